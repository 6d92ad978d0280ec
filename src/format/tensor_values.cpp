// The values of a float tensor whatever its dtype (tensor_values.hpp).
// Tested through the checkpoint reader, the converter and the CLI
// (tests/tools/test_cli.cpp); fuzzed by fuzz/fuzz_moe_input.cpp.
#include "format/tensor_values.hpp"

#include <cmath>
#include <cstring>

#include "fp4moe/error.hpp"
#include "fp4moe/nvfp4.hpp"

namespace fp4moe {

bool is_float_dtype(DType dtype) { return dtype == DType::F32 || dtype == DType::BF16 || dtype == DType::F16; }

namespace {

// Calls fn(index, value) for elements [begin, begin + count) of a float tensor.
template <typename Fn>
void for_each_float(const TensorView& view, int64_t begin, int64_t count, Fn&& fn) {
  FP4MOE_CHECK(begin >= 0 && count >= 0 && begin + count <= view.numel(), "tensor '", view.name, "': element range [",
               begin, ", ", begin + count, ") outside its ", view.numel(), " elements");
  const uint8_t* data = view.data;
  // The mapped data of a safetensors file need not be aligned: memcpy each element.
  switch (view.dtype) {
    case DType::F32:
      for (int64_t i = begin; i < begin + count; ++i) {
        float v;
        std::memcpy(&v, data + 4 * i, 4);
        fn(i, v);
      }
      return;
    case DType::BF16:
      for (int64_t i = begin; i < begin + count; ++i) {
        uint16_t h;
        std::memcpy(&h, data + 2 * i, 2);
        fn(i, bf16_to_float(h));
      }
      return;
    case DType::F16:
      for (int64_t i = begin; i < begin + count; ++i) {
        uint16_t h;
        std::memcpy(&h, data + 2 * i, 2);
        fn(i, f16_to_float(h));
      }
      return;
    default:
      FP4MOE_THROW("tensor '", view.name, "' has dtype ", dtype_name(view.dtype),
                   "; expected a float dtype (F32, BF16 or F16)");
  }
}

}  // namespace

std::vector<float> tensor_to_float(const TensorView& view) {
  std::vector<float> out(static_cast<size_t>(view.numel()));
  for_each_float(view, 0, view.numel(), [&](int64_t i, float v) { out[static_cast<size_t>(i)] = v; });
  return out;
}

float tensor_abs_max(const TensorView& view, int64_t begin, int64_t count) {
  float amax = 0.0f;
  for_each_float(view, begin, count, [&](int64_t, float v) {
    const float a = std::fabs(v);
    if (a > amax) amax = a;  // false for NaN
  });
  return amax;
}

}  // namespace fp4moe
