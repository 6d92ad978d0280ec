// parallel_for: the project's one host thread loop (weight packing, the CPU
// reference, the CLI's synthesis and quantisation, the benchmarks' weights),
// and hardware_threads(), what "all cores" means for it. Internal (not under
// include/).
//
// Tested in tests/util/test_parallel.cpp.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <exception>
#include <limits>
#include <mutex>
#include <thread>
#include <vector>

namespace fp4moe {

// Threads the hardware runs at once (std::thread::hardware_concurrency, which
// may report 0 when unknown): at least 1.
inline int hardware_threads() { return static_cast<int>(std::max(1u, std::thread::hardware_concurrency())); }

// Runs body(i) once for every i in [0, count), on min(count, num_threads)
// threads, the calling thread among them; num_threads <= 0 means one per
// hardware thread. Items are handed out in increasing order as threads come
// free, so which thread runs an item is unspecified: bodies must write
// disjoint results (then the result does not depend on the thread count).
//
// When bodies throw, no further items are started, every thread is joined,
// and the exception of the lowest item that threw is rethrown on the calling
// thread: all items below it had been handed out, so it is the exception a
// serial loop would have thrown.
template <typename Body>
void parallel_for(int64_t count, const Body& body, int num_threads = 0) {
  if (count <= 0) return;
  if (num_threads <= 0) num_threads = hardware_threads();
  const int64_t workers = std::min<int64_t>(count, num_threads);
  if (workers == 1) {
    for (int64_t i = 0; i < count; ++i) body(i);
    return;
  }
  std::atomic<int64_t> next{0};
  std::mutex error_mutex;
  std::exception_ptr error;
  int64_t error_idx = std::numeric_limits<int64_t>::max();
  const auto work = [&] {
    for (int64_t i = next++; i < count; i = next++) {
      try {
        body(i);
      } catch (...) {
        const std::lock_guard<std::mutex> lock(error_mutex);
        if (i < error_idx) {
          error = std::current_exception();
          error_idx = i;
        }
        next = count;  // start no more items
      }
    }
  };
  std::vector<std::thread> threads;
  threads.reserve(static_cast<size_t>(workers - 1));
  try {
    for (int64_t w = 1; w < workers; ++w) threads.emplace_back(work);
  } catch (...) {
    // A thread could not be started (std::system_error): the ones running,
    // this one included, take its items.
  }
  work();
  for (std::thread& thread : threads) thread.join();
  if (error) std::rethrow_exception(error);
}

}  // namespace fp4moe
