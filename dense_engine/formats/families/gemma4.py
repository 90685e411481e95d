"""gemma4.py: Gemma 4, Gemma 3's layer (post-norms, q/k norms, windows on five layers of six, a local rope base) with:
full layers of their own head size, rotated whole by proportional rope; values normed without gain, or the keys'
projection; the last layers reading the keys and values of the last earlier layer of their kind; per-layer
embeddings; a learned scalar per layer; plain gains in float32; attention scaled by 1; experts beside the MLP
(26B-A4B: enable_moe_block, a Hugging Face folder's only; a GGUF's are refused). A Hugging Face folder (gemma4_text,
or gemma4: the Hub's wrapper) or a GGUF file (gemma4).

What llama.cpp's files hold (gemma4): the sliding and full layers' own head sizes (key_length_swa, key_length) and
key/value heads (head_count_kv per layer), the full layers' partial rotation as `rope_freqs` factors (1 on the rotated
pairs, 1e30 on the rest: proportional rope), per-layer embeddings (per_layer_*), a learned scale per layer
(layer_output_scale), the last shared_kv_layers layers reading keys and values where llama.cpp's code points them
(which must be the last earlier layer of their kind), no attn_v on the full layers when their values are their keys;
norms stored as multiplied (no + 1). Its tokenizer ("gemma4") is vocab.py's.
"""

from __future__ import annotations

import layer_kinds
from dense import DenseConfig
from dense_engine.formats.checkpoint import make_config
from dense_engine.formats.families.common import LAYER_TENSORS, ConfigReader, hf_weights, model_rules, rename
from dense_engine.formats.gguf_import import Architecture, Metadata, dequantized
from dense_engine.system import machine
from dense_engine.system.errors import CheckpointError


def read_hf(folder: str, raw: dict, source: str):
    """gemma4_text, or gemma4 (the Hub's wrapper: text_config, the text model under model.language_model, the vision
    and audio towers skipped with a note): full layers of their own head size (global_head_dim, and
    per_layer_config's key/value heads); values normed without gain, or the keys' projection (attention_k_eq_v); the
    last num_kv_shared_layers layers reading earlier keys and values (and twice as wide an MLP: use_double_wide_mlp);
    enable_moe_block: experts beside every layer's MLP (layer_kinds.ExpertsConfig's beside_mlp and router_norm), as
    transformers saves them: stacked (experts.gate_up_proj [E, 2I, C] gate rows then up rows, as Experts holds them)."""
    wrapped = raw["model_type"] == "gemma4"
    text = dict((raw.get("text_config") or {}) if wrapped else raw)
    cfg = ConfigReader(text, source)
    experts = None
    if cfg.get("enable_moe_block", False):
        count, chosen = int(cfg.need("num_experts")), int(cfg.need("top_k_experts"))
        if not 0 < chosen <= count:
            cfg.refuse("top_k_experts", f"at most the {count} experts")
        experts = layer_kinds.ExpertsConfig(count=count, chosen=chosen, width=int(cfg.need("moe_intermediate_size")),
                                            activation="geglu", router_norm=True, beside_mlp=True)
    hidden, heads, layers = int(cfg.need("hidden_size")), int(cfg.need("num_attention_heads")), \
        int(cfg.need("num_hidden_layers"))
    types = cfg.need("layer_types")
    head_dim, kv = int(cfg.get("head_dim", 256)), int(cfg.get("num_key_value_heads", heads))
    full = [i for i, kind in enumerate(types) if kind == "full_attention"]
    per_layer = {int(i): dict(v) for i, v in (cfg.get("per_layer_config") or {}).items()}
    kv_heads = [int(per_layer.get(i, {}).pop("num_key_value_heads", kv)) for i in range(layers)]
    global_dims = {int(per_layer.get(i, {}).pop("head_dim", head_dim)) for i in full}
    if any(per_layer.values()) or any(i not in full for i in per_layer if "head_dim" in per_layer[i]) or \
            len(global_dims) > 1:
        cfg.refuse("per_layer_config", "only a head size and key/value heads shared by the full layers")
    rope = cfg.get("rope_parameters") or {}
    global_rope, local_rope = dict(rope.get("full_attention") or {}), dict(rope.get("sliding_attention") or {})
    if local_rope.pop("rope_type", "default") != "default" or global_rope.get("rope_type") not in (
            "proportional", "default", None) or set(local_rope) - {"rope_theta"}:
        cfg.refuse("rope_parameters", "proportional rope on the full layers, default on the sliding ones")
    proportional = global_rope.get("rope_type") == "proportional"
    shared = int(cfg.get("num_kv_shared_layers", 0))
    widths = [int(cfg.need("intermediate_size")) * (2 if cfg.get("use_double_wide_mlp") and i >= layers - shared
                                                     else 1) for i in range(layers)]
    if cfg.get("hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
        cfg.refuse("hidden_activation", "Gemma's MLP is gelu_pytorch_tanh")
    for key in ("attention_bias", "use_bidirectional_attention"):
        if cfg.get(key):
            cfg.refuse(key, "Gemma 4's text decoder has neither")
    P = int(cfg.get("hidden_size_per_layer_input", 0) or 0)
    per_layer_vocab = int(cfg.get("vocab_size_per_layer_input", cfg.need("vocab_size")))
    if P and per_layer_vocab != int(cfg.need("vocab_size")):
        cfg.refuse("vocab_size_per_layer_input", "a per-layer table of the vocabulary's size")
    for key in ("num_experts", "top_k_experts", "moe_intermediate_size", "final_logit_softcapping"):
        cfg.get(key)
    config = make_config(
        source, vocab_size=int(cfg.need("vocab_size")), hidden_size=hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
        global_head_dim=global_dims.pop() if full else None, intermediate_size=widths,
        max_position_embeddings=int(cfg.get("max_position_embeddings", 131072)),
        rope_theta=float(global_rope.get("rope_theta", 1e6)),
        rope_scaling={"rope_type": "proportional", "partial_rotary_factor": float(global_rope.get(
            "partial_rotary_factor", 1.0)), **({"factor": global_rope["factor"]} if "factor" in global_rope else {})}
        if proportional else None,
        rope_local_theta=float(local_rope.get("rope_theta", 1e4)), attn_scale=1.0,
        sliding_window=int(cfg.need("sliding_window")), layer_types=types, qk_norm="shared", value_norm=True,
        keys_are_values=bool(cfg.get("attention_k_eq_v", False)), kv_shared_layers=shared,
        norm_eps=float(cfg.get("rms_norm_eps", 1e-6)), norm_gain_in_float32=True, mlp="geglu", post_norms=True,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", cfg.get("tie_word_embeddings", True))),
        embed_scale=hidden ** 0.5, final_softcap=cfg.get("final_logit_softcapping"), per_layer_input=P,
        layer_scalars=True, extras={"experts": experts} if experts else {})
    cfg.check_unread()
    weights = hf_weights(folder)
    towers = sorted({name.split(".")[1] for name in weights if name.startswith("model.") and name.split(".")[1] in (
        "vision_tower", "audio_tower", "embed_vision", "embed_audio")})
    if towers:
        machine.note(f"{source}: {', '.join(towers)} not loaded: this engine reads text")
    top = r"model\.language_model\." if wrapped else r"model\."
    layer = top + r"layers\.(\d+)\."
    readers = "|".join(str(i) for i in range(layers) if layer_kinds.kv_source(config, i) is not None) or "-"
    rules = [(r"model\.(vision_tower|audio_tower|embed_vision|embed_audio)\..*", None),
             (top + rf"layers\.({readers})\.self_attn\.(k_proj|v_proj|k_norm)\.weight", None),  # (unused: read)
             *model_rules(config.tie_word_embeddings, top),
             (top + r"embed_tokens_per_layer\.weight", "embed_per_layer.weight"),
             (top + r"per_layer_model_projection\.weight", "per_layer_projection.weight"),
             (top + r"per_layer_projection_norm\.weight", "per_layer_norm.weight"),
             (layer + r"input_layernorm\.weight", r"layers.\1.mixer_norm.weight"),
             (layer + r"post_attention_layernorm\.weight", r"layers.\1.mixer_post_norm.weight"),
             (layer + r"pre_feedforward_layernorm\.weight", r"layers.\1.mlp_norm.weight"),
             (layer + r"post_feedforward_layernorm\.weight", r"layers.\1.mlp_post_norm.weight"),
             (layer + r"self_attn\.([qkvo]_proj|[qk]_norm)\.weight", r"layers.\1.mixer.\2.weight"),
             (layer + r"mlp\.(gate|up|down)_proj\.weight", r"layers.\1.mlp.\2_proj.weight"),
             (layer + r"per_layer_input_gate\.weight", r"layers.\1.per_layer_gate.weight"),
             (layer + r"per_layer_projection\.weight", r"layers.\1.per_layer_proj.weight"),
             (layer + r"post_per_layer_input_norm\.weight", r"layers.\1.per_layer_norm.weight"),
             (layer + r"layer_scalar", r"layers.\1.layer_scalar"),
             # the experts (enable_moe_block), stacked as transformers saves them
             (layer + r"router\.proj\.weight", r"layers.\1.experts.router.weight"),
             (layer + r"router\.scale", r"layers.\1.experts.router_scale"),
             (layer + r"router\.per_expert_scale", r"layers.\1.experts.expert_scale"),
             (layer + r"experts\.(gate_up|down)_proj", r"layers.\1.experts.experts_\2"),
             (layer + r"pre_feedforward_layernorm_2\.weight", r"layers.\1.experts_norm.weight"),
             (layer + r"post_feedforward_layernorm_2\.weight", r"layers.\1.experts_post_norm.weight"),
             (layer + r"post_feedforward_layernorm_1\.weight", r"layers.\1.mlp_branch_post_norm.weight")]
    return config, rename(weights, rules, source)


# ----------------------------------------------------------------------------------------------------------------
# GGUF files (gemma4)

# per-layer GGUF tensors (after "blk.N.") -> native names (after "layers.N.")
GGUF_TENSORS = {**{f"{k}.weight": f"{v}.weight" for k, v in LAYER_TENSORS.items()},
                "inp_gate.weight": "per_layer_gate.weight", "proj.weight": "per_layer_proj.weight",
                "post_norm.weight": "per_layer_norm.weight", "layer_output_scale.weight": "layer_scalar"}


def gguf_config(meta: Metadata) -> DenseConfig:
    """Gemma 4's config as llama.cpp reads it (the module's docstring says what is where), the switches read_hf
    sets: attention scaled by 1, values normed, tanh-GELU gates, post-norms."""
    key, tensors, path, arch = meta.key, meta.tensors, meta.path, meta.arch

    def per_layer(name: str, default=None) -> list[int]:
        value = key(name, default)
        return [int(n) for n in value] if isinstance(value, list) else [int(value)] * layers

    meta.refuse_experts()
    hidden, heads, layers = int(key("embedding_length")), int(key("attention.head_count")), int(key("block_count"))
    sliding = key("attention.sliding_window_pattern")
    if not isinstance(sliding, list) or len(sliding) < layers:
        raise CheckpointError(f"{path}: GGUF metadata {arch}.attention.sliding_window_pattern: a flag a layer expected")
    types = ["sliding_attention" if flag else "full_attention" for flag in sliding[:layers]]
    head_dim, global_dim = int(key("attention.key_length_swa")), int(key("attention.key_length"))
    for name, want in (("attention.value_length_swa", head_dim), ("attention.value_length", global_dim),
                       ("rope.dimension_count_swa", head_dim), ("rope.dimension_count", global_dim)):
        if int(key(name, want)) != want:
            raise CheckpointError(f"{path}: GGUF metadata {arch}.{name} {key(name)}: {want} expected (the layer's "
                                  "head size)")
    partial = 1.0  # the full layers rotate the pairs whose rope_freqs factor is 1; a factor of 1e30 stops a pair
    if "rope_freqs.weight" in tensors:
        factors = dequantized(tensors["rope_freqs.weight"], path)
        turned = int((factors == 1).sum())
        if len(factors) != global_dim // 2 or not (factors[:turned] == 1).all() or not (factors[turned:] > 1e20).all():
            raise CheckpointError(f"{path}: tensor 'rope_freqs.weight': factors of 1 then 1e30 expected (Gemma 4's "
                                  "partial rotation)")
        partial = 2 * turned / global_dim
    shared = int(key("attention.shared_kv_layers", 0))
    first = layers - shared
    config = make_config(
        path, vocab_size=meta.vocab_size(), hidden_size=hidden,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=per_layer("attention.head_count_kv"),
        head_dim=head_dim, global_head_dim=global_dim if "full_attention" in types else None,
        intermediate_size=per_layer("feed_forward_length"), max_position_embeddings=int(key("context_length", 131072)),
        rope_theta=float(key("rope.freq_base", 1e6)),
        rope_scaling={"rope_type": "proportional", "partial_rotary_factor": partial},
        rope_local_theta=float(key("rope.freq_base_swa", 1e4)), attn_scale=1.0,
        sliding_window=int(key("attention.sliding_window")), layer_types=types, qk_norm="shared", value_norm=True,
        keys_are_values=any(kind == "full_attention" and f"blk.{i}.attn_v.weight" not in tensors
                            for i, kind in enumerate(types[:first])),
        kv_shared_layers=shared, norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-6)),
        norm_gain_in_float32=True, mlp="geglu", post_norms=True, tie_word_embeddings=meta.tied,
        embed_scale=hidden ** 0.5, final_softcap=float(key("final_logit_softcapping", 0.0)) or None,
        per_layer_input=int(key("embedding_length_per_layer_input", 0)), layer_scalars=True)
    for i in range(first, layers):  # llama.cpp's code reads layer first - 2 (sliding) or first - 1 (full)
        source = first - 2 if types[i] == "sliding_attention" else first - 1
        if layer_kinds.kv_source(config, i) != source:
            raise CheckpointError(f"{path}: GGUF metadata {arch}.attention.shared_kv_layers {shared}: llama.cpp has "
                                  f"layer {i} read layer {source}'s keys, not the last earlier {types[i]} layer's")
    return config


def gguf_layer(config: DenseConfig, rest: str) -> list[tuple] | None:
    return [(GGUF_TENSORS[rest], None, None)] if rest in GGUF_TENSORS else None


GGUF = Architecture(gguf_config, gguf_layer)
