// NVFP4 quantisation in ModelOpt's order of operations, and the MoE expert
// tensors of a ModelOpt checkpoint: naming (ModelOpt's and Mixtral's),
// loading from a .safetensors file or a (sharded) checkpoint directory held
// to its hf_quant_config.json / config.json (format per layer, expert count)
// with validation of every tensor's dtype and shape, and writing them back
// (docs/design.md §3).
//
// Tested in tests/format/test_modelopt.cpp: quantise/dequantise error bounds
// on random data, idempotence, hand-computed bytes, save/load round trips
// (single file, sharded directory, Mixtral names), each declared format
// (NVFP4, W4A16_NVFP4, MIXED_PRECISION, config.json's quantization_config)
// and one test per error message. Loading is fuzzed by fuzz/fuzz_modelopt.cpp.
#include "fp4moe/modelopt.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <optional>
#include <sstream>

#include <nlohmann/json.hpp>

#include "format/checkpoint.hpp"
#include "fp4moe/error.hpp"
#include "fp4moe/model_config.hpp"
#include "fp4moe/nvfp4.hpp"

namespace fp4moe {

namespace fs = std::filesystem;
using json = nlohmann::json;

// ------------------------------------------------------------ quantisation

float Nvfp4Matrix::value(int64_t r, int64_t c) const {
  return nvfp4_dequantize_value(code(r, c), scale(r, c), global_scale);
}

std::vector<float> Nvfp4Matrix::dequantize() const {
  std::vector<float> out(static_cast<size_t>(rows * cols));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) out[static_cast<size_t>(r * cols + c)] = value(r, c);
  return out;
}

Nvfp4Matrix row_slice(const Nvfp4Matrix& m, int64_t begin, int64_t count) {
  Nvfp4Matrix out;
  out.rows = count;
  out.cols = m.cols;
  out.global_scale = m.global_scale;
  out.input_scale = m.input_scale;
  out.has_input_scale = m.has_input_scale;
  out.packed.assign(m.packed.begin() + begin * (m.cols / 2), m.packed.begin() + (begin + count) * (m.cols / 2));
  out.scales.assign(m.scales.begin() + begin * (m.cols / 16), m.scales.begin() + (begin + count) * (m.cols / 16));
  return out;
}

Nvfp4Matrix column_slice(const Nvfp4Matrix& m, int64_t begin, int64_t count) {
  Nvfp4Matrix out;
  out.rows = m.rows;
  out.cols = count;
  out.global_scale = m.global_scale;
  out.input_scale = m.input_scale;
  out.has_input_scale = m.has_input_scale;
  out.packed.resize(static_cast<size_t>(m.rows * count / 2));
  out.scales.resize(static_cast<size_t>(m.rows * count / 16));
  for (int64_t r = 0; r < m.rows; ++r) {
    std::copy_n(m.packed.begin() + r * (m.cols / 2) + begin / 2, count / 2, out.packed.begin() + r * (count / 2));
    std::copy_n(m.scales.begin() + r * (m.cols / 16) + begin / 16, count / 16, out.scales.begin() + r * (count / 16));
  }
  return out;
}

bool valid_input_scale(float value) {
  return std::isfinite(value) && value >= kMinInputScale && value <= kMaxInputScale;
}

std::string input_scale_rule() {
  return detail::concat("a finite input_scale in [", kMinInputScale, ", ", kMaxInputScale,
                        "] (the calibrated activation amax / 2688)");
}

float abs_max(const float* data, size_t count) {
  float amax = 0.0f;
  for (size_t i = 0; i < count; ++i) {
    const float a = std::fabs(data[i]);
    if (a > amax) amax = a;  // false for NaN, which is thereby ignored
  }
  return amax;
}

Nvfp4Matrix quantize_nvfp4(const float* weights, int64_t rows, int64_t cols,
                           std::optional<float> global_scale) {
  FP4MOE_CHECK(rows >= 0 && cols >= 0, "quantize_nvfp4: shape [", rows, ", ", cols,
               "] has a negative dimension");
  FP4MOE_CHECK(cols % kNvfp4BlockSize == 0, "quantize_nvfp4: cols (K) = ", cols,
               " is not a multiple of the NVFP4 block size ", kNvfp4BlockSize);
  const size_t count = static_cast<size_t>(rows * cols);
  FP4MOE_CHECK(weights != nullptr || count == 0, "quantize_nvfp4: weights is null for a [", rows,
               ", ", cols, "] matrix");
  // A non-finite weight would make the global scale (or a block scale)
  // meaningless; no checkpoint should contain one.
  for (size_t i = 0; i < count; ++i)
    FP4MOE_CHECK(std::isfinite(weights[i]), "quantize_nvfp4: weight [", i / cols, ", ",
                 i % cols, "] is ", weights[i], "; expected finite values");

  const float amax = abs_max(weights, count);
  const float s2 = global_scale ? *global_scale : nvfp4_global_scale(amax);
  FP4MOE_CHECK(std::isfinite(s2) && s2 >= 0.0f, "quantize_nvfp4: global scale ", s2,
               " is not a finite non-negative number");
  FP4MOE_CHECK(s2 > 0.0f || amax == 0.0f, "quantize_nvfp4: global scale 0 given for a matrix "
               "with abs max ", amax, "; expected amax / 2688 or more");

  Nvfp4Matrix m;
  m.rows = rows;
  m.cols = cols;
  m.global_scale = s2;
  m.packed.assign(count / 2, 0);
  m.scales.assign(count / kNvfp4BlockSize, 0);
  for (size_t block = 0; block < m.scales.size(); ++block) {
    const float* x = weights + block * kNvfp4BlockSize;
    const uint8_t ws = nvfp4_block_scale(abs_max(x, kNvfp4BlockSize), s2);
    m.scales[block] = ws;
    uint8_t* out = m.packed.data() + block * (kNvfp4BlockSize / 2);
    for (int i = 0; i < kNvfp4BlockSize; i += 2) {
      const uint8_t even = nvfp4_quantize_value(x[i], ws, s2);
      const uint8_t odd = nvfp4_quantize_value(x[i + 1], ws, s2);
      out[i / 2] = static_cast<uint8_t>(even | (odd << 4));
    }
  }
  return m;
}

// ------------------------------------------------------------ tensor names

std::string expert_tensor_name(const std::string& prefix, int64_t expert_idx,
                               const std::string& proj, const std::string& field) {
  return prefix + "experts." + std::to_string(expert_idx) + "." + proj + "." + field;
}

namespace {

constexpr const char* kProjNames[3] = {"gate_proj", "up_proj", "down_proj"};
// Mixtral's names for the same projections (gate, up, down), as ModelOpt
// exports them: block_sparse_moe.experts.<e>.{w1,w3,w2}.
constexpr const char* kMixtralProjNames[3] = {"w1", "w3", "w2"};
constexpr const char* kRequiredFields[3] = {"weight", "weight_scale", "weight_scale_2"};

std::string describe(DType dtype, const std::vector<int64_t>& shape) {
  return std::string(dtype_name(dtype)) + " " + shape_to_string(shape);
}

// The expert index of "<prefix>experts.<e>.<rest>", or -1 when `name` is not
// shaped like that. Only canonical decimal indices count ("7", not "07").
int64_t parse_expert_index(const std::string& name, const std::string& prefix) {
  const std::string head = prefix + "experts.";
  if (name.size() <= head.size() || name.compare(0, head.size(), head) != 0) return -1;
  size_t pos = head.size();
  const size_t digits_begin = pos;
  while (pos < name.size() && name[pos] >= '0' && name[pos] <= '9') ++pos;
  const size_t num_digits = pos - digits_begin;
  if (num_digits == 0 || num_digits > 9) return -1;
  if (num_digits > 1 && name[digits_begin] == '0') return -1;
  if (pos + 1 >= name.size() || name[pos] != '.') return -1;
  return std::stoll(name.substr(digits_begin, num_digits));
}

json read_json_file(const fs::path& path) {
  std::ifstream in(path);
  FP4MOE_CHECK(in.good(), path.string(), ": cannot open");
  try {
    return json::parse(in);
  } catch (const json::exception& e) {
    FP4MOE_THROW(path.string(), ": not valid JSON: ", e.what());
  }
}

// The weight_map of a sharded checkpoint's model.safetensors.index.json:
// tensor name -> shard path (the index's directory joined with the file name
// it gives). The one reader of the index: the CLI lists a checkpoint's
// tensors through checkpoint_tensor_names (format/checkpoint.hpp).
std::map<std::string, std::string> read_safetensors_index(const fs::path& index_path) {
  const json index = read_json_file(index_path);
  const std::string where = index_path.string();
  FP4MOE_CHECK(index.is_object() && index.contains("weight_map") && index["weight_map"].is_object(),
               where, ": expected an object with a \"weight_map\" object (tensor name -> shard file)");
  std::map<std::string, std::string> shard_of;
  for (const auto& [name, file] : index["weight_map"].items()) {
    FP4MOE_CHECK(file.is_string(), where, ": weight_map[\"", name, "\"] is ", file.dump(),
                 "; expected a shard file name");
    // The index comes with the checkpoint: it may only name files inside the
    // checkpoint's directory, never make the loader open one elsewhere.
    const fs::path shard = file.get<std::string>();
    const bool inside = !shard.empty() && shard.is_relative() &&
                        std::none_of(shard.begin(), shard.end(),
                                     [](const fs::path& part) { return part == ".."; });
    FP4MOE_CHECK(inside, where, ": weight_map[\"", name, "\"] is ", file.dump(),
                 "; expected the name of a shard file inside the checkpoint directory");
    shard_of.emplace(name, (index_path.parent_path() / shard).string());
  }
  return shard_of;
}

// The formats whose expert tensors are the NVFP4 layout load_moe_weights
// reads. "NVFP4" (W4A4) also carries a calibrated input_scale for engines
// that quantise activations; fp4moe keeps activations bf16 (§3).
constexpr const char* kLoadableAlgos[2] = {"NVFP4", "W4A16_NVFP4"};
constexpr const char* kMixedPrecision = "MIXED_PRECISION";

bool is_loadable_algo(const std::string& algo) {
  return std::find(std::begin(kLoadableAlgos), std::end(kLoadableAlgos), algo) != std::end(kLoadableAlgos);
}

// A checkpoint's declared quantisation: hf_quant_config.json's
// "quantization" object, or (without that file) config.json's
// quantization_config when its quant_method is "modelopt".
struct QuantConfig {
  std::string where;       // the file and key it came from, for messages
  std::string quant_algo;  // "NVFP4", "W4A16_NVFP4" or "MIXED_PRECISION"
  json quantized_layers;   // MIXED_PRECISION: module name -> {"quant_algo", "group_size"}
};

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
  FP4MOE_CHECK(group_size, where, ": ", what, " (", algo.get<std::string>(),
               ") gives no group_size; expected ", kNvfp4BlockSize);
  FP4MOE_CHECK(group_size->is_number_integer() && group_size->get<int64_t>() == kNvfp4BlockSize, where, ": ",
               what, " is ", algo.get<std::string>(), " with group_size ", group_size->dump(), "; expected ",
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
  FP4MOE_CHECK(config.is_object() && config.contains("quantization") && config["quantization"].is_object(),
               where, ": expected an object with a \"quantization\" object");
  return parse_quant_config(config["quantization"], where);
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
  FP4MOE_CHECK(!algo.empty(), config.where, ": this MIXED_PRECISION checkpoint lists no expert of prefix '",
               prefix, "' in quantized_layers: that layer's experts are not quantised; fp4moe loads NVFP4 experts");
  return algo;
}

// config.json beside the checkpoint: the declared quantisation (used when
// there is no hf_quant_config.json) and the expert count.
struct ModelConfig {
  std::string where;
  json modelopt_quantization;  // quantization_config when ModelOpt wrote it, else null
  std::optional<int64_t> num_experts;
  std::string num_experts_key;  // the key that gave it, for messages
};

// The keys MoE configs give the routed expert count under: DeepSeek/GLM/Kimi,
// Mixtral/gpt-oss, Qwen-MoE.
constexpr const char* kNumExpertsKeys[3] = {"n_routed_experts", "num_local_experts", "num_experts"};

ModelConfig read_model_config(const fs::path& path) {
  const json file = read_json_file(path);
  ModelConfig config;
  config.where = path.string();
  FP4MOE_CHECK(file.is_object(), config.where, ": expected a JSON object");
  // Another quantiser's config (compressed-tensors, ...) is not ModelOpt's
  // layout; its tensors are refused by name if they are not NVFP4.
  if (file.contains("quantization_config") && file["quantization_config"].is_object() &&
      file["quantization_config"].contains("quant_method") &&
      file["quantization_config"]["quant_method"] == "modelopt")
    config.modelopt_quantization = file["quantization_config"];
  // A multimodal model keeps its language model's fields in text_config.
  const json& text = file.contains("text_config") && file["text_config"].is_object() ? file["text_config"] : file;
  for (const char* key : kNumExpertsKeys) {
    if (!text.contains(key) || text[key].is_null()) continue;
    FP4MOE_CHECK(text[key].is_number_integer() && text[key].get<int64_t>() > 0, config.where, ": ", key, " is ",
                 text[key].dump(), "; expected a positive expert count");
    config.num_experts = text[key].get<int64_t>();
    config.num_experts_key = key;
    break;
  }
  return config;
}

// Every tensor of a checkpoint, wherever it lives: one .safetensors file, the
// shards named by model.safetensors.index.json, or all *.safetensors files of
// a directory. Shards are opened (memory-mapped) only when a tensor in them
// is asked for, so loading one layer touches only its shards.
class TensorSource {
 public:
  explicit TensorSource(const std::string& path) : path_(path) {
    std::error_code ec;
    const fs::file_status status = fs::status(path, ec);
    FP4MOE_CHECK(!ec && fs::exists(status), path, ": no such file or directory");
    // A single shard of a checkpoint directory is held to the directory's
    // configs too.
    const bool is_dir = fs::is_directory(status);
    const fs::path dir = is_dir ? fs::path(path) : fs::path(path).parent_path();
    if (fs::exists(dir / "config.json")) model_config_ = read_model_config(dir / "config.json");
    if (fs::exists(dir / "hf_quant_config.json"))
      quant_config_ = read_hf_quant_config(dir / "hf_quant_config.json");
    else if (model_config_ && !model_config_->modelopt_quantization.is_null())
      quant_config_ = parse_quant_config(model_config_->modelopt_quantization,
                                         model_config_->where + " (quantization_config)");
    if (is_dir) {
      open_directory(dir);
    } else {
      add_file(path, true);
      // The shards beside it, to say where a tensor missing here is.
      if (fs::exists(dir / "model.safetensors.index.json"))
        directory_index_ = read_safetensors_index(dir / "model.safetensors.index.json");
    }
  }

  // For a file given inside a sharded checkpoint: "; <index> puts it in
  // <shard>: ..." when the directory's index places `name` in another shard,
  // else empty.
  std::string where_else(const std::string& name) const {
    const auto it = directory_index_.find(name);
    if (it == directory_index_.end()) return {};
    return detail::concat("; the directory's model.safetensors.index.json puts it in ", it->second,
                          ": pass the directory to load the whole layer");
  }

  // The declared quantisation and config.json, where the checkpoint has them.
  const std::optional<QuantConfig>& quant_config() const { return quant_config_; }
  const std::optional<ModelConfig>& model_config() const { return model_config_; }

  // Every tensor name, in a stable order (sorted).
  const std::vector<std::string>& names() const { return names_; }
  bool contains(const std::string& name) const { return shard_of_.count(name) != 0; }

  // The tensor and the file it is in; the view lives as long as this source.
  std::pair<const TensorView*, const std::string*> get(const std::string& name) {
    const auto it = shard_of_.find(name);
    FP4MOE_CHECK(it != shard_of_.end(), path_, ": no tensor named '", name, "'");
    Shard& shard = shards_[it->second];
    if (!shard.file) shard.file = std::make_unique<SafetensorsFile>(SafetensorsFile::open(shard.path));
    FP4MOE_CHECK(shard.file->contains(name), shard.path, ": has no tensor '", name, "', but ",
                 path_, " lists it in this shard");
    return {&shard.file->get(name), &shard.path};
  }

 private:
  struct Shard {
    std::string path;
    std::unique_ptr<SafetensorsFile> file;  // opened on first use
  };

  void open_directory(const fs::path& dir) {
    const fs::path index_path = dir / "model.safetensors.index.json";
    if (fs::exists(index_path)) {
      std::map<std::string, size_t> shard_idx;
      for (const auto& [name, shard_path] : read_safetensors_index(index_path)) {
        auto [it, inserted] = shard_idx.emplace(shard_path, shards_.size());
        if (inserted) shards_.push_back(Shard{shard_path, nullptr});
        shard_of_.emplace(name, it->second);
        names_.push_back(name);
      }
      std::sort(names_.begin(), names_.end());
      return;
    }
    std::vector<fs::path> files;
    for (const fs::directory_entry& entry : fs::directory_iterator(dir))
      if (entry.is_regular_file() && entry.path().extension() == ".safetensors")
        files.push_back(entry.path());
    FP4MOE_CHECK(!files.empty(), dir.string(),
                 ": no *.safetensors file and no model.safetensors.index.json");
    std::sort(files.begin(), files.end());
    for (const fs::path& file : files) add_file(file.string(), false);
    std::sort(names_.begin(), names_.end());
  }

  void add_file(const std::string& file, bool sort_names) {
    const size_t idx = shards_.size();
    shards_.push_back(Shard{file, std::make_unique<SafetensorsFile>(SafetensorsFile::open(file))});
    for (const std::string& name : shards_[idx].file->names()) {
      const auto [it, inserted] = shard_of_.emplace(name, idx);
      FP4MOE_CHECK(inserted, path_, ": tensor '", name, "' is in both ", shards_[it->second].path,
                   " and ", file, "; add a model.safetensors.index.json to say which to use");
      names_.push_back(name);
    }
    if (sort_names) std::sort(names_.begin(), names_.end());
  }

  std::string path_;
  std::optional<QuantConfig> quant_config_;
  std::optional<ModelConfig> model_config_;
  std::map<std::string, std::string> directory_index_;  // a file's directory's index, else empty
  std::vector<Shard> shards_;
  std::map<std::string, size_t> shard_of_;  // tensor name -> index into shards_
  std::vector<std::string> names_;
};

// Enough digits to tell any two floats apart.
std::string exact(float value) {
  std::ostringstream os;
  os.precision(9);
  os << value;
  return os.str();
}

// A 0-d or [1] F32 scale (dtype and shape already checked). ModelOpt's
// scales are amax / constant: finite and never negative (0 for an all-zero
// tensor).
float read_f32_scale(const TensorView& view, const std::string& path) {
  float value;
  std::memcpy(&value, view.data, sizeof value);  // safetensors data is little-endian, as is the host
  FP4MOE_CHECK(std::isfinite(value) && value >= 0.0f, path, ": tensor '", view.name, "' is ", value,
               "; expected a finite, non-negative scale");
  return value;
}

// Calibrated activation amax / 2688, as ModelOpt exports it (valid_input_scale).
float read_input_scale(const TensorView& view, const std::string& path) {
  float value;
  std::memcpy(&value, view.data, sizeof value);
  FP4MOE_CHECK(valid_input_scale(value), path, ": tensor '", view.name, "' is ", value, "; expected ",
               input_scale_rule());
  return value;
}

// Collects dtype/shape mismatches over the whole layer, so that the one-line
// error names the first and counts the rest (a wrong dtype usually repeats in
// every expert).
class Problems {
 public:
  template <typename... Args>
  void add(const Args&... args) {
    if (count_++ == 0) first_ = detail::concat(args...);
  }
  void throw_if_any(const std::string& path, const std::string& prefix) const {
    if (count_ == 0) return;
    FP4MOE_THROW(path, ": ", first_,
                 count_ > 1 ? detail::concat(" (and ", count_ - 1, " more expert tensor(s) under prefix '", prefix,
                                             "' do not match the ModelOpt NVFP4 layout)")
                            : std::string());
  }

 private:
  size_t count_ = 0;
  std::string first_;
};

// The first tensor under `prefix` that stacks every expert in one tensor:
// "<prefix>experts.gate_up_proj" (transformers 5's fused layout) or
// "<prefix>experts.{gate_proj,up_proj,down_proj,...}.weight" (3-D stacks);
// empty when there is none.
std::string find_stacked_expert_tensor(const std::vector<std::string>& names, const std::string& prefix) {
  const std::string head = prefix + "experts.";
  for (const std::string& name : names)
    if (name.size() > head.size() && name.compare(0, head.size(), head) == 0 &&
        !(name[head.size()] >= '0' && name[head.size()] <= '9'))
      return name;
  return {};
}

// A float tensor's values (F32, BF16, F16) after its dtype and shape are
// checked; `what` says what it is for the message.
std::vector<float> read_float_tensor(TensorSource& source, const std::string& path, const std::string& name,
                                     const std::vector<int64_t>& shape, const char* what) {
  const auto [view, file] = source.get(name);
  const bool float_dtype = view->dtype == DType::F32 || view->dtype == DType::BF16 || view->dtype == DType::F16;
  FP4MOE_CHECK(float_dtype && view->shape == shape, path, ": tensor '", name, "' (in ", *file, ") is ",
               describe(view->dtype, view->shape), "; expected F32, BF16 or F16 ", shape_to_string(shape), " (",
               what, ")");
  const size_t count = static_cast<size_t>(view->numel());
  std::vector<float> values(count);
  for (size_t i = 0; i < count; ++i) {
    if (view->dtype == DType::F32) {
      std::memcpy(&values[i], view->data + i * 4, 4);
    } else {
      uint16_t h;
      std::memcpy(&h, view->data + i * 2, 2);
      values[i] = view->dtype == DType::BF16 ? bf16_to_float(h) : f16_to_float(h);
    }
  }
  const auto bad = std::find_if(values.begin(), values.end(), [](float v) { return !std::isfinite(v); });
  FP4MOE_CHECK(bad == values.end(), path, ": tensor '", name, "' element ", bad - values.begin(), " is ",
               bad == values.end() ? 0.0f : *bad, "; expected finite values (", what, ")");
  return values;
}

}  // namespace

std::vector<std::string> checkpoint_tensor_names(const std::string& path) {
  return TensorSource(path).names();
}

// ------------------------------------------------------------------ loading

MoeWeights load_moe_weights(const std::string& path, const std::string& prefix) {
  TensorSource source(path);

  // Discover the experts under the prefix and their projection names
  // (gate_proj/up_proj/down_proj, or Mixtral's w1/w3/w2).
  int64_t max_expert_idx = -1;
  bool any_bias = false, mixtral_names = false;
  for (const std::string& name : source.names()) {
    const int64_t e = parse_expert_index(name, prefix);
    if (e < 0) continue;
    max_expert_idx = std::max(max_expert_idx, e);
    if (name.size() >= 5 && name.compare(name.size() - 5, 5, ".bias") == 0) any_bias = true;
    const size_t proj_at = prefix.size() + std::string("experts.").size() + std::to_string(e).size() + 1;
    for (const char* proj : kMixtralProjNames)
      if (name.compare(proj_at, std::strlen(proj) + 1, std::string(proj) + ".") == 0) mixtral_names = true;
  }
  if (max_expert_idx < 0) {
    const std::string stacked = find_stacked_expert_tensor(source.names(), prefix);
    FP4MOE_CHECK(stacked.empty(), path, ": the experts under prefix '", prefix,
                 "' are stacked expert tensors (all experts in one tensor, e.g. '", stacked,
                 "'); fp4moe loads per-expert tensors '", expert_tensor_name(prefix, 0, "gate_proj", "weight"),
                 "', as ModelOpt exports them",
                 // <proj>.weight stacks are the ones `fp4moe quantize` splits.
                 stacked.size() > 7 && stacked.compare(stacked.size() - 7, 7, ".weight") == 0
                     ? " ('fp4moe quantize IN OUT' writes float stacks that way)"
                     : "");
    std::string example;
    for (const std::string& name : source.names()) {
      const size_t at = name.find("experts.");
      if (at != std::string::npos && (at == 0 || name[at - 1] == '.')) {
        example = detail::concat("; a tensor that looks like an expert's: '", name,
                                 "' (prefix '", name.substr(0, at), "'?)");
        break;
      }
    }
    FP4MOE_THROW(path, ": no expert tensors under prefix '", prefix, "' (looked for '",
                 expert_tensor_name(prefix, 0, "gate_proj", "weight"), "' and '",
                 expert_tensor_name(prefix, 0, "w1", "weight"), "')",
                 example.empty() ? std::string("; no tensor name contains 'experts.'") : example);
  }
  const char* const* proj_names = mixtral_names ? kMixtralProjNames : kProjNames;

  MoeWeights weights;
  if (source.quant_config()) weights.checkpoint_format = check_layer_format(*source.quant_config(), prefix);

  // The expert count: config.json's where the checkpoint has one (so that a
  // missing last expert is noticed), else the largest index found plus one.
  std::string count_source = detail::concat("the largest expert index under prefix '", prefix, "' is ",
                                            max_expert_idx);
  int64_t num_experts = max_expert_idx + 1;
  if (source.model_config() && source.model_config()->num_experts) {
    const ModelConfig& config = *source.model_config();
    num_experts = *config.num_experts;
    count_source = detail::concat(config.where, " says ", config.num_experts_key, " = ", num_experts);
    FP4MOE_CHECK(max_expert_idx < num_experts, path, ": tensors of expert ", max_expert_idx, " under prefix '",
                 prefix, "', but ", count_source, " (experts 0..", num_experts - 1, ")");
  }

  // Every expert 0..E-1 must have every required tensor; report the first gap.
  for (int64_t e = 0; e < num_experts; ++e)
    for (int p = 0; p < 3; ++p) {
      const char* proj = proj_names[p];
      for (const char* field : kRequiredFields) {
        const std::string name = expert_tensor_name(prefix, e, proj, field);
        FP4MOE_CHECK(source.contains(name), path, ": missing tensor '", name, "' (", count_source,
                     ", so experts 0..", num_experts - 1, " must all be complete)", source.where_else(name));
      }
      if (any_bias) {
        const std::string name = expert_tensor_name(prefix, e, proj, "bias");
        FP4MOE_CHECK(source.contains(name), path, ": missing tensor '", name,
                     "' (other experts under prefix '", prefix, "' have biases)");
      }
    }

  // Shapes follow from expert 0's gate weight, U8 [inter, hidden / 2].
  const std::string shape_source = expert_tensor_name(prefix, 0, proj_names[0], "weight");
  const TensorView& gate0 = *source.get(shape_source).first;
  FP4MOE_CHECK(gate0.dtype == DType::U8 && gate0.shape.size() == 2, path, ": tensor '",
               shape_source, "' is ", describe(gate0.dtype, gate0.shape),
               "; expected U8 [inter, hidden / 2] (packed fp4)");
  // A non-empty tensor's extents are bounded by the file's size (its bytes
  // are in it), so 2 * shape[1] below cannot overflow; an empty one may
  // claim any extent.
  FP4MOE_CHECK(gate0.shape[0] > 0 && gate0.shape[1] > 0, path, ": tensor '", shape_source, "' ",
               shape_to_string(gate0.shape), " is empty; expected U8 [inter, hidden / 2] with inter "
               "and hidden positive multiples of ", kNvfp4BlockSize);
  weights.num_experts = num_experts;
  weights.inter = gate0.shape[0];
  weights.hidden = gate0.shape[1] * 2;
  FP4MOE_CHECK(weights.hidden % kNvfp4BlockSize == 0 && weights.inter % kNvfp4BlockSize == 0 &&
                   weights.hidden > 0 && weights.inter > 0,
               path, ": tensor '", shape_source, "' ", shape_to_string(gate0.shape), " gives hidden = ",
               weights.hidden, " and inter = ", weights.inter,
               "; both must be positive multiples of ", kNvfp4BlockSize);

  Problems problems;
  // Checks dtype and shape; returns the view when they match, else null.
  auto checked = [&](const std::string& name, std::initializer_list<DType> dtypes,
                     std::vector<std::vector<int64_t>> shapes) -> const TensorView* {
    const auto [view, file] = source.get(name);
    const bool dtype_ok = std::find(dtypes.begin(), dtypes.end(), view->dtype) != dtypes.end();
    const bool shape_ok = std::find(shapes.begin(), shapes.end(), view->shape) != shapes.end();
    if (dtype_ok && shape_ok) return view;
    std::string expected;
    for (DType dtype : dtypes) expected += (expected.empty() ? "" : " or ") + std::string(dtype_name(dtype));
    expected += " ";
    for (size_t i = 0; i < shapes.size(); ++i)
      expected += (i ? " or " : "") + shape_to_string(shapes[i]);
    problems.add("'", name, "' (in ", *file, "): expected ", expected, ", found ",
                 describe(view->dtype, view->shape));
    return nullptr;
  };

  // Reads one NVFP4 matrix (m.rows, m.cols set) from the tensors name(field)
  // into m; returns its weight_scale_2 as read (for the gate/up check), or
  // nothing when a problem was recorded for it.
  const auto read_matrix = [&](const auto& name, Nvfp4Matrix& m) -> std::optional<float> {
    std::optional<float> scale_2;
    if (const TensorView* v = checked(name("weight"), {DType::U8}, {{m.rows, m.cols / 2}}))
      m.packed.assign(v->data, v->data + v->nbytes);
    if (const TensorView* v = checked(name("weight_scale"), {DType::F8_E4M3}, {{m.rows, m.cols / kNvfp4BlockSize}})) {
      m.scales.assign(v->data, v->data + v->nbytes);
      const auto nan = std::find_if(m.scales.begin(), m.scales.end(), e4m3_is_nan);
      if (nan != m.scales.end())
        problems.add("'", name("weight_scale"), "': element ", nan - m.scales.begin(), " is an e4m3 NaN");
    }
    // ModelOpt writes 0-d scalars; other exporters write shape [1].
    if (const TensorView* v = checked(name("weight_scale_2"), {DType::F32}, {{}, {1}})) {
      m.global_scale = read_f32_scale(*v, path);
      scale_2 = m.global_scale;
    }
    // input_scale is optional (W4A16 exports have none): 1.0 and
    // has_input_scale false when absent.
    if (source.contains(name("input_scale"))) {
      if (const TensorView* v = checked(name("input_scale"), {DType::F32}, {{}, {1}})) {
        m.input_scale = read_input_scale(*v, path);
        m.has_input_scale = true;
      }
    }
    return scale_2;
  };

  const int64_t H = weights.hidden, I = weights.inter;
  weights.experts.resize(static_cast<size_t>(num_experts));
  for (int64_t e = 0; e < num_experts; ++e) {
    ExpertWeights& expert = weights.experts[static_cast<size_t>(e)];
    Nvfp4Matrix* matrices[3] = {&expert.gate, &expert.up, &expert.down};
    std::vector<float>* biases[3] = {&expert.gate_bias, &expert.up_bias, &expert.down_bias};
    std::optional<float> scale_2[3];  // as read, for the gate/up comparison
    for (int p = 0; p < 3; ++p) {
      const std::string proj = proj_names[p];
      Nvfp4Matrix& m = *matrices[p];
      m.rows = p < 2 ? I : H;
      m.cols = p < 2 ? H : I;
      auto name = [&](const char* field) { return expert_tensor_name(prefix, e, proj, field); };

      scale_2[p] = read_matrix(name, m);
      if (any_bias) {
        if (const TensorView* v = checked(name("bias"), {DType::F32, DType::BF16}, {{m.rows}})) {
          biases[p]->resize(static_cast<size_t>(m.rows));
          for (int64_t i = 0; i < m.rows; ++i) {
            float& out = (*biases[p])[static_cast<size_t>(i)];
            if (v->dtype == DType::F32) {
              std::memcpy(&out, v->data + i * 4, 4);
            } else {
              uint16_t h;
              std::memcpy(&h, v->data + i * 2, 2);
              out = bf16_to_float(h);
            }
          }
          // A NaN or infinite bias would poison every token routed to the
          // expert without a word; report the first.
          const auto bad = std::find_if(biases[p]->begin(), biases[p]->end(),
                                        [](float b) { return !std::isfinite(b); });
          if (bad != biases[p]->end())
            problems.add("'", name("bias"), "': element ", bad - biases[p]->begin(), " is ", *bad,
                         "; expected finite biases");
        }
      }
    }
    if (scale_2[0] && scale_2[1] && *scale_2[0] != *scale_2[1])
      problems.add("'", expert_tensor_name(prefix, e, proj_names[0], "weight_scale_2"), "' = ",
                   exact(*scale_2[0]), " differs from '",
                   expert_tensor_name(prefix, e, proj_names[1], "weight_scale_2"), "' = ",
                   exact(*scale_2[1]), "; ModelOpt shares one weight_scale_2 between gate and up");
  }
  problems.throw_if_any(path, prefix);

  // The shared expert, whole or not at all: DeepSeek/GLM/Kimi's
  // "shared_experts." or Qwen2-MoE's gated "shared_expert.".
  const std::string gate_name = prefix + "shared_expert_gate.weight";
  std::string stem;
  for (const std::string& candidate : {prefix + "shared_experts.", prefix + "shared_expert."})
    for (const std::string& name : source.names())
      if (stem.empty() && name.compare(0, candidate.size(), candidate) == 0) stem = candidate;
  FP4MOE_CHECK(!stem.empty() || !source.contains(gate_name), path, ": '", gate_name,
               "' but no shared expert for it to gate (expected '", prefix, "shared_expert.gate_proj.weight')");
  if (stem.empty()) return weights;
  const bool gated = stem == prefix + "shared_expert.";
  // Qwen2-MoE's gate, nn.Linear(hidden, 1): [1, hidden]; a flat [hidden] is read too.
  auto read_shared_gate = [&] {
    FP4MOE_CHECK(source.contains(gate_name), path, ": missing tensor '", gate_name, "' (a Qwen2-MoE shared expert '",
                 stem, "*' is scaled by sigmoid(shared_expert_gate · x))");
    const TensorView& g = *source.get(gate_name).first;
    const std::vector<int64_t> shape = g.shape.size() == 1 ? std::vector<int64_t>{H} : std::vector<int64_t>{1, H};
    return read_float_tensor(source, path, gate_name, shape, "the shared expert's gate");
  };
  // A shared expert left in high precision (ModelOpt's experts-only configs
  // quantise the routed experts alone) is refused by name, not as a missing
  // scale: the layer runs it as extra NVFP4 experts of the same GEMMs.
  const TensorView* shared_w = source.contains(stem + "gate_proj.weight") ? source.get(stem + "gate_proj.weight").first
                                                                            : nullptr;
  if (shared_w != nullptr && shared_w->dtype != DType::U8) {
    FP4MOE_CHECK(shared_w->shape.size() == 2 && shared_w->shape[1] == H && shared_w->shape[0] > 0, path,
                 ": tensor '", stem, "gate_proj.weight' is ", describe(shared_w->dtype, shared_w->shape),
                 "; expected [shared inter, ", H, "] (an unquantised shared expert)");
    const int64_t S = shared_w->shape[0];
    for (const std::string& name : source.names())
      FP4MOE_CHECK(name.compare(0, stem.size(), stem) != 0 || name.size() < 7 ||
                       name.compare(name.size() - 7, 7, ".weight") == 0,
                   path, ": tensor '", name, "' beside an unquantised shared expert '", stem,
                   "*'; expected only {gate_proj,up_proj,down_proj}.weight (a shared expert is NVFP4 or "
                   "unquantised, not a mix)");
    SharedExpertWeights shared;
    shared.inter = S;
    const char* what = "an unquantised shared expert";
    shared.dense_gate_up = read_float_tensor(source, path, stem + "gate_proj.weight", {S, H}, what);
    const std::vector<float> up = read_float_tensor(source, path, stem + "up_proj.weight", {S, H}, what);
    shared.dense_gate_up.insert(shared.dense_gate_up.end(), up.begin(), up.end());
    shared.dense_down = read_float_tensor(source, path, stem + "down_proj.weight", {H, S}, what);
    if (gated) shared.gate = read_shared_gate();
    weights.shared_expert = std::move(shared);
    return weights;
  }
  for (const char* proj : kProjNames)
    for (const char* field : kRequiredFields) {
      const std::string name = stem + proj + "." + field;
      FP4MOE_CHECK(source.contains(name), path, ": missing tensor '", name, "' (other tensors under '", stem,
                   "' are there: a shared expert needs all of {gate_proj,up_proj,down_proj}.{weight,weight_scale,"
                   "weight_scale_2})", source.where_else(name));
    }
  const std::string shared_shape_source = stem + "gate_proj.weight";
  const TensorView& shared_gate0 = *source.get(shared_shape_source).first;
  FP4MOE_CHECK(shared_gate0.dtype == DType::U8 && shared_gate0.shape.size() == 2 &&
                   shared_gate0.shape[1] * 2 == H && shared_gate0.shape[0] > 0 &&
                   shared_gate0.shape[0] % kNvfp4BlockSize == 0,
               path, ": tensor '", shared_shape_source, "' is ", describe(shared_gate0.dtype, shared_gate0.shape),
               "; expected U8 [shared inter, ", H / 2, "] (packed fp4, shared inter a positive multiple of ",
               kNvfp4BlockSize, ")");
  SharedExpertWeights shared;
  shared.inter = shared_gate0.shape[0];
  Nvfp4Matrix* shared_matrices[3] = {&shared.mlp.gate, &shared.mlp.up, &shared.mlp.down};
  std::optional<float> shared_scale_2[3];
  for (int p = 0; p < 3; ++p) {
    Nvfp4Matrix& m = *shared_matrices[p];
    m.rows = p < 2 ? shared.inter : H;
    m.cols = p < 2 ? H : shared.inter;
    auto name = [&](const char* field) { return stem + kProjNames[p] + "." + field; };
    shared_scale_2[p] = read_matrix(name, m);
  }
  if (shared_scale_2[0] && shared_scale_2[1] && *shared_scale_2[0] != *shared_scale_2[1])
    problems.add("'", stem, "gate_proj.weight_scale_2' = ", exact(*shared_scale_2[0]), " differs from '", stem,
                 "up_proj.weight_scale_2' = ", exact(*shared_scale_2[1]),
                 "; ModelOpt shares one weight_scale_2 between gate and up");
  problems.throw_if_any(path, prefix);
  if (gated) shared.gate = read_shared_gate();
  weights.shared_expert = std::move(shared);
  return weights;
}

// ------------------------------------------------------------------ writing

void add_moe_weights(SafetensorsWriter& writer, const MoeWeights& weights,
                     const std::string& prefix) {
  FP4MOE_CHECK(static_cast<int64_t>(weights.experts.size()) == weights.num_experts,
               "add_moe_weights: num_experts is ", weights.num_experts, " but ",
               weights.experts.size(), " experts are given");
  const bool with_bias = weights.has_bias();
  for (int64_t e = 0; e < weights.num_experts; ++e) {
    const ExpertWeights& expert = weights.experts[static_cast<size_t>(e)];
    FP4MOE_CHECK(expert.gate.global_scale == expert.up.global_scale, "add_moe_weights: expert ", e,
                 ": gate global_scale ", expert.gate.global_scale, " differs from up global_scale ",
                 expert.up.global_scale, "; ModelOpt shares one weight_scale_2 between gate and up "
                 "(quantise both with the scale of their joint amax)");
    const Nvfp4Matrix* matrices[3] = {&expert.gate, &expert.up, &expert.down};
    const std::vector<float>* biases[3] = {&expert.gate_bias, &expert.up_bias, &expert.down_bias};
    for (int p = 0; p < 3; ++p) {
      const Nvfp4Matrix& m = *matrices[p];
      const std::string proj = kProjNames[p];
      const int64_t rows = p < 2 ? weights.inter : weights.hidden;
      const int64_t cols = p < 2 ? weights.hidden : weights.inter;
      FP4MOE_CHECK(m.rows == rows && m.cols == cols, "add_moe_weights: expert ", e, " ", proj,
                   " is [", m.rows, ", ", m.cols, "], expected [", rows, ", ", cols, "]");
      FP4MOE_CHECK(cols % kNvfp4BlockSize == 0, "add_moe_weights: K = ", cols,
                   " is not a multiple of ", kNvfp4BlockSize);
      FP4MOE_CHECK(m.packed.size() == static_cast<size_t>(rows * cols / 2) &&
                       m.scales.size() == static_cast<size_t>(rows * cols / kNvfp4BlockSize),
                   "add_moe_weights: expert ", e, " ", proj, " has ", m.packed.size(),
                   " packed bytes and ", m.scales.size(), " scales, expected ", rows * cols / 2,
                   " and ", rows * cols / kNvfp4BlockSize);
      auto name = [&](const char* field) { return expert_tensor_name(prefix, e, proj, field); };
      writer.add(name("weight"), DType::U8, {rows, cols / 2}, m.packed.data(), m.packed.size());
      writer.add(name("weight_scale"), DType::F8_E4M3, {rows, cols / kNvfp4BlockSize},
                 m.scales.data(), m.scales.size());
      writer.add(name("weight_scale_2"), DType::F32, {}, &m.global_scale, sizeof(float));
      writer.add(name("input_scale"), DType::F32, {}, &m.input_scale, sizeof(float));
      if (with_bias) {
        const std::vector<float>& bias = *biases[p];
        FP4MOE_CHECK(static_cast<int64_t>(bias.size()) == rows, "add_moe_weights: expert ", e, " ",
                     proj, " bias has ", bias.size(), " elements, expected ", rows,
                     " (expert 0 has biases, so every expert needs them)");
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
    writer.add(base + "weight_scale", DType::F8_E4M3, {rows, cols / kNvfp4BlockSize}, m.scales.data(),
               m.scales.size());
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

// ------------------------------------------------------------------ router

std::optional<RouterWeights> load_router_weights(const std::string& path, const std::string& prefix) {
  TensorSource source(path);
  // DeepSeek/GLM/Kimi/Qwen/Mixtral name the router "gate", gpt-oss "router".
  const std::string gate = prefix + "gate.", router = prefix + "router.";
  const std::string stem = source.contains(gate + "weight") ? gate : source.contains(router + "weight") ? router : "";
  if (stem.empty()) return std::nullopt;
  RouterWeights r;
  r.weight_name = stem + "weight";
  const TensorView& w = *source.get(r.weight_name).first;
  FP4MOE_CHECK(w.shape.size() == 2 && w.shape[0] > 0 && w.shape[1] > 0, path, ": tensor '", r.weight_name, "' is ",
               describe(w.dtype, w.shape), "; expected F32, BF16 or F16 [num_experts, hidden] (the router)");
  r.num_experts = w.shape[0];
  r.hidden = w.shape[1];
  r.weight = read_float_tensor(source, path, r.weight_name, {r.num_experts, r.hidden}, "the router weight");
  if (source.contains(stem + "bias"))
    r.bias = read_float_tensor(source, path, stem + "bias", {r.num_experts}, "the router bias");
  if (source.contains(gate + "e_score_correction_bias"))
    r.correction_bias = read_float_tensor(source, path, gate + "e_score_correction_bias", {r.num_experts},
                                          "noaux_tc's correction bias");
  return r;
}

}  // namespace fp4moe
