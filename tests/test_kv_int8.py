"""--kv-dtype int8: keys and values cached as int8 channels and a float32 scale per token and head. The CPU kernel's
attention over them (tests/test_kernels.py checks it against float64) and dense.py's PyTorch cache give the same
logits; both stay near the float cache's; the memory check counts the bytes the cache really takes; the flag reaches
the cache; a server's prefixes kept in the store come back exactly."""

import pytest
import torch
from conftest import fixture_path

import dense
from dense_engine.cpu import kernels
from dense_engine.formats.load import from_pretrained
from dense_engine.runtime import caches, generate

needs_kernels = pytest.mark.skipif(not kernels.available(), reason="no CPU kernels here")


def cached_logits(model, ids, cache_class, dtype):
    """Logits of ids [B, 48] through the cache: a prefill of 10 (its own keys), 10 decode steps, a chunk of 4 (the
    kernel), a chunk of 24 (many queries: the slots in use dequantized)."""
    model.setup_cache(ids.shape[0], 64, dtype, cache_class=cache_class)
    parts, p = [], 0
    for n in [10] + [1] * 10 + [4, 24]:
        parts.append(model(ids[:, p:p + n], input_pos=torch.arange(p, p + n)))
        p += n
    return torch.cat(parts, dim=1)


@needs_kernels
@pytest.mark.parametrize("layout", ["llama", "gptneox", "shellelastic"])
def test_the_kernels_int8_cache_equals_pytorchs_and_stays_near_the_float_cache(layout):
    model = from_pretrained(fixture_path(layout))
    torch.manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (2, 48))
    full = model(ids)  # no cache: float32 keys and values
    kernel = cached_logits(model, ids, caches.CPUInt8KVCache, torch.int8)
    pytorch = cached_logits(model, ids, caches.Int8KVCache, torch.int8)
    floats = cached_logits(model, ids, caches.CPUKVCache, None)
    scale = full.abs().max()
    assert (floats - full).abs().max() / scale < 1e-5
    # the same int8 values, two implementations, up to the chunk of 24: the kernel attends it as every cached step
    # (its bits the same in any chunk), dense.py by SDPA over the dequantized slots, 1e-4 from the kernel at that
    # chunk's last tokens, where the kernel a token at a time agrees with it
    assert (kernel - pytorch)[:, :24].abs().max() / scale < 1e-5
    model.setup_cache(2, 64, torch.int8, cache_class=caches.CPUInt8KVCache)
    single = torch.cat([model(ids[:, p:p + 1], input_pos=torch.tensor([p])) for p in range(48)], dim=1)
    assert (kernel - single).abs().max() / scale < 1e-5
    err = (kernel - full).abs().max() / scale
    assert 1e-5 < err < 2e-2, err  # (rounded: not the float cache's logits, but near them)


@pytest.mark.parametrize("cache_class", [dense.KVCache, caches.Int8KVCache, "kernels-int8"])
def test_the_memory_check_counts_the_bytes_the_cache_takes(cache_class):
    model = from_pretrained(fixture_path("llama"))
    dtype = torch.int8 if cache_class is not dense.KVCache else None
    if cache_class == "kernels-int8":
        if not kernels.available():
            pytest.skip("no CPU kernels here")
        cache_class = caches.CPUInt8KVCache
    model.setup_cache(3, 95, dtype, cache_class=cache_class)  # (95 + the scratch slot: whole blocks of 16)
    taken = sum(b.numel() * b.element_size() for layer in model.layers for b in layer.mixer.memory.buffers())
    assert taken == caches.cache_bytes(model, 3, 95, dtype)
    if dtype == torch.int8:
        assert 4 * taken < caches.cache_bytes(model, 3, 95, torch.float32) * 1.3  # about a quarter of float32's


@needs_kernels
@pytest.mark.parametrize("kv_dtype, cache_class, dtype", [("auto", caches.CPUKVCache, torch.float32),
                                                         ("float16", caches.CPUKVCache, torch.float16),
                                                         ("bfloat16", caches.CPUKVCache, torch.bfloat16),
                                                         ("int8", caches.CPUInt8KVCache, torch.int8)])
def test_kv_dtype_reaches_the_cache(kv_dtype, cache_class, dtype):
    import argparse

    from rich.console import Console

    from dense_engine.cli.flags import add_model_flags, load_model, parse_flags

    p = argparse.ArgumentParser()
    add_model_flags(p)
    args = parse_flags(p, ["--ckpt", fixture_path("llama"), "--kv-dtype", kv_dtype])
    model, record = load_model(args.ckpt, args, Console(quiet=True))
    caches.setup_cache(model, 1, 32, record.kv_dtype)
    cache = model.layers[0].mixer.memory
    assert type(cache) is cache_class and cache.v.dtype == dtype


@needs_kernels
@pytest.mark.slow
def test_a_compiled_decode_step_reads_the_int8_cache_as_the_eager_one(tmp_path):
    """The compiled step calls the kernel with the scales (one graph, compiled, none failed) and gives the eager
    step's tokens."""
    from conftest import random_model

    from dense_engine.runtime.steps import Steps

    model = random_model()
    caches.setup_cache(model, 2, 256, "int8")
    assert type(model.layers[0].mixer.memory) is caches.CPUInt8KVCache
    steps = Steps(model, folder=str(tmp_path))
    ids = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(0))
    runs = []
    for runner in (generate.Runner(model, steps), generate.Runner(model, None)):
        token = runner.prefill(ids, 0, None).argmax(-1, keepdim=True)
        out = []
        for i in range(16):
            token = runner.decode(token, 40 + i, None, generate.Sampling())
            out.append(token[:, 0].tolist())
        runs.append(out)
    assert runs[0] == runs[1]
    assert steps.compiled >= 1 and not steps.failed


@needs_kernels
def test_the_python_api_takes_kv_dtype_and_answers_as_the_int8_cache_does():
    import dense_engine
    from dense_engine.system.errors import UsageError

    llm = dense_engine.load(fixture_path("llama"), compile=False, kv_dtype="int8")
    assert type(llm.model.layers[0].mixer.memory) is caches.CPUInt8KVCache
    llm.generate("the cat sat", max_new_tokens=12, chat=False, temperature=0)
    got = list(llm.session.reply_ids)
    ids = llm.vocab.encode("the cat sat", special=True)
    want = generate.generate(llm.model, torch.tensor([ids]), 12)[0, len(ids):].tolist()  # (an int8 cache too)
    assert got == want[:len(got)] and len(got) >= 1
    with pytest.raises(UsageError, match="kv_dtype must be"):
        dense_engine.load(fixture_path("llama"), compile=False, kv_dtype="fp8")


def test_prompt_logprobs_on_the_default_cache_are_transformers():
    """lm-evaluation-harness reads a prompt's logprobs (a completion's echo): from a cached prefill from slot 0 (the
    server's echo path), whose keys and values the cache stores in its dtype and reads back. With the default cache
    (auto: float32 on CPU, for quantized weights too) they are transformers' within 2e-3 nats (here 2e-6); float16
    and bfloat16 caches move them by their mantissa's rounding, bfloat16 the most (BENCHMARKS.md: on the default
    model's int4 weights 4e-5 nats with float32, 1.4e-2 with float16, 6.8e-2 with bfloat16)."""
    transformers = pytest.importorskip("transformers")

    hf = transformers.AutoModelForCausalLM.from_pretrained(fixture_path("llama"), dtype=torch.float32).eval()
    model = from_pretrained(fixture_path("llama"))
    ids = torch.randint(0, model.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = torch.log_softmax(hf(ids).logits[0].float(), dim=-1)[:-1].gather(1, ids[0, 1:, None])

    def echo(kv_dtype: str) -> float:
        caches.setup_cache(model, 1, 64, kv_dtype)
        with torch.no_grad():
            logits = model(ids, input_pos=torch.arange(40))[0]
        got = torch.log_softmax(logits, dim=-1)[:-1].gather(1, ids[0, 1:, None])
        return float((got - want).abs().max())

    default, half, bf16 = echo("auto"), echo("float16"), echo("bfloat16")
    assert default < 2e-3 and default < half < bf16, (default, half, bf16)
    quantized = from_pretrained(fixture_path("llama"), quant="int4")
    assert caches.cache_for(quantized, "auto")[1] in (None, torch.float32)  # (None: the model's, float32)
    assert quantized.dtype == torch.float32
