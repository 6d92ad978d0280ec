// Architecture limits, tile configs, the shared-memory layout tables and the
// planner (see include/fp4moe/plan.hpp). Host-only; tested in
// tests/plan/test_plan.cpp.
#include "fp4moe/plan.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <sstream>

#include "fp4moe/error.hpp"
#include "plan/compiled_configs.hpp"
#include "plan/smem_model.hpp"

namespace fp4moe {

// ------------------------------------------------------------- architectures

namespace {
// NOTE: per-SM capacities from the CUDA programming guide's compute
// capability table; each resident block also costs 1 KB reserved by the system.
const std::vector<ArchLimits>& arch_table() {
  static const std::vector<ArchLimits> table = {
      {"sm80", 80, kSmemLimitSm80, 167936, 1024},
      {"sm86", 86, kSmemLimitSm86, 102400, 1024},
      {"sm89", 89, kSmemLimitSm86, 102400, 1024},
      {"sm90", 90, kSmemLimitSm90, kSmemPerSmSm90, kSmemReservedPerBlock},
      {"sm100", 100, kSmemLimitSm90, kSmemPerSmSm90, kSmemReservedPerBlock},
      {"sm120", 120, kSmemLimitSm120, 102400, 1024},
  };
  return table;
}
}  // namespace

int64_t blocks_per_sm_by_smem(const TileConfig& config, const ArchLimits& arch) {
  const int64_t by_smem = arch.smem_per_sm / (smem_bytes(config) + arch.smem_reserved_per_block);
  // An SM90 kernel's registers are split for the blocks it is compiled for.
  if (config.family == KernelFamily::kSm90)
    return std::min<int64_t>(by_smem, sm90_smem_layout(config).blocks_per_sm);
  return by_smem;
}

std::vector<std::string> known_archs() {
  std::vector<std::string> names;
  for (const auto& a : arch_table()) names.push_back(a.name);
  return names;
}

ArchLimits arch_limits(std::string_view name) {
  for (const auto& a : arch_table())
    if (a.name == name) return a;
  std::string valid;
  for (const auto& a : arch_table()) valid += (valid.empty() ? "" : ", ") + a.name;
  FP4MOE_THROW("unknown architecture '", name, "': expected one of ", valid);
}

// ---------------------------------------------------------------- configs

std::string to_string(Epilogue epilogue) {
  switch (epilogue) {
    case Epilogue::kNone: return "none";
    case Epilogue::kSwiglu: return "swiglu";
    case Epilogue::kFinalize: return "finalize";
  }
  return "?";
}

std::string to_string(KernelFamily family) {
  return family == KernelFamily::kSm90 ? "sm90" : "portable";
}

namespace {
constexpr std::string_view kSm90Prefix = "sm90";
}  // namespace

std::string TileConfig::to_string() const {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%sn%dm%dk%ds%dw%d", family == KernelFamily::kSm90 ? kSm90Prefix.data() : "", block_n,
                block_m, block_k, stages, warps);
  return epilogue == Epilogue::kNone ? std::string(buf)
                                     : std::string(buf) + "-" + fp4moe::to_string(epilogue);
}

TileConfig TileConfig::parse(std::string_view name) {
  TileConfig c;
  std::string s(name);
  if (const size_t dash = s.find('-'); dash != std::string::npos) {
    const std::string suffix = s.substr(dash + 1);
    bool known = false;
    for (Epilogue e : {Epilogue::kNone, Epilogue::kSwiglu, Epilogue::kFinalize})
      if (suffix == fp4moe::to_string(e)) {
        c.epilogue = e;
        known = true;
      }
    FP4MOE_CHECK(known, "malformed tile config '", name, "': unknown epilogue '", suffix,
                 "'; expected none, swiglu or finalize");
    s.resize(dash);
  }
  if (s.starts_with(kSm90Prefix)) {
    c.family = KernelFamily::kSm90;
    s.erase(0, kSm90Prefix.size());
  }
  int consumed = 0;
  if (std::sscanf(s.c_str(), "n%dm%dk%ds%dw%d%n", &c.block_n, &c.block_m, &c.block_k, &c.stages,
                  &c.warps, &consumed) != 5 ||
      consumed != static_cast<int>(s.size()))
    FP4MOE_THROW("malformed tile config '", name,
                 "': expected [sm90]n<BLOCK_N>m<BLOCK_M>k<BLOCK_K>s<STAGES>w<WARPS>[-epilogue], e.g. "
                 "n128m8k256s4w4 or sm90n128m64k128s6w12-swiglu");
  FP4MOE_CHECK(c.block_n > 0 && c.block_m > 0 && c.block_k > 0 && c.stages > 0 && c.warps > 0,
               "tile config '", name, "' has a zero field");
  return c;
}

const std::vector<TileConfig>& compiled_configs() {
  static const std::vector<TileConfig> configs = {
#define FP4MOE_X(BN, BM, BK, S, W, EPI) TileConfig{BN, BM, BK, S, W, EPI, KernelFamily::kPortable},
      FP4MOE_PORTABLE_KERNELS(FP4MOE_X)
#undef FP4MOE_X
#define FP4MOE_X(BM, BK, S, EPI) TileConfig{kSm90BlockN, BM, BK, S, kSm90Threads / 32, EPI, KernelFamily::kSm90},
      FP4MOE_SM90_KERNELS(FP4MOE_X)
#undef FP4MOE_X
  };
  return configs;
}

bool family_runs_on(KernelFamily family, int compute_capability) {
  if (family == KernelFamily::kSm90) return compute_capability == 90;
  return compute_capability >= 80;
}

bool is_compiled(const TileConfig& config) {
  const auto& all = compiled_configs();
  return std::find(all.begin(), all.end(), config) != all.end();
}

// ---------------------------------------------------------- shared memory

namespace {
// The staging row length of each epilogue, as src/plan/smem_model.hpp sets it.
std::string epilogue_row_formula(Epilogue epilogue) {
  switch (epilogue) {
    case Epilogue::kNone: return "BLOCK_N+8";
    case Epilogue::kSwiglu: return "BLOCK_N/2+8";
    case Epilogue::kFinalize: return "BLOCK_N+4";
  }
  return "?";
}
}  // namespace

namespace {

std::string dims(std::initializer_list<std::string> parts) {
  std::string s = "(";
  for (const auto& p : parts) s += (s.size() > 1 ? ", " : "") + p;
  return s + ")";
}

SmemLayout portable_layout(const TileConfig& c) {
  const PortableSmemLayout l =
      portable_smem_layout(c.block_n, c.block_m, c.block_k, c.stages, c.epilogue);
  const std::string stages = "STAGES=" + std::to_string(c.stages);
  const std::string bn = "BLOCK_N=" + std::to_string(c.block_n);
  const std::string bm = "BLOCK_M=" + std::to_string(c.block_m);
  SmemLayout out;
  out.regions = {
      {"weights", dims({stages, bn, "BLOCK_K/2=" + std::to_string(c.block_k / 2)}) + " packed fp4",
       l.weight_offset, l.weight_bytes, false},
      {"scales", dims({stages, bn, "BLOCK_K/16=" + std::to_string(c.block_k / 16)}) + " e4m3",
       l.scale_offset, l.scale_bytes, false},
      {"activations", dims({stages, bm, "BLOCK_K=" + std::to_string(c.block_k)}) + " bf16",
       l.act_offset, l.act_bytes, false},
      {"alignment", "padding to 128 B", l.act_offset + l.act_bytes,
       l.mainloop_end - (l.act_offset + l.act_bytes), false},
      {"epilogue", dims({bm, epilogue_row_formula(c.epilogue) + "=" + std::to_string(l.epi_row_elems)}) +
                       (l.epi_elem_bytes == 4 ? " fp32" : " bf16") + " " + fp4moe::to_string(c.epilogue) +
                       " staging, reuses the pipeline",
       l.epilogue_offset, l.epilogue_bytes, true},
      {"row indices", dims({"3", bm}) + " int32/fp32 gather row, output row, router weight",
       l.rows_offset, l.rows_bytes, false},
      {"schedule", "(" + std::to_string(kMaxExperts + 1) + " + 32) int32 m-tile prefix per expert",
       l.schedule_offset, l.schedule_bytes, false},
      {"split-k flag", "(4) int32 + padding", l.flag_offset, l.total_bytes - l.flag_offset, false},
  };
  out.total_bytes = l.total_bytes;
  return out;
}

SmemLayout sm90_layout(const TileConfig& c) {
  const Sm90SmemLayout l = sm90_smem_layout(c);
  const std::string stages = "STAGES=" + std::to_string(c.stages);
  const std::string bn = "BLOCK_N=" + std::to_string(c.block_n);
  const std::string bm = "BLOCK_M=" + std::to_string(c.block_m);
  const int64_t epi_row_bytes = int64_t{l.epi_row_elems} * l.epi_elem_bytes;
  SmemLayout out;
  out.regions = {
      {"activations", dims({stages, bm, "BLOCK_K=" + std::to_string(c.block_k)}) + " bf16, 128-B swizzled",
       l.act_offset, l.act_bytes, false},
      {"weights", dims({stages, bn, "BLOCK_K/2=" + std::to_string(c.block_k / 2)}) + " packed fp4",
       l.weight_offset, l.weight_bytes, false},
      {"scales", dims({stages, bn, "BLOCK_K/16=" + std::to_string(c.block_k / 16)}) + " e4m3",
       l.scale_offset, l.scale_bytes, false},
      {"barriers", dims({std::to_string(kSm90StageBarriers), stages}) + " mbarrier full/act/weights free",
       l.barrier_offset, l.barrier_bytes, false},
      {"alignment", "padding to 128 B", l.barrier_offset + l.barrier_bytes,
       l.ring_end - (l.barrier_offset + l.barrier_bytes), false},
      {"epilogue", dims({"CONSUMERS=" + std::to_string(kSm90Consumers), "CHUNK=" + std::to_string(l.chunk_tokens),
                         std::to_string(l.epi_row_elems)}) +
                       (l.epi_elem_bytes == 4 ? " fp32 " : " bf16 ") + fp4moe::to_string(c.epilogue) + " staging",
       l.epilogue_offset, int64_t{kSm90Consumers} * l.chunk_tokens * epi_row_bytes, false},
      {"row indices", dims({bm}) + " int64 producer's gathered row offsets", l.rows_offset, l.rows_bytes, false},
  };
  if (l.slots_bytes > 0)
    out.regions.push_back({"output slots", dims({"CONSUMERS=" + std::to_string(kSm90Consumers), bm}) +
                                               " int32 slot, fp32 weight",
                           l.slots_offset, l.slots_bytes, false});
  out.regions.push_back({"schedule", "(" + std::to_string(kMaxExperts + 1) + " + 32) int32 m-tile prefix per expert",
                         l.schedule_offset, l.schedule_bytes, false});
  out.regions.push_back({"split-k flag", "(4) int32 + padding", l.flag_offset, l.total_bytes - l.flag_offset, false});
  out.total_bytes = l.total_bytes;
  return out;
}

// The configs the shared-memory model describes.
void check_layout_config(const TileConfig& c) {
  FP4MOE_CHECK(c.block_n % kFragRows == 0 && c.block_k % kFragK == 0 && c.stages >= 1,
               "tile config ", c.to_string(), ": BLOCK_N must be a multiple of ", kFragRows,
               " and BLOCK_K of ", kFragK);
  if (c.family == KernelFamily::kSm90)
    FP4MOE_CHECK(c.block_n == kSm90BlockN && c.warps == kSm90Threads / 32 && c.block_m % 8 == 0 &&
                     c.block_m <= 256,
                 "tile config ", c.to_string(), ": the SM90 family has BLOCK_N = ", kSm90BlockN, ", ",
                 kSm90Threads / 32, " warps and BLOCK_M a multiple of 8 up to 256");
}

}  // namespace

SmemLayout smem_layout(const TileConfig& c) {
  check_layout_config(c);
  return c.family == KernelFamily::kSm90 ? sm90_layout(c) : portable_layout(c);
}

int64_t smem_bytes(const TileConfig& c) {
  check_layout_config(c);
  return c.family == KernelFamily::kSm90
             ? sm90_smem_layout(c).total_bytes
             : portable_smem_layout(c.block_n, c.block_m, c.block_k, c.stages, c.epilogue).total_bytes;
}

FitReport check_fit(const TileConfig& config, int64_t budget) {
  FitReport r;
  r.total_bytes = smem_bytes(config);
  r.limit_bytes = budget;
  r.fits = r.total_bytes <= budget;
  if (r.fits) return r;
  std::ostringstream advice;
  advice << "needs " << r.total_bytes - budget << " B more than the limit; ";
  TileConfig t = config;
  for (t.stages = config.stages - 1; t.stages >= 2; --t.stages)
    if (smem_bytes(t) <= budget) break;
  if (t.stages >= 2) {
    advice << "fits with stages=" << t.stages << " (" << t.to_string() << ", " << smem_bytes(t) << " B)";
    r.advice = advice.str();
    return r;
  }
  t = config;
  while (t.block_k > kFragK && smem_bytes(t) > budget) t.block_k /= 2;
  if (smem_bytes(t) <= budget) {
    advice << "fits with block_k=" << t.block_k << " (" << t.to_string() << ", " << smem_bytes(t) << " B)";
  } else {
    advice << "no stage count or block_k makes it fit; use a smaller block_m or block_n";
  }
  r.advice = advice.str();
  return r;
}

std::string format_layout(const TileConfig& config, int64_t budget) {
  const SmemLayout layout = smem_layout(config);
  const FitReport fit = check_fit(config, budget);
  std::ostringstream os;
  char line[256];
  os << "config " << config.to_string() << "  (" << to_string(config.family) << ", block_n " << config.block_n << ", block_m "
     << config.block_m << ", block_k " << config.block_k << ", " << config.stages << " stages, "
     << config.warps << " warps, epilogue " << to_string(config.epilogue) << ")\n";
  std::snprintf(line, sizeof line, "  %-13s %-62s %8s %8s\n", "region", "shape", "offset", "bytes");
  os << line;
  for (const auto& r : layout.regions) {
    std::snprintf(line, sizeof line, "  %-13s %-62s %8lld %8lld%s\n", r.name.c_str(),
                  r.shape.c_str(), static_cast<long long>(r.offset),
                  static_cast<long long>(r.bytes), r.overlaps_mainloop ? "  (union)" : "");
    os << line;
  }
  std::snprintf(line, sizeof line, "  %-13s %-62s %8s %8lld\n", "total", "", "",
                static_cast<long long>(layout.total_bytes));
  os << line;
  std::snprintf(line, sizeof line, "  %-13s %-62s %8s %8lld\n", "limit", "", "",
                static_cast<long long>(budget));
  os << line;
  os << "  " << (fit.fits ? "FITS" : "DOES NOT FIT") << " (" << layout.total_bytes << " of "
     << budget << " B, " << (fit.fits ? budget - layout.total_bytes : 0) << " B spare)";
  if (!fit.fits) os << ": " << fit.advice;
  os << "\n";
  return os.str();
}

// ----------------------------------------------------------------- planner

double expected_active_experts(int64_t num_experts, int top_k, int64_t num_tokens) {
  if (num_experts <= 0) return 0.0;
  const double p_miss = 1.0 - static_cast<double>(top_k) / static_cast<double>(num_experts);
  return static_cast<double>(num_experts) *
         (1.0 - std::pow(std::max(p_miss, 0.0), static_cast<double>(num_tokens)));
}

namespace {

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

void validate_problem(const GemmProblem& p) {
  FP4MOE_CHECK(p.num_experts >= 1 && p.num_experts <= kMaxExperts, "num_experts = ",
               p.num_experts, ": expected 1..", kMaxExperts);
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

GemmPlan plan_gemm_with(const GemmProblem& p, const TileConfig& config, int num_sms,
                        int blocks_per_sm, int split_k) {
  validate_problem(p);
  const int64_t k_tiles = ceil_div(p.k, config.block_k);
  FP4MOE_CHECK(split_k >= 0 && split_k <= k_tiles, "split_k = ", split_k, " for ", config.to_string(),
               " at k = ", p.k, ": expected 0 (the planner's choice) or 1 .. ", k_tiles,
               " (one k-tile per slice at least)");
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
      case Rationale::Note::Kind::kSplitKOffBatchInvariant: os << "; split-K off (batch invariant)"; break;
      case Rationale::Note::Kind::kSplitKOffTileCounters:
        os << "; split-K off (more tiles than the workspace's counters)";
        break;
      case Rationale::Note::Kind::kRowStage:
        os << "; experts of " << note.first_rows << "-" << note.max_rows << " rows first on " << note.config.to_string();
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

GemmPlan plan_gemm(const GemmProblem& p, int64_t smem_budget_bytes, int num_sms,
                   int compute_capability, int blocks_per_sm) {
  validate_problem(p);
  // The SM90 family where it runs and a config of it fits, else the portable one.
  auto candidates = [&](KernelFamily family) {
    std::vector<TileConfig> out;
    for (const auto& c : compiled_configs())
      if (c.family == family && c.epilogue == p.epilogue && smem_bytes(c) <= smem_budget_bytes)
        out.push_back(c);
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
    os << "no compiled tile config with the " << to_string(p.epilogue) << " epilogue fits "
       << smem_budget_bytes << " B of shared memory per block:";
    for (const auto& c : compiled_configs())
      if (c.epilogue == p.epilogue)
        os << "\n  " << c.to_string() << ": " << check_fit(c, smem_budget_bytes).advice;
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
        return with_row_stage(plan_gemm_with(p, *heavy, num_sms, blocks_per_sm), p, *pick, pick->block_m);
      const auto light = find(kSm90LightMaxRows, 2);
      if ((rows_per_expert <= kSm90LightMaxRows || pick->block_m == 160) && light != fitting.end())
        return with_row_stage(plan_gemm_with(p, *heavy, num_sms, blocks_per_sm), p, *light, kSm90LightMaxRows);
    }
  }
  return plan_gemm_with(p, *pick, num_sms, blocks_per_sm);
}

GemmPlan with_row_stage(GemmPlan plan, const GemmProblem& p, const TileConfig& config, int max_rows) {
  const int above = plan.row_stages.empty() ? 0 : plan.row_stages.back().max_rows;
  FP4MOE_CHECK(config.epilogue == plan.config.epilogue && max_rows > above, "with_row_stage: ", config.to_string(),
               " for ", plan.config.to_string(), " over experts of ", above + 1, " to ", max_rows, " rows");
  plan.row_stages.push_back({config, max_rows, max_tiles(p, config)});
  plan.why.notes.push_back({GemmPlan::Rationale::Note::Kind::kRowStage, config, above + 1, max_rows});
  return plan;
}

std::string describe_row_stages(const GemmPlan& plan) {
  std::string out;
  for (const GemmPlan::RowStage& s : plan.row_stages)
    out += s.config.to_string() + " (<= " + std::to_string(s.max_rows) + " rows), ";
  return out.empty() ? out : out + "then ";
}

}  // namespace fp4moe
