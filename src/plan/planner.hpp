// The planner's internals (include/fp4moe/plan.hpp has its API): the
// constants its choices rest on, each with the measurement behind it, and
// the steps MoeLayer, the grouped GEMM's launcher and the autotuner apply to
// a plan. Internal (not under include/); tested in tests/plan/test_plan.cpp.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <optional>

#include "fp4moe/plan.hpp"

namespace fp4moe {

// The architectures the planner knows (arch_limits() looks names up here).
const std::vector<ArchLimits>& arch_table();

// The SM90 row classes (GemmPlan::row_classes): where the planner picks an
// SM90 tile of 16 or 32 rows, it runs over the experts of at most its width and
// the 128-row tile over the rest; where it picks the 128-row tile for at
// most kSm90LightMaxRows expected rows, the two-block m48 tile runs first
// over the experts of at most 48 rows. Routed experts are far from equally
// loaded (the layer bench's T = 256: 12 rows on average, the largest 68),
// and a tile sized for the mean reads and dequantises a heavy expert's
// weights once per m-tile (docs/performance.md §5.11, "Row classes").
inline constexpr int kSm90LightMaxRows = 48;

// `plan` with one more row class: `config` (same epilogue) over the experts
// of more rows than the last class's and at most max_rows, before
// plan.config.
GemmPlan with_row_class(GemmPlan plan, const GemmProblem& problem, const TileConfig& config, int max_rows);

// Where the SM90 family takes over from the portable one: above
// kSm90MinRowsPerExpert rows per active expert, at every K
// (docs/performance.md §5.3). With its m8 ... m32 tiles at two
// blocks per SM it beats the portable tiles from 8 rows per expert on the
// GEMM2s of K = 1536-2880 too (T = 256), and its m128 tile beat the portable
// m64 one on Qwen3-30B's GEMM2 (K = 768) at 64 and 256 rows per expert
// (1.55-1.68x in one run); at ~5 rows (Kimi K2 at T = 256) the portable m8
// tile is still ahead.
inline constexpr double kSm90MinRowsPerExpert = 7;

// (m-tile, n-tile) pairs of `problem` with `config` that the planner expects
// (the active experts' mean rows each, rounded up to whole m-tiles).
double expected_tiles(const GemmProblem& problem, const TileConfig& config);

// Upper bound of (m-tile, n-tile) pairs of `problem` with `config` over any
// routing of its rows (what a plan's workspace and split-K counters cover).
int64_t max_tiles(const GemmProblem& problem, const TileConfig& config);

// The most K slices the planner (and the autotuner) splits a tile into.
inline constexpr int kMaxSplitK = 8;
// The planner's split-K keeps at least this much of K per slice.
inline constexpr int64_t kMinSplitKSliceK = 2048;
// Whether `split_k` is one the planner could pick for `config`: 1, or up to
// kMaxSplitK slices of at least two k-tiles each.
bool split_k_allowed(const GemmProblem& problem, const TileConfig& config, int split_k);

// Split-K needs one tile counter per (m-tile, n-tile) in the layer's
// workspace header, which holds this many per GEMM: plans with more tiles
// run unsplit (split-K only pays while tiles are few anyway).
inline constexpr int64_t kMaxSplitKTiles = 4096;
// The plan as MoeLayer runs it: split-K turned off for a batch-invariant
// layer (docs/design.md §3) and for plans with more than kMaxSplitKTiles
// tiles; the reason then says so.
GemmPlan limit_split_k(GemmPlan plan, bool batch_invariant);

// The fused decode kernel (docs/design.md §4.8): whether `tile` is one it is
// compiled for (FP4MOE_FUSED_DECODE_TILES; the epilogue is ignored), and the
// tile it runs for a forward of num_tokens whose GEMMs were planned as
// gemm1 and gemm2 (`chosen`: forced or tuned, else the heuristic's), or
// nullopt: from kFusedDecodeMinTokens to kFusedDecodeMaxTokens, where
// neither plan splits K, the heuristic's decode tile of GEMM1, else of
// GEMM2, where a chosen plan of the other GEMM has that tile (and no row
// classes).
bool is_fused_decode_tile(TileConfig tile);
std::optional<TileConfig> fused_decode_tile(int64_t num_tokens, const GemmPlan& gemm1, bool gemm1_chosen,
                                            const GemmPlan& gemm2, bool gemm2_chosen);

// Expected number of experts that receive at least one of `num_tokens`
// tokens with uniform top-k routing.
double expected_active_experts(int64_t num_experts, int top_k, int64_t num_tokens);

}  // namespace fp4moe
