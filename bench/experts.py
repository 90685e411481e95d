"""A mixture of experts' speed on this engine alone, at Qwen3-30B-A3B's layer shape (2048 wide, 128 experts of width
768, 8 chosen, 32 query heads and 4 key/value heads of 128, its 151936-token vocabulary) with fewer layers and random
weights: decode tokens/s eager (each chosen expert once: Experts.grouped) and with the compiled steps (each token's
experts gathered: Experts.gathered), and a 512-token prefill (eager). The peer's (llama.cpp's mul_mat_id on GGUF
blocks) side of the issue's table needs the experts as stored, which is the next step; this is where it starts.

    python bench/experts.py --layers 4 --dtype bfloat16
"""

from __future__ import annotations

import argparse
import json
import time

import torch

import dense
import layer_kinds
from dense_engine.runtime import caches, generate


def model_of(layers: int, dtype: torch.dtype) -> layer_kinds.Decoder:
    config = dense.DenseConfig(
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=layers, num_attention_heads=32,
        num_key_value_heads=4, head_dim=128, max_position_embeddings=4096, rope_theta=1e6, norm_eps=1e-6,
        qk_norm="shared", extras={"experts": layer_kinds.ExpertsConfig(count=128, chosen=8, width=768)})
    torch.manual_seed(0)
    with torch.device("meta"):
        model = layer_kinds.Decoder(config)
    model = model.to_empty(device="cpu").to(dtype)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.ones_like(p) if "norm" in name else torch.randn_like(p) * 0.02)
    return model.eval()


def decode_rate(model, prompt: torch.Tensor, n: int, compile: bool) -> float:
    generate.generate(model, prompt, 4, compile=compile)  # (compiles, or warms up)
    start = time.perf_counter()
    generate.generate(model, prompt, n, compile=compile)
    return n / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--tokens", type=int, default=32)
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    model = model_of(args.layers, dtype)
    prompt = torch.randint(0, 151936, (1, 16), generator=torch.Generator().manual_seed(1))
    long = torch.randint(0, 151936, (1, 512), generator=torch.Generator().manual_seed(2))
    caches.setup_cache(model, 1, 1024)
    with torch.no_grad():
        model(long[:, :64], torch.arange(64))  # (warm)
        start = time.perf_counter()
        model(long, torch.arange(512))
        prefill = 512 / (time.perf_counter() - start)
    record = {"layers": args.layers, "dtype": args.dtype, "threads": torch.get_num_threads(),
              "decode eager tok/s": round(decode_rate(model, prompt, args.tokens, False), 2),
              "decode compiled tok/s": round(decode_rate(model, prompt, args.tokens, True), 2),
              "prefill 512 tok/s": round(prefill, 1)}
    print(json.dumps(record))


if __name__ == "__main__":
    main()
