"""Files of cached keys and values: a prompt's tokens and each layer's keys and values of their slots, sealed by a
digest of their bytes, and the key of the model that computed them. The server's prefix store (its disk tier and
llama-server's slot files) and chat.py (/save beside a conversation, --prompt-cache) write and read them; a file is
used only by the model, quantization, dtype, cache layout and CPU kernels that wrote it, and never for other
tokens."""

from __future__ import annotations

import hashlib
import os
import threading

import torch

from dense_engine.cpu import kernels


PARTS = ("k", "v", "k_scale", "v_scale")  # a layer's tensors of a cache's slots (its slots(): dim 1 the slots)


def write(path: str, tokens: list[int], layers: list[tuple[torch.Tensor, ...]],
          metadata: dict | None = None) -> int:
    """The file: the tokens and each layer's keys and values (safetensors: no code in it), with a digest of their
    bytes in its metadata; a temporary file, then renamed into place. Its size in bytes."""
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
    """(tokens, each layer's (k, v), metadata) of a file write() wrote, its layers shaped as `like`'s but for
    the slots (dim 1); ValueError when it is not whole (its digest), not such a file, or another cache's."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(path, "pt") as f:
            tensors = {name: f.get_tensor(name) for name in f.keys()}
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


def first_words(e: Exception) -> str:
    return " ".join(str(e).split())[:120]


def tensors_digest(tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(tensors):
        h.update(name.encode())
        h.update(tensors[name].contiguous().view(-1).view(torch.uint8).numpy())
    return h.hexdigest()


def model_key(model) -> str:
    """What the keys and values its cache holds depend on: every weight's bytes (quantized ones as quantized), the
    config, the cache's class and dtype, and on CPU the kernels that compute them (kernels.build_key: a prefix an
    AVX2 build wrote is not read back by an AVX-512 one, whose answers would then depend on it). (Hashing the weights
    reads them once: 0.1 s for 100 MB.)"""
    cache = model.layers[0].attn.kv_cache
    built = kernels.build_key() if cache.v.device.type == "cpu" else ""
    h = hashlib.sha256(f"{type(cache).__qualname__} {cache.v.dtype} {built}".encode())
    h.update(repr(sorted(vars(model.config).items())).encode())
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if ".kv_cache." in name or name.startswith("rotary") or name == "kv_slots":
            continue  # (the cache itself and its position tables)
        h.update(f"{name} {t.dtype} {list(t.shape)}".encode())
        h.update(t.detach().to("cpu").contiguous().view(-1).view(torch.uint8).numpy())
    return h.hexdigest()[:32]


def copy_slots(model, row: int, start: int, end: int) -> list[tuple[torch.Tensor, ...]]:
    """Each layer's keys and values (and an int8 cache's scales) of row's slots start..end-1, copied to host memory
    (end and start: multiples of 16 for the CPU cache's key blocks)."""
    return [tuple(t.to("cpu", copy=True) for t in layer.attn.kv_cache.slots(row, start, end)) for layer in model.layers]


def put_slots(model, row: int, start: int, layers: list[tuple[torch.Tensor, ...]]) -> None:
    """copy_slots' copies (or a file's) into row's slots from start on."""
    for parts, layer in zip(layers, model.layers):
        layer.attn.kv_cache.put_slots(row, start, *(t.to(model.device) for t in parts))


def whole_slots(n: int) -> int:
    """The slots a file of n tokens holds: whole blocks of 16 (the CPU cache's keys come in blocks of 16 slots)."""
    return -(-n // 16) * 16


def is_cache_file(path: str) -> bool:
    """Whether path is a file of this kind (one that may be replaced by a newer one), not somebody else's."""
    from safetensors import safe_open

    try:
        with safe_open(path, "pt") as f:
            return "tokens" in f.keys() and "sha256" in (f.metadata() or {})
    except Exception:
        return False


def read_whole(path: str, like: list[tuple[torch.Tensor, ...]], key: str, room: int):
    """read() of a file holding a whole prefix (a slot's, a conversation's: not one block of it), written by the
    model whose key is `key`, of fewer than `room` tokens: (tokens, layers); ValueError saying why not."""
    tokens, layers, metadata = read(path, like)
    if metadata.get("model") != key:
        raise ValueError("saved by another model (weights, quantization or cache)")
    if any(v.shape[1] < len(tokens) for _, v in layers):
        raise ValueError("it holds fewer slots than tokens")
    if len(tokens) >= room:
        raise ValueError(f"it holds {len(tokens)} tokens; the cache holds {room - 1}")
    return tokens, layers
