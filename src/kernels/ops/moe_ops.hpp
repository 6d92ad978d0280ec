// Host launchers of the small kernels around the two grouped GEMMs of an MoE
// layer: routing, the permutation of (token, slot) pairs into expert order,
// the optional one-pass gather of activation rows, and the finalize reduction
// that turns per-pair (or accumulated) fp32 rows into the bf16 output.
//
// Every launcher is asynchronous on `stream`, allocates nothing, never
// synchronises with the host and needs no memset beforehand, so a sequence of
// them can be captured in a CUDA graph. With `programmatic`, kernels are
// launched with programmatic dependent launch (kernels/launch.cuh): they may
// start while the previous kernel in the stream finishes and wait for it on
// the device, which hides the launch gaps of a decode-sized layer. Input sizes are validated on the host
// before any launch (fp4moe::Error); device-side input errors (expert ids out
// of range) set bits in a caller-given int32 error word.
//
// Implemented in src/kernels/ops/ (routing.cu, sort.cu, gather.cu,
// finalize.cu); tested in tests/kernels/ops/ (the binary test_moe_ops)
// against the CPU reference (src/ref/routing.cpp) and host loops.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "fp4moe/reference.hpp"

namespace fp4moe::kernels {

// Bits of the layer's device-side error word (the grouped GEMM's bits are 1, 2).
inline constexpr int kErrorExpertIdOutOfRange = 4;
// A token had a non-finite router logit; its experts were excluded
// (docs/design.md §3). Not a fault of the layer: the output is defined.
inline constexpr int kErrorNonFiniteLogits = 8;
// The expert id of a slot that is deliberately empty (served by another rank
// under expert parallelism): skipped like any id out of range, not an error.
inline constexpr int32_t kAbsentSlot = -1;

// Largest top_k the routing and finalize kernels support.
inline constexpr int kMaxTopK = 32;

// A shared expert's slots, appended by the routing kernels to every token
// after its top_k choices: experts num_experts .. num_experts + num_shared - 1
// (the shared expert's chunks in the grouped GEMMs), weighted 1, or
// sigmoid(gate · x_t) in fp32 when gate is given. num_shared = 0: none.
struct SharedSlots {
  int num_shared = 0;
  const void* hidden_states = nullptr;  // bf16 [num_tokens, hidden]: x_t for the gate
  const float* gate = nullptr;          // fp32 [hidden], or null (weight 1)
  int64_t hidden = 0;
};

// Routes router_logits fp32 [num_tokens, num_experts] into topk_ids int32 and
// topk_weights fp32 [num_tokens, top_k] (row-major), with the CPU reference's
// semantics and tie rule (fp4moe::route, include/fp4moe/reference.hpp): equal
// scores rank by lower expert (or group) index; a token's ids are listed in
// selection order. Scores are computed in fp32. correction_bias fp32
// [num_experts] is read for kNoauxTc only and may be null (zeros).
// Non-finite logits exclude their expert as in route(); a token with one
// sets kErrorNonFiniteLogits in *error_flags (atomicOr) where error_flags is
// not null.
// Throws (before launch) on the parameter errors route() throws on, and when
// num_experts > kMaxExperts (512, plan/smem_model.hpp) or top_k > kMaxTopK.
// With shared slots, topk_ids and topk_weights are [num_tokens, top_k +
// shared.num_shared]: each token's choices, then its shared slots.
void launch_route(const float* router_logits, const float* correction_bias, int64_t num_tokens, int64_t num_experts,
                  const RoutingParams& params, int32_t* topk_ids, float* topk_weights, cudaStream_t stream,
                  bool programmatic = false, int32_t* error_flags = nullptr, const SharedSlots& shared = {});

// Counting sort of the num_tokens * top_k pairs by expert. Pair p = token *
// top_k + slot has expert topk_ids[p]. Writes
//   expert_offsets [num_experts + 1]: rows of expert e are [offsets[e], offsets[e+1]),
//                  offsets[0] = 0, offsets[E] = number of pairs with a valid id;
//   token_of_row   [num_tokens * top_k]: the token of each permuted row;
//   pair_of_row    [num_tokens * top_k]: the pair of each permuted row.
// Entries past offsets[E] are left unwritten. The order of rows within one
// expert is unspecified (results computed per row do not depend on it). Ids
// outside [0, num_experts) are not placed; all but kAbsentSlot set
// kErrorExpertIdOutOfRange in *error_flags (atomicOr). num_experts <= kMaxExperts.
// Up to kSortChunkPairs pairs one block sorts; more are counted and placed by
// a block per kSortChunkPairs (two kernels: one block held a whole 4096-token
// batch's sort for ~0.1 ms), which keep their per-block counts in
// sort_scratch, int32 [sort_scratch_ints(num_pairs, num_experts)] (null while
// that is 0).
void launch_sort_by_expert(const int32_t* topk_ids, int64_t num_tokens, int top_k, int64_t num_experts,
                           int32_t* expert_offsets, int32_t* token_of_row, int32_t* pair_of_row, int32_t* error_flags,
                           int32_t* sort_scratch, cudaStream_t stream, bool programmatic = false);

inline constexpr int64_t kSortChunkPairs = 2048;
// The int32 scratch launch_sort_by_expert needs for num_pairs pairs.
constexpr int64_t sort_scratch_ints(int64_t num_pairs, int64_t num_experts) {
  const int64_t blocks = (num_pairs + kSortChunkPairs - 1) / kSortChunkPairs;
  return blocks > 1 ? blocks * num_experts : 0;
}

// launch_route then launch_sort_by_expert (their contracts, their checks),
// in one kernel while num_tokens * top_k <= 1024: the last routing block to
// finish sorts, which saves a launch and the sort kernel's own latency at
// decode batch sizes. *arrivals is the int32 the fused kernel counts its
// blocks in: zero before the first launch, zero again after each; launches
// that may run concurrently need distinct counters. With shared slots (see
// launch_route), the sort runs over top_k + shared.num_shared slots per token
// and num_experts + shared.num_shared experts (fused while the slots number
// at most 1024; past that sort_scratch is launch_sort_by_expert's).
void launch_route_and_sort(const float* router_logits, const float* correction_bias, int64_t num_tokens,
                           int64_t num_experts, const RoutingParams& params, int32_t* topk_ids, float* topk_weights,
                           int32_t* expert_offsets, int32_t* token_of_row, int32_t* pair_of_row, int32_t* error_flags,
                           int32_t* arrivals, int32_t* sort_scratch, cudaStream_t stream, bool programmatic = false,
                           const SharedSlots& shared = {});

// Shared experts for caller-given routing (device routing appends the slots
// in the routing kernels, SharedSlots): writes out_ids and
// out_weights [num_tokens, top_k + num_shared], each token's top_k routed
// slots copied from topk_ids/topk_weights [num_tokens, top_k] (ids outside
// [0, num_experts) other than kAbsentSlot become INT32_MAX, out of range for
// the sort over num_experts + num_shared experts, which reports them), then
// its num_shared slots with experts num_experts .. num_experts + num_shared -
// 1, weighted 1, or sigmoid(shared_gate · x_t) in fp32 when shared_gate
// (fp32 [hidden]) is given, x_t the token's row of hidden_states (bf16
// [num_tokens, hidden]). top_k + num_shared <= kMaxTopK.
void launch_append_shared_slots(const int32_t* topk_ids, const float* topk_weights, int64_t num_tokens, int top_k,
                                int64_t num_experts, int num_shared, const void* hidden_states,
                                const float* shared_gate, int64_t hidden, int32_t* out_ids, float* out_weights,
                                cudaStream_t stream, bool programmatic = false);

// x_sorted[r, :] = x[token_of_row[r], :] for r < num_rows, bf16 rows of
// `hidden` elements (hidden % 8 == 0, pointers 16-byte aligned). Rows r with
// r >= expert_offsets[num_experts] (ids that were not placed) are skipped.
void launch_gather_rows(const void* x, const int32_t* token_of_row, const int32_t* expert_offsets, int64_t num_experts,
                        int64_t num_rows, int64_t hidden, void* x_sorted, cudaStream_t stream,
                        bool programmatic = false);

// W4A4: launch_gather_rows, with each row quantised to NVFP4 on the way, per
// block of 16 against input_scales[e] (fp32 [num_experts], e the row's
// expert), by the rule of include/fp4moe/nvfp4_activation.hpp, and written as
// q x e4m3 (exact in bf16; GEMM1's epilogue applies the input_scale).
// hidden % 16 == 0, num_experts <= kMaxExperts.
void launch_gather_rows_fp4(const void* x, const int32_t* token_of_row, const int32_t* expert_offsets,
                            int64_t num_experts, int64_t num_rows, int64_t hidden, const float* input_scales,
                            void* x_sorted, cudaStream_t stream, bool programmatic = false);

// The last step of the layer, output bf16 [num_tokens, hidden]:
//   per_pair (deterministic): output[t, :] = bf16(sum over slots j = 0..top_k-1,
//     in slot order, in fp32 from 0.0f, of pair_rows[t * top_k + j, :]),
//     skipping slots whose id topk_ids[t * top_k + j] is outside
//     [0, num_experts) (they were never written); topk_ids null: every slot
//     is valid (the routing kernel's ids always are), and the kernel saves
//     the ids' round trip before the rows'. pair_rows is bf16
//     [num_tokens * top_k, hidden] (GEMM2's finalize epilogue rounds each
//     row there once); the sum is rounded to bf16 (nearest even) once.
//   accumulated (atomic mode): output[t, :] = bf16(accum[t, :]), then
//     accum[t, :] = 0 so the buffer is ready for the next forward. accum is
//     fp32 [num_tokens, hidden].
// hidden % 4 == 0, pointers 16-byte aligned. A token with no valid slot gets
// zeros.
void launch_finalize_pairs(const void* pair_rows, const int32_t* topk_ids, int64_t num_tokens, int top_k,
                           int64_t num_experts, int64_t hidden, void* output, cudaStream_t stream,
                           bool programmatic = false);
void launch_finalize_accumulated(float* accum, int64_t num_tokens, int64_t hidden, void* output, cudaStream_t stream,
                                 bool programmatic = false);

}  // namespace fp4moe::kernels
