"""sprout.py: Sprout, its reference code's checkpoint (ckpt.pt {"model", "config": {vocab_size, dim, n_layers, ...}}, or
a state dict beside its config.json): fused qkv, nn.RMSNorm eps 1e-5, rotate-half RoPE in float32, untied head.
"""

from __future__ import annotations

from dense_engine.formats.checkpoint import eager, make_config
from dense_engine.formats.families.common import need, rename, split_qkv
from dense_engine.system.errors import CheckpointError


def read_weights(raw: dict, weights: dict, source: str):
    """(DenseConfig, table) of a Sprout state dict and its config."""
    weights = {k.removeprefix("_orig_mod."): v for k, v in weights.items()}
    dim, heads = int(need(raw, "dim", source)), int(need(raw, "n_heads", source))
    if "blocks.0.mlp.w_gate.weight" not in weights:
        raise CheckpointError(f"{source}: missing tensor 'blocks.0.mlp.w_gate.weight'")
    config = make_config(
        source, vocab_size=int(need(raw, "vocab_size", source)), hidden_size=dim,
        num_hidden_layers=int(need(raw, "n_layers", source)), num_attention_heads=heads, head_dim=dim // heads,
        intermediate_size=int(weights["blocks.0.mlp.w_gate.weight"].shape[0]),
        max_position_embeddings=int(raw.get("block_size", 1024)), norm_eps=1e-5, norm_gain_in_float32=True)
    table = rename(eager(weights), [
        (r"tok_emb\.weight", "embed_tokens.weight"), (r"norm_f\.weight", "norm.weight"),
        (r"head\.weight", "lm_head.weight"),
        (r"blocks\.(\d+)\.n1\.weight", r"layers.\1.mixer_norm.weight"),
        (r"blocks\.(\d+)\.n2\.weight", r"layers.\1.mlp_norm.weight"),
        (r"blocks\.(\d+)\.attn\.qkv\.weight", r"layers.\1.mixer.qkv.weight"),
        (r"blocks\.(\d+)\.attn\.proj\.weight", r"layers.\1.mixer.o_proj.weight"),
        (r"blocks\.(\d+)\.mlp\.w_(gate|up|down)\.weight", r"layers.\1.mlp.\2_proj.weight")], source)
    for i in range(config.num_hidden_layers):  # rows: q | k | v, dim each
        split_qkv(table, f"layers.{i}.mixer.", heads, heads, dim // heads)
    return config, table
