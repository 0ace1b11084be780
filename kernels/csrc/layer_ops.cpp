// The attention's small ops around its GEMMs, each one pass instead of torch's several:
//   rotary_:  q and k rotated in place, x * cos + roll(x, dim / 2) * signed_sin, each product
//             and the sum rounded to x's dtype as torch's three ops round them (bit for bit
//             the torch path, in float32 and bfloat16);
//   write_kv: each token's K and V rows copied to their slots of the paged cache.
// SmolLM2 on two threads, torch -> these: rotary 35 -> 23 us a layer at 64 tokens, 486 -> 355
// at 2,048; the KV write (torch's index_copy_ on the cache's slot dimension) 18 -> 3 and
// 356 -> 77. (A fused silu-and-mul was tried too: its exp and division cost as much as
// torch's two ops, so it was dropped.)

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstring>
#include <type_traits>

#include "simd.h"

namespace {

using namespace loragate;

// v rounded to T, as a torch op's result is. In float32 the empty asm keeps the compiler from
// fusing the product into the following add (one rounding instead of torch's two).
template <typename T>
inline vec8 as_op_result(vec8 v) {
  if constexpr (std::is_same_v<T, float>) {
    __asm__("" : "+x"(v));
    return v;
  } else {
    return round_as<T>(v);
  }
}

template <typename T>
void rotate_rows(T* x, const T* cos, const T* sin, int64_t tokens, int64_t heads, int64_t dim,
                 int64_t token_stride) {
  const int64_t half = dim / 2;
  at::parallel_for(0, tokens, 128, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* c = cos + t * dim;
      const T* s = sin + t * dim;
      for (int64_t h = 0; h < heads; ++h) {
        T* row = x + t * token_stride + h * dim;
        int64_t i = 0;
        for (; i + 8 <= half; i += 8) {
          const vec8 a = load8(row + i), b = load8(row + half + i);
          store8(row + i, as_op_result<T>(a * load8(c + i)) + as_op_result<T>(b * load8(s + i)));
          store8(row + half + i, as_op_result<T>(b * load8(c + half + i)) +
                                     as_op_result<T>(a * load8(s + half + i)));
        }
        for (; i < half; ++i) {
          const float a = to_float(row[i]), b = to_float(row[half + i]);
          // volatile: a product stored and read back, never fused into the add.
          const auto rounded = [](float v) {
            volatile float stored = to_float(static_cast<T>(v));
            return static_cast<float>(stored);
          };
          row[i] = static_cast<T>(rounded(a * to_float(c[i])) + rounded(b * to_float(s[i])));
          row[half + i] = static_cast<T>(rounded(b * to_float(c[half + i])) +
                                         rounded(a * to_float(s[half + i])));
        }
      }
    }
  });
}

void rotary_(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK((x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16) &&
                  x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == x.size(2) &&
                  x.size(2) % 2 == 0,
              "rotary_: float32 or bfloat16 [tokens, heads, head_dim], heads contiguous");
  const int64_t tokens = x.size(0), dim = x.size(2);
  for (const at::Tensor* t : {&cos, &sin})
    TORCH_CHECK(t->scalar_type() == x.scalar_type() && t->is_contiguous() &&
                    t->numel() == tokens * dim,
                "rotary_: cos and signed sin [tokens, 1, head_dim] in x's dtype, contiguous");
  if (x.scalar_type() == at::kFloat)
    rotate_rows(x.data_ptr<float>(), cos.data_ptr<float>(), sin.data_ptr<float>(), tokens,
                x.size(1), dim, x.stride(0));
  else
    rotate_rows(x.data_ptr<c10::BFloat16>(), cos.data_ptr<c10::BFloat16>(),
                sin.data_ptr<c10::BFloat16>(), tokens, x.size(1), dim, x.stride(0));
}

void write_kv(const at::Tensor& key, const at::Tensor& value, at::Tensor key_cache,
              at::Tensor value_cache, const at::Tensor& slots) {
  TORCH_CHECK(key_cache.dim() == 4 && key_cache.is_contiguous() &&
                  value_cache.sizes() == key_cache.sizes() && value_cache.is_contiguous() &&
                  value_cache.scalar_type() == key_cache.scalar_type(),
              "write_kv: contiguous [kv_heads, blocks, block_size, head_dim] caches alike");
  const int64_t heads = key_cache.size(0), dim = key_cache.size(3);
  const int64_t num_slots = key_cache.size(1) * key_cache.size(2), tokens = slots.numel();
  for (const at::Tensor* t : {&key, &value})
    TORCH_CHECK(t->scalar_type() == key_cache.scalar_type() && t->dim() == 3 &&
                    t->size(0) == tokens && t->size(1) == heads && t->size(2) == dim &&
                    t->stride(2) == 1 && t->stride(1) == dim,
                "write_kv: key and value [tokens, kv_heads, head_dim] in the cache's dtype");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.is_contiguous(),
              "write_kv: int64 slots, one per token");
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(slot[t] >= 0 && slot[t] < num_slots, "write_kv: slot ", slot[t],
                " outside the cache's ", num_slots);
  const size_t row_bytes = dim * key_cache.element_size();
  const auto copy = [&](const at::Tensor& src, at::Tensor& cache) {
    const char* s = static_cast<const char*>(src.data_ptr());
    char* c = static_cast<char*>(cache.data_ptr());
    const int64_t src_stride = src.stride(0) * src.element_size();
    for (int64_t t = 0; t < tokens; ++t)
      for (int64_t h = 0; h < heads; ++h)
        std::memcpy(c + (h * num_slots + slot[t]) * row_bytes,
                    s + t * src_stride + h * row_bytes, row_bytes);
  };
  copy(key, key_cache);
  copy(value, value_cache);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(loragate, m) {
  m.def("rotary_(Tensor(a!) x, Tensor cos, Tensor sin) -> ()");
  m.def("write_kv(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, "
        "Tensor slots) -> ()");
}

TORCH_LIBRARY_IMPL(loragate, CPU, m) {
  m.impl("rotary_", &rotary_);
  m.impl("write_kv", &write_kv);
}
