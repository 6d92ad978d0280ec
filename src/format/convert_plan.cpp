// Planning a checkpoint conversion from the input's headers alone
// (convert_plan.hpp): the input's shards and tensors, and the outputs each
// tensor becomes: a linear weight three NVFP4 fields, an expert stack those
// per expert, a fused experts' bias its per-expert slices, anything else a
// copy.
// Tested through `fp4moe quantize` in tests/tools/test_quantize.cpp.
#include "format/convert_plan.hpp"

#include <fnmatch.h>

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <fstream>
#include <regex>
#include <set>
#include <sstream>

#include <nlohmann/json.hpp>

#include "format/tensor_values.hpp"
#include "fp4moe/error.hpp"
#include "fp4moe/nvfp4.hpp"

namespace fp4moe {

const std::vector<std::string>& default_quantize_excludes() {
  static const std::vector<std::string> kDefaultExcludes = {"*block_sparse_moe.gate*",
                                                            "*linear_attn.conv1d*",
                                                            "*self_attention.conv1d*",
                                                            "*linear_attn.in_proj_a*",
                                                            "*linear_attn.in_proj_b*",
                                                            "*lm_head*",
                                                            "*mixer.conv1d*",
                                                            "*mlp.gate.*",
                                                            "*mlp.shared_expert_gate.*",
                                                            "*output_layer*",
                                                            "*proj_out.*",
                                                            "*router*",
                                                            "mtp.*",
                                                            "output.*",
                                                            "*embed_vision*",
                                                            "*vision_tower*",
                                                            "*visual*",
                                                            "*vision_model*",
                                                            "*multi_modal_projector*"};
  return kDefaultExcludes;
}

namespace convert {

namespace fs = std::filesystem;
using nlohmann::ordered_json;

namespace {

std::string read_text_file(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  FP4MOE_CHECK(in.good(), path.string(), ": cannot open for reading");
  std::stringstream ss;
  ss << in.rdbuf();
  FP4MOE_CHECK(!in.bad(), path.string(), ": read failed");
  return ss.str();
}

}  // namespace

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
    FP4MOE_CHECK(
        it != in.index_of.end() && fs::path(in.shards[in.tensors[it->second].shard].path()).filename() == shard, path,
        ": model.safetensors.index.json places tensor '", name, "' in ", shard, ", which does not hold it");
  }
  return in;
}

namespace {

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

}  // namespace

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
      const bool covered =
          std::all_of(wildcards.begin(), wildcards.end(), [&](const std::string& w) { return summary.contains(w); });
      // The pair {prefix, prefix.*} is written as prefix.* alone.
      if (!covered) summary.insert(wildcards.back());
      break;
    }
  }
  return {summary.begin(), summary.end()};
}

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

Planner::Planner(const Input& in, const std::string& input_path, const QuantizeCheckpointOptions& opts,
                 std::string model_type)
    : in_(in), input_path_(input_path), opts_(opts), model_type_(std::move(model_type)) {
  patterns_ = opts.no_default_exclude ? std::vector<std::string>{} : default_quantize_excludes();
  patterns_.insert(patterns_.end(), opts.excludes.begin(), opts.excludes.end());
}

Plan Planner::make() {
  for (size_t i = 0; i < in_.tensors.size(); ++i) {
    const TensorView& t = in_.tensors[i].desc;
    FP4MOE_CHECK(!t.name.ends_with(".weight_scale") && !t.name.ends_with(".weight_scale_2"), input_path_, ": tensor '",
                 t.name, "' is a quantisation scale: the checkpoint is already quantised");
    plan_tensor(i);
  }
  return std::move(plan_);
}

bool Planner::excluded(const std::string& module, const std::string& tensor) const {
  const std::string quantizer = module + ".weight_quantizer";
  return std::any_of(patterns_.begin(), patterns_.end(), [&](const std::string& p) {
    return fnmatch(p.c_str(), quantizer.c_str(), 0) == 0 || fnmatch(p.c_str(), tensor.c_str(), 0) == 0;
  });
}

// Tensors transformers keeps in fp32 whatever the load dtype
// (_keep_in_fp32_modules_strict of the model class): ModelOpt exports
// what the loaded model holds, so a BF16/F16 input gives them as F32.
bool Planner::kept_in_fp32(const std::string& name) const {
  if (name.ends_with("e_score_correction_bias")) return true;  // DeepSeek-V3, GLM-4.5 MoE, ...
  if (model_type_.starts_with("ernie4_5"))
    return name.ends_with(".gate.weight") || name.find("moe_statics") != std::string::npos;
  return false;
}

void Planner::add_copy(size_t input) {
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

void Planner::push(Output o) {
  const auto [it, inserted] = owner_.emplace(o.spec.name, o.input);
  FP4MOE_CHECK(inserted, input_path_, ": tensors '", in_.tensors[it->second].desc.name, "' and '",
               in_.tensors[o.input].desc.name, "' would both be written as '", o.spec.name, "'");
  plan_.outputs.push_back(std::move(o));
}

void Planner::add_matrix(const std::string& module, size_t input, const Slice& slice, bool whole_input_group) {
  const TensorView& t = in_.tensors[input].desc;
  FP4MOE_CHECK(slice.cols % kNvfp4BlockSize == 0, input_path_, ": tensor '", t.name, "' ", shape_to_string(t.shape),
               " has K = ", slice.cols, " columns, not a multiple of ", kNvfp4BlockSize,
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

void Planner::add_bias(const std::string& name, size_t input, const Slice& slice) {
  const TensorView& t = in_.tensors[input].desc;
  Output o;
  o.kind = Output::kBiasSlice;
  o.spec = {name, t.dtype, {slice.rows}};
  o.input = input;
  o.slice = slice;
  o.nbytes = static_cast<uint64_t>(slice.rows) * dtype_size(t.dtype);
  push(std::move(o));
}

const InputTensor* Planner::find(const std::string& name) const {
  const auto it = in_.index_of.find(name);
  return it == in_.index_of.end() ? nullptr : &in_.tensors[it->second];
}

// A fused gate_up stack's layout, decided by its shapes with down_proj's:
// transformers' [E, 2I, H] with down [E, H, I] (gate rows first), or the
// bmm layout of Llama4 / gpt-oss, [E, H, 2I] with down [E, I, H] (gpt-oss
// interleaves gate and up columns; Llama4 has gate's first).
Planner::FusedLayout Planner::fused_layout(const std::string& base, const TensorView& gate_up) const {
  const InputTensor* down = find(base + ".down_proj");
  FP4MOE_CHECK(down != nullptr && down->desc.shape.size() == 3, input_path_, ": '", gate_up.name, "' ",
               shape_to_string(gate_up.shape), " has no 3-D '", base, ".down_proj' beside it");
  const std::vector<int64_t>& g = gate_up.shape;
  const std::vector<int64_t>& d = down->desc.shape;
  FP4MOE_CHECK(d[0] == g[0], input_path_, ": '", gate_up.name, "' ", shape_to_string(g), " and '", down->desc.name,
               "' ", shape_to_string(d), " give different expert counts");
  FusedLayout layout;
  if (g[1] == 2 * d[2] && g[2] == d[1]) {
    layout.inter = d[2];
  } else if (g[2] == 2 * d[1] && g[1] == d[2]) {
    layout.transposed = true;
    layout.inter = d[1];
    layout.interleaved = model_type_ == "gpt_oss" || find(base + ".gate_up_proj_bias") != nullptr;
  } else {
    FP4MOE_THROW(input_path_, ": '", gate_up.name, "' ", shape_to_string(g), " and '", down->desc.name, "' ",
                 shape_to_string(d), " are neither [E, 2I, H] with [E, H, I] nor [E, H, 2I] with [E, I, H]");
  }
  return layout;
}

void Planner::plan_tensor(size_t i) {
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
    // transformers' fused experts name no ".weight".
    plan_expert_stack(i, match[1], match[2], !match[3].matched);
    return;
  }

  // Biases of fused experts (gpt-oss), split like their weights.
  if (is_float && t.shape.size() == 2 && std::regex_match(t.name, match, kStackBias)) {
    plan_expert_bias(i, match[1], match[2]);
    return;
  }

  // Any other multi-dimensional float tensor of the experts is a layout
  // this tool does not know: copying it unquantised would give a checkpoint
  // that claims NVFP4 experts and holds float ones.
  FP4MOE_CHECK(!(t.shape.size() >= 3 && t.name.find(".experts.") != std::string::npos), input_path_, ": tensor '",
               t.name, "' ", dtype_name(t.dtype), " ", shape_to_string(t.shape), " is a stacked expert tensor ",
               is_float ? "of a layout fp4moe does not know" : "that is not float (already quantised, e.g. MXFP4?)",
               "; refusing to copy it unquantised (expected float "
               "<p>experts.{gate_up_proj,gate_proj,up_proj,down_proj}[.weight] [E, N, K])");
  add_copy(i);
}

// A 3-D expert stack "<base>.<proj>[.weight]", split into each expert's
// matrices; `bare` when it has no ".weight".
void Planner::plan_expert_stack(size_t i, const std::string& base, const std::string& proj, bool bare) {
  const TensorView& t = in_.tensors[i].desc;
  if (excluded(base, t.name)) {  // only an explicit --exclude reaches here
    plan_.excluded_modules.push_back(base);
    add_copy(i);
    return;
  }
  const int64_t num_experts = t.shape[0];
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
}

// A fused experts' bias "<base>.<proj>_bias" [E, M], split like its weight.
void Planner::plan_expert_bias(size_t i, const std::string& base, const std::string& proj) {
  const TensorView& t = in_.tensors[i].desc;
  const InputTensor* weight = find(base + "." + proj);
  FP4MOE_CHECK(weight != nullptr && weight->desc.shape.size() == 3, input_path_, ": bias '", t.name, "' has no 3-D '",
               base, ".", proj, "' beside it");
  if (excluded(base, weight->desc.name)) {  // its stack is copied whole: so is the bias
    add_copy(i);
    return;
  }
  const int64_t num_experts = t.shape[0];
  for (int64_t e = 0; e < num_experts; ++e) {
    const std::string expert = base + "." + std::to_string(e) + ".";
    if (proj == "gate_up_proj") {
      const FusedLayout l = fused_layout(base, weight->desc);
      FP4MOE_CHECK(t.shape[1] == 2 * l.inter, input_path_, ": bias '", t.name, "' ", shape_to_string(t.shape),
                   " does not match 2 * I = ", 2 * l.inter);
      const int64_t stride = l.interleaved ? 2 : 1;
      add_bias(expert + "gate_proj.bias", i, Slice{e, false, 0, stride, l.inter, 1});
      add_bias(expert + "up_proj.bias", i, Slice{e, false, l.interleaved ? 1 : l.inter, stride, l.inter, 1});
    } else {
      add_bias(expert + "down_proj.bias", i, Slice{e, false, 0, 1, t.shape[1], 1});
    }
  }
}

}  // namespace convert
}  // namespace fp4moe
