// `fp4moe tune`: the autotuner (docs/design.md §4.6). For each MoE layer
// shape (--model NAME..., or the layer of a checkpoint, --weights), each of
// its two grouped GEMMs and each token bucket (--tokens; default
// tune::default_buckets()), times every candidate config x split-K the
// device can run (src/tune/tune.hpp) with bench/tune_bench.hpp, and writes
// the fastest into the tune cache (--cache; default
// tune::default_cache_path()), merged with what the file holds, after each
// shape. A table on stdout, one JSON line per (GEMM, bucket) plus a summary
// line per shape and one for the run (--json: a "tune" line is the cache
// entry, whose config, split_k and time_us are the tuned choice's, plus
// "speedup" = heuristic_us / time_us and how it was measured; both times
// come from a pass separate from the one that picked the winner, see
// bench/tune_bench.hpp), a progress
// bar with ETA on stderr. --estimate prints what a run would time and its
// estimated GPU time, and stops.
//
// Arguments and the cache path are checked before anything runs on the GPU.
// Tested in tests/tools/test_cli.cpp (arguments, no GPU) and
// tests/tools/test_cli_gpu.cpp (a small run, then `fp4moe plan` shows it).
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "cli_util.hpp"
#include "commands.hpp"
#include "fp4moe/error.hpp"
#include "fp4moe/modelopt.hpp"
#include "kernels/device_info.hpp"
#include "models.hpp"
#include "tune/tune.hpp"
#include "tune_bench.hpp"

namespace fp4moe::cli {
namespace {

struct TuneOptions {
  std::vector<std::string> models;
  std::string weights;
  std::optional<std::string> prefix;
  int top_k = 0;
  std::string activation = "swiglu";
  std::vector<int64_t> tokens = tune::default_buckets();
  int64_t smem_budget = 0;
  std::string cache;
  int iterations = 10;
  double routing_skew = 0;
  bool batch_invariant = false;
  std::string json_path;
  bool estimate = false;
};

// The shapes to tune, from --model or --weights (loading the checkpoint's
// layer checks it; its values are not used: a kernel's time does not
// depend on them).
std::vector<bench::TuneShape> tune_shapes(const TuneOptions& o, const CLI::App& cmd) {
  std::vector<bench::TuneShape> shapes;
  if (!o.weights.empty()) {
    FP4MOE_CHECK(o.models.empty(), "give --model or --weights, not both");
    FP4MOE_CHECK(cmd.count("--topk") > 0, "--weights needs --topk (the layer's experts per token)");
    const std::string prefix = o.prefix ? *o.prefix : detect_prefix(o.weights);
    const MoeWeights weights = load_moe_weights(o.weights, prefix);
    FP4MOE_CHECK(weights.num_experts > 0, o.weights, ": no experts under prefix '", prefix, "'");
    FP4MOE_CHECK(o.top_k <= weights.num_experts, "--topk ", o.top_k, " but the layer has ", weights.num_experts,
                 " experts");
    shapes.push_back({o.weights + (prefix.empty() ? "" : ":" + prefix), weights.num_experts, o.top_k, weights.hidden,
                      weights.inter, parse_activation(o.activation), weights.has_bias()});
    return shapes;
  }
  for (const char* flag : {"--prefix", "--topk", "--activation"})
    FP4MOE_CHECK(cmd.count(flag) == 0, flag, " goes with --weights");
  FP4MOE_CHECK(!o.models.empty(), "give --model NAME (", model_names(), ", or all) or --weights PATH");
  std::vector<std::string> names = o.models;
  if (names.size() == 1 && names[0] == "all") {
    names.clear();
    for (const ModelShape& m : kModelShapes) names.emplace_back(m.name);
  }
  for (const std::string& name : names) {
    const ModelShape& m = find_model(name);
    shapes.push_back({std::string(m.name), m.num_experts, m.top_k, m.hidden, m.inter, m.activation, m.has_bias});
  }
  return shapes;
}

// Refuses, before any GPU work, a cache path that cannot be written: a
// directory, an existing file without read and write permission, or a place
// whose nearest existing ancestor is not a writable directory.
void check_cache_path(const std::string& path) {
  namespace fs = std::filesystem;
  FP4MOE_CHECK(!path.empty(), "no tune cache path: FP4MOE_TUNE_CACHE is off (or HOME is unset); give --cache PATH");
  std::error_code ec;
  FP4MOE_CHECK(!fs::is_directory(path, ec), "tune cache ", path, " is a directory; expected a file name");
  if (fs::exists(path, ec)) {
    FP4MOE_CHECK(::access(path.c_str(), R_OK | W_OK) == 0, "tune cache ", path, " cannot be read and written (",
                 std::strerror(errno), ")");
    return;
  }
  fs::path ancestor = fs::absolute(fs::path(path)).parent_path();
  while (!fs::exists(ancestor, ec) && ancestor.has_parent_path() && ancestor != ancestor.parent_path())
    ancestor = ancestor.parent_path();
  FP4MOE_CHECK(fs::is_directory(ancestor, ec) && ::access(ancestor.c_str(), W_OK | X_OK) == 0, "tune cache ", path,
               ": cannot create it under ", ancestor.string(), " (not a writable directory)");
}

std::string choice_name(const tune::Candidate& c) { return c.config.to_string() + "/" + std::to_string(c.split_k); }

// One (shape, GEMM, bucket) to time.
struct Case {
  size_t shape_idx = 0;
  int gemm = 1;
  int64_t tokens = 0;
  GemmProblem problem;
  int num_candidates = 0;
  double estimate_us = 0;
};

double median(std::vector<double> values) {
  if (values.empty()) return 0.0;
  std::sort(values.begin(), values.end());
  const size_t mid = values.size() / 2;
  return values.size() % 2 ? values[mid] : 0.5 * (values[mid - 1] + values[mid]);
}

void run_tune(const TuneOptions& o, const CLI::App& cmd) {
  Timer wall;
  // Arguments first, then the cache and JSON paths, then the GPU.
  FP4MOE_CHECK(o.iterations >= 1, "--iterations must be >= 1, not ", o.iterations);
  FP4MOE_CHECK(cmd.count("--smem-budget") == 0 || o.smem_budget > 0, "--smem-budget must be > 0 bytes, not ",
               o.smem_budget);
  FP4MOE_CHECK(!o.tokens.empty(), "--tokens needs at least one token count");
  std::vector<int64_t> buckets = o.tokens;
  for (int64_t t : buckets) FP4MOE_CHECK(t >= 1, "--tokens: ", t, " is not a token count (expected >= 1)");
  std::sort(buckets.begin(), buckets.end());
  FP4MOE_CHECK(std::adjacent_find(buckets.begin(), buckets.end()) == buckets.end(),
               "--tokens lists a token count twice");
  const std::vector<bench::TuneShape> shapes = tune_shapes(o, cmd);
  for (const bench::TuneShape& s : shapes)
    FP4MOE_CHECK(buckets.back() * s.top_k < (int64_t{1} << 31), "--tokens ", buckets.back(), " x top-", s.top_k, " of ",
                 s.name, " is 2^31 rows or more; expected fewer");
  const std::string cache_path = cmd.count("--cache") > 0 ? o.cache : tune::default_cache_path();
  if (!o.estimate) check_cache_path(cache_path);
  if (!o.json_path.empty()) check_output_path(o.json_path);
  const GpuInfo gpu = probe_gpu();
  FP4MOE_CHECK(gpu.num_devices > 0, "fp4moe tune needs a CUDA GPU, and this machine has ", gpu.description);

  const tune::DeviceIdentity identity = tune::current_device_identity();
  const kernels::DeviceInfo dev = kernels::current_device();
  bench::TuneSettings settings;
  settings.iterations = o.iterations;
  settings.routing_skew = o.routing_skew;
  settings.batch_invariant = o.batch_invariant;
  settings.limits = {o.smem_budget > 0 ? std::min(o.smem_budget, dev.smem_per_block) : dev.smem_per_block,
                     kernels::compute_capability(dev)};
  const bench::L2Flusher flusher;
  const double flush_us = bench::time_median_us([&] { flusher.flush(nullptr); }, 5, flusher);

  std::vector<Case> cases;
  double total_us = 0;
  int64_t total_candidates = 0;
  for (size_t i = 0; i < shapes.size(); ++i)
    for (int gemm : {1, 2})
      for (int64_t t : buckets) {
        Case c;
        c.shape_idx = i;
        c.gemm = gemm;
        c.tokens = t;
        const bench::TuneShape& s = shapes[i];
        c.problem = moe_gemm_problem(gemm, s.num_experts, s.top_k, s.hidden, s.inter, t, o.batch_invariant);
        c.num_candidates = static_cast<int>(tune::candidates(c.problem, settings.limits, o.batch_invariant).size());
        FP4MOE_CHECK(c.num_candidates > 0, "no compiled config with the ", to_string(c.problem.epilogue),
                     " epilogue fits ", settings.limits.smem_budget_bytes, " B of shared memory per block",
                     cmd.count("--smem-budget") > 0 ? " (--smem-budget)" : "", "; fp4moe plan shows each one's needs");
        c.estimate_us = bench::estimate_bucket_us(c.problem, c.num_candidates, settings, flush_us);
        total_us += c.estimate_us;
        total_candidates += c.num_candidates;
        cases.push_back(c);
      }
  const std::string date = bench::today();
  char line[512];
  char routing_kind[32] = "uniform";
  if (o.routing_skew > 0) std::snprintf(routing_kind, sizeof routing_kind, "skewed (%g)", o.routing_skew);
  std::printf("# fp4moe tune on %s, %s; %s%s\n", identity.describe().c_str(), date.c_str(),
              o.estimate ? "estimate only" : ("cache " + cache_path).c_str(),
              o.batch_invariant ? "; batch-invariant choices (split-K 1, one family)" : "");
  std::printf(
      "# %zu shape(s) x 2 GEMMs x %zu buckets = %zu cases, %lld candidates (configs with the GEMM's "
      "epilogue that fit %lld B and run on sm%d, x split-K); %d launches per candidate, L2 flushed "
      "(%.0f us), %d %s routings rotated; estimated GPU time %.1f min\n",
      shapes.size(), buckets.size(), cases.size(), static_cast<long long>(total_candidates),
      static_cast<long long>(settings.limits.smem_budget_bytes), settings.limits.compute_capability, o.iterations,
      flush_us, settings.routings, routing_kind, total_us / 60e6);
  std::fflush(stdout);
  if (o.estimate) return;

  std::ofstream json;
  if (!o.json_path.empty()) {
    json.open(o.json_path);
    FP4MOE_CHECK(json.good(), "cannot open ", o.json_path, " for writing");
  }
  std::printf("%-24s %-5s %6s %4s  %-36s %9s  %-36s %9s %8s\n", "shape", "gemm", "tokens", "cand", "tuned", "us",
              "heuristic", "us", "speedup");
  // The bar advances by estimated GPU time, so that its ETA weighs a
  // prefill bucket's launches more than a decode bucket's.
  Progress progress("tune", std::max<int64_t>(1, static_cast<int64_t>(total_us)), true, Progress::Unit::kWork);
  double done_us = 0;
  int64_t shown_us = 0;
  const auto show = [&](const std::string& detail) {
    progress.advance(static_cast<int64_t>(done_us) - shown_us, detail);
    shown_us = static_cast<int64_t>(done_us);
  };
  std::vector<double> all_speedups;
  for (size_t shape_idx = 0; shape_idx < shapes.size(); ++shape_idx) {
    const bench::TuneShape& shape = shapes[shape_idx];
    Timer shape_wall;
    std::vector<tune::CacheEntry> entries;
    std::vector<double> speedups;
    int differ = 0;
    for (int gemm : {1, 2}) {
      bench::GemmTuneBench bench(shape, gemm, 11 + gemm);
      for (const Case& c : cases) {
        if (c.shape_idx != shape_idx || c.gemm != gemm) continue;
        const std::string detail = shape.name + " gemm" + std::to_string(gemm) + " T=" + std::to_string(c.tokens);
        const double launch_us = bench::estimate_launch_us(c.problem, flush_us);
        const double case_start_us = done_us;
        const bench::BucketResult r = bench::tune_bucket(bench, c.tokens, settings, flusher, [&](int64_t launches) {
          done_us = std::min(case_start_us + c.estimate_us, done_us + static_cast<double>(launches) * launch_us);
          show(detail);
        });
        done_us = case_start_us + c.estimate_us;
        show(detail);
        // From the separate interleaved pass, not the selection's times.
        const double speedup = r.speedup();
        speedups.push_back(speedup);
        if (!(r.tuned == r.heuristic)) ++differ;
        tune::CacheEntry e;
        e.device = identity;
        e.gemm = tune::gemm_key(r.problem, shape.top_k, o.batch_invariant);
        e.bucket = c.tokens;
        e.config = r.tuned.config.to_string();
        e.split_k = r.tuned.split_k;
        e.time_us = r.confirmed_tuned_us;
        e.heuristic_config = r.heuristic.config.to_string();
        e.heuristic_split_k = r.heuristic.split_k;
        e.heuristic_us = r.confirmed_heuristic_us;
        e.date = date;
        entries.push_back(e);
        std::snprintf(line, sizeof line, "%-24s gemm%d %6lld %4d  %-36s %9.1f  %-36s %9.1f %7.3fx\n",
                      shape.name.c_str(), gemm, static_cast<long long>(c.tokens), r.num_candidates,
                      choice_name(r.tuned).c_str(), r.confirmed_tuned_us, choice_name(r.heuristic).c_str(),
                      r.confirmed_heuristic_us, speedup);
        progress.clear();
        std::cout << line << std::flush;
        if (json.is_open()) {
          // The cache entry (device, GEMM, bucket; the tuned config, split_k
          // and time_us; the heuristic's) and how it was measured.
          nlohmann::json j = tune::to_json(e);
          j["kind"] = "tune";
          j["shape"] = shape.name;
          j["gemm"] = gemm;
          j["rows"] = r.problem.num_rows;
          j["candidates"] = r.num_candidates;
          j["heuristic_is_candidate"] = r.heuristic_is_candidate;
          j["speedup"] = speedup;
          j["confirm_rounds"] = settings.confirm_rounds;
          j["selection_time_us"] = r.tuned_us;  // biased low: the fastest of several medians
          j["selection_heuristic_us"] = r.heuristic_us;
          j["pruned"] = r.pruned;
          j["timed_launches"] = r.timed_launches;
          j["iterations"] = o.iterations;
          j["routings"] = settings.routings;
          j["routing_skew"] = settings.routing_skew;
          json << j.dump() << std::endl;
        }
      }
    }
    const tune::MergeSummary merged = tune::write_cache(cache_path, entries, identity);
    if (!merged.replaced_file_problem.empty())
      std::fprintf(stderr, "tune: note: %s; replaced by a new file\n", merged.replaced_file_problem.c_str());
    const double shape_s = shape_wall.elapsed_ms() / 1e3;
    std::snprintf(line, sizeof line,
                  "# %s: %zu cases in %.1f s, %d tuned choices differ from the heuristic's, speedup median %.3fx, "
                  "max %.3fx; cache %s: %lld added, %lld replaced, %lld stale dropped\n",
                  shape.name.c_str(), entries.size(), shape_s, differ, median(speedups),
                  *std::max_element(speedups.begin(), speedups.end()), cache_path.c_str(),
                  static_cast<long long>(merged.added), static_cast<long long>(merged.replaced),
                  static_cast<long long>(merged.dropped_stale));
    progress.clear();
    std::cout << line << std::flush;
    if (json.is_open()) {
      const nlohmann::json j{{"kind", "tune_summary"},
                             {"shape", shape.name},
                             {"cases", entries.size()},
                             {"differ_from_heuristic", differ},
                             {"median_speedup", median(speedups)},
                             {"max_speedup", *std::max_element(speedups.begin(), speedups.end())},
                             {"wall_s", shape_s},
                             {"cache", cache_path},
                             {"gpu", identity.gpu_name},
                             {"date", date}};
      json << j.dump() << std::endl;
    }
    all_speedups.insert(all_speedups.end(), speedups.begin(), speedups.end());
  }
  progress.finish();
  const double wall_s = wall.elapsed_ms() / 1e3;
  std::snprintf(line, sizeof line, "# tuned %zu cases of %zu shape(s) in %.1f s (estimate %.1f s); cache %s\n",
                cases.size(), shapes.size(), wall_s, total_us / 1e6, cache_path.c_str());
  std::cout << line << std::flush;
  if (json.is_open()) {
    const nlohmann::json j{{"kind", "tune_total"},       {"shapes", shapes.size()},
                           {"cases", cases.size()},      {"median_speedup", median(all_speedups)},
                           {"wall_s", wall_s},           {"estimate_s", total_us / 1e6},
                           {"iterations", o.iterations}, {"cache", cache_path},
                           {"gpu", identity.gpu_name},   {"date", date}};
    json << j.dump() << std::endl;
  }
}

}  // namespace

void add_tune_command(CLI::App& app) {
  auto opts = std::make_shared<TuneOptions>();
  CLI::App* cmd = app.add_subcommand(
      "tune",
      "Autotune the grouped GEMMs of MoE layers on this GPU: per GEMM and token bucket, time every compiled config "
      "x split-K that fits and runs here (L2 flushed, rotating random routings) and store the fastest in the tune "
      "cache, which MoeLayer reads (needs a GPU).");
  cmd->add_option("--model,-m", opts->models, "model shapes: " + model_names() + ", or all");
  cmd->add_option("--weights,-w", opts->weights,
                  "instead of --model: the MoE layer of this checkpoint (.safetensors file or directory); "
                  "timed on random weights of its shapes (a kernel's time does not depend on the values)")
      ->check(CLI::ExistingPath);
  cmd->add_option("--prefix", opts->prefix,
                  "--weights: tensor name prefix of the layer, e.g. 'model.layers.3.mlp.' (default: the only "
                  "layer with experts in the checkpoint)");
  cmd->add_option("--topk,-k", opts->top_k, "--weights: experts per token")->check(CLI::PositiveNumber);
  cmd->add_option("--activation", opts->activation, "--weights: swiglu or gptoss")
      ->check(CLI::IsMember({"swiglu", "gptoss"}))
      ->capture_default_str();
  cmd->add_option("--tokens,-t", opts->tokens,
                  "token buckets to time (a forward of T tokens takes the choice of the smallest tuned bucket >= T, "
                  "else the largest)")
      ->capture_default_str();
  cmd->add_option("--smem-budget", opts->smem_budget,
                  "time only configs within this many bytes of shared memory per block (default: the GPU's limit)");
  cmd->add_option("--cache", opts->cache,
                  "tune cache file (default: $FP4MOE_TUNE_CACHE, else $XDG_CACHE_HOME/fp4moe/tune-cache.json, else "
                  "~/.cache/fp4moe/tune-cache.json); merged, written atomically after each shape");
  cmd->add_option("--iterations", opts->iterations,
                  "timed launches per candidate (median; finalists get twice as many)")
      ->capture_default_str();
  cmd->add_option("--routing-skew", opts->routing_skew,
                  "time on skewed routings: expert popularity exp(S * N(0,1)), drawn per routing (0: uniform; "
                  "1: rows per expert vary about as much as under a noaux_tc router with an untrained "
                  "correction bias). Tune with the routing your server sees: the best tile depends on it")
      ->check(CLI::Range(0.0, 4.0))
      ->capture_default_str();
  cmd->add_flag("--batch-invariant", opts->batch_invariant,
                "tune the choices of batch-invariant layers: split-K 1, one kernel family");
  cmd->add_option("--json", opts->json_path, "write one JSON object per (GEMM, bucket) and summaries to this file");
  cmd->add_flag("--estimate", opts->estimate, "print the cases, candidates and estimated GPU time, then stop");
  cmd->callback([opts, cmd] { run_tune(*opts, *cmd); });
}

}  // namespace fp4moe::cli
