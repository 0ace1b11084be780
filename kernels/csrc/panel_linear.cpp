// float32 linear layers for processors whose widest vectors are 256 bits (AVX2 with FMA): the
// weight packed once, at load, into panels of 16 output columns stored k-major
// ([ceil(N / 16), K, 16]), and a register-blocked GEMM that streams each panel once per block of
// rows: six rows at a time hold 6 x 2 accumulators of 8 lanes, and every step of k is one
// broadcast of x per row and two loads of the panel for twelve FMAs.
//
// oneDNN's prepacked float32 kernels reach 26-65 GFLOP/s on a decode step's shapes (16 rows by
// the demo model's or SmolLM2's projections) on one core of a Zen 3 without AVX-512; these reach
// 78-87, near the core's FMA peak, and match or beat oneDNN on prompt-sized row counts too
// (issue 43, bench/README.md). With AVX-512 oneDNN's 512-bit kernels stay in use
// (kernels/linear.py chooses once, at load).
//
// The accumulators are a fixed-size array unrolled by `#pragma GCC unroll`: without it GCC keeps
// the array in memory and stores every accumulator back each step of k, which ran at 40 % of the
// peak.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <vector>

#include "simd.h"

namespace {

using namespace loragate;

constexpr int64_t kPanel = 16;  // output columns a panel holds: two vectors of eight
constexpr int kRows = 6;        // rows a microkernel step multiplies: 12 accumulators + 2 + 1
// Rows whose slice of x stays in L2 while every panel of a thread's share streams past: 96
// to 192 rows measured alike (prompt chunks of 128-512 tokens at 93-97 GFLOP/s on one core).
constexpr int64_t kRowBlock = 128;

// out[r][0:cols] = x[r] . panel for R rows (cols < 16 only in the last, padded panel).
template <int R>
inline void rows_by_panel(const float* x, int64_t ldx, const float* panel, int64_t K,
                          const float* bias, float* out, int64_t ldo, int64_t cols) {
  vec8 acc[2 * R];
#pragma GCC unroll 16
  for (int i = 0; i < 2 * R; ++i) acc[i] = vec8{};
  for (int64_t k = 0; k < K; ++k) {
    const vec8 w0 = load8(panel + k * kPanel);
    const vec8 w1 = load8(panel + k * kPanel + 8);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const float b = x[r * ldx + k];
      acc[2 * r] += b * w0;
      acc[2 * r + 1] += b * w1;
    }
  }
  vec8 b0{}, b1{};
  if (bias != nullptr && cols == kPanel) {
    b0 = load8(bias);
    b1 = load8(bias + 8);
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
    if (cols == kPanel) {
      store8(out + r * ldo, acc[2 * r] + b0);
      store8(out + r * ldo + 8, acc[2 * r + 1] + b1);
    } else {
      float lanes[kPanel];
      store8(lanes, acc[2 * r]);
      store8(lanes + 8, acc[2 * r + 1]);
      for (int64_t c = 0; c < cols; ++c) out[r * ldo + c] = lanes[c] + (bias ? bias[c] : 0.f);
    }
  }
}

template <int R>
void tail_rows(const float* x, int64_t ldx, const float* panel, int64_t K, const float* bias,
               float* out, int64_t ldo, int64_t cols, int64_t rows) {
  if constexpr (R > 0) {
    if (rows == R) return rows_by_panel<R>(x, ldx, panel, K, bias, out, ldo, cols);
    tail_rows<R - 1>(x, ldx, panel, K, bias, out, ldo, cols, rows);
  }
}

at::Tensor pack_panels(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat,
              "pack_panels: a float32 weight [out_features, in_features]");
  const at::Tensor w = weight.contiguous();
  const int64_t N = w.size(0), K = w.size(1), panels = (N + kPanel - 1) / kPanel;
  at::Tensor packed = at::zeros({panels, K, kPanel}, w.options());
  const float* src = w.data_ptr<float>();
  float* dst = packed.data_ptr<float>();
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p)
      for (int64_t c = 0; c < std::min(kPanel, N - p * kPanel); ++c) {
        const float* row = src + (p * kPanel + c) * K;
        float* column = dst + p * K * kPanel + c;
        for (int64_t k = 0; k < K; ++k) column[k * kPanel] = row[k];
      }
  });
  return packed;
}

at::Tensor panel_linear(const at::Tensor& input, const at::Tensor& panels,
                        const std::optional<at::Tensor>& bias, int64_t out_features) {
  TORCH_CHECK(input.scalar_type() == at::kFloat && panels.scalar_type() == at::kFloat,
              "panel_linear: float32 input and panels");
  TORCH_CHECK(panels.dim() == 3 && panels.size(2) == kPanel && panels.is_contiguous(),
              "panel_linear: panels must be contiguous [panels, in_features, 16]");
  const int64_t K = panels.size(1);
  TORCH_CHECK(input.dim() >= 1 && input.size(-1) == K, "panel_linear: input's last dimension ",
              input.size(-1), " is not in_features ", K);
  TORCH_CHECK(out_features > (panels.size(0) - 1) * kPanel && out_features <= panels.size(0) * kPanel,
              "panel_linear: ", out_features, " out_features for ", panels.size(0), " panels");
  const float* bias_data = nullptr;
  at::Tensor b;
  if (bias.has_value() && bias->defined()) {
    b = bias->contiguous();
    TORCH_CHECK(b.scalar_type() == at::kFloat && b.numel() == out_features,
                "panel_linear: a float32 bias of out_features");
    bias_data = b.data_ptr<float>();
  }
  const at::Tensor x = input.reshape({-1, K}).contiguous();
  const int64_t M = x.size(0), N = out_features;
  std::vector<int64_t> out_sizes(input.sizes().begin(), input.sizes().end());
  out_sizes.back() = N;
  at::Tensor out = at::empty(out_sizes, input.options());
  if (M == 0) return out;
  const float* xs = x.data_ptr<float>();
  const float* ws = panels.data_ptr<float>();
  float* os = out.data_ptr<float>();
  // Each thread takes a run of panels (output columns) and every row: no two write one value.
  at::parallel_for(0, panels.size(0), 1, [&](int64_t p_begin, int64_t p_end) {
    for (int64_t m0 = 0; m0 < M; m0 += kRowBlock) {
      const int64_t m1 = std::min(M, m0 + kRowBlock);
      for (int64_t p = p_begin; p < p_end; ++p) {
        const float* panel = ws + p * K * kPanel;
        const int64_t cols = std::min(kPanel, N - p * kPanel);
        const float* pb = bias_data ? bias_data + p * kPanel : nullptr;
        int64_t m = m0;
        for (; m + kRows <= m1; m += kRows)
          rows_by_panel<kRows>(xs + m * K, K, panel, K, pb, os + m * N + p * kPanel, N, cols);
        tail_rows<kRows - 1>(xs + m * K, K, panel, K, pb, os + m * N + p * kPanel, N, cols, m1 - m);
      }
    }
  });
  return out;
}

// Whether these kernels are the ones to run float32 linears with here: built for AVX2 with FMA
// and without AVX-512 (measured there; oneDNN's 512-bit kernels elsewhere).
bool panel_linear_preferred() {
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
  return true;
#else
  return false;
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(loragate, m) {
  m.def("pack_panels(Tensor weight) -> Tensor");
  m.def("panel_linear(Tensor input, Tensor panels, Tensor? bias, int out_features) -> Tensor");
  m.def("panel_linear_preferred() -> bool", &panel_linear_preferred);
}

TORCH_LIBRARY_IMPL(loragate, CPU, m) {
  m.impl("pack_panels", &pack_panels);
  m.impl("panel_linear", &panel_linear);
}
