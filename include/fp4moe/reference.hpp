// The CPU reference for every op of the MoE layer (DESIGN.md §3): routing,
// the expert MLPs and the weighted combine. Accumulates in double; this is the
// oracle GPU results are checked against, and a slow but complete backend.
// Tested in tests/ref/test_reference.cpp against a naive independent path.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "fp4moe/modelopt.hpp"

namespace fp4moe {

enum class RoutingMode {
  kSoftmaxTopK,  // softmax over experts, top-k, optional renormalisation
  kNoauxTc,      // DeepSeek-V3/GLM: sigmoid, grouped selection with correction bias
  kGptOss,       // top-k of the logits, softmax over the k selected
};

struct RoutingParams {
  RoutingMode mode = RoutingMode::kSoftmaxTopK;
  int top_k = 8;
  bool renormalize = true;             // kSoftmaxTopK only (kNoauxTc always renormalises)
  int num_groups = 1;                  // kNoauxTc: n_group
  int topk_groups = 1;                 // kNoauxTc: topk_group
  float routed_scaling_factor = 1.0f;  // kNoauxTc: multiplies the final weights
};

// Per-token expert choice: ids and weights [num_tokens, top_k], row-major.
struct Routing {
  int64_t num_tokens = 0;
  int top_k = 0;
  std::vector<int32_t> topk_ids;
  std::vector<float> topk_weights;
};

// Routes router_logits [num_tokens, num_experts]. correction_bias
// [num_experts] is used by kNoauxTc only (may be null: zeros). Ties between
// equal scores go to the lower expert index. Throws on top_k > num_experts,
// groups that do not divide the experts, etc.
Routing route(const float* router_logits, int64_t num_tokens, int64_t num_experts,
              const float* correction_bias, const RoutingParams& params);

// Validates caller-given routing against the layer (ids in range, no
// duplicate expert within a token, shapes); throws with the first offence.
void validate_routing(const Routing& routing, int64_t num_experts);

enum class Activation {
  kSwiGLU,  // silu(gate) * up
  kGptOss,  // g = min(gate, 7), l = clamp(up, -7, 7), g * sigmoid(1.702 g) * (l + 1)
};

std::string to_string(RoutingMode mode);
RoutingMode parse_routing_mode(const std::string& name);  // "softmax", "noaux_tc", "gptoss"

// output [num_tokens, hidden] = sum_j w_j * down_e(act(gate_e x, up_e x)) for the
// token's top-k experts e with weights w_j; biases added where present.
// hidden_states [num_tokens, hidden] row-major float. Uses all hardware threads.
void moe_reference(const MoeWeights& weights, const float* hidden_states,
                   const Routing& routing, Activation activation, float* output);

}  // namespace fp4moe
