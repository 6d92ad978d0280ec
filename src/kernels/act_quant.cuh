// W4A4 activations on the GPU: one NVFP4 block of 16 bf16 values quantised by
// include/fp4moe/nvfp4_activation.hpp's rule (the CPU reference's), in place,
// as q x e4m3 — exact in bf16, so the bf16 MMA multiplies exactly what an FP4
// tensor core would; the input_scale is applied in the next epilogue. Used by
// the quantising gather (ops/gather.cu) and GEMM1's SwiGLU epilogues
// (portable_grouped_gemm.cuh, sm90_grouped_gemm.cuh).
// Tested bit for bit against the CPU quantiser: the gather over every bf16
// value for every block scale (tests/kernels/ops/test_gather.cpp), the SwiGLU
// epilogues of every compiled config (tests/kernels/test_grouped_gemm.cpp).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "fp4moe/nvfp4_activation.hpp"

namespace fp4moe::kernels::detail {

// The rule on 16 floats, as the CPU reference evaluates it. lo, hi: elements
// 0..7 and 8..15 of the block (bf16 pairs, even element in the low half of
// each word).
__device__ __forceinline__ void fp4_quantize_bf16_block_by_rule(uint4& lo, uint4& hi, float input_scale) {
  float x[kNvfp4BlockSize];
  const uint32_t words[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
#pragma unroll
  for (int w = 0; w < 8; ++w) {
    x[2 * w] = __uint_as_float(words[w] << 16);
    x[2 * w + 1] = __uint_as_float(words[w] & 0xFFFF0000u);
  }
  uint8_t codes[kNvfp4BlockSize];
  float unscaled[kNvfp4BlockSize];
  nvfp4_act_quantize_block(x, input_scale, codes, unscaled);
  uint32_t out[8];
#pragma unroll
  for (int w = 0; w < 8; ++w)  // exact in bf16: a float's top half is the value
    out[w] = (__float_as_uint(unscaled[2 * w]) >> 16) | (__float_as_uint(unscaled[2 * w + 1]) & 0xFFFF0000u);
  lo = make_uint4(out[0], out[1], out[2], out[3]);
  hi = make_uint4(out[4], out[5], out[6], out[7]);
}

__device__ __forceinline__ uint32_t max_u16x2(uint32_t a, uint32_t b) {
#if __CUDA_ARCH__ >= 900
  uint32_t r;
  asm("max.u16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
  return r;
#else
  return __vmaxu2(a, b);
#endif
}

__device__ __forceinline__ __nv_bfloat162 bf16x2_of_bits(uint32_t bits) {
  return *reinterpret_cast<const __nv_bfloat162*>(&bits);
}
__device__ __forceinline__ uint32_t bits_of_bf16x2(__nv_bfloat162 v) { return *reinterpret_cast<const uint32_t*>(&v); }
// A bf16 bit pattern in both halves.
__device__ __forceinline__ uint32_t both_halves(uint32_t h) { return h | (h << 16); }

// The block scale code of nvfp4_act_block_scale() for a finite b = amax /
// (6 s) >= 0 and its value: with the hardware conversions (round to nearest
// even, exact for the clamped range) where the GPU has them.
__device__ __forceinline__ float fp4_block_scale_value(float b) {
  b = b == 0.0f ? 1.0f : fminf(fmaxf(b, kMinBlockScale), kE4m3Max);
#if __CUDA_ARCH__ >= 890
  uint16_t code;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(code) : "f"(0.0f), "f"(b));  // b in the low byte
  uint32_t halves;
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(halves) : "h"(code));
  return __half2float(__ushort_as_half(static_cast<unsigned short>(halves & 0xFFFFu)));
#else
  return e4m3_to_float(float_to_e4m3(b));
#endif
}

// What quantises the elements of one block once its amax is known:
// nvfp4_act_quantize_block()'s rule, packed (about 15 instructions per element
// instead of ~40). With the block's divisor d = float(sf) * s:
//   - the thresholds of nvfp4_act_thresholds() in fp32 without doubles: an
//     FMA rounds M·d + δ·d once, in the direction asked for, and δ·d (a power
//     of two times d) is exact for d >= 2^-100;
//   - bf16 inputs against an fp32 threshold P: |x| > P <=> |x| > bf16 floor
//     of P, |x| >= P <=> |x| > (bf16 ceiling of P) - 1 ulp, so every test is
//     one packed bf16 "greater than" (set.gt.bf16x2, 1.0 or 0.0 per half);
//   - the value q * sf as the sum of the magnitude steps passed (0.5, 0.5,
//     0.5, 0.5, 1, 1, 2 times sf): every partial sum has at most 6
//     significant bits, so the packed bf16 FMAs are exact;
//   - the sign bit where x < 0 and |x| exceeds the sign threshold, compared
//     as integers: (0x8000 + t) - |x| per half never borrows across halves
//     and has bit 15 clear exactly when |x| > t.
// `packed` is false for a block holding a NaN (a NaN amax) or a divisor
// outside [2^-100, 2^100]: such a block takes the rule as written.
struct Fp4BlockQuantiser {
  bool packed;
  __nv_bfloat162 t[7];
  __nv_bfloat162 half_step, step, double_step;
  uint32_t sign_test;

  __device__ __forceinline__ Fp4BlockQuantiser(float amax, float input_scale) {
    const float b = nvfp4_act_div(amax, nvfp4_act_mul(kE2m1Max, input_scale));
    const float sf = fp4_block_scale_value(b);
    const float d = nvfp4_act_mul(sf, input_scale);
    packed = b == b && d >= 0x1p-100f && d <= 0x1p100f;
    const float u = d * 0x1p-26f;  // exact where packed
    // nvfp4_act_thresholds(d): rd for the strict tests (even k), ru for the others.
    auto floor_bf16 = [](float v) { return __float_as_uint(v) >> 16; };
    auto below_ceil_bf16 = [](float v) { return ((__float_as_uint(v) + 0xFFFFu) >> 16) - 1u; };
    t[0] = bf16x2_of_bits(both_halves(floor_bf16(__fmaf_rd(0.25f, d, u))));
    t[1] = bf16x2_of_bits(both_halves(below_ceil_bf16(__fmaf_ru(0.75f, d, -2.0f * u))));
    t[2] = bf16x2_of_bits(both_halves(floor_bf16(__fmaf_rd(1.25f, d, 4.0f * u))));
    t[3] = bf16x2_of_bits(both_halves(below_ceil_bf16(__fmaf_ru(1.75f, d, -4.0f * u))));
    t[4] = bf16x2_of_bits(both_halves(floor_bf16(__fmaf_rd(2.5f, d, 8.0f * u))));
    t[5] = bf16x2_of_bits(both_halves(below_ceil_bf16(__fmaf_ru(3.5f, d, -8.0f * u))));
    t[6] = bf16x2_of_bits(both_halves(floor_bf16(__fmaf_rd(5.0f, d, 16.0f * u))));
    half_step = bf16x2_of_bits(both_halves(__float_as_uint(0.5f * sf) >> 16));
    step = bf16x2_of_bits(both_halves(__float_as_uint(sf) >> 16));
    double_step = bf16x2_of_bits(both_halves(__float_as_uint(2.0f * sf) >> 16));
    sign_test = both_halves(floor_bf16(__fmul_rd(d * 0x1p-24f, 0x1p-126f))) | 0x80008000u;  // rd(2^-150 d)
  }

  // Two elements: x, a bf16 pair, and mag = x & 0x7FFF7FFF.
  __device__ __forceinline__ uint32_t operator()(uint32_t x, uint32_t mag) const {
    const __nv_bfloat162 m = bf16x2_of_bits(mag);
    __nv_bfloat162 v = __hmul2(__hgt2(m, t[0]), half_step);
    v = __hfma2(__hgt2(m, t[1]), half_step, v);
    v = __hfma2(__hgt2(m, t[2]), half_step, v);
    v = __hfma2(__hgt2(m, t[3]), half_step, v);
    v = __hfma2(__hgt2(m, t[4]), step, v);
    v = __hfma2(__hgt2(m, t[5]), step, v);
    v = __hfma2(__hgt2(m, t[6]), double_step, v);
    return bits_of_bf16x2(v) | (x & ~(sign_test - mag) & 0x80008000u);
  }
};

// The amax of bf16 pairs' magnitudes as a bf16 bit pattern in both halves'
// max: |x| bit patterns order like the values (NaN above infinity).
template <int N>
__device__ __forceinline__ uint32_t max_magnitude_bits(const uint32_t (&mag)[N]) {
  uint32_t m = mag[0];
#pragma unroll
  for (int i = 1; i < N; ++i) m = max_u16x2(m, mag[i]);
  return max(m & 0xFFFFu, m >> 16);
}

// One block of 16 in one thread: lo, hi hold elements 0..7 and 8..15. For
// passes over many blocks (the gather), where a pair of lanes per block
// would compute the block's scale and thresholds twice.
__device__ __forceinline__ void fp4_quantize_bf16_block(uint4& lo, uint4& hi, float input_scale) {
  const uint32_t w[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
  uint32_t mag[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) mag[i] = w[i] & 0x7FFF7FFFu;
  const Fp4BlockQuantiser q(__uint_as_float(max_magnitude_bits(mag) << 16), input_scale);
  if (!q.packed) {
    fp4_quantize_bf16_block_by_rule(lo, hi, input_scale);
    return;
  }
  lo = make_uint4(q(w[0], mag[0]), q(w[1], mag[1]), q(w[2], mag[2]), q(w[3], mag[3]));
  hi = make_uint4(q(w[4], mag[4]), q(w[5], mag[5]), q(w[6], mag[6]), q(w[7], mag[7]));
}

// One block of 16 quantised by a pair of lanes, 8 elements each (the
// epilogues, whose few blocks per round are latency-bound): elements
// 0..7 in the even lane, 8..15 in the odd one (lane ^ 1). Both lanes of the
// pair call this together; the rest of the warp may be elsewhere.
__device__ __forceinline__ void fp4_quantize_bf16_half_block(uint4& half, float input_scale) {
  const uint32_t w[4] = {half.x, half.y, half.z, half.w};
  uint32_t mag[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) mag[i] = w[i] & 0x7FFF7FFFu;
  const unsigned pair = 3u << (threadIdx.x & 30u);
  const uint32_t mine = max_magnitude_bits(mag);
  const uint32_t amax_bits = max(mine, __shfl_xor_sync(pair, mine, 1));
  const Fp4BlockQuantiser q(__uint_as_float(amax_bits << 16), input_scale);
  if (!q.packed) {
    const bool odd = threadIdx.x & 1u;
    uint4 other;
    other.x = __shfl_xor_sync(pair, half.x, 1);
    other.y = __shfl_xor_sync(pair, half.y, 1);
    other.z = __shfl_xor_sync(pair, half.z, 1);
    other.w = __shfl_xor_sync(pair, half.w, 1);
    uint4 lo = odd ? other : half, hi = odd ? half : other;
    fp4_quantize_bf16_block_by_rule(lo, hi, input_scale);
    half = odd ? hi : lo;
    return;
  }
  half = make_uint4(q(w[0], mag[0]), q(w[1], mag[1]), q(w[2], mag[2]), q(w[3], mag[3]));
}

}  // namespace fp4moe::kernels::detail
