"""chat.py driven as a real program: one-shot runs, an interactive session in a pseudo-terminal, bad input."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pexpect
import pytest
import torch
from conftest import FIXTURES, ROOT, answer, fixture_path, with_kernels
from tokenizers import Tokenizer

import dense
from dense_engine.formats import convert, load
from dense_engine.formats import vocab as vocab_module
from dense_engine.formats.load import LoadRecord
from dense_engine.runtime import generate, session
from dense_engine.runtime.sampling import SamplerSettings

CHAT = os.path.join(ROOT, "chat.py")
LLAMA = os.path.join(FIXTURES, "llama")


def run_chat(*args, stdin=None):
    return subprocess.run([sys.executable, CHAT, *map(str, args)], capture_output=True, text=True, input=stdin,
                          cwd=ROOT, env={**os.environ, "PYTHONIOENCODING": "utf-8"}, check=False)


def expected_text(ckpt, ids, max_new, stop_ids):
    """generate.generate's greedy tokens after ids, cut at the first stop id, decoded."""
    model = load.from_pretrained(ckpt)
    out = generate.generate(model, torch.tensor([ids]), max_new)[0, len(ids):].tolist()
    for i, t in enumerate(out):
        if t in stop_ids:
            out = out[:i]
            break
    tok = Tokenizer.from_file(os.path.join(FIXTURES, os.path.basename(ckpt), "tokenizer.json"))
    return tok.decode(out, skip_special_tokens=True), out


@pytest.mark.slow
def test_one_shot_completion_equals_generate():
    ckpt = os.path.join(FIXTURES, "shellelastic")
    tok = Tokenizer.from_file(os.path.join(ckpt, "tokenizer.json"))
    ids = tok.encode("the cat sat").ids
    want, _ = expected_text(ckpt, ids, 24, set())
    result = run_chat("--ckpt", ckpt, "--prompt", "the cat sat", "--max-new-tokens", 24, "--temperature", 0)
    assert result.returncode == 0, result.stderr
    assert result.stdout == answer(want) and result.stderr == ""
    # stdout and stderr into one pipe (2>&1): the stats line follows the answer on a line of its own
    merged = subprocess.run([sys.executable, CHAT, "--ckpt", ckpt, "--prompt", "the cat sat", "--max-new-tokens", "24",
                             "--temperature", "0", "--stats"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, cwd=ROOT, env={**os.environ, "PYTHONIOENCODING": "utf-8"}, check=False)
    head, stats = merged.stdout.rstrip("\n").rsplit("\n", 1)
    assert merged.returncode == 0 and head.endswith(want), merged.stdout
    assert re.fullmatch(r"24 tokens, .*, loaded in [\d.]+ s", stats), merged.stdout


@pytest.mark.slow
def test_one_shot_chat_renders_template_and_stops_at_eos():
    tok = Tokenizer.from_file(os.path.join(LLAMA, "tokenizer.json"))
    config = json.loads(Path(LLAMA, "tokenizer_config.json").read_text())
    from jinja2 import Template

    text = Template(config["chat_template"]).render(messages=[{"role": "user", "content": "hi there"}],
                                                    add_generation_prompt=True)
    ids = tok.encode(text, add_special_tokens=False).ids
    stops = {tok.token_to_id("<|im_end|>"), 2}
    want, _ = expected_text(LLAMA, ids, 40, stops)
    result = run_chat("--ckpt", LLAMA, "--prompt", "-", "--max-new-tokens", 40, "--temperature", 0, "--stats",
                      stdin="hi there")
    assert result.returncode == 0, result.stderr
    assert result.stdout == answer(want)
    assert re.search(rf"\d+ tokens, .* tok/s( \([^)]*\))?, first token \d+ ms, prefilled {len(ids)} tokens",
                     result.stderr)


def test_prompt_cache_starts_a_one_shot_run_from_the_saved_prompt(tmp_path):
    """--prompt-cache FILE: the first run writes its prompt's cache, a second run with a longer prompt that starts
    with it prefills only the rest and prints what a run without the file prints; a file that is not a prompt cache
    is refused and left as it was; another model's file is not used (a note) and written again."""
    cache = tmp_path / "p.cache"
    flags = ["--ckpt", LLAMA, "--complete", "--max-new-tokens", 12, "--temperature", 0, "--stats", "--no-compile"]
    head = "the cat sat on the mat and looked at the dog"
    first = run_chat(*flags, "--prompt", head, "--prompt-cache", cache)
    assert first.returncode == 0, first.stderr and cache.exists()
    n = int(re.search(r"prefilled (\d+) tokens", first.stderr).group(1))
    second = run_chat(*flags, "--prompt", head + " and the bird", "--prompt-cache", cache)
    plain = run_chat(*flags, "--prompt", head + " and the bird")
    assert second.returncode == 0 and second.stdout == plain.stdout
    total = int(re.search(r"prefilled (\d+) tokens", plain.stderr).group(1))
    assert int(re.search(r"prefilled (\d+) tokens", second.stderr).group(1)) == total - n  # only what follows
    other = run_chat(*flags, "--quant", "int8", "--prompt", head, "--prompt-cache", cache)
    assert other.returncode == 0 and f"--prompt-cache {cache} not used" in other.stderr
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes")
    refused = run_chat(*flags, "--prompt", head, "--prompt-cache", notes)
    assert refused.returncode == 2 and "not a prompt cache" in refused.stderr and "Traceback" not in refused.stderr
    assert notes.read_text() == "my notes"


@pytest.mark.parametrize("args, message", [
    (["--ckpt", "/no/such/ckpt"], "--ckpt /no/such/ckpt: no such file or folder"),
    (["--ckpt", os.path.join(FIXTURES, "openelm")], "no tokenizer.json beside the checkpoint; pass --tokenizer"),
    (["--ckpt", LLAMA, "--temperature", "-0.5"], "--temperature must be a number >= 0"),
    (["--ckpt", LLAMA, "--top-p", "0"], "--top-p must be in (0, 1]"),
    (["--ckpt", LLAMA, "--top-p", "1.01"], "--top-p must be in (0, 1]"),
    (["--ckpt", LLAMA, "--top-k", "-1"], "--top-k must be a whole number >= 0 (0: off), got -1"),
    (["--ckpt", LLAMA, "--max-new-tokens", "0"], "--max-new-tokens: must be at least 1"),
    (["--ckpt", LLAMA, "--max-new-tokens", "many"], "--max-new-tokens: invalid positive_int value"),
    (["--ckpt", LLAMA, "--prompt", "word " * 300], "the prompt has"),
    (["--ckpt", LLAMA, "--plot", "x.png"], "--plot needs --bench"),
    (["--ckpt", LLAMA, "--prompt-file", "-", "--lookup"],
     "speculative decoding (--draft, --draft-quant, --lookup) runs"),
])
@pytest.mark.slow
def test_bad_input_is_one_line_and_exit_2(args, message):
    if "--prompt" not in args:
        args = args + ["--prompt", "hi"]
    result = run_chat(*args)
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr.count("\n") == 1 and message in result.stderr and "Traceback" not in result.stderr


def test_debug_shows_the_traceback():
    result = run_chat("--ckpt", "/no/such/ckpt", "--prompt", "hi", "--debug")
    assert result.returncode != 0 and "Traceback" in result.stderr


@pytest.mark.slow
def test_tokenizer_flag_for_a_checkpoint_without_one(tmp_path):
    ckpt = tmp_path / "shell"
    shutil.copytree(os.path.join(FIXTURES, "shellelastic"), ckpt)
    os.remove(ckpt / "tokenizer.json")
    assert run_chat("--ckpt", ckpt, "--prompt", "hi").returncode == 2
    result = run_chat("--ckpt", ckpt, "--tokenizer", os.path.join(FIXTURES, "shellelastic", "tokenizer.json"),
                      "--prompt", "the cat", "--max-new-tokens", 5, "--temperature", 0)
    assert result.returncode == 0 and result.stdout == answer(expected_text(
        os.path.join(FIXTURES, "shellelastic"),
        Tokenizer.from_file(os.path.join(FIXTURES, "shellelastic", "tokenizer.json")).encode("the cat").ids, 5,
        set())[0])


def byte_tokenizer() -> Tokenizer:
    """A byte-level BPE with no merges: every UTF-8 byte of a character is its own token."""
    from tokenizers import decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = ByteLevel.alphabet()
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(sorted(alphabet))}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return tok


def test_streaming_never_shows_broken_characters():
    vocab = vocab_module.Vocabulary(byte_tokenizer())
    text = "naïve 日本語 🙂 ok"
    ids = vocab.encode(text, special=False)
    assert len(ids) == len(text.encode("utf-8"))  # multi-byte characters really are split across tokens
    stream = vocab_module.TextStream(vocab)
    pieces = [stream.push(t) for t in ids] + [stream.finish()]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == vocab.decode(ids) == text
    assert "日" in pieces and "🙂" in pieces  # each character shown whole when its last byte arrives,
    assert pieces.count("") == len(ids) + 1 - len(text)  # and nothing for the bytes before it


@pytest.mark.parametrize("layout", ["llama", "gptneox", "shellelastic"])
def test_streamed_pieces_are_the_whole_decode_and_never_decode_the_whole_text(layout, monkeypatch):
    """Random ids (broken characters, special tokens) and real text: the pieces, then finish(), join to the decode of
    all the ids; push() never decodes the text so far again (constant work per token)."""
    import random

    vocab = vocab_module.load_vocabulary(fixture_path(layout), None)
    texts = [vocab.encode(" héllo wörld 你好 🙂\n  def f(x): return x " * 3, special=True)]
    texts += [[random.Random(i).randrange(vocab.size) for _ in range(60)] for i in range(20)]
    for ids in texts:
        stream = vocab_module.TextStream(vocab)
        whole = vocab.decode
        monkeypatch.setattr(vocab, "decode", lambda ids: pytest.fail("push() decoded the whole text"))
        pieces = [stream.push(t) for t in ids]
        monkeypatch.setattr(vocab, "decode", whole)
        assert "".join(pieces + [stream.finish()]) == vocab.decode(ids)


@pytest.mark.slow
def test_padded_vocabulary_is_never_sampled(tmp_path):
    # a tokenizer of 256 byte tokens over a model whose embedding has 512 rows: ids >= 256 must never be sampled
    ckpt = tmp_path / "padded"
    shutil.copytree(os.path.join(FIXTURES, "shellelastic"), ckpt)
    byte_tokenizer().save(str(ckpt / "tokenizer.json"))
    model = load.from_pretrained(ckpt)
    torch.manual_seed(3)
    unrestricted = generate.generate(model, torch.tensor([[97, 98, 99]]), 120, temperature=2.0)
    assert (unrestricted >= 256).any()  # without the limit this model does pick padded ids
    vocab = vocab_module.load_vocabulary(str(ckpt), None)
    assert vocab.size == 256
    args = session.Settings(SamplerSettings(temperature=2.0), max_new_tokens=120, speculate_k=4)
    torch.manual_seed(3)
    reply, _ = session.Session(model, vocab, args, LoadRecord(compile=False)).reply([97, 98, 99], lambda s: None)
    assert len(reply) == 120 and max(reply) < 256
    result = run_chat("--ckpt", ckpt, "--prompt", "abc", "--max-new-tokens", 60, "--temperature", 2.0, "--seed", 3)
    assert result.returncode == 0 and result.stdout  # and the program streams it


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # (the dropped interrupt, printed)
def test_ctrl_c_that_python_drops_in_a_finalizer_still_stops_the_reply():
    """Python prints and drops a KeyboardInterrupt raised inside a finalizer: the reply's token loop still stops at the
    next token, as it stops when the interrupt reaches it."""
    from dense_engine.cli import repl
    from dense_engine.formats.vocab import load_vocabulary

    model, vocab = load.from_pretrained(os.path.join(FIXTURES, "llama")), load_vocabulary(LLAMA, None)
    settings = session.Settings(SamplerSettings(), max_new_tokens=40)
    talk = session.Session(model, vocab, settings, LoadRecord(compile=False))
    whole, _ = talk.reply([1, 2, 3], lambda piece: None)
    keys = repl.ctrl_c_as_key(talk)

    class SignalsOnCollection:
        def __del__(self):
            os.kill(os.getpid(), signal.SIGINT)
            for _ in range(1000):  # (the handler runs here, inside the finalizer: its KeyboardInterrupt is dropped)
                pass

    def write(piece):
        if len(talk.reply_ids) == 5:
            SignalsOnCollection()
    try:
        keys.line()
        talk.cached = []
        reply, stats = talk.reply([1, 2, 3], write)
    finally:
        keys.restore()
    assert len(whole) == 40 and stats.interrupted and reply == whole[: len(reply)] and 5 <= len(reply) <= 7


def random_chat_model(folder, layers=4, hidden=256, context=16384, seed=0):
    """A random-weight model with the llama fixture's tokenizer whose replies never end by themselves: its end-of-turn
    logit is 0 while the largest of the others is over 40 (so a Ctrl-C test always lands in a reply, however fast the
    step); --max-new-tokens up to the context runs for seconds."""
    torch.manual_seed(seed)
    config = dense.DenseConfig(vocab_size=512, hidden_size=hidden, intermediate_size=4 * hidden,
                               num_hidden_layers=layers, num_attention_heads=4, head_dim=hidden // 4,
                               max_position_embeddings=context, qk_norm="none",
                               attn_output_gate=False)
    model = dense.DenseDecoder(config)
    state = {k: v.contiguous() for k, v in load.checkpoint_tensors(model).items()}
    end = Tokenizer.from_file(os.path.join(LLAMA, "tokenizer.json")).token_to_id("<|im_end|>")
    state["lm_head.weight"] = state["lm_head.weight"] * 30
    state["lm_head.weight"][end] = 0
    convert.write_native(str(folder), config, state)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(LLAMA, name), folder / name)
    return folder


def spawn(*args):
    child = pexpect.spawn(sys.executable, [CHAT, *map(str, args)], cwd=ROOT, encoding="utf-8", timeout=120,
                          env={**os.environ, "TERM": "dumb", "PYTHONUNBUFFERED": "1", "COLUMNS": "200"},
                          dimensions=(40, 200))
    return child


def prefilled(child) -> int:
    child.expect(r"prefilled (\d+) tokens")
    return int(child.match.group(1))


@pytest.mark.slow
def test_chat_keeps_the_cache_across_turns():
    tok = Tokenizer.from_file(os.path.join(LLAMA, "tokenizer.json"))
    vocab = vocab_module.load_vocabulary(LLAMA, None)
    child = spawn("--ckpt", LLAMA, "--temperature", "0", "--max-new-tokens", "6")
    child.expect(">>> ")
    child.sendline("hello")
    turn1 = tok.encode(vocab.render([{"role": "user", "content": "hello"}]), add_special_tokens=False).ids
    assert prefilled(child) == len(turn1)
    reply1, reply1_ids = expected_text(LLAMA, turn1, 6, vocab.stop_ids)
    child.expect(">>> ")
    child.sendline("how are you")
    turn2 = tok.encode(vocab.render([{"role": "user", "content": "hello"}, {"role": "assistant", "content": reply1},
                                     {"role": "user", "content": "how are you"}]), add_special_tokens=False).ids
    in_cache = (turn1 + reply1_ids)[: len(turn1) + 5]  # the 6th new token was never fed back
    common = next(i for i in range(len(turn2)) if i >= len(in_cache) or turn2[i] != in_cache[i])
    got = prefilled(child)
    assert got == len(turn2) - common and common >= len(turn1)  # turn 1 is not prefilled again
    child.expect(">>> ")
    child.sendline("/stats")
    child.expect(r"prefilled \d+ tokens, (\d+) from the cache")
    assert int(child.match.group(1)) == common  # the last reply's prompt tokens the cache held
    child.expect(r"(\d+) tokens prefilled in all, (\d+) from the cache")
    assert int(child.match.group(1)) == len(turn1) + got and int(child.match.group(2)) == common
    child.expect(">>> ")
    child.sendline("/reset")
    child.expect("new conversation")
    child.expect(">>> ")
    child.sendline("/exit")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0


@pytest.mark.slow
def test_ctrl_c_stops_a_reply_and_keeps_the_session(tmp_path):
    ckpt = random_chat_model(tmp_path / "big")
    child = spawn("--ckpt", ckpt, "--temperature", "1.0", "--seed", "0", "--max-new-tokens", "16000")
    child.expect(">>> ")
    child.sendline("tell me a long story")
    child.expect("story\r\n")  # the terminal's echo of the line
    child.expect(r"\S{3}")  # the reply has started streaming
    child.sendintr()
    child.expect(r"\(interrupted\)")
    child.expect(">>> ")
    child.sendline("/help")
    child.expect("/reset")
    child.expect(">>> ")
    child.sendintr()  # Ctrl-C at an empty prompt exits cleanly
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0


@pytest.mark.slow
def test_ctrl_d_exits_and_completion_mode():
    child = spawn("--ckpt", os.path.join(FIXTURES, "gptneox"), "--temperature", "0", "--max-new-tokens", "4")
    child.expect("complete mode")
    child.expect(">>> ")
    child.sendline("once upon a time")
    child.expect("4 tokens")
    child.expect(">>> ")
    child.sendeof()
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0


@pytest.mark.slow
def test_context_overflow_drops_oldest_turns(tmp_path):
    child = spawn("--ckpt", LLAMA, "--temperature", "0", "--max-new-tokens", "30", "--max-seq-len", "80")
    for i in range(4):
        child.expect(">>> ")
        child.sendline(f"message number {i} with some words")
    child.expect("dropped the \\d+ oldest messages")
    child.expect(">>> ")
    child.sendline("/exit")
    child.expect(pexpect.EOF)


# -- the hostile and careless inputs of issue 12, one test each: one line on stderr, exit status 2 -------------------


def one_line_exit_2(result, *needles):
    assert result.returncode == 2, result.stderr
    assert result.stdout == "" and result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
    for needle in needles:
        assert needle in result.stderr, result.stderr


def test_a_looping_template_is_stopped_at_its_deadline_in_any_thread(monkeypatch):
    """The time limit is the sandbox's own clock (not a signal of the main thread): a server renders in a pool."""
    import threading
    import time

    vocab = vocab_module.load_vocabulary(LLAMA, None)
    vocab.chat_template = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    monkeypatch.setattr(vocab_module, "TEMPLATE_SECONDS", 1)
    took = []

    def render():
        start = time.monotonic()
        with pytest.raises(vocab_module.UsageError, match="still rendering after 1 s"):
            vocab.render([{"role": "user", "content": "hi"}])
        took.append(time.monotonic() - start)

    worker = threading.Thread(target=render)
    worker.start()
    worker.join(timeout=30)
    render()
    assert len(took) == 2 and all(t < 10 for t in took)


@pytest.mark.slow
def test_template_that_reaches_for_python_internals_is_one_line(tmp_path):
    ckpt = tmp_path / "llama"
    shutil.copytree(LLAMA, ckpt)
    config = json.loads((ckpt / "tokenizer_config.json").read_text())
    config["chat_template"] = "{{ ''.__class__.__mro__[1].__subclasses__() }}"
    (ckpt / "tokenizer_config.json").write_text(json.dumps(config))
    one_line_exit_2(run_chat("--ckpt", ckpt, "--prompt", "hi", "--no-compile"), "chat template", "SecurityError")
    config["chat_template"] = "{{ raise_exception('only user messages, please') }}"
    (ckpt / "tokenizer_config.json").write_text(json.dumps(config))
    one_line_exit_2(run_chat("--ckpt", ckpt, "--prompt", "hi", "--no-compile"), "only user messages, please")
    config["chat_template"] = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    (ckpt / "tokenizer_config.json").write_text(json.dumps(config))
    one_line_exit_2(run_chat("--ckpt", ckpt, "--prompt", "hi", "--no-compile"), "still rendering after")


@pytest.mark.slow
def test_huge_declared_context_fails_before_allocating(tmp_path):
    import resource

    ckpt = tmp_path / "shell"
    shutil.copytree(os.path.join(FIXTURES, "shellelastic"), ckpt)
    config = json.loads((ckpt / "config.json").read_text())
    config["max_position_embeddings"] = 2147483648
    (ckpt / "config.json").write_text(json.dumps(config))
    one_line_exit_2(run_chat("--ckpt", ckpt, "--prompt", "hi"), "max_position_embeddings")
    config["max_position_embeddings"] = 16_000_000  # allowed by the config, but its cache would not fit: a smaller one
    config["vocab_size"] = 512
    (ckpt / "config.json").write_text(json.dumps(config))
    result = run_chat("--ckpt", ckpt, "--prompt", "the cat", "--max-new-tokens", 3, "--temperature", 0, "--no-compile")
    assert result.returncode == 0 and "the cache holds" in result.stderr, result.stderr
    config["vocab_size"] = 2 ** 24
    config["hidden_size"] = 2 ** 20  # 16M x 1M embedding: refused by its size, before any allocation
    (ckpt / "config.json").write_text(json.dumps(config))
    limited = subprocess.run([sys.executable, CHAT, "--ckpt", str(ckpt), "--prompt", "hi"], capture_output=True,
                             text=True, cwd=ROOT,
                             preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, (6 << 30, 6 << 30)), check=False)
    one_line_exit_2(limited, "vocab_size 16777216 x hidden_size 1048576", "GiB")  # named, within a 6 GiB limit


@pytest.mark.parametrize("flag, value, needle", [("--temperature", "nan", "--temperature must be a number >= 0"),
                                                 ("--temperature", "inf", "--temperature must be a number >= 0"),
                                                 ("--top-p", "nan", "--top-p must be in (0, 1]"),
                                                 ("--device", "tpu", "--device tpu: not a device"),
                                                 ("--device", "cuda:7", "--device cuda:7")])
@pytest.mark.slow
def test_bad_sampling_values_and_devices_are_one_line(flag, value, needle):
    one_line_exit_2(run_chat("--ckpt", LLAMA, "--prompt", "hi", flag, value), needle)


@pytest.mark.slow
def test_two_first_runs_at_once_both_succeed(tmp_path):
    """Two `python chat.py` on a fresh machine: one fetches and converts the default model, the other waits for it."""
    env = {**os.environ, "XDG_CACHE_HOME": str(with_kernels(tmp_path)), "PYTHONIOENCODING": "utf-8"}
    cmd = [sys.executable, CHAT, "--prompt", "What is the capital of France?", "--max-new-tokens", "8",
           "--temperature", "0", "--no-compile"]
    first = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    second = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    (out1, err1), (out2, err2) = first.communicate(timeout=600), second.communicate(timeout=600)
    assert first.returncode == 0 and second.returncode == 0, err1 + err2
    assert out1 == out2 and "Paris" in out1
    assert (err1 + err2).count("Converted the default model") == 1  # converted once
    folder = tmp_path / "dense-engine"
    assert not [p for p in os.listdir(folder) if p.startswith(".fetch-")]  # no half-written folder left behind


def test_prompt_file_writes_one_line_per_prompt_in_input_order(tmp_path):
    ckpt = os.path.join(FIXTURES, "shellelastic")
    tok = Tokenizer.from_file(os.path.join(ckpt, "tokenizer.json"))
    texts = ["the cat sat", "a", "once upon a time there was a dog that"]
    path = tmp_path / "prompts.jsonl"
    path.write_text(f"{texts[0]}\n\n" + json.dumps({"prompt": texts[1], "id": 7}) + "\n{\"prompt\": oops}\n"
                    + json.dumps({"prompt": texts[2]}) + "\n")
    result = run_chat("--ckpt", ckpt, "--prompt-file", path, "--batch-size", 2, "--max-new-tokens", 10,
                      "--temperature", 0, "--no-compile")
    assert result.returncode == 0, result.stderr
    assert "line 4" in result.stderr  # the malformed JSON line, by its number, skipped
    records = [json.loads(line) for line in result.stdout.splitlines()]
    assert [r["index"] for r in records] == [0, 1, 2] and [r["line"] for r in records] == [1, 3, 5]
    for record, text in zip(records, texts):
        want, ids = expected_text(ckpt, tok.encode(text).ids, 10, set())
        assert record["prompt"] == text and record["completion"] == want
        assert record["tokens"] == len(ids) == 10 and record["finish_reason"] == "length"


def test_prompt_file_rows_stop_at_their_own_eos(tmp_path):
    tok = Tokenizer.from_file(os.path.join(LLAMA, "tokenizer.json"))
    texts = ["hello", "the weather today is", "x y z"]
    free = [expected_text(LLAMA, tok.encode(t).ids, 40, set())[1] for t in texts]
    eos = free[1][12]  # a token the second prompt produces (the random fixture never meets its own eos)
    ckpt = tmp_path / "llama"
    shutil.copytree(LLAMA, ckpt)
    (ckpt / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    stops = {eos, tok.token_to_id("<|im_end|>"), 2}
    result = run_chat("--ckpt", ckpt, "--prompt-file", "-", "--complete", "--max-new-tokens", 40,
                      "--temperature", 0, "--no-compile", stdin="\n".join(texts) + "\n")
    assert result.returncode == 0, result.stderr
    records = [json.loads(line) for line in result.stdout.splitlines()]
    assert [r["finish_reason"] for r in records][1] == "eos" and len(records) == 3
    assert any(r["finish_reason"] == "length" for r in records)
    for record, text in zip(records, texts):
        want, ids = expected_text(LLAMA, tok.encode(text).ids, 40, stops)
        assert record["completion"] == want and record["tokens"] == len(ids)
        assert record["finish_reason"] == ("length" if len(ids) == 40 else "eos")


def session_replies(*flags, lines=("hello", "tell me more")):
    """The reply texts and stats lines of a chat session on the llama fixture, one turn per line."""
    child = spawn("--ckpt", LLAMA, "--temperature", "0", "--max-new-tokens", "24", "--no-compile", *flags)
    replies, stats = [], []
    for line in lines:
        child.expect(">>> ")
        child.sendline(line)
        child.expect(re.escape(line) + "\r\n")
        child.expect(r"\r\n(\d+ tokens, [^\r\n]*)\r\n")
        replies.append(child.before)
        stats.append(child.match.group(1))
    child.expect(">>> ")
    child.sendline("/stats")
    child.expect(r"last reply: ([^\r\n]*)\r\n")
    stats.append(child.match.group(1))
    child.expect(r"tokens prefilled in all")
    child.sendline("/exit")
    child.expect(pexpect.EOF)
    child.close()
    return replies, stats


@pytest.mark.parametrize("flags", [("--draft-quant", "int8", "--quant", "none"), ("--lookup",),
                                   ("--draft", LLAMA, "--speculate-k", "3")])
@pytest.mark.slow
def test_speculative_chat_gives_the_plain_replies_across_turns(flags):
    want, _ = session_replies()
    got, stats = session_replies(*flags)
    assert got == want and all(want)
    assert all("drafts accepted" in line for line in stats)
    if flags[0] == "--draft":  # the model drafting for itself: every draft is accepted, in every turn
        assert all("drafts accepted 100%" in line for line in stats)


def test_speculative_one_shot_prints_the_plain_text():
    args = ("--ckpt", LLAMA, "--prompt", "the the the", "--complete", "--temperature", 0, "--max-new-tokens", 20,
            "--no-compile")
    plain = run_chat(*args)
    spec = run_chat(*args, "--lookup", "--stats")
    assert spec.returncode == 0 and spec.stdout == plain.stdout != ""
    assert re.search(r"drafts accepted \d+% \([\d.]+ tokens per target step\)", spec.stderr)


@pytest.mark.slow
def test_json_schema_and_json_object_one_shot_replies_parse(tmp_path):
    """--json-schema FILE: the reply validates against the schema whatever the (random) model would say; sampled too.
    --json-object: a JSON object. A schema file that is not JSON, or not a schema, is one line and status 2."""
    jsonschema = pytest.importorskip("jsonschema")
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
                                                                                "maximum": 99}},
              "required": ["ok", "n"], "additionalProperties": False}
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(schema))
    for flags in (["--temperature", "0"], ["--temperature", "1", "--seed", "3"]):
        result = run_chat("--ckpt", LLAMA, "--prompt", "hi", "--json-schema", path, "--max-new-tokens", 300, *flags)
        assert result.returncode == 0, result.stderr
        jsonschema.validate(json.loads(result.stdout), schema)
    free = run_chat("--ckpt", LLAMA, "--prompt", "hi", "--max-new-tokens", 40, "--temperature", "0")
    assert free.stdout != run_chat("--ckpt", LLAMA, "--prompt", "hi", "--json-schema", path, "--max-new-tokens", 40,
                                   "--temperature", "0").stdout  # (the grammar changed what the model says)
    anything = run_chat("--ckpt", LLAMA, "--prompt", "hi", "--json-object", "--max-new-tokens", 200,
                        "--temperature", "0")
    assert anything.returncode == 0 and anything.stdout.startswith("{")
    (tmp_path / "bad.json").write_text("{not json")
    bad = run_chat("--ckpt", LLAMA, "--prompt", "hi", "--json-schema", tmp_path / "bad.json")
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1 and "not valid JSON" in bad.stderr
    chat_mode = run_chat("--ckpt", LLAMA, "--json-object")
    assert chat_mode.returncode == 2 and "one-shot --prompt" in chat_mode.stderr
