// Buckets, candidates and checked tuned choices (src/tune/tune.hpp).
// Host-only; tested in tests/tune/test_tune_cache.cpp.
#include "tune/tune.hpp"

#include <algorithm>
#include <map>

#include "fp4moe/error.hpp"
#include "plan/planner.hpp"

namespace fp4moe::tune {

const std::vector<int64_t>& default_buckets() {
  static const std::vector<int64_t> buckets = {1,   2,    4,    8,    16,   32,   64,   128,  256,   384,  512,
                                               768, 1024, 1536, 2048, 3072, 4096, 6144, 8192, 12288, 16384};
  return buckets;
}

int64_t bucket_for(int64_t num_tokens, const std::vector<int64_t>& buckets) {
  if (buckets.empty()) return 0;
  const auto it = std::lower_bound(buckets.begin(), buckets.end(), num_tokens);
  return it == buckets.end() ? buckets.back() : *it;
}

std::string Candidate::to_string() const { return config.to_string() + " split_k " + std::to_string(split_k); }

KernelFamily invariant_family(Epilogue epilogue, const DeviceLimits& limits) {
  if (family_runs_on(KernelFamily::kSm90, limits.compute_capability))
    for (const TileConfig& c : compiled_configs())
      if (c.family == KernelFamily::kSm90 && c.epilogue == epilogue && smem_bytes(c) <= limits.smem_budget_bytes)
        return KernelFamily::kSm90;
  return KernelFamily::kPortable;
}

std::vector<Candidate> candidates(const GemmProblem& problem, const DeviceLimits& limits, bool batch_invariant) {
  const KernelFamily only = invariant_family(problem.epilogue, limits);
  std::vector<Candidate> out;
  for (const TileConfig& c : compiled_configs()) {
    if (c.epilogue != problem.epilogue || !family_runs_on(c.family, limits.compute_capability) ||
        smem_bytes(c) > limits.smem_budget_bytes || (batch_invariant && c.family != only))
      continue;
    // Split-K needs the layer's tile counters (limit_split_k) and changes the
    // order of summation (batch invariance).
    const bool may_split = !batch_invariant && max_tiles(problem, c) <= kMaxSplitKTiles;
    for (int split = 1; split <= (may_split ? kMaxSplitK : 1) && split_k_allowed(problem, c, split); ++split)
      out.push_back({c, split});
  }
  return out;
}

std::string check_choice(const std::string& config, int split_k, const GemmProblem& problem,
                         const DeviceLimits& limits) {
  TileConfig c;
  try {
    c = TileConfig::parse(config);
  } catch (const Error& e) {
    return e.message();
  }
  const std::string name = "config '" + config + "'";
  if (c.epilogue != problem.epilogue)
    return name + " has the " + to_string(c.epilogue) + " epilogue; this GEMM's is " + to_string(problem.epilogue);
  if (!is_compiled(c)) return name + " is not compiled into this build";
  if (!family_runs_on(c.family, limits.compute_capability))
    return name + " is of the " + to_string(c.family) + " family, which does not run on compute capability " +
           std::to_string(limits.compute_capability / 10) + "." + std::to_string(limits.compute_capability % 10);
  const FitReport fit = check_fit(c, limits.smem_budget_bytes);
  if (!fit.fits)
    return name + " needs " + std::to_string(fit.total_bytes) + " B of shared memory per block; this GPU allows " +
           std::to_string(fit.limit_bytes) + " B";
  if (!split_k_allowed(problem, c, split_k))
    return "split_k " + std::to_string(split_k) + " is not a split the planner could pick for " + name +
           " at k = " + std::to_string(problem.k) + " (1, or 2 .. " + std::to_string(kMaxSplitK) +
           " slices of at least two k-tiles)";
  return {};
}

std::string check_batch_invariant(const Candidate& choice, Epilogue epilogue, const DeviceLimits& limits) {
  if (choice.split_k != 1)
    return "split_k " + std::to_string(choice.split_k) + " changes the order in which K is summed";
  const KernelFamily only = invariant_family(epilogue, limits);
  if (choice.config.family != only) return "a batch-invariant layer keeps to the " + to_string(only) + " family";
  return {};
}

TunedGemm::TunedGemm(const CacheFile& cache, const DeviceIdentity& device, const GemmProblem& problem, int top_k,
                     const DeviceLimits& limits, bool batch_invariant, std::vector<std::string>* warnings)
    : cache_path_(cache.path) {
  const GemmKey invariant_key = gemm_key(problem, top_k, /*batch_invariant=*/true);
  const GemmKey plain_key = gemm_key(problem, top_k, /*batch_invariant=*/false);
  const bool has_invariant_entries =
      batch_invariant && std::any_of(cache.entries.begin(), cache.entries.end(), [&](const CacheEntry& e) {
        return e.device == device && e.gemm == invariant_key;
      });
  const GemmKey& key = has_invariant_entries ? invariant_key : plain_key;
  std::map<int64_t, TunedChoice> by_bucket;
  for (const CacheEntry& e : cache.entries) {
    if (!(e.device == device) || !(e.gemm == key)) continue;
    TunedChoice choice;
    choice.bucket = e.bucket;
    choice.time_us = e.time_us;
    choice.rejected = check_choice(e.config, e.split_k, problem, limits);
    if (!choice.rejected.empty()) {
      if (warnings)
        warnings->push_back("tune cache " + cache.path + ": the entry for " + key.describe() + ", bucket " +
                            std::to_string(e.bucket) + " is not used: " + choice.rejected +
                            "; the heuristic plans those token counts");
    } else {
      choice.choice = {TileConfig::parse(e.config), e.split_k};
      if (batch_invariant) choice.rejected = check_batch_invariant(choice.choice, problem.epilogue, limits);
    }
    by_bucket[e.bucket] = std::move(choice);
  }
  for (auto& [bucket, choice] : by_bucket) {
    buckets_.push_back(bucket);
    choices_.push_back(std::move(choice));
  }
}

const TunedChoice* TunedGemm::find(int64_t num_tokens) const {
  const int64_t bucket = bucket_for(num_tokens, buckets_);
  if (bucket == 0) return nullptr;
  return &choices_[static_cast<size_t>(std::lower_bound(buckets_.begin(), buckets_.end(), bucket) - buckets_.begin())];
}

}  // namespace fp4moe::tune
