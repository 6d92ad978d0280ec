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
#include <optional>
#include <regex>
#include <set>

#ifdef FP4MOE_WITH_NCCL
#include <mutex>

#include "ep/nccl_util.hpp"
#include "fp4moe/expert_parallel_layer.hpp"
#endif
#include "format/checkpoint_reader.hpp"
#include "layer_bench.hpp"
#include "models.hpp"
#include "fp4moe/cuda_check.hpp"
#include "fp4moe/error.hpp"
#include "fp4moe/nvfp4.hpp"
#include "util/device_buffer.hpp"
#include "util/parallel.hpp"

namespace fp4moe::cli {

// ------------------------------------------------------------------ files

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

namespace {

// The prefixes of per-expert gate tensors (ModelOpt's names or Mixtral's),
// and the first prefix of stacked ones (3-D stacks, transformers 5's fused
// gate_up_proj).
struct ExpertPrefixes {
  std::set<std::string> per_expert;
  std::optional<std::string> stacked;
};
ExpertPrefixes expert_prefixes(const std::string& path) {
  static const std::regex kExpertName(R"((.*)experts\.\d+\.(gate_proj|w1)\.weight)");
  static const std::regex kStackName(R"((.*)experts\.(gate_proj\.weight|gate_up_proj.*))");
  ExpertPrefixes found;
  for (const std::string& name : checkpoint_tensor_names(path)) {
    std::smatch match;
    if (std::regex_match(name, match, kExpertName)) found.per_expert.insert(match[1]);
    if (!found.stacked && std::regex_match(name, match, kStackName)) found.stacked = match[1];
  }
  return found;
}

}  // namespace

std::string layer_prefix(const std::string& path, int layer) {
  const std::string marker = "layers." + std::to_string(layer) + ".";
  const ExpertPrefixes found = expert_prefixes(path);
  std::vector<std::string> matches;
  for (const std::string& p : found.per_expert) {
    const size_t at = p.find(marker);
    if (at != std::string::npos && (at == 0 || p[at - 1] == '.')) matches.push_back(p);
  }
  if (matches.empty() && found.stacked && found.stacked->find(marker) != std::string::npos)
    return *found.stacked;  // the loader says why it cannot use stacked experts
  FP4MOE_CHECK(
      !matches.empty(), path, ": no experts of layer ", layer, " (no expert tensor under a prefix holding '", marker,
      "')",
      found.per_expert.empty() ? std::string() : "; its first expert layer is '" + *found.per_expert.begin() + "'");
  FP4MOE_CHECK(matches.size() == 1, path, ": several expert prefixes hold '", marker, "': '", matches[0], "', '",
               matches[1], "'; choose one with --prefix");
  return matches[0];
}

std::string detect_prefix(const std::string& path) {
  const ExpertPrefixes found = expert_prefixes(path);
  const std::set<std::string>& prefixes = found.per_expert;
  const std::optional<std::string>& stack_prefix = found.stacked;
  if (prefixes.empty()) {
    // The loader says why it cannot use stacked experts.
    FP4MOE_CHECK(stack_prefix, path,
                 ": no expert tensors named '<prefix>experts.<e>.gate_proj.weight' "
                 "(or Mixtral's '<prefix>experts.<e>.w1.weight')");
    return *stack_prefix;
  }
  if (prefixes.size() > 1) {
    std::string list;
    int shown = 0;
    for (const std::string& p : prefixes) {
      if (shown++ == 5) {
        list += ", ...";
        break;
      }
      list += (list.empty() ? "'" : ", '") + p + "'";
    }
    FP4MOE_THROW(path, " holds the experts of ", prefixes.size(),
                 " layers; choose one with --prefix (or --layer N): ", list);
  }
  return *prefixes.begin();
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

void Progress::clear() {
  if (!enabled_ || !tty_ || finished_) return;
  std::fprintf(stderr, "\r\033[K");
  std::fflush(stderr);
  last_draw_ = start_;  // redraw at the next advance()
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
  } else if (unit_ == Unit::kCount) {
    line += std::to_string(done_) + "/" + std::to_string(total_);
  }
  char tail[96];
  std::snprintf(tail, sizeof tail, "%s(%3.0f%%) %.1f s", unit_ == Unit::kWork ? "" : " ", percent, elapsed_s);
  line += tail;
  if (!final && done_ > 0 && done_ < total_) {
    const double left_s = elapsed_s * static_cast<double>(total_ - done_) / static_cast<double>(done_);
    const long long left = std::llround(left_s);
    if (left >= 60)
      std::snprintf(tail, sizeof tail, ", ETA %lldm%02llds", left / 60, left % 60);
    else
      std::snprintf(tail, sizeof tail, ", ETA %llds", left);
    line += tail;
  }
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
    info.description =
        std::string("none usable (") + cudaGetErrorName(status) + ": " + cudaGetErrorString(status) + ")";
    return info;
  }
  info.num_devices = count;
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, 0) == cudaSuccess) {
    const double memory_gib = static_cast<double>(prop.totalGlobalMem) / (1024.0 * 1024.0 * 1024.0);
    info.description = std::string(prop.name) + " (SM" + std::to_string(prop.major) + std::to_string(prop.minor) +
                       ", " + std::to_string(static_cast<int>(std::lround(memory_gib))) + " GiB)";
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
      return probe_gpu().num_devices > 0 ? Device::kCuda : Device::kCpu;
    case Device::kCuda: {
      const GpuInfo gpu = probe_gpu();
      FP4MOE_CHECK(gpu.num_devices > 0, "--device cuda needs a CUDA GPU, and this machine has ", gpu.description,
                   "; use --device cpu (or auto) for the CPU reference backend");
      return Device::kCuda;
    }
  }
  FP4MOE_THROW("invalid device");
}

namespace {

// A CUDA stream and two events, released on every exit path.
struct CudaStreamAndEvents {
  cudaStream_t stream = nullptr;
  cudaEvent_t start = nullptr, stop = nullptr;
  CudaStreamAndEvents() {
    FP4MOE_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    FP4MOE_CUDA_CHECK(cudaEventCreate(&start));
    FP4MOE_CUDA_CHECK(cudaEventCreate(&stop));
  }
  ~CudaStreamAndEvents() {
    if (stream) cudaStreamSynchronize(stream);
    if (start) cudaEventDestroy(start);
    if (stop) cudaEventDestroy(stop);
    if (stream) cudaStreamDestroy(stream);
  }
  CudaStreamAndEvents(const CudaStreamAndEvents&) = delete;
  CudaStreamAndEvents& operator=(const CudaStreamAndEvents&) = delete;
};

void check_routing(const Routing& routing) {
  const int64_t num_tokens = routing.num_tokens;
  FP4MOE_CHECK(num_tokens >= 1, "run_moe_layer: ", num_tokens, " tokens; expected at least 1");
  FP4MOE_CHECK(routing.topk_ids.size() == static_cast<size_t>(num_tokens * routing.top_k) &&
                   routing.topk_weights.size() == routing.topk_ids.size(),
               "run_moe_layer: routing holds ", routing.topk_ids.size(), " ids and ", routing.topk_weights.size(),
               " weights; expected ", num_tokens, " x ", routing.top_k);
}

// The routing is given, so the layer's routing parameters matter only for
// its top-k (a layer of just the active experts, as the demo builds, may not
// fit a model's expert groups).
MoeLayerOptions caller_routing_options(const MoeLayerOptions& layer_options, int top_k) {
  MoeLayerOptions options = layer_options;
  options.routing = RoutingParams{};
  options.routing.top_k = top_k;
  return options;
}

std::vector<uint16_t> to_bf16(const float* values, size_t count) {
  std::vector<uint16_t> bits(count);
  for (size_t i = 0; i < count; ++i) bits[i] = float_to_bf16(values[i]);
  return bits;
}

MoeRunStats run_moe_layer_cuda(const MoeWeights& weights, const float* hidden_states, const Routing& routing,
                               const MoeLayerOptions& layer_options, float* output) {
  check_routing(routing);
  const int64_t num_tokens = routing.num_tokens;
  const int64_t hidden = weights.hidden;
  const MoeLayer layer = MoeLayer::prepare(weights, caller_routing_options(layer_options, routing.top_k));

  MoeRunStats stats;
  int device_idx = 0;
  cudaDeviceProp prop{};
  FP4MOE_CUDA_CHECK(cudaGetDevice(&device_idx));
  FP4MOE_CUDA_CHECK(cudaGetDeviceProperties(&prop, device_idx));
  stats.backend = std::string("cuda (") + prop.name + ")";
  stats.plan = layer.plan(num_tokens).describe();

  const std::vector<uint16_t> hidden_bf16 = to_bf16(hidden_states, static_cast<size_t>(num_tokens * hidden));

  CudaStreamAndEvents cuda;
  DeviceBuffer<uint16_t> d_hidden(hidden_bf16.size());
  DeviceBuffer<int32_t> d_ids(routing.topk_ids.size());
  DeviceBuffer<float> d_weights(routing.topk_weights.size());
  DeviceBuffer<uint16_t> d_output(static_cast<size_t>(num_tokens * hidden));
  DeviceBuffer<uint8_t> workspace(layer.workspace_bytes(num_tokens));
  d_hidden.upload(hidden_bf16, cuda.stream);
  d_ids.upload(routing.topk_ids, cuda.stream);
  d_weights.upload(routing.topk_weights, cuda.stream);
  workspace.fill_bytes(0, cuda.stream);

  MoeForwardArgs args;
  args.hidden_states = d_hidden.get();
  args.num_tokens = num_tokens;
  args.topk_ids = d_ids.get();
  args.topk_weights = d_weights.get();
  // One untimed forward first: the first launches of a process load the
  // kernels' modules (lazy loading), which is not the layer's time.
  layer.forward(args, d_output.get(), workspace.get(), workspace.bytes(), cuda.stream);
  FP4MOE_CUDA_CHECK(cudaEventRecord(cuda.start, cuda.stream));
  layer.forward(args, d_output.get(), workspace.get(), workspace.bytes(), cuda.stream);
  FP4MOE_CUDA_CHECK(cudaEventRecord(cuda.stop, cuda.stream));

  const std::vector<uint16_t> output_bf16 = d_output.download(cuda.stream);
  const std::string device_errors = layer.device_errors(workspace.get(), cuda.stream);
  FP4MOE_CHECK(device_errors.empty(), "the CUDA MoE layer reported: ", device_errors);
  float elapsed_ms = 0.0f;
  FP4MOE_CUDA_CHECK(cudaEventElapsedTime(&elapsed_ms, cuda.start, cuda.stop));
  stats.time_ms = elapsed_ms;
  for (size_t i = 0; i < output_bf16.size(); ++i) output[i] = bf16_to_float(output_bf16[i]);
  return stats;
}

}  // namespace

MoeRunStats run_moe_layer(Device device, const MoeWeights& weights, const float* hidden_states, const Routing& routing,
                          const MoeLayerOptions& layer_options, float* output, Progress* progress) {
  FP4MOE_CHECK(device == Device::kCpu || device == Device::kCuda,
               "run_moe_layer: resolve the device first (resolve_device)");
  if (device == Device::kCuda) {
    MoeRunStats stats = run_moe_layer_cuda(weights, hidden_states, routing, layer_options, output);
    if (progress) {
      progress->advance(routing.num_tokens);
      progress->finish();
    }
    return stats;
  }
  const Activation activation = layer_options.activation;
  MoeRunStats stats;
  stats.backend = "cpu (reference, double accumulation)";
  stats.num_threads = hardware_threads();
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
    moe_reference(weights, hidden_states + begin * hidden, part, activation, output + begin * hidden, stats.num_threads,
                  Intermediate::kExact, layer_options.activations);
    if (progress) progress->advance(count);
  }
  stats.time_ms = timer.elapsed_ms();
  if (progress) progress->finish();
  return stats;
}

bool built_with_nccl() {
#ifdef FP4MOE_WITH_NCCL
  return true;
#else
  return false;
#endif
}

MoeRunStats run_moe_layer_expert_parallel(const MoeWeights& weights, const float* hidden_states, const Routing& routing,
                                          const MoeLayerOptions& layer_options, int num_ranks, float* output) {
#ifndef FP4MOE_WITH_NCCL
  (void)weights, (void)hidden_states, (void)routing, (void)layer_options, (void)num_ranks, (void)output;
  FP4MOE_THROW(
      "expert parallelism needs NCCL, and this fp4moe was built without it (configure with "
      "NCCL installed or NCCL_HOME set)");
#else
  check_routing(routing);
  const int64_t T = routing.num_tokens, H = weights.hidden;
  const int k = routing.top_k;
  FP4MOE_CHECK(num_ranks >= 1 && num_ranks <= weights.num_experts, "--ep ", num_ranks,
               ": expected 1 .. the expert count (", weights.num_experts, ")");
  const ExpertPlacement placement = ExpertPlacement::contiguous(weights.num_experts, num_ranks);
  const MoeLayerOptions options = caller_routing_options(layer_options, k);
  const std::vector<uint16_t> hidden_bf16 = to_bf16(hidden_states, static_cast<size_t>(T * H));
  std::vector<uint16_t> output_bf16(static_cast<size_t>(T * H));
  std::vector<double> rank_ms(static_cast<size_t>(num_ranks));
  std::vector<std::string> rank_lines(static_cast<size_t>(num_ranks));
  std::string device_name;
  std::mutex mutex;
  run_ranks_in_threads(num_ranks, [&](int r, ncclComm_t comm) {
    // Rank r is home to tokens [first, last).
    const int64_t first = T * r / num_ranks, last = T * (r + 1) / num_ranks, count = last - first;
    ExpertParallelMoeLayer layer = ExpertParallelMoeLayer::prepare(weights, placement, comm, options);
    CudaStreamAndEvents cuda;
    DeviceBuffer<uint16_t> d_hidden(static_cast<size_t>(count * H)), d_output(static_cast<size_t>(count * H));
    DeviceBuffer<int32_t> d_ids(static_cast<size_t>(count * k));
    DeviceBuffer<float> d_weights(static_cast<size_t>(count * k));
    d_hidden.upload(std::vector<uint16_t>(hidden_bf16.begin() + first * H, hidden_bf16.begin() + last * H),
                    cuda.stream);
    d_ids.upload(std::vector<int32_t>(routing.topk_ids.begin() + first * k, routing.topk_ids.begin() + last * k),
                 cuda.stream);
    d_weights.upload(
        std::vector<float>(routing.topk_weights.begin() + first * k, routing.topk_weights.begin() + last * k),
        cuda.stream);
    MoeForwardArgs args;
    args.hidden_states = d_hidden.get();
    args.num_tokens = count;
    if (count > 0) {
      args.topk_ids = d_ids.get();
      args.topk_weights = d_weights.get();
    }
    layer.forward(args, d_output.get(), cuda.stream);  // untimed: module loading, buffers
    ExpertParallelTimes times;
    const ExpertParallelStats stats = layer.forward(args, d_output.get(), cuda.stream, &times);
    const std::vector<uint16_t> rank_output = d_output.download(cuda.stream);
    std::copy(rank_output.begin(), rank_output.end(), output_bf16.begin() + first * H);
    char line[320];
    std::snprintf(line, sizeof line,
                  "  rank %d: %lld tokens, %lld experts; sent %lld rows, computed %lld rows / %lld pairs; "
                  "ms: route %.3f, dispatch %.3f, experts %.3f, return %.3f, combine %.3f (all-to-all %.3f)\n",
                  r, static_cast<long long>(count), static_cast<long long>(placement.num_local_experts(r)),
                  static_cast<long long>(stats.sent_rows), static_cast<long long>(stats.received_rows),
                  static_cast<long long>(stats.received_pairs), times.route_ms, times.dispatch_ms, times.experts_ms,
                  times.return_ms, times.combine_ms, times.all_to_all_ms());
    cudaDeviceProp prop{};
    FP4MOE_CUDA_CHECK(cudaGetDeviceProperties(&prop, r));
    const std::lock_guard<std::mutex> lock(mutex);
    rank_ms[static_cast<size_t>(r)] = times.total_ms();
    rank_lines[static_cast<size_t>(r)] = line;
    if (r == 0) device_name = prop.name;
  });
  for (size_t i = 0; i < output_bf16.size(); ++i) output[i] = bf16_to_float(output_bf16[i]);
  MoeRunStats stats;
  stats.backend = "cuda, expert parallel over " + std::to_string(num_ranks) + " GPU(s) (" + device_name + ", NCCL)";
  stats.time_ms = *std::max_element(rank_ms.begin(), rank_ms.end());
  stats.plan = "expert parallel, experts placed contiguously, tokens split in order:\n";
  for (const std::string& line : rank_lines) stats.plan += line;
  return stats;
#endif
}

Activation parse_activation(const std::string& name) {
  if (name == "swiglu") return Activation::kSwiGLU;
  if (name == "gptoss") return Activation::kGptOss;
  FP4MOE_THROW("unknown activation '", name, "'; expected swiglu or gptoss");
}

std::string to_string(Activation activation) { return activation == Activation::kSwiGLU ? "swiglu" : "gptoss"; }

bench::LayerShape layer_shape(const ModelShape& model) {
  bench::LayerShape shape;
  shape.name = std::string(model.name);
  shape.num_experts = model.num_experts;
  shape.hidden = model.hidden;
  shape.inter = model.inter;
  shape.routing = model.routing_params();
  shape.activation = model.activation;
  shape.has_bias = model.has_bias;
  return shape;
}

}  // namespace fp4moe::cli
