// `fp4moe quantize IN OUT`: float safetensors checkpoint -> NVIDIA ModelOpt
// NVFP4 checkpoint (design: numerics contract of the project README).
//
//   <name>.weight [N, K] (2-D, float)      -> <name>.weight U8 [N, K/2],
//                                             <name>.weight_scale F8_E4M3 [N, K/16],
//                                             <name>.weight_scale_2 F32 [],
//                                             <name>.input_scale F32 [] = 1
//   <p>experts.<proj>.weight [E, N, K]     -> the same per expert, named
//     (3-D stack, proj = gate/up/down_proj)   <p>experts.<e>.<proj>.*
//   anything else                          -> copied unchanged
//
// Gate and up of one expert share weight_scale_2 = max(amax_gate, amax_up) /
// 2688, whether they come as 2-D per-expert tensors or as 3-D stacks. Layers
// ModelOpt leaves unquantised (router gates, lm_head, embeddings) are copied
// unless --no-default-exclude. Tested in tests/tools/test_cli.cpp (bit
// equality with quantize_nvfp4, shared scales, copies, K % 16 errors).
#include <fnmatch.h>

#include <algorithm>
#include <cstdio>
#include <map>
#include <memory>
#include <regex>
#include <set>

#include <nlohmann/json.hpp>

#include "cli_util.hpp"
#include "commands.hpp"
#include "fp4moe/error.hpp"
#include "fp4moe/modelopt.hpp"
#include "fp4moe/nvfp4.hpp"
#include "fp4moe/safetensors.hpp"
#include "util/parallel.hpp"

namespace fp4moe::cli {
namespace {

// What ModelOpt's NVFP4 export keeps in high precision (its default
// "disabled" quantizer patterns, for the layers that are 2-D *.weight here).
const std::vector<std::string> kDefaultExcludes = {
    "*lm_head*", "*embed_tokens*", "*router*", "*mlp.gate.*", "*block_sparse_moe.gate.*",
    "*shared_expert_gate*", "*output_layer*"};

// Above this input size the per-tensor progress line is shown.
constexpr size_t kProgressMinBytes = size_t{64} << 20;

struct QuantizeOptions {
  std::string input;
  std::string output;
  std::vector<std::string> excludes;
  bool no_default_exclude = false;
  bool quiet = false;
};

// How one input tensor is handled.
struct TensorPlan {
  enum Kind { kCopy, kMatrix, kStack } kind = kCopy;
  std::string base;          // kMatrix: output name without ".weight"
  std::string experts_base;  // expert tensors: "<p>experts"
  std::string proj;          // expert tensors: gate_proj, up_proj or down_proj
  int64_t expert_idx = -1;   // 2-D expert tensors: the expert's index

  int64_t num_matrices(const TensorView& view) const { return kind == kStack ? view.shape[0] : 1; }
  // Output name (without ".weight") of matrix `e` of this tensor.
  std::string output_base(int64_t e) const {
    return kind == kStack ? experts_base + "." + std::to_string(e) + "." + proj : base;
  }
  // Gate and up of one expert share their global scale under this key;
  // empty for matrices with a scale of their own.
  std::string pair_key(int64_t e) const {
    if (proj != "gate_proj" && proj != "up_proj") return {};
    return experts_base + "." + std::to_string(kind == kStack ? e : expert_idx);
  }
};

// quantize_nvfp4 over row chunks on all cores. Rows are quantised
// independently given the global scale, so the result equals one call.
Nvfp4Matrix quantize_rows_parallel(const float* weights, int64_t rows, int64_t cols,
                                   float global_scale) {
  // Parts of at least 2^18 values, at most one per hardware thread.
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
  out.input_scale = parts[0].input_scale;
  out.packed.reserve(static_cast<size_t>(rows * cols / 2));
  out.scales.reserve(static_cast<size_t>(rows * cols / kNvfp4BlockSize));
  for (const Nvfp4Matrix& part : parts) {
    out.packed.insert(out.packed.end(), part.packed.begin(), part.packed.end());
    out.scales.insert(out.scales.end(), part.scales.begin(), part.scales.end());
  }
  return out;
}

// Adds the four ModelOpt tensors of one quantised matrix. input_scale is 1:
// the checkpoint carries no activation calibration.
void add_quantized(SafetensorsWriter& writer, const std::string& base, const Nvfp4Matrix& m) {
  writer.add(base + ".weight", DType::U8, {m.rows, m.cols / 2}, m.packed.data(), m.packed.size());
  writer.add(base + ".weight_scale", DType::F8_E4M3, {m.rows, m.cols / kNvfp4BlockSize},
             m.scales.data(), m.scales.size());
  const float input_scale = 1.0f;
  writer.add(base + ".weight_scale_2", DType::F32, {}, &m.global_scale, sizeof(float));
  writer.add(base + ".input_scale", DType::F32, {}, &input_scale, sizeof(float));
}

void run_quantize(const QuantizeOptions& opts) {
  Timer timer;
  check_output_path(opts.output);
  const SafetensorsFile in = SafetensorsFile::open(opts.input);

  std::vector<std::string> excludes = opts.no_default_exclude ? std::vector<std::string>{} : kDefaultExcludes;
  excludes.insert(excludes.end(), opts.excludes.begin(), opts.excludes.end());
  const auto excluded = [&](const std::string& name) {
    return std::any_of(excludes.begin(), excludes.end(), [&](const std::string& pattern) {
      return fnmatch(pattern.c_str(), name.c_str(), 0) == 0;
    });
  };

  // Pass 1: decide every tensor's fate, check K, collect the shared gate/up
  // amax, and make sure no two inputs produce the same output name, all
  // before any work is done.
  static const std::regex kStackName(R"((.*experts)\.(gate_proj|up_proj|down_proj)\.weight)");
  static const std::regex kExpertName(R"((.*experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight)");
  std::vector<TensorPlan> plans;
  std::map<std::string, float> pair_amax;           // pair_key -> max(amax_gate, amax_up)
  std::map<std::string, std::string> output_owner;  // output name -> input name
  size_t input_bytes = 0;
  int num_stack_notes = 0;
  const auto claim = [&](const std::string& out_name, const std::string& in_name) {
    const auto [it, inserted] = output_owner.emplace(out_name, in_name);
    FP4MOE_CHECK(inserted, opts.input, ": tensors '", it->second, "' and '", in_name,
                 "' would both be written as '", out_name, "'");
  };
  for (const std::string& name : in.names()) {
    const TensorView& view = in.get(name);
    input_bytes += view.nbytes;
    TensorPlan plan;
    std::smatch match;
    const bool quantizable = is_float_dtype(view.dtype) && !excluded(name);
    if (quantizable && view.shape.size() == 3 && std::regex_match(name, match, kStackName)) {
      plan.kind = TensorPlan::kStack;
      plan.experts_base = match[1];
      plan.proj = match[2];
    } else if (quantizable && view.shape.size() == 2 && name.ends_with(".weight")) {
      plan.kind = TensorPlan::kMatrix;
      plan.base = name.substr(0, name.size() - std::string_view(".weight").size());
      if (std::regex_match(name, match, kExpertName)) {
        plan.experts_base = match[1];
        plan.expert_idx = std::stoll(match[2]);
        plan.proj = match[3];
      }
    } else if (view.shape.size() == 3 && !excluded(name) && num_stack_notes++ < 3) {
      std::fprintf(stderr, "quantize: note: 3-D tensor '%s' %s is not an "
                   "experts.{gate,up,down}_proj.weight float stack; copied unchanged\n",
                   name.c_str(), shape_to_string(view.shape).c_str());
    }

    if (plan.kind == TensorPlan::kCopy) {
      claim(name, name);
    } else {
      const int64_t cols = view.shape.back();
      FP4MOE_CHECK(cols % kNvfp4BlockSize == 0, opts.input, ": tensor '", name, "' ",
                   shape_to_string(view.shape), " has K = ", cols, " columns, not a multiple of ",
                   kNvfp4BlockSize, " (the NVFP4 block size); exclude it with --exclude '", name, "'");
      const int64_t num_matrices = plan.num_matrices(view);
      const int64_t slice = view.numel() / std::max<int64_t>(num_matrices, 1);
      for (int64_t e = 0; e < num_matrices; ++e) {
        for (const char* field : {".weight", ".weight_scale", ".weight_scale_2", ".input_scale"})
          claim(plan.output_base(e) + field, name);
        if (const std::string key = plan.pair_key(e); !key.empty()) {
          float& amax = pair_amax[key];
          amax = std::max(amax, tensor_abs_max(view, e * slice, slice));
        }
      }
    }
    plans.push_back(std::move(plan));
    in.release(name);  // the reader keeps a tensor's bytes until released
  }

  // Pass 2: quantise or copy, in file order.
  SafetensorsWriter writer;
  int num_matrices = 0;
  int num_stacks = 0;
  int num_copied = 0;
  Progress progress("quantize", static_cast<int64_t>(input_bytes),
                    !opts.quiet && input_bytes >= kProgressMinBytes, Progress::Unit::kBytes);
  for (size_t i = 0; i < plans.size(); ++i) {
    const std::string& name = in.names()[i];
    const TensorView& view = in.get(name);
    const TensorPlan& plan = plans[i];
    if (plan.kind == TensorPlan::kCopy) {
      writer.add(view);
      ++num_copied;
      progress.advance(static_cast<int64_t>(view.nbytes), name);
      in.release(name);
      continue;
    }
    const int64_t rows = view.shape[view.shape.size() - 2];
    const int64_t cols = view.shape.back();
    std::vector<float> weights;
    if (plan.kind == TensorPlan::kMatrix) weights = tensor_to_float(view);
    for (int64_t e = 0; e < plan.num_matrices(view); ++e) {
      const float* data = weights.data();
      std::vector<float> expert_weights;
      if (plan.kind == TensorPlan::kStack) {
        // One expert at a time: a stack may be many GB as float.
        TensorView slice = view;
        slice.shape = {rows, cols};
        slice.data = view.data + static_cast<size_t>(e * rows * cols) * dtype_size(view.dtype);
        slice.nbytes = static_cast<size_t>(rows * cols) * dtype_size(view.dtype);
        expert_weights = tensor_to_float(slice);
        data = expert_weights.data();
      }
      const std::string key = plan.pair_key(e);
      const float amax = key.empty() ? abs_max(data, static_cast<size_t>(rows * cols)) : pair_amax.at(key);
      add_quantized(writer, plan.output_base(e),
                    quantize_rows_parallel(data, rows, cols, nvfp4_global_scale(amax)));
      ++num_matrices;
      progress.advance(static_cast<int64_t>(view.nbytes) / plan.num_matrices(view), plan.output_base(e));
    }
    if (plan.kind == TensorPlan::kStack) ++num_stacks;
    in.release(name);
  }
  progress.finish();

  // hf_quant_config.json's content, so that the file describes itself.
  for (const auto& [key, value] : in.metadata()) writer.set_metadata(key, value);
  const nlohmann::json quant_config = {
      {"producer", {{"name", "fp4moe"}, {"version", FP4MOE_VERSION}}},
      {"quantization",
       {{"quant_algo", "NVFP4"}, {"kv_cache_quant_algo", nullptr}, {"group_size", kNvfp4BlockSize},
        {"exclude_modules", excludes}}}};
  writer.set_metadata("format", "pt");
  writer.set_metadata("quant_algo", "NVFP4");
  writer.set_metadata("group_size", std::to_string(kNvfp4BlockSize));
  writer.set_metadata("hf_quant_config", quant_config.dump());
  writer.write(opts.output);

  std::fprintf(stderr,
               "quantize: %s (%s) -> %s: %d matrices quantised to NVFP4 (%d expert stacks split), "
               "%d tensors copied, %.1f s\n",
               opts.input.c_str(), format_bytes(static_cast<double>(input_bytes)).c_str(),
               opts.output.c_str(), num_matrices, num_stacks, num_copied, timer.elapsed_ms() / 1e3);
}

}  // namespace

void add_quantize_command(CLI::App& app) {
  auto opts = std::make_shared<QuantizeOptions>();
  CLI::App* cmd = app.add_subcommand(
      "quantize",
      "Quantise a float safetensors checkpoint (F32/BF16/F16) to NVIDIA ModelOpt NVFP4: every 2-D "
      "'*.weight' [N, K] becomes weight (U8 [N, K/2]), weight_scale (F8_E4M3 [N, K/16]), "
      "weight_scale_2 and input_scale; 3-D expert stacks '<p>experts.{gate,up,down}_proj.weight' "
      "[E, N, K] are split into '<p>experts.<e>.<proj>.*'. Gate and up of an expert share "
      "weight_scale_2. Other tensors are copied. K must be a multiple of 16.");
  cmd->add_option("IN", opts->input, "input .safetensors file with float weights")
      ->required()
      ->check(CLI::ExistingFile);
  cmd->add_option("OUT", opts->output, "output .safetensors file (written atomically)")->required();
  cmd->add_option("--exclude", opts->excludes,
                  "glob of tensor names to copy unquantised (repeatable), e.g. '*layers.0.*'")
      ->allow_extra_args(false);
  cmd->add_flag("--no-default-exclude", opts->no_default_exclude,
                "also quantise what ModelOpt keeps in high precision: " +
                    [] {
                      std::string list;
                      for (const std::string& p : kDefaultExcludes) list += (list.empty() ? "" : " ") + p;
                      return list;
                    }());
  cmd->add_flag("-q,--quiet", opts->quiet, "no progress line");
  cmd->callback([opts] { run_quantize(*opts); });
}

}  // namespace fp4moe::cli
