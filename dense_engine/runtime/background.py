"""background.py: compile steps in another process while the program answers eagerly.

The first time a step is needed on a machine (or with a new model, cache size, batch or sampling kind), compiling it
takes 25-60 s. Instead of waiting, a program's steps.Steps hands the job to Compiler: a worker process (this file, run
as a script) loads the same checkpoint the same way (the program's LoadRecord, whole: quantization, dtype, the kind
of cache), rebuilds the step's arguments from their shapes, compiles the step and saves it into the cache folder.
The program answers on the eager path meanwhile and switches to the compiled step as soon as its file is there;
later processes load it. A worker outlives a short run (a one-shot --prompt), so
the next run is fast. Workers take turns (a lock), the decode step first; each step is compiled once (a lock per
step; saves are atomic, so a killed worker leaves no file a later run would mistake for complete).

DENSE_BACKGROUND_COMPILE=0 compiles in the program itself, before answering (the tests do). Stands on load.py,
caches.py, generate.py, steps.py and checkpoint.py.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time

import torch

from dense_engine.formats import load
from dense_engine.formats.checkpoint import atomic_write, locked, write_text
from dense_engine.formats.load import LoadRecord
from dense_engine.runtime import caches, generate
from dense_engine.runtime.steps import Steps, rebuild
from dense_engine.system import machine

ORDER = ("decode", "prefill", "verify")  # what a reply spends its time in first


def enabled() -> bool:
    return os.environ.get("DENSE_BACKGROUND_COMPILE", "1") != "0"


class Compiler:
    """Steps' background hook for a model loaded from a checkpoint: its load record (how to load it again, the kind
    of cache) and the cache its steps run over (batch, length)."""

    def __init__(self, record: LoadRecord, batch: int, seq_len: int, status=None) -> None:
        self.recipe = {**dataclasses.asdict(record), "path": os.path.abspath(record.path),
                       "dtype": str(record.dtype).removeprefix("torch."), "batch": batch, "seq_len": seq_len}
        self.status = status
        self.started: list[str] = []
        self.threads = torch.get_num_threads()

    def __call__(self, job: dict) -> None:
        folder = job["folder"]
        os.makedirs(os.path.join(folder, "jobs"), exist_ok=True)
        path = os.path.join(folder, "jobs", job["key"] + ".json")
        atomic_write(path, lambda p: write_text(p, json.dumps({**job, **self.recipe})))
        with open(os.path.join(folder, "jobs", "worker.log"), "a") as log:  # (the worker keeps its own handle)
            # run as a file (`ps` names it), the package and dense.py found where this process found them
            root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
            subprocess.Popen([sys.executable, os.path.abspath(__file__), folder], stdin=subprocess.DEVNULL, env=env,
                             stdout=log, stderr=log, start_new_session=True)  # (its own session: outlives this one)
        self.started.append(job["kind"])
        # the worker takes one core: this process leaves it (threads waiting at a barrier for a thread the worker
        # displaced cost 10x its decode speed on 2 cores, measured), until the steps are loaded (done())
        torch.set_num_threads(max(1, self.threads - 1))
        if self.status:
            kinds = list(dict.fromkeys(self.started))  # (a decode step per sampling kind: named once)
            self.status(f"compiling the {' and '.join(kinds)} step{'s' * (len(self.started) > 1)} in the "
                        f"background (about {job['estimate']:.0f} s; answering eagerly meanwhile)")

    def done(self) -> None:
        """Every step is loaded: this process takes all its threads again."""
        torch.set_num_threads(self.threads)


def work(folder: str) -> int:
    """The worker: compile every pending job of the folder, one worker at a time, the decode steps first."""
    jobs = os.path.join(folder, "jobs")
    with locked(os.path.join(jobs, "worker")):  # (waits for a worker already running)
        os.nice(10)
        torch.set_num_threads(1)  # one core; the program answering keeps the others (Compiler.threads)
        torch._inductor.config.compile_threads = 1
        loaded: dict = {}  # the last model loaded, by its recipe: a program's decode and prefill jobs share one load
        while True:
            pending = sorted((f for f in os.listdir(jobs) if f.endswith(".json")),
                             key=lambda f: (ORDER.index(f.split("-", 1)[0]) if f.split("-", 1)[0] in ORDER else 9, f))
            if not pending:
                return 0
            path = os.path.join(jobs, pending[0])
            with open(path) as f:
                job = json.load(f)
            try:
                compile_job(job, loaded)
            finally:
                os.unlink(path)


def compile_job(job: dict, loaded: dict) -> None:
    target = os.path.join(job["folder"], job["key"] + ".pt2")
    if machine.intact(target):
        return
    start = time.perf_counter()
    record = LoadRecord(**{f.name: job[f.name] for f in dataclasses.fields(LoadRecord)} | {
        "dtype": getattr(torch, job["dtype"]), "lora": tuple(map(tuple, job["lora"]))})
    recipe = (record, job["batch"], job["seq_len"])
    if recipe not in loaded:
        loaded.clear()  # (one model in memory at a time)
        loaded[recipe] = load.from_pretrained(record.path, record.device, record.dtype, record.quant or "none",
                                              lora=record.lora)
        caches.setup_cache(loaded[recipe], job["batch"], job["seq_len"], record.kv_dtype)
    model = loaded[recipe]
    steps = Steps(model, folder=job["folder"])
    if steps.key(job["kind"], **job["shape"]) != job["key"]:
        print(f"{job['key']}: the model loaded here differs from the program's; not compiled", flush=True)
        return
    steps.compile_now(target, job["kind"], getattr(generate, job["function"]), rebuild(job["args"], model),
                       job["shape"].get("dynamic"))
    print(f"{job['key']}: compiled in {time.perf_counter() - start:.0f} s", flush=True)


if __name__ == "__main__":
    sys.exit(work(sys.argv[1]))
