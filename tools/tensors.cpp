// Reading the tensors of the CLI's input files (see tensors.hpp).
// Tested through the CLI in tests/tools/test_cli.cpp and by
// fuzz/fuzz_moe_input.cpp.
#include "tensors.hpp"

#include <algorithm>

#include "fp4moe/error.hpp"

namespace fp4moe::cli {

void expect_tensor(const TensorView& view, const std::string& file, std::initializer_list<DType> dtypes,
                   std::initializer_list<int64_t> shape) {
  if (std::find(dtypes.begin(), dtypes.end(), view.dtype) == dtypes.end()) {
    std::string expected;
    for (DType d : dtypes) expected += (expected.empty() ? "" : " or ") + std::string(dtype_name(d));
    FP4MOE_THROW(file, ": tensor '", view.name, "' has dtype ", dtype_name(view.dtype), "; expected ", expected);
  }
  bool ok = view.shape.size() == shape.size();
  for (size_t i = 0; ok && i < shape.size(); ++i) {
    const int64_t want = *(shape.begin() + i);
    ok = want < 0 || view.shape[i] == want;
  }
  if (!ok) {
    std::string expected = "[";
    for (size_t i = 0; i < shape.size(); ++i) {
      const int64_t want = *(shape.begin() + i);
      expected += (i ? ", " : "") + (want < 0 ? std::string("*") : std::to_string(want));
    }
    expected += "]";
    FP4MOE_THROW(file, ": tensor '", view.name, "' has shape ", shape_to_string(view.shape), "; expected ", expected);
  }
}

}  // namespace fp4moe::cli
