// MoeLayer's state (include/fp4moe/moe_layer.hpp) and what its source files
// share. Internal (not under include/). The layer's parts, one role each:
//
//   weights.cpp    the checks of a layer's shape, weights and shared expert,
//                  and the shared expert's chunks
//   upload.cpp     prepare(), prepare_device(), load(): packing and upload
//   planning.cpp   a forward's plan per token count: forced, tuned or heuristic
//   workspace.cpp  the workspace (header, scratch, sizing) and the gather choice
//   forward.cpp    the forward's launches and device_errors()
//
// A shared expert runs as extra experts of the same grouped GEMMs: its
// intermediate dimension is cut into chunks of the routed experts' width
// (exact: SwiGLU is per intermediate column and down_proj sums over them;
// every chunk keeps the shared expert's global scales), appended as experts
// E .. E + c - 1, and every token gets c more slots for them, weighted 1 or
// sigmoid(gate · x), so a forward has T * (top_k + c) rows.
//
// Tested in tests/layer/ (the GPU layer against the CPU reference, host
// validation, faults).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "fp4moe/moe_layer.hpp"
#include "layer/moe_layer_internals.hpp"
#include "layer/plan_cache.hpp"
#include "plan/planner.hpp"
#include "tune/tune.hpp"
#include "util/device_buffer.hpp"

namespace fp4moe {

namespace layer {

// Token counts whose plans are kept; the least recently used goes first.
inline constexpr size_t kPlanCacheCapacity = 1024;

// Workspace alignment of every scratch region.
inline constexpr size_t kAlign = 256;
// Header: [layer error word, routing arrival counter | GEMM1 error word |
// GEMM2 error word] (16 B each), then the GEMM1 and GEMM2 split-K counters
// (kMaxSplitKTiles each: limit_split_k runs larger plans unsplit), which
// the fused decode kernel, whose units are never split, takes as its
// counters (2 kMaxSplitKTiles). All zero between forwards.
inline constexpr size_t kErrorWordsBytes = 48;
inline constexpr size_t kHeaderBytes = (kErrorWordsBytes + 2 * kMaxSplitKTiles * 4 + kAlign - 1) / kAlign * kAlign;

// Token counts are limited to T * top_k < 2^31 (rows are int on the device);
// compared as T < ceil(2^31 / top_k) so that no product can overflow.
inline int64_t max_tokens_for(int top_k) { return ((int64_t{1} << 31) + top_k - 1) / top_k; }

// One GEMM's packed weights on the device.
struct DeviceGemmWeights {
  DeviceBuffer<uint8_t> weights;
  DeviceBuffer<uint8_t> scales;
  DeviceBuffer<float> global_scales;
  size_t bytes() const { return weights.bytes() + scales.bytes() + global_scales.bytes(); }
};

// Byte offsets of one forward's scratch, after the header.
struct ScratchLayout {
  size_t topk_ids = 0, topk_weights = 0, offsets = 0, token_of_row = 0, pair_of_row = 0, sort_scratch = 0;
  size_t x_sorted = 0, activated = 0, finalize = 0, gemm1_ws = 0, gemm2_ws = 0;
  size_t gemm1_ws_bytes = 0, gemm2_ws_bytes = 0;
  size_t end = 0;
};

// weights.cpp: what prepare() and prepare_device() check before touching the
// GPU, each refusal one fp4moe::Error saying what was wrong.
//
// The rules on a layer's shape and options, whichever way its weights come.
void validate_shape(int64_t num_experts, int64_t hidden, int64_t inter, const MoeLayerOptions& o);
// The number of chunks of the routed experts' width the shared expert is
// cut into (0 without one), after checking that it can be.
int shared_chunks(const MoeWeights& w, const MoeLayerOptions& o);
// Chunk j of the shared expert as an expert of the routed width: gate and
// up rows [j I, (j+1) I), down columns [j I, (j+1) I).
ExpertWeights shared_chunk(const SharedExpertWeights& sh, int64_t inter, int64_t j);
// Everything prepare() checks on host weights: the shape, the shared
// expert, every expert's matrices, global scales and biases.
void validate_weights(const MoeWeights& w, const MoeLayerOptions& o);
// W4A4 input scales, as the quantiser needs them (the loader also bounds them).
void check_input_scale(float value, const char* what, int64_t expert_idx);

}  // namespace layer

struct MoeLayer::Impl {
  int device = 0;  // where prepare() uploaded the weights
  int64_t num_experts = 0, hidden = 0, inter = 0;
  int top_k = 0;
  // Shared expert chunks: extra experts num_experts .. num_experts +
  // num_shared - 1 of the GEMMs, one more slot each per token.
  int num_shared = 0;
  DeviceBuffer<float> shared_gate;  // [hidden]: Qwen2-MoE's sigmoid gate; empty: weight 1
  int rows_per_token() const { return top_k + num_shared; }
  int64_t gemm_experts() const { return num_experts + num_shared; }
  bool has_bias = false;
  MoeLayerOptions options;
  GatherMode gather = GatherMode::kAuto;
  layer::DeviceGemmWeights w13;  // interleaved gate/up, [E][2 inter, hidden]
  // [E] the up rows' weight_scale_2 where it differs from the gate rows' (in
  // w13.global_scales); empty when they share it, as ModelOpt's exports do.
  DeviceBuffer<float> w13_up_scales;
  layer::DeviceGemmWeights w2;  // down, [E][hidden, inter]
  DeviceBuffer<float> bias13;   // [E][2 inter]: gate biases then up biases
  DeviceBuffer<float> bias2;    // [E][hidden]
  // W4A4 (fp4 activations): [E] the input_scale each GEMM's input is
  // quantised with. Its activations are then stored as e2m1 x e4m3, so the
  // GEMMs' global scales above hold weight_scale_2 x input_scale.
  bool fp4_activations = false;
  DeviceBuffer<float> input_scales13;  // gate/up's (gemm1_input_scale)
  DeviceBuffer<float> input_scales2;   // down_proj's

  mutable PlanCache<MoeLayerPlan> plans{layer::kPlanCacheCapacity};          // by token count
  mutable PlanCache<size_t> workspace_by_tokens{layer::kPlanCacheCapacity};  // by max_tokens
  // GEMM1's and GEMM2's tuned choices, read once by prepare() and never
  // changed after: workspace_bytes() plans with them too, so the workspace
  // it sizes covers every split they make.
  tune::TunedGemm tuned[2];

  // planning.cpp
  GemmProblem problem(int gemm, int64_t num_tokens) const;
  void load_tuned_choices();
  void read_tuned_choices(const std::string& path);
  GemmPlan plan_one_gemm(int gemm, int64_t num_tokens, PlanOrigin* origin) const;
  MoeLayerPlan make_plan(int64_t num_tokens) const;
  void plan_fused_decode(MoeLayerPlan& p) const;
  std::shared_ptr<const MoeLayerPlan> plan(int64_t num_tokens) const;

  // workspace.cpp
  bool wants_separate_gather(const MoeLayerPlan& p) const;
  bool separate_gather(int64_t num_tokens, const MoeLayerPlan& p, size_t workspace_bytes) const;
  size_t min_forward_bytes(int64_t num_tokens, const MoeLayerPlan& p) const;
  layer::ScratchLayout scratch(int64_t num_tokens, const MoeLayerPlan& p, bool separate_gather) const;
  size_t workspace_bytes(int64_t max_tokens) const;

  // forward.cpp: forward() (output set) or forward_pair_rows() (pair_rows
  // set), recording `events` between the stages where given.
  void run(const MoeForwardArgs& args, void* output, void* pair_rows, void* workspace, size_t workspace_bytes,
           cudaStream_t stream, const MoeStageEvents* events) const;
};

}  // namespace fp4moe
