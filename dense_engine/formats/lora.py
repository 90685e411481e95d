"""lora.py: LoRA adapters (PEFT folders: adapter_config.json + adapter_model.safetensors) merged into a Hugging Face
folder's weights as they load: W + scale * (alpha / r) * B @ A for each target linear (alpha / sqrt(r) with
use_rslora; rank_pattern and alpha_pattern per module), before the family maps the names, so every family's own
changes (fused, split, folded) apply to the merged weight. `read_checkpoint(path, lora=...)` reads the adapters and
families.hf_weights merges them (PENDING: the adapters of the checkpoint being read). What an adapter would change
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

from dense_engine.formats.checkpoint import open_safetensors, read_json
from dense_engine.system.errors import CheckpointError, UsageError


@dataclass(frozen=True)
class Adapter:
    """One adapter as read: {base weight name: (A [r, in], B [out, r] thunks, its scale)} and where it came from."""
    path: str
    deltas: dict = field(default_factory=dict)


@dataclass
class Pending:
    """The adapters of the checkpoint being read, and whether a folder's weights took them."""
    adapters: tuple[Adapter, ...] = ()
    merged: bool = False


PENDING: ContextVar[Pending] = ContextVar("pending", default=Pending())


def parse(spec: str) -> tuple[str, float]:
    """--lora's DIR[:SCALE] -> (DIR, SCALE); a suffix that is not a number is part of the path."""
    path, _, scale = spec.rpartition(":")
    try:
        return (path, float(scale)) if path else (spec, 1.0)
    except ValueError:
        return spec, 1.0


def read_adapter(path: str, scale: float = 1.0) -> Adapter:
    """A PEFT adapter folder as an Adapter, its deltas scaled by `scale` (--lora DIR:SCALE) times alpha / r."""
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
        raise UsageError(f"--lora: adapters are merged into a Hugging Face folder's weights; {path} is not one")


def merged(table: dict, source: str) -> dict:
    """table {name: thunk} with ADAPTERS' deltas added to their base weights (float32, then the load's dtype); an
    adapter naming a weight the table lacks, or of another shape, is refused in one line."""
    out, pending = dict(table), PENDING.get()
    pending.merged = True
    for adapter in pending.adapters:
        missing = [name for name in adapter.deltas if name not in out]
        if missing:
            raise CheckpointError(f"--lora {adapter.path}: {missing[0]} is not a weight of {source} (an adapter of "
                                  "another model?)")
        for name, (a, b, factor) in adapter.deltas.items():
            out[name] = lambda base=out[name], a=a, b=b, factor=factor, name=name, path=adapter.path: add(
                base(), a(), b(), factor, name, path)
    return out


def add(w: torch.Tensor, a: torch.Tensor, b: torch.Tensor, factor: float, name: str, path: str) -> torch.Tensor:
    """w + factor * b @ a, in float32 (w [out, in], a [r, in], b [out, r])."""
    if a.shape[0] != b.shape[1] or (b.shape[0], a.shape[1]) != tuple(w.shape):
        raise CheckpointError(f"--lora {path}: {name} is {list(w.shape)} in the model, the adapter's B @ A "
                              f"[{b.shape[0]}, {a.shape[1]}] (an adapter of another model?)")
    return w.float() + factor * (b.float() @ a.float())
