// FP4MOE_HOST_DEVICE: a function compiled for the host and, under nvcc, for
// the device too, always inlined (internal headers shared by host code and
// kernels, e.g. kernels/fragment_layout.hpp).
#pragma once

#if defined(__CUDACC__)
#define FP4MOE_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define FP4MOE_HOST_DEVICE inline
#endif
