// `fp4moe bench`: the grouped-GEMM benchmark (bench/gemm_bench.hpp) over the
// model shapes and token counts, against the roofline and cuBLAS measured in
// the same run; with --layer, the whole-MoE-layer benchmark
// (bench/layer_bench.hpp: routing on the device, nine variants, stage split,
// CUDA-graph replay); with --layer --ep N, the expert-parallel layer over N
// GPUs (bench/ep_bench.hpp). A table on stdout and JSON
// lines in a file. Run on a GPU by tests/tools/test_cli_gpu.cpp.
#include <fstream>
#include <iostream>

#include "cli_util.hpp"
#include "commands.hpp"
#include "fp4moe/error.hpp"
#ifdef FP4MOE_WITH_NCCL
#include "ep_bench.hpp"
#endif
#include "gemm_bench.hpp"
#include "layer_bench.hpp"
#include "models.hpp"

namespace fp4moe::cli {

void add_bench_command(CLI::App& app) {
  struct BenchCli {
    std::vector<std::string> models;
    bench::Options options;
    std::string json_path;
    std::string config;
    std::string timeline_path;
    bool no_cublas = false;
    bool layer = false;
    bool no_graph = false;
    bool default_only = false;
    std::vector<std::string> routing = {"realistic"};
    int ep = 0;
  };
  auto o = std::make_shared<BenchCli>();
  CLI::App* cmd = app.add_subcommand(
      "bench",
      "Benchmark the NVFP4 grouped GEMMs (GEMM1, GEMM2) per model shape and token count against the "
      "roofline and cuBLAS bf16, measured in the same run; with --layer, the whole MoE layer (routing "
      "included) against the sum of the two GEMMs' rooflines (needs a GPU).");
  cmd->add_flag("--layer", o->layer,
                "Benchmark the whole MoE layer: 10 variants (finalize deterministic/atomic x gather "
                "auto/fused/separate, and the default with plain launches instead of programmatic dependent "
                "launch, with fp4 activations (w4a4: quantising gather and SwiGLU epilogue), made batch "
                "invariant, or without the fused decode kernel (unfused)), stage split, CUDA-graph replays (default "
                "models: glm-5, deepseek-v3; "
                "default tokens: 1 16 64 256 1024)");
  cmd->add_option("--models", o->models, "Models (default: all; with --layer glm-5 deepseek-v3): " + model_names());
  cmd->add_option("--tokens", o->options.tokens, "Token counts")->capture_default_str();
  cmd->add_option("--gemms", o->options.gemms, "Which GEMMs: 1 and/or 2 (not with --layer)")->capture_default_str();
  cmd->add_option("--iterations", o->options.iterations, "Timed launches per case (median)")->capture_default_str();
  cmd->add_option("--timeline", o->timeline_path,
                  "--layer: write every block's start and end in one default forward per case, as JSON lines, "
                  "to this file (a build configured with -DFP4MOE_TIMELINE=ON)");
  cmd->add_option("--config", o->config,
                  "Force a tile config, e.g. n128m8k256s4w4 (with --layer: for both GEMMs, each with its own "
                  "epilogue, at every token count)");
  cmd->add_flag("--no-cublas", o->no_cublas, "Skip the cuBLAS bf16 peer (not with --layer)");
  cmd->add_flag("--no-graph", o->no_graph, "--layer: skip the CUDA-graph replay");
  cmd->add_flag("--default-only", o->default_only,
                "--layer: time the default variant only (deterministic finalize, automatic gather, programmatic "
                "launch), not the plain-launch, w4a4, batch-invariant, atomic and gather variants");
  cmd->add_option("--routing", o->routing,
                  "--layer: how the router spreads tokens over experts, one or more of uniform (random top-k), "
                  "realistic (a fixed per-expert popularity: the hottest expert 2.5x the mean rows at T = 4096) "
                  "and skewed (N(0, 1) logits with a 0.1 N(0, 1) correction bias: the hottest 5-6x the mean)")
      ->capture_default_str();
  cmd->add_option("--ep", o->ep,
                  "--layer: the expert-parallel layer over this machine's first N GPUs instead (NCCL; per-phase "
                  "times with the all-to-all on its own, the single-GPU layer as peer; default tokens: 1 16 64 "
                  "256 1024 4096)")
      ->check(CLI::Range(1, 64));
  cmd->add_option("--json", o->json_path, "Write one JSON object per case to this file");
  cmd->callback([o, cmd] {
    for (int64_t t : o->options.tokens) FP4MOE_CHECK(t >= 1, "--tokens must be >= 1, not ", t);
    FP4MOE_CHECK(o->options.iterations >= 1, "--iterations must be >= 1");
    std::ofstream json;
    const auto open_json = [&] {
      if (o->json_path.empty()) return;
      json.open(o->json_path);
      FP4MOE_CHECK(json.good(), "cannot open ", o->json_path, " for writing");
    };

    if (o->layer) {
      for (const char* flag : {"--gemms", "--no-cublas"})
        FP4MOE_CHECK(cmd->count(flag) == 0, flag, " does not apply to --layer");
      bench::LayerBenchOptions opts;
      opts.iterations = o->options.iterations;
      opts.with_graph = !o->no_graph;
      opts.default_only = o->default_only;
      if (!o->config.empty()) opts.config = TileConfig::parse(o->config);
      std::ofstream timeline;
      if (!o->timeline_path.empty()) {
        FP4MOE_CHECK(kernels::timeline_available(),
                     "--timeline: this build's kernels have no timeline stamps; configure with -DFP4MOE_TIMELINE=ON");
        timeline.open(o->timeline_path);
        FP4MOE_CHECK(timeline.good(), "cannot open ", o->timeline_path, " for writing");
        opts.timeline = &timeline;
      }
      opts.loads.clear();
      for (const std::string& name : o->routing) opts.loads.push_back(bench::parse_router_load(name));
      if (cmd->count("--tokens") > 0) opts.tokens = o->options.tokens;
      const std::vector<std::string> names =
          o->models.empty() ? std::vector<std::string>{"glm-5", "deepseek-v3"} : o->models;
      for (const std::string& name : names) opts.models.push_back(layer_shape(find_model(name)));
      open_json();
      if (cmd->count("--ep") > 0) {
#ifdef FP4MOE_WITH_NCCL
        for (const char* flag : {"--no-graph", "--default-only", "--routing", "--timeline"})
          FP4MOE_CHECK(cmd->count(flag) == 0, flag, " does not apply to --ep (one variant, no graph replays)");
        bench::EpBenchOptions ep;
        ep.models = opts.models;
        ep.num_ranks = o->ep;
        ep.iterations = opts.iterations;
        if (cmd->count("--tokens") > 0) ep.tokens = opts.tokens;
        bench::run_ep_bench(ep, std::cout, json.is_open() ? &json : nullptr);
#else
        FP4MOE_THROW("--ep needs NCCL, and this fp4moe was built without it");
#endif
        return;
      }
      bench::run_layer_bench(opts, std::cout, json.is_open() ? &json : nullptr);
      return;
    }

    for (const char* flag : {"--no-graph", "--default-only", "--routing", "--ep", "--timeline"})
      FP4MOE_CHECK(cmd->count(flag) == 0, flag, " applies to --layer only");
    bench::Options opts = o->options;
    std::vector<std::string> names = o->models;
    if (names.empty())
      for (const ModelShape& m : kModelShapes) names.emplace_back(m.name);
    for (const std::string& name : names) {
      const ModelShape& m = find_model(name);
      opts.models.push_back({std::string(m.name), m.num_experts, m.top_k, m.hidden, m.inter});
    }
    for (int g : opts.gemms) FP4MOE_CHECK(g == 1 || g == 2, "--gemms takes 1 and/or 2, not ", g);
    if (!o->config.empty()) opts.config = TileConfig::parse(o->config);
    opts.with_cublas = !o->no_cublas;
    opts.with_other_family = !opts.config;  // a forced config is being compared already
    open_json();
    bench::run_gemm_bench(opts, std::cout, json.is_open() ? &json : nullptr);
  });
}

}  // namespace fp4moe::cli
