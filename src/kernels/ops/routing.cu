// Routing: the kernels that route tokens (one block per token, routing.cuh),
// alone or with the sort of their pairs in the same launch, and the shared
// experts' slots appended to caller-given routing; their host launchers (the
// contract is in moe_ops.hpp).
//
// Tested in tests/kernels/ops/test_routing.cpp: routing against the CPU
// reference fp4moe::route() for every mode, expert count, top-k and token
// count (and with many exact ties, and with non-finite logits), and the
// shared slots against a host loop; the fused routing and sort in
// tests/kernels/ops/test_sort.cpp.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <climits>
#include <cstdint>

#include "fp4moe/error.hpp"
#include "kernels/launch.cuh"
#include "kernels/ops/common.cuh"
#include "kernels/ops/moe_ops.hpp"
#include "kernels/ops/routing.cuh"
#include "kernels/ops/sort.cuh"
#include "kernels/ptx/grid_dependency.cuh"
#include "plan/smem_model.hpp"
#include "ref/routing_checks.hpp"

namespace fp4moe::kernels {
namespace {

constexpr int64_t kFusedSortMaxPairs = 1024;  // route_and_sort: up to here the routing kernel sorts
constexpr int kSharedSlotThreads = 128;       // append_shared_slots: one block per token

__global__ void __launch_bounds__(kRouteThreads)
    route_kernel(const float* __restrict__ router_logits, const float* __restrict__ correction_bias, int num_experts,
                 RoutingParams params, int32_t* __restrict__ topk_ids, float* __restrict__ topk_weights,
                 int32_t* __restrict__ error_flags, SharedSlots shared) {
  __shared__ RouteShared sh;
  const ExpertBias bias = load_expert_bias(correction_bias, num_experts, params);
  FP4MOE_TIMELINE_SPAN(TimelineKernel::kRouting);
  ptx::wait_for_prior_grids();  // launched early (programmatic): inputs may not be ready yet
  ptx::allow_dependent_launch();
  route_token(sh, router_logits, bias, num_experts, params, blockIdx.x, topk_ids, topk_weights, error_flags, shared);
}

// Routing and sort in one launch, for small batches where a second kernel's
// launch costs more than the sort: every block routes its token, then the
// last block to finish (counted in *arrivals, which it resets to 0 for the
// next launch) sorts all pairs with its kRouteThreads threads. A single
// token's block sorts its choices straight from shared memory
// (sort_one_token): no fence, no arrival atomic, no read-back through L2.
__global__ void __launch_bounds__(kRouteThreads)
    route_and_sort_kernel(const float* __restrict__ router_logits, const float* __restrict__ correction_bias,
                          int num_experts, RoutingParams params, int32_t* topk_ids, float* __restrict__ topk_weights,
                          int32_t* __restrict__ expert_offsets, int32_t* __restrict__ token_of_row,
                          int32_t* __restrict__ pair_of_row, int32_t* __restrict__ error_flags,
                          int32_t* __restrict__ arrivals, SharedSlots shared) {
  __shared__ RouteShared route_sh;
  __shared__ SortShared<kRouteThreads> sort_sh;
  __shared__ bool is_last;
  const ExpertBias bias = load_expert_bias(correction_bias, num_experts, params);
  FP4MOE_TIMELINE_SPAN(TimelineKernel::kRouting);
  ptx::wait_for_prior_grids();  // launched early (programmatic): inputs may not be ready yet
  ptx::allow_dependent_launch();
  route_token(route_sh, router_logits, bias, num_experts, params, blockIdx.x, topk_ids, topk_weights, error_flags,
              shared);
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
  sort_pairs_in_block<kRouteThreads>(sort_sh, topk_ids, static_cast<int64_t>(gridDim.x) * rows, rows, sorted_experts,
                                     expert_offsets, token_of_row, pair_of_row, error_flags);
}

// Writes a token's rows_per_token = top_k + num_shared slots: its routed
// slots as given (ids outside [0, num_experts) other than kAbsentSlot become
// INT32_MAX, so that the sort, which sees the shared chunks as experts
// num_experts.., still refuses them), then one slot per shared chunk, expert
// num_experts + j, weighted 1 or sigmoid(shared_gate · x) (a dot product in
// fp32, summed per thread, per warp, then over warps in a fixed order).
__global__ void __launch_bounds__(kSharedSlotThreads)
    append_shared_slots_kernel(const int32_t* __restrict__ topk_ids,    // [num_tokens, top_k]
                               const float* __restrict__ topk_weights,  // [num_tokens, top_k]
                               int top_k, int num_experts, int num_shared,
                               const __nv_bfloat16* __restrict__ hidden_states,  // [num_tokens, hidden]
                               const float* __restrict__ shared_gate,            // [hidden] or null
                               int64_t hidden,
                               int32_t* __restrict__ out_ids,      // [num_tokens, top_k + num_shared]
                               float* __restrict__ out_weights) {  // [num_tokens, top_k + num_shared]
  __shared__ float warp_partial[kSharedSlotThreads / 32];
  FP4MOE_TIMELINE_SPAN(TimelineKernel::kRouting);
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

// The parameter checks of fp4moe::route (src/ref/routing.cpp), plus this
// kernel's limits.
void check_routing_params(int64_t num_tokens, int64_t num_experts, const RoutingParams& p) {
  FP4MOE_CHECK(num_tokens >= 0, "launch_route: num_tokens = ", num_tokens, "; expected >= 0");
  check_num_experts("launch_route", num_experts);
  FP4MOE_CHECK(p.top_k >= 1 && p.top_k <= num_experts, "launch_route: top_k = ", p.top_k,
               "; expected in [1, num_experts = ", num_experts, "]");
  FP4MOE_CHECK(p.top_k <= kMaxTopK, "launch_route: top_k = ", p.top_k, "; expected <= ", kMaxTopK);
  FP4MOE_CHECK(p.mode == RoutingMode::kSoftmaxTopK || p.mode == RoutingMode::kNoauxTc || p.mode == RoutingMode::kGptOss,
               "launch_route: unknown RoutingMode ", static_cast<int>(p.mode));
  if (p.mode == RoutingMode::kNoauxTc) check_noaux_tc_params("launch_route", num_experts, p);
}

// The shared slots the routing kernels append: within the kernels' limits,
// and with hidden states to compute a gate from.
void check_shared_slots(const char* op, int64_t num_experts, int top_k, const SharedSlots& shared) {
  if (shared.num_shared == 0) return;
  FP4MOE_CHECK(
      shared.num_shared > 0 && top_k + shared.num_shared <= kMaxTopK && num_experts + shared.num_shared <= kMaxExperts,
      op, ": top_k = ", top_k, " with ", shared.num_shared, " shared slots over ", num_experts,
      " experts; expected top_k + shared <= ", kMaxTopK, " and experts + shared <= ", kMaxExperts);
  FP4MOE_CHECK(shared.gate == nullptr || (shared.hidden_states != nullptr && shared.hidden >= 1), op,
               ": a shared expert gate needs hidden_states and hidden >= 1");
}

}  // namespace

void launch_route(const float* router_logits, const float* correction_bias, int64_t num_tokens, int64_t num_experts,
                  const RoutingParams& params, int32_t* topk_ids, float* topk_weights, cudaStream_t stream,
                  bool programmatic, int32_t* error_flags, const SharedSlots& shared) {
  check_routing_params(num_tokens, num_experts, params);
  check_shared_slots("launch_route", num_experts, params.top_k, shared);
  if (num_tokens == 0) return;
  FP4MOE_CHECK(router_logits && topk_ids && topk_weights,
               "launch_route: router_logits, topk_ids and topk_weights must be non-null");
  FP4MOE_CHECK(num_tokens <= INT_MAX, "launch_route: num_tokens = ", num_tokens, "; expected <= ", INT_MAX,
               " (one block per token)");
  launch_kernel(route_kernel, static_cast<unsigned>(num_tokens), kRouteThreads, 0, stream, programmatic, router_logits,
                params.mode == RoutingMode::kNoauxTc ? correction_bias : nullptr, static_cast<int>(num_experts), params,
                topk_ids, topk_weights, error_flags, shared);
}

void launch_route_and_sort(const float* router_logits, const float* correction_bias, int64_t num_tokens,
                           int64_t num_experts, const RoutingParams& params, int32_t* topk_ids, float* topk_weights,
                           int32_t* expert_offsets, int32_t* token_of_row, int32_t* pair_of_row, int32_t* error_flags,
                           int32_t* arrivals, int32_t* sort_scratch, cudaStream_t stream, bool programmatic,
                           const SharedSlots& shared) {
  check_routing_params(num_tokens, num_experts, params);
  check_shared_slots("launch_route_and_sort", num_experts, params.top_k, shared);
  const int rows = params.top_k + shared.num_shared;
  if (num_tokens * rows > kFusedSortMaxPairs) {
    launch_route(router_logits, correction_bias, num_tokens, num_experts, params, topk_ids, topk_weights, stream,
                 programmatic, error_flags, shared);
    launch_sort_by_expert(topk_ids, num_tokens, rows, num_experts + shared.num_shared, expert_offsets, token_of_row,
                          pair_of_row, error_flags, sort_scratch, stream, programmatic);
    return;
  }
  if (num_tokens == 0) return;
  FP4MOE_CHECK(router_logits && topk_ids && topk_weights && expert_offsets && token_of_row && pair_of_row &&
                   error_flags && arrivals,
               "launch_route_and_sort: router_logits, topk_ids, topk_weights, expert_offsets, "
               "token_of_row, pair_of_row, error_flags and arrivals must be non-null");
  launch_kernel(route_and_sort_kernel, static_cast<unsigned>(num_tokens), kRouteThreads, 0, stream, programmatic,
                router_logits, params.mode == RoutingMode::kNoauxTc ? correction_bias : nullptr,
                static_cast<int>(num_experts), params, topk_ids, topk_weights, expert_offsets, token_of_row,
                pair_of_row, error_flags, arrivals, shared);
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

}  // namespace fp4moe::kernels
