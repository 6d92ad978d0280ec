// The checkpoint format's bindings: load_stacked (a checkpoint layer as the
// engines' stacked host arrays), quantize (ModelOpt's NVFP4 quantisation of
// one matrix) and moe_model_config (config.json's MoE fields, read by the
// library's one config.json reader, src/format/config_json.hpp; the
// package's layer_config_from_hf wraps it).
// Tested by tests/python/test_cpu.py.
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>

#include <optional>
#include <string>
#include <vector>

#include "arrays.hpp"
#include "fp4moe/error.hpp"
#include "fp4moe/model_config.hpp"
#include "fp4moe/modelopt.hpp"
#include "fp4moe/reference.hpp"

namespace fp4moe::python {
namespace {

// A checkpoint's layer as the engines' stacked host arrays (a dict), with
// w13_input_scale [E, 2] (gate, up) and w2_input_scale [E] where every
// expert matrix has an input_scale (an NVFP4 (W4A4) export).
nb::dict load_stacked(const std::string& path, const std::string& prefix) {
  MoeWeights w;
  {
    nb::gil_scoped_release release;
    w = load_moe_weights(path, prefix);
  }
  const size_t E = static_cast<size_t>(w.num_experts), H = static_cast<size_t>(w.hidden),
               I = static_cast<size_t>(w.inter);
  std::vector<uint8_t> w13, w13s, w2, w2s;
  std::vector<float> s13, s2, b13, b2, in13, in2;
  bool input_scales = true;  // every matrix has one: w13_input_scale [E, 2], w2_input_scale [E]
  for (const ExpertWeights& x : w.experts) {
    input_scales = input_scales && x.gate.has_input_scale && x.up.has_input_scale && x.down.has_input_scale;
    in13.push_back(x.gate.input_scale);
    in13.push_back(x.up.input_scale);
    in2.push_back(x.down.input_scale);
    for (const Nvfp4Matrix* m : {&x.gate, &x.up}) {
      w13.insert(w13.end(), m->packed.begin(), m->packed.end());
      w13s.insert(w13s.end(), m->scales.begin(), m->scales.end());
    }
    w2.insert(w2.end(), x.down.packed.begin(), x.down.packed.end());
    w2s.insert(w2s.end(), x.down.scales.begin(), x.down.scales.end());
    s13.push_back(x.gate.global_scale);
    s13.push_back(x.up.global_scale);
    s2.push_back(x.down.global_scale);
    b13.insert(b13.end(), x.gate_bias.begin(), x.gate_bias.end());
    b13.insert(b13.end(), x.up_bias.begin(), x.up_bias.end());
    b2.insert(b2.end(), x.down_bias.begin(), x.down_bias.end());
  }
  nb::dict d;
  d["w13"] = numpy_array(std::move(w13), {E, 2 * I, H / 2});
  d["w13_scale"] = numpy_array(std::move(w13s), {E, 2 * I, H / 16});
  d["w13_scale_2"] = numpy_array(std::move(s13), {E, 2});
  d["w2"] = numpy_array(std::move(w2), {E, H, I / 2});
  d["w2_scale"] = numpy_array(std::move(w2s), {E, H, I / 16});
  d["w2_scale_2"] = numpy_array(std::move(s2), {E});
  if (w.has_bias()) {
    d["w13_bias"] = numpy_array(std::move(b13), {E, 2 * I});
    d["w2_bias"] = numpy_array(std::move(b2), {E, H});
  }
  if (input_scales && E > 0) {
    d["w13_input_scale"] = numpy_array(std::move(in13), {E, 2});
    d["w2_input_scale"] = numpy_array(std::move(in2), {E});
  }
  return d;
}

// ModelOpt's NVFP4 quantisation of one float matrix [N, K] (host):
// (packed u8 [N, K/2], e4m3 scales as u8 [N, K/16], weight_scale_2).
nb::tuple quantize(const Array& weights, std::optional<float> global_scale) {
  FP4MOE_CHECK(weights.ndim() == 2, "fp4moe.quantize: weights have shape ", shape_string(shape_of(weights)),
               "; expected [N, K]");
  const int64_t n = static_cast<int64_t>(weights.shape(0)), k = static_cast<int64_t>(weights.shape(1));
  const auto* w =
      static_cast<const float*>(checked("fp4moe.quantize", "weights", weights, DType::kF32, {{n, k}}, kHost));
  Nvfp4Matrix m;
  {
    nb::gil_scoped_release release;
    m = quantize_nvfp4(w, n, k, global_scale);
  }
  const float s2 = m.global_scale;
  return nb::make_tuple(numpy_array(std::move(m.packed), {static_cast<size_t>(n), static_cast<size_t>(k / 2)}),
                        numpy_array(std::move(m.scales), {static_cast<size_t>(n), static_cast<size_t>(k / 16)}), s2);
}

// config.json's MoE fields as parse_moe_model_config reads them (`where`
// names the file in messages): a dict with model_type, num_experts, top_k
// (None where the config gives none), routing ("softmax", "noaux_tc",
// "gptoss"), renormalize, num_groups, topk_groups, routed_scaling_factor and
// activation ("swiglu", "gptoss"); None for a config without a routed
// expert count (not an MoE config).
std::optional<nb::dict> moe_model_config(const std::string& json_text, const std::string& where) {
  const std::optional<MoeModelConfig> config = parse_moe_model_config(json_text, where);
  if (!config) return std::nullopt;
  const RoutingParams& r = config->routing;
  nb::dict d;
  d["model_type"] = config->model_type;
  d["num_experts"] = config->num_experts;
  d["top_k"] = config->top_k ? nb::cast(*config->top_k) : nb::none();
  d["routing"] = to_string(r.mode);
  d["renormalize"] = r.renormalize;
  d["num_groups"] = r.num_groups;
  d["topk_groups"] = r.topk_groups;
  d["routed_scaling_factor"] = r.routed_scaling_factor;
  d["activation"] = config->activation == Activation::kGptOss ? "gptoss" : "swiglu";
  return d;
}

}  // namespace

void register_format(nb::module_& m) {
  m.def("load_stacked", &load_stacked, nb::arg("path"), nb::arg("prefix"),
        "A checkpoint layer's experts as stacked host arrays (w13_scale_2 as [E, 2]).");
  m.def("quantize", &quantize, nb::arg("weights"), nb::arg("global_scale").none() = nb::none(),
        "ModelOpt NVFP4 quantisation of a float32 [N, K] host array: (packed, scales, weight_scale_2); "
        "global_scale (gate and up share one) defaults to amax / 2688.");
  m.def("moe_model_config", &moe_model_config, nb::arg("json_text"), nb::arg("where") = "config.json",
        "config.json's MoE fields (routing, activation, top-k) as the library reads them: a dict, or None for a "
        "config without a routed expert count.");
}

}  // namespace fp4moe::python
