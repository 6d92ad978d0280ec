// Tests of src/format/model_config.cpp and the router loader of
// src/format/moe_weights_reader.cpp: config.json's MoE fields per model family (keys
// and transformers' defaults, as the real configs of the README's models
// write them), every refusal in one line naming the file and key, and the
// router read from a checkpoint (gate or gpt-oss router, correction bias,
// dtypes) and its logits against a hand-computed product.
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <string>
#include <vector>

#include "expect_error.hpp"
#include "fp4moe/model_config.hpp"
#include "fp4moe/nvfp4.hpp"
#include "fp4moe/safetensors.hpp"
#include "temp_dir.hpp"

namespace fp4moe {
namespace {

MoeModelConfig parse(const std::string& text) {
  const std::optional<MoeModelConfig> c = parse_moe_model_config(text, "config.json");
  EXPECT_TRUE(c.has_value()) << text;
  return c.value_or(MoeModelConfig{});
}

// The MoE fields of the published configs (DeepSeek-V3, Kimi K2, GLM-4.5,
// Qwen3-30B-A3B, Qwen1.5-MoE (qwen2_moe), Mixtral-8x7B, gpt-oss-120b).
TEST(ModelConfig, EachFamilyRoutesAsItsConfigSays) {
  const MoeModelConfig deepseek = parse(R"({"model_type": "deepseek_v3", "n_routed_experts": 256,
      "num_experts_per_tok": 8, "n_group": 8, "topk_group": 4, "routed_scaling_factor": 2.5,
      "norm_topk_prob": true, "scoring_func": "sigmoid", "topk_method": "noaux_tc", "n_shared_experts": 1,
      "hidden_size": 7168, "moe_intermediate_size": 2048, "hidden_act": "silu"})");
  EXPECT_EQ(deepseek.num_experts, 256);
  EXPECT_EQ(deepseek.num_experts_key, "n_routed_experts");
  EXPECT_EQ(deepseek.top_k, 8);
  EXPECT_EQ(deepseek.routing.mode, RoutingMode::kNoauxTc);
  EXPECT_EQ(deepseek.routing.top_k, 8);
  EXPECT_EQ(deepseek.routing.num_groups, 8);
  EXPECT_EQ(deepseek.routing.topk_groups, 4);
  EXPECT_FLOAT_EQ(deepseek.routing.routed_scaling_factor, 2.5f);
  EXPECT_EQ(deepseek.activation, Activation::kSwiGLU);
  EXPECT_EQ(deepseek.hidden_size, 7168);
  EXPECT_EQ(deepseek.moe_intermediate_size, 2048);
  EXPECT_EQ(deepseek.num_shared_experts, 1);
  EXPECT_EQ(deepseek.describe_routing(), "noaux_tc (n_group 8, topk_group 4, routed_scaling_factor 2.5)");

  // DeepseekV3Config's defaults where the keys are absent.
  const MoeModelConfig v3_defaults = parse(R"({"model_type": "deepseek_v3", "n_routed_experts": 256})");
  EXPECT_EQ(v3_defaults.routing.mode, RoutingMode::kNoauxTc);
  EXPECT_EQ(v3_defaults.routing.num_groups, 8);
  EXPECT_EQ(v3_defaults.routing.topk_groups, 4);
  EXPECT_FLOAT_EQ(v3_defaults.routing.routed_scaling_factor, 2.5f);
  EXPECT_FALSE(v3_defaults.top_k.has_value());

  const MoeModelConfig kimi = parse(R"({"model_type": "kimi_k2", "n_routed_experts": 384,
      "num_experts_per_tok": 8, "n_group": 1, "topk_group": 1, "routed_scaling_factor": 2.827,
      "scoring_func": "sigmoid", "topk_method": "noaux_tc", "norm_topk_prob": true})");
  EXPECT_EQ(kimi.routing.mode, RoutingMode::kNoauxTc);
  EXPECT_EQ(kimi.routing.num_groups, 1);
  EXPECT_FLOAT_EQ(kimi.routing.routed_scaling_factor, 2.827f);

  // GLM-4.5 writes neither scoring_func nor topk_method: sigmoid + noaux_tc.
  const MoeModelConfig glm = parse(R"({"model_type": "glm4_moe", "n_routed_experts": 160,
      "num_experts_per_tok": 8, "n_group": 1, "topk_group": 1, "routed_scaling_factor": 2.5,
      "norm_topk_prob": true, "n_shared_experts": 1, "moe_intermediate_size": 1536, "hidden_size": 5120})");
  EXPECT_EQ(glm.routing.mode, RoutingMode::kNoauxTc);
  EXPECT_FLOAT_EQ(glm.routing.routed_scaling_factor, 2.5f);
  EXPECT_EQ(glm.moe_intermediate_size, 1536);

  // DeepSeek-V2-Lite: greedy softmax, not renormalised.
  const MoeModelConfig v2 = parse(R"({"model_type": "deepseek_v2", "n_routed_experts": 64,
      "num_experts_per_tok": 6, "topk_method": "greedy", "scoring_func": "softmax", "norm_topk_prob": false,
      "routed_scaling_factor": 1.0, "n_shared_experts": 2})");
  EXPECT_EQ(v2.routing.mode, RoutingMode::kSoftmaxTopK);
  EXPECT_FALSE(v2.routing.renormalize);
  EXPECT_EQ(v2.num_shared_experts, 2);

  const MoeModelConfig qwen3 = parse(R"({"model_type": "qwen3_moe", "num_experts": 128,
      "num_experts_per_tok": 8, "norm_topk_prob": true, "moe_intermediate_size": 768, "hidden_size": 2048})");
  EXPECT_EQ(qwen3.num_experts_key, "num_experts");
  EXPECT_EQ(qwen3.routing.mode, RoutingMode::kSoftmaxTopK);
  EXPECT_TRUE(qwen3.routing.renormalize);
  EXPECT_EQ(qwen3.moe_intermediate_size, 768);
  EXPECT_EQ(qwen3.shared_expert_intermediate_size, 0);

  // transformers 5 writes Qwen3-MoE's expert count as num_local_experts: still
  // Qwen (moe_intermediate_size, norm_topk_prob as written), not Mixtral.
  const MoeModelConfig qwen3_tf5 = parse(R"({"model_type": "qwen3_moe", "num_local_experts": 8,
      "num_experts_per_tok": 2, "norm_topk_prob": false, "moe_intermediate_size": 64, "intermediate_size": 256})");
  EXPECT_EQ(qwen3_tf5.num_experts, 8);
  EXPECT_FALSE(qwen3_tf5.routing.renormalize);
  EXPECT_EQ(qwen3_tf5.moe_intermediate_size, 64);

  // Qwen2-MoE: norm_topk_prob defaults to false; a gated shared expert.
  const MoeModelConfig qwen2 = parse(R"({"model_type": "qwen2_moe", "num_experts": 60,
      "num_experts_per_tok": 4, "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632})");
  EXPECT_FALSE(qwen2.routing.renormalize);
  EXPECT_EQ(qwen2.shared_expert_intermediate_size, 5632);
  EXPECT_EQ(qwen2.describe_routing(), "softmax (not renormalised)");

  // Mixtral: always renormalised; intermediate_size is the experts' width.
  const MoeModelConfig mixtral = parse(R"({"model_type": "mixtral", "num_local_experts": 8,
      "num_experts_per_tok": 2, "intermediate_size": 14336, "hidden_size": 4096})");
  EXPECT_EQ(mixtral.routing.mode, RoutingMode::kSoftmaxTopK);
  EXPECT_TRUE(mixtral.routing.renormalize);
  EXPECT_EQ(mixtral.moe_intermediate_size, 14336);
  EXPECT_EQ(mixtral.moe_intermediate_key, "intermediate_size");

  // gpt-oss: both top-k keys, top-k then softmax, its own activation.
  const MoeModelConfig gpt_oss = parse(R"({"model_type": "gpt_oss", "num_local_experts": 128,
      "experts_per_token": 4, "num_experts_per_tok": 4, "intermediate_size": 2880, "hidden_size": 2880})");
  EXPECT_EQ(gpt_oss.routing.mode, RoutingMode::kGptOss);
  EXPECT_EQ(gpt_oss.activation, Activation::kGptOss);
  EXPECT_EQ(gpt_oss.top_k, 4);
  EXPECT_EQ(gpt_oss.moe_intermediate_size, 2880);

  // A multimodal model's language fields live in text_config.
  const MoeModelConfig nested = parse(R"({"model_type": "outer", "text_config": {"model_type": "qwen3_moe",
      "num_experts": 16, "num_experts_per_tok": 2}})");
  EXPECT_EQ(nested.num_experts, 16);
  EXPECT_EQ(nested.model_type, "qwen3_moe");
}

TEST(ModelConfig, NotAnMoeConfigIsEmpty) {
  EXPECT_FALSE(parse_moe_model_config(R"({"model_type": "llama", "hidden_size": 4096})", "c").has_value());
  TempDir dir;
  EXPECT_FALSE(read_moe_model_config(dir.path().string()).has_value());  // no config.json
  std::ofstream(dir / "config.json") << R"({"num_experts": 4, "num_experts_per_tok": 2})";
  const auto from_dir = read_moe_model_config(dir.path().string());
  const auto from_file = read_moe_model_config(dir / "model.safetensors");  // need not exist
  ASSERT_TRUE(from_dir && from_file);
  EXPECT_EQ(from_dir->num_experts, 4);
  EXPECT_EQ(from_file->where, dir / "config.json");
}

TEST(ModelConfig, RefusalsNameTheFileAndKey) {
  const auto refused = [](const std::string& text, const std::vector<std::string>& snippets) {
    SCOPED_TRACE(text);
    expect_error([&] { parse_moe_model_config(text, "/ckpt/config.json"); }, snippets);
  };
  refused("{not json", {"/ckpt/config.json", "not valid JSON"});
  refused("[1, 2]", {"expected a JSON object"});
  refused(R"({"num_experts": 0})", {"num_experts is 0", "positive integer"});
  refused(R"({"num_experts": 8, "num_experts_per_tok": "2"})", {"num_experts_per_tok is \"2\""});
  refused(R"({"num_local_experts": 8, "num_experts_per_tok": 2, "experts_per_token": 4})",
          {"num_experts_per_tok = 2", "experts_per_token = 4"});
  refused(R"({"n_routed_experts": 8, "norm_topk_prob": false})", {"norm_topk_prob is false", "noaux_tc"});
  refused(R"({"n_routed_experts": 8, "scoring_func": "softmax", "topk_method": "noaux_tc"})",
          {"scoring_func \"softmax\""});
  refused(R"({"n_routed_experts": 8, "topk_method": "group_limited_greedy", "scoring_func": "softmax"})",
          {"topk_method \"group_limited_greedy\"", "not a routing fp4moe implements"});
  refused(R"({"model_type": "deepseek_v2", "n_routed_experts": 8, "routed_scaling_factor": 16.0})",
          {"routed_scaling_factor 16", "expected 1"});
  refused(R"({"n_routed_experts": 8, "routed_scaling_factor": -1})", {"routed_scaling_factor is -1"});
  refused(R"({"n_routed_experts": 8, "n_group": 0})", {"n_group is 0"});
  refused(R"({"num_experts": 8, "norm_topk_prob": 1})", {"norm_topk_prob is 1", "true or false"});
  refused(R"({"num_experts": 8, "hidden_act": "gelu"})", {"hidden_act is \"gelu\"", "silu"});
}

// Writes a router to a safetensors file as `dtype` (F32, BF16).
void add_float(SafetensorsWriter& w, const std::string& name, DType dtype, const std::vector<int64_t>& shape,
               const std::vector<float>& values) {
  if (dtype == DType::F32) {
    w.add(name, dtype, shape, values.data(), values.size() * 4);
    return;
  }
  std::vector<uint16_t> bits(values.size());
  for (size_t i = 0; i < values.size(); ++i) bits[i] = float_to_bf16(values[i]);
  w.add(name, dtype, shape, bits.data(), bits.size() * 2);
}

TEST(RouterWeights, LoadedAndAppliedAsTheCheckpointSays) {
  TempDir dir;
  const int64_t E = 4, H = 16;
  std::vector<float> weight(E * H), bias = {0.5f, -1.0f, 0.25f, 2.0f}, correction = {0.1f, 0.2f, -0.3f, 0.0f};
  for (int64_t i = 0; i < E * H; ++i) weight[i] = static_cast<float>((i * 7) % 11) * 0.125f - 0.5f;  // bf16-exact

  for (const DType dtype : {DType::F32, DType::BF16}) {
    SCOPED_TRACE(dtype_name(dtype));
    SafetensorsWriter w;
    add_float(w, "model.layers.3.mlp.gate.weight", dtype, {E, H}, weight);
    add_float(w, "model.layers.3.mlp.gate.e_score_correction_bias", DType::F32, {E}, correction);
    add_float(w, "model.layers.5.mlp.router.weight", dtype, {E, H}, weight);
    add_float(w, "model.layers.5.mlp.router.bias", dtype, {E}, bias);
    w.write(dir / "model.safetensors");

    const auto gate = load_router_weights(dir / "model.safetensors", "model.layers.3.mlp.");
    ASSERT_TRUE(gate.has_value());
    EXPECT_EQ(gate->num_experts, E);
    EXPECT_EQ(gate->hidden, H);
    EXPECT_EQ(gate->weight, weight);
    EXPECT_TRUE(gate->bias.empty());
    EXPECT_EQ(gate->correction_bias, correction);
    EXPECT_EQ(gate->weight_name, "model.layers.3.mlp.gate.weight");

    const auto router = load_router_weights(dir.path().string(), "model.layers.5.mlp.");
    ASSERT_TRUE(router.has_value());
    EXPECT_EQ(router->bias, bias);
    EXPECT_TRUE(router->correction_bias.empty());

    EXPECT_FALSE(load_router_weights(dir / "model.safetensors", "model.layers.4.mlp.").has_value());

    // logits = x · Wᵀ + b, by hand.
    std::vector<float> x(2 * H);
    for (int64_t i = 0; i < 2 * H; ++i) x[i] = static_cast<float>(i % 5) - 2.0f;
    const std::vector<float> logits = compute_router_logits(*router, x.data(), 2);
    ASSERT_EQ(logits.size(), static_cast<size_t>(2 * E));
    for (int64_t t = 0; t < 2; ++t)
      for (int64_t e = 0; e < E; ++e) {
        double expected = bias[e];
        for (int64_t h = 0; h < H; ++h) expected += static_cast<double>(weight[e * H + h]) * x[t * H + h];
        EXPECT_EQ(logits[t * E + e], static_cast<float>(expected)) << t << "," << e;
      }
  }

  // Refused in one line: a quantised router, a mis-shaped bias, a NaN.
  SafetensorsWriter bad;
  std::vector<uint8_t> packed(E * H / 2);
  bad.add("a.gate.weight", DType::U8, {E, H / 2}, packed.data(), packed.size());
  add_float(bad, "b.gate.weight", DType::F32, {E, H}, weight);
  add_float(bad, "b.gate.e_score_correction_bias", DType::F32, {E + 1}, std::vector<float>(E + 1, 0.0f));
  std::vector<float> nan_weight = weight;
  nan_weight[5] = std::nanf("");
  add_float(bad, "c.router.weight", DType::F32, {E, H}, nan_weight);
  bad.write(dir / "bad.safetensors");
  expect_error([&] { load_router_weights(dir / "bad.safetensors", "a."); },
               {"'a.gate.weight'", "U8 [4, 8]", "expected F32, BF16 or F16"});
  expect_error([&] { load_router_weights(dir / "bad.safetensors", "b."); },
               {"'b.gate.e_score_correction_bias'", "[5]", "expected F32, BF16 or F16 [4]"});
  expect_error([&] { load_router_weights(dir / "bad.safetensors", "c."); }, {"'c.router.weight' element 5", "finite"});
}

}  // namespace
}  // namespace fp4moe
