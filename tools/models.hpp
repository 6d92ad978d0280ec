// The MoE layer shapes of the models fp4moe targets (one table, shared by the
// `demo`, `plan` and `bench` commands): expert count, top-k, hidden and
// intermediate sizes, and how each model routes and activates. Sizes are the
// models' published configs (config.json: n_routed_experts / num_experts,
// num_experts_per_tok, hidden_size, moe_intermediate_size).
// Tested through the CLI in tests/tools/test_cli.cpp (demo, unknown names).
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <string_view>

#include "fp4moe/error.hpp"
#include "fp4moe/reference.hpp"

namespace fp4moe::cli {

struct ModelShape {
  std::string_view name;     // CLI spelling, e.g. "glm-5"
  std::string_view display;  // human name, e.g. "GLM-5"
  int64_t num_experts;       // routed experts (the demo, plan and bench leave shared experts out)
  int top_k;                 // experts per token
  int64_t hidden;            // H: GEMM1's K, GEMM2's N
  int64_t inter;             // I: moe_intermediate_size, GEMM1's N (per gate/up), GEMM2's K
  RoutingMode routing;
  Activation activation;
  int num_groups = 1;                  // kNoauxTc: n_group
  int topk_groups = 1;                 // kNoauxTc: topk_group
  float routed_scaling_factor = 1.0f;  // kNoauxTc
  bool has_bias = false;               // gate/up/down biases (gpt-oss)

  RoutingParams routing_params() const {
    RoutingParams params;
    params.mode = routing;
    params.top_k = top_k;
    params.renormalize = true;
    params.num_groups = num_groups;
    params.topk_groups = topk_groups;
    params.routed_scaling_factor = routed_scaling_factor;
    return params;
  }
};

inline constexpr std::array<ModelShape, 8> kModelShapes = {{
    // name           display            E    k  hidden  inter  routing                    activation          groups  scale   bias
    {"deepseek-v3", "DeepSeek-V3", 256, 8, 7168, 2048, RoutingMode::kNoauxTc, Activation::kSwiGLU, 8, 4, 2.5f, false},
    {"kimi-k2", "Kimi K2", 384, 8, 7168, 2048, RoutingMode::kNoauxTc, Activation::kSwiGLU, 1, 1, 2.827f, false},
    {"glm-5", "GLM-5", 256, 8, 6144, 2048, RoutingMode::kNoauxTc, Activation::kSwiGLU, 1, 1, 2.5f, false},
    {"glm-4.5", "GLM-4.5/4.6/4.7", 160, 8, 5120, 1536, RoutingMode::kNoauxTc, Activation::kSwiGLU, 1, 1, 2.5f, false},
    {"qwen3-235b", "Qwen3-235B-A22B", 128, 8, 4096, 1536, RoutingMode::kSoftmaxTopK, Activation::kSwiGLU, 1, 1, 1.0f,
     false},
    {"qwen3-30b", "Qwen3-30B-A3B", 128, 8, 2048, 768, RoutingMode::kSoftmaxTopK, Activation::kSwiGLU, 1, 1, 1.0f,
     false},
    {"gpt-oss-120b", "gpt-oss-120b", 128, 4, 2880, 2880, RoutingMode::kGptOss, Activation::kGptOss, 1, 1, 1.0f, true},
    {"mixtral", "Mixtral-8x7B", 8, 2, 4096, 14336, RoutingMode::kSoftmaxTopK, Activation::kSwiGLU, 1, 1, 1.0f, false},
}};

inline constexpr std::string_view kDefaultModel = "glm-5";

// "deepseek-v3, kimi-k2, ..." for help texts and error messages.
inline std::string model_names() {
  std::string names;
  for (const ModelShape& model : kModelShapes) {
    if (!names.empty()) names += ", ";
    names += model.name;
  }
  return names;
}

// Throws fp4moe::Error listing the valid names when `name` is not one.
inline const ModelShape& find_model(std::string_view name) {
  for (const ModelShape& model : kModelShapes)
    if (model.name == name) return model;
  FP4MOE_THROW("unknown model '", name, "'; valid models: ", model_names());
}

}  // namespace fp4moe::cli
