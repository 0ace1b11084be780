// Paged decode attention for the CPU: one query token per row, its keys and values read in
// place from the block cache (no gather into a padded copy), softmax over each row's length.
//
// A group's rows may share leading blocks (a common prefix): those are copied out once and
// attended by every row's queries with one GEMM for scores and one for values, as the torch
// cascade path does. Matches kernels/attention.py's _decode_attention, which is the
// specification: query scaled first, scores, max-subtracted exp, P @ V, divided by the sum.
//
// Layout: key_cache / value_cache [kv_heads, num_blocks, block_size, head_dim], contiguous;
// query and out [rows, heads, head_dim] with head_dim contiguous. float32 or bfloat16, all
// four alike; bfloat16 is widened as it is read, and everything is computed in float32
// (scores, softmax, the weighted sum) and rounded once into `out`. On CPUs with AVX-512 BF16,
// bfloat16 at head_dim 64 or 128 takes decode_attention_bf16.h's path instead, and with AMX
// a whole tile of queries behind a shared prefix takes decode_attention_amx.h's cascade.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cmath>
#include <limits>
#include <optional>
#include <type_traits>
#include <vector>

#include "decode_attention_amx.h"
#include "decode_attention_bf16.h"
#include "simd.h"

namespace {

using namespace loragate;

// head_dim 64 (Llama-style models up to 8B use 64 or 128): q and o live in registers for a
// whole block; each key's dot product is a tree of independent FMAs, not one long chain.
template <int kDim, typename T>
inline void block_scores(const float* q, const T* keys, int64_t n, float* s) {
  constexpr int kVecs = kDim / 8;
  vec8 qv[kVecs];
  for (int i = 0; i < kVecs; ++i) qv[i] = load8(q + 8 * i);
  for (int64_t j = 0; j < n; ++j) {
    const T* k = keys + j * kDim;
    vec8 acc[4] = {};
    for (int i = 0; i < kVecs; ++i) acc[i % 4] += qv[i] * load8(k + 8 * i);
    s[j] = hsum((acc[0] + acc[1]) + (acc[2] + acc[3]));
  }
}

template <int kDim, typename T>
inline void block_values(float* o, const T* values, const float* p, int64_t n) {
  constexpr int kVecs = kDim / 8;
  vec8 ov[kVecs];
  for (int i = 0; i < kVecs; ++i) ov[i] = load8(o + 8 * i);
  for (int64_t j = 0; j < n; ++j) {
    const T* v = values + j * kDim;
    const float w = p[j];
    for (int i = 0; i < kVecs; ++i) ov[i] += w * load8(v + 8 * i);
  }
  for (int i = 0; i < kVecs; ++i) store8(o + 8 * i, ov[i]);
}

template <typename T>
inline void scores_of(const float* q, const T* keys, int64_t n, int64_t dim, float* s) {
  if (dim == 64) return block_scores<64>(q, keys, n, s);
  if (dim == 128) return block_scores<128>(q, keys, n, s);
  for (int64_t j = 0; j < n; ++j) s[j] = dot(q, keys + j * dim, dim);
}

template <typename T>
inline void values_of(float* o, const T* values, const float* p, int64_t n, int64_t dim) {
  if (dim == 64) return block_values<64>(o, values, p, n);
  if (dim == 128) return block_values<128>(o, values, p, n);
  for (int64_t j = 0; j < n; ++j) axpy(o, values + j * dim, p[j], dim);
}

// The block's `n` values as float32: in place for float32, else widened into `scratch`.
inline const float* as_float(const float* src, int64_t, std::vector<float>&) { return src; }
inline const float* as_float(const c10::BFloat16* src, int64_t n, std::vector<float>& scratch) {
  widen(src, scratch.data(), n);
  return scratch.data();
}

template <typename T>
void attend(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
            const at::Tensor& shared, const at::Tensor& tail_tables, const at::Tensor& seq_lens,
            float scale, at::Tensor& out) {
  const int64_t rows = query.size(0), heads = query.size(1), dim = query.size(2);
  const int64_t kv_heads = key_cache.size(0), num_blocks = key_cache.size(1);
  const int64_t block_size = key_cache.size(2);
  const int64_t per_kv = heads / kv_heads;
  const int64_t num_shared = shared.defined() ? shared.numel() : 0;
  const int64_t* shared_ids = num_shared ? shared.data_ptr<int64_t>() : nullptr;
  const int64_t* tails = tail_tables.data_ptr<int64_t>();
  const int64_t tail_width = tail_tables.size(1);
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  int64_t max_len = 0;
  for (int64_t r = 0; r < rows; ++r) max_len = std::max(max_len, lens[r]);

  const T* q_base = query.data_ptr<T>();
  T* o_base = out.data_ptr<T>();
  const int64_t q_row = query.stride(0), q_head = query.stride(1);
  const int64_t o_row = out.stride(0), o_head = out.stride(1);
  const int64_t block_elems = block_size * dim, head_elems = num_blocks * block_elems;
  const T* k_base = key_cache.data_ptr<T>();
  const T* v_base = value_cache.data_ptr<T>();

  const int64_t shared_len = num_shared * block_size;
  // Each row's own blocks after the shared ones: fn(row, the block's offset in a head's
  // cache, its first position in the row, its tokens in use), with the row's block `ahead`
  // of it in `cache` (a head's keys or values) on its way into L2.
  const int64_t ahead = std::max<int64_t>(1, kPrefetchTokens / block_size);
  const int64_t block_bytes = block_elems * int64_t{sizeof(T)};
  auto for_each_tail_block = [&](const T* cache, auto&& fn) {
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t* row_tails = tails + r * tail_width;
      const int64_t num_tail = (lens[r] - shared_len + block_size - 1) / block_size;
      for (int64_t b = 0; b < std::min(ahead, num_tail); ++b)
        prefetch_to_l2(cache + row_tails[b] * block_elems, block_bytes);
      for (int64_t b = 0; b < num_tail; ++b) {
        if (b + ahead < num_tail) prefetch_to_l2(cache + row_tails[b + ahead] * block_elems, block_bytes);
        const int64_t pos = shared_len + b * block_size;
        fn(r, row_tails[b] * block_elems, pos, std::min(block_size, lens[r] - pos));
      }
    }
  };
  at::parallel_for(0, kv_heads, 1, [&](int64_t g_begin, int64_t g_end) {
    // Per (row, head) of this kv head, at index i = r * per_kv + h: scores[i * max_len + t],
    // the scaled query q[i * dim + d], the output acc[i * dim + d] (float32 whatever T is).
    std::vector<float> scores(rows * per_kv * max_len);
    std::vector<float> q(rows * per_kv * dim);
    std::vector<float> acc(rows * per_kv * dim);
    std::vector<float> sums(rows * per_kv);
    // One block widened to float32 (bfloat16 caches): once for all the kv head's queries.
    std::vector<float> block(std::is_same_v<T, float> ? 0 : block_elems);
    // A shared prefix is copied out of its blocks once (widened to float32) and attended by
    // every query in one GEMM each for scores and values (the cascade of the torch path): it
    // is the bulk of the work when a long system prompt is shared, and a GEMM is several
    // times faster than per-row dot products there.
    const auto options = at::TensorOptions().dtype(at::kFloat);
    at::Tensor shared_keys, shared_values;
    if (num_shared) {
      shared_keys = at::empty({shared_len, dim}, options);
      shared_values = at::empty({shared_len, dim}, options);
    }
    const at::Tensor queries = at::from_blob(q.data(), {rows * per_kv, dim}, options);
    for (int64_t g = g_begin; g < g_end; ++g) {
      const T* K = k_base + g * head_elems;
      const T* V = v_base + g * head_elems;
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t h = 0; h < per_kv; ++h) {
          widen(q_base + r * q_row + (g * per_kv + h) * q_head,
                q.data() + (r * per_kv + h) * dim, dim, scale);
        }
      if (num_shared) {
        float* sk = shared_keys.data_ptr<float>();
        float* sv = shared_values.data_ptr<float>();
        for (int64_t b = 0; b < num_shared; ++b) {
          std::copy_n(K + shared_ids[b] * block_elems, block_elems, sk + b * block_elems);
          std::copy_n(V + shared_ids[b] * block_elems, block_elems, sv + b * block_elems);
        }
        at::Tensor shared_scores =
            at::from_blob(scores.data(), {rows * per_kv, shared_len}, {max_len, 1}, options);
        at::mm_out(shared_scores, queries, shared_keys.t());
      }
      for_each_tail_block(K, [&](int64_t r, int64_t offset, int64_t pos, int64_t n) {
        const float* keys = as_float(K + offset, n * dim, block);
        for (int64_t h = 0; h < per_kv; ++h) {
          const float* qh = q.data() + (r * per_kv + h) * dim;
          scores_of(qh, keys, n, dim, scores.data() + (r * per_kv + h) * max_len + pos);
        }
      });
      for (int64_t i = 0; i < rows * per_kv; ++i) {
        const int64_t len = lens[i / per_kv];
        float* s = scores.data() + i * max_len;
        sums[i] = exp_shifted(s, len, max_of(s, len));
      }
      if (num_shared) {
        const at::Tensor probs =
            at::from_blob(scores.data(), {rows * per_kv, shared_len}, {max_len, 1}, options);
        at::Tensor accumulated = at::from_blob(acc.data(), {rows * per_kv, dim}, options);
        at::mm_out(accumulated, probs, shared_values);
      } else {
        std::fill(acc.begin(), acc.end(), 0.f);
      }
      for_each_tail_block(V, [&](int64_t r, int64_t offset, int64_t pos, int64_t n) {
        const float* values = as_float(V + offset, n * dim, block);
        for (int64_t h = 0; h < per_kv; ++h) {
          const float* p = scores.data() + (r * per_kv + h) * max_len + pos;
          values_of(acc.data() + (r * per_kv + h) * dim, values, p, n, dim);
        }
      });
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t h = 0; h < per_kv; ++h) {
          narrow(acc.data() + (r * per_kv + h) * dim, o_base + r * o_row + (g * per_kv + h) * o_head,
                 dim, sums[r * per_kv + h]);
        }
    }
  });
}

void decode_attention(const at::Tensor& query, const at::Tensor& key_cache,
                      const at::Tensor& value_cache, const std::optional<at::Tensor>& shared_block_ids,
                      const at::Tensor& tail_tables, const at::Tensor& seq_lens, double scale,
                      at::Tensor out) {
  const auto dtype = query.scalar_type();
  TORCH_CHECK((dtype == at::kFloat || dtype == at::kBFloat16) &&
                  key_cache.scalar_type() == dtype && value_cache.scalar_type() == dtype &&
                  out.scalar_type() == dtype,
              "decode_attention: query, caches and out must all be float32 or all bfloat16");
  TORCH_CHECK(query.dim() == 3 && out.sizes() == query.sizes(), "decode_attention: query/out shape");
  TORCH_CHECK(query.stride(2) == 1 && out.stride(2) == 1, "decode_attention: head_dim must be contiguous");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous() &&
                  key_cache.sizes() == value_cache.sizes() && key_cache.dim() == 4,
              "decode_attention: caches must be contiguous [kv_heads, blocks, block_size, head_dim]");
  TORCH_CHECK(tail_tables.scalar_type() == at::kLong && tail_tables.dim() == 2 &&
                  tail_tables.is_contiguous() && seq_lens.scalar_type() == at::kLong &&
                  seq_lens.is_contiguous(),
              "decode_attention: int64 contiguous block tables and lengths");

  const int64_t rows = query.size(0), heads = query.size(1), dim = query.size(2);
  const int64_t kv_heads = key_cache.size(0), num_blocks = key_cache.size(1);
  const int64_t block_size = key_cache.size(2);
  TORCH_CHECK(key_cache.size(3) == dim && heads % kv_heads == 0, "decode_attention: head shapes");
  TORCH_CHECK(tail_tables.size(0) == rows && seq_lens.numel() == rows, "decode_attention: rows");

  at::Tensor shared;
  if (shared_block_ids.has_value()) shared = shared_block_ids->contiguous();
  const int64_t num_shared = shared.defined() ? shared.numel() : 0;
  TORCH_CHECK(!shared.defined() || shared.scalar_type() == at::kLong, "decode_attention: int64 ids");
  const int64_t* shared_ids = num_shared ? shared.data_ptr<int64_t>() : nullptr;
  const int64_t* tails = tail_tables.data_ptr<int64_t>();
  const int64_t tail_width = tail_tables.size(1);
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r)
    TORCH_CHECK(lens[r] > num_shared * block_size &&
                    lens[r] <= (num_shared + tail_width) * block_size,
                "decode_attention: a row's length does not fit its blocks");
  auto check_block = [&](int64_t id) {
    TORCH_CHECK(id >= 0 && id < num_blocks, "decode_attention: block id out of range");
  };
  for (int64_t i = 0; i < num_shared; ++i) check_block(shared_ids[i]);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t b = 0; b < (lens[r] + block_size - 1) / block_size - num_shared; ++b)
      check_block(tails[r * tail_width + b]);

  const float fscale = static_cast<float>(scale);
#ifdef LORAGATE_HAVE_AVX512_BF16
  if (dtype == at::kBFloat16 && (dim == 64 || dim == 128) && block_size % 2 == 0) {
#ifdef LORAGATE_HAVE_AMX_BF16
    if (cascade_on_tiles(query.size(0), query.size(1) / kv_heads, num_shared, block_size)) {
      auto cascade = dim == 64 ? attend_cascade_amx<64> : attend_cascade_amx<128>;
      cascade(query, key_cache, value_cache, shared_ids, num_shared, tail_tables, seq_lens,
              fscale, out);
      return;
    }
#endif
    auto attend = dim == 64 ? attend_bf16<64> : attend_bf16<128>;
    attend(query, key_cache, value_cache, shared_ids, num_shared, tail_tables, seq_lens, fscale,
           out);
    return;
  }
#endif
  if (dtype == at::kFloat)
    attend<float>(query, key_cache, value_cache, shared, tail_tables, seq_lens, fscale, out);
  else
    attend<c10::BFloat16>(query, key_cache, value_cache, shared, tail_tables, seq_lens, fscale,
                          out);
}

}  // namespace

TORCH_LIBRARY(loragate, m) {
  m.def(
      "decode_attention(Tensor query, Tensor key_cache, Tensor value_cache, "
      "Tensor? shared_block_ids, Tensor tail_tables, Tensor seq_lens, float scale, "
      "Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(loragate, CPU, m) { m.impl("decode_attention", &decode_attention); }
