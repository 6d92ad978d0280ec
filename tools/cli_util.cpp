// Helpers shared by the fp4moe subcommands (see cli_util.hpp).
// Tested through the CLI in tests/tools/test_cli.cpp.
#include "cli_util.hpp"

#include <cuda_runtime_api.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <thread>

#include "fp4moe/error.hpp"
#include "fp4moe/nvfp4.hpp"

namespace fp4moe::cli {

// ------------------------------------------------------------------ tensors

bool is_float_dtype(DType dtype) {
  return dtype == DType::F32 || dtype == DType::BF16 || dtype == DType::F16;
}

namespace {

// Calls fn(index, value) for elements [begin, begin + count) of a float tensor.
template <typename Fn>
void for_each_float(const TensorView& view, int64_t begin, int64_t count, Fn&& fn) {
  FP4MOE_CHECK(begin >= 0 && count >= 0 && begin + count <= view.numel(),
               "tensor '", view.name, "': element range [", begin, ", ", begin + count,
               ") outside its ", view.numel(), " elements");
  const uint8_t* data = view.data;
  // The mapped data of a safetensors file need not be aligned: memcpy each element.
  switch (view.dtype) {
    case DType::F32:
      for (int64_t i = begin; i < begin + count; ++i) {
        float v;
        std::memcpy(&v, data + 4 * i, 4);
        fn(i, v);
      }
      return;
    case DType::BF16:
      for (int64_t i = begin; i < begin + count; ++i) {
        uint16_t h;
        std::memcpy(&h, data + 2 * i, 2);
        fn(i, bf16_to_float(h));
      }
      return;
    case DType::F16:
      for (int64_t i = begin; i < begin + count; ++i) {
        uint16_t h;
        std::memcpy(&h, data + 2 * i, 2);
        fn(i, f16_to_float(h));
      }
      return;
    default:
      FP4MOE_THROW("tensor '", view.name, "' has dtype ", dtype_name(view.dtype),
                   "; expected a float dtype (F32, BF16 or F16)");
  }
}

}  // namespace

std::vector<float> tensor_to_float(const TensorView& view) {
  std::vector<float> out(static_cast<size_t>(view.numel()));
  for_each_float(view, 0, view.numel(), [&](int64_t i, float v) { out[static_cast<size_t>(i)] = v; });
  return out;
}

float tensor_abs_max(const TensorView& view, int64_t begin, int64_t count) {
  float amax = 0.0f;
  for_each_float(view, begin, count, [&](int64_t, float v) {
    const float a = std::fabs(v);
    if (a > amax) amax = a;  // false for NaN
  });
  return amax;
}

void expect_tensor(const TensorView& view, const std::string& file,
                   std::initializer_list<DType> dtypes, std::initializer_list<int64_t> shape) {
  if (std::find(dtypes.begin(), dtypes.end(), view.dtype) == dtypes.end()) {
    std::string expected;
    for (DType d : dtypes) expected += (expected.empty() ? "" : " or ") + std::string(dtype_name(d));
    FP4MOE_THROW(file, ": tensor '", view.name, "' has dtype ", dtype_name(view.dtype),
                 "; expected ", expected);
  }
  bool ok = view.shape.size() == shape.size();
  for (size_t i = 0; ok && i < shape.size(); ++i) {
    const int64_t want = *(shape.begin() + i);
    ok = want < 0 || view.shape[i] == want;
  }
  if (!ok) {
    std::string expected = "[";
    for (size_t i = 0; i < shape.size(); ++i) {
      const int64_t want = *(shape.begin() + i);
      expected += (i ? ", " : "") + (want < 0 ? std::string("*") : std::to_string(want));
    }
    expected += "]";
    FP4MOE_THROW(file, ": tensor '", view.name, "' has shape ", shape_to_string(view.shape),
                 "; expected ", expected);
  }
}

void check_output_path(const std::string& path) {
  namespace fs = std::filesystem;
  const fs::path parent = fs::absolute(fs::path(path)).parent_path();
  FP4MOE_CHECK(fs::is_directory(parent), "output ", path, ": directory ", parent.string(),
               " does not exist");
  FP4MOE_CHECK(!fs::is_directory(path), "output ", path, " is a directory; expected a file name");
}

std::string format_bytes(double bytes) {
  const char* units[] = {"B", "kB", "MB", "GB", "TB"};
  int unit = 0;
  while (bytes >= 1000.0 && unit < 4) {
    bytes /= 1000.0;
    ++unit;
  }
  char buf[32];
  std::snprintf(buf, sizeof buf, unit == 0 ? "%.0f %s" : "%.2f %s", bytes, units[unit]);
  return buf;
}

// ------------------------------------------------------------ progress, time

Progress::Progress(std::string label, int64_t total, bool enabled, Unit unit)
    : label_(std::move(label)),
      total_(total),
      enabled_(enabled),
      unit_(unit),
      tty_(isatty(STDERR_FILENO) != 0),
      start_(std::chrono::steady_clock::now()),
      last_draw_(start_) {
  if (enabled_ && tty_) draw({}, false);
}

Progress::~Progress() { finish(); }

void Progress::advance(int64_t count, std::string_view detail) {
  done_ += count;
  if (!enabled_) return;
  const auto now = std::chrono::steady_clock::now();
  const double since_draw_s = std::chrono::duration<double>(now - last_draw_).count();
  if (since_draw_s >= (tty_ ? 0.1 : 5.0)) draw(detail, false);
}

void Progress::finish() {
  if (finished_) return;
  finished_ = true;
  if (enabled_) draw({}, true);
}

void Progress::draw(std::string_view detail, bool final) {
  last_draw_ = std::chrono::steady_clock::now();
  const double elapsed_s = std::chrono::duration<double>(last_draw_ - start_).count();
  const double percent = total_ > 0 ? 100.0 * static_cast<double>(done_) / static_cast<double>(total_) : 100.0;
  std::string line = label_ + ": ";
  if (unit_ == Unit::kBytes) {
    line += format_bytes(static_cast<double>(done_)) + "/" + format_bytes(static_cast<double>(total_));
  } else {
    line += std::to_string(done_) + "/" + std::to_string(total_);
  }
  char tail[64];
  std::snprintf(tail, sizeof tail, " (%3.0f%%) %.1f s", percent, elapsed_s);
  line += tail;
  if (!detail.empty() && !final) {
    line += "  ";
    // Keep the line within a typical terminal width.
    line += detail.size() > 60 ? "..." + std::string(detail.substr(detail.size() - 57)) : std::string(detail);
  }
  if (tty_) {
    std::fprintf(stderr, "\r\033[K%s%s", line.c_str(), final ? "\n" : "");
  } else {
    std::fprintf(stderr, "%s\n", line.c_str());
  }
  std::fflush(stderr);
}

// ------------------------------------------------------------------ backends

Device parse_device(const std::string& name) {
  if (name == "auto") return Device::kAuto;
  if (name == "cpu") return Device::kCpu;
  if (name == "cuda") return Device::kCuda;
  FP4MOE_THROW("unknown device '", name, "'; expected auto, cpu or cuda");
}

GpuInfo probe_gpu() {
  GpuInfo info;
  int count = 0;
  const cudaError_t status = cudaGetDeviceCount(&count);
  if (status == cudaErrorInsufficientDriver || status == cudaErrorNoDevice || (status == cudaSuccess && count == 0)) {
    info.description = status == cudaErrorInsufficientDriver ? "none (no NVIDIA driver for CUDA 13 found)"
                                                             : "none (no CUDA device visible)";
    return info;
  }
  if (status != cudaSuccess) {
    info.description = std::string("none usable (") + cudaGetErrorName(status) + ": " +
                       cudaGetErrorString(status) + ")";
    return info;
  }
  info.num_devices = count;
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, 0) == cudaSuccess) {
    const double memory_gib = static_cast<double>(prop.totalGlobalMem) / (1024.0 * 1024.0 * 1024.0);
    info.description = std::string(prop.name) + " (SM" + std::to_string(prop.major) +
                       std::to_string(prop.minor) + ", " +
                       std::to_string(static_cast<int>(std::lround(memory_gib))) + " GiB)";
    if (count > 1) info.description += " and " + std::to_string(count - 1) + " more";
  } else {
    info.description = std::to_string(count) + " CUDA device(s)";
  }
  return info;
}

Device resolve_device(Device requested) {
  switch (requested) {
    case Device::kCpu:
      return Device::kCpu;
    case Device::kAuto:
      // NOTE: the CUDA MoE layer is not built yet; when it is, kAuto becomes
      // kCuda whenever probe_gpu() finds a device.
      return Device::kCpu;
    case Device::kCuda:
      FP4MOE_THROW("--device cuda: the CUDA MoE layer is not built yet in this version of fp4moe; "
                   "use --device cpu (or auto) for the CPU reference backend");
  }
  FP4MOE_THROW("invalid device");
}

MoeRunStats run_moe_layer(Device device, const MoeWeights& weights, const float* hidden_states,
                          const Routing& routing, Activation activation, float* output,
                          Progress* progress) {
  FP4MOE_CHECK(device == Device::kCpu, "run_moe_layer: only the CPU backend exists");
  MoeRunStats stats;
  stats.backend = "cpu (reference, double accumulation)";
  stats.num_threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  const int64_t num_tokens = routing.num_tokens;
  const int top_k = routing.top_k;
  const int64_t hidden = weights.hidden;

  // With a progress indicator, run in up to 10 token chunks so it moves. The
  // reference computes each token on its own, so chunking does not change
  // the result; it costs re-dequantising experts that several chunks share.
  const int64_t chunk = progress ? std::max<int64_t>(1, (num_tokens + 9) / 10) : num_tokens;
  Timer timer;
  for (int64_t begin = 0; begin < num_tokens; begin += chunk) {
    const int64_t count = std::min(chunk, num_tokens - begin);
    Routing part;
    part.num_tokens = count;
    part.top_k = top_k;
    const auto first = static_cast<size_t>(begin * top_k);
    const auto last = static_cast<size_t>((begin + count) * top_k);
    part.topk_ids.assign(routing.topk_ids.begin() + first, routing.topk_ids.begin() + last);
    part.topk_weights.assign(routing.topk_weights.begin() + first, routing.topk_weights.begin() + last);
    moe_reference(weights, hidden_states + begin * hidden, part, activation, output + begin * hidden,
                  stats.num_threads);
    if (progress) progress->advance(count);
  }
  stats.time_ms = timer.elapsed_ms();
  if (progress) progress->finish();
  return stats;
}

Activation parse_activation(const std::string& name) {
  if (name == "swiglu") return Activation::kSwiGLU;
  if (name == "gptoss") return Activation::kGptOss;
  FP4MOE_THROW("unknown activation '", name, "'; expected swiglu or gptoss");
}

std::string to_string(Activation activation) {
  return activation == Activation::kSwiGLU ? "swiglu" : "gptoss";
}

}  // namespace fp4moe::cli
