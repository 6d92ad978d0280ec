// GPU tests of MoeLayer at its limits and under misuse and faults
// (include/fp4moe/moe_layer.hpp, docs/reliability.md):
//   - non-finite router logits: their experts are excluded exactly as the CPU
//     reference does, and device_errors() reports them (docs/design.md §3);
//   - non-finite hidden states reach only their own token's output;
//   - token counts at and past 2^31 / top_k refused by plan, workspace_bytes
//     and forward before anything is allocated or launched; the workspace
//     contract (every count whose needs fit runs, one byte short is refused);
//   - the bounded plan cache;
//   - the device prepare() ran on is recorded, and a forward on another
//     device is refused (needs two GPUs; skipped, visibly, with one);
//   - cudaMalloc failing inside prepare(): an exception, no device memory
//     lost, and the process still usable.
// Skipped, visibly, where no GPU exists.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "expect_error.hpp"
#include "fp4moe/error.hpp"
#include "fp4moe/moe_layer.hpp"
#include "fp4moe/reference.hpp"
#include "gpu_test_util.hpp"
#include "layer/moe_layer_internals.hpp"
#include "util/parallel.hpp"

namespace fp4moe {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

constexpr uint16_t kPoisonBf16 = 0xFFFF;

struct Shape {
  int64_t num_experts = 16, hidden = 256, inter = 128;
  int top_k = 2;
};

// Random weights drawn in the quantised domain, seeded; global scales keep
// the projections O(1).
MoeWeights make_weights(const Shape& s, uint64_t seed) {
  MoeWeights w;
  w.num_experts = s.num_experts;
  w.hidden = s.hidden;
  w.inter = s.inter;
  w.experts.resize(static_cast<size_t>(s.num_experts));
  const float gate_up_scale = 0.1f / std::sqrt(static_cast<float>(s.hidden));
  const float down_scale = 0.1f / std::sqrt(static_cast<float>(s.inter));
  parallel_for(s.num_experts, [&](int64_t e) {
    ExpertWeights& x = w.experts[static_cast<size_t>(e)];
    const uint64_t base = seed * 1000003 + static_cast<uint64_t>(e) * 3;
    x.gate = testing::fast_random_nvfp4(s.inter, s.hidden, gate_up_scale, base);
    x.up = testing::fast_random_nvfp4(s.inter, s.hidden, gate_up_scale, base + 1);
    x.down = testing::fast_random_nvfp4(s.hidden, s.inter, down_scale, base + 2);
  });
  return w;
}

MoeLayerOptions softmax_options(int top_k) {
  MoeLayerOptions o;
  o.routing.mode = RoutingMode::kSoftmaxTopK;  // ranks by logit: fp32 and double agree
  o.routing.top_k = top_k;
  return o;
}

std::vector<float> bf16_to_floats(const std::vector<uint16_t>& bits) {
  std::vector<float> out(bits.size());
  for (size_t i = 0; i < bits.size(); ++i) out[i] = bf16_to_float(bits[i]);
  return out;
}

DeviceBuffer<uint8_t> make_workspace(const MoeLayer& layer, int64_t max_tokens) {
  DeviceBuffer<uint8_t> ws(layer.workspace_bytes(max_tokens));
  ws.fill_bytes(0);
  FP4MOE_CUDA_CHECK(cudaDeviceSynchronize());
  return ws;
}

// One forward on the legacy stream into a poisoned output; the output bits.
std::vector<uint16_t> run_forward(const MoeLayer& layer, const MoeForwardArgs& args, DeviceBuffer<uint8_t>& ws) {
  DeviceBuffer<uint16_t> out(static_cast<size_t>(args.num_tokens * layer.hidden()));
  out.fill_bytes(0xFF);
  layer.forward(args, out.get(), ws.get(), ws.bytes(), nullptr);
  return out.download();
}

size_t free_device_bytes() {
  size_t free_bytes = 0, total_bytes = 0;
  FP4MOE_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
  return free_bytes;
}

// ----------------------------------------------------- non-finite inputs

// Logits with NaN, +inf and -inf: token 0 has none finite, token 1 a single
// finite one (top_k = 2: its second slot weighs 0), tokens 2.. one
// non-finite logit each.
TEST(MoeLayerFaults, NonFiniteLogitsAreExcludedAndReported) {
  FP4MOE_REQUIRE_GPU();
  const Shape s;
  const MoeWeights weights = make_weights(s, 1);
  const MoeLayer layer = MoeLayer::prepare(weights, softmax_options(s.top_k));
  const int64_t T = 40;
  std::mt19937 rng(2);
  const std::vector<uint16_t> hidden = testing::random_bf16(static_cast<size_t>(T * s.hidden), rng);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> logits(static_cast<size_t>(T * s.num_experts));
  for (float& v : logits) v = normal(rng);
  const float kNonFinite[] = {NAN, INFINITY, -INFINITY};
  for (int64_t e = 0; e < s.num_experts; ++e) {
    logits[static_cast<size_t>(e)] = kNonFinite[e % 3];
    if (e != 5) logits[static_cast<size_t>(s.num_experts + e)] = kNonFinite[(e + 1) % 3];
  }
  for (int64_t t = 2; t < T; ++t)
    logits[static_cast<size_t>(t * s.num_experts + (t * 7) % s.num_experts)] = kNonFinite[t % 3];

  const Routing routing = route(logits.data(), T, s.num_experts, nullptr, softmax_options(s.top_k).routing);
  EXPECT_EQ(routing.tokens_with_nonfinite_logits, T);
  std::vector<float> ref(static_cast<size_t>(T * s.hidden));
  const std::vector<float> x = bf16_to_floats(hidden);
  moe_reference(weights, x.data(), routing, Activation::kSwiGLU, ref.data(), 0, Intermediate::kBf16,
                ActivationNumerics::kCheckpoint, Combine::kBf16Rows);  // the deterministic layer

  const DeviceBuffer<uint16_t> d_hidden(hidden);
  const DeviceBuffer<float> d_logits(logits);
  DeviceBuffer<uint8_t> ws = make_workspace(layer, T);
  MoeForwardArgs a;
  a.hidden_states = d_hidden.get();
  a.num_tokens = T;
  a.router_logits = d_logits.get();
  const std::vector<uint16_t> out = run_forward(layer, a, ws);
  // Token 0 routes nothing: exactly zero.
  for (int64_t i = 0; i < s.hidden; ++i) ASSERT_EQ(out[static_cast<size_t>(i)] & 0x7FFF, 0) << i;
  const testing::Comparison c =
      testing::compare(bf16_to_floats(out), std::vector<double>(ref.begin(), ref.end()), s.hidden);
  EXPECT_LT(c.rel_err, 1e-2) << c.first_bad;
  EXPECT_EQ(c.num_bad, 0) << c.first_bad;
  EXPECT_EQ(c.num_unwritten, 0) << c.first_bad;
  EXPECT_THAT(layer.device_errors(ws.get(), nullptr), HasSubstr("non-finite router logits"));

  // Finite logits: nothing to report (device_errors cleared the word).
  for (float& v : logits)
    if (!std::isfinite(v)) v = 0.5f;
  const DeviceBuffer<float> d_finite(logits);
  a.router_logits = d_finite.get();
  run_forward(layer, a, ws);
  EXPECT_EQ(layer.device_errors(ws.get(), nullptr), "");
}

TEST(MoeLayerFaults, NonFiniteHiddenStatesStayInTheirToken) {
  FP4MOE_REQUIRE_GPU();
  const Shape s;
  const MoeLayer layer = MoeLayer::prepare(make_weights(s, 3), softmax_options(s.top_k));
  const int64_t T = 12;
  std::mt19937 rng(4);
  std::vector<uint16_t> hidden = testing::random_bf16(static_cast<size_t>(T * s.hidden), rng);
  std::vector<int32_t> ids;
  std::vector<float> weights;
  for (int64_t t = 0; t < T; ++t) {
    ids.insert(ids.end(), {static_cast<int32_t>(t % s.num_experts), static_cast<int32_t>((t + 5) % s.num_experts)});
    weights.insert(weights.end(), {0.625f, 0.375f});
  }
  const DeviceBuffer<int32_t> d_ids(ids);
  const DeviceBuffer<float> d_weights(weights);
  DeviceBuffer<uint8_t> ws = make_workspace(layer, T);
  auto forward = [&](const std::vector<uint16_t>& h) {
    const DeviceBuffer<uint16_t> d_hidden(h);
    MoeForwardArgs a;
    a.hidden_states = d_hidden.get();
    a.num_tokens = T;
    a.topk_ids = d_ids.get();
    a.topk_weights = d_weights.get();
    return run_forward(layer, a, ws);
  };
  const std::vector<uint16_t> clean = forward(hidden);
  hidden[static_cast<size_t>(3 * s.hidden + 17)] = 0x7FC0;  // bf16 NaN
  hidden[static_cast<size_t>(8 * s.hidden + 0)] = 0x7F80;   // bf16 +inf
  const std::vector<uint16_t> dirty = forward(hidden);
  for (int64_t t = 0; t < T; ++t) {
    const size_t row = static_cast<size_t>(t * s.hidden);
    if (t == 3) {
      for (int64_t i = 0; i < s.hidden; ++i)
        EXPECT_TRUE(std::isnan(bf16_to_float(dirty[row + i]))) << "token 3 element " << i;
    } else if (t != 8) {
      EXPECT_TRUE(std::equal(clean.begin() + row, clean.begin() + row + s.hidden, dirty.begin() + row))
          << "token " << t << " changed because of another token's non-finite input";
    }
  }
  EXPECT_EQ(layer.device_errors(ws.get(), nullptr), "");
}

// ------------------------------------------------------------------ limits

TEST(MoeLayerLimits, TokenCountsPast2To31AreRefusedBeforeAllocating) {
  FP4MOE_REQUIRE_GPU();
  Shape s;
  s.top_k = 8;
  const MoeLayer layer = MoeLayer::prepare(make_weights(s, 5), softmax_options(s.top_k));
  const int64_t first_too_many = (int64_t{1} << 31) / s.top_k;  // T * top_k = 2^31
  EXPECT_THAT(error_of([&] { layer.plan(first_too_many); }),
              AllOf(HasSubstr("num_tokens = 268435456"), HasSubstr("2^31 / top_k")));
  EXPECT_THAT(error_of([&] { layer.workspace_bytes(first_too_many); }), HasSubstr("max_tokens = 268435456"));
  EXPECT_THAT(error_of([&] { layer.workspace_bytes(int64_t{1} << 62); }), HasSubstr("max_tokens"));
  // The largest count is planned and sized (tens of GiB, nothing allocated):
  // the size is exact, not wrapped at 32 bits.
  const int64_t largest = first_too_many - 1;
  EXPECT_EQ(layer.plan(largest).num_rows, largest * s.top_k);
  const size_t bytes = layer.workspace_bytes(largest);
  // (the bf16 (token, slot) rows alone)
  EXPECT_GE(bytes, static_cast<size_t>(largest * s.top_k) * static_cast<size_t>(s.hidden) * 2);

  DeviceBuffer<uint16_t> small(1024);
  DeviceBuffer<uint8_t> ws = make_workspace(layer, 4);
  MoeForwardArgs a;
  a.hidden_states = small.get();
  a.router_logits = reinterpret_cast<const float*>(small.get());
  for (const int64_t T : {first_too_many, int64_t{1} << 40, int64_t{-1}}) {
    a.num_tokens = T;
    EXPECT_THAT(error_of([&] { layer.forward(a, small.get(), ws.get(), ws.bytes(), nullptr); }),
                HasSubstr("num_tokens = " + std::to_string(T)));
  }
  // The largest valid count with a 4-token workspace: refused on size,
  // before any launch.
  a.num_tokens = largest;
  EXPECT_THAT(error_of([&] { layer.forward(a, small.get(), ws.get(), ws.bytes(), nullptr); }),
              AllOf(HasSubstr("workspace of " + std::to_string(ws.bytes()) + " B"),
                    HasSubstr(std::to_string(largest) + " tokens need")));
  FP4MOE_CUDA_CHECK(cudaDeviceSynchronize());
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
}

// The workspace contract (include/fp4moe/moe_layer.hpp, workspace_bytes): a
// workspace of workspace_bytes(N) serves every count up to N; any forward
// runs exactly when the bytes its own count needs fit, and is refused before
// anything is launched otherwise. Fails if the layer starts refusing counts
// that fit (a contract of "at most N tokens" would need a different test and
// different documentation) or runs a count that does not fit.
TEST(MoeLayerLimits, AWorkspaceServesExactlyTheCountsWhoseNeedsFit) {
  FP4MOE_REQUIRE_GPU();
  const Shape s;
  const MoeLayer layer = MoeLayer::prepare(make_weights(s, 6), softmax_options(s.top_k));
  const int64_t max_tokens = 64;
  DeviceBuffer<uint8_t> ws = make_workspace(layer, max_tokens);
  for (int64_t t = 1; t <= max_tokens; ++t)
    ASSERT_LE(MoeLayerInternals::min_forward_bytes(layer, t), ws.bytes()) << t << " tokens";

  const int64_t largest = 4096;
  std::mt19937 rng(7);
  const DeviceBuffer<uint16_t> hidden(testing::random_bf16(static_cast<size_t>(largest * s.hidden), rng));
  std::vector<float> logits(static_cast<size_t>(largest * s.num_experts));
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (float& v : logits) v = normal(rng);
  const DeviceBuffer<float> d_logits(logits);
  MoeForwardArgs a;
  a.hidden_states = hidden.get();
  a.router_logits = d_logits.get();
  // One forward into a poisoned output: whether it was refused, and whether
  // every output element was written.
  struct Outcome {
    bool refused;
    bool all_written;
    bool none_written;
    std::string error;
  };
  const auto forward = [&](int64_t T, const DeviceBuffer<uint8_t>& w, size_t given_bytes) {
    DeviceBuffer<uint16_t> out(static_cast<size_t>(T * s.hidden));
    out.fill_bytes(0xFF);
    FP4MOE_CUDA_CHECK(cudaDeviceSynchronize());
    a.num_tokens = T;
    Outcome o{};
    try {
      layer.forward(a, out.get(), w.get(), given_bytes, nullptr);
    } catch (const Error& e) {
      o.refused = true;
      o.error = e.message();
    }
    FP4MOE_CUDA_CHECK(cudaDeviceSynchronize());
    const std::vector<uint16_t> bits = out.download();
    o.all_written = std::none_of(bits.begin(), bits.end(), [](uint16_t v) { return v == kPoisonBf16; });
    o.none_written = std::all_of(bits.begin(), bits.end(), [](uint16_t v) { return v == kPoisonBf16; });
    return o;
  };

  for (const int64_t T : {int64_t{1}, int64_t{37}, max_tokens, max_tokens + 1, int64_t{256}, largest}) {
    SCOPED_TRACE(std::to_string(T) + " tokens into workspace_bytes(" + std::to_string(max_tokens) + ")");
    const bool fits = MoeLayerInternals::min_forward_bytes(layer, T) <= ws.bytes();
    if (T <= max_tokens) EXPECT_TRUE(fits);
    if (T == largest) ASSERT_FALSE(fits) << "the test needs a count that does not fit";
    const Outcome o = forward(T, ws, ws.bytes());
    EXPECT_EQ(o.refused, !fits) << o.error;
    if (fits) {
      EXPECT_TRUE(o.all_written);
    } else {
      EXPECT_THAT(o.error, AllOf(HasSubstr("workspace of " + std::to_string(ws.bytes()) + " B"),
                                 HasSubstr(std::to_string(T) + " tokens need"),
                                 HasSubstr("allocate workspace_bytes(max_tokens)")));
      EXPECT_TRUE(o.none_written) << "a refused forward launched something";
    }
  }
  EXPECT_EQ(layer.device_errors(ws.get(), nullptr), "");

  // A workspace one byte short of what 256 tokens need is refused before any
  // launch; the exact size runs. The buffer is the exact size, so a forward
  // that wrote past what it was given would also show under memcheck.
  const size_t need = MoeLayerInternals::min_forward_bytes(layer, 256);
  DeviceBuffer<uint8_t> exact(need);
  exact.fill_bytes(0);
  const Outcome short_one = forward(256, exact, need - 1);
  EXPECT_TRUE(short_one.refused);
  EXPECT_THAT(short_one.error, AllOf(HasSubstr("workspace of " + std::to_string(need - 1) + " B"),
                                     HasSubstr("256 tokens need " + std::to_string(need) + " B")));
  EXPECT_TRUE(short_one.none_written) << "a refused forward launched something";
  const Outcome enough = forward(256, exact, need);
  EXPECT_FALSE(enough.refused) << enough.error;
  EXPECT_TRUE(enough.all_written);
  EXPECT_EQ(layer.device_errors(exact.get(), nullptr), "");
}

// Every token count planned once: the cache stays within its bound, and
// evicted counts are planned again to the same plan.
TEST(MoeLayerLimits, PlanCacheIsBounded) {
  FP4MOE_REQUIRE_GPU();
  const Shape s;
  const MoeLayer layer = MoeLayer::prepare(make_weights(s, 8), softmax_options(s.top_k));
  const size_t capacity = MoeLayer::plan_cache_capacity();
  const MoeLayerPlan first = layer.plan(1);
  for (int64_t t = 1; t <= static_cast<int64_t>(capacity) + 300; ++t) {
    layer.plan(t);
    ASSERT_LE(layer.cached_plans(), capacity) << "after planning " << t << " token counts";
  }
  EXPECT_EQ(layer.cached_plans(), capacity);
  const MoeLayerPlan again = layer.plan(1);  // evicted long ago
  EXPECT_EQ(again.describe(), first.describe());
  // Sizing a workspace plans many counts but caches none of them.
  MoeLayer fresh = MoeLayer::prepare(make_weights(s, 8), softmax_options(s.top_k));
  fresh.workspace_bytes(4096);
  EXPECT_EQ(fresh.cached_plans(), 0u);
}

// ------------------------------------------------------------------ device

TEST(MoeLayerDevice, RecordsTheDevicePrepareRanOn) {
  FP4MOE_REQUIRE_GPU();
  int device = -1;
  FP4MOE_CUDA_CHECK(cudaGetDevice(&device));
  const Shape s;
  MoeLayer layer = MoeLayer::prepare(make_weights(s, 9), softmax_options(s.top_k));
  EXPECT_EQ(layer.device(), device);
  const MoeLayer moved = std::move(layer);
  EXPECT_EQ(moved.device(), device);
}

TEST(MoeLayerDevice, ForwardOnAnotherDeviceIsRefused) {
  FP4MOE_REQUIRE_GPU();
  int count = 0;
  FP4MOE_CUDA_CHECK(cudaGetDeviceCount(&count));
  if (count < 2) GTEST_SKIP() << "needs two CUDA devices, this machine has " << count;
  const Shape s;
  const MoeWeights weights = make_weights(s, 10);
  const int64_t T = 9;
  std::mt19937 rng(11);
  const std::vector<uint16_t> hidden = testing::random_bf16(static_cast<size_t>(T * s.hidden), rng);
  std::vector<float> logits(static_cast<size_t>(T * s.num_experts));
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (float& v : logits) v = normal(rng);

  // On device 0: the layer, its inputs and workspace, one reference forward.
  FP4MOE_CUDA_CHECK(cudaSetDevice(0));
  const MoeLayer layer0 = MoeLayer::prepare(weights, softmax_options(s.top_k));
  ASSERT_EQ(layer0.device(), 0);
  const DeviceBuffer<uint16_t> hidden0(hidden);
  const DeviceBuffer<float> logits0(logits);
  DeviceBuffer<uint8_t> ws0 = make_workspace(layer0, T);
  MoeForwardArgs a;
  a.hidden_states = hidden0.get();
  a.num_tokens = T;
  a.router_logits = logits0.get();
  const std::vector<uint16_t> on0 = run_forward(layer0, a, ws0);

  // Device 1 current: refused, naming both devices; nothing launched.
  FP4MOE_CUDA_CHECK(cudaSetDevice(1));
  DeviceBuffer<uint16_t> out0_on_1(static_cast<size_t>(T * s.hidden));
  EXPECT_THAT(error_of([&] { layer0.forward(a, out0_on_1.get(), ws0.get(), ws0.bytes(), nullptr); }),
              AllOf(HasSubstr("current CUDA device is 1"), HasSubstr("on device 0"), HasSubstr("cudaSetDevice(0)")));
  EXPECT_THAT(error_of([&] { layer0.device_errors(ws0.get(), nullptr); }), HasSubstr("current CUDA device is 1"));

  // A layer prepared on device 1 runs there, to the same bits.
  const MoeLayer layer1 = MoeLayer::prepare(weights, softmax_options(s.top_k));
  EXPECT_EQ(layer1.device(), 1);
  const DeviceBuffer<uint16_t> hidden1(hidden);
  const DeviceBuffer<float> logits1(logits);
  DeviceBuffer<uint8_t> ws1 = make_workspace(layer1, T);
  a.hidden_states = hidden1.get();
  a.router_logits = logits1.get();
  const std::vector<uint16_t> on1 = run_forward(layer1, a, ws1);
  EXPECT_EQ(on1, on0);
  EXPECT_EQ(layer1.device_errors(ws1.get(), nullptr), "");
  FP4MOE_CUDA_CHECK(cudaSetDevice(0));
  EXPECT_EQ(layer0.device_errors(ws0.get(), nullptr), "");
}

// ------------------------------------------------------------ out of memory

// The device filled by one allocation that leaves room for the gate/up
// weights but not the down weights: prepare() throws, frees what it had
// uploaded (free memory is what it was before), leaves no CUDA error behind,
// and once the filler is gone the same weights prepare and run.
TEST(MoeLayerFaults, PrepareOutOfMemoryThrowsAndLeaksNothing) {
  FP4MOE_REQUIRE_GPU();
  Shape s;
  s.num_experts = 32;
  s.hidden = 2048;
  s.inter = 1024;  // ~100 MB of device weights
  const MoeWeights weights = make_weights(s, 12);
  size_t weight_bytes = 0;
  {  // Warm-up: the context, module loading and the planner's device query
     // take their memory now, not during the measured attempt.
    const MoeLayer warm = MoeLayer::prepare(weights, softmax_options(s.top_k));
    weight_bytes = warm.device_weight_bytes();
    DeviceBuffer<uint8_t> ws = make_workspace(warm, 4);
    const DeviceBuffer<uint16_t> hidden(static_cast<size_t>(4 * s.hidden));
    std::vector<int32_t> ids(8, 1);
    for (size_t i = 0; i < ids.size(); i += 2) ids[i] = 0;
    const DeviceBuffer<int32_t> d_ids(ids);
    const DeviceBuffer<float> d_w(std::vector<float>(8, 0.5f));
    MoeForwardArgs a;
    a.hidden_states = hidden.get();
    a.num_tokens = 4;
    a.topk_ids = d_ids.get();
    a.topk_weights = d_w.get();
    run_forward(warm, a, ws);
  }
  FP4MOE_CUDA_CHECK(cudaDeviceSynchronize());

  // Leave 80% of the weights free: gate/up (about 2/3) fit, down does not.
  const size_t leave = weight_bytes * 8 / 10;
  const size_t free_now = free_device_bytes();
  ASSERT_GT(free_now, leave + (size_t{256} << 20));
  void* filler = nullptr;
  FP4MOE_CUDA_CHECK(cudaMalloc(&filler, free_now - leave));
  const size_t free_before = free_device_bytes();
  std::printf("  filler %.1f GiB, %zu MB free, the layer needs %zu MB\n",
              static_cast<double>(free_now - leave) / (1 << 30), free_before >> 20, weight_bytes >> 20);

  const std::string message = error_of([&] { MoeLayer::prepare(weights, softmax_options(s.top_k)); });
  EXPECT_THAT(message, AllOf(HasSubstr("cudaMalloc"), HasSubstr("cudaErrorMemoryAllocation")));
  EXPECT_EQ(free_device_bytes(), free_before) << "prepare() leaked device memory on failure";
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);

  FP4MOE_CUDA_CHECK(cudaFree(filler));
  const MoeLayer layer = MoeLayer::prepare(weights, softmax_options(s.top_k));
  const int64_t T = 5;
  std::mt19937 rng(13);
  const DeviceBuffer<uint16_t> hidden(testing::random_bf16(static_cast<size_t>(T * s.hidden), rng));
  std::vector<float> logits(static_cast<size_t>(T * s.num_experts));
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (float& v : logits) v = normal(rng);
  const DeviceBuffer<float> d_logits(logits);
  DeviceBuffer<uint8_t> ws = make_workspace(layer, T);
  MoeForwardArgs a;
  a.hidden_states = hidden.get();
  a.num_tokens = T;
  a.router_logits = d_logits.get();
  const std::vector<uint16_t> bits = run_forward(layer, a, ws);
  EXPECT_TRUE(std::none_of(bits.begin(), bits.end(), [](uint16_t v) { return v == kPoisonBf16; }));
  EXPECT_EQ(layer.device_errors(ws.get(), nullptr), "");
}

}  // namespace
}  // namespace fp4moe
