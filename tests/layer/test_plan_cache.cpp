// CPU tests of MoeLayer's bounded per-token-count cache
// (src/layer/plan_cache.hpp): it never holds more than its capacity, drops
// the least recently used entry first, keeps an evicted value alive for a
// holder, keeps the first of two values inserted for one key, and stays
// consistent under concurrent use.
#include <gtest/gtest.h>

#include <atomic>
#include <string>
#include <thread>
#include <vector>

#include "fp4moe/error.hpp"
#include "layer/plan_cache.hpp"

namespace fp4moe {
namespace {

TEST(PlanCache, NeverHoldsMoreThanItsCapacity) {
  PlanCache<std::string> cache(4);
  for (int64_t t = 1; t <= 1000; ++t) {
    cache.insert(t, std::to_string(t));
    EXPECT_LE(cache.size(), 4u);
  }
  EXPECT_EQ(cache.size(), 4u);
  for (int64_t t = 997; t <= 1000; ++t) {
    const auto hit = cache.find(t);
    ASSERT_NE(hit, nullptr) << t;
    EXPECT_EQ(*hit, std::to_string(t));
  }
  EXPECT_EQ(cache.find(996), nullptr);
}

TEST(PlanCache, DropsTheLeastRecentlyUsedFirst) {
  PlanCache<int> cache(3);
  cache.insert(1, 10);
  cache.insert(2, 20);
  cache.insert(3, 30);
  ASSERT_NE(cache.find(1), nullptr);  // 1 is now the most recently used
  cache.insert(4, 40);                // drops 2
  EXPECT_EQ(cache.find(2), nullptr);
  EXPECT_NE(cache.find(1), nullptr);
  EXPECT_NE(cache.find(3), nullptr);
  EXPECT_NE(cache.find(4), nullptr);
}

TEST(PlanCache, AnEvictedValueLivesWhileHeld) {
  PlanCache<std::string> cache(1);
  const auto held = cache.insert(7, "seven").first;
  cache.insert(8, "eight");
  EXPECT_EQ(cache.find(7), nullptr);
  EXPECT_EQ(*held, "seven");
}

TEST(PlanCache, TheFirstValueForAKeyIsKept) {
  PlanCache<int> cache(2);
  const auto [first, added] = cache.insert(5, 1);
  EXPECT_TRUE(added);
  const auto [second, added_again] = cache.insert(5, 2);
  EXPECT_FALSE(added_again);
  EXPECT_EQ(first, second);
  EXPECT_EQ(*cache.find(5), 1);
  EXPECT_EQ(cache.size(), 1u);
}

TEST(PlanCache, ZeroCapacityIsRefused) {
  try {
    PlanCache<int> cache(0);
    ADD_FAILURE() << "expected fp4moe::Error";
  } catch (const Error& e) {
    EXPECT_NE(e.message().find("capacity = 0"), std::string::npos) << e.message();
  }
}

TEST(PlanCache, ConcurrentLookupsAndInsertsStayBounded) {
  PlanCache<int64_t> cache(64);
  std::atomic<int> wrong{0};
  std::vector<std::thread> threads;
  for (int w = 0; w < 4; ++w)
    threads.emplace_back([&, w] {
      for (int64_t i = 0; i < 20000; ++i) {
        const int64_t key = (i * 7 + w * 13) % 256;
        auto value = cache.find(key);
        if (!value) value = cache.insert(key, key * 3).first;
        if (*value != key * 3) ++wrong;
      }
    });
  for (auto& t : threads) t.join();
  EXPECT_EQ(wrong.load(), 0);
  EXPECT_LE(cache.size(), 64u);
}

}  // namespace
}  // namespace fp4moe
