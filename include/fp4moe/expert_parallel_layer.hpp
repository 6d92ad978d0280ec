// One rank of an expert-parallel MoE layer over NCCL (docs/expert-parallel.md).
//
// Each of P ranks holds the experts that an ExpertPlacement gives it and is
// home to its own tokens. A forward on rank r:
//   1. routes its tokens (or takes the caller's routing) and copies the ids
//      to the host, where plan_dispatch() orders what goes where;
//   2. exchanges {rows, pairs} counts with every rank (NCCL), then sends each
//      token's bf16 hidden row once to every rank owning one of its experts,
//      with the slot metadata (local expert id or -1, router weight);
//   3. runs the grouped GEMMs of its experts on what it received
//      (MoeLayer::forward_pair_rows: one bf16 row per (row, slot) it serves);
//   4. returns those rows to their home ranks (NCCL), where each token's rows
//      are summed in slot order in fp32 and rounded once to bf16, by the same kernel
//      as the single-GPU deterministic finalize.
// The local layer is batch invariant (no split-K), so in deterministic mode
// the output is bit-identical to a batch-invariant single-GPU MoeLayer on the
// same tokens, whatever the placement and the split of tokens over ranks.
//
// Unlike MoeLayer::forward, a forward synchronises its stream three times
// (the routing ids, the received counts, the received metadata go to the
// host: NCCL counts are host values) and grows its buffers when a larger
// batch arrives, so it cannot be captured in a CUDA graph. Every rank of the
// communicator must call forward() (it is collective), with its own tokens;
// a rank may have none.
//
// Tested in tests/ep/test_expert_parallel_layer.cpp: one rank (any GPU) and
// P ranks on P GPUs, against MoeLayer.
#pragma once

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <cstdint>
#include <memory>

#include "fp4moe/expert_parallel.hpp"
#include "fp4moe/moe_layer.hpp"
#include "fp4moe/types.hpp"

namespace fp4moe {

// What one forward moved, on this rank.
struct ExpertParallelStats {
  int64_t sent_rows = 0;       // hidden rows sent (one per token and destination rank)
  int64_t sent_pairs = 0;      // (token, slot) pairs those rows serve = tokens * top_k
  int64_t received_rows = 0;   // rows this rank computed for all ranks
  int64_t received_pairs = 0;  // bf16 result rows it returned
  // Router logits given and some token had a non-finite one: those experts
  // were excluded, as MoeLayer does (docs/design.md §3), which reports the
  // same through device_errors().
  bool nonfinite_router_logits = false;
};

// Where one forward's time went on this rank, from CUDA events between the
// phases (milliseconds; host work between phases, such as planning, falls in
// the phase that follows it).
struct ExpertParallelTimes {
  double route_ms = 0;     // routing, its ids to the host, plan_dispatch
  double dispatch_ms = 0;  // send rows gathered, counts exchanged, rows + metadata moved (NCCL)
  double experts_ms = 0;   // metadata to the host, this rank's grouped GEMMs, rows in return order
  double return_ms = 0;    // result rows back to their home ranks (NCCL)
  double combine_ms = 0;   // slot-order sums into bf16
  double total_ms() const { return route_ms + dispatch_ms + experts_ms + return_ms + combine_ms; }
  double all_to_all_ms() const { return dispatch_ms + return_ms; }
};

class ExpertParallelMoeLayer {
 public:
  // This rank's part of the layer: `weights` holds every expert; only the
  // experts placement gives to the communicator's rank are uploaded. The
  // communicator's size must be placement.num_ranks. options.finalize must
  // be deterministic; batch invariance is switched on for the local layer.
  // Throws fp4moe::Error before any upload on a mismatch.
  static ExpertParallelMoeLayer prepare(const MoeWeights& weights, const ExpertPlacement& placement, ncclComm_t comm,
                                        const MoeLayerOptions& options = {});

  ExpertParallelMoeLayer(ExpertParallelMoeLayer&&) noexcept;
  ExpertParallelMoeLayer& operator=(ExpertParallelMoeLayer&&) noexcept;
  ~ExpertParallelMoeLayer();

  int rank() const;
  const ExpertPlacement& placement() const;
  const MoeLayer& local_layer() const;  // this rank's experts, local ids
  int64_t num_experts() const;          // of the whole layer
  int64_t hidden() const;
  int top_k() const;

  // This rank's tokens: args as for MoeLayer::forward, with global expert
  // ids (caller routing) or router logits over all experts; output bf16
  // [args.num_tokens, hidden]. Collective over the communicator; see above.
  // With `times`, the phases are timed and the stream is synchronised once
  // more at the end to read them.
  ExpertParallelStats forward(const MoeForwardArgs& args, void* output, cudaStream_t stream,
                              ExpertParallelTimes* times = nullptr);

 private:
  struct Impl;
  explicit ExpertParallelMoeLayer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace fp4moe
