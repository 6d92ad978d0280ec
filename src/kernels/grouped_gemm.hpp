// The NVFP4 grouped GEMM: Y[rows, n] = X[rows, k] . W_e[n, k]^T for the rows
// of each expert e, with W in NVFP4 and X, Y in bf16 (W4A16).
//
//   1. prepare_gemm_weights(): once, on the host, ModelOpt matrices -> the
//      kernel's fragment-ordered layout (upload the three arrays as they are).
//   2. plan_grouped_gemm(): picks a tile config and split-K for the problem
//      and the local GPU; grouped_gemm_workspace_bytes() sizes the workspace.
//   3. grouped_gemm(): one asynchronous launch for all experts. Per-expert row
//      offsets are read on the device; nothing synchronises with the host, so
//      the call can be captured in a CUDA graph.
//
// Tested in tests/kernels/test_grouped_gemm.cpp (GPU) and
// tests/kernels/test_grouped_gemm_args.cpp (argument validation, host packing).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <optional>
#include <span>
#include <vector>

#include "fp4moe/modelopt.hpp"
#include "fp4moe/plan.hpp"
#include "fp4moe/reference.hpp"  // Activation

namespace fp4moe {

// Weights of one grouped GEMM in the kernel's layout (host memory).
struct PreparedGemmWeights {
  int64_t num_experts = 0;
  int64_t n = 0;                     // output features
  int64_t k = 0;                     // reduction length
  int64_t n_padded = 0;              // n rounded up to 128 (zero codes past n)
  int64_t k_padded = 0;              // k rounded up to 256 (zero codes past k)
  std::vector<uint8_t> weights;      // [E][n_padded/16][k_padded/64][512] fp4 fragments
  std::vector<uint8_t> scales;       // [E][n_padded/16][k_padded/64][64] scale codes
  std::vector<float> global_scales;  // [E] weight_scale_2

  // Dequantised element (r, c) of expert e, read back from the packed form.
  float value(int64_t e, int64_t r, int64_t c) const;
};

// Packs experts' matrices, all [n, k]. Throws if shapes differ, k % 16 != 0,
// n % 16 != 0, a scale is NaN or negative, or there are more experts than a
// launch supports.
PreparedGemmWeights prepare_gemm_weights(std::span<const Nvfp4Matrix* const> experts);

// The [2 inter, k] matrix the kSwiglu epilogue expects: rows in groups of 16,
// 8 gate rows then the 8 up rows of the same features (row 16b + i is gate
// row 8b + i for i < 8, up row 8b + i - 8 otherwise), so one MMA tile holds
// both halves of each output feature. gate and up must have the same shape
// and rows % 8 == 0. The result carries gate's global scale; where up's
// differs, pass it as GroupedGemmArgs::up_global_scales.
Nvfp4Matrix interleave_gate_up(const Nvfp4Matrix& gate, const Nvfp4Matrix& up);

// Device pointers and sizes of one grouped GEMM call.
struct GroupedGemmArgs {
  // Prepared weights in device memory (PreparedGemmWeights' arrays, uploaded).
  const uint8_t* weights = nullptr;
  const uint8_t* scales = nullptr;
  const float* global_scales = nullptr;
  // kSwiglu only, optional: [E] global scales of the up rows, when they differ
  // from the gate rows' (global_scales then holds the gate rows').
  const float* up_global_scales = nullptr;
  // kSwiglu only, optional (W4A4): [E] the input_scale of the next GEMM's
  // activations (down_proj's). Each 16-feature block of the output is then
  // quantised to NVFP4 (nvfp4_activation.hpp) and stored as e2m1 x e4m3,
  // exact in bf16; the consumer applies the input_scale (fold it into
  // its global_scales).
  const float* act_quant_scales = nullptr;
  int64_t num_experts = 0;
  int64_t n = 0;
  int64_t k = 0;
  // Activations, bf16 [x_rows, k] row-major. Without gather_rows, x_rows =
  // num_rows and row r of the problem is x row r (rows grouped by expert);
  // with it, row r reads x row gather_rows[r] (device int32 [num_rows]).
  const void* x = nullptr;
  const int32_t* gather_rows = nullptr;
  int64_t x_rows = 0;  // 0: num_rows
  // Device int32 [num_experts + 1]: rows of expert e are
  // [offsets[e], offsets[e+1]); offsets[0] = 0, offsets[E] = num_rows.
  const int32_t* expert_offsets = nullptr;
  int64_t num_rows = 0;
  // Output, per plan.config.epilogue:
  //   kNone      y bf16 [num_rows, n].
  //   kSwiglu    weights made with interleave_gate_up(); y bf16 [num_rows, n/2]
  //              = activation(gate + bias[e][f], up + bias[e][n/2 + f]).
  //   kFinalize  row r of the problem, scaled, (+ bias[e][c]) x
  //              row_weights[s] with s = scatter_rows[r], goes to output row
  //              s / out_row_divisor: without atomic_out, rounded to bf16 and
  //              stored into out_bf16 (bf16 [out_rows, n], one row per slot:
  //              the deterministic combine's rows); with atomic_out, added
  //              atomically into out_f32 (fp32 [out_rows, n], one row per
  //              token). Exactly one of the two is set, 16-byte aligned.
  void* y = nullptr;
  Activation activation = Activation::kSwiGLU;
  const float* bias = nullptr;  // optional fp32 [num_experts][n], device
  const int32_t* scatter_rows = nullptr;
  const float* row_weights = nullptr;  // optional (1.0 when null), indexed by s
  float* out_f32 = nullptr;            // kFinalize with atomic_out
  void* out_bf16 = nullptr;            // kFinalize without atomic_out
  int64_t out_rows = 0;
  int out_row_divisor = 1;
  bool atomic_out = false;
  // Planning hint: experts expected to receive rows (0: as many as can).
  int64_t expected_active_experts = 0;
  // Zero-initialised once at allocation (cudaMemset); the kernel leaves it
  // ready for the next call. grouped_gemm_workspace_bytes() says how much.
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
  // Optional: the state that must stay zero between launches (device error
  // word, split-K tile counters) kept outside `workspace`, e.g. at a fixed
  // place of a larger workspace whose scratch layout changes between calls.
  // split_counters needs at least plan.max_tiles entries when split_k > 1.
  int32_t* error_flags = nullptr;
  int32_t* split_counters = nullptr;
  int64_t split_counters_capacity = 0;
  // Optional host copy of expert_offsets: when given, it is validated
  // (monotone, starting at 0, ending at num_rows) before launch.
  const int32_t* host_expert_offsets = nullptr;
  // Launch with programmatic dependent launch (SM90+; ignored before): the
  // kernel's blocks may become resident while the previous kernel in the
  // stream finishes, and wait for it on the device before touching memory.
  // Saves the launch gap between back-to-back kernels (an MoE layer's).
  bool programmatic_launch = false;
  // With programmatic_launch: everything the GEMM reads except x (expert
  // offsets, gather and scatter rows, router weights) was written before the
  // kernel preceding it in the stream started, as the layer's GEMM2 has it
  // (its routing ran before GEMM1). The portable kernel then builds its
  // schedule and starts copying its first unit's weights while that kernel
  // still runs, and waits for it only before the activations (the SM90
  // family, whose launches are long, waits at its start either way).
  bool indices_before_previous_kernel = false;
};

// Plans for the local GPU (its SM count and shared-memory limit) among the
// configs with `epilogue`. A forced config must be compiled and fit the
// device, else the call throws with the region-by-region breakdown; its
// epilogue field is replaced by `epilogue`.
GemmPlan plan_grouped_gemm(const GroupedGemmArgs& args, const std::optional<TileConfig>& forced = std::nullopt,
                           Epilogue epilogue = Epilogue::kNone);

// The same for a problem description (shapes, rows, epilogue) without
// pointers, e.g. to size a workspace ahead of the calls. With a forced
// config, split_k > 0 also forces the split (plan_gemm_with: 1 .. the
// config's k-tiles); 0 lets the planner choose it.
GemmPlan plan_grouped_gemm(const GemmProblem& problem, const std::optional<TileConfig>& forced = std::nullopt,
                           int split_k = 0);

size_t grouped_gemm_workspace_bytes(const GemmPlan& plan);

// Validates the arguments, then launches on `stream`. Throws fp4moe::Error
// before any launch on bad input (with what was expected), and after the
// launch if CUDA reports an error.
void grouped_gemm(const GroupedGemmArgs& args, const GemmPlan& plan, cudaStream_t stream);

// The fused decode kernel (kernels/fused_decode.cuh, docs/design.md §4.8):
// GEMM1 + SwiGLU (`gemm1`, the kSwiglu epilogue), GEMM2 + finalize
// (`gemm2`: kFinalize storing bf16 (token, slot) rows, out_row_divisor 1,
// its x gemm1's y) and, with `output`, the combine of each token's rows in
// one persistent launch of `tile` (epilogue and split-K ignored: every unit
// is a whole K). Both GEMMs share their experts and expert offsets.
struct FusedDecodeArgs {
  // Zero-initialised once, fused_decode_counter_ints() of them; the kernel
  // leaves them zero.
  int32_t* counters = nullptr;
  int64_t counters_capacity = 0;
  int64_t num_tokens = 0;
  int rows_per_token = 0;  // gemm2's rows are (token, slot) pairs: num_rows = num_tokens * rows_per_token
  // [num_tokens, rows_per_token] expert of each slot where some may have no
  // row (ids outside [0, num_experts)); null: every slot has one.
  const int32_t* slot_experts = nullptr;
  // bf16 [num_tokens, gemm2.n]: each token's (token, slot) rows summed in
  // slot order in fp32, rounded once (as launch_finalize_pairs); null: none.
  void* output = nullptr;
};
int64_t fused_decode_counter_ints(int64_t num_rows, int64_t num_tokens, int64_t gemm2_n);
// Validates like grouped_gemm(), then launches on `stream`.
void fused_decode(const GroupedGemmArgs& gemm1, const GroupedGemmArgs& gemm2, const FusedDecodeArgs& decode,
                  const TileConfig& tile, cudaStream_t stream);

// Device-side input errors seen by earlier launches using `workspace`
// (offsets not monotone, or outside [0, num_rows]; gather or scatter rows out
// of range); synchronises the stream.
// Returns an empty string when there were none.
std::string grouped_gemm_device_errors(const void* workspace, cudaStream_t stream);

// The kernel's static shared memory and the dynamic size it is launched
// with, as the CUDA runtime reports them, for a compiled config.
struct KernelAttributes {
  int64_t static_smem_bytes = 0;
  int64_t max_dynamic_smem_bytes = 0;
  int num_regs = 0;
  int64_t local_bytes = 0;  // spills and stack
  int blocks_per_sm = 0;
};
KernelAttributes grouped_gemm_kernel_attributes(const TileConfig& config);

}  // namespace fp4moe
