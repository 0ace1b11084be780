// The tasks of prefill_attention.cpp on AMX tiles (Sapphire Rapids and later): the same
// packed blocks, the same tasks, the same result within float32 rounding.
//
// Why: a task's two products are GEMMs, (16 queries x head_dim) by (head_dim x 16 keys) for
// the scores and (16 queries x 16 keys) by (16 keys x head_dim) for the weighted sum, and a
// tdpbf16ps does a 16x16x32 product in the time vdpbf16ps does 16x1x32. On a 2-core AMX
// Xeon the AVX-512 BF16 path ran prefill attention at 70-110 GFLOP/s beside 1,400 for a
// bf16 matmul.
//
// The packed layouts of prefill_attention.cpp are already the tiles' operands:
// - keys as (dimension pair, key): rows of sixteen keys' pairs, a B tile of 32 dimensions;
// - values as interleave_pairs lays them out: for a key pair, kDim / 16 rows of sixteen
//   dimensions' pairs; vector c of consecutive pairs, at a stride of kDim / 16 vectors, is a
//   B tile of 16 dimensions (permuted as `unpermute` undoes) over 16 keys.
// A block holds 16 keys or a multiple, so a key tile never straddles two blocks.
//
// Tiles, configured once per worker and call:
//   tmm0-3: the query block's 32-dimension pieces (scores), then the weighted sums' 16
//           dimension pieces (values, 64 dimensions per pass);
//   tmm4: a key tile; tmm5: a tile of scores; tmm6: 16 queries' weights over 16 keys;
//   tmm7: 16 keys' values (8 pairs) for 16 dimensions.
#pragma once

#include "amx.h"

#ifdef LORAGATE_HAVE_AMX_BF16

#include <immintrin.h>

#include <cstdint>
#include <algorithm>
#include <cstring>
#include <limits>

#include <c10/util/BFloat16.h>

#include "simd.h"

namespace loragate {

inline void configure_prefill_tiles() {
  TileConfig config;
  for (int t = 0; t < 6; ++t) {
    config.rows[t] = 16;
    config.colsb[t] = 64;
  }
  config.rows[6] = 16;  // weights: 16 queries x 16 bf16 keys
  config.colsb[6] = 32;
  config.rows[7] = 8;  // values: 8 key pairs x 16 dimensions' pairs
  config.colsb[7] = 64;
  _tile_loadconfig(&config);
}

typedef float vec16 __attribute__((vector_size(64), aligned(4)));
typedef int32_t ivec16 __attribute__((vector_size(64), aligned(4)));

// One query's weights from its n scores, in one pass after the max: p[k] = bf16(e^(scale *
// s[k] - m)) where m is the largest scaled score, p[n..padded) = 0; returns the sum of the
// weights before rounding (what the weighted sum is divided by). Sixteen lanes at a time,
// rounded by vcvtneps2bf16 (to nearest even, as narrow() rounds).
inline float softmax_weights(const float* s, c10::BFloat16* p, int64_t n, int64_t padded,
                             float scale) {
  const __m512 lowest = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512 top = lowest;
  for (int64_t k = 0; k < n; k += 16) {
    const __mmask16 mask = n - k >= 16 ? 0xffff : static_cast<__mmask16>((1u << (n - k)) - 1);
    top = _mm512_max_ps(top, _mm512_mask_loadu_ps(lowest, mask, s + k));
  }
  const __m512 factor = _mm512_set1_ps(scale);
  const __m512 shift = _mm512_set1_ps(-scale * _mm512_reduce_max_ps(top));
  __m512 total = _mm512_setzero_ps();
  for (int64_t k = 0; k < n; k += 16) {
    const __mmask16 mask = n - k >= 16 ? 0xffff : static_cast<__mmask16>((1u << (n - k)) - 1);
    const __m512 x = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(mask, s + k), factor, shift);
    const __m512 e = _mm512_maskz_mov_ps(mask, (__m512)exp_lanes<vec16, ivec16>((vec16)x));
    total = _mm512_add_ps(total, e);
    _mm256_mask_storeu_epi16(p + k, mask, (__m256i)_mm512_cvtneps_pbh(e));
  }
  std::fill(p + n, p + padded, c10::BFloat16(0.f));
  return _mm512_reduce_add_ps(total);
}

}  // namespace loragate

// GCC's tile intrinsics are macros that paste the tile's number into the instruction, so the
// pieces are macros too.
// Adds query piece `piece` (tmm<piece>) times its key tile to the scores in tmm5.
#define LORAGATE_SCORE_PIECE(piece, key_rows) \
  do {                                        \
    _tile_loadd(4, (key_rows), 64);           \
    _tile_dpbf16ps(5, piece, 4);              \
  } while (0)

// Adds 16 keys' weights (tmm6) times their values for 16 dimensions to sums piece `piece`.
#define LORAGATE_VALUE_PIECE(piece, value_rows, stride) \
  do {                                                  \
    _tile_loadd(7, (value_rows), (stride));             \
    _tile_dpbf16ps(piece, 6, 7);                        \
  } while (0)

#endif
