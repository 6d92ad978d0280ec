// GPU tests of the sort by expert (src/kernels/ops/sort.cu) and of routing
// and sort in one call (launch_route_and_sort, src/kernels/ops/routing.cu):
// the sort on random, skewed, single-expert, sparse, absent and out-of-range
// ids checked against every property of moe_ops.hpp's contract; the fused
// kernel's ids, weights and sort against launch_route's, with and without
// shared slots. Outputs are poisoned (0xFF bytes) before each run so an
// unwritten element fails. Skipped with a message where no GPU exists.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "fp4moe/error.hpp"
#include "fp4moe/nvfp4.hpp"
#include "fp4moe/reference.hpp"
#include "gpu_test_util.hpp"
#include "kernels/ops/moe_ops.hpp"
#include "kernels/ops/ops_test_util.hpp"

namespace fp4moe {
namespace {

using testing::float_bits;
using testing::kPoisonId;
using testing::random_normal;

enum class IdPattern { kRandom, kSkewed, kAllOneExpert, kSparse, kWithOutOfRange };

const char* to_string(IdPattern pattern) {
  switch (pattern) {
    case IdPattern::kRandom:
      return "random";
    case IdPattern::kSkewed:
      return "skewed";
    case IdPattern::kAllOneExpert:
      return "all-one-expert";
    case IdPattern::kSparse:
      return "sparse";
    case IdPattern::kWithOutOfRange:
      return "with-out-of-range";
  }
  return "?";
}

std::vector<int32_t> make_ids(IdPattern pattern, int64_t num_pairs, int64_t num_experts, std::mt19937& rng) {
  std::uniform_int_distribution<int32_t> any(0, static_cast<int32_t>(num_experts - 1));
  std::uniform_int_distribution<int> percent(0, 99);
  const int32_t hot = any(rng);
  std::vector<int32_t> ids(static_cast<size_t>(num_pairs));
  for (auto& id : ids) {
    switch (pattern) {
      case IdPattern::kRandom:
        id = any(rng);
        break;
      case IdPattern::kSkewed:
        id = percent(rng) < 90 ? hot : any(rng);
        break;
      case IdPattern::kAllOneExpert:
        id = hot;
        break;
      case IdPattern::kSparse:
        id = (any(rng) / 4) * 4;
        break;  // 3 of 4 experts get nothing
      case IdPattern::kWithOutOfRange: {
        const int r = percent(rng);
        id = r < 3 ? -1 : r < 6 ? static_cast<int32_t>(num_experts) : any(rng);
        break;
      }
    }
  }
  return ids;
}

// Checks a sort's outputs (downloaded; rows poisoned before the run) against
// every property of moe_ops.hpp's contract for `ids`.
void verify_sort(const std::vector<int32_t>& ids, int64_t num_tokens, int top_k, int64_t num_experts,
                 const std::vector<int32_t>& offsets, const std::vector<int32_t>& token_of_row,
                 const std::vector<int32_t>& pair_of_row, const std::string& what) {
  const int64_t num_pairs = num_tokens * top_k;
  std::vector<int32_t> expected_offsets(static_cast<size_t>(num_experts + 1), 0);
  for (int32_t id : ids)
    if (id >= 0 && id < num_experts) ++expected_offsets[static_cast<size_t>(id) + 1];
  std::partial_sum(expected_offsets.begin(), expected_offsets.end(), expected_offsets.begin());
  ASSERT_EQ(offsets, expected_offsets) << what;
  const int64_t num_placed = expected_offsets.back();
  std::vector<char> seen(static_cast<size_t>(num_pairs), 0);
  int64_t expert = 0, num_bad = 0;
  auto report = [&](int64_t row, const std::string& why) {
    if (num_bad++ < 3) ADD_FAILURE() << what << ": row " << row << ": " << why;
  };
  for (int64_t row = 0; row < num_placed; ++row) {
    while (offsets[static_cast<size_t>(expert) + 1] <= row) ++expert;
    const int32_t pair = pair_of_row[static_cast<size_t>(row)];
    if (pair < 0 || pair >= num_pairs) {
      report(row, "pair " + std::to_string(pair) + " out of range");
      continue;
    }
    if (seen[static_cast<size_t>(pair)]++) report(row, "pair " + std::to_string(pair) + " placed twice");
    if (ids[static_cast<size_t>(pair)] != expert)
      report(row, "pair " + std::to_string(pair) + " has expert " + std::to_string(ids[static_cast<size_t>(pair)]) +
                      ", the row is expert " + std::to_string(expert) + "'s");
    if (token_of_row[static_cast<size_t>(row)] != pair / top_k)
      report(row, "token " + std::to_string(token_of_row[static_cast<size_t>(row)]) +
                      ", expected pair / top_k = " + std::to_string(pair / top_k));
  }
  // Rows past offsets[E] are left unwritten.
  for (int64_t row = num_placed; row < num_pairs; ++row)
    if (pair_of_row[static_cast<size_t>(row)] != kPoisonId || token_of_row[static_cast<size_t>(row)] != kPoisonId)
      report(row, "written past offsets[E] = " + std::to_string(num_placed));
  EXPECT_EQ(num_bad, 0) << what;
}

// Runs the sort and checks it (verify_sort) and the error word.
void check_sort(const std::vector<int32_t>& ids, int64_t num_tokens, int top_k, int64_t num_experts,
                const std::string& what) {
  const int64_t num_pairs = num_tokens * top_k;
  // kAbsentSlot (-1) is skipped without an error; every other id outside the range is one.
  const bool has_out_of_range = std::any_of(
      ids.begin(), ids.end(), [&](int32_t id) { return (id < 0 && id != kernels::kAbsentSlot) || id >= num_experts; });
  const DeviceBuffer<int32_t> d_ids(ids);
  DeviceBuffer<int32_t> d_offsets(static_cast<size_t>(num_experts + 1));
  DeviceBuffer<int32_t> d_token_of_row(static_cast<size_t>(num_pairs));
  DeviceBuffer<int32_t> d_pair_of_row(static_cast<size_t>(num_pairs));
  DeviceBuffer<int32_t> d_error(std::vector<int32_t>{1});  // a GEMM bit already set stays set
  DeviceBuffer<int32_t> d_scratch(static_cast<size_t>(kernels::sort_scratch_ints(num_pairs, num_experts)));
  d_offsets.fill_bytes(0xFF);
  d_token_of_row.fill_bytes(0xFF);
  d_pair_of_row.fill_bytes(0xFF);
  d_scratch.fill_bytes(0xFF);  // every count is written before it is read
  kernels::launch_sort_by_expert(d_ids.get(), num_tokens, top_k, num_experts, d_offsets.get(), d_token_of_row.get(),
                                 d_pair_of_row.get(), d_error.get(), d_scratch.get(), nullptr);
  FP4MOE_CUDA_CHECK(cudaDeviceSynchronize());
  verify_sort(ids, num_tokens, top_k, num_experts, d_offsets.download(), d_token_of_row.download(),
              d_pair_of_row.download(), what);
  EXPECT_EQ(d_error.download()[0], 1 | (has_out_of_range ? kernels::kErrorExpertIdOutOfRange : 0)) << what;
}

TEST(MoeOpsGpu, SortByExpertEnumerated) {
  FP4MOE_REQUIRE_GPU();
  std::mt19937 rng(5);
  for (int64_t num_tokens : {1, 3, 64, 1000, 20000})
    for (int64_t num_experts : {8, 128, 256, 512})
      for (int top_k : {1, 6, 8})
        for (IdPattern pattern : {IdPattern::kRandom, IdPattern::kSkewed, IdPattern::kAllOneExpert, IdPattern::kSparse,
                                  IdPattern::kWithOutOfRange}) {
          const std::vector<int32_t> ids = make_ids(pattern, num_tokens * top_k, num_experts, rng);
          check_sort(ids, num_tokens, top_k, num_experts,
                     std::string(to_string(pattern)) + " tokens=" + std::to_string(num_tokens) +
                         " E=" + std::to_string(num_experts) + " k=" + std::to_string(top_k));
        }
}

TEST(MoeOpsGpu, SortEveryIdOutOfRange) {
  FP4MOE_REQUIRE_GPU();
  std::vector<int32_t> ids(64 * 8);
  for (size_t i = 0; i < ids.size(); ++i) ids[i] = i % 2 ? -1 : 256;
  check_sort(ids, 64, 8, 256, "every id out of range");
  for (size_t i = 0; i < ids.size(); ++i) ids[i] = i % 3 ? -2 : -1;
  check_sort(ids, 64, 8, 256, "negative ids, some absent slots");
}

// Absent slots (-1, expert parallelism's slots served by another rank) are
// skipped without an error; the others are sorted as usual.
TEST(MoeOpsGpu, SortSkipsAbsentSlotsWithoutAnError) {
  FP4MOE_REQUIRE_GPU();
  std::mt19937 rng(17);
  for (int64_t num_tokens : {1, 64, 1000}) {
    std::vector<int32_t> ids = make_ids(IdPattern::kRandom, num_tokens * 8, 256, rng);
    for (size_t i = 0; i < ids.size(); ++i)
      if (i % 3 != 1) ids[i] = kernels::kAbsentSlot;
    check_sort(ids, num_tokens, 8, 256, "two of three slots absent, tokens=" + std::to_string(num_tokens));
    std::fill(ids.begin(), ids.end(), kernels::kAbsentSlot);
    check_sort(ids, num_tokens, 8, 256, "every slot absent, tokens=" + std::to_string(num_tokens));
  }
}

// Routing and sort in one call (one kernel up to 1024 pairs, two past it):
// ids and weights bit-identical to launch_route's, the sort's contract, a
// clean error word and the arrival counter back to 0. Each case runs twice
// on the same counter with the outputs poisoned in between, so a counter
// left non-zero (no block would then sort) fails the second run.
TEST(MoeOpsGpu, RouteAndSortMatchesRouteThenSort) {
  FP4MOE_REQUIRE_GPU();
  struct Case {
    const char* name;
    int64_t num_experts;
    RoutingParams params;
  };
  RoutingParams noaux;  // DeepSeek-V3 / GLM-5 routing
  noaux.mode = RoutingMode::kNoauxTc;
  noaux.num_groups = 8;
  noaux.topk_groups = 4;
  noaux.routed_scaling_factor = 2.5f;
  RoutingParams softmax;  // Qwen3
  RoutingParams gpt_oss;
  gpt_oss.mode = RoutingMode::kGptOss;
  gpt_oss.top_k = 4;
  RoutingParams widest;  // the kernels' limits: 512 experts, top-32
  widest.top_k = kernels::kMaxTopK;
  widest.renormalize = false;
  const Case cases[] = {{"noaux_tc E=256 k=8", 256, noaux},
                        {"softmax E=128 k=8", 128, softmax},
                        {"gpt-oss E=128 k=4", 128, gpt_oss},
                        {"softmax E=512 k=32", 512, widest}};
  std::mt19937 rng(11);
  for (const Case& c : cases) {
    const int top_k = c.params.top_k;
    for (int64_t num_tokens : {1, 2, 3, 31, 32, 33, 64, 127, 128, 129, 1000}) {
      const std::string what = std::string(c.name) + " T=" + std::to_string(num_tokens) +
                               (num_tokens * top_k <= 1024 ? " (one kernel)" : " (two kernels)");
      const int64_t num_pairs = num_tokens * top_k;
      const DeviceBuffer<float> d_logits(random_normal(static_cast<size_t>(num_tokens * c.num_experts), rng));
      const DeviceBuffer<float> d_bias(random_normal(static_cast<size_t>(c.num_experts), rng, 0.1f));
      DeviceBuffer<int32_t> ref_ids(static_cast<size_t>(num_pairs));
      DeviceBuffer<float> ref_weights(ref_ids.size());
      kernels::launch_route(d_logits.get(), d_bias.get(), num_tokens, c.num_experts, c.params, ref_ids.get(),
                            ref_weights.get(), nullptr);
      DeviceBuffer<int32_t> ids(ref_ids.size()), token_of_row(ref_ids.size()), pair_of_row(ref_ids.size());
      DeviceBuffer<float> weights(ref_ids.size());
      DeviceBuffer<int32_t> offsets(static_cast<size_t>(c.num_experts + 1));
      DeviceBuffer<int32_t> error_and_arrivals(std::vector<int32_t>{0, 0});
      DeviceBuffer<int32_t> scratch(static_cast<size_t>(kernels::sort_scratch_ints(num_pairs, c.num_experts)));
      for (int run = 0; run < 2; ++run) {
        ids.fill_bytes(0xFF);
        weights.fill_bytes(0xFF);
        offsets.fill_bytes(0xFF);
        token_of_row.fill_bytes(0xFF);
        pair_of_row.fill_bytes(0xFF);
        kernels::launch_route_and_sort(d_logits.get(), d_bias.get(), num_tokens, c.num_experts, c.params, ids.get(),
                                       weights.get(), offsets.get(), token_of_row.get(), pair_of_row.get(),
                                       error_and_arrivals.get(), error_and_arrivals.get() + 1, scratch.get(), nullptr);
        FP4MOE_CUDA_CHECK(cudaDeviceSynchronize());
        const std::string run_what = what + " run " + std::to_string(run);
        const std::vector<int32_t> got_ids = ids.download();
        ASSERT_EQ(got_ids, ref_ids.download()) << run_what;
        const std::vector<float> got_weights = weights.download();
        const std::vector<float> want_weights = ref_weights.download();
        for (size_t i = 0; i < got_weights.size(); ++i)
          ASSERT_EQ(float_bits(got_weights[i]), float_bits(want_weights[i])) << run_what << " slot " << i;
        verify_sort(got_ids, num_tokens, top_k, c.num_experts, offsets.download(), token_of_row.download(),
                    pair_of_row.download(), run_what);
        EXPECT_EQ(error_and_arrivals.download(), (std::vector<int32_t>{0, 0})) << run_what;
      }
    }
  }
}

// Device routing with a shared expert's slots: each token's row is its
// choices (the routing without shared slots, bit for bit), then experts E + j
// weighted 1 or sigmoid(gate · x) (fp32 on the device, 1e-5 relative to a
// double evaluation); the fused and two-kernel sorts place all T * (k + c)
// pairs over E + c experts, and launch_route alone writes the same rows.
TEST(MoeOpsGpu, RouteAndSortAppendSharedSlots) {
  FP4MOE_REQUIRE_GPU();
  struct Case {
    const char* name;
    int64_t num_experts;
    RoutingParams params;
    int num_shared;
    bool gated;
  };
  RoutingParams noaux;  // DeepSeek-V3 with its shared expert
  noaux.mode = RoutingMode::kNoauxTc;
  noaux.num_groups = 8;
  noaux.topk_groups = 4;
  noaux.routed_scaling_factor = 2.5f;
  RoutingParams qwen2;  // Qwen2-MoE: 60 experts, top-4, gated shared expert of 4 chunks
  qwen2.top_k = 4;
  qwen2.renormalize = false;
  RoutingParams widest;  // the limits: 28 + 4 = 32 slots, 508 + 4 = 512 experts
  widest.top_k = 28;
  const Case cases[] = {{"noaux_tc E=256 k=8 + 1", 256, noaux, 1, false},
                        {"softmax E=60 k=4 + 4 gated", 60, qwen2, 4, true},
                        {"softmax E=508 k=28 + 4 gated", 508, widest, 4, true}};
  std::mt19937 rng(29);
  const int64_t hidden = 200;
  for (const Case& c : cases) {
    const int top_k = c.params.top_k, rows = top_k + c.num_shared;
    for (int64_t num_tokens : {1, 3, 64, 129, 300}) {
      const std::string what = std::string(c.name) + " T=" + std::to_string(num_tokens);
      const std::vector<float> logits = random_normal(static_cast<size_t>(num_tokens * c.num_experts), rng);
      const DeviceBuffer<float> d_logits(logits);
      const DeviceBuffer<float> d_bias(random_normal(static_cast<size_t>(c.num_experts), rng, 0.1f));
      const std::vector<uint16_t> x = testing::random_bf16(static_cast<size_t>(num_tokens * hidden), rng);
      const std::vector<float> gate = random_normal(static_cast<size_t>(hidden), rng, 0.05f);
      const DeviceBuffer<uint16_t> d_x(x);
      const DeviceBuffer<float> d_gate(gate);
      kernels::SharedSlots shared;
      shared.num_shared = c.num_shared;
      shared.hidden_states = d_x.get();
      shared.gate = c.gated ? d_gate.get() : nullptr;
      shared.hidden = hidden;

      DeviceBuffer<int32_t> ref_ids(static_cast<size_t>(num_tokens * top_k));
      DeviceBuffer<float> ref_weights(ref_ids.size());
      kernels::launch_route(d_logits.get(), d_bias.get(), num_tokens, c.num_experts, c.params, ref_ids.get(),
                            ref_weights.get(), nullptr);
      FP4MOE_CUDA_CHECK(cudaDeviceSynchronize());
      const std::vector<int32_t> routed_ids = ref_ids.download();
      const std::vector<float> routed_weights = ref_weights.download();

      const size_t num_pairs = static_cast<size_t>(num_tokens * rows);
      DeviceBuffer<int32_t> ids(num_pairs), token_of_row(num_pairs), pair_of_row(num_pairs);
      DeviceBuffer<float> weights(num_pairs);
      DeviceBuffer<int32_t> offsets(static_cast<size_t>(c.num_experts + c.num_shared + 1));
      DeviceBuffer<int32_t> error_and_arrivals(std::vector<int32_t>{0, 0});
      DeviceBuffer<int32_t> scratch(static_cast<size_t>(
          kernels::sort_scratch_ints(static_cast<int64_t>(num_pairs), c.num_experts + c.num_shared)));
      for (const bool fused : {true, false}) {
        const std::string run_what = what + (fused ? " route_and_sort" : " route");
        ids.fill_bytes(0xFF);
        weights.fill_bytes(0xFF);
        offsets.fill_bytes(0xFF);
        token_of_row.fill_bytes(0xFF);
        pair_of_row.fill_bytes(0xFF);
        if (fused)
          kernels::launch_route_and_sort(d_logits.get(), d_bias.get(), num_tokens, c.num_experts, c.params, ids.get(),
                                         weights.get(), offsets.get(), token_of_row.get(), pair_of_row.get(),
                                         error_and_arrivals.get(), error_and_arrivals.get() + 1, scratch.get(), nullptr,
                                         false, shared);
        else
          kernels::launch_route(d_logits.get(), d_bias.get(), num_tokens, c.num_experts, c.params, ids.get(),
                                weights.get(), nullptr, false, error_and_arrivals.get(), shared);
        FP4MOE_CUDA_CHECK(cudaDeviceSynchronize());
        const std::vector<int32_t> got_ids = ids.download();
        const std::vector<float> got_weights = weights.download();
        int64_t num_bad = 0;
        for (int64_t t = 0; t < num_tokens && num_bad < 3; ++t) {
          double dot = 0.0;
          for (int64_t h = 0; h < hidden; ++h) dot += static_cast<double>(bf16_to_float(x[t * hidden + h])) * gate[h];
          const double shared_weight = c.gated ? 1.0 / (1.0 + std::exp(-dot)) : 1.0;
          for (int j = 0; j < rows; ++j) {
            const size_t at = static_cast<size_t>(t * rows + j);
            const bool ok = j < top_k ? got_ids[at] == routed_ids[static_cast<size_t>(t * top_k + j)] &&
                                            float_bits(got_weights[at]) ==
                                                float_bits(routed_weights[static_cast<size_t>(t * top_k + j)])
                                      : got_ids[at] == c.num_experts + j - top_k &&
                                            std::fabs(got_weights[at] - shared_weight) <= 1e-5 * shared_weight;
            if (!ok) {
              ++num_bad;
              ADD_FAILURE() << run_what << ": token " << t << " slot " << j << ": id " << got_ids[at] << " weight "
                            << got_weights[at];
            }
          }
        }
        if (fused)
          verify_sort(got_ids, num_tokens, rows, c.num_experts + c.num_shared, offsets.download(),
                      token_of_row.download(), pair_of_row.download(), run_what);
        EXPECT_EQ(error_and_arrivals.download(), (std::vector<int32_t>{0, 0})) << run_what;
      }
    }
  }
}

TEST(MoeOpsGpu, SortRejectsBadParameters) {
  FP4MOE_REQUIRE_GPU();
  DeviceBuffer<int32_t> buf(1024);
  int32_t* p = buf.get();
  EXPECT_THROW(kernels::launch_sort_by_expert(p, 1, 0, 8, p, p, p, p, nullptr, nullptr), Error);
  EXPECT_THROW(kernels::launch_sort_by_expert(p, 1, 1, 513, p, p, p, p, nullptr, nullptr), Error);
  EXPECT_THROW(kernels::launch_sort_by_expert(p, -1, 1, 8, p, p, p, p, nullptr, nullptr), Error);
  EXPECT_THROW(kernels::launch_sort_by_expert(p, int64_t{1} << 30, 8, 8, p, p, p, p, nullptr, nullptr), Error);
  EXPECT_THROW(kernels::launch_sort_by_expert(p, 1, 1, 8, p, p, p, nullptr, nullptr, nullptr), Error);
  // More pairs than one block sorts, and no scratch for the blocks' counts.
  EXPECT_THROW(kernels::launch_sort_by_expert(p, kernels::kSortChunkPairs + 1, 1, 8, p, p, p, p, nullptr, nullptr),
               Error);
  EXPECT_NO_THROW(
      kernels::launch_sort_by_expert(nullptr, 0, 8, 8, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr));
}

}  // namespace
}  // namespace fp4moe
