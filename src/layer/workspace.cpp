// The forward's workspace (include/fp4moe/moe_layer.hpp, workspace_bytes):
// a fixed header holds everything that must stay zero between forwards
// (device error words, split-K tile counters; src/layer/layer_impl.hpp), so
// forwards of any token count can share one workspace; the scratch after it
// is carved per forward from the token count and its plan, with the
// activation rows copied into expert order where the gather runs apart
// (docs/performance.md §5.19). Tested in
// tests/layer/test_moe_layer_workspace.cpp (GPU) and
// test_moe_layer_faults.cpp (GPU: the byte-exact refusal).
#include "fp4moe/moe_layer.hpp"

#include <algorithm>
#include <string>

#include "fp4moe/error.hpp"
#include "kernels/grouped_gemm.hpp"
#include "kernels/ops/moe_ops.hpp"
#include "layer/layer_impl.hpp"
#include "layer/moe_layer_internals.hpp"
#include "plan/smem_model.hpp"

namespace fp4moe {

std::string to_string(GatherMode mode) {
  switch (mode) {
    case GatherMode::kAuto:
      return "auto";
    case GatherMode::kFused:
      return "fused";
    case GatherMode::kSeparate:
      return "separate";
  }
  return "?";
}

namespace {

size_t align_bytes(size_t v) { return (v + layer::kAlign - 1) / layer::kAlign * layer::kAlign; }

}  // namespace

// Whether a forward with plan `p` copies the activation rows into expert
// order first (GatherMode::kAuto: where GEMM1's tile then reads them by
// tensor map, which measured faster than the gather fused into its
// cp.async copies; docs/performance.md §5.19). Either way GEMM1 computes
// the same bits.
bool MoeLayer::Impl::wants_separate_gather(const MoeLayerPlan& p) const {
  if (fp4_activations) return true;  // the gather quantises GEMM1's input
  if (gather != GatherMode::kAuto) return gather == GatherMode::kSeparate;
  return auto_gather_is_separate(p.gemm1.config);
}

// What a forward of num_tokens with plan `p` and a workspace of
// `workspace_bytes` does: kAuto's separate gather only where the
// workspace holds the sorted copy (workspace_bytes() sizes it for the plan
// of max_tokens; a smaller count whose plan wants the copy while the
// largest one's does not runs fused).
bool MoeLayer::Impl::separate_gather(int64_t num_tokens, const MoeLayerPlan& p, size_t workspace_bytes) const {
  if (!wants_separate_gather(p)) return false;
  return fp4_activations || gather == GatherMode::kSeparate || workspace_bytes >= scratch(num_tokens, p, true).end;
}

// The fewest workspace bytes a forward of num_tokens with plan `p` runs
// in: kAuto's separate gather is left out where it is optional.
size_t MoeLayer::Impl::min_forward_bytes(int64_t num_tokens, const MoeLayerPlan& p) const {
  const bool required = wants_separate_gather(p) && (fp4_activations || gather == GatherMode::kSeparate);
  return scratch(num_tokens, p, required).end;
}

// The forward's regions, each starting on a kAlign (256 B) boundary. With
// P = num_tokens * rows_per_token() (routed slots + shared chunks), E' =
// gemm_experts(), H = hidden, I = inter and A(b) = b rounded up to 256:
//
//   end = kHeaderBytes + 4 A(4 P) + A(4 (E' + 1)) + A(4 sort_scratch_ints(P, E'))
//       + [A(2 P H): the sorted copy, separate gather only] + A(2 P I)
//       + (deterministic: A(2 P H), bf16 (token, slot) rows;
//          atomic: A(4 num_tokens H), the fp32 token rows)
//       + A(GEMM1 workspace) + A(GEMM2 workspace)
//
// (ids, weights, token_of_row, pair_of_row: int32 / fp32 per slot; the
// activated rows bf16 [P, I]; the GEMMs' grouped_gemm_workspace_bytes).
layer::ScratchLayout MoeLayer::Impl::scratch(int64_t num_tokens, const MoeLayerPlan& p, bool separate_gather) const {
  const size_t pairs = static_cast<size_t>(num_tokens * rows_per_token());
  layer::ScratchLayout s;
  size_t at = layer::kHeaderBytes;
  auto take = [&](size_t bytes) {
    const size_t offset = at;
    at = align_bytes(at + bytes);
    return offset;
  };
  s.topk_ids = take(pairs * 4);
  s.topk_weights = take(pairs * 4);
  s.offsets = take(static_cast<size_t>(gemm_experts() + 1) * 4);
  s.token_of_row = take(pairs * 4);
  s.pair_of_row = take(pairs * 4);
  s.sort_scratch =
      take(static_cast<size_t>(kernels::sort_scratch_ints(static_cast<int64_t>(pairs), gemm_experts())) * 4);
  if (separate_gather) s.x_sorted = take(pairs * hidden * 2);
  s.activated = take(pairs * inter * 2);
  // GEMM2's output (docs/design.md §3, Combine).
  s.finalize = options.finalize == FinalizeMode::kDeterministic ? take(pairs * hidden * 2)
                                                                : take(static_cast<size_t>(num_tokens) * hidden * 4);
  s.gemm1_ws_bytes = grouped_gemm_workspace_bytes(p.gemm1);
  s.gemm2_ws_bytes = grouped_gemm_workspace_bytes(p.gemm2);
  s.gemm1_ws = take(s.gemm1_ws_bytes);
  s.gemm2_ws = take(s.gemm2_ws_bytes);
  s.end = at;
  return s;
}

size_t MoeLayer::Impl::workspace_bytes(int64_t max_tokens) const {
  if (auto hit = workspace_by_tokens.find(max_tokens)) return *hit;
  // Every region but the split-K partials grows with the token count; the
  // partials exist only while tiles are few (limit_split_k), so the smaller
  // counts where a split is possible are checked one by one, with the
  // tuned choices the forwards will use (planned here, not cached: they
  // would push the forwards' plans out of the bounded cache).
  const auto bytes_for = [&](int64_t t) {
    const MoeLayerPlan p = make_plan(t);
    return scratch(t, p, wants_separate_gather(p)).end;
  };
  size_t bytes = bytes_for(max_tokens);
  int max_block_m = 1;
  for (const TileConfig& c : compiled_configs()) max_block_m = std::max(max_block_m, c.block_m);
  const int64_t min_n_tiles = (std::min(2 * inter, hidden) + 127) / 128;
  for (int64_t t = 1; t < max_tokens; ++t) {
    if ((t * rows_per_token() / max_block_m) * min_n_tiles > kMaxSplitKTiles) break;
    bytes = std::max(bytes, bytes_for(t));
  }
  workspace_by_tokens.insert(max_tokens, bytes);
  return bytes;
}

GatherMode MoeLayerInternals::gather(const MoeLayer& layer) { return layer.impl_->gather; }

bool auto_gather_is_separate(const TileConfig& gemm1) {
  return gemm1.family == KernelFamily::kSm90 && gemm1.block_m >= kSm90TensorMapMinBlockM;
}

bool MoeLayerInternals::separate_gather(const MoeLayer& layer, int64_t num_tokens, size_t workspace_bytes) {
  const MoeLayer::Impl& m = *layer.impl_;
  return m.separate_gather(num_tokens, *m.plan(num_tokens), workspace_bytes);
}

size_t MoeLayerInternals::min_forward_bytes(const MoeLayer& layer, int64_t num_tokens) {
  const MoeLayer::Impl& m = *layer.impl_;
  return m.min_forward_bytes(num_tokens, *m.plan(num_tokens));
}

size_t MoeLayer::workspace_bytes(int64_t max_tokens) const {
  FP4MOE_CHECK(max_tokens >= 1 && max_tokens < layer::max_tokens_for(impl_->rows_per_token()),
               "MoeLayer::workspace_bytes: max_tokens = ", max_tokens, "; expected 1 .. 2^31 / top_k");
  return impl_->workspace_bytes(max_tokens);
}

}  // namespace fp4moe
