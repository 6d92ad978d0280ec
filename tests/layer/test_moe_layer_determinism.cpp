// GPU tests of what the MoE layer's forward keeps fixed
// (include/fp4moe/moe_layer.hpp; src/layer/forward.cpp): bit-identical
// repeats, the same bits from either gather and from plain launches, batch
// invariance (a slice of a batch run alone gives the same bits),
// forward_pair_rows (the rows the deterministic finalize sums), atomic
// forwards within tolerance, CUDA-graph capture and replay with new inputs,
// and two host threads on one layer. The shapes, data and helpers:
// tests/layer/moe_layer_test_support.hpp. Skipped, visibly, where no GPU
// exists.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "fp4moe/error.hpp"
#include "fp4moe/moe_layer.hpp"
#include "moe_layer_test_support.hpp"

namespace fp4moe {
namespace {

// -------------------------------------------------------------- determinism

TEST(MoeLayerDeterminism, DeterministicForwardsAreBitIdentical) {
  FP4MOE_REQUIRE_GPU();
  for (const std::string name : {"DeepSeekV3", "GptOss"}) {
    const ModelShape& shape = shape_named(name);
    ModelData& data = model_data(shape);
    const TokenBatch& batch = data.batch(kMaxTokens);
    const DeviceInputs inputs(batch, data.correction_bias);
    for (GatherMode gather : {GatherMode::kFused, GatherMode::kSeparate}) {
      SCOPED_TRACE(shape.name + " " + to_string(gather));
      const MoeLayer layer =
          MoeLayerInternals::prepare(data.weights, layer_options(shape, FinalizeMode::kDeterministic), gather);
      Stream stream;
      const DeviceBuffer<uint8_t> workspace = make_workspace(layer, kMaxTokens);
      DeviceBuffer<uint16_t> output(static_cast<size_t>(kMaxTokens * shape.hidden));
      const std::vector<uint16_t> first = forward_bits(layer, inputs.device_routing(), output, workspace, stream.get());
      expect_matches_reference(first, batch.reference, shape.hidden);
      for (int run = 1; run < 5; ++run) {
        const std::vector<uint16_t> again =
            forward_bits(layer, inputs.device_routing(), output, workspace, stream.get());
        EXPECT_EQ(first_difference(first, again), -1) << "run " << run << " differs from run 0";
      }
    }
  }
}

// GatherMode::kAuto gathers separately where GEMM1's plan reads its
// activations by tensor map (here an SM90 m128 tile, forced), and falls back
// to the fused gather where the workspace lacks room for the sorted copy
// (sizes from workspace_bytes() may hold it anyway: split-K partials of
// smaller counts can need more); all three modes give the same bits.
TEST(MoeLayerDeterminism, AutoGatherMatchesFusedAndSeparateBits) {
  FP4MOE_REQUIRE_GPU();
  ArchLimits arch;
  if (!local_arch_limits(&arch) || !family_runs_on(KernelFamily::kSm90, arch.compute_capability))
    GTEST_SKIP() << "needs an SM90 GPU for the tensor-mapped GEMM1 tile";
  const ModelShape& shape = shape_named("DeepSeekV3");
  ModelData& data = model_data(shape);
  const TokenBatch& batch = data.batch(kMaxTokens);
  const DeviceInputs inputs(batch, data.correction_bias);
  MoeLayerOptions options = layer_options(shape, FinalizeMode::kDeterministic);
  options.gemm1_config = TileConfig::parse("sm90n128m128k128s4w12");
  Stream stream;
  DeviceBuffer<uint16_t> output(static_cast<size_t>(kMaxTokens * shape.hidden));
  std::vector<uint16_t> bits[3];
  const GatherMode modes[3] = {GatherMode::kFused, GatherMode::kSeparate, GatherMode::kAuto};
  for (int i = 0; i < 3; ++i) {
    const MoeLayer layer = MoeLayerInternals::prepare(data.weights, options, modes[i]);
    const DeviceBuffer<uint8_t> workspace = make_workspace(layer, kMaxTokens);
    EXPECT_EQ(MoeLayerInternals::separate_gather(layer, kMaxTokens, workspace.bytes()), modes[i] != GatherMode::kFused)
        << to_string(modes[i]);
    bits[i] = forward_bits(layer, inputs.device_routing(), output, workspace, stream.get());
    EXPECT_EQ(first_difference(bits[i], bits[0]), -1) << to_string(modes[i]) << " differs from fused";
    if (modes[i] == GatherMode::kAuto) {
      expect_matches_reference(bits[i], batch.reference, shape.hidden);
      // The smallest workspace with room for the sorted copy (found by
      // bisection), and one 256 B short of it: there auto runs fused.
      size_t lo = 0, hi = workspace.bytes();
      while (hi - lo > 1) {
        const size_t mid = lo + (hi - lo) / 2;
        (MoeLayerInternals::separate_gather(layer, kMaxTokens, mid) ? hi : lo) = mid;
      }
      const DeviceBuffer<uint8_t> short_of_it = [&] {
        DeviceBuffer<uint8_t> ws(hi - 256);
        ws.fill_bytes(0);
        FP4MOE_CUDA_CHECK(cudaDeviceSynchronize());
        return ws;
      }();
      EXPECT_FALSE(MoeLayerInternals::separate_gather(layer, kMaxTokens, short_of_it.bytes()));
      EXPECT_EQ(
          first_difference(forward_bits(layer, inputs.device_routing(), output, short_of_it, stream.get()), bits[0]),
          -1)
          << "auto with a workspace short of the sorted copy differs from fused";
    }
  }
}

// Programmatic dependent launch changes when kernels start, never what they
// compute: plain launches give the same bits, eagerly and from a graph, at
// decode sizes (routing and sort in one kernel) and at kMaxTokens (two).
TEST(MoeLayerDeterminism, PlainLaunchesGiveTheSameBits) {
  FP4MOE_REQUIRE_GPU();
  const ModelShape& shape = shape_named("DeepSeekV3");
  ModelData& data = model_data(shape);
  MoeLayerOptions plain_options = layer_options(shape);
  plain_options.programmatic_launch = false;
  const MoeLayer layer = MoeLayer::prepare(data.weights, layer_options(shape));
  const MoeLayer plain = MoeLayer::prepare(data.weights, plain_options);
  ASSERT_TRUE(layer.options().programmatic_launch);
  Stream stream;
  const DeviceBuffer<uint8_t> workspace = make_workspace(layer, kMaxTokens);
  DeviceBuffer<uint16_t> output(static_cast<size_t>(kMaxTokens * shape.hidden));
  for (int64_t num_tokens : {int64_t{1}, int64_t{64}, kMaxTokens}) {
    SCOPED_TRACE("T=" + std::to_string(num_tokens));
    const TokenBatch& batch = data.batch(num_tokens);
    const DeviceInputs inputs(batch, data.correction_bias);
    const std::vector<uint16_t> with_pdl =
        forward_bits(layer, inputs.device_routing(), output, workspace, stream.get());
    expect_matches_reference(with_pdl, batch.reference, shape.hidden);
    const std::vector<uint16_t> without = forward_bits(plain, inputs.device_routing(), output, workspace, stream.get());
    EXPECT_EQ(first_difference(with_pdl, without), -1) << "plain launches differ";

    // The same forward captured in a graph (programmatic edges) and replayed.
    output.fill_bytes(0xFF, stream.get());
    const ForwardGraph graph(layer, inputs.device_routing(), output.get(), workspace, stream.get());
    for (int replay = 0; replay < 3; ++replay) graph.launch(stream.get());
    const std::vector<uint16_t> replayed = output_rows(output.download(stream.get()), with_pdl.size());
    EXPECT_EQ(first_difference(with_pdl, replayed), -1) << "graph replay differs";
  }
}

// Batch invariance: with MoeLayerOptions::batch_invariant, slices of a
// 512-token batch run on their own (1, 3 and 64 tokens, at different
// offsets) give exactly the bits of the same tokens in the full forward,
// although the planner picks other tiles for them. The shape (16 experts,
// top 4, hidden 512, inter 4096: GEMM2 has 16 tiles at T = 1, far fewer than
// the SMs, and a K long enough for two slices of kMinSplitKSliceK) is one
// where the default plan splits K at T = 1,
// so the option has something to undo; how many tokens
// the default layer changes is printed, not asserted (split-K may round the
// same way by chance). A 3-token slice is checked against the reference.
TEST(MoeLayerBatchInvariance, TokenOutputsDoNotDependOnTheBatch) {
  FP4MOE_REQUIRE_GPU();
  const ModelShape shape{"SplitK", 16, 512, 4096, softmax_routing(4, true)};
  constexpr int64_t kTokens = 512;
  std::mt19937 rng(2026);
  const MoeWeights weights = random_weights(shape, rng);
  const std::vector<uint16_t> hidden_states = testing::random_bf16(static_cast<size_t>(kTokens * shape.hidden), rng);
  const std::vector<float> logits = draw_router_logits(kTokens, shape.num_experts, {}, shape.routing, rng);
  const Routing routing = route(logits.data(), kTokens, shape.num_experts, nullptr, shape.routing);
  const DeviceInputs inputs(hidden_states, logits, {}, routing, kTokens);

  MoeLayerOptions invariant_options = layer_options(shape);
  invariant_options.batch_invariant = true;
  const MoeLayer invariant = MoeLayer::prepare(weights, invariant_options);
  const MoeLayer plain = MoeLayer::prepare(weights, layer_options(shape));
  ASSERT_GT(std::max(plain.plan(1).gemm1.split_k, plain.plan(1).gemm2.split_k), 1)
      << "this test needs a shape whose default plan splits K at T = 1";
  for (int64_t t : {int64_t{1}, int64_t{3}, int64_t{64}, kTokens}) {
    EXPECT_EQ(invariant.plan(t).gemm1.split_k, 1) << "T=" << t;
    EXPECT_EQ(invariant.plan(t).gemm2.split_k, 1) << "T=" << t;
  }
  // The tiles a plan runs: its row classes' and its main config's.
  const auto same_tiles = [](const GemmPlan& a, const GemmPlan& b) {
    if (!same_tile(a.config, b.config) || a.row_classes.size() != b.row_classes.size()) return false;
    for (size_t i = 0; i < a.row_classes.size(); ++i)
      if (!same_tile(a.row_classes[i].config, b.row_classes[i].config)) return false;
    return true;
  };
  EXPECT_FALSE(same_tiles(invariant.plan(1).gemm1, invariant.plan(kTokens).gemm1) &&
               same_tiles(invariant.plan(1).gemm2, invariant.plan(kTokens).gemm2))
      << "the slices should run other tiles than the full batch";

  Stream stream;
  const DeviceBuffer<uint8_t> workspace = make_workspace(invariant, kTokens);
  const DeviceBuffer<uint8_t> plain_workspace = make_workspace(plain, kTokens);
  DeviceBuffer<uint16_t> output(static_cast<size_t>(kTokens * shape.hidden));
  const std::vector<uint16_t> full_invariant =
      forward_bits(invariant, inputs.device_routing(), output, workspace, stream.get());
  const std::vector<uint16_t> full_plain =
      forward_bits(plain, inputs.device_routing(), output, plain_workspace, stream.get());

  const int64_t H = shape.hidden, E = shape.num_experts;
  struct Slice {
    int64_t first, count;
  };
  for (const Slice slice : {Slice{0, 1}, Slice{317, 1}, Slice{511, 1}, Slice{10, 3}, Slice{400, 64}}) {
    SCOPED_TRACE("tokens [" + std::to_string(slice.first) + ", " + std::to_string(slice.first + slice.count) + ")");
    const auto rows = [&](const auto& all, int64_t width) {
      using Vec = std::decay_t<decltype(all)>;
      return Vec(all.begin() + slice.first * width, all.begin() + (slice.first + slice.count) * width);
    };
    const std::vector<uint16_t> hidden = rows(hidden_states, H);
    const Routing part_routing = route(rows(logits, E).data(), slice.count, E, nullptr, shape.routing);
    const DeviceInputs part(hidden, rows(logits, E), {}, part_routing, slice.count);
    const std::vector<uint16_t> got = forward_bits(invariant, part.device_routing(), output, workspace, stream.get());
    EXPECT_EQ(first_difference(got, rows(full_invariant, H)), -1)
        << "batch-invariant layer: the slice differs from the same tokens in the full batch";
    if (slice.count == 3)
      expect_matches_reference(got, reference_output(weights, hidden, part_routing, shape.activation), H);
    const std::vector<uint16_t> got_plain =
        forward_bits(plain, part.device_routing(), output, plain_workspace, stream.get());
    const std::vector<uint16_t> want_plain = rows(full_plain, H);
    int64_t differing_tokens = 0;
    for (int64_t t = 0; t < slice.count; ++t)
      differing_tokens +=
          !std::equal(got_plain.begin() + t * H, got_plain.begin() + (t + 1) * H, want_plain.begin() + t * H);
    std::printf(
        "  default layer (split-K %d/%d at T = %lld, %d/%d at T = %lld): %lld of %lld "
        "tokens differ from the full batch\n",
        plain.plan(slice.count).gemm1.split_k, plain.plan(slice.count).gemm2.split_k,
        static_cast<long long>(slice.count), plain.plan(kTokens).gemm1.split_k, plain.plan(kTokens).gemm2.split_k,
        static_cast<long long>(kTokens), static_cast<long long>(differing_tokens), static_cast<long long>(slice.count));
  }
}

// forward_pair_rows: the bf16 (token, slot) rows, widened and summed in slot
// order in fp32 from 0.0f on the host and rounded once, are forward()'s
// output bits; absent slots (-1) are left untouched; the atomic mode refuses.
TEST(MoeLayerPairRows, SlotOrderSumOfThePairRowsIsTheForwardOutput) {
  FP4MOE_REQUIRE_GPU();
  const ModelShape& shape = shape_named("GptOss");  // with biases
  ModelData& data = model_data(shape);
  const MoeLayer layer = MoeLayer::prepare(data.weights, layer_options(shape));
  const int64_t T = 64, H = shape.hidden;
  const int k = shape.routing.top_k;
  Routing given = data.batch(T).routing;
  for (int64_t t = 0; t < T; t += 5) given.topk_ids[static_cast<size_t>(t * k + t % k)] = -1;
  const DeviceInputs inputs(data.batch(T).hidden_states, {}, {}, given, T);
  Stream stream;
  const DeviceBuffer<uint8_t> workspace = make_workspace(layer, T);
  DeviceBuffer<uint16_t> output(static_cast<size_t>(T * H));
  const std::vector<uint16_t> want = forward_bits(layer, inputs.caller_routing(), output, workspace, stream.get());

  DeviceBuffer<uint16_t> pair_rows(static_cast<size_t>(T * k * H));  // bf16
  pair_rows.fill_bytes(0xFF);                                        // NaN: absent slots must keep it
  FP4MOE_CUDA_CHECK(cudaDeviceSynchronize());
  layer.forward_pair_rows(inputs.caller_routing(), pair_rows.get(), workspace.get(), workspace.bytes(), stream.get());
  const std::vector<uint16_t> rows = pair_rows.download(stream.get());
  int64_t bad = 0;
  for (int64_t t = 0; t < T; ++t)
    for (int64_t c = 0; c < H; ++c) {
      float sum = 0.0f;
      for (int j = 0; j < k; ++j) {
        const uint16_t v = rows[static_cast<size_t>((t * k + j) * H + c)];
        if (given.topk_ids[static_cast<size_t>(t * k + j)] == -1)
          bad += v != 0xFFFF;  // untouched
        else
          sum += bf16_to_float(v);
      }
      bad += float_to_bf16(sum) != want[static_cast<size_t>(t * H + c)];
    }
  EXPECT_EQ(bad, 0) << "pair rows that do not sum to forward()'s bits, or absent rows written";

  const MoeLayer atomic = MoeLayer::prepare(data.weights, layer_options(shape, FinalizeMode::kAtomic));
  EXPECT_THROW(atomic.forward_pair_rows(inputs.caller_routing(), pair_rows.get(), workspace.get(), workspace.bytes(),
                                        stream.get()),
               Error);
}

// Repeated atomic forwards, with the token count changing in between, each
// within tolerance: the accumulation buffer must be cleared for the next one.
TEST(MoeLayerDeterminism, AtomicForwardsStayWithinTolerance) {
  FP4MOE_REQUIRE_GPU();
  const ModelShape& shape = shape_named("Qwen3_30B");
  ModelData& data = model_data(shape);
  const MoeLayer layer = MoeLayer::prepare(data.weights, layer_options(shape, FinalizeMode::kAtomic));
  Stream stream;
  const DeviceBuffer<uint8_t> workspace = make_workspace(layer, kMaxTokens);
  DeviceBuffer<uint16_t> output(static_cast<size_t>(kMaxTokens * shape.hidden));
  for (int64_t num_tokens : {kMaxTokens, int64_t{64}, kMaxTokens, kMaxTokens, int64_t{3}, kMaxTokens}) {
    SCOPED_TRACE("T=" + std::to_string(num_tokens));
    const TokenBatch& batch = data.batch(num_tokens);
    const DeviceInputs inputs(batch, data.correction_bias);
    const std::vector<uint16_t> out = forward_bits(layer, inputs.device_routing(), output, workspace, stream.get());
    expect_matches_reference(out, batch.reference, shape.hidden);
  }
}

// ---------------------------------------------------------------- CUDA graph

// One forward captured once, replayed with new contents in the same input
// buffers: new hidden states with the old logits, then new logits too (so the
// routing, and every expert's row count, changes under the graph).
TEST(MoeLayerGraph, ReplaysWithNewInputsEqualEagerForwards) {
  FP4MOE_REQUIRE_GPU();
  const ModelShape& shape = shape_named("DeepSeekV3");
  ModelData& data = model_data(shape);
  const int64_t num_tokens = 64;
  const TokenBatch a = data.make_batch(num_tokens);
  const TokenBatch b = data.make_batch(num_tokens);
  struct Replay {
    const char* what;
    const std::vector<uint16_t>* hidden;
    const std::vector<float>* logits;
  };
  const Replay replays[] = {{"inputs A", &a.hidden_states, &a.router_logits},
                            {"hidden B, logits A", &b.hidden_states, &a.router_logits},
                            {"inputs B", &b.hidden_states, &b.router_logits}};

  const MoeLayer layer = MoeLayer::prepare(data.weights, layer_options(shape));
  Stream stream;
  const DeviceBuffer<uint8_t> workspace = make_workspace(layer, num_tokens);
  DeviceBuffer<uint16_t> output(static_cast<size_t>(num_tokens * shape.hidden));

  std::vector<std::vector<uint16_t>> eager;
  for (const Replay& r : replays) {
    const DeviceInputs inputs(*r.hidden, *r.logits, data.correction_bias, Routing{}, num_tokens);
    eager.push_back(forward_bits(layer, inputs.device_routing(), output, workspace, stream.get()));
  }
  expect_matches_reference(eager[0], a.reference, shape.hidden);
  expect_matches_reference(eager[2], b.reference, shape.hidden);

  const DeviceInputs live(a.hidden_states, a.router_logits, data.correction_bias, Routing{}, num_tokens);
  const ForwardGraph graph(layer, live.device_routing(), output.get(), workspace, stream.get());

  for (size_t i = 0; i < std::size(replays); ++i) {
    SCOPED_TRACE(std::string("replay with ") + replays[i].what);
    const std::vector<uint16_t>& hidden = *replays[i].hidden;
    const std::vector<float>& logits = *replays[i].logits;
    FP4MOE_CUDA_CHECK(cudaMemcpyAsync(live.hidden_states.get(), hidden.data(), hidden.size() * sizeof(uint16_t),
                                      cudaMemcpyHostToDevice, stream.get()));
    FP4MOE_CUDA_CHECK(cudaMemcpyAsync(live.router_logits.get(), logits.data(), logits.size() * sizeof(float),
                                      cudaMemcpyHostToDevice, stream.get()));
    output.fill_bytes(0xFF, stream.get());
    graph.launch(stream.get());
    const std::vector<uint16_t> replayed = output.download(stream.get());
    EXPECT_EQ(first_difference(replayed, eager[i]), -1) << "the replay differs from the eager forward";
  }
  EXPECT_EQ(layer.device_errors(workspace.get(), stream.get()), "");
}

// ------------------------------------------------------------- two threads

TEST(MoeLayerThreads, TwoThreadsTwoStreamsOneLayer) {
  FP4MOE_REQUIRE_GPU();
  const ModelShape& shape = shape_named("Qwen3_30B");
  ModelData& data = model_data(shape);
  const MoeLayer layer = MoeLayer::prepare(data.weights, layer_options(shape));

  // Thread 0 routes 1000 tokens on the device; thread 1 gives 64 tokens' routing.
  struct Job {
    const TokenBatch* batch;
    bool device_routing;
    std::unique_ptr<DeviceInputs> inputs;
    std::vector<uint16_t> eager;
    int num_mismatches = 0;
  };
  Job jobs[2] = {{&data.batch(kMaxTokens), true, nullptr, {}, 0}, {&data.batch(64), false, nullptr, {}, 0}};
  for (Job& job : jobs) {
    job.inputs = std::make_unique<DeviceInputs>(*job.batch, data.correction_bias);
    Stream stream;
    const DeviceBuffer<uint8_t> workspace = make_workspace(layer, job.batch->num_tokens);
    DeviceBuffer<uint16_t> output(static_cast<size_t>(job.batch->num_tokens * shape.hidden));
    const MoeForwardArgs args = job.device_routing ? job.inputs->device_routing() : job.inputs->caller_routing();
    job.eager = forward_bits(layer, args, output, workspace, stream.get());
    expect_matches_reference(job.eager, job.batch->reference, shape.hidden);
  }

  constexpr int kForwardsPerThread = 8;
  auto run = [&](Job& job) {
    Stream stream;
    const DeviceBuffer<uint8_t> workspace = make_workspace(layer, job.batch->num_tokens);
    DeviceBuffer<uint16_t> output(static_cast<size_t>(job.batch->num_tokens * shape.hidden));
    const MoeForwardArgs args = job.device_routing ? job.inputs->device_routing() : job.inputs->caller_routing();
    for (int i = 0; i < kForwardsPerThread; ++i)
      if (first_difference(forward_bits(layer, args, output, workspace, stream.get()), job.eager) != -1)
        ++job.num_mismatches;
  };
  std::thread other(run, std::ref(jobs[1]));
  run(jobs[0]);
  other.join();
  EXPECT_EQ(jobs[0].num_mismatches, 0) << "thread 0 (T=1000, device routing) differs from its eager result";
  EXPECT_EQ(jobs[1].num_mismatches, 0) << "thread 1 (T=64, caller routing) differs from its eager result";
}

}  // namespace
}  // namespace fp4moe
