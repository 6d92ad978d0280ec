// SplitMix64 (Steele, Lea & Flood 2014): the project's one seeded generator
// for synthetic data (the demo's layer, the benchmarks' weights, the GPU
// tests' large weights). One add and two multiply-xorshift rounds per 64
// random bits, fast enough to fill gigabytes, and the same stream on every
// platform (std:: distributions are not), so a seed names the same data
// everywhere. Internal (not under include/).
//
// Tested in tests/util/test_splitmix64.cpp (the published stream for seed 0,
// the ranges of uniform() and normal()).
#pragma once

#include <cmath>
#include <cstdint>

namespace fp4moe {

class SplitMix64 {
 public:
  explicit SplitMix64(uint64_t seed) : state_(seed) {}

  uint64_t next() {
    uint64_t z = (state_ += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  double uniform() { return static_cast<double>(next() >> 11) * 0x1.0p-53; }  // [0, 1), 53 bits
  double normal() {                                                           // Box-Muller
    const double u1 = 1.0 - uniform();                                        // (0, 1]
    const double u2 = uniform();
    return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
  }

 private:
  uint64_t state_;
};

}  // namespace fp4moe
