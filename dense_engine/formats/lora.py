"""lora.py: LoRA adapters (PEFT folders: adapter_config.json + adapter_model.safetensors) on a Hugging Face folder's
weights: W + scale * (alpha / r) * B @ A for each target linear (alpha / sqrt(r) with use_rslora; rank_pattern and
alpha_pattern per module). `read_checkpoint(path, lora_adapters)` reads the adapters and families.hf_weights wraps each
target weight's thunk in a Merged (PENDING: the adapters of the checkpoint being read), before the family maps the
names, so every family's own changes (fused, split, folded) apply to the merged weight: a full-precision load merges
them. A quantized load keeps the base as stored (Merged.base) and adds the adapters as an unmerged low-rank term
(LowRank, attach), where the family kept the weight as it is. A named adapter (serve.py's --lora NAME=DIR) is never
merged: it stays beside the weights, full-precision or quantized, switched on per cache row (switch: a request picks
it by its model name or llama-server's `lora` field, and rows with other adapters run in the same batch). What an
adapter would change
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
from torch import nn

from dense_engine.cpu import kernels
from dense_engine.formats.checkpoint import open_safetensors, read_json
from dense_engine.system.errors import CheckpointError, UsageError


@dataclass(frozen=True)
class Adapter:
    """One adapter as read: {base weight name: (A [r, in], B [out, r] thunks, its scale)} and where it came from;
    names: "peft" (Hugging Face's module names) or the GGUF architecture of a llama.cpp adapter (its tensor names);
    name: "" (merged, or on for every row) or the name requests pick it by (beside the weights, per row)."""
    path: str
    deltas: dict = field(default_factory=dict)
    names: str = "peft"
    name: str = ""


@dataclass
class Pending:
    """The adapters of the checkpoint being read, and whether a folder's weights took them."""
    adapters: tuple[Adapter, ...] = ()
    merged: bool = False


PENDING: ContextVar[Pending] = ContextVar("pending")  # (unset: no adapters; get(Pending()), a fresh one each time)


def parse(spec: str) -> tuple[str, float, str]:
    """--lora's [NAME=]DIR[:SCALE] -> (DIR, SCALE, NAME or ""); a suffix that is not a number is part of the path,
    and so is a NAME= where the whole spec is a path that exists. NAME: vLLM's --lora-modules name, which requests
    pick the adapter by (serve.py)."""
    name, equals, rest = spec.partition("=")
    if not equals or not name or os.path.exists(spec):
        name, rest = "", spec
    elif not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._:/-]*", name):
        raise UsageError(f"--lora {spec}: the name {name!r} is not a model name (letters, digits, . _ : / -)")
    path, _, scale = rest.rpartition(":")
    try:
        return (path, float(scale), name) if path else (rest, 1.0, name)
    except ValueError:
        return rest, 1.0, name


def entry(adapter) -> tuple[str, float, str]:
    """An adapter as a load takes it: "[NAME=]PATH[:SCALE]", (path, scale) or (path, scale, name) -> (the absolute
    path, scale, name)."""
    path, scale, name = parse(adapter) if isinstance(adapter, str) else (*adapter, "")[:3]
    return os.path.abspath(os.fspath(path)), float(scale), name


def unnamed(lora: tuple, where: str) -> None:
    """Refuse in one line a named adapter where no request picks one (chat.py, dense_engine.load)."""
    for path, _, name in lora:
        if name:
            raise UsageError(f"--lora {name}={path}: {where} has no requests to pick an adapter by name (serve.py "
                             f"serves them); --lora {path} applies it to every answer")


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
    name: str = ""  # the adapter's name ("": merged, or on for every row)

    def read(self, name: str, shape: tuple) -> tuple[torch.Tensor, torch.Tensor]:
        """(A, factor * B) in float32, refused in one line where B @ A is not the weight's shape."""
        a, b = self.a().float(), self.b().float()
        b = b if self.rows is None else b[self.rows]
        if a.shape[0] != b.shape[1] or (b.shape[0], a.shape[1]) != tuple(shape):
            raise CheckpointError(f"--lora {self.path}: {name} is {list(shape)} in the model, the adapter's B @ A "
                                  f"[{b.shape[0]}, {a.shape[1]}] (an adapter of another model?)")
        return a, b * self.factor


class Merged:
    """A target weight's thunk: called, the base weight plus its unnamed adapters' terms (float32; a named one stays
    beside it: attach); base: the weight as stored; deltas: the terms."""

    def __init__(self, base, deltas: tuple[Delta, ...], name: str) -> None:
        self.base, self.deltas, self.name = base, deltas, name

    def __call__(self) -> torch.Tensor:
        w = self.base().float()
        for delta in (d for d in self.deltas if not d.name):
            a, b = delta.read(self.name, tuple(w.shape))
            w = w + b @ a
        return w


# a Llama-layout adapter's names as a native folder names its weights (the default model's: read from a GGUF, its
# q and k rows back in Hugging Face's order)
NATIVE_NAMES = [(r"(?:model\.)?layers\.(\d+)\.self_attn\.([qkvo]_proj)\.weight", r"layers.\1.mixer.\2.weight"),
                (r"(?:model\.)?layers\.(\d+)\.mlp\.(gate_proj|up_proj|down_proj)\.weight", r"layers.\1.mlp.\2.weight")]


def native_names(adapter: Adapter, name: str) -> list[tuple[str, None]]:
    """A Hugging Face adapter's name as a native folder (or a GGUF file read as one) names the weight."""
    if adapter.names != "peft":
        raise UsageError(f"--lora {adapter.path}: a llama.cpp adapter applies to a GGUF base of its architecture")
    for pattern, native in NATIVE_NAMES:
        if re.fullmatch(pattern, name):
            return [(re.sub(pattern, native, name), None)]
    return [(name, None)]


def folder_names(adapter: Adapter, name: str) -> list[tuple[str, None]]:
    """A Hugging Face folder's names (merged's `names`): an adapter's names are the folder's."""
    if adapter.names != "peft":
        raise CheckpointError(f"--lora {adapter.path}: a llama.cpp adapter applies to a GGUF base of its architecture")
    return [(name, None)]


def gguf_names(arch: str, path: str, parts):
    """A GGUF base's names (merged's `names`; arch: its architecture): a llama.cpp adapter's GGUF names as the base's
    table names the weight, and B's rows in its order (parts(rest): the base's native tensors of a layer's tensor
    `rest`, turned q/k rows and fused tensors undone as for the base's); a Hugging Face one's as a Llama-layout native
    folder's (the base's rows here are in Hugging Face's order)."""
    def names(adapter: Adapter, name: str) -> list[tuple[str, torch.Tensor | None]]:
        if adapter.names == "peft":
            return native_names(adapter, name)
        if adapter.names != arch:
            raise CheckpointError(f"--lora {adapter.path}: an adapter of architecture {adapter.names!r}, the base "
                                  f"{path} is {arch!r}")
        prefix, layer, rest = (name.split(".", 2) + ["", ""])[:3]
        found = parts(rest) if prefix == "blk" else None
        if not found or not layer.isdigit() or any(change is not None for _, _, change in found):
            raise CheckpointError(f"--lora {adapter.path}: {name} is not an adapted weight this engine reads")
        return [(f"layers.{layer}.{native}", rows) for native, rows, _ in found]
    return names


def merged(table: dict, source: str, names=lambda adapter, name: [(name, None)]) -> dict:
    """table {name: thunk} with PENDING's adapters on their target weights (Merged); names(adapter, name) -> [(the
    table's name, B's rows or None)] for each adapted name (a fused tensor of the adapter's: several); an adapter
    naming a weight the table lacks is refused in one line."""
    out, pending = dict(table), PENDING.get(Pending())
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
            out[name] = Merged(base, (*deltas, Delta(a, b, factor, adapter.path, rows, adapter.name)), name)
    return out


def unmerged(table: dict) -> dict:
    """table with each Merged weight back to its base (a quantized load: the adapters go to attach)."""
    return {name: thunk.base if isinstance(thunk, Merged) else thunk for name, thunk in table.items()}


def check_unmerged(table: dict, adapters: tuple, mode: str | None) -> None:
    """Refuse in one line an adapter a load cannot keep apart (every adapter beside quantized weights, a named one
    beside any): one on a weight the family changes as it loads (split from a fused tensor, scaled), which only
    merges."""
    apart = [a for a in adapters if mode is not None or a.name]
    kept = sum(d.name == a.name and d.path == a.path for t in table.values() if isinstance(t, Merged)
               for d in t.deltas for a in apart)
    if kept != sum(len(a.deltas) for a in apart):
        raise UsageError(f"--lora with {mode or 'full-precision'} weights: this family changes some adapted weights "
                         "as they load (the adapter merges into full-precision weights only: --quant none, without "
                         "a name)")


class LowRank(nn.Module):
    """A linear with adapters beside it: base(x) + (x A^T) B^T, A [R, in] and B [out, R] the adapters' terms on its
    parts side by side (B holds each part's rows of its own terms, zeros elsewhere; the factors folded in).
    With named adapters, columns [R] says whose each of the R columns is (0: an adapter on for every row; i: the
    i-th named one), and row b of the input scales them by scales[b] [1 + named] (switch: the model's one tensor,
    a request's choice per cache row; scales[b, 0] is 1)."""

    def __init__(self, base: nn.Module, a: torch.Tensor, b: torch.Tensor, columns: torch.Tensor | None = None,
                 scales: torch.Tensor | None = None) -> None:
        super().__init__()
        self.base = base
        self.register_buffer("lora_a", a)
        self.register_buffer("lora_b", b)
        self.register_buffer("columns", columns, persistent=False)
        self.register_buffer("scales", scales, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # kernels.cpp's float32 tiles: a row's bits whatever the rows and the adapters beside it (PyTorch's GEMM
        # rounds by the shape)
        low = kernels.linear_f32(x, self.lora_a.to(x.dtype))  # [B, T, R]
        if self.columns is not None:  # each row's adapters on, at their scales; the others' columns zero
            low = low * self.scales[:x.shape[0]].index_select(1, self.columns).to(x.dtype)[:, None, :]
        return self.base(x) + kernels.linear_f32(low, self.lora_b.to(x.dtype))


def switches(model: nn.Module) -> list[LowRank]:
    """The model's linears with named adapters beside them."""
    return [m for m in model.modules() if isinstance(m, LowRank) and m.columns is not None]


def switched_off(rows: int, named: int, device) -> torch.Tensor:
    """Scales [rows, 1 + named] with every row's named adapters off (column 0, the unnamed ones': 1)."""
    scales = torch.zeros(rows, 1 + named, device=device)
    scales[:, 0] = 1
    return scales


def size_switch(model: nn.Module, rows: int) -> None:
    """The scales of named adapters for `rows` cache rows (every row: none on), one tensor the linears share."""
    held = switches(model)
    if held:
        scales = switched_off(rows, held[0].scales.shape[1] - 1, held[0].scales.device)
        for m in held:
            m.scales = scales


def switch(held: list[LowRank], rows: list[tuple[float, ...]]) -> None:
    """The next call's rows, held: switches(model) (their one scales tensor, as the cache sized it): row b of the
    call's input with the named adapters at the scales rows[b] (one per named adapter; (): none)."""
    if not held:
        return
    scales = held[0].scales
    named = scales.shape[1] - 1
    scales[:len(rows), 1:].copy_(torch.tensor([list(row) or [0.0] * named for row in rows], dtype=torch.float32))


def attach(model: nn.Module, table: dict, parts_of, served: tuple[str, ...] = (), merged: bool = False) -> None:
    """Put each Merged weight's adapters beside its (quantized) layer as a LowRank term; merged: the unnamed ones are
    in the weights already (a full-precision load), only the named go beside. served: the named adapters' names, in
    the order switch() takes their scales. parts_of(module name) -> {weight prefix: rows} of a fused layer's parts
    (quantized.fused_parts)."""
    terms = {name.removesuffix(".weight"): t for name, t in table.items() if isinstance(t, Merged)
             and any(d.name or not merged for d in t.deltas)}
    scales = None  # (one tensor for all named adapters' linears: caches.setup_cache sizes it for the cache's rows)
    for module_name, module in list(model.named_modules()):
        parts = parts_of(model, module_name) if hasattr(module, "in_features") else {}
        if not any(p in terms for p in parts):
            continue
        total = module.out_features
        a_rows, b_blocks, columns, start = [], [], [], 0
        for prefix, rows in parts.items():
            rows = rows or total  # (a layer of one part: all its rows)
            for delta in terms[prefix].deltas if prefix in terms else ():
                if merged and not delta.name:
                    continue
                a, b = delta.read(prefix + ".weight", (rows, module.in_features))
                a_rows.append(a)
                b_blocks.append((start, b))
                columns += [served.index(delta.name) + 1 if delta.name else 0] * a.shape[0]
            start += rows
        b = torch.zeros(total, sum(a.shape[0] for a in a_rows))
        column = 0
        for (row, block), a in zip(b_blocks, a_rows):
            b[row:row + block.shape[0], column:column + a.shape[0]] = block
            column += a.shape[0]
        parent, _, leaf = module_name.rpartition(".")
        device = next(module.buffers(), next(module.parameters(), torch.empty(0))).device
        if served and scales is None:
            scales = switched_off(1, len(served), device)
        setattr(model.get_submodule(parent) if parent else model, leaf,
                LowRank(module, torch.cat(a_rows).to(device), b.to(device),
                        torch.tensor(columns, device=device) if served else None, scales))
