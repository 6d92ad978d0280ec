// NCCL helpers for expert parallelism: see nccl_util.hpp.
// Tested in tests/ep/test_nccl_one_rank.cpp.
#include "ep/nccl_util.hpp"

#include <cuda_runtime.h>

#include <cctype>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <thread>
#include <utility>

#include "fp4moe/cuda_check.hpp"

namespace fp4moe {
namespace {

void check_comm(ncclComm_t comm, int num_ranks, const char* who) {
  FP4MOE_CHECK(comm != nullptr, who, ": comm is null");
  int count = 0;
  FP4MOE_NCCL_CHECK(ncclCommCount(comm, &count));
  FP4MOE_CHECK(count == num_ranks, who, ": the communicator has ", count, " ranks; the plan expects ", num_ranks);
}

int hex_digit(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

}  // namespace

const char* nccl_result_name(ncclResult_t result) {
  switch (result) {
    case ncclSuccess:
      return "ncclSuccess";
    case ncclUnhandledCudaError:
      return "ncclUnhandledCudaError";
    case ncclSystemError:
      return "ncclSystemError";
    case ncclInternalError:
      return "ncclInternalError";
    case ncclInvalidArgument:
      return "ncclInvalidArgument";
    case ncclInvalidUsage:
      return "ncclInvalidUsage";
    case ncclRemoteError:
      return "ncclRemoteError";
    case ncclInProgress:
      return "ncclInProgress";
    default:
      return "ncclResult(unknown)";
  }
}

std::string nccl_unique_id_to_hex(const ncclUniqueId& id) {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string hex;
  hex.reserve(2 * NCCL_UNIQUE_ID_BYTES);
  for (int i = 0; i < NCCL_UNIQUE_ID_BYTES; ++i) {
    const auto byte = static_cast<unsigned char>(id.internal[i]);
    hex.push_back(kDigits[byte >> 4]);
    hex.push_back(kDigits[byte & 0xF]);
  }
  return hex;
}

ncclUniqueId nccl_unique_id_from_hex(const std::string& text) {
  size_t begin = 0, end = text.size();
  while (begin < end && std::isspace(static_cast<unsigned char>(text[begin]))) ++begin;
  while (end > begin && std::isspace(static_cast<unsigned char>(text[end - 1]))) --end;
  const size_t length = end - begin;
  FP4MOE_CHECK(length == 2 * NCCL_UNIQUE_ID_BYTES, "nccl_unique_id_from_hex: ", length, " hex digits; expected ",
               2 * NCCL_UNIQUE_ID_BYTES, " (", NCCL_UNIQUE_ID_BYTES, " bytes, as nccl_unique_id_to_hex writes)");
  ncclUniqueId id;
  for (int i = 0; i < NCCL_UNIQUE_ID_BYTES; ++i) {
    const size_t at = begin + 2 * static_cast<size_t>(i);
    const int hi = hex_digit(text[at]), lo = hex_digit(text[at + 1]);
    FP4MOE_CHECK(hi >= 0 && lo >= 0, "nccl_unique_id_from_hex: character '", text[hi < 0 ? at : at + 1],
                 "' at position ", (hi < 0 ? at : at + 1) - begin, " is not a hex digit");
    id.internal[i] = static_cast<char>((hi << 4) | lo);
  }
  return id;
}

std::optional<ncclUniqueId> nccl_unique_id_from_env(const char* var) {
  FP4MOE_CHECK(var != nullptr, "nccl_unique_id_from_env: var is null");
  const char* value = std::getenv(var);
  if (value == nullptr) return std::nullopt;
  try {
    return nccl_unique_id_from_hex(value);
  } catch (const Error& e) {
    FP4MOE_THROW("environment variable ", var, ": ", e.message());
  }
}

void run_ranks_in_threads(int num_ranks, const std::function<void(int rank, ncclComm_t comm)>& fn) {
  int num_gpus = 0;
  if (cudaGetDeviceCount(&num_gpus) != cudaSuccess) {
    cudaGetLastError();
    num_gpus = 0;
  }
  FP4MOE_CHECK(num_ranks >= 1 && num_ranks <= num_gpus, num_ranks,
               " rank(s) need as many GPUs (one each); this machine has ", num_gpus);
  ncclUniqueId id;
  FP4MOE_NCCL_CHECK(ncclGetUniqueId(&id));
  std::mutex mutex;
  std::vector<ncclComm_t> comms(static_cast<size_t>(num_ranks), nullptr);
  bool aborted = false;
  std::string first_error;
  const auto fail = [&](int rank, const std::string& what) {
    const std::lock_guard<std::mutex> lock(mutex);
    if (first_error.empty()) first_error = "rank " + std::to_string(rank) + ": " + what;
    if (aborted) return;
    aborted = true;
    for (ncclComm_t& c : comms)
      if (c) ncclCommAbort(std::exchange(c, nullptr));
  };
  std::vector<std::thread> threads;
  for (int r = 0; r < num_ranks; ++r)
    threads.emplace_back([&, r] {
      try {
        FP4MOE_CUDA_CHECK(cudaSetDevice(r));
        ncclComm_t comm = nullptr;
        FP4MOE_NCCL_CHECK(ncclCommInitRank(&comm, num_ranks, id, r));
        {
          const std::lock_guard<std::mutex> lock(mutex);
          if (aborted) {
            ncclCommAbort(comm);
            return;
          }
          comms[static_cast<size_t>(r)] = comm;
        }
        fn(r, comm);
        const std::lock_guard<std::mutex> lock(mutex);
        if (ncclComm_t own = std::exchange(comms[static_cast<size_t>(r)], nullptr)) ncclCommDestroy(own);
      } catch (const std::exception& e) {
        fail(r, e.what());
      }
    });
  for (std::thread& t : threads) t.join();
  FP4MOE_CHECK(first_error.empty(), first_error);
}

void nccl_exchange_counts(const int64_t* counts_send, int64_t* counts_recv, int num_ranks, ncclComm_t comm,
                          cudaStream_t stream) {
  check_comm(comm, num_ranks, "nccl_exchange_counts");
  FP4MOE_CHECK(counts_send != nullptr && counts_recv != nullptr,
               "nccl_exchange_counts: counts_send and counts_recv must be non-null");
  FP4MOE_NCCL_CHECK(ncclGroupStart());
  for (int r = 0; r < num_ranks; ++r) {
    FP4MOE_NCCL_CHECK(ncclSend(counts_send + r * kCountsMessageWords, kCountsMessageWords, ncclInt64, r, comm, stream));
    FP4MOE_NCCL_CHECK(ncclRecv(counts_recv + r * kCountsMessageWords, kCountsMessageWords, ncclInt64, r, comm, stream));
  }
  FP4MOE_NCCL_CHECK(ncclGroupEnd());
}

void nccl_dispatch(const DispatchPlan& plan, const int64_t* recv_counts, int64_t hidden, const void* send_hidden,
                   const int32_t* send_meta, void* recv_hidden, int32_t* recv_meta, ncclComm_t comm,
                   cudaStream_t stream) {
  check_comm(comm, plan.num_ranks, "nccl_dispatch");
  FP4MOE_CHECK(recv_counts != nullptr, "nccl_dispatch: recv_counts is null");
  FP4MOE_CHECK(hidden >= 1, "nccl_dispatch: hidden = ", hidden, "; expected >= 1");
  const int64_t meta_words = dispatch_meta_words(plan.top_k);
  const auto* send_bytes = static_cast<const uint16_t*>(send_hidden);
  auto* recv_bytes = static_cast<uint16_t*>(recv_hidden);
  FP4MOE_NCCL_CHECK(ncclGroupStart());
  int64_t recv_row = 0;
  for (int r = 0; r < plan.num_ranks; ++r) {
    const int64_t send_begin = plan.send_row_offsets[static_cast<size_t>(r)];
    const int64_t send_rows = plan.send_rows(r);
    const int64_t recv_rows = recv_counts[r * kCountsMessageWords];
    if (send_rows > 0) {
      FP4MOE_NCCL_CHECK(ncclSend(send_bytes + send_begin * hidden, static_cast<size_t>(send_rows * hidden),
                                 ncclBfloat16, r, comm, stream));
      FP4MOE_NCCL_CHECK(ncclSend(send_meta + send_begin * meta_words, static_cast<size_t>(send_rows * meta_words),
                                 ncclInt32, r, comm, stream));
    }
    if (recv_rows > 0) {
      FP4MOE_NCCL_CHECK(ncclRecv(recv_bytes + recv_row * hidden, static_cast<size_t>(recv_rows * hidden), ncclBfloat16,
                                 r, comm, stream));
      FP4MOE_NCCL_CHECK(ncclRecv(recv_meta + recv_row * meta_words, static_cast<size_t>(recv_rows * meta_words),
                                 ncclInt32, r, comm, stream));
    }
    recv_row += recv_rows;
  }
  FP4MOE_NCCL_CHECK(ncclGroupEnd());
}

void nccl_return_rows(const ReceivePlan& recv, const DispatchPlan& plan, int64_t hidden, const void* return_rows,
                      void* returned, ncclComm_t comm, cudaStream_t stream) {
  FP4MOE_CHECK(recv.num_ranks == plan.num_ranks && recv.my_rank == plan.my_rank,
               "nccl_return_rows: the receive plan is for rank ", recv.my_rank, " of ", recv.num_ranks,
               ", the dispatch plan for rank ", plan.my_rank, " of ", plan.num_ranks);
  check_comm(comm, plan.num_ranks, "nccl_return_rows");
  FP4MOE_CHECK(hidden >= 1, "nccl_return_rows: hidden = ", hidden, "; expected >= 1");
  const auto* send_rows_bf16 = static_cast<const uint16_t*>(return_rows);
  auto* recv_rows_bf16 = static_cast<uint16_t*>(returned);
  FP4MOE_NCCL_CHECK(ncclGroupStart());
  for (int r = 0; r < plan.num_ranks; ++r) {
    const int64_t send_begin = recv.return_offsets[static_cast<size_t>(r)];
    const int64_t send_rows = recv.return_offsets[static_cast<size_t>(r + 1)] - send_begin;
    const int64_t recv_begin = plan.combine.recv_offsets[static_cast<size_t>(r)];
    const int64_t recv_rows = plan.combine.recv_offsets[static_cast<size_t>(r + 1)] - recv_begin;
    if (send_rows > 0)
      FP4MOE_NCCL_CHECK(ncclSend(send_rows_bf16 + send_begin * hidden, static_cast<size_t>(send_rows * hidden),
                                 ncclBfloat16, r, comm, stream));
    if (recv_rows > 0)
      FP4MOE_NCCL_CHECK(ncclRecv(recv_rows_bf16 + recv_begin * hidden, static_cast<size_t>(recv_rows * hidden),
                                 ncclBfloat16, r, comm, stream));
  }
  FP4MOE_NCCL_CHECK(ncclGroupEnd());
}

}  // namespace fp4moe
