// A CPU simulation of one expert-parallel forward over P ranks, moving the
// same rows in the same order as the NCCL implementation (counts exchange,
// dispatch, local computation, return, combine; the returned rows in fp32,
// where the GPU's are bf16), so the plans of dispatch_plan.cpp are validated
// end to end without a GPU.
// Tested in tests/ep/test_dispatch_plan.cpp against the single-node combine.
#include <algorithm>
#include <numeric>

#include "fp4moe/error.hpp"
#include "ep/dispatch_plan.hpp"
#include "fp4moe/nvfp4.hpp"

namespace fp4moe {
namespace {

// Rows [begin, end) of a [*, width] buffer appended to `to`.
template <typename T>
void append_rows(std::vector<T>& to, const std::vector<T>& from, int64_t begin, int64_t end, int64_t width) {
  to.insert(to.end(), from.begin() + begin * width, from.begin() + end * width);
}

}  // namespace

ExpertParallelSimulation simulate_expert_parallel(const uint16_t* hidden_states, int64_t hidden,
                                                  const int32_t* topk_ids, const float* topk_weights,
                                                  int64_t num_tokens, int top_k,
                                                  const std::vector<int64_t>& tokens_per_rank,
                                                  const ExpertPlacement& placement,
                                                  const LocalExpertFn& local_experts) {
  const int num_ranks = placement.num_ranks;
  FP4MOE_CHECK(num_ranks >= 1 && tokens_per_rank.size() == static_cast<size_t>(num_ranks),
               "simulate_expert_parallel: tokens_per_rank has ", tokens_per_rank.size(),
               " entries; expected num_ranks = ", num_ranks);
  int64_t total = 0;
  for (int r = 0; r < num_ranks; ++r) {
    FP4MOE_CHECK(tokens_per_rank[static_cast<size_t>(r)] >= 0, "simulate_expert_parallel: rank ", r, " has ",
                 tokens_per_rank[static_cast<size_t>(r)], " tokens; expected >= 0");
    total += tokens_per_rank[static_cast<size_t>(r)];
  }
  FP4MOE_CHECK(total == num_tokens, "simulate_expert_parallel: tokens_per_rank sums to ", total,
               "; expected num_tokens = ", num_tokens);
  FP4MOE_CHECK(hidden >= 1, "simulate_expert_parallel: hidden = ", hidden, "; expected >= 1");
  FP4MOE_CHECK(static_cast<bool>(local_experts), "simulate_expert_parallel: local_experts is empty");
  FP4MOE_CHECK(num_tokens == 0 || (hidden_states && topk_ids && topk_weights),
               "simulate_expert_parallel: hidden_states, topk_ids and topk_weights must be non-null");
  const size_t P = static_cast<size_t>(num_ranks);
  std::vector<int64_t> token_begin(P + 1, 0);
  std::partial_sum(tokens_per_rank.begin(), tokens_per_rank.end(), token_begin.begin() + 1);

  ExpertParallelSimulation sim;
  const int64_t meta_words = dispatch_meta_words(top_k);

  // Plans, and each rank's send buffer of bf16 rows (gathered by token).
  std::vector<std::vector<uint16_t>> send_hidden(P);
  for (int r = 0; r < num_ranks; ++r) {
    const int64_t t0 = token_begin[static_cast<size_t>(r)];
    sim.dispatch.push_back(plan_dispatch(topk_ids + t0 * top_k, tokens_per_rank[static_cast<size_t>(r)], top_k,
                                         placement, r, topk_weights + t0 * top_k));
    const DispatchPlan& plan = sim.dispatch.back();
    std::vector<uint16_t>& buf = send_hidden[static_cast<size_t>(r)];
    buf.reserve(static_cast<size_t>(plan.num_send_rows() * hidden));
    for (int32_t t : plan.send_token_idx)
      buf.insert(buf.end(), hidden_states + (t0 + t) * hidden, hidden_states + (t0 + t + 1) * hidden);
  }

  // Counts exchange, then the payload: rank r receives the blocks addressed to
  // it, concatenated in source rank order.
  std::vector<std::vector<int64_t>> recv_counts(P);
  std::vector<std::vector<uint16_t>> recv_hidden(P);
  std::vector<std::vector<int32_t>> recv_meta(P);
  for (int r = 0; r < num_ranks; ++r)
    for (int s = 0; s < num_ranks; ++s) {
      const DispatchPlan& from = sim.dispatch[static_cast<size_t>(s)];
      const std::vector<int64_t> counts = from.counts_message(r);
      recv_counts[static_cast<size_t>(r)].insert(recv_counts[static_cast<size_t>(r)].end(), counts.begin(),
                                                 counts.end());
      const int64_t begin = from.send_row_offsets[static_cast<size_t>(r)];
      const int64_t end = from.send_row_offsets[static_cast<size_t>(r + 1)];
      append_rows(recv_hidden[static_cast<size_t>(r)], send_hidden[static_cast<size_t>(s)], begin, end, hidden);
      append_rows(recv_meta[static_cast<size_t>(r)], from.send_meta, begin, end, meta_words);
    }

  // Each rank plans from what it received, computes its pairs in
  // expert-grouped order and scatters each row to its return position.
  std::vector<std::vector<float>> return_rows(P);
  for (int r = 0; r < num_ranks; ++r) {
    sim.receive.push_back(plan_receive(recv_counts[static_cast<size_t>(r)].data(),
                                       recv_meta[static_cast<size_t>(r)].data(), top_k, placement, r));
    const ReceivePlan& recv = sim.receive.back();
    // The receiver's return order must be each sender's send order.
    for (int s = 0; s < num_ranks; ++s) {
      const DispatchPlan& from = sim.dispatch[static_cast<size_t>(s)];
      const int64_t sent_begin = from.send_pair_offsets[static_cast<size_t>(r)];
      const int64_t count =
          recv.return_offsets[static_cast<size_t>(s + 1)] - recv.return_offsets[static_cast<size_t>(s)];
      FP4MOE_CHECK(count == from.send_pair_count(r), "simulate_expert_parallel: rank ", r, " returns ", count,
                   " rows to rank ", s, ", which sent it ", from.send_pair_count(r), " pairs");
      for (int64_t i = 0; i < count; ++i) {
        const RecvPair& got = recv.pairs[static_cast<size_t>(recv.return_offsets[static_cast<size_t>(s)] + i)];
        const SendPair& sent = from.send_pairs[static_cast<size_t>(sent_begin + i)];
        const int32_t got_token = recv_meta[static_cast<size_t>(r)][static_cast<size_t>(got.recv_row * meta_words)];
        FP4MOE_CHECK(got.source_rank == s && got_token == sent.token_idx && got.slot == sent.slot &&
                         got.local_expert_idx == sent.local_expert_idx &&
                         got.recv_row - recv.recv_row_offsets[static_cast<size_t>(s)] == sent.row_in_block,
                     "simulate_expert_parallel: rank ", r, " return row ", i, " for rank ", s, " is (token ", got_token,
                     ", slot ", got.slot, ", local expert ", got.local_expert_idx, "); the sender expects (token ",
                     sent.token_idx, ", slot ", sent.slot, ", local expert ", sent.local_expert_idx, ")");
      }
    }

    const int64_t num_pairs = recv.num_recv_pairs();
    std::vector<int32_t> batch_expert(static_cast<size_t>(num_pairs));
    std::vector<float> batch_weight(static_cast<size_t>(num_pairs));
    std::vector<float> batch_x(static_cast<size_t>(num_pairs * hidden));
    for (int64_t i = 0; i < num_pairs; ++i) {
      const RecvPair& pair = recv.pairs[static_cast<size_t>(recv.pairs_by_expert[static_cast<size_t>(i)])];
      batch_expert[static_cast<size_t>(i)] = pair.local_expert_idx;
      batch_weight[static_cast<size_t>(i)] = pair.weight;
      const uint16_t* row = recv_hidden[static_cast<size_t>(r)].data() + pair.recv_row * hidden;
      for (int64_t n = 0; n < hidden; ++n) batch_x[static_cast<size_t>(i * hidden + n)] = bf16_to_float(row[n]);
    }
    std::vector<float> batch_out(static_cast<size_t>(num_pairs * hidden), 0.0f);
    if (num_pairs > 0)
      local_experts(r, num_pairs, batch_expert.data(), batch_weight.data(), batch_x.data(), batch_out.data());
    std::vector<float>& ret = return_rows[static_cast<size_t>(r)];
    ret.assign(static_cast<size_t>(num_pairs * hidden), 0.0f);
    for (int64_t i = 0; i < num_pairs; ++i) {
      const int64_t p = recv.pairs_by_expert[static_cast<size_t>(i)];
      std::copy(batch_out.begin() + i * hidden, batch_out.begin() + (i + 1) * hidden, ret.begin() + p * hidden);
    }
  }

  // Return: home rank s receives, from every r, the rows r computed for it,
  // concatenated in rank order; then sums each token's slots in slot order.
  sim.output.assign(static_cast<size_t>(num_tokens * hidden), 0.0f);
  for (int s = 0; s < num_ranks; ++s) {
    const DispatchPlan& plan = sim.dispatch[static_cast<size_t>(s)];
    std::vector<float> returned;
    for (int r = 0; r < num_ranks; ++r) {
      const ReceivePlan& recv = sim.receive[static_cast<size_t>(r)];
      append_rows(returned, return_rows[static_cast<size_t>(r)], recv.return_offsets[static_cast<size_t>(s)],
                  recv.return_offsets[static_cast<size_t>(s + 1)], hidden);
    }
    FP4MOE_CHECK(static_cast<int64_t>(returned.size()) == plan.num_send_pairs() * hidden,
                 "simulate_expert_parallel: rank ", s, " got ", returned.size() / static_cast<size_t>(hidden),
                 " rows back; expected ", plan.num_send_pairs());
    const int64_t t0 = token_begin[static_cast<size_t>(s)];
    for (int64_t t = 0; t < plan.num_tokens; ++t) {
      float* out = sim.output.data() + (t0 + t) * hidden;
      for (int j = 0; j < top_k; ++j) {
        const float* row = returned.data() + plan.combine.return_row_idx[static_cast<size_t>(t * top_k + j)] * hidden;
        for (int64_t n = 0; n < hidden; ++n) out[n] += row[n];  // from 0.0f, slot order, fp32
      }
    }
  }
  return sim;
}

}  // namespace fp4moe
