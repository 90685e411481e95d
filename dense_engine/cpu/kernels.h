// kernels.h: what kernels.cpp (AVX-512) and kernels_avx2.cpp (AVX2) share: how a matmul's tiles are shared out
// among threads, the GEMM over dequantized tiles of a long prefill, GGUF's block sizes, the operators' schemas.
#pragma once

#include <ATen/Parallel.h>
#include <torch/library.h>
#include <ATen/ATen.h>
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <type_traits>
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

// The threads' shares of a matmul's tiles. A thread claims its share a block at a time from the front, so its weights
// are one long stream; when its share is done it takes the back half of the largest share left. A static split waits
// for the slower thread, which then streams alone at well under the memory's speed. On a 2-core VM, where the host
// often slows one core, the 1B shape's float32 decode ran 1.07x (a fast hour) to 1.28x (a slow one) faster, SmolLM2's
// 1.03-1.08x, the quantized modes the same (BENCHMARKS.md). Every tile is still computed once, by one thread, in the
// same order: the bits don't change.
struct alignas(64) Share { std::atomic<uint64_t> range; };  // [front, back) in tiles: front in the low 32 bits
inline uint64_t pack(uint64_t front, uint64_t back) { return front | back << 32; }
inline uint64_t front_of(uint64_t range) { return range & 0xffffffffu; }
inline uint64_t back_of(uint64_t range) { return range >> 32; }

template <typename Tile>
void for_each_tile_shared(int64_t tiles, int64_t block, Tile tile) {
  constexpr int MAX_THREADS = 64;
  int threads = (int)std::min<int64_t>({(int64_t)at::get_num_threads(), (tiles + block - 1) / block, MAX_THREADS});
  Share shares[MAX_THREADS];
  for (int i = 0; i < threads; ++i) shares[i].range = pack(tiles * i / threads, tiles * (i + 1) / threads);
  at::parallel_for(0, threads, 1, [&](int64_t me0, int64_t me1) {
    for (int64_t me = me0; me < me1; ++me) {  // one share per thread (more when at::parallel_for runs serially)
      std::atomic<uint64_t>& mine = shares[me].range;
      while (true) {
        uint64_t range = mine.load(), front = front_of(range), back = back_of(range);
        if (front < back) {  // claim the next block of our share
          uint64_t next = std::min<uint64_t>(front + block, back);
          if (mine.compare_exchange_weak(range, pack(next, back)))
            for (int64_t t = front; t < (int64_t)next; ++t) tile(t);
          continue;
        }
        int victim = -1;  // ours is done: the largest share left, if worth splitting
        uint64_t seen = 0, most = 2 * block;
        for (int i = 0; i < threads; ++i) {
          uint64_t other = shares[i].range.load();
          uint64_t left = back_of(other) - std::min(front_of(other), back_of(other));
          if (left > most) most = left, victim = i, seen = other;
        }
        if (victim < 0) break;
        uint64_t middle = front_of(seen) + (back_of(seen) - front_of(seen) + 1) / 2;
        if (shares[victim].range.compare_exchange_strong(seen, pack(front_of(seen), middle)))  // unless it moved
          mine = pack(middle, back_of(seen));  // nobody else writes an empty share
      }
    }
  });
}

// The N weight rows in tiles of NB; within a tile, walk x in chunks of up to 8 rows so the tile's weights stay in L1
// while every row of x passes over them.
template <int NB, int ROWS = MAX_ROWS, typename Tile>
void for_each_tile(int64_t M, int64_t N, int64_t K, int64_t bytes_per_weight_row, Tile tile) {
  int64_t block = std::max<int64_t>(1, (64 << 10) / std::max<int64_t>(1, NB * bytes_per_weight_row));  // >= 64 KB
  for_each_tile_shared((N + NB - 1) / NB, block, [&](int64_t t) {
    int64_t n0 = t * NB, nb = std::min<int64_t>(NB, N - n0);
    for (int64_t m0 = 0; m0 < M; m0 += ROWS) tile(m0, std::min<int64_t>(ROWS, M - m0), n0, nb);
  });
}

// ---- float32 and nf4 weights past a few rows of x (a prefill): the tiles' order of sums at a GEMM's rate -----------
// Each ISA's f32_tile computes an output (row m of x, weight row n) in L lanes, lane i summing x[m, k] w[n, k] over
// k = i, i + L, ... in order by FMAs, then its own sum of the lanes; in K's last partial step the lanes past K add
// fma(0, 0, acc). nf4_tile (below) keeps 8 lanes too, a block of 64 values at a time: each lane's 8 exact integer
// products, then times absmax into the lane's float sum.
// tile_gemm computes the same bits at a GEMM's schedule (float32: 0.8-0.9x oneDNN's float32 GEMM, BENCHMARKS.md):
//   * x packed once a call into blocks of R rows, [K_L / L][R][L] (K_L: K rounded up to L, zeros past K): its rows
//     K apart fell into the same L1 sets (at K = 2048 the tiles' loads ran at 0.6x);
//   * each thread a panel of 16 NB weight rows at a time (panel(n0, np): the rows K apart in the block's type, float32
//     as stored or nf4 decoded once a call, and nf4's absmax K / 64 apart), against x a group of 128 rows at a time, K
//     in even chunks of whole 64-blocks and at least CHUNK values: the panel's chunk and the group's stay in the cache
//     (x re-read whole for each small panel ran 512 rows of K = 8192 at 0.56x; AVX2's K = 576 in two chunks 0.93x);
//   * block(nb, xb, wb, sb, K, steps, acc, first, last, y, ldy, rows), the ISA's: a block of x against nb <= NB
//     weight rows (wb, K apart; sb their absmax) over `steps` steps of L, R x NB accumulators in registers, from and
//     back to acc (R L floats an output) between chunks, at the last one (its masked step where K % L) into y.
template <int64_t L, typename T>
inline void pack_steps(const T* src, int64_t rows, int64_t K, int64_t block, T* out) {
  for (int64_t s = 0; s < (K + L - 1) / L; ++s)
    for (int64_t r = 0; r < block; ++r) {
      T* o = out + (s * block + r) * L;
      const int64_t n = r < rows ? std::min(L, K - s * L) : 0;
      if (n > 0) memcpy(o, src + r * K + s * L, n * sizeof(T));
      std::fill(o + n, o + L, T(0));
    }
}

template <typename T>
inline T* aligned64(std::vector<T>& v, int64_t n) {  // n values of v from a 64-byte boundary
  v.resize(n + 64 / sizeof(T));
  return reinterpret_cast<T*>((reinterpret_cast<uintptr_t>(v.data()) + 63) & ~uintptr_t(63));
}

// n values from a 64-byte boundary for a call's packed x: the calling thread's buffer, kept from call to call up to
// 32 MB (a fresh buffer each call is zeroed, maybe faulted in); past that `fresh`, the caller's
template <typename T>
inline T* packed_x(std::vector<T>& fresh, int64_t n) {
  thread_local std::vector<T> kept;
  return aligned64(n * (int64_t)sizeof(T) <= (32 << 20) ? kept : fresh, n);
}

template <typename W>
struct PanelRows {  // a panel's weight rows as its block reads them: w [np, K]; nf4's absmax [np, K / 64], else null
  const W* w;
  const float* scale;
};

template <int64_t L, int R, int NB, int64_t CHUNK, typename T, typename Panel, typename Block>
void tile_gemm(const T* x, int64_t M, int64_t K, float* y, int64_t N, Panel panel, Block block) {
  constexpr int64_t PANEL = 16 * NB, GROUP = 128 / R, BLOCK_STEPS = (64 + L - 1) / L;  // (steps of a 64-block)
  const int64_t steps = (K + L - 1) / L, xblocks = (M + R - 1) / R;
  const int64_t chunks = std::max<int64_t>(1, K / CHUNK);
  const int64_t chunk = ((steps + chunks - 1) / chunks + BLOCK_STEPS - 1) / BLOCK_STEPS * BLOCK_STEPS;
  std::vector<T> fresh;
  T* xs = packed_x(fresh, xblocks * steps * R * L);
  at::parallel_for(0, xblocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) pack_steps<L>(x + b * R * K, std::min<int64_t>(R, M - b * R), K, R, xs + b * steps * R * L);
  });
  for_each_tile_shared((N + PANEL - 1) / PANEL, 1, [&](int64_t t) {
    const int64_t n0 = t * PANEL, np = std::min(PANEL, N - n0);
    const auto p = panel(n0, np);
    thread_local std::vector<float> abuf;  // (the accumulators between chunks: none where K is one chunk)
    float* acc = aligned64(abuf, chunk < steps ? GROUP * PANEL * R * L : 0);
    for (int64_t g = 0; g < xblocks; g += GROUP)
      for (int64_t c = 0; c < steps; c += chunk) {
        const int64_t cs = std::min(chunk, steps - c);
        for (int64_t b = g; b < std::min(g + GROUP, xblocks); ++b)
          for (int64_t j = 0; j < np; j += NB)
            block(std::min<int64_t>(NB, np - j), xs + (b * steps + c) * R * L, p.w + j * K + c * L,
                  p.scale ? p.scale + j * (K / 64) + c * L / 64 : nullptr, K, cs, acc + ((b - g) * PANEL + j) * R * L,
                  c == 0, c + cs == steps, y + b * R * N + n0 + j, N, std::min<int64_t>(R, M - b * R));
      }
  });
}

// ---- int8 weights past a few rows of x (a prefill): the tiles' exact integers at a GEMM's rate ---------------------
// Each ISA's int8_tile sums an output's products with x's two digits (DigitRows) as exact integers B1, B2 over the
// whole of K, then int8_out turns B = 127 B1 + B2 into y. Integers add up alike in any order, so int8_gemm, which
// reaches the same B by another route, gives the same bits at every number of rows:
//   * x's digits joined into one 16-bit integer a value, 127 q1 + q2 (|.| <= 127 * 127 + 64), packed once a call in
//     blocks of R rows as [K / 2][R] dwords: two values a dword, vpmaddwd's (vpdpwssd's) operand, broadcast;
//   * each thread a panel of L NB weight rows, K in chunks of 2 CHUNK values turned into 16-bit pairs [CHUNK][NB][L]
//     (the ISA's int8_panel: a weight row a lane), against every block of x: a lane is an output, nothing to sum
//     across lanes (the tiles' lanes run over K);
//   * a chunk's sums stay within int32 (2 CHUNK <= 1024 products of |w| <= 128 and |x| <= 16193: < 2^31); the chunks
//     are added in doubles (exact: |B| < 2^53), and the last into y by int8_out's arithmetic (block: the ISA's
//     int8_block, R x NB vectors of int32 in registers).
inline double int8_x_scale(float d) { return (double)d / 127.0; }  // a row's x = d / 127 (127 q1 + q2)
inline float int8_out(int64_t B, double x_scale, float s) { return (float)((double)B * x_scale * (double)s); }

template <int64_t L, int R, int NB, int64_t CHUNK, typename Digits, typename Panel, typename Block>
void int8_gemm(const Digits& xs, const uint8_t* w, const float* s, int64_t M, int64_t K, float* y, int64_t N,
               Panel panel, Block block) {
  constexpr int64_t PANEL = L * NB;
  static_assert(2 * CHUNK * 128 * 16193 < (int64_t(1) << 31), "a chunk's sums must stay within int32");
  const int64_t steps = K / 2, xblocks = (M + R - 1) / R;
  std::vector<int32_t> fresh;
  int32_t* xp = packed_x(fresh, xblocks * steps * R);
  std::vector<double> x_scale(xblocks * R, 0.0);
  at::parallel_for(0, xblocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b)
      for (int64_t r = 0; r < R; ++r) {
        const int64_t m = b * R + r;
        int32_t* out = xp + b * steps * R + r;
        if (m >= M) {
          for (int64_t t = 0; t < steps; ++t) out[t * R] = 0;
          continue;
        }
        x_scale[m] = int8_x_scale(xs.scale[m]);
        const int8_t *q1 = xs.q1.data() + m * K, *q2 = xs.q2.data() + m * K;
        for (int64_t t = 0; t < steps; ++t) {
          const int32_t lo = 127 * q1[2 * t] + q2[2 * t], hi = 127 * q1[2 * t + 1] + q2[2 * t + 1];
          out[t * R] = (int32_t)((uint32_t)(uint16_t)lo | (uint32_t)hi << 16);
        }
      }
  });
  for_each_tile_shared((N + PANEL - 1) / PANEL, 1, [&](int64_t t) {
    const int64_t n0 = t * PANEL, np = std::min(PANEL, N - n0);
    thread_local std::vector<int32_t> pbuf;
    thread_local std::vector<double> abuf;
    int32_t* pw = aligned64(pbuf, CHUNK * PANEL);
    double* acc = aligned64(abuf, steps > CHUNK ? xblocks * R * PANEL : 0);
    for (int64_t c = 0; c < steps; c += CHUNK) {
      const int64_t cs = std::min(CHUNK, steps - c);
      panel(w + n0 * K + 2 * c, np, K, cs, pw);
      for (int64_t b = 0; b < xblocks; ++b)
        block(xp + (b * steps + c) * R, pw, cs, acc + b * R * PANEL, c == 0, c + cs == steps, y + b * R * N + n0, N,
              std::min<int64_t>(R, M - b * R), np, x_scale.data() + b * R, s + n0);
    }
  });
}

at::Tensor output_like(const at::Tensor& x, int64_t N) {
  auto shape = x.sizes().vec();
  shape.back() = N;
  return at::empty(shape, x.options());
}

// A few rows of x run the decoding tiles, which read each weight once (decoding is memory-bound); past them, where
// arithmetic bounds a matmul, each type's prefill path in the tiles' order of sums. Each type hands over at its own
// count (F32_TILE_ROWS, INT8_TILE_ROWS, NF4_TILE_ROWS, tile_rows: BENCHMARKS.md); GGUF blocks on AVX2 at this one.
constexpr int64_t GEMM_ROWS = 12;

// A GGUF prefill pass's result for one row of x, a tile's weight rows n0 .. n0 + nb - 1: into y's row (its
// columns[n] for weight row n where columns is given: a fused projection's part)
inline void store_tile_row(const float* row, float* y_row, int64_t n0, int64_t nb, const int64_t* columns) {
  for (int64_t j = 0; j < nb; ++j) y_row[columns ? columns[n0 + j] : n0 + j] = row[j];
}

enum : int64_t { GQ4_0 = 2, GQ4_1 = 3, GQ5_0 = 6, GQ5_1 = 7, GQ8_0 = 8, GQ4_K = 12, GQ5_K = 13, GQ6_K = 14 };

constexpr int64_t block_elements(int64_t t) { return t >= GQ4_K ? 256 : 32; }
constexpr int64_t block_bytes(int64_t t) {
  return t == GQ4_0 ? 18 : t == GQ4_1 ? 20 : t == GQ5_0 ? 22 : t == GQ5_1 ? 24 : t == GQ8_0 ? 34 : t == GQ4_K ? 144
       : t == GQ5_K ? 176 : t == GQ6_K ? 210 : 0;
}

inline float half_at(const uint8_t* p) {
  uint16_t h;
  memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

// Q4_K / Q5_K's 12 bytes of packed 6-bit scales and mins -> scales in bytes 0..7, mins in bytes 8..15. As 32-bit
// lanes, the bytes hold d = scales 0-3 (low 6 bits), m = mins 0-3 (low 6 bits), md = scales 4-7 (low nibbles) and
// mins 4-7 (high nibbles); the top 2 bits of d and m are the high bits of scales and mins 4-7.
inline __m128i kquant_scales(const uint8_t* packed) {
  const __m128i v = _mm_loadu_si128((const __m128i*)packed);  // (the 4 bytes after the 12: the block's codes)
  const __m128i a = _mm_shuffle_epi32(v, _MM_SHUFFLE(2, 1, 2, 0));  // d, md, m, md
  const __m128i b = _mm_shuffle_epi32(v, _MM_SHUFFLE(1, 1, 0, 0));  // d, d, m, m
  const __m128i low = _mm_and_si128(_mm_srlv_epi32(a, _mm_setr_epi32(0, 0, 0, 4)),
                                    _mm_setr_epi32(0x3f3f3f3f, 0x0f0f0f0f, 0x3f3f3f3f, 0x0f0f0f0f));
  const __m128i high = _mm_and_si128(_mm_srlv_epi32(b, _mm_setr_epi32(0, 2, 0, 2)),
                                     _mm_setr_epi32(0, 0x30303030, 0, 0x30303030));
  return _mm_or_si128(low, high);
}

// K-quants' one order of sums, decoding and prefilling, on both instruction sets (issue 54, item 5). x is rounded to
// bytes a 256 at a time (ByteRows: xq, dx, llama.cpp's Q8_K). For weight row n, row m of x and super-block b:
//   I  = sum over sub-blocks j of scale_j * sum(s xq)    s = u - off (Q6_K: off 32), exact in int32 (< 2^28)
//   Mn = sum over sub-blocks j of min_j * sum(xq)         (Q4_K, Q5_K), exact in int32
//   acc = fma(fma(-dmin, Mn, d I), dx, acc)               (Q6_K: fma(d I, dx, acc)), b in order from 0
// The integer sums are the same whatever order a kernel adds them in (lanes over K when decoding, over weight rows
// in a prefill's tiles), and the float steps are one per super-block: a row's bits whatever the call holds beside it.
// (I and Mn as floats: the int32 sums converted, to the nearest, as every converter does)
inline float kquant_step(float acc, float I, float Mn, float d, float nd, float dx, bool mins) {
  const float part = d * I;
  return std::fma(mins ? std::fma(nd, Mn, part) : part, dx, acc);
}

// The sums of a's, b's, c's and d's eight int32 lanes, in that order (exact: the order of adding does not matter;
// unpacks and adds: vphaddd is 3-4 micro-ops on AMD's cores)
inline __m128i sum_lanes4(__m256i a, __m256i b, __m256i c, __m256i d) {
  const __m256i ab = _mm256_add_epi32(_mm256_unpacklo_epi32(a, b), _mm256_unpackhi_epi32(a, b));  // a02 b02 a13 b13 |
  const __m256i cd = _mm256_add_epi32(_mm256_unpacklo_epi32(c, d), _mm256_unpackhi_epi32(c, d));
  const __m256i t = _mm256_add_epi32(_mm256_unpacklo_epi64(ab, cd), _mm256_unpackhi_epi64(ab, cd));  // a0-3 .. d0-3 |
  return _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1));
}

// sum + the four products of unsigned bytes u and signed bytes s in each 32-bit lane: one vpdpbusd with AVX-VNNI
// (Alder Lake and later; -march=native enables it) or AVX-512 VNNI's 256-bit form; else vpmaddubsw (pairs in int16:
// callers keep |u s| pairs below 32768) and vpmaddwd by ones. The same integers either way.
#if defined(__AVXVNNI__) || (defined(__AVX512VNNI__) && defined(__AVX512VL__))
constexpr bool DOT_VNNI = true;  // (vpdpbusd: no pairs in int16 to keep small)
#else
constexpr bool DOT_VNNI = false;
#endif
inline __m256i dot_bytes(__m256i sum, __m256i u, __m256i s) {
#if defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(sum, u, s);
#elif defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(sum, u, s);
#else
  return _mm256_add_epi32(sum, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}

// sum + the products of pairs of 16-bit integers, in int32 lanes: one vpdpwssd with AVX-VNNI (or AVX-512 VNNI's
// 256-bit form), else vpmaddwd and an add
inline __m256i dot_words(__m256i sum, __m256i a, __m256i b) {
#if defined(__AVXVNNI__)
  return _mm256_dpwssd_avx_epi32(sum, a, b);
#elif defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpwssd_epi32(sum, a, b);
#else
  return _mm256_add_epi32(sum, _mm256_madd_epi16(a, b));
#endif
}

// 32 bits -> 32 bytes, byte j 0xFF where bit j is set
inline __m256i bits_to_bytes(uint32_t bits) {
#if defined(__AVX512BW__) && defined(__AVX512VL__)
  return _mm256_movm_epi8(bits);
#else
  const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32((int)bits),
                                             _mm256_setr_epi64x(0, 0x0101010101010101LL, 0x0202020202020202LL,
                                                                0x0303030303030303LL));
  const __m256i bit = _mm256_set1_epi64x((int64_t)0x8040201008040201ULL);
  return _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
#endif
}

// The sums of each of 8 registers' eight int32 lanes: lane j of the result is v[j]'s (exact)
inline __m256i sum_lanes8(const __m256i v[8]) {
  __m256i a[4], b[2];
  for (int i = 0; i < 4; ++i)  // v[2i] and v[2i + 1]'s lanes 0+2, 1+3 (and 4+6, 5+7), interleaved
    a[i] = _mm256_add_epi32(_mm256_unpacklo_epi32(v[2 * i], v[2 * i + 1]), _mm256_unpackhi_epi32(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 2; ++i)  // v[4i] .. v[4i + 3]'s lanes 0-3 in the low half, 4-7 in the high
    b[i] = _mm256_add_epi32(_mm256_unpacklo_epi64(a[2 * i], a[2 * i + 1]), _mm256_unpackhi_epi64(a[2 * i], a[2 * i + 1]));
  return _mm256_add_epi32(_mm256_permute2x128_si256(b[0], b[1], 0x20), _mm256_permute2x128_si256(b[0], b[1], 0x31));
}

// A 32-block's A, off and B (w = A (u - off) + B)
template <int64_t T>
inline void block_params(const uint8_t* blk, float& A, float& off, float& B) {
  A = half_at(blk);
  off = T == GQ4_0 ? 8.f : T == GQ5_0 ? 16.f : T == GQ8_0 ? 128.f : 0.f;
  B = T == GQ4_1 || T == GQ5_1 ? half_at(blk + 2) : 0.f;
}

// Chunk c's four quarters of 16: A, off and B of each (the dequantizer's view)
template <int64_t T>
inline void chunk_params(const uint8_t* row, int64_t c, int64_t blocks, float A[4], float off[4], float B[4]) {
  if constexpr (T == GQ4_K || T == GQ5_K) {
    const uint8_t* blk = row + (c / 4) * block_bytes(T);
    uint8_t sm[16];
    _mm_storeu_si128((__m128i*)sm, kquant_scales(blk + 4));
    const float d = half_at(blk), dmin = half_at(blk + 2);
    for (int q = 0; q < 4; ++q) {
      const int s = 2 * (c % 4) + q / 2;
      A[q] = d * (float)sm[s], off[q] = 0.f, B[q] = -(dmin * (float)sm[8 + s]);
    }
  } else if constexpr (T == GQ6_K) {
    const uint8_t* blk = row + (c / 4) * block_bytes(T);
    const float d = half_at(blk + 208);
    for (int q = 0; q < 4; ++q) A[q] = d * (float)(int8_t)blk[192 + 4 * (c % 4) + q], off[q] = 32.f, B[q] = 0.f;
  } else {
    for (int half = 0; half < 2; ++half) {
      float a = 0.f, o = 0.f, b = 0.f;
      if (2 * c + half < blocks) block_params<T>(row + (2 * c + half) * block_bytes(T), a, o, b);
      A[2 * half] = A[2 * half + 1] = a, off[2 * half] = off[2 * half + 1] = o, B[2 * half] = B[2 * half + 1] = b;
    }
  }
}

// ---- int4 weights, llama.cpp's Q4_1 grid: w = d * code + m per block of 32 --------------------------------------
// Packed (kernels.pack_int4) for lanes over weight rows: rows in groups of 16 (the last may hold fewer: `lanes`),
// each group's codes [K / 8][lanes][4 bytes], its d and m [K / 32][lanes] float32. The dword of row j and inputs
// 8c .. 8c + 7 holds code 8c + 2p in bits 4p .. 4p + 3 and code 8c + 2p + 1 in bits 16 + 4p .. 16 + 4p + 3
// (p = 0..3): (dword >> 4p) & 0x000F000F is that pair of codes as two 16-bit integers, what one vpdpwssd (or
// vpmaddwd) multiplies by the pair's H (BlockWords) broadcast to every row of the group; the dword & 0x0F0F0F0F and
// (dword >> 4) & 0x0F0F0F0F are codes 0 4 1 5 and 2 6 3 7 as bytes, what vpdpbusd (or vpmaddubsw) multiplies by L.
// Every tile, at every number of rows of x and on both instruction sets, computes a row's result in one order:
//   acc = 0; for each block b in order: acc = fma(u_b fma(BL_b, 1/128, BH_b), d_b, acc); acc = fma(s_b, m_b, acc)
// with BH_b, BL_b the block's sums of code H and code L, exact integers (< 2^24: exact in float): a row's bits
// whatever the call holds beside it (issue 54, item 5), and the same on AVX2 and AVX-512.
constexpr int64_t INT4_LANES = 16;

// x with a scale per 32 values as a 16-bit integer H and a signed byte L: x / u = H + L / 128 to within 1/256,
// u = the 32's largest |x| / 32767 (|H| <= 32767, |L| <= 64): each value within 2^-23 of its 32's largest, float32's
// precision (H alone, within 1/65534, put the default model's logits 2e-4 from its float path; issue 54 asks 1e-4).
// L is stored in the order the codes' bytes take (kernels.h's int4 layout): inputs 0 4 1 5 2 6 3 7 of each 8. Per 32
// also s = u (sum(H) + sum(L) / 128), what the block's m multiplies. The same float steps on both instruction sets.
struct BlockWords {
  int16_t* high;  // [M, K]: H
  int8_t* low;    // [M, K]: L, each 8 in the order above
  float *unit, *sum;  // [M, K / 32]: u, s
  // In the calling thread's buffers, kept from call to call (one BlockWords a thread at a time): fresh pages for each
  // call's megabytes cost page faults (measured: as long as computing the words)
  BlockWords(const float* xf, int64_t M, int64_t K) {
    thread_local std::vector<int16_t> words;
    thread_local std::vector<int8_t> bytes;
    thread_local std::vector<float> floats;
    words.resize(std::max<size_t>(words.size(), M * K)), bytes.resize(std::max<size_t>(bytes.size(), M * K));
    floats.resize(std::max<size_t>(floats.size(), M * K / 16));
    high = words.data(), low = bytes.data(), unit = floats.data(), sum = unit + M * K / 32;
    at::parallel_for(0, M * K / 32, 256, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) block(xf + 32 * b, b);
    });
  }
  void block(const float* v, int64_t b) {  // (AVX2 registers: the same instructions in both files)
    const __m256 sign = _mm256_set1_ps(-0.f);
    __m256 top8 = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) top8 = _mm256_max_ps(top8, _mm256_andnot_ps(sign, _mm256_loadu_ps(v + 8 * i)));
    __m128 t = _mm_max_ps(_mm256_castps256_ps128(top8), _mm256_extractf128_ps(top8, 1));
    t = _mm_max_ps(t, _mm_movehl_ps(t, t));
    const float top = _mm_cvtss_f32(_mm_max_ss(t, _mm_movehdup_ps(t)));
    const __m256 inv = _mm256_set1_ps(top > 0.f ? 32767.f / top : 0.f);
    constexpr int nearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    __m256i h[4], sum_h = _mm256_setzero_si256(), sum_l = _mm256_setzero_si256();
    alignas(32) int32_t l[32];
    for (int i = 0; i < 4; ++i) {  // (|h| <= 32767: top * inv rounds to 32767; scaled - h is exact, in [-1/2, 1/2])
      const __m256 scaled = _mm256_mul_ps(_mm256_loadu_ps(v + 8 * i), inv), hf = _mm256_round_ps(scaled, nearest);
      const __m256i li = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(_mm256_sub_ps(scaled, hf), _mm256_set1_ps(128.f)), nearest));
      h[i] = _mm256_cvtps_epi32(hf);
      _mm256_store_si256((__m256i*)(l + 8 * i), li);
      sum_h = _mm256_add_epi32(sum_h, h[i]), sum_l = _mm256_add_epi32(sum_l, li);
    }
    for (int i = 0; i < 4; i += 2)  // int32 -> int16 in order (packs interleaves the 128-bit halves)
      _mm256_storeu_si256((__m256i*)(high + 32 * b + 8 * i), _mm256_permute4x64_epi64(_mm256_packs_epi32(h[i], h[i + 1]), 0xD8));
    for (int e = 0; e < 32; ++e) low[32 * b + (e & ~7) + (e % 8 < 4 ? 2 * (e % 8) : 2 * (e % 8 - 4) + 1)] = (int8_t)l[e];
    unit[b] = top / 32767.f;
    sum[b] = unit[b] * std::fma((float)sum_of(sum_l), 1.f / 128.f, (float)sum_of(sum_h));
  }
  static int32_t sum_of(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
    return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1))));
  }
};

// The weight rows' groups shared among the threads; within a group, x in chunks of up to ROWS rows (the group's codes
// stay in L1 while every row of x passes over them). group(m0, rows, codes, d, m, n0, lanes) gets a whole group of
// 16 lanes: a last group of fewer rows is copied into one with zero codes, d and m.
template <int ROWS, typename Group>
void for_each_int4_group(int64_t M, int64_t N, int64_t K, const uint8_t* q, const float* d, const float* mn,
                         Group group) {
  const int64_t G = K / 32, group_bytes = INT4_LANES * K / 2;
  const int64_t block = std::max<int64_t>(1, (64 << 10) / group_bytes);  // >= 64 KB a claim
  for_each_tile_shared((N + INT4_LANES - 1) / INT4_LANES, block, [&](int64_t g) {
    const int64_t n0 = g * INT4_LANES, lanes = std::min(INT4_LANES, N - n0);
    const uint8_t* codes = q + n0 * (K / 2);
    const float *dg = d + n0 * G, *mg = mn + n0 * G;
    thread_local std::vector<uint8_t> whole_codes;
    thread_local std::vector<float> whole_d, whole_m;
    if (lanes < INT4_LANES) {
      whole_codes.assign(group_bytes, 0), whole_d.assign(G * INT4_LANES, 0.f), whole_m.assign(G * INT4_LANES, 0.f);
      for (int64_t c = 0; c < K / 8; ++c) memcpy(whole_codes.data() + c * 4 * INT4_LANES, codes + c * 4 * lanes, 4 * lanes);
      for (int64_t b = 0; b < G; ++b) {
        memcpy(whole_d.data() + b * INT4_LANES, dg + b * lanes, 4 * lanes);
        memcpy(whole_m.data() + b * INT4_LANES, mg + b * lanes, 4 * lanes);
      }
      codes = whole_codes.data(), dg = whole_d.data(), mg = whole_m.data();
    }
    for (int64_t m0 = 0; m0 < M; m0 += ROWS) group(m0, std::min<int64_t>(ROWS, M - m0), codes, dg, mg, n0, lanes);
  });
}

// ---- GGUF 32-blocks, decoding (both ISAs, 8 lanes): x rounded to bytes a 32 at a time (ByteRows, llama.cpp's Q8_0
// activations), as their prefill. A tile of 8 weight rows against R rows of x, a block at a time: the 8 rows' codes
// times xq (dot_bytes; Q8_0 without VNNI: |q| times xq with q's sign, whose pairs stay within vpmaddubsw's int16),
// their lane sums side by side (sum_lanes8: lanes over the weight rows, as the prefill's tiles hold them), less the
// offset (Q4_0 8, Q5_0 16, Q8_0's + 128) times the block's sum of xq: S, exact. Then, per block in order, the
// prefill's float steps:
//   part = d S (Q4_1 / Q5_1: part = fma(m, sum(xq), part)); acc = fma(part, dx, acc)
// so a row's bits do not depend on the call. (Lanes over K, each block's sum of lanes alone, ran at half the rate.)

// A 32-block's 32 codes (elements in order; Q8_0: its int8 + 128)
template <int64_t T>
inline __m256i block_codes(const uint8_t* blk) {
  if constexpr (T == GQ8_0) {
    return _mm256_xor_si256(_mm256_loadu_si256((const __m256i*)(blk + 2)), _mm256_set1_epi8((char)0x80));
  } else {
    constexpr int at = T == GQ4_0 ? 2 : T == GQ4_1 ? 4 : T == GQ5_0 ? 6 : 8;  // the 16 bytes of nibbles
    const __m128i q = _mm_loadu_si128((const __m128i*)(blk + at)), m = _mm_set1_epi8(15);
    __m256i u = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), m), _mm_and_si128(q, m));
    if constexpr (T == GQ5_0 || T == GQ5_1) {  // bit j of qh: element j's fifth bit
      uint32_t qh;
      memcpy(&qh, blk + (T == GQ5_0 ? 2 : 4), 4);
      u = _mm256_or_si256(u, _mm256_and_si256(bits_to_bytes(qh), _mm256_set1_epi8(16)));
    }
    return u;
  }
}

template <int64_t T, int R, typename ByteRows>
void block32_tile(const ByteRows& xs, int64_t m0, const uint8_t* w, int64_t row_bytes, int64_t K, float* y,
                  int64_t N, int64_t n0, int64_t nb) {
  constexpr bool MINS = T == GQ4_1 || T == GQ5_1;
  constexpr bool SIGNS = T == GQ8_0 && !DOT_VNNI;  // |q| times xq with q's sign; with vpdpbusd, q + 128 times xq
  // the offset, 8, 16 or 128 (Q8_0's u = q + 128): S = sum(u xq) - offset sum(xq)
  constexpr int SHIFT = T == GQ4_0 ? 3 : T == GQ5_0 ? 4 : T == GQ8_0 && !SIGNS ? 7 : 0;
  const int64_t blocks = K / 32;
  const __m256i zero = _mm256_setzero_si256();
  const uint8_t* rows[8];  // (past nb: the last row again, its results dropped)
  for (int j = 0; j < 8; ++j) rows[j] = w + (n0 + std::min<int64_t>(j, nb - 1)) * row_bytes;
  // each row's bytes asked for a tile ahead (into L2): the next tile's same row, where the thread reads next (its
  // share is one stream); a fixed distance fell inside this tile's own rows
  const int64_t ahead = 8 * row_bytes;
  __m256 acc[R];  // lanes: the tile's weight rows
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    __m256i u[8], q[8];  // codes (SIGNS: |q|, and q)
    int32_t head[8];       // each block's first 4 bytes: d (and Q4_1 / Q5_1's m) in float16
    for (int j = 0; j < 8; ++j) {
      const uint8_t* blk = rows[j] + b * block_bytes(T);
      if (b % 2 == 0) _mm_prefetch((const char*)blk + ahead, _MM_HINT_T1);
      memcpy(head + j, blk, 4);
      if constexpr (SIGNS) {
        q[j] = _mm256_loadu_si256((const __m256i*)(blk + 2));
        u[j] = _mm256_abs_epi8(q[j]);
      } else {
        u[j] = block_codes<T>(blk);
      }
    }
    // (lanes set from registers: eight 2-byte stores then one load would wait on store forwarding)
    const __m256i heads = _mm256_setr_epi32(head[0], head[1], head[2], head[3], head[4], head[5], head[6], head[7]);
    const __m256i halves = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(heads, _mm256_setr_epi8(
        0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15, 0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15)),
        _MM_SHUFFLE(3, 1, 2, 0));  // the 8 d, then the 8 m
    const __m256 d = _mm256_cvtph_ps(_mm256_castsi256_si128(halves));
    __m256 m;
    if constexpr (MINS) m = _mm256_cvtph_ps(_mm256_extracti128_si256(halves, 1));
    for (int r = 0; r < R; ++r) {
      const __m256i xq = _mm256_loadu_si256((const __m256i*)(xs.xu.data() + (m0 + r) * K + 32 * b));
      __m256i t[8];
      for (int j = 0; j < 8; ++j) t[j] = dot_bytes(zero, u[j], SIGNS ? _mm256_sign_epi8(xq, q[j]) : xq);
      __m256i S = sum_lanes8(t);
      const int16_t* s16 = xs.s16.data() + (m0 + r) * (K / 16) + 2 * b;
      const int32_t s32 = s16[0] + s16[1];  // the block's sum of xq
      if constexpr (SHIFT > 0) S = _mm256_sub_epi32(S, _mm256_set1_epi32(s32 << SHIFT));
      __m256 part = _mm256_mul_ps(d, _mm256_cvtepi32_ps(S));
      if constexpr (MINS) part = _mm256_fmadd_ps(m, _mm256_set1_ps((float)s32), part);
      acc[r] = _mm256_fmadd_ps(part, _mm256_set1_ps(xs.dx[(m0 + r) * blocks + b]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    alignas(32) float out[8];
    _mm256_store_ps(out, acc[r]);
    for (int64_t j = 0; j < nb; ++j) y[r * N + n0 + j] = out[j];
  }
}

#define DISPATCH_GGUF(type, BODY)                       \
  switch (type) {                                       \
    case GQ4_0: { constexpr int64_t T = GQ4_0; BODY; break; } \
    case GQ4_1: { constexpr int64_t T = GQ4_1; BODY; break; } \
    case GQ5_0: { constexpr int64_t T = GQ5_0; BODY; break; } \
    case GQ5_1: { constexpr int64_t T = GQ5_1; BODY; break; } \
    case GQ8_0: { constexpr int64_t T = GQ8_0; BODY; break; } \
    case GQ4_K: { constexpr int64_t T = GQ4_K; BODY; break; } \
    case GQ5_K: { constexpr int64_t T = GQ5_K; BODY; break; } \
    case GQ6_K: { constexpr int64_t T = GQ6_K; BODY; break; } \
    default: TORCH_CHECK(false, "GGUF type ", type, " has no kernel"); \
  }

// linear_gguf_into's operands: out float32 [..., width] contiguous, x's rows; columns int64 [N], w's rows' places
void check_columns(const at::Tensor& x, const at::Tensor& w, const at::Tensor& out, const at::Tensor& columns) {
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() && out.numel() / out.size(-1) == x.numel() / x.size(-1),
              "linear_gguf_into: out must be float32, contiguous, with x's rows");
  TORCH_CHECK(columns.scalar_type() == at::kLong && columns.dim() == 1 && columns.size(0) == w.size(0) && columns.is_contiguous(),
              "linear_gguf_into: columns must be int64 [", w.size(0), "]");
  TORCH_CHECK(columns.numel() == 0 || (columns.min().item<int64_t>() >= 0 && columns.max().item<int64_t>() < out.size(-1)),
              "linear_gguf_into: a column past out's ", out.size(-1));
}

// out[m, columns[n]] = y[m, n]
void write_columns(const at::Tensor& y_, at::Tensor& out, const at::Tensor& columns) {
  const auto y = y_.reshape({-1, y_.size(-1)});
  const int64_t M = y.size(0), N = y.size(1), width = out.size(-1);
  const float* yp = y.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t* c = columns.data_ptr<int64_t>();
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) op[m * width + c[n]] = yp[m * N + n];
}

void check_blocks(const at::Tensor& w, int64_t type, int64_t K, const char* op) {
  TORCH_CHECK(w.scalar_type() == at::kByte && w.dim() == 2 && w.is_contiguous(), op, ": blocks must be uint8 [N, bytes]");
  TORCH_CHECK(block_bytes(type) > 0, op, ": GGUF type ", type, " has no kernel");
  TORCH_CHECK(K % block_elements(type) == 0 && w.size(1) == K / block_elements(type) * block_bytes(type), op,
              ": ", w.size(1), " bytes a row do not hold ", K, " inputs of GGUF type ", type);
}

// ---- attention over the cache (kernels.cpp says how) ----------------------------------------------------------------

constexpr int GROUP = 4;   // queries scored together (GQA: the query heads of one key/value head), K and V read once
constexpr int64_t SPLIT = 512;  // a query's slots are cut into parts of this many (a part's results combined after)

struct Partial {  // one query's softmax over part of its slots: max score, sum of e^(s - max), sum of e^(s - max) v
  float max, sum;
  float acc[512];  // (a head of up to 512 channels: Gemma 4's full layers)
};

inline float as_float(float v) { return v; }
inline float as_float(int8_t v) { return (float)v; }  // (an int8 cache's padding output: never read)
inline float as_float(uint16_t bf16) {
  const uint32_t bits = (uint32_t)bf16 << 16;
  float v;
  memcpy(&v, &bits, 4);
  return v;
}
inline float as_float(c10::Half h) { return (float)h; }

// The scales of an int8 cache's slots (a key's or a value's int8 channels times its slot's scale, one per token and
// head: [B, K, blocks * 16] float32 each, as many as the keys' blocks have slots); null for a float32 or bfloat16
// cache
struct Scales {
  const float* k;
  const float* v;
};

// N (a constant, up to GROUP) queries of one batch row against one key/value head, over slots lo..hi (each query's
// own slots start[i]..end[i] intersected with it): the partial results, to be combined across parts (each ISA's
// file). scales (an int8 cache): a key's score is its slot's scale times q . k; a value's weight e^(s - max) is
// taken times its slot's scale after the sum of the weights
template <int N, typename T>
void attend_queries(const float* const* q, const int64_t* start, const int64_t* end, int64_t lo, int64_t hi,
                    const T* kt, const T* vv, Scales scales, int64_t D, float scale, float softcap, Partial* out,
                    std::vector<float>& buffer);

// attend_queries for n of them (n known at run time)
template <typename T>
void attend_part(const float* const* q, const int64_t* start, const int64_t* end, int n, int64_t lo, int64_t hi,
                 const T* kt, const T* vv, Scales scales, int64_t D, float scale, float softcap, Partial* out,
                 std::vector<float>& buffer) {
  static_assert(GROUP == 4, "one case per query count");
  if (n == 4) attend_queries<4>(q, start, end, lo, hi, kt, vv, scales, D, scale, softcap, out, buffer);
  else if (n == 3) attend_queries<3>(q, start, end, lo, hi, kt, vv, scales, D, scale, softcap, out, buffer);
  else if (n == 2) attend_queries<2>(q, start, end, lo, hi, kt, vv, scales, D, scale, softcap, out, buffer);
  else attend_queries<1>(q, start, end, lo, hi, kt, vv, scales, D, scale, softcap, out, buffer);
}

// The value weights of slots base + a .. base + b (e^(s - max), summed already) times their values' scales
inline void scale_weights(float* s, int64_t a, int64_t b, int64_t base, const float* value_scales) {
  if (value_scales)
    for (int64_t j = a; j <= b; ++j) s[j] *= value_scales[base + j];
}

template <typename T>
void attention_impl(const at::Tensor& q, const at::Tensor& k_t, const at::Tensor& v, const at::Tensor& k_scale,
                    const at::Tensor& v_scale, const int64_t* positions, int64_t pos_stride, const int64_t* starts,
                    const int64_t* rows, int64_t window, float scale, float softcap, at::Tensor& out) {
  const int64_t B = q.size(0), H = q.size(1), T_ = q.size(2), D = q.size(3), K = k_t.size(1), S1 = v.size(2);
  const float* qp = q.data_ptr<float>();
  const T* kp = reinterpret_cast<const T*>(k_t.data_ptr());
  const T* vp = reinterpret_cast<const T*>(v.data_ptr());
  const bool int8 = k_scale.defined();
  float* op = out.data_ptr<float>();
  const int64_t G = H / K, queries = G * T_, groups = (queries + GROUP - 1) / GROUP;
  auto position = [&](int64_t b, int64_t t) { return positions[b * pos_stride + t]; };  // slot of token t of row b
  auto cache_row = [&](int64_t b) { return rows ? rows[b] : b; };
  int64_t longest = 0;
  for (int64_t b = 0; b < (pos_stride ? B : 1); ++b)
    for (int64_t t = 0; t < T_; ++t)
      if (position(b, t) < S1 - 1) longest = std::max(longest, position(b, t) + 1);
  // work items: (batch row, key/value head, group of its queries, part of the slots); query index = t * G + g. The
  // slots are cut into parts at fixed places (every SPLIT slots), so a query's sums depend on its own slots only:
  // the same bits whatever the batch, the threads or the other queries of the call (a prompt in chunks, alone or
  // beside others).
  const int64_t items = B * K * groups;
  const int64_t parts = std::max<int64_t>(1, (longest + SPLIT - 1) / SPLIT), part_len = SPLIT;
  auto finish = [&](int64_t item, const Partial* results) {  // combine a group's parts: weights e^(max_p - max)
    const int64_t b = item / (K * groups), kv = (item / groups) % K, first = (item % groups) * GROUP;
    int i = 0;
    for (int64_t index = first; index < std::min(first + GROUP, queries); ++index) {
      const int64_t t = index / G, h = kv * G + index % G;
      float* o = op + ((b * H + h) * T_ + t) * D;
      if (position(b, t) >= S1 - 1) {  // padding (the scratch slot) sees only itself
        const T* scratch = vp + cache_row(b) * v.stride(0) + kv * v.stride(1) + (S1 - 1) * D;
        for (int64_t c = 0; c < D; ++c) o[c] = as_float(scratch[c]);
        continue;
      }
      float top = -INFINITY, sum = 0.f;
      for (int64_t p = 0; p < parts; ++p) top = std::max(top, results[p * GROUP + i].max);
      std::fill(o, o + D, 0.f);
      for (int64_t p = 0; p < parts; ++p) {
        const Partial& part = results[p * GROUP + i];
        if (part.sum == 0.f) continue;
        const float w = std::exp(part.max - top);
        sum += w * part.sum;
        for (int64_t c = 0; c < D; ++c) o[c] += w * part.acc[c];
      }
      for (int64_t c = 0; c < D; ++c) o[c] /= sum;
      ++i;
    }
  };
  auto work_on = [&](int64_t work, Partial* mine, std::vector<float>& buffer) {
    const int64_t item = work / parts, part = work % parts;
    const int64_t b = item / (K * groups), kv = (item / groups) % K, first = (item % groups) * GROUP;
    const T* kt = kp + cache_row(b) * k_t.stride(0) + kv * k_t.stride(1);
    const T* vv = vp + cache_row(b) * v.stride(0) + kv * v.stride(1);
    auto scales_of = [&](const at::Tensor& t) {  // (row b, head kv)'s slots
      return t.data_ptr<float>() + cache_row(b) * t.stride(0) + kv * t.stride(1);
    };
    const Scales scales = int8 ? Scales{scales_of(k_scale), scales_of(v_scale)} : Scales{nullptr, nullptr};
    const float* qs[GROUP];
    int64_t start[GROUP], end[GROUP];
    int n = 0;
    int64_t lo = INT64_MAX, hi = -1;
    for (int64_t index = first; index < std::min(first + GROUP, queries); ++index) {
      const int64_t t = index / G, h = kv * G + index % G;
      if (position(b, t) >= S1 - 1) continue;  // padding: in finish
      qs[n] = qp + ((b * H + h) * T_ + t) * D;
      end[n] = position(b, t);
      start[n] = std::min<int64_t>(starts ? starts[b] : 0, end[n]);
      if (window > 0) start[n] = std::max(start[n], end[n] - window + 1);
      lo = std::min(lo, start[n]), hi = std::max(hi, end[n]);
      ++n;
    }
    const int64_t a = std::max(lo, part * part_len), z = std::min(hi, (part + 1) * part_len - 1);
    if (n == 0 || a > z) {
      for (int i = 0; i < GROUP; ++i) mine[i].max = -INFINITY, mine[i].sum = 0.f;
      return;
    }
    attend_part<T>(qs, start, end, n, a, z, kt, vv, scales, D, scale, softcap, mine, buffer);
  };
  if (parts == 1) {  // a short context: each work item finishes its own queries, one parallel region
    at::parallel_for(0, items, 1, [&](int64_t i0, int64_t i1) {
      thread_local std::vector<float> buffer;
      Partial mine[GROUP];
      for (int64_t item = i0; item < i1; ++item) {
        work_on(item, mine, buffer);
        finish(item, mine);
      }
    });
    return;
  }
  constexpr int64_t RUN = 32;
  if (items >= RUN * at::get_num_threads()) {  // many queries (a long prefill): runs of RUN items of one thread,
    // the parts outermost, so one part's keys and values stay in the thread's cache while the run's queries read
    // them (a run a thread at least: fewer items, as a decode step's, share out their parts below)
    at::parallel_for(0, (items + RUN - 1) / RUN, 1, [&](int64_t r0, int64_t r1) {
      thread_local std::vector<float> buffer;
      thread_local std::vector<Partial> mine;
      mine.resize(RUN * parts * GROUP);
      for (int64_t run = r0; run < r1; ++run) {
        const int64_t first = run * RUN, last = std::min(items, first + RUN);
        for (int64_t part = 0; part < parts; ++part)
          for (int64_t item = first; item < last; ++item)
            work_on(item * parts + part, mine.data() + ((item - first) * parts + part) * GROUP, buffer);
        for (int64_t item = first; item < last; ++item) finish(item, mine.data() + (item - first) * parts * GROUP);
      }
    });
    return;
  }
  std::vector<Partial> partials(items * parts * GROUP);  // few queries over many slots (decoding a long context):
  at::parallel_for(0, items * parts, 1, [&](int64_t i0, int64_t i1) {  // the parts shared out among the threads
    thread_local std::vector<float> buffer;
    for (int64_t work = i0; work < i1; ++work) work_on(work, partials.data() + work * GROUP, buffer);
  });
  at::parallel_for(0, items, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t item = i0; item < i1; ++item) finish(item, partials.data() + item * parts * GROUP);
  });
}

at::Tensor attention(const at::Tensor& q_, const at::Tensor& k_t, const at::Tensor& v, const at::Tensor& pos_,
                     const at::Tensor& row_start, const at::Tensor& rows_, double scale, int64_t window, double softcap,
                     const std::optional<at::Tensor>& k_scale_, const std::optional<at::Tensor>& v_scale_) {
  const auto kind = k_t.scalar_type();
  const bool int8 = kind == at::kChar;
  TORCH_CHECK(q_.scalar_type() == at::kFloat && kind == v.scalar_type() && pos_.scalar_type() == at::kLong &&
              (kind == at::kFloat || kind == at::kBFloat16 || kind == at::kHalf || int8) &&
              int8 == (k_scale_.has_value() && v_scale_.has_value()),
              "attention: a float32, float16, bfloat16 or int8 cache (int8: with k_scale and v_scale)");
  auto q = q_.contiguous(), pos = pos_.contiguous(), rows = rows_.contiguous();
  const bool per_row = pos.dim() == 2;
  const int64_t D = q.size(3), S1 = v.size(2);
  TORCH_CHECK(k_t.dim() == 5 && k_t.size(2) * 16 >= S1 && k_t.size(3) == D && k_t.size(4) == 16 && v.size(3) == D &&
              D <= 512 && q.size(1) % k_t.size(1) == 0 && pos.size(-1) == q.size(2) && (!per_row || pos.size(0) == q.size(0)) &&
              (rows.numel() == 0 || rows.numel() == q.size(0)) && k_t.stride(2) == D * 16 &&
              k_t.stride(3) == 16 && k_t.stride(4) == 1 && v.stride(3) == 1 && v.stride(2) == D,
              "attention: bad shapes");
  at::Tensor k_scale, v_scale;
  if (int8) {
    k_scale = *k_scale_, v_scale = *v_scale_;
    for (const auto& t : {k_scale, v_scale})
      TORCH_CHECK(t.scalar_type() == at::kFloat && t.dim() == 3 && t.size(0) == v.size(0) && t.size(1) == v.size(1) &&
                  t.size(2) >= k_t.size(2) * 16 && t.stride(2) == 1,
                  "attention: scales [B, K, slots] float32, for every slot of the keys' blocks");
  }
  auto out = at::empty_like(q);
  const int64_t* starts = row_start.numel() ? row_start.data_ptr<int64_t>() : nullptr;
  const int64_t* row_of = rows.numel() ? rows.data_ptr<int64_t>() : nullptr;
  const int64_t stride = per_row ? q.size(2) : 0;
  if (kind == at::kFloat)
    attention_impl<float>(q, k_t, v, k_scale, v_scale, pos.data_ptr<int64_t>(), stride, starts, row_of, window,
                          (float)scale, (float)softcap, out);
  else if (kind == at::kBFloat16)
    attention_impl<uint16_t>(q, k_t, v, k_scale, v_scale, pos.data_ptr<int64_t>(), stride, starts, row_of, window,
                             (float)scale, (float)softcap, out);
  else if (kind == at::kHalf)
    attention_impl<c10::Half>(q, k_t, v, k_scale, v_scale, pos.data_ptr<int64_t>(), stride, starts, row_of, window,
                              (float)scale, (float)softcap, out);
  else
    attention_impl<int8_t>(q, k_t, v, k_scale, v_scale, pos.data_ptr<int64_t>(), stride, starts, row_of, window,
                           (float)scale, (float)softcap, out);
  return out;
}

// ---- nf4 weights (bitsandbytes' NF4 code), one absmax per block of 64: both ISAs, 8 lanes, the same bits ----------
// Per row and block: 32 bytes, byte j holding code j (low nibble) and code j + 32 (high nibble) (repacked at load
// from bitsandbytes' layout); absmax float32 [N, K/64]. kernels.cpp runs this code too (its 256-bit vpdpwssd in
// dot_words): in integers it ran 1.1-2.1x kernels.cpp's float32 lookups (vpermps, x in float32) on Zen 4
// (BENCHMARKS.md), and one design gives one result on both ISAs.

inline float hsum(__m256 v) {  // lanes summed pairwise: (0+4, 1+5, 2+6, 3+7), then (0+2, 1+3), then 0+1
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// nf4's tiles' schedule (half a byte a weight): at one row of x 4 weight rows a tile (more memory in
// flight), else 2 weight rows against up to 4 rows of x. tile(rows, weight_rows, m0, n0), the counts as
// std::integral_constant (each tile a template on them)
template <typename Tile>
void four_bit_tiles(int64_t M, int64_t N, int64_t K, Tile tile) {
  using std::integral_constant;
  if (M == 1) {
    for_each_tile<4>(M, N, K, 2 * K, [&](int64_t, int64_t, int64_t n0, int64_t nb) {
      if (nb == 4) tile(integral_constant<int, 1>(), integral_constant<int, 4>(), 0, n0);
      else for (int64_t j = 0; j < nb; ++j) tile(integral_constant<int, 1>(), integral_constant<int, 1>(), 0, n0 + j);
    });
    return;
  }
  for_each_tile<2, 4>(M, N, K, K, [&](int64_t m0, int64_t rows, int64_t n0, int64_t nb) {
    if (nb == 2) {
      DISPATCH_ROWS(rows, (tile(integral_constant<int, R>(), integral_constant<int, 2>(), m0, n0)));
    } else {
      DISPATCH_ROWS(rows, (tile(integral_constant<int, R>(), integral_constant<int, 1>(), m0, n0)));
    }
  });
}

// The tiles (up to NF4_TILE_ROWS rows of x) multiply in integers: x as 16-bit words X = 127 q1 + q2 (DigitRows' digits,
// within 1/32258 of a row's largest value) and each code's value as V = round(NF4[code] 2^14), within 2^-15 of the
// block's absmax (NF4's own steps are 2500x that). vpshufb looks 32 codes up at once in two 16-byte tables (V's low
// and high bytes), vpunpck{l,h}bw joins them into words; per block four vpmaddwd (8 products a lane: |V X| 8 <= 2^14
// 16193 8 < 2^31), then times absmax in float. A lookup of float32 values (vpermps in two registers, a blend: 2-3 shuffles
// per 8 weights) ran at a third of the memory's speed. Within each 128-bit lane the words come out as codes 0-7 and
// 16-23 (unpacklo), 8-15 and 24-31 (unpackhi), the same + 32 for the high nibbles: X is read in that order (NF4Words
// permutes it once a call).
struct NF4Words {
  __m256i low, high;       // V's low and high bytes of each code, in both lanes
  std::vector<int16_t> x;  // [M, K]: X = 127 q1 + q2 (x's digits), each 64 in the tile's order
  std::vector<float> unit; // per row: the value of X = 1
  template <typename Digits>
  NF4Words(const float* code, const Digits& digits, int64_t M, int64_t K) : x(M * K), unit(M) {
    alignas(16) uint8_t lo[16], hi[16];
    for (int v = 0; v < 16; ++v) {
      const int16_t V = (int16_t)std::nearbyint(code[v] * 16384.f);
      lo[v] = (uint8_t)(V & 0xFF), hi[v] = (uint8_t)((uint16_t)V >> 8);
    }
    low = _mm256_broadcastsi128_si256(_mm_load_si128((const __m128i*)lo));
    high = _mm256_broadcastsi128_si256(_mm_load_si128((const __m128i*)hi));
    for (int64_t row = 0; row < M; ++row) unit[row] = digits.scale[row] / 127.f;
    for (int64_t b = 0; b < M * K / 64; ++b)  // word 16 g + 8 lane + i <- value 32 (g / 2) + 8 (g % 2) + 16 lane + i
      for (int g = 0; g < 4; ++g)
        for (int lane = 0; lane < 2; ++lane)
          for (int i = 0; i < 8; ++i) {
            const int64_t from = 64 * b + 32 * (g / 2) + 8 * (g % 2) + 16 * lane + i;
            x[64 * b + 16 * g + 8 * lane + i] = (int16_t)(127 * digits.q1[from] + digits.q2[from]);
          }
  }
};

// A block's 64 codes (32 bytes) as V words in the order X is read: 16 a register
inline void nf4_words(const uint8_t* block, const NF4Words& t, __m256i w[4]) {
  const __m256i b = _mm256_loadu_si256((const __m256i*)block), low4 = _mm256_set1_epi8(15);
  for (int h = 0; h < 2; ++h) {  // codes 0-31 (low nibbles), 32-63 (high)
    const __m256i c = _mm256_and_si256(h ? _mm256_srli_epi16(b, 4) : b, low4);
    const __m256i vl = _mm256_shuffle_epi8(t.low, c), vh = _mm256_shuffle_epi8(t.high, c);
    w[2 * h] = _mm256_unpacklo_epi8(vl, vh), w[2 * h + 1] = _mm256_unpackhi_epi8(vl, vh);
  }
}

// An output's block of 64: each lane's 8 products V X, an exact int32, then acc += that sum absmax
inline __m256 nf4_step(const __m256i w[4], const int16_t* x, __m256 scale, __m256 acc) {
  __m256i sum = _mm256_madd_epi16(w[0], _mm256_loadu_si256((const __m256i*)x));
  for (int i = 1; i < 4; ++i) sum = dot_words(sum, w[i], _mm256_loadu_si256((const __m256i*)(x + 16 * i)));
  return _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), scale, acc);
}

template <int R, int NB>
void nf4_tile(const NF4Words& t, int64_t m0, const uint8_t* q, const float* absmax, int64_t K, float* y, int64_t N,
              int64_t n0) {
  const int64_t G = K / 64;
  const int16_t* X = t.x.data() + m0 * K;
  __m256 acc[R][NB];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NB; ++j) acc[r][j] = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; ++g)
    for (int j = 0; j < NB; ++j) {
      const int64_t n = n0 + j;
      const uint8_t* block = q + n * (K / 2) + g * 32;
      _mm_prefetch((const char*)block + PREFETCH, _MM_HINT_T0);
      __m256i w[4];
      nf4_words(block, t, w);
      const __m256 scale = _mm256_set1_ps(absmax[n * G + g]);
      for (int r = 0; r < R; ++r) acc[r][j] = nf4_step(w, X + r * K + 64 * g, scale, acc[r][j]);
    }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NB; ++j) y[r * N + n0 + j] = hsum(acc[r][j]) * (t.unit[m0 + r] * (1.f / 16384.f));
}

// Past NF4_TILE_ROWS rows of x: tile_gemm in nf4_tile's order (a step L = 64 words: one block), each thread's panel
// of weight rows decoded once a call to V words in X's order; a block 6 rows of x against one weight row (6
// accumulators, 4 weights, a sum, x and absmax: 13 of 16 AVX2 registers). It leaves hsum(acc) in y; nf4_matmul then
// multiplies each row by its unit, as the tile does.
constexpr int NF4_R = 6;
constexpr int64_t NF4_TILE_ROWS = 16;  // (the tiles are faster up to about 20 rows: BENCHMARKS.md)

void nf4_gemm_block(const int16_t* xb, const int16_t* wb, const float* sb, int64_t K, int64_t steps, float* acc,
                    bool first, bool last, float* y, int64_t ldy, int64_t rows) {
  __m256 a[NF4_R];
  for (int r = 0; r < NF4_R; ++r) a[r] = first ? _mm256_setzero_ps() : _mm256_load_ps(acc + 8 * r);
  for (int64_t s = 0; s < steps; ++s, xb += 64 * NF4_R, wb += 64) {  // (x: [step][R][64])
    __m256i w[4];
    for (int i = 0; i < 4; ++i) w[i] = _mm256_loadu_si256((const __m256i*)(wb + 16 * i));
    const __m256 scale = _mm256_set1_ps(sb[s]);
    for (int r = 0; r < NF4_R; ++r) a[r] = nf4_step(w, xb + 64 * r, scale, a[r]);
  }
  for (int r = 0; r < NF4_R; ++r) {
    if (!last) _mm256_store_ps(acc + 8 * r, a[r]);
    else if (r < rows) y[r * ldy] = hsum(a[r]);
  }
}

// y [M, N] = x [M, K] w^T, every M (Digits: the ISA's DigitRows)
template <typename Digits>
void nf4_matmul(const float* xp, const uint8_t* qp, const float* ap, const float* cp, int64_t M, int64_t K, float* yp,
                int64_t N) {
  const NF4Words t(cp, Digits(xp, M, K), M, K);
  if (M > NF4_TILE_ROWS) {  // (a prefill: the same bits)
    const auto panel = [&](int64_t n0, int64_t np) {
      thread_local std::vector<int16_t> decoded;
      int16_t* w = aligned64(decoded, np * K);
      for (int64_t n = 0; n < np; ++n)
        for (int64_t g = 0; g < K / 64; ++g) {
          __m256i v[4];
          nf4_words(qp + (n0 + n) * (K / 2) + g * 32, t, v);
          for (int i = 0; i < 4; ++i) _mm256_store_si256((__m256i*)(w + n * K + 64 * g + 16 * i), v[i]);
        }
      return PanelRows<int16_t>{w, ap + n0 * (K / 64)};
    };
    tile_gemm<64, NF4_R, 1, 1024>(t.x.data(), M, K, yp, N, panel,
                                  [](int64_t, auto... args) { nf4_gemm_block(args...); });
    at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
      for (int64_t m = m0; m < m1; ++m)
        for (int64_t n = 0; n < N; ++n) yp[m * N + n] *= t.unit[m] * (1.f / 16384.f);
    });
    return;
  }
  four_bit_tiles(M, N, K, [&](auto rows, auto weight_rows, int64_t m0, int64_t n0) {
    nf4_tile<decltype(rows)::value, decltype(weight_rows)::value>(t, m0, qp, ap, K, yp + m0 * N, N, n0);
  });
}

// ---- the operators' ATen side, the same on both instruction sets ----------------------------------------------------
// Each file defines, in its own registers, the names declared here: the tiles (y [M, N] = x [M, K] w^T: every M for
// float32, int8, int4 and nf4, up to GEMM_ROWS rows of x for GGUF blocks), the weight rows unpacked into W (bfloat16
// words where the CPU has AVX512-BF16, float32 where it does not: another device's weights, tests) and a GGUF
// prefill. These wrappers check the tensors, take x [..., K] as rows [M, K] and pick the path.
void f32_tiles(const float* x, const float* w, int64_t M, int64_t K, float* y, int64_t N);
void int8_tiles(const float* x, const uint8_t* w, const float* s, int64_t M, int64_t K, float* y, int64_t N);
// y [M, N] = x [M, K] w^T for int4 weights packed in groups (below), every M
void int4_tiles(const float* x, const uint8_t* q, const float* d, const float* mn, int64_t M, int64_t K, float* y,
                int64_t N);
void nf4_tiles(const float* x, const uint8_t* q, const float* absmax, const float* code, int64_t M, int64_t K, float* y,
               int64_t N);
void nf4_rows(const uint8_t* q, const float* absmax, const float* code, int64_t K, int64_t n0, int64_t n1, float* out);
void nf4_rows(const uint8_t* q, const float* absmax, const float* code, int64_t K, int64_t n0, int64_t n1,
              uint16_t* out);
template <int64_t T>
void gguf_tiles(const float* x, int64_t M, const uint8_t* w, int64_t row_bytes, int64_t K, float* y, int64_t N);
template <int64_t T>  // y [M, ldy] (its columns[n] for weight row n; columns null: y [M, N]) = x [M, K] w^T
void gguf_prefill(const at::Tensor& x, const uint8_t* w, int64_t row_bytes, int64_t N, float* y, int64_t ldy,
                  const int64_t* columns);
template <int64_t T, typename Out>
void dequantize_rows(const uint8_t* w, int64_t row_bytes, int64_t N, int64_t K, Out* out);

struct Rows {  // x [..., K] float32 as contiguous rows [M, K]
  at::Tensor t;
  int64_t M, K;
  explicit Rows(const at::Tensor& x) : t(x.reshape({-1, x.size(-1)}).contiguous()), M(t.size(0)), K(t.size(1)) {}
  const float* data() const { return t.data_ptr<float>(); }
};

at::Tensor linear_f32(const at::Tensor& x_, const at::Tensor& w) {
  TORCH_CHECK(x_.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat && w.is_contiguous());
  const Rows x(x_);
  TORCH_CHECK(w.size(1) == x.K, "linear_f32: x has ", x.K, " features, the weight ", w.size(1));
  auto y = output_like(x_, w.size(0));
  f32_tiles(x.data(), w.data_ptr<float>(), x.M, x.K, y.data_ptr<float>(), w.size(0));
  return y;
}

at::Tensor linear_int8(const at::Tensor& x_, const at::Tensor& w, const at::Tensor& s) {
  TORCH_CHECK(x_.scalar_type() == at::kFloat && w.scalar_type() == at::kByte && s.scalar_type() == at::kFloat);
  const Rows x(x_);
  const int64_t N = w.size(0);
  TORCH_CHECK(x.K % 64 == 0 && x.K <= 65536 && w.size(1) == x.K && w.is_contiguous() && s.numel() == N,
              "linear_int8: bad shapes");  // (K <= 65536: the int32 sums cannot overflow)
  auto y = output_like(x_, N);
  int8_tiles(x.data(), w.data_ptr<uint8_t>(), s.data_ptr<float>(), x.M, x.K, y.data_ptr<float>(), N);
  return y;
}

void check_int4(const at::Tensor& q, const at::Tensor& d, const at::Tensor& mn, int64_t K, const char* op) {
  const int64_t N = q.size(0), G = K / 32;
  TORCH_CHECK(q.scalar_type() == at::kByte && d.scalar_type() == at::kFloat && mn.scalar_type() == at::kFloat, op,
              ": codes must be uint8, scales and mins float32");
  TORCH_CHECK(K % 32 == 0 && q.size(1) == K / 2 && d.numel() == N * G && mn.numel() == N * G && q.is_contiguous() &&
              d.is_contiguous() && mn.is_contiguous(), op, ": bad shapes");
}

void check_nf4(const at::Tensor& q, const at::Tensor& absmax, const at::Tensor& code, int64_t K, const char* op) {
  TORCH_CHECK(q.scalar_type() == at::kByte && absmax.scalar_type() == at::kFloat && code.scalar_type() == at::kFloat &&
              code.numel() == 16, op, ": codes must be uint8, absmax and the 16 code values float32");
  const auto values = code.contiguous();  // (kernels_avx2.cpp takes them as 15-bit integers)
  for (int v = 0; v < 16; ++v)
    TORCH_CHECK(std::abs(values.data_ptr<float>()[v]) <= 1.f, op, ": the code values must lie in [-1, 1] (NF4's)");
  TORCH_CHECK(K % 64 == 0 && q.size(1) == K / 2 && absmax.numel() == q.size(0) * K / 64 && q.is_contiguous() &&
              absmax.is_contiguous(), op, ": bad shapes");
}

at::Tensor linear_int4(const at::Tensor& x_, const at::Tensor& q, const at::Tensor& d, const at::Tensor& mn) {
  TORCH_CHECK(x_.scalar_type() == at::kFloat, "linear_int4: x must be float32");
  const Rows x(x_);
  const int64_t N = q.size(0);
  check_int4(q, d, mn, x.K, "linear_int4");
  auto y = output_like(x_, N);
  int4_tiles(x.data(), q.data_ptr<uint8_t>(), d.data_ptr<float>(), mn.data_ptr<float>(), x.M, x.K, y.data_ptr<float>(), N);
  return y;
}

at::Tensor linear_nf4(const at::Tensor& x_, const at::Tensor& q, const at::Tensor& absmax, const at::Tensor& code) {
  TORCH_CHECK(x_.scalar_type() == at::kFloat, "linear_nf4: x must be float32");
  const Rows x(x_);
  const int64_t N = q.size(0), K = x.K;
  check_nf4(q, absmax, code, K, "linear_nf4");
  const auto table = code.contiguous();
  const float *ap = absmax.data_ptr<float>(), *cp = table.data_ptr<float>();
  const uint8_t* qp = q.data_ptr<uint8_t>();
  auto y = output_like(x_, N);
  nf4_tiles(x.data(), qp, ap, cp, x.M, K, y.data_ptr<float>(), N);
  return y;
}

// [N, K] bfloat16 from unpack(n0, n1, rows n0 .. n1 - 1 as W): a CPU model's weights for another device's step, tests
template <typename W, typename Unpack>
at::Tensor unpacked_bf16(int64_t N, int64_t K, const at::TensorOptions& options, Unpack unpack) {
  auto w = at::empty({N, K}, options.dtype(std::is_same_v<W, uint16_t> ? at::kBFloat16 : at::kFloat));
  W* wp = reinterpret_cast<W*>(w.data_ptr());
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) { unpack(n0, n1, wp + n0 * K); });
  return w.to(at::kBFloat16);  // (float32 rounded to nearest even, as vcvtneps2bf16 rounds)
}

at::Tensor dequantize_int4(const at::Tensor& q, const at::Tensor& d, const at::Tensor& mn) {
  const int64_t N = q.size(0), K = q.size(1) * 2, G = K / 32;
  check_int4(q, d, mn, K, "dequantize_int4");
  auto w = at::empty({N, K}, q.options().dtype(at::kBFloat16));
  const uint8_t* qp = q.data_ptr<uint8_t>();
  const float *dp = d.data_ptr<float>(), *mp = mn.data_ptr<float>();
  at::BFloat16* wp = w.data_ptr<at::BFloat16>();
  const __m256i shifts = _mm256_setr_epi32(0, 16, 4, 20, 8, 24, 12, 28), fifteen = _mm256_set1_epi32(15);  // (kernels.h's layout)
  at::parallel_for(0, (N + INT4_LANES - 1) / INT4_LANES, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t n0 = g * INT4_LANES, lanes = std::min(INT4_LANES, N - n0);
      const uint8_t* group = qp + n0 * (K / 2);
      for (int64_t j = 0; j < lanes; ++j)
        for (int64_t c = 0; c < K / 8; ++c) {  // the dword of row j and inputs 8c .. 8c + 7: its 8 codes in order
          uint32_t dword;
          memcpy(&dword, group + (c * lanes + j) * 4, 4);
          const __m256i codes = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32((int)dword), shifts), fifteen);
          const __m256 v = _mm256_fmadd_ps(_mm256_cvtepi32_ps(codes), _mm256_set1_ps(dp[n0 * G + c / 4 * lanes + j]),
                                           _mm256_set1_ps(mp[n0 * G + c / 4 * lanes + j]));
          __m256i bits = _mm256_castps_si256(v);  // to bfloat16, nearest even: + 0x7FFF + the kept lowest bit
          bits = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF),
                                   _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1)))), 16);
          const __m256i words = _mm256_permute4x64_epi64(_mm256_packus_epi32(bits, bits), 0x08);
          _mm_storeu_si128((__m128i*)(wp + (n0 + j) * K + 8 * c), _mm256_castsi256_si128(words));
        }
    }
  });
  return w;
}

template <typename W>
at::Tensor dequantize_nf4(const at::Tensor& q, const at::Tensor& absmax, const at::Tensor& code) {
  const int64_t K = q.size(1) * 2;
  check_nf4(q, absmax, code, K, "dequantize_nf4");
  const auto table = code.contiguous();
  return unpacked_bf16<W>(q.size(0), K, q.options(), [&](int64_t n0, int64_t n1, W* out) {
    nf4_rows(q.data_ptr<uint8_t>(), absmax.data_ptr<float>(), table.data_ptr<float>(), K, n0, n1, out);
  });
}

// y [M, ldy] (columns 0 .. nb - 1) = x [M, K] w^T for a tile of nb float32 weight rows [nb, K], in one thread: each
// output summed in the float32 tiles' own order (a row's bits whatever M)
void f32_rows(const float* x, int64_t M, const float* w, int64_t nb, int64_t K, float* y, int64_t ldy);
// y [M, N] = x [M, K] w^T for Q8_0 rows at float32's precision (each ISA's file): codes widened to float, FMAs
void q8_0_float_tiles(const float* x, int64_t M, const uint8_t* w, int64_t row_bytes, int64_t K, float* y, int64_t N);

// y [M, N] = x [M, K] w^T at float32's precision, for any M: each thread dequantizes F32_ROWS weight rows as gguf does
// (into its cache) and multiplies every row of x by them in float32. The dequantized weights' product as the float
// path computes it (an output head, whose logits x rounded to digits would put 1e-4 from it), the same bits for a row
// whatever rows beside it.
constexpr int64_t F32_ROWS = 16;
template <int64_t T>
void gguf_float_tiles(const float* x, int64_t M, const uint8_t* w, int64_t row_bytes, int64_t K, float* y, int64_t N) {
  if constexpr (T == GQ8_0) {  // (the default model's head: its own tiles widen the codes as they load them)
    q8_0_float_tiles(x, M, w, row_bytes, K, y, N);
    return;
  }
  const int64_t block = std::max<int64_t>(1, (64 << 10) / (F32_ROWS * row_bytes));
  for_each_tile_shared((N + F32_ROWS - 1) / F32_ROWS, block, [&](int64_t t) {
    thread_local std::vector<float> tile;
    tile.resize(F32_ROWS * K);
    const int64_t n0 = t * F32_ROWS, nb = std::min(F32_ROWS, N - n0);
    dequantize_rows<T>(w + n0 * row_bytes, row_bytes, nb, K, tile.data());
    f32_rows(x, M, tile.data(), nb, K, y + n0, N);
  });
}

// Up to this many rows of x a GGUF linear runs the decoding tiles, past it the prefill's (gguf_prefill). Both compute
// the same bits (the orders of sums above), so the switch is where the prefill's tiles get faster: with AVX-512
// K-quants past 4 rows, 32-blocks past 8; with AVX2 past GEMM_ROWS (BENCHMARKS.md).
template <int64_t T>
constexpr int64_t tile_rows() {
#ifdef __AVX512F__
  return T >= GQ4_K ? 4 : 8;
#endif
  return GEMM_ROWS;
}

// y = x w^T for x [..., K] float32 and w [N, bytes] the file's rows of blocks. float_x: x in float32 at every M
// (gguf_float_tiles); else the decoding tiles up to tile_rows() rows, the prefill's x rounded to 8 bits past them
// (both ISAs: integer products)
at::Tensor linear_gguf(const at::Tensor& x_, const at::Tensor& w, int64_t type, bool float_x) {
  TORCH_CHECK(x_.scalar_type() == at::kFloat, "linear_gguf: x must be float32");
  const Rows x(x_);
  const int64_t N = w.size(0), row_bytes = w.size(1);
  check_blocks(w, type, x.K, "linear_gguf");
  TORCH_CHECK(x.K % 16 == 0 && x.K <= 65536, "linear_gguf: ", x.K, " inputs");
  const uint8_t* wp = w.data_ptr<uint8_t>();
  auto y = output_like(x_, N);
  float* yp = y.data_ptr<float>();
  if (float_x) {
    DISPATCH_GGUF(type, (gguf_float_tiles<T>(x.data(), x.M, wp, row_bytes, x.K, yp, N)));
  } else {
    DISPATCH_GGUF(type, (x.M > tile_rows<T>() ? gguf_prefill<T>(x.t, wp, row_bytes, N, yp, N, nullptr)
                                             : gguf_tiles<T>(x.data(), x.M, wp, row_bytes, x.K, yp, N)));
  }
  return y;
}

// out[..., columns[n]] = (x w^T)[..., n]: one part of a fused projection written in place, in the model's order (no
// join of the parts' outputs, no reordering of llama's q/k rows after it). A prefill writes there directly.
void linear_gguf_into(const at::Tensor& x_, const at::Tensor& w, int64_t type, at::Tensor& out, const at::Tensor& columns) {
  check_columns(x_, w, out, columns);
  const Rows x(x_);
  bool tiles = false;
  DISPATCH_GGUF(type, (tiles = x.M <= tile_rows<T>()));
  if (tiles) {
    write_columns(linear_gguf(x_, w, type, false), out, columns);
    return;
  }
  TORCH_CHECK(x.t.scalar_type() == at::kFloat, "linear_gguf_into: x must be float32");
  check_blocks(w, type, x.K, "linear_gguf_into");
  DISPATCH_GGUF(type, (gguf_prefill<T>(x.t, w.data_ptr<uint8_t>(), w.size(1), w.size(0), out.data_ptr<float>(),
                                       out.size(-1), columns.data_ptr<int64_t>())));
}

// y [R, N], y[r] = x[r] w[ids[r]]^T, for x [R, K] float32, w [E, N, bytes] a GGUF file's experts (each its rows of
// blocks, as stored) and ids int64 [R]: llama.cpp's mul_mat_id. The rows that chose one expert are multiplied
// together, its blocks read once for them all; each row's outputs are the bits linear_gguf gives it alone.
at::Tensor linear_gguf_experts(const at::Tensor& x_, const at::Tensor& w, int64_t type, const at::Tensor& ids_) {
  TORCH_CHECK(x_.scalar_type() == at::kFloat && x_.dim() == 2, "linear_gguf_experts: x must be float32 [rows, K]");
  TORCH_CHECK(w.scalar_type() == at::kByte && w.dim() == 3 && w.is_contiguous(),
              "linear_gguf_experts: blocks must be uint8 [experts, N, bytes]");
  TORCH_CHECK(ids_.scalar_type() == at::kLong && ids_.dim() == 1 && ids_.size(0) == x_.size(0),
              "linear_gguf_experts: ids must be int64 [", x_.size(0), "]");
  const auto x = x_.contiguous();
  const auto ids = ids_.contiguous();
  const int64_t R = x.size(0), E = w.size(0);
  auto y = at::empty({R, w.size(1)}, x.options());
  if (R == 0) return y;
  std::vector<std::vector<int64_t>> rows(E);  // expert -> the rows that chose it, in order
  const int64_t* id = ids.data_ptr<int64_t>();
  for (int64_t r = 0; r < R; ++r) {
    TORCH_CHECK(id[r] >= 0 && id[r] < E, "linear_gguf_experts: expert ", id[r], " of ", E);
    rows[id[r]].push_back(r);
  }
  std::vector<int64_t> used;  // the experts chosen, and the most rows one took
  int64_t most = 0;
  for (int64_t e = 0; e < E; ++e) {
    if (!rows[e].empty()) used.push_back(e), most = std::max<int64_t>(most, rows[e].size());
  }
  if (most == R) return linear_gguf(x, w.select(0, used[0]), type, false);  // (every row one expert's)
  auto one = [&](int64_t e) {
    const auto index = at::from_blob(rows[e].data(), {static_cast<int64_t>(rows[e].size())}, ids.options());
    y.index_copy_(0, index, linear_gguf(x.index_select(0, index), w.select(0, e), type, false));
  };
  bool tiles = false;
  DISPATCH_GGUF(type, (tiles = most <= tile_rows<T>()));
  if (tiles) {  // (a decode step's few rows: the experts shared among the threads, each expert's call in one thread,
    // rather than each call shared, a pass of the threads for every expert)
    at::parallel_for(0, static_cast<int64_t>(used.size()), 1, [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; ++i) one(used[i]);
    });
  } else {
    for (int64_t e : used) one(e);
  }
  return y;
}

template <typename W>
at::Tensor dequantize_gguf(const at::Tensor& w, int64_t type, int64_t K, bool bf16) {
  check_blocks(w, type, K, "dequantize_gguf");
  const int64_t N = w.size(0);
  const uint8_t* wp = w.data_ptr<uint8_t>();
  if constexpr (std::is_same_v<W, uint16_t>) {  // bfloat16 words written directly
    if (bf16) {
      auto out = at::empty({N, K}, w.options().dtype(at::kBFloat16));
      DISPATCH_GGUF(type, (dequantize_rows<T>(wp, w.size(1), N, K, reinterpret_cast<uint16_t*>(out.data_ptr()))));
      return out;
    }
  }
  auto out = at::empty({N, K}, w.options().dtype(at::kFloat));
  DISPATCH_GGUF(type, (dequantize_rows<T>(wp, w.size(1), N, K, out.data_ptr<float>())));
  return bf16 ? out.to(at::kBFloat16) : out;
}

}  // namespace

// The operators, declared and implemented (after the including file has defined its tiles), W as above
#define REGISTER_OPS(W)                                    \
  TORCH_LIBRARY(dense_kernels, m) { define_ops(m); }       \
  TORCH_LIBRARY_IMPL(dense_kernels, CPU, m) {              \
    m.impl("linear_f32", &linear_f32);                     \
    m.impl("linear_int8", &linear_int8);                   \
    m.impl("linear_int4", &linear_int4);                   \
    m.impl("attention", &attention);                       \
    m.impl("dequantize_int4", &dequantize_int4);           \
    m.impl("dequantize_nf4", &dequantize_nf4<W>);          \
    m.impl("linear_nf4", &linear_nf4);                     \
    m.impl("linear_gguf", &linear_gguf);                   \
    m.impl("linear_gguf_into", &linear_gguf_into);         \
    m.impl("linear_gguf_experts", &linear_gguf_experts);   \
    m.impl("dequantize_gguf", &dequantize_gguf<W>);        \
  }

inline void define_ops(torch::Library& m) {
  m.def("linear_f32(Tensor x, Tensor w) -> Tensor");
  m.def("linear_int8(Tensor x, Tensor w, Tensor scales) -> Tensor");
  m.def("linear_int4(Tensor x, Tensor q, Tensor d, Tensor m) -> Tensor");
  m.def("attention(Tensor q, Tensor k_t, Tensor v, Tensor pos, Tensor row_start, Tensor rows, float scale, "
        "int window, float softcap, Tensor? k_scale=None, Tensor? v_scale=None) -> Tensor");
  m.def("dequantize_int4(Tensor q, Tensor d, Tensor m) -> Tensor");
  m.def("dequantize_nf4(Tensor q, Tensor absmax, Tensor code) -> Tensor");
  m.def("linear_nf4(Tensor x, Tensor q, Tensor absmax, Tensor code) -> Tensor");
  m.def("linear_gguf(Tensor x, Tensor blocks, int type, bool float_x=False) -> Tensor");
  m.def("linear_gguf_into(Tensor x, Tensor blocks, int type, Tensor(a!) out, Tensor columns) -> ()");
  m.def("linear_gguf_experts(Tensor x, Tensor blocks, int type, Tensor ids) -> Tensor");
  m.def("dequantize_gguf(Tensor blocks, int type, int K, bool bf16) -> Tensor");
}
