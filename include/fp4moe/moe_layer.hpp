// The MoE layer on the GPU: routing, permutation, GEMM1 with a fused SwiGLU,
// GEMM2 with a fused finalize (router weight x row, scattered to the token's
// output row), all asynchronous on one stream with no host synchronisation,
// so forward() can be captured in a CUDA graph and replayed.
//
//   MoeLayer layer = MoeLayer::prepare(weights, options);   // once: repack, upload
//   size_t bytes = layer.workspace_bytes(max_tokens);       // cudaMalloc + cudaMemset(0) once
//   layer.forward({hidden, num_tokens, router_logits, bias}, output, ws, bytes, stream);
//
// A forward reads bf16 hidden states [T, hidden] and writes bf16 output
// [T, hidden]. Routing is either computed on the device from fp32 router
// logits (the mode in MoeLayerOptions::routing) or given by the caller as
// topk_ids/topk_weights. forward() is const: one layer may run on several
// streams at once, each with its own workspace.
//
// Device: a layer lives on the CUDA device that was current when prepare()
// ran (device()). forward() and device_errors() refuse, with an error naming
// both devices, when another device is current: they never switch devices
// behind the caller, whose stream and buffers belong to its current device.
// Multi-GPU callers prepare one layer per device and cudaSetDevice before
// each call.
//
// Limits, refused with fp4moe::Error before anything is allocated or
// launched: hidden <= 2^31 - 256, inter <= 2^30 - 128 and 2 inter hidden <
// 2^40 (the grouped GEMM's 32-bit indexing); num_tokens * top_k < 2^31
// (plan, workspace_bytes, forward); a forward whose token count needs more
// workspace than it is given (see workspace_bytes). Plans are cached per token count, at most
// plan_cache_capacity() of them (least recently used dropped first). Each
// GEMM's plan is a forced config, else the tune cache's choice for this GPU
// (`fp4moe tune`; MoeLayerOptions::use_tune_cache), else the planner's
// heuristic; MoeLayerPlan says which.
//
// Tested in tests/layer/test_moe_layer_*.cpp (GPU) against the CPU reference
// (fp4moe::moe_reference), in tests/layer/test_moe_layer_args.cpp (host
// validation, no GPU needed) and, with a tune cache, in
// tests/tune/test_tune_gpu.cpp.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "fp4moe/plan.hpp"   // TileConfig, GemmPlan
#include "fp4moe/types.hpp"  // MoeWeights, RoutingParams, Activation, ActivationNumerics

namespace fp4moe {

class MoeLayerInternals;

// How GEMM2's per-(token, slot) rows are combined into a token's output row.
// Deterministic is the default; atomic measured 2-6 us faster at one token
// (GLM-5, H200) and slower from 1024 tokens on (docs/performance.md §5.20),
// at the price of output bits that vary from run to run.
enum class FinalizeMode {
  kDeterministic,  // bf16 row per (token, slot), summed in slot order in fp32: bit-identical runs
  kAtomic,         // fp32 atomic adds into the token's row: order varies run to run
};
std::string to_string(FinalizeMode mode);
FinalizeMode parse_finalize_mode(const std::string& name);  // "deterministic", "atomic"

struct MoeLayerOptions {
  Activation activation = Activation::kSwiGLU;
  // The precision of the expert GEMMs' input activations (docs/design.md
  // §3): kCheckpoint follows the weights (fp4 for an NVFP4 (W4A4) checkpoint
  // with every input_scale, bf16 otherwise; for prepare_device(), fp4 when
  // the input scales are given); kFp4 is refused for weights without
  // input scales. With fp4, the gather quantises GEMM1's input and GEMM1's
  // SwiGLU epilogue GEMM2's (the separate gather then always runs).
  ActivationNumerics activations = ActivationNumerics::kCheckpoint;
  // Used by forward() when router logits are given.
  RoutingParams routing;
  FinalizeMode finalize = FinalizeMode::kDeterministic;
  // Launch the layer's kernels with programmatic dependent launch (SM90+):
  // each may start while the previous one finishes, hiding launch gaps that
  // cost a decode-sized layer several microseconds. Off: plain launches.
  bool programmatic_launch = true;
  // Forwards of kFusedDecodeMinTokens to kFusedDecodeMaxTokens (fp4moe/plan.hpp)
  // tokens run GEMM1, GEMM2 and the combine as one persistent kernel whose
  // GEMM2 units start streaming their weights while GEMM1 still runs
  // (docs/design.md §4.8), where the plan's tile is compiled for it, neither
  // GEMM splits K and the finalize is deterministic: the same output bits as
  // the separate launches. Off: always the separate launches.
  bool fused_decode = true;
  // Force tile configs (e.g. from `fp4moe plan`); otherwise the tuned choice
  // or the planner picks per token count. The epilogue field is ignored (set
  // by the layer). A forced config wins over the tune cache.
  std::optional<TileConfig> gemm1_config;
  std::optional<TileConfig> gemm2_config;
  // Tuned choices (`fp4moe tune`, docs/design.md §4.6): prepare() reads the
  // tune cache once, and a forward of T tokens then runs, per GEMM, the
  // config and split-K measured fastest for this GPU, driver and fp4moe
  // version at the bucket of T (the smallest tuned token count >= T, else
  // the largest), once the choice is checked: compiled, fits the device's
  // shared memory, its family runs here and, for a batch-invariant layer,
  // no split-K and one family. Without an entry (or with a refused one) the
  // planner's heuristic plans it. A corrupt, unreadable, stale or refused
  // cache is reported once per process on stderr and never trusted.
  bool use_tune_cache = true;
  // The cache file; empty: $FP4MOE_TUNE_CACHE, else
  // $XDG_CACHE_HOME/fp4moe/tune-cache.json, else ~/.cache/fp4moe/tune-cache.json
  // (FP4MOE_TUNE_CACHE=off: none).
  std::string tune_cache_path;
  // Batch invariance: a token's output bits depend only on that token (its
  // hidden state and routing), never on which other tokens share the
  // forward or how many there are. Split-K is then never used (it changes
  // the order in which K is summed, and the planner picks it per token
  // count); tile shapes may still vary, as they do not change that order.
  // Needs the deterministic finalize. The cost is speed where the planner
  // would split K (small batches on GPUs with idle SMs). Expert-parallel
  // serving needs it to equal a single GPU, where each rank sees other
  // token counts.
  bool batch_invariant = false;
};

// Where a GEMM's config and split-K came from.
struct PlanOrigin {
  enum class Kind {
    kHeuristic,  // the planner's time model (plan_gemm)
    kForced,     // MoeLayerOptions::gemm1_config / gemm2_config
    kTuned,      // the tune cache's entry for `bucket`
  };
  Kind kind = Kind::kHeuristic;
  std::string cache_path;  // kTuned: the cache file
  // kTuned: the token count the choice was measured at; kHeuristic: that of
  // the tuned entry not used, if there was one
  int64_t bucket = 0;
  std::string unused_tuned_entry;  // kHeuristic: why the tuned entry for this token count was not used
  // kHeuristic: "the tuned entry for bucket 64 is not used: ..." where there
  // was one, else empty (formatted when asked: planning formats no text).
  std::string note() const;
  // "heuristic", "forced", "tuned (bucket 64 of PATH)", "heuristic; the tuned entry for bucket 64 is not used: ..."
  std::string describe() const;
};

// What a forward of `num_tokens` tokens will launch.
struct MoeLayerPlan {
  int64_t num_tokens = 0;
  int64_t num_rows = 0;  // num_tokens * (top_k + shared expert chunks)
  GemmPlan gemm1;        // [rows, hidden] x [2 inter, hidden]^T -> SwiGLU -> [rows, inter]
  GemmPlan gemm2;        // [rows, inter] x [hidden, inter]^T -> finalize -> [T, hidden]
  PlanOrigin gemm1_origin;
  PlanOrigin gemm2_origin;
  // Both GEMMs and the combine in one launch of gemm1's tile
  // (MoeLayerOptions::fused_decode); the GEMMs' plans then hold that tile,
  // unsplit.
  bool fused_decode = false;
  std::string describe() const;  // multi-line, for the CLI
};

// A layer's weights already in GPU memory, stacked per expert as inference
// engines hold a ModelOpt NVFP4 MoE (device pointers of the current device;
// every tensor contiguous, row-major). Only read: prepare_device() packs its
// own copy.
struct MoeDeviceWeights {
  int64_t num_experts = 0;
  int64_t hidden = 0;                  // H
  int64_t inter = 0;                   // I
  const uint8_t* w13 = nullptr;        // u8 [E, 2 I, H/2]: gate rows, then up rows
  const uint8_t* w13_scale = nullptr;  // e4m3 [E, 2 I, H/16]
  // fp32 [E] (gate and up share it, as ModelOpt writes) or, with
  // w13_scale_2_per_half, [E, 2] = {gate, up}: both are applied exactly.
  const float* w13_scale_2 = nullptr;
  bool w13_scale_2_per_half = false;
  const uint8_t* w2 = nullptr;        // u8 [E, H, I/2]
  const uint8_t* w2_scale = nullptr;  // e4m3 [E, H, I/16]
  const float* w2_scale_2 = nullptr;  // fp32 [E]
  // Optional biases (gpt-oss), both or neither.
  const float* w13_bias = nullptr;  // fp32 [E, 2 I]: gate biases, then up biases
  const float* w2_bias = nullptr;   // fp32 [E, H]
  // Optional activation scales (W4A4), both or neither: GEMM1's input
  // (gate/up's input_scale) and GEMM2's (down_proj's), as the engines hold
  // them (fp4moe::InputScaleExtent): [E] each by default, w13's [E, 2] =
  // {gate, up} as loaded (GEMM1's input is then quantised with the larger,
  // gemm1_input_scale), or one value for every expert. Checked as the
  // checkpoint loader checks input_scale tensors (valid_input_scale).
  const float* w13_input_scale = nullptr;  // fp32 [E], [E, 2] or [1]
  const float* w2_input_scale = nullptr;   // fp32 [E] or [1]
  InputScaleExtent w13_input_scale_extent = InputScaleExtent::kPerExpert;
  InputScaleExtent w2_input_scale_extent = InputScaleExtent::kPerExpert;
};

// One forward's inputs (device pointers).
struct MoeForwardArgs {
  const void* hidden_states = nullptr;  // bf16 [num_tokens, hidden], 16-byte aligned
  int64_t num_tokens = 0;
  // Either router logits (routing computed on the device) ...
  const float* router_logits = nullptr;  // fp32 [num_tokens, num_experts]
  // A weight: read before the previous kernel in the stream ends
  // (docs/design.md §3), so that kernel must not write it.
  const float* correction_bias = nullptr;  // fp32 [num_experts], kNoauxTc only; null = zeros
  // ... or the caller's routing (both set, router_logits null).
  const int32_t* topk_ids = nullptr;    // int32 [num_tokens, top_k]
  const float* topk_weights = nullptr;  // fp32 [num_tokens, top_k]
};

class MoeLayer {
 public:
  // Validates the weights (shapes, finite global scales, biases) and
  // uploads them, repacked, to the current device. Gate and up may have
  // different global scales: each is applied exactly. A shared expert
  // (MoeWeights::shared_expert) runs in the same grouped GEMMs as
  // shared_expert->inter / inter extra experts that every token routes to,
  // weighted 1 or sigmoid(gate · x); its width must be a multiple of inter
  // (refused otherwise), and top_k plus those chunks at most 32 rows per token. Throws fp4moe::Error
  // with what was wrong. This is the expensive one-time step. When an
  // allocation or upload fails (out of device memory), whatever was allocated
  // is freed before the error propagates.
  static MoeLayer prepare(const MoeWeights& weights, const MoeLayerOptions& options = {});
  // The same from weights already on the GPU (`weights`' device must be the
  // current one): repacked there by GPU kernels, ordered on `stream`, which
  // is synchronised once to check the block and global scales. The result
  // equals prepare() on the same weights, byte for byte.
  static MoeLayer prepare_device(const MoeDeviceWeights& weights, const MoeLayerOptions& options = {},
                                 cudaStream_t stream = nullptr);
  // load_moe_weights(path, prefix) then prepare().
  static MoeLayer load(const std::string& path, const std::string& prefix, const MoeLayerOptions& options = {});

  MoeLayer(MoeLayer&&) noexcept;
  MoeLayer& operator=(MoeLayer&&) noexcept;
  ~MoeLayer();

  int64_t num_experts() const;
  int64_t hidden() const;
  int64_t inter() const;
  int top_k() const;
  const MoeLayerOptions& options() const;
  // options().activations resolved for these weights: kBf16 or kFp4.
  ActivationNumerics activation_numerics() const;
  size_t device_weight_bytes() const;  // what prepare() uploaded
  int device() const;                  // the CUDA device prepare() uploaded to

  // Plans held now (one per recently used token count), and the bound.
  size_t cached_plans() const;
  static size_t plan_cache_capacity();

  MoeLayerPlan plan(int64_t num_tokens) const;

  // Workspace for any forward of up to max_tokens tokens. Allocate it once,
  // zero it once (cudaMemset); forwards leave it ready for the next one.
  //
  // The contract: a workspace of workspace_bytes(N) bytes serves every
  // forward of 1 .. N tokens. Each forward computes the bytes its own token
  // count needs (its plan's scratch) and is refused with fp4moe::Error,
  // naming both figures, before anything is launched when the workspace is
  // smaller; no forward touches memory past the bytes it is given. A count
  // above N may still fit (the split-K partials of small counts can make
  // workspace_bytes(N) larger than a larger count needs) and then runs
  // correctly: the byte count is what is checked, not N, which the layer
  // cannot know. Callers that must refuse every count above their maximum
  // (the Python MoeLayer's max_tokens) check it themselves.
  size_t workspace_bytes(int64_t max_tokens) const;

  // output: bf16 [num_tokens, hidden], 16-byte aligned. Validates every
  // argument on the host before any launch; launches only (no allocation, no
  // host synchronisation); num_tokens = 0 does nothing. Caller-given routing
  // has options().routing.top_k slots per token; an id of -1 marks an absent
  // slot (served elsewhere, e.g. by another rank) and contributes nothing.
  // Other expert ids out of range are reported by device_errors(); their
  // slots contribute nothing either.
  void forward(const MoeForwardArgs& args, void* output, void* workspace, size_t workspace_bytes,
               cudaStream_t stream) const;

  // The forward without its last step, for callers that sum the top-k rows
  // themselves (expert parallelism): pair_rows, bf16 [num_tokens * top_k,
  // hidden] and 16-byte aligned, receives at row token * top_k + slot the
  // router-weighted expert output of every slot with a valid id, rounded
  // once to bf16 (nearest even): exactly the rows the deterministic finalize
  // sums in slot order, in fp32 from 0.0f, before rounding the sum to bf16
  // once. Rows of absent slots are left as they were. Needs
  // FinalizeMode::kDeterministic and a layer without a shared expert (its
  // rows have no place in that layout).
  void forward_pair_rows(const MoeForwardArgs& args, void* pair_rows, void* workspace, size_t workspace_bytes,
                         cudaStream_t stream) const;

  // Device-side errors recorded in `workspace` by earlier forwards (expert
  // ids out of range, non-finite router logits, whose experts are excluded
  // as docs/design.md §3 says), then clears them; synchronises the stream.
  // Empty when there were none.
  std::string device_errors(void* workspace, cudaStream_t stream) const;

 private:
  struct Impl;
  friend class MoeLayerInternals;  // src/layer/moe_layer_internals.hpp: benchmark-only variants
  explicit MoeLayer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace fp4moe
