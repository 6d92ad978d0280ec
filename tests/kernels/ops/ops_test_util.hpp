// Helpers shared by the GPU tests of the kernels around the grouped GEMMs
// (tests/kernels/ops/, one binary test_moe_ops): the values that poisoned
// outputs hold, normal random data and a float's bits.
#pragma once

#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

namespace fp4moe::testing {

inline constexpr int32_t kPoisonId = -1;  // what fill_bytes(0xFF) leaves in an int32
inline constexpr uint16_t kPoisonBf16 = 0xFFFF;

inline std::vector<float> random_normal(size_t count, std::mt19937& rng, float stddev = 1.0f) {
  std::normal_distribution<float> dist(0.0f, stddev);
  std::vector<float> out(count);
  for (auto& v : out) v = dist(rng);
  return out;
}

inline uint32_t float_bits(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  return bits;
}

}  // namespace fp4moe::testing
