// What `fp4moe moe` reads from its --input file: hidden_states [T, H] and the
// routing, given as topk_ids + topk_weights, or routed here from
// router_logits (+ e_score_correction_bias), or from the logits of the
// checkpoint's router applied to the hidden states, by the routing that
// config.json or the command-line flags set. Every tensor is
// checked against the layer before anything runs. Host-only (no CUDA), so
// fuzz/fuzz_moe_input.cpp compiles it directly.
// Tested through the CLI in tests/tools/test_cli.cpp and by that fuzz target.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "fp4moe/model_config.hpp"
#include "fp4moe/reference.hpp"
#include "fp4moe/safetensors.hpp"

namespace fp4moe::cli {

// How router logits are routed (unused when the input gives topk_ids):
// config.json's routing, or the command-line flags where there is none.
struct LogitRoutingFlags {
  std::string mode = "softmax";  // --routing: softmax, noaux_tc, gptoss
  std::optional<int> top_k;      // --topk: required with router_logits
  bool renormalize = true;       // not --no-renormalize
  int num_groups = 1;            // --n-group
  int topk_groups = 1;           // --topk-group
  float routed_scaling_factor = 1.0f;
};

struct MoeInput {
  int64_t num_tokens = 0;            // T
  std::vector<float> hidden_states;  // [T, H] row-major
  Routing routing;
  // "topk_ids", or the mode that routed the logits (router_logits, or
  // "<mode> (router <weight name>)" when computed from the hidden states)
  std::string routing_source;
  std::vector<std::string> notes;  // tensors present but unused, one line each
};

// Reads and checks the input of a layer with `hidden` features and
// `num_experts` experts. `router` (the checkpoint's, may be null) gives the
// logits when the input holds hidden_states only, and its correction bias
// where the input's router_logits come without one. Throws fp4moe::Error
// naming the file, the tensor and what was expected.
MoeInput read_moe_input(const SafetensorsFile& in, int64_t hidden, int64_t num_experts, const LogitRoutingFlags& flags,
                        const RouterWeights* router = nullptr);

}  // namespace fp4moe::cli
