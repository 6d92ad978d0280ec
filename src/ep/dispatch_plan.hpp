// Expert parallelism, host side: the plans that move a rank's tokens to the
// ranks owning their experts (dispatch) and the per-(token, slot) result rows
// back (combine), and their wire format. Pure functions of the routing and
// the placement (fp4moe/expert_parallel.hpp); no GPU, no NCCL. The NCCL calls
// that follow these plans live in src/ep/nccl_util.hpp; the design is
// docs/expert-parallel.md.
//
//   ExpertPlacement placement = ExpertPlacement::contiguous(num_experts, num_ranks);
//   DispatchPlan plan = plan_dispatch(topk_ids, num_tokens, top_k, placement, my_rank);
//   // counts exchange: send plan.counts_message(r) to every rank r, receive theirs
//   // dispatch: send rows [send_row_offsets[r], send_row_offsets[r+1]) (hidden + meta) to r
//   ReceivePlan recv = plan_receive(recv_counts, recv_meta, top_k, placement, my_rank);
//   // local grouped GEMMs over recv.pairs_by_expert; GEMM2 writes pair p's fp32 row
//   // (weight x expert row) to return row p; return rows [return_offsets[s], ..) go back to s
//   // combine: output[t] = sum over slots j in slot order of returned row plan.combine.return_row_idx[t*k+j]
//
// Tested in tests/ep/test_dispatch_plan.cpp (CPU): plan invariants over many
// shapes and placements, and simulate_expert_parallel() against the
// single-node combine, bit for bit.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "fp4moe/expert_parallel.hpp"

namespace fp4moe {

// ---------------------------------------------------------------- wire format
//
// A dispatched row is a token's bf16 hidden state [hidden], sent ONCE to each
// rank that owns at least one of its experts, with fixed-width int32 metadata:
//
//   word 0                      source token index on the sending rank
//   words 1 .. top_k            per slot j: the expert's local index on the
//                               receiver, or -1 where slot j is served elsewhere
//   words 1 + top_k .. 2 top_k  per slot j: the router weight, fp32 bits
//                               (+0.0f where the slot is served elsewhere)
//
// Slot positions are kept, so a block of received rows is a routing of
// top_k slots per row over the receiver's local experts, with -1 for absent
// slots; the receiver needs no other table.
constexpr int64_t dispatch_meta_words(int top_k) { return 1 + 2 * static_cast<int64_t>(top_k); }
inline constexpr int32_t kSlotServedElsewhere = -1;

// The counts message each rank sends every rank (itself included) before the
// payload, int64: {rows it will send there, (token, slot) pairs those rows serve}.
inline constexpr int kCountsMessageWords = 2;

// One (token, slot) pair as its sender sees it.
struct SendPair {
  int32_t token_idx = 0;         // on the sending rank
  int32_t slot = 0;              // 0 .. top_k-1
  int32_t local_expert_idx = 0;  // on the receiving rank
  int64_t send_row = 0;          // its row in the send buffer (all destinations)
  int64_t row_in_block = 0;      // its row within the block sent to that rank
  // Where the receiver finds its router weight: in the block from this rank,
  // meta word 1 + top_k + slot of row row_in_block, i.e. weight index
  // row_in_block * top_k + slot of the block's [rows, top_k] weights.
  int64_t weight_idx = 0;
};

// Where each of this rank's (token, slot) result rows comes back. Rank r
// returns one fp32 row per pair this rank sent it, in the order they were sent
// (send_pairs order); the return blocks are received concatenated in rank order.
struct CombinePlan {
  int num_ranks = 0;
  int top_k = 0;
  int64_t num_tokens = 0;
  std::vector<int64_t> recv_offsets;    // [num_ranks + 1] return rows from rank r: [off[r], off[r+1])
  std::vector<int32_t> source_rank;     // [num_tokens * top_k] the rank that computes (t, j)
  std::vector<int64_t> position;        // [num_tokens * top_k] row within that rank's return block
  std::vector<int64_t> return_row_idx;  // [num_tokens * top_k] recv_offsets[source] + position
};

// One rank's dispatch: rows (one per (token, destination rank) with at least
// one of the token's slots there) in destination-rank-major order, tokens
// ascending within a destination; pairs in the same order, slots ascending
// within a row.
struct DispatchPlan {
  int num_ranks = 0;
  int my_rank = 0;
  int top_k = 0;
  int64_t num_tokens = 0;

  std::vector<int64_t> send_row_offsets;   // [num_ranks + 1] rows for rank r: [off[r], off[r+1])
  std::vector<int32_t> send_token_idx;     // [num_send_rows] whose hidden row each sent row carries
  std::vector<int32_t> send_meta;          // [num_send_rows, dispatch_meta_words(top_k)] the wire metadata
  std::vector<int64_t> send_pair_offsets;  // [num_ranks + 1] pairs for rank r: [off[r], off[r+1])
  std::vector<SendPair> send_pairs;        // [num_send_pairs] = num_tokens * top_k
  CombinePlan combine;

  int64_t num_send_rows() const { return send_row_offsets.empty() ? 0 : send_row_offsets.back(); }
  int64_t num_send_pairs() const { return static_cast<int64_t>(send_pairs.size()); }
  int64_t send_rows(int rank) const;
  int64_t send_pair_count(int rank) const;
  // {rows, pairs} for rank `rank` (kCountsMessageWords int64).
  std::vector<int64_t> counts_message(int rank) const;
  // The whole counts send buffer: [num_ranks, kCountsMessageWords].
  std::vector<int64_t> counts_messages() const;
};

// Plans the dispatch of this rank's tokens. topk_ids [num_tokens, top_k]
// global expert ids; topk_weights [num_tokens, top_k] router weights, copied
// into send_meta's weight words (null: those words stay +0.0f, for callers
// that write them on the device). Throws on an id outside [0, placement.num_experts),
// top_k outside [1, num_experts], my_rank outside [0, num_ranks), or
// num_tokens outside [0, 2^31), or a given weight that is not finite. A token listing one expert twice is
// planned as given (both slots served on its rank).
DispatchPlan plan_dispatch(const int32_t* topk_ids, int64_t num_tokens, int top_k, const ExpertPlacement& placement,
                           int my_rank, const float* topk_weights = nullptr);

// One (received row, slot) pair on the receiving rank.
struct RecvPair {
  int64_t recv_row = 0;  // row in the concatenated received blocks
  int32_t source_rank = 0;
  int32_t slot = 0;
  int32_t local_expert_idx = 0;
  float weight = 0.0f;
};

// What a rank does with what it received: its local pairs in return order
// (source rank, then row, then slot ascending: exactly each sender's
// send_pairs order, so the sender's CombinePlan positions hold), grouped by
// local expert for the grouped GEMMs.
struct ReceivePlan {
  int num_ranks = 0;
  int my_rank = 0;
  int top_k = 0;
  int64_t num_local_experts = 0;
  std::vector<int64_t> recv_row_offsets;  // [num_ranks + 1] rows received from rank s
  std::vector<int64_t> return_offsets;    // [num_ranks + 1] return rows for rank s (its pairs)
  std::vector<RecvPair> pairs;            // [num_recv_pairs] in return order: pair p -> return row p
  std::vector<int64_t> expert_offsets;    // [num_local_experts + 1] into pairs_by_expert
  std::vector<int64_t> pairs_by_expert;   // [num_recv_pairs] pair indices grouped by expert, stable

  int64_t num_recv_rows() const { return recv_row_offsets.empty() ? 0 : recv_row_offsets.back(); }
  int64_t num_recv_pairs() const { return static_cast<int64_t>(pairs.size()); }
};

// recv_counts [num_ranks, kCountsMessageWords]: the counts message received
// from each rank. recv_meta [num_recv_rows, dispatch_meta_words(top_k)]: the
// metadata blocks received, concatenated in source rank order. Checks that the
// metadata agrees with the counts (rows and pairs per source), that local
// expert ids are in range and every row serves at least one slot; throws
// naming the source rank and row otherwise.
ReceivePlan plan_receive(const int64_t* recv_counts, const int32_t* recv_meta, int top_k,
                         const ExpertPlacement& placement, int my_rank);

// ------------------------------------------------------------- CPU simulation

// A rank's local expert computation for a batch of pairs: out[i, :] (fp32
// [num_pairs, hidden]) = weights[i] * expert(x[i, :]) for the rank's local
// expert local_expert_idx[i], the row the layer's GEMM2 epilogue writes
// (which the GPU layer rounds to bf16; the simulation keeps fp32, see below).
// x is [num_pairs, hidden] (the received bf16 rows, widened exactly).
using LocalExpertFn = std::function<void(int rank, int64_t num_pairs, const int32_t* local_expert_idx,
                                         const float* weights, const float* x, float* out)>;

struct ExpertParallelSimulation {
  std::vector<float> output;           // [num_tokens, hidden] fp32 slot-order sums (the layer rounds each to bf16 once)
  std::vector<DispatchPlan> dispatch;  // per rank
  std::vector<ReceivePlan> receive;    // per rank
};

// Runs one expert-parallel forward over placement.num_ranks simulated ranks,
// moving rows as the NCCL implementation does: counts exchange, dispatch of
// bf16 rows + metadata, local computation in expert-grouped order with each
// pair's row scattered to its return position, return of the rows, and the
// combine: output[t] = ((0.0f + r_0) + r_1) + ... over slots in slot order,
// in fp32, as the single-GPU layer's deterministic finalize sums them. The
// returned rows stay fp32 here (the GPU layer's are bf16): what is under
// test is where each row goes, and fp32 rows let the test hold the combine
// to moe_reference closely.
// The global tokens are split over ranks in order: rank r is home to
// tokens_per_rank[r] consecutive tokens. hidden_states bf16 [num_tokens,
// hidden]; topk_ids/topk_weights [num_tokens, top_k]. Also checks on the way
// that every receiver's view agrees with every sender's (throws otherwise).
ExpertParallelSimulation simulate_expert_parallel(const uint16_t* hidden_states, int64_t hidden,
                                                  const int32_t* topk_ids, const float* topk_weights,
                                                  int64_t num_tokens, int top_k,
                                                  const std::vector<int64_t>& tokens_per_rank,
                                                  const ExpertPlacement& placement, const LocalExpertFn& local_experts);

}  // namespace fp4moe
