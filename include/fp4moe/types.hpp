// The vocabulary the parts of fp4moe share (docs/design.md §3): NVFP4
// weight matrices and an MoE layer's experts in ModelOpt's layout, how tokens
// are routed to experts, and the options of the expert MLPs (activation,
// activation numerics). Plain data and the names of its enums: the loader
// (fp4moe/modelopt.hpp), the CPU reference (fp4moe/reference.hpp) and the GPU
// layer (fp4moe/moe_layer.hpp) take and return these types. Tested with
// them, in tests/format/test_moe_weights_reader.cpp and tests/ref/test_reference.cpp.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace fp4moe {

// ------------------------------------------------------------------- weights

// One NVFP4 weight matrix W [rows = N, cols = K] in ModelOpt layout.
struct Nvfp4Matrix {
  int64_t rows = 0;             // N (output features)
  int64_t cols = 0;             // K (input features), a multiple of 16
  std::vector<uint8_t> packed;  // [rows, cols/2]; even element in the low nibble
  std::vector<uint8_t> scales;  // [rows, cols/16] float8 e4m3fn block scales
  float global_scale = 1.0f;    // weight_scale_2
  // The calibrated activation scale (amax / 2688 of this matrix's input),
  // used by W4A4 activation numerics only (fp4moe::ActivationNumerics);
  // has_input_scale says whether the checkpoint carries one.
  float input_scale = 1.0f;
  bool has_input_scale = false;

  uint8_t code(int64_t r, int64_t c) const {
    const uint8_t byte = packed[static_cast<size_t>(r * (cols / 2) + c / 2)];
    return (c & 1) ? (byte >> 4) : (byte & 0xF);
  }
  uint8_t scale(int64_t r, int64_t c) const { return scales[static_cast<size_t>(r * (cols / 16) + c / 16)]; }
  float value(int64_t r, int64_t c) const;  // dequantised element
  // The whole matrix dequantised to float, row-major [rows, cols].
  std::vector<float> dequantize() const;
};

// The three projections of one expert. gate and up have the same
// global_scale (ModelOpt shares weight_scale_2 between them).
struct ExpertWeights {
  Nvfp4Matrix gate;  // [inter, hidden]
  Nvfp4Matrix up;    // [inter, hidden]
  Nvfp4Matrix down;  // [hidden, inter]
  // Optional biases (gpt-oss): empty when the checkpoint has none.
  std::vector<float> gate_bias;  // [inter]
  std::vector<float> up_bias;    // [inter]
  std::vector<float> down_bias;  // [hidden]
};

// A shared expert: an MLP every token runs beside its routed experts
// (DeepSeek-V3/GLM/Kimi "shared_experts", n_shared_experts of them fused into
// one MLP n_shared_experts * moe_intermediate_size wide; Qwen2-MoE
// "shared_expert", shared_expert_intermediate_size wide, with a gate).
// Its output is added to the routed experts' weighted sum with weight 1 (no
// routed_scaling_factor: that scales the routed experts only) or, with a
// gate, sigmoid(gate · x).
struct SharedExpertWeights {
  int64_t inter = 0;        // its intermediate width, a multiple of 16
  ExpertWeights mlp;        // gate/up [inter, hidden], down [hidden, inter]; no biases
  std::vector<float> gate;  // Qwen2-MoE shared_expert_gate.weight [hidden]; empty: weight 1
  // A shared expert the checkpoint leaves unquantised (ModelOpt's
  // experts-only configs): its weights as floats, row-major, with `mlp`
  // empty — dense_gate_up [2 * inter, hidden] (gate rows, then up rows) and
  // dense_down [hidden, inter]. It runs with unquantised activations. The
  // CPU reference runs it; the GPU layer, which runs shared experts as NVFP4
  // experts of its grouped GEMMs, refuses it.
  std::vector<float> dense_gate_up;
  std::vector<float> dense_down;
  bool dense() const { return !dense_down.empty(); }
};

struct MoeWeights {
  int64_t num_experts = 0;
  int64_t hidden = 0;  // H
  int64_t inter = 0;   // I (moe_intermediate_size)
  std::vector<ExpertWeights> experts;
  // The layer's shared expert, when the checkpoint has one.
  std::optional<SharedExpertWeights> shared_expert;
  // The format the checkpoint declares for the layer (hf_quant_config.json,
  // or config.json's quantization_config): "NVFP4" (W4A4: its input_scale
  // quantises activations, ActivationNumerics::kCheckpoint follows it) or
  // "W4A16_NVFP4"; empty when the checkpoint declares none.
  std::string checkpoint_format;

  bool has_bias() const { return !experts.empty() && !experts[0].gate_bias.empty(); }
};

// How many values a stacked input_scale tensor holds (an inference
// engine's w13_input_scale or w2_input_scale; fp4moe/reference.hpp turns
// them into per-expert scales).
enum class InputScaleExtent {
  kPerExpert,        // [E]: w13's applies to gate and up alike
  kPerExpertGateUp,  // [E, 2] = {gate, up} of each expert (w13_input_scale only)
  kPerLayer,         // one value for every expert (0-d or [1])
};

// ------------------------------------------------------------------- routing

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
  // Set by route(): tokens with at least one non-finite logit (their
  // experts were excluded, see route()). The GPU reports the same event as
  // a device error bit (MoeLayer::device_errors).
  int64_t tokens_with_nonfinite_logits = 0;
};

std::string to_string(RoutingMode mode);
RoutingMode parse_routing_mode(const std::string& name);  // "softmax", "noaux_tc", "gptoss"

// --------------------------------------------------------------- expert MLPs

enum class Activation {
  kSwiGLU,  // silu(gate) * up
  kGptOss,  // g = min(gate, 7), l = clamp(up, -7, 7), g * sigmoid(1.702 g) * (l + 1)
};

// The precision of the two expert GEMMs' input activations (docs/design.md §3).
enum class ActivationNumerics {
  kCheckpoint,  // what the checkpoint declares: kFp4 for an "NVFP4" (W4A4) checkpoint whose
                // every expert matrix has an input_scale, kBf16 otherwise (W4A16_NVFP4 or none)
  kBf16,        // W4A16: activations as given (bf16 on the GPU)
  kFp4,         // W4A4: GEMM1's input quantised per 16-block against gate/up's input_scale,
                // GEMM2's input (the activation output) against down_proj's (nvfp4_activation.hpp)
};
std::string to_string(ActivationNumerics numerics);
ActivationNumerics parse_activation_numerics(const std::string& name);  // "checkpoint", "bf16", "fp4"

}  // namespace fp4moe
