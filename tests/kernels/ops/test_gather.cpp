// GPU tests of the row gathers (src/kernels/ops/gather.cu): the bf16 gather
// against a host loop (bit-exact), and the W4A4 quantising gather against the
// CPU quantiser (bit-exact, and over every bf16 value for every block scale).
// Outputs are poisoned (0xFF bytes: NaN bf16) before each run so an unwritten
// element fails. Skipped with a message where no GPU exists.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "fp4moe/error.hpp"
#include "fp4moe/nvfp4.hpp"
#include "fp4moe/nvfp4_activation.hpp"
#include "gpu_test_util.hpp"
#include "kernels/ops/moe_ops.hpp"
#include "kernels/ops/ops_test_util.hpp"

namespace fp4moe {
namespace {

using testing::kPoisonBf16;
using testing::kPoisonId;

TEST(MoeOpsGpu, GatherRows) {
  FP4MOE_REQUIRE_GPU();
  std::mt19937 rng(6);
  constexpr int64_t kNumExperts = 16;
  for (int64_t num_tokens : {1, 3, 64, 1000})
    for (int64_t hidden : {8, 64, 1032, 7168})
      for (int top_k : {1, 8}) {
        const std::string what = "tokens=" + std::to_string(num_tokens) + " hidden=" + std::to_string(hidden) +
                                 " k=" + std::to_string(top_k);
        const int64_t num_rows = num_tokens * top_k;
        // Some rows at the end are not placed (as after out-of-range ids).
        const int64_t num_placed = num_rows - num_rows / 5;
        std::uniform_int_distribution<int32_t> token(0, static_cast<int32_t>(num_tokens - 1));
        std::vector<int32_t> token_of_row(static_cast<size_t>(num_rows), kPoisonId);
        for (int64_t r = 0; r < num_placed; ++r) token_of_row[static_cast<size_t>(r)] = token(rng);
        std::vector<int32_t> offsets(kNumExperts + 1, 0);
        for (int64_t e = 1; e <= kNumExperts; ++e)
          offsets[static_cast<size_t>(e)] = static_cast<int32_t>(num_placed * e / kNumExperts);
        const std::vector<uint16_t> x = testing::random_bf16(static_cast<size_t>(num_tokens * hidden), rng);

        const DeviceBuffer<uint16_t> d_x(x);
        const DeviceBuffer<int32_t> d_token_of_row(token_of_row), d_offsets(offsets);
        DeviceBuffer<uint16_t> d_sorted(static_cast<size_t>(num_rows * hidden));
        d_sorted.fill_bytes(0xFF);
        kernels::launch_gather_rows(d_x.get(), d_token_of_row.get(), d_offsets.get(), kNumExperts, num_rows, hidden,
                                    d_sorted.get(), nullptr);
        FP4MOE_CUDA_CHECK(cudaDeviceSynchronize());
        const std::vector<uint16_t> sorted = d_sorted.download();
        int64_t num_bad = 0;
        for (int64_t r = 0; r < num_rows && num_bad < 3; ++r) {
          const uint16_t* got = sorted.data() + r * hidden;
          if (r < num_placed) {
            const uint16_t* expected = x.data() + token_of_row[static_cast<size_t>(r)] * hidden;
            if (!std::equal(got, got + hidden, expected)) {
              ++num_bad;
              ADD_FAILURE() << what << ": row " << r << " differs from token " << token_of_row[static_cast<size_t>(r)]
                            << "'s row";
            }
          } else if (std::any_of(got, got + hidden, [](uint16_t v) { return v != kPoisonBf16; })) {
            ++num_bad;
            ADD_FAILURE() << what << ": row " << r << " past offsets[E] was written";
          }
        }
      }
}

TEST(MoeOpsGpu, GatherRejectsBadParameters) {
  FP4MOE_REQUIRE_GPU();
  DeviceBuffer<uint16_t> x(1024), sorted(1024);
  DeviceBuffer<int32_t> idx(64);
  EXPECT_THROW(kernels::launch_gather_rows(x.get(), idx.get(), idx.get(), 8, 4, 12, sorted.get(), nullptr), Error);
  EXPECT_THROW(kernels::launch_gather_rows(x.get() + 1, idx.get(), idx.get(), 8, 4, 16, sorted.get(), nullptr), Error);
  EXPECT_THROW(kernels::launch_gather_rows(x.get(), nullptr, idx.get(), 8, 4, 16, sorted.get(), nullptr), Error);
  EXPECT_NO_THROW(kernels::launch_gather_rows(nullptr, nullptr, nullptr, 8, 0, 16, nullptr, nullptr));
}

// W4A4: each placed row quantised with its expert's input_scale, bit for bit
// as the CPU quantiser (nvfp4_activation.hpp) does it, with empty experts
// between busy ones, outliers past the calibrated range, zeros, negative
// zeros, bf16 subnormals, a NaN and infinities in some rows.
TEST(MoeOpsGpu, GatherRowsFp4MatchesTheCpuQuantiserBitExact) {
  FP4MOE_REQUIRE_GPU();
  std::mt19937 rng(16);
  constexpr int64_t kNumExperts = 16;
  std::vector<float> input_scales(kNumExperts);
  for (int64_t e = 0; e < kNumExperts; ++e)  // calibrated amax 0.5 .. 8 (N(0, 1) inputs: some clamp)
    input_scales[static_cast<size_t>(e)] = (0.5f + 0.5f * static_cast<float>(e)) / 2688.0f;
  for (int64_t num_tokens : {1, 3, 64, 1000})
    for (int64_t hidden : {16, 64, 1040, 7168})
      for (int top_k : {1, 8}) {
        const std::string what = "tokens=" + std::to_string(num_tokens) + " hidden=" + std::to_string(hidden) +
                                 " k=" + std::to_string(top_k);
        const int64_t num_rows = num_tokens * top_k;
        const int64_t num_placed = num_rows - num_rows / 5;  // the rest not placed
        std::uniform_int_distribution<int32_t> token(0, static_cast<int32_t>(num_tokens - 1));
        std::vector<int32_t> token_of_row(static_cast<size_t>(num_rows), kPoisonId);
        for (int64_t r = 0; r < num_placed; ++r) token_of_row[static_cast<size_t>(r)] = token(rng);
        // Experts 2, 3 and 9 get no rows (their offsets repeat).
        std::vector<int32_t> offsets(kNumExperts + 1, 0);
        for (int64_t e = 1; e <= kNumExperts; ++e) {
          const int64_t busy = e - (e > 2) - (e > 3) - (e > 9);  // busy experts before e
          offsets[static_cast<size_t>(e)] = static_cast<int32_t>(num_placed * busy / (kNumExperts - 3));
        }
        std::vector<uint16_t> x = testing::random_bf16(static_cast<size_t>(num_tokens * hidden), rng);
        std::uniform_int_distribution<size_t> any(0, x.size() - 1);
        for (int i = 0; i < 8; ++i) x[any(rng)] = float_to_bf16(i % 2 ? -300.0f : 1e5f);  // outliers
        for (int i = 0; i < 8; ++i) x[any(rng)] = i % 2 ? 0x8000 : 0x0000;                // +-0
        for (int i = 0; i < 4; ++i) x[any(rng)] = 0x0003;                                 // subnormal
        if (num_tokens >= 64) {
          x[any(rng)] = 0x7FC0;  // NaN: its block dequantises to NaN
          x[any(rng)] = 0x7F80;  // +inf: saturates
          x[any(rng)] = 0xFF80;  // -inf
        }
        // Expected rows from the CPU quantiser; the expert of row r is the
        // e with offsets[e] <= r < offsets[e + 1].
        std::vector<uint16_t> expected(static_cast<size_t>(num_placed * hidden));
        for (int64_t e = 0; e < kNumExperts; ++e)
          for (int64_t r = offsets[static_cast<size_t>(e)]; r < offsets[static_cast<size_t>(e) + 1]; ++r)
            for (int64_t b = 0; b < hidden; b += 16) {
              float block[16], unscaled[16];
              uint8_t codes[16];
              for (int i = 0; i < 16; ++i)
                block[i] = bf16_to_float(x[static_cast<size_t>(token_of_row[static_cast<size_t>(r)] * hidden + b + i)]);
              nvfp4_act_quantize_block(block, input_scales[static_cast<size_t>(e)], codes, unscaled);
              for (int i = 0; i < 16; ++i)
                expected[static_cast<size_t>(r * hidden + b + i)] = float_to_bf16(unscaled[i]);
            }

        const DeviceBuffer<uint16_t> d_x(x);
        const DeviceBuffer<int32_t> d_token_of_row(token_of_row), d_offsets(offsets);
        const DeviceBuffer<float> d_scales(input_scales);
        DeviceBuffer<uint16_t> d_sorted(static_cast<size_t>(num_rows * hidden));
        d_sorted.fill_bytes(0xFF);
        kernels::launch_gather_rows_fp4(d_x.get(), d_token_of_row.get(), d_offsets.get(), kNumExperts, num_rows, hidden,
                                        d_scales.get(), d_sorted.get(), nullptr);
        FP4MOE_CUDA_CHECK(cudaDeviceSynchronize());
        const std::vector<uint16_t> sorted = d_sorted.download();
        int64_t num_bad = 0;
        for (int64_t i = 0; i < num_placed * hidden && num_bad < 5; ++i) {
          const uint16_t got = sorted[static_cast<size_t>(i)], want = expected[static_cast<size_t>(i)];
          const bool both_nan = std::isnan(bf16_to_float(got)) && std::isnan(bf16_to_float(want));
          if (got == want || both_nan) continue;
          ++num_bad;
          const int64_t r = i / hidden;
          ADD_FAILURE() << what << ": row " << r << " (token " << token_of_row[static_cast<size_t>(r)] << ") element "
                        << i % hidden << ": got bf16 0x" << std::hex << got << ", expected 0x" << want << std::dec
                        << " (" << bf16_to_float(got) << " vs " << bf16_to_float(want) << "; input "
                        << bf16_to_float(
                               x[static_cast<size_t>(token_of_row[static_cast<size_t>(r)] * hidden + i % hidden)])
                        << ")";
        }
        for (int64_t i = num_placed * hidden; i < num_rows * hidden && num_bad < 5; ++i)
          if (sorted[static_cast<size_t>(i)] != kPoisonBf16) {
            ++num_bad;
            ADD_FAILURE() << what << ": row " << i / hidden << " past offsets[E] was written";
          }
      }
}

// The GPU quantiser's packed path (bf16 thresholds, exact bf16 FMAs) against
// the CPU quantiser for every bf16 value a block can hold: per (input_scale,
// block amax) case, one expert whose rows are blocks of that amax followed by
// 15 values, all bf16 magnitudes <= amax with both signs. The amaxes give
// every e4m3 block scale from the smallest subnormal to 448 (and the clamps
// at both ends); two input scales put the divisor outside [2^-100, 2^100],
// where the kernel applies the rule as written.
TEST(MoeOpsGpu, GatherRowsFp4EveryBf16ValueMatchesTheCpuQuantiser) {
  FP4MOE_REQUIRE_GPU();
  constexpr int64_t kHidden = 1024;
  constexpr int64_t kBlocksPerRow = kHidden / 16;
  std::vector<float> input_scales;
  std::vector<float> amaxes;
  for (float s : {1.0f / 2688.0f, 0.37f, 3.0e-2f / 2688.0f, 1e-33f, 1e29f}) {
    const bool ordinary = s > 1e-20f && s < 1e20f;
    for (int code = 1; code <= 0x7E; code += ordinary ? 1 : 25) {
      const float sf = e4m3_to_float(static_cast<uint8_t>(code));
      // An amax whose block scale is `code` (6 s sf rounded to bf16 may land
      // on a neighbour; either way a scale of that size is covered).
      input_scales.push_back(s);
      amaxes.push_back(bf16_to_float(float_to_bf16(6.0f * s * sf)));
    }
    input_scales.push_back(s);  // past 448 * 6 s: the scale clamps at 448
    amaxes.push_back(bf16_to_float(float_to_bf16(1e4f * s)));
  }
  const int64_t num_experts = static_cast<int64_t>(amaxes.size());
  std::vector<uint16_t> x;
  std::vector<int32_t> offsets = {0};
  for (int64_t e = 0; e < num_experts; ++e) {
    const uint16_t amax_bits = float_to_bf16(amaxes[static_cast<size_t>(e)]);
    std::vector<uint16_t> values;
    for (uint32_t m = 0; m <= amax_bits; ++m) {
      values.push_back(static_cast<uint16_t>(m));
      values.push_back(static_cast<uint16_t>(m | 0x8000u));
    }
    const int64_t blocks = (static_cast<int64_t>(values.size()) + 14) / 15;
    const int64_t rows = (blocks + kBlocksPerRow - 1) / kBlocksPerRow;
    for (int64_t b = 0; b < rows * kBlocksPerRow; ++b) {
      x.push_back(amax_bits);
      for (int64_t i = 0; i < 15; ++i) {
        const size_t v = static_cast<size_t>(b * 15 + i);
        x.push_back(v < values.size() ? values[v] : 0);
      }
    }
    offsets.push_back(offsets.back() + static_cast<int32_t>(rows));
  }
  const int64_t num_rows = offsets.back();
  std::vector<int32_t> token_of_row(static_cast<size_t>(num_rows));
  std::iota(token_of_row.begin(), token_of_row.end(), 0);
  std::vector<uint16_t> expected(x.size());
  for (int64_t e = 0; e < num_experts; ++e) {
    const int64_t first = offsets[static_cast<size_t>(e)] * kBlocksPerRow;
    const int64_t end = offsets[static_cast<size_t>(e) + 1] * kBlocksPerRow;
    for (int64_t b = first; b < end; ++b) {
      float block[16], unscaled[16];
      uint8_t codes[16];
      for (int i = 0; i < 16; ++i) block[i] = bf16_to_float(x[static_cast<size_t>(b * 16 + i)]);
      nvfp4_act_quantize_block(block, input_scales[static_cast<size_t>(e)], codes, unscaled);
      for (int i = 0; i < 16; ++i) expected[static_cast<size_t>(b * 16 + i)] = float_to_bf16(unscaled[i]);
    }
  }

  const DeviceBuffer<uint16_t> d_x(x);
  const DeviceBuffer<int32_t> d_token_of_row(token_of_row), d_offsets(offsets);
  const DeviceBuffer<float> d_scales(input_scales);
  DeviceBuffer<uint16_t> d_sorted(x.size());
  d_sorted.fill_bytes(0xFF);  // a NaN that no expected value equals: an unwritten element fails
  kernels::launch_gather_rows_fp4(d_x.get(), d_token_of_row.get(), d_offsets.get(), num_experts, num_rows, kHidden,
                                  d_scales.get(), d_sorted.get(), nullptr);
  FP4MOE_CUDA_CHECK(cudaDeviceSynchronize());
  const std::vector<uint16_t> sorted = d_sorted.download();
  int64_t num_bad = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    if (sorted[i] == expected[i]) continue;
    if (++num_bad > 5) continue;
    const size_t e = static_cast<size_t>(
        std::upper_bound(offsets.begin(), offsets.end(), static_cast<int32_t>(i / kHidden)) - offsets.begin() - 1);
    ADD_FAILURE() << "input_scale " << input_scales[e] << ", block amax " << amaxes[e] << ": input bf16 0x" << std::hex
                  << x[i] << " gave 0x" << sorted[i] << ", expected 0x" << expected[i] << std::dec;
  }
  EXPECT_EQ(num_bad, 0) << "of " << x.size() << " elements in " << num_experts << " (input_scale, amax) cases";
}

TEST(MoeOpsGpu, GatherRowsFp4RejectsBadParameters) {
  FP4MOE_REQUIRE_GPU();
  DeviceBuffer<uint16_t> x(1024), sorted(1024);
  DeviceBuffer<int32_t> idx(64);
  DeviceBuffer<float> scales(8);
  EXPECT_THROW(
      kernels::launch_gather_rows_fp4(x.get(), idx.get(), idx.get(), 8, 4, 24, scales.get(), sorted.get(), nullptr),
      Error);  // hidden not a multiple of 16
  EXPECT_THROW(kernels::launch_gather_rows_fp4(x.get(), idx.get(), idx.get(), 8, 4, 16, nullptr, sorted.get(), nullptr),
               Error);  // no input scales
  EXPECT_THROW(
      kernels::launch_gather_rows_fp4(x.get() + 1, idx.get(), idx.get(), 8, 4, 16, scales.get(), sorted.get(), nullptr),
      Error);
  // More experts than a layer has (kMaxExperts = 512).
  EXPECT_THROW(
      kernels::launch_gather_rows_fp4(x.get(), idx.get(), idx.get(), 513, 4, 16, scales.get(), sorted.get(), nullptr),
      Error);
  EXPECT_NO_THROW(kernels::launch_gather_rows_fp4(nullptr, nullptr, nullptr, 8, 0, 16, nullptr, nullptr, nullptr));
}

}  // namespace
}  // namespace fp4moe
