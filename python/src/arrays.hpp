// What every binding of the extension module fp4moe._fp4moe shares: the
// array types, the borrowed view of an array through DLPack's C exchange
// API (Layer.forward's fast path), the checks of an array's dtype, device,
// shape and strides (one message per mistake, naming the call and the
// argument), NumPy arrays that own a vector, and the engines' stacked host
// arrays turned into the library's MoeWeights. Each domain registers its functions in its
// own file (python/src/bind_*.cpp, declared at the end), module.cpp calls
// them.
//
// Tested by tests/python/ (CPU parts everywhere, GPU parts on a GPU).
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <cstdint>
#include <initializer_list>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "fp4moe/error.hpp"
#include "fp4moe/modelopt.hpp"
#include "fp4moe/reference.hpp"

namespace nb = nanobind;

namespace fp4moe::python {

using Array = nb::ndarray<nb::ro>;  // any dtype, device, shape: checked below
using OutArray = nb::ndarray<>;     // written to

// ---------------------------------------------------------------- checks

enum class DType { kU8, kBf16, kF32, kI32 };

const char* dtype_name(DType d);
bool has_dtype(const nb::dlpack::dtype& t, DType d);
// e.g. "float32", "bfloat16", "uint8" (DLPack's type code and bits).
std::string describe(const nb::dlpack::dtype& t);
std::string shape_string(const std::vector<int64_t>& shape);

template <typename A>
std::vector<int64_t> shape_of(const A& a) {
  std::vector<int64_t> s(a.ndim());
  for (size_t i = 0; i < a.ndim(); ++i) s[i] = static_cast<int64_t>(a.shape(i));
  return s;
}

// Where arrays must live: a CUDA device (id) or the host (device_id -1).
constexpr int kHost = -1;

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
const DLPackExchangeAPI* exchange_api(PyTypeObject* type);

// One array argument of a call, borrowed for the call's duration, with the
// accessors checked() reads: through the exchange API where the type has
// one, otherwise as an nb::ndarray (held here).
class ArrayView {
 public:
  ArrayView(const char* where, const char* name, nb::handle object);
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
  void compact_strides();

  nb::dlpack::dltensor t_;
  const DLPackExchangeAPI* api_ = nullptr;
  std::optional<Array> owner_;
  std::vector<int64_t> compact_;
};

// ---------------------------------------------------------------- array checks

// Checks dtype, device, shape (any of `shapes`) and row-major contiguity;
// -1 in a shape matches any extent. Returns the data pointer. Defined in
// arrays.cpp for Array and ArrayView.
template <typename A>
void* checked(const char* where, const char* name, const A& a, DType dtype,
              std::initializer_list<std::vector<int64_t>> shapes, int device_id);

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

// A NumPy array of shape `shape` that owns `data`.
template <typename T>
nb::ndarray<nb::numpy, T> numpy_array(std::vector<T>&& data, std::initializer_list<size_t> shape) {
  auto* owned = new std::vector<T>(std::move(data));
  nb::capsule owner(owned, [](void* p) noexcept { delete static_cast<std::vector<T>*>(p); });
  return nb::ndarray<nb::numpy, T>(owned->data(), shape, owner);
}

// Stacked host arrays [E, n, k/2] and [E, n, k/16] -> the E matrices, each
// with global scale scale_2[e * scale_2_stride + scale_2_offset] (1 without
// scale_2).
std::vector<Nvfp4Matrix> unstack(const char* where, const Array& packed, const Array& scales, const float* scale_2,
                                 int scale_2_stride, int scale_2_offset);

// The engines' stacked host arrays -> MoeWeights (per-expert gate/up/down).
// With fp4 activations, the input scales (both given: resolve the numerics
// first) are each matrix's input_scale, as a checkpoint's tensors give them
// (stacked_input_scales); otherwise only their shapes are checked, as
// MoeLayer does.
MoeWeights weights_from_stacked(const Array& w13, const Array& w13_scale, const Array& w13_scale_2, const Array& w2,
                                const Array& w2_scale, const Array& w2_scale_2, const std::optional<Array>& w13_bias,
                                const std::optional<Array>& w2_bias,
                                const std::optional<Array>& w13_input_scale = std::nullopt,
                                const std::optional<Array>& w2_input_scale = std::nullopt, bool fp4 = false);

// The bindings of each domain, called once by NB_MODULE (module.cpp).
void register_layer(nb::module_& m);      // bind_layer.cpp: Layer, the CUDA device queries
void register_reference(nb::module_& m);  // bind_reference.cpp: the CPU reference
void register_prepare(nb::module_& m);    // bind_prepare.cpp: the weight packers
void register_format(nb::module_& m);     // bind_format.cpp: checkpoints, quantisation, config.json
void register_plan(nb::module_& m);       // bind_plan.cpp: the planner

}  // namespace fp4moe::python
