// Host packer: ModelOpt NVFP4 matrices -> the grouped GEMMs'
// fragment-ordered layout (see fragment_layout.hpp for the layout and why).
// Tested in tests/kernels/test_grouped_gemm_args.cpp (every element round-trips,
// bad input refused) and, on the GPU, tests/kernels/test_grouped_gemm.cpp and
// tests/layer/test_moe_layer_*.cpp (interleave_gate_up through the SwiGLU epilogue).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "fp4moe/error.hpp"
#include "kernels/grouped_gemm.hpp"
#include "kernels/fragment_layout.hpp"
#include "plan/smem_model.hpp"
#include "util/parallel.hpp"

namespace fp4moe {

namespace {
int64_t round_up(int64_t v, int64_t m) { return (v + m - 1) / m * m; }

// Index of fragment (e, group, kf) in the packed arrays.
size_t fragment_index(const PreparedGemmWeights& p, int64_t e, int64_t group, int64_t kf) {
  return static_cast<size_t>(layout::fragment_index(e, group, kf, p.n_padded / kFragRows, p.k_padded / kFragK));
}
}  // namespace

PreparedGemmWeights prepare_gemm_weights(std::span<const Nvfp4Matrix* const> experts) {
  FP4MOE_CHECK(!experts.empty(), "prepare_gemm_weights: no experts given");
  FP4MOE_CHECK(static_cast<int64_t>(experts.size()) <= kMaxExperts, "prepare_gemm_weights: ", experts.size(),
               " experts, but one launch supports at most ", kMaxExperts);
  PreparedGemmWeights p;
  p.num_experts = static_cast<int64_t>(experts.size());
  p.n = experts[0]->rows;
  p.k = experts[0]->cols;
  FP4MOE_CHECK(p.n > 0 && p.n % 16 == 0, "prepare_gemm_weights: n = ", p.n,
               " rows; expected a positive multiple of 16");
  FP4MOE_CHECK(p.k > 0 && p.k % 16 == 0, "prepare_gemm_weights: k = ", p.k,
               " columns; expected a positive multiple of 16");
  p.n_padded = round_up(p.n, layout::kPadN);
  p.k_padded = round_up(p.k, layout::kPadK);
  const int64_t groups = p.n_padded / kFragRows;
  const int64_t frags = p.k_padded / kFragK;
  p.weights.assign(static_cast<size_t>(p.num_experts * groups * frags * kFragBytes), 0);
  p.scales.assign(static_cast<size_t>(p.num_experts * groups * frags * kFragScaleBytes), 0);
  p.global_scales.resize(static_cast<size_t>(p.num_experts));

  // Experts are independent: pack them on all hardware threads (a full
  // DeepSeek-V3 layer is ~10^10 elements).
  auto pack_expert = [&](int64_t e) {
    const Nvfp4Matrix& m = *experts[static_cast<size_t>(e)];
    FP4MOE_CHECK(m.rows == p.n && m.cols == p.k, "prepare_gemm_weights: expert ", e, " is [", m.rows, ", ", m.cols,
                 "], expected [", p.n, ", ", p.k, "] like expert 0");
    FP4MOE_CHECK(m.packed.size() == static_cast<size_t>(m.rows * m.cols / 2) &&
                     m.scales.size() == static_cast<size_t>(m.rows * m.cols / 16),
                 "prepare_gemm_weights: expert ", e, " has ", m.packed.size(), " packed bytes and ", m.scales.size(),
                 " scales; expected ", m.rows * m.cols / 2, " and ", m.rows * m.cols / 16);
    FP4MOE_CHECK(std::isfinite(m.global_scale), "prepare_gemm_weights: expert ", e,
                 " has a non-finite weight_scale_2 (", m.global_scale, ")");
    p.global_scales[static_cast<size_t>(e)] = m.global_scale;
    for (int64_t scale_idx = 0; scale_idx < static_cast<int64_t>(m.scales.size()); ++scale_idx) {
      const uint8_t s = m.scales[static_cast<size_t>(scale_idx)];
      FP4MOE_CHECK(!(s & 0x80) && !e4m3_is_nan(s), "prepare_gemm_weights: expert ", e, " block scale #", scale_idx,
                   " is ", e4m3_to_float(s), "; block scales must be finite and non-negative");
    }
    for (int64_t group = 0; group < groups; ++group) {
      for (int64_t kf = 0; kf < frags; ++kf) {
        const size_t frag = fragment_index(p, e, group, kf);
        uint8_t* wdst = p.weights.data() + frag * kFragBytes;
        uint8_t* sdst = p.scales.data() + frag * kFragScaleBytes;
        for (int lane = 0; lane < 32; ++lane) {
          const int g = lane / 4;
          const int t = lane % 4;
          for (int ks = 0; ks < 4; ++ks) {
            uint32_t word = 0;
            for (int r : {g, g + 8}) {
              for (int kk : {2 * t, 2 * t + 1, 2 * t + 8, 2 * t + 9}) {
                const int64_t row = group * kFragRows + r;
                const int64_t col = kf * kFragK + ks * 16 + kk;
                // A zero block scale zeroes its block: the scale code 0 does
                // not decode to zero, so the codes carry it instead.
                const bool live = row < p.n && col < p.k && m.scale(row, col) != 0;
                const uint32_t code = live ? m.code(row, col) : 0u;
                word |= layout::code_in_slot(layout::code_slot(r, kk), code);
              }
            }
            uint8_t* dst = wdst + lane * 16 + ks * 4;
            for (int b = 0; b < 4; ++b) dst[b] = static_cast<uint8_t>(word >> (8 * b));
          }
        }
        for (int g = 0; g < 8; ++g) {
          for (int ks = 0; ks < 4; ++ks) {
            for (int half = 0; half < 2; ++half) {
              const int64_t row = group * kFragRows + g + half * 8;
              const int64_t col = kf * kFragK + ks * 16;
              sdst[layout::scale_byte(g, ks, half)] =
                  (row < p.n && col < p.k) ? layout::scale_code_from_e4m3(m.scale(row, col)) : 0;
            }
          }
        }
      }
    }
  };
  // An error is the lowest failing expert's, as a serial loop would report it.
  parallel_for(p.num_experts, pack_expert);
  return p;
}

Nvfp4Matrix interleave_gate_up(const Nvfp4Matrix& gate, const Nvfp4Matrix& up) {
  FP4MOE_CHECK(gate.rows == up.rows && gate.cols == up.cols, "interleave_gate_up: gate is [", gate.rows, ", ",
               gate.cols, "] but up is [", up.rows, ", ", up.cols, "]; expected the same shape");
  FP4MOE_CHECK(gate.rows > 0 && gate.rows % 8 == 0 && gate.cols % 16 == 0, "interleave_gate_up: [", gate.rows, ", ",
               gate.cols, "]; expected rows a positive multiple of 8 and cols of 16");
  const size_t row_bytes = static_cast<size_t>(gate.cols / 2);
  const size_t row_scales = static_cast<size_t>(gate.cols / 16);
  FP4MOE_CHECK(gate.packed.size() == row_bytes * gate.rows && up.packed.size() == row_bytes * up.rows &&
                   gate.scales.size() == row_scales * gate.rows && up.scales.size() == row_scales * up.rows,
               "interleave_gate_up: packed or scale arrays do not match the shape");
  Nvfp4Matrix out;
  out.rows = 2 * gate.rows;
  out.cols = gate.cols;
  out.global_scale = gate.global_scale;
  out.input_scale = gate.input_scale;
  out.packed.resize(row_bytes * static_cast<size_t>(out.rows));
  out.scales.resize(row_scales * static_cast<size_t>(out.rows));
  for (int64_t r = 0; r < out.rows; ++r) {
    const int64_t block = r / 16, i = r % 16;
    const Nvfp4Matrix& src = i < 8 ? gate : up;
    const int64_t src_row = block * 8 + i % 8;
    std::memcpy(out.packed.data() + r * row_bytes, src.packed.data() + src_row * row_bytes, row_bytes);
    std::memcpy(out.scales.data() + r * row_scales, src.scales.data() + src_row * row_scales, row_scales);
  }
  return out;
}

float PreparedGemmWeights::value(int64_t e, int64_t r, int64_t c) const {
  FP4MOE_CHECK(e >= 0 && e < num_experts && r >= 0 && r < n && c >= 0 && c < k, "PreparedGemmWeights::value: index (",
               e, ", ", r, ", ", c, ") out of range");
  const int64_t group = r / kFragRows, kf = c / kFragK;
  const int rr = static_cast<int>(r % kFragRows);
  const int kc = static_cast<int>(c % kFragK);
  const int ks = kc / 16, kk = kc % 16;
  const int g = rr % 8, t = (kk % 8) / 2;
  const size_t frag = fragment_index(*this, e, group, kf);
  const uint8_t* word_bytes = weights.data() + frag * kFragBytes + (g * 4 + t) * 16 + ks * 4;
  const uint32_t word =
      word_bytes[0] | (word_bytes[1] << 8) | (word_bytes[2] << 16) | (static_cast<uint32_t>(word_bytes[3]) << 24);
  const uint8_t code = static_cast<uint8_t>(layout::code_of_slot(word, layout::code_slot(rr, kk)));
  const uint8_t scode = scales[frag * kFragScaleBytes + layout::scale_byte(g, ks, rr >= 8 ? 1 : 0)];
  // scale code -> bf16 bits carry the block scale times 2^119.
  const float scale = bf16_to_float(layout::scale_code_to_bf16_bits(scode)) * 0x1p-119f;
  return e2m1_to_float(code) * scale * global_scales[static_cast<size_t>(e)];
}

}  // namespace fp4moe
