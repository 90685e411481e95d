"""checkpoint.py: what loading needs from any checkpoint (the Checkpoint record), and the safe file operations every
reader and writer shares: JSON, memory-mapped safetensors, weights-only pickles, atomic writes, a lock file; and the
checking of a config read from a file (make_config, config_from_dict: every error one line naming the file).
Stands on dense.py (DenseConfig), layer_kinds.py (its records) and machine.py.

A Checkpoint is a config plus {native tensor name: thunk}: a thunk reads, slices or merges tensors only when called,
so loading builds the model one tensor at a time and never holds a second copy of the weights.
"""

from __future__ import annotations

import json
import math
import os
import pickle
import re
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field, fields

import torch

import layer_kinds
from dense import DenseConfig
from dense_engine.system.errors import CheckpointError, first_line
from layer_kinds import record


@dataclass
class Checkpoint:
    """What loading needs from any checkpoint: its config, {native tensor name: thunk} of the full-precision weights
    (empty when a folder holds only quantized variants), the declared dtype, and the native config.json's own record
    (its saved quantized variants; for a checkpoint converted from a GGUF, the source tensor types). A GGUF source
    also carries, for its Q4_0/Q4_1 linears, thunks of the int4 tensors that hold its blocks exactly, and where each
    2-D tensor of a block type with a kernel (quantized.GGUF_TYPES) lies in the file, to be kept as stored."""
    path: str
    config: DenseConfig
    tensors: dict[str, Callable[[], torch.Tensor]]
    dtype: torch.dtype | None = None
    record: dict = field(default_factory=dict)
    source_types: dict[str, str] = field(default_factory=dict)  # native weight name -> GGUF tensor type
    # block linear name -> its stored tensors in the mode that holds them exactly: int4 (a GGUF's Q4_0 / Q4_1 blocks,
    # GPTQ, AWQ) or fp8 (FP8 folders); scheme.mode names it for a folder that came quantized
    exact: dict[str, Callable[[], dict]] = field(default_factory=dict)
    blocks: dict = field(default_factory=dict)  # native weight name -> gguf_import.Blocks (GGUF types with kernels)
    scheme: object = None  # a folder that came quantized: its prequantized.Scheme
    adapters: tuple = ()  # the LoRA adapters (lora.Adapter) on its weights (lora.Merged thunks in tensors)
    mtp: dict = field(default_factory=dict)  # its multi-token prediction layers (Qwen3.5's mtp.*, a GGUF's nextn
    #                                          block): {name in speculative.MultiTokenPredictor: thunk}, a draft's

    @property
    def native(self) -> bool:
        return bool(self.record)


def read_json(path: str) -> dict:
    try:
        with open(path) as f:
            data = json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: file not found") from None
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read ({e.strerror})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: not valid JSON ({getattr(e, 'msg', None) or e.reason})") from None
    except RecursionError:
        raise CheckpointError(f"{path}: not valid JSON (nested too deeply)") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    return data


def open_safetensors(path: str) -> dict[str, Callable[[], torch.Tensor]]:
    """{name: thunk} over a memory-mapped safetensors file; a truncated or corrupt file is a CheckpointError."""
    from safetensors import safe_open

    try:
        handle = safe_open(path, framework="pt", device="cpu")
        names = list(handle.keys())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: file not found") from None
    except Exception as e:  # noqa: BLE001 (safetensors raises its own error types for bad headers and short files)
        raise CheckpointError(f"{path}: not a readable safetensors file ({first_line(e)})") from None

    def reader(name: str):
        def read() -> torch.Tensor:
            try:
                return handle.get_tensor(name)
            except Exception as e:  # noqa: BLE001 (safetensors' own error types: said as a CheckpointError)
                raise CheckpointError(f"{path}: cannot read tensor {name!r} ({first_line(e)})") from None
        return read

    return {name: reader(name) for name in names}


# Native folders written before a layer's mixer was named `mixer` name it `attn` (whatever it mixes with)
LEGACY_NAME = re.compile(r"(layers\.\d+\.)attn(?=\.|_norm\.|_post_norm\.)")


def current_names(tensors: dict) -> dict:
    """A native folder's (or saved variant's) {name: thunk}, its older names (layers.N.attn.*, attn_norm,
    attn_post_norm) read as today's (layers.N.mixer.*, mixer_norm, mixer_post_norm)."""
    return {LEGACY_NAME.sub(r"\1mixer", name): read for name, read in tensors.items()}


def load_pickle(path: str) -> dict:
    """torch.load with weights_only=True: tensors and plain containers only; a pickle that would run code is refused."""
    try:
        try:
            return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as e:
            if "mmap" not in str(e):  # legacy (non-zip) files cannot be memory-mapped
                raise
            return torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: file not found") from None
    except pickle.UnpicklingError as e:
        detail = (str(e).split("Unsupported")[-1].strip().splitlines() or ["unsafe"])[0] if "Unsupported" in str(e) \
            else "unsafe"
        raise CheckpointError(f"{path}: refused to unpickle: it holds something other than tensors and plain "
                              f"containers (weights_only=True; {detail})") from None
    except Exception as e:  # noqa: BLE001 (whatever unpickling raises: said as a CheckpointError)
        raise CheckpointError(f"{path}: not a readable PyTorch checkpoint ({first_line(e)})") from None


def eager(tensors: dict[str, torch.Tensor]) -> dict:
    return {name: (lambda t=t: t) for name, t in tensors.items()}


def atomic_write(path: str, write) -> None:
    """write(tmp_path) then rename over path: a reader never sees a half-written file."""
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-", suffix=os.path.basename(path))
    os.close(fd)
    try:
        write(tmp)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp creates 0600; give the file the permissions a plain open() would
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def write_text(path: str, text: str, encoding: str | None = None) -> None:
    """The file at path holding text, closed on return (an atomic_write writer: lambda p: write_text(p, text))."""
    with open(path, "w", encoding=encoding) as f:
        f.write(text)


class locked:
    """An exclusive lock on `path` + ".lock" (fcntl.flock; released when the process dies) for read-modify-write
    steps that other processes may run at the same time: converting the default model, recording a variant."""

    def __init__(self, path: str) -> None:
        self.path = path + ".lock"

    def __enter__(self):
        import fcntl

        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        self.handle = open(self.path, "a")
        fcntl.flock(self.handle, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc) -> None:
        self.handle.close()  # closing releases the lock


def torch_dtype(name) -> torch.dtype | None:
    table = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
    return table.get(str(name).removeprefix("torch.")) if name else None


# ----------------------------------------------------------------------------------------------------------------
# Configs read from files: checked before anything is built

# The rotary scalings (rope_scaling["rope_type"]) and the keys each reads, the required ones first (a count); a key
# not listed here is refused, so a scaling is never half applied. What each computes: dense.py's rope_frequencies
# and layer_kinds.py's family_frequencies.
ROPE_SCALINGS = {
    "linear": (1, ("factor",)),
    "dynamic": (1, ("factor",)),
    "llama3": (4, ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")),
    "yarn": (2, ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale", "mscale_all_dim",
                 "attention_factor", "truncate")),
    "longrope": (3, ("short_factor", "long_factor", "original_max_position_embeddings", "factor", "attention_factor")),
    "factors": (1, ("factors",)),
    "proportional": (1, ("partial_rotary_factor", "factor")),
}
# The native format is the ShellElastic release's (the model this project began with): its config.json
# leaves out what its own defaults say, and those differ from DenseConfig's Llama defaults.
NATIVE_DEFAULTS = {"vocab_size": 50432, "hidden_size": 384, "intermediate_size": 1536, "num_hidden_layers": 32,
                   "num_attention_heads": 6, "head_dim": 64, "max_position_embeddings": 2048,
                   "rope_precision": "bfloat16", "qk_norm": "per_channel", "attn_output_gate": True}
# Keys of a native config.json that describe the release, not the model; all other unknown keys are errors.
RELEASE_KEYS = ("method", "tier", "paper_table", "architectures", "model_type", "torch_dtype", "transformers_version",
                "_name_or_path", "bos_token_id", "eos_token_id", "pad_token_id", "quantization", "source_format",
                "source_tensor_types")
ALIASES = {"rms_norm_eps": "norm_eps"}  # the ShellElastic release's name for the eps
MAX_SIZE = 1 << 24  # no width, count or context of a real model comes near this; a bigger one is a broken config
# The families' fields by their flat names (the readers' keywords, and the keys of native config.json files written
# before the records): the record of layer_kinds.RECORDS and its field. conv_kernel goes to each state layer's record.
FLAT_NAMES = {
    "rope_precision": ("rotary", "precision"), "rope_local_theta": ("rotary", "local_theta"),
    "nope_layers": ("rotary", "nope_layers"), "attn_softcap": ("attention", "softcap"),
    "attn_sinks": ("attention", "sinks"), "attn_head_gate": ("attention", "head_gate"),
    "qk_norm_after_rope": ("attention", "norm_after_rope"), "global_head_dim": ("attention", "full_head_dim"),
    "value_norm": ("attention", "value_norm"), "keys_are_values": ("attention", "keys_are_values"),
    "kv_shared_layers": ("attention", "shared_layers"), "residual_scale": ("layer", "residual_scale"),
    "per_layer_input": ("layer", "per_layer_input"), "layer_scalars": ("layer", "layer_scalars"),
    "logits_divisor": ("head", "divisor"), "final_softcap": ("head", "softcap"), "output_vocab_size": ("head", "rows"),
    "linear_heads": ("gated_deltanet", "heads"), "linear_head_dims": ("gated_deltanet", "head_dims"),
    "linear_tiled_values": ("gated_deltanet", "tiled_values"), "linear_beta_scale": ("gated_deltanet", "beta_scale"),
    "linear_norm_eps": ("gated_deltanet", "norm_eps"), "mamba_heads": ("mamba2", "heads"),
    "mamba_biases": ("mamba2", "biases"), "mamba_norm": ("mamba2", "norm"),
    "time_step_limit": ("mamba2", "time_step_limit"), "conv_kernel": (None, "conv_kernel"),
}


def config_from_dict(values: dict, source: str = "config") -> DenseConfig:
    """A native config.json's values (absent keys: the native format's defaults) as a checked DenseConfig."""
    known = {f.name for f in fields(DenseConfig)} | set(FLAT_NAMES)
    kwargs = dict(NATIVE_DEFAULTS)
    if "extras" in values:  # (written with the records: the rotary's precision is in them)
        kwargs.pop("rope_precision")
    for key, value in values.items():
        key = ALIASES.get(key, key)
        if key in known:
            kwargs[key] = value
        elif key not in RELEASE_KEYS:
            raise CheckpointError(f"{source}: unknown config key {key!r}")
    return make_config(source, **kwargs)


def as_field(default, value):
    """A value read from JSON in its field's type: a list where the field holds a tuple, as a tuple."""
    return tuple(value) if isinstance(default, tuple) and isinstance(value, list) else value


def records(source: str, values: dict) -> dict:
    """The config's extras (layer_kinds.RECORDS by name) from values' "extras" (records, or a config.json's dicts)
    and its flat names (FLAT_NAMES, popped from values). A record whose fields are all its defaults is left out,
    but a state layer's record is always there when layer_types has its layers."""
    extras = {}
    for name, value in (values.pop("extras", None) or {}).items():
        if name not in layer_kinds.RECORDS:
            raise CheckpointError(f"{source}: unknown config extras {name!r}")
        extras[name] = vars(value) if isinstance(value, layer_kinds.RECORDS[name]) else dict(value)
    states = {layer_kinds.STATE_LAYERS[t] for t in values.get("layer_types") or () if t in layer_kinds.STATE_LAYERS}
    flat: dict[str, dict] = {name: {} for name in states}
    for key in [k for k in values if k in FLAT_NAMES]:
        owner, field_name = FLAT_NAMES[key]
        value = values.pop(key)
        for name in [owner] if owner else states:
            flat.setdefault(name, {})[field_name] = value
    made = {}
    for name in {**extras, **flat}:
        cls = layer_kinds.RECORDS[name]
        given = {**extras.get(name, {}), **flat.get(name, {})}  # (flat names win: replaced())
        defaults = {f.name: f.default for f in fields(cls)}
        unknown = sorted(set(given) - set(defaults))
        if unknown:
            raise CheckpointError(f"{source}: config extras {name!r} has no field {unknown[0]!r}")
        given = {k: as_field(defaults[k], v) for k, v in given.items()}
        if name in states or any(v != defaults[k] for k, v in given.items()):
            made[name] = cls(**given)
    return made


def replaced(config: DenseConfig, source: str = "config", **values) -> DenseConfig:
    """config with values changed (the families' fields by their flat names too), checked."""
    return make_config(source, **{**{f.name: getattr(config, f.name) for f in fields(config)}, **values})


def make_config(source: str = "config", **values) -> DenseConfig:
    """A DenseConfig from values read from a file, checked: an error names the file. The families' fields may come
    by their flat names (FLAT_NAMES) or as records in `extras`."""
    values = dict(values)
    extras = records(source, values)
    try:
        config = DenseConfig(**values, extras=extras)
    except TypeError as e:
        raise CheckpointError(f"{source}: {e}") from None
    check_config(config, source)
    return config


def check_config(config: DenseConfig, source: str = "config") -> None:
    """Refuse a config the model cannot be built from, or would build wrongly, in one line."""
    def bad(msg: str):
        raise CheckpointError(f"{source}: {msg}")

    rotary, attention, head, layer = (record(config, name) for name in ("rotary", "attention", "head", "layer"))
    flat = {"rope_precision": rotary.precision, "rope_local_theta": rotary.local_theta,
            "attn_softcap": attention.softcap, "residual_scale": layer.residual_scale, "logits_divisor": head.divisor,
            "final_softcap": head.softcap}

    def value_of(name: str):  # (a family's field by its flat name, as the errors name it)
        return flat[name] if name in flat else getattr(config, name)

    choices = {"rope_precision": ("bfloat16", "float32"), "rope_layout": ("half", "interleaved"),
               "norm": ("rmsnorm", "layernorm"), "qk_norm": ("none", "per_channel", "shared", "whole"),
               "mlp": ("swiglu", "geglu", "gelu", "xielu", "relu2")}
    for name, allowed in choices.items():
        if value_of(name) not in allowed:
            bad(f"{name} must be one of {', '.join(allowed)}, got {value_of(name)!r}")
    for name in ("vocab_size", "hidden_size", "num_hidden_layers", "head_dim", "max_position_embeddings"):
        value = getattr(config, name)
        if not isinstance(value, int) or isinstance(value, bool) or not 0 < value <= MAX_SIZE:
            bad(f"{name} must be an integer in 1..{MAX_SIZE}, got {value!r}")
    rows = head.rows
    if rows is not None and (not isinstance(rows, int) or isinstance(rows, bool) or not 0 < rows <= config.vocab_size):
        bad(f"output_vocab_size must be an integer in 1..vocab_size ({config.vocab_size}), got {rows!r}")
    if rows is not None and rows < config.vocab_size and config.tie_word_embeddings:
        bad(f"output_vocab_size {rows} with tie_word_embeddings: a pruned head is its own tensor")
    for name in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
        value = getattr(config, name)
        values = value if isinstance(value, (list, tuple)) else [value]
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in values if v is not None):
            bad(f"{name} must be an integer or a list of integers, got {value!r}")
        if isinstance(value, (list, tuple)) and len(value) != config.num_hidden_layers:
            bad(f"{name} has {len(value)} entries, expected num_hidden_layers={config.num_hidden_layers}")
    positive = ("norm_eps", "rope_theta", "rope_local_theta", "attn_scale", "attn_softcap", "residual_scale",
                "embed_scale", "logits_divisor", "final_softcap")
    for name in positive:
        value = value_of(name)
        if value is None and name not in ("norm_eps", "rope_theta", "residual_scale", "logits_divisor"):
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
            bad(f"{name} must be a positive number, got {value!r}")
    for layer in range(config.num_hidden_layers):
        heads, kv, width = config.heads(layer), config.kv_heads(layer), config.ffn_width(layer)
        if not (0 < heads <= MAX_SIZE and 0 < kv <= MAX_SIZE and 0 <= width <= MAX_SIZE):
            bad(f"layer {layer}: heads ({heads}) and key/value heads ({kv}) must be in 1..{MAX_SIZE}, the FFN width "
                f"({width}) in 0..{MAX_SIZE} (0: no MLP)")
        if heads % kv:
            bad(f"layer {layer}: {heads} query heads do not divide into {kv} key/value heads")
    rope_dim, head_dim = layer_kinds.rope_dim(config), attention.full_head_dim or config.head_dim
    if not isinstance(rope_dim, int) or not 0 < rope_dim <= head_dim or rope_dim % 2:
        bad(f"rotary dimension {rope_dim} must be even and in 1..head_dim={head_dim}")
    if config.sliding_window is not None and (not isinstance(config.sliding_window, int) or config.sliding_window < 1):
        bad(f"sliding_window must be a whole number >= 1, got {config.sliding_window!r}")
    if config.layer_types is not None:
        kinds = ("full_attention", "sliding_attention", "linear_attention", "conv", "mamba", "hybrid")
        if len(config.layer_types) != config.num_hidden_layers or not set(config.layer_types) <= set(kinds):
            bad(f"layer_types must list {config.num_hidden_layers} of {' / '.join(map(repr, kinds))}")
        if "linear_attention" in config.layer_types:
            delta = config.extras["gated_deltanet"]
            (k_heads, v_heads), dims = delta.heads, delta.head_dims
            if (not all(isinstance(n, int) and 0 < n <= MAX_SIZE for n in (k_heads, v_heads, *dims))
                    or v_heads % k_heads):
                bad(f"linear_heads {delta.heads} and linear_head_dims {delta.head_dims} must be "
                    "positive, the value heads a multiple of the key heads")
        if {"mamba", "hybrid"} & set(config.layer_types):
            mamba_heads = config.extras["mamba2"].heads
            heads, _, groups, _ = mamba_heads
            if not all(isinstance(n, int) and 0 < n <= MAX_SIZE for n in mamba_heads) or heads % groups:
                bad(f"mamba_heads {mamba_heads} (heads, channels per head, groups, state size) must be "
                    "positive, the heads a multiple of the groups")
        for name in {layer_kinds.STATE_LAYERS[t] for t in config.layer_types if t in layer_kinds.STATE_LAYERS}:
            kernel = config.extras[name].conv_kernel
            if not isinstance(kernel, int) or not 1 < kernel <= 64:
                bad(f"conv_kernel must be a whole number in 2..64, got {kernel!r}")
        if "sliding_attention" in config.layer_types and config.sliding_window is None:
            bad("layer_types has sliding_attention layers but no sliding_window is set")
    if rotary.nope_layers is not None and not all(isinstance(i, int) and 0 <= i < config.num_hidden_layers
                                                  for i in rotary.nope_layers):
        bad(f"nope_layers must list layer indices in 0..{config.num_hidden_layers - 1}")
    for name in ("pre_norms", "post_norms"):
        value = getattr(config, name)
        if isinstance(value, (list, tuple)) and len(value) != config.num_hidden_layers:
            bad(f"{name} has {len(value)} entries, expected num_hidden_layers={config.num_hidden_layers}")
    if config.parallel_residual and (config.post_norms or not config.pre_norms):
        bad("parallel_residual has no post-norm form")
    if config.attn_output_gate and attention.head_gate:
        bad("attn_output_gate and attn_head_gate: one gate or the other")
    if config.qkv_bias and config.attn_output_gate:
        bad("qkv_bias with attn_output_gate is not a known layout")
    if config.rope_scaling is not None:
        kind = config.rope_scaling.get("rope_type") if isinstance(config.rope_scaling, dict) else None
        if kind not in ROPE_SCALINGS:
            bad(f"rope_scaling type {kind!r} is not implemented (implemented: {', '.join(ROPE_SCALINGS)})")
        required, known = ROPE_SCALINGS[kind]
        extra = sorted(set(config.rope_scaling) - {"rope_type", *known})
        if extra:
            bad(f"rope_scaling {kind!r}: key {extra[0]!r} is not implemented")
        missing = [key for key in known[:required] if config.rope_scaling.get(key) is None]
        if missing:
            bad(f"rope_scaling {kind!r} needs {missing[0]!r}")
        for key in [k for k in ("short_factor", "long_factor", "factors") if k in config.rope_scaling]:
            if len(config.rope_scaling[key]) != rope_dim // 2:
                bad(f"rope_scaling {key} has {len(config.rope_scaling[key])} entries, expected rotary dimension / 2"
                    f" = {rope_dim // 2}")
