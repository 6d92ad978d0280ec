// The prepared ("fragment-ordered") weight layout of both grouped-GEMM
// families, shared by the host packer (prepare.cpp) and the device kernels.
//
// ModelOpt stores W [N, K] as packed fp4 [N, K/2] plus e4m3 scales [N, K/16].
// The kernel wants each lane of a warp to fetch, with one 16-byte load, the
// fp4 codes of its A fragments for four m16n8k16 MMAs, and to turn each
// 32-bit word into four bf16x2 registers with a handful of integer ops. So
// the packer regroups W into 512-byte fragments of 16 rows x 64 K, ordered
// so that the eight fragments of a 128-row tile at one 64-wide K step are
// adjacent (one pipeline stage of a tile is one contiguous block: a single
// bulk copy in the SM90 family):
//
//   weights: [E][N_pad/128][K_pad/64][group 0..7][lane 0..31][kstep 0..3] uint32
//   scales:  [E][N_pad/128][K_pad/64][group 0..7][g 0..7][kstep 0..3][row g, row g+8] uint8
//
// where group is the 16-row group within the 128-row tile (fragment_index()).
// With g = lane / 4 and t = lane % 4, the word for (lane, kstep) holds the
// eight codes the MMA's A fragment needs, one per slot (code_slot()):
//   3: W[g][2t]     7: W[g][2t+1]        (a0: row g,   k 2t..2t+1)
//   2: W[g+8][2t]   6: W[g+8][2t+1]      (a1: row g+8, k 2t..2t+1)
//   1: W[g][2t+8]   5: W[g][2t+9]        (a2: row g,   k 2t+8..2t+9)
//   0: W[g+8][2t+8] 4: W[g+8][2t+9]      (a3: row g+8, k 2t+8..2t+9)
// (k relative to the k-step's 16). A code is not kept as a nibble: its sign
// bit and its 3-bit magnitude (exponent and mantissa) sit at the bits of
// slot_bits(), chosen so that each A register needs at most two shifts and two
// logic ops. A bf16x2 wants the pair's signs at bits 15 and 31 and the
// magnitudes at bits 6..8 and 22..24; the word holds a0 exactly there (one
// mask), a1 three bits lower (a shift, a mask), a2's signs one bit lower and
// magnitudes three bits higher, a3's signs two lower and magnitudes six lower
// (two shifts, a mask, a masked or). No arrangement of the 32 bits gives
// three of the four registers with one shift each (an exhaustive search), and
// three of the four shifts are left shifts, which ptxas issues as IMAD.SHL on
// the FMA pipe beside the logic ops' integer pipe (docs/performance.md §5.2,
// "Scale pairs and the fragment word's bit layout").
//
// A lane reads its eight scale codes with one 8-byte load; per k-step the
// codes of its two rows sit side by side, so one byte permute and one
// multiply-add make the bf16x2 pair {scale row g, scale row g+8}.
//
// Scales are re-encoded losslessly from e4m3 into an unsigned 8-bit
// "exponent 5, mantissa 3" code (scales are positive; e4m3 subnormals become
// normals), chosen so that bf16 bits = code * 16 + kScaleBf16Bias is the
// block scale times 2^119: one integer multiply-add builds a bf16x2 pair.
// Placing an fp4 code in bf16 bits yields value * 2^-126, so the product is
// value * scale * 2^-7, exact in bf16 (at most 5 significant bits, normal
// range); the epilogue multiplies by global_scale * 2^7.
//
// N is padded to a multiple of 128 and K to a multiple of 256 with zero
// codes, so every compiled tile reads whole fragments.
// Tested by tests/kernels/test_grouped_gemm_args.cpp (host packer round trip)
// and tests/kernels/test_grouped_gemm.cpp (device dequantiser, every code and
// scale: EveryCodeAndScaleDequantisesExactly).
#pragma once

#include <cstdint>

#include "fp4moe/nvfp4.hpp"
#include "util/host_device.hpp"

namespace fp4moe::layout {

inline constexpr int kPadN = 128;               // N padding: the largest BLOCK_N, and the row tile of the layout
inline constexpr int kPadK = 256;               // K padding: the largest BLOCK_K
inline constexpr int kTileGroups = kPadN / 16;  // 16-row fragment groups per 128-row tile

// Index of fragment (expert e, 16-row group, 64-wide K step kf) in the
// prepared arrays (times 512 B for weights, 64 B for scales), with
// n_groups = N_pad / 16 and k_frags = K_pad / 64.
FP4MOE_HOST_DEVICE int64_t fragment_index(int64_t e, int64_t group, int64_t kf, int64_t n_groups, int64_t k_frags) {
  const int64_t tile = e * (n_groups / kTileGroups) + group / kTileGroups;
  return (tile * k_frags + kf) * kTileGroups + group % kTileGroups;
}

// bf16 bits = code * 16 + kScaleBf16Bias  <=>  exponent field = (code >> 3) + 236.
inline constexpr uint32_t kScaleBf16Bias = 236u << 7;
// The dequantised weights carry a factor 2^-7 that the epilogue removes.
inline constexpr float kEpilogueScale = 128.0f;

// Slot (0..7) inside the fragment word of the element at (row r in 0..15,
// k in 0..15) of an m16 x k16 block, for lane (g, t) with g = r % 8,
// t = (k % 8) / 2.
FP4MOE_HOST_DEVICE int code_slot(int r, int k) {
  const bool high_row = r >= 8;  // row g+8
  const bool high_k = k >= 8;    // k 2t+8..2t+9
  const bool odd = k & 1;        // second element of the bf16x2 pair
  // a0 -> 3, a1 -> 2, a2 -> 1, a3 -> 0; the odd element sits 4 slots higher.
  const int pair = (high_k ? 2 : 0) + (high_row ? 1 : 0);
  return (3 - pair) + (odd ? 4 : 0);
}

// Where slot s keeps its code: the sign bit, and the lowest bit of the
// magnitude (the code's low three bits, in order). The odd element of a pair
// is the bf16x2's upper half, 16 bits up. placed_pair() below is what the
// kernels' dequantiser (grouped_gemm_common.cuh) makes of them.
struct SlotBits {
  int sign;
  int magnitude;
};
FP4MOE_HOST_DEVICE constexpr SlotBits slot_bits(int slot) {
  const int high = slot >= 4 ? 16 : 0;
  switch (slot % 4) {
    case 3:
      return {15 + high, 6 + high};  // a0: where the bf16 wants them
    case 2:
      return {12 + high, 3 + high};  // a1: both 3 bits lower
    case 1:
      return {14 + high, 9 + high};  // a2: sign 1 lower, magnitude 3 higher
    default:
      return {13 + high, 0 + high};  // a3: sign 2 lower, magnitude 6 lower
  }
}

// The bits of a fragment word that hold `code` (0..15) in slot s.
FP4MOE_HOST_DEVICE uint32_t code_in_slot(int slot, uint32_t code) {
  const SlotBits b = slot_bits(slot);
  return ((code >> 3) & 1u) << b.sign | (code & 7u) << b.magnitude;
}

// The code that slot s of `word` holds.
FP4MOE_HOST_DEVICE uint32_t code_of_slot(uint32_t word, int slot) {
  const SlotBits b = slot_bits(slot);
  return ((word >> b.sign) & 1u) << 3 | ((word >> b.magnitude) & 7u);
}

// A register j (0..3: a0..a3) of a fragment word before the block scale:
// the bf16x2 whose halves are the pair's codes in bf16 bits (sign at bit
// 15, magnitude at bits 6..8), each worth the code's value times 2^-126.
// At most two shifts and two logic ops each (j is a constant in the kernels).
FP4MOE_HOST_DEVICE uint32_t placed_pair(uint32_t word, int j) {
  constexpr uint32_t kSigns = 0x80008000u;
  constexpr uint32_t kMagnitudes = 0x01C001C0u;
  switch (j) {
    case 0:
      return word & (kSigns | kMagnitudes);
    case 1:
      return (word << 3) & (kSigns | kMagnitudes);
    case 2:
      return ((word << 1) & kSigns) | ((word >> 3) & kMagnitudes);
    default:
      return ((word << 2) & kSigns) | ((word << 6) & kMagnitudes);
  }
}

// Byte, within a fragment's 64 scale codes, of the code of row g + 8 * half
// (g = 0..7) at k-step ks.
FP4MOE_HOST_DEVICE int scale_byte(int g, int ks, int half) { return g * 8 + ks * 2 + half; }

// e4m3 (positive, finite) -> scale code; 0 for a zero scale.
FP4MOE_HOST_DEVICE uint8_t scale_code_from_e4m3(uint8_t e4m3) {
  const uint32_t exp = (e4m3 >> 3) & 0xFu;
  const uint32_t man = e4m3 & 7u;
  if (exp != 0) return static_cast<uint8_t>(((exp + 3u) << 3) | man);  // 2^(exp-7) * 1.man
  if (man == 0) return 0;
  // Subnormal man * 2^-9: normalise so the leading one is implicit.
  int e = -9;
  uint32_t m = man;
  while (m < 4) {
    m <<= 1;
    --e;
  }  // m in 4..7 means 1.xx * 2^(e+2)
  e += 2;
  // m is 1xx in binary: mantissa bits are the two below the leading one.
  return static_cast<uint8_t>(((e + 10) << 3) | ((m & 3u) << 1));
}

// The bf16 bits a scale code stands for (block scale * 2^119).
FP4MOE_HOST_DEVICE uint16_t scale_code_to_bf16_bits(uint8_t code) {
  return static_cast<uint16_t>(code * 16u + kScaleBf16Bias);
}

}  // namespace fp4moe::layout
