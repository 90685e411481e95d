"""What each quantization mode costs in quality and saves in size, on a real model.

    python bench/quality.py [--ckpt DIR] [--text bench/english.txt] [--json]

Default: the default model (SmolLM2-135M-Instruct, converted by chat.py into ~/.cache/dense-engine). For every mode
it writes the variant with quantize.py into a temporary folder, reloads it, and reports:
  - size of the quantized layers' stored tensors against the same layers in bfloat16;
  - perplexity over the text (one pass) and its change against the full-precision model;
  - top-1 agreement: how often the variant's most likely next token is the full-precision one.
"""

import argparse
import json
import math
import os
import sys
import tempfile

import torch
from safetensors import safe_open

import dense
import quantize
from dense_engine.cpu import quantized
from dense_engine.formats import checkpoint, default_model, load

HERE = os.path.dirname(os.path.abspath(__file__))
VARIANTS = [("int8", 32, False), ("int4", 32, False), ("int4", 64, False), ("int4", 128, False), ("nf4", 32, False),
            ("nf4", 32, True), ("llm.int8", 32, False)]


def quantized_fraction(path: str, full: dense.DenseDecoder) -> float:
    """Bytes of the quantized layers (block linears and head) over the same layers' weights in bfloat16."""
    layers = set(quantized.layer_modes(full, "int8"))
    numel = sum(full.get_submodule(name).weight.numel() for name in layers)
    stored = 0
    with safe_open(path, "pt") as f:
        for key in f.keys():  # noqa: SIM118 (a safetensors file, not a dict: no __iter__)
            if key.rsplit(".", 1)[0] in layers and not key.endswith(".bias"):
                t = f.get_slice(key)
                stored += math.prod(t.get_shape()) * {"I8": 1, "U8": 1, "F16": 2, "BF16": 2, "F32": 4}[t.get_dtype()]
    return stored / (2 * numel)


def shape_sizes(name: str) -> int:
    """Quantized-layer size against bfloat16 for a random model of a published shape (the tensors quantize.py
    would store)."""
    from dense_engine.cli import benchmark

    full = benchmark.random_model(name, torch.device("cpu"), torch.bfloat16)
    layers = set(quantized.layer_modes(full, "int8"))
    numel = sum(full.get_submodule(n).weight.numel() for n in layers)
    for mode, group, dq in VARIANTS:
        if mode == "llm.int8":
            continue
        stored = 0
        for layer, layer_mode in quantized.layer_modes(full, mode).items():
            w = full.get_submodule(layer).weight
            parts = quantized.LINEARS[layer_mode].stored(w, group_size=group, double_quant=dq and layer_mode == "nf4")
            stored += sum(t.numel() * t.element_size() for t in parts.values())
        print(f"{name} {mode}{f'-g{group}' if mode == 'int4' else ''}{'-dq' if dq else ''}: quantized layers "
              f"{stored / (2 * numel):.3f}x of bfloat16 ({numel / 1e6:.0f}M weights)", flush=True)
    return 0


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--ckpt")
    p.add_argument("--text", default=os.path.join(HERE, "english.txt"))
    p.add_argument("--json", action="store_true")
    p.add_argument("--shape", help="sizes only, for a random-weight model of this published shape (benchmark.py)")
    args = p.parse_args()
    if args.shape:
        return shape_sizes(args.shape)
    from rich.console import Console
    from rich.table import Table
    from tokenizers import Tokenizer

    console = Console(stderr=args.json)
    ckpt = args.ckpt or default_model.default_checkpoint(console)
    tok = Tokenizer.from_file(os.path.join(ckpt, "tokenizer.json"))
    with open(args.text) as f:
        ids = torch.tensor([tok.encode(f.read()).ids])
    full = load.from_pretrained(ckpt)
    with torch.no_grad():
        ref_logits, ref_loss = full(ids[:, :-1], labels=ids[:, 1:])
    ref_top1 = ref_logits.argmax(-1)
    rows = [{"mode": "none", "dtype": str(full.dtype), "ppl": math.exp(ref_loss), "ppl_change_pct": 0.0,
             "top1_agreement": 1.0, "size_vs_bf16": 2.0 if full.dtype == torch.float32 else 1.0}]
    for mode, group, dq in VARIANTS:
        with tempfile.TemporaryDirectory() as out, console.status(f"{mode} g{group}"):
            try:
                path = quantize.quantize_checkpoint(ckpt, mode, out=out, group_size=group, double_quant=dq)
            except checkpoint.CheckpointError as e:  # e.g. int4-g128 on widths that are not multiples of 128
                console.print(f"[dim]{mode} g{group}: {e}[/dim]")
                continue
            size = quantized_fraction(path, full)
            model = load.from_pretrained(out, quant=mode)
            with torch.no_grad():
                logits, loss = model(ids[:, :-1], labels=ids[:, 1:])
        ppl = math.exp(loss)
        rows.append({"mode": mode + (f"-g{group}" if mode == "int4" else "") + ("-double-quant" if dq else ""),
                     "ppl": ppl, "ppl_change_pct": 100 * (ppl / rows[0]["ppl"] - 1), "size_vs_bf16": size,
                     "top1_agreement": float((logits.argmax(-1) == ref_top1).float().mean())})
    if args.json:
        print(json.dumps({"ckpt": ckpt, "tokens": ids.shape[1], "rows": rows}))
        return 0
    t = Table(title=f"{ckpt}: {ids.shape[1]} tokens of {os.path.basename(args.text)}")
    for col in ("mode", "quantized layers vs bf16", "perplexity", "change", "top-1 agreement"):
        t.add_column(col)
    for r in rows:
        t.add_row(r["mode"], f"{r['size_vs_bf16']:.3f}x", f"{r['ppl']:.4f}", f"{r['ppl_change_pct']:+.3f}%",
                  f"{r['top1_agreement'] * 100:.2f}%")
    console.print(t)
    return 0


if __name__ == "__main__":
    sys.exit(main())
