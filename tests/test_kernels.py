"""kernels.cpp (or kernels_avx2.cpp, on a CPU without AVX-512) against independent float64 implementations (the
dequantized weights' product, the attention over the visible slots), on shapes that exercise every
tail (rows beyond one tile of 8, widths that are not multiples of the vector width, odd output counts), eager and
inside a compiled graph; and nf4 on bitsandbytes' packed kernel against the dequantized weights.

This file and tests/test_gguf_blocks.py run once per build of the kernels the machine can run (.ci/kernels: the CPU's
own, then DENSE_KERNELS=avx512, avx2, avx2-vnni where it runs them), each in a process of its own."""

import os
import re
import shutil
import subprocess
import sys

import pytest
import torch
from conftest import other_builds

import dense
from dense_engine.cpu import kernels, quantized
from dense_engine.runtime import caches, generate
from dense_engine.runtime.steps import Steps

needs_kernels = pytest.mark.skipif(not kernels.available(), reason="no AVX2 or AVX-512 CPU, or no C++ compiler")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def instructions(library: str) -> str:
    return subprocess.run(["objdump", "-d", library], capture_output=True, text=True, check=False).stdout


# what only an EVEX instruction (AVX-512) names: a zmm register, a mask register, xmm16-31 / ymm16-31, a broadcast
EVEX_ONLY = re.compile(r"zmm|%k[0-7]\b|%[xy]mm(1[6-9]|2[0-9]|3[01])\b|\{1to[0-9]+\}")


@needs_kernels
def test_the_loaded_build_is_the_one_asked_for():
    """.ci/kernels runs this file under each build the machine can run: each process loads the build DENSE_KERNELS
    asks for (unset: the CPU's own, kernels.cpp wherever AVX-512 VNNI is), and its library holds what that build
    means: avx2 no EVEX instruction (a CPU without AVX-512 runs it), avx2-vnni vpdpbusd, kernels.cpp AVX512-BF16's
    vcvtneps2bf16 exactly where the CPU has BF16 and the build is its own (avx512: Cascade Lake's and Ice Lake's
    instructions alone)."""
    forced = os.environ.get("DENSE_KERNELS") or "native"
    flags = set(kernels.cpu_flags().split())
    want = (kernels.FORCED[forced][0] if forced in kernels.FORCED
            else "kernels.cpp" if kernels.SOURCES["kernels.cpp"] <= flags else "kernels_avx2.cpp")
    assert kernels._state["source"] == want and kernels.avx2_only() == (want == "kernels_avx2.cpp")
    assert kernels.build_name().startswith(f"{want} ({forced}")
    assert kernels.isa_flags("avx2") == ["-mno-avx512f"] and kernels.isa_flags("avx2-vnni") == []
    assert kernels.isa_flags("avx512") == ["-march=cascadelake"]
    assert kernels.isa_flags(None) == kernels.isa_flags("0") == kernels.isa_flags("") == []
    if shutil.which("objdump") is None:
        pytest.skip("no objdump to read the library with")
    code = instructions(kernels.library())
    assert "\tret" in code  # (read)
    if forced == "avx2":
        assert EVEX_ONLY.search(code) is None
    if forced == "avx2-vnni":
        assert "vpdpbusd" in code
    if want == "kernels.cpp":
        assert ("vcvtneps2bf16" in code) == (forced == "native" and "avx512_bf16" in flags)


@other_builds
@pytest.mark.skipif(not kernels.available() or kernels.compiler() is None, reason="no C++ compiler")
def test_the_avx2_build_takes_vpdpbusd_where_the_cpu_has_vnni(tmp_path):
    """kernels_avx2.cpp's int8 products: AVX-VNNI's VEX vpdpbusd where -march=native enables it (Alder Lake and
    later), AVX-512 VNNI's 256-bit one under DENSE_KERNELS=avx2-vnni, and vpmaddubsw + vpmaddwd without either (the
    kernel tests pass on each build the machine runs: .ci/kernels). This machine may have no AVX-VNNI: the VEX build
    is only compiled (-mavxvnni) and read, not run."""
    source = os.path.join(os.path.dirname(kernels.__file__), "kernels_avx2.cpp")
    vex, plain = str(tmp_path / "vex.so"), str(tmp_path / "plain.so")
    kernels.build(source, vex, ["-mno-avx512f", "-mavxvnni"])
    kernels.build(source, plain, ["-mno-avx512f", "-mno-avxvnni"])
    if shutil.which("objdump") is not None:
        assert "{vex} vpdpbusd" in instructions(vex) and EVEX_ONLY.search(instructions(vex)) is None
        assert "vpdpbusd" not in instructions(plain) and "vpmaddubsw" in instructions(plain)
        assert EVEX_ONLY.search(instructions(plain)) is None


BF16_WORDS = r"""
#include <immintrin.h>
#include <cstdint>
#include <cstdio>
namespace native {
%(function)s
#ifdef __AVX512BF16__
const int bf16 = 1;
#else
const int bf16 = 0;
#endif
}
#undef __AVX512BF16__
namespace plain {
%(function)s
}
// vcvtneps2bf16 as Intel's SDM writes it: a zero or denormal to a zero of its sign, a NaN's high half with bit 6
// set, else + 0x7FFF + the kept lowest bit (nearest even), the high half
uint16_t sdm(uint32_t x) {
  const uint32_t e = x & 0x7F800000u;
  if (e == 0) return (uint16_t)(x >> 16 & 0x8000);
  if (e == 0x7F800000u) return (uint16_t)(x >> 16 | ((x & 0x7FFFFF) ? 0x40 : 0));
  return (uint16_t)((x + 0x7FFF + (x >> 16 & 1)) >> 16);
}
int main() {
  uint64_t differ = 0, off = 0;
  alignas(64) uint32_t in[16];
  alignas(32) uint16_t out[16];
  for (uint64_t base = 0; base < (1ull << 32); base += 16) {
    for (int i = 0; i < 16; ++i) in[i] = (uint32_t)(base + i);
    const __m512 x = _mm512_load_ps((const float*)in);
    const __m256i p = plain::bf16_words(x);
    differ += __builtin_popcount(~_mm256_cmpeq_epi16_mask(p, native::bf16_words(x)) & 0xFFFF);
    _mm256_store_si256((__m256i*)out, p);
    for (int i = 0; i < 16; ++i) off += out[i] != sdm(in[i]);
  }
  printf("%%d %%llu %%llu\n", native::bf16, (unsigned long long)differ, (unsigned long long)off);
}
"""


@pytest.mark.skipif(kernels.compiler() is None
                    or not kernels.SOURCES["kernels.cpp"] <= set(kernels.cpu_flags().split()),
                    reason="needs a C++ compiler and an AVX-512 VNNI CPU")
def test_bfloat16_words_are_the_same_with_and_without_avx512_bf16(tmp_path):
    """kernels.cpp's one AVX512-BF16 instruction (vcvtneps2bf16: nf4's and GGUF blocks' weights as bfloat16) and the
    integer steps that stand in for it where the CPU has no BF16 (Cascade Lake, Ice Lake): kernels.cpp's bf16_words
    compiled both ways gives the same word for every one of the 2^32 float32 bit patterns, and the SDM's definition
    (the same function twice where this CPU has no BF16: then the definition is what it is checked against)."""
    with open(os.path.join(os.path.dirname(kernels.__file__), "kernels.cpp")) as f:
        text = f.read()
    function = re.search(r"inline __m256i bf16_words\(__m512 x\) \{\n.*?\n\}\n", text, re.DOTALL).group(0)
    source, program = tmp_path / "bf16.cpp", str(tmp_path / "bf16")
    source.write_text(BF16_WORDS % {"function": function})
    built = subprocess.run([kernels.compiler(), "-O2", "-march=native", "-w", str(source), "-o", program],
                           capture_output=True, text=True, check=False)
    assert built.returncode == 0, built.stderr[-2000:]
    bf16 = str(int("avx512_bf16" in kernels.cpu_flags().split()))  # (native: the instruction where the CPU has it)
    assert subprocess.run([program], capture_output=True, text=True, check=False).stdout.split() == [bf16, "0", "0"]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


@needs_kernels
@pytest.mark.parametrize("M, N, K", [(1, 5, 48), (1, 9, 2050), (3, 64, 100), (8, 37, 576), (13, 128, 64),
                                     (16, 9, 1536)])
def test_f32_kernel(M, N, K):
    torch.manual_seed(M * N + K)
    x, w = torch.randn(M, K), torch.randn(N, K)
    y = torch.ops.dense_kernels.linear_f32(x, w)
    assert y.shape == (M, N) and rel(y, x.double() @ w.double().T) < 1e-5


@needs_kernels
@pytest.mark.parametrize("K", [40, 576, 2048, 2064, 8200])
def test_f32_kernel_rows_do_not_depend_on_the_batch(K):
    """One row of x takes its own tiling (one weight row at a time up to K = 2048), a few rows 4 weight rows a tile,
    past 16 (AVX2: 24) the GEMM of packed blocks (kernels.h's tile_gemm: 8 or 6 rows of x a block, 48 or 32 weight rows
    a panel, K in chunks from 8192 or 1024 on, a masked last step where K % 16): each output the same bits in any call,
    so a row generates the same tokens alone, in a batch or in a prompt of any length; and the float64 product."""
    torch.manual_seed(K)
    x, w = torch.randn(61, K), torch.randn(67, K)
    whole = torch.ops.dense_kernels.linear_f32(x, w)
    assert rel(whole, x.double() @ w.double().T) < 1e-5
    for row in range(0, 61, 6):
        assert torch.equal(whole[row], torch.ops.dense_kernels.linear_f32(x[row:row + 1], w)[0])
    # the tiles (11), the GEMM (25: whole blocks and a last row)
    for rows in (slice(0, 11), slice(11, 36), slice(36, 61)):
        assert torch.equal(whole[rows], torch.ops.dense_kernels.linear_f32(x[rows], w))


@pytest.mark.parametrize("shape, bias", [((1, 17, 576), False), ((2, 128, 1536), True), ((3, 40, 100), True)])
def test_many_row_float32_linear_is_the_float64_product(shape, bias):
    """A prefill's float32 linear (the kernels' GEMM where they load, else F.linear): the float64 product, and with
    autograd on (then F.linear, which has a backward) too."""
    torch.manual_seed(shape[1])
    layer = kernels.Linear(shape[-1], 64 + shape[1], bias=bias)
    x = torch.randn(shape)
    want = x.double() @ layer.weight.double().T + (layer.bias.double() if bias else 0)
    with torch.no_grad():
        fast = layer(x)
    assert fast.shape == want.shape and rel(fast, want) < 1e-5
    trained = layer(x)
    trained.sum().backward()
    assert rel(trained.detach(), want) < 1e-5 and layer.weight.grad is not None


@needs_kernels
@pytest.mark.parametrize("threads", [3, 8])
def test_kernels_compute_each_output_once_whatever_the_threads(threads):
    # the threads share a matmul's tiles and take over the rest of each other's share (for_each_tile_shared); more
    # threads than cores get preempted mid-share, so shares are split while in use (measured: 4-14 splits a call).
    # Each output must still be the bits one thread alone computes; a new x every call, so a missed output (left
    # as whatever the allocator returned) cannot match
    torch.manual_seed(threads)
    N, K = 16387, 64  # 64 blocks of 256 weight rows (64 KB of float32) and a tail
    w = torch.randn(N, K)
    i8 = quantized.int8_quantize(w)
    i8 = kernels.pack_int8(i8["weight"], i8["scales"])
    layer = quantized.Int4Linear(K, N, False, group_size=32)
    layer._buffers.update(quantized.int4_quantize(w, 32))
    i4 = kernels.pack_int4(layer.qweight, layer.scales, layer.mins, 32)
    ops = [lambda x: torch.ops.dense_kernels.linear_f32(x, w),
           lambda x: torch.ops.dense_kernels.linear_int8(x, i8["kernel_weight"], i8["kernel_scales"]),
           lambda x: torch.ops.dense_kernels.linear_int4(x, i4["kernel_weight"], i4["kernel_scales"],
                                                         i4["kernel_mins"])]
    xs = [torch.randn(1 + i % 3, K) for i in range(12)] + [torch.randn(40, K)]  # (40: float32's and int8's GEMMs)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        want = [op(x) for op in ops for x in xs]
        torch.set_num_threads(threads)
        got = [op(x) for op in ops for x in xs]
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


@needs_kernels
@pytest.mark.parametrize("M, N, K", [(1, 7, 64), (5, 64, 128), (9, 33, 576), (16, 128, 256), (3, 5, 192),
                                     (33, 7, 64), (40, 64, 576), (200, 33, 192), (64, 20, 4096), (37, 100, 2112)])
def test_int8_kernel_is_the_dequantized_weights_product(M, N, K):
    """x in two int8 digits a row at every number of rows: the tiles up to 16 rows (AVX2: 12), past them kernels.h's
    int8_gemm (the digits joined in 16-bit words, K = 2112 in chunks of 1024 products, N past whole panels), the same
    exact integer sums: each row the same bits alone as in the batch."""
    torch.manual_seed(M + N + K)
    x = torch.randn(M, K) * torch.rand(M, 1) * 3
    x[:, 5] = 30  # (an outlier coarsens its own row's digits)
    q = quantized.int8_quantize(torch.randn(N, K))
    packed = kernels.pack_int8(q["weight"], q["scales"])
    op = lambda x: torch.ops.dense_kernels.linear_int8(x, packed["kernel_weight"], packed["kernel_scales"])
    y = op(x)
    weight = q["weight"].double() * q["scales"].double()[:, None]
    want = x.double() @ weight.T
    # activations in two int8 digits a row: each within 1/32258 of the row's largest value, so each output within
    # sum_k |w_k| of that; and well inside it, as the rounding errors mostly cancel
    bound = weight.abs().sum(1)[None, :] * x.abs().amax(1, keepdim=True).double() / 32258
    assert ((y.double() - want).abs() <= bound).all() and rel(y, want) < 5e-4
    assert all(torch.equal(op(x[m:m + 1]), y[m:m + 1]) for m in range(0, M, max(1, M // 7)))
    assert all(torch.equal(op(x[a:b]), y[a:b]) for a, b in ((0, 3), (1, M), (M // 2, M)))


@needs_kernels
def test_int8_linear_takes_the_kernel_at_every_length_of_a_dynamic_prefill():
    """kernels.linear_int8 in a graph whose row count is dynamic (2..32, as generate.py's prefill step) multiplies
    by the kernel (x in two int8 digits: within 1/32258 of each row's largest value) at 7, 20 and 32 rows, eager too,
    and eager past the step's rows (48: kernels.h's int8_gemm)."""
    torch.manual_seed(3)
    q = quantized.int8_quantize(torch.randn(96, 192))
    packed = kernels.pack_int8(q["weight"], q["scales"])
    weight = q["weight"].double() * q["scales"].double()[:, None]
    kernels.register_shapes()  # (as steps.before_tracing does before a compile)
    step = torch.compile(lambda x: kernels.linear_int8(x, packed["kernel_weight"], packed["kernel_scales"]),
                         fullgraph=True)
    for M in (20, 32, 7):
        x = torch.randn(M, 192)
        torch._dynamo.mark_dynamic(x, 0, min=2, max=generate.PREFILL_CHUNK)  # (the compiled prefill step's range)
        want = x.double() @ weight.T
        bound = weight.abs().sum(1)[None, :] * x.abs().amax(1, keepdim=True).double() / 32258
        for y in (step(x), kernels.linear_int8(x, packed["kernel_weight"], packed["kernel_scales"])):
            assert ((y.double() - want).abs() <= bound).all(), M
    x = torch.randn(48, 192)
    bound = weight.abs().sum(1)[None, :] * x.abs().amax(1, keepdim=True).double() / 32258
    assert ((kernels.linear_int8(x, packed["kernel_weight"], packed["kernel_scales"]).double()
             - x.double() @ weight.T).abs() <= bound).all()


@needs_kernels
@pytest.mark.parametrize("M, N, K", [(1, 3, 64), (4, 64, 192), (11, 29, 576), (17, 64, 128), (2, 5, 96), (70, 40, 256)])
def test_int4_kernel_is_the_dequantized_weights_product(M, N, K):
    """At every number of rows: x with a scale per 32 as a 16-bit integer and a byte (within 2^-23 of its 32's
    largest), exact integer sums per block: the dequantized weights' product to float32's precision; each row the same
    bits alone as beside the others (N not a multiple of 16: a last group of fewer weight rows)."""
    torch.manual_seed(M * K + N)
    x = torch.randn(M, K) * 2
    x[:, 7] = 40  # (an outlier coarsens its own 32 only)
    stored = quantized.int4_quantize(torch.randn(N, K) * 0.1, 32)
    layer = quantized.Int4Linear(K, N, False, group_size=32)
    layer._buffers.update(stored)
    packed = kernels.pack_int4(stored["qweight"], stored["scales"], stored["mins"], 32)
    op = lambda x: torch.ops.dense_kernels.linear_int4(x, packed["kernel_weight"], packed["kernel_scales"],
                                                      packed["kernel_mins"])
    y = op(x)
    want = x.double() @ layer.dequantize(torch.float64).T
    assert rel(y, want) < 1e-6
    assert all(torch.equal(op(x[m:m + 1]), y[m:m + 1]) for m in range(M))
    assert torch.equal(torch.ops.dense_kernels.dequantize_int4(packed["kernel_weight"], packed["kernel_scales"],
                                                               packed["kernel_mins"]),
                       layer.dequantize(torch.float32).to(torch.bfloat16))  # (the packed layout read back)


@needs_kernels
@pytest.mark.parametrize("mode", ["none", "int8", "int4"])
def test_compiled_graph_calls_the_same_kernels(mode):
    torch.manual_seed(0)
    linear = torch.nn.Linear(128, 96, bias=True)
    if mode == "none":
        layer = kernels.Linear(128, 96, bias=True)
        layer.load_state_dict(linear.state_dict())
    else:
        layer = quantized.LINEARS[mode](128, 96, True, group_size=32)
        layer._buffers.update(layer.stored(linear.weight.detach()))
        layer.bias = torch.nn.Parameter(linear.bias.detach(), requires_grad=False)
        layer.finish_loading()
    x = torch.randn(4, 128)
    eager = layer(x)
    kernels.register_shapes()  # (as steps.before_tracing does before a compile)
    compiled = torch.compile(lambda t: layer(t), fullgraph=True)(x)
    assert torch.allclose(eager, compiled, rtol=1e-6, atol=1e-6)
    weight = linear.weight if mode == "none" else layer.dequantize(torch.float32)
    reference = x.double() @ weight.double().T + linear.bias.double()
    assert rel(eager, reference) < 5e-5  # int8: activations in two int8 digits (see test_int8_kernel...)


@pytest.mark.parametrize("out_features, in_features", [(64, 64), (96, 192), (256, 576), (48, 64), (64, 96), (5, 128)])
def test_nf4_kernel_equals_the_dequantized_weights(out_features, in_features):
    torch.manual_seed(out_features + in_features)
    w = torch.randn(out_features, in_features) * 0.05
    layer = quantized.NF4Linear(in_features, out_features, False)
    stored = quantized.nf4_quantize(w)
    layer._buffers.update({k: v.clone() for k, v in stored.items()})
    layer.finish_loading()
    # our kernel takes rows that are whole 64-blocks; other shapes keep the dequantize path
    assert hasattr(layer, "kernel_weight") == (kernels.available() and in_features % 64 == 0)
    weight = layer.dequantize(torch.float64)
    for rows in (1, 3, 12, 40):  # the tiles, and a long prefill (the GEMM in the tiles' order)
        x = torch.randn(rows, in_features)
        x[:, 3] = 20  # (an outlier: x's digits coarsen with its row's largest value)
        reference = x.double() @ weight.T
        if hasattr(layer, "kernel_weight"):
            # kernels.h's nf4 (both ISAs): x in two int8 digits (within 1/32258 of the row's largest value, as int8's)
            # and NF4's values to 15 bits (within 2^-15 of the block's absmax)
            absmax = layer.kernel_absmax.double().repeat_interleave(64, 1)
            bound = (weight.abs().sum(1)[None] * x.abs().amax(1, keepdim=True).double() / 32258
                     + x.abs().double() @ absmax.T / 32768)
            y = layer(x)
            assert ((y.double() - reference).abs() <= bound).all() and rel(y, reference) < 1e-3
            assert rel(y, reference) > 1e-6  # (not float32's product)
        else:
            assert rel(layer(x), reference) < 1e-5
    if hasattr(layer, "kernel_weight"):  # a long prefill's bfloat16 weights: the same bits as PyTorch's rounding
        assert torch.equal(torch.ops.dense_kernels.dequantize_nf4(layer.kernel_weight, layer.kernel_absmax, layer.code),
                           layer.dequantize(torch.bfloat16))
    assert torch.equal(layer.weight, stored["weight"]) and torch.equal(layer.absmax, stored["absmax"])  # unchanged


@needs_kernels
@pytest.mark.parametrize("M, N, K", [(13, 33, 64), (17, 40, 576), (40, 70, 2112), (200, 33, 192), (30, 9, 8256)])
def test_nf4_kernel_rows_do_not_depend_on_the_batch(M, N, K):
    """Past 16 rows of x nf4 runs kernels.h's tile_gemm: each thread's panel of 16 weight rows decoded once a call into
    15-bit words in the tiles' order, 6 rows of x a block, K in chunks of 1024 values (2112: three), N past whole
    panels; each output the decoding tiles' own order of sums, so each row the same bits alone as in the batch."""
    torch.manual_seed(M + N + K)
    layer = quantized.NF4Linear(K, N, False)
    layer._buffers.update(quantized.nf4_quantize(torch.randn(N, K) * 0.05))
    layer.finish_loading()
    op = lambda x: torch.ops.dense_kernels.linear_nf4(x, layer.kernel_weight, layer.kernel_absmax, layer.code)
    x = torch.randn(M, K) * torch.rand(M, 1) * 3
    x[:, 5] = 30
    y = op(x)
    assert rel(y, x.double() @ layer.dequantize(torch.float64).T) < 1e-3
    assert all(torch.equal(op(x[m:m + 1]), y[m:m + 1]) for m in range(M))


NF4_ON_BOTH_ISAS = """
import sys, torch
from dense_engine.cpu import kernels, quantized
sys.path.insert(0, "tests")
from test_gguf_blocks import SCALES
out = {}
for n, k, m in ((40, 576, 1), (40, 576, 7), (33, 192, 40), (9, 2112, 13)):
    torch.manual_seed(n + k + m)
    layer = quantized.NF4Linear(k, n, False)
    layer._buffers.update(quantized.nf4_quantize(torch.randn(n, k) * 0.05))
    layer.finish_loading()
    out[f"{n}-{k}-{m}"] = torch.ops.dense_kernels.linear_nf4(torch.randn(m, k), layer.kernel_weight,
                                                             layer.kernel_absmax, layer.code)
    out[f"{n}-{k}-{m}-bf16"] = torch.ops.dense_kernels.dequantize_nf4(layer.kernel_weight, layer.kernel_absmax,
                                                                       layer.code).view(torch.int16)
for kind, (ggml_id, values, size) in quantized.GGUF_TYPES.items():  # (bfloat16 weights: AVX512-BF16's rounding)
    g = torch.Generator().manual_seed(values + size)
    blocks = torch.randint(0, 256, (9, 2304 // values, size), dtype=torch.uint8, generator=g)
    for at in SCALES[kind]:
        blocks[..., at:at + 2] = (torch.randn(9, 2304 // values, 1, generator=g) * 0.01).half().view(torch.uint8)
    out[f"{kind}-bf16"] = torch.ops.dense_kernels.dequantize_gguf(blocks.reshape(9, -1), ggml_id, 2304,
                                                                  True).view(torch.int16)
torch.save(out, sys.argv[1])
print(kernels.build_name())
"""


@pytest.mark.slow
@other_builds
@pytest.mark.skipif(not kernels.available() or kernels.avx2_only(), reason="needs the AVX-512 kernels beside AVX2's")
def test_nf4_gives_the_same_bits_on_both_instruction_sets(tmp_path):
    """nf4 is one design in kernels.h (8 lanes of integer products, then the same float steps), built into both
    files: kernels.cpp and kernels_avx2.cpp (DENSE_KERNELS=avx2) give the same bits, decoding and prefill, and so
    does kernels.cpp without AVX512-BF16 (DENSE_KERNELS=avx512, where this CPU has BF16), nf4's and GGUF blocks'
    bfloat16 weights too."""
    builds = {"": "kernels.cpp (native", "avx2": "kernels_avx2.cpp (avx2"}
    if "avx512_bf16" in kernels.cpu_flags().split():
        builds["avx512"] = "kernels.cpp (avx512"
    got = {}
    for isa, name in builds.items():
        path = str(tmp_path / f"nf4{isa}.pt")
        run = subprocess.run([sys.executable, "-c", NF4_ON_BOTH_ISAS, path], cwd=ROOT, capture_output=True, text=True,
                             env={**os.environ, "DENSE_KERNELS": isa}, check=False)
        assert run.stdout.strip().startswith(name), run.stderr[-2000:]
        got[isa] = torch.load(path, weights_only=True)
    for isa in builds:
        assert got[isa].keys() == got[""].keys()
        assert [k for k in got[""] if not torch.equal(got[""][k], got[isa][k])] == [], isa


@needs_kernels
def test_nf4_kernel_refuses_code_values_outside_nf4s_range():
    """kernels_avx2.cpp takes the 16 values as round(v 2^14) in 16 bits, its sums bounded for |v| <= 1: a table
    past that is refused in one line on either ISA, not summed into an overflow."""
    layer = quantized.NF4Linear(64, 8, False)
    layer._buffers.update(quantized.nf4_quantize(torch.randn(8, 64)))
    layer.finish_loading()
    with pytest.raises(RuntimeError, match=r"code values must lie in \[-1, 1\]"):
        torch.ops.dense_kernels.linear_nf4(torch.randn(1, 64), layer.kernel_weight, layer.kernel_absmax,
                                           layer.code * 1.5)


def reference_attention(q, k, v, visible, scale, softcap):
    """float64 attention written out: q [B, H, T, D] over k, v [B, K, S, D]; visible [B, T, S] bool."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    scores = q.double() @ k.transpose(-1, -2) * scale
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    return scores.masked_fill(~visible[:, None], float("-inf")).softmax(-1) @ v


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int8])
@pytest.mark.parametrize("B, H, K, T, D, S, P, window, softcap, per_row", [
    (1, 9, 3, 1, 64, 4096, 100, 0, 0.0, False), (1, 9, 3, 1, 64, 4096, 3000, 0, 0.0, False),
    (2, 4, 2, 5, 16, 64, 30, 0, 0.0, False), (1, 4, 4, 3, 100, 50, 20, 0, 0.0, False),
    (2, 6, 3, 64, 32, 600, 0, 0, 0.0, False),
    (1, 9, 3, 1, 64, 4096, 3000, 700, 0.0, False), (2, 4, 2, 5, 16, 64, 30, 8, 2.5, False),
    (1, 8, 4, 3, 256, 300, 200, 0, 1.0, False), (3, 4, 2, 1, 16, 600, 0, 0, 0.0, True),
    (3, 4, 2, 2, 32, 600, 0, 20, 3.0, True),
    (1, 9, 3, 18, 64, 4096, 420, 0, 0.0, False), (1, 6, 2, 32, 64, 600, 500, 100, 0.0, False),
    (1, 9, 3, 7, 48, 300, 37, 0, 5.0, False),
    (1, 8, 2, 1, 256, 4096, 3000, 0, 0.0, False), (2, 8, 2, 3, 32, 600, 330, 0, 2.0, False),
    (1, 14, 2, 2, 64, 300, 200, 50, 0.0, False), (1, 8, 1, 2, 512, 600, 530, 0, 0.0, False)])  # (Gemma 4: 512)
def test_attention_kernel_equals_the_reference_over_the_visible_slots(dtype, B, H, K, T, D, S, P, window, softcap,
                                                                     per_row):
    """kernels.cpp's attention against float64 attention over exactly the slots each query may see: its row's own
    slots (left padding, or a row of a server's batch at its own position, in its own cache row), its sliding window,
    soft-capped scores. int8 (--kv-dtype int8): against the same attention over the int8 values times their scales."""
    torch.manual_seed(T * D + P + window)
    rows_in_cache = B + 1 if per_row else B
    cache = (caches.CPUInt8KVCache if dtype == torch.int8 else caches.CPUKVCache)(rows_in_cache, K, S, D, dtype, "cpu")
    keys, values = torch.randn(rows_in_cache, K, S + 1, D), torch.randn(rows_in_cache, K, S + 1, D)
    cache.write(dense.Step(torch.arange(S + 1), None, None, {}, {}), keys, values)
    q = torch.randn(B, H, T, D)
    pos = torch.arange(P, P + T)
    if T == 64:
        pos[40:] = S  # a padded chunk: padding writes to (and reads only) the scratch slot
    start = torch.tensor([0, 7][:B]) if B == 2 else None
    rows = None
    if per_row:  # batch rows at their own positions, in cache rows 3, 0, 1 (row 2 is another request's)
        pos = torch.stack([torch.arange(p, p + T) for p in (17, 450, 3)])
        rows = torch.tensor([3, 0, 1])
    empty = pos.new_empty(0)
    out = torch.ops.dense_kernels.attention(q, cache.k, cache.v, pos, start if start is not None else empty,
                                            rows if rows is not None else empty, D ** -0.5, window, softcap,
                                            *cache.scales())
    slots = torch.arange(S + 1)
    pos_bt = pos.expand(B, T)
    visible = slots <= pos_bt[..., None]  # [B, T, S + 1]
    if start is not None:
        visible &= slots >= start[:, None, None]
    if window:
        visible &= slots > pos_bt[..., None] - window
    visible |= slots == pos_bt[..., None]
    cache_rows = rows if rows is not None else torch.arange(B)
    if dtype == torch.int8:  # what the cache holds: int8 channels times a scale per slot and head
        (qk, sk), (qv, sv) = caches.int8_rows(keys), caches.int8_rows(values)
        assert torch.equal(cache.v, qv) and torch.equal(cache.v_scale[..., :S + 1], sv[..., 0])
        k, v = (qk.double() * sk.double())[cache_rows], (qv.double() * sv.double())[cache_rows]
    else:
        k, v = keys.to(dtype).double()[cache_rows], values.to(dtype).double()[cache_rows]
    want = reference_attention(q, k, v, visible, D ** -0.5, softcap)
    real = pos_bt < S  # [B, T]
    err = (out.double() - want).abs().amax(dim=(1, 3))[real].max()
    assert err < 2e-6
    if (~real).any() and dtype != torch.int8:  # (int8: the scratch slot's channels, unscaled: never read either)
        scratch = v[:, :, -1:].float().repeat_interleave(H // K, 1)  # [B, H, 1, D]
        assert torch.equal(out[:, :, ~real[0]], scratch.expand_as(out[:, :, ~real[0]]))


@needs_kernels
@pytest.mark.parametrize("compile", [False, True])
def test_generation_on_the_kernel_cache_equals_the_argmax_loop(compile, tmp_path, monkeypatch):
    from conftest import random_model

    from dense_engine.runtime import generate

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    model = random_model()
    caches.setup_cache(model, 2, 512)
    assert isinstance(model.layers[0].mixer.memory, caches.CPUKVCache)
    ids = torch.randint(0, 512, (2, 37), generator=torch.Generator().manual_seed(1))
    want = ids
    for _ in range(40):
        want = torch.cat([want, model(want)[:, -1:].argmax(-1)], dim=1)
    steps = Steps(model) if compile else None
    got = torch.cat([ids, *generate.generate_tokens(model, ids, 40, steps=steps)], dim=1)
    assert torch.equal(got, want)


@needs_kernels
@pytest.mark.parametrize("overrides", [{}, {"sliding_window": 24, "layer_types": ["sliding_attention",
                                                                                    "full_attention"]}])
def test_a_prefill_chunk_after_earlier_tokens_equals_the_plain_pass(overrides):
    """A server's chunked prefill on the kernel cache: 40 tokens from slot 0, then chunks of 30 (SDPA over the slots
    in use, in dense.py's layout) and 10 (the per-query kernel) after them, in cache row 1 of 2; the logits of every
    chunk equal the plain pass's (no cache) at the same positions."""
    from conftest import random_model

    model = random_model(**overrides)
    model.setup_cache(2, 256, cache_class=caches.CPUKVCache)
    ids = torch.randint(0, 512, (1, 80), generator=torch.Generator().manual_seed(3))
    want = model(ids)  # [1, 80, V]
    row = torch.tensor([1])
    got = [model(ids[:, :40], torch.arange(40), rows=row, causal=False)]
    for start, end in ((40, 70), (70, 80)):
        got.append(model(ids[:, start:end], torch.arange(start, end), rows=row))
    assert (torch.cat(got, dim=1) - want).abs().max() < 2e-4
