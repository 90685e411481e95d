"""How far a checkpoint's default mode (`--quant auto`) is from its float path (`--quant none`) on the same file:
the last position's logits of random prompts of a few lengths, max |diff| / max |logit| and rms / rms; and the output
head's time a call as the file stores it, x in float32 (GGUFHead) against x as two int8 digits and an int8 copy.

    python bench/file_distance.py DIR_OR_GGUF [--tokens 1,4,12,15] [--time-head]
    DENSE_KERNELS=avx2 python bench/file_distance.py ...     # the AVX2 kernels on an AVX-512 CPU
"""

import argparse
import time

import torch

from dense_engine.cpu import quantized
from dense_engine.formats import load


def distance(path: str, lengths: list[int]) -> None:
    model, plain = load.from_pretrained(path, quant="auto"), load.from_pretrained(path, quant="none")
    print(f"head {type(model.lm_head).__name__}, embedding {type(model.embed_tokens).__name__}")
    ids = torch.randint(0, model.config.vocab_size, (1, max(lengths)), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for t in lengths:
            a, b = model(ids[:, :t])[0, -1], plain(ids[:, :t])[0, -1]
            print(f"{t:4d} tokens: max {float((a - b).abs().max() / b.abs().max()):.1e}, "
                  f"rms {float((a - b).norm() / b.norm()):.1e}")


def time_head(path: str) -> None:
    model = load.from_pretrained(path, quant="auto")
    head = model.lm_head
    if not isinstance(head, quantized.GGUFHead) or head.kinds != ["Q8_0"]:
        raise SystemExit(f"{path}: the head is {type(head).__name__}, not a Q8_0 GGUFHead")
    blocks = head.blocks0
    int8 = quantized.Int8Linear(head.in_features, head.out_features, False)
    int8._buffers.update(quantized.int8_quantize(head.dequantize(torch.float32)))
    int8.finish_loading()
    for rows in (1, 4):
        x = torch.randn(rows, head.in_features)
        calls = {"Q8_0, x float32": lambda x=x: torch.ops.dense_kernels.linear_gguf(x, blocks, 8, True),
                 "Q8_0, x two digits": lambda x=x: torch.ops.dense_kernels.linear_gguf(x, blocks, 8, False),
                 "int8 copy": lambda x=x: int8(x)}
        for name, call in calls.items():
            for _ in range(20):
                call()
            start = time.perf_counter()
            for _ in range(200):
                call()
            print(f"{rows} rows, {name}: {(time.perf_counter() - start) / 200 * 1e3:.2f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path")
    parser.add_argument("--tokens", default="1,4,12,15")
    parser.add_argument("--time-head", action="store_true")
    args = parser.parse_args()
    distance(args.path, [int(t) for t in args.tokens.split(",")])
    if args.time_head:
        time_head(args.path)


if __name__ == "__main__":
    main()
