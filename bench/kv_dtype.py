"""The KV cache's numbers (--kv-dtype): its bytes, decode tokens/s and logits at long positions, int8 against
bfloat16 (the default model's cache in its default mode, int4 weights) and float32, compiled steps, batch 1.

    python bench/kv_dtype.py [--ckpt DIR] [--positions 4096,32768] [--steps 64] [--shape-bytes llama-3-8b]

A 4,096-token text is prefilled once per cache; a position past it is reached by copying those slots along the
cache (the same content again: a decode step there reads as many slots as a real conversation of that length).
Then `--steps` tokens of the text are fed one at a time (teacher-forced, the same tokens for every cache): the
logits of each step against the float32 cache's (largest difference over the largest logit), the steps whose
likeliest token differs from the float32 cache's, and decode tokens/s. Also the cache's bytes for 32,768 tokens of
the model (and of an 8B shape: its KV heads and layers) from the same count the memory check uses.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

from dense_engine.formats import load
from dense_engine.formats.default_model import default_checkpoint
from dense_engine.formats.vocab import load_vocabulary
from dense_engine.runtime import generate
from dense_engine.runtime.steps import Steps

PREFIX = 4096
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "int8": torch.int8}


def run(model, ids: torch.Tensor, dtype: str, positions: list[int], steps: int) -> dict:
    """{position: (logits [steps, V], tokens/s)} for one cache dtype."""
    model.kv_dtype = dtype
    generate.setup_cache(model, 1, max(positions) + steps + 1)
    runner = generate.Runner(model, Steps(model))
    runner.prefill(ids[:, :PREFIX], 0, None)
    caches = [layer.attn.kv_cache for layer in model.layers]
    filled, out = PREFIX, {}
    for position in positions:
        while filled < position:  # (the first PREFIX slots again)
            n = min(PREFIX, position - filled)
            for cache in caches:
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
    """generate.cache_bytes' count for a model of that shape (batch 1)."""
    per_value = torch.empty((), dtype=dtype).element_size()
    return layers * 2 * kv_heads * (tokens + 1) * (head_dim * per_value + 4 * (dtype == torch.int8))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ckpt", default=None)
    p.add_argument("--positions", default="4096,32768")
    p.add_argument("--steps", type=int, default=64)
    args = p.parse_args()
    ckpt = args.ckpt or default_checkpoint(None)
    vocab = load_vocabulary(ckpt, None)
    model = load.from_pretrained(ckpt, quant="auto")
    with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "english.txt")) as f:
        text = f.read()
    ids = vocab.encode(text, special=False)
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
    layer = model.layers[0].attn
    print("cache bytes for 32,768 tokens:")
    for name, (layers, kv_heads, head_dim) in {
            os.path.basename(os.path.normpath(ckpt)): (config.num_hidden_layers, layer.n_kv_heads, layer.head_dim),
            "an 8B shape (Llama-3-8B: 32 layers, 8 KV heads of 128)": (32, 8, 128)}.items():
        sizes = {dtype: shape_bytes(layers, kv_heads, head_dim, 32768, DTYPES[dtype]) / 2**30 for dtype in DTYPES}
        print(f"  {name}: " + ", ".join(f"{dtype} {gib:.2f} GiB" for dtype, gib in sizes.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
