// Layer variants kept for measurement only, outside the public API: the
// separate gather pass (GEMM1 reading activations copied into expert order by
// a kernel of their own) measured never faster than the gather fused into
// GEMM1's loads (docs/perf-notes.md, "The whole MoE layer"), so users get the
// fused one; the layer benchmark and the tests still run both.
#pragma once

#include <string>

#include "fp4moe/moe_layer.hpp"

namespace fp4moe {

// How GEMM1 reads the activation rows of the permuted (expert-sorted) order.
enum class GatherMode {
  kFused,     // GEMM1's loads read hidden_states rows through the permutation
  kSeparate,  // one pass copies them into expert order first
};
std::string to_string(GatherMode mode);

class MoeLayerInternals {
 public:
  // MoeLayer::prepare() with the given gather mode.
  static MoeLayer prepare(const MoeWeights& weights, const MoeLayerOptions& options, GatherMode gather);
  static GatherMode gather(const MoeLayer& layer);
};

}  // namespace fp4moe
