// NVFP4 matrices and MoE expert weights in NVIDIA ModelOpt's checkpoint layout
// NVFP4 matrices and MoE expert weights in NVIDIA ModelOpt's checkpoint layout
// (docs/design.md §3; the types themselves in fp4moe/types.hpp): quantisation
// of float weights, dequantisation, and loading an MoE layer's experts from a
// safetensors file or a sharded checkpoint directory. Tested in
// tests/format/test_modelopt_quantize.cpp,
// tests/format/test_moe_weights_reader.cpp and
// tests/format/test_checkpoint_writer.cpp.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "fp4moe/safetensors.hpp"
#include "fp4moe/types.hpp"

namespace fp4moe {

// Rows [begin, begin + count) of an NVFP4 matrix; its global and input
// scales are the matrix's.
Nvfp4Matrix row_slice(const Nvfp4Matrix& m, int64_t begin, int64_t count);
// Columns [begin, begin + count) (begin and count multiples of 16, so that
// block scales split with them); its global and input scales are the
// matrix's.
Nvfp4Matrix column_slice(const Nvfp4Matrix& m, int64_t begin, int64_t count);

// The input_scale values W4A4 accepts, wherever they come from (checkpoint
// tensors, an engine's stacked tensors): finite and in [kMinInputScale,
// kMaxInputScale]. ModelOpt exports amax / 2688 of the calibrated
// activations, which its export asserts positive; the bounds keep the W4A4
// arithmetic in normal fp32 (6 * s, e4m3 * s with e4m3 down to 2^-9, the
// epilogue's weight_scale_2 * s) and span activation maxima from 2.7e-12 to
// 2.7e18.
inline constexpr float kMinInputScale = 1e-15f;
inline constexpr float kMaxInputScale = 1e15f;
bool valid_input_scale(float value);
// The rule's wording for refusals: "a finite input_scale in [1e-15, 1e+15]
// (the calibrated activation amax / 2688)".
std::string input_scale_rule();

// Absolute maximum of a float array (NaN ignored).
float abs_max(const float* data, size_t count);

// Quantises W [rows, cols] (row-major float) the way ModelOpt does. The global
// scale is amax/2688 of this matrix unless `global_scale` is given (gate and
// up share one: pass the one computed from both). cols % 16 != 0 throws.
Nvfp4Matrix quantize_nvfp4(const float* weights, int64_t rows, int64_t cols,
                           std::optional<float> global_scale = std::nullopt);

// The ModelOpt tensor name of expert `expert_idx`'s projection `proj`
// ("gate_proj", "up_proj", "down_proj") field ("weight", "weight_scale",
// "weight_scale_2", "input_scale", "bias"), under `prefix` such as
// "model.layers.3.mlp.": "<prefix>experts.<e>.<proj>.<field>".
std::string expert_tensor_name(const std::string& prefix, int64_t expert_idx, const std::string& proj,
                               const std::string& field);

// Loads every expert under `prefix` from a .safetensors file or a checkpoint
// directory (model.safetensors.index.json for shards). Expert tensors are
// "<prefix>experts.<e>.{gate_proj,up_proj,down_proj}.*" or Mixtral's
// "<prefix>experts.<e>.{w1,w3,w2}.*" (gate, up, down). The configs of the
// directory (a file's own directory) are honoured: hf_quant_config.json (or
// config.json's quantization_config) must declare NVFP4 or W4A16_NVFP4 with
// group_size 16, for MIXED_PRECISION the layer's experts in quantized_layers;
// config.json's expert count (n_routed_experts, num_local_experts or
// num_experts) is the count expected, else the largest index found sets it.
// A shared expert is loaded when present: "<prefix>shared_experts.<proj>.*"
// (DeepSeek/GLM/Kimi) or "<prefix>shared_expert.<proj>.*" with
// "<prefix>shared_expert_gate.weight" (Qwen2-MoE, float [1, hidden]); a set
// with a projection, a field or its gate missing is refused.
// Every error is one line naming the tensor or file and what was expected.
MoeWeights load_moe_weights(const std::string& path, const std::string& prefix);

// Adds the layer's tensors in ModelOpt layout to a writer (the inverse of
// load_moe_weights), e.g. to make test checkpoints.
void add_moe_weights(SafetensorsWriter& writer, const MoeWeights& weights, const std::string& prefix);

}  // namespace fp4moe
