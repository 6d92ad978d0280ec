// CPU test of stacked_layout.hpp, the index mapping the device packer
// (prepare_device.cu) runs one thread per element: evaluated here on the CPU
// for every prepared weight word and scale byte, it must equal the host
// packer's output (prepare_gemm_weights, with interleave_gate_up for a
// gate/up stack) byte for byte. Shapes enumerate expert counts, N and K at
// and off the 128/256 padding, a gate/up stack whose halves are not
// multiples of 128, and zero block scales (which zero their codes).
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <vector>

#include "kernels/grouped_gemm.hpp"
#include "kernels/stacked_layout.hpp"
#include "gpu_test_util.hpp"

namespace fp4moe {
namespace {

struct Shape {
  int64_t num_experts, n, k;
  bool gate_up;
};

// The stacked arrays [E, n, k/2] and [E, n, k/16] of the experts' matrices.
void stack(const std::vector<Nvfp4Matrix>& ms, std::vector<uint8_t>& packed, std::vector<uint8_t>& scales) {
  packed.clear();
  scales.clear();
  for (const Nvfp4Matrix& m : ms) {
    packed.insert(packed.end(), m.packed.begin(), m.packed.end());
    scales.insert(scales.end(), m.scales.begin(), m.scales.end());
  }
}

TEST(StackedLayout, EqualsTheHostPackerByteForByte) {
  const Shape shapes[] = {
      {1, 16, 16, false}, {3, 128, 256, false}, {2, 144, 272, false}, {2, 48, 64, false},
      {1, 32, 16, true},  {3, 96, 80, true},    {2, 256, 512, true},  {4, 320, 48, true},
  };
  std::mt19937 rng(7);
  for (const Shape& s : shapes) {
    SCOPED_TRACE(::testing::Message() << "E " << s.num_experts << " n " << s.n << " k " << s.k
                                      << (s.gate_up ? " gate/up" : ""));
    // Source matrices as an engine stacks them: [gate; up] for a gate/up stack.
    std::vector<Nvfp4Matrix> source;
    std::vector<Nvfp4Matrix> for_host;  // what prepare_gemm_weights gets
    for (int64_t e = 0; e < s.num_experts; ++e) {
      Nvfp4Matrix m = testing::random_nvfp4(s.n, s.k, 1.0f, rng);
      // Some zero block scales: their codes must be packed as zeros.
      for (size_t i = 0; i < m.scales.size(); i += 7) m.scales[i] = 0;
      if (s.gate_up) {
        Nvfp4Matrix gate = m, up = m;
        gate.rows = up.rows = s.n / 2;
        const size_t half_packed = m.packed.size() / 2, half_scales = m.scales.size() / 2;
        gate.packed.assign(m.packed.begin(), m.packed.begin() + half_packed);
        up.packed.assign(m.packed.begin() + half_packed, m.packed.end());
        gate.scales.assign(m.scales.begin(), m.scales.begin() + half_scales);
        up.scales.assign(m.scales.begin() + half_scales, m.scales.end());
        for_host.push_back(interleave_gate_up(gate, up));
      } else {
        for_host.push_back(m);
      }
      source.push_back(std::move(m));
    }
    std::vector<const Nvfp4Matrix*> ptrs;
    for (const auto& m : for_host) ptrs.push_back(&m);
    const PreparedGemmWeights host = prepare_gemm_weights(ptrs);

    std::vector<uint8_t> packed, scales;
    stack(source, packed, scales);
    const layout::StackedNvfp4 src{packed.data(), scales.data(), s.num_experts, s.n, s.k, s.gate_up};
    ASSERT_EQ(static_cast<size_t>(src.num_fragments() * kFragBytes), host.weights.size());
    ASSERT_EQ(static_cast<size_t>(src.num_fragments() * kFragScaleBytes), host.scales.size());

    int mismatches = 0;
    for (int64_t w = 0; w < src.num_fragments() * layout::kWordsPerFragment; ++w) {
      uint32_t expected;
      std::memcpy(&expected, host.weights.data() + w * 4, 4);
      const uint32_t got = layout::prepared_weight_word(src, w);
      if (got != expected && ++mismatches <= 5)
        ADD_FAILURE() << "weight word " << w << ": 0x" << std::hex << got << ", host packer 0x" << expected;
    }
    for (int64_t b = 0; b < src.num_fragments() * kFragScaleBytes; ++b) {
      const uint8_t got = layout::prepared_scale_byte(src, b);
      if (got != host.scales[static_cast<size_t>(b)] && ++mismatches <= 10)
        ADD_FAILURE() << "scale byte " << b << ": " << int{got} << ", host packer "
                      << int{host.scales[static_cast<size_t>(b)]};
    }
    EXPECT_EQ(mismatches, 0);
  }
}

TEST(StackedLayout, SourceRowOfAGateUpStackInterleavesBlocksOfEight) {
  // n = 64: gate rows 0..31, up rows 32..63 of the stack.
  EXPECT_EQ(layout::stacked_source_row(0, 64, true), 0);
  EXPECT_EQ(layout::stacked_source_row(7, 64, true), 7);
  EXPECT_EQ(layout::stacked_source_row(8, 64, true), 32);
  EXPECT_EQ(layout::stacked_source_row(15, 64, true), 39);
  EXPECT_EQ(layout::stacked_source_row(16, 64, true), 8);
  EXPECT_EQ(layout::stacked_source_row(63, 64, true), 63);
  EXPECT_EQ(layout::stacked_source_row(63, 64, false), 63);
}

}  // namespace
}  // namespace fp4moe
