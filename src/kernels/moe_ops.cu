// The small kernels around the two grouped GEMMs of an MoE layer and their
// host launchers (the contract is in moe_ops.hpp): routing (one warp per
// token), the counting sort of (token, slot) pairs by expert (one block),
// the bf16 row gather and the finalize reduction to bf16.
//
// Tested in tests/kernels/test_moe_ops.cpp: routing against the CPU reference
// fp4moe::route() for every mode, expert count, top-k and token count (and
// with many exact ties), the sort, gather and finalize against host loops with
// poisoned outputs, and a CUDA-graph capture of the sequence.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <climits>
#include <cmath>
#include <cstdint>

#include "fp4moe/cuda_check.hpp"
#include "fp4moe/error.hpp"
#include "kernels/moe_ops.hpp"

namespace fp4moe::kernels {
namespace {

constexpr unsigned kFullWarp = 0xFFFFFFFFu;
constexpr int kMaxExperts = 512;                    // routing scores held in registers, sort histogram in smem
constexpr int kExpertsPerLane = kMaxExperts / 32;   // routing: expert i * 32 + lane in register slot i
constexpr int kMaxGroups = kMaxExperts / 2;         // noaux_tc groups hold >= 2 experts
constexpr int kGroupsPerLane = kMaxGroups / 32;     // noaux_tc: group i * 32 + lane is candidate bit i
constexpr int kRouteWarpsPerBlock = 4;              // one token per warp
constexpr int kSortThreads = 1024;                  // the sort is one block
constexpr int kElementwiseThreads = 256;            // gather and finalize
constexpr int kElementwiseBlocksPerSm = 8;          // 2048 resident threads per SM: enough to saturate HBM
constexpr int kNoCandidate = INT_MAX;               // index of "no candidate left" in a selection

static_assert(kMaxExperts % 32 == 0 && kExpertsPerLane <= 32, "candidate masks are 32-bit");
static_assert(kMaxGroups % 32 == 0 && kGroupsPerLane <= 32, "group masks are 32-bit");
static_assert(kMaxTopK <= 32, "lane j holds the j-th chosen expert");
static_assert(kMaxExperts <= kSortThreads, "the sort scans one expert per thread");

// ------------------------------------------------------------------ routing

// One candidate of a selection: a score and the expert (or group) index.
struct Candidate {
  float score;
  int index;
};

// The tie rule of fp4moe::route: higher score first, equal scores by lower
// index. "No candidate" ranks last, so ids stay in range and distinct even
// where a NaN logit breaks the order of scores.
__device__ __forceinline__ bool ranks_higher(Candidate a, Candidate b) {
  if (a.index == kNoCandidate) return false;
  if (b.index == kNoCandidate) return true;
  return a.score > b.score || (a.score == b.score && a.index < b.index);
}

// The best candidate of the warp, the same on every lane.
__device__ __forceinline__ Candidate warp_best(Candidate c) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) {
    const Candidate other{__shfl_xor_sync(kFullWarp, c.score, offset),
                          __shfl_xor_sync(kFullWarp, c.index, offset)};
    if (ranks_higher(other, c)) c = other;
  }
  // With a total order every lane already agrees; NaN scores break it, so
  // lane 0's result is the one everybody uses.
  c.score = __shfl_sync(kFullWarp, c.score, 0);
  c.index = __shfl_sync(kFullWarp, c.index, 0);
  return c;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) v += __shfl_xor_sync(kFullWarp, v, offset);
  return v;  // xor butterfly: every lane adds the same pairs, so all get the same bits
}

// The lane's best expert among the candidate bits of its register slots.
// Slots are visited in ascending expert order, so ranks_higher keeps the
// lowest index among equal scores.
__device__ __forceinline__ Candidate lane_best_expert(const float (&score)[kExpertsPerLane],
                                                      uint32_t candidates, int lane) {
  Candidate best{0.0f, kNoCandidate};
#pragma unroll
  for (int i = 0; i < kExpertsPerLane; ++i) {
    const Candidate c{score[i], i * 32 + lane};
    if (((candidates >> i) & 1u) && ranks_higher(c, best)) best = c;
  }
  return best;
}

// Selects the top_k best experts in rank order; lane j < top_k returns the
// j-th. Only the winner's lane rescans its registers after each round.
__device__ __forceinline__ Candidate select_top_experts(const float (&score)[kExpertsPerLane],
                                                       uint32_t candidates, int top_k, int lane) {
  Candidate mine{0.0f, kNoCandidate};
  Candidate best = lane_best_expert(score, candidates, lane);
  for (int j = 0; j < top_k; ++j) {
    const Candidate winner = warp_best(best);
    if (lane == j) mine = winner;
    if ((winner.index & 31) == lane) {
      candidates &= ~(1u << (winner.index >> 5));
      best = lane_best_expert(score, candidates, lane);
    }
  }
  return mine;
}

// Per-warp scratch of noaux_tc's group selection (experts of one group are
// spread over lanes, so their scores go through shared memory).
struct RouteWarpStorage {
  float choice[kMaxExperts];      // c = sigmoid(logit) + bias
  float group_score[kMaxGroups];  // sum of the group's two largest c
  uint8_t group_kept[kMaxGroups];
};

// noaux_tc: keeps the topk_groups best groups and clears the candidate bits
// of experts in the others. Group g holds experts [g * group_size, (g + 1) * group_size).
__device__ __forceinline__ uint32_t keep_best_groups(const float (&choice)[kExpertsPerLane],
                                                     uint32_t candidates, int num_experts,
                                                     int num_groups, int topk_groups,
                                                     RouteWarpStorage& storage, int lane) {
  const int group_size = num_experts / num_groups;
#pragma unroll
  for (int i = 0; i < kExpertsPerLane; ++i)
    if (i * 32 + lane < num_experts) storage.choice[i * 32 + lane] = choice[i];
  __syncwarp();

  // Group scores: each group is scanned by lanes_per_group lanes (a power of
  // two), whose top-2 pairs are then merged with shuffles.
  const int lanes_per_group = num_groups >= 32 ? 1 : 1 << (31 - __clz(32 / num_groups));
  const int groups_per_round = 32 / lanes_per_group;
  for (int first_group = 0; first_group < num_groups; first_group += groups_per_round) {
    const int group = first_group + lane / lanes_per_group;
    const int part = lane % lanes_per_group;
    float top1 = -INFINITY, top2 = -INFINITY;
    if (group < num_groups) {
      for (int m = part; m < group_size; m += lanes_per_group) {
        const float v = storage.choice[group * group_size + m];
        top2 = fmaxf(top2, fminf(top1, v));
        top1 = fmaxf(top1, v);
      }
    }
    for (int offset = lanes_per_group / 2; offset > 0; offset /= 2) {
      const float other1 = __shfl_xor_sync(kFullWarp, top1, offset);
      const float other2 = __shfl_xor_sync(kFullWarp, top2, offset);
      top2 = fmaxf(fminf(top1, other1), fmaxf(top2, other2));
      top1 = fmaxf(top1, other1);
    }
    if (group < num_groups && part == 0) storage.group_score[group] = top1 + top2;
  }
  __syncwarp();

  // topk_groups rounds of a warp argmax over the group scores (same tie rule).
  uint32_t group_candidates = 0;
#pragma unroll
  for (int i = 0; i < kGroupsPerLane; ++i)
    if (i * 32 + lane < num_groups) group_candidates |= 1u << i;
  const uint32_t all_groups = group_candidates;
  for (int round = 0; round < topk_groups; ++round) {
    Candidate best{0.0f, kNoCandidate};
#pragma unroll
    for (int i = 0; i < kGroupsPerLane; ++i) {
      const int group = i * 32 + lane;
      if ((group_candidates >> i) & 1u) {
        const Candidate c{storage.group_score[group], group};
        if (ranks_higher(c, best)) best = c;
      }
    }
    const Candidate winner = warp_best(best);
    if ((winner.index & 31) == lane) group_candidates &= ~(1u << (winner.index >> 5));
  }
  const uint32_t kept = all_groups & ~group_candidates;
#pragma unroll
  for (int i = 0; i < kGroupsPerLane; ++i)
    if (i * 32 + lane < num_groups) storage.group_kept[i * 32 + lane] = (kept >> i) & 1u;
  __syncwarp();

#pragma unroll
  for (int i = 0; i < kExpertsPerLane; ++i) {
    const int expert = i * 32 + lane;
    if (expert < num_experts && !storage.group_kept[expert / group_size]) candidates &= ~(1u << i);
  }
  return candidates;
}

__device__ __forceinline__ float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

// One warp per token. Expert e lives in register slot e / 32 of lane e % 32,
// so the logits are read with coalesced loads. Non-finite logits are not
// checked here (route() refuses them on the CPU; a check would cost a pass):
// +-inf still rank consistently, NaN gives an unspecified choice, but ids are
// always in range and distinct, so the sort downstream stays safe; weights
// may then be NaN.
__global__ void __launch_bounds__(kRouteWarpsPerBlock * 32)
    route_kernel(const float* __restrict__ router_logits,    // [num_tokens, num_experts]
                 const float* __restrict__ correction_bias,  // [num_experts] or null (noaux_tc)
                 int64_t num_tokens, int num_experts, RoutingParams params,
                 int32_t* __restrict__ topk_ids,      // [num_tokens, top_k]
                 float* __restrict__ topk_weights) {  // [num_tokens, top_k]
  __shared__ RouteWarpStorage storage[kRouteWarpsPerBlock];
  const int warp = static_cast<int>(threadIdx.x) / 32;
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const int64_t token = static_cast<int64_t>(blockIdx.x) * kRouteWarpsPerBlock + warp;
  if (token >= num_tokens) return;  // warp-uniform
  const float* logits = router_logits + token * num_experts;
  const int top_k = params.top_k;

  float score[kExpertsPerLane];  // the selection key: the logit, or c for noaux_tc
  uint32_t candidates = 0;
#pragma unroll
  for (int i = 0; i < kExpertsPerLane; ++i) {
    const int expert = i * 32 + lane;
    score[i] = 0.0f;
    if (expert < num_experts) {
      score[i] = logits[expert];
      candidates |= 1u << i;
    }
  }

  float weight = 0.0f;
  Candidate mine{0.0f, kNoCandidate};
  if (params.mode == RoutingMode::kNoauxTc) {
#pragma unroll
    for (int i = 0; i < kExpertsPerLane; ++i) {
      const int expert = i * 32 + lane;
      if (expert < num_experts)
        score[i] = sigmoid(score[i]) + (correction_bias ? correction_bias[expert] : 0.0f);
    }
    if (params.topk_groups < params.num_groups)
      candidates = keep_best_groups(score, candidates, num_experts, params.num_groups,
                                    params.topk_groups, storage[warp], lane);
    mine = select_top_experts(score, candidates, top_k, lane);
    // The weight uses the unbiased score, recomputed from the logit exactly
    // as above (same fp32 operations, same bits).
    const float unbiased = lane < top_k ? sigmoid(logits[mine.index]) : 0.0f;
    const float chosen_sum = warp_sum(unbiased);
    weight = unbiased / (chosen_sum + 1e-20f) * params.routed_scaling_factor;
  } else {
    // softmax and exp are monotone: select on the logits themselves.
    mine = select_top_experts(score, candidates, top_k, lane);
    const float max_logit = __shfl_sync(kFullWarp, mine.score, 0);  // lane 0 holds the top-1
    const float numerator = lane < top_k ? expf(mine.score - max_logit) : 0.0f;
    float denominator = warp_sum(numerator);
    if (params.mode == RoutingMode::kSoftmaxTopK && !params.renormalize) {
      float partial = 0.0f;
#pragma unroll
      for (int i = 0; i < kExpertsPerLane; ++i)
        if (i * 32 + lane < num_experts) partial += expf(score[i] - max_logit);
      denominator = warp_sum(partial);
    }
    weight = numerator / denominator;
  }
  if (lane < top_k) {
    topk_ids[token * top_k + lane] = mine.index;
    topk_weights[token * top_k + lane] = weight;
  }
}

// ------------------------------------------------------------------- sort

// Calls fn(pair, expert_id, valid) for every pair, in warp-uniform chunks of
// 32 consecutive pairs so that every lane of a warp reaches the warp
// intrinsics inside fn together (lanes past the end pass valid = false).
template <typename Fn>
__device__ __forceinline__ void for_each_pair(const int32_t* __restrict__ topk_ids,
                                              int64_t num_pairs, int num_experts, Fn&& fn) {
  const int warp = static_cast<int>(threadIdx.x) / 32;
  const int lane = static_cast<int>(threadIdx.x) % 32;
  for (int64_t chunk = static_cast<int64_t>(warp) * 32; chunk < num_pairs; chunk += kSortThreads) {
    const int64_t pair = chunk + lane;
    const bool in_range = pair < num_pairs;
    const int32_t id = in_range ? __ldg(topk_ids + pair) : -1;
    const bool valid = in_range && static_cast<uint32_t>(id) < static_cast<uint32_t>(num_experts);
    fn(pair, id, in_range, valid);
  }
}

// Counting sort in one block: a shared-memory histogram, an exclusive scan
// over experts (written to expert_offsets every launch, so nothing needs a
// memset), then placement. Lanes of a warp with the same expert are grouped
// with __match_any_sync so each group costs one shared atomic: routing that
// sends every token to one expert does not serialise 32-fold.
__global__ void __launch_bounds__(kSortThreads)
    sort_by_expert_kernel(const int32_t* __restrict__ topk_ids,  // [num_pairs]
                          int64_t num_pairs, int top_k, int num_experts,
                          int32_t* __restrict__ expert_offsets,  // [num_experts + 1]
                          int32_t* __restrict__ token_of_row,    // [num_pairs]
                          int32_t* __restrict__ pair_of_row,     // [num_pairs]
                          int32_t* __restrict__ error_flags) {
  __shared__ int expert_cursor[kMaxExperts];  // counts, then each expert's next free row
  __shared__ int warp_totals[kSortThreads / 32];
  const int tid = static_cast<int>(threadIdx.x);
  const int warp = tid / 32;
  const int lane = tid % 32;
  const unsigned lanes_below = (1u << lane) - 1u;

  for (int e = tid; e < num_experts; e += kSortThreads) expert_cursor[e] = 0;
  __syncthreads();

  bool saw_invalid = false;
  for_each_pair(topk_ids, num_pairs, num_experts,
                [&](int64_t, int32_t id, bool in_range, bool valid) {
                  saw_invalid |= in_range && !valid;
                  const unsigned valid_lanes = __ballot_sync(kFullWarp, valid);
                  if (valid) {
                    const unsigned peers = __match_any_sync(valid_lanes, id);
                    if (lane == __ffs(peers) - 1) atomicAdd(&expert_cursor[id], __popc(peers));
                  }
                });
  if (__syncthreads_or(saw_invalid) && tid == 0) atomicOr(error_flags, kErrorExpertIdOutOfRange);

  // Exclusive scan of the counts: warp scans, then a scan of the warp totals.
  const int count = tid < num_experts ? expert_cursor[tid] : 0;
  int inclusive = count;
#pragma unroll
  for (int d = 1; d < 32; d *= 2) {
    const int below = __shfl_up_sync(kFullWarp, inclusive, d);
    if (lane >= d) inclusive += below;
  }
  if (lane == 31) warp_totals[warp] = inclusive;
  __syncthreads();
  if (warp == 0) {
    const int total = warp_totals[lane];
    int warp_inclusive = total;
#pragma unroll
    for (int d = 1; d < 32; d *= 2) {
      const int below = __shfl_up_sync(kFullWarp, warp_inclusive, d);
      if (lane >= d) warp_inclusive += below;
    }
    warp_totals[lane] = warp_inclusive - total;
  }
  __syncthreads();
  if (tid < num_experts) {
    const int start = warp_totals[warp] + inclusive - count;
    expert_offsets[tid] = start;
    expert_cursor[tid] = start;
    if (tid == num_experts - 1) expert_offsets[num_experts] = start + count;
  }
  __syncthreads();

  for_each_pair(topk_ids, num_pairs, num_experts,
                [&](int64_t pair, int32_t id, bool, bool valid) {
                  const unsigned valid_lanes = __ballot_sync(kFullWarp, valid);
                  if (!valid) return;
                  const unsigned peers = __match_any_sync(valid_lanes, id);
                  const int leader = __ffs(peers) - 1;
                  int first_row = 0;
                  if (lane == leader) first_row = atomicAdd(&expert_cursor[id], __popc(peers));
                  const int row = __shfl_sync(peers, first_row, leader) + __popc(peers & lanes_below);
                  token_of_row[row] = static_cast<int32_t>(pair / top_k);
                  pair_of_row[row] = static_cast<int32_t>(pair);
                });
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

__global__ void finalize_pairs_kernel(const float4* __restrict__ pair_rows,  // [num_tokens * top_k, vectors_per_row]
                                      const int32_t* __restrict__ topk_ids,  // [num_tokens, top_k]
                                      int64_t num_tokens, int top_k, int num_experts,
                                      int64_t vectors_per_row,
                                      Bf16x4* __restrict__ output) {         // [num_tokens, vectors_per_row]
  const int64_t num_vectors = num_tokens * vectors_per_row;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < num_vectors;
       i += stride) {
    const int64_t token = i / vectors_per_row;
    const int64_t column = i - token * vectors_per_row;
    // Slot order, from 0.0f, in fp32: the same bits on every run.
    float4 sum = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    for (int slot = 0; slot < top_k; ++slot) {
      const int64_t pair = token * top_k + slot;
      const int32_t id = __ldg(topk_ids + pair);
      if (static_cast<uint32_t>(id) >= static_cast<uint32_t>(num_experts)) continue;  // never written
      const float4 v = pair_rows[pair * vectors_per_row + column];
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
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < num_vectors;
       i += stride) {
    const float4 v = accum[i];
    accum[i] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);  // ready for the next forward
    output[i] = to_bf16x4(v);
  }
}

// ------------------------------------------------------------------ host

// Multiprocessor count of the current device, looked up once per device: the
// launch path must not query the driver every call.
int current_device_num_sms() {
  constexpr int kMaxCachedDevices = 64;
  static std::array<std::atomic<int>, kMaxCachedDevices> cache{};  // 0: not looked up yet
  int device = 0;
  FP4MOE_CUDA_CHECK(cudaGetDevice(&device));
  if (device < kMaxCachedDevices) {
    const int cached = cache[device].load(std::memory_order_relaxed);
    if (cached > 0) return cached;
  }
  int num_sms = 0;
  FP4MOE_CUDA_CHECK(cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, device));
  if (device < kMaxCachedDevices) cache[device].store(num_sms, std::memory_order_relaxed);
  return num_sms;
}

// Grid of a grid-stride elementwise kernel: enough blocks to fill the GPU,
// no more than the work needs.
unsigned elementwise_grid(int64_t num_items) {
  const int64_t needed = (num_items + kElementwiseThreads - 1) / kElementwiseThreads;
  const int64_t resident = static_cast<int64_t>(current_device_num_sms()) * kElementwiseBlocksPerSm;
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

}  // namespace

void launch_route(const float* router_logits, const float* correction_bias, int64_t num_tokens,
                  int64_t num_experts, const RoutingParams& params, int32_t* topk_ids,
                  float* topk_weights, cudaStream_t stream) {
  check_routing_params(num_tokens, num_experts, params);
  if (num_tokens == 0) return;
  FP4MOE_CHECK(router_logits && topk_ids && topk_weights,
               "launch_route: router_logits, topk_ids and topk_weights must be non-null");
  const int64_t num_blocks = (num_tokens + kRouteWarpsPerBlock - 1) / kRouteWarpsPerBlock;
  FP4MOE_CHECK(num_blocks <= INT_MAX, "launch_route: num_tokens = ", num_tokens,
               "; expected <= ", static_cast<int64_t>(INT_MAX) * kRouteWarpsPerBlock);
  route_kernel<<<static_cast<unsigned>(num_blocks), kRouteWarpsPerBlock * 32, 0, stream>>>(
      router_logits, params.mode == RoutingMode::kNoauxTc ? correction_bias : nullptr, num_tokens,
      static_cast<int>(num_experts), params, topk_ids, topk_weights);
  FP4MOE_CHECK_LAUNCH();
}

void launch_sort_by_expert(const int32_t* topk_ids, int64_t num_tokens, int top_k,
                           int64_t num_experts, int32_t* expert_offsets, int32_t* token_of_row,
                           int32_t* pair_of_row, int32_t* error_flags, cudaStream_t stream) {
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
  sort_by_expert_kernel<<<1, kSortThreads, 0, stream>>>(
      topk_ids, num_tokens * top_k, top_k, static_cast<int>(num_experts), expert_offsets,
      token_of_row, pair_of_row, error_flags);
  FP4MOE_CHECK_LAUNCH();
}

void launch_gather_rows(const void* x, const int32_t* token_of_row, const int32_t* expert_offsets,
                        int64_t num_experts, int64_t num_rows, int64_t hidden, void* x_sorted,
                        cudaStream_t stream) {
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
  gather_rows_kernel<<<elementwise_grid(num_rows * vectors_per_row), kElementwiseThreads, 0, stream>>>(
      static_cast<const uint4*>(x), token_of_row, expert_offsets, static_cast<int>(num_experts),
      num_rows, vectors_per_row, static_cast<uint4*>(x_sorted));
  FP4MOE_CHECK_LAUNCH();
}

void launch_finalize_pairs(const float* pair_rows, const int32_t* topk_ids, int64_t num_tokens,
                           int top_k, int64_t num_experts, int64_t hidden, void* output,
                           cudaStream_t stream) {
  FP4MOE_CHECK(num_tokens >= 0, "launch_finalize_pairs: num_tokens = ", num_tokens,
               "; expected >= 0");
  FP4MOE_CHECK(top_k >= 1 && top_k <= kMaxTopK, "launch_finalize_pairs: top_k = ", top_k,
               "; expected in [1, ", kMaxTopK, "]");
  FP4MOE_CHECK(num_experts >= 1 && num_experts <= INT32_MAX, "launch_finalize_pairs: num_experts = ",
               num_experts, "; expected >= 1");
  FP4MOE_CHECK(hidden >= 4 && hidden % 4 == 0, "launch_finalize_pairs: hidden = ", hidden,
               "; expected a positive multiple of 4 (float4 loads)");
  if (num_tokens == 0) return;
  FP4MOE_CHECK(pair_rows && topk_ids && output,
               "launch_finalize_pairs: pair_rows, topk_ids and output must be non-null");
  FP4MOE_CHECK(aligned_16(pair_rows) && aligned_16(output),
               "launch_finalize_pairs: pair_rows and output must be 16-byte aligned");
  const int64_t vectors_per_row = hidden / 4;
  finalize_pairs_kernel<<<elementwise_grid(num_tokens * vectors_per_row), kElementwiseThreads, 0,
                          stream>>>(reinterpret_cast<const float4*>(pair_rows), topk_ids,
                                    num_tokens, top_k, static_cast<int>(num_experts),
                                    vectors_per_row, static_cast<Bf16x4*>(output));
  FP4MOE_CHECK_LAUNCH();
}

void launch_finalize_accumulated(float* accum, int64_t num_tokens, int64_t hidden, void* output,
                                 cudaStream_t stream) {
  FP4MOE_CHECK(num_tokens >= 0, "launch_finalize_accumulated: num_tokens = ", num_tokens,
               "; expected >= 0");
  FP4MOE_CHECK(hidden >= 4 && hidden % 4 == 0, "launch_finalize_accumulated: hidden = ", hidden,
               "; expected a positive multiple of 4 (float4 loads)");
  if (num_tokens == 0) return;
  FP4MOE_CHECK(accum && output, "launch_finalize_accumulated: accum and output must be non-null");
  FP4MOE_CHECK(aligned_16(accum) && aligned_16(output),
               "launch_finalize_accumulated: accum and output must be 16-byte aligned");
  const int64_t num_vectors = num_tokens * (hidden / 4);
  finalize_accumulated_kernel<<<elementwise_grid(num_vectors), kElementwiseThreads, 0, stream>>>(
      reinterpret_cast<float4*>(accum), num_vectors, static_cast<Bf16x4*>(output));
  FP4MOE_CHECK_LAUNCH();
}

}  // namespace fp4moe::kernels
