// kernels.cpp: the CPU matmuls of a decode step, for x [M, K] with few rows (one token, a batch, a draft to verify)
// against a weight [N, K] read once from memory. Built on first use by kernels.py (g++ -O3 -march=native); needs
// AVX-512 with VNNI. Each op is registered as a PyTorch operator, so a compiled decode step calls it directly.
//
//   dense_kernels::linear_f32 (x, w)          w float32 [N, K]
//   dense_kernels::linear_int8(x, w, s)       w uint8 [N, K] = int8 weight + 128, s float32 [N]
//   dense_kernels::linear_int4(x, q, d, m)    q uint8 [N, K/2], d and m float32 [N, K/32]: w = d * code + m
//
// The int8 kernel quantizes x to int8 per block of 32 (scale = max|x| / 127, as llama.cpp's Q8 does) and takes 64
// products per instruction (vpdpbusd: unsigned weight bytes times signed activation bytes); each block's sum is
// then scaled in float32. The int4 kernel takes x in bfloat16 (see below). A tile computes NB weight rows against
// up to 8 rows of x, so a weight row is loaded once for all of them.
#if !defined(__AVX512F__) || !defined(__AVX512BW__) || !defined(__AVX512VNNI__) || !defined(__AVX512BF16__)
#error "kernels.cpp needs AVX-512 (F, BW, VNNI, BF16); kernels.py falls back to PyTorch's kernels"
#endif

#include <ATen/Parallel.h>
#include <torch/library.h>
#include <ATen/ATen.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

constexpr int MAX_ROWS = 8;  // rows of x per tile: 8 x NB accumulators stay in registers
#ifndef PREFETCH
#define PREFETCH 2048  // bytes ahead of a weight row's loads (measured)
#endif


#define DISPATCH_ROWS(rows, BODY)                  \
  switch (rows) {                                  \
    case 1: { constexpr int R = 1; BODY; break; }  \
    case 2: { constexpr int R = 2; BODY; break; }  \
    case 3: { constexpr int R = 3; BODY; break; }  \
    case 4: { constexpr int R = 4; BODY; break; }  \
    case 5: { constexpr int R = 5; BODY; break; }  \
    case 6: { constexpr int R = 6; BODY; break; }  \
    case 7: { constexpr int R = 7; BODY; break; }  \
    default: { constexpr int R = 8; BODY; break; } \
  }

// Split the N weight rows across threads in tiles of NB; within a tile, walk x in chunks of up to 8 rows so the
// tile's weights stay in L1 while every row of x passes over them.
template <int NB, int ROWS = MAX_ROWS, typename Tile>
void for_each_tile(int64_t M, int64_t N, int64_t K, int64_t bytes_per_weight_row, Tile tile) {
  int64_t tiles = (N + NB - 1) / NB;
  int64_t grain = std::max<int64_t>(1, (64 << 10) / std::max<int64_t>(1, NB * bytes_per_weight_row));  // >= 64 KB
  at::parallel_for(0, tiles, grain, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      int64_t n0 = t * NB, nb = std::min<int64_t>(NB, N - n0);
      for (int64_t m0 = 0; m0 < M; m0 += ROWS) tile(m0, std::min<int64_t>(ROWS, M - m0), n0, nb);
    }
  });
}

at::Tensor output_like(const at::Tensor& x, int64_t N) {
  auto shape = x.sizes().vec();
  shape.back() = N;
  return at::empty(shape, x.options());
}

// ---- float32 weights --------------------------------------------------------------------------------------------

template <int R, int NB>
void f32_tile(const float* x, const float* w, int64_t K, float* y, int64_t N, int64_t n0) {
  __m512 acc[R][NB];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NB; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 16) {
    __mmask16 mask = K - k >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (K - k)) - 1);
    __m512 wv[NB];
    for (int j = 0; j < NB; ++j) wv[j] = _mm512_maskz_loadu_ps(mask, w + (n0 + j) * K + k);
    for (int r = 0; r < R; ++r) {
      __m512 xv = _mm512_maskz_loadu_ps(mask, x + r * K + k);
      for (int j = 0; j < NB; ++j) acc[r][j] = _mm512_fmadd_ps(xv, wv[j], acc[r][j]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NB; ++j) y[r * N + n0 + j] = _mm512_reduce_add_ps(acc[r][j]);
}

at::Tensor linear_f32(const at::Tensor& x_, const at::Tensor& w) {
  TORCH_CHECK(x_.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat && w.is_contiguous());
  auto x = x_.reshape({-1, x_.size(-1)}).contiguous();
  int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(w.size(1) == K, "linear_f32: x has ", K, " features, the weight ", w.size(1));
  auto y = output_like(x_, N);
  const float *xp = x.data_ptr<float>(), *wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  // 4 rows of x at a time against 4 weight rows (16 accumulators, 8 loads per 16 FMAs); the tile's weights stay in
  // L1 for the next 4 rows
  for_each_tile<4, 4>(M, N, K, 4 * K, [&](int64_t m0, int64_t rows, int64_t n0, int64_t nb) {
    if (nb == 4) {
      DISPATCH_ROWS(rows, (f32_tile<R, 4>(xp + m0 * K, wp, K, yp + m0 * N, N, n0)));
    } else {
      for (int64_t j = 0; j < nb; ++j) DISPATCH_ROWS(rows, (f32_tile<R, 1>(xp + m0 * K, wp, K, yp + m0 * N, N, n0 + j)));
    }
  });
  return y;
}

// ---- activations quantized per block of 32 (the int8 kernel) ---------------------------------------------------

// One row of x, K % 64 == 0 -> int8 codes; per 64 inputs, the scale of the block each of the 16 int32 lanes of a
// vpdpbusd result covers (lanes 0-7: the first block of 32, 8-15: the second); and sum_blocks d * sum(codes).
void quantize_row(const float* x, int64_t K, int8_t* q, float* lane_scale, float* code_sum) {
  double total = 0;
  for (int64_t b = 0; b < K / 32; ++b) {
    const float* xb = x + b * 32;
    float amax = 0.f;
    for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(xb[j]));
    float d = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
    int codes = 0;
    for (int j = 0; j < 32; ++j) {
      int v = (int)std::nearbyint(xb[j] * inv);
      codes += v;
      q[b * 32 + j] = (int8_t)v;
    }
    total += (double)d * codes;
    for (int lane = 0; lane < 8; ++lane) lane_scale[(b / 2) * 16 + (b % 2) * 8 + lane] = d;
  }
  *code_sum = (float)total;
}

struct QuantizedRows {
  std::vector<int8_t> q;
  std::vector<float> lane_scale, code_sum;
  QuantizedRows(const float* x, int64_t M, int64_t K) : q(M * K), lane_scale(M * K / 4), code_sum(M) {
    at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
      for (int64_t m = m0; m < m1; ++m)
        quantize_row(x + m * K, K, q.data() + m * K, lane_scale.data() + m * K / 4, code_sum.data() + m);
    });
  }
};

// ---- int8 weights, one scale per output row -----------------------------------------------------------------------
// The weight is stored + 128 (unsigned, as vpdpbusd wants it): sum (w + 128) q = sum w q + 128 sum q, and
// sum_blocks d * 128 * sum q is the row's code_sum, the same for every output.

template <int R, int NB>
void int8_tile(const QuantizedRows& qx, int64_t m0, const uint8_t* w, const float* s, int64_t K, float* y,
               int64_t N, int64_t n0) {
  __m512 acc[R][NB];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NB; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 64) {
    __m512i wv[NB];
    for (int j = 0; j < NB; ++j) wv[j] = _mm512_loadu_si512(w + (n0 + j) * K + k);
    for (int r = 0; r < R; ++r) {
      __m512i xv = _mm512_loadu_si512(qx.q.data() + (m0 + r) * K + k);
      __m512 sc = _mm512_loadu_ps(qx.lane_scale.data() + (m0 + r) * K / 4 + k / 4);
      for (int j = 0; j < NB; ++j) {
        __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wv[j], xv);
        acc[r][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), sc, acc[r][j]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NB; ++j)
      y[r * N + n0 + j] = (_mm512_reduce_add_ps(acc[r][j]) - 128.f * qx.code_sum[m0 + r]) * s[n0 + j];
}

at::Tensor linear_int8(const at::Tensor& x_, const at::Tensor& w, const at::Tensor& s) {
  TORCH_CHECK(x_.scalar_type() == at::kFloat && w.scalar_type() == at::kByte && s.scalar_type() == at::kFloat);
  auto x = x_.reshape({-1, x_.size(-1)}).contiguous();
  int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(K % 64 == 0 && w.size(1) == K && w.is_contiguous() && s.numel() == N, "linear_int8: bad shapes");
  QuantizedRows qx(x.data_ptr<float>(), M, K);
  auto y = output_like(x_, N);
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const float* sp = s.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  for_each_tile<1>(M, N, K, K, [&](int64_t m0, int64_t rows, int64_t n0, int64_t) {
    DISPATCH_ROWS(rows, (int8_tile<R, 1>(qx, m0, wp, sp, K, yp + m0 * N, N, n0)));
  });
  return y;
}

// ---- int4 weights, llama.cpp's Q4_1 grid: w = d * code + m per block of 32 --------------------------------------
// Per row and block: 16 bytes, byte j holding code j (low nibble) and code j + 16 (high nibble); d and m float32
// [N, K/32]. Each block is dequantized through a table of its 16 values (one FMA, rounded to bfloat16, looked up with
// one vpermw), then multiplied with bfloat16 activations by vdpbf16ps (32 products per instruction, float32 sums).
// 8-bit activations would be faster still but cost this 4-bit grid 1% perplexity (measured); bfloat16 costs 0.2%.

template <int R, int NB>
void int4_tile(const uint16_t* x, const uint8_t* q, const float* d, const float* mn, int64_t K, float* y, int64_t N,
               int64_t n0) {
  const int64_t G = K / 32;
  __m512 acc[2][R][NB];  // two accumulators a row, alternating blocks: two dependency chains
  for (int a = 0; a < 2; ++a)
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < NB; ++j) acc[a][r][j] = _mm512_setzero_ps();
  const __m256i low = _mm256_set1_epi16(15);
  const __m512 iota = _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  for (int64_t g = 0; g < G; ++g) {
    __m512bh w[NB];
    for (int j = 0; j < NB; ++j) {
      const uint8_t* block = q + (n0 + j) * (K / 2) + g * 16;
      _mm_prefetch((const char*)block + PREFETCH, _MM_HINT_T0);
      __m256i bytes = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i*)block));
      __m512i codes = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(bytes, low)),
                                         _mm256_srli_epi16(bytes, 4), 1);  // codes 0..31 of the block, in order
      __m512 table = _mm512_fmadd_ps(iota, _mm512_set1_ps(d[(n0 + j) * G + g]), _mm512_set1_ps(mn[(n0 + j) * G + g]));
      w[j] = (__m512bh)_mm512_permutexvar_epi16(codes, (__m512i)_mm512_cvtne2ps_pbh(table, table));
    }
    for (int r = 0; r < R; ++r) {
      __m512bh xv = (__m512bh)_mm512_loadu_si512(x + r * K + g * 32);
      for (int j = 0; j < NB; ++j) acc[g & 1][r][j] = _mm512_dpbf16_ps(acc[g & 1][r][j], xv, w[j]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NB; ++j) y[r * N + n0 + j] = _mm512_reduce_add_ps(_mm512_add_ps(acc[0][r][j], acc[1][r][j]));
}

at::Tensor linear_int4(const at::Tensor& x_, const at::Tensor& q, const at::Tensor& d, const at::Tensor& mn) {
  TORCH_CHECK(x_.scalar_type() == at::kFloat && q.scalar_type() == at::kByte && d.scalar_type() == at::kFloat &&
              mn.scalar_type() == at::kFloat);
  auto x = x_.reshape({-1, x_.size(-1)}).contiguous();
  int64_t M = x.size(0), K = x.size(1), N = q.size(0);
  TORCH_CHECK(K % 32 == 0 && q.size(1) == K / 2 && d.numel() == N * K / 32 && mn.numel() == N * K / 32 &&
              q.is_contiguous() && d.is_contiguous() && mn.is_contiguous(), "linear_int4: bad shapes");
  std::vector<uint16_t> xb(M * K);  // x in bfloat16 (round to nearest even)
  const float* xp = x.data_ptr<float>();
  for (int64_t i = 0; i < M * K; i += 16)
    _mm256_storeu_si256((__m256i*)(xb.data() + i), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(xp + i)));
  auto y = output_like(x_, N);
  const uint8_t* qp = q.data_ptr<uint8_t>();
  const float *dp = d.data_ptr<float>(), *mp = mn.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  for_each_tile<2>(M, N, K, K / 2, [&](int64_t m0, int64_t rows, int64_t n0, int64_t nb) {
    if (nb == 2 && rows <= 4) {
      DISPATCH_ROWS(rows, (int4_tile<R, 2>(xb.data() + m0 * K, qp, dp, mp, K, yp + m0 * N, N, n0)));
    } else {  // 8 rows x 2 x 2 accumulators would not fit the registers: one weight row at a time
      for (int64_t j = 0; j < nb; ++j)
        DISPATCH_ROWS(rows, (int4_tile<R, 1>(xb.data() + m0 * K, qp, dp, mp, K, yp + m0 * N, N, n0 + j)));
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY(dense_kernels, m) {
  m.def("linear_f32(Tensor x, Tensor w) -> Tensor");
  m.def("linear_int8(Tensor x, Tensor w, Tensor scales) -> Tensor");
  m.def("linear_int4(Tensor x, Tensor q, Tensor d, Tensor m) -> Tensor");
}

TORCH_LIBRARY_IMPL(dense_kernels, CPU, m) {
  m.impl("linear_f32", &linear_f32);
  m.impl("linear_int8", &linear_int8);
  m.impl("linear_int4", &linear_int4);
}
