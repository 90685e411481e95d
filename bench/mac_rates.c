// How many multiply-accumulates one core does per second with the three AVX-512 instructions a quantized CPU kernel
// can build on: float32 FMA (16 products per instruction), bfloat16 pairs (vdpbf16ps, 32) and unsigned x signed
// bytes (vpdpbusd, 64). Twelve independent accumulators, so latency is hidden and only the issue rate counts.
//
//   cc -O2 -march=native bench/mac_rates.c -o /tmp/mac_rates && /tmp/mac_rates
//
// What it says about batching int4 weights (BENCHMARKS.md, issue 14): with activations kept at float32 precision
// every product is one FMA lane, so a batch of rows is bound by the FMA rate however the weights are stored.
#include <immintrin.h>
#include <stdio.h>
#include <time.h>

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

int main(void) {
  enum { ACC = 12 };
  const long steps = 20000000;
  __m512 f[ACC];
  __m512i b[ACC];
  for (int i = 0; i < ACC; ++i) f[i] = _mm512_setzero_ps(), b[i] = _mm512_setzero_si512();
  const __m512 x = _mm512_set1_ps(1.0001f), y = _mm512_set1_ps(0.9999f);
  const __m512bh xh = (__m512bh)_mm512_set1_epi16(0x3f80), yh = (__m512bh)_mm512_set1_epi16(0x3f80);
  const __m512i u = _mm512_set1_epi8(1), s = _mm512_set1_epi8(1);

  double t = now();
  for (long k = 0; k < steps; ++k)
    for (int i = 0; i < ACC; ++i) f[i] = _mm512_fmadd_ps(x, y, f[i]);
  double fma = steps * ACC / (now() - t);
  t = now();
  for (long k = 0; k < steps; ++k)
    for (int i = 0; i < ACC; ++i) f[i] = _mm512_dpbf16_ps(f[i], xh, yh);
  double bf16 = steps * ACC / (now() - t);
  t = now();
  for (long k = 0; k < steps; ++k)
    for (int i = 0; i < ACC; ++i) b[i] = _mm512_dpbusd_epi32(b[i], u, s);
  double int8 = steps * ACC / (now() - t);

  float sink = 0;
  for (int i = 0; i < ACC; ++i) sink += _mm512_reduce_add_ps(f[i]) + (float)_mm512_reduce_add_epi32(b[i]);
  printf("one core, instructions/ns and GMAC/s:\n");
  printf("  float32 FMA        %.2f  %6.1f\n", fma / 1e9, fma * 16 / 1e9);
  printf("  bfloat16 vdpbf16ps %.2f  %6.1f\n", bf16 / 1e9, bf16 * 32 / 1e9);
  printf("  int8 vpdpbusd      %.2f  %6.1f\n", int8 / 1e9, int8 * 64 / 1e9);
  return sink == 42.f;  // keeps the loops alive
}
