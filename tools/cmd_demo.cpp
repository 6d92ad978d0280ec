// `fp4moe demo`: the project's main job end to end on one real-shaped MoE
// layer (DeepSeek-V3, Kimi K2, GLM-5, GLM-4.5, Qwen3, gpt-oss, Mixtral; see
// models.hpp), with no checkpoint download:
//
//   1. random bf16 hidden states and router logits; route with the model's
//      own routing (all experts take part);
//   2. synthesise the NVFP4 weights of the experts that received tokens,
//      directly in the quantised domain (random e2m1 codes, e4m3 block scales
//      in the range real checkpoints show, a global scale chosen so that each
//      projection has unit gain and outputs are O(1));
//   3. run the layer on the best available backend (on a GPU: print the
//      layer plan, then run fp4moe::MoeLayer);
//   4. check sampled tokens (fails the command when the relative error
//      exceeds 1e-5 on the CPU, the bf16-output contract 1e-2 on the GPU):
//      the CPU backend against an
//      independent dequantise-and-loop evaluation, the GPU against the CPU
//      reference (moe_reference) on just those tokens' routing;
//   5. report what ran and how fast: ms, tokens/s, effective GB/s of weights;
//   6. on a GPU, a timing table of the whole layer at several T (routing on
//      the device included): median µs with the L2 flushed before each
//      forward, the layer roofline (bench/layer_bench.hpp) and efficiency, and
//      the share of time outside the two GEMMs. Timing at T = 1024 needs
//      nearly every expert, so that layer holds ALL experts with random
//      NVFP4 codes drawn by a fast generator (the kernels' cost does not
//      depend on the values; synthesising a 256-expert model the careful way
//      of step 2 would take minutes on the CPU).
//
// Tested in tests/tools/test_cli.cpp (CPU: a small model end to end, bad
// names) and tests/tools/test_cli_gpu.cpp (GPU: check and timing table).
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "cli_util.hpp"
#include "commands.hpp"
#include "fp4moe/error.hpp"
#include "fp4moe/modelopt.hpp"
#include "fp4moe/nvfp4.hpp"
#include "fp4moe/reference.hpp"
#include "layer_bench.hpp"
#include "models.hpp"
#include "util/parallel.hpp"
#include "util/splitmix64.hpp"

namespace fp4moe::cli {
namespace {

struct DemoOptions {
  std::string model{kDefaultModel};
  int64_t tokens = 8;
  uint64_t seed = 1;
  std::string device = "auto";
  int check_tokens = -1;  // -1: kDefaultCheckTokensCpu or kDefaultCheckTokensGpu
  std::vector<int64_t> timing_tokens = {1, 16, 64, 256, 1024};
  int timing_iterations = 20;
  bool no_timing = false;
};

// Tokens checked by default: the CPU check costs about as much as the run
// itself; on the GPU the CPU reference is the slow part, and 8 tokens keep it
// to seconds.
constexpr int kDefaultCheckTokensCpu = 2;
constexpr int kDefaultCheckTokensGpu = 8;

// Relative-error bounds of the check (‖out − ref‖/‖ref‖), each near what its
// path really reaches so that a real fault cannot hide under it: the GPU's
// is the contract for bf16 outputs (it lands near 3e-3); the CPU backend
// accumulates in double and writes fp32, and lands near 1e-7 against the
// independent evaluation (fp32 rounding of the output and of intermediate
// values summed in another order).
constexpr double kCheckToleranceGpu = 1e-2;
constexpr double kCheckToleranceCpu = 1e-5;

// Block scales are drawn uniformly from the e4m3 codes 0x68..0x77, values
// 64..240: ModelOpt's scale is 448 · block_amax / tensor_amax, which for
// Gaussian-like weights sits mostly in that range.
constexpr uint8_t kFirstScaleCode = 0x68;
constexpr int kNumScaleCodes = 16;

// Expert `expert_idx` of the model; its weights depend only on the seed and
// its index, not on which other experts are active.
ExpertWeights synthesize_expert(const ModelShape& model, uint64_t seed, int64_t expert_idx) {
  SplitMix64 rng(seed * 0x2545F4914F6CDD1Dull + static_cast<uint64_t>(expert_idx) + 1);
  ExpertWeights ex;
  const float gate_up_scale =
      bench::unit_gain_global_scale(model.hidden, kFirstScaleCode, kNumScaleCodes);  // shared, as ModelOpt does
  ex.gate = bench::random_nvfp4_matrix(model.inter, model.hidden, gate_up_scale, kFirstScaleCode, kNumScaleCodes, rng);
  ex.up = bench::random_nvfp4_matrix(model.inter, model.hidden, gate_up_scale, kFirstScaleCode, kNumScaleCodes, rng);
  ex.down = bench::random_nvfp4_matrix(model.hidden, model.inter,
                                       bench::unit_gain_global_scale(model.inter, kFirstScaleCode, kNumScaleCodes),
                                       kFirstScaleCode, kNumScaleCodes, rng);
  if (model.has_bias) {
    const auto bias = [&](int64_t n) {
      std::vector<float> b(static_cast<size_t>(n));
      for (float& v : b) v = static_cast<float>(0.1 * rng.normal());
      return b;
    };
    ex.gate_bias = bias(model.inter);
    ex.up_bias = bias(model.inter);
    ex.down_bias = bias(model.hidden);
  }
  return ex;
}

// One (token, slot) contribution, the slow and obvious way: every weight
// dequantised on its own from its code, block scale and global scale (with
// lookup tables for the two codecs, so that checking stays quick).
std::vector<double> evaluate_expert(const ExpertWeights& ex, const float* x, Activation activation) {
  static const auto tables = [] {
    std::pair<std::array<double, 16>, std::array<double, 256>> t;
    for (int c = 0; c < 16; ++c) t.first[static_cast<size_t>(c)] = e2m1_to_float(static_cast<uint8_t>(c));
    for (int c = 0; c < 256; ++c) t.second[static_cast<size_t>(c)] = e4m3_to_float(static_cast<uint8_t>(c));
    return t;
  }();
  // row · v for row r of m; v has m.cols entries.
  const auto dot_row = [&](const Nvfp4Matrix& m, int64_t r, const auto* v) {
    double acc = 0.0;
    for (int64_t c = 0; c < m.cols; ++c)
      acc += tables.first[m.code(r, c)] * tables.second[m.scale(r, c)] * static_cast<double>(v[c]);
    return acc * static_cast<double>(m.global_scale);
  };
  const int64_t inter = ex.gate.rows;
  const int64_t hidden = ex.gate.cols;
  std::vector<double> h(static_cast<size_t>(inter));
  for (int64_t i = 0; i < inter; ++i) {
    const double gate = dot_row(ex.gate, i, x) + (ex.gate_bias.empty() ? 0.0 : ex.gate_bias[static_cast<size_t>(i)]);
    const double up = dot_row(ex.up, i, x) + (ex.up_bias.empty() ? 0.0 : ex.up_bias[static_cast<size_t>(i)]);
    if (activation == Activation::kSwiGLU) {
      h[static_cast<size_t>(i)] = gate / (1.0 + std::exp(-gate)) * up;
    } else {
      const double g = std::min(gate, 7.0);
      const double l = std::max(-7.0, std::min(up, 7.0));
      h[static_cast<size_t>(i)] = g / (1.0 + std::exp(-1.702 * g)) * (l + 1.0);
    }
  }
  std::vector<double> y(static_cast<size_t>(hidden));
  for (int64_t n = 0; n < hidden; ++n)
    y[static_cast<size_t>(n)] =
        dot_row(ex.down, n, h.data()) + (ex.down_bias.empty() ? 0.0 : ex.down_bias[static_cast<size_t>(n)]);
  return y;
}

std::string routing_description(const ModelShape& model) {
  switch (model.routing) {
    case RoutingMode::kSoftmaxTopK:
      return "softmax top-" + std::to_string(model.top_k) + ", renormalised";
    case RoutingMode::kNoauxTc: {
      char buf[160];
      std::snprintf(buf, sizeof buf, "noaux_tc (sigmoid + correction bias, %d group%s, keep %d), scaling %.3g",
                    model.num_groups, model.num_groups == 1 ? "" : "s", model.topk_groups, model.routed_scaling_factor);
      return buf;
    }
    case RoutingMode::kGptOss:
      return "gpt-oss (top-" + std::to_string(model.top_k) + " logits, softmax over them)";
  }
  return "?";
}

// The tokens checked: `count` of [0, num_tokens), spread evenly, first and last included.
std::vector<int64_t> spread_tokens(int64_t count, int64_t num_tokens) {
  std::vector<int64_t> tokens;
  for (int64_t i = 0; i < count; ++i) tokens.push_back(count == 1 ? 0 : i * (num_tokens - 1) / (count - 1));
  return tokens;
}

struct CheckResult {
  double rel_err = 0.0;
  int64_t num_nonfinite = 0;  // output elements that are NaN or infinite
  std::string against;        // what the output was compared with
};

// CPU backend: each checked (token, slot) evaluated on its own, the slow and
// obvious way, so the reference is not checked against itself.
CheckResult check_against_evaluation(const ModelShape& model, const MoeWeights& weights,
                                     const std::vector<float>& hidden_states, const Routing& compact_routing,
                                     const std::vector<int64_t>& checked_tokens, const std::vector<float>& output) {
  const int top_k = compact_routing.top_k;
  const int64_t hidden = weights.hidden;
  const int64_t num_checked = static_cast<int64_t>(checked_tokens.size());
  std::vector<std::vector<double>> contributions(static_cast<size_t>(num_checked * top_k));
  {
    Progress progress("check (token, expert) pairs", num_checked * top_k);
    std::mutex progress_mutex;
    parallel_for(num_checked * top_k, [&](int64_t p) {
      const int64_t t = checked_tokens[static_cast<size_t>(p / top_k)];
      const int32_t e = compact_routing.topk_ids[static_cast<size_t>(t * top_k + p % top_k)];
      contributions[static_cast<size_t>(p)] =
          evaluate_expert(weights.experts[static_cast<size_t>(e)], hidden_states.data() + t * hidden, model.activation);
      std::lock_guard<std::mutex> lock(progress_mutex);
      progress.advance();
    });
  }
  CheckResult result;
  result.against = "a dequantise-and-loop evaluation";
  double err_sq = 0.0, ref_sq = 0.0;
  for (int64_t c = 0; c < num_checked; ++c) {
    const int64_t t = checked_tokens[static_cast<size_t>(c)];
    for (int64_t n = 0; n < hidden; ++n) {
      double ref = 0.0;
      for (int j = 0; j < top_k; ++j)
        ref += static_cast<double>(compact_routing.topk_weights[static_cast<size_t>(t * top_k + j)]) *
               contributions[static_cast<size_t>(c * top_k + j)][static_cast<size_t>(n)];
      const float out = output[static_cast<size_t>(t * hidden + n)];
      result.num_nonfinite += !std::isfinite(out);
      const double diff = out - ref;
      err_sq += diff * diff;
      ref_sq += ref * ref;
    }
  }
  result.rel_err = std::sqrt(err_sq / ref_sq);
  return result;
}

// GPU backend: the CPU reference on just the checked tokens' rows and routing.
CheckResult check_against_reference(const ModelShape& model, const MoeWeights& weights,
                                    const std::vector<float>& hidden_states, const Routing& compact_routing,
                                    const std::vector<int64_t>& checked_tokens, const std::vector<float>& output) {
  const int top_k = compact_routing.top_k;
  const int64_t hidden = weights.hidden;
  Routing sample;
  sample.num_tokens = static_cast<int64_t>(checked_tokens.size());
  sample.top_k = top_k;
  std::vector<float> sample_hidden;
  for (int64_t t : checked_tokens) {
    sample_hidden.insert(sample_hidden.end(), hidden_states.begin() + t * hidden,
                         hidden_states.begin() + (t + 1) * hidden);
    for (int j = 0; j < top_k; ++j) {
      sample.topk_ids.push_back(compact_routing.topk_ids[static_cast<size_t>(t * top_k + j)]);
      sample.topk_weights.push_back(compact_routing.topk_weights[static_cast<size_t>(t * top_k + j)]);
    }
  }
  std::vector<float> reference(sample_hidden.size());
  {
    Progress progress("check: CPU reference (tokens)", sample.num_tokens);
    moe_reference(weights, sample_hidden.data(), sample, model.activation, reference.data());
    progress.advance(sample.num_tokens);
  }
  CheckResult result;
  result.against = "the CPU reference";
  double err_sq = 0.0, ref_sq = 0.0;
  for (size_t c = 0; c < checked_tokens.size(); ++c)
    for (int64_t n = 0; n < hidden; ++n) {
      const double ref = reference[c * static_cast<size_t>(hidden) + static_cast<size_t>(n)];
      const float out = output[static_cast<size_t>(checked_tokens[c] * hidden + n)];
      result.num_nonfinite += !std::isfinite(out);
      err_sq += (out - ref) * (out - ref);
      ref_sq += ref * ref;
    }
  result.rel_err = std::sqrt(err_sq / ref_sq);
  return result;
}

// Step 6: the whole layer on the GPU at several token counts (see the file
// comment for why its weights are random codes).
void print_timing_table(const ModelShape& model, const DemoOptions& opts) {
  const bench::LayerShape shape = layer_shape(model);
  const double weight_bytes =
      3.0 * static_cast<double>(model.hidden * model.inter) * (0.5 + 1.0 / kNvfp4BlockSize) * model.num_experts;
  std::printf(
      "\ntiming: the whole layer on the GPU, routing included, all %lld experts (%s) with random NVFP4 "
      "codes\n  (the kernels' cost does not depend on the values; random codes make a full model quick "
      "to build)\n",
      static_cast<long long>(model.num_experts), format_bytes(weight_bytes).c_str());
  std::fflush(stdout);

  MoeLayerOptions options;
  options.activation = model.activation;
  options.routing = model.routing_params();
  Timer build_timer;
  const MoeLayer layer = [&] {
    const MoeWeights weights = bench::random_moe_weights(shape, opts.seed);  // freed once uploaded
    return MoeLayer::prepare(weights, options);
  }();
  const bench::L2Flusher flusher;
  const bench::Ceilings ceilings = bench::measure_ceilings(flusher);
  std::printf("  weights drawn and uploaded in %.1f s; measured: %s\n", build_timer.elapsed_ms() / 1e3,
              ceilings.describe().c_str());
  std::printf(
      "  layer us: median of %d forwards, L2 flushed (512 MB read) before each; roofline = GEMM1 + GEMM2 + combine "
      "(bench/layer_bench.hpp);\n  routing load: realistic (the hottest expert 2.5x the mean rows at "
      "T = 4096; fp4moe bench --layer --routing for the others);\n  outside GEMMs: share of the forward "
      "spent in routing, sort, gather and finalize (stage events)\n",
      opts.timing_iterations);
  std::printf("  %6s %7s %10s %11s %6s %14s\n", "T", "experts", "layer_us", "roofline_us", "eff", "outside_GEMMs");
  std::fflush(stdout);
  const int64_t max_tokens = *std::max_element(opts.timing_tokens.begin(), opts.timing_tokens.end());
  bench::LayerTimer timer(layer, max_tokens, opts.seed, bench::RouterLoad::kRealistic);
  for (int64_t tokens : opts.timing_tokens) {
    const bench::LayerMeasurement m =
        bench::measure_layer(timer, layer, tokens, opts.timing_iterations, /*with_graph=*/false, ceilings, flusher);
    std::printf("  %6lld %7lld %10.1f %11.1f %6.2f %13.0f%%%s\n", static_cast<long long>(tokens),
                static_cast<long long>(m.roofline.active_experts), m.time_us, m.roofline.roof_us, m.efficiency,
                100.0 * m.stages.outside_gemm_share(),
                m.nonfinite_outputs > 0 ? "  (WARNING: non-finite outputs)" : "");
    std::fflush(stdout);
  }
}

void run_demo(const DemoOptions& opts) {
  const ModelShape& model = find_model(opts.model);
  FP4MOE_CHECK(opts.tokens >= 1, "--tokens ", opts.tokens, ": expected at least 1");
  for (int64_t t : opts.timing_tokens) FP4MOE_CHECK(t >= 1, "--timing-tokens ", t, ": expected at least 1");
  FP4MOE_CHECK(opts.timing_iterations >= 1, "--timing-iterations ", opts.timing_iterations, ": expected at least 1");
  const Device device = resolve_device(parse_device(opts.device));
  const bool on_gpu = device == Device::kCuda;
  const GpuInfo gpu = probe_gpu();
  const int64_t num_tokens = opts.tokens;
  const int64_t hidden = model.hidden;
  const int64_t inter = model.inter;

  std::printf("fp4moe demo: %.*s MoE layer, NVFP4 weights (synthetic, seed %llu)\n",
              static_cast<int>(model.display.size()), model.display.data(), static_cast<unsigned long long>(opts.seed));
  std::printf("  experts %lld, top-%d, hidden %lld, moe_inter %lld, activation %s%s\n",
              static_cast<long long>(model.num_experts), model.top_k, static_cast<long long>(hidden),
              static_cast<long long>(inter), to_string(model.activation).c_str(), model.has_bias ? " with biases" : "");
  std::printf("  routing %s\n", routing_description(model).c_str());
  std::printf("  GPU: %s%s\n", gpu.description.c_str(),
              on_gpu                ? "; the layer runs on it"
              : gpu.num_devices > 0 ? "; --device cpu: the CPU backend runs"
                                    : "");
  std::fflush(stdout);

  // 1. Inputs and routing over all experts.
  SplitMix64 rng(opts.seed);
  std::vector<float> hidden_states(static_cast<size_t>(num_tokens * hidden));
  for (float& v : hidden_states) v = bf16_to_float(float_to_bf16(static_cast<float>(rng.normal())));
  std::vector<float> router_logits(static_cast<size_t>(num_tokens * model.num_experts));
  for (float& v : router_logits) v = static_cast<float>(rng.normal());
  std::vector<float> correction_bias(static_cast<size_t>(model.num_experts));
  for (float& v : correction_bias) v = static_cast<float>(0.1 * rng.normal());
  const Routing routing =
      route(router_logits.data(), num_tokens, model.num_experts, correction_bias.data(), model.routing_params());

  // 2. Weights of the active experts only, renumbered 0..active-1.
  std::vector<int32_t> compact_idx(static_cast<size_t>(model.num_experts), -1);
  std::vector<int64_t> active_experts;
  for (int32_t e : routing.topk_ids)
    if (compact_idx[static_cast<size_t>(e)] < 0) {
      compact_idx[static_cast<size_t>(e)] = 0;
      active_experts.push_back(e);
    }
  std::sort(active_experts.begin(), active_experts.end());
  for (size_t i = 0; i < active_experts.size(); ++i)
    compact_idx[static_cast<size_t>(active_experts[i])] = static_cast<int32_t>(i);
  Routing compact_routing = routing;
  for (int32_t& e : compact_routing.topk_ids) e = compact_idx[static_cast<size_t>(e)];

  const int64_t num_active = static_cast<int64_t>(active_experts.size());
  const double bytes_per_expert = 3.0 * static_cast<double>(hidden * inter) * (0.5 + 1.0 / kNvfp4BlockSize);
  const double weight_bytes = bytes_per_expert * static_cast<double>(num_active);
  std::printf("  tokens %lld: %lld of %lld experts active, %s of NVFP4 weights to read\n",
              static_cast<long long>(num_tokens), static_cast<long long>(num_active),
              static_cast<long long>(model.num_experts), format_bytes(weight_bytes).c_str());
  std::fflush(stdout);

  MoeWeights weights;
  weights.num_experts = num_active;
  weights.hidden = hidden;
  weights.inter = inter;
  weights.experts.resize(static_cast<size_t>(num_active));
  {
    Progress progress("synthesise experts", num_active);
    std::mutex progress_mutex;
    parallel_for(num_active, [&](int64_t i) {
      weights.experts[static_cast<size_t>(i)] =
          synthesize_expert(model, opts.seed, active_experts[static_cast<size_t>(i)]);
      std::lock_guard<std::mutex> lock(progress_mutex);
      progress.advance();
    });
  }

  // 3. The layer.
  std::vector<float> output(static_cast<size_t>(num_tokens * hidden));
  MoeLayerOptions layer_options;
  layer_options.activation = model.activation;
  layer_options.routing = model.routing_params();
  MoeRunStats stats;
  {
    Progress progress("run layer (tokens)", num_tokens);
    stats =
        run_moe_layer(device, weights, hidden_states.data(), compact_routing, layer_options, output.data(), &progress);
  }
  if (!stats.plan.empty()) std::printf("layer plan: %s", stats.plan.c_str());

  // 4. Check on sampled tokens.
  const int requested_checks = opts.check_tokens >= 0 ? opts.check_tokens
                               : on_gpu               ? kDefaultCheckTokensGpu
                                                      : kDefaultCheckTokensCpu;
  const std::vector<int64_t> checked_tokens =
      spread_tokens(std::clamp<int64_t>(requested_checks, 0, num_tokens), num_tokens);
  std::optional<CheckResult> check;
  if (!checked_tokens.empty()) {
    check = on_gpu ? check_against_reference(model, weights, hidden_states, compact_routing, checked_tokens, output)
                   : check_against_evaluation(model, weights, hidden_states, compact_routing, checked_tokens, output);
  }

  // 5. Report.
  double out_sq = 0.0;
  for (float v : output) out_sq += static_cast<double>(v) * v;
  const double time_s = stats.time_ms / 1e3;
  if (on_gpu) {
    std::printf("ran: %lld tokens on %s\n", static_cast<long long>(num_tokens), stats.backend.c_str());
  } else {
    std::printf("ran: %lld tokens on %s, %d threads\n", static_cast<long long>(num_tokens), stats.backend.c_str(),
                stats.num_threads);
  }
  std::printf("  time %.3f ms, %.1f tokens/s, weights read at %.2f GB/s effective (%s / time)\n", stats.time_ms,
              static_cast<double>(num_tokens) / time_s, weight_bytes / time_s / 1e9,
              format_bytes(weight_bytes).c_str());
  std::printf("  output rms %.3f\n", std::sqrt(out_sq / static_cast<double>(output.size())));
  if (!check) {
    std::printf("check: skipped (--check 0)\n");
  } else {
    std::string tokens_list;
    for (int64_t t : checked_tokens) tokens_list += (tokens_list.empty() ? "" : ", ") + std::to_string(t);
    const double tolerance = on_gpu ? kCheckToleranceGpu : kCheckToleranceCpu;
    const bool ok = check->rel_err <= tolerance && check->num_nonfinite == 0;
    std::printf("check: tokens {%s} against %s: rel err %.2e (limit %.0e)%s %s\n", tokens_list.c_str(),
                check->against.c_str(), check->rel_err, tolerance,
                check->num_nonfinite > 0 ? (", " + std::to_string(check->num_nonfinite) + " non-finite").c_str() : "",
                ok ? "PASS" : "FAIL");
    std::fflush(stdout);
    FP4MOE_CHECK(ok, "demo check failed: the ", stats.backend, " backend's output differs from ", check->against,
                 " by rel err ", check->rel_err, " (limit ", tolerance, ")",
                 check->num_nonfinite > 0 ? " and has non-finite elements" : "");
  }

  // 6. Timing table (GPU).
  if (on_gpu && !opts.no_timing && !opts.timing_tokens.empty()) print_timing_table(model, opts);
}

}  // namespace

void add_demo_command(CLI::App& app) {
  auto opts = std::make_shared<DemoOptions>();
  CLI::App* cmd = app.add_subcommand(
      "demo",
      "Run one real-shaped NVFP4 MoE layer end to end on synthetic weights and tokens: route, run on "
      "the best available backend, check sampled tokens against an independent evaluation (the CPU "
      "reference on a GPU), and report time, tokens/s and effective weight bandwidth; on a GPU, then "
      "time the whole layer at several token counts against its roofline.");
  cmd->add_option("--model,-m", opts->model, "model shape: " + model_names())->capture_default_str();
  cmd->add_option("--tokens,-t", opts->tokens, "tokens in the batch (T)")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  cmd->add_option("--seed", opts->seed, "seed of the synthetic weights and inputs")->capture_default_str();
  cmd->add_option("--device", opts->device,
                  "backend: auto (the GPU when there is one, else the CPU), cpu (the reference), cuda")
      ->check(CLI::IsMember({"auto", "cpu", "cuda"}))
      ->capture_default_str();
  cmd->add_option("--check", opts->check_tokens, "tokens checked (0: none; default 2 on the CPU, 8 on the GPU)")
      ->check(CLI::NonNegativeNumber);
  cmd->add_option("--timing-tokens", opts->timing_tokens,
                  "GPU: token counts of the timing table (all experts, random codes)")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  cmd->add_option("--timing-iterations", opts->timing_iterations, "GPU: timed forwards per token count (median)")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  cmd->add_flag("--no-timing", opts->no_timing, "GPU: skip the timing table");
  cmd->callback([opts] { run_demo(*opts); });
}

}  // namespace fp4moe::cli
