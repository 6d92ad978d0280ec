// ExpertParallelMoeLayer (include/fp4moe/expert_parallel_layer.hpp) against
// the single-GPU MoeLayer, bit for bit, in deterministic mode:
//   - one rank (any GPU), phases timed: DeepSeek-V3- and GLM-5-shaped layers (256 experts,
//     top-8, noaux_tc routing; hidden/inter scaled down), T in {0, 1, 64,
//     4096}, device routing and caller routing, repeated forwards on one
//     layer (buffers reused and grown);
//   - P ranks on P GPUs (P = every GPU up to 8, one thread each through
//     run_ranks_in_threads, as `fp4moe moe --ep N` runs them): contiguous
//     and table placements, tokens split unevenly over the ranks with one
//     rank holding none; skipped, visibly, on fewer than 2 GPUs;
//   - errors: a placement for another communicator size, the atomic finalize.
// The reference is MoeLayer with batch_invariant on (the EP layer's local
// layers are), which MoeLayerBatchInvariance shows equals any batch split.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "ep/nccl_util.hpp"
#include "fp4moe/cuda_check.hpp"
#include "fp4moe/expert_parallel_layer.hpp"
#include "fp4moe/moe_layer.hpp"
#include "fp4moe/reference.hpp"
#include "gpu_test_util.hpp"

namespace fp4moe {
namespace {

struct Shape {
  std::string name;
  int64_t num_experts, hidden, inter;
  int num_groups, topk_groups;
};

const Shape kShapes[] = {
    {"deepseek-v3-like", 256, 512, 256, 8, 4},
    {"glm-5-like", 256, 384, 256, 1, 1},
};

MoeLayerOptions options_for(const Shape& s) {
  MoeLayerOptions o;
  o.routing.mode = RoutingMode::kNoauxTc;
  o.routing.top_k = 8;
  o.routing.num_groups = s.num_groups;
  o.routing.topk_groups = s.topk_groups;
  o.routing.routed_scaling_factor = 2.5f;
  return o;
}

MoeWeights weights_for(const Shape& s) {
  MoeWeights w;
  w.num_experts = s.num_experts;
  w.hidden = s.hidden;
  w.inter = s.inter;
  for (int64_t e = 0; e < s.num_experts; ++e) {
    ExpertWeights x;
    const uint64_t seed = 1000 + static_cast<uint64_t>(e) * 3;
    x.gate = testing::fast_random_nvfp4(s.inter, s.hidden, 0.02f, seed);
    x.up = testing::fast_random_nvfp4(s.inter, s.hidden, 0.02f, seed + 1);
    x.down = testing::fast_random_nvfp4(s.hidden, s.inter, 0.02f, seed + 2);
    w.experts.push_back(std::move(x));
  }
  return w;
}

// One batch on the host: hidden states, router logits, and the routing the
// device computes from them (for the caller-routing runs).
struct Batch {
  int64_t num_tokens = 0;
  std::vector<uint16_t> hidden;
  std::vector<float> logits;
  std::vector<float> bias;
};

Batch make_batch(const Shape& s, int64_t num_tokens, std::mt19937& rng) {
  Batch b;
  b.num_tokens = num_tokens;
  b.hidden = testing::random_bf16(static_cast<size_t>(num_tokens * s.hidden), rng);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  b.logits.resize(static_cast<size_t>(num_tokens * s.num_experts));
  for (float& v : b.logits) v = normal(rng);
  b.bias.resize(static_cast<size_t>(s.num_experts));
  for (float& v : b.bias) v = 0.1f * normal(rng);
  return b;
}

// Rows [first, first + count) of a row-major host array.
template <typename T>
std::vector<T> rows(const std::vector<T>& all, int64_t width, int64_t first, int64_t count) {
  return std::vector<T>(all.begin() + first * width, all.begin() + (first + count) * width);
}

// Device copies of a batch (or of some of its tokens) for one forward.
struct DeviceBatch {
  int64_t num_tokens = 0;
  bool caller_routing = false;
  DeviceBuffer<uint16_t> hidden;
  DeviceBuffer<float> logits, bias, weights;
  DeviceBuffer<int32_t> ids;

  // Tokens [first, first + count) of b; routing given (caller) or on the
  // device from the logits.
  DeviceBatch(const Shape& s, const Batch& b, const Routing* caller, int64_t first, int64_t count)
      : num_tokens(count),
        caller_routing(caller != nullptr),
        hidden(rows(b.hidden, s.hidden, first, count)),
        logits(rows(b.logits, s.num_experts, first, count)),
        bias(b.bias) {
    if (caller) {
      ids = DeviceBuffer<int32_t>(rows(caller->topk_ids, caller->top_k, first, count));
      weights = DeviceBuffer<float>(rows(caller->topk_weights, caller->top_k, first, count));
    }
  }
  MoeForwardArgs args() const {
    MoeForwardArgs a;
    a.hidden_states = hidden.get();
    a.num_tokens = num_tokens;
    if (caller_routing) {
      a.topk_ids = ids.get();
      a.topk_weights = weights.get();
    } else {
      a.router_logits = logits.get();
      a.correction_bias = bias.get();
    }
    return a;
  }
};

// The single-GPU batch-invariant layer's output bits on the current device.
std::vector<uint16_t> single_gpu_output(const MoeWeights& weights, const MoeLayerOptions& options, const Shape& s,
                                        const Batch& b, const Routing* caller,
                                        const std::string& expected_device_errors = "") {
  if (b.num_tokens == 0) return {};
  MoeLayerOptions o = options;
  o.batch_invariant = true;
  const MoeLayer layer = MoeLayer::prepare(weights, o);
  const DeviceBatch d(s, b, caller, 0, b.num_tokens);
  DeviceBuffer<uint16_t> out(static_cast<size_t>(b.num_tokens * weights.hidden));
  out.fill_bytes(0xFF);
  DeviceBuffer<uint8_t> ws(layer.workspace_bytes(b.num_tokens));
  ws.fill_bytes(0);
  layer.forward(d.args(), out.get(), ws.get(), ws.bytes(), nullptr);
  FP4MOE_CUDA_CHECK(cudaDeviceSynchronize());
  EXPECT_EQ(layer.device_errors(ws.get(), nullptr), expected_device_errors);
  std::vector<uint16_t> bits = out.download();
  // The reference must be whole: an EP output compared with it then fails
  // wherever the EP layer left its (poisoned) output unwritten.
  EXPECT_TRUE(std::none_of(bits.begin(), bits.end(), [](uint16_t v) { return v == 0xFFFF; }))
      << "the single-GPU layer left output elements unwritten";
  return bits;
}

int64_t first_difference(const std::vector<uint16_t>& a, const std::vector<uint16_t>& b) {
  if (a.size() != b.size()) return 0;
  const auto it = std::mismatch(a.begin(), a.end(), b.begin());
  return it.first == a.end() ? -1 : static_cast<int64_t>(it.first - a.begin());
}

void one_rank_equals_the_single_gpu_layer(ncclComm_t comm) {
  cudaStream_t stream = nullptr;
  FP4MOE_CUDA_CHECK(cudaStreamCreate(&stream));
  std::mt19937 rng(3);
  for (const Shape& s : kShapes) {
    const MoeWeights weights = weights_for(s);
    const MoeLayerOptions options = options_for(s);
    ExpertParallelMoeLayer ep =
        ExpertParallelMoeLayer::prepare(weights, ExpertPlacement::contiguous(s.num_experts, 1), comm, options);
    EXPECT_TRUE(ep.local_layer().options().batch_invariant);
    for (int64_t T : {int64_t{1}, int64_t{64}, int64_t{4096}, int64_t{0}, int64_t{3}}) {
      const Batch b = make_batch(s, T, rng);
      Routing caller;  // the CPU routing, fed to both layers (empty for T = 0)
      caller.top_k = options.routing.top_k;
      if (T > 0) caller = route(b.logits.data(), T, s.num_experts, b.bias.data(), options.routing);
      const Routing* no_routing = nullptr;
      for (const Routing* given : {no_routing, static_cast<const Routing*>(&caller)}) {
        SCOPED_TRACE(s.name + " T=" + std::to_string(T) + (given ? " caller routing" : " device routing"));
        const std::vector<uint16_t> want = single_gpu_output(weights, options, s, b, given);
        const DeviceBatch d(s, b, given, 0, T);
        DeviceBuffer<uint16_t> out(static_cast<size_t>(std::max<int64_t>(T, 1) * s.hidden));
        out.fill_bytes(0xFF);
        ExpertParallelTimes times;
        const ExpertParallelStats stats = ep.forward(d.args(), out.get(), stream, given ? &times : nullptr);
        FP4MOE_CUDA_CHECK(cudaStreamSynchronize(stream));
        if (given) {
          for (double ms : {times.route_ms, times.dispatch_ms, times.experts_ms, times.return_ms, times.combine_ms})
            EXPECT_GE(ms, 0.0);
          EXPECT_GT(times.total_ms(), 0.0);
        }
        EXPECT_EQ(stats.sent_rows, T) << "one rank: every token once";
        EXPECT_EQ(stats.sent_pairs, T * options.routing.top_k);
        EXPECT_EQ(stats.received_rows, T);
        EXPECT_EQ(stats.received_pairs, T * options.routing.top_k);
        EXPECT_FALSE(stats.nonfinite_router_logits);
        if (T == 0) continue;
        EXPECT_EQ(first_difference(out.download(), want), -1) << "EP output differs from one GPU";
      }
    }
  }
  cudaStreamDestroy(stream);
}

void rejects_bad_configurations(ncclComm_t comm) {
  const Shape& s = kShapes[0];
  const MoeWeights weights = weights_for(s);
  const auto error_of = [&](const ExpertPlacement& placement, const MoeLayerOptions& options) {
    try {
      ExpertParallelMoeLayer::prepare(weights, placement, comm, options);
    } catch (const Error& e) {
      return e.message();
    }
    return std::string("(no error)");
  };
  EXPECT_NE(error_of(ExpertPlacement::contiguous(s.num_experts, 2), options_for(s)).find("2"), std::string::npos);
  EXPECT_NE(error_of(ExpertPlacement::contiguous(s.num_experts, 2), options_for(s)).find("communicator"),
            std::string::npos);
  MoeLayerOptions atomic = options_for(s);
  atomic.finalize = FinalizeMode::kAtomic;
  EXPECT_NE(error_of(ExpertPlacement::contiguous(s.num_experts, 1), atomic).find("Deterministic"), std::string::npos);
  EXPECT_NE(error_of(ExpertPlacement::contiguous(128, 1), options_for(s)).find("128"), std::string::npos);
}

// Non-finite router logits: their experts are excluded as on one GPU, and
// the forward's stats say so.
void nonfinite_logits_are_excluded_and_reported(ncclComm_t comm) {
  const Shape& s = kShapes[0];
  const MoeWeights weights = weights_for(s);
  const MoeLayerOptions options = options_for(s);
  ExpertParallelMoeLayer ep =
      ExpertParallelMoeLayer::prepare(weights, ExpertPlacement::contiguous(s.num_experts, 1), comm, options);
  std::mt19937 rng(4);
  Batch b = make_batch(s, 5, rng);
  b.logits[0] = std::numeric_limits<float>::quiet_NaN();  // token 0, expert 0
  b.logits[static_cast<size_t>(2 * s.num_experts + 1)] = std::numeric_limits<float>::infinity();
  const std::vector<uint16_t> want = single_gpu_output(
      weights, options, s, b, nullptr, "non-finite router logits (their experts were excluded, docs/design.md §3); ");
  const DeviceBatch d(s, b, nullptr, 0, b.num_tokens);
  DeviceBuffer<uint16_t> out(static_cast<size_t>(b.num_tokens * s.hidden));
  out.fill_bytes(0xFF);
  const ExpertParallelStats stats = ep.forward(d.args(), out.get(), nullptr);
  FP4MOE_CUDA_CHECK(cudaDeviceSynchronize());
  EXPECT_TRUE(stats.nonfinite_router_logits);
  EXPECT_EQ(first_difference(out.download(), want), -1) << "EP output differs from one GPU";
}

TEST(ExpertParallelLayer, OneRankEqualsTheSingleGpuLayer) {
  FP4MOE_REQUIRE_GPU();
  run_ranks_in_threads(1, [](int, ncclComm_t comm) { one_rank_equals_the_single_gpu_layer(comm); });
}

TEST(ExpertParallelLayer, NonFiniteLogitsAreExcludedAndReported) {
  FP4MOE_REQUIRE_GPU();
  run_ranks_in_threads(1, [](int, ncclComm_t comm) { nonfinite_logits_are_excluded_and_reported(comm); });
}

TEST(ExpertParallelLayer, RejectsAMismatchedPlacementAndTheAtomicFinalize) {
  FP4MOE_REQUIRE_GPU();
  run_ranks_in_threads(1, [](int, ncclComm_t comm) { rejects_bad_configurations(comm); });
}

// P ranks on P GPUs in one process, a thread per rank (as a serving framework
// runs one process per GPU, each calling forward with its own tokens).
TEST(ExpertParallelLayer, RanksOnSeveralGpusEqualTheSingleGpuLayer) {
  FP4MOE_REQUIRE_GPU();
  int num_gpus = 0;
  FP4MOE_CUDA_CHECK(cudaGetDeviceCount(&num_gpus));
  if (num_gpus < 2)
    GTEST_SKIP() << "needs 2 or more GPUs, this machine has " << num_gpus
                 << ": multi-rank expert parallelism not tested here";
  const int P = std::min(num_gpus, 8);
  std::mt19937 rng(9);
  for (const Shape& s : kShapes) {
    const MoeWeights weights = weights_for(s);
    const MoeLayerOptions options = options_for(s);
    std::vector<int32_t> table(static_cast<size_t>(s.num_experts));
    for (size_t e = 0; e < table.size(); ++e) table[e] = static_cast<int32_t>((e * 7 + e / 5) % P);
    for (const ExpertPlacement& placement :
         {ExpertPlacement::contiguous(s.num_experts, P), ExpertPlacement::from_table(table, P)}) {
      for (int64_t T : {int64_t{1}, int64_t{64}, int64_t{4096}}) {
        const Batch b = make_batch(s, T, rng);
        const Routing caller = route(b.logits.data(), T, s.num_experts, b.bias.data(), options.routing);
        FP4MOE_CUDA_CHECK(cudaSetDevice(0));
        const std::vector<uint16_t> want = single_gpu_output(weights, options, s, b, &caller);
        // Uneven split: rank 0 gets none when there is more than one token,
        // the last rank the remainder.
        std::vector<int64_t> first(static_cast<size_t>(P + 1), 0);
        for (int r = 0; r < P; ++r) {
          const int64_t share = r == 0 && T > 1 ? 0 : (T + P - 1) / P;
          first[static_cast<size_t>(r) + 1] = std::min(T, first[static_cast<size_t>(r)] + share);
        }
        first[static_cast<size_t>(P)] = T;
        std::vector<std::vector<uint16_t>> got(static_cast<size_t>(P));
        run_ranks_in_threads(P, [&](int r, ncclComm_t comm) {
          ExpertParallelMoeLayer ep = ExpertParallelMoeLayer::prepare(weights, placement, comm, options);
          const int64_t count = first[static_cast<size_t>(r) + 1] - first[static_cast<size_t>(r)];
          const DeviceBatch d(s, b, &caller, first[static_cast<size_t>(r)], count);
          DeviceBuffer<uint16_t> out(static_cast<size_t>(std::max<int64_t>(count, 1) * s.hidden));
          out.fill_bytes(0xFF);
          cudaStream_t stream = nullptr;
          FP4MOE_CUDA_CHECK(cudaStreamCreate(&stream));
          ExpertParallelTimes times;
          ep.forward(d.args(), out.get(), stream, &times);
          FP4MOE_CUDA_CHECK(cudaStreamSynchronize(stream));
          cudaStreamDestroy(stream);
          EXPECT_GT(times.all_to_all_ms(), 0.0) << "rank " << r;
          std::vector<uint16_t> bits = out.download();
          bits.resize(static_cast<size_t>(count * s.hidden));
          got[static_cast<size_t>(r)] = std::move(bits);
        });
        SCOPED_TRACE(s.name + " P=" + std::to_string(P) + " T=" + std::to_string(T));
        std::vector<uint16_t> all;
        for (const auto& part : got) all.insert(all.end(), part.begin(), part.end());
        EXPECT_EQ(first_difference(all, want), -1) << "EP output differs from one GPU";
      }
    }
  }
}

}  // namespace
}  // namespace fp4moe
