// The routing of one token by one block (device code): every expert's
// selection key in shared memory, experts ranked in parallel, then the
// chosen experts' weights. route_kernel and route_and_sort_kernel
// (routing.cu) run it; the contract is launch_route's in moe_ops.hpp.
// Tested in tests/kernels/ops/test_routing.cpp against fp4moe::route().
#pragma once

#include <cuda_bf16.h>

#include <cmath>
#include <cstdint>

#include "kernels/ops/common.cuh"

namespace fp4moe::kernels {

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
  int chosen[kMaxTopK];  // expert of rank j, then the shared chunks' experts
  float partial[kRouteThreads / 32];
  float gate_partial[kRouteThreads / 32];  // the shared expert's gate dot product, per warp
};

__device__ __forceinline__ float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

// Whether (key a, index ia) ranks before (key b, index ib).
__device__ __forceinline__ bool ranks_before(float a, int ia, float b, int ib) { return a > b || (a == b && ia < ib); }

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
inline __device__ void route_token(RouteShared& sh,
                                   const float* __restrict__ router_logits,  // [num_tokens, num_experts]
                                   const ExpertBias& bias,                   // load_expert_bias()
                                   int num_experts, const RoutingParams& params, int64_t token,
                                   int32_t* __restrict__ topk_ids,     // [num_tokens, top_k + num_shared]
                                   float* __restrict__ topk_weights,   // [num_tokens, top_k + num_shared]
                                   int32_t* __restrict__ error_flags,  // layer error word, or null
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
      const float numerator = lane < top_k && key != -INFINITY ? expf(key - max_logit) : 0.0f;
      const float denominator =
          params.mode == RoutingMode::kSoftmaxTopK && !params.renormalize ? all_sum : warp_sum(numerator);
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

}  // namespace fp4moe::kernels
