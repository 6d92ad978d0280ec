// NCCL helpers for expert parallelism (docs/expert-parallel.md): error
// checking, the communicator's unique id as text (so a launcher can share it
// through a file or the FP4MOE_NCCL_ID environment variable), and the grouped
// send/recv calls that carry out a DispatchPlan / ReceivePlan. Built into the
// fp4moe_nccl target only when NCCL is found.
//
// Every exchange is one ncclGroupStart/ncclGroupEnd group of ncclSend +
// ncclRecv per peer, this rank included (a send to itself is an ordinary NCCL
// peer copy). Peers with nothing to move in either direction are skipped on
// both sides: both sides know the count (the sender from its plan, the
// receiver from the counts exchange), so the calls still match.
//
// Tested in tests/ep/test_nccl_one_rank.cpp (one-rank communicator; GPU).
#pragma once

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "fp4moe/error.hpp"
#include "ep/dispatch_plan.hpp"

// Throws fp4moe::Error with the NCCL error name and the last NCCL message.
#define FP4MOE_NCCL_CHECK(expr)                                                               \
  do {                                                                                        \
    const ncclResult_t fp4moe_nccl_result_ = (expr);                                          \
    if (fp4moe_nccl_result_ != ncclSuccess)                                                   \
      FP4MOE_THROW(#expr, " failed: ", ::fp4moe::nccl_result_name(fp4moe_nccl_result_), " (", \
                   ncclGetErrorString(fp4moe_nccl_result_), ")");                             \
  } while (0)

namespace fp4moe {

const char* nccl_result_name(ncclResult_t result);  // "ncclInvalidUsage", ...

// The environment variable a multi-process launch uses to pass the id.
inline constexpr const char* kNcclIdEnvVar = "FP4MOE_NCCL_ID";

// 256 lowercase hex digits (NCCL_UNIQUE_ID_BYTES = 128 bytes, in order).
std::string nccl_unique_id_to_hex(const ncclUniqueId& id);
// Inverse of nccl_unique_id_to_hex; accepts upper or lower case and ignores
// surrounding whitespace (a trailing newline from a file). Throws saying what
// was wrong: length or the first bad character and its position.
ncclUniqueId nccl_unique_id_from_hex(const std::string& hex);
// The id in environment variable `var` (default FP4MOE_NCCL_ID); nullopt when
// the variable is unset. Throws when it is set but malformed.
std::optional<ncclUniqueId> nccl_unique_id_from_env(const char* var = kNcclIdEnvVar);

// Single-process multi-GPU mode (the CLI's --ep N, the multi-GPU tests):
// rank r runs fn(r, comm) on device r, in a thread of its own, over one
// communicator of num_ranks ranks. Returns when all are done. When a rank
// throws, every communicator is aborted, so the other ranks' pending NCCL
// work fails instead of waiting forever, and the first error is rethrown
// naming its rank. Throws up front unless 1 <= num_ranks <= the GPU count.
// (A rank that fails before joining the communicator leaves the others
// waiting in ncclCommInitRank: fn's inputs should be checked first.)
void run_ranks_in_threads(int num_ranks, const std::function<void(int rank, ncclComm_t comm)>& fn);

// Counts exchange: sends counts_send [num_ranks, kCountsMessageWords] (row r
// to rank r) and receives counts_recv [num_ranks, kCountsMessageWords] (row s
// from rank s), device int64 buffers. The caller copies counts_recv to the
// host (and synchronises) before nccl_dispatch: NCCL counts are host values.
void nccl_exchange_counts(const int64_t* counts_send, int64_t* counts_recv, int num_ranks, ncclComm_t comm,
                          cudaStream_t stream);

// Dispatch payload. send_hidden bf16 [plan.num_send_rows(), hidden] and
// send_meta int32 [plan.num_send_rows(), dispatch_meta_words(top_k)] are
// packed in the plan's row order; recv_counts (host) is what
// nccl_exchange_counts received; recv_hidden / recv_meta receive the blocks
// concatenated in source rank order.
void nccl_dispatch(const DispatchPlan& plan, const int64_t* recv_counts, int64_t hidden, const void* send_hidden,
                   const int32_t* send_meta, void* recv_hidden, int32_t* recv_meta, ncclComm_t comm,
                   cudaStream_t stream);

// Return of the bf16 result rows (MoeLayer::forward_pair_rows'): sends
// return_rows bf16 [recv.num_recv_pairs(), hidden] (block s to rank s) and
// receives the rows computed for this rank into returned bf16
// [plan.num_send_pairs(), hidden] (block r from rank r), where
// plan.combine.return_row_idx finds them.
void nccl_return_rows(const ReceivePlan& recv, const DispatchPlan& plan, int64_t hidden, const void* return_rows,
                      void* returned, ncclComm_t comm, cudaStream_t stream);

}  // namespace fp4moe
