// `fp4moe plan`: every compiled tile config's shared-memory layout for an
// architecture (or the local GPU), whether it fits and why, what would make
// it fit, and the config the planner picks per token-count bucket for a model.
// Tested in tests/tools/test_cli.cpp (runs the binary).
#include <cstdio>
#include <iostream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "commands.hpp"
#include "fp4moe/error.hpp"
#include "fp4moe/plan.hpp"
#include "models.hpp"

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

void plan_one(const PlanOptions& o, const ArchLimits& arch, int num_sms, const std::string& origin,
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
    std::cout << "== " << arch.name << " (" << origin << "): " << budget
              << " B shared memory per block (opt-in), " << arch.smem_per_sm << " B per SM, " << num_sms
              << " SMs ==\n\n";
  }
  for (const TileConfig& c : compiled_configs()) {
    const FitReport fit = check_fit(c, budget);
    const SmemLayout layout = smem_layout(c);
    const int64_t per_block = layout.total_bytes + arch.smem_reserved_per_block;
    const int64_t resident = fit.fits ? arch.smem_per_sm / per_block : 0;
    nlohmann::json regions = nlohmann::json::array();
    for (const auto& r : layout.regions)
      regions.push_back({{"name", r.name}, {"shape", r.shape}, {"offset", r.offset}, {"bytes", r.bytes},
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
      std::cout << format_layout(c, budget) << "  blocks per SM (shared memory bound): " << resident << "\n";
      if (!runs)
        std::cout << "  (the " << to_string(c.family) << " family does not run on " << arch.name
                  << ": shown for its shared-memory fit only)\n";
      std::cout << "\n";
    }
  }
  if (!out) {
    std::cout << "planner choice for " << label << ", per token count (GEMM1: N = 2*inter, K = hidden; GEMM2: N = "
                                                   "hidden, K = inter):\n";
    std::printf("  %7s %8s  %-27s %-29s %s\n", "tokens", "rows", "GEMM1", "GEMM2", "why (GEMM1)");
  }
  for (int64_t t : o.tokens) {
    const int64_t rows = t * topk;
    const int64_t active = static_cast<int64_t>(expected_active_experts(experts, topk, t) + 0.5);
    // The layer's GEMMs: GEMM1 with the fused SwiGLU, GEMM2 with the fused finalize.
    GemmProblem g1{experts, 2 * inter, hidden, rows, std::max<int64_t>(active, 1), Epilogue::kSwiglu};
    GemmProblem g2{experts, hidden, inter, rows, std::max<int64_t>(active, 1), Epilogue::kFinalize};
    const GemmPlan p1 = plan_gemm(g1, budget, num_sms, arch.compute_capability);
    const GemmPlan p2 = plan_gemm(g2, budget, num_sms, arch.compute_capability);
    auto name = [](const GemmPlan& p) { return p.config.to_string() + " sk" + std::to_string(p.split_k); };
    j["plans"].push_back({{"tokens", t}, {"rows", rows}, {"expected_active_experts", active},
                          {"gemm1", {{"config", p1.config.to_string()}, {"split_k", p1.split_k}, {"reason", p1.reason}}},
                          {"gemm2", {{"config", p2.config.to_string()}, {"split_k", p2.split_k}, {"reason", p2.reason}}}});
    if (!out)
      std::printf("  %7lld %8lld  %-27s %-29s %s\n", static_cast<long long>(t), static_cast<long long>(rows),
                  name(p1).c_str(), name(p2).c_str(), p1.reason.c_str());
  }
  if (out) out->push_back(j);
  else std::cout << "\n";
}

}  // namespace

void add_plan_command(CLI::App& app) {
  auto opts = std::make_shared<PlanOptions>();
  CLI::App* cmd = app.add_subcommand(
      "plan", "Show every compiled kernel config's shared-memory layout, whether it fits an architecture (and "
              "what would make it fit), and the planner's choice per token count.");
  cmd->add_option("--arch", opts->arch, "Target: " + [] {
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
  cmd->callback([opts] {
    const PlanOptions& o = *opts;
    if (o.experts > 0 || o.hidden > 0 || o.inter > 0 || o.topk > 0)
      FP4MOE_CHECK(o.experts > 0 && o.hidden > 0 && o.inter > 0 && o.topk > 0 && o.topk <= o.experts,
                   "a custom shape needs --experts, --hidden, --inter and --topk (1 <= topk <= experts)");
    FP4MOE_CHECK(o.smem_budget >= 0, "--smem-budget must be >= 0");
    nlohmann::json all = nlohmann::json::array();
    nlohmann::json* out = o.json ? &all : nullptr;
    if (!o.arch.empty()) {
      plan_one(o, arch_limits(o.arch), o.num_sms > 0 ? o.num_sms : default_sms(o.arch), "requested", out);
    } else {
      ArchLimits local;
      std::string device;
      if (local_arch_limits(&local, &device)) {
        int sms = o.num_sms;
        if (sms <= 0) sms = default_sms(local.name);
        plan_one(o, local, sms, "local GPU: " + device, out);
      } else {
        if (!o.json) std::cout << "no CUDA GPU found on this machine; showing sm90 (H100/H200) and sm120 (RTX 50xx / RTX PRO)\n\n";
        for (const char* a : {"sm90", "sm120"})
          plan_one(o, arch_limits(a), o.num_sms > 0 ? o.num_sms : default_sms(a), "no local GPU", out);
      }
    }
    if (o.json) std::cout << all.dump(2) << "\n";
  });
}

}  // namespace fp4moe::cli
