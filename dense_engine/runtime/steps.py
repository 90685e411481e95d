"""steps.py: compiled steps, saved across processes. A step function (generate.py's decode, prefill and verify
steps) is compiled once per machine and configuration, saved in the cache folder, and loaded by every later process.

Each graph is exported (torch.export) and compiled ahead of time into an AOTInductor package (its kernels and their
C++ wrapper in one shared library, without the weights), saved under $XDG_CACHE_HOME/dense-engine/compiled/ (or
~/.cache/...), keyed by everything that shapes it (torch version, this engine's code, the model config, dtype,
quantized layouts, device, cache size, batch, bucket and sampling settings). The next process opens it in
milliseconds (no Dynamo or Inductor import, no guards: the key pins what they would check) and binds it to the model's
own tensors. A damaged or foreign file is rebuilt, with a notice. Stands on dense.py, kernels.py and checkpoint.py
(atomic writes).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import sys
import time
import types
import warnings
import zipfile
from collections.abc import Callable

import torch
from safetensors.torch import load as safetensors_load

import dense
from dense_engine.cpu import kernels
from dense_engine.formats.checkpoint import atomic_write, write_text
from dense_engine.system import machine
from dense_engine.system.errors import first_line
from dense_engine.system.machine import note

_state: dict = {}
PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # dense_engine/
# the code that shapes a graph: dense.py and layer_kinds.py (beside the package, in a clone or in site-packages) and
# these
SOURCES = (*(os.path.join(os.path.dirname(PACKAGE), name) for name in ("dense.py", "layer_kinds.py")),
           *(os.path.join(PACKAGE, "cpu", name) for name in ("quantized.py", "kernels.py", "kernels.h", "kernels.cpp",
                                                             "kernels_avx2.cpp")),
           *(os.path.join(PACKAGE, "runtime", name) for name in ("caches.py", "generate.py", "sampling.py",
                                                                "steps.py")))


def before_tracing() -> None:
    """What a trace (export, compile) needs first: the kernels' output shapes (kernels.register_shapes), and Inductor
    told to trust the CPU flags. It checks each vector instruction set by compiling and loading a probe in 6 child
    processes, 1.1 s at every process start (measured); when kernels.cpp built with -march=native, the compiler
    handles the CPU's instruction sets, and its flags (/proc/cpuinfo) say which."""
    if kernels.available():
        kernels.register_shapes()
        torch._inductor.config.cpp.vec_isa_ok = True


def code_version() -> str:
    digest = hashlib.sha256()
    for path in SOURCES:
        if os.path.isfile(path):
            with open(path, "rb") as f:
                digest.update(f.read())
    return digest.hexdigest()[:16]


def model_signature(model: dense.DenseDecoder) -> dict:
    """What a compiled step depends on besides its arguments: the config and every tensor's shape and dtype."""
    tensors = {name: [list(t.shape), str(t.dtype)] for name, t in model.named_buffers()}
    tensors.update({name: [list(t.shape), str(t.dtype)] for name, t in model.named_parameters()})
    layers = {name: type(m).__name__ + "".join(getattr(m, "kinds", ())) for name, m in model.named_modules()
              if not list(m.children())}
    return {"config": dataclasses.asdict(model.config), "tensors": tensors, "layers": layers,
            "device": model.device.type, "kernels": kernels.available() if model.device.type == "cpu" else None}


class Steps:
    """The compiled steps of one model, by (kind, batch, tokens, bucket, options): loaded from the cache folder or
    compiled there on first use. status(message) is called before a compile that will take a while.

    background(job) (programs set it: background.py): a step not compiled yet on this machine is compiled by another
    process, described by `job` (the step function's name, its arguments' shapes, the key); until its file appears,
    get() returns None and the caller runs the step eagerly, so the answer never waits for a compile."""

    def __init__(self, model: dense.DenseDecoder, status: Callable[[str], None] | None = None,
                 folder: str | None = None, background: Callable[[dict], None] | None = None,
                 saved: bool | None = None) -> None:
        self.model, self.status, self.background = model, status, background
        self.pending: set[str] = set()  # keys being compiled by a background process
        self.failed: set[str] = set()  # keys that could not be compiled here: eager
        self.folder = folder or (os.path.join(machine.cache_dir(), "compiled") if machine.unwritable_cache() is None
                                 else machine.temporary_folder("dense-steps-"))  # (packages are files: this run's)
        self.functions: dict[str, Callable] = {}
        self.base = None  # the part of the key shared by every step of this model and cache
        self.compile_s = 0.0  # seconds spent compiling (not loading) in this process
        self.loaded = self.compiled = 0
        self.decoded = {"compiled": 0, "eager": 0}  # decode and verify steps run each way (Runner counts; stats)
        self.eager: set[str] = set()  # kinds run eagerly here (a one-shot answer's one prefill: not worth a load)
        if any(getattr(m, "eager_prefill", False) for m in model.modules()):  # (a layer no prefill graph can hold)
            self.eager.add("prefill")
        # Saved steps (packages) on CPU. On CUDA, steps are compiled in the process (LazyStep): a step's worth
        # there is its CUDA graph, which is recorded per process and cannot be saved; Inductor's own caches (FX graph,
        # Triton kernels and their tuning, in torch's cache folder) make a later process's compile short. Tensor
        # parallel steps too: their graphs hold collectives of this process group.
        distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
        self.saved = model.device.type == "cpu" and not distributed if saved is None else saved

    def key(self, kind: str, **shape) -> str:
        if self.base is None or self.base[0] != (self.model.max_batch_size, self.model.max_seq_len):
            signature = {"torch": torch.__version__, "python": sys.version.split()[0], "code": code_version(),
                         "model": model_signature(self.model)}
            digest = hashlib.sha256(json.dumps(signature, sort_keys=True, default=str).encode()).hexdigest()
            self.base = ((self.model.max_batch_size, self.model.max_seq_len), digest[:24])
        detail = json.dumps(shape, sort_keys=True, default=str)
        return f"{kind}-{self.base[1]}-{hashlib.sha256(detail.encode()).hexdigest()[:16]}"

    def get(self, kind: str, fn: Callable, args: tuple, **shape) -> Callable | None:
        """The compiled step, or None: the caller runs it eagerly (while it compiles in the background, or when it
        cannot be compiled here: no working C++ compiler)."""
        if kind in self.eager:
            return None
        key = self.key(kind, **shape)
        compiled = self.functions.get(key)
        if compiled is not None or key in self.failed:
            return compiled
        path = os.path.join(self.folder, key + ".pt2")
        if self.background is not None and self.saved and self.in_background(key, path, kind, fn, args, shape):
            return None
        if key not in self.functions:
            self.functions[key] = self.load_or_compile(key, kind, fn, args, shape.get("dynamic"))
            if self.functions[key] is None:
                self.failed.add(key)
        return self.functions[key]

    def in_background(self, key: str, path: str, kind: str, fn: Callable, args: tuple, shape: dict) -> bool:
        """Whether the step is still being compiled elsewhere (then the caller runs it eagerly): started now if its file
        is missing, loaded here once the file is complete."""
        loaded = self.load(path)
        if loaded is not None:
            self.functions[key] = loaded
            self.pending.discard(key)
            if not self.pending and hasattr(self.background, "done"):
                self.background.done()
            if self.status:
                self.status(f"switched to the compiled {kind} step")
            return False
        if key not in self.pending:
            self.pending.add(key)
            self.background({"key": key, "kind": kind, "function": fn.__name__, "args": describe(args),
                             "shape": shape, "folder": self.folder, "estimate": estimate(self.folder, kind)})
        return True

    def load(self, path: str) -> Callable | None:
        """A saved step, or None when there is none: a file without its seal (a killed or failed save) or whose
        digest differs (damaged) is removed, with a note, so that it is compiled again."""
        if not os.path.exists(path) or not os.path.exists(path + ".sha256"):  # none, or still being saved
            return None
        try:
            if not machine.intact(path):
                raise ValueError("damaged: its digest is not the one written when it was saved")
            loaded = PackagedStep(path, self.model)
            self.loaded += 1
            return loaded
        except Exception as e:  # noqa: BLE001 (a damaged file, another torch or python: compile it again)
            note(f"ignoring the saved compiled step {path} ({first_line(e)}); compiling it again")
            discard(path)
            return None

    def load_or_compile(self, key: str, kind: str, fn: Callable, args: tuple, dynamic: dict | None) -> Callable | None:
        if not self.saved:
            before_tracing()
            return LazyStep(self, kind, fn)
        path = os.path.join(self.folder, key + ".pt2")
        return self.load(path) or self.compile_now(path, kind, fn, args, dynamic)

    def compile_now(self, path: str, kind: str, fn: Callable, args: tuple,
                    dynamic: dict | None = None) -> Callable | None:
        """Compile the step into a package and save it (sealed: its digest written last); None if it cannot be
        compiled here (the step then runs eagerly, with one note). dynamic: {"dims": [[argument, dim], ...], "range":
        [low, high]}, one length those dimensions share, which the graph takes at any value in the range (its code must
        not depend on the value there: export refuses code that would; the caller keeps to the range)."""
        if self.status:
            self.status(f"Compiling the {kind} step for {self.model.max_seq_len}-slot cache (once per machine; about "
                        f"{estimate(self.folder, kind):.0f} s)...")
        start = time.perf_counter()
        try:
            os.makedirs(self.folder, exist_ok=True)
            atomic_write(path, lambda tmp: package(fn, args, dynamic, tmp))
        except Exception as e:  # noqa: BLE001 (a failing C++ compiler (Inductor's), a full disk: eager, said once)
            if not _state.get("compile_failed"):
                note(f"compiling the {kind} step failed ({first_line(e)}); running eagerly (slower)")
                _state["compile_failed"] = True
            return None
        took = time.perf_counter() - start
        self.compile_s += took
        self.compiled += 1
        machine.seal(path)  # the completion marker, last
        record_seconds(self.folder, kind, took)
        return PackagedStep(path, self.model)


class Exported(torch.nn.Module):
    """A step function with its other arguments fixed (the key pins them), as torch.export takes it: forward(tensors)
    with the step's tensor arguments in order; the model's parameters and buffers are the package's constants."""

    def __init__(self, fn: Callable, args: tuple) -> None:
        super().__init__()
        self.model = next(a for a in args if isinstance(a, dense.DenseDecoder))
        self.fn, self.args = fn, args

    def forward(self, tensors: list[torch.Tensor]):
        given = iter(tensors)
        return self.fn(*(next(given) if torch.is_tensor(a) else a for a in self.args))


def package(fn: Callable, args: tuple, dynamic: dict | None, path: str) -> None:
    """Export the step and compile it ahead of time into an AOTInductor package at `path`: its kernels and their
    C++ wrapper in one shared library, without the weights (PackagedStep binds the model's own tensors). No guards, no
    Python between its kernels; a later process opens it in milliseconds, without importing Dynamo or Inductor."""
    tensors = [a for a in args if torch.is_tensor(a)]
    shapes = None
    if dynamic:
        at = {i: n for n, i in enumerate(i for i, a in enumerate(args) if torch.is_tensor(a))}  # argument -> input
        # (DYNAMIC, not a named Dim: the export's solver cannot prove some of the kernels' shape facts over the range,
        # min(16, 32 * length) == 16 among them, and a named Dim refuses them)
        length = torch.export.Dim.DYNAMIC(min=dynamic["range"][0], max=dynamic["range"][1])
        shapes = [{} for _ in tensors]
        for i, dim in dynamic["dims"]:
            shapes[at[i]][dim] = length
        shapes = ([s or None for s in shapes],)
    before_tracing()
    ir_log = logging.getLogger("torch._inductor.ir")  # its note that an op without a C shim runs through a fallback
    level = ir_log.level  # (a state layer's triangular solve) is not the user's to read
    ir_log.setLevel(logging.ERROR)
    try:
        export_and_compile(fn, args, tensors, shapes, path)
    finally:
        ir_log.setLevel(level)


def export_and_compile(fn: Callable, args: tuple, tensors: list, shapes, path: str) -> None:
    from torch._inductor import compile_fx

    made: dict = {}
    with torch.no_grad(), warnings.catch_warnings(), uncopied_buffers(compile_fx), made_constants(made):
        warnings.simplefilter("ignore", FutureWarning)  # (PyTorch's own deprecations inside export, not the user's)
        exported = torch.export.export(Exported(fn, args), (tensors,), dynamic_shapes=shapes, strict=False)
        # The constants stay out of the package: PackagedStep binds the model's tensors, whatever their size. The
        # wrapper (calls of kernels) is compiled at -O0: a third less compile time, and no slower (BENCHMARKS.md).
        torch._inductor.aoti_compile_and_package(exported, package_path=path, inductor_configs={
            "aot_inductor.package_constants_in_so": False, "aot_inductor.package_constants_on_disk_format": None,
            "aot_inductor.compile_wrapper_opt_level": "O0"})
    model = next(a for a in args if isinstance(a, dense.DenseDecoder))
    held = {t.data_ptr() for t in (*model.parameters(), *model.buffers())}
    own = {name: t.contiguous() for name, t in made.items() if t.numel() and t.data_ptr() not in held}
    if own:  # (beside the package's files, in its zip: sealed with it)
        from safetensors.torch import save

        with zipfile.ZipFile(path, "a") as archive:
            archive.writestr(MADE_CONSTANTS, save(own))


MADE_CONSTANTS = "dense_engine/made_constants.safetensors"  # (in a package's zip)


@contextlib.contextmanager
def made_constants(found: dict):
    """Records the tensors Inductor makes constants of while it compiles ({name: tensor}): the model's own, and a few
    of its own making (the group size of PyTorch's int4 CPU matmul, a 0-d tensor), which a package without constants
    does not hold and PackagedStep must bind beside the model's."""
    from torch._inductor.graph import GraphLowering

    add = GraphLowering.add_tensor_constant

    def recording(self, data, name=None):
        box = add(self, data, name)
        found[box.get_name()] = data
        return box
    GraphLowering.add_tensor_constant = recording
    try:
        yield
    finally:
        GraphLowering.add_tensor_constant = add


@contextlib.contextmanager
def uncopied_buffers(compile_fx):
    """Inductor copies each of the model's buffers before an ahead-of-time compile (their values as they were, should
    the graph write them, for constants packed into the library); quantized weights are buffers, so that was the whole
    model again in memory while a step compiled. The package holds no constants (PackagedStep binds the model's own):
    the copies are not read, and are not made."""
    clone = getattr(compile_fx, "clone_preserve_strides", None)
    if clone is not None:
        compile_fx.clone_preserve_strides = lambda tensor: tensor
    try:
        yield
    finally:
        if clone is not None:
            compile_fx.clone_preserve_strides = clone


class PackagedStep:
    """A saved step: its package opened (torch._C._aoti's loader: the shared library, no Python imports), bound to
    the model's parameters and buffers in place (user-managed: the package holds no copy, and the cache's in-place
    writes land in the model's cache). Bound again when a cache was replaced (caches.setup_cache)."""

    def __init__(self, path: str, model: dense.DenseDecoder) -> None:
        self.loader = torch._C._aoti.AOTIModelPackageLoader(path, "model", False, 1, -1)
        self.model, self.names = model, self.loader.get_constant_fqns()
        with zipfile.ZipFile(path) as archive:  # (Inductor's own constants, export_and_compile)
            made = archive.read(MADE_CONSTANTS) if MADE_CONSTANTS in archive.namelist() else None
        self.made = {} if made is None else {n: t.to(model.device) for n, t in safetensors_load(made).items()}
        self.holders = [m for m in model.modules() if hasattr(m, "memory")]
        self.bound: list = []
        self.bind()

    def bind(self) -> None:
        tensors = {f"model.{name}": t for name, t in (*self.model.named_parameters(remove_duplicate=False),
                                                        *self.model.named_buffers(remove_duplicate=False))}
        tensors.update(self.made)
        missing = [name for name in self.names if name not in tensors]
        if missing:
            raise ValueError(f"the package's constant {missing[0]} is not among the model's tensors")
        self.loader.load_constants({name: tensors[name] for name in self.names}, False, True, True)
        self.bound = [h.memory for h in self.holders]  # (and the tensors stay referenced by the model)

    def __call__(self, *args):
        if any(h.memory is not c for h, c in zip(self.holders, self.bound)):
            self.bind()
        out = self.loader.run([a for a in args if torch.is_tensor(a)])
        return out[0] if len(out) == 1 else tuple(out)


def discard(path: str) -> None:
    """A saved step and its seal, gone (a later run compiles it again)."""
    for name in (path, path + ".sha256"):
        try:
            os.unlink(name)
        except OSError:
            pass


def estimate(folder: str, kind: str) -> float:
    """How long compiling a step of this kind took last time on this machine (timings.json), or a guess."""
    try:
        with open(os.path.join(folder, "timings.json")) as f:
            return float(json.load(f)[kind])
    except (OSError, ValueError, KeyError, TypeError):
        return 40.0 if kind == "decode" else 60.0


def record_seconds(folder: str, kind: str, seconds: float) -> None:
    path = os.path.join(folder, "timings.json")
    try:
        with open(path) as f:
            timings = json.load(f)
        timings = timings if isinstance(timings, dict) else {}
    except (OSError, ValueError):
        timings = {}
    timings[kind] = round(seconds, 1)
    atomic_write(path, lambda p: write_text(p, json.dumps(timings)))


def inductor_one_rank_at_a_time(graph: torch.fx.GraphModule, inputs: list):
    """Inductor (torch.compile's backend), one process of this machine at a time: the ranks of a tensor-parallel run
    on one CPU trace the same graphs, and compiled at once each would compile them all; one after another, the first
    compiles and the others find its work in Inductor's cache (its FX graph cache) in a second or two."""
    from torch._inductor.compile_fx import compile_fx
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    try:
        import fcntl

        os.makedirs(cache_dir(), exist_ok=True)
        lock = open(os.path.join(cache_dir(), "dense-engine-compile.lock"), "a")  # noqa: SIM115 (closed by the with below)
    except (ImportError, OSError):  # (no POSIX locks, an unwritable cache: each compiles at once, as before)
        return compile_fx(graph, inputs)
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # (released when the file closes, before the graph first runs)
        return compile_fx(graph, inputs)


# How a step compiled in the process is compiled, by device: CUDA graphs on CUDA (one replay per step: a decode
# step is hundreds of small kernels, whose launches would otherwise cost more than they run).
LAZY_OPTIONS = {"cuda": {"mode": "reduce-overhead"}, "cpu": {"backend": inductor_one_rank_at_a_time}}


def tune_for_cuda() -> None:
    """gpt-fast's Inductor settings: coordinate descent tuning is what fuses a one-row matmul with the dequantizing
    of its weight (nf4 here), and a little faster everywhere."""
    torch._inductor.config.coordinate_descent_tuning = True
    torch._inductor.config.triton.unique_kernel_names = True
    torch._inductor.config.fx_graph_cache = True


class LazyStep:
    """A step compiled in this process at its first call (CUDA, tensor parallel; Steps(saved=False) on CPU). Each has
    its own copy of the step function's code: Dynamo counts a function's variants per code object, and one shared
    code object would reach its recompile limit (8) after eight buckets, batch sizes or sampling kinds."""

    def __init__(self, steps: Steps, kind: str, fn: Callable) -> None:
        self.steps, self.kind, self.first = steps, kind, True
        device = steps.model.device.type
        if device == "cuda":
            tune_for_cuda()
        own = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
        self.compiled = torch.compile(own, fullgraph=True, dynamic=False, **LAZY_OPTIONS.get(device, {}))

    def __call__(self, *args):
        if not self.first:
            return self.compiled(*args)
        steps = self.steps
        if steps.status:
            steps.status(f"Compiling the {self.kind} step for {steps.model.max_seq_len}-slot cache (this process; "
                         f"about {estimate(steps.folder, self.kind):.0f} s)...")
        start = time.perf_counter()
        out = self.compiled(*args)
        if steps.model.device.type == "cuda":
            torch.cuda.synchronize(steps.model.device)
        steps.compile_s += time.perf_counter() - start
        steps.compiled += 1
        self.first = False
        return out


def describe(args: tuple) -> list:
    """A step's arguments as JSON a background process rebuilds them from (steps are traced from shapes and dtypes,
    never values): the model, tensors by shape and dtype, Python values as they are."""
    out = []
    for a in args:
        if isinstance(a, dense.DenseDecoder):
            out.append({"model": True})
        elif torch.is_tensor(a):
            out.append({"shape": list(a.shape), "dtype": str(a.dtype).removeprefix("torch."), "device": a.device.type})
        else:
            out.append({"value": a})
    return out


def rebuild(described: list, model: dense.DenseDecoder) -> tuple:
    """describe()'s arguments again, ones in each tensor's shape (not zeros: sampling noise divides)."""
    out = []
    for d in described:
        if "model" in d:
            out.append(model)
        elif "shape" in d:
            out.append(torch.ones(d["shape"], dtype=getattr(torch, d["dtype"]), device=d["device"]))
        else:
            out.append(d["value"])
    return tuple(out)


_steps: dict[int, Steps] = {}


def forget(model: dense.DenseDecoder) -> None:
    """Drop a model's Steps (and with them the last reference this module holds to the model and its graphs)."""
    _steps.pop(id(model), None)


def steps_for(model: dense.DenseDecoder) -> Steps:
    """The Steps of a model (one per model object, so compiled steps are shared by every generate call)."""
    steps = _steps.get(id(model))
    if steps is None or steps.model is not model:
        steps = _steps[id(model)] = Steps(model)
    return steps
