// The routings the autotuner times on (bench/gemm_bench.hpp): uniform and
// skewed top-k draws give distinct experts in range, and the skew gives the
// load imbalance its --routing-skew help promises.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <set>
#include <vector>

#include "fp4moe/error.hpp"
#include "gemm_bench.hpp"

namespace fp4moe::bench {
namespace {

// Coefficient of variation of the rows per expert.
double rows_cv(const std::vector<int32_t>& ids, int64_t num_experts) {
  std::vector<double> rows(static_cast<size_t>(num_experts), 0.0);
  for (int32_t id : ids) rows[static_cast<size_t>(id)] += 1;
  const double mean = static_cast<double>(ids.size()) / static_cast<double>(num_experts);
  double var = 0;
  for (double r : rows) var += (r - mean) * (r - mean);
  return std::sqrt(var / static_cast<double>(num_experts)) / mean;
}

TEST(TuneRouting, TopKIdsAreDistinctAndInRange) {
  for (double skew : {0.0, 0.5, 1.0, 3.0}) {
    std::mt19937_64 rng(7);
    const std::vector<int32_t> ids = skewed_topk_ids(64, 6, 500, skew, rng);
    ASSERT_EQ(ids.size(), 500u * 6) << "skew " << skew;
    for (size_t t = 0; t < 500; ++t) {
      const std::set<int32_t> experts(ids.begin() + static_cast<std::ptrdiff_t>(t * 6),
                                      ids.begin() + static_cast<std::ptrdiff_t>(t * 6 + 6));
      EXPECT_EQ(experts.size(), 6u) << "token " << t << ", skew " << skew;
      EXPECT_GE(*experts.begin(), 0);
      EXPECT_LT(*experts.rbegin(), 64);
    }
  }
  // top_k = num_experts: every expert once per token, at any skew.
  std::mt19937_64 rng(1);
  std::vector<int32_t> all = skewed_topk_ids(8, 8, 3, 2.0, rng);
  std::sort(all.begin(), all.begin() + 8);
  for (int32_t e = 0; e < 8; ++e) EXPECT_EQ(all[static_cast<size_t>(e)], e);
}

TEST(TuneRouting, SkewZeroIsTheUniformRouting) {
  std::mt19937_64 a(3), b(3);
  EXPECT_EQ(skewed_topk_ids(256, 8, 100, 0.0, a), random_topk_ids(256, 8, 100, b));
}

TEST(TuneRouting, SkewSetsTheLoadImbalance) {
  // DeepSeek-V3's shape at T = 4096: 128 rows per expert on average. Uniform
  // routing leaves a Poisson-like spread (cv ~ 1/sqrt(128)); skew 1 about
  // 1.3 (the --routing-skew help), 0.5 about 0.5.
  std::mt19937_64 rng(2026);
  EXPECT_LT(rows_cv(skewed_topk_ids(256, 8, 4096, 0.0, rng), 256), 0.15);
  const double half = rows_cv(skewed_topk_ids(256, 8, 4096, 0.5, rng), 256);
  EXPECT_GT(half, 0.3);
  EXPECT_LT(half, 0.8);
  const double one = rows_cv(skewed_topk_ids(256, 8, 4096, 1.0, rng), 256);
  EXPECT_GT(one, 0.8);
  EXPECT_LT(one, 2.0);
  EXPECT_THROW(skewed_topk_ids(256, 8, 1, -1.0, rng), Error);
  EXPECT_THROW(skewed_topk_ids(256, 8, 1, std::nan(""), rng), Error);
}

}  // namespace
}  // namespace fp4moe::bench
