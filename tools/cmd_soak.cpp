// `fp4moe soak`: a long run of MoeLayer forwards that must all agree bit for
// bit with a first pass over the same inputs (determinism is a library
// guarantee, docs/design.md §3), while device memory is sampled for drift.
//
//   1. Synthesise one layer (bench::random_moe_weights; default: DeepSeek-V3's router, 256 experts,
//      top-8, 8 groups / 4 kept, over experts of hidden 1024 and inter 512;
//      --model gives a full-size shape instead) and a set of cases: random
//      token counts in [1, --max-tokens] (half log-uniform, so decode sizes
//      are common), half routed on the device from router logits, half with
//      the caller's ids and weights.
//   2. First pass: every case once, eagerly, on one stream; the outputs stay
//      on the device as the expected bits.
//   3. Per host thread (--threads, default 4): its own stream, workspace and
//      output buffer, and one CUDA graph per case captured up front (graph
//      instantiation allocates device memory, so it happens before the
//      memory baseline is taken).
//   4. Soak: each thread picks random cases, runs them eagerly or by graph
//      replay into a poisoned output, and a kernel counts the bf16 elements
//      that differ from the first pass (tools/soak_compare.cu). Every 64
//      forwards a thread checks its counts and the layer's device errors.
//      The main thread samples cudaMemGetInfo and prints progress.
//   5. One JSON line: forwards by mode, mismatches, device errors, memory
//      at the baseline, its minimum and at the end. Exit code 1 (an
//      fp4moe::Error) if any forward mismatched, a device error was
//      reported, or free memory ended lower than the baseline by more than
//      --max-drift-mib.
//
// Runs until --forwards forwards (default 100000) or --seconds (default
// 240), whichever comes first. Needs a GPU; documented in
// docs/reliability.md ("Soak").
#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <exception>
#include <functional>
#include <iostream>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "cli_util.hpp"
#include "commands.hpp"
#include "fp4moe/cuda_check.hpp"
#include "fp4moe/error.hpp"
#include "fp4moe/moe_layer.hpp"
#include "fp4moe/nvfp4.hpp"
#include "gemm_bench.hpp"
#include "layer_bench.hpp"
#include "models.hpp"
#include "soak_compare.hpp"
#include "util/device_buffer.hpp"
#include "util/splitmix64.hpp"

namespace fp4moe::cli {
namespace {

struct SoakOptions {
  std::string model;  // empty: the default DeepSeek-routed small layer
  double seconds = 240.0;
  int64_t forwards = 100000;
  int threads = 4;
  int cases = 48;
  int64_t max_tokens = 4096;
  uint64_t seed = 1;
  double progress_seconds = 10.0;
  double max_drift_mib = 0.0;
};

// Forwards between a thread's checks of its mismatch counts (one counter per
// forward, so a mismatch is pinned to its case and mode).
constexpr int kCheckEvery = 64;

bench::LayerShape soak_shape(const std::string& model) {
  if (model.empty()) {
    const ModelShape& ds = find_model("deepseek-v3");
    return {"deepseek-v3-router, hidden 1024, inter 512",
            ds.num_experts,
            1024,
            512,
            ds.routing_params(),
            ds.activation,
            ds.has_bias};
  }
  return layer_shape(find_model(model));
}

// One case: its inputs on the device and the first pass's output bits.
struct SoakCase {
  int64_t num_tokens = 0;
  bool device_routing = false;
  DeviceBuffer<uint16_t> hidden_states;  // bf16 [T, hidden]
  DeviceBuffer<float> router_logits;     // fp32 [T, E] (device routing)
  DeviceBuffer<float> correction_bias;   // fp32 [E] (noaux_tc)
  DeviceBuffer<int32_t> topk_ids;        // [T, k] (caller routing)
  DeviceBuffer<float> topk_weights;      // [T, k]
  DeviceBuffer<uint16_t> expected;       // bf16 [T, hidden], from the first pass

  MoeForwardArgs args() const {
    MoeForwardArgs a;
    a.hidden_states = hidden_states.get();
    a.num_tokens = num_tokens;
    if (device_routing) {
      a.router_logits = router_logits.get();
      a.correction_bias = correction_bias.get();
    } else {
      a.topk_ids = topk_ids.get();
      a.topk_weights = topk_weights.get();
    }
    return a;
  }
};

SoakCase make_case(const bench::LayerShape& shape, int top_k, int64_t max_tokens, SplitMix64& rng, int case_idx) {
  SoakCase c;
  const bool log_uniform = case_idx % 2 == 0;
  c.num_tokens = log_uniform ? static_cast<int64_t>(std::exp(rng.uniform() * std::log(static_cast<double>(max_tokens))))
                             : 1 + static_cast<int64_t>(rng.next() % static_cast<uint64_t>(max_tokens));
  c.num_tokens = std::clamp<int64_t>(c.num_tokens, 1, max_tokens);
  c.device_routing = (case_idx / 2) % 2 == 0;
  std::vector<uint16_t> hidden(static_cast<size_t>(c.num_tokens * shape.hidden));
  for (uint16_t& v : hidden) v = float_to_bf16(static_cast<float>(rng.normal()));
  c.hidden_states = DeviceBuffer<uint16_t>(hidden);
  if (c.device_routing) {
    std::vector<float> logits(static_cast<size_t>(c.num_tokens * shape.num_experts));
    for (float& v : logits) v = static_cast<float>(rng.normal());
    c.router_logits = DeviceBuffer<float>(logits);
    if (shape.routing.mode == RoutingMode::kNoauxTc) {
      std::vector<float> bias(static_cast<size_t>(shape.num_experts));
      for (float& v : bias) v = static_cast<float>(0.05 * rng.normal());
      c.correction_bias = DeviceBuffer<float>(bias);
    }
  } else {
    std::vector<int32_t> ids;
    std::vector<float> weights;
    std::vector<int32_t> pool(static_cast<size_t>(shape.num_experts));
    for (size_t e = 0; e < pool.size(); ++e) pool[e] = static_cast<int32_t>(e);
    for (int64_t t = 0; t < c.num_tokens; ++t) {
      for (int j = 0; j < top_k; ++j) {  // a partial Fisher-Yates shuffle: distinct ids
        const size_t pick = static_cast<size_t>(j) + rng.next() % (pool.size() - static_cast<size_t>(j));
        std::swap(pool[static_cast<size_t>(j)], pool[pick]);
        ids.push_back(pool[static_cast<size_t>(j)]);
        weights.push_back(static_cast<float>(0.1 + rng.uniform()));
      }
    }
    c.topk_ids = DeviceBuffer<int32_t>(ids);
    c.topk_weights = DeviceBuffer<float>(weights);
  }
  return c;
}

// A stream with its own workspace, output, mismatch counters and one graph
// per case.
class Worker {
 public:
  Worker(const MoeLayer& layer, const std::vector<SoakCase>& cases, int64_t max_tokens) : layer_(layer), cases_(cases) {
    FP4MOE_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    workspace_ = DeviceBuffer<uint8_t>(layer.workspace_bytes(max_tokens));
    workspace_.fill_bytes(0, stream_);
    output_ = DeviceBuffer<uint16_t>(static_cast<size_t>(max_tokens * layer.hidden()));
    counters_ = DeviceBuffer<uint32_t>(kCheckEvery);
    counters_.fill_bytes(0, stream_);
    FP4MOE_CUDA_CHECK(cudaStreamSynchronize(stream_));
  }
  ~Worker() {
    for (cudaGraphExec_t exec : graphs_)
      if (exec) cudaGraphExecDestroy(exec);
    if (stream_) cudaStreamDestroy(stream_);
  }
  Worker(const Worker&) = delete;
  Worker& operator=(const Worker&) = delete;

  // One graph per case: a poisoning memset and the forward.
  void capture_graphs() {
    for (const SoakCase& c : cases_) {
      const cudaGraphExec_t exec = bench::capture_graph(stream_, [&] { enqueue_forward(c); });
      graphs_.push_back(exec);
    }
  }

  // Runs case `case_idx` (eagerly or by replay) and queues its comparison
  // into counter `slot`.
  void run(size_t case_idx, bool graph, int slot) {
    const SoakCase& c = cases_[case_idx];
    if (graph)
      FP4MOE_CUDA_CHECK(cudaGraphLaunch(graphs_[case_idx], stream_));
    else
      enqueue_forward(c);
    launch_count_mismatches(output_.get(), c.expected.get(), c.num_tokens * layer_.hidden(), counters_.get() + slot,
                            stream_);
  }

  // Waits for the queued forwards; the mismatch count of each slot (then
  // zeroed) and the layer's device errors.
  std::vector<uint32_t> collect(std::string& device_errors) {
    std::vector<uint32_t> counts = counters_.download(stream_);
    counters_.fill_bytes(0, stream_);
    device_errors = layer_.device_errors(workspace_.get(), stream_);
    return counts;
  }

  // The first pass: the case's output into `expected`.
  void first_pass(SoakCase& c) {
    enqueue_forward(c);
    c.expected = DeviceBuffer<uint16_t>(static_cast<size_t>(c.num_tokens * layer_.hidden()));
    FP4MOE_CUDA_CHECK(
        cudaMemcpyAsync(c.expected.get(), output_.get(), c.expected.bytes(), cudaMemcpyDeviceToDevice, stream_));
    FP4MOE_CUDA_CHECK(cudaStreamSynchronize(stream_));
  }

 private:
  void enqueue_forward(const SoakCase& c) {
    const size_t bytes = static_cast<size_t>(c.num_tokens * layer_.hidden()) * sizeof(uint16_t);
    FP4MOE_CUDA_CHECK(cudaMemsetAsync(output_.get(), 0xFF, bytes, stream_));  // bf16 NaN
    layer_.forward(c.args(), output_.get(), workspace_.get(), workspace_.bytes(), stream_);
  }

  const MoeLayer& layer_;
  const std::vector<SoakCase>& cases_;
  cudaStream_t stream_ = nullptr;
  DeviceBuffer<uint8_t> workspace_;
  DeviceBuffer<uint16_t> output_;
  DeviceBuffer<uint32_t> counters_;
  std::vector<cudaGraphExec_t> graphs_;
};

size_t free_device_bytes() {
  size_t free_bytes = 0, total_bytes = 0;
  FP4MOE_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
  return free_bytes;
}

double gib(double bytes) { return bytes / (1024.0 * 1024.0 * 1024.0); }

struct Totals {
  std::atomic<int64_t> forwards{0}, eager{0}, graph{0}, device_routing{0}, caller_routing{0};
  std::atomic<int64_t> mismatched_forwards{0}, mismatched_elements{0}, device_error_reports{0};
  std::atomic<bool> stop{false};
  std::mutex report_mutex;
  std::vector<std::string> first_reports;  // the first few mismatches and device errors
  std::exception_ptr error;                // a worker's exception
};

void note(Totals& totals, const std::string& what) {
  const std::lock_guard<std::mutex> lock(totals.report_mutex);
  if (totals.first_reports.size() < 10) {
    totals.first_reports.push_back(what);
    std::fprintf(stderr, "soak: %s\n", what.c_str());
  }
}

void soak_thread(int thread_idx, Worker& worker, const std::vector<SoakCase>& cases, const SoakOptions& o,
                 Totals& totals, int device) {
  try {
    FP4MOE_CUDA_CHECK(cudaSetDevice(device));
    SplitMix64 rng(o.seed * 7919 + static_cast<uint64_t>(thread_idx) + 100);
    struct Pending {
      size_t case_idx;
      bool graph;
    };
    std::vector<Pending> pending;
    while (true) {
      const bool stopping = totals.stop.load();
      if (!stopping) {
        const size_t case_idx = rng.next() % cases.size();
        const bool graph = rng.next() % 2 == 0;
        worker.run(case_idx, graph, static_cast<int>(pending.size()));
        pending.push_back({case_idx, graph});
        if (totals.forwards.fetch_add(1) + 1 >= o.forwards) totals.stop = true;
      }
      if (pending.size() == kCheckEvery || (stopping && !pending.empty())) {
        std::string device_errors;
        const std::vector<uint32_t> counts = worker.collect(device_errors);
        for (size_t i = 0; i < pending.size(); ++i) {
          const SoakCase& c = cases[pending[i].case_idx];
          (pending[i].graph ? totals.graph : totals.eager)++;
          (c.device_routing ? totals.device_routing : totals.caller_routing)++;
          if (counts[i] == 0) continue;
          ++totals.mismatched_forwards;
          totals.mismatched_elements += counts[i];
          note(totals, "thread " + std::to_string(thread_idx) + ": case " + std::to_string(pending[i].case_idx) + " (" +
                           std::to_string(c.num_tokens) + " tokens, " + (c.device_routing ? "device" : "caller") +
                           " routing, " + (pending[i].graph ? "graph replay" : "eager") +
                           "): " + std::to_string(counts[i]) + " elements differ from the first pass");
        }
        if (!device_errors.empty()) {
          ++totals.device_error_reports;
          note(totals, "thread " + std::to_string(thread_idx) + ": device errors: " + device_errors);
        }
        pending.clear();
      }
      if (stopping && pending.empty()) return;
    }
  } catch (...) {
    const std::lock_guard<std::mutex> lock(totals.report_mutex);
    if (!totals.error) totals.error = std::current_exception();
    totals.stop = true;
  }
}

void run_soak(const SoakOptions& o) {
  FP4MOE_CHECK(o.threads >= 1 && o.threads <= 64, "--threads must be in 1..64, not ", o.threads);
  FP4MOE_CHECK(o.cases >= 1, "--cases must be >= 1, not ", o.cases);
  FP4MOE_CHECK(o.max_tokens >= 1, "--max-tokens must be >= 1, not ", o.max_tokens);
  FP4MOE_CHECK(o.seconds > 0 && o.forwards >= 1, "--seconds and --forwards must be positive");
  const bench::LayerShape shape = soak_shape(o.model);
  const GpuInfo gpu = probe_gpu();
  FP4MOE_CHECK(gpu.num_devices > 0, "soak needs a CUDA GPU, and this machine has ", gpu.description);
  int device = 0;
  FP4MOE_CUDA_CHECK(cudaGetDevice(&device));
  cudaDeviceProp prop{};
  FP4MOE_CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
  std::fprintf(stderr, "soak: %s on %s: %d cases up to %lld tokens, %d threads, until %lld forwards or %.0f s\n",
               shape.name.c_str(), prop.name, o.cases, static_cast<long long>(o.max_tokens), o.threads,
               static_cast<long long>(o.forwards), o.seconds);

  MoeLayerOptions options;
  options.activation = shape.activation;
  options.routing = shape.routing;
  const MoeLayer layer = MoeLayer::prepare(bench::random_moe_weights(shape, o.seed), options);

  SplitMix64 rng(o.seed);
  std::vector<SoakCase> cases;
  for (int i = 0; i < o.cases; ++i) cases.push_back(make_case(shape, layer.top_k(), o.max_tokens, rng, i));
  FP4MOE_CUDA_CHECK(cudaDeviceSynchronize());  // the uploads ran on the legacy stream

  std::vector<std::unique_ptr<Worker>> workers;
  for (int t = 0; t < o.threads; ++t) workers.push_back(std::make_unique<Worker>(layer, cases, o.max_tokens));
  for (SoakCase& c : cases) workers[0]->first_pass(c);
  std::string first_errors;
  workers[0]->collect(first_errors);
  FP4MOE_CHECK(first_errors.empty(), "soak: the first pass reported device errors: ", first_errors);
  for (auto& w : workers) w->capture_graphs();
  FP4MOE_CUDA_CHECK(cudaDeviceSynchronize());

  const size_t free_baseline = free_device_bytes();
  size_t free_min = free_baseline;
  Totals totals;
  const auto start = std::chrono::steady_clock::now();
  const auto elapsed = [&] { return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(); };
  std::vector<std::thread> threads;
  for (int t = 0; t < o.threads; ++t)
    threads.emplace_back(soak_thread, t, std::ref(*workers[static_cast<size_t>(t)]), std::cref(cases), std::cref(o),
                         std::ref(totals), device);
  double next_progress = o.progress_seconds;
  int64_t memory_samples = 0;
  while (!totals.stop.load()) {
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    free_min = std::min(free_min, free_device_bytes());
    ++memory_samples;
    const double seconds = elapsed();
    if (seconds >= o.seconds) totals.stop = true;
    if (seconds >= next_progress) {
      next_progress += o.progress_seconds;
      const int64_t n = totals.forwards.load();
      std::fprintf(stderr, "soak: %6.0f s  %9lld forwards (%6.0f/s)  %lld mismatched  free %.2f GiB (min %.2f)\n",
                   seconds, static_cast<long long>(n), static_cast<double>(n) / seconds,
                   static_cast<long long>(totals.mismatched_forwards.load()),
                   gib(static_cast<double>(free_device_bytes())), gib(static_cast<double>(free_min)));
    }
  }
  for (std::thread& t : threads) t.join();
  const double seconds = elapsed();
  FP4MOE_CUDA_CHECK(cudaDeviceSynchronize());
  const size_t free_end = free_device_bytes();
  free_min = std::min(free_min, free_end);
  if (totals.error) std::rethrow_exception(totals.error);

  const int64_t completed = totals.eager + totals.graph;
  const double drift_bytes = static_cast<double>(free_baseline) - static_cast<double>(free_end);
  const bool drift_ok = drift_bytes <= o.max_drift_mib * 1024.0 * 1024.0;
  const bool ok = totals.mismatched_forwards == 0 && totals.device_error_reports == 0 && drift_ok;
  nlohmann::json summary = {
      {"soak", shape.name},
      {"device", prop.name},
      {"threads", o.threads},
      {"cases", o.cases},
      {"max_tokens", o.max_tokens},
      {"seconds", seconds},
      {"forwards", completed},
      {"forwards_target", o.forwards},
      {"target_reached", completed >= o.forwards},
      {"eager", totals.eager.load()},
      {"graph_replays", totals.graph.load()},
      {"device_routing", totals.device_routing.load()},
      {"caller_routing", totals.caller_routing.load()},
      {"mismatched_forwards", totals.mismatched_forwards.load()},
      {"mismatched_elements", totals.mismatched_elements.load()},
      {"device_error_reports", totals.device_error_reports.load()},
      {"mem_free_baseline_bytes", free_baseline},
      {"mem_free_min_bytes", free_min},
      {"mem_free_end_bytes", free_end},
      {"mem_drift_bytes", drift_bytes},
      {"mem_samples", memory_samples},
      {"ok", ok},
  };
  std::cout << summary.dump() << std::endl;
  FP4MOE_CHECK(ok, "soak failed: ", totals.mismatched_forwards.load(), " forwards differed from the first pass, ",
               totals.device_error_reports.load(), " device error reports, free memory drifted by ", drift_bytes,
               " B (allowed ", o.max_drift_mib, " MiB)");
}

}  // namespace

void add_soak_command(CLI::App& app) {
  auto o = std::make_shared<SoakOptions>();
  CLI::App* cmd = app.add_subcommand(
      "soak",
      "Run MoE layer forwards for minutes (random token counts, eager and CUDA-graph replay, device and caller "
      "routing, several host threads with a stream and workspace each) and check every output bit for bit "
      "against a first pass over the same inputs, sampling device memory throughout; one JSON line at the end "
      "(needs a GPU).");
  cmd->add_option("--model", o->model,
                  "A full-size model shape instead of the default DeepSeek-V3 router over hidden 1024, inter 512: " +
                      model_names());
  cmd->add_option("--seconds", o->seconds, "Stop after this long")->capture_default_str();
  cmd->add_option("--forwards", o->forwards, "Stop after this many forwards")->capture_default_str();
  cmd->add_option("--threads", o->threads, "Host threads, each with its own stream and workspace")
      ->capture_default_str();
  cmd->add_option("--cases", o->cases, "Distinct inputs (token count, routing, values)")->capture_default_str();
  cmd->add_option("--max-tokens", o->max_tokens, "Largest token count of a case")->capture_default_str();
  cmd->add_option("--seed", o->seed, "Seed of the weights and inputs")->capture_default_str();
  cmd->add_option("--progress-seconds", o->progress_seconds, "Seconds between progress lines on stderr")
      ->capture_default_str();
  cmd->add_option("--max-drift-mib", o->max_drift_mib, "Free device memory may end this much lower than after warm-up")
      ->capture_default_str();
  cmd->callback([o] { run_soak(*o); });
}

}  // namespace fp4moe::cli
