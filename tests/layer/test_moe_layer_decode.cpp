// GPU tests of the fused decode kernel (MoeLayerOptions::fused_decode,
// src/kernels/fused_decode.cuh): on every decode size of the README it runs
// (T = 2, 4, 8, 16; T = 1 keeps the separate launches) and every test model
// (gpt-oss's activation and biases included), with device routing and with
// caller routings that load one set of experts with every token, skip
// slots, or leave a token without any slot, the fused forward gives the bits
// of the separate launches and matches the CPU reference; graph replays
// equal eager forwards; and the planner's choice. With a shared expert and
// with fp4 activations it runs at T = 3 in test_moe_layer_weights.cpp and
// test_moe_layer_w4a4.cpp. The shapes, data and helpers:
// tests/layer/moe_layer_test_support.hpp. Skipped, visibly, where no GPU
// exists.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "fp4moe/moe_layer.hpp"
#include "moe_layer_test_support.hpp"

namespace fp4moe {
namespace {

// The README's decode sizes where the planner fuses (kFusedDecodeMinTokens ..).
constexpr int64_t kDecodeTokens[] = {2, 4, 8, 16};
static_assert(kDecodeTokens[0] == kFusedDecodeMinTokens && kDecodeTokens[3] == kFusedDecodeMaxTokens);

// The planner's decode tile in both GEMMs, fused or not.
MoeLayerOptions decode_options(const ModelShape& shape, bool fused) {
  MoeLayerOptions o = layer_options(shape);
  o.gemm1_config = TileConfig::parse("n128m8k256s4w4");
  o.gemm2_config = o.gemm1_config;
  o.fused_decode = fused;
  return o;
}

enum class DecodeRouting { kRouter, kHotExperts, kSkippedSlots };
const char* to_string(DecodeRouting r) {
  return r == DecodeRouting::kRouter ? "router" : r == DecodeRouting::kHotExperts ? "hot experts" : "skipped slots";
}

// kHotExperts: every token on experts 0 .. top_k-1 (a GEMM2 unit then holds
// up to 8 tokens' rows and T = 16 needs two m-tiles per expert);
// kSkippedSlots: the router's choice with slot t % top_k of every token set
// to -1 (absent), and token 1 without any slot (its output is zeros).
// `expected` is what the reference runs: a skipped slot as an unused expert
// with weight 0.
void caller_routing(DecodeRouting kind, const Routing& router, int64_t num_experts, Routing* given, Routing* expected) {
  *given = router;
  const int top_k = router.top_k;
  for (int64_t t = 0; t < router.num_tokens; ++t) {
    for (int s = 0; s < top_k; ++s) {
      const size_t pair = static_cast<size_t>(t * top_k + s);
      if (kind == DecodeRouting::kHotExperts) given->topk_ids[pair] = s;
      if (kind == DecodeRouting::kSkippedSlots && (s == t % top_k || t == 1)) given->topk_ids[pair] = -1;
    }
  }
  *expected = *given;
  for (int64_t t = 0; t < router.num_tokens; ++t) {
    // The token's experts as the reference will see them, kept distinct.
    const auto begin = expected->topk_ids.begin() + t * top_k;
    for (int s = 0; s < top_k; ++s) {
      const size_t pair = static_cast<size_t>(t * top_k + s);
      if (given->topk_ids[pair] >= 0) continue;
      int32_t unused = 0;
      while (std::find(begin, begin + top_k, unused) != begin + top_k) ++unused;
      ASSERT_LT(unused, num_experts);
      expected->topk_ids[pair] = unused;
      expected->topk_weights[pair] = 0.0f;
    }
  }
}

class FusedDecode : public ::testing::TestWithParam<std::string> {};

TEST_P(FusedDecode, EqualsSeparateLaunchesAndTheReference) {
  FP4MOE_REQUIRE_GPU();
  const ModelShape& shape = shape_named(GetParam());
  ModelData& data = model_data(shape);
  const MoeLayer fused = MoeLayer::prepare(data.weights, decode_options(shape, true));
  const MoeLayer separate = MoeLayer::prepare(data.weights, decode_options(shape, false));
  Stream stream;
  constexpr int64_t kMax = 16;
  const DeviceBuffer<uint8_t> workspace = make_workspace(fused, kMax);
  DeviceBuffer<uint16_t> output(static_cast<size_t>(kMax * shape.hidden));
  for (const int64_t T : kDecodeTokens) {
    ASSERT_TRUE(fused.plan(T).fused_decode) << "T=" << T << ": " << fused.plan(T).describe();
    ASSERT_FALSE(separate.plan(T).fused_decode);
    const TokenBatch& batch = data.batch(T);
    for (const DecodeRouting kind :
         {DecodeRouting::kRouter, DecodeRouting::kHotExperts, DecodeRouting::kSkippedSlots}) {
      Routing given, expected;
      caller_routing(kind, batch.routing, shape.num_experts, &given, &expected);
      const DeviceInputs inputs(batch.hidden_states, batch.router_logits, data.correction_bias, given, T);
      const std::vector<float> reference =
          kind == DecodeRouting::kRouter
              ? batch.reference
              : reference_output(data.weights, batch.hidden_states, expected, shape.activation);
      for (const bool device_routing : {true, false}) {
        if (device_routing && kind != DecodeRouting::kRouter) continue;
        const std::string what = shape.name + " T=" + std::to_string(T) + " " + to_string(kind) +
                                 (device_routing ? ", device routing" : ", caller routing");
        SCOPED_TRACE(what);
        const MoeForwardArgs args = device_routing ? inputs.device_routing() : inputs.caller_routing();
        const std::vector<uint16_t> bits = forward_bits(fused, args, output, workspace, stream.get());
        const std::vector<uint16_t> plain = forward_bits(separate, args, output, workspace, stream.get());
        EXPECT_EQ(first_difference(bits, plain), -1) << "the fused forward differs from the separate launches";
        const double rel_err = expect_matches_reference(bits, reference, shape.hidden);
        std::printf("  %-60s rel_err %.2e\n", what.c_str(), rel_err);
      }
    }
  }
  EXPECT_EQ(fused.device_errors(workspace.get(), stream.get()), "");
}

INSTANTIATE_TEST_SUITE_P(Models, FusedDecode,
                         ::testing::Values("DeepSeekV3", "GLM45", "Qwen3_30B", "GptOss", "Mixtral"),
                         [](const ::testing::TestParamInfo<std::string>& info) { return info.param; });

// The kernel's counters are left at zero (the workspace's contract): graph
// replays with new inputs between them equal eager forwards, at T = 2 and 16.
TEST(FusedDecodeGraph, ReplaysWithNewInputsEqualEagerForwards) {
  FP4MOE_REQUIRE_GPU();
  const ModelShape& shape = shape_named("DeepSeekV3");
  ModelData& data = model_data(shape);
  const MoeLayer layer = MoeLayer::prepare(data.weights, decode_options(shape, true));
  Stream stream;
  const DeviceBuffer<uint8_t> workspace = make_workspace(layer, 16);
  DeviceBuffer<uint16_t> output(static_cast<size_t>(16 * shape.hidden));
  for (const int64_t T : {kFusedDecodeMinTokens, kFusedDecodeMaxTokens}) {
    SCOPED_TRACE("T=" + std::to_string(T));
    ASSERT_TRUE(layer.plan(T).fused_decode);
    const TokenBatch first = data.make_batch(T);
    const TokenBatch second = data.make_batch(T);
    DeviceInputs inputs(first, data.correction_bias);
    const std::vector<uint16_t> eager_first =
        forward_bits(layer, inputs.device_routing(), output, workspace, stream.get());
    const ForwardGraph graph(layer, inputs.device_routing(), output.get(), workspace, stream.get());
    for (int replay = 0; replay < 4; ++replay) {
      const TokenBatch& batch = replay % 2 == 0 ? first : second;
      inputs.hidden_states.upload(batch.hidden_states, stream.get());
      inputs.router_logits.upload(batch.router_logits, stream.get());
      output.fill_bytes(0xFF, stream.get());
      graph.launch(stream.get());
      const std::vector<uint16_t> replayed =
          output_rows(output.download(stream.get()), static_cast<size_t>(T * shape.hidden));
      expect_matches_reference(replayed, batch.reference, shape.hidden);
      if (replay % 2 == 0) EXPECT_EQ(first_difference(replayed, eager_first), -1) << "replay " << replay;
    }
  }
}

// The planner runs the fused kernel from kFusedDecodeMinTokens to
// kFusedDecodeMaxTokens, in the deterministic finalize only, and not where a
// forced tile of the other GEMM differs from the decode tile (the rule
// itself, split plans included: tests/plan/test_plan.cpp).
TEST(FusedDecodePlan, WhereTheKernelRuns) {
  FP4MOE_REQUIRE_GPU();
  const ModelShape& shape = shape_named("GLM45");
  ModelData& data = model_data(shape);
  const MoeLayer layer = MoeLayer::prepare(data.weights, layer_options(shape));
  EXPECT_FALSE(layer.plan(kFusedDecodeMinTokens - 1).fused_decode);
  EXPECT_TRUE(layer.plan(kFusedDecodeMinTokens).fused_decode) << layer.plan(kFusedDecodeMinTokens).describe();
  EXPECT_TRUE(layer.plan(kFusedDecodeMaxTokens).fused_decode);
  EXPECT_FALSE(layer.plan(kFusedDecodeMaxTokens + 1).fused_decode);
  EXPECT_NE(layer.plan(kFusedDecodeMinTokens).describe().find("fused decode"), std::string::npos);
  EXPECT_EQ(layer.plan(kFusedDecodeMinTokens).gemm1.split_k, 1);
  EXPECT_EQ(layer.plan(kFusedDecodeMinTokens).gemm2.split_k, 1);

  const MoeLayer atomic = MoeLayer::prepare(data.weights, layer_options(shape, FinalizeMode::kAtomic));
  EXPECT_FALSE(atomic.plan(kFusedDecodeMinTokens).fused_decode);
  MoeLayerOptions mixed = decode_options(shape, true);
  mixed.gemm2_config = TileConfig::parse("n128m32k128s4w4");
  EXPECT_FALSE(MoeLayer::prepare(data.weights, mixed).plan(kFusedDecodeMinTokens).fused_decode);
}

}  // namespace
}  // namespace fp4moe
