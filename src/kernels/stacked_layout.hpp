// The index mapping from stacked ModelOpt NVFP4 expert tensors, as inference
// engines hold them, to the grouped GEMMs' fragment-ordered layout
// (fragment_layout.hpp):
//
//   packed [E, n, k/2]  u8, even element in the low nibble
//   scales [E, n, k/16] e4m3 block scales
//
// and, for GEMM1, the rows of each expert are [gate rows; up rows] (the
// engines' w13), prepared interleaved as interleave_gate_up() does on the host.
//
// Every element of the prepared arrays is a pure function of its index and the
// source, so the device packer (prepare_device.cu) runs one thread per word
// and tests/kernels/test_stacked_layout.cpp evaluates the same functions on
// the CPU and checks them against the host packer (prepare.cpp), byte for byte.
#pragma once

#include <cstdint>

#include "kernels/fragment_layout.hpp"
#include "plan/smem_model.hpp"
#include "util/host_device.hpp"

namespace fp4moe::layout {

// Words (uint32) of one 512-byte weight fragment.
inline constexpr int kWordsPerFragment = kFragBytes / 4;  // 128

// E matrices [n, k] stacked, row-major, contiguous.
struct StackedNvfp4 {
  const uint8_t* packed = nullptr;  // [E, n, k/2]
  const uint8_t* scales = nullptr;  // [E, n, k/16] e4m3
  int64_t num_experts = 0;
  int64_t n = 0;         // rows per expert (2 inter for a gate/up stack)
  int64_t k = 0;         // columns, a multiple of 16
  bool gate_up = false;  // rows are [gate; up]: prepare them interleaved
  FP4MOE_HOST_DEVICE int64_t n_groups() const { return (n + kPadN - 1) / kPadN * kPadN / kFragRows; }  // N_pad / 16
  FP4MOE_HOST_DEVICE int64_t k_frags() const { return (k + kPadK - 1) / kPadK * kPadK / kFragK; }      // K_pad / 64
  FP4MOE_HOST_DEVICE int64_t num_fragments() const { return num_experts * n_groups() * k_frags(); }
};

// The source row (within its expert) of prepared row `row`: the identity, or
// for a gate/up stack the interleave of interleave_gate_up(): row 16b + i is
// gate row 8b + i for i < 8 and up row 8b + i - 8 (stack row n/2 + 8b + i - 8).
FP4MOE_HOST_DEVICE int64_t stacked_source_row(int64_t row, int64_t n, bool gate_up) {
  if (!gate_up) return row;
  const int64_t block = row / 16, i = row % 16;
  return i < 8 ? block * 8 + i : n / 2 + block * 8 + (i - 8);
}

// Fragment number `frag` (the order of fragment_index()) -> (expert, 16-row
// group, 64-wide K step).
struct FragmentCoords {
  int64_t expert, group, kf;
};
FP4MOE_HOST_DEVICE FragmentCoords fragment_coords(int64_t frag, int64_t n_groups, int64_t k_frags) {
  const int64_t tiles_per_expert = n_groups / kTileGroups;
  const int64_t group_in_tile = frag % kTileGroups;
  const int64_t rest = frag / kTileGroups;
  const int64_t kf = rest % k_frags;
  const int64_t tile = rest / k_frags;
  return {tile / tiles_per_expert, (tile % tiles_per_expert) * kTileGroups + group_in_tile, kf};
}

// Inverse of code_slot(): the (row r in 0..15, k in 0..15) of an m16 x k16
// block that slot `slot` of lane (g, t)'s word holds.
FP4MOE_HOST_DEVICE void slot_source(int g, int t, int slot, int& r, int& k) {
  const int pair = 3 - slot % 4;  // a0..a3
  const bool odd = slot >= 4;
  r = g + ((pair & 1) ? 8 : 0);
  k = 2 * t + ((pair & 2) ? 8 : 0) + (odd ? 1 : 0);
}

// Word `word_idx` (0 .. num_fragments * 128) of the prepared weights: eight
// fp4 codes, zero past n or k and in blocks whose scale is zero (the scale
// code 0 does not decode to zero, so the codes carry it; prepare.cpp).
FP4MOE_HOST_DEVICE uint32_t prepared_weight_word(const StackedNvfp4& s, int64_t word_idx) {
  const FragmentCoords f = fragment_coords(word_idx / kWordsPerFragment, s.n_groups(), s.k_frags());
  const int w = static_cast<int>(word_idx % kWordsPerFragment);
  const int lane = w / 4, ks = w % 4;  // [lane 0..31][kstep 0..3]
  const int g = lane / 4, t = lane % 4;
  uint32_t word = 0;
  for (int slot = 0; slot < 8; ++slot) {
    int r, kk;
    slot_source(g, t, slot, r, kk);
    const int64_t row = f.group * kFragRows + r;
    const int64_t col = f.kf * kFragK + ks * 16 + kk;
    if (row >= s.n || col >= s.k) continue;
    const int64_t src_row = f.expert * s.n + stacked_source_row(row, s.n, s.gate_up);
    if (s.scales[src_row * (s.k / 16) + col / 16] == 0) continue;
    const uint8_t byte = s.packed[src_row * (s.k / 2) + col / 2];
    const uint32_t code = (col & 1) ? (byte >> 4) : (byte & 0xFu);
    word |= code_in_slot(slot, code);
  }
  return word;
}

// Byte `byte_idx` (0 .. num_fragments * 64) of the prepared scales: the scale
// code (scale_code_from_e4m3) of row g + 8 * half at k-step ks, with
// byte = g * 8 + ks * 2 + half within the fragment (scale_byte()).
FP4MOE_HOST_DEVICE uint8_t prepared_scale_byte(const StackedNvfp4& s, int64_t byte_idx) {
  const FragmentCoords f = fragment_coords(byte_idx / kFragScaleBytes, s.n_groups(), s.k_frags());
  const int b = static_cast<int>(byte_idx % kFragScaleBytes);
  const int g = b / 8, ks = (b % 8) / 2, half = b % 2;
  const int64_t row = f.group * kFragRows + g + 8 * half;
  const int64_t col = f.kf * kFragK + ks * 16;
  if (row >= s.n || col >= s.k) return 0;
  const int64_t src_row = f.expert * s.n + stacked_source_row(row, s.n, s.gate_up);
  return scale_code_from_e4m3(s.scales[src_row * (s.k / 16) + col / 16]);
}

}  // namespace fp4moe::layout
