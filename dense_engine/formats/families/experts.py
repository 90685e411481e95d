"""experts.py: the mixtures of experts of the Llama-layout rows (llama.py's FAMILIES with `experts`) and of three
hybrids (granite_hybrid.py, nemotron_h.py, lfm2.py read their names): each model type's config keys read into a
layer_kinds.ExpertsConfig, and its experts' tensors stacked into the native experts_gate_up [E, 2I, C] /
experts_down [E, C, I] of layer_kinds.Experts.

| model_type | router                                    | experts                 | beside them                      |
| ---------- | ----------------------------------------- | ----------------------- | -------------------------------- |
| mixtral    | softmax, top-k renormalized               | SwiGLU (w1, w3, w2)     |                                  |
| qwen2_moe  | softmax, top-k (norm_topk_prob)           | SwiGLU                  | a shared expert behind a gate    |
| qwen3_moe  | softmax, top-k (norm_topk_prob)           | SwiGLU                  | dense layers (mlp_only_layers)   |
| olmoe      | softmax, top-k (norm_topk_prob)           | SwiGLU                  |                                  |
| glm4_moe   | sigmoid, a choice bias, grouped top-k,    | SwiGLU                  | shared experts; the first layers |
|            | renormalized, a routed scale              |                         | dense (first_k_dense_replace)    |
| gpt_oss    | a biased router, top-k, softmax over them | clamped SwiGLU, biases  |                                  |
| qwen3_next | softmax, top-k (norm_topk_prob)           | SwiGLU                  | a shared expert behind a gate;   |
|            |                                           |                         | dense layers (mlp_only_layers)   |
| qwen3_5_moe| softmax, top-k renormalized               | SwiGLU                  | a shared expert behind a gate    |
| granitemoe | top-k, a softmax over them (the softmax   | SwiGLU (stacked)        | its shared MLP, added, no gate   |
| hybrid     | renormalized)                             |                         |                                  |
| nemotron_h | sigmoid, a choice bias, grouped top-k,    | squared ReLU (up, down) | a squared-ReLU shared expert;    |
|            | renormalized, a routed scale              |                         | dense where the block is not moe |
| lfm2_moe   | sigmoid, a choice bias (use_expert_bias), | SwiGLU (w1, w3, w2)     | the first layers dense           |
|            | renormalized, a routed scale              |                         | (num_dense_layers)               |

A folder's experts come one tensor each (the Hub's: mlp.experts.N.gate_proj.weight, ...) or stacked (transformers
5's own: mlp.experts.gate_up_proj [E, 2I, C]; gpt-oss's [E, C, 2I] with gate and up interleaved).

GGUF files (gguf_experts, llama.py's reader): llama.cpp's llama (Mixtral), olmoe, qwen2moe and qwen3moe, their
experts stacked by the converter (blk.N.ffn_gate_exps / ffn_up_exps [E, I, C], ffn_down_exps [E, C, I], the router
ffn_gate_inp [E, C]; qwen2moe's shared expert ffn_{gate,up,down}_shexp and its gate ffn_gate_inp_shexp [C]); what
llama.cpp's model code hard-codes for each (whether the top-k is renormalized) as it does.
"""

from __future__ import annotations

import re

import torch

from dense_engine.formats.families.common import ConfigReader
from dense_engine.system.errors import CheckpointError
from layer_kinds import ExpertsConfig

# keys the readers below read only to know they change nothing at inference
TRAINING_KEYS = ("output_router_logits", "router_aux_loss_coef", "router_jitter_noise", "router_z_loss_coef")


def hf_experts(cfg: ConfigReader, kind: str, layers: int) -> ExpertsConfig:
    """The experts' record of a model type's config (the table above)."""
    for key in TRAINING_KEYS:
        cfg.get(key)
    chosen = int(cfg.need("num_experts_per_tok"))
    count = int(cfg.get("num_experts") or cfg.get("num_local_experts") or cfg.get("n_routed_experts") or 0)
    if count < chosen:
        cfg.refuse("num_experts_per_tok", f"at most the {count} experts")
    if kind in ("qwen2_moe", "qwen3_moe"):
        step, only = int(cfg.get("decoder_sparse_step", 1)), list(cfg.get("mlp_only_layers") or [])
        dense = tuple(i for i in range(layers) if i in only or (i + 1) % step)
        return ExpertsConfig(count=count, chosen=chosen, width=int(cfg.need("moe_intermediate_size")),
                             renormalize=bool(cfg.get("norm_topk_prob", False)),
                             shared_width=int(cfg.get("shared_expert_intermediate_size", 0)),
                             shared_gate=kind == "qwen2_moe", dense_layers=dense)
    if kind in ("qwen3_next", "qwen3_5_moe_text"):  # (read by qwen3_5.py) a shared expert behind a sigmoid gate;
        # Qwen3.5's: every layer a mixture, its top-k always renormalized (transformers reads neither key)
        next_ = kind == "qwen3_next"
        step = int(cfg.get("decoder_sparse_step", 1)) if next_ else 1
        only = list(cfg.get("mlp_only_layers") or []) if next_ else []
        return ExpertsConfig(count=count, chosen=chosen, width=int(cfg.need("moe_intermediate_size")),
                             renormalize=bool(cfg.get("norm_topk_prob", True)) if next_ else True,
                             shared_width=int(cfg.get("shared_expert_intermediate_size", 512)), shared_gate=True,
                             dense_layers=tuple(i for i in range(layers) if i in only or (i + 1) % step))
    if kind == "mixtral":
        return ExpertsConfig(count=count, chosen=chosen, width=int(cfg.need("intermediate_size")))
    if kind == "olmoe":
        return ExpertsConfig(count=count, chosen=chosen, width=int(cfg.need("intermediate_size")),
                             renormalize=bool(cfg.get("norm_topk_prob", False)))
    if kind == "glm4_moe":
        width = int(cfg.need("moe_intermediate_size"))
        groups = (int(cfg.get("n_group", 1)), int(cfg.get("topk_group", 1)))
        if count % groups[0] or not 0 < groups[1] <= groups[0]:
            cfg.refuse("n_group", f"groups that divide the {count} experts, topk_group of them kept")
        return ExpertsConfig(count=count, chosen=chosen, width=width, scoring="sigmoid", choice_bias=True,
                             renormalize=bool(cfg.get("norm_topk_prob", True)), groups=groups,
                             routed_scale=float(cfg.get("routed_scaling_factor", 1.0)),
                             shared_width=width * int(cfg.get("n_shared_experts", 0)),
                             dense_layers=tuple(range(min(int(cfg.get("first_k_dense_replace", 0)), layers))))
    if kind == "gpt_oss":
        if float(cfg.get("swiglu_alpha", 1.702)) != 1.702:
            cfg.refuse("swiglu_alpha", "gpt-oss's 1.702")
        return ExpertsConfig(count=count, chosen=chosen, width=int(cfg.need("intermediate_size")), router_bias=True,
                             activation="clamped_swiglu", clamp=float(cfg.get("swiglu_limit", 7.0)))
    if kind == "granitemoehybrid":  # (its shared_mlp, always there, is the shared expert: added, no gate)
        return ExpertsConfig(count=count, chosen=chosen, width=int(cfg.need("intermediate_size")),
                             shared_width=int(cfg.need("shared_intermediate_size")))
    if kind == "nemotron_h":  # (its dense layers: its blocks say, nemotron_h.py)
        if cfg.get("moe_latent_size"):
            cfg.refuse("moe_latent_size", "experts that read the hidden state itself (no latent projection)")
        groups = (int(cfg.get("n_group", 1)), int(cfg.get("topk_group", 1)))
        if count % groups[0] or not 0 < groups[1] <= groups[0]:
            cfg.refuse("n_group", f"groups that divide the {count} experts, topk_group of them kept")
        for key in ("n_shared_experts", "moe_shared_expert_overlap"):
            cfg.get(key)  # (transformers runs one shared expert, moe_shared_expert_intermediate_size wide)
        return ExpertsConfig(count=count, chosen=chosen, width=int(cfg.need("moe_intermediate_size")),
                             scoring="sigmoid", choice_bias=True, renormalize=bool(cfg.get("norm_topk_prob", True)),
                             groups=groups, routed_scale=float(cfg.get("routed_scaling_factor", 1.0)),
                             activation="relu2", shared_width=int(cfg.need("moe_shared_expert_intermediate_size"))
                             or int(cfg.need("intermediate_size")))  # (0: transformers' MLP falls back to that)
    if kind == "lfm2_moe":  # (renormalized over sum + 1e-6, not + 1e-20: apart by 1e-6 of the weights at most)
        return ExpertsConfig(count=count, chosen=chosen, width=int(cfg.need("moe_intermediate_size")),
                             scoring="sigmoid", choice_bias=bool(cfg.get("use_expert_bias", True)),
                             renormalize=bool(cfg.get("norm_topk_prob", True)),
                             routed_scale=float(cfg.get("routed_scaling_factor", 1.0)),
                             dense_layers=tuple(range(min(int(cfg.get("num_dense_layers", 2)), layers))))
    raise CheckpointError(f"{cfg.source}: model_type {kind!r} has no experts reader")


# GGUF architectures whose mixtures are read -> (the top-k renormalized, a shared expert behind a sigmoid gate), as
# llama.cpp's model code fixes them (build_moe_ffn's norm_w; no metadata key says it)
GGUF_MIXTURES = {"llama": (True, False), "olmoe": (False, False), "qwen2moe": (False, True), "qwen3moe": (True, False)}
# a layer's expert tensors (after "blk.N.") -> native names (after "layers.N."); gate and up joined by join_experts
GGUF_EXPERTS = {"ffn_gate_inp.weight": "mlp.router.weight", "ffn_gate_exps.weight": "mlp.experts_gate",
                "ffn_up_exps.weight": "mlp.experts_up", "ffn_down_exps.weight": "mlp.experts_down",
                "ffn_gate_shexp.weight": "mlp.shared.gate_proj.weight",
                "ffn_up_shexp.weight": "mlp.shared.up_proj.weight",
                "ffn_down_shexp.weight": "mlp.shared.down_proj.weight",
                "ffn_gate_inp_shexp.weight": "mlp.shared_gate.weight"}


def gguf_experts(meta, layers: int) -> ExpertsConfig | None:
    """The experts' record of a GGUF file (meta: gguf_import.Metadata) with `ARCH.expert_count`, read as llama.cpp
    reads it: each expert expert_feed_forward_length wide (llama, olmoe: feed_forward_length; absent:
    feed_forward_length / expert_used_count), a layer without a router a plain MLP; None without experts. A mixture
    of another architecture is refused in one line."""
    count = int(meta.key("expert_count", 0))
    if not count:
        return None
    if meta.arch not in GGUF_MIXTURES:
        meta.refuse_experts()
    renormalize, shared = GGUF_MIXTURES[meta.arch]
    chosen, ffn = int(meta.key("expert_used_count", 0)), int(meta.key("feed_forward_length"))
    if not 0 < chosen <= count:
        raise CheckpointError(f"{meta.path}: GGUF metadata {meta.arch}.expert_used_count {chosen}: expected 1 to the "
                              f"{count} experts")
    shared_width = int(meta.key("expert_shared_feed_forward_length", 0))
    if shared_width and not shared:  # (llama.cpp's Granite MoE shared, another architecture's files)
        raise CheckpointError(f"{meta.path}: GGUF metadata {meta.arch}.expert_shared_feed_forward_length "
                              f"{shared_width}: a shared expert is not supported for {meta.arch}")
    width = ffn if meta.arch in ("llama", "olmoe") else (int(meta.key("expert_feed_forward_length", 0))
                                                         or ffn // chosen)
    return ExpertsConfig(count=count, chosen=chosen, width=width, renormalize=renormalize,
                         shared_width=(shared_width or ffn) if shared else 0, shared_gate=shared,
                         dense_layers=tuple(i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" not in
                                            meta.tensors))


def join_experts(table: dict, config, source: str) -> None:
    """A GGUF file's experts_gate and experts_up [E, I, C] as Experts' experts_gate_up [E, 2I, C] (gate rows, then up
    rows), and a shared expert's gate [C] (llama.cpp's shape) as the linear's [1, C]."""
    for i in range(config.num_hidden_layers):
        m = f"layers.{i}.mlp."
        if m + "experts_gate" in table:
            gate, up = table.pop(m + "experts_gate"), table.pop(m + "experts_up", None)
            if up is None:
                raise CheckpointError(f"{source}: tensor 'blk.{i}.ffn_gate_exps.weight' has no ffn_up_exps beside it")
            table[m + "experts_gate_up"] = lambda gate=gate, up=up: torch.cat([gate(), up()], dim=1)
        if m + "shared_gate.weight" in table:
            table[m + "shared_gate.weight"] = lambda w=table[m + "shared_gate.weight"]: w().reshape(1, -1)


def expert_rules(layer: str) -> list[tuple[str, str]]:
    """Rename rules (common.rename) for a layer's router and experts, `layer` the regex of a layer's prefix with its
    index as group 1: to native names, the experts one by one (stacked by stack_experts)."""
    return [
        (layer + r"(?:mlp|block_sparse_moe)\.(?:gate|router)\.weight", r"layers.\1.mlp.router.weight"),
        (layer + r"mlp\.router\.bias", r"layers.\1.mlp.router.bias"),
        (layer + r"mlp\.gate\.e_score_correction_bias", r"layers.\1.mlp.choice_bias"),
        (layer + r"mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight", r"layers.\1.mlp.expert\2.\3"),
        (layer + r"block_sparse_moe\.experts\.(\d+)\.(w[123])\.weight", r"layers.\1.mlp.expert\2.\3"),
        (layer + r"mlp\.experts\.(gate_up_proj|down_proj)(_bias)?", r"layers.\1.mlp.stacked.\2\3"),
        (layer + r"mlp\.shared_experts?\.(gate|up|down)_proj\.weight", r"layers.\1.mlp.shared.\2_proj.weight"),
        (layer + r"mlp\.shared_expert_gate\.weight", r"layers.\1.mlp.shared_gate.weight")]


MIXTRAL_NAMES = {"w1": "gate", "w3": "up", "w2": "down"}


def stack_experts(table: dict, config, source: str) -> None:
    """Replace each layer's experts in table (as expert_rules named them) by the two stacked tensors Experts holds:
    experts_gate_up [E, 2I, C] (gate rows, then up rows) and experts_down [E, C, I], and gpt-oss's biases."""
    spec = config.extras["experts"]
    for i in range(config.num_hidden_layers):
        m = f"layers.{i}.mlp."
        ones = {}
        for name in [n for n in table if n.startswith(m + "expert") and not n.startswith(m + "experts_")]:
            match = re.fullmatch(re.escape(m) + r"expert(\d+)\.(\w+)", name)
            ones[(int(match[1]), MIXTRAL_NAMES.get(match[2], match[2]))] = table.pop(name)
        stacked = {name[len(m + "stacked."):]: table.pop(name) for name in list(table)
                   if name.startswith(m + "stacked.")}
        if ones:
            parts = ("up", "down") if spec.activation == "relu2" else ("gate", "up", "down")  # (relu2: no gate)
            missing = [(e, p) for e in range(spec.count) for p in parts if (e, p) not in ones]
            if missing:
                raise CheckpointError(f"{source}: layer {i} lacks expert {missing[0][0]}'s {missing[0][1]}_proj")
            table[m + "experts_gate_up"] = lambda ones=ones, parts=parts: torch.stack(
                [torch.cat([ones[(e, p)]() for p in parts[:-1]]) for e in range(spec.count)])
            table[m + "experts_down"] = lambda ones=ones: torch.stack([ones[(e, "down")]() for e in range(spec.count)])
        elif stacked and spec.activation == "clamped_swiglu":  # gpt-oss's: [E, C, 2I] and [E, I, C], x @ W; gate
            # and up interleaved
            table[m + "experts_gate_up"] = lambda t=stacked["gate_up_proj"]: deinterleaved(t().transpose(1, 2), 1)
            table[m + "experts_down"] = lambda t=stacked["down_proj"]: t().transpose(1, 2).contiguous()
            table[m + "experts_gate_up_bias"] = lambda t=stacked["gate_up_proj_bias"]: deinterleaved(t(), 1)
            table[m + "experts_down_bias"] = stacked["down_proj_bias"]
        elif stacked:  # transformers 5's own: [E, 2I, C] and [E, C, I], as Experts holds them
            table[m + "experts_gate_up"] = stacked["up_proj" if "up_proj" in stacked else "gate_up_proj"]  # (relu2's)
            table[m + "experts_down"] = stacked["down_proj"]


def deinterleaved(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Rows (gate, up, gate, up, ...) along dim as (gate, ..., up, ...)."""
    pairs = t.unflatten(dim, (-1, 2))
    return torch.cat([pairs.select(dim + 1, 0), pairs.select(dim + 1, 1)], dim=dim).contiguous()
