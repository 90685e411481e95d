"""checkpoint.py: what loading needs from any checkpoint (the Checkpoint record), and the safe file operations every
reader and writer shares: JSON, memory-mapped safetensors, weights-only pickles, atomic writes, a lock file.
Stands on dense.py (CheckpointError, DenseConfig).

A Checkpoint is a config plus {native tensor name: thunk}: a thunk reads, slices or merges tensors only when called,
so loading builds the model one tensor at a time and never holds a second copy of the weights.
"""

from __future__ import annotations

import json
import os
import pickle
import tempfile
from dataclasses import dataclass, field
from typing import Callable

import torch

from dense import CheckpointError, DenseConfig


@dataclass
class Checkpoint:
    """What loading needs from any checkpoint: its config, {native tensor name: thunk} of the full-precision weights
    (empty when a folder holds only quantized variants), the declared dtype, and the native config.json's own record
    (its saved quantized variants; for a checkpoint converted from a GGUF, the source tensor types). A GGUF source
    also carries, for its Q4_0/Q4_1 linears, thunks of the int4 tensors that hold its blocks exactly."""
    path: str
    config: DenseConfig
    tensors: dict[str, Callable[[], torch.Tensor]]
    dtype: torch.dtype | None = None
    record: dict = field(default_factory=dict)
    source_types: dict[str, str] = field(default_factory=dict)  # native weight name -> GGUF tensor type
    exact_int4: dict[str, Callable[[], dict]] = field(default_factory=dict)  # linear name -> its int4 tensors

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
    except Exception as e:  # safetensors raises its own error types for bad headers and short files
        raise CheckpointError(f"{path}: not a readable safetensors file ({first_line(e)})") from None

    def reader(name: str):
        def read() -> torch.Tensor:
            try:
                return handle.get_tensor(name)
            except Exception as e:
                raise CheckpointError(f"{path}: cannot read tensor {name!r} ({first_line(e)})") from None
        return read

    return {name: reader(name) for name in names}


def first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


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
        detail = str(e).split("Unsupported")[-1].strip().splitlines()[0] if "Unsupported" in str(e) else "unsafe"
        raise CheckpointError(f"{path}: refused to unpickle: it holds something other than tensors and plain "
                              f"containers (weights_only=True; {detail})") from None
    except Exception as e:
        raise CheckpointError(f"{path}: not a readable PyTorch checkpoint ({str(e).splitlines()[0]})") from None


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
