// The helpers of tests/layer/moe_layer_test_support.hpp.
#include "moe_layer_test_support.hpp"

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <memory>

namespace fp4moe {

namespace {

// For one token: the smallest gap between a score that decides its routing
// and the next one down (the k-th chosen vs the best unchosen expert; for
// grouped noaux_tc also the last kept vs the best dropped group). Scores are
// the logits (softmax and gpt-oss rank by them) or sigmoid + correction bias.
double routing_margin(const float* logits, int64_t num_experts, const float* correction_bias, const RoutingParams& p) {
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
      std::vector<double> members(score.begin() + g * group_size, score.begin() + (g + 1) * group_size);
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
        candidates.insert(candidates.end(), score.begin() + g * group_size, score.begin() + (g + 1) * group_size);
  }
  std::sort(candidates.begin(), candidates.end(), std::greater<>());
  if (candidates.size() > static_cast<size_t>(p.top_k))
    margin = std::min(margin, candidates[p.top_k - 1] - candidates[p.top_k]);
  return margin;
}

}  // namespace

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

MoeLayerOptions layer_options(const ModelShape& shape, FinalizeMode finalize) {
  MoeLayerOptions o;
  o.activation = shape.activation;
  o.routing = shape.routing;
  o.finalize = finalize;
  return o;
}

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

std::vector<float> draw_router_logits(int64_t num_tokens, int64_t num_experts,
                                      const std::vector<float>& correction_bias, const RoutingParams& params,
                                      std::mt19937& rng) {
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

std::vector<float> reference_output(const MoeWeights& weights, const std::vector<uint16_t>& hidden_states,
                                    const Routing& routing, Activation activation, Intermediate intermediate,
                                    Combine combine) {
  const std::vector<float> x = bf16_to_floats(hidden_states);  // exact
  std::vector<float> out(static_cast<size_t>(routing.num_tokens * weights.hidden));
  moe_reference(weights, x.data(), routing, activation, out.data(), 0, intermediate, ActivationNumerics::kCheckpoint,
                combine);
  return out;
}

ModelData& model_data(const ModelShape& shape) {
  static std::map<std::string, std::unique_ptr<ModelData>> cache;
  std::unique_ptr<ModelData>& slot = cache[shape.name];
  if (!slot) {
    slot = std::make_unique<ModelData>();
    slot->shape = shape;
    slot->rng.seed(static_cast<uint32_t>(std::hash<std::string>{}(shape.name)));
    slot->weights = random_weights(shape, slot->rng);
    if (shape.routing.mode == RoutingMode::kNoauxTc)
      slot->correction_bias = normal_floats(static_cast<size_t>(shape.num_experts), 0.1f, slot->rng);
  }
  return *slot;
}

ForwardGraph::ForwardGraph(const MoeLayer& layer, const MoeForwardArgs& args, void* output,
                           const DeviceBuffer<uint8_t>& workspace, cudaStream_t stream) {
  FP4MOE_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  try {
    layer.forward(args, output, workspace.get(), workspace.bytes(), stream);
  } catch (...) {
    cudaStreamEndCapture(stream, &graph_);
    if (graph_) cudaGraphDestroy(graph_);
    throw;
  }
  FP4MOE_CUDA_CHECK(cudaStreamEndCapture(stream, &graph_));
  FP4MOE_CUDA_CHECK(cudaGraphInstantiate(&exec_, graph_, 0));
}

ForwardGraph::~ForwardGraph() {
  if (exec_) cudaGraphExecDestroy(exec_);
  if (graph_) cudaGraphDestroy(graph_);
}

DeviceBuffer<uint8_t> make_workspace(const MoeLayer& layer, int64_t max_tokens) {
  DeviceBuffer<uint8_t> ws(layer.workspace_bytes(max_tokens));
  ws.fill_bytes(0);
  FP4MOE_CUDA_CHECK(cudaDeviceSynchronize());
  return ws;
}

std::vector<uint16_t> output_rows(std::vector<uint16_t> all, size_t count) {
  const auto beyond = std::count_if(all.begin() + static_cast<std::ptrdiff_t>(count), all.end(),
                                    [](uint16_t v) { return v != 0xFFFF; });
  EXPECT_EQ(beyond, 0) << "the forward wrote past its output rows";
  all.resize(count);
  return all;
}

std::vector<uint16_t> forward_bits(const MoeLayer& layer, const MoeForwardArgs& args, DeviceBuffer<uint16_t>& output,
                                   const DeviceBuffer<uint8_t>& workspace, cudaStream_t stream) {
  output.fill_bytes(0xFF, stream);
  layer.forward(args, output.get(), workspace.get(), workspace.bytes(), stream);
  return output_rows(output.download(stream), static_cast<size_t>(args.num_tokens * layer.hidden()));
}

double expect_matches_reference(const std::vector<uint16_t>& out, const std::vector<float>& ref, int64_t hidden) {
  EXPECT_EQ(out.size(), ref.size());
  if (out.size() != ref.size()) return 1.0;
  const testing::Comparison c =
      testing::compare(bf16_to_floats(out), std::vector<double>(ref.begin(), ref.end()), hidden);
  EXPECT_LT(c.rel_err, 1e-2) << c.first_bad;
  EXPECT_EQ(c.num_bad, 0) << c.first_bad;
  EXPECT_EQ(c.num_unwritten, 0) << c.first_bad;
  return c.rel_err;
}

int64_t first_difference(const std::vector<uint16_t>& a, const std::vector<uint16_t>& b) {
  if (a.size() != b.size()) return 0;
  const auto it = std::mismatch(a.begin(), a.end(), b.begin());
  return it.first == a.end() ? -1 : static_cast<int64_t>(it.first - a.begin());
}

bool same_tile(const TileConfig& a, const TileConfig& b) {
  return a.family == b.family && a.block_n == b.block_n && a.block_m == b.block_m && a.block_k == b.block_k &&
         a.stages == b.stages && a.warps == b.warps;
}

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

StackedDeviceWeights::StackedDeviceWeights(const MoeWeights& w, bool per_half) {
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

}  // namespace fp4moe
