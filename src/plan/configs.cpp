// Architecture limits, tile configs and their shared-memory layout tables
// with the fit report `fp4moe plan` prints (include/fp4moe/plan.hpp); the
// planner that picks among the configs is src/plan/planner.cpp. Host-only;
// tested in tests/plan/test_plan.cpp.
#include "fp4moe/plan.hpp"

#include <algorithm>
#include <cstdio>
#include <sstream>

#include "fp4moe/error.hpp"
#include "plan/compiled_configs.hpp"
#include "plan/planner.hpp"
#include "plan/smem_model.hpp"

namespace fp4moe {

// ------------------------------------------------------------- architectures

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

int64_t blocks_per_sm_by_smem(const TileConfig& config, const ArchLimits& arch) {
  const int64_t by_smem = arch.smem_per_sm / (smem_bytes(config) + arch.smem_reserved_per_block);
  // An SM90 kernel's registers are split for the blocks it is compiled for.
  if (config.family == KernelFamily::kSm90) return std::min<int64_t>(by_smem, sm90_smem_layout(config).blocks_per_sm);
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
    case Epilogue::kNone:
      return "none";
    case Epilogue::kSwiglu:
      return "swiglu";
    case Epilogue::kFinalize:
      return "finalize";
  }
  return "?";
}

std::string to_string(KernelFamily family) { return family == KernelFamily::kSm90 ? "sm90" : "portable"; }

namespace {
constexpr std::string_view kSm90Prefix = "sm90";
}  // namespace

std::string TileConfig::to_string() const {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%sn%dm%dk%ds%dw%d", family == KernelFamily::kSm90 ? kSm90Prefix.data() : "", block_n,
                block_m, block_k, stages, warps);
  return epilogue == Epilogue::kNone ? std::string(buf) : std::string(buf) + "-" + fp4moe::to_string(epilogue);
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
  if (std::sscanf(s.c_str(), "n%dm%dk%ds%dw%d%n", &c.block_n, &c.block_m, &c.block_k, &c.stages, &c.warps, &consumed) !=
          5 ||
      consumed != static_cast<int>(s.size()))
    FP4MOE_THROW("malformed tile config '", name,
                 "': expected [sm90]n<BLOCK_N>m<BLOCK_M>k<BLOCK_K>s<STAGES>w<WARPS>[-epilogue], e.g. "
                 "n128m8k256s4w4 or sm90n128m64k128s6w12-swiglu");
  FP4MOE_CHECK(c.block_n > 0 && c.block_m > 0 && c.block_k > 0 && c.stages > 0 && c.warps > 0, "tile config '", name,
               "' has a zero field");
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
    case Epilogue::kNone:
      return "BLOCK_N+8";
    case Epilogue::kSwiglu:
      return "BLOCK_N/2+8";
    case Epilogue::kFinalize:
      return "BLOCK_N+4";
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
  const PortableSmemLayout l = portable_smem_layout(c.block_n, c.block_m, c.block_k, c.stages, c.epilogue);
  const std::string stages = "STAGES=" + std::to_string(c.stages);
  const std::string bn = "BLOCK_N=" + std::to_string(c.block_n);
  const std::string bm = "BLOCK_M=" + std::to_string(c.block_m);
  SmemLayout out;
  out.regions = {
      {"weights", dims({stages, bn, "BLOCK_K/2=" + std::to_string(c.block_k / 2)}) + " packed fp4", l.weight_offset,
       l.weight_bytes, false},
      {"scales", dims({stages, bn, "BLOCK_K/16=" + std::to_string(c.block_k / 16)}) + " e4m3", l.scale_offset,
       l.scale_bytes, false},
      {"activations", dims({stages, bm, "BLOCK_K=" + std::to_string(c.block_k)}) + " bf16", l.act_offset, l.act_bytes,
       false},
      {"alignment", "padding to 128 B", l.act_offset + l.act_bytes, l.mainloop_end - (l.act_offset + l.act_bytes),
       false},
      {"epilogue",
       dims({bm, epilogue_row_formula(c.epilogue) + "=" + std::to_string(l.epi_row_elems)}) +
           (l.epi_elem_bytes == 4 ? " fp32" : " bf16") + " " + fp4moe::to_string(c.epilogue) +
           " staging, reuses the pipeline",
       l.epilogue_offset, l.epilogue_bytes, true},
      {"row indices", dims({"3", bm}) + " int32/fp32 gather row, output row, router weight", l.rows_offset,
       l.rows_bytes, false},
      {"schedule", "(" + std::to_string(kMaxExperts + 1) + " + 32) int32 m-tile prefix per expert", l.schedule_offset,
       l.schedule_bytes, false},
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
      {"weights", dims({stages, bn, "BLOCK_K/2=" + std::to_string(c.block_k / 2)}) + " packed fp4", l.weight_offset,
       l.weight_bytes, false},
      {"scales", dims({stages, bn, "BLOCK_K/16=" + std::to_string(c.block_k / 16)}) + " e4m3", l.scale_offset,
       l.scale_bytes, false},
      {"barriers", dims({std::to_string(kSm90StageBarriers), stages}) + " mbarrier full/act/weights free",
       l.barrier_offset, l.barrier_bytes, false},
      {"alignment", "padding to 128 B", l.barrier_offset + l.barrier_bytes,
       l.ring_end - (l.barrier_offset + l.barrier_bytes), false},
      {"epilogue",
       dims({"CONSUMERS=" + std::to_string(kSm90Consumers), "CHUNK=" + std::to_string(l.chunk_tokens),
             std::to_string(l.epi_row_elems)}) +
           (l.epi_elem_bytes == 4 ? " fp32 " : " bf16 ") + fp4moe::to_string(c.epilogue) + " staging",
       l.epilogue_offset, int64_t{kSm90Consumers} * l.chunk_tokens * epi_row_bytes, false},
      {"row indices", dims({bm}) + " int64 producer's gathered row offsets", l.rows_offset, l.rows_bytes, false},
  };
  if (l.slots_bytes > 0)
    out.regions.push_back({"output slots",
                           dims({"CONSUMERS=" + std::to_string(kSm90Consumers), bm}) + " int32 slot, fp32 weight",
                           l.slots_offset, l.slots_bytes, false});
  out.regions.push_back({"schedule", "(" + std::to_string(kMaxExperts + 1) + " + 32) int32 m-tile prefix per expert",
                         l.schedule_offset, l.schedule_bytes, false});
  out.regions.push_back({"split-k flag", "(4) int32 + padding", l.flag_offset, l.total_bytes - l.flag_offset, false});
  out.total_bytes = l.total_bytes;
  return out;
}

// The configs the shared-memory model describes.
void check_layout_config(const TileConfig& c) {
  FP4MOE_CHECK(c.block_n % kFragRows == 0 && c.block_k % kFragK == 0 && c.stages >= 1, "tile config ", c.to_string(),
               ": BLOCK_N must be a multiple of ", kFragRows, " and BLOCK_K of ", kFragK);
  if (c.family == KernelFamily::kSm90)
    FP4MOE_CHECK(c.block_n == kSm90BlockN && c.warps == kSm90Threads / 32 && c.block_m % 8 == 0 && c.block_m <= 256,
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
  os << "config " << config.to_string() << "  (" << to_string(config.family) << ", block_n " << config.block_n
     << ", block_m " << config.block_m << ", block_k " << config.block_k << ", " << config.stages << " stages, "
     << config.warps << " warps, epilogue " << to_string(config.epilogue) << ")\n";
  std::snprintf(line, sizeof line, "  %-13s %-62s %8s %8s\n", "region", "shape", "offset", "bytes");
  os << line;
  for (const auto& r : layout.regions) {
    std::snprintf(line, sizeof line, "  %-13s %-62s %8lld %8lld%s\n", r.name.c_str(), r.shape.c_str(),
                  static_cast<long long>(r.offset), static_cast<long long>(r.bytes),
                  r.overlaps_mainloop ? "  (union)" : "");
    os << line;
  }
  std::snprintf(line, sizeof line, "  %-13s %-62s %8s %8lld\n", "total", "", "",
                static_cast<long long>(layout.total_bytes));
  os << line;
  std::snprintf(line, sizeof line, "  %-13s %-62s %8s %8lld\n", "limit", "", "", static_cast<long long>(budget));
  os << line;
  os << "  " << (fit.fits ? "FITS" : "DOES NOT FIT") << " (" << layout.total_bytes << " of " << budget << " B, "
     << (fit.fits ? budget - layout.total_bytes : 0) << " B spare)";
  if (!fit.fits) os << ": " << fit.advice;
  os << "\n";
  return os.str();
}

}  // namespace fp4moe
