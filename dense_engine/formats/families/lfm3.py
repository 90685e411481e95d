"""lfm3.py: LFM3 (a Hugging Face folder, lfm3): LFM2's short convs between sliding and full attention layers (Qwen3's
q/k norms per head; a sigmoid gate per head from the layer's input, use_attention_gate), norms before and after each
branch (use_sandwich_norm), default rope on the sliding layers and proportional rope on the full ones (as Gemma 4's).
"""

from __future__ import annotations

from dense_engine.formats.checkpoint import make_config
from dense_engine.formats.families.common import ConfigReader, hf_weights, rename
from dense_engine.formats.families.lfm2 import LIQUID_LAYER, liquid_rules


def read_hf(folder: str, raw: dict, source: str):
    """LFM3's folder."""
    cfg = ConfigReader(raw, source)
    layers = int(cfg.need("num_hidden_layers"))
    types = cfg.get("layer_types") or ["full_attention" if i % 4 == 2 else "sliding_attention" if i % 4 == 0 and i
                                       else "conv" for i in range(layers)]
    if cfg.get("conv_bias", False):
        cfg.refuse("conv_bias", "a conv bias is not supported")
    rope = cfg.get("rope_parameters") or {}
    global_rope, local_rope = dict(rope.get("full_attention") or {}), dict(rope.get("sliding_attention") or {})
    if local_rope.pop("rope_type", "default") != "default" or set(local_rope) - {"rope_theta"} or global_rope.get(
            "rope_type", "default") not in ("default", "proportional") or set(global_rope) - {
            "rope_type", "rope_theta", "partial_rotary_factor"}:
        cfg.refuse("rope_parameters", "default rope on the sliding layers, proportional or default on the full ones")
    hidden, heads = int(cfg.need("hidden_size")), int(cfg.need("num_attention_heads"))
    proportional = global_rope.get("rope_type") == "proportional"
    config = make_config(
        source, vocab_size=int(cfg.need("vocab_size")), hidden_size=hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=int(cfg.get("num_key_value_heads", heads)),
        head_dim=int(cfg.get("head_dim") or hidden // heads), intermediate_size=int(cfg.need("intermediate_size")),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 128000)), layer_types=types,
        rope_theta=float(global_rope.get("rope_theta", 1e6)), rope_local_theta=float(local_rope.get("rope_theta", 1e4)),
        rope_scaling={"rope_type": "proportional", "partial_rotary_factor": float(global_rope.get(
            "partial_rotary_factor", 1.0))} if proportional else None,
        sliding_window=int(cfg.get("sliding_window", 256)), conv_kernel=int(cfg.get("conv_L_cache", 7)),
        qk_norm="shared", attn_head_gate=bool(cfg.get("use_attention_gate", True)),
        post_norms=bool(cfg.get("use_sandwich_norm", True)), norm_eps=float(cfg.get("norm_eps", 1e-5)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)))
    if cfg.get("attention_bias", False):
        cfg.refuse("attention_bias", "LFM3 has no biases")
    cfg.check_unread()
    return config, rename(hf_weights(folder), liquid_rules(config) + [
        (LIQUID_LAYER + r"post_operator_norm\.weight", r"layers.\1.mixer_post_norm.weight"),
        (LIQUID_LAYER + r"post_ffn_norm\.weight", r"layers.\1.mlp_post_norm.weight"),
        (LIQUID_LAYER + r"self_attn\.([qkvo]_proj|[qk]_norm|gate_proj)\.weight", r"layers.\1.mixer.\2.weight"),
        (LIQUID_LAYER + r"self_attn\.g_proj\.weight", r"layers.\1.mixer.gate_proj.weight")], source)

