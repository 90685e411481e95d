"""What the server's prefill choices cost, on the default model (int4) or --ckpt: requests arriving together prefilled
one pass each or in one pass, and a long prompt whole or in chunks of --prefill-chunk tokens (the time of each chunk
is what a running stream waits for between two of its tokens).

    python bench/prefill_budget.py [--ckpt DIR] [--quant int4] [--long 3000] [--chunks 128,256,512] [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

from dense_engine.cli.flags import load_model
from dense_engine.formats.vocab import load_vocabulary
from dense_engine.server.scheduler import Scheduler


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ckpt")
    p.add_argument("--quant", default="int4")
    p.add_argument("--long", type=int, default=3000)
    p.add_argument("--chunks", default="128,256,512")
    p.add_argument("--repeat", type=int, default=3)
    args = p.parse_args()
    from rich.console import Console

    from dense_engine.cli import flags as model_flags
    from dense_engine.formats import default_model

    console = Console(stderr=True)
    ckpt = args.ckpt or default_model.default_checkpoint(console)
    parser = argparse.ArgumentParser()
    model_flags.add_model_flags(parser)
    flags = model_flags.parse_flags(parser, ["--quant", args.quant, "--no-compile"])
    model, _ = load_model(ckpt, flags, console)
    vocab = load_vocabulary(ckpt, None)
    ctx = 1 << (args.long + 64).bit_length()
    scheduler = Scheduler(model, vocab, 8, ctx, compile=False)
    runner = scheduler.calls.runner
    questions = [vocab.encode(vocab.render([{"role": "user", "content": q}]), special=False) for q in
                 ("What is the capital of France?", "Write a haiku about the sea.", "Explain photosynthesis simply.",
                  "List three uses of copper.", "Why is the sky blue?", "Tell me a short story about a cat.",
                  "What does a compiler do?", "Give me a recipe for pancakes.")]
    rows = {"machine": f"{os.cpu_count()} cores, torch {torch.__version__}",
            "prompt_tokens": [len(q) for q in questions]}

    def apart():
        for r, q in enumerate(questions):
            runner.prefill(torch.tensor([q]), 0, None, rows=torch.tensor([r]))

    def together():
        runner.prefill_rows(questions, [0] * len(questions), torch.arange(len(questions)))

    for name, fn in (("8 arrivals, a pass each", apart), ("8 arrivals, one pass", together)):
        fn()
        rows[name] = min(timed(fn) for _ in range(args.repeat)) * 1000
    text = " ".join(["The history of the printing press begins long before Gutenberg."] * 400)
    long = vocab.encode(text, special=False)[: args.long]

    def chunked(size: int) -> list[float]:
        times = []
        for start in range(0, len(long), size):
            times.append(timed(lambda start=start: runner.prefill(torch.tensor([long[start:start + size]]), start,
                                                                  None, rows=torch.tensor([0]))))
        return times

    whole = min(timed(lambda: runner.prefill(torch.tensor([long]), 0, None, rows=torch.tensor([0])))
                for _ in range(args.repeat))
    rows[f"{len(long)} tokens whole"] = whole * 1000
    for size in map(int, args.chunks.split(",")):
        best = min((chunked(size) for _ in range(args.repeat)), key=sum)
        rows[f"{len(long)} tokens in chunks of {size}: total"] = sum(best) * 1000
        rows[f"{len(long)} tokens in chunks of {size}: largest chunk"] = max(best) * 1000
    for key, value in rows.items():
        print(f"{key:45s} {value:9.1f} ms" if isinstance(value, float) else f"{key:45s} {value}")
    print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
