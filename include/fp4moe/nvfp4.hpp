// NVFP4 scalar codecs shared by host and device code: e2m1 (fp4), float8
// e4m3fn, bf16 and f16 bit conversions, and the ModelOpt NVFP4 block
// quantisation rule (docs/design.md §3).
//
// Everything here is a pure function of bits, usable from C++ host code and
// from CUDA kernels alike. Tested exhaustively over every code in
// tests/format/test_nvfp4.cpp.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

// Local to this header (undefined at its end): host and device, inlined.
#if defined(__CUDACC__)
#define FP4MOE_HD __host__ __device__ __forceinline__
#else
#define FP4MOE_HD inline
#endif

namespace fp4moe {

// Elements per NVFP4 scale block along K.
inline constexpr int kNvfp4BlockSize = 16;
// Largest e2m1 magnitude and largest finite e4m3fn value.
inline constexpr float kE2m1Max = 6.0f;
inline constexpr float kE4m3Max = 448.0f;
// Smallest block scale ModelOpt stores (the smallest e4m3 subnormal).
inline constexpr float kMinBlockScale = 1.0f / 512.0f;

FP4MOE_HD float bits_to_float(uint32_t bits) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(bits);
#else
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
#endif
}

FP4MOE_HD uint32_t float_to_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  return bits;
#endif
}

// ---------------------------------------------------------------- e2m1 (fp4)
// Code layout: bit 3 sign, bits 2..1 exponent (bias 1), bit 0 mantissa.
// Magnitudes by code & 7: 0, 0.5, 1, 1.5, 2, 3, 4, 6.

FP4MOE_HD float e2m1_to_float(uint8_t code) {
  const uint32_t mag = code & 7u;
  // 2 * value for magnitudes 0..7: 0 1 2 3 4 6 8 12.
  // From 4 on, mantissa bit m and exponent e = mag >> 1 give (2 + m) << (e - 1).
  const uint32_t twice = mag < 4 ? mag : (2u + (mag & 1u)) << ((mag >> 1) - 1u);  // 4 6 8 12
  const float value = 0.5f * static_cast<float>(twice);
  return (code & 8u) ? -value : value;
}

// Rounds to the nearest e2m1 value, ties to even, saturating to +-6. The sign
// bit is set for x < 0 (so a small negative value becomes code 0x8, -0), as
// ModelOpt's _cast_fp4 does. NaN maps to +0.
FP4MOE_HD uint8_t float_to_e2m1(float x) {
  const uint8_t sign = x < 0.0f ? 8u : 0u;
  const float a = std::fabs(x);
  uint8_t mag;
  // Boundaries between neighbours: 0.25 0.75 1.25 1.75 2.5 3.5 5. A value on
  // a boundary goes to the neighbour whose code is even.
  if (!(a > 0.25f))
    mag = 0;  // also NaN
  else if (a < 0.75f)
    mag = 1;
  else if (a <= 1.25f)
    mag = 2;
  else if (a < 1.75f)
    mag = 3;
  else if (a <= 2.5f)
    mag = 4;
  else if (a < 3.5f)
    mag = 5;
  else if (a <= 5.0f)
    mag = 6;
  else
    mag = 7;
  return static_cast<uint8_t>(sign | mag);
}

// ------------------------------------------------------------- float8 e4m3fn
// Bit 7 sign, bits 6..3 exponent (bias 7), bits 2..0 mantissa; no infinity;
// S.1111.111 is NaN; largest finite 448; subnormals down to 2^-9.

FP4MOE_HD bool e4m3_is_nan(uint8_t code) { return (code & 0x7Fu) == 0x7Fu; }

FP4MOE_HD float e4m3_to_float(uint8_t code) {
  const uint32_t sign = static_cast<uint32_t>(code & 0x80u) << 24;
  const uint32_t exp = (code >> 3) & 0xFu;
  const uint32_t man = code & 7u;
  if (e4m3_is_nan(code)) return bits_to_float(sign | 0x7FC00000u);
  if (exp == 0) {
    // Subnormal: man * 2^-9, exact in float.
    const float v = static_cast<float>(man) * (1.0f / 512.0f);
    return sign ? -v : v;
  }
  return bits_to_float(sign | ((exp + 120u) << 23) | (man << 20));
}

// Rounds to nearest even; finite values beyond 448 saturate to +-448; NaN
// stays NaN. (torch's cast gives NaN past 464; ModelOpt never produces such
// a scale, and saturation is the safer behaviour for a codec.)
FP4MOE_HD uint8_t float_to_e4m3(float x) {
  const uint32_t bits = float_to_bits(x);
  const uint8_t sign = static_cast<uint8_t>((bits >> 24) & 0x80u);
  if ((bits & 0x7F800000u) == 0x7F800000u && (bits & 0x7FFFFFu)) return sign | 0x7Fu;  // NaN
  const float a = std::fabs(x);
  if (a >= 464.0f) return sign | 0x7Eu;  // >= midpoint(448, 480): saturate (also inf)
  // Work in units of the smallest subnormal, 2^-9, for small values.
  if (a < 0.015625f) {                // below 2^-6: subnormal range, step 2^-9
    const float scaled = a * 512.0f;  // exact (power of two)
    // Round half to even on the integer grid 0..8 (8 = 2^-6, the smallest normal).
    const float floor_v = std::floor(scaled);
    const float diff = scaled - floor_v;
    const bool odd = static_cast<uint32_t>(floor_v) & 1u;
    const float r = (diff > 0.5f || (diff == 0.5f && odd)) ? floor_v + 1.0f : floor_v;
    const uint32_t m = static_cast<uint32_t>(r);  // 0..8; 8 is exp 1, man 0
    return static_cast<uint8_t>(sign | m);
  }
  // Normal: keep 3 mantissa bits with round-to-nearest-even on the float bits.
  const uint32_t abits = float_to_bits(a);
  const uint32_t lsb = (abits >> 20) & 1u;
  const uint32_t rounded = abits + 0x7FFFFu + lsb;  // carries into the exponent as needed
  const uint32_t exp = ((rounded >> 23) & 0xFFu) - 120u;
  const uint32_t man = (rounded >> 20) & 7u;
  return static_cast<uint8_t>(sign | (exp << 3) | man);
}

// -------------------------------------------------------------- bf16 / f16

FP4MOE_HD float bf16_to_float(uint16_t h) { return bits_to_float(static_cast<uint32_t>(h) << 16); }

// Round to nearest even; NaN stays a (quiet) NaN.
FP4MOE_HD uint16_t float_to_bf16(float f) {
  const uint32_t bits = float_to_bits(f);
  if ((bits & 0x7F800000u) == 0x7F800000u && (bits & 0x7FFFFFu)) return static_cast<uint16_t>((bits >> 16) | 0x40u);
  const uint32_t lsb = (bits >> 16) & 1u;
  return static_cast<uint16_t>((bits + 0x7FFFu + lsb) >> 16);
}

FP4MOE_HD float f16_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1Fu;
  const uint32_t man = h & 0x3FFu;
  if (exp == 0x1F) return bits_to_float(sign | 0x7F800000u | (man << 13));
  if (exp == 0) {
    const float v = static_cast<float>(man) * (1.0f / 16777216.0f);  // man * 2^-24
    return sign ? -v : v;
  }
  return bits_to_float(sign | ((exp + 112u) << 23) | (man << 13));
}

// Round to nearest even, overflow to infinity, NaN stays NaN.
FP4MOE_HD uint16_t float_to_f16(float f) {
  const uint32_t bits = float_to_bits(f);
  const uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
  const uint32_t abits = bits & 0x7FFFFFFFu;
  if (abits >= 0x7F800000u) return sign | (abits > 0x7F800000u ? 0x7E00u : 0x7C00u);
  if (abits >= 0x477FF000u) return sign | 0x7C00u;  // rounds past 65504
  if (abits < 0x38800000u) {
    // Result is subnormal or zero: value / 2^-24, rounded to nearest even.
    const float scaled = bits_to_float(abits) * 16777216.0f;  // exact
    const float fl = std::floor(scaled);
    const float diff = scaled - fl;
    uint32_t m = static_cast<uint32_t>(fl);
    if (diff > 0.5f || (diff == 0.5f && (m & 1u))) ++m;
    return static_cast<uint16_t>(sign | m);  // m == 1024 becomes the smallest normal
  }
  const uint32_t lsb = (abits >> 13) & 1u;
  const uint32_t rounded = abits + 0xFFFu + lsb;
  return static_cast<uint16_t>(sign | (((rounded >> 23) - 112u) << 10) | ((rounded >> 13) & 0x3FFu));
}

// ------------------------------------------------ ModelOpt NVFP4 quantisation

// weight_scale_2 for a tensor with the given absolute maximum (fp32, as
// ModelOpt computes it).
FP4MOE_HD float nvfp4_global_scale(float amax) { return amax / (kE2m1Max * kE4m3Max); }

// The e4m3 block scale for a block with absolute maximum block_amax, in
// ModelOpt's order of operations. A zero block gets scale 1; the scale is
// clamped below at 2^-9. An all-zero tensor (global_scale 0) gets scale 1.
FP4MOE_HD uint8_t nvfp4_block_scale(float block_amax, float global_scale) {
  float b = block_amax / (kE2m1Max * global_scale);
  if (b == 0.0f || b != b) b = 1.0f;  // zero block, or 0/0 for an all-zero tensor
  b = b < kMinBlockScale ? kMinBlockScale : b;
  return float_to_e4m3(b);
}

// The e2m1 code for element x of a block with the given stored scales.
FP4MOE_HD uint8_t nvfp4_quantize_value(float x, uint8_t block_scale, float global_scale) {
  const float denom = e4m3_to_float(block_scale) * global_scale;
  if (denom == 0.0f) return 0;  // only for an all-zero tensor
  return float_to_e2m1(x / denom);
}

// The value an NVFP4 element stands for.
FP4MOE_HD float nvfp4_dequantize_value(uint8_t code, uint8_t block_scale, float global_scale) {
  return e2m1_to_float(code) * e4m3_to_float(block_scale) * global_scale;
}

}  // namespace fp4moe

#undef FP4MOE_HD
