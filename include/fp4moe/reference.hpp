// The CPU reference for every op of the MoE layer (docs/design.md §3): routing,
// the expert MLPs and the weighted combine. Accumulates in double; this is the
// oracle GPU results are checked against, and a slow but complete backend.
// Tested in tests/ref/test_reference.cpp against a naive independent path.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "fp4moe/types.hpp"

namespace fp4moe {

// Routes router_logits [num_tokens, num_experts]. correction_bias
// [num_experts] is used by kNoauxTc only (may be null: zeros). All scores are
// computed in double from the float inputs; weights are rounded to float last.
//
//   kSoftmaxTopK  p = softmax(logits) (max-subtracted); the k largest p; with
//                 renormalize, w = p / sum of the k chosen p, else w = p.
//   kNoauxTc      s = sigmoid(logits); c = s + correction_bias (the choice
//                 score). Experts form num_groups contiguous groups; a group
//                 scores the sum of its two largest c; the topk_groups best
//                 groups are kept; the k largest c among their experts are
//                 chosen; w = s / (sum of the k chosen s + 1e-20) *
//                 routed_scaling_factor (the unbiased s; the 1e-20 is
//                 DeepSeek-V3's, so a token whose scores all underflow gets
//                 zero weights instead of NaN).
//   kGptOss       the k largest logits; w = softmax over those k logits.
//
// Tie rule (the contract GPU routing kernels must match): whenever two
// experts, or two groups, have exactly equal scores (in double), the one with
// the lower index ranks first. A token's ids are listed in selection order:
// descending score, ties by ascending index. kSoftmaxTopK ranks by logit
// (the order of p, without the ties of probabilities that underflow to 0).
//
// Non-finite logits (NaN, +inf, -inf) exclude their expert: it ranks after
// every expert with a finite logit (its key, and for kNoauxTc its choice
// score, is -inf; excluded experts tie, lower index first), weights are
// computed from the finite logits alone, and an excluded expert chosen
// anyway (fewer than top_k finite logits) gets weight 0. A token without a
// finite logit gets weight 0 in every slot. Such tokens are counted in
// Routing::tokens_with_nonfinite_logits; nothing throws (docs/design.md §3).
//
// Throws fp4moe::Error naming the parameter when top_k is outside
// [1, num_experts], num_tokens < 1 or num_tokens * top_k >= 2^31 (the GPU
// layer's limit, checked before anything is allocated), num_experts >=
// 2^31, a correction bias is not finite, or (for
// kNoauxTc) num_groups does not divide num_experts, a group has fewer than 2
// experts, topk_groups is outside [1, num_groups], the kept groups hold fewer
// than top_k experts, or routed_scaling_factor is not finite and positive.
Routing route(const float* router_logits, int64_t num_tokens, int64_t num_experts, const float* correction_bias,
              const RoutingParams& params);

// Validates caller-given routing against the layer (ids in range, no
// duplicate expert within a token, shapes, num_tokens * top_k < 2^31);
// throws with the first offence.
void validate_routing(const Routing& routing, int64_t num_experts);

// act(gate, up) in double, as above: the reference of the SwiGLU epilogue.
double activate(Activation activation, double gate, double up);

// output [num_tokens, hidden] = sum_j w_j * down_e(act(gate_e x, up_e x)) for the
// token's top-k experts e with weights w_j; biases added where present; plus,
// when weights.shared_expert is set, s * down_s(act(gate_s x, up_s x)) with
// s = 1, or sigmoid(gate · x) for a gated one (added after the slots).
// hidden_states [num_tokens, hidden] row-major float. Uses all hardware threads.
// The result is bitwise independent of the thread count: every (token, slot)
// contribution is computed by one sequential dot product per output element,
// and a token's contributions are summed in slot order. Throws on shape
// mismatches between weights, routing and the layer.
void moe_reference(const MoeWeights& weights, const float* hidden_states, const Routing& routing, Activation activation,
                   float* output);
// Precision of the intermediate act(gate, up) that feeds the down projection.
enum class Intermediate {
  kExact,  // double
  kBf16,   // rounded to bf16 (nearest even), as the GPU layer stores it: the
           // contract is W4A16, so GEMM2's input activations are bf16 too
};

// How a token's weighted (token, slot) rows w_j · y_j are summed.
enum class Combine {
  kExact,     // in double (the GPU layer's atomic combine, fp32 rows)
  kBf16Rows,  // each row rounded to float, then to bf16 (nearest even), then
              // summed in slot order, as the GPU layer's deterministic combine
              // stores them (docs/design.md §3); a shared expert's output as
              // the layer's rows of it: one per chunk of the routed width
};

// kCheckpoint resolved for `weights` (kBf16 or kFp4); kBf16 and kFp4 as they
// are. kFp4 on weights without an input_scale on every expert matrix throws,
// in one line naming the first matrix without one.
ActivationNumerics resolve_activation_numerics(const MoeWeights& weights, ActivationNumerics requested);

// The input_scale GEMM1's input is quantised with for expert `expert`: gate's
// and up's are one value in ModelOpt exports (the same input); where they
// differ, the larger, whose range covers both calibrations.
float gemm1_input_scale(const ExpertWeights& expert);
float gemm1_input_scale(float gate_input_scale, float up_input_scale);

// ---- W4A4 from an engine's stacked tensors
//
// Inference engines (vLLM, SGLang) hold a ModelOpt NVFP4 MoE layer stacked
// per expert, its input scales as w13_input_scale (gate/up's) and
// w2_input_scale (down_proj's): [E, 2] as loaded, [E] once reduced to one
// per expert (the larger of gate's and up's), or one value for every expert
// where an engine keeps a single activation scale (the largest). The rules
// below turn them into what a checkpoint's per-matrix input_scale tensors
// give (ExpertWeights), so that both sources run the same W4A4 numerics.

// How many values a stacked tensor of `extent` holds (InputScaleExtent,
// fp4moe/types.hpp).
int64_t input_scale_count(InputScaleExtent extent, int64_t num_experts);

struct ExpertInputScales {
  float gate = 1.0f, up = 1.0f, down = 1.0f;
};
// Each expert's gate, up and down input scales from the stacked values
// (host floats, input_scale_count() of them each), every value checked as
// the checkpoint loader checks input_scale tensors (valid_input_scale). A
// refusal is one line starting with `where` and naming the tensor and the
// index, e.g. "fp4moe.MoeLayer: w13_input_scale[3, 1] is nan; expected a
// finite input_scale in [1e-15, 1e+15] (the calibrated activation amax /
// 2688)". w2's extent cannot be kPerExpertGateUp.
std::vector<ExpertInputScales> stacked_input_scales(int64_t num_experts, const float* w13_input_scale,
                                                    InputScaleExtent w13_extent, const float* w2_input_scale,
                                                    InputScaleExtent w2_extent, const std::string& where);
// The activation numerics of a stacked layer: both input scales or neither
// (refused otherwise); kCheckpoint is kFp4 where they are given (an NVFP4
// (W4A4) export's, as for a checkpoint that declares NVFP4) and kBf16
// where not; kFp4 without them is refused. Refusals start with `where`.
ActivationNumerics resolve_stacked_activation_numerics(ActivationNumerics requested, bool has_w13_input_scale,
                                                       bool has_w2_input_scale, const std::string& where);

// As above with an explicit thread count (num_threads <= 0 means all
// hardware threads), intermediate precision, activation numerics and
// combine. With kFp4 the intermediate is rounded as `intermediate` says, to
// float, then quantised; the quantised values q * e4m3 * input_scale are
// exact in double, as an FP4 tensor-core engine multiplies them.
void moe_reference(const MoeWeights& weights, const float* hidden_states, const Routing& routing, Activation activation,
                   float* output, int num_threads, Intermediate intermediate = Intermediate::kExact,
                   ActivationNumerics numerics = ActivationNumerics::kCheckpoint, Combine combine = Combine::kExact);

}  // namespace fp4moe
