// Tests of src/format/safetensors_format.cpp: dtype names, sizes and
// parsing, shape element counts and their text.
#include <gtest/gtest.h>

#include <limits>
#include <string>
#include <vector>

#include "expect_error.hpp"
#include "fp4moe/error.hpp"
#include "fp4moe/safetensors.hpp"
#include "safetensors_fixture.hpp"

namespace fp4moe {
namespace {

using namespace std::string_literals;

// ---------------------------------------------------------------------------
// dtype and shape helpers

TEST(SafetensorsHelpers, DTypeNamesSizesAndParsing) {
  const std::pair<DType, size_t> expected_sizes[] = {{DType::BF16, 2},    {DType::F16, 2}, {DType::F32, 4},
                                                     {DType::F8_E4M3, 1}, {DType::U8, 1},  {DType::I32, 4},
                                                     {DType::I64, 8}};
  for (const auto& [dtype, size] : expected_sizes) {
    EXPECT_EQ(dtype_size(dtype), size) << dtype_name(dtype);
    EXPECT_EQ(parse_dtype(dtype_name(dtype)), dtype);
  }
  EXPECT_EQ(dtype_name(DType::F8_E4M3), "F8_E4M3");
  for (const char* unsupported : {"F64", "f32", "", "F8_E5M2", "BOOL", "BF16 "}) {
    const std::string message = error_of([&] { parse_dtype(unsupported); });
    EXPECT_NE(message.find(std::string("unsupported dtype '") + unsupported + "'"), std::string::npos) << message;
  }
}

TEST(SafetensorsHelpers, ShapeNumelAndToString) {
  EXPECT_EQ(shape_numel(std::vector<int64_t>{}), 1);
  EXPECT_EQ(shape_numel(std::vector<int64_t>{7}), 7);
  EXPECT_EQ(shape_numel(std::vector<int64_t>{2, 3, 4}), 24);
  EXPECT_EQ(shape_numel(std::vector<int64_t>{2, 0, 4}), 0);
  // A zero dimension wins even over dimensions whose product would overflow.
  EXPECT_EQ(shape_numel(std::vector<int64_t>{int64_t{1} << 40, int64_t{1} << 40, 0}), 0);
  EXPECT_NE(error_of([] { shape_numel(std::vector<int64_t>{3, -1}); }).find("negative"), std::string::npos);
  EXPECT_NE(error_of([] {
              shape_numel(std::vector<int64_t>{int64_t{1} << 32, int64_t{1} << 32});
            }).find("64 bits"),
            std::string::npos);
  EXPECT_EQ(shape_to_string(std::vector<int64_t>{}), "[]");
  EXPECT_EQ(shape_to_string(std::vector<int64_t>{5}), "[5]");
  EXPECT_EQ(shape_to_string(std::vector<int64_t>{2, 3}), "[2, 3]");
}

}  // namespace
}  // namespace fp4moe
