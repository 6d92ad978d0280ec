// The planner (include/fp4moe/plan.hpp, src/plan/planner.hpp): the time
// model that picks a tile config and split-K per problem, the row classes,
// and the plan as MoeLayer runs it. Host-only; tested in
// tests/plan/test_plan.cpp.
#include "plan/planner.hpp"

#include <algorithm>
#include <cmath>
#include <sstream>

#include "fp4moe/error.hpp"
#include "fp4moe/plan.hpp"
#include "plan/compiled_configs.hpp"
#include "plan/smem_model.hpp"

namespace fp4moe {

// ----------------------------------------------------------------- planner

double expected_active_experts(int64_t num_experts, int top_k, int64_t num_tokens) {
  if (num_experts <= 0) return 0.0;
  const double p_miss = 1.0 - static_cast<double>(top_k) / static_cast<double>(num_experts);
  return static_cast<double>(num_experts) * (1.0 - std::pow(std::max(p_miss, 0.0), static_cast<double>(num_tokens)));
}

namespace {

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

void validate_problem(const GemmProblem& p) {
  FP4MOE_CHECK(p.num_experts >= 1 && p.num_experts <= kMaxExperts, "num_experts = ", p.num_experts, ": expected 1..",
               kMaxExperts);
  FP4MOE_CHECK(p.n >= 16 && p.n % 16 == 0, "n = ", p.n, ": expected a positive multiple of 16");
  FP4MOE_CHECK(p.k >= 16 && p.k % 16 == 0, "k = ", p.k, ": expected a positive multiple of 16");
  FP4MOE_CHECK(p.num_rows >= 0, "num_rows = ", p.num_rows, ": expected >= 0");
}

// Upper bound of sum_e ceil(rows_e / block_m) over any routing of num_rows
// rows onto num_experts experts.
int64_t max_m_tiles(int64_t num_rows, int64_t num_experts, int block_m) {
  const int64_t active = std::min(num_experts, num_rows);
  return (num_rows + active * (block_m - 1)) / block_m;
}

}  // namespace

namespace {

// Experts expected to receive rows (the caller's estimate, else as many as
// there are rows), and the rows each of them gets; at least one row.
double active_experts(const GemmProblem& p) {
  return p.expected_active_experts > 0 ? static_cast<double>(p.expected_active_experts)
                                       : std::min<double>(p.num_experts, std::max<int64_t>(p.num_rows, 1));
}
double rows_per_active_expert(const GemmProblem& p) {
  return static_cast<double>(std::max<int64_t>(p.num_rows, 1)) / active_experts(p);
}

// The m-tiles of block_m rows an expert expects, its rows a Poisson count of
// mean `rows` (as a normal of the same mean and variance):
// E[ceil(rows / block_m)] = sum over j >= 0 of P(rows > j * block_m).
double expected_m_tiles(double rows, int block_m) {
  const double sd = std::sqrt(rows);
  double tiles = 0;
  for (int j = 0; j * block_m < rows + 8 * sd; ++j)
    tiles += 0.5 * std::erfc((j * block_m - rows) / (sd * std::sqrt(2.0)));
  return tiles;
}

// Whether the SM90 160-row tile beats the 128-row one at this many rows per
// expert: its expected units, each kSm90M160UnitCost m128 units, against
// m128's. The ratio is measured (H100, GEMM bench, uniform routing;
// docs/performance.md §5.12): GLM-4.5 at 205 rows, two units on
// either tile, ran 0.86x on m160. The rule picks m160 at 117-168 and 247-326
// rows (from 384 the 256-row tile, or m160 by sm90_m160_beats_m256). On the
// measured shapes of 85-256 rows its pick is the faster tile or within 4 % of
// it, but for Kimi K2 at 171 rows (m160 1.04x / 1.06x faster, predicted
// 0.97x).
bool sm90_m160_saves_units(double rows) {
  return kSm90M160UnitCost * expected_m_tiles(rows, 160) < expected_m_tiles(rows, 128);
}

// Whether the 160-row tile beats the 256-row one from ~384 rows per expert:
// its expected units cost 5 % less, an m256 unit taking 1.6x an m160 unit's
// time (H100, both tiles forced at T = 16384 on GLM-4.5, Qwen3-235B,
// Qwen3-30B and gpt-oss: 1.50-1.71x, docs/performance.md §5.12).
// m256 has one wgmma width, so an expert's last, partly filled
// unit costs a whole one: GLM-4.5 at 819 rows runs 4 units of m256 (the
// last at 51 rows) or 6 of m160 (the last at 19, 40 columns wide). Where
// the rows nearly fill 256-row units (512 and 1024 rows) m256 stays.
bool sm90_m160_beats_m256(double rows) {
  constexpr double kM256UnitCost = 1.6 * kSm90M160UnitCost;
  return kSm90M160UnitCost * expected_m_tiles(rows, 160) < 0.95 * kM256UnitCost * expected_m_tiles(rows, 256);
}

}  // namespace

double expected_tiles(const GemmProblem& p, const TileConfig& config) {
  return std::ceil(rows_per_active_expert(p) / config.block_m) * active_experts(p) *
         static_cast<double>(ceil_div(p.n, config.block_n));
}

int64_t max_tiles(const GemmProblem& p, const TileConfig& config) {
  return max_m_tiles(p.num_rows, p.num_experts, config.block_m) * ceil_div(p.n, config.block_n);
}

bool split_k_allowed(const GemmProblem& p, const TileConfig& config, int split_k) {
  const int64_t k_tiles = ceil_div(p.k, config.block_k);
  return split_k == 1 || (split_k >= 2 && split_k <= kMaxSplitK && k_tiles / split_k >= 2);
}

GemmPlan plan_gemm_with(const GemmProblem& p, const TileConfig& config, int num_sms, int blocks_per_sm, int split_k) {
  validate_problem(p);
  const int64_t k_tiles = ceil_div(p.k, config.block_k);
  FP4MOE_CHECK(split_k >= 0 && split_k <= k_tiles, "split_k = ", split_k, " for ", config.to_string(), " at k = ", p.k,
               ": expected 0 (the planner's choice) or 1 .. ", k_tiles, " (one k-tile per slice at least)");
  GemmPlan plan;
  plan.config = config;
  plan.split_k = std::max(split_k, 1);
  plan.max_tiles = max_tiles(p, config);
  if (p.num_rows == 0) {
    plan.why.no_rows = true;
    return plan;
  }
  const double active = active_experts(p);
  const double rows_per_expert = rows_per_active_expert(p);
  const double tiles = expected_tiles(p, config);
  const bool sm90 = config.family == KernelFamily::kSm90;
  if (sm90)  // the warp-specialised kernel is compiled for one or two blocks per SM
    blocks_per_sm = sm90_smem_layout(config).blocks_per_sm;
  const double slots = static_cast<double>(std::max(1, num_sms) * std::max(1, blocks_per_sm));
  // Split-K only fills block slots that the tiles leave idle: the largest
  // split whose units still fit in one wave of slots, with at least
  // kMinSplitKSliceK of K per slice. Where split-K would pay, the GEMM is
  // small and bound by DRAM and the dequantisation, not by waves of tiles:
  // the units on an SM share its bandwidth and issue slots, so a split that
  // makes more waves only adds a pipeline fill and a fix-up per slice
  // (measured against every split by `fp4moe tune`: docs/performance.md §5.8).
  for (int split = 2; split_k == 0 && split <= kMaxSplitK; ++split) {
    if (!split_k_allowed(p, config, split) || p.k / split < kMinSplitKSliceK || tiles * split > slots) break;
    plan.split_k = split;
  }
  // The figures only: reason() formats them when asked.
  GemmPlan::Rationale& why = plan.why;
  why.block_m = config.block_m;
  why.rows_per_expert = rows_per_expert;
  why.active_experts = active;
  why.num_experts = p.num_experts;
  why.tiles = tiles;
  why.split_k = plan.split_k;
  why.split_k_given = split_k > 0;
  why.block_slots = slots;
  why.k_tiles = k_tiles;
  return plan;
}

std::string GemmPlan::reason() const {
  std::ostringstream os;
  os.precision(3);
  if (why.no_rows)
    os << "no rows";
  else
    os << "block_m " << why.block_m << " for ~" << why.rows_per_expert << " rows per active expert ("
       << why.active_experts << " of " << why.num_experts << " experts); ~" << why.tiles << " tiles x split_k "
       << why.split_k << (why.split_k_given ? " (given)" : "") << " over " << why.block_slots << " block slots, "
       << why.k_tiles << " k-tiles each";
  for (const Rationale::Note& note : why.notes) {
    switch (note.kind) {
      case Rationale::Note::Kind::kSplitKOffBatchInvariant:
        os << "; split-K off (batch invariant)";
        break;
      case Rationale::Note::Kind::kSplitKOffTileCounters:
        os << "; split-K off (more tiles than the workspace's counters)";
        break;
      case Rationale::Note::Kind::kRowClass:
        os << "; experts of " << note.first_rows << "-" << note.max_rows << " rows first on "
           << note.config.to_string();
        break;
    }
  }
  return os.str();
}

GemmPlan limit_split_k(GemmPlan plan, bool batch_invariant) {
  using Note = GemmPlan::Rationale::Note;
  if (plan.split_k > 1 && batch_invariant) {
    plan.split_k = 1;
    plan.why.notes.push_back({Note::Kind::kSplitKOffBatchInvariant, {}, 0, 0});
  } else if (plan.split_k > 1 && plan.max_tiles > kMaxSplitKTiles) {
    plan.split_k = 1;
    plan.why.notes.push_back({Note::Kind::kSplitKOffTileCounters, {}, 0, 0});
  }
  return plan;
}

bool is_fused_decode_tile(TileConfig tile) {
  tile.epilogue = Epilogue::kNone;
  static const TileConfig tiles[] = {
#define FP4MOE_X(BN, BM, BK, S, W) TileConfig{BN, BM, BK, S, W, Epilogue::kNone, KernelFamily::kPortable},
      FP4MOE_FUSED_DECODE_TILES(FP4MOE_X)
#undef FP4MOE_X
  };
  for (const TileConfig& t : tiles)
    if (t == tile) return true;
  return false;
}

std::optional<TileConfig> fused_decode_tile(int64_t num_tokens, const GemmPlan& gemm1, bool gemm1_chosen,
                                            const GemmPlan& gemm2, bool gemm2_chosen) {
  if (num_tokens < kFusedDecodeMinTokens || num_tokens > kFusedDecodeMaxTokens) return std::nullopt;
  // A split plan fills SMs that the fused launch's unsplit units would
  // leave idle (a small shape: few n-tiles).
  if (gemm1.split_k > 1 || gemm2.split_k > 1) return std::nullopt;
  const TileConfig tile = is_fused_decode_tile(gemm1.config) ? gemm1.config : gemm2.config;
  if (!is_fused_decode_tile(tile)) return std::nullopt;
  const auto serves = [&](const GemmPlan& plan, bool chosen) {
    TileConfig t = plan.config;
    t.epilogue = tile.epilogue;
    return !chosen || (t == tile && plan.row_classes.empty());
  };
  if (!serves(gemm1, gemm1_chosen) || !serves(gemm2, gemm2_chosen)) return std::nullopt;
  return tile;
}

GemmProblem moe_gemm_problem(int gemm, int64_t num_experts, int top_k, int64_t hidden, int64_t inter,
                             int64_t num_tokens, bool batch_invariant) {
  FP4MOE_CHECK(gemm == 1 || gemm == 2, "moe_gemm_problem: gemm = ", gemm, "; expected 1 or 2");
  GemmProblem p;
  p.num_experts = num_experts;
  p.n = gemm == 1 ? 2 * inter : hidden;
  p.k = gemm == 1 ? hidden : inter;
  p.num_rows = num_tokens * top_k;
  // Rounded up, less the pow() error that turns exactly top_k experts at
  // one token into top_k + 1.
  p.expected_active_experts =
      static_cast<int64_t>(std::ceil(expected_active_experts(num_experts, top_k, num_tokens) - 1e-6));
  p.epilogue = gemm == 1 ? Epilogue::kSwiglu : Epilogue::kFinalize;
  p.single_family = batch_invariant;
  return p;
}

GemmPlan plan_gemm(const GemmProblem& p, int64_t smem_budget_bytes, int num_sms, int compute_capability,
                   int blocks_per_sm) {
  validate_problem(p);
  // The SM90 family where it runs and a config of it fits, else the portable one.
  auto candidates = [&](KernelFamily family) {
    std::vector<TileConfig> out;
    for (const auto& c : compiled_configs())
      if (c.family == family && c.epilogue == p.epilogue && smem_bytes(c) <= smem_budget_bytes) out.push_back(c);
    return out;
  };
  const double rows_per_expert = rows_per_active_expert(p);
  std::vector<TileConfig> fitting;
  const bool sm90_rows = rows_per_expert > kSm90MinRowsPerExpert;
  if (family_runs_on(KernelFamily::kSm90, compute_capability) && (p.single_family || sm90_rows))
    fitting = candidates(KernelFamily::kSm90);
  if (fitting.empty()) fitting = candidates(KernelFamily::kPortable);
  if (fitting.empty()) {
    std::ostringstream os;
    os << "no compiled tile config with the " << to_string(p.epilogue) << " epilogue fits " << smem_budget_bytes
       << " B of shared memory per block:";
    for (const auto& c : compiled_configs())
      if (c.epilogue == p.epilogue) os << "\n  " << c.to_string() << ": " << check_fit(c, smem_budget_bytes).advice;
    FP4MOE_THROW(os.str());
  }
  // The smallest token tile that holds the expected rows of an expert; the
  // largest one when experts get more rows than any tile holds. Routed rows
  // per expert spread like a Poisson count, so the SM90 family sizes its tile
  // for two standard deviations above the mean (fewer experts need a second,
  // mostly empty m-tile), and from ~24 rows takes the 128-row tile, whose
  // tensor-mapped activation copies beat the 64-row tile's cp.async, until
  // experts get ~3 x 128 rows (one standard deviation from ~384 rows), where
  // it takes the 256-row tile: measured best by `fp4moe tune` over the eight
  // README shapes (docs/performance.md §5.9). Between, the 160-row
  // tile where it needs fewer units than m128 by more than its unit costs
  // over m128's (sm90_m160_saves_units), and above it where its units cost
  // less than m256's (sm90_m160_beats_m256). Below the 256-row tile the row
  // classes after this add the 128-row tile for the experts the pick cannot
  // hold.
  double target = rows_per_expert;
  if (fitting.front().family == KernelFamily::kSm90) {
    const bool m160 = std::any_of(fitting.begin(), fitting.end(), [](const TileConfig& c) { return c.block_m == 160; });
    if (rows_per_expert >= 384) {
      target = m160 && sm90_m160_beats_m256(rows_per_expert) ? 160 : rows_per_expert + std::sqrt(rows_per_expert);
    } else {
      target = rows_per_expert + 2 * std::sqrt(rows_per_expert);
      if (target > 32) target = m160 && sm90_m160_saves_units(rows_per_expert) ? 160 : 128;
    }
  }
  const TileConfig* pick = &fitting.back();
  for (const auto& c : fitting) {
    if (c.block_m >= target) {
      pick = &c;
      break;
    }
  }
  // The portable family compiles the m8 tile at two pipeline depths, the
  // deeper first in the list. Where the shallower one fits more blocks per
  // SM (SM90: 3 against 2), the deeper one keeps more bytes in flight per
  // block, which wins while one wave of its block slots holds every unit;
  // past that the shallower one's extra block per SM hides more latency in
  // the issue-bound mainloop (~1.05x at T = 4-64, 1.26x on GLM-5's GEMM2 at
  // T = 1) — except where its units would spill a few into a second wave
  // that two waves of the deeper one absorb (DeepSeek-V3's GEMM2 at T = 1,
  // 448 units: the layer 1.08x slower). docs/performance.md §5.7. Where
  // both fit as many blocks (SM120, SM86: one), the deeper.
  const auto& archs = arch_table();
  const auto arch = std::find_if(archs.begin(), archs.end(),
                                 [&](const ArchLimits& a) { return a.compute_capability == compute_capability; });
  if (pick->family == KernelFamily::kPortable && arch != archs.end()) {
    const auto resident = [&](const TileConfig& c) { return blocks_per_sm_by_smem(c, *arch); };
    const auto next = fitting.begin() + (pick - fitting.data()) + 1;
    const auto shallower = std::find_if(next, fitting.end(), [&](const TileConfig& c) {
      return c.family == KernelFamily::kPortable && c.block_m == pick->block_m && resident(c) > resident(*pick);
    });
    if (shallower != fitting.end() && resident(*pick) >= 1) {
      const int per_sm = static_cast<int>(resident(*pick));
      const double slots = static_cast<double>(std::max(1, num_sms)) * per_sm;
      const double shallower_slots = static_cast<double>(std::max(1, num_sms)) * resident(*shallower);
      const double units = expected_tiles(p, *pick) * plan_gemm_with(p, *pick, num_sms, per_sm).split_k;
      if (units > slots && !(units > shallower_slots && units <= 2 * slots)) pick = &*shallower;
    }
  }
  // SM90 row classes, the `pick` rule (docs/performance.md §5.11: the
  // layer 1.12x at T = 256 on an H200, the GEMM bench unchanged): a picked
  // 16- or 32-row tile over the experts of at most its width and the 128-row
  // tile over the rest; at the 128-row tile with at most 48 expected rows,
  // and under every 160-row pick, the two-block m48 tile under it. The
  // 160-row tile is picked at 117+ expected rows, where a uniformly routed
  // batch leaves no expert with 48 rows or fewer (the m48 launch finds no
  // unit: 0.3 % of the GEMM), while skewed routing leaves many (the layer
  // bench at T = 4096: 75 of its 205 active experts) that m160 runs one block
  // per SM at a narrow width: the layer 1.02-1.08x (docs/performance.md §5.13).
  // Not under a 128-row pick above 48 expected rows: a second
  // launch for the few small experts there cost Qwen3-30B's short GEMMs 10 %.
  // The m8 tile (a batch-invariant layer's decode) runs alone: a second
  // launch would add its latency to every decode step.
  if (pick->family == KernelFamily::kSm90 && pick->block_m >= 16 && pick->block_m <= 160) {
    const auto find = [&](int block_m, int blocks) {
      return std::find_if(fitting.begin(), fitting.end(), [&](const TileConfig& c) {
        return c.block_m == block_m && (blocks == 0 || sm90_smem_layout(c).blocks_per_sm == blocks);
      });
    };
    const auto heavy = pick->block_m >= 128 ? fitting.begin() + (pick - fitting.data()) : find(128, 0);
    if (heavy != fitting.end()) {
      if (pick->block_m < 128)
        return with_row_class(plan_gemm_with(p, *heavy, num_sms, blocks_per_sm), p, *pick, pick->block_m);
      const auto light = find(kSm90LightMaxRows, 2);
      if ((rows_per_expert <= kSm90LightMaxRows || pick->block_m == 160) && light != fitting.end())
        return with_row_class(plan_gemm_with(p, *heavy, num_sms, blocks_per_sm), p, *light, kSm90LightMaxRows);
    }
  }
  return plan_gemm_with(p, *pick, num_sms, blocks_per_sm);
}

GemmPlan with_row_class(GemmPlan plan, const GemmProblem& p, const TileConfig& config, int max_rows) {
  const int above = plan.row_classes.empty() ? 0 : plan.row_classes.back().max_rows;
  FP4MOE_CHECK(config.epilogue == plan.config.epilogue && max_rows > above, "with_row_class: ", config.to_string(),
               " for ", plan.config.to_string(), " over experts of ", above + 1, " to ", max_rows, " rows");
  plan.row_classes.push_back({config, max_rows, max_tiles(p, config)});
  plan.why.notes.push_back({GemmPlan::Rationale::Note::Kind::kRowClass, config, above + 1, max_rows});
  return plan;
}

std::string describe_row_classes(const GemmPlan& plan) {
  std::string out;
  for (const GemmPlan::RowClass& s : plan.row_classes)
    out += s.config.to_string() + " (<= " + std::to_string(s.max_rows) + " rows), ";
  return out.empty() ? out : out + "then ";
}

}  // namespace fp4moe
