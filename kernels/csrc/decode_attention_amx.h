// Decode rows behind a shared prefix on AMX tiles (bfloat16, head_dim 64 or 128, blocks of a
// multiple of 16 tokens): the cascade. Same arguments and result as decode_attention_bf16.h's
// path, within float32 rounding: scores in float32, probabilities rounded to bf16 for the
// weighted sum, sums in float32, rounded once into `out`.
//
// Why: rows that share a long prefix (a system prompt, W2's 1,024 tokens) each read it through
// their own block list, and on a 2-core AMX Xeon decode attention over that prefix was 37 % of
// a step, at vdpbf16ps speed. Every row's queries over the prefix are one GEMM for the scores
// and one for the weighted sum: work for tiles.
//
// In four passes, each split among the threads:
//   1. pack, per kv head: the queries of every row as rows of a tile operand; the prefix's
//      keys as (dimension pair, key) tiles, 16 keys by 32 dimensions; its values as (key pair,
//      dimension) rows, zero past the prefix to a whole 32 keys;
//   2. the prefix's scores, per kv head and 16 queries, 32 keys at a time, into each query's
//      row-long line;
//   3. per (kv head, row): its own blocks' scores (decode_attention_bf16.h's loops), the
//      softmax over the whole line into bf16 probabilities (one pass: the prefix's are pass
//      4's tile operand), its own blocks' weighted sum (unnormalized, float32);
//   4. the prefix's weighted sums, per kv head and 16 queries, 64 dimensions a pass, added to
//      the rows' own and divided by the softmax's sum.
// Tiles: tmm0 the A operand (queries or probabilities), tmm1-3 B operands, tmm4-7 sums.
#pragma once

#include "amx.h"

#ifdef LORAGATE_HAVE_AMX_BF16

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "decode_attention_bf16.h"
#include "prefill_attention_amx.h"  // softmax_weights
#include "simd.h"

namespace loragate {

// Where the cascade pays for its passes: a whole tile of queries over the prefix.
inline bool cascade_on_tiles(int64_t rows, int64_t per_kv, int64_t num_shared, int64_t block_size) {
  return num_shared > 0 && block_size % 16 == 0 && rows * per_kv >= 16 && amx_permitted();
}

// Adds 16 probabilities' rows (tmm0) times key pairs' values for 16 dimensions to sums
// `acc`, the values' tile loaded into `b`.
#define LORAGATE_CASCADE_VALUES(acc, b, values, stride) \
  do {                                                  \
    _tile_loadd(b, (values), (stride));                 \
    _tile_dpbf16ps(acc, 0, b);                          \
  } while (0)

template <int kDim>
void attend_cascade_amx(const at::Tensor& query, const at::Tensor& key_cache,
                        const at::Tensor& value_cache, const int64_t* shared_ids,
                        int64_t num_shared, const at::Tensor& tail_tables,
                        const at::Tensor& seq_lens, float scale, at::Tensor& out) {
  using bf16 = c10::BFloat16;
  constexpr int kVecs = kDim / 16, kChunks = kDim / 32;
  const int64_t rows = query.size(0), heads = query.size(1);
  const int64_t kv_heads = key_cache.size(0), num_blocks = key_cache.size(1);
  const int64_t block_size = key_cache.size(2);
  const int64_t per_kv = heads / kv_heads;
  const int64_t* tails = tail_tables.data_ptr<int64_t>();
  const int64_t tail_width = tail_tables.size(1);
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  const int64_t shared_len = num_shared * block_size;
  int64_t max_len = 0;
  for (int64_t r = 0; r < rows; ++r) {
    TORCH_CHECK(lens[r] >= shared_len, "decode_attention: a row is shorter than its shared prefix");
    max_len = std::max(max_len, lens[r]);
  }
  const int64_t line = max_len / 16 * 16 + 16;  // as attend_bf16's, >= the prefix to 32 keys
  const int64_t nq = rows * per_kv, nq16 = round_up(nq, 16);
  const int64_t key_tiles = shared_len / 16, shared32 = round_up(shared_len, 32);
  // A query's probabilities, the prefix's first (pass 4's tile operand, read to a whole 32
  // keys: the values' pairs past the prefix are zero), then its own blocks'.
  const int64_t line32 = round_up(max_len + 1, 32);

  const bf16* q_base = query.data_ptr<bf16>();
  bf16* o_base = out.data_ptr<bf16>();
  const int64_t q_row = query.stride(0), q_head = query.stride(1);
  const int64_t o_row = out.stride(0), o_head = out.stride(1);
  const int64_t block_elems = block_size * kDim, head_elems = num_blocks * block_elems;
  const bf16* k_base = key_cache.data_ptr<bf16>();
  const bf16* v_base = value_cache.data_ptr<bf16>();

  // The passes' operands, per kv head; the calling thread keeps them between calls.
  thread_local std::vector<bf16> queries, probs;
  thread_local std::vector<uint32_t> keys, values;
  thread_local std::vector<float> scores, own, sums;
  grow(queries, kv_heads * nq16 * kDim);
  grow(keys, kv_heads * key_tiles * kChunks * 256);
  grow(values, kv_heads * shared32 / 2 * kDim);
  grow(scores, kv_heads * nq16 * line);
  grow(probs, kv_heads * nq16 * line32);
  grow(own, kv_heads * nq16 * kDim);
  grow(sums, kv_heads * nq16);
  bf16* qp = queries.data();
  uint32_t* kp = keys.data();
  uint32_t* vp = values.data();
  float* sp = scores.data();
  bf16* pp = probs.data();
  float* op = own.data();
  float* su = sums.data();
  auto shared_block = [&](const bf16* cache, int64_t g, int64_t b) {
    return cache + g * head_elems + shared_ids[b] * block_elems;
  };

  // 1. Pack.
  at::parallel_for(0, kv_heads * (num_shared + 1), 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t g = task / (num_shared + 1), b = task % (num_shared + 1);
      if (b == num_shared) {  // the queries, and the values' zero pairs past the prefix
        bf16* dst = qp + g * nq16 * kDim;
        for (int64_t i = 0; i < nq16; ++i) {
          if (i < nq)
            std::memcpy(dst + i * kDim,
                        q_base + (i / per_kv) * q_row + (g * per_kv + i % per_kv) * q_head,
                        kDim * sizeof(bf16));
          else
            std::fill(dst + i * kDim, dst + (i + 1) * kDim, bf16(0.f));
        }
        uint32_t* vz = vp + g * shared32 / 2 * kDim;
        std::fill(vz + shared_len / 2 * kDim, vz + shared32 / 2 * kDim, 0u);
        continue;
      }
      const auto* k32 = reinterpret_cast<const uint32_t*>(shared_block(k_base, g, b));
      for (int64_t t = 0; t < block_size / 16; ++t) {
        uint32_t* dst = kp + ((g * key_tiles + b * block_size / 16 + t) * kChunks) * 256;
        for (int c = 0; c < kChunks; ++c)
          for (int pair = 0; pair < 16; ++pair)
            for (int j = 0; j < 16; ++j)
              dst[c * 256 + pair * 16 + j] = k32[(t * 16 + j) * (kDim / 2) + c * 16 + pair];
      }
      const bf16* v = shared_block(v_base, g, b);
      uint32_t* dst = vp + (g * shared32 / 2 + b * block_size / 2) * kDim;
      for (int64_t j = 0; j < block_size; j += 2, dst += kDim)
        for (int d = 0; d < kDim; d += 16) {
          const __m512i lo = _mm512_cvtepu16_epi32(
              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v + j * kDim + d)));
          const __m512i hi = _mm512_cvtepu16_epi32(
              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v + (j + 1) * kDim + d)));
          _mm512_storeu_si512(dst + d, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
        }
    }
  });

  // 2. The prefix's scores, unscaled (pass 3 scales every score as it takes its exp).
  const int64_t q_tiles = nq16 / 16;
  at::parallel_for(0, kv_heads * q_tiles, 1, [&](int64_t begin, int64_t end) {
    configure_tiles_16x64();
    for (int64_t task = begin; task < end; ++task) {
      const int64_t g = task / q_tiles, qt = task % q_tiles;
      const bf16* qtile = qp + (g * nq16 + qt * 16) * kDim;
      float* s = sp + (g * nq16 + qt * 16) * line;
      const uint32_t* kg = kp + g * key_tiles * kChunks * 256;
      for (int64_t t = 0; t < key_tiles; t += 2) {
        const bool pair = t + 1 < key_tiles;
        _tile_zero(4);
        _tile_zero(5);
        for (int c = 0; c < kChunks; ++c) {
          _tile_loadd(0, qtile + 32 * c, kDim * sizeof(bf16));
          _tile_loadd(2, kg + (t * kChunks + c) * 256, 64);
          _tile_dpbf16ps(4, 0, 2);
          if (pair) {
            _tile_loadd(3, kg + ((t + 1) * kChunks + c) * 256, 64);
            _tile_dpbf16ps(5, 0, 3);
          }
        }
        _tile_stored(4, s + t * 16, line * sizeof(float));
        if (pair) _tile_stored(5, s + (t + 1) * 16, line * sizeof(float));
      }
    }
    _tile_release();
  });

  // 3. Each row's own blocks, the softmax, its own weighted sum.
  at::parallel_for(0, kv_heads * rows, 1, [&](int64_t begin, int64_t end) {
    thread_local std::vector<__m512bh> q;
    grow(q, per_kv * kChunks);
    __m512i pairs[8 * kVecs];
    for (int64_t task = begin; task < end; ++task) {
      const int64_t g = task / rows, r = task % rows, len = lens[r];
      const int64_t own_len = len - shared_len;
      const int64_t own_blocks = (own_len + block_size - 1) / block_size;
      auto block = [&](const bf16* cache, int64_t b) {
        return cache + g * head_elems + tails[r * tail_width + b] * block_elems;
      };
      const int64_t first = g * nq16 + r * per_kv;  // this row's first query of kv head g
      for (int64_t h = 0; h < per_kv; ++h)
        for (int i = 0; i < kChunks; ++i)
          q[h * kChunks + i] = load_bf16x32(q_base + r * q_row + (g * per_kv + h) * q_head + 32 * i);
      for (int64_t b = 0; b < own_blocks; ++b)
        block_scores16<kDim>(q.data(), per_kv, block(k_base, b),
                             std::min(block_size, own_len - b * block_size), 1.f,
                             sp + first * line + shared_len + b * block_size, line);
      for (int64_t h = 0; h < per_kv; ++h)  // zeros past len: the odd last key's partner
        su[first + h] = softmax_weights(sp + (first + h) * line, pp + (first + h) * line32, len,
                                        line32, scale);
      __m512 acc[kVecs * 4];
      for (int64_t h0 = 0; h0 < per_kv; h0 += 4) {
        const int64_t hn = std::min<int64_t>(4, per_kv - h0);
        for (int i = 0; i < kVecs * 4; ++i) acc[i] = _mm512_setzero_ps();
        for (int64_t b = 0; b < own_blocks; ++b)
          block_values16<kDim>(block(v_base, b), std::min(block_size, own_len - b * block_size),
                               pp + (first + h0) * line32 + shared_len + b * block_size, line32,
                               hn, pairs, acc);
        for (int64_t h = 0; h < hn; ++h) unpermute<kDim>(acc + h * kVecs, op + (first + h0 + h) * kDim);
      }
    }
  });

  // 4. The prefix's weighted sums, added to the rows' own, divided by the sums.
  at::parallel_for(0, kv_heads * q_tiles, 1, [&](int64_t begin, int64_t end) {
    configure_tiles_16x64();
    alignas(64) float weighted[16 * kDim];
    for (int64_t task = begin; task < end; ++task) {
      const int64_t g = task / q_tiles, qt = task % q_tiles;
      const bf16* ptile = pp + (g * nq16 + qt * 16) * line32;
      const uint32_t* vg = vp + g * shared32 / 2 * kDim;
      const int64_t v_stride = kDim * sizeof(uint32_t);
      for (int d = 0; d < kDim; d += 64) {
        _tile_zero(4);
        _tile_zero(5);
        _tile_zero(6);
        _tile_zero(7);
        for (int64_t k = 0; k < shared32; k += 32) {
          _tile_loadd(0, ptile + k, line32 * sizeof(bf16));
          const uint32_t* v = vg + k / 2 * kDim + d;
          LORAGATE_CASCADE_VALUES(4, 1, v, v_stride);
          LORAGATE_CASCADE_VALUES(5, 2, v + 16, v_stride);
          LORAGATE_CASCADE_VALUES(6, 3, v + 32, v_stride);
          LORAGATE_CASCADE_VALUES(7, 1, v + 48, v_stride);
        }
        _tile_stored(4, weighted + d, kDim * sizeof(float));
        _tile_stored(5, weighted + d + 16, kDim * sizeof(float));
        _tile_stored(6, weighted + d + 32, kDim * sizeof(float));
        _tile_stored(7, weighted + d + 48, kDim * sizeof(float));
      }
      for (int64_t i = 0; i < 16 && qt * 16 + i < nq; ++i) {
        const int64_t qi = qt * 16 + i, r = qi / per_kv, h = qi % per_kv;
        const float* mine = op + (g * nq16 + qi) * kDim;
        float* w = weighted + i * kDim;
        for (int d = 0; d < kDim; d += 16)
          _mm512_store_ps(w + d, _mm512_add_ps(_mm512_load_ps(w + d), _mm512_loadu_ps(mine + d)));
        narrow(w, o_base + r * o_row + (g * per_kv + h) * o_head, kDim, su[g * nq16 + qi]);
      }
    }
    _tile_release();
  });
}

}  // namespace loragate

#endif  // LORAGATE_HAVE_AMX_BF16
