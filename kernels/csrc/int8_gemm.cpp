// The int8 linear's GEMM at decode sizes (a few dozen rows) on CPUs with AVX-512 VNNI:
// acc[m][n] = sum_k x[m][k] * w[n][k], int8 x int8 -> int32, exactly what torch._int_mm
// returns (integer sums are exact, so the two agree bit for bit).
//
// Why: torch's int8 GEMM reads the plain [out, in] weight every call and, at 16 rows, ran no
// faster than oneDNN's prepacked bf16 GEMM, so int8 weights bought decode nothing. Here the
// weight is packed once, at load, as [out / 16][in / 4][16][4]: one 64-byte load holds four
// consecutive inputs of sixteen outputs, what vpdpbusd multiplies against four of a row's
// inputs broadcast. vpdpbusd takes unsigned activations: x + 128 (its sign bit flipped), and
// 128 * sum_k w[n][k] (col_sums, also computed at load) is taken back off.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>

#if defined(__AVX512F__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#define LORAGATE_HAVE_AVX512_VNNI 1
#endif

namespace {

constexpr int64_t kCols = 16;     // outputs per packed block (one int32 vector)
constexpr int kBlocksPerTask = 4;  // column blocks a task keeps in registers
constexpr int kRowTile = 4;        // rows multiplied per pass over a task's weights

#ifdef LORAGATE_HAVE_AVX512_VNNI
// Rows [row, row + kRowTile) (the last repeated past `rows`) times blocks [block, block +
// kBlocks) of the packed weight, into acc.
template <int kBlocks>
inline void tile(const int8_t* x, int64_t rows, int64_t row, int64_t k_groups, const int8_t* w,
                 int64_t block, const int32_t* col_sums, int32_t* acc, int64_t n) {
  const int32_t* xr[kRowTile];
  for (int i = 0; i < kRowTile; ++i)
    xr[i] = reinterpret_cast<const int32_t*>(x + std::min(row + i, rows - 1) * k_groups * 4);
  __m512i sums[kRowTile][kBlocks];
  for (int i = 0; i < kRowTile; ++i)
    for (int b = 0; b < kBlocks; ++b) sums[i][b] = _mm512_setzero_si512();
  const __m512i flip = _mm512_set1_epi32(static_cast<int32_t>(0x80808080u));
  for (int64_t g = 0; g < k_groups; ++g) {
    __m512i wv[kBlocks];
    for (int b = 0; b < kBlocks; ++b)
      wv[b] = _mm512_loadu_si512(w + ((block + b) * k_groups + g) * kCols * 4);
    for (int i = 0; i < kRowTile; ++i) {
      const __m512i a = _mm512_xor_si512(_mm512_set1_epi32(xr[i][g]), flip);
      for (int b = 0; b < kBlocks; ++b) sums[i][b] = _mm512_dpbusd_epi32(sums[i][b], a, wv[b]);
    }
  }
  for (int b = 0; b < kBlocks; ++b) {
    const int64_t col = (block + b) * kCols;
    const __m512i offset = _mm512_slli_epi32(_mm512_loadu_si512(col_sums + col), 7);
    for (int i = 0; i < kRowTile && row + i < rows; ++i)
      _mm512_storeu_si512(acc + (row + i) * n + col, _mm512_sub_epi32(sums[i][b], offset));
  }
}
#endif

bool int8_mm_available() {
#ifdef LORAGATE_HAVE_AVX512_VNNI
  return true;
#else
  return false;
#endif
}

at::Tensor int8_mm_packed(const at::Tensor& x, const at::Tensor& packed,
                          const at::Tensor& col_sums) {
  TORCH_CHECK(int8_mm_available(), "int8_mm_packed: built for a CPU without AVX-512 VNNI");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kChar,
              "int8_mm_packed: int8 contiguous [rows, in] activations");
  TORCH_CHECK(packed.dim() == 4 && packed.is_contiguous() && packed.scalar_type() == at::kChar &&
                  packed.size(2) == kCols && packed.size(3) == 4,
              "int8_mm_packed: weight packed as [out / 16, in / 4, 16, 4] int8");
  const int64_t rows = x.size(0), k_groups = packed.size(1), n = packed.size(0) * kCols;
  TORCH_CHECK(x.size(1) == k_groups * 4, "int8_mm_packed: activations' width != weight's");
  TORCH_CHECK(col_sums.scalar_type() == at::kInt && col_sums.is_contiguous() &&
                  col_sums.numel() == n,
              "int8_mm_packed: int32 column sums, one per output");
  at::Tensor acc = at::empty({rows, n}, x.options().dtype(at::kInt));
#ifdef LORAGATE_HAVE_AVX512_VNNI
  const int8_t* xp = x.data_ptr<int8_t>();
  const int8_t* wp = packed.data_ptr<int8_t>();
  const int32_t* cs = col_sums.data_ptr<int32_t>();
  int32_t* ap = acc.data_ptr<int32_t>();
  const int64_t blocks = packed.size(0);
  const int64_t tasks = (blocks + kBlocksPerTask - 1) / kBlocksPerTask;
  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t block = t * kBlocksPerTask;
      for (int64_t row = 0; row < rows; row += kRowTile) {
        if (block + kBlocksPerTask <= blocks) {
          tile<kBlocksPerTask>(xp, rows, row, k_groups, wp, block, cs, ap, n);
        } else {
          for (int64_t b = block; b < blocks; ++b) tile<1>(xp, rows, row, k_groups, wp, b, cs, ap, n);
        }
      }
    }
  });
#endif
  return acc;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(loragate, m) {
  m.def("int8_mm_packed(Tensor x, Tensor packed, Tensor col_sums) -> Tensor");
  m.def("int8_mm_available() -> bool", &int8_mm_available);  // no tensors: one kernel for all
}

TORCH_LIBRARY_IMPL(loragate, CPU, m) { m.impl("int8_mm_packed", &int8_mm_packed); }
