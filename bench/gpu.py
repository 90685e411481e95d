"""bench/gpu.py: the GPU plan, in stages that each fit one device call (bench/gpu.sh runs them). Installs nothing.

    python bench/gpu.py check [--dry-run]     correctness on CUDA of every mode and path, against CPU float32
    python bench/gpu.py time [--dry-run]      decode/prefill at batch 1, 1B- and 7B-class shapes, each quant mode
    python bench/gpu.py table FILE            the JSON lines of `time` as BENCHMARKS.md rows

Every result is one JSON line appended to OUT/gpu.json (--out, default /tmp/gpu-bench) as soon as it is known, so
a stage cut short by its time limit keeps what it measured. --dry-run runs the same plan on the CPU with a tiny
shape (the `tiny` benchmark shape), to find mistakes before a GPU's minutes are spent on them.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import benchmark  # noqa: E402
import generate  # noqa: E402
import quantized  # noqa: E402
import speculative  # noqa: E402
from steps import Steps  # noqa: E402

MODES = ("none", "int8", "int4", "nf4")
TOLERANCE = 3e-2  # bfloat16 against float32, relative to the largest logit


class Plan:
    def __init__(self, args) -> None:
        self.device = torch.device("cpu" if args.dry_run else "cuda")
        self.dtype = torch.bfloat16
        os.makedirs(args.out, exist_ok=True)
        self.path = os.path.join(args.out, "gpu.json")
        self.failures = 0

    def record(self, **row) -> None:
        row.setdefault("device", benchmark.device_name(self.device))
        print(json.dumps(row), flush=True)
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
        if row.get("ok") is False:
            self.failures += 1

    def guarded(self, name: str, fn) -> None:
        """One check or timing; an exception is recorded as its result and the plan goes on."""
        start = time.perf_counter()
        try:
            fn()
        except Exception as e:
            self.record(check=name, ok=False, error=f"{type(e).__name__}: {str(e)[:300]}",
                        where=traceback.format_exc().strip().splitlines()[-3][:200])
        finally:
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            print(f"# {name}: {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float().cpu() - b.float().cpu()).abs().max() / b.float().abs().max())


def near_best(reference, rows, start: int) -> tuple[int, int]:
    """Greedy picks checked against a reference model: for each row of ids (a [T] tensor whose tokens from `start`
    on were generated), how many generated tokens the reference, fed the same ids without a cache, rates within
    TOLERANCE (relative to its largest logit) of its best token. A bfloat16 path may pick the other one of two
    near-equal tokens, and then the sequences go apart; every pick must still be one of the best."""
    good = total = 0
    for row in rows:
        row = row.cpu().reshape(-1)
        with torch.no_grad():
            logits = reference(row[None, :-1])[0].float()  # [T - 1, V]: position p predicts row[p + 1]
        chosen = logits[start - 1:].gather(-1, row[start:, None])[:, 0]
        gap = logits[start - 1:].max(dim=-1).values - chosen
        good += int((gap <= TOLERANCE * logits.abs().max()).sum())
        total += len(gap)
    return good, total


def lazy_steps(model) -> Steps:
    return Steps(model, saved=False)  # CUDA's path (the default there); on a dry run the same, on the CPU


def quantize(model, mode: str):
    return model if mode == "none" else quantized.quantize_model(model, mode)


# ----------------------------------------------------------------------------------------------------------------
# Stage a: correctness


def check(plan: Plan, shape: str) -> None:
    dev, dtype = plan.device, plan.dtype
    # weights that bfloat16 holds exactly: quantized from float32 or from bfloat16, the codes are the same
    base = benchmark.random_model(shape, "cpu", torch.bfloat16).float()
    V = base.config.vocab_size
    ids = torch.randint(0, V, (2, 40), generator=torch.Generator().manual_seed(0))
    for mode in MODES:
        def one_mode(mode=mode):
            cpu = quantize(copy.deepcopy(base), mode)
            with torch.no_grad():
                reference = cpu(ids)  # CPU float32, no cache
            moved = copy.deepcopy(cpu).to(dev, dtype)  # quantized on the CPU, then moved: repacked for the device
            direct = quantize(copy.deepcopy(base).to(dev, dtype), mode)  # quantized on the device
            for how, model in (("moved", moved), ("direct", direct)):
                with torch.no_grad():
                    full = model(ids.to(dev))
                plan.record(check=f"{mode} {how}: logits vs CPU float32", value=rel_err(full, reference),
                            ok=rel_err(full, reference) < TOLERANCE)
            model = direct
            with torch.no_grad():  # the cache: a prefill of 30, then 10 single steps, against one pass without it
                full = model(ids.to(dev))
                generate.setup_cache(model, 2, 64)
                parts = [model(ids[:, :30].to(dev), input_pos=torch.arange(30, device=dev))]
                parts += [model(ids[:, p:p + 1].to(dev), input_pos=torch.tensor([p], device=dev)) for p in range(30, 40)]
            err = rel_err(torch.cat(parts, 1), full)
            plan.record(check=f"{mode}: cached vs no cache", value=err, ok=err < TOLERANCE)
            prompt = ids[:, :20].to(dev)
            for name, steps in (("eager", None), ("compiled", lazy_steps(model))):
                good, total = near_best(cpu, generate.generate(model, prompt, 16, steps=steps), 20)
                plan.record(check=f"{mode}: {name} greedy picks near CPU float32's best", value=f"{good}/{total}",
                            ok=good == total)
        plan.guarded(f"mode {mode}", one_mode)

    model = base.to(dev, dtype)
    steps = lazy_steps(model)

    def sampling():
        prompt = ids[:1, :20].to(dev)
        seeded = lambda: (torch.Generator(dev).manual_seed(1),)  # noqa: E731
        runs = {}
        for name, use in (("eager", None), ("compiled", steps)):
            generate.setup_cache(model, 1, 1024)
            runner = generate.Runner(model, use)
            out = []
            for pos, setting in ((20, dict(temperature=0.8, top_k=50)), (300, dict(temperature=0.7)),
                                 (700, dict(temperature=0.0)), (701, dict(temperature=1.0, top_p=0.9))):
                token = runner.decode(prompt[:, -1:], pos, None, generate.Sampling(**setting, generators=seeded()))
                out.append(int(token))
            runs[name] = out
        plan.record(check="sampling kinds x buckets: compiled vs eager tokens", value=runs,
                    ok=runs["eager"] == runs["compiled"])
    plan.guarded("sampling", sampling)

    def speculation():
        prompt = torch.tensor([[5, 6, 7, 8] * 6], device=dev)
        for name, draft in (("lookup", speculative.LookupDraft()),
                            ("int8 self-draft", speculative.ModelDraft(speculative.quantized_copy(model, "int8")))):
            out = speculative.generate(model, prompt, 24, draft, steps=steps)
            good, total = near_best(base, out, prompt.shape[1])
            plan.record(check=f"speculative ({name}) greedy picks near CPU float32's best", value=f"{good}/{total}",
                        ok=good == total)
        out = speculative.generate(model, prompt, 24, speculative.LookupDraft(), temperature=1.0)  # one-hot q
        plan.record(check="speculative sampling (lookup) runs on the device", value=out.shape[1] - prompt.shape[1],
                    ok=out.shape[1] == prompt.shape[1] + 24)
    plan.guarded("speculative", speculation)

    def batch():
        rows = [ids[0, :25].tolist(), ids[1, :9].tolist()]
        together = generate.generate(model, rows, 12, steps=steps)
        for (row, new), start in zip(zip(rows, together), (25, 9)):
            good, total = near_best(base, [torch.cat([torch.tensor(row), new.cpu()])], start)
            plan.record(check=f"ragged batch row of {start}: picks near CPU float32's best", value=f"{good}/{total}",
                        ok=good == total)
    plan.guarded("batch", batch)

    def llm_int8():
        try:
            quantized.import_bitsandbytes()
        except ImportError:
            plan.record(check="llm.int8", ok=None, skipped="bitsandbytes is not installed here")
            return
        cpu = quantize(copy.deepcopy(base), "int8")
        with torch.no_grad():
            reference = cpu(ids)
            model8 = quantize(copy.deepcopy(base).to(dev, torch.float16 if dev.type == "cuda" else torch.float32), "llm.int8")
            err = rel_err(model8(ids.to(dev)), reference)
        plan.record(check="llm.int8 logits vs CPU int8 float32", value=err, ok=err < 5e-2)
    plan.guarded("llm.int8", llm_int8)


# ----------------------------------------------------------------------------------------------------------------
# Stage b: timing


def time_shapes(plan: Plan, shapes: list[str], runs: int, gen_len: int) -> None:
    for shape in shapes:
        for mode in MODES:
            def one(shape=shape, mode=mode):
                model = quantize(benchmark.random_model(shape, plan.device, plan.dtype), mode)  # on the device
                result = benchmark.run_benchmark(model, batch=1, prompt_len=128, gen_len=gen_len, compile=True,
                                                 runs=runs, peak_bw=None, quant=mode)
                plan.record(stage="time", model=shape, **result)
            plan.guarded(f"time {shape} {mode}", one)


def time_linears(plan: Plan, sizes: list[tuple[int, int]]) -> None:
    """One-row linears (a decode step's matmuls) alone: bfloat16, int8 through _weight_int8pack_mm and as a compiled
    dequantize-and-matmul, int4 through tinygemm; microseconds each, to choose the int8 path with numbers."""
    dev = plan.device
    for n, k in sizes:
        def one(n=n, k=k):
            w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02
            x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
            q8, q4 = quantized.Int8Linear(k, n, False), quantized.Int4Linear(k, n, False, group_size=128)
            for layer in (q8, q4):
                for key, t in layer.stored(w, group_size=128).items():
                    layer._buffers[key] = t.to(dev)
                layer.finish_loading()
            dequant = torch.compile(lambda x: torch.nn.functional.linear(x, q8.weight.to(x.dtype)) *
                                    q8.scales.to(x.dtype))
            cases = {"bf16": lambda: torch.nn.functional.linear(x, w), "int8 (layer)": lambda: q8(x),
                     "int8 compiled dequant": lambda: dequant(x), "int4 (layer)": lambda: q4(x)}
            row = {}
            for name, fn in cases.items():
                for _ in range(3):
                    fn()
                benchmark.sync(dev)
                start = time.perf_counter()
                for _ in range(50):
                    fn()
                benchmark.sync(dev)
                row[name] = round((time.perf_counter() - start) / 50 * 1e6, 1)
            plan.record(stage="linear", n=n, k=k, us=row)
        plan.guarded(f"linear {n}x{k}", one)


# ----------------------------------------------------------------------------------------------------------------


def table(path: str) -> None:
    rows = [json.loads(line) for line in open(path) if line.strip()]
    timed = [r for r in rows if r.get("stage") == "time"]
    base = {r["model"]: r["decode_tok_s"] for r in timed if r["quant"] == "none"}
    print("| shape | quant | decode tok/s | x bf16 | GB/s | MBU | prefill tok/s (128) | compile s | peak GiB |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in timed:
        ratio = r["decode_tok_s"] / base[r["model"]] if r["model"] in base else float("nan")
        mbu = f"{r['mbu'] * 100:.0f}%" if r.get("mbu") else "-"
        print(f"| {r['model']} | {r['quant']} | {r['decode_tok_s']:.1f} | {ratio:.2f} | {r['bandwidth_gbs']:.0f} | "
              f"{mbu} | {r['prefill_tok_s']:.0f} | {r['compile_s']:.1f} | {r['peak_mem_bytes'] / 2**30:.1f} |")
    for r in rows:
        if r.get("stage") == "linear":
            print(f"linear {r['n']}x{r['k']} (1 row), us: {r['us']}")
        elif "check" in r and r.get("ok") is not True:
            print(f"check {r['check']}: {r.get('ok')} {r.get('value', '')} {r.get('error', r.get('skipped', ''))}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("stage", choices=("check", "time", "table"))
    p.add_argument("file", nargs="?", help="table: the gpu.json to print")
    p.add_argument("--dry-run", action="store_true", help="the whole plan on the CPU with a tiny shape")
    p.add_argument("--out", default=os.environ.get("OUT", "/tmp/gpu-bench"))
    p.add_argument("--shapes", default="llama-3.2-1b,llama-2-7b", help="time: the shapes, comma-separated")
    args = p.parse_args(argv)
    if args.stage == "table":
        table(args.file or os.path.join(args.out, "gpu.json"))
        return 0
    if not args.dry_run and not torch.cuda.is_available():
        print("no CUDA device here (--dry-run runs the plan on the CPU)", file=sys.stderr)
        return 2
    plan = Plan(args)
    if args.stage == "check":
        check(plan, "tiny" if args.dry_run else "smollm2-135m")
    else:
        time_shapes(plan, ["tiny"] if args.dry_run else args.shapes.split(","), runs=1 if args.dry_run else 3,
                    gen_len=8 if args.dry_run else 128)
        time_linears(plan, [(64, 256)] if args.dry_run else [(4096, 4096), (11008, 4096), (4096, 11008)])
    print(f"{plan.failures} failed", file=sys.stderr)
    return 1 if plan.failures else 0


if __name__ == "__main__":
    sys.exit(main())
