// Converting a float checkpoint into ModelOpt NVFP4 (fp4moe/checkpoint.hpp):
// the plan (convert_plan.hpp) carried out. Each input tensor is read once,
// its outputs computed one matrix at a time (a shared global scale from the
// amax of its whole group, read when the group's first member is written)
// and streamed into the shard being written; a directory then gets its
// index, hf_quant_config.json, config.json with quantization_config and the
// input's other files, and the temporary output is renamed into place.
//
// Tested through `fp4moe quantize` in tests/tools/test_quantize.cpp and
// tests/tools/test_cli.cpp.
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string_view>

#include <nlohmann/json.hpp>

#include "format/convert_plan.hpp"
#include "format/tensor_values.hpp"
#include "fp4moe/checkpoint.hpp"
#include "fp4moe/error.hpp"
#include "fp4moe/modelopt.hpp"
#include "fp4moe/nvfp4.hpp"
#include "fp4moe/safetensors.hpp"
#include "util/output_path.hpp"
#include "util/parallel.hpp"

#ifndef FP4MOE_LIBRARY_VERSION
#error "FP4MOE_LIBRARY_VERSION must be defined by the build (src/CMakeLists.txt)"
#endif

namespace fp4moe {
namespace convert {
namespace {

namespace fs = std::filesystem;
using nlohmann::ordered_json;

constexpr const char* kAlgo = "W4A16_NVFP4";
// Files of a checkpoint directory that hold weights in another format: not
// copied (they would contradict the quantised safetensors).
const std::set<std::string> kSkippedExtensions = {".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf", ".onnx"};

// ------------------------------------------------------------------ compute

// The float rows of one output matrix [rows, cols], row-major.
std::vector<float> extract_rows(const TensorView& view, const Slice& s) {
  const int64_t slice_numel = s.expert < 0 ? view.numel() : view.numel() / view.shape[0];
  TensorView part = view;
  part.shape = {slice_numel};
  part.data = view.data + static_cast<size_t>(std::max<int64_t>(s.expert, 0) * slice_numel) * dtype_size(view.dtype);
  part.nbytes = static_cast<size_t>(slice_numel) * dtype_size(view.dtype);
  // Contiguous rows: convert only those.
  if (!s.transposed && s.row_stride == 1) {
    part.shape = {s.rows * s.cols};
    part.data += static_cast<size_t>(s.row_offset * s.cols) * dtype_size(view.dtype);
    part.nbytes = static_cast<size_t>(s.rows * s.cols) * dtype_size(view.dtype);
    return tensor_to_float(part);
  }
  const std::vector<float> all = tensor_to_float(part);
  const int64_t width = slice_numel / s.cols;  // M: rows of the logical [M, cols] view
  std::vector<float> out(static_cast<size_t>(s.rows * s.cols));
  for (int64_t r = 0; r < s.rows; ++r) {
    const int64_t src_row = s.row_offset + r * s.row_stride;
    for (int64_t c = 0; c < s.cols; ++c) {
      out[static_cast<size_t>(r * s.cols + c)] =
          s.transposed ? all[static_cast<size_t>(c * width + src_row)] : all[static_cast<size_t>(src_row * s.cols + c)];
    }
  }
  return out;
}

// quantize_nvfp4 over row chunks on all cores. Rows are quantised
// independently given the global scale, so the result equals one call.
Nvfp4Matrix quantize_rows_parallel(const float* weights, int64_t rows, int64_t cols, float global_scale) {
  const int64_t min_rows_per_part = std::max<int64_t>(1, (int64_t{1} << 18) / cols);
  const int64_t num_parts = std::clamp<int64_t>(rows / min_rows_per_part, 1, hardware_threads());
  if (num_parts == 1) return quantize_nvfp4(weights, rows, cols, global_scale);
  const int64_t rows_per_part = (rows + num_parts - 1) / num_parts;
  std::vector<Nvfp4Matrix> parts(static_cast<size_t>(num_parts));
  parallel_for(num_parts, [&](int64_t part) {
    const int64_t r0 = part * rows_per_part;
    const int64_t n = std::min(rows_per_part, rows - r0);
    if (n > 0) parts[static_cast<size_t>(part)] = quantize_nvfp4(weights + r0 * cols, n, cols, global_scale);
  });
  Nvfp4Matrix out;
  out.rows = rows;
  out.cols = cols;
  out.global_scale = global_scale;
  out.packed.reserve(static_cast<size_t>(rows * cols / 2));
  out.scales.reserve(static_cast<size_t>(rows * cols / kNvfp4BlockSize));
  for (const Nvfp4Matrix& part : parts) {
    out.packed.insert(out.packed.end(), part.packed.begin(), part.packed.end());
    out.scales.insert(out.scales.end(), part.scales.begin(), part.scales.end());
  }
  return out;
}

// ------------------------------------------------------------------ output

void write_text_file(const fs::path& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  FP4MOE_CHECK(out.good(), path.string(), ": cannot create");
  out << text;
  out.close();
  FP4MOE_CHECK(out.good(), path.string(), ": write failed");
}

// Removes the temporary output on every exit path until released.
class TempOutput {
 public:
  explicit TempOutput(fs::path path) : path_(std::move(path)) {}
  ~TempOutput() {
    if (path_.empty()) return;
    std::error_code ignored;
    fs::remove_all(path_, ignored);
  }
  TempOutput(const TempOutput&) = delete;
  TempOutput& operator=(const TempOutput&) = delete;
  void release() { path_.clear(); }

 private:
  fs::path path_;
};

ordered_json hf_quant_config(const std::vector<std::string>& exclude_modules) {
  ordered_json quantization = ordered_json::object();
  quantization["quant_algo"] = kAlgo;
  quantization["kv_cache_quant_algo"] = nullptr;
  quantization["group_size"] = kNvfp4BlockSize;
  quantization["exclude_modules"] = exclude_modules;
  ordered_json config = ordered_json::object();
  config["producer"] = {{"name", "fp4moe"}, {"version", FP4MOE_LIBRARY_VERSION}};
  config["quantization"] = std::move(quantization);
  return config;
}

// config.json's quantization_config, in the form ModelOpt's export converts
// hf_quant_config.json to (weight-only: no input_activations).
ordered_json config_quantization(const ordered_json& hf_quant) {
  ordered_json weights = ordered_json::object();
  weights["dynamic"] = false;
  weights["num_bits"] = 4;
  weights["type"] = "float";
  weights["group_size"] = kNvfp4BlockSize;
  ordered_json group = ordered_json::object();
  group["weights"] = std::move(weights);
  group["targets"] = ordered_json::array({"Linear"});
  ordered_json q = ordered_json::object();
  q["config_groups"] = {{"group_0", std::move(group)}};
  q["ignore"] = hf_quant["quantization"]["exclude_modules"];
  q["quant_algo"] = kAlgo;
  q["producer"] = hf_quant["producer"];
  q["quant_method"] = "modelopt";
  return q;
}

// ------------------------------------------------------------------ steps

// Refuses a format other than W4A16_NVFP4.
void check_algo(const std::string& algo) {
  FP4MOE_CHECK(algo == kAlgo,
               algo == "NVFP4"
                   ? std::string("--algo NVFP4 (W4A4) needs each layer's input_scale, an activation range "
                                 "calibrated by running the model on data, which quantize cannot compute; use "
                                 "--algo W4A16_NVFP4 (weight-only, the default) or calibrate with ModelOpt")
                   : "--algo " + algo + " is not supported; expected W4A16_NVFP4");
}

// Refuses an output that would clobber something: a directory is written as
// a new (or empty) directory, a file not over its input.
void check_output(const std::string& input, const std::string& output, bool dir_input) {
  const fs::path out_path = fs::path(output);
  if (dir_input) {
    const fs::path parent = fs::absolute(out_path).parent_path();
    FP4MOE_CHECK(fs::is_directory(parent), "output ", output, ": directory ", parent.string(), " does not exist");
    FP4MOE_CHECK(!fs::exists(out_path) || (fs::is_directory(out_path) && fs::is_empty(out_path)), "output ", output,
                 " exists and is not an empty directory; a checkpoint directory is written as a new "
                 "directory");
  } else {
    check_output_path(output);
    std::error_code ec;
    FP4MOE_CHECK(!fs::equivalent(input, output, ec), "output ", output,
                 " is the input file; write the quantised checkpoint elsewhere");
  }
}

// config.json beside the input: its model_type (a shard's layout hint, e.g.
// gpt-oss) and, for a directory, the document written out again with its
// quantization_config (null for a file, or without config.json).
ordered_json read_input_config(const Input& in, bool dir_input, std::string& model_type) {
  const fs::path config_path = in.dir / "config.json";
  if (!fs::exists(config_path)) return nullptr;
  ordered_json config = read_json(config_path);
  FP4MOE_CHECK(config.is_object(), config_path.string(), ": expected a JSON object");
  if (config.contains("model_type") && config["model_type"].is_string())
    model_type = config["model_type"].get<std::string>();
  if (!dir_input) return nullptr;
  FP4MOE_CHECK(!config.contains("quantization_config"), config_path.string(),
               ": the model already has a quantization_config; quantize reads float checkpoints");
  return config;
}

// A tied lm_head has no tensor of its own but is a module ModelOpt lists
// as kept: a causal LM without lm_head.weight has one (config.json may
// leave tie_word_embeddings out when it is the class default).
void add_tied_lm_head(const Input& in, const ordered_json& model_config, const Planner& planner, Plan& plan) {
  if (model_config.is_null() || in.index_of.contains("lm_head.weight")) return;
  bool causal_lm = false;
  if (model_config.contains("architectures") && model_config["architectures"].is_array())
    for (const ordered_json& arch : model_config["architectures"])
      causal_lm |= arch.is_string() && arch.get<std::string>().ends_with("ForCausalLM");
  const bool tied = model_config.contains("tie_word_embeddings") && model_config["tie_word_embeddings"] == true;
  if ((causal_lm || tied) && planner.excluded("lm_head", "lm_head.weight")) plan.excluded_modules.push_back("lm_head");
}

// Streams the planned outputs into their shards: a shard's writer opens at
// its first tensor and commits when the next shard begins.
class ShardStreamer {
 public:
  ShardStreamer(const Plan& plan, const std::vector<Shard>& shards, std::map<std::string, std::string> metadata,
                std::function<std::string(const Shard&)> shard_path, const QuantizeCheckpointProgress& progress)
      : plan_(plan),
        shards_(shards),
        metadata_(std::move(metadata)),
        shard_path_(std::move(shard_path)),
        progress_(progress),
        shard_of_(plan.outputs.size()) {
    for (size_t s = 0; s < shards.size(); ++s)
      for (size_t k : shards[s].outputs) shard_of_[k] = s;
  }

  // Output k's bytes.
  void write(size_t k, const void* data, size_t nbytes) {
    if (progress_.before_write) progress_.before_write();
    if (shard_of_[k] != writer_shard_) {
      if (writer_) writer_->commit();
      writer_shard_ = shard_of_[k];
      std::vector<TensorSpec> specs;
      for (size_t o : shards_[writer_shard_].outputs) specs.push_back(plan_.outputs[o].spec);
      writer_ =
          std::make_unique<SafetensorsStreamWriter>(shard_path_(shards_[writer_shard_]), std::move(specs), metadata_);
    }
    writer_->write(plan_.outputs[k].spec.name, data, nbytes);
  }

  // Commits the last shard; an input without tensors still gives a valid
  // (empty) file.
  void finish() {
    if (!writer_ && !shards_[0].outputs.empty()) FP4MOE_THROW("quantize: nothing was written (internal)");
    if (!writer_) {
      writer_ =
          std::make_unique<SafetensorsStreamWriter>(shard_path_(shards_[0]), std::vector<TensorSpec>{}, metadata_);
    }
    writer_->commit();
  }

 private:
  const Plan& plan_;
  const std::vector<Shard>& shards_;
  std::map<std::string, std::string> metadata_;
  std::function<std::string(const Shard&)> shard_path_;
  const QuantizeCheckpointProgress& progress_;
  std::vector<size_t> shard_of_;  // output index -> shard index
  std::unique_ptr<SafetensorsStreamWriter> writer_;
  size_t writer_shard_ = SIZE_MAX;
};

// Reads every input tensor once, in order, and writes its planned outputs:
// copies, and each matrix quantised with its own or its group's global
// scale. A shared scale needs the amax of its whole group before the first
// member is written: members in other input tensors (separate q/k/v,
// gate/up) are read then and stay cached by their file until their own
// turn, which comes soon after, so memory holds at most one group's
// tensors. Returns the number of tensors copied.
int write_outputs(Input& in, const Plan& plan, ShardStreamer& streamer, const QuantizeCheckpointProgress& progress) {
  std::map<std::string, std::vector<size_t>> group_members;
  for (size_t m = 0; m < plan.matrices.size(); ++m)
    if (!plan.matrices[m].group.empty()) group_members[plan.matrices[m].group].push_back(m);
  std::map<std::string, float> group_amax;
  const auto load = [&](size_t i) -> const TensorView& {
    const InputTensor& t = in.tensors[i];
    return in.shards[t.shard].get(t.desc.name);
  };
  const auto release = [&](size_t i) { in.shards[in.tensors[i].shard].release(in.tensors[i].desc.name); };
  const auto advance = [&](uint64_t bytes, std::string_view detail) {
    if (progress.advance) progress.advance(bytes, detail);
  };

  int num_copied = 0;
  size_t k = 0;
  Nvfp4Matrix current;  // the matrix whose fields are being written
  while (k < plan.outputs.size()) {
    const size_t i = plan.outputs[k].input;
    const TensorView& view = load(i);
    for (; k < plan.outputs.size() && plan.outputs[k].input == i; ++k) {
      const Output& o = plan.outputs[k];
      switch (o.kind) {
        case Output::kCopy:
          streamer.write(k, view.data, view.nbytes);
          ++num_copied;
          break;
        case Output::kCopyAsF32: {
          const std::vector<float> values = tensor_to_float(view);  // exact: BF16/F16 -> F32
          streamer.write(k, values.data(), values.size() * sizeof(float));
          ++num_copied;
          break;
        }
        case Output::kWeight: {
          const Matrix& m = plan.matrices[o.matrix];
          const std::vector<float> rows = extract_rows(view, m.slice);
          float amax = abs_max(rows.data(), rows.size());
          if (!m.group.empty()) {
            auto it = group_amax.find(m.group);
            if (it == group_amax.end()) {
              float shared = 0.0f;
              if (m.group_is_input) {
                shared = tensor_abs_max(view, 0, view.numel());
              } else {
                for (size_t other : group_members.at(m.group)) {
                  const Matrix& member = plan.matrices[other];
                  const TensorView& member_view = member.input == i ? view : load(member.input);
                  const std::vector<float> other_rows = extract_rows(member_view, member.slice);
                  shared = std::max(shared, abs_max(other_rows.data(), other_rows.size()));
                }
              }
              it = group_amax.emplace(m.group, shared).first;
            }
            amax = it->second;
          }
          current = quantize_rows_parallel(rows.data(), m.slice.rows, m.slice.cols, nvfp4_global_scale(amax));
          streamer.write(k, current.packed.data(), current.packed.size());
          advance(0, m.module);
          break;
        }
        case Output::kWeightScale:
          streamer.write(k, current.scales.data(), current.scales.size());
          break;
        case Output::kWeightScale2:
          streamer.write(k, &current.global_scale, sizeof(float));
          break;
        case Output::kBiasSlice: {
          const size_t element = dtype_size(view.dtype);
          const int64_t width = view.shape[1];
          std::vector<uint8_t> bytes(static_cast<size_t>(o.slice.rows) * element);
          for (int64_t r = 0; r < o.slice.rows; ++r) {
            const int64_t src = o.slice.expert * width + o.slice.row_offset + r * o.slice.row_stride;
            std::memcpy(bytes.data() + r * element, view.data + src * element, element);
          }
          streamer.write(k, bytes.data(), bytes.size());
          break;
        }
      }
    }
    release(i);
    advance(in.tensors[i].desc.nbytes, in.tensors[i].desc.name);
  }
  streamer.finish();
  return num_copied;
}

// A directory's files beside its shards, then the temporary directory
// renamed to the output: the index (several shards), hf_quant_config.json,
// config.json with its quantization_config, and the input's other files
// (tokenizer, generation config, ...) as they are.
void finish_directory(const Input& in, const Plan& plan, const std::vector<Shard>& shards,
                      const ordered_json& quant_config, ordered_json model_config, const fs::path& tmp_dir,
                      const std::string& output) {
  if (shards.size() > 1) {
    ordered_json weight_map = ordered_json::object();
    std::vector<std::pair<std::string, std::string>> entries;
    uint64_t total = 0;
    for (const Shard& s : shards) {
      total += s.data_bytes;
      for (size_t o : s.outputs) entries.emplace_back(plan.outputs[o].spec.name, s.file);
    }
    std::sort(entries.begin(), entries.end());
    for (const auto& [name, file] : entries) weight_map[name] = file;
    ordered_json index = ordered_json::object();
    index["metadata"] = {{"total_size", total}};
    index["weight_map"] = std::move(weight_map);
    write_text_file(tmp_dir / "model.safetensors.index.json", index.dump(2) + "\n");
  }
  // ensure_ascii, as Python's json.dump writes them.
  write_text_file(tmp_dir / "hf_quant_config.json", quant_config.dump(4, ' ', true));
  if (!model_config.is_null()) {
    model_config["quantization_config"] = config_quantization(quant_config);
    write_text_file(tmp_dir / "config.json", model_config.dump(4, ' ', true));
  }
  static const std::set<std::string> kWritten = {"config.json", "hf_quant_config.json", "model.safetensors.index.json"};
  for (const fs::directory_entry& entry : fs::directory_iterator(in.dir)) {
    const std::string name = entry.path().filename().string();
    if (!entry.is_regular_file() || name.starts_with(".") || kWritten.contains(name) ||
        entry.path().extension() == ".safetensors" || kSkippedExtensions.contains(entry.path().extension().string()))
      continue;
    std::error_code ec;
    fs::copy_file(entry.path(), tmp_dir / name, ec);
    FP4MOE_CHECK(!ec, entry.path().string(), ": cannot copy into the output: ", ec.message());
  }
  const fs::path out_path(output);
  std::error_code ec;
  if (fs::exists(out_path)) fs::remove(out_path, ec);  // an empty directory, checked before
  fs::rename(tmp_dir, out_path, ec);
  FP4MOE_CHECK(!ec, "output ", output, ": cannot rename '", tmp_dir.string(), "' to it: ", ec.message());
}

QuantizeCheckpointSummary run(const std::string& input, std::string output, const QuantizeCheckpointOptions& options,
                              const QuantizeCheckpointProgress& progress) {
  // "out/" names the directory "out"; its temporary sibling is "out.tmp.<pid>".
  while (output.size() > 1 && output.back() == '/') output.pop_back();
  check_algo(options.algo);
  const bool dir_input = fs::is_directory(input);
  check_output(input, output, dir_input);

  Input in = open_input(input);
  std::string model_type;
  const ordered_json model_config = read_input_config(in, dir_input, model_type);
  Planner planner(in, input, options, model_type);
  Plan plan = planner.make();
  add_tied_lm_head(in, model_config, planner, plan);
  const ordered_json quant_config = hf_quant_config(summarize_excludes(plan.excluded_modules, plan.quantized_modules));

  QuantizeCheckpointSummary summary;
  summary.output = output;
  for (const InputTensor& t : in.tensors) summary.input_bytes += t.desc.nbytes;
  if (progress.begin) progress.begin(summary.input_bytes);

  // Output layout: a directory gets shards no larger than the input's
  // largest; as transformers' save_pretrained (and so ModelOpt's export)
  // names them, a single shard is model.safetensors, without an index.
  std::vector<Shard> shards;
  if (dir_input && in.sharded) {
    shards = make_shards(plan, *std::max_element(in.shard_data_bytes.begin(), in.shard_data_bytes.end()));
  } else {
    shards = make_shards(plan, UINT64_MAX);
  }
  if (shards.size() == 1) shards[0].file = dir_input ? "model.safetensors" : fs::path(output).filename().string();

  const fs::path tmp_dir = dir_input ? fs::path(output + ".tmp." + std::to_string(::getpid())) : fs::path();
  TempOutput cleanup(tmp_dir);
  if (dir_input) {
    std::error_code ec;
    fs::remove_all(tmp_dir, ec);
    FP4MOE_CHECK(fs::create_directory(tmp_dir, ec) && !ec, "output ", output, ": cannot create '", tmp_dir.string(),
                 "': ", ec ? ec.message() : "it exists");
  }

  // Metadata: ModelOpt's shards carry {"format": "pt"}; a single output file
  // also describes its quantisation, having no hf_quant_config.json beside it.
  std::map<std::string, std::string> metadata = {{"format", "pt"}};
  if (!dir_input) {
    for (const auto& [key, value] : in.shards[0].metadata()) metadata.emplace(key, value);
    metadata["quant_algo"] = kAlgo;
    metadata["group_size"] = std::to_string(kNvfp4BlockSize);
    metadata["hf_quant_config"] = quant_config.dump();
  }

  ShardStreamer streamer(
      plan, shards, std::move(metadata),
      [&](const Shard& s) { return dir_input ? (tmp_dir / s.file).string() : output; }, progress);
  summary.num_copied = write_outputs(in, plan, streamer, progress);
  if (progress.end) progress.end();

  if (dir_input) {
    finish_directory(in, plan, shards, quant_config, model_config, tmp_dir, output);
    cleanup.release();
  }
  summary.num_matrices = plan.matrices.size();
  summary.num_expert_stacks = plan.num_stacks;
  summary.num_shards = shards.size();
  return summary;
}

}  // namespace
}  // namespace convert

QuantizeCheckpointSummary quantize_checkpoint(const std::string& input, const std::string& output,
                                              const QuantizeCheckpointOptions& options,
                                              const QuantizeCheckpointProgress& progress) {
  try {
    return convert::run(input, output, options, progress);
  } catch (const std::filesystem::filesystem_error& e) {
    // A file system failure is the user's environment, not a bug: one line.
    FP4MOE_THROW("quantize: ", e.what());
  }
}

}  // namespace fp4moe
