// See layer_bench.hpp. Host code only: the device work is MoeLayer::forward
// and the shared fills and L2 flush of gemm_bench.cu.
#include "layer_bench.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <iomanip>
#include <nlohmann/json.hpp>
#include <random>
#include <utility>

#include "fp4moe/cuda_check.hpp"
#include "fp4moe/nvfp4.hpp"
#include "kernels/launch.cuh"
#include "layer/moe_layer_internals.hpp"
#include "util/parallel.hpp"
#include "util/splitmix64.hpp"

namespace fp4moe::bench {

namespace {

// e4m3 codes 0x28..0x48: 0.125 .. 2.0, the sane middle of the format.
constexpr uint8_t kFirstScaleCode = 0x28;
constexpr int kNumScaleCodes = 0x48 - 0x28 + 1;

std::vector<float> random_bias(int64_t n, SplitMix64& rng) {
  std::vector<float> bias(static_cast<size_t>(n));
  for (float& b : bias) b = static_cast<float>((rng.uniform() - 0.5) * 0.2);
  return bias;
}

double median(std::vector<float> values) {
  const size_t mid = values.size() / 2;
  std::nth_element(values.begin(), values.begin() + static_cast<std::ptrdiff_t>(mid), values.end());
  return values[mid];
}

// One layer variant the benchmark runs.
struct Variant {
  MoeLayerOptions options;
  GatherMode gather = GatherMode::kAuto;
};

std::string variant_name(const MoeLayerOptions& options, GatherMode gather) {
  return to_string(options.finalize) + "/" + to_string(gather) +
         (options.activations == ActivationNumerics::kFp4 ? "/w4a4" : "") +
         (options.programmatic_launch ? "" : "/plain") + (options.batch_invariant ? "/batch-invariant" : "") +
         (options.fused_decode ? "" : "/unfused");
}

}  // namespace

// ---------------------------------------------------------------- weights

Nvfp4Matrix random_nvfp4_matrix(int64_t rows, int64_t cols, float global_scale, uint8_t first_scale_code,
                                int num_scale_codes, SplitMix64& rng) {
  FP4MOE_CHECK(num_scale_codes >= 1 && first_scale_code + num_scale_codes <= 256, "random_nvfp4_matrix: scale codes ",
               int{first_scale_code}, " + ", num_scale_codes, " outside e4m3");
  Nvfp4Matrix m;
  m.rows = rows;
  m.cols = cols;
  m.global_scale = global_scale;
  m.input_scale = 1.0f;
  m.packed.resize(static_cast<size_t>(rows * cols / 2));
  for (size_t i = 0; i < m.packed.size(); i += 8) {  // 16 codes per draw
    const uint64_t bits = rng.next();
    std::memcpy(m.packed.data() + i, &bits, std::min<size_t>(8, m.packed.size() - i));
  }
  m.scales.resize(static_cast<size_t>(rows * cols / kNvfp4BlockSize));
  for (size_t i = 0; i < m.scales.size(); i += 8) {  // 8 scales (one byte each) per draw
    const uint64_t bits = rng.next();
    for (size_t b = 0; b < 8 && i + b < m.scales.size(); ++b)
      m.scales[i + b] = static_cast<uint8_t>(first_scale_code + ((bits >> (8 * b)) & 0xFF) % num_scale_codes);
  }
  return m;
}

float unit_gain_global_scale(int64_t k, uint8_t first_scale_code, int num_scale_codes) {
  double code_ms = 0.0, scale_ms = 0.0;
  for (int c = 0; c < 16; ++c) code_ms += std::pow(e2m1_to_float(static_cast<uint8_t>(c)), 2) / 16.0;
  for (int c = 0; c < num_scale_codes; ++c)
    scale_ms += std::pow(e4m3_to_float(static_cast<uint8_t>(first_scale_code + c)), 2) / num_scale_codes;
  return static_cast<float>(1.0 / std::sqrt(static_cast<double>(k) * code_ms * scale_ms));
}

MoeWeights random_moe_weights(const LayerShape& shape, uint64_t seed) {
  FP4MOE_CHECK(
      shape.num_experts >= 1 && shape.hidden % 16 == 0 && shape.inter % 16 == 0 && shape.hidden > 0 && shape.inter > 0,
      "random_moe_weights: ", shape.name, " has ", shape.num_experts, " experts, hidden ", shape.hidden, ", inter ",
      shape.inter, "; expected >= 1 expert and positive multiples of 16");
  MoeWeights weights;
  weights.num_experts = shape.num_experts;
  weights.hidden = shape.hidden;
  weights.inter = shape.inter;
  weights.experts.resize(static_cast<size_t>(shape.num_experts));
  const float gate_up_scale =
      unit_gain_global_scale(shape.hidden, kFirstScaleCode, kNumScaleCodes);  // shared, as ModelOpt does
  const float down_scale = unit_gain_global_scale(shape.inter, kFirstScaleCode, kNumScaleCodes);
  parallel_for(shape.num_experts, [&](int64_t e) {
    // Seeded per expert: experts are drawn in parallel, and a seed gives one layer.
    SplitMix64 rng(seed * 0x2545F4914F6CDD1Dull + static_cast<uint64_t>(e) + 1);
    ExpertWeights& ex = weights.experts[static_cast<size_t>(e)];
    ex.gate = random_nvfp4_matrix(shape.inter, shape.hidden, gate_up_scale, kFirstScaleCode, kNumScaleCodes, rng);
    ex.up = random_nvfp4_matrix(shape.inter, shape.hidden, gate_up_scale, kFirstScaleCode, kNumScaleCodes, rng);
    ex.down = random_nvfp4_matrix(shape.hidden, shape.inter, down_scale, kFirstScaleCode, kNumScaleCodes, rng);
    // Input scales as calibration would set them (amax / 2688) for the
    // benchmark's hidden states, uniform in [-1, 1), and the unit-gain
    // SwiGLU output; used by the w4a4 variant only (the layer's format is
    // undeclared, so the others run bf16 activations).
    ex.gate.input_scale = ex.up.input_scale = 1.0f / 2688.0f;
    ex.down.input_scale = 4.0f / 2688.0f;
    ex.gate.has_input_scale = ex.up.has_input_scale = ex.down.has_input_scale = true;
    if (shape.has_bias) {
      ex.gate_bias = random_bias(shape.inter, rng);
      ex.up_bias = random_bias(shape.inter, rng);
      ex.down_bias = random_bias(shape.hidden, rng);
    }
  });
  return weights;
}

// --------------------------------------------------------------- roofline

LayerRoofline layer_roofline(int64_t hidden, int64_t inter, int64_t num_tokens, int64_t rows, int64_t active_experts,
                             const Ceilings& ceilings) {
  LayerRoofline roof;
  roof.rows = rows;
  roof.active_experts = active_experts;
  const double row_bytes = static_cast<double>(rows) * 2;  // one bf16 element per routed row
  roof.gemm1 = grouped_gemm_cost(active_experts, rows, 2 * inter, hidden);
  roof.gemm1.bytes -= row_bytes * static_cast<double>(inter);  // SwiGLU writes inter columns, not 2 inter
  roof.gemm2 = grouped_gemm_cost(active_experts, rows, hidden, inter);
  roof.combine.bytes = (row_bytes + static_cast<double>(num_tokens) * 2) * static_cast<double>(hidden);
  roof.gemm1_roof_us = roofline_us(roof.gemm1, ceilings);
  roof.gemm2_roof_us = roofline_us(roof.gemm2, ceilings);
  roof.combine_roof_us = roofline_us(roof.combine, ceilings);
  roof.roof_us = roof.gemm1_roof_us + roof.gemm2_roof_us + roof.combine_roof_us;
  return roof;
}

// ----------------------------------------------------------------- timer

struct LayerTimer::Buffers {
  DeviceBuffer<uint16_t> hidden_states;  // bf16 [max_tokens, hidden]
  DeviceBuffer<float> router_logits;     // [max_tokens, num_experts]
  DeviceBuffer<float> correction_bias;   // [num_experts]
  DeviceBuffer<uint16_t> output;         // bf16 [max_tokens, hidden]
  DeviceBuffer<uint8_t> workspace;
  Buffers(int64_t max_tokens, int64_t hidden, int64_t num_experts, size_t workspace_bytes)
      : hidden_states(static_cast<size_t>(max_tokens * hidden)),
        router_logits(static_cast<size_t>(max_tokens * num_experts)),
        correction_bias(static_cast<size_t>(num_experts)),
        output(static_cast<size_t>(max_tokens * hidden)),
        workspace(workspace_bytes) {}
};

std::string to_string(RouterLoad load) {
  switch (load) {
    case RouterLoad::kUniform:
      return "uniform";
    case RouterLoad::kRealistic:
      return "realistic";
    case RouterLoad::kSkewed:
      return "skewed";
  }
  return "?";
}

RouterLoad parse_router_load(const std::string& name) {
  for (RouterLoad load : {RouterLoad::kUniform, RouterLoad::kRealistic, RouterLoad::kSkewed})
    if (name == to_string(load)) return load;
  FP4MOE_THROW("unknown routing load '", name, "'; expected uniform, realistic or skewed");
}

namespace {

// Rows of the most loaded expert over the mean (tokens * top_k / num_experts)
// when `tokens` tokens of `logits` are routed with `routing`.
double hottest_over_mean(const std::vector<float>& logits, int64_t tokens, int64_t num_experts,
                         const std::vector<float>& bias, const RoutingParams& routing) {
  const Routing r = route(logits.data(), tokens, num_experts, bias.data(), routing);
  std::vector<int64_t> rows(static_cast<size_t>(num_experts), 0);
  for (int32_t e : r.topk_ids) ++rows[static_cast<size_t>(e)];
  const double mean = static_cast<double>(tokens) * routing.top_k / static_cast<double>(num_experts);
  return static_cast<double>(*std::max_element(rows.begin(), rows.end())) / mean;
}

}  // namespace

RouterInputs random_router_inputs(int64_t max_tokens, int64_t num_experts, const RoutingParams& routing, uint64_t seed,
                                  RouterLoad load) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  RouterInputs r;
  r.logits.resize(static_cast<size_t>(max_tokens * num_experts));
  for (float& v : r.logits) v = normal(rng);
  r.bias.assign(static_cast<size_t>(num_experts), 0.0f);
  if (load == RouterLoad::kSkewed) {
    for (float& v : r.bias) v = 0.1f * normal(rng);
  } else if (load == RouterLoad::kRealistic) {
    // The popularity comes from a generator of its own, and its scale is
    // fitted on the first kRealisticCalibrationTokens tokens of the logits'
    // stream (drawn again, whatever max_tokens is): every max_tokens gives
    // the same popularity and the same logits for the tokens it has.
    // (A distribution object per generator: it keeps a second draw.)
    std::mt19937_64 popularity_rng(seed ^ 0x9E3779B97F4A7C15ull);
    std::normal_distribution<float> popularity_normal(0.0f, 1.0f);
    std::vector<float> z(static_cast<size_t>(num_experts));
    for (float& v : z) v = popularity_normal(popularity_rng);
    const int64_t cal_tokens = kRealisticCalibrationTokens;
    std::vector<float> base(static_cast<size_t>(cal_tokens * num_experts));
    std::mt19937_64 stream_rng(seed);
    std::normal_distribution<float> stream_normal(0.0f, 1.0f);
    for (float& v : base) v = stream_normal(stream_rng);
    std::vector<float> shifted(base.size());
    const auto hot_share = [&](double s) {
      for (size_t i = 0; i < base.size(); ++i)
        shifted[i] = base[i] + static_cast<float>(s) * z[i % static_cast<size_t>(num_experts)];
      return hottest_over_mean(shifted, cal_tokens, num_experts, r.bias, routing);
    };
    double lo = 0.0, hi = 4.0;
    FP4MOE_CHECK(hot_share(hi) >= kRealisticHotShare, "the realistic routing load cannot reach ", kRealisticHotShare,
                 "x the mean rows with ", num_experts, " experts and top-", routing.top_k);
    for (int i = 0; i < 30; ++i) {  // the share grows with s
      const double mid = 0.5 * (lo + hi);
      (hot_share(mid) < kRealisticHotShare ? lo : hi) = mid;
    }
    r.popularity_scale = hi;
    for (size_t i = 0; i < r.logits.size(); ++i)
      r.logits[i] += static_cast<float>(hi) * z[i % static_cast<size_t>(num_experts)];
  }
  return r;
}

LayerTimer::LayerTimer(const MoeLayer& layer, int64_t max_tokens, uint64_t seed, RouterLoad load)
    : layer_(layer), max_tokens_(max_tokens), load_(load) {
  FP4MOE_CHECK(max_tokens >= 1, "LayerTimer: max_tokens must be >= 1, not ", max_tokens);
  const int64_t num_experts = layer.num_experts();
  RouterInputs inputs = random_router_inputs(max_tokens, num_experts, layer.options().routing, seed, load);
  host_logits_ = std::move(inputs.logits);
  host_bias_ = std::move(inputs.bias);
  popularity_scale_ = inputs.popularity_scale;

  buffers_ = std::make_unique<Buffers>(max_tokens, layer.hidden(), num_experts, layer.workspace_bytes(max_tokens));
  FP4MOE_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  fill_random_bf16(buffers_->hidden_states.get(), buffers_->hidden_states.size(), seed + kHiddenSeedOffset, stream_);
  buffers_->router_logits.upload(host_logits_, stream_);
  buffers_->correction_bias.upload(host_bias_, stream_);
  buffers_->workspace.fill_bytes(0, stream_);
  FP4MOE_CUDA_CHECK(cudaStreamSynchronize(stream_));
}

LayerTimer::~LayerTimer() {
  if (stream_) {
    cudaStreamSynchronize(stream_);
    cudaStreamDestroy(stream_);
  }
}

LayerTimer::ExpertLoad LayerTimer::expert_load(int64_t tokens) const {
  const Routing routing =
      route(host_logits_.data(), tokens, layer_.num_experts(), host_bias_.data(), layer_.options().routing);
  std::vector<int64_t> rows(static_cast<size_t>(layer_.num_experts()), 0);
  for (int32_t e : routing.topk_ids) ++rows[static_cast<size_t>(e)];
  std::erase(rows, 0);
  std::sort(rows.begin(), rows.end());
  ExpertLoad load;
  load.active = static_cast<int64_t>(rows.size());
  if (!rows.empty()) {
    load.max_rows = rows.back();
    load.median_rows = rows[rows.size() / 2];
  }
  load.mean_rows = static_cast<double>(tokens) * layer_.top_k() / static_cast<double>(layer_.num_experts());
  return load;
}

MoeForwardArgs LayerTimer::args(int64_t tokens) const {
  FP4MOE_CHECK(tokens >= 1 && tokens <= max_tokens_, "LayerTimer: ", tokens, " tokens; expected 1 .. ", max_tokens_);
  MoeForwardArgs a;
  a.hidden_states = buffers_->hidden_states.get();
  a.num_tokens = tokens;
  a.router_logits = buffers_->router_logits.get();
  a.correction_bias = buffers_->correction_bias.get();
  return a;
}

void LayerTimer::forward(int64_t tokens, const MoeStageEvents* events) const {
  MoeLayerInternals::forward(layer_, args(tokens), buffers_->output.get(), buffers_->workspace.get(),
                             buffers_->workspace.size(), stream_, events ? *events : MoeStageEvents{});
}

double LayerTimer::time_forward_us(int64_t tokens, int iterations, const L2Flusher& flusher) {
  return time_median_us([&] { forward(tokens, nullptr); }, iterations, flusher, stream_);
}

std::vector<kernels::TimelineRecord> LayerTimer::timeline(int64_t tokens, const L2Flusher& flusher) {
  using kernels::TimelineRecord;
  DeviceBuffer<TimelineRecord> records(std::vector<TimelineRecord>(
      static_cast<size_t>(kernels::TimelineKernel::kCount) * kernels::kTimelineMaxBlocks, TimelineRecord{~0ull, 0}));
  forward(tokens, nullptr);  // warm-up
  flusher.flush(stream_);
  FP4MOE_CUDA_CHECK(cudaStreamSynchronize(stream_));
  kernels::set_timeline(records.get());
  forward(tokens, nullptr);
  FP4MOE_CUDA_CHECK(cudaStreamSynchronize(stream_));
  kernels::set_timeline(nullptr);
  return records.download(stream_);
}

StageTimes LayerTimer::time_stages(int64_t tokens, int iterations, const L2Flusher& flusher) {
  FP4MOE_CHECK(iterations >= 1, "time_stages: iterations must be >= 1, not ", iterations);
  // Only events that delimit a stage that runs: every event adds its own gap.
  const bool separate_gather = MoeLayerInternals::separate_gather(layer_, tokens, buffers_->workspace.bytes());
  enum { kStart, kSorted, kGathered, kGemm1, kGemm2, kEnd, kNumEvents };
  std::vector<cudaEvent_t> events(static_cast<size_t>(iterations * kNumEvents));
  for (cudaEvent_t& e : events) FP4MOE_CUDA_CHECK(cudaEventCreate(&e));
  const auto event = [&](int i, int which) { return events[static_cast<size_t>(i * kNumEvents + which)]; };
  forward(tokens, nullptr);  // warm-up
  for (int i = 0; i < iterations; ++i) {
    flusher.flush(stream_);
    MoeStageEvents ev;
    ev.start = event(i, kStart);
    ev.sorted = event(i, kSorted);
    ev.gathered = separate_gather ? event(i, kGathered) : nullptr;
    ev.gemm1 = event(i, kGemm1);
    ev.gemm2 = event(i, kGemm2);
    ev.end = event(i, kEnd);
    forward(tokens, &ev);
  }
  FP4MOE_CUDA_CHECK(cudaStreamSynchronize(stream_));
  const auto stage_us = [&](int from, int to) {
    std::vector<float> ms(static_cast<size_t>(iterations));
    for (int i = 0; i < iterations; ++i)
      FP4MOE_CUDA_CHECK(cudaEventElapsedTime(&ms[static_cast<size_t>(i)], event(i, from), event(i, to)));
    return median(ms) * 1e3;
  };
  StageTimes t;
  t.route_sort_us = stage_us(kStart, kSorted);
  t.gather_us = separate_gather ? stage_us(kSorted, kGathered) : 0.0;
  t.gemm1_us = stage_us(separate_gather ? kGathered : kSorted, kGemm1);
  t.gemm2_us = stage_us(kGemm1, kGemm2);
  t.finalize_us = stage_us(kGemm2, kEnd);
  t.total_us = stage_us(kStart, kEnd);
  for (cudaEvent_t& e : events) cudaEventDestroy(e);
  return t;
}

LayerTimer::GraphTimes LayerTimer::time_graph(int64_t tokens, int iterations, const L2Flusher& flusher) {
  // NOTE: a forward that made a capture-unsafe call fails here, which is
  // part of what this measurement checks.
  cudaGraphExec_t exec = capture_graph(stream_, [&] { forward(tokens, nullptr); });
  GraphTimes t;
  try {
    const std::vector<double> us = time_interleaved_us(
        {[&] { FP4MOE_CUDA_CHECK(cudaGraphLaunch(exec, stream_)); }, [&] { forward(tokens, nullptr); }}, iterations,
        flusher, stream_);
    t.device_us = us[0];
    t.eager_us = us[1];
    std::vector<float> host(static_cast<size_t>(iterations));
    for (float& u : host) {
      const auto start = std::chrono::steady_clock::now();
      FP4MOE_CUDA_CHECK(cudaGraphLaunch(exec, stream_));
      u = std::chrono::duration<float, std::micro>(std::chrono::steady_clock::now() - start).count();
    }
    FP4MOE_CUDA_CHECK(cudaStreamSynchronize(stream_));
    t.launch_host_us = median(host);
  } catch (...) {
    cudaGraphExecDestroy(exec);
    throw;
  }
  cudaGraphExecDestroy(exec);
  return t;
}

namespace {
__global__ void empty_kernel(int) {}
}  // namespace

double launch_floor_us(int launches, bool programmatic, cudaStream_t stream, int calls) {
  auto launch_all = [&] {
    for (int i = 0; i < launches; ++i) kernels::launch_kernel(empty_kernel, 1, 32, 0, stream, programmatic, i);
  };
  launch_all();
  FP4MOE_CUDA_CHECK(cudaStreamSynchronize(stream));
  std::vector<float> us(static_cast<size_t>(calls));
  for (float& u : us) {
    const auto start = std::chrono::steady_clock::now();
    launch_all();
    u = std::chrono::duration<float, std::micro>(std::chrono::steady_clock::now() - start).count();
  }
  FP4MOE_CUDA_CHECK(cudaStreamSynchronize(stream));
  return median(us);
}

double LayerTimer::host_us_per_forward(int64_t tokens, int calls) {
  FP4MOE_CHECK(calls >= 1, "host_us_per_forward: calls must be >= 1, not ", calls);
  forward(tokens, nullptr);  // warm: plans cached, kernels loaded
  FP4MOE_CUDA_CHECK(cudaStreamSynchronize(stream_));
  std::vector<float> us(static_cast<size_t>(calls));
  for (float& u : us) {
    const auto start = std::chrono::steady_clock::now();
    forward(tokens, nullptr);
    u = std::chrono::duration<float, std::micro>(std::chrono::steady_clock::now() - start).count();
  }
  FP4MOE_CUDA_CHECK(cudaStreamSynchronize(stream_));
  return median(us);
}

int64_t LayerTimer::count_nonfinite_outputs(int64_t tokens) const {
  std::vector<uint16_t> out(static_cast<size_t>(tokens * layer_.hidden()));
  FP4MOE_CUDA_CHECK(
      cudaMemcpyAsync(out.data(), buffers_->output.get(), out.size() * 2, cudaMemcpyDeviceToHost, stream_));
  FP4MOE_CUDA_CHECK(cudaStreamSynchronize(stream_));
  return std::count_if(out.begin(), out.end(), [](uint16_t v) { return !std::isfinite(bf16_to_float(v)); });
}

std::string LayerTimer::device_errors() const { return layer_.device_errors(buffers_->workspace.get(), stream_); }

LayerMeasurement measure_layer(LayerTimer& timer, const MoeLayer& layer, int64_t tokens, int iterations,
                               bool with_graph, const Ceilings& ceilings, const L2Flusher& flusher) {
  LayerMeasurement m;
  m.tokens = tokens;
  m.expert_load = timer.expert_load(tokens);
  const auto roofline_at = [&](const Ceilings& c) {
    return layer_roofline(layer.hidden(), layer.inter(), tokens, tokens * layer.top_k(), m.expert_load.active, c);
  };
  m.roofline = roofline_at(ceilings);
  m.time_us = timer.time_forward_us(tokens, iterations, flusher);
  m.stages = timer.time_stages(tokens, iterations, flusher);
  if (with_graph) {
    const LayerTimer::GraphTimes graph = timer.time_graph(tokens, iterations, flusher);
    m.graph_us = graph.device_us;
    m.graph_eager_us = graph.eager_us;
    m.graph_launch_host_us = graph.launch_host_us;
    m.host_us = timer.host_us_per_forward(tokens, 50);
    // The launches alone: routing + sort, GEMM1, GEMM2, finalize.
    m.launch_floor_us = launch_floor_us(4, layer.options().programmatic_launch, nullptr, 50);
  }
  m.efficiency = m.roofline.roof_us / m.time_us;
  m.efficiency_sustained = roofline_at(ceilings.sustained()).roof_us / m.time_us;
  if (m.roofline.memory_bound(ceilings)) m.read_peer_us = time_stream_read_us(m.roofline.bytes(), iterations, flusher);
  m.nonfinite_outputs = timer.count_nonfinite_outputs(tokens);
  const std::string errors = timer.device_errors();
  FP4MOE_CHECK(errors.empty(), "the layer reported device errors: ", errors);
  return m;
}

// ------------------------------------------------------------------ bench

namespace {

// One forward's per-block spans: a JSON line per block (µs from the
// forward's first stamp) and a line per kernel in the table (its blocks,
// their first and last start, first and last end).
void write_timeline(const std::vector<kernels::TimelineRecord>& records, const LayerShape& shape, RouterLoad load,
                    int64_t tokens, std::ostream& table, std::ostream& out) {
  unsigned long long origin = ~0ull;
  for (const kernels::TimelineRecord& r : records) origin = std::min(origin, r.start);
  FP4MOE_CHECK(origin != ~0ull, "--timeline: no block stamped; the layer's kernels ran without timeline stamps");
  const auto us = [&](unsigned long long ns) { return static_cast<double>(ns - origin) / 1e3; };
  for (int k = 0; k < static_cast<int>(kernels::TimelineKernel::kCount); ++k) {
    const auto kernel = static_cast<kernels::TimelineKernel>(k);
    double first_start = 1e30, last_start = 0, first_end = 1e30, last_end = 0;
    int blocks = 0;
    for (int b = 0; b < kernels::kTimelineMaxBlocks; ++b) {
      const kernels::TimelineRecord& r = records[static_cast<size_t>(k * kernels::kTimelineMaxBlocks + b)];
      if (r.start == ~0ull) continue;
      ++blocks;
      first_start = std::min(first_start, us(r.start));
      last_start = std::max(last_start, us(r.start));
      first_end = std::min(first_end, us(r.end));
      last_end = std::max(last_end, us(r.end));
      out << nlohmann::json{{"kind", "timeline_block"}, {"model", shape.name},         {"router_load", to_string(load)},
                            {"tokens", tokens},         {"kernel", to_string(kernel)}, {"block", b},
                            {"start_us", us(r.start)},  {"end_us", us(r.end)}}
                 .dump()
          << "\n";
    }
    if (blocks == 0) continue;
    char line[200];
    std::snprintf(line, sizeof line, "  timeline %-12s %5d blocks: start %8.2f .. %8.2f us, end %8.2f .. %8.2f us\n",
                  to_string(kernel), blocks, first_start, last_start, first_end, last_end);
    table << line;
  }
  out << std::flush;
}

}  // namespace

void run_layer_bench(const LayerBenchOptions& opt, std::ostream& table, std::ostream* json) {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0)
    FP4MOE_THROW("fp4moe bench --layer needs a CUDA GPU; none was found");
  FP4MOE_CHECK(opt.iterations >= 1, "iterations must be >= 1, not ", opt.iterations);
  FP4MOE_CHECK(!opt.tokens.empty(), "no token counts to run");
  const int64_t max_tokens = *std::max_element(opt.tokens.begin(), opt.tokens.end());
  const L2Flusher flusher;
  const Ceilings ceil = measure_ceilings(flusher);
  const std::string gpu = gpu_name();
  const std::string date = today();
  table << "# " << gpu << ", " << date << ": " << ceil.describe() << "\n"
        << "# whole MoE layer (routing on the device), L2 flushed before each forward, medians of " << opt.iterations
        << "; roof = GEMM1 + GEMM2 + combine rooflines; stages in us; out% = time outside the GEMMs\n";
  table << "# routing load (--routing): uniform = random top-k; realistic = a fixed per-expert popularity, the "
           "hottest expert 2.5x the mean rows at T = 4096; skewed = N(0, 1) logits with a 0.1 N(0, 1) correction "
           "bias; hot = rows of the hottest expert / the mean, med = the median active expert's / the mean\n";
  if (opt.config)
    table << "# tile config forced for both GEMMs (--config): " << opt.config->to_string() << "; no row classes\n";
  table << "# sus = efficiency against the roofline at the sustained bf16 rate (the GPU at its power limit)\n";
  table << "model         variant                routing      T act   hot  med   time_us  graph_us   roof_us   eff  "
           "sus | "
           "route+sort gather    gemm1    gemm2  final |  out%\n";
  if (json) {
    *json << ceilings_json_line(gpu, date, ceil) << std::endl;
  }

  // The default variant first, then the same with plain launches (no
  // programmatic dependent launch) and with fp4 activations (W4A4: the
  // quantising gather and SwiGLU epilogue): those three get a graph replay
  // too. Then the default made batch invariant (no split-K), to show what
  // that costs, and without the fused decode kernel (separate launches at
  // every T).
  std::vector<Variant> variants;
  for (FinalizeMode finalize : {FinalizeMode::kDeterministic, FinalizeMode::kAtomic})
    for (GatherMode gather : {GatherMode::kAuto, GatherMode::kFused, GatherMode::kSeparate}) {
      Variant v;
      v.options.finalize = finalize;
      v.gather = gather;
      variants.push_back(v);
      if (variants.size() == 1) {
        Variant plain = v;
        plain.options.programmatic_launch = false;
        variants.push_back(plain);
        Variant w4a4 = v;
        w4a4.options.activations = ActivationNumerics::kFp4;
        variants.push_back(w4a4);
        Variant invariant = v;
        invariant.options.batch_invariant = true;
        variants.push_back(invariant);
        Variant unfused = v;
        unfused.options.fused_decode = false;
        variants.push_back(unfused);
      }
    }
  if (opt.default_only) variants.resize(1);  // deterministic finalize, automatic gather, PDL
  const MoeLayerOptions defaults;

  for (const LayerShape& shape : opt.models) {
    const MoeWeights weights = random_moe_weights(shape, opt.seed);
    for (size_t variant_index = 0; variant_index < variants.size(); ++variant_index) {
      const Variant& variant = variants[variant_index];
      MoeLayerOptions options = variant.options;
      options.activation = shape.activation;
      options.routing = shape.routing;
      options.gemm1_config = opt.config;
      options.gemm2_config = opt.config;
      // Graph replays for the default finalize and gather, with and without PDL.
      const bool is_default = options.finalize == defaults.finalize && variant.gather == GatherMode::kAuto &&
                              options.batch_invariant == defaults.batch_invariant;
      const MoeLayer layer = MoeLayerInternals::prepare(weights, options, variant.gather);
      for (RouterLoad load : opt.loads) {
        LayerTimer timer(layer, max_tokens, opt.seed, load);
        if (load == RouterLoad::kRealistic)
          table << "# " << shape.name << " realistic routing: logits N(0, 1) + " << timer.popularity_scale()
                << " z_e, z_e ~ N(0, 1) per expert\n";
        for (int64_t tokens : opt.tokens) {
          const bool with_graph = opt.with_graph && is_default;
          const LayerMeasurement m = measure_layer(timer, layer, tokens, opt.iterations, with_graph, ceil, flusher);
          const StageTimes& s = m.stages;
          char graph_text[32] = "-";
          if (with_graph) std::snprintf(graph_text, sizeof graph_text, "%.1f", m.graph_us);
          const std::string graph_us = graph_text;
          char line[512];
          const LayerTimer::ExpertLoad& el = m.expert_load;
          std::snprintf(
              line, sizeof line,
              "%-13s %-22s %-9s %6lld %3lld %5.2f %4.2f %9.1f %9s %9.1f %5.2f %4.2f | %10.1f %6.1f %8.1f %8.1f "
              "%6.1f | %4.0f%%\n",
              shape.name.c_str(), variant_name(options, variant.gather).c_str(), to_string(load).c_str(),
              static_cast<long long>(tokens), static_cast<long long>(m.roofline.active_experts),
              static_cast<double>(el.max_rows) / el.mean_rows, static_cast<double>(el.median_rows) / el.mean_rows,
              m.time_us, graph_us.c_str(), m.roofline.roof_us, m.efficiency, m.efficiency_sustained, s.route_sort_us,
              s.gather_us, s.gemm1_us, s.gemm2_us, s.finalize_us, 100.0 * s.outside_gemm_share());
          table << line;
          if (with_graph)
            table << "  graph replay " << m.graph_us << " us against eager forwards taken in turn with it "
                  << m.graph_eager_us << " us (" << m.graph_us / m.graph_eager_us << "x)\n"
                  << "  host time of one eager forward() call: " << m.host_us << " us (its 4 kernel launches alone, "
                  << "empty kernels: " << m.launch_floor_us << " us); of one graph replay: " << m.graph_launch_host_us
                  << " us\n";
          if (m.read_peer_us > 0)
            table << "  read peer: one streaming read of the layer's " << m.roofline.bytes() / 1e6 << " MB "
                  << m.read_peer_us << " us (roof / read " << m.roofline.roof_us / m.read_peer_us << ")\n";
          if (m.nonfinite_outputs > 0)
            table << "  WARNING: " << m.nonfinite_outputs << " output elements are NaN or infinite\n";
          if (opt.timeline && variant_index == 0)
            write_timeline(timer.timeline(tokens, flusher), shape, load, tokens, table, *opt.timeline);
          table << std::flush;
          if (json) {
            const MoeLayerPlan plan = layer.plan(tokens);
            nlohmann::json j{
                {"kind", "moe_layer"},
                {"gpu", gpu},
                {"date", date},
                {"model", shape.name},
                {"num_experts", shape.num_experts},
                {"top_k", shape.routing.top_k},
                {"hidden", shape.hidden},
                {"inter", shape.inter},
                {"routing", to_string(shape.routing.mode)},
                {"router_load", to_string(load)},
                {"popularity_scale", timer.popularity_scale()},
                {"expert_rows_mean", el.mean_rows},
                {"tokens", tokens},
                {"rows", m.roofline.rows},
                {"active_experts", m.roofline.active_experts},
                {"expert_rows_max", m.expert_load.max_rows},
                {"expert_rows_median", m.expert_load.median_rows},
                {"variant", variant_name(options, variant.gather)},
                {"finalize", to_string(options.finalize)},
                {"gather", to_string(variant.gather)},
                {"programmatic_launch", options.programmatic_launch},
                {"batch_invariant", options.batch_invariant},
                {"activations", to_string(layer.activation_numerics())},
                {"gemm1_config", plan.gemm1.config.to_string()},
                {"gemm1_split_k", plan.gemm1.split_k},
                {"gemm1_row_stages", describe_row_classes(plan.gemm1)},
                {"gemm2_config", plan.gemm2.config.to_string()},
                {"gemm2_split_k", plan.gemm2.split_k},
                {"gemm2_row_stages", describe_row_classes(plan.gemm2)},
                {"fused_decode", plan.fused_decode},
                {"time_us", m.time_us},
                {"graph_us", with_graph ? nlohmann::json(m.graph_us) : nlohmann::json(nullptr)},
                {"graph_eager_us", with_graph ? nlohmann::json(m.graph_eager_us) : nlohmann::json(nullptr)},
                {"host_us_per_forward", with_graph ? nlohmann::json(m.host_us) : nlohmann::json(nullptr)},
                {"graph_launch_host_us", with_graph ? nlohmann::json(m.graph_launch_host_us) : nlohmann::json(nullptr)},
                {"launch_floor_us", with_graph ? nlohmann::json(m.launch_floor_us) : nlohmann::json(nullptr)},
                {"roof_us", m.roofline.roof_us},
                {"gemm1_roof_us", m.roofline.gemm1_roof_us},
                {"gemm2_roof_us", m.roofline.gemm2_roof_us},
                {"combine_roof_us", m.roofline.combine_roof_us},
                {"efficiency", m.efficiency},
                {"efficiency_sustained", m.efficiency_sustained},
                {"read_peer_us", m.read_peer_us > 0 ? nlohmann::json(m.read_peer_us) : nlohmann::json(nullptr)},
                {"read_peer_efficiency",
                 m.read_peer_us > 0 ? nlohmann::json(m.roofline.roof_us / m.read_peer_us) : nlohmann::json(nullptr)},
                {"stage_us",
                 {{"route_sort", s.route_sort_us},
                  {"gather", s.gather_us},
                  {"gemm1", s.gemm1_us},
                  {"gemm2", s.gemm2_us},
                  {"finalize", s.finalize_us},
                  {"total", s.total_us}}},
                {"outside_gemm_share", s.outside_gemm_share()},
                {"nonfinite_outputs", m.nonfinite_outputs},
                {"copy_tbps", ceil.copy_bytes_per_s / 1e12},
                {"memory_tbps", ceil.memory_bytes_per_s() / 1e12},
                {"bf16_tflops", ceil.bf16_flops_per_s / 1e12},
                {"bf16_sustained_tflops", ceil.bf16_sustained_flops_per_s / 1e12},
                {"iterations", opt.iterations}};
            *json << j.dump() << std::endl;
          }
        }
      }
    }
  }
}

}  // namespace fp4moe::bench
