// GPU tests of the MoE layer with fp4 activations (W4A4, MoeLayerW4a4;
// include/fp4moe/moe_layer.hpp, docs/design.md §3): every compiled tile in
// both GEMMs, both finalize modes, against the W4A4 reference; graph
// replay; a shared expert's inputs quantised as the routed experts' are; the
// checkpoint rule and refusals; prepare_device with input scales. The
// shapes, data and helpers: tests/layer/moe_layer_test_support.hpp.
// Skipped, visibly, where no GPU exists.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <functional>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "fp4moe/error.hpp"
#include "fp4moe/moe_layer.hpp"
#include "moe_layer_test_support.hpp"

namespace fp4moe {
namespace {

using ::testing::HasSubstr;

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
std::vector<float> w4a4_reference(const MoeWeights& weights, const TokenBatch& batch, Activation activation,
                                  Combine combine = Combine::kBf16Rows) {
  const std::vector<float> x = bf16_to_floats(batch.hidden_states);
  std::vector<float> out(static_cast<size_t>(batch.num_tokens * weights.hidden));
  moe_reference(weights, x.data(), batch.routing, activation, out.data(), 0, Intermediate::kBf16,
                ActivationNumerics::kFp4, combine);
  return out;
}

// A W4A4 layer output against the W4A4 reference and, to show that fp4
// numerics were applied at all, against the bf16 (W4A16) reference. The
// GPU's GEMM1 input is the reference's bit for bit (tests/kernels/ops/
// test_gather.cpp), but GEMM2's is quantised from the fp32 SwiGLU output
// rounded to bf16, the reference's from the double one: where those round to
// different bf16 values across an fp4 rounding boundary (rare), that element
// moves by a whole fp4 step and its token's output row by a few percent.
// Measured on an H100 over every case of the test_moe_layer binary (some
// 300 layers, T = 1 to 1000, its fixed seeds): no such flip, no element
// outside compare()'s per-element tolerance, relative error 1.6-1.9e-3, no
// row worse than 2.4e-3. The limits are set there: the relative error as
// for bf16, every token's row within 5e-3 (twice the worst seen), and no
// element outside the per-element tolerance. Data that does hit a flip
// fails on that row and names it; a wrong scale, block or expert fails far
// more.
double expect_matches_w4a4_reference(const std::vector<uint16_t>& out, const std::vector<float>& w4a4_ref,
                                     const std::vector<float>& bf16_ref, int64_t hidden) {
  EXPECT_EQ(out.size(), w4a4_ref.size());
  if (out.size() != w4a4_ref.size()) return 1.0;
  const std::vector<float> got = bf16_to_floats(out);
  const testing::Comparison c = testing::compare(got, std::vector<double>(w4a4_ref.begin(), w4a4_ref.end()), hidden);
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
    std::vector<std::vector<float>> references, references_atomic;
    for (int64_t t : token_counts) {
      inputs.push_back(std::make_unique<DeviceInputs>(data.batch(t), data.correction_bias));
      references.push_back(w4a4_reference(weights, data.batch(t), shape.activation));
      references_atomic.push_back(w4a4_reference(weights, data.batch(t), shape.activation, Combine::kExact));
    }
    Stream stream;
    DeviceBuffer<uint16_t> output(static_cast<size_t>(kMaxTokens * shape.hidden));
    for (FinalizeMode finalize : {FinalizeMode::kDeterministic, FinalizeMode::kAtomic})
      for (const auto& forced : plans) {
        const std::vector<std::vector<float>>& reference =
            finalize == FinalizeMode::kAtomic ? references_atomic : references;
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
          const std::string what =
              shape.name + " W4A4 " + to_string(finalize) + " " +
              (forced ? "gemm1 " + forced->first.to_string() + " gemm2 " + forced->second.to_string()
                      : std::string("planner")) +
              " T=" + std::to_string(num_tokens);
          SCOPED_TRACE(what);
          if (!forced && num_tokens == 3)  // the quantising gather, then the fused decode kernel (docs/design.md §4.8)
            EXPECT_EQ(layer.plan(num_tokens).fused_decode, finalize == FinalizeMode::kDeterministic);
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
              expect_matches_w4a4_reference(out, reference[i], data.batch(num_tokens).reference, shape.hidden);
          std::printf("  %-75s rel_err %.2e\n", what.c_str(), rel_err);
          if (num_tokens == 64) {
            const std::vector<uint16_t> caller =
                forward_bits(layer, inputs[i]->caller_routing(), output, workspace, stream.get());
            expect_matches_w4a4_reference(caller, reference[i], data.batch(num_tokens).reference, shape.hidden);
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
  const ForwardGraph graph(layer, live.device_routing(), output.get(), workspace, stream.get());
  for (size_t i = 0; i < std::size(batches); ++i) {
    SCOPED_TRACE(i == 0 ? "replay with inputs A" : "replay with inputs B");
    FP4MOE_CUDA_CHECK(cudaMemcpyAsync(live.hidden_states.get(), batches[i]->hidden_states.data(),
                                      batches[i]->hidden_states.size() * sizeof(uint16_t), cudaMemcpyHostToDevice,
                                      stream.get()));
    FP4MOE_CUDA_CHECK(cudaMemcpyAsync(live.router_logits.get(), batches[i]->router_logits.data(),
                                      batches[i]->router_logits.size() * sizeof(float), cudaMemcpyHostToDevice,
                                      stream.get()));
    output.fill_bytes(0xFF, stream.get());
    graph.launch(stream.get());
    EXPECT_EQ(first_difference(output.download(stream.get()), eager[i]), -1)
        << "the W4A4 replay differs from the eager forward";
  }
  EXPECT_EQ(layer.device_errors(workspace.get(), stream.get()), "");
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
    shared.mlp.down =
        testing::random_nvfp4(c.shape.hidden, shared.inter, 0.1f / std::sqrt(static_cast<float>(shared.inter)), rng);
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
    const std::vector<uint16_t> out = forward_bits(layer, inputs.device_routing(), output, workspace, stream.get());
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
    const std::vector<uint16_t> out =
        forward_bits(from_device, inputs.caller_routing(), output, workspace, stream.get());
    expect_matches_w4a4_reference(out, w4a4_reference(weights, batch, shape.activation), batch.reference, shape.hidden);
    EXPECT_EQ(first_difference(out, forward_bits(from_host, inputs.caller_routing(), output, workspace, stream.get())),
              -1)
        << "host and device preparation of a W4A4 layer differ";
  }
}

}  // namespace
}  // namespace fp4moe
