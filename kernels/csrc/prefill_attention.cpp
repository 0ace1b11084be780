// Paged prefill attention for bfloat16 caches on CPUs with AVX-512 BF16: every prefill row
// of a step (a fresh prompt, a chunk after cached context, a recompute) in one call, its
// queries attending causally over its keys read through its block table.
//
// Matches kernels/attention.py's prefill paths (the specification) as flash attention in
// bf16 does: scores are float32 sums of exact bf16 products, the softmax is float32, the
// probabilities that weigh the values are rounded to bf16, the weighted sum is float32 and
// is rounded once into `out`.
//
// Why it exists: torch's CPU flash attention runs these shapes (head_dim 64, a few hundred
// queries per row) at a fraction of the bf16 GEMM rate, and a chunk behind a long cached
// prefix (a shared system prompt) is attended one row at a time. Here:
// - Each cache block a step reads is packed once per kv head, however many rows share it:
//   keys transposed to (dimension pair, key) so that vdpbf16ps scores sixteen keys per
//   instruction with no horizontal sums, values interleaved in key pairs for P @ V.
// - Each task is (row, kv head, 16 of the row's tokens): the scores of its queries (all the
//   kv head's query heads) over the keys each may see, a two-pass softmax over them, the
//   weighted sum in registers.
//
// meta[r] = (query_start, query_len, seq_len): row r's queries are rows query_start ..
// query_start + query_len of `query` ([tokens, heads, head_dim]) at positions seq_len -
// query_len ..; block_tables[r] lists its blocks.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "decode_attention_bf16.h"
#include "prefill_attention_amx.h"
#include "simd.h"

namespace {

#ifdef LORAGATE_HAVE_AVX512_BF16
using namespace loragate;
using bf16 = c10::BFloat16;

constexpr int64_t kKeyTile = 16;  // keys per vdpbf16ps score vector
constexpr int64_t kTokensPerTask = 16;
constexpr int kQueryTile = 8;  // query vectors scored together (one key load feeds eight)

// 16 rows of 16 int32 -> their transpose, in place.
inline void transpose16x16(__m512i* r) {
  __m512i t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int a = 0; a < 4; ++a) {  // r[4a + c] lane L: rows 4a..4a+3, element 4L + c
    r[4 * a] = _mm512_unpacklo_epi64(t[4 * a], t[4 * a + 2]);
    r[4 * a + 1] = _mm512_unpackhi_epi64(t[4 * a], t[4 * a + 2]);
    r[4 * a + 2] = _mm512_unpacklo_epi64(t[4 * a + 1], t[4 * a + 3]);
    r[4 * a + 3] = _mm512_unpackhi_epi64(t[4 * a + 1], t[4 * a + 3]);
  }
  for (int c = 0; c < 4; ++c) {
    t[c] = _mm512_shuffle_i32x4(r[c], r[4 + c], _MM_SHUFFLE(1, 0, 1, 0));
    t[4 + c] = _mm512_shuffle_i32x4(r[c], r[4 + c], _MM_SHUFFLE(3, 2, 3, 2));
    t[8 + c] = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], _MM_SHUFFLE(1, 0, 1, 0));
    t[12 + c] = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int c = 0; c < 4; ++c) {
    r[c] = _mm512_shuffle_i32x4(t[c], t[8 + c], _MM_SHUFFLE(2, 0, 2, 0));
    r[4 + c] = _mm512_shuffle_i32x4(t[c], t[8 + c], _MM_SHUFFLE(3, 1, 3, 1));
    r[8 + c] = _mm512_shuffle_i32x4(t[4 + c], t[12 + c], _MM_SHUFFLE(2, 0, 2, 0));
    r[12 + c] = _mm512_shuffle_i32x4(t[4 + c], t[12 + c], _MM_SHUFFLE(3, 1, 3, 1));
  }
}

// One block's keys as [tiles][kDim / 2][16] dimension pairs (key j of a tile in lane j) and
// its values as interleave_pairs lays them out; keys past `n` are zero.
template <int kDim>
void pack_block(const bf16* keys, const bf16* values, int64_t n, int64_t block_size,
                __m512i* packed_keys, __m512i* packed_values) {
  for (int64_t tile = 0; tile < block_size; tile += kKeyTile) {
    for (int half = 0; half < kDim / 32; ++half) {  // 16 of the kDim / 2 pairs at a time
      __m512i r[16];
      for (int j = 0; j < 16; ++j)
        r[j] = tile + j < n ? _mm512_loadu_si512(keys + (tile + j) * kDim + 32 * half)
                            : _mm512_setzero_si512();
      transpose16x16(r);
      for (int p = 0; p < 16; ++p) packed_keys[(tile / kKeyTile) * (kDim / 2) + 16 * half + p] = r[p];
    }
  }
  std::fill(packed_values, packed_values + (block_size / 2) * (kDim / 16), _mm512_setzero_si512());
  interleave_pairs<kDim>(values, n, packed_values);
}

// What the tasks of one call share: the rows, the packed blocks, the queries and outputs.
struct PackedStep {
  const int64_t* meta;  // [rows, 3]: query_start, query_len, seq_len
  const int64_t* tables;
  int64_t width;  // a block table's length
  int64_t block_size;
  int64_t per_kv;  // query heads per kv head
  int64_t kv_heads;
  int64_t row_tasks;  // tasks per kv head
  const int64_t* task_row;
  const int64_t* task_token;
  const int64_t* slot;  // block id -> its packed slot
  const __m512i* keys_packed;
  const __m512i* values_packed;
  int64_t keys_per_head, values_per_head;  // vectors of a kv head's packed blocks
  int64_t key_vectors, value_vectors;      // vectors of one packed block
  const bf16* q_base;
  int64_t q_row, q_head;
  bf16* o_base;
  int64_t o_row, o_head;
  int64_t line;  // a query's scores, padded to whole key tiles
  float scale;

  // Task i: kv head g, row `row`, `tokens` of its queries from its token `first`.
  struct Task {
    int64_t g, row, first, tokens, query_start, context;
    const __m512i* keys;  // the kv head's packed blocks
    const __m512i* values;
  };

  Task task(int64_t i) const {
    const int64_t g = i / row_tasks, r = task_row[i % row_tasks], first = task_token[i % row_tasks];
    const int64_t query_start = meta[3 * r], query_len = meta[3 * r + 1], seq_len = meta[3 * r + 2];
    return {g,           r,
            first,       std::min(kTokensPerTask, query_len - first),
            query_start, seq_len - query_len,
            keys_packed + g * keys_per_head,
            values_packed + g * values_per_head};
  }
  // The packed slot of the block holding row r's key `pos`.
  int64_t block(int64_t r, int64_t pos) const { return slot[tables[r * width + pos / block_size]]; }
  // Query vector q of a task: token first + q / per_kv, head g * per_kv + q % per_kv.
  const bf16* query(const Task& t, int64_t q) const {
    return q_base + (t.query_start + t.first + q / per_kv) * q_row + (t.g * per_kv + q % per_kv) * q_head;
  }
  bf16* output(const Task& t, int64_t q) const {
    return o_base + (t.query_start + t.first + q / per_kv) * o_row + (t.g * per_kv + q % per_kv) * o_head;
  }
  // Causal: query q sees the keys up to its own position.
  int64_t limit(const Task& t, int64_t q) const { return t.context + t.first + q / per_kv + 1; }
};

// The tasks on AVX-512 BF16: vdpbf16ps scores kQueryTile queries against sixteen keys at a
// time and sums kValueTile queries' weighted values in registers.
template <int kDim>
void attend_tasks(const PackedStep& st) {
  const int64_t line = st.line;
  constexpr int kValueTile = 256 / kDim;  // query vectors whose sums stay in 16 registers

  at::parallel_for(0, st.kv_heads * st.row_tasks, 1, [&](int64_t begin, int64_t end) {
    thread_local std::vector<float> scores;
    thread_local std::vector<bf16> probs;
    grow(scores, kQueryTile * line);
    grow(probs, kQueryTile * line);
    float sums[kQueryTile];
    alignas(64) float o[kDim];
    for (int64_t task = begin; task < end; ++task) {
      const PackedStep::Task t = st.task(task);
      const int64_t r = t.row;
      auto packed_block = [&](int64_t pos) { return st.block(r, pos); };

      // Query vector i of the task: token first + i / per_kv, head g * per_kv + i % per_kv.
      const int64_t num_queries = t.tokens * st.per_kv;
      for (int64_t q0 = 0; q0 < num_queries; q0 += kQueryTile) {
        const int tile = static_cast<int>(std::min<int64_t>(kQueryTile, num_queries - q0));
        const uint32_t* qp[kQueryTile];
        int64_t limit[kQueryTile];
        // A short last tile repeats its last query: the loops below keep whole tiles in
        // registers, and only the tile's own queries are written out.
        for (int i = 0; i < kQueryTile; ++i) {
          const int64_t q = q0 + std::min(i, tile - 1);
          qp[i] = reinterpret_cast<const uint32_t*>(st.query(t, q));
          limit[i] = st.limit(t, q);
        }
        const int64_t most = limit[kQueryTile - 1];
        for (int64_t pos = 0; pos < most; pos += kKeyTile) {
          const __m512i* kt = t.keys + packed_block(pos) * st.key_vectors +
                              ((pos % st.block_size) / kKeyTile) * (kDim / 2);
          __m512 acc[kQueryTile];
          for (int i = 0; i < kQueryTile; ++i) acc[i] = _mm512_setzero_ps();
          for (int p = 0; p < kDim / 2; ++p) {
            const __m512bh k = (__m512bh)kt[p];
            for (int i = 0; i < kQueryTile; ++i)
              acc[i] = _mm512_dpbf16_ps(acc[i], (__m512bh)_mm512_set1_epi32(qp[i][p]), k);
          }
          for (int i = 0; i < kQueryTile; ++i)
            _mm512_storeu_ps(scores.data() + i * line + pos,
                             _mm512_mul_ps(acc[i], _mm512_set1_ps(st.scale)));
        }
        for (int i = 0; i < tile; ++i) {
          float* s = scores.data() + i * line;
          sums[i] = exp_shifted(s, limit[i], max_of(s, limit[i]));
          bf16* p = probs.data() + i * line;
          narrow(s, p, limit[i]);
          std::fill(p + limit[i], p + most + 2, bf16(0.f));  // keys it may not see weigh 0
        }
        for (int v0 = 0; v0 < tile; v0 += kValueTile) {
          const int vt = std::min(kValueTile, tile - v0);
          const int64_t pairs = (limit[v0 + vt - 1] + 1) / 2;
          __m512 acc[kValueTile][kDim / 16];
          for (int i = 0; i < kValueTile; ++i)
            for (int c = 0; c < kDim / 16; ++c) acc[i][c] = _mm512_setzero_ps();
          for (int64_t u = 0; u < pairs; ++u) {
            const int64_t pos = 2 * u;
            const __m512i* vp = t.values + packed_block(pos) * st.value_vectors +
                                ((pos % st.block_size) / 2) * (kDim / 16);
            __m512bh w[kValueTile];
            for (int i = 0; i < kValueTile; ++i) {
              uint32_t pair;
              const int64_t q = v0 + std::min(i, vt - 1);
              __builtin_memcpy(&pair, probs.data() + q * line + pos, sizeof(pair));
              w[i] = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
            }
            for (int c = 0; c < kDim / 16; ++c) {
              const __m512bh v = (__m512bh)vp[c];
              for (int i = 0; i < kValueTile; ++i) acc[i][c] = _mm512_dpbf16_ps(acc[i][c], w[i], v);
            }
          }
          for (int i = 0; i < vt; ++i) {
            unpermute<kDim>(acc[i], o);
            narrow(o, st.output(t, q0 + v0 + i), kDim, sums[v0 + i]);
          }
        }
      }
    }
  });
}
#ifdef LORAGATE_HAVE_AMX_BF16
// The tasks on AMX tiles (prefill_attention_amx.h): 16 queries at a time, their scores over
// 16 keys a tile, their weighted sums over 16 keys a tile, 64 dimensions a pass.
template <int kDim>
void attend_tasks_amx(const PackedStep& st) {
  static_assert(kDim == 64 || kDim == 128, "query pieces live in tmm0-3");
  constexpr int kRows = 16;  // queries per tile
  const int64_t line = st.line;
  at::parallel_for(0, st.kv_heads * st.row_tasks, 1, [&](int64_t begin, int64_t end) {
    configure_prefill_tiles();
    thread_local std::vector<float> scores;
    thread_local std::vector<bf16> probs;
    grow(scores, kRows * line);
    grow(probs, kRows * line);
    alignas(64) bf16 queries[kRows * kDim];
    alignas(64) float weighted[kRows * kDim];
    alignas(64) float o[kDim];
    float sums[kRows];
    int64_t limit[kRows];
    for (int64_t task = begin; task < end; ++task) {
      const PackedStep::Task t = st.task(task);
      const int64_t num_queries = t.tokens * st.per_kv;
      for (int64_t q0 = 0; q0 < num_queries; q0 += kRows) {
        const int tile = static_cast<int>(std::min<int64_t>(kRows, num_queries - q0));
        // A short last tile repeats its last query; only the tile's own are written out.
        for (int i = 0; i < kRows; ++i) {
          const int64_t q = q0 + std::min(i, tile - 1);
          std::memcpy(queries + i * kDim, st.query(t, q), kDim * sizeof(bf16));
          limit[i] = st.limit(t, q);
        }
        const int64_t most = limit[tile - 1];
        const int64_t padded = (most + kKeyTile - 1) / kKeyTile * kKeyTile;

        _tile_loadd(0, queries, kDim * sizeof(bf16));
        _tile_loadd(1, queries + 32, kDim * sizeof(bf16));
        if constexpr (kDim == 128) {
          _tile_loadd(2, queries + 64, kDim * sizeof(bf16));
          _tile_loadd(3, queries + 96, kDim * sizeof(bf16));
        }
        for (int64_t pos = 0; pos < most; pos += kKeyTile) {
          const __m512i* kt = t.keys + st.block(t.row, pos) * st.key_vectors +
                              ((pos % st.block_size) / kKeyTile) * (kDim / 2);
          _tile_zero(5);
          LORAGATE_SCORE_PIECE(0, kt);
          LORAGATE_SCORE_PIECE(1, kt + 16);
          if constexpr (kDim == 128) {
            LORAGATE_SCORE_PIECE(2, kt + 32);
            LORAGATE_SCORE_PIECE(3, kt + 48);
          }
          _tile_stored(5, scores.data() + pos, line * sizeof(float));
        }

        for (int i = 0; i < kRows; ++i) {
          bf16* p = probs.data() + i * line;
          if (i >= tile) {  // a repeated query weighs nothing into the tile's sums
            std::fill(p, p + padded, bf16(0.f));
            continue;
          }
          // Keys it may not see weigh 0.
          sums[i] = softmax_weights(scores.data() + i * line, p, limit[i], padded, st.scale);
        }

        const int64_t value_stride = (kDim / 16) * sizeof(__m512i);  // one key pair to the next
        for (int half = 0; half < kDim / 64; ++half) {
          _tile_zero(0);
          _tile_zero(1);
          _tile_zero(2);
          _tile_zero(3);
          for (int64_t pos = 0; pos < most; pos += kKeyTile) {
            _tile_loadd(6, probs.data() + pos, line * sizeof(bf16));
            const __m512i* vp = t.values + st.block(t.row, pos) * st.value_vectors +
                                ((pos % st.block_size) / 2) * (kDim / 16) + 4 * half;
            LORAGATE_VALUE_PIECE(0, vp, value_stride);
            LORAGATE_VALUE_PIECE(1, vp + 1, value_stride);
            LORAGATE_VALUE_PIECE(2, vp + 2, value_stride);
            LORAGATE_VALUE_PIECE(3, vp + 3, value_stride);
          }
          float* w = weighted + 64 * half;
          _tile_stored(0, w, kDim * sizeof(float));
          _tile_stored(1, w + 16, kDim * sizeof(float));
          _tile_stored(2, w + 32, kDim * sizeof(float));
          _tile_stored(3, w + 48, kDim * sizeof(float));
        }
        for (int i = 0; i < tile; ++i) {
          unpermute<kDim>(reinterpret_cast<const __m512*>(weighted + i * kDim), o);
          narrow(o, st.output(t, q0 + i), kDim, sums[i]);
        }
      }
    }
    _tile_release();
  });
}
#endif  // LORAGATE_HAVE_AMX_BF16

template <int kDim>
void attend(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
            const at::Tensor& block_tables, const at::Tensor& meta, float scale,
            at::Tensor& out) {
  const int64_t rows = meta.size(0), heads = query.size(1);
  const int64_t kv_heads = key_cache.size(0), num_blocks = key_cache.size(1);
  const int64_t block_size = key_cache.size(2);
  const int64_t per_kv = heads / kv_heads;
  const int64_t* m = meta.data_ptr<int64_t>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t width = block_tables.size(1);

  // Every block the step reads, packed once per kv head; its valid length is the longest
  // any row gives it (only full blocks are shared, so rows agree on what they can see).
  thread_local std::vector<int64_t> slot_of;
  slot_of.assign(num_blocks, -1);
  std::vector<int64_t> packed_ids, packed_lens;
  int64_t max_len = 0;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t seq_len = m[3 * r + 2];
    max_len = std::max(max_len, seq_len);
    for (int64_t b = 0; b * block_size < seq_len; ++b) {
      const int64_t id = tables[r * width + b], n = std::min(block_size, seq_len - b * block_size);
      if (slot_of[id] < 0) {
        slot_of[id] = static_cast<int64_t>(packed_ids.size());
        packed_ids.push_back(id);
        packed_lens.push_back(n);
      }
      packed_lens[slot_of[id]] = std::max(packed_lens[slot_of[id]], n);
    }
  }
  const int64_t num_packed = static_cast<int64_t>(packed_ids.size());
  const int64_t key_vectors = (block_size / kKeyTile) * (kDim / 2);  // per packed block
  const int64_t value_vectors = (block_size / 2) * (kDim / 16);
  // Kept between calls (one pair per calling thread): a fresh megabyte each layer is fresh
  // pages for the kernel to fault in and zero, and to unmap from both cores afterwards.
  thread_local std::vector<__m512i> packed_keys, packed_values;
  grow(packed_keys, kv_heads * num_packed * key_vectors);
  grow(packed_values, kv_heads * num_packed * value_vectors);
  // thread_local names would mean each worker's own (empty) copies inside the lambdas below.
  __m512i* const keys_packed = packed_keys.data();
  __m512i* const values_packed = packed_values.data();
  const int64_t* const slot = slot_of.data();
  const int64_t block_elems = block_size * kDim, head_elems = num_blocks * block_elems;
  const bf16* k_base = key_cache.data_ptr<bf16>();
  const bf16* v_base = value_cache.data_ptr<bf16>();
  at::parallel_for(0, kv_heads * num_packed, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t g = i / num_packed, s = i % num_packed;
      const int64_t offset = g * head_elems + packed_ids[s] * block_elems;
      pack_block<kDim>(k_base + offset, v_base + offset, packed_lens[s], block_size,
                       keys_packed + i * key_vectors, values_packed + i * value_vectors);
    }
  });

  // Tasks: (row, kv head, a run of kTokensPerTask of the row's tokens).
  std::vector<int64_t> task_row, task_token;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t t = 0; t < m[3 * r + 1]; t += kTokensPerTask) {
      task_row.push_back(r);
      task_token.push_back(t);
    }
  PackedStep step{
      m,
      tables,
      width,
      block_size,
      per_kv,
      kv_heads,
      static_cast<int64_t>(task_row.size()),
      task_row.data(),
      task_token.data(),
      slot,
      keys_packed,
      values_packed,
      num_packed * key_vectors,
      num_packed * value_vectors,
      key_vectors,
      value_vectors,
      query.data_ptr<bf16>(),
      query.stride(0),
      query.stride(1),
      out.data_ptr<bf16>(),
      out.stride(0),
      out.stride(1),
      max_len + kKeyTile,  // a query's scores, padded to whole key tiles
      scale,
  };
#ifdef LORAGATE_HAVE_AMX_BF16
  if (amx_permitted()) {
    attend_tasks_amx<kDim>(step);
    return;
  }
#endif
  attend_tasks<kDim>(step);
}

#endif  // LORAGATE_HAVE_AVX512_BF16

// Whether this build runs caches like `key_cache` ([kv_heads, blocks, block_size, head_dim]).
bool prefill_attention_available(const at::Tensor& key_cache) {
#ifdef LORAGATE_HAVE_AVX512_BF16
  if (key_cache.dim() != 4) return false;
  const int64_t dim = key_cache.size(3);
  return key_cache.scalar_type() == at::kBFloat16 && (dim == 64 || dim == 128) &&
         key_cache.size(2) % kKeyTile == 0;
#else
  return false;
#endif
}

void prefill_attention(const at::Tensor& query, const at::Tensor& key_cache,
                       const at::Tensor& value_cache, const at::Tensor& block_tables,
                       const at::Tensor& meta, double scale, at::Tensor out) {
  TORCH_CHECK(prefill_attention_available(key_cache),
              "prefill_attention: bfloat16 caches with head_dim 64 or 128 and blocks of a "
              "multiple of 16 tokens, on a CPU with AVX-512 BF16");
  TORCH_CHECK(query.scalar_type() == at::kBFloat16 && value_cache.scalar_type() == at::kBFloat16 &&
                  out.scalar_type() == at::kBFloat16,
              "prefill_attention: query, caches and out must all be bfloat16");
  TORCH_CHECK(query.dim() == 3 && out.sizes() == query.sizes() && query.stride(2) == 1 &&
                  out.stride(2) == 1,
              "prefill_attention: query/out [tokens, heads, head_dim], head_dim contiguous");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous() &&
                  key_cache.sizes() == value_cache.sizes(),
              "prefill_attention: contiguous caches [kv_heads, blocks, block_size, head_dim]");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && block_tables.dim() == 2 &&
                  block_tables.is_contiguous() && meta.scalar_type() == at::kLong &&
                  meta.dim() == 2 && meta.size(1) == 3 && meta.is_contiguous() &&
                  block_tables.size(0) == meta.size(0),
              "prefill_attention: int64 block_tables [rows, blocks] and meta [rows, 3]");
  const int64_t heads = query.size(1), dim = query.size(2);
  const int64_t kv_heads = key_cache.size(0), num_blocks = key_cache.size(1);
  const int64_t block_size = key_cache.size(2);
  TORCH_CHECK(key_cache.size(3) == dim && heads % kv_heads == 0, "prefill_attention: head shapes");
  const int64_t* m = meta.data_ptr<int64_t>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  for (int64_t r = 0; r < meta.size(0); ++r) {
    const int64_t start = m[3 * r], len = m[3 * r + 1], seq_len = m[3 * r + 2];
    TORCH_CHECK(len > 0 && seq_len >= len && start >= 0 && start + len <= query.size(0) &&
                    seq_len <= block_tables.size(1) * block_size,
                "prefill_attention: a row's queries or length do not fit");
    for (int64_t b = 0; b * block_size < seq_len; ++b) {
      const int64_t id = tables[r * block_tables.size(1) + b];
      TORCH_CHECK(id >= 0 && id < num_blocks, "prefill_attention: block id out of range");
    }
  }
#ifdef LORAGATE_HAVE_AVX512_BF16
  const float fscale = static_cast<float>(scale);
  if (dim == 64)
    attend<64>(query, key_cache, value_cache, block_tables, meta, fscale, out);
  else
    attend<128>(query, key_cache, value_cache, block_tables, meta, fscale, out);
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(loragate, m) {
  m.def(
      "prefill_attention(Tensor query, Tensor key_cache, Tensor value_cache, "
      "Tensor block_tables, Tensor meta, float scale, Tensor(a!) out) -> ()");
  m.def("prefill_attention_available(Tensor key_cache) -> bool");
}

TORCH_LIBRARY_IMPL(loragate, CPU, m) {
  m.impl("prefill_attention", &prefill_attention);
  m.impl("prefill_attention_available", &prefill_attention_available);
}
