"""llama.py: Llama and the families laid out as it is (model.layers.N.self_attn.q_proj, ...). They differ in a few
switches and defaults: one table, FAMILIES (model type -> Family), holds them, and serves both their Hugging Face
folders (hf_decoder; image_text for a wrapper around one) and their GGUF files (GGUF: each row's `gguf`
architecture). Adding such a family is adding a row: each switch is a behaviour, read where it applies.

What llama.cpp's converter (convert_hf_to_gguf.py) did that an importer must undo or honour, and what llama.cpp's
model code decides beyond the file (llama-model.cpp, src/models/*.cpp), each where it is read below:
  * llama: q and k rows permuted so rotary can turn adjacent pairs (2i, 2i+1); undone here, back to rotate-half
    pairs (i, i + D/2), the same model (permuted_qk). `rope_freqs.weight` holds Llama 3.x's divisor of each
    frequency.
  * gemma, gemma2, gemma3: every norm weight has the `+1` of Gemma's `(1 + w)` baked in; embeddings times sqrt(hidden);
    tanh-GELU gates. gemma2/3: post-norms, soft-caps (2), windows on the layers llama.cpp's pattern picks (2: every
    other layer; 3: five of six, with `rope.freq_base_swa`), and a query scale fixed by llama.cpp's code, not the file.
  * phi3: q|k|v fused in attn_qkv and gate|up in ffn_up (split here); partial rotary; LongRoPE factors as tensors,
    the long ones for a cache longer than `rope.scaling.original_context_length` (as llama.cpp picks by its context).
"""

from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass

import torch

from dense import DenseConfig
from dense_engine.formats.checkpoint import make_config
from dense_engine.formats.families.common import (
    LAYER_TENSORS,
    ConfigReader,
    gguf_rope_scaling,
    head_rule,
    hf_rope,
    hf_weights,
    rename,
    split_gate_up,
    split_qkv,
)
from dense_engine.formats.families.experts import (
    GGUF_EXPERTS,
    expert_rules,
    gguf_experts,
    hf_experts,
    join_experts,
    stack_experts,
)
from dense_engine.formats.gguf_import import Architecture, Metadata, field, unpermute
from dense_engine.system import machine
from dense_engine.system.errors import CheckpointError


@dataclass(frozen=True)
class Family:
    """What a model type fixes beyond its config file: the defaults transformers uses for absent keys, the behaviours
    that are always on (or on by a config key), and where sliding windows go. One row serves a Hugging Face folder (its
    model_type) and a GGUF file (its llama.cpp architecture, `gguf`, and what llama.cpp decides for it)."""
    eps: float = 1e-6  # the norm eps when the config has none
    tied: bool = False  # tie_word_embeddings when absent
    theta: float = 1e4  # rope_theta when absent
    head_dim: int | None = None  # head_dim when absent (None: hidden / heads); derived: always hidden / heads
    derived_head_dim: bool = False
    rotary_fraction: float = 1.0  # partial_rotary_factor when absent
    gguf: str | None = None  # llama.cpp's architecture name
    # norms
    unit_offset_norms: bool = False  # norms scale by (1 + w) (Gemma; its GGUF files hold 1 + w)
    layer_norms: bool = False  # LayerNorm (eps: layer_norm_eps) instead of RMSNorm (StableLM, Command R)
    norms_without_bias: bool = False  # layer norms without bias: a bias of zeros adds nothing (Command R)
    pre_norms: bool = True
    post_norms: bool = False
    post_attention_is_mlp_norm: bool = False  # with post_norms, post_attention_layernorm is still the MLP's pre-norm
    #                                           and post_self_attn_layernorm the attention's post-norm (GLM-4)
    norm_gain_in_float32: bool = False
    qk_norm: str = "none"
    qk_norm_key: str | None = None  # qk_norm only where this config key is true (StableLM: qk_layernorm)
    norm_after_rope: bool = False  # the q/k norms after the rotary (Hunyuan)
    qk_norms_refused: bool = False  # per-head q/k layer norms (use_qk_norm, a GGUF's attn_q_norm) are refused
    #                                 (Command R+)
    # biases
    qkv_bias: bool = False
    qkv_bias_key: str | None = None  # q/k/v biases where this config key is true (StableLM: use_qkv_bias)
    attention_bias_is_qkv: bool = False  # attention_bias (true when absent) is q/k/v's, attention_out_bias the
    #                                      output's (Seed-OSS, GLM-4)
    # the layer
    parallel: bool = False  # attention and MLP in parallel, from one norm (Command R)
    parallel_key: str | None = None  # parallel where this config key is true (StableLM: use_parallel_residual)
    mlp: str = "swiglu"  # "geglu": tanh-GELU gates (Gemma) | "xielu": down(xielu(up(x))), its parameters learned
    #                      per layer (Apertus)
    # rotary and attention
    interleaved_rope: bool = False  # rotary pairs (2i, 2i + 1) (GLM-4, Command R)
    windows: str = "none"  # "none": a window is refused | "given": as the config says | "flag": only with
    #                        use_sliding_window (Qwen) | "pattern": every layer but each window_pattern-th
    window_pattern: int | None = None
    window: int | None = None  # sliding_window when absent (OLMo 3: 4096)
    softcaps: bool = False  # attention and final logit soft-caps (Gemma 2)
    query_scalar: bool = False  # query_pre_attn_scalar sets the attention scale (Gemma 2/3)
    local_rope: bool = False  # sliding layers rotate with their own base, unscaled (Gemma 3, OLMo 3)
    local_theta: float | None = None  # that base when the config names none (None: the global one)
    nope: bool = False  # some layers have no rope, and those slide (SmolLM3)
    nope_full: bool = False  # with a window, the full layers have no rope (EXAONE 4)
    layer_thetas: bool = False  # layer_rope_theta: a rope base per layer, 0 for none (Granite SWA)
    attn_sinks: bool = False  # a learned logit per head beside the scores (Granite SWA)
    query_scale_past_context: bool = False  # rope_parameters' llama_4_scaling_beta scales queries past the original
    #                                         context (Ministral 3; not run: the context stops there)
    # embeddings and logits
    sqrt_embed_scale: bool = False  # embeddings times sqrt(hidden) (Gemma)
    multipliers: bool = False  # Granite's embedding, attention, residual and logits multipliers
    logit_scale: bool = False  # logits times logit_scale (Command R)
    # what llama.cpp decides for a GGUF file of the family
    permuted_qk: bool = False  # the converter turned q/k rows for its rotary's pairs (undone here)
    whole_heads_rotated: bool = False  # rope.dimension_count must be the head size (llama.cpp's llama)
    fused_gate_up: bool = False  # ffn_up holds gate | up (Phi-3, GLM-4)
    gguf_mlp_norm: str | None = None  # the MLP's pre-norm's name where it is not ffn_norm (Seed-OSS:
    #                                   post_attention_norm)
    head_is_embedding: bool = False  # the head is the embedding, whatever else the file holds (Gemma 1/2, Command R)
    gguf_window: int | None = None  # attention.sliding_window when absent (Gemma 2, EXAONE 4: 4096)
    gguf_window_depth: int | None = None  # windows only in a model of this many layers (EXAONE 4: its 32B's 64)
    width_scaled_depth: int | None = None  # queries scaled by (hidden / heads)^-0.5 in a model of this many layers
    #                                        (Gemma 2 / 3 27B: 46, 62)
    experts: bool = False  # a mixture of experts in place of the MLP (experts.py reads it)


FAMILIES = {
    "llama": Family(gguf="llama", permuted_qk=True, whole_heads_rotated=True),
    "mistral": Family(windows="given"),
    "qwen2": Family(gguf="qwen2", qkv_bias=True, windows="flag"),
    "qwen3": Family(gguf="qwen3", head_dim=128, qk_norm="shared", windows="flag"),
    "gemma": Family(gguf="gemma", tied=True, head_dim=256, unit_offset_norms=True, mlp="geglu", sqrt_embed_scale=True,
                    head_is_embedding=True),
    "gemma2": Family(gguf="gemma2", tied=True, head_dim=256, unit_offset_norms=True, post_norms=True, mlp="geglu",
                     windows="pattern", window_pattern=2, softcaps=True, query_scalar=True, sqrt_embed_scale=True,
                     head_is_embedding=True, gguf_window=4096, width_scaled_depth=46),
    "gemma3_text": Family(gguf="gemma3", tied=True, theta=1e6, head_dim=256, unit_offset_norms=True, post_norms=True,
                          qk_norm="shared", mlp="geglu", windows="pattern", window_pattern=6, query_scalar=True,
                          local_rope=True, local_theta=1e4, sqrt_embed_scale=True, width_scaled_depth=62),
    "phi3": Family(gguf="phi3", eps=1e-5, derived_head_dim=True, windows="given", fused_gate_up=True),
    "smollm3": Family(gguf="smollm3", tied=True, theta=2e6, windows="flag", nope=True, permuted_qk=True),
    "granite": Family(gguf="granite", multipliers=True, permuted_qk=True),
    "granite_swa": Family(gguf="granite_swa", windows="given", window=128, layer_thetas=True, window_pattern=4,
                          attn_sinks=True, multipliers=True, permuted_qk=True),  # (a GGUF file gives its pattern:
    #                                                                             attention.sliding_window_pattern)
    "olmo2": Family(eps=1e-5, pre_norms=False, post_norms=True, norm_gain_in_float32=True, qk_norm="whole"),
    "olmo3": Family(gguf="olmo2", eps=1e-5, theta=5e5, pre_norms=False, post_norms=True, norm_gain_in_float32=True,
                    qk_norm="whole", windows="pattern", window_pattern=4, window=4096, local_rope=True),
    "stablelm": Family(gguf="stablelm", eps=1e-5, derived_head_dim=True, rotary_fraction=0.25, layer_norms=True,
                       qk_norm="per_channel", qk_norm_key="qk_layernorm", qkv_bias_key="use_qkv_bias",
                       parallel_key="use_parallel_residual"),
    "seed_oss": Family(gguf="seed_oss", head_dim=128, attention_bias_is_qkv=True, gguf_mlp_norm="post_attention_norm"),
    "glm4": Family(gguf="glm4", eps=1.5625e-7, head_dim=128, rotary_fraction=0.5, post_norms=True,
                   post_attention_is_mlp_norm=True, attention_bias_is_qkv=True, interleaved_rope=True,
                   fused_gate_up=True),
    "cohere": Family(gguf="command-r", eps=1e-5, theta=5e5, tied=True, layer_norms=True, norms_without_bias=True,
                     qk_norms_refused=True, parallel=True, interleaved_rope=True, windows="none", logit_scale=True,
                     head_is_embedding=True),
    "cohere2": Family(gguf="cohere2", eps=1e-5, tied=True, layer_norms=True, norms_without_bias=True,
                      qk_norms_refused=True, parallel=True, interleaved_rope=True, windows="pattern", window_pattern=4,
                      window=4096, nope_full=True, logit_scale=True, head_is_embedding=True),
    "ministral3": Family(gguf="mistral3", theta=1e6, head_dim=128, windows="given", query_scale_past_context=True,
                         permuted_qk=True),
    "apertus": Family(gguf="apertus", eps=1e-5, theta=12e6, qk_norm="shared", mlp="xielu"),
    "apertus1p5_text": Family(eps=1e-5, theta=12e6, qk_norm="shared", mlp="xielu"),  # (its head may be pruned)
    "hunyuan_v1_dense": Family(gguf="hunyuan-dense", eps=1e-5, qk_norm="shared", norm_after_rope=True),
    # mixtures of experts (experts.py)
    "mixtral": Family(eps=1e-5, theta=1e6, windows="given", experts=True),  # (GGUF: llama with llama.expert_count)
    "qwen2_moe": Family(gguf="qwen2moe", qkv_bias=True, qkv_bias_key="qkv_bias", windows="flag", experts=True),
    "qwen3_moe": Family(gguf="qwen3moe", head_dim=128, qk_norm="shared", windows="flag", experts=True),
    "olmoe": Family(gguf="olmoe", eps=1e-5, qk_norm="whole", experts=True),
    "glm4_moe": Family(eps=1e-5, head_dim=128, rotary_fraction=0.5, qk_norm="shared", qk_norm_key="use_qk_norm",
                       attention_bias_is_qkv=True, experts=True),
    "gpt_oss": Family(eps=1e-5, theta=150000, windows="given", attn_sinks=True, experts=True),
    "exaone4": Family(gguf="exaone4", eps=1e-5, pre_norms=False, post_norms=True, qk_norm="shared", windows="pattern",
                      window_pattern=4, window=4096, nope_full=True, gguf_window=4096, gguf_window_depth=64),
}


# ----------------------------------------------------------------------------------------------------------------
# Hugging Face folders: one reader for every row, each difference read where it applies


def hf_layer_types(cfg: ConfigReader, family: Family, layers: int, window: int | None,
                   nope: list[int] | None) -> list[str] | None:
    """Which layers use the sliding window: transformers 5's layer_types, else the family's rule (None: every layer,
    when there is a window)."""
    given = cfg.get("layer_types")
    if family.window_pattern:
        pattern = cfg.get("sliding_window_pattern", cfg.get("_sliding_window_pattern", family.window_pattern))
        if isinstance(pattern, str):  # EXAONE 4: "LLLG", L a local (sliding) layer, G a global one, repeated
            rule = ["sliding_attention" if pattern[i % len(pattern)] == "L" else "full_attention"
                    for i in range(layers)]
        else:
            rule = ["sliding_attention" if (i + 1) % int(pattern) else "full_attention" for i in range(layers)]
    elif family.windows == "flag" and not family.nope:  # Qwen: the layers from max_window_layers on
        first = int(cfg.get("max_window_layers", 28))
        rule = ["sliding_attention" if i >= first else "full_attention" for i in range(layers)]
    elif family.nope:  # the layers without rope slide
        rule = ["sliding_attention" if i in (nope or ()) else "full_attention" for i in range(layers)]
    else:
        rule = None
    return None if window is None else given or rule


def hf_decoder(folder: str, raw: dict, source: str, prefix: str = "model."):
    """Hugging Face Llama and the families that share its layout (FAMILIES), exactly as transformers runs them:
    Llama 2/3.x (rope scalings), Mistral (a sliding window on every layer), Qwen2/2.5 (q/k/v biases), Qwen3 (q/k
    norms per head), Gemma 1/2/3 ((1 + w) norms, scaled embeddings, tanh-GELU gates; 2 and 3: post-norms, a
    query scale, sliding windows on some layers; 2: soft-capped scores and logits; 3: q/k norms and a local rope
    base), Phi-3/3.5/4-mini (fused projections, partial rotary, longrope), SmolLM3 (layers without rope), Granite
    (multipliers), OLMo 2 (post-norms only, q/k norms over the projection; 3: and Gemma 3's windows and local rope
    on three layers of four), StableLM 2 (layer norms, partial rotary, per-head q/k layer norms, parallel blocks),
    Seed-OSS (q/k/v biases), GLM-4 (q/k/v biases, norms before and after each branch, a half of each head rotated in
    interleaved pairs), Command R7B (cohere2: layer norms without bias before parallel branches, a logit scale,
    interleaved pairs, windows and no rope as EXAONE 4's), EXAONE 4 (OLMo 2's norms, Qwen3's q/k norms, windows on
    three layers of four and no rope on the others), Ministral 3 (yarn; its query scale past the original context
    is not run: the context stops there). prefix: where the decoder's tensors are (a wrapper's text model)."""
    kind = raw["model_type"]
    family, cfg = FAMILIES[kind], ConfigReader(dict(raw), source)  # (a copy: a rope key below is rewritten)
    context = int(cfg.get("max_position_embeddings", 2048))
    for key in ("rope_parameters", "rope_scaling") if family.query_scale_past_context else ():
        # the queries times 1 + beta log(1 + floor(position / original)): 1 within the original context
        rope = dict(cfg.raw.get(key) or {})
        beta, _ = rope.pop("llama_4_scaling_beta", 0), rope.pop("max_position_embeddings", None)
        original = int(rope.get("original_max_position_embeddings") or cfg.get("original_max_position_embeddings")
                       or context)
        if beta and original < context:
            machine.note(f"{source}: the context is {original} tokens (past them Ministral 3 scales its queries, "
                         "which this engine does not do yet)")
            context = original
        if key in cfg.raw:
            cfg.raw[key] = rope or None
    hidden, heads = int(cfg.need("hidden_size")), int(cfg.need("num_attention_heads"))
    layers = int(cfg.need("num_hidden_layers"))
    head_dim = int(cfg.get("head_dim") or family.head_dim or hidden // heads)
    if family.derived_head_dim:  # transformers derives it, whatever the config says
        head_dim = hidden // heads
    theta, scaling, rotary, local_theta = hf_rope(cfg, family.theta, head_dim, family.rotary_fraction)
    if family.local_rope and local_theta is None:
        local_theta = family.local_theta or theta
    elif not family.local_rope and local_theta is not None:
        cfg.refuse("rope_local_base_freq", "only Gemma 3 and OLMo 3 have a local rope base")
    geglu = family.mlp == "geglu"
    act = cfg.get("hidden_activation") or cfg.get("hidden_act", "gelu_pytorch_tanh" if geglu else "silu")
    if geglu:
        if act not in ("gelu_pytorch_tanh", "gelu") or (act == "gelu" and kind != "gemma"):
            cfg.refuse("hidden_activation", "Gemma's MLP is gelu_pytorch_tanh")
    elif act != family.mlp and (family.mlp == "xielu" or act not in ("silu", "swish")):
        cfg.refuse("hidden_act", f"only {'xielu' if family.mlp == 'xielu' else 'silu'} for this family")
    if family.qk_norms_refused and cfg.get("use_qk_norm"):
        cfg.refuse("use_qk_norm", "Command R+'s per-head q/k layer norms are not supported")
    window = cfg.get("sliding_window", family.window)
    if family.windows == "flag" and not cfg.get("use_sliding_window", False):
        window = None  # a window in the config is off unless use_sliding_window says so
    elif family.windows == "none" and window is not None:
        cfg.refuse("sliding_window", f"{kind} has no sliding window")
    nope = None
    if family.nope:  # no_rope_layers[i] is 1 where layer i uses rope
        interval = int(cfg.get("no_rope_layer_interval", 4))
        flags = cfg.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(layers)]
        nope = [i for i, use_rope in enumerate(flags) if not use_rope]
    if family.layer_thetas and not cfg.get("layer_types"):  # (transformers' default: every fourth layer full)
        cfg.raw["layer_types"] = ["full_attention" if i % 4 == 0 else "sliding_attention" for i in range(layers)]
    types = hf_layer_types(cfg, family, layers, window, nope)
    if family.layer_thetas:
        nope, theta, local_theta = layer_thetas(cfg, layers, types, theta)
    if family.nope_full and types:
        nope = [i for i, kind in enumerate(types) if kind == "full_attention"]
    attn_bias = bool(cfg.get("attention_bias", family.attention_bias_is_qkv))
    mlp_bias = bool(cfg.get("mlp_bias", False))
    qkv_bias = family.qkv_bias
    if family.attention_bias_is_qkv:  # attention_bias is q/k/v's; the output's is attention_out_bias
        qkv_bias, attn_bias = attn_bias, bool(cfg.get("attention_out_bias", False))
    experts = hf_experts(cfg, kind, layers) if family.experts else None
    if attn_bias != mlp_bias and (experts is None or experts.dense_layers or mlp_bias):  # (experts: their own)
        cfg.refuse("attention_bias" if attn_bias else "mlp_bias", "biases on attention or MLP alone")
    if cfg.get("use_bidirectional_attention"):
        cfg.refuse("use_bidirectional_attention", "a decoder attends causally")
    scalar = cfg.get("query_pre_attn_scalar") if family.query_scalar else None
    multipliers = {key: float(cfg.get(key, 1.0)) for key in ("embedding_multiplier", "residual_multiplier",
                                                             "logits_scaling")} if family.multipliers else {}
    config = make_config(
        source, vocab_size=int(cfg.need("vocab_size")), hidden_size=hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=int(cfg.get("num_key_value_heads", heads)), head_dim=head_dim,
        intermediate_size=int(cfg.need("intermediate_size")), max_position_embeddings=context, rope_theta=theta,
        rotary_dim=rotary, rope_layout="interleaved" if family.interleaved_rope else "half",
        rope_scaling=scaling, rope_local_theta=local_theta, nope_layers=nope,
        attn_scale=float(cfg.get("attention_multiplier")) if family.multipliers else (
            float(scalar) ** -0.5 if scalar else None),
        attn_softcap=cfg.get("attn_logit_softcapping") if family.softcaps else None,
        sliding_window=window, layer_types=types,
        qkv_bias=bool(cfg.get(family.qkv_bias_key, qkv_bias)) if family.qkv_bias_key else qkv_bias,
        norm="layernorm" if family.layer_norms else "rmsnorm",
        norm_eps=float(cfg.get("layer_norm_eps" if family.layer_norms else "rms_norm_eps", family.eps)),
        norm_gain_in_float32=family.norm_gain_in_float32, norm_unit_offset=family.unit_offset_norms,
        qk_norm=family.qk_norm if family.qk_norm_key is None or cfg.get(family.qk_norm_key) else "none",
        qk_norm_after_rope=family.norm_after_rope, mlp=family.mlp, bias=attn_bias,
        parallel_residual=family.parallel or family.parallel_key is not None and bool(cfg.get(family.parallel_key)),
        pre_norms=family.pre_norms, post_norms=family.post_norms,
        residual_scale=multipliers.get("residual_multiplier", 1.0),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", family.tied)),
        embed_scale=hidden ** 0.5 if family.sqrt_embed_scale else multipliers.get("embedding_multiplier"),
        logits_divisor=(1 / float(cfg.get("logit_scale", 0.0625)) if family.logit_scale
                        else multipliers.get("logits_scaling", 1.0)),
        final_softcap=cfg.get("final_logit_softcapping") if family.softcaps else None,
        output_vocab_size=cfg.get("output_vocab_size"), attn_sinks=family.attn_sinks,
        extras={"experts": experts} if experts else {})
    for key in ("max_window_layers", "use_sliding_window"):
        cfg.get(key)  # read above where they apply; without a window they change nothing
    mtp_layers = int(cfg.get("num_nextn_predict_layers", 0))  # (GLM-4.5's draft layers: not read)
    cfg.check_unread()
    return config, hf_decoder_tensors(folder, family, config, source, prefix, mtp_layers)


def layer_thetas(cfg: ConfigReader, layers: int, types: list[str] | None, theta: float):
    """(layers without rope, the full layers' base, the sliding layers' base or None) of Granite SWA's
    layer_rope_theta: a base per layer, 0 where none; one base for each kind of layer."""
    thetas = [float(t) for t in cfg.get("layer_rope_theta") or [theta] * layers]
    kinds = types or ["full_attention"] * layers
    if len(thetas) != layers:
        cfg.refuse("layer_rope_theta", f"one base per layer ({layers})")
    full = {t for t, kind in zip(thetas, kinds) if t and kind == "full_attention"}
    sliding = {t for t, kind in zip(thetas, kinds) if t and kind == "sliding_attention"}
    if len(full) > 1 or len(sliding) > 1:
        cfg.refuse("layer_rope_theta", "one base for the full layers and one for the sliding ones")
    base = full.pop() if full else sliding.pop() if sliding else theta
    local = sliding.pop() if sliding else None
    return [i for i, t in enumerate(thetas) if not t] or None, base, local if local != base else None


def hf_decoder_tensors(folder: str, family: Family, config: DenseConfig, source: str, prefix: str = "model.",
                       mtp_layers: int = 0) -> dict:
    """{native name: thunk} of a Llama-layout folder. Where the families' names differ: Gemma 2/3's
    post_attention_layernorm is the attention's post-norm (Llama's is the MLP's pre-norm), OLMo 2 has post-norms
    only, Phi-3 fuses q|k|v and gate|up, StableLM keeps one layer norm per head for q and k."""
    after_attention = "mixer_post_norm" if family.post_norms and not family.post_attention_is_mlp_norm else "mlp_norm"
    weights = hf_weights(folder)
    headless = prefix == "model." and not any(name.startswith("model.") for name in weights)
    if headless:  # the decoder alone, its tensors at the top (an embedding model's: Qwen3-Embedding)
        prefix = ""
    top = re.escape(prefix)
    layer = top + r"layers\.(\d+)\."
    rules = [
        (top + r"embed_tokens\.weight", "embed_tokens.weight"), (top + r"norm\.(weight|bias)", r"norm.\1"),
        head_rule(config.tie_word_embeddings),
        (layer + r"(?:input|attention)_layernorm\.(weight|bias)", r"layers.\1.mixer_norm.\2"),
        (layer + r"feedforward_layernorm\.weight", r"layers.\1.mlp_norm.weight"),  # (Apertus)
        (layer + r"mlp\.act_fn\.(alpha_p|alpha_n|beta|eps)", r"layers.\1.mlp.act.\2"),
        (layer + r"post_attention_layernorm\.(weight|bias)", rf"layers.\1.{after_attention}.\2"),
        (layer + r"pre_feedforward_layernorm\.weight", r"layers.\1.mlp_norm.weight"),
        (layer + r"post_feedforward_layernorm\.weight", r"layers.\1.mlp_post_norm.weight"),
        (layer + r"post_self_attn_layernorm\.weight", r"layers.\1.mixer_post_norm.weight"),  # (GLM-4)
        (layer + r"post_mlp_layernorm\.weight", r"layers.\1.mlp_post_norm.weight"),
        (layer + r"self_attn\.([qkvo]_proj)\.(weight|bias)", r"layers.\1.mixer.\2.\3"),
        (layer + r"self_attn\.([qk])_norm\.weight", r"layers.\1.mixer.\2_norm.weight"),
        (layer + r"self_attn\.query_layernorm\.weight", r"layers.\1.mixer.q_norm.weight"),  # (Hunyuan's names)
        (layer + r"self_attn\.key_layernorm\.weight", r"layers.\1.mixer.k_norm.weight"),
        (layer + r"self_attn\.([qk])_layernorm\.norms\.(\d+)\.weight", r"layers.\1.mixer.\2_norm.head\3"),
        (layer + r"self_attn\.qkv_proj\.weight", r"layers.\1.mixer.qkv.weight"),
        (layer + r"self_attn\.sinks", r"layers.\1.mixer.sinks"),  # (Granite SWA)
        (layer + r"mlp\.gate_up_proj\.weight", r"layers.\1.mlp.gate_up.weight"),
        (layer + r"mlp\.(gate|up|down)_proj\.(weight|bias)", r"layers.\1.mlp.\2_proj.\3")]
    if family.experts:
        rules = expert_rules(layer) + rules
    if mtp_layers:  # the layers past the decoder's: a draft's (multi-token prediction), not read
        past = "|".join(str(config.num_hidden_layers + j) for j in range(mtp_layers))
        rules = [(top + rf"layers\.(?:{past})\..*", None)] + rules
    if prefix != "model.":  # a wrapper's image model: not read (its reader says so); its head beside the text model
        rules += [(r"(?:model\.)?(vision_tower|multi_modal_projector|vision_tokenizer|audio_tokenizer)\..*", None),
                  head_rule(config.tie_word_embeddings, r"language_model\.lm_head\.weight")]
    table = rename(weights, rules, source)
    if headless and "lm_head.weight" not in table and not config.tie_word_embeddings:
        table["lm_head.weight"] = table["embed_tokens.weight"]  # (no head to read: an embedding model uses none)
    H, K, D = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    for i in range(config.num_hidden_layers):
        a, m = f"layers.{i}.mixer.", f"layers.{i}.mlp."
        if a + "qkv.weight" in table:  # Phi-3: rows are q | k | v
            split_qkv(table, a, H, K, D)
        if m + "gate_up.weight" in table:  # Phi-3: rows are gate | up
            split_gate_up(table, m, config.intermediate_size)
        for part, count in (("q", H), ("k", K)):  # StableLM: one [D] gain per head, stacked into [heads * D]
            heads = [table.pop(f"{a}{part}_norm.head{h}", None) for h in range(count)]
            if any(heads):
                if not all(heads):
                    raise CheckpointError(f"{source}: layer {i} lacks some of its per-head {part} norms")
                table[f"{a}{part}_norm.weight"] = lambda heads=heads: torch.cat([read() for read in heads])
    shared_norms(table, family, config)
    if family.experts:
        stack_experts(table, config, source)
    return table


def shared_norms(table: dict, family: Family, config: DenseConfig) -> None:
    """Command R's layer norms without bias (a bias of zeros adds nothing); one norm before both branches where they
    run in parallel (StableLM 2 12B, Command R)."""
    if family.norms_without_bias:
        table["norm.bias"] = lambda C=config.hidden_size: torch.zeros(C)
    for i in range(config.num_hidden_layers):
        if family.norms_without_bias:
            table[f"layers.{i}.mixer_norm.bias"] = table["norm.bias"]
        if config.parallel_residual and f"layers.{i}.mixer_norm.weight" in table:
            for p in ("weight", "bias"):
                table[f"layers.{i}.mlp_norm.{p}"] = table[f"layers.{i}.mixer_norm.{p}"]


def image_text(folder: str, raw: dict, source: str):
    """An image-text folder whose text model (text_config, a family of FAMILIES) is under model.language_model, read
    as that family's folder; the rest is skipped with a note. Mistral 3 (Ministral 3, Mistral Small 3.1 / 3.2): a
    vision tower and its projector. Apertus 1.5: its vision and audio tokenizers (images and sounds become token ids
    of the one vocabulary, which the text model reads as any other)."""
    text = dict(raw.get("text_config") or {})
    if text.get("model_type") not in FAMILIES:
        raise CheckpointError(f"{source}: text_config model_type {text.get('model_type')!r} is not supported")
    if "tie_word_embeddings" in raw:  # (the wrapper's own says whether transformers ties the head)
        text["tie_word_embeddings"] = raw["tie_word_embeddings"]
    names = list(hf_weights(folder))
    skipped = [words for part, words in IMAGE_TEXT_PARTS.items()
               if any(name.startswith((f"model.{part}.", f"{part}.")) for name in names)]
    if skipped:
        machine.note(f"{source}: {' and '.join(skipped)} {'is' if len(skipped) == 1 else 'are'} not loaded: this "
                     "engine reads text")
    # (the Hub's files: language_model.model.*; transformers 5's own: model.language_model.*)
    legacy = any(name.startswith("language_model.model.") for name in names)
    return hf_decoder(folder, text, source, prefix="language_model.model." if legacy else "model.language_model.")


IMAGE_TEXT_PARTS = {"vision_tower": "the vision tower", "vision_tokenizer": "the vision tokenizer",
                    "audio_tokenizer": "the audio tokenizer"}  # (and a vision tower's multi_modal_projector)


# ----------------------------------------------------------------------------------------------------------------
# GGUF files: each row's `gguf` architecture


def gguf_config(family: Family, meta: Metadata) -> DenseConfig:
    """The model's config from the file's `ARCH.*` metadata, the family's switches (as for its Hugging Face folders)
    and what llama.cpp's model code fixes beyond them."""
    key, tensors, path, arch = meta.key, meta.tensors, meta.path, meta.arch
    if family.qk_norms_refused and "blk.0.attn_q_norm.weight" in tensors:
        raise CheckpointError(f"{path}: tensor 'blk.0.attn_q_norm.weight': Command R+'s per-head q/k layer norms are "
                              "not supported")
    hidden, heads = int(key("embedding_length")), int(key("attention.head_count"))
    layers = int(key("block_count"))
    experts = gguf_experts(meta, layers)  # (llama: Mixtral's; another architecture's refused)
    head_dim = meta.head_dim(hidden, heads)
    rope_dim = int(key("rope.dimension_count", head_dim))
    if family.whole_heads_rotated and rope_dim != head_dim:  # llama.cpp refuses it too
        raise CheckpointError(f"{path}: GGUF metadata {arch}.rope.dimension_count {rope_dim} must equal the head size "
                              f"{head_dim} for {arch}")
    context = int(key("context_length", 2048))
    scaling = gguf_rope_scaling(meta, context, rope_dim)
    original = (scaling or {}).get("original_max_position_embeddings", context)
    if float(key("attention.temperature_scale", 0.0)) and original < context:  # (llama.cpp: 1 up to the original)
        machine.note(f"{path}: the context is {original} tokens (past them Ministral 3 scales its queries, which this "
                     "engine does not do yet)")
        context = original
    window = int(key("attention.sliding_window", family.gguf_window or 0)) if family.window_pattern else 0
    if family.gguf_window_depth and layers != family.gguf_window_depth:  # (EXAONE 4: only the 32B's layers slide)
        window = 0
    layer_types = None
    if window:  # llama.cpp: layer il slides if il % n < n - 1 (n: the family's pattern), or the file's flags
        pattern = key("attention.sliding_window_pattern", family.window_pattern)
        flags = pattern if isinstance(pattern, list) else [il % pattern < pattern - 1 for il in range(layers)]
        layer_types = ["sliding_attention" if f else "full_attention" for f in flags]
    nope = [i for i in range(layers) if (i + 1) % 4 == 0] if family.nope else None  # (llama.cpp: every 4th)
    rotates = key("attention.rope_pattern", [])  # (Granite SWA: False where a layer has no rope)
    if rotates:
        nope = [i for i, r in enumerate(rotates[:layers]) if not r] or None
    if family.nope_full and layer_types:  # (EXAONE 4: the full layers have no rope)
        nope = [i for i, kind in enumerate(layer_types) if kind == "full_attention"]
    return make_config(
        path, vocab_size=meta.vocab_size(),
        hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=int(key("attention.head_count_kv", heads)), head_dim=head_dim,
        intermediate_size=int(key("feed_forward_length")), max_position_embeddings=context,
        rope_theta=float(key("rope.freq_base", 10000.0)), rotary_dim=rope_dim if rope_dim != head_dim else None,
        rope_layout="interleaved" if family.interleaved_rope else "half",  # (llama.cpp's "norm" rope: q/k as made)
        rope_scaling=scaling,
        rope_local_theta=float(key("rope.freq_base_swa", family.local_theta or key("rope.freq_base", 10000.0)))
        if family.local_rope and window else None,
        attn_scale=float(key("attention.scale")) if family.multipliers and key("attention.scale", 0.0) else (
            (hidden // heads) ** -0.5 if layers == family.width_scaled_depth else None),
        embed_scale=math.sqrt(hidden) if family.sqrt_embed_scale else (float(key("embedding_scale", 0.0)) or None),
        residual_scale=float(key("residual_scale", 0.0) or 1.0),  # (Granite's scales as llama.cpp reads them)
        logits_divisor=float(key("logit_scale")) if family.multipliers else 1 / float(key("logit_scale"))
        if family.logit_scale else 1.0,
        nope_layers=nope,
        attn_softcap=float(key("attn_logit_softcapping", 50.0)) if family.softcaps else None,
        sliding_window=window or None, layer_types=layer_types, qkv_bias="blk.0.attn_q.bias" in tensors,
        norm_eps=float(key("attention.layer_norm_epsilon") if family.layer_norms else
                       key("attention.layer_norm_rms_epsilon", 1e-5)),
        norm="layernorm" if family.layer_norms else "rmsnorm",
        parallel_residual=family.parallel or family.parallel_key is not None and "blk.0.ffn_norm.weight" not in
        tensors,  # (one norm before both branches)
        qk_norm=(family.qk_norm if family.qk_norm != "none" else "shared") if "blk.0.attn_q_norm.weight" in tensors
        else "none", qk_norm_after_rope=family.norm_after_rope, mlp=family.mlp, pre_norms=family.pre_norms,
        post_norms=family.post_norms, norm_gain_in_float32=family.norm_gain_in_float32,  # (Gemma's 1 + w: baked in)
        tie_word_embeddings=meta.tied or family.head_is_embedding,
        final_softcap=float(key("final_logit_softcapping", 30.0 if family.softcaps else 0.0)) or None,
        attn_sinks="blk.0.attn_sinks.weight" in tensors, extras={"experts": experts} if experts else {})


def gguf_layer(family: Family, config: DenseConfig, rest: str) -> list[tuple] | None:
    """[(native name after "layers.N.", rows or None, change or None)] for a layer's tensor `rest` (after "blk.N.");
    None: no such tensor. llama's q/k rows are put back in rotate-half order; a fused q|k|v (Phi-3's, GPT-NeoX's) and
    a fused gate|up are split."""
    H, K, D, W = config.num_attention_heads, config.num_key_value_heads, config.head_dim, config.intermediate_size
    kind, _, suffix = rest.partition(".")
    if kind == "attn_qkv" and suffix in ("weight", "bias"):  # q | k | v (GPT-NeoX: biases too)
        return [(f"mixer.q_proj.{suffix}", torch.arange(0, H * D), None),
                (f"mixer.k_proj.{suffix}", torch.arange(H * D, (H + K) * D), None),
                (f"mixer.v_proj.{suffix}", torch.arange((H + K) * D, (H + 2 * K) * D), None)]
    if family.fused_gate_up and rest == "ffn_up.weight":  # gate | up
        return [("mlp.gate_proj.weight", torch.arange(0, W), None),
                ("mlp.up_proj.weight", torch.arange(W, 2 * W), None)]
    if rest == "attn_sinks.weight":  # (Granite SWA: a logit per head)
        return [("mixer.sinks", None, None)]
    if rest in GGUF_EXPERTS and "experts" in config.extras:  # (joined by gguf_finish: join_experts)
        return [(GGUF_EXPERTS[rest], None, None)]
    if kind == family.gguf_mlp_norm:  # (Seed-OSS: its norm before the MLP, as llama.cpp names it)
        return [(f"mlp_norm.{suffix}", None, None)]
    if kind not in LAYER_TENSORS or suffix not in ("weight", "bias") or (
            suffix == "bias" and kind not in ("attn_q", "attn_k", "attn_v", "attn_norm", "ffn_norm")
            and not config.bias):
        return None
    if kind in ("attn_q_norm", "attn_k_norm") and config.qk_norm == "per_channel":  # ([heads, D]: rows of heads)
        return [(f"{LAYER_TENSORS[kind]}.{suffix}", None, lambda w, where: w.reshape(-1))]
    heads = {"attn_q": H, "attn_k": K}.get(kind) if family.permuted_qk else None
    rows = unpermute(torch.arange(heads * D), heads) if heads else None
    return [(f"{LAYER_TENSORS[kind]}.{suffix}", rows, None)]


def gguf_finish(family: Family, table: dict, config: DenseConfig, meta: Metadata) -> None:
    """What a row's file holds beside its tensors: the head read from the embedding, whatever else is there
    (head_is_embedding), xIELU's parameters (Apertus), the norms shared_norms makes, and a mixture's gate and up
    experts joined (join_experts)."""
    if family.head_is_embedding:
        table.pop("lm_head.weight", None)
    if config.mlp == "xielu":  # (Apertus) its activation's parameters, a layer each, in the metadata as stored
        for key in ("alpha_p", "alpha_n", "beta", "eps"):
            values = field(meta.reader, f"xielu.{key}", path=meta.path)
            values = values if isinstance(values, list) else [values] * config.num_hidden_layers
            for i, value in enumerate(values[:config.num_hidden_layers]):
                shape = (1,) if key.startswith("alpha") else ()
                table[f"layers.{i}.mlp.act.{key}"] = lambda value=value, shape=shape: torch.full(shape, float(value))
    shared_norms(table, family, config)
    if "experts" in config.extras:
        join_experts(table, config, meta.path)


def gguf_architecture(family: Family) -> Architecture:
    return Architecture(functools.partial(gguf_config, family), functools.partial(gguf_layer, family),
                        finish=functools.partial(gguf_finish, family))


GGUF = {family.gguf: gguf_architecture(family) for family in FAMILIES.values() if family.gguf}
