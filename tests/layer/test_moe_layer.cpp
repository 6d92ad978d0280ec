// GPU tests of the MoE layer (include/fp4moe/moe_layer.hpp) against the CPU
// reference, moe_reference(route(logits)) in double:
//   - model-shaped layers (DeepSeek-V3, GLM-4.5, Qwen3-30B, gpt-oss with
//     biases, Mixtral) with hidden/inter scaled down and chosen off the
//     128-tile grid, T in {1, 3, 64, 1000}, device and caller routing, both
//     finalize modes x both gather modes;
//   - caller routing that is skewed (one hot expert) or uses only a few
//     experts (most experts get no tokens);
//   - every compiled tile config forced in GEMM1 and GEMM2;
//   - the full-size GLM-5 layer (~5.4 GB of weights) at T = 1 and 64;
//   - batch invariance (a slice of a batch run alone gives the same bits);
//   - forward_pair_rows: the rows the deterministic finalize sums;
//   - determinism (bit-identical repeats), atomic mode, CUDA-graph capture
//     and replay with new inputs, two host threads on one layer, workspace
//     reuse and a too-small workspace, out-of-range expert ids reported by
//     device_errors(), and MoeLayer::load from a checkpoint file;
//   - W4A4 (fp4 activations, MoeLayerW4a4): every compiled tile in both
//     GEMMs, both finalize modes, against the W4A4 reference; graph replay;
//     the checkpoint rule and refusals; prepare_device with input scales.
// Outputs are poisoned (0xFF bytes, bf16 NaN) before every forward so an
// unwritten element fails. Router logits are drawn so that no routing
// decision is within 1e-3 of a tie: the device scores in fp32, the
// reference in double, and both must pick the same experts.
// Skipped, visibly, where no GPU exists.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <iterator>
#include <limits>
#include <map>
#include <memory>
#include <numeric>
#include <optional>
#include <ostream>
#include <random>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "fp4moe/error.hpp"
#include "fp4moe/moe_layer.hpp"
#include "fp4moe/reference.hpp"
#include "fp4moe/safetensors.hpp"
#include "gpu_test_util.hpp"
#include "layer/moe_layer_internals.hpp"
#include "util/parallel.hpp"

namespace fp4moe {

// Readable test parameters in gtest's listing (found by ADL; internal linkage).
static void PrintTo(FinalizeMode mode, std::ostream* os) { *os << to_string(mode); }
static void PrintTo(GatherMode mode, std::ostream* os) { *os << to_string(mode); }

namespace {

using ::testing::HasSubstr;

// ---------------------------------------------------------------- shapes

struct ModelShape {
  std::string name;  // letters, digits and '_' only (a gtest name)
  int64_t num_experts = 0;
  int64_t hidden = 0;
  int64_t inter = 0;
  RoutingParams routing;
  Activation activation = Activation::kSwiGLU;
  bool with_bias = false;
};

RoutingParams softmax_routing(int top_k, bool renormalize) {
  RoutingParams p;
  p.mode = RoutingMode::kSoftmaxTopK;
  p.top_k = top_k;
  p.renormalize = renormalize;
  return p;
}

RoutingParams noaux_routing(int top_k, int num_groups, int topk_groups, float scaling) {
  RoutingParams p;
  p.mode = RoutingMode::kNoauxTc;
  p.top_k = top_k;
  p.num_groups = num_groups;
  p.topk_groups = topk_groups;
  p.routed_scaling_factor = scaling;
  return p;
}

RoutingParams gptoss_routing(int top_k) {
  RoutingParams p;
  p.mode = RoutingMode::kGptOss;
  p.top_k = top_k;
  return p;
}

// The models' expert counts and routing, hidden/inter scaled down so the CPU
// reference stays fast. 336, 272 and 208 are multiples of 16 but not of 128
// (hidden 336, 272: GEMM2's N and GEMM1's K edges; inter 272, 144, 208:
// GEMM1's N and GEMM2's K edges).
const std::vector<ModelShape>& model_shapes() {
  static const std::vector<ModelShape> shapes = {
      {"DeepSeekV3", 256, 512, 256, noaux_routing(8, 8, 4, 2.5f)},
      {"GLM45", 160, 336, 272, noaux_routing(8, 1, 1, 2.5f)},
      {"Qwen3_30B", 128, 256, 144, softmax_routing(8, true)},
      {"GptOss", 128, 272, 192, gptoss_routing(4), Activation::kGptOss, /*with_bias=*/true},
      {"Mixtral", 8, 384, 208, softmax_routing(2, true)},
  };
  return shapes;
}

const ModelShape& shape_named(const std::string& name) {
  for (const ModelShape& s : model_shapes())
    if (s.name == name) return s;
  throw std::runtime_error("no model shape " + name);
}

// Token counts every model runs: one token, fewer tokens than experts per
// token, a decode batch, and a prefill chunk far from any tile multiple.
constexpr int64_t kTokenCounts[] = {1, 3, 64, 1000};
constexpr int64_t kMaxTokens = 1000;

MoeLayerOptions layer_options(const ModelShape& shape,
                              FinalizeMode finalize = FinalizeMode::kDeterministic) {
  MoeLayerOptions o;
  o.activation = shape.activation;
  o.routing = shape.routing;
  o.finalize = finalize;
  return o;
}

// ------------------------------------------------------------- host data

std::vector<float> bf16_to_floats(const std::vector<uint16_t>& bits) {
  std::vector<float> out(bits.size());
  for (size_t i = 0; i < bits.size(); ++i) out[i] = bf16_to_float(bits[i]);
  return out;
}

std::vector<float> normal_floats(size_t count, float stddev, std::mt19937& rng) {
  std::normal_distribution<float> dist(0.0f, stddev);
  std::vector<float> out(count);
  for (float& v : out) v = dist(rng);
  return out;
}

// Random weights in the quantised domain (every fp4 code, heavy-tailed block
// scales); gate and up share a global scale, as ModelOpt writes them. Global
// scales ~ 1/sqrt(K) keep the projections' outputs O(1).
MoeWeights random_weights(const ModelShape& shape, std::mt19937& rng) {
  std::uniform_real_distribution<float> jitter(0.5f, 2.0f);
  MoeWeights w;
  w.num_experts = shape.num_experts;
  w.hidden = shape.hidden;
  w.inter = shape.inter;
  for (int64_t e = 0; e < shape.num_experts; ++e) {
    const float gate_up_scale = jitter(rng) * 0.1f / std::sqrt(static_cast<float>(shape.hidden));
    const float down_scale = jitter(rng) * 0.1f / std::sqrt(static_cast<float>(shape.inter));
    ExpertWeights ex;
    ex.gate = testing::random_nvfp4(shape.inter, shape.hidden, gate_up_scale, rng);
    ex.up = testing::random_nvfp4(shape.inter, shape.hidden, gate_up_scale, rng);
    ex.down = testing::random_nvfp4(shape.hidden, shape.inter, down_scale, rng);
    if (shape.with_bias) {
      // Comparable to what they are added to (gate/up rows ~10, output rows
      // ~50-100 with these scales), so a bias dropped or applied twice fails.
      ex.gate_bias = normal_floats(static_cast<size_t>(shape.inter), 4.0f, rng);
      ex.up_bias = normal_floats(static_cast<size_t>(shape.inter), 4.0f, rng);
      ex.down_bias = normal_floats(static_cast<size_t>(shape.hidden), 40.0f, rng);
    }
    w.experts.push_back(std::move(ex));
  }
  return w;
}

// For one token: the smallest gap between a score that decides its routing
// and the next one down (the k-th chosen vs the best unchosen expert; for
// grouped noaux_tc also the last kept vs the best dropped group). Scores are
// the logits (softmax and gpt-oss rank by them) or sigmoid + correction bias.
double routing_margin(const float* logits, int64_t num_experts, const float* correction_bias,
                      const RoutingParams& p) {
  std::vector<double> score(static_cast<size_t>(num_experts));
  for (int64_t e = 0; e < num_experts; ++e) {
    score[e] = logits[e];
    if (p.mode == RoutingMode::kNoauxTc)
      score[e] = 1.0 / (1.0 + std::exp(-score[e])) + (correction_bias ? correction_bias[e] : 0.0);
  }
  double margin = std::numeric_limits<double>::infinity();
  std::vector<double> candidates = score;
  if (p.mode == RoutingMode::kNoauxTc && p.num_groups > 1) {
    const int64_t group_size = num_experts / p.num_groups;
    std::vector<double> group_score(static_cast<size_t>(p.num_groups));
    for (int g = 0; g < p.num_groups; ++g) {
      std::vector<double> members(score.begin() + g * group_size,
                                  score.begin() + (g + 1) * group_size);
      std::partial_sort(members.begin(), members.begin() + 2, members.end(), std::greater<>());
      group_score[g] = members[0] + members[1];
    }
    std::vector<double> ranked = group_score;
    std::sort(ranked.begin(), ranked.end(), std::greater<>());
    const double last_kept = ranked[p.topk_groups - 1];
    if (p.topk_groups < p.num_groups) margin = last_kept - ranked[p.topk_groups];
    candidates.clear();
    for (int g = 0; g < p.num_groups; ++g)
      if (group_score[g] >= last_kept)
        candidates.insert(candidates.end(), score.begin() + g * group_size,
                          score.begin() + (g + 1) * group_size);
  }
  std::sort(candidates.begin(), candidates.end(), std::greater<>());
  if (candidates.size() > static_cast<size_t>(p.top_k))
    margin = std::min(margin, candidates[p.top_k - 1] - candidates[p.top_k]);
  return margin;
}

// Router logits [num_tokens, num_experts], N(0, 1), each token redrawn until
// its routing_margin is at least kMinRoutingMargin.
constexpr double kMinRoutingMargin = 1e-3;
std::vector<float> draw_router_logits(int64_t num_tokens, int64_t num_experts,
                                      const std::vector<float>& correction_bias,
                                      const RoutingParams& params, std::mt19937& rng) {
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> logits(static_cast<size_t>(num_tokens * num_experts));
  const float* bias = correction_bias.empty() ? nullptr : correction_bias.data();
  for (int64_t t = 0; t < num_tokens; ++t) {
    float* row = logits.data() + t * num_experts;
    do {
      for (int64_t e = 0; e < num_experts; ++e) row[e] = dist(rng);
    } while (routing_margin(row, num_experts, bias, params) < kMinRoutingMargin);
  }
  return logits;
}

// The reference the layer is held to element by element: the CPU layer in
// double with the intermediate act(gate, up) rounded to bf16, as the GPU
// stores it (W4A16: GEMM2's activations are bf16). Against the all-double
// reference a single element can miss by far more than the bf16 output
// rounding where large per-slot contributions cancel (the random weights
// have block scales up to 448); ModelMatrix checks the relative error
// against that reference too.
std::vector<float> reference_output(const MoeWeights& weights,
                                    const std::vector<uint16_t>& hidden_states,
                                    const Routing& routing, Activation activation,
                                    Intermediate intermediate = Intermediate::kBf16) {
  const std::vector<float> x = bf16_to_floats(hidden_states);  // exact
  std::vector<float> out(static_cast<size_t>(routing.num_tokens * weights.hidden));
  moe_reference(weights, x.data(), routing, activation, out.data(), 0, intermediate);
  return out;
}

// One batch of tokens with its routing and reference output.
struct TokenBatch {
  int64_t num_tokens = 0;
  std::vector<uint16_t> hidden_states;  // bf16 [T, hidden]
  std::vector<float> router_logits;     // fp32 [T, num_experts]
  Routing routing;                      // route(router_logits): the reference's routing
  std::vector<float> reference;         // fp32 [T, hidden], bf16 intermediate
  std::vector<float> reference_exact;   // fp32 [T, hidden], all in double
};

// A model's weights and its batches, built once per test binary run.
struct ModelData {
  ModelShape shape;
  MoeWeights weights;
  std::vector<float> correction_bias;  // [num_experts], noaux_tc only
  std::mt19937 rng;
  std::map<int64_t, TokenBatch> batches;

  const float* bias_or_null() const {
    return correction_bias.empty() ? nullptr : correction_bias.data();
  }

  // A fresh batch of T tokens (new random hidden states and logits).
  TokenBatch make_batch(int64_t num_tokens) {
    TokenBatch b;
    b.num_tokens = num_tokens;
    b.hidden_states = testing::random_bf16(static_cast<size_t>(num_tokens * shape.hidden), rng);
    b.router_logits =
        draw_router_logits(num_tokens, shape.num_experts, correction_bias, shape.routing, rng);
    b.routing =
        route(b.router_logits.data(), num_tokens, shape.num_experts, bias_or_null(), shape.routing);
    b.reference = reference_output(weights, b.hidden_states, b.routing, shape.activation);
    b.reference_exact = reference_output(weights, b.hidden_states, b.routing, shape.activation,
                                         Intermediate::kExact);
    return b;
  }

  // The shared batch of T tokens, made on first use.
  const TokenBatch& batch(int64_t num_tokens) {
    auto it = batches.find(num_tokens);
    if (it == batches.end()) it = batches.emplace(num_tokens, make_batch(num_tokens)).first;
    return it->second;
  }
};

ModelData& model_data(const ModelShape& shape) {
  static std::map<std::string, std::unique_ptr<ModelData>> cache;
  std::unique_ptr<ModelData>& slot = cache[shape.name];
  if (!slot) {
    slot = std::make_unique<ModelData>();
    slot->shape = shape;
    slot->rng.seed(static_cast<uint32_t>(std::hash<std::string>{}(shape.name)));
    slot->weights = random_weights(shape, slot->rng);
    if (shape.routing.mode == RoutingMode::kNoauxTc)
      slot->correction_bias =
          normal_floats(static_cast<size_t>(shape.num_experts), 0.1f, slot->rng);
  }
  return *slot;
}

// Caller-given routing patterns that device routing of random logits never produces.
enum class RoutingPattern {
  kHotExpert,   // 90% of tokens send one slot to the same expert
  kFewExperts,  // all tokens use a handful of experts; the rest get none
};

std::string to_string(RoutingPattern p) {
  return p == RoutingPattern::kHotExpert ? "HotExpert" : "FewExperts";
}
void PrintTo(RoutingPattern p, std::ostream* os) { *os << to_string(p); }

// max(3, top_k + 1) experts spread over [0, num_experts), both ends included.
std::vector<int32_t> few_expert_pool(int64_t num_experts, int top_k) {
  const int64_t n = std::min<int64_t>(num_experts, std::max(3, top_k + 1));
  std::vector<int32_t> pool;
  for (int64_t i = 0; i < n; ++i)
    pool.push_back(static_cast<int32_t>(n == 1 ? 0 : i * (num_experts - 1) / (n - 1)));
  return pool;
}

Routing patterned_routing(RoutingPattern pattern, int64_t num_tokens, int64_t num_experts,
                          int top_k, std::mt19937& rng) {
  Routing r;
  r.num_tokens = num_tokens;
  r.top_k = top_k;
  std::vector<int32_t> pool(static_cast<size_t>(num_experts));
  std::iota(pool.begin(), pool.end(), 0);
  if (pattern == RoutingPattern::kFewExperts) pool = few_expert_pool(num_experts, top_k);
  const int32_t hot_expert =
      static_cast<int32_t>(num_experts / 2 + 1) % static_cast<int32_t>(num_experts);
  std::uniform_real_distribution<float> weight(0.1f, 1.0f);
  std::bernoulli_distribution is_hot(0.9);
  std::uniform_int_distribution<int> slot(0, top_k - 1);
  for (int64_t t = 0; t < num_tokens; ++t) {
    std::shuffle(pool.begin(), pool.end(), rng);
    std::vector<int32_t> chosen(pool.begin(), pool.begin() + top_k);
    if (pattern == RoutingPattern::kHotExpert && is_hot(rng) &&
        std::find(chosen.begin(), chosen.end(), hot_expert) == chosen.end())
      chosen[slot(rng)] = hot_expert;
    for (int j = 0; j < top_k; ++j) {
      r.topk_ids.push_back(chosen[j]);
      r.topk_weights.push_back(weight(rng));
    }
  }
  return r;
}

// -------------------------------------------------------------- device side

// A non-blocking stream: no implicit ordering with the legacy default stream,
// so every forward's work must be ordered on its own stream.
class Stream {
 public:
  Stream() { FP4MOE_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking)); }
  ~Stream() { cudaStreamDestroy(stream_); }
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
  cudaStream_t get() const { return stream_; }

 private:
  cudaStream_t stream_ = nullptr;
};

// Device copies of one batch's inputs, for device routing (logits) and for
// caller routing (ids and weights).
struct DeviceInputs {
  int64_t num_tokens = 0;
  DeviceBuffer<uint16_t> hidden_states;
  DeviceBuffer<float> router_logits;
  DeviceBuffer<float> correction_bias;
  DeviceBuffer<int32_t> topk_ids;
  DeviceBuffer<float> topk_weights;

  DeviceInputs(const std::vector<uint16_t>& hidden, const std::vector<float>& logits,
               const std::vector<float>& bias, const Routing& routing, int64_t tokens)
      : num_tokens(tokens),
        hidden_states(hidden),
        router_logits(logits),
        correction_bias(bias),
        topk_ids(routing.topk_ids),
        topk_weights(routing.topk_weights) {
    // The uploads ran on the legacy stream; the forwards run on non-blocking ones.
    FP4MOE_CUDA_CHECK(cudaDeviceSynchronize());
  }
  DeviceInputs(const TokenBatch& b, const std::vector<float>& bias)
      : DeviceInputs(b.hidden_states, b.router_logits, bias, b.routing, b.num_tokens) {}

  MoeForwardArgs device_routing() const {
    MoeForwardArgs a;
    a.hidden_states = hidden_states.get();
    a.num_tokens = num_tokens;
    a.router_logits = router_logits.get();
    a.correction_bias = correction_bias.get();  // null when empty
    return a;
  }
  MoeForwardArgs caller_routing() const {
    MoeForwardArgs a;
    a.hidden_states = hidden_states.get();
    a.num_tokens = num_tokens;
    a.topk_ids = topk_ids.get();
    a.topk_weights = topk_weights.get();
    return a;
  }
};

// A workspace for up to max_tokens tokens, zeroed once as the contract asks.
DeviceBuffer<uint8_t> make_workspace(const MoeLayer& layer, int64_t max_tokens) {
  DeviceBuffer<uint8_t> ws(layer.workspace_bytes(max_tokens));
  ws.fill_bytes(0);
  FP4MOE_CUDA_CHECK(cudaDeviceSynchronize());
  return ws;
}

// The first `count` elements of a downloaded output; checks that the rest of
// the (poisoned) buffer was left alone.
std::vector<uint16_t> output_rows(std::vector<uint16_t> all, size_t count) {
  const auto beyond = std::count_if(all.begin() + static_cast<std::ptrdiff_t>(count), all.end(),
                                    [](uint16_t v) { return v != 0xFFFF; });
  EXPECT_EQ(beyond, 0) << "the forward wrote past its output rows";
  all.resize(count);
  return all;
}

// Poisons `output` (0xFF bytes: bf16 NaN), runs one forward on `stream`,
// waits, and returns the bf16 bits of the num_tokens output rows.
std::vector<uint16_t> forward_bits(const MoeLayer& layer, const MoeForwardArgs& args,
                                   DeviceBuffer<uint16_t>& output,
                                   const DeviceBuffer<uint8_t>& workspace, cudaStream_t stream) {
  output.fill_bytes(0xFF, stream);
  layer.forward(args, output.get(), workspace.get(), workspace.bytes(), stream);
  return output_rows(output.download(stream),
                     static_cast<size_t>(args.num_tokens * layer.hidden()));
}

// Checks a bf16 layer output against the reference: ||out - ref|| / ||ref||
// < 1e-2, every element within compare()'s atol + rtol |ref|, none
// unwritten. Returns the relative error for the log.
double expect_matches_reference(const std::vector<uint16_t>& out, const std::vector<float>& ref,
                                int64_t hidden) {
  EXPECT_EQ(out.size(), ref.size());
  if (out.size() != ref.size()) return 1.0;
  const testing::Comparison c =
      testing::compare(bf16_to_floats(out), std::vector<double>(ref.begin(), ref.end()), hidden);
  EXPECT_LT(c.rel_err, 1e-2) << c.first_bad;
  EXPECT_EQ(c.num_bad, 0) << c.first_bad;
  EXPECT_EQ(c.num_unwritten, 0) << c.first_bad;
  return c.rel_err;
}

// Index of the first differing element, or -1: for bit-exact comparisons.
int64_t first_difference(const std::vector<uint16_t>& a, const std::vector<uint16_t>& b) {
  if (a.size() != b.size()) return 0;
  const auto it = std::mismatch(a.begin(), a.end(), b.begin());
  return it.first == a.end() ? -1 : static_cast<int64_t>(it.first - a.begin());
}

bool same_tile(const TileConfig& a, const TileConfig& b) {
  return a.family == b.family && a.block_n == b.block_n && a.block_m == b.block_m &&
         a.block_k == b.block_k && a.stages == b.stages && a.warps == b.warps;
}

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// -------------------------------------------- model shapes x modes x tokens

using ModelModes = std::tuple<int, FinalizeMode, GatherMode>;
class ModelMatrix : public ::testing::TestWithParam<ModelModes> {};

TEST_P(ModelMatrix, MatchesReferenceWithDeviceAndCallerRouting) {
  FP4MOE_REQUIRE_GPU();
  const auto [model_idx, finalize, gather] = GetParam();
  const ModelShape& shape = model_shapes()[static_cast<size_t>(model_idx)];
  ModelData& data = model_data(shape);
  const MoeLayer layer = MoeLayerInternals::prepare(data.weights, layer_options(shape, finalize), gather);
  EXPECT_EQ(layer.num_experts(), shape.num_experts);
  EXPECT_EQ(layer.hidden(), shape.hidden);
  EXPECT_EQ(layer.inter(), shape.inter);
  EXPECT_EQ(layer.top_k(), shape.routing.top_k);

  Stream stream;
  const DeviceBuffer<uint8_t> workspace = make_workspace(layer, kMaxTokens);
  DeviceBuffer<uint16_t> output(static_cast<size_t>(kMaxTokens * shape.hidden));
  for (int64_t num_tokens : kTokenCounts) {
    const TokenBatch& batch = data.batch(num_tokens);
    const DeviceInputs inputs(batch, data.correction_bias);
    EXPECT_EQ(layer.plan(num_tokens).num_rows, num_tokens * shape.routing.top_k);
    for (bool device_routing : {true, false}) {
      const std::string what = shape.name + " T=" + std::to_string(num_tokens) + " " +
                               (device_routing ? "device routing" : "caller routing") + " " +
                               to_string(finalize) + " " + to_string(gather);
      SCOPED_TRACE(what);
      const std::vector<uint16_t> out =
          forward_bits(layer, device_routing ? inputs.device_routing() : inputs.caller_routing(),
                       output, workspace, stream.get());
      const double rel_err = expect_matches_reference(out, batch.reference, shape.hidden);
      // Against the all-double layer: the contract's ||out - ref|| / ||ref|| < 1e-2.
      const double rel_err_exact =
          testing::compare(bf16_to_floats(out),
                           std::vector<double>(batch.reference_exact.begin(),
                                               batch.reference_exact.end()),
                           shape.hidden)
              .rel_err;
      EXPECT_LT(rel_err_exact, 1e-2);
      std::printf("  %-60s rel_err %.2e (all-double reference %.2e)\n", what.c_str(), rel_err,
                  rel_err_exact);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Models, ModelMatrix,
    ::testing::Combine(::testing::Range(0, static_cast<int>(model_shapes().size())),
                       ::testing::Values(FinalizeMode::kDeterministic, FinalizeMode::kAtomic),
                       ::testing::Values(GatherMode::kFused, GatherMode::kSeparate)),
    [](const ::testing::TestParamInfo<ModelModes>& param_info) {
      return model_shapes()[static_cast<size_t>(std::get<0>(param_info.param))].name + "_" +
             to_string(std::get<1>(param_info.param)) + "_" +
             to_string(std::get<2>(param_info.param));
    });

// ------------------------------------------- skewed and sparse caller routing

// The model shapes plus a top-1 layer, where "90% of tokens to one expert"
// is also 90% of all (token, slot) pairs; with top_k > 1 a token may name an
// expert once only, so the hot expert gets at most 1/top_k of the pairs.
const std::vector<ModelShape>& pattern_shapes() {
  static const std::vector<ModelShape> shapes = [] {
    std::vector<ModelShape> s = model_shapes();
    s.push_back({"Top1", 64, 256, 144, softmax_routing(1, false)});
    return s;
  }();
  return shapes;
}

using ShapePattern = std::tuple<int, RoutingPattern>;
class CallerRoutingPatterns : public ::testing::TestWithParam<ShapePattern> {};

TEST_P(CallerRoutingPatterns, MatchReference) {
  FP4MOE_REQUIRE_GPU();
  const auto [shape_idx, pattern] = GetParam();
  const ModelShape& shape = pattern_shapes()[static_cast<size_t>(shape_idx)];
  ModelData& data = model_data(shape);
  for (FinalizeMode finalize : {FinalizeMode::kDeterministic, FinalizeMode::kAtomic}) {
    const MoeLayer layer = MoeLayer::prepare(data.weights, layer_options(shape, finalize));
    Stream stream;
    const DeviceBuffer<uint8_t> workspace = make_workspace(layer, kMaxTokens);
    DeviceBuffer<uint16_t> output(static_cast<size_t>(kMaxTokens * shape.hidden));
    for (int64_t num_tokens : {int64_t{3}, int64_t{64}, kMaxTokens}) {
      std::mt19937 rng(static_cast<uint32_t>(num_tokens * 31 + shape_idx));
      const std::vector<uint16_t> hidden =
          testing::random_bf16(static_cast<size_t>(num_tokens * shape.hidden), rng);
      const Routing routing =
          patterned_routing(pattern, num_tokens, shape.num_experts, shape.routing.top_k, rng);
      std::vector<int64_t> pairs_per_expert(static_cast<size_t>(shape.num_experts), 0);
      for (int32_t id : routing.topk_ids) ++pairs_per_expert[static_cast<size_t>(id)];
      const int64_t used = std::count_if(pairs_per_expert.begin(), pairs_per_expert.end(),
                                         [](int64_t n) { return n > 0; });
      const int64_t busiest = *std::max_element(pairs_per_expert.begin(), pairs_per_expert.end());
      const std::string what =
          shape.name + " " + to_string(pattern) + " T=" + std::to_string(num_tokens) + " " +
          to_string(finalize) + ": " + std::to_string(used) + " of " +
          std::to_string(shape.num_experts) + " experts used, busiest has " +
          std::to_string(busiest) + " of " + std::to_string(routing.topk_ids.size()) + " pairs";
      SCOPED_TRACE(what);
      const DeviceInputs inputs(hidden, {}, {}, routing, num_tokens);
      const std::vector<uint16_t> out =
          forward_bits(layer, inputs.caller_routing(), output, workspace, stream.get());
      const double rel_err = expect_matches_reference(
          out, reference_output(data.weights, hidden, routing, shape.activation), shape.hidden);
      std::printf("  %-90s rel_err %.2e\n", what.c_str(), rel_err);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Patterns, CallerRoutingPatterns,
    ::testing::Combine(::testing::Range(0, static_cast<int>(pattern_shapes().size())),
                       ::testing::Values(RoutingPattern::kHotExpert, RoutingPattern::kFewExperts)),
    [](const ::testing::TestParamInfo<ShapePattern>& param_info) {
      return pattern_shapes()[static_cast<size_t>(std::get<0>(param_info.param))].name + "_" +
             to_string(std::get<1>(param_info.param));
    });

// ------------------------------------------------------ forced tile configs

// The compiled tile shapes whose family runs on this GPU: compiled_configs()
// lists each once per epilogue, and the layer sets the epilogue itself.
std::vector<TileConfig> compiled_tiles() {
  ArchLimits arch;
  const int cc = local_arch_limits(&arch) ? arch.compute_capability : 0;
  std::vector<TileConfig> tiles;
  for (const TileConfig& c : compiled_configs())
    if (family_runs_on(c.family, cc) &&
        std::none_of(tiles.begin(), tiles.end(), [&](const TileConfig& t) { return same_tile(t, c); }))
      tiles.push_back(c);
  return tiles;
}

// Every tile forced in GEMM1 (SwiGLU epilogue) and GEMM2 (finalize), paired
// with the next tile in the list so that each GEMM sees every tile and both
// families meet in one layer.
TEST(MoeLayerConfigs, EveryCompiledConfigForcedInBothGemms) {
  FP4MOE_REQUIRE_GPU();
  const std::vector<TileConfig> tiles = compiled_tiles();
  ASSERT_FALSE(tiles.empty());
  std::vector<std::pair<TileConfig, TileConfig>> pairs;
  for (size_t i = 0; i < tiles.size(); ++i) pairs.emplace_back(tiles[i], tiles[(i + 1) % tiles.size()]);
  for (const std::string name : {"GLM45", "Mixtral"}) {
    const ModelShape& shape = shape_named(name);
    ModelData& data = model_data(shape);
    std::vector<std::unique_ptr<DeviceInputs>> inputs;
    const int64_t token_counts[] = {3, 64, kMaxTokens};
    for (int64_t t : token_counts)
      inputs.push_back(std::make_unique<DeviceInputs>(data.batch(t), data.correction_bias));
    Stream stream;
    DeviceBuffer<uint16_t> output(static_cast<size_t>(kMaxTokens * shape.hidden));
    for (const auto& [config1, config2] : pairs) {
      {
        MoeLayerOptions options = layer_options(shape);
        options.gemm1_config = config1;
        options.gemm2_config = config2;
        const MoeLayer layer = MoeLayer::prepare(data.weights, options);
        const DeviceBuffer<uint8_t> workspace = make_workspace(layer, kMaxTokens);
        for (size_t i = 0; i < inputs.size(); ++i) {
          const int64_t num_tokens = token_counts[i];
          const std::string what = shape.name + " gemm1 " + config1.to_string() + " gemm2 " +
                                   config2.to_string() + " T=" + std::to_string(num_tokens);
          SCOPED_TRACE(what);
          const MoeLayerPlan plan = layer.plan(num_tokens);
          EXPECT_TRUE(same_tile(plan.gemm1.config, config1))
              << "planned " << plan.gemm1.config.to_string();
          EXPECT_TRUE(same_tile(plan.gemm2.config, config2))
              << "planned " << plan.gemm2.config.to_string();
          const std::vector<uint16_t> out =
              forward_bits(layer, inputs[i]->device_routing(), output, workspace, stream.get());
          const double rel_err =
              expect_matches_reference(out, data.batch(num_tokens).reference, shape.hidden);
          std::printf("  %-60s rel_err %.2e\n", what.c_str(), rel_err);
        }
      }
    }
  }
}

// ------------------------------------------------------ full-size GLM-5 layer

// Full-size weights from the fast generator (block scales 0.125 .. 2).
MoeWeights fast_random_weights(const ModelShape& shape) {
  MoeWeights w;
  w.num_experts = shape.num_experts;
  w.hidden = shape.hidden;
  w.inter = shape.inter;
  w.experts.resize(static_cast<size_t>(shape.num_experts));
  const float gate_up_scale = 0.3f / std::sqrt(static_cast<float>(shape.hidden));
  const float down_scale = 0.3f / std::sqrt(static_cast<float>(shape.inter));
  parallel_for(shape.num_experts, [&](int64_t e) {
    ExpertWeights& ex = w.experts[static_cast<size_t>(e)];
    const uint64_t seed = 0xF00D0000ull + static_cast<uint64_t>(e) * 3;
    ex.gate = testing::fast_random_nvfp4(shape.inter, shape.hidden, gate_up_scale, seed);
    ex.up = testing::fast_random_nvfp4(shape.inter, shape.hidden, gate_up_scale, seed + 1);
    ex.down = testing::fast_random_nvfp4(shape.hidden, shape.inter, down_scale, seed + 2);
  });
  return w;
}

size_t host_weight_bytes(const MoeWeights& w) {
  size_t bytes = 0;
  for (const ExpertWeights& ex : w.experts)
    for (const Nvfp4Matrix* m : {&ex.gate, &ex.up, &ex.down})
      bytes += m->packed.size() + m->scales.size();
  return bytes;
}

TEST(MoeLayerFullSize, Glm5AtOneAnd64Tokens) {
  FP4MOE_REQUIRE_GPU();
  const ModelShape shape{"GLM5", 256, 6144, 2048, noaux_routing(8, 1, 1, 2.5f)};

  auto start = std::chrono::steady_clock::now();
  const MoeWeights weights = fast_random_weights(shape);
  std::printf("  GLM-5: generated %.2f GB of NVFP4 weights in %.1f s\n",
              host_weight_bytes(weights) / 1e9, seconds_since(start));

  start = std::chrono::steady_clock::now();
  const MoeLayer layer = MoeLayer::prepare(weights, layer_options(shape));
  std::printf("  GLM-5: prepare (repack + upload %.2f GB) took %.1f s\n",
              layer.device_weight_bytes() / 1e9, seconds_since(start));

  std::mt19937 rng(55);
  const std::vector<float> correction_bias =
      normal_floats(static_cast<size_t>(shape.num_experts), 0.1f, rng);
  Stream stream;
  const int64_t max_tokens = 64;
  const DeviceBuffer<uint8_t> workspace = make_workspace(layer, max_tokens);
  DeviceBuffer<uint16_t> output(static_cast<size_t>(max_tokens * shape.hidden));
  for (int64_t num_tokens : {int64_t{1}, max_tokens}) {
    SCOPED_TRACE("GLM-5 T=" + std::to_string(num_tokens));
    TokenBatch b;
    b.num_tokens = num_tokens;
    b.hidden_states = testing::random_bf16(static_cast<size_t>(num_tokens * shape.hidden), rng);
    b.router_logits =
        draw_router_logits(num_tokens, shape.num_experts, correction_bias, shape.routing, rng);
    b.routing = route(b.router_logits.data(), num_tokens, shape.num_experts, correction_bias.data(),
                      shape.routing);
    start = std::chrono::steady_clock::now();
    b.reference = reference_output(weights, b.hidden_states, b.routing, shape.activation);
    const double reference_s = seconds_since(start);

    const DeviceInputs inputs(b, correction_bias);
    for (bool device_routing : {true, false}) {
      const std::vector<uint16_t> out =
          forward_bits(layer, device_routing ? inputs.device_routing() : inputs.caller_routing(),
                       output, workspace, stream.get());
      const double rel_err = expect_matches_reference(out, b.reference, shape.hidden);
      std::printf("  GLM-5 T=%lld %s routing: reference %.1f s, rel_err %.2e\n",
                  static_cast<long long>(num_tokens), device_routing ? "device" : "caller",
                  reference_s, rel_err);
    }
  }
}

// -------------------------------------------------------------- determinism

TEST(MoeLayerDeterminism, DeterministicForwardsAreBitIdentical) {
  FP4MOE_REQUIRE_GPU();
  for (const std::string name : {"DeepSeekV3", "GptOss"}) {
    const ModelShape& shape = shape_named(name);
    ModelData& data = model_data(shape);
    const TokenBatch& batch = data.batch(kMaxTokens);
    const DeviceInputs inputs(batch, data.correction_bias);
    for (GatherMode gather : {GatherMode::kFused, GatherMode::kSeparate}) {
      SCOPED_TRACE(shape.name + " " + to_string(gather));
      const MoeLayer layer =
          MoeLayerInternals::prepare(data.weights, layer_options(shape, FinalizeMode::kDeterministic), gather);
      Stream stream;
      const DeviceBuffer<uint8_t> workspace = make_workspace(layer, kMaxTokens);
      DeviceBuffer<uint16_t> output(static_cast<size_t>(kMaxTokens * shape.hidden));
      const std::vector<uint16_t> first =
          forward_bits(layer, inputs.device_routing(), output, workspace, stream.get());
      expect_matches_reference(first, batch.reference, shape.hidden);
      for (int run = 1; run < 5; ++run) {
        const std::vector<uint16_t> again =
            forward_bits(layer, inputs.device_routing(), output, workspace, stream.get());
        EXPECT_EQ(first_difference(first, again), -1) << "run " << run << " differs from run 0";
      }
    }
  }
}

// GatherMode::kAuto gathers separately where GEMM1's plan reads its
// activations by tensor map (here an SM90 m128 tile, forced), and falls back
// to the fused gather where the workspace lacks room for the sorted copy
// (sizes from workspace_bytes() may hold it anyway: split-K partials of
// smaller counts can need more); all three modes give the same bits.
TEST(MoeLayerDeterminism, AutoGatherMatchesFusedAndSeparateBits) {
  FP4MOE_REQUIRE_GPU();
  ArchLimits arch;
  if (!local_arch_limits(&arch) || !family_runs_on(KernelFamily::kSm90, arch.compute_capability))
    GTEST_SKIP() << "needs an SM90 GPU for the tensor-mapped GEMM1 tile";
  const ModelShape& shape = shape_named("DeepSeekV3");
  ModelData& data = model_data(shape);
  const TokenBatch& batch = data.batch(kMaxTokens);
  const DeviceInputs inputs(batch, data.correction_bias);
  MoeLayerOptions options = layer_options(shape, FinalizeMode::kDeterministic);
  options.gemm1_config = TileConfig::parse("sm90n128m128k128s4w12");
  Stream stream;
  DeviceBuffer<uint16_t> output(static_cast<size_t>(kMaxTokens * shape.hidden));
  std::vector<uint16_t> bits[3];
  const GatherMode modes[3] = {GatherMode::kFused, GatherMode::kSeparate, GatherMode::kAuto};
  for (int i = 0; i < 3; ++i) {
    const MoeLayer layer = MoeLayerInternals::prepare(data.weights, options, modes[i]);
    const DeviceBuffer<uint8_t> workspace = make_workspace(layer, kMaxTokens);
    EXPECT_EQ(MoeLayerInternals::separate_gather(layer, kMaxTokens, workspace.bytes()),
              modes[i] != GatherMode::kFused)
        << to_string(modes[i]);
    bits[i] = forward_bits(layer, inputs.device_routing(), output, workspace, stream.get());
    EXPECT_EQ(first_difference(bits[i], bits[0]), -1) << to_string(modes[i]) << " differs from fused";
    if (modes[i] == GatherMode::kAuto) {
      expect_matches_reference(bits[i], batch.reference, shape.hidden);
      // The smallest workspace with room for the sorted copy (found by
      // bisection), and one 256 B short of it: there auto runs fused.
      size_t lo = 0, hi = workspace.bytes();
      while (hi - lo > 1) {
        const size_t mid = lo + (hi - lo) / 2;
        (MoeLayerInternals::separate_gather(layer, kMaxTokens, mid) ? hi : lo) = mid;
      }
      const DeviceBuffer<uint8_t> short_of_it = [&] {
        DeviceBuffer<uint8_t> ws(hi - 256);
        ws.fill_bytes(0);
        FP4MOE_CUDA_CHECK(cudaDeviceSynchronize());
        return ws;
      }();
      EXPECT_FALSE(MoeLayerInternals::separate_gather(layer, kMaxTokens, short_of_it.bytes()));
      EXPECT_EQ(first_difference(forward_bits(layer, inputs.device_routing(), output, short_of_it, stream.get()),
                                 bits[0]),
                -1)
          << "auto with a workspace short of the sorted copy differs from fused";
    }
  }
}

// Programmatic dependent launch changes when kernels start, never what they
// compute: plain launches give the same bits, eagerly and from a graph, at
// decode sizes (routing and sort in one kernel) and at kMaxTokens (two).
TEST(MoeLayerDeterminism, PlainLaunchesGiveTheSameBits) {
  FP4MOE_REQUIRE_GPU();
  const ModelShape& shape = shape_named("DeepSeekV3");
  ModelData& data = model_data(shape);
  MoeLayerOptions plain_options = layer_options(shape);
  plain_options.programmatic_launch = false;
  const MoeLayer layer = MoeLayer::prepare(data.weights, layer_options(shape));
  const MoeLayer plain = MoeLayer::prepare(data.weights, plain_options);
  ASSERT_TRUE(layer.options().programmatic_launch);
  Stream stream;
  const DeviceBuffer<uint8_t> workspace = make_workspace(layer, kMaxTokens);
  DeviceBuffer<uint16_t> output(static_cast<size_t>(kMaxTokens * shape.hidden));
  for (int64_t num_tokens : {int64_t{1}, int64_t{64}, kMaxTokens}) {
    SCOPED_TRACE("T=" + std::to_string(num_tokens));
    const TokenBatch& batch = data.batch(num_tokens);
    const DeviceInputs inputs(batch, data.correction_bias);
    const std::vector<uint16_t> with_pdl =
        forward_bits(layer, inputs.device_routing(), output, workspace, stream.get());
    expect_matches_reference(with_pdl, batch.reference, shape.hidden);
    const std::vector<uint16_t> without =
        forward_bits(plain, inputs.device_routing(), output, workspace, stream.get());
    EXPECT_EQ(first_difference(with_pdl, without), -1) << "plain launches differ";

    // The same forward captured in a graph (programmatic edges) and replayed.
    output.fill_bytes(0xFF, stream.get());
    cudaGraph_t graph = nullptr;
    FP4MOE_CUDA_CHECK(cudaStreamBeginCapture(stream.get(), cudaStreamCaptureModeThreadLocal));
    layer.forward(inputs.device_routing(), output.get(), workspace.get(), workspace.bytes(),
                  stream.get());
    FP4MOE_CUDA_CHECK(cudaStreamEndCapture(stream.get(), &graph));
    cudaGraphExec_t exec = nullptr;
    FP4MOE_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
    for (int replay = 0; replay < 3; ++replay) FP4MOE_CUDA_CHECK(cudaGraphLaunch(exec, stream.get()));
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
    const std::vector<uint16_t> replayed =
        output_rows(output.download(stream.get()), with_pdl.size());
    EXPECT_EQ(first_difference(with_pdl, replayed), -1) << "graph replay differs";
  }
}

// Batch invariance: with MoeLayerOptions::batch_invariant, slices of a
// 512-token batch run on their own (1, 3 and 64 tokens, at different
// offsets) give exactly the bits of the same tokens in the full forward,
// although the planner picks other tiles for them. The shape (16 experts,
// top 4, hidden 512, inter 4096: GEMM2 has 16 tiles at T = 1, far fewer than
// the SMs, and a K long enough for two slices of kMinSplitKSliceK) is one
// where the default plan splits K at T = 1,
// so the option has something to undo; how many tokens
// the default layer changes is printed, not asserted (split-K may round the
// same way by chance). A 3-token slice is checked against the reference.
TEST(MoeLayerBatchInvariance, TokenOutputsDoNotDependOnTheBatch) {
  FP4MOE_REQUIRE_GPU();
  const ModelShape shape{"SplitK", 16, 512, 4096, softmax_routing(4, true)};
  constexpr int64_t kTokens = 512;
  std::mt19937 rng(2026);
  const MoeWeights weights = random_weights(shape, rng);
  const std::vector<uint16_t> hidden_states =
      testing::random_bf16(static_cast<size_t>(kTokens * shape.hidden), rng);
  const std::vector<float> logits =
      draw_router_logits(kTokens, shape.num_experts, {}, shape.routing, rng);
  const Routing routing = route(logits.data(), kTokens, shape.num_experts, nullptr, shape.routing);
  const DeviceInputs inputs(hidden_states, logits, {}, routing, kTokens);

  MoeLayerOptions invariant_options = layer_options(shape);
  invariant_options.batch_invariant = true;
  const MoeLayer invariant = MoeLayer::prepare(weights, invariant_options);
  const MoeLayer plain = MoeLayer::prepare(weights, layer_options(shape));
  ASSERT_GT(std::max(plain.plan(1).gemm1.split_k, plain.plan(1).gemm2.split_k), 1)
      << "this test needs a shape whose default plan splits K at T = 1";
  for (int64_t t : {int64_t{1}, int64_t{3}, int64_t{64}, kTokens}) {
    EXPECT_EQ(invariant.plan(t).gemm1.split_k, 1) << "T=" << t;
    EXPECT_EQ(invariant.plan(t).gemm2.split_k, 1) << "T=" << t;
  }
  // The tiles a plan runs: its row classes' and its main config's.
  const auto same_tiles = [](const GemmPlan& a, const GemmPlan& b) {
    if (!same_tile(a.config, b.config) || a.row_classes.size() != b.row_classes.size()) return false;
    for (size_t i = 0; i < a.row_classes.size(); ++i)
      if (!same_tile(a.row_classes[i].config, b.row_classes[i].config)) return false;
    return true;
  };
  EXPECT_FALSE(same_tiles(invariant.plan(1).gemm1, invariant.plan(kTokens).gemm1) &&
               same_tiles(invariant.plan(1).gemm2, invariant.plan(kTokens).gemm2))
      << "the slices should run other tiles than the full batch";

  Stream stream;
  const DeviceBuffer<uint8_t> workspace = make_workspace(invariant, kTokens);
  const DeviceBuffer<uint8_t> plain_workspace = make_workspace(plain, kTokens);
  DeviceBuffer<uint16_t> output(static_cast<size_t>(kTokens * shape.hidden));
  const std::vector<uint16_t> full_invariant =
      forward_bits(invariant, inputs.device_routing(), output, workspace, stream.get());
  const std::vector<uint16_t> full_plain =
      forward_bits(plain, inputs.device_routing(), output, plain_workspace, stream.get());

  const int64_t H = shape.hidden, E = shape.num_experts;
  struct Slice {
    int64_t first, count;
  };
  for (const Slice slice : {Slice{0, 1}, Slice{317, 1}, Slice{511, 1}, Slice{10, 3}, Slice{400, 64}}) {
    SCOPED_TRACE("tokens [" + std::to_string(slice.first) + ", " +
                 std::to_string(slice.first + slice.count) + ")");
    const auto rows = [&](const auto& all, int64_t width) {
      using Vec = std::decay_t<decltype(all)>;
      return Vec(all.begin() + slice.first * width, all.begin() + (slice.first + slice.count) * width);
    };
    const std::vector<uint16_t> hidden = rows(hidden_states, H);
    const Routing part_routing = route(rows(logits, E).data(), slice.count, E, nullptr, shape.routing);
    const DeviceInputs part(hidden, rows(logits, E), {}, part_routing, slice.count);
    const std::vector<uint16_t> got =
        forward_bits(invariant, part.device_routing(), output, workspace, stream.get());
    EXPECT_EQ(first_difference(got, rows(full_invariant, H)), -1)
        << "batch-invariant layer: the slice differs from the same tokens in the full batch";
    if (slice.count == 3)
      expect_matches_reference(got, reference_output(weights, hidden, part_routing, shape.activation), H);
    const std::vector<uint16_t> got_plain =
        forward_bits(plain, part.device_routing(), output, plain_workspace, stream.get());
    const std::vector<uint16_t> want_plain = rows(full_plain, H);
    int64_t differing_tokens = 0;
    for (int64_t t = 0; t < slice.count; ++t)
      differing_tokens += !std::equal(got_plain.begin() + t * H, got_plain.begin() + (t + 1) * H,
                                      want_plain.begin() + t * H);
    std::printf("  default layer (split-K %d/%d at T = %lld, %d/%d at T = %lld): %lld of %lld "
                "tokens differ from the full batch\n",
                plain.plan(slice.count).gemm1.split_k, plain.plan(slice.count).gemm2.split_k,
                static_cast<long long>(slice.count), plain.plan(kTokens).gemm1.split_k,
                plain.plan(kTokens).gemm2.split_k, static_cast<long long>(kTokens),
                static_cast<long long>(differing_tokens),
                static_cast<long long>(slice.count));
  }
}

// forward_pair_rows: the fp32 (token, slot) rows, summed in slot order on the
// host and rounded once, are forward()'s output bits; absent slots (-1) are
// left untouched; the atomic mode refuses.
TEST(MoeLayerPairRows, SlotOrderSumOfThePairRowsIsTheForwardOutput) {
  FP4MOE_REQUIRE_GPU();
  const ModelShape& shape = shape_named("GptOss");  // with biases
  ModelData& data = model_data(shape);
  const MoeLayer layer = MoeLayer::prepare(data.weights, layer_options(shape));
  const int64_t T = 64, H = shape.hidden;
  const int k = shape.routing.top_k;
  Routing given = data.batch(T).routing;
  for (int64_t t = 0; t < T; t += 5) given.topk_ids[static_cast<size_t>(t * k + t % k)] = -1;
  const DeviceInputs inputs(data.batch(T).hidden_states, {}, {}, given, T);
  Stream stream;
  const DeviceBuffer<uint8_t> workspace = make_workspace(layer, T);
  DeviceBuffer<uint16_t> output(static_cast<size_t>(T * H));
  const std::vector<uint16_t> want = forward_bits(layer, inputs.caller_routing(), output, workspace, stream.get());

  DeviceBuffer<float> pair_rows(static_cast<size_t>(T * k * H));
  pair_rows.fill_bytes(0xFF);  // NaN: absent slots must keep it
  FP4MOE_CUDA_CHECK(cudaDeviceSynchronize());
  layer.forward_pair_rows(inputs.caller_routing(), pair_rows.get(), workspace.get(), workspace.bytes(),
                          stream.get());
  const std::vector<float> rows = pair_rows.download(stream.get());
  int64_t bad = 0;
  for (int64_t t = 0; t < T; ++t)
    for (int64_t c = 0; c < H; ++c) {
      float sum = 0.0f;
      for (int j = 0; j < k; ++j) {
        const float v = rows[static_cast<size_t>((t * k + j) * H + c)];
        if (given.topk_ids[static_cast<size_t>(t * k + j)] == -1)
          bad += !std::isnan(v);  // untouched
        else
          sum += v;
      }
      bad += float_to_bf16(sum) != want[static_cast<size_t>(t * H + c)];
    }
  EXPECT_EQ(bad, 0) << "pair rows that do not sum to forward()'s bits, or absent rows written";

  const MoeLayer atomic =
      MoeLayer::prepare(data.weights, layer_options(shape, FinalizeMode::kAtomic));
  EXPECT_THROW(atomic.forward_pair_rows(inputs.caller_routing(), pair_rows.get(), workspace.get(),
                                        workspace.bytes(), stream.get()),
               Error);
}

// ------------------------------------------------------------ shared experts

// A layer with a shared expert against the CPU reference, which runs it
// whole (unchunked): DeepSeek-V3-like (noaux_tc, one ungated chunk), GLM-like
// (two chunks, inter not a multiple of 128) and Qwen2-MoE-like (softmax not
// renormalised, four gated chunks), for device and caller routing, both
// finalize modes and several token counts. The plan has T * (top_k + chunks)
// rows; forward_pair_rows, whose rows are [T * top_k], is refused.
TEST(MoeLayerSharedExpert, MatchesReference) {
  FP4MOE_REQUIRE_GPU();
  struct Case {
    ModelShape shape;
    int chunks;
    bool gated;
  };
  const Case cases[] = {
      {{"DeepSeekV3Shared", 64, 256, 128, noaux_routing(8, 8, 4, 2.5f)}, 1, false},
      {{"GLM45Shared", 32, 336, 208, noaux_routing(8, 1, 1, 2.5f)}, 2, false},
      {{"Qwen2MoeShared", 60, 256, 144, softmax_routing(4, false)}, 4, true},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.shape.name);
    std::mt19937 rng(static_cast<uint32_t>(std::hash<std::string>{}(c.shape.name)));
    MoeWeights weights = random_weights(c.shape, rng);
    SharedExpertWeights shared;
    shared.inter = c.chunks * c.shape.inter;
    const float gate_up_scale = 0.1f / std::sqrt(static_cast<float>(c.shape.hidden));
    shared.mlp.gate = testing::random_nvfp4(shared.inter, c.shape.hidden, gate_up_scale, rng);
    shared.mlp.up = testing::random_nvfp4(shared.inter, c.shape.hidden, gate_up_scale, rng);
    shared.mlp.down = testing::random_nvfp4(c.shape.hidden, shared.inter,
                                            0.1f / std::sqrt(static_cast<float>(shared.inter)), rng);
    if (c.gated) shared.gate = normal_floats(static_cast<size_t>(c.shape.hidden), 0.05f, rng);
    weights.shared_expert = shared;
    std::vector<float> correction_bias;
    if (c.shape.routing.mode == RoutingMode::kNoauxTc)
      correction_bias = normal_floats(static_cast<size_t>(c.shape.num_experts), 0.1f, rng);

    for (const FinalizeMode finalize : {FinalizeMode::kDeterministic, FinalizeMode::kAtomic}) {
      const MoeLayer layer = MoeLayer::prepare(weights, layer_options(c.shape, finalize));
      EXPECT_EQ(layer.top_k(), c.shape.routing.top_k);
      Stream stream;
      constexpr int64_t kMax = 300;
      const DeviceBuffer<uint8_t> workspace = make_workspace(layer, kMax);
      DeviceBuffer<uint16_t> output(static_cast<size_t>(kMax * c.shape.hidden));
      for (const int64_t T : {int64_t{1}, int64_t{3}, int64_t{64}, kMax}) {
        EXPECT_EQ(layer.plan(T).num_rows, T * (c.shape.routing.top_k + c.chunks));
        const std::vector<uint16_t> hidden = testing::random_bf16(static_cast<size_t>(T * c.shape.hidden), rng);
        const std::vector<float> logits =
            draw_router_logits(T, c.shape.num_experts, correction_bias, c.shape.routing, rng);
        const Routing routing = route(logits.data(), T, c.shape.num_experts,
                                      correction_bias.empty() ? nullptr : correction_bias.data(), c.shape.routing);
        const std::vector<float> reference = reference_output(weights, hidden, routing, c.shape.activation);
        const DeviceInputs inputs(hidden, logits, correction_bias, routing, T);
        for (const bool device_routing : {true, false}) {
          const std::string what = c.shape.name + " T=" + std::to_string(T) + " " + to_string(finalize) + " " +
                                   (device_routing ? "device routing" : "caller routing");
          SCOPED_TRACE(what);
          const std::vector<uint16_t> out = forward_bits(
              layer, device_routing ? inputs.device_routing() : inputs.caller_routing(), output, workspace,
              stream.get());
          const double rel_err = expect_matches_reference(out, reference, c.shape.hidden);
          std::printf("  %-60s rel_err %.2e\n", what.c_str(), rel_err);
        }
        if (finalize == FinalizeMode::kDeterministic && T == 3) {
          DeviceBuffer<float> pair_rows(static_cast<size_t>(T * layer.top_k() * c.shape.hidden));
          EXPECT_THAT(
              [&] {
                try {
                  layer.forward_pair_rows(inputs.caller_routing(), pair_rows.get(), workspace.get(),
                                          workspace.bytes(), stream.get());
                } catch (const Error& e) {
                  return std::string(e.what());
                }
                return std::string();
              }(),
              HasSubstr("shared expert"));
        }
      }
      EXPECT_EQ(layer.device_errors(workspace.get(), stream.get()), "");
    }
  }
}

// Repeated atomic forwards, with the token count changing in between, each
// within tolerance: the accumulation buffer must be cleared for the next one.
TEST(MoeLayerDeterminism, AtomicForwardsStayWithinTolerance) {
  FP4MOE_REQUIRE_GPU();
  const ModelShape& shape = shape_named("Qwen3_30B");
  ModelData& data = model_data(shape);
  const MoeLayer layer =
      MoeLayer::prepare(data.weights, layer_options(shape, FinalizeMode::kAtomic));
  Stream stream;
  const DeviceBuffer<uint8_t> workspace = make_workspace(layer, kMaxTokens);
  DeviceBuffer<uint16_t> output(static_cast<size_t>(kMaxTokens * shape.hidden));
  for (int64_t num_tokens :
       {kMaxTokens, int64_t{64}, kMaxTokens, kMaxTokens, int64_t{3}, kMaxTokens}) {
    SCOPED_TRACE("T=" + std::to_string(num_tokens));
    const TokenBatch& batch = data.batch(num_tokens);
    const DeviceInputs inputs(batch, data.correction_bias);
    const std::vector<uint16_t> out =
        forward_bits(layer, inputs.device_routing(), output, workspace, stream.get());
    expect_matches_reference(out, batch.reference, shape.hidden);
  }
}

// ---------------------------------------------------------------- CUDA graph

// One forward captured once, replayed with new contents in the same input
// buffers: new hidden states with the old logits, then new logits too (so the
// routing, and every expert's row count, changes under the graph).
TEST(MoeLayerGraph, ReplaysWithNewInputsEqualEagerForwards) {
  FP4MOE_REQUIRE_GPU();
  const ModelShape& shape = shape_named("DeepSeekV3");
  ModelData& data = model_data(shape);
  const int64_t num_tokens = 64;
  const TokenBatch a = data.make_batch(num_tokens);
  const TokenBatch b = data.make_batch(num_tokens);
  struct Replay {
    const char* what;
    const std::vector<uint16_t>* hidden;
    const std::vector<float>* logits;
  };
  const Replay replays[] = {{"inputs A", &a.hidden_states, &a.router_logits},
                            {"hidden B, logits A", &b.hidden_states, &a.router_logits},
                            {"inputs B", &b.hidden_states, &b.router_logits}};

  const MoeLayer layer = MoeLayer::prepare(data.weights, layer_options(shape));
  Stream stream;
  const DeviceBuffer<uint8_t> workspace = make_workspace(layer, num_tokens);
  DeviceBuffer<uint16_t> output(static_cast<size_t>(num_tokens * shape.hidden));

  std::vector<std::vector<uint16_t>> eager;
  for (const Replay& r : replays) {
    const DeviceInputs inputs(*r.hidden, *r.logits, data.correction_bias, Routing{}, num_tokens);
    eager.push_back(forward_bits(layer, inputs.device_routing(), output, workspace, stream.get()));
  }
  expect_matches_reference(eager[0], a.reference, shape.hidden);
  expect_matches_reference(eager[2], b.reference, shape.hidden);

  const DeviceInputs live(a.hidden_states, a.router_logits, data.correction_bias, Routing{},
                          num_tokens);
  cudaGraph_t graph = nullptr;
  FP4MOE_CUDA_CHECK(cudaStreamBeginCapture(stream.get(), cudaStreamCaptureModeGlobal));
  try {
    layer.forward(live.device_routing(), output.get(), workspace.get(), workspace.bytes(),
                  stream.get());
  } catch (...) {
    cudaStreamEndCapture(stream.get(), &graph);
    if (graph) cudaGraphDestroy(graph);
    throw;
  }
  FP4MOE_CUDA_CHECK(cudaStreamEndCapture(stream.get(), &graph));
  cudaGraphExec_t exec = nullptr;
  FP4MOE_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));

  for (size_t i = 0; i < std::size(replays); ++i) {
    SCOPED_TRACE(std::string("replay with ") + replays[i].what);
    const std::vector<uint16_t>& hidden = *replays[i].hidden;
    const std::vector<float>& logits = *replays[i].logits;
    FP4MOE_CUDA_CHECK(cudaMemcpyAsync(live.hidden_states.get(), hidden.data(),
                                      hidden.size() * sizeof(uint16_t), cudaMemcpyHostToDevice,
                                      stream.get()));
    FP4MOE_CUDA_CHECK(cudaMemcpyAsync(live.router_logits.get(), logits.data(),
                                      logits.size() * sizeof(float), cudaMemcpyHostToDevice,
                                      stream.get()));
    output.fill_bytes(0xFF, stream.get());
    FP4MOE_CUDA_CHECK(cudaGraphLaunch(exec, stream.get()));
    const std::vector<uint16_t> replayed = output.download(stream.get());
    EXPECT_EQ(first_difference(replayed, eager[i]), -1)
        << "the replay differs from the eager forward";
  }
  EXPECT_EQ(layer.device_errors(workspace.get(), stream.get()), "");
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
}

// ------------------------------------------------------------- two threads

TEST(MoeLayerThreads, TwoThreadsTwoStreamsOneLayer) {
  FP4MOE_REQUIRE_GPU();
  const ModelShape& shape = shape_named("Qwen3_30B");
  ModelData& data = model_data(shape);
  const MoeLayer layer = MoeLayer::prepare(data.weights, layer_options(shape));

  // Thread 0 routes 1000 tokens on the device; thread 1 gives 64 tokens' routing.
  struct Job {
    const TokenBatch* batch;
    bool device_routing;
    std::unique_ptr<DeviceInputs> inputs;
    std::vector<uint16_t> eager;
    int num_mismatches = 0;
  };
  Job jobs[2] = {{&data.batch(kMaxTokens), true, nullptr, {}, 0},
                 {&data.batch(64), false, nullptr, {}, 0}};
  for (Job& job : jobs) {
    job.inputs = std::make_unique<DeviceInputs>(*job.batch, data.correction_bias);
    Stream stream;
    const DeviceBuffer<uint8_t> workspace = make_workspace(layer, job.batch->num_tokens);
    DeviceBuffer<uint16_t> output(static_cast<size_t>(job.batch->num_tokens * shape.hidden));
    const MoeForwardArgs args =
        job.device_routing ? job.inputs->device_routing() : job.inputs->caller_routing();
    job.eager = forward_bits(layer, args, output, workspace, stream.get());
    expect_matches_reference(job.eager, job.batch->reference, shape.hidden);
  }

  constexpr int kForwardsPerThread = 8;
  auto run = [&](Job& job) {
    Stream stream;
    const DeviceBuffer<uint8_t> workspace = make_workspace(layer, job.batch->num_tokens);
    DeviceBuffer<uint16_t> output(static_cast<size_t>(job.batch->num_tokens * shape.hidden));
    const MoeForwardArgs args =
        job.device_routing ? job.inputs->device_routing() : job.inputs->caller_routing();
    for (int i = 0; i < kForwardsPerThread; ++i)
      if (first_difference(forward_bits(layer, args, output, workspace, stream.get()), job.eager) !=
          -1)
        ++job.num_mismatches;
  };
  std::thread other(run, std::ref(jobs[1]));
  run(jobs[0]);
  other.join();
  EXPECT_EQ(jobs[0].num_mismatches, 0)
      << "thread 0 (T=1000, device routing) differs from its eager result";
  EXPECT_EQ(jobs[1].num_mismatches, 0)
      << "thread 1 (T=64, caller routing) differs from its eager result";
}

// ------------------------------------------------------------------ workspace

TEST(MoeLayerWorkspace, OneWorkspaceServesEveryTokenCountUpToItsMax) {
  FP4MOE_REQUIRE_GPU();
  const ModelShape& shape = shape_named("GLM45");
  ModelData& data = model_data(shape);
  const MoeLayer layer = MoeLayer::prepare(data.weights, layer_options(shape));
  EXPECT_LE(layer.workspace_bytes(1), layer.workspace_bytes(64));
  EXPECT_LE(layer.workspace_bytes(64), layer.workspace_bytes(kMaxTokens));
  Stream stream;
  const DeviceBuffer<uint8_t> workspace = make_workspace(layer, kMaxTokens);
  DeviceBuffer<uint16_t> output(static_cast<size_t>(kMaxTokens * shape.hidden));
  for (int64_t num_tokens : {kMaxTokens, int64_t{1}, int64_t{64}, int64_t{3}, kMaxTokens}) {
    SCOPED_TRACE("T=" + std::to_string(num_tokens) + " in a workspace for " +
                 std::to_string(kMaxTokens));
    const TokenBatch& batch = data.batch(num_tokens);
    const DeviceInputs inputs(batch, data.correction_bias);
    expect_matches_reference(
        forward_bits(layer, inputs.device_routing(), output, workspace, stream.get()),
        batch.reference, shape.hidden);
  }
}

// Refused before anything is launched (the poisoned output stays poisoned).
// For max_tokens = 1, workspace_bytes(1) is exactly what a 1-token forward
// needs, so one byte less must fail and the message must quote that number.
// For T = 1000 only sizes far below need are used: a forward of T tokens may
// need less than workspace_bytes(T), the maximum over all counts up to T.
TEST(MoeLayerWorkspace, TooSmallWorkspaceThrowsBeforeLaunch) {
  FP4MOE_REQUIRE_GPU();
  const ModelShape& shape = shape_named("GLM45");
  ModelData& data = model_data(shape);
  const MoeLayer layer = MoeLayer::prepare(data.weights, layer_options(shape));
  Stream stream;
  DeviceBuffer<uint16_t> output(static_cast<size_t>(kMaxTokens * shape.hidden));
  const size_t one_token_bytes = layer.workspace_bytes(1);

  struct Case {
    int64_t num_tokens;
    size_t given_bytes;
    bool quotes_need;  // the message must contain workspace_bytes(num_tokens)
  };
  const Case cases[] = {{1, 0, true},
                        {1, one_token_bytes / 2, true},
                        {1, one_token_bytes - 1, true},
                        {kMaxTokens, 0, false},
                        {kMaxTokens, one_token_bytes, false}};
  for (const Case& c : cases) {
    const size_t needed = layer.workspace_bytes(c.num_tokens);
    SCOPED_TRACE("T=" + std::to_string(c.num_tokens) + ": workspace of " +
                 std::to_string(c.given_bytes) +
                 " bytes, workspace_bytes(T) = " + std::to_string(needed));
    const TokenBatch& batch = data.batch(c.num_tokens);
    const DeviceInputs inputs(batch, data.correction_bias);
    const DeviceBuffer<uint8_t> workspace = make_workspace(layer, c.num_tokens);
    output.fill_bytes(0xFF, stream.get());
    try {
      layer.forward(inputs.device_routing(), output.get(), workspace.get(), c.given_bytes,
                    stream.get());
      ADD_FAILURE() << "forward accepted a workspace that is too small";
    } catch (const Error& e) {
      EXPECT_THAT(e.what(), HasSubstr("workspace"));
      if (c.quotes_need) EXPECT_THAT(e.what(), HasSubstr(std::to_string(needed)));
    }
    const std::vector<uint16_t> after = output.download(stream.get());
    EXPECT_EQ(std::count(after.begin(), after.end(), uint16_t{0xFFFF}),
              static_cast<std::ptrdiff_t>(after.size()))
        << "the output was written although forward threw";
    // The right size still works after the refusal.
    expect_matches_reference(
        forward_bits(layer, inputs.device_routing(), output, workspace, stream.get()),
        batch.reference, shape.hidden);
  }
}

// ------------------------------------------------------------- device errors

// Ids outside [0, num_experts) in caller routing: their slots contribute
// nothing, every other (token, slot) is computed; device_errors reports them,
// except -1 (an absent slot, served by another rank).
TEST(MoeLayerDeviceErrors, OutOfRangeIdsAreReportedAndSkipped) {
  FP4MOE_REQUIRE_GPU();
  const ModelShape& shape = shape_named("Mixtral");
  ModelData& data = model_data(shape);
  const MoeLayer layer = MoeLayer::prepare(data.weights, layer_options(shape));
  const int64_t num_tokens = 64;
  const int top_k = shape.routing.top_k;
  const TokenBatch& batch = data.batch(num_tokens);
  Stream stream;
  DeviceBuffer<uint16_t> output(static_cast<size_t>(num_tokens * shape.hidden));

  // Runs caller routing `given`, checks the output against the reference on
  // `expected` (the skipped slots as a valid id with weight 0) and returns
  // device_errors(), which must then be clear (reported once).
  const auto run = [&](const Routing& given, const Routing& expected) {
    const DeviceBuffer<uint8_t> workspace = make_workspace(layer, num_tokens);
    const DeviceInputs inputs(batch.hidden_states, {}, {}, given, num_tokens);
    const std::vector<uint16_t> out =
        forward_bits(layer, inputs.caller_routing(), output, workspace, stream.get());
    expect_matches_reference(
        out, reference_output(data.weights, batch.hidden_states, expected, shape.activation),
        shape.hidden);
    const std::string errors = layer.device_errors(workspace.get(), stream.get());
    EXPECT_EQ(layer.device_errors(workspace.get(), stream.get()), "") << "reported twice";
    return errors;
  };

  EXPECT_EQ(run(batch.routing, batch.routing), "") << "valid routing";
  {
    // Absent slots (-1: served by another rank) are skipped without an error.
    SCOPED_TRACE("absent slots");
    Routing given = batch.routing;
    Routing expected = batch.routing;
    for (int64_t token = 0; token < num_tokens; token += 3) {
      const size_t pair = static_cast<size_t>(token * top_k + token % top_k);
      given.topk_ids[pair] = -1;
      expected.topk_weights[pair] = 0.0f;  // the same expert, contributing nothing
    }
    EXPECT_EQ(run(given, expected), "");
  }

  // (token, slot, bad id); the reference gets a valid unused id with weight 0 there.
  const std::tuple<int64_t, int, int32_t> bad_slots[] = {
      {5, 1, static_cast<int32_t>(shape.num_experts)}, {17, 0, -2}, {63, top_k - 1, 1 << 20}};
  Routing given = batch.routing;
  Routing expected = batch.routing;
  for (const auto& [token, slot, bad_id] : bad_slots) {
    const size_t pair = static_cast<size_t>(token * top_k + slot);
    given.topk_ids[pair] = bad_id;
    int32_t unused = 0;
    while (std::find(expected.topk_ids.begin() + token * top_k,
                     expected.topk_ids.begin() + (token + 1) * top_k,
                     unused) != expected.topk_ids.begin() + (token + 1) * top_k)
      ++unused;
    expected.topk_ids[pair] = unused;
    expected.topk_weights[pair] = 0.0f;
  }
  const std::string errors = run(given, expected);
  std::printf("  device_errors: %s\n", errors.c_str());
  EXPECT_NE(errors, "");
  std::string lower = errors;
  std::transform(lower.begin(), lower.end(), lower.begin(),
                 [](unsigned char c) { return std::tolower(c); });
  EXPECT_THAT(lower, HasSubstr("expert"));
}

// --------------------------------------------------------- load from a file

TEST(MoeLayerLoad, CheckpointFileEqualsPrepareFromMemory) {
  FP4MOE_REQUIRE_GPU();
  const ModelShape& shape = shape_named("GptOss");  // with biases: they must round-trip too
  ModelData& data = model_data(shape);
  const std::string prefix = "model.layers.7.mlp.";
  const std::filesystem::path path =
      std::filesystem::temp_directory_path() /
      ("fp4moe_test_moe_layer_" + std::to_string(getpid()) + ".safetensors");
  SafetensorsWriter writer;
  add_moe_weights(writer, data.weights, prefix);
  writer.write(path.string());

  const MoeLayerOptions options = layer_options(shape);
  const MoeLayer from_memory = MoeLayer::prepare(data.weights, options);
  const MoeLayer from_file = MoeLayer::load(path.string(), prefix, options);
  std::filesystem::remove(path);
  EXPECT_EQ(from_file.num_experts(), from_memory.num_experts());
  EXPECT_EQ(from_file.hidden(), from_memory.hidden());
  EXPECT_EQ(from_file.inter(), from_memory.inter());
  EXPECT_EQ(from_file.top_k(), from_memory.top_k());
  EXPECT_EQ(from_file.device_weight_bytes(), from_memory.device_weight_bytes());

  Stream stream;
  const DeviceBuffer<uint8_t> workspace = make_workspace(from_memory, kMaxTokens);
  DeviceBuffer<uint16_t> output(static_cast<size_t>(kMaxTokens * shape.hidden));
  for (int64_t num_tokens : {int64_t{3}, kMaxTokens}) {
    SCOPED_TRACE("T=" + std::to_string(num_tokens));
    const TokenBatch& batch = data.batch(num_tokens);
    const DeviceInputs inputs(batch, data.correction_bias);
    const std::vector<uint16_t> memory_out =
        forward_bits(from_memory, inputs.device_routing(), output, workspace, stream.get());
    const std::vector<uint16_t> file_out =
        forward_bits(from_file, inputs.device_routing(), output, workspace, stream.get());
    EXPECT_EQ(first_difference(memory_out, file_out), -1)
        << "loaded layer differs from the prepared one";
    expect_matches_reference(file_out, batch.reference, shape.hidden);
  }
}

// ---------------------------------------------------------------- prepare_device

// A layer's weights as the stacked device tensors of MoeDeviceWeights.
struct StackedDeviceWeights {
  DeviceBuffer<uint8_t> w13, w13_scale, w2, w2_scale;
  DeviceBuffer<float> w13_scale_2, w2_scale_2, w13_bias, w2_bias;
  MoeDeviceWeights view;

  // per_half: w13_scale_2 as [E, 2] = {gate, up}, else [E] (gate's).
  StackedDeviceWeights(const MoeWeights& w, bool per_half) {
    std::vector<uint8_t> h13, h13s, h2, h2s;
    std::vector<float> s13, s2, b13, b2;
    for (const ExpertWeights& x : w.experts) {
      for (const Nvfp4Matrix* m : {&x.gate, &x.up}) {
        h13.insert(h13.end(), m->packed.begin(), m->packed.end());
        h13s.insert(h13s.end(), m->scales.begin(), m->scales.end());
      }
      h2.insert(h2.end(), x.down.packed.begin(), x.down.packed.end());
      h2s.insert(h2s.end(), x.down.scales.begin(), x.down.scales.end());
      s13.push_back(x.gate.global_scale);
      if (per_half) s13.push_back(x.up.global_scale);
      s2.push_back(x.down.global_scale);
      b13.insert(b13.end(), x.gate_bias.begin(), x.gate_bias.end());
      b13.insert(b13.end(), x.up_bias.begin(), x.up_bias.end());
      b2.insert(b2.end(), x.down_bias.begin(), x.down_bias.end());
    }
    w13 = DeviceBuffer<uint8_t>(h13);
    w13_scale = DeviceBuffer<uint8_t>(h13s);
    w2 = DeviceBuffer<uint8_t>(h2);
    w2_scale = DeviceBuffer<uint8_t>(h2s);
    w13_scale_2 = DeviceBuffer<float>(s13);
    w2_scale_2 = DeviceBuffer<float>(s2);
    view.num_experts = w.num_experts;
    view.hidden = w.hidden;
    view.inter = w.inter;
    view.w13 = w13.get();
    view.w13_scale = w13_scale.get();
    view.w13_scale_2 = w13_scale_2.get();
    view.w13_scale_2_per_half = per_half;
    view.w2 = w2.get();
    view.w2_scale = w2_scale.get();
    view.w2_scale_2 = w2_scale_2.get();
    if (w.has_bias()) {
      w13_bias = DeviceBuffer<float>(b13);
      w2_bias = DeviceBuffer<float>(b2);
      view.w13_bias = w13_bias.get();
      view.w2_bias = w2_bias.get();
    }
  }
};

// Device-prepared equals host-prepared, bit for bit, for every model shape
// (biases, gpt-oss activation and all routing modes included); the source
// tensors are left as they were.
TEST(MoeLayerPrepareDevice, EqualsPrepareOnTheHostBitForBit) {
  FP4MOE_REQUIRE_GPU();
  for (const ModelShape& shape : model_shapes()) {
    SCOPED_TRACE(shape.name);
    ModelData& data = model_data(shape);
    const MoeLayerOptions options = layer_options(shape);
    const StackedDeviceWeights stacked(data.weights, /*per_half=*/false);
    const std::vector<uint8_t> w13_before = stacked.w13.download();
    const MoeLayer from_host = MoeLayer::prepare(data.weights, options);
    const MoeLayer from_device = MoeLayer::prepare_device(stacked.view, options);
    EXPECT_EQ(stacked.w13.download(), w13_before) << "prepare_device changed its source";
    EXPECT_EQ(from_device.device_weight_bytes(), from_host.device_weight_bytes());

    Stream stream;
    const DeviceBuffer<uint8_t> workspace = make_workspace(from_host, kMaxTokens);
    DeviceBuffer<uint16_t> output(static_cast<size_t>(kMaxTokens * shape.hidden));
    const TokenBatch& batch = data.batch(kMaxTokens);
    const DeviceInputs inputs(batch, data.correction_bias);
    const std::vector<uint16_t> host_out =
        forward_bits(from_host, inputs.device_routing(), output, workspace, stream.get());
    const std::vector<uint16_t> device_out =
        forward_bits(from_device, inputs.device_routing(), output, workspace, stream.get());
    EXPECT_EQ(first_difference(host_out, device_out), -1);
  }
}

// Gate and up with different global scales ([E, 2]): each half is scaled by
// its own in the SwiGLU epilogue, matching the reference, which dequantises
// every matrix with its own scale; prepare() on the host gives the same bits.
TEST(MoeLayerPrepareDevice, GateAndUpWithDifferentGlobalScales) {
  FP4MOE_REQUIRE_GPU();
  const ModelShape& shape = shape_named("GptOss");
  MoeWeights weights = model_data(shape).weights;
  std::mt19937 rng(5);
  std::uniform_real_distribution<float> factor(0.25f, 4.0f);
  for (ExpertWeights& x : weights.experts) x.up.global_scale *= factor(rng);
  const StackedDeviceWeights stacked(weights, /*per_half=*/true);
  const MoeLayer layer = MoeLayer::prepare_device(stacked.view, layer_options(shape));
  const MoeLayer from_host = MoeLayer::prepare(weights, layer_options(shape));

  Stream stream;
  const DeviceBuffer<uint8_t> workspace = make_workspace(layer, kMaxTokens);
  DeviceBuffer<uint16_t> output(static_cast<size_t>(kMaxTokens * shape.hidden));
  for (int64_t num_tokens : {int64_t{1}, int64_t{7}, kMaxTokens}) {
    SCOPED_TRACE("T=" + std::to_string(num_tokens));
    const TokenBatch& batch = model_data(shape).batch(num_tokens);
    const std::vector<float> reference =
        reference_output(weights, batch.hidden_states, batch.routing, shape.activation);
    const DeviceInputs inputs(batch, model_data(shape).correction_bias);
    const std::vector<uint16_t> out = forward_bits(layer, inputs.caller_routing(), output, workspace, stream.get());
    expect_matches_reference(out, reference, shape.hidden);
    EXPECT_EQ(first_difference(out, forward_bits(from_host, inputs.caller_routing(), output, workspace,
                                                 stream.get())), -1)
        << "host and device preparation differ";
  }
}

TEST(MoeLayerPrepareDevice, RefusesBadScalesAndHostPointers) {
  FP4MOE_REQUIRE_GPU();
  const ModelShape& shape = shape_named("GptOss");
  const MoeLayerOptions options = layer_options(shape);
  {
    StackedDeviceWeights stacked(model_data(shape).weights, false);
    const uint8_t nan = 0x7F;
    const size_t at = static_cast<size_t>(shape.hidden * (shape.inter / 16) + 3);  // expert 1, row 0, block 3
    FP4MOE_CUDA_CHECK(cudaMemcpy(stacked.w2_scale.get() + at, &nan, 1, cudaMemcpyHostToDevice));
    try {
      (void)MoeLayer::prepare_device(stacked.view, options);
      ADD_FAILURE() << "a NaN block scale was accepted";
    } catch (const Error& e) {
      EXPECT_THAT(e.message(), HasSubstr("w2_scale[1, 0, 3]"));
    }
  }
  {
    StackedDeviceWeights stacked(model_data(shape).weights, false);
    const std::vector<float> host_scales(static_cast<size_t>(shape.num_experts), 1.0f);
    stacked.view.w2_scale_2 = host_scales.data();
    try {
      (void)MoeLayer::prepare_device(stacked.view, options);
      ADD_FAILURE() << "a host pointer was accepted";
    } catch (const Error& e) {
      EXPECT_THAT(e.message(), HasSubstr("w2_scale_2 is not GPU memory"));
    }
  }
}

// ------------------------------------------------------------------ W4A4

// A model's weights as an NVFP4 (W4A4) checkpoint holds them: every matrix
// with an input_scale, calibrated for GEMM1 inputs of amax 2.5 .. 4 (the
// hidden states are N(0, 1), so some blocks clamp at 448 and saturate) and
// for GEMM2 inputs (the SwiGLU output, up to ~100 with these weights) of amax
// 20 .. 60.
MoeWeights w4a4_weights(const MoeWeights& weights) {
  MoeWeights w = weights;
  w.checkpoint_format = "NVFP4";
  for (size_t e = 0; e < w.experts.size(); ++e) {
    ExpertWeights& x = w.experts[e];
    x.gate.input_scale = x.up.input_scale = (2.5f + 0.5f * static_cast<float>(e % 4)) / 2688.0f;
    x.down.input_scale = (20.0f + 10.0f * static_cast<float>(e % 5)) / 2688.0f;
    x.gate.has_input_scale = x.up.has_input_scale = x.down.has_input_scale = true;
  }
  return w;
}

// The W4A4 reference: GEMM1's input quantised with gate/up's input_scale,
// the intermediate rounded to bf16 (as the GPU stages it) then quantised
// with down's, all products exact in double.
std::vector<float> w4a4_reference(const MoeWeights& weights, const TokenBatch& batch, Activation activation) {
  const std::vector<float> x = bf16_to_floats(batch.hidden_states);
  std::vector<float> out(static_cast<size_t>(batch.num_tokens * weights.hidden));
  moe_reference(weights, x.data(), batch.routing, activation, out.data(), 0, Intermediate::kBf16,
                ActivationNumerics::kFp4);
  return out;
}

// A W4A4 layer output against the W4A4 reference and, to show that fp4
// numerics were applied at all, against the bf16 (W4A16) reference. The
// GPU's GEMM1 input is the reference's bit for bit (tests/kernels/
// test_moe_ops.cpp), but GEMM2's is quantised from the fp32 SwiGLU output
// rounded to bf16, the reference's from the double one: where those round to
// different bf16 values across an fp4 rounding boundary (rare), that element
// moves by a whole fp4 step and its token's output row by a few percent.
// Measured on an H100 over every case of this file (some 300 layers, T = 1
// to 1000, its fixed seeds): no such flip, no element outside compare()'s
// per-element tolerance, relative error 1.6-1.9e-3, no row worse than
// 2.4e-3. The limits are set there: the relative error as for bf16, every
// token's row within 5e-3 (twice the worst seen), and no element outside
// the per-element tolerance. Data that does hit a flip fails on that row and
// names it; a wrong scale, block or expert fails far more.
double expect_matches_w4a4_reference(const std::vector<uint16_t>& out, const std::vector<float>& w4a4_ref,
                                     const std::vector<float>& bf16_ref, int64_t hidden) {
  EXPECT_EQ(out.size(), w4a4_ref.size());
  if (out.size() != w4a4_ref.size()) return 1.0;
  const std::vector<float> got = bf16_to_floats(out);
  const testing::Comparison c =
      testing::compare(got, std::vector<double>(w4a4_ref.begin(), w4a4_ref.end()), hidden);
  EXPECT_LT(c.rel_err, 1e-2) << "relative error against the W4A4 reference\n" << c.first_bad;
  EXPECT_LT(c.worst_row_rel_err, 5e-3) << "a token's row against the W4A4 reference\n" << c.first_bad;
  EXPECT_EQ(c.num_bad, 0) << "elements outside the per-element tolerance of the W4A4 reference\n" << c.first_bad;
  EXPECT_EQ(c.num_unwritten, 0) << c.first_bad;
  const testing::Comparison vs_bf16 =
      testing::compare(got, std::vector<double>(bf16_ref.begin(), bf16_ref.end()), hidden);
  EXPECT_GT(vs_bf16.rel_err, 1.5e-2) << "the output is as close to the bf16 (W4A16) reference as to the W4A4 one: "
                                      "were fp4 activations applied?";
  return c.rel_err;
}

// Every compiled tile forced in GEMM1 (the quantising SwiGLU epilogue of
// both families) paired with the next in GEMM2, and the planner's own
// choice; both finalize modes; device routing at every token count and
// caller routing at 64 tokens. GLM45: inter 272 leaves a GEMM1 tile with
// one 16-feature block; GptOss: biases and the clamped activation.
TEST(MoeLayerW4a4, EveryCompiledConfigBothFinalizeModesMatchTheReference) {
  FP4MOE_REQUIRE_GPU();
  const std::vector<TileConfig> tiles = compiled_tiles();
  ASSERT_FALSE(tiles.empty());
  std::vector<std::optional<std::pair<TileConfig, TileConfig>>> plans = {std::nullopt};
  for (size_t i = 0; i < tiles.size(); ++i) plans.emplace_back(std::make_pair(tiles[i], tiles[(i + 1) % tiles.size()]));
  for (const std::string name : {"GLM45", "GptOss"}) {
    const ModelShape& shape = shape_named(name);
    ModelData& data = model_data(shape);
    const MoeWeights weights = w4a4_weights(data.weights);
    const int64_t token_counts[] = {1, 3, 64, kMaxTokens};
    std::vector<std::unique_ptr<DeviceInputs>> inputs;
    std::vector<std::vector<float>> references;
    for (int64_t t : token_counts) {
      inputs.push_back(std::make_unique<DeviceInputs>(data.batch(t), data.correction_bias));
      references.push_back(w4a4_reference(weights, data.batch(t), shape.activation));
    }
    Stream stream;
    DeviceBuffer<uint16_t> output(static_cast<size_t>(kMaxTokens * shape.hidden));
    for (FinalizeMode finalize : {FinalizeMode::kDeterministic, FinalizeMode::kAtomic})
      for (const auto& forced : plans) {
        MoeLayerOptions options = layer_options(shape, finalize);
        if (forced) {
          options.gemm1_config = forced->first;
          options.gemm2_config = forced->second;
        }
        const MoeLayer layer = MoeLayer::prepare(weights, options);
        ASSERT_EQ(layer.activation_numerics(), ActivationNumerics::kFp4)
            << "an NVFP4 checkpoint with input scales must run fp4 activations by default";
        const DeviceBuffer<uint8_t> workspace = make_workspace(layer, kMaxTokens);
        for (size_t i = 0; i < inputs.size(); ++i) {
          const int64_t num_tokens = token_counts[i];
          const std::string what = shape.name + " W4A4 " + to_string(finalize) + " " +
                                   (forced ? "gemm1 " + forced->first.to_string() + " gemm2 " + forced->second.to_string()
                                           : std::string("planner")) +
                                   " T=" + std::to_string(num_tokens);
          SCOPED_TRACE(what);
          if (forced) {
            const MoeLayerPlan plan = layer.plan(num_tokens);
            EXPECT_TRUE(same_tile(plan.gemm1.config, forced->first)) << "planned " << plan.gemm1.config.to_string();
            EXPECT_TRUE(same_tile(plan.gemm2.config, forced->second)) << "planned " << plan.gemm2.config.to_string();
          }
          EXPECT_TRUE(MoeLayerInternals::separate_gather(layer, num_tokens, workspace.bytes()))
              << "fp4 activations are quantised by the separate gather";
          const std::vector<uint16_t> out =
              forward_bits(layer, inputs[i]->device_routing(), output, workspace, stream.get());
          const double rel_err =
              expect_matches_w4a4_reference(out, references[i], data.batch(num_tokens).reference, shape.hidden);
          std::printf("  %-75s rel_err %.2e\n", what.c_str(), rel_err);
          if (num_tokens == 64) {
            const std::vector<uint16_t> caller =
                forward_bits(layer, inputs[i]->caller_routing(), output, workspace, stream.get());
            expect_matches_w4a4_reference(caller, references[i], data.batch(num_tokens).reference, shape.hidden);
          }
        }
        EXPECT_EQ(layer.device_errors(workspace.get(), stream.get()), "");
      }
  }
}

// A W4A4 forward captured once and replayed with new hidden states and new
// logits equals the eager forwards bit for bit (deterministic finalize).
TEST(MoeLayerW4a4, GraphReplaysEqualEagerForwards) {
  FP4MOE_REQUIRE_GPU();
  const ModelShape& shape = shape_named("DeepSeekV3");
  ModelData& data = model_data(shape);
  const MoeWeights weights = w4a4_weights(data.weights);
  const int64_t num_tokens = 64;
  const TokenBatch a = data.make_batch(num_tokens);
  const TokenBatch b = data.make_batch(num_tokens);
  const MoeLayer layer = MoeLayer::prepare(weights, layer_options(shape));
  ASSERT_EQ(layer.activation_numerics(), ActivationNumerics::kFp4);
  Stream stream;
  const DeviceBuffer<uint8_t> workspace = make_workspace(layer, num_tokens);
  DeviceBuffer<uint16_t> output(static_cast<size_t>(num_tokens * shape.hidden));
  const TokenBatch* batches[] = {&a, &b};
  std::vector<std::vector<uint16_t>> eager;
  for (const TokenBatch* t : batches) {
    const DeviceInputs inputs(*t, data.correction_bias);
    eager.push_back(forward_bits(layer, inputs.device_routing(), output, workspace, stream.get()));
    expect_matches_w4a4_reference(eager.back(), w4a4_reference(weights, *t, shape.activation), t->reference,
                                  shape.hidden);
  }

  const DeviceInputs live(a, data.correction_bias);
  cudaGraph_t graph = nullptr;
  FP4MOE_CUDA_CHECK(cudaStreamBeginCapture(stream.get(), cudaStreamCaptureModeGlobal));
  try {
    layer.forward(live.device_routing(), output.get(), workspace.get(), workspace.bytes(), stream.get());
  } catch (...) {
    cudaStreamEndCapture(stream.get(), &graph);
    if (graph) cudaGraphDestroy(graph);
    throw;
  }
  FP4MOE_CUDA_CHECK(cudaStreamEndCapture(stream.get(), &graph));
  cudaGraphExec_t exec = nullptr;
  FP4MOE_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  for (size_t i = 0; i < std::size(batches); ++i) {
    SCOPED_TRACE(i == 0 ? "replay with inputs A" : "replay with inputs B");
    FP4MOE_CUDA_CHECK(cudaMemcpyAsync(live.hidden_states.get(), batches[i]->hidden_states.data(),
                                      batches[i]->hidden_states.size() * sizeof(uint16_t), cudaMemcpyHostToDevice,
                                      stream.get()));
    FP4MOE_CUDA_CHECK(cudaMemcpyAsync(live.router_logits.get(), batches[i]->router_logits.data(),
                                      batches[i]->router_logits.size() * sizeof(float), cudaMemcpyHostToDevice,
                                      stream.get()));
    output.fill_bytes(0xFF, stream.get());
    FP4MOE_CUDA_CHECK(cudaGraphLaunch(exec, stream.get()));
    EXPECT_EQ(first_difference(output.download(stream.get()), eager[i]), -1)
        << "the W4A4 replay differs from the eager forward";
  }
  EXPECT_EQ(layer.device_errors(workspace.get(), stream.get()), "");
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
}

// kCheckpoint follows the format and the scales; kBf16 on a W4A4 checkpoint
// is the bf16 layer bit for bit; kFp4 without input scales is refused.
// A shared expert under W4A4: its chunks run as extra experts, their inputs
// quantised with the shared expert's own input scales (gate/up's for the
// hidden states, down's for the SwiGLU output), against the CPU reference,
// which runs the shared expert whole; ungated (DeepSeek) and gated (Qwen2-MoE).
TEST(MoeLayerW4a4, SharedExpertQuantisesItsInputsAsRoutedExpertsDo) {
  FP4MOE_REQUIRE_GPU();
  struct Case {
    ModelShape shape;
    int chunks;
    bool gated;
  };
  const Case cases[] = {
      {{"DeepSeekV3SharedW4a4", 64, 256, 128, noaux_routing(8, 8, 4, 2.5f)}, 2, false},
      {{"Qwen2MoeSharedW4a4", 60, 256, 144, softmax_routing(4, false)}, 4, true},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.shape.name);
    std::mt19937 rng(static_cast<uint32_t>(std::hash<std::string>{}(c.shape.name)));
    MoeWeights weights = w4a4_weights(random_weights(c.shape, rng));
    SharedExpertWeights shared;
    shared.inter = c.chunks * c.shape.inter;
    const float gate_up_scale = 0.1f / std::sqrt(static_cast<float>(c.shape.hidden));
    shared.mlp.gate = testing::random_nvfp4(shared.inter, c.shape.hidden, gate_up_scale, rng);
    shared.mlp.up = testing::random_nvfp4(shared.inter, c.shape.hidden, gate_up_scale, rng);
    shared.mlp.down = testing::random_nvfp4(c.shape.hidden, shared.inter,
                                            0.1f / std::sqrt(static_cast<float>(shared.inter)), rng);
    shared.mlp.gate.input_scale = shared.mlp.up.input_scale = 3.0f / 2688.0f;
    shared.mlp.down.input_scale = 30.0f / 2688.0f;
    shared.mlp.gate.has_input_scale = shared.mlp.up.has_input_scale = shared.mlp.down.has_input_scale = true;
    if (c.gated) shared.gate = normal_floats(static_cast<size_t>(c.shape.hidden), 0.05f, rng);
    weights.shared_expert = shared;
    std::vector<float> correction_bias;
    if (c.shape.routing.mode == RoutingMode::kNoauxTc)
      correction_bias = normal_floats(static_cast<size_t>(c.shape.num_experts), 0.1f, rng);

    const MoeLayer layer = MoeLayer::prepare(weights, layer_options(c.shape));
    ASSERT_EQ(layer.activation_numerics(), ActivationNumerics::kFp4);
    Stream stream;
    constexpr int64_t kTokens = 64;
    const DeviceBuffer<uint8_t> workspace = make_workspace(layer, kTokens);
    DeviceBuffer<uint16_t> output(static_cast<size_t>(kTokens * c.shape.hidden));
    TokenBatch batch;
    batch.num_tokens = kTokens;
    batch.hidden_states = testing::random_bf16(static_cast<size_t>(kTokens * c.shape.hidden), rng);
    batch.router_logits = draw_router_logits(kTokens, c.shape.num_experts, correction_bias, c.shape.routing, rng);
    batch.routing = route(batch.router_logits.data(), kTokens, c.shape.num_experts,
                          correction_bias.empty() ? nullptr : correction_bias.data(), c.shape.routing);
    // The W4A16 reference of the same weights (bf16 activations), which the
    // output must not match: shows that fp4 numerics were applied.
    std::vector<float> bf16_ref(static_cast<size_t>(kTokens * c.shape.hidden));
    const std::vector<float> x = bf16_to_floats(batch.hidden_states);
    moe_reference(weights, x.data(), batch.routing, c.shape.activation, bf16_ref.data(), 0, Intermediate::kBf16,
                  ActivationNumerics::kBf16);
    const std::vector<float> w4a4_ref = w4a4_reference(weights, batch, c.shape.activation);
    const DeviceInputs inputs(batch.hidden_states, batch.router_logits, correction_bias, batch.routing, kTokens);
    const std::vector<uint16_t> out =
        forward_bits(layer, inputs.device_routing(), output, workspace, stream.get());
    const double rel_err = expect_matches_w4a4_reference(out, w4a4_ref, bf16_ref, c.shape.hidden);
    std::printf("  %-30s T=%lld rel_err %.2e\n", c.shape.name.c_str(), static_cast<long long>(kTokens), rel_err);
  }
}

TEST(MoeLayerW4a4, CheckpointRuleAndRefusals) {
  FP4MOE_REQUIRE_GPU();
  const ModelShape& shape = shape_named("Mixtral");
  ModelData& data = model_data(shape);
  MoeWeights weights = w4a4_weights(data.weights);
  EXPECT_EQ(MoeLayer::prepare(data.weights, layer_options(shape)).activation_numerics(), ActivationNumerics::kBf16)
      << "weights of no declared format run bf16 activations";
  EXPECT_EQ(MoeLayer::prepare(weights, layer_options(shape)).activation_numerics(), ActivationNumerics::kFp4);

  MoeLayerOptions bf16_options = layer_options(shape);
  bf16_options.activations = ActivationNumerics::kBf16;
  const MoeLayer forced_bf16 = MoeLayer::prepare(weights, bf16_options);
  const MoeLayer plain = MoeLayer::prepare(data.weights, layer_options(shape));
  EXPECT_EQ(forced_bf16.activation_numerics(), ActivationNumerics::kBf16);
  Stream stream;
  const DeviceBuffer<uint8_t> workspace = make_workspace(plain, 64);
  DeviceBuffer<uint16_t> output(static_cast<size_t>(64 * shape.hidden));
  const DeviceInputs inputs(data.batch(64), data.correction_bias);
  EXPECT_EQ(first_difference(forward_bits(forced_bf16, inputs.device_routing(), output, workspace, stream.get()),
                             forward_bits(plain, inputs.device_routing(), output, workspace, stream.get())),
            -1)
      << "--activations bf16 on a W4A4 checkpoint must be the W4A16 layer";

  weights.checkpoint_format = "W4A16_NVFP4";
  EXPECT_EQ(MoeLayer::prepare(weights, layer_options(shape)).activation_numerics(), ActivationNumerics::kBf16);

  MoeLayerOptions fp4_options = layer_options(shape);
  fp4_options.activations = ActivationNumerics::kFp4;
  try {
    (void)MoeLayer::prepare(data.weights, fp4_options);
    ADD_FAILURE() << "fp4 activations were accepted for weights without input_scale";
  } catch (const Error& e) {
    EXPECT_THAT(e.message(), HasSubstr("need an input_scale for every expert matrix"));
  }
}

// prepare_device with w13/w2 input scales equals prepare() of the W4A4
// checkpoint, bit for bit; fp4 without them is refused.
TEST(MoeLayerW4a4, PrepareDeviceWithInputScalesEqualsPrepare) {
  FP4MOE_REQUIRE_GPU();
  const ModelShape& shape = shape_named("GptOss");
  ModelData& data = model_data(shape);
  const MoeWeights weights = w4a4_weights(data.weights);
  StackedDeviceWeights stacked(weights, /*per_half=*/false);
  std::vector<float> in13, in2;
  for (const ExpertWeights& x : weights.experts) {
    in13.push_back(x.gate.input_scale);
    in2.push_back(x.down.input_scale);
  }
  const DeviceBuffer<float> d_in13(in13), d_in2(in2);
  MoeLayerOptions fp4_options = layer_options(shape);
  fp4_options.activations = ActivationNumerics::kFp4;
  try {
    (void)MoeLayer::prepare_device(stacked.view, fp4_options);
    ADD_FAILURE() << "fp4 activations were accepted without input scales";
  } catch (const Error& e) {
    EXPECT_THAT(e.message(), HasSubstr("w13_input_scale and w2_input_scale"));
  }
  stacked.view.w13_input_scale = d_in13.get();
  stacked.view.w2_input_scale = d_in2.get();
  const MoeLayer from_device = MoeLayer::prepare_device(stacked.view, layer_options(shape));
  const MoeLayer from_host = MoeLayer::prepare(weights, layer_options(shape));
  EXPECT_EQ(from_device.activation_numerics(), ActivationNumerics::kFp4);
  EXPECT_EQ(from_device.device_weight_bytes(), from_host.device_weight_bytes());

  Stream stream;
  const DeviceBuffer<uint8_t> workspace = make_workspace(from_host, kMaxTokens);
  DeviceBuffer<uint16_t> output(static_cast<size_t>(kMaxTokens * shape.hidden));
  for (int64_t num_tokens : {int64_t{1}, int64_t{7}, kMaxTokens}) {
    SCOPED_TRACE("T=" + std::to_string(num_tokens));
    const TokenBatch& batch = data.batch(num_tokens);
    const DeviceInputs inputs(batch, data.correction_bias);
    const std::vector<uint16_t> out = forward_bits(from_device, inputs.caller_routing(), output, workspace, stream.get());
    expect_matches_w4a4_reference(out, w4a4_reference(weights, batch, shape.activation), batch.reference, shape.hidden);
    EXPECT_EQ(first_difference(out, forward_bits(from_host, inputs.caller_routing(), output, workspace, stream.get())),
              -1)
        << "host and device preparation of a W4A4 layer differ";
  }
}

}  // namespace
}  // namespace fp4moe
