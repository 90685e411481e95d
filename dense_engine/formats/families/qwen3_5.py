"""qwen3_5.py: Qwen3.5 / 3.6, three Gated DeltaNet layers to one full-attention layer, whose q_proj also yields an
output gate (per head: D query rows, then D gate rows), with q/k norms and a quarter of each head rotated; (1 + w)
norms; multi-token prediction layers (mtp.*) read as a draft's. A Hugging Face folder (qwen3_5_text, or qwen3_5: the
Hub's image-text folder) or a GGUF file (qwen35). Its mixtures of experts (experts.py: a shared expert behind a sigmoid
gate) read by the same reader: Qwen3.5-MoE (qwen3_5_moe_text, or qwen3_5_moe: the image-text folder) and Qwen3-Next
(qwen3_next: the same layers, its Gated DeltaNet's projections fused by key head, taken apart: split_by_key_head).

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
from dense_engine.formats.families.experts import expert_rules, hf_experts, stack_experts
from dense_engine.formats.families.hybrid import ATTENTION_TENSORS, gguf_state_config, state_config, state_layer
from dense_engine.formats.gguf_import import Architecture, Metadata
from dense_engine.system import machine
from dense_engine.system.errors import CheckpointError

# the mixtures: model_type -> the experts' reader's kind (experts.hf_experts)
MIXTURES = {"qwen3_5_moe": "qwen3_5_moe_text", "qwen3_5_moe_text": "qwen3_5_moe_text", "qwen3_next": "qwen3_next"}


def read_hf(folder: str, raw: dict, source: str):
    """qwen3_5_text, or qwen3_5 (the text model under model.language_model, the vision tower skipped with a note);
    the mixtures (MIXTURES) alike. mrope: text alone has one position in all its sections, so plain rope."""
    model_type = raw["model_type"]
    wrapped = model_type in ("qwen3_5", "qwen3_5_moe")
    text = dict((raw.get("text_config") or {}) if wrapped else raw)
    params = dict(text.get("rope_parameters") or {})
    for key in ("mrope_section", "mrope_interleaved"):  # (text positions: every section the same)
        params.pop(key, None)
    cfg = ConfigReader({**text, "rope_parameters": params}, source)
    layers = int(cfg.need("num_hidden_layers"))
    interval = int(cfg.get("full_attention_interval", 4))
    types = cfg.get("layer_types") or ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                                       for i in range(layers)]
    experts = hf_experts(cfg, MIXTURES[model_type], layers) if model_type in MIXTURES else None
    # (a mixture's intermediate_size: its dense layers' width, Qwen3-Next's mlp_only_layers; Qwen3.5-MoE has none)
    width = int(cfg.get("intermediate_size") or 0) if experts and not experts.dense_layers else \
        int(cfg.need("intermediate_size"))
    config = state_config(
        cfg, layers, intermediate_size=width, layer_types=types, extras={"experts": experts} if experts else {},
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
        rules += [(at + r"input_layernorm\.weight", to + r"\1.mixer_norm.weight"),
                  (at + r"post_attention_layernorm\.weight", to + r"\1.mlp_norm.weight"),
                  (at + r"self_attn\.([qkvo]_proj|[qk]_norm)\.weight", to + r"\1.mixer.\2.weight"),
                  (at + r"linear_attn\.(in_proj_\w+|out_proj|norm)\.weight", to + r"\1.mixer.\2.weight"),
                  (at + r"linear_attn\.conv1d\.weight", to + r"\1.mixer.conv_weight"),
                  (at + r"linear_attn\.(A_log|dt_bias)", to + r"\1.mixer.\2"),
                  (at + r"mlp\.(gate|up|down)_proj\.weight", to + r"\1.mlp.\2_proj.weight")]
    if experts:  # the router, experts and shared expert of the model's layers and of the draft's (under mtp.)
        rules += expert_rules(layer) + [(at, "mtp." + to) for at, to in expert_rules(mtp + r"layers\.(\d+)\.")]
    table = rename(weights, rules, source)
    for name in [n for n in table if n.endswith("mixer.in_proj_qkvz.weight")]:  # (Qwen3-Next)
        split_by_key_head(table, name.removesuffix("in_proj_qkvz.weight"), config)
    mtp_layers = sorted({int(n.split(".")[2]) for n in table if n.startswith("mtp.layers.")})
    for a in [f"layers.{i}.mixer." for i, kind in enumerate(types) if kind == "full_attention"] + \
            [f"mtp.layers.{j}.mixer." for j in mtp_layers]:
        split_rows(table, a + "q_proj.weight", {a + "q_proj.weight": 0, a + "gate_proj.weight": 1},
                   view=(config.num_attention_heads, 2, config.head_dim))
    if experts:
        stack_experts(table, config, source)
        draft = {n.removeprefix("mtp."): table.pop(n) for n in list(table) if n.startswith("mtp.layers.")}
        stack_experts(draft, config, source)  # (the draft's layers: fewer than the model's)
        table.update({"mtp." + n: thunk for n, thunk in draft.items()})
    return config, table


def split_by_key_head(table: dict, a: str, config: DenseConfig) -> None:
    """Qwen3-Next's fused projections of the Gated DeltaNet under `a` as Qwen3.5's: in_proj_qkvz [Hk * (2 Dk + 2 s
    Dv), C] holds, key head by key head, its q rows, its k rows, then the v rows and the z rows of its s = Hv / Hk
    value heads; in_proj_ba [Hk * 2s, C] its s b rows, then its s a rows. -> in_proj_qkv (every head's q, then k, then
    v: the conv's channels), in_proj_z, in_proj_b, in_proj_a; value head j belongs to key head j // s, as
    GatedDeltaNet reads them (tiled_values False)."""
    (Hk, Hv), (Dk, Dv) = config.extras["gated_deltanet"].heads, config.extras["gated_deltanet"].head_dims
    s = Hv // Hk
    qkvz, ba = table.pop(a + "in_proj_qkvz.weight"), table.pop(a + "in_proj_ba.weight")

    def rows(fused, widths: list[int], *parts: int):
        def read() -> torch.Tensor:
            groups = fused().unflatten(0, (Hk, -1)).split(widths, dim=1)  # each [Hk, width, C]
            return torch.cat([groups[p].flatten(0, 1) for p in parts])
        return read

    table[a + "in_proj_qkv.weight"] = rows(qkvz, [Dk, Dk, s * Dv, s * Dv], 0, 1, 2)
    table[a + "in_proj_z.weight"] = rows(qkvz, [Dk, Dk, s * Dv, s * Dv], 3)
    table[a + "in_proj_b.weight"], table[a + "in_proj_a.weight"] = rows(ba, [s, s], 0), rows(ba, [s, s], 1)


# ----------------------------------------------------------------------------------------------------------------
# GGUF files (qwen35)

# per-layer GGUF tensors (after "blk.N.") -> native names (after "layers.N.")
GGUF_TENSORS = {**ATTENTION_TENSORS, "post_attention_norm.weight": "mlp_norm.weight",  # (the MLP's input norm)
                "attn_qkv.weight": "mixer.in_proj_qkv.weight", "attn_gate.weight": "mixer.in_proj_z.weight",
                "ssm_beta.weight": "mixer.in_proj_b.weight", "ssm_alpha.weight": "mixer.in_proj_a.weight",
                "ssm_conv1d.weight": "mixer.conv_weight", "ssm_dt.bias": "mixer.dt_bias", "ssm_a": "mixer.A_log",
                "ssm_norm.weight": "mixer.norm.weight", "ssm_out.weight": "mixer.out_proj.weight"}


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
        return [("mixer.q_proj.weight", rows[:, 0].flatten(), None),
                ("mixer.gate_proj.weight", rows[:, 1].flatten(), None)]
    return state_layer(GGUF_TENSORS, rest)


GGUF = Architecture(lambda meta: gguf_state_config(meta, gguf_kinds), gguf_layer)
