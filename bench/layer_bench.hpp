// Benchmark of the whole GPU MoE layer (fp4moe::MoeLayer, routing included)
// against the layer roofline, measured in the same run.
//
// For each model and token count T: random normal router logits routed on
// the device with the model's routing mode, random NVFP4 weights for ALL
// experts, random bf16 hidden states. Per case, with the L2 flushed before
// every timed forward (medians of CUDA-event-timed forwards):
//   - the whole forward (no stage events),
//   - the stage split from MoeStageEvents (routing, sort, gather, GEMM1,
//     GEMM2, finalize) in a separate set of forwards, and the share of time
//     outside the two GEMMs: (total - gemm1 - gemm2) / total,
//   - for the default variant, a CUDA-graph replay of the forward,
// for finalize in {deterministic, atomic} x gather in {auto, fused, separate}, and
// the default with plain launches and made batch invariant.
//
// Layer roofline: docs/design.md §6 applied to each stage, with the bytes
// that stage must move, and summed:
//   GEMM1: n = 2 * inter, k = hidden, but its fused SwiGLU writes rows x inter
//          (not rows x 2 inter);
//   GEMM2: n = hidden, k = inter, writing one bf16 row per (token, slot);
//   combine: those rows read once and the bf16 output [T, hidden] written;
//   t_roof = t_roof(GEMM1) + t_roof(GEMM2) + t_roof(combine),
// with the memory ceiling (max of copy and streaming read) and the cuBLAS
// bf16 rate measured at start-up (bench/gemm_bench.hpp). GEMM2's rows are
// counted at bf16, the least that rows computed by different blocks and
// summed in a fixed order can move, and what the deterministic finalize
// writes and reads back. Routing and sort get no budget: their
// bytes (logits, ids) are negligible beside the weights, and the time they
// take is what the "outside" share shows.
//
// The weights are random codes, not a trained checkpoint: the kernels' cost
// does not depend on the values, and drawing codes is what makes ALL experts
// of a 256-expert model (5-6 GB) quick to build on the host.
//
// Run through `fp4moe bench --layer`; the `fp4moe demo` timing table uses
// LayerTimer and measure_layer. Exercised on a GPU by tests/tools/
// test_cli_gpu.cpp (a small model, few iterations).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <ostream>
#include <string>
#include <vector>

#include "fp4moe/moe_layer.hpp"
#include "fp4moe/reference.hpp"
#include "gemm_bench.hpp"
#include "kernels/timeline.hpp"
#include "layer/moe_layer_internals.hpp"  // MoeStageEvents
#include "util/splitmix64.hpp"

namespace fp4moe::bench {

// One MoE layer shape with how it routes and activates.
struct LayerShape {
  std::string name;
  int64_t num_experts = 0;
  int64_t hidden = 0;     // H
  int64_t inter = 0;      // I (moe_intermediate_size)
  RoutingParams routing;  // routing.top_k is the layer's top-k
  Activation activation = Activation::kSwiGLU;
  bool has_bias = false;  // gate/up/down biases (gpt-oss)
};

// Random NVFP4 weights for every expert of `shape`, drawn on all host cores
// with a fast generator: uniform e2m1 codes, e4m3 block scales among the
// codes 0x28..0x48 (0.125 .. 2.0), and a global scale that gives each
// projection unit gain on unit-variance inputs, so outputs stay O(1) and
// finite. Biases (has_bias) are uniform in [-0.1, 0.1]. For timing only.
MoeWeights random_moe_weights(const LayerShape& shape, uint64_t seed);

// Random NVFP4 codes (uniform over all 16 nibbles) and block scales uniform
// over the e4m3 codes first_scale_code .. + num_scale_codes - 1 (at most
// 256), with the given global scale; input_scale 1.
Nvfp4Matrix random_nvfp4_matrix(int64_t rows, int64_t cols, float global_scale, uint8_t first_scale_code,
                                int num_scale_codes, SplitMix64& rng);

// The global scale that gives a projection with k inputs unit gain on
// unit-variance inputs, Var(w.x) = k E[e2m1^2] E[e4m3^2] s^2 = 1, for codes
// uniform over all 16 nibbles and block scales uniform over the e4m3 codes
// first_scale_code .. + num_scale_codes - 1.
float unit_gain_global_scale(int64_t k, uint8_t first_scale_code, int num_scale_codes);

// How the benchmark's router logits spread the tokens over the experts:
//   kUniform    logits ~ N(0, 1), no correction bias: every expert is equally
//               likely, the top-k a uniformly random set (the GEMM bench's
//               balance);
//   kRealistic  logits ~ N(0, 1) + s z_e with one z_e ~ N(0, 1) per expert
//               (a fixed popularity) and no correction bias, s chosen so that
//               at T = 4096 the hottest expert gets 2.5x the mean rows
//               (kRealisticHotShare); for GLM-5 and DeepSeek-V3 the median
//               expert then gets ~0.9x the mean, the spread a trained router
//               balanced by its correction bias leaves in serving;
//   kSkewed     logits ~ N(0, 1) and a correction bias ~ 0.1 N(0, 1), which
//               under the sigmoid routings is far more uneven (GLM-5 at T =
//               4096: the hottest expert 5.7x the mean, 17x the median).
// The rows each expert gets at each T are in the benchmark's output.
enum class RouterLoad { kUniform, kRealistic, kSkewed };
std::string to_string(RouterLoad load);
RouterLoad parse_router_load(const std::string& name);  // "uniform", "realistic", "skewed"
inline constexpr double kRealisticHotShare = 2.5;
inline constexpr int64_t kRealisticCalibrationTokens = 4096;

// The router inputs LayerTimer gives a layer routing with `routing` over
// num_experts experts, [max_tokens, num_experts] logits and a [num_experts]
// correction bias drawn from `seed` as `load` says; popularity_scale is
// kRealistic's s (0 otherwise). The hidden states are fill_random_bf16(seed +
// 17) over [max_tokens, hidden]. The expert-parallel benchmark gives its
// ranks the same tokens.
struct RouterInputs {
  std::vector<float> logits, bias;
  double popularity_scale = 0.0;
};
RouterInputs random_router_inputs(int64_t max_tokens, int64_t num_experts, const RoutingParams& routing, uint64_t seed,
                                  RouterLoad load = RouterLoad::kSkewed);
inline constexpr uint64_t kHiddenSeedOffset = 17;

// The layer roofline of one forward (see the file comment).
struct LayerRoofline {
  int64_t rows = 0;            // num_tokens * top_k
  int64_t active_experts = 0;  // experts with at least one row
  GemmCost gemm1, gemm2, combine;
  double gemm1_roof_us = 0, gemm2_roof_us = 0, combine_roof_us = 0;
  double roof_us = 0;  // the sum

  double bytes() const { return gemm1.bytes + gemm2.bytes + combine.bytes; }
  // The layer's bytes take longer at the memory ceiling than its flops at
  // the bf16 rate.
  bool memory_bound(const Ceilings& ceilings) const {
    return bytes() / ceilings.memory_bytes_per_s() >= (gemm1.flops + gemm2.flops) / ceilings.bf16_flops_per_s;
  }
};
LayerRoofline layer_roofline(int64_t hidden, int64_t inter, int64_t num_tokens, int64_t rows, int64_t active_experts,
                             const Ceilings& ceilings);

// Medians over the timed forwards, in us, of each stage between two
// consecutive MoeStageEvents, and of the whole (start -> end). Routing and
// the sort are one stage (one kernel at small batches); gather_us is 0 when
// the gather is fused into GEMM1 (no events are recorded around it).
struct StageTimes {
  double route_sort_us = 0, gather_us = 0, gemm1_us = 0, gemm2_us = 0, finalize_us = 0;
  double total_us = 0;
  // (total - gemm1 - gemm2) / total
  double outside_gemm_share() const { return total_us > 0 ? (total_us - gemm1_us - gemm2_us) / total_us : 0.0; }
};

// Device inputs and buffers for timing forwards of one prepared layer: bf16
// hidden states in [-1, 1) and fp32 router logits and correction bias as
// random_router_inputs draws them for `load`, for up to max_tokens tokens (a
// forward of T tokens reads the first T rows; the bias is read by noaux_tc
// routing only), the output
// and a zeroed workspace, all on one non-blocking stream of its own (so the
// forward can be captured in a CUDA graph). The same seed gives the same
// inputs, so several variants of a layer see identical tokens and routing.
class LayerTimer {
 public:
  LayerTimer(const MoeLayer& layer, int64_t max_tokens, uint64_t seed, RouterLoad load = RouterLoad::kSkewed);
  ~LayerTimer();
  LayerTimer(const LayerTimer&) = delete;
  LayerTimer& operator=(const LayerTimer&) = delete;

  // How the layer's routing of the first `tokens` tokens loads the experts,
  // from the CPU reference's routing of the same logits (ties aside, what the
  // device routes): the experts it selects, the rows of the most loaded one
  // and of the median one among those, and the mean over all experts
  // (tokens * top_k / num_experts). Only kUniform matches the tile planner's
  // Poisson model.
  struct ExpertLoad {
    int64_t active = 0;
    int64_t max_rows = 0;
    int64_t median_rows = 0;
    double mean_rows = 0;
  };
  ExpertLoad expert_load(int64_t tokens) const;
  RouterLoad load() const { return load_; }
  double popularity_scale() const { return popularity_scale_; }  // RouterInputs::popularity_scale
  int64_t active_experts(int64_t tokens) const { return expert_load(tokens).active; }

  double time_forward_us(int64_t tokens, int iterations, const L2Flusher& flusher);
  // One forward from a flushed L2 with every block of every kernel stamped
  // (kernels/timeline.hpp; a build with FP4MOE_TIMELINE): the records.
  std::vector<kernels::TimelineRecord> timeline(int64_t tokens, const L2Flusher& flusher);
  StageTimes time_stages(int64_t tokens, int iterations, const L2Flusher& flusher);
  // Captures one forward into a CUDA graph and times its replays against
  // eager forwards taken in turn with them (time_interleaved_us, L2 flushed,
  // medians of `iterations` each), and the host time of one cudaGraphLaunch
  // call (median of `iterations` launches back to back).
  struct GraphTimes {
    double device_us = 0;
    double eager_us = 0;  // the eager forwards interleaved with the replays
    double launch_host_us = 0;
  };
  GraphTimes time_graph(int64_t tokens, int iterations, const L2Flusher& flusher);
  // Host time of one eager forward() call (checks, planning lookups,
  // launches), the median of `calls` calls enqueued back to back.
  double host_us_per_forward(int64_t tokens, int calls);

  // Elements of the last forward's output [tokens, hidden] that are NaN or
  // infinite (a broken layer must not be timed silently), and the device
  // errors the layer recorded; synchronises.
  int64_t count_nonfinite_outputs(int64_t tokens) const;
  std::string device_errors() const;

 private:
  MoeForwardArgs args(int64_t tokens) const;
  void forward(int64_t tokens, const MoeStageEvents* events) const;

  struct Buffers;
  const MoeLayer& layer_;
  int64_t max_tokens_;
  RouterLoad load_;
  double popularity_scale_ = 0.0;
  std::vector<float> host_logits_;  // [max_tokens, num_experts]
  std::vector<float> host_bias_;    // [num_experts]
  std::unique_ptr<Buffers> buffers_;
  cudaStream_t stream_ = nullptr;
};

// Everything one benchmark case reports.
struct LayerMeasurement {
  int64_t tokens = 0;
  LayerRoofline roofline;
  double time_us = 0;               // plain forward
  double graph_us = 0;              // CUDA-graph replay; 0 when not measured
  double graph_eager_us = 0;        // eager forwards interleaved with the replays
  double host_us = 0;               // host time of one forward() call; measured with the graph
  double graph_launch_host_us = 0;  // host time of one replay's cudaGraphLaunch
  double launch_floor_us = 0;       // host time of the forward's 4 launches of an empty kernel
  StageTimes stages;
  LayerTimer::ExpertLoad expert_load;
  double efficiency = 0;  // roof_us / time_us
  // Against the roofline at the sustained bf16 rate (Ceilings::sustained):
  // where the GPU's power limit, not the burst rate, bounds the arithmetic.
  double efficiency_sustained = 0;
  // Where the layer is memory-bound: one streaming read of all its bytes
  // (time_stream_read_us), the one-stream peer of the forward's kernels;
  // 0 elsewhere.
  double read_peer_us = 0;
  int64_t nonfinite_outputs = 0;
};
// Host time (median of `calls`) of `launches` back-to-back launches of an
// empty kernel, the floor under a forward's host time.
double launch_floor_us(int launches, bool programmatic, cudaStream_t stream, int calls);

LayerMeasurement measure_layer(LayerTimer& timer, const MoeLayer& layer, int64_t tokens, int iterations,
                               bool with_graph, const Ceilings& ceilings, const L2Flusher& flusher);

struct LayerBenchOptions {
  std::vector<LayerShape> models;
  std::vector<int64_t> tokens = {1, 16, 64, 256, 1024};
  std::vector<RouterLoad> loads = {RouterLoad::kRealistic};
  int iterations = 20;
  bool with_graph = true;            // graph replay of the default variant
  bool default_only = false;         // skip the other variants (plain launches, w4a4, batch invariant, ...)
  std::optional<TileConfig> config;  // forced for both GEMMs (MoeLayerOptions::gemm1_config, gemm2_config)
  std::ostream* timeline = nullptr;  // per-block spans of one default forward per case, as JSON lines
  uint64_t seed = 1;
};

// Runs every (model, variant, T) case; prints a table to `table` and one JSON
// object per line to `json` (if not null). Throws fp4moe::Error if there is
// no GPU.
void run_layer_bench(const LayerBenchOptions& options, std::ostream& table, std::ostream* json);

}  // namespace fp4moe::bench
