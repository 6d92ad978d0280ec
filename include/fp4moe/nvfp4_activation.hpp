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

// The e2m1 code of x in a block with scale code `block_scale`.
FP4MOE_ACT_HD uint8_t nvfp4_act_quantize_value(float x, uint8_t block_scale, float input_scale) {
  return float_to_e2m1(nvfp4_act_div(x, nvfp4_act_mul(e4m3_to_float(block_scale), input_scale)));
}

// q * float(sf) for an element: exact in fp32, bf16 and f16; NaN for a NaN
// scale. The element's value is this times input_scale.
FP4MOE_ACT_HD float nvfp4_act_unscaled_value(uint8_t code, uint8_t block_scale) {
  return e2m1_to_float(code) * e4m3_to_float(block_scale);
}

// Quantises one block of 16: returns the scale code, writes the 16 e2m1
// codes and, if `unscaled` is not null, q_i * float(sf) (what the GPU stores).
FP4MOE_ACT_HD uint8_t nvfp4_act_quantize_block(const float* x, float input_scale, uint8_t* codes,
                                               float* unscaled) {
  const uint8_t scale = nvfp4_act_block_scale(nvfp4_act_block_amax(x), input_scale);
  for (int i = 0; i < kNvfp4BlockSize; ++i) {
    codes[i] = nvfp4_act_quantize_value(x[i], scale, input_scale);
    if (unscaled) unscaled[i] = nvfp4_act_unscaled_value(codes[i], scale);
  }
  return scale;
}

}  // namespace fp4moe

#undef FP4MOE_ACT_HD
