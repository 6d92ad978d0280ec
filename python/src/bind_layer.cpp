// The GPU layer's bindings: Layer (a MoeLayer plus its workspace, sized for
// max_tokens at construction), the CUDA device queries and the current
// stream fallback. Layer.forward, called per forward, validates every array
// (dtype, device, shape, strides) and launches on the caller's stream: no
// allocation, no host synchronisation. It reads arrays whose type publishes
// DLPack's C exchange API (torch >= 2.10) through it: a borrowed view and
// the current stream in tens of nanoseconds, where __dlpack__() costs
// microseconds per array (bench/python_bench.py;
// docs/performance.md §5.22).
//
// W4A4 (fp4 activations) from the engines' layout: w13_input_scale and
// w2_input_scale as vLLM and SGLang hold them ([E], w13's [E, 2], or one
// value) go to the library's rules (reference.hpp:
// resolve_stacked_activation_numerics, stacked_input_scales), which make
// them what a checkpoint's per-matrix input_scale tensors give; only their
// shapes are read here.
//
// Tested by tests/python/test_gpu.py (on a GPU) and
// tests/python/test_cpu.py (the device queries without one).
#include <cuda_runtime_api.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>

#include <algorithm>
#include <chrono>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "arrays.hpp"
#include "fp4moe/cuda_check.hpp"
#include "fp4moe/error.hpp"
#include "fp4moe/modelopt.hpp"
#include "fp4moe/moe_layer.hpp"
#include "fp4moe/reference.hpp"

namespace fp4moe::python {
namespace {

// Makes `device` current for the scope (kernels launch on it).
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    FP4MOE_CUDA_CHECK(cudaGetDevice(&previous_));
    if (previous_ != device) FP4MOE_CUDA_CHECK(cudaSetDevice(device));
  }
  ~DeviceGuard() {
    int now = 0;
    if (cudaGetDevice(&now) == cudaSuccess && now != previous_) cudaSetDevice(previous_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = 0;
};

// ---------------------------------------------------------------- options

MoeLayerOptions make_options(int top_k, const std::string& routing, bool renormalize, int num_groups, int topk_groups,
                             float routed_scaling_factor, const std::string& activation, const std::string& activations,
                             const std::string& finalize, bool batch_invariant, bool programmatic_launch) {
  MoeLayerOptions o;
  o.activations = parse_activation_numerics(activations);
  o.routing.mode = parse_routing_mode(routing);
  o.routing.top_k = top_k;
  o.routing.renormalize = renormalize;
  o.routing.num_groups = num_groups;
  o.routing.topk_groups = topk_groups;
  o.routing.routed_scaling_factor = routed_scaling_factor;
  if (activation == "swiglu")
    o.activation = Activation::kSwiGLU;
  else if (activation == "gptoss")
    o.activation = Activation::kGptOss;
  else
    FP4MOE_THROW("unknown activation '", activation, "': expected swiglu or gptoss");
  o.finalize = parse_finalize_mode(finalize);
  o.batch_invariant = batch_invariant;
  o.programmatic_launch = programmatic_launch;
  return o;
}

// Python's current-stream query for arrays without the exchange API
// (fp4moe/layer.py sets it to torch's when torch is present): device -> int.
nb::object& current_stream_fallback() {
  static nb::object* fallback = new nb::object();  // leaked: outlives the interpreter's teardown order
  return *fallback;
}

// The stream a forward launches on: `stream` when it is an int; for None the
// current stream of the array's framework on its device.
cudaStream_t stream_for(nb::handle stream, const ArrayView& array) {
  if (!stream.is_none()) return reinterpret_cast<cudaStream_t>(nb::cast<uintptr_t>(stream));
  if (array.api() != nullptr) {
    void* current = nullptr;
    if (array.api()->current_work_stream(array.device_type(), array.device_id(), &current) != 0)
      throw nb::python_error();
    return static_cast<cudaStream_t>(current);
  }
  const nb::object& fallback = current_stream_fallback();
  if (!fallback.is_valid() || fallback.is_none()) return nullptr;  // the legacy default stream
  return reinterpret_cast<cudaStream_t>(nb::cast<uintptr_t>(fallback(array.device_id())));
}

// ---------------------------------------------------------------- Layer

class Layer {
 public:
  Layer(MoeLayer layer, int device, int64_t max_tokens)
      : layer_(std::move(layer)), device_(device), max_tokens_(max_tokens) {
    FP4MOE_CHECK(max_tokens >= 1, "fp4moe.MoeLayer: max_tokens = ", max_tokens, "; expected >= 1");
    workspace_bytes_ = layer_.workspace_bytes(max_tokens);
    FP4MOE_CUDA_CHECK(cudaMalloc(&workspace_, workspace_bytes_));
    FP4MOE_CUDA_CHECK(cudaMemset(workspace_, 0, workspace_bytes_));
  }
  ~Layer() {
    if (workspace_) {
      int previous = 0;
      cudaGetDevice(&previous);
      cudaSetDevice(device_);
      cudaFree(workspace_);
      cudaSetDevice(previous);
    }
  }
  Layer(const Layer&) = delete;
  Layer& operator=(const Layer&) = delete;

  static Layer* from_device(const Array& w13, const Array& w13_scale, const Array& w13_scale_2, const Array& w2,
                            const Array& w2_scale, const Array& w2_scale_2, const std::optional<Array>& w13_bias,
                            const std::optional<Array>& w2_bias, const std::optional<Array>& w13_input_scale,
                            const std::optional<Array>& w2_input_scale, const MoeLayerOptions& options,
                            int64_t max_tokens, uintptr_t stream) {
    constexpr const char* kWhere = "fp4moe.MoeLayer";
    FP4MOE_CHECK(w13.device_type() == nb::device::cuda::value, kWhere,
                 ": w13 is not on a CUDA device; expected the stacked weights on a GPU");
    const int device = w13.device_id();
    FP4MOE_CHECK(w13.ndim() == 3 && w2.ndim() == 3, kWhere, ": w13 has shape ", shape_string(shape_of(w13)), " and w2 ",
                 shape_string(shape_of(w2)), "; expected [E, 2*I, H/2] and [E, H, I/2]");
    const int64_t E = static_cast<int64_t>(w13.shape(0));
    const int64_t I = static_cast<int64_t>(w13.shape(1)) / 2;
    const int64_t H = static_cast<int64_t>(w13.shape(2)) * 2;
    FP4MOE_CHECK(static_cast<int64_t>(w13.shape(1)) % 2 == 0, kWhere, ": w13 has ", w13.shape(1),
                 " rows per expert; expected 2*I (gate rows, then up rows)");
    MoeDeviceWeights w;
    w.num_experts = E;
    w.hidden = H;
    w.inter = I;
    w.w13 = static_cast<const uint8_t*>(checked(kWhere, "w13", w13, DType::kU8, {{E, 2 * I, H / 2}}, device));
    w.w13_scale =
        static_cast<const uint8_t*>(checked(kWhere, "w13_scale", w13_scale, DType::kU8, {{E, 2 * I, H / 16}}, device));
    w.w13_scale_2 = static_cast<const float*>(
        checked(kWhere, "w13_scale_2", w13_scale_2, DType::kF32, {{E}, {E, 1}, {E, 2}}, device));
    w.w13_scale_2_per_half = w13_scale_2.ndim() == 2 && w13_scale_2.shape(1) == 2;
    w.w2 = static_cast<const uint8_t*>(checked(kWhere, "w2", w2, DType::kU8, {{E, H, I / 2}}, device));
    w.w2_scale =
        static_cast<const uint8_t*>(checked(kWhere, "w2_scale", w2_scale, DType::kU8, {{E, H, I / 16}}, device));
    w.w2_scale_2 =
        static_cast<const float*>(checked(kWhere, "w2_scale_2", w2_scale_2, DType::kF32, {{E}, {E, 1}}, device));
    FP4MOE_CHECK(w13_bias.has_value() == w2_bias.has_value(), kWhere, ": give both w13_bias and w2_bias, or neither");
    if (w13_bias) {
      w.w13_bias = static_cast<const float*>(checked(kWhere, "w13_bias", *w13_bias, DType::kF32, {{E, 2 * I}}, device));
      w.w2_bias = static_cast<const float*>(checked(kWhere, "w2_bias", *w2_bias, DType::kF32, {{E, H}}, device));
    }
    // W4A4: the library's rules (resolve_stacked_activation_numerics here,
    // the values in prepare_device), refusals naming this call.
    resolve_stacked_activation_numerics(options.activations, w13_input_scale.has_value(), w2_input_scale.has_value(),
                                        kWhere);
    if (w13_input_scale) {
      std::tie(w.w13_input_scale, w.w13_input_scale_extent) =
          input_scale_array(kWhere, "w13_input_scale", *w13_input_scale, E, /*gate_up=*/true, device);
      std::tie(w.w2_input_scale, w.w2_input_scale_extent) =
          input_scale_array(kWhere, "w2_input_scale", *w2_input_scale, E, /*gate_up=*/false, device);
    }
    DeviceGuard guard(device);
    MoeLayer layer = MoeLayer::prepare_device(w, options, reinterpret_cast<cudaStream_t>(stream));
    return new Layer(std::move(layer), device, max_tokens);
  }

  static Layer* from_checkpoint(const std::string& path, const std::string& prefix, const MoeLayerOptions& options,
                                int64_t max_tokens, int device) {
    MoeWeights weights;
    {
      nb::gil_scoped_release release;  // reading and checking gigabytes
      weights = load_moe_weights(path, prefix);
    }
    DeviceGuard guard(device);
    nb::gil_scoped_release release;
    MoeLayer layer = MoeLayer::prepare(weights, options);
    return new Layer(std::move(layer), device, max_tokens);
  }

  // output = the layer applied to hidden_states, routed by router_logits (on
  // the device) or by the given topk_ids/topk_weights; None for an absent
  // one. Launched on `stream` (an int), or with None on the current stream
  // of hidden_states' framework (its exchange API, else
  // current_stream_fallback(device)).
  void forward(nb::handle hidden_object, nb::handle out_object, nb::handle logits_object, nb::handle bias_object,
               nb::handle ids_object, nb::handle weights_object, nb::handle stream_object) const {
    constexpr const char* kWhere = "fp4moe.MoeLayer.forward";
    const ArrayView hidden(kWhere, "hidden_states", hidden_object);
    const ArrayView out(kWhere, "out", out_object);
    const int64_t H = layer_.hidden(), E = layer_.num_experts(), k = layer_.top_k();
    FP4MOE_CHECK(hidden.ndim() == 2, kWhere, ": hidden_states has shape ", shape_string(shape_of(hidden)),
                 "; expected [num_tokens, ", H, "]");
    const int64_t T = hidden.shape(0);
    FP4MOE_CHECK(T <= max_tokens_, kWhere, ": ", T,
                 " tokens, but the layer's workspace was sized for "
                 "max_tokens = ",
                 max_tokens_, "; construct the layer with a larger max_tokens");
    MoeForwardArgs args;
    args.num_tokens = T;
    args.hidden_states = checked(kWhere, "hidden_states", hidden, DType::kBf16, {{T, H}}, device_);
    void* output = checked(kWhere, "out", out, DType::kBf16, {{T, H}}, device_);
    const bool has_logits = !logits_object.is_none(), has_ids = !ids_object.is_none();
    FP4MOE_CHECK(has_logits != has_ids, kWhere, ": give either router_logits or topk_ids + topk_weights");
    FP4MOE_CHECK(has_ids == !weights_object.is_none(), kWhere, ": topk_ids and topk_weights go together");
    if (has_logits) {
      const ArrayView logits(kWhere, "router_logits", logits_object);
      args.router_logits =
          static_cast<const float*>(checked(kWhere, "router_logits", logits, DType::kF32, {{T, E}}, device_));
      if (!bias_object.is_none()) {
        const ArrayView bias(kWhere, "correction_bias", bias_object);
        args.correction_bias =
            static_cast<const float*>(checked(kWhere, "correction_bias", bias, DType::kF32, {{E}}, device_));
      }
    } else {
      FP4MOE_CHECK(bias_object.is_none(), kWhere, ": correction_bias goes with router_logits");
      const ArrayView ids(kWhere, "topk_ids", ids_object), weights(kWhere, "topk_weights", weights_object);
      args.topk_ids = static_cast<const int32_t*>(checked(kWhere, "topk_ids", ids, DType::kI32, {{T, k}}, device_));
      args.topk_weights =
          static_cast<const float*>(checked(kWhere, "topk_weights", weights, DType::kF32, {{T, k}}, device_));
    }
    if (T == 0) return;
    const cudaStream_t stream = stream_for(stream_object, hidden);
    DeviceGuard guard(device_);
    layer_.forward(args, output, workspace_, workspace_bytes_, stream);
  }

  // Host time of `iterations` C++ forwards (device routing), each timed on
  // its own: the median in ns. For bench/python_bench.py, which compares it
  // with a Python call's.
  double host_forward_ns(const Array& hidden, OutArray& out, const Array& router_logits, uintptr_t stream,
                         int iterations) const {
    MoeForwardArgs args;
    args.num_tokens = static_cast<int64_t>(hidden.shape(0));
    args.hidden_states = hidden.data();
    args.router_logits = static_cast<const float*>(router_logits.data());
    DeviceGuard guard(device_);
    std::vector<double> ns;
    for (int i = 0; i < iterations; ++i) {
      const auto start = std::chrono::steady_clock::now();
      layer_.forward(args, out.data(), workspace_, workspace_bytes_, reinterpret_cast<cudaStream_t>(stream));
      ns.push_back(std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - start).count());
    }
    std::sort(ns.begin(), ns.end());
    return ns.empty() ? 0.0 : ns[ns.size() / 2];
  }

  std::string device_errors(uintptr_t stream) const {
    DeviceGuard guard(device_);
    return layer_.device_errors(workspace_, reinterpret_cast<cudaStream_t>(stream));
  }
  std::string plan(int64_t num_tokens) const { return layer_.plan(num_tokens).describe(); }

  const MoeLayer& layer() const { return layer_; }
  int device() const { return device_; }
  int64_t max_tokens() const { return max_tokens_; }
  size_t workspace_bytes() const { return workspace_bytes_; }

 private:
  MoeLayer layer_;
  int device_ = 0;
  int64_t max_tokens_ = 0;
  void* workspace_ = nullptr;
  size_t workspace_bytes_ = 0;
};

// Seconds MoeLayer::prepare (the host packer, then the upload) takes for
// the stacked host arrays, on the current device; the layer is dropped.
double time_host_prepare(const Array& w13, const Array& w13_scale, const Array& w13_scale_2, const Array& w2,
                         const Array& w2_scale, const Array& w2_scale_2, int top_k) {
  const MoeWeights w =
      weights_from_stacked(w13, w13_scale, w13_scale_2, w2, w2_scale, w2_scale_2, std::nullopt, std::nullopt);
  MoeLayerOptions o;
  o.routing.top_k = top_k;
  nb::gil_scoped_release release;
  const auto start = std::chrono::steady_clock::now();
  MoeLayer layer = MoeLayer::prepare(w, o);
  FP4MOE_CUDA_CHECK(cudaDeviceSynchronize());
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

int cuda_device_count() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();  // clear: no driver or no device is an answer, not an error
    return 0;
  }
  return count;
}

}  // namespace

void register_layer(nb::module_& m) {
  nb::class_<Layer>(m, "Layer")
      .def_static(
          "from_device",
          [](const Array& w13, const Array& w13_scale, const Array& w13_scale_2, const Array& w2, const Array& w2_scale,
             const Array& w2_scale_2, const std::optional<Array>& w13_bias, const std::optional<Array>& w2_bias,
             const std::optional<Array>& w13_input_scale, const std::optional<Array>& w2_input_scale, int top_k,
             const std::string& routing, bool renormalize, int num_groups, int topk_groups, float routed_scaling_factor,
             const std::string& activation, const std::string& activations, const std::string& finalize,
             bool batch_invariant, bool programmatic_launch, int64_t max_tokens, uintptr_t stream) {
            return Layer::from_device(
                w13, w13_scale, w13_scale_2, w2, w2_scale, w2_scale_2, w13_bias, w2_bias, w13_input_scale,
                w2_input_scale,
                make_options(top_k, routing, renormalize, num_groups, topk_groups, routed_scaling_factor, activation,
                             activations, finalize, batch_invariant, programmatic_launch),
                max_tokens, stream);
          },
          nb::arg("w13"), nb::arg("w13_scale"), nb::arg("w13_scale_2"), nb::arg("w2"), nb::arg("w2_scale"),
          nb::arg("w2_scale_2"), nb::arg("w13_bias").none(), nb::arg("w2_bias").none(), nb::kw_only(),
          nb::arg("w13_input_scale").none(), nb::arg("w2_input_scale").none(), nb::arg("top_k"), nb::arg("routing"),
          nb::arg("renormalize"), nb::arg("num_groups"), nb::arg("topk_groups"), nb::arg("routed_scaling_factor"),
          nb::arg("activation"), nb::arg("activations"), nb::arg("finalize"), nb::arg("batch_invariant"),
          nb::arg("programmatic_launch"), nb::arg("max_tokens"), nb::arg("stream"), nb::rv_policy::take_ownership)
      .def_static(
          "from_checkpoint",
          [](const std::string& path, const std::string& prefix, int top_k, const std::string& routing,
             bool renormalize, int num_groups, int topk_groups, float routed_scaling_factor,
             const std::string& activation, const std::string& activations, const std::string& finalize,
             bool batch_invariant, bool programmatic_launch, int64_t max_tokens, int device) {
            return Layer::from_checkpoint(
                path, prefix,
                make_options(top_k, routing, renormalize, num_groups, topk_groups, routed_scaling_factor, activation,
                             activations, finalize, batch_invariant, programmatic_launch),
                max_tokens, device);
          },
          nb::arg("path"), nb::arg("prefix"), nb::kw_only(), nb::arg("top_k"), nb::arg("routing"),
          nb::arg("renormalize"), nb::arg("num_groups"), nb::arg("topk_groups"), nb::arg("routed_scaling_factor"),
          nb::arg("activation"), nb::arg("activations"), nb::arg("finalize"), nb::arg("batch_invariant"),
          nb::arg("programmatic_launch"), nb::arg("max_tokens"), nb::arg("device"), nb::rv_policy::take_ownership)
      // .none(): nanobind refuses None for an argument unless told; the
      // checks in forward() name what is missing or wrong.
      .def("forward", &Layer::forward, nb::arg("hidden_states").none(), nb::arg("out").none(),
           nb::arg("router_logits").none(), nb::arg("correction_bias").none(), nb::arg("topk_ids").none(),
           nb::arg("topk_weights").none(), nb::arg("stream").none())
      .def("device_errors", &Layer::device_errors, nb::arg("stream"))
      .def("host_forward_ns", &Layer::host_forward_ns, nb::arg("hidden_states"), nb::arg("out"),
           nb::arg("router_logits"), nb::arg("stream"), nb::arg("iterations"))
      .def("plan", &Layer::plan, nb::arg("num_tokens"))
      .def_prop_ro("activations", [](const Layer& l) { return fp4moe::to_string(l.layer().activation_numerics()); })
      .def_prop_ro("num_experts", [](const Layer& l) { return l.layer().num_experts(); })
      .def_prop_ro("hidden", [](const Layer& l) { return l.layer().hidden(); })
      .def_prop_ro("inter", [](const Layer& l) { return l.layer().inter(); })
      .def_prop_ro("top_k", [](const Layer& l) { return l.layer().top_k(); })
      .def_prop_ro("device", &Layer::device)
      .def_prop_ro("max_tokens", &Layer::max_tokens)
      .def_prop_ro("workspace_bytes", &Layer::workspace_bytes)
      .def_prop_ro("device_weight_bytes", [](const Layer& l) { return l.layer().device_weight_bytes(); });

  m.def("time_host_prepare", &time_host_prepare, nb::arg("w13"), nb::arg("w13_scale"), nb::arg("w13_scale_2"),
        nb::arg("w2"), nb::arg("w2_scale"), nb::arg("w2_scale_2"), nb::arg("top_k"),
        "Seconds MoeLayer::prepare (host packer + upload) takes for stacked host arrays (benchmarks).");
  m.def("cuda_device_count", &cuda_device_count, "CUDA devices usable by the library (0 without a driver).");
  m.def("cuda_unavailable_reason", &fp4moe::cuda_unavailable_reason,
        "'' where a CUDA device can be used, else why not (the CUDA runtime's error, named).");
  m.def(
      "set_current_stream_fallback", [](nb::object fn) { current_stream_fallback() = std::move(fn); },
      nb::arg("fn").none(),
      "fn(device) -> the current CUDA stream (int) for forwards given stream=None on arrays whose type has "
      "no DLPack C exchange API; None: the legacy default stream.");
  m.def(
      "has_exchange_api", [](nb::handle array) { return exchange_api(Py_TYPE(array.ptr())) != nullptr; },
      nb::arg("array"), "Whether forward reads arrays of this type through DLPack's C exchange API.");
}

}  // namespace fp4moe::python
