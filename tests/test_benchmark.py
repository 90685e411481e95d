"""chat.py --bench: the JSON it prints, the published shapes it builds, and what it counts."""

import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import ROOT, fixture_path

import layer_kinds
from dense_engine.cli import benchmark
from dense_engine.cpu import quantized
from dense_engine.formats import load

KEYS = {"decode_tok_s", "prefill_tok_s", "ttft_s", "compile_s", "bytes_per_token", "bandwidth_gbs", "mbu",
        "peak_mem_bytes", "device", "dtype", "quant", "batch_size", "prompt_len", "gen_len"}


def bench(*args):
    result = subprocess.run([sys.executable, os.path.join(ROOT, "chat.py"), "--bench", "--json", *map(str, args)],
                            capture_output=True, text=True, cwd=ROOT, check=False)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)  # stdout holds exactly one JSON object


@pytest.mark.slow
def test_json_has_every_key_and_consistent_numbers():
    r = bench("--ckpt", fixture_path("llama"), "--prompt-len", 8, "--gen-len", 12, "--runs", 2, "--batch-size", 2,
              "--peak-bw", 100)
    assert KEYS <= set(r)
    assert (r["batch_size"], r["prompt_len"], r["gen_len"], r["quant"], r["dtype"]) == (2, 8, 12, "none", "float32")
    # the llama fixture ties its head to the embedding: every parameter is read once per decode step
    model = load.from_pretrained(fixture_path("llama"))
    assert r["bytes_per_token"] == sum(p.numel() * 4 for p in model.parameters())
    assert r["bandwidth_gbs"] == pytest.approx(r["bytes_per_token"] * r["decode_tok_s"] / 2 / 1e9)
    assert r["mbu"] == pytest.approx(r["bandwidth_gbs"] / 100)
    assert r["prefill_tok_s"] == pytest.approx(2 * 8 / r["ttft_s"])  # batch x prompt / time to first token
    assert r["decode_tok_s"] == pytest.approx(2 * 1000 / r["ms_per_step"])  # batch / step time
    for key in ("decode_tok_s", "prefill_tok_s", "ttft_s"):
        lo, hi = r[f"{key}_range"]
        assert lo <= r[key] * (1 + 1e-9) and r[key] <= hi * (1 + 1e-9)
    assert r["peak_mem_bytes"] > 0


@pytest.mark.slow
def test_mbu_is_null_without_a_known_peak():
    r = bench("--ckpt", fixture_path("gptneox"), "--prompt-len", 4, "--gen-len", 4, "--runs", 1, "--quant", "int8")
    assert r["mbu"] is None and r["quant"] == "int8"
    # untied: the embedding table is not read by a decode step, the int8 head is
    model = load.from_pretrained(fixture_path("gptneox"), quant="int8")
    assert r["bytes_per_token"] == sum(t.numel() * t.element_size() for n, t in model.state_dict().items()
                                       if n != "embed_tokens.weight")


@pytest.mark.parametrize("name, params", [("smollm2-135m", 134_515_008), ("pythia-1.4b", 1_414_647_808),
                                          ("openelm-1.1b", 1_079_891_456), ("llama-2-7b", 6_738_415_616)])
def test_published_shapes_have_the_published_sizes(name, params):
    config = benchmark.shape_config(name)
    with torch.device("meta"):
        model = layer_kinds.Decoder(config)
    assert sum(p.numel() for p in model.parameters()) == params


def test_random_shape_model_keeps_tied_embeddings():
    model = benchmark.random_model("smollm2-135m", torch.device("cpu"), torch.bfloat16)
    assert model.lm_head.weight is model.embed_tokens.weight and model.dtype == torch.bfloat16
    assert benchmark.weight_bytes(model) == 134_515_008 * 2
    quantized.quantize_model(model, "int4")  # the head becomes an int8 copy: the table is no longer read a token
    assert benchmark.weight_bytes(model) == sum(t.numel() * t.element_size() for n, t in model.state_dict().items()
                                                if n != "embed_tokens.weight")


def test_bad_bench_input():
    result = subprocess.run([sys.executable, os.path.join(ROOT, "chat.py"), "--shape", "llama-2-7b"],
                            capture_output=True, text=True, check=False)
    assert result.returncode == 2 and "--shape needs --bench" in result.stderr


@pytest.mark.slow
def test_speculative_bench_reports_acceptance_and_tokens_per_target_step():
    # the target drafting for itself: every draft is accepted; 11 decode tokens at k = 4 take steps of 5, 5 and 1
    r = bench("--ckpt", fixture_path("llama"), "--draft", fixture_path("llama"), "--speculate-k", 4, "--prompt-len", 6,
              "--gen-len", 12, "--runs", 2, "--no-compile")
    assert (r["draft"], r["speculate_k"], r["acceptance_rate"]) == ("ModelDraft", 4, 1.0)
    assert r["tokens_per_target_step"] == pytest.approx(11 / 3)
    plain = bench("--ckpt", fixture_path("llama"), "--prompt-len", 6, "--gen-len", 12, "--runs", 1, "--no-compile")
    assert plain["draft"] is None and plain["tokens_per_target_step"] == 1.0 and plain["acceptance_rate"] is None
    lookup = bench("--ckpt", fixture_path("llama"), "--lookup", "--prompt", "a b c a b c a b c a b", "--complete",
                   "--gen-len", 12, "--runs", 1, "--no-compile")
    assert 0.0 <= lookup["acceptance_rate"] <= 1.0 and lookup["prompt_len"] > 6


def test_plot_writes_a_png_of_the_measured_curve(tmp_path):
    pytest.importorskip("matplotlib")  # the 'plot' extra (CI installs it)
    from matplotlib import image

    path = tmp_path / "decode.png"
    r = bench("--ckpt", fixture_path("llama"), "--prompt-len", 8, "--gen-len", 40, "--runs", 1, "--no-compile",
              "--plot", path)
    assert r["gen_len"] == 40
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    pixels = image.imread(path)
    assert pixels.shape[0] >= 300 and pixels.shape[1] >= 500 and pixels.std() > 0.05  # drawn, not blank
    benchmark.bar_chart(str(tmp_path / "bars.png"), ["float32", "int4"], {"a": [1.0, 2.0], "b": [3.0, None]}, "t",
                        "tok/s")
    assert image.imread(tmp_path / "bars.png").shape[1] >= 500
    assert sorted(os.listdir(tmp_path)) == ["bars.png", "decode.png"]  # no temporary files left behind


def test_plot_to_a_missing_folder_fails_before_measuring(tmp_path):
    result = subprocess.run([sys.executable, os.path.join(ROOT, "chat.py"), "--bench", "--ckpt", fixture_path("llama"),
                             "--plot", str(tmp_path / "nope" / "x.png")], capture_output=True, text=True, check=False)
    assert result.returncode == 2 and "--plot" in result.stderr and "no such folder" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
