// Inline-PTX wrappers for cp.async (SM80+): 16-byte global -> shared copies
// that bypass the register file, grouped and waited on per pipeline stage.
#pragma once

#include <cstdint>

namespace fp4moe::ptx {

// Copies 16 bytes; when src_bytes is 0 nothing is read and the 16 bytes are
// zero-filled. .cg caches in L2 only: streamed weights have no reuse in L1.
__device__ __forceinline__ void cp_async_16(uint32_t smem_addr, const void* gmem, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr), "l"(gmem), "r"(src_bytes));
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

// Waits until at most `kPending` committed groups are still in flight.
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending));
}

// Waits for every cp.async this thread issued, committed or not.
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }

}  // namespace fp4moe::ptx
