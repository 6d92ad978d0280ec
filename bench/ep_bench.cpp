// The expert-parallel layer benchmark (ep_bench.hpp).
#include "ep_bench.hpp"

#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>
#include <cstdio>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>

#include "ep/nccl_util.hpp"
#include "fp4moe/cuda_check.hpp"
#include "fp4moe/error.hpp"
#include "fp4moe/expert_parallel_layer.hpp"

namespace fp4moe::bench {
namespace {

double median_of(std::vector<double> v) {
  std::nth_element(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(v.size() / 2), v.end());
  return v[v.size() / 2];
}

// One rank's medians for one token count.
struct RankResult {
  int64_t tokens = 0;
  ExpertParallelStats stats;  // of the last forward (the same every time)
  ExpertParallelTimes median;
  int64_t nonfinite_outputs = 0;
};

// An all-to-all of `bytes_per_peer` to and from every other rank, grouped
// NCCL send/recv, on every rank: GB/s sent per rank (median of 5 after a
// warm-up). 0 on one rank (nothing leaves the GPU).
double measure_all_to_all_gbps(int num_ranks, size_t bytes_per_peer) {
  if (num_ranks < 2) return 0.0;
  std::vector<double> rate(static_cast<size_t>(num_ranks));
  run_ranks_in_threads(num_ranks, [&](int r, ncclComm_t comm) {
    DeviceBuffer<uint8_t> send(bytes_per_peer * num_ranks), recv(bytes_per_peer * num_ranks);
    send.fill_bytes(r);
    cudaStream_t stream = nullptr;
    FP4MOE_CUDA_CHECK(cudaStreamCreate(&stream));
    cudaEvent_t start = nullptr, stop = nullptr;
    FP4MOE_CUDA_CHECK(cudaEventCreate(&start));
    FP4MOE_CUDA_CHECK(cudaEventCreate(&stop));
    std::vector<double> ms;
    for (int i = 0; i < 6; ++i) {
      FP4MOE_CUDA_CHECK(cudaEventRecord(start, stream));
      FP4MOE_NCCL_CHECK(ncclGroupStart());
      for (int peer = 0; peer < num_ranks; ++peer) {
        if (peer == r) continue;
        FP4MOE_NCCL_CHECK(ncclSend(send.get() + peer * bytes_per_peer, bytes_per_peer, ncclUint8, peer, comm, stream));
        FP4MOE_NCCL_CHECK(ncclRecv(recv.get() + peer * bytes_per_peer, bytes_per_peer, ncclUint8, peer, comm, stream));
      }
      FP4MOE_NCCL_CHECK(ncclGroupEnd());
      FP4MOE_CUDA_CHECK(cudaEventRecord(stop, stream));
      FP4MOE_CUDA_CHECK(cudaEventSynchronize(stop));
      float t = 0.0f;
      FP4MOE_CUDA_CHECK(cudaEventElapsedTime(&t, start, stop));
      if (i > 0) ms.push_back(t);
    }
    cudaEventDestroy(start);
    cudaEventDestroy(stop);
    cudaStreamDestroy(stream);
    rate[static_cast<size_t>(r)] = static_cast<double>(bytes_per_peer) * (num_ranks - 1) / (median_of(ms) * 1e-3) / 1e9;
  });
  return *std::min_element(rate.begin(), rate.end());
}

// Bytes one rank moved in a forward: dispatch (bf16 row + metadata per sent
// row) and return (a bf16 row per computed pair), sent and received.
double bytes_moved(const ExpertParallelStats& s, int64_t hidden, int top_k) {
  const double row = 2.0 * hidden + 4.0 * static_cast<double>(dispatch_meta_words(top_k));
  return row * static_cast<double>(s.sent_rows + s.received_rows) +
         2.0 * hidden * static_cast<double>(s.received_pairs + s.sent_pairs);
}

}  // namespace

void run_ep_bench(const EpBenchOptions& opt, std::ostream& table, std::ostream* json) {
  FP4MOE_CHECK(opt.num_ranks >= 1, "--ep must be >= 1, not ", opt.num_ranks);
  FP4MOE_CHECK(opt.iterations >= 1 && !opt.tokens.empty() && !opt.models.empty(),
               "run_ep_bench: needs models, token counts and iterations >= 1");
  const int P = opt.num_ranks;
  int num_gpus = 0;
  if (cudaGetDeviceCount(&num_gpus) != cudaSuccess) {
    cudaGetLastError();
    num_gpus = 0;
  }
  FP4MOE_CHECK(num_gpus >= P, "fp4moe bench --layer --ep ", P, " needs ", P, " CUDA GPUs; this machine has ", num_gpus);
  FP4MOE_CUDA_CHECK(cudaSetDevice(0));
  const L2Flusher flusher;
  const Ceilings ceil = measure_ceilings(flusher);
  const double a2a_gbps = measure_all_to_all_gbps(P, size_t{64} << 20);
  const std::string gpu = gpu_name(), date = today();
  const int64_t max_tokens = *std::max_element(opt.tokens.begin(), opt.tokens.end());
  char line[640];
  std::snprintf(line, sizeof line,
                "# %s x %d, %s: %s (GPU 0); NCCL all-to-all %.1f GB/s "
                "sent per rank (64 MiB per peer)\n"
                "# expert parallel layer, experts placed contiguously, tokens split in order, routing on each "
                "rank's device; L2 flushed before each forward; medians of %d per rank, the slowest rank shown; "
                "ms; roof/P = the one-GPU layer roofline spread over P GPUs; 1gpu = the single-GPU layer, same "
                "tokens\n",
                gpu.c_str(), P, date.c_str(), ceil.describe().c_str(), a2a_gbps, opt.iterations);
  table << line
        << "model          P      T   total   route dispatch experts  return combine  a2a%  MB/rank  a2a GB/s  "
           "roof/P   eff    1gpu\n"
        << std::flush;
  if (json) {
    const nlohmann::json j{{"kind", "ceilings"},
                           {"gpu", gpu},
                           {"date", date},
                           {"num_ranks", P},
                           {"copy_tbps", ceil.copy_bytes_per_s / 1e12},
                           {"read_tbps", ceil.read_bytes_per_s / 1e12},
                           {"memory_tbps", ceil.memory_bytes_per_s() / 1e12},
                           {"bf16_tflops", ceil.bf16_flops_per_s / 1e12},
                           {"all_to_all_gbps", a2a_gbps}};
    *json << j.dump() << std::endl;
  }

  for (const LayerShape& shape : opt.models) {
    const MoeWeights weights = random_moe_weights(shape, opt.seed);
    MoeLayerOptions options;
    options.routing = shape.routing;
    options.activation = shape.activation;
    options.batch_invariant = true;
    const int k = shape.routing.top_k;

    // The single-GPU peer on GPU 0, on the same tokens.
    std::map<int64_t, double> single_ms;
    std::map<int64_t, int64_t> active;
    {
      FP4MOE_CUDA_CHECK(cudaSetDevice(0));
      const MoeLayer layer = MoeLayer::prepare(weights, options);
      LayerTimer timer(layer, max_tokens, opt.seed);
      for (int64_t t : opt.tokens) {
        single_ms[t] = timer.time_forward_us(t, opt.iterations, flusher) / 1e3;
        active[t] = timer.active_experts(t);
      }
    }

    const RouterInputs router = random_router_inputs(max_tokens, shape.num_experts, shape.routing, opt.seed);
    const ExpertPlacement placement = ExpertPlacement::contiguous(shape.num_experts, P);
    std::map<int64_t, std::vector<RankResult>> results;
    for (int64_t t : opt.tokens) results[t].resize(static_cast<size_t>(P));
    std::mutex mutex;
    run_ranks_in_threads(P, [&](int r, ncclComm_t comm) {
      ExpertParallelMoeLayer layer = ExpertParallelMoeLayer::prepare(weights, placement, comm, options);
      const L2Flusher rank_flusher;
      cudaStream_t stream = nullptr;
      FP4MOE_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
      // Every rank holds all max_tokens tokens; a forward reads its share.
      DeviceBuffer<uint16_t> hidden(static_cast<size_t>(max_tokens * shape.hidden));
      DeviceBuffer<uint16_t> output(static_cast<size_t>(max_tokens * shape.hidden));
      DeviceBuffer<float> logits(router.logits.size()), bias(router.bias.size());
      fill_random_bf16(hidden.get(), hidden.size(), opt.seed + kHiddenSeedOffset, stream);
      logits.upload(router.logits, stream);
      bias.upload(router.bias, stream);
      for (int64_t t : opt.tokens) {
        const int64_t first = t * r / P, count = t * (r + 1) / P - first;
        MoeForwardArgs args;
        args.num_tokens = count;
        args.hidden_states = hidden.get() + first * shape.hidden;
        if (count > 0) {
          args.router_logits = logits.get() + first * shape.num_experts;
          args.correction_bias = bias.get();
        }
        RankResult result;
        result.tokens = count;
        layer.forward(args, output.get(), stream);  // warm-up: module loading, buffer growth
        std::vector<double> phases[5];
        for (int i = 0; i < opt.iterations; ++i) {
          rank_flusher.flush(stream);
          ExpertParallelTimes times;
          result.stats = layer.forward(args, output.get(), stream, &times);
          const double values[5] = {times.route_ms, times.dispatch_ms, times.experts_ms, times.return_ms,
                                    times.combine_ms};
          for (int p = 0; p < 5; ++p) phases[p].push_back(values[p]);
        }
        result.median = {median_of(phases[0]), median_of(phases[1]), median_of(phases[2]), median_of(phases[3]),
                         median_of(phases[4])};
        std::vector<uint16_t> out(static_cast<size_t>(count * shape.hidden));
        if (count > 0)
          FP4MOE_CUDA_CHECK(cudaMemcpyAsync(out.data(), output.get(), out.size() * 2, cudaMemcpyDeviceToHost, stream));
        FP4MOE_CUDA_CHECK(cudaStreamSynchronize(stream));
        result.nonfinite_outputs = std::count_if(out.begin(), out.end(), [](uint16_t b) {
          return (b & 0x7F80u) == 0x7F80u;  // bf16 exponent all ones: inf or NaN
        });
        const std::lock_guard<std::mutex> lock(mutex);
        results[t][static_cast<size_t>(r)] = result;
      }
      cudaStreamDestroy(stream);
    });

    for (int64_t t : opt.tokens) {
      const std::vector<RankResult>& ranks = results[t];
      const auto slowest = [&](double ExpertParallelTimes::*field) {
        double v = 0.0;
        for (const RankResult& rr : ranks) v = std::max(v, rr.median.*field);
        return v;
      };
      double total = 0.0, bytes = 0.0, a2a = 0.0;
      int64_t nonfinite = 0;
      for (const RankResult& rr : ranks) {
        total = std::max(total, rr.median.total_ms());
        a2a = std::max(a2a, rr.median.all_to_all_ms());
        bytes = std::max(bytes, bytes_moved(rr.stats, shape.hidden, k));
        nonfinite += rr.nonfinite_outputs;
      }
      const LayerRoofline roof = layer_roofline(shape.hidden, shape.inter, t, t * k, active[t], ceil);
      const double roof_per_rank_ms = roof.roof_us / 1e3 / P;
      std::snprintf(line, sizeof line,
                    "%-13s %2d %6lld %7.3f %7.3f %8.3f %7.3f %7.3f %7.3f %4.0f%% %8.2f %9.1f %7.3f %5.2f %7.3f\n",
                    shape.name.c_str(), P, static_cast<long long>(t), total, slowest(&ExpertParallelTimes::route_ms),
                    slowest(&ExpertParallelTimes::dispatch_ms), slowest(&ExpertParallelTimes::experts_ms),
                    slowest(&ExpertParallelTimes::return_ms), slowest(&ExpertParallelTimes::combine_ms),
                    100.0 * a2a / total, bytes / 1e6, a2a > 0 ? bytes / (a2a * 1e-3) / 1e9 : 0.0, roof_per_rank_ms,
                    roof_per_rank_ms / total, single_ms[t]);
      table << line;
      if (nonfinite > 0) table << "  WARNING: " << nonfinite << " output elements are NaN or infinite\n";
      table << std::flush;
      if (json) {
        nlohmann::json per_rank = nlohmann::json::array();
        for (const RankResult& rr : ranks)
          per_rank.push_back({{"tokens", rr.tokens},
                              {"sent_rows", rr.stats.sent_rows},
                              {"received_rows", rr.stats.received_rows},
                              {"received_pairs", rr.stats.received_pairs},
                              {"route_ms", rr.median.route_ms},
                              {"dispatch_ms", rr.median.dispatch_ms},
                              {"experts_ms", rr.median.experts_ms},
                              {"return_ms", rr.median.return_ms},
                              {"combine_ms", rr.median.combine_ms}});
        const nlohmann::json j{{"kind", "ep_layer"},
                               {"gpu", gpu},
                               {"date", date},
                               {"model", shape.name},
                               {"num_ranks", P},
                               {"tokens", t},
                               {"iterations", opt.iterations},
                               {"total_ms", total},
                               {"all_to_all_ms", a2a},
                               {"bytes_moved_per_rank", bytes},
                               {"all_to_all_gbps_measured", a2a_gbps},
                               {"roof_per_rank_ms", roof_per_rank_ms},
                               {"efficiency", roof_per_rank_ms / total},
                               {"single_gpu_ms", single_ms[t]},
                               {"nonfinite_outputs", nonfinite},
                               {"ranks", per_rank}};
        *json << j.dump() << std::endl;
      }
    }
  }
}

}  // namespace fp4moe::bench
