// The measurements behind `fp4moe tune` (docs/design.md §4.6): one grouped
// GEMM of an MoE layer, launched as MoeLayer launches it, timed with every
// candidate config and split-K (src/tune/tune.hpp) at a token bucket.
//
// Per bucket of T tokens: `routings` top-k routings of T tokens (uniform, or
// skewed by `routing_skew`: skewed_topk_ids),
// permuted into expert order by the layer's own sort kernel, with random
// inputs; every timed launch starts from a flushed L2 (L2Flusher) and the
// launches rotate over the routings, so no candidate is timed on one lucky
// routing. Pass 1 times every candidate (`iterations` launches, the median;
// the heuristic's own choice first, and a candidate whose first launch is
// `prune_slower_than` times slower than the best so far is not timed
// further); pass 2 times the `finalists` fastest and the heuristic's choice
// again with twice the launches, and the fastest of those wins, unless the
// heuristic's choice is within `keep_heuristic_within` of it (noise: the
// heuristic then stays, and the cache records it as tuned). Pass 3 times the
// winner and the heuristic's choice again, `confirm_rounds` rounds of
// `iterations` launches each, alternating: the speedup reported and cached
// comes from this pass alone, since the times that picked the winner carry
// the winner's curse (the fastest of several noisy medians is low by
// construction) and would make any choice look at least as fast as the
// heuristic's.
//
// The GPU test tests/tune/test_tune_gpu.cpp launches every candidate through
// GemmTuneBench and checks each output against a CPU reference.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "fp4moe/plan.hpp"
#include "fp4moe/reference.hpp"
#include "gemm_bench.hpp"
#include "kernels/grouped_gemm.hpp"
#include "tune/tune.hpp"

namespace fp4moe::bench {

// The MoE layer shape being tuned: a model of tools/models.hpp or a checkpoint's.
struct TuneShape {
  std::string name;
  int64_t num_experts = 0;
  int top_k = 0;
  int64_t hidden = 0;  // H: GEMM1's K, GEMM2's N
  int64_t inter = 0;   // I: GEMM1's N is 2 I, GEMM2's K
  Activation activation = Activation::kSwiGLU;
  bool has_bias = false;  // gate/up/down biases (gpt-oss)
};

// One grouped GEMM of a layer on the current device. GEMM 1 reads hidden
// states [T, hidden] through the permutation (the fused gather) and applies
// the SwiGLU epilogue with the shape's activation and gate/up biases; with a
// tile that the default layer precedes with its separate gather pass
// (auto_gather_is_separate, src/layer/moe_layer_internals.hpp: SM90 tiles
// read by tensor map), a launch is that pass and GEMM 1 on the sorted copy,
// so the candidate is timed as the layer runs it. GEMM 2
// reads activated rows [rows, inter] in expert order and stores each row,
// plus its bias, times its router weight, rounded to bf16, at its (token,
// slot) row (the deterministic finalize). Weights are random_gemm_weights();
// split-K counters and the error word live outside the workspace, as in the
// layer, so plans of any tile count can follow each other on one workspace.
class GemmTuneBench {
 public:
  GemmTuneBench(const TuneShape& shape, int gemm, uint64_t seed);
  ~GemmTuneBench();
  GemmTuneBench(const GemmTuneBench&) = delete;
  GemmTuneBench& operator=(const GemmTuneBench&) = delete;

  // Draws `num_routings` routings of num_tokens tokens (skewed_topk_ids
  // with `routing_skew`, each with its own expert popularity) and fresh inputs.
  void set_tokens(int64_t num_tokens, int num_routings, double routing_skew = 0);
  int64_t num_tokens() const;
  // This GEMM at the current token count, as MoeLayer plans it.
  GemmProblem problem(bool batch_invariant) const;

  // One launch of `plan` on routing `routing_idx` (the workspace grows, and
  // is zeroed, when a plan needs more; that synchronises).
  void launch(const GemmPlan& plan, int routing_idx, cudaStream_t stream = nullptr);
  // time_median_us of `iterations` launches rotating over the routings.
  double time_us(const GemmPlan& plan, int iterations, const L2Flusher& flusher, cudaStream_t stream = nullptr);
  // Device-side errors of the launches so far (grouped_gemm_device_errors),
  // then cleared; synchronises.
  std::string device_errors();

  // What the last launches computed from, for checks on the host.
  struct HostCopy {
    PreparedGemmWeights weights;        // this GEMM's [E][n, k], global scales included
    std::vector<float> bias;            // [E][n], empty without biases
    std::vector<uint16_t> x;            // bf16: GEMM 1 [T, hidden], GEMM 2 [rows, inter]
    std::vector<int32_t> offsets;       // [E + 1] of the routing
    std::vector<int32_t> token_of_row;  // [rows]: GEMM 1's gather rows
    std::vector<int32_t> pair_of_row;   // [rows]: GEMM 2's scatter rows
    std::vector<float> row_weights;     // [rows] router weight per (token, slot) pair
  };
  HostCopy host_copy(int routing_idx) const;
  // Fills the output with NaN bytes, so that an unwritten element shows.
  void poison_output();
  // The output as floats: GEMM 1 bf16 [rows, inter]; GEMM 2 bf16 [rows,
  // hidden] by (token, slot) pair.
  std::vector<float> output() const;

 private:
  struct State;
  std::unique_ptr<State> state_;
};

struct TuneSettings {
  int iterations = 10;                  // pass 1: timed launches per candidate (median)
  int routings = 4;                     // routings rotated over
  double routing_skew = 0;              // 0: uniform routings; > 0: skewed (skewed_topk_ids)
  int finalists = 3;                    // pass 2: re-timed with the heuristic's choice, 2x the launches
  double keep_heuristic_within = 0.01;  // the heuristic's choice stays unless beaten by more
  double prune_slower_than = 2.0;       // pass 1: stop timing a candidate this much slower than the best (0: never)
  int confirm_rounds = 3;               // pass 3: alternating rounds of the winner and the heuristic's choice
  tune::DeviceLimits limits;            // the candidates' budget and compute capability
  bool batch_invariant = false;         // tune a batch-invariant layer's choices
};

struct BucketResult {
  GemmProblem problem;
  int num_candidates = 0;
  tune::Candidate tuned;
  double tuned_us = 0;        // pass 2: the selection's time
  tune::Candidate heuristic;  // what MoeLayer plans without a tuned choice
  double heuristic_us = 0;    // pass 2
  // Pass 3, separate from the selection: the median over confirm_rounds of
  // each round's median (the same plan twice where tuned == heuristic).
  double confirmed_tuned_us = 0, confirmed_heuristic_us = 0;
  double speedup() const { return confirmed_heuristic_us / confirmed_tuned_us; }
  bool heuristic_is_candidate = true;  // false when --smem-budget excludes it
  int pruned = 0;                      // candidates timed once only (prune_slower_than)
  int64_t timed_launches = 0;
};

// Tunes `bench`'s GEMM at num_tokens tokens (see the file comment).
// `progress` is called after each timed candidate with the launches it took
// (warm-up included). Throws when the device reports errors.
BucketResult tune_bucket(GemmTuneBench& bench, int64_t num_tokens, const TuneSettings& settings,
                         const L2Flusher& flusher, const std::function<void(int64_t launches)>& progress = {});

// A rough GPU time, in us, of one timed launch for `problem` (an L2 flush of
// flush_us and the kernel at 40 % of a nominal roofline: 4 TB/s, 700
// TFLOP/s) and of tune_bucket with `num_candidates` candidates. For the
// estimate printed before a run and its progress bar.
double estimate_launch_us(const GemmProblem& problem, double flush_us);
double estimate_bucket_us(const GemmProblem& problem, int num_candidates, const TuneSettings& settings,
                          double flush_us);

}  // namespace fp4moe::bench
