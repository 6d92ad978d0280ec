// The SM90a NVFP4 grouped GEMM: warp-specialised, bulk async copies into an
// mbarrier ring, wgmma with the dequantised weights as the register A operand.
//
// Swap AB as in the portable family: per expert e it computes
// Y^T[n, rows] = W_e[n, k] . X^T[k, rows]. A block is one producer
// warpgroup and kSm90Consumers consumer warpgroups (src/plan/smem_model.hpp):
//
//   producer   per k-tile of a unit: one thread waits until the stage's
//              weights are free, sets the stage barrier's transaction count
//              and issues two bulk copies, the stage's weight fragments and
//              scale codes (each one contiguous block of the prepared
//              layout). Activations wait until the stage's activations are
//              free. Contiguous ones (no gather) come as tensor-map (TMA)
//              copies of the unit's rows into 128-byte-swizzled atoms, as
//              many rows as the wgmmas' width, issued by three more threads.
//              Gathered ones: warps 1-3 cp.async the rows (zero past k and
//              past the expert's rows, none past the width) and arrive on the
//              barrier when their copies land. It runs ahead across units.
//   consumers  each owns 64 weight rows (one 16-row fragment group per warp):
//              per 64-wide K fragment, one 16-byte shared load of fp4 codes per
//              lane, dequantised in registers into four m16k16 A fragments
//              (fragment_layout.hpp), then four wgmma m64nWk16 against the
//              activation tile in shared memory (W: the unit's rows rounded
//              up to a quarter tile, sm90::mma_width). The A registers of one
//              fragment are consumed while the next is dequantised: at most two
//              wgmma groups in flight. A stage's weights are released once its
//              last wgmmas have been issued, its activations once the wgmmas
//              that read them have completed: the weight stream, from HBM,
//              keeps about one stage more in flight than the activations.

// Work units, split-K (deterministic, slice order) and the epilogues (NONE,
// SWIGLU with the gpt-oss variant and biases, FINALIZE stored or atomic)
// follow the portable family (portable_grouped_gemm.cuh). The roles live in
// sm90/: producer.cuh, consumer.cuh (the mainloop), epilogue.cuh (split-K
// fix-up, stores) and common.cuh (barriers, register split, wgmma widths,
// the tile's shape and shared memory); this file composes them.
//
// Built for sm_90a only; on other targets the kernel is an empty stub and the
// host never launches it. Tested in tests/kernels/test_grouped_gemm.cpp
// (every compiled config against the CPU reference) and tests/layer/.
#pragma once

#include "kernels/ptx/grid_dependency.cuh"
#include "kernels/sm90/common.cuh"
#include "kernels/sm90/consumer.cuh"
#include "kernels/sm90/producer.cuh"

namespace fp4moe::kernels {

template <int BLOCK_M, int BLOCK_K, int STAGES, Epilogue EPI>
__global__ void __launch_bounds__(kSm90Threads)
    __maxnreg__(sm90::launch_regs(sm90_smem_layout(BLOCK_M, BLOCK_K, STAGES, EPI).blocks_per_sm))
        sm90_grouped_gemm_kernel(const __grid_constant__ GroupedGemmParams p) {
#if FP4MOE_SM90_DEVICE_CODE
  using T = sm90::Tile<BLOCK_M, BLOCK_K, STAGES, EPI>;
  extern __shared__ __align__(1024) uint8_t smem[];
  const sm90::Shared<T> sh(smem);

  FP4MOE_TIMELINE_SPAN(gemm_timeline_kernel(EPI));
  const int tid = threadIdx.x;
  ptx::wait_for_prior_grids();
  ptx::allow_dependent_launch();
  if (ptx::smem_u32(smem) % kSm90AtomAlign != 0) {  // uniform: every thread leaves
    if (tid == 0) atomicOr(p.error_flags, kErrorSmemMisaligned);
    return;
  }
  if (tid == 0) {
    for (int s = 0; s < STAGES; ++s) {
      // The producer's arrivals: one per issuing warp (each with its own
      // copies' transaction bytes) when a tensor map brings the activations,
      // else the weight issuer's (with the weights' bytes) and one per
      // gathering thread's cp.async.
      ptx::mbarrier_init(sh.stage_full + 8 * s,
                         T::TMA_TILE && p.x_map_valid ? sm90::kCopyIssuers : sm90::kGatherThreads + 1);
      // One arrival per consumer thread: mbarrier.arrive releases the
      // arriving thread's own reads of the stage. With __syncwarp and one
      // arrival per warp, compute-sanitizer's racecheck reported the other
      // lanes' reads racing with the producer's next bulk copy.
      ptx::mbarrier_init(sh.acts_free + 8 * s, kSm90Consumers * 128);
      ptx::mbarrier_init(sh.weights_free + 8 * s, kSm90Consumers * 128);
    }
    ptx::fence_barrier_init();
  }
  detail::build_schedule<kSm90Threads, BLOCK_M>(p, sh.prefix, sh.warp_sums);  // synchronises the block

  // NOTE: the roles' values are derived after setmaxnreg: a value live across
  // the register reallocation is spilled to local memory.
  const int warpgroup = tid / 128;
  const int lane = tid % 32;
  const int n_tiles = (p.n + T::BLOCK_N - 1) / T::BLOCK_N;
  const int units_per_mtile = n_tiles * p.split_k;
  const int k_tiles_total = p.k_frags / T::K_FRAGS;

  if (warpgroup == 0) {
    ptx::setmaxnreg_dec<sm90::producer_regs(T::L.blocks_per_sm)>();
    const int64_t num_units = static_cast<int64_t>(sh.prefix[p.num_experts]) * units_per_mtile;
    if (T::TMA_TILE && p.x_map_valid) {
      if constexpr (T::TMA_TILE) sm90::copy_by_tensor_map<T>(p, sh, tid, num_units, units_per_mtile, k_tiles_total);
      return;
    }
    if (tid < 32) {
      if (tid == 0) sm90::copy_weights<T>(p, sh, num_units, units_per_mtile, k_tiles_total);
    } else {
      sm90::gather_activations<T>(p, sh, tid - 32, num_units, units_per_mtile, k_tiles_total);
    }
  } else {
    ptx::setmaxnreg_inc<sm90::consumer_regs(T::L.blocks_per_sm)>();
    sm90::consume_units<T>(p, sh, tid, warpgroup, lane, n_tiles, units_per_mtile, k_tiles_total);
  }
#endif  // FP4MOE_SM90_DEVICE_CODE
}

}  // namespace fp4moe::kernels
