// Every tensor of a checkpoint, wherever it lives (docs/design.md §3): one
// .safetensors file, the shards named by model.safetensors.index.json, or
// all *.safetensors files of a directory, held to the directory's
// config.json and declared quantisation. The expert and router loaders
// (moe_weights_reader.cpp) read through it, and the CLI lists a
// checkpoint's tensors with checkpoint_tensor_names. Internal: library users
// load layers, not file listings.
//
// Tested in tests/format/test_checkpoint_reader.cpp.
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "format/config_json.hpp"
#include "format/quant_config.hpp"
#include "fp4moe/safetensors.hpp"

namespace fp4moe {

// Every tensor name of a .safetensors file or a checkpoint directory (the
// shards its model.safetensors.index.json names, else all its *.safetensors
// files), sorted: what load_moe_weights(path, ...) can find there. Throws as
// the loader does: a missing path, an invalid index, an invalid or refused
// hf_quant_config.json or config.json, a tensor in two loose files.
std::vector<std::string> checkpoint_tensor_names(const std::string& path);

// A checkpoint's tensors. Shards are opened (read) only when a tensor in
// them is asked for, so loading one layer touches only its shards. A single
// file of a checkpoint directory is held to the directory's configs too.
class TensorSource {
 public:
  // Throws one line naming the file for a missing path, an invalid index or
  // config, a refused declared format, a tensor in two loose files.
  explicit TensorSource(const std::string& path);

  // For a file given inside a sharded checkpoint: "; <index> puts it in
  // <shard>: ..." when the directory's index places `name` in another shard,
  // else empty.
  std::string where_else(const std::string& name) const;

  // The declared quantisation, config.json and its expert count, where the
  // checkpoint has them.
  const std::optional<QuantConfig>& quant_config() const { return quant_config_; }
  const std::optional<ConfigJson>& config_json() const { return config_json_; }
  const std::optional<ConfigJson::ExpertCount>& expert_count() const { return expert_count_; }

  // Every tensor name, in a stable order (sorted).
  const std::vector<std::string>& names() const { return names_; }
  bool contains(const std::string& name) const { return shard_of_.count(name) != 0; }

  // The tensor and the file it is in; the view lives as long as this source.
  std::pair<const TensorView*, const std::string*> get(const std::string& name);

 private:
  struct Shard {
    std::string path;
    std::unique_ptr<SafetensorsFile> file;  // opened on first use
  };

  void open_directory(const std::filesystem::path& dir);
  void add_file(const std::string& file, bool sort_names);

  std::string path_;
  std::optional<QuantConfig> quant_config_;
  std::optional<ConfigJson> config_json_;
  std::optional<ConfigJson::ExpertCount> expert_count_;
  std::map<std::string, std::string> directory_index_;  // a file's directory's index, else empty
  std::vector<Shard> shards_;
  std::map<std::string, size_t> shard_of_;  // tensor name -> index into shards_
  std::vector<std::string> names_;
};

// "<dtype> <shape>", e.g. "BF16 [4, 8]", for messages.
std::string describe_tensor(DType dtype, const std::vector<int64_t>& shape);

// A float tensor's values (F32, BF16, F16) after its dtype and shape are
// checked, each finite; `what` says what it is for the message, `path` is
// the checkpoint named in it.
std::vector<float> read_float_tensor(TensorSource& source, const std::string& path, const std::string& name,
                                     const std::vector<int64_t>& shape, const char* what);

}  // namespace fp4moe
