// Finalize: the last step of the layer, per-pair bf16 rows summed per token
// in slot order in fp32 (deterministic) or an fp32 accumulator read and
// cleared, written as bf16; and the host launchers (the contract is in
// moe_ops.hpp).
//
// Tested in tests/kernels/ops/test_finalize.cpp against host loops, bit for
// bit, with poisoned outputs.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "fp4moe/error.hpp"
#include "kernels/bf16x4.cuh"
#include "kernels/launch.cuh"
#include "kernels/ops/common.cuh"
#include "kernels/ops/moe_ops.hpp"
#include "kernels/ptx/grid_dependency.cuh"

namespace fp4moe::kernels {
namespace {

// A thread's four columns of a token: 8 bytes of each slot's bf16 row read,
// 8 bytes of bf16 output written.
__global__ void finalize_pairs_kernel(const uint2* __restrict__ pair_rows,   // [num_tokens * top_k, vectors_per_row]
                                      const int32_t* __restrict__ topk_ids,  // [num_tokens, top_k] or null
                                      int64_t num_tokens, int top_k, int num_experts, int64_t vectors_per_row,
                                      uint2* __restrict__ output) {  // [num_tokens, vectors_per_row]
  FP4MOE_TIMELINE_SPAN(TimelineKernel::kFinalize);
  ptx::wait_for_prior_grids();  // launched early (programmatic): inputs may not be ready yet
  ptx::allow_dependent_launch();
  const int64_t num_vectors = num_tokens * vectors_per_row;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < num_vectors; i += stride) {
    const int64_t token = i / vectors_per_row;
    const int64_t column = i - token * vectors_per_row;
    // The bf16 rows widened (exactly) and summed in slot order, from 0.0f,
    // in fp32, rounded to bf16 once: the same bits on every run.
    // NOTE: ids first, then the rows, as independent loads: a load-check-load
    // chain per slot made this kernel latency-bound (ncu: 4.8 us for 1 token).
    uint32_t written = ~0u;  // slots whose id is valid (the others were never written)
    if (topk_ids != nullptr) {
      written = 0;
#pragma unroll 8
      for (int slot = 0; slot < top_k; ++slot) {
        const int32_t id = __ldg(topk_ids + token * top_k + slot);
        if (static_cast<uint32_t>(id) < static_cast<uint32_t>(num_experts)) written |= 1u << slot;
      }
    }
    float4 sum = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll 8
    for (int slot = 0; slot < top_k; ++slot) {
      if (!((written >> slot) & 1u)) continue;
      const float4 v = ldg_bf16x4(pair_rows + (token * top_k + slot) * vectors_per_row + column);
      sum.x += v.x;
      sum.y += v.y;
      sum.z += v.z;
      sum.w += v.w;
    }
    output[i] = to_bf16x4(sum);
  }
}

__global__ void finalize_accumulated_kernel(float4* __restrict__ accum,  // [num_tokens, vectors_per_row]
                                            int64_t num_vectors, uint2* __restrict__ output) {
  FP4MOE_TIMELINE_SPAN(TimelineKernel::kFinalize);
  ptx::wait_for_prior_grids();  // launched early (programmatic): inputs may not be ready yet
  ptx::allow_dependent_launch();
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < num_vectors; i += stride) {
    const float4 v = accum[i];
    accum[i] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);  // ready for the next forward
    output[i] = to_bf16x4(v);
  }
}

}  // namespace

void launch_finalize_pairs(const void* pair_rows, const int32_t* topk_ids, int64_t num_tokens, int top_k,
                           int64_t num_experts, int64_t hidden, void* output, cudaStream_t stream, bool programmatic) {
  FP4MOE_CHECK(num_tokens >= 0, "launch_finalize_pairs: num_tokens = ", num_tokens, "; expected >= 0");
  FP4MOE_CHECK(top_k >= 1 && top_k <= kMaxTopK, "launch_finalize_pairs: top_k = ", top_k, "; expected in [1, ",
               kMaxTopK, "]");
  FP4MOE_CHECK(num_experts >= 1 && num_experts <= INT32_MAX, "launch_finalize_pairs: num_experts = ", num_experts,
               "; expected >= 1");
  FP4MOE_CHECK(hidden >= 4 && hidden % 4 == 0, "launch_finalize_pairs: hidden = ", hidden,
               "; expected a positive multiple of 4 (four bf16 per load)");
  if (num_tokens == 0) return;
  FP4MOE_CHECK(pair_rows && output, "launch_finalize_pairs: pair_rows and output must be non-null");
  FP4MOE_CHECK(aligned_16(pair_rows) && aligned_16(output),
               "launch_finalize_pairs: pair_rows and output must be 16-byte aligned");
  const int64_t vectors_per_row = hidden / 4;
  launch_kernel(finalize_pairs_kernel, elementwise_grid(num_tokens * vectors_per_row), kElementwiseThreads, 0, stream,
                programmatic, static_cast<const uint2*>(pair_rows), topk_ids, num_tokens, top_k,
                static_cast<int>(num_experts), vectors_per_row, static_cast<uint2*>(output));
}

void launch_finalize_accumulated(float* accum, int64_t num_tokens, int64_t hidden, void* output, cudaStream_t stream,
                                 bool programmatic) {
  FP4MOE_CHECK(num_tokens >= 0, "launch_finalize_accumulated: num_tokens = ", num_tokens, "; expected >= 0");
  FP4MOE_CHECK(hidden >= 4 && hidden % 4 == 0, "launch_finalize_accumulated: hidden = ", hidden,
               "; expected a positive multiple of 4 (float4 loads)");
  if (num_tokens == 0) return;
  FP4MOE_CHECK(accum && output, "launch_finalize_accumulated: accum and output must be non-null");
  FP4MOE_CHECK(aligned_16(accum) && aligned_16(output),
               "launch_finalize_accumulated: accum and output must be 16-byte aligned");
  const int64_t num_vectors = num_tokens * (hidden / 4);
  launch_kernel(finalize_accumulated_kernel, elementwise_grid(num_vectors), kElementwiseThreads, 0, stream,
                programmatic, reinterpret_cast<float4*>(accum), num_vectors, static_cast<uint2*>(output));
}

}  // namespace fp4moe::kernels
