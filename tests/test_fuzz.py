"""Hostile and careless checkpoints: a few hundred random corruptions (fixed seed) of a small native checkpoint's files
and of a small GGUF. Every case must end in a correct load or a one-line CheckpointError / UsageError: never another
exception type, never more than a few seconds, never an allocation beyond a bound. The cases run in a subprocess
under an address-space limit (RLIMIT_AS) with a time limit each (SIGALRM); it reports every outcome as JSON.

    python tests/test_fuzz.py --run DIR [--cases N] [--seed S]      # the runner itself
"""

import json
import os
import random
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import with_kernels

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
CASE_SECONDS = 10
MEMORY_LIMIT = 6 << 30  # address space for the runner; loading the fixtures needs well under 2 GiB


# ----------------------------------------------------------------------------------------------------------------
# Mutations: each takes (rng, folder) and damages one file of a copy of the checkpoint


HOSTILE_VALUES = [2 ** 31, 2 ** 63, -1, 0, 1, 3.5, float("inf"), "128", "", None, True, [], [1, 2], {"a": 1},
                  10 ** 30, -(2 ** 40), "nan"]
TEMPLATES = [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ raise_exception('no system messages allowed') }}",
    "{% for m in messages %}{{ m['content'] }",
    "{{ messages[0].content.__globals__ }}",
    "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "{{ undefined_function() }}",
    "{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}",
    "{{ messages | tojson }}",
    "{{ 'x' * 10 }}{{ bos_token }}{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}",
    12345,
    None,
]


def corrupt_bytes(rng: random.Random, path: str, region: int | None = None) -> None:
    data = bytearray(Path(path).read_bytes())
    if not data:
        return
    end = min(len(data), region or len(data))
    for _ in range(rng.randint(1, 8)):
        data[rng.randrange(end)] = rng.randrange(256)
    Path(path).write_bytes(bytes(data))


def truncate(rng: random.Random, path: str) -> None:
    data = Path(path).read_bytes()
    Path(path).write_bytes(data[: rng.randrange(max(1, len(data)))])


def safetensors_header(rng: random.Random, folder: str) -> None:
    path = os.path.join(folder, "model.safetensors")
    data = Path(path).read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    choice = rng.randrange(5)
    if choice == 0:  # the header's length
        Path(path).write_bytes(struct.pack("<Q", rng.choice([0, 1, n + 1, 2 ** 40, 2 ** 64 - 1])) + data[8:])
        return
    if choice == 1:
        corrupt_bytes(rng, path, 8 + n)
        return
    name = rng.choice([k for k in header if k != "__metadata__"])
    field, value = rng.choice([("data_offsets", [0, 2 ** 40]), ("data_offsets", [10, 5]), ("data_offsets", "x"),
                               ("shape", [2 ** 31, 2 ** 31]), ("shape", [-1, 4]), ("shape", []), ("dtype", "Q9"),
                               ("dtype", "F64"), ("shape", [1, 2, 3, 4, 5, 6])])
    header[name][field] = value
    raw = json.dumps(header).encode()
    Path(path).write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + n:])


def config_value(rng: random.Random, folder: str) -> None:
    path = os.path.join(folder, "config.json")
    config = json.loads(Path(path).read_text())
    choice = rng.randrange(4)
    if choice == 0:
        config[rng.choice(list(config))] = rng.choice(HOSTILE_VALUES)
    elif choice == 1:
        config.pop(rng.choice(list(config)))
    elif choice == 2:
        config[rng.choice(["unknown_key", "rope_scaling", "__proto__"])] = rng.choice(HOSTILE_VALUES)
    else:
        corrupt_bytes(rng, path)
        return
    Path(path).write_text(json.dumps(config))


def tokenizer_json(rng: random.Random, folder: str) -> None:
    path = os.path.join(folder, "tokenizer.json")
    if rng.random() < 0.5:
        (truncate if rng.random() < 0.5 else corrupt_bytes)(rng, path)
        return
    tok = json.loads(Path(path).read_text())
    target = rng.choice(["model", "pre_tokenizer", "decoder", "added_tokens", "normalizer"])
    tok[target] = rng.choice(HOSTILE_VALUES)
    Path(path).write_text(json.dumps(tok))


def chat_template(rng: random.Random, folder: str) -> None:
    path = os.path.join(folder, "tokenizer_config.json")
    config = json.loads(Path(path).read_text())
    if rng.random() < 0.2:
        config = rng.choice(HOSTILE_VALUES)
    else:
        cut = rng.choice([s for s in TEMPLATES if isinstance(s, str)])[: rng.randrange(1, 40)]  # a truncated one
        config["chat_template"] = rng.choice(TEMPLATES + [cut])
    Path(path).write_text(json.dumps(config))


def gguf_damage(rng: random.Random, folder: str) -> None:
    path = os.path.join(folder, "model.gguf")
    choice = rng.randrange(3)
    if choice == 0:
        truncate(rng, path)
    elif choice == 1:
        corrupt_bytes(rng, path, 24)  # magic, version, tensor and metadata counts
    else:
        corrupt_bytes(rng, path, 64 * 1024)  # metadata values and tensor infos


def gguf_metadata(rng: random.Random, folder: str) -> None:
    """A GGUF written with hostile metadata values (sizes, counts, rope settings) by gguf's own writer."""
    import gguf

    path = os.path.join(folder, "model.gguf")
    reader = gguf.GGUFReader(path)
    key = rng.choice(["llama.embedding_length", "llama.block_count", "llama.attention.head_count",
                      "llama.attention.head_count_kv", "llama.context_length", "llama.feed_forward_length",
                      "llama.rope.freq_base", "llama.vocab_size", "tokenizer.ggml.bos_token_id"])
    value = rng.choice([0, 1, 3, 2 ** 31 - 1, 2 ** 32 - 1])
    writer = gguf.GGUFWriter(path + ".new", "llama")
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), vtype, sub_type=sub)
    writer.add_key_value(key, value, gguf.GGUFValueType.UINT32)
    for t in reader.tensors:
        plain = t.tensor_type in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16)
        writer.add_tensor(t.name, t.data, raw_dtype=None if plain else t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(path + ".new", path)


NATIVE = [safetensors_header, config_value, tokenizer_json, chat_template,
          lambda rng, folder: truncate(rng, os.path.join(folder, "model.safetensors"))]
GGUF = [gguf_damage, gguf_metadata]


# ----------------------------------------------------------------------------------------------------------------
# The runner (in its own process)


def make_sources(work: str) -> tuple[str, str]:
    """A native folder (the Llama fixture converted, with its tokenizer and template) and a small GGUF."""
    sys.path.insert(0, ROOT)
    sys.path.insert(0, HERE)
    import test_gguf

    from dense_engine.formats import convert

    native = os.path.join(work, "native")
    convert.convert(os.path.join(HERE, "fixtures", "llama"), native)
    gguf_dir = os.path.join(work, "gguf")
    os.makedirs(gguf_dir)
    tokenizer = test_gguf.original_tokenizer("gpt2")
    test_gguf.write_gguf(os.path.join(gguf_dir, "model.gguf"), test_gguf.small_llama(tied=True), tokenizer, "gpt2",
                         {"attn_q": test_gguf.Q.Q8_0, "ffn_up": test_gguf.Q.Q4_1})
    return native, gguf_dir


def attempt(folder: str, kind: str) -> None:
    """What a user's first command does with a checkpoint: load it, read its tokenizer, render its template."""
    import dense
    from dense_engine.formats import load
    from dense_engine.formats import vocab as vocab_module

    path = folder if kind == "native" else os.path.join(folder, "model.gguf")
    model = load.from_pretrained(path)
    vocab = vocab_module.load_vocabulary(path, None)
    if vocab.chat_template:
        text = vocab.render([{"role": "user", "content": "hi"}])
        vocab.encode(text, special=False)
    n = min(3, model.config.max_position_embeddings)
    model(dense.torch.tensor([[1, 2, 3][:n]]))


def run(work: str, cases: int, seed: int) -> dict:
    import resource
    import signal

    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))
    sys.path.insert(0, ROOT)
    from dense_engine.formats import checkpoint
    from dense_engine.formats import vocab as vocab_module

    native, gguf_dir = make_sources(work)

    class Hang(Exception):
        pass

    def alarm(signum, frame):
        raise Hang()

    signal.signal(signal.SIGALRM, alarm)
    rng = random.Random(seed)
    outcomes, failures = {}, []
    for case in range(cases):
        kind = "native" if case % 3 else "gguf"
        source = native if kind == "native" else gguf_dir
        folder = os.path.join(work, f"case{case}")
        shutil.copytree(source, folder)
        mutation = rng.choice(NATIVE if kind == "native" else GGUF)
        name = getattr(mutation, "__name__", "truncate")
        try:
            mutation(rng, folder)
        except Exception as e:  # noqa: BLE001 (the mutation itself could not apply, e.g. already unreadable: skip)
            outcomes["skipped"] = outcomes.get("skipped", 0) + 1
            outcomes.setdefault("skipped mutations", {})[name] = f"{type(e).__name__}: {str(e)[:100]}"
            shutil.rmtree(folder, ignore_errors=True)
            continue
        signal.alarm(CASE_SECONDS)
        try:
            attempt(folder, kind)
            result = "loaded"
        except (checkpoint.CheckpointError, vocab_module.UsageError) as e:
            result = "one-line error" if "\n" not in str(e) else "multi-line error"
            if "\n" in str(e):
                failures.append({"case": case, "mutation": name, "error": str(e)[:300]})
        except Hang:
            result = "hang"
            failures.append({"case": case, "mutation": name, "error": f"still running after {CASE_SECONDS} s"})
        except BaseException as e:  # noqa: BLE001 (any other exception type is a failure of the promise)
            result = f"uncaught {type(e).__name__}"
            failures.append({"case": case, "mutation": name, "error": f"{type(e).__name__}: {str(e)[:300]}"})
        finally:
            signal.alarm(0)
        outcomes[result] = outcomes.get(result, 0) + 1
        shutil.rmtree(folder, ignore_errors=True)
    return {"cases": cases, "outcomes": outcomes, "failures": failures}


@pytest.mark.slow
def test_fuzz_corrupted_checkpoints_end_in_a_load_or_a_one_line_error(tmp_path):
    result = subprocess.run([sys.executable, __file__, "--run", str(tmp_path), "--cases", "300", "--seed", "1234"],
                            capture_output=True, text=True, timeout=600,
                            env={**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache"), "DENSE_KERNELS": "0"},
                            check=False)
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    print(json.dumps(report["outcomes"]))
    assert not report["failures"], json.dumps(report["failures"][:5], indent=1)
    assert report["outcomes"].get("one-line error", 0) > 100 and report["outcomes"].get("loaded", 0) > 10


def damage(rng: random.Random, path: str, within: int | None = None) -> str:
    """Truncate the file at a random length, or overwrite a random run of its bytes (in its first `within` bytes)."""
    data = bytearray(Path(path).read_bytes())
    if rng.random() < 0.5:
        cut = rng.randrange(0, len(data))
        Path(path).write_bytes(bytes(data[:cut]))
        return f"truncated to {cut} bytes"
    start = rng.randrange(0, within or len(data))
    data[start:start + 64] = bytes(rng.randrange(256) for _ in range(len(data[start:start + 64])))
    Path(path).write_bytes(bytes(data))
    return f"64 bytes overwritten at {start}"


@pytest.mark.slow
def test_fuzz_damaged_cache_files_end_in_the_answer_or_a_one_line_error(tmp_path):
    """The cache folder's own files damaged at random (a compiled step, a converted model's weights; the kernel
    library: tests/test_reliability.py): the next run answers as before (having rebuilt what was damaged, with a
    note) or stops with one line; never a crash, never a wrong answer from a damaged file."""
    from dense_engine.formats import convert

    chat = os.path.join(ROOT, "chat.py")
    native = str(tmp_path / "native")
    convert.convert(os.path.join(ROOT, "tests", "fixtures", "llama"), native)
    cache = with_kernels(tmp_path / "cache") / "dense-engine"  # (the library the suite built, not a build of its own)
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")}
    run = [sys.executable, chat, "--ckpt", native, "--prompt", "hi", "--temperature", "0", "--max-new-tokens", "8"]
    want = subprocess.run(run, capture_output=True, text=True, env=env, timeout=300, check=False)
    assert want.returncode == 0, want.stderr
    targets = {"compiled step": lambda: min(cache.glob("compiled/*.pt2")),
               "converted weights": lambda: os.path.join(native, "model.safetensors")}
    rng = random.Random(7)
    for kind in ("compiled step", "converted weights", "converted weights"):
        path = str(targets[kind]())
        saved = Path(path).read_bytes()
        # (weights carry no digest: a check of every byte at each start would cost seconds for a large model; what
        # an interrupted write or a damaged header leaves is caught by sizes and the format's own checks)
        header = 8 + int.from_bytes(saved[:8], "little") if kind == "converted weights" else None
        how = damage(rng, path, header)
        got = subprocess.run(run, capture_output=True, text=True, env=env, timeout=300, check=False)
        where = f"{kind} {how}: {got.stderr[-500:]}"
        assert got.returncode in (0, 2) and "Traceback" not in got.stderr, where
        if got.returncode == 0:
            assert got.stdout == want.stdout, where
        else:
            assert got.stderr.count("\n") == 1 and "error:" in got.stderr, where
        if kind == "converted weights":  # (ours to mend: what the user converted is reported, not rebuilt)
            Path(path).write_bytes(saved)


if __name__ == "__main__":
    import argparse

    p = argparse.ArgumentParser()
    p.add_argument("--run", required=True)
    p.add_argument("--cases", type=int, default=300)
    p.add_argument("--seed", type=int, default=1234)
    args = p.parse_args()
    print(json.dumps(run(args.run, args.cases, args.seed)))
