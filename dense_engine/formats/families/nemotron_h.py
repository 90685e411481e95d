"""nemotron_h.py: Nemotron-H / Nemotron Nano 2 / Nemotron 3 Nano, a pattern of blocks, each a norm and one of Mamba2
(M), attention without rope (*), a squared-ReLU MLP (-) or a mixture of squared-ReLU experts (E: a sigmoid router
with a choice bias, grouped top-k, a routed scale, and a squared-ReLU shared expert; experts.py), its output added to
the residual. A mixing block and the MLP or experts block after it are one layer here (an FFN width of 0 where none
follows); an MLP block after another is refused. A Hugging Face folder (nemotron_h) or a GGUF file (nemotron_h:
granitehybrid's tensors in blocks of one kind each, attention where head_count_kv is not 0, a squared-ReLU MLP where
feed_forward_length is not, else Mamba2; grouped into layers as its folders are).
"""

from __future__ import annotations

import dataclasses
import functools
import re

from dense import DenseConfig
from dense_engine.formats.checkpoint import make_config
from dense_engine.formats.families.common import ConfigReader, head_rule, hf_weights, rename
from dense_engine.formats.families.experts import hf_experts, stack_experts
from dense_engine.formats.families.hybrid import MAMBA2_TENSORS, mamba2_layer, mamba2_values, time_step_limit
from dense_engine.formats.gguf_import import Architecture, Metadata
from dense_engine.system.errors import CheckpointError


def read_hf(folder: str, raw: dict, source: str):
    """Nemotron-H's folder."""
    cfg = ConfigReader(raw, source)
    names = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe", "mamba": "mamba", "linear_attention": "mamba",
             "attention": "attention", "full_attention": "attention", "mlp": "mlp", "moe": "moe"}
    given = cfg.get("layers_block_type") or cfg.get("layer_types") or list(cfg.get("hybrid_override_pattern", ""))
    if not given or not set(given) <= set(names) or int(cfg.get("num_hidden_layers", len(given))) != len(given):
        cfg.refuse("layers_block_type", "mamba, attention, mlp and moe blocks, num_hidden_layers of them")
    kinds, widths, moe = [], [], []  # (moe: the layers whose MLP is the experts)
    for block in (names[b] for b in given):
        if block in ("mlp", "moe") and (not kinds or widths[-1]):
            cfg.refuse("layers_block_type", "an mlp or moe block after each mamba or attention block at most")
        if block in ("mlp", "moe"):  # (an experts layer's width: one expert's, as a size only)
            widths[-1] = int(cfg.need("intermediate_size" if block == "mlp" else "moe_intermediate_size"))
            moe += [len(kinds) - 1] if block == "moe" else []
        else:
            kinds.append("mamba" if block == "mamba" else "full_attention")
            widths.append(0)
    for key, allowed in (("mlp_hidden_act", "relu2"), ("mamba_hidden_act", "silu")):
        if cfg.get(key, allowed) != allowed:
            cfg.refuse(key, f"{allowed} in Nemotron-H")
    for key in ("mlp_bias", "attention_bias", "mamba_proj_bias", "sliding_window", "num_nextn_predict_layers"):
        if cfg.get(key):
            cfg.refuse(key, "not in Nemotron-H's dense releases")
    for key in ("n_routed_experts", "n_shared_experts", "moe_intermediate_size", "moe_shared_expert_intermediate_size",
                "num_experts_per_tok", "routed_scaling_factor", "n_group", "topk_group", "norm_topk_prob",
                "mtp_layers_block_type", "moe_latent_size", "moe_shared_expert_overlap", "time_step_min",
                "time_step_max", "time_step_floor", "chunk_size", "expand", "use_mamba_kernels", "residual_in_fp32",
                "rescale_prenorm_residual", "num_logits_to_keep", "mamba_ssm_cache_dtype", "hidden_dropout",
                "output_router_logits"):
        cfg.get(key)  # (experts with no moe block, the MTP's blocks with none, initialization, kernels: unused)
    hidden, heads, layers = int(cfg.need("hidden_size")), int(cfg.need("num_attention_heads")), len(kinds)
    experts = dataclasses.replace(hf_experts(cfg, "nemotron_h", layers), dense_layers=tuple(
        i for i in range(layers) if i not in moe)) if moe else None
    m_heads, m_dim = int(cfg.need("mamba_num_heads")), int(cfg.need("mamba_head_dim"))
    config = make_config(
        source, vocab_size=int(cfg.need("vocab_size")), hidden_size=hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=int(cfg.get("num_key_value_heads", heads)),
        head_dim=int(cfg.get("head_dim") or hidden // heads), intermediate_size=widths,
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)), nope_layers=list(range(layers)),
        layer_types=kinds, mlp="relu2",
        mamba_heads=(m_heads, m_dim, int(cfg.get("n_groups", 8)), int(cfg.get("ssm_state_size", 128))),
        mamba_biases=(bool(cfg.get("use_bias", False)), bool(cfg.get("use_conv_bias", True))),
        time_step_limit=time_step_limit(cfg),
        conv_kernel=int(cfg.get("conv_kernel", 4)), norm_eps=float(cfg.get("layer_norm_epsilon", 1e-5)),
        norm_gain_in_float32=True, tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        extras={"experts": experts} if experts else {})
    cfg.check_unread()
    layer_of, layer = [], -1  # our layer of each block: a mixing block starts one
    for block in given:
        layer += names[block] not in ("mlp", "moe")
        layer_of.append(layer)
    table = {}
    for name, thunk in hf_weights(folder).items():
        match = re.fullmatch(r"(?:model|backbone)\.layers\.(\d+)\.(.*)", name)
        if match is None:
            table[name] = thunk
            continue
        block, rest = int(match.group(1)), match.group(2)
        if block >= len(given):
            raise CheckpointError(f"{source}: unexpected tensor {name!r}")
        kind = "mlp" if names[given[block]] in ("mlp", "moe") else "mixer"
        table[f"layer{layer_of[block]}.{kind}.{rest}"] = thunk
    rules = [(r"(?:model|backbone)\.embeddings\.weight", "embed_tokens.weight"),
             (r"(?:model|backbone)\.norm_f\.weight", "norm.weight"),
             head_rule(config.tie_word_embeddings),
             (r"layer(\d+)\.mixer\.norm\.weight", r"layers.\1.mixer_norm.weight"),
             (r"layer(\d+)\.mlp\.norm\.weight", r"layers.\1.mlp_norm.weight"),
             (r"layer(\d+)\.mixer\.mixer\.([qkvo]_proj)\.weight", r"layers.\1.mixer.\2.weight"),
             (r"layer(\d+)\.mixer\.mixer\.(in_proj|out_proj)\.(weight|bias)", r"layers.\1.mixer.\2.\3"),
             (r"layer(\d+)\.mixer\.mixer\.conv1d\.(weight|bias)", r"layers.\1.mixer.conv_\2"),
             (r"layer(\d+)\.mixer\.mixer\.(A_log|D|dt_bias|norm\.weight)", r"layers.\1.mixer.\2"),
             (r"layer(\d+)\.mlp\.mixer\.(up_proj|down_proj)\.weight", r"layers.\1.mlp.\2.weight"),
             # an experts block's router, its experts one by one (the Hub's) or stacked (transformers 5's own), its
             # shared expert
             (r"layer(\d+)\.mlp\.mixer\.gate\.weight", r"layers.\1.mlp.router.weight"),
             (r"layer(\d+)\.mlp\.mixer\.gate\.e_score_correction_bias", r"layers.\1.mlp.choice_bias"),
             (r"layer(\d+)\.mlp\.mixer\.experts\.(\d+)\.(up|down)_proj\.weight", r"layers.\1.mlp.expert\2.\3"),
             (r"layer(\d+)\.mlp\.mixer\.experts\.(up_proj|down_proj)", r"layers.\1.mlp.stacked.\2"),
             (r"layer(\d+)\.mlp\.mixer\.shared_experts\.(up|down)_proj\.weight",
              r"layers.\1.mlp.shared.\2_proj.weight")]
    table = rename(table, rules, source)
    if experts:
        stack_experts(table, config, source)
    return config, table


# ----------------------------------------------------------------------------------------------------------------
# GGUF files (nemotron_h)


def gguf_blocks(meta: Metadata) -> list[tuple[int, str]]:
    """Each block's layer in this engine and its kind ("attention", "mamba", "mlp"): a mixing block starts a layer,
    an MLP block joins the one before it."""
    blocks, path, arch = int(meta.key("block_count")), meta.path, meta.arch
    kv, ff = ([int(n) for n in meta.key(name)] for name in ("attention.head_count_kv", "feed_forward_length"))
    if len(kv) < blocks or len(ff) < blocks:
        raise CheckpointError(f"{path}: GGUF metadata {arch}.attention.head_count_kv and feed_forward_length must "
                              "list every block")
    out, layer = [], -1
    for i in range(blocks):
        kind = "attention" if kv[i] else "mlp" if ff[i] else "mamba"
        if kind == "mlp" and (not out or out[-1][1] == "mlp"):
            raise CheckpointError(f"{path}: block {i} is an MLP block after no mixing block: not supported")
        layer += kind != "mlp"
        out.append((layer, kind))
    return out


def gguf_config(meta: Metadata) -> DenseConfig:
    """Nemotron-H as llama.cpp reads it: gguf_blocks' layers, attention without rope, squared-ReLU MLPs."""
    key = meta.key
    blocks = gguf_blocks(meta)
    layers = blocks[-1][0] + 1
    kinds, widths, kv = ["mamba"] * layers, [0] * layers, [1] * layers
    ff = [int(n) for n in key("feed_forward_length")]
    for i, (layer, kind) in enumerate(blocks):
        if kind == "attention":
            kinds[layer], kv[layer] = "full_attention", int(key("attention.head_count_kv")[i])
        elif kind == "mlp":
            widths[layer] = ff[i]
    kv = [n if kinds[i] == "full_attention" else max(kv) for i, n in enumerate(kv)]  # (a Mamba2 layer: any count)
    hidden, heads = int(key("embedding_length")), int(key("attention.head_count"))
    first = next((i for i, (_, kind) in enumerate(blocks) if kind == "mamba"), 0)
    return make_config(
        meta.path, vocab_size=meta.vocab_size(), hidden_size=hidden,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv[0] if len(set(kv)) == 1 else kv,
        head_dim=int(key("attention.key_length", hidden // heads)), intermediate_size=widths,
        max_position_embeddings=int(key("context_length", 4096)), layer_types=kinds, mlp="relu2",
        nope_layers=None if key("rope.scaling.finetuned", True) else list(range(layers)),
        norm_eps=float(key("attention.layer_norm_epsilon", key("attention.layer_norm_rms_epsilon", 1e-5))),
        norm_gain_in_float32=True, tie_word_embeddings=meta.tied, **mamba2_values(meta, first))


GGUF = Architecture(gguf_config, functools.partial(mamba2_layer, MAMBA2_TENSORS), blocks=gguf_blocks)
