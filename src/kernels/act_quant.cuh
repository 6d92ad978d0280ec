// W4A4 activations on the GPU: one NVFP4 block of 16 bf16 values quantised by
// include/fp4moe/nvfp4_activation.hpp's rule (the CPU reference's), in place,
// as q x e4m3 — exact in bf16, so the bf16 MMA multiplies exactly what an FP4
// tensor core would; the input_scale is applied in the next epilogue. Used by
// the quantising gather (moe_ops.cu) and GEMM1's SwiGLU epilogue
// (grouped_gemm_common.cuh). Tested bit for bit in tests/kernels/test_moe_ops.cpp.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "fp4moe/nvfp4_activation.hpp"

namespace fp4moe::kernels::detail {

// lo, hi: elements 0..7 and 8..15 of the block (bf16 pairs, even element in
// the low half of each word).
__device__ __forceinline__ void fp4_quantize_bf16_block(uint4& lo, uint4& hi, float input_scale) {
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

}  // namespace fp4moe::kernels::detail
