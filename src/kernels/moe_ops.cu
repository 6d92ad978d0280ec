// The small kernels around the two grouped GEMMs of an MoE layer and their
// host launchers (the contract is in moe_ops.hpp): routing (one block per
// token, experts ranked in parallel), the counting sort of (token, slot) pairs by expert (one block),
// the bf16 row gather, the shared experts' slots and the finalize reduction
// to bf16.
//
// Tested in tests/kernels/test_moe_ops.cpp: routing against the CPU reference
// fp4moe::route() for every mode, expert count, top-k and token count (and
// with many exact ties, and with non-finite logits), the sort, gather and finalize against host loops with
// poisoned outputs, and a CUDA-graph capture of the sequence.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>

#include "fp4moe/cuda_check.hpp"
#include "fp4moe/error.hpp"
#include "kernels/act_quant.cuh"
#include "kernels/device_info.hpp"
#include "kernels/launch.cuh"
#include "kernels/moe_ops.hpp"
#include "kernels/ptx/grid_dependency.cuh"
#include "plan/smem_model.hpp"

namespace fp4moe::kernels {
namespace {

constexpr unsigned kFullWarp = 0xFFFFFFFFu;
// kMaxExperts (plan/smem_model.hpp, the grouped GEMM's bound) also sizes the
// routing keys and the sort histogram held in shared memory here.
constexpr int kRouteThreads = 256;                  // routing: one block per token
constexpr int kSortThreads = 1024;                  // a sort block
constexpr int64_t kFusedSortMaxPairs = 1024;        // route_and_sort: up to here the routing kernel sorts
constexpr int kElementwiseThreads = 256;            // gather and finalize
constexpr int kElementwiseBlocksPerSm = 8;          // 2048 resident threads per SM: enough to saturate HBM

static_assert(kMaxTopK <= 32, "lane j holds the j-th chosen expert");

// ------------------------------------------------------------------ routing

// One block per token. Every expert's selection key goes to shared memory,
// then each thread ranks its experts by counting the experts that beat them
// (higher key, or equal key and lower index: the tie rule of fp4moe::route);
// rank j < top_k is the j-th choice. The counting runs on all threads at
// once: a chain of top_k warp argmax rounds is latency-bound (one warp,
// ~3,000 dependent instructions, 12 us at T = 1 in ncu). It counts in two
// steps, each a short chain: within the expert's slice of 32, then, for the
// top_k of every slice (the candidates), among the candidates. An expert
// beaten by a non-candidate is beaten by that slice's top_k as well, so a
// candidate's count among candidates is its rank wherever that is < top_k.
// noaux_tc ranks groups the same way first. A non-finite logit excludes its
// expert as in fp4moe::route (docs/design.md §3): its key is -inf, so it
// ranks after every finite one and ids stay in range and distinct whatever
// the logits; if chosen anyway it weighs 0, and the token sets
// kErrorNonFiniteLogits.
struct RouteShared {
  // Selection key: the logit, or c = sigmoid(logit) + bias for noaux_tc; NaN
  // for experts of dropped groups and for the padding to a slice of 32.
  alignas(16) float key[kMaxExperts];
  // noaux_tc: sigmoid(logit), the unbiased score a choice's weight comes
  // from (0 for a non-finite logit); kept here so that the weights need no
  // second read of the logits.
  float score[kMaxExperts];
  // The top_k of each slice of 32 experts (key, expert); NaN keys: empty.
  alignas(16) float candidate_key[kMaxExperts / 32 * kMaxTopK];
  alignas(16) int candidate[kMaxExperts / 32 * kMaxTopK];
  float group_score[kMaxExperts / 2];
  uint8_t group_kept[kMaxExperts / 2];
  int chosen[kMaxTopK];            // expert of rank j, then the shared chunks' experts
  float partial[kRouteThreads / 32];
  float gate_partial[kRouteThreads / 32];  // the shared expert's gate dot product, per warp
};

__device__ __forceinline__ float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

// Whether (key a, index ia) ranks before (key b, index ib).
__device__ __forceinline__ bool ranks_before(float a, int ia, float b, int ib) {
  return a > b || (a == b && ia < ib);
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) v += __shfl_xor_sync(kFullWarp, v, offset);
  return v;  // xor butterfly: every lane adds the same pairs, so all get the same bits
}

// Experts per routing thread: thread t keys experts t, t + kRouteThreads, ...
constexpr int kRouteExpertsPerThread = kMaxExperts / kRouteThreads;
static_assert(kMaxExperts % kRouteThreads == 0, "whole experts per routing thread");

// noaux_tc's correction bias of this thread's experts (0 where there is
// none). A model constant, so the kernels load it before waiting for the
// stream's previous kernel (whose output, the logits, they do wait for):
// its HBM round trip then overlaps that kernel instead of following the
// logits' (docs/design.md §3: the bias must not be written by the kernel
// just before the layer).
struct ExpertBias {
  float value[kRouteExpertsPerThread];
};

__device__ __forceinline__ ExpertBias load_expert_bias(const float* __restrict__ correction_bias, int num_experts,
                                                       const RoutingParams& params) {
  ExpertBias bias;
#pragma unroll
  for (int i = 0; i < kRouteExpertsPerThread; ++i) {
    const int e = static_cast<int>(threadIdx.x) + i * kRouteThreads;
    const bool used = params.mode == RoutingMode::kNoauxTc && correction_bias != nullptr && e < num_experts;
    bias.value[i] = used ? __ldg(correction_bias + e) : 0.0f;
  }
  return bias;
}

// Routes one token with the whole block (kRouteThreads threads). With
// shared expert slots, the token's row of ids and weights has top_k +
// shared.num_shared entries: its choices, then experts num_experts + j with
// the shared weight (1, or sigmoid(gate · x) in fp32).
__device__ void route_token(RouteShared& sh,
                            const float* __restrict__ router_logits,  // [num_tokens, num_experts]
                            const ExpertBias& bias,                   // load_expert_bias()
                            int num_experts, const RoutingParams& params, int64_t token,
                            int32_t* __restrict__ topk_ids,      // [num_tokens, top_k + num_shared]
                            float* __restrict__ topk_weights,    // [num_tokens, top_k + num_shared]
                            int32_t* __restrict__ error_flags,   // layer error word, or null
                            const SharedSlots& shared) {
  const int tid = static_cast<int>(threadIdx.x);
  const float* logits = router_logits + token * num_experts;
  const int top_k = params.top_k;
  const int rows = top_k + shared.num_shared;  // ids per token
  const bool noaux = params.mode == RoutingMode::kNoauxTc;
  // The ranking below writes chosen[0, top_k) only; the shared chunks' ids
  // follow, for the fused single-token sort (visible after the syncs below).
  if (tid < shared.num_shared) sh.chosen[top_k + tid] = num_experts + tid;

  // Every logit load is issued before the first is used: one round trip.
  float logit[kRouteExpertsPerThread];
#pragma unroll
  for (int i = 0; i < kRouteExpertsPerThread; ++i) {
    const int e = tid + i * kRouteThreads;
    logit[i] = e < num_experts ? __ldg(logits + e) : 0.0f;
  }
  bool saw_nonfinite = false;
#pragma unroll
  for (int i = 0; i < kRouteExpertsPerThread; ++i) {
    const int e = tid + i * kRouteThreads;
    if (e >= num_experts) break;
    float key = -INFINITY;  // excluded
    float score = 0.0f;
    if (isfinite(logit[i])) {
      score = noaux ? sigmoid(logit[i]) : 0.0f;
      key = noaux ? score + bias.value[i] : logit[i];
      if (isnan(key)) key = -INFINITY;  // a NaN correction bias
    } else {
      saw_nonfinite = true;
    }
    sh.key[e] = key;
    if (noaux) sh.score[e] = score;
  }
  // Pad to whole slices of 32 keys for the float4 reads; NaN ranks nowhere.
  const int num_slices = (num_experts + 31) / 32;
  static_assert(kMaxExperts % 32 == 0, "slices of 32 experts");
  for (int e = num_experts + tid; e < num_slices * 32; e += kRouteThreads) sh.key[e] = NAN;
  for (int c = tid; c < num_slices * top_k; c += kRouteThreads) sh.candidate_key[c] = NAN;
  if (__syncthreads_or(saw_nonfinite) && tid == 0 && error_flags != nullptr)
    atomicOr(error_flags, kErrorNonFiniteLogits);

  if (noaux && params.topk_groups < params.num_groups) {
    // Group score: the sum of its two largest keys; keep the topk_groups best.
    const int group_size = num_experts / params.num_groups;
    for (int g = tid; g < params.num_groups; g += kRouteThreads) {
      float top1 = -INFINITY, top2 = -INFINITY;
      for (int m = 0; m < group_size; ++m) {
        const float v = sh.key[g * group_size + m];
        top2 = fmaxf(top2, fminf(top1, v));
        top1 = fmaxf(top1, v);
      }
      const float score = top1 + top2;
      sh.group_score[g] = isnan(score) ? -INFINITY : score;
    }
    __syncthreads();
    for (int g = tid; g < params.num_groups; g += kRouteThreads) {
      int rank = 0;
      for (int other = 0; other < params.num_groups; ++other)
        rank += ranks_before(sh.group_score[other], other, sh.group_score[g], g);
      sh.group_kept[g] = rank < params.topk_groups;
    }
    __syncthreads();
  }

  // Rank of each allowed expert among the allowed experts. Excluded experts
  // carry a NaN key, which never compares greater or equal, so they beat
  // nobody. NOTE: float4 reads and 4 independent counters: each thread's
  // loop is a dependent chain over all experts, so its length, not the
  // thread count, sets the kernel's time.
  if (noaux && params.topk_groups < params.num_groups) {
    const int group_size = num_experts / params.num_groups;
    for (int e = tid; e < num_experts; e += kRouteThreads)
      if (!sh.group_kept[e / group_size]) sh.key[e] = NAN;
    __syncthreads();
  }
  for (int e = tid; e < num_experts; e += kRouteThreads) {
    const float key = sh.key[e];
    if (isnan(key)) continue;
    const int slice = e / 32;
    int rank[4] = {0, 0, 0, 0};
    const float4* keys4 = reinterpret_cast<const float4*>(sh.key + slice * 32);
#pragma unroll
    for (int o = 0; o < 8; ++o) {
      const float4 k4 = keys4[o];
      const int base = slice * 32 + 4 * o;
      rank[0] += ranks_before(k4.x, base + 0, key, e);
      rank[1] += ranks_before(k4.y, base + 1, key, e);
      rank[2] += ranks_before(k4.z, base + 2, key, e);
      rank[3] += ranks_before(k4.w, base + 3, key, e);
    }
    const int in_slice = rank[0] + rank[1] + rank[2] + rank[3];
    if (in_slice < top_k) {
      sh.candidate_key[slice * top_k + in_slice] = key;
      sh.candidate[slice * top_k + in_slice] = e;
    }
  }
  __syncthreads();
  const int num_candidates = num_slices * top_k;
  for (int c = tid; c < num_candidates; c += kRouteThreads) {
    const float key = sh.candidate_key[c];
    if (isnan(key)) continue;
    const int e = sh.candidate[c];
    int rank[4] = {0, 0, 0, 0};
    int j = 0;
    for (; j + 4 <= num_candidates; j += 4) {
      const float4 k4 = *reinterpret_cast<const float4*>(sh.candidate_key + j);
      const int4 e4 = *reinterpret_cast<const int4*>(sh.candidate + j);
      rank[0] += ranks_before(k4.x, e4.x, key, e);
      rank[1] += ranks_before(k4.y, e4.y, key, e);
      rank[2] += ranks_before(k4.z, e4.z, key, e);
      rank[3] += ranks_before(k4.w, e4.w, key, e);
    }
    for (; j < num_candidates; ++j) rank[0] += ranks_before(sh.candidate_key[j], sh.candidate[j], key, e);
    const int total = rank[0] + rank[1] + rank[2] + rank[3];
    if (total < top_k) sh.chosen[total] = e;
  }

  // Softmax without renormalisation divides by the sum over all experts
  // (excluded ones add expf(-inf) = 0; without a finite logit the weights
  // are 0 and the sum is not used).
  float all_sum = 0.0f;
  if (params.mode == RoutingMode::kSoftmaxTopK && !params.renormalize) {
    __syncthreads();
    const float max_logit = sh.key[sh.chosen[0]];
    float partial = 0.0f;
    if (max_logit != -INFINITY)
      for (int e = tid; e < num_experts; e += kRouteThreads) partial += expf(sh.key[e] - max_logit);
    partial = warp_sum(partial);
    if (tid % 32 == 0) sh.partial[tid / 32] = partial;
    __syncthreads();
    for (int w = 0; w < kRouteThreads / 32; ++w) all_sum += sh.partial[w];  // fixed order
  } else {
    __syncthreads();
  }

  // The shared slots' weight: sigmoid(gate · x) summed per thread, per warp,
  // then over warps in a fixed order (block-uniform branch).
  float shared_weight = 1.0f;
  if (shared.num_shared > 0 && shared.gate != nullptr) {
    const __nv_bfloat16* x = static_cast<const __nv_bfloat16*>(shared.hidden_states) + token * shared.hidden;
    float partial = 0.0f;
    for (int64_t h = tid; h < shared.hidden; h += kRouteThreads)
      partial += __bfloat162float(x[h]) * __ldg(shared.gate + h);
    partial = warp_sum(partial);
    if (tid % 32 == 0) sh.gate_partial[tid / 32] = partial;
    __syncthreads();
    float dot = 0.0f;
    for (int w = 0; w < kRouteThreads / 32; ++w) dot += sh.gate_partial[w];
    shared_weight = sigmoid(dot);
  }

  if (tid < 32) {  // lane j: the j-th choice and its weight
    const int lane = tid;
    const int expert = lane < top_k ? sh.chosen[lane] : 0;
    float weight = 0.0f;
    if (noaux) {
      const float unbiased = lane < top_k ? sh.score[expert] : 0.0f;
      weight = unbiased / (warp_sum(unbiased) + 1e-20f) * params.routed_scaling_factor;
    } else {
      // The first choice holds the largest key; -inf there: no finite logit.
      const float max_logit = sh.key[sh.chosen[0]];
      const float key = sh.key[expert];
      const float numerator =
          lane < top_k && key != -INFINITY ? expf(key - max_logit) : 0.0f;
      const float denominator =
          params.mode == RoutingMode::kSoftmaxTopK && !params.renormalize ? all_sum
                                                                          : warp_sum(numerator);
      weight = max_logit == -INFINITY ? 0.0f : numerator / denominator;
    }
    if (lane < top_k) {
      topk_ids[token * rows + lane] = expert;
      topk_weights[token * rows + lane] = weight;
    } else if (lane < rows) {
      topk_ids[token * rows + lane] = num_experts + lane - top_k;
      topk_weights[token * rows + lane] = shared_weight;
    }
  }
}

__global__ void __launch_bounds__(kRouteThreads)
    route_kernel(const float* __restrict__ router_logits, const float* __restrict__ correction_bias,
                 int num_experts, RoutingParams params, int32_t* __restrict__ topk_ids,
                 float* __restrict__ topk_weights, int32_t* __restrict__ error_flags, SharedSlots shared) {
  __shared__ RouteShared sh;
  const ExpertBias bias = load_expert_bias(correction_bias, num_experts, params);
  ptx::wait_for_prior_grids();  // launched early (programmatic): inputs may not be ready yet
  ptx::allow_dependent_launch();
  route_token(sh, router_logits, bias, num_experts, params, blockIdx.x, topk_ids,
              topk_weights, error_flags, shared);
}

// ------------------------------------------------------------------- sort

// Calls fn(pair, expert_id, in_range, valid) for every pair of [begin,
// end), in warp-uniform chunks of 32 consecutive pairs so that every lane of
// a warp reaches the warp intrinsics inside fn together (lanes past the end
// pass in_range = false). NOTE: the ids are read through L2 (ld.global.cg),
// not the read-only path: in route_and_sort_kernel other blocks of the same
// grid wrote them.
template <int THREADS, typename Fn>
__device__ __forceinline__ void for_each_pair(const int32_t* topk_ids, int64_t begin, int64_t end,
                                              int num_experts, Fn&& fn) {
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
__device__ void place_pairs(SortShared<THREADS>& sh, const int32_t* topk_ids, int64_t begin, int64_t end,
                            int top_k, int num_experts, int32_t* __restrict__ token_of_row,
                            int32_t* __restrict__ pair_of_row) {
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

__global__ void __launch_bounds__(kSortThreads)
    sort_by_expert_kernel(const int32_t* __restrict__ topk_ids, int64_t num_pairs, int top_k,
                          int num_experts, int32_t* __restrict__ expert_offsets,
                          int32_t* __restrict__ token_of_row, int32_t* __restrict__ pair_of_row,
                          int32_t* __restrict__ error_flags) {
  __shared__ SortShared<kSortThreads> sh;
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

// The sort of a single token's `rows` slots (chosen: their experts, in
// shared memory, at most kMaxTopK) without a histogram: expert e's first
// row is the number of valid slots with a smaller expert, and slot j's row
// its rank by (expert, j), the order sort_pairs_in_block places them in.
// No barrier, no atomic: each thread counts over the slots on its own (the
// block-wide histogram, scan and placement cost five barriers at T = 1).
__device__ void sort_one_token(const int* chosen, int rows, int num_experts,
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

// Routing and sort in one launch, for small batches where a second kernel's
// launch costs more than the sort: every block routes its token, then the
// last block to finish (counted in *arrivals, which it resets to 0 for the
// next launch) sorts all pairs with its kRouteThreads threads. A single
// token's block sorts its choices straight from shared memory
// (sort_one_token): no fence, no arrival atomic, no read-back through L2.
__global__ void __launch_bounds__(kRouteThreads)
    route_and_sort_kernel(const float* __restrict__ router_logits,
                          const float* __restrict__ correction_bias, int num_experts,
                          RoutingParams params, int32_t* topk_ids, float* __restrict__ topk_weights,
                          int32_t* __restrict__ expert_offsets, int32_t* __restrict__ token_of_row,
                          int32_t* __restrict__ pair_of_row, int32_t* __restrict__ error_flags,
                          int32_t* __restrict__ arrivals, SharedSlots shared) {
  __shared__ RouteShared route_sh;
  __shared__ SortShared<kRouteThreads> sort_sh;
  __shared__ bool is_last;
  const ExpertBias bias = load_expert_bias(correction_bias, num_experts, params);
  ptx::wait_for_prior_grids();  // launched early (programmatic): inputs may not be ready yet
  ptx::allow_dependent_launch();
  route_token(route_sh, router_logits, bias, num_experts, params, blockIdx.x, topk_ids,
              topk_weights, error_flags, shared);
  // The sort sees the shared chunks as experts num_experts.., one more slot
  // per token each.
  const int rows = params.top_k + shared.num_shared;
  const int sorted_experts = num_experts + shared.num_shared;
  if (gridDim.x == 1) {  // route_token synchronised the block after filling route_sh.chosen
    sort_one_token(route_sh.chosen, rows, sorted_experts, expert_offsets, token_of_row, pair_of_row, error_flags);
    return;
  }
  // NOTE: the classic threadfence reduction: each writer fences its ids
  // before the block's arrival is counted, so the last block sees them all.
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) is_last = atomicAdd(arrivals, 1) == static_cast<int>(gridDim.x) - 1;
  __syncthreads();
  if (!is_last) return;
  __threadfence();
  if (threadIdx.x == 0) *arrivals = 0;
  sort_pairs_in_block<kRouteThreads>(
      sort_sh, topk_ids, static_cast<int64_t>(gridDim.x) * rows, rows, sorted_experts, expert_offsets,
      token_of_row, pair_of_row, error_flags);
}

// ------------------------------------------------------- gather, finalize

// Four bf16, stored with one 8-byte store.
struct alignas(8) Bf16x4 {
  __nv_bfloat162 lo, hi;
};

__device__ __forceinline__ Bf16x4 to_bf16x4(float4 v) {
  return Bf16x4{__floats2bfloat162_rn(v.x, v.y), __floats2bfloat162_rn(v.z, v.w)};
}

__global__ void gather_rows_kernel(const uint4* __restrict__ x,                // [tokens, vectors_per_row]
                                   const int32_t* __restrict__ token_of_row,   // [num_rows]
                                   const int32_t* __restrict__ expert_offsets, // [num_experts + 1]
                                   int num_experts, int64_t num_rows, int64_t vectors_per_row,
                                   uint4* __restrict__ x_sorted) {             // [num_rows, vectors_per_row]
  ptx::wait_for_prior_grids();  // launched early (programmatic): inputs may not be ready yet
  ptx::allow_dependent_launch();
  const int64_t placed_rows = min(num_rows, static_cast<int64_t>(expert_offsets[num_experts]));
  const int64_t num_vectors = placed_rows * vectors_per_row;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < num_vectors;
       i += stride) {
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
    gather_rows_fp4_kernel(const uint4* __restrict__ x,                // [tokens, 2 * blocks_per_row]
                           const int32_t* __restrict__ token_of_row,   // [num_rows]
                           const int32_t* __restrict__ expert_offsets, // [num_experts + 1]
                           int num_experts, int64_t num_rows, int blocks_per_row,
                           const float* __restrict__ input_scales,     // [num_experts]
                           uint4* __restrict__ x_sorted) {             // [num_rows, 2 * blocks_per_row]
  __shared__ int32_t s_offsets[kMaxExperts + 1];
  ptx::wait_for_prior_grids();  // launched early (programmatic): inputs may not be ready yet
  ptx::allow_dependent_launch();
  for (int e = threadIdx.x; e <= num_experts; e += blockDim.x) s_offsets[e] = expert_offsets[e];
  __syncthreads();
  const int64_t placed_rows = min(num_rows, static_cast<int64_t>(s_offsets[num_experts]));
  const int64_t num_blocks = placed_rows * blocks_per_row;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const bool narrow = num_blocks <= INT32_MAX;  // 32-bit division: a few instructions, 64-bit ~70
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < num_blocks;
       i += stride) {
    const int64_t row = narrow ? int64_t{static_cast<uint32_t>(i) / static_cast<uint32_t>(blocks_per_row)}
                               : i / blocks_per_row;
    const int64_t block = i - row * blocks_per_row;
    const uint4* src = x + (static_cast<int64_t>(token_of_row[row]) * blocks_per_row + block) * 2;
    uint4 first = src[0], second = src[1];
    // The row's expert: rows are sorted by expert, so the last e with
    // offsets[e] <= row (empty experts before it share its offset).
    int lo = 0, hi = num_experts - 1;
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (s_offsets[mid] <= row) lo = mid;
      else hi = mid - 1;
    }
    detail::fp4_quantize_bf16_block(first, second, __ldg(input_scales + lo));
    x_sorted[2 * i] = first;
    x_sorted[2 * i + 1] = second;
  }
}

__global__ void finalize_pairs_kernel(const float4* __restrict__ pair_rows,  // [num_tokens * top_k, vectors_per_row]
                                      const int32_t* __restrict__ topk_ids,  // [num_tokens, top_k] or null
                                      int64_t num_tokens, int top_k, int num_experts,
                                      int64_t vectors_per_row,
                                      Bf16x4* __restrict__ output) {         // [num_tokens, vectors_per_row]
  ptx::wait_for_prior_grids();  // launched early (programmatic): inputs may not be ready yet
  ptx::allow_dependent_launch();
  const int64_t num_vectors = num_tokens * vectors_per_row;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < num_vectors;
       i += stride) {
    const int64_t token = i / vectors_per_row;
    const int64_t column = i - token * vectors_per_row;
    // Slot order, from 0.0f, in fp32: the same bits on every run.
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
      const float4 v = __ldg(pair_rows + (token * top_k + slot) * vectors_per_row + column);
      sum.x += v.x;
      sum.y += v.y;
      sum.z += v.z;
      sum.w += v.w;
    }
    output[i] = to_bf16x4(sum);
  }
}

__global__ void finalize_accumulated_kernel(float4* __restrict__ accum,  // [num_tokens, vectors_per_row]
                                            int64_t num_vectors,
                                            Bf16x4* __restrict__ output) {
  ptx::wait_for_prior_grids();  // launched early (programmatic): inputs may not be ready yet
  ptx::allow_dependent_launch();
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < num_vectors;
       i += stride) {
    const float4 v = accum[i];
    accum[i] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);  // ready for the next forward
    output[i] = to_bf16x4(v);
  }
}

// ------------------------------------------------------ shared experts

constexpr int kSharedSlotThreads = 128;  // one block per token

// Writes a token's rows_per_token = top_k + num_shared slots: its routed
// slots as given (ids outside [0, num_experts) other than kAbsentSlot become
// INT32_MAX, so that the sort, which sees the shared chunks as experts
// num_experts.., still refuses them), then one slot per shared chunk, expert
// num_experts + j, weighted 1 or sigmoid(shared_gate · x) (a dot product in
// fp32, summed per thread, per warp, then over warps in a fixed order).
__global__ void __launch_bounds__(kSharedSlotThreads)
    append_shared_slots_kernel(const int32_t* __restrict__ topk_ids,         // [num_tokens, top_k]
                               const float* __restrict__ topk_weights,       // [num_tokens, top_k]
                               int top_k, int num_experts, int num_shared,
                               const __nv_bfloat16* __restrict__ hidden_states,  // [num_tokens, hidden]
                               const float* __restrict__ shared_gate,        // [hidden] or null
                               int64_t hidden,
                               int32_t* __restrict__ out_ids,                // [num_tokens, top_k + num_shared]
                               float* __restrict__ out_weights) {            // [num_tokens, top_k + num_shared]
  __shared__ float warp_partial[kSharedSlotThreads / 32];
  ptx::wait_for_prior_grids();  // launched early (programmatic): inputs may not be ready yet
  ptx::allow_dependent_launch();
  const int64_t token = blockIdx.x;
  const int tid = static_cast<int>(threadIdx.x);
  const int rows = top_k + num_shared;
  if (tid < top_k) {
    const int32_t id = topk_ids[token * top_k + tid];
    const bool keep = id == kAbsentSlot || static_cast<uint32_t>(id) < static_cast<uint32_t>(num_experts);
    out_ids[token * rows + tid] = keep ? id : INT32_MAX;
    out_weights[token * rows + tid] = topk_weights[token * top_k + tid];
  }
  float weight = 1.0f;
  if (shared_gate != nullptr) {  // block-uniform branch
    float partial = 0.0f;
    const __nv_bfloat16* x = hidden_states + token * hidden;
    for (int64_t h = tid; h < hidden; h += kSharedSlotThreads)
      partial += __bfloat162float(x[h]) * __ldg(shared_gate + h);
    partial = warp_sum(partial);
    if (tid % 32 == 0) warp_partial[tid / 32] = partial;
    __syncthreads();
    float dot = 0.0f;
    for (int w = 0; w < kSharedSlotThreads / 32; ++w) dot += warp_partial[w];  // fixed order
    weight = sigmoid(dot);
  }
  if (tid < num_shared) {
    out_ids[token * rows + top_k + tid] = num_experts + tid;
    out_weights[token * rows + top_k + tid] = weight;
  }
}

// ------------------------------------------------------------------ host

// Grid of a grid-stride elementwise kernel: enough blocks to fill the GPU,
// no more than the work needs.
unsigned elementwise_grid(int64_t num_items) {
  const int64_t needed = (num_items + kElementwiseThreads - 1) / kElementwiseThreads;
  const int64_t resident = static_cast<int64_t>(current_device().num_sms) * kElementwiseBlocksPerSm;
  return static_cast<unsigned>(std::max<int64_t>(1, std::min(needed, resident)));
}

bool aligned_16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

void check_num_experts(const char* op, int64_t num_experts) {
  FP4MOE_CHECK(num_experts >= 1 && num_experts <= kMaxExperts, op, ": num_experts = ", num_experts,
               "; expected in [1, ", kMaxExperts, "]");
}

// The parameter checks of fp4moe::route (src/ref/routing.cpp), plus this
// kernel's limits.
void check_routing_params(int64_t num_tokens, int64_t num_experts, const RoutingParams& p) {
  FP4MOE_CHECK(num_tokens >= 0, "launch_route: num_tokens = ", num_tokens, "; expected >= 0");
  check_num_experts("launch_route", num_experts);
  FP4MOE_CHECK(p.top_k >= 1 && p.top_k <= num_experts, "launch_route: top_k = ", p.top_k,
               "; expected in [1, num_experts = ", num_experts, "]");
  FP4MOE_CHECK(p.top_k <= kMaxTopK, "launch_route: top_k = ", p.top_k, "; expected <= ", kMaxTopK);
  FP4MOE_CHECK(p.mode == RoutingMode::kSoftmaxTopK || p.mode == RoutingMode::kNoauxTc ||
                   p.mode == RoutingMode::kGptOss,
               "launch_route: unknown RoutingMode ", static_cast<int>(p.mode));
  if (p.mode != RoutingMode::kNoauxTc) return;
  FP4MOE_CHECK(p.num_groups >= 1 && num_experts % p.num_groups == 0,
               "launch_route(noaux_tc): num_groups = ", p.num_groups,
               "; expected a positive divisor of num_experts = ", num_experts);
  const int64_t group_size = num_experts / p.num_groups;
  FP4MOE_CHECK(group_size >= 2, "launch_route(noaux_tc): num_groups = ", p.num_groups, " gives ",
               group_size, " expert(s) per group for num_experts = ", num_experts,
               "; expected >= 2 per group (a group scores the sum of its top 2)");
  FP4MOE_CHECK(p.topk_groups >= 1 && p.topk_groups <= p.num_groups,
               "launch_route(noaux_tc): topk_groups = ", p.topk_groups,
               "; expected in [1, num_groups = ", p.num_groups, "]");
  FP4MOE_CHECK(p.topk_groups * group_size >= p.top_k, "launch_route(noaux_tc): topk_groups = ",
               p.topk_groups, " keeps ", p.topk_groups * group_size, " experts (groups of ",
               group_size, "); expected >= top_k = ", p.top_k);
  FP4MOE_CHECK(std::isfinite(p.routed_scaling_factor) && p.routed_scaling_factor > 0.0f,
               "launch_route(noaux_tc): routed_scaling_factor = ", p.routed_scaling_factor,
               "; expected finite and > 0");
}

// The shared slots the routing kernels append: within the kernels' limits,
// and with hidden states to compute a gate from.
void check_shared_slots(const char* op, int64_t num_experts, int top_k, const SharedSlots& shared) {
  if (shared.num_shared == 0) return;
  FP4MOE_CHECK(shared.num_shared > 0 && top_k + shared.num_shared <= kMaxTopK &&
                   num_experts + shared.num_shared <= kMaxExperts,
               op, ": top_k = ", top_k, " with ", shared.num_shared, " shared slots over ", num_experts,
               " experts; expected top_k + shared <= ", kMaxTopK, " and experts + shared <= ", kMaxExperts);
  FP4MOE_CHECK(shared.gate == nullptr || (shared.hidden_states != nullptr && shared.hidden >= 1), op,
               ": a shared expert gate needs hidden_states and hidden >= 1");
}

}  // namespace

void launch_route(const float* router_logits, const float* correction_bias, int64_t num_tokens,
                  int64_t num_experts, const RoutingParams& params, int32_t* topk_ids,
                  float* topk_weights, cudaStream_t stream, bool programmatic,
                  int32_t* error_flags, const SharedSlots& shared) {
  check_routing_params(num_tokens, num_experts, params);
  check_shared_slots("launch_route", num_experts, params.top_k, shared);
  if (num_tokens == 0) return;
  FP4MOE_CHECK(router_logits && topk_ids && topk_weights,
               "launch_route: router_logits, topk_ids and topk_weights must be non-null");
  FP4MOE_CHECK(num_tokens <= INT_MAX, "launch_route: num_tokens = ", num_tokens,
               "; expected <= ", INT_MAX, " (one block per token)");
  launch_kernel(route_kernel, static_cast<unsigned>(num_tokens), kRouteThreads, 0, stream,
                programmatic, router_logits,
                params.mode == RoutingMode::kNoauxTc ? correction_bias : nullptr,
                static_cast<int>(num_experts), params, topk_ids, topk_weights, error_flags, shared);
}

void launch_sort_by_expert(const int32_t* topk_ids, int64_t num_tokens, int top_k,
                           int64_t num_experts, int32_t* expert_offsets, int32_t* token_of_row,
                           int32_t* pair_of_row, int32_t* error_flags, int32_t* sort_scratch,
                           cudaStream_t stream, bool programmatic) {
  FP4MOE_CHECK(num_tokens >= 0, "launch_sort_by_expert: num_tokens = ", num_tokens,
               "; expected >= 0");
  FP4MOE_CHECK(top_k >= 1, "launch_sort_by_expert: top_k = ", top_k, "; expected >= 1");
  check_num_experts("launch_sort_by_expert", num_experts);
  FP4MOE_CHECK(num_tokens <= INT32_MAX / top_k, "launch_sort_by_expert: num_tokens * top_k = ",
               num_tokens, " * ", top_k, "; expected <= ", INT32_MAX, " (rows are int32)");
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
  FP4MOE_CHECK(sort_scratch != nullptr, "launch_sort_by_expert: ", num_pairs, " pairs (more than ",
               kSortChunkPairs, ") need sort_scratch, int32 [sort_scratch_ints(num_pairs, num_experts)]");
  const auto blocks = static_cast<unsigned>((num_pairs + kSortChunkPairs - 1) / kSortChunkPairs);
  launch_kernel(count_pairs_kernel, blocks, kSortThreads, 0, stream, programmatic, topk_ids, num_pairs,
                static_cast<int>(num_experts), sort_scratch, error_flags);
  launch_kernel(place_pairs_kernel, blocks, kSortThreads, 0, stream, programmatic, topk_ids, num_pairs, top_k,
                static_cast<int>(num_experts), static_cast<const int32_t*>(sort_scratch), expert_offsets,
                token_of_row, pair_of_row);
}

void launch_route_and_sort(const float* router_logits, const float* correction_bias,
                           int64_t num_tokens, int64_t num_experts, const RoutingParams& params,
                           int32_t* topk_ids, float* topk_weights, int32_t* expert_offsets,
                           int32_t* token_of_row, int32_t* pair_of_row, int32_t* error_flags,
                           int32_t* arrivals, int32_t* sort_scratch, cudaStream_t stream, bool programmatic,
                           const SharedSlots& shared) {
  check_routing_params(num_tokens, num_experts, params);
  check_shared_slots("launch_route_and_sort", num_experts, params.top_k, shared);
  const int rows = params.top_k + shared.num_shared;
  if (num_tokens * rows > kFusedSortMaxPairs) {
    launch_route(router_logits, correction_bias, num_tokens, num_experts, params, topk_ids,
                 topk_weights, stream, programmatic, error_flags, shared);
    launch_sort_by_expert(topk_ids, num_tokens, rows, num_experts + shared.num_shared, expert_offsets,
                          token_of_row, pair_of_row, error_flags, sort_scratch, stream, programmatic);
    return;
  }
  if (num_tokens == 0) return;
  FP4MOE_CHECK(router_logits && topk_ids && topk_weights && expert_offsets && token_of_row &&
                   pair_of_row && error_flags && arrivals,
               "launch_route_and_sort: router_logits, topk_ids, topk_weights, expert_offsets, "
               "token_of_row, pair_of_row, error_flags and arrivals must be non-null");
  launch_kernel(route_and_sort_kernel, static_cast<unsigned>(num_tokens), kRouteThreads, 0, stream,
                programmatic, router_logits,
                params.mode == RoutingMode::kNoauxTc ? correction_bias : nullptr,
                static_cast<int>(num_experts), params, topk_ids, topk_weights, expert_offsets,
                token_of_row, pair_of_row, error_flags, arrivals, shared);
}

void launch_append_shared_slots(const int32_t* topk_ids, const float* topk_weights, int64_t num_tokens, int top_k,
                                int64_t num_experts, int num_shared, const void* hidden_states,
                                const float* shared_gate, int64_t hidden, int32_t* out_ids, float* out_weights,
                                cudaStream_t stream, bool programmatic) {
  FP4MOE_CHECK(num_tokens >= 0 && num_tokens <= INT_MAX, "launch_append_shared_slots: num_tokens = ", num_tokens,
               "; expected in [0, ", INT_MAX, "]");
  FP4MOE_CHECK(top_k >= 1 && num_shared >= 1 && top_k + num_shared <= kMaxTopK,
               "launch_append_shared_slots: top_k = ", top_k, ", num_shared = ", num_shared,
               "; expected both >= 1 and top_k + num_shared <= ", kMaxTopK);
  FP4MOE_CHECK(num_shared <= kSharedSlotThreads, "launch_append_shared_slots: num_shared = ", num_shared,
               "; expected <= ", kSharedSlotThreads);
  check_num_experts("launch_append_shared_slots", num_experts + num_shared);
  FP4MOE_CHECK(hidden >= 1, "launch_append_shared_slots: hidden = ", hidden, "; expected >= 1");
  if (num_tokens == 0) return;
  FP4MOE_CHECK(topk_ids && topk_weights && out_ids && out_weights && (!shared_gate || hidden_states),
               "launch_append_shared_slots: topk_ids, topk_weights, out_ids, out_weights (and hidden_states "
               "with a shared gate) must be non-null");
  launch_kernel(append_shared_slots_kernel, static_cast<unsigned>(num_tokens), kSharedSlotThreads, 0, stream,
                programmatic, topk_ids, topk_weights, top_k, static_cast<int>(num_experts), num_shared,
                static_cast<const __nv_bfloat16*>(hidden_states), shared_gate, hidden, out_ids, out_weights);
}

void launch_gather_rows(const void* x, const int32_t* token_of_row, const int32_t* expert_offsets,
                        int64_t num_experts, int64_t num_rows, int64_t hidden, void* x_sorted,
                        cudaStream_t stream, bool programmatic) {
  FP4MOE_CHECK(num_rows >= 0 && num_rows <= INT32_MAX, "launch_gather_rows: num_rows = ", num_rows,
               "; expected in [0, ", INT32_MAX, "]");
  FP4MOE_CHECK(num_experts >= 1 && num_experts <= INT32_MAX - 1, "launch_gather_rows: num_experts = ",
               num_experts, "; expected >= 1");
  FP4MOE_CHECK(hidden >= 8 && hidden % 8 == 0, "launch_gather_rows: hidden = ", hidden,
               "; expected a positive multiple of 8 (16-byte bf16 vectors)");
  if (num_rows == 0) return;
  FP4MOE_CHECK(x && token_of_row && expert_offsets && x_sorted,
               "launch_gather_rows: x, token_of_row, expert_offsets and x_sorted must be non-null");
  FP4MOE_CHECK(aligned_16(x) && aligned_16(x_sorted),
               "launch_gather_rows: x and x_sorted must be 16-byte aligned");
  const int64_t vectors_per_row = hidden / 8;
  launch_kernel(gather_rows_kernel, elementwise_grid(num_rows * vectors_per_row),
                kElementwiseThreads, 0, stream, programmatic, static_cast<const uint4*>(x),
                token_of_row, expert_offsets, static_cast<int>(num_experts), num_rows,
                vectors_per_row, static_cast<uint4*>(x_sorted));
}

void launch_gather_rows_fp4(const void* x, const int32_t* token_of_row, const int32_t* expert_offsets,
                            int64_t num_experts, int64_t num_rows, int64_t hidden, const float* input_scales,
                            void* x_sorted, cudaStream_t stream, bool programmatic) {
  FP4MOE_CHECK(num_rows >= 0 && num_rows <= INT32_MAX, "launch_gather_rows_fp4: num_rows = ", num_rows,
               "; expected in [0, ", INT32_MAX, "]");
  check_num_experts("launch_gather_rows_fp4", num_experts);
  FP4MOE_CHECK(hidden >= 16 && hidden % 16 == 0 && hidden / 16 <= INT32_MAX, "launch_gather_rows_fp4: hidden = ",
               hidden, "; expected a positive multiple of 16 (the NVFP4 block)");
  if (num_rows == 0) return;
  FP4MOE_CHECK(x && token_of_row && expert_offsets && input_scales && x_sorted,
               "launch_gather_rows_fp4: x, token_of_row, expert_offsets, input_scales and x_sorted must be "
               "non-null");
  FP4MOE_CHECK(aligned_16(x) && aligned_16(x_sorted),
               "launch_gather_rows_fp4: x and x_sorted must be 16-byte aligned");
  const int64_t blocks_per_row = hidden / 16;
  launch_kernel(gather_rows_fp4_kernel, elementwise_grid(num_rows * blocks_per_row),
                kElementwiseThreads, 0, stream, programmatic, static_cast<const uint4*>(x),
                token_of_row, expert_offsets, static_cast<int>(num_experts), num_rows,
                static_cast<int>(blocks_per_row), input_scales, static_cast<uint4*>(x_sorted));
}

void launch_finalize_pairs(const float* pair_rows, const int32_t* topk_ids, int64_t num_tokens,
                           int top_k, int64_t num_experts, int64_t hidden, void* output,
                           cudaStream_t stream, bool programmatic) {
  FP4MOE_CHECK(num_tokens >= 0, "launch_finalize_pairs: num_tokens = ", num_tokens,
               "; expected >= 0");
  FP4MOE_CHECK(top_k >= 1 && top_k <= kMaxTopK, "launch_finalize_pairs: top_k = ", top_k,
               "; expected in [1, ", kMaxTopK, "]");
  FP4MOE_CHECK(num_experts >= 1 && num_experts <= INT32_MAX, "launch_finalize_pairs: num_experts = ",
               num_experts, "; expected >= 1");
  FP4MOE_CHECK(hidden >= 4 && hidden % 4 == 0, "launch_finalize_pairs: hidden = ", hidden,
               "; expected a positive multiple of 4 (float4 loads)");
  if (num_tokens == 0) return;
  FP4MOE_CHECK(pair_rows && output, "launch_finalize_pairs: pair_rows and output must be non-null");
  FP4MOE_CHECK(aligned_16(pair_rows) && aligned_16(output),
               "launch_finalize_pairs: pair_rows and output must be 16-byte aligned");
  const int64_t vectors_per_row = hidden / 4;
  launch_kernel(finalize_pairs_kernel, elementwise_grid(num_tokens * vectors_per_row),
                kElementwiseThreads, 0, stream, programmatic,
                reinterpret_cast<const float4*>(pair_rows), topk_ids, num_tokens, top_k,
                static_cast<int>(num_experts), vectors_per_row, static_cast<Bf16x4*>(output));
}

void launch_finalize_accumulated(float* accum, int64_t num_tokens, int64_t hidden, void* output,
                                 cudaStream_t stream, bool programmatic) {
  FP4MOE_CHECK(num_tokens >= 0, "launch_finalize_accumulated: num_tokens = ", num_tokens,
               "; expected >= 0");
  FP4MOE_CHECK(hidden >= 4 && hidden % 4 == 0, "launch_finalize_accumulated: hidden = ", hidden,
               "; expected a positive multiple of 4 (float4 loads)");
  if (num_tokens == 0) return;
  FP4MOE_CHECK(accum && output, "launch_finalize_accumulated: accum and output must be non-null");
  FP4MOE_CHECK(aligned_16(accum) && aligned_16(output),
               "launch_finalize_accumulated: accum and output must be 16-byte aligned");
  const int64_t num_vectors = num_tokens * (hidden / 4);
  launch_kernel(finalize_accumulated_kernel, elementwise_grid(num_vectors), kElementwiseThreads, 0,
                stream, programmatic, reinterpret_cast<float4*>(accum), num_vectors,
                static_cast<Bf16x4*>(output));
}

}  // namespace fp4moe::kernels
