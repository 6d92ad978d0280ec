// Helpers shared by the GPU tests: device detection with a visible skip,
// random NVFP4 data (also a fast generator for gigabytes of weights) and
// result comparison. Device memory is fp4moe::DeviceBuffer
// (src/util/device_buffer.hpp), included here for every GPU test.
#pragma once

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "fp4moe/cuda_check.hpp"
#include "fp4moe/modelopt.hpp"
#include "fp4moe/nvfp4.hpp"
#include "util/device_buffer.hpp"
#include "util/splitmix64.hpp"

namespace fp4moe::testing {

inline bool has_cuda_device() { return cuda_unavailable_reason().empty(); }

// FP4MOE_EXPECT_GPU=1 (set by the scripts that run the suite on a GPU
// machine): a missing or broken GPU fails the GPU tests instead of skipping
// them.
inline bool gpu_expected() {
  const char* v = std::getenv("FP4MOE_EXPECT_GPU");
  return v != nullptr && *v != '\0' && std::string(v) != "0";
}

// Skips the current test, visibly and with the CUDA error, where no GPU can
// be used; fails it instead under FP4MOE_EXPECT_GPU=1.
#define FP4MOE_REQUIRE_GPU()                                                             \
  do {                                                                                   \
    const std::string fp4moe_gpu_why = ::fp4moe::cuda_unavailable_reason();              \
    if (!fp4moe_gpu_why.empty()) {                                                       \
      if (::fp4moe::testing::gpu_expected())                                             \
        FAIL() << "FP4MOE_EXPECT_GPU is set but no GPU can be used: " << fp4moe_gpu_why; \
      GTEST_SKIP() << "GPU test skipped: " << fp4moe_gpu_why;                            \
    }                                                                                    \
  } while (0)

// A random NVFP4 matrix drawn in the quantised domain: every fp4 code, block
// scales spread over [2^-9 .. 448] with extra weight on the sane middle, and a
// given global scale.
inline Nvfp4Matrix random_nvfp4(int64_t rows, int64_t cols, float global_scale, std::mt19937& rng) {
  Nvfp4Matrix m;
  m.rows = rows;
  m.cols = cols;
  m.global_scale = global_scale;
  m.packed.resize(static_cast<size_t>(rows * cols / 2));
  m.scales.resize(static_cast<size_t>(rows * cols / 16));
  std::uniform_int_distribution<int> byte(0, 255);
  std::uniform_int_distribution<int> mid_scale(0x28, 0x48);  // 0.125 .. 2.0
  std::uniform_int_distribution<int> any_scale(0x01, 0x7E);  // every finite positive code
  for (auto& b : m.packed) b = static_cast<uint8_t>(byte(rng));
  for (auto& s : m.scales) s = static_cast<uint8_t>(byte(rng) < 32 ? any_scale(rng) : mid_scale(rng));
  return m;
}

// A layer of random_nvfp4 experts (gate and up [inter, hidden], down
// [hidden, inter], drawn in that order per expert), gate and up sharing one
// global scale as ModelOpt's exports do; no biases.
inline MoeWeights random_moe_weights(int64_t num_experts, int64_t hidden, int64_t inter, float gate_up_scale,
                                     float down_scale, std::mt19937& rng) {
  MoeWeights w;
  w.num_experts = num_experts;
  w.hidden = hidden;
  w.inter = inter;
  for (int64_t e = 0; e < num_experts; ++e) {
    ExpertWeights ex;
    ex.gate = random_nvfp4(inter, hidden, gate_up_scale, rng);
    ex.up = random_nvfp4(inter, hidden, gate_up_scale, rng);
    ex.down = random_nvfp4(hidden, inter, down_scale, rng);
    w.experts.push_back(std::move(ex));
  }
  return w;
}

// Fills data[0, count) with random bytes from a SplitMix64 stream seeded by
// `seed` (src/util/splitmix64.hpp): fast enough for gigabytes of test
// weights, where mt19937 per byte takes minutes.
inline void fill_random_bytes(uint8_t* data, size_t count, uint64_t seed) {
  SplitMix64 rng(seed);
  size_t i = 0;
  for (; i + 8 <= count; i += 8) {
    const uint64_t word = rng.next();
    std::memcpy(data + i, &word, 8);
  }
  if (i < count) {
    const uint64_t word = rng.next();
    std::memcpy(data + i, &word, count - i);
  }
}

// A random NVFP4 matrix for large layers: every fp4 code, block scales only in
// the sane middle (e4m3 codes 0x28..0x48, 0.125 .. 2.0) so sums of thousands
// of products stay far from overflow. Deterministic in `seed`; single-threaded
// (callers parallelise over matrices).
inline Nvfp4Matrix fast_random_nvfp4(int64_t rows, int64_t cols, float global_scale, uint64_t seed) {
  constexpr uint32_t kLowScale = 0x28, kNumScales = 0x48 - 0x28 + 1;
  Nvfp4Matrix m;
  m.rows = rows;
  m.cols = cols;
  m.global_scale = global_scale;
  m.packed.resize(static_cast<size_t>(rows * cols / 2));
  m.scales.resize(static_cast<size_t>(rows * cols / 16));
  fill_random_bytes(m.packed.data(), m.packed.size(), seed);
  fill_random_bytes(m.scales.data(), m.scales.size(), seed ^ 0x5CA1E5ull);
  for (auto& s : m.scales) s = static_cast<uint8_t>(kLowScale + ((s * kNumScales) >> 8));
  return m;
}

inline std::vector<uint16_t> random_bf16(size_t count, std::mt19937& rng, float stddev = 1.0f) {
  std::normal_distribution<float> dist(0.0f, stddev);
  std::vector<uint16_t> out(count);
  for (auto& v : out) v = float_to_bf16(dist(rng));
  return out;
}

struct Comparison {
  double rel_err = 0.0;            // ||out - ref|| / ||ref||
  int64_t num_bad = 0;             // elements outside atol + rtol |ref|
  int64_t num_unwritten = 0;       // NaN (poisoned and never written)
  int64_t num_bad_rows = 0;        // rows holding at least one bad element
  double worst_row_rel_err = 0.0;  // the largest ||out - ref|| / ||ref|| of one row
  std::string first_bad;           // the first few mismatches with indices
};

// out/ref are [rows, cols]; atol is relative to the rms of ref.
inline Comparison compare(const std::vector<float>& out, const std::vector<double>& ref, int64_t cols,
                          double rtol = 2e-2, double atol_rms = 2e-2) {
  Comparison c;
  double num = 0.0, den = 0.0;
  for (size_t i = 0; i < ref.size(); ++i) den += ref[i] * ref[i];
  const double rms = ref.empty() ? 0.0 : std::sqrt(den / static_cast<double>(ref.size()));
  int shown = 0;
  int64_t bad_row = -1;
  double row_num = 0.0, row_den = 0.0;
  for (size_t i = 0; i < ref.size(); ++i) {
    if (i % static_cast<size_t>(cols) == 0) row_num = row_den = 0.0;
    row_den += ref[i] * ref[i];
    if (std::isnan(out[i])) {
      ++c.num_unwritten;
      if (shown++ < 5)
        c.first_bad += "  [" + std::to_string(i / cols) + ", " + std::to_string(i % cols) + "] unwritten (NaN), ref " +
                       std::to_string(ref[i]) + "\n";
      continue;
    }
    const double d = out[i] - ref[i];
    num += d * d;
    row_num += d * d;
    if ((i + 1) % static_cast<size_t>(cols) == 0 && row_den > 0)
      c.worst_row_rel_err = std::max(c.worst_row_rel_err, std::sqrt(row_num / row_den));
    if (std::fabs(d) > atol_rms * rms + rtol * std::fabs(ref[i])) {
      ++c.num_bad;
      const int64_t row = static_cast<int64_t>(i) / cols;
      if (row != bad_row) {
        ++c.num_bad_rows;
        bad_row = row;
      }
      if (shown++ < 5)
        c.first_bad += "  [" + std::to_string(i / cols) + ", " + std::to_string(i % cols) + "] got " +
                       std::to_string(out[i]) + ", ref " + std::to_string(ref[i]) + "\n";
    }
  }
  c.rel_err = den > 0 ? std::sqrt(num / den) : std::sqrt(num);
  return c;
}

}  // namespace fp4moe::testing
