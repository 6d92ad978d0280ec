// Expert parallelism, public part: which rank owns which expert
// (ExpertParallelMoeLayer, expert_parallel_layer.hpp, takes a placement). The
// dispatch/combine plans that follow from it are internal
// (src/ep/dispatch_plan.hpp); the design is docs/expert-parallel.md.
//
// Tested in tests/ep/test_dispatch_plan.cpp (CPU).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace fp4moe {

// Which rank owns each expert. A rank's experts are numbered 0.. in ascending
// global id: that is their local index, the expert index of the rank's own
// grouped GEMMs.
struct ExpertPlacement {
  int64_t num_experts = 0;
  int num_ranks = 0;
  std::vector<int32_t> rank_of_expert;       // [num_experts]
  std::vector<int32_t> local_idx_of_expert;  // [num_experts] index among its rank's experts
  std::vector<int64_t> rank_expert_offsets;  // [num_ranks + 1] into experts_by_rank
  std::vector<int32_t> experts_by_rank;      // [num_experts] global ids, rank-major, ascending per rank

  // Contiguous blocks of experts: rank r owns [r * E / P, (r + 1) * E / P)
  // when P divides E; otherwise the first E % P ranks own one expert more.
  // Throws unless 1 <= num_ranks <= num_experts.
  static ExpertPlacement contiguous(int64_t num_experts, int num_ranks);
  // Any expert -> rank table. Throws naming the offending expert or rank when
  // an id is outside [0, num_ranks) or a rank owns no expert.
  static ExpertPlacement from_table(const std::vector<int32_t>& rank_of_expert, int num_ranks);

  int64_t num_local_experts(int rank) const;
  int32_t global_expert(int rank, int64_t local_idx) const;
  std::string describe() const;  // one line per rank: "rank 1: 3 experts [4, 7, 9]"
};

}  // namespace fp4moe
