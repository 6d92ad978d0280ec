// Bit-exact comparison of two bf16 buffers on the device, for `fp4moe soak`
// (contract in tools/soak_compare.hpp).
#include <cuda_runtime.h>

#include <algorithm>

#include "fp4moe/cuda_check.hpp"
#include "fp4moe/error.hpp"
#include "soak_compare.hpp"

namespace fp4moe::cli {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 1024;

__device__ __forceinline__ uint32_t differing_halves(uint32_t a, uint32_t b) {
  const uint32_t x = a ^ b;
  return ((x & 0xFFFFu) != 0) + ((x >> 16) != 0);
}

__global__ void __launch_bounds__(kThreads)
    count_mismatches_kernel(const uint4* __restrict__ got,       // [num_vectors] 8 bf16 each
                            const uint4* __restrict__ expected,  // [num_vectors]
                            int64_t num_vectors, uint32_t* __restrict__ mismatches) {
  uint32_t count = 0;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < num_vectors; i += stride) {
    const uint4 a = got[i];
    const uint4 b = expected[i];
    count += differing_halves(a.x, b.x) + differing_halves(a.y, b.y) + differing_halves(a.z, b.z) +
             differing_halves(a.w, b.w);
  }
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) count += __shfl_xor_sync(0xFFFFFFFFu, count, offset);
  if (threadIdx.x % 32 == 0 && count != 0) atomicAdd(mismatches, count);
}

}  // namespace

void launch_count_mismatches(const uint16_t* got, const uint16_t* expected, int64_t count, uint32_t* mismatches,
                             cudaStream_t stream) {
  FP4MOE_CHECK(count >= 0 && count % 8 == 0, "launch_count_mismatches: count = ", count, "; expected a multiple of 8");
  if (count == 0) return;
  const int64_t num_vectors = count / 8;
  const int64_t blocks = std::min(kMaxBlocks, (num_vectors + kThreads - 1) / kThreads);
  count_mismatches_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
      reinterpret_cast<const uint4*>(got), reinterpret_cast<const uint4*>(expected), num_vectors, mismatches);
  FP4MOE_CHECK_LAUNCH();
}

}  // namespace fp4moe::cli
