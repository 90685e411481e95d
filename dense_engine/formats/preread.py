"""A quantized GGUF file read into huge pages, for a run that decodes long (standard library only).

A decode step streams the weights a few percent faster from 2 MB pages than from the file's own 4 KB pages (measured
in BENCHMARKS.md), and the copy costs about 0.3 s a GB. Runs that decode long (chat.py's interactive mode, the
server, --bench, dense_engine.load) pay it: chat.py and serve.py start it on a thread before `import torch` (reading is
page faults and a copy, done by the kernel with the GIL released), the others when the load is planned (start_for). A
one-shot does not: its weights stay in the file's pages (load.read_runs maps the file), and its first token comes
sooner. load.read_runs takes the bytes from here when they are here.

Only files whose layers the engine runs as stored are read early: nine tenths of their bytes in block types with a
CPU kernel (quantized.GGUF_TYPES), their layers not all Q4_0/Q4_1 (those load as int4: load.auto_mode), and the
file well within the free memory. A read that loading does not take is stopped and dropped (discard).
"""

import mmap
import os
import struct
import sys
import threading

HUGE = 2 << 20
CHUNK = 64 << 20  # bytes a read call (the thread looks at `stopped` between them)
KERNEL_TYPES = {2, 3, 6, 7, 8, 12, 13, 14}  # GGML ids of quantized.GGUF_TYPES: the blocks a kernel runs as stored
INT4_TYPES = {2, 3}  # Q4_0, Q4_1: a file whose layers are all these loads as int4 (load.auto_mode), converted

_reads: dict[str, "EarlyRead"] = {}


class EarlyRead:
    """A file's bytes, read on a thread into one anonymous mapping whose start is 2 MiB aligned: file offset x lies
    at mapping offset start + x. complete: read whole (False: not a file to read early, stopped, or the read
    failed)."""

    def __init__(self, path: str, stat: os.stat_result, readers: int) -> None:
        self.path, self.size, self.stamp = path, stat.st_size, (stat.st_size, stat.st_mtime_ns)
        self.readers = readers
        self.mapping, self.start, self.complete, self.stopped = None, 0, False, False
        self.thread = threading.Thread(target=self._read, name="dense-preread", daemon=True)
        self.thread.start()

    def _read(self) -> None:
        try:
            if kernel_share(self.path) < 0.9:
                return
            mapping = mmap.mmap(-1, self.size + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            base = _address(mapping)
            start = (base + HUGE - 1) // HUGE * HUGE - base
            mapping.madvise(mmap.MADV_HUGEPAGE, start, self.size)
            share = (self.size // self.readers + HUGE - 1) // HUGE * HUGE
            slices = [(a, min(self.size, a + share)) for a in range(0, self.size, share)]
            done = [False] * len(slices)
            with memoryview(mapping) as whole:
                view = whole[start:start + self.size]
                threads = [threading.Thread(target=self._read_slice, args=(view, a, b, done, i), daemon=True)
                           for i, (a, b) in enumerate(slices[1:], 1)]
                for t in threads:
                    t.start()
                self._read_slice(view, *slices[0], done, 0)
                for t in threads:
                    t.join()
                view.release()
            if all(done):
                self.mapping, self.start, self.complete = mapping, start, True
        except Exception:  # noqa: BLE001 (a damaged file, no huge pages: the loader reads it and says what is wrong)
            return

    def _read_slice(self, view: memoryview, a: int, b: int, done: list, i: int) -> None:
        """Bytes a..b of the file into view[a:b], CHUNK at a time (stopped: left unfinished)."""
        try:
            with open(self.path, "rb", buffering=0) as f:
                f.seek(a)
                while a < b and not self.stopped:
                    n = f.readinto(view[a:min(b, a + CHUNK)])
                    if not n:
                        return
                    a += n
            done[i] = a == b
        except OSError:
            return


def _address(mapping: mmap.mmap) -> int:
    import ctypes

    return ctypes.addressof(ctypes.c_char.from_buffer(mapping))


def kernel_share(path: str) -> float:
    """The share of a GGUF file's tensor bytes in block types that load runs as stored (0 for a file whose layers
    load as int4, or for anything else): stepping over its metadata (a vocabulary's strings one by one) to its
    tensor table, in a few tens of milliseconds."""
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
        table = []  # (offset in the data, type, name)
        for _ in range(tensors):
            n = unpack("<Q", head, at)[0]
            name, at = bytes(head[at + 8:at + 8 + n]), at + 8 + n
            at += 4 + 8 * unpack("<I", head, at)[0]
            kind, offset = unpack("<IQ", head, at)
            table.append((offset, kind, name))
            at += 12
        data = (at + 31) // 32 * 32
        offsets = sorted(offset for offset, _, _ in table)
        ends = dict(zip(offsets, offsets[1:] + [len(head) - data]))
    layers = {kind for _, kind, name in table if name.startswith(b"blk.") and name.endswith(b".weight")
              and kind not in (0, 1, 30)}  # (F32, F16, BF16: norms, convs)
    if layers <= INT4_TYPES:
        return 0.0
    stored = sum(ends[offset] - offset for offset, kind, _ in table if kind in KERNEL_TYPES)
    return stored / max(1, sum(ends[offset] - offset for offset, _, _ in table))


def free_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def start(path: str, beside_import: bool = True) -> None:
    """Begin reading a GGUF file into huge pages (Linux; nothing elsewhere; a file read already is not read again).
    A reader a core (the page faults of new huge pages are most of a read's time), but the one importing torch
    (beside_import)."""
    if (not sys.platform.startswith("linux") or not path.endswith(".gguf") or not hasattr(mmap, "MADV_HUGEPAGE")
            or os.path.realpath(path) in _reads):
        return
    try:
        stat = os.stat(path)
    except OSError:
        return
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1
    if stat.st_size <= free_bytes() // 2:
        _reads[os.path.realpath(path)] = EarlyRead(path, stat, max(1, cores - beside_import))


def start_for(record) -> None:
    """The read for a planned load (load.LoadRecord) that runs a file's blocks as stored on the CPU: --bench and
    dense_engine.load, and chat.py's and serve.py's runs that did not start it before importing torch."""
    if record.path and record.device == "cpu" and record.quant == "gguf":
        start(record.path, beside_import=False)


FLAGS = ("--ckpt", "--device", "--quant")


def start_from_argv(argv: list[str]) -> None:
    """chat.py's and serve.py's runs of `--ckpt FILE.gguf` on the CPU with its blocks as stored, but a one-shot
    (`--prompt`) (the flags read as argparse reads them: the last of a repeated flag, a flag by a prefix of its
    name)."""
    values = {}
    for i, arg in enumerate(argv):
        name, eq, value = arg.partition("=")
        full = [flag for flag in FLAGS if len(name) >= 4 and flag.startswith(name)]
        if len(full) == 1:
            values[full[0]] = value if eq else (argv[i + 1] if i + 1 < len(argv) else "")
    if ("--bench" in argv or "--help" in argv or "-h" in argv or "WORLD_SIZE" in os.environ
            or any(arg == "--prompt" or arg.startswith("--prompt=") for arg in argv)):
        return
    gpu = any(os.path.exists(p) for p in ("/dev/nvidia0", "/dev/kfd"))  # (CUDA or ROCm: torch's default device)
    if values.get("--device", "cuda" if gpu else "cpu") != "cpu":
        return
    if values.get("--quant", "auto") in ("auto", "gguf") and values.get("--ckpt"):
        start(values["--ckpt"])


def held(path: str) -> int:
    """Bytes an early read of this file holds (or will): memory the load's own weights take, not memory to find."""
    early = _reads.get(os.path.realpath(path))
    return early.size if early is not None and not early.stopped else 0


def taken(path: str) -> EarlyRead | None:
    """The early read of this file once it is complete (waited for; None if there was none, or it read nothing):
    its mapping goes with it (tensors made over it keep it alive; it is never closed while they live)."""
    early = _reads.pop(os.path.realpath(path), None)
    if early is None:
        return None
    early.thread.join()
    try:
        stat = os.stat(path)
    except OSError:
        return None
    return early if early.complete and (stat.st_size, stat.st_mtime_ns) == early.stamp else None


def discard() -> None:
    """Stop and forget the early reads that loading did not take (a file converted, not run as stored)."""
    for early in _reads.values():
        early.stopped = True
    _reads.clear()
