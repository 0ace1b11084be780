// Paged decode attention for bfloat16 caches on CPUs with AVX-512 BF16 (vdpbf16ps): the
// fast path of decode_attention.cpp, same arguments, same result within float32 rounding.
//
// Why a path of its own: the generic kernel widens every key to float32 and ends every
// key's dot product with a horizontal sum, about 70 vector operations per (key, head). Here
// a key's scores come from bf16 pairs multiplied into float32 (exact products, float32
// sums, as widening would give), sixteen keys at a time, and the sixteen accumulators are
// folded into one vector of sixteen scores by a transposing reduction (three operations a
// key instead of a horizontal sum each). Values are interleaved in pairs once per sixteen
// keys, for all the query heads of their kv head. The shared prefix of a group is read
// through each row's own block list (no copy into a GEMM operand): at head_dim 64 the cache
// blocks stay in L2 across the rows of a step.
//
// Each task is one (kv head, row), in one pass over its blocks (online softmax): scores in
// float32, probabilities rounded to bf16 for the weighted sum (as flash attention rounds
// them), sums in float32, rounded once into `out`.
#pragma once

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define LORAGATE_HAVE_AVX512_BF16 1

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "simd.h"

namespace loragate {

// v[j] (sixteen lanes each) -> one vector whose lane j is the sum of v[j]'s lanes.
inline __m512 transpose_sum16(const __m512* v) {
  __m512 pairs[8], quads[4], halves[2];
  for (int i = 0; i < 8; ++i)  // within each 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3]
    pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                             _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i)  // within each 128-bit lane: the sums of four vectors
    quads[i] = _mm512_add_ps(
        _mm512_shuffle_ps(pairs[2 * i], pairs[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
        _mm512_shuffle_ps(pairs[2 * i], pairs[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  for (int i = 0; i < 2; ++i)  // across 128-bit lanes, pairwise
    halves[i] = _mm512_add_ps(
        _mm512_shuffle_f32x4(quads[2 * i], quads[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
        _mm512_shuffle_f32x4(quads[2 * i], quads[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(halves[0], halves[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(halves[0], halves[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

inline __m512bh load_bf16x32(const c10::BFloat16* p) {
  return (__m512bh)_mm512_loadu_si512(reinterpret_cast<const void*>(p));
}

// Lane j: scale * (q . keys[j]) for the n <= 16 keys of [n, kDim] `keys` (0 past n).
template <int kDim>
inline __m512 scores16(const __m512bh* q, const c10::BFloat16* keys, int64_t n, float scale) {
  __m512 acc[16];
  for (int j = 0; j < 16; ++j) {
    __m512 a = _mm512_setzero_ps();
    if (j < n)
      for (int i = 0; i < kDim / 32; ++i)
        a = _mm512_dpbf16_ps(a, q[i], load_bf16x32(keys + j * kDim + 32 * i));
    acc[j] = a;
  }
  return _mm512_mul_ps(transpose_sum16(acc), _mm512_set1_ps(scale));
}

// Keys j and j+1 of a block's values interleaved per dimension, (v[j][d], v[j+1][d]), as
// vdpbf16ps pairs them: `pairs` gets ceil(n / 2) rows of kDim / 16 vectors (a missing
// j+1 is zero). Unpacking works within 128-bit lanes, so the dimensions come out permuted:
// see `unpermute`.
template <int kDim>
inline void interleave_pairs(const c10::BFloat16* values, int64_t n, __m512i* pairs) {
  for (int64_t j = 0; j < n; j += 2, pairs += kDim / 16)
    for (int c = 0; c < kDim / 32; ++c) {
      const __m512i a = _mm512_loadu_si512(values + j * kDim + 32 * c);
      const __m512i b = j + 1 < n ? _mm512_loadu_si512(values + (j + 1) * kDim + 32 * c)
                                  : _mm512_setzero_si512();
      pairs[2 * c] = _mm512_unpacklo_epi16(a, b);
      pairs[2 * c + 1] = _mm512_unpackhi_epi16(a, b);
    }
}

// The weighted sum accumulated over interleaved pairs, back in dimension order: vector 2c
// (unpacklo) holds dims 32c + 8k + i in lane 4k + i, vector 2c + 1 (unpackhi) dims
// 32c + 8k + 4 + i.
template <int kDim>
inline void unpermute(const __m512* acc, float* o) {
  alignas(64) float lanes[kDim];
  for (int i = 0; i < kDim / 16; ++i) _mm512_store_ps(lanes + 16 * i, acc[i]);
  for (int c = 0; c < kDim / 32; ++c)
    for (int k = 0; k < 4; ++k)
      for (int i = 0; i < 4; ++i) {
        o[32 * c + 8 * k + i] = lanes[32 * c + 4 * k + i];
        o[32 * c + 8 * k + 4 + i] = lanes[32 * c + 16 + 4 * k + i];
      }
}

// The scores of `heads` query heads (q: kDim / 32 vectors each) over a block's n keys,
// scaled: head h's at scores + h * line, sixteen keys at a time.
template <int kDim>
inline void block_scores16(const __m512bh* q, int64_t heads, const c10::BFloat16* keys, int64_t n,
                           float scale, float* scores, int64_t line) {
  for (int64_t h = 0; h < heads; ++h)
    for (int64_t j = 0; j < n; j += 16) {
      const int64_t m = std::min<int64_t>(16, n - j);
      _mm512_mask_storeu_ps(scores + h * line + j, static_cast<__mmask16>((1u << m) - 1),
                            scores16<kDim>(q + h * (kDim / 32), keys + j * kDim, m, scale));
    }
}

// acc[h * kDim / 16 ...] += a block's n values weighed by head h's bf16 probabilities (at
// probs + h * line; the odd last key's partner reads as a zero weight), `heads` <= 4 heads,
// sixteen keys at a time interleaved in pairs into `pairs`.
template <int kDim>
inline void block_values16(const c10::BFloat16* values, int64_t n, const c10::BFloat16* probs,
                           int64_t line, int64_t heads, __m512i* pairs, __m512* acc) {
  constexpr int kVecs = kDim / 16;
  for (int64_t j = 0; j < n; j += 16) {
    const int64_t m = std::min<int64_t>(16, n - j);
    interleave_pairs<kDim>(values + j * kDim, m, pairs);
    for (int64_t h = 0; h < heads; ++h) {
      const c10::BFloat16* p = probs + h * line + j;
      for (int64_t t = 0; t < (m + 1) / 2; ++t) {
        uint32_t w;
        __builtin_memcpy(&w, p + 2 * t, sizeof(w));
        const __m512bh weights = (__m512bh)_mm512_set1_epi32(static_cast<int>(w));
        for (int i = 0; i < kVecs; ++i)
          acc[h * kVecs + i] =
              _mm512_dpbf16_ps(acc[h * kVecs + i], weights, (__m512bh)pairs[t * kVecs + i]);
      }
    }
  }
}

// Each task is one (kv head, row), in two streaming passes over the row's blocks: the keys
// (scores of all its query heads into a row-long line each, then the softmax over the
// line), then the values (interleaved in pairs sixteen keys at a time, in registers, and
// weighed by the bf16 probabilities). Neither pass writes anything row-long but the scores.
template <int kDim>
void attend_bf16(const at::Tensor& query, const at::Tensor& key_cache,
                 const at::Tensor& value_cache, const int64_t* shared_ids, int64_t num_shared,
                 const at::Tensor& tail_tables, const at::Tensor& seq_lens, float scale,
                 at::Tensor& out) {
  using bf16 = c10::BFloat16;
  constexpr int kVecs = kDim / 16, kChunks = kDim / 32;
  const int64_t rows = query.size(0), heads = query.size(1);
  const int64_t kv_heads = key_cache.size(0), num_blocks = key_cache.size(1);
  const int64_t block_size = key_cache.size(2);
  const int64_t per_kv = heads / kv_heads;
  const int64_t* tails = tail_tables.data_ptr<int64_t>();
  const int64_t tail_width = tail_tables.size(1);
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  int64_t max_len = 0;
  for (int64_t r = 0; r < rows; ++r) max_len = std::max(max_len, lens[r]);
  // A query head's scores, then its probabilities rounded to bf16, on one line with room
  // for the odd last key's partner (read as a zero weight).
  const int64_t line = max_len / 16 * 16 + 16;

  const bf16* q_base = query.data_ptr<bf16>();
  bf16* o_base = out.data_ptr<bf16>();
  const int64_t q_row = query.stride(0), q_head = query.stride(1);
  const int64_t o_row = out.stride(0), o_head = out.stride(1);
  const int64_t block_elems = block_size * kDim, head_elems = num_blocks * block_elems;
  const bf16* k_base = key_cache.data_ptr<bf16>();
  const bf16* v_base = value_cache.data_ptr<bf16>();
  const int64_t ahead = std::max<int64_t>(1, kPrefetchTokens / block_size);
  const int64_t block_bytes = block_elems * int64_t{sizeof(bf16)};

  at::parallel_for(0, kv_heads * rows, 1, [&](int64_t begin, int64_t end) {
    // Each thread's scratch, kept between calls (a decode step calls this once per layer):
    // grown as rows get longer, never freed.
    thread_local std::vector<float> scores, sums;
    thread_local std::vector<bf16> probs;
    thread_local std::vector<__m512bh> q;
    grow(scores, per_kv * line);
    grow(probs, per_kv * line);
    grow(sums, per_kv);
    grow(q, per_kv * kChunks);
    __m512i pairs[8 * kVecs];  // sixteen keys' values, interleaved in pairs
    alignas(64) float o[kDim];
    for (int64_t task = begin; task < end; ++task) {
      const int64_t g = task / rows, r = task % rows, len = lens[r];
      const int64_t num_row_blocks = (len + block_size - 1) / block_size;
      auto block = [&](const bf16* cache, int64_t b) {
        const int64_t id = b < num_shared ? shared_ids[b] : tails[r * tail_width + b - num_shared];
        return cache + g * head_elems + id * block_elems;
      };
      // fn(the block's first key or value, its first position, its tokens in use), with the
      // block `ahead` of it on its way into L2.
      auto stream = [&](const bf16* cache, auto&& fn) {
        for (int64_t b = 0; b < std::min(ahead, num_row_blocks); ++b)
          prefetch_to_l2(block(cache, b), block_bytes);
        for (int64_t b = 0; b < num_row_blocks; ++b) {
          if (b + ahead < num_row_blocks) prefetch_to_l2(block(cache, b + ahead), block_bytes);
          fn(block(cache, b), b * block_size, std::min(block_size, len - b * block_size));
        }
      };
      for (int64_t h = 0; h < per_kv; ++h)
        for (int i = 0; i < kChunks; ++i)
          q[h * kChunks + i] =
              load_bf16x32(q_base + r * q_row + (g * per_kv + h) * q_head + 32 * i);
      stream(k_base, [&](const bf16* keys, int64_t pos, int64_t n) {
        block_scores16<kDim>(q.data(), per_kv, keys, n, scale, scores.data() + pos, line);
      });
      for (int64_t h = 0; h < per_kv; ++h) {
        float* s = scores.data() + h * line;
        sums[h] = exp_shifted(s, len, max_of(s, len));
        bf16* p = probs.data() + h * line;
        narrow(s, p, len);
        p[len] = bf16(0.f);  // the odd last key's partner (its values are zero too)
      }
      __m512 acc[kVecs * 4];  // per_kv <= 4 query heads a kv head in registers, else in turns
      for (int64_t h0 = 0; h0 < per_kv; h0 += 4) {
        const int64_t hn = std::min<int64_t>(4, per_kv - h0);
        for (int i = 0; i < kVecs * 4; ++i) acc[i] = _mm512_setzero_ps();
        stream(v_base, [&](const bf16* values, int64_t pos, int64_t n) {
          block_values16<kDim>(values, n, probs.data() + h0 * line + pos, line, hn, pairs, acc);
        });
        for (int64_t h = 0; h < hn; ++h) {
          unpermute<kDim>(acc + h * kVecs, o);
          narrow(o, o_base + r * o_row + (g * per_kv + h0 + h) * o_head, kDim, sums[h0 + h]);
        }
      }
    }
  });
}

}  // namespace loragate

#endif  // __AVX512F__ && __AVX512BF16__
