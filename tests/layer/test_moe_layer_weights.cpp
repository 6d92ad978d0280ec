// GPU tests of the MoE layer's weights (include/fp4moe/moe_layer.hpp;
// src/layer/weights.cpp, upload.cpp) against the CPU reference: a shared
// expert run as chunks of the routed experts' width, MoeLayer::load from a
// checkpoint file, and prepare_device() from stacked device tensors equal to
// prepare() bit for bit (and its refusals). The shapes, data and helpers:
// tests/layer/moe_layer_test_support.hpp. Skipped, visibly, where no GPU
// exists.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "fp4moe/error.hpp"
#include "fp4moe/modelopt.hpp"
#include "fp4moe/moe_layer.hpp"
#include "fp4moe/safetensors.hpp"
#include "moe_layer_test_support.hpp"

namespace fp4moe {
namespace {

using ::testing::HasSubstr;

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
    shared.mlp.down =
        testing::random_nvfp4(c.shape.hidden, shared.inter, 0.1f / std::sqrt(static_cast<float>(shared.inter)), rng);
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
        if (T == 3)  // the shared expert's chunks through the fused decode kernel too (docs/design.md §4.8)
          EXPECT_EQ(layer.plan(T).fused_decode, finalize == FinalizeMode::kDeterministic);
        const std::vector<uint16_t> hidden = testing::random_bf16(static_cast<size_t>(T * c.shape.hidden), rng);
        const std::vector<float> logits =
            draw_router_logits(T, c.shape.num_experts, correction_bias, c.shape.routing, rng);
        const Routing routing = route(logits.data(), T, c.shape.num_experts,
                                      correction_bias.empty() ? nullptr : correction_bias.data(), c.shape.routing);
        const std::vector<float> reference = reference_output(weights, hidden, routing, c.shape.activation,
                                                              Intermediate::kBf16, reference_combine(finalize));
        const DeviceInputs inputs(hidden, logits, correction_bias, routing, T);
        for (const bool device_routing : {true, false}) {
          const std::string what = c.shape.name + " T=" + std::to_string(T) + " " + to_string(finalize) + " " +
                                   (device_routing ? "device routing" : "caller routing");
          SCOPED_TRACE(what);
          const std::vector<uint16_t> out =
              forward_bits(layer, device_routing ? inputs.device_routing() : inputs.caller_routing(), output, workspace,
                           stream.get());
          const double rel_err = expect_matches_reference(out, reference, c.shape.hidden);
          std::printf("  %-60s rel_err %.2e\n", what.c_str(), rel_err);
        }
        if (finalize == FinalizeMode::kDeterministic && T == 3) {
          DeviceBuffer<uint16_t> pair_rows(static_cast<size_t>(T * layer.top_k() * c.shape.hidden));  // bf16
          EXPECT_THAT(
              [&] {
                try {
                  layer.forward_pair_rows(inputs.caller_routing(), pair_rows.get(), workspace.get(), workspace.bytes(),
                                          stream.get());
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

// --------------------------------------------------------- load from a file

TEST(MoeLayerLoad, CheckpointFileEqualsPrepareFromMemory) {
  FP4MOE_REQUIRE_GPU();
  const ModelShape& shape = shape_named("GptOss");  // with biases: they must round-trip too
  ModelData& data = model_data(shape);
  const std::string prefix = "model.layers.7.mlp.";
  const std::filesystem::path path =
      std::filesystem::temp_directory_path() / ("fp4moe_test_moe_layer_" + std::to_string(getpid()) + ".safetensors");
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
    EXPECT_EQ(first_difference(memory_out, file_out), -1) << "loaded layer differs from the prepared one";
    expect_matches_reference(file_out, batch.reference, shape.hidden);
  }
}

// ---------------------------------------------------------------- prepare_device

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
    EXPECT_EQ(first_difference(out, forward_bits(from_host, inputs.caller_routing(), output, workspace, stream.get())),
              -1)
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

}  // namespace
}  // namespace fp4moe
