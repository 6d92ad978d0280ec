// Activation numerics and GEMM input scales (docs/design.md §3): the names of
// ActivationNumerics, which numerics a layer's weights allow, and the rules
// that turn ModelOpt's per-projection input scales into the one scale each
// GEMM quantises its input with. Shared by the CPU reference and the GPU
// layer. Tested in tests/ref/test_reference.cpp.
#include <string>

#include "fp4moe/error.hpp"
#include "fp4moe/modelopt.hpp"  // valid_input_scale, input_scale_rule
#include "fp4moe/reference.hpp"

namespace fp4moe {

std::string to_string(ActivationNumerics numerics) {
  switch (numerics) {
    case ActivationNumerics::kCheckpoint:
      return "checkpoint";
    case ActivationNumerics::kBf16:
      return "bf16";
    case ActivationNumerics::kFp4:
      return "fp4";
  }
  FP4MOE_THROW("to_string: unknown ActivationNumerics ", static_cast<int>(numerics));
}

ActivationNumerics parse_activation_numerics(const std::string& name) {
  for (ActivationNumerics n : {ActivationNumerics::kCheckpoint, ActivationNumerics::kBf16, ActivationNumerics::kFp4})
    if (to_string(n) == name) return n;
  FP4MOE_THROW("activation numerics '", name, "' is not one of checkpoint, bf16, fp4");
}

ActivationNumerics resolve_activation_numerics(const MoeWeights& weights, ActivationNumerics requested) {
  FP4MOE_CHECK(requested == ActivationNumerics::kCheckpoint || requested == ActivationNumerics::kBf16 ||
                   requested == ActivationNumerics::kFp4,
               "unknown ActivationNumerics ", static_cast<int>(requested));
  if (requested == ActivationNumerics::kBf16) return requested;
  // The first expert matrix without an input_scale, if any.
  static const char* const kProj[3] = {"gate", "up", "down"};
  // The routed experts, then the shared expert (if any, and quantised: an
  // unquantised one runs with unquantised activations).
  const bool nvfp4_shared = weights.shared_expert && !weights.shared_expert->dense();
  const size_t num_mlps = weights.experts.size() + (nvfp4_shared ? 1 : 0);
  for (size_t e = 0; e < num_mlps; ++e) {
    const bool is_shared = e == weights.experts.size();
    const ExpertWeights& ex = is_shared ? weights.shared_expert->mlp : weights.experts[e];
    const Nvfp4Matrix* m[3] = {&ex.gate, &ex.up, &ex.down};
    for (int p = 0; p < 3; ++p) {
      if (m[p]->has_input_scale) continue;
      if (requested == ActivationNumerics::kCheckpoint) return ActivationNumerics::kBf16;
      FP4MOE_THROW("fp4 activations (W4A4) need an input_scale for every expert matrix; ",
                   is_shared ? std::string("the shared expert's") : "expert " + std::to_string(e), " ", kProj[p],
                   " has none (",
                   weights.checkpoint_format.empty() ? std::string("the checkpoint declares no format")
                                                     : "a " + weights.checkpoint_format + " checkpoint",
                   "): use bf16 activations");
    }
  }
  if (requested == ActivationNumerics::kFp4) return requested;
  return weights.checkpoint_format == "NVFP4" ? ActivationNumerics::kFp4 : ActivationNumerics::kBf16;
}

float gemm1_input_scale(const ExpertWeights& expert) {
  return gemm1_input_scale(expert.gate.input_scale, expert.up.input_scale);
}

float gemm1_input_scale(float gate_input_scale, float up_input_scale) {
  return std::max(gate_input_scale, up_input_scale);
}

int64_t input_scale_count(InputScaleExtent extent, int64_t num_experts) {
  switch (extent) {
    case InputScaleExtent::kPerExpert:
      return num_experts;
    case InputScaleExtent::kPerExpertGateUp:
      return 2 * num_experts;
    case InputScaleExtent::kPerLayer:
      return 1;
  }
  FP4MOE_THROW("input_scale_count: unknown InputScaleExtent ", static_cast<int>(extent));
}

std::vector<ExpertInputScales> stacked_input_scales(int64_t num_experts, const float* w13_input_scale,
                                                    InputScaleExtent w13_extent, const float* w2_input_scale,
                                                    InputScaleExtent w2_extent, const std::string& where) {
  FP4MOE_CHECK(w13_input_scale != nullptr && w2_input_scale != nullptr, where,
               ": give both w13_input_scale and w2_input_scale, or neither");
  FP4MOE_CHECK(w2_extent != InputScaleExtent::kPerExpertGateUp, where,
               ": w2_input_scale holds down_proj's input scales: one per expert or one for every expert, not "
               "[E, 2]");
  // The value at flat index i of a tensor of `extent`, checked.
  const auto value = [&](const float* tensor, const char* name, int64_t i, InputScaleExtent extent) {
    const float v = tensor[i];
    if (!valid_input_scale(v)) {
      const std::string index = extent == InputScaleExtent::kPerLayer ? ""
                                : extent == InputScaleExtent::kPerExpertGateUp
                                    ? detail::concat("[", i / 2, ", ", i % 2, "]")
                                    : detail::concat("[", i, "]");
      FP4MOE_THROW(where, ": ", name, index, " is ", v, "; expected ", input_scale_rule());
    }
    return v;
  };
  const auto at = [&](InputScaleExtent extent, int64_t e, int half) {
    switch (extent) {
      case InputScaleExtent::kPerExpert:
        return e;
      case InputScaleExtent::kPerExpertGateUp:
        return 2 * e + half;
      case InputScaleExtent::kPerLayer:
        return int64_t{0};
    }
    return int64_t{0};
  };
  std::vector<ExpertInputScales> out(static_cast<size_t>(num_experts));
  for (int64_t e = 0; e < num_experts; ++e) {
    ExpertInputScales& s = out[static_cast<size_t>(e)];
    s.gate = value(w13_input_scale, "w13_input_scale", at(w13_extent, e, 0), w13_extent);
    s.up = value(w13_input_scale, "w13_input_scale", at(w13_extent, e, 1), w13_extent);
    s.down = value(w2_input_scale, "w2_input_scale", at(w2_extent, e, 0), w2_extent);
  }
  return out;
}

ActivationNumerics resolve_stacked_activation_numerics(ActivationNumerics requested, bool has_w13_input_scale,
                                                       bool has_w2_input_scale, const std::string& where) {
  FP4MOE_CHECK(has_w13_input_scale == has_w2_input_scale, where,
               ": give both w13_input_scale and w2_input_scale, or neither");
  FP4MOE_CHECK(requested != ActivationNumerics::kFp4 || has_w13_input_scale, where,
               ": fp4 activations (W4A4) need w13_input_scale and w2_input_scale; none are given: use bf16 "
               "activations");
  if (requested == ActivationNumerics::kBf16 || !has_w13_input_scale) return ActivationNumerics::kBf16;
  FP4MOE_CHECK(requested == ActivationNumerics::kCheckpoint || requested == ActivationNumerics::kFp4,
               "unknown ActivationNumerics ", static_cast<int>(requested));
  return ActivationNumerics::kFp4;
}

}  // namespace fp4moe
