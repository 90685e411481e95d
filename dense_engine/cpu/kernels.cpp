// kernels.cpp: the CPU matmuls and the attention of a decode step, for x [M, K] with few rows (one token, a batch, a draft to verify)
// against a weight [N, K] read once from memory. Built on first use by kernels.py (g++ -O3 -march=native); needs
// AVX-512 (F, BW, VL) with VNNI: Intel Cascade Lake, Ice Lake and later, AMD Zen 4 and later. AVX512-BF16's one
// instruction here (vcvtneps2bf16) is taken where the CPU has it, the same bits by integer steps where it has not
// (bf16_words). Each op is registered as a PyTorch operator, so a compiled decode step calls it directly.
//
//   dense_kernels::linear_f32 (x, w)          w float32 [N, K]
//   dense_kernels::linear_int8(x, w, s)       w uint8 [N, K] = int8 weight + 128, s float32 [N]: w = s * q
//   dense_kernels::linear_int4(x, q, d, m)    q uint8 [N, K/2], d and m float32 [N, K/32]: w = d * code + m (in
//                                             groups of 16 rows: kernels.h)
//   dense_kernels::linear_nf4(x, q, absmax, code)   q uint8 [N, K/2], absmax float32 [N, K/64], code the 16 NF4 values
//   dense_kernels::linear_gguf(x, blocks, type, float_x)  blocks uint8 [N, bytes]: a GGUF file's rows of blocks, as stored
//                                             (type: ggml's id of Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K)
//   dense_kernels::linear_gguf_into(x, blocks, type, out, columns)   the same, written into out's columns (a fused
//                                             projection's part, in the model's order)
//   dense_kernels::linear_gguf_experts(x, blocks, type, ids)  blocks uint8 [E, N, bytes] (a file's experts), ids int64
//                                             [rows]: each row of x through its expert's blocks (llama.cpp's mul_mat_id)
//   dense_kernels::dequantize_gguf(blocks, type, K, bf16)   those rows as gguf's dequantizer computes them
//   dense_kernels::attention(q, k_t, v, pos, row_start, rows, scale, window, softcap)   a cached step's attention,
//                                             over the slots in use
//
// The quantized kernels multiply at float32's precision: int8 with AVX-512 VNNI on activations written as two int8
// digits a row; int4 by integer products on x as a 16-bit integer and a byte a value (one tile at every number of
// rows); nf4 by integer products on x's two digits (kernels.h, both ISAs' design). GGUF blocks take x rounded to 8 bits
// (llama.cpp's Q8_K and Q8_0) at every number of rows, summed in one order (kernels.h). A
// tile computes NB weight rows against up to 8 rows of x, so a weight row is loaded once for all of them. Past
// GEMM_ROWS rows of x (a prefill), where arithmetic rather than memory bounds a matmul: GGUF blocks integer dot
// products on x rounded to 8 bits (as llama.cpp computes every quantized matmul); float32 and nf4 past 16 rows a GEMM
// of packed blocks in their tiles' order of sums, int8 past 16 one reaching its tiles' integers (kernels.h).
#if !defined(__AVX512F__) || !defined(__AVX512BW__) || !defined(__AVX512VL__) || !defined(__AVX512VNNI__)
#error "kernels.cpp needs AVX-512 (F, BW, VL, VNNI); kernels.py falls back to PyTorch's kernels"
#endif

#include "kernels.h"

namespace {

inline __mmask16 lanes(int64_t left) { return left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1); }

// 16 float32 as bfloat16 words, as vcvtneps2bf16 rounds them (AVX512-BF16, taken where -march=native enables it):
// to nearest even, a zero or denormal to a zero of its sign, a NaN quieted (its high half, bit 6 set), an infinity
// and a value past bfloat16's largest to infinity. Without BF16 (Cascade Lake, Ice Lake) the same words by integer
// steps: + 0x7FFF + the kept lowest bit, the high half (tests/test_kernels.py: every float32, both ways, equal)
inline __m256i bf16_words(__m512 x) {
#ifdef __AVX512BF16__
  return (__m256i)_mm512_cvtneps_pbh(x);
#else
  const __m512i bits = _mm512_castps_si512(x), high = _mm512_srli_epi32(bits, 16);
  const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7FFF)),
                                                             _mm512_and_si512(high, _mm512_set1_epi32(1))), 16);
  const __mmask16 tiny = _mm512_testn_epi32_mask(bits, _mm512_set1_epi32(0x7F800000));  // exponent 0: zero, denormal
  const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  __m512i words = _mm512_mask_and_epi32(rounded, tiny, high, _mm512_set1_epi32(0x8000));
  words = _mm512_mask_or_epi32(words, nan, high, _mm512_set1_epi32(0x40));
  return _mm512_cvtepi32_epi16(words);
#endif
}

// 16 registers of 16 int32 lanes, transposed: lane j of register i <-> lane i of register j
inline void transpose16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]), t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]), r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]), r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }  // r[4a + b]: lanes (a's four rows) x column b of each 128-bit part
  for (int h = 0; h < 16; h += 8)
    for (int i = 0; i < 4; ++i)
      t[h + i] = _mm512_shuffle_i32x4(r[h + i], r[h + 4 + i], 0x88), t[h + 4 + i] = _mm512_shuffle_i32x4(r[h + i], r[h + 4 + i], 0xdd);
  for (int i = 0; i < 8; ++i)
    r[i] = _mm512_shuffle_i32x4(t[i], t[8 + i], 0x88), r[8 + i] = _mm512_shuffle_i32x4(t[i], t[8 + i], 0xdd);
}

// ---- float32 weights --------------------------------------------------------------------------------------------

// One accumulator per (row of x, weight row), summed over K in order: a row's result is the same bits whatever the
// tile shape or the number of rows (a batch never changes a row). With several rows of x, each step also prefetches
// the next tile's weight rows at the same column into L2: the hardware prefetcher alone falls behind while the FMAs
// run, and prefetches into L1 stall on its few miss buffers (1.2x at 8 rows on SmolLM2's linears).
template <int R, int NB, bool PREFETCH_NEXT = true>
void f32_tile(const float* x, const float* w, int64_t K, float* y, int64_t N, int64_t n0) {
  __m512 acc[R][NB];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NB; ++j) acc[r][j] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {  // plain loads here: masked ones cost 1.4x at 8 rows
    __m512 wv[NB];
    for (int j = 0; j < NB; ++j) {
      if (PREFETCH_NEXT) _mm_prefetch((const char*)(w + (n0 + NB + j) * K + k), _MM_HINT_T1);  // (past the end: no fault)
      wv[j] = _mm512_loadu_ps(w + (n0 + j) * K + k);
    }
    for (int r = 0; r < R; ++r) {
      __m512 xv = _mm512_loadu_ps(x + r * K + k);
      for (int j = 0; j < NB; ++j) acc[r][j] = _mm512_fmadd_ps(xv, wv[j], acc[r][j]);
    }
  }
  if (k < K) {
    __m512 wv[NB];
    for (int j = 0; j < NB; ++j) wv[j] = _mm512_maskz_loadu_ps(lanes(K - k), w + (n0 + j) * K + k);
    for (int r = 0; r < R; ++r) {
      __m512 xv = _mm512_maskz_loadu_ps(lanes(K - k), x + r * K + k);
      for (int j = 0; j < NB; ++j) acc[r][j] = _mm512_fmadd_ps(xv, wv[j], acc[r][j]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NB; ++j) y[r * N + n0 + j] = _mm512_reduce_add_ps(acc[r][j]);
}

// kernels.h's tile_gemm: 8 rows of x against 3 weight rows a block (24 accumulators, 3 weights and x: 28 of 32
// registers), K whole (chunks only past 4096); past 16 rows of x (up to 16 the tiles, faster on the 1B shape's
// weights: BENCHMARKS.md)
constexpr int GEMM_R = 8, GEMM_NB = 3;
constexpr int64_t F32_TILE_ROWS = 16;

template <int NB>
void f32_block(const float* xb, const float* wb, const float*, int64_t K, int64_t steps, float* acc, bool first,
               bool last, float* y, int64_t ldy, int64_t rows) {
  __m512 a[GEMM_R][NB];
  for (int r = 0; r < GEMM_R; ++r)
    for (int j = 0; j < NB; ++j) a[r][j] = first ? _mm512_setzero_ps() : _mm512_load_ps(acc + 16 * (r * NB + j));
  const bool tail = last && K % 16;  // (the last step's lanes past K: w masked to zeros, as f32_tile's)
  auto step = [&](const float* xs, const __m512 wv[NB]) {
    for (int r = 0; r < GEMM_R; ++r) {
      __m512 xv = _mm512_load_ps(xs + 16 * r);
      __asm__("" : "+v"(xv));  // (one load a row of x: GCC folds it into each FMA otherwise, NB loads)
      for (int j = 0; j < NB; ++j) a[r][j] = _mm512_fmadd_ps(xv, wv[j], a[r][j]);
    }
  };
  for (int64_t s = 0; s < steps - tail; ++s, xb += 16 * GEMM_R, wb += 16) {  // plain loads (masked: 2.2x slower)
    __m512 wv[NB];
    for (int j = 0; j < NB; ++j) wv[j] = _mm512_loadu_ps(wb + j * K);
    step(xb, wv);
  }
  if (tail) {
    __m512 wv[NB];
    for (int j = 0; j < NB; ++j) wv[j] = _mm512_maskz_loadu_ps(lanes(K % 16), wb + j * K);
    step(xb, wv);
  }
  for (int r = 0; r < GEMM_R; ++r)
    for (int j = 0; j < NB; ++j) {
      if (!last) _mm512_store_ps(acc + 16 * (r * NB + j), a[r][j]);
      else if (r < rows) y[r * ldy + j] = _mm512_reduce_add_ps(a[r][j]);
    }
}

// y [M, N] = x [M, K] w^T, every M: past F32_TILE_ROWS kernels.h's tile_gemm, in the tiles' order
void f32_tiles(const float* xp, const float* wp, int64_t M, int64_t K, float* yp, int64_t N) {
  if (M > F32_TILE_ROWS) {  // (a prefill: the same bits, kernels.h)
    const auto panel = [wp, K](int64_t n0, int64_t) { return PanelRows<float>{wp + n0 * K, nullptr}; };
    tile_gemm<16, GEMM_R, GEMM_NB, 4096>(xp, M, K, yp, N, panel, [](int64_t nb, auto... args) {
      if (nb == 3) f32_block<3>(args...);
      else if (nb == 2) f32_block<2>(args...);
      else f32_block<1>(args...);
    });
    return;
  }
  // One row of x and short weight rows: one weight row after another, no software prefetch. The weights are then one
  // sequential stream, which the hardware prefetchers read fastest (SmolLM2's shapes 1.14-1.6x, the 1B shape's K =
  // 2048 ones 1.05x, over 4 rows a tile with the L2 prefetch; within 5-15% of a plain sum over the same bytes). With
  // long rows (K = 5632: 22 KB) x no longer stays in L1 beside the stream, and 4 rows a tile read x a quarter as
  // often (one row a tile: 0.87x there).
  if (M == 1 && K <= 2048) {
    for_each_tile<1>(M, N, K, K * 4, [&](int64_t, int64_t, int64_t n0, int64_t) {
      f32_tile<1, 1, false>(xp, wp, K, yp, N, n0);
    });
    return;
  }
  // 4 weight rows against up to 8 rows of x, each weight row read once (measured best of 2, 3 and 4 rows)
  for_each_tile<4>(M, N, K, 4 * K, [&](int64_t m0, int64_t rows, int64_t n0, int64_t nb) {
    if (nb == 4) {
      DISPATCH_ROWS(rows, (f32_tile<R, 4>(xp + m0 * K, wp, K, yp + m0 * N, N, n0)));
    } else {
      for (int64_t j = 0; j < nb; ++j) DISPATCH_ROWS(rows, (f32_tile<R, 1>(xp + m0 * K, wp, K, yp + m0 * N, N, n0 + j)));
    }
  });
}

void f32_rows(const float* x, int64_t M, const float* w, int64_t nb, int64_t K, float* y, int64_t ldy) {
  for (int64_t m0 = 0; m0 < M; m0 += MAX_ROWS) {
    const int64_t rows = std::min<int64_t>(MAX_ROWS, M - m0);
    int64_t j = 0;
    for (; j + 4 <= nb; j += 4) DISPATCH_ROWS(rows, (f32_tile<R, 4, false>(x + m0 * K, w, K, y + m0 * ldy, ldy, j)));
    for (; j < nb; ++j) DISPATCH_ROWS(rows, (f32_tile<R, 1, false>(x + m0 * K, w, K, y + m0 * ldy, ldy, j)));
  }
}

// ---- int8 weights, one scale per output row ------------------------------------------------------------------------
// x in two int8 digits per row: d = max|x| / 127, q1 = round(x / d), q2 = round((x / d - q1) * 127), so
// x = d (q1 + q2 / 127) to within d / 254 (1/32258 of the row's largest value). vpdpbusd takes 64 weight x digit
// products per instruction into int32 lanes (the weight stored + 128, unsigned, as it wants); with one scale per row
// the sums stay integers over the whole of K: two instructions per 64 weights, exact whatever the tile, and the
// 128 * sum(digits) the stored weights add is taken off at the end: B1 = b1 - 128 S1, B2 = b2 - 128 S2, and
// y = int8_out(127 B1 + B2) (kernels.h: d / 127 times s, in doubles).

struct DigitRows {
  std::vector<int8_t> q1, q2;  // [M, K]
  std::vector<float> scale;    // per row: d
  std::vector<int64_t> sum1, sum2;  // per row: sum q1, sum q2
  DigitRows(const float* x, int64_t M, int64_t K) : q1(M * K), q2(M * K), scale(M), sum1(M), sum2(M) {
    for (int64_t row = 0; row < M; ++row) {
      const float* xr = x + row * K;
      __m512 amax = _mm512_setzero_ps();
      for (int64_t k = 0; k < K; k += 16) amax = _mm512_max_ps(amax, _mm512_abs_ps(_mm512_loadu_ps(xr + k)));
      const float top = _mm512_reduce_max_ps(amax);
      scale[row] = top / 127.f;
      const __m512 inv = _mm512_set1_ps(top > 0.f ? 127.f / top : 0.f), k127 = _mm512_set1_ps(127.f);
      __m512i s1 = _mm512_setzero_si512(), s2 = _mm512_setzero_si512();
      for (int64_t k = 0; k < K; k += 16) {
        const __m512 v = _mm512_mul_ps(_mm512_loadu_ps(xr + k), inv);
        const __m512 a = _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        const __m512 c = _mm512_roundscale_ps(_mm512_mul_ps(_mm512_sub_ps(v, a), k127),
                                              _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        const __m512i ai = _mm512_cvtps_epi32(a), ci = _mm512_cvtps_epi32(c);
        _mm_storeu_si128((__m128i*)(q1.data() + row * K + k), _mm512_cvtepi32_epi8(ai));
        _mm_storeu_si128((__m128i*)(q2.data() + row * K + k), _mm512_cvtepi32_epi8(ci));
        s1 = _mm512_add_epi32(s1, ai), s2 = _mm512_add_epi32(s2, ci);
      }
      sum1[row] = _mm512_reduce_add_epi32(s1), sum2[row] = _mm512_reduce_add_epi32(s2);
    }
  }
};

// How far ahead a tile asks for its weight rows, into L2 (a row or a group of rows is one stream): 2 KB into L1 (the
// old int4 tile's distance) streamed Q4_K_M's tensors at 16.5 GB/s, 8 KB into L2 at 26-30 (measured, huge pages; the file's own 4 KB
// pages 21-27)
constexpr int64_t AHEAD = 8192;

template <int R, int NB>
void int8_tile(const DigitRows& xs, int64_t m0, const uint8_t* w, const float* s, int64_t K, float* y, int64_t N,
               int64_t n0, int64_t ahead) {
  __m512i big[R][NB], small[R][NB];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NB; ++j) big[r][j] = small[r][j] = _mm512_setzero_si512();
  for (int64_t k = 0; k < K; k += 64) {
    __m512i wv[NB];
    for (int j = 0; j < NB; ++j) {
      _mm_prefetch((const char*)(w + (n0 + ahead + j) * K + k), _MM_HINT_T1);
      wv[j] = _mm512_loadu_si512(w + (n0 + j) * K + k);
    }
    for (int r = 0; r < R; ++r) {
      const __m512i a = _mm512_loadu_si512(xs.q1.data() + (m0 + r) * K + k);
      const __m512i c = _mm512_loadu_si512(xs.q2.data() + (m0 + r) * K + k);
      for (int j = 0; j < NB; ++j) {
        big[r][j] = _mm512_dpbusd_epi32(big[r][j], wv[j], a);
        small[r][j] = _mm512_dpbusd_epi32(small[r][j], wv[j], c);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NB; ++j) {
      const int64_t b1 = _mm512_reduce_add_epi32(big[r][j]) - 128 * xs.sum1[m0 + r];
      const int64_t b2 = _mm512_reduce_add_epi32(small[r][j]) - 128 * xs.sum2[m0 + r];
      y[r * N + n0 + j] = int8_out(127 * b1 + b2, int8_x_scale(xs.scale[m0 + r]), s[n0 + j]);
    }
}

// Past INT8_TILE_ROWS rows of x: int8_gemm (kernels.h), the tiles' integers. A panel of 16 NB weight rows as
// [steps][NB][16] 16-bit pairs: 16 rows' 32 values a register each (sign-extended), transposed
template <int NB>
void int8_panel(const uint8_t* w, int64_t np, int64_t K, int64_t steps, int32_t* out) {
  const __m256i flip = _mm256_set1_epi8((char)0x80);  // (stored + 128)
  for (int j = 0; j < NB; ++j)
    for (int64_t t = 0; t < steps; t += 16) {
      __m512i r[16];
      for (int i = 0; i < 16; ++i) {
        const int64_t n = j * 16 + i;
        const __m256i bytes = _mm256_loadu_si256((const __m256i*)(w + n * K + 2 * t));
        r[i] = n < np ? _mm512_cvtepi8_epi16(_mm256_xor_si256(bytes, flip)) : _mm512_setzero_si512();
      }
      transpose16(r);
      for (int i = 0; i < 16; ++i) _mm512_store_si512(out + ((t + i) * NB + j) * 16, r[i]);
    }
}

// R rows of x (a block, [steps][R] dwords) against a panel: R x NB registers of 16 outputs, one vpdpwssd a pair of
// values; between chunks the sums in doubles (acc [R][16 NB]), after the last y = int8_out
template <int R, int NB>
void int8_block(const int32_t* xb, const int32_t* pw, int64_t steps, double* acc, bool first, bool last, float* y,
                int64_t ldy, int64_t rows, int64_t np, const double* x_scale, const float* s) {
  __m512i a[R][NB];
  _Pragma("GCC unroll 16") for (int r = 0; r < R; ++r)  // (unrolled whole: the accumulators stay in registers)
    _Pragma("GCC unroll 16") for (int j = 0; j < NB; ++j) a[r][j] = _mm512_setzero_si512();
  for (int64_t t = 0; t < steps; ++t) {
    __m512i wv[NB];
    _Pragma("GCC unroll 16") for (int j = 0; j < NB; ++j) wv[j] = _mm512_load_si512(pw + (t * NB + j) * 16);
    _Pragma("GCC unroll 16") for (int r = 0; r < R; ++r) {
      const __m512i xv = _mm512_set1_epi32(xb[t * R + r]);
      _Pragma("GCC unroll 16") for (int j = 0; j < NB; ++j) a[r][j] = _mm512_dpwssd_epi32(a[r][j], wv[j], xv);
    }
  }
  alignas(64) int32_t sums[R][NB][16];
  _Pragma("GCC unroll 16") for (int r = 0; r < R; ++r)
    _Pragma("GCC unroll 16") for (int j = 0; j < NB; ++j) _mm512_store_si512(sums[r][j], a[r][j]);
  for (int r = 0; r < (last ? rows : R); ++r)
    for (int j = 0; j < NB; ++j)
      for (int h = 0; h < 2; ++h) {
        const int64_t n = 16 * j + 8 * h;
        double* ar = acc + r * 16 * NB + n;
        __m512d B = _mm512_cvtepi32_pd(_mm256_load_si256((const __m256i*)(sums[r][j] + 8 * h)));
        if (!first) B = _mm512_add_pd(B, _mm512_load_pd(ar));
        if (!last) {
          _mm512_store_pd(ar, B);
          continue;
        }
        if (n >= np) continue;
        const __mmask8 m = (__mmask8)lanes(np - n);
        const __m512d sd = _mm512_cvtps_pd(_mm256_maskz_loadu_ps(m, s + n));
        const __m512d v = _mm512_mul_pd(_mm512_mul_pd(B, _mm512_set1_pd(x_scale[r])), sd);  // (int8_out's order)
        _mm256_mask_storeu_ps(y + r * ldy + n, m, _mm512_cvtpd_ps(v));
      }
}

// y [M, N] = x [M, K] w^T, every M: past INT8_TILE_ROWS kernels.h's int8_gemm, the same integers
constexpr int64_t INT8_TILE_ROWS = 16;  // (measured: BENCHMARKS.md)
void int8_tiles(const float* xp, const uint8_t* wp, const float* sp, int64_t M, int64_t K, float* yp, int64_t N) {
  DigitRows digits(xp, M, K);
  if (M > INT8_TILE_ROWS) {
    int8_gemm<16, 8, 3, 512>(digits, wp, sp, M, K, yp, N, int8_panel<3>, int8_block<8, 3>);
    return;
  }
  // Each step prefetches the weights >= 8 KB ahead into L2, as float32's tiles do (a tile of int8 rows is a quarter
  // of float32's bytes: the next tile alone was too close, 1.15x slower on SmolLM2's linears)
  const int64_t rows_ahead = (8192 + K - 1) / K;
  if (M == 1) {  // 4 weight rows a tile (more memory in flight), as float32
    const int64_t ahead = (rows_ahead + 3) / 4 * 4;
    for_each_tile<4>(M, N, K, 4 * K, [&](int64_t, int64_t, int64_t n0, int64_t nb) {
      if (nb == 4) {
        int8_tile<1, 4>(digits, 0, wp, sp, K, yp, N, n0, ahead);
      } else {
        for (int64_t j = 0; j < nb; ++j) int8_tile<1, 1>(digits, 0, wp, sp, K, yp, N, n0 + j, ahead);
      }
    });
    return;
  }
  // 2 weight rows against up to 4 rows of x: 2 x 4 x 2 int32 accumulators fill half the registers
  const int64_t ahead = (rows_ahead + 1) / 2 * 2;
  for_each_tile<2, 4>(M, N, K, 2 * K, [&](int64_t m0, int64_t rows, int64_t n0, int64_t nb) {
    if (nb == 2) {
      DISPATCH_ROWS(rows, (int8_tile<R, 2>(digits, m0, wp, sp, K, yp + m0 * N, N, n0, ahead)));
    } else {
      DISPATCH_ROWS(rows, (int8_tile<R, 1>(digits, m0, wp, sp, K, yp + m0 * N, N, n0, ahead)));
    }
  });
}

// ---- int4 weights, llama.cpp's Q4_1 grid: w = d * code + m per block of 32 --------------------------------------
// Packed in groups of 16 weight rows, a lane each (kernels.h): one 64-byte load holds 8 codes of each of the 16 rows;
// shifts and masks make four registers of code pairs (16-bit) and two of code quads (bytes); a row of x adds their
// products with its H (four vpdpwssd) and L (two vpdpbusd) into each weight row's int32 sums. Per block, the float
// steps of kernels.h. The one tile serves every number of rows of x: up to 4 rows of x against a group, the group's
// codes loaded once for all of them (a long prefill reads them from L1).

// R rows of x (from m0) against one group of 16 weight rows: y [R, N] from column n0, its first `width`
template <int R>
void int4_group(const BlockWords& xs, int64_t m0, const uint8_t* codes, const float* d, const float* mn, int64_t K,
                float* y, int64_t N, int64_t n0, int64_t width) {
  const int64_t G = K / 32;
  const int16_t* H = xs.high + m0 * K;
  const int8_t* L = xs.low + m0 * K;
  const float *U = xs.unit + m0 * G, *S = xs.sum + m0 * G;
  const __m512i pair_mask = _mm512_set1_epi32(0x000F000F), quad_mask = _mm512_set1_epi32(0x0F0F0F0F);
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < G; ++b) {
    __m512i high[R], low[R];
    for (int r = 0; r < R; ++r) high[r] = low[r] = _mm512_setzero_si512();
    for (int c = 0; c < 4; ++c) {  // 8 inputs a load
      const uint8_t* chunk = codes + (4 * b + c) * 64;
      _mm_prefetch((const char*)chunk + AHEAD, _MM_HINT_T1);
      const __m512i v = _mm512_loadu_si512(chunk), v4 = _mm512_srli_epi32(v, 4);
      const __m512i pairs[4] = {_mm512_and_si512(v, pair_mask), _mm512_and_si512(v4, pair_mask),
                                _mm512_and_si512(_mm512_srli_epi32(v, 8), pair_mask),
                                _mm512_and_si512(_mm512_srli_epi32(v, 12), pair_mask)};
      const __m512i quads[2] = {_mm512_and_si512(v, quad_mask), _mm512_and_si512(v4, quad_mask)};
      for (int r = 0; r < R; ++r) {
        const int64_t at = r * K + 32 * b + 8 * c;
        for (int p = 0; p < 4; ++p) {
          int32_t h;
          memcpy(&h, H + at + 2 * p, 4);
          high[r] = _mm512_dpwssd_epi32(high[r], pairs[p], _mm512_set1_epi32(h));
        }
        for (int q = 0; q < 2; ++q) {
          int32_t l;
          memcpy(&l, L + at + 4 * q, 4);
          low[r] = _mm512_dpbusd_epi32(low[r], quads[q], _mm512_set1_epi32(l));
        }
      }
    }
    const __m512 dv = _mm512_loadu_ps(d + 16 * b), mv = _mm512_loadu_ps(mn + 16 * b);
    for (int r = 0; r < R; ++r) {
      const __m512 x = _mm512_fmadd_ps(_mm512_cvtepi32_ps(low[r]), _mm512_set1_ps(1.f / 128.f), _mm512_cvtepi32_ps(high[r]));
      acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(x, _mm512_set1_ps(U[r * G + b])), dv, acc[r]);
      acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(S[r * G + b]), mv, acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(y + r * N + n0, lanes(width), acc[r]);
}

// y [M, N] = x [M, K] w^T, every M
void int4_tiles(const float* xp, const uint8_t* qp, const float* dp, const float* mp, int64_t M, int64_t K, float* yp,
                int64_t N) {
  const BlockWords xs(xp, M, K);
  for_each_int4_group<4>(M, N, K, qp, dp, mp, [&](int64_t m0, int64_t rows, const uint8_t* codes, const float* d,
                                                      const float* mn, int64_t n0, int64_t width) {
    DISPATCH_ROWS(rows, (int4_group<R>(xs, m0, codes, d, mn, K, yp + m0 * N, N, n0, width)));
  });
}

// ---- nf4 weights (bitsandbytes' NF4 code), one absmax per block of 64: the matmul is kernels.h's -----------------

// nf4 weight rows n0 .. n1 - 1 (our repacked layout) as bfloat16 into out [n1 - n0, K], rounded as PyTorch rounds
// float32 code * absmax
void nf4_rows(const uint8_t* qp, const float* ap, const float* code, int64_t K, int64_t n0, int64_t n1, uint16_t* wp) {
  const int64_t B = K / 64;
  const __m512 table = _mm512_loadu_ps(code);
  const __m512i low = _mm512_set1_epi32(15);
  for (int64_t n = n0; n < n1; ++n)
    for (int64_t b = 0; b < B; ++b) {
      const __m512 s = _mm512_set1_ps(ap[n * B + b]);
      for (int half = 0; half < 2; ++half) {  // bytes 16 half .. +16: codes 16 half.. (low), 32 + 16 half.. (high)
        __m512i codes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(qp + n * (K / 2) + b * 32 + half * 16)));
        __m512 lo = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_and_si512(codes, low), table), s);
        __m512 hi = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(codes, 4), table), s);
        uint16_t* out = wp + (n - n0) * K + b * 64 + half * 16;
        _mm256_storeu_si256((__m256i*)out, bf16_words(lo));
        _mm256_storeu_si256((__m256i*)(out + 32), bf16_words(hi));
      }
    }
}

// y [M, N] = x [M, K] w^T, every M: kernels.h's nf4_matmul (kernels_avx2.cpp's design, in 8 lanes here too)
void nf4_tiles(const float* xp, const uint8_t* qp, const float* ap, const float* cp, int64_t M, int64_t K, float* yp,
               int64_t N) {
  nf4_matmul<DigitRows>(xp, qp, ap, cp, M, K, yp, N);
}

// ---- GGUF blocks as the file stores them: llama.cpp's K-quants (Q4_K, Q5_K, Q6_K, super-blocks of 256) and its
// 32-blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) --------------------------------------------------------------------------
// A weight row is the file's row of blocks, untouched. Every type is read as unsigned codes u (one byte each) with,
// per sub-block, w = A * (u - off) + B:
//   Q4_K, Q5_K  A = d * scale_j (6-bit), B = -(dmin * min_j), per 32      Q6_K  A = d * scale_j (int8), off 32, per 16
//   Q4_0 / Q5_0 / Q8_0  A = d, off 8 / 16 / 128 (Q8_0's int8 + 128)        Q4_1 / Q5_1  A = d, B = m
// The matmuls take x in bytes (ByteRows: llama.cpp's Q8_K for K-quants, its Q8_0 for 32-blocks), as their prefill.
// K-quants: 64 codes a register as bytes (chunk_codes; Q4_K / Q5_K's decoding tile in their nibbles' order), times xq
// by vpmaddubsw (pairs of products in int16), times the sub-block's integer scale by vpdpwssd (into int32), a
// super-block at a time, then kernels.h's float steps. 32-blocks: kernels.h's block32_tile (8 lanes, shared with
// kernels_avx2.cpp). Mins and offsets meet the sums of xq over their sub-blocks. The result is the dequantized
// weights' product with x so rounded.

// Chunk c of a row (elements 64c .. 64c + 63) as 64 codes. blocks: the row's blocks (32-blocks: an odd last chunk
// gets zero codes in its second half).
template <int64_t T>
inline __m512i chunk_codes(const uint8_t* row, int64_t c, int64_t blocks) {
  if constexpr (T == GQ4_K || T == GQ5_K) {
    const uint8_t* blk = row + (c / 4) * block_bytes(T);
    const int g = c % 4;
    const uint8_t* qs = blk + (T == GQ4_K ? 16 : 48) + 32 * g;
    const __m512i z = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i*)qs));
    __m512i u = _mm512_and_si512(_mm512_mask_srli_epi16(z, 0xFFFF0000u, z, 4), _mm512_set1_epi8(15));
    if constexpr (T == GQ5_K) {  // sub-block s takes bit s of qh[l]: bits 2g (low half) and 2g + 1 (high half)
      const __m512i h = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i*)(blk + 16)));
      const __m512i shift = _mm512_mask_blend_epi16(0xFFFF0000u, _mm512_set1_epi16(2 * g), _mm512_set1_epi16(2 * g + 1));
      u = _mm512_or_si512(u, _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi16(h, shift), _mm512_set1_epi8(1)), 4));
    }
    return u;
  } else if constexpr (T == GQ6_K) {  // chunk 2h + k: nibble k of ql[64h ..], bits 4k, 4k + 2 of qh[32h ..]
    const uint8_t* blk = row + (c / 4) * block_bytes(T);
    const int h = (c % 4) / 2, k = c % 2;
    const __m512i low = _mm512_loadu_si512(blk + 64 * h);
    const __m512i nib = _mm512_and_si512(k ? _mm512_srli_epi16(low, 4) : low, _mm512_set1_epi8(15));
    const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i*)(blk + 128 + 32 * h)));
    const __m512i shift = _mm512_mask_blend_epi16(0xFFFF0000u, _mm512_set1_epi16(4 * k), _mm512_set1_epi16(4 * k + 2));
    const __m512i top = _mm512_and_si512(_mm512_srlv_epi16(qh, shift), _mm512_set1_epi8(3));
    return _mm512_or_si512(nib, _mm512_slli_epi16(top, 4));
  } else {
    const uint8_t* blk = row + 2 * c * block_bytes(T);
    const __m256i a = block_codes<T>(blk);
    const __m256i b = 2 * c + 1 < blocks ? block_codes<T>(blk + block_bytes(T)) : _mm256_setzero_si256();
    return _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1);
  }
}


// x [M, K] rounded to 8 bits a value, as llama.cpp's activations: each `group` values (256: K-quants, its Q8_K; 32:
// 32-blocks, its Q8_0) xq = x / dx rounded to the nearest (even), dx = their max|x| / 127; stored + 128 as unsigned
// bytes for a prefill's vpdpbusd (plus128), as signed bytes for the K-quants' decoding (codes times xq, vpmaddubsw).
// nibble_order: xq in the order Q4_K / Q5_K's 64 bytes of codes hold their values, low nibbles then high ones (each
// 128 values' second and third 32 swapped), so that one load of codes serves two registers
struct ByteRows {
  std::vector<uint8_t> xu;   // [M, K] xq + 128 (plus128) or xq
  std::vector<float> dx;     // [M, K / group]
  std::vector<int16_t> s16;  // [M, K / 16]: sum(xq) over each 16 (the mins and offsets meet them)
  int64_t K;
  float sum32(int64_t m, int64_t b) const {  // sum(xq) over values 32b .. 32b + 31 of row m
    return (float)(s16[m * (K / 16) + 2 * b] + s16[m * (K / 16) + 2 * b + 1]);
  }
  ByteRows(const float* x, int64_t M, int64_t K, int64_t group, bool plus128 = true, bool nibble_order = false)
      : xu(M * K), dx(M * (K / group)), s16(M * (K / 16)), K(K) {
    const __m512i off = _mm512_set1_epi32(plus128 ? 128 : 0);
    at::parallel_for(0, M, 8, [&](int64_t m0, int64_t m1) {
      for (int64_t m = m0; m < m1; ++m)
        for (int64_t b = 0; b < K / group; ++b) {
          const float* xb = x + m * K + b * group;
          __m512 amax = _mm512_setzero_ps();
          for (int k = 0; k < group; k += 16) amax = _mm512_max_ps(amax, _mm512_abs_ps(_mm512_loadu_ps(xb + k)));
          const float top = _mm512_reduce_max_ps(amax), d = top / 127.f;
          dx[m * (K / group) + b] = d;
          const __m512 inv = _mm512_set1_ps(top > 0.f ? 127.f / top : 0.f);
          for (int k = 0; k < group; k += 32) {
            const __m512i a = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(xb + k), inv));  // nearest
            const __m512i c = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(xb + k + 16), inv));
            const int64_t at = m * K + b * group + k, s = k / 32;
            const int64_t to = nibble_order ? at - k + 32 * ((s & ~3) | (s & 1) << 1 | (s >> 1 & 1)) : at;
            _mm_storeu_si128((__m128i*)(xu.data() + to), _mm512_cvtepi32_epi8(_mm512_add_epi32(a, off)));
            _mm_storeu_si128((__m128i*)(xu.data() + to + 16), _mm512_cvtepi32_epi8(_mm512_add_epi32(c, off)));
            const int32_t low = _mm512_reduce_add_epi32(a), high = _mm512_reduce_add_epi32(c);
            s16[at / 16] = (int16_t)low, s16[at / 16 + 1] = (int16_t)high;
          }
        }
    });
  }
};

// NB weight rows of a K-quant type against R rows of x in bytes (signed xq, a scale per 256), a super-block at a
// time: 64 codes u (0..63) a register times xq by vpmaddubsw (pairs in int16: |u xq| pairs <= 2 x 63 x 127), times
// the sub-block's integer scale by vpdpwssd into int32 lanes (kernels.h's I, less Q6_K's offset: 32 times the
// scales against the sums of xq per 16), the mins against the sums of xq per 32 (Mn); then kernels.h's float steps,
// two outputs at a time: one reduction gives both outputs' I and Mn, and lanes 0 and 2 of a register take the steps
// (kquant_step's operations, lane by lane). The scales reach their lanes by vpermw from the 16 of a super-block.
template <int64_t T, int R, int NB>
void kquant_tile(const ByteRows& xs, int64_t m0, const uint8_t* w, int64_t row_bytes, int64_t K, float* y,
                 int64_t N, int64_t n0) {
  constexpr int OUT = R * NB, PAIRS = (OUT + 1) / 2;  // output o: row o / NB of x, weight row o % NB
  const int64_t S = K / 256;
  const __m512i word = _mm512_set_epi16(31, 30, 29, 28, 27, 26, 25, 24, 23, 22, 21, 20, 19, 18, 17, 16, 15, 14, 13,
                                        12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  __m128 acc[PAIRS];
  for (int p = 0; p < PAIRS; ++p) acc[p] = _mm_setzero_ps();
  for (int64_t sb = 0; sb < S; ++sb) {
    __m512i isum[R][NB];
    __m256i per16[NB];  // what each 16's sum of xq meets: Q6_K its scale (the offset's), Q4_K / Q5_K its 32's min
    uint32_t halves[NB];  // the super-block's d and dmin (Q6_K: d, 0) as float16
#pragma GCC unroll 2
    for (int j = 0; j < NB; ++j) {
      const uint8_t* blk = w + (n0 + j) * row_bytes + sb * block_bytes(T);
      for (int line = 0; line < block_bytes(T); line += 64) _mm_prefetch((const char*)blk + AHEAD + line, _MM_HINT_T1);
      __m512i even[R], odd[R];  // (two chains of vpdpwssd, added at the end)
      for (int r = 0; r < R; ++r) even[r] = odd[r] = _mm512_setzero_si512();
      if constexpr (T == GQ6_K) {  // 64 codes (0..63) a register as bytes
        const __m256i scales = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(blk + 192)));  // 16, as words
        for (int c = 0; c < 4; ++c) {  // chunk c: sub-blocks 4c .. 4c + 3, eight words each
          const __m512i u = chunk_codes<T>(w + (n0 + j) * row_bytes, sb * 4 + c, 0);
          const __m512i index = _mm512_add_epi16(_mm512_set1_epi16(4 * c), _mm512_srli_epi16(word, 3));
          const __m512i scale = _mm512_permutexvar_epi16(index, _mm512_castsi256_si512(scales));
          for (int r = 0; r < R; ++r) {
            const __m512i xq = _mm512_loadu_si512(xs.xu.data() + (m0 + r) * K + sb * 256 + 64 * c);
            __m512i& sum = c % 2 ? odd[r] : even[r];
            sum = _mm512_dpwssd_epi32(sum, _mm512_maddubs_epi16(u, xq), scale);
          }
        }
        per16[j] = scales;
        uint16_t d;
        memcpy(&d, blk + 208, 2);
        halves[j] = d;
      } else {  // 64 bytes of codes, two registers: sub-blocks 4h and 4h + 2 in the low nibbles, 4h + 1 and 4h + 3 in
                // the high ones (xq in that order: nibble_order)
        const __m256i sm = _mm256_cvtepu8_epi16(kquant_scales(blk + 4));  // scales in words 0-7, mins in 8-15
        const uint8_t* qs = blk + (T == GQ4_K ? 16 : 48);
        __m512i qh;
        if constexpr (T == GQ5_K) qh = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i*)(blk + 16)));
        for (int g = 0; g < 4; ++g) {  // register g: sub-blocks s and s + 2, s = 4 (g / 2) + g % 2
          const int s = 4 * (g / 2) + g % 2;
          const __m512i z = _mm512_loadu_si512(qs + 64 * (g / 2));
          __m512i u = _mm512_and_si512(g % 2 ? _mm512_srli_epi16(z, 4) : z, _mm512_set1_epi8(15));
          if constexpr (T == GQ5_K) {  // bit s of qh[l]: the fifth bit of value l of sub-block s
            const __m512i shift = _mm512_mask_blend_epi16(0xFFFF0000u, _mm512_set1_epi16(s), _mm512_set1_epi16(s + 2));
            u = _mm512_or_si512(u, _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi16(qh, shift), _mm512_set1_epi8(1)), 4));
          }
          const __m512i scale = _mm512_permutexvar_epi16(  // words 0-15: scale s, 16-31: scale s + 2
              _mm512_mask_blend_epi16(0xFFFF0000u, _mm512_set1_epi16(s), _mm512_set1_epi16(s + 2)),
              _mm512_castsi256_si512(sm));
          for (int r = 0; r < R; ++r) {
            const __m512i xq = _mm512_loadu_si512(xs.xu.data() + (m0 + r) * K + sb * 256 + 64 * g);
            __m512i& sum = g % 2 ? odd[r] : even[r];
            sum = _mm512_dpwssd_epi32(sum, _mm512_maddubs_epi16(u, xq), scale);
          }
        }
        const __m256i min_words =  // words 8 + w / 2: each min for both 16s of its 32
            _mm256_or_si256(_mm256_srli_epi16(_mm512_castsi512_si256(word), 1), _mm256_set1_epi16(8));
        per16[j] = _mm256_permutexvar_epi16(min_words, sm);
        memcpy(&halves[j], blk, 4);
      }
      for (int r = 0; r < R; ++r) isum[r][j] = _mm512_add_epi32(even[r], odd[r]);
    }
#pragma GCC unroll 4
    for (int p = 0; p < PAIRS; ++p) {  // outputs a and b: I_a, Mn_a, I_b, Mn_b in one reduction
      const int a = 2 * p, b = std::min(2 * p + 1, OUT - 1), ra = a / NB, ja = a % NB, rb = b / NB, jb = b % NB;
      auto half = [](__m512i v) {
        return _mm256_add_epi32(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64(v, 1));
      };
      auto mins = [&](int r, int j) {
        const __m256i sums = _mm256_loadu_si256((const __m256i*)(xs.s16.data() + (m0 + r) * (K / 16) + sb * 16));
        return _mm256_madd_epi16(sums, per16[j]);
      };
      __m128i s = sum_lanes4(half(isum[ra][ja]), mins(ra, ja), half(isum[rb][jb]), mins(rb, jb));
      if constexpr (T == GQ6_K) s = _mm_sub_epi32(s, _mm_slli_epi32(_mm_srli_epi64(s, 32), 5));  // I - 32 C
      const __m128 f = _mm_cvtepi32_ps(s);
      const __m128 dm = _mm_cvtph_ps(_mm_setr_epi32(halves[ja], halves[jb], 0, 0));  // d_a, dmin_a, d_b, dmin_b
      __m128 part = _mm_mul_ps(f, dm);  // (lanes 0 and 2) d I
      if constexpr (T != GQ6_K) part = _mm_fnmadd_ps(_mm_movehdup_ps(dm), _mm_movehdup_ps(f), part);  // + nd Mn
      const __m128 dx = _mm_setr_ps(xs.dx[(m0 + ra) * S + sb], 0.f, xs.dx[(m0 + rb) * S + sb], 0.f);
      acc[p] = _mm_fmadd_ps(part, dx, acc[p]);
    }
  }
  for (int o = 0; o < OUT; ++o) {
    const __m128 pair = acc[o / 2];
    y[(o / NB) * N + n0 + o % NB] = _mm_cvtss_f32(o % 2 ? _mm_movehl_ps(pair, pair) : pair);
  }
}

// R rows of x against Q8_0 weight row n in float32: per block its 32 codes widened to float times x (a multiply and
// an FMA), then d times that block sum into the row's sum, even and odd blocks in two sums (one chain of FMAs
// waits on their latency) added at the end (a fixed order: a row's bits whatever M)
template <int R>
void q8_0_float_tile(const float* x, const uint8_t* w, int64_t row_bytes, int64_t K, float* y, int64_t N, int64_t n) {
  const uint8_t* row = w + n * row_bytes;
  __m512 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  auto block = [&](int64_t b, int half) {
    const uint8_t* blk = row + b * 34;
    _mm_prefetch((const char*)blk + AHEAD, _MM_HINT_T1);
    const __m512 w0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(blk + 2))));
    const __m512 w1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(blk + 18))));
    const __m512 d = _mm512_set1_ps(half_at(blk));
    for (int r = 0; r < R; ++r) {
      const float* xb = x + r * K + 32 * b;
      const __m512 s = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xb + 16), _mm512_mul_ps(w0, _mm512_loadu_ps(xb)));
      acc[r][half] = _mm512_fmadd_ps(s, d, acc[r][half]);
    }
  };
  int64_t b = 0;
  for (; b + 2 <= K / 32; b += 2) block(b, 0), block(b + 1, 1);
  if (b < K / 32) block(b, 0);
  for (int r = 0; r < R; ++r) y[r * N + n] = _mm512_reduce_add_ps(_mm512_add_ps(acc[r][0], acc[r][1]));
}

void q8_0_float_tiles(const float* x, int64_t M, const uint8_t* w, int64_t row_bytes, int64_t K, float* y, int64_t N) {
  for_each_tile<1>(M, N, K, row_bytes, [&](int64_t m0, int64_t rows, int64_t n0, int64_t) {
    DISPATCH_ROWS(rows, (q8_0_float_tile<R>(x + m0 * K, w, row_bytes, K, y + m0 * N, N, n0)));
  });
}

template <int64_t T>
void gguf_tiles(const float* x, int64_t M, const uint8_t* w, int64_t row_bytes, int64_t K, float* y, int64_t N) {
  const ByteRows xs(x, M, K, block_elements(T), false, T == GQ4_K || T == GQ5_K);  // x in bytes, as the prefill
  if constexpr (T < GQ4_K) {  // (kernels.h's, 8 weight rows a tile)
    for_each_tile<8, 8>(M, N, K, row_bytes, [&](int64_t m0, int64_t rows, int64_t n0, int64_t nb) {
      DISPATCH_ROWS(rows, (block32_tile<T, R>(xs, m0, w, row_bytes, K, y + m0 * N, N, n0, nb)));
    });
    return;
  }
  auto tile = [&](auto rows_tag, auto nb_tag, int64_t m0, int64_t n0) {
    constexpr int R = decltype(rows_tag)::value, NB = decltype(nb_tag)::value;
    kquant_tile<T, R, NB>(xs, m0, w, row_bytes, K, y + m0 * N, N, n0);
  };
  // 2 weight rows a tile (two streams in flight) against up to 2 rows of x; 3-8 rows of x: one weight row at a time
  // (its decoded super-block, 8 registers, used by every row of x)
  for_each_tile<2, 8>(M, N, K, row_bytes, [&](int64_t m0, int64_t rows, int64_t n0, int64_t nb) {
    if (nb == 2 && rows <= 2) {
      if (rows == 1) tile(std::integral_constant<int, 1>{}, std::integral_constant<int, 2>{}, m0, n0);
      else tile(std::integral_constant<int, 2>{}, std::integral_constant<int, 2>{}, m0, n0);
    } else {
      for (int64_t j = 0; j < nb; ++j)
        DISPATCH_ROWS(rows, (tile(std::integral_constant<int, R>{}, std::integral_constant<int, 1>{}, m0, n0 + j)));
    }
  });
}

// Rows of blocks -> [N, K] values as gguf's own dequantizer computes them (float32: bit for bit; bfloat16: those
// rounded). No fused multiply-adds: A (u - off) and + B are two roundings there. A, off and B are made once per
// super-block (per 16 values) or per chunk of two 32-blocks.
template <int64_t T, typename Out>
__attribute__((optimize("fp-contract=off"))) void dequantize_rows(const uint8_t* w, int64_t row_bytes, int64_t N,
                                                                   int64_t K, Out* out) {
  const int64_t blocks = K / block_elements(T), chunks = (K + 63) / 64;
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    float A[16], off[16], B[16];  // of each 16 values of the super-block (K-quants) or of the chunk (32-blocks)
    for (int64_t n = n0; n < n1; ++n) {
      const uint8_t* row = w + n * row_bytes;
      for (int64_t c = 0; c < chunks; ++c) {
        if constexpr (T >= GQ4_K) {
          if (c % 4 == 0)
            for (int g = 0; g < 4; ++g) chunk_params<T>(row, c + g, blocks, A + 4 * g, off + 4 * g, B + 4 * g);
        } else {
          chunk_params<T>(row, c, blocks, A, off, B);
        }
        const __m512i u = chunk_codes<T>(row, c, blocks);
        const int first = T >= GQ4_K ? 4 * (c % 4) : 0;
        for (int q = 0; q < 4 && c * 64 + q * 16 < K; ++q) {
          const __m128i bytes = q == 0 ? _mm512_castsi512_si128(u) : q == 1 ? _mm512_extracti32x4_epi32(u, 1)
                              : q == 2 ? _mm512_extracti32x4_epi32(u, 2) : _mm512_extracti32x4_epi32(u, 3);
          const __m512 v = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(bytes));
          const __m512 x = _mm512_add_ps(_mm512_mul_ps(_mm512_sub_ps(v, _mm512_set1_ps(off[first + q])),
                                                       _mm512_set1_ps(A[first + q])), _mm512_set1_ps(B[first + q]));
          Out* o = out + n * K + c * 64 + q * 16;
          if constexpr (std::is_same_v<Out, float>) _mm512_storeu_ps(o, x);
          else _mm256_storeu_si256((__m256i*)o, bf16_words(x));
        }
      }
    }
  });
}

// ---- A long prefill on GGUF blocks: 8-bit activations and integer dot products ------------------------------------
// Past GEMM_ROWS rows of x a GGUF linear is bound by arithmetic, not memory. vpdpbusd (64 multiply-adds of bytes)
// runs twice as many per instruction as oneDNN's bfloat16 GEMM (vdpbf16ps, 32), so x is rounded to 8 bits, as
// llama.cpp does for every quantized matmul: each 256 values of a row (K-quants; 32 for 32-blocks, llama.cpp's Q8_0)
// become xq = x / dx rounded (dx = their max|x| / 127), stored + 128 as unsigned bytes. Each thread decodes a tile
// of 32 weight rows into signed codes s = u - off, four values of a row side by side, 16 rows a register (k-group g of the tile: 128 bytes), so one
// vpdpbusd adds four products of 16 rows against four values of one row of x (broadcast). Per sub-block (32 values;
// Q6_K 16) the int32 sums sum(s (xq + 128)) less their + 128's share (they start at Z = -128 sum(s), the weights'
// own: exact in int32, where a float difference of the two large sums lost digits) times the integer scale into I;
// per super-block kernels.h's float steps (the decoding tiles' order: a row's bits whatever the call). The result is
// the dequantized weights' product with x rounded to 8 bits a value (to float32's rounding of the sums): 1.4-1.5x the
// rate of oneDNN's bfloat16 GEMM on weights already dequantized, on Zen 4 and 5 (BENCHMARKS.md).
// 32-blocks (BlockTile, q8_pass32) the same with a scale of x per block: per block, the sums (from Z) times A, times
// dx.
constexpr int Q8_TILE = 32;  // weight rows a tile: two registers of 16
constexpr int Q8_ROWS = 6;   // rows of x a pass: 2 x 6 int32 sums and 2 x 6 float sums in registers
constexpr int64_t Q8_BLOCK = 256;  // rows of x a round of tiles

// A super-block's integer scale and min of each of its 16 sixteens, in lanes (Q6_K: no mins)
template <int64_t T>
inline void superblock_ints(const uint8_t* blk, __m512i& scale, __m512i& min) {
  if constexpr (T == GQ6_K) {
    scale = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(blk + 192)));
    min = _mm512_setzero_si512();
  } else {  // sixteen q: scale and min q / 2
    const __m512i v = _mm512_cvtepu8_epi32(kquant_scales(blk + 4));  // scales in lanes 0-7, mins in 8-15
    const __m512i pair = _mm512_srli_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0), 1);
    scale = _mm512_permutexvar_epi32(pair, v);
    min = _mm512_permutexvar_epi32(_mm512_add_epi32(pair, _mm512_set1_epi32(8)), v);
  }
}

// A tile of Q8_TILE weight rows, decoded for q8_pass: codes [K / 4][32 rows][4]; the integer scale and Z = -128
// sum(s) of each 16 values [K / 16][32] (a sub-block of 32: at its first 16's); the mins of each two sub-blocks as
// 16-bit pairs [K / 64][32] (Q4_K, Q5_K: for vpdpwssd); d and -dmin of each super-block [K / 256][32]
template <int64_t T>
struct ByteTile {
  static constexpr int SB = T == GQ6_K ? 16 : 32, OFF = T == GQ6_K ? 32 : 0;
  std::vector<int8_t> codes;
  std::vector<int32_t> scale, min, Z;
  std::vector<float> d, nd;
  explicit ByteTile(int64_t K) : codes(K * Q8_TILE), scale(K / 16 * Q8_TILE), min(K / 64 * Q8_TILE),
                                 Z(K / 16 * Q8_TILE), d(K / 256 * Q8_TILE), nd(K / 256 * Q8_TILE) {}

  void decode(const uint8_t* w, int64_t row_bytes, int64_t K, int64_t nb) {
    const int64_t blocks = K / 256;
    const __m512i ones = _mm512_set1_epi8(1);
    for (int64_t b = 0; b < blocks; ++b)
      for (int64_t r = 0; r < Q8_TILE; ++r) {
        const uint8_t* blk = w + r * row_bytes + b * block_bytes(T);
        d[b * Q8_TILE + r] = r >= nb ? 0.f : half_at(blk + (T == GQ6_K ? 208 : 0));
        nd[b * Q8_TILE + r] = r >= nb || T == GQ6_K ? 0.f : -half_at(blk + 2);
      }
    for (int half = 0; half < 2; ++half) {  // 16 rows at a time: a register's lanes
      for (int64_t b = 0; b < blocks; ++b) {  // scales and mins of each 16 values, rows in lanes
        __m512i a[16], m[16];
        for (int i = 0; i < 16; ++i) {
          const int64_t r = 16 * half + i;
          a[i] = m[i] = _mm512_setzero_si512();
          if (r < nb) superblock_ints<T>(w + r * row_bytes + b * block_bytes(T), a[i], m[i]);
        }
        transpose16(a);
        if (T != GQ6_K) transpose16(m);
        for (int q = 0; q < 16; ++q) _mm512_storeu_si512(scale.data() + (16 * b + q) * Q8_TILE + 16 * half, a[q]);
        for (int p = 0; T != GQ6_K && p < 4; ++p)  // sub-blocks 2p and 2p + 1's mins: their first sixteens'
          _mm512_storeu_si512(min.data() + (4 * b + p) * Q8_TILE + 16 * half,
                              _mm512_or_si512(m[4 * p], _mm512_slli_epi32(m[4 * p + 2], 16)));
      }
      for (int64_t c = 0; c < K / 64; ++c) {
        __m512i u[16];
        for (int i = 0; i < 16; ++i) {
          const int64_t r = 16 * half + i;
          u[i] = r < nb ? _mm512_sub_epi8(chunk_codes<T>(w + r * row_bytes, c, blocks), _mm512_set1_epi8((char)OFF))
                        : _mm512_setzero_si512();
        }
        transpose16(u);  // u[j]: values 4j .. 4j + 3 of the chunk, of 16 rows
        for (int j = 0; j < 16; ++j) _mm512_storeu_si512(codes.data() + ((16 * c + j) * 2 + half) * 64, u[j]);
        __m512i z[4];  // the codes' share of x's + 128: 128 sum(s) over each 16 values, then each sub-block
        for (int q = 0; q < 4; ++q) {
          z[q] = _mm512_setzero_si512();
          for (int j = 4 * q; j < 4 * q + 4; ++j) z[q] = _mm512_dpbusd_epi32(z[q], ones, u[j]);
        }
        for (int q = 0; q < 4; q += SB / 16) {
          const __m512i zs = SB == 16 ? z[q] : _mm512_add_epi32(z[q], z[q + 1]);
          _mm512_storeu_si512(Z.data() + (4 * c + q) * Q8_TILE + 16 * half,
                              _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_slli_epi32(zs, 7)));
        }
      }
    }
  }
};

// The int32 sums, from z0 / z1, of G groups of four values (from group `first`) of R rows of x (bytes, + 128) against
// a decoded tile's 32 rows: one vpdpbusd adds four products of 16 weight rows against one row's four values
// (broadcast)
template <int R, int G>
inline void byte_sums(const int8_t* codes, const uint8_t* x, int64_t K, int64_t first, __m512i z0, __m512i z1,
                      __m512i sum[R][2]) {
  for (int r = 0; r < R; ++r) sum[r][0] = z0, sum[r][1] = z1;
  _Pragma("GCC unroll 8") for (int g = 0; g < G; ++g) {
    const int64_t group = first + g;
    const __m512i w0 = _mm512_loadu_si512(codes + group * 4 * Q8_TILE), w1 = _mm512_loadu_si512(codes + group * 4 * Q8_TILE + 64);
    for (int r = 0; r < R; ++r) {
      int32_t four;
      memcpy(&four, x + r * K + group * 4, 4);
      const __m512i xb = _mm512_set1_epi32(four);
      sum[r][0] = _mm512_dpbusd_epi32(sum[r][0], xb, w0);
      sum[r][1] = _mm512_dpbusd_epi32(sum[r][1], xb, w1);
    }
  }
}

// R rows of x (from m0) against a decoded tile: per sub-block 2 x R int32 sums (byte_sums) times the scales into
// 2 x R of kernels.h's I in registers, per super-block its float steps; the running result in memory (L1)
template <int64_t T, int R>
void q8_pass(const ByteRows& xs, int64_t m0, const ByteTile<T>& t, int64_t K, float* y, int64_t N, int64_t n0,
             int64_t nb, const int64_t* columns) {
  constexpr int SB = ByteTile<T>::SB;
  alignas(64) float out[R][Q8_TILE] = {};
  const int8_t* codes = t.codes.data();
  const uint8_t* x = xs.xu.data() + m0 * K;
  for (int64_t b = 0; b < K / 256; ++b) {
    __m512i I[R][2];
    for (int r = 0; r < R; ++r) I[r][0] = I[r][1] = _mm512_setzero_si512();
    for (int q = 0; q < 256 / SB; ++q) {
      __m512i sum[R][2];
      const int64_t at = (b * 16 + q * (SB / 16)) * Q8_TILE;  // (SB 32: its first 16's scale and Z)
      byte_sums<R, SB / 4>(codes, x, K, b * 64 + q * (SB / 4), _mm512_loadu_si512(t.Z.data() + at),
                           _mm512_loadu_si512(t.Z.data() + at + 16), sum);
      const __m512i s0 = _mm512_loadu_si512(t.scale.data() + at), s1 = _mm512_loadu_si512(t.scale.data() + at + 16);
      for (int r = 0; r < R; ++r) {
        I[r][0] = _mm512_add_epi32(I[r][0], _mm512_mullo_epi32(sum[r][0], s0));
        I[r][1] = _mm512_add_epi32(I[r][1], _mm512_mullo_epi32(sum[r][1], s1));
      }
    }
    const __m512 d0 = _mm512_loadu_ps(t.d.data() + b * Q8_TILE), d1 = _mm512_loadu_ps(t.d.data() + b * Q8_TILE + 16);
    for (int r = 0; r < R; ++r) {
      __m512 p0 = _mm512_mul_ps(d0, _mm512_cvtepi32_ps(I[r][0])), p1 = _mm512_mul_ps(d1, _mm512_cvtepi32_ps(I[r][1]));
      if constexpr (T != GQ6_K) {  // Mn: the mins against the sums of xq over each 32, two at a time (vpdpwssd)
        __m512i m0_ = _mm512_setzero_si512(), m1_ = _mm512_setzero_si512();
        const int16_t* s16 = xs.s16.data() + (m0 + r) * (K / 16) + b * 16;
        for (int p = 0; p < 4; ++p) {
          const int32_t first = s16[4 * p] + s16[4 * p + 1], second = s16[4 * p + 2] + s16[4 * p + 3];
          const __m512i s = _mm512_set1_epi32((int32_t)((uint32_t)(uint16_t)first | (uint32_t)second << 16));
          const int32_t* mins = t.min.data() + (b * 4 + p) * Q8_TILE;
          m0_ = _mm512_dpwssd_epi32(m0_, _mm512_loadu_si512(mins), s);
          m1_ = _mm512_dpwssd_epi32(m1_, _mm512_loadu_si512(mins + 16), s);
        }
        p0 = _mm512_fmadd_ps(_mm512_loadu_ps(t.nd.data() + b * Q8_TILE), _mm512_cvtepi32_ps(m0_), p0);
        p1 = _mm512_fmadd_ps(_mm512_loadu_ps(t.nd.data() + b * Q8_TILE + 16), _mm512_cvtepi32_ps(m1_), p1);
      }
      const __m512 dx = _mm512_set1_ps(xs.dx[(m0 + r) * (K / 256) + b]);
      _mm512_store_ps(out[r], _mm512_fmadd_ps(p0, dx, _mm512_load_ps(out[r])));
      _mm512_store_ps(out[r] + 16, _mm512_fmadd_ps(p1, dx, _mm512_load_ps(out[r] + 16)));
    }
  }
  for (int r = 0; r < R; ++r) store_tile_row(out[r], y + (m0 + r) * N, n0, nb, columns);
}

// A tile of Q8_TILE weight rows of a 32-block type: codes as ByteTile's (s = u - off: Q8_0's own int8), and of each
// block [K / 32][32 rows] A and B (w = A s + B) and Z = -128 sum(s), the codes' share of x's + 128 (the sums' start)
template <int64_t T>
struct BlockTile {
  static constexpr char OFF = T == GQ4_0 ? 8 : T == GQ5_0 ? 16 : T == GQ8_0 ? (char)128 : 0;
  std::vector<int8_t> codes;
  std::vector<float> A, B;
  std::vector<int32_t> Z;
  explicit BlockTile(int64_t K) : codes((K + 63) / 64 * 64 * Q8_TILE), A(K / 32 * Q8_TILE), B(K / 32 * Q8_TILE),
                                  Z(K / 32 * Q8_TILE) {}

  void decode(const uint8_t* w, int64_t row_bytes, int64_t K, int64_t nb) {
    const int64_t blocks = K / 32;
    for (int64_t r = 0; r < Q8_TILE; ++r)
      for (int64_t k = 0; k < blocks; ++k) {
        float a = 0.f, off = 0.f, b = 0.f;
        if (r < nb) block_params<T>(w + r * row_bytes + k * block_bytes(T), a, off, b);
        A[k * Q8_TILE + r] = a, B[k * Q8_TILE + r] = b;
      }
    const __m512i ones = _mm512_set1_epi8(1);
    for (int half = 0; half < 2; ++half)
      for (int64_t c = 0; c < (blocks + 1) / 2; ++c) {  // 64 values a chunk (an odd last block: its half alone)
        __m512i u[16];
        for (int i = 0; i < 16; ++i) {
          const int64_t r = 16 * half + i;
          u[i] = r < nb ? _mm512_sub_epi8(chunk_codes<T>(w + r * row_bytes, c, blocks), _mm512_set1_epi8(OFF))
                        : _mm512_setzero_si512();
        }
        transpose16(u);  // u[j]: values 4j .. 4j + 3 of the chunk, of 16 rows
        for (int j = 0; j < 16; ++j) _mm512_storeu_si512(codes.data() + ((16 * c + j) * 2 + half) * 64, u[j]);
        for (int q = 0; q < 2 && 2 * c + q < blocks; ++q) {
          __m512i sum = _mm512_setzero_si512();
          for (int j = 8 * q; j < 8 * q + 8; ++j) sum = _mm512_dpbusd_epi32(sum, ones, u[j]);
          _mm512_storeu_si512(Z.data() + (2 * c + q) * Q8_TILE + 16 * half,
                              _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_slli_epi32(sum, 7)));
        }
      }
  }
};

// R rows of x (from m0, a scale dx per 32) against a decoded 32-block tile: per block, the int32 sums (from Z) times A,
// plus B times sum(xq), times dx, into 2 x R float sums in registers
template <int64_t T, int R>
void q8_pass32(const ByteRows& xs, int64_t m0, const BlockTile<T>& t, int64_t K, float* y, int64_t N, int64_t n0,
               int64_t nb, const int64_t* columns) {
  const int64_t blocks = K / 32;
  __m512 out[R][2];
  for (int r = 0; r < R; ++r) out[r][0] = out[r][1] = _mm512_setzero_ps();
  const int8_t* codes = t.codes.data();
  const uint8_t* x = xs.xu.data() + m0 * K;
  for (int64_t k = 0; k < blocks; ++k) {
    __m512i sum[R][2];
    const int64_t at = k * Q8_TILE;
    byte_sums<R, 8>(codes, x, K, k * 8, _mm512_loadu_si512(t.Z.data() + at), _mm512_loadu_si512(t.Z.data() + at + 16), sum);
    const __m512 a0 = _mm512_loadu_ps(t.A.data() + at), a1 = _mm512_loadu_ps(t.A.data() + at + 16);
    for (int r = 0; r < R; ++r) {
      __m512 v0 = _mm512_mul_ps(_mm512_cvtepi32_ps(sum[r][0]), a0);
      __m512 v1 = _mm512_mul_ps(_mm512_cvtepi32_ps(sum[r][1]), a1);
      if constexpr (T == GQ4_1 || T == GQ5_1) {  // the mins: B times sum(xq) over the block
        const __m512 s = _mm512_set1_ps(xs.sum32(m0 + r, k));
        v0 = _mm512_fmadd_ps(_mm512_loadu_ps(t.B.data() + at), s, v0);
        v1 = _mm512_fmadd_ps(_mm512_loadu_ps(t.B.data() + at + 16), s, v1);
      }
      const __m512 d = _mm512_set1_ps(xs.dx[(m0 + r) * blocks + k]);
      out[r][0] = _mm512_fmadd_ps(v0, d, out[r][0]);
      out[r][1] = _mm512_fmadd_ps(v1, d, out[r][1]);
    }
  }
  for (int r = 0; r < R; ++r) {
    alignas(64) float row[Q8_TILE];
    _mm512_store_ps(row, out[r][0]), _mm512_store_ps(row + 16, out[r][1]);
    store_tile_row(row, y + (m0 + r) * N, n0, nb, columns);
  }
}

// One pass of R rows of x over a decoded tile, by its kind
template <int64_t T, int R, typename Tile>
inline void byte_pass(const ByteRows& xs, int64_t m0, const Tile& t, int64_t K, float* y, int64_t N, int64_t n0,
                      int64_t nb, const int64_t* columns) {
  if constexpr (T >= GQ4_K) q8_pass<T, R>(xs, m0, t, K, y, N, n0, nb, columns);
  else q8_pass32<T, R>(xs, m0, t, K, y, N, n0, nb, columns);
}

// y [M, ldy] (its columns[n] for weight row n; columns null: y [M, N]) = x [M, K] w^T
template <int64_t T>
void gguf_prefill(const at::Tensor& x, const uint8_t* w, int64_t row_bytes, int64_t N, float* y, int64_t ldy,
               const int64_t* columns) {
  const int64_t M = x.size(0), K = x.size(1);
  const ByteRows xs(x.data_ptr<float>(), M, K, T >= GQ4_K ? 256 : 32);
  using Tile = std::conditional_t<T >= GQ4_K, ByteTile<T>, BlockTile<T>>;
  const int64_t tiles = (N + Q8_TILE - 1) / Q8_TILE;
  // a long prompt Q8_BLOCK rows of x at a time (a tile passes over them from the thread's cache), each block its
  // own round of tiles
  for (int64_t first = 0; first < M; first += Q8_BLOCK) {
    const int64_t last = std::min(M, first + Q8_BLOCK);
    std::atomic<int64_t> next{0};  // tiles claimed one at a time: a thread the host slows takes fewer
    at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), tiles), 1, [&](int64_t, int64_t) {
      Tile tile(K);
      for (int64_t t = next++, after; t < tiles; t = after) {
        after = next++;  // claimed now, and asked for into L2 a slice a pass while this tile computes (decoding
                         // waited on memory)
        const uint8_t* ahead = w + after * Q8_TILE * row_bytes;
        const int64_t bytes = after < tiles ? std::min<int64_t>(Q8_TILE, N - after * Q8_TILE) * row_bytes : 0;
        const int64_t slice = (bytes / ((last - first + Q8_ROWS - 1) / Q8_ROWS) + 63) / 64 * 64;
        const int64_t n0 = t * Q8_TILE, nb = std::min<int64_t>(Q8_TILE, N - n0);
        tile.decode(w + n0 * row_bytes, row_bytes, K, nb);
        for (int64_t m0 = first, at = 0; m0 < last; m0 += Q8_ROWS) {
          for (const int64_t end = std::min(bytes, at + slice); at < end; at += 64) _mm_prefetch((const char*)ahead + at, _MM_HINT_T1);
          switch (std::min<int64_t>(Q8_ROWS, last - m0)) {
            case 1: byte_pass<T, 1>(xs, m0, tile, K, y, ldy, n0, nb, columns); break;
            case 2: byte_pass<T, 2>(xs, m0, tile, K, y, ldy, n0, nb, columns); break;
            case 3: byte_pass<T, 3>(xs, m0, tile, K, y, ldy, n0, nb, columns); break;
            case 4: byte_pass<T, 4>(xs, m0, tile, K, y, ldy, n0, nb, columns); break;
            case 5: byte_pass<T, 5>(xs, m0, tile, K, y, ldy, n0, nb, columns); break;
            default: byte_pass<T, 6>(xs, m0, tile, K, y, ldy, n0, nb, columns); break;
          }
        }
      }
    });
  }
}

// ---- attention over the cache ------------------------------------------------------------------------------------
// Keys are cached in blocks of 16 slots, k [B, K, (S + 1) / 16, D, 16]: the scores of a block are one FMA per channel
// (the query's channel broadcast) over one contiguous D x 16 block; values stay [B, K, S + 1, D], added row by row. Each query reads only the slots it
// can see, start..pos (start = its row's first slot in a left-padded batch, or the first slot of its sliding window),
// so decoding at position p costs O(p), or O(window), whatever the cache length. q [B, H, T, D] float32; pos [T]
// int64 (every row at the same slots) or [B, T] (a slot per row: a server's batch); row_start [B] int64 or empty;
// rows [B] int64 or empty: the cache row of each batch row (a server prefilling one request in its row); window 0 or
// the sliding window; softcap 0 or the cap of cap * tanh(score / cap) (Gemma 2).

// e^x for x <= 0 (softmax arguments): 2^(x log2 e) = 2^n * 2^f, f in [-0.5, 0.5], 2^f by its degree-6 Taylor
// polynomial (relative error below 2e-7), 2^n by vscalefps.
inline __m512 exp_nonpositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-104.f));
  __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504f));
  __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 f = _mm512_mul_ps(_mm512_sub_ps(t, n), _mm512_set1_ps(0.69314718f));  // f ln 2, in [-0.35, 0.35]
  __m512 p = _mm512_set1_ps(1.f / 720.f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 120.f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 24.f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 6.f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

// cap * tanh(x / cap) = cap * sign(x) (1 - e) / (1 + e), e = e^(-2 |x| / cap): softcapped attention scores
inline __m512 softcap16(__m512 x, float cap) {
  const __m512 a = _mm512_abs_ps(x);
  const __m512 e = exp_nonpositive(_mm512_mul_ps(a, _mm512_set1_ps(-2.f / cap)));
  __m512 t = _mm512_div_ps(_mm512_sub_ps(_mm512_set1_ps(1.f), e), _mm512_add_ps(_mm512_set1_ps(1.f), e));
  t = _mm512_mul_ps(t, _mm512_set1_ps(cap));
  return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(t), _mm512_and_si512(_mm512_castps_si512(x),
                                                                                       _mm512_set1_epi32(INT32_MIN))));
}

constexpr int CHUNK = 8;   // x 16 slots scored at a time by up to 3 queries: 3 x CHUNK accumulators

// 16 cached values as float32, from a float32, bfloat16 or float16 cache
inline __m512 load16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 load16(const uint16_t* p, __mmask16 m) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}
inline __m512 load16(const c10::Half* p, __mmask16 m) { return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, p)); }
inline __m512 load16(const int8_t* p, __mmask16 m) {  // (an int8 cache: times the slot's scale by the caller)
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(m, p)));
}


// The scores of N queries against U blocks of 16 keys at `keys` (each D x 16 contiguous values), scaled (and capped),
// to dst + i * stride (query i). N and U are constants: the N x U accumulators stay in registers, each a chain over d
// (the same sums, in the same order, whatever N or U: a query's scores do not depend on its companions)
template <int N, int U, typename T>
inline void score_blocks(const float* const* q, const T* keys, const float* key_scales, int64_t D, float scale,
                         float softcap, float* dst, int64_t stride) {
  __m512 acc[N][U];
  for (int i = 0; i < N; ++i)
    for (int u = 0; u < U; ++u) acc[i][u] = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; ++d)
    for (int u = 0; u < U; ++u) {
      const __m512 key = load16(keys + (u * D + d) * 16, 0xFFFF);
      for (int i = 0; i < N; ++i) acc[i][u] = _mm512_fmadd_ps(_mm512_set1_ps(q[i][d]), key, acc[i][u]);
    }
  for (int i = 0; i < N; ++i)
    for (int u = 0; u < U; ++u) {
      __m512 s = _mm512_mul_ps(acc[i][u], _mm512_set1_ps(scale));
      if (key_scales) s = _mm512_mul_ps(s, _mm512_loadu_ps(key_scales + u * 16));
      _mm512_storeu_ps(dst + i * stride + u * 16, softcap > 0.f ? softcap16(s, softcap) : s);
    }
}

// out[i].acc[c0 * 16 ..] = sum over slots lo..hi of p_ij v_j, 16 C channels of each value row, read once for the N
// queries (p: scores, query i's at p + i * stride, slot j's at index j - base)
template <int N, int C, typename T>
inline void weigh_values(const float* p, int64_t stride, int64_t base, int64_t lo, int64_t hi, const T* vv, int64_t D,
                         int64_t c0, Partial* out) {
  __m512 acc[N][C];
  for (int i = 0; i < N; ++i)
    for (int c = 0; c < C; ++c) acc[i][c] = _mm512_setzero_ps();
  for (int64_t j = lo; j <= hi; ++j) {
    const T* row = vv + j * D;
    __m512 value[C];
    for (int c = 0; c < C; ++c) value[c] = load16(row + (c0 + c) * 16, lanes(D - (c0 + c) * 16));
    for (int i = 0; i < N; ++i) {
      const __m512 w = _mm512_set1_ps(p[i * stride + (j - base)]);
      for (int c = 0; c < C; ++c) acc[i][c] = _mm512_fmadd_ps(w, value[c], acc[i][c]);
    }
  }
  for (int i = 0; i < N; ++i)
    for (int c = 0; c < C; ++c) _mm512_mask_storeu_ps(out[i].acc + (c0 + c) * 16, lanes(D - (c0 + c) * 16), acc[i][c]);
}

// kernels.h's attend_queries: the scores of CHUNK blocks of keys at a time, the softmax over each query's own slots,
// then the values
template <int N, typename T>
void attend_queries(const float* const* q, const int64_t* start, const int64_t* end, int64_t lo, int64_t hi,
                    const T* kt, const T* vv, Scales scales, int64_t D, float scale, float softcap, Partial* out,
                    std::vector<float>& buffer) {
  const int64_t first = lo / 16, last = hi / 16, base = first * 16;  // whole blocks of 16 slots
  const int64_t width = (last + 1) * 16 - base, stride = width + 16;
  buffer.resize(N * stride);
  float* scores = buffer.data();
  auto key_scales = [&](int64_t b) { return scales.k ? scales.k + b * 16 : nullptr; };
  constexpr int U = N == 4 ? 6 : CHUNK;  // blocks a pass: N x U accumulators (of 32 registers)
  int64_t blk = first;
  for (; blk + U <= last + 1; blk += U)
    score_blocks<N, U>(q, kt + blk * D * 16, key_scales(blk), D, scale, softcap, scores + blk * 16 - base, stride);
  for (; blk <= last; ++blk)
    score_blocks<N, 1>(q, kt + blk * D * 16, key_scales(blk), D, scale, softcap, scores + blk * 16 - base, stride);
  for (int i = 0; i < N; ++i) {  // e^(s - max) over the query's own slots in this part; zero elsewhere
    float* s = scores + i * stride;
    const int64_t a = std::max(start[i], lo) - base, b = std::min(end[i], hi) - base;
    out[i].max = -INFINITY, out[i].sum = 0.f;
    if (a > b) {
      std::fill(s, s + width, 0.f);
      continue;
    }
    __m512 vmax = _mm512_set1_ps(-INFINITY);
    for (int64_t j = a; j <= b; j += 16) vmax = _mm512_mask_max_ps(vmax, lanes(b + 1 - j), vmax, _mm512_loadu_ps(s + j));
    out[i].max = _mm512_reduce_max_ps(vmax);
    const __m512 top = _mm512_set1_ps(out[i].max);
    __m512 vsum = _mm512_setzero_ps();
    for (int64_t j = a; j <= b; j += 16) {
      __mmask16 m = lanes(b + 1 - j);
      __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, s + j), top));
      _mm512_mask_storeu_ps(s + j, m, e);
      vsum = _mm512_mask_add_ps(vsum, m, vsum, e);
    }
    std::fill(s, s + a, 0.f);
    std::fill(s + b + 1, s + width, 0.f);
    out[i].sum = _mm512_reduce_add_ps(vsum);
    scale_weights(s, a, b, base, scales.v);
  }
  const int64_t DV = (D + 15) / 16;
  for (int64_t c0 = 0; c0 < DV; c0 += 4)  // 64 channels a pass: N x 4 accumulators
    switch (std::min<int64_t>(4, DV - c0)) {
      case 4: weigh_values<N, 4>(scores, stride, base, lo, hi, vv, D, c0, out); break;
      case 3: weigh_values<N, 3>(scores, stride, base, lo, hi, vv, D, c0, out); break;
      case 2: weigh_values<N, 2>(scores, stride, base, lo, hi, vv, D, c0, out); break;
      default: weigh_values<N, 1>(scores, stride, base, lo, hi, vv, D, c0, out);
    }
}

}  // namespace

REGISTER_OPS(uint16_t)  // (W: bfloat16 words)
