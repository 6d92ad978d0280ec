// Sort: the counting sort of (token, slot) pairs by expert (device code in
// sort.cuh), in one block up to kSortChunkPairs pairs and in two kernels
// over blocks of kSortChunkPairs past it; and its host launcher (the
// contract is in moe_ops.hpp).
//
// Tested in tests/kernels/ops/test_sort.cpp against every property of the
// contract on random, skewed, single-expert, sparse and out-of-range ids,
// with poisoned outputs.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "fp4moe/error.hpp"
#include "kernels/launch.cuh"
#include "kernels/ops/common.cuh"
#include "kernels/ops/moe_ops.hpp"
#include "kernels/ops/sort.cuh"
#include "kernels/ptx/grid_dependency.cuh"

namespace fp4moe::kernels {
namespace {

__global__ void __launch_bounds__(kSortThreads)
    sort_by_expert_kernel(const int32_t* __restrict__ topk_ids, int64_t num_pairs, int top_k, int num_experts,
                          int32_t* __restrict__ expert_offsets, int32_t* __restrict__ token_of_row,
                          int32_t* __restrict__ pair_of_row, int32_t* __restrict__ error_flags) {
  __shared__ SortShared<kSortThreads> sh;
  FP4MOE_TIMELINE_SPAN(TimelineKernel::kSort);
  ptx::wait_for_prior_grids();  // launched early (programmatic): inputs may not be ready yet
  ptx::allow_dependent_launch();
  sort_pairs_in_block<kSortThreads>(sh, topk_ids, num_pairs, top_k, num_experts, expert_offsets, token_of_row,
                                    pair_of_row, error_flags);
}

// Many pairs, first kernel: block b counts its chunk's pairs per expert into
// block_counts[b][e] (every entry written every launch).
__global__ void __launch_bounds__(kSortThreads)
    count_pairs_kernel(const int32_t* __restrict__ topk_ids, int64_t num_pairs, int num_experts,
                       int32_t* __restrict__ block_counts,  // [gridDim.x][num_experts]
                       int32_t* __restrict__ error_flags) {
  __shared__ SortShared<kSortThreads> sh;
  FP4MOE_TIMELINE_SPAN(TimelineKernel::kSort);
  ptx::wait_for_prior_grids();  // launched early (programmatic): inputs may not be ready yet
  ptx::allow_dependent_launch();
  const int64_t begin = static_cast<int64_t>(blockIdx.x) * kSortChunkPairs;
  count_pairs<kSortThreads>(sh, topk_ids, begin, std::min(begin + kSortChunkPairs, num_pairs), num_experts,
                            error_flags);
  for (int e = static_cast<int>(threadIdx.x); e < num_experts; e += kSortThreads)
    block_counts[static_cast<int64_t>(blockIdx.x) * num_experts + e] = sh.expert_cursor[e];
}

// Many pairs, second kernel: block b places its chunk's pairs after every
// earlier block's pairs of the same expert; block 0 writes expert_offsets.
__global__ void __launch_bounds__(kSortThreads)
    place_pairs_kernel(const int32_t* __restrict__ topk_ids, int64_t num_pairs, int top_k, int num_experts,
                       const int32_t* __restrict__ block_counts,  // [gridDim.x][num_experts]
                       int32_t* __restrict__ expert_offsets, int32_t* __restrict__ token_of_row,
                       int32_t* __restrict__ pair_of_row) {
  constexpr int kPerThread = kExpertsPerSortThread<kSortThreads>;
  __shared__ SortShared<kSortThreads> sh;
  FP4MOE_TIMELINE_SPAN(TimelineKernel::kSort);
  ptx::wait_for_prior_grids();  // launched early (programmatic): inputs may not be ready yet
  ptx::allow_dependent_launch();
  int counts[kPerThread], skip[kPerThread];
#pragma unroll
  for (int i = 0; i < kPerThread; ++i) {
    const int e = static_cast<int>(threadIdx.x) * kPerThread + i;
    counts[i] = skip[i] = 0;
    if (e >= num_experts) continue;
    for (int b = 0; b < static_cast<int>(gridDim.x); ++b) {
      const int c = block_counts[static_cast<int64_t>(b) * num_experts + e];
      counts[i] += c;
      if (b < static_cast<int>(blockIdx.x)) skip[i] += c;
    }
  }
  scan_expert_rows<kSortThreads>(sh, counts, skip, num_experts, blockIdx.x == 0 ? expert_offsets : nullptr);
  const int64_t begin = static_cast<int64_t>(blockIdx.x) * kSortChunkPairs;
  place_pairs<kSortThreads>(sh, topk_ids, begin, std::min(begin + kSortChunkPairs, num_pairs), top_k, num_experts,
                            token_of_row, pair_of_row);
}

}  // namespace

void launch_sort_by_expert(const int32_t* topk_ids, int64_t num_tokens, int top_k, int64_t num_experts,
                           int32_t* expert_offsets, int32_t* token_of_row, int32_t* pair_of_row, int32_t* error_flags,
                           int32_t* sort_scratch, cudaStream_t stream, bool programmatic) {
  FP4MOE_CHECK(num_tokens >= 0, "launch_sort_by_expert: num_tokens = ", num_tokens, "; expected >= 0");
  FP4MOE_CHECK(top_k >= 1, "launch_sort_by_expert: top_k = ", top_k, "; expected >= 1");
  check_num_experts("launch_sort_by_expert", num_experts);
  FP4MOE_CHECK(num_tokens <= INT32_MAX / top_k, "launch_sort_by_expert: num_tokens * top_k = ", num_tokens, " * ",
               top_k, "; expected <= ", INT32_MAX, " (rows are int32)");
  if (num_tokens == 0) return;
  FP4MOE_CHECK(topk_ids && expert_offsets && token_of_row && pair_of_row && error_flags,
               "launch_sort_by_expert: topk_ids, expert_offsets, token_of_row, pair_of_row and "
               "error_flags must be non-null");
  const int64_t num_pairs = num_tokens * top_k;
  if (sort_scratch_ints(num_pairs, num_experts) == 0) {
    launch_kernel(sort_by_expert_kernel, 1, kSortThreads, 0, stream, programmatic, topk_ids, num_pairs, top_k,
                  static_cast<int>(num_experts), expert_offsets, token_of_row, pair_of_row, error_flags);
    return;
  }
  FP4MOE_CHECK(sort_scratch != nullptr, "launch_sort_by_expert: ", num_pairs, " pairs (more than ", kSortChunkPairs,
               ") need sort_scratch, int32 [sort_scratch_ints(num_pairs, num_experts)]");
  const auto blocks = static_cast<unsigned>((num_pairs + kSortChunkPairs - 1) / kSortChunkPairs);
  launch_kernel(count_pairs_kernel, blocks, kSortThreads, 0, stream, programmatic, topk_ids, num_pairs,
                static_cast<int>(num_experts), sort_scratch, error_flags);
  launch_kernel(place_pairs_kernel, blocks, kSortThreads, 0, stream, programmatic, topk_ids, num_pairs, top_k,
                static_cast<int>(num_experts), static_cast<const int32_t*>(sort_scratch), expert_offsets, token_of_row,
                pair_of_row);
}

}  // namespace fp4moe::kernels
