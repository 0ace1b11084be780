// Multi-LoRA for a step whose rows are ordered by adapter slot: one call per LoRA-targeted
// linear adds, for each run of rows [start, end) under one slot,
//     y[start:end] += (x[start:end] @ A[slot, :width].T) @ B[slot, :width]
// at each adapter's own width. kernels/lora.py's add_lora is the specification. A decode step
// has a handful of rows per adapter and widths of a few dozen: BLAS calls of that size cost
// tens of microseconds each in setup, so float32 runs are plain vectorized loops (shrink:
// dot products; expand: row updates with y's row in cache); others go to at::mm.

#include <ATen/ATen.h>
#include <torch/library.h>

#include <vector>

#include "simd.h"

namespace {

using namespace loragate;

// A module's block of B: rows [k0, k1) are non-zero only in columns [c0, c1).
struct Segment {
  int64_t k0, k1, c0, c1;
};

// y[c0:c1] += shrunk[k0:k1] @ b[k0:k1, c0:c1], holding 64 columns of y in registers across
// the block's rows, so y is read and written once rather than once per rank.
inline void expand(float* y, const float* b, const float* shrunk, int64_t out, Segment s) {
  int64_t c = s.c0;
  for (; c + 64 <= s.c1; c += 64) {
    vec8 acc[8];
    for (int v = 0; v < 8; ++v) acc[v] = load8(y + c + 8 * v);
    for (int64_t k = s.k0; k < s.k1; ++k) {
      const float w = shrunk[k];
      const float* bk = b + k * out + c;
      for (int v = 0; v < 8; ++v) acc[v] += w * load8(bk + 8 * v);
    }
    for (int v = 0; v < 8; ++v) store8(y + c + 8 * v, acc[v]);
  }
  for (int64_t k = s.k0; k < s.k1; ++k) axpy(y + c, b + k * out + c, shrunk[k], s.c1 - c);
}

// y[r] += (x[r] @ a.T) @ b for the run's rows; a: [width, in], b: [width, out], rows of each
// contiguous; only the modules' blocks of b are read.
void run_float(float* y, int64_t y_row, const float* x, int64_t x_row, int64_t rows,
               const float* a, const float* b, int64_t width, int64_t in, int64_t out,
               const std::vector<Segment>& segments) {
  float shrunk[256];
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * x_row;
    for (int64_t k = 0; k < width; ++k) shrunk[k] = dot(xr, a + k * in, in);
    for (const Segment& s : segments) expand(y + r * y_row, b, shrunk, out, s);
  }
}

// The segments of `slot` in the flat list [count, 4 ints per segment] per slot; the whole
// [0, width) x [0, out) block when the list says nothing.
std::vector<Segment> segments_of(at::IntArrayRef flat, int64_t slot, int64_t width,
                                 int64_t out) {
  size_t i = 0;
  for (int64_t s = 0; s < slot && i < flat.size(); ++s) i += 1 + 4 * flat[i];
  std::vector<Segment> result;
  if (i < flat.size()) {
    const int64_t count = flat[i];
    TORCH_CHECK(i + 1 + 4 * count <= flat.size(), "add_lora_runs: segment list too short");
    for (int64_t j = 0; j < count; ++j) {
      const int64_t* v = flat.data() + i + 1 + 4 * j;
      TORCH_CHECK(0 <= v[0] && v[0] <= v[1] && v[1] <= width && 0 <= v[2] && v[2] <= v[3] &&
                      v[3] <= out,
                  "add_lora_runs: segment out of range");
      result.push_back({v[0], v[1], v[2], v[3]});
    }
  }
  if (result.empty()) result.push_back({0, width, 0, out});
  return result;
}

void add_lora_runs(at::Tensor y, const at::Tensor& x, const at::Tensor& lora_a,
                   const at::Tensor& lora_b, at::IntArrayRef slots, at::IntArrayRef starts,
                   at::IntArrayRef ends, at::IntArrayRef widths, at::IntArrayRef segments) {
  TORCH_CHECK(x.dim() == 2 && y.dim() == 2 && x.size(0) == y.size(0), "add_lora_runs: x/y rows");
  TORCH_CHECK(lora_a.dim() == 3 && lora_b.dim() == 3 && lora_a.size(0) == lora_b.size(0) &&
                  lora_a.size(1) == lora_b.size(1) && lora_a.size(2) == x.size(1) &&
                  lora_b.size(2) == y.size(1),
              "add_lora_runs: stacks must be [slots, width, in] and [slots, width, out]");
  TORCH_CHECK(slots.size() == starts.size() && starts.size() == ends.size(),
              "add_lora_runs: one slot, start and end per run");
  const int64_t num_slots = lora_a.size(0), max_width = lora_a.size(1), rows = x.size(0);
  TORCH_CHECK(static_cast<int64_t>(widths.size()) == num_slots, "add_lora_runs: widths");
  for (size_t i = 0; i < slots.size(); ++i) {
    const int64_t slot = slots[i], start = starts[i], end = ends[i];
    TORCH_CHECK(slot >= 0 && slot < num_slots && 0 <= start && start < end && end <= rows,
                "add_lora_runs: run out of range");
    const int64_t width = widths[slot];
    TORCH_CHECK(width >= 0 && width <= max_width, "add_lora_runs: width out of range");
    if (width == 0) continue;
    const bool plain = x.scalar_type() == at::kFloat && y.scalar_type() == at::kFloat &&
                       lora_a.scalar_type() == at::kFloat && lora_b.scalar_type() == at::kFloat &&
                       x.stride(1) == 1 && y.stride(1) == 1 && lora_a.is_contiguous() &&
                       lora_b.is_contiguous() && width <= 256;
    if (plain) {
      const int64_t in = x.size(1), out = y.size(1);
      run_float(y.data_ptr<float>() + start * y.stride(0), y.stride(0),
                x.data_ptr<float>() + start * x.stride(0), x.stride(0), end - start,
                lora_a.data_ptr<float>() + slot * max_width * in,
                lora_b.data_ptr<float>() + slot * max_width * out, width, in, out,
                segments_of(segments, slot, width, out));
      continue;
    }
    const at::Tensor xs = x.narrow(0, start, end - start);
    const at::Tensor shrunk = at::mm(xs, lora_a.select(0, slot).narrow(0, 0, width).t());
    at::Tensor ys = y.narrow(0, start, end - start);
    ys.addmm_(shrunk, lora_b.select(0, slot).narrow(0, 0, width));
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(loragate, m) {
  m.def(
      "add_lora_runs(Tensor(a!) y, Tensor x, Tensor lora_a, Tensor lora_b, int[] slots, "
      "int[] starts, int[] ends, int[] widths, int[] segments) -> ()");
}

TORCH_LIBRARY_IMPL(loragate, CPU, m) { m.impl("add_lora_runs", &add_lora_runs); }
