// The decode rows' loops of lora.cpp on CPUs with AVX-512 BF16 (vdpbf16ps): same arguments,
// same results within float32 rounding.
//
// Why a path of its own: a decode step with tens of adapters reads each adapter's A and B
// once for a row or two, so the loops do few multiply-adds per byte and the generic 8-lane
// code (widen, multiply, add) was bound by instructions, not by memory: 36 GFLOP/s on a rank-64
// gate/up. Here the shrink's dot products take bf16 pairs 32 at a time (exact products,
// float32 sums, as widening would give; float32 inputs use 16-lane FMAs), and the expand
// keeps 128 columns of a row of y in 16-lane registers across the block's rows of B.
#pragma once

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define LORAGATE_LORA_AVX512 1

#include <immintrin.h>

#include <cstdint>

#include <c10/util/BFloat16.h>

namespace loragate {

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  const __m256i half = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}
inline __m512 load16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 load16(const c10::BFloat16* p, __mmask16 m) {
  const __m256i half = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}

inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
// vcvtneps2bf16 rounds to nearest even, as c10::BFloat16's constructor does.
inline void store16(c10::BFloat16* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), (__m256i)_mm512_cvtneps_pbh(v));
}
inline void store16(float* p, __m512 v, __mmask16 m) { _mm512_mask_storeu_ps(p, m, v); }
inline void store16(c10::BFloat16* p, __m512 v, __mmask16 m) {
  _mm256_mask_storeu_epi16(p, m, (__m256i)_mm512_cvtneps_pbh(v));
}

// x . a over n values, in float32.
inline float dot512(const c10::BFloat16* x, const c10::BFloat16* a, int64_t n) {
  __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 64 <= n; i += 64) {
    acc0 = _mm512_dpbf16_ps(acc0, (__m512bh)_mm512_loadu_si512(x + i),
                            (__m512bh)_mm512_loadu_si512(a + i));
    acc1 = _mm512_dpbf16_ps(acc1, (__m512bh)_mm512_loadu_si512(x + i + 32),
                            (__m512bh)_mm512_loadu_si512(a + i + 32));
  }
  for (; i + 32 <= n; i += 32)
    acc0 = _mm512_dpbf16_ps(acc0, (__m512bh)_mm512_loadu_si512(x + i),
                            (__m512bh)_mm512_loadu_si512(a + i));
  if (i < n) {  // zeros past the end pair with zeros
    const __mmask32 m = static_cast<__mmask32>((1ull << (n - i)) - 1);
    acc1 = _mm512_dpbf16_ps(acc1, (__m512bh)_mm512_maskz_loadu_epi16(m, x + i),
                            (__m512bh)_mm512_maskz_loadu_epi16(m, a + i));
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
}

inline float dot512(const float* x, const float* a, int64_t n) {
  __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    acc0 = _mm512_fmadd_ps(_mm512_loadu_ps(x + i), _mm512_loadu_ps(a + i), acc0);
    acc1 = _mm512_fmadd_ps(_mm512_loadu_ps(x + i + 16), _mm512_loadu_ps(a + i + 16), acc1);
  }
  for (; i + 16 <= n; i += 16)
    acc0 = _mm512_fmadd_ps(_mm512_loadu_ps(x + i), _mm512_loadu_ps(a + i), acc0);
  if (i < n) {
    const __mmask16 m = static_cast<__mmask16>((1u << (n - i)) - 1);
    acc1 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, x + i), _mm512_maskz_loadu_ps(m, a + i), acc1);
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
}

// y[c0:c1] += shrunk[k0:k1] @ b[k0:k1, c0:c1] for one row: `Tiles` vectors of y in registers
// across the block's rows, read and written (rounded) once.
template <int Tiles, typename T>
inline void expand_tile(T* y, const T* b, int64_t out, const float* shrunk, int64_t k0,
                        int64_t k1, int64_t c, __mmask16 last) {
  __m512 acc[Tiles];
  for (int v = 0; v < Tiles - 1; ++v) acc[v] = load16(y + c + 16 * v);
  acc[Tiles - 1] = load16(y + c + 16 * (Tiles - 1), last);
  for (int64_t k = k0; k < k1; ++k) {
    const __m512 w = _mm512_set1_ps(shrunk[k]);
    const T* bk = b + k * out + c;
    for (int v = 0; v < Tiles - 1; ++v) acc[v] = _mm512_fmadd_ps(w, load16(bk + 16 * v), acc[v]);
    acc[Tiles - 1] = _mm512_fmadd_ps(w, load16(bk + 16 * (Tiles - 1), last), acc[Tiles - 1]);
  }
  for (int v = 0; v < Tiles - 1; ++v) store16(y + c + 16 * v, acc[v]);
  store16(y + c + 16 * (Tiles - 1), acc[Tiles - 1], last);
}

template <typename T>
inline void expand_row512(T* y, const T* b, int64_t out, const float* shrunk, int64_t k0,
                          int64_t k1, int64_t c0, int64_t c1) {
  int64_t c = c0;
  for (; c + 128 <= c1; c += 128) expand_tile<8>(y, b, out, shrunk, k0, k1, c, 0xffff);
  for (; c + 16 <= c1; c += 16) expand_tile<1>(y, b, out, shrunk, k0, k1, c, 0xffff);
  if (c < c1) {
    const __mmask16 m = static_cast<__mmask16>((1u << (c1 - c)) - 1);
    expand_tile<1>(y, b, out, shrunk, k0, k1, c, m);
  }
}

}  // namespace loragate

#endif  // __AVX512F__ && __AVX512BF16__
