// GPU tests of the MoE layer's forward (include/fp4moe/moe_layer.hpp;
// src/layer/forward.cpp, planning.cpp) against the CPU reference,
// moe_reference(route(logits)) in double:
//   - model-shaped layers (DeepSeek-V3, GLM-4.5, Qwen3-30B, gpt-oss with
//     biases, Mixtral) with hidden/inter scaled down and chosen off the
//     128-tile grid, T in {1, 3, 64, 1000}, device and caller routing, both
//     finalize modes x both gather modes;
//   - caller routing that is skewed (one hot expert) or uses only a few
//     experts (most experts get no tokens);
//   - every compiled tile config forced in GEMM1 and GEMM2;
//   - the full-size GLM-5 layer (~5.4 GB of weights) at T = 1 and 64.
// The shapes, data and helpers: tests/layer/moe_layer_test_support.hpp.
// Skipped, visibly, where no GPU exists.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <numeric>
#include <random>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "fp4moe/moe_layer.hpp"
#include "moe_layer_test_support.hpp"
#include "util/parallel.hpp"

namespace fp4moe {
namespace {

// -------------------------------------------- model shapes x modes x tokens

using ModelModes = std::tuple<int, FinalizeMode, GatherMode>;
class ModelMatrix : public ::testing::TestWithParam<ModelModes> {};

TEST_P(ModelMatrix, MatchesReferenceWithDeviceAndCallerRouting) {
  FP4MOE_REQUIRE_GPU();
  const auto [model_idx, finalize, gather] = GetParam();
  const ModelShape& shape = model_shapes()[static_cast<size_t>(model_idx)];
  ModelData& data = model_data(shape);
  const MoeLayer layer = MoeLayerInternals::prepare(data.weights, layer_options(shape, finalize), gather);
  EXPECT_EQ(layer.num_experts(), shape.num_experts);
  EXPECT_EQ(layer.hidden(), shape.hidden);
  EXPECT_EQ(layer.inter(), shape.inter);
  EXPECT_EQ(layer.top_k(), shape.routing.top_k);

  Stream stream;
  const DeviceBuffer<uint8_t> workspace = make_workspace(layer, kMaxTokens);
  DeviceBuffer<uint16_t> output(static_cast<size_t>(kMaxTokens * shape.hidden));
  for (int64_t num_tokens : kTokenCounts) {
    const TokenBatch& batch = data.batch(num_tokens);
    const DeviceInputs inputs(batch, data.correction_bias);
    EXPECT_EQ(layer.plan(num_tokens).num_rows, num_tokens * shape.routing.top_k);
    for (bool device_routing : {true, false}) {
      const std::string what = shape.name + " T=" + std::to_string(num_tokens) + " " +
                               (device_routing ? "device routing" : "caller routing") + " " + to_string(finalize) +
                               " " + to_string(gather);
      SCOPED_TRACE(what);
      const std::vector<uint16_t> out = forward_bits(
          layer, device_routing ? inputs.device_routing() : inputs.caller_routing(), output, workspace, stream.get());
      const double rel_err = expect_matches_reference(out, batch.reference_for(finalize), shape.hidden);
      // Against the all-double layer: the contract's ||out - ref|| / ||ref|| < 1e-2.
      const double rel_err_exact =
          testing::compare(bf16_to_floats(out),
                           std::vector<double>(batch.reference_exact.begin(), batch.reference_exact.end()),
                           shape.hidden)
              .rel_err;
      EXPECT_LT(rel_err_exact, 1e-2);
      std::printf("  %-60s rel_err %.2e (all-double reference %.2e)\n", what.c_str(), rel_err, rel_err_exact);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Models, ModelMatrix,
                         ::testing::Combine(::testing::Range(0, static_cast<int>(model_shapes().size())),
                                            ::testing::Values(FinalizeMode::kDeterministic, FinalizeMode::kAtomic),
                                            ::testing::Values(GatherMode::kFused, GatherMode::kSeparate)),
                         [](const ::testing::TestParamInfo<ModelModes>& param_info) {
                           return model_shapes()[static_cast<size_t>(std::get<0>(param_info.param))].name + "_" +
                                  to_string(std::get<1>(param_info.param)) + "_" +
                                  to_string(std::get<2>(param_info.param));
                         });

// ------------------------------------------- skewed and sparse caller routing

// Caller-given routing patterns that device routing of random logits never produces.
enum class RoutingPattern {
  kHotExpert,   // 90% of tokens send one slot to the same expert
  kFewExperts,  // all tokens use a handful of experts; the rest get none
};

std::string to_string(RoutingPattern p) { return p == RoutingPattern::kHotExpert ? "HotExpert" : "FewExperts"; }
void PrintTo(RoutingPattern p, std::ostream* os) { *os << to_string(p); }

// max(3, top_k + 1) experts spread over [0, num_experts), both ends included.
std::vector<int32_t> few_expert_pool(int64_t num_experts, int top_k) {
  const int64_t n = std::min<int64_t>(num_experts, std::max(3, top_k + 1));
  std::vector<int32_t> pool;
  for (int64_t i = 0; i < n; ++i) pool.push_back(static_cast<int32_t>(n == 1 ? 0 : i * (num_experts - 1) / (n - 1)));
  return pool;
}

Routing patterned_routing(RoutingPattern pattern, int64_t num_tokens, int64_t num_experts, int top_k,
                          std::mt19937& rng) {
  Routing r;
  r.num_tokens = num_tokens;
  r.top_k = top_k;
  std::vector<int32_t> pool(static_cast<size_t>(num_experts));
  std::iota(pool.begin(), pool.end(), 0);
  if (pattern == RoutingPattern::kFewExperts) pool = few_expert_pool(num_experts, top_k);
  const int32_t hot_expert = static_cast<int32_t>(num_experts / 2 + 1) % static_cast<int32_t>(num_experts);
  std::uniform_real_distribution<float> weight(0.1f, 1.0f);
  std::bernoulli_distribution is_hot(0.9);
  std::uniform_int_distribution<int> slot(0, top_k - 1);
  for (int64_t t = 0; t < num_tokens; ++t) {
    std::shuffle(pool.begin(), pool.end(), rng);
    std::vector<int32_t> chosen(pool.begin(), pool.begin() + top_k);
    if (pattern == RoutingPattern::kHotExpert && is_hot(rng) &&
        std::find(chosen.begin(), chosen.end(), hot_expert) == chosen.end())
      chosen[slot(rng)] = hot_expert;
    for (int j = 0; j < top_k; ++j) {
      r.topk_ids.push_back(chosen[j]);
      r.topk_weights.push_back(weight(rng));
    }
  }
  return r;
}

// The model shapes plus a top-1 layer, where "90% of tokens to one expert"
// is also 90% of all (token, slot) pairs; with top_k > 1 a token may name an
// expert once only, so the hot expert gets at most 1/top_k of the pairs.
const std::vector<ModelShape>& pattern_shapes() {
  static const std::vector<ModelShape> shapes = [] {
    std::vector<ModelShape> s = model_shapes();
    s.push_back({"Top1", 64, 256, 144, softmax_routing(1, false)});
    return s;
  }();
  return shapes;
}

using ShapePattern = std::tuple<int, RoutingPattern>;
class CallerRoutingPatterns : public ::testing::TestWithParam<ShapePattern> {};

TEST_P(CallerRoutingPatterns, MatchReference) {
  FP4MOE_REQUIRE_GPU();
  const auto [shape_idx, pattern] = GetParam();
  const ModelShape& shape = pattern_shapes()[static_cast<size_t>(shape_idx)];
  ModelData& data = model_data(shape);
  for (FinalizeMode finalize : {FinalizeMode::kDeterministic, FinalizeMode::kAtomic}) {
    const MoeLayer layer = MoeLayer::prepare(data.weights, layer_options(shape, finalize));
    Stream stream;
    const DeviceBuffer<uint8_t> workspace = make_workspace(layer, kMaxTokens);
    DeviceBuffer<uint16_t> output(static_cast<size_t>(kMaxTokens * shape.hidden));
    for (int64_t num_tokens : {int64_t{3}, int64_t{64}, kMaxTokens}) {
      std::mt19937 rng(static_cast<uint32_t>(num_tokens * 31 + shape_idx));
      const std::vector<uint16_t> hidden = testing::random_bf16(static_cast<size_t>(num_tokens * shape.hidden), rng);
      const Routing routing = patterned_routing(pattern, num_tokens, shape.num_experts, shape.routing.top_k, rng);
      std::vector<int64_t> pairs_per_expert(static_cast<size_t>(shape.num_experts), 0);
      for (int32_t id : routing.topk_ids) ++pairs_per_expert[static_cast<size_t>(id)];
      const int64_t used =
          std::count_if(pairs_per_expert.begin(), pairs_per_expert.end(), [](int64_t n) { return n > 0; });
      const int64_t busiest = *std::max_element(pairs_per_expert.begin(), pairs_per_expert.end());
      const std::string what = shape.name + " " + to_string(pattern) + " T=" + std::to_string(num_tokens) + " " +
                               to_string(finalize) + ": " + std::to_string(used) + " of " +
                               std::to_string(shape.num_experts) + " experts used, busiest has " +
                               std::to_string(busiest) + " of " + std::to_string(routing.topk_ids.size()) + " pairs";
      SCOPED_TRACE(what);
      const DeviceInputs inputs(hidden, {}, {}, routing, num_tokens);
      const std::vector<uint16_t> out = forward_bits(layer, inputs.caller_routing(), output, workspace, stream.get());
      const double rel_err =
          expect_matches_reference(out,
                                   reference_output(data.weights, hidden, routing, shape.activation,
                                                    Intermediate::kBf16, reference_combine(finalize)),
                                   shape.hidden);
      std::printf("  %-90s rel_err %.2e\n", what.c_str(), rel_err);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Patterns, CallerRoutingPatterns,
                         ::testing::Combine(::testing::Range(0, static_cast<int>(pattern_shapes().size())),
                                            ::testing::Values(RoutingPattern::kHotExpert, RoutingPattern::kFewExperts)),
                         [](const ::testing::TestParamInfo<ShapePattern>& param_info) {
                           return pattern_shapes()[static_cast<size_t>(std::get<0>(param_info.param))].name + "_" +
                                  to_string(std::get<1>(param_info.param));
                         });

// ------------------------------------------------------ forced tile configs

// Every tile forced in GEMM1 (SwiGLU epilogue) and GEMM2 (finalize), paired
// with the next tile in the list so that each GEMM sees every tile and both
// families meet in one layer.
TEST(MoeLayerConfigs, EveryCompiledConfigForcedInBothGemms) {
  FP4MOE_REQUIRE_GPU();
  const std::vector<TileConfig> tiles = compiled_tiles();
  ASSERT_FALSE(tiles.empty());
  std::vector<std::pair<TileConfig, TileConfig>> pairs;
  for (size_t i = 0; i < tiles.size(); ++i) pairs.emplace_back(tiles[i], tiles[(i + 1) % tiles.size()]);
  for (const std::string name : {"GLM45", "Mixtral"}) {
    const ModelShape& shape = shape_named(name);
    ModelData& data = model_data(shape);
    std::vector<std::unique_ptr<DeviceInputs>> inputs;
    const int64_t token_counts[] = {3, 64, kMaxTokens};
    for (int64_t t : token_counts)
      inputs.push_back(std::make_unique<DeviceInputs>(data.batch(t), data.correction_bias));
    Stream stream;
    DeviceBuffer<uint16_t> output(static_cast<size_t>(kMaxTokens * shape.hidden));
    for (const auto& [config1, config2] : pairs) {
      {
        MoeLayerOptions options = layer_options(shape);
        options.gemm1_config = config1;
        options.gemm2_config = config2;
        const MoeLayer layer = MoeLayer::prepare(data.weights, options);
        const DeviceBuffer<uint8_t> workspace = make_workspace(layer, kMaxTokens);
        for (size_t i = 0; i < inputs.size(); ++i) {
          const int64_t num_tokens = token_counts[i];
          const std::string what = shape.name + " gemm1 " + config1.to_string() + " gemm2 " + config2.to_string() +
                                   " T=" + std::to_string(num_tokens);
          SCOPED_TRACE(what);
          const MoeLayerPlan plan = layer.plan(num_tokens);
          EXPECT_TRUE(same_tile(plan.gemm1.config, config1)) << "planned " << plan.gemm1.config.to_string();
          EXPECT_TRUE(same_tile(plan.gemm2.config, config2)) << "planned " << plan.gemm2.config.to_string();
          const std::vector<uint16_t> out =
              forward_bits(layer, inputs[i]->device_routing(), output, workspace, stream.get());
          const double rel_err = expect_matches_reference(out, data.batch(num_tokens).reference, shape.hidden);
          std::printf("  %-60s rel_err %.2e\n", what.c_str(), rel_err);
        }
      }
    }
  }
}

// ------------------------------------------------------ full-size GLM-5 layer

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// Full-size weights from the fast generator (block scales 0.125 .. 2).
MoeWeights fast_random_weights(const ModelShape& shape) {
  MoeWeights w;
  w.num_experts = shape.num_experts;
  w.hidden = shape.hidden;
  w.inter = shape.inter;
  w.experts.resize(static_cast<size_t>(shape.num_experts));
  const float gate_up_scale = 0.3f / std::sqrt(static_cast<float>(shape.hidden));
  const float down_scale = 0.3f / std::sqrt(static_cast<float>(shape.inter));
  parallel_for(shape.num_experts, [&](int64_t e) {
    ExpertWeights& ex = w.experts[static_cast<size_t>(e)];
    const uint64_t seed = 0xF00D0000ull + static_cast<uint64_t>(e) * 3;
    ex.gate = testing::fast_random_nvfp4(shape.inter, shape.hidden, gate_up_scale, seed);
    ex.up = testing::fast_random_nvfp4(shape.inter, shape.hidden, gate_up_scale, seed + 1);
    ex.down = testing::fast_random_nvfp4(shape.hidden, shape.inter, down_scale, seed + 2);
  });
  return w;
}

size_t host_weight_bytes(const MoeWeights& w) {
  size_t bytes = 0;
  for (const ExpertWeights& ex : w.experts)
    for (const Nvfp4Matrix* m : {&ex.gate, &ex.up, &ex.down}) bytes += m->packed.size() + m->scales.size();
  return bytes;
}

TEST(MoeLayerFullSize, Glm5AtOneAnd64Tokens) {
  FP4MOE_REQUIRE_GPU();
  const ModelShape shape{"GLM5", 256, 6144, 2048, noaux_routing(8, 1, 1, 2.5f)};

  auto start = std::chrono::steady_clock::now();
  const MoeWeights weights = fast_random_weights(shape);
  std::printf("  GLM-5: generated %.2f GB of NVFP4 weights in %.1f s\n", host_weight_bytes(weights) / 1e9,
              seconds_since(start));

  start = std::chrono::steady_clock::now();
  const MoeLayer layer = MoeLayer::prepare(weights, layer_options(shape));
  std::printf("  GLM-5: prepare (repack + upload %.2f GB) took %.1f s\n", layer.device_weight_bytes() / 1e9,
              seconds_since(start));

  std::mt19937 rng(55);
  const std::vector<float> correction_bias = normal_floats(static_cast<size_t>(shape.num_experts), 0.1f, rng);
  Stream stream;
  const int64_t max_tokens = 64;
  const DeviceBuffer<uint8_t> workspace = make_workspace(layer, max_tokens);
  DeviceBuffer<uint16_t> output(static_cast<size_t>(max_tokens * shape.hidden));
  for (int64_t num_tokens : {int64_t{1}, max_tokens}) {
    SCOPED_TRACE("GLM-5 T=" + std::to_string(num_tokens));
    TokenBatch b;
    b.num_tokens = num_tokens;
    b.hidden_states = testing::random_bf16(static_cast<size_t>(num_tokens * shape.hidden), rng);
    b.router_logits = draw_router_logits(num_tokens, shape.num_experts, correction_bias, shape.routing, rng);
    b.routing = route(b.router_logits.data(), num_tokens, shape.num_experts, correction_bias.data(), shape.routing);
    start = std::chrono::steady_clock::now();
    b.reference = reference_output(weights, b.hidden_states, b.routing, shape.activation);
    const double reference_s = seconds_since(start);

    const DeviceInputs inputs(b, correction_bias);
    for (bool device_routing : {true, false}) {
      const std::vector<uint16_t> out = forward_bits(
          layer, device_routing ? inputs.device_routing() : inputs.caller_routing(), output, workspace, stream.get());
      const double rel_err = expect_matches_reference(out, b.reference, shape.hidden);
      std::printf("  GLM-5 T=%lld %s routing: reference %.1f s, rel_err %.2e\n", static_cast<long long>(num_tokens),
                  device_routing ? "device" : "caller", reference_s, rel_err);
    }
  }
}

}  // namespace
}  // namespace fp4moe
