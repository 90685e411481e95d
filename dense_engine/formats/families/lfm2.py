"""lfm2.py: LFM2 (Liquid AI), gated short convs between attention layers (q/k norms, no output gate), a SwiGLU whose
width the config may adjust (block_auto_adjust_ff_dim), the final norm named embedding_norm; LFM2-MoE (lfm2_moe,
LFM2-8B-A1B): the same layers, SwiGLU experts past the first num_dense_layers (a sigmoid router, a choice bias;
experts.py). A Hugging Face folder (lfm2, lfm2_moe) or a GGUF file (lfm2: short-conv layers where
attention.head_count_kv is 0; the final norm is token_embd_norm). The names LFM3 shares (liquid_rules).
"""

from __future__ import annotations

from dense import DenseConfig
from dense_engine.formats.families.common import ConfigReader, hf_weights, model_rules, rename
from dense_engine.formats.families.experts import hf_experts, stack_experts
from dense_engine.formats.families.hybrid import ATTENTION_TENSORS, gguf_state_config, state_config, state_layer
from dense_engine.formats.gguf_import import Architecture, Metadata

LIQUID_LAYER = r"model\.layers\.(\d+)\."


def liquid_rules(config: DenseConfig) -> list:
    """The names LFM2 and LFM3 share: embedding_norm the final norm, operator_norm and ffn_norm the branches'
    pre-norms, conv.* the short conv, feed_forward.w1 / w3 / w2 the SwiGLU's gate, up and down."""
    layer = LIQUID_LAYER
    return [*model_rules(config.tie_word_embeddings, norm="embedding_norm"),
            (layer + r"operator_norm\.weight", r"layers.\1.mixer_norm.weight"),
            (layer + r"ffn_norm\.weight", r"layers.\1.mlp_norm.weight"),
            (layer + r"conv\.(in_proj|out_proj)\.weight", r"layers.\1.mixer.\2.weight"),
            (layer + r"conv\.conv\.weight", r"layers.\1.mixer.conv_weight"),
            (layer + r"feed_forward\.w1\.weight", r"layers.\1.mlp.gate_proj.weight"),
            (layer + r"feed_forward\.w3\.weight", r"layers.\1.mlp.up_proj.weight"),
            (layer + r"feed_forward\.w2\.weight", r"layers.\1.mlp.down_proj.weight")]


def read_hf(folder: str, raw: dict, source: str):
    """LFM2's folder, or LFM2-MoE's."""
    cfg = ConfigReader(raw, source)
    layers = int(cfg.need("num_hidden_layers"))
    full = cfg.get("full_attn_idxs")
    types = cfg.get("layer_types") or ["full_attention" if full is None or i in full else "conv"
                                       for i in range(layers)]
    experts = hf_experts(cfg, "lfm2_moe", layers) if raw.get("model_type") == "lfm2_moe" else None
    if experts:  # (LFM2-MoE's dense layers: intermediate_size as given; no block_* key is read)
        width = int(cfg.need("intermediate_size"))
    else:
        width = int(cfg.get("block_ff_dim") or cfg.need("intermediate_size"))
        multiplier, multiple = cfg.get("block_ffn_dim_multiplier"), int(cfg.get("block_multiple_of", 256))
        if cfg.get("block_auto_adjust_ff_dim", True):  # (transformers' rule, rounded as it rounds; else: as given)
            width = int(2 * width / 3)
            if multiplier is not None:
                width = multiple * ((int(float(multiplier) * width) + multiple - 1) // multiple)
    if cfg.get("conv_bias", False):
        cfg.refuse("conv_bias", "LFM2 releases have no conv biases")
    config = state_config(cfg, layers, intermediate_size=width, layer_types=types,
                          conv_kernel=int(cfg.get("conv_L_cache", 3)), norm_eps=float(cfg.get("norm_eps", 1e-5)),
                          tie_word_embeddings=bool(cfg.get("tie_word_embeddings", cfg.get("tie_embedding", True))),
                          extras={"experts": experts} if experts else {})
    cfg.check_unread()
    table = rename(hf_weights(folder), liquid_rules(config) + [
        (LIQUID_LAYER + r"self_attn\.([qkv]_proj)\.weight", r"layers.\1.mixer.\2.weight"),
        (LIQUID_LAYER + r"self_attn\.out_proj\.weight", r"layers.\1.mixer.o_proj.weight"),
        (LIQUID_LAYER + r"self_attn\.([qk])_layernorm\.weight", r"layers.\1.mixer.\2_norm.weight"),
        # LFM2-MoE's experts: the router, the choice bias (read past where use_expert_bias is false), the experts one
        # by one (the Hub's w1 / w3 / w2) or stacked (transformers 5's own)
        (LIQUID_LAYER + r"feed_forward\.gate\.weight", r"layers.\1.mlp.router.weight"),
        (LIQUID_LAYER + r"feed_forward\.expert_bias", r"layers.\1.mlp.choice_bias" if experts and experts.choice_bias
         else None),
        (LIQUID_LAYER + r"feed_forward\.experts\.(\d+)\.(w[123])\.weight", r"layers.\1.mlp.expert\2.\3"),
        (LIQUID_LAYER + r"feed_forward\.experts\.(gate_up_proj|down_proj)", r"layers.\1.mlp.stacked.\2")], source)
    if experts:
        stack_experts(table, config, source)
    return config, table


# ----------------------------------------------------------------------------------------------------------------
# GGUF files (lfm2)

# per-layer GGUF tensors (after "blk.N.") -> native names (after "layers.N.")
GGUF_TENSORS = {**ATTENTION_TENSORS, "ffn_norm.weight": "mlp_norm.weight",
                "shortconv.conv.weight": "mixer.conv_weight", "shortconv.in_proj.weight": "mixer.in_proj.weight",
                "shortconv.out_proj.weight": "mixer.out_proj.weight"}


def gguf_kinds(meta: Metadata, kv: list[int], layers: int) -> tuple[list[str], dict]:
    """Short-conv layers where attention.head_count_kv is 0, conv width shortconv.l_cache."""
    types = ["conv" if n == 0 else "full_attention" for n in kv[:layers]]
    return types, {"conv_kernel": int(meta.key("shortconv.l_cache")), "qk_norm": "shared"}


GGUF = Architecture(lambda meta: gguf_state_config(meta, gguf_kinds),
                    lambda config, rest: state_layer(GGUF_TENSORS, rest), final_norm="token_embd_norm.weight")
