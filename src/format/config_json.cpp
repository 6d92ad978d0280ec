// The one reader of config.json, and of the checkpoint's JSON files
// (config_json.hpp).
// Tested in tests/format/test_config_json.cpp.
#include "format/config_json.hpp"

#include <cmath>
#include <fstream>
#include <utility>

#include "fp4moe/error.hpp"

namespace fp4moe {

using json = nlohmann::json;

json read_json_file(const std::filesystem::path& path) {
  std::ifstream in(path);
  FP4MOE_CHECK(in.good(), path.string(), ": cannot open");
  try {
    return json::parse(in);
  } catch (const json::exception& e) {
    FP4MOE_THROW(path.string(), ": not valid JSON: ", e.what());
  }
}

ConfigJson::ConfigJson(json file, std::string where) : file_(std::move(file)), where_(std::move(where)) {
  FP4MOE_CHECK(file_.is_object(), where_, ": expected a JSON object");
}

ConfigJson ConfigJson::read(const std::filesystem::path& path) {
  return ConfigJson(read_json_file(path), path.string());
}

ConfigJson ConfigJson::parse(const std::string& json_text, const std::string& where) {
  json file;
  try {
    file = json::parse(json_text);
  } catch (const json::exception& e) {
    FP4MOE_THROW(where, ": not valid JSON: ", e.what());
  }
  return ConfigJson(std::move(file), where);
}

// A multimodal model keeps its language model's fields in text_config.
bool ConfigJson::nested() const { return file_.contains("text_config") && file_["text_config"].is_object(); }

const json& ConfigJson::text() const { return nested() ? file_["text_config"] : file_; }

bool ConfigJson::has(const char* key) const { return text().contains(key) && !text()[key].is_null(); }

std::optional<int64_t> ConfigJson::positive_int(const char* key) const {
  if (!has(key)) return std::nullopt;
  const json& v = text()[key];
  FP4MOE_CHECK(v.is_number_integer() && v.get<int64_t>() > 0, where_, ": ", key, " is ", v.dump(),
               "; expected a positive integer");
  return v.get<int64_t>();
}

std::optional<int64_t> ConfigJson::count(const char* key) const {
  if (!has(key)) return std::nullopt;
  const json& v = text()[key];
  FP4MOE_CHECK(v.is_number_integer() && v.get<int64_t>() >= 0, where_, ": ", key, " is ", v.dump(),
               "; expected a non-negative integer");
  return v.get<int64_t>();
}

std::optional<double> ConfigJson::number(const char* key) const {
  if (!has(key)) return std::nullopt;
  const json& v = text()[key];
  FP4MOE_CHECK(v.is_number() && std::isfinite(v.get<double>()), where_, ": ", key, " is ", v.dump(),
               "; expected a finite number");
  return v.get<double>();
}

std::optional<bool> ConfigJson::boolean(const char* key) const {
  if (!has(key)) return std::nullopt;
  const json& v = text()[key];
  FP4MOE_CHECK(v.is_boolean(), where_, ": ", key, " is ", v.dump(), "; expected true or false");
  return v.get<bool>();
}

std::optional<std::string> ConfigJson::string(const char* key) const {
  if (!has(key)) return std::nullopt;
  const json& v = text()[key];
  FP4MOE_CHECK(v.is_string(), where_, ": ", key, " is ", v.dump(), "; expected a string");
  return v.get<std::string>();
}

std::string ConfigJson::model_type() const {
  if (const auto type = string("model_type")) return *type;
  if (nested() && file_.contains("model_type") && file_["model_type"].is_string())
    return file_["model_type"].get<std::string>();
  return {};
}

std::optional<ConfigJson::ExpertCount> ConfigJson::expert_count() const {
  for (const char* key : {"n_routed_experts", "num_local_experts", "num_experts"}) {
    if (!has(key)) continue;
    const json& v = text()[key];
    FP4MOE_CHECK(v.is_number_integer() && v.get<int64_t>() > 0, where_, ": ", key, " is ", v.dump(),
                 "; expected a positive expert count (a positive integer)");
    return ExpertCount{v.get<int64_t>(), key};
  }
  return std::nullopt;
}

json ConfigJson::modelopt_quantization() const {
  if (file_.contains("quantization_config") && file_["quantization_config"].is_object() &&
      file_["quantization_config"].contains("quant_method") &&
      file_["quantization_config"]["quant_method"] == "modelopt")
    return file_["quantization_config"];
  return nullptr;
}

}  // namespace fp4moe
