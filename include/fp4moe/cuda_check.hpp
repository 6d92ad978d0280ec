// FP4MOE_CUDA_CHECK: turns a CUDA runtime error into fp4moe::Error with
// file:line, the error's name and its description.
#pragma once

#include <cuda_runtime_api.h>

#include <string>

#include "fp4moe/error.hpp"

#define FP4MOE_CUDA_CHECK(expr)                                                                                    \
  do {                                                                                                             \
    const cudaError_t fp4moe_status_ = (expr);                                                                     \
    if (fp4moe_status_ != cudaSuccess)                                                                             \
      FP4MOE_THROW(#expr, " failed: ", cudaGetErrorName(fp4moe_status_), " (", cudaGetErrorString(fp4moe_status_), \
                   ")");                                                                                           \
  } while (0)

// After a kernel launch: a launch configuration error surfaces here.
#define FP4MOE_CHECK_LAUNCH() FP4MOE_CUDA_CHECK(cudaGetLastError())

namespace fp4moe {

// Why no CUDA device can be used here: "" when one can, else what the CUDA
// runtime said (the error's name and text, or that it counts no device), so a
// driver/runtime mismatch or an empty CUDA_VISIBLE_DEVICES shows as the error
// it is, never as a silent "no GPU". The sticky error is cleared.
inline std::string cuda_unavailable_reason() {
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    cudaGetLastError();
    return std::string("cudaGetDeviceCount failed: ") + cudaGetErrorName(err) + " (" + cudaGetErrorString(err) + ")";
  }
  return count > 0 ? std::string() : std::string("cudaGetDeviceCount counts 0 devices");
}

}  // namespace fp4moe
