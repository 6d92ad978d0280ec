// GPU tests of the autotuner (label "gpu"; skipped, visibly, without a
// device):
//   - every candidate the tuner may launch (tune::candidates on this GPU,
//     batch-invariant ones included: they are a subset) on reduced model
//     shapes, both GEMMs with their fused epilogues, at token counts with
//     about one routed row per expert, a few, and past the SM90 family's
//     boundary, launched through bench::GemmTuneBench exactly as `fp4moe
//     tune` launches it (GEMM1's tensor-map tiles after the separate gather
//     pass, as the layer runs them), on a poisoned output, checked against a
//     CPU reference in double with the GPU tests' tolerance;
//   - tune_bucket itself on one bucket: its winner is a candidate, no slower
//     than the heuristic's choice in the same measurement;
//   - MoeLayer with a tune cache: plan() reports the cached choice and where
//     it came from, the bucket rule, the forward matches the CPU reference
//     with the tuned config and split; forced configs win; a batch-invariant
//     layer refuses a split; a cache that is disabled, missing, corrupt,
//     stale or holds an invalid entry gives the heuristic, each problem
//     reported once per process.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <numeric>
#include <optional>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "fp4moe/moe_layer.hpp"
#include "fp4moe/reference.hpp"
#include "gpu_test_util.hpp"
#include "kernels/device_info.hpp"
#include "kernels/grouped_gemm.hpp"
#include "plan/planner.hpp"
#include "temp_dir.hpp"
#include "tune/tune.hpp"
#include "tune/tune_cache.hpp"
#include "tune_bench.hpp"
#include "util/parallel.hpp"

namespace fp4moe {
namespace {

tune::DeviceLimits local_limits() {
  const kernels::DeviceInfo dev = kernels::current_device();
  return {dev.smem_per_block, kernels::compute_capability(dev)};
}

// ---------------------------------------------------- every candidate launched

// The output `bench` should have computed from `h`: GEMM 1 act(gate + b,
// up + b) per (row, feature) with gate and up rows interleaved in groups of
// 16 (8 gate rows, then the 8 up rows of the same features), reading x
// through token_of_row; GEMM 2 (row + bias) x router weight at its pair's
// row. In double, from the prepared weights as the kernel reads them.
std::vector<double> reference(const bench::TuneShape& shape, int gemm, const bench::GemmTuneBench::HostCopy& h) {
  const PreparedGemmWeights& w = h.weights;
  const int64_t rows = static_cast<int64_t>(h.token_of_row.size());
  const int64_t out_cols = gemm == 1 ? w.n / 2 : w.n;
  // Dequantised weights (exact in float) of every expert that has rows: [E][n][k].
  std::vector<std::vector<float>> dense(static_cast<size_t>(w.num_experts));
  parallel_for(w.num_experts, [&](int64_t e) {
    if (h.offsets[static_cast<size_t>(e + 1)] == h.offsets[static_cast<size_t>(e)]) return;
    std::vector<float>& m = dense[static_cast<size_t>(e)];
    m.resize(static_cast<size_t>(w.n * w.k));
    for (int64_t r = 0; r < w.n; ++r)
      for (int64_t c = 0; c < w.k; ++c) m[static_cast<size_t>(r * w.k + c)] = w.value(e, r, c);
  });
  std::vector<double> out(static_cast<size_t>(rows * out_cols), 0.0);
  parallel_for(shape.num_experts, [&](int64_t e) {
    const std::vector<float>& m = dense[static_cast<size_t>(e)];
    const auto bias = [&](int64_t col) { return h.bias.empty() ? 0.0 : h.bias[static_cast<size_t>(e * w.n + col)]; };
    for (int32_t r = h.offsets[static_cast<size_t>(e)]; r < h.offsets[static_cast<size_t>(e + 1)]; ++r) {
      const int64_t x_row = gemm == 1 ? h.token_of_row[static_cast<size_t>(r)] : r;
      const uint16_t* x = h.x.data() + x_row * w.k;
      const auto dot = [&](int64_t weight_row) {
        const float* wr = m.data() + weight_row * w.k;
        double sum = 0.0;
        for (int64_t c = 0; c < w.k; ++c) sum += static_cast<double>(bf16_to_float(x[c])) * wr[c];
        return sum;
      };
      if (gemm == 1) {
        for (int64_t f = 0; f < out_cols; ++f) {
          const int64_t gate_row = 16 * (f / 8) + f % 8;
          out[static_cast<size_t>(r * out_cols + f)] =
              activate(shape.activation, dot(gate_row) + bias(f), dot(gate_row + 8) + bias(out_cols + f));
        }
      } else {
        const int32_t pair = h.pair_of_row[static_cast<size_t>(r)];
        for (int64_t col = 0; col < out_cols; ++col)
          out[static_cast<size_t>(pair * out_cols + col)] =
              (dot(col) + bias(col)) * static_cast<double>(h.row_weights[static_cast<size_t>(pair)]);
      }
    }
  });
  return out;
}

// Reduced model shapes: GLM-like with K >= 1024 for GEMM1 (the SM90 family's
// long-K boundary) and N = 2 * 336 off the 128-row tile grid; gpt-oss-like
// with its activation and biases, K = 576 off the 256 padding.
const std::vector<bench::TuneShape>& reduced_shapes() {
  static const std::vector<bench::TuneShape> shapes = {
      {"glm-like", 64, 8, 1024, 336, Activation::kSwiGLU, false},
      {"gpt-oss-like", 32, 4, 576, 576, Activation::kGptOss, true},
  };
  return shapes;
}

TEST(TuneCandidatesGpu, EveryCandidateLaunchesAndMatchesTheReference) {
  FP4MOE_REQUIRE_GPU();
  const tune::DeviceLimits limits = local_limits();
  int launched = 0, split_launches = 0;
  bool saw_family[2] = {false, false};
  for (const bench::TuneShape& shape : reduced_shapes()) {
    for (int gemm : {1, 2}) {
      bench::GemmTuneBench bench(shape, gemm, 7);
      // ~1 row per expert, a few, and past the SM90 boundary (> 16 rows per active expert).
      for (int64_t tokens : {shape.num_experts / shape.top_k, int64_t{24}, 5 * shape.num_experts}) {
        bench.set_tokens(tokens, 1);
        const GemmProblem problem = bench.problem(false);
        const std::vector<tune::Candidate> candidates = tune::candidates(problem, limits, false);
        ASSERT_FALSE(candidates.empty());
        // The batch-invariant candidates are among these.
        for (const tune::Candidate& c : tune::candidates(bench.problem(true), limits, true))
          EXPECT_NE(std::find(candidates.begin(), candidates.end(), c), candidates.end()) << c.to_string();
        const std::vector<double> ref = reference(shape, gemm, bench.host_copy(0));
        const int64_t cols = gemm == 1 ? shape.inter : shape.hidden;
        for (const tune::Candidate& c : candidates) {
          const std::string what =
              shape.name + " gemm" + std::to_string(gemm) + " T=" + std::to_string(tokens) + " " + c.to_string();
          SCOPED_TRACE(what);
          const GemmPlan plan = plan_grouped_gemm(problem, c.config, c.split_k);
          ASSERT_EQ(plan.split_k, c.split_k);
          bench.poison_output();
          bench.launch(plan, 0);
          FP4MOE_CUDA_CHECK(cudaDeviceSynchronize());
          ASSERT_EQ(bench.device_errors(), "");
          const testing::Comparison cmp = testing::compare(bench.output(), ref, cols);
          EXPECT_EQ(cmp.num_unwritten, 0) << cmp.first_bad;
          EXPECT_EQ(cmp.num_bad, 0) << cmp.first_bad;
          EXPECT_LT(cmp.rel_err, 1e-2);
          ++launched;
          split_launches += c.split_k > 1;
          saw_family[c.config.family == KernelFamily::kSm90] = true;
        }
        std::printf("  %-14s gemm%d T=%-4lld %3zu candidates launched and checked\n", shape.name.c_str(), gemm,
                    static_cast<long long>(tokens), candidates.size());
      }
    }
  }
  EXPECT_GT(split_launches, 0) << "decode-sized problems must have split-K candidates";
  EXPECT_TRUE(saw_family[0]);
  if (family_runs_on(KernelFamily::kSm90, limits.compute_capability)) EXPECT_TRUE(saw_family[1]);
  std::printf("  %d launches, %d with split-K\n", launched, split_launches);
}

TEST(TuneCandidatesGpu, TuneBucketPicksACandidateNoSlowerThanTheHeuristic) {
  FP4MOE_REQUIRE_GPU();
  const bench::TuneShape& shape = reduced_shapes()[0];
  bench::GemmTuneBench bench(shape, 2, 3);
  bench::TuneSettings settings;
  settings.iterations = 3;
  settings.limits = local_limits();
  const bench::L2Flusher flusher(size_t{64} << 20);
  int64_t progress_launches = 0;
  const bench::BucketResult r =
      bench::tune_bucket(bench, 16, settings, flusher, [&](int64_t launches) { progress_launches += launches; });
  const std::vector<tune::Candidate> candidates = tune::candidates(r.problem, settings.limits, false);
  EXPECT_EQ(r.num_candidates, static_cast<int>(candidates.size()));
  EXPECT_NE(std::find(candidates.begin(), candidates.end(), r.tuned), candidates.end()) << r.tuned.to_string();
  EXPECT_TRUE(r.heuristic_is_candidate);
  EXPECT_GT(r.tuned_us, 0.0);
  EXPECT_LE(r.tuned_us, r.heuristic_us);  // the selection step kept the faster of its own times
  // The separate interleaved pass: the choice is not slower than the
  // heuristic's on times the selection never saw (beyond noise: a few us
  // launches on a shared GPU move by several percent).
  EXPECT_GT(r.confirmed_tuned_us, 0.0);
  EXPECT_LE(r.confirmed_tuned_us, r.confirmed_heuristic_us * 1.10)
      << "tuned " << r.tuned.to_string() << " is slower than the heuristic's " << r.heuristic.to_string();
  EXPECT_EQ(progress_launches, r.timed_launches);
  // Every candidate launched at least twice (warm-up and one timed launch);
  // the unpruned ones iterations + 1 times, the finalists 2 iterations + 1 more.
  const int64_t unpruned = static_cast<int64_t>(candidates.size()) - r.pruned;
  EXPECT_GE(r.timed_launches, unpruned * (settings.iterations + 1) + 2 * r.pruned +
                                  int64_t{settings.finalists} * (2 * settings.iterations + 1) +
                                  2 * int64_t{settings.confirm_rounds} * (settings.iterations + 1));
  EXPECT_LT(r.pruned, r.num_candidates);
  std::printf("  tuned %s %.1f us, heuristic %s %.1f us (selection: %.1f / %.1f us), %d of %d candidates pruned\n",
              r.tuned.to_string().c_str(), r.confirmed_tuned_us, r.heuristic.to_string().c_str(),
              r.confirmed_heuristic_us, r.tuned_us, r.heuristic_us, r.pruned, r.num_candidates);
}

// ------------------------------------------------------- MoeLayer and the cache

constexpr int64_t kExperts = 32, kHidden = 512, kInter = 256;
constexpr int kTopK = 4;
constexpr int64_t kBucket = 16;

MoeWeights small_weights() {
  std::mt19937 rng(77);
  return testing::random_moe_weights(kExperts, kHidden, kInter, 0.1f / std::sqrt(static_cast<float>(kHidden)),
                                     0.1f / std::sqrt(static_cast<float>(kInter)), rng);
}

MoeLayerOptions small_options(const std::string& cache_path) {
  MoeLayerOptions o;
  o.routing.mode = RoutingMode::kSoftmaxTopK;
  o.routing.top_k = kTopK;
  o.tune_cache_path = cache_path;
  return o;
}

// A candidate other than the heuristic's choice for `gemm` at kBucket tokens:
// one with split-K where there is one (the workspace must hold its partials).
tune::Candidate other_than_heuristic(int gemm) {
  const GemmProblem problem = moe_gemm_problem(gemm, kExperts, kTopK, kHidden, kInter, kBucket);
  const GemmPlan heuristic = limit_split_k(plan_grouped_gemm(problem), false);
  const tune::Candidate h{heuristic.config, heuristic.split_k};
  const std::vector<tune::Candidate> all = tune::candidates(problem, local_limits(), false);
  std::optional<tune::Candidate> pick;
  for (const tune::Candidate& c : all)
    if (!(c == h) && (!pick || c.split_k > pick->split_k)) pick = c;
  EXPECT_TRUE(pick.has_value()) << "only the heuristic's choice is a candidate";
  return pick.value_or(h);
}

tune::CacheEntry cache_entry(int gemm, int64_t bucket, const tune::Candidate& c, const tune::DeviceIdentity& device,
                             const std::string& config_name = "") {
  tune::CacheEntry e;
  e.device = device;
  e.gemm = tune::gemm_key(moe_gemm_problem(gemm, kExperts, kTopK, kHidden, kInter, bucket), kTopK, false);
  e.bucket = bucket;
  e.config = config_name.empty() ? c.config.to_string() : config_name;
  e.split_k = c.split_k;
  return e;
}

// One layer forward of `tokens` random tokens with random caller routing,
// checked against moe_reference (bf16 intermediate, as the GPU stores it).
void expect_forward_matches_reference(const MoeLayer& layer, const MoeWeights& weights, int64_t tokens) {
  std::mt19937 rng(static_cast<uint32_t>(tokens));
  const std::vector<uint16_t> hidden = testing::random_bf16(static_cast<size_t>(tokens * kHidden), rng);
  Routing routing;
  routing.num_tokens = tokens;
  routing.top_k = kTopK;
  std::vector<int32_t> experts(kExperts);
  std::uniform_real_distribution<float> weight(0.1f, 1.0f);
  for (int64_t t = 0; t < tokens; ++t) {
    std::iota(experts.begin(), experts.end(), 0);
    std::shuffle(experts.begin(), experts.end(), rng);
    for (int j = 0; j < kTopK; ++j) {
      routing.topk_ids.push_back(experts[static_cast<size_t>(j)]);
      routing.topk_weights.push_back(weight(rng));
    }
  }
  std::vector<float> x(hidden.size());
  for (size_t i = 0; i < x.size(); ++i) x[i] = bf16_to_float(hidden[i]);
  std::vector<float> ref(static_cast<size_t>(tokens * kHidden));
  moe_reference(weights, x.data(), routing, Activation::kSwiGLU, ref.data(), 0, Intermediate::kBf16,
                ActivationNumerics::kCheckpoint, Combine::kBf16Rows);  // the deterministic layer

  const DeviceBuffer<uint16_t> d_hidden(hidden);
  const DeviceBuffer<int32_t> d_ids(routing.topk_ids);
  const DeviceBuffer<float> d_weights(routing.topk_weights);
  DeviceBuffer<uint16_t> out(static_cast<size_t>(tokens * kHidden));
  out.fill_bytes(0xFF);
  DeviceBuffer<uint8_t> workspace(layer.workspace_bytes(tokens));
  workspace.fill_bytes(0);
  MoeForwardArgs args;
  args.hidden_states = d_hidden.get();
  args.num_tokens = tokens;
  args.topk_ids = d_ids.get();
  args.topk_weights = d_weights.get();
  layer.forward(args, out.get(), workspace.get(), workspace.bytes(), nullptr);
  std::vector<float> got;
  for (uint16_t v : out.download()) got.push_back(bf16_to_float(v));
  EXPECT_EQ(layer.device_errors(workspace.get(), nullptr), "");
  const testing::Comparison cmp = testing::compare(got, std::vector<double>(ref.begin(), ref.end()), kHidden);
  EXPECT_EQ(cmp.num_unwritten, 0) << cmp.first_bad;
  EXPECT_EQ(cmp.num_bad, 0) << cmp.first_bad;
  EXPECT_LT(cmp.rel_err, 1e-2);
}

TEST(MoeLayerTuneCache, UsesTheTunedChoiceAndMatchesTheReference) {
  FP4MOE_REQUIRE_GPU();
  const TempDir dir;
  const std::string path = dir / "tune-cache.json";
  const tune::DeviceIdentity device = tune::current_device_identity();
  const tune::Candidate choice1 = other_than_heuristic(1), choice2 = other_than_heuristic(2);
  tune::write_cache(path, {cache_entry(1, kBucket, choice1, device), cache_entry(2, kBucket, choice2, device)}, device);
  const MoeWeights weights = small_weights();

  ::testing::internal::CaptureStderr();
  const MoeLayer layer = MoeLayer::prepare(weights, small_options(path));
  EXPECT_EQ(::testing::internal::GetCapturedStderr(), "") << "a valid cache is read silently";
  // kBucket is the only bucket: it plans fewer tokens (the smallest bucket >= T)
  // and more (the largest).
  for (int64_t tokens : {kBucket, int64_t{5}, int64_t{1}, int64_t{100}}) {
    SCOPED_TRACE("T=" + std::to_string(tokens));
    const MoeLayerPlan plan = layer.plan(tokens);
    EXPECT_EQ(plan.gemm1.config, choice1.config);
    EXPECT_EQ(plan.gemm1.split_k, choice1.split_k);
    EXPECT_EQ(plan.gemm2.config, choice2.config);
    EXPECT_EQ(plan.gemm2.split_k, choice2.split_k);
    for (const PlanOrigin* origin : {&plan.gemm1_origin, &plan.gemm2_origin}) {
      EXPECT_EQ(origin->kind, PlanOrigin::Kind::kTuned);
      EXPECT_EQ(origin->bucket, kBucket);
      EXPECT_EQ(origin->cache_path, path);
    }
    EXPECT_NE(plan.describe().find("tuned (bucket 16 of " + path + ")"), std::string::npos) << plan.describe();
    expect_forward_matches_reference(layer, weights, tokens);
  }
  std::printf("  tuned GEMM1 %s, GEMM2 %s\n", choice1.to_string().c_str(), choice2.to_string().c_str());

  // The heuristic, where the cache is not to be used.
  MoeLayerOptions off = small_options(path);
  off.use_tune_cache = false;
  const MoeLayerPlan heuristic = MoeLayer::prepare(weights, off).plan(kBucket);
  EXPECT_EQ(heuristic.gemm1_origin.kind, PlanOrigin::Kind::kHeuristic);
  EXPECT_EQ(heuristic.gemm1_origin.describe(), "heuristic");
  EXPECT_FALSE(heuristic.gemm1.config == choice1.config && heuristic.gemm1.split_k == choice1.split_k);

  // A forced config wins over the cache, for its GEMM only.
  MoeLayerOptions forced = small_options(path);
  forced.gemm1_config = heuristic.gemm1.config;
  const MoeLayerPlan forced_plan = MoeLayer::prepare(weights, forced).plan(kBucket);
  EXPECT_EQ(forced_plan.gemm1_origin.kind, PlanOrigin::Kind::kForced);
  EXPECT_EQ(forced_plan.gemm1.config, heuristic.gemm1.config);
  EXPECT_EQ(forced_plan.gemm2_origin.kind, PlanOrigin::Kind::kTuned);

  // A batch-invariant layer never takes a split (or the other family).
  MoeLayerOptions invariant = small_options(path);
  invariant.batch_invariant = true;
  const MoeLayer invariant_layer = MoeLayer::prepare(weights, invariant);
  const MoeLayerPlan invariant_plan = invariant_layer.plan(kBucket);
  for (const auto& [gemm_plan, origin, choice] :
       {std::tuple{&invariant_plan.gemm1, &invariant_plan.gemm1_origin, choice1},
        std::tuple{&invariant_plan.gemm2, &invariant_plan.gemm2_origin, choice2}}) {
    EXPECT_EQ(gemm_plan->split_k, 1);
    const bool usable = tune::check_batch_invariant(choice, gemm_plan->config.epilogue, local_limits()).empty();
    EXPECT_EQ(origin->kind, usable ? PlanOrigin::Kind::kTuned : PlanOrigin::Kind::kHeuristic);
    if (!usable) EXPECT_NE(origin->note().find("is not used"), std::string::npos) << origin->note();
  }
  expect_forward_matches_reference(invariant_layer, weights, kBucket);
}

TEST(MoeLayerTuneCache, InvalidOrStaleEntriesGiveTheHeuristicReportedOnce) {
  FP4MOE_REQUIRE_GPU();
  const TempDir dir;
  const std::string path = dir / "tune-cache.json";
  const tune::DeviceIdentity device = tune::current_device_identity();
  tune::DeviceIdentity old_library = device;
  old_library.library_version = "0.0.0-old";
  const tune::Candidate any = other_than_heuristic(2);
  // GEMM1: a config that is not compiled; GEMM2: only an entry of another library version.
  tune::write_cache(
      path, {cache_entry(1, kBucket, any, device, "n128m16k256s4w4-swiglu"), cache_entry(2, kBucket, any, old_library)},
      tune::DeviceIdentity{"another GPU", 1, "1", "1"});
  const MoeWeights weights = small_weights();
  ::testing::internal::CaptureStderr();
  const MoeLayer first = MoeLayer::prepare(weights, small_options(path));
  const MoeLayer second = MoeLayer::prepare(weights, small_options(path));
  const std::string err = ::testing::internal::GetCapturedStderr();
  std::printf("%s", err.c_str());
  const auto count = [&](const std::string& phrase) {
    size_t n = 0;
    for (size_t at = err.find(phrase); at != std::string::npos; at = err.find(phrase, at + 1)) ++n;
    return n;
  };
  EXPECT_EQ(count("is not compiled into this build"), 1u) << err;
  EXPECT_EQ(count("1 of 2 entries were tuned on another GPU, driver or library version"), 1u) << err;
  EXPECT_EQ(std::count(err.begin(), err.end(), '\n'), 2) << "one line each:\n" << err;
  const MoeLayerPlan plan = second.plan(kBucket);
  EXPECT_EQ(plan.gemm1_origin.kind, PlanOrigin::Kind::kHeuristic);
  EXPECT_NE(plan.gemm1_origin.note().find("not compiled"), std::string::npos) << plan.gemm1_origin.note();
  EXPECT_EQ(plan.gemm2_origin.kind, PlanOrigin::Kind::kHeuristic);
  EXPECT_EQ(plan.gemm2_origin.note(), "") << "a stale entry is not this device's";
  expect_forward_matches_reference(second, weights, kBucket);
}

TEST(MoeLayerTuneCache, CorruptOrMissingCacheGivesTheHeuristic) {
  FP4MOE_REQUIRE_GPU();
  const TempDir dir;
  const MoeWeights weights = small_weights();
  const std::string corrupt = dir / "corrupt.json";
  {
    std::ofstream out(corrupt);
    out << R"({"format": "fp4moe tune cache", "version": 1, "entries": [{"gpu": )";
  }
  ::testing::internal::CaptureStderr();
  const MoeLayer a = MoeLayer::prepare(weights, small_options(corrupt));
  const MoeLayer b = MoeLayer::prepare(weights, small_options(corrupt));
  const std::string err = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(err,
            "fp4moe: tune cache " + corrupt + " is corrupt (not valid JSON); ignored (fp4moe tune writes a new one)\n");
  EXPECT_EQ(a.plan(kBucket).gemm1_origin.kind, PlanOrigin::Kind::kHeuristic);

  ::testing::internal::CaptureStderr();
  const MoeLayer missing = MoeLayer::prepare(weights, small_options(dir / "absent.json"));
  EXPECT_EQ(::testing::internal::GetCapturedStderr(), "") << "a missing cache is silent";
  EXPECT_EQ(missing.plan(kBucket).gemm2_origin.kind, PlanOrigin::Kind::kHeuristic);
  expect_forward_matches_reference(missing, weights, kBucket);
}

}  // namespace
}  // namespace fp4moe
