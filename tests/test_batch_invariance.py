"""The same bits whatever the batch (issue 54, item 5): a query's attention over the cache depends on its own slots
only, so a prompt prefilled in chunks of any length, one token at a time or beside another row's gives identical
logits, bit for bit, while its linears stay within their tiles; float32 linears sum in the tiles' order at every
number of rows (a GEMM past them), int8 linears reach the tiles' exact integer sums by a GEMM past 16 rows, int4
linears run one tile at every number of rows, nf4 linears sum in the tiles' order at every number of rows (a GEMM past
them); GGUF blocks take x in bytes and sum in one order in their decoding and prefill tiles (kernels.h)."""

import types

import pytest
import torch
from conftest import fixture_path

from dense_engine.cpu import kernels
from dense_engine.formats.load import from_pretrained
from dense_engine.runtime import caches, generate

needs_kernels = pytest.mark.skipif(not kernels.available(), reason="no CPU kernels here")


def attend(cache, q, pos, rows=None):
    """The kernel's attention of queries q [B, H, T, D] at slots pos ([T], or [B, T] with cache rows `rows`)."""
    empty = torch.empty(0, dtype=torch.long)
    return torch.ops.dense_kernels.attention(q, cache.k, cache.v, pos, empty, empty if rows is None else rows,
                                             0.25, 0, 0.0, *cache.scales())


@needs_kernels
@pytest.mark.parametrize("cache_class, dtype", [(caches.CPUKVCache, torch.float32), (caches.CPUKVCache, torch.bfloat16),
                                                (caches.CPUInt8KVCache, torch.int8)])
def test_a_querys_attention_is_the_same_bits_in_any_call(cache_class, dtype):
    """1100 slots (three parts of the kernel's 512): every query of row 0 in one call, in chunks of 1, 7 and 300,
    beside row 1's queries at other positions, and with one thread: the same bits."""
    torch.manual_seed(0)
    T, H, K, D = 1100, 4, 2, 16
    cache = cache_class(2, K, 1200, D, dtype, "cpu")
    k, v = torch.randn(2, K, T, D), torch.randn(2, K, T, D)
    cache.write(types.SimpleNamespace(input_pos=torch.arange(T), rows=None, row_start=None), k, v)
    q = torch.randn(1, H, T, D)
    whole = attend(cache, q, torch.arange(T))
    for size in (1, 7, 300):
        for start in (0, 509, 1024, T - size):
            piece = slice(start, start + size)
            got = attend(cache, q[:, :, piece].contiguous(), torch.arange(T)[piece])
            assert torch.equal(got, whole[:, :, piece]), (size, start)
    other = torch.randint(0, T, (7,))  # row 1 at 7 other positions, beside row 0's 7 last
    both = torch.stack([torch.arange(T - 7, T), other])  # [2, 7]
    q2 = torch.cat([q[:, :, -7:], torch.randn(1, H, 7, D)])
    assert torch.equal(attend(cache, q2, both, torch.tensor([0, 1]))[:1], whole[:, :, -7:])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(attend(cache, q, torch.arange(T)), whole)
        assert torch.equal(attend(cache, q[:, :, -1:].contiguous(), torch.arange(T - 1, T)), whole[:, :, -1:])
    finally:
        torch.set_num_threads(threads)


def in_chunks(runner, prompt, sizes):
    """The last chunk's logits of prompt [1, T] prefilled from slot 0 in chunks of these sizes."""
    start = 0
    for size in sizes:
        logits = runner.prefill(prompt[:, start:start + size], start, None)
        start += size
    return logits


@needs_kernels
def test_a_prompts_logits_are_the_same_bits_whole_in_chunks_or_beside_another():
    """An int8 model (tiles up to 16 rows, a GEMM of the same integers past them): a 40-token prompt prefilled in
    chunks of 20, 1, 12 and 7 tokens, one token at a time, and in chunks of 16 beside another row's (one pass of 32
    rows) gives the same logits: the attention of each chunk (from slot 0 or after others, of 1 or 20 queries) is the
    same bits."""
    model = from_pretrained(fixture_path("gptneox"), quant="int8")
    caches.setup_cache(model, 2, 128)
    runner = generate.Runner(model, None)
    torch.manual_seed(1)
    prompt = torch.randint(0, model.config.vocab_size, (1, 40))
    other = torch.randint(0, model.config.vocab_size, (40,)).tolist()

    want = in_chunks(runner, prompt, [20, 1, 12, 7])
    assert torch.equal(in_chunks(runner, prompt, [1] * 40), want)
    for start in range(0, 40, 16):
        together = runner.prefill_rows([prompt[0, start:start + 16].tolist(), other[start:start + 16]], [start, start],
                                       torch.tensor([0, 1]))
    assert torch.equal(together[:1], want)
    assert not torch.equal(together[1:], want)  # (the other row's own logits)


def assert_the_same_bits_at_any_length(model, seed: int):
    """A 40-token prompt prefilled whole, in chunks of 20, 1, 12 and 7, a token at a time, and whole beside another
    row's 40 (80 rows): the same logits, bit for bit."""
    caches.setup_cache(model, 2, 64)
    runner = generate.Runner(model, None)
    torch.manual_seed(seed)
    prompt = torch.randint(0, model.config.vocab_size, (1, 40))
    other = torch.randint(0, model.config.vocab_size, (40,)).tolist()
    want = in_chunks(runner, prompt, [40])
    assert torch.equal(in_chunks(runner, prompt, [20, 1, 12, 7]), want)
    assert torch.equal(in_chunks(runner, prompt, [1] * 40), want)
    together = runner.prefill_rows([prompt[0].tolist(), other], [0, 0], torch.tensor([0, 1]))
    assert torch.equal(together[:1], want)
    assert not torch.equal(together[1:], want)


@needs_kernels
@pytest.mark.parametrize("family", ["gptneox", "llama"])
def test_a_float32_prompts_logits_are_the_same_bits_at_any_length_and_beside_another(family):
    """float32 linears sum each output in the decoding tiles' order at every number of rows (kernels.h's tile_gemm
    past 16 or 24 rows, where oneDNN served before): a 40-token prompt whole, in chunks of 20, 1, 12 and 7, a token
    at a time and beside another row's 40 (80 rows) gives the same logits, bit for bit."""
    model = from_pretrained(fixture_path(family))
    assert all(isinstance(m, kernels.Linear) for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert_the_same_bits_at_any_length(model, seed=4)


@needs_kernels
@pytest.mark.parametrize("family", ["gptneox", "llama"])
def test_an_int8_prompts_logits_are_the_same_bits_at_any_length_and_beside_another(family):
    """int8 linears take x in two int8 digits a row and sum exact integers at every number of rows (past 16 rows, AVX2
    12, kernels.h's int8_gemm; past 32 bfloat16 GEMMs (AVX2: x in bytes) served before): a 40-token prompt whole, in
    chunks of 20, 1, 12 and 7, a token at a time and beside another row's 40 (80 rows) gives the same logits, bit for
    bit."""
    model = from_pretrained(fixture_path(family), quant="int8")
    assert any(hasattr(m, "kernel_weight") for m in model.modules())
    assert_the_same_bits_at_any_length(model, seed=5)


@needs_kernels
@pytest.mark.parametrize("family", ["gptneox", "llama"])
def test_an_int4_prompts_logits_are_the_same_bits_at_any_length_and_beside_another(family):
    """int4 linears take one tile at every number of rows (kernels.h: x with a scale per 32 as a 16-bit integer and a
    byte, exact integer sums per block, one order of float steps): a 40-token prompt prefilled whole (40 rows, where
    bfloat16 GEMMs served past 12 before), in chunks of 20, 1, 12 and 7, a token at a time, and whole beside another
    row's 40 (80 rows) gives the same logits, bit for bit."""
    model = from_pretrained(fixture_path(family), quant="int4")
    assert all(type(m).__name__ != "Linear" or m is model.lm_head for m in model.modules())  # (every linear int4)
    assert_the_same_bits_at_any_length(model, seed=2)


@needs_kernels
@pytest.mark.parametrize("family", ["gptneox", "llama"])
def test_an_nf4_prompts_logits_are_the_same_bits_at_any_length_and_beside_another(family):
    """nf4 linears sum each output in the decoding tiles' order at every number of rows (past 16 rows kernels.h's
    tile_gemm on each panel's weights decoded once a call, where bfloat16 GEMMs (AVX2: float32) served before; a layer
    whose rows are not whole 64-blocks, the float32 tiles on its dequantized weight): a 40-token prompt whole, in
    chunks of 20, 1, 12 and 7, a token at a time and beside another row's 40 (80 rows) gives the same logits, bit for
    bit."""
    model = from_pretrained(fixture_path(family), quant="nf4")
    assert any(hasattr(m, "kernel_weight") for m in model.modules())
    assert_the_same_bits_at_any_length(model, seed=6)


@needs_kernels
@pytest.mark.parametrize("blocks", ["K-quants", "32-blocks"])
def test_a_gguf_files_logits_are_the_same_bits_at_any_length_and_beside_another(tmp_path, blocks):
    """A GGUF of K-quants (Q4_K, Q5_K, Q6_K, as a Q4_K_M's wide tensors) or of 32-blocks (Q4_0, Q4_1, Q5_0, Q5_1,
    Q8_0), --quant auto keeping each block type: x rounded to bytes (a scale per 256 or per 32) at every number of
    rows, and one order of sums in the decoding tiles and the prefill's (kernels.h): a 40-token prompt whole, in
    chunks of 20, 1, 12 and 7, a token at a time and beside another row's gives the same logits, bit for bit."""
    from test_gguf import Q, original_tokenizer, small_llama, write_gguf

    kinds = {"K-quants": {"token_embd": Q.Q6_K, "attn_q": Q.Q4_K, "attn_k": Q.Q4_K, "attn_v": Q.Q6_K,
                          "attn_output": Q.Q5_K, "ffn_gate": Q.Q4_K, "ffn_up": Q.Q5_K, "ffn_down": Q.Q6_K,
                          "output": Q.Q5_K},
             "32-blocks": {"token_embd": Q.Q8_0, "attn_q": Q.Q4_0, "attn_k": Q.Q4_0, "attn_v": Q.Q5_0,
                           "attn_output": Q.Q4_1, "ffn_gate": Q.Q5_1, "ffn_up": Q.Q8_0, "ffn_down": Q.Q5_0,
                           "output": Q.Q8_0}}[blocks]
    path = tmp_path / "blocks.gguf"
    write_gguf(path, small_llama(tied=False, hidden=256, ffn=512), original_tokenizer("gpt2"), "llama-bpe", kinds)
    model = from_pretrained(str(path), quant="auto")
    held = {kind for m in model.modules() for kind in getattr(m, "kinds", [])}
    assert held == {kind.name for name, kind in kinds.items() if name != "token_embd"}
    assert_the_same_bits_at_any_length(model, seed=3)
