// Inline-PTX wrappers for the SM90a kernel family (src/kernels/sm90_grouped_gemm.cuh):
// transaction barriers (mbarrier), 1-D and tensor (TMA) bulk async copies, cp.async arrivals on
// an mbarrier, named barriers, warpgroup register reallocation and the
// wgmma bookkeeping instructions. The wgmma instructions themselves are in
// ptx/wgmma.cuh. Everything here needs sm_90a; the kernel that uses it is
// compiled to a stub for other targets.
#pragma once

#include <cstdint>

namespace fp4moe::ptx {

// ---------------------------------------------------------------- mbarrier

__device__ __forceinline__ void mbarrier_init(uint32_t bar, uint32_t arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(arrivals) : "memory");
}

// Makes initialised barriers visible to the async proxy (bulk copies) and to
// the other threads once followed by a block-wide barrier.
__device__ __forceinline__ void fence_barrier_init() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}

// Orders this thread's generic-proxy shared-memory accesses with later
// async-proxy ones (wgmma operand reads, bulk copies).
__device__ __forceinline__ void fence_proxy_async_shared() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// Adds `bytes` to the transaction count the barrier's current phase waits for.
__device__ __forceinline__ void mbarrier_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.expect_tx.relaxed.cta.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}

__device__ __forceinline__ void mbarrier_arrive(uint32_t bar) {
  asm volatile(
      "{\n"
      ".reg .b64 state;\n"
      "mbarrier.arrive.shared::cta.b64 state, [%0];\n"
      "}\n" ::"r"(bar)
      : "memory");
}

// Waits until the phase of parity `parity` has completed.
__device__ __forceinline__ void mbarrier_wait(uint32_t bar, uint32_t parity) {
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "WAIT_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT_%=;\n"
      "}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}

// One arrival on `bar` once every cp.async this thread issued so far has
// landed; the arrival is counted in the barrier's expected count (.noinc).
__device__ __forceinline__ void cp_async_arrive_noinc(uint32_t bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}

// ---------------------------------------------------------- bulk copies

// Copies `bytes` (a multiple of 16; both addresses 16-byte aligned) from
// global to shared memory; completion is counted on `bar` as transactions.
__device__ __forceinline__ void bulk_copy_g2s(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(dst),
               "l"(src), "r"(bytes), "r"(bar)
               : "memory");
}

// Copies the box at element coordinates (c0, c1) of the 2-D tensor a
// CUtensorMap describes into shared memory at `dst` (laid out and swizzled
// as the map says; 1024-byte aligned for the 128-byte swizzle), zero-filling
// what lies outside the tensor; completion is counted on `bar` as the box's
// bytes. `map` is the generic address of a __grid_constant__ kernel
// parameter (or of global memory).
__device__ __forceinline__ void tma_load_2d(uint32_t dst, const void* map, int c0, int c1, uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], "
      "[%4];\n" ::"r"(dst),
      "l"(map), "r"(c0), "r"(c1), "r"(bar)
      : "memory");
}

// Fetches a tensor map into the descriptor cache ahead of its first use.
__device__ __forceinline__ void prefetch_tensormap(const void* map) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(map) : "memory");
}

// --------------------------------------------------------- named barriers

// Synchronises `threads` threads (a multiple of 32) on hardware barrier `id`
// (1..15; 0 is __syncthreads').
__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// ------------------------------------------------------ register budget

// Warpgroup-wide: lowers (producer) or raises (consumers) the registers each
// thread of the warpgroup may use.
template <int kRegs>
__device__ __forceinline__ void setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}
template <int kRegs>
__device__ __forceinline__ void setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}

// ------------------------------------------------------------------ wgmma

// Before a wgmma that reads registers written by ordinary instructions.
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
// Waits until at most kPending committed wgmma groups are still running.
template <int kPending>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
}

// Shared-memory matrix descriptor of a K-major bf16 operand stored in
// 128-byte-swizzled atoms of 8 rows x 128 B (docs/design.md §4.7): start
// address >> 4 (bits 0-13), leading byte offset (unused for this layout, 1),
// stride byte offset 1024 >> 4 between 8-row atoms (bits 32-45), swizzle
// mode 1 = 128 B (bits 62-63). The atoms must be 1024-byte aligned.
__device__ __forceinline__ uint64_t smem_desc_k_major_sw128(uint32_t smem_addr) {
  return static_cast<uint64_t>((smem_addr & 0x3FFFFu) >> 4) | (uint64_t{1} << 16) | (uint64_t{1024 >> 4} << 32) |
         (uint64_t{1} << 62);
}
// The descriptor of the operand `bytes` further on (a multiple of 16) from
// the one `desc` describes: the start-address field is the address >> 4 and
// shared addresses stay below 256 KB, so the field of the sum never carries
// into the next one. One add instead of the mask, shift and or above per
// wgmma (uniform-datapath instructions take the consumers' issue slots).
__device__ __forceinline__ uint64_t smem_desc_advance(uint64_t desc, uint32_t bytes) { return desc + (bytes >> 4); }

}  // namespace fp4moe::ptx
