// NCCL groundwork for expert parallelism on one GPU (src/ep/nccl_util.cpp):
// the unique id's hex form (no GPU needed), and a one-rank communicator that
// sends to itself, with the helpers' grouped ncclSend/ncclRecv, the counts
// exchange, the dispatch payload (bf16 rows + metadata) of a P = 1
// DispatchPlan and the return of bf16 rows, checking every byte. The
// multi-rank runs need a multi-GPU machine (docs/expert-parallel.md).
// GPU label; the NCCL tests skip visibly without a device.
#include <gtest/gtest.h>

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "ep/nccl_util.hpp"
#include "expect_error.hpp"
#include "ep/dispatch_plan.hpp"
#include "gpu_test_util.hpp"

namespace fp4moe {
namespace {

ncclUniqueId patterned_id() {
  ncclUniqueId id;
  for (int i = 0; i < NCCL_UNIQUE_ID_BYTES; ++i) id.internal[i] = static_cast<char>(i * 37 + 11);
  return id;
}

TEST(NcclUniqueIdHex, RoundTrips) {
  const ncclUniqueId id = patterned_id();
  const std::string hex = nccl_unique_id_to_hex(id);
  ASSERT_EQ(hex.size(), 2u * NCCL_UNIQUE_ID_BYTES);
  EXPECT_EQ(hex.substr(0, 6), "0b3055");  // 11, 48, 85
  EXPECT_EQ(std::memcmp(nccl_unique_id_from_hex(hex).internal, id.internal, NCCL_UNIQUE_ID_BYTES), 0);
  std::string upper = hex;
  for (char& c : upper) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  EXPECT_EQ(std::memcmp(nccl_unique_id_from_hex("  " + upper + "\n").internal, id.internal, NCCL_UNIQUE_ID_BYTES), 0);
}

TEST(NcclUniqueIdHex, RejectsBadText) {
  const std::string hex = nccl_unique_id_to_hex(patterned_id());
  expect_error([&] { nccl_unique_id_from_hex(hex.substr(1)); }, {"255 hex digits", "expected 256"});
  std::string bad = hex;
  bad[17] = 'g';
  expect_error([&] { nccl_unique_id_from_hex(bad); }, {"'g' at position 17"});
}

TEST(NcclUniqueIdHex, ReadsTheEnvironment) {
  const char* var = "FP4MOE_NCCL_ID_TEST";
  ::unsetenv(var);
  EXPECT_FALSE(nccl_unique_id_from_env(var).has_value());
  const ncclUniqueId id = patterned_id();
  ::setenv(var, nccl_unique_id_to_hex(id).c_str(), 1);
  const std::optional<ncclUniqueId> got = nccl_unique_id_from_env(var);
  ASSERT_TRUE(got.has_value());
  EXPECT_EQ(std::memcmp(got->internal, id.internal, NCCL_UNIQUE_ID_BYTES), 0);
  ::setenv(var, "abc", 1);
  expect_error([&] { nccl_unique_id_from_env(var); }, {"FP4MOE_NCCL_ID_TEST", "3 hex digits"});
  ::unsetenv(var);
  EXPECT_STREQ(kNcclIdEnvVar, "FP4MOE_NCCL_ID");
}

// A one-rank communicator, destroyed at scope exit.
class OneRankComm {
 public:
  OneRankComm() {
    ncclUniqueId id;
    FP4MOE_NCCL_CHECK(ncclGetUniqueId(&id));
    // As a launcher would: through the text form.
    const ncclUniqueId shared = nccl_unique_id_from_hex(nccl_unique_id_to_hex(id));
    FP4MOE_NCCL_CHECK(ncclCommInitRank(&comm_, 1, shared, 0));
  }
  ~OneRankComm() {
    if (comm_) ncclCommDestroy(comm_);
  }
  OneRankComm(const OneRankComm&) = delete;
  OneRankComm& operator=(const OneRankComm&) = delete;
  ncclComm_t get() const { return comm_; }

 private:
  ncclComm_t comm_ = nullptr;
};

TEST(NcclOneRank, CountsPayloadAndReturnFollowTheDispatchPlan) {
  FP4MOE_REQUIRE_GPU();
  int version = 0;
  FP4MOE_NCCL_CHECK(ncclGetVersion(&version));
  std::printf("NCCL version code %d\n", version);
  OneRankComm comm;
  cudaStream_t stream = nullptr;
  FP4MOE_CUDA_CHECK(cudaStreamCreate(&stream));

  constexpr int64_t kNumExperts = 8, kHidden = 64;
  constexpr int kTopK = 2;
  const ExpertPlacement placement = ExpertPlacement::contiguous(kNumExperts, 1);
  std::mt19937 rng(5);
  for (int64_t num_tokens : {0, 1, 37}) {
    SCOPED_TRACE("num_tokens = " + std::to_string(num_tokens));
    std::vector<int32_t> ids;
    std::vector<float> weights;
    std::uniform_real_distribution<float> weight(0.1f, 1.0f);
    for (int64_t t = 0; t < num_tokens; ++t) {
      const int32_t first = static_cast<int32_t>(rng() % kNumExperts);
      ids.push_back(first);
      ids.push_back(static_cast<int32_t>((first + 1 + rng() % (kNumExperts - 1)) % kNumExperts));
      weights.push_back(weight(rng));
      weights.push_back(weight(rng));
    }
    const DispatchPlan plan = plan_dispatch(ids.data(), num_tokens, kTopK, placement, 0, weights.data());
    const std::vector<uint16_t> hidden = testing::random_bf16(static_cast<size_t>(num_tokens * kHidden), rng);
    std::vector<uint16_t> send_hidden;
    for (int32_t t : plan.send_token_idx)
      send_hidden.insert(send_hidden.end(), hidden.begin() + t * kHidden, hidden.begin() + (t + 1) * kHidden);

    // Counts exchange.
    DeviceBuffer<int64_t> counts_send(plan.counts_messages()), counts_recv(kCountsMessageWords);
    counts_recv.fill_bytes(0xFF);
    nccl_exchange_counts(counts_send.get(), counts_recv.get(), 1, comm.get(), stream);
    FP4MOE_CUDA_CHECK(cudaStreamSynchronize(stream));
    const std::vector<int64_t> recv_counts = counts_recv.download();
    ASSERT_EQ(recv_counts, plan.counts_messages());
    ASSERT_EQ(recv_counts[0], num_tokens);  // one rank: every token once (dedup)
    ASSERT_EQ(recv_counts[1], num_tokens * kTopK);

    // Payload: bf16 rows and metadata, received into poisoned buffers (one
    // spare row so the buffers exist when nothing is sent).
    const int64_t rows = recv_counts[0];
    const int64_t meta_words = dispatch_meta_words(kTopK);
    DeviceBuffer<uint16_t> d_send_hidden(std::max<size_t>(send_hidden.size(), 1));
    d_send_hidden.upload(send_hidden);
    DeviceBuffer<int32_t> d_send_meta(std::max<size_t>(plan.send_meta.size(), 1));
    d_send_meta.upload(plan.send_meta);
    DeviceBuffer<uint16_t> d_recv_hidden(static_cast<size_t>((rows + 1) * kHidden));
    DeviceBuffer<int32_t> d_recv_meta(static_cast<size_t>((rows + 1) * meta_words));
    d_recv_hidden.fill_bytes(0xA5);
    d_recv_meta.fill_bytes(0xA5);
    nccl_dispatch(plan, recv_counts.data(), kHidden, d_send_hidden.get(), d_send_meta.get(), d_recv_hidden.get(),
                  d_recv_meta.get(), comm.get(), stream);
    FP4MOE_CUDA_CHECK(cudaStreamSynchronize(stream));
    std::vector<uint16_t> got_hidden = d_recv_hidden.download();
    std::vector<int32_t> got_meta = d_recv_meta.download();
    for (int64_t n = 0; n < kHidden; ++n) ASSERT_EQ(got_hidden[static_cast<size_t>(rows * kHidden + n)], 0xA5A5);
    got_hidden.resize(static_cast<size_t>(rows * kHidden));
    got_meta.resize(static_cast<size_t>(rows * meta_words));
    ASSERT_EQ(got_hidden, send_hidden);
    ASSERT_EQ(got_meta, plan.send_meta);

    // The receiver's plan from what arrived; a recognisable row per pair,
    // returned and found through the combine plan.
    const ReceivePlan recv = plan_receive(recv_counts.data(), got_meta.data(), kTopK, placement, 0);
    ASSERT_EQ(recv.num_recv_pairs(), num_tokens * kTopK);
    // bf16 rows, a distinct bit pattern per (token, slot, element) (moved
    // as bits: < 2^16 for these counts).
    const auto mark = [](int64_t token, int64_t slot, int64_t n) {
      return static_cast<uint16_t>(token * 1000 + slot * 100 + n);
    };
    std::vector<uint16_t> return_rows(static_cast<size_t>(recv.num_recv_pairs() * kHidden));
    for (int64_t p = 0; p < recv.num_recv_pairs(); ++p) {
      const RecvPair& pair = recv.pairs[static_cast<size_t>(p)];
      const int32_t token = got_meta[static_cast<size_t>(pair.recv_row * meta_words)];
      for (int64_t n = 0; n < kHidden; ++n)
        return_rows[static_cast<size_t>(p * kHidden + n)] = mark(token, pair.slot, n);
    }
    DeviceBuffer<uint16_t> d_return(std::max<size_t>(return_rows.size(), 1));
    d_return.upload(return_rows);
    DeviceBuffer<uint16_t> d_returned(static_cast<size_t>((plan.num_send_pairs() + 1) * kHidden));
    d_returned.fill_bytes(0xFF);
    nccl_return_rows(recv, plan, kHidden, d_return.get(), d_returned.get(), comm.get(), stream);
    FP4MOE_CUDA_CHECK(cudaStreamSynchronize(stream));
    const std::vector<uint16_t> returned = d_returned.download();
    for (int64_t t = 0; t < num_tokens; ++t)
      for (int j = 0; j < kTopK; ++j) {
        const int64_t row = plan.combine.return_row_idx[static_cast<size_t>(t * kTopK + j)];
        for (int64_t n = 0; n < kHidden; ++n)
          ASSERT_EQ(returned[static_cast<size_t>(row * kHidden + n)], mark(t, j, n))
              << "token " << t << " slot " << j << " element " << n;
      }
  }
  FP4MOE_CUDA_CHECK(cudaStreamDestroy(stream));
}

TEST(NcclOneRank, RejectsAPlanForAnotherCommunicatorSize) {
  FP4MOE_REQUIRE_GPU();
  OneRankComm comm;
  const ExpertPlacement placement = ExpertPlacement::contiguous(8, 2);
  const std::vector<int32_t> ids = {1};
  const DispatchPlan plan = plan_dispatch(ids.data(), 1, 1, placement, 0);
  const std::vector<int64_t> counts = {1, 1, 0, 0};
  expect_error([&] { nccl_dispatch(plan, counts.data(), 16, nullptr, nullptr, nullptr, nullptr, comm.get(), nullptr); },
               {"the communicator has 1 ranks; the plan expects 2"});
}

}  // namespace
}  // namespace fp4moe
