"""common.py: what every family's readers repeat. A Hugging Face folder: its tensors (hf_weights) mapped to native
names by rules (rename, split_rows, head_rule), its config read key by key and every key no rule read refused
(ConfigReader, HARMLESS_KEYS), mixtures of experts refused before anything is read (refuse_moe), its rope (hf_rope).
A GGUF file: the per-layer tensors' native names (LAYER_TENSORS) and its rope scaling (gguf_rope_scaling), read from
its Metadata (gguf_import.py).
"""

from __future__ import annotations

import os
import re

import dense
from dense_engine.formats import lora, prequantized
from dense_engine.formats.checkpoint import eager, load_pickle, open_safetensors, read_json
from dense_engine.formats.gguf_import import Metadata, dequantized
from dense_engine.system.errors import CheckpointError

# Non-parameter buffers that older exports carry; recognised and skipped.
SKIPPED_BUFFERS = re.compile(r".*\.(rotary_emb\.inv_freq|attention\.bias|attention\.masked_bias|attn\.bias|"
                             r"attn\.masked_bias)$")


def hf_weights(folder: str) -> dict:
    """{name: thunk} over a Hugging Face folder's tensors; a quantized folder's linears dequantized (prequantized.py),
    the LoRA adapters of this load merged (lora.py)."""
    return lora.merged(prequantized.dequantized_weights(stored_weights(folder), folder), folder, lora.folder_names)


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


def head_rule(tied: bool, pattern: str = r"lm_head\.weight") -> tuple[str, str | None]:
    """The rule for the output head's tensor: lm_head.weight, or read past where the head is the embedding (tied)."""
    return pattern, None if tied else "lm_head.weight"


def model_rules(tied: bool, top: str = r"model\.", norm: str = "norm") -> list:
    """The rules for the tensors outside the layers, named as Llama's are (under top): the embedding, the final norm
    (norm: its name) and the head."""
    return [(top + r"embed_tokens\.weight", "embed_tokens.weight"), (top + norm + r"\.weight", "norm.weight"),
            head_rule(tied)]


def split_rows(table: dict, name: str, parts: dict, *, view: tuple[int, ...] | None = None) -> None:
    """Replace the fused tensor table[name] by slices. parts maps native name -> (first row, end row); or, with
    view, rows are reshaped to view (e.g. [heads, 3, head_dim]) and parts maps native name -> index in dim 1."""
    fused = table.pop(name)

    def piece(where):
        def read():
            t = fused()
            if view is None:
                return t[where[0]:where[1]]
            return t.reshape(view + tuple(t.shape[1:]))[:, where].flatten(0, 1)
        return read

    for target, where in parts.items():
        table[target] = piece(where)


def split_qkv(table: dict, a: str, heads: int, kv_heads: int, head_dim: int) -> None:
    """a + "qkv.weight" (rows q | k | v: heads, kv_heads and kv_heads heads of head_dim) as a + "q_proj.weight", ..."""
    H, K, D = heads, kv_heads, head_dim
    split_rows(table, a + "qkv.weight", {a + "q_proj.weight": (0, H * D), a + "k_proj.weight": (H * D, (H + K) * D),
                                         a + "v_proj.weight": ((H + K) * D, (H + 2 * K) * D)})


def split_gate_up(table: dict, m: str, width: int) -> None:
    """m + "gate_up.weight" (rows gate | up, width each) as m + "gate_proj.weight" and m + "up_proj.weight"."""
    split_rows(table, m + "gate_up.weight", {m + "gate_proj.weight": (0, width),
                                             m + "up_proj.weight": (width, 2 * width)})


def need(raw: dict, key: str, source: str):
    if key not in raw:
        raise CheckpointError(f"{source}: missing config field {key!r}")
    return raw[key]


# ----------------------------------------------------------------------------------------------------------------
# Hugging Face configs: a config key that no rule reads and that is not known to leave the math alone is refused, so
# a model is never loaded with part of its math missing.

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
EXPERTS_READ = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "glm4_moe", "gpt_oss",  # (experts.py)
                "granitemoehybrid", "nemotron_h", "lfm2_moe")
EXPERTS_READ += ("qwen3_5_moe", "qwen3_5_moe_text", "qwen3_next")  # (qwen3_5.py)
EXPERTS_READ += ("gemma4", "gemma4_text")  # (gemma4.py: enable_moe_block)
LATENT_ATTENTION = ("deepseek_v2", "deepseek_v3", "kimi_k2", "kimi_linear")


def refuse_moe(raw: dict, source: str) -> None:
    """Mixtures of experts are not dense models: one line, before anything is read (those of EXPERTS_READ are read;
    Granite 4.0 H and Nemotron-H, among them, keep the experts' keys in their dense releases too)."""
    key = next((k for k in MOE_KEYS if raw.get(k)), None)
    kind = raw.get("model_type", "")
    if kind in EXPERTS_READ:
        return
    if kind in LATENT_ATTENTION or raw.get("kv_lora_rank"):
        raise CheckpointError(f"{source}: model_type {kind!r} uses multi-head latent attention (DeepSeek V2 / V3, "
                              "Kimi), which this engine does not run")
    if key or "moe" in str(kind) or kind in ("dbrx", "jamba"):
        raise CheckpointError(f"{source}: model_type {kind!r}{f' ({key})' if key else ''} is a mixture of experts "
                              f"this engine does not read yet (it reads {', '.join(EXPERTS_READ)})")


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


def plain_rope(cfg: ConfigReader, head_dim: int) -> tuple[float, int]:
    """(base, rotary channels) of a family that runs default rope alone; a scaling is refused."""
    theta, scaling, rotary, _ = hf_rope(cfg, 1e4, head_dim)
    if scaling is not None:
        cfg.refuse("rope_parameters", "only default rope for this family")
    return theta, rotary


def refuse_act(cfg: ConfigReader) -> None:
    """Only silu (swish) gates, the hybrids' MLPs."""
    if cfg.get("hidden_act", "silu") not in ("silu", "swish"):
        cfg.refuse("hidden_act", "only silu for this family")


# ----------------------------------------------------------------------------------------------------------------
# GGUF files

# Per-layer GGUF tensors (llama.cpp's names, after "blk.N." and before ".weight" / ".bias") -> native names (after
# "layers.N."); q|k|v and Phi-3's gate|up are split where they are read
LAYER_TENSORS = {"attn_norm": "mixer_norm", "ffn_norm": "mlp_norm", "post_attention_norm": "mixer_post_norm",
                 "post_ffw_norm": "mlp_post_norm", "attn_q": "mixer.q_proj", "attn_k": "mixer.k_proj",
                 "attn_v": "mixer.v_proj", "attn_output": "mixer.o_proj", "attn_q_norm": "mixer.q_norm",
                 "attn_k_norm": "mixer.k_norm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                 "ffn_down": "mlp.down_proj"}


def gguf_rope_scaling(meta: Metadata, context: int, rope_dim: int) -> dict | None:
    """Llama 3.x's rope_freqs tensor, Phi-3's LongRoPE factor tensors, or a linear rope.scaling.factor."""
    key, tensors, path, arch = meta.key, meta.tensors, meta.path, meta.arch
    kind = key("rope.scaling.type", "")
    factor = float(key("rope.scaling.factor", 0.0) or key("rope.scale_linear", 0.0))
    if "rope_freqs.weight" in tensors:
        return {"rope_type": "factors", "factors": dequantized(tensors["rope_freqs.weight"], path).tolist()}
    if "rope_factors_long.weight" in tensors:
        if "rope_factors_short.weight" not in tensors:
            raise CheckpointError(f"{path}: tensor 'rope_factors_long.weight' without 'rope_factors_short.weight'")
        return {"rope_type": "longrope", "long_factor": dequantized(tensors["rope_factors_long.weight"], path).tolist(),
                "short_factor": dequantized(tensors["rope_factors_short.weight"], path).tolist(),
                "original_max_position_embeddings": int(key("rope.scaling.original_context_length", context)),
                "attention_factor": float(key("rope.scaling.attn_factor", 1.0))}
    if kind in ("", "linear", "none") and factor in (0.0, 1.0) or kind == "none":
        return None
    if kind in ("", "linear"):
        return {"rope_type": "linear", "factor": factor}
    if kind == "yarn":  # (Ministral 3) the cos and sin scaled as llama.cpp scales them: mscale 1 over mscale_all_dim
        if float(key("rope.scaling.yarn_ext_factor", 1.0)) != 1.0:
            raise CheckpointError(f"{path}: GGUF metadata {arch}.rope.scaling.yarn_ext_factor "
                                  f"{key('rope.scaling.yarn_ext_factor')}: only 1 (yarn's whole ramp) is supported")
        log_mul = float(key("rope.scaling.yarn_log_multiplier", 0.0))
        mscale = dense.yarn_mscale(factor) / (dense.yarn_mscale(factor, log_mul) if log_mul else 1.0)
        return {"rope_type": "yarn", "factor": factor, "beta_fast": float(key("rope.scaling.yarn_beta_fast", 32.0)),
                "beta_slow": float(key("rope.scaling.yarn_beta_slow", 1.0)),
                "original_max_position_embeddings": int(key("rope.scaling.original_context_length", context)),
                "attention_factor": mscale * float(key("rope.scaling.attn_factor", 1.0))}
    raise CheckpointError(f"{path}: GGUF metadata {arch}.rope.scaling.type {kind!r} is not supported (linear, yarn, "
                          "and the factor tensors of Llama 3 and Phi-3)")
