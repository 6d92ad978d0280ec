// Kernel launch with optional programmatic dependent launch: on SM90+ the
// kernel may then start while the previous kernel in the stream finishes
// (its blocks get resident and wait in ptx::wait_for_prior_grids()), which
// hides the launch latency between the short kernels of a decode-sized MoE
// layer. Only kernels that call ptx::wait_for_prior_grids() before touching
// global memory may be launched this way. Works under stream capture.
#pragma once

#include <cuda_runtime.h>

#include <utility>

#include "fp4moe/cuda_check.hpp"
#include "kernels/device_info.hpp"

namespace fp4moe::kernels {

template <typename... Params, typename... Args>
void launch_kernel(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem_bytes, cudaStream_t stream,
                   bool programmatic, Args&&... args) {
  cudaLaunchAttribute attribute{};
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem_bytes;
  config.stream = stream;
  config.attrs = &attribute;
  config.numAttrs = programmatic && current_device().cc_major >= 9 ? 1 : 0;
  FP4MOE_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...));
}

}  // namespace fp4moe::kernels
