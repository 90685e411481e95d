// kernels_avx2.cpp: kernels.cpp's operators for CPUs with AVX2 and FMA but no AVX-512 (AMD Zen 1-3, Intel laptops and
// desktops since Alder Lake, which dropped AVX-512): the same operators and schemas, in 8-lane registers. kernels.py
// builds this file where kernels.cpp cannot run. What differs:
//   * 16 registers, not 32: tiles hold fewer accumulators (one to four weight rows against up to 4 or 8 rows of x);
//   * 8-bit products by vpmaddubsw (unsigned x signed bytes, pairs in int16) and vpmaddwd (pairs in int32), or by one
//     vpdpbusd where the CPU has AVX-VNNI (dot_bytes; the int8 weights' products, the same integers); int8 weights go
//     through it as |w| times x with w's sign (pairs stay below int16's limit); nf4 and int4 compute kernels.cpp's
//     bits (kernels.h); GGUF blocks decode on x in bytes (llama.cpp's), kernels.cpp's bits;
//   * no bfloat16 arithmetic: a long prefill's nf4 runs its tiles' integer products in a GEMM (kernels.h's tile_gemm);
//     GGUF blocks as kernels.cpp, integer products on x in bytes (vpmaddubsw or vpdpbusd); int8 weights past
//     INT8_TILE_ROWS as kernels.cpp (kernels.h's int8_gemm), by vpmaddwd (AVX-VNNI: vpdpwssd).
// Each row of x is still summed in one fixed order whatever the tile or the batch: a row's result does not depend on
// the other rows.
#if !defined(__AVX2__) || !defined(__FMA__) || !defined(__F16C__)
#error "kernels_avx2.cpp needs AVX2, FMA and F16C; kernels.py falls back to PyTorch's kernels"
#endif

#include "kernels.h"

namespace {

inline float hmax(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}

inline int32_t hsum(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
  return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1))));
}

// the first `left` of 8 lanes (all when left >= 8), as vmaskmovps wants them
inline __m256i lanes8(int64_t left) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)std::min<int64_t>(left, 8)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

inline __m256 to_float(__m128i bytes8) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes8)); }  // 8 bytes

constexpr int64_t AHEAD = 8192;  // bytes ahead of a weight row's loads, into L2 (kernels.cpp's distance)

// ---- float32 weights --------------------------------------------------------------------------------------------

template <int R, int NB, bool AHEAD_OF_MEMORY = true>  // (false: weights already in the cache, f32_rows' tiles)
void f32_tile(const float* x, const float* w, int64_t K, float* y, int64_t N, int64_t n0) {
  __m256 acc[R][NB];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NB; ++j) acc[r][j] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    __m256 wv[NB];
    if (AHEAD_OF_MEMORY && k % 16 == 0)  // each weight row AHEAD bytes on, a line at a time (as the int8 tile)
      for (int j = 0; j < NB; ++j) _mm_prefetch((const char*)(w + (n0 + j) * K + k) + AHEAD, _MM_HINT_T1);
    for (int j = 0; j < NB; ++j) wv[j] = _mm256_loadu_ps(w + (n0 + j) * K + k);
    for (int r = 0; r < R; ++r) {
      const __m256 xv = _mm256_loadu_ps(x + r * K + k);
      for (int j = 0; j < NB; ++j) acc[r][j] = _mm256_fmadd_ps(xv, wv[j], acc[r][j]);
    }
  }
  if (k < K) {
    const __m256i m = lanes8(K - k);
    __m256 wv[NB];
    for (int j = 0; j < NB; ++j) wv[j] = _mm256_maskload_ps(w + (n0 + j) * K + k, m);
    for (int r = 0; r < R; ++r) {
      const __m256 xv = _mm256_maskload_ps(x + r * K + k, m);
      for (int j = 0; j < NB; ++j) acc[r][j] = _mm256_fmadd_ps(xv, wv[j], acc[r][j]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NB; ++j) y[r * N + n0 + j] = hsum(acc[r][j]);
}

// kernels.h's tile_gemm: 6 rows of x against 2 weight rows a block (12 accumulators, 2 weights and x: 15 of 16
// registers), K in chunks of 512; past 24 rows of x (BENCHMARKS.md)
constexpr int GEMM_R = 6, GEMM_NB = 2;
constexpr int64_t F32_TILE_ROWS = 24;

template <int NB>
void f32_block(const float* xb, const float* wb, const float*, int64_t K, int64_t steps, float* acc, bool first,
               bool last, float* y, int64_t ldy, int64_t rows) {
  __m256 a[GEMM_R][NB];
  for (int r = 0; r < GEMM_R; ++r)
    for (int j = 0; j < NB; ++j) a[r][j] = first ? _mm256_setzero_ps() : _mm256_load_ps(acc + 8 * (r * NB + j));
  const bool tail = last && K % 8;  // (the last step's lanes past K: w masked to zeros, as f32_tile's)
  auto step = [&](const float* xs, const __m256 wv[NB]) {
    for (int r = 0; r < GEMM_R; ++r) {
      __m256 xv = _mm256_load_ps(xs + 8 * r);
      __asm__("" : "+x"(xv));  // (one load a row of x: GCC folds it into each FMA otherwise, NB loads)
      for (int j = 0; j < NB; ++j) a[r][j] = _mm256_fmadd_ps(xv, wv[j], a[r][j]);
    }
  };
  for (int64_t s = 0; s < steps - tail; ++s, xb += 8 * GEMM_R, wb += 8) {
    __m256 wv[NB];
    for (int j = 0; j < NB; ++j) wv[j] = _mm256_loadu_ps(wb + j * K);
    step(xb, wv);
  }
  if (tail) {
    __m256 wv[NB];
    for (int j = 0; j < NB; ++j) wv[j] = _mm256_maskload_ps(wb + j * K, lanes8(K % 8));
    step(xb, wv);
  }
  for (int r = 0; r < GEMM_R; ++r)
    for (int j = 0; j < NB; ++j) {
      if (!last) _mm256_store_ps(acc + 8 * (r * NB + j), a[r][j]);
      else if (r < rows) y[r * ldy + j] = hsum(a[r][j]);
    }
}

// y [M, N] = x [M, K] w^T, every M: past F32_TILE_ROWS kernels.h's tile_gemm, in the tiles' order
void f32_tiles(const float* xp, const float* wp, int64_t M, int64_t K, float* yp, int64_t N) {
  if (M > F32_TILE_ROWS) {  // (a prefill: the same bits, kernels.h)
    const auto panel = [wp, K](int64_t n0, int64_t) { return PanelRows<float>{wp + n0 * K, nullptr}; };
    tile_gemm<8, GEMM_R, GEMM_NB, 512>(xp, M, K, yp, N, panel, [](int64_t nb, auto... args) {
      if (nb == 2) f32_block<2>(args...);
      else f32_block<1>(args...);
    });
    return;
  }
  // 4 weight rows against one row of x, 2 against up to 4 (8 accumulators, 2 weights and x: 11 of 16 registers)
  if (M == 1) {
    for_each_tile<4>(M, N, K, 4 * K, [&](int64_t, int64_t, int64_t n0, int64_t nb) {
      if (nb == 4) f32_tile<1, 4>(xp, wp, K, yp, N, n0);
      else for (int64_t j = 0; j < nb; ++j) f32_tile<1, 1>(xp, wp, K, yp, N, n0 + j);
    });
    return;
  }
  for_each_tile<2, 4>(M, N, K, 2 * K, [&](int64_t m0, int64_t rows, int64_t n0, int64_t nb) {
    if (nb == 2) {
      DISPATCH_ROWS(rows, (f32_tile<R, 2>(xp + m0 * K, wp, K, yp + m0 * N, N, n0)));
    } else {
      DISPATCH_ROWS(rows, (f32_tile<R, 1>(xp + m0 * K, wp, K, yp + m0 * N, N, n0)));
    }
  });
}

void f32_rows(const float* x, int64_t M, const float* w, int64_t nb, int64_t K, float* y, int64_t ldy) {
  for (int64_t m0 = 0; m0 < M; m0 += 4) {  // 2 weight rows against up to 4 rows of x, as f32_tiles
    const int64_t rows = std::min<int64_t>(4, M - m0);
    int64_t j = 0;
    for (; j + 2 <= nb; j += 2) DISPATCH_ROWS(rows, (f32_tile<R, 2, false>(x + m0 * K, w, K, y + m0 * ldy, ldy, j)));
    for (; j < nb; ++j) DISPATCH_ROWS(rows, (f32_tile<R, 1, false>(x + m0 * K, w, K, y + m0 * ldy, ldy, j)));
  }
}

// 8 registers of 8 int32 lanes, transposed: lane j of register i <-> lane i of register j
inline void transpose8(__m256i r[8]) {
  __m256i t[8], u[8];
  for (int i = 0; i < 8; i += 2)
    t[i] = _mm256_unpacklo_epi32(r[i], r[i + 1]), t[i + 1] = _mm256_unpackhi_epi32(r[i], r[i + 1]);
  for (int i = 0; i < 8; i += 4) {
    u[i] = _mm256_unpacklo_epi64(t[i], t[i + 2]), u[i + 1] = _mm256_unpackhi_epi64(t[i], t[i + 2]);
    u[i + 2] = _mm256_unpacklo_epi64(t[i + 1], t[i + 3]), u[i + 3] = _mm256_unpackhi_epi64(t[i + 1], t[i + 3]);
  }  // u[4a + b]: rows 4a .. 4a + 3 of columns b (low 128 bits) and b + 4 (high)
  for (int i = 0; i < 4; ++i)
    r[i] = _mm256_permute2x128_si256(u[i], u[4 + i], 0x20), r[i + 4] = _mm256_permute2x128_si256(u[i], u[4 + i], 0x31);
}

// ---- int8 weights, one scale per output row ------------------------------------------------------------------------
// x as two int8 digits a row, as kernels.cpp: d = max|x| / 127, q1 = round(x / d), q2 = round((x / d - q1) * 127).
// dot_bytes multiplies unsigned by signed bytes: |w| by the digit with w's sign (|w| <= 128, so a pair of products
// stays within int16 where vpmaddubsw takes them). The sums over K are exact integers, as with kernels.cpp's VNNI,
// and y = int8_out(127 B1 + B2) (kernels.h).

struct DigitRows {
  std::vector<int8_t> q1, q2;  // [M, K]
  std::vector<float> scale;    // per row: d
  std::vector<int64_t> sum1, sum2;  // per row: sum q1, sum q2
  DigitRows(const float* x, int64_t M, int64_t K) : q1(M * K), q2(M * K), scale(M), sum1(M), sum2(M) {
    constexpr int nearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    for (int64_t row = 0; row < M; ++row) {  // (K is a multiple of 16 for every caller)
      const float* xr = x + row * K;
      __m256 amax = _mm256_setzero_ps();
      const __m256 sign = _mm256_set1_ps(-0.f);
      for (int64_t k = 0; k < K; k += 8) amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, _mm256_loadu_ps(xr + k)));
      const float top = hmax(amax);
      scale[row] = top / 127.f;
      const __m256 inv = _mm256_set1_ps(top > 0.f ? 127.f / top : 0.f), k127 = _mm256_set1_ps(127.f);
      __m256i s1 = _mm256_setzero_si256(), s2 = _mm256_setzero_si256();
      for (int64_t k = 0; k < K; k += 16) {  // 16 at a time: two registers' int32 packed to 16 int8
        __m256i a[2], c[2];
        for (int h = 0; h < 2; ++h) {
          const __m256 v = _mm256_mul_ps(_mm256_loadu_ps(xr + k + 8 * h), inv);
          const __m256 av = _mm256_round_ps(v, nearest);
          a[h] = _mm256_cvtps_epi32(av);
          c[h] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(_mm256_sub_ps(v, av), k127), nearest));
          s1 = _mm256_add_epi32(s1, a[h]), s2 = _mm256_add_epi32(s2, c[h]);
        }
        const __m256i a16 = _mm256_permute4x64_epi64(_mm256_packs_epi32(a[0], a[1]), 0xD8);  // 16 int16 in order
        const __m256i c16 = _mm256_permute4x64_epi64(_mm256_packs_epi32(c[0], c[1]), 0xD8);
        _mm_storeu_si128((__m128i*)(q1.data() + row * K + k),
                         _mm_packs_epi16(_mm256_castsi256_si128(a16), _mm256_extracti128_si256(a16, 1)));
        _mm_storeu_si128((__m128i*)(q2.data() + row * K + k),
                         _mm_packs_epi16(_mm256_castsi256_si128(c16), _mm256_extracti128_si256(c16, 1)));
      }
      sum1[row] = hsum(s1), sum2[row] = hsum(s2);
    }
  }
};
template <int R, int NB>
void int8_tile(const DigitRows& xs, int64_t m0, const uint8_t* w, const float* s, int64_t K, float* y, int64_t N,
               int64_t n0) {
  __m256i big[R][NB], small[R][NB];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NB; ++j) big[r][j] = small[r][j] = _mm256_setzero_si256();
  const __m256i flip = _mm256_set1_epi8((char)0x80);
  for (int64_t k = 0; k < K; k += 32) {
    __m256i wabs[NB], wsgn[NB];
    if (k % 64 == 0)  // each weight row AHEAD bytes on (the hardware prefetcher alone falls well behind here)
      for (int j = 0; j < NB; ++j) _mm_prefetch((const char*)(w + (n0 + j) * K + k) + AHEAD, _MM_HINT_T1);
    for (int j = 0; j < NB; ++j) {
      const __m256i wv = _mm256_xor_si256(_mm256_loadu_si256((const __m256i*)(w + (n0 + j) * K + k)), flip);  // int8
      wabs[j] = _mm256_abs_epi8(wv), wsgn[j] = wv;
    }
    for (int r = 0; r < R; ++r) {
      const __m256i a = _mm256_loadu_si256((const __m256i*)(xs.q1.data() + (m0 + r) * K + k));
      const __m256i c = _mm256_loadu_si256((const __m256i*)(xs.q2.data() + (m0 + r) * K + k));
      for (int j = 0; j < NB; ++j) {
        big[r][j] = dot_bytes(big[r][j], wabs[j], _mm256_sign_epi8(a, wsgn[j]));
        small[r][j] = dot_bytes(small[r][j], wabs[j], _mm256_sign_epi8(c, wsgn[j]));
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NB; ++j) {
      const int64_t b1 = hsum(big[r][j]), b2 = hsum(small[r][j]);
      y[r * N + n0 + j] = int8_out(127 * b1 + b2, int8_x_scale(xs.scale[m0 + r]), s[n0 + j]);
    }
}

// Past INT8_TILE_ROWS rows of x: int8_gemm (kernels.h), the tiles' integers. A panel of 8 NB weight rows as
// [steps][NB][8] 16-bit pairs: 8 rows' 16 values a register each (sign-extended), transposed
template <int NB>
void int8_panel(const uint8_t* w, int64_t np, int64_t K, int64_t steps, int32_t* out) {
  const __m128i flip = _mm_set1_epi8((char)0x80);  // (stored + 128)
  for (int j = 0; j < NB; ++j)
    for (int64_t t = 0; t < steps; t += 8) {
      __m256i r[8];
      for (int i = 0; i < 8; ++i) {
        const int64_t n = j * 8 + i;
        r[i] = n < np ? _mm256_cvtepi8_epi16(_mm_xor_si128(_mm_loadu_si128((const __m128i*)(w + n * K + 2 * t)), flip))
                      : _mm256_setzero_si256();
      }
      transpose8(r);
      for (int i = 0; i < 8; ++i) _mm256_store_si256((__m256i*)(out + ((t + i) * NB + j) * 8), r[i]);
    }
}

// R rows of x (a block, [steps][R] dwords) against a panel: R x NB registers of 8 outputs, one vpmaddwd (AVX-VNNI:
// vpdpwssd) a pair of values; between chunks the sums in doubles (acc [R][8 NB]), after the last y = int8_out
template <int R, int NB>
void int8_block(const int32_t* xb, const int32_t* pw, int64_t steps, double* acc, bool first, bool last, float* y,
                int64_t ldy, int64_t rows, int64_t np, const double* x_scale, const float* s) {
  __m256i a[R][NB];
  _Pragma("GCC unroll 16") for (int r = 0; r < R; ++r)  // (unrolled whole: the accumulators stay in registers)
    _Pragma("GCC unroll 16") for (int j = 0; j < NB; ++j) a[r][j] = _mm256_setzero_si256();
  for (int64_t t = 0; t < steps; ++t) {
    __m256i wv[NB];
    _Pragma("GCC unroll 16") for (int j = 0; j < NB; ++j)
      wv[j] = _mm256_load_si256((const __m256i*)(pw + (t * NB + j) * 8));
    _Pragma("GCC unroll 16") for (int r = 0; r < R; ++r) {
      const __m256i xv = _mm256_set1_epi32(xb[t * R + r]);
      _Pragma("GCC unroll 16") for (int j = 0; j < NB; ++j) a[r][j] = dot_words(a[r][j], wv[j], xv);
    }
  }
  alignas(32) int32_t sums[R][NB][8];
  _Pragma("GCC unroll 16") for (int r = 0; r < R; ++r)
    _Pragma("GCC unroll 16") for (int j = 0; j < NB; ++j) _mm256_store_si256((__m256i*)sums[r][j], a[r][j]);
  for (int r = 0; r < (last ? rows : R); ++r)
    for (int j = 0; j < NB; ++j)
      for (int h = 0; h < 2; ++h) {
        const int64_t n = 8 * j + 4 * h;
        double* ar = acc + r * 8 * NB + n;
        __m256d B = _mm256_cvtepi32_pd(_mm_load_si128((const __m128i*)(sums[r][j] + 4 * h)));
        if (!first) B = _mm256_add_pd(B, _mm256_load_pd(ar));
        if (!last) {
          _mm256_store_pd(ar, B);
          continue;
        }
        if (n >= np) continue;
        alignas(16) float sv[4] = {}, out[4];
        std::copy(s + n, s + std::min<int64_t>(np, n + 4), sv);
        const __m256d v = _mm256_mul_pd(_mm256_mul_pd(B, _mm256_set1_pd(x_scale[r])), _mm256_cvtps_pd(_mm_load_ps(sv)));
        _mm_store_ps(out, _mm256_cvtpd_ps(v));  // (int8_out's order)
        std::copy(out, out + std::min<int64_t>(4, np - n), y + r * ldy + n);
      }
}

// y [M, N] = x [M, K] w^T, every M: past INT8_TILE_ROWS kernels.h's int8_gemm, the same integers
constexpr int64_t INT8_TILE_ROWS = 12;  // (measured: BENCHMARKS.md)
void int8_tiles(const float* xp, const uint8_t* wp, const float* sp, int64_t M, int64_t K, float* yp, int64_t N) {
  DigitRows digits(xp, M, K);
  if (M > INT8_TILE_ROWS) {
    int8_gemm<8, 6, 2, 512>(digits, wp, sp, M, K, yp, N, int8_panel<2>, int8_block<6, 2>);
    return;
  }
  if (M == 1) {  // 2 weight rows a tile: 4 accumulators, 4 weight registers
    for_each_tile<2>(M, N, K, 2 * K, [&](int64_t, int64_t, int64_t n0, int64_t nb) {
      if (nb == 2) int8_tile<1, 2>(digits, 0, wp, sp, K, yp, N, n0);
      else int8_tile<1, 1>(digits, 0, wp, sp, K, yp, N, n0);
    });
    return;
  }
  for_each_tile<1, 4>(M, N, K, K, [&](int64_t m0, int64_t rows, int64_t n0, int64_t) {
    DISPATCH_ROWS(rows, (int8_tile<R, 1>(digits, m0, wp, sp, K, yp + m0 * N, N, n0)));
  });
}

// ---- int4 weights, llama.cpp's Q4_1 grid: w = d * code + m per block of 32 --------------------------------------
// kernels.cpp's design (the groups of kernels.h) in 8 lanes: a group of 16 weight rows in two halves, one 32-byte
// load holding 8 codes of each of 8 rows; four registers of code pairs times H by vpmaddwd (or AVX-VNNI's vpdpwssd),
// two of code quads times L by vpmaddubsw, their int16 pairs added over the block (|sum| <= 8 x 2 x 15 x 64) and
// widened once; per block the float steps of kernels.h: the same bits as kernels.cpp's.

// R rows of x (from m0) against one group of 16 weight rows: y [R, N] from column n0, its first `width`
template <int R>
void int4_group(const BlockWords& xs, int64_t m0, const uint8_t* codes, const float* d, const float* mn, int64_t K,
                float* y, int64_t N, int64_t n0, int64_t width) {
  const int64_t G = K / 32;
  const int16_t* H = xs.high + m0 * K;
  const int8_t* L = xs.low + m0 * K;
  const float *U = xs.unit + m0 * G, *S = xs.sum + m0 * G;
  const __m256i pair_mask = _mm256_set1_epi32(0x000F000F), quad_mask = _mm256_set1_epi32(0x0F0F0F0F);
  for (int half = 0; half < 2 && 8 * half < width; ++half) {  // rows 8 half .. 8 half + 7 of the group
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < G; ++b) {
      __m256i high[R], low[R];  // int32 sums of code H; int16 pairs of code L
      for (int r = 0; r < R; ++r) high[r] = low[r] = _mm256_setzero_si256();
      for (int c = 0; c < 4; ++c) {  // 8 inputs a load
        const uint8_t* chunk = codes + (4 * b + c) * 64;
        if (half == 0) _mm_prefetch((const char*)chunk + AHEAD, _MM_HINT_T1);
        const __m256i v = _mm256_loadu_si256((const __m256i*)(chunk + 32 * half));
        for (int p = 0; p < 4; ++p) {
          const __m256i pair = _mm256_and_si256(_mm256_srli_epi32(v, 4 * p), pair_mask);
          for (int r = 0; r < R; ++r) {
            int32_t h;
            memcpy(&h, H + r * K + 32 * b + 8 * c + 2 * p, 4);
            high[r] = dot_words(high[r], pair, _mm256_set1_epi32(h));
          }
        }
        for (int q = 0; q < 2; ++q) {
          const __m256i quad = _mm256_and_si256(_mm256_srli_epi32(v, 4 * q), quad_mask);
          for (int r = 0; r < R; ++r) {
            int32_t l;
            memcpy(&l, L + r * K + 32 * b + 8 * c + 4 * q, 4);
            low[r] = _mm256_add_epi16(low[r], _mm256_maddubs_epi16(quad, _mm256_set1_epi32(l)));
          }
        }
      }
      const __m256 dv = _mm256_loadu_ps(d + 16 * b + 8 * half), mv = _mm256_loadu_ps(mn + 16 * b + 8 * half);
      for (int r = 0; r < R; ++r) {
        const __m256i low32 = _mm256_madd_epi16(low[r], _mm256_set1_epi16(1));
        const __m256 x = _mm256_fmadd_ps(_mm256_cvtepi32_ps(low32), _mm256_set1_ps(1.f / 128.f), _mm256_cvtepi32_ps(high[r]));
        acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(x, _mm256_set1_ps(U[r * G + b])), dv, acc[r]);
        acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(S[r * G + b]), mv, acc[r]);
      }
    }
    for (int r = 0; r < R; ++r) {
      float* to = y + r * N + n0 + 8 * half;
      if (width - 8 * half >= 8) _mm256_storeu_ps(to, acc[r]);
      else _mm256_maskstore_ps(to, lanes8(width - 8 * half), acc[r]);
    }
  }
}

// y [M, N] = x [M, K] w^T, every M: up to 3 rows of x against a group (16 registers)
void int4_tiles(const float* xp, const uint8_t* qp, const float* dp, const float* mp, int64_t M, int64_t K, float* yp,
                int64_t N) {
  const BlockWords xs(xp, M, K);
  for_each_int4_group<3>(M, N, K, qp, dp, mp, [&](int64_t m0, int64_t rows, const uint8_t* codes, const float* d,
                                                const float* mn, int64_t n0, int64_t width) {
    switch (rows) {
      case 1: int4_group<1>(xs, m0, codes, d, mn, K, yp + m0 * N, N, n0, width); break;
      case 2: int4_group<2>(xs, m0, codes, d, mn, K, yp + m0 * N, N, n0, width); break;
      default: int4_group<3>(xs, m0, codes, d, mn, K, yp + m0 * N, N, n0, width); break;
    }
  });
}

// ---- nf4 weights (bitsandbytes' NF4 code), one absmax per block of 64 ----------------------------------------------
// Per row and block: 32 bytes, byte j holding code j (low nibble) and code j + 32 (high nibble); absmax float32
// [N, K/64]. For the dequantized float32 weights (nf4_rows: dequantize_nf4) the 16 code values sit in two registers:
// vpermps looks a code up in both, its bit 3 picks one. The matmul is kernels.h's nf4_matmul.

struct NF4Table {
  __m256 low, high;
  explicit NF4Table(const float* code) : low(_mm256_loadu_ps(code)), high(_mm256_loadu_ps(code + 8)) {}
  __m256 operator()(__m128i bytes8) const {  // 8 codes (one a byte) -> their values
    const __m256i c = _mm256_cvtepu8_epi32(bytes8);
    return _mm256_blendv_ps(_mm256_permutevar8x32_ps(low, c), _mm256_permutevar8x32_ps(high, c),
                            _mm256_castsi256_ps(_mm256_slli_epi32(c, 28)));
  }
};

// A block's 64 values NF4[code] (not yet times absmax), in order
inline void nf4_block(const uint8_t* block, const NF4Table& table, __m256 out[8]) {
  const __m128i low = _mm_set1_epi8(15);
  for (int half = 0; half < 2; ++half) {  // bytes 16 half ..: codes 16 half .. (low nibbles), 32 + 16 half .. (high)
    const __m128i q = _mm_loadu_si128((const __m128i*)(block + 16 * half));
    const __m128i lo = _mm_and_si128(q, low), hi = _mm_and_si128(_mm_srli_epi16(q, 4), low);
    out[2 * half] = table(lo), out[2 * half + 1] = table(_mm_srli_si128(lo, 8));
    out[4 + 2 * half] = table(hi), out[5 + 2 * half] = table(_mm_srli_si128(hi, 8));
  }
}

void nf4_rows(const uint8_t* qp, const float* ap, const float* code, int64_t K, int64_t n0, int64_t n1, float* wp) {
  const int64_t B = K / 64;
  const NF4Table table(code);
  for (int64_t n = n0; n < n1; ++n)
    for (int64_t b = 0; b < B; ++b) {
      __m256 v[8];
      nf4_block(qp + n * (K / 2) + b * 32, table, v);
      const __m256 s = _mm256_set1_ps(ap[n * B + b]);
      for (int i = 0; i < 8; ++i) _mm256_storeu_ps(wp + (n - n0) * K + b * 64 + 8 * i, _mm256_mul_ps(v[i], s));
    }
}

// y [M, N] = x [M, K] w^T, every M: kernels.h's nf4_matmul
void nf4_tiles(const float* xp, const uint8_t* qp, const float* ap, const float* cp, int64_t M, int64_t K, float* yp,
               int64_t N) {
  nf4_matmul<DigitRows>(xp, qp, ap, cp, M, K, yp, N);
}

// x [M, K] rounded to 8 bits a value, as llama.cpp's activations: each `group` values (256: its Q8_K; 32: its Q8_0)
// xq = x / dx rounded, dx = their max|x| / 127; stored + 128 as unsigned bytes for the prefill's tiles (plus128), as
// signed bytes for the K-quant decode and Q8_0's prefill without VNNI (codes or |s| times xq)
struct ByteRows {
  std::vector<uint8_t> xu;   // [M, K] xq + 128 (plus128) or xq
  std::vector<float> dx;     // [M, K / group]
  std::vector<int16_t> s16;  // [M, K / 16]: sum(xq) over each 16 (the mins and offsets meet them)
  int64_t K;
  float sum32(int64_t m, int64_t b) const {  // sum(xq) over values 32b .. 32b + 31 of row m
    return (float)(s16[m * (K / 16) + 2 * b] + s16[m * (K / 16) + 2 * b + 1]);
  }
  ByteRows(const float* x, int64_t M, int64_t K, int64_t group, bool plus128)
      : xu(M * K), dx(M * (K / group)), s16(M * (K / 16)), K(K) {
    const __m256i top_bit = _mm256_set1_epi8(plus128 ? (char)0x80 : 0);
    at::parallel_for(0, M, 8, [&](int64_t m0, int64_t m1) {
      for (int64_t m = m0; m < m1; ++m)
        for (int64_t b = 0; b < K / group; ++b) {
          const float* xb = x + m * K + b * group;
          __m256 amax = _mm256_setzero_ps();
          const __m256 abs = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
          for (int k = 0; k < group; k += 8) amax = _mm256_max_ps(amax, _mm256_and_ps(_mm256_loadu_ps(xb + k), abs));
          const float top = hmax(amax);
          dx[m * (K / group) + b] = top / 127.f;
          const __m256 inv = _mm256_set1_ps(top > 0.f ? 127.f / top : 0.f);
          for (int k = 0; k < group; k += 32) {
            __m256i q[4];  // nearest (even), as kernels.cpp
            for (int i = 0; i < 4; ++i) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb + k + 8 * i), inv));
            const int64_t at = m * K + b * group + k;
            const int32_t low = hsum(_mm256_add_epi32(q[0], q[1])), high = hsum(_mm256_add_epi32(q[2], q[3]));
            s16[at / 16] = (int16_t)low, s16[at / 16 + 1] = (int16_t)high;
            // packed: 4-byte groups 0, 2, 4, 6, 1, 3, 5, 7 of the 32 -> in order, then (plus128) + 128
            const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
            const __m256i ordered = _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
            _mm256_storeu_si256((__m256i*)(xu.data() + m * K + b * group + k), _mm256_xor_si256(ordered, top_bit));
          }
        }
    });
  }
};

// ---- GGUF blocks as the file stores them (see kernels.cpp) -----------------------------------------------------------
// Every type is read as unsigned codes u, 32 to a register (one byte each), with w = A (u - off) + B per sub-block.
// K-quants, decoding: codes times x in bytes (llama.cpp's Q8_K, as kernels.cpp's) by vpmaddubsw (pairs in int16),
// times the sub-block's integer scale by vpmaddwd (into int32), over a super-block, then kernels.h's float steps; the
// mins (Q4_K, Q5_K) or the offset 32 (Q6_K) meet the sums of xq.
// 32-blocks: kernels.h's block32_tile (x in bytes a 32 at a time). A prefill (byte_pass, below): kernels.cpp's tiles.

// Sub-block s (values 32s .. 32s + 31) of a K-quant super-block as codes u, one a byte
template <int64_t T>
inline __m256i kquant_codes32(const uint8_t* blk, int s) {
  const __m256i low4 = _mm256_set1_epi8(15);
  if constexpr (T == GQ4_K || T == GQ5_K) {  // 32 bytes of qs: sub-block 2g low nibbles, 2g + 1 high ones
    const int g = s / 2;
    const __m256i z = _mm256_loadu_si256((const __m256i*)(blk + (T == GQ4_K ? 16 : 48) + 32 * g));
    __m256i u = _mm256_and_si256(s % 2 ? _mm256_srli_epi16(z, 4) : z, low4);
    if constexpr (T == GQ5_K) {  // bit s of qh[l]: the fifth bit of value l of sub-block s
      const __m256i qh = _mm256_loadu_si256((const __m256i*)(blk + 16));
      u = _mm256_or_si256(u, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, s), _mm256_set1_epi8(1)), 4));
    }
    return u;
  } else {  // Q6_K: values 128h + 32i + 64k + l: nibble k of ql[64h + 32i + l], bits 4k + 2i of qh[32h + l]
    const int h = s / 4, k = (s % 4) / 2, i = s % 2;
    const __m256i ql = _mm256_loadu_si256((const __m256i*)(blk + 64 * h + 32 * i));
    const __m256i qh = _mm256_loadu_si256((const __m256i*)(blk + 128 + 32 * h));
    const __m256i nib = _mm256_and_si256(k ? _mm256_srli_epi16(ql, 4) : ql, low4);
    const int at = 4 * k + 2 * i;  // the two bits moved to bits 4-5 (a constant where the caller's loop unrolls)
    const __m256i moved = at < 4 ? _mm256_slli_epi16(qh, 4 - at) : at > 4 ? _mm256_srli_epi16(qh, at - 4) : qh;
    return _mm256_or_si256(nib, _mm256_and_si256(moved, _mm256_set1_epi8(0x30)));
  }
}

// Values 32v .. 32v + 31 of a row as codes u, one a byte
template <int64_t T>
inline __m256i codes32(const uint8_t* row, int64_t v) {
  if constexpr (T >= GQ4_K) {
    return kquant_codes32<T>(row + (v / 8) * block_bytes(T), (int)(v % 8));
  } else {
    return block_codes<T>(row + v * block_bytes(T));
  }
}

// One super-block of a K-quant weight row against R rows of x in bytes (8 registers of 32 codes): codes times xq
// (vpmaddubsw) times the sub-block's integer scale (vpmaddwd) into int32 lanes I[r] (kernels.h's I, less Q6_K's
// offset), and in C[r] what the sums of xq per 16 meet (Q4_K / Q5_K: the mins, Mn; Q6_K: the offset's scales)
template <int64_t T, int R>
inline void kquant_sums(const ByteRows& xs, int64_t m0, const uint8_t* blk, int64_t K, int64_t sb, __m256i I[R],
                        __m256i C[R], float& d, float& nd) {
  for (int line = 0; line < block_bytes(T); line += 64) _mm_prefetch((const char*)blk + AHEAD + line, _MM_HINT_T1);
  __m256i scales;  // int16 in both 128-bit halves: Q4_K / Q5_K the 8 scales; Q6_K the even 8, then the odd 8
  __m256i per16;   // what each 16's sum of xq meets
  if constexpr (T == GQ6_K) {
    d = half_at(blk + 208), nd = 0.f;
    const __m128i bytes = _mm_loadu_si128((const __m128i*)(blk + 192));
    scales = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(bytes, _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15)));
    per16 = _mm256_cvtepi8_epi16(bytes);
  } else {
    const __m128i sm = kquant_scales(blk + 4);  // scales in bytes 0-7, mins in 8-15
    d = half_at(blk), nd = -half_at(blk + 2);
    scales = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(sm));
    const __m128i mins = _mm_srli_si128(sm, 8);
    per16 = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(mins, mins));
  }
  for (int r = 0; r < R; ++r) I[r] = _mm256_setzero_si256();
  _Pragma("GCC unroll 8") for (int v = 0; v < 8; ++v) {
    const __m256i u = kquant_codes32<T>(blk, v);
    // sub-block v's scale in every lane (Q6_K: 2v's in the low 128 bits, 2v + 1's in the high): one vpshufb
    const __m256i sc = _mm256_shuffle_epi8(scales, _mm256_set1_epi16((short)(0x0100 + 0x0202 * v)));
    for (int r = 0; r < R; ++r) {  // the codes (< 64) times xq (signed bytes)
      const __m256i a = _mm256_loadu_si256((const __m256i*)(xs.xu.data() + (m0 + r) * K + sb * 256 + 32 * v));
      I[r] = _mm256_add_epi32(I[r], _mm256_madd_epi16(_mm256_maddubs_epi16(u, a), sc));
    }
  }
  for (int r = 0; r < R; ++r)
    C[r] = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i*)(xs.s16.data() + (m0 + r) * (K / 16) + sb * 16)), per16);
}

// One weight row of a K-quant type against R rows of x in bytes (a scale per 256): kquant_sums two super-blocks at a
// time (up to 4 rows of x; more would spill the sums), their four sums of lanes at once (sum_lanes4), then
// kernels.h's float steps
template <int64_t T, int R>
void kquant_tile(const ByteRows& xs, int64_t m0, const uint8_t* w, int64_t row_bytes, int64_t K, float* y,
                 int64_t N, int64_t n) {
  const int64_t S = K / 256;
  constexpr int STEP = R <= 4 ? 2 : 1;
  const uint8_t* row = w + n * row_bytes;
  float acc[R] = {};
  for (int64_t sb = 0; sb < S; sb += STEP) {
    const bool pair = STEP == 2 && sb + 1 < S;
    __m256i I0[R], C0[R], I1[R], C1[R];
    float d0, nd0, d1 = 0.f, nd1 = 0.f;
    kquant_sums<T, R>(xs, m0, row + sb * block_bytes(T), K, sb, I0, C0, d0, nd0);
    if (pair) kquant_sums<T, R>(xs, m0, row + (sb + 1) * block_bytes(T), K, sb + 1, I1, C1, d1, nd1);
    for (int r = 0; r < R; ++r) {
      __m128i s = pair ? sum_lanes4(I0[r], C0[r], I1[r], C1[r]) : sum_lanes4(I0[r], C0[r], I0[r], C0[r]);
      if constexpr (T == GQ6_K) s = _mm_sub_epi32(s, _mm_slli_epi32(_mm_srli_epi64(s, 32), 5));  // I - 32 C
      const __m128 f = _mm_cvtepi32_ps(s);  // I0, C0, I1, C1
      const float* dx = xs.dx.data() + (m0 + r) * S + sb;
      acc[r] = kquant_step(acc[r], _mm_cvtss_f32(f), _mm_cvtss_f32(_mm_movehdup_ps(f)), d0, nd0, dx[0], T != GQ6_K);
      if (pair)
        acc[r] = kquant_step(acc[r], _mm_cvtss_f32(_mm_movehl_ps(f, f)), _mm_cvtss_f32(_mm_shuffle_ps(f, f, 3)), d1,
                             nd1, dx[1], T != GQ6_K);
    }
  }
  for (int r = 0; r < R; ++r) y[r * N + n] = acc[r];
}

// R rows of x against Q8_0 weight row n in float32 (as kernels.cpp's, in 8 lanes)
template <int R>
void q8_0_float_tile(const float* x, const uint8_t* w, int64_t row_bytes, int64_t K, float* y, int64_t N, int64_t n) {
  const uint8_t* row = w + n * row_bytes;
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  auto block = [&](int64_t b, int half) {
    const uint8_t* blk = row + b * 34;
    _mm_prefetch((const char*)blk + AHEAD, _MM_HINT_T1);
    __m256 wv[4];
    for (int i = 0; i < 4; ++i) wv[i] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(blk + 2 + 8 * i))));
    const __m256 d = _mm256_set1_ps(half_at(blk));
    for (int r = 0; r < R; ++r) {
      const float* xb = x + r * K + 32 * b;
      __m256 s = _mm256_mul_ps(wv[0], _mm256_loadu_ps(xb));
      for (int i = 1; i < 4; ++i) s = _mm256_fmadd_ps(wv[i], _mm256_loadu_ps(xb + 8 * i), s);
      acc[r][half] = _mm256_fmadd_ps(s, d, acc[r][half]);
    }
  };
  int64_t b = 0;
  for (; b + 2 <= K / 32; b += 2) block(b, 0), block(b + 1, 1);
  if (b < K / 32) block(b, 0);
  for (int r = 0; r < R; ++r) y[r * N + n] = hsum(_mm256_add_ps(acc[r][0], acc[r][1]));
}

void q8_0_float_tiles(const float* x, int64_t M, const uint8_t* w, int64_t row_bytes, int64_t K, float* y, int64_t N) {
  for_each_tile<1, 4>(M, N, K, row_bytes, [&](int64_t m0, int64_t rows, int64_t n0, int64_t) {
    DISPATCH_ROWS(rows, (q8_0_float_tile<R>(x + m0 * K, w, row_bytes, K, y + m0 * N, N, n0)));
  });
}

// Rows of blocks -> [N, K] values as gguf's own dequantizer computes them: A (u - off) + B, two roundings (no fused
// multiply-adds), A, off and B per 16 values (chunk_params)
template <int64_t T, typename Out>
__attribute__((optimize("fp-contract=off"))) void dequantize_rows(const uint8_t* w, int64_t row_bytes, int64_t N,
                                                                   int64_t K, Out* out) {
  static_assert(std::is_same_v<Out, float>, "no bfloat16 words without AVX512-BF16");
  const int64_t blocks = K / block_elements(T), chunks = (K + 63) / 64;
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    float A[4], off[4], B[4];  // of each 16 values of a chunk of 64
    for (int64_t n = n0; n < n1; ++n) {
      const uint8_t* row = w + n * row_bytes;
      for (int64_t c = 0; c < chunks; ++c) {
        chunk_params<T>(row, c, blocks, A, off, B);
        for (int half = 0; half < 2 && c * 64 + half * 32 < K; ++half) {
          const __m256i u = codes32<T>(row, 2 * c + half);
          for (int e = 0; e < 4; ++e) {  // 8 values: quarter 2 half + e / 2
            const __m128i bytes = e < 2 ? _mm256_castsi256_si128(u) : _mm256_extracti128_si256(u, 1);
            const __m256 v = to_float(e % 2 ? _mm_srli_si128(bytes, 8) : bytes);
            const int q = 2 * half + e / 2;
            const __m256 x = _mm256_add_ps(_mm256_mul_ps(_mm256_sub_ps(v, _mm256_set1_ps(off[q])), _mm256_set1_ps(A[q])),
                                           _mm256_set1_ps(B[q]));
            _mm256_storeu_ps(out + n * K + c * 64 + half * 32 + 8 * e, x);
          }
        }
      }
    }
  });
}

// ---- A long prefill on GGUF blocks: 8-bit activations and integer products (kernels.cpp's design, 8 lanes) ------
// As kernels.cpp: past GEMM_ROWS rows each 256 values of a row of x (K-quants, llama.cpp's Q8_K; 32 for 32-blocks,
// its Q8_0) become xq = x / dx rounded (dx = their max|x| / 127), stored + 128 as unsigned bytes; each thread decodes
// a tile of 16 weight rows into signed codes s = u - off, four values of a row side by side, 8 rows a register, so
// one dot_bytes adds four products of 8 weight rows against four values of one row of x (broadcast). Per sub-block
// (32 values; Q6_K 16) the int32 sums, which start at Z = -128 sum(s) (the + 128's share, exact), times A in float,
// plus the mins' B times sum(xq); per scale of x, times dx (K-quants: times the integer scale into I, then kernels.h's
// float steps, the decoding tiles' order). Without VNNI, vpmaddubsw keeps a pair (xq + 128) s below
// int16's limit for every type but Q8_0 (|s| up to 128): its x is stored signed and meets |s| with s's sign (vpsignb).
constexpr bool VNNI = DOT_VNNI;
constexpr int B_TILE = 16;         // weight rows a tile: two registers of 8
constexpr int B_ROWS = 3;          // rows of x a pass: 2 x 3 int32 sums, 2 x 3 float sums, 2 x 3 results
constexpr int64_t B_BLOCK = 256;   // rows of x a round of tiles

// The integer scale and min (Q6_K: 0) of each sub-block of a K-quant super-block, to scale[j * stride] and
// min[j * stride] for sub-block j
template <int64_t T>
inline void superblock_ints(const uint8_t* blk, int32_t* scale, int32_t* min, int64_t stride) {
  if constexpr (T == GQ6_K) {
    for (int j = 0; j < 16; ++j) scale[j * stride] = (int8_t)blk[192 + j], min[j * stride] = 0;
  } else {
    uint8_t sm[16];
    _mm_storeu_si128((__m128i*)sm, kquant_scales(blk + 4));
    for (int j = 0; j < 8; ++j) scale[j * stride] = sm[j], min[j * stride] = sm[8 + j];
  }
}

// A tile of B_TILE weight rows, decoded: codes [K / 4][16 rows][4] (SIGNED_X: their magnitudes too), Z = -128 sum(s)
// of each sub-block [K / SB][16] (SIGNED_X: Z = 0), and of each sub-block A and B (w = A s + B; 32-blocks) or the
// integer scale and min [K / SB][16] with d and -dmin of each super-block [K / 256][16] (K-quants)
template <int64_t T>
struct ByteTile {
  static constexpr int SB = T == GQ6_K ? 16 : 32;
  static constexpr int64_t GROUP = T >= GQ4_K ? 256 : 32;
  static constexpr bool MINS = T == GQ4_K || T == GQ5_K || T == GQ4_1 || T == GQ5_1;
  static constexpr bool SIGNED_X = T == GQ8_0 && !VNNI;
  // groups of four whose vpmaddubsw pairs add in int16 before vpmaddwd: 2 (xq + 128) |s| PACK stays below 32768 (|s|
  // <= 16: 4; <= 32: 2); with VNNI, one vpdpbusd a group
  static constexpr int PACK = VNNI || SIGNED_X ? 1 : (T == GQ4_0 || T == GQ4_1 || T == GQ5_0 || T == GQ4_K) ? 4 : 2;
  static constexpr int OFF = T == GQ4_0 ? 8 : T == GQ5_0 ? 16 : T == GQ6_K ? 32 : T == GQ8_0 ? 128 : 0;
  std::vector<int8_t> codes;
  std::vector<uint8_t> mag;
  static constexpr bool KQ = T >= GQ4_K;
  std::vector<float> A, B, d, nd;
  std::vector<int32_t> Z, scale, min;
  explicit ByteTile(int64_t K)
      : codes(K * B_TILE), mag(SIGNED_X ? K * B_TILE : 0), A(KQ ? 0 : K / SB * B_TILE), B(KQ ? 0 : K / SB * B_TILE),
        d(KQ ? K / 256 * B_TILE : 0), nd(KQ ? K / 256 * B_TILE : 0), Z(K / SB * B_TILE),
        scale(KQ ? K / SB * B_TILE : 0), min(KQ ? K / SB * B_TILE : 0) {}

  void decode(const uint8_t* w, int64_t row_bytes, int64_t K, int64_t nb) {
    const int64_t blocks = K / block_elements(T);
    std::fill(Z.begin(), Z.end(), 0);
    for (int64_t r = 0; r < B_TILE; ++r) {  // each sub-block's scales, a block at a time (rows past nb: 0)
      const uint8_t* row = w + r * row_bytes;
      for (int64_t k = 0; k < blocks; ++k) {
        const uint8_t* blk = row + k * block_bytes(T);
        const int64_t at = k * (block_elements(T) / SB) * B_TILE + r;
        if constexpr (KQ) {
          if (r >= nb) {
            for (int j = 0; j < 256 / SB; ++j) scale[at + j * B_TILE] = min[at + j * B_TILE] = 0;
            d[k * B_TILE + r] = nd[k * B_TILE + r] = 0.f;
            continue;
          }
          superblock_ints<T>(blk, scale.data() + at, min.data() + at, B_TILE);
          d[k * B_TILE + r] = half_at(blk + (T == GQ6_K ? 208 : 0));
          nd[k * B_TILE + r] = T == GQ6_K ? 0.f : -half_at(blk + 2);
        } else {
          float off;
          if (r >= nb) A[at] = B[at] = 0.f;
          else block_params<T>(blk, A[at], off, B[at]);
        }
      }
    }
    for (int half = 0; half < 2; ++half)
      for (int64_t v = 0; v < K / 32; ++v) {  // 32 values of 8 rows
        __m256i s[8];
        for (int i = 0; i < 8; ++i) {
          const int64_t r = 8 * half + i;
          if (r >= nb) {
            s[i] = _mm256_setzero_si256();
            continue;
          }
          const __m256i u = codes32<T>(w + r * row_bytes, v);
          s[i] = _mm256_sub_epi8(u, _mm256_set1_epi8((char)OFF));
          if (!SIGNED_X) {  // Z: -128 sum(s) = -128 (sum(u) - off) over each 16 (sum(u) by vpsadbw, 8 bytes a lane)
            alignas(32) int64_t eight[4];
            _mm256_store_si256((__m256i*)eight, _mm256_sad_epu8(u, _mm256_setzero_si256()));
            for (int q = 0; q < 2; ++q)
              Z[(32 * v + 16 * q) / SB * B_TILE + r] -= 128 * (int32_t)(eight[2 * q] + eight[2 * q + 1] - 16 * OFF);
          }
        }
        transpose8(s);  // s[j]: values 4j .. 4j + 3 of the 32, of 8 rows
        for (int j = 0; j < 8; ++j) {
          const int64_t at = ((8 * v + j) * 2 + half) * 32;
          _mm256_storeu_si256((__m256i*)(codes.data() + at), s[j]);
          if constexpr (SIGNED_X) _mm256_storeu_si256((__m256i*)(mag.data() + at), _mm256_abs_epi8(s[j]));
        }
      }
  }
};

// R rows of x (from m0) against a decoded tile: per sub-block the int32 sums of each row against the tile's 16 rows
// (two registers) from Z, times A (plus B sum(xq)); per scale of x, times dx. K-quants: the sums times the integer
// scales into kernels.h's I, and per super-block its float steps
template <int64_t T, int R>
void byte_pass(const ByteRows& xs, int64_t m0, const ByteTile<T>& t, int64_t K, float* y, int64_t N, int64_t n0,
               int64_t nb, const int64_t* columns) {
  using Tile = ByteTile<T>;
  constexpr int SB = Tile::SB;
  constexpr int64_t GROUP = Tile::GROUP;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 out[R][2];
  for (int r = 0; r < R; ++r) out[r][0] = out[r][1] = _mm256_setzero_ps();
  const uint8_t* x = xs.xu.data() + m0 * K;
  for (int64_t g = 0; g < K / GROUP; ++g) {
    __m256 part[R][2];
    __m256i I[R][2];
    for (int r = 0; r < R; ++r) part[r][0] = part[r][1] = _mm256_setzero_ps(), I[r][0] = I[r][1] = _mm256_setzero_si256();
    for (int j = 0; j < GROUP / SB; ++j) {
      const int64_t first = (g * GROUP + j * SB) / 4;  // the sub-block's first group of four values
      const int64_t sb = (g * GROUP + j * SB) / SB;
      __m256i sum[R][2];
      for (int r = 0; r < R; ++r)
        for (int h = 0; h < 2; ++h) sum[r][h] = _mm256_loadu_si256((const __m256i*)(t.Z.data() + sb * B_TILE + 8 * h));
      _Pragma("GCC unroll 8") for (int q = 0; q < SB / 4; q += Tile::PACK) {
        for (int r = 0; r < R; ++r) {
          const auto bytes_at = [&](int i) {  // four values of row r's x, in every lane
            int32_t four;
            memcpy(&four, x + r * K + (first + q + i) * 4, 4);
            return _mm256_set1_epi32(four);
          };
          const auto codes_at = [&](const auto* v, int i, int h) {
            return _mm256_loadu_si256((const __m256i*)(v + (first + q + i) * 64 + 32 * h));
          };
          if constexpr (Tile::SIGNED_X) {  // |s| times xq (stored signed) with s's sign
            const __m256i xq = bytes_at(0);
            for (int h = 0; h < 2; ++h)
              sum[r][h] = _mm256_add_epi32(sum[r][h], _mm256_madd_epi16(_mm256_maddubs_epi16(
                  codes_at(t.mag.data(), 0, h), _mm256_sign_epi8(xq, codes_at(t.codes.data(), 0, h))), ones));
          } else if constexpr (Tile::PACK == 1) {
            const __m256i xb = bytes_at(0);
            for (int h = 0; h < 2; ++h) sum[r][h] = dot_bytes(sum[r][h], xb, codes_at(t.codes.data(), 0, h));
          } else {  // PACK groups' pairs added in int16, then one vpmaddwd
            __m256i pairs[2];
            for (int i = 0; i < Tile::PACK; ++i) {
              const __m256i xb = bytes_at(i);
              for (int h = 0; h < 2; ++h) {
                const __m256i p = _mm256_maddubs_epi16(xb, codes_at(t.codes.data(), i, h));
                pairs[h] = i ? _mm256_add_epi16(pairs[h], p) : p;
              }
            }
            for (int h = 0; h < 2; ++h) sum[r][h] = _mm256_add_epi32(sum[r][h], _mm256_madd_epi16(pairs[h], ones));
          }
        }
      }
      if constexpr (Tile::KQ) {
        const __m256i s0 = _mm256_loadu_si256((const __m256i*)(t.scale.data() + sb * B_TILE));
        const __m256i s1 = _mm256_loadu_si256((const __m256i*)(t.scale.data() + sb * B_TILE + 8));
        for (int r = 0; r < R; ++r) {
          I[r][0] = _mm256_add_epi32(I[r][0], _mm256_mullo_epi32(sum[r][0], s0));
          I[r][1] = _mm256_add_epi32(I[r][1], _mm256_mullo_epi32(sum[r][1], s1));
        }
        continue;
      }
      const __m256 a0 = _mm256_loadu_ps(t.A.data() + sb * B_TILE), a1 = _mm256_loadu_ps(t.A.data() + sb * B_TILE + 8);
      for (int r = 0; r < R; ++r) {
        part[r][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[r][0]), a0, part[r][0]);
        part[r][1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[r][1]), a1, part[r][1]);
      }
      if constexpr (Tile::MINS) {  // the mins: B times sum(xq) over the 32
        const __m256 b0 = _mm256_loadu_ps(t.B.data() + sb * B_TILE), b1 = _mm256_loadu_ps(t.B.data() + sb * B_TILE + 8);
        for (int r = 0; r < R; ++r) {
          const __m256 s = _mm256_set1_ps(xs.sum32(m0 + r, (g * GROUP + j * SB) / 32));
          part[r][0] = _mm256_fmadd_ps(b0, s, part[r][0]);
          part[r][1] = _mm256_fmadd_ps(b1, s, part[r][1]);
        }
      }
    }
    if constexpr (Tile::KQ) {  // d I, plus -dmin Mn (the mins against the sums of xq over each 32)
      const __m256 d0 = _mm256_loadu_ps(t.d.data() + g * B_TILE), d1 = _mm256_loadu_ps(t.d.data() + g * B_TILE + 8);
      for (int r = 0; r < R; ++r) {
        part[r][0] = _mm256_mul_ps(d0, _mm256_cvtepi32_ps(I[r][0]));
        part[r][1] = _mm256_mul_ps(d1, _mm256_cvtepi32_ps(I[r][1]));
        if constexpr (Tile::MINS) {
          __m256i mn0 = _mm256_setzero_si256(), mn1 = _mm256_setzero_si256();
          const int16_t* s16 = xs.s16.data() + (m0 + r) * (K / 16) + g * 16;
          for (int j = 0; j < 8; ++j) {
            const __m256i s = _mm256_set1_epi32(s16[2 * j] + s16[2 * j + 1]);
            const int32_t* mins = t.min.data() + (g * 8 + j) * B_TILE;
            mn0 = _mm256_add_epi32(mn0, _mm256_mullo_epi32(_mm256_loadu_si256((const __m256i*)mins), s));
            mn1 = _mm256_add_epi32(mn1, _mm256_mullo_epi32(_mm256_loadu_si256((const __m256i*)(mins + 8)), s));
          }
          part[r][0] = _mm256_fmadd_ps(_mm256_loadu_ps(t.nd.data() + g * B_TILE), _mm256_cvtepi32_ps(mn0), part[r][0]);
          part[r][1] = _mm256_fmadd_ps(_mm256_loadu_ps(t.nd.data() + g * B_TILE + 8), _mm256_cvtepi32_ps(mn1), part[r][1]);
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      const __m256 d = _mm256_set1_ps(xs.dx[(m0 + r) * (K / GROUP) + g]);
      out[r][0] = _mm256_fmadd_ps(part[r][0], d, out[r][0]);
      out[r][1] = _mm256_fmadd_ps(part[r][1], d, out[r][1]);
    }
  }
  for (int r = 0; r < R; ++r) {
    alignas(32) float row[B_TILE];
    _mm256_store_ps(row, out[r][0]), _mm256_store_ps(row + 8, out[r][1]);
    store_tile_row(row, y + (m0 + r) * N, n0, nb, columns);
  }
}

// Up to GEMM_ROWS rows of x: x in bytes as llama.cpp takes it, and as the prefill does (kernels.h's orders)
template <int64_t T>
void gguf_tiles(const float* x, int64_t M, const uint8_t* w, int64_t row_bytes, int64_t K, float* y, int64_t N) {
  const ByteRows xs(x, M, K, block_elements(T), false);
  if constexpr (T >= GQ4_K) {
    for_each_tile<1, 8>(M, N, K, row_bytes, [&](int64_t m0, int64_t rows, int64_t n0, int64_t) {
      DISPATCH_ROWS(rows, (kquant_tile<T, R>(xs, m0, w, row_bytes, K, y + m0 * N, N, n0)));
    });
  } else {
    for_each_tile<8, 8>(M, N, K, row_bytes, [&](int64_t m0, int64_t rows, int64_t n0, int64_t nb) {
      DISPATCH_ROWS(rows, (block32_tile<T, R>(xs, m0, w, row_bytes, K, y + m0 * N, N, n0, nb)));
    });
  }
}

template <int64_t T>
void gguf_prefill(const at::Tensor& x, const uint8_t* w, int64_t row_bytes, int64_t N, float* y, int64_t ldy,
                  const int64_t* columns) {
  const int64_t M = x.size(0), K = x.size(1);
  const ByteRows xs(x.data_ptr<float>(), M, K, block_elements(T), !ByteTile<T>::SIGNED_X);
  const int64_t tiles = (N + B_TILE - 1) / B_TILE;
  for (int64_t first = 0; first < M; first += B_BLOCK) {  // a tile passes over B_BLOCK rows from the thread's cache
    const int64_t last = std::min(M, first + B_BLOCK);
    std::atomic<int64_t> next{0};  // tiles claimed one at a time: a thread the host slows takes fewer
    at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), tiles), 1, [&](int64_t, int64_t) {
      ByteTile<T> tile(K);
      for (int64_t t = next++; t < tiles; t = next++) {
        const int64_t n0 = t * B_TILE, nb = std::min<int64_t>(B_TILE, N - n0);
        tile.decode(w + n0 * row_bytes, row_bytes, K, nb);
        for (int64_t m0 = first; m0 < last; m0 += B_ROWS)
          switch (std::min<int64_t>(B_ROWS, last - m0)) {
            case 1: byte_pass<T, 1>(xs, m0, tile, K, y, ldy, n0, nb, columns); break;
            case 2: byte_pass<T, 2>(xs, m0, tile, K, y, ldy, n0, nb, columns); break;
            default: byte_pass<T, 3>(xs, m0, tile, K, y, ldy, n0, nb, columns); break;
          }
      }
    });
  }
}

// ---- attention over the cache (kernels.h; kernels.cpp says how) ------------------------------------------------------

// e^x for x <= 0: 2^(x log2 e) = 2^n 2^f, f in [-0.5, 0.5], 2^f by its degree-6 Taylor polynomial, 2^n built in the
// exponent bits (x >= -87: 2^n stays a normal float; e^-87 is 1.6e-38, nothing beside 1)
inline __m256 exp_nonpositive(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.f));
  const __m256 t = _mm256_mul_ps(x, _mm256_set1_ps(1.44269504f));
  const __m256 n = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_mul_ps(_mm256_sub_ps(t, n), _mm256_set1_ps(0.69314718f));
  __m256 p = _mm256_set1_ps(1.f / 720.f);
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f / 120.f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f / 24.f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f / 6.f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

// cap * tanh(x / cap) = cap * sign(x) (1 - e) / (1 + e), e = e^(-2 |x| / cap)
inline __m256 softcap8(__m256 x, float cap) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  const __m256 e = exp_nonpositive(_mm256_mul_ps(_mm256_andnot_ps(sign, x), _mm256_set1_ps(-2.f / cap)));
  __m256 t = _mm256_div_ps(_mm256_sub_ps(_mm256_set1_ps(1.f), e), _mm256_add_ps(_mm256_set1_ps(1.f), e));
  t = _mm256_mul_ps(t, _mm256_set1_ps(cap));
  return _mm256_or_ps(t, _mm256_and_ps(x, sign));
}

// 8 cached values as float32 (the first `left`), from a float32, bfloat16 or float16 cache
inline __m256 load8(const float* p, int64_t left) {
  return left >= 8 ? _mm256_loadu_ps(p) : _mm256_maskload_ps(p, lanes8(left));
}
inline __m128i load8_words(const void* p, int64_t left) {  // 8 16-bit numbers, zeros past `left`
  if (left >= 8) return _mm_loadu_si128((const __m128i*)p);
  uint16_t part[8] = {};
  memcpy(part, p, std::max<int64_t>(left, 0) * 2);
  return _mm_loadu_si128((const __m128i*)part);
}
inline __m256 load8(const uint16_t* p, int64_t left) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(load8_words(p, left)), 16));
}
inline __m256 load8(const c10::Half* p, int64_t left) { return _mm256_cvtph_ps(load8_words(p, left)); }
inline __m256 load8(const int8_t* p, int64_t left) {  // (an int8 cache: times the slot's scale by the caller)
  int64_t bytes = 0;
  memcpy(&bytes, p, std::min<int64_t>(std::max<int64_t>(left, 0), 8));
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_cvtsi64_si128(bytes)));
}

// The scores of N queries against U blocks of 16 keys at `keys` (each D x 16 contiguous values), scaled (and capped),
// to dst + i * stride (query i). N and U are constants: the accumulators' loops unroll into registers.
template <int N, int U, typename T>
inline void score_blocks(const float* const* q, const T* keys, const float* key_scales, int64_t D, float scale,
                         float softcap, float* dst, int64_t stride) {
  __m256 acc[N][U][2];
  for (int i = 0; i < N; ++i)
    for (int u = 0; u < U; ++u) acc[i][u][0] = acc[i][u][1] = _mm256_setzero_ps();
  for (int64_t d = 0; d < D; ++d)
    for (int u = 0; u < U; ++u) {
      const __m256 k0 = load8(keys + (u * D + d) * 16, 8), k1 = load8(keys + (u * D + d) * 16 + 8, 8);
      for (int i = 0; i < N; ++i) {
        const __m256 qd = _mm256_broadcast_ss(q[i] + d);
        acc[i][u][0] = _mm256_fmadd_ps(qd, k0, acc[i][u][0]);
        acc[i][u][1] = _mm256_fmadd_ps(qd, k1, acc[i][u][1]);
      }
    }
  for (int i = 0; i < N; ++i)
    for (int u = 0; u < U; ++u)
      for (int h = 0; h < 2; ++h) {
        __m256 s = _mm256_mul_ps(acc[i][u][h], _mm256_set1_ps(scale));
        if (key_scales) s = _mm256_mul_ps(s, _mm256_loadu_ps(key_scales + u * 16 + 8 * h));
        _mm256_storeu_ps(dst + i * stride + u * 16 + 8 * h, softcap > 0.f ? softcap8(s, softcap) : s);
      }
}

// out[i].acc[c0 * 8 ..] = sum over slots lo..hi of p_ij v_j, 8 C channels (C registers) of each value row, read once
// for the N queries (p: scores, query i's at p + i * stride, slot j's at index j - base). FULL: 8 C whole channels.
template <int N, int C, bool FULL, typename T>
inline void weigh_values(const float* p, int64_t stride, int64_t base, int64_t lo, int64_t hi, const T* vv, int64_t D,
                         int64_t c0, Partial* out) {
  __m256 acc[N][C];
  for (int i = 0; i < N; ++i)
    for (int c = 0; c < C; ++c) acc[i][c] = _mm256_setzero_ps();
  for (int64_t j = lo; j <= hi; ++j) {
    const T* row = vv + j * D + c0 * 8;
    __m256 value[C];
    for (int c = 0; c < C; ++c) value[c] = load8(row + c * 8, FULL ? 8 : D - (c0 + c) * 8);
    for (int i = 0; i < N; ++i) {
      const __m256 w = _mm256_broadcast_ss(p + i * stride + (j - base));
      for (int c = 0; c < C; ++c) acc[i][c] = _mm256_fmadd_ps(w, value[c], acc[i][c]);
    }
  }
  for (int i = 0; i < N; ++i)
    for (int c = 0; c < C; ++c)
      if (FULL) _mm256_storeu_ps(out[i].acc + (c0 + c) * 8, acc[i][c]);
      else _mm256_maskstore_ps(out[i].acc + (c0 + c) * 8, lanes8(D - (c0 + c) * 8), acc[i][c]);
}

// kernels.h's attend_queries (N a constant: see score_blocks)
template <int N, typename T>
void attend_queries(const float* const* q, const int64_t* start, const int64_t* end, int64_t lo, int64_t hi,
                    const T* kt, const T* vv, Scales scales, int64_t D, float scale, float softcap, Partial* out,
                    std::vector<float>& buffer) {
  const int64_t first = lo / 16, last = hi / 16, base = first * 16;  // whole blocks of 16 slots
  const int64_t width = (last + 1) * 16 - base, stride = width + 16;
  buffer.resize(N * stride);
  float* scores = buffer.data();
  int64_t blk = first;
  auto key_scales = [&](int64_t b) { return scales.k ? scales.k + b * 16 : nullptr; };
  if (N < 4)  // two blocks at a time: N x 4 accumulators (12 of 16 registers); four queries take one
    for (; blk + 1 <= last; blk += 2)
      score_blocks<N, 2>(q, kt + blk * D * 16, key_scales(blk), D, scale, softcap, scores + blk * 16 - base, stride);
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
    __m256 topv = _mm256_set1_ps(-INFINITY);
    for (int64_t j = a; j <= b; j += 8) {
      const __m256 m = _mm256_castsi256_ps(lanes8(b + 1 - j));
      topv = _mm256_max_ps(topv, _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), _mm256_loadu_ps(s + j), m));
    }
    __m128 top4 = _mm_max_ps(_mm256_castps256_ps128(topv), _mm256_extractf128_ps(topv, 1));
    top4 = _mm_max_ps(top4, _mm_movehl_ps(top4, top4));
    const float top = std::max(_mm_cvtss_f32(top4), _mm_cvtss_f32(_mm_shuffle_ps(top4, top4, 1)));
    out[i].max = top;
    topv = _mm256_set1_ps(top);
    __m256 vsum = _mm256_setzero_ps();
    for (int64_t j = a; j <= b; j += 8) {
      const __m256i m = lanes8(b + 1 - j);
      const __m256 e = _mm256_and_ps(exp_nonpositive(_mm256_sub_ps(_mm256_maskload_ps(s + j, m), topv)),
                                     _mm256_castsi256_ps(m));
      _mm256_maskstore_ps(s + j, m, e);
      vsum = _mm256_add_ps(vsum, e);
    }
    std::fill(s, s + a, 0.f);
    std::fill(s + b + 1, s + width, 0.f);
    out[i].sum = hsum(vsum);
    scale_weights(s, a, b, base, scales.v);
  }
  constexpr int C = N >= 3 ? 2 : 4;  // registers of values a pass: N x C accumulators, C values, one weight
  for (int64_t c0 = 0; c0 < (D + 7) / 8; c0 += C)
    if ((c0 + C) * 8 <= D) weigh_values<N, C, true>(scores, stride, base, lo, hi, vv, D, c0, out);
    else weigh_values<N, C, false>(scores, stride, base, lo, hi, vv, D, c0, out);
}

}  // namespace

REGISTER_OPS(float)  // (W: float32, no AVX512-BF16)
