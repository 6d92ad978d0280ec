// Tests of the expert-parallel plans (src/ep/dispatch_plan.cpp) and of the
// CPU simulation (src/ep/simulate.cpp). For P ranks in {1, 2, 3, 4, 8},
// E experts in {8, 64, 256} (contiguous placements and random tables, E % P
// nonzero included), top_k in {1, 2, 8} and {0, 1, 3, 64, 1000} tokens split
// unevenly over the ranks (some ranks with none), under uniform and skewed
// routing (every token to experts of one rank, so the others receive
// nothing), the tests check:
//   - every (token, slot) is sent exactly once, to the rank owning its
//     expert, with the right local expert id, row and weight on the wire;
//   - dedup: a token goes to a rank once however many of its slots it serves,
//     and the metadata marks exactly the slots served there;
//   - the sender's counts match what the receiver derives from the metadata;
//   - the combine positions are a bijection onto the returned rows;
//   - the simulated EP forward equals the single-node combine bit for bit,
//     and for top_k = 1 equals fp4moe::moe_reference itself bit for bit.
// Per-pair rows come from moe_reference (one slot of weight w per pair), so
// every rank computes exactly what one node would: the reference's result for
// a token does not depend on the other tokens in its batch.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <map>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "expect_error.hpp"
#include "fp4moe/error.hpp"
#include "ep/dispatch_plan.hpp"
#include "fp4moe/nvfp4.hpp"
#include "fp4moe/reference.hpp"

namespace fp4moe {
namespace {

constexpr int64_t kHidden = 32;  // small: the plans, not the MLP, are under test
constexpr int64_t kInter = 16;

// ------------------------------------------------------------------ helpers

Nvfp4Matrix random_matrix(int64_t rows, int64_t cols, std::mt19937_64& rng) {
  Nvfp4Matrix m;
  m.rows = rows;
  m.cols = cols;
  m.global_scale = 0.05f;
  m.packed.resize(static_cast<size_t>(rows * cols / 2));
  m.scales.resize(static_cast<size_t>(rows * cols / 16));
  std::uniform_int_distribution<int> byte(0, 255), scale(0x28, 0x40);  // e4m3 0.25 .. 2
  for (auto& b : m.packed) b = static_cast<uint8_t>(byte(rng));
  for (auto& s : m.scales) s = static_cast<uint8_t>(scale(rng));
  return m;
}

// Random weights per expert count, built once.
const MoeWeights& weights_for(int64_t num_experts) {
  static std::map<int64_t, MoeWeights> cache;
  auto it = cache.find(num_experts);
  if (it != cache.end()) return it->second;
  std::mt19937_64 rng(1000 + static_cast<uint64_t>(num_experts));
  MoeWeights w;
  w.num_experts = num_experts;
  w.hidden = kHidden;
  w.inter = kInter;
  for (int64_t e = 0; e < num_experts; ++e)
    w.experts.push_back({random_matrix(kInter, kHidden, rng),
                         random_matrix(kInter, kHidden, rng),
                         random_matrix(kHidden, kInter, rng),
                         {},
                         {},
                         {}});
  return cache.emplace(num_experts, std::move(w)).first->second;
}

// fp32 rows weight * expert(x) for a batch of (global expert, weight, x): the
// reference with one slot per pair.
void reference_rows(const MoeWeights& w, int64_t num_pairs, const int32_t* experts, const float* weights,
                    const float* x, float* out) {
  Routing routing;
  routing.num_tokens = num_pairs;
  routing.top_k = 1;
  routing.topk_ids.assign(experts, experts + num_pairs);
  routing.topk_weights.assign(weights, weights + num_pairs);
  moe_reference(w, x, routing, Activation::kSwiGLU, out, /*num_threads=*/1);
}

struct Problem {
  int num_ranks = 1;
  int64_t num_experts = 8;
  int top_k = 1;
  int64_t num_tokens = 0;
  std::vector<int32_t> topk_ids;        // [num_tokens, top_k]
  std::vector<float> topk_weights;      // [num_tokens, top_k]
  std::vector<uint16_t> hidden_states;  // bf16 [num_tokens, kHidden]
  std::vector<int64_t> tokens_per_rank;
  std::string describe() const {
    return "P=" + std::to_string(num_ranks) + " E=" + std::to_string(num_experts) + " top_k=" + std::to_string(top_k) +
           " T=" + std::to_string(num_tokens);
  }
};

// Random distinct experts per token, drawn from `pool` (all experts, or those
// of one rank for skewed routing).
void route_from(Problem& pb, const std::vector<int32_t>& pool, std::mt19937_64& rng) {
  std::uniform_real_distribution<float> weight(0.05f, 1.0f);
  pb.topk_ids.clear();
  pb.topk_weights.clear();
  std::vector<int32_t> choice = pool;
  for (int64_t t = 0; t < pb.num_tokens; ++t) {
    for (int j = 0; j < pb.top_k; ++j) {  // partial Fisher-Yates
      std::uniform_int_distribution<size_t> pick(static_cast<size_t>(j), choice.size() - 1);
      std::swap(choice[static_cast<size_t>(j)], choice[pick(rng)]);
      pb.topk_ids.push_back(choice[static_cast<size_t>(j)]);
      pb.topk_weights.push_back(weight(rng));
    }
  }
}

// Splits num_tokens over the ranks unevenly; with several ranks, rank 1 gets
// none (a rank that sends nothing).
std::vector<int64_t> split_tokens(int64_t num_tokens, int num_ranks, std::mt19937_64& rng) {
  std::vector<int64_t> split(static_cast<size_t>(num_ranks), 0);
  for (int64_t t = 0; t < num_tokens; ++t) {
    int r = static_cast<int>(rng() % static_cast<uint64_t>(num_ranks));
    if (num_ranks > 1 && r == 1) r = 0;
    ++split[static_cast<size_t>(r)];
  }
  return split;
}

ExpertPlacement random_table(int64_t num_experts, int num_ranks, std::mt19937_64& rng) {
  std::vector<int32_t> table(static_cast<size_t>(num_experts));
  std::vector<int32_t> order(static_cast<size_t>(num_experts));
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), rng);
  for (int64_t i = 0; i < num_experts; ++i)  // one expert per rank first, the rest anywhere
    table[static_cast<size_t>(order[static_cast<size_t>(i)])] =
        i < num_ranks ? static_cast<int32_t>(i) : static_cast<int32_t>(rng() % static_cast<uint64_t>(num_ranks));
  return ExpertPlacement::from_table(table, num_ranks);
}

// ------------------------------------------------------- invariant checks

// One rank's plan against its routing.
void check_dispatch_plan(const DispatchPlan& plan, const int32_t* ids, const float* weights,
                         const ExpertPlacement& placement) {
  const int k = plan.top_k;
  const int P = plan.num_ranks;
  const int64_t T = plan.num_tokens;
  const int64_t meta_words = dispatch_meta_words(k);
  ASSERT_EQ(plan.send_row_offsets.size(), static_cast<size_t>(P + 1));
  ASSERT_EQ(plan.send_pair_offsets.size(), static_cast<size_t>(P + 1));
  ASSERT_EQ(plan.num_send_pairs(), T * k);
  ASSERT_EQ(plan.send_token_idx.size(), static_cast<size_t>(plan.num_send_rows()));
  ASSERT_EQ(plan.send_meta.size(), static_cast<size_t>(plan.num_send_rows() * meta_words));
  const std::vector<int64_t> counts = plan.counts_messages();
  std::vector<int> seen(static_cast<size_t>(T * k), 0);
  for (int r = 0; r < P; ++r) {
    EXPECT_EQ(counts[static_cast<size_t>(2 * r)], plan.send_rows(r));
    EXPECT_EQ(counts[static_cast<size_t>(2 * r + 1)], plan.send_pair_count(r));
    // Dedup: exactly the tokens with a slot on r, once each, ascending.
    std::vector<int32_t> expected_tokens;
    for (int64_t t = 0; t < T; ++t)
      for (int j = 0; j < k; ++j)
        if (placement.rank_of_expert[static_cast<size_t>(ids[t * k + j])] == r) {
          expected_tokens.push_back(static_cast<int32_t>(t));
          break;
        }
    const std::vector<int32_t> sent_tokens(
        plan.send_token_idx.begin() + plan.send_row_offsets[static_cast<size_t>(r)],
        plan.send_token_idx.begin() + plan.send_row_offsets[static_cast<size_t>(r + 1)]);
    ASSERT_EQ(sent_tokens, expected_tokens) << "rows to rank " << r;
    for (int64_t row = plan.send_row_offsets[static_cast<size_t>(r)];
         row < plan.send_row_offsets[static_cast<size_t>(r + 1)]; ++row) {
      const int32_t* meta = plan.send_meta.data() + row * meta_words;
      const int32_t t = plan.send_token_idx[static_cast<size_t>(row)];
      ASSERT_EQ(meta[0], t);
      for (int j = 0; j < k; ++j) {
        const int32_t expert = ids[t * k + j];
        if (placement.rank_of_expert[static_cast<size_t>(expert)] == r) {
          ASSERT_EQ(meta[1 + j], placement.local_idx_of_expert[static_cast<size_t>(expert)]);
          ASSERT_EQ(meta[1 + k + j], std::bit_cast<int32_t>(weights[t * k + j]));
        } else {
          ASSERT_EQ(meta[1 + j], kSlotServedElsewhere) << "row " << row << " slot " << j;
          ASSERT_EQ(meta[1 + k + j], 0);
        }
      }
    }
    // Pairs: to the owner, in (token, slot) order.
    for (int64_t p = plan.send_pair_offsets[static_cast<size_t>(r)];
         p < plan.send_pair_offsets[static_cast<size_t>(r + 1)]; ++p) {
      const SendPair& sp = plan.send_pairs[static_cast<size_t>(p)];
      ASSERT_TRUE(sp.token_idx >= 0 && sp.token_idx < T && sp.slot >= 0 && sp.slot < k);
      const int32_t expert = ids[sp.token_idx * k + sp.slot];
      ASSERT_EQ(placement.rank_of_expert[static_cast<size_t>(expert)], r);
      ASSERT_EQ(sp.local_expert_idx, placement.local_idx_of_expert[static_cast<size_t>(expert)]);
      ASSERT_EQ(sp.send_row - plan.send_row_offsets[static_cast<size_t>(r)], sp.row_in_block);
      ASSERT_EQ(plan.send_token_idx[static_cast<size_t>(sp.send_row)], sp.token_idx);
      ASSERT_EQ(sp.weight_idx, sp.row_in_block * k + sp.slot);
      ++seen[static_cast<size_t>(sp.token_idx * k + sp.slot)];
      if (p > plan.send_pair_offsets[static_cast<size_t>(r)]) {
        const SendPair& prev = plan.send_pairs[static_cast<size_t>(p - 1)];
        ASSERT_TRUE(prev.token_idx < sp.token_idx || (prev.token_idx == sp.token_idx && prev.slot < sp.slot));
      }
    }
  }
  for (size_t i = 0; i < seen.size(); ++i) ASSERT_EQ(seen[i], 1) << "pair " << i << " sent " << seen[i] << " times";

  // Combine: a bijection onto the returned rows, each finding its own pair.
  const CombinePlan& c = plan.combine;
  ASSERT_EQ(c.recv_offsets, plan.send_pair_offsets);
  std::vector<int> hit(static_cast<size_t>(T * k), 0);
  for (int64_t t = 0; t < T; ++t)
    for (int j = 0; j < k; ++j) {
      const size_t ts = static_cast<size_t>(t * k + j);
      const int32_t src = c.source_rank[ts];
      ASSERT_EQ(src, placement.rank_of_expert[static_cast<size_t>(ids[ts])]);
      ASSERT_TRUE(c.position[ts] >= 0 && c.position[ts] < plan.send_pair_count(src));
      ASSERT_EQ(c.return_row_idx[ts], c.recv_offsets[static_cast<size_t>(src)] + c.position[ts]);
      const SendPair& sp = plan.send_pairs[static_cast<size_t>(c.return_row_idx[ts])];
      ASSERT_TRUE(sp.token_idx == t && sp.slot == j);
      ++hit[static_cast<size_t>(c.return_row_idx[ts])];
    }
  for (size_t i = 0; i < hit.size(); ++i) ASSERT_EQ(hit[i], 1) << "return row " << i;
}

// Every receiver's view against every sender's.
void check_receive_plans(const ExpertParallelSimulation& sim, const ExpertPlacement& placement) {
  const int P = placement.num_ranks;
  for (int r = 0; r < P; ++r) {
    const ReceivePlan& recv = sim.receive[static_cast<size_t>(r)];
    ASSERT_EQ(recv.num_local_experts, placement.num_local_experts(r));
    for (int s = 0; s < P; ++s) {
      const DispatchPlan& from = sim.dispatch[static_cast<size_t>(s)];
      EXPECT_EQ(recv.recv_row_offsets[static_cast<size_t>(s + 1)] - recv.recv_row_offsets[static_cast<size_t>(s)],
                from.send_rows(r))
          << "rows " << s << " -> " << r;
      EXPECT_EQ(recv.return_offsets[static_cast<size_t>(s + 1)] - recv.return_offsets[static_cast<size_t>(s)],
                from.send_pair_count(r))
          << "pairs " << s << " -> " << r;
    }
    // pairs_by_expert: a permutation, grouped by expert, stable within a group.
    ASSERT_EQ(recv.pairs_by_expert.size(), recv.pairs.size());
    ASSERT_EQ(recv.expert_offsets.back(), recv.num_recv_pairs());
    std::vector<int> hit(recv.pairs.size(), 0);
    for (int64_t e = 0; e < recv.num_local_experts; ++e)
      for (int64_t i = recv.expert_offsets[static_cast<size_t>(e)]; i < recv.expert_offsets[static_cast<size_t>(e + 1)];
           ++i) {
        const int64_t p = recv.pairs_by_expert[static_cast<size_t>(i)];
        ASSERT_EQ(recv.pairs[static_cast<size_t>(p)].local_expert_idx, e);
        if (i > recv.expert_offsets[static_cast<size_t>(e)])
          ASSERT_LT(recv.pairs_by_expert[static_cast<size_t>(i - 1)], p);
        ++hit[static_cast<size_t>(p)];
      }
    for (size_t i = 0; i < hit.size(); ++i) ASSERT_EQ(hit[i], 1);
  }
}

// Index of the first differing float, or -1; bitwise.
int64_t first_difference(const std::vector<float>& a, const std::vector<float>& b) {
  if (a.size() != b.size()) return 0;
  for (size_t i = 0; i < a.size(); ++i)
    if (std::bit_cast<uint32_t>(a[i]) != std::bit_cast<uint32_t>(b[i])) return static_cast<int64_t>(i);
  return -1;
}

// Runs one problem end to end under one placement and checks everything.
void run_problem(const Problem& pb, const ExpertPlacement& placement, const std::string& label) {
  SCOPED_TRACE(pb.describe() + " " + label);
  const MoeWeights& w = weights_for(pb.num_experts);
  const LocalExpertFn local = [&](int rank, int64_t n, const int32_t* local_idx, const float* weights, const float* x,
                                  float* out) {
    std::vector<int32_t> experts(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) experts[static_cast<size_t>(i)] = placement.global_expert(rank, local_idx[i]);
    reference_rows(w, n, experts.data(), weights, x, out);
  };
  const ExpertParallelSimulation sim =
      simulate_expert_parallel(pb.hidden_states.data(), kHidden, pb.topk_ids.data(), pb.topk_weights.data(),
                               pb.num_tokens, pb.top_k, pb.tokens_per_rank, placement, local);
  ASSERT_EQ(sim.dispatch.size(), static_cast<size_t>(pb.num_ranks));
  int64_t t0 = 0;
  for (int r = 0; r < pb.num_ranks; ++r) {
    SCOPED_TRACE("rank " + std::to_string(r));
    check_dispatch_plan(sim.dispatch[static_cast<size_t>(r)], pb.topk_ids.data() + t0 * pb.top_k,
                        pb.topk_weights.data() + t0 * pb.top_k, placement);
    if (::testing::Test::HasFatalFailure()) return;
    t0 += pb.tokens_per_rank[static_cast<size_t>(r)];
  }
  check_receive_plans(sim, placement);
  if (::testing::Test::HasFatalFailure()) return;

  // The single node: every pair's row, then each token's slots in slot order
  // from 0.0f in fp32 (the layer's deterministic finalize).
  const int64_t num_pairs = pb.num_tokens * pb.top_k;
  std::vector<float> x(static_cast<size_t>(num_pairs * kHidden));
  for (int64_t p = 0; p < num_pairs; ++p)
    for (int64_t n = 0; n < kHidden; ++n)
      x[static_cast<size_t>(p * kHidden + n)] =
          bf16_to_float(pb.hidden_states[static_cast<size_t>((p / pb.top_k) * kHidden + n)]);
  std::vector<float> rows(static_cast<size_t>(num_pairs * kHidden));
  if (num_pairs > 0) reference_rows(w, num_pairs, pb.topk_ids.data(), pb.topk_weights.data(), x.data(), rows.data());
  std::vector<float> single(static_cast<size_t>(pb.num_tokens * kHidden), 0.0f);
  for (int64_t t = 0; t < pb.num_tokens; ++t)
    for (int j = 0; j < pb.top_k; ++j)
      for (int64_t n = 0; n < kHidden; ++n)
        single[static_cast<size_t>(t * kHidden + n)] += rows[static_cast<size_t>((t * pb.top_k + j) * kHidden + n)];
  const int64_t diff = first_difference(sim.output, single);
  ASSERT_EQ(diff, -1) << "EP differs from the single node at [" << diff / kHidden << ", " << diff % kHidden
                      << "]: " << sim.output[static_cast<size_t>(diff)] << " vs " << single[static_cast<size_t>(diff)];

  // And the reference layer itself: equal for one slot; for several, the
  // reference sums in double, so only close.
  if (pb.num_tokens == 0) return;
  std::vector<float> hidden_f(pb.hidden_states.size());
  for (size_t i = 0; i < hidden_f.size(); ++i) hidden_f[i] = bf16_to_float(pb.hidden_states[i]);
  Routing routing{pb.num_tokens, pb.top_k, pb.topk_ids, pb.topk_weights};
  std::vector<float> ref(static_cast<size_t>(pb.num_tokens * kHidden));
  moe_reference(w, hidden_f.data(), routing, Activation::kSwiGLU, ref.data(), 1);
  if (pb.top_k == 1) {
    const int64_t d = first_difference(sim.output, ref);
    ASSERT_EQ(d, -1) << "EP differs from moe_reference at [" << d / kHidden << ", " << d % kHidden << "]";
  } else {
    double num = 0.0, den = 0.0;
    for (size_t i = 0; i < ref.size(); ++i) {
      num += (double{sim.output[i]} - ref[i]) * (double{sim.output[i]} - ref[i]);
      den += double{ref[i]} * ref[i];
    }
    EXPECT_LE(std::sqrt(num / den), 1e-6);
  }
}

// -------------------------------------------------------------- placement

TEST(ExpertPlacement, ContiguousSplitsEvenlyAndNumbersLocally) {
  const ExpertPlacement p = ExpertPlacement::contiguous(10, 4);  // 3, 3, 2, 2
  EXPECT_EQ(p.rank_of_expert, (std::vector<int32_t>{0, 0, 0, 1, 1, 1, 2, 2, 3, 3}));
  EXPECT_EQ(p.local_idx_of_expert, (std::vector<int32_t>{0, 1, 2, 0, 1, 2, 0, 1, 0, 1}));
  EXPECT_EQ(p.num_local_experts(0), 3);
  EXPECT_EQ(p.num_local_experts(3), 2);
  EXPECT_EQ(p.global_expert(2, 1), 7);
  EXPECT_EQ(p.describe().substr(0, 26), "rank 0: 3 experts [0, 1, 2");
  const ExpertPlacement even = ExpertPlacement::contiguous(256, 8);
  for (int r = 0; r < 8; ++r) EXPECT_EQ(even.num_local_experts(r), 32);
  EXPECT_EQ(even.rank_of_expert[255], 7);
}

TEST(ExpertPlacement, FromTableOrdersLocalExpertsByGlobalId) {
  const ExpertPlacement p = ExpertPlacement::from_table({2, 0, 1, 0, 2, 2, 1}, 3);
  EXPECT_EQ(p.local_idx_of_expert, (std::vector<int32_t>{0, 0, 0, 1, 1, 2, 1}));
  EXPECT_EQ(p.experts_by_rank, (std::vector<int32_t>{1, 3, 2, 6, 0, 4, 5}));
  for (int64_t e = 0; e < p.num_experts; ++e)
    EXPECT_EQ(p.global_expert(p.rank_of_expert[static_cast<size_t>(e)], p.local_idx_of_expert[static_cast<size_t>(e)]),
              e);
}

TEST(ExpertPlacement, RejectsBadInputs) {
  expect_error([] { ExpertPlacement::contiguous(4, 8); }, {"num_experts = 4", "expected >= num_ranks = 8"});
  expect_error([] { ExpertPlacement::contiguous(8, 0); }, {"num_ranks = 0"});
  expect_error([] { ExpertPlacement::from_table({0, 0, 2}, 3); }, {"rank 1 owns no expert"});
  expect_error([] { ExpertPlacement::from_table({0, 3}, 2); }, {"expert 1 is placed on rank 3", "[0, 2)"});
  expect_error([] { ExpertPlacement::from_table({0, -1}, 2); }, {"expert 1 is placed on rank -1"});
  expect_error([] { ExpertPlacement::from_table({}, 1); }, {"0 entries"});
  const ExpertPlacement p = ExpertPlacement::contiguous(8, 2);
  expect_error([&] { p.global_expert(1, 4); }, {"local index 4 on rank 1", "[0, 4)"});
  expect_error([&] { p.num_local_experts(2); }, {"rank = 2"});
}

// ----------------------------------------------------------- plan details

TEST(DispatchPlan, DeduplicatesSlotsOnOneRankAndKeepsSlotPositions) {
  // 8 experts on 2 ranks (0-3, 4-7). Token 0: experts 1, 5, 2 -> rank 0 serves
  // slots 0 and 2, rank 1 slot 1. Token 1: 6, 7, 4 -> rank 1 only.
  const ExpertPlacement p = ExpertPlacement::contiguous(8, 2);
  const std::vector<int32_t> ids = {1, 5, 2, 6, 7, 4};
  const std::vector<float> w = {0.5f, 0.25f, 0.125f, 1.0f, 2.0f, 3.0f};
  const DispatchPlan plan = plan_dispatch(ids.data(), 2, 3, p, 0, w.data());
  EXPECT_EQ(plan.send_row_offsets, (std::vector<int64_t>{0, 1, 3}));
  EXPECT_EQ(plan.send_pair_offsets, (std::vector<int64_t>{0, 2, 6}));
  EXPECT_EQ(plan.send_token_idx, (std::vector<int32_t>{0, 0, 1}));
  const auto bits = [](float f) { return std::bit_cast<int32_t>(f); };
  EXPECT_EQ(plan.send_meta,
            (std::vector<int32_t>{0, 1,  -1, 2,  bits(0.5f), 0,           bits(0.125f),   // token 0 -> rank 0
                                  0, -1, 1,  -1, 0,          bits(0.25f), 0,              // token 0 -> rank 1
                                  1, 2,  3,  0,  bits(1.0f), bits(2.0f),  bits(3.0f)}));  // token 1 -> rank 1
  EXPECT_EQ(plan.counts_messages(), (std::vector<int64_t>{1, 2, 2, 4}));
  // Return rows: rank 0 sends back (0,0), (0,2); rank 1 (0,1), (1,0), (1,1), (1,2).
  EXPECT_EQ(plan.combine.return_row_idx, (std::vector<int64_t>{0, 2, 1, 3, 4, 5}));
  EXPECT_EQ(plan.combine.position, (std::vector<int64_t>{0, 0, 1, 1, 2, 3}));
  EXPECT_EQ(plan.combine.source_rank, (std::vector<int32_t>{0, 1, 0, 1, 1, 1}));
  // Without weights, the weight words stay zero.
  const DispatchPlan bare = plan_dispatch(ids.data(), 2, 3, p, 0);
  EXPECT_EQ(bare.send_meta[4], 0);
  EXPECT_EQ(bare.send_token_idx, plan.send_token_idx);
}

TEST(DispatchPlan, RejectsBadInputs) {
  const ExpertPlacement p = ExpertPlacement::contiguous(8, 2);
  const std::vector<int32_t> ids = {1, 8};
  expect_error([&] { plan_dispatch(ids.data(), 1, 2, p, 0); }, {"token 0 slot 1", "expert id 8", "[0, 8)"});
  expect_error([&] { plan_dispatch(ids.data(), 1, 2, p, 2); }, {"my_rank = 2"});
  expect_error([&] { plan_dispatch(ids.data(), 1, 0, p, 0); }, {"top_k = 0"});
  expect_error([&] { plan_dispatch(ids.data(), -1, 2, p, 0); }, {"num_tokens = -1"});
  const std::vector<int32_t> good = {1, 2};
  const std::vector<float> nan = {1.0f, NAN};
  expect_error([&] { plan_dispatch(good.data(), 1, 2, p, 0, nan.data()); }, {"slot 1", "not finite"});
  expect_error([&] { plan_dispatch(good.data(), 1, 2, ExpertPlacement{}, 0); }, {"placement is not built"});
}

TEST(ReceivePlan, RejectsMetadataThatDisagreesWithTheCounts) {
  const ExpertPlacement p = ExpertPlacement::contiguous(8, 2);
  const std::vector<int32_t> ids = {1, 2, 5, 6};  // token 0 -> rank 0 (2 slots), token 1 -> rank 1
  const DispatchPlan plan = plan_dispatch(ids.data(), 2, 2, p, 0);
  // Rank 0 receives from rank 0 (itself) and, say, nothing from rank 1.
  std::vector<int64_t> counts = {plan.send_rows(0), plan.send_pair_count(0), 0, 0};
  std::vector<int32_t> meta(plan.send_meta.begin(), plan.send_meta.begin() + dispatch_meta_words(2));
  const ReceivePlan ok = plan_receive(counts.data(), meta.data(), 2, p, 0);
  EXPECT_EQ(ok.num_recv_pairs(), 2);
  counts[1] = 1;  // announces one pair, the row serves two
  expect_error([&] { plan_receive(counts.data(), meta.data(), 2, p, 0); }, {"rank 0 announced 1 pairs", "serve 2"});
  counts[1] = 2;
  meta[1] = 4;  // rank 0 has local experts 0..3
  expect_error([&] { plan_receive(counts.data(), meta.data(), 2, p, 0); }, {"local expert 4", "[0, 4)"});
  meta[1] = meta[2] = -1;
  counts[1] = 1;
  expect_error([&] { plan_receive(counts.data(), meta.data(), 2, p, 0); }, {"serves no slot on rank 0"});
  counts = {1, 3, 0, 0};  // more pairs than rows * top_k
  expect_error([&] { plan_receive(counts.data(), meta.data(), 2, p, 0); }, {"announced 1 rows serving 3 pairs"});
}

TEST(Simulation, RejectsATokenSplitThatDoesNotAddUp) {
  const ExpertPlacement p = ExpertPlacement::contiguous(8, 2);
  const std::vector<int32_t> ids = {1};
  const std::vector<float> w = {1.0f};
  const std::vector<uint16_t> h(kHidden, 0);
  const LocalExpertFn none = [](int, int64_t, const int32_t*, const float*, const float*, float*) {};
  expect_error(
      [&] {
        simulate_expert_parallel(h.data(), kHidden, ids.data(), w.data(), 1, 1, {0, 0}, p, none);
      },
      {"sums to 0", "num_tokens = 1"});
  expect_error([&] { simulate_expert_parallel(h.data(), kHidden, ids.data(), w.data(), 1, 1, {1}, p, none); },
               {"1 entries", "num_ranks = 2"});
}

// ------------------------------------------------------- the enumeration

struct Shape {
  int num_ranks;
  int64_t num_experts;
};

class EndToEnd : public ::testing::TestWithParam<Shape> {};

TEST_P(EndToEnd, EveryTopKTokenCountPlacementAndRouting) {
  const auto [num_ranks, num_experts] = GetParam();
  std::mt19937_64 rng(static_cast<uint64_t>(num_ranks * 1000 + num_experts));
  std::vector<std::pair<std::string, ExpertPlacement>> placements;
  placements.emplace_back("contiguous", ExpertPlacement::contiguous(num_experts, num_ranks));
  placements.emplace_back("random table", random_table(num_experts, num_ranks, rng));
  for (int top_k : {1, 2, 8}) {
    for (int64_t num_tokens : {0, 1, 3, 64, 1000}) {
      Problem pb;
      pb.num_ranks = num_ranks;
      pb.num_experts = num_experts;
      pb.top_k = top_k;
      pb.num_tokens = num_tokens;
      pb.tokens_per_rank = split_tokens(num_tokens, num_ranks, rng);
      std::normal_distribution<float> normal(0.0f, 1.0f);
      for (int64_t i = 0; i < num_tokens * kHidden; ++i) pb.hidden_states.push_back(float_to_bf16(normal(rng)));
      for (const auto& [name, placement] : placements) {
        std::vector<int32_t> all(static_cast<size_t>(num_experts));
        std::iota(all.begin(), all.end(), 0);
        route_from(pb, all, rng);
        run_problem(pb, placement, name + ", uniform routing");
        if (HasFatalFailure()) return;
        // Skewed: every token to experts of the last rank owning >= top_k.
        for (int target = num_ranks - 1; target >= 0; --target) {
          if (placement.num_local_experts(target) < top_k) continue;
          std::vector<int32_t> pool;
          for (int64_t i = 0; i < placement.num_local_experts(target); ++i)
            pool.push_back(placement.global_expert(target, i));
          route_from(pb, pool, rng);
          const std::string label = name + ", skewed to rank " + std::to_string(target);
          run_problem(pb, placement, label);
          if (HasFatalFailure()) return;
          // Only the target receives anything (ranks receiving nothing).
          const ExpertParallelSimulation sim = simulate_expert_parallel(
              pb.hidden_states.data(), kHidden, pb.topk_ids.data(), pb.topk_weights.data(), num_tokens, top_k,
              pb.tokens_per_rank, placement,
              [&](int rank, int64_t n, const int32_t* local_idx, const float* weights, const float* x, float* out) {
                std::vector<int32_t> experts(static_cast<size_t>(n));
                for (int64_t i = 0; i < n; ++i)
                  experts[static_cast<size_t>(i)] = placement.global_expert(rank, local_idx[i]);
                reference_rows(weights_for(num_experts), n, experts.data(), weights, x, out);
              });
          for (int r = 0; r < num_ranks; ++r)
            EXPECT_EQ(sim.receive[static_cast<size_t>(r)].num_recv_rows(), r == target ? num_tokens : 0)
                << label << ", rank " << r;
          break;
        }
      }
    }
  }
}

std::vector<Shape> all_shapes() {
  std::vector<Shape> shapes;
  for (int num_ranks : {1, 2, 3, 4, 8})
    for (int64_t num_experts : {8, 64, 256}) shapes.push_back({num_ranks, num_experts});
  return shapes;
}

INSTANTIATE_TEST_SUITE_P(Shapes, EndToEnd, ::testing::ValuesIn(all_shapes()),
                         [](const ::testing::TestParamInfo<Shape>& info) {
                           return "P" + std::to_string(info.param.num_ranks) + "_E" +
                                  std::to_string(info.param.num_experts);
                         });

}  // namespace
}  // namespace fp4moe
