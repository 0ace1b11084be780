// What every AMX kernel needs (Sapphire Rapids and later): the permission to use the tiles
// and the tile configuration's layout. LORAGATE_HAVE_AMX_BF16 is defined where the build
// targets AMX-BF16 (kernels/cpu_features.py's flags); amx_permitted() says at run time
// whether Linux lets this process use the tiles.
#pragma once

#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define LORAGATE_HAVE_AMX_BF16 1

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace loragate {

// Linux hands a process the tiles' 8 KB of state only when it asks (since 5.16).
inline bool amx_permitted() {
  static const bool permitted = [] {
    constexpr int kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return permitted;
}

// ldtilecfg's 64-byte operand: palette 1, then each tile's bytes per row and rows.
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Every tile 16 rows of 64 bytes: 16 x 32 bf16 operands, 16 x 16 float32 sums (what the
// LoRA runs and the decode cascade use; prefill attention has a layout of its own).
inline void configure_tiles_16x64() {
  TileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.rows[t] = 16;
    config.colsb[t] = 64;
  }
  _tile_loadconfig(&config);
}

inline int64_t round_up(int64_t n, int64_t multiple) {
  return (n + multiple - 1) / multiple * multiple;
}

}  // namespace loragate

#endif
