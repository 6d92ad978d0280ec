// The CPU reference's bindings: reference_forward on the engines' stacked
// host arrays (W4A4 with their input scales) and checkpoint_reference_forward
// on a checkpoint layer, as MoeLayer would run them.
// Tested by tests/python/test_cpu.py.
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>

#include <optional>
#include <string>
#include <vector>

#include "arrays.hpp"
#include "fp4moe/error.hpp"
#include "fp4moe/modelopt.hpp"
#include "fp4moe/reference.hpp"

namespace fp4moe::python {
namespace {

// The CPU reference (bf16 intermediate, as the GPU layer stores it) of a
// layer's weights on host arrays; `numerics` kBf16 or kFp4.
nb::ndarray<nb::numpy, float> reference_on(const char* where, const MoeWeights& w, const Array& hidden,
                                           const Array& topk_ids, const Array& topk_weights,
                                           const std::string& activation, ActivationNumerics numerics) {
  FP4MOE_CHECK(hidden.ndim() == 2 && topk_ids.ndim() == 2, where,
               ": hidden_states and topk_ids must be 2-D ([T, H] and [T, k])");
  const int64_t T = static_cast<int64_t>(hidden.shape(0));
  const int64_t k = static_cast<int64_t>(topk_ids.shape(1));
  const auto* x =
      static_cast<const float*>(checked(where, "hidden_states", hidden, DType::kF32, {{T, w.hidden}}, kHost));
  Routing r;
  r.num_tokens = T;
  r.top_k = static_cast<int>(k);
  const auto* ids = static_cast<const int32_t*>(checked(where, "topk_ids", topk_ids, DType::kI32, {{T, k}}, kHost));
  const auto* wts =
      static_cast<const float*>(checked(where, "topk_weights", topk_weights, DType::kF32, {{T, k}}, kHost));
  r.topk_ids.assign(ids, ids + T * k);
  r.topk_weights.assign(wts, wts + T * k);
  validate_routing(r, w.num_experts);
  const Activation act = activation == "gptoss" ? Activation::kGptOss : Activation::kSwiGLU;
  FP4MOE_CHECK(activation == "gptoss" || activation == "swiglu", where, ": unknown activation '", activation,
               "'; expected swiglu or gptoss");
  std::vector<float> out(static_cast<size_t>(T * w.hidden));
  {
    nb::gil_scoped_release release;
    moe_reference(w, x, r, act, out.data(), 0, Intermediate::kBf16, numerics);
  }
  return numpy_array(std::move(out), {static_cast<size_t>(T), static_cast<size_t>(w.hidden)});
}

// The engines' stacked host arrays, with input scales for W4A4 (the
// activation numerics resolved as MoeLayer resolves them).
nb::ndarray<nb::numpy, float> reference_forward(
    const Array& w13, const Array& w13_scale, const Array& w13_scale_2, const Array& w2, const Array& w2_scale,
    const Array& w2_scale_2, const std::optional<Array>& w13_bias, const std::optional<Array>& w2_bias,
    const Array& hidden, const Array& topk_ids, const Array& topk_weights, const std::string& activation,
    const std::optional<Array>& w13_input_scale, const std::optional<Array>& w2_input_scale,
    const std::string& activations) {
  constexpr const char* kWhere = "fp4moe.reference_forward";
  const ActivationNumerics numerics = resolve_stacked_activation_numerics(
      parse_activation_numerics(activations), w13_input_scale.has_value(), w2_input_scale.has_value(), kWhere);
  const MoeWeights w = weights_from_stacked(w13, w13_scale, w13_scale_2, w2, w2_scale, w2_scale_2, w13_bias, w2_bias,
                                            w13_input_scale, w2_input_scale, numerics == ActivationNumerics::kFp4);
  return reference_on(kWhere, w, hidden, topk_ids, topk_weights, activation, numerics);
}

// A checkpoint layer as MoeLayer.from_checkpoint loads it, on the CPU
// reference: the activation numerics resolved as for a checkpoint (fp4 for
// an NVFP4 (W4A4) export with every input_scale, unless asked otherwise).
nb::ndarray<nb::numpy, float> checkpoint_reference_forward(const std::string& path, const std::string& prefix,
                                                           const Array& hidden, const Array& topk_ids,
                                                           const Array& topk_weights, const std::string& activation,
                                                           const std::string& activations) {
  MoeWeights w;
  {
    nb::gil_scoped_release release;
    w = load_moe_weights(path, prefix);
  }
  const ActivationNumerics numerics = resolve_activation_numerics(w, parse_activation_numerics(activations));
  return reference_on("fp4moe.checkpoint_reference_forward", w, hidden, topk_ids, topk_weights, activation, numerics);
}

}  // namespace

void register_reference(nb::module_& m) {
  m.def("reference_forward", &reference_forward, nb::arg("w13"), nb::arg("w13_scale"), nb::arg("w13_scale_2"),
        nb::arg("w2"), nb::arg("w2_scale"), nb::arg("w2_scale_2"), nb::arg("w13_bias").none(),
        nb::arg("w2_bias").none(), nb::arg("hidden_states"), nb::arg("topk_ids"), nb::arg("topk_weights"),
        nb::arg("activation") = "swiglu", nb::kw_only(), nb::arg("w13_input_scale").none() = nb::none(),
        nb::arg("w2_input_scale").none() = nb::none(), nb::arg("activations") = "checkpoint",
        "The CPU reference (double accumulation, bf16 intermediate as the GPU stores it) on stacked host "
        "arrays; with w13_input_scale and w2_input_scale ([E], [E, 2] for w13, or one value) W4A4 as "
        "MoeLayer runs it (activations: checkpoint, bf16 or fp4).");
  m.def("checkpoint_reference_forward", &checkpoint_reference_forward, nb::arg("path"), nb::arg("prefix"),
        nb::arg("hidden_states"), nb::arg("topk_ids"), nb::arg("topk_weights"), nb::arg("activation") = "swiglu",
        nb::arg("activations") = "checkpoint",
        "The CPU reference of a checkpoint layer as MoeLayer.from_checkpoint loads it (activations: "
        "checkpoint, bf16 or fp4).");
}

}  // namespace fp4moe::python
