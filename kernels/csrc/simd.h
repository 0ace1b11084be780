// Small SIMD helpers shared by the CPU kernels: 8-lane float vectors with GCC/Clang's vector
// extensions (one AVX register; pairs of SSE registers where there is no AVX), loads and
// stores that need no alignment, the dot product and row update every kernel uses, and the
// softmax's vectorized exp and max.
//
// Every load widens to float32 and every store rounds from it, so a kernel templated on its
// storage type (float or c10::BFloat16) computes in float32 either way: a bf16 value is the
// top half of a float's bits, widened by a shift; stores round to nearest even, as torch's.
#pragma once

#include <c10/util/BFloat16.h>

#ifdef __AVX2__
#include <immintrin.h>
#endif

#include <cmath>
#include <cstdint>
#include <limits>
#include <algorithm>
#include <type_traits>

namespace loragate {

typedef float vec8 __attribute__((vector_size(32), aligned(4)));
typedef int32_t ivec8 __attribute__((vector_size(32), aligned(4)));
typedef uint16_t u16vec8 __attribute__((vector_size(16), aligned(2)));
typedef uint32_t u32vec8 __attribute__((vector_size(32), aligned(4)));

// Loads and stores go through these under-aligned, may-alias twins of the vector types: one
// unaligned vector move each. A __builtin_memcpy of 32 bytes is not one: GCC expands it by
// pieces no wider than -mmove-max, which its Zen tunings set to 128 bits where AVX-512 is
// off, and the vectors then went through the stack in halves (every kernel 6-10x slower on
// an AVX2 build, issue 43).
typedef float vec8_mem __attribute__((vector_size(32), aligned(4), may_alias));
typedef int32_t ivec8_mem __attribute__((vector_size(32), aligned(4), may_alias));
typedef uint16_t u16vec8_mem __attribute__((vector_size(16), aligned(2), may_alias));

inline vec8 load8(const float* p) { return *reinterpret_cast<const vec8_mem*>(p); }

inline void store8(float* p, vec8 v) { *reinterpret_cast<vec8_mem*>(p) = v; }

inline vec8 load8(const c10::BFloat16* p) {
#ifdef __AVX2__
  // One widening load: GCC's generic conversion below splits it into 128-bit halves.
  const __m256i bits = _mm256_slli_epi32(
      _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16);
  return (vec8)_mm256_castsi256_ps(bits);
#else
  const u16vec8 half = *reinterpret_cast<const u16vec8_mem*>(p);
  return (vec8)(__builtin_convertvector(half, u32vec8) << 16);
#endif
}

// Round to nearest even (NaN kept a NaN), as c10::BFloat16's constructor does per value.
inline void store8(c10::BFloat16* p, vec8 v) {
  const u32vec8 bits = (u32vec8)v;
  const u32vec8 rounded = (bits + (0x7fffu + ((bits >> 16) & 1u))) >> 16;
  const u32vec8 is_nan = (u32vec8)(v != v);
  const u32vec8 out = (rounded & ~is_nan) | (0x7fc0u & is_nan);
  *reinterpret_cast<u16vec8_mem*>(p) = __builtin_convertvector(out, u16vec8);
}

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) { return static_cast<float>(x); }

// v rounded to T's precision and back: what storing as T and reading it again yields.
template <typename T>
inline vec8 round_as(vec8 v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else {
    T tmp[8];
    store8(tmp, v);
    return load8(tmp);
  }
}

// dst[i] = src[i] * scale, widened to float32.
template <typename T>
inline void widen(const T* src, float* dst, int64_t n, float scale = 1.f) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) store8(dst + i, load8(src + i) * scale);
  for (; i < n; ++i) dst[i] = to_float(src[i]) * scale;
}

// dst[i] = src[i] / divisor, rounded to T.
template <typename T>
inline void narrow(const float* src, T* dst, int64_t n, float divisor = 1.f) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) store8(dst + i, load8(src + i) / divisor);
  for (; i < n; ++i) dst[i] = static_cast<T>(src[i] / divisor);
}

inline float hsum(vec8 v) {
  return ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7]));
}

// Four independent accumulators: one dot product's FMAs do not wait on each other.
template <typename A, typename B>
inline float dot(const A* a, const B* b, int64_t n) {
  vec8 acc[4] = {};
  int64_t i = 0;
  for (; i + 32 <= n; i += 32)
    for (int k = 0; k < 4; ++k) acc[k] += load8(a + i + 8 * k) * load8(b + i + 8 * k);
  float total = hsum((acc[0] + acc[1]) + (acc[2] + acc[3]));
  for (; i < n; ++i) total += to_float(a[i]) * to_float(b[i]);
  return total;
}

// y += a * x
template <typename T>
inline void axpy(float* y, const T* x, float a, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] += a * to_float(x[i]);
}

// e^x lane by lane (V: a float vector, IV: the int32 vector of as many lanes): Cephes' expf
// (range reduction by ln 2 in two parts, a degree-6 polynomial, the exponent put back into
// the float's bits); within 2 ulp of expf over the range softmax uses (x <= 0). Scalar expf
// was most of a long row's attention.
template <typename V, typename IV>
inline V exp_lanes(V x) {
  const V lo = x < -87.33654f;  // e^x underflows: the result is forced to 0 below
  x = x < -87.33654f ? -87.33654f : x;
  x = x > 88.3762626647949f ? 88.3762626647949f : x;
  const V fx = x * 1.44269504088896341f + 0.5f;
  IV n = __builtin_convertvector(fx, IV);  // toward zero; floor below
  n -= (IV)(__builtin_convertvector(n, V) > fx) & 1;
  const V nf = __builtin_convertvector(n, V);
  const V r = x - nf * 0.693359375f + nf * 2.12194440e-4f;
  V p = r * 1.9875691500E-4f + 1.3981999507E-3f;
  p = p * r + 8.3334519073E-3f;
  p = p * r + 4.1665795894E-2f;
  p = p * r + 1.6666665459E-1f;
  p = p * r + 5.0000001201E-1f;
  p = p * r * r + r + 1.0f;
  const V scale = (V)((n + 127) << 23);  // 2^n, put together in the float's bits
  const V result = p * scale;
  return (V)((IV)result & ~(IV)lo);
}

inline vec8 exp8(vec8 x) { return exp_lanes<vec8, ivec8>(x); }

// s[t] = e^(s[t] - m) for t < n; returns their sum.
inline float exp_shifted(float* s, int64_t n, float m) {
  vec8 acc = {};
  int64_t t = 0;
  for (; t + 8 <= n; t += 8) {
    const vec8 v = exp8(load8(s + t) - m);
    store8(s + t, v);
    acc += v;
  }
  float sum = hsum(acc);
  for (; t < n; ++t) {
    s[t] = std::exp(s[t] - m);
    sum += s[t];
  }
  return sum;
}

inline float max_of(const float* s, int64_t n) {
  float m = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : m)
  for (int64_t t = 0; t < n; ++t) m = std::max(m, s[t]);
  return m;
}

// The cache lines of [p, p + bytes) asked into L2 (prefetcht1): KV blocks a kernel reads next.
// A row's blocks lie anywhere in the pool (sequences that grow together interleave theirs),
// so the hardware's stream prefetcher sees one 2-4 KiB run at a time and a kernel otherwise
// waits on each block's first lines from L3 or DRAM.
//
// Decode attention asks for the block kPrefetchTokens ahead of the one it reads. With the keys
// and the values each streamed once (no row-long copy of the values), two blocks of 16 ahead
// took 16 rows of 1,000 bf16 keys from 0.9 to 0.5 ms a layer on Zen 4 (the demo model's
// heads; into L1, or further ahead, gained less).
constexpr int64_t kPrefetchTokens = 32;

inline void prefetch_to_l2(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(c + off, 0, 2);
}

// Scratch kept between calls: `v` holds at least n elements (grown, never shrunk or freed).
template <typename V>
inline void grow(V& v, size_t n) {
  if (v.size() < n) v.resize(n);
}

}  // namespace loragate
