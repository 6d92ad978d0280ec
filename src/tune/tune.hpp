// The autotuner's rules (docs/design.md §4.6), host-only: the token buckets
// it times, the candidates it may launch for a GEMM on a device, and the
// tuned choices a layer takes from the cache (src/tune/tune_cache.hpp), each
// checked before use.
//
//   buckets     default_buckets(); a forward of T tokens takes the choice of
//               bucket_for(T): the smallest tuned bucket >= T, else the largest.
//   candidates  every compiled config with the GEMM's epilogue whose family
//               runs on the device and that check_fit admits under the budget
//               (never one that could fail to launch), x split-K 1 and every
//               split the planner could pick (split_k_allowed) while the plan
//               has at most kMaxSplitKTiles tiles; a batch-invariant layer's:
//               split-K 1 in the one family it keeps to.
//   choices     TunedGemm: a cache entry is used only for its device identity
//               and GEMM, and only when its config is compiled with that
//               epilogue, its family runs here, it fits the device's shared
//               memory and its split is one the planner could pick; an entry
//               that is not is reported and the heuristic plans its bucket.
//
// Internal. Tested in tests/tune/test_tune_cache.cpp (CPU) and, on a GPU,
// tests/tune/test_tune_gpu.cpp (every candidate launched and checked).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "fp4moe/plan.hpp"
#include "tune/tune_cache.hpp"

namespace fp4moe::tune {

// The token counts `fp4moe tune` times by default: the powers of two up to
// 256 (decode batches), then steps of 1.5x and 1.33x up to 16384 (the sizes
// serving batches and prefill chunks grow by): 384, 512, 768, 1024, 1536,
// 2048, 3072, 4096, 6144, 8192, 12288, 16384.
const std::vector<int64_t>& default_buckets();

// The bucket whose tuned choice plans a forward of num_tokens tokens: the
// smallest of `buckets` (ascending) that is >= num_tokens, else the largest;
// 0 when there are none.
int64_t bucket_for(int64_t num_tokens, const std::vector<int64_t>& buckets);

// One (config, split) the autotuner times.
struct Candidate {
  TileConfig config;
  int split_k = 1;

  bool operator==(const Candidate&) const = default;
  std::string to_string() const;  // "sm90n128m16k128s7w12-swiglu split_k 2"
};

// What limits the candidates on one device.
struct DeviceLimits {
  int64_t smem_budget_bytes = 0;  // per block
  int compute_capability = 0;     // e.g. 90
};

// The kernel family a batch-invariant layer keeps to at every token count
// (plan_gemm with single_family): the SM90 family where it runs and one of
// its configs with `epilogue` fits, else the portable one.
KernelFamily invariant_family(Epilogue epilogue, const DeviceLimits& limits);

// Every candidate for `problem` on a device with `limits`, in the order of
// compiled_configs(), each config's splits ascending (see the file comment).
// The heuristic's own choice, limit_split_k(plan_gemm(...)), is among them.
std::vector<Candidate> candidates(const GemmProblem& problem, const DeviceLimits& limits, bool batch_invariant);

// Why a cached (config name, split) may not plan `problem`'s GEMM on a device
// with `limits`, as a phrase; empty when it may.
std::string check_choice(const std::string& config, int split_k, const GemmProblem& problem,
                         const DeviceLimits& limits);

// Why a valid choice would make a batch-invariant layer's bits depend on its
// batch (a split, or the other kernel family), as a phrase; empty when it
// would not.
std::string check_batch_invariant(const Candidate& choice, Epilogue epilogue, const DeviceLimits& limits);

// One cache entry as a layer sees it.
struct TunedChoice {
  int64_t bucket = 0;
  Candidate choice;      // meaningful when `rejected` is empty
  std::string rejected;  // why the heuristic plans this bucket instead; empty when the choice is used
  double time_us = 0;    // what the tuner measured
};

// The tuned choices of one GEMM of a layer: the cache's entries for this
// device identity and GEMM, one per bucket (the last entry of a bucket wins),
// each checked once, here.
class TunedGemm {
 public:
  TunedGemm() = default;  // nothing tuned: the heuristic plans everything

  // `problem` gives the GEMM's n, k, experts and epilogue (its rows do not
  // matter). A batch-invariant layer takes the entries tuned for batch
  // invariance where the cache has any for this GEMM, else the others; of
  // those it uses only the choices check_batch_invariant passes (the rest
  // are not faulty, just not for it). `warnings` receives one line per entry
  // that check_choice refuses.
  TunedGemm(const CacheFile& cache, const DeviceIdentity& device, const GemmProblem& problem, int top_k,
            const DeviceLimits& limits, bool batch_invariant, std::vector<std::string>* warnings);

  // The entry that plans num_tokens tokens (bucket_for), or null when this
  // GEMM has none.
  const TunedChoice* find(int64_t num_tokens) const;
  const std::vector<TunedChoice>& choices() const { return choices_; }  // by ascending bucket
  const std::string& cache_path() const { return cache_path_; }

 private:
  std::string cache_path_;
  std::vector<TunedChoice> choices_;
  std::vector<int64_t> buckets_;
};

}  // namespace fp4moe::tune
