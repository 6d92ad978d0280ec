// The one reader of a checkpoint's config.json (docs/design.md §3): its
// language model's fields (a multimodal model's text_config) as typed
// values, the routed expert count, and the quantization_config ModelOpt
// writes there. The MoE fields per model family (model_config.cpp, and
// through the Python extension fp4moe.layer_config_from_hf) and the
// checkpoint reader's expert count and declared format
// (checkpoint_reader.cpp, quant_config.cpp) all read config.json through it.
// Also the JSON file reader of the checkpoint's other files
// (hf_quant_config.json, model.safetensors.index.json). Internal to
// src/format.
//
// Tested in tests/format/test_config_json.cpp, and through its users in
// tests/format/test_model_config.cpp and tests/format/test_quant_config.cpp.
#pragma once

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>

#include <nlohmann/json.hpp>

namespace fp4moe {

// A JSON file's value. Throws fp4moe::Error "<path>: cannot open" or
// "<path>: not valid JSON: <the parser's message>".
nlohmann::json read_json_file(const std::filesystem::path& path);

class ConfigJson {
 public:
  // The config.json at `path`, or its text (`where` names it in messages).
  // Throws one line naming it when it cannot be read, is not valid JSON or
  // is not a JSON object.
  static ConfigJson read(const std::filesystem::path& path);
  static ConfigJson parse(const std::string& json_text, const std::string& where);

  // The file read, for messages.
  const std::string& where() const { return where_; }

  // Typed reads of the language model's fields. A null value counts as
  // absent (configs write "n_shared_experts": null for "none"); a value of
  // another type or range throws, naming the file and the key.
  bool has(const char* key) const;
  std::optional<int64_t> positive_int(const char* key) const;
  std::optional<int64_t> count(const char* key) const;  // may be 0 (n_shared_experts)
  std::optional<double> number(const char* key) const;  // finite
  std::optional<bool> boolean(const char* key) const;
  std::optional<std::string> string(const char* key) const;

  // The language model's model_type, else (a multimodal model naming only
  // its own) the outer one; empty when neither says.
  std::string model_type() const;

  // The routed expert count, under the first key of n_routed_experts
  // (DeepSeek/GLM/Kimi), num_local_experts (Mixtral/gpt-oss), num_experts
  // (Qwen-MoE) the config gives; empty when it gives none (not an MoE
  // config). A count that is not a positive integer throws.
  struct ExpertCount {
    int64_t num_experts = 0;
    std::string key;  // the key that gave it, for messages
  };
  std::optional<ExpertCount> expert_count() const;

  // quantization_config when ModelOpt wrote it (quant_method "modelopt"),
  // else null: another quantiser's (compressed-tensors, ...) is not
  // ModelOpt's layout.
  nlohmann::json modelopt_quantization() const;

 private:
  ConfigJson(nlohmann::json file, std::string where);
  // The object the typed reads look in: text_config when it is an object.
  const nlohmann::json& text() const;
  bool nested() const;

  nlohmann::json file_;
  std::string where_;
};

}  // namespace fp4moe
