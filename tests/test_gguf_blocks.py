"""GGUF blocks kept as the file stores them (--quant gguf, what auto picks for K-quant files): every block type's
kernels against gguf's own dequantizer (the values bit for bit) and against the float64 product of those values;
a mixed-type file (as a Q4_K_M mixes Q4_K, Q6_K and Q8_0) loaded with every tensor in its own type, its logits
against the float path on the same file (a long prefill's, in bytes, against llama.cpp's distance from it), its
cached and compiled decoding against plain passes."""

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from conftest import ROOT, other_builds
from test_gguf import Q, original_tokenizer, small_llama, write_gguf

from dense_engine.cpu import kernels, quantized
from dense_engine.formats import gguf_import, load
from dense_engine.runtime import caches, generate
from dense_engine.runtime.steps import Steps
from dense_engine.system.errors import CheckpointError

needs_kernels = pytest.mark.skipif(not kernels.available(), reason="no AVX-512 VNNI CPU or no C++ compiler")
SCALES = {"Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0], "Q4_K": [0, 2], "Q5_K": [0, 2],
          "Q6_K": [208]}  # where each type's float16 scales sit in its block
# a file's tensor types as llama.cpp's Q4_K_M mixes them, with a Q5_K head and Q8_0 / Q5_0 where rows are short
MIXED = {"token_embd": Q.Q6_K, "attn_q": Q.Q4_K, "attn_k": Q.Q4_K, "attn_v": Q.Q6_K, "attn_output": Q.Q5_K,
         "ffn_gate": Q.Q4_K, "ffn_up": Q.Q8_0, "ffn_down": Q.Q6_K, "output": Q.Q5_K}


def random_blocks(kind: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Every bit pattern a block can hold (random bytes), with finite float16 scales."""
    _, values, size = quantized.GGUF_TYPES[kind]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows, cols // values, size), dtype=np.uint8)
    for at in SCALES[kind]:
        half = (rng.standard_normal((rows, cols // values)) * 0.01).astype(np.float16)
        raw[..., at:at + 2] = half.view(np.uint8).reshape(rows, cols // values, 2)
    return raw.reshape(rows, -1)


def shapes(kind: str):
    values = quantized.GGUF_TYPES[kind][1]
    # odd row counts (a tile's tail), one block, and 32-blocks whose count is odd (half a 64-value chunk at the end)
    return [(7, values * 3), (1, values), (33, 896 if values == 32 else 1024)]


@pytest.mark.parametrize("kind", list(quantized.GGUF_TYPES))
def test_torch_dequantizer_equals_ggufs(kind):
    for rows, cols in shapes(kind):
        raw = random_blocks(kind, rows, cols)
        want = gguf.quants.dequantize(raw, Q[kind]).reshape(rows, cols)
        np.testing.assert_array_equal(quantized.gguf_dequantize(torch.from_numpy(raw), kind, cols).numpy(), want)


@needs_kernels
@pytest.mark.parametrize("kind", list(quantized.GGUF_TYPES))
def test_kernels_equal_ggufs_dequantizer_and_the_float_product(kind):
    ggml_id = quantized.GGUF_TYPES[kind][0]
    for rows, cols in shapes(kind):
        raw = random_blocks(kind, rows, cols, seed=rows)
        blocks = torch.from_numpy(raw)
        want = torch.from_numpy(gguf.quants.dequantize(raw, Q[kind]).reshape(rows, cols).copy())
        assert torch.equal(torch.ops.dense_kernels.dequantize_gguf(blocks, ggml_id, cols, False), want)
        assert torch.equal(torch.ops.dense_kernels.dequantize_gguf(blocks, ggml_id, cols, True), want.bfloat16())
        for m in (1, 2, 3, 5, 12):  # the decoding tiles (AVX-512's K-quants past 4 rows: the prefill's): x in bytes
            assert_bytes_product(kind, torch.randn(m, cols, generator=torch.Generator().manual_seed(m)), blocks, want)
        for m in (13, 40):  # a prefill
            x = torch.randn(m, cols, generator=torch.Generator().manual_seed(m))
            x[1, : min(cols, 256)] = 0  # (a block of x all zeros: a scale of 0)
            assert_bytes_product(kind, x, blocks, want)


@needs_kernels
@pytest.mark.parametrize("kind", ["Q8_0", "Q6_K", "Q4_1"])
def test_float_x_is_the_float_product_and_a_rows_bits_whatever_the_rows(kind):
    """linear_gguf(float_x=True), the output head of int4 made from a GGUF (quantized.GGUFHead): x stays float32, so
    the result is the dequantized weights' product to float32's rounding (Q8_0, the default model's head: its own
    kernel; the other types dequantize tiles), at every number of rows, and a row's bits do not depend on the rows
    beside it (1, 5, 12, 13 or 40)."""
    ggml_id = quantized.GGUF_TYPES[kind][0]
    cols = 576 if kind != "Q6_K" else 512
    raw = random_blocks(kind, 37, cols, seed=3)
    blocks = torch.from_numpy(raw)
    want = torch.from_numpy(gguf.quants.dequantize(raw, Q[kind]).reshape(37, cols).copy()).double()
    x = torch.randn(40, cols, generator=torch.Generator().manual_seed(1))
    x[3, 7] = 60.0  # an outlier channel (the final hidden states have them): digits would lose the others
    alone = torch.cat([torch.ops.dense_kernels.linear_gguf(x[i:i + 1], blocks, ggml_id, True) for i in range(40)])
    exact = x.double() @ want.T
    scale = (x.double().abs() @ want.abs().T)  # what float32's rounding of the sums is relative to
    assert ((alone.double() - exact).abs() <= 1e-6 * scale).all(), kind
    for m in (5, 12, 13, 40):
        assert torch.equal(torch.ops.dense_kernels.linear_gguf(x[:m], blocks, ggml_id, True), alone[:m]), (kind, m)


@needs_kernels
@pytest.mark.parametrize("kind", ["Q4_K", "Q5_K", "Q6_K"])
def test_a_kquant_rows_bits_do_not_depend_on_the_rows_beside_it(kind):
    """K-quants take x in bytes at every number of rows and sum in one order (kernels.h) in the decoding tiles and the
    prefill's: each of 40 rows of x alone gives the same bits as within 2, 4, 5, 12, 13 or 40 rows; and those are
    the dequantized weights' product with x so rounded."""
    ggml_id = quantized.GGUF_TYPES[kind][0]
    raw = random_blocks(kind, 70, 1024, seed=5)  # (70 weight rows: two prefill tiles and a tail)
    blocks = torch.from_numpy(raw)
    want = torch.from_numpy(gguf.quants.dequantize(raw, Q[kind]).reshape(70, 1024).copy())
    x = torch.randn(40, 1024, generator=torch.Generator().manual_seed(4))
    x[2, 300] = 50.0  # (an outlier: its 256 values' bytes coarser, the others' not)
    alone = torch.cat([torch.ops.dense_kernels.linear_gguf(x[i:i + 1], blocks, ggml_id) for i in range(40)])
    for m in (2, 4, 5, 12, 13, 40):
        assert torch.equal(torch.ops.dense_kernels.linear_gguf(x[:m], blocks, ggml_id), alone[:m]), (kind, m)
    assert_bytes_product(kind, x, blocks, want)



BLOCKS_ON_BOTH_ISAS = """
import sys, torch
from dense_engine.cpu import kernels, quantized
assert kernels.available()
scales = %r
out = {}
for kind, (ggml_id, values, size) in quantized.GGUF_TYPES.items():
    for n, k in ((37, 1024), (9, 2304)):
        g = torch.Generator().manual_seed(n + k)
        blocks = torch.randint(0, 256, (n, k // values, size), dtype=torch.uint8, generator=g)
        for at in scales[kind]:
            blocks[..., at:at + 2] = (torch.randn(n, k // values, 1, generator=g) * 0.01).half().view(torch.uint8)
        x = torch.randn(40, k, generator=g)
        x[2, 100] = 40.0
        for m in (1, 2, 3, 5, 12, 13, 40):
            out[f"{kind}-{n}-{k}-{m}"] = torch.ops.dense_kernels.linear_gguf(x[:m], blocks.reshape(n, -1), ggml_id)
torch.save(out, sys.argv[1])
print(kernels.avx2_only())
""" % SCALES  # noqa: UP031 (a script full of braces)


@pytest.mark.slow
@other_builds
@pytest.mark.skipif(not kernels.available() or kernels.avx2_only(), reason="needs the AVX-512 kernels beside AVX2's")
def test_gguf_blocks_give_the_same_bits_on_both_instruction_sets(tmp_path):
    """Every block type sums in kernels.h's one order on both ISAs (x in bytes, the integer sums, then the same float
    steps): kernels.cpp and kernels_avx2.cpp (DENSE_KERNELS=avx2) give the same bits, decoding (1-12 rows: AVX-512's
    K-quant tiles reduce two outputs at a time) and prefilling."""
    got = {}
    for isa in ("", "avx2"):
        path = str(tmp_path / f"blocks{isa}.pt")
        run = subprocess.run([sys.executable, "-c", BLOCKS_ON_BOTH_ISAS, path], cwd=ROOT, capture_output=True,
                             text=True, env={**os.environ, "DENSE_KERNELS": isa}, check=False)
        assert run.stdout.strip() == str(isa == "avx2"), run.stderr[-2000:]
        got[isa] = torch.load(path, weights_only=True)
    assert got[""].keys() == got["avx2"].keys()
    assert [k for k in got[""] if not torch.equal(got[""][k], got["avx2"][k])] == []

def x_in_bytes(x: torch.Tensor, group: int) -> torch.Tensor:
    """x as a GGUF prefill rounds it (float64): each group of values (K-quants 256, llama.cpp's Q8_K; 32-blocks 32,
    its Q8_0) to 8 bits, q = x * (127 / max|x|) rounded to the nearest (even) integer in float32, times max|x| / 127."""
    xb = x.reshape(*x.shape[:-1], -1, group)
    top = xb.abs().amax(-1, keepdim=True)
    inv = torch.where(top > 0, torch.full_like(top, 127) / top, 0)  # (127 / top would be 127 * (1 / top))
    q = torch.round(xb * inv)
    return (q.double() * (top / 127).double()).reshape(x.shape)


def assert_bytes_product(kind: str, x: torch.Tensor, blocks: torch.Tensor, want: torch.Tensor):
    """At any number of rows, decoding or prefilling: the dequantized weights' product with x rounded to bytes, to
    float32's rounding of the sums; PyTorch's kernels: bfloat16."""
    got = torch.ops.dense_kernels.linear_gguf(x, blocks, quantized.GGUF_TYPES[kind][0])
    if kernels.available():
        group = 256 if kind.endswith("_K") else 32
        ref = x_in_bytes(x, group) @ want.double().T
        assert (got.double() - ref).abs().max() <= 2e-5 * ref.abs().max(), kind
        # and what rounding x costs: each input within half a step (max|x| / 254 of its group), so an output within
        # those half-steps times |w|
        exact = x.double() @ want.double().T
        half_steps = (x.reshape(x.shape[0], -1, group).abs().amax(-1, keepdim=True) / 254).expand(-1, -1, group)
        bound = half_steps.reshape(x.shape).double() @ want.abs().double().T
        assert ((got.double() - exact).abs() <= bound * (1 + 1e-5)).all(), kind
    else:
        assert torch.allclose(got, (x.bfloat16() @ want.bfloat16().T).float(), rtol=1e-2, atol=1e-2 * got.abs().max())


@needs_kernels
@pytest.mark.parametrize("kind", list(quantized.GGUF_TYPES))
def test_the_largest_codes_against_the_largest_x_stay_exact(kind):
    """Every code at its extreme (bytes all 0xFF, then all 0x00: Q8_0's -1 and 0, the 4-bit types' 15 and 0, ...)
    against x whose bytes are all +-127: the products' int16 pairs (AVX2's vpmaddubsw, several groups added before
    vpmaddwd) at their largest, the prefill's and (AVX2's K-quants) the decode's results still the exact product of
    x in bytes."""
    _, values, size = quantized.GGUF_TYPES[kind]
    for fill in (0xFF, 0x00, 0x80, 0x7F):
        raw = np.full((20, 2 * 256 // values, size), fill, dtype=np.uint8)
        for at in SCALES[kind]:
            raw[..., at:at + 2] = np.array([0.01], dtype=np.float16).view(np.uint8)
        raw = raw.reshape(20, -1)
        want = torch.from_numpy(gguf.quants.dequantize(raw, Q[kind]).reshape(20, 512).copy())
        for sign in (1.0, -1.0):
            x = torch.full((16, 512), sign)
            x[1::2] *= torch.linspace(0.5, 1, 512)  # (every other row not all equal)
            assert_bytes_product(kind, x, torch.from_numpy(raw), want)
            assert_bytes_product(kind, x[:3], torch.from_numpy(raw), want)  # (the decoding tiles)


@needs_kernels
@pytest.mark.parametrize("kind", ["Q6_K", "Q4_K", "Q5_0"])
def test_prefill_over_several_weight_tiles(kind):
    """300 weight rows of 4096 inputs: 32-row tiles and a tail of 12 (AVX2: 16-row tiles and a tail of 12), x in
    bytes; x of 2 x 20 rows, each a row with one large input."""
    raw = random_blocks(kind, 300, 4096)
    want = torch.from_numpy(gguf.quants.dequantize(raw, Q[kind]).reshape(300, 4096).copy())
    x = torch.randn(2, 20, 4096, generator=torch.Generator().manual_seed(1))
    x[:, :, 700] = 40  # an outlier channel (as LLMs have): it coarsens its own 256 values' bytes only
    got = torch.ops.dense_kernels.linear_gguf(x, torch.from_numpy(raw), quantized.GGUF_TYPES[kind][0])
    assert got.shape == (2, 20, 300)
    assert_bytes_product(kind, x.reshape(40, 4096), torch.from_numpy(raw), want)


@needs_kernels
@pytest.mark.parametrize("rows", [3, 40])
def test_a_fused_projection_writes_its_parts_in_place_in_the_models_order(rows):
    """Parts of three types (q|k in Q4_K, v in Q6_K, a Q8_0), llama's q/k rows permuted: each part's kernel writes its
    outputs into their columns (linear_gguf_into), the same bits as joining the parts' outputs and reordering them."""
    kinds, sizes = ["Q4_K", "Q6_K", "Q8_0"], [96, 40, 33]
    raws = [torch.from_numpy(random_blocks(kind, n, 512, seed=n)) for kind, n in zip(kinds, sizes)]
    order = torch.cat([gguf_import.unpermute(torch.arange(96), 4), torch.arange(96, 169)])
    layer = quantized.GGUFLinear(512, 169, False, parts=list(zip(kinds, raws)), order=order)
    x = torch.randn(1, rows, 512)
    parts = [torch.ops.dense_kernels.linear_gguf(x, raw, quantized.GGUF_TYPES[kind][0])
             for kind, raw in zip(kinds, raws)]
    with torch.no_grad():
        assert torch.equal(layer(x), torch.cat(parts, dim=-1)[..., order])


def write_mixed(path, tied: bool) -> None:
    """A small llama whose tensors are of MIXED's types (the same file every time: seeded weights and blocks; a
    pre-tokenizer llama.cpp knows, for tests/gguf_reference.py)."""
    write_gguf(path, small_llama(tied=tied, hidden=256, ffn=512), original_tokenizer("gpt2"), "llama-bpe", MIXED)


@pytest.fixture(scope="module")
def mixed_files(tmp_path_factory):
    files = {}
    for tied in (True, False):
        path = tmp_path_factory.mktemp("gguf") / f"mixed-{'tied' if tied else 'head'}.gguf"
        write_mixed(path, tied)
        files[tied] = str(path)
    return files


@pytest.mark.parametrize("tied", [True, False])
def test_auto_keeps_every_tensor_in_its_own_type(mixed_files, tied):
    model = load.from_pretrained(mixed_files[tied], quant="auto")
    assert load.auto_mode(load.convert.read_checkpoint(mixed_files[tied]))[0] == "gguf"
    assert isinstance(model.embed_tokens, quantized.GGUFEmbedding) and model.embed_tokens.kind == "Q6_K"
    assert model.lm_head.kinds == (["Q6_K"] if tied else ["Q5_K"])
    if tied:  # the head multiplies the embedding's own blocks
        assert model.lm_head.blocks0.data_ptr() == model.embed_tokens.blocks.data_ptr()
    for layer in model.layers:
        assert layer.mixer.qkv_proj.kinds == ["Q4_K", "Q6_K"]  # q|k in one buffer, v in its own
        assert layer.mixer.o_proj.kinds == ["Q5_K"]
        assert layer.mlp.gate_up_proj.kinds == ["Q4_K", "Q8_0"] and layer.mlp.down_proj.kinds == ["Q6_K"]
    # no float copy of any weight: what the model holds is the file's blocks and its norms
    held = sum(t.numel() * t.element_size() for t in {t.data_ptr(): t for t in model.buffers()}.values())
    held += sum(p.numel() * p.element_size() for p in model.parameters())
    assert held <= os.path.getsize(mixed_files[tied])
    assert all(p.ndim == 1 for p in model.parameters())


@pytest.mark.parametrize("tied", [True, False])
def test_embeddings_exact_and_the_fallback_the_float_path_on_the_same_file(mixed_files, tied, monkeypatch):
    """(The kernels take x in bytes: the next test holds their logits to llama.cpp's distance from the float path;
    their ops, test_kernels_equal_ggufs_dequantizer_and_the_float_product.)"""
    blocks = load.from_pretrained(mixed_files[tied], quant="auto")
    plain = load.from_pretrained(mixed_files[tied], quant="none")  # gguf's dequantizer, float32
    ids = torch.randint(0, 400, (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = plain.double()(ids)
        assert torch.equal(blocks.embed_tokens(ids), plain.float().embed_tokens(ids))  # rows dequantized exactly
        monkeypatch.setattr(kernels, "available", lambda: False)  # the fallback: dequantize-and-matmul in PyTorch
        fallback = blocks(ids)
    assert (fallback - want).abs().max() <= 1e-5 * want.abs().max()


KQUANT_REFERENCE = os.path.join(os.path.dirname(__file__), "fixtures", "gguf", "kquant_prefill")


def test_a_long_prefill_is_as_near_the_float_path_as_llama_cpps(mixed_files):
    """The GGUF linears take x rounded to 8 bits a value (llama.cpp's Q8_K and Q8_0, as llama.cpp computes them): a
    40-token prefill's logits, and the same tokens decoded through the cache, are no farther from the float path than
    llama.cpp's own on the same file (its logits made once by tests/gguf_reference.py --kquant-prefill), and near
    them, on either ISA. (On PyTorch's kernels the products are bfloat16's: near the float path.)"""
    from safetensors.torch import load_file

    with open(KQUANT_REFERENCE + ".json") as f:
        record = json.load(f)
    path = mixed_files[False]
    assert hashlib.sha256(Path(path).read_bytes()).hexdigest() == record["digest"]  # the very file
    theirs = load_file(KQUANT_REFERENCE + ".safetensors")["logits"]
    ids = torch.tensor([record["ids"]])
    with torch.no_grad():
        want = load.from_pretrained(path, quant="none").double()(ids)[0].float()
        got = load.from_pretrained(path, quant="auto")(ids)[0]

    def rms(a):  # the typical difference from the float path, relative to its logits'
        return float((a - want).square().mean().sqrt() / want.square().mean().sqrt())

    def largest(a):
        return float((a - want).abs().max() / want.abs().max())

    def as_near_as_theirs(a):
        assert rms(a) <= 1.1 * rms(theirs) and largest(a) <= 1.25 * largest(theirs), (rms(a), rms(theirs))

    as_near_as_theirs(got)
    if kernels.available():  # the decoding tiles take x in bytes too: the same tokens through the cache in steps of
        model = load.from_pretrained(path, quant="auto")  # up to 10, as near
        caches.setup_cache(model, 1, ids.shape[1])
        n = ids.shape[1]
        with torch.no_grad():
            steps = [model(ids[:, s:s + 10], torch.arange(s, min(s + 10, n)))[0] for s in range(0, n, 10)]
        as_near_as_theirs(torch.cat(steps))
    if kernels.available():  # the same rounding: nearer llama.cpp's than either is to the float path
        assert float((got - theirs).square().mean().sqrt() / theirs.square().mean().sqrt()) <= 0.25 * rms(theirs)
    else:  # bfloat16 (PyTorch) products of the dequantized weights
        assert rms(got) <= 1e-2 * rms(theirs), rms(got)


def test_cached_and_compiled_decoding_equal_plain_passes(mixed_files):
    model = load.from_pretrained(mixed_files[True], quant="auto")
    prompt = torch.randint(0, 400, (1, 9), generator=torch.Generator().manual_seed(2))
    eager = torch.cat(list(generate.generate_tokens(model, prompt, 12)), dim=1)
    ids = prompt
    with torch.no_grad():  # the plain path: a whole pass per token, no cache (its linears round x to bytes as the
        for _ in range(12):  # cached steps' do, whatever the number of rows: kernels.h)
            ids = torch.cat([ids, model(ids)[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(eager, ids[:, 9:])
    if kernels.available():  # the compiled prefill pads a prompt to PREFILL_CHUNK rows, past GEMM_ROWS: against an
        # eager prefill past them too (x in bytes: each row's result the same whatever the rows around it)
        prompt = torch.randint(0, 400, (1, kernels.GEMM_ROWS + 2), generator=torch.Generator().manual_seed(3))
        eager = torch.cat(list(generate.generate_tokens(model, prompt, 12)), dim=1)
        compiled = torch.cat(list(generate.generate_tokens(model, prompt, 12, steps=Steps(model, saved=False))), dim=1)
        assert torch.equal(compiled, eager)


def test_quant_gguf_on_a_file_without_blocks_is_one_line(tmp_path):
    tok = original_tokenizer("gpt2")
    path = tmp_path / "f32.gguf"
    write_gguf(path, small_llama(tied=True), tok, "gpt2", {})
    with pytest.raises(CheckpointError, match="--quant gguf: .* is not a GGUF file with quantized blocks"):
        load.from_pretrained(str(path), quant="gguf")


def test_a_truncated_block_tensor_is_one_line(mixed_files, tmp_path):
    data = Path(mixed_files[False]).read_bytes()
    short = tmp_path / "short.gguf"
    short.write_bytes(data[:-5000])  # the last tensor (a layer's) loses its end
    with pytest.raises(CheckpointError, match="short.gguf"):
        load.from_pretrained(str(short), quant="auto")
