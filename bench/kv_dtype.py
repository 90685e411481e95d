"""The KV cache's numbers (--kv-dtype): its bytes, decode tokens/s and logits at long positions, int8 against
bfloat16 and float32 (the default model's cache in its default mode, int4 weights), compiled steps, batch 1; or a
random-weight model of a published shape (float32 weights) for positions past the default model's 8,192.

    python bench/kv_dtype.py [--ckpt DIR | --shape qwen2.5-0.5b --positions 4096,32640] [--positions 4096,8064]
        [--steps 64]

A 4,096-token text is prefilled once per cache; a position past it is reached by copying those slots along the
cache (the same content again: a decode step there reads as many slots as a real conversation of that length).
Then `--steps` tokens of the text are fed one at a time (teacher-forced, the same tokens for every cache): the
logits of each step against the float32 cache's (largest difference over the largest logit), the steps whose
likeliest token differs from the float32 cache's, and decode tokens/s. Also the cache's bytes for 32,768 tokens of
the model and of an 8B shape (Llama-3-8B's 32 layers of 8 KV heads) by the count the memory check uses, and the peak
RSS that 8B shape's cache adds to a process once every slot is written (a process per dtype).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import torch
from rich.console import Console

from dense_engine.cli import benchmark
from dense_engine.formats import load
from dense_engine.formats.default_model import default_checkpoint
from dense_engine.formats.vocab import load_vocabulary
from dense_engine.runtime import caches, generate
from dense_engine.runtime.steps import Steps

PREFIX = 4096
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "int8": torch.int8}


def run(model, ids: torch.Tensor, dtype: str, positions: list[int], steps: int) -> dict:
    """{position: (logits [steps, V], tokens/s)} for one cache dtype."""
    length = max(positions) + steps + 1
    if dtype == "float32":  # (not a --kv-dtype: the reference the others are held to)
        model.setup_cache(1, length, torch.float32, cache_class=caches.cache_for(model)[0])
    else:
        caches.setup_cache(model, 1, length, dtype)
    runner = generate.Runner(model, Steps(model))
    runner.prefill(ids[:, :PREFIX], 0, None)
    memories = caches.memories(model)
    filled, out = PREFIX, {}
    for position in positions:
        while filled < position:  # (the first PREFIX slots again)
            n = min(PREFIX, position - filled)
            for cache in memories:
                cache.put_slots(0, filled, *(t.clone() for t in cache.slots(0, 0, n)))
            filled += n
        feed = ids[0, PREFIX:PREFIX + steps + 1].tolist()
        logits = []
        runner.decode(torch.tensor([[feed[0]]]), position, None, generate.Sampling(), True)  # (warm: compile)
        start = time.perf_counter()
        for i in range(steps):
            _, step_logits = runner.decode(torch.tensor([[feed[i]]]), position + i, None, generate.Sampling(), True)
            logits.append(step_logits[0].float())
        out[position] = torch.stack(logits), steps / (time.perf_counter() - start)
    return out


def shape_bytes(layers: int, kv_heads: int, head_dim: int, tokens: int, dtype: torch.dtype) -> int:
    """caches.cache_bytes' count for a model of that shape (batch 1)."""
    per_value = torch.empty((), dtype=dtype).element_size()
    return layers * 2 * kv_heads * (tokens + 1) * (head_dim * per_value + 4 * (dtype == torch.int8))


def cache_rss(dtype: str, tokens: int = 32768) -> None:
    """(A process of its own) an 8B shape's cache for `tokens` tokens, every slot written: the peak RSS it adds, GiB."""
    def peak() -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) << 10 for line in f if line.startswith("VmHWM:"))

    before = peak()
    cache_class = caches.CPUInt8KVCache if dtype == "int8" else caches.CPUKVCache
    layers = [cache_class(1, 8, tokens, 128, DTYPES[dtype], "cpu") for _ in range(32)]
    for cache in layers:  # (every page committed, as a conversation of that length commits them)
        for t in cache.buffers():
            t.fill_(1)
    print(f"{(peak() - before) / 2**30:.2f}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ckpt", default=None)
    p.add_argument("--positions", default="4096,8064", help="where the timed decode steps start (+ --steps within "
                   "the model's context)")
    p.add_argument("--shape", help="a random-weight model of this published shape instead (chat.py --bench's "
                   "shapes; qwen2.5-0.5b holds 32,768 positions)")
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--cache-rss", choices=tuple(DTYPES), help=argparse.SUPPRESS)  # (the child process's work)
    args = p.parse_args()
    if args.cache_rss:
        cache_rss(args.cache_rss)
        return 0
    ckpt = args.ckpt or default_checkpoint(Console(stderr=True))
    vocab = load_vocabulary(ckpt, None)
    if args.shape:
        model, ckpt = benchmark.random_model(args.shape, "cpu", torch.float32), f"{args.shape} (random weights)"
    else:
        model = load.from_pretrained(ckpt, quant="auto")
    with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "english.txt")) as f:
        text = f.read()
    ids = vocab.encode(text, special=False)  # (the default model's tokens: within any shape's vocabulary)
    ids = torch.tensor([(ids * (1 + (PREFIX + args.steps + 1) // len(ids)))[:PREFIX + args.steps + 1]])
    positions = [int(x) for x in args.positions.split(",")]
    results = {dtype: run(model, ids, dtype, positions, args.steps) for dtype in DTYPES}
    print(f"{ckpt}: {PREFIX} tokens prefilled, {args.steps} decode steps at each position, compiled, batch 1")
    print(f"{'cache':9s} {'position':>8s} {'tok/s':>7s} {'max |dlogit| / max |logit|':>27s} {'argmax differs':>15s}")
    for dtype, by_position in results.items():
        for position, (logits, rate) in by_position.items():
            ref = results["float32"][position][0]
            err = float((logits - ref).abs().max() / ref.abs().max())
            flips = int((logits.argmax(-1) != ref.argmax(-1)).sum())
            print(f"{dtype:9s} {position:8d} {rate:7.1f} {err:27.2e} {flips:>9d} of {args.steps}")
    config = model.config
    layer = model.layers[0].mixer
    print("cache bytes for 32,768 tokens:")
    for name, (layers, kv_heads, head_dim) in {
            os.path.basename(os.path.normpath(ckpt)): (config.num_hidden_layers, layer.n_kv_heads, layer.head_dim),
            "an 8B shape (Llama-3-8B: 32 layers, 8 KV heads of 128)": (32, 8, 128)}.items():
        sizes = {dtype: shape_bytes(layers, kv_heads, head_dim, 32768, DTYPES[dtype]) / 2**30 for dtype in DTYPES}
        print(f"  {name}: " + ", ".join(f"{dtype} {gib:.2f} GiB" for dtype, gib in sizes.items()))
    rss = {dtype: subprocess.run([sys.executable, __file__, "--cache-rss", dtype], capture_output=True, text=True,
                                 check=True).stdout.strip() for dtype in DTYPES}
    print("peak RSS of that 8B shape's cache, every slot of 32,768 written: "
          + ", ".join(f"{dtype} {gib} GiB" for dtype, gib in rss.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
