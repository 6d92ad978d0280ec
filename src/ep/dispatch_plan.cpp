// Expert placement and the dispatch / receive / combine plans of expert
// parallelism (include/fp4moe/expert_parallel.hpp, docs/expert-parallel.md).
// Host-only and allocation-light: one counting pass, one filling pass.
// Tested in tests/ep/test_dispatch_plan.cpp.
#include <algorithm>
#include <bit>
#include <cmath>
#include <limits>
#include <sstream>

#include "fp4moe/error.hpp"
#include "ep/dispatch_plan.hpp"

namespace fp4moe {
namespace {

void check_placement(const ExpertPlacement& placement, const char* who) {
  FP4MOE_CHECK(placement.num_ranks >= 1 && placement.num_experts >= placement.num_ranks &&
                   placement.rank_of_expert.size() == static_cast<size_t>(placement.num_experts) &&
                   placement.rank_expert_offsets.size() == static_cast<size_t>(placement.num_ranks + 1),
               who, ": placement is not built (num_experts = ", placement.num_experts,
               ", num_ranks = ", placement.num_ranks, "); expected one from ExpertPlacement::contiguous or from_table");
}

void check_rank(int rank, int num_ranks, const char* who, const char* name) {
  FP4MOE_CHECK(rank >= 0 && rank < num_ranks, who, ": ", name, " = ", rank, "; expected in [0, ", num_ranks, ")");
}

// Fills the per-rank lists from rank_of_expert (already validated).
void index_experts(ExpertPlacement& p) {
  p.local_idx_of_expert.assign(static_cast<size_t>(p.num_experts), 0);
  p.rank_expert_offsets.assign(static_cast<size_t>(p.num_ranks + 1), 0);
  for (int32_t r : p.rank_of_expert) ++p.rank_expert_offsets[static_cast<size_t>(r + 1)];
  for (int r = 0; r < p.num_ranks; ++r)
    p.rank_expert_offsets[static_cast<size_t>(r + 1)] += p.rank_expert_offsets[static_cast<size_t>(r)];
  p.experts_by_rank.assign(static_cast<size_t>(p.num_experts), 0);
  std::vector<int64_t> fill(p.rank_expert_offsets.begin(), p.rank_expert_offsets.end() - 1);
  for (int64_t e = 0; e < p.num_experts; ++e) {  // ascending e: local order = global order
    const int32_t r = p.rank_of_expert[static_cast<size_t>(e)];
    const int64_t slot = fill[static_cast<size_t>(r)]++;
    p.experts_by_rank[static_cast<size_t>(slot)] = static_cast<int32_t>(e);
    p.local_idx_of_expert[static_cast<size_t>(e)] =
        static_cast<int32_t>(slot - p.rank_expert_offsets[static_cast<size_t>(r)]);
  }
}

}  // namespace

// ------------------------------------------------------------ ExpertPlacement

ExpertPlacement ExpertPlacement::contiguous(int64_t num_experts, int num_ranks) {
  FP4MOE_CHECK(num_ranks >= 1, "ExpertPlacement::contiguous: num_ranks = ", num_ranks, "; expected >= 1");
  FP4MOE_CHECK(num_experts >= num_ranks && num_experts <= std::numeric_limits<int32_t>::max(),
               "ExpertPlacement::contiguous: num_experts = ", num_experts, "; expected >= num_ranks = ", num_ranks,
               " (every rank owns at least one expert)");
  ExpertPlacement p;
  p.num_experts = num_experts;
  p.num_ranks = num_ranks;
  p.rank_of_expert.resize(static_cast<size_t>(num_experts));
  const int64_t base = num_experts / num_ranks, extra = num_experts % num_ranks;
  int64_t e = 0;
  for (int r = 0; r < num_ranks; ++r)
    for (int64_t i = 0; i < base + (r < extra ? 1 : 0); ++i) p.rank_of_expert[static_cast<size_t>(e++)] = r;
  index_experts(p);
  return p;
}

ExpertPlacement ExpertPlacement::from_table(const std::vector<int32_t>& rank_of_expert, int num_ranks) {
  FP4MOE_CHECK(num_ranks >= 1, "ExpertPlacement::from_table: num_ranks = ", num_ranks, "; expected >= 1");
  FP4MOE_CHECK(
      !rank_of_expert.empty() && rank_of_expert.size() <= static_cast<size_t>(std::numeric_limits<int32_t>::max()),
      "ExpertPlacement::from_table: the table has ", rank_of_expert.size(),
      " entries; expected one rank per expert (>= 1 expert)");
  std::vector<int64_t> owned(static_cast<size_t>(num_ranks), 0);
  for (size_t e = 0; e < rank_of_expert.size(); ++e) {
    const int32_t r = rank_of_expert[e];
    FP4MOE_CHECK(r >= 0 && r < num_ranks, "ExpertPlacement::from_table: expert ", e, " is placed on rank ", r,
                 "; expected a rank in [0, ", num_ranks, ")");
    ++owned[static_cast<size_t>(r)];
  }
  for (int r = 0; r < num_ranks; ++r)
    FP4MOE_CHECK(owned[static_cast<size_t>(r)] > 0, "ExpertPlacement::from_table: rank ", r, " owns no expert (",
                 rank_of_expert.size(), " experts over ", num_ranks,
                 " ranks); expected every rank to own at least one");
  ExpertPlacement p;
  p.num_experts = static_cast<int64_t>(rank_of_expert.size());
  p.num_ranks = num_ranks;
  p.rank_of_expert = rank_of_expert;
  index_experts(p);
  return p;
}

int64_t ExpertPlacement::num_local_experts(int rank) const {
  check_rank(rank, num_ranks, "ExpertPlacement::num_local_experts", "rank");
  return rank_expert_offsets[static_cast<size_t>(rank + 1)] - rank_expert_offsets[static_cast<size_t>(rank)];
}

int32_t ExpertPlacement::global_expert(int rank, int64_t local_idx) const {
  const int64_t count = num_local_experts(rank);
  FP4MOE_CHECK(local_idx >= 0 && local_idx < count, "ExpertPlacement::global_expert: local index ", local_idx,
               " on rank ", rank, "; expected in [0, ", count, ")");
  return experts_by_rank[static_cast<size_t>(rank_expert_offsets[static_cast<size_t>(rank)] + local_idx)];
}

std::string ExpertPlacement::describe() const {
  std::ostringstream os;
  for (int r = 0; r < num_ranks; ++r) {
    const int64_t begin = rank_expert_offsets[static_cast<size_t>(r)];
    const int64_t end = rank_expert_offsets[static_cast<size_t>(r + 1)];
    os << "rank " << r << ": " << (end - begin) << " experts [";
    for (int64_t i = begin; i < end; ++i) os << (i > begin ? ", " : "") << experts_by_rank[static_cast<size_t>(i)];
    os << "]\n";
  }
  return os.str();
}

// --------------------------------------------------------------- DispatchPlan

int64_t DispatchPlan::send_rows(int rank) const {
  check_rank(rank, num_ranks, "DispatchPlan::send_rows", "rank");
  return send_row_offsets[static_cast<size_t>(rank + 1)] - send_row_offsets[static_cast<size_t>(rank)];
}

int64_t DispatchPlan::send_pair_count(int rank) const {
  check_rank(rank, num_ranks, "DispatchPlan::send_pair_count", "rank");
  return send_pair_offsets[static_cast<size_t>(rank + 1)] - send_pair_offsets[static_cast<size_t>(rank)];
}

std::vector<int64_t> DispatchPlan::counts_message(int rank) const { return {send_rows(rank), send_pair_count(rank)}; }

std::vector<int64_t> DispatchPlan::counts_messages() const {
  std::vector<int64_t> all;
  all.reserve(static_cast<size_t>(num_ranks * kCountsMessageWords));
  for (int r = 0; r < num_ranks; ++r) {
    all.push_back(send_rows(r));
    all.push_back(send_pair_count(r));
  }
  return all;
}

DispatchPlan plan_dispatch(const int32_t* topk_ids, int64_t num_tokens, int top_k, const ExpertPlacement& placement,
                           int my_rank, const float* topk_weights) {
  check_placement(placement, "plan_dispatch");
  const int num_ranks = placement.num_ranks;
  check_rank(my_rank, num_ranks, "plan_dispatch", "my_rank");
  FP4MOE_CHECK(top_k >= 1 && top_k <= placement.num_experts, "plan_dispatch: top_k = ", top_k,
               "; expected in [1, num_experts = ", placement.num_experts, "]");
  FP4MOE_CHECK(num_tokens >= 0 && num_tokens <= std::numeric_limits<int32_t>::max(),
               "plan_dispatch: num_tokens = ", num_tokens, "; expected in [0, 2^31)");
  FP4MOE_CHECK(num_tokens == 0 || topk_ids != nullptr, "plan_dispatch: topk_ids is null");
  for (int64_t i = 0; i < num_tokens * top_k; ++i)
    FP4MOE_CHECK(topk_ids[i] >= 0 && topk_ids[i] < placement.num_experts, "plan_dispatch: token ", i / top_k, " slot ",
                 i % top_k, ": expert id ", topk_ids[i], " out of range; expected in [0, ", placement.num_experts, ")");
  if (topk_weights != nullptr)
    for (int64_t i = 0; i < num_tokens * top_k; ++i)
      FP4MOE_CHECK(std::isfinite(topk_weights[i]), "plan_dispatch: token ", i / top_k, " slot ", i % top_k, ": weight ",
                   topk_weights[i], " is not finite");

  DispatchPlan plan;
  plan.num_ranks = num_ranks;
  plan.my_rank = my_rank;
  plan.top_k = top_k;
  plan.num_tokens = num_tokens;
  const auto rank_of = [&](int64_t t, int j) {
    return placement.rank_of_expert[static_cast<size_t>(topk_ids[t * top_k + j])];
  };
  // A token's row goes to rank r once, however many of its slots r serves:
  // slot j opens the row when no earlier slot went to r.
  const auto opens_row = [&](int64_t t, int j) {
    const int32_t r = rank_of(t, j);
    for (int i = 0; i < j; ++i)
      if (rank_of(t, i) == r) return false;
    return true;
  };

  // Counting pass.
  std::vector<int64_t> rows_to(static_cast<size_t>(num_ranks), 0), pairs_to(static_cast<size_t>(num_ranks), 0);
  for (int64_t t = 0; t < num_tokens; ++t)
    for (int j = 0; j < top_k; ++j) {
      ++pairs_to[static_cast<size_t>(rank_of(t, j))];
      if (opens_row(t, j)) ++rows_to[static_cast<size_t>(rank_of(t, j))];
    }
  plan.send_row_offsets.assign(static_cast<size_t>(num_ranks + 1), 0);
  plan.send_pair_offsets.assign(static_cast<size_t>(num_ranks + 1), 0);
  for (int r = 0; r < num_ranks; ++r) {
    plan.send_row_offsets[static_cast<size_t>(r + 1)] =
        plan.send_row_offsets[static_cast<size_t>(r)] + rows_to[static_cast<size_t>(r)];
    plan.send_pair_offsets[static_cast<size_t>(r + 1)] =
        plan.send_pair_offsets[static_cast<size_t>(r)] + pairs_to[static_cast<size_t>(r)];
  }

  // Filling pass: tokens ascending, so each destination's rows and pairs come
  // out in token order and, within a row, in slot order.
  const int64_t meta_words = dispatch_meta_words(top_k);
  const int64_t num_rows = plan.send_row_offsets.back();
  const int64_t num_pairs = plan.send_pair_offsets.back();
  plan.send_token_idx.assign(static_cast<size_t>(num_rows), 0);
  plan.send_meta.assign(static_cast<size_t>(num_rows * meta_words), 0);
  plan.send_pairs.assign(static_cast<size_t>(num_pairs), SendPair{});
  CombinePlan& combine = plan.combine;
  combine.num_ranks = num_ranks;
  combine.top_k = top_k;
  combine.num_tokens = num_tokens;
  combine.recv_offsets = plan.send_pair_offsets;
  combine.source_rank.assign(static_cast<size_t>(num_tokens * top_k), 0);
  combine.position.assign(static_cast<size_t>(num_tokens * top_k), 0);
  combine.return_row_idx.assign(static_cast<size_t>(num_tokens * top_k), 0);

  std::vector<int64_t> next_row(plan.send_row_offsets.begin(), plan.send_row_offsets.end() - 1);
  std::vector<int64_t> next_pair(plan.send_pair_offsets.begin(), plan.send_pair_offsets.end() - 1);
  std::vector<int64_t> row_of_rank(static_cast<size_t>(num_ranks), -1);  // this token's row per rank
  for (int64_t t = 0; t < num_tokens; ++t) {
    for (int j = 0; j < top_k; ++j) {
      const int32_t r = rank_of(t, j);
      if (!opens_row(t, j)) continue;
      const int64_t row = next_row[static_cast<size_t>(r)]++;
      row_of_rank[static_cast<size_t>(r)] = row;
      plan.send_token_idx[static_cast<size_t>(row)] = static_cast<int32_t>(t);
      int32_t* meta = plan.send_meta.data() + row * meta_words;
      meta[0] = static_cast<int32_t>(t);
      for (int i = 0; i < top_k; ++i) meta[1 + i] = kSlotServedElsewhere;  // weights stay +0.0f
    }
    for (int j = 0; j < top_k; ++j) {
      const int32_t expert = topk_ids[t * top_k + j];
      const int32_t r = placement.rank_of_expert[static_cast<size_t>(expert)];
      const int32_t local_expert = placement.local_idx_of_expert[static_cast<size_t>(expert)];
      const int64_t row = row_of_rank[static_cast<size_t>(r)];
      const int64_t row_in_block = row - plan.send_row_offsets[static_cast<size_t>(r)];
      int32_t* meta = plan.send_meta.data() + row * meta_words;
      meta[1 + j] = local_expert;
      if (topk_weights != nullptr) meta[1 + top_k + j] = std::bit_cast<int32_t>(topk_weights[t * top_k + j]);
      const int64_t pair = next_pair[static_cast<size_t>(r)]++;
      plan.send_pairs[static_cast<size_t>(pair)] = {static_cast<int32_t>(t), j, local_expert, row, row_in_block,
                                                    row_in_block * top_k + j};
      const size_t ts = static_cast<size_t>(t * top_k + j);
      combine.source_rank[ts] = r;
      combine.position[ts] = pair - plan.send_pair_offsets[static_cast<size_t>(r)];
      combine.return_row_idx[ts] = pair;
    }
  }
  return plan;
}

// ---------------------------------------------------------------- ReceivePlan

ReceivePlan plan_receive(const int64_t* recv_counts, const int32_t* recv_meta, int top_k,
                         const ExpertPlacement& placement, int my_rank) {
  check_placement(placement, "plan_receive");
  const int num_ranks = placement.num_ranks;
  check_rank(my_rank, num_ranks, "plan_receive", "my_rank");
  FP4MOE_CHECK(top_k >= 1 && top_k <= placement.num_experts, "plan_receive: top_k = ", top_k,
               "; expected in [1, num_experts = ", placement.num_experts, "]");
  FP4MOE_CHECK(recv_counts != nullptr, "plan_receive: recv_counts is null");

  ReceivePlan plan;
  plan.num_ranks = num_ranks;
  plan.my_rank = my_rank;
  plan.top_k = top_k;
  plan.num_local_experts = placement.num_local_experts(my_rank);
  plan.recv_row_offsets.assign(static_cast<size_t>(num_ranks + 1), 0);
  plan.return_offsets.assign(static_cast<size_t>(num_ranks + 1), 0);
  for (int s = 0; s < num_ranks; ++s) {
    const int64_t rows = recv_counts[s * kCountsMessageWords];
    const int64_t pairs = recv_counts[s * kCountsMessageWords + 1];
    FP4MOE_CHECK(rows >= 0 && pairs >= rows && pairs <= rows * top_k, "plan_receive: rank ", s, " announced ", rows,
                 " rows serving ", pairs, " pairs; expected 0 <= rows <= pairs <= rows * top_k (", top_k, ")");
    plan.recv_row_offsets[static_cast<size_t>(s + 1)] = plan.recv_row_offsets[static_cast<size_t>(s)] + rows;
    plan.return_offsets[static_cast<size_t>(s + 1)] = plan.return_offsets[static_cast<size_t>(s)] + pairs;
  }
  const int64_t num_rows = plan.recv_row_offsets.back();
  FP4MOE_CHECK(num_rows == 0 || recv_meta != nullptr, "plan_receive: recv_meta is null");

  // Pairs in return order: source rank, row, slot.
  const int64_t meta_words = dispatch_meta_words(top_k);
  plan.pairs.reserve(static_cast<size_t>(plan.return_offsets.back()));
  std::vector<int64_t> pairs_of_expert(static_cast<size_t>(plan.num_local_experts), 0);
  for (int s = 0; s < num_ranks; ++s) {
    for (int64_t row = plan.recv_row_offsets[static_cast<size_t>(s)];
         row < plan.recv_row_offsets[static_cast<size_t>(s + 1)]; ++row) {
      const int32_t* meta = recv_meta + row * meta_words;
      const int64_t row_in_block = row - plan.recv_row_offsets[static_cast<size_t>(s)];
      int served = 0;
      for (int j = 0; j < top_k; ++j) {
        const int32_t local_expert = meta[1 + j];
        if (local_expert == kSlotServedElsewhere) continue;
        FP4MOE_CHECK(local_expert >= 0 && local_expert < plan.num_local_experts, "plan_receive: rank ", s, " row ",
                     row_in_block, " (token ", meta[0], ") slot ", j, ": local expert ", local_expert,
                     "; expected -1 or in [0, ", plan.num_local_experts, ")");
        const float weight = std::bit_cast<float>(meta[1 + top_k + j]);
        plan.pairs.push_back({row, s, j, local_expert, weight});
        ++pairs_of_expert[static_cast<size_t>(local_expert)];
        ++served;
      }
      FP4MOE_CHECK(served > 0, "plan_receive: rank ", s, " row ", row_in_block, " (token ", meta[0],
                   ") serves no slot on rank ", my_rank, "; expected at least one");
    }
    const int64_t pairs_seen = static_cast<int64_t>(plan.pairs.size());
    FP4MOE_CHECK(pairs_seen == plan.return_offsets[static_cast<size_t>(s + 1)], "plan_receive: rank ", s, " announced ",
                 plan.return_offsets[static_cast<size_t>(s + 1)] - plan.return_offsets[static_cast<size_t>(s)],
                 " pairs but its rows serve ", pairs_seen - plan.return_offsets[static_cast<size_t>(s)]);
  }

  // Group by local expert, stable (counting sort).
  plan.expert_offsets.assign(static_cast<size_t>(plan.num_local_experts + 1), 0);
  for (int64_t e = 0; e < plan.num_local_experts; ++e)
    plan.expert_offsets[static_cast<size_t>(e + 1)] =
        plan.expert_offsets[static_cast<size_t>(e)] + pairs_of_expert[static_cast<size_t>(e)];
  std::vector<int64_t> fill(plan.expert_offsets.begin(), plan.expert_offsets.end() - 1);
  plan.pairs_by_expert.assign(plan.pairs.size(), 0);
  for (size_t p = 0; p < plan.pairs.size(); ++p)
    plan.pairs_by_expert[static_cast<size_t>(fill[static_cast<size_t>(plan.pairs[p].local_expert_idx)]++)] =
        static_cast<int64_t>(p);
  return plan;
}

}  // namespace fp4moe
