// Tests of src/util/parallel.hpp: every index visited exactly once for counts
// 0, 1, around the thread count and large, with the default and with fixed
// thread counts; no more threads than asked for; one thread means the
// calling thread, in order; an exception in a worker reaches the caller after
// every worker has finished, and it is the one of the lowest failing item.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <mutex>
#include <set>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "util/parallel.hpp"

namespace fp4moe {
namespace {

constexpr int64_t kCounts[] = {0, 1, 2, 3, 7, 8, 9, 64, 1000, 100003};
constexpr int kThreadCounts[] = {0, 1, 2, 3, 8, 33};  // 0: one per hardware thread

TEST(ParallelFor, VisitsEveryIndexExactlyOnce) {
  for (const int64_t count : kCounts) {
    for (const int num_threads : kThreadCounts) {
      std::vector<std::atomic<int>> visits(static_cast<size_t>(count));
      std::atomic<int64_t> out_of_range{0};
      parallel_for(
          count,
          [&](int64_t i) {
            if (i < 0 || i >= count) {
              ++out_of_range;
              return;
            }
            ++visits[static_cast<size_t>(i)];
          },
          num_threads);
      EXPECT_EQ(out_of_range.load(), 0) << "count " << count << ", threads " << num_threads;
      int64_t wrong = 0;
      for (const std::atomic<int>& v : visits) wrong += v.load() != 1;
      EXPECT_EQ(wrong, 0) << "count " << count << ", threads " << num_threads << ": indices not visited exactly once";
    }
  }
}

TEST(ParallelFor, NegativeCountRunsNothing) {
  bool called = false;
  parallel_for(-5, [&](int64_t) { called = true; });
  EXPECT_FALSE(called);
}

TEST(ParallelFor, UsesAtMostTheThreadsAskedFor) {
  for (const int num_threads : {1, 2, 3, 8}) {
    for (const int64_t count : {int64_t{1}, int64_t{2}, int64_t{5}, int64_t{200}}) {
      std::mutex mutex;
      std::set<std::thread::id> ids;
      parallel_for(
          count,
          [&](int64_t) {
            // Long enough that idle threads take items, so several threads run.
            std::this_thread::sleep_for(std::chrono::microseconds(200));
            const std::lock_guard<std::mutex> lock(mutex);
            ids.insert(std::this_thread::get_id());
          },
          num_threads);
      EXPECT_LE(static_cast<int64_t>(ids.size()), std::min<int64_t>(count, num_threads))
          << "count " << count << ", threads " << num_threads;
    }
  }
}

TEST(ParallelFor, OneThreadRunsInOrderOnTheCaller) {
  std::vector<int64_t> order;
  const std::thread::id caller = std::this_thread::get_id();
  bool other_thread = false;
  parallel_for(
      50,
      [&](int64_t i) {
        order.push_back(i);
        other_thread = other_thread || std::this_thread::get_id() != caller;
      },
      1);
  ASSERT_EQ(order.size(), 50u);
  for (int64_t i = 0; i < 50; ++i) EXPECT_EQ(order[static_cast<size_t>(i)], i);
  EXPECT_FALSE(other_thread);
}

TEST(ParallelFor, ResultDoesNotDependOnTheThreadCount) {
  // Disjoint writes, as the CPU reference does them.
  const auto run = [](int num_threads) {
    std::vector<double> out(10000);
    parallel_for(
        static_cast<int64_t>(out.size()),
        [&](int64_t i) {
          double sum = 0.0;
          for (int64_t j = 0; j <= i % 97; ++j) sum += 1.0 / static_cast<double>(i + j + 1);
          out[static_cast<size_t>(i)] = sum;
        },
        num_threads);
    return out;
  };
  const std::vector<double> serial = run(1);
  for (const int num_threads : kThreadCounts) EXPECT_EQ(run(num_threads), serial) << num_threads << " threads";
}

TEST(ParallelFor, ExceptionInAWorkerReachesTheCaller) {
  for (const int num_threads : kThreadCounts) {
    for (const int64_t count : {int64_t{1}, int64_t{2}, int64_t{16}, int64_t{1000}}) {
      const int64_t bad = count / 2;
      try {
        parallel_for(
            count,
            [&](int64_t i) {
              if (i == bad) throw std::runtime_error("item " + std::to_string(i));
            },
            num_threads);
        ADD_FAILURE() << "no exception; count " << count << ", threads " << num_threads;
      } catch (const std::runtime_error& e) {
        EXPECT_EQ(std::string(e.what()), "item " + std::to_string(bad))
            << "count " << count << ", threads " << num_threads;
      }
    }
  }
}

TEST(ParallelFor, RethrowsTheLowestFailingItemAfterEveryWorkerFinished) {
  // Items 10, 20, 30, ... throw; a serial loop would throw at 10. Items take
  // a little time so that several are in flight when the first one throws.
  for (const int num_threads : {2, 3, 8, 0}) {
    for (int repeat = 0; repeat < 10; ++repeat) {
      std::atomic<int> running{0};
      try {
        parallel_for(
            500,
            [&](int64_t i) {
              ++running;
              std::this_thread::sleep_for(std::chrono::microseconds(50 + (i * 37) % 100));
              --running;
              if (i >= 10 && i % 10 == 0) throw std::runtime_error(std::to_string(i));
            },
            num_threads);
        ADD_FAILURE() << "no exception with " << num_threads << " threads";
      } catch (const std::runtime_error& e) {
        EXPECT_EQ(std::string(e.what()), "10") << num_threads << " threads, repeat " << repeat;
        EXPECT_EQ(running.load(), 0) << "an item was still running when the exception arrived";
      }
    }
  }
}

TEST(ParallelFor, ExceptionTypeIsKept) {
  struct Custom {
    int code;
  };
  try {
    parallel_for(
        100,
        [](int64_t i) {
          if (i == 42) throw Custom{42};
        },
        4);
    ADD_FAILURE() << "no exception";
  } catch (const Custom& c) {
    EXPECT_EQ(c.code, 42);
  }
}

}  // namespace
}  // namespace fp4moe
