// A forward's plan per token count (include/fp4moe/moe_layer.hpp,
// MoeLayerPlan). Plans are cached per token count in a bounded LRU cache
// (kPlanCacheCapacity plans, src/layer/plan_cache.hpp), so a server that
// sees every token count holds a fixed amount of host memory. Each GEMM's
// plan is, in this order, a forced config, the tune cache's checked choice
// for the token count's bucket (read once by prepare(); src/tune/tune.hpp),
// or the heuristic. Tested in tests/layer/test_moe_layer_forward.cpp (GPU)
// and, with a tune cache, tests/tune/test_tune_gpu.cpp.
#include "fp4moe/moe_layer.hpp"

#include <cstdio>
#include <cstdlib>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "fp4moe/error.hpp"
#include "kernels/device_info.hpp"
#include "kernels/grouped_gemm.hpp"
#include "layer/layer_impl.hpp"
#include "plan/planner.hpp"
#include "tune/tune.hpp"

namespace fp4moe {

std::string PlanOrigin::describe() const {
  switch (kind) {
    case Kind::kForced:
      return "forced";
    case Kind::kTuned:
      return "tuned (bucket " + std::to_string(bucket) + " of " + cache_path + ")";
    case Kind::kHeuristic:
      break;
  }
  const std::string why = note();
  return why.empty() ? "heuristic" : "heuristic; " + why;
}

std::string PlanOrigin::note() const {
  if (kind != Kind::kHeuristic || unused_tuned_entry.empty()) return "";
  return "the tuned entry for bucket " + std::to_string(bucket) + " is not used: " + unused_tuned_entry;
}

std::string MoeLayerPlan::describe() const {
  std::ostringstream os;
  os << num_tokens << " tokens -> " << num_rows << " routed rows\n"
     << "  GEMM1 + SwiGLU  " << describe_row_classes(gemm1) << gemm1.config.to_string() << " split_k " << gemm1.split_k
     << " [" << gemm1_origin.describe() << "]: " << gemm1.reason() << "\n"
     << "  GEMM2 + finalize " << describe_row_classes(gemm2) << gemm2.config.to_string() << " split_k " << gemm2.split_k
     << " [" << gemm2_origin.describe() << "]: " << gemm2.reason() << "\n";
  if (fused_decode) os << "  both GEMMs and the combine in one launch (fused decode)\n";
  return os.str();
}

namespace {

// FP4MOE_PRINT_CONFIG=1: every new per-token-count plan (config, split-K,
// where each came from, the planner's reason) goes to stderr once, when it
// is made.
bool print_plans() {
  static const bool enabled = [] {
    const char* v = std::getenv("FP4MOE_PRINT_CONFIG");
    return v != nullptr && *v != '\0' && std::string(v) != "0";
  }();
  return enabled;
}

}  // namespace

GemmProblem MoeLayer::Impl::problem(int gemm, int64_t num_tokens) const {
  GemmProblem p = moe_gemm_problem(gemm, num_experts, top_k, hidden, inter, num_tokens, options.batch_invariant);
  // The shared chunks: always active, one row per token each.
  p.num_experts += num_shared;
  p.num_rows = num_tokens * rows_per_token();
  p.expected_active_experts += num_shared;
  return p;
}

// Reads the tune cache for this device (MoeLayerOptions::use_tune_cache)
// and checks both GEMMs' entries; what is wrong with it is reported once
// per process. A cache never makes prepare() fail: anything unexpected
// leaves the heuristic in charge, reported.
void MoeLayer::Impl::load_tuned_choices() {
  if (!options.use_tune_cache) return;
  const std::string path = options.tune_cache_path.empty() ? tune::default_cache_path() : options.tune_cache_path;
  if (path.empty()) return;
  try {
    read_tuned_choices(path);
  } catch (const Error& e) {
    tuned[0] = tune::TunedGemm();
    tuned[1] = tune::TunedGemm();
    tune::report_once("tune cache " + path + " not used: " + e.message());
  }
}
void MoeLayer::Impl::read_tuned_choices(const std::string& path) {
  const tune::CacheFile cache = tune::read_cache(path);
  if (!cache.problem.empty()) tune::report_once(cache.problem);
  if (cache.entries.empty()) return;
  const tune::DeviceIdentity identity = tune::current_device_identity();
  if (const std::string stale = tune::stale_entries_note(cache, identity); !stale.empty()) tune::report_once(stale);
  const kernels::DeviceInfo dev = kernels::current_device();
  const tune::DeviceLimits limits{dev.smem_per_block, kernels::compute_capability(dev)};
  std::vector<std::string> warnings;
  for (int gemm : {1, 2})
    tuned[gemm - 1] =
        tune::TunedGemm(cache, identity, problem(gemm, 1), top_k, limits, options.batch_invariant, &warnings);
  for (const std::string& warning : warnings) tune::report_once(warning);
}

// One GEMM's plan: the forced config, else the tuned choice, else the
// heuristic, each as the layer runs it (limit_split_k).
GemmPlan MoeLayer::Impl::plan_one_gemm(int gemm, int64_t num_tokens, PlanOrigin* origin) const {
  const GemmProblem p = problem(gemm, num_tokens);
  const std::optional<TileConfig>& forced = gemm == 1 ? options.gemm1_config : options.gemm2_config;
  *origin = PlanOrigin{};
  if (forced) {
    origin->kind = PlanOrigin::Kind::kForced;
    return limit_split_k(plan_grouped_gemm(p, forced), options.batch_invariant);
  }
  const tune::TunedGemm& choices = tuned[gemm - 1];
  if (const tune::TunedChoice* tuned_choice = choices.find(num_tokens)) {
    if (tuned_choice->rejected.empty()) {
      origin->kind = PlanOrigin::Kind::kTuned;
      origin->cache_path = choices.cache_path();
      origin->bucket = tuned_choice->bucket;
      // The heuristic's own config and split run as the heuristic plans
      // them (row classes included), as `fp4moe tune` timed them.
      const GemmPlan heuristic = limit_split_k(plan_grouped_gemm(p), options.batch_invariant);
      if (heuristic.config == tuned_choice->choice.config && heuristic.split_k == tuned_choice->choice.split_k)
        return heuristic;
      return limit_split_k(plan_grouped_gemm(p, tuned_choice->choice.config, tuned_choice->choice.split_k),
                           options.batch_invariant);
    }
    origin->bucket = tuned_choice->bucket;  // note() says so, when asked
    origin->unused_tuned_entry = tuned_choice->rejected;
  }
  return limit_split_k(plan_grouped_gemm(p), options.batch_invariant);
}

MoeLayerPlan MoeLayer::Impl::make_plan(int64_t num_tokens) const {
  MoeLayerPlan p;
  p.num_tokens = num_tokens;
  p.num_rows = num_tokens * rows_per_token();
  p.gemm1 = plan_one_gemm(1, num_tokens, &p.gemm1_origin);
  p.gemm2 = plan_one_gemm(2, num_tokens, &p.gemm2_origin);
  plan_fused_decode(p);
  return p;
}

// The fused decode kernel (MoeLayerOptions::fused_decode; the tile rule is
// the planner's, fused_decode_tile) needs the deterministic finalize and
// room for its counters in the header's split-K counters.
void MoeLayer::Impl::plan_fused_decode(MoeLayerPlan& p) const {
  if (!options.fused_decode || options.finalize != FinalizeMode::kDeterministic ||
      fused_decode_counter_ints(p.num_rows, p.num_tokens, hidden) > 2 * kMaxSplitKTiles)
    return;
  const auto chosen = [](const PlanOrigin& o) { return o.kind != PlanOrigin::Kind::kHeuristic; };
  std::optional<TileConfig> tile =
      fused_decode_tile(p.num_tokens, p.gemm1, chosen(p.gemm1_origin), p.gemm2, chosen(p.gemm2_origin));
  if (!tile) return;
  p.fused_decode = true;
  tile->epilogue = Epilogue::kSwiglu;
  p.gemm1 = plan_grouped_gemm(problem(1, p.num_tokens), tile, 1);
  tile->epilogue = Epilogue::kFinalize;
  p.gemm2 = plan_grouped_gemm(problem(2, p.num_tokens), tile, 1);
}

// A shared pointer into the bounded cache: a forward copies no plan (its
// reason strings), and a plan evicted by another thread meanwhile stays
// alive while this one holds it.
std::shared_ptr<const MoeLayerPlan> MoeLayer::Impl::plan(int64_t num_tokens) const {
  if (auto hit = plans.find(num_tokens)) return hit;
  auto [plan, added] = plans.insert(num_tokens, make_plan(num_tokens));
  if (added && print_plans()) std::fprintf(stderr, "fp4moe: plan for %s", plan->describe().c_str());
  return plan;
}

MoeLayerPlan MoeLayer::plan(int64_t num_tokens) const {
  FP4MOE_CHECK(num_tokens >= 1 && num_tokens < layer::max_tokens_for(impl_->rows_per_token()),
               "MoeLayer::plan: num_tokens = ", num_tokens, "; expected 1 .. 2^31 / top_k");
  return *impl_->plan(num_tokens);
}

}  // namespace fp4moe
