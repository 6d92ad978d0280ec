// See tune_bench.hpp. Host code: the device work is the grouped GEMM, the
// layer's sort kernel, and the fills and L2 flush of gemm_bench.cu.
#include "tune_bench.hpp"

#include <algorithm>
#include <cmath>
#include <random>

#include "fp4moe/cuda_check.hpp"
#include "fp4moe/error.hpp"
#include "fp4moe/nvfp4.hpp"
#include "kernels/ops/moe_ops.hpp"
#include "layer/moe_layer_internals.hpp"
#include "plan/planner.hpp"

namespace fp4moe::bench {

// ------------------------------------------------------------------ bench

struct GemmTuneBench::State {
  TuneShape shape;
  int gemm = 1;
  int64_t n = 0, k = 0;
  uint64_t seed = 0;
  RandomGemmWeights weights;
  DeviceBuffer<float> bias;  // [E][n], empty without biases
  int64_t num_tokens = 0;
  // Per routing: offsets [E + 1], token_of_row and pair_of_row [rows], from
  // the layer's sort kernel.
  struct Routing {
    DeviceBuffer<int32_t> offsets, token_of_row, pair_of_row;
  };
  std::vector<Routing> routings;
  DeviceBuffer<uint16_t> x;              // bf16: GEMM 1 [T, hidden], GEMM 2 [rows, inter]
  DeviceBuffer<uint16_t> x_sorted;       // GEMM 1 with the separate gather: bf16 [rows, hidden], grown
  DeviceBuffer<float> row_weights;       // [rows]
  DeviceBuffer<uint16_t> y;              // GEMM 1: bf16 [rows, inter]
  DeviceBuffer<uint16_t> out_bf16;       // GEMM 2: bf16 [rows, hidden]
  DeviceBuffer<int32_t> error_flags;     // [4]: the GEMM's error word
  DeviceBuffer<int32_t> split_counters;  // [kMaxSplitKTiles], zero between launches
  DeviceBuffer<uint8_t> workspace;       // split-K partials, grown to the largest plan

  int64_t rows() const { return num_tokens * shape.top_k; }

  GroupedGemmArgs args(int routing_idx) const {
    const Routing& r = routings.at(static_cast<size_t>(routing_idx));
    GroupedGemmArgs a;
    a.weights = weights.weights.get();
    a.scales = weights.scales.get();
    a.global_scales = weights.global_scales.get();
    a.num_experts = shape.num_experts;
    a.n = n;
    a.k = k;
    a.x = x.get();
    a.expert_offsets = r.offsets.get();
    a.num_rows = rows();
    a.bias = bias.get();
    if (gemm == 1) {
      a.gather_rows = r.token_of_row.get();
      a.x_rows = num_tokens;
      a.y = y.get();
      a.activation = shape.activation;
    } else {
      a.scatter_rows = r.pair_of_row.get();
      a.row_weights = row_weights.get();
      a.out_bf16 = out_bf16.get();
      a.out_rows = rows();
    }
    a.workspace = workspace.get();
    a.workspace_bytes = workspace.bytes();
    a.error_flags = error_flags.get();
    a.split_counters = split_counters.get();
    a.split_counters_capacity = kMaxSplitKTiles;
    return a;
  }
};

GemmTuneBench::GemmTuneBench(const TuneShape& shape, int gemm, uint64_t seed) : state_(std::make_unique<State>()) {
  FP4MOE_CHECK(gemm == 1 || gemm == 2, "GemmTuneBench: gemm = ", gemm, "; expected 1 or 2");
  State& s = *state_;
  s.shape = shape;
  s.gemm = gemm;
  s.seed = seed;
  s.n = gemm == 1 ? 2 * shape.inter : shape.hidden;
  s.k = gemm == 1 ? shape.hidden : shape.inter;
  s.weights = random_gemm_weights(shape.num_experts, s.n, s.k, seed);
  if (shape.has_bias) {
    s.bias = DeviceBuffer<float>(static_cast<size_t>(shape.num_experts * s.n));
    std::mt19937_64 rng(seed + 5);
    std::uniform_real_distribution<float> value(-0.1f, 0.1f);
    std::vector<float> host(s.bias.size());
    for (float& b : host) b = value(rng);
    s.bias.upload(host);
  }
  s.error_flags = DeviceBuffer<int32_t>(4);
  s.error_flags.fill_bytes(0);
  s.split_counters = DeviceBuffer<int32_t>(static_cast<size_t>(kMaxSplitKTiles));
  s.split_counters.fill_bytes(0);
  s.workspace = DeviceBuffer<uint8_t>(16);
  s.workspace.fill_bytes(0);
}

GemmTuneBench::~GemmTuneBench() = default;

void GemmTuneBench::set_tokens(int64_t num_tokens, int num_routings, double routing_skew) {
  State& s = *state_;
  FP4MOE_CHECK(num_tokens >= 1 && num_routings >= 1, "GemmTuneBench::set_tokens: ", num_tokens, " tokens, ",
               num_routings, " routings; expected >= 1 of each");
  FP4MOE_CHECK(num_tokens * s.shape.top_k < (int64_t{1} << 31), "GemmTuneBench::set_tokens: ", num_tokens,
               " tokens x top-", s.shape.top_k, " rows; expected < 2^31");
  s.num_tokens = num_tokens;
  const size_t rows = static_cast<size_t>(s.rows());
  std::mt19937_64 rng(s.seed * 0x9E3779B97F4A7C15ull + static_cast<uint64_t>(num_tokens));
  DeviceBuffer<int32_t> ids(rows);
  DeviceBuffer<int32_t> sort_errors(1);
  DeviceBuffer<int32_t> sort_scratch(
      static_cast<size_t>(kernels::sort_scratch_ints(static_cast<int64_t>(rows), s.shape.num_experts)));
  sort_errors.fill_bytes(0);
  s.routings.clear();
  for (int i = 0; i < num_routings; ++i) {
    ids.upload(skewed_topk_ids(s.shape.num_experts, s.shape.top_k, num_tokens, routing_skew, rng));
    State::Routing r{DeviceBuffer<int32_t>(static_cast<size_t>(s.shape.num_experts + 1)), DeviceBuffer<int32_t>(rows),
                     DeviceBuffer<int32_t>(rows)};
    kernels::launch_sort_by_expert(ids.get(), num_tokens, s.shape.top_k, s.shape.num_experts, r.offsets.get(),
                                   r.token_of_row.get(), r.pair_of_row.get(), sort_errors.get(), sort_scratch.get(),
                                   nullptr);
    s.routings.push_back(std::move(r));
  }
  FP4MOE_CHECK(sort_errors.download()[0] == 0, "GemmTuneBench: the sort kernel reported expert ids out of range");
  const size_t x_rows = s.gemm == 1 ? static_cast<size_t>(num_tokens) : rows;
  s.x = DeviceBuffer<uint16_t>(x_rows * static_cast<size_t>(s.k));
  fill_random_bf16(s.x.get(), s.x.size(), s.seed + 17 + static_cast<uint64_t>(num_tokens));
  std::uniform_real_distribution<float> weight(0.1f, 1.0f);
  std::vector<float> row_weights(rows);
  for (float& w : row_weights) w = weight(rng);
  s.row_weights = DeviceBuffer<float>(row_weights);
  if (s.gemm == 1) {
    s.y = DeviceBuffer<uint16_t>(rows * static_cast<size_t>(s.n / 2));
    s.out_bf16 = DeviceBuffer<uint16_t>();
  } else {
    s.y = DeviceBuffer<uint16_t>();
    s.out_bf16 = DeviceBuffer<uint16_t>(rows * static_cast<size_t>(s.n));
  }
  FP4MOE_CUDA_CHECK(cudaDeviceSynchronize());
}

int64_t GemmTuneBench::num_tokens() const { return state_->num_tokens; }

GemmProblem GemmTuneBench::problem(bool batch_invariant) const {
  const State& s = *state_;
  return moe_gemm_problem(s.gemm, s.shape.num_experts, s.shape.top_k, s.shape.hidden, s.shape.inter, s.num_tokens,
                          batch_invariant);
}

void GemmTuneBench::launch(const GemmPlan& plan, int routing_idx, cudaStream_t stream) {
  State& s = *state_;
  if (s.workspace.grow(grouped_gemm_workspace_bytes(plan))) {
    s.workspace.fill_bytes(0, stream);
    FP4MOE_CUDA_CHECK(cudaStreamSynchronize(stream));
  }
  GroupedGemmArgs args = s.args(routing_idx);
  if (s.gemm == 1 && auto_gather_is_separate(plan.config)) {
    // As the default layer runs this tile: the rows copied into expert
    // order first, then read contiguously (by tensor map).
    const State::Routing& r = s.routings.at(static_cast<size_t>(routing_idx));
    s.x_sorted.grow(static_cast<size_t>(s.rows() * s.k));
    kernels::launch_gather_rows(s.x.get(), r.token_of_row.get(), r.offsets.get(), s.shape.num_experts, s.rows(), s.k,
                                s.x_sorted.get(), stream);
    args.x = s.x_sorted.get();
    args.gather_rows = nullptr;
    args.x_rows = s.rows();
  }
  grouped_gemm(args, plan, stream);
}

double GemmTuneBench::time_us(const GemmPlan& plan, int iterations, const L2Flusher& flusher, cudaStream_t stream) {
  int next = 0;
  const int num_routings = static_cast<int>(state_->routings.size());
  return time_median_us([&] { launch(plan, next++ % num_routings, stream); }, iterations, flusher, stream);
}

std::string GemmTuneBench::device_errors() {
  const std::string errors = grouped_gemm_device_errors(state_->error_flags.get(), nullptr);
  state_->error_flags.fill_bytes(0);
  FP4MOE_CUDA_CHECK(cudaDeviceSynchronize());
  return errors;
}

GemmTuneBench::HostCopy GemmTuneBench::host_copy(int routing_idx) const {
  const State& s = *state_;
  const State::Routing& r = s.routings.at(static_cast<size_t>(routing_idx));
  HostCopy h;
  PreparedGemmWeights& w = h.weights;
  w.num_experts = s.shape.num_experts;
  w.n = s.n;
  w.k = s.k;
  w.n_padded = s.weights.n_padded;
  w.k_padded = s.weights.k_padded;
  w.weights = s.weights.weights.download();
  w.scales = s.weights.scales.download();
  w.global_scales = s.weights.global_scales.download();
  h.bias = s.bias.download();
  h.x = s.x.download();
  h.offsets = r.offsets.download();
  h.token_of_row = r.token_of_row.download();
  h.pair_of_row = r.pair_of_row.download();
  h.row_weights = s.row_weights.download();
  return h;
}

void GemmTuneBench::poison_output() {
  state_->y.fill_bytes(0xFF);
  state_->out_bf16.fill_bytes(0xFF);
}

std::vector<float> GemmTuneBench::output() const {
  const State& s = *state_;
  const std::vector<uint16_t> bits = s.gemm == 2 ? s.out_bf16.download() : s.y.download();
  std::vector<float> out(bits.size());
  for (size_t i = 0; i < bits.size(); ++i) out[i] = bf16_to_float(bits[i]);
  return out;
}

// ------------------------------------------------------------------ tuning

double estimate_launch_us(const GemmProblem& problem, double flush_us) {
  constexpr double kEfficiency = 0.4;
  const Ceilings nominal{.copy_bytes_per_s = 4.0e12, .read_bytes_per_s = 4.0e12, .bf16_flops_per_s = 7.0e14};
  const int64_t active =
      std::max<int64_t>(1, problem.expected_active_experts > 0 ? problem.expected_active_experts
                                                               : std::min(problem.num_experts, problem.num_rows));
  const double kernel_us = roofline_us(grouped_gemm_cost(active, problem.num_rows, problem.n, problem.k), nominal);
  constexpr double kLaunchUs = 5;  // launch and event gaps
  return flush_us + kernel_us / kEfficiency + kLaunchUs;
}

double estimate_bucket_us(const GemmProblem& problem, int num_candidates, const TuneSettings& settings,
                          double flush_us) {
  // Pass 1: every candidate but the first probed with 2 launches, then timed
  // (pruned ones are not: this is the most it takes); pass 2; pass 3.
  const double launches = num_candidates * (settings.iterations + 3.0) - 2.0 +
                          (std::min(settings.finalists, num_candidates) + 1.0) * (2.0 * settings.iterations + 1.0) +
                          2.0 * settings.confirm_rounds * (settings.iterations + 1.0);
  return launches * estimate_launch_us(problem, flush_us);
}

BucketResult tune_bucket(GemmTuneBench& bench, int64_t num_tokens, const TuneSettings& settings,
                         const L2Flusher& flusher, const std::function<void(int64_t launches)>& progress) {
  FP4MOE_CHECK(
      settings.iterations >= 1 && settings.routings >= 1 && settings.finalists >= 1 && settings.confirm_rounds >= 1,
      "tune_bucket: iterations, routings, finalists and confirm_rounds must be >= 1");
  bench.set_tokens(num_tokens, settings.routings, settings.routing_skew);
  BucketResult result;
  result.problem = bench.problem(settings.batch_invariant);
  const std::vector<tune::Candidate> candidates =
      tune::candidates(result.problem, settings.limits, settings.batch_invariant);
  FP4MOE_CHECK(!candidates.empty(), "no compiled config with the ", to_string(result.problem.epilogue),
               " epilogue fits ", settings.limits.smem_budget_bytes,
               " B of shared memory and runs on compute capability ", settings.limits.compute_capability);
  result.num_candidates = static_cast<int>(candidates.size());
  // What MoeLayer plans for this bucket without a tuned choice.
  const GemmPlan heuristic_plan = limit_split_k(plan_grouped_gemm(result.problem), settings.batch_invariant);
  result.heuristic = {heuristic_plan.config, heuristic_plan.split_k};
  result.heuristic_is_candidate = std::find(candidates.begin(), candidates.end(), result.heuristic) != candidates.end();
  struct Timed {
    tune::Candidate candidate;
    GemmPlan plan;
    double time_us = 0;
  };
  std::vector<Timed> timed;
  const auto time_one = [&](Timed& t, int iterations) {
    t.time_us = bench.time_us(t.plan, iterations, flusher);
    result.timed_launches += iterations + 1;
    if (progress) progress(iterations + 1);
  };
  // The heuristic's own candidate is timed as the layer runs it, row classes
  // (GemmPlan::row_classes) included: a layer whose tuned choice is the
  // heuristic's config and split runs the heuristic's plan.
  for (const tune::Candidate& c : candidates)
    timed.push_back(
        {c, c == result.heuristic ? heuristic_plan : plan_grouped_gemm(result.problem, c.config, c.split_k), 0.0});
  if (!result.heuristic_is_candidate) timed.push_back({result.heuristic, heuristic_plan, 0.0});

  // Pass 1, the heuristic's choice first (a good first best). A candidate
  // whose first timed launch takes more than prune_slower_than x the best
  // median so far keeps that time and is not timed further: it cannot win,
  // and at prefill sizes the worst tiles take tens of milliseconds a launch.
  const auto is_heuristic = [&](const Timed& t) { return t.candidate == result.heuristic; };
  std::stable_partition(timed.begin(), timed.end(), is_heuristic);
  double best_us = 0;
  for (Timed& t : timed) {
    if (best_us > 0 && settings.prune_slower_than > 0) {
      time_one(t, 1);
      if (t.time_us > settings.prune_slower_than * best_us) {
        ++result.pruned;
        continue;
      }
    }
    time_one(t, settings.iterations);
    best_us = best_us > 0 ? std::min(best_us, t.time_us) : t.time_us;
  }

  // Pass 2: the finalists and the heuristic's choice, with more launches.
  std::vector<Timed> ranked;
  for (const Timed& t : timed)
    if (result.heuristic_is_candidate || !is_heuristic(t)) ranked.push_back(t);
  std::stable_sort(ranked.begin(), ranked.end(), [](const Timed& a, const Timed& b) { return a.time_us < b.time_us; });
  ranked.resize(std::min<size_t>(ranked.size(), static_cast<size_t>(settings.finalists)));
  if (std::none_of(ranked.begin(), ranked.end(), is_heuristic))
    ranked.push_back(*std::find_if(timed.begin(), timed.end(), is_heuristic));
  for (Timed& t : ranked) time_one(t, 2 * settings.iterations);

  const Timed* best = nullptr;
  const Timed* heuristic = nullptr;
  for (const Timed& t : ranked) {
    if (is_heuristic(t)) heuristic = &t;
    const bool eligible = !is_heuristic(t) || result.heuristic_is_candidate;
    if (eligible && (!best || t.time_us < best->time_us)) best = &t;
  }
  if (result.heuristic_is_candidate && heuristic->time_us <= best->time_us * (1.0 + settings.keep_heuristic_within))
    best = heuristic;
  result.tuned = best->candidate;
  result.tuned_us = best->time_us;
  result.heuristic_us = heuristic->time_us;

  // Pass 3: the winner against the heuristic's choice, interleaved, on times
  // the selection did not see.
  Timed winner = *best, baseline = *heuristic;
  std::vector<double> winner_us, baseline_us;
  for (int round = 0; round < settings.confirm_rounds; ++round) {
    for (Timed* t : {&baseline, &winner}) time_one(*t, settings.iterations);
    winner_us.push_back(winner.time_us);
    baseline_us.push_back(baseline.time_us);
  }
  const auto median_of = [](std::vector<double> v) {
    std::nth_element(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(v.size() / 2), v.end());
    return v[v.size() / 2];
  };
  result.confirmed_tuned_us = median_of(winner_us);
  result.confirmed_heuristic_us = median_of(baseline_us);
  const std::string errors = bench.device_errors();
  FP4MOE_CHECK(errors.empty(), "tuning ", num_tokens, " tokens: the device reported ", errors);
  return result;
}

}  // namespace fp4moe::bench
