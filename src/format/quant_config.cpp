// A checkpoint's declared quantisation, read and held to the formats
// fp4moe loads (quant_config.hpp).
// Tested in tests/format/test_quant_config.cpp: each declared format
// (NVFP4, W4A16_NVFP4, MIXED_PRECISION, config.json's quantization_config)
// and one refusal per rule.
#include "format/quant_config.hpp"

#include <algorithm>
#include <cstdint>

#include "fp4moe/error.hpp"
#include "fp4moe/nvfp4.hpp"

namespace fp4moe {

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

// The formats whose expert tensors are the NVFP4 layout load_moe_weights
// reads. "NVFP4" (W4A4) also carries a calibrated input_scale for engines
// that quantise activations; fp4moe keeps activations bf16 (§3).
constexpr const char* kLoadableAlgos[2] = {"NVFP4", "W4A16_NVFP4"};
constexpr const char* kMixedPrecision = "MIXED_PRECISION";

bool is_loadable_algo(const std::string& algo) {
  return std::find(std::begin(kLoadableAlgos), std::end(kLoadableAlgos), algo) != std::end(kLoadableAlgos);
}

// The group size of a format entry: "group_size", or (config.json's
// quantization_config) the weights' group_size of its config groups.
std::optional<json> group_size_of(const json& q) {
  if (q.contains("group_size")) return q["group_size"];
  if (q.contains("config_groups") && q["config_groups"].is_object())
    for (const auto& [group_name, group] : q["config_groups"].items())
      if (group.is_object() && group.contains("weights") && group["weights"].is_object() &&
          group["weights"].contains("group_size"))
        return group["weights"]["group_size"];
  return std::nullopt;
}

// Refuses a format entry other than NVFP4 / W4A16_NVFP4 with group size 16;
// `what` names the entry ("quantization" or the layer).
void check_format(const json& q, const std::string& where, const std::string& what) {
  const json algo = q.contains("quant_algo") ? q["quant_algo"] : json();
  FP4MOE_CHECK(algo.is_string() && is_loadable_algo(algo.get<std::string>()), where, ": ", what, " is ",
               algo.is_null() ? std::string("missing its quant_algo") : "quant_algo " + algo.dump(),
               "; fp4moe loads \"NVFP4\" or \"W4A16_NVFP4\" experts (group_size 16)");
  const std::optional<json> group_size = group_size_of(q);
  FP4MOE_CHECK(group_size, where, ": ", what, " (", algo.get<std::string>(), ") gives no group_size; expected ",
               kNvfp4BlockSize);
  FP4MOE_CHECK(group_size->is_number_integer() && group_size->get<int64_t>() == kNvfp4BlockSize, where, ": ", what,
               " is ", algo.get<std::string>(), " with group_size ", group_size->dump(), "; expected ",
               kNvfp4BlockSize);
}

// Reads and checks a quantisation object: a single format must be loadable
// now; a MIXED_PRECISION checkpoint is checked per layer (check_layer_format).
QuantConfig parse_quant_config(const json& q, const std::string& where) {
  FP4MOE_CHECK(q.is_object(), where, ": expected an object with a \"quantization\" object");
  QuantConfig config;
  config.where = where;
  if (q.contains("quant_algo") && q["quant_algo"] == kMixedPrecision) {
    FP4MOE_CHECK(q.contains("quantized_layers") && q["quantized_layers"].is_object(), where,
                 ": quant_algo is \"MIXED_PRECISION\" but quantized_layers (layer -> format) is not an object");
    config.quant_algo = kMixedPrecision;
    config.quantized_layers = q["quantized_layers"];
    return config;
  }
  check_format(q, where, "quantization");
  config.quant_algo = q["quant_algo"].get<std::string>();
  return config;
}

// hf_quant_config.json as ModelOpt writes it:
//   {"quantization": {"quant_algo": "NVFP4", "group_size": 16, ...}, ...}
//   {"quantization": {"quant_algo": "MIXED_PRECISION",
//                     "quantized_layers": {"<module>": {"quant_algo": ..., "group_size": ...}}}}
QuantConfig read_hf_quant_config(const fs::path& path) {
  const json config = read_json_file(path);
  const std::string where = path.string();
  FP4MOE_CHECK(config.is_object() && config.contains("quantization") && config["quantization"].is_object(), where,
               ": expected an object with a \"quantization\" object");
  return parse_quant_config(config["quantization"], where);
}

}  // namespace

std::optional<QuantConfig> read_declared_quantization(const fs::path& dir, const std::optional<ConfigJson>& config) {
  if (fs::exists(dir / "hf_quant_config.json")) return read_hf_quant_config(dir / "hf_quant_config.json");
  if (!config) return std::nullopt;
  const json quantization = config->modelopt_quantization();
  if (quantization.is_null()) return std::nullopt;
  return parse_quant_config(quantization, config->where() + " (quantization_config)");
}

// The format of the layer under `prefix`: its own for a single-format
// checkpoint; for MIXED_PRECISION, every expert module of the layer listed in
// quantized_layers must be NVFP4 / W4A16_NVFP4 with group size 16. ModelOpt
// lists per-expert modules ("<prefix>experts.3.gate_proj") or, for a fused
// experts module (transformers 5), that module once ("<prefix>experts").
std::string check_layer_format(const QuantConfig& config, const std::string& prefix) {
  if (config.quant_algo != kMixedPrecision) return config.quant_algo;
  const std::string experts = prefix + "experts";
  std::string algo;
  for (const auto& [module, format] : config.quantized_layers.items()) {
    const bool fused = module == experts;
    if (!fused && module.compare(0, experts.size() + 1, experts + ".") != 0) continue;
    FP4MOE_CHECK(format.is_object(), config.where, ": quantized_layers[\"", module, "\"] is ", format.dump(),
                 "; expected an object with quant_algo and group_size");
    check_format(format, config.where, "layer '" + module + "'");
    const std::string layer_algo = format["quant_algo"].get<std::string>();
    FP4MOE_CHECK(algo.empty() || algo == layer_algo, config.where, ": layer '", module, "' is ", layer_algo,
                 " but another expert under prefix '", prefix, "' is ", algo,
                 "; fp4moe loads a layer whose experts share one format");
    algo = layer_algo;
  }
  FP4MOE_CHECK(!algo.empty(), config.where, ": this MIXED_PRECISION checkpoint lists no expert of prefix '", prefix,
               "' in quantized_layers: that layer's experts are not quantised; fp4moe loads NVFP4 experts");
  return algo;
}

}  // namespace fp4moe
