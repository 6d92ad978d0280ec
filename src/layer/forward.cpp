// The GPU MoE layer's forward (include/fp4moe/moe_layer.hpp): the host
// checks of its arguments, then the sequence of launches, all on the
// caller's stream with no host synchronisation:
//
//   route (+ shared slots; or caller ids -> shared slots) -> sort pairs by expert
//     -> [gather] -> GEMM1 + SwiGLU -> GEMM2 + finalize scatter -> finalize reduction
//
// where a small forward runs the last three as one fused decode launch
// (MoeLayerPlan::fused_decode, docs/design.md §4.8),
// and device_errors(), which reads the error words the launches leave in
// the workspace header. Tested in tests/layer/test_moe_layer_forward.cpp,
// test_moe_layer_determinism.cpp, test_moe_layer_workspace.cpp (GPU) and
// test_moe_layer_faults.cpp (GPU: limits, device, out of memory,
// non-finite inputs).
#include "fp4moe/moe_layer.hpp"

#include <cstdint>
#include <memory>
#include <string>

#include "fp4moe/cuda_check.hpp"
#include "fp4moe/error.hpp"
#include "kernels/grouped_gemm.hpp"
#include "kernels/ops/moe_ops.hpp"
#include "layer/layer_impl.hpp"
#include "layer/moe_layer_internals.hpp"

namespace fp4moe {

std::string to_string(FinalizeMode mode) { return mode == FinalizeMode::kAtomic ? "atomic" : "deterministic"; }
FinalizeMode parse_finalize_mode(const std::string& name) {
  if (name == "deterministic") return FinalizeMode::kDeterministic;
  if (name == "atomic") return FinalizeMode::kAtomic;
  FP4MOE_THROW("unknown finalize mode '", name, "': expected deterministic or atomic");
}

namespace {
bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// The forward's launches go to the current device; the layer's weights live on
// the device prepare() ran on. Refused rather than switched: the caller's
// stream and buffers belong to the caller's device, and changing the thread's
// device behind its back would surprise the code around the call.
void check_device(int layer_device, const char* what) {
  int current = -1;
  FP4MOE_CUDA_CHECK(cudaGetDevice(&current));
  FP4MOE_CHECK(current == layer_device, what, ": the current CUDA device is ", current,
               " but the layer's weights are on device ", layer_device, " (where prepare() ran); call cudaSetDevice(",
               layer_device, ") first");
}
void record(cudaEvent_t event, cudaStream_t stream) {
  if (event) FP4MOE_CUDA_CHECK(cudaEventRecord(event, stream));
}
}  // namespace

void MoeLayer::forward(const MoeForwardArgs& args, void* output, void* workspace, size_t workspace_bytes,
                       cudaStream_t stream) const {
  impl_->run(args, output, nullptr, workspace, workspace_bytes, stream, nullptr);
}

void MoeLayerInternals::forward(const MoeLayer& layer, const MoeForwardArgs& args, void* output, void* workspace,
                                size_t workspace_bytes, cudaStream_t stream, const MoeStageEvents& events) {
  layer.impl_->run(args, output, nullptr, workspace, workspace_bytes, stream, &events);
}

void MoeLayer::forward_pair_rows(const MoeForwardArgs& args, void* pair_rows, void* workspace, size_t workspace_bytes,
                                 cudaStream_t stream) const {
  FP4MOE_CHECK(impl_->options.finalize == FinalizeMode::kDeterministic,
               "MoeLayer::forward_pair_rows: needs FinalizeMode::kDeterministic (the atomic mode "
               "never holds a row per slot)");
  FP4MOE_CHECK(impl_->num_shared == 0,
               "MoeLayer::forward_pair_rows: the layer has a shared expert, whose rows "
               "are not part of the [num_tokens * top_k] pair rows; use forward()");
  impl_->run(args, nullptr, pair_rows, workspace, workspace_bytes, stream, nullptr);
}

void MoeLayer::Impl::run(const MoeForwardArgs& args, void* output, void* pair_rows, void* workspace,
                         size_t workspace_bytes, cudaStream_t stream, const MoeStageEvents* events) const {
  const Impl& m = *this;
  const int64_t T = args.num_tokens;
  FP4MOE_CHECK(T >= 0 && T < layer::max_tokens_for(m.rows_per_token()), "MoeLayer::forward: num_tokens = ", T,
               "; expected 0 .. 2^31 / top_k");
  if (T == 0) return;
  FP4MOE_CHECK(args.hidden_states && aligned16(args.hidden_states),
               "MoeLayer::forward: hidden_states must be a 16-byte aligned device pointer (bf16 [", T, ", ", m.hidden,
               "])");
  if (pair_rows)
    FP4MOE_CHECK(aligned16(pair_rows),
                 "MoeLayer::forward_pair_rows: pair_rows must be a 16-byte "
                 "aligned device pointer (bf16 [",
                 T * m.top_k, ", ", m.hidden, "])");
  else
    FP4MOE_CHECK(output && aligned16(output),
                 "MoeLayer::forward: output must be a 16-byte aligned device pointer (bf16 [", T, ", ", m.hidden, "])");
  const bool device_routing = args.router_logits != nullptr;
  FP4MOE_CHECK(device_routing != (args.topk_ids != nullptr || args.topk_weights != nullptr),
               "MoeLayer::forward: give either router_logits or topk_ids + topk_weights, not both");
  FP4MOE_CHECK(device_routing || (args.topk_ids && args.topk_weights),
               "MoeLayer::forward: topk_ids and topk_weights go together");
  FP4MOE_CHECK(workspace && aligned16(workspace),
               "MoeLayer::forward: workspace must be a 16-byte "
               "aligned device pointer");
  check_device(m.device, "MoeLayer::forward");
  const std::shared_ptr<const MoeLayerPlan> plan_ptr = m.plan(T);  // one cached lookup per forward
  const MoeLayerPlan& plan = *plan_ptr;
  const bool separate_gather = m.separate_gather(T, plan, workspace_bytes);
  const layer::ScratchLayout s = m.scratch(T, plan, separate_gather);
  FP4MOE_CHECK(workspace_bytes >= s.end, "MoeLayer::forward: workspace of ", workspace_bytes, " B; ", T,
               " tokens need ", s.end, " B (allocate workspace_bytes(max_tokens))");

  auto* ws = static_cast<uint8_t*>(workspace);
  auto* layer_errors = reinterpret_cast<int32_t*>(ws);
  int32_t* route_arrivals = layer_errors + 1;
  auto* gemm1_errors = reinterpret_cast<int32_t*>(ws + 16);
  auto* gemm2_errors = reinterpret_cast<int32_t*>(ws + 32);
  auto* gemm1_counters = reinterpret_cast<int32_t*>(ws + layer::kErrorWordsBytes);
  int32_t* gemm2_counters = gemm1_counters + kMaxSplitKTiles;
  auto* ids = reinterpret_cast<int32_t*>(ws + s.topk_ids);
  auto* weights = reinterpret_cast<float*>(ws + s.topk_weights);
  auto* offsets = reinterpret_cast<int32_t*>(ws + s.offsets);
  auto* token_of_row = reinterpret_cast<int32_t*>(ws + s.token_of_row);
  auto* pair_of_row = reinterpret_cast<int32_t*>(ws + s.pair_of_row);
  auto* sort_scratch = reinterpret_cast<int32_t*>(ws + s.sort_scratch);
  // Deterministic: bf16 (token, slot) rows; atomic: the fp32 token rows.
  uint8_t* finalize = ws + s.finalize;
  auto* accum = reinterpret_cast<float*>(finalize);
  // Rows per token: the routed slots, then the shared expert's chunks.
  const int rows = m.rows_per_token();
  const int64_t pairs = T * rows;
  const int64_t gemm_experts = m.gemm_experts();
  const bool pdl = m.options.programmatic_launch;
  const MoeStageEvents no_events;
  const MoeStageEvents& ev = events ? *events : no_events;

  record(ev.start, stream);
  const int32_t* topk_ids = args.topk_ids;
  const float* topk_weights = args.topk_weights;
  // The shared expert's slots follow each token's routed ones ([T, rows]):
  // the routing kernel appends them, or for caller-given routing one small
  // kernel copies the caller's slots and appends them.
  kernels::SharedSlots shared_slots;
  shared_slots.num_shared = m.num_shared;
  shared_slots.hidden_states = args.hidden_states;
  shared_slots.gate = m.shared_gate.get();  // null: weight 1
  shared_slots.hidden = m.hidden;
  if (device_routing) {
    // One kernel for small batches, so the stage boundary is not observable.
    kernels::launch_route_and_sort(args.router_logits, args.correction_bias, T, m.num_experts, m.options.routing, ids,
                                   weights, offsets, token_of_row, pair_of_row, layer_errors, route_arrivals,
                                   sort_scratch, stream, pdl, shared_slots);
    topk_ids = ids;
    topk_weights = weights;
    record(ev.routed, stream);
  } else if (m.num_shared > 0) {
    kernels::launch_append_shared_slots(topk_ids, topk_weights, T, m.top_k, m.num_experts, m.num_shared,
                                        args.hidden_states, m.shared_gate.get(), m.hidden, ids, weights, stream, pdl);
    topk_ids = ids;
    topk_weights = weights;
    record(ev.routed, stream);
    kernels::launch_sort_by_expert(topk_ids, T, rows, gemm_experts, offsets, token_of_row, pair_of_row, layer_errors,
                                   sort_scratch, stream, pdl);
  } else {
    record(ev.routed, stream);
    kernels::launch_sort_by_expert(topk_ids, T, m.top_k, m.num_experts, offsets, token_of_row, pair_of_row,
                                   layer_errors, sort_scratch, stream, pdl);
  }
  record(ev.sorted, stream);
  if (m.fp4_activations)
    kernels::launch_gather_rows_fp4(args.hidden_states, token_of_row, offsets, gemm_experts, pairs, m.hidden,
                                    m.input_scales13.get(), ws + s.x_sorted, stream, pdl);
  else if (separate_gather)
    kernels::launch_gather_rows(args.hidden_states, token_of_row, offsets, gemm_experts, pairs, m.hidden,
                                ws + s.x_sorted, stream, pdl);
  record(ev.gathered, stream);

  GroupedGemmArgs g1;
  g1.weights = m.w13.weights.get();
  g1.scales = m.w13.scales.get();
  g1.global_scales = m.w13.global_scales.get();
  g1.up_global_scales = m.w13_up_scales.get();  // null when gate and up share one
  g1.num_experts = gemm_experts;
  g1.n = 2 * m.inter;
  g1.k = m.hidden;
  g1.x = separate_gather ? static_cast<const void*>(ws + s.x_sorted) : args.hidden_states;
  g1.gather_rows = separate_gather ? nullptr : token_of_row;
  g1.x_rows = separate_gather ? pairs : T;
  g1.expert_offsets = offsets;
  g1.num_rows = pairs;
  g1.y = ws + s.activated;
  g1.activation = m.options.activation;
  g1.bias = m.bias13.get();
  g1.act_quant_scales = m.input_scales2.get();  // W4A4: GEMM2's input quantised here; else null
  g1.workspace = ws + s.gemm1_ws;
  g1.workspace_bytes = s.gemm1_ws_bytes;
  g1.error_flags = gemm1_errors;
  g1.split_counters = gemm1_counters;
  g1.split_counters_capacity = kMaxSplitKTiles;
  g1.programmatic_launch = pdl;

  const bool atomic = m.options.finalize == FinalizeMode::kAtomic;
  GroupedGemmArgs g2;
  g2.weights = m.w2.weights.get();
  g2.scales = m.w2.scales.get();
  g2.global_scales = m.w2.global_scales.get();
  g2.num_experts = gemm_experts;
  g2.n = m.hidden;
  g2.k = m.inter;
  g2.x = ws + s.activated;
  g2.expert_offsets = offsets;
  g2.num_rows = pairs;
  g2.bias = m.bias2.get();
  g2.scatter_rows = pair_of_row;
  g2.row_weights = topk_weights;
  if (atomic)
    g2.out_f32 = accum;
  else
    g2.out_bf16 = pair_rows ? pair_rows : finalize;
  g2.out_rows = atomic ? T : pairs;
  g2.out_row_divisor = atomic ? rows : 1;
  g2.atomic_out = atomic;
  g2.workspace = ws + s.gemm2_ws;
  g2.workspace_bytes = s.gemm2_ws_bytes;
  g2.error_flags = gemm2_errors;
  g2.split_counters = gemm2_counters;
  g2.split_counters_capacity = kMaxSplitKTiles;
  g2.programmatic_launch = pdl;
  g2.indices_before_previous_kernel = true;  // offsets, slots and weights come from the routing, before GEMM1

  if (plan.fused_decode) {
    FusedDecodeArgs d;
    d.counters = gemm1_counters;  // and gemm2_counters after them
    d.counters_capacity = 2 * kMaxSplitKTiles;
    d.num_tokens = T;
    d.rows_per_token = rows;
    d.slot_experts = device_routing ? nullptr : topk_ids;  // (as the finalize below)
    d.output = pair_rows ? nullptr : output;
    fused_decode(g1, g2, d, plan.gemm1.config, stream);
    // One launch: the GEMM1 and GEMM2 stages end with the combine.
    record(ev.gemm1, stream);
    record(ev.gemm2, stream);
    if (!pair_rows) record(ev.end, stream);
    return;
  }
  grouped_gemm(g1, plan.gemm1, stream);
  record(ev.gemm1, stream);
  if (atomic) FP4MOE_CUDA_CHECK(cudaMemsetAsync(accum, 0, static_cast<size_t>(T * m.hidden) * 4, stream));
  grouped_gemm(g2, plan.gemm2, stream);
  record(ev.gemm2, stream);
  if (pair_rows) return;

  if (atomic)
    kernels::launch_finalize_accumulated(accum, T, m.hidden, output, stream, pdl);
  else
    // The routing kernel's ids are all valid: no id check (a round trip
    // before the rows' loads at small T).
    kernels::launch_finalize_pairs(finalize, device_routing ? nullptr : topk_ids, T, rows, gemm_experts, m.hidden,
                                   output, stream, pdl);
  record(ev.end, stream);
}

std::string MoeLayer::device_errors(void* workspace, cudaStream_t stream) const {
  FP4MOE_CHECK(workspace != nullptr, "MoeLayer::device_errors: workspace is null");
  check_device(impl_->device, "MoeLayer::device_errors");
  int32_t words[12] = {};
  FP4MOE_CUDA_CHECK(cudaMemcpyAsync(words, workspace, layer::kErrorWordsBytes, cudaMemcpyDeviceToHost, stream));
  FP4MOE_CUDA_CHECK(cudaStreamSynchronize(stream));
  std::string out;
  if (words[0] & kernels::kErrorExpertIdOutOfRange)
    out += "expert ids outside [0, " + std::to_string(impl_->num_experts) + ") (their slots were skipped); ";
  if (words[0] & kernels::kErrorNonFiniteLogits)
    out += "non-finite router logits (their experts were excluded, docs/design.md §3); ";
  for (int gemm = 1; gemm <= 2; ++gemm) {
    const std::string errors = grouped_gemm_device_errors(static_cast<const uint8_t*>(workspace) + 16 * gemm, stream);
    if (!errors.empty()) out += "GEMM" + std::to_string(gemm) + ": " + errors;
  }
  // Reported once: the words are cleared for the next forwards.
  FP4MOE_CUDA_CHECK(cudaMemsetAsync(workspace, 0, layer::kErrorWordsBytes, stream));
  FP4MOE_CUDA_CHECK(cudaStreamSynchronize(stream));
  return out;
}

}  // namespace fp4moe
