// Helpers shared by the fp4moe subcommands: a progress indicator and a
// wall-clock timer on stderr, the --device choice, and the one place that
// runs an MoE layer on a backend (the CPU reference or the CUDA layer,
// fp4moe::MoeLayer). Reading float tensors whatever their dtype lives in
// tensors.hpp (host-only, so the fuzz targets can compile it).
// Tested through the CLI in tests/tools/test_cli.cpp.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "fp4moe/modelopt.hpp"
#include "fp4moe/moe_layer.hpp"
#include "fp4moe/reference.hpp"
#include "fp4moe/safetensors.hpp"
#include "tensors.hpp"
#include "util/output_path.hpp"  // check_output_path

namespace fp4moe::bench {
struct LayerShape;  // bench/layer_bench.hpp
}

namespace fp4moe::cli {

struct ModelShape;  // models.hpp

// The layer benchmark's description of a model shape (name, experts, sizes,
// routing, activation, biases).
bench::LayerShape layer_shape(const ModelShape& model);

// ------------------------------------------------------------------ files

// "12.3 MB" with decimal units.
std::string format_bytes(double bytes);

// The one layer prefix ("model.layers.3.mlp.") whose experts the checkpoint
// at `path` holds; throws, listing them, when it holds several layers (the
// user must choose with --prefix) and when it holds none. Expert tensors
// named as ModelOpt does or as Mixtral does (w1) count; a checkpoint with
// stacked expert tensors only gives the first stack's prefix, for the loader to
// refuse with its reason.
std::string detect_prefix(const std::string& path);

// The layer prefix of layer number `layer` ("model.layers.3.mlp.", Mixtral's
// "model.layers.3.block_sparse_moe."): the one expert prefix holding
// "layers.<layer>."; throws naming the checkpoint when there is none or
// several.
std::string layer_prefix(const std::string& path, int layer);

// ------------------------------------------------------------ progress, time

// A one-line progress indicator on stderr, with the time elapsed and, once
// some work is done, the time left at the rate so far (ETA). On a terminal
// the line is redrawn in place (at most ~10 times a second); otherwise a line
// is printed at most every few seconds, so logs stay short. Disabled
// indicators print nothing.
class Progress {
 public:
  // How done/total are shown: "3/8", "1.2 GB/3.4 GB", or only as the
  // percentage (units of estimated work, e.g. microseconds of GPU time).
  enum class Unit { kCount, kBytes, kWork };
  Progress(std::string label, int64_t total, bool enabled = true, Unit unit = Unit::kCount);
  ~Progress();
  Progress(const Progress&) = delete;
  Progress& operator=(const Progress&) = delete;

  // Marks `count` more units done; `detail` (e.g. a tensor name) is shown
  // beside the count.
  void advance(int64_t count = 1, std::string_view detail = {});
  // Ends the line (called by the destructor if not before).
  void finish();
  // On a terminal, erases the line so that other output (a table row on
  // stdout) starts on a clean one; the next advance() draws it again.
  void clear();

 private:
  void draw(std::string_view detail, bool final);

  std::string label_;
  int64_t total_;
  int64_t done_ = 0;
  bool enabled_;
  Unit unit_;
  bool tty_;
  bool finished_ = false;
  std::chrono::steady_clock::time_point start_;
  std::chrono::steady_clock::time_point last_draw_;
};

class Timer {
 public:
  Timer() : start_(std::chrono::steady_clock::now()) {}
  double elapsed_ms() const {
    return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start_).count();
  }

 private:
  std::chrono::steady_clock::time_point start_;
};

// ------------------------------------------------------------------ backends

enum class Device { kAuto, kCpu, kCuda };

// "auto", "cpu", "cuda"; the CLI restricts the spelling with CLI::IsMember.
Device parse_device(const std::string& name);

// What the machine offers: the number of visible CUDA devices and a one-line
// description ("NVIDIA H200 (SM90, 139 GiB)" or why there is none).
struct GpuInfo {
  int num_devices = 0;
  std::string description;
};
GpuInfo probe_gpu();

// The backend a request resolves to. kAuto picks the fastest available
// backend: kCuda when probe_gpu() finds a device, else kCpu. kCuda without a
// usable GPU throws, saying what the machine has.
Device resolve_device(Device requested);

struct MoeRunStats {
  std::string backend;   // "cpu (reference, ...)" or "cuda (NVIDIA H200)"
  int num_threads = 0;   // CPU threads (CPU backend); 0 for CUDA
  double time_ms = 0.0;  // the layer only: CPU wall time, or CUDA events around forward()
  std::string plan;      // CUDA: the forward's MoeLayerPlan::describe(); empty for the CPU
};

// Runs one MoE layer on `device` (already resolved) with the caller's
// routing. hidden_states [T, H] float; the CUDA backend runs in bf16, so
// they should be bf16-representable (they are rounded to nearest even).
// output [T, H] float. layer_options: the activation for both backends; the
// finalize and gather modes and forced tile configs for CUDA (its routing
// parameters are unused: the routing is given). For CUDA, the time excludes
// preparing and uploading the weights. `progress`, when given, advances by
// one per token (at once at the end on the GPU).
MoeRunStats run_moe_layer(Device device, const MoeWeights& weights, const float* hidden_states, const Routing& routing,
                          const MoeLayerOptions& layer_options, float* output, Progress* progress = nullptr);

// Whether this build has the NCCL expert-parallel layer (fp4moe_nccl).
bool built_with_nccl();

// The CUDA layer expert-parallel over the first num_ranks GPUs of this
// machine in one process (run_ranks_in_threads: a thread and an NCCL rank
// per GPU, experts placed contiguously, tokens split into num_ranks
// consecutive runs). Same arguments and output as run_moe_layer; the
// finalize must be deterministic. time_ms is the slowest rank's forward
// (after one untimed forward); plan says per rank what moved and where the
// time went. Throws when the build lacks NCCL or the machine the GPUs.
MoeRunStats run_moe_layer_expert_parallel(const MoeWeights& weights, const float* hidden_states, const Routing& routing,
                                          const MoeLayerOptions& layer_options, int num_ranks, float* output);

Activation parse_activation(const std::string& name);  // "swiglu", "gptoss"
std::string to_string(Activation activation);

}  // namespace fp4moe::cli
