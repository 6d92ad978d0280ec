// Benchmark of the NVFP4 grouped GEMMs of an MoE layer against the roofline
// and the cuBLAS bf16 grouped GEMM, all measured in the same run.
//
// For each model shape and token count: random top-k routing, GEMM1
// (n = 2 * inter, k = hidden) and GEMM2 (n = hidden, k = inter). Per case:
//   bytes = sum_active n*k*(1/2 + 1/16) + rows*k*2 + rows*n*2,  flops = 2*rows*n*k,
//   t_roof = max(bytes / BW, flops / P), efficiency = t_roof / t_measured,
// with BW a device-to-device copy rate and P a cuBLAS bf16 8192^3 GEMM rate
// measured at start-up. L2 is flushed before every timed launch; times are
// medians of CUDA-event-timed launches. One JSON line per case.
// Run through `fp4moe bench`.
#pragma once

#include <cstdint>
#include <optional>
#include <ostream>
#include <string>
#include <vector>

#include "fp4moe/plan.hpp"

namespace fp4moe::bench {

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
  std::optional<TileConfig> config;  // force a config instead of the planner's
  uint64_t seed = 1;
};

// Runs every case; prints a table to `table` and one JSON object per line to
// `json` (if not null). Throws fp4moe::Error if there is no GPU.
void run_gemm_bench(const Options& options, std::ostream& table, std::ostream* json);

}  // namespace fp4moe::bench
