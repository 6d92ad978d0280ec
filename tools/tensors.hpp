// Reading the tensors of the CLI's input files: float tensors whatever their
// dtype (the library's, src/format/tensor_values.hpp), and dtype/shape checks
// with messages that name the tensor and file. Host-only (no CUDA), so
// fuzz/fuzz_moe_input.cpp compiles it directly.
// Tested through the CLI in tests/tools/test_cli.cpp and by that fuzz target.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <string>
#include <vector>

#include "format/tensor_values.hpp"
#include "fp4moe/safetensors.hpp"

namespace fp4moe::cli {

// Checks name's dtype and shape; the message names the tensor, the file and
// what was expected. An expected extent of -1 matches any extent.
void expect_tensor(const TensorView& view, const std::string& file, std::initializer_list<DType> dtypes,
                   std::initializer_list<int64_t> shape);

}  // namespace fp4moe::cli
