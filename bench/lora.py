"""lora.py: what a LoRA adapter costs a decode step, on the default model (SmolLM2-135M-Instruct) as chat.py loads it.

    python bench/lora.py [--rank 16] [--runs 3] [--max-new 128] [--ckpt DIR]

Writes a random PEFT adapter (rank --rank on q, k, v, o, gate, up and down of every layer, B drawn with std 0.02)
and times greedy decoding through the compiled step (chat.py's default cache): int4 weights alone and with the
adapter beside them (unmerged: lora.LowRank), and full-precision weights alone, with the adapter merged in, and with
it served by name (serve.py's --lora NAME=DIR: beside the weights, switched on for the row). The median of --runs
each, after a warm-up run (the steps loaded or compiled).
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch
from safetensors.torch import save_file

import chat
from dense_engine.cli import flags
from dense_engine.formats import default_model, lora
from dense_engine.formats import vocab as vocab_module
from dense_engine.runtime import caches, generate
from dense_engine.runtime.steps import Steps

TARGETS = {"self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"), "mlp": ("gate_proj", "up_proj", "down_proj")}


def write_adapter(folder: str, model, rank: int) -> None:
    """A PEFT adapter folder for a Llama-layout model (the engine's loaded model gives the shapes)."""
    c = model.config
    shapes = {"q_proj": (c.num_attention_heads * c.head_dim, c.hidden_size),
              "k_proj": (c.num_key_value_heads * c.head_dim, c.hidden_size),
              "v_proj": (c.num_key_value_heads * c.head_dim, c.hidden_size),
              "o_proj": (c.hidden_size, c.num_attention_heads * c.head_dim),
              "gate_proj": (c.intermediate_size, c.hidden_size), "up_proj": (c.intermediate_size, c.hidden_size),
              "down_proj": (c.hidden_size, c.intermediate_size)}
    torch.manual_seed(0)
    tensors = {}
    for i in range(c.num_hidden_layers):
        for block, names in TARGETS.items():
            for name in names:
                out, inp = shapes[name]
                prefix = f"base_model.model.model.layers.{i}.{block}.{name}"
                tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, inp) / inp ** 0.5
                tensors[f"{prefix}.lora_B.weight"] = torch.randn(out, rank) * 0.02
    save_file(tensors, os.path.join(folder, "adapter_model.safetensors"))
    with open(os.path.join(folder, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "bias": "none",
                   "target_modules": [n for names in TARGETS.values() for n in names]}, f)


def decode_rate(model, ids: list[int], max_new: int, runs: int) -> float:
    caches.setup_cache(model, 1, model.config.max_position_embeddings)
    lora.switch(lora.switches(model), [(1.0,)])  # (an adapter served by name: on for the row, as a request naming it)
    steps = Steps(model)
    rates = []
    for run in range(runs + 1):  # (the first: load or compile the steps)
        start, count = None, 0
        for token in generate.generate_tokens(model, torch.tensor([ids]), max_new, steps=steps):
            count += 1
            start = start or time.perf_counter()
        if run:
            rates.append((count - 1) / (time.perf_counter() - start))
    return statistics.median(rates)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--max-new", type=int, default=128)
    p.add_argument("--ckpt")
    args = p.parse_args()
    from rich.console import Console

    console = Console(stderr=True)
    ckpt = args.ckpt or default_model.default_checkpoint(console)
    vocab = vocab_module.load_vocabulary(ckpt, None)
    ids = flags.prompt_ids(vocab, "Explain in a few sentences why the sky is blue.", "chat", None)
    with tempfile.TemporaryDirectory() as adapter:
        print(f"# {ckpt}; rank {args.rank} on 7 linears a layer; torch threads {torch.get_num_threads()}")
        print(f"{'weights':10} {'adapter':10} {'tok/s':>7} {'vs alone':>8}")
        for quant in ("int4", "none"):
            alone = None
            for adapters in ([], [adapter], [f"by-name={adapter}"] if quant == "none" else None):
                if adapters is None:
                    continue
                chat_args = chat.parse_args(["--ckpt", ckpt, "--quant", quant])
                chat_args.lora = adapters  # (a name: as serve.py takes it)
                model, _ = flags.load_model(ckpt, chat_args, console)
                if not os.path.exists(os.path.join(adapter, "adapter_config.json")):
                    write_adapter(adapter, model, args.rank)
                rate = decode_rate(model, ids, args.max_new, args.runs)
                alone = alone or rate
                kind = "-" if not adapters else "by name" if "=" in adapters[0] else \
                    "unmerged" if quant != "none" else "merged"
                print(f"{quant:10} {kind:10} {rate:7.1f} {rate / alone:7.2f}x", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
