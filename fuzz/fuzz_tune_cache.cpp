// libFuzzer target: the tune cache file (tune::read_cache,
// src/tune/tune_cache.cpp), which every MoeLayer::prepare reads from the
// user's cache directory, and what a layer makes of its entries
// (tune::TunedGemm, src/tune/tune.cpp).
//
// The input is the whole file. Reading must never throw, whatever the file
// holds: it returns a status, and a one-line problem naming the file unless
// the file is fine (kOk) or absent. A file read as kOk then goes through
// TunedGemm for each entry's device and GEMM (which must not throw either;
// every choice it accepts is compiled, fits the device's budget and has a
// split the planner could pick), and through write_cache and a second read,
// which must give the same entries (the last of each key).
//
// Seeds: fuzz/make-seeds (<build>/fuzz/seeds/tune_cache); dictionary:
// fuzz/tune_cache.dict. Run with scripts/fuzz tune_cache.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string>
#include <string_view>
#include <vector>

#include "fp4moe/error.hpp"
#include "fp4moe/plan.hpp"
#include "fuzz_util.hpp"
#include "tune/tune.hpp"
#include "tune/tune_cache.hpp"

namespace fp4moe::fuzz {
namespace {

bool same_entry(const tune::CacheEntry& a, const tune::CacheEntry& b) {
  return a.same_key(b) && a.config == b.config && a.split_k == b.split_k && a.time_us == b.time_us &&
         a.heuristic_config == b.heuristic_config && a.heuristic_split_k == b.heuristic_split_k &&
         a.heuristic_us == b.heuristic_us && a.date == b.date;
}

void check_read(const tune::CacheFile& cache, const std::string& path) {
  const bool quiet = cache.status == tune::CacheStatus::kOk || cache.status == tune::CacheStatus::kMissing;
  FP4MOE_FUZZ_ASSERT(quiet == cache.problem.empty(), "a problem is reported exactly when the file is not usable");
  FP4MOE_FUZZ_ASSERT(cache.status == tune::CacheStatus::kOk || cache.entries.empty(),
                     "entries kept from a file that is not usable");
  FP4MOE_FUZZ_ASSERT(cache.problem.find('\n') == std::string::npos, "a problem of more than one line");
  FP4MOE_FUZZ_ASSERT(quiet || cache.problem.find(path) != std::string::npos, "a problem that does not name the file");
}

// Every entry as a layer of its device and GEMM would see it, on an H200's
// and an SM120 part's limits.
void check_choices(const tune::CacheFile& cache) {
  for (const tune::CacheEntry& e : cache.entries) {
    GemmProblem problem;
    problem.num_experts = e.gemm.num_experts;
    problem.n = e.gemm.n;
    problem.k = e.gemm.k;
    problem.num_rows = e.bucket;
    problem.epilogue = e.gemm.epilogue;
    for (const tune::DeviceLimits limits : {tune::DeviceLimits{232448, 90}, tune::DeviceLimits{101376, 120}})
      for (bool invariant : {false, true}) {
        std::vector<std::string> warnings;
        const tune::TunedGemm tuned(cache, e.device, problem, e.gemm.top_k, limits, invariant, &warnings);
        for (const tune::TunedChoice& c : tuned.choices()) {
          if (!c.rejected.empty()) continue;
          FP4MOE_FUZZ_ASSERT(is_compiled(c.choice.config), "an accepted choice is not compiled");
          FP4MOE_FUZZ_ASSERT(check_fit(c.choice.config, limits.smem_budget_bytes).fits,
                             "an accepted choice does not fit the budget");
          FP4MOE_FUZZ_ASSERT(family_runs_on(c.choice.config.family, limits.compute_capability),
                             "an accepted choice's family does not run there");
          FP4MOE_FUZZ_ASSERT(c.choice.split_k >= 1 && c.choice.split_k <= kMaxSplitK,
                             "an accepted split is out of range");
          FP4MOE_FUZZ_ASSERT(!invariant || c.choice.split_k == 1, "a batch-invariant layer accepted a split");
        }
        for (const std::string& w : warnings)
          FP4MOE_FUZZ_ASSERT(w.find('\n') == std::string::npos, "a warning of more than one line");
      }
  }
}

// Written back (merged into an empty file) and read again: the same entries.
void check_round_trip(const tune::CacheFile& cache) {
  const std::string path = (scratch_dir() / "round-trip.json").string();
  // A writer whose GPU no entry has (entries have at least one SM): nothing is dropped as stale.
  tune::write_cache(path, cache.entries, tune::DeviceIdentity{"", 0, "", ""});
  const tune::CacheFile again = tune::read_cache(path);
  FP4MOE_FUZZ_ASSERT(again.status == tune::CacheStatus::kOk, "a written cache does not read back");
  size_t unique = 0;
  for (size_t i = 0; i < cache.entries.size(); ++i) {
    const tune::CacheEntry& e = cache.entries[i];
    const bool last_of_key = std::none_of(cache.entries.begin() + static_cast<std::ptrdiff_t>(i) + 1,
                                          cache.entries.end(), [&](const tune::CacheEntry& later) {
                                            return later.same_key(e);
                                          });
    if (!last_of_key) continue;
    ++unique;
    FP4MOE_FUZZ_ASSERT(std::any_of(again.entries.begin(), again.entries.end(),
                                   [&](const tune::CacheEntry& a) { return same_entry(a, e); }),
                       "an entry changed in a round trip");
  }
  FP4MOE_FUZZ_ASSERT(again.entries.size() == unique, "the round trip changed the number of entries");
}

void run(const uint8_t* data, size_t size) {
  clear_scratch_dir();
  const std::string path = (scratch_dir() / "tune-cache.json").string();
  write_file(path, std::string_view(reinterpret_cast<const char*>(data), size));
  tune::CacheFile cache;
  try {
    cache = tune::read_cache(path);
    check_read(cache, path);
    check_choices(cache);
  } catch (const Error& e) {
    std::fprintf(stderr, "reading or using a tune cache threw: %s\n", e.what());
    std::abort();
  }
  if (cache.status != tune::CacheStatus::kOk) return;
  try {
    check_round_trip(cache);
  } catch (const Error& e) {
    std::fprintf(stderr, "an accepted cache failed its round trip: %s\n", e.what());
    std::abort();
  }
}

}  // namespace
}  // namespace fp4moe::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  return fp4moe::fuzz::run_guarded(fp4moe::fuzz::run, data, size);
}
