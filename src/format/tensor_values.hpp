// The values of a float tensor (F32, BF16, F16) whatever its dtype: the
// checkpoint reader's float tensors (routers, biases, unquantised shared
// experts), the converter's inputs (convert.cpp) and the CLI's input files
// (tools/tensors.hpp) all read them here. Internal to the library.
//
// Tested through the checkpoint reader (tests/format/test_moe_weights_reader.cpp),
// the converter (tests/tools/test_quantize.cpp) and the CLI
// (tests/tools/test_cli.cpp).
#pragma once

#include <cstdint>
#include <vector>

#include "fp4moe/safetensors.hpp"

namespace fp4moe {

bool is_float_dtype(DType dtype);  // F32, BF16, F16

// The tensor converted to float (row-major, same element order). Throws
// naming the tensor unless its dtype is F32, BF16 or F16.
std::vector<float> tensor_to_float(const TensorView& view);

// Largest |x| over the float elements [begin, begin + count) of the tensor
// (NaN ignored), without materialising a float copy.
float tensor_abs_max(const TensorView& view, int64_t begin, int64_t count);

}  // namespace fp4moe
