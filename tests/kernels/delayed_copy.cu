#include "kernels/delayed_copy.hpp"

#include "fp4moe/cuda_check.hpp"
#include "fp4moe/error.hpp"
#include "kernels/ptx/grid_dependency.cuh"

namespace fp4moe::testing {
namespace {

__global__ void delayed_copy_kernel(const uint4* src, uint4* dst, size_t chunks, int64_t delay_ns) {
  ptx::allow_dependent_launch();
  uint64_t start = 0;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  for (uint64_t now = start; static_cast<int64_t>(now - start) < delay_ns;) {
    __nanosleep(1000);
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  }
  for (size_t i = threadIdx.x; i < chunks; i += blockDim.x) dst[i] = src[i];
}

}  // namespace

void launch_delayed_copy(const void* src, void* dst, size_t bytes, int64_t delay_ns, cudaStream_t stream) {
  FP4MOE_CHECK(bytes % 16 == 0, "launch_delayed_copy: ", bytes, " bytes is not a multiple of 16");
  delayed_copy_kernel<<<1, 256, 0, stream>>>(static_cast<const uint4*>(src), static_cast<uint4*>(dst), bytes / 16,
                                             delay_ns);
  FP4MOE_CUDA_CHECK(cudaGetLastError());
}

}  // namespace fp4moe::testing
