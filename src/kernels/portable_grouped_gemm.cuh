// The portable NVFP4 grouped GEMM (SM80 ... SM120): mma.sync + cp.async,
// <= 99 KB of shared memory in every compiled configuration.
//
// Swap AB: per expert e it computes Y^T[n, rows] = W_e[n, k] . X^T[k, rows],
// so weight rows fill the MMA's M side (16) and tokens its N side (8 per
// MMA): a tile of 1..8 tokens wastes no weight bandwidth. Weights arrive
// fragment-ordered (fragment_layout.hpp), are dequantised to bf16 in
// registers (fp4 x block scale, exact), and the fp32 global scale is applied
// in the epilogue.
//
// One persistent launch covers all experts. Work units are (expert, n-tile,
// k-slice, m-tile), enumerated from device-side expert offsets: each block
// turns the offsets into a prefix sum of m-tiles in shared memory, then
// strides over units. No host synchronisation anywhere, so the launch can be
// captured in a CUDA graph; experts with no rows produce no units.
//
// Split-K (k-slices > 1) writes fp32 partial tiles to the workspace; the last
// block to finish a tile (an atomic counter, reset to zero afterwards) sums the
// slices in slice order, so the result is deterministic.
//
// Activation rows may be gathered (row r of the problem reads x row
// gather_rows[r]), so GEMM1 reads hidden states in token order through the
// permutation. Epilogues (template parameter, docs/design.md §4.4):
//   kNone      y[row, n] = bf16(acc * global_scale)
//   kSwiglu    the tile's 16-row groups hold 8 gate rows then the 8 up rows of
//              the same features (interleave_gate_up()), so one thread holds
//              gate and up of a (feature, token) in registers:
//              y[row, n/2] = bf16(act(gate + bias_g, up + bias_u))
//   kFinalize  v = (acc * global_scale + bias[col]) * row_weights[s], with
//              s = scatter_rows[row], to row s / out_row_divisor: rounded to
//              bf16 and stored to out_bf16 (a (token, slot) row:
//              deterministic) or added atomically to out_f32 (a token row:
//              fast). The layer sums or converts afterwards.
//
// Tested in tests/kernels/test_grouped_gemm.cpp against the CPU reference.
#pragma once

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
#error "the fp4moe kernels need SM80 or newer (mma.sync bf16, cp.async): set CMAKE_CUDA_ARCHITECTURES"
#endif

#include <cuda_bf16.h>

#include <cstdint>

#include "kernels/grouped_gemm_common.cuh"
#include "kernels/ptx/cp_async.cuh"
#include "kernels/ptx/grid_dependency.cuh"
#include "kernels/ptx/mma.cuh"

namespace fp4moe::kernels {

namespace detail {

// The tile's shapes and shared-memory regions, as the kernels below carve
// them from the layout of portable_smem_layout().
template <int BLOCK_N, int BLOCK_M, int BLOCK_K, int STAGES, int WARPS, Epilogue EPI>
struct PortableTile {
  static constexpr PortableSmemLayout L = portable_smem_layout(BLOCK_N, BLOCK_M, BLOCK_K, STAGES, EPI);
  static_assert(L.total_bytes <= kPortableSmemLimit, "config exceeds the 99 KB portable budget");
  static constexpr int THREADS = WARPS * 32;
  static_assert((BLOCK_N / WARPS) % 16 == 0 && BLOCK_M % 8 == 0 && BLOCK_N == layout::kPadN &&
                    layout::kPadK % BLOCK_K == 0 && BLOCK_M <= THREADS,
                "unsupported tile shape");
};

// One work unit, start to finish: its row indices, the STAGES-deep cp.async
// ring over its k-tiles, the epilogue (with the split-K fix-up), ending in a
// barrier after its stores. s_prefix is the block's schedule
// (build_schedule). With weights_first, the unit's first STAGES - 1 weight
// stages are copied before before_activations() runs and before any
// activation is read (they join the first stage's commit group, so the
// mainloop's group count holds): the caller waits there for the
// activations' writer.
template <int BLOCK_N, int BLOCK_M, int BLOCK_K, int STAGES, int WARPS, Epilogue EPI, typename BeforeActivations>
__device__ __forceinline__ void portable_unit(const GroupedGemmParams& p, uint8_t* smem, const int32_t* s_prefix,
                                              const WorkUnit& u, bool weights_first,
                                              BeforeActivations&& before_activations) {
  constexpr PortableSmemLayout L = PortableTile<BLOCK_N, BLOCK_M, BLOCK_K, STAGES, WARPS, EPI>::L;
  constexpr int THREADS = WARPS * 32;
  constexpr int WARP_ROWS = BLOCK_N / WARPS;     // weight rows per warp
  constexpr int ROW_TILES = WARP_ROWS / 16;      // 16-weight-row MMA tiles per warp (the MMA M side)
  constexpr int TOKEN_TILES = BLOCK_M / 8;       // 8-token MMA tiles (the MMA N side)
  constexpr int K_FRAGS = BLOCK_K / kFragK;      // 64-wide K fragments per stage
  constexpr int N_GROUPS = BLOCK_N / kFragRows;  // 16-row groups per tile
  constexpr int X_CHUNKS = BLOCK_K / 8;          // 16-byte chunks per activation row

  uint8_t* s_weights = smem + L.weight_offset;  // (STAGES, K_FRAGS, N_GROUPS, 512 B)
  uint8_t* s_scales = smem + L.scale_offset;    // (STAGES, K_FRAGS, N_GROUPS, 64 B)
  uint8_t* s_act = smem + L.act_offset;         // (STAGES, BLOCK_M, BLOCK_K) bf16, swizzled
  __nv_bfloat16* s_out = reinterpret_cast<__nv_bfloat16*>(smem + L.epilogue_offset);  // (BLOCK_M, epi_row_elems) bf16
  float* s_out_f32 = reinterpret_cast<float*>(smem + L.epilogue_offset);  // kFinalize: (BLOCK_M, epi_row_elems) fp32
  int32_t* s_gather = reinterpret_cast<int32_t*>(smem + L.rows_offset);   // (BLOCK_M) x row per tile row
  int32_t* s_out_row = s_gather + BLOCK_M;                                // (BLOCK_M) kFinalize output row, -1: none
  float* s_row_weight = reinterpret_cast<float*>(s_out_row + BLOCK_M);    // (BLOCK_M) router weight
  int32_t* s_flag = reinterpret_cast<int32_t*>(smem + L.flag_offset);

  const int tid = threadIdx.x;
  const int lane = tid % 32;
  const int warp = tid / 32;

  // ldmatrix addressing: lane supplies row (lane % 8) of matrix (lane / 8);
  // matrices alternate k halves (hi) and, for x4, pair two 8-token tiles.
  const int ldsm_row = lane % 8;
  const int ldsm_hi = (lane / 8) % 2;
  const uint32_t ldsm_lane_offset = ((TOKEN_TILES == 1 ? 0 : (lane / 16) * 8) + ldsm_row) * X_CHUNKS * 16;
  uint32_t ldsm_ks_offset[4];
#pragma unroll
  for (int ks = 0; ks < 4; ++ks) ldsm_ks_offset[ks] = ((2 * ks + ldsm_hi) ^ ldsm_row) * 16;

  const int n_tiles = (p.n + BLOCK_N - 1) / BLOCK_N;
  const int e = u.expert;
  const int n_tile = u.n_tile;
  const int slice = u.slice;
  const int m_tile = u.m_tile;
  const int row_begin = u.row_begin;
  const int rows_valid = u.rows_valid;
  const int kt_begin = u.kt_begin;
  const int num_k_tiles = u.num_k_tiles;

  // Row indices of the tile. Rows past the expert's end repeat its last row:
  // their columns of the result are never stored.
  if (tid < BLOCK_M) {
    const int row = row_begin + min(tid, rows_valid - 1);
    int src = row;
    if (p.gather_rows) {
      src = __ldg(p.gather_rows + row);
      if (src < 0 || src >= p.x_rows) {
        atomicOr(p.error_flags, kErrorGatherRowOutOfRange);
        src = 0;
      }
    }
    s_gather[tid] = src;
    if constexpr (EPI == Epilogue::kFinalize) {
      const int slot = __ldg(p.scatter_rows + row);
      const int out_row = finalize_out_row(p, slot);
      s_out_row[tid] = out_row;
      s_row_weight[tid] = (out_row >= 0 && p.row_weights) ? __ldg(p.row_weights + slot) : 1.0f;
    }
  }
  __syncthreads();

  // The tile's fragments, (K_pad/64, N_GROUPS) in the prepared layout: a
  // stage is one contiguous block.
  const size_t tile_frag0 = static_cast<size_t>(layout::fragment_index(e, n_tile * N_GROUPS, 0, p.n_groups, p.k_frags));
  const uint8_t* g_weights = p.weights + tile_frag0 * kFragBytes;
  const uint8_t* g_scales = p.scales + tile_frag0 * kFragScaleBytes;

  // ---- producer: one pipeline stage of weights and scales, then of
  // activations.
  auto load_weights = [&](int stage, int kt) {
    const int frag0 = kt * K_FRAGS;
    const uint32_t sw = ptx::smem_u32(s_weights + stage * L.weight_stage_bytes);
    constexpr int W_CHUNKS = N_GROUPS * K_FRAGS * (kFragBytes / 16);
#pragma unroll
    for (int j = 0; j < (W_CHUNKS + THREADS - 1) / THREADS; ++j) {
      const int i = tid + j * THREADS;
      if (W_CHUNKS % THREADS != 0 && i >= W_CHUNKS) break;
      ptx::cp_async_16(sw + i * 16, g_weights + static_cast<size_t>(frag0) * N_GROUPS * kFragBytes + i * 16, 16);
    }
    const uint32_t ss = ptx::smem_u32(s_scales + stage * L.scale_stage_bytes);
    constexpr int S_CHUNKS = N_GROUPS * K_FRAGS * (kFragScaleBytes / 16);
#pragma unroll
    for (int j = 0; j < (S_CHUNKS + THREADS - 1) / THREADS; ++j) {
      const int i = tid + j * THREADS;
      if (S_CHUNKS % THREADS != 0 && i >= S_CHUNKS) break;
      ptx::cp_async_16(ss + i * 16, g_scales + static_cast<size_t>(frag0) * N_GROUPS * kFragScaleBytes + i * 16, 16);
    }
  };
  auto load_activations = [&](int stage, int kt) {
    const uint32_t sa = ptx::smem_u32(s_act + stage * L.act_stage_bytes);
    constexpr int A_CHUNKS = BLOCK_M * X_CHUNKS;
#pragma unroll
    for (int j = 0; j < (A_CHUNKS + THREADS - 1) / THREADS; ++j) {
      const int i = tid + j * THREADS;
      if (A_CHUNKS % THREADS != 0 && i >= A_CHUNKS) break;
      const int r = i / X_CHUNKS;
      const int c = i % X_CHUNKS;
      const int kk = kt * BLOCK_K + c * 8;
      // K past the end is zero-filled.
      const int row = s_gather[r];
      const bool in_k = kk < p.k;
      const __nv_bfloat16* src = p.x + static_cast<size_t>(row) * p.k + (in_k ? kk : 0);
      ptx::cp_async_16(sa + (r * X_CHUNKS + (c ^ (r % 8))) * 16, src, in_k ? 16 : 0);
    }
  };

  float acc[ROW_TILES][TOKEN_TILES][4];
#pragma unroll
  for (int mt = 0; mt < ROW_TILES; ++mt)
#pragma unroll
    for (int nt = 0; nt < TOKEN_TILES; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[mt][nt][i] = 0.0f;

  // ---- mainloop: STAGES-deep cp.async ring. Under p.early_weights the
  // first unit's first weight stages are copied before the wait; they
  // join the first stage's commit group, so the mainloop's group count
  // holds.
  if (weights_first) {
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s)
      if (s < num_k_tiles) load_weights(s, kt_begin + s);
    before_activations();
  }
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < num_k_tiles) {
      if (!weights_first) load_weights(s, kt_begin + s);
      load_activations(s, kt_begin + s);
    }
    ptx::cp_async_commit();
  }
  for (int it = 0; it < num_k_tiles; ++it) {
    ptx::cp_async_wait<STAGES - 2>();
    __syncthreads();
    {
      const int next = it + STAGES - 1;
      if (next < num_k_tiles) {
        load_weights(next % STAGES, kt_begin + next);
        load_activations(next % STAGES, kt_begin + next);
      }
      ptx::cp_async_commit();
    }
    const int stage = it % STAGES;
    const uint8_t* w_stage = s_weights + stage * L.weight_stage_bytes;
    const uint8_t* s_stage = s_scales + stage * L.scale_stage_bytes;
    const uint32_t a_stage = ptx::smem_u32(s_act + stage * L.act_stage_bytes);
    // NOTE: fully unrolled: shared-memory addresses fold into immediates.
    // The loop is issue-bound (ncu: ~0.64 warps issued per scheduler per
    // cycle), so every address instruction saved is bandwidth gained.
#pragma unroll
    for (int kf = 0; kf < K_FRAGS; ++kf) {
      uint4 codes[ROW_TILES];
      uint2 scales[ROW_TILES];
#pragma unroll
      for (int mt = 0; mt < ROW_TILES; ++mt) {
        const int group = warp * ROW_TILES + mt;
        codes[mt] = *reinterpret_cast<const uint4*>(w_stage + (kf * N_GROUPS + group) * kFragBytes + lane * 16);
        scales[mt] =
            *reinterpret_cast<const uint2*>(s_stage + (kf * N_GROUPS + group) * kFragScaleBytes + (lane / 4) * 8);
      }
#pragma unroll
      for (int ks = 0; ks < 4; ++ks) {
        // B fragments: tokens x (k 0..7, k 8..15) of this k-step; chunk
        // kf*8 + 2ks + hi of row r sits at chunk (kf*8) + ((2ks + hi) ^ r).
        uint32_t b[TOKEN_TILES][2];
#pragma unroll
        for (int nt = 0; nt < TOKEN_TILES; nt += 2) {
          const uint32_t addr = a_stage + ldsm_lane_offset + ldsm_ks_offset[ks] + kf * 8 * 16 + nt * 8 * X_CHUNKS * 16;
          if constexpr (TOKEN_TILES == 1) {
            uint32_t v[2];
            ptx::ldmatrix_x2(v, addr);
            b[nt][0] = v[0];
            b[nt][1] = v[1];
          } else {
            uint32_t v[4];
            ptx::ldmatrix_x4(v, addr);
            b[nt][0] = v[0];
            b[nt][1] = v[1];
            b[nt + 1][0] = v[2];
            b[nt + 1][1] = v[3];
          }
        }
#pragma unroll
        for (int mt = 0; mt < ROW_TILES; ++mt) {
          const uint32_t word = ks == 0 ? codes[mt].x : ks == 1 ? codes[mt].y : ks == 2 ? codes[mt].z : codes[mt].w;
          uint32_t a[4];
          dequant_a_fragment(word, scale_pair(scales[mt], ks), a);
#pragma unroll
          for (int nt = 0; nt < TOKEN_TILES; ++nt) ptx::mma_m16n8k16_bf16(acc[mt][nt], a, b[nt][0], b[nt][1]);
        }
      }
    }
  }
  ptx::cp_async_wait<0>();
  __syncthreads();  // the pipeline buffers are drained: the epilogue may reuse them

  // ---- epilogue. Accumulator element i of (mt, nt) sits at weight row
  // g (+8 for i >= 2) of the warp's m-tile and token 2t (+1 for odd i).
  const int g = lane / 4;
  const int t = lane % 4;
  const float out_scale = __ldg(p.global_scales + e) * layout::kEpilogueScale;
  const float up_scale = up_epilogue_scale(p, e, out_scale);  // kSwiglu's up rows
  // kSwiglu: feature f of the tile (0 .. BLOCK_N/2) from its scaled gate
  // and up sums, biases added, activated.
  const int n_half = p.n / 2;
  auto swiglu = [&](int f, float gate_sum, float up_sum) {
    return swiglu_output(p, e, n_tile * (BLOCK_N / 2) + f, gate_sum, up_sum, out_scale, up_scale);
  };
  // Staging writes of one result, tile row f (weight row) and token tok.
  auto stage = [&](int f, int tok, float sum) {
    if constexpr (EPI == Epilogue::kFinalize)
      s_out_f32[tok * L.epi_row_elems + f] = sum * out_scale;
    else
      s_out[tok * L.epi_row_elems + f] = __float2bfloat16_rn(sum * out_scale);
  };
  bool store_tile = true;
  if (p.split_k > 1) {
    const int64_t tile_idx = static_cast<int64_t>(s_prefix[e] + m_tile) * n_tiles + n_tile;
    float* tile_partials = p.partials + tile_idx * p.split_k * (BLOCK_N * BLOCK_M);
    float* mine = tile_partials + slice * (BLOCK_N * BLOCK_M);  // (BLOCK_N, BLOCK_M) fp32
#pragma unroll
    for (int mt = 0; mt < ROW_TILES; ++mt)
#pragma unroll
      for (int nt = 0; nt < TOKEN_TILES; ++nt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int f = warp * WARP_ROWS + mt * 16 + g + h * 8;
          const int tok = nt * 8 + 2 * t;
          __stcg(reinterpret_cast<float2*>(mine + f * BLOCK_M + tok),
                 make_float2(acc[mt][nt][2 * h], acc[mt][nt][2 * h + 1]));
        }
    __threadfence();
    __syncthreads();
    if (tid == 0) {
      *s_flag = last_slice_to_arrive(p.tile_counters + tile_idx, p.split_k);
    }
    __syncthreads();
    store_tile = *s_flag != 0;
    if (store_tile) {
      __threadfence();
      // Sum the slices in slice order (deterministic), into the staging tile.
      auto sum_slices = [&](int f, int tok) {
        float4 sum = make_float4(0.f, 0.f, 0.f, 0.f);
        for (int s = 0; s < p.split_k; ++s) {
          const float4 v =
              __ldcg(reinterpret_cast<const float4*>(tile_partials + s * (BLOCK_N * BLOCK_M) + f * BLOCK_M + tok));
          sum.x += v.x;
          sum.y += v.y;
          sum.z += v.z;
          sum.w += v.w;
        }
        return sum;
      };
      if constexpr (EPI == Epilogue::kSwiglu) {
        for (int i = tid; i < BLOCK_N / 2 * BLOCK_M / 4; i += THREADS) {
          const int f = i / (BLOCK_M / 4);
          const int tok = (i % (BLOCK_M / 4)) * 4;
          const int gate_row = (f / 8) * 16 + f % 8;
          const float4 gs = sum_slices(gate_row, tok);
          const float4 us = sum_slices(gate_row + 8, tok);
          s_out[(tok + 0) * L.epi_row_elems + f] = swiglu(f, gs.x, us.x);
          s_out[(tok + 1) * L.epi_row_elems + f] = swiglu(f, gs.y, us.y);
          s_out[(tok + 2) * L.epi_row_elems + f] = swiglu(f, gs.z, us.z);
          s_out[(tok + 3) * L.epi_row_elems + f] = swiglu(f, gs.w, us.w);
        }
      } else {
        for (int i = tid; i < BLOCK_N * BLOCK_M / 4; i += THREADS) {
          const int f = i / (BLOCK_M / 4);
          const int tok = (i % (BLOCK_M / 4)) * 4;
          const float4 sum = sum_slices(f, tok);
          stage(f, tok + 0, sum.x);
          stage(f, tok + 1, sum.y);
          stage(f, tok + 2, sum.z);
          stage(f, tok + 3, sum.w);
        }
      }
    }
  } else {
#pragma unroll
    for (int mt = 0; mt < ROW_TILES; ++mt)
#pragma unroll
      for (int nt = 0; nt < TOKEN_TILES; ++nt) {
        if constexpr (EPI == Epilogue::kSwiglu) {
          // Rows g (gate) and g + 8 (up) of this 16-row group are one feature.
          const int f = (warp * WARP_ROWS + mt * 16) / 2 + g;
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const int tok = nt * 8 + 2 * t + h;
            s_out[tok * L.epi_row_elems + f] = swiglu(f, acc[mt][nt][h], acc[mt][nt][2 + h]);
          }
        } else {
#pragma unroll
          for (int i = 0; i < 4; ++i)
            stage(warp * WARP_ROWS + mt * 16 + g + (i / 2) * 8, nt * 8 + 2 * t + i % 2, acc[mt][nt][i]);
        }
      }
  }
  __syncthreads();
  if (store_tile) {
    if constexpr (EPI == Epilogue::kFinalize) {
      // (rows_valid, BLOCK_N) fp32 -> (+ bias) x router weight -> the slot's
      // bf16 row (8-byte stores) or the token's fp32 row (vector atomics).
      constexpr int OUT_CHUNKS = BLOCK_N / 4;
      const int n0 = n_tile * BLOCK_N;
      for (int i = tid; i < rows_valid * OUT_CHUNKS; i += THREADS) {
        const int r = i / OUT_CHUNKS;
        const int col = n0 + (i % OUT_CHUNKS) * 4;
        const int out_row = s_out_row[r];
        if (col >= p.n || out_row < 0) continue;
        const float4 v = *reinterpret_cast<const float4*>(s_out_f32 + r * L.epi_row_elems + col - n0);
        finalize_store(p, out_row, col, v, finalize_bias(p, e, col), s_row_weight[r]);
      }
    } else {
      // (rows_valid, OUT_N) bf16 -> Y rows, 16-byte stores; the output width
      // is a multiple of 8, so a chunk is wholly inside it or wholly past it.
      constexpr int OUT_N = EPI == Epilogue::kSwiglu ? BLOCK_N / 2 : BLOCK_N;
      constexpr int OUT_CHUNKS = OUT_N / 8;
      const int y_cols = EPI == Epilogue::kSwiglu ? n_half : p.n;
      const int n0 = n_tile * OUT_N;
      static_assert(EPI != Epilogue::kSwiglu || OUT_N % 16 == 0, "a SwiGLU tile must hold whole NVFP4 blocks");
      // W4A4 (kSwiglu with act_quant_scales): quantised to NVFP4 against
      // down_proj's input_scale on the way, a block of 16 features per pair
      // of threads (n0 and the output width are multiples of 16, so both
      // chunks of a block are stored or skipped together).
      const bool quantise = EPI == Epilogue::kSwiglu && p.act_quant_scales;
      const float input_scale = quantise ? __ldg(p.act_quant_scales + e) : 0.0f;
      for (int i = tid; i < rows_valid * OUT_CHUNKS; i += THREADS) {
        const int r = i / OUT_CHUNKS;
        const int c = i % OUT_CHUNKS;
        if (n0 + c * 8 >= y_cols) continue;
        uint4 v = *reinterpret_cast<const uint4*>(s_out + r * L.epi_row_elems + c * 8);
        if (quantise) fp4_quantize_bf16_half_block(v, input_scale);
        *reinterpret_cast<uint4*>(p.y + static_cast<size_t>(row_begin + r) * y_cols + n0 + c * 8) = v;
      }
    }
  }
  __syncthreads();  // the staging tile is read before the next unit's loads land
}

}  // namespace detail

// NOTE: the minimum of two resident blocks (what the shared memory allows)
// only bounds registers at 255: without it ptxas picked 168 for the m64
// finalize tile and spilled.
template <int BLOCK_N, int BLOCK_M, int BLOCK_K, int STAGES, int WARPS, Epilogue EPI>
__global__ void __launch_bounds__(WARPS * 32, 2) portable_grouped_gemm_kernel(const GroupedGemmParams p) {
  using Tile = detail::PortableTile<BLOCK_N, BLOCK_M, BLOCK_K, STAGES, WARPS, EPI>;
  constexpr PortableSmemLayout L = Tile::L;
  FP4MOE_TIMELINE_SPAN(gemm_timeline_kernel(EPI));
  extern __shared__ __align__(128) uint8_t smem[];
  int32_t* s_prefix = reinterpret_cast<int32_t*>(smem + L.schedule_offset);  // (kMaxExperts + 1)
  int32_t* s_warp_sums = s_prefix + kMaxExperts + 1;                         // (32)

  // Everything below reads what earlier kernels wrote (offsets, rows, x) or
  // writes what they may still read: wait for them when launched early;
  // with p.early_weights only before the first unit's activations.
  bool waited = p.early_weights == 0;  // uniform
  if (waited) {
    ptx::wait_for_prior_grids();
    ptx::allow_dependent_launch();
  }
  detail::build_schedule<Tile::THREADS, BLOCK_M>(p, s_prefix, s_warp_sums);

  const int n_tiles = (p.n + BLOCK_N - 1) / BLOCK_N;
  const int units_per_mtile = n_tiles * p.split_k;
  const int64_t num_units = static_cast<int64_t>(s_prefix[p.num_experts]) * units_per_mtile;
  const int k_tiles_total = p.k_frags / (BLOCK_K / kFragK);
  for (int64_t unit = blockIdx.x; unit < num_units; unit += gridDim.x) {
    const detail::WorkUnit u = detail::decode_unit<BLOCK_M>(p, s_prefix, unit, units_per_mtile, k_tiles_total);
    detail::portable_unit<BLOCK_N, BLOCK_M, BLOCK_K, STAGES, WARPS, EPI>(p, smem, s_prefix, u, !waited, [&] {
      ptx::wait_for_prior_grids();
      ptx::allow_dependent_launch();
    });
    waited = true;
  }
}

}  // namespace fp4moe::kernels
