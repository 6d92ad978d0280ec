// A checkpoint's declared quantisation (docs/design.md §3):
// hf_quant_config.json's "quantization" object, or (without that file)
// config.json's quantization_config when ModelOpt wrote it; a single format
// must be one fp4moe loads (NVFP4 or W4A16_NVFP4, group size 16), a
// MIXED_PRECISION checkpoint is held to that per layer. Internal to
// src/format: the checkpoint reader (checkpoint_reader.cpp) reads it, the
// expert loader checks a layer against it.
//
// Tested in tests/format/test_quant_config.cpp.
#pragma once

#include <filesystem>
#include <optional>
#include <string>

#include <nlohmann/json.hpp>

#include "format/config_json.hpp"

namespace fp4moe {

struct QuantConfig {
  std::string where;                // the file and key it came from, for messages
  std::string quant_algo;           // "NVFP4", "W4A16_NVFP4" or "MIXED_PRECISION"
  nlohmann::json quantized_layers;  // MIXED_PRECISION: module name -> {"quant_algo", "group_size"}
};

// The quantisation the checkpoint directory `dir` declares:
// dir/hf_quant_config.json where it exists, else `config`'s
// quantization_config when ModelOpt wrote it; empty when neither declares
// one. Throws one line naming the file for a format fp4moe does not load.
std::optional<QuantConfig> read_declared_quantization(const std::filesystem::path& dir,
                                                      const std::optional<ConfigJson>& config);

// The format of the layer under `prefix`: the checkpoint's for a single
// format; for MIXED_PRECISION the one its experts listed in
// quantized_layers share, each NVFP4 or W4A16_NVFP4 with group size 16.
// Throws one line naming the layer otherwise.
std::string check_layer_format(const QuantConfig& config, const std::string& prefix);

}  // namespace fp4moe
