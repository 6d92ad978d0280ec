// Layer variants kept for measurement, outside the public API: how GEMM1
// reads the activation rows, and events between the stages of a forward.
// Users get kAuto: the separate gather pass where GEMM1's tile then copies
// its activations by tensor map (SM90, m128 and m256 tiles: faster than
// gathering through cp.async), the gather fused into GEMM1's loads elsewhere
// (where the separate pass measured never faster; both in
// docs/performance.md §5.19). The layer benchmark and the tests run the
// forced modes too; the benchmark splits a forward's time by stage.
#pragma once

#include <cuda_runtime_api.h>

#include <string>

#include "fp4moe/moe_layer.hpp"

namespace fp4moe {

// How GEMM1 reads the activation rows of the permuted (expert-sorted) order.
// With fp4 activations (W4A4) the separate pass always runs, whatever the
// mode: it is where GEMM1's input is quantised.
enum class GatherMode {
  kAuto,      // separate where GEMM1's plan reads by tensor map, else fused
  kFused,     // GEMM1's loads read hidden_states rows through the permutation
  kSeparate,  // one pass copies them into expert order first
};
std::string to_string(GatherMode mode);

// Whether GatherMode::kAuto copies the activation rows into expert order
// before a GEMM1 planned with `gemm1`: where its tile then reads them by
// tensor map (the SM90 family's tiles of kSm90TensorMapMinBlockM rows or
// more), the workspace permitting. The autotuner times such GEMM1 candidates
// with that pass, as the layer runs them.
bool auto_gather_is_separate(const TileConfig& gemm1);

// Optional events recorded on the stream between the stages of a forward, for
// benchmarks that split the layer's time; null members are skipped. Stages
// that do not run (routing with caller-given ids, the gather in fused mode)
// leave their two events back to back. Routing on the device includes the
// permutation (one kernel at small batches): `routed` and `sorted` are then
// back to back.
struct MoeStageEvents {
  cudaEvent_t start = nullptr;     // before routing
  cudaEvent_t routed = nullptr;    // after routing (+ the permutation, for device routing)
  cudaEvent_t sorted = nullptr;    // after the permutation
  cudaEvent_t gathered = nullptr;  // after the separate gather
  cudaEvent_t gemm1 = nullptr;     // after GEMM1 + SwiGLU
  cudaEvent_t gemm2 = nullptr;     // after GEMM2 + finalize scatter
  cudaEvent_t end = nullptr;       // after the finalize reduction
};

class MoeLayerInternals {
 public:
  // MoeLayer::prepare() with the given gather mode.
  static MoeLayer prepare(const MoeWeights& weights, const MoeLayerOptions& options, GatherMode gather);
  static GatherMode gather(const MoeLayer& layer);
  // Whether a forward of num_tokens with a workspace of workspace_bytes runs
  // the separate gather pass.
  static bool separate_gather(const MoeLayer& layer, int64_t num_tokens, size_t workspace_bytes);
  // The fewest workspace bytes a forward of num_tokens runs in: a forward
  // is refused exactly when it is given fewer.
  static size_t min_forward_bytes(const MoeLayer& layer, int64_t num_tokens);
  // MoeLayer::forward() with `events` recorded between its stages.
  static void forward(const MoeLayer& layer, const MoeForwardArgs& args, void* output, void* workspace,
                      size_t workspace_bytes, cudaStream_t stream, const MoeStageEvents& events);
};

}  // namespace fp4moe
