// Inline-PTX wrappers for programmatic dependent launch (SM90+). A kernel
// launched with the programmatic-serialisation attribute (launch.cuh) may
// start while the kernel before it in the stream still runs: it must call
// wait_for_prior_grids() before it reads or writes any global memory that
// earlier kernels touch; that returns once they have completed and their
// writes are visible. allow_dependent_launch() lets the next kernel start
// early (it only launches once every block of this grid has called it or
// exited). Both are no-ops on older GPUs and in kernels launched normally.
#pragma once

namespace fp4moe::ptx {

__device__ __forceinline__ void wait_for_prior_grids() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

__device__ __forceinline__ void allow_dependent_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

}  // namespace fp4moe::ptx
