// RMSNorm for the CPU, alone or fused with the residual add before it, in one pass over each
// row: the torch version (engine/models/llama.py RMSNorm) is six small ops per call, and a
// decode step calls it twice per layer on a [rows, hidden] tensor that fits in L1.
//
// As HF computes it: var = mean(x^2) and x * rsqrt(var + eps) in float32 (1 / sqrt,
// correctly rounded), rounded to the input's dtype, then times the weight (in the input's
// dtype too: float32, or bfloat16 with float32 products rounded once). The residual add
// rounds to the input's dtype as torch's does. Only the order of the sum of squares differs.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>

#include "simd.h"

namespace {

using namespace loragate;

void check(const at::Tensor& t, const at::Tensor& weight, const char* what) {
  TORCH_CHECK((t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16) &&
                  t.dim() == 2 && t.is_contiguous(),
              what, ": float32 or bfloat16 contiguous [rows, hidden] only");
  TORCH_CHECK(weight.scalar_type() == t.scalar_type() && weight.is_contiguous() &&
                  weight.numel() == t.size(1),
              what, ": weight must be [hidden] in the input's dtype");
}

template <typename T>
inline void normalize(const T* x, const T* weight, float eps, int64_t n, T* out) {
  const float inv = 1.0f / std::sqrt(dot(x, x, n) / static_cast<float>(n) + eps);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    store8(out + i, load8(weight + i) * round_as<T>(load8(x + i) * inv));
  for (; i < n; ++i)
    out[i] = static_cast<T>(to_float(weight[i]) * to_float(static_cast<T>(to_float(x[i]) * inv)));
}

template <typename T>
void rms_norm_rows(const at::Tensor& input, const at::Tensor& weight, float eps, at::Tensor& out) {
  const int64_t hidden = input.size(1);
  const T* x = input.data_ptr<T>();
  const T* w = weight.data_ptr<T>();
  T* o = out.data_ptr<T>();
  at::parallel_for(0, input.size(0), 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) normalize(x + r * hidden, w, eps, hidden, o + r * hidden);
  });
}

template <typename T>
void add_rms_norm_rows(at::Tensor& residual, const at::Tensor& delta, const at::Tensor& weight,
                       float eps, at::Tensor& out) {
  const int64_t hidden = residual.size(1);
  T* res = residual.data_ptr<T>();
  const T* d = delta.data_ptr<T>();
  const T* w = weight.data_ptr<T>();
  T* o = out.data_ptr<T>();
  at::parallel_for(0, residual.size(0), 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      T* row = res + r * hidden;
      const T* drow = d + r * hidden;
      int64_t i = 0;
      for (; i + 8 <= hidden; i += 8) store8(row + i, load8(row + i) + load8(drow + i));
      for (; i < hidden; ++i) row[i] = static_cast<T>(to_float(row[i]) + to_float(drow[i]));
      normalize(row, w, eps, hidden, o + r * hidden);
    }
  });
}

void rms_norm(const at::Tensor& input, const at::Tensor& weight, double eps, at::Tensor out) {
  check(input, weight, "rms_norm");
  check(out, weight, "rms_norm out");
  TORCH_CHECK(out.sizes() == input.sizes(), "rms_norm: out shape");
  if (input.scalar_type() == at::kFloat)
    rms_norm_rows<float>(input, weight, static_cast<float>(eps), out);
  else
    rms_norm_rows<c10::BFloat16>(input, weight, static_cast<float>(eps), out);
}

// residual += delta; out = rms_norm(residual).
void add_rms_norm(at::Tensor residual, const at::Tensor& delta, const at::Tensor& weight,
                  double eps, at::Tensor out) {
  check(residual, weight, "add_rms_norm residual");
  check(delta, weight, "add_rms_norm delta");
  check(out, weight, "add_rms_norm out");
  TORCH_CHECK(delta.sizes() == residual.sizes() && out.sizes() == residual.sizes(),
              "add_rms_norm: shapes differ");
  if (residual.scalar_type() == at::kFloat)
    add_rms_norm_rows<float>(residual, delta, weight, static_cast<float>(eps), out);
  else
    add_rms_norm_rows<c10::BFloat16>(residual, delta, weight, static_cast<float>(eps), out);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(loragate, m) {
  m.def("rms_norm(Tensor input, Tensor weight, float eps, Tensor(a!) out) -> ()");
  m.def(
      "add_rms_norm(Tensor(a!) residual, Tensor delta, Tensor weight, float eps, "
      "Tensor(b!) out) -> ()");
}

TORCH_LIBRARY_IMPL(loragate, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
}
