// The counting sort of (token, slot) pairs by expert (device code): the
// three steps of count_pairs, scan_expert_rows and place_pairs, run back to
// back by one block (sort_pairs_in_block) or split over blocks (sort.cu's
// kernels), and the single-token sort of the fused routing kernel
// (routing.cu). The contract is launch_sort_by_expert's in moe_ops.hpp.
// Tested in tests/kernels/ops/test_sort.cpp.
#pragma once

#include <cstdint>

#include "kernels/ops/common.cuh"

namespace fp4moe::kernels {

// Calls fn(pair, expert_id, in_range, valid) for every pair of [begin,
// end), in warp-uniform chunks of 32 consecutive pairs so that every lane of
// a warp reaches the warp intrinsics inside fn together (lanes past the end
// pass in_range = false). NOTE: the ids are read through L2 (ld.global.cg),
// not the read-only path: in route_and_sort_kernel other blocks of the same
// grid wrote them.
template <int THREADS, typename Fn>
__device__ __forceinline__ void for_each_pair(const int32_t* topk_ids, int64_t begin, int64_t end, int num_experts,
                                              Fn&& fn) {
  const int warp = static_cast<int>(threadIdx.x) / 32;
  const int lane = static_cast<int>(threadIdx.x) % 32;
  for (int64_t chunk = begin + static_cast<int64_t>(warp) * 32; chunk < end; chunk += THREADS) {
    const int64_t pair = chunk + lane;
    const bool in_range = pair < end;
    int32_t id = -1;
    if (in_range) id = __ldcg(topk_ids + pair);
    const bool valid = in_range && static_cast<uint32_t>(id) < static_cast<uint32_t>(num_experts);
    fn(pair, id, in_range, valid);
  }
}

template <int THREADS>
struct SortShared {
  int expert_cursor[kMaxExperts];  // counts, then each expert's next free row
  int warp_totals[THREADS / 32];
};

// The counting sort of pairs by expert, in three steps that one block runs
// back to back (sort_pairs_in_block) or, for many pairs, two kernels split
// over blocks of kSortChunkPairs pairs (count_pairs_kernel, then
// place_pairs_kernel). Lanes of a warp with the same expert are grouped with
// __match_any_sync so each group costs one shared atomic: routing that sends
// every token to one expert does not serialise 32-fold.

// Step 1: sh.expert_cursor[e] = the pairs of [begin, end) with expert e.
// Sets kErrorExpertIdOutOfRange for ids outside [0, num_experts) but
// kAbsentSlot. Ends with the block synchronised.
template <int THREADS>
__device__ void count_pairs(SortShared<THREADS>& sh, const int32_t* topk_ids, int64_t begin, int64_t end,
                            int num_experts, int32_t* __restrict__ error_flags) {
  const int tid = static_cast<int>(threadIdx.x);
  const int lane = tid % 32;
  for (int e = tid; e < num_experts; e += THREADS) sh.expert_cursor[e] = 0;
  __syncthreads();
  bool saw_invalid = false;
  for_each_pair<THREADS>(topk_ids, begin, end, num_experts, [&](int64_t, int32_t id, bool in_range, bool valid) {
    saw_invalid |= in_range && !valid && id != kAbsentSlot;
    const unsigned valid_lanes = __ballot_sync(kFullWarp, valid);
    if (valid) {
      const unsigned peers = __match_any_sync(valid_lanes, id);
      if (lane == __ffs(peers) - 1) atomicAdd(&sh.expert_cursor[id], __popc(peers));
    }
  });
  if (__syncthreads_or(saw_invalid) && tid == 0) atomicOr(error_flags, kErrorExpertIdOutOfRange);
}

// The experts each thread owns in step 2's scan: kPerThread consecutive ones.
template <int THREADS>
inline constexpr int kExpertsPerSortThread = (kMaxExperts + THREADS - 1) / THREADS;

// Step 2: an exclusive scan of counts[i] (expert tid * kPerThread + i; per-
// thread sums, warp scans of those, then a scan of the warp totals) gives
// each expert's first row; expert_offsets gets it where non-null (with the
// total at [num_experts]), and sh.expert_cursor[e] = first row + skip[i],
// where this block's pairs of e go. Ends with the block synchronised.
template <int THREADS>
__device__ void scan_expert_rows(SortShared<THREADS>& sh, const int (&counts)[kExpertsPerSortThread<THREADS>],
                                 const int (&skip)[kExpertsPerSortThread<THREADS>], int num_experts,
                                 int32_t* __restrict__ expert_offsets) {
  static_assert(THREADS % 32 == 0 && THREADS / 32 <= 32, "warp totals are scanned by one warp");
  constexpr int kPerThread = kExpertsPerSortThread<THREADS>;
  const int tid = static_cast<int>(threadIdx.x);
  const int warp = tid / 32;
  const int lane = tid % 32;
  int thread_total = 0;
#pragma unroll
  for (int i = 0; i < kPerThread; ++i) thread_total += counts[i];
  int inclusive = thread_total;
#pragma unroll
  for (int d = 1; d < 32; d *= 2) {
    const int below = __shfl_up_sync(kFullWarp, inclusive, d);
    if (lane >= d) inclusive += below;
  }
  if (lane == 31) sh.warp_totals[warp] = inclusive;
  __syncthreads();
  if (warp == 0) {
    const int total = lane < THREADS / 32 ? sh.warp_totals[lane] : 0;
    int warp_inclusive = total;
#pragma unroll
    for (int d = 1; d < 32; d *= 2) {
      const int below = __shfl_up_sync(kFullWarp, warp_inclusive, d);
      if (lane >= d) warp_inclusive += below;
    }
    if (lane < THREADS / 32) sh.warp_totals[lane] = warp_inclusive - total;
  }
  __syncthreads();
  int start = sh.warp_totals[warp] + inclusive - thread_total;
  const int first_expert = tid * kPerThread;
#pragma unroll
  for (int i = 0; i < kPerThread; ++i) {
    const int e = first_expert + i;
    if (e < num_experts) {
      if (expert_offsets) expert_offsets[e] = start;
      sh.expert_cursor[e] = start + skip[i];
    }
    start += counts[i];
  }
  if (expert_offsets && tid == THREADS - 1) expert_offsets[num_experts] = start;  // the total
  __syncthreads();
}

// Step 3: each pair of [begin, end) with a valid id takes the next row of its
// expert (sh.expert_cursor).
template <int THREADS>
__device__ void place_pairs(SortShared<THREADS>& sh, const int32_t* topk_ids, int64_t begin, int64_t end, int top_k,
                            int num_experts, int32_t* __restrict__ token_of_row, int32_t* __restrict__ pair_of_row) {
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const unsigned lanes_below = (1u << lane) - 1u;
  for_each_pair<THREADS>(topk_ids, begin, end, num_experts, [&](int64_t pair, int32_t id, bool, bool valid) {
    const unsigned valid_lanes = __ballot_sync(kFullWarp, valid);
    if (!valid) return;
    const unsigned peers = __match_any_sync(valid_lanes, id);
    const int leader = __ffs(peers) - 1;
    int first_row = 0;
    if (lane == leader) first_row = atomicAdd(&sh.expert_cursor[id], __popc(peers));
    const int row = __shfl_sync(peers, first_row, leader) + __popc(peers & lanes_below);
    token_of_row[row] = static_cast<int32_t>(pair / top_k);
    pair_of_row[row] = static_cast<int32_t>(pair);
  });
}

// All pairs by one block of THREADS threads (expert_offsets is written every
// launch, so nothing needs a memset).
template <int THREADS>
__device__ void sort_pairs_in_block(SortShared<THREADS>& sh,
                                    const int32_t* topk_ids,  // [num_pairs]
                                    int64_t num_pairs, int top_k, int num_experts,
                                    int32_t* __restrict__ expert_offsets,  // [num_experts + 1]
                                    int32_t* __restrict__ token_of_row,    // [num_pairs]
                                    int32_t* __restrict__ pair_of_row,     // [num_pairs]
                                    int32_t* __restrict__ error_flags) {
  constexpr int kPerThread = kExpertsPerSortThread<THREADS>;
  count_pairs<THREADS>(sh, topk_ids, 0, num_pairs, num_experts, error_flags);
  int counts[kPerThread], skip[kPerThread];
#pragma unroll
  for (int i = 0; i < kPerThread; ++i) {
    const int e = static_cast<int>(threadIdx.x) * kPerThread + i;
    counts[i] = e < num_experts ? sh.expert_cursor[e] : 0;
    skip[i] = 0;
  }
  scan_expert_rows<THREADS>(sh, counts, skip, num_experts, expert_offsets);
  place_pairs<THREADS>(sh, topk_ids, 0, num_pairs, top_k, num_experts, token_of_row, pair_of_row);
}

// The sort of a single token's `rows` slots (chosen: their experts, in
// shared memory, at most kMaxTopK) without a histogram: expert e's first
// row is the number of valid slots with a smaller expert, and slot j's row
// its rank by (expert, j), the order sort_pairs_in_block places them in.
// No barrier, no atomic: each thread counts over the slots on its own (the
// block-wide histogram, scan and placement cost five barriers at T = 1).
inline __device__ void sort_one_token(const int* chosen, int rows, int num_experts,
                                      int32_t* __restrict__ expert_offsets,  // [num_experts + 1]
                                      int32_t* __restrict__ token_of_row,    // [rows]
                                      int32_t* __restrict__ pair_of_row,     // [rows]
                                      int32_t* __restrict__ error_flags) {
  const int tid = static_cast<int>(threadIdx.x);
  auto valid = [&](int id) { return static_cast<uint32_t>(id) < static_cast<uint32_t>(num_experts); };
  // NOTE: loops over the `rows` slots read from shared memory: holding all
  // kMaxTopK slots in registers made every thread run 32 compares per
  // expert (3.3x the instructions of this form at top-8 + 1 in ncu).
  for (int e = tid; e <= num_experts; e += kRouteThreads) {
    int below = 0;
    for (int j = 0; j < rows; ++j) {
      const int other = chosen[j];
      below += valid(other) && other < e;
    }
    expert_offsets[e] = below;
  }
  if (tid >= rows) return;
  const int id = chosen[tid];
  if (!valid(id)) {
    if (id != kAbsentSlot) atomicOr(error_flags, kErrorExpertIdOutOfRange);
    return;
  }
  int row = 0;
  for (int j = 0; j < rows; ++j) {
    const int other = chosen[j];
    row += valid(other) && (other < id || (other == id && j < tid));
  }
  token_of_row[row] = 0;
  pair_of_row[row] = tid;
}

}  // namespace fp4moe::kernels
