// GPU tests of the finalize reductions (src/kernels/ops/finalize.cu): both
// modes against host loops, bit for bit, with bf16 rounding edges (the
// deterministic mode's bf16 rows summed in fp32, rounded once). Outputs
// are poisoned (0xFF bytes: NaN bf16) before each run so an unwritten element
// fails. Skipped with a message where no GPU exists.
#include <gtest/gtest.h>

#include <algorithm>
#include <initializer_list>
#include <iterator>
#include <random>
#include <string>
#include <vector>

#include "fp4moe/error.hpp"
#include "fp4moe/nvfp4.hpp"
#include "gpu_test_util.hpp"
#include "kernels/ops/moe_ops.hpp"
#include "kernels/ops/ops_test_util.hpp"

namespace fp4moe {
namespace {

using testing::float_bits;
using testing::random_normal;

// The host twin of finalize_pairs: the bf16 rows widened to fp32 and summed
// from 0.0f in slot order, in fp32, then rounded to bf16 (nearest even) once;
// the device must match it bit for bit.
std::vector<uint16_t> host_finalize_pairs(const std::vector<uint16_t>& pair_rows, const std::vector<int32_t>& ids,
                                          int64_t num_tokens, int top_k, int64_t num_experts, int64_t hidden) {
  std::vector<uint16_t> out(static_cast<size_t>(num_tokens * hidden));
  for (int64_t t = 0; t < num_tokens; ++t)
    for (int64_t h = 0; h < hidden; ++h) {
      float sum = 0.0f;
      for (int j = 0; j < top_k; ++j) {
        const int32_t id = ids[static_cast<size_t>(t * top_k + j)];
        if (id >= 0 && id < num_experts)
          sum += bf16_to_float(pair_rows[static_cast<size_t>((t * top_k + j) * hidden + h)]);
      }
      out[static_cast<size_t>(t * hidden + h)] = float_to_bf16(sum);
    }
  return out;
}

// bf16 (token, slot) rows as GEMM2's epilogue writes them: N(0, stddev)
// values rounded to bf16.
std::vector<uint16_t> random_bf16_rows(size_t count, std::mt19937& rng) {
  const std::vector<float> values = random_normal(count, rng);
  std::vector<uint16_t> rows(count);
  std::transform(values.begin(), values.end(), rows.begin(), [](float v) { return float_to_bf16(v); });
  return rows;
}

void expect_bits_equal(const std::vector<uint16_t>& got, const std::vector<uint16_t>& expected, int64_t hidden,
                       const std::string& what) {
  ASSERT_EQ(got.size(), expected.size()) << what;
  int64_t num_bad = 0;
  for (size_t i = 0; i < got.size(); ++i)
    if (got[i] != expected[i] && num_bad++ < 3)
      ADD_FAILURE() << what << ": [" << i / hidden << ", " << i % hidden << "] got 0x" << std::hex << got[i] << " ("
                    << bf16_to_float(got[i]) << "), expected 0x" << expected[i] << " (" << bf16_to_float(expected[i])
                    << ")" << std::dec;
  EXPECT_EQ(num_bad, 0) << what;
}

TEST(MoeOpsGpu, FinalizePairsMatchesHostBitExact) {
  FP4MOE_REQUIRE_GPU();
  std::mt19937 rng(7);
  constexpr int64_t kNumExperts = 64;
  std::uniform_int_distribution<int32_t> any(0, kNumExperts - 1);
  std::uniform_int_distribution<int> percent(0, 99);
  for (int64_t num_tokens : {1, 3, 64, 1000})
    for (int top_k : {1, 2, 4, 8, 32})
      for (int64_t hidden : {4, 12, 256, 2052}) {
        if (num_tokens * top_k * hidden > (int64_t{1} << 23)) continue;  // keep host memory small
        const std::string what = "tokens=" + std::to_string(num_tokens) + " k=" + std::to_string(top_k) +
                                 " hidden=" + std::to_string(hidden);
        std::vector<int32_t> ids(static_cast<size_t>(num_tokens * top_k));
        for (auto& id : ids) {
          const int r = percent(rng);
          id = r < 3 ? -1 : r < 6 ? static_cast<int32_t>(kNumExperts) : any(rng);
        }
        if (num_tokens >= 3)  // a token with no valid slot gets zeros
          std::fill(ids.begin() + top_k, ids.begin() + 2 * top_k, -1);
        std::vector<uint16_t> pair_rows = random_bf16_rows(static_cast<size_t>(num_tokens * top_k * hidden), rng);
        for (size_t p = 0; p < ids.size(); ++p)  // slots never written by a GEMM hold garbage (NaN bf16)
          if (ids[p] < 0 || ids[p] >= kNumExperts)
            std::fill_n(pair_rows.begin() + static_cast<int64_t>(p) * hidden, hidden, uint16_t{0xFFFF});
        const std::vector<uint16_t> expected =
            host_finalize_pairs(pair_rows, ids, num_tokens, top_k, kNumExperts, hidden);

        const DeviceBuffer<uint16_t> d_rows(pair_rows);
        const DeviceBuffer<int32_t> d_ids(ids);
        DeviceBuffer<uint16_t> d_out(static_cast<size_t>(num_tokens * hidden));
        for (int run = 0; run < 3; ++run) {  // the same bits every run
          d_out.fill_bytes(0xFF);
          kernels::launch_finalize_pairs(d_rows.get(), d_ids.get(), num_tokens, top_k, kNumExperts, hidden, d_out.get(),
                                         nullptr);
          FP4MOE_CUDA_CHECK(cudaDeviceSynchronize());
          expect_bits_equal(d_out.download(), expected, hidden, what + " run " + std::to_string(run));
        }
      }
}

// Without ids (the layer with device routing, whose ids are all valid) every
// slot is summed: the same bits as with the ids given.
TEST(MoeOpsGpu, FinalizePairsWithoutIdsSumsEverySlot) {
  FP4MOE_REQUIRE_GPU();
  std::mt19937 rng(9);
  constexpr int64_t kNumExperts = 64;
  std::uniform_int_distribution<int32_t> any(0, kNumExperts - 1);
  for (int64_t num_tokens : {1, 5, 300})
    for (int top_k : {1, 8, 9}) {
      constexpr int64_t kHidden = 6144;
      const std::string what = "tokens=" + std::to_string(num_tokens) + " k=" + std::to_string(top_k);
      std::vector<int32_t> ids(static_cast<size_t>(num_tokens * top_k));
      for (auto& id : ids) id = any(rng);
      const std::vector<uint16_t> pair_rows = random_bf16_rows(static_cast<size_t>(num_tokens * top_k * kHidden), rng);
      const std::vector<uint16_t> expected =
          host_finalize_pairs(pair_rows, ids, num_tokens, top_k, kNumExperts, kHidden);
      const DeviceBuffer<uint16_t> d_rows(pair_rows);
      DeviceBuffer<uint16_t> d_out(static_cast<size_t>(num_tokens * kHidden));
      d_out.fill_bytes(0xFF);
      kernels::launch_finalize_pairs(d_rows.get(), nullptr, num_tokens, top_k, kNumExperts, kHidden, d_out.get(),
                                     nullptr);
      FP4MOE_CUDA_CHECK(cudaDeviceSynchronize());
      expect_bits_equal(d_out.download(), expected, kHidden, what);
    }
}

// The sum is fp32 and rounded to bf16 once, at the end: rows chosen so that
// rounding per slot, or summing from -0, or in another precision, would give
// other bits.
TEST(MoeOpsGpu, FinalizePairsRoundsTheFp32SumOnce) {
  FP4MOE_REQUIRE_GPU();
  constexpr int kTopK = 3;
  constexpr int64_t kHidden = 8, kNumExperts = 4;
  const uint16_t one = 0x3F80, one_up = 0x3F81, half_step = 0x3B80;                 // 1, 1 + 2^-7, 2^-8
  const uint16_t neg_zero = 0x8000, zero = 0x0000, big = 0x7F00, neg_big = 0xFF00;  // 2^127, -2^127
  // [slot][column]
  const uint16_t slots[kTopK][kHidden] = {
      {one, one_up, neg_zero, big, one, one, 0x4000, 0x0001},
      {half_step, half_step, neg_zero, big, 0xBF80, half_step, 0x3B00, 0x0001},
      {half_step, zero, neg_zero, neg_big, zero, zero, 0x3B00, 0x0001},
  };
  const uint16_t expected_bits[kHidden] = {
      0x3F81,  // 1 + 2^-8 + 2^-8 = 1 + 2^-7 in fp32 (per-slot rounding: 1)
      0x3F82,  // 1 + 2^-7 + 2^-8: halfway, to even
      0x0000,  // 0.0f + -0 + -0 + -0 = +0
      0x7F80,  // 2^127 + 2^127 overflows fp32 to inf before -2^127
      0x0000,  // 1 - 1 + 0 (0xBF80: -1)
      0x3F80,  // 1 + 2^-8 + 0: halfway, to even
      0x4000,  // 2 + 2^-9 + 2^-9 = 2 + 2^-8: below halfway of 2's step
      0x0003,  // three of the smallest subnormal (2^-133, 0x3B00: 2^-9)
  };
  std::vector<uint16_t> pair_rows;
  for (const auto& slot : slots) pair_rows.insert(pair_rows.end(), std::begin(slot), std::end(slot));
  const std::vector<int32_t> ids = {0, 1, 2};
  const std::vector<uint16_t> expected(std::begin(expected_bits), std::end(expected_bits));
  ASSERT_EQ(host_finalize_pairs(pair_rows, ids, 1, kTopK, kNumExperts, kHidden), expected);
  const DeviceBuffer<uint16_t> d_rows(pair_rows);
  const DeviceBuffer<int32_t> d_ids(ids);
  DeviceBuffer<uint16_t> d_out(static_cast<size_t>(kHidden));
  for (const int32_t* id_ptr : std::initializer_list<const int32_t*>{d_ids.get(), nullptr}) {
    d_out.fill_bytes(0xFF);
    kernels::launch_finalize_pairs(d_rows.get(), id_ptr, 1, kTopK, kNumExperts, kHidden, d_out.get(), nullptr);
    FP4MOE_CUDA_CHECK(cudaDeviceSynchronize());
    expect_bits_equal(d_out.download(), expected, kHidden, id_ptr ? "with ids" : "without ids");
  }
}

TEST(MoeOpsGpu, FinalizeAccumulatedMatchesHostAndClears) {
  FP4MOE_REQUIRE_GPU();
  std::mt19937 rng(8);
  for (int64_t num_tokens : {1, 3, 64, 1000})
    for (int64_t hidden : {4, 12, 256, 2052}) {
      const std::string what = "tokens=" + std::to_string(num_tokens) + " hidden=" + std::to_string(hidden);
      std::vector<float> accum = random_normal(static_cast<size_t>(num_tokens * hidden), rng, 4.0f);
      // bf16 rounding edges: exact halfway cases (to even), -0, overflow to inf.
      const float edges[] = {1.00390625f, 1.01171875f, -1.00390625f, -0.0f, 3.4e38f, 1e-40f};
      for (size_t i = 0; i < std::size(edges) && i < accum.size(); ++i) accum[i] = edges[i];
      std::vector<uint16_t> expected(accum.size());
      for (size_t i = 0; i < accum.size(); ++i) expected[i] = float_to_bf16(accum[i]);

      DeviceBuffer<float> d_accum(accum);
      DeviceBuffer<uint16_t> d_out(accum.size());
      d_out.fill_bytes(0xFF);
      kernels::launch_finalize_accumulated(d_accum.get(), num_tokens, hidden, d_out.get(), nullptr);
      FP4MOE_CUDA_CHECK(cudaDeviceSynchronize());
      expect_bits_equal(d_out.download(), expected, hidden, what);
      const std::vector<float> after = d_accum.download();
      EXPECT_TRUE(std::all_of(after.begin(), after.end(), [](float v) { return float_bits(v) == 0; }))
          << what << ": accum not cleared to +0";
    }
}

TEST(MoeOpsGpu, FinalizeRejectsBadParameters) {
  FP4MOE_REQUIRE_GPU();
  DeviceBuffer<uint16_t> rows(1024);  // bf16 pair rows
  DeviceBuffer<float> accum(1024);
  DeviceBuffer<int32_t> ids(64);
  DeviceBuffer<uint16_t> out(1024);
  EXPECT_THROW(kernels::launch_finalize_pairs(rows.get(), ids.get(), 2, 2, 8, 6, out.get(), nullptr), Error);
  EXPECT_THROW(
      kernels::launch_finalize_pairs(rows.get(), ids.get(), 2, kernels::kMaxTopK + 1, 64, 8, out.get(), nullptr),
      Error);
  EXPECT_THROW(kernels::launch_finalize_pairs(rows.get(), ids.get(), 2, 0, 8, 8, out.get(), nullptr), Error);
  EXPECT_THROW(kernels::launch_finalize_pairs(rows.get() + 4, ids.get(), 2, 2, 8, 8, out.get(), nullptr), Error);
  EXPECT_THROW(kernels::launch_finalize_pairs(nullptr, ids.get(), 2, 2, 8, 8, out.get(), nullptr), Error);
  EXPECT_THROW(kernels::launch_finalize_accumulated(accum.get(), 2, 6, out.get(), nullptr), Error);
  EXPECT_THROW(kernels::launch_finalize_accumulated(accum.get(), 2, 8, out.get() + 1, nullptr), Error);
  EXPECT_NO_THROW(kernels::launch_finalize_pairs(nullptr, nullptr, 0, 2, 8, 8, nullptr, nullptr));
  EXPECT_NO_THROW(kernels::launch_finalize_accumulated(nullptr, 0, 8, nullptr, nullptr));
}

}  // namespace
}  // namespace fp4moe
