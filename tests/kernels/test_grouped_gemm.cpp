// GPU tests of the portable grouped GEMM against a double-precision CPU
// reference: enumerated expert counts, rows per expert (0, 1, 7, 8, 9, 31, 64,
// 100, 120, 130, 150), N and K at alignment edges, every compiled config forced, split-K,
// every fp4 code x every block scale, the W4A4 SwiGLU epilogue against the
// CPU activation quantiser, graph capture, device-side offset checks, and the
// shared-memory model against the compiled kernels.
// Outputs are poisoned (NaN) before each run so an unwritten element fails.
// Skipped with a message where no GPU exists.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <numeric>
#include <random>
#include <string>

#include "kernels/delayed_copy.hpp"
#include "kernels/grouped_gemm.hpp"
#include "fp4moe/nvfp4_activation.hpp"
#include "fp4moe/plan.hpp"
#include "gpu_test_util.hpp"
#include "plan/planner.hpp"
#include "plan/smem_model.hpp"

namespace fp4moe {
namespace {

// Whether `config`'s kernel family runs on this machine's GPU.
bool runs_here(const TileConfig& config) {
  ArchLimits arch;
  return local_arch_limits(&arch) && family_runs_on(config.family, arch.compute_capability);
}

// The compiled configs with the none epilogue (the fused epilogues are
// tested in tests/layer) that run on this GPU.
std::vector<TileConfig> configs_to_test() {
  std::vector<TileConfig> out;
  for (const TileConfig& c : compiled_configs())
    if (c.epilogue == Epilogue::kNone && runs_here(c)) out.push_back(c);
  return out;
}

// One small-tile config of each kernel family that runs here, for the tests
// of the launch machinery (graph capture, device-side checks) rather than of
// the tile shapes.
std::vector<TileConfig> one_config_per_family() {
  std::vector<TileConfig> out;
  for (KernelFamily family : {KernelFamily::kPortable, KernelFamily::kSm90})
    for (const TileConfig& c : configs_to_test())
      if (c.family == family && c.block_m >= 8 && c.block_m <= 32) {
        out.push_back(c);
        break;
      }
  return out;
}

struct GemmCase {
  int64_t n = 0;
  int64_t k = 0;
  std::vector<int32_t> rows_per_expert;
};

std::string describe(const GemmCase& c, const TileConfig& config, int split_k) {
  std::string rows;
  for (auto r : c.rows_per_expert) rows += (rows.empty() ? "" : ",") + std::to_string(r);
  return "n=" + std::to_string(c.n) + " k=" + std::to_string(c.k) + " rows=[" + rows +
         "] config=" + config.to_string() + " split_k=" + std::to_string(split_k);
}

// Everything for one problem: host data, device copies, the reference.
struct Problem {
  GemmCase shape;
  std::vector<Nvfp4Matrix> experts;
  PreparedGemmWeights prepared;
  std::vector<int32_t> offsets;
  std::vector<uint16_t> x;  // bf16 [rows, k]
  int64_t num_rows = 0;

  DeviceBuffer<uint8_t> d_weights, d_scales;
  DeviceBuffer<float> d_global;
  DeviceBuffer<uint16_t> d_x, d_y;
  DeviceBuffer<int32_t> d_offsets;

  Problem(const GemmCase& c, std::mt19937& rng) : shape(c) {
    const int64_t num_experts = static_cast<int64_t>(c.rows_per_expert.size());
    std::uniform_real_distribution<float> gs(0.002f, 0.02f);
    for (int64_t e = 0; e < num_experts; ++e) experts.push_back(testing::random_nvfp4(c.n, c.k, gs(rng), rng));
    std::vector<const Nvfp4Matrix*> ptrs;
    for (const auto& m : experts) ptrs.push_back(&m);
    prepared = prepare_gemm_weights(ptrs);
    offsets.assign(1, 0);
    for (auto r : c.rows_per_expert) offsets.push_back(offsets.back() + r);
    num_rows = offsets.back();
    x = testing::random_bf16(static_cast<size_t>(num_rows * c.k), rng);
    d_weights = DeviceBuffer<uint8_t>(prepared.weights);
    d_scales = DeviceBuffer<uint8_t>(prepared.scales);
    d_global = DeviceBuffer<float>(prepared.global_scales);
    d_x = DeviceBuffer<uint16_t>(x.empty() ? std::vector<uint16_t>(8) : x);
    d_y.resize(static_cast<size_t>(std::max<int64_t>(num_rows, 1) * c.n));
    d_offsets = DeviceBuffer<int32_t>(offsets);
  }

  GroupedGemmArgs args() const {
    GroupedGemmArgs a;
    a.weights = d_weights.get();
    a.scales = d_scales.get();
    a.global_scales = d_global.get();
    a.num_experts = static_cast<int64_t>(experts.size());
    a.n = shape.n;
    a.k = shape.k;
    a.x = d_x.get();
    a.expert_offsets = d_offsets.get();
    a.num_rows = num_rows;
    a.y = d_y.get();
    a.host_expert_offsets = offsets.data();
    return a;
  }

  // Y[row, j] = sum_k x[row, k] * W_e[j, k] in double.
  std::vector<double> reference() const {
    std::vector<double> ref(static_cast<size_t>(num_rows * shape.n), 0.0);
    for (size_t e = 0; e < experts.size(); ++e) {
      if (offsets[e + 1] == offsets[e]) continue;
      const std::vector<float> w = experts[e].dequantize();
      for (int64_t row = offsets[e]; row < offsets[e + 1]; ++row) {
        const uint16_t* xr = x.data() + row * shape.k;
        for (int64_t j = 0; j < shape.n; ++j) {
          const float* wr = w.data() + j * shape.k;
          double sum = 0.0;
          for (int64_t kk = 0; kk < shape.k; ++kk) sum += static_cast<double>(bf16_to_float(xr[kk])) * wr[kk];
          ref[static_cast<size_t>(row * shape.n + j)] = sum;
        }
      }
    }
    return ref;
  }

  std::vector<float> output() const {
    const std::vector<uint16_t> y = d_y.download();
    std::vector<float> out(static_cast<size_t>(num_rows * shape.n));
    for (size_t i = 0; i < out.size(); ++i) out[i] = bf16_to_float(y[i]);
    return out;
  }
};

// Runs one plan on a fresh poisoned output and checks it against the
// reference; `before_launch` may change the arguments and launch work ahead
// of the GEMM (on the default stream).
void run_and_check(Problem& prob, const GemmPlan& plan, const std::vector<double>& ref, const std::string& what,
                   const std::function<void(GroupedGemmArgs&)>& before_launch = {}) {
  const size_t ws_bytes = grouped_gemm_workspace_bytes(plan);
  DeviceBuffer<uint8_t> workspace(ws_bytes);
  workspace.fill_bytes(0);
  prob.d_y.fill_bytes(0xFF);  // bf16 0xFFFF is NaN: an unwritten element shows
  GroupedGemmArgs args = prob.args();
  args.workspace = workspace.get();
  args.workspace_bytes = ws_bytes;
  if (before_launch) before_launch(args);
  grouped_gemm(args, plan, nullptr);
  FP4MOE_CUDA_CHECK(cudaDeviceSynchronize());
  EXPECT_EQ(grouped_gemm_device_errors(workspace.get(), nullptr), "") << what;
  const testing::Comparison cmp = testing::compare(prob.output(), ref, prob.shape.n);
  EXPECT_EQ(cmp.num_unwritten, 0) << what << "\n" << cmp.first_bad;
  EXPECT_EQ(cmp.num_bad, 0) << what << "\n" << cmp.first_bad;
  EXPECT_LT(cmp.rel_err, 1e-2) << what;
  // Split-K counters must be back at zero for the next launch.
  if (plan.split_k > 1) {
    const std::vector<uint8_t> ws = workspace.download();
    for (int64_t t = 0; t < plan.max_tiles; ++t) {
      int32_t counter;
      std::memcpy(&counter, ws.data() + 16 + t * 4, 4);
      ASSERT_EQ(counter, 0) << what << ": split-K counter " << t << " not reset";
    }
  }
}

const std::vector<GemmCase>& enumerated_cases() {
  static const std::vector<GemmCase> cases = {
      {128, 256, {1}},
      {128, 256, {0, 1, 7, 8, 9}},
      {256, 512, {31, 0, 64, 100}},
      {16, 16, {3, 0, 5}},                // smallest legal n and k
      {144, 272, {9, 1, 0, 8}},           // n, k just past the padding multiples
      {48, 1072, {2, 65, 1}},             // k = 4 * 256 + 48
      {1040, 64, {33, 1, 17, 0, 0, 40}},  // n = 8 * 128 + 16
      {384, 2048, {1, 1, 1, 1, 1, 1, 1, 1}},
      {256, 512, {120, 130, 0, 150}},  // m160: 121-144 rows at 144 columns, 160 rows copied
  };
  return cases;
}

// Row classes (GemmPlan::row_classes): each launch takes the experts whose
// row count falls in its class, the main config the experts above the last,
// for every enumerated case (their row counts straddle the classes),
// against the reference; the main launch also split in K where K allows.
TEST(GroupedGemmGpu, RowClassesInSeveralLaunchesMatchReference) {
  FP4MOE_REQUIRE_GPU();
  const TileConfig heavy = TileConfig::parse("sm90n128m128k128s4w12");
  const TileConfig m16 = TileConfig::parse("sm90n128m16k128s7w12");
  const TileConfig m48 = TileConfig::parse("sm90n128m48k128s4w12");
  if (!runs_here(heavy)) GTEST_SKIP() << "the SM90 family does not run on this GPU";
  struct Classes {
    std::vector<std::pair<TileConfig, int>> row_classes;  // (config, max_rows)
    int split_k;
  };
  const Classes classes[] = {
      {{{m48, 1}}, 1}, {{{m48, 8}}, 1}, {{{m48, 48}}, 1}, {{{m16, 16}, {m48, 48}}, 1}, {{{m16, 16}, {m48, 48}}, 2}};
  std::mt19937 rng(4321);
  for (const GemmCase& c : enumerated_cases()) {
    Problem prob(c, rng);
    const std::vector<double> ref = prob.reference();
    for (const Classes& cl : classes) {
      const GroupedGemmArgs a = prob.args();
      const GemmProblem problem{a.num_experts, a.n, a.k, a.num_rows, 0, Epilogue::kNone};
      if (!split_k_allowed(problem, heavy, cl.split_k)) continue;
      GemmPlan plan = plan_grouped_gemm(problem, heavy, cl.split_k);
      std::string what = describe(c, heavy, cl.split_k) + ", classes";
      for (const auto& [config, max_rows] : cl.row_classes) {
        plan = with_row_class(plan, problem, config, max_rows);
        what += " " + config.to_string() + " <= " + std::to_string(max_rows);
      }
      run_and_check(prob, plan, ref, what);
    }
  }
}

TEST(GroupedGemmGpu, EveryCompiledConfigMatchesReference) {
  FP4MOE_REQUIRE_GPU();
  std::mt19937 rng(1234);
  for (const GemmCase& c : enumerated_cases()) {
    Problem prob(c, rng);
    const std::vector<double> ref = prob.reference();
    for (const TileConfig& config : configs_to_test()) {
      GemmPlan plan = plan_grouped_gemm(prob.args(), config);
      plan.split_k = 1;
      run_and_check(prob, plan, ref, describe(c, config, 1));
    }
  }
}

TEST(GroupedGemmGpu, SplitKMatchesReference) {
  FP4MOE_REQUIRE_GPU();
  std::mt19937 rng(99);
  const std::vector<GemmCase> cases = {{128, 2048, {1, 0, 3}}, {256, 1536, {17, 64, 2}}, {128, 4096, {100}}};
  for (const GemmCase& c : cases) {
    Problem prob(c, rng);
    const std::vector<double> ref = prob.reference();
    for (const TileConfig& config : configs_to_test()) {
      for (int split : {2, 3, 5}) {
        GemmPlan plan = plan_grouped_gemm(prob.args(), config);
        const int64_t k_tiles = (c.k + config.block_k - 1) / config.block_k;
        if (split > k_tiles) continue;
        plan.split_k = split;
        run_and_check(prob, plan, ref, describe(c, config, split));
      }
    }
  }
}

// The SM90 family copies contiguous activations with tensor maps (TMA) and
// gathered ones with cp.async: an identity gather takes the second path on
// the same rows, and must give the same bits (rows past an expert's are
// read by the first path but land in columns nobody stores).
TEST(GroupedGemmGpu, Sm90TensorMapAndGatheredCopiesGiveTheSameBits) {
  FP4MOE_REQUIRE_GPU();
  std::mt19937 rng(31);
  const std::vector<GemmCase> cases = {{256, 512, {31, 0, 64, 100}}, {144, 272, {9, 1, 0, 8}}, {128, 2048, {200, 3}}};
  for (const GemmCase& c : cases) {
    Problem prob(c, rng);
    std::vector<int32_t> identity(static_cast<size_t>(prob.num_rows));
    std::iota(identity.begin(), identity.end(), 0);
    const DeviceBuffer<int32_t> d_identity(identity);
    for (const TileConfig& config : configs_to_test()) {
      if (config.family != KernelFamily::kSm90) continue;
      for (int split : {1, 2}) {
        GemmPlan plan = plan_grouped_gemm(prob.args(), config);
        plan.split_k = split;
        const std::string what = describe(c, config, split);
        std::vector<uint16_t> outputs[2];
        for (int gathered = 0; gathered < 2; ++gathered) {
          DeviceBuffer<uint8_t> workspace(grouped_gemm_workspace_bytes(plan));
          workspace.fill_bytes(0);
          prob.d_y.fill_bytes(0xFF);
          GroupedGemmArgs args = prob.args();
          if (gathered) {
            args.gather_rows = d_identity.get();
            args.x_rows = prob.num_rows;
          }
          args.workspace = workspace.get();
          args.workspace_bytes = workspace.bytes();
          grouped_gemm(args, plan, nullptr);
          FP4MOE_CUDA_CHECK(cudaDeviceSynchronize());
          EXPECT_EQ(grouped_gemm_device_errors(workspace.get(), nullptr), "") << what;
          outputs[gathered] = prob.d_y.download();
        }
        EXPECT_TRUE(outputs[0] == outputs[1]) << what;
      }
    }
  }
}

// W4A4: the SwiGLU epilogue with act_quant_scales stores, bit for bit, what
// the CPU quantiser (nvfp4_activation.hpp) makes of the same epilogue's bf16
// output, in every compiled SwiGLU config of both families. The experts'
// input scales put their outputs' amax at 0.25x .. 1.75x of the calibrated
// range (the first saturates), and the last expert's divisor under 2^-100
// takes the quantiser's unpacked path.
TEST(GroupedGemmGpu, SwigluFp4OutputIsTheCpuQuantiserOfItsBf16Output) {
  FP4MOE_REQUIRE_GPU();
  std::mt19937 rng(77);
  const std::vector<GemmCase> cases = {{256, 512, {31, 0, 64, 100}}, {544, 272, {9, 1, 40, 8}}};
  int num_runs = 0;
  for (const GemmCase& c : cases) {
    Problem prob(c, rng);
    const int64_t num_experts = static_cast<int64_t>(c.rows_per_expert.size());
    const int64_t y_cols = c.n / 2;
    for (const TileConfig& compiled : compiled_configs()) {
      if (compiled.epilogue != Epilogue::kSwiglu || !runs_here(compiled)) continue;
      GemmPlan plan = plan_grouped_gemm(prob.args(), compiled, Epilogue::kSwiglu);
      plan.split_k = 1;
      const std::string what = describe(c, compiled, 1);
      DeviceBuffer<uint8_t> workspace(grouped_gemm_workspace_bytes(plan));
      workspace.fill_bytes(0);
      auto run = [&](const float* act_quant_scales) {
        prob.d_y.fill_bytes(0xFF);
        GroupedGemmArgs args = prob.args();
        args.act_quant_scales = act_quant_scales;
        args.workspace = workspace.get();
        args.workspace_bytes = workspace.bytes();
        grouped_gemm(args, plan, nullptr);
        FP4MOE_CUDA_CHECK(cudaDeviceSynchronize());
        EXPECT_EQ(grouped_gemm_device_errors(workspace.get(), nullptr), "") << what;
        std::vector<uint16_t> y = prob.d_y.download();
        y.resize(static_cast<size_t>(prob.num_rows * y_cols));
        return y;
      };
      const std::vector<uint16_t> bf16 = run(nullptr);
      std::vector<float> input_scales(static_cast<size_t>(num_experts), 1.0f);
      for (int64_t e = 0; e < num_experts; ++e) {
        float amax = 0.0f;
        for (int64_t i = prob.offsets[e] * y_cols; i < prob.offsets[e + 1] * y_cols; ++i)
          amax = std::max(amax, std::fabs(bf16_to_float(bf16[static_cast<size_t>(i)])));
        input_scales[static_cast<size_t>(e)] =
            e + 1 == num_experts ? 1e-33f : std::max(amax, 1e-6f) * (0.25f + 0.5f * static_cast<float>(e)) / 2688.0f;
      }
      const DeviceBuffer<float> d_input_scales(input_scales);
      const std::vector<uint16_t> fp4 = run(d_input_scales.get());
      int64_t num_bad = 0;
      for (int64_t e = 0; e < num_experts; ++e)
        for (int64_t row = prob.offsets[e]; row < prob.offsets[e + 1]; ++row)
          for (int64_t b = 0; b < y_cols; b += 16) {
            float block[16], unscaled[16];
            uint8_t codes[16];
            for (int i = 0; i < 16; ++i) block[i] = bf16_to_float(bf16[static_cast<size_t>(row * y_cols + b + i)]);
            nvfp4_act_quantize_block(block, input_scales[static_cast<size_t>(e)], codes, unscaled);
            for (int i = 0; i < 16; ++i) {
              const uint16_t got = fp4[static_cast<size_t>(row * y_cols + b + i)], want = float_to_bf16(unscaled[i]);
              if (got != want && ++num_bad <= 3)
                ADD_FAILURE() << what << ": row " << row << " feature " << b + i << ": got bf16 0x" << std::hex << got
                              << ", expected 0x" << want << std::dec << " (input " << block[i] << ")";
            }
          }
      EXPECT_EQ(num_bad, 0) << what;
      ++num_runs;
    }
  }
  EXPECT_GT(num_runs, 0) << "no compiled SwiGLU config runs on this GPU";
}

TEST(GroupedGemmGpu, PlannerChoiceMatchesReference) {
  FP4MOE_REQUIRE_GPU();
  std::mt19937 rng(7);
  // Shapes where the planner should pick split-K (few tiles, long K) and not.
  const std::vector<GemmCase> cases = {{256, 7168, {1, 1}}, {512, 256, {40, 300, 5}}};
  for (const GemmCase& c : cases) {
    Problem prob(c, rng);
    const GemmPlan plan = plan_grouped_gemm(prob.args());
    run_and_check(prob, plan, prob.reference(), describe(c, plan.config, plan.split_k));
  }
}

// Every fp4 code times every finite positive block scale comes out exact:
// one-hot activation rows read the weights back one by one.
TEST(GroupedGemmGpu, EveryCodeAndScaleDequantisesExactly) {
  FP4MOE_REQUIRE_GPU();
  const int64_t n = 128, k = 256;
  Nvfp4Matrix m;
  m.rows = n;
  m.cols = k;
  m.global_scale = 1.0f;  // outputs are then e2m1 * e4m3, exact in bf16
  m.packed.resize(n * k / 2);
  m.scales.resize(n * k / 16);
  for (int64_t i = 0; i < n * k / 2; ++i) m.packed[i] = static_cast<uint8_t>((i * 37 + (i >> 4)) & 0xFF);
  for (int64_t i = 0; i < n * k / 16; ++i) m.scales[i] = static_cast<uint8_t>(i % 127);  // 0x00..0x7E
  std::vector<const Nvfp4Matrix*> ptrs = {&m};
  const PreparedGemmWeights prepared = prepare_gemm_weights(ptrs);
  std::vector<uint16_t> x(k * k, 0);
  for (int64_t t = 0; t < k; ++t) x[t * k + t] = float_to_bf16(1.0f);
  DeviceBuffer<uint8_t> dw(prepared.weights), ds(prepared.scales);
  DeviceBuffer<float> dg(prepared.global_scales);
  DeviceBuffer<uint16_t> dx(x), dy(static_cast<size_t>(k * n));
  DeviceBuffer<int32_t> doff(std::vector<int32_t>{0, static_cast<int32_t>(k)});
  for (const TileConfig& config : configs_to_test()) {
    GroupedGemmArgs a;
    a.weights = dw.get();
    a.scales = ds.get();
    a.global_scales = dg.get();
    a.num_experts = 1;
    a.n = n;
    a.k = k;
    a.x = dx.get();
    a.expert_offsets = doff.get();
    a.num_rows = k;
    a.y = dy.get();
    GemmPlan plan = plan_grouped_gemm(a, config);
    plan.split_k = 1;
    DeviceBuffer<uint8_t> ws(grouped_gemm_workspace_bytes(plan));
    ws.fill_bytes(0);
    a.workspace = ws.get();
    a.workspace_bytes = ws.bytes();
    dy.fill_bytes(0xFF);
    grouped_gemm(a, plan, nullptr);
    FP4MOE_CUDA_CHECK(cudaDeviceSynchronize());
    const std::vector<uint16_t> y = dy.download();
    int mismatches = 0;
    for (int64_t t = 0; t < k && mismatches < 5; ++t) {
      for (int64_t j = 0; j < n && mismatches < 5; ++j) {
        const float expected = e2m1_to_float(m.code(j, t)) * e4m3_to_float(m.scale(j, t));
        const uint16_t got = y[t * n + j];
        if (bf16_to_float(got) != expected) {
          ++mismatches;
          ADD_FAILURE() << config.to_string() << ": W[" << j << "][" << t << "] code 0x" << std::hex
                        << int(m.code(j, t)) << " scale 0x" << int(m.scale(j, t)) << std::dec << ": got "
                        << bf16_to_float(got) << ", expected " << expected;
        }
      }
    }
  }
}

TEST(GroupedGemmGpu, GraphReplayEqualsEager) {
  FP4MOE_REQUIRE_GPU();
  std::mt19937 rng(5);
  Problem prob({256, 1024, {3, 0, 12, 1}}, rng);
  for (const TileConfig& config : one_config_per_family()) {
    SCOPED_TRACE(config.to_string());
    GemmPlan plan = plan_grouped_gemm(prob.args(), config);
    plan.split_k = 2;  // exercise the counters across replays
    DeviceBuffer<uint8_t> ws(grouped_gemm_workspace_bytes(plan));
    ws.fill_bytes(0);
    GroupedGemmArgs args = prob.args();
    args.workspace = ws.get();
    args.workspace_bytes = ws.size();
    cudaStream_t stream;
    FP4MOE_CUDA_CHECK(cudaStreamCreate(&stream));
    grouped_gemm(args, plan, stream);
    FP4MOE_CUDA_CHECK(cudaStreamSynchronize(stream));
    const std::vector<uint16_t> eager = prob.d_y.download();

    cudaGraph_t graph;
    cudaGraphExec_t exec;
    FP4MOE_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
    grouped_gemm(args, plan, stream);
    FP4MOE_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
    FP4MOE_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
    for (int replay = 0; replay < 3; ++replay) {
      prob.d_y.fill_bytes(0xFF);
      FP4MOE_CUDA_CHECK(cudaGraphLaunch(exec, stream));
      FP4MOE_CUDA_CHECK(cudaStreamSynchronize(stream));
      EXPECT_EQ(prob.d_y.download(), eager) << "replay " << replay;
    }
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
    cudaStreamDestroy(stream);
  }
}

// GroupedGemmArgs::indices_before_previous_kernel: the kernel may start
// copying weights while the kernel before it runs, but reads x only after
// it. Here that kernel lets the GEMM start at once and writes x 200 us
// later; x holds NaNs until then. Every portable config (the ones that copy
// early) and one SM90 config, unsplit and split in K.
TEST(GroupedGemmGpu, EarlyWeightCopiesWaitForThePreviousKernelsActivations) {
  FP4MOE_REQUIRE_GPU();
  std::vector<TileConfig> configs;
  for (const TileConfig& c : configs_to_test())
    if (c.family == KernelFamily::kPortable) configs.push_back(c);
  for (const TileConfig& c : one_config_per_family())
    if (c.family == KernelFamily::kSm90) configs.push_back(c);
  std::mt19937 rng(77);
  for (const GemmCase& c : {GemmCase{384, 2048, {1, 1, 1, 1, 1, 1, 1, 1}}, GemmCase{256, 512, {31, 0, 64, 100}}}) {
    Problem prob(c, rng);
    const std::vector<double> ref = prob.reference();
    DeviceBuffer<uint16_t> late_x(prob.x.size());
    for (const TileConfig& config : configs) {
      for (int split_k : {1, 2}) {
        const GroupedGemmArgs a = prob.args();
        const GemmProblem problem{a.num_experts, a.n, a.k, a.num_rows, 0, Epilogue::kNone};
        if (!split_k_allowed(problem, config, split_k)) continue;
        const GemmPlan plan = plan_grouped_gemm(problem, config, split_k);
        run_and_check(prob, plan, ref, describe(c, config, split_k) + ", x written late", [&](GroupedGemmArgs& args) {
          late_x.fill_bytes(0xFF);
          FP4MOE_CUDA_CHECK(cudaDeviceSynchronize());
          args.x = late_x.get();
          args.programmatic_launch = true;
          args.indices_before_previous_kernel = true;
          testing::launch_delayed_copy(prob.d_x.get(), late_x.get(), late_x.bytes(), 200'000, nullptr);
        });
      }
    }
  }
}

TEST(GroupedGemmGpu, DeviceFlagsMalformedOffsets) {
  FP4MOE_REQUIRE_GPU();
  std::mt19937 rng(11);
  Problem prob({128, 256, {4, 4, 4}}, rng);
  prob.d_offsets.upload({0, 8, 4, 12});  // not monotone
  GroupedGemmArgs args = prob.args();
  args.host_expert_offsets = nullptr;  // only the device sees them
  for (const TileConfig& config : one_config_per_family()) {
    SCOPED_TRACE(config.to_string());
    const GemmPlan plan = plan_grouped_gemm(args, config);
    DeviceBuffer<uint8_t> ws(grouped_gemm_workspace_bytes(plan));
    ws.fill_bytes(0);
    args.workspace = ws.get();
    args.workspace_bytes = ws.size();
    grouped_gemm(args, plan, nullptr);
    const std::string errors = grouped_gemm_device_errors(ws.get(), nullptr);
    EXPECT_NE(errors.find("not monotone"), std::string::npos) << errors;
  }
}

// The shared-memory model is what the compiled kernels use: nothing static
// outside it, the launch size equal to the model, no spills.
TEST(GroupedGemmGpu, SmemModelMatchesCompiledKernels) {
  FP4MOE_REQUIRE_GPU();
  for (const TileConfig& config : compiled_configs()) {
    if (!runs_here(config)) {
      std::printf("  %-24s not for this GPU (%s family)\n", config.to_string().c_str(),
                  to_string(config.family).c_str());
      continue;
    }
    const KernelAttributes attr = grouped_gemm_kernel_attributes(config);
    const SmemLayout layout = smem_layout(config);
    EXPECT_EQ(attr.static_smem_bytes, 0) << config.to_string();
    EXPECT_EQ(attr.max_dynamic_smem_bytes, layout.total_bytes) << config.to_string();
    EXPECT_LE(layout.total_bytes, config.family == KernelFamily::kPortable ? kPortableSmemLimit : kSmemLimitSm90)
        << config.to_string();
    EXPECT_EQ(attr.local_bytes, 0) << config.to_string() << " spills to local memory";
    EXPECT_GE(attr.blocks_per_sm, 1) << config.to_string();
    if (config.family == KernelFamily::kSm90)  // the blocks its registers are split for
      EXPECT_EQ(attr.blocks_per_sm, sm90_smem_layout(config).blocks_per_sm) << config.to_string();
    std::printf("  %-24s smem %6lld B (model %6lld B), %3d registers, %d blocks/SM\n", config.to_string().c_str(),
                static_cast<long long>(attr.max_dynamic_smem_bytes), static_cast<long long>(layout.total_bytes),
                attr.num_regs, attr.blocks_per_sm);
  }
}

}  // namespace
}  // namespace fp4moe
