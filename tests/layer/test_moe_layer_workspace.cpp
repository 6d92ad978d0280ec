// GPU tests of the MoE layer's workspace (include/fp4moe/moe_layer.hpp;
// src/layer/workspace.cpp): one workspace serves every token count up to its
// maximum, a too-small one is refused before any launch, and out-of-range
// expert ids are reported by device_errors() from the workspace header and
// skipped. The shapes, data and helpers:
// tests/layer/moe_layer_test_support.hpp. Skipped, visibly, where no GPU
// exists.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <string>
#include <tuple>
#include <vector>

#include "fp4moe/error.hpp"
#include "fp4moe/moe_layer.hpp"
#include "moe_layer_test_support.hpp"

namespace fp4moe {
namespace {

using ::testing::HasSubstr;

// ------------------------------------------------------------------ workspace

TEST(MoeLayerWorkspace, OneWorkspaceServesEveryTokenCountUpToItsMax) {
  FP4MOE_REQUIRE_GPU();
  const ModelShape& shape = shape_named("GLM45");
  ModelData& data = model_data(shape);
  const MoeLayer layer = MoeLayer::prepare(data.weights, layer_options(shape));
  EXPECT_LE(layer.workspace_bytes(1), layer.workspace_bytes(64));
  EXPECT_LE(layer.workspace_bytes(64), layer.workspace_bytes(kMaxTokens));
  Stream stream;
  const DeviceBuffer<uint8_t> workspace = make_workspace(layer, kMaxTokens);
  DeviceBuffer<uint16_t> output(static_cast<size_t>(kMaxTokens * shape.hidden));
  for (int64_t num_tokens : {kMaxTokens, int64_t{1}, int64_t{64}, int64_t{3}, kMaxTokens}) {
    SCOPED_TRACE("T=" + std::to_string(num_tokens) + " in a workspace for " + std::to_string(kMaxTokens));
    const TokenBatch& batch = data.batch(num_tokens);
    const DeviceInputs inputs(batch, data.correction_bias);
    expect_matches_reference(forward_bits(layer, inputs.device_routing(), output, workspace, stream.get()),
                             batch.reference, shape.hidden);
  }
}

// Refused before anything is launched (the poisoned output stays poisoned).
// For max_tokens = 1, workspace_bytes(1) is exactly what a 1-token forward
// needs, so one byte less must fail and the message must quote that number.
// For T = 1000 only sizes far below need are used: a forward of T tokens may
// need less than workspace_bytes(T), the maximum over all counts up to T.
TEST(MoeLayerWorkspace, TooSmallWorkspaceThrowsBeforeLaunch) {
  FP4MOE_REQUIRE_GPU();
  const ModelShape& shape = shape_named("GLM45");
  ModelData& data = model_data(shape);
  const MoeLayer layer = MoeLayer::prepare(data.weights, layer_options(shape));
  Stream stream;
  DeviceBuffer<uint16_t> output(static_cast<size_t>(kMaxTokens * shape.hidden));
  const size_t one_token_bytes = layer.workspace_bytes(1);

  struct Case {
    int64_t num_tokens;
    size_t given_bytes;
    bool quotes_need;  // the message must contain workspace_bytes(num_tokens)
  };
  const Case cases[] = {{1, 0, true},
                        {1, one_token_bytes / 2, true},
                        {1, one_token_bytes - 1, true},
                        {kMaxTokens, 0, false},
                        {kMaxTokens, one_token_bytes, false}};
  for (const Case& c : cases) {
    const size_t needed = layer.workspace_bytes(c.num_tokens);
    SCOPED_TRACE("T=" + std::to_string(c.num_tokens) + ": workspace of " + std::to_string(c.given_bytes) +
                 " bytes, workspace_bytes(T) = " + std::to_string(needed));
    const TokenBatch& batch = data.batch(c.num_tokens);
    const DeviceInputs inputs(batch, data.correction_bias);
    const DeviceBuffer<uint8_t> workspace = make_workspace(layer, c.num_tokens);
    output.fill_bytes(0xFF, stream.get());
    try {
      layer.forward(inputs.device_routing(), output.get(), workspace.get(), c.given_bytes, stream.get());
      ADD_FAILURE() << "forward accepted a workspace that is too small";
    } catch (const Error& e) {
      EXPECT_THAT(e.what(), HasSubstr("workspace"));
      if (c.quotes_need) EXPECT_THAT(e.what(), HasSubstr(std::to_string(needed)));
    }
    const std::vector<uint16_t> after = output.download(stream.get());
    EXPECT_EQ(std::count(after.begin(), after.end(), uint16_t{0xFFFF}), static_cast<std::ptrdiff_t>(after.size()))
        << "the output was written although forward threw";
    // The right size still works after the refusal.
    expect_matches_reference(forward_bits(layer, inputs.device_routing(), output, workspace, stream.get()),
                             batch.reference, shape.hidden);
  }
}

// ------------------------------------------------------------- device errors

// Ids outside [0, num_experts) in caller routing: their slots contribute
// nothing, every other (token, slot) is computed; device_errors reports them,
// except -1 (an absent slot, served by another rank).
TEST(MoeLayerDeviceErrors, OutOfRangeIdsAreReportedAndSkipped) {
  FP4MOE_REQUIRE_GPU();
  const ModelShape& shape = shape_named("Mixtral");
  ModelData& data = model_data(shape);
  const MoeLayer layer = MoeLayer::prepare(data.weights, layer_options(shape));
  const int64_t num_tokens = 64;
  const int top_k = shape.routing.top_k;
  const TokenBatch& batch = data.batch(num_tokens);
  Stream stream;
  DeviceBuffer<uint16_t> output(static_cast<size_t>(num_tokens * shape.hidden));

  // Runs caller routing `given`, checks the output against the reference on
  // `expected` (the skipped slots as a valid id with weight 0) and returns
  // device_errors(), which must then be clear (reported once).
  const auto run = [&](const Routing& given, const Routing& expected) {
    const DeviceBuffer<uint8_t> workspace = make_workspace(layer, num_tokens);
    const DeviceInputs inputs(batch.hidden_states, {}, {}, given, num_tokens);
    const std::vector<uint16_t> out = forward_bits(layer, inputs.caller_routing(), output, workspace, stream.get());
    expect_matches_reference(out, reference_output(data.weights, batch.hidden_states, expected, shape.activation),
                             shape.hidden);
    const std::string errors = layer.device_errors(workspace.get(), stream.get());
    EXPECT_EQ(layer.device_errors(workspace.get(), stream.get()), "") << "reported twice";
    return errors;
  };

  EXPECT_EQ(run(batch.routing, batch.routing), "") << "valid routing";
  {
    // Absent slots (-1: served by another rank) are skipped without an error.
    SCOPED_TRACE("absent slots");
    Routing given = batch.routing;
    Routing expected = batch.routing;
    for (int64_t token = 0; token < num_tokens; token += 3) {
      const size_t pair = static_cast<size_t>(token * top_k + token % top_k);
      given.topk_ids[pair] = -1;
      expected.topk_weights[pair] = 0.0f;  // the same expert, contributing nothing
    }
    EXPECT_EQ(run(given, expected), "");
  }

  // (token, slot, bad id); the reference gets a valid unused id with weight 0 there.
  const std::tuple<int64_t, int, int32_t> bad_slots[] = {
      {5, 1, static_cast<int32_t>(shape.num_experts)}, {17, 0, -2}, {63, top_k - 1, 1 << 20}};
  Routing given = batch.routing;
  Routing expected = batch.routing;
  for (const auto& [token, slot, bad_id] : bad_slots) {
    const size_t pair = static_cast<size_t>(token * top_k + slot);
    given.topk_ids[pair] = bad_id;
    int32_t unused = 0;
    while (std::find(expected.topk_ids.begin() + token * top_k, expected.topk_ids.begin() + (token + 1) * top_k,
                     unused) != expected.topk_ids.begin() + (token + 1) * top_k)
      ++unused;
    expected.topk_ids[pair] = unused;
    expected.topk_weights[pair] = 0.0f;
  }
  const std::string errors = run(given, expected);
  std::printf("  device_errors: %s\n", errors.c_str());
  EXPECT_NE(errors, "");
  std::string lower = errors;
  std::transform(lower.begin(), lower.end(), lower.begin(), [](unsigned char c) { return std::tolower(c); });
  EXPECT_THAT(lower, HasSubstr("expert"));
}

}  // namespace
}  // namespace fp4moe
