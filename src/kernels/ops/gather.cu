// Gather: the activation rows of each (token, slot) pair copied into expert
// order, as bf16 or (W4A4) quantised to NVFP4 on the way; and their host
// launchers (the contract is in moe_ops.hpp).
//
// Tested in tests/kernels/ops/test_gather.cpp against host loops (bit-exact)
// and the CPU quantiser (every bf16 value for every block scale), with
// poisoned outputs.
#include <cuda_runtime.h>

#include <cstdint>

#include "fp4moe/error.hpp"
#include "kernels/act_quant.cuh"
#include "kernels/launch.cuh"
#include "kernels/ops/common.cuh"
#include "kernels/ops/moe_ops.hpp"
#include "kernels/ptx/grid_dependency.cuh"
#include "plan/smem_model.hpp"

namespace fp4moe::kernels {
namespace {

__global__ void gather_rows_kernel(const uint4* __restrict__ x,                 // [tokens, vectors_per_row]
                                   const int32_t* __restrict__ token_of_row,    // [num_rows]
                                   const int32_t* __restrict__ expert_offsets,  // [num_experts + 1]
                                   int num_experts, int64_t num_rows, int64_t vectors_per_row,
                                   uint4* __restrict__ x_sorted) {  // [num_rows, vectors_per_row]
  FP4MOE_TIMELINE_SPAN(TimelineKernel::kGather);
  ptx::wait_for_prior_grids();  // launched early (programmatic): inputs may not be ready yet
  ptx::allow_dependent_launch();
  const int64_t placed_rows = min(num_rows, static_cast<int64_t>(expert_offsets[num_experts]));
  const int64_t num_vectors = placed_rows * vectors_per_row;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < num_vectors; i += stride) {
    const int64_t row = i / vectors_per_row;
    const int64_t column = i - row * vectors_per_row;
    x_sorted[i] = x[static_cast<int64_t>(token_of_row[row]) * vectors_per_row + column];
  }
}

// W4A4: as gather_rows_kernel, one thread per NVFP4 block of 16 (two 16-byte
// vectors), each quantised against its row's expert's input_scale
// (act_quant.cuh) on the way. The expert offsets are searched in shared
// memory: from global memory the search was eight dependent L2 round trips
// per thread, the longest latency of the pass at one token.
__global__ void __launch_bounds__(kElementwiseThreads)
    gather_rows_fp4_kernel(const uint4* __restrict__ x,                 // [tokens, 2 * blocks_per_row]
                           const int32_t* __restrict__ token_of_row,    // [num_rows]
                           const int32_t* __restrict__ expert_offsets,  // [num_experts + 1]
                           int num_experts, int64_t num_rows, int blocks_per_row,
                           const float* __restrict__ input_scales,  // [num_experts]
                           uint4* __restrict__ x_sorted) {          // [num_rows, 2 * blocks_per_row]
  __shared__ int32_t s_offsets[kMaxExperts + 1];
  FP4MOE_TIMELINE_SPAN(TimelineKernel::kGather);
  ptx::wait_for_prior_grids();  // launched early (programmatic): inputs may not be ready yet
  ptx::allow_dependent_launch();
  for (int e = threadIdx.x; e <= num_experts; e += blockDim.x) s_offsets[e] = expert_offsets[e];
  __syncthreads();
  const int64_t placed_rows = min(num_rows, static_cast<int64_t>(s_offsets[num_experts]));
  const int64_t num_blocks = placed_rows * blocks_per_row;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const bool narrow = num_blocks <= INT32_MAX;  // 32-bit division: a few instructions, 64-bit ~70
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < num_blocks; i += stride) {
    const int64_t row =
        narrow ? int64_t{static_cast<uint32_t>(i) / static_cast<uint32_t>(blocks_per_row)} : i / blocks_per_row;
    const int64_t block = i - row * blocks_per_row;
    const uint4* src = x + (static_cast<int64_t>(token_of_row[row]) * blocks_per_row + block) * 2;
    uint4 first = src[0], second = src[1];
    // The row's expert: rows are sorted by expert, so the last e with
    // offsets[e] <= row (empty experts before it share its offset).
    int lo = 0, hi = num_experts - 1;
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (s_offsets[mid] <= row)
        lo = mid;
      else
        hi = mid - 1;
    }
    detail::fp4_quantize_bf16_block(first, second, __ldg(input_scales + lo));
    x_sorted[2 * i] = first;
    x_sorted[2 * i + 1] = second;
  }
}

}  // namespace

void launch_gather_rows(const void* x, const int32_t* token_of_row, const int32_t* expert_offsets, int64_t num_experts,
                        int64_t num_rows, int64_t hidden, void* x_sorted, cudaStream_t stream, bool programmatic) {
  FP4MOE_CHECK(num_rows >= 0 && num_rows <= INT32_MAX, "launch_gather_rows: num_rows = ", num_rows,
               "; expected in [0, ", INT32_MAX, "]");
  FP4MOE_CHECK(num_experts >= 1 && num_experts <= INT32_MAX - 1, "launch_gather_rows: num_experts = ", num_experts,
               "; expected >= 1");
  FP4MOE_CHECK(hidden >= 8 && hidden % 8 == 0, "launch_gather_rows: hidden = ", hidden,
               "; expected a positive multiple of 8 (16-byte bf16 vectors)");
  if (num_rows == 0) return;
  FP4MOE_CHECK(x && token_of_row && expert_offsets && x_sorted,
               "launch_gather_rows: x, token_of_row, expert_offsets and x_sorted must be non-null");
  FP4MOE_CHECK(aligned_16(x) && aligned_16(x_sorted), "launch_gather_rows: x and x_sorted must be 16-byte aligned");
  const int64_t vectors_per_row = hidden / 8;
  launch_kernel(gather_rows_kernel, elementwise_grid(num_rows * vectors_per_row), kElementwiseThreads, 0, stream,
                programmatic, static_cast<const uint4*>(x), token_of_row, expert_offsets, static_cast<int>(num_experts),
                num_rows, vectors_per_row, static_cast<uint4*>(x_sorted));
}

void launch_gather_rows_fp4(const void* x, const int32_t* token_of_row, const int32_t* expert_offsets,
                            int64_t num_experts, int64_t num_rows, int64_t hidden, const float* input_scales,
                            void* x_sorted, cudaStream_t stream, bool programmatic) {
  FP4MOE_CHECK(num_rows >= 0 && num_rows <= INT32_MAX, "launch_gather_rows_fp4: num_rows = ", num_rows,
               "; expected in [0, ", INT32_MAX, "]");
  check_num_experts("launch_gather_rows_fp4", num_experts);
  FP4MOE_CHECK(hidden >= 16 && hidden % 16 == 0 && hidden / 16 <= INT32_MAX,
               "launch_gather_rows_fp4: hidden = ", hidden, "; expected a positive multiple of 16 (the NVFP4 block)");
  if (num_rows == 0) return;
  FP4MOE_CHECK(x && token_of_row && expert_offsets && input_scales && x_sorted,
               "launch_gather_rows_fp4: x, token_of_row, expert_offsets, input_scales and x_sorted must be "
               "non-null");
  FP4MOE_CHECK(aligned_16(x) && aligned_16(x_sorted), "launch_gather_rows_fp4: x and x_sorted must be 16-byte aligned");
  const int64_t blocks_per_row = hidden / 16;
  launch_kernel(gather_rows_fp4_kernel, elementwise_grid(num_rows * blocks_per_row), kElementwiseThreads, 0, stream,
                programmatic, static_cast<const uint4*>(x), token_of_row, expert_offsets, static_cast<int>(num_experts),
                num_rows, static_cast<int>(blocks_per_row), input_scales, static_cast<uint4*>(x_sorted));
}

}  // namespace fp4moe::kernels
