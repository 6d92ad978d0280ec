// Helpers shared by the fp4moe subcommands: reading float tensors whatever
// their dtype, a progress indicator and a wall-clock timer on stderr, the
// --device choice, and the one place that runs an MoE layer on a backend (so
// the CUDA layer slots in here when it exists).
// Tested through the CLI in tests/tools/test_cli.cpp.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "fp4moe/modelopt.hpp"
#include "fp4moe/reference.hpp"
#include "fp4moe/safetensors.hpp"

namespace fp4moe::cli {

// ------------------------------------------------------------------ tensors

bool is_float_dtype(DType dtype);  // F32, BF16, F16

// The tensor converted to float (row-major, same element order). Throws
// naming the tensor unless its dtype is F32, BF16 or F16.
std::vector<float> tensor_to_float(const TensorView& view);

// Largest |x| over the float elements [begin, begin + count) of the tensor
// (NaN ignored), without materialising a float copy.
float tensor_abs_max(const TensorView& view, int64_t begin, int64_t count);

// Checks name's dtype and shape; the message names the tensor, the file and
// what was expected. An expected extent of -1 matches any extent.
void expect_tensor(const TensorView& view, const std::string& file,
                   std::initializer_list<DType> dtypes, std::initializer_list<int64_t> shape);

// Checks up front, before any long work, that `path` can be written: its
// directory exists and it is not itself a directory.
void check_output_path(const std::string& path);

// "12.3 MB" with decimal units.
std::string format_bytes(double bytes);

// ------------------------------------------------------------ progress, time

// A one-line progress indicator on stderr. On a terminal the line is redrawn
// in place (at most ~10 times a second); otherwise a line is printed at most
// every few seconds, so logs stay short. Disabled indicators print nothing.
class Progress {
 public:
  enum class Unit { kCount, kBytes };  // how done/total are shown: "3/8" or "1.2 GB/3.4 GB"
  Progress(std::string label, int64_t total, bool enabled = true, Unit unit = Unit::kCount);
  ~Progress();
  Progress(const Progress&) = delete;
  Progress& operator=(const Progress&) = delete;

  // Marks `count` more units done; `detail` (e.g. a tensor name) is shown
  // beside the count.
  void advance(int64_t count = 1, std::string_view detail = {});
  // Ends the line (called by the destructor if not before).
  void finish();

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
    return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start_)
        .count();
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
// backend (the CPU reference today); kCuda throws: the CUDA layer is not
// built yet.
Device resolve_device(Device requested);

struct MoeRunStats {
  std::string backend;  // "cpu (reference)"
  int num_threads = 0;
  double time_ms = 0.0;
};

// Runs one MoE layer on `device` (already resolved). output [T, H] float.
// `progress`, when given, advances by one per token.
MoeRunStats run_moe_layer(Device device, const MoeWeights& weights, const float* hidden_states,
                          const Routing& routing, Activation activation, float* output,
                          Progress* progress = nullptr);

Activation parse_activation(const std::string& name);  // "swiglu", "gptoss"
std::string to_string(Activation activation);

}  // namespace fp4moe::cli
