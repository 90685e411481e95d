"""Sampling defaults: what a reply gets where nobody says. The checkpoint's generation_config.json first, then a GGUF
file's general.sampling.* keys, else llama.cpp's defaults; the same for chat.py, the Python API and the server, with
where each value came from."""

import json
import os
import shutil
import subprocess
import sys

import gguf
import gguf_cases
import pytest
import torch
from conftest import FIXTURES, ROOT

from dense_engine.formats.vocab import load_vocabulary
from dense_engine.runtime.sampling import LLAMA_CPP, Defaults, describe
from dense_engine.server.protocol import parse_request

LLAMA = os.path.join(FIXTURES, "llama")


def test_the_checkpoint_s_values_come_first_then_llama_cpp_s():
    declared = {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.05, "do_sample": True}
    sampler, sources = Defaults.of(declared, "generation_config.json").settings()
    assert (sampler.temperature, sampler.top_k, sampler.top_p, sampler.min_p, sampler.repetition_penalty) == \
        (0.6, 20, 0.9, 0.05, 1.05)
    assert sources["top_p"] == "generation_config.json" and sources["min_p"] == "llama.cpp's default"
    sampler, _ = Defaults.of({}, "generation_config.json").settings()
    assert (sampler.temperature, sampler.top_k, sampler.top_p, sampler.min_p) == \
        (LLAMA_CPP["temperature"], 40, 0.95, 0.05) == (0.8, 40, 0.95, 0.05)
    sampler, sources = Defaults.of({"do_sample": False, "temperature": 0.6}, "generation_config.json").settings()
    assert sampler.temperature == 0 and "do_sample false" in sources["temperature"]  # (transformers: greedy)


def test_what_is_given_wins_and_a_neutral_value_turns_a_filter_off():
    defaults = Defaults.of({"top_k": 20, "temperature": 0.6}, "generation_config.json")
    sampler, sources = defaults.settings("flag", temperature=0.3, top_k=0, top_p=1.0, min_p=0)
    assert (sampler.temperature, sampler.top_k, sampler.top_p, sampler.min_p) == (0.3, None, None, None)
    assert sources["temperature"] == sources["top_k"] == "flag"
    assert "top-k off (flag)" in describe(sampler, sources) and "temperature 0.3 (flag)" in describe(sampler, sources)
    with pytest.raises(ValueError, match="top_p"):
        defaults.settings(top_p=1.5)


def test_a_value_that_is_not_valid_is_left_out_with_a_note():
    notes = []
    sampler, sources = Defaults.of({"top_p": 7, "top_k": "many", "min_p": 0.1}, "generation_config.json",
                                   notes.append).settings()
    assert (sampler.top_p, sampler.top_k, sampler.min_p) == (0.95, 40, 0.1)
    assert len(notes) == 2 and any("top_p 7" in n for n in notes) and sources["top_p"] == "llama.cpp's default"


def with_generation_config(tmp_path, values: dict) -> str:
    folder = tmp_path / "model"
    shutil.copytree(LLAMA, folder)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": 2, **values}))
    return str(folder)


def test_a_folder_s_generation_config_and_a_gguf_s_keys_are_read(tmp_path, monkeypatch):
    vocab = load_vocabulary(with_generation_config(tmp_path, {"temperature": 0.5, "top_k": 12, "do_sample": True,
                                                              "max_length": 20}), None)
    assert vocab.sampling == {"temperature": 0.5, "top_k": 12, "do_sample": True}
    assert vocab.sampling_source == "generation_config.json"

    class Recommending(gguf.GGUFWriter):  # (gguf_cases' writer, with the keys a recommending file carries)
        def write_header_to_file(self, *args, **kwargs):
            self.add_float32("general.sampling.temp", 0.25)
            self.add_uint32("general.sampling.top_k", 7)
            self.add_float32("general.sampling.min_p", 0.5)
            super().write_header_to_file(*args, **kwargs)

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(gguf_cases.gguf, "GGUFWriter", Recommending)
    path = str(tmp_path / "recommending.gguf")
    gguf_cases.write("llama3", path)
    vocab = load_vocabulary(path, None)
    assert vocab.sampling == {"temperature": 0.25, "top_k": 7, "min_p": 0.5}
    sampler, sources = Defaults.of_vocab(vocab).settings()
    assert (sampler.temperature, sampler.top_k, sampler.top_p, sampler.min_p) == (0.25, 7, 0.95, 0.5)
    assert sources["top_k"] == "general.sampling.*" and sources["top_p"] == "llama.cpp's default"


def test_the_api_samples_with_the_checkpoint_s_defaults(tmp_path):
    import dense_engine

    greedy = dense_engine.load(with_generation_config(tmp_path, {"do_sample": False}), compile=False)
    by_default = greedy.generate("hello", max_new_tokens=12)
    assert greedy.session.settings.sources["temperature"] == "generation_config.json (do_sample false)"
    assert by_default == greedy.generate("hello", max_new_tokens=12, temperature=0)
    shutil.rmtree(tmp_path / "model")
    llm = dense_engine.load(with_generation_config(tmp_path, {"temperature": 5.0, "top_k": 3}), compile=False)
    torch.manual_seed(1)
    by_default = llm.generate("hello", max_new_tokens=12)
    torch.manual_seed(1)
    said = llm.generate("hello", max_new_tokens=12, temperature=5.0, top_k=3, top_p=0.95, min_p=0.05)
    torch.manual_seed(1)
    other = llm.generate("hello", max_new_tokens=12, temperature=5.0, top_k=0, top_p=1, min_p=0)  # (filters off)
    assert by_default == said and llm.stats.tokens == 12 and other != said


class Vocab:
    size, chat_template, stop_ids = 1000, None, {2}
    sampling, sampling_source = {"temperature": 0.3, "top_p": 0.5}, "generation_config.json"

    def encode(self, text, special=False):
        return [min(ord(c), 999) for c in text]


def test_a_request_that_does_not_say_gets_the_checkpoint_s_defaults():
    settings = parse_request({"prompt": "abc"}, "completion", Vocab(), 256)
    assert (settings.sampler.temperature, settings.sampler.top_p, settings.sampler.top_k, settings.sampler.min_p) == \
        (0.3, 0.5, 40, 0.05)
    said = parse_request({"prompt": "abc", "temperature": 1.0, "top_k": 0, "min_p": 0, "top_p": 1}, "completion",
                         Vocab(), 256)
    assert (said.sampler.temperature, said.sampler.top_p, said.sampler.top_k, said.sampler.min_p) == \
        (1.0, None, None, None)


@pytest.mark.slow
def test_chat_py_answers_with_the_checkpoint_s_defaults_and_says_where_they_came_from(tmp_path):
    """generation_config.json says greedy: the one-shot's answer is --temperature 0's, and --verbose says why."""
    folder = with_generation_config(tmp_path, {"do_sample": False})

    def run(ckpt, *flags):
        result = subprocess.run([sys.executable, os.path.join(ROOT, "chat.py"), "--ckpt", ckpt, "--prompt", "hello",
                                 "--max-new-tokens", "12", "--no-compile", *flags], capture_output=True, text=True,
                                check=False)
        assert result.returncode == 0, result.stderr
        return result

    by_default = run(folder, "--verbose")
    assert by_default.stdout == run(LLAMA, "--temperature", "0").stdout
    assert "temperature 0.0 (generation_config.json (do_sample false))" in by_default.stderr
    assert "top-k 40 (llama.cpp's default)" in by_default.stderr
    flagged = run(folder, "--verbose", "--temperature", "0.5", "--top-k", "0", "--seed", "3")
    assert "temperature 0.5 (flag)" in flagged.stderr and "top-k off (flag)" in flagged.stderr
