// The SM90a kernel's epilogues (sm90_grouped_gemm.cuh): after a unit's
// mainloop, the split-K fix-up (the last slice to land sums all slices in
// slice order) and the store of the unit's outputs. NONE and SWIGLU (the
// gpt-oss variant, biases, W4A4's quantised rows) stage each warpgroup's 64
// rows x CHUNK tokens token-major in a region of its own (the producer keeps
// filling the ring meanwhile) and write whole 16-byte chunks of output rows;
// FINALIZE stages fp32 and writes each row, weighted and rounded to bf16, to
// its output slot (or adds it in fp32 to the token's row), with the slots
// loaded while the mainloop runs.
#pragma once

#include "kernels/sm90/common.cuh"

namespace fp4moe::kernels::sm90 {

// A consumer thread's place: its warpgroup, its index among every consumer
// thread and within its warpgroup, and (kFinalize) its warpgroup's table of
// the unit's output rows (detail::finalize_out_row) and router weights,
// (BLOCK_M) int32 then (BLOCK_M) fp32.
struct EpilogueRoles {
  int consumer;  // 0 .. kSm90Consumers - 1
  int ctid;      // 0 .. 128 * kSm90Consumers - 1
  int wtid;      // 0 .. 127
  int n_half;    // p.n / 2: SWIGLU's output columns
  int32_t* out_rows;
  float* row_weights;
};

// The accumulator fragment's lanes: element 4j + 2h + i of a thread sits at
// warpgroup row warp * 16 + g + 8h, token 8j + 2t + i.
struct AccumulatorLanes {
  int warp;  // warp in the warpgroup
  int g;
  int t;
  // Derived from a value the compiler may not treat as known (see
  // unknown_to_compiler): it hoisted the staging addresses made from these
  // out of the unit loop, and ~8 registers live across the mainloop made
  // ptxas spill in the two-block tiles.
  __device__ __forceinline__ explicit AccumulatorLanes(const EpilogueRoles& roles) {
    const int wtid = unknown_to_compiler(roles.wtid);
    warp = wtid / 32;
    g = wtid % 32 / 4;
    t = wtid % 4;
  }
};

// kFinalize: the output slots of a unit's rows wtid, wtid + 128, ..., loaded
// when the unit starts so that the L2 round trip overlaps the mainloop.
template <class T>
struct FinalizeSlots {
  static constexpr int LOADS = T::EPI == Epilogue::kFinalize ? (T::BLOCK_M + 127) / 128 : 1;
  [[maybe_unused]] int32_t row_slots[LOADS];
  __device__ __forceinline__ void load(const GroupedGemmParams& p, const detail::WorkUnit& u, int wtid) {
    if constexpr (T::EPI == Epilogue::kFinalize) {
#pragma unroll
      for (int j = 0; j < LOADS; ++j) {
        const int r = wtid + 128 * j;
        row_slots[j] = r < u.rows_valid ? __ldg(p.scatter_rows + u.row_begin + r) : -1;
      }
    }
  }
};

// Split-K: stores this slice's partial tile, and in the block whose slice
// lands last (the counter's last arrival) sums every slice in slice order
// into acc and returns true; the other blocks return false (nothing to store).
template <class T>
__device__ __forceinline__ bool sum_split_k_slices(const GroupedGemmParams& p, const Shared<T>& sh,
                                                   const detail::WorkUnit& u, int n_tiles, const EpilogueRoles& roles,
                                                   const AccumulatorLanes& lanes, float (&acc)[T::NACC]) {
  constexpr int BLOCK_M = T::BLOCK_M;
  constexpr int BLOCK_N = T::BLOCK_N;
  const int row0 = roles.consumer * kSm90WarpgroupRows + lanes.warp * 16 + lanes.g;
  const int t = lanes.t;
  const int64_t tile_idx = static_cast<int64_t>(sh.prefix[u.expert] + u.m_tile) * n_tiles + u.n_tile;
  float* tile_partials = p.partials + tile_idx * p.split_k * (BLOCK_N * BLOCK_M);
  float* mine = tile_partials + u.slice * (BLOCK_N * BLOCK_M);  // (BLOCK_N, BLOCK_M) fp32
#pragma unroll
  for (int j = 0; j < BLOCK_M / 8; ++j)
#pragma unroll
    for (int h = 0; h < 2; ++h)
      __stcg(reinterpret_cast<float2*>(mine + (row0 + 8 * h) * BLOCK_M + 8 * j + 2 * t),
             make_float2(acc[4 * j + 2 * h], acc[4 * j + 2 * h + 1]));
  __threadfence();
  ptx::named_barrier_sync(kBarConsumers, 128 * kSm90Consumers);
  if (roles.ctid == 0) {
    *sh.flag = detail::last_slice_to_arrive(p.tile_counters + tile_idx, p.split_k);
  }
  ptx::named_barrier_sync(kBarConsumers, 128 * kSm90Consumers);
  if (*sh.flag == 0) return false;
  __threadfence();
#pragma unroll
  for (int j = 0; j < BLOCK_M / 8; ++j)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float2 sum = make_float2(0.0f, 0.0f);
      for (int s = 0; s < p.split_k; ++s) {
        const float2 v = __ldcg(reinterpret_cast<const float2*>(tile_partials + s * (BLOCK_N * BLOCK_M) +
                                                                (row0 + 8 * h) * BLOCK_M + 8 * j + 2 * t));
        sum.x += v.x;
        sum.y += v.y;
      }
      acc[4 * j + 2 * h] = sum.x;
      acc[4 * j + 2 * h + 1] = sum.y;
    }
  return true;
}

// The unit's outputs from acc, CHUNK tokens at a time through this
// warpgroup's staging region.
template <class T>
__device__ __forceinline__ void store_unit(const GroupedGemmParams& p, const Shared<T>& sh, const detail::WorkUnit& u,
                                           const EpilogueRoles& roles, const AccumulatorLanes& lanes,
                                           const FinalizeSlots<T>& slots, const float (&acc)[T::NACC]) {
  constexpr Sm90SmemLayout L = T::L;
  constexpr int BLOCK_M = T::BLOCK_M;
  constexpr int BLOCK_N = T::BLOCK_N;
  constexpr int CHUNK = T::CHUNK;
  constexpr Epilogue EPI = T::EPI;
  const int consumer = roles.consumer;
  const int wtid = roles.wtid;
  const int warp = lanes.warp;
  const int g = lanes.g;
  const int t = lanes.t;
  const int e = u.expert;
  if constexpr (EPI == Epilogue::kFinalize) {
    // Read in the rounds below, after their first barrier; rewritten for
    // the next unit only after their last one.
#pragma unroll
    for (int j = 0; j < FinalizeSlots<T>::LOADS; ++j) {
      const int r = wtid + 128 * j;
      if (r >= u.rows_valid) continue;
      const int slot = slots.row_slots[j];
      const int out_row = detail::finalize_out_row(p, slot);
      roles.out_rows[r] = out_row;
      roles.row_weights[r] = out_row >= 0 && p.row_weights ? __ldg(p.row_weights + slot) : 1.0f;
    }
  }
  const float out_scale = __ldg(p.global_scales + e) * layout::kEpilogueScale;
  const float up_scale = detail::up_epilogue_scale(p, e, out_scale);  // kSwiglu's up rows
  uint8_t* stage_base = sh.smem + L.epilogue_offset +
                        consumer * (CHUNK * L.epi_row_elems * L.epi_elem_bytes);  // (CONSUMERS, CHUNK, epi_row_elems)
  auto* s_out = reinterpret_cast<__nv_bfloat16*>(stage_base);                     // (CHUNK, epi_row_elems) bf16
  auto* s_out_f32 = reinterpret_cast<float*>(stage_base);  // kFinalize: (CHUNK, epi_row_elems) fp32
  const int wg_row0 = warp * 16 + g;                       // this thread's rows in the warpgroup's 64
#pragma unroll
  for (int c = 0; c < BLOCK_M / CHUNK; ++c) {
    if (c * CHUNK < u.rows_valid) {  // uniform across the warpgroup
#pragma unroll
      for (int jj = 0; jj < CHUNK / 8; ++jj) {
        const int j = c * (CHUNK / 8) + jj;
#pragma unroll
        for (int i = 0; i < 2; ++i) {
          const int tok = jj * 8 + 2 * t + i;
          if constexpr (EPI == Epilogue::kSwiglu) {
            // Rows g (gate) and g + 8 (up) of the warp's 16-row group are one feature.
            const int f = consumer * (kSm90WarpgroupRows / 2) + warp * 8 + g;  // in the tile's 64
            s_out[tok * L.epi_row_elems + warp * 8 + g] = detail::swiglu_output(
                p, e, u.n_tile * (BLOCK_N / 2) + f, acc[4 * j + i], acc[4 * j + 2 + i], out_scale, up_scale);
          } else {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
              const float v = acc[4 * j + 2 * h + i] * out_scale;
              if constexpr (EPI == Epilogue::kFinalize)
                s_out_f32[tok * L.epi_row_elems + wg_row0 + 8 * h] = v;
              else
                s_out[tok * L.epi_row_elems + wg_row0 + 8 * h] = __float2bfloat16_rn(v);
            }
          }
        }
      }
      ptx::named_barrier_sync(kBarWarpgroup0 + consumer, 128);
      const int rows = min(CHUNK, u.rows_valid - c * CHUNK);
      const int row_first = u.row_begin + c * CHUNK;
      if constexpr (EPI == Epilogue::kFinalize) {
        // (rows, 64) fp32 -> (+ bias) x router weight -> the slot's bf16
        // row (8-byte stores) or the token's fp32 row (vector atomics).
        // A thread stores the same four columns of rows r0, r0 + 8, ...
        constexpr int OUT_CHUNKS = kSm90WarpgroupRows / 4;
        constexpr int ROWS_PER_PASS = 128 / OUT_CHUNKS;
        const int n0 = u.n_tile * BLOCK_N + consumer * kSm90WarpgroupRows;
        const int col = n0 + (wtid % OUT_CHUNKS) * 4;
        if (col < p.n) {
          const float4 bias = detail::finalize_bias(p, e, col);
#pragma unroll
          for (int pass = 0; pass < CHUNK / ROWS_PER_PASS; ++pass) {
            const int r = wtid / OUT_CHUNKS + pass * ROWS_PER_PASS;
            if (r >= rows) break;
            const int out_row = roles.out_rows[c * CHUNK + r];
            if (out_row < 0) continue;
            const float4 v = *reinterpret_cast<const float4*>(s_out_f32 + r * L.epi_row_elems + col - n0);
            detail::finalize_store(p, out_row, col, v, bias, roles.row_weights[c * CHUNK + r]);
          }
        }
      } else {
        // (rows, OUT_N) bf16 -> Y rows, 16-byte stores; the output width is
        // a multiple of 8, so a chunk is wholly inside it or past it.
        constexpr int OUT_N = EPI == Epilogue::kSwiglu ? kSm90WarpgroupRows / 2 : kSm90WarpgroupRows;
        constexpr int OUT_CHUNKS = OUT_N / 8;
        const int y_cols = EPI == Epilogue::kSwiglu ? roles.n_half : p.n;
        const int n0 = u.n_tile * (EPI == Epilogue::kSwiglu ? BLOCK_N / 2 : BLOCK_N) + consumer * OUT_N;
        static_assert(EPI != Epilogue::kSwiglu || OUT_N % 16 == 0, "a SwiGLU tile must hold whole NVFP4 blocks");
        // W4A4 (kSwiglu with act_quant_scales): quantised to NVFP4 against
        // down_proj's input_scale on the way, a block of 16 features per
        // pair of threads (n0 and the output width are multiples of 16: both
        // chunks of a block are stored or skipped).
        const bool quantise = EPI == Epilogue::kSwiglu && p.act_quant_scales;
        const float input_scale = quantise ? __ldg(p.act_quant_scales + e) : 0.0f;
        // A thread stores the same eight columns of rows r0, r0 + 128 / OUT_CHUNKS, ...
        constexpr int ROWS_PER_PASS = 128 / OUT_CHUNKS;
        const int cc = wtid % OUT_CHUNKS;
        if (n0 + cc * 8 < y_cols) {
#pragma unroll
          for (int pass = 0; pass < (CHUNK + ROWS_PER_PASS - 1) / ROWS_PER_PASS; ++pass) {
            const int r = wtid / OUT_CHUNKS + pass * ROWS_PER_PASS;
            if (r >= rows) break;
            uint4 v = *reinterpret_cast<const uint4*>(s_out + r * L.epi_row_elems + cc * 8);
            if (quantise) detail::fp4_quantize_bf16_half_block(v, input_scale);
            *reinterpret_cast<uint4*>(p.y + static_cast<size_t>(row_first + r) * y_cols + n0 + cc * 8) = v;
          }
        }
      }
      ptx::named_barrier_sync(kBarWarpgroup0 + consumer, 128);  // staging free again
    }
  }
}

}  // namespace fp4moe::kernels::sm90
