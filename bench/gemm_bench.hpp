// Benchmark of the NVFP4 grouped GEMMs of an MoE layer against the roofline
// and the cuBLAS bf16 grouped GEMM, all measured in the same run.
//
// For each model shape and token count: random top-k routing, GEMM1
// (n = 2 * inter, k = hidden) and GEMM2 (n = hidden, k = inter). Per case:
//   bytes = sum_active n*k*(1/2 + 1/16) + rows*k*2 + rows*n*2,  flops = 2*rows*n*k,
//   t_roof = max(bytes / BW, flops / P), efficiency = t_roof / t_measured,
// with BW a device-to-device copy rate and P a cuBLAS bf16 8192^3 GEMM rate
// measured at start-up. L2 is flushed before every timed launch; times are
// medians of CUDA-event-timed launches. One JSON line per case. Peers timed
// the same way: cuBLAS, the other kernel family's own choice and, at
// memory-bound points, a streaming read of the same bytes.
// Run through `fp4moe bench`.
//
// The measurement pieces (ceilings, roofline, L2 flush, event timing, device
// buffers, random fills) are shared with the layer benchmark
// (bench/layer_bench.hpp) and the `fp4moe demo` timing table, so that every
// efficiency the project prints comes from the same yardstick.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <functional>
#include <optional>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include <algorithm>
#include <string>

#include "fp4moe/cuda_check.hpp"
#include "fp4moe/plan.hpp"
#include "util/device_buffer.hpp"

namespace fp4moe::bench {

// ------------------------------------------------------ shared measurement

// The two ceilings of the roofline (docs/design.md §6), measured on the current
// device. Memory: the larger of a device-to-device copy rate (read + write
// bytes per second) and a streaming read of a 2 GiB buffer (stream_read),
// since a plain read beats the copy by a few percent on an H100 and a
// ceiling that a kernel can beat overstates its efficiency. Arithmetic: the
// cuBLAS dense bf16 GEMM rate at 8192^3.
struct Ceilings {
  double copy_bytes_per_s = 0;
  double read_bytes_per_s = 0;
  double bf16_flops_per_s = 0;
  // The same GEMM back to back for 1.5 s, timed over the last 0.75 s: the
  // rate the GPU holds under its power limit. The flushed medians above run
  // at burst clocks; a forward of a few milliseconds or more, repeated, runs
  // at the limit (an H100 SXM: 676 against 800 TFLOP/s, 1.38 GHz at 700 W;
  // docs/performance.md §5.28). Reported beside the roofline, which keeps
  // bf16_flops_per_s.
  double bf16_sustained_flops_per_s = 0;
  double memory_bytes_per_s() const { return std::max(copy_bytes_per_s, read_bytes_per_s); }
  // These ceilings with the sustained arithmetic rate.
  Ceilings sustained() const {
    Ceilings c = *this;
    c.bf16_flops_per_s = bf16_sustained_flops_per_s;
    return c;
  }
  // "memory 3.12 TB/s (copy 3.05, read 3.12), cuBLAS bf16 794 TFLOP/s (8192^3; 676 sustained)"
  std::string describe() const;
};

// Reads a buffer larger than 3x the L2 before each timed launch, so that the
// launch starts from a cold L2 (see read_to_evict_l2 in gemm_bench.cu for why
// it reads instead of writing).
class L2Flusher {
 public:
  explicit L2Flusher(size_t bytes = size_t{512} << 20);  // > 3x the 60 MB L2 of an H200
  void flush(cudaStream_t stream) const;

 private:
  DeviceBuffer<uint8_t> buffer_;
};

// Median, in us, of `iterations` CUDA-event-timed calls of `launch` on
// `stream`, each preceded by an L2 flush; one untimed warm-up call first.
double time_median_us(const std::function<void()>& launch, int iterations, const L2Flusher& flusher,
                      cudaStream_t stream = nullptr);
// Time, in us, of one call of `launch` (which may enqueue many kernels) on
// `stream`, between two CUDA events; no flush, no warm-up.
double time_span_us(const std::function<void()>& launch, cudaStream_t stream = nullptr);
// The same for several launches taken in turn (round i times launch 0, 1,
// ... each after its own flush), so that they share the GPU's state (clocks,
// temperature) and their medians compare like for like; one median per launch.
std::vector<double> time_interleaved_us(const std::vector<std::function<void()>>& launches, int iterations,
                                        const L2Flusher& flusher, cudaStream_t stream = nullptr);

Ceilings measure_ceilings(const L2Flusher& flusher);

// The read peer of a memory-bound point: one plain streaming read of `bytes`
// from DRAM (four independent 16-byte loads in flight per thread, eight
// blocks of 256 threads per SM), timed as the kernels are. At a few
// megabytes even this read stays below the roofline: launch and ramp-up do
// not shrink with the bytes. 0 where its buffer would not leave 1 GiB of
// the device free.
double time_stream_read_us(double bytes, int iterations, const L2Flusher& flusher);
// The benchmarks' first JSON line: {"kind": "ceilings", gpu, date, the
// memory rates in TB/s and the bf16 rate in TFLOP/s}.
std::string ceilings_json_line(const std::string& gpu, const std::string& date, const Ceilings& ceilings);

// Captures what `work` enqueues on `stream` (thread-local capture mode: a
// capture-unsafe call, an allocation or a synchronisation, fails) into an
// instantiated graph; the caller destroys it (cudaGraphExecDestroy).
cudaGraphExec_t capture_graph(cudaStream_t stream, const std::function<void()>& work);

// Bytes and flops of one grouped GEMM with `rows` routed rows over
// `active_experts` experts (docs/design.md §6):
//   bytes = active * n*k*(1/2 + 1/16) + rows*k*2 + rows*n*2,  flops = 2*rows*n*k.
struct GemmCost {
  double bytes = 0;
  double flops = 0;
};
GemmCost grouped_gemm_cost(int64_t active_experts, int64_t rows, int64_t n, int64_t k);
// t_roof = max(bytes / BW, flops / P), in us.
double roofline_us(const GemmCost& cost, const Ceilings& ceilings);

// Deterministic pseudo-random device fills (hash of seed and index), for
// benchmark inputs: bytes (count a multiple of 4), bf16 values in [-1, 1).
void fill_random_bytes(uint8_t* dst, size_t count, uint64_t seed, cudaStream_t stream = nullptr);
void fill_random_bf16(void* dst, size_t count, uint64_t seed, cudaStream_t stream = nullptr);

// The weights of one grouped GEMM, drawn on the device directly in the
// prepared (fragment-ordered) layout of E experts of [n, k]: uniform fp4
// codes, e4m3 block scales in [0.5, 2), global scales 1/64. The kernels' cost
// does not depend on the values.
struct RandomGemmWeights {
  int64_t num_experts = 0, n = 0, k = 0;
  int64_t n_padded = 0, k_padded = 0;  // n to a multiple of 128, k of 256
  DeviceBuffer<uint8_t> weights;       // [E][n_pad/16][k_pad/64][512] fp4 fragments
  DeviceBuffer<uint8_t> scales;        // [E][n_pad/16][k_pad/64][64] scale codes
  DeviceBuffer<float> global_scales;   // [E]
};
RandomGemmWeights random_gemm_weights(int64_t num_experts, int64_t n, int64_t k, uint64_t seed);

// Uniform top-k routing: `top_k` distinct experts per token drawn uniformly,
// the ids of `tokens` tokens as [tokens, top_k] row-major.
std::vector<int32_t> random_topk_ids(int64_t num_experts, int top_k, int64_t tokens, std::mt19937_64& rng);
// Skewed top-k routing: each expert gets a popularity exp(skew * z), z drawn
// from N(0, 1) once per call, and every token draws `top_k` distinct experts
// with probabilities proportional to it (weighted sampling without
// replacement, by Gumbel keys). skew 0 is the uniform routing above; skew 1
// gives rows per expert with a coefficient of variation of about 1.3 at 128
// rows per expert (DeepSeek-V3's shape), about the imbalance of the layer
// bench's noaux_tc routing (1.5).
std::vector<int32_t> skewed_topk_ids(int64_t num_experts, int top_k, int64_t tokens, double skew, std::mt19937_64& rng);

std::string gpu_name();  // of the current device
std::string today();     // YYYY-MM-DD (UTC)

// ------------------------------------------------------ grouped-GEMM bench

struct ModelSpec {
  std::string name;
  int64_t num_experts = 0;
  int top_k = 0;
  int64_t hidden = 0;
  int64_t inter = 0;
};

struct Options {
  std::vector<ModelSpec> models;
  std::vector<int64_t> tokens = {1, 4, 16, 64, 256, 1024, 4096, 16384};
  std::vector<int> gemms = {1, 2};
  int iterations = 20;
  bool with_cublas = true;
  bool with_other_family = true;     // also time the other kernel family's own choice (where it runs)
  std::optional<TileConfig> config;  // force a config instead of the planner's
  uint64_t seed = 1;
};

// Runs every case; prints a table to `table` and one JSON object per line to
// `json` (if not null). Throws fp4moe::Error if there is no GPU.
void run_gemm_bench(const Options& options, std::ostream& table, std::ostream* json);

}  // namespace fp4moe::bench
