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
// An MLP's fused gate/up weight packs into panels of eight gate and eight up columns of the same
// units, so that silu(gate) * up is computed as each panel's rows are stored: no [gate | up]
// tensor, no separate activation and product over it (a 512-token prompt chunk of the demo model
// spent 0.5 ms a layer on those two ops).
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

// Where a panel's two vectors of a row go. Plain: the panel's 16 output columns, in order (the
// last panel may hold fewer, `cols`). GateUp and SiluMul read a gate/up panel (`pack_gate_up_panels`:
// eight gate columns, then the eight up columns of the same units): GateUp stores them at their
// places in [gate | up], SiluMul stores silu(gate) * up, the MLP's activation, in one pass.
struct Plain {
  static void store(float* out, int64_t p, vec8 a, vec8 b, const float* bias, int64_t cols) {
    out += p * kPanel;
    if (cols == kPanel) {
      store8(out, a + (bias ? load8(bias) : vec8{}));
      store8(out + 8, b + (bias ? load8(bias + 8) : vec8{}));
      return;
    }
    float lanes[kPanel];
    store8(lanes, a);
    store8(lanes + 8, b);
    for (int64_t c = 0; c < cols; ++c) out[c] = lanes[c] + (bias ? bias[c] : 0.f);
  }
};

struct GateUp {
  int64_t units;  // the intermediate size: up's columns start there
  void store(float* out, int64_t p, vec8 gate, vec8 up, const float*, int64_t) const {
    store8(out + p * 8, gate);
    store8(out + units + p * 8, up);
  }
};

struct SiluMul {
  static void store(float* out, int64_t p, vec8 gate, vec8 up, const float*, int64_t) {
    store8(out + p * 8, gate / (1.f + exp8(-gate)) * up);
  }
};

// x[r] . panel for R rows, handed to the epilogue `e` row by row.
template <int R, typename Epilogue>
inline void rows_by_panel(const float* x, int64_t ldx, const float* panel, int64_t K,
                          const Epilogue& e, int64_t p, const float* bias, float* out, int64_t ldo,
                          int64_t cols) {
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
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) e.store(out + r * ldo, p, acc[2 * r], acc[2 * r + 1], bias, cols);
}

template <int R, typename Epilogue>
void tail_rows(const float* x, int64_t ldx, const float* panel, int64_t K, const Epilogue& e,
               int64_t p, const float* bias, float* out, int64_t ldo, int64_t cols, int64_t rows) {
  if constexpr (R > 0) {
    if (rows == R) return rows_by_panel<R>(x, ldx, panel, K, e, p, bias, out, ldo, cols);
    tail_rows<R - 1>(x, ldx, panel, K, e, p, bias, out, ldo, cols, rows);
  }
}

// out[m] = epilogue(x[m] . panels) for every row: each thread takes a run of panels (output
// columns) and every row, so no two write one value.
template <typename Epilogue>
void multiply(const float* xs, int64_t M, int64_t K, const float* ws, int64_t num_panels,
              int64_t N, const Epilogue& e, const float* bias, float* os, int64_t ldo) {
  at::parallel_for(0, num_panels, 1, [&](int64_t p_begin, int64_t p_end) {
    for (int64_t m0 = 0; m0 < M; m0 += kRowBlock) {
      const int64_t m1 = std::min(M, m0 + kRowBlock);
      for (int64_t p = p_begin; p < p_end; ++p) {
        const float* panel = ws + p * K * kPanel;
        const int64_t cols = std::min(kPanel, N - p * kPanel);
        const float* pb = bias ? bias + p * kPanel : nullptr;
        int64_t m = m0;
        for (; m + kRows <= m1; m += kRows)
          rows_by_panel<kRows>(xs + m * K, K, panel, K, e, p, pb, os + m * ldo, ldo, cols);
        tail_rows<kRows - 1>(xs + m * K, K, panel, K, e, p, pb, os + m * ldo, ldo, cols, m1 - m);
      }
    }
  });
}

// A weight [N, K] into panels [ceil(N / 16), K, 16], zero-padded: panel p's column c holds the
// weight's row source(p, c), or none where source returns N or more.
template <typename Source>
at::Tensor pack(const at::Tensor& weight, const char* name, Source source) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat, name,
              ": a float32 weight [out_features, in_features]");
  const at::Tensor w = weight.contiguous();
  const int64_t N = w.size(0), K = w.size(1), panels = (N + kPanel - 1) / kPanel;
  at::Tensor packed = at::zeros({panels, K, kPanel}, w.options());
  const float* src = w.data_ptr<float>();
  float* dst = packed.data_ptr<float>();
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p)
      for (int64_t c = 0; c < kPanel; ++c) {
        const int64_t n = source(p, c);
        if (n >= N) continue;
        const float* row = src + n * K;
        float* column = dst + p * K * kPanel + c;
        for (int64_t k = 0; k < K; ++k) column[k * kPanel] = row[k];
      }
  });
  return packed;
}

at::Tensor pack_panels(const at::Tensor& weight) {
  return pack(weight, "pack_panels", [](int64_t p, int64_t c) { return p * kPanel + c; });
}

// gate_up [2 * units, K] (gate's rows, then up's) with units a multiple of 8: panel p holds gate
// units 8p..8p+7 and then up's same units, so one panel's two vectors are a unit's gate and up.
at::Tensor pack_gate_up_panels(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.size(0) % kPanel == 0,
              "pack_gate_up_panels: out_features must be twice a multiple of 8");
  const int64_t units = weight.size(0) / 2;
  return pack(weight, "pack_gate_up_panels", [units](int64_t p, int64_t c) {
    return c < 8 ? p * 8 + c : units + p * 8 + (c - 8);
  });
}

// The input as a contiguous [M, K] of float32 for panels of K, and the output's sizes: the
// input's leading ones and `out_features`.
at::Tensor rows_of(const at::Tensor& input, const at::Tensor& panels, const char* name) {
  TORCH_CHECK(input.scalar_type() == at::kFloat && panels.scalar_type() == at::kFloat, name,
              ": float32 input and panels");
  TORCH_CHECK(panels.dim() == 3 && panels.size(2) == kPanel && panels.is_contiguous(), name,
              ": panels must be contiguous [panels, in_features, 16]");
  const int64_t K = panels.size(1);
  TORCH_CHECK(input.dim() >= 1 && input.size(-1) == K, name, ": input's last dimension ",
              input.size(-1), " is not in_features ", K);
  return input.reshape({-1, K}).contiguous();
}

at::Tensor empty_out(const at::Tensor& input, int64_t out_features) {
  std::vector<int64_t> sizes(input.sizes().begin(), input.sizes().end());
  sizes.back() = out_features;
  return at::empty(sizes, input.options());
}

at::Tensor panel_linear(const at::Tensor& input, const at::Tensor& panels,
                        const std::optional<at::Tensor>& bias, int64_t out_features) {
  const at::Tensor x = rows_of(input, panels, "panel_linear");
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
  at::Tensor out = empty_out(input, out_features);
  multiply(x.data_ptr<float>(), x.size(0), x.size(1), panels.data_ptr<float>(), panels.size(0),
           out_features, Plain{}, bias_data, out.data_ptr<float>(), out_features);
  return out;
}

// [gate | up] of gate/up panels: what a LoRA adds its deltas to before the activation.
at::Tensor gate_up_panel_linear(const at::Tensor& input, const at::Tensor& panels) {
  const at::Tensor x = rows_of(input, panels, "gate_up_panel_linear");
  const int64_t units = panels.size(0) * 8;
  at::Tensor out = empty_out(input, 2 * units);
  multiply(x.data_ptr<float>(), x.size(0), x.size(1), panels.data_ptr<float>(), panels.size(0),
           2 * units, GateUp{units}, nullptr, out.data_ptr<float>(), 2 * units);
  return out;
}

// silu(gate) * up of gate/up panels, [..., units]: the MLP's activation without [gate | up].
at::Tensor silu_mul_panel_linear(const at::Tensor& input, const at::Tensor& panels) {
  const at::Tensor x = rows_of(input, panels, "silu_mul_panel_linear");
  const int64_t units = panels.size(0) * 8;
  at::Tensor out = empty_out(input, units);
  multiply(x.data_ptr<float>(), x.size(0), x.size(1), panels.data_ptr<float>(), panels.size(0),
           2 * units, SiluMul{}, nullptr, out.data_ptr<float>(), units);
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
  m.def("pack_gate_up_panels(Tensor weight) -> Tensor");
  m.def("gate_up_panel_linear(Tensor input, Tensor panels) -> Tensor");
  m.def("silu_mul_panel_linear(Tensor input, Tensor panels) -> Tensor");
  m.def("panel_linear(Tensor input, Tensor panels, Tensor? bias, int out_features) -> Tensor");
  m.def("panel_linear_preferred() -> bool", &panel_linear_preferred);
}

TORCH_LIBRARY_IMPL(loragate, CPU, m) {
  m.impl("pack_panels", &pack_panels);
  m.impl("panel_linear", &panel_linear);
  m.impl("pack_gate_up_panels", &pack_gate_up_panels);
  m.impl("gate_up_panel_linear", &gate_up_panel_linear);
  m.impl("silu_mul_panel_linear", &silu_mul_panel_linear);
}
