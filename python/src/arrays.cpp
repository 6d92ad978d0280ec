// The array views and checks shared by every binding, and the engines'
// stacked host arrays as MoeWeights (arrays.hpp).
// Tested by tests/python/test_cpu.py (messages with numbers, the CPU
// reference on stacked arrays, the exchange API's lookup) and
// tests/python/test_gpu.py (forward through the exchange API).
#include "arrays.hpp"

namespace fp4moe::python {

const char* dtype_name(DType d) {
  switch (d) {
    case DType::kU8:
      return "uint8 (or float8_e4m3fn for scales)";
    case DType::kBf16:
      return "bfloat16";
    case DType::kF32:
      return "float32";
    case DType::kI32:
      return "int32";
  }
  return "?";
}

bool has_dtype(const nb::dlpack::dtype& t, DType d) {
  using Code = nb::dlpack::dtype_code;
  if (t.lanes != 1) return false;
  switch (d) {
    // Bytes: uint8, int8, or float8_e4m3fn for scales.
    case DType::kU8:
      return t.bits == 8 && (t.code == static_cast<uint8_t>(Code::UInt) || t.code == static_cast<uint8_t>(Code::Int) ||
                             t.code == static_cast<uint8_t>(Code::Float8_E4M3FN));
    case DType::kBf16:
      return t.code == static_cast<uint8_t>(Code::Bfloat) && t.bits == 16;
    case DType::kF32:
      return t.code == static_cast<uint8_t>(Code::Float) && t.bits == 32;
    case DType::kI32:
      return t.code == static_cast<uint8_t>(Code::Int) && t.bits == 32;
  }
  return false;
}

std::string describe(const nb::dlpack::dtype& t) {
  using Code = nb::dlpack::dtype_code;
  const char* kind = "unknown type ";
  switch (static_cast<Code>(t.code)) {
    case Code::Int:
      kind = "int";
      break;
    case Code::UInt:
      kind = "uint";
      break;
    case Code::Float:
      kind = "float";
      break;
    case Code::Bfloat:
      kind = "bfloat";
      break;
    case Code::Bool:
      kind = "bool";
      break;
    case Code::Float8_E4M3FN:
      return "float8_e4m3fn";
    default:
      break;
  }
  return kind + std::to_string(t.bits) + (t.lanes != 1 ? "x" + std::to_string(t.lanes) : "");
}

std::string shape_string(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

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

ArrayView::ArrayView(const char* where, const char* name, nb::handle object) {
  api_ = exchange_api(Py_TYPE(object.ptr()));
  if (api_ != nullptr) {
    if (api_->dltensor_from_py_object_no_sync(object.ptr(), &t_) != 0) throw nb::python_error();
    if (t_.strides == nullptr) compact_strides();
    return;
  }
  Array array;
  FP4MOE_CHECK(nb::try_cast(object, array), where, ": ", name, " is a ", nb::inst_name(object).c_str(),
               "; expected an array (DLPack or buffer protocol)");
  owner_ = std::move(array);
  t_.data = const_cast<void*>(owner_->data());
  t_.device = {owner_->device_type(), owner_->device_id()};
  t_.ndim = static_cast<int32_t>(owner_->ndim());
  t_.dtype = owner_->dtype();
  t_.shape = const_cast<int64_t*>(owner_->shape_ptr());
  t_.strides = const_cast<int64_t*>(owner_->stride_ptr());
  if (t_.strides == nullptr) compact_strides();
}

void ArrayView::compact_strides() {
  compact_.resize(ndim());
  int64_t stride = 1;
  for (size_t i = ndim(); i-- > 0;) {
    compact_[i] = stride;
    stride *= t_.shape[i];
  }
  t_.strides = compact_.data();
}

template <typename A>
void* checked(const char* where, const char* name, const A& a, DType dtype,
              std::initializer_list<std::vector<int64_t>> shapes, int device_id) {
  FP4MOE_CHECK(has_dtype(a.dtype(), dtype), where, ": ", name, " has dtype ", describe(a.dtype()), "; expected ",
               dtype_name(dtype));
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
    FP4MOE_CHECK(a.shape(i) <= 1 || a.stride(i) == stride, where, ": ", name, " with shape ", shape_string(got),
                 " is not contiguous (stride ", a.stride(i), " in dimension ", i, ", expected ", stride,
                 "); pass .contiguous()");
    stride *= static_cast<int64_t>(a.shape(i));
  }
  return const_cast<void*>(static_cast<const void*>(a.data()));
}

template void* checked(const char*, const char*, const Array&, DType, std::initializer_list<std::vector<int64_t>>, int);
template void* checked(const char*, const char*, const ArrayView&, DType, std::initializer_list<std::vector<int64_t>>,
                       int);

std::vector<Nvfp4Matrix> unstack(const char* where, const Array& packed, const Array& scales, const float* scale_2,
                                 int scale_2_stride, int scale_2_offset) {
  FP4MOE_CHECK(packed.ndim() == 3, where, ": packed weights have shape ", shape_string(shape_of(packed)),
               "; expected [E, n, k/2]");
  const int64_t E = static_cast<int64_t>(packed.shape(0)), n = static_cast<int64_t>(packed.shape(1));
  const int64_t k = static_cast<int64_t>(packed.shape(2)) * 2;
  const auto* p = static_cast<const uint8_t*>(checked(where, "packed", packed, DType::kU8, {{E, n, k / 2}}, kHost));
  const auto* s = static_cast<const uint8_t*>(checked(where, "scales", scales, DType::kU8, {{E, n, k / 16}}, kHost));
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

MoeWeights weights_from_stacked(const Array& w13, const Array& w13_scale, const Array& w13_scale_2, const Array& w2,
                                const Array& w2_scale, const Array& w2_scale_2, const std::optional<Array>& w13_bias,
                                const std::optional<Array>& w2_bias, const std::optional<Array>& w13_input_scale,
                                const std::optional<Array>& w2_input_scale, bool fp4) {
  constexpr const char* kWhere = "fp4moe.reference_forward";
  FP4MOE_CHECK(w13.ndim() == 3, kWhere, ": w13 has shape ", shape_string(shape_of(w13)), "; expected [E, 2*I, H/2]");
  const int64_t E = static_cast<int64_t>(w13.shape(0)), I = static_cast<int64_t>(w13.shape(1)) / 2;
  const int64_t H = static_cast<int64_t>(w13.shape(2)) * 2;
  const auto* s13 =
      static_cast<const float*>(checked(kWhere, "w13_scale_2", w13_scale_2, DType::kF32, {{E}, {E, 1}, {E, 2}}, kHost));
  const int halves = w13_scale_2.ndim() == 2 && w13_scale_2.shape(1) == 2 ? 2 : 1;
  const auto* s2 =
      static_cast<const float*>(checked(kWhere, "w2_scale_2", w2_scale_2, DType::kF32, {{E}, {E, 1}}, kHost));
  const std::vector<Nvfp4Matrix> stacked13 = unstack(kWhere, w13, w13_scale, nullptr, 0, 0);
  std::vector<Nvfp4Matrix> down = unstack(kWhere, w2, w2_scale, s2, 1, 0);
  FP4MOE_CHECK(static_cast<int64_t>(down.size()) == E && down[0].rows == H && down[0].cols == I, kWhere,
               ": w2 has shape ", shape_string(shape_of(w2)), "; expected [", E, ", ", H, ", ", I / 2, "]");
  const float* b13 =
      w13_bias ? static_cast<const float*>(checked(kWhere, "w13_bias", *w13_bias, DType::kF32, {{E, 2 * I}}, kHost))
               : nullptr;
  const float* b2 =
      w2_bias ? static_cast<const float*>(checked(kWhere, "w2_bias", *w2_bias, DType::kF32, {{E, H}}, kHost)) : nullptr;
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

}  // namespace fp4moe::python
