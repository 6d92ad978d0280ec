// The names of a ModelOpt checkpoint's MoE expert tensors
// (docs/design.md §3): "<prefix>experts.<e>.<proj>.<field>" with ModelOpt's
// projection names or Mixtral's, how an expert index is read back from a
// name, and the stacked (all experts in one tensor) names fp4moe refuses.
// expert_tensor_name itself is public (fp4moe/modelopt.hpp). Internal to
// src/format: shared by the expert loader (moe_weights_reader.cpp) and
// writer (checkpoint_writer.cpp).
//
// Tested in tests/format/test_moe_weights_reader.cpp (ExpertTensorName,
// MixtralNamesLoad, StackedExpertTensorsAreRefusedWithTheReason).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace fp4moe {

// ModelOpt's projection names, in the order gate, up, down.
inline constexpr const char* kProjNames[3] = {"gate_proj", "up_proj", "down_proj"};
// Mixtral's names for the same projections (gate, up, down), as ModelOpt
// exports them: block_sparse_moe.experts.<e>.{w1,w3,w2}.
inline constexpr const char* kMixtralProjNames[3] = {"w1", "w3", "w2"};
// The fields every NVFP4 matrix has (input_scale and bias are optional).
inline constexpr const char* kRequiredFields[3] = {"weight", "weight_scale", "weight_scale_2"};

// The expert index of "<prefix>experts.<e>.<rest>", or -1 when `name` is not
// shaped like that. Only canonical decimal indices count ("7", not "07").
int64_t parse_expert_index(const std::string& name, const std::string& prefix);

// The first tensor under `prefix` that stacks every expert in one tensor:
// "<prefix>experts.gate_up_proj" (transformers 5's fused layout) or
// "<prefix>experts.{gate_proj,up_proj,down_proj,...}.weight" (3-D stacks);
// empty when there is none.
std::string find_stacked_expert_tensor(const std::vector<std::string>& names, const std::string& prefix);

}  // namespace fp4moe
