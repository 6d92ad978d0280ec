// Tests of the shared-memory model, the fit checks and the planner (host only).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "fp4moe/error.hpp"
#include "fp4moe/plan.hpp"
#include "plan/planner.hpp"
#include "plan/smem_model.hpp"

namespace fp4moe {
namespace {

TEST(TileConfig, RoundTripsThroughItsName) {
  for (const TileConfig& c : compiled_configs()) EXPECT_EQ(TileConfig::parse(c.to_string()), c);
  EXPECT_EQ(TileConfig::parse("n128m8k256s4w4").block_k, 256);
  EXPECT_THROW(TileConfig::parse("n128m8k256"), Error);
  EXPECT_THROW(TileConfig::parse("n128m8k256s4w4x"), Error);
  EXPECT_THROW(TileConfig::parse("n0m8k256s4w4"), Error);
  EXPECT_EQ(TileConfig::parse("n128m8k256s4w4-swiglu").epilogue, Epilogue::kSwiglu);
  EXPECT_EQ(TileConfig::parse("n128m8k256s4w4-finalize").epilogue, Epilogue::kFinalize);
  EXPECT_EQ(TileConfig::parse("n128m8k256s4w4").epilogue, Epilogue::kNone);
  EXPECT_THROW(TileConfig::parse("n128m8k256s4w4-gelu"), Error);
  const TileConfig sm90 = TileConfig::parse("sm90n128m64k128s6w12-finalize");
  EXPECT_EQ(sm90.family, KernelFamily::kSm90);
  EXPECT_EQ(sm90.block_m, 64);
  EXPECT_EQ(sm90.epilogue, Epilogue::kFinalize);
  EXPECT_EQ(TileConfig::parse("n128m64k128s6w12").family, KernelFamily::kPortable);
  EXPECT_THROW(TileConfig::parse("sm90"), Error);
}

TEST(TileConfig, EveryTileShapeIsCompiledWithEveryEpilogue) {
  for (const TileConfig& c : compiled_configs())
    for (Epilogue e : {Epilogue::kNone, Epilogue::kSwiglu, Epilogue::kFinalize}) {
      TileConfig other = c;
      other.epilogue = e;
      EXPECT_TRUE(is_compiled(other)) << other.to_string();
    }
}

TEST(SmemModel, EpilogueStagingPerKind) {
  // (BLOCK_M, row) with row = BLOCK_N+8 bf16, BLOCK_N/2+8 bf16, BLOCK_N+4 fp32.
  EXPECT_EQ(portable_smem_layout(128, 64, 128, 3, Epilogue::kNone).epilogue_bytes, 64 * 136 * 2);
  EXPECT_EQ(portable_smem_layout(128, 64, 128, 3, Epilogue::kSwiglu).epilogue_bytes, 64 * 72 * 2);
  EXPECT_EQ(portable_smem_layout(128, 64, 128, 3, Epilogue::kFinalize).epilogue_bytes, 64 * 132 * 4);
  // A staging tile larger than the drained pipeline grows the union (a
  // one-stage, short-K tile with a fp32 finalize staging).
  const PortableSmemLayout tiny = portable_smem_layout(128, 64, 64, 1, Epilogue::kFinalize);
  EXPECT_GT(tiny.epilogue_bytes, tiny.mainloop_end);
  EXPECT_EQ(tiny.union_end, align_up(tiny.epilogue_bytes, kSmemAlign));
}

TEST(SmemModel, RegionsAreDisjointAlignedAndSumToTotal) {
  for (const TileConfig& c : compiled_configs()) {
    if (c.family != KernelFamily::kPortable) continue;
    const SmemLayout layout = smem_layout(c);
    const PortableSmemLayout l = portable_smem_layout(c.block_n, c.block_m, c.block_k, c.stages, c.epilogue);
    EXPECT_EQ(l.weight_bytes, int64_t{c.stages} * c.block_n * c.block_k / 2) << c.to_string();
    EXPECT_EQ(l.scale_bytes, int64_t{c.stages} * c.block_n * c.block_k / 16) << c.to_string();
    EXPECT_EQ(l.act_bytes, int64_t{c.stages} * c.block_m * c.block_k * 2) << c.to_string();
    // Mainloop regions in order, non-overlapping, 128-B aligned.
    EXPECT_LE(l.weight_offset + l.weight_bytes, l.scale_offset);
    EXPECT_LE(l.scale_offset + l.scale_bytes, l.act_offset);
    EXPECT_LE(l.act_offset + l.act_bytes, l.mainloop_end);
    for (int64_t off : {l.weight_offset, l.scale_offset, l.act_offset, l.schedule_offset})
      EXPECT_EQ(off % kSmemAlign, 0) << c.to_string();
    // The epilogue reuses the mainloop and stays inside the union.
    EXPECT_LE(l.epilogue_offset + l.epilogue_bytes, l.union_end);
    EXPECT_EQ(l.epilogue_bytes, int64_t{c.block_m} * l.epi_row_elems * l.epi_elem_bytes);
    EXPECT_LE(l.union_end, l.rows_offset);
    EXPECT_EQ(l.rows_bytes, 3 * 4 * int64_t{c.block_m});
    EXPECT_LE(l.rows_offset + l.rows_bytes, l.schedule_offset);
    EXPECT_LE(l.schedule_offset + l.schedule_bytes, l.flag_offset);
    EXPECT_LE(l.flag_offset + l.flag_bytes, l.total_bytes);
    EXPECT_EQ(layout.total_bytes, l.total_bytes);
    // Every portable config fits the smallest (SM120 / SM86) budget.
    EXPECT_LE(l.total_bytes, kPortableSmemLimit) << c.to_string();
    EXPECT_TRUE(check_fit(c, arch_limits("sm120").smem_per_block).fits) << c.to_string();
  }
}

TEST(SmemModel, Sm90RegionsAreDisjointAlignedAndSumToTotal) {
  int prefill_tiles_fitting_sm120 = 0;
  for (const TileConfig& c : compiled_configs()) {
    if (c.family != KernelFamily::kSm90) continue;
    const SmemLayout layout = smem_layout(c);
    const Sm90SmemLayout l = sm90_smem_layout(c);
    EXPECT_EQ(c.block_n, kSm90BlockN);
    EXPECT_EQ(l.act_bytes, int64_t{c.stages} * c.block_m * c.block_k * 2) << c.to_string();
    EXPECT_EQ(l.weight_bytes, int64_t{c.stages} * c.block_n * c.block_k / 2) << c.to_string();
    EXPECT_EQ(l.scale_bytes, int64_t{c.stages} * c.block_n * c.block_k / 16) << c.to_string();
    // The swizzled activation atoms (8 rows x 128 B) start on 1024-B boundaries in every stage.
    EXPECT_EQ(l.act_offset % kSm90AtomAlign, 0);
    EXPECT_EQ(l.act_stage_bytes % kSm90AtomAlign, 0) << c.to_string();
    // Regions in order, non-overlapping; the bulk-copy targets 16-B aligned.
    const int64_t ends[][2] = {{l.act_offset + l.act_bytes, l.weight_offset},
                               {l.weight_offset + l.weight_bytes, l.scale_offset},
                               {l.scale_offset + l.scale_bytes, l.barrier_offset},
                               {l.barrier_offset + l.barrier_bytes, l.ring_end},
                               {l.ring_end, l.epilogue_offset},
                               {l.epilogue_offset + l.epilogue_bytes, l.rows_offset},
                               {l.rows_offset + l.rows_bytes, l.slots_offset},
                               {l.slots_offset + l.slots_bytes, l.schedule_offset},
                               {l.schedule_offset + l.schedule_bytes, l.flag_offset},
                               {l.flag_offset + l.flag_bytes, l.total_bytes}};
    for (const auto& e : ends) EXPECT_LE(e[0], e[1]) << c.to_string();
    for (int64_t off : {l.weight_offset, l.scale_offset, l.barrier_offset, l.weight_stage_bytes, l.scale_stage_bytes,
                        l.epilogue_offset})
      EXPECT_EQ(off % 16, 0) << c.to_string();
    EXPECT_EQ(l.barrier_bytes, kSm90StageBarriers * 8 * int64_t{c.stages});
    // The finalize epilogue's per-warpgroup (slot, router weight) table; no other epilogue has one.
    EXPECT_EQ(l.slots_bytes, c.epilogue == Epilogue::kFinalize ? int64_t{kSm90Consumers} * c.block_m * 8 : 0)
        << c.to_string();
    EXPECT_EQ(l.slots_offset % 16, 0) << c.to_string();
    EXPECT_EQ(c.block_m % l.chunk_tokens, 0) << c.to_string();
    EXPECT_LE(l.chunk_tokens, kSm90EpilogueChunk) << c.to_string();
    EXPECT_EQ(l.epilogue_bytes, int64_t{kSm90Consumers} * l.chunk_tokens * l.epi_row_elems * l.epi_elem_bytes);
    EXPECT_EQ(layout.total_bytes, l.total_bytes);
    EXPECT_LE(l.total_bytes, kSmemLimitSm90) << c.to_string();
    EXPECT_TRUE(check_fit(c, arch_limits("sm90").smem_per_block).fits) << c.to_string();
    if (c.block_m == 128) prefill_tiles_fitting_sm120 += check_fit(c, arch_limits("sm120").smem_per_block).fits;
  }
  // One 128-row tile shape (with each epilogue) fits the 101,376 B of SM120 / SM86.
  EXPECT_EQ(prefill_tiles_fitting_sm120, 3);
}

TEST(SmemModel, Sm90TwoBlockTilesFitHalfAnSmAndCompileAtMostTwoWidths) {
  int two_block = 0;
  for (const TileConfig& c : compiled_configs()) {
    if (c.family != KernelFamily::kSm90) continue;
    const Sm90SmemLayout l = sm90_smem_layout(c);
    const int step = sm90_mma_width_step(c.block_m, l.blocks_per_sm);
    EXPECT_EQ(c.block_m % step, 0) << c.to_string();
    EXPECT_EQ(blocks_per_sm_by_smem(c, arch_limits("sm90")), l.blocks_per_sm) << c.to_string();
    if (l.blocks_per_sm == 1) continue;
    ++two_block;
    EXPECT_LE(c.block_m, kSm90TwoBlocksMaxBlockM) << c.to_string();
    EXPECT_LE(2 * (l.total_bytes + kSmemReservedPerBlock), kSmemPerSmSm90) << c.to_string();
    // The consumers' 104 registers hold two mainloop copies at most, one above 32 rows.
    EXPECT_LE(c.block_m / step, c.block_m > 32 ? 1 : 2) << c.to_string();
  }
  EXPECT_GT(two_block, 0);
  // One block where two do not fit, whatever the tile.
  EXPECT_EQ(sm90_smem_layout(64, 128, 6, Epilogue::kNone).blocks_per_sm, 1);
  EXPECT_EQ(sm90_smem_layout(128, 64, 3, Epilogue::kNone).blocks_per_sm, 1);  // fits twice, too many accumulators
  EXPECT_EQ(sm90_smem_layout(32, 128, 5, Epilogue::kFinalize).blocks_per_sm, 2);
  EXPECT_EQ(sm90_smem_layout(32, 128, 6, Epilogue::kFinalize).blocks_per_sm, 1);
}

TEST(SmemModel, RefusesWithBreakdownAndAdvice) {
  // Fewer stages make it fit.
  const FitReport by_stages = check_fit(TileConfig::parse("n128m32k256s4w4"), 101376);
  EXPECT_FALSE(by_stages.fits);
  EXPECT_NE(by_stages.advice.find("fits with stages=2"), std::string::npos) << by_stages.advice;
  // Even two stages are too many: a shorter block_k makes it fit.
  const TileConfig big = TileConfig::parse("n128m64k256s4w4");
  const FitReport fit = check_fit(big, arch_limits("sm120").smem_per_block);
  EXPECT_FALSE(fit.fits);
  EXPECT_GT(fit.total_bytes, 101376);
  EXPECT_NE(fit.advice.find("fits with block_k=64"), std::string::npos) << fit.advice;
  const std::string table = format_layout(big, 101376);
  for (const char* region : {"weights", "scales", "activations", "epilogue", "schedule", "total", "limit"})
    EXPECT_NE(table.find(region), std::string::npos) << table;
  EXPECT_NE(table.find("DOES NOT FIT"), std::string::npos) << table;
  // The same config fits SM90's 227 KB.
  EXPECT_TRUE(check_fit(big, arch_limits("sm90").smem_per_block).fits);
  // Below every option: a clear "no" with what to change.
  const FitReport tiny = check_fit(big, 4096);
  EXPECT_FALSE(tiny.fits);
  EXPECT_NE(tiny.advice.find("smaller block_m"), std::string::npos) << tiny.advice;
}

TEST(ArchLimits, KnowsTheBudgets) {
  EXPECT_EQ(arch_limits("sm80").smem_per_block, 166912);
  EXPECT_EQ(arch_limits("sm86").smem_per_block, 101376);
  EXPECT_EQ(arch_limits("sm89").smem_per_block, 101376);
  EXPECT_EQ(arch_limits("sm90").smem_per_block, 232448);
  EXPECT_EQ(arch_limits("sm100").smem_per_block, 232448);
  EXPECT_EQ(arch_limits("sm120").smem_per_block, 101376);
  EXPECT_THROW(arch_limits("sm75"), Error);
}

TEST(Planner, PicksTokenTileByRowsPerExpert) {
  GemmProblem p{256, 4096, 7168, 8, 0};  // DeepSeek-V3 GEMM1, one token
  GemmPlan plan = plan_gemm(p, 232448, 132);
  EXPECT_EQ(plan.config.block_m, 8) << plan.reason();
  p.num_rows = 16384 * 8;  // prefill: 512 rows per expert
  plan = plan_gemm(p, 232448, 132);
  EXPECT_EQ(plan.config.block_m, 64) << plan.reason();
  EXPECT_EQ(plan.split_k, 1) << plan.reason();
  GemmProblem mixtral{8, 4096, 14336, 2, 0};  // Mixtral GEMM2 at T = 1: 64 tiles, long K
  plan = plan_gemm(mixtral, 232448, 132);
  // Split-K fills the idle block slots: 64 tiles x 4 slices <= 132 SMs x 2.
  EXPECT_EQ(plan.split_k, 4) << plan.reason();
  // The tile bound covers any routing: all rows on one expert, or one per expert.
  EXPECT_GE(plan.max_tiles, 2 * (4096 / 128));
  // Never a split that needs a second wave of slots, nor slices shorter than
  // kMinSplitKSliceK: DeepSeek-V3's GEMM2 at one token (K = 2048) is unsplit.
  EXPECT_EQ(plan_gemm(moe_gemm_problem(2, 256, 8, 7168, 2048, 1), 232448, 132).split_k, 1);
  GemmProblem wide = mixtral;
  wide.num_rows = 16;  // 8 experts x 32 tiles = 256 of 264 slots: no room for a second slice
  EXPECT_EQ(plan_gemm(wide, 232448, 132).split_k, 1) << plan_gemm(wide, 232448, 132).reason();
}

TEST(Planner, PortableM8PipelineDepthFollowsTheWaves) {
  const auto stages = [](const GemmProblem& p) { return plan_gemm(p, 232448, 132, 90).config.stages; };
  // One wave of the 4-stage tile's 264 slots holds every unit: 4 stages
  // (DeepSeek-V3 GEMM1 at T = 1: 8 experts x 32 n-tiles = 256 units).
  EXPECT_EQ(stages(moe_gemm_problem(1, 256, 8, 7168, 2048, 1)), 4);
  // GLM-5 GEMM2 at T = 1: 8 x 48 = 384 units, one wave of the 3-stage tile's
  // 396 slots (three blocks per SM).
  EXPECT_EQ(stages(moe_gemm_problem(2, 256, 8, 6144, 2048, 1)), 3);
  // DeepSeek-V3 GEMM2 at T = 1: 8 x 56 = 448 units would spill 52 into a
  // second wave of the 3-stage tile; two waves of the 4-stage one take them.
  EXPECT_EQ(stages(moe_gemm_problem(2, 256, 8, 7168, 2048, 1)), 4);
  // Many waves (T = 16, 64): the third block per SM.
  for (int64_t tokens : {16, 64}) {
    EXPECT_EQ(stages(moe_gemm_problem(1, 256, 8, 7168, 2048, tokens)), 3) << tokens;
    EXPECT_EQ(stages(moe_gemm_problem(2, 256, 8, 7168, 2048, tokens)), 3) << tokens;
  }
  // Where both depths fit as many blocks per SM (SM120: one), the deeper.
  EXPECT_EQ(plan_gemm(moe_gemm_problem(2, 256, 8, 7168, 2048, 16), 101376, 188, 120).config.stages, 4);
  // The depths fit 2 and 3 blocks per SM on SM90 (228 KB, 1 KB reserved per
  // block), one each on SM120.
  for (const auto& [name, blocks] :
       std::vector<std::pair<std::string, int>>{{"n128m8k256s4w4", 2}, {"n128m8k256s3w4", 3}}) {
    EXPECT_EQ(blocks_per_sm_by_smem(TileConfig::parse(name), arch_limits("sm90")), blocks) << name;
    EXPECT_EQ(blocks_per_sm_by_smem(TileConfig::parse(name), arch_limits("sm120")), 1) << name;
  }
}

TEST(Planner, OneTokenActivatesExactlyTopKExperts) {
  // Kimi K2: 384 experts, top 8. The expectation is exactly 8 at one token;
  // rounding it up to 9 once made the planner split GEMM2 (1.28x slower).
  EXPECT_EQ(moe_gemm_problem(1, 384, 8, 7168, 2048, 1).expected_active_experts, 8);
  EXPECT_EQ(moe_gemm_problem(2, 256, 8, 7168, 2048, 1).expected_active_experts, 8);
  EXPECT_EQ(moe_gemm_problem(2, 8, 2, 4096, 14336, 1).expected_active_experts, 2);
}

TEST(Planner, PicksTheSm90FamilyOnSm90ForManyRowsPerExpert) {
  GemmProblem decode{256, 4096, 7168, 8, 0, Epilogue::kSwiglu};  // one token: 1 row per active expert
  GemmProblem prefill = decode;
  prefill.num_rows = 16384 * 8;  // 512 rows per expert
  // Decode stays with the portable family, also on SM90 (measured faster there) ...
  EXPECT_EQ(plan_gemm(decode, 232448, 132, 90).config.family, KernelFamily::kPortable);
  EXPECT_EQ(plan_gemm(decode, 232448, 132, 90).config.block_m, 8);
  // ... unless one family is asked for (batch invariance).
  decode.single_family = true;
  EXPECT_EQ(plan_gemm(decode, 232448, 132, 90).config.family, KernelFamily::kSm90);
  EXPECT_EQ(plan_gemm(decode, 232448, 132, 90).config.block_m, 8);
  EXPECT_EQ(plan_gemm(decode, 232448, 132, 90).config.epilogue, Epilogue::kSwiglu);
  // Prefill: the widest SM90 token tile, on SM90 only.
  EXPECT_EQ(plan_gemm(prefill, 232448, 132, 90).config.family, KernelFamily::kSm90);
  EXPECT_EQ(plan_gemm(prefill, 232448, 132, 90).config.block_m, 256);
  // Below ~384 rows per expert the SM90 row classes: the tile sized for two
  // standard deviations above the mean over the experts of at most its
  // width and the 128-row tile over the rest; the two-block m48 tile under
  // the 128-row one up to 48 expected rows and under every 160-row pick (for
  // skewed routing's small experts); the 160-row tile where it
  // expects fewer units by more than its 1.14x cost per unit (117-168 and
  // 247-326 rows; GLM-4.5's 205, two units either way, stays on m128); from
  // ~384 rows the 256-row tile, but the 160-row one where m256's last,
  // partly filled unit makes its units cost more (GLM-4.5 at 410 and 819
  // rows; not at 512 or 1024, which fill 256-row units).
  struct Classes {
    int64_t rows_per_expert;
    int block_m;        // the main config's
    int light_block_m;  // the row class's, 0: none
  };
  for (const Classes& c : std::vector<Classes>{{8, 128, 16},
                                               {16, 128, 32},
                                               {24, 128, 48},
                                               {32, 128, 48},
                                               {64, 128, 0},
                                               {116, 128, 0},
                                               {117, 160, 48},
                                               {128, 160, 48},
                                               {168, 160, 48},
                                               {169, 128, 0},
                                               {205, 128, 0},
                                               {256, 160, 48},
                                               {410, 160, 48},
                                               {512, 256, 0},
                                               {819, 160, 48},
                                               {1024, 256, 0},
                                               {4096, 256, 0}}) {
    GemmProblem q = prefill;
    q.expected_active_experts = 256;
    q.num_rows = c.rows_per_expert * 256;
    const GemmPlan plan = plan_gemm(q, 232448, 132, 90);
    const std::string what = std::to_string(c.rows_per_expert) + " rows per expert: " + plan.reason();
    EXPECT_EQ(plan.config.block_m, c.block_m) << what;
    if (c.light_block_m == 0) {
      EXPECT_TRUE(plan.row_classes.empty()) << what;
      continue;
    }
    ASSERT_EQ(plan.row_classes.size(), 1u) << what;
    const GemmPlan::RowClass& light = plan.row_classes[0];
    EXPECT_EQ(light.max_rows, c.light_block_m) << what;
    EXPECT_EQ(light.config.block_m, c.light_block_m) << what;
    EXPECT_EQ(light.config.family, KernelFamily::kSm90) << what;
    EXPECT_EQ(light.config.epilogue, plan.config.epilogue) << what;
    EXPECT_EQ(light.max_tiles, max_tiles(q, light.config)) << what;
    EXPECT_NE(plan.reason().find(light.config.to_string()), std::string::npos) << what;
    EXPECT_EQ(describe_row_classes(plan),
              light.config.to_string() + " (<= " + std::to_string(c.light_block_m) + " rows), then ");
  }
  // Where the 160-row tile does not fit the budget, the 128-row one.
  {
    GemmProblem q = prefill;
    q.num_rows = 128 * 256;
    const TileConfig m160 = TileConfig::parse("sm90n128m160k128s4w12-swiglu");
    const int64_t budget = sm90_smem_layout(m160).total_bytes - 1;
    ASSERT_TRUE(check_fit(TileConfig::parse("sm90n128m128k128s4w12-swiglu"), budget).fits);
    EXPECT_EQ(plan_gemm(q, budget, 132, 90).config.block_m, 128);
  }
  // A stage must cover more rows than the one before it, with the same epilogue.
  {
    GemmProblem q = prefill;
    q.num_rows = 32 * 256;
    const GemmPlan plan = plan_gemm(q, 232448, 132, 90);
    EXPECT_THROW(with_row_class(plan, q, plan.row_classes[0].config, plan.row_classes[0].max_rows), Error);
    TileConfig other = plan.row_classes[0].config;
    other.epilogue = plan.config.epilogue == Epilogue::kNone ? Epilogue::kSwiglu : Epilogue::kNone;
    EXPECT_THROW(with_row_class(plan, q, other, 64), Error);
  }
  for (int cc : {0, 80, 89, 100, 120})
    EXPECT_EQ(plan_gemm(prefill, 232448, 132, cc).config.family, KernelFamily::kPortable) << cc;
  // The boundary: more than kSm90MinRowsPerExpert rows per active expert,
  // at a long and a short K alike.
  GemmProblem edge = decode;
  edge.single_family = false;
  edge.expected_active_experts = 256;
  for (int64_t k : {int64_t{7168}, int64_t{768}}) {
    edge.k = k;
    edge.num_rows = static_cast<int64_t>(kSm90MinRowsPerExpert) * 256;
    EXPECT_EQ(plan_gemm(edge, 232448, 132, 90).config.family, KernelFamily::kPortable) << k;
    edge.num_rows += 256;
    EXPECT_EQ(plan_gemm(edge, 232448, 132, 90).config.family, KernelFamily::kSm90) << k;
  }
  // With SM120's budget only the small SM90 config fits; it is still chosen on SM90.
  const GemmPlan small = plan_gemm(prefill, 101376, 132, 90);
  EXPECT_EQ(small.config.family, KernelFamily::kSm90);
  EXPECT_LE(smem_layout(small.config).total_bytes, 101376);
  EXPECT_TRUE(family_runs_on(KernelFamily::kSm90, 90));
  EXPECT_FALSE(family_runs_on(KernelFamily::kSm90, 100));
  EXPECT_TRUE(family_runs_on(KernelFamily::kPortable, 120));
}

TEST(Planner, MaxTilesBoundsEveryRouting) {
  const TileConfig c = compiled_configs()[1];
  for (int64_t rows : {1, 7, 8, 9, 100, 1000}) {
    for (int64_t experts : {1, 3, 64, 256}) {
      GemmProblem p{experts, 128, 256, rows, 0};
      const GemmPlan plan = plan_gemm_with(p, c, 132);
      // Worst case: as many experts as possible with a partial tile each.
      const int64_t active = std::min(experts, rows);
      int64_t worst = 0;
      int64_t left = rows;
      for (int64_t e = 0; e < active; ++e) {
        const int64_t r = e == active - 1 ? left : 1;
        left -= r;
        worst += (r + c.block_m - 1) / c.block_m;
      }
      EXPECT_GE(plan.max_tiles, worst) << rows << " rows, " << experts << " experts";
    }
  }
}

TEST(Planner, GivenSplitIsKeptAndChecked) {
  const GemmProblem p{256, 4096, 7168, 8, 8, Epilogue::kSwiglu};
  for (const TileConfig& c : compiled_configs()) {
    if (c.epilogue != Epilogue::kSwiglu) continue;
    const int64_t k_tiles = (p.k + c.block_k - 1) / c.block_k;
    const GemmPlan chosen = plan_gemm_with(p, c, 132);
    EXPECT_EQ(plan_gemm_with(p, c, 132, 2, 0).split_k, chosen.split_k) << "0: the planner's choice";
    EXPECT_TRUE(split_k_allowed(p, c, chosen.split_k)) << c.to_string();
    for (int split : {1, 2, 3, static_cast<int>(k_tiles)}) {
      const GemmPlan given = plan_gemm_with(p, c, 132, 2, split);
      EXPECT_EQ(given.split_k, split) << c.to_string();
      EXPECT_EQ(given.max_tiles, chosen.max_tiles);
      EXPECT_NE(given.reason().find("split_k " + std::to_string(split) + " (given)"), std::string::npos)
          << given.reason();
    }
    EXPECT_THROW(plan_gemm_with(p, c, 132, 2, static_cast<int>(k_tiles) + 1), Error) << c.to_string();
    EXPECT_THROW(plan_gemm_with(p, c, 132, 2, -1), Error);
    // The splits the planner may pick: 1, or up to kMaxSplitK of >= 2 k-tiles each.
    for (int split = 1; split <= kMaxSplitK + 1; ++split)
      EXPECT_EQ(split_k_allowed(p, c, split), split == 1 || (split <= kMaxSplitK && k_tiles / split >= 2))
          << c.to_string() << " split " << split;
  }
}

TEST(Planner, LimitSplitKAsTheLayerRunsIt) {
  GemmPlan plan;
  plan.split_k = 3;
  plan.max_tiles = kMaxSplitKTiles;
  EXPECT_EQ(limit_split_k(plan, false).split_k, 3);
  EXPECT_EQ(limit_split_k(plan, false).reason(), plan.reason());
  const GemmPlan invariant = limit_split_k(plan, true);
  EXPECT_EQ(invariant.split_k, 1);
  EXPECT_EQ(invariant.reason(), plan.reason() + "; split-K off (batch invariant)");
  plan.max_tiles = kMaxSplitKTiles + 1;
  const GemmPlan many = limit_split_k(plan, false);
  EXPECT_EQ(many.split_k, 1);
  EXPECT_EQ(many.reason(), plan.reason() + "; split-K off (more tiles than the workspace's counters)");
}

// fused_decode_tile: 2 ... 16 tokens, plans without split-K, the heuristic's
// m8 tile of either GEMM, and a forced or tuned plan of the other only with
// that tile.
TEST(Planner, FusedDecodeTileWhereTheRuleSaysSo) {
  const auto heuristic = [](int gemm, int64_t tokens) {
    return plan_gemm(moe_gemm_problem(gemm, 256, 8, 6144, 2048, tokens), 232448, 132, 90);  // GLM-5
  };
  for (int64_t tokens : {kFusedDecodeMinTokens, int64_t{4}, kFusedDecodeMaxTokens}) {
    const std::optional<TileConfig> tile =
        fused_decode_tile(tokens, heuristic(1, tokens), false, heuristic(2, tokens), false);
    ASSERT_TRUE(tile.has_value()) << tokens;
    EXPECT_TRUE(is_fused_decode_tile(*tile));
    EXPECT_EQ(*tile, heuristic(1, tokens).config) << tokens;
  }
  for (int64_t tokens : {kFusedDecodeMinTokens - 1, kFusedDecodeMaxTokens + 1})
    EXPECT_FALSE(fused_decode_tile(tokens, heuristic(1, tokens), false, heuristic(2, tokens), false)) << tokens;

  const GemmPlan g1 = heuristic(1, 4), g2 = heuristic(2, 4);
  GemmPlan split = g2;
  split.split_k = 2;
  EXPECT_FALSE(fused_decode_tile(4, g1, false, split, false)) << "a split plan keeps its separate launch";
  GemmPlan other = g2;
  other.config = TileConfig::parse("n128m32k128s4w4-finalize");
  EXPECT_TRUE(fused_decode_tile(4, g1, false, other, false)) << "the heuristic's other tile is replaced";
  EXPECT_FALSE(fused_decode_tile(4, g1, false, other, true)) << "a forced or tuned other tile is kept";
  GemmPlan same = g2;
  same.config = g1.config;
  same.config.epilogue = Epilogue::kFinalize;
  EXPECT_TRUE(fused_decode_tile(4, g1, true, same, true)) << "both chosen with the decode tile";
}

// The reason is formatted when asked for, from the figures the planner kept
// (planning formats no text); its wording is what `fp4moe plan` and
// MoeLayerPlan::describe() have always printed.
TEST(Planner, ReasonTextFromThePlannersFigures) {
  const GemmProblem mixtral{8, 4096, 14336, 2, 0};  // GEMM2 at T = 1: split 4, then off
  EXPECT_EQ(limit_split_k(plan_gemm(mixtral, 232448, 132), true).reason(),
            "block_m 8 for ~1 rows per active expert (2 of 8 experts); ~64 tiles x split_k 4 over 264 block slots, "
            "56 k-tiles each; split-K off (batch invariant)");
  const GemmPlan deepseek = plan_gemm(moe_gemm_problem(1, 256, 8, 7168, 2048, 256), 232448, 132, 90);
  EXPECT_EQ(deepseek.reason(),
            "block_m 128 for ~8 rows per active expert (256 of 256 experts); ~8.19e+03 tiles x split_k 1 over 132 "
            "block slots, 56 k-tiles each; experts of 1-16 rows first on sm90n128m16k128s7w12-swiglu");
  EXPECT_EQ(
      limit_split_k(plan_gemm_with(moe_gemm_problem(2, 8, 2, 4096, 14336, 0), compiled_configs()[0], 132, 2, 2), true)
          .reason(),
      "no rows; split-K off (batch invariant)");
  // smem_bytes is the layout's total, for every compiled config.
  for (const TileConfig& c : compiled_configs()) EXPECT_EQ(smem_bytes(c), smem_layout(c).total_bytes) << c.to_string();
}

TEST(Planner, MoeGemmProblemsAreTheLayersGemms) {
  const GemmProblem g1 = moe_gemm_problem(1, 256, 8, 7168, 2048, 3);
  EXPECT_EQ(g1.n, 4096);
  EXPECT_EQ(g1.k, 7168);
  EXPECT_EQ(g1.epilogue, Epilogue::kSwiglu);
  EXPECT_EQ(g1.num_rows, 24);
  EXPECT_EQ(g1.expected_active_experts, static_cast<int64_t>(std::ceil(expected_active_experts(256, 8, 3))));
  EXPECT_FALSE(g1.single_family);
  const GemmProblem g2 = moe_gemm_problem(2, 256, 8, 7168, 2048, 3, true);
  EXPECT_EQ(g2.n, 7168);
  EXPECT_EQ(g2.k, 2048);
  EXPECT_EQ(g2.epilogue, Epilogue::kFinalize);
  EXPECT_TRUE(g2.single_family);
  EXPECT_THROW(moe_gemm_problem(3, 256, 8, 7168, 2048, 3), Error);
}

TEST(Planner, RejectsBadProblems) {
  EXPECT_THROW(plan_gemm({0, 128, 256, 8, 0}, 232448, 132), Error);
  EXPECT_THROW(plan_gemm({8, 100, 256, 8, 0}, 232448, 132), Error);
  EXPECT_THROW(plan_gemm({8, 128, 250, 8, 0}, 232448, 132), Error);
  try {
    plan_gemm({8, 128, 256, 8, 0}, 20000, 132);
    ADD_FAILURE() << "expected no config to fit 20000 B";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("no compiled tile config with the none epilogue fits 20000 B"),
              std::string::npos)
        << e.what();
  }
}

}  // namespace
}  // namespace fp4moe
