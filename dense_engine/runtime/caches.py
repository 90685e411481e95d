"""caches.py: the home of every layer's memory between steps. dense.py keeps the plain static KVCache its lesson
needs; here are the variants a load may ask for and their layout on each device (cache_for, setup_cache), their bytes
(cache_bytes), their copies to host memory and back (copy_slots, put_slots: a server's kept prefixes, /save), and
their files (write, read: the prefix store's disk tier, llama-server's slot files, chat.py's --prompt-cache).

A layer's memory is a module on its mixer's .memory (model.mixers: a Falcon-H1 layer has two; memories(model)
lists them), which the mixer makes (setup_cache) and whose bytes it says (cache_bytes). Keys and values have
  attend(q, k, v, step, view, layer)            its part of a forward call (dense.py's NoCache and KVCache: the
                                               layer's attention over what it holds);
  slots(row, start, end) -> tuple of tensors   what it holds of row's slots start..end-1, each tensor's dim 1 its
                                               slots (or blocks of them): copies of these travel and are saved;
  put_slots(row, start, *parts)                 what slots() gave, back into row from slot start on.
Keys and values grow with the slots; a fixed-size state (layer_kinds.State, the memory of a mixer whose has_state is
True) is kept where it ends: row_states, put_row_states.

The variants: KVCache (dense.py's layout, any device), Int8KVCache (a quarter of float32's bytes), and on CPU with the
kernels CPUKVCache and CPUInt8KVCache: keys in blocks of 16 slots read by kernels.cpp's attention, which reads only
the slots each query can see.
"""

from __future__ import annotations

import hashlib
import os
import threading

import torch
from torch import nn

import dense
from dense_engine.cpu import kernels
from dense_engine.formats import lora
from dense_engine.formats.load import KV_DTYPES
from dense_engine.system import machine

# ----------------------------------------------------------------------------------------------------------------
# The variants


class KVCache(dense.KVCache):
    """dense.py's cache, [B, K, S + 1, D] keys and values, with the copies of a row's slots."""

    def slots(self, row: int, start: int, end: int) -> tuple[torch.Tensor, ...]:
        """Views of row's keys and values at slots start..end-1, [K, n, D] each."""
        return self.k[row, :, start:end], self.v[row, :, start:end]

    def put_slots(self, row: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k[row, :, start:start + k.shape[1]].copy_(k)
        self.v[row, :, start:start + v.shape[1]].copy_(v)


class ScaledSlots:
    """An int8 cache's slots(): its layout's keys and values, then their scales (dim 2 of k_scale, v_scale: slots)."""

    @staticmethod
    def bytes_for(batch: int, kv_heads: int, seq_len: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * batch * kv_heads * (seq_len + 1) * (head_dim + 4)  # int8 channels and a float32 scale

    def slots(self, row: int, start: int, end: int) -> tuple[torch.Tensor, ...]:
        return (*super().slots(row, start, end), self.k_scale[row, :, start:end], self.v_scale[row, :, start:end])

    def put_slots(self, row: int, start: int, k, v, k_scale=None, v_scale=None) -> None:
        super().put_slots(row, start, k, v)
        self.k_scale[row, :, start:start + k_scale.shape[1]].copy_(k_scale)
        self.v_scale[row, :, start:start + v_scale.shape[1]].copy_(v_scale)


def int8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (int8 [..., D], float32 scales [..., 1]): x ~ q * scale, scale = max |x| / 127 per row."""
    x = x.float()
    scale = x.abs().amax(-1, keepdim=True) / 127
    q = torch.round(x / scale.clamp_min(torch.finfo(torch.float32).tiny)).clamp_(-127, 127)
    return q.to(torch.int8), scale


class Int8KVCache(ScaledSlots, KVCache):
    """A quarter of float32's bytes (--kv-dtype int8): each key and value of a token and head as int8 channels and one
    float32 scale, max |x| / 127 (llama.cpp's q8_0 rounding, one block a head). Written quantized, read back as the
    query's dtype for the slots attended (CPUInt8KVCache's kernel reads the int8 slots instead)."""

    def __init__(self, batch: int, kv_heads: int, seq_len: int, head_dim: int, dtype, device) -> None:
        super().__init__(batch, kv_heads, seq_len, head_dim, torch.int8, device)
        shape = (batch, kv_heads, seq_len + 1, 1)
        self.register_buffer("k_scale", torch.zeros(shape, device=device), persistent=False)
        self.register_buffer("v_scale", torch.zeros(shape, device=device), persistent=False)

    def write(self, step: dense.Step, k: torch.Tensor, v: torch.Tensor) -> None:
        (qk, sk), (qv, sv) = int8_rows(k), int8_rows(v)  # [B, K, T, D] int8, [B, K, T, 1] float32
        pairs = ((self.k, qk), (self.v, qv), (self.k_scale, sk), (self.v_scale, sv))
        if step.input_pos.ndim == 1 and step.rows is None:  # every row writes the same slots
            for cache, value in pairs:
                cache[: value.shape[0]].index_copy_(2, step.input_pos, value)
            return
        rows, pos = dense.row_slots(step, k.shape[0], k.shape[2])  # [B, T] each
        for cache, value in pairs:
            cache[rows, :, pos] = value.transpose(1, 2)

    def read(self, step: dense.Step, view: dense.View, B: int) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = super().read(step, view, B)  # int8 [B, K, A or W, D]
        if view.slots is not None:  # a sliding layer's window: the scales gathered as the keys were
            index = view.slots[:, None, :, None].expand(B, self.k.shape[1], -1, 1)
            scales = [dense.cache_rows(s, step, B).gather(2, index) for s in (self.k_scale, self.v_scale)]
        else:
            scales = [dense.cache_rows(s[:, :, :view.attend], step, B) for s in (self.k_scale, self.v_scale)]
        return keys.float() * scales[0], values.float() * scales[1]


# A layer's cache beyond this is committed in 4 KB pages (CPUKVCache): in 2 MB pages every head's keys and values
# commit (and zero) a whole page at the first token, 2 MB per head and layer when a head's slots span 2 MB or more;
# the default model's 8K-slot cache committed 360 MB so, a third of a second of a one-shot's first token.
LONG_CACHE_BYTES = 4 << 20


def zeroed(shapes: list[tuple[tuple, torch.dtype]], device, huge: bool) -> list[torch.Tensor]:
    """Zero tensors of these shapes and dtypes, on CPU in one mapping committed as written (kernels.huge_pages): a
    long cache (a 128K-token context by default) is mostly never written: in 2 MB pages (huge) each head and layer
    would commit 2 MB at its first token (0.5 GiB for Llama-3.2-1B), in 4 KB pages what is used."""
    tensors = kernels.huge_pages([torch.empty(shape, dtype=dt, device="meta") for shape, dt in shapes], zeros=True,
                                 advise=huge)
    if tensors[0].device.type == "meta":  # no huge pages here
        tensors = [torch.zeros_like(t, device=device) for t in tensors]
    return tensors


class CPUKVCache(KVCache):
    """The CPU cache: keys in blocks of 16 slots, [B, K, (S + 1) / 16, D, 16], values [B, K, S + 1, D], and attention
    by kernels.cpp, which reads only the slots each query can see, each block of keys as one contiguous run (decoding
    at position p costs O(p), whatever the cache length, so a compiled step needs no buckets)."""

    def __init__(self, batch: int, kv_heads: int, seq_len: int, head_dim: int, dtype, device) -> None:
        nn.Module.__init__(self)
        blocks = (seq_len + 1 + 15) // 16
        huge = self.bytes_for(batch, kv_heads, seq_len, head_dim, dtype) <= LONG_CACHE_BYTES
        k, v = zeroed([((batch, kv_heads, blocks, head_dim, 16), dtype), ((batch, kv_heads, seq_len + 1, head_dim),
                                                                          dtype)], device, huge)
        self.register_buffer("k", k, persistent=False)
        self.register_buffer("v", v, persistent=False)

    def write(self, step: dense.Step, k: torch.Tensor, v: torch.Tensor) -> None:
        k, v = k.to(self.k.dtype), v.to(self.v.dtype)
        if step.input_pos.ndim == 1 and step.rows is None:  # every row writes the same slots
            pos, B = step.input_pos, k.shape[0]
            self.k[:B, :, pos // 16, :, pos % 16] = k.permute(2, 0, 1, 3)  # [T, B, K, D]
            self.v[:B].index_copy_(2, pos, v)
            return
        rows, pos = dense.row_slots(step, k.shape[0], k.shape[2])  # [B, T] each
        self.k[rows, :, pos // 16, :, pos % 16] = k.transpose(1, 2)  # [B, T, K, D] by (row, slot)
        self.v[rows, :, pos] = v.transpose(1, 2)

    def slots(self, row: int, start: int, end: int) -> tuple[torch.Tensor, ...]:
        """Keys [K, n / 16, D, 16] (whole blocks: start and end multiples of 16) and values [K, n, D]."""
        assert start % 16 == 0 and end % 16 == 0, (start, end)
        return self.k[row, :, start // 16:end // 16], self.v[row, :, start:end]

    def put_slots(self, row: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        assert start % 16 == 0, start
        self.k[row, :, start // 16:start // 16 + k.shape[1]].copy_(k)
        self.v[row, :, start:start + v.shape[1]].copy_(v)

    def attend(self, q, k, v, step: dense.Step, view: dense.View, layer: dense.Attention):
        softcap = getattr(layer, "softcap", None)  # (layer_kinds' soft-capped scores: the kernel caps them too)
        if getattr(layer, "sinks", None) is not None:  # (cache_for gives a model with sinks dense.py's layout)
            raise ValueError("attention sinks need dense.py's cache layout")
        if step.input_pos is None:  # a plain pass: the layer's attention on this call's own k, v
            return super().attend(q, k, v, step, view, layer)
        # Every cached step, a decode or a prefill of any length, from slot 0 or after earlier tokens, alone or
        # beside other rows: the kernel over the slots as the cache holds them. A query's result then depends on its
        # own slots only (the same bits whether its prompt went in whole, in chunks or beside others); SDPA's
        # blocking follows the number of queries and keys of the call.
        self.write(step, k, v)
        empty = step.input_pos.new_empty(0)
        start = step.row_start if step.row_start is not None else empty
        rows = step.rows if step.rows is not None else empty
        return torch.ops.dense_kernels.attention(q, self.k, self.v, step.input_pos, start, rows, layer.scale,
                                                 view.window or 0, softcap or 0.0, *self.scales())

    def scales(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The keys' and values' scales per slot (an int8 cache's), or None: the kernel reads the slots as they are."""
        return None, None


class CPUInt8KVCache(ScaledSlots, CPUKVCache):
    """CPUKVCache's layout in int8 (--kv-dtype int8, int8_rows' rounding): each key and value of a token and head as
    int8 channels times one float32 scale, a quarter of float32's bytes. The attention kernel reads the int8 slots and
    their scales (a key's score and a value's weight times its scale)."""

    def __init__(self, batch: int, kv_heads: int, seq_len: int, head_dim: int, dtype, device) -> None:
        nn.Module.__init__(self)
        blocks = (seq_len + 1 + 15) // 16
        huge = 2 * batch * kv_heads * (seq_len + 1) * head_dim <= LONG_CACHE_BYTES
        tensors = zeroed([((batch, kv_heads, blocks, head_dim, 16), torch.int8),
                          ((batch, kv_heads, seq_len + 1, head_dim), torch.int8),
                          ((batch, kv_heads, blocks * 16), torch.float32),
                          ((batch, kv_heads, blocks * 16), torch.float32)], device, huge)
        for name, t in zip(("k", "v", "k_scale", "v_scale"), tensors):
            self.register_buffer(name, t, persistent=False)

    def write(self, step: dense.Step, k: torch.Tensor, v: torch.Tensor) -> None:
        (qk, sk), (qv, sv) = int8_rows(k), int8_rows(v)  # [B, K, T, D] int8, [B, K, T, 1] float32
        sk, sv = sk[..., 0], sv[..., 0]
        if step.input_pos.ndim == 1 and step.rows is None:
            pos, B = step.input_pos, k.shape[0]
            self.k[:B, :, pos // 16, :, pos % 16] = qk.permute(2, 0, 1, 3)  # [T, B, K, D]
            self.v[:B].index_copy_(2, pos, qv)
            self.k_scale[:B].index_copy_(2, pos, sk)
            self.v_scale[:B].index_copy_(2, pos, sv)
            return
        rows, pos = dense.row_slots(step, k.shape[0], k.shape[2])  # [B, T] each
        self.k[rows, :, pos // 16, :, pos % 16] = qk.transpose(1, 2)  # [B, T, K, D] by (row, slot)
        self.v[rows, :, pos] = qv.transpose(1, 2)
        self.k_scale[rows, :, pos] = sk.transpose(1, 2)  # [B, T, K]
        self.v_scale[rows, :, pos] = sv.transpose(1, 2)

    def scales(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k_scale, self.v_scale


# ----------------------------------------------------------------------------------------------------------------
# Which cache a load gets, and its bytes


def cache_for(model: dense.DenseDecoder, kv_dtype: str = "auto") -> tuple[type, torch.dtype | None]:
    """The cache class a model's cached steps should use, and its dtype (None: the model's), as kv_dtype asks
    (--kv-dtype: one of KV_DTYPES). auto: ours on CPU for float32 models, in float32 for quantized weights too (a
    prompt's logprobs on the default model's int4 weights were 6.8e-2 nats from transformers' with bfloat16 keys and
    values, 1.4e-2 with float16, 4e-5 with float32: BENCHMARKS.md), else dense.py's layout in the model's dtype.
    int8: a quarter of float32's bytes."""
    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"kv_dtype must be one of {', '.join(KV_DTYPES)}, got {kv_dtype!r}")
    named = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}.get(kv_dtype)
    sinks = any(getattr(m, "sinks", None) is not None for m in model.mixers)  # (the kernel has none)
    if model.device.type == "cpu" and model.dtype == torch.float32 and kernels.available() and not sinks:
        return (CPUInt8KVCache, torch.int8) if kv_dtype == "int8" else (CPUKVCache, named)
    if kv_dtype == "int8":
        return Int8KVCache, torch.int8
    return KVCache, named


def memories(model: dense.DenseDecoder) -> list[nn.Module]:
    """Each layer's memory, in layer order."""
    return list(dict.fromkeys(m.memory for m in model.mixers))  # (once: a layer may read another's)


def kv_memory(model: dense.DenseDecoder) -> nn.Module | None:
    """The first attention layer's memory (its kind and dtype are every attention layer's), or None."""
    return next((m.memory for m in model.mixers if not getattr(m, "has_state", False)), None)


def state_mixers(model: dense.DenseDecoder) -> list[nn.Module]:
    """The mixers whose memory is a fixed-size state (layer_kinds.py's) rather than keys and values."""
    return [m for m in model.mixers if getattr(m, "has_state", False)]


def has_state(model: dense.DenseDecoder) -> bool:
    return bool(state_mixers(model))


def kept_memories(model: dense.DenseDecoder) -> list[nn.Module]:
    """memories(), for copies and files of a row's slots; refused in one line where a layer keeps a state (a state
    holds where it ends, not its slots: the server's prefix store keeps it at block ends, copy_keys and row_states;
    files do not yet)."""
    if has_state(model):
        raise ValueError("this model's state layers (Gated DeltaNet, short conv, Mamba2) cannot be kept per slot yet: "
                         "--prompt-cache, /save, slot files and the prefix store's disk are not available for it")
    return memories(model)


def state_buffers(model: dense.DenseDecoder) -> list[torch.Tensor]:
    return [t for m in state_mixers(model) for t in (m.memory.window, m.memory.recurrent) if t is not None]


def saved_states(model: dense.DenseDecoder, rows: int = 1) -> list[torch.Tensor]:
    """Copies of the first `rows` rows of every state layer's buffers (a speculative round's starting point, in row
    0: rejected drafts are undone by putting them back and feeding the accepted tokens again)."""
    return [t[:rows].clone() for t in state_buffers(model)]


def restore_states(model: dense.DenseDecoder, saved: list[torch.Tensor]) -> None:
    for buffer, copy in zip(state_buffers(model), saved):
        buffer[: copy.shape[0]].copy_(copy)


def cache_bytes(model: dense.DenseDecoder, batch: int, seq_len: int, dtype: torch.dtype | None = None,
                cache_class: type = KVCache) -> int:
    """The bytes of a cache of batch x seq_len tokens (+ the scratch slot) in dtype (default the model's; int8: a
    float32 scale per token and head beside), as cache_class lays it out."""
    dtype = dtype or model.dtype
    if dtype == torch.int8 and not issubclass(cache_class, ScaledSlots):
        cache_class = Int8KVCache
    return sum(m.cache_bytes(batch, seq_len, dtype, cache_class, model) for m in model.mixers)


def setup_cache(model: dense.DenseDecoder, batch: int, seq_len: int, kv_dtype: str | None = "auto") -> None:
    """model.setup_cache with the cache kv_dtype asks for on this device (cache_for; None: the kind the model holds now,
    auto before its first or after a move to another device), refused in one line when it would not fit the memory
    available."""
    now = kv_memory(model)
    if kv_dtype is None and isinstance(now, dense.KVCache) and now.v.device == model.device:
        cache_class, dtype = type(now), now.v.dtype
    else:
        cache_class, dtype = cache_for(model, kv_dtype or "auto")
    for mixer in model.mixers:  # (the old cache's memory counts as available)
        mixer.memory = dense.NoCache()
    need, have = cache_bytes(model, batch, seq_len, dtype, cache_class), machine.available_memory(model.device)
    if need > have:
        raise ValueError(f"a KV cache of {seq_len} tokens x batch {batch} needs {need / 2**30:.1f} GiB; "
                         f"{model.device.type} has {have / 2**30:.1f} GiB available (a smaller max_seq_len fits)")
    model.setup_cache(batch, seq_len, dtype, cache_class=cache_class)
    lora.size_switch(model, batch)  # (named adapters: their scales, a row each)


def fitting_cache(model: dense.DenseDecoder, batch: int = 1, asked: int | None = None, kv_dtype: str = "auto") -> int:
    """The cache's length for `batch` rows: `asked` (--max-seq-len) when given; else the model's whole context, or the
    largest power of two that fits in a quarter of the memory still available (with a note). (Its pages are
    committed only as positions are used.)"""
    if asked:
        return asked
    context = model.config.max_position_embeddings
    cache_class, dtype = cache_for(model, kv_dtype)
    budget = machine.available_memory(model.device) // 4

    def size(length: int) -> int:
        return cache_bytes(model, batch, length, dtype, cache_class)

    if size(context) <= budget:
        return context
    length = 256
    while length * 2 < context and size(length * 2) <= budget:
        length *= 2
    rows = f" x {batch} rows" if batch > 1 else ""
    machine.note(f"the cache holds {length} tokens{rows}: the model's context of {context} would need "
                 f"{size(context) / 2**30:.1f} GiB (--max-seq-len sets it)")
    return length


# ----------------------------------------------------------------------------------------------------------------
# Copies of a row's slots, to host memory and back


def copy_slots(model: dense.DenseDecoder, row: int, start: int, end: int) -> list[tuple[torch.Tensor, ...]]:
    """Each layer's memory of row's slots start..end-1, copied to host memory (end and start: multiples of 16 for
    the CPU cache's key blocks)."""
    kept_memories(model)  # (refused for a state model: its copies are copy_keys' and row_states')
    return copy_keys(model, row, start, end)


def put_slots(model: dense.DenseDecoder, row: int, start: int, layers: list[tuple[torch.Tensor, ...]]) -> None:
    """copy_slots' copies (or a file's) into row's slots from start on."""
    kept_memories(model)
    put_keys(model, row, start, layers)


def key_memories(model: dense.DenseDecoder) -> list[nn.Module]:
    """The attention layers' memories (a state model's too), in layer order."""
    return list(dict.fromkeys(m.memory for m in model.mixers if not getattr(m, "has_state", False)))


def copy_keys(model: dense.DenseDecoder, row: int, start: int, end: int) -> list[tuple[torch.Tensor, ...]]:
    """copy_slots of the attention layers alone: with row_states at a block's end, a state model's kept prefix."""
    return [tuple(t.to("cpu", copy=True) for t in memory.slots(row, start, end)) for memory in key_memories(model)]


def put_keys(model: dense.DenseDecoder, row: int, start: int, layers: list[tuple[torch.Tensor, ...]]) -> None:
    for parts, memory in zip(layers, key_memories(model)):
        memory.put_slots(row, start, *(t.to(model.device) for t in parts))


def row_states(model: dense.DenseDecoder, row: int) -> list[torch.Tensor]:
    """Copies, in host memory, of row's state buffers: the state after the last token it took."""
    return [t[row:row + 1].to("cpu", copy=True) for t in state_buffers(model)]


def put_row_states(model: dense.DenseDecoder, row: int, saved: list[torch.Tensor]) -> None:
    for buffer, copy in zip(state_buffers(model), saved):
        buffer[row:row + 1].copy_(copy)


def states_bytes(model: dense.DenseDecoder) -> int:
    """The bytes of one row's state buffers (0: a model without state layers)."""
    return sum(t[:1].numel() * t.element_size() for t in state_buffers(model))


def like(model: dense.DenseDecoder, slots: int = 0) -> list[tuple[torch.Tensor, ...]]:
    """Each layer's parts for `slots` slots (views, not copies): the shapes and dtypes a file must match."""
    return [memory.slots(0, 0, slots) for memory in kept_memories(model)]


def whole_slots(n: int) -> int:
    """The slots a file of n tokens holds: whole blocks of 16 (the CPU cache's keys come in blocks of 16 slots)."""
    return -(-n // 16) * 16


# ----------------------------------------------------------------------------------------------------------------
# Files: a prompt's tokens and each layer's memory of their slots, sealed by a digest of their bytes, with the key of
# the model that computed them. A file is used only by the model, quantization, dtype, cache layout and CPU kernels
# that wrote it, and never for other tokens.


PARTS = ("k", "v", "k_scale", "v_scale")  # the names of a layer's parts in a file, in slots() order


def write(path: str, tokens: list[int], layers: list[tuple[torch.Tensor, ...]],
          metadata: dict | None = None) -> int:
    """The file: the tokens and each layer's parts (safetensors: no code in it), with a digest of their bytes in its
    metadata; a temporary file, then renamed into place. Its size in bytes."""
    from safetensors.torch import save_file

    tensors = {"tokens": torch.tensor(tokens, dtype=torch.int32)}
    for n, parts in enumerate(layers):
        for name, t in zip(PARTS, parts):
            tensors[f"{name}.{n}"] = t.contiguous()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
    try:
        save_file(tensors, tmp, metadata={**(metadata or {}), "sha256": tensors_digest(tensors)})
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return os.path.getsize(path)


def read(path: str, like: list[tuple[torch.Tensor, ...]]) -> tuple[list[int], list, dict]:
    """(tokens, each layer's parts, metadata) of a file write() wrote, its layers shaped as `like`'s but for the slots
    (dim 1); ValueError when it is not whole (its digest), not such a file, or another cache's."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(path, "pt") as f:
            tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 (a file, not a dict)
            metadata = f.metadata() or {}
    except (SafetensorError, RuntimeError) as e:
        raise ValueError(f"not a whole file of keys and values ({first_words(e)})") from None
    names = [f"{name}.{n}" for n, parts in enumerate(like) for name in PARTS[:len(parts)]]
    if sorted(tensors) != sorted(["tokens", *names]):
        raise ValueError(f"not a file of this model's {len(like)} layers and cache")
    layers = [tuple(tensors[f"{name}.{n}"] for name in PARTS[:len(parts)]) for n, parts in enumerate(like)]
    for parts, wanted in zip(layers, like):
        if any(t.dtype != u.dtype or t.shape[:1] + t.shape[2:] != u.shape[:1] + u.shape[2:]
               for t, u in zip(parts, wanted)):
            raise ValueError("its keys and values are another cache's (shape or dtype)")
    if metadata.get("sha256") != tensors_digest(tensors):
        raise ValueError("damaged: its digest is not the one written with it")
    return tensors["tokens"].tolist(), layers, metadata


def read_whole(path: str, like: list[tuple[torch.Tensor, ...]], key: str, room: int):
    """read() of a file holding a whole prefix (a slot's, a conversation's: not one block of it), written by the
    model whose key is `key`, of fewer than `room` tokens: (tokens, layers); ValueError saying why not."""
    tokens, layers, metadata = read(path, like)
    if metadata.get("model") != key:
        raise ValueError("saved by another model (weights, quantization or cache)")
    if any(v.shape[1] < len(tokens) for _, v, *_ in layers):
        raise ValueError("it holds fewer slots than tokens")
    if len(tokens) >= room:
        raise ValueError(f"it holds {len(tokens)} tokens; the cache holds {room - 1}")
    return tokens, layers


def is_cache_file(path: str) -> bool:
    """Whether path is a file of this kind (one that may be replaced by a newer one), not somebody else's."""
    from safetensors import safe_open

    try:
        with safe_open(path, "pt") as f:
            return "tokens" in f.keys() and "sha256" in (f.metadata() or {})  # noqa: SIM118 (no __contains__)
    except Exception:  # noqa: BLE001 (an unreadable file: not one of ours)
        return False


def first_words(e: Exception) -> str:
    return " ".join(str(e).split())[:120]


def tensors_digest(tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(tensors):
        h.update(name.encode())
        h.update(tensors[name].contiguous().view(-1).view(torch.uint8).numpy())
    return h.hexdigest()


def model_key(model: dense.DenseDecoder) -> str:
    """What the memory its cache holds depends on: every weight's bytes (quantized ones as quantized), the config, the
    cache's class and dtype, and on CPU the kernels that compute them (kernels.build_key: a prefix an AVX2 build wrote
    is not read back by an AVX-512 one, whose answers would then depend on it). Hashing the weights reads them once."""
    cache = kept_memories(model)[0]
    built = kernels.build_key() if cache.v.device.type == "cpu" else ""
    h = hashlib.sha256(f"{type(cache).__qualname__} {cache.v.dtype} {built}".encode())
    h.update(repr(sorted(vars(model.config).items())).encode())
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if ".memory." in name or name.startswith("rotary") or name == "kv_slots":
            continue  # (the cache itself and its position tables)
        h.update(f"{name} {t.dtype} {list(t.shape)}".encode())
        h.update(t.detach().to("cpu").contiguous().view(-1).view(torch.uint8).numpy())
    return h.hexdigest()[:32]
