"""prequantized.py: a 4-bit GPTQ and an AWQ folder's decode against the same weights as int4-g32 made by the engine;
a fine-grained FP8 folder's as stored (fp8) and dequantized (float32).

    python bench/prequantized.py [--layers 16] [--runs 3] [--max-new 64] [--rows FOLDER:QUANT,...]

Writes a random folder of Llama-3.2-1B's shape (transformers' LlamaForCausalLM: 2048 wide, 16 layers, 32 query and 8
key-value heads of 64, MLP 8192, a 128,256-token vocabulary, tied; float32), the same linears packed as GPTQ (4 bits,
group 128, zero points, v1) and as AWQ (gemm, group 128) the way their libraries save them (min/max to nearest: the
storage is what counts), and the float folder's dequantized GPTQ weights; then times greedy decoding through the
compiled step (the model's 2,048-token context as the cache): the GPTQ and AWQ folders as `--quant auto` loads them
(int4-g32 holding their numbers), the float folder of the GPTQ weights with `--quant int4` (quantized by the engine at
load, as quantize.py would), and an FP8 folder (Qwen3-FP8's 128 x 128 blocks) as fp8 and as float32 (--quant none). The
median of --runs each, after a warm-up run.
"""

import argparse
import json
import os
import shutil
import sys
import tempfile

import torch
from lora import decode_rate  # (bench/lora.py's: the compiled step over the model's context as the cache)
from safetensors.torch import load_file, save_file

from dense_engine.formats import load

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def words(codes: torch.Tensor, minus: int = 0) -> torch.Tensor:
    """4-bit codes [..., n] packed eight a word along the last dim, the first lowest, as int32 [..., n / 8]; minus:
    taken from each whole word (GPTQ v1's zero points)."""
    packed = ((codes.long().unflatten(-1, (-1, 8)) << (torch.arange(8) * 4)).sum(-1) - minus) % 2**32
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def grid(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [out, in] on a 4-bit grid with zero points, a group of inputs each: (q, zeros, scales) [out, in] and
    [out, in / group] (float16 scales), min/max round to nearest."""
    g = w.float().unflatten(1, (-1, group))
    low, high = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
    scales = ((high - low) / 15).clamp(min=1e-8).half()
    zeros = torch.round(-low / scales.float()).clamp(0, 15)
    q = torch.round(g / scales.float()[..., None] + zeros[..., None]).clamp(0, 15)
    return q.flatten(1), zeros, scales


def pack_gptq(w: torch.Tensor, group: int = 128) -> tuple[dict, torch.Tensor]:
    """GPTQ v1 tensors (GPTQModel's layout: qweight packs inputs, qzeros outputs, zero points minus one) and the
    weight they mean."""
    q, zeros, scales = grid(w, group)
    tensors = {"qweight": words(q).t().contiguous(), "qzeros": words(zeros.t(), minus=0x11111111),
               "scales": scales.t().contiguous(),
               "g_idx": (torch.arange(w.shape[1]) // group).to(torch.int32)}
    return tensors, (scales.float().repeat_interleave(group, 1) * (q - zeros.repeat_interleave(group, 1)))


def pack_awq(w: torch.Tensor, group: int = 128) -> tuple[dict, torch.Tensor]:
    """AWQ gemm tensors (eight columns a word in AWQ_ORDER) and the weight they mean."""
    q, zeros, scales = grid(w, group)
    order = torch.arange(w.shape[0]).view(-1, 8)[:, list(AWQ_ORDER)].flatten()  # the column in each slot
    tensors = {"qweight": words(q.t()[:, order]), "qzeros": words(zeros.t()[:, order]),
               "scales": scales.t().contiguous()}
    return tensors, (scales.float().repeat_interleave(group, 1) * (q - zeros.repeat_interleave(group, 1)))


def pack_fp8(w: torch.Tensor, block: int = 128) -> tuple[dict, torch.Tensor]:
    """Fine-grained FP8 tensors (Qwen3-FP8's layout: e4m3 values, weight_scale_inv per 128 x 128 block) and the weight
    they mean."""
    from dense_engine.cpu.quantized import FP8_MAX

    blocks = w.float().unflatten(0, (-1, block)).unflatten(2, (-1, block))  # [out / b, b, in / b, b]
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / FP8_MAX
    q = (blocks / scale[:, None, :, None]).flatten(2).flatten(0, 1).to(torch.float8_e4m3fn)
    return {"weight": q, "weight_scale_inv": scale}, q.float() * scale.repeat_interleave(block, 0).repeat_interleave(
        block, 1)


def make_folders(root: str, layers: int) -> dict[str, str]:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=layers,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=64, max_position_embeddings=2048,
                         tie_word_embeddings=True, rms_norm_eps=1e-5)
    torch.manual_seed(0)
    base = os.path.join(root, "float")
    LlamaForCausalLM(config).save_pretrained(base)
    stored = load_file(os.path.join(base, "model.safetensors"))
    folders = {}
    for kind, pack, quantization in (("gptq", pack_gptq, {"quant_method": "gptq", "bits": 4, "group_size": 128,
                                                          "desc_act": False, "sym": False,
                                                          "checkpoint_format": "gptq"}),
                                     ("awq", pack_awq, {"quant_method": "awq", "bits": 4, "group_size": 128,
                                                        "zero_point": True, "version": "gemm"}),
                                     ("fp8", pack_fp8, {"quant_method": "fp8", "fmt": "e4m3",
                                                        "activation_scheme": "dynamic",
                                                        "weight_block_size": [128, 128]})):
        packed, weights = {}, {}
        for name, t in stored.items():
            if name.endswith("proj.weight"):
                tensors, weight = pack(t)
                weights[name] = weight.contiguous()
                packed.update({f"{name[:-len('.weight')]}.{k}": v.contiguous() for k, v in tensors.items()})
            else:
                packed[name] = weights[name] = t
        folders[kind] = os.path.join(root, kind)
        shutil.copytree(base, folders[kind])
        save_file(packed, os.path.join(folders[kind], "model.safetensors"))
        with open(os.path.join(base, "config.json")) as f:
            raw = json.load(f)
        with open(os.path.join(folders[kind], "config.json"), "w") as f:
            json.dump({**raw, "quantization_config": quantization}, f)
        if kind == "gptq":  # the float folder holds the GPTQ folder's numbers
            save_file(weights, os.path.join(base, "model.safetensors"))
    folders["float"] = base
    return folders


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--max-new", type=int, default=64)
    p.add_argument("--rows", default="float:int4,gptq:auto,awq:auto,fp8:fp8,fp8:none",
                   help="FOLDER:QUANT pairs, comma-separated (the first is the ratios' reference)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as root:
        folders = make_folders(root, args.layers)
        print(f"# Llama-3.2-1B's shape, {args.layers} layers; torch threads {torch.get_num_threads()}")
        print(f"{'folder':8} {'loaded as':40} {'tok/s':>7} {'vs first':>8}")
        reference = None
        for kind, quant in (row.split(":") for row in args.rows.split(",")):
            record, checkpoint = load.plan(folders[kind], quant, "cpu")
            model = load.from_pretrained(checkpoint, dtype=torch.float32, quant=record.quant)
            rate = decode_rate(model, list(range(3, 31)), args.max_new, args.runs)  # (a 28-token prompt)
            reference = reference or rate
            print(f"{kind:8} {record.weights[:40]:40} {rate:7.1f} {rate / reference:7.2f}x", flush=True)
            del model, checkpoint
    return 0


if __name__ == "__main__":
    sys.exit(main())
