"""Compiling in the background (background.py): the program answers eagerly while a worker process compiles a step,
then switches to it; the compiled step gives eager decoding's tokens, and so does the same step loaded by a later
process; a worker killed mid-compile leaves no file a later run would take for complete."""

import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch
from conftest import ROOT, fixture_path, with_kernels

from dense_engine.formats import load
from dense_engine.formats.load import from_pretrained
from dense_engine.runtime import background, caches, generate, sampling
from dense_engine.runtime.steps import Steps

LLAMA = fixture_path("llama")


def greedy(runner: generate.Runner, ids: torch.Tensor, n: int) -> list[int]:
    caches.setup_cache(runner.model, 1, 128)
    token = sampling.sample(runner.prefill(ids, 0, None), 0.0)
    out = [int(token)]
    for i in range(n - 1):
        token = runner.decode(token, ids.shape[1] + i, None, generate.Sampling())
        out.append(int(token))
    return out


def wait_for(steps: Steps, kind: str, args: tuple, timeout: float = 240, **shape):
    """Steps.get until the background worker's step is there."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        fn = steps.get(kind, generate.decode_step, args, **shape)
        if fn is not None:
            return fn
        time.sleep(0.5)
    raise AssertionError(f"no compiled {kind} step after {timeout} s")


@pytest.mark.slow
def test_a_step_compiled_in_the_background_gives_eager_tokens_here_and_in_a_later_process(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(with_kernels(tmp_path)))  # (its worker: a process)
    record, checkpoint = load.plan(LLAMA)
    model = from_pretrained(checkpoint, quant=record.quant or "none")
    caches.setup_cache(model, 1, 128)
    notes = []
    compiler = background.Compiler(record, batch=1, seq_len=128, status=notes.append)
    steps = Steps(model, folder=str(tmp_path / "compiled"), background=compiler)
    # 36 tokens, over generate.PREFILL_CHUNK: the prompt prefills eagerly, one step (decode) is compiled
    ids = torch.tensor([[5, 17, 99, 3, 250, 7, 31, 8, 2, 77, 410, 6, 45, 90, 13, 200, 11, 4] * 2])
    want = greedy(generate.Runner(model, None), ids, 24)
    # the first use starts the worker and answers eagerly: the same tokens, at once
    start = time.monotonic()
    assert greedy(generate.Runner(model, steps), ids, 24) == want
    assert time.monotonic() - start < 10 and steps.pending and "in the background" in notes[0]
    args = (model, torch.tensor([[1]]), torch.tensor([20]), None, None, 128, "greedy", None, None, None, None, None,
            None, None)
    wait_for(steps, "decode", args, batch=1, attend=128, sampling="greedy", vocab_limit=None, ragged=False,
             per_row=False)
    assert steps.loaded == 1 and not steps.pending
    assert greedy(generate.Runner(model, steps), ids, 24) == want  # switched: the compiled step, the same tokens
    later = Steps(model, folder=str(tmp_path / "compiled"))  # a later process: loads the file
    assert greedy(generate.Runner(model, later), ids, 24) == want and later.loaded == 1 and later.compiled == 0


def saved_steps(folder) -> list:
    """The saved steps in a compiled/ folder (not the ".tmp-" file of a package a killed worker was writing)."""
    return [p for p in folder.iterdir() if p.suffix == ".pt2" and not p.name.startswith(".")]


@pytest.mark.slow
def test_a_worker_killed_while_compiling_leaves_no_broken_step(tmp_path):
    """With the background compiler on, as users run: a worker killed while compiling leaves no broken step, the next
    run compiles again and a later one loads the step (no note); a damaged saved step is one note and compiled again,
    the answer the same each time."""
    env = {**os.environ, "XDG_CACHE_HOME": str(with_kernels(tmp_path)), "DENSE_BACKGROUND_COMPILE": "1"}
    run = [sys.executable, os.path.join(ROOT, "chat.py"), "--ckpt", LLAMA, "--prompt", "hi", "--temperature", "0",
           "--max-new-tokens", "8"]
    first = subprocess.run(run, capture_output=True, text=True, env=env, check=False)
    assert first.returncode == 0 and "compiling the decode step in the background" in first.stderr
    time.sleep(4)  # the worker is loading or compiling: kill it (its own process group)
    workers = subprocess.run(["pgrep", "-f", "background.py " + str(tmp_path)], capture_output=True, text=True,
                             check=False)
    for pid in workers.stdout.split():
        os.killpg(int(pid), signal.SIGKILL)
    compiled = tmp_path / "dense-engine" / "compiled"
    for step in saved_steps(compiled):  # a step's name holds a whole step or nothing
        torch._C._aoti.AOTIModelPackageLoader(str(step), "model", False, 1, -1)
    # the next run starts the compile again and answers the same
    second = subprocess.run(run, capture_output=True, text=True, env=env, check=False)
    assert second.returncode == 0 and second.stdout == first.stdout
    assert "in the background" in second.stderr
    end = time.monotonic() + 240  # (a one-shot run compiles its decode step; its prefill runs eagerly)
    while time.monotonic() < end and len(saved_steps(compiled)) < 1:
        time.sleep(1)
    third = subprocess.run(run, capture_output=True, text=True, env=env, check=False)  # loads the step
    assert third.returncode == 0 and third.stdout == first.stdout and "background" not in third.stderr
    # a damaged saved step: one note, the answer the same (eager), and the step compiled again in the background
    (step,) = saved_steps(compiled)
    step.write_bytes(step.read_bytes()[:1000])
    fourth = subprocess.run(run, capture_output=True, text=True, env=env, check=False)
    subprocess.run(["pkill", "-f", f"background.py {tmp_path}"], check=False)
    assert fourth.returncode == 0 and fourth.stdout == first.stdout and "Traceback" not in fourth.stderr
    assert fourth.stderr.count("ignoring the saved compiled step") == 1 and "in the background" in fourth.stderr


@pytest.mark.slow
def test_the_background_note_never_lands_inside_the_answer(tmp_path):
    """On a terminal (stdout and stderr on one pty) a fresh machine's first one-shot answer starts its background
    compile after the first token: the note waits for the answer's line to end, and the answer reads whole."""
    import pexpect

    env = {**os.environ, "XDG_CACHE_HOME": str(with_kernels(tmp_path)), "DENSE_BACKGROUND_COMPILE": "1", "TERM": "dumb"}
    run = [os.path.join(ROOT, "chat.py"), "--ckpt", LLAMA, "--prompt", "hi", "--temperature", "0", "--max-new-tokens",
           "12", "--complete"]
    piped = subprocess.run([sys.executable, *run], capture_output=True, text=True, env=env,
                           check=False)  # (the answer alone)
    assert piped.returncode == 0 and piped.stdout
    subprocess.run(["pkill", "-f", f"background.py {tmp_path}"], check=False)
    for p in saved_steps(tmp_path / "dense-engine" / "compiled"):
        p.unlink()  # a fresh machine again: the next run compiles in the background too
    child = pexpect.spawn(sys.executable, run, env=env, encoding="utf-8", timeout=120, dimensions=(40, 200))
    child.expect(pexpect.EOF)
    child.close()
    subprocess.run(["pkill", "-f", f"background.py {tmp_path}"], check=False)
    screen = child.before.replace("\r\n", "\n")
    assert child.exitstatus == 0 and "in the background" in screen
    assert piped.stdout.endswith("\n") and piped.stdout in screen  # the answer whole, on its own line
    assert all(line.startswith("note: ") for line in screen.split("\n") if "note:" in line)


@pytest.mark.slow
def test_a_kv_dtype_run_compiles_in_the_background_and_the_next_run_decodes_with_the_compiled_step(tmp_path):
    """--kv-dtype int8 and bfloat16 on a float32 model, background compiles on as users run: the worker loads the
    program's model with the program's cache (its LoadRecord, whole), so the step it saves is the one the next run
    loads: that run starts no compile and answers the same text."""
    env = {**os.environ, "XDG_CACHE_HOME": str(with_kernels(tmp_path)), "DENSE_BACKGROUND_COMPILE": "1"}
    jobs = tmp_path / "dense-engine" / "compiled" / "jobs"
    for kv_dtype in ("int8", "bfloat16"):
        run = [sys.executable, os.path.join(ROOT, "chat.py"), "--ckpt", LLAMA, "--prompt", "hi", "--temperature", "0",
               "--max-new-tokens", "8", "--quant", "none", "--kv-dtype", kv_dtype, "--stats"]
        first = subprocess.run(run, capture_output=True, text=True, env=env, check=False)
        assert first.returncode == 0 and "compiling the decode step in the background" in first.stderr, first.stderr
        assert re.search(r"tok/s \(eager\), first token .*, loaded in [0-9.]+ s", first.stderr), first.stderr
        end = time.monotonic() + 300
        while time.monotonic() < end and (list(jobs.glob("*.json")) or subprocess.run(
                ["pgrep", "-f", "background.py " + str(tmp_path)], capture_output=True, check=False).returncode == 0):
            time.sleep(1)
        log = (jobs / "worker.log").read_text()
        assert "differs from the program's" not in log and "compiled in" in log, log
        second = subprocess.run(run, capture_output=True, text=True, env=env, check=False)
        assert second.returncode == 0 and second.stdout == first.stdout
        assert "background" not in second.stderr, second.stderr  # the saved step loaded: nothing left to compile
        assert "tok/s (compiled step), first token" in second.stderr, second.stderr  # (its stats line says so)
