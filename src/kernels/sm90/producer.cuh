// The SM90a kernel's producer warpgroup (sm90_grouped_gemm.cuh): it fills
// the ring's stages, running ahead across units. Two forms:
//   copy_by_tensor_map   activations not gathered (tiles from
//                        kSm90TensorMapMinBlockM rows): four issuing warps,
//                        the weights and scales by bulk copy, the rows by
//                        tensor-map boxes;
//   copy_weights +       activations gathered through row indices: one
//   gather_activations   thread copies the weights and scales, warps 1-3
//                        cp.async the rows.
#pragma once

#include "kernels/ptx/cp_async.cuh"
#include "kernels/sm90/common.cuh"

namespace fp4moe::kernels::sm90 {

// Lane 0 of each issuing warp (kCopyIssuers) waits until its part of the
// stage is free (weights or activations), issues its share of the stage's
// copies and arrives with their bytes: the weight and scale blocks (issuer
// 0) and, per 64-wide K fragment, the unit's activation rows in boxes of STEP
// rows (rows past the expert's land in columns nobody stores; past x and past
// k they are zeros). One thread issuing all of m128's ten copies spent ~136
// instructions per stage, as long as the stage's wgmmas
// (docs/performance.md §5.14).
template <class T>
__device__ __forceinline__ void copy_by_tensor_map(const GroupedGemmParams& p, const Shared<T>& sh, int ptid,
                                                   int64_t num_units, int units_per_mtile, int k_tiles_total) {
  constexpr Sm90SmemLayout L = T::L;
  constexpr int BLOCK_M = T::BLOCK_M;
  constexpr int K_FRAGS = T::K_FRAGS;
  constexpr int STEP = T::STEP;
  const int issuer = ptid / 32;
  if (ptid % 32 != 0 || issuer >= kCopyIssuers) return;
  const int box_issuer = issuer - 1;  // -1: issues no box
  if (box_issuer >= 0) ptx::prefetch_tensormap(&p.x_map);
  // A box issuer's boxes of a unit (issuer_box), found once per unit: a
  // division per box in the k loop cost ~35 instructions.
  constexpr int MAX_MINE = max_issuer_boxes(K_FRAGS, BLOCK_M / STEP);
  static_assert(issuers_copy_every_box_once(K_FRAGS, BLOCK_M / STEP), "a box copied twice or never");
  uint32_t box_smem[MAX_MINE];  // offset in a stage's activation tile
  int box_k[MAX_MINE];          // k offset in the stage
  int box_row[MAX_MINE];        // row offset in the unit
  RingPosition ring;
  for (int64_t unit = blockIdx.x; unit < num_units; unit += gridDim.x) {
    const detail::WorkUnit u = detail::decode_unit<BLOCK_M>(p, sh.prefix, unit, units_per_mtile, k_tiles_total);
    const size_t tile_frag0 =
        static_cast<size_t>(layout::fragment_index(u.expert, u.n_tile * T::N_GROUPS, 0, p.n_groups, p.k_frags));
    const int boxes = mma_width<BLOCK_M, STEP>(u.rows_valid) / STEP;
    int mine = 0;
#pragma unroll
    for (int j = 0; j < MAX_MINE; ++j) {
      int kf = 0, b = 0;
      if (issuer_box(box_issuer, j, boxes, K_FRAGS, kf, b)) {
        box_smem[j] = static_cast<uint32_t>(kf * (BLOCK_M * 128) + b * (STEP * 128));
        box_k[j] = kf * kFragK;
        box_row[j] = b * STEP;
        mine = j + 1;
      }
    }
    const uint32_t my_bytes = (issuer == 0 ? static_cast<uint32_t>(L.weight_stage_bytes + L.scale_stage_bytes) : 0u) +
                              static_cast<uint32_t>(mine * STEP * 128);
    for (int it = 0; it < u.num_k_tiles; ++it) {
      const int kt = u.kt_begin + it;
      // The weight issuer waits for the stage's weights to be read, the box
      // issuers for its activations.
      ptx::mbarrier_wait((issuer == 0 ? sh.weights_free : sh.acts_free) + 8 * ring.stage, ring.phase ^ 1);
      const uint32_t full = sh.stage_full + 8 * ring.stage;
      if (my_bytes != 0) ptx::mbarrier_expect_tx(full, my_bytes);
      if (issuer == 0) {
        const size_t frag0 = tile_frag0 + static_cast<size_t>(kt) * K_FRAGS * T::N_GROUPS;
        ptx::bulk_copy_g2s(sh.weight_ring + ring.stage * L.weight_stage_bytes, p.weights + frag0 * kFragBytes,
                           static_cast<uint32_t>(L.weight_stage_bytes), full);
        ptx::bulk_copy_g2s(sh.scale_ring + ring.stage * L.scale_stage_bytes, p.scales + frag0 * kFragScaleBytes,
                           static_cast<uint32_t>(L.scale_stage_bytes), full);
      }
      const uint32_t a_stage = sh.act_ring + ring.stage * L.act_stage_bytes;
#pragma unroll
      for (int j = 0; j < MAX_MINE; ++j)
        if (j < mine)
          ptx::tma_load_2d(a_stage + box_smem[j], &p.x_map, kt * T::BLOCK_K + box_k[j], u.row_begin + box_row[j],
                           full);
      ptx::mbarrier_arrive(full);
      ring.template advance<T::STAGES>();
    }
  }
}

// Warp 0's lane 0 when the rows are gathered: per stage, the weight and
// scale blocks as soon as the consumers have issued the last wgmmas made from
// the previous ones, a fragment or more before the activations that share
// the stage are released: the HBM stream keeps more stages in flight.
template <class T>
__device__ __forceinline__ void copy_weights(const GroupedGemmParams& p, const Shared<T>& sh, int64_t num_units,
                                             int units_per_mtile, int k_tiles_total) {
  constexpr Sm90SmemLayout L = T::L;
  RingPosition ring;
  for (int64_t unit = blockIdx.x; unit < num_units; unit += grid_blocks()) {
    const detail::WorkUnit u = detail::decode_unit<T::BLOCK_M>(p, sh.prefix, unit, units_per_mtile, k_tiles_total);
    const size_t tile_frag0 =
        static_cast<size_t>(layout::fragment_index(u.expert, u.n_tile * T::N_GROUPS, 0, p.n_groups, p.k_frags));
#pragma unroll 1
    for (int it = 0; it < u.num_k_tiles; ++it) {
      const size_t frag0 = tile_frag0 + static_cast<size_t>(u.kt_begin + it) * T::K_FRAGS * T::N_GROUPS;
      ptx::mbarrier_wait(sh.weights_free + 8 * ring.stage, ring.phase ^ 1);
      const uint32_t full = sh.stage_full + 8 * ring.stage;
      ptx::mbarrier_expect_tx(full, static_cast<uint32_t>(L.weight_stage_bytes + L.scale_stage_bytes));
      // The same two copies as copy_by_tensor_map's issuer 0.
      ptx::bulk_copy_g2s(sh.weight_ring + ring.stage * L.weight_stage_bytes, p.weights + frag0 * kFragBytes,
                         static_cast<uint32_t>(L.weight_stage_bytes), full);
      ptx::bulk_copy_g2s(sh.scale_ring + ring.stage * L.scale_stage_bytes, p.scales + frag0 * kFragScaleBytes,
                         static_cast<uint32_t>(L.scale_stage_bytes), full);
      ptx::mbarrier_arrive(full);
      ring.template advance<T::STAGES>();
    }
  }
}

// Warps 1-3 gather the activation rows, four threads per row: thread j
// copies the row's 16-byte chunks j, j + 4, j + 8, ... (64 B apart in x). In
// the swizzled tile (act_chunk_offset) chunk j + 8q lands at the same offset
// in K block q, and chunk j + 4 + 8q at that offset XOR 64, the same for rows
// row0, row0 + ROWS_PER_PASS, ... (a multiple of the 8-row atom): two
// shared-memory addresses per row, the rest immediates. gtid: 0 ..
// kGatherThreads - 1.
template <class T>
__device__ __forceinline__ void gather_activations(const GroupedGemmParams& p, const Shared<T>& sh, int gtid,
                                                   int64_t num_units, int units_per_mtile, int k_tiles_total) {
  constexpr Sm90SmemLayout L = T::L;
  constexpr int BLOCK_M = T::BLOCK_M;
  constexpr int STEP = T::STEP;
  constexpr int THREADS_PER_ROW = 4;
  constexpr int GATHER_CHUNKS = T::X_CHUNKS / THREADS_PER_ROW;
  constexpr int ROWS_PER_PASS = kGatherThreads / THREADS_PER_ROW;
  static_assert(T::X_CHUNKS % 8 == 0 && ROWS_PER_PASS % 8 == 0, "unsupported BLOCK_K");
  const int j = gtid % THREADS_PER_ROW;
  const int row0 = gtid / THREADS_PER_ROW;
  const uint32_t row_offset0 = act_chunk_offset<BLOCK_M>(row0, j);      // chunks j + 8q
  const uint32_t row_offset1 = act_chunk_offset<BLOCK_M>(row0, j + 4);  // chunks j + 4 + 8q
  RingPosition ring;
  // NOTE: the grid size is read afresh per unit (here and in copy_weights'
  // loop): held in a register across the copy loop, ptxas spilled it in the
  // two-block tiles (32 registers per producer thread).
  for (int64_t unit = blockIdx.x; unit < num_units; unit += grid_blocks()) {
    const detail::WorkUnit u = detail::decode_unit<BLOCK_M>(p, sh.prefix, unit, units_per_mtile, k_tiles_total);
    // The previous unit's copies are issued.
    ptx::named_barrier_sync(kBarProducer, kGatherThreads);
    // Element offsets in x of the unit's token rows (-1: past the expert's
    // rows, zero-filled). NOTE: the row is gtid, spelt from %laneid:
    // &src_rows[gtid] from threadIdx.x is an address the schedule computed
    // before the register reallocation, which ptxas reused across it,
    // spilling it.
    for (int r = (gtid / 32) * 32 + lane_index(); r < BLOCK_M; r += kGatherThreads) {
      int64_t offset = -1;
      if (r < u.rows_valid) {
        int src = u.row_begin + r;
        if (p.gather_rows) {
          src = __ldg(p.gather_rows + src);
          if (src < 0 || src >= p.x_rows) {
            atomicOr(p.error_flags, kErrorGatherRowOutOfRange);
            src = 0;
          }
        }
        offset = static_cast<int64_t>(src) * p.k;
      }
      sh.src_rows[r] = offset;
    }
    ptx::named_barrier_sync(kBarProducer, kGatherThreads);
    // Only the rows the consumers' wgmmas read (zeros past the valid ones);
    // the copy loop is compiled per width so that it has no data-dependent
    // branch per copy (one cost 2-4 % on full tiles,
    // docs/performance.md §5.4).
    with_mma_width<BLOCK_M, STEP>(mma_width<BLOCK_M, STEP>(u.rows_valid), [&](auto width) {
      constexpr int WIDTH = decltype(width)::value;
      constexpr int PASSES = (WIDTH + ROWS_PER_PASS - 1) / ROWS_PER_PASS;
      for (int it = 0; it < u.num_k_tiles; ++it) {
        const int kk = (u.kt_begin + it) * T::BLOCK_K + j * 8;
        ptx::mbarrier_wait(sh.acts_free + 8 * ring.stage, ring.phase ^ 1);
        const uint32_t a_stage = sh.act_ring + ring.stage * L.act_stage_bytes;
#pragma unroll
        for (int pass = 0; pass < PASSES; ++pass) {
          const int r = row0 + pass * ROWS_PER_PASS;
          if (WIDTH % ROWS_PER_PASS != 0 && r >= WIDTH) break;
          const int64_t offset = sh.src_rows[r];
          // A chunk past k or of a row past the expert's is zero-filled
          // (src-size 0: nothing is read from its address).
          const __nv_bfloat16* src = p.x + (offset >= 0 ? offset + kk : 0);
          const int k_left = offset >= 0 ? p.k - kk : 0;
          const uint32_t dst0 = a_stage + row_offset0 + pass * ROWS_PER_PASS * 128;
          const uint32_t dst1 = a_stage + row_offset1 + pass * ROWS_PER_PASS * 128;
#pragma unroll
          for (int m = 0; m < GATHER_CHUNKS; ++m)
            ptx::cp_async_16((m % 2 ? dst1 : dst0) + (m / 2) * (BLOCK_M * 128), src + 32 * m,
                             32 * m < k_left ? 16 : 0);
        }
        ptx::cp_async_arrive_noinc(sh.stage_full + 8 * ring.stage);
        ring.template advance<T::STAGES>();
      }
    });
  }
  ptx::cp_async_wait_all();  // leave no copy of this thread in flight
}

}  // namespace fp4moe::kernels::sm90
