// CPU reference routing (docs/design.md §3): softmax top-k, DeepSeek-V3/GLM
// noaux_tc grouped selection and gpt-oss top-k-then-softmax, plus validation
// of caller-given routing. Scores are computed in double and ranked with one
// comparator, so the tie rule documented in reference.hpp holds everywhere.
// Non-finite logits exclude their expert (docs/design.md §3), exactly as the
// GPU routing kernels do.
// Tested in tests/ref/test_reference.cpp (hand-made logits per mode, ties,
// non-finite logits, error messages, and an independent full-sort
// implementation).
#include <algorithm>
#include <climits>
#include <cmath>
#include <limits>
#include <numeric>

#include "fp4moe/error.hpp"
#include "fp4moe/reference.hpp"
#include "ref/routing_checks.hpp"

namespace fp4moe {
namespace {

// Orders candidates by descending score, ties by ascending index: the tie
// rule of reference.hpp. Scores are finite or -inf (an excluded expert, or a
// group whose best experts are excluded), never NaN, so this is a strict weak
// ordering.
struct RanksHigher {
  const std::vector<double>& score;
  bool operator()(int a, int b) const { return score[a] > score[b] || (score[a] == score[b] && a < b); }
};

// The k best of `candidates` under RanksHigher, in rank order.
std::vector<int> top_k_of(std::vector<int> candidates, const std::vector<double>& score, int k) {
  std::partial_sort(candidates.begin(), candidates.begin() + k, candidates.end(), RanksHigher{score});
  candidates.resize(static_cast<size_t>(k));
  return candidates;
}

std::vector<int> iota_vector(int64_t n) {
  std::vector<int> v(static_cast<size_t>(n));
  std::iota(v.begin(), v.end(), 0);
  return v;
}

// (token, slot) pairs and expert ids are int32 on the GPU; the reference
// keeps the same limits, checked before any product is formed.
constexpr int64_t kMaxRoutedPairs = int64_t{1} << 31;
constexpr int64_t kMaxRoutedExperts = INT32_MAX;

void validate_params(int64_t num_tokens, int64_t num_experts, const RoutingParams& p) {
  FP4MOE_CHECK(num_tokens >= 1, "route: num_tokens = ", num_tokens, "; expected >= 1");
  FP4MOE_CHECK(num_experts >= 1, "route: num_experts = ", num_experts, "; expected >= 1");
  FP4MOE_CHECK(num_experts <= kMaxRoutedExperts, "route: num_experts = ", num_experts,
               "; expected <= ", kMaxRoutedExperts, " (ids are int32)");
  FP4MOE_CHECK(p.top_k >= 1 && p.top_k <= num_experts, "route: top_k = ", p.top_k,
               "; expected in [1, num_experts = ", num_experts, "]");
  // Before the outputs are allocated: the GPU layer's limit.
  FP4MOE_CHECK(num_tokens < kMaxRoutedPairs / p.top_k, "route: num_tokens = ", num_tokens, " with top_k = ", p.top_k,
               "; expected num_tokens * top_k < 2^31");
  if (p.mode == RoutingMode::kNoauxTc) check_noaux_tc_params("route", num_experts, p);
}

// Fills one token's ids and weights from the chosen experts (in rank order)
// and their unnormalised weights.
void store(Routing& r, int64_t token, const std::vector<int>& chosen, const std::vector<double>& weight) {
  for (int j = 0; j < r.top_k; ++j) {
    const size_t slot = static_cast<size_t>(token * r.top_k + j);
    r.topk_ids[slot] = chosen[static_cast<size_t>(j)];
    r.topk_weights[slot] = static_cast<float>(weight[static_cast<size_t>(j)]);
  }
}

constexpr double kExcluded = -std::numeric_limits<double>::infinity();

// The ranking key of a logit: itself, or -inf for a non-finite logit, which
// excludes its expert (ranked after every finite one, weight 0).
double logit_key(float logit) { return std::isfinite(logit) ? static_cast<double>(logit) : kExcluded; }

// Experts rank by logit, which orders them as their probabilities do (exp is
// monotonic) and keeps apart logits whose probabilities both underflow.
void route_softmax(const float* logits, int64_t num_experts, const RoutingParams& p, std::vector<double>& key,
                   std::vector<double>& prob, std::vector<int>& chosen, std::vector<double>& weight) {
  for (int64_t e = 0; e < num_experts; ++e) key[e] = logit_key(logits[e]);
  chosen = top_k_of(iota_vector(num_experts), key, p.top_k);
  const double max_key = key[chosen[0]];
  if (max_key == kExcluded) {  // no finite logit: nothing is routed
    std::fill(weight.begin(), weight.end(), 0.0);
    return;
  }
  double sum = 0.0;
  for (int64_t e = 0; e < num_experts; ++e) {
    prob[e] = key[e] == kExcluded ? 0.0 : std::exp(key[e] - max_key);
    sum += prob[e];
  }
  for (double& v : prob) v /= sum;
  double chosen_sum = 0.0;
  for (int j = 0; j < p.top_k; ++j) chosen_sum += prob[chosen[j]];
  for (int j = 0; j < p.top_k; ++j) weight[j] = p.renormalize ? prob[chosen[j]] / chosen_sum : prob[chosen[j]];
}

void route_noaux_tc(const float* logits, int64_t num_experts, const float* correction_bias, const RoutingParams& p,
                    std::vector<double>& score, std::vector<double>& choice, std::vector<int>& chosen,
                    std::vector<double>& weight) {
  for (int64_t e = 0; e < num_experts; ++e) {
    if (!std::isfinite(logits[e])) {  // excluded: ranks last, weighs nothing
      score[e] = 0.0;
      choice[e] = kExcluded;
      continue;
    }
    score[e] = 1.0 / (1.0 + std::exp(-static_cast<double>(logits[e])));
    choice[e] = score[e] + (correction_bias ? static_cast<double>(correction_bias[e]) : 0.0);
  }
  const int64_t group_size = num_experts / p.num_groups;
  std::vector<double> group_score(static_cast<size_t>(p.num_groups));
  for (int g = 0; g < p.num_groups; ++g) {
    std::vector<int> members(static_cast<size_t>(group_size));
    std::iota(members.begin(), members.end(), static_cast<int>(g * group_size));
    const std::vector<int> best2 = top_k_of(std::move(members), choice, 2);
    group_score[g] = choice[best2[0]] + choice[best2[1]];
  }
  const std::vector<int> kept_groups = top_k_of(iota_vector(p.num_groups), group_score, p.topk_groups);
  std::vector<int> candidates;
  for (int g : kept_groups)
    for (int64_t i = 0; i < group_size; ++i) candidates.push_back(static_cast<int>(g * group_size + i));
  chosen = top_k_of(std::move(candidates), choice, p.top_k);
  double chosen_sum = 0.0;
  for (int j = 0; j < p.top_k; ++j) chosen_sum += score[chosen[j]];
  for (int j = 0; j < p.top_k; ++j) weight[j] = score[chosen[j]] / (chosen_sum + 1e-20) * p.routed_scaling_factor;
}

void route_gptoss(const float* logits, int64_t num_experts, const RoutingParams& p, std::vector<double>& logit,
                  std::vector<int>& chosen, std::vector<double>& weight) {
  for (int64_t e = 0; e < num_experts; ++e) logit[e] = logit_key(logits[e]);
  chosen = top_k_of(iota_vector(num_experts), logit, p.top_k);
  const double max_logit = logit[chosen[0]];  // the first chosen is the largest
  if (max_logit == kExcluded) {               // no finite logit: nothing is routed
    std::fill(weight.begin(), weight.end(), 0.0);
    return;
  }
  double sum = 0.0;
  for (int j = 0; j < p.top_k; ++j) {
    const double v = logit[chosen[j]];
    weight[j] = v == kExcluded ? 0.0 : std::exp(v - max_logit);
    sum += weight[j];
  }
  for (int j = 0; j < p.top_k; ++j) weight[j] /= sum;
}

}  // namespace

void check_noaux_tc_params(const char* op, int64_t num_experts, const RoutingParams& p) {
  FP4MOE_CHECK(p.num_groups >= 1 && num_experts % p.num_groups == 0, op, "(noaux_tc): num_groups = ", p.num_groups,
               "; expected a positive divisor of num_experts = ", num_experts);
  const int64_t group_size = num_experts / p.num_groups;
  FP4MOE_CHECK(group_size >= 2, op, "(noaux_tc): num_groups = ", p.num_groups, " gives ", group_size,
               " expert(s) per group for num_experts = ", num_experts,
               "; expected >= 2 per group (a group scores the sum of its top 2)");
  FP4MOE_CHECK(p.topk_groups >= 1 && p.topk_groups <= p.num_groups, op, "(noaux_tc): topk_groups = ", p.topk_groups,
               "; expected in [1, num_groups = ", p.num_groups, "]");
  FP4MOE_CHECK(p.topk_groups * group_size >= p.top_k, op, "(noaux_tc): topk_groups = ", p.topk_groups, " keeps ",
               p.topk_groups * group_size, " experts (groups of ", group_size, "); expected >= top_k = ", p.top_k);
  FP4MOE_CHECK(std::isfinite(p.routed_scaling_factor) && p.routed_scaling_factor > 0.0f, op,
               "(noaux_tc): routed_scaling_factor = ", p.routed_scaling_factor, "; expected finite and > 0");
}

std::string to_string(RoutingMode mode) {
  switch (mode) {
    case RoutingMode::kSoftmaxTopK:
      return "softmax";
    case RoutingMode::kNoauxTc:
      return "noaux_tc";
    case RoutingMode::kGptOss:
      return "gptoss";
  }
  FP4MOE_THROW("to_string: unknown RoutingMode ", static_cast<int>(mode));
}

RoutingMode parse_routing_mode(const std::string& name) {
  for (RoutingMode mode : {RoutingMode::kSoftmaxTopK, RoutingMode::kNoauxTc, RoutingMode::kGptOss})
    if (to_string(mode) == name) return mode;
  FP4MOE_THROW("unknown routing mode '", name, "'; expected one of: softmax, noaux_tc, gptoss");
}

Routing route(const float* router_logits, int64_t num_tokens, int64_t num_experts, const float* correction_bias,
              const RoutingParams& params) {
  validate_params(num_tokens, num_experts, params);
  FP4MOE_CHECK(router_logits != nullptr, "route: router_logits is null");
  // Non-finite logits are activations, not parameters: they exclude their
  // expert (as on the GPU) and are counted, never refused.
  if (params.mode == RoutingMode::kNoauxTc && correction_bias != nullptr)
    for (int64_t e = 0; e < num_experts; ++e)
      FP4MOE_CHECK(std::isfinite(correction_bias[e]), "route(noaux_tc): correction_bias[", e,
                   "] = ", correction_bias[e], "; expected finite");

  Routing r;
  r.num_tokens = num_tokens;
  r.top_k = params.top_k;
  r.topk_ids.resize(static_cast<size_t>(num_tokens * params.top_k));
  r.topk_weights.resize(r.topk_ids.size());
  std::vector<double> score(static_cast<size_t>(num_experts));
  std::vector<double> choice(static_cast<size_t>(num_experts));
  std::vector<double> key(static_cast<size_t>(num_experts));
  std::vector<double> weight(static_cast<size_t>(params.top_k));
  std::vector<int> chosen;
  for (int64_t t = 0; t < num_tokens; ++t) {
    const float* logits = router_logits + t * num_experts;
    if (!std::all_of(logits, logits + num_experts, [](float v) { return std::isfinite(v); }))
      ++r.tokens_with_nonfinite_logits;
    switch (params.mode) {
      case RoutingMode::kSoftmaxTopK:
        route_softmax(logits, num_experts, params, key, score, chosen, weight);
        break;
      case RoutingMode::kNoauxTc:
        route_noaux_tc(logits, num_experts, correction_bias, params, score, choice, chosen, weight);
        break;
      case RoutingMode::kGptOss:
        route_gptoss(logits, num_experts, params, score, chosen, weight);
        break;
      default:
        FP4MOE_THROW("route: unknown RoutingMode ", static_cast<int>(params.mode));
    }
    store(r, t, chosen, weight);
  }
  return r;
}

void validate_routing(const Routing& routing, int64_t num_experts) {
  FP4MOE_CHECK(num_experts >= 1, "routing: num_experts = ", num_experts, "; expected >= 1");
  FP4MOE_CHECK(routing.num_tokens >= 0, "routing: num_tokens = ", routing.num_tokens, "; expected >= 0");
  FP4MOE_CHECK(routing.top_k >= 1 && routing.top_k <= num_experts, "routing: top_k = ", routing.top_k,
               "; expected in [1, num_experts = ", num_experts, "]");
  FP4MOE_CHECK(routing.num_tokens < kMaxRoutedPairs / routing.top_k, "routing: num_tokens = ", routing.num_tokens,
               " with top_k = ", routing.top_k, "; expected num_tokens * top_k < 2^31");
  const size_t expected = static_cast<size_t>(routing.num_tokens * routing.top_k);
  FP4MOE_CHECK(routing.topk_ids.size() == expected, "routing: topk_ids has ", routing.topk_ids.size(),
               " entries; expected num_tokens * top_k = ", routing.num_tokens, " * ", routing.top_k, " = ", expected);
  FP4MOE_CHECK(routing.topk_weights.size() == expected, "routing: topk_weights has ", routing.topk_weights.size(),
               " entries; expected num_tokens * top_k = ", routing.num_tokens, " * ", routing.top_k, " = ", expected);
  for (int64_t t = 0; t < routing.num_tokens; ++t) {
    for (int j = 0; j < routing.top_k; ++j) {
      const size_t slot = static_cast<size_t>(t * routing.top_k + j);
      const int32_t id = routing.topk_ids[slot];
      FP4MOE_CHECK(id >= 0 && id < num_experts, "routing: token ", t, " slot ", j, ": expert id ", id,
                   " out of range; expected in [0, ", num_experts, ")");
      for (int i = 0; i < j; ++i)
        FP4MOE_CHECK(routing.topk_ids[static_cast<size_t>(t * routing.top_k + i)] != id, "routing: token ", t, " slot ",
                     j, ": expert id ", id, " duplicates slot ", i, "; expected distinct experts per token");
      const float w = routing.topk_weights[slot];
      FP4MOE_CHECK(std::isfinite(w), "routing: token ", t, " slot ", j, ": weight ", w, " is not finite");
    }
  }
}

}  // namespace fp4moe
