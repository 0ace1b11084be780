// Small SIMD helpers shared by the CPU kernels: 8-lane float vectors with GCC/Clang's vector
// extensions (one AVX register; pairs of SSE registers where there is no AVX), loads and
// stores that need no alignment, and the dot product and row update every kernel uses.
#pragma once

#include <cstdint>

namespace loragate {

typedef float vec8 __attribute__((vector_size(32), aligned(4)));
typedef int32_t ivec8 __attribute__((vector_size(32), aligned(4)));

inline vec8 load8(const float* p) {
  vec8 v;
  __builtin_memcpy(&v, p, sizeof(v));
  return v;
}

inline void store8(float* p, vec8 v) { __builtin_memcpy(p, &v, sizeof(v)); }

inline float hsum(vec8 v) {
  return ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7]));
}

// Four independent accumulators: one dot product's FMAs do not wait on each other.
inline float dot(const float* a, const float* b, int64_t n) {
  vec8 acc[4] = {};
  int64_t i = 0;
  for (; i + 32 <= n; i += 32)
    for (int k = 0; k < 4; ++k) acc[k] += load8(a + i + 8 * k) * load8(b + i + 8 * k);
  float total = hsum((acc[0] + acc[1]) + (acc[2] + acc[3]));
  for (; i < n; ++i) total += a[i] * b[i];
  return total;
}

// y += a * x
inline void axpy(float* y, const float* x, float a, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] += a * x[i];
}

}  // namespace loragate
