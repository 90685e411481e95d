"""machine.py: this machine as the engine meets it: the cache folder and the sealed files kept in it, the C++
compiler, the memory a new allocation can take, and the one-line notes the programs print on stderr (errors:
errors.py). Imports nothing of the project.
"""

from __future__ import annotations

import hashlib
import os
import sys
import tempfile

import torch

_state: dict = {}


def cache_dir() -> str:
    """The project's cache folder (built kernels, compiled steps, the default model, chat history)."""
    return os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "dense-engine")


def unwritable_cache() -> str | None:
    """Why the cache folder cannot be written (read-only, full, a file in its place), or None: then the programs
    answer without saving anything there (one note, session.py), and the kernels are built in a temporary folder."""
    if "unwritable" not in _state:
        folder = cache_dir()
        try:
            os.makedirs(folder, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=folder, prefix=".probe-"):
                pass
            _state["unwritable"] = None
        except OSError as e:
            _state["unwritable"] = e.strerror or type(e).__name__
    return _state["unwritable"]


def temporary_folder(prefix: str) -> str:
    """A folder for this run's files where the cache folder cannot be written, removed when the program exits."""
    import atexit
    import shutil

    folder = tempfile.mkdtemp(prefix=prefix)
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return folder


def compiler() -> str | None:
    """The C++ compiler the kernels and compiled steps are built with ($CXX, else c++, g++ or clang++), or None."""
    import shutil

    names = [os.environ["CXX"]] if os.environ.get("CXX") else ["c++", "g++", "clang++"]
    return next(filter(None, map(shutil.which, names)), None)


def digest(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def intact(path: str) -> bool:
    """Whether a built file is complete and undamaged: its digest is the one written beside it (path + ".sha256",
    written last, after the file is in place), so a killed build or a damaged file is never loaded (a truncated
    library would kill the process with SIGBUS inside dlopen)."""
    try:
        with open(path + ".sha256") as f:
            return f.read().strip() == digest(path)
    except OSError:
        return False


def seal(path: str) -> None:
    """Write the digest beside a file that is complete (the marker intact() checks)."""
    tmp = f"{path}.sha256.{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(digest(path))
    os.replace(tmp, path + ".sha256")


def available_memory(device: torch.device) -> int:
    """Bytes a new allocation can take on device: free GPU memory; on the CPU the OS's MemAvailable, or less under
    an address-space limit (ulimit -v). Unknown: no limit."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    have = 1 << 62
    try:
        import resource

        with open("/proc/meminfo") as f:
            have = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
        limit = resource.getrlimit(resource.RLIMIT_AS)[0]
        if limit != resource.RLIM_INFINITY:
            with open("/proc/self/status") as f:
                used = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
            have = min(have, max(0, limit - used))
    except (OSError, StopIteration, ValueError, ImportError):
        pass
    return have


def note(message: str) -> None:
    """A one-line note on stderr: something the user should know that does not stop the program."""
    print(f"note: {message}", file=sys.stderr)
