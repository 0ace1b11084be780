// The prompt runs of lora.cpp on AMX tiles (bfloat16, Sapphire Rapids and later): the same
// update, y[run] += bf16(x[run] @ A.T) @ B, the same result within float32 rounding, and no
// GEMM library call.
//
// Why: a run of tens to hundreds of rows is two skinny GEMMs (rows x in by in x rank, then
// rows x rank by rank x out). On a 2-core AMX Xeon, oneDNN's bf16 GEMM costs 25-35 us at any
// size below a few hundred rows, so a step pays about 60 us per run and linear before any
// arithmetic: a decode step of 61 rows on one adapter spent 38 ms of its 160 in LoRA, and a
// prompt step over 45 adapters 400 ms of its 1,260. The arithmetic is a few tile products.
//
// The operands as the tiles take them (a B operand holds pairs of the reduction dimension):
//   x        the run's rows where they lie: 16 rows x 32 inputs a tile;
//   A pairs  the adapter's A as (input pair, adapter row): [in / 2][width32];
//   shrunk   32 rows' x @ A.T rounded to bf16, as the reference rounds it: [32][width32],
//            zero past the adapter's width;
//   B pairs  the adapter's B as (row pair, column): [width32 / 2][out32], zero-padded.
// A and B are repacked once per run and thread (a call's pieces of one run reuse them).
// Tiles: tmm0-1 two row tiles of the A operand (x or shrunk), tmm2-3 two column tiles of the
// B operand, tmm4-7 their four products' float32 sums.
#pragma once

#include "amx.h"
#include "lora_avx512.h"  // load16, store16

#ifdef LORAGATE_HAVE_AMX_BF16

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include <c10/util/BFloat16.h>

namespace loragate {

constexpr int64_t kTileRows = 16;

// Whether a linear's runs can take the tiles: x's rows are read 32 inputs a tile.
inline bool lora_tiles_fit(int64_t in) { return in % 32 == 0; }

struct LoRATileBuffers {
  // What a_pairs and b_pairs hold: the call (its number) and the adapter's rows.
  uint64_t call = 0;
  const void* a = nullptr;
  const void* b = nullptr;
  int64_t width = 0;
  std::vector<uint32_t> a_pairs, b_pairs;
  std::vector<c10::BFloat16> shrunk, x_tail;
};

// pairs[kp][j] = (a[j][2kp], a[j][2kp + 1]) for j < width, 0 for width <= j < width32.
inline void pair_a(const c10::BFloat16* a, int64_t width, int64_t in, int64_t width32,
                   uint32_t* pairs) {
  const int64_t kps = in / 2;
  const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i rows = _mm512_mullo_epi32(lanes, _mm512_set1_epi32(static_cast<int>(kps)));
  const auto* words = reinterpret_cast<const int*>(a);
  for (int64_t kp = 0; kp < kps; ++kp) {
    uint32_t* dst = pairs + kp * width32;
    for (int64_t j = 0; j < width32; j += 16) {
      const int64_t left = width - j;
      const __mmask16 m = left >= 16 ? 0xffff : left <= 0 ? 0 : (1u << left) - 1;
      const __m512i v = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), m, rows,
                                                    words + j * kps + kp, 4);
      _mm512_storeu_si512(dst + j, v);
    }
  }
}

// pairs[kp][c] = (b[2kp][c], b[2kp + 1][c]), zero past width rows and out columns.
inline void pair_b(const c10::BFloat16* b, int64_t width, int64_t out, int64_t width32,
                   int64_t out32, uint32_t* pairs) {
  for (int64_t kp = 0; kp < width32 / 2; ++kp) {
    uint32_t* dst = pairs + kp * out32;
    const bool has0 = 2 * kp < width, has1 = 2 * kp + 1 < width;
    const c10::BFloat16* r0 = b + 2 * kp * out;
    const c10::BFloat16* r1 = r0 + out;
    for (int64_t c = 0; c < out32; c += 16) {
      const int64_t left = out - c;
      const __mmask16 m = left >= 16 ? 0xffff : left <= 0 ? 0 : (1u << left) - 1;
      const __m512i lo = _mm512_cvtepu16_epi32(
          has0 ? _mm256_maskz_loadu_epi16(m, r0 + c) : _mm256_setzero_si256());
      const __m512i hi = _mm512_cvtepu16_epi32(
          has1 ? _mm256_maskz_loadu_epi16(m, r1 + c) : _mm256_setzero_si256());
      _mm512_storeu_si512(dst + c, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
    }
  }
}

// tmm4-7 = a 32 x 32 block of A @ B over `steps` chunks of 32 of the reduction: A's two
// 16-row tiles at a and a + 16 * a_row (elements), chunk k 32 elements on; B's two 16-column
// tiles of pairs at b and b + 16 (rows b_row dwords apart), chunk k 16 * b_row dwords on.
inline void product_block(const c10::BFloat16* a, int64_t a_row, const uint32_t* b,
                          int64_t b_row, int64_t steps) {
  _tile_zero(4);
  _tile_zero(5);
  _tile_zero(6);
  _tile_zero(7);
  for (int64_t k = 0; k < steps; ++k) {
    _tile_loadd(0, a + 32 * k, a_row * sizeof(c10::BFloat16));
    _tile_loadd(1, a + kTileRows * a_row + 32 * k, a_row * sizeof(c10::BFloat16));
    const uint32_t* bk = b + 16 * k * b_row;
    _tile_loadd(2, bk, b_row * sizeof(uint32_t));
    _tile_loadd(3, bk + 16, b_row * sizeof(uint32_t));
    _tile_dpbf16ps(4, 0, 2);
    _tile_dpbf16ps(5, 0, 3);
    _tile_dpbf16ps(6, 1, 2);
    _tile_dpbf16ps(7, 1, 3);
  }
}

// The block's sums into `sums` ([32][32], 128-byte rows): tmm4-7 hold rows 0-15 x columns
// 0-15, 0-15 x 16-31, 16-31 x 0-15, 16-31 x 16-31.
inline void store_block(float* sums) {
  _tile_stored(4, sums, 32 * sizeof(float));
  _tile_stored(5, sums + 16, 32 * sizeof(float));
  _tile_stored(6, sums + 16 * 32, 32 * sizeof(float));
  _tile_stored(7, sums + 16 * 32 + 16, 32 * sizeof(float));
}

// y[0:rows] += bf16(x[0:rows] @ a.T) @ b for a slot of `width` rows; the caller has
// configured the tiles (configure_tiles_16x64) on this thread. 32 rows by 32 columns at a
// time: four accumulators, so that a tile product never waits for the one before it (a
// chain of them into one tile runs at their latency, three times their throughput).
inline void lora_run_amx(c10::BFloat16* y, int64_t y_stride, const c10::BFloat16* x,
                         int64_t x_stride, int64_t rows, const c10::BFloat16* a,
                         const c10::BFloat16* b, int64_t width, int64_t in, int64_t out,
                         uint64_t call, LoRATileBuffers& buf) {
  constexpr int64_t kBlock = 2 * kTileRows;
  const int64_t width32 = round_up(width, 32), out32 = round_up(out, 32);
  if (buf.call != call || buf.a != a || buf.b != b || buf.width != width) {
    buf.a_pairs.resize(in / 2 * width32);
    buf.b_pairs.resize(width32 / 2 * out32);
    pair_a(a, width, in, width32, buf.a_pairs.data());
    pair_b(b, width, out, width32, out32, buf.b_pairs.data());
    buf.call = call;
    buf.a = a;
    buf.b = b;
    buf.width = width;
  }
  buf.shrunk.resize(kBlock * width32);
  c10::BFloat16* shrunk = buf.shrunk.data();
  const uint32_t* a_pairs = buf.a_pairs.data();
  const uint32_t* b_pairs = buf.b_pairs.data();
  alignas(64) float sums[kBlock * 32];
  for (int64_t r0 = 0; r0 < rows; r0 += kBlock) {
    const int64_t m = std::min(kBlock, rows - r0);
    // A short last block reads its rows from a zero-padded copy: past the run lie other
    // runs' rows, or the end of x.
    const c10::BFloat16* xs = x + r0 * x_stride;
    int64_t xs_rows = x_stride;
    if (m < kBlock) {
      buf.x_tail.assign(kBlock * in, c10::BFloat16(0.f));
      for (int64_t i = 0; i < m; ++i)
        std::memcpy(buf.x_tail.data() + i * in, xs + i * x_stride, in * sizeof(c10::BFloat16));
      xs = buf.x_tail.data();
      xs_rows = in;
    }
    for (int64_t j = 0; j < width32; j += 32) {
      product_block(xs, xs_rows, a_pairs + j, width32, in / 32);
      store_block(sums);
      for (int64_t i = 0; i < kBlock; ++i) {
        store16(shrunk + i * width32 + j, load16(sums + 32 * i));
        store16(shrunk + i * width32 + j + 16, load16(sums + 32 * i + 16));
      }
    }
    c10::BFloat16* ys = y + r0 * y_stride;
    for (int64_t c = 0; c < out; c += 32) {
      product_block(shrunk, width32, b_pairs + c, out32, width32 / 32);
      store_block(sums);
      for (int64_t half = 0; half < 32 && c + half < out; half += 16) {
        const int64_t left = out - c - half;
        const __mmask16 mask = left >= 16 ? 0xffff : (1u << left) - 1;
        for (int64_t i = 0; i < m; ++i) {
          c10::BFloat16* yr = ys + i * y_stride + c + half;
          store16(yr, _mm512_add_ps(load16(yr, mask), load16(sums + 32 * i + half)), mask);
        }
      }
    }
  }
}

}  // namespace loragate

#endif  // LORAGATE_HAVE_AMX_BF16
