"""bench/gpu.py: the GPU plan's stages (bench/gpu.sh runs them all in one device call). Installs nothing.

    python bench/gpu.py time [--dry-run] [--budget S]   decode/prefill at batch 1: the 7B shape first (bf16, int8,
                                                        nf4, int4), then one-row linears, then the 1B shape
    python bench/gpu.py check [--dry-run]               correctness on CUDA against CPU float32, on a 4-layer model
                                                        of SmolLM2-135M's widths: every quant mode eager, one
                                                        compiled mode, two sampling kinds, lookup speculation, a
                                                        ragged batch, llm.int8
    python bench/gpu.py table FILE                      the JSON lines as BENCHMARKS.md rows

Every result is one JSON line appended to OUT/gpu.json (--out, default $OUT or /tmp/gpu-bench) as soon as it is
known, so a stage cut short by its time limit keeps what it measured. Each timed row builds its model, measures it,
then frees it (its steps, Dynamo's caches, the CUDA allocator's cache) and reports its own peak memory. --dry-run
runs the same plan on the CPU with the tiny shape, to find mistakes before a GPU's minutes are spent on them.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import sys
import time
import traceback

import torch


from dense_engine.cli import benchmark
from dense_engine.cpu import quantized
from dense_engine.runtime import caches, generate, speculative
from dense_engine.runtime import steps as steps_module
from dense_engine.system.errors import first_line

MODES = ("none", "int8", "nf4", "int4")  # the order rows are timed in: int4 last, measured in the first GPU run
TOLERANCE = 3e-2  # bfloat16 against float32, relative to the largest logit (the CPU tests' tolerance)
CHECK_SHAPE, CHECK_LAYERS = "smollm2-135m", 4  # its widths (GQA 9/3, head_dim 64), 4 layers: short compiles


class Plan:
    def __init__(self, args) -> None:
        self.device = torch.device("cpu" if args.dry_run else "cuda")
        self.dtype = torch.bfloat16
        os.makedirs(args.out, exist_ok=True)
        self.path = os.path.join(args.out, "gpu.json")
        self.failures = 0
        self.started = time.perf_counter()

    def record(self, **row) -> None:
        row.setdefault("device", benchmark.device_name(self.device))
        print(json.dumps(row), flush=True)
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
        if row.get("ok") is False:
            self.failures += 1

    def guarded(self, name: str, fn) -> float:
        """One check or timing; an exception is recorded as its result and the plan goes on. Returns its seconds."""
        start = time.perf_counter()
        try:
            fn()
        except Exception as e:
            self.record(check=name, ok=False, error=f"{type(e).__name__}: {str(e)[:300]}",
                        where=traceback.format_exc().strip().splitlines()[-3][:200])
        finally:
            free_device(self.device)
        seconds = time.perf_counter() - start
        print(f"# {name}: {seconds:.1f} s", file=sys.stderr, flush=True)
        return seconds


def free_device(device: torch.device) -> None:
    """What a finished row leaves behind goes: compiled graphs (and their CUDA graph pools), then the memory."""
    torch._dynamo.reset()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def on_device(model, plan: Plan, dtype=None):
    """A copy of a CPU model on the plan's device (Module.to works in place: the CPU model stays the reference)."""
    return copy.deepcopy(model).to(plan.device, dtype or plan.dtype)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float().cpu() - b.float().cpu()).abs().max() / b.float().abs().max())


def near_best(reference, rows, start: int) -> tuple[int, int]:
    """Greedy picks checked against a reference model: for each row of ids (a [T] tensor whose tokens from `start`
    on were generated), how many generated tokens the reference, fed the same ids without a cache, rates within
    TOLERANCE (relative to its largest logit) of its best token. A bfloat16 path may pick the other one of two
    near-equal tokens, and then the sequences go apart; every pick must still be one of the best."""
    good = total = 0
    ref_device = next(reference.parameters()).device
    for row in rows:
        row = row.reshape(-1).to(ref_device)
        with torch.no_grad():
            logits = reference(row[None, :-1])[0].float()  # [T - 1, V]: position p predicts row[p + 1]
        chosen = logits[start - 1:].gather(-1, row[start:, None])[:, 0]
        gap = logits[start - 1:].max(dim=-1).values - chosen
        good += int((gap <= TOLERANCE * logits.abs().max()).sum())
        total += len(gap)
    return good, total


def quantize(model, mode: str):
    return model if mode == "none" else quantized.quantize_model(model, mode)


# ----------------------------------------------------------------------------------------------------------------
# Stage: timing


def time_row(plan: Plan, shape: str, mode: str, runs: int, gen_len: int) -> None:
    free_device(plan.device)
    model = quantize(benchmark.random_model(shape, plan.device, plan.dtype), mode)  # built and quantized there
    try:
        result = benchmark.run_benchmark(model, batch=1, prompt_len=128, gen_len=gen_len, compile=True, runs=runs,
                                         peak_bw=None, quant=mode)
        result["peak_mem_bytes"] = benchmark.peak_memory(plan.device)  # this row's: weights, cache, activations
        plan.record(stage="time", model=shape, **result)
    finally:
        steps_module.forget(model)
        del model


def time_linears(plan: Plan, sizes: list[tuple[int, int]]) -> None:
    """One-row linears (a decode step's matmuls) alone: bfloat16, the int8 layer (compiled dequantize-and-matmul),
    aten._weight_int8pack_mm (the kernel it replaced), int4 through tinygemm; microseconds each."""
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
            int8_layer = torch.compile(q8, dynamic=False)  # (dynamic=False: each size its own static graph)
            scales16 = q8.scales.to(torch.bfloat16)
            cases = {"bf16": lambda: torch.nn.functional.linear(x, w), "int8 (layer, compiled)": lambda: int8_layer(x),
                     "int8 _weight_int8pack_mm": lambda: torch.ops.aten._weight_int8pack_mm(x, q8.weight, scales16),
                     "int4 (layer)": lambda: q4(x)}
            row = {}
            for name, fn in cases.items():
                try:
                    for _ in range(3):
                        fn()
                    benchmark.sync(dev)
                    start = time.perf_counter()
                    for _ in range(50):
                        fn()
                    benchmark.sync(dev)
                    row[name] = round((time.perf_counter() - start) / 50 * 1e6, 1)
                except (RuntimeError, NotImplementedError) as e:  # (an op this device lacks)
                    row[name] = f"unavailable: {first_line(e, 80)}"
            err = rel_err(int8_layer(x), torch.nn.functional.linear(x.float(), q8.dequantize(torch.float32)))
            plan.record(stage="linear", n=n, k=k, us=row, int8_rel_err=err, ok=err < TOLERANCE)
        plan.guarded(f"linear {n}x{k}", one)


def time_stage(plan: Plan, shapes: list[str], runs: int, gen_len: int, sizes, budget: float) -> None:
    """The rows in order while the budget lasts: a row starts only if the longest row so far still fits."""
    longest = 0.0
    rows = [(shapes[0], mode) for mode in MODES]
    rows += [("linears", None)] + [(shape, mode) for shape in shapes[1:] for mode in MODES]
    for shape, mode in rows:
        left = budget - (time.perf_counter() - plan.started)
        if left < longest:
            plan.record(stage="skipped", model=shape, quant=mode, why=f"{left:.0f} s of the budget left, a row took "
                                                                      f"up to {longest:.0f} s")
            continue
        if shape == "linears":
            spent = time.perf_counter()
            time_linears(plan, sizes)
            longest = max(longest, (time.perf_counter() - spent) / 2)
            continue
        longest = max(longest, plan.guarded(f"time {shape} {mode}",
                                            lambda s=shape, m=mode: time_row(plan, s, m, runs, gen_len)))


# ----------------------------------------------------------------------------------------------------------------
# Stage: correctness


def check(plan: Plan, shape: str, layers: int | None) -> torch.nn.Module:
    """Returns the CPU float32 reference model, which every check leaves as it was (on the CPU, in float32)."""
    dev = plan.device
    # weights that bfloat16 holds exactly: quantized from float32 or from bfloat16, the codes are the same
    base = benchmark.random_model(shape, "cpu", torch.bfloat16, layers).float()
    V = base.config.vocab_size
    ids = torch.randint(0, V, (2, 40), generator=torch.Generator().manual_seed(0))

    for mode in MODES:  # eager: logits of a model moved and of one quantized on the device; the cache
        def one_mode(mode=mode):
            cpu = quantize(copy.deepcopy(base), mode)
            with torch.no_grad():
                reference = cpu(ids)  # CPU float32, no cache
            moved = on_device(cpu, plan)  # quantized on the CPU, then moved: repacked for the device
            direct = quantize(on_device(base, plan), mode)  # quantized on the device
            for how, model in (("moved", moved), ("direct", direct)):
                with torch.no_grad():
                    err = rel_err(model(ids.to(dev)), reference)
                plan.record(check=f"{mode} {how}: logits vs CPU float32", value=err, ok=err < TOLERANCE)
            model = direct
            with torch.no_grad():  # the cache: a prefill of 30, then 10 single steps, against one pass without it
                full = model(ids.to(dev))
                caches.setup_cache(model, 2, 64)
                parts = [model(ids[:, :30].to(dev), input_pos=torch.arange(30, device=dev))]
                parts += [model(ids[:, p:p + 1].to(dev), input_pos=torch.tensor([p], device=dev)) for p in range(30, 40)]
            err = rel_err(torch.cat(parts, 1), full)
            plan.record(check=f"{mode}: cached vs no cache", value=err, ok=err < TOLERANCE)
        plan.guarded(f"mode {mode}", one_mode)

    def compiled():  # one compiled mode (int8: the fused dequantize-and-matmul) and the paths built on its steps
        model = quantize(on_device(base, plan), "int8")
        caches.setup_cache(model, 2, 256)
        steps = steps_module.Steps(model, saved=False)  # CUDA's path: compiled in this process
        cpu8 = quantize(copy.deepcopy(base), "int8")
        for name, use in (("eager", None), ("compiled", steps)):
            good, total = near_best(cpu8, generate.generate(model, ids[:, :20].to(dev), 16, steps=use), 20)
            plan.record(check=f"int8: {name} greedy picks near CPU's best", value=f"{good}/{total}", ok=good == total)
        prompt = torch.tensor([[5, 6, 7, 8] * 6], device=dev)
        out = speculative.generate(model, prompt, 24, speculative.LookupDraft(), steps=steps)
        good, total = near_best(cpu8, out, prompt.shape[1])
        plan.record(check="int8: speculative (lookup) greedy picks near CPU's best", value=f"{good}/{total}",
                    ok=good == total)
        rows = [ids[0, :25].tolist(), ids[1, :9].tolist()]
        for (row, new), start in zip(zip(rows, generate.generate(model, rows, 12, steps=steps)), (25, 9)):
            good, total = near_best(cpu8, [torch.cat([torch.tensor(row), new.cpu()])], start)
            plan.record(check=f"int8: ragged batch row of {start}: picks near CPU's best", value=f"{good}/{total}",
                        ok=good == total)
        steps_module.forget(model)
    plan.guarded("compiled int8", compiled)

    def sampling():
        """Two sampling kinds, compiled against eager with the same noise. In float32: bfloat16's different
        reductions would flip near-ties, and this checks the sampling inputs, not the rounding."""
        model = on_device(base, plan, torch.float32)
        prompt = ids[:1, :20].to(dev)
        steps = steps_module.Steps(model, saved=False)
        runs = {}
        for name, use in (("eager", None), ("compiled", steps)):
            caches.setup_cache(model, 1, 256)
            runner = generate.Runner(model, use)
            out = []
            for pos, setting in ((20, dict(temperature=0.0)), (21, dict(temperature=0.8, top_k=50)),
                                 (22, dict(temperature=0.0)), (23, dict(temperature=1.0, top_k=50))):
                sampling = generate.Sampling(**setting, generators=(torch.Generator(dev).manual_seed(pos),))
                out.append(int(runner.decode(prompt[:, -1:], pos, None, sampling)))
            runs[name] = out
        plan.record(check="float32 greedy and top-k sampling: compiled vs eager tokens", value=runs,
                    ok=runs["eager"] == runs["compiled"])
        steps_module.forget(model)
    plan.guarded("sampling", sampling)

    def llm_int8():
        try:
            quantized.import_bitsandbytes()
        except ImportError:
            plan.record(check="llm.int8", ok=None, skipped="bitsandbytes is not installed here")
            return
        cpu = quantize(copy.deepcopy(base), "int8")
        with torch.no_grad():
            reference = cpu(ids)
            model8 = quantize(on_device(base, plan, torch.float16 if dev.type == "cuda" else torch.float32), "llm.int8")
            err = rel_err(model8(ids.to(dev)), reference)
        plan.record(check="llm.int8 logits vs CPU int8 float32", value=err, ok=err < 5e-2)
    plan.guarded("llm.int8", llm_int8)
    return base


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
        elif r.get("stage") == "skipped":
            print(f"skipped {r['model']} {r['quant'] or ''}: {r['why']}")
        elif "check" in r and r.get("ok") is not True:
            print(f"check {r['check']}: {r.get('ok')} {r.get('value', '')} {r.get('error', r.get('skipped', ''))}")
    checks = [r for r in rows if "check" in r]
    print(f"checks: {sum(r.get('ok') is True for r in checks)} passed, {sum(r.get('ok') is False for r in checks)} "
          f"failed")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("stage", choices=("check", "time", "table"))
    p.add_argument("file", nargs="?", help="table: the gpu.json to print")
    p.add_argument("--dry-run", action="store_true", help="the whole plan on the CPU with a tiny shape")
    p.add_argument("--out", default=os.environ.get("OUT", "/tmp/gpu-bench"))
    p.add_argument("--shapes", default="llama-2-7b,llama-3.2-1b", help="time: the shapes, comma-separated; the "
                                                                       "first is timed first in every mode")
    p.add_argument("--budget", type=float, default=270, help="time: seconds; no row starts that would not fit")
    args = p.parse_args(argv)
    if args.stage == "table":
        table(args.file or os.path.join(args.out, "gpu.json"))
        return 0
    if not args.dry_run and not torch.cuda.is_available():
        print("no CUDA device here (--dry-run runs the plan on the CPU)", file=sys.stderr)
        return 2
    plan = Plan(args)
    if args.stage == "check":
        check(plan, "tiny", None) if args.dry_run else check(plan, CHECK_SHAPE, CHECK_LAYERS)
    elif args.dry_run:
        time_stage(plan, ["tiny", "tiny"], runs=1, gen_len=8, sizes=[(64, 256)], budget=args.budget)
    else:
        time_stage(plan, args.shapes.split(","), runs=2, gen_len=128,
                   sizes=[(4096, 4096), (11008, 4096), (4096, 11008)], budget=args.budget)
    print(f"{plan.failures} failed", file=sys.stderr)
    return 1 if plan.failures else 0


if __name__ == "__main__":
    sys.exit(main())
