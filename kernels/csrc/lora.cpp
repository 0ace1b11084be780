// Multi-LoRA for one step (SGMV for prompt runs, BGMV for decode rows): one call per
// LoRA-targeted linear adds, for each run of rows [start, end) under one slot,
//     y[start:end] += (x[start:end] @ A[slot].T) @ B[slot]
// at that adapter's own rank. kernels/lora.py's add_lora is the specification.
//
// The adapters live in one pool of rows per linear (engine/lora/pool.py), not in slots padded
// to the largest rank: slot s owns rows [offset, offset + width) of pool_a [rows, in] and
// pool_b [rows, out], and its modules' blocks of B are listed as segments: B is zero outside
// them (a q/k/v adapter's module i touches only its columns), and the loops read only them.
//
//     table[slot] = offset, width, (k0, k1, c0, c1) x 3     rows and columns of each block,
//                                                           k relative to offset; k0 == k1: none
//     runs[i]     = slot, start, end                        the step's rows under one slot
//
// The cost is each run's rows times its own rank, whatever the number of distinct adapters.
// A run of many rows (a prompt chunk) is two GEMMs through ATen (oneDNN, AMX for bf16); short
// runs (decode rows, one or two per adapter) are too small for a GEMM's setup and go to
// vectorized loops. Where the CPU has AMX, bfloat16 runs of many rows go to tiles of our own
// instead (lora_amx.h), in pieces of at most kPieceRows rows. The threads take runs (and
// pieces) as they finish the last one.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <vector>

#include "lora_amx.h"
#include "lora_avx512.h"
#include "simd.h"

namespace {

using namespace loragate;

constexpr int64_t kSegments = 3;  // modules in one fused linear at most (q, k, v)
constexpr int64_t kTableColumns = 2 + 4 * kSegments;
// Runs at least this long take the GEMM path: where a rank-16 and a rank-64 gate/up run cost
// the same both ways on AVX-512 BF16 (oneDNN's bf16 GEMM costs ~60 us whatever its size
// below that; float32's ~10 us).
inline int64_t gemm_rows(at::ScalarType dtype) { return dtype == at::kBFloat16 ? 16 : 12; }
// The loop path keeps a run's shrunk activations on the stack.
constexpr int64_t kMaxLoopRows = 15;
constexpr int64_t kMaxWidth = 1024;
// A long run on tiles is cut into pieces that the threads share: long enough that repacking
// the adapter for a piece (once per run and thread) is small beside the piece's work.
constexpr int64_t kPieceRows = 128;

struct Segment {
  int64_t k0, k1, c0, c1;
};

struct SlotView {
  int64_t offset, width, count;
  Segment segments[kSegments];
};

SlotView slot_view(const int64_t* row, int64_t pool_rows, int64_t out) {
  SlotView v{row[0], row[1], 0, {}};
  TORCH_CHECK(v.offset >= 0 && v.width >= 0 && v.offset + v.width <= pool_rows,
              "add_lora_sgmv: slot rows out of the pool");
  for (int64_t j = 0; j < kSegments; ++j) {
    const int64_t* s = row + 2 + 4 * j;
    if (s[1] <= s[0]) continue;
    TORCH_CHECK(0 <= s[0] && s[1] <= v.width && 0 <= s[2] && s[2] <= s[3] && s[3] <= out,
                "add_lora_sgmv: segment out of range");
    v.segments[v.count++] = {s[0], s[1], s[2], s[3]};
  }
  return v;
}

// shrunk[r, k] = x[r] . a[k], rounded to T as the reference's product is. The loop over k
// is outside, so that a row of A is read from memory once for the run's rows.
template <typename T>
void shrink(const T* x, int64_t x_row, int64_t rows, const T* a, int64_t width, int64_t in,
            float* shrunk) {
  for (int64_t k = 0; k < width; ++k) {
    const T* ak = a + k * in;
    for (int64_t r = 0; r < rows; ++r) {
#ifdef LORAGATE_LORA_AVX512
      shrunk[r * width + k] = dot512(x + r * x_row, ak, in);
#else
      shrunk[r * width + k] = dot(x + r * x_row, ak, in);
#endif
    }
  }
  if constexpr (!std::is_same_v<T, float>) {
    for (int64_t i = 0; i < rows * width; ++i) shrunk[i] = to_float(static_cast<T>(shrunk[i]));
  }
}

// y[r, c0:c1] += shrunk[r, k0:k1] @ b[k0:k1, c0:c1], 64 columns of y held in registers across
// the block's rows, y read and written once, rounded once.
template <typename T>
void expand(T* y, int64_t y_row, int64_t rows, const T* b, int64_t out, const float* shrunk,
            int64_t width, Segment s) {
#ifdef LORAGATE_LORA_AVX512
  for (int64_t r = 0; r < rows; ++r)
    expand_row512(y + r * y_row, b, out, shrunk + r * width, s.k0, s.k1, s.c0, s.c1);
#else
  int64_t c = s.c0;
  for (; c + 64 <= s.c1; c += 64) {
    for (int64_t r = 0; r < rows; ++r) {
      T* yr = y + r * y_row + c;
      const float* sr = shrunk + r * width;
      vec8 acc[8];
      for (int v = 0; v < 8; ++v) acc[v] = load8(yr + 8 * v);
      for (int64_t k = s.k0; k < s.k1; ++k) {
        const float w = sr[k];
        const T* bk = b + k * out + c;
        for (int v = 0; v < 8; ++v) acc[v] += w * load8(bk + 8 * v);
      }
      for (int v = 0; v < 8; ++v) store8(yr + 8 * v, acc[v]);
    }
  }
  const int64_t tail = s.c1 - c;
  if (tail == 0) return;
  float acc[64];
  for (int64_t r = 0; r < rows; ++r) {
    T* yr = y + r * y_row + c;
    const float* sr = shrunk + r * width;
    widen(yr, acc, tail);
    for (int64_t k = s.k0; k < s.k1; ++k) axpy(acc, b + k * out + c, sr[k], tail);
    narrow(acc, yr, tail);
  }
#endif
}

template <typename T>
void run_loop(at::Tensor& y, const at::Tensor& x, const T* pool_a, const T* pool_b,
              const SlotView& v, int64_t start, int64_t rows) {
  const int64_t in = x.size(1), out = y.size(1);
  float shrunk[kMaxLoopRows * kMaxWidth];
  const T* xs = x.data_ptr<T>() + start * x.stride(0);
  T* ys = y.data_ptr<T>() + start * y.stride(0);
  shrink(xs, x.stride(0), rows, pool_a + v.offset * in, v.width, in, shrunk);
  for (int64_t j = 0; j < v.count; ++j)
    expand(ys, y.stride(0), rows, pool_b + v.offset * out, out, shrunk, v.width, v.segments[j]);
}

// A prompt run: two GEMMs. The expand covers every column of y: B is zero outside each
// module's columns (engine/lora/pool.py keeps it so), and one contiguous GEMM beats one per
// module's column block on strided views (3.4x in bfloat16 at 512 rows of q/k/v).
void run_gemm(at::Tensor& y, const at::Tensor& x, const at::Tensor& pool_a,
              const at::Tensor& pool_b, const SlotView& v, int64_t start, int64_t rows) {
  const at::Tensor shrunk =
      at::mm(x.narrow(0, start, rows), pool_a.narrow(0, v.offset, v.width).t());
  y.narrow(0, start, rows).addmm_(shrunk, pool_b.narrow(0, v.offset, v.width));
}

// A run, or a piece of one on tiles: rows [start, end) under runs[run]'s slot.
struct Task {
  int64_t run, start, end;
};

// Numbers the calls, so that a thread's repacked adapter is never taken from an earlier
// call (the pool's rows may hold another adapter by then).
std::atomic<uint64_t> next_call{1};

#ifdef LORAGATE_HAVE_AMX_BF16
bool tiles_here(const at::Tensor& x) {
  return x.scalar_type() == at::kBFloat16 && lora_tiles_fit(x.size(1)) && amx_permitted();
}

void run_tiles(at::Tensor& y, const at::Tensor& x, const at::Tensor& pool_a,
               const at::Tensor& pool_b, const SlotView& v, int64_t start, int64_t rows,
               uint64_t call, bool& configured) {
  thread_local LoRATileBuffers buffers;
  if (!configured) {
    configure_tiles_16x64();
    configured = true;
  }
  const int64_t in = x.size(1), out = y.size(1);
  lora_run_amx(y.data_ptr<c10::BFloat16>() + start * y.stride(0), y.stride(0),
               x.data_ptr<c10::BFloat16>() + start * x.stride(0), x.stride(0), rows,
               pool_a.data_ptr<c10::BFloat16>() + v.offset * in,
               pool_b.data_ptr<c10::BFloat16>() + v.offset * out, v.width, in, out, call,
               buffers);
}

void release_tiles(bool configured) {
  if (configured) _tile_release();
}
#else
bool tiles_here(const at::Tensor&) { return false; }
void run_tiles(at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
               const SlotView&, int64_t, int64_t, uint64_t, bool&) {
  TORCH_CHECK(false, "add_lora_sgmv: built without AMX tiles");
}
void release_tiles(bool) {}
#endif

void add_lora_sgmv(at::Tensor y, const at::Tensor& x, const at::Tensor& pool_a,
                   const at::Tensor& pool_b, const at::Tensor& runs, const at::Tensor& table) {
  TORCH_CHECK(x.dim() == 2 && y.dim() == 2 && x.size(0) == y.size(0), "add_lora_sgmv: x/y rows");
  TORCH_CHECK(x.stride(1) == 1 && y.stride(1) == 1, "add_lora_sgmv: x and y rows contiguous");
  TORCH_CHECK(pool_a.dim() == 2 && pool_b.dim() == 2 && pool_a.size(0) == pool_b.size(0) &&
                  pool_a.size(1) == x.size(1) && pool_b.size(1) == y.size(1) &&
                  pool_a.is_contiguous() && pool_b.is_contiguous(),
              "add_lora_sgmv: pools must be contiguous [rows, in] and [rows, out]");
  TORCH_CHECK(x.scalar_type() == y.scalar_type() && x.scalar_type() == pool_a.scalar_type() &&
                  x.scalar_type() == pool_b.scalar_type(),
              "add_lora_sgmv: x, y and the pools share one dtype");
  TORCH_CHECK(runs.scalar_type() == at::kLong && runs.dim() == 2 && runs.size(1) == 3 &&
                  runs.is_contiguous() && !runs.is_cuda(),
              "add_lora_sgmv: runs must be a contiguous int64 [n, 3] CPU tensor");
  TORCH_CHECK(table.scalar_type() == at::kLong && table.dim() == 2 &&
                  table.size(1) == kTableColumns && table.is_contiguous() && !table.is_cuda(),
              "add_lora_sgmv: table must be a contiguous int64 [slots, 14] CPU tensor");
  const int64_t num_runs = runs.size(0), num_slots = table.size(0), rows = x.size(0);
  const int64_t pool_rows = pool_a.size(0), out = y.size(1);
  const int64_t* run = runs.data_ptr<int64_t>();
  const int64_t* tab = table.data_ptr<int64_t>();

  // Validate everything before touching y: a bad run fails the call, not half of it.
  const bool vectorized = x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16;
  std::vector<SlotView> views(num_runs);
  std::vector<int64_t> loops;  // runs for the loop path
  std::vector<char> looped(num_runs, 0);
  const int64_t loop_rows = std::min(gemm_rows(x.scalar_type()), kMaxLoopRows + 1);
  for (int64_t i = 0; i < num_runs; ++i) {
    const int64_t slot = run[3 * i], start = run[3 * i + 1], end = run[3 * i + 2];
    TORCH_CHECK(slot >= 0 && slot < num_slots && 0 <= start && start < end && end <= rows,
                "add_lora_sgmv: run out of range");
    views[i] = slot_view(tab + slot * kTableColumns, pool_rows, out);
    if (views[i].width == 0) continue;
    if (vectorized && end - start < loop_rows && views[i].width <= kMaxWidth) {
      loops.push_back(i);
      looped[i] = 1;
    }
  }
  // Runs on tiles are cut into pieces; GEMM runs (or pieces) first, longest first, then the
  // loops: the workers take the next one as they finish, so a step's prompt runs and decode
  // rows share the threads.
  const bool tiles = tiles_here(x);
  std::vector<Task> tasks;
  for (int64_t i = 0; i < num_runs; ++i) {
    if (views[i].width == 0 || looped[i]) continue;
    const int64_t start = run[3 * i + 1], end = run[3 * i + 2];
    const int64_t piece = tiles ? kPieceRows : end - start;
    for (int64_t s = start; s < end; s += piece) tasks.push_back({i, s, std::min(end, s + piece)});
  }
  std::stable_sort(tasks.begin(), tasks.end(),
                   [](const Task& a, const Task& b) { return a.end - a.start > b.end - b.start; });
  const size_t num_gemms = tasks.size();
  for (int64_t i : loops) tasks.push_back({i, run[3 * i + 1], run[3 * i + 2]});
  const uint64_t call = next_call++;
  auto task = [&](const Task& t, bool& configured) {
    const SlotView& v = views[t.run];
    const int64_t n = t.end - t.start;
    if (looped[t.run]) {
      if (x.scalar_type() == at::kFloat)
        run_loop<float>(y, x, pool_a.data_ptr<float>(), pool_b.data_ptr<float>(), v, t.start, n);
      else
        run_loop<c10::BFloat16>(y, x, pool_a.data_ptr<c10::BFloat16>(),
                                pool_b.data_ptr<c10::BFloat16>(), v, t.start, n);
    } else if (tiles) {
      run_tiles(y, x, pool_a, pool_b, v, t.start, n, call, configured);
    } else {
      run_gemm(y, x, pool_a, pool_b, v, t.start, n);
    }
  };
  // A lone prompt run through oneDNN is one GEMM pair that threads itself; several are each
  // too small to (oneDNN's bf16 GEMM costs ~25 us below a few hundred rows), so they run side
  // by side, as tiles' pieces do.
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), tasks.size());
  if (workers <= 1 || (!tiles && num_gemms == 1 && tasks.size() == 1)) {
    bool configured = false;
    for (const Task& t : tasks) task(t, configured);
    release_tiles(configured);
    return;
  }
  // Runs are disjoint rows of y: each worker takes whole runs or pieces. The GEMMs' ATen
  // calls need the caller's thread-local state (inference mode: y may be an inference tensor).
  std::atomic<size_t> next{0};
  const at::ThreadLocalState caller;
  at::parallel_for(0, workers, 1, [&](int64_t begin, int64_t stop) {
    const at::ThreadLocalStateGuard guard(caller);
    bool configured = false;
    for (int64_t w = begin; w < stop; ++w)
      for (size_t k = next++; k < tasks.size(); k = next++) task(tasks[k], configured);
    release_tiles(configured);
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(loragate, m) {
  m.def(
      "add_lora_sgmv(Tensor(a!) y, Tensor x, Tensor pool_a, Tensor pool_b, Tensor runs, "
      "Tensor table) -> ()");
}

TORCH_LIBRARY_IMPL(loragate, CPU, m) { m.impl("add_lora_sgmv", &add_lora_sgmv); }
