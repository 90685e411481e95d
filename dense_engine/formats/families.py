"""families.py: each supported checkpoint family's config and tensor names, mapped to dense.py's native ones.

The Llama-layout families differ in a few switches and defaults: one table, FAMILIES (model type -> Family), holds
them, and serves both their Hugging Face folders (hf_decoder) and their GGUF architectures (gguf_import.py). The
others, whose layouts differ more, have a small reader each. Every reader returns a checked DenseConfig and a table
{native name: thunk} whose thunks read, slice or merge the family's tensors on demand (checkpoint.py). Stands on
dense.py and checkpoint.py; convert.py dispatches to these by what a path holds.

| family                       | what is on disk                                                         |
| ---------------------------- | ----------------------------------------------------------------------- |
| ShellElastic                 | native: config.json + model.safetensors (convert.py reads it)            |
| Sprout                       | ckpt.pt {"model", "config": {vocab_size, dim, n_layers, ...}}            |
| GermanGPT                    | checkpoint.pt {"config": {d_model, n_kv_heads, ...}, "model"}             |
| OpenELM                      | Hugging Face folder, model_type "openelm"                                |
| GPT-NeoX                     | Hugging Face folder, model_type "gpt_neox"                               |
| GPT-NeoX original            | global_step*/layer_NN-model_0R-model_states.pt + configs/*.yml           |
| the FAMILIES table (21)      | Hugging Face folder, model_type llama, mistral, qwen2, qwen3, gemma,     |
|                              | gemma2, gemma3_text, phi3, smollm3, granite, olmo2, olmo3, stablelm,     |
|                              | seed_oss, glm4, cohere, cohere2, exaone4, apertus, hunyuan_v1_dense,     |
|                              | ministral3 (also inside mistral3, the image-text wrapper), apertus1p5_  |
|                              | text (also inside apertus1p5); GGUF files of each row's `gguf`          |
|                              | architecture (gguf_import.py)                                            |
"""

from __future__ import annotations

import dataclasses
import functools
import glob
import math
import os
import re
from dataclasses import dataclass

import numpy as np
import torch

from dense import DenseConfig
from dense_engine.formats import lora, prequantized
from dense_engine.formats.checkpoint import Checkpoint, eager, load_pickle, make_config, open_safetensors, read_json
from dense_engine.system import machine
from dense_engine.system.errors import CheckpointError, first_line

# Non-parameter buffers that older exports carry; recognised and skipped.
SKIPPED_BUFFERS = re.compile(r".*\.(rotary_emb\.inv_freq|attention\.bias|attention\.masked_bias|attn\.bias|"
                             r"attn\.masked_bias)$")


def hf_weights(folder: str) -> dict:
    """{name: thunk} over a Hugging Face folder's tensors; a quantized folder's linears dequantized (prequantized.py),
    the LoRA adapters of this load merged (lora.py)."""
    return lora.merged(prequantized.dequantized_weights(stored_weights(folder), folder), folder, hf_lora_names)


def hf_lora_names(adapter, name: str) -> list[tuple[str, None]]:
    if adapter.names != "peft":
        raise CheckpointError(f"--lora {adapter.path}: a llama.cpp adapter applies to a GGUF base of its architecture")
    return [(name, None)]


def stored_weights(folder: str) -> dict:
    """{name: thunk} over a Hugging Face folder: model.safetensors, a sharded safetensors index, or
    pytorch_model.bin (and its index) when there are no safetensors."""
    for index_name, single in (("model.safetensors.index.json", "model.safetensors"),
                               ("pytorch_model.bin.index.json", "pytorch_model.bin")):
        index = os.path.join(folder, index_name)
        if os.path.isfile(index):
            weight_map = read_json(index).get("weight_map")
            if not isinstance(weight_map, dict):
                raise CheckpointError(f"{index}: no 'weight_map'")
            table = {}
            for shard in dict.fromkeys(weight_map.values()):
                shard_path = os.path.join(folder, shard)
                if not os.path.isfile(shard_path):
                    raise CheckpointError(f"{index}: shard {shard!r} is named in the index but absent")
                shard_table = open_safetensors(shard_path) if shard.endswith(".safetensors") else \
                    eager(load_pickle(shard_path))
                table.update({n: f for n, f in shard_table.items() if weight_map.get(n) == shard})
            return table
        if os.path.isfile(os.path.join(folder, single)):
            path = os.path.join(folder, single)
            return open_safetensors(path) if single.endswith(".safetensors") else eager(load_pickle(path))
    raise CheckpointError(f"{folder}: no model.safetensors, safetensors index or pytorch_model.bin")


def rename(source: dict, rules: list[tuple[str, str]], origin: str) -> dict:
    """Map foreign names to native ones with regex rules (first match wins); skipped buffers are dropped and any
    other name that no rule matches is an error."""
    table = {}
    for name, thunk in source.items():
        if SKIPPED_BUFFERS.match(name):
            continue
        for pattern, target in rules:
            if re.fullmatch(pattern, name):
                if target:
                    table[re.sub(pattern, target, name)] = thunk
                break
        else:
            raise CheckpointError(f"{origin}: unexpected tensor {name!r}")
    return table


def split_rows(table: dict, name: str, parts: dict, *, view: tuple[int, ...] | None = None) -> None:
    """Replace the fused tensor table[name] by slices. parts maps native name -> (first row, end row); or, with
    view, rows are reshaped to view (e.g. [heads, 3, head_dim]) and parts maps native name -> index in dim 1."""
    fused = table.pop(name)

    def piece(where):
        def read() -> torch.Tensor:
            t = fused()
            if view is None:
                return t[where[0]:where[1]]
            return t.reshape(view + tuple(t.shape[1:]))[:, where].flatten(0, 1)
        return read

    for target, where in parts.items():
        table[target] = piece(where)


def need(raw: dict, key: str, source: str):
    if key not in raw:
        raise CheckpointError(f"{source}: missing config field {key!r}")
    return raw[key]


# ----------------------------------------------------------------------------------------------------------------
# Families


def sprout(raw: dict, state: dict, source: str):
    """Sprout (its reference code's checkpoint): fused qkv, nn.RMSNorm eps 1e-5, rotate-half RoPE in float32, untied
    head."""
    state = {k.removeprefix("_orig_mod."): v for k, v in state.items()}
    dim, heads = int(need(raw, "dim", source)), int(need(raw, "n_heads", source))
    if "blocks.0.mlp.w_gate.weight" not in state:
        raise CheckpointError(f"{source}: missing tensor 'blocks.0.mlp.w_gate.weight'")
    config = make_config(
        source, vocab_size=int(need(raw, "vocab_size", source)), hidden_size=dim,
        num_hidden_layers=int(need(raw, "n_layers", source)), num_attention_heads=heads, head_dim=dim // heads,
        intermediate_size=int(state["blocks.0.mlp.w_gate.weight"].shape[0]),
        max_position_embeddings=int(raw.get("block_size", 1024)), norm_eps=1e-5, norm_gain_in_float32=True)
    table = rename(eager(state), [
        (r"tok_emb\.weight", "embed_tokens.weight"), (r"norm_f\.weight", "norm.weight"),
        (r"head\.weight", "lm_head.weight"),
        (r"blocks\.(\d+)\.n1\.weight", r"layers.\1.attn_norm.weight"),
        (r"blocks\.(\d+)\.n2\.weight", r"layers.\1.mlp_norm.weight"),
        (r"blocks\.(\d+)\.attn\.qkv\.weight", r"layers.\1.attn.qkv.weight"),
        (r"blocks\.(\d+)\.attn\.proj\.weight", r"layers.\1.attn.o_proj.weight"),
        (r"blocks\.(\d+)\.mlp\.w_(gate|up|down)\.weight", r"layers.\1.mlp.\2_proj.weight")], source)
    for i in range(config.num_hidden_layers):
        split_rows(table, f"layers.{i}.attn.qkv.weight", {f"layers.{i}.attn.{p}_proj.weight": (j * dim, (j + 1) * dim)
                                                          for j, p in enumerate("qkv")})
    return config, table


def germangpt(raw: dict, state: dict, source: str):
    """GermanGPT (its reference code's checkpoint): RMSNorm eps 1e-6, RoPE on interleaved pairs, GQA, tied embeddings
    when tie_embeddings."""
    if raw.get("norm", "rmsnorm") != "rmsnorm" or raw.get("mlp", "swiglu") != "swiglu":
        raise CheckpointError(f"{source}: only norm 'rmsnorm' and mlp 'swiglu' exist in GermanGPT")
    d_model, heads = int(need(raw, "d_model", source)), int(raw.get("n_heads", 16))
    tied = bool(raw.get("tie_embeddings", True))
    config = make_config(
        source, vocab_size=int(need(raw, "vocab_size", source)), hidden_size=d_model,
        num_hidden_layers=int(raw.get("n_layers", 24)), num_attention_heads=heads,
        num_key_value_heads=int(raw.get("n_kv_heads", heads)), head_dim=d_model // heads,
        intermediate_size=int(raw.get("d_ff", 2816)), max_position_embeddings=int(raw.get("context_len", 2048)),
        rope_theta=float(raw.get("rope_theta", 10000.0)), rope_layout="interleaved", norm_eps=1e-6,
        tie_word_embeddings=tied)
    table = rename(eager(state), [
        (r"token_embedding\.weight", "embed_tokens.weight"), (r"norm\.weight", "norm.weight"),
        (r"lm_head\.weight", None if tied else "lm_head.weight"),
        (r"blocks\.(\d+)\.(attn_norm)\.weight", r"layers.\1.\2.weight"),
        (r"blocks\.(\d+)\.ffn_norm\.weight", r"layers.\1.mlp_norm.weight"),
        (r"blocks\.(\d+)\.attn\.([qkvo]_proj)\.weight", r"layers.\1.attn.\2.weight"),
        (r"blocks\.(\d+)\.ffn\.(gate|up|down)_proj\.weight", r"layers.\1.mlp.\2_proj.weight")], source)
    return config, table


def make_divisible(v: float, divisor: int, min_value: int | None = None) -> int:
    """OpenELM's rounding of a width to a multiple of divisor (never more than 10% below v)."""
    min_value = divisor if min_value is None else min_value
    new_v = max(min_value, int(v + divisor / 2) // divisor * divisor)
    return new_v + divisor if new_v < 0.9 * v else new_v


def openelm_widths(raw: dict, source: str) -> tuple[list[int], list[int], list[int]]:
    """Per-layer query heads, key/value heads and FFN widths, derived exactly as OpenELM's reference config does."""
    layers, model_dim = int(need(raw, "num_transformer_layers", source)), int(need(raw, "model_dim", source))
    head_dim, groups = int(need(raw, "head_dim", source)), int(raw.get("num_gqa_groups", 1))

    def multipliers(value, name):
        if isinstance(value, (int, float)):
            return [value] * layers
        if len(value) == 2:  # layer-wise scaling: linspace from first to last layer, rounded to 2 decimals
            return [round(float(v), 2) for v in np.linspace(value[0], value[1], num=layers, dtype=float)]
        if name == "ffn_multipliers" and len(value) == layers:
            return list(value)
        raise CheckpointError(f"{source}: {name} needs 1, 2 or (ffn only) {layers} entries, got {len(value)}")

    q_dims = [int(make_divisible(model_dim * m, head_dim * groups))
              for m in multipliers(raw.get("qkv_multipliers", 1.0), "qkv_multipliers")]
    q_heads = [q // head_dim for q in q_dims]
    kv_heads = [h // groups for h in q_heads]
    ffn = [int(make_divisible(m * model_dim, int(raw.get("ffn_dim_divisor", 256))))
           for m in multipliers(raw.get("ffn_multipliers", 4.0), "ffn_multipliers")]
    return q_heads, kv_heads, ffn


def openelm(folder: str, raw: dict, source: str):
    """OpenELM: per-layer widths, fused qkv [q heads, k heads, v heads], q/k RMSNorm with one shared [D] gain,
    proj_1 = [gate, up], eps 1e-6, shared input/output embedding."""
    if not raw.get("ffn_with_glu", True) or raw.get("activation_fn_name", "swish") not in ("swish", "silu"):
        raise CheckpointError(f"{source}: only the GLU feed-forward with swish activation is supported")
    if raw.get("normalization_layer_name", "rms_norm") != "rms_norm":
        raise CheckpointError(f"{source}: only normalization_layer_name 'rms_norm' is supported")
    q_heads, kv_heads, ffn = openelm_widths(raw, source)
    D, tied = int(raw["head_dim"]), bool(raw.get("share_input_output_layers", False))
    config = make_config(
        source, vocab_size=int(need(raw, "vocab_size", source)), hidden_size=int(raw["model_dim"]),
        num_hidden_layers=len(q_heads), num_attention_heads=q_heads, num_key_value_heads=kv_heads, head_dim=D,
        intermediate_size=ffn, max_position_embeddings=int(raw.get("max_context_length", 2048)),
        rope_theta=float(raw.get("rope_freq_constant", 10000)), norm_eps=1e-6,
        qk_norm="shared" if raw.get("normalize_qk_projections", False) else "none", tie_word_embeddings=tied)
    table = rename(hf_weights(folder), [
        (r"transformer\.token_embeddings\.weight", "embed_tokens.weight"),
        (r"transformer\.norm\.weight", "norm.weight"), (r"lm_head\.weight", None if tied else "lm_head.weight"),
        (r"transformer\.layers\.(\d+)\.(attn_norm)\.weight", r"layers.\1.\2.weight"),
        (r"transformer\.layers\.(\d+)\.ffn_norm\.weight", r"layers.\1.mlp_norm.weight"),
        (r"transformer\.layers\.(\d+)\.attn\.(q_norm|k_norm)\.weight", r"layers.\1.attn.\2.weight"),
        (r"transformer\.layers\.(\d+)\.attn\.qkv_proj\.weight", r"layers.\1.attn.qkv.weight"),
        (r"transformer\.layers\.(\d+)\.attn\.out_proj\.weight", r"layers.\1.attn.o_proj.weight"),
        (r"transformer\.layers\.(\d+)\.ffn\.proj_1\.weight", r"layers.\1.mlp.proj_1.weight"),
        (r"transformer\.layers\.(\d+)\.ffn\.proj_2\.weight", r"layers.\1.mlp.down_proj.weight")], source)
    for i, (h, kv, w) in enumerate(zip(q_heads, kv_heads, ffn)):
        a = f"layers.{i}.attn."
        split_rows(table, a + "qkv.weight", {a + "q_proj.weight": (0, h * D),
                                             a + "k_proj.weight": (h * D, (h + kv) * D),
                                             a + "v_proj.weight": ((h + kv) * D, (h + 2 * kv) * D)})
        m = f"layers.{i}.mlp."
        split_rows(table, m + "proj_1.weight", {m + "gate_proj.weight": (0, w), m + "up_proj.weight": (w, 2 * w)})
    return config, table


def neox_config(source: str, hidden: int, heads: int, layers: int, vocab: int, ffn: int, rotary_pct: float,
                base: float, context: int, eps: float, parallel: bool, tied: bool) -> DenseConfig:
    head_dim = hidden // heads
    return make_config(
        source, vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
        head_dim=head_dim, intermediate_size=ffn, max_position_embeddings=context, rope_theta=base,
        rotary_dim=int(head_dim * rotary_pct), norm="layernorm", norm_eps=eps, mlp="gelu", bias=True,
        parallel_residual=parallel, tie_word_embeddings=tied)


def split_neox_qkv(table: dict, config: DenseConfig) -> None:
    """query_key_value rows are [head, (q, k, v), head_dim]: split them per head."""
    H, D = config.num_attention_heads, config.head_dim
    for i in range(config.num_hidden_layers):
        a = f"layers.{i}.attn."
        for kind in ("weight", "bias"):
            split_rows(table, a + f"qkv.{kind}", {a + f"{p}_proj.{kind}": j for j, p in enumerate("qkv")},
                       view=(H, 3, D))


NEOX_RULES = [
    (r"(?:gpt_neox\.)?embed_in\.weight", "embed_tokens.weight"), (r"embed_out\.weight", "lm_head.weight"),
    (r"(?:gpt_neox\.)?final_layer_norm\.(weight|bias)", r"norm.\1"),
    (r"(?:gpt_neox\.)?layers\.(\d+)\.input_layernorm\.(weight|bias)", r"layers.\1.attn_norm.\2"),
    (r"(?:gpt_neox\.)?layers\.(\d+)\.post_attention_layernorm\.(weight|bias)", r"layers.\1.mlp_norm.\2"),
    (r"(?:gpt_neox\.)?layers\.(\d+)\.attention\.query_key_value\.(weight|bias)", r"layers.\1.attn.qkv.\2"),
    (r"(?:gpt_neox\.)?layers\.(\d+)\.attention\.dense\.(weight|bias)", r"layers.\1.attn.o_proj.\2"),
    (r"(?:gpt_neox\.)?layers\.(\d+)\.mlp\.dense_h_to_4h\.(weight|bias)", r"layers.\1.mlp.up_proj.\2"),
    (r"(?:gpt_neox\.)?layers\.(\d+)\.mlp\.dense_4h_to_h\.(weight|bias)", r"layers.\1.mlp.down_proj.\2")]


def gpt_neox(folder: str, raw: dict, source: str):
    """GPT-NeoX, Hugging Face layout: LayerNorm with bias, per-head fused qkv, partial rotary, parallel residual,
    exact GELU."""
    if raw.get("hidden_act", "gelu") != "gelu":
        raise CheckpointError(f"{source}: hidden_act {raw['hidden_act']!r} is not supported (only exact 'gelu')")
    rope = raw.get("rope_parameters") or {}
    rotary_pct = rope.get("partial_rotary_factor", raw.get("rotary_pct", raw.get("partial_rotary_factor", 0.25)))
    base = rope.get("rope_theta", raw.get("rotary_emb_base", raw.get("rope_theta", 10000)))
    tied = bool(raw.get("tie_word_embeddings", False))
    hidden = int(need(raw, "hidden_size", source))
    config = neox_config(source, hidden, int(need(raw, "num_attention_heads", source)),
                         int(need(raw, "num_hidden_layers", source)), int(need(raw, "vocab_size", source)),
                         int(raw.get("intermediate_size", 4 * hidden)), float(rotary_pct), float(base),
                         int(raw.get("max_position_embeddings", 2048)), float(raw.get("layer_norm_eps", 1e-5)),
                         bool(raw.get("use_parallel_residual", True)), tied)
    rules = [(p, None if tied and t == "lm_head.weight" else t) for p, t in NEOX_RULES]
    table = rename(hf_weights(folder), rules, source)
    split_neox_qkv(table, config)
    return config, table


# -- Hugging Face Llama and its descendants ---------------------------------------------------------------------
# One reader for every family laid out as Llama is (model.layers.N.self_attn.q_proj, ...); each difference is read
# where it applies. A config key that no rule reads and that is not known to leave the math alone is refused, so a
# model is never loaded with part of its math missing.

# Keys that describe a release, its training or its generation defaults, never the forward pass.
HARMLESS_KEYS = {
    "architectures", "model_type", "transformers_version", "torch_dtype", "dtype", "_name_or_path", "auto_map",
    "bos_token_id", "eos_token_id", "pad_token_id", "sep_token_id", "eod_token_id", "decoder_start_token_id",
    "initializer_range",
    "use_cache", "attention_dropout", "hidden_dropout", "embd_pdrop", "resid_pdrop", "classifier_dropout",
    "pretraining_tp", "output_attentions", "output_hidden_states", "return_dict", "use_return_dict", "torchscript",
    "tie_encoder_decoder", "is_encoder_decoder", "is_decoder", "add_cross_attention", "chunk_size_feed_forward",
    "finetuning_task", "id2label", "label2id", "problem_type", "tokenizer_class", "prefix", "task_specific_params",
    "max_length", "min_length", "do_sample", "early_stopping", "num_beams", "num_beam_groups", "diversity_penalty",
    "temperature", "top_k", "top_p", "typical_p", "repetition_penalty", "length_penalty", "no_repeat_ngram_size",
    "encoder_no_repeat_ngram_size", "bad_words_ids", "num_return_sequences", "output_scores",
    "return_dict_in_generate", "forced_bos_token_id", "forced_eos_token_id", "remove_invalid_values",
    "exponential_decay_length_penalty", "suppress_tokens", "begin_suppress_tokens", "pruned_heads",
    "cross_attention_hidden_size", "use_bfloat16", "tf_legacy_loss", "_attn_implementation_autoset",
    "cache_implementation", "residual_dropout", "unsloth_version", "unsloth_fixed", "quantization_config_null",
    "attn_implementation"}
# Mixtures of experts and other designs this dense engine does not run.
MOE_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size")
@dataclass(frozen=True)
class Family:
    """What a model type fixes beyond its config file: the defaults transformers uses for absent keys, the switches
    that are always on, and where sliding windows go. One row serves a Hugging Face folder (its model_type) and a GGUF
    file (its llama.cpp architecture, `gguf`)."""
    eps: float = 1e-6  # the norm eps when the config has none
    tied: bool = False  # tie_word_embeddings when absent
    theta: float = 1e4  # rope_theta when absent
    head_dim: int | None = None  # head_dim when absent (None: hidden / heads); derived: always hidden / heads
    derived_head_dim: bool = False
    rotary_fraction: float = 1.0  # partial_rotary_factor when absent
    gguf: str | None = None  # llama.cpp's architecture name
    gemma: bool = False  # (1 + w) norms, sqrt(hidden) embeddings, tanh-GELU gates
    qk_norm: str = "none"
    qkv_bias: bool = False
    pre_norms: bool = True
    post_norms: bool = False
    norm_gain_in_float32: bool = False
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
    multipliers: bool = False  # Granite's embedding, attention, residual and logits multipliers
    layer_thetas: bool = False  # layer_rope_theta: a rope base per layer, 0 for none; learned attention sinks
    #                             (Granite SWA)
    stablelm: bool = False  # layer norms, per-head q/k layer norms, parallel blocks, qkv biases by flag
    llama4_scale: bool = False  # rope_parameters' llama_4_scaling_beta scales queries past the original context
    cohere: bool = False  # layer norms without bias, one before both branches in parallel, logits times logit_scale,
    #                       rotary pairs interleaved (Command R7B / A)
    attention_bias_is_qkv: bool = False  # attention_bias (true when absent) is q/k/v's, attention_out_bias the
    #                                      output's (Seed-OSS, GLM-4)
    norm_after_rope: bool = False  # the q/k norms after the rotary (Hunyuan)
    mlp: str = "swiglu"  # "xielu": down(xielu(up(x))), its parameters learned per layer (Apertus)
    glm: bool = False  # rotary pairs interleaved; post_self_attn_layernorm and post_mlp_layernorm after the branches,
    #                    post_attention_layernorm before the MLP (GLM-4)


FAMILIES = {
    "llama": Family(gguf="llama"),
    "mistral": Family(windows="given"),
    "qwen2": Family(gguf="qwen2", qkv_bias=True, windows="flag"),
    "qwen3": Family(gguf="qwen3", head_dim=128, qk_norm="shared", windows="flag"),
    "gemma": Family(gguf="gemma", tied=True, head_dim=256, gemma=True),
    "gemma2": Family(gguf="gemma2", tied=True, head_dim=256, gemma=True, post_norms=True, windows="pattern",
                     window_pattern=2, softcaps=True, query_scalar=True),
    "gemma3_text": Family(gguf="gemma3", tied=True, theta=1e6, head_dim=256, gemma=True, qk_norm="shared",
                          post_norms=True, windows="pattern", window_pattern=6, query_scalar=True, local_rope=True,
                          local_theta=1e4),
    "phi3": Family(gguf="phi3", eps=1e-5, derived_head_dim=True, windows="given"),
    "smollm3": Family(gguf="smollm3", tied=True, theta=2e6, windows="flag", nope=True),
    "granite": Family(gguf="granite", multipliers=True),
    "granite_swa": Family(gguf="granite_swa", multipliers=True, windows="given", window=128, layer_thetas=True,
                          window_pattern=4),  # (a GGUF file gives its pattern: attention.sliding_window_pattern)
    "olmo2": Family(eps=1e-5, qk_norm="whole", pre_norms=False, post_norms=True, norm_gain_in_float32=True),
    "olmo3": Family(gguf="olmo2", eps=1e-5, theta=5e5, qk_norm="whole", pre_norms=False, post_norms=True,
                    norm_gain_in_float32=True, windows="pattern", window_pattern=4, window=4096, local_rope=True),
    "stablelm": Family(gguf="stablelm", eps=1e-5, derived_head_dim=True, rotary_fraction=0.25, stablelm=True),
    "seed_oss": Family(gguf="seed_oss", head_dim=128, attention_bias_is_qkv=True),
    "glm4": Family(gguf="glm4", eps=1.5625e-7, head_dim=128, rotary_fraction=0.5, attention_bias_is_qkv=True,
                   post_norms=True, glm=True),
    "cohere": Family(gguf="command-r", eps=1e-5, theta=5e5, tied=True, cohere=True, windows="none"),
    "cohere2": Family(gguf="cohere2", eps=1e-5, tied=True, cohere=True, windows="pattern", window_pattern=4,
                      window=4096, nope_full=True),
    "ministral3": Family(gguf="mistral3", theta=1e6, head_dim=128, windows="given", llama4_scale=True),
    "apertus": Family(gguf="apertus", eps=1e-5, theta=12e6, qk_norm="shared", mlp="xielu"),
    "apertus1p5_text": Family(eps=1e-5, theta=12e6, qk_norm="shared", mlp="xielu"),  # (its head may be pruned)
    "hunyuan_v1_dense": Family(gguf="hunyuan-dense", eps=1e-5, qk_norm="shared", norm_after_rope=True),
    "exaone4": Family(gguf="exaone4", eps=1e-5, qk_norm="shared", pre_norms=False, post_norms=True,
                      windows="pattern", window_pattern=4, window=4096, nope_full=True),
}
BY_GGUF = {family.gguf: (kind, family) for kind, family in FAMILIES.items() if family.gguf}


class ConfigReader:
    """A config.json's values, remembering which keys were read, so that the rest can be refused."""

    def __init__(self, raw: dict, source: str) -> None:
        self.raw, self.source, self.read = raw, source, set()

    def get(self, key: str, default=None):
        self.read.add(key)
        value = self.raw.get(key)
        return default if value is None else value

    def need(self, key: str):
        if self.raw.get(key) is None:
            raise CheckpointError(f"{self.source}: missing config field {key!r}")
        return self.get(key)

    def refuse(self, key: str, why: str):
        raise CheckpointError(f"{self.source}: {key} {self.raw.get(key)!r} is not supported ({why})")

    def check_unread(self) -> None:
        for key, value in self.raw.items():  # (a key set to null or false turns a feature off)
            if key not in self.read and key not in HARMLESS_KEYS and not key.startswith("_") and value not in (
                    None, False):
                raise CheckpointError(f"{self.source}: config key {key!r} is not supported (it may change the "
                                      "model's math, and this engine does not read it)")


def hf_rope(cfg: ConfigReader, default_theta: float, head_dim: int,
            default_fraction: float = 1.0) -> tuple[float, dict | None, int, float | None]:
    """(base, scaling, rotary channels, local base) from either form transformers reads: the Hub's rope_theta /
    rope_scaling / partial_rotary_factor / rope_local_base_freq, or transformers 5's rope_parameters (flat, or by
    layer type: Gemma 3's sliding_attention / full_attention)."""
    params = cfg.get("rope_parameters") or {}
    local = None
    if "full_attention" in params or "sliding_attention" in params:
        local = (params.get("sliding_attention") or {}).get("rope_theta", 1e4)
        if (params.get("sliding_attention") or {}).get("rope_type", "default") != "default":
            raise CheckpointError(f"{cfg.source}: rope_parameters.sliding_attention: only default rope is supported")
        params = params.get("full_attention") or {}
    elif cfg.get("rope_local_base_freq") is not None:
        local = cfg.get("rope_local_base_freq")
    scaling = dict(cfg.get("rope_scaling") or {})
    params = {**params, **scaling}
    theta = float(params.pop("rope_theta", cfg.get("rope_theta", default_theta)))
    fraction = float(params.pop("partial_rotary_factor", cfg.get("partial_rotary_factor", default_fraction)))
    kind = params.pop("rope_type", params.pop("type", "default"))
    kind = {"su": "longrope"}.get(kind, kind)
    if kind == "dynamic" and params.get("alpha"):  # Hunyuan's NTK alpha: a fixed stretch of the base, as transformers
        theta *= float(params.pop("alpha")) ** (head_dim / (head_dim - 2))
        kind = "default"
    if kind == "yarn" and cfg.raw.get("model_type") == "phi3":
        kind = "longrope"  # transformers reads Phi-3's legacy "yarn" as longrope
    cfg.get("original_max_position_embeddings")  # read where a scaling uses it; without one it changes nothing
    if kind == "default":
        params = None
    else:
        params = {"rope_type": kind, **params}
        if kind in ("llama3", "yarn", "longrope"):
            params["original_max_position_embeddings"] = int(
                cfg.get("original_max_position_embeddings") or params.get("original_max_position_embeddings") or
                cfg.need("max_position_embeddings"))
    if local is not None:
        local = float(local)
    return theta, params, int(head_dim * fraction), local


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
    for key in ("rope_parameters", "rope_scaling") if family.llama4_scale else ():
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
    act = cfg.get("hidden_activation") or cfg.get("hidden_act", "gelu_pytorch_tanh" if family.gemma else "silu")
    if family.gemma:
        if act not in ("gelu_pytorch_tanh", "gelu") or (act == "gelu" and kind != "gemma"):
            cfg.refuse("hidden_activation", "Gemma's MLP is gelu_pytorch_tanh")
    elif act != family.mlp and (family.mlp == "xielu" or act not in ("silu", "swish")):
        cfg.refuse("hidden_act", f"only {'xielu' if family.mlp == 'xielu' else 'silu'} for this family")
    if family.cohere and cfg.get("use_qk_norm"):
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
    if attn_bias != mlp_bias:
        cfg.refuse("attention_bias" if attn_bias else "mlp_bias", "biases on attention or MLP alone")
    if cfg.get("use_bidirectional_attention"):
        cfg.refuse("use_bidirectional_attention", "a decoder attends causally")
    scalar = cfg.get("query_pre_attn_scalar") if family.query_scalar else None
    granite = {key: float(cfg.get(key, 1.0)) for key in ("embedding_multiplier", "residual_multiplier",
                                                         "logits_scaling")} if family.multipliers else {}
    stablelm, layer_norms = family.stablelm, family.stablelm or family.cohere
    config = make_config(
        source, vocab_size=int(cfg.need("vocab_size")), hidden_size=hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=int(cfg.get("num_key_value_heads", heads)), head_dim=head_dim,
        intermediate_size=int(cfg.need("intermediate_size")), max_position_embeddings=context, rope_theta=theta,
        rotary_dim=rotary, rope_layout="interleaved" if family.glm or family.cohere else "half",
        rope_scaling=scaling, rope_local_theta=local_theta, nope_layers=nope,
        attn_scale=float(cfg.get("attention_multiplier")) if family.multipliers else (
            float(scalar) ** -0.5 if scalar else None),
        attn_softcap=cfg.get("attn_logit_softcapping") if family.softcaps else None,
        sliding_window=window, layer_types=types,
        qkv_bias=qkv_bias or (stablelm and bool(cfg.get("use_qkv_bias"))),
        norm="layernorm" if layer_norms else "rmsnorm",
        norm_eps=float(cfg.get("layer_norm_eps" if layer_norms else "rms_norm_eps", family.eps)),
        norm_gain_in_float32=family.norm_gain_in_float32, norm_unit_offset=family.gemma,
        qk_norm="per_channel" if stablelm and cfg.get("qk_layernorm") else family.qk_norm,
        qk_norm_after_rope=family.norm_after_rope,
        mlp="geglu" if family.gemma else family.mlp, bias=attn_bias,
        parallel_residual=family.cohere or stablelm and bool(cfg.get("use_parallel_residual")),
        pre_norms=family.pre_norms, post_norms=family.post_norms,
        residual_scale=granite.get("residual_multiplier", 1.0),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", family.tied)),
        embed_scale=hidden ** 0.5 if family.gemma else granite.get("embedding_multiplier"),
        logits_divisor=(1 / float(cfg.get("logit_scale", 0.0625)) if family.cohere
                        else granite.get("logits_scaling", 1.0)),
        final_softcap=cfg.get("final_logit_softcapping") if family.softcaps else None,
        output_vocab_size=cfg.get("output_vocab_size"), attn_sinks=family.layer_thetas)
    for key in ("max_window_layers", "use_sliding_window"):
        cfg.get(key)  # read above where they apply; without a window they change nothing
    cfg.check_unread()
    return config, hf_decoder_tensors(folder, family, config, source, prefix)


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


def hf_decoder_tensors(folder: str, family: Family, config: DenseConfig, source: str, prefix: str = "model.") -> dict:
    """{native name: thunk} of a Llama-layout folder. Where the families' names differ: Gemma 2/3's
    post_attention_layernorm is the attention's post-norm (Llama's is the MLP's pre-norm), OLMo 2 has post-norms
    only, Phi-3 fuses q|k|v and gate|up, StableLM keeps one layer norm per head for q and k."""
    after_attention = "attn_post_norm" if family.post_norms and not family.glm else "mlp_norm"
    weights = hf_weights(folder)
    headless = prefix == "model." and not any(name.startswith("model.") for name in weights)
    if headless:  # the decoder alone, its tensors at the top (an embedding model's: Qwen3-Embedding)
        prefix = ""
    top = re.escape(prefix)
    layer = top + r"layers\.(\d+)\."
    rules = [
        (top + r"embed_tokens\.weight", "embed_tokens.weight"), (top + r"norm\.(weight|bias)", r"norm.\1"),
        (r"lm_head\.weight", None if config.tie_word_embeddings else "lm_head.weight"),
        (layer + r"(?:input|attention)_layernorm\.(weight|bias)", r"layers.\1.attn_norm.\2"),
        (layer + r"feedforward_layernorm\.weight", r"layers.\1.mlp_norm.weight"),  # (Apertus)
        (layer + r"mlp\.act_fn\.(alpha_p|alpha_n|beta|eps)", r"layers.\1.mlp.act.\2"),
        (layer + r"post_attention_layernorm\.(weight|bias)", rf"layers.\1.{after_attention}.\2"),
        (layer + r"pre_feedforward_layernorm\.weight", r"layers.\1.mlp_norm.weight"),
        (layer + r"post_feedforward_layernorm\.weight", r"layers.\1.mlp_post_norm.weight"),
        (layer + r"post_self_attn_layernorm\.weight", r"layers.\1.attn_post_norm.weight"),  # (GLM-4)
        (layer + r"post_mlp_layernorm\.weight", r"layers.\1.mlp_post_norm.weight"),
        (layer + r"self_attn\.([qkvo]_proj)\.(weight|bias)", r"layers.\1.attn.\2.\3"),
        (layer + r"self_attn\.([qk])_norm\.weight", r"layers.\1.attn.\2_norm.weight"),
        (layer + r"self_attn\.query_layernorm\.weight", r"layers.\1.attn.q_norm.weight"),  # (Hunyuan's names)
        (layer + r"self_attn\.key_layernorm\.weight", r"layers.\1.attn.k_norm.weight"),
        (layer + r"self_attn\.([qk])_layernorm\.norms\.(\d+)\.weight", r"layers.\1.attn.\2_norm.head\3"),
        (layer + r"self_attn\.qkv_proj\.weight", r"layers.\1.attn.qkv.weight"),
        (layer + r"self_attn\.sinks", r"layers.\1.attn.sinks"),  # (Granite SWA)
        (layer + r"mlp\.gate_up_proj\.weight", r"layers.\1.mlp.gate_up.weight"),
        (layer + r"mlp\.(gate|up|down)_proj\.(weight|bias)", r"layers.\1.mlp.\2_proj.\3")]
    if prefix != "model.":  # a wrapper's image model: not read (its reader says so); its head beside the text model
        rules += [(r"(?:model\.)?(vision_tower|multi_modal_projector|vision_tokenizer|audio_tokenizer)\..*", None),
                  (r"language_model\.lm_head\.weight", None if config.tie_word_embeddings else "lm_head.weight")]
    table = rename(weights, rules, source)
    if headless and "lm_head.weight" not in table and not config.tie_word_embeddings:
        table["lm_head.weight"] = table["embed_tokens.weight"]  # (no head to read: an embedding model uses none)
    H, K, D, W = config.num_attention_heads, config.num_key_value_heads, config.head_dim, config.intermediate_size
    for i in range(config.num_hidden_layers):
        a, m = f"layers.{i}.attn.", f"layers.{i}.mlp."
        if a + "qkv.weight" in table:  # Phi-3: rows are q | k | v
            split_rows(table, a + "qkv.weight", {a + "q_proj.weight": (0, H * D), a + "k_proj.weight": (
                H * D, (H + K) * D), a + "v_proj.weight": ((H + K) * D, (H + 2 * K) * D)})
        if m + "gate_up.weight" in table:  # Phi-3: rows are gate | up
            split_rows(table, m + "gate_up.weight", {m + "gate_proj.weight": (0, W), m + "up_proj.weight": (W, 2 * W)})
        for part, count in (("q", H), ("k", K)):  # StableLM: one [D] gain per head, stacked into [heads * D]
            heads = [table.pop(f"{a}{part}_norm.head{h}", None) for h in range(count)]
            if any(heads):
                if not all(heads):
                    raise CheckpointError(f"{source}: layer {i} lacks some of its per-head {part} norms")
                table[f"{a}{part}_norm.weight"] = lambda heads=heads: torch.cat([read() for read in heads])
        if family.cohere:  # layer norms without bias: a bias of zeros adds nothing
            table[f"layers.{i}.attn_norm.bias"] = table["norm.bias"] = lambda C=config.hidden_size: torch.zeros(C)
        if config.parallel_residual and f"layers.{i}.attn_norm.weight" in table:  # one norm, both branches
            for p in ("weight", "bias"):
                table[f"layers.{i}.mlp_norm.{p}"] = table[f"layers.{i}.attn_norm.{p}"]
    return table


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


def refuse_moe(raw: dict, source: str) -> None:
    """Mixtures of experts are not dense models: one line, before anything is read. Granite 4.0 H's dense releases
    keep the experts' keys with num_local_experts 0: no expert is used, the model is dense."""
    if raw.get("model_type") == "granitemoehybrid" and not raw.get("num_local_experts"):
        return
    if raw.get("model_type") == "nemotron_h":  # (its config keeps experts' keys whatever its blocks are: read those)
        blocks = raw.get("layers_block_type") or raw.get("layer_types") or list(raw.get("hybrid_override_pattern", ""))
        if "moe" in blocks or "E" in blocks:
            raise CheckpointError(f"{source}: model_type 'nemotron_h' with moe blocks is a mixture of experts; this "
                                  "engine runs dense models only")
        return
    key = next((k for k in MOE_KEYS if raw.get(k)), None)
    kind = raw.get("model_type", "")
    if key or "moe" in str(kind) or kind in ("mixtral", "dbrx", "deepseek_v2", "deepseek_v3", "jamba"):
        raise CheckpointError(f"{source}: model_type {kind!r}{f' ({key})' if key else ''} is a mixture of experts; "
                              "this engine runs dense models only")


# -- GPT-NeoX original two-way tensor-parallel release ------------------------------------------------------------

NEOX_20B = {"num_layers": 44, "hidden_size": 6144, "num_attention_heads": 64, "rotary_pct": 0.25,
            "rotary_emb_base": 10000, "max_position_embeddings": 2048, "layernorm_epsilon": 1e-5,
            "gpt_j_residual": True, "no_weight_tying": True}


def neox_yaml(folder: str) -> dict:
    """The NeoX YAML config (configs/*.yml) with '-' in keys read as '_'; GPT-NeoX-20B's sizes when absent."""
    files = sorted(glob.glob(os.path.join(folder, "configs", "*.yml")) + glob.glob(os.path.join(folder, "*.yml")))
    values = dict(NEOX_20B)
    for path in files:
        import yaml

        try:
            with open(path) as f:
                data = yaml.safe_load(f) or {}
        except yaml.YAMLError as e:
            raise CheckpointError(f"{path}: not valid YAML ({first_line(e)})") from None
        values.update({k.replace("-", "_"): v for k, v in data.items()})
    return values


def neox_original(folder: str, rank: int | None = None):
    """GPT-NeoX-20B's original release, merged as its reference merge script does: column-parallel weights/biases, the
    embedding and the readout concatenated on dim 0, row-parallel weights on dim 1, row-parallel biases summed, norms
    checked equal across the shards. Files are read a layer (two shards) at a time. rank 0 or 1 (two-way tensor
    parallel, tp.py): the blocks' tensors are that shard's own, unmerged (its row-parallel bias too: the ranks'
    all-reduce sums them as the merge would)."""
    steps = sorted(glob.glob(os.path.join(folder, "global_step*")))
    latest = os.path.join(folder, "latest")
    if os.path.isfile(latest):
        with open(latest) as f:
            steps = [os.path.join(folder, f.read().strip())]
    step = steps[-1]
    raw = neox_yaml(folder)
    layers = int(raw["num_layers"])

    @functools.lru_cache(maxsize=2)  # at most two layers' shards (memory-mapped) at a time
    def shards(layer: int):
        files = [os.path.join(step, f"layer_{layer:02d}-model_0{r}-model_states.pt") for r in (0, 1)]
        for f in files:
            if not os.path.isfile(f):
                raise CheckpointError(f"{step}: missing shard {os.path.basename(f)}")
        return load_pickle(files[0]), load_pickle(files[1])

    @functools.lru_cache(maxsize=1)
    def own(layer: int):  # this rank's shard of a layer
        return load_pickle(os.path.join(step, f"layer_{layer:02d}-model_0{rank}-model_states.pt"))

    def merged(layer: int, name: str, how: str):
        def read():
            if rank is not None and 2 <= layer < layers + 2:  # a block's tensor: this shard's own
                return own(layer)[name]
            p1, p2 = shards(layer)
            if name not in p1 or name not in p2:
                raise CheckpointError(f"{step}: layer {layer:02d} shards lack tensor {name!r}")
            a, b = p1[name], p2[name]
            if how == "same":
                if not torch.equal(a, b):
                    raise CheckpointError(f"{step}: {name!r} of layer {layer:02d} differs between the two shards")
                return a
            return a + b if how == "sum" else torch.cat((a, b), dim=0 if how == "dim0" else 1)
        return read

    def shape(layer: int, name: str):
        return shards(layer)[0][name].shape

    hidden, heads = int(raw["hidden_size"]), int(raw["num_attention_heads"])
    vocab = 2 * shape(0, "word_embeddings.weight")[0]
    ffn = 2 * shape(2, "mlp.dense_h_to_4h.weight")[0]
    tied = not raw.get("no_weight_tying", True)
    config = neox_config(step, hidden, heads, layers, vocab, ffn, float(raw["rotary_pct"]),
                         float(raw["rotary_emb_base"]),
                         int(raw.get("max_position_embeddings") or raw.get("seq_length") or 2048),
                         float(raw["layernorm_epsilon"]), bool(raw["gpt_j_residual"]), tied)
    table = {"embed_tokens.weight": merged(0, "word_embeddings.weight", "dim0")}
    parts = {"attn_norm": ("input_layernorm", "same", "same"), "mlp_norm": ("post_attention_layernorm", "same", "same"),
             "attn.qkv": ("attention.query_key_value", "dim0", "dim0"),
             "attn.o_proj": ("attention.dense", "dim1", "sum"),
             "mlp.up_proj": ("mlp.dense_h_to_4h", "dim0", "dim0"),
             "mlp.down_proj": ("mlp.dense_4h_to_h", "dim1", "sum")}
    for i in range(layers):
        for native, (theirs, weight_how, bias_how) in parts.items():
            table[f"layers.{i}.{native}.weight"] = merged(i + 2, f"{theirs}.weight", weight_how)
            table[f"layers.{i}.{native}.bias"] = merged(i + 2, f"{theirs}.bias", bias_how)
    table["norm.weight"] = merged(layers + 3, "norm.weight", "same")
    table["norm.bias"] = merged(layers + 3, "norm.bias", "same")
    if not tied:
        table["lm_head.weight"] = merged(layers + 4, "final_linear.weight", "dim0")
    split_neox_qkv(table, config if rank is None else dataclasses.replace(config, num_attention_heads=heads // 2))
    return config, table


def read_torch_file(path: str, raw: dict | None) -> Checkpoint:
    """Sprout's ckpt.pt, GermanGPT's checkpoint.pt, or a plain state dict (.pt/.safetensors) with its config."""
    if path.endswith(".safetensors"):
        state = {n: f() for n, f in open_safetensors(path).items()}
    else:
        state = load_pickle(path)
    if raw is None:
        if not isinstance(state, dict) or not isinstance(state.get("config"), dict) or "model" not in state:
            raise CheckpointError(f"{path}: expected a dict with 'model' (state dict) and 'config'")
        raw, state = state["config"], state["model"]
    elif isinstance(state, dict) and isinstance(state.get("model"), dict):
        state = state["model"]
    if "d_model" in raw:
        config, table = germangpt(raw, state, path)
    elif "dim" in raw:
        config, table = sprout(raw, state, path)
    else:
        raise CheckpointError(f"{path}: config has neither 'dim' (Sprout) nor 'd_model' (GermanGPT)")
    return Checkpoint(path, config, table)


# ----------------------------------------------------------------------------------------------------------------
# Families whose layers keep a state (dense.py section 4)


def state_config(cfg: ConfigReader, layers: int, **values) -> DenseConfig:
    """The config keys Qwen3.5 and LFM2 share with Llama's layout, read, and the family's own values."""
    hidden, heads = int(cfg.need("hidden_size")), int(cfg.need("num_attention_heads"))
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    theta, scaling, rotary, _ = hf_rope(cfg, 1e4, head_dim)
    if scaling is not None:
        cfg.refuse("rope_parameters", "only default rope for this family")
    if cfg.get("hidden_act", "silu") not in ("silu", "swish"):
        cfg.refuse("hidden_act", "only silu for this family")
    if cfg.get("attention_bias", False):
        cfg.refuse("attention_bias", "this family has no biases")
    return make_config(cfg.source, vocab_size=int(cfg.need("vocab_size")), hidden_size=hidden,
                       num_hidden_layers=layers, num_attention_heads=heads,
                       num_key_value_heads=int(cfg.get("num_key_value_heads", heads)), head_dim=head_dim,
                       max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)), rope_theta=theta,
                       rotary_dim=rotary, **{"qk_norm": "shared", **values})


def qwen3_5(folder: str, raw: dict, source: str):
    """Qwen3.5 / 3.6: qwen3_5_text, or qwen3_5 (the Hub's image-text folder: the text model under
    model.language_model, the vision tower skipped with a note). Three Gated DeltaNet layers to one full-attention
    layer, whose q_proj also yields an output gate (per head: D query rows, then D gate rows), with q/k norms and a
    quarter of each head rotated (mrope: text alone has one position in all its sections, so plain rope); (1 + w)
    norms."""
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
             (prefix + r"embed_tokens\.weight", "embed_tokens.weight"), (prefix + r"norm\.weight", "norm.weight"),
             (r"lm_head\.weight", None if config.tie_word_embeddings else "lm_head.weight")]
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


def olmo_hybrid(folder: str, raw: dict, source: str):
    """OLMo hybrid: Gated DeltaNet layers (q, k, v, the gate g, a and b each their own projection; beta times 2 where
    linear_allow_neg_eigval, so the delta rule's eigenvalues may go negative; an output norm of eps 1e-5, FLA's)
    with Llama's pre-norms, between full-attention layers as OLMo 3's: post-norms only, q/k norms over the whole
    projection, rope. The Hub's names too: attention_layer_norm and feedforward_layer_norm for input_layernorm and
    post_attention_layernorm, the conv in q, k and v pieces."""
    cfg = ConfigReader(raw, source)
    layers = int(cfg.need("num_hidden_layers"))
    types = cfg.get("layer_types") or ["full_attention" if i % 4 == 3 else "linear_attention" for i in range(layers)]
    heads = int(cfg.need("num_attention_heads"))
    keys, values = int(cfg.get("linear_num_key_heads") or heads), int(cfg.get("linear_num_value_heads") or heads)
    k_dim = int(cfg.get("linear_key_head_dim") or 0.75 * int(cfg.need("hidden_size")) / keys)
    v_dim = int(cfg.get("linear_value_head_dim") or 2 * k_dim)
    if keys != values:
        cfg.refuse("linear_num_value_heads", "OLMo hybrid's delta rule takes as many value heads as key heads")
    for key in ("linear_a_log_min", "linear_a_log_max", "linear_dt_min", "linear_dt_max", "linear_dt_init_floor"):
        cfg.get(key)  # (initialization only)
    attention = [kind == "full_attention" for kind in types]
    config = state_config(
        cfg, layers, intermediate_size=int(cfg.need("intermediate_size")), layer_types=types,
        linear_heads=(keys, values), linear_head_dims=(k_dim, v_dim),
        conv_kernel=int(cfg.get("linear_conv_kernel_dim", 4)),
        linear_beta_scale=2.0 if cfg.get("linear_allow_neg_eigval", True) else 1.0, linear_norm_eps=1e-5,
        norm_eps=float(cfg.get("rms_norm_eps", 1e-6)), qk_norm="whole", pre_norms=[not a for a in attention],
        post_norms=attention, tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)))
    cfg.check_unread()
    layer = r"model\.layers\.(\d+)\."
    rules = [(r"model\.embed_tokens\.weight", "embed_tokens.weight"), (r"model\.norm\.weight", "norm.weight"),
             (r"lm_head\.weight", None if config.tie_word_embeddings else "lm_head.weight"),
             (layer + r"(?:input_layernorm|attention_layer_norm)\.weight", r"layers.\1.attn_norm.weight"),
             (layer + r"(?:post_attention_layernorm|feedforward_layer_norm)\.weight",
              r"layers.\1.post_attention_layernorm"),
             (layer + r"post_feedforward_layernorm\.weight", r"layers.\1.mlp_post_norm.weight"),
             (layer + r"self_attn\.([qkvo]_proj|[qk]_norm)\.weight", r"layers.\1.attn.\2.weight"),
             (layer + r"linear_attn\.([qkv])_proj\.weight", r"layers.\1.attn.\2"),
             (layer + r"linear_attn\.([qkv])_conv1d\.weight", r"layers.\1.attn.\2_conv"),
             (layer + r"linear_attn\.g_proj\.weight", r"layers.\1.attn.in_proj_z.weight"),
             (layer + r"linear_attn\.([ab])_proj\.weight", r"layers.\1.attn.in_proj_\2.weight"),
             (layer + r"linear_attn\.o_proj\.weight", r"layers.\1.attn.out_proj.weight"),
             (layer + r"linear_attn\.o_norm\.weight", r"layers.\1.attn.norm.weight"),
             (layer + r"linear_attn\.conv1d\.weight", r"layers.\1.attn.conv_weight"),
             (layer + r"linear_attn\.(A_log|dt_bias)", r"layers.\1.attn.\2"),
             (layer + r"mlp\.(gate|up|down)_proj\.weight", r"layers.\1.mlp.\2_proj.weight")]
    table = rename(hf_weights(folder), rules, source)
    for i, is_attention in enumerate(attention):  # (the attention's post-norm; a delta layer's MLP pre-norm)
        norm = table.pop(f"layers.{i}.post_attention_layernorm")
        table[f"layers.{i}.attn_post_norm.weight" if is_attention else f"layers.{i}.mlp_norm.weight"] = norm
        if not is_attention:  # q | k | v: the conv's channels in that order (saved in three pieces, or one)
            q, k, v = (table.pop(f"layers.{i}.attn.{p}") for p in "qkv")
            table[f"layers.{i}.attn.in_proj_qkv.weight"] = lambda q=q, k=k, v=v: torch.cat([q(), k(), v()])
            if f"layers.{i}.attn.q_conv" in table:
                q, k, v = (table.pop(f"layers.{i}.attn.{p}_conv") for p in "qkv")
                table[f"layers.{i}.attn.conv_weight"] = lambda q=q, k=k, v=v: torch.cat([q(), k(), v()])
    return config, table


def lfm2(folder: str, raw: dict, source: str):
    """LFM2 (Liquid AI): gated short convs between attention layers (q/k norms, no output gate), a SwiGLU whose width
    the config may adjust (block_auto_adjust_ff_dim), the final norm named embedding_norm."""
    cfg = ConfigReader(raw, source)
    layers = int(cfg.need("num_hidden_layers"))
    full = cfg.get("full_attn_idxs")
    types = cfg.get("layer_types") or ["full_attention" if full is None or i in full else "conv"
                                       for i in range(layers)]
    width = int(cfg.get("block_ff_dim") or cfg.need("intermediate_size"))
    multiplier, multiple = cfg.get("block_ffn_dim_multiplier"), int(cfg.get("block_multiple_of", 256))
    if cfg.get("block_auto_adjust_ff_dim", True):  # (transformers' rule, rounded as it rounds; else the width given)
        width = int(2 * width / 3)
        if multiplier is not None:
            width = multiple * ((int(float(multiplier) * width) + multiple - 1) // multiple)
    if cfg.get("conv_bias", False):
        cfg.refuse("conv_bias", "LFM2 releases have no conv biases")
    config = state_config(cfg, layers, intermediate_size=width, layer_types=types,
                          conv_kernel=int(cfg.get("conv_L_cache", 3)), norm_eps=float(cfg.get("norm_eps", 1e-5)),
                          tie_word_embeddings=bool(cfg.get("tie_word_embeddings", cfg.get("tie_embedding", True))))
    cfg.check_unread()
    return config, rename(hf_weights(folder), liquid_rules(config) + [
        (LIQUID_LAYER + r"self_attn\.([qkv]_proj)\.weight", r"layers.\1.attn.\2.weight"),
        (LIQUID_LAYER + r"self_attn\.out_proj\.weight", r"layers.\1.attn.o_proj.weight"),
        (LIQUID_LAYER + r"self_attn\.([qk])_layernorm\.weight", r"layers.\1.attn.\2_norm.weight")], source)


LIQUID_LAYER = r"model\.layers\.(\d+)\."


def liquid_rules(config: DenseConfig) -> list:
    """The names LFM2 and LFM3 share: embedding_norm the final norm, operator_norm and ffn_norm the branches'
    pre-norms, conv.* the short conv, feed_forward.w1 / w3 / w2 the SwiGLU's gate, up and down."""
    layer = LIQUID_LAYER
    return [(r"model\.embed_tokens\.weight", "embed_tokens.weight"), (r"model\.embedding_norm\.weight", "norm.weight"),
            (r"lm_head\.weight", None if config.tie_word_embeddings else "lm_head.weight"),
            (layer + r"operator_norm\.weight", r"layers.\1.attn_norm.weight"),
            (layer + r"ffn_norm\.weight", r"layers.\1.mlp_norm.weight"),
            (layer + r"conv\.(in_proj|out_proj)\.weight", r"layers.\1.attn.\2.weight"),
            (layer + r"conv\.conv\.weight", r"layers.\1.attn.conv_weight"),
            (layer + r"feed_forward\.w1\.weight", r"layers.\1.mlp.gate_proj.weight"),
            (layer + r"feed_forward\.w3\.weight", r"layers.\1.mlp.up_proj.weight"),
            (layer + r"feed_forward\.w2\.weight", r"layers.\1.mlp.down_proj.weight")]


def lfm3(folder: str, raw: dict, source: str):
    """LFM3: LFM2's short convs between sliding and full attention layers (Qwen3's q/k norms per head; a sigmoid gate
    per head from the layer's input, use_attention_gate), norms before and after each branch (use_sandwich_norm),
    default rope on the sliding layers and proportional rope on the full ones (as Gemma 4's)."""
    cfg = ConfigReader(raw, source)
    layers = int(cfg.need("num_hidden_layers"))
    types = cfg.get("layer_types") or ["full_attention" if i % 4 == 2 else "sliding_attention" if i % 4 == 0 and i
                                       else "conv" for i in range(layers)]
    if cfg.get("conv_bias", False):
        cfg.refuse("conv_bias", "a conv bias is not supported")
    rope = cfg.get("rope_parameters") or {}
    global_rope, local_rope = dict(rope.get("full_attention") or {}), dict(rope.get("sliding_attention") or {})
    if local_rope.pop("rope_type", "default") != "default" or set(local_rope) - {"rope_theta"} or global_rope.get(
            "rope_type", "default") not in ("default", "proportional") or set(global_rope) - {
            "rope_type", "rope_theta", "partial_rotary_factor"}:
        cfg.refuse("rope_parameters", "default rope on the sliding layers, proportional or default on the full ones")
    hidden, heads = int(cfg.need("hidden_size")), int(cfg.need("num_attention_heads"))
    proportional = global_rope.get("rope_type") == "proportional"
    config = make_config(
        source, vocab_size=int(cfg.need("vocab_size")), hidden_size=hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=int(cfg.get("num_key_value_heads", heads)),
        head_dim=int(cfg.get("head_dim") or hidden // heads), intermediate_size=int(cfg.need("intermediate_size")),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 128000)), layer_types=types,
        rope_theta=float(global_rope.get("rope_theta", 1e6)), rope_local_theta=float(local_rope.get("rope_theta", 1e4)),
        rope_scaling={"rope_type": "proportional", "partial_rotary_factor": float(global_rope.get(
            "partial_rotary_factor", 1.0))} if proportional else None,
        sliding_window=int(cfg.get("sliding_window", 256)), conv_kernel=int(cfg.get("conv_L_cache", 7)),
        qk_norm="shared", attn_head_gate=bool(cfg.get("use_attention_gate", True)),
        post_norms=bool(cfg.get("use_sandwich_norm", True)), norm_eps=float(cfg.get("norm_eps", 1e-5)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)))
    if cfg.get("attention_bias", False):
        cfg.refuse("attention_bias", "LFM3 has no biases")
    cfg.check_unread()
    return config, rename(hf_weights(folder), liquid_rules(config) + [
        (LIQUID_LAYER + r"post_operator_norm\.weight", r"layers.\1.attn_post_norm.weight"),
        (LIQUID_LAYER + r"post_ffn_norm\.weight", r"layers.\1.mlp_post_norm.weight"),
        (LIQUID_LAYER + r"self_attn\.([qkvo]_proj|[qk]_norm|gate_proj)\.weight", r"layers.\1.attn.\2.weight"),
        (LIQUID_LAYER + r"self_attn\.g_proj\.weight", r"layers.\1.attn.gate_proj.weight")], source)


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


def granite_hybrid(folder: str, raw: dict, source: str):
    """Granite 4.0 H (granitemoehybrid without experts: num_local_experts 0): Mamba2 layers with a few attention
    layers between them, Granite's multipliers (embedding, residual, attention scale, logits divisor), no position
    embedding unless position_embedding_type is "rope", the MLP's gate|up rows fused in input_linear."""
    cfg = ConfigReader(raw, source)
    if int(cfg.get("num_local_experts", 0) or 0):
        cfg.refuse("num_local_experts", "a mixture of experts; this engine runs dense models only")
    for key in ("num_experts_per_tok", "router_aux_loss_coef", "intermediate_size", "mamba_chunk_size"):
        cfg.get(key)  # (the experts' settings, with no experts; the chunk a prompt is scanned in: the same sums)
    hidden, heads = int(cfg.need("hidden_size")), int(cfg.need("num_attention_heads"))
    layers = int(cfg.need("num_hidden_layers"))
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
    if cfg.get("hidden_act", "silu") not in ("silu", "swish"):
        cfg.refuse("hidden_act", "only silu for this family")
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
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)))
    cfg.check_unread()
    layer = r"model\.layers\.(\d+)\."
    rules = [(r"model\.embed_tokens\.weight", "embed_tokens.weight"), (r"model\.norm\.weight", "norm.weight"),
             (r"lm_head\.weight", None if config.tie_word_embeddings else "lm_head.weight"),
             (layer + r"input_layernorm\.weight", r"layers.\1.attn_norm.weight"),
             (layer + r"post_attention_layernorm\.weight", r"layers.\1.mlp_norm.weight"),
             (layer + r"self_attn\.([qkvo]_proj)\.(weight|bias)", r"layers.\1.attn.\2.\3"),
             *mamba_rules(layer, "attn."),
             (layer + r"shared_mlp\.input_linear\.weight", r"layers.\1.mlp.gate_up.weight"),
             (layer + r"shared_mlp\.output_linear\.weight", r"layers.\1.mlp.down_proj.weight")]
    table = rename(hf_weights(folder), rules, source)
    W = config.intermediate_size
    for i in range(layers):  # rows: gate | up
        m = f"layers.{i}.mlp."
        split_rows(table, m + "gate_up.weight", {m + "gate_proj.weight": (0, W), m + "up_proj.weight": (W, 2 * W)})
    return config, table


def falcon_h1(folder: str, raw: dict, source: str):
    """Falcon-H1: in every layer attention and Mamba2 read the same normed input, their outputs summed (dense.Hybrid),
    then a SwiGLU MLP. Its muP multipliers are folded into the weights they scale, as llama.cpp's converter folds
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
    if cfg.get("hidden_act", "silu") not in ("silu", "swish"):
        cfg.refuse("hidden_act", "only silu for this family")
    rms_norm, before_gate = bool(cfg.get("mamba_rms_norm", False)), bool(cfg.get("mamba_norm_before_gate", True))
    if rms_norm and before_gate:
        cfg.refuse("mamba_norm_before_gate", "with mamba_rms_norm, only the norm after the silu(z) gate (false), as "
                                             "llama.cpp runs it")
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    theta, scaling, rotary, _ = hf_rope(cfg, 1e4, head_dim)
    if scaling is not None:
        cfg.refuse("rope_parameters", "only default rope for this family")
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
    rules = [(r"model\.embed_tokens\.weight", "embed_tokens.weight"),
             (r"model\.final_layernorm\.weight", "norm.weight"),
             (r"lm_head\.weight", None if config.tie_word_embeddings else "lm_head.weight"),
             (layer + r"input_layernorm\.weight", r"layers.\1.attn_norm.weight"),
             (layer + r"pre_ff_layernorm\.weight", r"layers.\1.mlp_norm.weight"),
             (layer + r"self_attn\.([qkvo]_proj)\.weight", r"layers.\1.attn.attention.\2.weight"),
             *mamba_rules(layer, "attn.mamba."),
             (layer + r"feed_forward\.(gate|up|down)_proj\.weight", r"layers.\1.mlp.\2_proj.weight")]
    table = rename(hf_weights(folder), rules, source)
    widths = [inner, inner, m_groups * m_state, m_groups * m_state, m_heads]  # in_proj's rows: z, x, B, C, dt
    rows = torch.cat([torch.full((w,), v) for w, v in zip(widths, ssm)]) * m["ssm_in_multiplier"]
    scales = {"attention.q_proj": m["attention_in_multiplier"], "attention.v_proj": m["attention_in_multiplier"],
              "attention.k_proj": m["attention_in_multiplier"] * m["key_multiplier"],
              "attention.o_proj": m["attention_out_multiplier"], "mamba.out_proj": m["ssm_out_multiplier"],
              "mamba.in_proj": rows[:, None]}
    for i in range(layers):
        for name, scale in [*((f"layers.{i}.attn.{n}.weight", v) for n, v in scales.items()),
                            (f"layers.{i}.mlp.gate_proj.weight", gate_m), (f"layers.{i}.mlp.down_proj.weight", down_m)]:
            if name in table:
                table[name] = lambda read=table[name], scale=scale: read().float() * scale
    return config, table


def nemotron_h(folder: str, raw: dict, source: str):
    """Nemotron-H / Nemotron Nano 2: a pattern of blocks, each a norm and one of Mamba2 (M), attention without rope (*)
    or a squared-ReLU MLP (-), its output added to the residual. A mixing block and the MLP block after it are one
    layer here (an FFN width of 0 where none follows); an MLP block after another is refused."""
    cfg = ConfigReader(raw, source)
    names = {"M": "mamba", "*": "attention", "-": "mlp", "mamba": "mamba", "linear_attention": "mamba",
             "attention": "attention", "full_attention": "attention", "mlp": "mlp"}
    given = cfg.get("layers_block_type") or cfg.get("layer_types") or list(cfg.get("hybrid_override_pattern", ""))
    if not given or not set(given) <= set(names) or int(cfg.get("num_hidden_layers", len(given))) != len(given):
        cfg.refuse("layers_block_type", "mamba, attention and mlp blocks, num_hidden_layers of them")
    kinds, widths = [], []
    for block in (names[b] for b in given):
        if block == "mlp" and (not kinds or widths[-1]):
            cfg.refuse("layers_block_type", "an mlp block after each mamba or attention block at most")
        if block == "mlp":
            widths[-1] = int(cfg.need("intermediate_size"))
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
        norm_gain_in_float32=True, tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)))
    cfg.check_unread()
    layer_of, layer = [], -1  # our layer of each block: a mixing block starts one
    for block in given:
        layer += names[block] != "mlp"
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
        kind = "mlp" if names[given[block]] == "mlp" else "mixer"
        table[f"layer{layer_of[block]}.{kind}.{rest}"] = thunk
    rules = [(r"(?:model|backbone)\.embeddings\.weight", "embed_tokens.weight"),
             (r"(?:model|backbone)\.norm_f\.weight", "norm.weight"),
             (r"lm_head\.weight", None if config.tie_word_embeddings else "lm_head.weight"),
             (r"layer(\d+)\.mixer\.norm\.weight", r"layers.\1.attn_norm.weight"),
             (r"layer(\d+)\.mlp\.norm\.weight", r"layers.\1.mlp_norm.weight"),
             (r"layer(\d+)\.mixer\.mixer\.([qkvo]_proj)\.weight", r"layers.\1.attn.\2.weight"),
             (r"layer(\d+)\.mixer\.mixer\.(in_proj|out_proj)\.(weight|bias)", r"layers.\1.attn.\2.\3"),
             (r"layer(\d+)\.mixer\.mixer\.conv1d\.(weight|bias)", r"layers.\1.attn.conv_\2"),
             (r"layer(\d+)\.mixer\.mixer\.(A_log|D|dt_bias|norm\.weight)", r"layers.\1.attn.\2"),
             (r"layer(\d+)\.mlp\.mixer\.(up_proj|down_proj)\.weight", r"layers.\1.mlp.\2.weight")]
    return config, rename(table, rules, source)


def gemma4(folder: str, raw: dict, source: str):
    """Gemma 4: gemma4_text, or gemma4 (the Hub's wrapper: text_config, the text model under model.language_model,
    the vision and audio towers skipped with a note). Gemma 3's layer (post-norms, q/k norms, windows on five layers
    of six, a local rope base) with: full layers of their own head size (global_head_dim, and per_layer_config's
    key/value heads), rotated whole by proportional rope; values normed without gain, or the keys' projection
    (attention_k_eq_v); the last num_kv_shared_layers layers reading the keys and values of the last earlier layer of
    their kind (and twice as wide an MLP: use_double_wide_mlp); per-layer embeddings; a learned scalar per layer;
    plain gains in float32; attention scaled by 1. Experts are refused."""
    wrapped = raw["model_type"] == "gemma4"
    text = dict((raw.get("text_config") or {}) if wrapped else raw)
    cfg = ConfigReader(text, source)
    if cfg.get("enable_moe_block") or cfg.get("num_experts"):
        cfg.refuse("enable_moe_block", "a mixture of experts; this engine runs dense models only")
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
    for key in ("top_k_experts", "moe_intermediate_size", "final_logit_softcapping"):
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
        layer_scalars=True)
    cfg.check_unread()
    weights = hf_weights(folder)
    towers = sorted({name.split(".")[1] for name in weights if name.startswith("model.") and name.split(".")[1] in (
        "vision_tower", "audio_tower", "embed_vision", "embed_audio")})
    if towers:
        machine.note(f"{source}: {', '.join(towers)} not loaded: this engine reads text")
    top = r"model\.language_model\." if wrapped else r"model\."
    layer = top + r"layers\.(\d+)\."
    readers = "|".join(str(i) for i in range(layers) if config.kv_source(i) is not None) or "-"
    rules = [(r"model\.(vision_tower|audio_tower|embed_vision|embed_audio)\..*", None),
             (top + rf"layers\.({readers})\.self_attn\.(k_proj|v_proj|k_norm)\.weight", None),  # (unused: read)
             (top + r"embed_tokens\.weight", "embed_tokens.weight"), (top + r"norm\.weight", "norm.weight"),
             (r"lm_head\.weight", None if config.tie_word_embeddings else "lm_head.weight"),
             (top + r"embed_tokens_per_layer\.weight", "embed_per_layer.weight"),
             (top + r"per_layer_model_projection\.weight", "per_layer_projection.weight"),
             (top + r"per_layer_projection_norm\.weight", "per_layer_norm.weight"),
             (layer + r"input_layernorm\.weight", r"layers.\1.attn_norm.weight"),
             (layer + r"post_attention_layernorm\.weight", r"layers.\1.attn_post_norm.weight"),
             (layer + r"pre_feedforward_layernorm\.weight", r"layers.\1.mlp_norm.weight"),
             (layer + r"post_feedforward_layernorm\.weight", r"layers.\1.mlp_post_norm.weight"),
             (layer + r"self_attn\.([qkvo]_proj|[qk]_norm)\.weight", r"layers.\1.attn.\2.weight"),
             (layer + r"mlp\.(gate|up|down)_proj\.weight", r"layers.\1.mlp.\2_proj.weight"),
             (layer + r"per_layer_input_gate\.weight", r"layers.\1.per_layer_gate.weight"),
             (layer + r"per_layer_projection\.weight", r"layers.\1.per_layer_proj.weight"),
             (layer + r"post_per_layer_input_norm\.weight", r"layers.\1.per_layer_norm.weight"),
             (layer + r"layer_scalar", r"layers.\1.layer_scalar")]
    return config, rename(weights, rules, source)


# Hugging Face folders by config.json's model_type: (folder, raw config, config path) -> (DenseConfig, table)
HF_FAMILIES = {"openelm": openelm, "gpt_neox": gpt_neox, "qwen3_5": qwen3_5, "qwen3_5_text": qwen3_5, "lfm2": lfm2,
               "mistral3": image_text, "apertus1p5": image_text, "olmo_hybrid": olmo_hybrid, "lfm3": lfm3,
               "gemma4": gemma4, "gemma4_text": gemma4, "granitemoehybrid": granite_hybrid,
               "nemotron_h": nemotron_h, "falcon_h1": falcon_h1,
               **{kind: hf_decoder for kind in FAMILIES}}
