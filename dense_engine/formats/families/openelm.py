"""openelm.py: OpenELM (a Hugging Face folder, model_type "openelm"): per-layer widths, fused qkv [q heads, k heads,
v heads], q/k RMSNorm with one shared [D] gain, proj_1 = [gate, up], eps 1e-6, shared input/output embedding.
"""

from __future__ import annotations

import numpy as np

from dense_engine.formats.checkpoint import make_config
from dense_engine.formats.families.common import head_rule, hf_weights, need, rename, split_gate_up, split_qkv
from dense_engine.system.errors import CheckpointError


def make_divisible(v: float, divisor: int, min_value: int | None = None) -> int:
    """OpenELM's rounding of a width to a multiple of divisor (never more than 10% below v)."""
    min_value = divisor if min_value is None else min_value
    new_v = max(min_value, int(v + divisor / 2) // divisor * divisor)
    return new_v + divisor if new_v < 0.9 * v else new_v


def openelm_widths(raw: dict, source: str) -> tuple[list[int], list[int], list[int]]:
    """Per-layer query heads, key/value heads and FFN widths, derived exactly as OpenELM's reference config does."""
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


def read_hf(folder: str, raw: dict, source: str):
    """OpenELM's folder."""
    if not raw.get("ffn_with_glu", True) or raw.get("activation_fn_name", "swish") not in ("swish", "silu"):
        raise CheckpointError(f"{source}: only the GLU feed-forward with swish activation is supported")
    if raw.get("normalization_layer_name", "rms_norm") != "rms_norm":
        raise CheckpointError(f"{source}: only normalization_layer_name 'rms_norm' is supported")
    q_heads, kv_heads, ffn = openelm_widths(raw, source)
    D, tied = int(raw["head_dim"]), bool(raw.get("share_input_output_layers", False))
    config = make_config(
        source, vocab_size=int(need(raw, "vocab_size", source)), hidden_size=int(raw["model_dim"]),
        num_hidden_layers=len(q_heads), num_attention_heads=q_heads, num_key_value_heads=kv_heads, head_dim=D,
        intermediate_size=ffn, max_position_embeddings=int(raw.get("max_context_length", 2048)),
        rope_theta=float(raw.get("rope_freq_constant", 10000)), norm_eps=1e-6,
        qk_norm="shared" if raw.get("normalize_qk_projections", False) else "none", tie_word_embeddings=tied)
    table = rename(hf_weights(folder), [
        (r"transformer\.token_embeddings\.weight", "embed_tokens.weight"),
        (r"transformer\.norm\.weight", "norm.weight"), head_rule(tied),
        (r"transformer\.layers\.(\d+)\.attn_norm\.weight", r"layers.\1.mixer_norm.weight"),
        (r"transformer\.layers\.(\d+)\.ffn_norm\.weight", r"layers.\1.mlp_norm.weight"),
        (r"transformer\.layers\.(\d+)\.attn\.(q_norm|k_norm)\.weight", r"layers.\1.mixer.\2.weight"),
        (r"transformer\.layers\.(\d+)\.attn\.qkv_proj\.weight", r"layers.\1.mixer.qkv.weight"),
        (r"transformer\.layers\.(\d+)\.attn\.out_proj\.weight", r"layers.\1.mixer.o_proj.weight"),
        (r"transformer\.layers\.(\d+)\.ffn\.proj_1\.weight", r"layers.\1.mlp.gate_up.weight"),
        (r"transformer\.layers\.(\d+)\.ffn\.proj_2\.weight", r"layers.\1.mlp.down_proj.weight")], source)
    for i, (h, kv, w) in enumerate(zip(q_heads, kv_heads, ffn)):
        split_qkv(table, f"layers.{i}.mixer.", h, kv, D)
        split_gate_up(table, f"layers.{i}.mlp.", w)
    return config, table
