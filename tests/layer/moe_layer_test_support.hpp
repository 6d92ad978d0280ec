// The shared ground of the GPU layer tests (tests/layer/test_moe_layer_*.cpp,
// one binary): scaled-down model shapes, their random weights and token
// batches with the CPU reference's outputs (made once per binary run),
// device copies of a batch, and forward/compare helpers. Outputs are
// poisoned (0xFF bytes, bf16 NaN) before every forward so an unwritten
// element fails. Router logits are drawn so that no routing decision is
// within 1e-3 of a tie: the device scores in fp32, the reference in double,
// and both must pick the same experts.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <map>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "fp4moe/cuda_check.hpp"
#include "fp4moe/moe_layer.hpp"
#include "fp4moe/reference.hpp"
#include "gpu_test_util.hpp"
#include "layer/moe_layer_internals.hpp"
#include "util/device_buffer.hpp"

namespace fp4moe {

// Readable test parameters in gtest's listing (found by ADL).
inline void PrintTo(FinalizeMode mode, std::ostream* os) { *os << to_string(mode); }
inline void PrintTo(GatherMode mode, std::ostream* os) { *os << to_string(mode); }

// ---------------------------------------------------------------- shapes

struct ModelShape {
  std::string name;  // letters, digits and '_' only (a gtest name)
  int64_t num_experts = 0;
  int64_t hidden = 0;
  int64_t inter = 0;
  RoutingParams routing;
  Activation activation = Activation::kSwiGLU;
  bool with_bias = false;
};

RoutingParams softmax_routing(int top_k, bool renormalize);
RoutingParams noaux_routing(int top_k, int num_groups, int topk_groups, float scaling);
RoutingParams gptoss_routing(int top_k);

// The models' expert counts and routing, hidden/inter scaled down so the CPU
// reference stays fast. 336, 272 and 208 are multiples of 16 but not of 128
// (hidden 336, 272: GEMM2's N and GEMM1's K edges; inter 272, 144, 208:
// GEMM1's N and GEMM2's K edges).
const std::vector<ModelShape>& model_shapes();

const ModelShape& shape_named(const std::string& name);

// Token counts every model runs: one token, fewer tokens than experts per
// token, a decode batch, and a prefill chunk far from any tile multiple.
inline constexpr int64_t kTokenCounts[] = {1, 3, 64, 1000};
inline constexpr int64_t kMaxTokens = 1000;

MoeLayerOptions layer_options(const ModelShape& shape, FinalizeMode finalize = FinalizeMode::kDeterministic);

// ------------------------------------------------------------- host data

std::vector<float> bf16_to_floats(const std::vector<uint16_t>& bits);

std::vector<float> normal_floats(size_t count, float stddev, std::mt19937& rng);

// Random weights in the quantised domain (every fp4 code, heavy-tailed block
// scales); gate and up share a global scale, as ModelOpt writes them. Global
// scales ~ 1/sqrt(K) keep the projections' outputs O(1).
MoeWeights random_weights(const ModelShape& shape, std::mt19937& rng);

// Router logits [num_tokens, num_experts], N(0, 1), each token redrawn until
// its routing_margin is at least kMinRoutingMargin.
inline constexpr double kMinRoutingMargin = 1e-3;
std::vector<float> draw_router_logits(int64_t num_tokens, int64_t num_experts,
                                      const std::vector<float>& correction_bias, const RoutingParams& params,
                                      std::mt19937& rng);

// The reference the layer is held to element by element: the CPU layer in
// double with the intermediate act(gate, up) rounded to bf16, as the GPU
// stores it (W4A16: GEMM2's activations are bf16), and the (token, slot)
// rows combined as the finalize mode does (reference_combine). Against the all-double
// reference a single element can miss by far more than the bf16 output
// rounding where large per-slot contributions cancel (the random weights
// have block scales up to 448); ModelMatrix checks the relative error
// against that reference too.
std::vector<float> reference_output(const MoeWeights& weights, const std::vector<uint16_t>& hidden_states,
                                    const Routing& routing, Activation activation,
                                    Intermediate intermediate = Intermediate::kBf16,
                                    Combine combine = Combine::kBf16Rows);

// The reference's combine for a finalize mode: the deterministic one sums
// bf16 rows, the atomic one fp32 rows (docs/design.md §3).
inline Combine reference_combine(FinalizeMode finalize) {
  return finalize == FinalizeMode::kAtomic ? Combine::kExact : Combine::kBf16Rows;
}

// One batch of tokens with its routing and reference output.
struct TokenBatch {
  int64_t num_tokens = 0;
  std::vector<uint16_t> hidden_states;  // bf16 [T, hidden]
  std::vector<float> router_logits;     // fp32 [T, num_experts]
  Routing routing;                      // route(router_logits): the reference's routing
  std::vector<float> reference;         // fp32 [T, hidden], bf16 intermediate, bf16 rows (deterministic)
  std::vector<float> reference_atomic;  // fp32 [T, hidden], bf16 intermediate, rows in double (atomic)
  std::vector<float> reference_exact;   // fp32 [T, hidden], all in double

  const std::vector<float>& reference_for(FinalizeMode finalize) const {
    return finalize == FinalizeMode::kAtomic ? reference_atomic : reference;
  }
};

// A model's weights and its batches, built once per test binary run.
struct ModelData {
  ModelShape shape;
  MoeWeights weights;
  std::vector<float> correction_bias;  // [num_experts], noaux_tc only
  std::mt19937 rng;
  std::map<int64_t, TokenBatch> batches;

  const float* bias_or_null() const { return correction_bias.empty() ? nullptr : correction_bias.data(); }

  // A fresh batch of T tokens (new random hidden states and logits).
  TokenBatch make_batch(int64_t num_tokens) {
    TokenBatch b;
    b.num_tokens = num_tokens;
    b.hidden_states = testing::random_bf16(static_cast<size_t>(num_tokens * shape.hidden), rng);
    b.router_logits = draw_router_logits(num_tokens, shape.num_experts, correction_bias, shape.routing, rng);
    b.routing = route(b.router_logits.data(), num_tokens, shape.num_experts, bias_or_null(), shape.routing);
    b.reference = reference_output(weights, b.hidden_states, b.routing, shape.activation);
    b.reference_atomic =
        reference_output(weights, b.hidden_states, b.routing, shape.activation, Intermediate::kBf16, Combine::kExact);
    b.reference_exact = reference_output(weights, b.hidden_states, b.routing, shape.activation, Intermediate::kExact);
    return b;
  }

  // The shared batch of T tokens, made on first use.
  const TokenBatch& batch(int64_t num_tokens) {
    auto it = batches.find(num_tokens);
    if (it == batches.end()) it = batches.emplace(num_tokens, make_batch(num_tokens)).first;
    return it->second;
  }
};

ModelData& model_data(const ModelShape& shape);

// -------------------------------------------------------------- device side

// A non-blocking stream: no implicit ordering with the legacy default stream,
// so every forward's work must be ordered on its own stream.
class Stream {
 public:
  Stream() { FP4MOE_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking)); }
  ~Stream() { cudaStreamDestroy(stream_); }
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
  cudaStream_t get() const { return stream_; }

 private:
  cudaStream_t stream_ = nullptr;
};

// Device copies of one batch's inputs, for device routing (logits) and for
// caller routing (ids and weights).
struct DeviceInputs {
  int64_t num_tokens = 0;
  DeviceBuffer<uint16_t> hidden_states;
  DeviceBuffer<float> router_logits;
  DeviceBuffer<float> correction_bias;
  DeviceBuffer<int32_t> topk_ids;
  DeviceBuffer<float> topk_weights;

  DeviceInputs(const std::vector<uint16_t>& hidden, const std::vector<float>& logits, const std::vector<float>& bias,
               const Routing& routing, int64_t tokens)
      : num_tokens(tokens),
        hidden_states(hidden),
        router_logits(logits),
        correction_bias(bias),
        topk_ids(routing.topk_ids),
        topk_weights(routing.topk_weights) {
    // The uploads ran on the legacy stream; the forwards run on non-blocking ones.
    FP4MOE_CUDA_CHECK(cudaDeviceSynchronize());
  }
  DeviceInputs(const TokenBatch& b, const std::vector<float>& bias)
      : DeviceInputs(b.hidden_states, b.router_logits, bias, b.routing, b.num_tokens) {}

  MoeForwardArgs device_routing() const {
    MoeForwardArgs a;
    a.hidden_states = hidden_states.get();
    a.num_tokens = num_tokens;
    a.router_logits = router_logits.get();
    a.correction_bias = correction_bias.get();  // null when empty
    return a;
  }
  MoeForwardArgs caller_routing() const {
    MoeForwardArgs a;
    a.hidden_states = hidden_states.get();
    a.num_tokens = num_tokens;
    a.topk_ids = topk_ids.get();
    a.topk_weights = topk_weights.get();
    return a;
  }
};

// One layer.forward() captured into a CUDA graph on `stream` (ended and
// released if the forward throws), replayed with launch(): a replay reads
// whatever the argument buffers hold then.
class ForwardGraph {
 public:
  ForwardGraph(const MoeLayer& layer, const MoeForwardArgs& args, void* output, const DeviceBuffer<uint8_t>& workspace,
               cudaStream_t stream);
  ~ForwardGraph();
  ForwardGraph(const ForwardGraph&) = delete;
  ForwardGraph& operator=(const ForwardGraph&) = delete;
  void launch(cudaStream_t stream) const { FP4MOE_CUDA_CHECK(cudaGraphLaunch(exec_, stream)); }

 private:
  cudaGraph_t graph_ = nullptr;
  cudaGraphExec_t exec_ = nullptr;
};

// A workspace for up to max_tokens tokens, zeroed once as the contract asks.
DeviceBuffer<uint8_t> make_workspace(const MoeLayer& layer, int64_t max_tokens);

// The first `count` elements of a downloaded output; checks that the rest of
// the (poisoned) buffer was left alone.
std::vector<uint16_t> output_rows(std::vector<uint16_t> all, size_t count);

// Poisons `output` (0xFF bytes: bf16 NaN), runs one forward on `stream`,
// waits, and returns the bf16 bits of the num_tokens output rows.
std::vector<uint16_t> forward_bits(const MoeLayer& layer, const MoeForwardArgs& args, DeviceBuffer<uint16_t>& output,
                                   const DeviceBuffer<uint8_t>& workspace, cudaStream_t stream);

// Checks a bf16 layer output against the reference: ||out - ref|| / ||ref||
// < 1e-2, every element within compare()'s atol + rtol |ref|, none
// unwritten. Returns the relative error for the log.
double expect_matches_reference(const std::vector<uint16_t>& out, const std::vector<float>& ref, int64_t hidden);

// Index of the first differing element, or -1: for bit-exact comparisons.
int64_t first_difference(const std::vector<uint16_t>& a, const std::vector<uint16_t>& b);

bool same_tile(const TileConfig& a, const TileConfig& b);

// The compiled tile shapes whose family runs on this GPU: compiled_configs()
// lists each once per epilogue, and the layer sets the epilogue itself.
std::vector<TileConfig> compiled_tiles();

// A layer's weights as the stacked device tensors of MoeDeviceWeights.
struct StackedDeviceWeights {
  DeviceBuffer<uint8_t> w13, w13_scale, w2, w2_scale;
  DeviceBuffer<float> w13_scale_2, w2_scale_2, w13_bias, w2_bias;
  MoeDeviceWeights view;

  // per_half: w13_scale_2 as [E, 2] = {gate, up}, else [E] (gate's).
  StackedDeviceWeights(const MoeWeights& w, bool per_half);
};

}  // namespace fp4moe
