// The two elementwise halves of an int8 linear (kernels/quant.py) around torch's int8 GEMM:
//   quantize_rows: each row of x to int8 with its own scale (max |x| / 127): per-token
//                  dynamic quantization, one pass over x;
//   dequantize_mm: out = acc * row_scale[m] * col_scale[n] (+ bias[n]), int32 -> x's dtype,
//                  one pass over the GEMM's int32 result.
// In torch each is five or six ops with a temporary each, which at decode sizes cost more
// than the int8 GEMM saves. kernels/quant.py's torch versions are the specification.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <optional>

#include "simd.h"

namespace {

using namespace loragate;

typedef int8_t i8vec8 __attribute__((vector_size(8), aligned(1)));

// Round to nearest even for |v| < 2^22 (adding and taking away 1.5 * 2^23 leaves the
// integer part in the mantissa), as torch.round and nearbyint do.
inline vec8 round_even(vec8 v) {
  const float magic = 12582912.f;
  return (v + magic) - magic;
}

inline vec8 abs8(vec8 v) { return (vec8)((ivec8)v & 0x7fffffff); }

template <typename T>
void quantize_rows_impl(const at::Tensor& x, at::Tensor& q, at::Tensor& scales) {
  const int64_t rows = x.size(0), cols = x.size(1);
  const T* src = x.data_ptr<T>();
  int8_t* dst = q.data_ptr<int8_t>();
  float* s = scales.data_ptr<float>();
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* row = src + r * cols;
      vec8 vmax = {};
      int64_t i = 0;
      for (; i + 8 <= cols; i += 8) {
        const vec8 a = abs8(load8(row + i));
        vmax = a > vmax ? a : vmax;
      }
      float amax = 0.f;
      for (int k = 0; k < 8; ++k) amax = std::max(amax, vmax[k]);
      for (; i < cols; ++i) amax = std::max(amax, std::fabs(to_float(row[i])));
      const float scale = std::max(amax, 1e-8f) / 127.f;
      s[r] = scale;
      int8_t* out = dst + r * cols;
      for (i = 0; i + 8 <= cols; i += 8) {
        vec8 v = round_even(load8(row + i) / scale);
        v = v > 127.f ? 127.f : v;
        v = v < -127.f ? -127.f : v;
        const i8vec8 packed = __builtin_convertvector(__builtin_convertvector(v, ivec8), i8vec8);
        __builtin_memcpy(out + i, &packed, sizeof(packed));
      }
      for (; i < cols; ++i)
        out[i] = static_cast<int8_t>(
            std::nearbyint(std::clamp(to_float(row[i]) / scale, -127.f, 127.f)));
    }
  });
}

std::tuple<at::Tensor, at::Tensor> quantize_rows(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "quantize_rows: float32 or bfloat16 contiguous [rows, cols] only");
  at::Tensor q = at::empty(x.sizes(), x.options().dtype(at::kChar));
  at::Tensor scales = at::empty({x.size(0)}, x.options().dtype(at::kFloat));
  if (x.scalar_type() == at::kFloat)
    quantize_rows_impl<float>(x, q, scales);
  else
    quantize_rows_impl<c10::BFloat16>(x, q, scales);
  return {q, scales};
}

template <typename T>
void dequantize_impl(const at::Tensor& acc, const at::Tensor& row_scales,
                     const at::Tensor& col_scales, const std::optional<at::Tensor>& bias,
                     at::Tensor& out) {
  const int64_t rows = acc.size(0), cols = acc.size(1);
  const int32_t* a = acc.data_ptr<int32_t>();
  const float* rs = row_scales.data_ptr<float>();
  const float* cs = col_scales.data_ptr<float>();
  const float* b = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  T* o = out.data_ptr<T>();
  at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int32_t* ar = a + r * cols;
      const float scale = rs[r];
      T* orow = o + r * cols;
      int64_t i = 0;
      for (; i + 8 <= cols; i += 8) {
        const ivec8 iv = *reinterpret_cast<const ivec8_mem*>(ar + i);
        vec8 v = __builtin_convertvector(iv, vec8) * scale * load8(cs + i);
        if (b != nullptr) v += load8(b + i);
        store8(orow + i, v);
      }
      for (; i < cols; ++i)
        orow[i] = static_cast<T>(static_cast<float>(ar[i]) * scale * cs[i] + (b ? b[i] : 0.f));
    }
  });
}

void dequantize_mm(const at::Tensor& acc, const at::Tensor& row_scales,
                   const at::Tensor& col_scales, const std::optional<at::Tensor>& bias,
                   at::Tensor out) {
  TORCH_CHECK(acc.dim() == 2 && acc.is_contiguous() && acc.scalar_type() == at::kInt,
              "dequantize_mm: int32 contiguous [rows, cols] accumulators");
  TORCH_CHECK(row_scales.scalar_type() == at::kFloat && row_scales.is_contiguous() &&
                  row_scales.numel() == acc.size(0),
              "dequantize_mm: float32 row scales, one per row");
  TORCH_CHECK(col_scales.scalar_type() == at::kFloat && col_scales.is_contiguous() &&
                  col_scales.numel() == acc.size(1),
              "dequantize_mm: float32 column scales, one per column");
  TORCH_CHECK(!bias.has_value() || (bias->scalar_type() == at::kFloat && bias->is_contiguous() &&
                                    bias->numel() == acc.size(1)),
              "dequantize_mm: float32 bias, one per column");
  TORCH_CHECK(out.sizes() == acc.sizes() && out.is_contiguous() &&
                  (out.scalar_type() == at::kFloat || out.scalar_type() == at::kBFloat16),
              "dequantize_mm: out must be float32 or bfloat16, contiguous, acc's shape");
  if (out.scalar_type() == at::kFloat)
    dequantize_impl<float>(acc, row_scales, col_scales, bias, out);
  else
    dequantize_impl<c10::BFloat16>(acc, row_scales, col_scales, bias, out);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(loragate, m) {
  m.def("quantize_rows(Tensor x) -> (Tensor, Tensor)");
  m.def(
      "dequantize_mm(Tensor acc, Tensor row_scales, Tensor col_scales, Tensor? bias, "
      "Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(loragate, CPU, m) {
  m.impl("quantize_rows", &quantize_rows);
  m.impl("dequantize_mm", &dequantize_mm);
}
