// FP4MOE_CUDA_CHECK: turns a CUDA runtime error into fp4moe::Error with
// file:line, the error's name and its description.
#pragma once

#include <cuda_runtime_api.h>

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
