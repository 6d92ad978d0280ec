// GPU tests of the finalize reductions (src/kernels/ops/finalize.cu): both
// modes against host loops, bit for bit, with bf16 rounding edges. Outputs
// are poisoned (0xFF bytes: NaN bf16) before each run so an unwritten element
// fails. Skipped with a message where no GPU exists.
#include <gtest/gtest.h>

#include <algorithm>
#include <iterator>
#include <limits>
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

// The host twin of finalize_pairs: fp32 from 0.0f in slot order, then bf16
// round-to-nearest-even; the device must match it bit for bit.
std::vector<uint16_t> host_finalize_pairs(const std::vector<float>& pair_rows, const std::vector<int32_t>& ids,
                                          int64_t num_tokens, int top_k, int64_t num_experts, int64_t hidden) {
  std::vector<uint16_t> out(static_cast<size_t>(num_tokens * hidden));
  for (int64_t t = 0; t < num_tokens; ++t)
    for (int64_t h = 0; h < hidden; ++h) {
      float sum = 0.0f;
      for (int j = 0; j < top_k; ++j) {
        const int32_t id = ids[static_cast<size_t>(t * top_k + j)];
        if (id >= 0 && id < num_experts) sum += pair_rows[static_cast<size_t>((t * top_k + j) * hidden + h)];
      }
      out[static_cast<size_t>(t * hidden + h)] = float_to_bf16(sum);
    }
  return out;
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
        std::vector<float> pair_rows = random_normal(static_cast<size_t>(num_tokens * top_k * hidden), rng);
        for (size_t p = 0; p < ids.size(); ++p)  // slots never written by a GEMM hold garbage
          if (ids[p] < 0 || ids[p] >= kNumExperts)
            std::fill_n(pair_rows.begin() + static_cast<int64_t>(p) * hidden, hidden,
                        std::numeric_limits<float>::quiet_NaN());
        const std::vector<uint16_t> expected =
            host_finalize_pairs(pair_rows, ids, num_tokens, top_k, kNumExperts, hidden);

        const DeviceBuffer<float> d_rows(pair_rows);
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
      const std::vector<float> pair_rows = random_normal(static_cast<size_t>(num_tokens * top_k * kHidden), rng);
      const std::vector<uint16_t> expected =
          host_finalize_pairs(pair_rows, ids, num_tokens, top_k, kNumExperts, kHidden);
      const DeviceBuffer<float> d_rows(pair_rows);
      DeviceBuffer<uint16_t> d_out(static_cast<size_t>(num_tokens * kHidden));
      d_out.fill_bytes(0xFF);
      kernels::launch_finalize_pairs(d_rows.get(), nullptr, num_tokens, top_k, kNumExperts, kHidden, d_out.get(),
                                     nullptr);
      FP4MOE_CUDA_CHECK(cudaDeviceSynchronize());
      expect_bits_equal(d_out.download(), expected, kHidden, what);
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
  DeviceBuffer<float> rows(1024);
  DeviceBuffer<int32_t> ids(64);
  DeviceBuffer<uint16_t> out(1024);
  EXPECT_THROW(kernels::launch_finalize_pairs(rows.get(), ids.get(), 2, 2, 8, 6, out.get(), nullptr), Error);
  EXPECT_THROW(
      kernels::launch_finalize_pairs(rows.get(), ids.get(), 2, kernels::kMaxTopK + 1, 64, 8, out.get(), nullptr),
      Error);
  EXPECT_THROW(kernels::launch_finalize_pairs(rows.get(), ids.get(), 2, 0, 8, 8, out.get(), nullptr), Error);
  EXPECT_THROW(kernels::launch_finalize_pairs(rows.get() + 1, ids.get(), 2, 2, 8, 8, out.get(), nullptr), Error);
  EXPECT_THROW(kernels::launch_finalize_pairs(nullptr, ids.get(), 2, 2, 8, 8, out.get(), nullptr), Error);
  EXPECT_THROW(kernels::launch_finalize_accumulated(rows.get(), 2, 6, out.get(), nullptr), Error);
  EXPECT_THROW(kernels::launch_finalize_accumulated(rows.get(), 2, 8, out.get() + 1, nullptr), Error);
  EXPECT_NO_THROW(kernels::launch_finalize_pairs(nullptr, nullptr, 0, 2, 8, 8, nullptr, nullptr));
  EXPECT_NO_THROW(kernels::launch_finalize_accumulated(nullptr, 0, 8, nullptr, nullptr));
}

}  // namespace
}  // namespace fp4moe
