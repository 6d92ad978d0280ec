// GPU test of the kernels around the grouped GEMMs in sequence
// (src/kernels/ops/): route -> sort -> gather -> finalize captured in a CUDA
// graph and replayed, against the eager run. Skipped with a message where no
// GPU exists.
#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <vector>

#include "fp4moe/reference.hpp"
#include "gpu_test_util.hpp"
#include "kernels/ops/moe_ops.hpp"
#include "kernels/ops/ops_test_util.hpp"

namespace fp4moe {
namespace {

using testing::float_bits;
using testing::random_normal;

// route -> sort -> gather -> finalize_pairs, captured once and replayed: the
// results equal the eager run's (the order of rows within an expert is
// unspecified, so sorted rows are compared per expert as sets).
TEST(MoeOpsGpu, GraphReplayEqualsEager) {
  FP4MOE_REQUIRE_GPU();
  std::mt19937 rng(9);
  constexpr int64_t kTokens = 64, kExperts = 256, kHidden = 256;
  RoutingParams p;
  p.mode = RoutingMode::kNoauxTc;
  p.top_k = 8;
  p.num_groups = 8;
  p.topk_groups = 4;
  p.routed_scaling_factor = 2.5f;
  const int64_t num_pairs = kTokens * p.top_k;
  const DeviceBuffer<float> d_logits(random_normal(kTokens * kExperts, rng));
  const DeviceBuffer<float> d_bias(random_normal(kExperts, rng, 0.1f));
  const DeviceBuffer<uint16_t> d_x(testing::random_bf16(kTokens * kHidden, rng));
  const DeviceBuffer<uint16_t> d_pair_rows(testing::random_bf16(num_pairs * kHidden, rng));  // bf16 (token, slot) rows
  DeviceBuffer<int32_t> d_ids(num_pairs), d_offsets(kExperts + 1), d_token_of_row(num_pairs), d_pair_of_row(num_pairs),
      d_error(std::vector<int32_t>{0}), d_scratch(static_cast<size_t>(kernels::sort_scratch_ints(num_pairs, kExperts)));
  DeviceBuffer<float> d_weights(num_pairs);
  DeviceBuffer<uint16_t> d_sorted(num_pairs * kHidden), d_out(kTokens * kHidden);

  auto forward = [&](cudaStream_t stream) {
    kernels::launch_route(d_logits.get(), d_bias.get(), kTokens, kExperts, p, d_ids.get(), d_weights.get(), stream);
    kernels::launch_sort_by_expert(d_ids.get(), kTokens, p.top_k, kExperts, d_offsets.get(), d_token_of_row.get(),
                                   d_pair_of_row.get(), d_error.get(), d_scratch.get(), stream);
    kernels::launch_gather_rows(d_x.get(), d_token_of_row.get(), d_offsets.get(), kExperts, num_pairs, kHidden,
                                d_sorted.get(), stream);
    kernels::launch_finalize_pairs(d_pair_rows.get(), d_ids.get(), kTokens, p.top_k, kExperts, kHidden, d_out.get(),
                                   stream);
  };
  auto poison = [&] {
    for (auto* b : {&d_ids, &d_offsets, &d_token_of_row, &d_pair_of_row}) b->fill_bytes(0xFF);
    d_weights.fill_bytes(0xFF);
    d_sorted.fill_bytes(0xFF);
    d_out.fill_bytes(0xFF);
  };
  struct Result {
    std::vector<int32_t> ids, offsets;
    std::vector<float> weights;
    std::vector<std::vector<int32_t>> pairs_per_expert;
    std::vector<uint16_t> out;
  };
  auto collect = [&] {
    Result r{d_ids.download(), d_offsets.download(), d_weights.download(), {}, d_out.download()};
    const std::vector<int32_t> pair_of_row = d_pair_of_row.download();
    const std::vector<int32_t> token_of_row = d_token_of_row.download();
    const std::vector<uint16_t> sorted = d_sorted.download();
    const std::vector<uint16_t> x = d_x.download();
    for (int64_t e = 0; e < kExperts; ++e) {
      std::vector<int32_t> pairs(pair_of_row.begin() + r.offsets[e], pair_of_row.begin() + r.offsets[e + 1]);
      std::sort(pairs.begin(), pairs.end());
      r.pairs_per_expert.push_back(pairs);
    }
    for (int64_t row = 0; row < r.offsets[kExperts]; ++row)
      EXPECT_TRUE(std::equal(sorted.begin() + row * kHidden, sorted.begin() + (row + 1) * kHidden,
                             x.begin() + token_of_row[row] * kHidden))
          << "gathered row " << row;
    return r;
  };

  cudaStream_t stream;
  FP4MOE_CUDA_CHECK(cudaStreamCreate(&stream));
  poison();
  forward(stream);
  FP4MOE_CUDA_CHECK(cudaStreamSynchronize(stream));
  const Result eager = collect();
  EXPECT_EQ(eager.offsets[kExperts], num_pairs);

  cudaGraph_t graph;
  cudaGraphExec_t exec;
  FP4MOE_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  forward(stream);
  FP4MOE_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
  FP4MOE_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  for (int replay = 0; replay < 3; ++replay) {
    poison();
    FP4MOE_CUDA_CHECK(cudaGraphLaunch(exec, stream));
    FP4MOE_CUDA_CHECK(cudaStreamSynchronize(stream));
    const Result replayed = collect();
    EXPECT_EQ(replayed.ids, eager.ids) << "replay " << replay;
    EXPECT_EQ(replayed.offsets, eager.offsets) << "replay " << replay;
    EXPECT_EQ(replayed.pairs_per_expert, eager.pairs_per_expert) << "replay " << replay;
    EXPECT_EQ(replayed.out, eager.out) << "replay " << replay;
    std::vector<uint32_t> got_bits, eager_bits;
    for (float w : replayed.weights) got_bits.push_back(float_bits(w));
    for (float w : eager.weights) eager_bits.push_back(float_bits(w));
    EXPECT_EQ(got_bits, eager_bits) << "replay " << replay;
  }
  EXPECT_EQ(d_error.download()[0], 0);
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
}

}  // namespace
}  // namespace fp4moe
