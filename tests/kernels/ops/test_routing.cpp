// GPU tests of the routing kernels and the shared slots they append
// (src/kernels/ops/routing.cu): routing against the CPU reference
// fp4moe::route() for every mode, expert counts {8, 60, 128, 256, 384, 512},
// top-k {1, 2, 4, 8, 32}, token counts {1, 3, 64, 1000}, enumerated noaux_tc
// group settings, the DeepSeek-V3 and gpt-oss settings, logits with many
// exact ties, and logits with NaN and +-inf (docs/design.md §3) and their
// error bit; the shared slots appended to caller-given routing against a
// host evaluation. Outputs are poisoned (0xFF bytes: -1 ids, NaN floats)
// before each run so an unwritten element fails. Skipped with a message where
// no GPU exists.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <limits>
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

using testing::kPoisonId;
using testing::random_normal;

std::string describe(const RoutingParams& p, int64_t num_experts, int64_t num_tokens, bool with_bias) {
  std::string s = to_string(p.mode) + " E=" + std::to_string(num_experts) + " k=" + std::to_string(p.top_k) +
                  " tokens=" + std::to_string(num_tokens);
  if (p.mode == RoutingMode::kSoftmaxTopK) s += p.renormalize ? " renormalize" : " no-renormalize";
  if (p.mode == RoutingMode::kNoauxTc)
    s += " groups=" + std::to_string(p.num_groups) + " topk_groups=" + std::to_string(p.topk_groups) +
         " scale=" + std::to_string(p.routed_scaling_factor) + (with_bias ? " bias" : " no-bias");
  return s;
}

struct RoutingScores {
  std::vector<double> sigmoid, choice, group_score;
};

// noaux_tc scores of one token in double, as route() computes them.
RoutingScores noaux_scores(const float* logits, const float* bias, int64_t num_experts, const RoutingParams& p) {
  RoutingScores r;
  r.sigmoid.resize(num_experts);
  r.choice.resize(num_experts);
  for (int64_t e = 0; e < num_experts; ++e) {
    r.sigmoid[e] = 1.0 / (1.0 + std::exp(-static_cast<double>(logits[e])));
    r.choice[e] = r.sigmoid[e] + (bias ? static_cast<double>(bias[e]) : 0.0);
  }
  const int64_t group_size = num_experts / p.num_groups;
  for (int g = 0; g < p.num_groups; ++g) {
    std::vector<double> members(r.choice.begin() + g * group_size, r.choice.begin() + (g + 1) * group_size);
    std::partial_sort(members.begin(), members.begin() + 2, members.end(), std::greater<>());
    r.group_score.push_back(members[0] + members[1]);
  }
  return r;
}

// The device computes noaux_tc scores in fp32, so where two choice scores (or
// group scores) are within fp32 rounding of each other its order may differ
// from the double reference. Accepts a token's ids when they are a correct
// noaux_tc selection with every score comparison relaxed by `slack`; returns
// why not otherwise.
std::string noaux_near_tie_violation(const RoutingScores& s, const RoutingParams& p, const int32_t* ids, double slack) {
  const int64_t num_experts = static_cast<int64_t>(s.choice.size());
  const int64_t group_size = num_experts / p.num_groups;
  std::vector<double> sorted_groups = s.group_score;
  std::sort(sorted_groups.begin(), sorted_groups.end(), std::greater<>());
  const double last_kept = sorted_groups[p.topk_groups - 1];
  const double first_dropped =
      p.topk_groups < p.num_groups ? sorted_groups[p.topk_groups] : -std::numeric_limits<double>::infinity();
  std::vector<char> chosen(num_experts, 0), group_used(p.num_groups, 0);
  for (int j = 0; j < p.top_k; ++j) {
    const int32_t id = ids[j];
    if (id < 0 || id >= num_experts) return "id " + std::to_string(id) + " out of range";
    if (chosen[id]) return "id " + std::to_string(id) + " chosen twice";
    chosen[id] = 1;
    group_used[id / group_size] = 1;
    if (s.group_score[id / group_size] < last_kept - slack)
      return "id " + std::to_string(id) + " is in a group that is clearly not kept";
    if (j > 0 && s.choice[id] > s.choice[ids[j - 1]] + slack)
      return "slot " + std::to_string(j) + " ranks clearly above slot " + std::to_string(j - 1);
  }
  if (std::count(group_used.begin(), group_used.end(), 1) > p.topk_groups)
    return "experts from more than topk_groups groups";
  double min_chosen = std::numeric_limits<double>::infinity();
  for (int j = 0; j < p.top_k; ++j) min_chosen = std::min(min_chosen, s.choice[ids[j]]);
  for (int64_t e = 0; e < num_experts; ++e) {
    const int64_t g = e / group_size;
    const bool surely_kept = group_used[g] || s.group_score[g] > first_dropped + slack;
    if (!chosen[e] && surely_kept && s.choice[e] > min_chosen + slack)
      return "expert " + std::to_string(e) + " was clearly better than a chosen one";
  }
  return "";
}

bool weight_close(float got, double expected) {
  return std::fabs(got - expected) <= 1e-5 * std::fabs(expected) + 1e-30;
}

// Routes `logits` for the first num_tokens tokens on the GPU (inputs already
// on the device) and compares with the CPU reference `ref` (computed for at
// least that many tokens). ids must be identical; for noaux_tc a token may
// differ only where fp32 near-ties explain it (counted, and bounded).
void check_route(const std::vector<float>& logits, const DeviceBuffer<float>& d_logits, const float* bias,
                 const DeviceBuffer<float>& d_bias, int64_t num_tokens, int64_t num_experts, const RoutingParams& p,
                 const Routing& ref) {
  const std::string what = describe(p, num_experts, num_tokens, bias != nullptr);
  const int64_t capacity_tokens = ref.num_tokens;
  DeviceBuffer<int32_t> d_ids(static_cast<size_t>(capacity_tokens * p.top_k));
  DeviceBuffer<float> d_weights(d_ids.size());
  d_ids.fill_bytes(0xFF);
  d_weights.fill_bytes(0xFF);
  kernels::launch_route(d_logits.get(), bias ? d_bias.get() : nullptr, num_tokens, num_experts, p, d_ids.get(),
                        d_weights.get(), nullptr);
  FP4MOE_CUDA_CHECK(cudaDeviceSynchronize());
  const std::vector<int32_t> ids = d_ids.download();
  const std::vector<float> weights = d_weights.download();

  int64_t num_bad = 0, num_near_tie = 0;
  auto report = [&](int64_t token, const std::string& why) {
    if (num_bad++ < 3) ADD_FAILURE() << what << ": token " << token << ": " << why;
  };
  for (int64_t t = 0; t < num_tokens; ++t) {
    const int32_t* got_ids = ids.data() + t * p.top_k;
    const float* got_w = weights.data() + t * p.top_k;
    const int32_t* ref_ids = ref.topk_ids.data() + t * p.top_k;
    const float* ref_w = ref.topk_weights.data() + t * p.top_k;
    if (std::equal(got_ids, got_ids + p.top_k, ref_ids)) {
      for (int j = 0; j < p.top_k; ++j)
        if (!weight_close(got_w[j], ref_w[j]))
          report(t, "slot " + std::to_string(j) + " weight " + std::to_string(got_w[j]) + ", expected " +
                        std::to_string(ref_w[j]));
      continue;
    }
    std::string ids_text;
    for (int j = 0; j < p.top_k; ++j) ids_text += " " + std::to_string(got_ids[j]) + "/" + std::to_string(ref_ids[j]);
    if (p.mode != RoutingMode::kNoauxTc) {
      report(t, "ids (got/expected):" + ids_text);
      continue;
    }
    const RoutingScores s = noaux_scores(logits.data() + t * num_experts, bias, num_experts, p);
    const std::string why = noaux_near_tie_violation(s, p, got_ids, 2e-6);
    if (!why.empty()) {
      report(t, why + "; ids (got/expected):" + ids_text);
      continue;
    }
    ++num_near_tie;
    double chosen_sum = 0.0;
    for (int j = 0; j < p.top_k; ++j) chosen_sum += s.sigmoid[got_ids[j]];
    for (int j = 0; j < p.top_k; ++j) {
      const double expected = s.sigmoid[got_ids[j]] / (chosen_sum + 1e-20) * p.routed_scaling_factor;
      if (!weight_close(got_w[j], expected))
        report(t, "near-tie token, slot " + std::to_string(j) + " weight " + std::to_string(got_w[j]) + ", expected " +
                      std::to_string(expected));
    }
  }
  // Near ties within fp32 rounding are rare on normal logits (~1e-4 per token).
  EXPECT_LE(num_near_tie, 1 + num_tokens / 100) << what << ": too many near-tie differences";
  if (num_near_tie > 0)
    std::printf("  %s: %lld token(s) differ from the double reference by an fp32 near-tie\n", what.c_str(),
                static_cast<long long>(num_near_tie));
  // Past the last token nothing is written.
  for (size_t i = static_cast<size_t>(num_tokens * p.top_k); i < ids.size(); ++i)
    if (ids[i] != kPoisonId || !std::isnan(weights[i])) {
      ADD_FAILURE() << what << ": wrote past the last token at slot " << i;
      break;
    }
  EXPECT_EQ(num_bad, 0) << what;
}

const std::vector<int64_t> kRouteExpertCounts = {8, 60, 128, 256, 384, 512};
const std::vector<int> kRouteTopKs = {1, 2, 4, 8, 32};  // 32 = kMaxTopK
const std::vector<int64_t> kRouteTokenCounts = {1, 3, 64, 1000};

// Runs every token count of kRouteTokenCounts on one draw of logits.
void check_route_all_token_counts(const std::vector<float>& logits, const std::vector<float>* bias, int64_t num_experts,
                                  const RoutingParams& p) {
  const int64_t max_tokens = kRouteTokenCounts.back();
  const DeviceBuffer<float> d_logits(logits);
  const DeviceBuffer<float> d_bias(bias ? *bias : std::vector<float>{});
  const float* host_bias = bias ? bias->data() : nullptr;
  const Routing ref =
      route(logits.data(), max_tokens, num_experts, p.mode == RoutingMode::kNoauxTc ? host_bias : nullptr, p);
  for (int64_t num_tokens : kRouteTokenCounts)
    check_route(logits, d_logits, p.mode == RoutingMode::kNoauxTc ? host_bias : nullptr, d_bias, num_tokens,
                num_experts, p, ref);
}

TEST(MoeOpsGpu, RouteSoftmaxAndGptOss) {
  FP4MOE_REQUIRE_GPU();
  std::mt19937 rng(1);
  for (int64_t num_experts : kRouteExpertCounts) {
    const std::vector<float> logits = random_normal(static_cast<size_t>(kRouteTokenCounts.back() * num_experts), rng);
    for (int top_k : kRouteTopKs) {
      if (top_k > num_experts) continue;
      for (RoutingMode mode : {RoutingMode::kSoftmaxTopK, RoutingMode::kGptOss}) {
        for (bool renormalize : {true, false}) {
          if (mode == RoutingMode::kGptOss && !renormalize) continue;  // has no such option
          RoutingParams p;
          p.mode = mode;
          p.top_k = top_k;
          p.renormalize = renormalize;
          check_route_all_token_counts(logits, nullptr, num_experts, p);
        }
      }
    }
  }
}

TEST(MoeOpsGpu, RouteNoauxTcEnumeratedGroups) {
  FP4MOE_REQUIRE_GPU();
  std::mt19937 rng(2);
  std::uniform_real_distribution<float> bias_dist(-0.2f, 0.2f);
  for (int64_t num_experts : kRouteExpertCounts) {
    const std::vector<float> logits = random_normal(static_cast<size_t>(kRouteTokenCounts.back() * num_experts), rng);
    std::vector<float> bias(static_cast<size_t>(num_experts));
    for (auto& b : bias) b = bias_dist(rng);
    // Group counts: one group, a few, and the most (two experts per group).
    std::vector<int> group_counts;
    for (int g : {1, 4, 8, 16, static_cast<int>(num_experts / 2)})
      if (num_experts % g == 0 && num_experts / g >= 2 &&
          std::find(group_counts.begin(), group_counts.end(), g) == group_counts.end())
        group_counts.push_back(g);
    for (int top_k : kRouteTopKs) {
      if (top_k > num_experts) continue;
      for (int num_groups : group_counts) {
        std::vector<int> kept_counts = {1, std::max(1, num_groups / 2), num_groups};
        kept_counts.erase(std::unique(kept_counts.begin(), kept_counts.end()), kept_counts.end());
        for (int topk_groups : kept_counts) {
          if (topk_groups * (num_experts / num_groups) < top_k) continue;
          RoutingParams p;
          p.mode = RoutingMode::kNoauxTc;
          p.top_k = top_k;
          p.num_groups = num_groups;
          p.topk_groups = topk_groups;
          p.routed_scaling_factor = 1.5f;
          check_route_all_token_counts(logits, &bias, num_experts, p);
        }
      }
      // Without a correction bias (null pointer).
      RoutingParams p;
      p.mode = RoutingMode::kNoauxTc;
      p.top_k = top_k;
      p.num_groups = group_counts.back();
      p.topk_groups = std::max(1, p.num_groups / 2);
      if (p.topk_groups * (num_experts / p.num_groups) >= top_k)
        check_route_all_token_counts(logits, nullptr, num_experts, p);
    }
  }
}

// The shipped models' settings, named so a failure says which model breaks.
TEST(MoeOpsGpu, RouteModelSettings) {
  FP4MOE_REQUIRE_GPU();
  std::mt19937 rng(3);
  {  // DeepSeek-V3: 256 experts, top-8, 8 groups, 4 kept, scaling 2.5
    const std::vector<float> logits = random_normal(1000 * 256, rng);
    std::vector<float> bias = random_normal(256, rng, 0.1f);
    RoutingParams p;
    p.mode = RoutingMode::kNoauxTc;
    p.top_k = 8;
    p.num_groups = 8;
    p.topk_groups = 4;
    p.routed_scaling_factor = 2.5f;
    check_route_all_token_counts(logits, &bias, 256, p);
  }
  {  // gpt-oss: 128 experts, top-4, softmax over the 4
    const std::vector<float> logits = random_normal(1000 * 128, rng, 3.0f);
    RoutingParams p;
    p.mode = RoutingMode::kGptOss;
    p.top_k = 4;
    check_route_all_token_counts(logits, nullptr, 128, p);
  }
}

// Logits from a few values: most selections involve exact ties, which must
// break by lower index (and lower group index) exactly as on the CPU. The
// values avoid sigmoid's symmetry (s(x) + s(-x) = 2 s(0)) so that fp32 and
// double agree on which group sums tie.
TEST(MoeOpsGpu, RouteTiesBreakByLowerIndex) {
  FP4MOE_REQUIRE_GPU();
  std::mt19937 rng(4);
  const float kValues[] = {-1.0f, 0.0f, 0.5f, 2.0f};
  std::uniform_int_distribution<int> pick(0, 3);
  std::uniform_int_distribution<int> coin(0, 1);
  for (int64_t num_experts : {8, 60, 256, 512}) {
    std::vector<float> logits(static_cast<size_t>(kRouteTokenCounts.back() * num_experts));
    for (auto& v : logits) v = kValues[pick(rng)];
    std::vector<float> bias(static_cast<size_t>(num_experts));
    for (auto& b : bias) b = coin(rng) ? 0.25f : 0.0f;
    for (int top_k : {1, 4, 8}) {
      if (top_k > num_experts) continue;
      RoutingParams p;
      p.top_k = top_k;
      for (bool renormalize : {true, false}) {
        p.mode = RoutingMode::kSoftmaxTopK;
        p.renormalize = renormalize;
        check_route_all_token_counts(logits, nullptr, num_experts, p);
      }
      p.mode = RoutingMode::kGptOss;
      check_route_all_token_counts(logits, nullptr, num_experts, p);
      p.mode = RoutingMode::kNoauxTc;
      p.num_groups = 4;
      p.topk_groups = 2;
      if (num_experts % 4 == 0 && 2 * num_experts / 4 >= top_k) {
        check_route_all_token_counts(logits, &bias, num_experts, p);
        check_route_all_token_counts(logits, nullptr, num_experts, p);
      }
    }
  }
}

// docs/design.md §3: non-finite logits exclude their expert, on the GPU as in
// route(). Logits sprinkled with NaN, +inf and -inf, some tokens with fewer
// finite logits than top_k and some with none; the device error bit is set
// exactly when a token had one.
TEST(MoeOpsGpu, RouteNonFiniteLogitsMatchTheReference) {
  FP4MOE_REQUIRE_GPU();
  std::mt19937 rng(5);
  const float kNonFinite[] = {NAN, INFINITY, -INFINITY};
  std::uniform_int_distribution<int> pick(0, 2);
  std::uniform_real_distribution<float> unit(0.0f, 1.0f);
  const int64_t max_tokens = kRouteTokenCounts.back();
  for (int64_t num_experts : {8, 60, 256}) {
    std::vector<float> logits = random_normal(static_cast<size_t>(max_tokens * num_experts), rng);
    for (int64_t t = 0; t < max_tokens; ++t) {
      // Token t % 7 == 0: every logit non-finite; t % 7 == 1: all but two;
      // others: each logit non-finite with probability 0.1.
      for (int64_t e = 0; e < num_experts; ++e) {
        const bool replace = t % 7 == 0 || (t % 7 == 1 && e >= 2) || unit(rng) < 0.1f;
        if (replace) logits[static_cast<size_t>(t * num_experts + e)] = kNonFinite[pick(rng)];
      }
    }
    const std::vector<float> bias = random_normal(static_cast<size_t>(num_experts), rng, 0.1f);
    for (int top_k : {1, 4, 8}) {
      if (top_k > num_experts) continue;
      RoutingParams p;
      p.top_k = top_k;
      for (bool renormalize : {true, false}) {
        p.mode = RoutingMode::kSoftmaxTopK;
        p.renormalize = renormalize;
        check_route_all_token_counts(logits, nullptr, num_experts, p);
      }
      p.mode = RoutingMode::kGptOss;
      check_route_all_token_counts(logits, nullptr, num_experts, p);
      p.mode = RoutingMode::kNoauxTc;
      p.num_groups = 4;
      p.topk_groups = 2;
      if (num_experts % 4 == 0 && 2 * num_experts / 4 >= top_k) {
        check_route_all_token_counts(logits, &bias, num_experts, p);
        check_route_all_token_counts(logits, nullptr, num_experts, p);
      }
    }
  }

  // The error bit: set by a token with a non-finite logit, by launch_route and
  // launch_route_and_sort alike; absent when every logit is finite.
  const int64_t num_experts = 16, num_tokens = 5;
  RoutingParams p;
  p.top_k = 2;
  std::vector<float> logits = random_normal(static_cast<size_t>(num_tokens * num_experts), rng);
  DeviceBuffer<int32_t> ids(num_tokens * p.top_k), offsets(num_experts + 1), token_of_row(ids.size()),
      pair_of_row(ids.size()), flags(2),
      scratch(static_cast<size_t>(kernels::sort_scratch_ints(num_tokens * p.top_k, num_experts)));
  DeviceBuffer<float> weights(ids.size());
  auto error_word = [&](bool fused) {
    const DeviceBuffer<float> d_logits(logits);
    flags.fill_bytes(0);
    if (fused)
      kernels::launch_route_and_sort(d_logits.get(), nullptr, num_tokens, num_experts, p, ids.get(), weights.get(),
                                     offsets.get(), token_of_row.get(), pair_of_row.get(), flags.get(), flags.get() + 1,
                                     scratch.get(), nullptr);
    else
      kernels::launch_route(d_logits.get(), nullptr, num_tokens, num_experts, p, ids.get(), weights.get(), nullptr,
                            false, flags.get());
    FP4MOE_CUDA_CHECK(cudaDeviceSynchronize());
    return flags.download()[0];
  };
  for (bool fused : {false, true}) {
    EXPECT_EQ(error_word(fused), 0) << "fused " << fused;
    logits[3 * num_experts + 7] = -INFINITY;
    EXPECT_EQ(error_word(fused), kernels::kErrorNonFiniteLogits) << "fused " << fused;
    logits[3 * num_experts + 7] = 0.25f;
  }
}

TEST(MoeOpsGpu, RouteRejectsBadParameters) {
  FP4MOE_REQUIRE_GPU();
  DeviceBuffer<float> logits(1024), weights(64);
  DeviceBuffer<int32_t> ids(64);
  logits.fill_bytes(0);
  auto route_with = [&](int64_t num_experts, RoutingParams p) {
    kernels::launch_route(logits.get(), nullptr, 1, num_experts, p, ids.get(), weights.get(), nullptr);
  };
  RoutingParams p;
  p.top_k = 0;
  EXPECT_THROW(route_with(8, p), Error);
  p.top_k = 9;
  EXPECT_THROW(route_with(8, p), Error);  // top_k > num_experts
  p.top_k = kernels::kMaxTopK + 1;
  EXPECT_THROW(route_with(64, p), Error);
  p.top_k = 2;
  EXPECT_THROW(route_with(513, p), Error);  // more experts than the kernel holds
  EXPECT_THROW(route_with(0, p), Error);
  p.mode = RoutingMode::kNoauxTc;
  p.num_groups = 3;
  EXPECT_THROW(route_with(64, p), Error);  // does not divide
  p.num_groups = 64;
  EXPECT_THROW(route_with(64, p), Error);  // one expert per group
  p.num_groups = 8;
  p.topk_groups = 9;
  EXPECT_THROW(route_with(64, p), Error);
  p.topk_groups = 1;
  p.top_k = 9;
  EXPECT_THROW(route_with(64, p), Error);  // one kept group of 8 cannot give 9
  p.top_k = 2;
  p.routed_scaling_factor = 0.0f;
  EXPECT_THROW(route_with(64, p), Error);
  p.routed_scaling_factor = 1.0f;
  EXPECT_NO_THROW(route_with(64, p));
  // Zero tokens: nothing launched, null pointers accepted.
  EXPECT_NO_THROW(kernels::launch_route(nullptr, nullptr, 0, 64, p, nullptr, nullptr, nullptr));
  FP4MOE_CUDA_CHECK(cudaDeviceSynchronize());
}

// ----------------------------------------------------------- shared slots

// Every token's routed slots come through (out-of-range ids as INT32_MAX,
// absent slots as they are), followed by one slot per shared chunk with
// expert E + j and weight 1, or sigmoid(gate · x) against a host evaluation
// in double (fp32 on the device: 1e-5 relative).
TEST(MoeOpsGpu, AppendSharedSlots) {
  FP4MOE_REQUIRE_GPU();
  std::mt19937 rng(17);
  constexpr int64_t kNumExperts = 60;
  for (const int64_t num_tokens : {1, 5, 300})
    for (const int top_k : {1, 4, 8})
      for (const int num_shared : {1, 4})
        for (const bool gated : {false, true}) {
          const int64_t hidden = 264;  // not a multiple of the block
          const std::string what = "tokens=" + std::to_string(num_tokens) + " k=" + std::to_string(top_k) +
                                   " shared=" + std::to_string(num_shared) + (gated ? " gated" : "");
          std::uniform_int_distribution<int32_t> expert(0, kNumExperts - 1);
          std::vector<int32_t> ids(static_cast<size_t>(num_tokens * top_k));
          for (int32_t& id : ids) id = expert(rng);
          ids[0] = kernels::kAbsentSlot;
          if (ids.size() > 2) ids[2] = static_cast<int32_t>(kNumExperts);  // out of range
          const std::vector<float> weights = random_normal(ids.size(), rng);
          const std::vector<uint16_t> x = testing::random_bf16(static_cast<size_t>(num_tokens * hidden), rng);
          const std::vector<float> gate =
              gated ? random_normal(static_cast<size_t>(hidden), rng, 0.05f) : std::vector<float>();
          const DeviceBuffer<int32_t> d_ids(ids);
          const DeviceBuffer<float> d_weights(weights), d_gate(gate);
          const DeviceBuffer<uint16_t> d_x(x);
          const int rows = top_k + num_shared;
          DeviceBuffer<int32_t> out_ids(static_cast<size_t>(num_tokens * rows));
          DeviceBuffer<float> out_weights(static_cast<size_t>(num_tokens * rows));
          out_ids.fill_bytes(0xFF);
          out_weights.fill_bytes(0xFF);
          kernels::launch_append_shared_slots(d_ids.get(), d_weights.get(), num_tokens, top_k, kNumExperts, num_shared,
                                              d_x.get(), gated ? d_gate.get() : nullptr, hidden, out_ids.get(),
                                              out_weights.get(), nullptr);
          FP4MOE_CUDA_CHECK(cudaDeviceSynchronize());
          const std::vector<int32_t> got_ids = out_ids.download();
          const std::vector<float> got_weights = out_weights.download();
          int64_t num_bad = 0;
          for (int64_t t = 0; t < num_tokens && num_bad < 3; ++t) {
            double dot = 0.0;
            for (int64_t h = 0; h < hidden && gated; ++h)
              dot += static_cast<double>(bf16_to_float(x[t * hidden + h])) * gate[h];
            const double shared_weight = gated ? 1.0 / (1.0 + std::exp(-dot)) : 1.0;
            for (int j = 0; j < rows; ++j) {
              const size_t at = static_cast<size_t>(t * rows + j);
              int32_t want_id;
              double want_weight;
              if (j < top_k) {
                const int32_t id = ids[static_cast<size_t>(t * top_k + j)];
                want_id = id == kernels::kAbsentSlot || (id >= 0 && id < kNumExperts) ? id : INT32_MAX;
                want_weight = weights[static_cast<size_t>(t * top_k + j)];
              } else {
                want_id = static_cast<int32_t>(kNumExperts + j - top_k);
                want_weight = shared_weight;
              }
              if (got_ids[at] != want_id || std::fabs(got_weights[at] - want_weight) > 1e-5 * std::fabs(want_weight)) {
                ++num_bad;
                ADD_FAILURE() << what << ": token " << t << " slot " << j << ": id " << got_ids[at] << " weight "
                              << got_weights[at] << ", expected " << want_id << " " << want_weight;
              }
            }
          }
        }
  DeviceBuffer<int32_t> idx(64);
  DeviceBuffer<float> w(64);
  EXPECT_THROW(kernels::launch_append_shared_slots(idx.get(), w.get(), 1, 30, 60, 3, nullptr, nullptr, 64, idx.get(),
                                                   w.get(), nullptr),
               Error);  // 33 rows per token
  EXPECT_THROW(kernels::launch_append_shared_slots(idx.get(), w.get(), 1, 2, 511, 2, nullptr, nullptr, 64, idx.get(),
                                                   w.get(), nullptr),
               Error);  // 513 experts
  EXPECT_THROW(kernels::launch_append_shared_slots(idx.get(), w.get(), 1, 2, 60, 2, nullptr, w.get(), 64, idx.get(),
                                                   w.get(), nullptr),
               Error);  // a gate without hidden states
}

}  // namespace
}  // namespace fp4moe
