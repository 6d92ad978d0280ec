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
// eight codes the MMA's A fragment needs, at nibble positions:
//   3: W[g][2t]     7: W[g][2t+1]        (a0: row g,   k 2t..2t+1)
//   2: W[g+8][2t]   6: W[g+8][2t+1]      (a1: row g+8, k 2t..2t+1)
//   1: W[g][2t+8]   5: W[g][2t+9]        (a2: row g,   k 2t+8..2t+9)
//   0: W[g+8][2t+8] 4: W[g+8][2t+9]      (a3: row g+8, k 2t+8..2t+9)
// (k relative to the k-step's 16). Nibbles 3 and 7 sit at bits 12..15 and
// 28..31, exactly where a bf16x2's two halves need sign and exponent bits
// after a shift by 6; shifting the word left by 4 brings the next pair there.
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

inline constexpr int kPadN = 128;  // N padding: the largest BLOCK_N, and the row tile of the layout
inline constexpr int kPadK = 256;  // K padding: the largest BLOCK_K
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

// Nibble position (0..7) inside the fragment word of the element at
// (row r in 0..15, k in 0..15) of an m16 x k16 block, for lane (g, t) with
// g = r % 8, t = (k % 8) / 2.
FP4MOE_HOST_DEVICE int nibble_position(int r, int k) {
  const bool high_row = r >= 8;   // row g+8
  const bool high_k = k >= 8;     // k 2t+8..2t+9
  const bool odd = k & 1;         // second element of the bf16x2 pair
  // a0 -> 3, a1 -> 2, a2 -> 1, a3 -> 0; the odd element sits 4 nibbles higher.
  const int pair = (high_k ? 2 : 0) + (high_row ? 1 : 0);
  return (3 - pair) + (odd ? 4 : 0);
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
  while (m < 4) { m <<= 1; --e; }  // m in 4..7 means 1.xx * 2^(e+2)
  e += 2;
  // m is 1xx in binary: mantissa bits are the two below the leading one.
  return static_cast<uint8_t>(((e + 10) << 3) | ((m & 3u) << 1));
}

// The bf16 bits a scale code stands for (block scale * 2^119).
FP4MOE_HOST_DEVICE uint16_t scale_code_to_bf16_bits(uint8_t code) {
  return static_cast<uint16_t>(code * 16u + kScaleBf16Bias);
}

}  // namespace fp4moe::layout
