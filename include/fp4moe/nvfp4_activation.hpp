// NVFP4 activation quantisation (W4A4, docs/design.md §3): ModelOpt's NVFP4
// rule applied to an activation row against the checkpoint's calibrated
// per-tensor input_scale, per block of 16 consecutive elements. Pure functions
// of bits, shared by the CPU reference and the GPU gather / SwiGLU epilogue so
// that both take the same rounding decisions.
//
// The rule, in fp32 and in this order (ModelOpt's NVFP4QTensor.quantize with
// the input_scale as its per-tensor scale s):
//   amax = max |x_i| over the block
//   b    = amax / (6 * s)                 (6 * s rounded to fp32 first)
//   b    = 1            where b == 0      (an all-zero block)
//   b    = clamp(b, 2^-9, 448)            (e4m3's smallest subnormal, largest finite)
//   sf   = e4m3fn(b)                      round to nearest even
//   q_i  = e2m1(x_i / (float(sf) * s))    nearest, ties to even, saturating at 6;
//                                         the sign bit is set for x_i < 0 (-0 -> +0)
// The value an element stands for is q_i * sf * s. The GPU stores
// q_i * float(sf) — exact in bf16 and f16 (at most 6 significant bits,
// magnitudes 2^-10 .. 2688) — and folds s into the GEMM epilogue's fp32
// scale, as an FP4 tensor-core engine applies the activation's global scale
// to its accumulator.
//
// Non-finite inputs (a policy of fp4moe; ModelOpt's rule gives the same
// dequantised values): a block holding a NaN has a NaN amax, its scale is the
// e4m3 NaN code 0x7F and every element of the block dequantises to NaN, so a
// NaN poisons its token's outputs as it does with bf16 activations. An
// infinity makes the block's scale 448 (the clamp) and saturates to +-6
// (+-2688 s); the block's finite elements are quantised against that scale.
//
// Tested bit for bit against a brute-force nearest-value search in
// tests/format/test_nvfp4_activation.cpp.
#pragma once

#include <cmath>
#include <cstdint>

#include "fp4moe/nvfp4.hpp"

#if defined(__CUDACC__)
#define FP4MOE_ACT_HD __host__ __device__ __forceinline__
#else
#define FP4MOE_ACT_HD inline
#endif

namespace fp4moe {

// e4m3fn's NaN code: the block scale of a block holding a NaN.
inline constexpr uint8_t kE4m3NanCode = 0x7F;

// fp32 division rounded to nearest even also where the device code would
// otherwise be compiled with approximate division.
FP4MOE_ACT_HD float nvfp4_act_div(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}

FP4MOE_ACT_HD float nvfp4_act_mul(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);  // never contracted into an FMA
#else
  return a * b;
#endif
}

// Absolute maximum of a block; NaN as soon as one element is NaN.
FP4MOE_ACT_HD float nvfp4_act_block_amax(const float* x) {
  float amax = 0.0f;
  for (int i = 0; i < kNvfp4BlockSize; ++i) {
    const float a = std::fabs(x[i]);
    if (a > amax || a != a) amax = a;  // once NaN, stays NaN (a > NaN is false)
  }
  return amax;
}

// The e4m3 block scale code of a block with absolute maximum block_amax.
// input_scale must be finite and positive (the loader checks it).
FP4MOE_ACT_HD uint8_t nvfp4_act_block_scale(float block_amax, float input_scale) {
  float b = nvfp4_act_div(block_amax, nvfp4_act_mul(kE2m1Max, input_scale));
  if (b != b) return kE4m3NanCode;
  if (b == 0.0f) b = 1.0f;
  b = b < kMinBlockScale ? kMinBlockScale : b;
  b = b > kE4m3Max ? kE4m3Max : b;  // also +inf
  return float_to_e4m3(b);
}

// q * float(sf) for an element: exact in fp32, bf16 and f16; NaN for a NaN
// scale. The element's value is this times input_scale.
FP4MOE_ACT_HD float nvfp4_act_unscaled_value(uint8_t code, uint8_t block_scale) {
  return e2m1_to_float(code) * e4m3_to_float(block_scale);
}

// A double rounded to float toward -inf (rd) or +inf (ru); NaN stays NaN.
FP4MOE_ACT_HD float nvfp4_act_round_down(double v) {
#if defined(__CUDA_ARCH__)
  return __double2float_rd(v);
#else
  float f = static_cast<float>(v);
  if (static_cast<double>(f) > v) f = std::nextafter(f, -INFINITY);
  return f;
#endif
}

FP4MOE_ACT_HD float nvfp4_act_round_up(double v) {
#if defined(__CUDA_ARCH__)
  return __double2float_ru(v);
#else
  float f = static_cast<float>(v);
  if (static_cast<double>(f) < v) f = std::nextafter(f, INFINITY);
  return f;
#endif
}

// The e2m1 codes of a block without a division per element: for the rule's
// fp32 quotient fl(q), q = x / d (d = float(sf) * s, rounded), and an e2m1
// rounding boundary M (0.25 0.75 1.25 1.75 2.5 3.5 5, whose last mantissa
// bit is 0, so a tie in fl() goes to M):
//   fl(q) >  M  <=>  q >  M + u/2        (u: the fp32 spacing above M)
//   fl(q) >= M  <=>  q >= M - u'/2       (u': the spacing below M)
// and for an fp32 |x|, with the threshold T·d exact in double (T has at
// most 26 significant bits, d 24):
//   |x| / d >  T  <=>  |x| >  rd(T·d),     |x| / d >= T  <=>  |x| >= ru(T·d).
// float_to_e2m1 takes magnitude k past boundary k (strictly past 0.25, 1.25,
// 2.5 and 5; at or past 0.75, 1.75 and 3.5), so the magnitude is the number
// of thresholds |x| passes. The sign bit is fl(q) < 0: x < 0 with |q| above
// half the smallest fp32 subnormal (2^-150; a tie rounds to 0). A NaN d
// (a block holding a NaN) passes no threshold: code 0, as fl(q) = NaN gives.
// Equal to float_to_e2m1(nvfp4_act_div(x, d)) for every fp32 x
// (tests/format/test_nvfp4_activation.cpp); about a third of the
// instructions of the division and the comparison chain on the GPU.
struct Nvfp4ActThresholds {
  float pass[7];  // |x| must exceed (odd k: reach) pass[k] for magnitude k + 1
  float sign;     // |x| > sign: the quotient keeps its sign
};

FP4MOE_ACT_HD Nvfp4ActThresholds nvfp4_act_thresholds(float d) {
  const double dd = d;
  Nvfp4ActThresholds t;
  t.pass[0] = nvfp4_act_round_down((0.25 + 0x1p-26) * dd);
  t.pass[1] = nvfp4_act_round_up((0.75 - 0x1p-25) * dd);
  t.pass[2] = nvfp4_act_round_down((1.25 + 0x1p-24) * dd);
  t.pass[3] = nvfp4_act_round_up((1.75 - 0x1p-24) * dd);
  t.pass[4] = nvfp4_act_round_down((2.5 + 0x1p-23) * dd);
  t.pass[5] = nvfp4_act_round_up((3.5 - 0x1p-23) * dd);
  t.pass[6] = nvfp4_act_round_down((5.0 + 0x1p-22) * dd);
  t.sign = nvfp4_act_round_down(0x1p-150 * dd);
  return t;
}

FP4MOE_ACT_HD uint8_t nvfp4_act_code(float x, const Nvfp4ActThresholds& t) {
  const float a = std::fabs(x);
  const int mag = (a > t.pass[0]) + (a >= t.pass[1]) + (a > t.pass[2]) + (a >= t.pass[3]) + (a > t.pass[4]) +
                  (a >= t.pass[5]) + (a > t.pass[6]);
  return static_cast<uint8_t>(((x < 0.0f && a > t.sign) ? 8 : 0) | mag);
}

// Quantises one block of 16: returns the scale code, writes the 16 e2m1
// codes and, if `unscaled` is not null, q_i * float(sf) (what the GPU stores).
FP4MOE_ACT_HD uint8_t nvfp4_act_quantize_block(const float* x, float input_scale, uint8_t* codes, float* unscaled) {
  const uint8_t scale = nvfp4_act_block_scale(nvfp4_act_block_amax(x), input_scale);
  const Nvfp4ActThresholds t = nvfp4_act_thresholds(nvfp4_act_mul(e4m3_to_float(scale), input_scale));
  for (int i = 0; i < kNvfp4BlockSize; ++i) {
    codes[i] = nvfp4_act_code(x[i], t);
    if (unscaled) unscaled[i] = nvfp4_act_unscaled_value(codes[i], scale);
  }
  return scale;
}

}  // namespace fp4moe

#undef FP4MOE_ACT_HD
