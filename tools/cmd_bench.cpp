// `fp4moe bench`: the grouped-GEMM benchmark (bench/gemm_bench.hpp) over the
// model shapes and token counts, against the roofline and cuBLAS measured in
// the same run; a table on stdout and JSON lines in a file.
#include <fstream>
#include <iostream>

#include "commands.hpp"
#include "fp4moe/error.hpp"
#include "gemm_bench.hpp"
#include "models.hpp"

namespace fp4moe::cli {

void add_bench_command(CLI::App& app) {
  struct BenchCli {
    std::vector<std::string> models;
    bench::Options options;
    std::string json_path;
    std::string config;
    bool no_cublas = false;
  };
  auto o = std::make_shared<BenchCli>();
  CLI::App* cmd = app.add_subcommand(
      "bench", "Benchmark the NVFP4 grouped GEMMs (GEMM1, GEMM2) per model shape and token count against the "
               "roofline and cuBLAS bf16, measured in the same run (needs a GPU).");
  cmd->add_option("--models", o->models, "Models (default: all): " + model_names());
  cmd->add_option("--tokens", o->options.tokens, "Token counts")->capture_default_str();
  cmd->add_option("--gemms", o->options.gemms, "Which GEMMs: 1 and/or 2")->capture_default_str();
  cmd->add_option("--iterations", o->options.iterations, "Timed launches per case (median)")->capture_default_str();
  cmd->add_option("--config", o->config, "Force a tile config, e.g. n128m8k256s4w4");
  cmd->add_flag("--no-cublas", o->no_cublas, "Skip the cuBLAS bf16 peer");
  cmd->add_option("--json", o->json_path, "Write one JSON object per case to this file");
  cmd->callback([o] {
    bench::Options opts = o->options;
    std::vector<std::string> names = o->models;
    if (names.empty())
      for (const ModelShape& m : kModelShapes) names.emplace_back(m.name);
    for (const std::string& name : names) {
      const ModelShape& m = find_model(name);
      opts.models.push_back({std::string(m.name), m.num_experts, m.top_k, m.hidden, m.inter});
    }
    for (int g : opts.gemms) FP4MOE_CHECK(g == 1 || g == 2, "--gemms takes 1 and/or 2, not ", g);
    for (int64_t t : opts.tokens) FP4MOE_CHECK(t >= 1, "--tokens must be >= 1, not ", t);
    FP4MOE_CHECK(opts.iterations >= 1, "--iterations must be >= 1");
    if (!o->config.empty()) opts.config = TileConfig::parse(o->config);
    opts.with_cublas = !o->no_cublas;
    std::ofstream json;
    if (!o->json_path.empty()) {
      json.open(o->json_path);
      FP4MOE_CHECK(json.good(), "cannot open ", o->json_path, " for writing");
    }
    bench::run_gemm_bench(opts, std::cout, json.is_open() ? &json : nullptr);
  });
}

}  // namespace fp4moe::cli
