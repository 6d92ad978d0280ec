// GPU tests of the MoE routing, sort-by-expert, gather and finalize kernels
// (src/kernels/moe_ops.cu):
//   - routing against the CPU reference fp4moe::route() for every mode,
//     expert counts {8, 60, 128, 256, 384, 512}, top-k {1, 2, 4, 8, 32},
//     token counts {1, 3, 64, 1000}, enumerated noaux_tc group settings, the
//     DeepSeek-V3 and gpt-oss settings, logits with many exact ties, and
//     logits with NaN and +-inf (docs/design.md §3) and their error bit;
//   - the sort on random, skewed, single-expert, sparse and out-of-range ids;
//   - gather and both finalize modes against host loops (bit-exact), and the
//     W4A4 quantising gather against the CPU quantiser (bit-exact);
//   - a CUDA-graph capture of route -> sort -> gather -> finalize.
// Outputs are poisoned (0xFF bytes: -1 ids, NaN floats and bf16) before each
// run so an unwritten element fails. Skipped with a message where no GPU exists.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <iterator>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "fp4moe/error.hpp"
#include "fp4moe/nvfp4.hpp"
#include "fp4moe/nvfp4_activation.hpp"
#include "fp4moe/reference.hpp"
#include "gpu_test_util.hpp"
#include "kernels/moe_ops.hpp"

namespace fp4moe {
namespace {

constexpr int32_t kPoisonId = -1;  // what fill_bytes(0xFF) leaves in an int32
constexpr uint16_t kPoisonBf16 = 0xFFFF;

std::vector<float> random_normal(size_t count, std::mt19937& rng, float stddev = 1.0f) {
  std::normal_distribution<float> dist(0.0f, stddev);
  std::vector<float> out(count);
  for (auto& v : out) v = dist(rng);
  return out;
}

uint32_t float_bits(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  return bits;
}

// ------------------------------------------------------------------ routing

std::string describe(const RoutingParams& p, int64_t num_experts, int64_t num_tokens,
                     bool with_bias) {
  std::string s = to_string(p.mode) + " E=" + std::to_string(num_experts) +
                  " k=" + std::to_string(p.top_k) + " tokens=" + std::to_string(num_tokens);
  if (p.mode == RoutingMode::kSoftmaxTopK) s += p.renormalize ? " renormalize" : " no-renormalize";
  if (p.mode == RoutingMode::kNoauxTc)
    s += " groups=" + std::to_string(p.num_groups) + " topk_groups=" +
         std::to_string(p.topk_groups) + " scale=" + std::to_string(p.routed_scaling_factor) +
         (with_bias ? " bias" : " no-bias");
  return s;
}

struct RoutingScores {
  std::vector<double> sigmoid, choice, group_score;
};

// noaux_tc scores of one token in double, as route() computes them.
RoutingScores noaux_scores(const float* logits, const float* bias, int64_t num_experts,
                           const RoutingParams& p) {
  RoutingScores r;
  r.sigmoid.resize(num_experts);
  r.choice.resize(num_experts);
  for (int64_t e = 0; e < num_experts; ++e) {
    r.sigmoid[e] = 1.0 / (1.0 + std::exp(-static_cast<double>(logits[e])));
    r.choice[e] = r.sigmoid[e] + (bias ? static_cast<double>(bias[e]) : 0.0);
  }
  const int64_t group_size = num_experts / p.num_groups;
  for (int g = 0; g < p.num_groups; ++g) {
    std::vector<double> members(r.choice.begin() + g * group_size,
                                r.choice.begin() + (g + 1) * group_size);
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
std::string noaux_near_tie_violation(const RoutingScores& s, const RoutingParams& p,
                                     const int32_t* ids, double slack) {
  const int64_t num_experts = static_cast<int64_t>(s.choice.size());
  const int64_t group_size = num_experts / p.num_groups;
  std::vector<double> sorted_groups = s.group_score;
  std::sort(sorted_groups.begin(), sorted_groups.end(), std::greater<>());
  const double last_kept = sorted_groups[p.topk_groups - 1];
  const double first_dropped = p.topk_groups < p.num_groups
                                   ? sorted_groups[p.topk_groups]
                                   : -std::numeric_limits<double>::infinity();
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
void check_route(const std::vector<float>& logits, const DeviceBuffer<float>& d_logits,
                 const float* bias, const DeviceBuffer<float>& d_bias, int64_t num_tokens,
                 int64_t num_experts, const RoutingParams& p, const Routing& ref) {
  const std::string what = describe(p, num_experts, num_tokens, bias != nullptr);
  const int64_t capacity_tokens = ref.num_tokens;
  DeviceBuffer<int32_t> d_ids(static_cast<size_t>(capacity_tokens * p.top_k));
  DeviceBuffer<float> d_weights(d_ids.size());
  d_ids.fill_bytes(0xFF);
  d_weights.fill_bytes(0xFF);
  kernels::launch_route(d_logits.get(), bias ? d_bias.get() : nullptr, num_tokens, num_experts, p,
                        d_ids.get(), d_weights.get(), nullptr);
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
          report(t, "slot " + std::to_string(j) + " weight " + std::to_string(got_w[j]) +
                        ", expected " + std::to_string(ref_w[j]));
      continue;
    }
    std::string ids_text;
    for (int j = 0; j < p.top_k; ++j)
      ids_text += " " + std::to_string(got_ids[j]) + "/" + std::to_string(ref_ids[j]);
    if (p.mode != RoutingMode::kNoauxTc) {
      report(t, "ids (got/expected):" + ids_text);
      continue;
    }
    const RoutingScores s = noaux_scores(logits.data() + t * num_experts,
                                         bias, num_experts, p);
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
        report(t, "near-tie token, slot " + std::to_string(j) + " weight " +
                      std::to_string(got_w[j]) + ", expected " + std::to_string(expected));
    }
  }
  // Near ties within fp32 rounding are rare on normal logits (~1e-4 per token).
  EXPECT_LE(num_near_tie, 1 + num_tokens / 100) << what << ": too many near-tie differences";
  if (num_near_tie > 0)
    std::printf("  %s: %lld token(s) differ from the double reference by an fp32 near-tie\n",
                what.c_str(), static_cast<long long>(num_near_tie));
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
void check_route_all_token_counts(const std::vector<float>& logits, const std::vector<float>* bias,
                                  int64_t num_experts, const RoutingParams& p) {
  const int64_t max_tokens = kRouteTokenCounts.back();
  const DeviceBuffer<float> d_logits(logits);
  const DeviceBuffer<float> d_bias(bias ? *bias : std::vector<float>{});
  const float* host_bias = bias ? bias->data() : nullptr;
  const Routing ref = route(logits.data(), max_tokens, num_experts,
                            p.mode == RoutingMode::kNoauxTc ? host_bias : nullptr, p);
  for (int64_t num_tokens : kRouteTokenCounts)
    check_route(logits, d_logits, p.mode == RoutingMode::kNoauxTc ? host_bias : nullptr, d_bias,
                num_tokens, num_experts, p, ref);
}

TEST(MoeOpsGpu, RouteSoftmaxAndGptOss) {
  FP4MOE_REQUIRE_GPU();
  std::mt19937 rng(1);
  for (int64_t num_experts : kRouteExpertCounts) {
    const std::vector<float> logits =
        random_normal(static_cast<size_t>(kRouteTokenCounts.back() * num_experts), rng);
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
    const std::vector<float> logits =
        random_normal(static_cast<size_t>(kRouteTokenCounts.back() * num_experts), rng);
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
    std::vector<float> logits =
        random_normal(static_cast<size_t>(max_tokens * num_experts), rng);
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
      kernels::launch_route_and_sort(d_logits.get(), nullptr, num_tokens, num_experts, p, ids.get(),
                                     weights.get(), offsets.get(), token_of_row.get(),
                                     pair_of_row.get(), flags.get(), flags.get() + 1, scratch.get(), nullptr);
    else
      kernels::launch_route(d_logits.get(), nullptr, num_tokens, num_experts, p, ids.get(),
                            weights.get(), nullptr, false, flags.get());
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
    kernels::launch_route(logits.get(), nullptr, 1, num_experts, p, ids.get(), weights.get(),
                          nullptr);
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

// --------------------------------------------------------------------- sort

enum class IdPattern { kRandom, kSkewed, kAllOneExpert, kSparse, kWithOutOfRange };

const char* to_string(IdPattern pattern) {
  switch (pattern) {
    case IdPattern::kRandom: return "random";
    case IdPattern::kSkewed: return "skewed";
    case IdPattern::kAllOneExpert: return "all-one-expert";
    case IdPattern::kSparse: return "sparse";
    case IdPattern::kWithOutOfRange: return "with-out-of-range";
  }
  return "?";
}

std::vector<int32_t> make_ids(IdPattern pattern, int64_t num_pairs, int64_t num_experts,
                              std::mt19937& rng) {
  std::uniform_int_distribution<int32_t> any(0, static_cast<int32_t>(num_experts - 1));
  std::uniform_int_distribution<int> percent(0, 99);
  const int32_t hot = any(rng);
  std::vector<int32_t> ids(static_cast<size_t>(num_pairs));
  for (auto& id : ids) {
    switch (pattern) {
      case IdPattern::kRandom: id = any(rng); break;
      case IdPattern::kSkewed: id = percent(rng) < 90 ? hot : any(rng); break;
      case IdPattern::kAllOneExpert: id = hot; break;
      case IdPattern::kSparse: id = (any(rng) / 4) * 4; break;  // 3 of 4 experts get nothing
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
void verify_sort(const std::vector<int32_t>& ids, int64_t num_tokens, int top_k,
                 int64_t num_experts, const std::vector<int32_t>& offsets,
                 const std::vector<int32_t>& token_of_row, const std::vector<int32_t>& pair_of_row,
                 const std::string& what) {
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
      report(row, "pair " + std::to_string(pair) + " has expert " +
                      std::to_string(ids[static_cast<size_t>(pair)]) + ", the row is expert " +
                      std::to_string(expert) + "'s");
    if (token_of_row[static_cast<size_t>(row)] != pair / top_k)
      report(row, "token " + std::to_string(token_of_row[static_cast<size_t>(row)]) +
                      ", expected pair / top_k = " + std::to_string(pair / top_k));
  }
  // Rows past offsets[E] are left unwritten.
  for (int64_t row = num_placed; row < num_pairs; ++row)
    if (pair_of_row[static_cast<size_t>(row)] != kPoisonId ||
        token_of_row[static_cast<size_t>(row)] != kPoisonId)
      report(row, "written past offsets[E] = " + std::to_string(num_placed));
  EXPECT_EQ(num_bad, 0) << what;
}

// Runs the sort and checks it (verify_sort) and the error word.
void check_sort(const std::vector<int32_t>& ids, int64_t num_tokens, int top_k,
                int64_t num_experts, const std::string& what) {
  const int64_t num_pairs = num_tokens * top_k;
  // kAbsentSlot (-1) is skipped without an error; every other id outside the range is one.
  const bool has_out_of_range = std::any_of(ids.begin(), ids.end(), [&](int32_t id) {
    return (id < 0 && id != kernels::kAbsentSlot) || id >= num_experts;
  });
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
  kernels::launch_sort_by_expert(d_ids.get(), num_tokens, top_k, num_experts, d_offsets.get(),
                                 d_token_of_row.get(), d_pair_of_row.get(), d_error.get(), d_scratch.get(), nullptr);
  FP4MOE_CUDA_CHECK(cudaDeviceSynchronize());
  verify_sort(ids, num_tokens, top_k, num_experts, d_offsets.download(), d_token_of_row.download(),
              d_pair_of_row.download(), what);
  EXPECT_EQ(d_error.download()[0], 1 | (has_out_of_range ? kernels::kErrorExpertIdOutOfRange : 0))
      << what;
}

TEST(MoeOpsGpu, SortByExpertEnumerated) {
  FP4MOE_REQUIRE_GPU();
  std::mt19937 rng(5);
  for (int64_t num_tokens : {1, 3, 64, 1000, 20000})
    for (int64_t num_experts : {8, 128, 256, 512})
      for (int top_k : {1, 6, 8})
        for (IdPattern pattern : {IdPattern::kRandom, IdPattern::kSkewed, IdPattern::kAllOneExpert,
                                  IdPattern::kSparse, IdPattern::kWithOutOfRange}) {
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
      const DeviceBuffer<float> d_logits(
          random_normal(static_cast<size_t>(num_tokens * c.num_experts), rng));
      const DeviceBuffer<float> d_bias(random_normal(static_cast<size_t>(c.num_experts), rng, 0.1f));
      DeviceBuffer<int32_t> ref_ids(static_cast<size_t>(num_pairs));
      DeviceBuffer<float> ref_weights(ref_ids.size());
      kernels::launch_route(d_logits.get(), d_bias.get(), num_tokens, c.num_experts, c.params,
                            ref_ids.get(), ref_weights.get(), nullptr);
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
        kernels::launch_route_and_sort(d_logits.get(), d_bias.get(), num_tokens, c.num_experts,
                                       c.params, ids.get(), weights.get(), offsets.get(),
                                       token_of_row.get(), pair_of_row.get(),
                                       error_and_arrivals.get(), error_and_arrivals.get() + 1,
                                       scratch.get(), nullptr);
        FP4MOE_CUDA_CHECK(cudaDeviceSynchronize());
        const std::string run_what = what + " run " + std::to_string(run);
        const std::vector<int32_t> got_ids = ids.download();
        ASSERT_EQ(got_ids, ref_ids.download()) << run_what;
        const std::vector<float> got_weights = weights.download();
        const std::vector<float> want_weights = ref_weights.download();
        for (size_t i = 0; i < got_weights.size(); ++i)
          ASSERT_EQ(float_bits(got_weights[i]), float_bits(want_weights[i])) << run_what << " slot " << i;
        verify_sort(got_ids, num_tokens, top_k, c.num_experts, offsets.download(),
                    token_of_row.download(), pair_of_row.download(), run_what);
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
                                         error_and_arrivals.get(), error_and_arrivals.get() + 1, scratch.get(),
                                         nullptr, false, shared);
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
            const bool ok =
                j < top_k ? got_ids[at] == routed_ids[static_cast<size_t>(t * top_k + j)] &&
                                float_bits(got_weights[at]) == float_bits(routed_weights[static_cast<size_t>(t * top_k + j)])
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
  EXPECT_NO_THROW(kernels::launch_sort_by_expert(nullptr, 0, 8, 8, nullptr, nullptr, nullptr,
                                                 nullptr, nullptr, nullptr));
}

// ------------------------------------------------------------------ gather

TEST(MoeOpsGpu, GatherRows) {
  FP4MOE_REQUIRE_GPU();
  std::mt19937 rng(6);
  constexpr int64_t kNumExperts = 16;
  for (int64_t num_tokens : {1, 3, 64, 1000})
    for (int64_t hidden : {8, 64, 1032, 7168})
      for (int top_k : {1, 8}) {
        const std::string what = "tokens=" + std::to_string(num_tokens) +
                                 " hidden=" + std::to_string(hidden) + " k=" + std::to_string(top_k);
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
        kernels::launch_gather_rows(d_x.get(), d_token_of_row.get(), d_offsets.get(), kNumExperts,
                                    num_rows, hidden, d_sorted.get(), nullptr);
        FP4MOE_CUDA_CHECK(cudaDeviceSynchronize());
        const std::vector<uint16_t> sorted = d_sorted.download();
        int64_t num_bad = 0;
        for (int64_t r = 0; r < num_rows && num_bad < 3; ++r) {
          const uint16_t* got = sorted.data() + r * hidden;
          if (r < num_placed) {
            const uint16_t* expected = x.data() + token_of_row[static_cast<size_t>(r)] * hidden;
            if (!std::equal(got, got + hidden, expected)) {
              ++num_bad;
              ADD_FAILURE() << what << ": row " << r << " differs from token "
                            << token_of_row[static_cast<size_t>(r)] << "'s row";
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
        const std::string what = "tokens=" + std::to_string(num_tokens) +
                                 " hidden=" + std::to_string(hidden) + " k=" + std::to_string(top_k);
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
        for (int i = 0; i < 8; ++i) x[any(rng)] = i % 2 ? 0x8000 : 0x0000;                 // +-0
        for (int i = 0; i < 4; ++i) x[any(rng)] = 0x0003;                                   // subnormal
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
        kernels::launch_gather_rows_fp4(d_x.get(), d_token_of_row.get(), d_offsets.get(), kNumExperts, num_rows,
                                        hidden, d_scales.get(), d_sorted.get(), nullptr);
        FP4MOE_CUDA_CHECK(cudaDeviceSynchronize());
        const std::vector<uint16_t> sorted = d_sorted.download();
        int64_t num_bad = 0;
        for (int64_t i = 0; i < num_placed * hidden && num_bad < 5; ++i) {
          const uint16_t got = sorted[static_cast<size_t>(i)], want = expected[static_cast<size_t>(i)];
          const bool both_nan = std::isnan(bf16_to_float(got)) && std::isnan(bf16_to_float(want));
          if (got == want || both_nan) continue;
          ++num_bad;
          const int64_t r = i / hidden;
          ADD_FAILURE() << what << ": row " << r << " (token " << token_of_row[static_cast<size_t>(r)]
                        << ") element " << i % hidden << ": got bf16 0x" << std::hex << got << ", expected 0x"
                        << want << std::dec << " (" << bf16_to_float(got) << " vs " << bf16_to_float(want)
                        << "; input " << bf16_to_float(x[static_cast<size_t>(token_of_row[static_cast<size_t>(r)] * hidden + i % hidden)])
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
  EXPECT_THROW(kernels::launch_gather_rows_fp4(x.get(), idx.get(), idx.get(), 8, 4, 24, scales.get(), sorted.get(),
                                               nullptr), Error);  // hidden not a multiple of 16
  EXPECT_THROW(kernels::launch_gather_rows_fp4(x.get(), idx.get(), idx.get(), 8, 4, 16, nullptr, sorted.get(),
                                               nullptr), Error);  // no input scales
  EXPECT_THROW(kernels::launch_gather_rows_fp4(x.get() + 1, idx.get(), idx.get(), 8, 4, 16, scales.get(),
                                               sorted.get(), nullptr), Error);
  // More experts than a layer has (kMaxExperts = 512).
  EXPECT_THROW(kernels::launch_gather_rows_fp4(x.get(), idx.get(), idx.get(), 513, 4, 16, scales.get(),
                                               sorted.get(), nullptr), Error);
  EXPECT_NO_THROW(kernels::launch_gather_rows_fp4(nullptr, nullptr, nullptr, 8, 0, 16, nullptr, nullptr, nullptr));
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
          const std::vector<float> gate = gated ? random_normal(static_cast<size_t>(hidden), rng, 0.05f)
                                                : std::vector<float>();
          const DeviceBuffer<int32_t> d_ids(ids);
          const DeviceBuffer<float> d_weights(weights), d_gate(gate);
          const DeviceBuffer<uint16_t> d_x(x);
          const int rows = top_k + num_shared;
          DeviceBuffer<int32_t> out_ids(static_cast<size_t>(num_tokens * rows));
          DeviceBuffer<float> out_weights(static_cast<size_t>(num_tokens * rows));
          out_ids.fill_bytes(0xFF);
          out_weights.fill_bytes(0xFF);
          kernels::launch_append_shared_slots(d_ids.get(), d_weights.get(), num_tokens, top_k, kNumExperts,
                                              num_shared, d_x.get(), gated ? d_gate.get() : nullptr, hidden,
                                              out_ids.get(), out_weights.get(), nullptr);
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
  EXPECT_THROW(kernels::launch_append_shared_slots(idx.get(), w.get(), 1, 30, 60, 3, nullptr, nullptr, 64,
                                                   idx.get(), w.get(), nullptr),
               Error);  // 33 rows per token
  EXPECT_THROW(kernels::launch_append_shared_slots(idx.get(), w.get(), 1, 2, 511, 2, nullptr, nullptr, 64,
                                                   idx.get(), w.get(), nullptr),
               Error);  // 513 experts
  EXPECT_THROW(kernels::launch_append_shared_slots(idx.get(), w.get(), 1, 2, 60, 2, nullptr, w.get(), 64,
                                                   idx.get(), w.get(), nullptr),
               Error);  // a gate without hidden states
}

// ---------------------------------------------------------------- finalize

// The host twin of finalize_pairs: fp32 from 0.0f in slot order, then bf16
// round-to-nearest-even; the device must match it bit for bit.
std::vector<uint16_t> host_finalize_pairs(const std::vector<float>& pair_rows,
                                          const std::vector<int32_t>& ids, int64_t num_tokens,
                                          int top_k, int64_t num_experts, int64_t hidden) {
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

void expect_bits_equal(const std::vector<uint16_t>& got, const std::vector<uint16_t>& expected,
                       int64_t hidden, const std::string& what) {
  ASSERT_EQ(got.size(), expected.size()) << what;
  int64_t num_bad = 0;
  for (size_t i = 0; i < got.size(); ++i)
    if (got[i] != expected[i] && num_bad++ < 3)
      ADD_FAILURE() << what << ": [" << i / hidden << ", " << i % hidden << "] got 0x" << std::hex
                    << got[i] << " (" << bf16_to_float(got[i]) << "), expected 0x" << expected[i]
                    << " (" << bf16_to_float(expected[i]) << ")" << std::dec;
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
        const std::string what = "tokens=" + std::to_string(num_tokens) + " k=" +
                                 std::to_string(top_k) + " hidden=" + std::to_string(hidden);
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
          kernels::launch_finalize_pairs(d_rows.get(), d_ids.get(), num_tokens, top_k, kNumExperts,
                                         hidden, d_out.get(), nullptr);
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
  EXPECT_THROW(kernels::launch_finalize_pairs(rows.get(), ids.get(), 2, kernels::kMaxTopK + 1, 64, 8,
                                              out.get(), nullptr), Error);
  EXPECT_THROW(kernels::launch_finalize_pairs(rows.get(), ids.get(), 2, 0, 8, 8, out.get(), nullptr), Error);
  EXPECT_THROW(kernels::launch_finalize_pairs(rows.get() + 1, ids.get(), 2, 2, 8, 8, out.get(), nullptr), Error);
  EXPECT_THROW(kernels::launch_finalize_pairs(nullptr, ids.get(), 2, 2, 8, 8, out.get(), nullptr), Error);
  EXPECT_THROW(kernels::launch_finalize_accumulated(rows.get(), 2, 6, out.get(), nullptr), Error);
  EXPECT_THROW(kernels::launch_finalize_accumulated(rows.get(), 2, 8, out.get() + 1, nullptr), Error);
  EXPECT_NO_THROW(kernels::launch_finalize_pairs(nullptr, nullptr, 0, 2, 8, 8, nullptr, nullptr));
  EXPECT_NO_THROW(kernels::launch_finalize_accumulated(nullptr, 0, 8, nullptr, nullptr));
}

// ------------------------------------------------------------------- graph

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
  const DeviceBuffer<float> d_pair_rows(random_normal(num_pairs * kHidden, rng));
  DeviceBuffer<int32_t> d_ids(num_pairs), d_offsets(kExperts + 1), d_token_of_row(num_pairs),
      d_pair_of_row(num_pairs), d_error(std::vector<int32_t>{0}),
      d_scratch(static_cast<size_t>(kernels::sort_scratch_ints(num_pairs, kExperts)));
  DeviceBuffer<float> d_weights(num_pairs);
  DeviceBuffer<uint16_t> d_sorted(num_pairs * kHidden), d_out(kTokens * kHidden);

  auto forward = [&](cudaStream_t stream) {
    kernels::launch_route(d_logits.get(), d_bias.get(), kTokens, kExperts, p, d_ids.get(),
                          d_weights.get(), stream);
    kernels::launch_sort_by_expert(d_ids.get(), kTokens, p.top_k, kExperts, d_offsets.get(),
                                   d_token_of_row.get(), d_pair_of_row.get(), d_error.get(), d_scratch.get(), stream);
    kernels::launch_gather_rows(d_x.get(), d_token_of_row.get(), d_offsets.get(), kExperts,
                                num_pairs, kHidden, d_sorted.get(), stream);
    kernels::launch_finalize_pairs(d_pair_rows.get(), d_ids.get(), kTokens, p.top_k, kExperts,
                                   kHidden, d_out.get(), stream);
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
