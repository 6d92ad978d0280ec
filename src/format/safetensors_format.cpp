// The safetensors format's shared facts: dtype names and sizes, shape
// element counts, and the helpers the reader and writer share
// (safetensors_format.hpp).
// Tested in tests/format/test_safetensors_format.cpp and through the reader
// and writer tests.
#include "format/safetensors_format.hpp"

#include <algorithm>
#include <system_error>

#include "fp4moe/error.hpp"

namespace fp4moe {
namespace safetensors_format {
namespace {

constexpr DType kAllDTypes[] = {DType::BF16, DType::F16, DType::F32, DType::F8_E4M3, DType::U8, DType::I32, DType::I64};

}  // namespace

std::string errno_message(int error_number) { return std::system_category().message(error_number); }

std::optional<DType> find_dtype(std::string_view name) {
  for (DType dtype : kAllDTypes) {
    if (dtype_name(dtype) == name) return dtype;
  }
  return std::nullopt;
}

std::optional<uint64_t> checked_nbytes(std::span<const int64_t> shape, size_t element_bytes) {
  if (std::find(shape.begin(), shape.end(), 0) != shape.end()) return 0;
  int64_t product = static_cast<int64_t>(element_bytes);
  for (int64_t dim : shape) {
    if (dim < 0 || __builtin_mul_overflow(product, dim, &product)) return std::nullopt;
  }
  return static_cast<uint64_t>(product);
}

}  // namespace safetensors_format

using safetensors_format::checked_nbytes;
using safetensors_format::find_dtype;
using safetensors_format::kSupportedDTypes;

size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::BF16:
      return 2;
    case DType::F16:
      return 2;
    case DType::F32:
      return 4;
    case DType::F8_E4M3:
      return 1;
    case DType::U8:
      return 1;
    case DType::I32:
      return 4;
    case DType::I64:
      return 8;
  }
  FP4MOE_THROW("dtype_size: invalid DType value ", static_cast<int>(dtype));
}

std::string_view dtype_name(DType dtype) {
  switch (dtype) {
    case DType::BF16:
      return "BF16";
    case DType::F16:
      return "F16";
    case DType::F32:
      return "F32";
    case DType::F8_E4M3:
      return "F8_E4M3";
    case DType::U8:
      return "U8";
    case DType::I32:
      return "I32";
    case DType::I64:
      return "I64";
  }
  FP4MOE_THROW("dtype_name: invalid DType value ", static_cast<int>(dtype));
}

DType parse_dtype(std::string_view name) {
  const std::optional<DType> dtype = find_dtype(name);
  FP4MOE_CHECK(dtype.has_value(), "unsupported dtype '", name, "' (supported: ", kSupportedDTypes, ")");
  return *dtype;
}

int64_t shape_numel(std::span<const int64_t> shape) {
  for (int64_t dim : shape) {
    FP4MOE_CHECK(dim >= 0, "shape ", shape_to_string(shape), " has a negative dimension");
  }
  const std::optional<uint64_t> numel = checked_nbytes(shape, 1);
  FP4MOE_CHECK(numel.has_value(), "shape ", shape_to_string(shape), " has more elements than fit in 64 bits");
  return static_cast<int64_t>(*numel);
}

std::string shape_to_string(std::span<const int64_t> shape) {
  std::string text = "[";
  for (size_t dim_idx = 0; dim_idx < shape.size(); ++dim_idx) {
    if (dim_idx > 0) text += ", ";
    text += std::to_string(shape[dim_idx]);
  }
  return text + "]";
}

}  // namespace fp4moe
