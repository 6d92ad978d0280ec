// What both grouped-GEMM kernel families share (portable_grouped_gemm.cuh,
// sm90_grouped_gemm.cuh): the launch parameters, the device-side error bits,
// the work-unit schedule built from the expert offsets, the fp4 -> bf16
// dequantisation of one m16 x k16 A fragment, and the SwiGLU activations.
// Tested through both families in tests/kernels/test_grouped_gemm.cpp.
#pragma once

#include <cuda.h>  // CUtensorMap (a plain struct; nothing of the driver API is called here)
#include <cuda_bf16.h>

#include <cstdint>

#include "kernels/act_quant.cuh"
#include "kernels/bf16x4.cuh"
#include "kernels/fragment_layout.hpp"
#include "kernels/ptx/mma.cuh"
#include "kernels/timeline.cuh"
#include "plan/smem_model.hpp"

namespace fp4moe::kernels {

// The timeline's name of a grouped GEMM launch (timeline.hpp).
constexpr TimelineKernel gemm_timeline_kernel(Epilogue epilogue) {
  return epilogue == Epilogue::kSwiglu     ? TimelineKernel::kGemm1
         : epilogue == Epilogue::kFinalize ? TimelineKernel::kGemm2
                                           : TimelineKernel::kGemm;
}

// Bits of the device-side error word at the start of the workspace.
inline constexpr int kErrorOffsetsNotMonotone = 1;
inline constexpr int kErrorOffsetsOutOfRange = 2;
inline constexpr int kErrorGatherRowOutOfRange = 8;  // 4 is the layer's (moe_ops.hpp)
// SM90 family: dynamic shared memory did not start on a 1024-byte boundary
// (the swizzled activation atoms need it); the launch computed nothing.
inline constexpr int kErrorSmemMisaligned = 16;

// Activation of the kSwiglu epilogue (fp4moe::Activation).
inline constexpr int kActSwiglu = 0;  // silu(gate) * up
inline constexpr int kActGptOss = 1;  // g = min(gate, 7), l = clamp(up, -7, 7), g sigma(1.702 g) (l + 1)

struct GroupedGemmParams {
  const uint8_t* weights;         // [E][n_pad/16][k_pad/64][512] fragment-ordered fp4
  const uint8_t* scales;          // [E][n_pad/16][k_pad/64][64] scale codes
  const float* global_scales;     // [E] weight_scale_2
  const float* up_global_scales;  // kSwiglu: [E] the up rows' weight_scale_2; null: global_scales
  const __nv_bfloat16* x;         // [x_rows, k] activations
  const int32_t* gather_rows;     // [num_rows] x row of each problem row; null: identity
  int x_rows;                     // rows of x (gather bound)
  const int32_t* expert_offsets;  // [E + 1] first row of each expert; [E] = num_rows
  __nv_bfloat16* y;               // kNone [num_rows, n], kSwiglu [num_rows, n/2] bf16
  const float* bias;              // optional fp32 [E][n]: kSwiglu gate then up biases, kFinalize per column
  int activation;                 // kSwiglu: kAct*
  // kSwiglu, W4A4: [E] down_proj's input_scale; the output is quantised to
  // NVFP4 per 16 features against it and stored as e2m1 x e4m3 (exact in
  // bf16; GEMM2's epilogue applies the input_scale). Null: plain bf16.
  const float* act_quant_scales;
  const int32_t* scatter_rows;  // kFinalize [num_rows]: output slot of each row
  const float* row_weights;     // kFinalize: router weight per slot (indexed by scatter row)
  // kFinalize, the one of its mode (row = slot / out_row_divisor): with
  // atomic_out, out_f32 fp32 [out_rows, n], added into; without, out_bf16
  // bf16 [out_rows, n], one row per slot, stored.
  // NOTE: one pointer: a parameter block 8 bytes longer made ptxas spill 4
  // bytes in the SM90 m8 (k128, 9 stages) kernels of every epilogue.
  union {
    float* out_f32;
    __nv_bfloat16* out_bf16;
  };
  int out_rows;
  int out_row_divisor;     // kFinalize: 1 (one row per slot) or top_k (one per token)
  int atomic_out;          // kFinalize: add atomically instead of storing
  int32_t* error_flags;    // workspace: kError* bits, sticky
  int32_t* tile_counters;  // workspace: split-K arrivals per tile, zero at rest
  float* partials;         // workspace: split-K fp32 tiles [tile][slice][BLOCK_N][BLOCK_M]
  int num_experts;
  int n;         // output features (logical)
  int k;         // reduction length (logical)
  int n_groups;  // n_pad / 16
  int k_frags;   // k_pad / 64
  int num_rows;
  int split_k;  // k-slices per tile
  // Experts whose row count lies outside [min_expert_rows, max_expert_rows]
  // get no tiles in this launch (GemmPlan::row_classes); 0 and
  // INT32_MAX take every expert.
  int min_expert_rows;
  int max_expert_rows;
  // GroupedGemmArgs::indices_before_previous_kernel: the portable kernel
  // reads the offsets and rows and copies its first weights before it waits
  // for the previous grid.
  int early_weights;
  // SM90 family, activations not gathered: x as a 2-D tensor map ([x_rows,
  // k] bf16, boxes of 64 k x sm90_mma_width_step(BLOCK_M, blocks per SM) rows, 128-byte
  // swizzle, zeros outside), read by the kernel through its __grid_constant__
  // parameter. x_map_valid = 0: the producer copies rows with cp.async.
  int x_map_valid;
  CUtensorMap x_map;
};

namespace detail {

// Builds s_prefix[e] = number of m-tiles of experts < e (e = 0..E) from the
// device offsets; flags malformed offsets. All threads participate.
template <int THREADS, int BLOCK_M>
__device__ __forceinline__ void build_schedule(const GroupedGemmParams& p, int32_t* s_prefix, int32_t* s_warp_sums) {
  constexpr int kPerThread = (kMaxExperts + THREADS - 1) / THREADS;
  const int tid = threadIdx.x;
  const int lane = tid % 32;
  const int warp = tid / 32;
  int counts[kPerThread];
  int local_sum = 0;
  int bad = 0;
#pragma unroll
  for (int i = 0; i < kPerThread; ++i) {
    const int e = tid * kPerThread + i;
    int tiles = 0;
    if (e < p.num_experts) {
      const int begin = __ldg(p.expert_offsets + e);
      const int end = __ldg(p.expert_offsets + e + 1);
      if (end < begin) bad |= kErrorOffsetsNotMonotone;
      if (begin < 0 || end > p.num_rows) bad |= kErrorOffsetsOutOfRange;
      // Malformed offsets produce no work rather than out-of-bounds accesses.
      const int rows = (end > begin && begin >= 0 && end <= p.num_rows) ? end - begin : 0;
      if (rows >= p.min_expert_rows && rows <= p.max_expert_rows) tiles = (rows + BLOCK_M - 1) / BLOCK_M;
    }
    counts[i] = tiles;
    local_sum += tiles;
  }
  if (bad && p.error_flags) atomicOr(p.error_flags, bad);
  // Exclusive scan of local sums: within the warp, then across warps.
  int inclusive = local_sum;
#pragma unroll
  for (int d = 1; d < 32; d *= 2) {
    const int v = __shfl_up_sync(0xffffffffu, inclusive, d);
    if (lane >= d) inclusive += v;
  }
  if (lane == 31) s_warp_sums[warp] = inclusive;
  __syncthreads();
  int warp_base = 0;
  for (int w = 0; w < warp; ++w) warp_base += s_warp_sums[w];
  int running = warp_base + inclusive - local_sum;
#pragma unroll
  for (int i = 0; i < kPerThread; ++i) {
    const int e = tid * kPerThread + i;
    if (e <= kMaxExperts) s_prefix[e] = running;
    running += counts[i];
  }
  if (tid == THREADS - 1) s_prefix[kMaxExperts] = running;
  __syncthreads();
}

// Finds the expert owning unit `unit`: the largest e with prefix[e] * units_per_mtile <= unit.
__device__ __forceinline__ int find_expert(const int32_t* s_prefix, int num_experts, int64_t unit,
                                           int units_per_mtile) {
  int lo = 0, hi = num_experts - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (static_cast<int64_t>(s_prefix[mid]) * units_per_mtile <= unit)
      lo = mid;
    else
      hi = mid - 1;
  }
  return lo;
}

// One work unit: rows [row_begin, row_begin + rows_valid) of `expert`
// against weight rows [n_tile * BLOCK_N, +BLOCK_N), k-tiles
// [kt_begin, kt_begin + num_k_tiles) (split-K slice `slice`).
struct WorkUnit {
  int expert;
  int n_tile;
  int slice;
  int m_tile;
  int row_begin;
  int rows_valid;
  int kt_begin;
  int num_k_tiles;
};

// Units are numbered with m-tiles fastest, so blocks running side by side
// share a weight tile in L2 when an expert has many rows.
template <int BLOCK_M>
__device__ __forceinline__ WorkUnit decode_unit(const GroupedGemmParams& p, const int32_t* s_prefix, int64_t unit,
                                                int units_per_mtile, int k_tiles_total) {
  WorkUnit u;
  u.expert = find_expert(s_prefix, p.num_experts, unit, units_per_mtile);
  const int64_t local = unit - static_cast<int64_t>(s_prefix[u.expert]) * units_per_mtile;
  const int m_tiles_e = s_prefix[u.expert + 1] - s_prefix[u.expert];
  const int ns = static_cast<int>(local / m_tiles_e);
  u.m_tile = static_cast<int>(local % m_tiles_e);
  u.n_tile = ns / p.split_k;
  u.slice = ns % p.split_k;
  u.row_begin = __ldg(p.expert_offsets + u.expert) + u.m_tile * BLOCK_M;
  u.rows_valid = min(BLOCK_M, __ldg(p.expert_offsets + u.expert + 1) - u.row_begin);
  u.kt_begin = u.slice * k_tiles_total / p.split_k;
  u.num_k_tiles = (u.slice + 1) * k_tiles_total / p.split_k - u.kt_begin;
  return u;
}

// Eight fp4 codes (one fragment word) and the two rows' block scales as one
// bf16x2 {row g, row g + 8} -> the four A registers of one m16n8k16 MMA.
// NOTE: ptxas folds the half-broadcasts into the multiplies' operands
// (HMUL2 ... R.H0_H0 / R.H1_H1), so the pair costs nothing to split.
__device__ __forceinline__ void dequant_a_fragment(uint32_t codes, uint32_t scales, uint32_t (&a)[4]) {
  const uint32_t row_g = ptx::broadcast_low_bf16(scales);
  const uint32_t row_g8 = ptx::broadcast_high_bf16(scales);
  a[0] = ptx::mul_bf16x2(layout::placed_pair(codes, 0), row_g);
  a[1] = ptx::mul_bf16x2(layout::placed_pair(codes, 1), row_g8);
  a[2] = ptx::mul_bf16x2(layout::placed_pair(codes, 2), row_g);
  a[3] = ptx::mul_bf16x2(layout::placed_pair(codes, 3), row_g8);
}

// k-step `ks` of a lane's eight scale codes (fragment_layout.hpp: per k-step
// the codes of rows g and g + 8 side by side) -> bf16x2 {row g, row g + 8}.
__device__ __forceinline__ uint32_t scale_pair(uint2 codes, int ks) {
  const uint32_t word = ks < 2 ? codes.x : codes.y;
  const uint32_t spread = ptx::prmt(word, 0u, (ks % 2) ? 0x4342u : 0x4140u);  // 0x00hh00gg
  return spread * 16u + (layout::kScaleBf16Bias | (layout::kScaleBf16Bias << 16));
}

// The kSwiglu epilogue's activation of one (gate, up) pair, in fp32.
__device__ __forceinline__ float activate(int activation, float gate, float up) {
  if (activation == kActGptOss) {
    const float g = fminf(gate, 7.0f);
    const float l = fminf(fmaxf(up, -7.0f), 7.0f);
    return g / (1.0f + __expf(-1.702f * g)) * (l + 1.0f);
  }
  return gate / (1.0f + __expf(-gate)) * up;
}

// The up rows' epilogue scale of expert e (the gate rows' is `gate_scale`):
// gate and up may carry different weight_scale_2 (an engine's w13_scale_2
// [E, 2]); ModelOpt's exports share one, and the array is then absent.
__device__ __forceinline__ float up_epilogue_scale(const GroupedGemmParams& p, int e, float gate_scale) {
  return p.up_global_scales ? __ldg(p.up_global_scales + e) * layout::kEpilogueScale : gate_scale;
}

// The kSwiglu epilogue of output feature `feature` (< n/2) of expert e from
// the gate and up sums: scaled, biases added, activated, rounded to bf16.
__device__ __forceinline__ __nv_bfloat16 swiglu_output(const GroupedGemmParams& p, int e, int feature, float gate_sum,
                                                       float up_sum, float gate_scale, float up_scale) {
  float gate = gate_sum * gate_scale;
  float up = up_sum * up_scale;
  const int n_half = p.n / 2;
  if (p.bias && feature < n_half) {
    gate += __ldg(p.bias + static_cast<size_t>(e) * p.n + feature);
    up += __ldg(p.bias + static_cast<size_t>(e) * p.n + n_half + feature);
  }
  return __float2bfloat16_rn(activate(p.activation, gate, up));
}

// The kFinalize output row of `slot` (slot / out_row_divisor), or -1 for a
// slot out of range, reported in error_flags. Found once per row, where the
// row's slot is read: a division by the runtime divisor per 16-byte store
// was half of the SM90 finalize epilogue's instructions.
__device__ __forceinline__ int finalize_out_row(const GroupedGemmParams& p, int slot) {
  const int row = slot >= 0 ? slot / p.out_row_divisor : -1;
  if (row < 0 || row >= p.out_rows) {
    atomicOr(p.error_flags, kErrorGatherRowOutOfRange);
    return -1;
  }
  return row;
}

// The kFinalize bias of expert e's columns [col, col + 4) (zeros without one).
__device__ __forceinline__ float4 finalize_bias(const GroupedGemmParams& p, int e, int col) {
  if (!p.bias) return make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  return __ldg(reinterpret_cast<const float4*>(p.bias + static_cast<size_t>(e) * p.n + col));
}

// The kFinalize epilogue of four columns [col, col + 4) of one row (already
// scaled by the global scale): + bias (finalize_bias), x the slot's router
// weight, then added into the fp32 token row `out_row` with atomic_out, or
// else rounded once to bf16 (nearest even) and stored, one 8-byte store, to
// the bf16 (token, slot) row `out_row` (finalize_out_row). The epilogues
// stage fp32; only the deterministic rows' global store is bf16
// (docs/design.md §4.4).
__device__ __forceinline__ void finalize_store(const GroupedGemmParams& p, int out_row, int col, float4 v, float4 bias,
                                               float router_weight) {
  if (p.bias) {  // (without one, -0 stays -0 as before)
    v.x += bias.x;
    v.y += bias.y;
    v.z += bias.z;
    v.w += bias.w;
  }
  v.x *= router_weight;
  v.y *= router_weight;
  v.z *= router_weight;
  v.w *= router_weight;
  const size_t at = static_cast<size_t>(out_row) * p.n + col;
  if (p.atomic_out) {
    float* dst = p.out_f32 + at;
#if __CUDA_ARCH__ >= 900
    atomicAdd(reinterpret_cast<float4*>(dst), v);
#else
    atomicAdd(dst + 0, v.x);
    atomicAdd(dst + 1, v.y);
    atomicAdd(dst + 2, v.z);
    atomicAdd(dst + 3, v.w);
#endif
  } else {
    *reinterpret_cast<uint2*>(p.out_bf16 + at) = to_bf16x4(v);
  }
}

// Split-K: counts this slice of a tile in and says whether it was the last
// of split_k to arrive (the one that sums them); the last resets the counter
// for the next launch. One thread calls it, after a fence and a barrier
// that order every thread's partial-tile stores before it.
__device__ __forceinline__ bool last_slice_to_arrive(int32_t* counter, int split_k) {
  const bool last = atomicAdd(counter, 1) == split_k - 1;
  if (last) *counter = 0;
  return last;
}

}  // namespace detail

}  // namespace fp4moe::kernels
