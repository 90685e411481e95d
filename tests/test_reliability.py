"""The machine around the engine, as a user meets it: prompts from stdin, runs killed at chosen moments, damaged and
stale cache files, no C++ compiler, a cache folder that cannot be written, big and dirty prompt files, signals,
the edge values of every numeric flag, and error lines that stay one line whatever the terminal's width."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import ROOT, fixture_path

CHAT = os.path.join(ROOT, "chat.py")
LLAMA = fixture_path("llama")  # ChatML template, float32 weights


def chat(*args, stdin=None, env=None, timeout=300):
    return subprocess.run([sys.executable, CHAT, *map(str, args)], capture_output=True, text=True, input=stdin,
                          cwd=ROOT, env={**os.environ, "PYTHONIOENCODING": "utf-8", **(env or {})}, timeout=timeout,
                          check=False)


GREEDY = ("--temperature", "0", "--max-new-tokens", "12")
FAST = (*GREEDY, "--no-compile")


@pytest.fixture(scope="module")
def cache():
    """The cache folder the other tests' runs share (kernels built once, the fixture's compiled steps)."""
    return os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")


@pytest.mark.slow
def test_a_prompt_from_stdin_is_what_was_typed(cache):
    env = {"XDG_CACHE_HOME": str(cache)}
    typed = chat("--ckpt", LLAMA, "--prompt", "What is the capital of France?", *FAST, env=env)
    piped = chat("--ckpt", LLAMA, "--prompt", "-", *FAST, stdin="What is the capital of France?\n", env=env)
    assert typed.returncode == piped.returncode == 0 and piped.stdout == typed.stdout  # chat: no trailing newline
    complete = ("--complete", *FAST)  # completion: echo's one newline goes; a second one stays
    plain = chat("--ckpt", LLAMA, "--prompt", "the cat sat", *complete, env=env)
    assert chat("--ckpt", LLAMA, "--prompt", "-", *complete, stdin="the cat sat\n", env=env).stdout == plain.stdout
    kept = chat("--ckpt", LLAMA, "--prompt", "the cat sat\n", *complete, env=env)
    assert chat("--ckpt", LLAMA, "--prompt", "-", *complete, stdin="the cat sat\n\n", env=env).stdout == kept.stdout
    assert kept.stdout != plain.stdout  # (the newline matters to this model: the test would see it kept wrongly)


def run_until(cmd, env, appears, timeout=120):
    """Start cmd; SIGKILL it (and its children) as soon as appears() is true; whether it was killed in time."""
    child = subprocess.Popen(cmd, env={**os.environ, **env}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             start_new_session=True, cwd=ROOT)
    end = time.monotonic() + timeout
    while time.monotonic() < end and child.poll() is None:
        if appears():
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
            return True
        time.sleep(0.01)
    child.kill()
    child.wait()
    return False


@pytest.mark.slow
def test_a_kernel_build_killed_or_damaged_is_built_again(tmp_path):
    from dense_engine.system import machine

    env = {"XDG_CACHE_HOME": str(tmp_path)}
    folder = tmp_path / "dense-engine" / "kernels"
    building = lambda: folder.exists() and any(p.name.startswith("tmp") for d in folder.iterdir() if d.is_dir()
                                                for p in d.iterdir())
    assert run_until([sys.executable, CHAT, "--ckpt", LLAMA, "--prompt", "hi", *GREEDY], env, building)
    assert not list(folder.glob("*/libdense_kernels.so"))  # nothing under the library's name
    first = chat("--ckpt", LLAMA, "--prompt", "hi", *GREEDY, "--no-compile", env=env)
    assert first.returncode == 0 and "building the CPU kernels" in first.stderr
    library = next(folder.glob("*/libdense_kernels.so"))
    assert machine.intact(str(library))
    library.write_bytes(library.read_bytes()[:4096])  # truncated: loading it would end the process with SIGBUS
    second = chat("--ckpt", LLAMA, "--prompt", "hi", *GREEDY, "--no-compile", env=env)
    assert second.returncode == 0 and second.stdout == first.stdout
    assert "damaged or incomplete; building it again" in second.stderr and "Traceback" not in second.stderr


@pytest.mark.slow
def test_a_default_model_conversion_killed_or_damaged_is_redone(tmp_path):
    """The default model's conversion (here from a tiny GGUF standing in for the wheel's): killed while fetching or
    converting, it leaves no folder under the model's name, and its temporary folder goes with the next conversion; a
    file of the converted folder truncated later is found before loading, and the folder converted again."""
    import gguf_cases

    source = str(tmp_path / "stand-in.gguf")
    gguf_cases.write("qwen2", source)
    script = (f"import sys; sys.path[:0] = [{ROOT!r}]\n"
              "from dense_engine.formats import default_model; import rich.console\n"
              f"default_model.fetch_default_gguf = lambda work: {source!r}\n"
              "print(default_model.default_checkpoint(rich.console.Console(stderr=True, soft_wrap=True)))\n")
    env = {"XDG_CACHE_HOME": str(tmp_path / "cache")}
    cache = tmp_path / "cache" / "dense-engine"
    fetching = lambda: any(cache.glob(".fetch-*"))  # (its fetch or conversion under way)
    assert run_until([sys.executable, "-c", script], env, fetching)
    assert list(cache.glob(".fetch-*")) and not (cache / "smollm2-135m-instruct").exists()
    run = lambda: subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                                 env={**os.environ, **env}, check=False)
    done = run()
    assert done.returncode == 0 and not list(cache.glob(".fetch-*"))  # the killed run's folder is gone
    folder = cache / "smollm2-135m-instruct"
    assert (folder / ".complete").exists()
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    again = run()
    assert again.returncode == 0 and "incomplete or damaged; converting it again" in again.stderr
    assert weights.stat().st_size == json.loads((folder / ".complete").read_text())["model.safetensors"]


@pytest.mark.slow
def test_without_a_compiler_the_answer_comes_from_pytorchs_kernels(tmp_path, cache):
    bare = tmp_path / "bin"  # a PATH with no compiler on it
    bare.mkdir()
    with_compiler = chat("--ckpt", LLAMA, "--prompt", "hi", *GREEDY, env={"XDG_CACHE_HOME": str(cache)})
    result = chat("--ckpt", LLAMA, "--prompt", "hi", *GREEDY, env={"XDG_CACHE_HOME": str(tmp_path / "c"),
                                                                   "PATH": str(bare), "CXX": ""}, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "no C++ compiler" in result.stderr and result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
    assert result.stdout == with_compiler.stdout  # float32: the same math either way


@pytest.mark.slow
def test_a_cache_folder_that_cannot_be_written_still_answers(tmp_path, cache):
    (tmp_path / "dense-engine").write_text("a file where the folder should be")
    want = chat("--ckpt", LLAMA, "--prompt", "hi", *GREEDY, "--no-compile", env={"XDG_CACHE_HOME": str(cache)})
    result = chat("--ckpt", LLAMA, "--prompt", "hi", *GREEDY, env={"XDG_CACHE_HOME": str(tmp_path)})
    assert result.returncode == 0 and result.stdout == want.stdout
    assert "cannot be written" in result.stderr and "Traceback" not in result.stderr
    notes = [line for line in result.stderr.splitlines() if line.startswith("note:")]
    assert len(notes) <= 2  # the folder, once (the kernels built aside say so too), never a line per file


def prompt_file(path, junk_lines: int) -> list[int]:
    """Valid prompts among junk: invalid JSON, blank lines, objects without a prompt, a line of 300000 characters
    (too long for the context), bytes that are not UTF-8. Returns the valid lines' numbers."""
    good, number = [], 0
    with open(path, "wb") as f:
        def line(data: bytes):
            nonlocal number
            number += 1
            f.write(data + b"\n")
            return number
        for i in range(6):
            good.append(line(json.dumps({"prompt": f"item {i}"}).encode()))
            line(b"")
            line(b'{"prompt": 3}')
            line(b"\xff\xfe not utf-8")
            for _ in range(junk_lines // 6):
                line(b"{" + b"x" * 2000)
            good.append(line(f"plain prompt {i}".encode()))
        line(b"word " * 60000)
    return good


@pytest.mark.slow
def test_big_dirty_prompt_files_stream_in_bounded_memory(tmp_path, cache):
    env = {"XDG_CACHE_HOME": str(cache)}
    rss = {}
    for junk in (600, 6000):  # 1.2 MB and 12 MB of junk
        path = tmp_path / f"p{junk}.jsonl"
        good = prompt_file(path, junk)
        run = subprocess.Popen([sys.executable, "-c", (
            # (at exit: chat.py leaves without the interpreter's teardown, but runs atexit's handlers)
            "import atexit, resource, runpy, sys; sys.argv = sys.argv[1:]\n"
            "atexit.register(lambda: print('maxrss', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, "
            "file=sys.stderr))\n"
            "runpy.run_path(sys.argv[0], run_name='__main__')"),
            CHAT, "--ckpt", LLAMA, "--prompt-file", str(path), "--complete", *GREEDY, "--no-compile"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, **env}, cwd=ROOT)
        out, err = run.communicate(timeout=300)
        assert run.returncode == 0, err[-2000:]
        records = [json.loads(line) for line in out.splitlines()]
        assert [r["line"] for r in records] == good and [r["index"] for r in records] == sorted(
            r["index"] for r in records)
        reported = [line for line in err.splitlines() if "skipped" in line]
        assert all(line.startswith(str(path)) for line in reported)
        assert any("not valid JSON" in line for line in reported) and any("not UTF-8" in line for line in reported)
        assert any("the prompt has" in line for line in reported)
        rss[junk] = int(err.rsplit("maxrss", 1)[1].split()[0]) * 1024
    assert rss[6000] - rss[600] < 8 * 2**20  # 10.8 MB more input: not held in memory


@pytest.mark.slow
def test_sigterm_mid_prompt_file_leaves_whole_lines(tmp_path, cache):
    path = tmp_path / "p.txt"
    path.write_text("".join(f"prompt number {i}\n" for i in range(400)))
    run = subprocess.Popen([sys.executable, CHAT, "--ckpt", LLAMA, "--prompt-file", str(path), "--complete",
                            "--temperature", "0", "--max-new-tokens", "30", "--batch-size", "2", "--no-compile"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           env={**os.environ, "XDG_CACHE_HOME": str(cache)}, cwd=ROOT)
    first = run.stdout.readline()  # the first batch is written: now stop it
    run.send_signal(signal.SIGTERM)
    start = time.monotonic()
    rest, err = run.communicate(timeout=30)
    assert time.monotonic() - start < 5 and run.returncode == 128 + signal.SIGTERM
    assert "Traceback" not in err
    lines = (first + rest).splitlines()
    assert lines and all(json.loads(line)["prompt"].startswith("prompt number") for line in lines)


@pytest.mark.slow
def test_sigterm_and_sighup_mid_reply_restore_the_terminal(cache):
    import pexpect

    for sig in (signal.SIGTERM, signal.SIGHUP):
        child = pexpect.spawn(sys.executable, [CHAT, "--ckpt", LLAMA, "--max-new-tokens", "120", "--temperature",
                                               "0"], cwd=ROOT, env={**os.environ, "XDG_CACHE_HOME": str(cache),
                                                                    "TERM": "xterm"}, encoding="utf-8", timeout=120)
        child.expect(">>> ")
        before = subprocess.run(["stty", "-g"], stdin=child.child_fd, capture_output=True, text=True,
                                check=False).stdout
        child.sendline("tell me a long story")
        time.sleep(0.5)
        child.kill(sig)
        child.expect(pexpect.EOF, timeout=10)
        child.close()
        assert child.exitstatus == 128 + sig and "Traceback" not in child.before
        del before  # (the pty is gone with the child: what it restored shows in the exit status and output)


@pytest.mark.parametrize("flags, meaning", [
    (["--max-seq-len", "0"], "--max-seq-len: must be at least 1"),
    (["--max-seq-len", "-5"], "--max-seq-len: must be at least 1"),
    (["--max-seq-len", "100000000"], "exceeds the model's context"),
    (["--max-new-tokens", "0"], "--max-new-tokens: must be at least 1"),
    (["--max-new-tokens", "1000000000"], None),  # as many as the context leaves
    (["--speculate-k", "0", "--lookup"], "--speculate-k: must be at least 1"),
    (["--speculate-k", "100000", "--lookup"], "--speculate-k must be at most 64"),
    (["--batch-size", "0"], "--batch-size: must be at least 1"),
    (["--top-k", "0"], None),  # off
    (["--top-k", "-1"], "--top-k must be a whole number >= 0"),
    (["--top-k", "1000000"], None),  # more than the vocabulary: every token
    (["--seed", "-1"], None),
    (["--seed", str(2 ** 70)], "--seed must be in"),
    (["--temperature", "nan"], "--temperature must be a number >= 0"),
    (["--temperature", "inf"], "--temperature must be a number >= 0"),
    (["--top-p", "0"], "--top-p must be in (0, 1] (1: off)"),
    (["--lookup-ngram", "0", "--lookup"], "--lookup-ngram: must be at least 1"),
    (["--bench", "--runs", "0"], "--runs: must be at least 1"),
    (["--bench", "--gen-len", "0"], "--gen-len: must be at least 1"),
    (["--bench", "--prompt-len", "0"], "--prompt-len: must be at least 1"),
    (["--bench", "--peak-bw", "-3"], "--peak-bw must be a number of GB/s above 0"),
])
@pytest.mark.slow
def test_edge_values_of_numeric_flags(cache, flags, meaning):
    result = chat("--ckpt", LLAMA, "--prompt", "hi", "--temperature", "0", *flags, "--no-compile",
                  env={"XDG_CACHE_HOME": str(cache)}, timeout=120)
    if meaning is None:
        assert result.returncode == 0, result.stderr
    else:
        assert result.returncode == 2 and meaning in result.stderr and result.stderr.count("\n") == 1, result.stderr


def test_error_and_note_lines_stay_one_line_at_any_width(tmp_path, cache):
    deep = tmp_path / ("a-long-folder-name-" * 6) / ("another-long-one-" * 6)
    deep.mkdir(parents=True)
    path = deep / "prompts.jsonl"
    path.write_text('{"prompt": "hi"}\n{not json\n')
    result = chat("--ckpt", LLAMA, "--prompt-file", str(path), "--complete", *GREEDY, "--no-compile",
                  env={"XDG_CACHE_HOME": str(cache), "COLUMNS": "40", "TMPDIR": str(deep)})
    assert result.returncode == 0
    line = next(line for line in result.stderr.splitlines() if "line 2" in line)
    assert line.startswith(str(path)) and line.endswith("skipped")
