// See gemm_bench.hpp. Weights are drawn directly in the prepared
// (fragment-ordered) layout on the device; the cuBLAS peer multiplies the same
// weights dequantised to bf16, and its output doubles as a cross-check of ours.
#include "gemm_bench.hpp"

#include <cublas_v2.h>
#include <cuda_bf16.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <ctime>
#include <functional>
#include <iomanip>
#include <limits>
#include <nlohmann/json.hpp>
#include <numeric>
#include <random>
#include <sstream>
#include <utility>

#include "fp4moe/cuda_check.hpp"
#include "kernels/grouped_gemm.hpp"
#include "kernels/fragment_layout.hpp"
#include "plan/smem_model.hpp"

namespace fp4moe::bench {

namespace {

#define BENCH_CUBLAS_CHECK(expr)                                                              \
  do {                                                                                        \
    const cublasStatus_t s_ = (expr);                                                         \
    if (s_ != CUBLAS_STATUS_SUCCESS) FP4MOE_THROW(#expr, " failed: cuBLAS status ", int(s_)); \
  } while (0)

__device__ __forceinline__ uint32_t hash32(uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdull;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ull;
  x ^= x >> 33;
  return static_cast<uint32_t>(x);
}

__global__ void fill_random_bytes_kernel(uint8_t* out, size_t n, uint64_t seed) {
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n / 4; i += size_t{gridDim.x} * blockDim.x)
    reinterpret_cast<uint32_t*>(out)[i] = hash32(seed * 0x9E3779B97F4A7C15ull + i);
}

// Scale codes of e4m3 values in [0.5, 2): realistic ModelOpt block scales
// after the 448 / amax normalisation are O(1..448); the kernel's cost does
// not depend on the value.
__global__ void fill_random_scales(uint8_t* out, size_t n, uint64_t seed) {
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n; i += size_t{gridDim.x} * blockDim.x) {
    const uint8_t e4m3 = static_cast<uint8_t>(0x30 + hash32(seed + i * 7919) % 16);
    out[i] = layout::scale_code_from_e4m3(e4m3);
  }
}

__global__ void fill_random_bf16_kernel(__nv_bfloat16* out, size_t n, uint64_t seed) {
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n; i += size_t{gridDim.x} * blockDim.x) {
    const uint32_t h = hash32(seed ^ (i * 0x2545F4914F6CDD1Dull));
    out[i] = __float2bfloat16((static_cast<float>(h & 0xFFFF) / 32768.0f) - 1.0f);
  }
}

// Prepared weights -> bf16 W[e][n][k] (times the global scale), for cuBLAS.
__global__ void dequantize_prepared(const uint8_t* weights, const uint8_t* scales, const float* global_scales,
                                    __nv_bfloat16* out, int64_t num_experts, int64_t n, int64_t k, int64_t n_groups,
                                    int64_t k_frags) {
  const int64_t words = num_experts * n_groups * k_frags * 128;  // 32 lanes x 4 k-steps per fragment
  for (int64_t w = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; w < words; w += int64_t{gridDim.x} * blockDim.x) {
    const int64_t frag_seq = w / 128;  // (e, group, kf) in row-major order
    const int lane = static_cast<int>((w % 128) / 4), ks = static_cast<int>(w % 4);
    const int64_t kf = frag_seq % k_frags, group = (frag_seq / k_frags) % n_groups, e = frag_seq / (k_frags * n_groups);
    const int64_t frag = layout::fragment_index(e, group, kf, n_groups, k_frags);
    const uint32_t word = reinterpret_cast<const uint32_t*>(weights)[frag * 128 + lane * 4 + ks];
    const int g = lane / 4, t = lane % 4;
    for (int r : {g, g + 8}) {
      const int64_t row = group * 16 + r;
      if (row >= n) continue;
      const uint8_t code_s = scales[frag * kFragScaleBytes + layout::scale_byte(g, ks, r >= 8 ? 1 : 0)];
      const float scale = __uint_as_float(static_cast<uint32_t>(layout::scale_code_to_bf16_bits(code_s)) << 16) *
                          0x1p-119f * global_scales[e];
      for (int kk : {2 * t, 2 * t + 1, 2 * t + 8, 2 * t + 9}) {
        const int64_t col = kf * 64 + ks * 16 + kk;
        if (col >= k) continue;
        const uint8_t code = static_cast<uint8_t>(layout::code_of_slot(word, layout::code_slot(r, kk)));
        out[(e * n + row) * k + col] = __float2bfloat16(e2m1_to_float(code) * scale);
      }
    }
  }
}

// Reads the flush buffer so that L2 then holds only clean lines of it. A
// memset would leave up to an L2's worth of dirty lines whose write-back
// steals bandwidth from the launch being timed.
__global__ void read_to_evict_l2(const uint4* buf, size_t count, uint32_t* sink) {
  uint32_t acc = 0;
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < count; i += size_t{gridDim.x} * blockDim.x) {
    const uint4 v = __ldcg(buf + i);
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == 0x9E3779B9u) *sink = acc;  // never true for the zero-filled buffer; keeps the loads
}

constexpr int kFillGrid = 1024, kFillBlock = 256;

// The GEMM bench's read peer: reads `count` 16-byte words from DRAM, four
// independent loads in flight per thread (streaming, L1 bypassed), eight
// blocks of 256 threads per SM, so that a read of a few megabytes is limited
// by the launch and DRAM latency rather than by too few requests.
__global__ void __launch_bounds__(256) stream_read(const uint4* buf, size_t count, uint32_t* sink) {
  const size_t stride = size_t{gridDim.x} * blockDim.x;
  size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x;
  uint32_t acc = 0;
  for (; i + 3 * stride < count; i += 4 * stride) {
    const uint4 a = __ldcs(buf + i), b = __ldcs(buf + i + stride), c = __ldcs(buf + i + 2 * stride),
                d = __ldcs(buf + i + 3 * stride);
    acc ^= a.x ^ a.y ^ a.z ^ a.w ^ b.x ^ b.y ^ b.z ^ b.w ^ c.x ^ c.y ^ c.z ^ c.w ^ d.x ^ d.y ^ d.z ^ d.w;
  }
  for (; i < count; i += stride) {
    const uint4 a = __ldcs(buf + i);
    acc ^= a.x ^ a.y ^ a.z ^ a.w;
  }
  if (acc == 0x9E3779B9u) *sink = acc;  // never true for a zero-filled buffer; keeps the loads
}

// Random distinct top-k experts per token -> rows per expert.
std::vector<int32_t> random_routing_counts(int64_t num_experts, int top_k, int64_t tokens, std::mt19937_64& rng) {
  std::vector<int32_t> counts(static_cast<size_t>(num_experts), 0);
  for (int32_t id : random_topk_ids(num_experts, top_k, tokens, rng)) ++counts[static_cast<size_t>(id)];
  return counts;
}

}  // namespace

std::vector<int32_t> random_topk_ids(int64_t num_experts, int top_k, int64_t tokens, std::mt19937_64& rng) {
  FP4MOE_CHECK(top_k >= 1 && top_k <= num_experts, "random_topk_ids: top_k = ", top_k, "; expected 1 .. ", num_experts);
  std::vector<int32_t> out;
  out.reserve(static_cast<size_t>(tokens * top_k));
  std::vector<int32_t> ids(static_cast<size_t>(num_experts));
  for (int64_t t = 0; t < tokens; ++t) {
    std::iota(ids.begin(), ids.end(), 0);
    for (int j = 0; j < top_k; ++j) {  // partial Fisher-Yates
      std::uniform_int_distribution<int64_t> pick(j, num_experts - 1);
      std::swap(ids[static_cast<size_t>(j)], ids[static_cast<size_t>(pick(rng))]);
      out.push_back(ids[static_cast<size_t>(j)]);
    }
  }
  return out;
}

std::vector<int32_t> skewed_topk_ids(int64_t num_experts, int top_k, int64_t tokens, double skew,
                                     std::mt19937_64& rng) {
  FP4MOE_CHECK(std::isfinite(skew) && skew >= 0, "skewed_topk_ids: skew = ", skew, "; expected a finite value >= 0");
  if (skew == 0) return random_topk_ids(num_experts, top_k, tokens, rng);
  FP4MOE_CHECK(top_k >= 1 && top_k <= num_experts, "skewed_topk_ids: top_k = ", top_k, "; expected 1 .. ", num_experts);
  std::normal_distribution<double> normal(0.0, 1.0);
  std::vector<double> log_popularity(static_cast<size_t>(num_experts));
  for (double& l : log_popularity) l = skew * normal(rng);
  // The top_k largest log p_e + Gumbel noise are a sample of top_k distinct
  // experts drawn in turn with probabilities proportional to p_e.
  std::uniform_real_distribution<double> uniform(std::numeric_limits<double>::min(), 1.0);
  std::vector<std::pair<double, int32_t>> keys(static_cast<size_t>(num_experts));
  std::vector<int32_t> out;
  out.reserve(static_cast<size_t>(tokens * top_k));
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t e = 0; e < num_experts; ++e)
      keys[static_cast<size_t>(e)] = {log_popularity[static_cast<size_t>(e)] - std::log(-std::log(uniform(rng))),
                                      static_cast<int32_t>(e)};
    std::partial_sort(keys.begin(), keys.begin() + top_k, keys.end(), std::greater<>());
    for (int j = 0; j < top_k; ++j) out.push_back(keys[static_cast<size_t>(j)].second);
  }
  return out;
}

RandomGemmWeights random_gemm_weights(int64_t num_experts, int64_t n, int64_t k, uint64_t seed) {
  RandomGemmWeights w;
  w.num_experts = num_experts;
  w.n = n;
  w.k = k;
  w.n_padded = (n + layout::kPadN - 1) / layout::kPadN * layout::kPadN;
  w.k_padded = (k + layout::kPadK - 1) / layout::kPadK * layout::kPadK;
  const size_t w_bytes = static_cast<size_t>(num_experts * w.n_padded * w.k_padded / 2);
  const size_t s_bytes = static_cast<size_t>(num_experts * w.n_padded * w.k_padded / 16);
  w.weights = DeviceBuffer<uint8_t>(w_bytes);
  w.scales = DeviceBuffer<uint8_t>(s_bytes);
  fill_random_bytes(w.weights.get(), w_bytes, seed);
  fill_random_scales<<<kFillGrid, kFillBlock>>>(w.scales.get(), s_bytes, seed + 2);
  FP4MOE_CHECK_LAUNCH();
  w.global_scales = DeviceBuffer<float>(std::vector<float>(static_cast<size_t>(num_experts), 1.0f / 64.0f));
  return w;
}

// ------------------------------------------------------ shared measurement

L2Flusher::L2Flusher(size_t bytes) : buffer_(bytes) {
  // Zeros: read_to_evict_l2's sink condition is then never true.
  buffer_.fill_bytes(0);
}

void L2Flusher::flush(cudaStream_t stream) const {
  read_to_evict_l2<<<kFillGrid, kFillBlock, 0, stream>>>(
      reinterpret_cast<const uint4*>(buffer_.get()), buffer_.size() / 16, reinterpret_cast<uint32_t*>(buffer_.get()));
  FP4MOE_CHECK_LAUNCH();
}

std::vector<double> time_interleaved_us(const std::vector<std::function<void()>>& launches, int iterations,
                                        const L2Flusher& flusher, cudaStream_t stream) {
  FP4MOE_CHECK(iterations >= 1, "time_interleaved_us: iterations must be >= 1, not ", iterations);
  const size_t n = launches.size();
  std::vector<cudaEvent_t> events(2 * n * static_cast<size_t>(iterations));
  for (cudaEvent_t& e : events) FP4MOE_CUDA_CHECK(cudaEventCreate(&e));
  const auto event = [&](int i, size_t l, int edge) { return events[(static_cast<size_t>(i) * n + l) * 2 + edge]; };
  for (const auto& launch : launches) launch();  // warm-up
  for (int i = 0; i < iterations; ++i)
    for (size_t l = 0; l < n; ++l) {
      flusher.flush(stream);
      FP4MOE_CUDA_CHECK(cudaEventRecord(event(i, l, 0), stream));
      launches[l]();
      FP4MOE_CUDA_CHECK(cudaEventRecord(event(i, l, 1), stream));
    }
  FP4MOE_CUDA_CHECK(cudaStreamSynchronize(stream));
  std::vector<double> medians(n);
  for (size_t l = 0; l < n; ++l) {
    std::vector<float> ms(static_cast<size_t>(iterations));
    for (int i = 0; i < iterations; ++i)
      FP4MOE_CUDA_CHECK(cudaEventElapsedTime(&ms[static_cast<size_t>(i)], event(i, l, 0), event(i, l, 1)));
    std::nth_element(ms.begin(), ms.begin() + iterations / 2, ms.end());
    medians[l] = ms[static_cast<size_t>(iterations / 2)] * 1e3;
  }
  for (cudaEvent_t& e : events) cudaEventDestroy(e);
  return medians;
}

double time_median_us(const std::function<void()>& launch, int iterations, const L2Flusher& flusher,
                      cudaStream_t stream) {
  return time_interleaved_us({launch}, iterations, flusher, stream)[0];
}

double time_span_us(const std::function<void()>& launch, cudaStream_t stream) {
  cudaEvent_t start = nullptr, stop = nullptr;
  FP4MOE_CUDA_CHECK(cudaEventCreate(&start));
  float ms = 0;
  try {
    FP4MOE_CUDA_CHECK(cudaEventCreate(&stop));
    FP4MOE_CUDA_CHECK(cudaEventRecord(start, stream));
    launch();
    FP4MOE_CUDA_CHECK(cudaEventRecord(stop, stream));
    FP4MOE_CUDA_CHECK(cudaEventSynchronize(stop));
    FP4MOE_CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
  } catch (...) {
    cudaEventDestroy(start);
    if (stop) cudaEventDestroy(stop);
    throw;
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  return ms * 1e3;
}

std::string ceilings_json_line(const std::string& gpu, const std::string& date, const Ceilings& ceilings) {
  const nlohmann::json j{{"kind", "ceilings"},
                         {"gpu", gpu},
                         {"date", date},
                         {"copy_tbps", ceilings.copy_bytes_per_s / 1e12},
                         {"read_tbps", ceilings.read_bytes_per_s / 1e12},
                         {"memory_tbps", ceilings.memory_bytes_per_s() / 1e12},
                         {"bf16_tflops", ceilings.bf16_flops_per_s / 1e12},
                         {"bf16_sustained_tflops", ceilings.bf16_sustained_flops_per_s / 1e12}};
  return j.dump();
}

cudaGraphExec_t capture_graph(cudaStream_t stream, const std::function<void()>& work) {
  cudaGraph_t graph = nullptr;
  FP4MOE_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  try {
    work();
  } catch (...) {
    cudaStreamEndCapture(stream, &graph);
    if (graph) cudaGraphDestroy(graph);
    cudaGetLastError();
    throw;
  }
  FP4MOE_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
  cudaGraphExec_t exec = nullptr;
  const cudaError_t status = cudaGraphInstantiate(&exec, graph, 0);
  cudaGraphDestroy(graph);
  FP4MOE_CUDA_CHECK(status);
  return exec;
}

double time_stream_read_us(double bytes, int iterations, const L2Flusher& flusher) {
  size_t free_bytes = 0, total_bytes = 0;
  FP4MOE_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
  if (bytes + static_cast<double>(size_t{1} << 30) >= static_cast<double>(free_bytes)) return 0.0;
  int device = 0, num_sms = 0;
  FP4MOE_CUDA_CHECK(cudaGetDevice(&device));
  FP4MOE_CUDA_CHECK(cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, device));
  DeviceBuffer<uint8_t> src(static_cast<size_t>(bytes) / 16 * 16);
  src.fill_bytes(0);
  return time_median_us(
      [&] {
        stream_read<<<8 * num_sms, 256>>>(reinterpret_cast<const uint4*>(src.get()), src.size() / 16,
                                          reinterpret_cast<uint32_t*>(src.get()));
        FP4MOE_CHECK_LAUNCH();
      },
      iterations, flusher);
}

Ceilings measure_ceilings(const L2Flusher& flusher) {
  Ceilings c;
  const size_t copy_bytes = size_t{2} << 30;
  DeviceBuffer<uint8_t> a(copy_bytes), b(copy_bytes);
  fill_random_bytes(a.get(), copy_bytes, 1);
  const double copy_us = time_median_us(
      [&] { FP4MOE_CUDA_CHECK(cudaMemcpyAsync(b.get(), a.get(), copy_bytes, cudaMemcpyDeviceToDevice)); }, 10, flusher);
  c.copy_bytes_per_s = 2.0 * copy_bytes / (copy_us * 1e-6);  // read + write
  int device = 0, num_sms = 0;
  FP4MOE_CUDA_CHECK(cudaGetDevice(&device));
  FP4MOE_CUDA_CHECK(cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, device));
  const double read_us = time_median_us(
      [&] {
        stream_read<<<8 * num_sms, 256>>>(reinterpret_cast<const uint4*>(a.get()), copy_bytes / 16,
                                          reinterpret_cast<uint32_t*>(b.get()));
        FP4MOE_CHECK_LAUNCH();
      },
      10, flusher);
  c.read_bytes_per_s = copy_bytes / (read_us * 1e-6);

  cublasHandle_t cublas;
  BENCH_CUBLAS_CHECK(cublasCreate(&cublas));
  const int dim = 8192;
  DeviceBuffer<__nv_bfloat16> ma(size_t{dim} * dim), mb(size_t{dim} * dim), mc(size_t{dim} * dim);
  fill_random_bf16(ma.get(), ma.size(), 2);
  fill_random_bf16(mb.get(), mb.size(), 3);
  const float alpha = 1.0f, beta = 0.0f;
  const auto gemm = [&] {
    BENCH_CUBLAS_CHECK(cublasGemmEx(cublas, CUBLAS_OP_N, CUBLAS_OP_N, dim, dim, dim, &alpha, ma.get(), CUDA_R_16BF, dim,
                                    mb.get(), CUDA_R_16BF, dim, &beta, mc.get(), CUDA_R_16BF, dim, CUBLAS_COMPUTE_32F,
                                    CUBLAS_GEMM_DEFAULT));
  };
  const double flops = 2.0 * dim * dim * static_cast<double>(dim);
  try {
    const double gemm_us = time_median_us(gemm, 10, flusher);
    c.bf16_flops_per_s = flops / (gemm_us * 1e-6);
    // Sustained: 0.75 s of back-to-back GEMMs brings the GPU to its power
    // limit (the clocks settle within a few hundred ms), the next 0.75 s are
    // timed.
    const int count = static_cast<int>(0.75e6 / gemm_us) + 1;
    const auto run = [&] {
      for (int i = 0; i < count; ++i) gemm();
    };
    run();
    c.bf16_sustained_flops_per_s = flops * count / (time_span_us(run) * 1e-6);
  } catch (...) {
    cublasDestroy(cublas);
    throw;
  }
  cublasDestroy(cublas);
  return c;
}

GemmCost grouped_gemm_cost(int64_t active_experts, int64_t rows, int64_t n, int64_t k) {
  GemmCost cost;
  cost.bytes =
      static_cast<double>(active_experts) * static_cast<double>(n) * static_cast<double>(k) * (0.5 + 1.0 / 16) +
      static_cast<double>(rows) * static_cast<double>(k) * 2 + static_cast<double>(rows) * static_cast<double>(n) * 2;
  cost.flops = 2.0 * static_cast<double>(rows) * static_cast<double>(n) * static_cast<double>(k);
  return cost;
}

double roofline_us(const GemmCost& cost, const Ceilings& ceilings) {
  return std::max(cost.bytes / ceilings.memory_bytes_per_s(), cost.flops / ceilings.bf16_flops_per_s) * 1e6;
}

std::string Ceilings::describe() const {
  char buf[160];
  std::snprintf(buf, sizeof buf,
                "memory %.2f TB/s (copy %.2f, read %.2f), cuBLAS bf16 %.0f TFLOP/s (8192^3; %.0f sustained)",
                memory_bytes_per_s() / 1e12, copy_bytes_per_s / 1e12, read_bytes_per_s / 1e12, bf16_flops_per_s / 1e12,
                bf16_sustained_flops_per_s / 1e12);
  return buf;
}

void fill_random_bytes(uint8_t* dst, size_t count, uint64_t seed, cudaStream_t stream) {
  FP4MOE_CHECK(count % 4 == 0, "fill_random_bytes: count ", count, " is not a multiple of 4");
  fill_random_bytes_kernel<<<kFillGrid, kFillBlock, 0, stream>>>(dst, count, seed);
  FP4MOE_CHECK_LAUNCH();
}

void fill_random_bf16(void* dst, size_t count, uint64_t seed, cudaStream_t stream) {
  fill_random_bf16_kernel<<<kFillGrid, kFillBlock, 0, stream>>>(static_cast<__nv_bfloat16*>(dst), count, seed);
  FP4MOE_CHECK_LAUNCH();
}

std::string gpu_name() {
  int dev = 0;
  cudaDeviceProp prop{};
  FP4MOE_CUDA_CHECK(cudaGetDevice(&dev));
  FP4MOE_CUDA_CHECK(cudaGetDeviceProperties(&prop, dev));
  return prop.name;
}

std::string today() {
  const std::time_t now = std::time(nullptr);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%d", std::gmtime(&now));
  return buf;
}

// ------------------------------------------------------ grouped-GEMM bench

void run_gemm_bench(const Options& opt, std::ostream& table, std::ostream* json) {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0)
    FP4MOE_THROW("fp4moe bench needs a CUDA GPU; none was found");
  cublasHandle_t cublas;
  BENCH_CUBLAS_CHECK(cublasCreate(&cublas));
  const L2Flusher flusher;
  const Ceilings ceil = measure_ceilings(flusher);
  const std::string gpu = gpu_name();
  const std::string date = today();
  table << "# " << gpu << ", " << date << ": " << ceil.describe() << "\n";
  table << "model         gemm      T    rows act     N     K config                   sk   time_us   TB/s  TFLOP/s  "
           "eff   "
           "cublas_us cub_eff  speedup rel_err  other family              other_us other_eff  read_us read_eff\n";
  int num_sms = 0, device = 0;
  FP4MOE_CUDA_CHECK(cudaGetDevice(&device));
  FP4MOE_CUDA_CHECK(cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, device));
  int cc_major = 0, cc_minor = 0;
  FP4MOE_CUDA_CHECK(cudaDeviceGetAttribute(&cc_major, cudaDevAttrComputeCapabilityMajor, device));
  FP4MOE_CUDA_CHECK(cudaDeviceGetAttribute(&cc_minor, cudaDevAttrComputeCapabilityMinor, device));
  const int compute_capability = cc_major * 10 + cc_minor;
  if (json) {
    *json << ceilings_json_line(gpu, date, ceil) << std::endl;
  }
  std::mt19937_64 rng(opt.seed);
  for (const ModelSpec& model : opt.models) {
    for (int gemm : opt.gemms) {
      const int64_t n = gemm == 1 ? 2 * model.inter : model.hidden;
      const int64_t k = gemm == 1 ? model.hidden : model.inter;
      const int64_t E = model.num_experts;
      const RandomGemmWeights random = random_gemm_weights(E, n, k, 11 + gemm);
      const DeviceBuffer<uint8_t>& weights = random.weights;
      const DeviceBuffer<uint8_t>& scales = random.scales;
      const DeviceBuffer<float>& global = random.global_scales;
      std::optional<DeviceBuffer<__nv_bfloat16>> w_bf16;
      if (opt.with_cublas) {
        w_bf16.emplace(static_cast<size_t>(E * n * k));
        dequantize_prepared<<<4096, 256>>>(weights.get(), scales.get(), global.get(), w_bf16->get(), E, n, k,
                                           random.n_padded / 16, random.k_padded / 64);
        FP4MOE_CHECK_LAUNCH();
      }
      for (int64_t tokens : opt.tokens) {
        const std::vector<int32_t> counts = random_routing_counts(E, model.top_k, tokens, rng);
        std::vector<int32_t> offsets(1, 0);
        int64_t active = 0;
        for (int32_t c : counts) {
          offsets.push_back(offsets.back() + c);
          active += c > 0;
        }
        const int64_t rows = offsets.back();
        DeviceBuffer<__nv_bfloat16> x(static_cast<size_t>(rows * k)), y(static_cast<size_t>(rows * n));
        const DeviceBuffer<int32_t> d_offsets(offsets);
        fill_random_bf16(x.get(), x.size(), 17 + tokens);

        GroupedGemmArgs args;
        args.weights = weights.get();
        args.scales = scales.get();
        args.global_scales = global.get();
        args.num_experts = E;
        args.n = n;
        args.k = k;
        args.x = x.get();
        args.expert_offsets = d_offsets.get();
        args.num_rows = rows;
        args.y = y.get();
        args.host_expert_offsets = offsets.data();
        const GemmPlan plan = plan_grouped_gemm(args, opt.config);
        DeviceBuffer<uint8_t> workspace(grouped_gemm_workspace_bytes(plan));
        workspace.fill_bytes(0);
        args.workspace = workspace.get();
        args.workspace_bytes = workspace.size();
        const int iters = std::max(3, tokens >= 4096 ? opt.iterations / 4 : opt.iterations);
        const double t_us = time_median_us([&] { grouped_gemm(args, plan, nullptr); }, iters, flusher);
        const std::string device_errors = grouped_gemm_device_errors(workspace.get(), nullptr);
        FP4MOE_CHECK(device_errors.empty(), "device reported: ", device_errors);

        const GemmCost cost = grouped_gemm_cost(active, rows, n, k);
        const double bytes = cost.bytes, flops = cost.flops;
        const double roof_us = roofline_us(cost, ceil);

        // Peer: the other kernel family's own choice, where it runs here.
        double other_us = 0;
        std::string other_config = "-";
        {
          GemmProblem problem{E, n, k, rows, active, Epilogue::kNone};
          std::optional<TileConfig> other;
          if (plan.config.family == KernelFamily::kSm90) {
            other = plan_gemm(problem, kPortableSmemLimit, num_sms, /*compute_capability=*/0).config;
          } else if (opt.with_other_family && family_runs_on(KernelFamily::kSm90, compute_capability)) {
            problem.single_family = true;
            other = plan_gemm(problem, kSmemLimitSm90, num_sms, compute_capability).config;
          }
          if (other && opt.with_other_family) {
            const GemmPlan other_plan = plan_grouped_gemm(args, *other);
            DeviceBuffer<uint8_t> other_ws(grouped_gemm_workspace_bytes(other_plan));
            other_ws.fill_bytes(0);
            GroupedGemmArgs other_args = args;
            other_args.workspace = other_ws.get();
            other_args.workspace_bytes = other_ws.size();
            other_us = time_median_us([&] { grouped_gemm(other_args, other_plan, nullptr); }, iters, flusher);
            other_config = other_plan.config.to_string() + "/" + std::to_string(other_plan.split_k);
            // It wrote y too: run ours again so that y is ours for the cross-check.
            grouped_gemm(args, plan, nullptr);
          }
        }

        // Peer at memory-bound points: a plain streaming read of the same bytes.
        const double read_us = cost.bytes / ceil.memory_bytes_per_s() >= cost.flops / ceil.bf16_flops_per_s
                                   ? time_stream_read_us(bytes, iters, flusher)
                                   : 0.0;

        double cublas_us = 0, rel_err = -1;
        if (opt.with_cublas) {
          DeviceBuffer<__nv_bfloat16> y_ref(static_cast<size_t>(rows * n));
          y_ref.fill_bytes(0xFF);  // NaN: an element cuBLAS never wrote fails the cross-check
          std::vector<cublasOperation_t> ta, tb;
          std::vector<int> m_arr, n_arr, k_arr, lda, ldb, ldc, group_size;
          std::vector<float> alpha, beta;
          std::vector<const void*> a_ptrs, b_ptrs;
          std::vector<void*> c_ptrs;
          for (int64_t e = 0; e < E; ++e) {
            if (counts[static_cast<size_t>(e)] == 0) continue;
            ta.push_back(CUBLAS_OP_T);
            tb.push_back(CUBLAS_OP_N);
            m_arr.push_back(static_cast<int>(n));
            n_arr.push_back(counts[static_cast<size_t>(e)]);
            k_arr.push_back(static_cast<int>(k));
            lda.push_back(static_cast<int>(k));
            ldb.push_back(static_cast<int>(k));
            ldc.push_back(static_cast<int>(n));
            alpha.push_back(1.0f);
            beta.push_back(0.0f);
            group_size.push_back(1);
            a_ptrs.push_back(w_bf16->get() + e * n * k);
            b_ptrs.push_back(x.get() + static_cast<int64_t>(offsets[static_cast<size_t>(e)]) * k);
            c_ptrs.push_back(y_ref.get() + static_cast<int64_t>(offsets[static_cast<size_t>(e)]) * n);
          }
          const int groups = static_cast<int>(ta.size());
          const DeviceBuffer<const void*> d_a(a_ptrs), d_b(b_ptrs);
          const DeviceBuffer<void*> d_c(c_ptrs);
          cublas_us = time_median_us(
              [&] {
                BENCH_CUBLAS_CHECK(cublasGemmGroupedBatchedEx(
                    cublas, ta.data(), tb.data(), m_arr.data(), n_arr.data(), k_arr.data(), alpha.data(), d_a.get(),
                    CUDA_R_16BF, lda.data(), d_b.get(), CUDA_R_16BF, ldb.data(), beta.data(), d_c.get(), CUDA_R_16BF,
                    ldc.data(), groups, group_size.data(), CUBLAS_COMPUTE_32F));
              },
              iters, flusher);
          // Cross-check: both compute X . W^T from the same weights.
          const std::vector<__nv_bfloat16> ours = y.download(), theirs = y_ref.download();
          double num = 0, den = 0;
          int64_t nonfinite = 0;
          for (size_t i = 0; i < ours.size(); ++i) {
            const double a = __bfloat162float(ours[i]), b = __bfloat162float(theirs[i]);
            if (!std::isfinite(a) || !std::isfinite(b)) {
              ++nonfinite;
              continue;
            }
            num += (a - b) * (a - b);
            den += b * b;
          }
          // Random inputs never give an all-zero product: a zero norm means
          // an output nobody wrote, and 0 would read as a perfect match.
          FP4MOE_CHECK(nonfinite == 0 && den > 0, "cross-check against cuBLAS (", model.name, " GEMM", gemm,
                       ", T = ", tokens, "): ", nonfinite, " non-finite or unwritten elements, cuBLAS output norm ",
                       std::sqrt(den));
          rel_err = std::sqrt(num / den);
        }
        const double eff = roof_us / t_us;
        char line[704];
        std::snprintf(
            line, sizeof line,
            "%-13s gemm%d %6lld %7lld %3lld %5lld %5lld %-24s %2d %9.1f %6.2f %8.1f %5.2f %9.1f %6.2f %7.2fx %.1e"
            "  %-26s %8.1f %6.2f %8.1f %6.2f\n",
            model.name.c_str(), gemm, static_cast<long long>(tokens), static_cast<long long>(rows),
            static_cast<long long>(active), static_cast<long long>(n), static_cast<long long>(k),
            plan.config.to_string().c_str(), plan.split_k, t_us, bytes / (t_us * 1e-6) / 1e12,
            flops / (t_us * 1e-6) / 1e12, eff, cublas_us, cublas_us > 0 ? roof_us / cublas_us : 0.0,
            cublas_us > 0 ? cublas_us / t_us : 0.0, rel_err, other_config.c_str(), other_us,
            other_us > 0 ? roof_us / other_us : 0.0, read_us, read_us > 0 ? roof_us / read_us : 0.0);
        table << line << std::flush;
        if (json) {
          nlohmann::json j{{"kind", "grouped_gemm"},
                           {"gpu", gpu},
                           {"date", date},
                           {"model", model.name},
                           {"gemm", gemm},
                           {"tokens", tokens},
                           {"rows", rows},
                           {"active_experts", active},
                           {"num_experts", E},
                           {"n", n},
                           {"k", k},
                           {"config", plan.config.to_string()},
                           {"row_stages", describe_row_classes(plan)},
                           {"family", to_string(plan.config.family)},
                           {"split_k", plan.split_k},
                           {"time_us", t_us},
                           {"tbps", bytes / (t_us * 1e-6) / 1e12},
                           {"tflops", flops / (t_us * 1e-6) / 1e12},
                           {"roof_us", roof_us},
                           {"efficiency", eff},
                           {"efficiency_sustained", roofline_us(cost, ceil.sustained()) / t_us},
                           {"copy_tbps", ceil.copy_bytes_per_s / 1e12},
                           {"memory_tbps", ceil.memory_bytes_per_s() / 1e12},
                           {"bf16_tflops", ceil.bf16_flops_per_s / 1e12},
                           {"bf16_sustained_tflops", ceil.bf16_sustained_flops_per_s / 1e12},
                           {"cublas_us", cublas_us},
                           {"cublas_efficiency", cublas_us > 0 ? roof_us / cublas_us : 0.0},
                           {"speedup_vs_cublas", cublas_us > 0 ? cublas_us / t_us : 0.0},
                           {"rel_err_vs_cublas", rel_err},
                           {"other_family_config", other_config},
                           {"other_family_us", other_us},
                           {"other_family_efficiency", other_us > 0 ? roof_us / other_us : 0.0},
                           {"read_peer_us", read_us},
                           {"read_peer_efficiency", read_us > 0 ? roof_us / read_us : 0.0},
                           {"iterations", iters}};
          *json << j.dump() << std::endl;
        }
      }
    }
  }
  cublasDestroy(cublas);
}

}  // namespace fp4moe::bench
