"""attention_decode.py: one decode step's attention over a long cache, the CPU kernel alone (dense_kernels::attention).

    python bench/attention_decode.py --slots 4000 --heads 8 --kv-heads 2 --dim 256 --dtype float32

Times the kernel for one query token against `slots` cached keys and values (random), the median of --repeats calls,
and the bytes of keys and values it reads a call over that time. The default shape is Qwen3.5-0.8B's attention layer.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from dense_engine.cpu import kernels


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--slots", type=int, default=4000)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args()
    if not kernels.available():
        raise SystemExit("the CPU kernels are not built on this machine")
    dtype = getattr(torch, args.dtype)
    S1 = args.slots + 1 + 16  # the cache's slots, the scratch slot, rounded up to blocks of 16 below
    blocks = (S1 + 15) // 16
    torch.manual_seed(0)
    q = torch.randn(1, args.heads, 1, args.dim)
    k_t = torch.randn(1, args.kv_heads, blocks, args.dim, 16).to(dtype)
    v = torch.randn(1, args.kv_heads, blocks * 16, args.dim).to(dtype)
    pos = torch.tensor([args.slots - 1])
    empty = torch.empty(0, dtype=torch.long)
    call = lambda: torch.ops.dense_kernels.attention(q, k_t, v, pos, empty, empty, args.dim ** -0.5, 0, 0.0,
                                                     None, None)
    for _ in range(10):
        call()
    times = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    ms = statistics.median(times) * 1e3
    read = 2 * args.kv_heads * args.slots * args.dim * k_t.element_size()
    print(f"attention: {args.heads} query heads on {args.kv_heads} key/value heads of {args.dim}, {args.slots} slots, "
          f"{args.dtype} cache, {torch.get_num_threads()} threads: {ms:.3f} ms a call, "
          f"{read / 1e6:.1f} MB of keys and values at {read / ms / 1e6:.1f} GB/s")


if __name__ == "__main__":
    main()
