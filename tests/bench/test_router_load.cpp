// The layer benchmark's router loads (bench/layer_bench.hpp, RouterLoad):
// what each spreads over the experts, routed by the CPU reference as the
// benchmark's expert_load does, and that the skewed load keeps the draws of
// the runs recorded before the option existed.
#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <vector>

#include "fp4moe/reference.hpp"
#include "layer_bench.hpp"

namespace fp4moe::bench {
namespace {

RoutingParams glm5() {
  RoutingParams r;
  r.mode = RoutingMode::kNoauxTc;
  r.top_k = 8;
  r.num_groups = 1;
  r.topk_groups = 1;
  r.routed_scaling_factor = 2.5f;
  return r;
}

RoutingParams deepseek_v3() {
  RoutingParams r = glm5();
  r.num_groups = 8;
  r.topk_groups = 4;
  return r;
}

struct Load {
  double hottest_over_mean = 0;
  double median_over_mean = 0;  // among the experts with rows
};

Load load_of(const RouterInputs& in, int64_t tokens, int64_t num_experts, const RoutingParams& routing) {
  const Routing r = route(in.logits.data(), tokens, num_experts, in.bias.data(), routing);
  std::vector<int64_t> rows(static_cast<size_t>(num_experts), 0);
  for (int32_t e : r.topk_ids) ++rows[static_cast<size_t>(e)];
  std::erase(rows, 0);
  std::sort(rows.begin(), rows.end());
  const double mean = static_cast<double>(tokens) * routing.top_k / static_cast<double>(num_experts);
  return {static_cast<double>(rows.back()) / mean, static_cast<double>(rows[rows.size() / 2]) / mean};
}

TEST(RouterLoad, RealisticPutsTwoAndAHalfTimesTheMeanOnTheHottestExpertAtT4096) {
  for (const RoutingParams& routing : {glm5(), deepseek_v3()}) {
    const RouterInputs in = random_router_inputs(4096, 256, routing, 1, RouterLoad::kRealistic);
    const Load load = load_of(in, 4096, 256, routing);
    EXPECT_NEAR(load.hottest_over_mean, kRealisticHotShare, 0.02) << "groups " << routing.num_groups;
    EXPECT_GT(load.median_over_mean, 0.75);
    EXPECT_LT(load.median_over_mean, 1.0);
    EXPECT_GT(in.popularity_scale, 0.0);
    for (float b : in.bias) EXPECT_EQ(b, 0.0f);
  }
}

TEST(RouterLoad, RealisticGivesTheSameTokensWhateverTheMaximumCount) {
  const RouterInputs small = random_router_inputs(64, 256, glm5(), 3, RouterLoad::kRealistic);
  const RouterInputs large = random_router_inputs(8192, 256, glm5(), 3, RouterLoad::kRealistic);
  EXPECT_EQ(small.popularity_scale, large.popularity_scale);
  ASSERT_EQ(small.logits.size(), 64u * 256u);
  EXPECT_TRUE(std::equal(small.logits.begin(), small.logits.end(), large.logits.begin()));
}

TEST(RouterLoad, UniformIsBalancedAndSkewedIsNot) {
  const RouterInputs uniform = random_router_inputs(4096, 256, glm5(), 1, RouterLoad::kUniform);
  const RouterInputs skewed = random_router_inputs(4096, 256, glm5(), 1, RouterLoad::kSkewed);
  EXPECT_LT(load_of(uniform, 4096, 256, glm5()).hottest_over_mean, 1.5);  // Poisson(128): ~1.3
  EXPECT_GT(load_of(skewed, 4096, 256, glm5()).hottest_over_mean, 4.0);
  EXPECT_EQ(uniform.popularity_scale, 0.0);
}

TEST(RouterLoad, SkewedKeepsTheDrawsOfEarlierRuns) {
  // N(0, 1) logits, then a 0.1 N(0, 1) bias, from one mt19937_64(seed).
  const RouterInputs in = random_router_inputs(16, 8, glm5(), 7, RouterLoad::kSkewed);
  std::mt19937_64 rng(7);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (float v : in.logits) ASSERT_EQ(v, normal(rng));
  for (float v : in.bias) ASSERT_EQ(v, 0.1f * normal(rng));
}

TEST(RouterLoad, NamesRoundTripAndUnknownOnesAreRefused) {
  for (RouterLoad load : {RouterLoad::kUniform, RouterLoad::kRealistic, RouterLoad::kSkewed})
    EXPECT_EQ(parse_router_load(to_string(load)), load);
  EXPECT_THROW(parse_router_load("balanced"), Error);
}

}  // namespace
}  // namespace fp4moe::bench
