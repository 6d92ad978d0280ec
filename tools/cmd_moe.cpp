// `fp4moe moe`: runs one MoE layer of an NVFP4 checkpoint on tokens from a
// safetensors file and writes the result.
//
//   --weights W  checkpoint file or directory (ModelOpt NVFP4 expert tensors)
//   --input X    hidden_states [T, H] (BF16 or F32), and either
//                  topk_ids [T, k] I32 + topk_weights [T, k] F32   (routing given)
//                  router_logits [T, E] F32 (+ e_score_correction_bias [E])
//                  nothing more: the logits come from the checkpoint's router
//                (routed as config.json says, else by the flags; read by
//                moe_input.cpp)
//   --prefix P / --layer N  the layer (default: the checkpoint's only one)
//   --output Y   output [T, H] BF16 (rounded to nearest even)
//   --device     auto (the GPU when there is one), cpu (the reference), cuda
//   --finalize   CUDA: deterministic (fixed summation order) or atomic
//   --ep N       CUDA: expert parallel over this machine's first N GPUs (NCCL)
//   --activations checkpoint (W4A4 for an NVFP4 checkpoint with input_scale,
//                else bf16), bf16 (W4A16), fp4 (W4A4; refused without input_scale)
//
// Every input is checked before the layer runs and the output is written only
// on success (atomically), so a failed run leaves no file behind.
// Tested in tests/tools/test_cli.cpp against a float reference and for each
// rejected input.
#include <cstdio>
#include <memory>
#include <optional>
#include <sstream>

#include "cli_util.hpp"
#include "commands.hpp"
#include "fp4moe/error.hpp"
#include "fp4moe/model_config.hpp"
#include "fp4moe/modelopt.hpp"
#include "fp4moe/nvfp4.hpp"
#include "fp4moe/reference.hpp"
#include "fp4moe/safetensors.hpp"
#include "moe_input.hpp"

namespace fp4moe::cli {
namespace {

struct MoeOptions {
  std::string weights;
  std::string input;
  std::string output;
  std::optional<std::string> prefix;
  std::optional<int> layer;
  std::string routing = "softmax";
  std::optional<int> top_k;
  bool no_renormalize = false;
  int num_groups = 1;
  int topk_groups = 1;
  float routed_scaling_factor = 1.0f;
  std::string activation = "swiglu";
  std::string device = "auto";
  std::string finalize = "deterministic";
  std::string activations = "checkpoint";
  int ep = 0;  // 0: one GPU, no NCCL
};

std::string number_text(double v) {
  std::ostringstream os;
  os << v;
  return os.str();
}

// The routing of the layer: config.json's where the checkpoint has one (a
// flag that says otherwise is refused, naming both values), else the flags.
LogitRoutingFlags resolve_routing(const MoeOptions& opts, const CLI::App& cmd,
                                  const std::optional<MoeModelConfig>& config) {
  LogitRoutingFlags flags;
  flags.mode = opts.routing;
  flags.top_k = opts.top_k;
  flags.renormalize = !opts.no_renormalize;
  flags.num_groups = opts.num_groups;
  flags.topk_groups = opts.topk_groups;
  flags.routed_scaling_factor = opts.routed_scaling_factor;
  if (!config) return flags;

  const MoeModelConfig& c = *config;
  const RoutingParams& r = c.routing;
  auto refuse_if = [&](const char* flag, bool contradicts, const std::string& given, const std::string& configured) {
    FP4MOE_CHECK(!(cmd.count(flag) > 0 && contradicts), flag, given.empty() ? "" : " ", given, " contradicts ", c.where,
                 ": ", configured, " (leave the flag out: config.json sets the routing)");
  };
  const std::string routing_says = "routing " + c.describe_routing();
  refuse_if("--routing", opts.routing != to_string(r.mode), opts.routing, routing_says);
  if (c.top_k)
    refuse_if("--topk", opts.top_k && *opts.top_k != *c.top_k, opts.top_k ? std::to_string(*opts.top_k) : "",
              c.top_k_key + " = " + std::to_string(*c.top_k));
  refuse_if("--no-renormalize", r.mode != RoutingMode::kSoftmaxTopK || r.renormalize, "", routing_says);
  const bool noaux = r.mode == RoutingMode::kNoauxTc;
  refuse_if("--n-group", opts.num_groups != (noaux ? r.num_groups : 1), std::to_string(opts.num_groups), routing_says);
  refuse_if("--topk-group", opts.topk_groups != (noaux ? r.topk_groups : 1), std::to_string(opts.topk_groups),
            routing_says);
  refuse_if("--routed-scaling-factor", opts.routed_scaling_factor != (noaux ? r.routed_scaling_factor : 1.0f),
            number_text(opts.routed_scaling_factor), routing_says);
  refuse_if(
      "--activation", parse_activation(opts.activation) != c.activation, opts.activation,
      "activation " + to_string(c.activation) + (c.model_type.empty() ? "" : " (model_type " + c.model_type + ")"));

  flags.mode = to_string(r.mode);
  if (c.top_k) flags.top_k = *c.top_k;
  flags.renormalize = r.renormalize;
  flags.num_groups = r.num_groups;
  flags.topk_groups = r.topk_groups;
  flags.routed_scaling_factor = r.routed_scaling_factor;
  return flags;
}

// config.json's sizes must be the loaded layer's: a config of another model
// beside the weights would route them wrongly.
void check_config_sizes(const MoeModelConfig& c, const MoeWeights& weights) {
  FP4MOE_CHECK(!c.hidden_size || *c.hidden_size == weights.hidden, c.where,
               ": hidden_size = ", c.hidden_size.value_or(0),
               " but the experts' weights have hidden = ", weights.hidden);
  FP4MOE_CHECK(!c.moe_intermediate_size || *c.moe_intermediate_size == weights.inter, c.where, ": ",
               c.moe_intermediate_key, " = ", c.moe_intermediate_size.value_or(0),
               " but the experts' weights have inter = ", weights.inter);
  // A shared expert the config declares must be there (never dropped
  // silently), as wide as declared.
  const int64_t shared_width =
      c.num_shared_experts > 0 ? c.num_shared_experts * weights.inter : c.shared_expert_intermediate_size;
  const std::string declared = c.num_shared_experts > 0
                                   ? "n_shared_experts = " + std::to_string(c.num_shared_experts) + " (" +
                                         std::to_string(shared_width) + " wide)"
                                   : "shared_expert_intermediate_size = " + std::to_string(shared_width);
  FP4MOE_CHECK(shared_width == 0 || weights.shared_expert, c.where, ": ", declared,
               " but the checkpoint has no shared expert tensors for the layer ('<prefix>shared_experts.*' or "
               "'<prefix>shared_expert.*')");
  FP4MOE_CHECK(shared_width == 0 || weights.shared_expert->inter == shared_width, c.where, ": ", declared,
               " but the checkpoint's shared expert is ", weights.shared_expert ? weights.shared_expert->inter : 0,
               " wide");
}

void run_moe(const MoeOptions& opts, const CLI::App& cmd) {
  Timer total_timer;
  // Refuse an unavailable backend before any loading.
  const Device device = resolve_device(parse_device(opts.device));
  if (cmd.count("--ep") > 0) {
    FP4MOE_CHECK(device == Device::kCuda, "--ep ", opts.ep,
                 " needs the CUDA backend (--device cuda or auto on a "
                 "machine with GPUs); this run resolved to the CPU");
    FP4MOE_CHECK(built_with_nccl(), "--ep needs NCCL, and this fp4moe was built without it");
    const int num_gpus = probe_gpu().num_devices;
    FP4MOE_CHECK(opts.ep <= num_gpus, "--ep ", opts.ep, " needs ", opts.ep, " GPUs; this machine has ", num_gpus);
    FP4MOE_CHECK(opts.finalize == "deterministic",
                 "--ep needs --finalize deterministic (home ranks sum each "
                 "token's rows in slot order)");
  }
  check_output_path(opts.output);

  const std::string prefix = opts.prefix  ? *opts.prefix
                             : opts.layer ? layer_prefix(opts.weights, *opts.layer)
                                          : detect_prefix(opts.weights);
  const MoeWeights weights = load_moe_weights(opts.weights, prefix);
  const std::optional<MoeModelConfig> config = read_moe_model_config(opts.weights);
  if (config) check_config_sizes(*config, weights);
  const int64_t num_experts = weights.num_experts;
  const int64_t hidden = weights.hidden;
  FP4MOE_CHECK(num_experts > 0, opts.weights, ": no experts under prefix '", prefix, "'");
  // Resolved once here, so every backend (and every expert-parallel rank)
  // runs the same numerics; fp4 without input scales is refused here.
  const ActivationNumerics activations =
      resolve_activation_numerics(weights, parse_activation_numerics(opts.activations));

  const SafetensorsFile in = SafetensorsFile::open(opts.input);
  const LogitRoutingFlags flags = resolve_routing(opts, cmd, config);
  const std::string activation = config ? to_string(config->activation) : opts.activation;
  const std::optional<RouterWeights> router = load_router_weights(opts.weights, prefix);
  const MoeInput input = read_moe_input(in, hidden, num_experts, flags, router ? &*router : nullptr);
  const int64_t num_tokens = input.num_tokens;
  const Routing& routing = input.routing;
  if (input.routing_source == "topk_ids") {
    for (const char* flag :
         {"--routing", "--topk", "--no-renormalize", "--n-group", "--topk-group", "--routed-scaling-factor"}) {
      if (cmd.count(flag) > 0) std::fprintf(stderr, "moe: note: %s is ignored: the input gives topk_ids\n", flag);
    }
  }
  for (const std::string& note : input.notes) std::fprintf(stderr, "moe: note: %s\n", note.c_str());

  std::vector<float> output(static_cast<size_t>(num_tokens * hidden));
  MoeLayerOptions layer_options;
  layer_options.activation = parse_activation(activation);
  layer_options.finalize = parse_finalize_mode(opts.finalize);
  layer_options.activations = activations;
  if (device == Device::kCpu && cmd.count("--finalize") > 0)
    std::fprintf(stderr, "moe: note: --finalize applies to the CUDA backend only; ignored\n");
  const MoeRunStats stats =
      opts.ep > 0 ? run_moe_layer_expert_parallel(weights, input.hidden_states.data(), routing, layer_options, opts.ep,
                                                  output.data())
                  : run_moe_layer(device, weights, input.hidden_states.data(), routing, layer_options, output.data());
  if (opts.ep > 0) std::fprintf(stderr, "moe: %s", stats.plan.c_str());

  std::vector<uint16_t> output_bf16(output.size());
  for (size_t i = 0; i < output.size(); ++i) output_bf16[i] = float_to_bf16(output[i]);
  SafetensorsWriter writer;
  writer.add("output", DType::BF16, {num_tokens, hidden}, output_bf16.data(), output_bf16.size() * sizeof(uint16_t));
  writer.set_metadata("format", "pt");
  writer.set_metadata("producer", std::string("fp4moe ") + FP4MOE_VERSION + " moe");
  writer.write(opts.output);

  const std::string backend_detail =
      device == Device::kCuda ? " finalize=" + opts.finalize + (opts.ep > 0 ? " ep=" + std::to_string(opts.ep) : "")
                              : " threads=" + std::to_string(stats.num_threads);
  const std::string shared = weights.shared_expert ? " shared=" + std::to_string(weights.shared_expert->inter) +
                                                         (weights.shared_expert->gate.empty() ? "" : "(gated)") +
                                                         (weights.shared_expert->dense() ? "(unquantised)" : "")
                                                   : "";
  std::fprintf(stderr,
               "moe: T=%lld E=%lld k=%d H=%lld I=%lld%s routing=%s activation=%s activations=%s backend=%s%s "
               "layer %.3f ms, total %.2f ms\n",
               static_cast<long long>(num_tokens), static_cast<long long>(num_experts), routing.top_k,
               static_cast<long long>(hidden), static_cast<long long>(weights.inter), shared.c_str(),
               input.routing_source.c_str(), activation.c_str(), to_string(activations).c_str(), stats.backend.c_str(),
               backend_detail.c_str(), stats.time_ms, total_timer.elapsed_ms());
}

}  // namespace

void add_moe_command(CLI::App& app) {
  auto opts = std::make_shared<MoeOptions>();
  CLI::App* cmd = app.add_subcommand(
      "moe",
      "Run one MoE layer of an NVFP4 checkpoint. The input holds hidden_states [T, H] (BF16 or F32) "
      "and either topk_ids [T, k] I32 + topk_weights [T, k] F32, or router_logits [T, E] F32 "
      "(+ optional e_score_correction_bias [E]), or nothing more: the logits then come from the checkpoint's "
      "router. Logits are routed as the checkpoint's config.json says (a flag that contradicts it is refused), "
      "else by the flags below. Writes output [T, H] BF16.");
  cmd->add_option("--weights,-w", opts->weights, "checkpoint: .safetensors file or directory")
      ->required()
      ->check(CLI::ExistingPath);
  cmd->add_option("--input,-i", opts->input, "input .safetensors (hidden_states + routing)")
      ->required()
      ->check(CLI::ExistingFile);
  cmd->add_option("--output,-o", opts->output, "output .safetensors (written only on success)")->required();
  cmd->add_option("--prefix", opts->prefix,
                  "tensor name prefix of the layer, e.g. 'model.layers.3.mlp.' (default: the only "
                  "layer with experts in the checkpoint)");
  cmd->add_option("--layer", opts->layer,
                  "the layer by number: the checkpoint's expert prefix that holds 'layers.N.' (instead of --prefix)")
      ->check(CLI::NonNegativeNumber)
      ->excludes("--prefix");
  cmd->add_option("--routing", opts->routing, "routing of router_logits")
      ->check(CLI::IsMember({"softmax", "noaux_tc", "gptoss"}))
      ->capture_default_str();
  cmd->add_option("--topk,-k", opts->top_k, "experts per token (needed with router_logits)");
  cmd->add_flag("--no-renormalize", opts->no_renormalize, "softmax routing: keep the top-k probabilities as they are");
  cmd->add_option("--n-group", opts->num_groups, "noaux_tc: number of expert groups")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  cmd->add_option("--topk-group", opts->topk_groups, "noaux_tc: groups kept per token")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  cmd->add_option("--routed-scaling-factor", opts->routed_scaling_factor, "noaux_tc: multiplies the routing weights")
      ->capture_default_str();
  cmd->add_option("--activation", opts->activation, "swiglu: silu(gate)*up; gptoss: clamped gpt-oss variant")
      ->check(CLI::IsMember({"swiglu", "gptoss"}))
      ->capture_default_str();
  cmd->add_option("--device", opts->device,
                  "backend: auto (the GPU when there is one, else the CPU), cpu (the reference), cuda")
      ->check(CLI::IsMember({"auto", "cpu", "cuda"}))
      ->capture_default_str();
  cmd->add_option("--finalize", opts->finalize,
                  "CUDA: how a token's top-k rows are summed: deterministic (fixed order, bit-identical "
                  "runs) or atomic (fp32 atomic adds)")
      ->check(CLI::IsMember({"deterministic", "atomic"}))
      ->capture_default_str();
  cmd->add_option("--activations", opts->activations,
                  "precision of the experts' input activations: checkpoint (fp4 for an NVFP4 (W4A4) "
                  "checkpoint with input_scale, else bf16), bf16 (W4A16), fp4 (W4A4: quantised per 16 "
                  "against input_scale; refused for a checkpoint without it)")
      ->check(CLI::IsMember({"checkpoint", "bf16", "fp4"}))
      ->capture_default_str();
  cmd->add_option("--ep", opts->ep,
                  "CUDA: run the layer expert parallel over this machine's first N GPUs, one NCCL rank each "
                  "(experts placed contiguously, tokens split in order); per-rank traffic and times on stderr")
      ->check(CLI::Range(1, 64));
  cmd->callback([opts, cmd] { run_moe(*opts, *cmd); });
}

}  // namespace fp4moe::cli
