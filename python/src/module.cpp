// The Python extension module fp4moe._fp4moe (nanobind). Arrays cross the
// boundary as nb::ndarray (DLPack, or the buffer protocol for NumPy) without
// copies; the module links neither libtorch nor Python's torch, so any torch
// version (or none) works. The Python package (python/fp4moe/) wraps it.
// Layer.forward, called per forward, reads arrays whose type publishes
// DLPack's C exchange API (torch >= 2.10) through it instead: a borrowed
// view and the current stream in tens of nanoseconds, where __dlpack__()
// costs microseconds per array (bench/python_bench.py;
// docs/performance.md §5.22).
//
//   Layer        a MoeLayer plus its workspace (sized for max_tokens at
//                construction); forward() validates every array (dtype,
//                device, shape, strides) and launches on the caller's stream:
//                no allocation, no host synchronisation.
//   load_stacked, reference_forward, checkpoint_reference_forward,
//   describe_plan, pack_stacked, pack_host
//                CPU functions: the checkpoint loader, the CPU reference (of
//                stacked arrays, or of a checkpoint layer), the planner for
//                a given architecture, and the two weight packers (the
//                device packer's index mapping evaluated on the CPU, and the
//                host packer) for the tests.
//
// W4A4 (fp4 activations) from the engines' layout: w13_input_scale and
// w2_input_scale as vLLM and SGLang hold them ([E], w13's [E, 2], or one
// value) go to the library's rules (reference.hpp:
// resolve_stacked_activation_numerics, stacked_input_scales), which make
// them what a checkpoint's per-matrix input_scale tensors give; only their
// shapes are read here.
//
// Every fp4moe::Error becomes fp4moe.Error (a ValueError) carrying the
// library's one-line message (with the source location when FP4MOE_VERBOSE=1).
// Tested by tests/python/ (CPU parts everywhere, GPU parts on a GPU).
#include <cuda_runtime_api.h>
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "fp4moe/cuda_check.hpp"
#include "fp4moe/error.hpp"
#include "fp4moe/modelopt.hpp"
#include "fp4moe/moe_layer.hpp"
#include "fp4moe/reference.hpp"
#include "kernels/grouped_gemm.hpp"
#include "kernels/stacked_layout.hpp"
#include "plan/planner.hpp"

namespace nb = nanobind;

namespace fp4moe::python {
namespace {

using Array = nb::ndarray<nb::ro>;  // any dtype, device, shape: checked below
using OutArray = nb::ndarray<>;     // written to

// ---------------------------------------------------------------- checks

enum class DType { kU8, kBf16, kF32, kI32 };

const char* dtype_name(DType d) {
  switch (d) {
    case DType::kU8: return "uint8 (or float8_e4m3fn for scales)";
    case DType::kBf16: return "bfloat16";
    case DType::kF32: return "float32";
    case DType::kI32: return "int32";
  }
  return "?";
}

bool has_dtype(const nb::dlpack::dtype& t, DType d) {
  using Code = nb::dlpack::dtype_code;
  if (t.lanes != 1) return false;
  switch (d) {
    // Bytes: uint8, int8, or float8_e4m3fn for scales.
    case DType::kU8:
      return t.bits == 8 &&
             (t.code == static_cast<uint8_t>(Code::UInt) || t.code == static_cast<uint8_t>(Code::Int) ||
              t.code == static_cast<uint8_t>(Code::Float8_E4M3FN));
    case DType::kBf16: return t.code == static_cast<uint8_t>(Code::Bfloat) && t.bits == 16;
    case DType::kF32: return t.code == static_cast<uint8_t>(Code::Float) && t.bits == 32;
    case DType::kI32: return t.code == static_cast<uint8_t>(Code::Int) && t.bits == 32;
  }
  return false;
}

// e.g. "float32", "bfloat16", "uint8" (DLPack's type code and bits).
std::string describe(const nb::dlpack::dtype& t) {
  using Code = nb::dlpack::dtype_code;
  const char* kind = "unknown type ";
  switch (static_cast<Code>(t.code)) {
    case Code::Int: kind = "int"; break;
    case Code::UInt: kind = "uint"; break;
    case Code::Float: kind = "float"; break;
    case Code::Bfloat: kind = "bfloat"; break;
    case Code::Bool: kind = "bool"; break;
    case Code::Float8_E4M3FN: return "float8_e4m3fn";
    default: break;
  }
  return kind + std::to_string(t.bits) + (t.lanes != 1 ? "x" + std::to_string(t.lanes) : "");
}

std::string shape_string(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

template <typename A>
std::vector<int64_t> shape_of(const A& a) {
  std::vector<int64_t> s(a.ndim());
  for (size_t i = 0; i < a.ndim(); ++i) s[i] = static_cast<int64_t>(a.shape(i));
  return s;
}

// Where arrays must live: a CUDA device (id) or the host (device_id -1).
constexpr int kHost = -1;

// Checks dtype, device, shape (any of `shapes`) and row-major contiguity;
// -1 in a shape matches any extent. Returns the data pointer.
template <typename A>
void* checked(const char* where, const char* name, const A& a, DType dtype,
              std::initializer_list<std::vector<int64_t>> shapes, int device_id) {
  FP4MOE_CHECK(has_dtype(a.dtype(), dtype), where, ": ", name, " has dtype ", describe(a.dtype()),
               "; expected ", dtype_name(dtype));
  if (device_id == kHost) {
    FP4MOE_CHECK(a.device_type() == nb::device::cpu::value, where, ": ", name,
                 " is not in host memory; expected a CPU array");
  } else {
    FP4MOE_CHECK(a.device_type() == nb::device::cuda::value, where, ": ", name,
                 " is not on a CUDA device; expected a tensor on cuda:", device_id);
    FP4MOE_CHECK(a.device_id() == device_id, where, ": ", name, " is on cuda:", a.device_id(),
                 " but the layer is on cuda:", device_id);
  }
  const std::vector<int64_t> got = shape_of(a);
  bool shape_ok = false;
  for (const auto& s : shapes) {
    bool match = s.size() == got.size();
    for (size_t i = 0; match && i < s.size(); ++i) match = s[i] < 0 || s[i] == got[i];
    shape_ok = shape_ok || match;
  }
  if (!shape_ok) {
    std::string expected;
    for (const auto& s : shapes) expected += (expected.empty() ? "" : " or ") + shape_string(s);
    FP4MOE_THROW(where, ": ", name, " has shape ", shape_string(got), "; expected ", expected);
  }
  int64_t stride = 1;
  for (size_t i = a.ndim(); i-- > 0;) {
    FP4MOE_CHECK(a.shape(i) <= 1 || a.stride(i) == stride, where, ": ", name, " with shape ",
                 shape_string(got), " is not contiguous (stride ", a.stride(i), " in dimension ", i,
                 ", expected ", stride, "); pass .contiguous()");
    stride *= static_cast<int64_t>(a.shape(i));
  }
  return const_cast<void*>(static_cast<const void*>(a.data()));
}

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

// ---------------------------------------------------------------- fast views

// DLPack's C exchange API (DLPack 1.3): an array type publishes, as the
// PyCapsule "dlpack_exchange_api" in its `__dlpack_c_exchange_api__`
// attribute, a table of C functions. Only the two used here are typed; the
// layout is the standard's.
struct DLPackVersion {
  uint32_t major;
  uint32_t minor;
};
struct DLPackExchangeAPIHeader {
  DLPackVersion version;
  DLPackExchangeAPIHeader* prev_api;
};
struct DLPackExchangeAPI {
  DLPackExchangeAPIHeader header;
  void* managed_tensor_allocator;
  void* managed_tensor_from_py_object_no_sync;
  void* managed_tensor_to_py_object_no_sync;
  // Fills a borrowed view (valid while the object lives; no stream sync).
  int (*dltensor_from_py_object_no_sync)(void* py_object, nb::dlpack::dltensor* out);
  // The framework's current stream of a device (torch.cuda.current_stream).
  int (*current_work_stream)(int32_t device_type, int32_t device_id, void** out_stream);
};
constexpr uint32_t kDLPackMajor = 1;

// The exchange API of `type`, or null when it has none (or one of another
// major version): looked up once per type, the type kept alive.
const DLPackExchangeAPI* exchange_api(PyTypeObject* type) {
  static std::vector<std::pair<PyTypeObject*, const DLPackExchangeAPI*>> known;
  for (const auto& [t, api] : known)
    if (t == type) return api;
  const DLPackExchangeAPI* api = nullptr;
  PyObject* capsule = PyObject_GetAttrString(reinterpret_cast<PyObject*>(type), "__dlpack_c_exchange_api__");
  if (capsule != nullptr && PyCapsule_IsValid(capsule, "dlpack_exchange_api")) {
    const auto* candidate = static_cast<const DLPackExchangeAPI*>(PyCapsule_GetPointer(capsule, "dlpack_exchange_api"));
    if (candidate != nullptr && candidate->header.version.major == kDLPackMajor &&
        candidate->dltensor_from_py_object_no_sync != nullptr && candidate->current_work_stream != nullptr)
      api = candidate;
  }
  Py_XDECREF(capsule);
  PyErr_Clear();  // no such attribute: the type has no API
  Py_INCREF(reinterpret_cast<PyObject*>(type));
  known.emplace_back(type, api);
  return api;
}

// One array argument of a call, borrowed for the call's duration, with the
// accessors checked() reads: through the exchange API where the type has
// one, otherwise as an nb::ndarray (held here).
class ArrayView {
 public:
  ArrayView(const char* where, const char* name, nb::handle object) {
    api_ = exchange_api(Py_TYPE(object.ptr()));
    if (api_ != nullptr) {
      if (api_->dltensor_from_py_object_no_sync(object.ptr(), &t_) != 0) throw nb::python_error();
      if (t_.strides == nullptr) compact_strides();
      return;
    }
    Array array;
    FP4MOE_CHECK(nb::try_cast(object, array), where, ": ", name, " is a ",
                 nb::inst_name(object).c_str(), "; expected an array (DLPack or buffer protocol)");
    owner_ = std::move(array);
    t_.data = const_cast<void*>(owner_->data());
    t_.device = {owner_->device_type(), owner_->device_id()};
    t_.ndim = static_cast<int32_t>(owner_->ndim());
    t_.dtype = owner_->dtype();
    t_.shape = const_cast<int64_t*>(owner_->shape_ptr());
    t_.strides = const_cast<int64_t*>(owner_->stride_ptr());
    if (t_.strides == nullptr) compact_strides();
  }
  ArrayView(const ArrayView&) = delete;
  ArrayView& operator=(const ArrayView&) = delete;

  nb::dlpack::dtype dtype() const { return t_.dtype; }
  int32_t device_type() const { return t_.device.device_type; }
  int32_t device_id() const { return t_.device.device_id; }
  size_t ndim() const { return static_cast<size_t>(t_.ndim); }
  int64_t shape(size_t i) const { return t_.shape[i]; }
  int64_t stride(size_t i) const { return t_.strides[i]; }
  const void* data() const { return static_cast<const char*>(t_.data) + t_.byte_offset; }
  // The exchange API the array came through, or null.
  const DLPackExchangeAPI* api() const { return api_; }

 private:
  void compact_strides() {
    compact_.resize(ndim());
    int64_t stride = 1;
    for (size_t i = ndim(); i-- > 0;) {
      compact_[i] = stride;
      stride *= t_.shape[i];
    }
    t_.strides = compact_.data();
  }

  nb::dlpack::dltensor t_;
  const DLPackExchangeAPI* api_ = nullptr;
  std::optional<Array> owner_;
  std::vector<int64_t> compact_;
};

// ---------------------------------------------------------------- input scales

// A stacked input_scale array (w13_input_scale, w2_input_scale) as the
// engines hold it: its extent by shape ([E] or [E, 1]: one per expert; w13's
// [E, 2]: gate and up; [] or [1]: one for every expert) and its data,
// checked for dtype, place and contiguity. The values are checked by the
// library (stacked_input_scales).
template <typename A>
std::pair<const float*, InputScaleExtent> input_scale_array(const char* where, const char* name, const A& a,
                                                            int64_t num_experts, bool gate_up, int device_id) {
  const int64_t E = num_experts;
  const auto* data = static_cast<const float*>(
      gate_up ? checked(where, name, a, DType::kF32, {{E}, {E, 1}, {E, 2}, {}, {1}}, device_id)
              : checked(where, name, a, DType::kF32, {{E}, {E, 1}, {}, {1}}, device_id));
  InputScaleExtent extent = InputScaleExtent::kPerExpert;
  if (a.ndim() == 0 || (a.ndim() == 1 && a.shape(0) == 1 && E != 1))
    extent = InputScaleExtent::kPerLayer;
  else if (a.ndim() == 2 && a.shape(1) == 2)
    extent = InputScaleExtent::kPerExpertGateUp;
  return {data, extent};
}

// ---------------------------------------------------------------- options

MoeLayerOptions make_options(int top_k, const std::string& routing, bool renormalize, int num_groups,
                             int topk_groups, float routed_scaling_factor, const std::string& activation,
                             const std::string& activations, const std::string& finalize, bool batch_invariant,
                             bool programmatic_launch) {
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

  static Layer* from_device(const Array& w13, const Array& w13_scale, const Array& w13_scale_2,
                            const Array& w2, const Array& w2_scale, const Array& w2_scale_2,
                            const std::optional<Array>& w13_bias, const std::optional<Array>& w2_bias,
                            const std::optional<Array>& w13_input_scale, const std::optional<Array>& w2_input_scale,
                            const MoeLayerOptions& options, int64_t max_tokens, uintptr_t stream) {
    constexpr const char* kWhere = "fp4moe.MoeLayer";
    FP4MOE_CHECK(w13.device_type() == nb::device::cuda::value, kWhere,
                 ": w13 is not on a CUDA device; expected the stacked weights on a GPU");
    const int device = w13.device_id();
    FP4MOE_CHECK(w13.ndim() == 3 && w2.ndim() == 3, kWhere, ": w13 has shape ", shape_string(shape_of(w13)),
                 " and w2 ", shape_string(shape_of(w2)), "; expected [E, 2*I, H/2] and [E, H, I/2]");
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
    w.w13_scale = static_cast<const uint8_t*>(
        checked(kWhere, "w13_scale", w13_scale, DType::kU8, {{E, 2 * I, H / 16}}, device));
    w.w13_scale_2 = static_cast<const float*>(
        checked(kWhere, "w13_scale_2", w13_scale_2, DType::kF32, {{E}, {E, 1}, {E, 2}}, device));
    w.w13_scale_2_per_half = w13_scale_2.ndim() == 2 && w13_scale_2.shape(1) == 2;
    w.w2 = static_cast<const uint8_t*>(checked(kWhere, "w2", w2, DType::kU8, {{E, H, I / 2}}, device));
    w.w2_scale = static_cast<const uint8_t*>(
        checked(kWhere, "w2_scale", w2_scale, DType::kU8, {{E, H, I / 16}}, device));
    w.w2_scale_2 = static_cast<const float*>(
        checked(kWhere, "w2_scale_2", w2_scale_2, DType::kF32, {{E}, {E, 1}}, device));
    FP4MOE_CHECK(w13_bias.has_value() == w2_bias.has_value(), kWhere,
                 ": give both w13_bias and w2_bias, or neither");
    if (w13_bias) {
      w.w13_bias = static_cast<const float*>(
          checked(kWhere, "w13_bias", *w13_bias, DType::kF32, {{E, 2 * I}}, device));
      w.w2_bias =
          static_cast<const float*>(checked(kWhere, "w2_bias", *w2_bias, DType::kF32, {{E, H}}, device));
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

  static Layer* from_checkpoint(const std::string& path, const std::string& prefix,
                                const MoeLayerOptions& options, int64_t max_tokens, int device) {
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
  void forward(nb::handle hidden_object, nb::handle out_object, nb::handle logits_object,
               nb::handle bias_object, nb::handle ids_object, nb::handle weights_object,
               nb::handle stream_object) const {
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
      ns.push_back(
          std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - start).count());
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

// ---------------------------------------------------------------- CPU functions

template <typename T>
nb::ndarray<nb::numpy, T> numpy_array(std::vector<T>&& data, std::initializer_list<size_t> shape) {
  auto* owned = new std::vector<T>(std::move(data));
  nb::capsule owner(owned, [](void* p) noexcept { delete static_cast<std::vector<T>*>(p); });
  return nb::ndarray<nb::numpy, T>(owned->data(), shape, owner);
}

// Stacked host arrays [E, n, k/2] and [E, n, k/16] -> the E matrices.
std::vector<Nvfp4Matrix> unstack(const char* where, const Array& packed, const Array& scales,
                                 const float* scale_2, int scale_2_stride, int scale_2_offset) {
  FP4MOE_CHECK(packed.ndim() == 3, where, ": packed weights have shape ", shape_string(shape_of(packed)),
               "; expected [E, n, k/2]");
  const int64_t E = static_cast<int64_t>(packed.shape(0)), n = static_cast<int64_t>(packed.shape(1));
  const int64_t k = static_cast<int64_t>(packed.shape(2)) * 2;
  const auto* p =
      static_cast<const uint8_t*>(checked(where, "packed", packed, DType::kU8, {{E, n, k / 2}}, kHost));
  const auto* s =
      static_cast<const uint8_t*>(checked(where, "scales", scales, DType::kU8, {{E, n, k / 16}}, kHost));
  std::vector<Nvfp4Matrix> out(static_cast<size_t>(E));
  for (int64_t e = 0; e < E; ++e) {
    Nvfp4Matrix& m = out[static_cast<size_t>(e)];
    m.rows = n;
    m.cols = k;
    m.packed.assign(p + e * n * k / 2, p + (e + 1) * n * k / 2);
    m.scales.assign(s + e * n * k / 16, s + (e + 1) * n * k / 16);
    m.global_scale = scale_2 ? scale_2[e * scale_2_stride + scale_2_offset] : 1.0f;
  }
  return out;
}

// The engines' stacked host arrays -> MoeWeights (per-expert gate/up/down).
// With fp4 activations, the input scales (both given: resolve the numerics
// first) are each matrix's input_scale, as a checkpoint's tensors give them
// (stacked_input_scales); otherwise only their shapes are checked, as
// MoeLayer does.
MoeWeights weights_from_stacked(const Array& w13, const Array& w13_scale, const Array& w13_scale_2,
                                const Array& w2, const Array& w2_scale, const Array& w2_scale_2,
                                const std::optional<Array>& w13_bias, const std::optional<Array>& w2_bias,
                                const std::optional<Array>& w13_input_scale = std::nullopt,
                                const std::optional<Array>& w2_input_scale = std::nullopt, bool fp4 = false) {
  constexpr const char* kWhere = "fp4moe.reference_forward";
  FP4MOE_CHECK(w13.ndim() == 3, kWhere, ": w13 has shape ", shape_string(shape_of(w13)),
               "; expected [E, 2*I, H/2]");
  const int64_t E = static_cast<int64_t>(w13.shape(0)), I = static_cast<int64_t>(w13.shape(1)) / 2;
  const int64_t H = static_cast<int64_t>(w13.shape(2)) * 2;
  const auto* s13 = static_cast<const float*>(
      checked(kWhere, "w13_scale_2", w13_scale_2, DType::kF32, {{E}, {E, 1}, {E, 2}}, kHost));
  const int halves = w13_scale_2.ndim() == 2 && w13_scale_2.shape(1) == 2 ? 2 : 1;
  const auto* s2 =
      static_cast<const float*>(checked(kWhere, "w2_scale_2", w2_scale_2, DType::kF32, {{E}, {E, 1}}, kHost));
  const std::vector<Nvfp4Matrix> stacked13 = unstack(kWhere, w13, w13_scale, nullptr, 0, 0);
  std::vector<Nvfp4Matrix> down = unstack(kWhere, w2, w2_scale, s2, 1, 0);
  FP4MOE_CHECK(static_cast<int64_t>(down.size()) == E && down[0].rows == H && down[0].cols == I, kWhere,
               ": w2 has shape ", shape_string(shape_of(w2)), "; expected [", E, ", ", H, ", ", I / 2, "]");
  const float* b13 = w13_bias ? static_cast<const float*>(
                                    checked(kWhere, "w13_bias", *w13_bias, DType::kF32, {{E, 2 * I}}, kHost))
                              : nullptr;
  const float* b2 =
      w2_bias ? static_cast<const float*>(checked(kWhere, "w2_bias", *w2_bias, DType::kF32, {{E, H}}, kHost))
              : nullptr;
  FP4MOE_CHECK((b13 == nullptr) == (b2 == nullptr), kWhere, ": give both w13_bias and w2_bias, or neither");
  MoeWeights w;
  w.num_experts = E;
  w.hidden = H;
  w.inter = I;
  w.experts.resize(static_cast<size_t>(E));
  for (int64_t e = 0; e < E; ++e) {
    ExpertWeights& x = w.experts[static_cast<size_t>(e)];
    x.gate = row_slice(stacked13[static_cast<size_t>(e)], 0, I);
    x.gate.global_scale = s13[e * halves];
    x.up = row_slice(stacked13[static_cast<size_t>(e)], I, I);
    x.up.global_scale = s13[e * halves + halves - 1];
    x.down = std::move(down[static_cast<size_t>(e)]);
    if (b13) {
      x.gate_bias.assign(b13 + e * 2 * I, b13 + e * 2 * I + I);
      x.up_bias.assign(b13 + e * 2 * I + I, b13 + (e + 1) * 2 * I);
      x.down_bias.assign(b2 + e * H, b2 + (e + 1) * H);
    }
  }
  if (w13_input_scale && w2_input_scale) {
    const auto [in13, extent13] = input_scale_array(kWhere, "w13_input_scale", *w13_input_scale, E, true, kHost);
    const auto [in2, extent2] = input_scale_array(kWhere, "w2_input_scale", *w2_input_scale, E, false, kHost);
    if (!fp4) return w;
    const std::vector<ExpertInputScales> scales = stacked_input_scales(E, in13, extent13, in2, extent2, kWhere);
    for (int64_t e = 0; e < E; ++e) {
      ExpertWeights& x = w.experts[static_cast<size_t>(e)];
      x.gate.input_scale = scales[static_cast<size_t>(e)].gate;
      x.up.input_scale = scales[static_cast<size_t>(e)].up;
      x.down.input_scale = scales[static_cast<size_t>(e)].down;
      x.gate.has_input_scale = x.up.has_input_scale = x.down.has_input_scale = true;
    }
  }
  return w;
}

// The CPU reference (bf16 intermediate, as the GPU layer stores it) of a
// layer's weights on host arrays; `numerics` kBf16 or kFp4.
nb::ndarray<nb::numpy, float> reference_on(const char* where, const MoeWeights& w, const Array& hidden,
                                           const Array& topk_ids, const Array& topk_weights,
                                           const std::string& activation, ActivationNumerics numerics) {
  FP4MOE_CHECK(hidden.ndim() == 2 && topk_ids.ndim() == 2, where,
               ": hidden_states and topk_ids must be 2-D ([T, H] and [T, k])");
  const int64_t T = static_cast<int64_t>(hidden.shape(0));
  const int64_t k = static_cast<int64_t>(topk_ids.shape(1));
  const auto* x = static_cast<const float*>(
      checked(where, "hidden_states", hidden, DType::kF32, {{T, w.hidden}}, kHost));
  Routing r;
  r.num_tokens = T;
  r.top_k = static_cast<int>(k);
  const auto* ids =
      static_cast<const int32_t*>(checked(where, "topk_ids", topk_ids, DType::kI32, {{T, k}}, kHost));
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
nb::ndarray<nb::numpy, float> reference_forward(const Array& w13, const Array& w13_scale, const Array& w13_scale_2,
                                                const Array& w2, const Array& w2_scale, const Array& w2_scale_2,
                                                const std::optional<Array>& w13_bias,
                                                const std::optional<Array>& w2_bias, const Array& hidden,
                                                const Array& topk_ids, const Array& topk_weights,
                                                const std::string& activation,
                                                const std::optional<Array>& w13_input_scale,
                                                const std::optional<Array>& w2_input_scale,
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

// The device packer's index mapping, evaluated on the CPU.
nb::tuple pack_stacked(const Array& packed, const Array& scales, bool gate_up) {
  FP4MOE_CHECK(packed.ndim() == 3, "fp4moe.pack_stacked: packed has shape ", shape_string(shape_of(packed)),
               "; expected [E, n, k/2]");
  const int64_t E = static_cast<int64_t>(packed.shape(0)), n = static_cast<int64_t>(packed.shape(1));
  const int64_t k = static_cast<int64_t>(packed.shape(2)) * 2;
  layout::StackedNvfp4 s;
  s.packed = static_cast<const uint8_t*>(
      checked("fp4moe.pack_stacked", "packed", packed, DType::kU8, {{E, n, k / 2}}, kHost));
  s.scales = static_cast<const uint8_t*>(
      checked("fp4moe.pack_stacked", "scales", scales, DType::kU8, {{E, n, k / 16}}, kHost));
  s.num_experts = E;
  s.n = n;
  s.k = k;
  s.gate_up = gate_up;
  FP4MOE_CHECK(n % 16 == 0 && k % 16 == 0 && (!gate_up || n % 32 == 0), "fp4moe.pack_stacked: n = ", n,
               ", k = ", k, "; expected multiples of 16 (n of 32 for a gate/up stack)");
  const int64_t frags = s.num_fragments();
  std::vector<uint8_t> w(static_cast<size_t>(frags * kFragBytes)),
      sc(static_cast<size_t>(frags * kFragScaleBytes));
  {
    nb::gil_scoped_release release;
    for (int64_t i = 0; i < frags * layout::kWordsPerFragment; ++i) {
      const uint32_t word = layout::prepared_weight_word(s, i);
      std::memcpy(w.data() + i * 4, &word, 4);
    }
    for (int64_t i = 0; i < frags * kFragScaleBytes; ++i)
      sc[static_cast<size_t>(i)] = layout::prepared_scale_byte(s, i);
  }
  const size_t wn = w.size(), sn = sc.size();
  return nb::make_tuple(numpy_array(std::move(w), {wn}), numpy_array(std::move(sc), {sn}));
}

// The host packer (prepare.cpp), for the same stacked arrays.
nb::tuple pack_host(const Array& packed, const Array& scales, bool gate_up) {
  std::vector<Nvfp4Matrix> ms = unstack("fp4moe.pack_host", packed, scales, nullptr, 0, 0);
  if (gate_up) {
    for (Nvfp4Matrix& m : ms) {
      FP4MOE_CHECK(m.rows % 16 == 0, "fp4moe.pack_host: a gate/up stack needs rows a multiple of 16, not ",
                   m.rows);
      m = interleave_gate_up(row_slice(m, 0, m.rows / 2), row_slice(m, m.rows / 2, m.rows / 2));
    }
  }
  std::vector<const Nvfp4Matrix*> ptrs;
  for (const auto& m : ms) ptrs.push_back(&m);
  PreparedGemmWeights p = prepare_gemm_weights(ptrs);
  const size_t wn = p.weights.size(), sn = p.scales.size();
  return nb::make_tuple(numpy_array(std::move(p.weights), {wn}), numpy_array(std::move(p.scales), {sn}));
}

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
  return nb::make_tuple(
      numpy_array(std::move(m.packed), {static_cast<size_t>(n), static_cast<size_t>(k / 2)}),
      numpy_array(std::move(m.scales), {static_cast<size_t>(n), static_cast<size_t>(k / 16)}), s2);
}

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

// What the planner picks for a layer of this shape on `arch` ("sm90", ...;
// no GPU needed), described as MoeLayer.plan describes a layer's plan: the
// heuristic's, with `num_sms` multiprocessors and two blocks per SM for the
// split-K choice (a GPU layer sizes that by its kernels' occupancy, and a
// tune cache may override either GEMM).
std::string describe_plan(int64_t num_experts, int top_k, int64_t hidden, int64_t inter, int64_t num_tokens,
                          const std::string& arch, int num_sms, bool batch_invariant) {
  const ArchLimits limits = arch_limits(arch);
  FP4MOE_CHECK(num_sms >= 1, "fp4moe.describe_plan: num_sms = ", num_sms, "; expected >= 1");
  FP4MOE_CHECK(top_k >= 1 && num_tokens >= 1, "fp4moe.describe_plan: top_k = ", top_k, ", num_tokens = ",
               num_tokens, "; expected >= 1 each");
  MoeLayerPlan p;
  p.num_tokens = num_tokens;
  p.num_rows = num_tokens * top_k;
  GemmPlan* plans[2] = {&p.gemm1, &p.gemm2};
  for (int gemm : {1, 2}) {
    const GemmProblem problem = moe_gemm_problem(gemm, num_experts, top_k, hidden, inter, num_tokens, batch_invariant);
    *plans[gemm - 1] = limit_split_k(
        plan_gemm(problem, limits.smem_per_block, num_sms, limits.compute_capability), batch_invariant);
  }
  return p.describe();
}

int cuda_device_count() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();  // clear: no driver or no device is an answer, not an error
    return 0;
  }
  return count;
}

// Why no CUDA device can be used: "" when one can, else the CUDA runtime's
// error (name and text) or that it counts none, so that a broken driver is
// told apart from a machine without a GPU.
std::string cuda_unavailable_reason() {
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    cudaGetLastError();
    return std::string("cudaGetDeviceCount failed: ") + cudaGetErrorName(err) + " (" + cudaGetErrorString(err) +
           ")";
  }
  return count > 0 ? std::string() : std::string("cudaGetDeviceCount counts 0 devices");
}

bool verbose_errors() {
  const char* v = std::getenv("FP4MOE_VERBOSE");
  return v != nullptr && *v != '\0' && std::string(v) != "0";
}

}  // namespace
}  // namespace fp4moe::python

NB_MODULE(_fp4moe, m) {
  using namespace fp4moe::python;
  using fp4moe::python::Layer;
  m.doc() = "fp4moe: NVFP4 Mixture-of-Experts layers (the compiled part; see the fp4moe package)";

  static nb::exception<fp4moe::Error> error(m, "Error", PyExc_ValueError);
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const fp4moe::Error& e) {
      PyErr_SetString(error.ptr(), verbose_errors() ? e.what() : e.message().c_str());
    }
  });

  nb::class_<Layer>(m, "Layer")
      .def_static(
          "from_device",
          [](const Array& w13, const Array& w13_scale, const Array& w13_scale_2, const Array& w2,
             const Array& w2_scale, const Array& w2_scale_2, const std::optional<Array>& w13_bias,
             const std::optional<Array>& w2_bias, const std::optional<Array>& w13_input_scale,
             const std::optional<Array>& w2_input_scale, int top_k, const std::string& routing, bool renormalize,
             int num_groups, int topk_groups, float routed_scaling_factor, const std::string& activation,
             const std::string& activations, const std::string& finalize, bool batch_invariant,
             bool programmatic_launch, int64_t max_tokens, uintptr_t stream) {
            return Layer::from_device(
                w13, w13_scale, w13_scale_2, w2, w2_scale, w2_scale_2, w13_bias, w2_bias, w13_input_scale,
                w2_input_scale,
                make_options(top_k, routing, renormalize, num_groups, topk_groups, routed_scaling_factor,
                             activation, activations, finalize, batch_invariant, programmatic_launch),
                max_tokens, stream);
          },
          nb::arg("w13"), nb::arg("w13_scale"), nb::arg("w13_scale_2"), nb::arg("w2"), nb::arg("w2_scale"),
          nb::arg("w2_scale_2"), nb::arg("w13_bias").none(), nb::arg("w2_bias").none(), nb::kw_only(),
          nb::arg("w13_input_scale").none(), nb::arg("w2_input_scale").none(), nb::arg("top_k"),
          nb::arg("routing"), nb::arg("renormalize"), nb::arg("num_groups"), nb::arg("topk_groups"),
          nb::arg("routed_scaling_factor"), nb::arg("activation"), nb::arg("activations"), nb::arg("finalize"),
          nb::arg("batch_invariant"), nb::arg("programmatic_launch"), nb::arg("max_tokens"), nb::arg("stream"),
          nb::rv_policy::take_ownership)
      .def_static(
          "from_checkpoint",
          [](const std::string& path, const std::string& prefix, int top_k, const std::string& routing,
             bool renormalize, int num_groups, int topk_groups, float routed_scaling_factor,
             const std::string& activation, const std::string& activations, const std::string& finalize,
             bool batch_invariant, bool programmatic_launch, int64_t max_tokens, int device) {
            return Layer::from_checkpoint(
                path, prefix,
                make_options(top_k, routing, renormalize, num_groups, topk_groups, routed_scaling_factor,
                             activation, activations, finalize, batch_invariant, programmatic_launch),
                max_tokens, device);
          },
          nb::arg("path"), nb::arg("prefix"), nb::kw_only(), nb::arg("top_k"), nb::arg("routing"),
          nb::arg("renormalize"), nb::arg("num_groups"), nb::arg("topk_groups"),
          nb::arg("routed_scaling_factor"), nb::arg("activation"), nb::arg("activations"), nb::arg("finalize"),
          nb::arg("batch_invariant"), nb::arg("programmatic_launch"), nb::arg("max_tokens"),
          nb::arg("device"), nb::rv_policy::take_ownership)
      // .none(): nanobind refuses None for an argument unless told; the
      // checks in forward() name what is missing or wrong.
      .def("forward", &Layer::forward, nb::arg("hidden_states").none(), nb::arg("out").none(),
           nb::arg("router_logits").none(), nb::arg("correction_bias").none(), nb::arg("topk_ids").none(),
           nb::arg("topk_weights").none(), nb::arg("stream").none())
      .def("device_errors", &Layer::device_errors, nb::arg("stream"))
      .def("host_forward_ns", &Layer::host_forward_ns, nb::arg("hidden_states"), nb::arg("out"),
           nb::arg("router_logits"), nb::arg("stream"), nb::arg("iterations"))
      .def("plan", &Layer::plan, nb::arg("num_tokens"))
      .def_prop_ro("activations",
                   [](const Layer& l) { return fp4moe::to_string(l.layer().activation_numerics()); })
      .def_prop_ro("num_experts", [](const Layer& l) { return l.layer().num_experts(); })
      .def_prop_ro("hidden", [](const Layer& l) { return l.layer().hidden(); })
      .def_prop_ro("inter", [](const Layer& l) { return l.layer().inter(); })
      .def_prop_ro("top_k", [](const Layer& l) { return l.layer().top_k(); })
      .def_prop_ro("device", &Layer::device)
      .def_prop_ro("max_tokens", &Layer::max_tokens)
      .def_prop_ro("workspace_bytes", &Layer::workspace_bytes)
      .def_prop_ro("device_weight_bytes", [](const Layer& l) { return l.layer().device_weight_bytes(); });

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
  m.def("pack_stacked", &pack_stacked, nb::arg("packed"), nb::arg("scales"), nb::arg("gate_up"),
        "The device packer's index mapping evaluated on the CPU: (weights, scales) uint8 arrays.");
  m.def("pack_host", &pack_host, nb::arg("packed"), nb::arg("scales"), nb::arg("gate_up"),
        "The host packer on the same arrays: (weights, scales) uint8 arrays.");
  m.def("load_stacked", &load_stacked, nb::arg("path"), nb::arg("prefix"),
        "A checkpoint layer's experts as stacked host arrays (w13_scale_2 as [E, 2]).");
  m.def("quantize", &quantize, nb::arg("weights"), nb::arg("global_scale").none() = nb::none(),
        "ModelOpt NVFP4 quantisation of a float32 [N, K] host array: (packed, scales, weight_scale_2); "
        "global_scale (gate and up share one) defaults to amax / 2688.");
  m.def("time_host_prepare", &time_host_prepare, nb::arg("w13"), nb::arg("w13_scale"), nb::arg("w13_scale_2"),
        nb::arg("w2"), nb::arg("w2_scale"), nb::arg("w2_scale_2"), nb::arg("top_k"),
        "Seconds MoeLayer::prepare (host packer + upload) takes for stacked host arrays (benchmarks).");
  m.def("describe_plan", &describe_plan, nb::arg("num_experts"), nb::arg("top_k"), nb::arg("hidden"),
        nb::arg("inter"), nb::arg("num_tokens"), nb::kw_only(), nb::arg("arch") = "sm90", nb::arg("num_sms") = 132,
        nb::arg("batch_invariant") = false,
        "What the planner picks for a layer of this shape on an architecture (sm80, sm86, sm89, sm90, sm100, "
        "sm120), as MoeLayer.plan describes it; no GPU needed (the heuristic's choice: a tune cache may differ).");
  m.def("cuda_device_count", &cuda_device_count, "CUDA devices usable by the library (0 without a driver).");
  m.def("cuda_unavailable_reason", &cuda_unavailable_reason,
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
