// What the CLI needs of src/format's checkpoint reader beyond the public
// load_moe_weights: the tensor names of a checkpoint, read exactly as the
// loader reads them (implemented in src/format/modelopt.cpp). Internal:
// library users load layers, not file listings.
//
// Tested in tests/format/test_modelopt.cpp.
#pragma once

#include <string>
#include <vector>

namespace fp4moe {

// Every tensor name of a .safetensors file or a checkpoint directory (the
// shards its model.safetensors.index.json names, else all its *.safetensors
// files), sorted: what load_moe_weights(path, ...) can find there. Throws as
// the loader does: a missing path, an invalid index, an invalid or refused
// hf_quant_config.json or config.json, a tensor in two loose files.
std::vector<std::string> checkpoint_tensor_names(const std::string& path);

}  // namespace fp4moe
