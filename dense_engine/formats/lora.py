"""lora.py: LoRA adapters (PEFT folders: adapter_config.json + adapter_model.safetensors) on a Hugging Face folder's
weights: W + scale * (alpha / r) * B @ A for each target linear (alpha / sqrt(r) with use_rslora; rank_pattern and
alpha_pattern per module). `read_checkpoint(path, lora_adapters)` reads the adapters and families.hf_weights wraps each
target weight's thunk in a Merged (PENDING: the adapters of the checkpoint being read), before the family maps the
names, so every family's own changes (fused, split, folded) apply to the merged weight: a full-precision load merges
them. A quantized load keeps the base as stored (Merged.base) and adds the adapters as an unmerged low-rank term
(LowRank, attach), where the family kept the weight as it is. What an adapter would change
that is not a linear's weight (DoRA, biases, modules_to_save, embeddings), and an adapter whose tensors do not fit the
base (another model's), are refused in one line.
"""

from __future__ import annotations

import contextlib
import os
import re
from contextvars import ContextVar
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from dense_engine.formats.checkpoint import open_safetensors, read_json
from dense_engine.system.errors import CheckpointError, UsageError


@dataclass(frozen=True)
class Adapter:
    """One adapter as read: {base weight name: (A [r, in], B [out, r] thunks, its scale)} and where it came from;
    names: "peft" (Hugging Face's module names) or the GGUF architecture of a llama.cpp adapter (its tensor names)."""
    path: str
    deltas: dict = field(default_factory=dict)
    names: str = "peft"


@dataclass
class Pending:
    """The adapters of the checkpoint being read, and whether a folder's weights took them."""
    adapters: tuple[Adapter, ...] = ()
    merged: bool = False


PENDING: ContextVar[Pending] = ContextVar("pending", default=Pending())


def parse(spec: str) -> tuple[str, float]:
    """--lora's DIR[:SCALE] -> (DIR, SCALE); a suffix that is not a number is part of the path. vLLM's NAME=DIR (an
    adapter a request picks by name) is refused in one line."""
    name, equals, folder = spec.partition("=")
    if equals and name and not os.path.exists(spec) and os.path.exists(parse(folder)[0]):
        raise UsageError(f"--lora {spec}: adapters picked per request by name are not served yet; --lora "
                         f"{folder} applies the adapter to every request")
    path, _, scale = spec.rpartition(":")
    try:
        return (path, float(scale)) if path else (spec, 1.0)
    except ValueError:
        return spec, 1.0


def read_adapter(path: str, scale: float = 1.0) -> Adapter:
    """A PEFT adapter folder as an Adapter, its deltas scaled by `scale` (--lora DIR:SCALE) times alpha / r.
    (llama.cpp's GGUF adapter files: gguf_import.read_lora.)"""
    config_file = os.path.join(path, "adapter_config.json")
    if not os.path.isfile(config_file):
        raise UsageError(f"--lora {path}: no adapter_config.json (a PEFT LoRA adapter folder)")
    raw = read_json(config_file)

    def refuse(key: str, why: str):
        raise CheckpointError(f"{config_file}: {key} {raw.get(key)!r} is not supported ({why})")

    if raw.get("peft_type", "LORA") != "LORA":
        refuse("peft_type", "LORA adapters")
    if raw.get("use_dora"):
        refuse("use_dora", "plain LoRA: DoRA's magnitudes are not read")
    if raw.get("bias", "none") != "none":
        refuse("bias", "adapters without biases")
    if raw.get("fan_in_fan_out"):
        refuse("fan_in_fan_out", "nn.Linear's [out, in] weights")
    if raw.get("modules_to_save"):
        refuse("modules_to_save", "an adapter of low-rank terms alone")
    weights = os.path.join(path, "adapter_model.safetensors")
    if not os.path.isfile(weights):
        raise CheckpointError(f"{path}: no adapter_model.safetensors (a .bin adapter: save it with "
                              "safe_serialization=True)")
    tensors = open_safetensors(weights)
    r, alpha = int(raw.get("r", 8)), float(raw.get("lora_alpha", 8))
    ranks, alphas = raw.get("rank_pattern") or {}, raw.get("alpha_pattern") or {}
    deltas = {}
    for name in tensors:
        match = re.fullmatch(r"(?:base_model\.model\.)?(.+)\.lora_([AB])\.weight", name)
        if match is None:
            raise CheckpointError(f"{weights}: unexpected tensor {name!r} (LoRA's lora_A / lora_B weights alone)")
        module, which = match.groups()
        b_name = name.removesuffix(".lora_A.weight") + ".lora_B.weight"
        if which == "B":
            continue
        if b_name not in tensors:
            raise CheckpointError(f"{weights}: {b_name} is missing beside its lora_A")
        rank = int(pattern_value(ranks, module, r))
        a = float(pattern_value(alphas, module, alpha))
        factor = scale * (a / rank ** 0.5 if raw.get("use_rslora") else a / rank)
        deltas[module + ".weight"] = (tensors[name], tensors[b_name], factor)
    if not deltas:
        raise CheckpointError(f"{weights}: no lora_A / lora_B weights")
    return Adapter(path, deltas)


def pattern_value(patterns: dict, module: str, default):
    """PEFT's rank_pattern / alpha_pattern: the value of the first key that ends the module's name, else default."""
    for key, value in patterns.items():
        if re.search(rf"(^|\.){key}$", module):
            return value
    return default


@contextlib.contextmanager
def applying(adapters: tuple[Adapter, ...], path: str):
    """While the checkpoint at path is read: the adapters that families.hf_weights merges into its tensors; refused
    in one line where it is not a Hugging Face folder."""
    pending = Pending(adapters)
    token = PENDING.set(pending)
    try:
        yield
    finally:
        PENDING.reset(token)
    if adapters and not pending.merged:
        raise UsageError(f"--lora: adapters apply to a Hugging Face folder's, a native folder's or a GGUF file's "
                         f"weights; {path} is none of them")


@dataclass(frozen=True)
class Delta:
    """One adapter's term on one weight: factor * B @ A (A [r, in], B [out, r] thunks)."""
    a: object
    b: object
    factor: float
    path: str
    rows: torch.Tensor | None = None  # B's rows in the weight's order (a GGUF file's turned q/k rows), None: as is

    def read(self, name: str, shape: tuple) -> tuple[torch.Tensor, torch.Tensor]:
        """(A, factor * B) in float32, refused in one line where B @ A is not the weight's shape."""
        a, b = self.a().float(), self.b().float()
        b = b if self.rows is None else b[self.rows]
        if a.shape[0] != b.shape[1] or (b.shape[0], a.shape[1]) != tuple(shape):
            raise CheckpointError(f"--lora {self.path}: {name} is {list(shape)} in the model, the adapter's B @ A "
                                  f"[{b.shape[0]}, {a.shape[1]}] (an adapter of another model?)")
        return a, b * self.factor


class Merged:
    """A target weight's thunk: called, the base weight plus its adapters' terms (float32); base: the weight as
    stored; deltas: the terms."""

    def __init__(self, base, deltas: tuple[Delta, ...], name: str) -> None:
        self.base, self.deltas, self.name = base, deltas, name

    def __call__(self) -> torch.Tensor:
        w = self.base().float()
        for delta in self.deltas:
            a, b = delta.read(self.name, tuple(w.shape))
            w = w + b @ a
        return w


# a Llama-layout adapter's names as a native folder names its weights (the default model's: read from a GGUF, its
# q and k rows back in Hugging Face's order)
NATIVE_NAMES = [(r"(?:model\.)?layers\.(\d+)\.self_attn\.([qkvo]_proj)\.weight", r"layers.\1.attn.\2.weight"),
                (r"(?:model\.)?layers\.(\d+)\.mlp\.(gate_proj|up_proj|down_proj)\.weight", r"layers.\1.mlp.\2.weight")]


def native_names(adapter: Adapter, name: str) -> list[tuple[str, None]]:
    """A Hugging Face adapter's name as a native folder (or a GGUF file read as one) names the weight."""
    if adapter.names != "peft":
        raise UsageError(f"--lora {adapter.path}: a llama.cpp adapter applies to a GGUF base of its architecture")
    for pattern, native in NATIVE_NAMES:
        if re.fullmatch(pattern, name):
            return [(re.sub(pattern, native, name), None)]
    return [(name, None)]


def merged(table: dict, source: str, names=lambda adapter, name: [(name, None)]) -> dict:
    """table {name: thunk} with PENDING's adapters on their target weights (Merged); names(adapter, name) -> [(the
    table's name, B's rows or None)] for each adapted name (a fused tensor of the adapter's: several); an adapter
    naming a weight the table lacks is refused in one line."""
    out, pending = dict(table), PENDING.get()
    pending.merged = True
    for adapter in pending.adapters:
        targets = [(target, rows, delta) for name, delta in adapter.deltas.items()
                   for target, rows in names(adapter, name)]
        missing = [target for target, _, _ in targets if target not in out]
        if missing or not targets:
            raise CheckpointError(f"--lora {adapter.path}: {missing[0] if missing else 'its tensors'} is not a weight "
                                  f"of {source} (an adapter of another model?)")
        for name, rows, (a, b, factor) in targets:
            before = out[name]
            base, deltas = (before.base, before.deltas) if isinstance(before, Merged) else (before, ())
            out[name] = Merged(base, (*deltas, Delta(a, b, factor, adapter.path, rows)), name)
    return out


def unmerged(table: dict) -> dict:
    """table with each Merged weight back to its base (a quantized load: the adapters go to attach)."""
    return {name: thunk.base if isinstance(thunk, Merged) else thunk for name, thunk in table.items()}


def check_unmerged(table: dict, adapters: tuple, mode: str) -> None:
    """Refuse in one line an adapter a quantized load cannot keep apart: one on a weight the family changes as it
    loads (split from a fused tensor, scaled), which only merges."""
    kept = sum(len(t.deltas) for t in table.values() if isinstance(t, Merged))
    wanted = sum(len(a.deltas) for a in adapters)
    if kept != wanted:
        raise UsageError(f"--lora with {mode} weights: this family changes some adapted weights as they load (the "
                         "adapter merges into full-precision weights only: --quant none)")


class LowRank(nn.Module):
    """A linear with adapters beside it: base(x) + (x A^T) B^T, A [R, in] and B [out, R] the adapters' terms on its
    parts side by side (B holds each part's rows of its own terms, zeros elsewhere; the factors folded in)."""

    def __init__(self, base: nn.Module, a: torch.Tensor, b: torch.Tensor) -> None:
        super().__init__()
        self.base = base
        self.register_buffer("lora_a", a)
        self.register_buffer("lora_b", b)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + F.linear(F.linear(x, self.lora_a.to(x.dtype)), self.lora_b.to(x.dtype))


def attach(model: nn.Module, table: dict, parts_of) -> None:
    """Put each Merged weight's adapters beside its (quantized) layer as a LowRank term. parts_of(module name) ->
    {weight prefix: rows} of a fused layer's parts (load.fused_parts)."""
    terms = {name.removesuffix(".weight"): t for name, t in table.items() if isinstance(t, Merged)}
    for module_name, module in list(model.named_modules()):
        parts = parts_of(model, module_name) if hasattr(module, "in_features") else {}
        if not any(p in terms for p in parts):
            continue
        total = module.out_features
        a_rows, b_blocks, start = [], [], 0
        for prefix, rows in parts.items():
            rows = rows or total  # (a layer of one part: all its rows)
            for delta in terms[prefix].deltas if prefix in terms else ():
                a, b = delta.read(prefix + ".weight", (rows, module.in_features))
                a_rows.append(a)
                b_blocks.append((start, b))
            start += rows
        b = torch.zeros(total, sum(a.shape[0] for a in a_rows))
        column = 0
        for (row, block), a in zip(b_blocks, a_rows):
            b[row:row + block.shape[0], column:column + a.shape[0]] = block
            column += a.shape[0]
        parent, _, leaf = module_name.rpartition(".")
        device = next(module.buffers(), next(module.parameters(), torch.empty(0))).device
        setattr(model.get_submodule(parent) if parent else model, leaf,
                LowRank(module, torch.cat(a_rows).to(device), b.to(device)))
