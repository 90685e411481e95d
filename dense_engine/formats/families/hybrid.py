"""hybrid.py: what the families whose layers keep a state (Gated DeltaNet, the short conv, Mamba2) share. A Hugging
Face folder: the keys a hybrid shares with Llama's layout (state_config); a Mamba2 mixer's names and dt range
(mamba_rules, time_step_limit). A GGUF file: the keys every hybrid's file shares (gguf_state_config), its
attention layers' and Mamba2 mixers' tensors (ATTENTION_TENSORS, MAMBA2_TENSORS), and what llama.cpp's converter
changed in a state layer's tensors, undone (state_layer, mamba2_layer: ssm_a holds -exp(A_log), conv kernels lost
their middle dimension, D and the Mamba2 norm were reshaped, attention's q/k rows turned as llama's).
"""

from __future__ import annotations

import math

import torch

from dense import DenseConfig
from dense_engine.formats.checkpoint import make_config
from dense_engine.formats.families.common import ConfigReader, gguf_rope_scaling, plain_rope, refuse_act
from dense_engine.formats.gguf_import import Metadata, unpermute
from dense_engine.system.errors import CheckpointError


def state_config(cfg: ConfigReader, layers: int, **values) -> DenseConfig:
    """The config keys Qwen3.5, OLMo hybrid and LFM2 share with Llama's layout, read, and the family's own values."""
    hidden, heads = int(cfg.need("hidden_size")), int(cfg.need("num_attention_heads"))
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    theta, rotary = plain_rope(cfg, head_dim)
    refuse_act(cfg)
    if cfg.get("attention_bias", False):
        cfg.refuse("attention_bias", "this family has no biases")
    return make_config(cfg.source, vocab_size=int(cfg.need("vocab_size")), hidden_size=hidden,
                       num_hidden_layers=layers, num_attention_heads=heads,
                       num_key_value_heads=int(cfg.get("num_key_value_heads", heads)), head_dim=head_dim,
                       max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)), rope_theta=theta,
                       rotary_dim=rotary, **{"qk_norm": "shared", **values})


def time_step_limit(cfg: ConfigReader) -> tuple[float, float]:
    """A Mamba2 config's dt range (transformers 5 writes infinity as {"__float__": "Infinity"})."""
    limit = cfg.get("time_step_limit", (0.0, math.inf))
    return tuple(float(t["__float__"] if isinstance(t, dict) else t) for t in limit)


def mamba_rules(layer: str, into: str) -> list:
    """The names of a Hugging Face Mamba2 mixer's tensors (under `layer`, its `mamba.`) as this engine's Mamba2 under
    layers.N.`into`."""
    return [(layer + r"mamba\.(in_proj|out_proj)\.(weight|bias)", rf"layers.\1.{into}\2.\3"),
            (layer + r"mamba\.conv1d\.(weight|bias)", rf"layers.\1.{into}conv_\2"),
            (layer + r"mamba\.(A_log|D|dt_bias|norm\.weight)", rf"layers.\1.{into}\2")]


# ----------------------------------------------------------------------------------------------------------------
# GGUF files

# A hybrid's attention layers and MLPs: per-layer GGUF tensors (after "blk.N.") -> native names (after "layers.N.")
ATTENTION_TENSORS = {"attn_norm.weight": "mixer_norm.weight", "attn_q.weight": "mixer.q_proj.weight",
                     "attn_k.weight": "mixer.k_proj.weight", "attn_v.weight": "mixer.v_proj.weight",
                     "attn_output.weight": "mixer.o_proj.weight", "attn_q_norm.weight": "mixer.q_norm.weight",
                     "attn_k_norm.weight": "mixer.k_norm.weight", "ffn_gate.weight": "mlp.gate_proj.weight",
                     "ffn_up.weight": "mlp.up_proj.weight", "ffn_down.weight": "mlp.down_proj.weight"}
# Mamba2 layers beside those (granitehybrid's; nemotron_h's blocks grouped into layers first; falcon-h1's side by
# side with attention)
MAMBA2_TENSORS = {**ATTENTION_TENSORS, "ffn_norm.weight": "mlp_norm.weight", "ssm_in.weight": "mixer.in_proj.weight",
                  "ssm_conv1d.weight": "mixer.conv_weight", "ssm_conv1d.bias": "mixer.conv_bias",
                  "ssm_dt.bias": "mixer.dt_bias", "ssm_a": "mixer.A_log", "ssm_d": "mixer.D",
                  "ssm_norm.weight": "mixer.norm.weight", "ssm_out.weight": "mixer.out_proj.weight"}


def gguf_state_config(meta: Metadata, kinds) -> DenseConfig:
    """The config of a hybrid's file, as llama.cpp's model code reads it: the keys every hybrid shares, and
    kinds(meta, kv, layers) -> (each layer's kind, the family's own config values), kv each layer's key/value heads (0
    for a state layer). Layers: block_count less the nextn_predict_layers MTP layers counted in it (a draft's:
    Checkpoint.mtp)."""
    key, path, arch = meta.key, meta.path, meta.arch
    meta.refuse_experts()
    if int(key("attention.sliding_window", 0)):
        raise CheckpointError(f"{path}: GGUF metadata {arch}.attention.sliding_window: sliding-window attention is not "
                              f"supported for {arch}")
    hidden, heads = int(key("embedding_length")), int(key("attention.head_count"))
    layers = int(key("block_count")) - int(key("nextn_predict_layers", 0))
    head_dim = meta.head_dim(hidden, heads)
    rope_dim, context = int(key("rope.dimension_count", head_dim)), int(key("context_length", 2048))
    if gguf_rope_scaling(meta, context, rope_dim) is not None:
        raise CheckpointError(f"{path}: GGUF metadata {arch}.rope.scaling.type: only plain rope for {arch}")
    kv = key("attention.head_count_kv", heads)
    kv = [int(n) for n in kv] if isinstance(kv, list) else [int(kv)] * layers  # (per layer: 0 for a state layer)
    types, values = kinds(meta, kv, layers)
    if len(types) != layers or len(kv) < layers:
        raise CheckpointError(f"{path}: GGUF metadata {arch}: {len(types)} layer kinds for {layers} layers")
    kv = [n or max(kv) or heads for n in kv[:layers]]  # (a state layer has no key/value heads: any count builds it)
    return make_config(
        path, vocab_size=meta.vocab_size(), hidden_size=hidden,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv[0] if len(set(kv)) == 1 else kv,
        head_dim=head_dim, intermediate_size=int(key("feed_forward_length")), max_position_embeddings=context,
        rope_theta=float(key("rope.freq_base", 10000.0)), rotary_dim=rope_dim if rope_dim != head_dim else None,
        layer_types=types, norm_eps=float(key("attention.layer_norm_rms_epsilon")),
        tie_word_embeddings=meta.tied, **values)


def state_layer(names: dict, rest: str) -> list[tuple] | None:
    """[(native name after "layers.N.", None, change or None)] for a hybrid's layer tensor `rest` by the family's
    names (None: no such tensor): conv kernels and ssm_a back to what the model holds."""
    native = names.get(rest)
    if native is None:
        return None
    if native.endswith("conv_weight"):
        return [(native, None, conv_kernel)]
    if native.endswith("A_log"):
        return [(native, None, a_log)]
    return [(native, None, None)]


def conv_kernel(w: torch.Tensor, where: str) -> torch.Tensor:
    """A depthwise conv's kernel [channels, W] (squeezed by the converter) -> the model's [channels, 1, W]."""
    return w.unsqueeze(1)


def a_log(w: torch.Tensor, where: str) -> torch.Tensor:
    """ssm_a [heads] (granitehybrid: [heads, 1]) holds -exp(A_log): A_log = log(-ssm_a) (the model computes -exp(A_log)
    again)."""
    if not (w < 0).all():
        raise CheckpointError(f"{where} holds values >= 0, not -exp(A_log)")
    return torch.log(-w.double()).float().reshape(-1)


def mamba2_values(meta: Metadata, block: int) -> dict:
    """A Mamba2 layer's config values from ssm.* (heads = time_step_rank, channels = inner_size / heads, groups,
    state size, conv width; the conv's bias as block `block` has it)."""
    key, path, arch = meta.key, meta.path, meta.arch
    heads, inner = int(key("ssm.time_step_rank")), int(key("ssm.inner_size"))
    if not 0 < heads or inner % heads:
        raise CheckpointError(f"{path}: GGUF metadata {arch}.ssm.inner_size {inner} is not a whole number of "
                              f"{arch}.ssm.time_step_rank {heads} heads")
    return {"mamba_heads": (heads, inner // heads, int(key("ssm.group_count")), int(key("ssm.state_size"))),
            "mamba_biases": (False, f"blk.{block}.ssm_conv1d.bias" in meta.tensors),
            "conv_kernel": int(key("ssm.conv_kernel"))}


def mamba2_layer(names: dict, config: DenseConfig, rest: str) -> list[tuple] | None:
    """state_layer for a Mamba2 hybrid: D ([heads, 1]) and the norm ([groups, channels]) flattened, the attention
    layers' q/k rows turned back from llama's order."""
    native = names.get(rest)
    if native in ("mixer.D", "mixer.norm.weight", "mixer.mamba.D", "mixer.mamba.norm.weight"):
        return [(native, None, lambda w, where: w.reshape(-1))]
    if native in ("mixer.q_proj.weight", "mixer.k_proj.weight"):  # llama's turned rows
        attention = config.layer_types.index("full_attention")
        heads = config.heads(attention) if native == "mixer.q_proj.weight" else config.kv_heads(attention)
        return [(native, unpermute(torch.arange(heads * config.head_dim), heads), None)]
    return state_layer(names, rest)
