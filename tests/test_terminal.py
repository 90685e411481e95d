"""chat.py's interactive terminal (terminal.py): history and line editing, multi-line messages, /retry /undo /save
/load /set /model, Markdown while streaming, and plain output to a pipe."""

import io
import json
import os
import re
import subprocess
import sys

import pexpect
import pytest
from conftest import FIXTURES, ROOT, with_kernels

from dense_engine.cli import terminal

CHAT = os.path.join(ROOT, "chat.py")
LLAMA = os.path.join(FIXTURES, "llama")
UP = "\x1b[A"


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """One cache folder for these tests (the CPU kernels are built into it once), its history emptied per test."""
    return with_kernels(tmp_path_factory.mktemp("xdg"))


@pytest.fixture(autouse=True)
def fresh_history(cache):
    history = cache / "dense-engine" / "history"
    if history.exists():
        history.unlink()


def start(cache, *flags, term="dumb"):
    env = {**os.environ, "TERM": term, "PYTHONUNBUFFERED": "1", "COLUMNS": "200", "XDG_CACHE_HOME": str(cache)}
    child = pexpect.spawn(sys.executable, [CHAT, "--ckpt", LLAMA, "--temperature", "0", "--max-new-tokens", "8",
                                           "--no-compile", *flags], cwd=ROOT, encoding="utf-8", timeout=60, env=env,
                          dimensions=(40, 200))
    child.expect(">>> ")
    return child


def say(child, line):
    """Send a line, wait for the reply's stats line and the next prompt; the reply's text."""
    child.sendline(line)
    child.expect(r"\r\n(\d+ tokens, [^\r\n]*)\r\n")
    text = child.before.rsplit("\r\n", 1)[-1]
    child.expect(">>> ")
    return text


def saved(child, path):
    child.sendline(f"/save {path}")
    child.expect("saved")
    child.expect(">>> ")
    return json.loads(open(path).read())


def close(child):
    child.sendline("/exit")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0


def users(record):
    return [m["content"] for m in record["messages"] if m["role"] == "user"]


@pytest.mark.slow
def test_up_arrow_recalls_the_previous_message_in_this_run_and_the_next(tmp_path, cache):
    child = start(cache)
    first = say(child, "what is up")
    again = say(child, UP)  # up arrow, then enter: the same message again
    assert users(saved(child, tmp_path / "a.json")) == ["what is up", "what is up"]
    close(child)
    child = start(cache)  # a new process: the history was kept in the cache folder
    child.sendline(UP * 3)  # (the newest entries are the /exit and /save lines)
    child.expect(r"\r\n(\d+ tokens, [^\r\n]*)\r\n")
    child.expect(">>> ")
    assert users(saved(child, tmp_path / "b.json")) == ["what is up"]
    close(child)
    assert first and again
    assert os.path.isfile(cache / "dense-engine" / "history")


def test_pasted_lines_are_one_message_and_backslash_continues(tmp_path, cache):
    child = start(cache)
    child.send("line one\nline two\n")  # one write: what a paste delivers
    child.expect(r"\r\n(\d+ tokens, [^\r\n]*)\r\n")
    child.expect(">>> ")
    child.sendline("first \\")
    child.expect(r"\.\.\. ")
    say(child, "second")
    record = saved(child, tmp_path / "c.json")
    assert users(record) == ["line one\nline two", "first \nsecond"] and len(record["messages"]) == 4
    close(child)


def test_retry_regenerates_from_the_cache_and_undo_drops_the_exchange(tmp_path, cache):
    child = start(cache)
    first = say(child, "hello")
    child.sendline("/retry")
    child.expect(r"\r\n(\d+ tokens, [^\r\n]*)\r\n")
    assert "prefilled 1 tokens" in child.match.group(1)  # the conversation was not prefilled again
    retried = child.before.rsplit("\r\n", 1)[-1]
    child.expect(">>> ")
    assert retried == first  # temperature 0: the same reply
    assert len(saved(child, tmp_path / "d.json")["messages"]) == 2  # the old reply was replaced, not kept
    say(child, "and more")
    child.sendline("/undo")
    child.expect("dropped the last exchange; 2 messages left")
    child.expect(">>> ")
    assert users(saved(child, tmp_path / "e.json")) == ["hello"]
    close(child)


def test_save_then_load_in_a_new_process_continues_the_conversation(tmp_path, cache):
    child = start(cache, "--system", "be brief")
    say(child, "hello")
    record = saved(child, tmp_path / "conv.json")
    want = say(child, "how are you")
    close(child)
    assert record["system"] == "be brief" and record["sampling"]["temperature"] == 0.0
    assert record["model"] == os.path.abspath(LLAMA)
    assert os.path.exists(tmp_path / "conv.json.cache")  # (its cache beside it)
    child = start(cache, "--temperature", "1.0")  # the saved sampling settings come back with the conversation
    child.sendline(f"/load {tmp_path / 'conv.json'}")
    child.expect(r"loaded 2 messages .* and its cache \((\d+) tokens: not prefilled again\)")
    kept = int(child.match.group(1))
    child.expect(">>> ")
    assert say(child, "how are you") == want  # the same reply, from the saved cache
    child.sendline("/stats")
    child.expect(r"prefilled \d+ tokens, (\d+) from the cache")
    # the first turn's prompt came from the file (the reply's 8 tokens, decoded and encoded again, may differ)
    assert kept - 8 <= int(child.match.group(1)) <= kept
    child.expect(">>> ")
    close(child)
    child = start(cache, "--quant", "int8")  # another model: its cache is not used, the conversation is
    child.sendline(f"/load {tmp_path / 'conv.json'}")
    child.expect(r"loaded 2 messages .*its cache not used: ")
    child.expect(">>> ")
    close(child)


@pytest.mark.slow
def test_set_temperature_zero_makes_replies_deterministic(tmp_path, cache):
    child = start(cache)
    want = say(child, "tell me")
    close(child)
    child = start(cache, "--temperature", "1.5")
    child.sendline("/set temperature 0")
    child.expect("temperature = 0.0")
    child.expect(">>> ")
    assert say(child, "tell me") == want
    child.sendline("/set top-p 7")
    child.expect("top-p 7 is out of range")
    child.expect(">>> ")
    child.sendline("/model")
    child.expect(r"0\.1M parameters, 2 layers, 4 heads \(2 key/value\).*\r\n.*float32 on cpu.*\r\n.*cache \d+ tokens")
    child.expect(">>> ")
    close(child)


def test_output_to_a_pipe_carries_no_escape_codes(tmp_path, cache):
    result = subprocess.run([sys.executable, CHAT, "--ckpt", LLAMA, "--temperature", "0", "--max-new-tokens", "8",
                             "--no-compile"], input="hello\n/model\n/help\n/exit\n", capture_output=True, text=True,
                            cwd=ROOT, env={**os.environ, "XDG_CACHE_HOME": str(cache), "TERM": "xterm-256color"},
                            check=False)
    assert result.returncode == 0, result.stderr
    assert "8 tokens" in result.stdout and "/retry" in result.stdout
    assert "\x1b" not in result.stdout + result.stderr


def test_replies_render_as_markdown_while_streaming():
    from rich.console import Console

    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=60, color_system="truecolor")
    view = terminal.ReplyView(console, markdown=True)
    reply = "Here is **bold** text.\n\n- one\n- two\n\n```python\nprint(1)\n```\n"
    for i in range(0, len(reply), 3):  # a few characters a token
        view.write(reply[i:i + 3])
    view.finish("20 tokens, 1.0 tok/s")
    shown = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", out.getvalue())
    final = shown[shown.rindex("Here is"):]
    assert "bold" in final and "**" not in final and "```" not in final
    assert re.search(r"•\s*one", final) and "print(1)" in final
    assert "\x1b[" in out.getvalue()  # styled: bold, colors of the highlighted code
    plain = io.StringIO()
    view = terminal.ReplyView(Console(file=plain, force_terminal=False), markdown=False)
    for i in range(0, len(reply), 3):
        view.write(reply[i:i + 3])
    view.finish("stats")
    assert plain.getvalue() == reply + "\nstats\n"
