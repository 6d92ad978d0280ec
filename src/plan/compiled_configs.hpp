// The tile configurations compiled into the library: one X-macro that the
// kernel instantiations, the launch dispatch, the planner and the tests all
// expand, so they cannot drift apart.
//
// X(BLOCK_N, BLOCK_M, BLOCK_K, STAGES, WARPS, EPILOGUE)
//   BLOCK_N  weight rows (output features) per tile, the MMA's M side
//   BLOCK_M  token rows per tile, the MMA's N side
//   BLOCK_K  K elements per pipeline stage
//   STAGES   cp.async pipeline depth
//   WARPS    warps per block; each owns BLOCK_N / WARPS weight rows
//   EPILOGUE fp4moe::Epilogue: every tile shape is compiled with each epilogue
//
// Only configurations that earned their place in the sweeps of
// docs/performance.md §5.1 and §5.7: one per token-tile size,
// and the m8 tile at two pipeline depths (4 stages: two blocks per SM on
// SM90, more bytes in flight per block; 3 stages: three blocks per SM; the
// planner picks by waves of units, plan_gemm), each <= 99 KB so the same
// list runs on SM120 and SM86 as on SM90.
#pragma once

#define FP4MOE_PORTABLE_TILES(X, EPI) \
  X(128, 8, 256, 4, 4, EPI)           \
  X(128, 8, 256, 3, 4, EPI)           \
  X(128, 32, 128, 4, 4, EPI)          \
  X(128, 64, 128, 3, 4, EPI)

#define FP4MOE_PORTABLE_KERNELS(X)                      \
  FP4MOE_PORTABLE_TILES(X, ::fp4moe::Epilogue::kNone)   \
  FP4MOE_PORTABLE_TILES(X, ::fp4moe::Epilogue::kSwiglu) \
  FP4MOE_PORTABLE_TILES(X, ::fp4moe::Epilogue::kFinalize)

// The portable tiles the fused decode kernel (kernels/fused_decode.cuh) is
// compiled for: the planner's tiles of small forwards, at both depths.
// X(BLOCK_N, BLOCK_M, BLOCK_K, STAGES, WARPS)
#define FP4MOE_FUSED_DECODE_TILES(X) \
  X(128, 8, 256, 4, 4)               \
  X(128, 8, 256, 3, 4)

// The SM90a family (sm90_grouped_gemm.cuh): BLOCK_N is always kSm90BlockN
// (two consumer warpgroups of 64 weight rows) and 12 warps.
// X(BLOCK_M, BLOCK_K, STAGES, EPILOGUE)
//   BLOCK_M  token rows per tile: the wgmma's N (8 ... 256)
//   BLOCK_K  K elements per pipeline stage: 64 or 128 (with four 64-wide
//            fragments per stage ptxas serialises the wgmmas, C7513)
//   STAGES   depth of the mbarrier ring
// The m8 ... m64 tiles are shallow enough for two blocks per SM
// (Sm90SmemLayout::blocks_per_sm), which beat one block with a deeper ring at
// 93 of 96 points for m8 ... m32 (docs/performance.md §5.6).
// m48 and the two-block m64 beat m128 by 1.07-1.20x on uniformly routed
// experts of 32-51 rows but lost to it in the layer's skewed routing
// (docs/performance.md §5.10): the planner skips them (and the one-block m64)
// as a GEMM's tile but runs the two-block m48 over the experts of at most
// kSm90LightMaxRows rows (its row classes); the tuner may pick any of them.
// sm90n128m128k64s3w12 fits the 101,376-byte budget of SM120/SM86-class parts
// (fp4moe plan --arch sm120), as do the m48 and two-block m64 tiles. m160
// (widths 40, 80, 120, 144, 160) holds an expert of 129-160 rows in one unit
// where m128 adds a second, mostly empty one that reads and dequantises the
// whole weight tile again (half of DeepSeek-V3's experts at T = 4096 under
// uniform routing); the planner takes it where its expected units, each
// costing kSm90M160UnitCost m128 units, cost less than m128's (planner.cpp,
// sm90_m160_saves_units). Steps of 32 (five mainloop copies) and an m192 tile
// spilled.
#define FP4MOE_SM90_TILES(X, EPI) \
  X(8, 128, 9, EPI)               \
  X(16, 128, 7, EPI)              \
  X(32, 128, 5, EPI)              \
  X(48, 128, 4, EPI)              \
  X(64, 128, 3, EPI)              \
  X(64, 128, 6, EPI)              \
  X(128, 128, 4, EPI)             \
  X(128, 64, 3, EPI)              \
  X(160, 128, 4, EPI)             \
  X(256, 64, 4, EPI)

#define FP4MOE_SM90_KERNELS(X)                      \
  FP4MOE_SM90_TILES(X, ::fp4moe::Epilogue::kNone)   \
  FP4MOE_SM90_TILES(X, ::fp4moe::Epilogue::kSwiglu) \
  FP4MOE_SM90_TILES(X, ::fp4moe::Epilogue::kFinalize)

namespace fp4moe {

// An m160 unit's time over an m128 unit's, measured (H100, GEMM bench,
// uniform routing; docs/performance.md §5.12): the one statement of where
// the planner takes the 160-row tile, which plan_gemm derives from it and
// the expected units of each tile.
inline constexpr double kSm90M160UnitCost = 1.14;

}  // namespace fp4moe
