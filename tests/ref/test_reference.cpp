// Tests of the CPU reference (src/ref): routing with hand-made logits for
// every mode (known ids and weights, ties to the lower index, noaux_tc's group
// restriction), error messages for bad parameters and bad caller routing, a
// hand-computed expert MLP for both activations, and random problems checked
// against a naive path written here independently: every matrix dequantised
// to floats with the plain NVFP4 formula, triple loops, and routing by full
// sort. The naive path shares no code with src/ref.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "expect_error.hpp"
#include "fp4moe/error.hpp"
#include "fp4moe/nvfp4.hpp"
#include "fp4moe/nvfp4_activation.hpp"
#include "fp4moe/reference.hpp"

namespace fp4moe {
namespace {

// ------------------------------------------------------------------ helpers

// e4m3fn codes of a few exact block scales.
constexpr uint8_t kScaleOne = 0x38;  // 1.0
constexpr uint8_t kScaleTwo = 0x40;  // 2.0

// A random NVFP4 matrix built in the quantised domain: any fp4 codes, block
// scales among e4m3 codes 0x28..0x40 (0.25..2), and a global scale chosen so
// that a dot product with unit-normal inputs is of order 1..10 (so the gpt-oss
// clamps at 7 are exercised).
Nvfp4Matrix random_matrix(int64_t rows, int64_t cols, std::mt19937_64& rng) {
  Nvfp4Matrix m;
  m.rows = rows;
  m.cols = cols;
  m.packed.resize(static_cast<size_t>(rows * cols / 2));
  m.scales.resize(static_cast<size_t>(rows * cols / 16));
  std::uniform_int_distribution<int> scale(0x28, 0x40);
  for (size_t i = 0; i < m.packed.size(); i += 8) {  // any codes: 8 random bytes at a time
    const uint64_t bits = rng();
    std::memcpy(m.packed.data() + i, &bits, std::min<size_t>(8, m.packed.size() - i));
  }
  for (uint8_t& s : m.scales) s = static_cast<uint8_t>(scale(rng));
  m.global_scale = std::uniform_real_distribution<float>(0.3f, 2.5f)(rng) / std::sqrt(static_cast<float>(cols));
  return m;
}

std::vector<float> random_vector(size_t n, float stddev, std::mt19937_64& rng) {
  std::normal_distribution<float> dist(0.0f, stddev);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

MoeWeights random_weights(int64_t num_experts, int64_t hidden, int64_t inter, bool with_bias, std::mt19937_64& rng) {
  MoeWeights w;
  w.num_experts = num_experts;
  w.hidden = hidden;
  w.inter = inter;
  for (int64_t e = 0; e < num_experts; ++e) {
    ExpertWeights ex;
    ex.gate = random_matrix(inter, hidden, rng);
    ex.up = random_matrix(inter, hidden, rng);
    ex.up.global_scale = ex.gate.global_scale;  // shared weight_scale_2, as in ModelOpt
    ex.down = random_matrix(hidden, inter, rng);
    if (with_bias) {
      ex.gate_bias = random_vector(static_cast<size_t>(inter), 1.0f, rng);
      ex.up_bias = random_vector(static_cast<size_t>(inter), 1.0f, rng);
      ex.down_bias = random_vector(static_cast<size_t>(hidden), 1.0f, rng);
    }
    w.experts.push_back(std::move(ex));
  }
  return w;
}

// ------------------------------------------------------------- naive path

// The plain formula, element by element: e2m1(code) * e4m3(scale) * global,
// evaluated in double, where it is exact. (Rounded to float it would be off by
// up to 2^-24 relative per weight, which after cancellation in the dot products
// moves single outputs by a few 1e-6 relative: more than this test allows.)
std::vector<double> naive_dequantize(const Nvfp4Matrix& m) {
  std::vector<double> out(static_cast<size_t>(m.rows * m.cols));
  for (int64_t r = 0; r < m.rows; ++r)
    for (int64_t c = 0; c < m.cols; ++c) {
      const uint8_t byte = m.packed[static_cast<size_t>(r * m.cols / 2 + c / 2)];
      const uint8_t code = c % 2 == 0 ? (byte & 0xF) : (byte >> 4);
      const uint8_t scale = m.scales[static_cast<size_t>(r * m.cols / 16 + c / 16)];
      out[static_cast<size_t>(r * m.cols + c)] =
          static_cast<double>(e2m1_to_float(code)) * e4m3_to_float(scale) * m.global_scale;
    }
  return out;
}

// Expert indices sorted by descending key, ties to the lower index.
std::vector<int> sorted_by(const std::vector<double>& key, std::vector<int> idx) {
  std::stable_sort(idx.begin(), idx.end(), [&](int a, int b) { return key[a] > key[b]; });
  return idx;
}

std::vector<int> all_indices(int n) {
  std::vector<int> v(static_cast<size_t>(n));
  std::iota(v.begin(), v.end(), 0);
  return v;
}

Routing naive_route(const std::vector<float>& logits, int num_tokens, int num_experts, const float* bias,
                    const RoutingParams& p) {
  Routing r;
  r.num_tokens = num_tokens;
  r.top_k = p.top_k;
  for (int t = 0; t < num_tokens; ++t) {
    std::vector<double> l(logits.begin() + t * num_experts, logits.begin() + (t + 1) * num_experts);
    std::vector<int> ids;
    std::vector<double> w;
    if (p.mode == RoutingMode::kSoftmaxTopK) {
      const double m = *std::max_element(l.begin(), l.end());
      std::vector<double> prob(l.size());
      double total = 0;
      for (size_t e = 0; e < l.size(); ++e) total += prob[e] = std::exp(l[e] - m);
      for (double& v : prob) v /= total;
      const std::vector<int> order = sorted_by(prob, all_indices(num_experts));
      ids.assign(order.begin(), order.begin() + p.top_k);
      double chosen = 0;
      for (int id : ids) chosen += prob[id];
      for (int id : ids) w.push_back(p.renormalize ? prob[id] / chosen : prob[id]);
    } else if (p.mode == RoutingMode::kGptOss) {
      const std::vector<int> order = sorted_by(l, all_indices(num_experts));
      ids.assign(order.begin(), order.begin() + p.top_k);
      double total = 0;
      for (int id : ids) total += std::exp(l[id] - l[ids[0]]);
      for (int id : ids) w.push_back(std::exp(l[id] - l[ids[0]]) / total);
    } else {
      std::vector<double> s(l.size()), c(l.size());
      for (size_t e = 0; e < l.size(); ++e) {
        s[e] = 1.0 / (1.0 + std::exp(-l[e]));
        c[e] = s[e] + (bias ? bias[e] : 0.0);
      }
      const int size = num_experts / p.num_groups;
      std::vector<double> group(static_cast<size_t>(p.num_groups));
      for (int g = 0; g < p.num_groups; ++g) {
        std::vector<double> members(c.begin() + g * size, c.begin() + (g + 1) * size);
        std::sort(members.begin(), members.end(), std::greater<double>());
        group[g] = members[0] + members[1];
      }
      const std::vector<int> group_order = sorted_by(group, all_indices(p.num_groups));
      std::vector<double> masked(c.size(), -1e300);
      for (int i = 0; i < p.topk_groups; ++i)
        for (int e = group_order[i] * size; e < (group_order[i] + 1) * size; ++e) masked[e] = c[e];
      const std::vector<int> order = sorted_by(masked, all_indices(num_experts));
      ids.assign(order.begin(), order.begin() + p.top_k);
      double total = 0;
      for (int id : ids) total += s[id];
      for (int id : ids) w.push_back(s[id] / (total + 1e-20) * p.routed_scaling_factor);
    }
    for (int j = 0; j < p.top_k; ++j) {
      r.topk_ids.push_back(ids[j]);
      r.topk_weights.push_back(static_cast<float>(w[j]));
    }
  }
  return r;
}

double naive_activation(Activation a, double g, double u) {
  if (a == Activation::kSwiGLU) return g / (1.0 + std::exp(-g)) * u;
  const double gc = g > 7.0 ? 7.0 : g;
  const double uc = u > 7.0 ? 7.0 : (u < -7.0 ? -7.0 : u);
  return gc / (1.0 + std::exp(-1.702 * gc)) * (uc + 1.0);
}

// W4A4: v[0, n) quantised per 16-block against input_scale s (the
// quantiser of nvfp4_activation.hpp, itself checked bit for bit in
// tests/format/test_nvfp4_activation.cpp), as q * e4m3 * s in double.
std::vector<double> naive_fp4(const std::vector<double>& v, float s) {
  std::vector<double> out(v.size());
  for (size_t b = 0; b < v.size(); b += 16) {
    float block[16], unscaled[16];
    uint8_t codes[16];
    for (int i = 0; i < 16; ++i) block[i] = static_cast<float>(v[b + i]);
    nvfp4_act_quantize_block(block, s, codes, unscaled);
    for (int i = 0; i < 16; ++i) out[b + i] = static_cast<double>(unscaled[i]) * s;
  }
  return out;
}

std::vector<double> naive_moe(const MoeWeights& w, const std::vector<float>& x, const Routing& r, Activation a,
                              bool fp4 = false) {
  const int64_t H = w.hidden, I = w.inter;
  std::vector<double> out(static_cast<size_t>(r.num_tokens * H), 0.0);
  for (int64_t e = 0; e < w.num_experts; ++e) {
    const ExpertWeights& ex = w.experts[static_cast<size_t>(e)];
    const std::vector<double> gate = naive_dequantize(ex.gate), up = naive_dequantize(ex.up),
                              down = naive_dequantize(ex.down);
    for (int64_t t = 0; t < r.num_tokens; ++t)
      for (int j = 0; j < r.top_k; ++j) {
        if (r.topk_ids[static_cast<size_t>(t * r.top_k + j)] != e) continue;
        std::vector<double> h(static_cast<size_t>(I));
        std::vector<double> xt(x.begin() + t * H, x.begin() + (t + 1) * H);
        if (fp4) xt = naive_fp4(xt, std::max(ex.gate.input_scale, ex.up.input_scale));
        for (int64_t i = 0; i < I; ++i) {
          double g = ex.gate_bias.empty() ? 0.0 : ex.gate_bias[i];
          double u = ex.up_bias.empty() ? 0.0 : ex.up_bias[i];
          for (int64_t k = 0; k < H; ++k) {
            g += gate[i * H + k] * xt[k];
            u += up[i * H + k] * xt[k];
          }
          h[i] = naive_activation(a, g, u);
        }
        if (fp4) h = naive_fp4(h, ex.down.input_scale);
        for (int64_t n = 0; n < H; ++n) {
          double y = ex.down_bias.empty() ? 0.0 : ex.down_bias[n];
          for (int64_t i = 0; i < I; ++i) y += down[n * I + i] * h[i];
          out[t * H + n] += r.topk_weights[static_cast<size_t>(t * r.top_k + j)] * y;
        }
      }
  }
  return out;
}

// ‖out − ref‖/‖ref‖ < tol and, per element, |out − ref| <= tol·(|ref| + max|ref|·1e-3)
// (the small absolute part covers elements that cancel to near zero). Prints
// the first mismatches with their indices.
void expect_close(const std::vector<float>& out, const std::vector<double>& ref, int64_t cols, double tol) {
  ASSERT_EQ(out.size(), ref.size());
  double diff2 = 0, ref2 = 0, ref_max = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    diff2 += (out[i] - ref[i]) * (out[i] - ref[i]);
    ref2 += ref[i] * ref[i];
    ref_max = std::max(ref_max, std::fabs(ref[i]));
  }
  ASSERT_GT(ref2, 0.0) << "reference is all zeros: the test data is degenerate";
  EXPECT_LT(std::sqrt(diff2 / ref2), tol) << "relative L2 error";
  int shown = 0, bad = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    if (std::fabs(out[i] - ref[i]) <= tol * (std::fabs(ref[i]) + 1e-3 * ref_max)) continue;
    if (shown++ < 8)
      ADD_FAILURE() << "mismatch at [" << i / cols << ", " << i % cols << "]: got " << out[i] << ", expected "
                    << ref[i];
    ++bad;
  }
  EXPECT_EQ(bad, 0) << "elements out of tolerance";
}

// ------------------------------------------------------------ routing: hand

Routing route_one(std::vector<float> logits, const RoutingParams& p, const std::vector<float>& bias = {}) {
  return route(logits.data(), 1, static_cast<int64_t>(logits.size()), bias.empty() ? nullptr : bias.data(), p);
}

double sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }

TEST(ReferenceRouting, SoftmaxTopKTiesGoToLowerIndex) {
  RoutingParams p;
  p.mode = RoutingMode::kSoftmaxTopK;
  p.top_k = 2;
  p.renormalize = true;
  Routing r = route_one({1.0f, 3.0f, 2.0f, 3.0f}, p);
  EXPECT_EQ(r.topk_ids, (std::vector<int32_t>{1, 3}));
  EXPECT_FLOAT_EQ(r.topk_weights[0], 0.5f);
  EXPECT_FLOAT_EQ(r.topk_weights[1], 0.5f);

  p.top_k = 3;
  p.renormalize = false;
  r = route_one({1.0f, 3.0f, 2.0f, 3.0f}, p);
  EXPECT_EQ(r.topk_ids, (std::vector<int32_t>{1, 3, 2}));
  const double total = std::exp(1.0) + 2 * std::exp(3.0) + std::exp(2.0);
  EXPECT_FLOAT_EQ(r.topk_weights[0], static_cast<float>(std::exp(3.0) / total));
  EXPECT_FLOAT_EQ(r.topk_weights[2], static_cast<float>(std::exp(2.0) / total));

  // All equal: the lowest indices, in order.
  p.top_k = 3;
  r = route_one({0.5f, 0.5f, 0.5f, 0.5f, 0.5f}, p);
  EXPECT_EQ(r.topk_ids, (std::vector<int32_t>{0, 1, 2}));
  EXPECT_FLOAT_EQ(r.topk_weights[0], 0.2f);
}

TEST(ReferenceRouting, SoftmaxRenormalisedWeights) {
  RoutingParams p;
  p.top_k = 2;
  p.renormalize = true;
  const Routing r = route_one({0.0f, 1.0f, -2.0f, 2.0f}, p);
  EXPECT_EQ(r.topk_ids, (std::vector<int32_t>{3, 1}));
  EXPECT_FLOAT_EQ(r.topk_weights[0], static_cast<float>(1.0 / (1.0 + std::exp(-1.0))));
  EXPECT_FLOAT_EQ(r.topk_weights[1], static_cast<float>(std::exp(-1.0) / (1.0 + std::exp(-1.0))));
}

TEST(ReferenceRouting, GptOssSoftmaxOverSelected) {
  RoutingParams p;
  p.mode = RoutingMode::kGptOss;
  p.top_k = 3;
  const Routing r = route_one({0.5f, 2.0f, -1.0f, 2.0f, 1.0f}, p);
  EXPECT_EQ(r.topk_ids, (std::vector<int32_t>{1, 3, 4}));
  const double total = 2.0 + std::exp(-1.0);
  EXPECT_FLOAT_EQ(r.topk_weights[0], static_cast<float>(1.0 / total));
  EXPECT_FLOAT_EQ(r.topk_weights[1], static_cast<float>(1.0 / total));
  EXPECT_FLOAT_EQ(r.topk_weights[2], static_cast<float>(std::exp(-1.0) / total));
}

TEST(ReferenceRouting, NoauxTcDropsBestExpertInDroppedGroup) {
  RoutingParams p;
  p.mode = RoutingMode::kNoauxTc;
  p.top_k = 2;
  p.num_groups = 4;  // groups {0,1} {2,3} {4,5} {6,7}
  p.topk_groups = 2;
  p.routed_scaling_factor = 2.5f;
  // Group sums of sigmoid scores: g0 = s(5)+s(-5) = 1.0, g1 = 2 s(1) = 1.46,
  // g2 = s(2)+s(0) = 1.38, g3 = 2 s(-1) = 0.54. Expert 0 has the best score
  // but its group is dropped; experts 2 and 3 tie, so 2 wins.
  const Routing r = route_one({5.0f, -5.0f, 1.0f, 1.0f, 2.0f, 0.0f, -1.0f, -1.0f}, p);
  EXPECT_EQ(r.topk_ids, (std::vector<int32_t>{4, 2}));
  const double s4 = sigmoid(2.0), s2 = sigmoid(1.0);
  EXPECT_FLOAT_EQ(r.topk_weights[0], static_cast<float>(s4 / (s4 + s2) * 2.5));
  EXPECT_FLOAT_EQ(r.topk_weights[1], static_cast<float>(s2 / (s4 + s2) * 2.5));

  // With all groups kept, expert 0 is chosen first.
  p.topk_groups = 4;
  EXPECT_EQ(route_one({5.0f, -5.0f, 1.0f, 1.0f, 2.0f, 0.0f, -1.0f, -1.0f}, p).topk_ids, (std::vector<int32_t>{0, 4}));
}

TEST(ReferenceRouting, NoauxTcBiasSelectsButDoesNotWeigh) {
  RoutingParams p;
  p.mode = RoutingMode::kNoauxTc;
  p.top_k = 2;
  p.num_groups = 1;
  p.topk_groups = 1;
  p.routed_scaling_factor = 1.5f;
  // Choice scores s + b: 0.88, 1.5, 0.73, 0.77 -> experts 1 then 0.
  const Routing r = route_one({2.0f, 0.0f, 1.0f, -1.0f}, p, {0.0f, 1.0f, 0.0f, 0.5f});
  EXPECT_EQ(r.topk_ids, (std::vector<int32_t>{1, 0}));
  const double s0 = sigmoid(2.0), s1 = 0.5;
  EXPECT_FLOAT_EQ(r.topk_weights[0], static_cast<float>(s1 / (s0 + s1) * 1.5));
  EXPECT_FLOAT_EQ(r.topk_weights[1], static_cast<float>(s0 / (s0 + s1) * 1.5));
  // Without bias the order follows the scores.
  EXPECT_EQ(route_one({2.0f, 0.0f, 1.0f, -1.0f}, p).topk_ids, (std::vector<int32_t>{0, 2}));
}

TEST(ReferenceRouting, NoauxTcGroupTiesGoToLowerGroup) {
  RoutingParams p;
  p.mode = RoutingMode::kNoauxTc;
  p.top_k = 3;
  p.num_groups = 3;
  p.topk_groups = 2;
  const Routing r = route_one({0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f}, p);
  EXPECT_EQ(r.topk_ids, (std::vector<int32_t>{0, 1, 2}));
  for (float w : r.topk_weights) EXPECT_FLOAT_EQ(w, 1.0f / 3.0f);
}

TEST(ReferenceRouting, MultipleTokensAreIndependent) {
  RoutingParams p;
  p.top_k = 1;
  const std::vector<float> logits = {0.0f, 1.0f, 2.0f, 2.0f, 1.0f, 0.0f};
  const Routing r = route(logits.data(), 2, 3, nullptr, p);
  EXPECT_EQ(r.num_tokens, 2);
  EXPECT_EQ(r.top_k, 1);
  EXPECT_EQ(r.topk_ids, (std::vector<int32_t>{2, 0}));
  EXPECT_FLOAT_EQ(r.topk_weights[1], 1.0f);
}

TEST(ReferenceRouting, ModeNamesRoundTrip) {
  for (RoutingMode m : {RoutingMode::kSoftmaxTopK, RoutingMode::kNoauxTc, RoutingMode::kGptOss})
    EXPECT_EQ(parse_routing_mode(to_string(m)), m);
  EXPECT_EQ(to_string(RoutingMode::kNoauxTc), "noaux_tc");
  expect_error([] { parse_routing_mode("topk"); }, {"'topk'", "softmax", "noaux_tc", "gptoss"});
}

// ---------------------------------------------------------- routing: errors

TEST(ReferenceRoutingErrors, BadParameters) {
  const std::vector<float> logits(16, 0.0f);  // 2 tokens x 8 experts
  auto run = [&](RoutingParams p, int64_t tokens = 2, int64_t experts = 8) {
    return [=, &logits] { route(logits.data(), tokens, experts, nullptr, p); };
  };
  RoutingParams p;
  p.top_k = 9;
  expect_error(run(p), {"top_k = 9", "num_experts = 8"});
  p.top_k = 0;
  expect_error(run(p), {"top_k = 0"});
  p.top_k = 2;
  expect_error(run(p, 0), {"num_tokens = 0", ">= 1"});

  RoutingParams n;
  n.mode = RoutingMode::kNoauxTc;
  n.top_k = 2;
  n.num_groups = 3;
  expect_error(run(n), {"num_groups = 3", "divisor", "num_experts = 8"});
  n.num_groups = 8;
  expect_error(run(n), {"num_groups = 8", ">= 2 per group"});
  n.num_groups = 4;
  n.topk_groups = 0;
  expect_error(run(n), {"topk_groups = 0", "[1, num_groups = 4]"});
  n.topk_groups = 5;
  expect_error(run(n), {"topk_groups = 5"});
  n.topk_groups = 1;
  n.top_k = 3;
  expect_error(run(n), {"topk_groups = 1", "keeps 2 experts", "top_k = 3"});
  n.top_k = 2;
  n.routed_scaling_factor = 0.0f;
  expect_error(run(n), {"routed_scaling_factor = 0"});
  n.routed_scaling_factor = 1.0f;
  EXPECT_NO_THROW(run(n)());
  // Group settings do not matter outside noaux_tc.
  RoutingParams s;
  s.top_k = 2;
  s.num_groups = 3;
  EXPECT_NO_THROW(run(s)());
}

// Sizes at and past 2^31 pairs are refused before anything is read or
// allocated (the logits buffer here holds one token).
TEST(ReferenceRoutingErrors, PairCountsPast2To31) {
  std::vector<float> logits(8, 0.0f);
  RoutingParams p;
  p.top_k = 8;
  expect_error([&] { route(logits.data(), int64_t{1} << 28, 8, nullptr, p); },
               {"num_tokens = 268435456", "num_tokens * top_k < 2^31"});
  expect_error([&] { route(logits.data(), int64_t{1} << 62, 8, nullptr, p); }, {"num_tokens * top_k < 2^31"});
  p.top_k = 1;
  expect_error([&] { route(logits.data(), 1, int64_t{1} << 31, nullptr, p); }, {"num_experts = 2147483648"});
  Routing r;
  r.num_tokens = int64_t{1} << 61;  // num_tokens * top_k would overflow int64
  r.top_k = 8;
  expect_error([&] { validate_routing(r, 8); }, {"num_tokens * top_k < 2^31"});
  std::mt19937_64 rng(5);
  const MoeWeights w = random_weights(8, 16, 16, false, rng);
  expect_error([&] { moe_reference(w, nullptr, r, Activation::kSwiGLU, nullptr); }, {"2^31"});
  MoeWeights huge;
  huge.num_experts = 1;
  huge.experts.resize(1);
  huge.hidden = int64_t{1} << 40;
  huge.inter = int64_t{1} << 40;  // rows * cols would overflow int64
  Routing none;
  none.top_k = 1;
  expect_error([&] { moe_reference(huge, nullptr, none, Activation::kSwiGLU, nullptr); },
               {"hidden = 1099511627776", "expected each at most"});
}

TEST(ReferenceRoutingErrors, NonFiniteBiasIsRefused) {
  std::vector<float> logits(8, 0.0f);
  std::vector<float> bias(4, 0.0f);
  bias[2] = INFINITY;
  RoutingParams p;
  p.top_k = 2;
  p.mode = RoutingMode::kNoauxTc;
  expect_error([&] { route(logits.data(), 2, 4, bias.data(), p); }, {"correction_bias[2]"});
}

// docs/design.md §3: a non-finite logit excludes its expert (ranks after every
// finite one, weight 0); the token is counted, nothing throws.
TEST(ReferenceRouting, NonFiniteLogitsExcludeTheirExpert) {
  const float inf = INFINITY, nan = NAN;
  for (const RoutingMode mode : {RoutingMode::kSoftmaxTopK, RoutingMode::kGptOss}) {
    RoutingParams p;
    p.mode = mode;
    p.top_k = 2;
    // +inf, NaN and -inf lose to the finite logits 1 and 0.
    Routing r = route_one({inf, 1.0f, nan, 0.0f, -inf}, p);
    EXPECT_EQ(r.topk_ids, (std::vector<int32_t>{1, 3})) << to_string(mode);
    EXPECT_FLOAT_EQ(r.topk_weights[0], static_cast<float>(1.0 / (1.0 + std::exp(-1.0))));
    EXPECT_FLOAT_EQ(r.topk_weights[1], static_cast<float>(std::exp(-1.0) / (1.0 + std::exp(-1.0))));
    EXPECT_EQ(r.tokens_with_nonfinite_logits, 1);
    // One finite logit, k = 3: it takes everything, the excluded ones follow
    // by index with weight 0.
    p.top_k = 3;
    r = route_one({nan, -inf, 2.0f, inf}, p);
    EXPECT_EQ(r.topk_ids, (std::vector<int32_t>{2, 0, 1})) << to_string(mode);
    EXPECT_EQ(r.topk_weights, (std::vector<float>{1.0f, 0.0f, 0.0f})) << to_string(mode);
    // No finite logit: the lowest ids, weight 0 everywhere.
    p.top_k = 2;
    r = route_one({nan, inf, -inf}, p);
    EXPECT_EQ(r.topk_ids, (std::vector<int32_t>{0, 1})) << to_string(mode);
    EXPECT_EQ(r.topk_weights, (std::vector<float>{0.0f, 0.0f})) << to_string(mode);
  }
  // Softmax without renormalisation divides by the finite experts' sum.
  RoutingParams s;
  s.top_k = 1;
  s.renormalize = false;
  const Routing r = route_one({0.0f, NAN, 0.0f}, s);
  EXPECT_EQ(r.topk_ids, (std::vector<int32_t>{0}));
  EXPECT_FLOAT_EQ(r.topk_weights[0], 0.5f);
}

TEST(ReferenceRouting, NonFiniteLogitsNoauxTc) {
  RoutingParams p;
  p.mode = RoutingMode::kNoauxTc;
  p.top_k = 2;
  p.num_groups = 2;  // groups {0..3} {4..7}
  p.topk_groups = 1;
  // Group 0 holds the largest logit but two non-finite ones; its score is the
  // sum of its two best choice scores, both finite (experts 0 and 3), and it
  // beats group 1 (whose second best is excluded: score -inf).
  const std::vector<float> logits = {3.0f, NAN, INFINITY, 1.0f, 2.0f, -INFINITY, NAN, NAN};
  const Routing r = route_one(logits, p);
  EXPECT_EQ(r.topk_ids, (std::vector<int32_t>{0, 3}));
  const double s0 = sigmoid(3.0), s3 = sigmoid(1.0);
  EXPECT_FLOAT_EQ(r.topk_weights[0], static_cast<float>(s0 / (s0 + s3)));
  EXPECT_FLOAT_EQ(r.topk_weights[1], static_cast<float>(s3 / (s0 + s3)));
  EXPECT_EQ(r.tokens_with_nonfinite_logits, 1);
  // Everything excluded: zero weights (the 1e-20 keeps 0 / 0 away), no throw.
  const Routing none = route_one({NAN, NAN, INFINITY, -INFINITY}, [] {
    RoutingParams q;
    q.mode = RoutingMode::kNoauxTc;
    q.top_k = 2;
    return q;
  }());
  EXPECT_EQ(none.topk_ids, (std::vector<int32_t>{0, 1}));
  EXPECT_EQ(none.topk_weights, (std::vector<float>{0.0f, 0.0f}));
}

TEST(ReferenceRouting, NonFiniteLogitsCountTokens) {
  std::vector<float> logits(4 * 5, 0.5f);
  logits[1 * 5 + 2] = NAN;
  logits[3 * 5 + 0] = -INFINITY;
  RoutingParams p;
  p.top_k = 2;
  const Routing r = route(logits.data(), 4, 5, nullptr, p);
  EXPECT_EQ(r.tokens_with_nonfinite_logits, 2);
  EXPECT_EQ(route(logits.data(), 1, 5, nullptr, p).tokens_with_nonfinite_logits, 0);
}

Routing make_routing(int64_t tokens, int top_k, std::vector<int32_t> ids) {
  Routing r;
  r.num_tokens = tokens;
  r.top_k = top_k;
  r.topk_ids = std::move(ids);
  r.topk_weights.assign(r.topk_ids.size(), 0.25f);
  return r;
}

TEST(ReferenceRoutingErrors, ValidateRouting) {
  EXPECT_NO_THROW(validate_routing(make_routing(2, 3, {0, 1, 2, 7, 5, 0}), 8));
  expect_error(
      [] {
        validate_routing(make_routing(2, 3, {0, 1, 2, 5, 7, 5}), 8);
      },
      {"token 1 slot 2", "expert id 5", "duplicates slot 0"});
  expect_error(
      [] {
        validate_routing(make_routing(2, 3, {0, 8, 2, 5, 7, 4}), 8);
      },
      {"token 0 slot 1", "expert id 8", "[0, 8)"});
  expect_error(
      [] {
        validate_routing(make_routing(2, 3, {0, 1, 2, -1, 7, 4}), 8);
      },
      {"token 1 slot 0", "expert id -1"});
  expect_error(
      [] {
        validate_routing(make_routing(2, 3, {0, 1, 2, 3, 4}), 8);
      },
      {"topk_ids has 5 entries", "2 * 3 = 6"});
  Routing r = make_routing(2, 3, {0, 1, 2, 3, 4, 5});
  r.topk_weights.pop_back();
  expect_error([&] { validate_routing(r, 8); }, {"topk_weights has 5 entries"});
  r = make_routing(2, 3, {0, 1, 2, 3, 4, 5});
  r.topk_weights[4] = NAN;
  expect_error([&] { validate_routing(r, 8); }, {"token 1 slot 1", "not finite"});
}

// ------------------------------------------------------------- expert MLP

// One expert, hidden = inter = 16, x = e_0, so gate·x and up·x are the first
// column of gate and up; down is the identity, so the output is act(g, u)
// element by element and can be checked against values computed here.
TEST(ReferenceMoe, HandComputedActivations) {
  // Magnitudes with block scale 2: code -> 0, 1, 2, 3, 4, 6, 8, 12 (sign bit 8).
  const std::vector<uint8_t> gate_codes = {0x7, 0xF, 0x3, 0x9, 0x5, 0x6, 0x0, 0xA,
                                           0x2, 0xE, 0x4, 0x1, 0xB, 0x7, 0xC, 0x6};
  const std::vector<uint8_t> up_codes = {0x6, 0xF, 0xA, 0x2, 0x7, 0xE, 0x5, 0x1,
                                         0x0, 0x9, 0x4, 0xB, 0x3, 0x8, 0xD, 0xC};
  auto column0 = [](const std::vector<uint8_t>& codes) {
    Nvfp4Matrix m;
    m.rows = m.cols = 16;
    m.packed.assign(16 * 8, 0);
    m.scales.assign(16, kScaleTwo);
    for (int r = 0; r < 16; ++r) m.packed[r * 8] = codes[r];  // element 0: low nibble
    return m;
  };
  MoeWeights w;
  w.num_experts = 1;
  w.hidden = w.inter = 16;
  ExpertWeights ex;
  ex.gate = column0(gate_codes);
  ex.up = column0(up_codes);
  ex.down.rows = ex.down.cols = 16;
  ex.down.packed.assign(16 * 8, 0);
  ex.down.scales.assign(16, kScaleOne);
  for (int n = 0; n < 16; ++n) ex.down.packed[n * 8 + n / 2] = n % 2 ? 0x20 : 0x02;  // 1.0
  w.experts.push_back(ex);

  std::vector<float> x(16, 0.0f);
  x[0] = 1.0f;
  const Routing r = make_routing(1, 1, {0});
  auto value = [](uint8_t code) { return 2.0 * e2m1_to_float(code); };
  for (const bool with_bias : {false, true}) {
    if (with_bias) {
      w.experts[0].gate_bias.assign(16, 0.5f);
      w.experts[0].up_bias.assign(16, -0.25f);
      w.experts[0].down_bias.assign(16, 0.125f);
    }
    for (const Activation a : {Activation::kSwiGLU, Activation::kGptOss}) {
      std::vector<float> out(16, NAN);
      Routing rw = r;
      rw.topk_weights = {1.0f};
      moe_reference(w, x.data(), rw, a, out.data());
      for (int i = 0; i < 16; ++i) {
        const double g = value(gate_codes[i]) + (with_bias ? 0.5 : 0.0);
        const double u = value(up_codes[i]) + (with_bias ? -0.25 : 0.0);
        double h;
        if (a == Activation::kSwiGLU) {
          h = g * sigmoid(g) * u;
        } else {
          const double gc = std::min(g, 7.0), uc = std::max(-7.0, std::min(u, 7.0));
          h = gc * sigmoid(1.702 * gc) * (uc + 1.0);
        }
        EXPECT_FLOAT_EQ(out[i], static_cast<float>(h + (with_bias ? 0.125 : 0.0)))
            << "row " << i << " g=" << g << " u=" << u << " bias=" << with_bias;
      }
    }
  }
}

TEST(ReferenceMoe, ShapeErrors) {
  std::mt19937_64 rng(7);
  MoeWeights w = random_weights(3, 32, 48, false, rng);
  const std::vector<float> x(2 * 32, 1.0f);
  std::vector<float> out(2 * 32);
  const Routing r = make_routing(2, 2, {0, 1, 2, 0});
  EXPECT_NO_THROW(moe_reference(w, x.data(), r, Activation::kSwiGLU, out.data()));
  expect_error(
      [&] {
        moe_reference(w, x.data(), make_routing(2, 2, {0, 3, 2, 0}), Activation::kSwiGLU, out.data());
      },
      {"expert id 3", "[0, 3)"});
  MoeWeights bad = w;
  bad.experts[1].down = random_matrix(48, 32, rng);
  expect_error([&] { moe_reference(bad, x.data(), r, Activation::kSwiGLU, out.data()); },
               {"expert 1 down is [48, 32]", "expected [32, 48]"});
  bad = w;
  bad.experts[2].gate.scales.pop_back();
  expect_error([&] { moe_reference(bad, x.data(), r, Activation::kSwiGLU, out.data()); }, {"expert 2 gate scales"});
  bad = w;
  bad.experts[0].up_bias.assign(47, 0.0f);
  expect_error([&] { moe_reference(bad, x.data(), r, Activation::kSwiGLU, out.data()); },
               {"expert 0 up_bias has 47 entries"});
  bad = w;
  bad.experts.pop_back();
  expect_error([&] { moe_reference(bad, x.data(), r, Activation::kSwiGLU, out.data()); },
               {"2 experts given", "num_experts = 3"});
  bad = w;
  bad.hidden = 40;
  expect_error([&] { moe_reference(bad, x.data(), r, Activation::kSwiGLU, out.data()); },
               {"hidden = 40", "multiple of 16"});
}

// ------------------------------------------------- random vs. naive path

struct Case {
  RoutingMode mode;
  bool renormalize;
  int num_groups, topk_groups;
  float scaling;
  bool correction_bias;
  Activation activation;
  bool with_bias;
  int tokens, experts, top_k, hidden, inter;
};

std::string case_name(const testing::TestParamInfo<Case>& info) {
  const Case& c = info.param;
  std::string s = to_string(c.mode);
  if (c.mode == RoutingMode::kSoftmaxTopK) s += c.renormalize ? "_renorm" : "_raw";
  if (c.mode == RoutingMode::kNoauxTc)
    s += "_g" + std::to_string(c.num_groups) + "k" + std::to_string(c.topk_groups) + (c.correction_bias ? "_cb" : "");
  s += c.activation == Activation::kSwiGLU ? "_swiglu" : "_gptossact";
  s += c.with_bias ? "_bias" : "";
  s += "_T" + std::to_string(c.tokens) + "_E" + std::to_string(c.experts) + "_k" + std::to_string(c.top_k) + "_H" +
       std::to_string(c.hidden) + "_I" + std::to_string(c.inter);
  return s;
}

std::vector<Case> all_cases() {
  struct RoutingCase {
    RoutingMode mode;
    bool renormalize;
    int num_groups, topk_groups;
    float scaling;
    bool correction_bias;
    int experts;
    std::vector<int> top_ks;
  };
  const std::vector<RoutingCase> routings = {
      {RoutingMode::kSoftmaxTopK, true, 1, 1, 1.0f, false, 8, {1, 2, 8}},
      {RoutingMode::kSoftmaxTopK, false, 1, 1, 1.0f, false, 64, {8, 4, 6}},
      {RoutingMode::kSoftmaxTopK, true, 1, 1, 1.0f, false, 1, {1}},
      {RoutingMode::kSoftmaxTopK, false, 1, 1, 1.0f, false, 5, {3, 5, 1}},
      {RoutingMode::kGptOss, true, 1, 1, 1.0f, false, 32, {4, 1, 7}},
      {RoutingMode::kGptOss, true, 1, 1, 1.0f, false, 2, {2, 1}},
      {RoutingMode::kNoauxTc, true, 4, 2, 2.5f, true, 16, {4, 8, 3}},
      {RoutingMode::kNoauxTc, true, 8, 4, 2.5f, true, 64, {8, 6, 2}},
      {RoutingMode::kNoauxTc, true, 1, 1, 1.0f, false, 8, {2, 5, 8}},
      {RoutingMode::kNoauxTc, true, 16, 3, 1.5f, true, 32, {6, 1, 5}},
      {RoutingMode::kNoauxTc, true, 3, 1, 2.0f, true, 24, {8, 7, 4}},
  };
  const std::vector<std::pair<int, int>> shapes = {{32, 48}, {64, 32}, {128, 96}, {256, 64}, {48, 256}, {96, 128}};
  std::vector<Case> cases;
  int counter = 0;
  for (const RoutingCase& rc : routings)
    for (const int tokens : {1, 3, 17})
      for (const Activation act : {Activation::kSwiGLU, Activation::kGptOss}) {
        const auto [hidden, inter] = shapes[counter % shapes.size()];
        const int top_k = rc.top_ks[counter % rc.top_ks.size()];
        cases.push_back({rc.mode, rc.renormalize, rc.num_groups, rc.topk_groups, rc.scaling, rc.correction_bias, act,
                         (counter / 2) % 2 == 1, tokens, rc.experts, top_k, hidden, inter});
        ++counter;
      }
  return cases;
}

class ReferenceRandomProblem : public testing::TestWithParam<Case> {};

TEST_P(ReferenceRandomProblem, MatchesNaivePath) {
  const Case& c = GetParam();
  std::mt19937_64 rng(std::hash<std::string>{}(case_name({c, 0})));
  const MoeWeights w = random_weights(c.experts, c.hidden, c.inter, c.with_bias, rng);
  const std::vector<float> x = random_vector(static_cast<size_t>(c.tokens * c.hidden), 1.0f, rng);
  const std::vector<float> logits = random_vector(static_cast<size_t>(c.tokens * c.experts), 2.0f, rng);
  std::vector<float> bias;
  if (c.correction_bias) {
    std::uniform_real_distribution<float> dist(-0.5f, 0.5f);
    for (int e = 0; e < c.experts; ++e) bias.push_back(dist(rng));
  }
  RoutingParams p;
  p.mode = c.mode;
  p.top_k = c.top_k;
  p.renormalize = c.renormalize;
  p.num_groups = c.num_groups;
  p.topk_groups = c.topk_groups;
  p.routed_scaling_factor = c.scaling;

  const float* bias_ptr = bias.empty() ? nullptr : bias.data();
  const Routing routing = route(logits.data(), c.tokens, c.experts, bias_ptr, p);
  const Routing expected = naive_route(logits, c.tokens, c.experts, bias_ptr, p);
  ASSERT_EQ(routing.num_tokens, c.tokens);
  ASSERT_EQ(routing.top_k, c.top_k);
  ASSERT_EQ(routing.topk_ids, expected.topk_ids);
  for (size_t i = 0; i < expected.topk_weights.size(); ++i)
    EXPECT_NEAR(routing.topk_weights[i], expected.topk_weights[i], 1e-6 * std::fabs(expected.topk_weights[i]))
        << "slot " << i;
  EXPECT_NO_THROW(validate_routing(routing, c.experts));

  std::vector<float> out(static_cast<size_t>(c.tokens * c.hidden), NAN);  // poisoned
  moe_reference(w, x.data(), routing, c.activation, out.data());
  expect_close(out, naive_moe(w, x, routing, c.activation), c.hidden, 1e-6);
}

INSTANTIATE_TEST_SUITE_P(AllModes, ReferenceRandomProblem, testing::ValuesIn(all_cases()), case_name);

// ------------------------------------------------ W4A4 activation numerics

// Weights as an NVFP4 (W4A4) checkpoint has them: every matrix with an
// input_scale. GEMM1's input is unit-normal (amax ~3-4 per row): a scale
// calibrated for amax 2.5 makes some blocks clamp at 448 and saturate.
MoeWeights w4a4_weights(int experts, int hidden, int inter, std::mt19937_64& rng) {
  MoeWeights w = random_weights(experts, hidden, inter, false, rng);
  w.checkpoint_format = "NVFP4";
  for (int e = 0; e < experts; ++e) {
    ExpertWeights& ex = w.experts[static_cast<size_t>(e)];
    ex.gate.input_scale = ex.up.input_scale = (2.5f + 0.5f * static_cast<float>(e % 3)) / 2688.0f;
    ex.down.input_scale = (8.0f + static_cast<float>(e)) / 2688.0f;
    ex.gate.has_input_scale = ex.up.has_input_scale = ex.down.has_input_scale = true;
  }
  return w;
}

TEST(ReferenceW4a4, NumericsNamesRoundTrip) {
  for (ActivationNumerics n : {ActivationNumerics::kCheckpoint, ActivationNumerics::kBf16, ActivationNumerics::kFp4})
    EXPECT_EQ(parse_activation_numerics(to_string(n)), n);
  expect_error([] { parse_activation_numerics("fp8"); }, {"'fp8'", "checkpoint, bf16, fp4"});
}

TEST(ReferenceW4a4, CheckpointNumericsFollowTheFormatAndTheScales) {
  std::mt19937_64 rng(5);
  MoeWeights w = w4a4_weights(3, 32, 32, rng);
  EXPECT_EQ(resolve_activation_numerics(w, ActivationNumerics::kCheckpoint), ActivationNumerics::kFp4);
  EXPECT_EQ(resolve_activation_numerics(w, ActivationNumerics::kBf16), ActivationNumerics::kBf16);
  w.checkpoint_format = "W4A16_NVFP4";
  EXPECT_EQ(resolve_activation_numerics(w, ActivationNumerics::kCheckpoint), ActivationNumerics::kBf16);
  EXPECT_EQ(resolve_activation_numerics(w, ActivationNumerics::kFp4), ActivationNumerics::kFp4);
  w.checkpoint_format = "NVFP4";
  w.experts[2].down.has_input_scale = false;
  EXPECT_EQ(resolve_activation_numerics(w, ActivationNumerics::kCheckpoint), ActivationNumerics::kBf16);
  expect_error([&] { resolve_activation_numerics(w, ActivationNumerics::kFp4); },
               {"input_scale", "expert 2 down", "NVFP4"});
  // Gate and up differ: GEMM1's input takes the larger.
  w.experts[1].up.input_scale = 2 * w.experts[1].gate.input_scale;
  EXPECT_EQ(gemm1_input_scale(w.experts[1]), w.experts[1].up.input_scale);
}

// The engines' stacked input scales ([E], [E, 2], one value) become each
// matrix's input_scale; values are checked as the loader checks tensors.
TEST(ReferenceW4a4, StackedInputScalesAsTheEnginesHoldThem) {
  const std::vector<float> per_expert = {0.5f, 0.25f, 2.0f};
  const std::vector<float> gate_up = {0.5f, 1.0f, 0.25f, 0.125f, 2.0f, 3.0f};
  const std::vector<float> one = {4.0f};
  EXPECT_EQ(input_scale_count(InputScaleExtent::kPerExpert, 3), 3);
  EXPECT_EQ(input_scale_count(InputScaleExtent::kPerExpertGateUp, 3), 6);
  EXPECT_EQ(input_scale_count(InputScaleExtent::kPerLayer, 3), 1);
  auto s = stacked_input_scales(3, gate_up.data(), InputScaleExtent::kPerExpertGateUp, per_expert.data(),
                                InputScaleExtent::kPerExpert, "here");
  ASSERT_EQ(s.size(), 3u);
  for (size_t e = 0; e < 3; ++e) {
    EXPECT_EQ(s[e].gate, gate_up[2 * e]);
    EXPECT_EQ(s[e].up, gate_up[2 * e + 1]);
    EXPECT_EQ(s[e].down, per_expert[e]);
  }
  EXPECT_EQ(gemm1_input_scale(s[1].gate, s[1].up), 0.25f) << "the larger of gate's and up's";
  s = stacked_input_scales(3, per_expert.data(), InputScaleExtent::kPerExpert, one.data(), InputScaleExtent::kPerLayer,
                           "here");
  for (size_t e = 0; e < 3; ++e) {
    EXPECT_EQ(s[e].gate, per_expert[e]);
    EXPECT_EQ(s[e].up, per_expert[e]);
    EXPECT_EQ(s[e].down, 4.0f);
  }
  // Refused: values the loader refuses, named by tensor and index.
  std::vector<float> bad = gate_up;
  for (const float value : {0.0f, -1.0f, NAN, INFINITY, 1e-20f, 3e15f}) {
    bad[3] = value;
    expect_error(
        [&] {
          stacked_input_scales(3, bad.data(), InputScaleExtent::kPerExpertGateUp, per_expert.data(),
                               InputScaleExtent::kPerExpert, "here");
        },
        {"here: w13_input_scale[1, 1] is ", "; expected a finite input_scale in [1e-15, 1e+15]"});
  }
  const std::vector<float> zero = {0.0f};
  expect_error(
      [&] {
        stacked_input_scales(3, per_expert.data(), InputScaleExtent::kPerExpert, zero.data(),
                             InputScaleExtent::kPerLayer, "here");
      },
      {"here: w2_input_scale is 0; expected a finite input_scale"});
  expect_error(
      [&] {
        stacked_input_scales(3, gate_up.data(), InputScaleExtent::kPerExpertGateUp, gate_up.data(),
                             InputScaleExtent::kPerExpertGateUp, "here");
      },
      {"w2_input_scale holds down_proj's input scales"});
  expect_error(
      [&] {
        stacked_input_scales(3, nullptr, InputScaleExtent::kPerExpert, per_expert.data(), InputScaleExtent::kPerExpert,
                             "here");
      },
      {"here: give both w13_input_scale and w2_input_scale, or neither"});

  // The numerics: checkpoint follows the scales, fp4 needs them, both or neither.
  using N = ActivationNumerics;
  EXPECT_EQ(resolve_stacked_activation_numerics(N::kCheckpoint, true, true, "here"), N::kFp4);
  EXPECT_EQ(resolve_stacked_activation_numerics(N::kCheckpoint, false, false, "here"), N::kBf16);
  EXPECT_EQ(resolve_stacked_activation_numerics(N::kBf16, true, true, "here"), N::kBf16);
  EXPECT_EQ(resolve_stacked_activation_numerics(N::kFp4, true, true, "here"), N::kFp4);
  expect_error([] { resolve_stacked_activation_numerics(N::kFp4, false, false, "here"); },
               {"here: fp4 activations (W4A4) need w13_input_scale and w2_input_scale; none are given: use bf16 "
                "activations"});
  expect_error([] { resolve_stacked_activation_numerics(N::kCheckpoint, true, false, "here"); },
               {"here: give both w13_input_scale and w2_input_scale, or neither"});
}

TEST(ReferenceW4a4, MatchesNaivePathAndDiffersFromBf16) {
  std::mt19937_64 rng(17);
  const int tokens = 7, experts = 5, top_k = 2, hidden = 64, inter = 48;
  for (Activation a : {Activation::kSwiGLU, Activation::kGptOss}) {
    const MoeWeights w = w4a4_weights(experts, hidden, inter, rng);
    std::vector<float> x = random_vector(static_cast<size_t>(tokens * hidden), 1.0f, rng);
    x[5] = 0.0f;  // a few exact zeros and a negative zero
    x[6] = -0.0f;
    const std::vector<float> logits = random_vector(static_cast<size_t>(tokens * experts), 2.0f, rng);
    RoutingParams p;
    p.top_k = top_k;
    const Routing routing = route(logits.data(), tokens, experts, nullptr, p);
    std::vector<float> fp4(static_cast<size_t>(tokens * hidden), NAN);
    moe_reference(w, x.data(), routing, a, fp4.data(), 0);  // kCheckpoint: fp4 for this checkpoint
    expect_close(fp4, naive_moe(w, x, routing, a, /*fp4=*/true), hidden, 1e-6);
    std::vector<float> forced(fp4.size(), NAN);
    moe_reference(w, x.data(), routing, a, forced.data(), 1, Intermediate::kExact, ActivationNumerics::kFp4);
    EXPECT_EQ(forced, fp4) << "kFp4 equals kCheckpoint on an NVFP4 checkpoint, for any thread count";

    // bf16 numerics: the W4A16 result, which W4A4 is measurably away from.
    std::vector<float> bf16(fp4.size(), NAN);
    moe_reference(w, x.data(), routing, a, bf16.data(), 0, Intermediate::kExact, ActivationNumerics::kBf16);
    expect_close(bf16, naive_moe(w, x, routing, a), hidden, 1e-6);
    double diff2 = 0, ref2 = 0;
    for (size_t i = 0; i < fp4.size(); ++i) {
      diff2 += (double(fp4[i]) - bf16[i]) * (double(fp4[i]) - bf16[i]);
      ref2 += double(bf16[i]) * bf16[i];
    }
    EXPECT_GT(std::sqrt(diff2 / ref2), 1e-2) << "fp4 activations should move the result";
  }
}

TEST(ReferenceW4a4, Fp4WithoutInputScalesIsRefused) {
  std::mt19937_64 rng(3);
  MoeWeights w = random_weights(2, 32, 32, false, rng);  // no input_scale anywhere
  const std::vector<float> x(32, 1.0f);
  const Routing r = make_routing(1, 1, {1});
  std::vector<float> out(32);
  expect_error(
      [&] {
        moe_reference(w, x.data(), r, Activation::kSwiGLU, out.data(), 1, Intermediate::kExact,
                      ActivationNumerics::kFp4);
      },
      {"input_scale", "expert 0 gate", "bf16"});
  EXPECT_NO_THROW(moe_reference(w, x.data(), r, Activation::kSwiGLU, out.data()));  // kCheckpoint: bf16
}

// ------------------------------------------------------------ shared expert

// out += s_t * down_s(act(gate_s x, up_s x)), s_t = 1 or sigmoid(gate · x),
// dequantised naively and unchunked.
void add_naive_shared(const MoeWeights& w, const std::vector<float>& x, int64_t num_tokens, Activation a,
                      std::vector<double>& out) {
  const SharedExpertWeights& sh = *w.shared_expert;
  const int64_t H = w.hidden, S = sh.inter;
  const std::vector<double> gate = naive_dequantize(sh.mlp.gate), up = naive_dequantize(sh.mlp.up),
                            down = naive_dequantize(sh.mlp.down);
  for (int64_t t = 0; t < num_tokens; ++t) {
    double scale = 1.0;
    if (!sh.gate.empty()) {
      double z = 0.0;
      for (int64_t k = 0; k < H; ++k) z += static_cast<double>(sh.gate[k]) * x[t * H + k];
      scale = 1.0 / (1.0 + std::exp(-z));
    }
    std::vector<double> h(static_cast<size_t>(S));
    for (int64_t i = 0; i < S; ++i) {
      double g = 0.0, u = 0.0;
      for (int64_t k = 0; k < H; ++k) {
        g += gate[i * H + k] * x[t * H + k];
        u += up[i * H + k] * x[t * H + k];
      }
      h[i] = naive_activation(a, g, u);
    }
    for (int64_t n = 0; n < H; ++n) {
      double y = 0.0;
      for (int64_t i = 0; i < S; ++i) y += down[n * S + i] * h[i];
      out[t * H + n] += scale * y;
    }
  }
}

// Rows [begin, begin + count) or columns [begin, begin + count) of a matrix.
Nvfp4Matrix slice(const Nvfp4Matrix& m, bool columns, int64_t begin, int64_t count) {
  Nvfp4Matrix out = m;
  out.rows = columns ? m.rows : count;
  out.cols = columns ? count : m.cols;
  out.packed.clear();
  out.scales.clear();
  for (int64_t r = 0; r < out.rows; ++r) {
    const int64_t src_row = columns ? r : begin + r, col0 = columns ? begin : 0;
    out.packed.insert(out.packed.end(), m.packed.begin() + src_row * m.cols / 2 + col0 / 2,
                      m.packed.begin() + src_row * m.cols / 2 + (col0 + out.cols) / 2);
    out.scales.insert(out.scales.end(), m.scales.begin() + src_row * m.cols / 16 + col0 / 16,
                      m.scales.begin() + src_row * m.cols / 16 + (col0 + out.cols) / 16);
  }
  return out;
}

// The reference's shared expert against an independent float evaluation
// (DeepSeek's ungated one, Qwen2-MoE's gated one; widths of 1 and 3 routed
// widths), and against the same shared expert cut into chunks of the routed
// width and routed to as extra experts with the same weight, which is how the
// GPU layer runs it: the two agree to rounding.
// An unquantised shared expert (float weights, ModelOpt's experts-only
// configs) computes what the NVFP4 one whose dequantised values it holds
// computes; it keeps bf16 activations beside W4A4 routed experts, whose
// fp4 numerics it does not block.
TEST(ReferenceMoe, UnquantisedSharedExpertRunsInFloat) {
  const int tokens = 4, experts = 5, top_k = 2, hidden = 32, inter = 16;
  std::mt19937_64 rng(77);
  MoeWeights w = random_weights(experts, hidden, inter, false, rng);
  SharedExpertWeights shared;
  shared.inter = 2 * inter;
  shared.mlp = random_weights(1, hidden, shared.inter, false, rng).experts[0];
  shared.gate = random_vector(hidden, 0.3f, rng);
  w.shared_expert = shared;
  MoeWeights dense_w = w;
  SharedExpertWeights& dense = *dense_w.shared_expert;
  for (const Nvfp4Matrix* m : {&shared.mlp.gate, &shared.mlp.up})
    for (double v : naive_dequantize(*m)) dense.dense_gate_up.push_back(static_cast<float>(v));  // exact
  for (double v : naive_dequantize(shared.mlp.down)) dense.dense_down.push_back(static_cast<float>(v));
  dense.mlp = ExpertWeights{};
  ASSERT_TRUE(dense.dense());
  const std::vector<float> x = random_vector(static_cast<size_t>(tokens * hidden), 1.0f, rng);
  const std::vector<float> logits = random_vector(static_cast<size_t>(tokens * experts), 2.0f, rng);
  RoutingParams p;
  p.top_k = top_k;
  const Routing routing = route(logits.data(), tokens, experts, nullptr, p);
  std::vector<float> want(static_cast<size_t>(tokens * hidden)), got(want.size());
  moe_reference(w, x.data(), routing, Activation::kSwiGLU, want.data());
  moe_reference(dense_w, x.data(), routing, Activation::kSwiGLU, got.data());
  expect_close(got, std::vector<double>(want.begin(), want.end()), hidden, 1e-6);

  // W4A4 routed experts: fp4 by the checkpoint's rule, the unquantised
  // shared expert on unquantised activations.
  MoeWeights w4a4 = dense_w;
  w4a4.checkpoint_format = "NVFP4";
  for (ExpertWeights& e : w4a4.experts) {
    e.gate.input_scale = e.up.input_scale = 3.0f / 2688.0f;
    e.down.input_scale = 20.0f / 2688.0f;
    e.gate.has_input_scale = e.up.has_input_scale = e.down.has_input_scale = true;
  }
  EXPECT_EQ(resolve_activation_numerics(w4a4, ActivationNumerics::kCheckpoint), ActivationNumerics::kFp4);
  MoeWeights routed_only = w4a4;
  routed_only.shared_expert.reset();
  std::vector<float> routed(want.size()), with_shared(want.size());
  moe_reference(routed_only, x.data(), routing, Activation::kSwiGLU, routed.data());
  moe_reference(w4a4, x.data(), routing, Activation::kSwiGLU, with_shared.data());
  std::vector<double> expected(routed.begin(), routed.end());
  add_naive_shared(w, x, tokens, Activation::kSwiGLU, expected);  // the shared expert on bf16 activations
  expect_close(with_shared, expected, hidden, 1e-5);
}

// The layer's view of a shared expert: its chunks of the routed width as
// experts E .. E + chunks - 1 after the routed slots of every token, each
// weighted 1 or by the expert's sigmoid gate (as a float).
std::pair<MoeWeights, Routing> shared_chunks_as_experts(const MoeWeights& w, const std::vector<float>& x,
                                                        const Routing& routing) {
  const SharedExpertWeights& shared = *w.shared_expert;
  const int64_t chunks = shared.inter / w.inter, hidden = w.hidden;
  MoeWeights as_experts = w;
  as_experts.shared_expert.reset();
  for (int64_t j = 0; j < chunks; ++j) {
    ExpertWeights chunk;
    chunk.gate = slice(shared.mlp.gate, false, j * w.inter, w.inter);
    chunk.up = slice(shared.mlp.up, false, j * w.inter, w.inter);
    chunk.down = slice(shared.mlp.down, true, j * w.inter, w.inter);
    as_experts.experts.push_back(chunk);
  }
  as_experts.num_experts = w.num_experts + chunks;
  Routing extended;
  extended.num_tokens = routing.num_tokens;
  extended.top_k = routing.top_k + static_cast<int>(chunks);
  for (int64_t t = 0; t < routing.num_tokens; ++t) {
    double z = 0.0;
    for (int64_t k = 0; k < static_cast<int64_t>(shared.gate.size()); ++k)
      z += static_cast<double>(shared.gate[static_cast<size_t>(k)]) * x[static_cast<size_t>(t * hidden + k)];
    const float scale = shared.gate.empty() ? 1.0f : static_cast<float>(sigmoid(z));
    for (int j = 0; j < routing.top_k; ++j) {
      extended.topk_ids.push_back(routing.topk_ids[static_cast<size_t>(t * routing.top_k + j)]);
      extended.topk_weights.push_back(routing.topk_weights[static_cast<size_t>(t * routing.top_k + j)]);
    }
    for (int64_t j = 0; j < chunks; ++j) {
      extended.topk_ids.push_back(static_cast<int32_t>(w.num_experts + j));
      extended.topk_weights.push_back(scale);
    }
  }
  return {as_experts, extended};
}

TEST(ReferenceMoe, SharedExpertMatchesIndependentPaths) {
  const int tokens = 5, experts = 6, top_k = 2, hidden = 48, inter = 32;
  for (const bool gated : {false, true})
    for (const int chunks : {1, 3}) {
      SCOPED_TRACE(std::string(gated ? "gated" : "ungated") + ", " + std::to_string(chunks) + " chunk(s)");
      std::mt19937_64 rng(100 + chunks + (gated ? 10 : 0));
      MoeWeights w = random_weights(experts, hidden, inter, false, rng);
      SharedExpertWeights shared;
      shared.inter = chunks * inter;
      shared.mlp = random_weights(1, hidden, shared.inter, false, rng).experts[0];
      if (gated) shared.gate = random_vector(hidden, 0.3f, rng);
      w.shared_expert = shared;
      const std::vector<float> x = random_vector(static_cast<size_t>(tokens * hidden), 1.0f, rng);
      const std::vector<float> logits = random_vector(static_cast<size_t>(tokens * experts), 2.0f, rng);
      RoutingParams p;
      p.top_k = top_k;
      const Routing routing = route(logits.data(), tokens, experts, nullptr, p);

      std::vector<float> out(static_cast<size_t>(tokens * hidden), NAN);
      moe_reference(w, x.data(), routing, Activation::kSwiGLU, out.data());
      std::vector<double> expected = naive_moe(w, x, routing, Activation::kSwiGLU);
      add_naive_shared(w, x, tokens, Activation::kSwiGLU, expected);
      expect_close(out, expected, hidden, 1e-6);

      // Chunks as experts E .. E + chunks - 1, every token routed to each.
      const auto [as_experts, extended] = shared_chunks_as_experts(w, x, routing);
      std::vector<float> chunked(out.size(), NAN);
      moe_reference(as_experts, x.data(), extended, Activation::kSwiGLU, chunked.data());
      expect_close(chunked, std::vector<double>(out.begin(), out.end()), hidden, 1e-6);
    }
}

// Combine::kBf16Rows (the GPU layer's deterministic combine): each weighted
// (token, slot) row rounded to bf16, then summed in slot order. Bit for bit
// the per-slot kExact outputs (the other slots weighted 0) rounded and summed
// by hand; a shared expert's rows one per chunk, as the chunks routed as
// experts give; and not the kExact output. Routed experts with biases.
TEST(ReferenceMoe, Bf16RowsCombineRoundsEachSlotRow) {
  const int tokens = 4, experts = 5, top_k = 3, hidden = 64, inter = 32, chunks = 2;
  std::mt19937_64 rng(77);
  MoeWeights w = random_weights(experts, hidden, inter, true, rng);
  const std::vector<float> x = random_vector(static_cast<size_t>(tokens * hidden), 1.0f, rng);
  const std::vector<float> logits = random_vector(static_cast<size_t>(tokens * experts), 2.0f, rng);
  RoutingParams p;
  p.top_k = top_k;
  const Routing routing = route(logits.data(), tokens, experts, nullptr, p);
  const auto run = [&](const MoeWeights& weights, const Routing& r, Combine combine) {
    std::vector<float> out(static_cast<size_t>(r.num_tokens * hidden), NAN);
    moe_reference(weights, x.data(), r, Activation::kSwiGLU, out.data(), 1, Intermediate::kExact,
                  ActivationNumerics::kCheckpoint, combine);
    return out;
  };

  const std::vector<float> rows = run(w, routing, Combine::kBf16Rows);
  std::vector<double> by_hand(rows.size(), 0.0);
  for (int j = 0; j < top_k; ++j) {
    Routing only_j = routing;
    for (int t = 0; t < tokens; ++t)
      for (int i = 0; i < top_k; ++i)
        if (i != j) only_j.topk_weights[static_cast<size_t>(t * top_k + i)] = 0.0f;
    const std::vector<float> row = run(w, only_j, Combine::kExact);
    for (size_t i = 0; i < row.size(); ++i) by_hand[i] += static_cast<double>(bf16_to_float(float_to_bf16(row[i])));
  }
  for (size_t i = 0; i < rows.size(); ++i) ASSERT_EQ(rows[i], static_cast<float>(by_hand[i])) << "element " << i;
  const std::vector<float> exact = run(w, routing, Combine::kExact);
  EXPECT_NE(rows, exact) << "kBf16Rows rounded nothing";

  // An ungated shared expert of two chunks against its chunks as experts.
  w = random_weights(experts, hidden, inter, false, rng);
  SharedExpertWeights shared;
  shared.inter = chunks * inter;
  shared.mlp = random_weights(1, hidden, shared.inter, false, rng).experts[0];
  MoeWeights with_shared = w;
  with_shared.shared_expert = shared;
  const auto [as_experts, extended] = shared_chunks_as_experts(with_shared, x, routing);
  const std::vector<float> shared_rows = run(with_shared, routing, Combine::kBf16Rows);
  const std::vector<float> chunked = run(as_experts, extended, Combine::kBf16Rows);
  expect_close(shared_rows, std::vector<double>(chunked.begin(), chunked.end()), hidden, 1e-6);
  EXPECT_NE(shared_rows, run(with_shared, routing, Combine::kExact));
}

// A shared expert of the wrong shape, or with a gate of the wrong size, is
// refused with what was expected.
TEST(ReferenceMoe, SharedExpertShapeErrors) {
  std::mt19937_64 rng(5);
  MoeWeights w = random_weights(4, 32, 16, false, rng);
  SharedExpertWeights shared;
  shared.inter = 32;
  shared.mlp = random_weights(1, 32, 16, false, rng).experts[0];  // 16 wide, not 32
  w.shared_expert = shared;
  Routing r;
  r.num_tokens = 1;
  r.top_k = 1;
  r.topk_ids = {0};
  r.topk_weights = {1.0f};
  std::vector<float> x(32, 1.0f), out(32);
  expect_error([&] { moe_reference(w, x.data(), r, Activation::kSwiGLU, out.data()); },
               {"(shared) gate", "expected [32, 32]"});
  w.shared_expert->inter = 16;
  w.shared_expert->gate.assign(31, 0.5f);
  expect_error([&] { moe_reference(w, x.data(), r, Activation::kSwiGLU, out.data()); },
               {"shared expert's gate has 31 values", "hidden = 32"});
}

// Caller-given routing: one expert takes most pairs, several take none, and
// the output must not depend (bitwise) on the thread count, nor on which
// other tokens share the batch.
TEST(ReferenceMoe, SkewedRoutingThreadAndBatchIndependence) {
  std::mt19937_64 rng(11);
  const int tokens = 9, experts = 12, top_k = 3, hidden = 80, inter = 112;
  const MoeWeights w = random_weights(experts, hidden, inter, true, rng);
  const std::vector<float> x = random_vector(static_cast<size_t>(tokens * hidden), 1.0f, rng);
  Routing r;
  r.num_tokens = tokens;
  r.top_k = top_k;
  for (int t = 0; t < tokens; ++t) {
    r.topk_ids.insert(r.topk_ids.end(), {5, t % 3 == 0 ? 11 : 2, t % 2 ? 7 : 0});
    r.topk_weights.insert(r.topk_weights.end(), {0.5f, -0.25f, 1.75f});  // any finite weights
  }
  const std::vector<double> expected = naive_moe(w, x, r, Activation::kGptOss);
  std::vector<float> first;
  for (const int threads : {1, 2, 3, 7, 0}) {
    std::vector<float> out(static_cast<size_t>(tokens * hidden), NAN);
    moe_reference(w, x.data(), r, Activation::kGptOss, out.data(), threads);
    expect_close(out, expected, hidden, 1e-6);
    if (first.empty()) first = out;
    EXPECT_EQ(std::memcmp(first.data(), out.data(), out.size() * sizeof(float)), 0) << "threads = " << threads;
  }
  for (int t = 0; t < tokens; ++t) {
    Routing alone;
    alone.num_tokens = 1;
    alone.top_k = top_k;
    alone.topk_ids.assign(r.topk_ids.begin() + t * top_k, r.topk_ids.begin() + (t + 1) * top_k);
    alone.topk_weights.assign(r.topk_weights.begin() + t * top_k, r.topk_weights.begin() + (t + 1) * top_k);
    std::vector<float> out(static_cast<size_t>(hidden), NAN);
    moe_reference(w, x.data() + t * hidden, alone, Activation::kGptOss, out.data());
    EXPECT_EQ(std::memcmp(first.data() + t * hidden, out.data(), out.size() * sizeof(float)), 0)
        << "token " << t << " routed alone differs from the batch";
  }
}

// docs/design.md §3: a non-finite hidden state reaches its own token's output
// only; every other token's output keeps its bits.
TEST(ReferenceMoe, NonFiniteHiddenStatesStayInTheirToken) {
  std::mt19937_64 rng(17);
  const int tokens = 6, experts = 8, top_k = 2, hidden = 32, inter = 48;
  const MoeWeights w = random_weights(experts, hidden, inter, false, rng);
  std::vector<float> x = random_vector(static_cast<size_t>(tokens * hidden), 1.0f, rng);
  Routing r;
  r.num_tokens = tokens;
  r.top_k = top_k;
  for (int t = 0; t < tokens; ++t) {
    r.topk_ids.insert(r.topk_ids.end(), {t % experts, (t + 3) % experts});
    r.topk_weights.insert(r.topk_weights.end(), {0.75f, 0.25f});
  }
  std::vector<float> clean(static_cast<size_t>(tokens * hidden), NAN);
  moe_reference(w, x.data(), r, Activation::kSwiGLU, clean.data());
  x[1 * hidden + 5] = NAN;
  x[4 * hidden + 0] = INFINITY;
  std::vector<float> dirty(clean.size(), 0.0f);
  moe_reference(w, x.data(), r, Activation::kSwiGLU, dirty.data());
  for (int t = 0; t < tokens; ++t) {
    const size_t row = static_cast<size_t>(t * hidden);
    if (t == 1) {
      for (int i = 0; i < hidden; ++i) EXPECT_TRUE(std::isnan(dirty[row + i])) << "element " << i;
    } else if (t != 4) {
      EXPECT_EQ(std::memcmp(clean.data() + row, dirty.data() + row, hidden * sizeof(float)), 0) << "token " << t;
    }
  }
}

TEST(ReferenceMoe, NoTokensIsANoOp) {
  std::mt19937_64 rng(3);
  const MoeWeights w = random_weights(2, 16, 16, false, rng);
  Routing r;
  r.num_tokens = 0;
  r.top_k = 1;
  EXPECT_NO_THROW(moe_reference(w, nullptr, r, Activation::kSwiGLU, nullptr));
}

// A GLM-5-shaped layer (hidden 6144, inter 2048, top-8, 16 tokens): the
// worst case of 128 distinct active experts. Needs ~2.5 GB and some seconds,
// so it is not part of the default run:
//   test_reference --gtest_also_run_disabled_tests --gtest_filter='*Glm5*'
TEST(ReferenceMoe, DISABLED_Glm5ShapeTiming) {
  std::mt19937_64 rng(5);
  const int tokens = 16, top_k = 8, experts = tokens * top_k, hidden = 6144, inter = 2048;
  const MoeWeights w = random_weights(experts, hidden, inter, false, rng);
  const std::vector<float> x = random_vector(static_cast<size_t>(tokens * hidden), 1.0f, rng);
  Routing r;
  r.num_tokens = tokens;
  r.top_k = top_k;
  for (int p = 0; p < tokens * top_k; ++p) {
    r.topk_ids.push_back(p);
    r.topk_weights.push_back(1.0f / top_k);
  }
  std::vector<float> out(static_cast<size_t>(tokens * hidden));
  const auto start = std::chrono::steady_clock::now();
  const std::clock_t cpu_start = std::clock();
  moe_reference(w, x.data(), r, Activation::kSwiGLU, out.data());
  const double cpu_seconds = static_cast<double>(std::clock() - cpu_start) / CLOCKS_PER_SEC;
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  // CPU time too: on a shared machine the wall time says little.
  std::printf("GLM-5 shape, %d tokens, %d active experts, %u threads: %.2f s wall, %.2f s CPU\n", tokens, experts,
              std::thread::hardware_concurrency(), seconds, cpu_seconds);
}

}  // namespace
}  // namespace fp4moe
