// RMSNorm for the CPU, alone or fused with the residual add before it, in one pass over each
// row: the torch version (engine/models/llama.py RMSNorm) is six small ops per call, and a
// decode step calls it twice per layer on a [rows, hidden] tensor that fits in L1.
//
// Float32 as HF computes it: var = mean(x^2); x * rsqrt(var + eps) (1 / sqrt, correctly
// rounded); then times the weight. Only the order of the sum of squares differs.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>

#include "simd.h"

namespace {

using namespace loragate;

void check(const at::Tensor& t, const at::Tensor& weight, const char* what) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.dim() == 2 && t.is_contiguous(), what,
              ": float32 contiguous [rows, hidden] only");
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.is_contiguous() &&
                  weight.numel() == t.size(1),
              what, ": weight must be float32 [hidden]");
}

inline float sum_of_squares(const float* x, int64_t n) {
  return dot(x, x, n);
}

inline void normalize(const float* x, const float* weight, float eps, int64_t n, float* out) {
  const float inv = 1.0f / std::sqrt(sum_of_squares(x, n) / static_cast<float>(n) + eps);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] = weight[i] * (x[i] * inv);
}

void rms_norm(const at::Tensor& input, const at::Tensor& weight, double eps, at::Tensor out) {
  check(input, weight, "rms_norm");
  check(out, weight, "rms_norm out");
  TORCH_CHECK(out.sizes() == input.sizes(), "rms_norm: out shape");
  const int64_t hidden = input.size(1);
  const float* x = input.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, input.size(0), 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      normalize(x + r * hidden, w, static_cast<float>(eps), hidden, o + r * hidden);
  });
}

// residual += delta; out = rms_norm(residual).
void add_rms_norm(at::Tensor residual, const at::Tensor& delta, const at::Tensor& weight,
                  double eps, at::Tensor out) {
  check(residual, weight, "add_rms_norm residual");
  check(delta, weight, "add_rms_norm delta");
  check(out, weight, "add_rms_norm out");
  TORCH_CHECK(delta.sizes() == residual.sizes() && out.sizes() == residual.sizes(),
              "add_rms_norm: shapes differ");
  const int64_t hidden = residual.size(1);
  float* res = residual.data_ptr<float>();
  const float* d = delta.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, residual.size(0), 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* row = res + r * hidden;
      const float* drow = d + r * hidden;
#pragma omp simd
      for (int64_t i = 0; i < hidden; ++i) row[i] += drow[i];
      normalize(row, w, static_cast<float>(eps), hidden, o + r * hidden);
    }
  });
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
