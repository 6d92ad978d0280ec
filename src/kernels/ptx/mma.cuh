// Inline-PTX wrappers for the warp-level tensor-core path (SM80+): bf16
// mma.sync, ldmatrix and the bf16x2 multiply used by the dequantiser.
#pragma once

#include <cstdint>

namespace fp4moe::ptx {

// D += A . B for one m16n8k16 tile, bf16 inputs, fp32 accumulators.
//   a: 4 regs of bf16x2, (16 rows, 16 k) row-major fragment
//   b: 2 regs of bf16x2, (16 k, 8 cols) column fragment
//   d: 4 fp32, (16 rows, 8 cols) fragment
__device__ __forceinline__ void mma_m16n8k16_bf16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
      "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Four 8x8 b16 matrices from shared memory; lane i supplies the row address
// of row (i % 8) of matrix (i / 8).
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t smem_addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr));
}

// Two 8x8 b16 matrices; lanes 0..15 supply row addresses.
__device__ __forceinline__ void ldmatrix_x2(uint32_t (&r)[2], uint32_t smem_addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];\n" : "=r"(r[0]), "=r"(r[1]) : "r"(smem_addr));
}

// a * b per bf16 half, round to nearest. Written as fma with -0 so that it
// assembles on SM80 too (mul.bf16x2 needs SM90); x * y + (-0) == x * y
// exactly, including the sign of zero.
__device__ __forceinline__ uint32_t mul_bf16x2(uint32_t a, uint32_t b) {
  uint32_t d;
  asm("fma.rn.bf16x2 %0, %1, %2, %3;\n" : "=r"(d) : "r"(a), "r"(b), "r"(0x80008000u));
  return d;
}

// {lo, lo} and {hi, hi} of a bf16x2 word.
__device__ __forceinline__ uint32_t broadcast_low_bf16(uint32_t v) {
  uint32_t d;
  asm("{\n.reg .b16 lo, hi;\nmov.b32 {lo, hi}, %1;\nmov.b32 %0, {lo, lo};\n}\n" : "=r"(d) : "r"(v));
  return d;
}
__device__ __forceinline__ uint32_t broadcast_high_bf16(uint32_t v) {
  uint32_t d;
  asm("{\n.reg .b16 lo, hi;\nmov.b32 {lo, hi}, %1;\nmov.b32 %0, {hi, hi};\n}\n" : "=r"(d) : "r"(v));
  return d;
}

// Byte permute: result byte i = byte selector[4i..4i+3] of {b:a}.
__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t selector) {
  uint32_t d;
  asm("prmt.b32 %0, %1, %2, %3;\n" : "=r"(d) : "r"(a), "r"(b), "r"(selector));
  return d;
}

__device__ __forceinline__ uint32_t smem_u32(const void* ptr) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(ptr));
}

}  // namespace fp4moe::ptx
