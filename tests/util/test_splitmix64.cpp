// Tests of src/util/splitmix64.hpp: the first outputs for seed 0 are those of
// the published SplitMix64 (so every user's fixed-seed data stays what it
// was), uniform() stays in [0, 1), and normal() has mean 0 and variance 1
// within sampling error.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>

#include "util/splitmix64.hpp"

namespace fp4moe {
namespace {

TEST(SplitMix64, PublishedStreamForSeedZero) {
  SplitMix64 rng(0);
  EXPECT_EQ(rng.next(), 0xE220A8397B1DCDAFull);
  EXPECT_EQ(rng.next(), 0x6E789E6AA1B965F4ull);
  EXPECT_EQ(rng.next(), 0x06C45D188009454Full);
}

TEST(SplitMix64, SameSeedSameStream) {
  SplitMix64 a(12345), b(12345), c(12346);
  bool differs = false;
  for (int i = 0; i < 100; ++i) {
    const uint64_t x = a.next();
    EXPECT_EQ(x, b.next());
    differs = differs || x != c.next();
  }
  EXPECT_TRUE(differs);
}

TEST(SplitMix64, UniformAndNormalRanges) {
  SplitMix64 rng(7);
  constexpr int kDraws = 200000;
  double sum = 0.0, sum_sq = 0.0;
  for (int i = 0; i < kDraws; ++i) {
    const double u = rng.uniform();
    ASSERT_GE(u, 0.0);
    ASSERT_LT(u, 1.0);
    const double n = rng.normal();
    ASSERT_TRUE(std::isfinite(n));
    sum += n;
    sum_sq += n * n;
  }
  const double mean = sum / kDraws;
  EXPECT_NEAR(mean, 0.0, 0.02);  // about 9 standard errors; the seed is fixed
  EXPECT_NEAR(sum_sq / kDraws - mean * mean, 1.0, 0.02);
}

}  // namespace
}  // namespace fp4moe
