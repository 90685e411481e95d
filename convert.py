"""convert.py: read every supported checkpoint layout into dense.py's native names, and write native folders.

    python convert.py SRC DST [--force] [--dtype float32|float16|bfloat16]

Each family is a small function: read the family's config into a DenseConfig and return a table
{native name: thunk} whose thunks read, slice or merge the family's tensors on demand. dense.DenseDecoder loads
from such a table one tensor at a time, so no family ever needs a second full copy of the weights in memory.

| family            | what is on disk                                                   |
| ----------------- | ----------------------------------------------------------------- |
| ShellElastic      | native: config.json + model.safetensors (seed 000)                |
| Sprout            | ckpt.pt {"model", "config": {vocab_size, dim, n_layers, ...}}     |
| GermanGPT         | checkpoint.pt {"config": {d_model, n_kv_heads, ...}, "model"}      |
| OpenELM           | Hugging Face folder, model_type "openelm"                         |
| GPT-NeoX          | Hugging Face folder, model_type "gpt_neox"                        |
| GPT-NeoX original | global_step*/layer_NN-model_0R-model_states.pt + configs/*.yml    |
| Llama             | Hugging Face folder, model_type "llama"                           |
| GGUF              | a .gguf file, architecture "llama" (gguf_import.py)               |
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import glob
import json
import os
import pickle
import re
import shutil
import sys
import tempfile

import numpy as np
import torch

from dataclasses import dataclass, field
from typing import Callable

from dense import CheckpointError, DenseConfig, torch_dtype

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "special_tokens_map.json")
# Non-parameter buffers that older exports carry; recognised and skipped.
SKIPPED_BUFFERS = re.compile(r".*\.(rotary_emb\.inv_freq|attention\.bias|attention\.masked_bias|attn\.bias|"
                             r"attn\.masked_bias)$")


# ----------------------------------------------------------------------------------------------------------------
# Reading files


@dataclass
class Checkpoint:
    """What loading needs from any checkpoint: its config, {native tensor name: thunk} of the full-precision weights
    (empty when a folder holds only quantized variants), the declared dtype, and the native config.json's own record
    (its saved quantized variants; for a checkpoint converted from a GGUF, the source tensor types). A GGUF source
    also carries, for its Q4_0/Q4_1 linears, thunks of the int4 tensors that hold its blocks exactly."""
    path: str
    config: DenseConfig
    tensors: dict[str, Callable[[], torch.Tensor]]
    dtype: torch.dtype | None = None
    record: dict = field(default_factory=dict)
    source_types: dict[str, str] = field(default_factory=dict)  # native weight name -> GGUF tensor type
    exact_int4: dict[str, Callable[[], dict]] = field(default_factory=dict)  # linear name -> its int4 tensors

    @property
    def native(self) -> bool:
        return bool(self.record)


def read_json(path: str) -> dict:
    try:
        with open(path) as f:
            data = json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: file not found") from None
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read ({e.strerror})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: not valid JSON ({getattr(e, 'msg', None) or e.reason})") from None
    except RecursionError:
        raise CheckpointError(f"{path}: not valid JSON (nested too deeply)") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    return data


def open_safetensors(path: str) -> dict[str, Callable[[], torch.Tensor]]:
    """{name: thunk} over a memory-mapped safetensors file; a truncated or corrupt file is a CheckpointError."""
    from safetensors import safe_open

    try:
        handle = safe_open(path, framework="pt", device="cpu")
        names = list(handle.keys())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: file not found") from None
    except Exception as e:  # safetensors raises its own error types for bad headers and short files
        raise CheckpointError(f"{path}: not a readable safetensors file ({first_line(e)})") from None

    def reader(name: str):
        def read() -> torch.Tensor:
            try:
                return handle.get_tensor(name)
            except Exception as e:
                raise CheckpointError(f"{path}: cannot read tensor {name!r} ({first_line(e)})") from None
        return read

    return {name: reader(name) for name in names}


def first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def read_checkpoint(path) -> Checkpoint:
    """Any supported checkpoint, native or foreign, as a Checkpoint."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise CheckpointError(f"{path}: no such file or folder")
    config_file = os.path.join(path, "config.json")
    if os.path.isdir(path) and os.path.isfile(config_file):
        raw = read_json(config_file)
        if raw.get("model_type", "dense") == "dense" and "dim" not in raw:  # native (seed 000 release) format
            config = DenseConfig.from_dict(raw, source=config_file)
            weights = os.path.join(path, "model.safetensors")
            if not os.path.isfile(weights) and not raw.get("quantization"):
                raise CheckpointError(f"{path}: no model.safetensors beside config.json")
            tensors = open_safetensors(weights) if os.path.isfile(weights) else {}
            return Checkpoint(path, config, tensors, torch_dtype(raw.get("torch_dtype")), raw)
    return read_foreign(path)


def load_pickle(path: str) -> dict:
    """torch.load with weights_only=True: tensors and plain containers only; a pickle that would run code is refused."""
    try:
        try:
            return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as e:
            if "mmap" not in str(e):  # legacy (non-zip) files cannot be memory-mapped
                raise
            return torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: file not found") from None
    except pickle.UnpicklingError as e:
        detail = str(e).split("Unsupported")[-1].strip().splitlines()[0] if "Unsupported" in str(e) else "unsafe"
        raise CheckpointError(f"{path}: refused to unpickle: it holds something other than tensors and plain "
                              f"containers (weights_only=True; {detail})") from None
    except Exception as e:
        raise CheckpointError(f"{path}: not a readable PyTorch checkpoint ({str(e).splitlines()[0]})") from None


def eager(tensors: dict[str, torch.Tensor]) -> dict:
    return {name: (lambda t=t: t) for name, t in tensors.items()}


def hf_weights(folder: str) -> dict:
    """{name: thunk} over a Hugging Face folder: model.safetensors, a sharded safetensors index, or
    pytorch_model.bin (and its index) when there are no safetensors."""
    for index_name, single in (("model.safetensors.index.json", "model.safetensors"),
                               ("pytorch_model.bin.index.json", "pytorch_model.bin")):
        index = os.path.join(folder, index_name)
        if os.path.isfile(index):
            weight_map = read_json(index).get("weight_map")
            if not isinstance(weight_map, dict):
                raise CheckpointError(f"{index}: no 'weight_map'")
            table = {}
            for shard in dict.fromkeys(weight_map.values()):
                shard_path = os.path.join(folder, shard)
                if not os.path.isfile(shard_path):
                    raise CheckpointError(f"{index}: shard {shard!r} is named in the index but absent")
                shard_table = open_safetensors(shard_path) if shard.endswith(".safetensors") else \
                    eager(load_pickle(shard_path))
                table.update({n: f for n, f in shard_table.items() if weight_map.get(n) == shard})
            return table
        if os.path.isfile(os.path.join(folder, single)):
            path = os.path.join(folder, single)
            return open_safetensors(path) if single.endswith(".safetensors") else eager(load_pickle(path))
    raise CheckpointError(f"{folder}: no model.safetensors, safetensors index or pytorch_model.bin")


def rename(source: dict, rules: list[tuple[str, str]], origin: str) -> dict:
    """Map foreign names to native ones with regex rules (first match wins); skipped buffers are dropped and any
    other name that no rule matches is an error."""
    table = {}
    for name, thunk in source.items():
        if SKIPPED_BUFFERS.match(name):
            continue
        for pattern, target in rules:
            if re.fullmatch(pattern, name):
                if target:
                    table[re.sub(pattern, target, name)] = thunk
                break
        else:
            raise CheckpointError(f"{origin}: unexpected tensor {name!r}")
    return table


def split_rows(table: dict, name: str, parts: dict, *, view: tuple[int, ...] | None = None) -> None:
    """Replace the fused tensor table[name] by slices. parts maps native name -> (first row, end row); or, with
    view, rows are reshaped to view (e.g. [heads, 3, head_dim]) and parts maps native name -> index in dim 1."""
    fused = table.pop(name)

    def piece(where):
        def read() -> torch.Tensor:
            t = fused()
            if view is None:
                return t[where[0]:where[1]]
            return t.reshape(view + tuple(t.shape[1:]))[:, where].flatten(0, 1)
        return read

    for target, where in parts.items():
        table[target] = piece(where)


def need(raw: dict, key: str, source: str):
    if key not in raw:
        raise CheckpointError(f"{source}: missing config field {key!r}")
    return raw[key]


# ----------------------------------------------------------------------------------------------------------------
# Families


def sprout(raw: dict, state: dict, source: str):
    """Seed 001: fused qkv, nn.RMSNorm eps 1e-5, rotate-half RoPE in float32, untied head."""
    state = {k.removeprefix("_orig_mod."): v for k, v in state.items()}
    dim, heads = int(need(raw, "dim", source)), int(need(raw, "n_heads", source))
    if "blocks.0.mlp.w_gate.weight" not in state:
        raise CheckpointError(f"{source}: missing tensor 'blocks.0.mlp.w_gate.weight'")
    config = DenseConfig(
        vocab_size=int(need(raw, "vocab_size", source)), hidden_size=dim, num_hidden_layers=int(need(raw, "n_layers", source)),
        num_attention_heads=heads, head_dim=dim // heads, intermediate_size=int(state["blocks.0.mlp.w_gate.weight"].shape[0]),
        max_position_embeddings=int(raw.get("block_size", 1024)), rope_precision="float32", norm_eps=1e-5,
        norm_gain_in_float32=True,
        qk_norm="none", attn_output_gate=False)
    table = rename(eager(state), [
        (r"tok_emb\.weight", "embed_tokens.weight"), (r"norm_f\.weight", "norm.weight"), (r"head\.weight", "lm_head.weight"),
        (r"blocks\.(\d+)\.n1\.weight", r"layers.\1.attn_norm.weight"), (r"blocks\.(\d+)\.n2\.weight", r"layers.\1.mlp_norm.weight"),
        (r"blocks\.(\d+)\.attn\.qkv\.weight", r"layers.\1.attn.qkv.weight"),
        (r"blocks\.(\d+)\.attn\.proj\.weight", r"layers.\1.attn.o_proj.weight"),
        (r"blocks\.(\d+)\.mlp\.w_(gate|up|down)\.weight", r"layers.\1.mlp.\2_proj.weight")], source)
    for i in range(config.num_hidden_layers):
        split_rows(table, f"layers.{i}.attn.qkv.weight", {f"layers.{i}.attn.{p}_proj.weight": (j * dim, (j + 1) * dim)
                                                          for j, p in enumerate("qkv")})
    return config, table


def germangpt(raw: dict, state: dict, source: str):
    """Seed 002: RMSNorm eps 1e-6, RoPE on interleaved pairs, GQA, tied embeddings when tie_embeddings."""
    if raw.get("norm", "rmsnorm") != "rmsnorm" or raw.get("mlp", "swiglu") != "swiglu":
        raise CheckpointError(f"{source}: only norm 'rmsnorm' and mlp 'swiglu' exist in GermanGPT")
    d_model, heads = int(need(raw, "d_model", source)), int(raw.get("n_heads", 16))
    tied = bool(raw.get("tie_embeddings", True))
    config = DenseConfig(
        vocab_size=int(need(raw, "vocab_size", source)), hidden_size=d_model, num_hidden_layers=int(raw.get("n_layers", 24)),
        num_attention_heads=heads, num_key_value_heads=int(raw.get("n_kv_heads", heads)), head_dim=d_model // heads,
        intermediate_size=int(raw.get("d_ff", 2816)), max_position_embeddings=int(raw.get("context_len", 2048)),
        rope_theta=float(raw.get("rope_theta", 10000.0)), rope_precision="float32", rope_layout="interleaved",
        norm_eps=1e-6, qk_norm="none", attn_output_gate=False, tie_word_embeddings=tied)
    table = rename(eager(state), [
        (r"token_embedding\.weight", "embed_tokens.weight"), (r"norm\.weight", "norm.weight"),
        (r"lm_head\.weight", None if tied else "lm_head.weight"),
        (r"blocks\.(\d+)\.(attn_norm)\.weight", r"layers.\1.\2.weight"), (r"blocks\.(\d+)\.ffn_norm\.weight", r"layers.\1.mlp_norm.weight"),
        (r"blocks\.(\d+)\.attn\.([qkvo]_proj)\.weight", r"layers.\1.attn.\2.weight"),
        (r"blocks\.(\d+)\.ffn\.(gate|up|down)_proj\.weight", r"layers.\1.mlp.\2_proj.weight")], source)
    return config, table


def make_divisible(v: float, divisor: int, min_value: int | None = None) -> int:
    """OpenELM's rounding of a width to a multiple of divisor (never more than 10% below v)."""
    min_value = divisor if min_value is None else min_value
    new_v = max(min_value, int(v + divisor / 2) // divisor * divisor)
    return new_v + divisor if new_v < 0.9 * v else new_v


def openelm_widths(raw: dict, source: str) -> tuple[list[int], list[int], list[int]]:
    """Per-layer query heads, key/value heads and FFN widths, derived exactly as seed 003's config does."""
    layers, model_dim = int(need(raw, "num_transformer_layers", source)), int(need(raw, "model_dim", source))
    head_dim, groups = int(need(raw, "head_dim", source)), int(raw.get("num_gqa_groups", 1))

    def multipliers(value, name):
        if isinstance(value, (int, float)):
            return [value] * layers
        if len(value) == 2:  # layer-wise scaling: linspace from first to last layer, rounded to 2 decimals
            return [round(float(v), 2) for v in np.linspace(value[0], value[1], num=layers, dtype=float)]
        if name == "ffn_multipliers" and len(value) == layers:
            return list(value)
        raise CheckpointError(f"{source}: {name} needs 1, 2 or (ffn only) {layers} entries, got {len(value)}")

    q_dims = [int(make_divisible(model_dim * m, head_dim * groups))
              for m in multipliers(raw.get("qkv_multipliers", 1.0), "qkv_multipliers")]
    q_heads = [q // head_dim for q in q_dims]
    kv_heads = [h // groups for h in q_heads]
    ffn = [int(make_divisible(m * model_dim, int(raw.get("ffn_dim_divisor", 256))))
           for m in multipliers(raw.get("ffn_multipliers", 4.0), "ffn_multipliers")]
    return q_heads, kv_heads, ffn


def openelm(folder: str, raw: dict, source: str):
    """Seed 003: per-layer widths, fused qkv [q heads, k heads, v heads], q/k RMSNorm with one shared [D] gain,
    proj_1 = [gate, up], eps 1e-6, shared input/output embedding."""
    if not raw.get("ffn_with_glu", True) or raw.get("activation_fn_name", "swish") not in ("swish", "silu"):
        raise CheckpointError(f"{source}: only the GLU feed-forward with swish activation is supported")
    if raw.get("normalization_layer_name", "rms_norm") != "rms_norm":
        raise CheckpointError(f"{source}: only normalization_layer_name 'rms_norm' is supported")
    q_heads, kv_heads, ffn = openelm_widths(raw, source)
    D, tied = int(raw["head_dim"]), bool(raw.get("share_input_output_layers", False))
    config = DenseConfig(
        vocab_size=int(need(raw, "vocab_size", source)), hidden_size=int(raw["model_dim"]),
        num_hidden_layers=len(q_heads), num_attention_heads=q_heads, num_key_value_heads=kv_heads, head_dim=D,
        intermediate_size=ffn, max_position_embeddings=int(raw.get("max_context_length", 2048)),
        rope_theta=float(raw.get("rope_freq_constant", 10000)), rope_precision="float32", norm_eps=1e-6,
        qk_norm="shared" if raw.get("normalize_qk_projections", False) else "none", attn_output_gate=False,
        tie_word_embeddings=tied)
    table = rename(hf_weights(folder), [
        (r"transformer\.token_embeddings\.weight", "embed_tokens.weight"), (r"transformer\.norm\.weight", "norm.weight"),
        (r"lm_head\.weight", None if tied else "lm_head.weight"),
        (r"transformer\.layers\.(\d+)\.(attn_norm)\.weight", r"layers.\1.\2.weight"),
        (r"transformer\.layers\.(\d+)\.ffn_norm\.weight", r"layers.\1.mlp_norm.weight"),
        (r"transformer\.layers\.(\d+)\.attn\.(q_norm|k_norm)\.weight", r"layers.\1.attn.\2.weight"),
        (r"transformer\.layers\.(\d+)\.attn\.qkv_proj\.weight", r"layers.\1.attn.qkv.weight"),
        (r"transformer\.layers\.(\d+)\.attn\.out_proj\.weight", r"layers.\1.attn.o_proj.weight"),
        (r"transformer\.layers\.(\d+)\.ffn\.proj_1\.weight", r"layers.\1.mlp.proj_1.weight"),
        (r"transformer\.layers\.(\d+)\.ffn\.proj_2\.weight", r"layers.\1.mlp.down_proj.weight")], source)
    for i, (h, kv, w) in enumerate(zip(q_heads, kv_heads, ffn)):
        a = f"layers.{i}.attn."
        split_rows(table, a + "qkv.weight", {a + "q_proj.weight": (0, h * D), a + "k_proj.weight": (h * D, (h + kv) * D),
                                             a + "v_proj.weight": ((h + kv) * D, (h + 2 * kv) * D)})
        m = f"layers.{i}.mlp."
        split_rows(table, m + "proj_1.weight", {m + "gate_proj.weight": (0, w), m + "up_proj.weight": (w, 2 * w)})
    return config, table


def neox_config(hidden: int, heads: int, layers: int, vocab: int, ffn: int, rotary_pct: float, base: float,
                context: int, eps: float, parallel: bool, tied: bool) -> DenseConfig:
    head_dim = hidden // heads
    return DenseConfig(
        vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads, head_dim=head_dim,
        intermediate_size=ffn, max_position_embeddings=context, rope_theta=base, rope_precision="float32",
        rotary_dim=int(head_dim * rotary_pct), norm="layernorm", norm_eps=eps, qk_norm="none", attn_output_gate=False,
        mlp="gelu", bias=True, parallel_residual=parallel, tie_word_embeddings=tied)


def split_neox_qkv(table: dict, config: DenseConfig) -> None:
    """query_key_value rows are [head, (q, k, v), head_dim]: split them per head."""
    H, D = config.num_attention_heads, config.head_dim
    for i in range(config.num_hidden_layers):
        a = f"layers.{i}.attn."
        for kind in ("weight", "bias"):
            split_rows(table, a + f"qkv.{kind}", {a + f"{p}_proj.{kind}": j for j, p in enumerate("qkv")}, view=(H, 3, D))


NEOX_RULES = [
    (r"(?:gpt_neox\.)?embed_in\.weight", "embed_tokens.weight"), (r"embed_out\.weight", "lm_head.weight"),
    (r"(?:gpt_neox\.)?final_layer_norm\.(weight|bias)", r"norm.\1"),
    (r"(?:gpt_neox\.)?layers\.(\d+)\.input_layernorm\.(weight|bias)", r"layers.\1.attn_norm.\2"),
    (r"(?:gpt_neox\.)?layers\.(\d+)\.post_attention_layernorm\.(weight|bias)", r"layers.\1.mlp_norm.\2"),
    (r"(?:gpt_neox\.)?layers\.(\d+)\.attention\.query_key_value\.(weight|bias)", r"layers.\1.attn.qkv.\2"),
    (r"(?:gpt_neox\.)?layers\.(\d+)\.attention\.dense\.(weight|bias)", r"layers.\1.attn.o_proj.\2"),
    (r"(?:gpt_neox\.)?layers\.(\d+)\.mlp\.dense_h_to_4h\.(weight|bias)", r"layers.\1.mlp.up_proj.\2"),
    (r"(?:gpt_neox\.)?layers\.(\d+)\.mlp\.dense_4h_to_h\.(weight|bias)", r"layers.\1.mlp.down_proj.\2")]


def gpt_neox(folder: str, raw: dict, source: str):
    """Seed 004, Hugging Face layout: LayerNorm with bias, per-head fused qkv, partial rotary, parallel residual,
    exact GELU."""
    if raw.get("hidden_act", "gelu") != "gelu":
        raise CheckpointError(f"{source}: hidden_act {raw['hidden_act']!r} is not supported (only exact 'gelu')")
    rope = raw.get("rope_parameters") or {}
    rotary_pct = rope.get("partial_rotary_factor", raw.get("rotary_pct", raw.get("partial_rotary_factor", 0.25)))
    base = rope.get("rope_theta", raw.get("rotary_emb_base", raw.get("rope_theta", 10000)))
    tied = bool(raw.get("tie_word_embeddings", False))
    hidden = int(need(raw, "hidden_size", source))
    config = neox_config(hidden, int(need(raw, "num_attention_heads", source)),
                         int(need(raw, "num_hidden_layers", source)), int(need(raw, "vocab_size", source)),
                         int(raw.get("intermediate_size", 4 * hidden)), float(rotary_pct), float(base),
                         int(raw.get("max_position_embeddings", 2048)), float(raw.get("layer_norm_eps", 1e-5)),
                         bool(raw.get("use_parallel_residual", True)), tied)
    rules = [(p, None if tied and t == "lm_head.weight" else t) for p, t in NEOX_RULES]
    table = rename(hf_weights(folder), rules, source)
    split_neox_qkv(table, config)
    return config, table


def llama(folder: str, raw: dict, source: str):
    """Hugging Face Llama (SmolLM2, TinyLlama, Llama 2/3 layout): GQA, RMSNorm, rotate-half RoPE, rope_theta."""
    if raw.get("rope_scaling"):
        raise CheckpointError(f"{source}: rope_scaling {raw['rope_scaling']!r} is not supported")
    if raw.get("attention_bias") or raw.get("mlp_bias"):
        raise CheckpointError(f"{source}: attention_bias / mlp_bias are not supported")
    if raw.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"{source}: hidden_act {raw['hidden_act']!r} is not supported (only 'silu')")
    hidden, heads = int(need(raw, "hidden_size", source)), int(need(raw, "num_attention_heads", source))
    tied = bool(raw.get("tie_word_embeddings", False))
    rope = raw.get("rope_parameters") or {}
    config = DenseConfig(
        vocab_size=int(need(raw, "vocab_size", source)), hidden_size=hidden,
        num_hidden_layers=int(need(raw, "num_hidden_layers", source)), num_attention_heads=heads,
        num_key_value_heads=int(raw.get("num_key_value_heads") or heads), head_dim=int(raw.get("head_dim") or hidden // heads),
        intermediate_size=int(need(raw, "intermediate_size", source)),
        max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
        rope_theta=float(rope.get("rope_theta", raw.get("rope_theta", 10000.0))), rope_precision="float32",
        norm_eps=float(raw.get("rms_norm_eps", 1e-6)), qk_norm="none", attn_output_gate=False, tie_word_embeddings=tied)
    table = rename(hf_weights(folder), [
        (r"model\.embed_tokens\.weight", "embed_tokens.weight"), (r"model\.norm\.weight", "norm.weight"),
        (r"lm_head\.weight", None if tied else "lm_head.weight"),
        (r"model\.layers\.(\d+)\.input_layernorm\.weight", r"layers.\1.attn_norm.weight"),
        (r"model\.layers\.(\d+)\.post_attention_layernorm\.weight", r"layers.\1.mlp_norm.weight"),
        (r"model\.layers\.(\d+)\.self_attn\.([qkvo]_proj)\.weight", r"layers.\1.attn.\2.weight"),
        (r"model\.layers\.(\d+)\.mlp\.(gate|up|down)_proj\.weight", r"layers.\1.mlp.\2_proj.weight")], source)
    return config, table


# -- GPT-NeoX original two-way tensor-parallel release ------------------------------------------------------------

NEOX_20B = dict(num_layers=44, hidden_size=6144, num_attention_heads=64, rotary_pct=0.25, rotary_emb_base=10000,
                max_position_embeddings=2048, layernorm_epsilon=1e-5, gpt_j_residual=True, no_weight_tying=True)


def neox_yaml(folder: str) -> dict:
    """The NeoX YAML config (configs/*.yml) with '-' in keys read as '_'; seed 004's 20B sizes when absent."""
    files = sorted(glob.glob(os.path.join(folder, "configs", "*.yml")) + glob.glob(os.path.join(folder, "*.yml")))
    values = dict(NEOX_20B)
    for path in files:
        import yaml

        try:
            with open(path) as f:
                data = yaml.safe_load(f) or {}
        except yaml.YAMLError as e:
            raise CheckpointError(f"{path}: not valid YAML ({str(e).splitlines()[0]})") from None
        values.update({k.replace("-", "_"): v for k, v in data.items()})
    return values


def neox_original(folder: str, rank: int | None = None):
    """Seed 004's merge: column-parallel weights/biases, the embedding and the readout concatenated on dim 0,
    row-parallel weights on dim 1, row-parallel biases summed, norms checked equal across the shards. Files are read
    a layer (two shards) at a time. rank 0 or 1 (two-way tensor parallel, tp.py): the blocks' tensors are that
    shard's own, unmerged (its row-parallel bias too: the ranks' all-reduce sums them as the merge would)."""
    steps = sorted(glob.glob(os.path.join(folder, "global_step*")))
    latest = os.path.join(folder, "latest")
    if os.path.isfile(latest):
        with open(latest) as f:
            steps = [os.path.join(folder, f.read().strip())]
    step = steps[-1]
    raw = neox_yaml(folder)
    layers = int(raw["num_layers"])

    @functools.lru_cache(maxsize=2)  # at most two layers' shards (memory-mapped) at a time
    def shards(layer: int):
        files = [os.path.join(step, f"layer_{layer:02d}-model_0{r}-model_states.pt") for r in (0, 1)]
        for f in files:
            if not os.path.isfile(f):
                raise CheckpointError(f"{step}: missing shard {os.path.basename(f)}")
        return load_pickle(files[0]), load_pickle(files[1])

    @functools.lru_cache(maxsize=1)
    def own(layer: int):  # this rank's shard of a layer
        return load_pickle(os.path.join(step, f"layer_{layer:02d}-model_0{rank}-model_states.pt"))

    def merged(layer: int, name: str, how: str):
        def read():
            if rank is not None and 2 <= layer < layers + 2:  # a block's tensor: this shard's own
                return own(layer)[name]
            p1, p2 = shards(layer)
            if name not in p1 or name not in p2:
                raise CheckpointError(f"{step}: layer {layer:02d} shards lack tensor {name!r}")
            a, b = p1[name], p2[name]
            if how == "same":
                if not torch.equal(a, b):
                    raise CheckpointError(f"{step}: {name!r} of layer {layer:02d} differs between the two shards")
                return a
            return a + b if how == "sum" else torch.cat((a, b), dim=0 if how == "dim0" else 1)
        return read

    def shape(layer: int, name: str):
        return shards(layer)[0][name].shape

    hidden, heads = int(raw["hidden_size"]), int(raw["num_attention_heads"])
    vocab = 2 * shape(0, "word_embeddings.weight")[0]
    ffn = 2 * shape(2, "mlp.dense_h_to_4h.weight")[0]
    tied = not raw.get("no_weight_tying", True)
    config = neox_config(hidden, heads, layers, vocab, ffn, float(raw["rotary_pct"]), float(raw["rotary_emb_base"]),
                         int(raw.get("max_position_embeddings") or raw.get("seq_length") or 2048),
                         float(raw["layernorm_epsilon"]), bool(raw["gpt_j_residual"]), tied)
    table = {"embed_tokens.weight": merged(0, "word_embeddings.weight", "dim0")}
    parts = {"attn_norm": ("input_layernorm", "same", "same"), "mlp_norm": ("post_attention_layernorm", "same", "same"),
             "attn.qkv": ("attention.query_key_value", "dim0", "dim0"), "attn.o_proj": ("attention.dense", "dim1", "sum"),
             "mlp.up_proj": ("mlp.dense_h_to_4h", "dim0", "dim0"), "mlp.down_proj": ("mlp.dense_4h_to_h", "dim1", "sum")}
    for i in range(layers):
        for native, (theirs, weight_how, bias_how) in parts.items():
            table[f"layers.{i}.{native}.weight"] = merged(i + 2, f"{theirs}.weight", weight_how)
            table[f"layers.{i}.{native}.bias"] = merged(i + 2, f"{theirs}.bias", bias_how)
    table["norm.weight"] = merged(layers + 3, "norm.weight", "same")
    table["norm.bias"] = merged(layers + 3, "norm.bias", "same")
    if not tied:
        table["lm_head.weight"] = merged(layers + 4, "final_linear.weight", "dim0")
    split_neox_qkv(table, config if rank is None else dataclasses.replace(config, num_attention_heads=heads // 2))
    return config, table


# ----------------------------------------------------------------------------------------------------------------
# Dispatch


def read_foreign(path: str) -> Checkpoint:
    """A non-native checkpoint as a Checkpoint (no record)."""
    if os.path.isfile(path) and path.endswith(".gguf"):
        import gguf_import

        return gguf_import.read_gguf(path)
    if os.path.isfile(path):
        return read_torch_file(path, None)
    if glob.glob(os.path.join(path, "global_step*")):
        config, table = neox_original(path)
        return Checkpoint(path, config, table)
    config_file = os.path.join(path, "config.json")
    if os.path.isfile(config_file):
        raw = read_json(config_file)
        declared = torch_dtype(raw.get("torch_dtype") or raw.get("dtype"))
        model_type = raw.get("model_type")
        families = {"openelm": openelm, "gpt_neox": gpt_neox, "llama": llama}
        if model_type in families:
            config, table = families[model_type](path, raw, config_file)
            return Checkpoint(path, config, table, declared)
        if model_type is None and "dim" in raw:  # a Sprout state dict beside its config.json
            weights = [os.path.join(path, n) for n in ("model.safetensors", "model.pt", "ckpt.pt", "pytorch_model.bin")]
            weights = [w for w in weights if os.path.isfile(w)]
            if not weights:
                raise CheckpointError(f"{path}: no model.safetensors or model.pt beside config.json")
            return read_torch_file(weights[0], raw)
        raise CheckpointError(f"{config_file}: unknown model_type {model_type!r} (supported: "
                              f"{', '.join(families)}, or a native dense config)")
    for name in ("ckpt.pt", "checkpoint.pt"):
        if os.path.isfile(os.path.join(path, name)):
            return read_torch_file(os.path.join(path, name), None)
    ggufs = glob.glob(os.path.join(path, "*.gguf"))
    if len(ggufs) == 1:
        return read_foreign(ggufs[0])
    raise CheckpointError(f"{path}: not a checkpoint folder (no config.json, ckpt.pt, checkpoint.pt or .gguf)")


def read_torch_file(path: str, raw: dict | None) -> Checkpoint:
    """Sprout's ckpt.pt, GermanGPT's checkpoint.pt, or a plain state dict (.pt/.safetensors) with its config."""
    if path.endswith(".safetensors"):
        state = {n: f() for n, f in open_safetensors(path).items()}
    else:
        state = load_pickle(path)
    if raw is None:
        if not isinstance(state, dict) or not isinstance(state.get("config"), dict) or "model" not in state:
            raise CheckpointError(f"{path}: expected a dict with 'model' (state dict) and 'config'")
        raw, state = state["config"], state["model"]
    elif isinstance(state, dict) and isinstance(state.get("model"), dict):
        state = state["model"]
    if "d_model" in raw:
        config, table = germangpt(raw, state, path)
    elif "dim" in raw:
        config, table = sprout(raw, state, path)
    else:
        raise CheckpointError(f"{path}: config has neither 'dim' (Sprout) nor 'd_model' (GermanGPT)")
    return Checkpoint(path, config, table)


# ----------------------------------------------------------------------------------------------------------------
# Writing a native folder


def atomic_write(path: str, write) -> None:
    """write(tmp_path) then rename over path: a reader never sees a half-written file."""
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-", suffix=os.path.basename(path))
    os.close(fd)
    try:
        write(tmp)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp creates 0600; give the file the permissions a plain open() would
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


class locked:
    """An exclusive lock on `path` + ".lock" (fcntl.flock; released when the process dies) for read-modify-write
    steps that other processes may run at the same time: converting the default model, recording a variant."""

    def __init__(self, path: str) -> None:
        self.path = path + ".lock"

    def __enter__(self):
        import fcntl

        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        self.handle = open(self.path, "a")
        fcntl.flock(self.handle, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc) -> None:
        self.handle.close()  # closing releases the lock


def tokenizer_sources(src: str) -> dict[str, str]:
    """{native file name: source path} for the tokenizer files that travel with a checkpoint."""
    folder = src if os.path.isdir(src) else os.path.dirname(src)
    found = {n: os.path.join(folder, n) for n in TOKENIZER_FILES if os.path.isfile(os.path.join(folder, n))}
    neox = os.path.join(folder, "20B_tokenizer.json")
    if "tokenizer.json" not in found and os.path.isfile(neox):
        found["tokenizer.json"] = neox
    return found


def side_files(src: str) -> dict:
    """{file name: writer(path)} for the tokenizer and generation files that travel with a checkpoint: copied from
    beside SRC, or, for a GGUF, rebuilt from its metadata (tokenizer.json, tokenizer_config.json, ...)."""
    writers = {name: (lambda p, s=path: shutil.copyfile(s, p)) for name, path in tokenizer_sources(src).items()}
    if os.path.isfile(src) and src.endswith(".gguf"):
        import gguf_import

        writers.update({name: (lambda p, t=text: open(p, "w").write(t))
                        for name, text in gguf_import.side_files(src).items()})
    return writers


def convert(src: str, dst: str, force: bool = False, dtype: torch.dtype | None = None, progress=None) -> None:
    """Write DST/config.json + DST/model.safetensors (+ tokenizer files) from any supported SRC. A GGUF source's
    tensor types are recorded in config.json, and its Q4_0 / Q4_1 blocks also become DST/model.int4.safetensors, bit
    for bit (what `--quant auto` loads)."""
    import quantize

    checkpoint = read_checkpoint(src)
    dtype = dtype or checkpoint.dtype
    extra = side_files(src)
    os.makedirs(dst, exist_ok=True)
    clash = [n for n in ("config.json", "model.safetensors", *extra) if os.path.exists(os.path.join(dst, n))]
    if clash and not force:
        raise CheckpointError(f"{dst}: {clash[0]} already exists (use --force to overwrite)")
    tensors = {}
    for i, (name, read) in enumerate(checkpoint.tensors.items()):
        t = read()
        tensors[name] = (t.to(dtype) if dtype is not None and t.is_floating_point() else t).contiguous()
        if progress:
            progress(i + 1, len(checkpoint.tensors))
    write_native(dst, checkpoint.config, tensors, dtype, source_record(checkpoint))
    del tensors
    for name, write in extra.items():
        atomic_write(os.path.join(dst, name), write)
    blocks = {n.removesuffix(".weight") for n in checkpoint.source_types if quantize.BLOCK_LINEAR.fullmatch(n[:-7])}
    if blocks and blocks <= set(checkpoint.exact_int4):
        quantize.write_variant(read_checkpoint(dst), "int4", dst, {"group_size": 32}, exact=checkpoint.exact_int4)


def source_record(checkpoint: Checkpoint) -> dict:
    """{"source_format", "source_tensor_types": {"blocks": {type: count}, "other": {type: count}}} for a GGUF."""
    if not checkpoint.source_types:
        return {}
    import collections

    import quantize

    kinds = {"blocks": collections.Counter(), "other": collections.Counter()}
    for name, kind in checkpoint.source_types.items():
        kinds["blocks" if quantize.BLOCK_LINEAR.fullmatch(name.removesuffix(".weight")) else "other"][kind] += 1
    return {"source_format": "gguf", "source_tensor_types": {k: dict(v) for k, v in kinds.items()}}


def write_native(dst: str, config: DenseConfig, tensors: dict[str, torch.Tensor], dtype=None,
                 record: dict | None = None) -> None:
    """DST/model.safetensors and DST/config.json, each written to a temporary file and renamed into place."""
    from safetensors.torch import save_file

    os.makedirs(dst, exist_ok=True)
    atomic_write(os.path.join(dst, "model.safetensors"), lambda p: save_file(tensors, p, metadata={"format": "pt"}))
    values = {**config.to_dict(), **(record or {})}
    if dtype is not None:
        values["torch_dtype"] = str(dtype).removeprefix("torch.")
    atomic_write(os.path.join(dst, "config.json"), lambda p: open(p, "w").write(json.dumps(values, indent=2) + "\n"))


def report_errors(action, debug: bool) -> int:
    """Run action(); a CheckpointError or OSError becomes one line on stderr and exit status 2 (--debug: traceback)."""
    try:
        action()
    except (CheckpointError, OSError) as e:
        if debug:
            raise
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Convert a checkpoint of any supported family to the native format.")
    parser.add_argument("src", help="checkpoint folder or file (.pt, .gguf, ...)")
    parser.add_argument("dst", help="output folder (config.json + model.safetensors + tokenizer files)")
    parser.add_argument("--force", action="store_true", help="overwrite files that already exist in DST")
    parser.add_argument("--dtype", choices=("float32", "float16", "bfloat16"), help="cast the weights")
    parser.add_argument("--debug", action="store_true", help="show tracebacks")
    args = parser.parse_args(argv)
    status = report_errors(lambda: convert(args.src, args.dst, args.force, torch_dtype(args.dtype)), args.debug)
    if status == 0:
        print(f"wrote {args.dst}")
    return status


if __name__ == "__main__":
    sys.exit(main())
