"""A quantized GGUF file read into huge pages while Python is still importing torch (standard library only).

A warm one-shot spends its first second or more in `import torch`, on one core. Reading the file's blocks into the
memory a decode step streams (load.read_runs: an anonymous mapping advised for 2 MB pages) is mostly page faults and
a copy, which the kernel does with the GIL released: started first, on a thread, it costs little on a machine with a
second core. load.read_runs takes the bytes from here when they are here, and reads them itself otherwise.

Only files whose blocks the engine runs as stored are read early (nine tenths of their bytes quantized: an F16 or
F32 file is converted, and its bytes would be a second copy), and only a file well within the free memory.
"""

import mmap
import os
import struct
import sys
import threading

HUGE = 2 << 20
FLOAT_TYPES = {0, 1, 30}  # GGML's F32, F16, BF16 tensors: converted at load, not run as stored
INT4_TYPES = {2, 3}  # Q4_0, Q4_1: a file of only these loads as int4 (load.auto_mode), converted too

_reads: dict[str, "EarlyRead"] = {}


class EarlyRead:
    """A file's bytes, read on a thread into one anonymous mapping whose start is 2 MiB aligned: file offset x lies
    at mapping offset start + x. complete: read whole (False: not a file to read early, or the read failed)."""

    def __init__(self, path: str, size: int) -> None:
        self.path, self.size = path, size
        self.mapping, self.start, self.complete = None, 0, False
        self.thread = threading.Thread(target=self._read, name="dense-preread", daemon=True)
        self.thread.start()

    def _read(self) -> None:
        try:
            if quantized_share(self.path) < 0.9:
                return
            mapping = mmap.mmap(-1, self.size + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            base = _address(mapping)
            start = (base + HUGE - 1) // HUGE * HUGE - base
            mapping.madvise(mmap.MADV_HUGEPAGE, start, self.size)
            with memoryview(mapping) as whole, open(self.path, "rb", buffering=0) as f:
                view, done = whole[start:start + self.size], 0
                while done < self.size:  # (one read returns at most about 2 GB)
                    n = f.readinto(view[done:])
                    if not n:
                        return
                    done += n
                view.release()
        except (OSError, ValueError, struct.error):  # (a damaged file: the loader says what is wrong with it)
            return
        self.mapping, self.start, self.complete = mapping, start, True


def _address(mapping: mmap.mmap) -> int:
    import ctypes

    return ctypes.addressof(ctypes.c_char.from_buffer(mapping))


def quantized_share(path: str) -> float:
    """The share of a GGUF file's tensor bytes that are quantized blocks that load runs as stored (0 for anything
    else): stepping over its metadata (a vocabulary's strings one by one) to its tensor table, in a few tens of
    milliseconds."""
    scalars = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as head:
        if head[:4] != b"GGUF":
            return 0.0
        unpack = struct.unpack_from
        tensors, kvs = unpack("<QQ", head, 8)
        at = 24
        for _ in range(kvs):
            at += 8 + unpack("<Q", head, at)[0]
            kind, at = unpack("<I", head, at)[0], at + 4
            count = 1
            if kind == 9:
                kind, count = unpack("<IQ", head, at)
                at += 12
            if kind == 8:
                for _ in range(count):
                    at += 8 + unpack("<Q", head, at)[0]
            elif kind in scalars:
                at += count * scalars[kind]
            else:  # (arrays of arrays: no file of a supported family has them here)
                return 0.0
        table = []  # (offset in the data, type)
        for _ in range(tensors):
            at += 8 + unpack("<Q", head, at)[0]
            at += 4 + 8 * unpack("<I", head, at)[0]
            kind, offset = unpack("<IQ", head, at)
            table.append((offset, kind))
            at += 12
        data = (at + 31) // 32 * 32
        ends = sorted(offset for offset, _ in table)[1:] + [len(head) - data]
        sizes = dict(zip(sorted(offset for offset, _ in table), ends))
    kinds = {kind for _, kind in table} - FLOAT_TYPES
    if kinds <= INT4_TYPES:
        return 0.0
    quantized = sum(sizes[offset] - offset for offset, kind in table if kind not in FLOAT_TYPES)
    return quantized / max(1, sum(sizes[offset] - offset for offset, _ in table))

def free_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def start(path: str) -> None:
    """Begin reading a GGUF file early (Linux; nothing elsewhere)."""
    if not sys.platform.startswith("linux") or not path.endswith(".gguf") or not hasattr(mmap, "MADV_HUGEPAGE"):
        return
    try:
        size = os.path.getsize(path)
    except OSError:
        return
    if size <= free_bytes() // 2:
        _reads[os.path.realpath(path)] = EarlyRead(path, size)


def start_from_argv(argv: list[str]) -> None:
    """chat.py's runs of `--ckpt FILE.gguf` on the CPU with its blocks as stored."""
    values = {}
    for i, arg in enumerate(argv):
        name, eq, value = arg.partition("=")
        if name in ("--ckpt", "--device", "--quant") and name not in values:
            values[name] = value if eq else (argv[i + 1] if i + 1 < len(argv) else "")
    if os.environ.get("XPRE") or "--bench" in argv or "--help" in argv or "-h" in argv or "WORLD_SIZE" in os.environ:
        return
    if values.get("--device", "cpu") != "cpu" or ("--device" not in values and os.path.exists("/dev/nvidia0")):
        return
    if values.get("--quant", "auto") in ("auto", "gguf") and values.get("--ckpt"):
        start(values["--ckpt"])


def taken(path: str) -> EarlyRead | None:
    """The early read of this file once it is complete (waited for; None if there was none, or it read nothing):
    its mapping goes with it (tensors made over it keep it alive)."""
    early = _reads.pop(os.path.realpath(path), None)
    if early is None:
        return None
    early.thread.join()
    if not early.complete or os.path.getsize(path) != early.size:
        return None
    return early


def discard() -> None:
    """Forget the early reads that loading did not take (a file converted, not run as stored)."""
    _reads.clear()
