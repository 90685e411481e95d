"""granite_hybrid.py: Granite 4.0 H (granitemoehybrid): Mamba2 layers with a few attention layers between them,
Granite's multipliers (embedding, residual, attention scale, logits divisor), no position embedding unless the config
or file says rope, the MLP's gate|up rows fused in input_linear; with experts (num_local_experts > 0: Tiny, Small)
that MLP is the shared expert added to theirs (experts.py), their gate|up rows stacked [E, 2I, C] in
block_sparse_moe.input_linear. A Hugging Face folder (granitemoehybrid) or a GGUF file (granitehybrid, dense: Mamba2
layers where attention.head_count_kv is 0, ssm.time_step_rank heads, ssm.group_count groups of ssm.state_size;
ssm_a = -exp(A_log), ssm_d and ssm_norm reshaped, the conv kernels squeezed; attention layers with llama's permuted q/k
rows and no rope unless rope.scaling.finetuned, which llama.cpp takes as true when absent; Granite's four scales).
"""

from __future__ import annotations

import functools

from dense_engine.formats.checkpoint import make_config
from dense_engine.formats.families.common import (
    ConfigReader,
    hf_rope,
    hf_weights,
    model_rules,
    refuse_act,
    rename,
    split_gate_up,
)
from dense_engine.formats.families.experts import hf_experts
from dense_engine.formats.families.hybrid import (
    MAMBA2_TENSORS,
    gguf_state_config,
    mamba2_layer,
    mamba2_values,
    mamba_rules,
    time_step_limit,
)
from dense_engine.formats.gguf_import import Architecture, Metadata


def read_hf(folder: str, raw: dict, source: str):
    """Granite 4.0 H's folder."""
    cfg = ConfigReader(raw, source)
    for key in ("num_experts_per_tok", "router_aux_loss_coef", "intermediate_size", "mamba_chunk_size"):
        cfg.get(key)  # (the experts' settings where there are none, else read below; the chunk a prompt is
        #              scanned in: the same sums)
    hidden, heads = int(cfg.need("hidden_size")), int(cfg.need("num_attention_heads"))
    layers = int(cfg.need("num_hidden_layers"))
    experts = hf_experts(cfg, "granitemoehybrid", layers) if cfg.get("num_local_experts") else None
    kinds = {"mamba": "mamba", "linear_attention": "mamba", "attention": "full_attention",
             "full_attention": "full_attention"}
    given = cfg.get("layer_types") or cfg.get("layers_block_type") or ["mamba"] * layers
    if len(given) != layers or not set(given) <= set(kinds):
        cfg.refuse("layer_types", f"{layers} of 'mamba' / 'attention'")
    m_heads, expand = int(cfg.get("mamba_n_heads", 128)), int(cfg.get("mamba_expand", 2))
    m_dim = cfg.get("mamba_d_head", "auto")
    m_dim = expand * hidden // m_heads if m_dim == "auto" else int(m_dim)
    if m_heads * m_dim != expand * hidden:
        cfg.refuse("mamba_d_head", f"mamba_n_heads x mamba_d_head must be mamba_expand x hidden_size "
                                   f"({expand * hidden})")
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    theta, scaling, rotary, _ = hf_rope(cfg, 1e4, head_dim)
    rope = cfg.get("position_embedding_type") == "rope"
    if rope and scaling is not None:
        cfg.refuse("rope_parameters", "only default rope for this family")
    refuse_act(cfg)
    if cfg.get("attention_bias", False):
        cfg.refuse("attention_bias", "Granite 4.0 H releases have no attention biases")
    config = make_config(
        source, vocab_size=int(cfg.need("vocab_size")), hidden_size=hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=int(cfg.get("num_key_value_heads", heads)), head_dim=head_dim,
        intermediate_size=int(cfg.need("shared_intermediate_size")),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)), rope_theta=theta,
        rotary_dim=rotary, nope_layers=None if rope else list(range(layers)), layer_types=[kinds[k] for k in given],
        mamba_heads=(m_heads, m_dim, int(cfg.get("mamba_n_groups", 1)), int(cfg.get("mamba_d_state", 256))),
        mamba_biases=(bool(cfg.get("mamba_proj_bias", False)), bool(cfg.get("mamba_conv_bias", True))),
        time_step_limit=time_step_limit(cfg),
        conv_kernel=int(cfg.get("mamba_d_conv", 4)), norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        embed_scale=float(cfg.get("embedding_multiplier", 1.0)),
        residual_scale=float(cfg.get("residual_multiplier", 1.0)),
        attn_scale=float(cfg.get("attention_multiplier", 1.0)), logits_divisor=float(cfg.get("logits_scaling", 1.0)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)), extras={"experts": experts} if experts else {})
    cfg.check_unread()
    layer = r"model\.layers\.(\d+)\."
    shared = "mlp.shared." if experts else "mlp."  # (with experts, the MLP is their shared expert)
    rules = [*model_rules(config.tie_word_embeddings),
             (layer + r"input_layernorm\.weight", r"layers.\1.mixer_norm.weight"),
             (layer + r"post_attention_layernorm\.weight", r"layers.\1.mlp_norm.weight"),
             (layer + r"self_attn\.([qkvo]_proj)\.(weight|bias)", r"layers.\1.mixer.\2.\3"),
             *mamba_rules(layer, "mixer."),
             (layer + r"shared_mlp\.input_linear\.weight", rf"layers.\1.{shared}gate_up.weight"),
             (layer + r"shared_mlp\.output_linear\.weight", rf"layers.\1.{shared}down_proj.weight"),
             # the experts, stacked as Experts holds them: the Hub's names, and transformers 5's own
             (layer + r"block_sparse_moe\.(?:input_linear\.weight|experts\.gate_up_proj)",
              r"layers.\1.mlp.experts_gate_up"),
             (layer + r"block_sparse_moe\.(?:output_linear\.weight|experts\.down_proj)", r"layers.\1.mlp.experts_down"),
             (layer + r"block_sparse_moe\.router\.(?:layer\.)?weight", r"layers.\1.mlp.router.weight")]
    table = rename(hf_weights(folder), rules, source)
    for i in range(layers):  # rows: gate | up
        split_gate_up(table, f"layers.{i}.{shared}", config.intermediate_size)
    return config, table


# ----------------------------------------------------------------------------------------------------------------
# GGUF files (granitehybrid)


def gguf_kinds(meta: Metadata, kv: list[int], layers: int) -> tuple[list[str], dict]:
    """Mamba2 layers where attention.head_count_kv is 0; rope unless rope.scaling.finetuned is false."""
    key = meta.key
    types = ["mamba" if n == 0 else "full_attention" for n in kv[:layers]]
    return types, dict(mamba2_values(meta, types.index("mamba") if "mamba" in types else 0),
                       nope_layers=None if key("rope.scaling.finetuned", True) else list(range(layers)),
                       embed_scale=float(key("embedding_scale", 1.0)), residual_scale=float(key("residual_scale", 1.0)),
                       attn_scale=float(key("attention.scale", 0.0)) or None,
                       logits_divisor=float(key("logit_scale", 1.0)), qk_norm="none")


GGUF = Architecture(lambda meta: gguf_state_config(meta, gguf_kinds), functools.partial(mamba2_layer, MAMBA2_TENSORS))
