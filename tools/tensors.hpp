// Reading the tensors of the CLI's input files: float tensors whatever their
// dtype, and dtype/shape checks with messages that name the tensor and file.
// Host-only (no CUDA), so fuzz/fuzz_moe_input.cpp compiles it directly.
// Tested through the CLI in tests/tools/test_cli.cpp and by that fuzz target.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <string>
#include <vector>

#include "fp4moe/safetensors.hpp"

namespace fp4moe::cli {

bool is_float_dtype(DType dtype);  // F32, BF16, F16

// The tensor converted to float (row-major, same element order). Throws
// naming the tensor unless its dtype is F32, BF16 or F16.
std::vector<float> tensor_to_float(const TensorView& view);

// Largest |x| over the float elements [begin, begin + count) of the tensor
// (NaN ignored), without materialising a float copy.
float tensor_abs_max(const TensorView& view, int64_t begin, int64_t count);

// Checks name's dtype and shape; the message names the tensor, the file and
// what was expected. An expected extent of -1 matches any extent.
void expect_tensor(const TensorView& view, const std::string& file,
                   std::initializer_list<DType> dtypes, std::initializer_list<int64_t> shape);

}  // namespace fp4moe::cli
