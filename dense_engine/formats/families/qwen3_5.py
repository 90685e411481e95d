"""qwen3_5.py: Qwen3.5 / 3.6, three Gated DeltaNet layers to one full-attention layer, whose q_proj also yields an
output gate (per head: D query rows, then D gate rows), with q/k norms and a quarter of each head rotated; (1 + w)
norms; multi-token prediction layers (mtp.*) read as a draft's. A Hugging Face folder (qwen3_5_text, or qwen3_5: the
Hub's image-text folder) or a GGUF file (qwen35).

What llama.cpp's converter did to a qwen35 file, undone here: Gated DeltaNet layers (ssm.* metadata; ssm_a =
-exp(A_log), taken back to A_log; conv kernels [C, W]; value heads reordered to tiled, kept so: linear_tiled_values)
and full-attention layers whose attn_q holds each head's query rows, then its output-gate rows; every norm but
ssm_norm with its 1 + w baked in (used as stored); MTP layers after the model's (nextn_predict_layers: nextn.* and a
full-attention layer) read as a draft's.
"""

from __future__ import annotations

import torch

from dense import DenseConfig
from dense_engine.formats.families.common import ConfigReader, hf_weights, model_rules, rename, split_rows
from dense_engine.formats.families.hybrid import ATTENTION_TENSORS, gguf_state_config, state_config, state_layer
from dense_engine.formats.gguf_import import Architecture, Metadata
from dense_engine.system import machine
from dense_engine.system.errors import CheckpointError


def read_hf(folder: str, raw: dict, source: str):
    """qwen3_5_text, or qwen3_5 (the text model under model.language_model, the vision tower skipped with a note).
    mrope: text alone has one position in all its sections, so plain rope."""
    wrapped = raw["model_type"] == "qwen3_5"
    text = dict((raw.get("text_config") or {}) if wrapped else raw)
    params = dict(text.get("rope_parameters") or {})
    for key in ("mrope_section", "mrope_interleaved"):  # (text positions: every section the same)
        params.pop(key, None)
    cfg = ConfigReader({**text, "rope_parameters": params}, source)
    layers = int(cfg.need("num_hidden_layers"))
    interval = int(cfg.get("full_attention_interval", 4))
    types = cfg.get("layer_types") or ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                                       for i in range(layers)]
    config = state_config(
        cfg, layers, intermediate_size=int(cfg.need("intermediate_size")), layer_types=types,
        linear_heads=(int(cfg.get("linear_num_key_heads", 16)), int(cfg.get("linear_num_value_heads", 32))),
        linear_head_dims=(int(cfg.get("linear_key_head_dim", 128)), int(cfg.get("linear_value_head_dim", 128))),
        conv_kernel=int(cfg.get("linear_conv_kernel_dim", 4)), attn_output_gate=True,
        norm_eps=float(cfg.get("rms_norm_eps", 1e-6)), norm_unit_offset=True,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings") if wrapped else cfg.get("tie_word_embeddings")))
    cfg.check_unread()
    prefix = r"model\.language_model\." if wrapped else r"model\."
    layer = prefix + r"layers\.(\d+)\."
    weights = hf_weights(folder)
    if any(name.startswith("model.visual.") for name in weights):
        machine.note(f"{source}: the vision tower (model.visual.*) is not loaded: this engine reads text")
    # the multi-token prediction layers (mtp.*: a draft, --draft mtp) under mtp., as speculative.MultiTokenPredictor
    # names them: its layers are full-attention layers named as the model's
    mtp = r"(?:model\.)?mtp\."  # (at the top, or under model. as some releases save it)
    rules = [(r"model\.visual\..*", None), (mtp + r"fc\.weight", "mtp.fc.weight"),
             (mtp + r"pre_fc_norm_(embedding|hidden)\.weight", r"mtp.norm_\1.weight"),
             (mtp + r"norm\.weight", "mtp.norm.weight"),
             *model_rules(config.tie_word_embeddings, prefix)]
    for at, to in ((layer, "layers."), (mtp + r"layers\.(\d+)\.", "mtp.layers.")):
        rules += [(at + r"input_layernorm\.weight", to + r"\1.attn_norm.weight"),
                  (at + r"post_attention_layernorm\.weight", to + r"\1.mlp_norm.weight"),
                  (at + r"self_attn\.([qkvo]_proj|[qk]_norm)\.weight", to + r"\1.attn.\2.weight"),
                  (at + r"linear_attn\.(in_proj_\w+|out_proj|norm)\.weight", to + r"\1.attn.\2.weight"),
                  (at + r"linear_attn\.conv1d\.weight", to + r"\1.attn.conv_weight"),
                  (at + r"linear_attn\.(A_log|dt_bias)", to + r"\1.attn.\2"),
                  (at + r"mlp\.(gate|up|down)_proj\.weight", to + r"\1.mlp.\2_proj.weight")]
    table = rename(weights, rules, source)
    mtp_layers = sorted({int(n.split(".")[2]) for n in table if n.startswith("mtp.layers.")})
    for a in [f"layers.{i}.attn." for i, kind in enumerate(types) if kind == "full_attention"] + \
            [f"mtp.layers.{j}.attn." for j in mtp_layers]:
        split_rows(table, a + "q_proj.weight", {a + "q_proj.weight": 0, a + "gate_proj.weight": 1},
                   view=(config.num_attention_heads, 2, config.head_dim))
    return config, table


# ----------------------------------------------------------------------------------------------------------------
# GGUF files (qwen35)

# per-layer GGUF tensors (after "blk.N.") -> native names (after "layers.N.")
GGUF_TENSORS = {**ATTENTION_TENSORS, "post_attention_norm.weight": "mlp_norm.weight",  # (the MLP's input norm)
                "attn_qkv.weight": "attn.in_proj_qkv.weight", "attn_gate.weight": "attn.in_proj_z.weight",
                "ssm_beta.weight": "attn.in_proj_b.weight", "ssm_alpha.weight": "attn.in_proj_a.weight",
                "ssm_conv1d.weight": "attn.conv_weight", "ssm_dt.bias": "attn.dt_bias", "ssm_a": "attn.A_log",
                "ssm_norm.weight": "attn.norm.weight", "ssm_out.weight": "attn.out_proj.weight"}


def gguf_kinds(meta: Metadata, kv: list[int], layers: int) -> tuple[list[str], dict]:
    """Gated DeltaNet layers (ssm.*: key heads = group_count, value heads = time_step_rank, Dk = state_size, Dv =
    inner_size / value heads) where attention.recurrent_layers marks them (or all but every full_attention_interval-th),
    full-attention layers with an output gate, partial rotary (rope.dimension_sections: text has one position in
    every section, plain rope), norms with their 1 + w baked in."""
    key, path, arch = meta.key, meta.path, meta.arch
    interval = int(key("full_attention_interval", 4))
    flags = key("attention.recurrent_layers", []) or [(i + 1) % interval != 0 for i in range(layers)]
    types = ["linear_attention" if recurrent else "full_attention" for recurrent in flags[:layers]]
    k_heads, v_heads = int(key("ssm.group_count")), int(key("ssm.time_step_rank"))
    inner = int(key("ssm.inner_size"))
    if not 0 < v_heads or inner % v_heads:
        raise CheckpointError(f"{path}: GGUF metadata {arch}.ssm.inner_size {inner} is not a whole number of "
                              f"{arch}.ssm.time_step_rank {v_heads} value heads")
    # (value heads in the converter's tiled order: value head j reads key head j % key heads)
    return types, {"linear_heads": (k_heads, v_heads),
                   "linear_head_dims": (int(key("ssm.state_size")), inner // v_heads),
                   "linear_tiled_values": k_heads != v_heads, "conv_kernel": int(key("ssm.conv_kernel")),
                   "attn_output_gate": True, "norm_gain_in_float32": True,  # (the gains 1 + w, in float32 as llama.cpp)
                   "qk_norm": "shared"}


def gguf_layer(config: DenseConfig, rest: str) -> list[tuple] | None:
    """hybrid.state_layer, and attn_q [H * 2D, C]: per head D query rows, then D gate rows."""
    if rest == "attn_q.weight":
        H, D = config.num_attention_heads, config.head_dim
        rows = torch.arange(H * 2 * D).view(H, 2, D)
        return [("attn.q_proj.weight", rows[:, 0].flatten(), None),
                ("attn.gate_proj.weight", rows[:, 1].flatten(), None)]
    return state_layer(GGUF_TENSORS, rest)


GGUF = Architecture(lambda meta: gguf_state_config(meta, gguf_kinds), gguf_layer)
