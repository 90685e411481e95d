"""gguf_import.py: llama.cpp's GGUF files parsed, and read as native checkpoints by their architecture's family.

The file's metadata and tensor table are parsed here (GGUFFile, over a memory map: gguf's reader takes seconds on a
large vocabulary); weights are dequantized with the `gguf` package's own dequantizer (F32, F16, BF16, Q8_0, Q4_0,
Q4_1, Q4_K, Q5_K, Q6_K, ...). Q4_0 / Q4_1 linears also keep their blocks, which int4-g32 holds exactly, and every
2-D tensor of a type with a kernel (quantized.GGUF_TYPES: the K-quants, Q8_0, Q4_0/1, Q5_0/1), a mixture's 3-D
experts too, says where its rows of blocks lie in the file (Blocks), for `--quant gguf` to read as stored. read_gguf
names a file's tensors as its architecture's family says (an Architecture of families.GGUF_FAMILIES: the config from
the `ARCH.*` metadata, read as llama.cpp's model code reads it, and each layer tensor's native names, with what
llama.cpp's converter (convert_hf_to_gguf.py) did undone: each family's module says what); read_lora reads
llama.cpp's LoRA adapter files. The tokenizer a file holds is rebuilt in vocab.py. Stands on dense.py,
checkpoint.py, lora.py and quantized.py (int4's layout).
"""

from __future__ import annotations

import functools
import math
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from dense import DenseConfig
from dense_engine.cpu import quantized
from dense_engine.formats import lora
from dense_engine.formats.checkpoint import Checkpoint
from dense_engine.system.errors import CheckpointError, first_line

# The tensors outside the layers -> native names (the final norm's name is the family's: Architecture.final_norm)
MODEL_TENSORS = {"token_embd.weight": "embed_tokens.weight", "output.weight": "lm_head.weight",
                 "output_norm.bias": "norm.bias", "per_layer_token_embd.weight": "embed_per_layer.weight",
                 "per_layer_model_proj.weight": "per_layer_projection.weight",
                 "per_layer_proj_norm.weight": "per_layer_norm.weight"}
# A multi-token prediction layer's own tensors (after "blk.N.") -> native names (after "mtp.")
NEXTN_TENSORS = {"nextn.eh_proj.weight": "fc.weight", "nextn.enorm.weight": "norm_embedding.weight",
                 "nextn.hnorm.weight": "norm_hidden.weight", "nextn.shared_head_norm.weight": "norm.weight"}
# Tensors whose values the family reads into the config
CONFIG_TENSORS = {"rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight"}


def open_gguf(path: str) -> GGUFFile:
    """The file parsed once per process (a program reads its config, weights and tokenizer from it; a file changed
    since is parsed again)."""
    try:
        stat = os.stat(path)
        return parsed(os.path.abspath(path), stat.st_size, stat.st_mtime_ns)
    except (OSError, ValueError, struct.error, UnicodeDecodeError, OverflowError, MemoryError) as e:
        raise CheckpointError(f"{path}: not a readable GGUF file ({first_line(e) or type(e).__name__})") from None


@functools.lru_cache(maxsize=4)
def parsed(path: str, size: int, mtime_ns: int) -> GGUFFile:
    return GGUFFile(path)


class Strings:
    """An array of strings of a GGUF file, decoded when called (its length known without)."""

    def __init__(self, file: GGUFFile, at: int, count: int) -> None:
        self.file, self.at, self.count = file, at, count

    def __call__(self) -> list[str]:
        self.file.at = self.at
        return [self.file.string() for _ in range(self.count)]


class Field:
    """A metadata value, as gguf.GGUFReader's fields give it (contents()); value may be a function that decodes it
    when asked (an array of strings: a vocabulary, its merges)."""

    def __init__(self, value) -> None:
        self.value = value

    def contents(self):
        if callable(self.value):
            self.value = self.value()
        return self.value


@dataclass
class TensorInfo:
    """A tensor of the file, as gguf.GGUFReader's tensors describe it: dims innermost first; data: its bytes."""
    name: str
    tensor_type: object  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]
    n_bytes: int
    data_offset: int
    file: GGUFFile

    @property
    def data(self) -> np.ndarray:
        return self.file.bytes[self.data_offset:self.data_offset + self.n_bytes]


class GGUFFile:
    """A GGUF file's metadata and tensor table (llama.cpp's format: magic, version, counts, key/value pairs, tensor
    infos, aligned data), parsed with struct over a memory map. gguf.GGUFReader makes a numpy view of every array
    element: 4-14 s for a 128K-token vocabulary, most of a warm start; this takes 0.05 s. It offers the reader's
    shapes the importer uses (fields[key].contents(), tensors[i].name / tensor_type / shape / n_bytes / data_offset /
    data); values are decoded as they are read, arrays of strings when first asked (an undecodable string: the file
    is unreadable, or that key damaged)."""
    # GGUF value types -> struct formats, numpy dtypes
    SCALARS: ClassVar[dict[int, str]] = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
                                         10: "<Q", 11: "<q", 12: "<d"}
    NUMPY: ClassVar[dict[int, str]] = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?",
                                       10: "<u8", 11: "<i8", 12: "<f8"}

    def __init__(self, path: str) -> None:
        import gguf

        self.bytes = np.memmap(path, dtype=np.uint8, mode="r")
        self.buf, self.at = memoryview(self.bytes), 4  # (after the magic)
        if bytes(self.buf[:4]) != b"GGUF":
            raise ValueError("no GGUF magic")
        version = self.scalar(4)
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version}")
        tensors, kvs = self.scalar(10), self.scalar(10)
        if tensors > len(self.buf) or kvs > len(self.buf):
            raise ValueError("counts past the end of the file")
        self.fields = {}
        for _ in range(kvs):
            key, kind = self.string(), self.scalar(4)
            self.fields[key] = Field(self.value(kind))
            if key == "general.alignment" and (kind != 4 or not is_power_of_two(self.fields[key].contents())):
                raise ValueError(f"general.alignment is {self.fields[key].contents()!r}"
                                 f"{'' if kind == 4 else ' (not stored as u32)'}; expected a power of two stored as "
                                 "u32")
        infos = []
        for _ in range(tensors):
            name, dims = self.string(), self.scalar(4)
            if dims > 8:
                raise ValueError(f"tensor {name!r} has {dims} dimensions")
            shape = tuple(self.scalar(10) for _ in range(dims))
            infos.append((name, shape, gguf.GGMLQuantizationType(self.scalar(4)), self.scalar(10)))
        align = int(self.fields.get("general.alignment", Field(32)).contents() or 32)
        start = (self.at + align - 1) // align * align
        self.tensors = []
        for name, shape, kind, offset in infos:
            values, size = gguf.GGML_QUANT_SIZES[kind]
            count = math.prod(shape)
            row = shape[0] if shape else count
            if row % values:  # (a block never spans two rows)
                raise ValueError(f"tensor {name!r}: its rows of {row} values are not whole {kind.name} blocks of "
                                 f"{values}")
            n_bytes = count // values * size
            if start + offset + n_bytes > len(self.buf):
                raise ValueError(f"tensor {name!r} runs past the end of the file")
            self.tensors.append(TensorInfo(name, kind, shape, n_bytes, start + offset, self))

    def scalar(self, kind: int):
        fmt = self.SCALARS[kind]
        (value,) = struct.unpack_from(fmt, self.buf, self.at)
        self.at += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.scalar(10)
        if self.at + n > len(self.buf):
            raise ValueError("a string runs past the end of the file")
        text = bytes(self.buf[self.at:self.at + n]).decode("utf-8")
        self.at += n
        return text

    def value(self, kind: int):
        if kind == 8:
            return self.string()
        if kind != 9:
            return self.scalar(kind)
        item, count = self.scalar(4), self.scalar(10)
        if count > len(self.buf) - self.at:
            raise ValueError("an array runs past the end of the file")
        if item in self.NUMPY:  # numbers: one numpy read
            values = np.frombuffer(self.buf, dtype=self.NUMPY[item], count=count, offset=self.at)
            self.at += values.nbytes
            return values.tolist()
        if item == 8:  # strings: stepped over now (their lengths), decoded when asked (a warm start never asks)
            start = self.at
            for _ in range(count):
                (n,) = struct.unpack_from("<Q", self.buf, self.at)
                self.at += 8 + n
            if self.at > len(self.buf):
                raise ValueError("a string runs past the end of the file")
            return Strings(self, start, count)
        values = (self.value(item) for _ in range(count))  # arrays of arrays: decoded now, each where it lies
        return [value() if callable(value) else value for value in values]


def is_power_of_two(n) -> bool:
    return isinstance(n, int) and n > 0 and n & (n - 1) == 0


def tokens_count(reader, path: str) -> int:
    """How many tokens the vocabulary has (without decoding them: the config needs only the count)."""
    value = getattr(reader.fields.get("tokenizer.ggml.tokens"), "value", None)
    return value.count if isinstance(value, Strings) else len(field(reader, "tokenizer.ggml.tokens", path=path))


def field(reader, key: str, default=None, path: str = ""):
    f = reader.fields.get(key)
    if f is None:
        if default is None:
            raise CheckpointError(f"{path}: missing GGUF metadata {key!r}")
        return default
    try:
        return f.contents()
    except Exception as e:  # noqa: BLE001 (damaged values: undecodable strings, arrays shorter than declared)
        raise CheckpointError(f"{path}: GGUF metadata {key!r} is damaged ({type(e).__name__})") from None


def unpermute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row order: per head, rows (pair, 2) -> (2, pair), i.e. back to rotate-half halves."""
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def shape_of(t) -> tuple[int, ...]:
    return tuple(int(n) for n in reversed(t.shape))  # GGUF lists dims innermost first


def dequantized(t, path: str) -> torch.Tensor:
    """A GGUF tensor as float32 values in its shape, by gguf's own dequantizer."""
    import gguf

    try:
        values = gguf.quants.dequantize(t.data, t.tensor_type)
    except NotImplementedError:
        raise CheckpointError(f"{path}: tensor {t.name!r} has type {t.tensor_type.name}, which gguf cannot "
                              "dequantize") from None
    except (ValueError, TypeError, IndexError) as e:
        raise CheckpointError(f"{path}: tensor {t.name!r} is damaged ({first_line(e)})") from None
    if values.size != math.prod(shape_of(t)):
        raise CheckpointError(f"{path}: tensor {t.name!r} holds {values.size} values, its shape {list(shape_of(t))} "
                              f"needs {math.prod(shape_of(t))}")
    values = values.reshape(shape_of(t))
    return torch.from_numpy(values.copy() if not values.flags.writeable else np.ascontiguousarray(values))


class Metadata:
    """A GGUF file as its architecture's reader sees it: key(name) reads the metadata `ARCH.name` (default: when
    absent; None: it must be there), tensors are the file's by name; and what every reader reads alike."""

    def __init__(self, reader, arch: str, path: str) -> None:
        self.reader, self.arch, self.path = reader, arch, path
        self.tensors = {t.name: t for t in reader.tensors}

    def key(self, name: str, default=None):
        return field(self.reader, f"{self.arch}.{name}", default, self.path)

    def refuse_experts(self) -> None:
        if int(self.key("expert_count", 0)):
            raise CheckpointError(f"{self.path}: GGUF metadata {self.arch}.expert_count {self.key('expert_count')}: a "
                                  f"mixture of experts of architecture {self.arch!r}, which this engine does not read "
                                  "from GGUF files yet (it reads llama's (Mixtral), olmoe's, qwen2moe's and "
                                  "qwen3moe's)")

    def vocab_size(self) -> int:
        return int(self.key("vocab_size", 0) or tokens_count(self.reader, self.path))

    def head_dim(self, hidden: int, heads: int) -> int:
        """attention.key_length (hidden / heads when absent), which attention.value_length must equal."""
        head_dim = int(self.key("attention.key_length", hidden // max(heads, 1)))
        if int(self.key("attention.value_length", head_dim)) != head_dim:
            raise CheckpointError(f"{self.path}: GGUF metadata {self.arch}.attention.value_length differs from "
                                  "key_length")
        return head_dim

    @property
    def tied(self) -> bool:
        """Whether the head is the embedding (the file has no output.weight)."""
        return "output.weight" not in self.tensors


@dataclass(frozen=True)
class Architecture:
    """How a family (families/) reads a GGUF file of its architecture: config(meta) its DenseConfig (meta: the file's
    Metadata); layer(config, rest) [(native name after "layers.N.", rows or None, change(w, where) or None)] for a
    layer's tensor `rest` (after "blk.N."; None: no such tensor), where rows picks the stored rows (a part of a fused
    tensor, llama's turned q/k rows) and change undoes what the converter changed; blocks(meta), where blocks of the
    file make one layer here, each block's (layer, kind); finish(table, config, meta), the tensors a family adds from
    the metadata or shares between names; final_norm, the final norm's name."""
    config: Callable[[Metadata], DenseConfig]
    layer: Callable[[DenseConfig, str], list[tuple] | None]
    blocks: Callable[[Metadata], list[tuple[int, str]]] | None = None
    finish: Callable[[dict, DenseConfig, Metadata], None] | None = None
    final_norm: str = "output_norm.weight"


def read_gguf(path: str, architectures: dict[str, Architecture]) -> Checkpoint:
    """A GGUF file as a Checkpoint, its tensors named by its architecture's family (architectures:
    families.GGUF_FAMILIES): the weights dequantized with gguf's own dequantizer, each tensor's GGUF type, and for
    Q4_0 / Q4_1 linears their blocks as int4-g32 tensors (int4_tensors)."""
    reader = open_gguf(path)
    arch = field(reader, "general.architecture", path=path)
    if arch not in architectures:
        raise CheckpointError(f"{path}: GGUF architecture {arch!r} is not supported (supported: "
                              f"{', '.join(architectures)})")
    family, meta = architectures[arch], Metadata(reader, arch, path)
    tensors = meta.tensors
    config = family.config(meta)
    grouped = family.blocks(meta) if family.blocks else None  # [(its layer here, kind)]
    def read(name: str, rows: torch.Tensor | None, change):
        def thunk() -> torch.Tensor:
            w = dequantized(tensors[name], path)
            w = w if rows is None else w[rows]
            return w if change is None else change(w, f"{path}: tensor {name!r}")
        return thunk

    def read_blocks(name: str, rows: torch.Tensor | None) -> Blocks:
        t = tensors[name]
        out = math.prod(shape_of(t)[:-1])  # (a mixture's experts [E, rows, C]: E x rows rows)
        return Blocks(t.tensor_type.name, path, name, t.data_offset, out, t.n_bytes // out, rows)

    def read_int4(name: str, rows: torch.Tensor | None):
        def thunk() -> dict:
            stored = int4_tensors(tensors[name], shape_of(tensors[name]), path)
            return stored if rows is None else {k: v[rows] for k, v in stored.items()}
        return thunk

    table, types, exact, blocks = {}, {}, {}, {}

    def add(native: str, name: str, rows: torch.Tensor | None = None, change=None) -> None:
        """native: rows `rows` of the tensor `name` (None: all), as change(w, where) makes them (None: as stored)."""
        table[native] = read(name, rows, change)
        types[native] = tensors[name].tensor_type.name
        if change is not None:  # (a changed tensor is float: conv kernels, ssm_a)
            return
        if types[native] in quantized.GGUF_TYPES and len(tensors[name].shape) in (2, 3):  # (3: experts)
            blocks[native] = read_blocks(name, rows)
        if types[native] in quantized.EXACT_INT4_TYPES and native.startswith("layers.") and native.endswith(".weight"):
            exact[native.removesuffix(".weight")] = read_int4(name, rows)

    model_tensors = {**MODEL_TENSORS, family.final_norm: "norm.weight"}
    extra = range(config.num_hidden_layers, int(meta.key("block_count"))) if grouped is None else range(0)  # (MTP)
    for name in tensors:
        if name in CONFIG_TENSORS:
            continue
        if name in model_tensors:
            add(model_tensors[name], name)
            continue
        prefix, layer, rest = (name.split(".", 2) + ["", ""])[:3]
        if prefix != "blk" or not layer.isdigit():
            raise CheckpointError(f"{path}: unexpected tensor {name!r} for architecture {arch!r}")
        if int(layer) in extra:  # a multi-token prediction layer (qwen35's): a full-attention layer (mtp.layers.J.*)
            # and nextn.* (mtp.*, as speculative.MultiTokenPredictor names them; convert.mtp_apart takes them apart)
            at = int(layer) - config.num_hidden_layers
            parts = [(NEXTN_TENSORS[rest], None, None)] if rest in NEXTN_TENSORS else family.layer(config, rest)
            if parts is None:
                raise CheckpointError(f"{path}: unexpected tensor {name!r} for architecture {arch!r}")
            for native, rows, change in parts:
                add(f"mtp.{native}" if rest in NEXTN_TENSORS else f"mtp.layers.{at}.{native}", name, rows, change)
            continue
        if grouped is not None and int(layer) < len(grouped):  # (an MLP block's norm is its layer's mlp_norm)
            at, kind = grouped[int(layer)]
            layer, rest = str(at), "ffn_norm.weight" if kind == "mlp" and rest == "attn_norm.weight" else rest
        parts = family.layer(config, rest) if int(layer) < config.num_hidden_layers else None
        if parts is None:
            raise CheckpointError(f"{path}: unexpected tensor {name!r} for architecture {arch!r}")
        for native, rows, change in parts:
            add(f"layers.{layer}.{native}", name, rows, change)
    if family.finish:
        family.finish(table, config, meta)
    table = lora.merged(table, path, lora.gguf_names(arch, path, lambda rest: family.layer(config, rest)))
    return Checkpoint(path, config, table, source_types=types, exact=exact, blocks=blocks)


def read_lora(path: str, scale: float) -> lora.Adapter:
    """llama.cpp's LoRA file (convert_lora_to_gguf.py's): NAME.lora_a [r, in] and NAME.lora_b [out, r] for each
    adapted tensor NAME of the base's GGUF names, adapter.lora.alpha (scale alpha / r, as llama.cpp; none: 1)."""
    reader = open_gguf(path)
    kind = (field(reader, "general.type", "", path), field(reader, "adapter.type", "", path))
    if kind != ("adapter", "lora"):
        raise CheckpointError(f"{path}: general.type / adapter.type {'/'.join(kind)!r}: not a LoRA adapter file")
    alpha = float(field(reader, "adapter.lora.alpha", 0.0, path))
    tensors = {t.name: t for t in reader.tensors}
    deltas = {}
    for name in tensors:
        if not name.endswith((".lora_a", ".lora_b")):
            raise CheckpointError(f"{path}: unexpected tensor {name!r} (lora_a / lora_b tensors alone)")
        if name.endswith(".lora_b"):
            continue
        base = name.removesuffix(".lora_a")
        if base + ".lora_b" not in tensors:
            raise CheckpointError(f"{path}: {base}.lora_b is missing beside its lora_a")
        a, b = (lambda t=tensors[base + part]: dequantized(t, path) for part in (".lora_a", ".lora_b"))
        rank = int(shape_of(tensors[name])[0])
        deltas[base] = (a, b, scale * (alpha / rank if alpha else 1.0))
    if not deltas:
        raise CheckpointError(f"{path}: no lora_a / lora_b tensors")
    return lora.Adapter(path, deltas, field(reader, "general.architecture", "", path))


@dataclass
class Blocks:
    """A GGUF tensor's blocks as the file stores them (rows of row_bytes each, from offset), and which of its rows a
    native tensor is: order (indices of stored rows, in the native tensor's order; None: every row, in order): a
    part of a fused tensor (Phi-3's q|k|v, qwen35's per-head q|gate) or llama's permuted q/k rows."""
    kind: str
    path: str
    name: str
    offset: int  # in the file, of the tensor's first row
    rows: int  # the tensor's rows
    row_bytes: int
    order: torch.Tensor | None = None

    @property
    def native_rows(self) -> int:
        return self.rows if self.order is None else len(self.order)

    def read(self) -> torch.Tensor:
        """The tensor's rows as stored, uint8 [rows, row_bytes] (a copy)."""
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            data = f.read(self.rows * self.row_bytes)
        if len(data) != self.rows * self.row_bytes:
            raise CheckpointError(f"{self.path}: tensor {self.name!r} is truncated")
        return torch.frombuffer(bytearray(data), dtype=torch.uint8).reshape(self.rows, self.row_bytes)


def int4_tensors(t, shape: tuple[int, ...], path: str) -> dict:
    """A Q4_0 / Q4_1 tensor's blocks as int4-g32's stored tensors, exactly: Q4_1 blocks are {d, m, 16 bytes} with
    w = d * q + m, Q4_0 blocks are {d, 16 bytes} with w = d * (q - 8) = d * q + (-8 d); byte j of a block holds q[j]
    in its low nibble and q[j + 16] in its high one. (Every stored tensor is row-major: rows are picked after.)"""
    rows, cols = shape
    header = 4 if t.tensor_type.name == "Q4_1" else 2
    blocks = np.asarray(t.data, dtype=np.uint8).reshape(-1, header + 16)
    if blocks.shape[0] != rows * cols // 32:
        raise CheckpointError(f"{path}: tensor {t.name!r} holds {blocks.shape[0]} blocks, expected {rows * cols // 32}")
    d = torch.from_numpy(blocks[:, 0:2].copy().view(np.float16)).reshape(rows, cols // 32)
    m = torch.from_numpy(blocks[:, 2:4].copy().view(np.float16)).reshape(rows, cols // 32) if header == 4 else -8 * d
    packed = torch.from_numpy(blocks[:, header:].copy())  # [blocks, 16]
    codes = torch.cat((packed & 15, packed >> 4), dim=1).reshape(rows, cols)
    return quantized.int4_pack(codes, d, m)
