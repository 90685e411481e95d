"""olmo_hybrid.py: OLMo hybrid (a Hugging Face folder, olmo_hybrid): Gated DeltaNet layers (q, k, v, the gate g, a and b
each their own projection; beta times 2 where linear_allow_neg_eigval, so the delta rule's eigenvalues may go
negative; an output norm of eps 1e-5, FLA's) with Llama's pre-norms, between full-attention layers as OLMo 3's:
post-norms only, q/k norms over the whole projection, rope. The Hub's names too: attention_layer_norm and
feedforward_layer_norm for input_layernorm and post_attention_layernorm, the conv in q, k and v pieces.
"""

from __future__ import annotations

import torch

from dense_engine.formats.families.common import ConfigReader, hf_weights, model_rules, rename
from dense_engine.formats.families.hybrid import state_config


def read_hf(folder: str, raw: dict, source: str):
    """OLMo hybrid's folder."""
    cfg = ConfigReader(raw, source)
    layers = int(cfg.need("num_hidden_layers"))
    types = cfg.get("layer_types") or ["full_attention" if i % 4 == 3 else "linear_attention" for i in range(layers)]
    heads = int(cfg.need("num_attention_heads"))
    keys, values = int(cfg.get("linear_num_key_heads") or heads), int(cfg.get("linear_num_value_heads") or heads)
    k_dim = int(cfg.get("linear_key_head_dim") or 0.75 * int(cfg.need("hidden_size")) / keys)
    v_dim = int(cfg.get("linear_value_head_dim") or 2 * k_dim)
    if keys != values:
        cfg.refuse("linear_num_value_heads", "OLMo hybrid's delta rule takes as many value heads as key heads")
    for key in ("linear_a_log_min", "linear_a_log_max", "linear_dt_min", "linear_dt_max", "linear_dt_init_floor"):
        cfg.get(key)  # (initialization only)
    attention = [kind == "full_attention" for kind in types]
    config = state_config(
        cfg, layers, intermediate_size=int(cfg.need("intermediate_size")), layer_types=types,
        linear_heads=(keys, values), linear_head_dims=(k_dim, v_dim),
        conv_kernel=int(cfg.get("linear_conv_kernel_dim", 4)),
        linear_beta_scale=2.0 if cfg.get("linear_allow_neg_eigval", True) else 1.0, linear_norm_eps=1e-5,
        norm_eps=float(cfg.get("rms_norm_eps", 1e-6)), qk_norm="whole", pre_norms=[not a for a in attention],
        post_norms=attention, tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)))
    cfg.check_unread()
    layer = r"model\.layers\.(\d+)\."
    rules = [*model_rules(config.tie_word_embeddings),
             (layer + r"(?:input_layernorm|attention_layer_norm)\.weight", r"layers.\1.mixer_norm.weight"),
             (layer + r"(?:post_attention_layernorm|feedforward_layer_norm)\.weight",
              r"layers.\1.post_attention_layernorm"),
             (layer + r"post_feedforward_layernorm\.weight", r"layers.\1.mlp_post_norm.weight"),
             (layer + r"self_attn\.([qkvo]_proj|[qk]_norm)\.weight", r"layers.\1.mixer.\2.weight"),
             (layer + r"linear_attn\.([qkv])_proj\.weight", r"layers.\1.mixer.\2"),
             (layer + r"linear_attn\.([qkv])_conv1d\.weight", r"layers.\1.mixer.\2_conv"),
             (layer + r"linear_attn\.g_proj\.weight", r"layers.\1.mixer.in_proj_z.weight"),
             (layer + r"linear_attn\.([ab])_proj\.weight", r"layers.\1.mixer.in_proj_\2.weight"),
             (layer + r"linear_attn\.o_proj\.weight", r"layers.\1.mixer.out_proj.weight"),
             (layer + r"linear_attn\.o_norm\.weight", r"layers.\1.mixer.norm.weight"),
             (layer + r"linear_attn\.conv1d\.weight", r"layers.\1.mixer.conv_weight"),
             (layer + r"linear_attn\.(A_log|dt_bias)", r"layers.\1.mixer.\2"),
             (layer + r"mlp\.(gate|up|down)_proj\.weight", r"layers.\1.mlp.\2_proj.weight")]
    table = rename(hf_weights(folder), rules, source)
    for i, is_attention in enumerate(attention):  # (the attention's post-norm; a delta layer's MLP pre-norm)
        norm = table.pop(f"layers.{i}.post_attention_layernorm")
        table[f"layers.{i}.mixer_post_norm.weight" if is_attention else f"layers.{i}.mlp_norm.weight"] = norm
        if not is_attention:  # q | k | v: the conv's channels in that order (saved in three pieces, or one)
            q, k, v = (table.pop(f"layers.{i}.mixer.{p}") for p in "qkv")
            table[f"layers.{i}.mixer.in_proj_qkv.weight"] = lambda q=q, k=k, v=v: torch.cat([q(), k(), v()])
            if f"layers.{i}.mixer.q_conv" in table:
                q, k, v = (table.pop(f"layers.{i}.mixer.{p}_conv") for p in "qkv")
                table[f"layers.{i}.mixer.conv_weight"] = lambda q=q, k=k, v=v: torch.cat([q(), k(), v()])
    return config, table
