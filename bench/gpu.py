"""bench/gpu.py: the GPU plan (bench/gpu.sh runs it in one device call). Installs nothing.

    python bench/gpu.py probe [--dry-run]          the memory's rate: an 8 GB copy and a sum
    python bench/gpu.py rows [--dry-run] [--budget S] [--workers N] [--only NAME,...]
                                                   every row, each in its own process: they compile side by side
                                                   (one Inductor cache, 2 compile threads each) and measure one at a
                                                   time (a lock on OUT/gpu.lock); a row starts while the GPU's
                                                   memory holds it and ends within the budget, else is recorded cut
    python bench/gpu.py row NAME [--dry-run]       one row (what `rows` starts): "linears", "decode MODE bBATCH"
                                                   (MODE: bf16, int8, int4-g32, int4-g128, nf4, fp8), "server",
                                                   "check", "tests"
    python bench/gpu.py check [--dry-run]          correctness on CUDA against CPU float32 (the "check" row)
    python bench/gpu.py table FILE                 the JSON lines as BENCHMARKS.md rows
    python bench/gpu.py results FILE               the rows as bench/results/gpu-<card>.json (mode, group, batch,
                                                   decode_tok_s, bytes_per_token, mbu, probe_gb_s; cuda_tests)

A decode row (Llama-2-7B's shape, random bfloat16 weights, quantized on the device): batch-1 or batch-8 decode of 128
tokens after a 128-token prompt through the compiled steps (CUDA graphs), bytes a token (weights and the KV cache
its steps read), MBU against the datasheet and against the probe, prefill of 128 and 2,048 tokens, Inductor's
CUDA-graph skip count, and a profile of 16 decode steps (kernel time by kind, idle time, the top kernels). Every
result is one JSON line appended to OUT/gpu.json (--out, default $OUT or /tmp/gpu-bench) as soon as it is known.
--dry-run runs the same plan on the CPU with the tiny shape, to find mistakes before a GPU's minutes are spent.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import fcntl
import gc
import json
import os
import re
import shutil
import subprocess
import sys
import time
import traceback

import torch

from dense_engine.cli import benchmark
from dense_engine.cpu import quantized
from dense_engine.runtime import caches, generate, speculative
from dense_engine.runtime import steps as steps_module
from dense_engine.system.errors import first_line

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODES = ("none", "int8", "nf4", "int4", "fp8")  # check's modes
DECODE_MODES = ("bf16", "int8", "int4-g32", "int4-g128", "nf4", "fp8")
TOLERANCE = 3e-2  # bfloat16 against float32, relative to the largest logit (the CPU tests' tolerance)
FP8_TOLERANCE = 1e-1  # fp8 on a GPU with float8 matmuls quantizes the activations too (e4m3: 3 mantissa bits)
CHECK_SHAPE, CHECK_LAYERS = "smollm2-135m", 4  # its widths (GQA 9/3, head_dim 64), 4 layers: short compiles
SHAPE, DRY_SHAPE = "llama-2-7b", "tiny"
CUDA_TESTS = "tests/test_cuda.py"
# Rows in the order they start (the longest first) and the GPU memory each holds at most, GiB (7B shape).
ROWS = {"server": 20, "decode bf16 b1": 16, "decode int8 b1": 10, "decode int4-g32 b1": 7, "decode int4-g128 b1": 7,
        "decode nf4 b1": 7, "decode fp8 b1": 10, "decode bf16 b8": 20, "decode int8 b8": 13, "linears": 3,
        "check": 4, "tests": 4}


class Plan:
    def __init__(self, args) -> None:
        self.dry = args.dry_run
        self.device = torch.device("cpu" if args.dry_run else "cuda")
        self.dtype = torch.bfloat16
        self.out = args.out
        os.makedirs(args.out, exist_ok=True)
        self.path = os.path.join(args.out, "gpu.json")
        self.failures = 0
        self.started = time.perf_counter()

    def record(self, **row) -> None:
        row.setdefault("device", benchmark.device_name(self.device))
        print(json.dumps(row), flush=True)
        with open(self.path, "a") as f:  # (one write of one line: rows of processes side by side stay whole)
            f.write(json.dumps(row) + "\n")
        if row.get("ok") is False:
            self.failures += 1

    def guarded(self, name: str, fn) -> float:
        """One check or timing; an exception is recorded as its result and the plan goes on. Returns its seconds."""
        start = time.perf_counter()
        try:
            fn()
        except Exception as e:  # noqa: BLE001 (any failure is the check's result, recorded; the plan goes on)
            self.record(check=name, ok=False, error=f"{type(e).__name__}: {str(e)[:300]}",
                        where=traceback.format_exc().strip().splitlines()[-3][:200])
        finally:
            free_device(self.device)
        seconds = time.perf_counter() - start
        print(f"# {name}: {seconds:.1f} s", file=sys.stderr, flush=True)
        return seconds

    @contextlib.contextmanager
    def measuring(self):
        """The GPU to this process alone while it measures: rows of other processes wait (they compile meanwhile)."""
        with open(os.path.join(self.out, "gpu.lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def probe(self) -> float | None:
        if not os.path.exists(self.path):
            return None
        with open(self.path) as f:
            rows = [json.loads(line) for line in f if '"probe"' in line]
        return rows[-1]["probe_gb_s"] if rows else None


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


def quantize(model, mode: str, group: int = 32):
    """mode as check names them (none, int8, ...) or as a decode row does (bf16, int4-g128, ...)."""
    mode, _, size = mode.partition("-g")
    return model if mode in ("none", "bf16") else quantized.quantize_model(model, mode, int(size or group))


# ----------------------------------------------------------------------------------------------------------------
# The probe: what the memory gives a plain read and a copy


def probe(plan: Plan) -> None:
    dev = plan.device
    n = (64 << 20) if plan.dry else (8 << 30)  # bytes
    x = torch.empty(n // 4, dtype=torch.float32, device=dev).uniform_()
    y = torch.empty_like(x)
    rates = {}
    for name, fn, moved in (("copy", lambda: y.copy_(x), 2 * n), ("sum", lambda: x.sum(), n)):
        fn()
        benchmark.sync(dev)
        start = time.perf_counter()
        for _ in range(5):
            fn()
        benchmark.sync(dev)
        rates[name] = moved * 5 / (time.perf_counter() - start) / 1e9
    plan.record(stage="probe", bytes=n, copy_gb_s=round(rates["copy"], 1), sum_gb_s=round(rates["sum"], 1),
                probe_gb_s=round(max(rates.values()), 1))


# ----------------------------------------------------------------------------------------------------------------
# Rows: each in its own process (`row NAME`), started by `rows`


def run_rows(plan: Plan, names: list[str], budget: float, workers: int) -> None:
    """Start each row's process while fewer than `workers` run and the GPU's free memory holds its need; end the
    ones still running when the budget is spent (recorded cut), record the ones never started (skipped)."""
    memory = (torch.cuda.mem_get_info()[1] / 2**30 * 0.85) if not plan.dry else float("inf")
    env = {**os.environ, "TORCHINDUCTOR_COMPILE_THREADS": "2", "OMP_NUM_THREADS": "2",
           "TORCHINDUCTOR_CACHE_DIR": os.environ.get("TORCHINDUCTOR_CACHE_DIR", os.path.join(plan.out, "inductor"))}
    pending, running = list(names), {}
    while pending or running:
        left = budget - (time.perf_counter() - plan.started)
        for name in list(pending):
            held = sum(ROWS[n] for n in running)
            if len(running) >= workers or held + ROWS[name] > memory or left < 30:
                break
            log = open(os.path.join(plan.out, f"row-{name.replace(' ', '-')}.log"), "w")  # noqa: SIM115 (closed below)
            cmd = [sys.executable, os.path.abspath(__file__), "row", name, "--out", plan.out]
            running[name] = (subprocess.Popen(cmd + (["--dry-run"] if plan.dry else []), stdout=log,
                                              stderr=subprocess.STDOUT, env=env, cwd=ROOT), log, time.perf_counter())
            pending.remove(name)
            print(f"# started {name}", file=sys.stderr, flush=True)
        for name, (process, log, began) in list(running.items()):
            if process.poll() is None and left > 0:
                continue
            if process.poll() is None:
                process.kill()
                process.wait()
                plan.record(stage="cut", row=name, ok=False, why=f"running at the budget's end ({budget:.0f} s)")
            elif process.returncode:
                plan.record(stage="crashed", row=name, ok=False, exit=process.returncode, log=log_tail(log.name))
            log.close()
            del running[name]
            print(f"# {name}: {time.perf_counter() - began:.0f} s", file=sys.stderr, flush=True)
        if left <= 0:
            for name in pending:
                plan.record(stage="skipped", row=name, why="the budget was spent before it could start")
            break
        time.sleep(0.5)


def log_tail(path: str, lines: int = 3) -> str:
    with open(path, errors="replace") as f:
        return " | ".join(line.strip() for line in f.readlines()[-lines:])[:600]


def run_row(plan: Plan, name: str) -> None:
    if name == "check":
        check(plan, "tiny", None) if plan.dry else check(plan, CHECK_SHAPE, CHECK_LAYERS)
    elif name == "tests":
        cuda_tests(plan)
    elif name == "server":
        plan.guarded(name, lambda: server_row(plan))
    elif name == "linears":
        time_linears(plan, [(64, 256)] if plan.dry else [(4096, 4096), (11008, 4096), (4096, 11008)])
    else:
        _, mode, batch = name.split()
        plan.guarded(name, lambda: decode_row(plan, mode, int(batch[1:])))


def decode_row(plan: Plan, mode: str, batch: int) -> None:
    """Warm (compile) alone, then measure under the lock: decode, prefill 128 and 2,048, a profile."""
    shape, gen_len = (DRY_SHAPE, 8) if plan.dry else (SHAPE, 128)
    long_prompt = 96 if plan.dry else 2048
    model = quantize(benchmark.random_model(shape, plan.device, plan.dtype), mode)  # built and quantized there
    counters = torch._dynamo.utils.counters
    try:
        def measure(prompt_len: int, gen: int, runs: int) -> dict:
            return benchmark.run_benchmark(model, batch=batch, prompt_len=prompt_len, gen_len=gen, compile=True,
                                           runs=runs, peak_bw=None, quant=mode)
        measure(128, gen_len, 1)  # (compiles every step and bucket the measured runs reach)
        if batch == 1:
            measure(long_prompt, 2, 1)
        with plan.measuring():
            result = measure(128, gen_len, 2)
            long = measure(long_prompt, 2, 1) if batch == 1 else {}
            profile = decode_profile(model, batch, 16 if not plan.dry else 4)
        kv = caches.cache_bytes(model, batch, result["attended_len"])
        probe_rate = plan.probe()
        mode_name, _, group = mode.partition("-g")
        plan.record(stage="decode", model=shape, mode=mode_name, group=int(group) if group else None, batch=batch,
                    decode_tok_s=result["decode_tok_s"], ms_per_step=result["ms_per_step"],
                    weight_bytes=result["bytes_per_token"], kv_bytes=kv, bytes_per_token=result["bytes_per_token"] + kv,
                    gb_s=(result["bytes_per_token"] + kv) * 1000 / result["ms_per_step"] / 1e9,
                    mbu=((result["bytes_per_token"] + kv) * 1000 / result["ms_per_step"] / 1e9 /
                         result["peak_bw_gbs"]) if result["peak_bw_gbs"] else None,
                    peak_bw_gbs=result["peak_bw_gbs"], probe_gb_s=probe_rate,
                    mbu_probe=((result["bytes_per_token"] + kv) * 1000 / result["ms_per_step"] / 1e9 / probe_rate)
                    if probe_rate else None,
                    prefill_128_tok_s=result["prefill_tok_s"], prefill_long=long_prompt if long else None,
                    prefill_long_tok_s=long.get("prefill_tok_s"), compile_s=result["compile_s"],
                    cudagraph_skips=int(counters["inductor"].get("cudagraph_skips", 0)), profile=profile,
                    peak_mem_bytes=benchmark.peak_memory(plan.device), ok=True)
    finally:
        steps_module.forget(model)
        model = None  # (its memory goes now, even while a traceback holds this frame)


def decode_profile(model, batch: int, steps: int) -> dict:
    """Kernel time a decode step by kind, the step's idle time (no kernel running), the top kernels: `steps` decode
    steps after a prefill, through the compiled steps, under torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    device = model.device
    cuda = device.type == "cuda"
    prompt = benchmark.prompts(model, batch, (128, 128), seed=5)
    tokens = generate.generate_tokens(model, prompt, steps + 1, steps=steps_module.steps_for(model))
    next(tokens).cpu()  # the prefill, outside the window
    benchmark.sync(device)
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        for _ in tokens:
            pass
        benchmark.sync(device)
        wall_us = (time.perf_counter() - start) * 1e6
    kind = torch.autograd.DeviceType.CUDA if cuda else torch.autograd.DeviceType.CPU
    events = [e for e in prof.events() if e.device_type == kind and (cuda or e.cpu_parent is None)]
    spans = sorted((e.time_range.start, e.time_range.end) for e in events)
    busy, end = 0.0, None
    for a, b in spans:  # the union of the kernels' intervals
        if end is None or a > end:
            busy += b - a
            end = b
        elif b > end:
            busy += b - end
            end = b
    by_kind, by_name = {}, {}
    for e in events:
        us = e.time_range.end - e.time_range.start
        by_kind[kernel_kind(e.name)] = by_kind.get(kernel_kind(e.name), 0.0) + us
        by_name[e.name] = by_name.get(e.name, 0.0) + us
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:5]
    return {"steps": steps, "wall_ms_per_step": round(wall_us / steps / 1000, 3),
            "kernel_ms_per_step": {k: round(v / steps / 1000, 3) for k, v in sorted(by_kind.items())},
            "idle_ms_per_step": round(max(0.0, wall_us - busy) / steps / 1000, 3), "kernels_per_step": len(events) //
            steps, "top": [[name[:80], round(us / steps / 1000, 3)] for name, us in top]}


def kernel_kind(name: str) -> str:
    n = name.lower()
    for kind, pattern in (("matmul", (r"gemm|gemv|matmul|tinygemm|int4pack|int8pack|cutlass|scaled_mm|\bmm\b|addmm|"
                                      r"linear|nvjet|sm90_|splitk")),
                          ("attention", r"flash|attention|sdpa|fmha|softmax"),
                          ("copy", r"copy|memcpy|memset|cat|index|fill|scatter"),
                          ("fused (Inductor)", r"^triton|cpp_fused")):
        if re.search(pattern, n):
            return kind
    return "other"


def time_linears(plan: Plan, sizes: list[tuple[int, int]]) -> None:
    """One-row linears (a decode step's matmuls) alone, each mode's layer compiled and its calls captured in one
    CUDA graph (replayed: no launch gaps): microseconds a call and the weight bytes read a second. int4 both ways:
    tinygemm (the layer's kernel) and dequantized into the matmul."""
    dev = plan.device
    for n, k in sizes:
        def one(n=n, k=k):
            w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02
            x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
            layers = {"bf16": torch.nn.Linear(k, n, bias=False, device=dev, dtype=torch.bfloat16)}
            layers["bf16"].weight.data = w
            stored = {"bf16": w.numel() * w.element_size()}  # bytes a call reads
            for mode in DECODE_MODES[1:]:
                name, _, group = mode.partition("-g")
                layer = quantized.LINEARS[name](k, n, False, group_size=int(group or 32))
                tensors = layer.stored(w, group_size=int(group or 32))
                for key, t in tensors.items():
                    layer._buffers[key] = t.to(dev)
                layer.finish_loading()
                layers[mode], stored[mode] = layer, sum(t.numel() * t.element_size() for t in tensors.values())
                if name == "int4":  # the other way to run it: dequantized into the matmul (compiled), no tinygemm
                    plain = copy.deepcopy(layer)
                    for key in [k for k in plain._buffers if k.startswith("kernel_")]:
                        del plain._buffers[key]
                    layers[f"{mode} dequantized"], stored[f"{mode} dequantized"] = plain, stored[mode]
            row, errors, compiled = {}, {}, {}
            for mode, layer in layers.items():  # compiled while other rows measure
                try:
                    compiled[mode] = torch.compile(layer, dynamic=False)  # (each size its own static graph)
                    with torch.no_grad():
                        reference = torch.nn.functional.linear(x.float(), layer.weight.float() if mode == "bf16" else
                                                               layer.dequantize(torch.float32))
                        errors[mode] = rel_err(compiled[mode](x), reference)
                except (RuntimeError, NotImplementedError) as e:  # (an op this device lacks)
                    row[mode] = f"unavailable: {first_line(e, 80)}"
            with plan.measuring(), torch.no_grad():
                row.update({mode: graph_time(fn, x, dev) for mode, fn in compiled.items()})
            plan.record(stage="linear", n=n, k=k, us=row, gb_s={m: round(stored[m] / us / 1e3, 1) for m, us in
                                                                 row.items() if isinstance(us, float)},
                        rel_err=errors, ok=all(e < (FP8_TOLERANCE if m == "fp8" else TOLERANCE)
                                               for m, e in errors.items()))
        plan.guarded(f"linear {n}x{k}", one)


def graph_time(fn, x: torch.Tensor, device: torch.device, calls: int = 50) -> float:
    """Microseconds a call: `calls` calls captured in one CUDA graph and replayed (on the CPU: a plain loop)."""
    if device.type == "cuda":
        side = torch.cuda.Stream(device)  # (warmed on a side stream, as a capture wants)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(3):
                fn(x)
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(calls):
                fn(x)
        graph.replay()
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        graph.replay()
        torch.cuda.synchronize(device)
    else:
        for _ in range(3):
            fn(x)
        start = time.perf_counter()
        for _ in range(calls):
            fn(x)
    return round((time.perf_counter() - start) / calls * 1e6, 2)


def server_row(plan: Plan) -> None:
    """serve.py on a random checkpoint of the 7B shape (the test tokenizer's 512-token vocabulary), bfloat16, 8 rows:
    its generated tokens a second at 1 and 8 clients (bench/serve_load.py's streamed chat load)."""
    try:
        import serve_load  # (bench/: the openai client's load)
    except ImportError as e:
        plan.record(stage="server", ok=None, skipped=f"{first_line(e)}")
        return
    from dense_engine.formats import convert, load

    shape, seconds = (DRY_SHAPE, 8) if plan.dry else (SHAPE, 20)
    folder = os.path.join(plan.out, "server-checkpoint")
    model = benchmark.random_model(shape, plan.device, plan.dtype, vocab=512)
    tensors = {k: v.cpu().contiguous() for k, v in load.checkpoint_tensors(model).items()}
    config = model.config
    del model
    free_device(plan.device)
    convert.write_native(folder, config, tensors, torch.bfloat16)
    del tensors
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(ROOT, "tests", "fixtures", "llama", name), folder)
    args = argparse.Namespace(root=ROOT, max_batch=8, quant="none", ctx=1024, serve_flag=[], gguf=folder)
    process, port = serve_load.start("dense", args)
    try:
        asyncio.run(serve_load.load(port, 8, seconds, 32, requests=16))  # (warm: the batch's steps compiled)
        with plan.measuring():
            for clients in (1, 8):
                result = asyncio.run(serve_load.load(port, clients, seconds, 128))
                plan.record(stage="server", model=shape, vocab=512, **result, ok=result["requests"] > 0)
    finally:
        process.terminate()
        process.wait(timeout=60)
        shutil.rmtree(folder, ignore_errors=True)


def cuda_tests(plan: Plan) -> None:
    """The CUDA tests, each line kept (OUT/cuda-tests.txt); the dry run only collects them."""
    cmd = [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", CUDA_TESTS]
    if plan.dry:
        cmd.append("--collect-only")
    path = os.path.join(plan.out, "cuda-tests.txt")
    with open(path, "w") as f:
        code = subprocess.call(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT)
    with open(path, errors="replace") as f:
        text = f.read()
    passed, failed = len(re.findall(r" PASSED", text)), len(re.findall(r" (?:FAILED|ERROR)", text))
    collected = len(re.findall(r"<Function ", text))
    plan.record(stage="tests", passed=passed, failed=failed, collected=collected or None, exit=code,
                ok=code == 0 if not plan.dry else collected > 0)


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
                plan.record(check=f"{mode} {how}: logits vs CPU float32", value=err,
                            ok=err < (FP8_TOLERANCE if mode == "fp8" else TOLERANCE))
            model = direct
            with torch.no_grad():  # the cache: a prefill of 30, then 10 single steps, against one pass without it
                full = model(ids.to(dev))
                caches.setup_cache(model, 2, 64)
                parts = [model(ids[:, :30].to(dev), input_pos=torch.arange(30, device=dev))]
                parts += [model(ids[:, p:p + 1].to(dev), input_pos=torch.tensor([p], device=dev))
                          for p in range(30, 40)]
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
            for pos, setting in ((20, {"temperature": 0.0}), (21, {"temperature": 0.8, "top_k": 50}),
                                 (22, {"temperature": 0.0}), (23, {"temperature": 1.0, "top_k": 50})):
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


def read_rows(path: str) -> list[dict]:
    return [json.loads(line) for line in open(path) if line.strip()]


def table(path: str) -> None:
    rows = read_rows(path)
    decode = [r for r in rows if r.get("stage") == "decode"]
    base = {r["batch"]: r["decode_tok_s"] for r in decode if r["mode"] == "bf16"}
    for r in rows:
        if r.get("stage") == "probe":
            print(f"probe: copy {r['copy_gb_s']} GB/s, sum {r['sum_gb_s']} GB/s ({r['bytes'] / 1e9:.1f} GB)")
    print("| mode | group | batch | decode tok/s | x bf16 | GB a token (weights + KV) | GB/s | MBU datasheet | MBU "
          "probe | prefill 128 tok/s | prefill 2,048 tok/s | graph skips | idle ms a step | compile s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in decode:
        ratio = r["decode_tok_s"] / base[r["batch"]] if r["batch"] in base else float("nan")

        def pct(v):
            return f"{v * 100:.0f}%" if v else "-"
        print(f"| {r['mode']} | {r['group'] or '-'} | {r['batch']} | {r['decode_tok_s']:.1f} | {ratio:.2f} | "
              f"{r['weight_bytes'] / 1e9:.2f} + {r['kv_bytes'] / 1e9:.2f} | {r['gb_s']:.0f} | {pct(r['mbu'])} | "
              f"{pct(r['mbu_probe'])} | {r['prefill_128_tok_s']:.0f} | "
              f"{'-' if r['prefill_long_tok_s'] is None else round(r['prefill_long_tok_s'])} | "
              f"{r['cudagraph_skips']} | {r['profile']['idle_ms_per_step']} | {r['compile_s']:.0f} |")
    for r in decode:
        p = r["profile"]
        print(f"profile {r['mode']} {r['group'] or ''} b{r['batch']}: {p['wall_ms_per_step']} ms a step, kernels "
              f"{p['kernel_ms_per_step']}, idle {p['idle_ms_per_step']} ms, {p['kernels_per_step']} kernels; top "
              f"{p['top'][:3]}")
    for r in rows:
        if r.get("stage") == "linear":
            print(f"linear {r['n']}x{r['k']} (1 row, CUDA graph), us: {r['us']}; GB/s: {r['gb_s']}")
        elif r.get("stage") == "server":
            print(f"server {r.get('clients')} clients: {r.get('tokens_per_s', 0):.1f} tok/s, ttft p50 "
                  f"{r.get('ttft_p50_ms')} ms, itl p50 {r.get('itl_p50_ms')} ms {r.get('skipped', '')}")
        elif r.get("stage") == "tests":
            print(f"CUDA tests: {r['passed']} passed, {r['failed']} failed (collected {r['collected']})")
        elif r.get("stage") in ("skipped", "cut", "crashed"):
            print(f"{r['stage']} {r['row']}: {r.get('why', r.get('log', ''))}")
        elif "check" in r and r.get("ok") is not True:
            print(f"check {r['check']}: {r.get('ok')} {r.get('value', '')} {r.get('error', r.get('skipped', ''))}")
    checks = [r for r in rows if "check" in r]
    print(f"checks: {sum(r.get('ok') is True for r in checks)} passed, {sum(r.get('ok') is False for r in checks)} "
          f"failed")


def results(path: str) -> dict:
    """The run as bench/results/gpu-<card>.json keeps it."""
    rows = read_rows(path)
    probe_rate = next((r["probe_gb_s"] for r in rows if r.get("stage") == "probe"), None)
    tests = next((r for r in rows if r.get("stage") == "tests"), {})
    keys = ("mode", "group", "batch", "decode_tok_s", "bytes_per_token", "weight_bytes", "kv_bytes", "mbu",
            "mbu_probe", "probe_gb_s", "prefill_128_tok_s", "prefill_long_tok_s", "cudagraph_skips", "profile")
    return {"device": next((r["device"] for r in rows if "device" in r), None),
            "shape": next((r["model"] for r in rows if r.get("stage") == "decode"), None),
            "probe_gb_s": probe_rate, "cuda_tests": {"passed": tests.get("passed"), "failed": tests.get("failed")},
            "rows": [{k: r.get(k) for k in keys} for r in rows if r.get("stage") == "decode"],
            "linears": [r for r in rows if r.get("stage") == "linear"],
            "server": [r for r in rows if r.get("stage") == "server"]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("stage", choices=("probe", "rows", "row", "check", "table", "results"))
    p.add_argument("name", nargs="?", help="row: the row's name; table, results: the gpu.json to read")
    p.add_argument("--dry-run", action="store_true", help="the whole plan on the CPU with a tiny shape")
    p.add_argument("--out", default=os.environ.get("OUT", "/tmp/gpu-bench"))
    p.add_argument("--budget", type=float, default=480, help="rows: seconds; a row running at the end is cut")
    p.add_argument("--workers", type=int, default=5, help="rows: processes at once")
    p.add_argument("--only", help="rows: these rows (comma-separated names), in this order")
    args = p.parse_args(argv)
    if args.stage == "table":
        table(args.name or os.path.join(args.out, "gpu.json"))
        return 0
    if args.stage == "results":
        print(json.dumps(results(args.name or os.path.join(args.out, "gpu.json")), indent=1))
        return 0
    if not args.dry_run and not torch.cuda.is_available():
        print("no CUDA device here (--dry-run runs the plan on the CPU)", file=sys.stderr)
        return 2
    plan = Plan(args)
    if args.stage == "probe":
        probe(plan)
    elif args.stage == "rows":
        names = args.only.split(",") if args.only else list(ROWS)
        unknown = [n for n in names if n not in ROWS]
        if unknown:
            print(f"--only: unknown row {unknown[0]!r} (rows: {', '.join(ROWS)})", file=sys.stderr)
            return 2
        run_rows(plan, names, args.budget, args.workers)
        plan.failures = sum(r.get("ok") is False for r in read_rows(plan.path))  # (every row's, each process's)
    elif args.stage == "row":  # (its failures are its records: the process fails only when it cannot go on)
        run_row(plan, args.name)
        return 0
    else:
        check(plan, "tiny", None) if args.dry_run else check(plan, CHECK_SHAPE, CHECK_LAYERS)
    print(f"{plan.failures} failed", file=sys.stderr)
    return 1 if plan.failures else 0


if __name__ == "__main__":
    sys.exit(main())
