// What a checkpoint's config.json says about its MoE layers (expert count,
// top-k, routing, activation, sizes, shared experts) and the layer's router
// (its gate weight, optional bias and noaux_tc correction bias), so that a
// layer runs from hidden states alone, with the model's own routing
// (docs/design.md §3). Tested in tests/format/test_model_config.cpp.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "fp4moe/types.hpp"

namespace fp4moe {

// The MoE fields of a config.json (a multimodal model's text_config), under
// each family's key names, with transformers' defaults for absent keys:
//
//   DeepSeek-V3 / Kimi K2 / GLM-4.5+  n_routed_experts, num_experts_per_tok,
//     scoring_func ("sigmoid"), topk_method ("noaux_tc"), n_group,
//     topk_group, routed_scaling_factor, norm_topk_prob (true),
//     n_shared_experts, moe_intermediate_size. noaux_tc routing; DeepSeek-V2's
//     "greedy" softmax top-k is read too (without a scaling factor other than 1).
//     Defaults where a key is absent: model_type deepseek_v3 / kimi_k2 as
//     transformers' DeepseekV3Config (n_group 8, topk_group 4, factor 2.5),
//     others n_group 1, topk_group 1, factor 1.
//   Qwen2-MoE / Qwen3-MoE  num_experts, num_experts_per_tok, norm_topk_prob
//     (false), moe_intermediate_size, shared_expert_intermediate_size
//     (Qwen2-MoE's gated shared expert). Softmax top-k.
//   Mixtral  num_local_experts, num_experts_per_tok, intermediate_size.
//     Softmax top-k, always renormalised.
//   gpt-oss  (model_type gpt_oss) num_local_experts, experts_per_token or
//     num_experts_per_tok, intermediate_size. Top-k logits then softmax, the
//     clamped gpt-oss activation.
struct MoeModelConfig {
  std::string where;       // the config.json read, for messages
  std::string model_type;  // as written; may be empty
  int64_t num_experts = 0;
  std::string num_experts_key;
  // Experts per token; absent when the config does not say (the routing's
  // top_k is then 0 and must come from elsewhere).
  std::optional<int> top_k;
  std::string top_k_key;
  RoutingParams routing;  // mode, renormalize, groups, scaling; top_k = *top_k or 0
  Activation activation = Activation::kSwiGLU;
  std::optional<int64_t> hidden_size;            // hidden_size
  std::optional<int64_t> moe_intermediate_size;  // the routed experts' width
  std::string moe_intermediate_key;              // the key that gave it
  // Shared experts: DeepSeek/GLM/Kimi's n_shared_experts (an MLP of width
  // n_shared_experts * moe_intermediate_size), Qwen2-MoE's
  // shared_expert_intermediate_size (one gated MLP). 0: none declared.
  int64_t num_shared_experts = 0;
  int64_t shared_expert_intermediate_size = 0;

  // "noaux_tc (n_group 8, topk_group 4, routed_scaling_factor 2.5)" etc.
  std::string describe_routing() const;
};

// Reads config.json beside a checkpoint: `checkpoint_path` is its directory
// or a file in it. Empty when there is no config.json or it declares no
// routed expert count (not an MoE config). Throws fp4moe::Error, one line
// naming the file and key, for a value of the wrong type or range and for a
// routing fp4moe does not implement (e.g. noaux_tc with norm_topk_prob false).
std::optional<MoeModelConfig> read_moe_model_config(const std::string& checkpoint_path);
// The same from config.json's text (`where` names it in messages).
std::optional<MoeModelConfig> parse_moe_model_config(const std::string& json_text, const std::string& where);

// A layer's router: logits = hidden · weightᵀ + bias.
struct RouterWeights {
  int64_t num_experts = 0;
  int64_t hidden = 0;
  std::vector<float> weight;           // [num_experts, hidden] row-major
  std::vector<float> bias;             // [num_experts] (gpt-oss), else empty
  std::vector<float> correction_bias;  // [num_experts] noaux_tc e_score_correction_bias, else empty
  std::string weight_name;             // the tensor read, for messages
};

// Loads the router of the layer under `prefix` ("model.layers.3.mlp.") from
// a .safetensors file or checkpoint directory: "<prefix>gate.weight" (DeepSeek,
// GLM, Kimi, Qwen, Mixtral's block_sparse_moe.gate) with
// "<prefix>gate.e_score_correction_bias" where present, or gpt-oss's
// "<prefix>router.weight" + "<prefix>router.bias". Float tensors (F32, BF16,
// F16), unquantised as ModelOpt leaves them. Empty when there is no router
// weight; throws one line for a wrong dtype or shape or a non-finite value.
std::optional<RouterWeights> load_router_weights(const std::string& path, const std::string& prefix);

// router logits [num_tokens, num_experts] of hidden_states [num_tokens,
// hidden]: each a dot product accumulated in double in a fixed order, plus
// the bias, rounded to float.
std::vector<float> compute_router_logits(const RouterWeights& router, const float* hidden_states, int64_t num_tokens);

}  // namespace fp4moe
