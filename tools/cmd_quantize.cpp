// `fp4moe quantize IN OUT`: float checkpoint -> NVIDIA ModelOpt NVFP4
// checkpoint as ModelOpt's W4A16_NVFP4 export writes it, through the
// library's converter (fp4moe/checkpoint.hpp: the layouts, shared scales and
// output; src/format/convert.cpp). This command parses the arguments, shows
// the progress line, turns SIGINT/SIGTERM into a clean stop and prints the
// summary.
// Tested in tests/tools/test_quantize.cpp (directories, shards, configs,
// shared scales, stacked layouts, refusals, failures and signals midway) and
// tests/tools/test_cli.cpp (bit equality with quantize_nvfp4, the loader).
#include <csignal>
#include <cstdio>
#include <memory>
#include <optional>

#include "cli_util.hpp"
#include "commands.hpp"
#include "fp4moe/checkpoint.hpp"
#include "fp4moe/error.hpp"

namespace fp4moe::cli {
namespace {

// Above this much input the progress line is shown.
constexpr uint64_t kProgressMinBytes = uint64_t{64} << 20;

struct QuantizeOptions {
  std::string input;
  std::string output;
  QuantizeCheckpointOptions convert;
  bool quiet = false;
};

// ------------------------------------------------------------- interrupts

// Ctrl-C or SIGTERM during a long run: the work stops at the next tensor
// and the temporary output is removed like after any error (a second signal
// kills at once: the handler restores the default).
volatile std::sig_atomic_t g_interrupt_signal = 0;

extern "C" void on_interrupt(int sig) {
  g_interrupt_signal = sig;
  std::signal(sig, SIG_DFL);
}

class InterruptGuard {
 public:
  InterruptGuard() {
    g_interrupt_signal = 0;
    previous_int_ = std::signal(SIGINT, on_interrupt);
    previous_term_ = std::signal(SIGTERM, on_interrupt);
    // A signal the caller ignores (nohup, a background job) stays ignored.
    if (previous_int_ == SIG_IGN) std::signal(SIGINT, SIG_IGN);
    if (previous_term_ == SIG_IGN) std::signal(SIGTERM, SIG_IGN);
  }
  ~InterruptGuard() {
    std::signal(SIGINT, previous_int_);
    std::signal(SIGTERM, previous_term_);
  }
  InterruptGuard(const InterruptGuard&) = delete;
  InterruptGuard& operator=(const InterruptGuard&) = delete;
  static void check() {
    FP4MOE_CHECK(g_interrupt_signal == 0, "quantize: interrupted by signal ", static_cast<int>(g_interrupt_signal),
                 "; nothing was written");
  }

 private:
  void (*previous_int_)(int) = SIG_DFL;
  void (*previous_term_)(int) = SIG_DFL;
};

void run_quantize(const QuantizeOptions& opts) {
  Timer timer;
  // Installed once the outputs are planned, as the progress line starts.
  std::optional<InterruptGuard> interrupt_guard;
  std::optional<Progress> progress;
  QuantizeCheckpointProgress report;
  report.begin = [&](uint64_t input_bytes) {
    interrupt_guard.emplace();
    progress.emplace("quantize", static_cast<int64_t>(input_bytes), !opts.quiet && input_bytes >= kProgressMinBytes,
                     Progress::Unit::kBytes);
  };
  report.advance = [&](uint64_t bytes, std::string_view detail) {
    progress->advance(static_cast<int64_t>(bytes), detail);
  };
  report.end = [&] { progress->finish(); };
  report.before_write = [] { InterruptGuard::check(); };
  const QuantizeCheckpointSummary done = quantize_checkpoint(opts.input, opts.output, opts.convert, report);
  std::fprintf(stderr,
               "quantize: %s (%s) -> %s: %zu matrices quantised to %s (%d expert stacks split), %d tensors "
               "copied, %zu shard%s, %.1f s\n",
               opts.input.c_str(), format_bytes(static_cast<double>(done.input_bytes)).c_str(), done.output.c_str(),
               done.num_matrices, opts.convert.algo.c_str(), done.num_expert_stacks, done.num_copied, done.num_shards,
               done.num_shards == 1 ? "" : "s", timer.elapsed_ms() / 1e3);
}

}  // namespace

void add_quantize_command(CLI::App& app) {
  auto opts = std::make_shared<QuantizeOptions>();
  CLI::App* cmd = app.add_subcommand(
      "quantize",
      "Quantise a float checkpoint (F32/BF16/F16) to NVIDIA ModelOpt NVFP4, as ModelOpt's W4A16_NVFP4 export "
      "writes it: every linear '<m>.weight' [N, K] becomes weight (U8 [N, K/2]), weight_scale (F8_E4M3 "
      "[N, K/16]) and weight_scale_2 (F32); stacked experts ('<p>experts.gate_up_proj' [E, 2I, H] or Llama4/"
      "gpt-oss [E, H, 2I], '<p>experts.{gate,up,down}_proj[.weight]') are split into "
      "'<p>experts.<e>.<proj>.*'. q/k/v of an attention block and gate/up of an MLP or expert share "
      "weight_scale_2. Routers, lm_head, embeddings and the other layers ModelOpt keeps are copied bit for "
      "bit, as is everything else. IN is a .safetensors file (OUT: a file) or a checkpoint directory (OUT: a "
      "new directory with shards sized like IN's, model.safetensors.index.json, hf_quant_config.json, "
      "config.json with quantization_config, and IN's other files). Memory is bounded by the largest tensor; "
      "the output appears only when complete.");
  cmd->add_option("IN", opts->input, "input .safetensors file or checkpoint directory with float weights")
      ->required()
      ->check(CLI::ExistingPath);
  cmd->add_option("OUT", opts->output, "output .safetensors file, or directory when IN is one")->required();
  cmd->add_option("--algo", opts->convert.algo,
                  "W4A16_NVFP4 (default; weight-only NVFP4, no input_scale). NVFP4 (W4A4) is refused: its "
                  "input_scale needs activations calibrated on data")
      ->capture_default_str();
  cmd->add_option("--exclude", opts->convert.excludes,
                  "glob of tensor or module names to keep unquantised (repeatable), e.g. '*layers.0.*'")
      ->allow_extra_args(false);
  cmd->add_flag(
      "--no-default-exclude", opts->convert.no_default_exclude,
      "also quantise embeddings and what ModelOpt keeps in high precision: " + [] {
        std::string list;
        for (const std::string& p : default_quantize_excludes()) list += (list.empty() ? "" : " ") + p;
        return list;
      }());
  cmd->add_flag("-q,--quiet", opts->quiet, "no progress line");
  cmd->callback([opts] { run_quantize(*opts); });
}

}  // namespace fp4moe::cli
