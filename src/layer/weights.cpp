// The checks MoeLayer::prepare() and prepare_device() make before anything
// touches the GPU (a layer's shape and options, host weights, the shared
// expert), and the shared expert cut into chunks of the routed experts' width
// (src/layer/layer_impl.hpp). Tested in tests/layer/test_moe_layer_args.cpp
// (host validation, no GPU needed) and, with the GPU layer, in
// tests/layer/test_moe_layer_weights.cpp.
#include "layer/layer_impl.hpp"

#include <algorithm>
#include <cmath>
#include <utility>
#include <vector>

#include "fp4moe/error.hpp"
#include "fp4moe/modelopt.hpp"
#include "kernels/ops/moe_ops.hpp"
#include "plan/smem_model.hpp"

namespace fp4moe::layer {

namespace {

// The grouped GEMM's largest N or K (grouped_gemm.cu: int indexing of the
// padded sizes).
constexpr int64_t kMaxLayerDim = (int64_t{1} << 31) - 256;

void check_matrix(const Nvfp4Matrix& m, int64_t rows, int64_t cols, int64_t expert_idx, const char* name) {
  FP4MOE_CHECK(m.rows == rows && m.cols == cols, "MoeLayer: expert ", expert_idx, " ", name, " is [", m.rows, ", ",
               m.cols, "]; expected [", rows, ", ", cols, "]");
  FP4MOE_CHECK(m.packed.size() == static_cast<size_t>(rows * cols / 2) &&
                   m.scales.size() == static_cast<size_t>(rows * cols / 16),
               "MoeLayer: expert ", expert_idx, " ", name, " has ", m.packed.size(), " packed bytes and ",
               m.scales.size(), " scales; expected ", rows * cols / 2, " and ", rows * cols / 16);
}

}  // namespace

void validate_shape(int64_t num_experts, int64_t hidden, int64_t inter, const MoeLayerOptions& o) {
  FP4MOE_CHECK(num_experts >= 1 && num_experts <= kMaxExperts, "MoeLayer: ", num_experts, " experts; expected 1..",
               kMaxExperts);
  FP4MOE_CHECK(hidden >= 16 && hidden % 16 == 0, "MoeLayer: hidden = ", hidden,
               "; expected a positive multiple of 16 (the NVFP4 block)");
  FP4MOE_CHECK(inter >= 16 && inter % 16 == 0, "MoeLayer: inter = ", inter,
               "; expected a positive multiple of 16 (the NVFP4 block)");
  // Before any product of the two is formed: GEMM1's N is 2 * inter, and the
  // grouped GEMM indexes N and K with int and refuses N * K >= 2^40.
  FP4MOE_CHECK(hidden <= kMaxLayerDim && inter <= kMaxLayerDim / 2 && 2 * inter * hidden < (int64_t{1} << 40),
               "MoeLayer: hidden = ", hidden, ", inter = ", inter, "; expected hidden <= ", kMaxLayerDim,
               ", inter <= ", kMaxLayerDim / 2, " and 2 * inter * hidden < 2^40 (the grouped GEMM's 32-bit indexing)");
  FP4MOE_CHECK(!o.batch_invariant || o.finalize == FinalizeMode::kDeterministic,
               "MoeLayer: batch_invariant needs the deterministic finalize (atomic adds sum the "
               "top-k rows in a different order on every run)");
  const int k = o.routing.top_k;
  FP4MOE_CHECK(k >= 1 && k <= num_experts && k <= kernels::kMaxTopK, "MoeLayer: top_k = ", k, "; expected 1..",
               std::min<int64_t>(num_experts, kernels::kMaxTopK));
}

int shared_chunks(const MoeWeights& w, const MoeLayerOptions& o) {
  if (!w.shared_expert) return 0;
  const SharedExpertWeights& sh = *w.shared_expert;
  FP4MOE_CHECK(!sh.dense(),
               "MoeLayer: the shared expert is unquantised in the checkpoint (ModelOpt's "
               "experts-only configs leave it in bf16); the GPU layer runs NVFP4 shared experts only, as extra experts "
               "of its grouped GEMMs: use the CPU backend (--device cpu) or a checkpoint that quantises it");
  FP4MOE_CHECK(sh.inter > 0 && sh.inter % w.inter == 0, "MoeLayer: the shared expert is ", sh.inter,
               " wide; expected a multiple of the routed experts' inter = ", w.inter,
               " (it runs as extra experts of that width)");
  const int64_t chunks = sh.inter / w.inter;
  FP4MOE_CHECK(o.routing.top_k + chunks <= kernels::kMaxTopK && w.num_experts + chunks <= kMaxExperts,
               "MoeLayer: the shared expert makes ", chunks, " extra experts of width ", w.inter, "; top_k + ", chunks,
               " = ", o.routing.top_k + chunks, " rows per token and ", w.num_experts + chunks,
               " experts; expected at most ", kernels::kMaxTopK, " and ", kMaxExperts);
  FP4MOE_CHECK(!w.has_bias(), "MoeLayer: a shared expert beside routed experts with biases (gpt-oss has none)");
  check_matrix(sh.mlp.gate, sh.inter, w.hidden, -1, "shared gate");
  check_matrix(sh.mlp.up, sh.inter, w.hidden, -1, "shared up");
  check_matrix(sh.mlp.down, w.hidden, sh.inter, -1, "shared down");
  FP4MOE_CHECK(std::isfinite(sh.mlp.gate.global_scale) && std::isfinite(sh.mlp.up.global_scale) &&
                   std::isfinite(sh.mlp.down.global_scale),
               "MoeLayer: the shared expert's weight_scale_2 are not all finite");
  FP4MOE_CHECK(sh.gate.empty() || sh.gate.size() == static_cast<size_t>(w.hidden),
               "MoeLayer: the shared expert's "
               "gate has ",
               sh.gate.size(), " values; expected 0 (none) or hidden = ", w.hidden);
  return static_cast<int>(chunks);
}

ExpertWeights shared_chunk(const SharedExpertWeights& sh, int64_t inter, int64_t j) {
  ExpertWeights e;
  e.gate = row_slice(sh.mlp.gate, j * inter, inter);
  e.up = row_slice(sh.mlp.up, j * inter, inter);
  e.down = column_slice(sh.mlp.down, j * inter, inter);
  return e;
}

void validate_weights(const MoeWeights& w, const MoeLayerOptions& o) {
  validate_shape(w.num_experts, w.hidden, w.inter, o);
  shared_chunks(w, o);
  FP4MOE_CHECK(static_cast<int64_t>(w.experts.size()) == w.num_experts, "MoeLayer: num_experts = ", w.num_experts,
               " but ", w.experts.size(), " experts are given");
  const bool bias = w.has_bias();
  for (int64_t e = 0; e < w.num_experts; ++e) {
    const ExpertWeights& x = w.experts[static_cast<size_t>(e)];
    check_matrix(x.gate, w.inter, w.hidden, e, "gate");
    check_matrix(x.up, w.inter, w.hidden, e, "up");
    check_matrix(x.down, w.hidden, w.inter, e, "down");
    FP4MOE_CHECK(std::isfinite(x.gate.global_scale) && std::isfinite(x.up.global_scale), "MoeLayer: expert ", e,
                 " has gate and up weight_scale_2 ", x.gate.global_scale, " and ", x.up.global_scale,
                 "; expected finite");
    const std::pair<const std::vector<float>*, std::pair<const char*, int64_t>> biases[] = {
        {&x.gate_bias, {"gate_bias", w.inter}},
        {&x.up_bias, {"up_bias", w.inter}},
        {&x.down_bias, {"down_bias", w.hidden}}};
    for (const auto& [values, what] : biases) {
      const size_t expected = bias ? static_cast<size_t>(what.second) : 0;
      FP4MOE_CHECK(values->size() == expected, "MoeLayer: expert ", e, " ", what.first, " has ", values->size(),
                   " entries; expected ", expected, bias ? "" : " (expert 0 has no biases)");
    }
  }
}

void check_input_scale(float value, const char* what, int64_t expert_idx) {
  FP4MOE_CHECK(std::isfinite(value) && value > 0.0f, what, "[", expert_idx, "] is ", value,
               "; fp4 activations need a finite, positive input_scale");
}

}  // namespace fp4moe::layer
