// The SM90a kernel's consumer warpgroups (sm90_grouped_gemm.cuh): per unit
// the mainloop over its stages (here), then the split-K fix-up and the
// epilogue (sm90/epilogue.cuh).
#pragma once

#include "kernels/ptx/wgmma.cuh"
#include "kernels/sm90/common.cuh"
#include "kernels/sm90/epilogue.cuh"

namespace fp4moe::kernels::sm90 {

// One unit's mainloop into acc. One stage: wait for it, then per 64-wide K
// fragment dequantise, fence, four wgmmas, commit, and wait for the previous
// fragment's group; the previous stage is released once the first group of
// this one has been issued and the older ones have completed. Returns with
// every wgmma of the unit complete and every stage it read released.
// group: this warp's 16-row fragment group in the tile.
template <class T>
__device__ __forceinline__ void mainloop(const Shared<T>& sh, const detail::WorkUnit& u, int group, int lane,
                                         RingPosition& ring, float (&acc)[T::NACC]) {
  constexpr Sm90SmemLayout L = T::L;
  constexpr int BLOCK_M = T::BLOCK_M;
  constexpr int K_FRAGS = T::K_FRAGS;
  constexpr int N_GROUPS = T::N_GROUPS;
  const uint8_t* s_weights = sh.smem + L.weight_offset;
  const uint8_t* s_scales = sh.smem + L.scale_offset;
  int prev_stage = -1;
  auto consume_stage = [&](auto width) {
    constexpr int WIDTH = decltype(width)::value;
    const int stage = ring.stage;
    ptx::mbarrier_wait(sh.stage_full + 8 * stage, ring.phase);
    ptx::fence_proxy_async_shared();  // the cp.async rows are read by wgmma (async proxy)
    const uint8_t* w_stage = s_weights + stage * L.weight_stage_bytes + group * kFragBytes;
    const uint8_t* sc_stage = s_scales + stage * L.scale_stage_bytes + group * kFragScaleBytes;
    const uint64_t a_stage_desc = ptx::smem_desc_k_major_sw128(sh.act_ring + stage * L.act_stage_bytes);
    // Every fragment's codes and scales of the stage are loaded up front, so
    // the later fragments' loads overlap the first one's dequantisation.
    uint4 stage_codes[K_FRAGS];
    uint2 stage_scales[K_FRAGS];
#pragma unroll
    for (int kf = 0; kf < K_FRAGS; ++kf) {
      stage_codes[kf] = *reinterpret_cast<const uint4*>(w_stage + kf * (N_GROUPS * kFragBytes) + lane * 16);
      stage_scales[kf] = *reinterpret_cast<const uint2*>(sc_stage + kf * (N_GROUPS * kFragScaleBytes) + lane / 4 * 8);
    }
#pragma unroll
    for (int kf = 0; kf < K_FRAGS; ++kf) {
      const uint4 codes = stage_codes[kf];
      const uint2 scales = stage_scales[kf];
      uint32_t a[4][4];
      detail::dequant_a_fragment(codes.x, detail::scale_pair(scales, 0), a[0]);
      detail::dequant_a_fragment(codes.y, detail::scale_pair(scales, 1), a[1]);
      detail::dequant_a_fragment(codes.z, detail::scale_pair(scales, 2), a[2]);
      detail::dequant_a_fragment(codes.w, detail::scale_pair(scales, 3), a[3]);
#pragma unroll
      for (int ks = 0; ks < 4; ++ks) fence_registers(a[ks]);
      fence_registers(acc);
      ptx::wgmma_fence();
#pragma unroll
      for (int ks = 0; ks < 4; ++ks)
        ptx::Wgmma<WIDTH>::mma(acc, a[ks], ptx::smem_desc_advance(a_stage_desc, kf * (BLOCK_M * 128) + ks * 32));
      ptx::wgmma_commit();
      ptx::wgmma_wait<1>();  // the previous fragment's wgmmas are done
      // The stage's weights may be overwritten: its last wgmmas have been
      // issued, so the codes and scales they were made from are in
      // registers (the wgmmas read only the activations from shared memory).
      // NOTE: arriving right after the last dequantisation instead, ptxas
      // placed the arrival before the shared loads had returned (nothing
      // orders the two), and with one fragment per stage the next bulk copy
      // now and then overwrote codes not yet read (test_tune_gpu, m256k64
      // with split-K).
      if (kf == K_FRAGS - 1) ptx::mbarrier_arrive(sh.weights_free + 8 * stage);
      if (kf == 0 && prev_stage >= 0) {  // ... and with them every read of the previous stage
        ptx::mbarrier_arrive(sh.acts_free + 8 * prev_stage);
      }
    }
    prev_stage = stage;
    ring.template advance<T::STAGES>();
  };
  // NOTE: the loop body must hold an even number of wgmma groups. ptxas keeps
  // a group's A registers apart from the next group's within the body, but
  // reuses the body's registers across the back edge: with one group per
  // iteration the next one would overwrite the A operand of the group still
  // in flight (seen as wrong results with BLOCK_K = 64).
  constexpr int STAGES_PER_ITER = K_FRAGS % 2 == 0 ? 1 : 2;
  // The producer copied mma_width<BLOCK_M, STEP> rows, at least as many.
  with_mma_width<BLOCK_M, T::STEP, T::EXTRA>(mma_width<BLOCK_M, T::STEP, T::EXTRA>(u.rows_valid), [&](auto width) {
    int it = 0;
    for (; it + STAGES_PER_ITER <= u.num_k_tiles; it += STAGES_PER_ITER) {
#pragma unroll
      for (int s = 0; s < STAGES_PER_ITER; ++s) consume_stage(width);
    }
    if (it < u.num_k_tiles) {  // an odd last stage: no group may be in flight
      ptx::wgmma_wait<0>();
      consume_stage(width);
    }
    ptx::wgmma_wait<0>();
  });
  fence_registers(acc);
  if (prev_stage >= 0) {
    ptx::mbarrier_arrive(sh.acts_free + 8 * prev_stage);
  }
}

// Consumer warpgroup `warpgroup` (1 .. kSm90Consumers) over the block's
// units: the mainloop, the split-K fix-up, the epilogue.
template <class T>
__device__ __forceinline__ void consume_units(const GroupedGemmParams& p, const Shared<T>& sh, int tid, int warpgroup,
                                              int lane, int n_tiles, int units_per_mtile, int k_tiles_total) {
  constexpr int BLOCK_M = T::BLOCK_M;
  const int64_t num_units = static_cast<int64_t>(sh.prefix[p.num_experts]) * units_per_mtile;
  EpilogueRoles roles;
  roles.consumer = warpgroup - 1;  // 0 .. kSm90Consumers - 1
  roles.ctid = tid - 128;          // 0 .. 128 * kSm90Consumers - 1
  roles.wtid = tid % 128;          // thread in the warpgroup
  roles.out_rows = reinterpret_cast<int32_t*>(sh.smem + T::L.slots_offset) + roles.consumer * 2 * BLOCK_M;
  roles.row_weights = reinterpret_cast<float*>(roles.out_rows + BLOCK_M);
  const int group = roles.consumer * 4 + roles.wtid / 32;  // this warp's 16-row fragment group in the tile
  roles.n_half = p.n / 2;
  RingPosition ring;
  float acc[T::NACC];

  for (int64_t unit = blockIdx.x; unit < num_units; unit += gridDim.x) {
    const detail::WorkUnit u = detail::decode_unit<BLOCK_M>(p, sh.prefix, unit, units_per_mtile, k_tiles_total);
#pragma unroll
    for (int i = 0; i < T::NACC; ++i) acc[i] = 0.0f;
    // kFinalize: the output slots of the unit's rows, loaded here and used in
    // the epilogue, so that the L2 round trip overlaps the mainloop.
    FinalizeSlots<T> slots;
    slots.load(p, u, roles.wtid);

    mainloop<T>(sh, u, group, lane, ring, acc);

    // The epilogue's lanes, derived here rather than once per block
    // (AccumulatorLanes).
    const AccumulatorLanes lanes(roles);
    if (p.split_k > 1 && !sum_split_k_slices<T>(p, sh, u, n_tiles, roles, lanes, acc)) continue;
    store_unit<T>(p, sh, u, roles, lanes, slots, acc);
  }
}

}  // namespace fp4moe::kernels::sm90
