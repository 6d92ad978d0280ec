// `fp4moe plan`: every compiled tile config's shared-memory layout for an
// architecture (or the local GPU), whether it fits and why, what would make
// it fit, and the config and split-K a layer of a model runs per token count:
// on the local GPU the tune cache's checked choice where it holds one
// (`fp4moe tune`, src/tune/tune.hpp), else the planner's heuristic, with
// where each came from.
// Tested in tests/tools/test_cli.cpp (runs the binary) and
// tests/tools/test_cli_gpu.cpp (tuned choices).
#include <cstdio>
#include <iostream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "commands.hpp"
#include "fp4moe/error.hpp"
#include "fp4moe/plan.hpp"
#include "models.hpp"
#include "plan/planner.hpp"
#include "tune/tune.hpp"

namespace fp4moe::cli {

namespace {

struct PlanOptions {
  std::string arch;
  int64_t smem_budget = 0;
  std::string model = std::string(kDefaultModel);
  int64_t experts = 0, hidden = 0, inter = 0;
  int topk = 0;
  std::vector<int64_t> tokens = {1, 4, 16, 64, 256, 1024, 4096, 16384};
  int num_sms = 0;
  bool json = false;
  std::string cache;  // empty: tune::default_cache_path()
};

// The tuned choices of a layer's two GEMMs on the local GPU.
struct LayerTunedChoices {
  tune::TunedGemm gemm[2];
};

// Typical multiprocessor counts, for the split-K choice when planning for a
// GPU that is not present.
int default_sms(const std::string& arch) {
  if (arch == "sm80") return 108;
  if (arch == "sm86") return 84;
  if (arch == "sm89") return 128;
  if (arch == "sm90") return 132;
  if (arch == "sm100") return 148;
  if (arch == "sm120") return 188;
  return 132;
}

// The tune cache's choices for the model's GEMMs on the local GPU under
// `budget`; what is wrong with the cache goes to stderr once.
LayerTunedChoices local_tuned_choices(const std::string& cache_path, const ArchLimits& arch, int64_t budget,
                                      int64_t experts, int topk, int64_t hidden, int64_t inter) {
  LayerTunedChoices tuned;
  if (cache_path.empty()) return tuned;
  const tune::CacheFile cache = tune::read_cache(cache_path);
  if (!cache.problem.empty()) tune::report_once(cache.problem);
  if (cache.entries.empty()) return tuned;
  const tune::DeviceIdentity identity = tune::current_device_identity();
  if (const std::string stale = tune::stale_entries_note(cache, identity); !stale.empty()) tune::report_once(stale);
  std::vector<std::string> warnings;
  for (int gemm : {1, 2})
    tuned.gemm[gemm - 1] = tune::TunedGemm(cache, identity, moe_gemm_problem(gemm, experts, topk, hidden, inter, 1),
                                           topk, {budget, arch.compute_capability}, false, &warnings);
  for (const std::string& warning : warnings) tune::report_once(warning);
  return tuned;
}

void plan_one(const PlanOptions& o, const ArchLimits& arch, int num_sms, const std::string& origin, bool local,
              nlohmann::json* out) {
  const int64_t budget = o.smem_budget > 0 ? std::min(o.smem_budget, arch.smem_per_block) : arch.smem_per_block;
  const ModelShape* model = o.experts > 0 ? nullptr : &find_model(o.model);
  const int64_t experts = model ? model->num_experts : o.experts;
  const int64_t hidden = model ? model->hidden : o.hidden;
  const int64_t inter = model ? model->inter : o.inter;
  const int topk = model ? model->top_k : o.topk;
  const std::string label = model ? std::string(model->display)
                                  : "custom (" + std::to_string(experts) + " experts, top-" + std::to_string(topk) +
                                        ", hidden " + std::to_string(hidden) + ", inter " + std::to_string(inter) + ")";
  nlohmann::json j{{"arch", arch.name},
                   {"origin", origin},
                   {"smem_budget_bytes", budget},
                   {"smem_per_sm_bytes", arch.smem_per_sm},
                   {"model", label},
                   {"configs", nlohmann::json::array()},
                   {"plans", nlohmann::json::array()}};
  if (!out) {
    std::cout << "== " << arch.name << " (" << origin << "): " << budget << " B shared memory per block (opt-in), "
              << arch.smem_per_sm << " B per SM, " << num_sms << " SMs ==\n\n";
  }
  for (const TileConfig& c : compiled_configs()) {
    const FitReport fit = check_fit(c, budget);
    const SmemLayout layout = smem_layout(c);
    const int64_t resident = fit.fits ? blocks_per_sm_by_smem(c, arch) : 0;
    nlohmann::json regions = nlohmann::json::array();
    for (const auto& r : layout.regions)
      regions.push_back({{"name", r.name},
                         {"shape", r.shape},
                         {"offset", r.offset},
                         {"bytes", r.bytes},
                         {"union_with_mainloop", r.overlaps_mainloop}});
    const bool runs = family_runs_on(c.family, arch.compute_capability);
    j["configs"].push_back({{"config", c.to_string()},
                            {"family", to_string(c.family)},
                            {"runs_on_arch", runs},
                            {"total_bytes", layout.total_bytes},
                            {"fits", fit.fits},
                            {"advice", fit.advice},
                            {"blocks_per_sm_by_smem", resident},
                            {"regions", regions}});
    if (!out) {
      std::cout << format_layout(c, budget) << "  blocks per SM (shared memory bound"
                << (c.family == KernelFamily::kSm90 ? ", at most the blocks the kernel is compiled for" : "")
                << "): " << resident << "\n";
      if (!runs)
        std::cout << "  (the " << to_string(c.family) << " family does not run on " << arch.name
                  << ": shown for its shared-memory fit only)\n";
      std::cout << "\n";
    }
  }
  const std::string cache_path = o.cache.empty() ? tune::default_cache_path() : o.cache;
  const LayerTunedChoices tuned =
      local ? local_tuned_choices(cache_path, arch, budget, experts, topk, hidden, inter) : LayerTunedChoices{};
  j["tune_cache"] = local ? nlohmann::json(cache_path) : nlohmann::json(nullptr);
  if (!out) {
    std::cout << "per token count, what a layer of " << label
              << " runs (GEMM1: N = 2*inter, K = hidden; GEMM2: N = hidden, K = inter) and where it came from ("
              << (local ? (cache_path.empty() ? "no tune cache" : "tune cache " + cache_path)
                        : "tuned choices apply to the local GPU only")
              << "):\n";
    std::printf("  %7s %8s  %-33s %-35s %-20s %s\n", "tokens", "rows", "GEMM1", "GEMM2", "from (GEMM1, GEMM2)",
                "why (GEMM1)");
    std::cout << "  (\"fused\": both GEMMs and the combine in one launch of the fused decode kernel, docs/design.md "
                 "§4.8)\n";
  }
  for (int64_t t : o.tokens) {
    // The layer's GEMMs, GEMM1 with the fused SwiGLU, GEMM2 with the fused
    // finalize, as MoeLayer plans them: the tuned choice for the bucket of t
    // where there is a valid one, else the heuristic.
    GemmPlan plans[2];
    std::string sources[2];
    for (int gemm : {1, 2}) {
      const GemmProblem problem = moe_gemm_problem(gemm, experts, topk, hidden, inter, t);
      const tune::TunedChoice* choice = tuned.gemm[gemm - 1].find(t);
      if (choice && choice->rejected.empty()) {
        plans[gemm - 1] = plan_gemm_with(problem, choice->choice.config, num_sms, 2, choice->choice.split_k);
        sources[gemm - 1] = "tuned@" + std::to_string(choice->bucket);
      } else {
        plans[gemm - 1] = plan_gemm(problem, budget, num_sms, arch.compute_capability);
        sources[gemm - 1] = "heuristic";
      }
      plans[gemm - 1] = limit_split_k(plans[gemm - 1], false);
    }
    const GemmProblem g1 = moe_gemm_problem(1, experts, topk, hidden, inter, t);
    // The layer's fused decode launch (both GEMMs and the combine in one
    // kernel of one tile, unsplit) where it applies (the deterministic
    // finalize, the default).
    const std::optional<TileConfig> fused =
        fused_decode_tile(t, plans[0], sources[0] != "heuristic", plans[1], sources[1] != "heuristic");
    if (fused)
      for (int gemm : {1, 2}) {
        TileConfig tile = *fused;
        tile.epilogue = gemm == 1 ? Epilogue::kSwiglu : Epilogue::kFinalize;
        plans[gemm - 1] = plan_gemm_with(moe_gemm_problem(gemm, experts, topk, hidden, inter, t), tile, num_sms, 2, 1);
      }
    auto name = [](const GemmPlan& p) {
      return describe_row_classes(p) + p.config.to_string() + " sk" + std::to_string(p.split_k);
    };
    auto plan_json = [](const GemmPlan& p, const std::string& source) {
      nlohmann::json out{
          {"config", p.config.to_string()}, {"split_k", p.split_k}, {"reason", p.reason()}, {"source", source}};
      for (const GemmPlan::RowClass& s : p.row_classes)
        out["row_stages"].push_back({{"config", s.config.to_string()}, {"max_rows", s.max_rows}});
      return out;
    };
    j["plans"].push_back({{"tokens", t},
                          {"rows", g1.num_rows},
                          {"expected_active_experts", g1.expected_active_experts},
                          {"gemm1", plan_json(plans[0], sources[0])},
                          {"gemm2", plan_json(plans[1], sources[1])},
                          {"fused_decode", fused.has_value()}});
    if (!out)
      std::printf("  %7lld %8lld  %-33s %-35s %-20s %s\n", static_cast<long long>(t),
                  static_cast<long long>(g1.num_rows), name(plans[0]).c_str(), name(plans[1]).c_str(),
                  (sources[0] + ", " + sources[1] + (fused ? ", fused" : "")).c_str(), plans[0].reason().c_str());
  }
  if (out)
    out->push_back(j);
  else
    std::cout << "\n";
}

}  // namespace

void add_plan_command(CLI::App& app) {
  auto opts = std::make_shared<PlanOptions>();
  CLI::App* cmd = app.add_subcommand(
      "plan",
      "Show every compiled kernel config's shared-memory layout, whether it fits an architecture (and "
      "what would make it fit), and the planner's choice per token count.");
  cmd->add_option(
      "--arch", opts->arch, "Target: " + [] {
        std::string s;
        for (const auto& a : known_archs()) s += (s.empty() ? "" : ", ") + a;
        return s;
      }() + " (default: the local GPU, else sm90 and sm120)");
  cmd->add_option("--smem-budget", opts->smem_budget, "Per-block shared-memory budget in bytes (<= the arch's limit)");
  cmd->add_option("--model", opts->model, "Model shape: " + model_names())->capture_default_str();
  cmd->add_option("--experts", opts->experts, "Custom shape: number of experts (with --hidden, --inter, --topk)");
  cmd->add_option("--hidden", opts->hidden, "Custom shape: hidden size");
  cmd->add_option("--inter", opts->inter, "Custom shape: expert intermediate size");
  cmd->add_option("--topk", opts->topk, "Custom shape: experts per token");
  cmd->add_option("--tokens", opts->tokens, "Token counts to plan for")->capture_default_str();
  cmd->add_option("--sms", opts->num_sms, "Multiprocessor count for split-K (default: the GPU's or typical)");
  cmd->add_flag("--json", opts->json, "Print JSON instead of tables");
  cmd->add_option("--cache", opts->cache,
                  "Tune cache whose choices the local GPU's plans show (default: $FP4MOE_TUNE_CACHE, else "
                  "$XDG_CACHE_HOME/fp4moe/tune-cache.json, else ~/.cache/fp4moe/tune-cache.json)");
  cmd->callback([opts] {
    const PlanOptions& o = *opts;
    if (o.experts > 0 || o.hidden > 0 || o.inter > 0 || o.topk > 0)
      FP4MOE_CHECK(o.experts > 0 && o.hidden > 0 && o.inter > 0 && o.topk > 0 && o.topk <= o.experts,
                   "a custom shape needs --experts, --hidden, --inter and --topk (1 <= topk <= experts)");
    FP4MOE_CHECK(o.smem_budget >= 0, "--smem-budget must be >= 0");
    nlohmann::json all = nlohmann::json::array();
    nlohmann::json* out = o.json ? &all : nullptr;
    if (!o.arch.empty()) {
      plan_one(o, arch_limits(o.arch), o.num_sms > 0 ? o.num_sms : default_sms(o.arch), "requested", false, out);
    } else {
      ArchLimits local;
      std::string device;
      if (local_arch_limits(&local, &device)) {
        int sms = o.num_sms;
        if (sms <= 0) sms = default_sms(local.name);
        plan_one(o, local, sms, "local GPU: " + device, true, out);
      } else {
        if (!o.json)
          std::cout << "no CUDA GPU found on this machine; showing sm90 (H100/H200) and sm120 (RTX 50xx / RTX PRO)\n\n";
        for (const char* a : {"sm90", "sm120"})
          plan_one(o, arch_limits(a), o.num_sms > 0 ? o.num_sms : default_sms(a), "no local GPU", false, out);
      }
    }
    if (o.json) std::cout << all.dump(2) << "\n";
  });
}

}  // namespace fp4moe::cli
