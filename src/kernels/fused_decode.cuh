// The fused decode kernel (docs/design.md §4.8): a small forward's GEMM1 +
// SwiGLU, GEMM2 + finalize and the combine of each token's (token, slot)
// rows in one persistent launch, so that GEMM2's weights stream while GEMM1
// still runs instead of after it, and no kernel boundary waits for the
// slowest block of the one before.
//
// Work units are handed out in ticket order from one counter: every GEMM1
// unit (expert-major, as the grouped GEMM numbers them), then every GEMM2
// unit. A GEMM2 unit copies its first weight stages, then waits until all
// GEMM1 units of its m-tile (the rows it reads) have stored, then runs. A
// unit only waits on units of lower tickets, which blocks already running
// hold and finish without waiting, so the launch cannot deadlock whatever
// number of its blocks is resident. Each GEMM2 unit stores its bf16
// (token, slot) rows; for each (token, n-tile), the unit whose rows
// complete the token's slots sums them in slot order from 0 in fp32 and
// writes the token's bf16 output columns: the same bits as finalize_pairs
// (ops/finalize.cu), so the forward is bit-identical with and without this
// kernel for the same tile.
//
// Synchronisation: a unit's stores end in a barrier, after which one thread
// counts the unit in with a release (red.release.gpu; the combine's count,
// which also hands the rows to the last unit, with atom.acq_rel.gpu); a
// waiter loads the counter with ld.acquire.gpu, then a barrier. No
// sequentially consistent fence (__threadfence) per unit. The counters
// (FusedDecodeParams) are zero at rest: the last user of each resets it, so
// graph replays and the next forward find them zeroed.
//
// Tested in tests/layer/test_moe_layer_decode.cpp against the CPU reference
// and against the chain of launches, bit for bit.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "kernels/bf16x4.cuh"
#include "kernels/portable_grouped_gemm.cuh"
#include "kernels/timeline.cuh"

namespace fp4moe::kernels {

struct FusedDecodeParams {
  // Zero at rest, fused_decode_counter_ints() of them: [0] the ticket, [1]
  // blocks finished, then per m-tile (max_m_tiles each) the GEMM1 units
  // stored and the GEMM2 units run, then per (token, GEMM2 n-tile) the
  // (token, slot) rows stored.
  int32_t* counters;
  int max_m_tiles;
  // [num_tokens, rows_per_token] expert of each slot, for the slots that
  // have rows (ids < GEMM2's num_experts); null: every slot has a row.
  const int32_t* slot_experts;
  // bf16 [num_tokens, GEMM2 n]; null: no combine (the (token, slot) rows
  // in GEMM2's out_bf16 are the result).
  __nv_bfloat16* output;
  int num_tokens;
  int rows_per_token;
};

namespace detail {

__device__ __forceinline__ int load_acquire(const int32_t* p) {
  int v;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void add_release(int32_t* p, int v) {
  asm volatile("red.release.gpu.global.add.s32 [%0], %1;\n" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ int add_acq_rel(int32_t* p, int v) {
  int old;
  asm volatile("atom.acq_rel.gpu.global.add.s32 %0, [%1], %2;\n" : "=r"(old) : "l"(p), "r"(v) : "memory");
  return old;
}

// The slots of `token` that have rows, as bits (slot order).
__device__ __forceinline__ uint32_t slots_with_rows(const FusedDecodeParams& d, int num_experts, int token) {
  if (d.slot_experts == nullptr) return d.rows_per_token >= 32 ? ~0u : (1u << d.rows_per_token) - 1u;
  uint32_t bits = 0;
  for (int s = 0; s < d.rows_per_token; ++s) {
    const int32_t id = __ldg(d.slot_experts + static_cast<int64_t>(token) * d.rows_per_token + s);
    if (static_cast<uint32_t>(id) < static_cast<uint32_t>(num_experts)) bits |= 1u << s;
  }
  return bits;
}

}  // namespace detail

template <int BLOCK_N, int BLOCK_M, int BLOCK_K, int STAGES, int WARPS>
__global__ void __launch_bounds__(WARPS * 32, 2)
    portable_fused_decode_kernel(const GroupedGemmParams p1, const GroupedGemmParams p2, const FusedDecodeParams d) {
  using Tile1 = detail::PortableTile<BLOCK_N, BLOCK_M, BLOCK_K, STAGES, WARPS, Epilogue::kSwiglu>;
  using Tile2 = detail::PortableTile<BLOCK_N, BLOCK_M, BLOCK_K, STAGES, WARPS, Epilogue::kFinalize>;
  constexpr PortableSmemLayout L = Tile2::L;
  // One carving serves both GEMMs' units: only the epilogue staging, inside
  // the drained ring, differs.
  static_assert(Tile1::L.rows_offset == L.rows_offset && Tile1::L.schedule_offset == L.schedule_offset &&
                    Tile1::L.flag_offset == L.flag_offset && Tile1::L.total_bytes == L.total_bytes,
                "GEMM1's and GEMM2's units need the same shared-memory regions");
  constexpr int THREADS = WARPS * 32;
  constexpr int K_FRAGS = BLOCK_K / kFragK;

  FP4MOE_TIMELINE_SPAN(TimelineKernel::kFusedDecode);
  extern __shared__ __align__(128) uint8_t smem[];
  int32_t* s_prefix = reinterpret_cast<int32_t*>(smem + L.schedule_offset);  // (kMaxExperts + 1)
  int32_t* s_warp_sums = s_prefix + kMaxExperts + 1;                         // (32)
  int32_t* s_flag = reinterpret_cast<int32_t*>(smem + L.flag_offset);        // [0] split-K's; [1] the ticket
  // After a GEMM2 unit: per row, the token this block combines, or -1 (the
  // unit's gather rows are dead by then).
  int32_t* s_combine = reinterpret_cast<int32_t*>(smem + L.rows_offset);
  const int32_t* s_out_row = s_combine + BLOCK_M;  // the GEMM2 unit's (token, slot) rows

  const int tid = threadIdx.x;
  ptx::wait_for_prior_grids();  // the routing's offsets, rows and weights; the gathered x
  ptx::allow_dependent_launch();
  detail::build_schedule<THREADS, BLOCK_M>(p1, s_prefix, s_warp_sums);

  int32_t* ticket = d.counters;
  int32_t* finished = d.counters + 1;
  int32_t* gemm1_stored = d.counters + 2;             // [max_m_tiles]
  int32_t* gemm2_run = gemm1_stored + d.max_m_tiles;  // [max_m_tiles]
  int32_t* combine = gemm2_run + d.max_m_tiles;       // [num_tokens][n_tiles2]
  const int n_tiles1 = (p1.n + BLOCK_N - 1) / BLOCK_N;
  const int n_tiles2 = (p2.n + BLOCK_N - 1) / BLOCK_N;
  const int m_tiles = s_prefix[p1.num_experts];
  const int units1 = m_tiles * n_tiles1;
  const int units = units1 + m_tiles * n_tiles2;

  // A token without any slot that has rows gets zeros, as finalize_pairs
  // writes them; its columns are never combined.
  if (d.output != nullptr && d.slot_experts != nullptr && blockIdx.x == gridDim.x - 1) {
    for (int t = 0; t < d.num_tokens; ++t) {
      if (detail::slots_with_rows(d, p2.num_experts, t) != 0) continue;
      for (int c = tid * 4; c < p2.n; c += THREADS * 4)
        *reinterpret_cast<uint2*>(d.output + static_cast<int64_t>(t) * p2.n + c) = make_uint2(0u, 0u);
    }
  }

  if (tid == 0) s_flag[1] = atomicAdd(ticket, 1);
  __syncthreads();
  int unit = s_flag[1];
  [[maybe_unused]] unsigned long long gemm1_start = 0, gemm2_start = 0;
  while (unit < units) {
    // The next ticket is fetched while this unit runs.
    int next = 0;
    if (tid == 0) next = atomicAdd(ticket, 1);
    if (unit < units1) {
      if (gemm1_start == 0) gemm1_start = FP4MOE_TIMELINE_NOW();
      const detail::WorkUnit u = detail::decode_unit<BLOCK_M>(p1, s_prefix, unit, n_tiles1, p1.k_frags / K_FRAGS);
      detail::portable_unit<BLOCK_N, BLOCK_M, BLOCK_K, STAGES, WARPS, Epilogue::kSwiglu>(p1, smem, s_prefix, u, false,
                                                                                         [] {});
      // (The unit ended in a barrier after its stores.)
      if (tid == 0) detail::add_release(gemm1_stored + s_prefix[u.expert] + u.m_tile, 1);
      FP4MOE_TIMELINE_MARK(TimelineKernel::kGemm1, gemm1_start);
    } else {
      if (gemm2_start == 0) gemm2_start = FP4MOE_TIMELINE_NOW();
      const detail::WorkUnit u =
          detail::decode_unit<BLOCK_M>(p2, s_prefix, unit - units1, n_tiles2, p2.k_frags / K_FRAGS);
      const int m_tile = s_prefix[u.expert] + u.m_tile;
      detail::portable_unit<BLOCK_N, BLOCK_M, BLOCK_K, STAGES, WARPS, Epilogue::kFinalize>(
          p2, smem, s_prefix, u, true, [&] {
            if (tid == 0)
              while (detail::load_acquire(gemm1_stored + m_tile) < n_tiles1) __nanosleep(32);
            __syncthreads();
          });
      // The last of the m-tile's GEMM2 units resets both of its counters:
      // every other one has passed its wait.
      if (tid == 0 && atomicAdd(gemm2_run + m_tile, 1) == n_tiles2 - 1) {
        gemm2_run[m_tile] = 0;
        gemm1_stored[m_tile] = 0;
      }
      if (d.output != nullptr) {
        if (tid < BLOCK_M) {
          int token = -1;
          const int out_row = tid < u.rows_valid ? s_out_row[tid] : -1;
          if (out_row >= 0) {
            const int t = out_row / d.rows_per_token;
            const int expected = __popc(detail::slots_with_rows(d, p2.num_experts, t));
            int32_t* arrivals = combine + static_cast<int64_t>(t) * n_tiles2 + u.n_tile;
            // Releases this unit's rows; the last one acquires the others'.
            if (detail::add_acq_rel(arrivals, 1) == expected - 1) {
              *arrivals = 0;
              token = t;
            }
          }
          s_combine[tid] = token;
        }
        __syncthreads();
        // The token's columns of this n-tile: its slots' bf16 rows summed
        // in slot order from 0 in fp32, rounded once (finalize_pairs).
        constexpr int CHUNKS = BLOCK_N / 4;
        const int n0 = u.n_tile * BLOCK_N;
        for (int r = 0; r < u.rows_valid; ++r) {
          const int t = s_combine[r];
          if (t < 0) continue;
          const uint32_t slots = detail::slots_with_rows(d, p2.num_experts, t);
          for (int c = tid; c < CHUNKS; c += THREADS) {
            const int col = n0 + c * 4;
            if (col >= p2.n) continue;
            float4 sum = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            for (int s = 0; s < d.rows_per_token; ++s) {
              if (!((slots >> s) & 1u)) continue;
              const float4 v = ldcg_bf16x4(reinterpret_cast<const uint2*>(
                  p2.out_bf16 + (static_cast<int64_t>(t) * d.rows_per_token + s) * p2.n + col));
              sum.x += v.x;
              sum.y += v.y;
              sum.z += v.z;
              sum.w += v.w;
            }
            *reinterpret_cast<uint2*>(d.output + static_cast<int64_t>(t) * p2.n + col) = to_bf16x4(sum);
          }
        }
      }
      FP4MOE_TIMELINE_MARK(TimelineKernel::kGemm2, gemm2_start);
    }
    if (tid == 0) s_flag[1] = next;
    __syncthreads();
    unit = s_flag[1];
  }
  // The last block out resets the ticket: every block took its last ticket
  // before it counted itself out.
  if (tid == 0) {
    if (detail::add_acq_rel(finished, 1) == static_cast<int>(gridDim.x) - 1) {
      *ticket = 0;
      *finished = 0;
    }
  }
}

}  // namespace fp4moe::kernels
