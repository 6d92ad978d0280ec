// NVFP4 quantisation in ModelOpt's order of operations (docs/design.md §3),
// dequantisation, and the row and column slices of a quantised matrix.
//
// Tested in tests/format/test_modelopt_quantize.cpp: quantise/dequantise error bounds
// on random data, idempotence, the special cases (zero blocks, the amax
// element, subnormal block scales) and hand-computed bytes.
#include <algorithm>
#include <cmath>

#include "fp4moe/error.hpp"
#include "fp4moe/modelopt.hpp"
#include "fp4moe/nvfp4.hpp"

namespace fp4moe {

float Nvfp4Matrix::value(int64_t r, int64_t c) const {
  return nvfp4_dequantize_value(code(r, c), scale(r, c), global_scale);
}

std::vector<float> Nvfp4Matrix::dequantize() const {
  std::vector<float> out(static_cast<size_t>(rows * cols));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) out[static_cast<size_t>(r * cols + c)] = value(r, c);
  return out;
}

Nvfp4Matrix row_slice(const Nvfp4Matrix& m, int64_t begin, int64_t count) {
  Nvfp4Matrix out;
  out.rows = count;
  out.cols = m.cols;
  out.global_scale = m.global_scale;
  out.input_scale = m.input_scale;
  out.has_input_scale = m.has_input_scale;
  out.packed.assign(m.packed.begin() + begin * (m.cols / 2), m.packed.begin() + (begin + count) * (m.cols / 2));
  out.scales.assign(m.scales.begin() + begin * (m.cols / 16), m.scales.begin() + (begin + count) * (m.cols / 16));
  return out;
}

Nvfp4Matrix column_slice(const Nvfp4Matrix& m, int64_t begin, int64_t count) {
  Nvfp4Matrix out;
  out.rows = m.rows;
  out.cols = count;
  out.global_scale = m.global_scale;
  out.input_scale = m.input_scale;
  out.has_input_scale = m.has_input_scale;
  out.packed.resize(static_cast<size_t>(m.rows * count / 2));
  out.scales.resize(static_cast<size_t>(m.rows * count / 16));
  for (int64_t r = 0; r < m.rows; ++r) {
    std::copy_n(m.packed.begin() + r * (m.cols / 2) + begin / 2, count / 2, out.packed.begin() + r * (count / 2));
    std::copy_n(m.scales.begin() + r * (m.cols / 16) + begin / 16, count / 16, out.scales.begin() + r * (count / 16));
  }
  return out;
}

bool valid_input_scale(float value) {
  return std::isfinite(value) && value >= kMinInputScale && value <= kMaxInputScale;
}

std::string input_scale_rule() {
  return detail::concat("a finite input_scale in [", kMinInputScale, ", ", kMaxInputScale,
                        "] (the calibrated activation amax / 2688)");
}

float abs_max(const float* data, size_t count) {
  float amax = 0.0f;
  for (size_t i = 0; i < count; ++i) {
    const float a = std::fabs(data[i]);
    if (a > amax) amax = a;  // false for NaN, which is thereby ignored
  }
  return amax;
}

Nvfp4Matrix quantize_nvfp4(const float* weights, int64_t rows, int64_t cols, std::optional<float> global_scale) {
  FP4MOE_CHECK(rows >= 0 && cols >= 0, "quantize_nvfp4: shape [", rows, ", ", cols, "] has a negative dimension");
  FP4MOE_CHECK(cols % kNvfp4BlockSize == 0, "quantize_nvfp4: cols (K) = ", cols,
               " is not a multiple of the NVFP4 block size ", kNvfp4BlockSize);
  const size_t count = static_cast<size_t>(rows * cols);
  FP4MOE_CHECK(weights != nullptr || count == 0, "quantize_nvfp4: weights is null for a [", rows, ", ", cols,
               "] matrix");
  // A non-finite weight would make the global scale (or a block scale)
  // meaningless; no checkpoint should contain one.
  for (size_t i = 0; i < count; ++i)
    FP4MOE_CHECK(std::isfinite(weights[i]), "quantize_nvfp4: weight [", i / cols, ", ", i % cols, "] is ", weights[i],
                 "; expected finite values");

  const float amax = abs_max(weights, count);
  const float s2 = global_scale ? *global_scale : nvfp4_global_scale(amax);
  FP4MOE_CHECK(std::isfinite(s2) && s2 >= 0.0f, "quantize_nvfp4: global scale ", s2,
               " is not a finite non-negative number");
  FP4MOE_CHECK(s2 > 0.0f || amax == 0.0f,
               "quantize_nvfp4: global scale 0 given for a matrix "
               "with abs max ",
               amax, "; expected amax / 2688 or more");

  Nvfp4Matrix m;
  m.rows = rows;
  m.cols = cols;
  m.global_scale = s2;
  m.packed.assign(count / 2, 0);
  m.scales.assign(count / kNvfp4BlockSize, 0);
  for (size_t block = 0; block < m.scales.size(); ++block) {
    const float* x = weights + block * kNvfp4BlockSize;
    const uint8_t ws = nvfp4_block_scale(abs_max(x, kNvfp4BlockSize), s2);
    m.scales[block] = ws;
    uint8_t* out = m.packed.data() + block * (kNvfp4BlockSize / 2);
    for (int i = 0; i < kNvfp4BlockSize; i += 2) {
      const uint8_t even = nvfp4_quantize_value(x[i], ws, s2);
      const uint8_t odd = nvfp4_quantize_value(x[i + 1], ws, s2);
      out[i / 2] = static_cast<uint8_t>(even | (odd << 4));
    }
  }
  return m;
}

}  // namespace fp4moe
