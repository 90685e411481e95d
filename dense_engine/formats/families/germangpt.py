"""germangpt.py: GermanGPT, its reference code's checkpoint (checkpoint.pt {"config": {d_model, n_kv_heads, ...},
"model"}): RMSNorm eps 1e-6, RoPE on interleaved pairs, GQA, tied embeddings when tie_embeddings.
"""

from __future__ import annotations

from dense_engine.formats.checkpoint import eager, make_config
from dense_engine.formats.families.common import head_rule, need, rename
from dense_engine.system.errors import CheckpointError


def read_weights(raw: dict, weights: dict, source: str):
    """(DenseConfig, table) of a GermanGPT state dict and its config."""
    if raw.get("norm", "rmsnorm") != "rmsnorm" or raw.get("mlp", "swiglu") != "swiglu":
        raise CheckpointError(f"{source}: only norm 'rmsnorm' and mlp 'swiglu' exist in GermanGPT")
    d_model, heads = int(need(raw, "d_model", source)), int(raw.get("n_heads", 16))
    tied = bool(raw.get("tie_embeddings", True))
    config = make_config(
        source, vocab_size=int(need(raw, "vocab_size", source)), hidden_size=d_model,
        num_hidden_layers=int(raw.get("n_layers", 24)), num_attention_heads=heads,
        num_key_value_heads=int(raw.get("n_kv_heads", heads)), head_dim=d_model // heads,
        intermediate_size=int(raw.get("d_ff", 2816)), max_position_embeddings=int(raw.get("context_len", 2048)),
        rope_theta=float(raw.get("rope_theta", 10000.0)), rope_layout="interleaved", norm_eps=1e-6,
        tie_word_embeddings=tied)
    table = rename(eager(weights), [
        (r"token_embedding\.weight", "embed_tokens.weight"), (r"norm\.weight", "norm.weight"), head_rule(tied),
        (r"blocks\.(\d+)\.attn_norm\.weight", r"layers.\1.mixer_norm.weight"),
        (r"blocks\.(\d+)\.ffn_norm\.weight", r"layers.\1.mlp_norm.weight"),
        (r"blocks\.(\d+)\.attn\.([qkvo]_proj)\.weight", r"layers.\1.mixer.\2.weight"),
        (r"blocks\.(\d+)\.ffn\.(gate|up|down)_proj\.weight", r"layers.\1.mlp.\2_proj.weight")], source)
    return config, table
