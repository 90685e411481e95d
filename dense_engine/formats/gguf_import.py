"""gguf_import.py: llama.cpp's GGUF files as native checkpoints, and their tokenizers, read as llama.cpp reads them.

Architectures: llama (Llama 1/2/3.x, SmolLM2, TinyLlama), qwen2, qwen3, gemma, gemma2, gemma3, gemma4, phi3, and the
hybrids whose other layers keep a state (dense.py section 4): qwen35 (Qwen3.5 / 3.6), lfm2 (LFM2), granitehybrid
(Granite 4.0 H), nemotron_h (Nemotron-H), falcon-h1 (Falcon-H1). What llama.cpp's
converter (convert_hf_to_gguf.py) did that an importer must undo or honour, and what llama.cpp's model code decides
beyond the file (llama-model.cpp, src/models/*.cpp), each where it is read below:
  * llama: q and k rows permuted so rotary can turn adjacent pairs (2i, 2i+1); undone here, back to rotate-half
    pairs (i, i + D/2), the same model. `rope_freqs.weight` holds Llama 3.x's divisor of each frequency.
  * gemma, gemma2, gemma3: every norm weight has the `+1` of Gemma's `(1 + w)` baked in; embeddings times sqrt(hidden);
    tanh-GELU gates. gemma2/3: post-norms, soft-caps (2), windows on the layers llama.cpp's pattern picks (2: every
    other layer; 3: five of six, with `rope.freq_base_swa`), and a query scale fixed by llama.cpp's code, not the file.
  * phi3: q|k|v fused in attn_qkv and gate|up in ffn_up (split here); partial rotary; LongRoPE factors as tensors,
    the long ones for a cache longer than `rope.scaling.original_context_length` (as llama.cpp picks by its context).
  * qwen35: Gated DeltaNet layers (ssm.* metadata; ssm_a = -exp(A_log), taken back to A_log; conv kernels [C, W];
    value heads reordered to tiled, kept so: linear_tiled_values) and full-attention layers whose attn_q holds each
    head's query rows, then its output-gate rows; every norm but ssm_norm with its 1 + w baked in (used as stored);
    MTP layers after the model's (nextn_predict_layers: nextn.* and a full-attention layer) read as a draft's.
  * lfm2: short-conv layers where attention.head_count_kv is 0; the final norm is token_embd_norm.
  * granitehybrid (Granite 4.0 H): Mamba2 layers where attention.head_count_kv is 0 (ssm.time_step_rank heads,
    ssm.group_count groups of ssm.state_size; ssm_a = -exp(A_log), ssm_d and ssm_norm reshaped, the conv kernels
    squeezed), attention layers with llama's permuted q/k rows and no rope unless rope.scaling.finetuned (which
    llama.cpp takes as true when absent), Granite's four scales.
  * nemotron_h (Nemotron-H): granitehybrid's tensors in blocks of one kind each (attention where head_count_kv is
    not 0, a squared-ReLU MLP where feed_forward_length is not, else Mamba2), grouped into this engine's layers as
    its folders are (families.nemotron_h).
  * falcon-h1 (Falcon-H1): attention and Mamba2 in every layer (granitehybrid's tensors side by side, q/k rows as
    stored), its muP multipliers already folded into the weights by the converter; ssm_norm where the model has it.
  * gemma4: Gemma 3's layer with Gemma 4's switches (dense.py): the sliding and full layers' own head sizes
    (key_length_swa, key_length) and key/value heads (head_count_kv per layer), the full layers' partial rotation as
    `rope_freqs` factors (1 on the rotated pairs, 1e30 on the rest: proportional rope), per-layer embeddings
    (per_layer_*), a learned scale per layer (layer_output_scale), the last shared_kv_layers layers reading keys and
    values where llama.cpp's code points them (which must be the last earlier layer of their kind), no attn_v on the
    full layers when their values are their keys; norms stored as multiplied (no + 1). Tokenizer "gemma4": BPE over
    the text with spaces as "▁", split only at newlines, byte fallback.

The file's metadata and tensor table are parsed here (GGUFFile, over a memory map: gguf's reader takes seconds on a
large vocabulary); weights are dequantized with the `gguf` package's own dequantizer (F32, F16, BF16, Q8_0, Q4_0,
Q4_1, Q4_K, Q5_K, Q6_K, ...). Q4_0 / Q4_1 linears also keep their blocks, which int4-g32 holds exactly, and every
2-D tensor of a type with a kernel (quantized.GGUF_TYPES: the K-quants, Q8_0, Q4_0/1, Q5_0/1) says where its rows
of blocks lie in the file (Blocks), for `--quant gguf` to read as stored. Tokenizers: `tokenizer.ggml.*` rebuilt with
the `tokenizers` library: byte-level BPE ("gpt2", with llama.cpp's pre-tokenizers) or SentencePiece ("llama": scores,
byte fallback, "▁" for spaces). The chat template is kept for tokenizer_config.json. Stands on dense.py, checkpoint.py
and quantized.py (int4's layout).
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import struct
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from dense import DenseConfig
from dense_engine.cpu import quantized
from dense_engine.formats import families, lora, rope_scalings
from dense_engine.formats.checkpoint import Checkpoint, atomic_write, make_config, write_text
from dense_engine.system.errors import CheckpointError, first_line
from dense_engine.system.machine import cache_dir, note, unwritable_cache

# hybrids with state layers (dense.py 4)
STATE_ARCHITECTURES = ("qwen35", "lfm2", "granitehybrid", "nemotron_h", "falcon-h1")
ARCHITECTURES = tuple(families.BY_GGUF) + STATE_ARCHITECTURES + ("gptneox", "gemma4")  # llama, qwen2, qwen3, gemma,
#                                                                   gemma2, gemma3, phi3,
#                                                                   smollm3, granite, olmo2 (OLMo 2 and 3), seed_oss,
#                                                                   exaone4, glm4, cohere2, apertus, hunyuan-dense,
#                                                                   stablelm, granite_swa
# Token texts that end a turn in common chat formats (llama.cpp recognises them the same way).
END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<|end_of_text|>", "<|endoftext|>", "<end_of_turn>", "<turn|>", "<|end|>",
               "</s>")
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6  # tokenizer.ggml.token_type values
# Per-layer GGUF tensors -> native names (q|k|v and Phi-3's gate|up are split where they are read)
LAYER_TENSORS = {"attn_norm": "attn_norm", "ffn_norm": "mlp_norm", "post_attention_norm": "attn_post_norm",
                 "post_ffw_norm": "mlp_post_norm", "attn_q": "attn.q_proj", "attn_k": "attn.k_proj",
                 "attn_v": "attn.v_proj", "attn_output": "attn.o_proj", "attn_q_norm": "attn.q_norm",
                 "attn_k_norm": "attn.k_norm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                 "ffn_down": "mlp.down_proj"}
# qwen35 and lfm2: per-layer GGUF tensors (after "blk.N.") -> native names (after "layers.N."); the changes the
# converter made are undone in state_layer_tensors
ATTENTION_TENSORS = {"attn_norm.weight": "attn_norm.weight", "attn_q.weight": "attn.q_proj.weight",
                     "attn_k.weight": "attn.k_proj.weight", "attn_v.weight": "attn.v_proj.weight",
                     "attn_output.weight": "attn.o_proj.weight", "attn_q_norm.weight": "attn.q_norm.weight",
                     "attn_k_norm.weight": "attn.k_norm.weight", "ffn_gate.weight": "mlp.gate_proj.weight",
                     "ffn_up.weight": "mlp.up_proj.weight", "ffn_down.weight": "mlp.down_proj.weight"}
# gemma4: per-layer GGUF tensors -> native names (its norms stored as the model multiplies them: no + 1)
GEMMA4_TENSORS = {**{f"{k}.weight": f"{v}.weight" for k, v in LAYER_TENSORS.items()},
                  "inp_gate.weight": "per_layer_gate.weight", "proj.weight": "per_layer_proj.weight",
                  "post_norm.weight": "per_layer_norm.weight", "layer_output_scale.weight": "layer_scalar"}
STATE_LAYER_TENSORS = {
    "qwen35": {**ATTENTION_TENSORS, "post_attention_norm.weight": "mlp_norm.weight",  # (the MLP's input norm)
               "attn_qkv.weight": "attn.in_proj_qkv.weight", "attn_gate.weight": "attn.in_proj_z.weight",
               "ssm_beta.weight": "attn.in_proj_b.weight", "ssm_alpha.weight": "attn.in_proj_a.weight",
               "ssm_conv1d.weight": "attn.conv_weight", "ssm_dt.bias": "attn.dt_bias", "ssm_a": "attn.A_log",
               "ssm_norm.weight": "attn.norm.weight", "ssm_out.weight": "attn.out_proj.weight"},
    "lfm2": {**ATTENTION_TENSORS, "ffn_norm.weight": "mlp_norm.weight",
             "shortconv.conv.weight": "attn.conv_weight", "shortconv.in_proj.weight": "attn.in_proj.weight",
             "shortconv.out_proj.weight": "attn.out_proj.weight"},
    "granitehybrid": {**ATTENTION_TENSORS, "ffn_norm.weight": "mlp_norm.weight", "ssm_in.weight": "attn.in_proj.weight",
                      "ssm_conv1d.weight": "attn.conv_weight", "ssm_conv1d.bias": "attn.conv_bias",
                      "ssm_dt.bias": "attn.dt_bias", "ssm_a": "attn.A_log", "ssm_d": "attn.D",
                      "ssm_norm.weight": "attn.norm.weight", "ssm_out.weight": "attn.out_proj.weight"}}
STATE_LAYER_TENSORS["nemotron_h"] = STATE_LAYER_TENSORS["granitehybrid"]  # (its blocks grouped into layers first)
# falcon-h1: both mixers in every layer (dense.Hybrid), its MLP's norm named without ".weight"
STATE_LAYER_TENSORS["falcon-h1"] = {
    "attn_norm.weight": "attn_norm.weight", "ffn_norm": "mlp_norm.weight",
    **{k: v.replace("attn.", "attn.attention.") for k, v in ATTENTION_TENSORS.items() if k.startswith("attn_")
       and k != "attn_norm.weight"},
    **{k: v for k, v in ATTENTION_TENSORS.items() if k.startswith("ffn_")},
    **{k: v.replace("attn.", "attn.mamba.") for k, v in STATE_LAYER_TENSORS["granitehybrid"].items()
       if k.startswith("ssm_")}}


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


def read_config(reader, arch: str, tensors: dict, path: str) -> DenseConfig:
    """The model's config from the file's `ARCH.*` metadata, the family's switches (families.FAMILIES, as for its
    Hugging Face folders) and what llama.cpp's model code fixes beyond them."""
    def key(name: str, default=None):
        return field(reader, f"{arch}.{name}", default, path)

    if int(key("expert_count", 0)):
        raise CheckpointError(f"{path}: GGUF metadata {arch}.expert_count {key('expert_count')}: a mixture of experts; "
                              "this engine runs dense models only")
    family = families.BY_GGUF[arch][1]
    if arch == "command-r" and "blk.0.attn_q_norm.weight" in tensors:
        raise CheckpointError(f"{path}: tensor 'blk.0.attn_q_norm.weight': Command R+'s per-head q/k layer norms are "
                              "not supported")
    hidden, heads = int(key("embedding_length")), int(key("attention.head_count"))
    layers = int(key("block_count"))
    head_dim = int(key("attention.key_length", hidden // max(heads, 1)))
    if int(key("attention.value_length", head_dim)) != head_dim:
        raise CheckpointError(f"{path}: GGUF metadata {arch}.attention.value_length differs from key_length")
    rope_dim = int(key("rope.dimension_count", head_dim))
    if arch == "llama" and rope_dim != head_dim:  # llama.cpp refuses it too
        raise CheckpointError(f"{path}: GGUF metadata {arch}.rope.dimension_count {rope_dim} must equal the head size "
                              f"{head_dim} for llama")
    context = int(key("context_length", 2048))
    scaling = rope_scaling(reader, arch, tensors, path, context, rope_dim)
    original = (scaling or {}).get("original_max_position_embeddings", context)
    if float(key("attention.temperature_scale", 0.0)) and original < context:  # (llama.cpp: 1 up to the original)
        note(f"{path}: the context is {original} tokens (past them Ministral 3 scales its queries, which this engine "
             "does not do yet)")
        context = original
    window = int(key("attention.sliding_window", 4096 if family.softcaps else 0)) if family.window_pattern else 0
    if arch == "exaone4":  # llama.cpp slides only the 32B's layers (64 of them), by 4096 unless the file says
        window = int(key("attention.sliding_window", 4096)) if layers == 64 else 0
    layer_types = None
    if window:  # llama.cpp: layer il slides if il % n < n - 1 (n: the family's pattern), or the file's flags
        pattern = key("attention.sliding_window_pattern", family.window_pattern)
        flags = pattern if isinstance(pattern, list) else [il % pattern < pattern - 1 for il in range(layers)]
        layer_types = ["sliding_attention" if f else "full_attention" for f in flags]
    nope = [i for i in range(layers) if (i + 1) % 4 == 0] if family.nope else None  # (llama.cpp: every 4th)
    rotates = key("attention.rope_pattern", [])  # (Granite SWA: False where a layer has no rope)
    if rotates:
        nope = [i for i, r in enumerate(rotates[:layers]) if not r] or None
    if family.nope_full and layer_types:  # (EXAONE 4: the full layers have no rope)
        nope = [i for i, kind in enumerate(layer_types) if kind == "full_attention"]
    big = layers == {"gemma2": 46, "gemma3": 62}.get(arch)  # llama.cpp's 27B: the query scale of hidden / heads
    granite = family.multipliers  # its scales, as llama.cpp reads them (the logit scale required)
    return make_config(
        path, vocab_size=int(key("vocab_size", 0) or tokens_count(reader, path)),
        hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=int(key("attention.head_count_kv", heads)), head_dim=head_dim,
        intermediate_size=int(key("feed_forward_length")), max_position_embeddings=context,
        rope_theta=float(key("rope.freq_base", 10000.0)), rotary_dim=rope_dim if rope_dim != head_dim else None,
        rope_layout="interleaved" if family.glm or family.cohere else "half",  # (llama.cpp's "norm" rope: q/k as made)
        rope_scaling=scaling,
        rope_local_theta=float(key("rope.freq_base_swa", family.local_theta or key("rope.freq_base", 10000.0)))
        if family.local_rope and window else None,
        attn_scale=float(key("attention.scale")) if granite and key("attention.scale", 0.0) else (
            (hidden // heads) ** -0.5 if big else None),
        embed_scale=math.sqrt(hidden) if family.gemma else (float(key("embedding_scale", 0.0)) or None),
        residual_scale=float(key("residual_scale", 0.0) or 1.0), logits_divisor=float(key("logit_scale"))
        if granite else 1 / float(key("logit_scale")) if family.cohere else 1.0,
        nope_layers=nope,
        attn_softcap=float(key("attn_logit_softcapping", 50.0)) if family.softcaps else None,
        sliding_window=window or None, layer_types=layer_types, qkv_bias="blk.0.attn_q.bias" in tensors,
        norm_eps=float(key("attention.layer_norm_epsilon") if family.cohere or family.stablelm else
                       key("attention.layer_norm_rms_epsilon", 1e-5)),
        norm="layernorm" if family.cohere or family.stablelm else "rmsnorm",
        parallel_residual=family.cohere or family.stablelm and "blk.0.ffn_norm.weight" not in tensors,  # (one norm)
        qk_norm=("per_channel" if family.stablelm else family.qk_norm if family.qk_norm != "none" else "shared")
        if "blk.0.attn_q_norm.weight" in tensors else "none", qk_norm_after_rope=family.norm_after_rope,
        mlp="geglu" if family.gemma else family.mlp, pre_norms=family.pre_norms,
        post_norms=family.post_norms, norm_gain_in_float32=family.norm_gain_in_float32,  # (Gemma's 1 + w: baked in)
        tie_word_embeddings="output.weight" not in tensors or arch in ("gemma", "gemma2", "cohere2", "command-r"),
        final_softcap=float(key("final_logit_softcapping", 30.0 if family.softcaps else 0.0)) or None,
        attn_sinks="blk.0.attn_sinks.weight" in tensors)


def read_gptneox_config(reader, arch: str, tensors: dict, path: str) -> DenseConfig:
    """GPT-NeoX (Pythia): layer norms and biases everywhere, q|k|v fused, a plain GELU MLP, a part of each head
    rotated, the two branches in parallel unless the file says otherwise (its own reader for folders: no family)."""
    def key(name: str, default=None):
        return field(reader, f"{arch}.{name}", default, path)

    hidden, heads = int(key("embedding_length")), int(key("attention.head_count"))
    rope_dim = int(key("rope.dimension_count", hidden // heads))
    return make_config(
        path, vocab_size=int(key("vocab_size", 0) or tokens_count(reader, path)), hidden_size=hidden,
        num_hidden_layers=int(key("block_count")), num_attention_heads=heads, num_key_value_heads=heads,
        head_dim=hidden // heads,
        intermediate_size=int(key("feed_forward_length")), max_position_embeddings=int(key("context_length", 2048)),
        rope_theta=float(key("rope.freq_base", 10000.0)), rotary_dim=rope_dim if rope_dim != hidden // heads else None,
        norm="layernorm", norm_eps=float(key("attention.layer_norm_epsilon")), mlp="gelu", bias=True,
        parallel_residual=bool(key("use_parallel_residual", True)), tie_word_embeddings="output.weight" not in tensors)


def read_state_config(reader, arch: str, tensors: dict, path: str) -> DenseConfig:
    """The config of a qwen35, lfm2 or granitehybrid file, as llama.cpp's model code reads it. qwen35: Gated
    DeltaNet layers (ssm.*: key heads = group_count, value heads = time_step_rank, Dk = state_size, Dv = inner_size /
    value heads) where attention.recurrent_layers marks them (or all but every full_attention_interval-th),
    full-attention layers with an output gate, partial rotary (rope.dimension_sections: text has one position in
    every section, plain rope), norms with their 1 + w baked in, and nextn_predict_layers MTP layers counted in
    block_count (a draft's: Checkpoint.mtp). lfm2: short-conv layers where attention.head_count_kv is 0, conv width
    shortconv.l_cache.
    granitehybrid: Mamba2 layers where it is 0 (the module's docstring says the rest)."""
    def key(name: str, default=None):
        return field(reader, f"{arch}.{name}", default, path)

    if int(key("expert_count", 0)):
        raise CheckpointError(f"{path}: GGUF metadata {arch}.expert_count {key('expert_count')}: a mixture of experts; "
                              "this engine runs dense models only")
    if int(key("attention.sliding_window", 0)):
        raise CheckpointError(f"{path}: GGUF metadata {arch}.attention.sliding_window: sliding-window attention is not "
                              f"supported for {arch}")
    hidden, heads = int(key("embedding_length")), int(key("attention.head_count"))
    layers = int(key("block_count")) - int(key("nextn_predict_layers", 0))
    head_dim = int(key("attention.key_length", hidden // max(heads, 1)))
    if int(key("attention.value_length", head_dim)) != head_dim:
        raise CheckpointError(f"{path}: GGUF metadata {arch}.attention.value_length differs from key_length")
    rope_dim, context = int(key("rope.dimension_count", head_dim)), int(key("context_length", 2048))
    if rope_scaling(reader, arch, tensors, path, context, rope_dim) is not None:
        raise CheckpointError(f"{path}: GGUF metadata {arch}.rope.scaling.type: only plain rope for {arch}")
    kv = key("attention.head_count_kv", heads)
    kv = [int(n) for n in kv] if isinstance(kv, list) else [int(kv)] * layers  # (per layer: 0 for a state layer)
    if arch == "lfm2":
        types = ["conv" if n == 0 else "full_attention" for n in kv[:layers]]
        values = {"conv_kernel": int(key("shortconv.l_cache")), "qk_norm": "shared"}
    elif arch == "falcon-h1":  # (its multipliers folded into the weights by the converter)
        types = ["hybrid"] * layers
        values = dict(mamba_values(reader, arch, tensors, path, 0), mamba_norm="blk.0.ssm_norm.weight" in tensors)
    elif arch == "granitehybrid":
        types = ["mamba" if n == 0 else "full_attention" for n in kv[:layers]]
        values = dict(mamba_values(reader, arch, tensors, path, types.index("mamba") if "mamba" in types else 0),
                      nope_layers=None if key("rope.scaling.finetuned", True) else list(range(layers)),
                      embed_scale=float(key("embedding_scale", 1.0)), residual_scale=float(key("residual_scale", 1.0)),
                      attn_scale=float(key("attention.scale", 0.0)) or None,
                      logits_divisor=float(key("logit_scale", 1.0)), qk_norm="none")  # (llama.cpp: rope unless the
    #                                                                               file says otherwise)
    else:
        interval = int(key("full_attention_interval", 4))
        flags = key("attention.recurrent_layers", []) or [(i + 1) % interval != 0 for i in range(layers)]
        types = ["linear_attention" if recurrent else "full_attention" for recurrent in flags[:layers]]
        k_heads, v_heads = int(key("ssm.group_count")), int(key("ssm.time_step_rank"))
        inner = int(key("ssm.inner_size"))
        if not 0 < v_heads or inner % v_heads:
            raise CheckpointError(f"{path}: GGUF metadata {arch}.ssm.inner_size {inner} is not a whole number of "
                                  f"{arch}.ssm.time_step_rank {v_heads} value heads")
        # (value heads in the converter's tiled order: value head j reads key head j % key heads)
        values = {"linear_heads": (k_heads, v_heads),
                  "linear_head_dims": (int(key("ssm.state_size")), inner // v_heads),
                  "linear_tiled_values": k_heads != v_heads, "conv_kernel": int(key("ssm.conv_kernel")),
                  "attn_output_gate": True, "norm_gain_in_float32": True,  # (the gains 1 + w, in float32 as llama.cpp)
                  "qk_norm": "shared"}
    if len(types) != layers or len(kv) < layers:
        raise CheckpointError(f"{path}: GGUF metadata {arch}: {len(types)} layer kinds for {layers} layers")
    kv = [n or max(kv) or heads for n in kv[:layers]]  # (a state layer has no key/value heads: any count builds it)
    return make_config(
        path, vocab_size=int(key("vocab_size", 0) or tokens_count(reader, path)), hidden_size=hidden,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv[0] if len(set(kv)) == 1 else kv,
        head_dim=head_dim, intermediate_size=int(key("feed_forward_length")), max_position_embeddings=context,
        rope_theta=float(key("rope.freq_base", 10000.0)), rotary_dim=rope_dim if rope_dim != head_dim else None,
        layer_types=types, norm_eps=float(key("attention.layer_norm_rms_epsilon")),
        tie_word_embeddings="output.weight" not in tensors, **values)


def read_gemma4_config(reader, arch: str, tensors: dict, path: str) -> DenseConfig:
    """Gemma 4's config as llama.cpp reads it (the module's docstring says what is where), the switches the Hugging
    Face family sets (families.gemma4): attention scaled by 1, values normed, tanh-GELU gates, post-norms."""
    def key(name: str, default=None):
        return field(reader, f"{arch}.{name}", default, path)

    def per_layer(name: str, default=None) -> list[int]:
        value = key(name, default)
        return [int(n) for n in value] if isinstance(value, list) else [int(value)] * layers

    if int(key("expert_count", 0)):
        raise CheckpointError(f"{path}: GGUF metadata {arch}.expert_count {key('expert_count')}: a mixture of experts; "
                              "this engine runs dense models only")
    hidden, heads, layers = int(key("embedding_length")), int(key("attention.head_count")), int(key("block_count"))
    sliding = key("attention.sliding_window_pattern")
    if not isinstance(sliding, list) or len(sliding) < layers:
        raise CheckpointError(f"{path}: GGUF metadata {arch}.attention.sliding_window_pattern: a flag a layer expected")
    types = ["sliding_attention" if flag else "full_attention" for flag in sliding[:layers]]
    head_dim, global_dim = int(key("attention.key_length_swa")), int(key("attention.key_length"))
    for name, want in (("attention.value_length_swa", head_dim), ("attention.value_length", global_dim),
                       ("rope.dimension_count_swa", head_dim), ("rope.dimension_count", global_dim)):
        if int(key(name, want)) != want:
            raise CheckpointError(f"{path}: GGUF metadata {arch}.{name} {key(name)}: {want} expected (the layer's "
                                  "head size)")
    partial = 1.0  # the full layers rotate the pairs whose rope_freqs factor is 1; a factor of 1e30 stops a pair
    if "rope_freqs.weight" in tensors:
        factors = dequantized(tensors["rope_freqs.weight"], path)
        turned = int((factors == 1).sum())
        if len(factors) != global_dim // 2 or not (factors[:turned] == 1).all() or not (factors[turned:] > 1e20).all():
            raise CheckpointError(f"{path}: tensor 'rope_freqs.weight': factors of 1 then 1e30 expected (Gemma 4's "
                                  "partial rotation)")
        partial = 2 * turned / global_dim
    shared = int(key("attention.shared_kv_layers", 0))
    first = layers - shared
    config = make_config(
        path, vocab_size=int(key("vocab_size", 0) or tokens_count(reader, path)), hidden_size=hidden,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=per_layer("attention.head_count_kv"),
        head_dim=head_dim, global_head_dim=global_dim if "full_attention" in types else None,
        intermediate_size=per_layer("feed_forward_length"), max_position_embeddings=int(key("context_length", 131072)),
        rope_theta=float(key("rope.freq_base", 1e6)),
        rope_scaling={"rope_type": "proportional", "partial_rotary_factor": partial},
        rope_local_theta=float(key("rope.freq_base_swa", 1e4)), attn_scale=1.0,
        sliding_window=int(key("attention.sliding_window")), layer_types=types, qk_norm="shared", value_norm=True,
        keys_are_values=any(kind == "full_attention" and f"blk.{i}.attn_v.weight" not in tensors
                            for i, kind in enumerate(types[:first])),
        kv_shared_layers=shared, norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-6)),
        norm_gain_in_float32=True, mlp="geglu", post_norms=True, tie_word_embeddings="output.weight" not in tensors,
        embed_scale=hidden ** 0.5, final_softcap=float(key("final_logit_softcapping", 0.0)) or None,
        per_layer_input=int(key("embedding_length_per_layer_input", 0)), layer_scalars=True)
    for i in range(first, layers):  # llama.cpp's code reads layer first - 2 (sliding) or first - 1 (full)
        source = first - 2 if types[i] == "sliding_attention" else first - 1
        if config.kv_source(i) != source:
            raise CheckpointError(f"{path}: GGUF metadata {arch}.attention.shared_kv_layers {shared}: llama.cpp has "
                                  f"layer {i} read layer {source}'s keys, not the last earlier {types[i]} layer's")
    return config


def mamba_values(reader, arch: str, tensors: dict, path: str, block: int) -> dict:
    """A Mamba2 layer's config values from ssm.* (heads = time_step_rank, channels = inner_size / heads, groups,
    state size, conv width; the conv's bias as block `block` has it)."""
    heads, inner = int(field(reader, f"{arch}.ssm.time_step_rank", path=path)), int(
        field(reader, f"{arch}.ssm.inner_size", path=path))
    if not 0 < heads or inner % heads:
        raise CheckpointError(f"{path}: GGUF metadata {arch}.ssm.inner_size {inner} is not a whole number of "
                              f"{arch}.ssm.time_step_rank {heads} heads")
    return {"mamba_heads": (heads, inner // heads, int(field(reader, f"{arch}.ssm.group_count", path=path)),
                            int(field(reader, f"{arch}.ssm.state_size", path=path))),
            "mamba_biases": (False, f"blk.{block}.ssm_conv1d.bias" in tensors),
            "conv_kernel": int(field(reader, f"{arch}.ssm.conv_kernel", path=path))}


def nemotron_blocks(reader, arch: str, path: str) -> list[tuple[int, str]]:
    """Each block's layer in this engine and its kind ("attention", "mamba", "mlp"): a mixing block starts a layer,
    an MLP block joins the one before it."""
    blocks = int(field(reader, f"{arch}.block_count", path=path))
    listed = lambda name: [int(n) for n in field(reader, f"{arch}.{name}", path=path)]
    kv, ff = listed("attention.head_count_kv"), listed("feed_forward_length")
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


def read_nemotron_h_config(reader, arch: str, tensors: dict, path: str) -> DenseConfig:
    """Nemotron-H as llama.cpp reads it: nemotron_blocks' layers, attention without rope, squared-ReLU MLPs."""
    def key(name: str, default=None):
        return field(reader, f"{arch}.{name}", default, path)

    blocks = nemotron_blocks(reader, arch, path)
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
        path, vocab_size=int(key("vocab_size", 0) or tokens_count(reader, path)), hidden_size=hidden,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv[0] if len(set(kv)) == 1 else kv,
        head_dim=int(key("attention.key_length", hidden // heads)), intermediate_size=widths,
        max_position_embeddings=int(key("context_length", 4096)), layer_types=kinds, mlp="relu2",
        nope_layers=None if key("rope.scaling.finetuned", True) else list(range(layers)),
        norm_eps=float(key("attention.layer_norm_epsilon", key("attention.layer_norm_rms_epsilon", 1e-5))),
        norm_gain_in_float32=True, tie_word_embeddings="output.weight" not in tensors,
        **mamba_values(reader, arch, tensors, path, first))


def rope_scaling(reader, arch: str, tensors: dict, path: str, context: int, rope_dim: int) -> dict | None:
    """Llama 3.x's rope_freqs tensor, Phi-3's LongRoPE factor tensors, or a linear rope.scaling.factor."""
    def key(name: str, default=None):
        return field(reader, f"{arch}.{name}", default, path)

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
        mscale = rope_scalings.yarn_mscale(factor) / (rope_scalings.yarn_mscale(factor, log_mul) if log_mul else 1.0)
        return {"rope_type": "yarn", "factor": factor, "beta_fast": float(key("rope.scaling.yarn_beta_fast", 32.0)),
                "beta_slow": float(key("rope.scaling.yarn_beta_slow", 1.0)),
                "original_max_position_embeddings": int(key("rope.scaling.original_context_length", context)),
                "attention_factor": mscale * float(key("rope.scaling.attn_factor", 1.0))}
    raise CheckpointError(f"{path}: GGUF metadata {arch}.rope.scaling.type {kind!r} is not supported (linear, yarn, "
                          "and the factor tensors of Llama 3 and Phi-3)")


def read_gguf(path: str) -> Checkpoint:
    """A GGUF file as a Checkpoint: the weights dequantized with gguf's own dequantizer, each tensor's GGUF type, and
    for Q4_0 / Q4_1 linears their blocks as int4-g32 tensors (int4_tensors)."""
    reader = open_gguf(path)
    arch = field(reader, "general.architecture", path=path)
    if arch not in ARCHITECTURES:
        raise CheckpointError(f"{path}: GGUF architecture {arch!r} is not supported (supported: "
                              f"{', '.join(ARCHITECTURES)})")
    tensors = {t.name: t for t in reader.tensors}
    state = arch in STATE_ARCHITECTURES
    config = {"gptneox": read_gptneox_config, "gemma4": read_gemma4_config, "nemotron_h": read_nemotron_h_config}.get(
        arch, read_state_config if state else read_config)(reader, arch, tensors, path)
    grouped = nemotron_blocks(reader, arch, path) if arch == "nemotron_h" else None  # [(its layer here, kind)]

    def read(name: str, rows: torch.Tensor | None, change):
        def thunk() -> torch.Tensor:
            w = dequantized(tensors[name], path)
            w = w if rows is None else w[rows]
            return w if change is None else change(w, f"{path}: tensor {name!r}")
        return thunk

    def read_blocks(name: str, rows: torch.Tensor | None) -> Blocks:
        t = tensors[name]
        out = shape_of(t)[0]
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
        if types[native] in quantized.GGUF_TYPES and len(tensors[name].shape) == 2:
            blocks[native] = read_blocks(name, rows)
        if types[native] in quantized.EXACT_INT4_TYPES and native.startswith("layers.") and native.endswith(".weight"):
            exact[native.removesuffix(".weight")] = read_int4(name, rows)

    skip = {"rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight"}  # read into the config
    model_tensors = {"token_embd.weight": "embed_tokens.weight", "output.weight": "lm_head.weight",
                     "token_embd_norm.weight" if arch == "lfm2" else "output_norm.weight": "norm.weight",
                     "output_norm.bias": "norm.bias", "per_layer_token_embd.weight": "embed_per_layer.weight",
                     "per_layer_model_proj.weight": "per_layer_projection.weight",
                     "per_layer_proj_norm.weight": "per_layer_norm.weight"}
    extra = range(config.num_hidden_layers, int(field(reader, f"{arch}.block_count", path=path))) if grouped is None \
        else range(0)  # qwen35's MTP
    nextn = {"nextn.eh_proj.weight": "fc.weight", "nextn.enorm.weight": "norm_embedding.weight",
             "nextn.hnorm.weight": "norm_hidden.weight", "nextn.shared_head_norm.weight": "norm.weight"}
    for name in tensors:
        if name in skip:
            continue
        if name in model_tensors:
            add(model_tensors[name], name)
            continue
        prefix, layer, rest = (name.split(".", 2) + ["", ""])[:3]
        if prefix != "blk" or not layer.isdigit():
            raise CheckpointError(f"{path}: unexpected tensor {name!r} for architecture {arch!r}")
        if int(layer) in extra:  # qwen35's multi-token prediction layer: a full-attention layer (mtp.layers.J.*) and
            # nextn.* (mtp.*, as speculative.MultiTokenPredictor names them; convert.mtp_apart takes them apart)
            at = int(layer) - config.num_hidden_layers
            parts = [(nextn[rest], None, None)] if rest in nextn else state_layer_tensors(arch, config, rest)
            if parts is None:
                raise CheckpointError(f"{path}: unexpected tensor {name!r} for architecture {arch!r}")
            for native, rows, change in parts:
                add(f"mtp.{native}" if rest in nextn else f"mtp.layers.{at}.{native}", name, rows, change)
            continue
        if grouped is not None and int(layer) < len(grouped):  # (an MLP block's norm is its layer's mlp_norm)
            at, kind = grouped[int(layer)]
            layer, rest = str(at), "ffn_norm.weight" if kind == "mlp" and rest == "attn_norm.weight" else rest
        parts = None
        if int(layer) < config.num_hidden_layers and arch == "gemma4":
            parts = [(GEMMA4_TENSORS[rest], None, None)] if rest in GEMMA4_TENSORS else None
        elif int(layer) < config.num_hidden_layers:
            parts = (state_layer_tensors if state else layer_tensors)(arch, config, rest)
        if parts is None:
            raise CheckpointError(f"{path}: unexpected tensor {name!r} for architecture {arch!r}")
        for native, rows, change in parts:
            add(f"layers.{layer}.{native}", name, rows, change)
    if arch in ("gemma", "gemma2", "cohere2", "command-r"):  # llama.cpp reads the head from the embedding, whatever
        # else is there
        table.pop("lm_head.weight", None)
    if config.mlp == "xielu":  # (Apertus) its activation's parameters, a layer each, in the metadata as stored
        for key in ("alpha_p", "alpha_n", "beta", "eps"):
            values = field(reader, f"xielu.{key}", path=path)
            values = values if isinstance(values, list) else [values] * config.num_hidden_layers
            for i, value in enumerate(values[:config.num_hidden_layers]):
                shape = (1,) if key.startswith("alpha") else ()
                table[f"layers.{i}.mlp.act.{key}"] = lambda value=value, shape=shape: torch.full(shape, float(value))
    if arch == "stablelm" and config.parallel_residual:  # (StableLM 2 12B: one norm before both branches)
        for i in range(config.num_hidden_layers):
            for p in ("weight", "bias"):
                table[f"layers.{i}.mlp_norm.{p}"] = table[f"layers.{i}.attn_norm.{p}"]
    if arch in ("cohere2", "command-r"):  # layer norms without bias (zeros add nothing), one before both branches
        table["norm.bias"] = lambda C=config.hidden_size: torch.zeros(C)
        for i in range(config.num_hidden_layers):
            table[f"layers.{i}.attn_norm.bias"] = table[f"layers.{i}.mlp_norm.bias"] = table["norm.bias"]
            table[f"layers.{i}.mlp_norm.weight"] = table[f"layers.{i}.attn_norm.weight"]
    def lora_names(adapter, name: str) -> list[tuple[str, torch.Tensor | None]]:
        """A LoRA adapter's name as this table names the weight, and B's rows in its order: a llama.cpp adapter's
        GGUF names (turned q/k rows and fused tensors undone as for the base's), a Hugging Face one's as a Llama-layout
        native folder's (the base's rows here are in Hugging Face's order)."""
        if adapter.names == "peft":
            return lora.native_names(adapter, name)
        if adapter.names != arch:
            raise CheckpointError(f"--lora {adapter.path}: an adapter of architecture {adapter.names!r}, the base "
                                  f"{path} is {arch!r}")
        prefix, layer, rest = (name.split(".", 2) + ["", ""])[:3]
        parts = (state_layer_tensors if state else layer_tensors)(arch, config, rest) if prefix == "blk" else None
        if not parts or not layer.isdigit() or any(change is not None for _, _, change in parts):
            raise CheckpointError(f"--lora {adapter.path}: {name} is not an adapted weight this engine reads")
        return [(f"layers.{layer}.{native}", rows) for native, rows, _ in parts]

    table = lora.merged(table, path, lora_names)
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


# the converter's LlamaModel turns their q/k rows for its rotary's pairs
PERMUTED = ("llama", "smollm3", "granite", "granite_swa", "mistral3")


def layer_tensors(arch: str, config: DenseConfig, rest: str) -> list[tuple] | None:
    """[(native name after "layers.N.", rows or None, None)] for a layer's tensor `rest` (after "blk.N.") of the
    Llama-layout architectures; None: no such tensor. llama's q/k rows are put back in rotate-half order; a fused
    q|k|v (Phi-3's) and Phi-3's fused gate|up are split."""
    H, K, D, W = config.num_attention_heads, config.num_key_value_heads, config.head_dim, config.intermediate_size
    kind, _, suffix = rest.partition(".")
    if kind == "attn_qkv" and suffix in ("weight", "bias"):  # q | k | v (GPT-NeoX: biases too)
        return [(f"attn.q_proj.{suffix}", torch.arange(0, H * D), None),
                (f"attn.k_proj.{suffix}", torch.arange(H * D, (H + K) * D), None),
                (f"attn.v_proj.{suffix}", torch.arange((H + K) * D, (H + 2 * K) * D), None)]
    if arch in ("phi3", "glm4") and rest == "ffn_up.weight":  # gate | up
        return [("mlp.gate_proj.weight", torch.arange(0, W), None),
                ("mlp.up_proj.weight", torch.arange(W, 2 * W), None)]
    if rest == "attn_sinks.weight":  # (Granite SWA: a logit per head)
        return [("attn.sinks", None, None)]
    if arch == "seed_oss" and kind == "post_attention_norm":  # (its norm before the MLP, as llama.cpp names it)
        return [(f"mlp_norm.{suffix}", None, None)]
    if kind not in LAYER_TENSORS or suffix not in ("weight", "bias") or (
            suffix == "bias" and kind not in ("attn_q", "attn_k", "attn_v", "attn_norm", "ffn_norm")
            and not config.bias):
        return None
    if kind in ("attn_q_norm", "attn_k_norm") and config.qk_norm == "per_channel":  # ([heads, D]: rows of heads)
        return [(f"{LAYER_TENSORS[kind]}.{suffix}", None, lambda w, where: w.reshape(-1))]
    heads = {"attn_q": H, "attn_k": K}.get(kind) if arch in PERMUTED else None
    rows = unpermute(torch.arange(heads * D), heads) if heads else None
    return [(f"{LAYER_TENSORS[kind]}.{suffix}", rows, None)]


def state_layer_tensors(arch: str, config: DenseConfig, rest: str) -> list[tuple] | None:
    """[(native name after "layers.N.", rows or None, change or None)] for a layer's tensor `rest` of qwen35 or lfm2;
    None: no such tensor. What the converter changed is undone: qwen35's attn_q holds each head's D query rows then
    its D output-gate rows, ssm_a is -exp(A_log), conv kernels lost their middle dimension. (qwen35's value heads stay
    in the file's tiled order: linear_tiled_values.)"""
    native = STATE_LAYER_TENSORS[arch].get(rest)
    if native is None:
        return None
    if native.endswith("conv_weight"):
        return [(native, None, conv_kernel)]
    if native.endswith("A_log"):
        return [(native, None, a_log)]
    mamba = arch in ("granitehybrid", "nemotron_h", "falcon-h1")
    if mamba and native in ("attn.D", "attn.norm.weight", "attn.mamba.D", "attn.mamba.norm.weight"):  # ([heads, 1],
        # [groups, channels])
        return [(native, None, lambda w, where: w.reshape(-1))]
    if mamba and native in ("attn.q_proj.weight", "attn.k_proj.weight"):  # llama's turned rows
        attention = config.layer_types.index("full_attention")
        heads = config.heads(attention) if native == "attn.q_proj.weight" else config.kv_heads(attention)
        return [(native, unpermute(torch.arange(heads * config.head_dim), heads), None)]
    if arch == "qwen35" and native == "attn.q_proj.weight":  # [H * 2D, C]: per head D query rows, then D gate rows
        H, D = config.num_attention_heads, config.head_dim
        rows = torch.arange(H * 2 * D).view(H, 2, D)
        return [(native, rows[:, 0].flatten(), None), ("attn.gate_proj.weight", rows[:, 1].flatten(), None)]
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


# ----------------------------------------------------------------------------------------------------------------
# Tokenizer

LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                r"\s*[\r\n]+|\s+(?!\S)|\s+")
# Qwen2's split: as Llama 3's, but digits one at a time
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
               r"\s*[\r\n]+|\s+(?!\S)|\s+")
# Qwen3.5's: as Qwen2's, with combining marks (\p{M}) kept in words
QWEN35_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|"
                r"\s*[\r\n]+|\s+(?!\S)|\s+")


def pre_tokenizer(pre: str, path: str):
    """The pre-tokenizer llama.cpp uses for tokenizer.ggml.pre, in `tokenizers` terms."""
    from tokenizers import Regex, pre_tokenizers

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in ("default", "gpt2", "gpt-2", "olmo", "jina-es", "jina-de"):
        return byte_level
    if pre in ("smollm", "starcoder", "refact", "exaone"):  # every digit alone, then GPT-2's split (llama.cpp's REFACT)
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    split = {"llama-bpe": LLAMA3_SPLIT, "llama3": LLAMA3_SPLIT, "llama-v3": LLAMA3_SPLIT, "dbrx": LLAMA3_SPLIT,
             "smaug-bpe": LLAMA3_SPLIT, "lfm2": LLAMA3_SPLIT, "qwen2": QWEN2_SPLIT, "qwen35": QWEN35_SPLIT}.get(pre)
    if split is None:
        raise CheckpointError(f"{path}: GGUF metadata tokenizer.ggml.pre {pre!r} is not supported")
    return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


def build_tokenizer(reader, path: str):
    """A `tokenizers.Tokenizer` equal to llama.cpp's tokenizer of the file (BPE "gpt2" or SentencePiece "llama")."""
    try:
        return _build_tokenizer(reader, path)
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 (tokens or merges the tokenizers library refuses)
        raise CheckpointError(f"{path}: the GGUF's tokenizer cannot be built ({type(e).__name__}: "
                              f"{first_line(e)})") from None


def _build_tokenizer(reader, path: str):
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

    kind = field(reader, "tokenizer.ggml.model", path=path)
    tokens = field(reader, "tokenizer.ggml.tokens", path=path)
    types = field(reader, "tokenizer.ggml.token_type", [NORMAL] * len(tokens), path)
    if kind == "gpt2":
        merges = [tuple(m.split(" ", 1)) for m in field(reader, "tokenizer.ggml.merges", path=path)]
        tokenizer = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False))
        tokenizer.pre_tokenizer = pre_tokenizer(field(reader, "tokenizer.ggml.pre", "default", path), path)
        tokenizer.decoder = decoders.ByteLevel()
    elif kind == "llama":
        tokenizer = sentencepiece_tokenizer(reader, tokens, types, path)
    elif kind == "gemma4":  # BPE on the text itself: spaces as "▁", split only at newlines, <0xXX> byte fallback
        merges = [tuple(m.split(" ", 1)) for m in field(reader, "tokenizer.ggml.merges", path=path)]
        tokenizer = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False,
                                         byte_fallback=True))
        tokenizer.normalizer = normalizers.Replace(" ", "▁")
        tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r"[^\n]+|\n+"), behavior="isolated")
        tokenizer.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    else:
        raise CheckpointError(f"{path}: GGUF metadata tokenizer.ggml.model {kind!r} is not supported ('gpt2' BPE, "
                              "'llama' SentencePiece or 'gemma4' BPE)")
    # control tokens (and user-defined ones) are matched whole, before the model sees the text, as llama.cpp does
    tokenizer.add_tokens([AddedToken(t, special=ty == CONTROL, normalized=False)
                          for t, ty in zip(tokens, types) if ty in (CONTROL, USER_DEFINED)])
    bos = int(field(reader, "tokenizer.ggml.bos_token_id", -1, path))
    if add_bos(reader, path) and 0 <= bos < len(tokens):  # encode(text, add_special_tokens=True) starts with BOS
        from tokenizers import processors

        tokenizer.post_processor = processors.TemplateProcessing(single=f"{tokens[bos]} $A",
                                                                 special_tokens=[(tokens[bos], bos)])
    return tokenizer


def add_bos(reader, path: str) -> bool:
    """Whether llama.cpp starts a tokenized text with BOS: the file's add_bos_token, else yes for SentencePiece."""
    return bool(field(reader, "tokenizer.ggml.add_bos_token",
                      field(reader, "tokenizer.ggml.model", path=path) == "llama", path))


def sentencepiece_tokenizer(reader, tokens: list[str], types: list[int], path: str):
    """llama.cpp's SentencePiece tokenizer as a `tokenizers` BPE: spaces become "▁" (a "▁" before the text, and after
    every special token, when add_space_prefix), adjacent pieces merge into the highest-scoring piece first, and what
    no piece covers falls back to its UTF-8 bytes (<0xXX> tokens). A merge is ranked by the score of the piece it
    makes, so the BPE's merge order is llama.cpp's."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    scores = field(reader, "tokenizer.ggml.scores", [0.0] * len(tokens), path)
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = []
    for piece, ty in zip(tokens, types):
        if ty not in (NORMAL, USER_DEFINED) or len(piece) < 2:
            continue
        merges += [(piece[:i], piece[i:], scores[vocab[piece]]) for i in range(1, len(piece))
                   if piece[:i] in vocab and piece[i:] in vocab]
    merges.sort(key=lambda m: -m[2])  # (stable: equal scores keep the shorter left part first)
    unk = int(field(reader, "tokenizer.ggml.unknown_token_id", 0, path))
    model = models.BPE(vocab=vocab, merges=[(a, b) for a, b, _ in merges], unk_token=tokens[unk], fuse_unk=True,
                       byte_fallback=True)
    tokenizer = Tokenizer(model)
    prefix = bool(field(reader, "tokenizer.ggml.add_space_prefix", True, path))
    steps = [normalizers.Prepend("▁")] if prefix else []
    tokenizer.normalizer = normalizers.Sequence(steps + [normalizers.Replace(" ", "▁")])
    decode = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    tokenizer.decoder = decoders.Sequence(decode + ([decoders.Strip(" ", 1, 0)] if prefix else []))
    return tokenizer


# A GGUF file's recommended sampling (general.sampling.*, as llama.cpp reads them) by generation_config.json's names
SAMPLING_KEYS = {"temp": "temperature", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p", "typ_p": "typical_p",
                 "penalty_repeat": "repetition_penalty"}


def side_files(path: str) -> dict[str, str]:
    """tokenizer.json, tokenizer_config.json and generation_config.json texts for a GGUF's native folder. Building
    them takes 0.6 s for a 128K vocabulary: they are kept in the cache folder, keyed by the file (path, size, time)
    and this code, and read back by later runs (0.05 s)."""
    saved = None
    try:
        stat = os.stat(path)
        with open(__file__, "rb") as f:
            code = f.read()
        identity = json.dumps([os.path.abspath(path), stat.st_size, stat.st_mtime_ns]).encode()
        saved = os.path.join(cache_dir(), "tokenizers", hashlib.sha256(identity + code).hexdigest()[:32] + ".json")
        with open(saved, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):  # not built yet (or unreadable: built again)
        pass
    files = build_side_files(path)
    if saved is not None and unwritable_cache() is None:
        try:
            os.makedirs(os.path.dirname(saved), exist_ok=True)
            atomic_write(saved, lambda p: write_text(p, json.dumps(files), encoding="utf-8"))
        except OSError:  # a full disk: built again next time
            pass
    return files


def build_side_files(path: str) -> dict[str, str]:
    reader = open_gguf(path)
    tokens = field(reader, "tokenizer.ggml.tokens", path=path)
    types = field(reader, "tokenizer.ggml.token_type", [NORMAL] * len(tokens), path)
    bos = int(field(reader, "tokenizer.ggml.bos_token_id", -1, path))
    eos = int(field(reader, "tokenizer.ggml.eos_token_id", -1, path))
    for name, value in (("bos", bos), ("eos", eos)):
        if value >= len(tokens):
            raise CheckpointError(f"{path}: tokenizer.ggml.{name}_token_id {value} is not among the {len(tokens)} "
                                  "tokens")
    stops = [eos] if eos >= 0 else []
    stops += [i for i, (t, ty) in enumerate(zip(tokens, types))
              if ty == CONTROL and t in END_OF_TURN and i not in stops]
    arch = field(reader, "general.architecture", path=path)
    tokenizer_config = {"bos_token": tokens[bos] if bos >= 0 else None, "eos_token": tokens[eos] if eos >= 0 else None,
                        "add_bos_token": add_bos(reader, path),
                        "model_max_length": int(field(reader, f"{arch}.context_length", 2048, path))}
    template = field(reader, "tokenizer.chat_template", "", path)
    if template:
        tokenizer_config["chat_template"] = template
    generation = {"bos_token_id": bos if bos >= 0 else None, "eos_token_id": stops}
    generation.update({name: field(reader, f"general.sampling.{key}", path=path)  # (the sampling it recommends)
                       for key, name in SAMPLING_KEYS.items() if f"general.sampling.{key}" in reader.fields})
    return {"tokenizer.json": build_tokenizer(reader, path).to_str(),
            "tokenizer_config.json": json.dumps(tokenizer_config, indent=2, ensure_ascii=False) + "\n",
            "generation_config.json": json.dumps(generation, indent=2) + "\n"}
