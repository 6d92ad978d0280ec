// `fp4moe quantize IN OUT`: float checkpoint -> NVIDIA ModelOpt NVFP4
// checkpoint as ModelOpt's W4A16_NVFP4 export writes it (numerics:
// docs/design.md §3; the format and its rules: README, "quantize").
//
// IN is a .safetensors file (OUT: a file) or a checkpoint directory with
// model.safetensors.index.json or one model.safetensors (OUT: a directory with
// shards, the index, hf_quant_config.json, config.json with its
// quantization_config, and the directory's other small files copied).
//
//   <m>.weight [N, K] float (a linear layer)  -> <m>.weight U8 [N, K/2],
//                                                <m>.weight_scale F8_E4M3 [N, K/16],
//                                                <m>.weight_scale_2 F32 []
//   <p>experts.<proj>[.weight] [E, N, K] and  -> the same per expert, named
//   <p>experts.gate_up_proj [E, 2I, H] or        <p>experts.<e>.{gate,up,down}_proj.*
//   [E, H, 2I] (Llama4, gpt-oss interleaved)     (+ .bias split the same way)
//   anything else                              -> copied bit for bit
//
// Global scales are shared the way ModelOpt's export shares them between
// linear layers that read the same input: q/k/v (and DeepSeek MLA's q_a/q
// with kv_a_proj_with_mqa) of one attention block, gate/up (w1/w3) of one MLP
// or expert. Memory stays bounded by the largest input tensor (or scale
// group): outputs are planned from the headers, then each input tensor is
// read once, its outputs computed one matrix at a time and streamed into the
// shard being written. Everything goes to "OUT.tmp.<pid>" and is renamed at
// the end; an error or SIGINT/SIGTERM removes it.
// Tested in tests/tools/test_quantize.cpp (directories, shards, configs,
// shared scales, stacked layouts, refusals, failures and signals midway) and
// tests/tools/test_cli.cpp (bit equality with quantize_nvfp4, the loader).
#include <fnmatch.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <optional>
#include <regex>
#include <set>
#include <sstream>

#include <nlohmann/json.hpp>

#include "cli_util.hpp"
#include "commands.hpp"
#include "fp4moe/error.hpp"
#include "fp4moe/modelopt.hpp"
#include "fp4moe/nvfp4.hpp"
#include "fp4moe/safetensors.hpp"
#include "tensors.hpp"
#include "util/parallel.hpp"

namespace fp4moe::cli {
namespace {

namespace fs = std::filesystem;
using nlohmann::ordered_json;

// What ModelOpt keeps in high precision by default (its default-disabled
// quantizer patterns). They match quantizer names, "<module>.weight_quantizer",
// so "*mlp.gate.*" is the MoE router and not mlp.gate_proj. Embedding tables
// are kept too (ModelOpt disables quantizers of nn.Embedding by class).
const std::vector<std::string> kDefaultExcludes = {
    "*block_sparse_moe.gate*", "*linear_attn.conv1d*",    "*self_attention.conv1d*",
    "*linear_attn.in_proj_a*", "*linear_attn.in_proj_b*", "*lm_head*",
    "*mixer.conv1d*",          "*mlp.gate.*",             "*mlp.shared_expert_gate.*",
    "*output_layer*",          "*proj_out.*",             "*router*",
    "mtp.*",                   "output.*",                "*embed_vision*",
    "*vision_tower*",          "*visual*",                "*vision_model*",
    "*multi_modal_projector*"};

constexpr const char* kAlgo = "W4A16_NVFP4";
// Above this much input the progress line is shown.
constexpr uint64_t kProgressMinBytes = uint64_t{64} << 20;
// Files of a checkpoint directory that hold weights in another format: not
// copied (they would contradict the quantised safetensors).
const std::set<std::string> kSkippedExtensions = {".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf", ".onnx"};

struct QuantizeOptions {
  std::string input;
  std::string output;
  std::string algo = kAlgo;
  std::vector<std::string> excludes;
  bool no_default_exclude = false;
  bool quiet = false;
};

// ------------------------------------------------------------------ input

struct InputTensor {
  size_t shard = 0;  // index into Input::shards
  TensorView desc;   // name, dtype, shape, nbytes (no data)
};

struct Input {
  bool is_dir = false;
  bool sharded = false;   // a directory with model.safetensors.index.json
  fs::path dir;           // the checkpoint directory (a file's own directory)
  std::vector<SafetensorsFile> shards;
  std::vector<uint64_t> shard_data_bytes;
  std::vector<InputTensor> tensors;  // shard by shard, file order
  std::map<std::string, size_t> index_of;
};

std::string read_text_file(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  FP4MOE_CHECK(in.good(), path.string(), ": cannot open for reading");
  std::stringstream ss;
  ss << in.rdbuf();
  FP4MOE_CHECK(!in.bad(), path.string(), ": read failed");
  return ss.str();
}

ordered_json read_json(const fs::path& path) {
  try {
    return ordered_json::parse(read_text_file(path));
  } catch (const ordered_json::exception& e) {
    FP4MOE_THROW(path.string(), ": not valid JSON (", e.what(), ")");
  }
}

Input open_input(const std::string& path) {
  Input in;
  std::vector<fs::path> shard_paths;
  std::vector<std::pair<std::string, std::string>> indexed;  // weight_map: tensor -> shard file
  if (fs::is_directory(path)) {
    in.is_dir = true;
    in.dir = path;
    const fs::path index = in.dir / "model.safetensors.index.json";
    if (fs::exists(index)) {
      in.sharded = true;
      const ordered_json j = read_json(index);
      FP4MOE_CHECK(j.is_object() && j.contains("weight_map") && j["weight_map"].is_object(), index.string(),
                   ": expected an object with a \"weight_map\" object");
      std::set<std::string> seen;
      for (const auto& [name, file] : j["weight_map"].items()) {
        FP4MOE_CHECK(file.is_string(), index.string(), ": weight_map[\"", name, "\"] is ", file.dump(),
                     "; expected a shard file name");
        const fs::path shard(file.get<std::string>());
        FP4MOE_CHECK(shard.is_relative() && shard.has_filename() && shard == shard.filename(), index.string(),
                     ": weight_map[\"", name, "\"] is ", file.dump(), "; expected a file in the directory");
        if (seen.insert(shard.string()).second) shard_paths.push_back(in.dir / shard);
        indexed.emplace_back(name, shard.string());
      }
      // Shard names number the shards: keep their order.
      std::sort(shard_paths.begin(), shard_paths.end());
    } else {
      const fs::path single = in.dir / "model.safetensors";
      FP4MOE_CHECK(fs::exists(single), path, ": a directory without model.safetensors.index.json or model.safetensors");
      shard_paths.push_back(single);
    }
  } else {
    FP4MOE_CHECK(fs::exists(path), path, ": no such file or directory");
    in.dir = fs::absolute(path).parent_path();
    shard_paths.push_back(path);
  }
  for (const fs::path& shard_path : shard_paths) {
    in.shards.push_back(SafetensorsFile::open(shard_path.string()));
    const SafetensorsFile& file = in.shards.back();
    uint64_t data_bytes = 0;
    for (const std::string& name : file.names()) {
      FP4MOE_CHECK(!in.index_of.contains(name), path, ": tensor '", name, "' is in two shards (",
                   in.shards[in.tensors[in.index_of[name]].shard].path(), " and ", file.path(), ")");
      InputTensor t{in.shards.size() - 1, file.describe(name)};
      data_bytes += t.desc.nbytes;
      in.index_of.emplace(name, in.tensors.size());
      in.tensors.push_back(std::move(t));
    }
    in.shard_data_bytes.push_back(data_bytes);
  }
  // An index that names a tensor its shard lacks describes another checkpoint.
  for (const auto& [name, shard] : indexed) {
    const auto it = in.index_of.find(name);
    FP4MOE_CHECK(it != in.index_of.end() && fs::path(in.shards[in.tensors[it->second].shard].path()).filename() == shard,
                 path, ": model.safetensors.index.json places tensor '", name, "' in ", shard,
                 ", which does not hold it");
  }
  return in;
}

// ------------------------------------------------------------------- plan

// How the rows of one output matrix [rows, cols] come out of an input tensor:
// the input's slice `expert` (or the whole 2-D tensor), seen as [M, cols]
// (transposed: the slice is [cols, M]), rows row_offset, row_offset +
// row_stride, ... That covers plain matrices, [E, N, K] stacks, fused gate_up
// halves and gpt-oss's interleaved gate/up columns.
struct Slice {
  int64_t expert = -1;  // -1: a 2-D input
  bool transposed = false;
  int64_t row_offset = 0;
  int64_t row_stride = 1;
  int64_t rows = 0;
  int64_t cols = 0;
};

struct Matrix {
  std::string module;  // output name without ".weight"
  size_t input = 0;    // input tensor index
  Slice slice;
  std::string group;   // shared global scale key; empty: its own
  // The group is the whole input tensor (a bmm-layout stack): its amax is
  // the tensor's.
  bool group_is_input = false;
};

// One output tensor and where its bytes come from.
struct Output {
  enum Kind { kCopy, kCopyAsF32, kWeight, kWeightScale, kWeightScale2, kBiasSlice } kind = kCopy;
  TensorSpec spec;
  size_t input = 0;     // the input tensor it derives from
  size_t matrix = 0;    // kWeight*: index into Plan::matrices
  Slice slice;          // kBiasSlice: rows of a [E, M] bias (cols = 1)
  uint64_t nbytes = 0;
};

struct Plan {
  std::vector<Matrix> matrices;
  std::vector<Output> outputs;   // in input order, then the order each input emits
  std::vector<std::string> quantized_modules;
  std::vector<std::string> excluded_modules;
  int num_stacks = 0;
};

std::string parent_of(const std::string& module) {
  const size_t dot = module.rfind('.');
  return dot == std::string::npos ? std::string() : module.substr(0, dot);
}
std::string leaf_of(const std::string& module) {
  const size_t dot = module.rfind('.');
  return dot == std::string::npos ? module : module.substr(dot + 1);
}

// The shared-scale group of a quantised linear layer, from its name. ModelOpt
// finds the layers fed by one tensor in a forward pass and gives them
// max(amax) (requantize of fused layers); by name that is q/k/v (or MLA's
// q_a_proj / q_proj with kv_a_proj_with_mqa) of an attention block and
// gate/up (Mixtral w1/w3) of one MLP, shared expert or expert. Other layers
// read an input of their own.
std::string shared_input_group(const std::string& module) {
  static const std::set<std::string> kAttentionInputs = {"q_proj", "k_proj", "v_proj", "q_a_proj",
                                                         "kv_a_proj_with_mqa"};
  static const std::set<std::string> kMlpInputs = {"gate_proj", "up_proj", "w1", "w3"};
  const std::string leaf = leaf_of(module);
  if (kAttentionInputs.contains(leaf)) return parent_of(module) + " (attention input)";
  if (kMlpInputs.contains(leaf)) return parent_of(module) + " (mlp input)";
  return {};
}

bool is_embedding(const std::string& module) { return leaf_of(module).find("embed") != std::string::npos; }

// Numbers inside names compare as numbers, so layers.2 comes before layers.10
// (the module order ModelOpt walks, not the file's alphabetical order).
bool natural_less(const std::string& a, const std::string& b) {
  size_t i = 0, j = 0;
  while (i < a.size() && j < b.size()) {
    if (std::isdigit(static_cast<unsigned char>(a[i])) && std::isdigit(static_cast<unsigned char>(b[j]))) {
      size_t i_end = i, j_end = j;
      while (i_end < a.size() && std::isdigit(static_cast<unsigned char>(a[i_end]))) ++i_end;
      while (j_end < b.size() && std::isdigit(static_cast<unsigned char>(b[j_end]))) ++j_end;
      const std::string na = a.substr(i, i_end - i), nb = b.substr(j, j_end - j);
      if (na.size() != nb.size()) return na.size() < nb.size();
      if (na != nb) return na < nb;
      i = i_end;
      j = j_end;
    } else {
      if (a[i] != b[j]) return a[i] < b[j];
      ++i;
      ++j;
    }
  }
  return a.size() - i < b.size() - j;
}

// hf_quant_config.json's exclude_modules as ModelOpt summarises it: each
// unquantised module is covered by the shortest prefix wildcard cut at a dot
// ("a.b*", or "a.b.*" when the bare "a.b*" would also catch a sibling such
// as "a.bc") that matches no quantised module, else by its own name; names
// already covered add nothing. Sorted.
std::vector<std::string> summarize_excludes(std::vector<std::string> excluded,
                                            const std::vector<std::string>& quantized) {
  // Every wildcard that would match a quantised module.
  std::set<std::string> forbidden;
  for (const std::string& q : quantized) {
    forbidden.insert(q);
    for (size_t len = 0; len <= q.size(); ++len) forbidden.insert(q.substr(0, len) + "*");
  }
  std::sort(excluded.begin(), excluded.end(), natural_less);
  std::set<std::string> summary;
  for (const std::string& name : excluded) {
    std::vector<std::vector<std::string>> candidates;
    for (size_t i = 0; i < name.size(); ++i) {
      if (name[i] != '.') continue;
      candidates.push_back({name.substr(0, i) + "*"});
      candidates.push_back({name.substr(0, i), name.substr(0, i) + ".*"});
    }
    candidates.push_back({name});
    for (const std::vector<std::string>& wildcards : candidates) {
      if (std::any_of(wildcards.begin(), wildcards.end(), [&](const std::string& w) { return forbidden.contains(w); }))
        continue;
      const bool covered = std::all_of(wildcards.begin(), wildcards.end(),
                                       [&](const std::string& w) { return summary.contains(w); });
      // The pair {prefix, prefix.*} is written as prefix.* alone.
      if (!covered) summary.insert(wildcards.back());
      break;
    }
  }
  return {summary.begin(), summary.end()};
}

class Planner {
 public:
  Planner(const Input& in, const QuantizeOptions& opts) : in_(in), opts_(opts) {
    patterns_ = opts.no_default_exclude ? std::vector<std::string>{} : kDefaultExcludes;
    patterns_.insert(patterns_.end(), opts.excludes.begin(), opts.excludes.end());
  }

  Plan make() {
    for (size_t i = 0; i < in_.tensors.size(); ++i) {
      const TensorView& t = in_.tensors[i].desc;
      FP4MOE_CHECK(!t.name.ends_with(".weight_scale") && !t.name.ends_with(".weight_scale_2"), opts_.input,
                   ": tensor '", t.name, "' is a quantisation scale: the checkpoint is already quantised");
      plan_tensor(i);
    }
    return std::move(plan_);
  }

  // A layer is kept in high precision when a pattern matches its quantizer
  // name (ModelOpt's form) or the tensor's own name (what --exclude users
  // see).
  bool excluded(const std::string& module, const std::string& tensor) const {
    const std::string quantizer = module + ".weight_quantizer";
    return std::any_of(patterns_.begin(), patterns_.end(), [&](const std::string& p) {
      return fnmatch(p.c_str(), quantizer.c_str(), 0) == 0 || fnmatch(p.c_str(), tensor.c_str(), 0) == 0;
    });
  }

 private:

  // Tensors transformers keeps in fp32 whatever the load dtype
  // (_keep_in_fp32_modules_strict of the model class): ModelOpt exports
  // what the loaded model holds, so a BF16/F16 input gives them as F32.
  bool kept_in_fp32(const std::string& name) const {
    if (name.ends_with("e_score_correction_bias")) return true;  // DeepSeek-V3, GLM-4.5 MoE, ...
    if (model_type_.starts_with("ernie4_5"))
      return name.ends_with(".gate.weight") || name.find("moe_statics") != std::string::npos;
    return false;
  }

  void add_copy(size_t input) {
    const TensorView& t = in_.tensors[input].desc;
    Output o;
    o.kind = Output::kCopy;
    o.spec = {t.name, t.dtype, t.shape};
    o.input = input;
    o.nbytes = t.nbytes;
    if ((t.dtype == DType::BF16 || t.dtype == DType::F16) && kept_in_fp32(t.name)) {
      o.kind = Output::kCopyAsF32;
      o.spec.dtype = DType::F32;
      o.nbytes = static_cast<uint64_t>(t.numel()) * sizeof(float);
    }
    push(std::move(o));
  }

  void push(Output o) {
    const auto [it, inserted] = owner_.emplace(o.spec.name, o.input);
    FP4MOE_CHECK(inserted, opts_.input, ": tensors '", in_.tensors[it->second].desc.name, "' and '",
                 in_.tensors[o.input].desc.name, "' would both be written as '", o.spec.name, "'");
    plan_.outputs.push_back(std::move(o));
  }

  void add_matrix(const std::string& module, size_t input, const Slice& slice, bool whole_input_group = false) {
    const TensorView& t = in_.tensors[input].desc;
    FP4MOE_CHECK(slice.cols % kNvfp4BlockSize == 0, opts_.input, ": tensor '", t.name, "' ",
                 shape_to_string(t.shape), " has K = ", slice.cols, " columns, not a multiple of ", kNvfp4BlockSize,
                 " (the NVFP4 block size); exclude it with --exclude '", t.name, "'");
    const size_t m = plan_.matrices.size();
    plan_.matrices.push_back(whole_input_group ? Matrix{module, input, slice, t.name + " (stack)", true}
                                               : Matrix{module, input, slice, shared_input_group(module), false});
    plan_.quantized_modules.push_back(module);
    const int64_t rows = slice.rows, cols = slice.cols;
    const auto field = [&](Output::Kind kind, const char* suffix, DType dtype, std::vector<int64_t> shape) {
      Output o;
      o.kind = kind;
      o.spec = {module + suffix, dtype, std::move(shape)};
      o.input = input;
      o.matrix = m;
      o.nbytes = static_cast<uint64_t>(shape_numel(o.spec.shape)) * dtype_size(dtype);
      push(std::move(o));
    };
    // The three fields in this order: the writer computes the matrix at
    // .weight and writes its scales right after.
    field(Output::kWeight, ".weight", DType::U8, {rows, cols / 2});
    field(Output::kWeightScale, ".weight_scale", DType::F8_E4M3, {rows, cols / kNvfp4BlockSize});
    field(Output::kWeightScale2, ".weight_scale_2", DType::F32, {});
  }

  void add_bias(const std::string& name, size_t input, const Slice& slice) {
    const TensorView& t = in_.tensors[input].desc;
    Output o;
    o.kind = Output::kBiasSlice;
    o.spec = {name, t.dtype, {slice.rows}};
    o.input = input;
    o.slice = slice;
    o.nbytes = static_cast<uint64_t>(slice.rows) * dtype_size(t.dtype);
    push(std::move(o));
  }

  const InputTensor* find(const std::string& name) const {
    const auto it = in_.index_of.find(name);
    return it == in_.index_of.end() ? nullptr : &in_.tensors[it->second];
  }

  // A fused gate_up stack's layout, decided by its shapes with down_proj's:
  // transformers' [E, 2I, H] with down [E, H, I] (gate rows first), or the
  // bmm layout of Llama4 / gpt-oss, [E, H, 2I] with down [E, I, H] (gpt-oss
  // interleaves gate and up columns; Llama4 has gate's first).
  struct FusedLayout {
    bool transposed = false;
    bool interleaved = false;
    int64_t inter = 0;
  };
  FusedLayout fused_layout(const std::string& base, const TensorView& gate_up) const {
    const InputTensor* down = find(base + ".down_proj");
    FP4MOE_CHECK(down != nullptr && down->desc.shape.size() == 3, opts_.input, ": '", gate_up.name, "' ",
                 shape_to_string(gate_up.shape), " has no 3-D '", base, ".down_proj' beside it");
    const std::vector<int64_t>& g = gate_up.shape;
    const std::vector<int64_t>& d = down->desc.shape;
    FP4MOE_CHECK(d[0] == g[0], opts_.input, ": '", gate_up.name, "' ", shape_to_string(g), " and '",
                 down->desc.name, "' ", shape_to_string(d), " give different expert counts");
    FusedLayout layout;
    if (g[1] == 2 * d[2] && g[2] == d[1]) {
      layout.inter = d[2];
    } else if (g[2] == 2 * d[1] && g[1] == d[2]) {
      layout.transposed = true;
      layout.inter = d[1];
      layout.interleaved = model_type_ == "gpt_oss" || find(base + ".gate_up_proj_bias") != nullptr;
    } else {
      FP4MOE_THROW(opts_.input, ": '", gate_up.name, "' ", shape_to_string(g), " and '", down->desc.name, "' ",
                   shape_to_string(d), " are neither [E, 2I, H] with [E, H, I] nor [E, H, 2I] with [E, I, H]");
    }
    return layout;
  }

  void plan_tensor(size_t i) {
    const TensorView& t = in_.tensors[i].desc;
    const bool is_float = is_float_dtype(t.dtype);
    static const std::regex kStack(R"((.*\.experts)\.(gate_up_proj|gate_proj|up_proj|down_proj)(\.weight)?)");
    static const std::regex kStackBias(R"((.*\.experts)\.(gate_up_proj|down_proj)_bias)");
    std::smatch match;

    // 2-D linear (or embedding) weights.
    if (is_float && t.shape.size() == 2 && t.name.ends_with(".weight")) {
      const std::string module = t.name.substr(0, t.name.size() - 7);
      if (excluded(module, t.name) || (!opts_.no_default_exclude && is_embedding(module))) {
        plan_.excluded_modules.push_back(module);
        add_copy(i);
      } else {
        add_matrix(module, i, Slice{-1, false, 0, 1, t.shape[0], t.shape[1]});
      }
      return;
    }

    // 3-D expert stacks, split per expert.
    if (is_float && t.shape.size() == 3 && std::regex_match(t.name, match, kStack)) {
      const std::string base = match[1];
      const std::string proj = match[2];
      if (excluded(base, t.name)) {  // only an explicit --exclude reaches here
        plan_.excluded_modules.push_back(base);
        add_copy(i);
        return;
      }
      const int64_t num_experts = t.shape[0];
      const bool bare = !match[3].matched;  // transformers' fused experts name no ".weight"
      ++plan_.num_stacks;
      // ModelOpt quantises a bmm-layout stack (Llama4, gpt-oss) with one
      // quantizer per stack, so every expert's gate/up (and down) gets the
      // stack's amax; split with that scale, each expert's tensors are the
      // rows of ModelOpt's fused export bit for bit. transformers' fused
      // experts have a quantizer per expert: gate and up share the expert's.
      for (int64_t e = 0; e < num_experts; ++e) {
        const std::string expert = base + "." + std::to_string(e) + ".";
        if (proj == "gate_up_proj") {
          const FusedLayout l = fused_layout(base, t);
          const int64_t stride = l.interleaved ? 2 : 1;
          const int64_t up_offset = l.interleaved ? 1 : l.inter;
          const int64_t cols = l.transposed ? t.shape[1] : t.shape[2];
          add_matrix(expert + "gate_proj", i, Slice{e, l.transposed, 0, stride, l.inter, cols}, l.transposed);
          add_matrix(expert + "up_proj", i, Slice{e, l.transposed, up_offset, stride, l.inter, cols}, l.transposed);
        } else {
          // down_proj beside a bmm-layout gate_up is [E, I, H]: transposed.
          bool transposed = false;
          if (proj == "down_proj" && bare) {
            if (const InputTensor* gu = find(base + ".gate_up_proj"); gu != nullptr && gu->desc.shape.size() == 3)
              transposed = fused_layout(base, gu->desc).transposed;
          }
          const int64_t rows = transposed ? t.shape[2] : t.shape[1];
          const int64_t cols = transposed ? t.shape[1] : t.shape[2];
          add_matrix(expert + proj, i, Slice{e, transposed, 0, 1, rows, cols}, transposed);
        }
      }
      return;
    }

    // Biases of fused experts (gpt-oss), split like their weights.
    if (is_float && t.shape.size() == 2 && std::regex_match(t.name, match, kStackBias)) {
      const std::string base = match[1];
      const std::string proj = match[2];
      const InputTensor* weight = find(base + "." + proj);
      FP4MOE_CHECK(weight != nullptr && weight->desc.shape.size() == 3, opts_.input, ": bias '", t.name,
                   "' has no 3-D '", base, ".", proj, "' beside it");
      if (excluded(base, weight->desc.name)) {  // its stack is copied whole: so is the bias
        add_copy(i);
        return;
      }
      const int64_t num_experts = t.shape[0];
      for (int64_t e = 0; e < num_experts; ++e) {
        const std::string expert = base + "." + std::to_string(e) + ".";
        if (proj == "gate_up_proj") {
          const FusedLayout l = fused_layout(base, weight->desc);
          FP4MOE_CHECK(t.shape[1] == 2 * l.inter, opts_.input, ": bias '", t.name, "' ", shape_to_string(t.shape),
                       " does not match 2 * I = ", 2 * l.inter);
          const int64_t stride = l.interleaved ? 2 : 1;
          add_bias(expert + "gate_proj.bias", i, Slice{e, false, 0, stride, l.inter, 1});
          add_bias(expert + "up_proj.bias", i, Slice{e, false, l.interleaved ? 1 : l.inter, stride, l.inter, 1});
        } else {
          add_bias(expert + "down_proj.bias", i, Slice{e, false, 0, 1, t.shape[1], 1});
        }
      }
      return;
    }

    // Any other multi-dimensional float tensor of the experts is a layout
    // this tool does not know: copying it unquantised would give a checkpoint
    // that claims NVFP4 experts and holds float ones.
    FP4MOE_CHECK(!(t.shape.size() >= 3 && t.name.find(".experts.") != std::string::npos), opts_.input,
                 ": tensor '", t.name, "' ", dtype_name(t.dtype), " ", shape_to_string(t.shape),
                 " is a stacked expert tensor ",
                 is_float ? "of a layout fp4moe does not know" : "that is not float (already quantised, e.g. MXFP4?)",
                 "; refusing to copy it unquantised (expected float "
                 "<p>experts.{gate_up_proj,gate_proj,up_proj,down_proj}[.weight] [E, N, K])");
    add_copy(i);
  }

 public:
  std::string model_type_;

 private:
  const Input& in_;
  const QuantizeOptions& opts_;
  std::vector<std::string> patterns_;
  Plan plan_;
  std::map<std::string, size_t> owner_;  // output name -> input tensor
};

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

// ------------------------------------------------------------- interrupts

// Ctrl-C or SIGTERM during a long run: the work stops at the next tensor
// and the temporary output is removed like after any error (a second signal
// kills at once: the handler restores the default).
volatile std::sig_atomic_t g_interrupt_signal = 0;

extern "C" void on_interrupt(int sig) {
  g_interrupt_signal = sig;
  std::signal(sig, SIG_DFL);
}

class InterruptGuard {
 public:
  InterruptGuard() {
    g_interrupt_signal = 0;
    previous_int_ = std::signal(SIGINT, on_interrupt);
    previous_term_ = std::signal(SIGTERM, on_interrupt);
    // A signal the caller ignores (nohup, a background job) stays ignored.
    if (previous_int_ == SIG_IGN) std::signal(SIGINT, SIG_IGN);
    if (previous_term_ == SIG_IGN) std::signal(SIGTERM, SIG_IGN);
  }
  ~InterruptGuard() {
    std::signal(SIGINT, previous_int_);
    std::signal(SIGTERM, previous_term_);
  }
  InterruptGuard(const InterruptGuard&) = delete;
  InterruptGuard& operator=(const InterruptGuard&) = delete;
  static void check() {
    FP4MOE_CHECK(g_interrupt_signal == 0, "quantize: interrupted by signal ", static_cast<int>(g_interrupt_signal),
                 "; nothing was written");
  }

 private:
  void (*previous_int_)(int) = SIG_DFL;
  void (*previous_term_)(int) = SIG_DFL;
};

// ------------------------------------------------------------------ output

struct Shard {
  std::string file;                  // name inside the output directory (or the output file)
  std::vector<size_t> outputs;       // indices into Plan::outputs, in order
  uint64_t data_bytes = 0;
};

// Packs the outputs, in order, into shards of at most `max_bytes` each (a
// tensor larger than that gets a shard of its own), named as transformers
// names them.
std::vector<Shard> make_shards(const Plan& plan, uint64_t max_bytes) {
  std::vector<Shard> shards(1);
  for (size_t k = 0; k < plan.outputs.size(); ++k) {
    const uint64_t n = plan.outputs[k].nbytes;
    if (!shards.back().outputs.empty() && shards.back().data_bytes + n > max_bytes) shards.emplace_back();
    shards.back().outputs.push_back(k);
    shards.back().data_bytes += n;
  }
  const size_t count = shards.size();
  for (size_t s = 0; s < count; ++s) {
    char name[64];
    std::snprintf(name, sizeof name, "model-%05zu-of-%05zu.safetensors", s + 1, count);
    shards[s].file = name;
  }
  return shards;
}

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
  config["producer"] = {{"name", "fp4moe"}, {"version", FP4MOE_VERSION}};
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

void run_quantize(QuantizeOptions opts) {
  Timer timer;
  // "out/" names the directory "out"; its temporary sibling is "out.tmp.<pid>".
  while (opts.output.size() > 1 && opts.output.back() == '/') opts.output.pop_back();
  FP4MOE_CHECK(opts.algo == kAlgo,
               opts.algo == "NVFP4"
                   ? std::string("--algo NVFP4 (W4A4) needs each layer's input_scale, an activation range "
                                 "calibrated by running the model on data, which quantize cannot compute; use "
                                 "--algo W4A16_NVFP4 (weight-only, the default) or calibrate with ModelOpt")
                   : "--algo " + opts.algo + " is not supported; expected W4A16_NVFP4");

  const bool dir_input = fs::is_directory(opts.input);
  const fs::path out_path = fs::path(opts.output);
  if (dir_input) {
    const fs::path parent = fs::absolute(out_path).parent_path();
    FP4MOE_CHECK(fs::is_directory(parent), "output ", opts.output, ": directory ", parent.string(), " does not exist");
    FP4MOE_CHECK(!fs::exists(out_path) || (fs::is_directory(out_path) && fs::is_empty(out_path)), "output ",
                 opts.output, " exists and is not an empty directory; a checkpoint directory is written as a new "
                 "directory");
  } else {
    check_output_path(opts.output);
    std::error_code ec;
    FP4MOE_CHECK(!fs::equivalent(opts.input, opts.output, ec), "output ", opts.output,
                 " is the input file; write the quantised checkpoint elsewhere");
  }

  Input in = open_input(opts.input);
  Planner planner(in, opts);
  ordered_json model_config;
  // config.json: copied with quantization_config for a directory; for a
  // file, only its model_type is read (a shard's layout hint, e.g. gpt-oss).
  const fs::path config_path = in.dir / "config.json";
  if (fs::exists(config_path)) {
    ordered_json config = read_json(config_path);
    FP4MOE_CHECK(config.is_object(), config_path.string(), ": expected a JSON object");
    if (config.contains("model_type") && config["model_type"].is_string())
      planner.model_type_ = config["model_type"].get<std::string>();
    if (dir_input) {
      FP4MOE_CHECK(!config.contains("quantization_config"), config_path.string(),
                   ": the model already has a quantization_config; quantize reads float checkpoints");
      model_config = std::move(config);
    }
  }
  Plan plan = planner.make();
  // A tied lm_head has no tensor of its own but is a module ModelOpt lists
  // as kept: a causal LM without lm_head.weight has one (config.json may
  // leave tie_word_embeddings out when it is the class default).
  if (!model_config.is_null() && !in.index_of.contains("lm_head.weight")) {
    bool causal_lm = false;
    if (model_config.contains("architectures") && model_config["architectures"].is_array())
      for (const ordered_json& arch : model_config["architectures"])
        causal_lm |= arch.is_string() && arch.get<std::string>().ends_with("ForCausalLM");
    const bool tied = model_config.contains("tie_word_embeddings") && model_config["tie_word_embeddings"] == true;
    if ((causal_lm || tied) && planner.excluded("lm_head", "lm_head.weight")) plan.excluded_modules.push_back("lm_head");
  }
  const ordered_json quant_config = hf_quant_config(summarize_excludes(plan.excluded_modules, plan.quantized_modules));

  // A shared scale needs the amax of its whole group before the first
  // member is written. Members in other input tensors (separate q/k/v,
  // gate/up) are read then and stay cached by their file until their own
  // turn, which comes soon after: every tensor is read once, and memory
  // holds at most one group's tensors.
  std::map<std::string, std::vector<size_t>> group_members;
  for (size_t m = 0; m < plan.matrices.size(); ++m)
    if (!plan.matrices[m].group.empty()) group_members[plan.matrices[m].group].push_back(m);

  const InterruptGuard interrupt_guard;
  uint64_t input_bytes = 0;
  for (const InputTensor& t : in.tensors) input_bytes += t.desc.nbytes;
  Progress progress("quantize", static_cast<int64_t>(input_bytes), !opts.quiet && input_bytes >= kProgressMinBytes,
                    Progress::Unit::kBytes);

  std::map<std::string, float> group_amax;
  const auto load = [&](size_t i) -> const TensorView& {
    const InputTensor& t = in.tensors[i];
    return in.shards[t.shard].get(t.desc.name);
  };
  const auto release = [&](size_t i) { in.shards[in.tensors[i].shard].release(in.tensors[i].desc.name); };

  // Output layout: a directory gets shards no larger than the input's
  // largest; as transformers' save_pretrained (and so ModelOpt's export)
  // names them, a single shard is model.safetensors, without an index.
  std::vector<Shard> shards;
  if (dir_input && in.sharded) {
    shards = make_shards(plan, *std::max_element(in.shard_data_bytes.begin(), in.shard_data_bytes.end()));
  } else {
    shards = make_shards(plan, UINT64_MAX);
  }
  if (shards.size() == 1) shards[0].file = dir_input ? "model.safetensors" : out_path.filename().string();

  const fs::path tmp_dir = dir_input ? fs::path(opts.output + ".tmp." + std::to_string(::getpid())) : fs::path();
  TempOutput cleanup(tmp_dir);
  if (dir_input) {
    std::error_code ec;
    fs::remove_all(tmp_dir, ec);
    FP4MOE_CHECK(fs::create_directory(tmp_dir, ec) && !ec, "output ", opts.output, ": cannot create '",
                 tmp_dir.string(), "': ", ec ? ec.message() : "it exists");
  }
  const auto shard_path = [&](const Shard& s) {
    return dir_input ? (tmp_dir / s.file).string() : opts.output;
  };

  // Metadata: ModelOpt's shards carry {"format": "pt"}; a single output file
  // also describes its quantisation, having no hf_quant_config.json beside it.
  std::map<std::string, std::string> metadata = {{"format", "pt"}};
  if (!dir_input) {
    for (const auto& [key, value] : in.shards[0].metadata()) metadata.emplace(key, value);
    metadata["quant_algo"] = kAlgo;
    metadata["group_size"] = std::to_string(kNvfp4BlockSize);
    metadata["hf_quant_config"] = quant_config.dump();
  }

  // Stream: inputs in order, each input's outputs as planned, into the
  // shard that holds them.
  std::vector<size_t> shard_of(plan.outputs.size());
  for (size_t s = 0; s < shards.size(); ++s)
    for (size_t k : shards[s].outputs) shard_of[k] = s;
  std::unique_ptr<SafetensorsStreamWriter> writer;
  size_t writer_shard = SIZE_MAX;
  const auto sink = [&](size_t k, const void* data, size_t nbytes) {
    InterruptGuard::check();
    if (shard_of[k] != writer_shard) {
      if (writer) writer->commit();
      writer_shard = shard_of[k];
      std::vector<TensorSpec> specs;
      for (size_t o : shards[writer_shard].outputs) specs.push_back(plan.outputs[o].spec);
      writer = std::make_unique<SafetensorsStreamWriter>(shard_path(shards[writer_shard]), std::move(specs),
                                                         metadata);
    }
    writer->write(plan.outputs[k].spec.name, data, nbytes);
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
          sink(k, view.data, view.nbytes);
          ++num_copied;
          break;
        case Output::kCopyAsF32: {
          const std::vector<float> values = tensor_to_float(view);  // exact: BF16/F16 -> F32
          sink(k, values.data(), values.size() * sizeof(float));
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
          sink(k, current.packed.data(), current.packed.size());
          progress.advance(0, m.module);
          break;
        }
        case Output::kWeightScale:
          sink(k, current.scales.data(), current.scales.size());
          break;
        case Output::kWeightScale2:
          sink(k, &current.global_scale, sizeof(float));
          break;
        case Output::kBiasSlice: {
          const size_t element = dtype_size(view.dtype);
          const int64_t width = view.shape[1];
          std::vector<uint8_t> bytes(static_cast<size_t>(o.slice.rows) * element);
          for (int64_t r = 0; r < o.slice.rows; ++r) {
            const int64_t src = o.slice.expert * width + o.slice.row_offset + r * o.slice.row_stride;
            std::memcpy(bytes.data() + r * element, view.data + src * element, element);
          }
          sink(k, bytes.data(), bytes.size());
          break;
        }
      }
    }
    release(i);
    progress.advance(static_cast<int64_t>(in.tensors[i].desc.nbytes), in.tensors[i].desc.name);
  }
  if (!writer && !shards[0].outputs.empty()) FP4MOE_THROW("quantize: nothing was written (internal)");
  if (!writer) {  // an input without tensors still gives a valid (empty) file
    writer = std::make_unique<SafetensorsStreamWriter>(shard_path(shards[0]), std::vector<TensorSpec>{}, metadata);
  }
  writer->commit();
  progress.finish();

  if (dir_input) {
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
    // The directory's other files (tokenizer, generation config, ...) as they are.
    static const std::set<std::string> kWritten = {"config.json", "hf_quant_config.json",
                                                   "model.safetensors.index.json"};
    for (const fs::directory_entry& entry : fs::directory_iterator(in.dir)) {
      const std::string name = entry.path().filename().string();
      if (!entry.is_regular_file() || name.starts_with(".") || kWritten.contains(name) ||
          entry.path().extension() == ".safetensors" || kSkippedExtensions.contains(entry.path().extension().string()))
        continue;
      std::error_code ec;
      fs::copy_file(entry.path(), tmp_dir / name, ec);
      FP4MOE_CHECK(!ec, entry.path().string(), ": cannot copy into the output: ", ec.message());
    }
    std::error_code ec;
    if (fs::exists(out_path)) fs::remove(out_path, ec);  // an empty directory, checked above
    fs::rename(tmp_dir, out_path, ec);
    FP4MOE_CHECK(!ec, "output ", opts.output, ": cannot rename '", tmp_dir.string(), "' to it: ", ec.message());
    cleanup.release();
  }

  std::fprintf(stderr,
               "quantize: %s (%s) -> %s: %zu matrices quantised to %s (%d expert stacks split), %d tensors "
               "copied, %zu shard%s, %.1f s\n",
               opts.input.c_str(), format_bytes(static_cast<double>(input_bytes)).c_str(), opts.output.c_str(),
               plan.matrices.size(), kAlgo, plan.num_stacks, num_copied, shards.size(),
               shards.size() == 1 ? "" : "s", timer.elapsed_ms() / 1e3);
}

}  // namespace

void add_quantize_command(CLI::App& app) {
  auto opts = std::make_shared<QuantizeOptions>();
  CLI::App* cmd = app.add_subcommand(
      "quantize",
      "Quantise a float checkpoint (F32/BF16/F16) to NVIDIA ModelOpt NVFP4, as ModelOpt's W4A16_NVFP4 export "
      "writes it: every linear '<m>.weight' [N, K] becomes weight (U8 [N, K/2]), weight_scale (F8_E4M3 "
      "[N, K/16]) and weight_scale_2 (F32); stacked experts ('<p>experts.gate_up_proj' [E, 2I, H] or Llama4/"
      "gpt-oss [E, H, 2I], '<p>experts.{gate,up,down}_proj[.weight]') are split into "
      "'<p>experts.<e>.<proj>.*'. q/k/v of an attention block and gate/up of an MLP or expert share "
      "weight_scale_2. Routers, lm_head, embeddings and the other layers ModelOpt keeps are copied bit for "
      "bit, as is everything else. IN is a .safetensors file (OUT: a file) or a checkpoint directory (OUT: a "
      "new directory with shards sized like IN's, model.safetensors.index.json, hf_quant_config.json, "
      "config.json with quantization_config, and IN's other files). Memory is bounded by the largest tensor; "
      "the output appears only when complete.");
  cmd->add_option("IN", opts->input, "input .safetensors file or checkpoint directory with float weights")
      ->required()
      ->check(CLI::ExistingPath);
  cmd->add_option("OUT", opts->output, "output .safetensors file, or directory when IN is one")->required();
  cmd->add_option("--algo", opts->algo,
                  "W4A16_NVFP4 (default; weight-only NVFP4, no input_scale). NVFP4 (W4A4) is refused: its "
                  "input_scale needs activations calibrated on data")
      ->capture_default_str();
  cmd->add_option("--exclude", opts->excludes,
                  "glob of tensor or module names to keep unquantised (repeatable), e.g. '*layers.0.*'")
      ->allow_extra_args(false);
  cmd->add_flag("--no-default-exclude", opts->no_default_exclude,
                "also quantise embeddings and what ModelOpt keeps in high precision: " + [] {
                  std::string list;
                  for (const std::string& p : kDefaultExcludes) list += (list.empty() ? "" : " ") + p;
                  return list;
                }());
  cmd->add_flag("-q,--quiet", opts->quiet, "no progress line");
  cmd->callback([opts] {
    try {
      run_quantize(*opts);
    } catch (const fs::filesystem_error& e) {
      // A file system failure is the user's environment, not a bug: one line.
      FP4MOE_THROW("quantize: ", e.what());
    }
  });
}

}  // namespace fp4moe::cli
