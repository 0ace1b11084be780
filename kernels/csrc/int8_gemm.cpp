// The whole int8 linear in one op on CPUs with AVX-512 VNNI (kernels/quant.py's
// int8_linear_reference is its specification):
//   out = sum over groups g of (q(x)_g . q(w)_g) * (s_x[row][g] * s_w[g][col])  (+ bias[col])
// x is quantized as the op starts, each row's groups of `group` inputs to int8 with their own
// scale (max |x| / 127; group = the row's width is per-token quantization), then multiplied
// against int8 weight rows quantized in the same groups (a scale per output and group) with
// int32 sums per group.
// gated: x is the fused gate/up output [gate | up] and the linear's input silu(gate) * up,
// computed (and rounded as torch's two ops round it) as the rows are quantized: for down_proj
// one pass over gate/up instead of torch's silu, mul and our quantization, three passes.
//
// Why one op: quantize, GEMM and scale back as three ops wrote and read an int32 matrix and
// paid three dispatches per linear; at decode sizes that was a third of the linear's time.
// Why our own GEMM: torch's int8 GEMM reads the plain [out, in] weight every call and at decode
// sizes ran no faster than oneDNN's prepacked bf16 one. Here the weight is packed once, at load,
// as [out / 16][in / 4][16][4]: one 64-byte load holds four consecutive inputs of sixteen
// outputs, what vpdpbusd multiplies against four of a row's inputs broadcast. vpdpbusd takes
// unsigned activations, so x is stored quantized + 128 (its sign bit flipped), and 128 * the
// group's sum of each weight column (col_sums, computed at load) is taken back off.
//
// Register tile: kRows rows x kBlocks column blocks of int32 sums (24 of the 32 vector
// registers) for a row in one group; in several groups, a smaller tile keeps float32 sums
// across groups in registers beside the int32 sums of the group (tile_grouped).
// Tasks are (column tile, row tile) pairs, column-major, so a thread runs every row tile of a
// column tile while its weight panel is in L2.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <type_traits>
#include <vector>

#include "simd.h"

#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include <immintrin.h>
#define LORAGATE_HAVE_AVX512_VNNI 1
#endif

namespace {

using namespace loragate;

bool int8_linear_available() {
#ifdef LORAGATE_HAVE_AVX512_VNNI
  return true;
#else
  return false;
#endif
}

#ifdef LORAGATE_HAVE_AVX512_VNNI

constexpr int64_t kCols = 16;  // outputs per packed block (one int32 vector)
constexpr int kRows = 6;       // rows of a register tile
constexpr int kBlocks = 4;     // column blocks of a register tile

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  const __m256i half = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}

inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline void store16(c10::BFloat16* p, __m512 v) {
#ifdef __AVX512BF16__
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), (__m256i)_mm512_cvtneps_pbh(v));
#else
  // Round to nearest even, NaN kept a NaN, as c10::BFloat16 does.
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i bias = _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(bits, bias), 16);
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc0));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(r));
#endif
}

typedef float vec16 __attribute__((vector_size(64)));  // an __m512 for simd.h's exp_lanes
typedef int32_t ivec16 __attribute__((vector_size(64)));

// v as torch stores an op's result in T: float32 unchanged, bf16 rounded to nearest even.
template <typename T>
inline __m512 as_stored(__m512 v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else {
#ifdef __AVX512BF16__
    const __m256i half = (__m256i)_mm512_cvtneps_pbh(v);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
#else
    c10::BFloat16 tmp[16];
    store16(tmp, v);
    return load16(tmp);
#endif
  }
}

// silu(x) = x / (1 + e^-x) in float32 (exp within 2 ulp of expf; past float's overflow the
// signed 0 that expf's inf gives).
inline __m512 silu16(__m512 v) {
  const vec16 x = (vec16)v;
  const vec16 y = x / (1.f + exp_lanes<vec16, ivec16>(-x));
  return (__m512)(x < -88.3762626647949f ? x * 0.f : y);
}

// One row's groups to uint8 (q + 128) and their scales, as quantize_groups specifies:
// scale = max(max |x|, 1e-8) / 127, q = round-half-even(x / scale) clamped to [-127, 127].
template <typename T>
void quantize_row(const T* x, int64_t cols, int64_t group, uint8_t* q, float* scales) {
  for (int64_t g0 = 0, gi = 0; g0 < cols; g0 += group, ++gi) {
    __m512 vmax = _mm512_setzero_ps();
    for (int64_t i = g0; i < g0 + group; i += 16)
      vmax = _mm512_max_ps(vmax, _mm512_abs_ps(load16(x + i)));
    const float scale = std::max(_mm512_reduce_max_ps(vmax), 1e-8f) / 127.f;
    scales[gi] = scale;
    const __m512 vs = _mm512_set1_ps(scale);
    for (int64_t i = g0; i < g0 + group; i += 16) {
      __m512 v = _mm512_roundscale_ps(_mm512_div_ps(load16(x + i), vs),
                                      _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      v = _mm512_min_ps(_mm512_max_ps(v, _mm512_set1_ps(-127.f)), _mm512_set1_ps(127.f));
      const __m512i u = _mm512_add_epi32(_mm512_cvtps_epi32(v), _mm512_set1_epi32(128));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + i), _mm512_cvtepi32_epi8(u));
    }
  }
}

// The same for silu(gate) * up of one row of the fused gate/up output [gate (cols) | up
// (cols)], rounded as torch's two ops round them, through `h` (cols floats of scratch).
template <typename T>
void quantize_gated_row(const T* gate_up, int64_t cols, int64_t group, float* h, uint8_t* q,
                        float* scales) {
  const T* up = gate_up + cols;
  for (int64_t i = 0; i < cols; i += 16) {
    const __m512 s = as_stored<T>(silu16(load16(gate_up + i)));
    _mm512_storeu_ps(h + i, as_stored<T>(_mm512_mul_ps(s, load16(up + i))));
  }
  quantize_row(h, cols, group, q, scales);
}

struct Operands {
  const uint8_t* xq;      // [rows][in], quantized + 128
  const float* xs;        // [rows][groups]
  const int8_t* w;        // [out / 16][in / 4][16][4]
  const int32_t* sums;    // [groups][out]
  const float* wscale;    // [groups][out]
  const float* bias;      // [out] or null
  int64_t in, out, groups, group4;  // group4: a group's inputs / 4
};

// The int32 sums of rows xr[0..R) x blocks [0, B) of w over k-groups [begin, end), into
// sums[i * B + b]. Its own function: inlined into the tile, GCC kept the 24 sums on the stack.
template <int R, int B>
__attribute__((noinline)) void dot_group(const int32_t* const* xr, const int8_t* w, int64_t k4,
                                         int64_t begin, int64_t end, __m512i* out) {
  __m512i sums[R][B];
#pragma GCC unroll 8
  for (int i = 0; i < R; ++i)
#pragma GCC unroll 8
    for (int b = 0; b < B; ++b) sums[i][b] = _mm512_setzero_si512();
  for (int64_t g = begin; g < end; ++g) {
    __m512i wv[B];
#pragma GCC unroll 8
    for (int b = 0; b < B; ++b) wv[b] = _mm512_loadu_si512(w + (b * k4 + g) * kCols * 4);
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i) {
      const __m512i a = _mm512_set1_epi32(xr[i][g]);
#pragma GCC unroll 8
      for (int b = 0; b < B; ++b) sums[i][b] = _mm512_dpbusd_epi32(sums[i][b], a, wv[b]);
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < R; ++i)
#pragma GCC unroll 8
    for (int b = 0; b < B; ++b) out[i * B + b] = sums[i][b];
}

// Rows [row, row + R) x blocks [block, block + B) of the output, for per-token activations and
// per-channel weights (one group a row).
template <int R, int B, typename T>
void tile(const Operands& op, int64_t row, int64_t block, T* y) {
  const int64_t k4 = op.in / 4;
  __m512i sums[R * B];
  const int32_t* xr[R];
  for (int i = 0; i < R; ++i) xr[i] = reinterpret_cast<const int32_t*>(op.xq + (row + i) * op.in);
  dot_group<R, B>(xr, op.w + block * k4 * kCols * 4, k4, 0, k4, sums);
  for (int b = 0; b < B; ++b) {
    const int64_t col = (block + b) * kCols;
    const __m512i offset = _mm512_slli_epi32(_mm512_loadu_si512(op.sums + col), 7);
    const __m512 ws = _mm512_loadu_ps(op.wscale + col);
    for (int i = 0; i < R; ++i) {
      const __m512i exact = _mm512_sub_epi32(sums[i * B + b], offset);
      const __m512 scale = _mm512_mul_ps(_mm512_set1_ps(op.xs[row + i]), ws);
      __m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(exact), scale);
      if (op.bias != nullptr) v = _mm512_add_ps(v, _mm512_loadu_ps(op.bias + col));
      store16(y + (row + i) * op.out + col, v);
    }
  }
}

template <int R, typename T>
void tile_rows(const Operands& op, int64_t row, int64_t block, int64_t blocks, T* y) {
  switch (blocks) {
    case 4: return tile<R, 4>(op, row, block, y);
    case 3: return tile<R, 3>(op, row, block, y);
    case 2: return tile<R, 2>(op, row, block, y);
    default: return tile<R, 1>(op, row, block, y);
  }
}

template <typename T>
void tile_any(const Operands& op, int64_t row, int64_t rows, int64_t block, int64_t blocks, T* y) {
  switch (rows) {
    case 6: return tile_rows<6>(op, row, block, blocks, y);
    case 5: return tile_rows<5>(op, row, block, blocks, y);
    case 4: return tile_rows<4>(op, row, block, blocks, y);
    case 3: return tile_rows<3>(op, row, block, blocks, y);
    case 2: return tile_rows<2>(op, row, block, blocks, y);
    default: return tile_rows<1>(op, row, block, blocks, y);
  }
}

// The same for weights and activations in several groups: each group's int32 sums are scaled
// into float32 sums held in registers beside them (R x B of each: 24 registers at 3 x 4), not
// in a stack array that every group reads and writes (that was twice as slow at groups of 64
// inputs; 4 x 3, 6 x 2 and 2 x 6 tiles measured no faster than 3 x 4).
constexpr int kGroupedRows = 3;
constexpr int kGroupedBlocks = 4;

template <int R, int B, typename T>
__attribute__((noinline)) void tile_grouped(const Operands& op, int64_t row, int64_t block, T* y) {
  const int64_t k4 = op.in / 4;
  const int32_t* xr[R];
  for (int i = 0; i < R; ++i) xr[i] = reinterpret_cast<const int32_t*>(op.xq + (row + i) * op.in);
  const int8_t* w = op.w + block * k4 * kCols * 4;
  __m512 acc[R][B];
#pragma GCC unroll 8
  for (int i = 0; i < R; ++i)
#pragma GCC unroll 8
    for (int b = 0; b < B; ++b) acc[i][b] = _mm512_setzero_ps();
  for (int64_t gi = 0; gi < op.groups; ++gi) {
    __m512i sums[R][B];
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i)
#pragma GCC unroll 8
      for (int b = 0; b < B; ++b) sums[i][b] = _mm512_setzero_si512();
    for (int64_t g = gi * op.group4; g < (gi + 1) * op.group4; ++g) {
      __m512i wv[B];
#pragma GCC unroll 8
      for (int b = 0; b < B; ++b) wv[b] = _mm512_loadu_si512(w + (b * k4 + g) * kCols * 4);
#pragma GCC unroll 8
      for (int i = 0; i < R; ++i) {
        const __m512i a = _mm512_set1_epi32(xr[i][g]);
#pragma GCC unroll 8
        for (int b = 0; b < B; ++b) sums[i][b] = _mm512_dpbusd_epi32(sums[i][b], a, wv[b]);
      }
    }
#pragma GCC unroll 8
    for (int b = 0; b < B; ++b) {
      const int64_t col = (block + b) * kCols;
      const __m512i offset = _mm512_slli_epi32(_mm512_loadu_si512(op.sums + gi * op.out + col), 7);
      const __m512 ws = _mm512_loadu_ps(op.wscale + gi * op.out + col);
#pragma GCC unroll 8
      for (int i = 0; i < R; ++i) {
        const __m512 scale = _mm512_mul_ps(_mm512_set1_ps(op.xs[(row + i) * op.groups + gi]), ws);
        const __m512 part =
            _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(sums[i][b], offset)), scale);
        acc[i][b] = _mm512_add_ps(acc[i][b], part);
      }
    }
  }
  for (int b = 0; b < B; ++b) {
    const int64_t col = (block + b) * kCols;
    for (int i = 0; i < R; ++i) {
      __m512 v = acc[i][b];
      if (op.bias != nullptr) v = _mm512_add_ps(v, _mm512_loadu_ps(op.bias + col));
      store16(y + (row + i) * op.out + col, v);
    }
  }
}

template <int R, typename T>
void tile_grouped_rows(const Operands& op, int64_t row, int64_t block, int64_t blocks, T* y) {
  switch (blocks) {
    case 4: return tile_grouped<R, 4>(op, row, block, y);
    case 3: return tile_grouped<R, 3>(op, row, block, y);
    case 2: return tile_grouped<R, 2>(op, row, block, y);
    default: return tile_grouped<R, 1>(op, row, block, y);
  }
}

template <typename T>
void tile_grouped_any(const Operands& op, int64_t row, int64_t rows, int64_t block,
                      int64_t blocks, T* y) {
  switch (rows) {
    case 3: return tile_grouped_rows<3>(op, row, block, blocks, y);
    case 2: return tile_grouped_rows<2>(op, row, block, blocks, y);
    default: return tile_grouped_rows<1>(op, row, block, blocks, y);
  }
}

template <typename T>
void int8_linear_impl(const at::Tensor& x, Operands op, bool gated, at::Tensor& out) {
  const int64_t rows = x.size(0);
  // Scratch kept between calls, owned by the calling thread: the workers reach it through
  // these pointers (a thread_local named inside the lambdas would be each worker's own).
  thread_local std::vector<uint8_t> xq_scratch;
  thread_local std::vector<float> xs_scratch;
  grow(xq_scratch, rows * op.in);
  grow(xs_scratch, rows * op.groups);
  uint8_t* xq = xq_scratch.data();
  float* xs = xs_scratch.data();
  const T* xp = x.data_ptr<T>();
  const int64_t group = op.group4 * 4;
  // Below some 64K inputs the rows are quantized on this thread: waking the others costs
  // more than the pass (a decode step's 64 rows of 576 take about 5 us).
  const int64_t grain = std::max<int64_t>(1, (1 << 16) / op.in);
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    if (gated) {
      thread_local std::vector<float> h;  // this worker's own
      grow(h, op.in);
      for (int64_t r = begin; r < end; ++r)
        quantize_gated_row(xp + r * 2 * op.in, op.in, group, h.data(), xq + r * op.in,
                           xs + r * op.groups);
    } else {
      for (int64_t r = begin; r < end; ++r)
        quantize_row(xp + r * op.in, op.in, group, xq + r * op.in, xs + r * op.groups);
    }
  });
  op.xq = xq;
  op.xs = xs;
  T* y = out.data_ptr<T>();
  const bool grouped = op.groups > 1;
  const int64_t tile_rows = grouped ? kGroupedRows : kRows;
  const int64_t tile_blocks = grouped ? kGroupedBlocks : kBlocks;
  const int64_t blocks = op.out / kCols;
  const int64_t col_tiles = (blocks + tile_blocks - 1) / tile_blocks;
  const int64_t row_tiles = (rows + tile_rows - 1) / tile_rows;
  at::parallel_for(0, col_tiles * row_tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t block = (t / row_tiles) * tile_blocks, row = (t % row_tiles) * tile_rows;
      const int64_t r = std::min(tile_rows, rows - row), b = std::min(tile_blocks, blocks - block);
      if (grouped)
        tile_grouped_any(op, row, r, block, b, y);
      else
        tile_any(op, row, r, block, b, y);
    }
  });
}

#endif  // LORAGATE_HAVE_AVX512_VNNI

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& col_sums,
                       const at::Tensor& weight_scales, const std::optional<at::Tensor>& bias,
                       int64_t group, bool gated) {
  TORCH_CHECK(int8_linear_available(), "int8_linear: built for a CPU without AVX-512 VNNI");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "int8_linear: float32 or bfloat16 contiguous [rows, in] activations");
  TORCH_CHECK(packed.dim() == 4 && packed.is_contiguous() && packed.scalar_type() == at::kChar &&
                  packed.size(2) == 16 && packed.size(3) == 4,
              "int8_linear: weight packed as [out / 16, in / 4, 16, 4] int8");
  const int64_t in = packed.size(1) * 4, n = packed.size(0) * 16;
  TORCH_CHECK(x.size(1) == (gated ? 2 * in : in),
              gated ? "int8_linear: gated activations' width != twice the weight's"
                    : "int8_linear: activations' width != weight's");
  TORCH_CHECK(group > 0 && group % 16 == 0 && in % group == 0,
              "int8_linear: the group must be a multiple of 16 dividing the input width");
  const int64_t groups = in / group;
  TORCH_CHECK(col_sums.scalar_type() == at::kInt && col_sums.is_contiguous() &&
                  col_sums.dim() == 2 && col_sums.size(0) == groups && col_sums.size(1) == n,
              "int8_linear: int32 column sums [in / group, out]");
  TORCH_CHECK(weight_scales.scalar_type() == at::kFloat && weight_scales.is_contiguous() &&
                  weight_scales.dim() == 2 && weight_scales.size(0) == groups &&
                  weight_scales.size(1) == n,
              "int8_linear: float32 weight scales [in / group, out]");
  TORCH_CHECK(!bias.has_value() || (bias->scalar_type() == at::kFloat && bias->is_contiguous() &&
                                    bias->numel() == n),
              "int8_linear: float32 bias, one per output");
  at::Tensor out = at::empty({x.size(0), n}, x.options());
#ifdef LORAGATE_HAVE_AVX512_VNNI
  if (x.size(0) == 0) return out;
  Operands op{nullptr,
              nullptr,
              packed.data_ptr<int8_t>(),
              col_sums.data_ptr<int32_t>(),
              weight_scales.data_ptr<float>(),
              bias.has_value() ? bias->data_ptr<float>() : nullptr,
              in,
              n,
              groups,
              group / 4};
  if (x.scalar_type() == at::kFloat)
    int8_linear_impl<float>(x, op, gated, out);
  else
    int8_linear_impl<c10::BFloat16>(x, op, gated, out);
#endif
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(loragate, m) {
  m.def(
      "int8_linear(Tensor x, Tensor packed, Tensor col_sums, Tensor weight_scales, Tensor? bias, "
      "int group, bool gated=False) -> Tensor");
  // No tensors: one kernel for all.
  m.def("int8_linear_available() -> bool", &int8_linear_available);
}

TORCH_LIBRARY_IMPL(loragate, CPU, m) { m.impl("int8_linear", &int8_linear); }
