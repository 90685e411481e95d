"""falcon_h1.py: Falcon-H1, in every layer attention and Mamba2 reading the same normed input, their outputs summed
(dense.Hybrid), then a SwiGLU MLP. A Hugging Face folder (falcon_h1) or a GGUF file (falcon-h1: attention and Mamba2
in every layer, granitehybrid's tensors side by side, q/k rows as stored, its muP multipliers already folded into the
weights by the converter; ssm_norm where the model has it).
"""

from __future__ import annotations

import torch

from dense_engine.formats.checkpoint import make_config
from dense_engine.formats.families.common import ConfigReader, hf_weights, model_rules, plain_rope, refuse_act, rename
from dense_engine.formats.families.hybrid import (
    ATTENTION_TENSORS,
    MAMBA2_TENSORS,
    gguf_state_config,
    mamba2_layer,
    mamba2_values,
    mamba_rules,
    time_step_limit,
)
from dense_engine.formats.gguf_import import Architecture, Metadata


def read_hf(folder: str, raw: dict, source: str):
    """Falcon-H1's folder. Its muP multipliers are folded into the weights they scale, as llama.cpp's converter folds
    them: attention's input into q, k and v (key_multiplier into k too), its output into o_proj; the SSM's input and
    ssm_multipliers (z, x, B, C, dt) into in_proj's rows, its output into out_proj; mlp_multipliers into gate and
    down. The embedding's and the head's stay switches (a tied table is both)."""
    cfg = ConfigReader(raw, source)
    hidden, heads, layers = int(cfg.need("hidden_size")), int(cfg.need("num_attention_heads")), \
        int(cfg.need("num_hidden_layers"))
    m_heads, m_groups, m_state = int(cfg.need("mamba_n_heads")), int(cfg.get("mamba_n_groups", 1)), \
        int(cfg.get("mamba_d_state", 256))
    inner = int(cfg.get("mamba_d_ssm") or int(cfg.get("mamba_expand", 2)) * hidden)
    m_dim = cfg.get("mamba_d_head", "auto")
    m_dim = inner // m_heads if m_dim == "auto" else int(m_dim)
    if m_heads * m_dim != inner:
        cfg.refuse("mamba_d_head", f"mamba_n_heads x mamba_d_head must be the SSM's width ({inner})")
    for key in ("attention_bias", "mlp_bias", "mamba_proj_bias", "projectors_bias"):
        if cfg.get(key, False):
            cfg.refuse(key, "Falcon-H1's releases have no such biases")
    refuse_act(cfg)
    rms_norm, before_gate = bool(cfg.get("mamba_rms_norm", False)), bool(cfg.get("mamba_norm_before_gate", True))
    if rms_norm and before_gate:
        cfg.refuse("mamba_norm_before_gate", "with mamba_rms_norm, only the norm after the silu(z) gate (false), as "
                                             "llama.cpp runs it")
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    theta, rotary = plain_rope(cfg, head_dim)
    for key in ("mamba_chunk_size", "num_logits_to_keep", "mamba_expand"):
        cfg.get(key)  # (the chunk a prompt is scanned in: the same sums)

    def number(key: str) -> float:
        value = cfg.get(key)
        return 1.0 if value is None else float(value)

    m = {key: number(key) for key in ("attention_in_multiplier", "attention_out_multiplier", "key_multiplier",
                                      "ssm_in_multiplier", "ssm_out_multiplier")}
    ssm = [float(v) for v in cfg.get("ssm_multipliers") or [1.0] * 5]
    gate_m, down_m = (float(v) for v in cfg.get("mlp_multipliers") or [1.0, 1.0])
    config = make_config(
        source, vocab_size=int(cfg.need("vocab_size")), hidden_size=hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=head_dim, intermediate_size=int(cfg.need("intermediate_size")),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 8192)), rope_theta=theta, rotary_dim=rotary,
        layer_types=["hybrid"] * layers, mamba_heads=(m_heads, m_dim, m_groups, m_state),
        mamba_biases=(False, bool(cfg.get("mamba_conv_bias", True))), mamba_norm=rms_norm,
        time_step_limit=time_step_limit(cfg), conv_kernel=int(cfg.get("mamba_d_conv", 4)),
        norm_eps=float(cfg.get("rms_norm_eps", 1e-5)), embed_scale=number("embedding_multiplier"),
        logits_divisor=1.0 / number("lm_head_multiplier"),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)))
    cfg.check_unread()
    layer = r"model\.layers\.(\d+)\."
    rules = [*model_rules(config.tie_word_embeddings, norm="final_layernorm"),
             (layer + r"input_layernorm\.weight", r"layers.\1.mixer_norm.weight"),
             (layer + r"pre_ff_layernorm\.weight", r"layers.\1.mlp_norm.weight"),
             (layer + r"self_attn\.([qkvo]_proj)\.weight", r"layers.\1.mixer.attention.\2.weight"),
             *mamba_rules(layer, "mixer.mamba."),
             (layer + r"feed_forward\.(gate|up|down)_proj\.weight", r"layers.\1.mlp.\2_proj.weight")]
    table = rename(hf_weights(folder), rules, source)
    widths = [inner, inner, m_groups * m_state, m_groups * m_state, m_heads]  # in_proj's rows: z, x, B, C, dt
    rows = torch.cat([torch.full((w,), v) for w, v in zip(widths, ssm)]) * m["ssm_in_multiplier"]
    scales = {"attention.q_proj": m["attention_in_multiplier"], "attention.v_proj": m["attention_in_multiplier"],
              "attention.k_proj": m["attention_in_multiplier"] * m["key_multiplier"],
              "attention.o_proj": m["attention_out_multiplier"], "mamba.out_proj": m["ssm_out_multiplier"],
              "mamba.in_proj": rows[:, None]}
    for i in range(layers):
        for name, scale in [*((f"layers.{i}.mixer.{n}.weight", v) for n, v in scales.items()),
                            (f"layers.{i}.mlp.gate_proj.weight", gate_m), (f"layers.{i}.mlp.down_proj.weight", down_m)]:
            if name in table:
                table[name] = lambda read=table[name], scale=scale: read().float() * scale
    return config, table


# ----------------------------------------------------------------------------------------------------------------
# GGUF files (falcon-h1)

# per-layer GGUF tensors (after "blk.N.") -> native names (after "layers.N."): both mixers in every layer
# (dense.Hybrid), its MLP's norm named without ".weight"
GGUF_TENSORS = {
    "attn_norm.weight": "mixer_norm.weight", "ffn_norm": "mlp_norm.weight",
    **{k: v.replace("mixer.", "mixer.attention.") for k, v in ATTENTION_TENSORS.items() if k.startswith("attn_")
       and k != "attn_norm.weight"},
    **{k: v for k, v in ATTENTION_TENSORS.items() if k.startswith("ffn_")},
    **{k: v.replace("mixer.", "mixer.mamba.") for k, v in MAMBA2_TENSORS.items() if k.startswith("ssm_")}}


def gguf_kinds(meta: Metadata, kv: list[int], layers: int) -> tuple[list[str], dict]:
    """Every layer both (its multipliers folded into the weights by the converter)."""
    return ["hybrid"] * layers, dict(mamba2_values(meta, 0), mamba_norm="blk.0.ssm_norm.weight" in meta.tensors)


GGUF = Architecture(lambda meta: gguf_state_config(meta, gguf_kinds),
                    lambda config, rest: mamba2_layer(GGUF_TENSORS, config, rest))
