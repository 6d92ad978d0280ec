// Writing an MoE layer in ModelOpt's checkpoint layout (docs/design.md §3),
// the inverse of load_moe_weights: every expert's NVFP4 matrices (weight,
// weight_scale, weight_scale_2, input_scale) and biases, and the shared
// expert (NVFP4, or unquantised as F32) with Qwen2-MoE's gate.
// Tested in tests/format/test_checkpoint_writer.cpp (the layout written,
// inconsistent weights refused) and by every round trip of
// tests/format/test_moe_weights_reader.cpp.
#include "format/expert_names.hpp"
#include "fp4moe/error.hpp"
#include "fp4moe/modelopt.hpp"
#include "fp4moe/nvfp4.hpp"

namespace fp4moe {

void add_moe_weights(SafetensorsWriter& writer, const MoeWeights& weights, const std::string& prefix) {
  FP4MOE_CHECK(static_cast<int64_t>(weights.experts.size()) == weights.num_experts, "add_moe_weights: num_experts is ",
               weights.num_experts, " but ", weights.experts.size(), " experts are given");
  const bool with_bias = weights.has_bias();
  for (int64_t e = 0; e < weights.num_experts; ++e) {
    const ExpertWeights& expert = weights.experts[static_cast<size_t>(e)];
    FP4MOE_CHECK(expert.gate.global_scale == expert.up.global_scale, "add_moe_weights: expert ", e,
                 ": gate global_scale ", expert.gate.global_scale, " differs from up global_scale ",
                 expert.up.global_scale,
                 "; ModelOpt shares one weight_scale_2 between gate and up "
                 "(quantise both with the scale of their joint amax)");
    const Nvfp4Matrix* matrices[3] = {&expert.gate, &expert.up, &expert.down};
    const std::vector<float>* biases[3] = {&expert.gate_bias, &expert.up_bias, &expert.down_bias};
    for (int p = 0; p < 3; ++p) {
      const Nvfp4Matrix& m = *matrices[p];
      const std::string proj = kProjNames[p];
      const int64_t rows = p < 2 ? weights.inter : weights.hidden;
      const int64_t cols = p < 2 ? weights.hidden : weights.inter;
      FP4MOE_CHECK(m.rows == rows && m.cols == cols, "add_moe_weights: expert ", e, " ", proj, " is [", m.rows, ", ",
                   m.cols, "], expected [", rows, ", ", cols, "]");
      FP4MOE_CHECK(cols % kNvfp4BlockSize == 0, "add_moe_weights: K = ", cols, " is not a multiple of ",
                   kNvfp4BlockSize);
      FP4MOE_CHECK(m.packed.size() == static_cast<size_t>(rows * cols / 2) &&
                       m.scales.size() == static_cast<size_t>(rows * cols / kNvfp4BlockSize),
                   "add_moe_weights: expert ", e, " ", proj, " has ", m.packed.size(), " packed bytes and ",
                   m.scales.size(), " scales, expected ", rows * cols / 2, " and ", rows * cols / kNvfp4BlockSize);
      auto name = [&](const char* field) { return expert_tensor_name(prefix, e, proj, field); };
      writer.add(name("weight"), DType::U8, {rows, cols / 2}, m.packed.data(), m.packed.size());
      writer.add(name("weight_scale"), DType::F8_E4M3, {rows, cols / kNvfp4BlockSize}, m.scales.data(),
                 m.scales.size());
      writer.add(name("weight_scale_2"), DType::F32, {}, &m.global_scale, sizeof(float));
      writer.add(name("input_scale"), DType::F32, {}, &m.input_scale, sizeof(float));
      if (with_bias) {
        const std::vector<float>& bias = *biases[p];
        FP4MOE_CHECK(static_cast<int64_t>(bias.size()) == rows, "add_moe_weights: expert ", e, " ", proj, " bias has ",
                     bias.size(), " elements, expected ", rows, " (expert 0 has biases, so every expert needs them)");
        writer.add(name("bias"), DType::F32, {rows}, bias.data(), bias.size() * sizeof(float));
      }
    }
  }
  if (!weights.shared_expert) return;
  // DeepSeek's names without a gate, Qwen2-MoE's with one.
  const SharedExpertWeights& shared = *weights.shared_expert;
  const bool gated = !shared.gate.empty();
  const std::string stem = prefix + (gated ? "shared_expert." : "shared_experts.");
  const int64_t S = shared.inter, H = weights.hidden;
  if (shared.dense()) {  // unquantised, as F32 tensors
    FP4MOE_CHECK(shared.dense_gate_up.size() == static_cast<size_t>(2 * S * H) &&
                     shared.dense_down.size() == static_cast<size_t>(H * S),
                 "add_moe_weights: the unquantised shared expert has ", shared.dense_gate_up.size(), " gate/up and ",
                 shared.dense_down.size(), " down values; expected ", 2 * S * H, " and ", H * S);
    writer.add(stem + "gate_proj.weight", DType::F32, {S, H}, shared.dense_gate_up.data(),
               static_cast<size_t>(S * H) * sizeof(float));
    writer.add(stem + "up_proj.weight", DType::F32, {S, H}, shared.dense_gate_up.data() + S * H,
               static_cast<size_t>(S * H) * sizeof(float));
    writer.add(stem + "down_proj.weight", DType::F32, {H, S}, shared.dense_down.data(),
               static_cast<size_t>(H * S) * sizeof(float));
  }
  const Nvfp4Matrix* matrices[3] = {&shared.mlp.gate, &shared.mlp.up, &shared.mlp.down};
  for (int p = 0; p < 3 && !shared.dense(); ++p) {
    const Nvfp4Matrix& m = *matrices[p];
    const int64_t rows = p < 2 ? shared.inter : weights.hidden;
    const int64_t cols = p < 2 ? weights.hidden : shared.inter;
    FP4MOE_CHECK(m.rows == rows && m.cols == cols && m.packed.size() == static_cast<size_t>(rows * cols / 2) &&
                     m.scales.size() == static_cast<size_t>(rows * cols / kNvfp4BlockSize),
                 "add_moe_weights: shared expert ", kProjNames[p], " is [", m.rows, ", ", m.cols, "] with ",
                 m.packed.size(), " packed bytes; expected [", rows, ", ", cols, "]");
    const std::string base = stem + kProjNames[p] + ".";
    writer.add(base + "weight", DType::U8, {rows, cols / 2}, m.packed.data(), m.packed.size());
    writer.add(base + "weight_scale", DType::F8_E4M3, {rows, cols / kNvfp4BlockSize}, m.scales.data(), m.scales.size());
    writer.add(base + "weight_scale_2", DType::F32, {}, &m.global_scale, sizeof(float));
    writer.add(base + "input_scale", DType::F32, {}, &m.input_scale, sizeof(float));
  }
  if (gated) {
    FP4MOE_CHECK(static_cast<int64_t>(shared.gate.size()) == weights.hidden, "add_moe_weights: shared expert gate has ",
                 shared.gate.size(), " values; expected hidden = ", weights.hidden);
    writer.add(prefix + "shared_expert_gate.weight", DType::F32, {1, weights.hidden}, shared.gate.data(),
               shared.gate.size() * sizeof(float));
  }
}

}  // namespace fp4moe
