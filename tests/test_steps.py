"""Compiled steps saved across processes (generate.Steps): a second process loads what the first compiled and gets
the same tokens; damaged or foreign artifacts are compiled again with a notice, never a crash."""

import dataclasses
import os
import subprocess
import sys

import pytest
import torch
from conftest import ROOT, random_model, with_kernels

from dense_engine.runtime import caches, generate
from dense_engine.runtime.steps import Steps

SCRIPT = """
import sys, torch
sys.path.insert(0, {root!r}); sys.path.insert(0, {tests!r})
from dense_engine.runtime import generate
from conftest import random_model
from dense_engine.runtime.steps import Steps
model = random_model()
model.setup_cache(1, 256)
steps = Steps(model)
ids = torch.tensor([[5, 17, 99, 3, 250, 7]])
out = torch.cat([ids, *generate.generate_tokens(model, ids, 24, steps=steps)], dim=1)
print("tokens", out[0].tolist())
print("loaded", steps.loaded, "compiled", steps.compiled)
"""


def run(cache) -> tuple[list[int], int, int, str]:
    code = SCRIPT.format(root=ROOT, tests=os.path.join(ROOT, "tests"))
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            env={**os.environ, "XDG_CACHE_HOME": str(with_kernels(cache))}, check=False)
    assert result.returncode == 0, result.stderr
    lines = dict(line.split(" ", 1) for line in result.stdout.splitlines())
    tokens = eval(lines["tokens"])
    counts = lines["loaded"].split()
    return tokens, int(counts[0]), int(counts[2]), result.stderr


def greedy(model, ids, n):
    for _ in range(n):
        ids = torch.cat([ids, model(ids)[:, -1:].argmax(-1)], dim=1)
    return ids


@pytest.mark.slow
def test_a_second_process_loads_the_saved_steps(tmp_path):
    first, loaded, compiled, _ = run(tmp_path)
    assert (loaded, compiled) == (0, 2)  # the prefill and the decode step
    second, loaded, compiled, _ = run(tmp_path)
    assert (loaded, compiled) == (2, 0) and second == first
    assert first == greedy(random_model(), torch.tensor([[5, 17, 99, 3, 250, 7]]), 24)[0].tolist()
    # damaged artifacts: truncated, or random bytes -> compiled again, with a notice, same tokens
    files = sorted(p for p in (tmp_path / "dense-engine" / "compiled").iterdir() if p.suffix == ".pt2")
    files[0].write_bytes(files[0].read_bytes()[:1000])
    files[1].write_bytes(os.urandom(5000))
    third, loaded, compiled, stderr = run(tmp_path)
    assert (loaded, compiled) == (0, 2) and third == first
    assert stderr.count("ignoring the saved compiled step") == 2 and "Traceback" not in stderr
    fourth, loaded, compiled, _ = run(tmp_path)  # and the rebuilt ones are saved again
    assert (loaded, compiled) == (2, 0) and fourth == first


def test_keys_change_with_what_shapes_a_graph(tmp_path):
    model = random_model()
    model.setup_cache(1, 256)
    steps = Steps(model, folder=str(tmp_path))
    kind = generate.Sampling().kind()
    key = steps.key("decode", batch=1, attend=256, sampling=kind, ragged=False)
    assert key == steps.key("decode", batch=1, attend=256, sampling=kind, ragged=False)
    others = {steps.key("decode", batch=2, attend=256, sampling=kind, ragged=False),
              steps.key("decode", batch=1, attend=512, sampling=kind, ragged=False),
              steps.key("decode", batch=1, attend=256, sampling=generate.Sampling(temperature=0.7).kind(),
                        ragged=False),
              steps.key("prefill", batch=1, attend=256, sampling=kind, ragged=False)}
    assert key not in others and len(others) == 4
    model.setup_cache(1, 512)  # another cache length is another graph (the cache is one of its inputs)
    assert steps.key("decode", batch=1, attend=256, sampling=kind, ragged=False) != key
    other = random_model(num_hidden_layers=3)
    other.setup_cache(1, 256)
    assert Steps(other, folder=str(tmp_path)).key("decode", batch=1, attend=256, sampling=kind,
                                                  ragged=False) != key
    # sampling values are inputs: a new temperature, top-k or top-p is the same graph
    assert generate.Sampling(temperature=0.7).kind() == generate.Sampling(temperature=1.3).kind() == "sampled"
    assert generate.Sampling(0.7, top_k=5).kind() == generate.Sampling(0.9, top_p=0.5).kind() == "filtered"
    assert generate.Sampling(0.7, min_p=0.1).kind() == "sampled+min-p"  # (a graph holds the filters asked for)
    assert generate.Sampling(0.7, top_k=5, min_p=0.1, typical_p=0.9).kind() == "filtered+min-p+typical"


@pytest.mark.slow
def test_one_compiled_step_serves_every_sampling_value(tmp_path):
    """Temperatures, top-k, top-p, min-p, typical-p and penalties changed between replies (chat's /set, a server's
    requests) reuse one compiled step per kind, and give the tokens an eager step gives from the same noise; rows of
    one batch may differ."""
    model = random_model()
    caches.setup_cache(model, 3, 256)
    steps = Steps(model, folder=str(tmp_path))
    ids = torch.tensor([[5, 17, 99, 3, 250, 7]] * 3)
    penalty = torch.ones(3, model.config.vocab_size)
    penalty[:, [5, 17, 99]] = torch.tensor([[1.3], [1.0], [0.8]])
    settings = [generate.Sampling(0.7), generate.Sampling(1.3), generate.Sampling(0.9, top_k=5, top_p=0.8),
                generate.Sampling(0.6, top_k=40),
                generate.Sampling((0.0, 0.8, 1.5), (None, 3, None), (None, None, 0.7)),
                generate.Sampling(0.8, min_p=0.05), generate.Sampling(0.8, typical_p=0.9),
                generate.Sampling((0.7, 0.7, 1.1), min_p=(None, 0.2, 0.02), typical_p=(0.95, None, 0.5)),
                generate.Sampling(0.9, top_k=8, penalty=penalty), generate.Sampling(1.2, min_p=0.1, penalty=penalty)]
    for sampling in settings:
        runs = []
        for runner in (generate.Runner(model, steps), generate.Runner(model, None)):
            sampling_run = dataclasses.replace(
                sampling, generators=tuple(torch.Generator().manual_seed(r) for r in range(3)))
            token = runner.prefill(ids, 0, None).argmax(-1, keepdim=True)
            out = []
            for i in range(12):
                token = runner.decode(token, 6 + i, None, sampling_run)
                out.append(token[:, 0].tolist())
            runs.append(out)
        assert runs[0] == runs[1], sampling
    # one prefill; "sampled", "filtered", "sampled+min-p", "sampled+typical", "sampled+min-p+typical" decode steps;
    # and penalized ("filtered", "sampled+min-p")
    assert steps.compiled == 8


@pytest.mark.slow
def test_compiling_a_step_does_not_copy_the_models_weights(tmp_path, monkeypatch):
    """Quantized weights are buffers, which Inductor copies before an ahead-of-time compile: the whole model again in
    memory while a step compiles (a Gemma 4 E2B Q8_0 file: 5.5 GB more). The package binds the model's own tensors,
    so nothing is copied: the bytes cloned while compiling stay under a tenth of the weights'; the step's tokens are
    the eager step's."""
    from torch._subclasses.fake_tensor import is_fake
    from torch.utils._python_dispatch import TorchDispatchMode

    from dense_engine.cpu import quantized

    model = quantized.quantize_model(random_model(hidden_size=256, intermediate_size=1024, num_hidden_layers=4),
                                     "int8")
    weights = sum(b.numel() * b.element_size() for b in model.buffers())
    caches.setup_cache(model, 1, 64)
    cloned = []

    class Clones(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func is torch.ops.aten.clone.default and not is_fake(out):  # (real bytes, not a traced shape's)
                cloned.append(out.numel() * out.element_size())
            return out

    compile_and_package = torch._inductor.aoti_compile_and_package

    def spied(*args, **kwargs):
        with Clones():
            return compile_and_package(*args, **kwargs)

    monkeypatch.setattr(torch._inductor, "aoti_compile_and_package", spied)
    ids = torch.tensor([[5, 17, 99, 3]])
    steps = Steps(model, folder=str(tmp_path))
    compiled = generate.generate(model, ids, 8, steps=steps)
    assert steps.compiled == 2 and sum(cloned) < weights / 10, (sum(cloned), weights)
    assert torch.equal(compiled, generate.generate(model, ids, 8))


def test_buckets():
    assert generate.buckets(8192) == [256, 512, 1024, 2048, 4096, 8192]
    assert generate.buckets(3000) == [256, 512, 1024, 2048, 3000]
    assert generate.buckets(100) == [100]
    assert generate.bucket_for(1, 8192) == 256 and generate.bucket_for(257, 8192) == 512
    assert generate.bucket_for(3001, 8192) == 4096 and generate.bucket_for(2999, 3000) == 3000


@pytest.mark.slow
def test_one_compiled_prefill_step_takes_every_length_up_to_the_chunk(tmp_path):
    """The prefill step's length is a dynamic dimension: prompts and turns of 1, 2, 17 and 32 tokens, from slot 0 and
    after earlier tokens, run one compiled graph and give the eager pass's logits."""
    model = random_model()
    caches.setup_cache(model, 1, 256)
    steps = Steps(model, folder=str(tmp_path))
    compiled, eager = generate.Runner(model, steps), generate.Runner(model, None)
    ids = torch.randint(0, 256, (1, 90), generator=torch.Generator().manual_seed(0))
    start = 0
    for n in (17, 1, 32, 2, 20):  # each piece after the ones before it, in the same cache
        piece = ids[:, start:start + n]
        want = eager.prefill(piece, start, None)
        got = compiled.prefill(piece, start, None)  # (rewrites the same slots with the same keys and values)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        start += n
    assert steps.compiled == 1 and len(steps.functions) == 1


def gpu_paths(model, mode: str):
    """model's linears in `mode` as a GPU runs them, here on the CPU: int8 and nf4 dequantized into the matmul (no CPU
    kernel layout), int4 through PyTorch's int4-pack matmul (tinygemm's, on a GPU), fp8 through torch._scaled_mm."""
    from dense_engine.cpu import quantized

    if mode == "none":
        return model
    model = quantized.quantize_model(model, mode, group_size=64)  # (int4 g64: PyTorch's op, not kernels.cpp's tiles)
    for layer in model.modules():
        for name in [n for n in layer._buffers if n.startswith("kernel_") and mode in ("int8", "nf4")]:
            del layer._buffers[name]
        if isinstance(layer, quantized.Float8Linear):
            layer.scaled_mm = True
    return model


@pytest.mark.parametrize("mode", ["none", "int8", "int4", "nf4", "fp8"])
def test_the_gpus_step_graphs_hold_no_host_sync(mode, monkeypatch):
    """The steps a GPU compiles in its process (LazyStep: fullgraph, then CUDA graphs), traced here with aot_eager over
    each mode's GPU path: a prefill of two rows and their decode steps are each one graph, with no read of a value
    by the host (an .item(), a .tolist(), a branch on a tensor, an output whose shape depends on values would break
    the graph, which fullgraph refuses), and give eager's tokens."""
    from dense_engine.runtime import steps as steps_module

    monkeypatch.setitem(steps_module.LAZY_OPTIONS, "cpu", {"backend": "aot_eager"})
    model = gpu_paths(random_model(), mode)
    ids = torch.tensor([[5, 17, 99, 3, 250, 7, 41, 8], [9, 2, 77, 130, 6, 61, 300, 11]])
    caches.setup_cache(model, 2, 128)
    eager = generate.generate(model, ids, 12)
    steps = Steps(model, saved=False)
    compiled = generate.generate(model, ids, 12, steps=steps)
    assert steps.compiled >= 2 and torch.equal(compiled, eager)
