"""The Python API (dense_engine.load, LLM.generate / stream, Session from Settings) against the plain path:
generate.generate's greedy tokens from the same ids, cut at the first stop token; and the README's example run."""

import os
import re
import subprocess
import sys

import pytest
import torch
from conftest import FIXTURES, ROOT

import dense_engine
from dense_engine.formats import load
from dense_engine.runtime import generate
from dense_engine.runtime.sampling import SamplerSettings
from dense_engine.system.errors import UsageError

LLAMA = os.path.join(FIXTURES, "llama")
SHELL = os.path.join(FIXTURES, "shellelastic")


def plain_tokens(ckpt: str, ids: list[int], max_new: int, stop_ids) -> list[int]:
    """Greedy tokens by the plain path (a fresh model, no kept cache), cut at the first stop id."""
    model = load.from_pretrained(ckpt)
    out = generate.generate(model, torch.tensor([ids]), max_new)[0, len(ids):].tolist()
    return next((out[:i] for i, t in enumerate(out) if t in stop_ids), out)


@pytest.fixture(scope="module")
def llm():
    return dense_engine.load(LLAMA, compile=False)


def test_generate_equals_the_plain_path(llm):
    ids = llm.encode("the cat sat on", chat=False)
    assert ids == llm.vocab.encode("the cat sat on", special=True)
    text = llm.generate("the cat sat on", max_new_tokens=20, chat=False, temperature=0)
    want = plain_tokens(LLAMA, ids, 20, llm.vocab.stop_ids)
    assert llm.session.reply_ids == want and text == llm.vocab.decode(want)
    assert llm.stats.tokens >= len(want) and llm.stats.prefilled == len(ids)


def test_the_other_samplers_reach_the_reply(llm):
    """repetition_penalty (and the other Settings fields) as keywords: the plain path's tokens under the same
    penalty; an unknown keyword is a one-line error."""
    ids = llm.encode("the cat sat on", chat=False)
    llm.session.cached = []  # (a fresh reply: the penalty's window is this call's tokens)
    llm.generate("the cat sat on", max_new_tokens=16, chat=False, temperature=0, repetition_penalty=1.5,
                 repeat_last_n=-1)
    model = load.from_pretrained(LLAMA)
    out = [int(t) for t in generate.generate_tokens(model, torch.tensor([ids]), 16,
                                                    sampler=SamplerSettings(repetition_penalty=1.5, repeat_last_n=-1))]
    want = next((out[:i] for i, t in enumerate(out) if t in llm.vocab.stop_ids), out)
    assert llm.session.reply_ids == want and want != plain_tokens(LLAMA, ids, 16, llm.vocab.stop_ids)
    assert llm.session.settings.sampler.repetition_penalty == 1.5
    llm.generate("the cat", max_new_tokens=2, chat=False)  # (a call's settings are its own)
    assert llm.session.settings.sampler.repetition_penalty == 1.0
    with pytest.raises(UsageError, match="unknown sampling"):
        llm.generate("the cat", max_new_tokens=2, chat=False, temprature=0.5)


def test_stream_and_ids_and_messages_are_one_reply(llm):
    messages = [{"role": "user", "content": "hi there"}]
    ids = llm.vocab.encode(llm.vocab.render(messages), special=False)
    assert llm.encode(messages) == ids == llm.encode("hi there")  # (text goes through the template: it has one)
    pieces = list(llm.stream(messages, max_new_tokens=16, temperature=0))
    want = plain_tokens(LLAMA, ids, 16, llm.vocab.stop_ids)
    assert llm.session.reply_ids == want and "".join(pieces) == llm.vocab.decode(want)
    assert llm.generate(ids, max_new_tokens=16, temperature=0) == "".join(pieces)  # ids as they are


def test_a_next_turn_prefills_only_its_new_tokens(llm):
    first = "the cat sat on the mat and"
    llm.generate(first, max_new_tokens=6, chat=False, temperature=0)
    longer = llm.encode(first, chat=False) + llm.session.reply_ids + llm.encode(" then", chat=False)
    text = llm.generate(longer, max_new_tokens=12, temperature=0)
    assert llm.stats.prefilled < len(longer)  # the cache kept the first prompt and its reply
    assert llm.session.reply_ids == plain_tokens(LLAMA, longer, 12, llm.vocab.stop_ids)
    assert text == llm.vocab.decode(llm.session.reply_ids)


def test_a_stream_closed_early_leaves_the_cache_right(llm):
    ids = llm.encode("once upon a time", chat=False)
    pieces = llm.stream(ids, max_new_tokens=30, temperature=0)
    next(pieces)
    pieces.close()  # the consumer stopped reading after one piece
    assert llm.session.cached == ids + llm.session.reply_ids[:len(llm.session.cached) - len(ids)]
    again = llm.generate(ids + [5, 9], max_new_tokens=10, temperature=0)
    assert llm.session.reply_ids == plain_tokens(LLAMA, ids + [5, 9], 10, llm.vocab.stop_ids)
    assert again == llm.vocab.decode(llm.session.reply_ids)


def test_a_session_from_settings_samples_like_the_plain_path():
    """Session(model, vocab, Settings(...)) with a seed draws the tokens generate.generate draws with that seed."""
    model = load.from_pretrained(SHELL)
    llm = dense_engine.load(SHELL, compile=False)
    ids = llm.encode("abc", chat=False)
    settings = dense_engine.Settings(SamplerSettings(temperature=1.5, top_k=40), max_new_tokens=24)
    session = dense_engine.Session(llm.model, llm.vocab, settings, dense_engine.LoadRecord(compile=False))
    torch.manual_seed(7)
    got, stats = session.reply(ids, lambda piece: None)
    torch.manual_seed(7)
    want = generate.generate(model, torch.tensor([ids]), 24, temperature=1.5, top_k=40)[0, len(ids):].tolist()
    want = next((want[:i] for i, t in enumerate(want) if t in llm.vocab.stop_ids), want)
    assert got == want and stats.tokens >= len(want)


def test_bad_prompts_are_one_line_errors(llm):
    with pytest.raises(UsageError, match="the prompt is empty"):
        llm.generate("", chat=False)
    with pytest.raises(UsageError, match="the cache holds"):
        llm.generate([1] * llm.session.max_seq_len)
    shell = dense_engine.load(SHELL, compile=False)  # (no chat template)
    with pytest.raises(UsageError, match="chat template"):
        shell.generate([{"role": "user", "content": "hi"}])


@pytest.mark.slow
def test_the_readme_example_runs_and_prints_the_plain_paths_text(tmp_path):
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        readme = f.read()
    section = readme[readme.index("## Python API"):]
    code = re.search(r"```python\n(.*?)```", section, re.DOTALL).group(1)
    assert 'dense_engine.load("path/to/checkpoint")' in code
    code = code.replace('"path/to/checkpoint"', f"{LLAMA!r}, compile=False")
    script = tmp_path / "example.py"
    script.write_text(code)
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, cwd=tmp_path, check=False)
    assert result.returncode == 0, result.stderr
    llm = dense_engine.load(LLAMA, compile=False)
    first = llm.generate("The capital of France is", max_new_tokens=16, chat=False, temperature=0)
    second = llm.generate([{"role": "user", "content": "And of Italy?"}], max_new_tokens=16, temperature=0)
    lines = result.stdout.split("\n")
    assert lines[0] == llm.weights and result.stdout.startswith(f"{llm.weights}\n{first}\n{second}\n")
    assert re.fullmatch(r"\d+ tokens, .* prefilled \d+ tokens", lines[-2])
