// Four bf16 values moved as one 8-byte load or store (a uint2, element 0 in
// the low half of .x), and their conversions from and to fp32: the
// deterministic combine's (token, slot) rows, written by GEMM2's finalize
// epilogue (grouped_gemm_common.cuh, finalize_store) and summed by
// finalize_pairs (ops/finalize.cu) or the fused decode kernel's combine
// (fused_decode.cuh), which also write the layer's bf16 output with them. Tested through tests/kernels/ops/test_finalize.cpp (bit
// for bit) and the layer tests.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

namespace fp4moe::kernels {

// Each element rounded once to bf16, to nearest even. A uint2 rather than a
// struct of two __nv_bfloat162: the struct's copy was two 4-byte stores in
// the PTX.
__device__ __forceinline__ uint2 to_bf16x4(float4 v) {
  const __nv_bfloat162 lo = __floats2bfloat162_rn(v.x, v.y);
  const __nv_bfloat162 hi = __floats2bfloat162_rn(v.z, v.w);
  return make_uint2(*reinterpret_cast<const uint32_t*>(&lo), *reinterpret_cast<const uint32_t*>(&hi));
}

// Four bf16 widened to fp32, exactly: a bf16 is the high half of its fp32.
__device__ __forceinline__ float4 widen_bf16x4(uint2 bits) {
  return make_float4(__uint_as_float(bits.x << 16), __uint_as_float(bits.x & 0xFFFF0000u),
                     __uint_as_float(bits.y << 16), __uint_as_float(bits.y & 0xFFFF0000u));
}

// Four bf16 read through the read-only path (ld.global.nc, one 8-byte load),
// widened: for rows an earlier kernel wrote.
__device__ __forceinline__ float4 ldg_bf16x4(const uint2* p) { return widen_bf16x4(__ldg(p)); }

// The same read from L2 (ld.global.cg): for rows other blocks of the same
// kernel wrote (the fused decode kernel's combine, fused_decode.cuh).
__device__ __forceinline__ float4 ldcg_bf16x4(const uint2* p) { return widen_bf16x4(__ldcg(p)); }

}  // namespace fp4moe::kernels
