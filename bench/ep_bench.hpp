// Benchmark of the expert-parallel MoE layer (ExpertParallelMoeLayer) over
// P GPUs of one machine, run through `fp4moe bench --layer --ep P`.
//
// For each model and total token count T (split in order over the ranks,
// each routing its own tokens on the device from random logits, random
// NVFP4 weights for all experts, experts placed contiguously), every rank
// flushes its L2, then runs timed forwards; per phase (route, dispatch,
// experts, return, combine: ExpertParallelTimes) the median over the
// iterations is taken on each rank and the slowest rank's is reported. The
// all-to-all time (dispatch + return) is shown on its own, with the bytes a
// rank moved and the rate that gives, next to an all-to-all of large
// messages measured with NCCL in the same run. Peer: the single-GPU layer
// (batch invariant, all experts on GPU 0) on the same T, L2 flushed too.
//
// The phases include the host work between them (three stream
// synchronisations per forward: routing ids, counts, metadata), which is
// part of the layer's cost today (docs/expert-parallel.md).
#pragma once

#include <cstdint>
#include <ostream>
#include <vector>

#include "layer_bench.hpp"

namespace fp4moe::bench {

struct EpBenchOptions {
  std::vector<LayerShape> models;
  std::vector<int64_t> tokens = {1, 16, 64, 256, 1024, 4096};
  int num_ranks = 2;
  int iterations = 20;
  uint64_t seed = 1;
};

// Prints a table to `table` and one JSON object per case to `json` (if not
// null). Throws fp4moe::Error unless the machine has num_ranks GPUs.
void run_ep_bench(const EpBenchOptions& options, std::ostream& table, std::ostream* json);

}  // namespace fp4moe::bench
