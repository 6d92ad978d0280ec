// Every tensor of a checkpoint, wherever it lives (checkpoint_reader.hpp):
// the shard index read and held to the checkpoint directory, the configs
// read once, the shards opened on first use.
// Tested in tests/format/test_checkpoint_reader.cpp: round trips through a
// single file, a sharded directory with an index and a directory of loose
// shards, the tensor listing the CLI uses, and one test per error. Fuzzed by
// fuzz/fuzz_modelopt.cpp.
#include "format/checkpoint_reader.hpp"

#include <algorithm>
#include <cmath>
#include <system_error>

#include <nlohmann/json.hpp>

#include "format/tensor_values.hpp"
#include "fp4moe/error.hpp"

namespace fp4moe {

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

// The weight_map of a sharded checkpoint's model.safetensors.index.json:
// tensor name -> shard path (the index's directory joined with the file name
// it gives). The one reader of the index: the CLI lists a checkpoint's
// tensors through checkpoint_tensor_names (format/checkpoint.hpp).
std::map<std::string, std::string> read_safetensors_index(const fs::path& index_path) {
  const json index = read_json_file(index_path);
  const std::string where = index_path.string();
  FP4MOE_CHECK(index.is_object() && index.contains("weight_map") && index["weight_map"].is_object(), where,
               ": expected an object with a \"weight_map\" object (tensor name -> shard file)");
  std::map<std::string, std::string> shard_of;
  for (const auto& [name, file] : index["weight_map"].items()) {
    FP4MOE_CHECK(file.is_string(), where, ": weight_map[\"", name, "\"] is ", file.dump(),
                 "; expected a shard file name");
    // The index comes with the checkpoint: it may only name files inside the
    // checkpoint's directory, never make the loader open one elsewhere.
    const fs::path shard = file.get<std::string>();
    const bool inside = !shard.empty() && shard.is_relative() &&
                        std::none_of(shard.begin(), shard.end(), [](const fs::path& part) { return part == ".."; });
    FP4MOE_CHECK(inside, where, ": weight_map[\"", name, "\"] is ", file.dump(),
                 "; expected the name of a shard file inside the checkpoint directory");
    shard_of.emplace(name, (index_path.parent_path() / shard).string());
  }
  return shard_of;
}

}  // namespace

TensorSource::TensorSource(const std::string& path) : path_(path) {
  std::error_code ec;
  const fs::file_status status = fs::status(path, ec);
  FP4MOE_CHECK(!ec && fs::exists(status), path, ": no such file or directory");
  // A single shard of a checkpoint directory is held to the directory's
  // configs too.
  const bool is_dir = fs::is_directory(status);
  const fs::path dir = is_dir ? fs::path(path) : fs::path(path).parent_path();
  if (fs::exists(dir / "config.json")) {
    config_json_ = ConfigJson::read(dir / "config.json");
    expert_count_ = config_json_->expert_count();
  }
  quant_config_ = read_declared_quantization(dir, config_json_);
  if (is_dir) {
    open_directory(dir);
  } else {
    add_file(path, true);
    // The shards beside it, to say where a tensor missing here is.
    if (fs::exists(dir / "model.safetensors.index.json"))
      directory_index_ = read_safetensors_index(dir / "model.safetensors.index.json");
  }
}

std::string TensorSource::where_else(const std::string& name) const {
  const auto it = directory_index_.find(name);
  if (it == directory_index_.end()) return {};
  return detail::concat("; the directory's model.safetensors.index.json puts it in ", it->second,
                        ": pass the directory to load the whole layer");
}

std::pair<const TensorView*, const std::string*> TensorSource::get(const std::string& name) {
  const auto it = shard_of_.find(name);
  FP4MOE_CHECK(it != shard_of_.end(), path_, ": no tensor named '", name, "'");
  Shard& shard = shards_[it->second];
  if (!shard.file) shard.file = std::make_unique<SafetensorsFile>(SafetensorsFile::open(shard.path));
  FP4MOE_CHECK(shard.file->contains(name), shard.path, ": has no tensor '", name, "', but ", path_,
               " lists it in this shard");
  return {&shard.file->get(name), &shard.path};
}

void TensorSource::open_directory(const fs::path& dir) {
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
    if (entry.is_regular_file() && entry.path().extension() == ".safetensors") files.push_back(entry.path());
  FP4MOE_CHECK(!files.empty(), dir.string(), ": no *.safetensors file and no model.safetensors.index.json");
  std::sort(files.begin(), files.end());
  for (const fs::path& file : files) add_file(file.string(), false);
  std::sort(names_.begin(), names_.end());
}

void TensorSource::add_file(const std::string& file, bool sort_names) {
  const size_t idx = shards_.size();
  shards_.push_back(Shard{file, std::make_unique<SafetensorsFile>(SafetensorsFile::open(file))});
  for (const std::string& name : shards_[idx].file->names()) {
    const auto [it, inserted] = shard_of_.emplace(name, idx);
    FP4MOE_CHECK(inserted, path_, ": tensor '", name, "' is in both ", shards_[it->second].path, " and ", file,
                 "; add a model.safetensors.index.json to say which to use");
    names_.push_back(name);
  }
  if (sort_names) std::sort(names_.begin(), names_.end());
}

std::vector<std::string> checkpoint_tensor_names(const std::string& path) { return TensorSource(path).names(); }

std::string describe_tensor(DType dtype, const std::vector<int64_t>& shape) {
  return std::string(dtype_name(dtype)) + " " + shape_to_string(shape);
}

// A float tensor's values (F32, BF16, F16) after its dtype and shape are
// checked; `what` says what it is for the message.
std::vector<float> read_float_tensor(TensorSource& source, const std::string& path, const std::string& name,
                                     const std::vector<int64_t>& shape, const char* what) {
  const auto [view, file] = source.get(name);
  FP4MOE_CHECK(is_float_dtype(view->dtype) && view->shape == shape, path, ": tensor '", name, "' (in ", *file, ") is ",
               describe_tensor(view->dtype, view->shape), "; expected F32, BF16 or F16 ", shape_to_string(shape), " (",
               what, ")");
  const std::vector<float> values = tensor_to_float(*view);
  const auto bad = std::find_if(values.begin(), values.end(), [](float v) { return !std::isfinite(v); });
  FP4MOE_CHECK(bad == values.end(), path, ": tensor '", name, "' element ", bad - values.begin(), " is ",
               bad == values.end() ? 0.0f : *bad, "; expected finite values (", what, ")");
  return values;
}

}  // namespace fp4moe
