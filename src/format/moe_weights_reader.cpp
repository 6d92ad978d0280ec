// Loading an MoE layer from a ModelOpt checkpoint (docs/design.md §3): its
// routed experts (ModelOpt's names or Mixtral's), its shared expert (NVFP4
// or left unquantised) and its router, every tensor's dtype and shape
// validated, read through the checkpoint reader (checkpoint_reader.hpp) and
// held to the checkpoint's declared format and expert count.
//
// load_moe_weights runs in steps: find the experts under the prefix, the
// count expected, check that every expert is complete, the layer's shape
// from expert 0, read every expert (collecting dtype/shape mismatches so
// that one line names the first and counts the rest), then the shared
// expert.
//
// Tested in tests/format/test_moe_weights_reader.cpp: round trips (single
// file, Mixtral names, biases, shared experts) and one test per error
// message; the router in tests/format/test_model_config.cpp. Fuzzed by
// fuzz/fuzz_modelopt.cpp.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <initializer_list>
#include <optional>
#include <sstream>

#include "format/checkpoint_reader.hpp"
#include "format/expert_names.hpp"
#include "format/quant_config.hpp"
#include "format/tensor_values.hpp"
#include "fp4moe/error.hpp"
#include "fp4moe/model_config.hpp"
#include "fp4moe/modelopt.hpp"
#include "fp4moe/nvfp4.hpp"

namespace fp4moe {
namespace {

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

// The tensor errors of one layer, collected rather than thrown one by one:
// the one-line error names the first and counts the rest (a wrong dtype
// usually repeats in every expert).
class LayerTensorErrors {
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

// Reads a layer's NVFP4 matrices and biases, each tensor checked for dtype
// and shape; a mismatch is recorded in errors() and the tensor skipped.
class ExpertTensorReader {
 public:
  ExpertTensorReader(TensorSource& source, const std::string& path) : source_(source), path_(path) {}

  LayerTensorErrors& errors() { return errors_; }

  // The view when its dtype is one of `dtypes` and its shape one of
  // `shapes`, else null (the mismatch recorded).
  const TensorView* checked(const std::string& name, std::initializer_list<DType> dtypes,
                            const std::vector<std::vector<int64_t>>& shapes) {
    const auto [view, file] = source_.get(name);
    const bool dtype_ok = std::find(dtypes.begin(), dtypes.end(), view->dtype) != dtypes.end();
    const bool shape_ok = std::find(shapes.begin(), shapes.end(), view->shape) != shapes.end();
    if (dtype_ok && shape_ok) return view;
    std::string expected;
    for (DType dtype : dtypes) expected += (expected.empty() ? "" : " or ") + std::string(dtype_name(dtype));
    expected += " ";
    for (size_t i = 0; i < shapes.size(); ++i) expected += (i ? " or " : "") + shape_to_string(shapes[i]);
    errors_.add("'", name, "' (in ", *file, "): expected ", expected, ", found ",
                describe_tensor(view->dtype, view->shape));
    return nullptr;
  }

  // Reads one NVFP4 matrix (m.rows, m.cols set) from the tensors
  // name(field) into m; returns its weight_scale_2 as read (for the gate/up
  // check), or nothing when an error was recorded for it.
  template <typename NameOf>
  std::optional<float> read_matrix(const NameOf& name, Nvfp4Matrix& m) {
    std::optional<float> scale_2;
    if (const TensorView* v = checked(name("weight"), {DType::U8}, {{m.rows, m.cols / 2}}))
      m.packed.assign(v->data, v->data + v->nbytes);
    if (const TensorView* v = checked(name("weight_scale"), {DType::F8_E4M3}, {{m.rows, m.cols / kNvfp4BlockSize}})) {
      m.scales.assign(v->data, v->data + v->nbytes);
      const auto nan = std::find_if(m.scales.begin(), m.scales.end(), e4m3_is_nan);
      if (nan != m.scales.end())
        errors_.add("'", name("weight_scale"), "': element ", nan - m.scales.begin(), " is an e4m3 NaN");
    }
    // ModelOpt writes 0-d scalars; other exporters write shape [1].
    if (const TensorView* v = checked(name("weight_scale_2"), {DType::F32}, {{}, {1}})) {
      m.global_scale = read_f32_scale(*v, path_);
      scale_2 = m.global_scale;
    }
    // input_scale is optional (W4A16 exports have none): 1.0 and
    // has_input_scale false when absent.
    if (source_.contains(name("input_scale"))) {
      if (const TensorView* v = checked(name("input_scale"), {DType::F32}, {{}, {1}})) {
        m.input_scale = read_input_scale(*v, path_);
        m.has_input_scale = true;
      }
    }
    return scale_2;
  }

  // An F32 or BF16 bias [rows] into `bias`. A NaN or infinite bias would
  // poison every token routed to the expert without a word: the first is
  // recorded.
  void read_bias(const std::string& name, int64_t rows, std::vector<float>& bias) {
    const TensorView* v = checked(name, {DType::F32, DType::BF16}, {{rows}});
    if (v == nullptr) return;
    bias = tensor_to_float(*v);
    const auto bad = std::find_if(bias.begin(), bias.end(), [](float b) { return !std::isfinite(b); });
    if (bad != bias.end())
      errors_.add("'", name, "': element ", bad - bias.begin(), " is ", *bad, "; expected finite biases");
  }

 private:
  TensorSource& source_;
  const std::string& path_;
  LayerTensorErrors errors_;
};

// What the tensor names under a prefix say about its routed experts.
struct ExpertNames {
  int64_t max_expert_idx = -1;
  bool any_bias = false;
  const char* const* proj_names = kProjNames;  // or Mixtral's w1/w3/w2
};

// Refuses a prefix without per-expert tensors: stacked experts with the
// reason, else naming a tensor that looks like an expert's.
[[noreturn]] void refuse_missing_experts(const TensorSource& source, const std::string& path,
                                         const std::string& prefix) {
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
      example =
          detail::concat("; a tensor that looks like an expert's: '", name, "' (prefix '", name.substr(0, at), "'?)");
      break;
    }
  }
  FP4MOE_THROW(path, ": no expert tensors under prefix '", prefix, "' (looked for '",
               expert_tensor_name(prefix, 0, "gate_proj", "weight"), "' and '",
               expert_tensor_name(prefix, 0, "w1", "weight"), "')",
               example.empty() ? std::string("; no tensor name contains 'experts.'") : example);
}

// The experts under the prefix and their projection names (gate_proj/
// up_proj/down_proj, or Mixtral's w1/w3/w2).
ExpertNames find_experts(const TensorSource& source, const std::string& path, const std::string& prefix) {
  ExpertNames found;
  bool mixtral_names = false;
  for (const std::string& name : source.names()) {
    const int64_t e = parse_expert_index(name, prefix);
    if (e < 0) continue;
    found.max_expert_idx = std::max(found.max_expert_idx, e);
    if (name.size() >= 5 && name.compare(name.size() - 5, 5, ".bias") == 0) found.any_bias = true;
    const size_t proj_at = prefix.size() + std::string("experts.").size() + std::to_string(e).size() + 1;
    for (const char* proj : kMixtralProjNames)
      if (name.compare(proj_at, std::strlen(proj) + 1, std::string(proj) + ".") == 0) mixtral_names = true;
  }
  if (found.max_expert_idx < 0) refuse_missing_experts(source, path, prefix);
  found.proj_names = mixtral_names ? kMixtralProjNames : kProjNames;
  return found;
}

// The expert count: config.json's where the checkpoint has one (so that a
// missing last expert is noticed), else the largest index found plus one;
// and what gave it, for messages.
struct ExpectedExperts {
  int64_t num_experts = 0;
  std::string count_source;
};

ExpectedExperts expected_experts(const TensorSource& source, const std::string& path, const std::string& prefix,
                                 int64_t max_expert_idx) {
  ExpectedExperts expected{max_expert_idx + 1,
                           detail::concat("the largest expert index under prefix '", prefix, "' is ", max_expert_idx)};
  if (source.expert_count()) {
    expected.num_experts = source.expert_count()->num_experts;
    expected.count_source = detail::concat(source.config_json()->where(), " says ", source.expert_count()->key, " = ",
                                           expected.num_experts);
    FP4MOE_CHECK(max_expert_idx < expected.num_experts, path, ": tensors of expert ", max_expert_idx, " under prefix '",
                 prefix, "', but ", expected.count_source, " (experts 0..", expected.num_experts - 1, ")");
  }
  return expected;
}

// Every expert 0..E-1 must have every required tensor; reports the first gap.
void check_experts_complete(const TensorSource& source, const std::string& path, const std::string& prefix,
                            const ExpertNames& found, const ExpectedExperts& expected) {
  const int64_t num_experts = expected.num_experts;
  for (int64_t e = 0; e < num_experts; ++e)
    for (int p = 0; p < 3; ++p) {
      const char* proj = found.proj_names[p];
      for (const char* field : kRequiredFields) {
        const std::string name = expert_tensor_name(prefix, e, proj, field);
        FP4MOE_CHECK(source.contains(name), path, ": missing tensor '", name, "' (", expected.count_source,
                     ", so experts 0..", num_experts - 1, " must all be complete)", source.where_else(name));
      }
      if (found.any_bias) {
        const std::string name = expert_tensor_name(prefix, e, proj, "bias");
        FP4MOE_CHECK(source.contains(name), path, ": missing tensor '", name, "' (other experts under prefix '", prefix,
                     "' have biases)");
      }
    }
}

// The layer's hidden and inter size, from expert 0's gate weight, U8
// [inter, hidden / 2].
void read_layer_shape(TensorSource& source, const std::string& path, const std::string& prefix,
                      const ExpertNames& found, MoeWeights& weights) {
  const std::string shape_source = expert_tensor_name(prefix, 0, found.proj_names[0], "weight");
  const TensorView& gate0 = *source.get(shape_source).first;
  FP4MOE_CHECK(gate0.dtype == DType::U8 && gate0.shape.size() == 2, path, ": tensor '", shape_source, "' is ",
               describe_tensor(gate0.dtype, gate0.shape), "; expected U8 [inter, hidden / 2] (packed fp4)");
  // A non-empty tensor's extents are bounded by the file's size (its bytes
  // are in it), so 2 * shape[1] below cannot overflow; an empty one may
  // claim any extent.
  FP4MOE_CHECK(gate0.shape[0] > 0 && gate0.shape[1] > 0, path, ": tensor '", shape_source, "' ",
               shape_to_string(gate0.shape),
               " is empty; expected U8 [inter, hidden / 2] with inter "
               "and hidden positive multiples of ",
               kNvfp4BlockSize);
  weights.inter = gate0.shape[0];
  weights.hidden = gate0.shape[1] * 2;
  FP4MOE_CHECK(weights.hidden % kNvfp4BlockSize == 0 && weights.inter % kNvfp4BlockSize == 0 && weights.hidden > 0 &&
                   weights.inter > 0,
               path, ": tensor '", shape_source, "' ", shape_to_string(gate0.shape), " gives hidden = ", weights.hidden,
               " and inter = ", weights.inter, "; both must be positive multiples of ", kNvfp4BlockSize);
}

// The gate and up weight_scale_2 as read must agree: ModelOpt shares one.
void check_gate_up_scale(LayerTensorErrors& errors, const std::optional<float> (&scale_2)[3],
                         const std::string& gate_name, const std::string& up_name) {
  if (scale_2[0] && scale_2[1] && *scale_2[0] != *scale_2[1])
    errors.add("'", gate_name, "' = ", exact(*scale_2[0]), " differs from '", up_name, "' = ", exact(*scale_2[1]),
               "; ModelOpt shares one weight_scale_2 between gate and up");
}

// Every routed expert's matrices (and biases), the layer's shape set.
void read_routed_experts(ExpertTensorReader& reader, const std::string& prefix, const ExpertNames& found,
                         MoeWeights& weights) {
  const int64_t H = weights.hidden, I = weights.inter;
  weights.experts.resize(static_cast<size_t>(weights.num_experts));
  for (int64_t e = 0; e < weights.num_experts; ++e) {
    ExpertWeights& expert = weights.experts[static_cast<size_t>(e)];
    Nvfp4Matrix* matrices[3] = {&expert.gate, &expert.up, &expert.down};
    std::vector<float>* biases[3] = {&expert.gate_bias, &expert.up_bias, &expert.down_bias};
    std::optional<float> scale_2[3];  // as read, for the gate/up comparison
    for (int p = 0; p < 3; ++p) {
      const std::string proj = found.proj_names[p];
      Nvfp4Matrix& m = *matrices[p];
      m.rows = p < 2 ? I : H;
      m.cols = p < 2 ? H : I;
      auto name = [&](const char* field) { return expert_tensor_name(prefix, e, proj, field); };
      scale_2[p] = reader.read_matrix(name, m);
      if (found.any_bias) reader.read_bias(name("bias"), m.rows, *biases[p]);
    }
    check_gate_up_scale(reader.errors(), scale_2, expert_tensor_name(prefix, e, found.proj_names[0], "weight_scale_2"),
                        expert_tensor_name(prefix, e, found.proj_names[1], "weight_scale_2"));
  }
}

// The stem of the layer's shared expert: DeepSeek/GLM/Kimi's
// "<prefix>shared_experts." or Qwen2-MoE's gated "<prefix>shared_expert.";
// empty when it has none.
std::string find_shared_expert_stem(const TensorSource& source, const std::string& prefix) {
  std::string stem;
  for (const std::string& candidate : {prefix + "shared_experts.", prefix + "shared_expert."})
    for (const std::string& name : source.names())
      if (stem.empty() && name.compare(0, candidate.size(), candidate) == 0) stem = candidate;
  return stem;
}

// Qwen2-MoE's shared expert gate, nn.Linear(hidden, 1): [1, hidden]; a flat
// [hidden] is read too.
std::vector<float> read_shared_gate(TensorSource& source, const std::string& path, const std::string& stem,
                                    const std::string& gate_name, int64_t H) {
  FP4MOE_CHECK(source.contains(gate_name), path, ": missing tensor '", gate_name, "' (a Qwen2-MoE shared expert '",
               stem, "*' is scaled by sigmoid(shared_expert_gate · x))");
  const TensorView& g = *source.get(gate_name).first;
  const std::vector<int64_t> shape = g.shape.size() == 1 ? std::vector<int64_t>{H} : std::vector<int64_t>{1, H};
  return read_float_tensor(source, path, gate_name, shape, "the shared expert's gate");
}

// A shared expert left in high precision (ModelOpt's experts-only configs
// quantise the routed experts alone), its gate_proj.weight `shared_w`
// already found unquantised: read as floats, all three projections plain
// .weight tensors.
SharedExpertWeights read_dense_shared_expert(TensorSource& source, const std::string& path, const std::string& stem,
                                             const TensorView& shared_w, int64_t H) {
  FP4MOE_CHECK(shared_w.shape.size() == 2 && shared_w.shape[1] == H && shared_w.shape[0] > 0, path, ": tensor '", stem,
               "gate_proj.weight' is ", describe_tensor(shared_w.dtype, shared_w.shape), "; expected [shared inter, ",
               H, "] (an unquantised shared expert)");
  const int64_t S = shared_w.shape[0];
  for (const std::string& name : source.names())
    FP4MOE_CHECK(
        name.compare(0, stem.size(), stem) != 0 || name.size() < 7 || name.compare(name.size() - 7, 7, ".weight") == 0,
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
  return shared;
}

// An NVFP4 shared expert: every projection's required fields, its width
// from gate_proj.weight, its matrices read as a routed expert's.
SharedExpertWeights read_nvfp4_shared_expert(TensorSource& source, ExpertTensorReader& reader, const std::string& path,
                                             const std::string& prefix, const std::string& stem, int64_t H) {
  for (const char* proj : kProjNames)
    for (const char* field : kRequiredFields) {
      const std::string name = stem + proj + "." + field;
      FP4MOE_CHECK(source.contains(name), path, ": missing tensor '", name, "' (other tensors under '", stem,
                   "' are there: a shared expert needs all of {gate_proj,up_proj,down_proj}.{weight,weight_scale,"
                   "weight_scale_2})",
                   source.where_else(name));
    }
  const std::string shared_shape_source = stem + "gate_proj.weight";
  const TensorView& shared_gate0 = *source.get(shared_shape_source).first;
  FP4MOE_CHECK(shared_gate0.dtype == DType::U8 && shared_gate0.shape.size() == 2 && shared_gate0.shape[1] * 2 == H &&
                   shared_gate0.shape[0] > 0 && shared_gate0.shape[0] % kNvfp4BlockSize == 0,
               path, ": tensor '", shared_shape_source, "' is ",
               describe_tensor(shared_gate0.dtype, shared_gate0.shape), "; expected U8 [shared inter, ", H / 2,
               "] (packed fp4, shared inter a positive multiple of ", kNvfp4BlockSize, ")");
  SharedExpertWeights shared;
  shared.inter = shared_gate0.shape[0];
  Nvfp4Matrix* shared_matrices[3] = {&shared.mlp.gate, &shared.mlp.up, &shared.mlp.down};
  std::optional<float> shared_scale_2[3];
  for (int p = 0; p < 3; ++p) {
    Nvfp4Matrix& m = *shared_matrices[p];
    m.rows = p < 2 ? shared.inter : H;
    m.cols = p < 2 ? H : shared.inter;
    auto name = [&](const char* field) { return stem + kProjNames[p] + "." + field; };
    shared_scale_2[p] = reader.read_matrix(name, m);
  }
  check_gate_up_scale(reader.errors(), shared_scale_2, stem + "gate_proj.weight_scale_2",
                      stem + "up_proj.weight_scale_2");
  reader.errors().throw_if_any(path, prefix);
  return shared;
}

// The shared expert, whole or not at all; empty when the layer has none.
std::optional<SharedExpertWeights> read_shared_expert(TensorSource& source, ExpertTensorReader& reader,
                                                      const std::string& path, const std::string& prefix, int64_t H) {
  const std::string gate_name = prefix + "shared_expert_gate.weight";
  const std::string stem = find_shared_expert_stem(source, prefix);
  FP4MOE_CHECK(!stem.empty() || !source.contains(gate_name), path, ": '", gate_name,
               "' but no shared expert for it to gate (expected '", prefix, "shared_expert.gate_proj.weight')");
  if (stem.empty()) return std::nullopt;
  const bool gated = stem == prefix + "shared_expert.";
  // A shared expert left in high precision is refused by name, not as a
  // missing scale: the layer runs it as extra NVFP4 experts of the same
  // GEMMs.
  const TensorView* shared_w =
      source.contains(stem + "gate_proj.weight") ? source.get(stem + "gate_proj.weight").first : nullptr;
  SharedExpertWeights shared = shared_w != nullptr && shared_w->dtype != DType::U8
                                   ? read_dense_shared_expert(source, path, stem, *shared_w, H)
                                   : read_nvfp4_shared_expert(source, reader, path, prefix, stem, H);
  if (gated) shared.gate = read_shared_gate(source, path, stem, gate_name, H);
  return shared;
}

}  // namespace

MoeWeights load_moe_weights(const std::string& path, const std::string& prefix) {
  TensorSource source(path);
  const ExpertNames found = find_experts(source, path, prefix);

  MoeWeights weights;
  if (source.quant_config()) weights.checkpoint_format = check_layer_format(*source.quant_config(), prefix);

  const ExpectedExperts expected = expected_experts(source, path, prefix, found.max_expert_idx);
  check_experts_complete(source, path, prefix, found, expected);
  read_layer_shape(source, path, prefix, found, weights);
  weights.num_experts = expected.num_experts;

  ExpertTensorReader reader(source, path);
  read_routed_experts(reader, prefix, found, weights);
  reader.errors().throw_if_any(path, prefix);

  weights.shared_expert = read_shared_expert(source, reader, path, prefix, weights.hidden);
  return weights;
}

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
               describe_tensor(w.dtype, w.shape), "; expected F32, BF16 or F16 [num_experts, hidden] (the router)");
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
