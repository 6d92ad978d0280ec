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
// follow the portable family (portable_grouped_gemm.cuh). The epilogue stages
// each warpgroup's 64 rows x up to kSm90EpilogueChunk tokens token-major in a
// region of its own (the producer keeps filling the ring meanwhile) and
// writes whole 16-byte chunks of output rows. FINALIZE's output slots are
// loaded when a unit starts and its router weights once per row, into a
// table of the warpgroup's (Sm90SmemLayout::slots_*).
//
// Built for sm_90a only; on other targets the kernel is an empty stub and the
// host never launches it. Tested in tests/kernels/test_grouped_gemm.cpp
// (every compiled config against the CPU reference) and tests/layer/.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>
#include <type_traits>

#include "kernels/grouped_gemm_common.cuh"
#include "kernels/ptx/cp_async.cuh"
#include "kernels/ptx/grid_dependency.cuh"
#include "kernels/ptx/sm90.cuh"
#include "kernels/ptx/wgmma.cuh"

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define FP4MOE_SM90_DEVICE_CODE 1
#else
#define FP4MOE_SM90_DEVICE_CODE 0
#endif

namespace fp4moe::kernels {

namespace sm90 {

// Hardware named barriers (0 is __syncthreads).
inline constexpr int kBarConsumers = 1;     // every consumer thread
inline constexpr int kBarWarpgroup0 = 2;    // + consumer warpgroup index
inline constexpr int kBarProducer = 2 + kSm90Consumers;

// Producer warps whose lane 0 issues a share of a stage's copies when a
// tensor map brings the activations (the one-block tiles from
// kSm90TensorMapMinBlockM rows): warp 0 the weight and scale blocks, warps
// 1-3 in turn the activation boxes.
inline constexpr int kCopyIssuers = 4;
inline constexpr int kBoxIssuers = kCopyIssuers - 1;
static_assert(kCopyIssuers * 32 <= 128, "the issuers are warps of the producer warpgroup");
static_assert(kSm90TwoBlocksMaxBlockM < kSm90TensorMapMinBlockM,
              "tensor-mapped tiles run one block per SM (64 registers per producer thread)");

// Producer threads that gather activation rows with cp.async when no tensor
// map brings them: warps 1-3 (warp 0's lane 0 issues the weight and scale
// copies, waiting on barriers of their own: sm90_grouped_gemm_kernel).
inline constexpr int kGatherThreads = 96;

// A unit's activation boxes, k_frags x boxes of them numbered kf * boxes + b,
// go to the box issuers in turn: box j of issuer i (0 .. kBoxIssuers - 1) is
// number i + j * kBoxIssuers. False past the issuer's last box.
__host__ __device__ constexpr bool issuer_box(int i, int j, int boxes, int k_frags, int& kf, int& b) {
  const int n = i + j * kBoxIssuers;
  if (i < 0 || n >= k_frags * boxes) return false;
  kf = n / boxes;
  b = n % boxes;
  return true;
}
// The most boxes one issuer copies per stage of a tile with k_frags K
// fragments and at most max_boxes boxes per fragment.
__host__ __device__ constexpr int max_issuer_boxes(int k_frags, int max_boxes) {
  return (k_frags * max_boxes + kBoxIssuers - 1) / kBoxIssuers;
}
// Every box of every unit width is copied by exactly one issuer, within
// max_issuer_boxes of its boxes (asserted by each tensor-mapped kernel).
constexpr bool issuers_copy_every_box_once(int k_frags, int max_boxes) {
  for (int boxes = 1; boxes <= max_boxes; ++boxes) {
    int copies[8][8] = {};
    if (k_frags > 8 || boxes > 8) return false;
    for (int i = 0; i < kBoxIssuers; ++i)
      for (int j = 0; j < max_issuer_boxes(k_frags, max_boxes); ++j) {
        int kf = 0, b = 0;
        if (issuer_box(i, j, boxes, k_frags, kf, b)) ++copies[kf][b];
      }
    for (int kf = 0; kf < k_frags; ++kf)
      for (int b = 0; b < boxes; ++b)
        if (copies[kf][b] != 1) return false;
  }
  int kf = 0, b = 0;
  return !issuer_box(-1, 0, max_boxes, k_frags, kf, b);  // the weight issuer copies no box
}
static_assert(issuers_copy_every_box_once(1, 1) && issuers_copy_every_box_once(1, 4) &&
              issuers_copy_every_box_once(2, 4) && issuers_copy_every_box_once(4, 8));

// Registers per thread after the producer gives its surplus to the consumers
// (setmaxnreg), for one or two blocks per SM (Sm90SmemLayout::blocks_per_sm).
// A block owns what it launched with: the kernel is compiled for
// launch_regs (__maxnreg__: 65536 / (384 * blocks) rounded down to 8, 168 and
// 80), and the split must stay within it, or setmaxnreg.inc waits forever.
constexpr int producer_regs(int blocks_per_sm) { return blocks_per_sm == 1 ? 64 : 32; }
constexpr int consumer_regs(int blocks_per_sm) { return blocks_per_sm == 1 ? 216 : 104; }
constexpr int launch_regs(int blocks_per_sm) { return 65536 / (kSm90Threads * blocks_per_sm) / 8 * 8; }
constexpr bool register_split_fits(int blocks_per_sm) {
  return producer_regs(blocks_per_sm) + kSm90Consumers * consumer_regs(blocks_per_sm) <=
         (kSm90Consumers + 1) * launch_regs(blocks_per_sm);
}
static_assert(register_split_fits(1) && register_split_fits(2), "register file overcommitted");

// Byte offset, inside one stage's activation tile, of 16-byte chunk c (8 k
// values) of token row r: 64-wide K blocks of BLOCK_M rows x 128 B, chunks
// XOR-swizzled by the row within each 8-row atom (the wgmma 128-B swizzle).
template <int BLOCK_M>
__device__ __forceinline__ uint32_t act_chunk_offset(int r, int c) {
  return static_cast<uint32_t>((c / 8) * (BLOCK_M * 128) + r * 128 + (((c % 8) ^ (r % 8)) << 4));
}

// The token width a unit's wgmmas run at: its valid rows rounded up to a
// multiple of STEP = sm90_mma_width_step(BLOCK_M, blocks per SM), at most
// BLOCK_M (a quarter of the tile for m32 ... m128 at one block per SM).
// A tile that holds only the tail of an expert's rows (a Poisson spread puts
// one behind about half the experts when the tile is sized near the mean)
// then costs the tensor cores what its rows need, not BLOCK_M columns, and
// the producer copies only those rows. Both the producer's copy loop and the
// consumers' mainloop are compiled once per width (with_mma_width).
// EXTRA (sm90_mma_extra_width), when not 0, is one more width between the
// last two steps.
// NOTE: m256 has one width: with 128 accumulators per thread a second
// mainloop copy made ptxas spill in the SwiGLU kernel, and three or four
// serialised its wgmmas for lack of registers (C7512).
template <int BLOCK_M, int STEP, int EXTRA = 0>
__host__ __device__ constexpr int mma_width(int rows_valid) {
  const int steps = rows_valid <= STEP ? 1 : (rows_valid + STEP - 1) / STEP;
  const int width = steps * STEP < BLOCK_M ? steps * STEP : BLOCK_M;
  return EXTRA != 0 && rows_valid <= EXTRA && width > EXTRA ? EXTRA : width;
}

static_assert(mma_width<128, 32>(1) == 32 && mma_width<128, 32>(33) == 64 && mma_width<128, 32>(97) == 128 &&
              mma_width<256, 256>(100) == 256 && mma_width<16, 8>(9) == 16 && mma_width<8, 8>(0) == 8 &&
              mma_width<64, 16>(64) == 64 && mma_width<32, 16>(17) == 32 && mma_width<160, 40>(129) == 160 &&
              mma_width<160, 40>(128) == 160 && mma_width<160, 40>(120) == 120 &&
              mma_width<160, 40, 144>(121) == 144 && mma_width<160, 40, 144>(144) == 144 &&
              mma_width<160, 40, 144>(145) == 160 && mma_width<160, 40, 144>(120) == 120);

// Calls f(std::integral_constant<int, width>{}); width is one of
// mma_width<BLOCK_M, STEP, EXTRA>'s values.
template <int BLOCK_M, int STEP, int EXTRA = 0, int W = STEP, class F>
__device__ __forceinline__ void with_mma_width(int width, F&& f) {
  if constexpr (EXTRA != 0) {
    if (width == EXTRA) return f(std::integral_constant<int, EXTRA>{});
    with_mma_width<BLOCK_M, STEP>(width, static_cast<F&&>(f));
  } else if constexpr (W >= BLOCK_M) {
    f(std::integral_constant<int, BLOCK_M>{});
  } else {
    if (width == W) return f(std::integral_constant<int, W>{});
    with_mma_width<BLOCK_M, STEP, 0, W + STEP>(width, static_cast<F&&>(f));
  }
}

// Pins registers to this point of the instruction stream: the compiler may
// not move their definitions below it nor their uses above it. Used before
// wgmma_fence (every A register is written before the wgmmas start, or ptxas
// serialises them) and after wgmma_wait (no accumulator is read early).
// This thread's lane, from %laneid (an expression of its own: ptxas does not
// equate what is computed from it with what threadIdx.x gave).
__device__ __forceinline__ int lane_index() {
  uint32_t l;
  asm("mov.u32 %0, %%laneid;" : "=r"(l));
  return static_cast<int>(l);
}
// gridDim.x, read where it is used (the compiler neither hoists nor keeps it).
__device__ __forceinline__ uint32_t grid_blocks() {
  uint32_t n;
  asm volatile("mov.u32 %0, %%nctaid.x;" : "=r"(n));
  return n;
}
// v, which the compiler may no longer treat as known: what is computed
// from it stays after this point (is not hoisted above it).
__device__ __forceinline__ int opaque(int v) {
  asm volatile("" : "+r"(v));
  return v;
}
template <int N>
__device__ __forceinline__ void fence_registers(float (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i])::"memory");
}
template <int N>
__device__ __forceinline__ void fence_registers(uint32_t (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+r"(r[i])::"memory");
}

}  // namespace sm90

template <int BLOCK_M, int BLOCK_K, int STAGES, Epilogue EPI>
__global__ void __launch_bounds__(kSm90Threads)
    __maxnreg__(sm90::launch_regs(sm90_smem_layout(BLOCK_M, BLOCK_K, STAGES, EPI).blocks_per_sm))
    sm90_grouped_gemm_kernel(const __grid_constant__ GroupedGemmParams p) {
#if FP4MOE_SM90_DEVICE_CODE
  constexpr Sm90SmemLayout L = sm90_smem_layout(BLOCK_M, BLOCK_K, STAGES, EPI);
  static_assert(L.total_bytes <= kSmemLimitSm90, "config exceeds the SM90 shared-memory limit");
  constexpr int BLOCK_N = kSm90BlockN;
  constexpr int K_FRAGS = BLOCK_K / kFragK;      // 64-wide K fragments per stage
  constexpr int N_GROUPS = BLOCK_N / kFragRows;  // 16-row fragment groups per tile
  constexpr int X_CHUNKS = BLOCK_K / 8;          // 16-byte chunks per activation row per stage
  constexpr int NACC = BLOCK_M / 2;              // fp32 accumulators per consumer thread
  constexpr int CHUNK = L.chunk_tokens;          // tokens per epilogue round
  constexpr int STEP = sm90_mma_width_step(BLOCK_M, L.blocks_per_sm);  // wgmma widths: multiples of it
  constexpr int EXTRA = sm90_mma_extra_width(BLOCK_M, L.blocks_per_sm);  // and this one (0: none)
  // Activations by tensor map (TMA): only tiles from kSm90TensorMapMinBlockM
  // rows are compiled for it; the host sets x_map_valid only for them.
  constexpr bool TMA_TILE = BLOCK_M >= kSm90TensorMapMinBlockM;
  static_assert(BLOCK_M % 8 == 0 && BLOCK_M <= 256 && BLOCK_M % CHUNK == 0 && CHUNK % 8 == 0,
                "BLOCK_M must be a multiple of 8 up to 256 (wgmma N)");
  static_assert(BLOCK_K % kFragK == 0 && layout::kPadK % BLOCK_K == 0 && layout::kPadN % BLOCK_N == 0,
                "unsupported tile shape");
  static_assert(BLOCK_N == layout::kPadN, "a stage of the prepared layout is one 128-row tile");

  extern __shared__ __align__(1024) uint8_t smem[];
  const uint32_t smem_base = ptx::smem_u32(smem);
  const uint32_t act_ring = smem_base + L.act_offset;        // (STAGES, K_FRAGS, BLOCK_M, 128 B) swizzled bf16
  const uint32_t weight_ring = smem_base + L.weight_offset;  // (STAGES, K_FRAGS, N_GROUPS, 512 B) fp4
  const uint32_t scale_ring = smem_base + L.scale_offset;    // (STAGES, K_FRAGS, N_GROUPS, 64 B) scale codes
  const uint32_t full_bar = smem_base + L.barrier_offset;    // (STAGES) mbarrier: stage loaded
  const uint32_t empty_bar = full_bar + 8 * STAGES;          // (STAGES) mbarrier: activations consumed
  const uint32_t wempty_bar = empty_bar + 8 * STAGES;        // (STAGES) mbarrier: weights and scales consumed
  static_assert(kSm90StageBarriers == 3, "full, empty and wempty");
  const uint8_t* s_weights = smem + L.weight_offset;
  const uint8_t* s_scales = smem + L.scale_offset;
  uint8_t* s_epilogue = smem + L.epilogue_offset;  // (CONSUMERS, CHUNK, epi_row_elems)
  int64_t* s_src_rows = reinterpret_cast<int64_t*>(smem + L.rows_offset);         // (BLOCK_M) x offsets
  int32_t* s_prefix = reinterpret_cast<int32_t*>(smem + L.schedule_offset);       // (kMaxExperts + 1)
  int32_t* s_warp_sums = s_prefix + kMaxExperts + 1;                              // (32)
  int32_t* s_flag = reinterpret_cast<int32_t*>(smem + L.flag_offset);

  const int tid = threadIdx.x;
  ptx::wait_for_prior_grids();
  ptx::allow_dependent_launch();
  if (smem_base % kSm90AtomAlign != 0) {  // uniform: every thread leaves
    if (tid == 0) atomicOr(p.error_flags, kErrorSmemMisaligned);
    return;
  }
  if (tid == 0) {
    for (int s = 0; s < STAGES; ++s) {
      // The producer's arrivals: one per issuing warp (each with its own
      // copies' transaction bytes) when a tensor map brings the activations,
      // else the weight issuer's (with the weights' bytes) and one per
      // gathering thread's cp.async.
      ptx::mbarrier_init(full_bar + 8 * s, TMA_TILE && p.x_map_valid ? sm90::kCopyIssuers : sm90::kGatherThreads + 1);
      // One arrival per consumer thread: mbarrier.arrive releases the
      // arriving thread's own reads of the stage. With __syncwarp and one
      // arrival per warp, compute-sanitizer's racecheck reported the other
      // lanes' reads racing with the producer's next bulk copy.
      ptx::mbarrier_init(empty_bar + 8 * s, kSm90Consumers * 128);
      ptx::mbarrier_init(wempty_bar + 8 * s, kSm90Consumers * 128);
    }
    ptx::fence_barrier_init();
  }
  detail::build_schedule<kSm90Threads, BLOCK_M>(p, s_prefix, s_warp_sums);  // synchronises the block

  // NOTE: the roles' values are derived after setmaxnreg: a value live across
  // the register reallocation is spilled to local memory.
  const int warpgroup = tid / 128;
  const int lane = tid % 32;
  const int n_tiles = (p.n + BLOCK_N - 1) / BLOCK_N;
  const int units_per_mtile = n_tiles * p.split_k;
  const int k_tiles_total = p.k_frags / K_FRAGS;

  if (warpgroup == 0) {
    // ================================================================ producer
    ptx::setmaxnreg_dec<sm90::producer_regs(L.blocks_per_sm)>();
    const int64_t num_units = static_cast<int64_t>(s_prefix[p.num_experts]) * units_per_mtile;
    const int ptid = tid;
    if (TMA_TILE && p.x_map_valid) {
      // Lane 0 of each issuing warp (sm90::kCopyIssuers) waits until its part
      // of the stage is free (weights or activations), issues its share of
      // the stage's copies and arrives with their bytes: the weight and scale
      // blocks (issuer 0) and, per 64-wide K
      // fragment, the unit's activation rows in boxes of STEP rows (rows past
      // the expert's land in columns nobody stores; past x and past k they
      // are zeros). One thread issuing all of m128's ten copies spent ~136
      // instructions per stage, as long as the stage's wgmmas
      // (docs/performance.md §5.14).
      const int issuer = ptid / 32;
      if constexpr (TMA_TILE) {
        if (ptid % 32 == 0 && issuer < sm90::kCopyIssuers) {
          const int box_issuer = issuer - 1;  // -1: issues no box
          if (box_issuer >= 0) ptx::prefetch_tensormap(&p.x_map);
          // A box issuer's boxes of a unit (sm90::issuer_box), found once per
          // unit: a division per box in the k loop cost ~35 instructions.
          constexpr int MAX_MINE = sm90::max_issuer_boxes(K_FRAGS, BLOCK_M / STEP);
          static_assert(sm90::issuers_copy_every_box_once(K_FRAGS, BLOCK_M / STEP), "a box copied twice or never");
          uint32_t box_smem[MAX_MINE];  // offset in a stage's activation tile
          int box_k[MAX_MINE];          // k offset in the stage
          int box_row[MAX_MINE];        // row offset in the unit
          int stage = 0;
          uint32_t phase = 0;
          for (int64_t unit = blockIdx.x; unit < num_units; unit += gridDim.x) {
            const detail::WorkUnit u =
                detail::decode_unit<BLOCK_M>(p, s_prefix, unit, units_per_mtile, k_tiles_total);
            const size_t tile_frag0 = static_cast<size_t>(
                layout::fragment_index(u.expert, u.n_tile * N_GROUPS, 0, p.n_groups, p.k_frags));
            const int boxes = sm90::mma_width<BLOCK_M, STEP>(u.rows_valid) / STEP;
            int mine = 0;
#pragma unroll
            for (int j = 0; j < MAX_MINE; ++j) {
              int kf = 0, b = 0;
              if (sm90::issuer_box(box_issuer, j, boxes, K_FRAGS, kf, b)) {
                box_smem[j] = static_cast<uint32_t>(kf * (BLOCK_M * 128) + b * (STEP * 128));
                box_k[j] = kf * kFragK;
                box_row[j] = b * STEP;
                mine = j + 1;
              }
            }
            const uint32_t my_bytes =
                (issuer == 0 ? static_cast<uint32_t>(L.weight_stage_bytes + L.scale_stage_bytes) : 0u) +
                static_cast<uint32_t>(mine * STEP * 128);
            for (int it = 0; it < u.num_k_tiles; ++it) {
              const int kt = u.kt_begin + it;
              // The weight issuer waits for the stage's weights to be read,
              // the box issuers for its activations.
              ptx::mbarrier_wait((issuer == 0 ? wempty_bar : empty_bar) + 8 * stage, phase ^ 1);
              const uint32_t full = full_bar + 8 * stage;
              if (my_bytes != 0) ptx::mbarrier_expect_tx(full, my_bytes);
              if (issuer == 0) {
                const size_t frag0 = tile_frag0 + static_cast<size_t>(kt) * K_FRAGS * N_GROUPS;
                ptx::bulk_copy_g2s(weight_ring + stage * L.weight_stage_bytes, p.weights + frag0 * kFragBytes,
                                   static_cast<uint32_t>(L.weight_stage_bytes), full);
                ptx::bulk_copy_g2s(scale_ring + stage * L.scale_stage_bytes, p.scales + frag0 * kFragScaleBytes,
                                   static_cast<uint32_t>(L.scale_stage_bytes), full);
              }
              const uint32_t a_stage = act_ring + stage * L.act_stage_bytes;
#pragma unroll
              for (int j = 0; j < MAX_MINE; ++j)
                if (j < mine)
                  ptx::tma_load_2d(a_stage + box_smem[j], &p.x_map, kt * BLOCK_K + box_k[j], u.row_begin + box_row[j],
                                   full);
              ptx::mbarrier_arrive(full);
              if (++stage == STAGES) {
                stage = 0;
                phase ^= 1;
              }
            }
          }
        }
      }
      return;
    }
    if (ptid < 32) {
      // Warp 0's lane 0: per stage, the weight and scale blocks as soon as
      // the consumers have issued the last wgmmas made from the previous
      // ones, a fragment or more before the activations that share the
      // stage are released: the HBM stream keeps more stages in flight.
      if (ptid == 0) {
        int stage = 0;
        uint32_t phase = 0;
        for (int64_t unit = blockIdx.x; unit < num_units; unit += sm90::grid_blocks()) {
          const detail::WorkUnit u = detail::decode_unit<BLOCK_M>(p, s_prefix, unit, units_per_mtile, k_tiles_total);
          const size_t tile_frag0 =
              static_cast<size_t>(layout::fragment_index(u.expert, u.n_tile * N_GROUPS, 0, p.n_groups, p.k_frags));
#pragma unroll 1
          for (int it = 0; it < u.num_k_tiles; ++it) {
            const size_t frag0 = tile_frag0 + static_cast<size_t>(u.kt_begin + it) * K_FRAGS * N_GROUPS;
            ptx::mbarrier_wait(wempty_bar + 8 * stage, phase ^ 1);
            const uint32_t full = full_bar + 8 * stage;
            ptx::mbarrier_expect_tx(full, static_cast<uint32_t>(L.weight_stage_bytes + L.scale_stage_bytes));
            // The same two copies as the tensor-map path's issuer 0.
            ptx::bulk_copy_g2s(weight_ring + stage * L.weight_stage_bytes, p.weights + frag0 * kFragBytes,
                               static_cast<uint32_t>(L.weight_stage_bytes), full);
            ptx::bulk_copy_g2s(scale_ring + stage * L.scale_stage_bytes, p.scales + frag0 * kFragScaleBytes,
                               static_cast<uint32_t>(L.scale_stage_bytes), full);
            ptx::mbarrier_arrive(full);
            if (++stage == STAGES) {
              stage = 0;
              phase ^= 1;
            }
          }
        }
      }
    } else {
      // Warps 1-3 gather the activation rows, four threads per row: thread
      // j copies the row's 16-byte chunks j, j + 4, j + 8, ... (64 B apart in
      // x). In the swizzled tile (sm90::act_chunk_offset) chunk j + 8q lands at
      // the same offset in K block q, and chunk j + 4 + 8q at that offset XOR
      // 64, the same for rows row0, row0 + ROWS_PER_PASS, ... (a multiple of
      // the 8-row atom): two shared-memory addresses per row, the rest
      // immediates.
      constexpr int THREADS_PER_ROW = 4;
      constexpr int GATHER_CHUNKS = X_CHUNKS / THREADS_PER_ROW;
      constexpr int ROWS_PER_PASS = sm90::kGatherThreads / THREADS_PER_ROW;
      static_assert(X_CHUNKS % 8 == 0 && ROWS_PER_PASS % 8 == 0, "unsupported BLOCK_K");
      const int gtid = ptid - 32;  // 0 .. kGatherThreads - 1
      const int j = gtid % THREADS_PER_ROW;
      const int row0 = gtid / THREADS_PER_ROW;
      const uint32_t row_offset0 = sm90::act_chunk_offset<BLOCK_M>(row0, j);      // chunks j + 8q
      const uint32_t row_offset1 = sm90::act_chunk_offset<BLOCK_M>(row0, j + 4);  // chunks j + 4 + 8q
      int stage = 0;
      uint32_t phase = 0;
      // NOTE: the grid size is read afresh per unit (here and in the weight
      // issuer's loop): held in a register across the copy loop, ptxas spilled
      // it in the two-block tiles (32 registers per producer thread).
      for (int64_t unit = blockIdx.x; unit < num_units; unit += sm90::grid_blocks()) {
        const detail::WorkUnit u = detail::decode_unit<BLOCK_M>(p, s_prefix, unit, units_per_mtile, k_tiles_total);
        // The previous unit's copies are issued.
        ptx::named_barrier_sync(sm90::kBarProducer, sm90::kGatherThreads);
        // Element offsets in x of the unit's token rows (-1: past the expert's
        // rows, zero-filled). NOTE: the row is gtid, spelt from %laneid:
        // &s_src_rows[gtid] from threadIdx.x is an address the schedule
        // computed before the register reallocation, which ptxas reused
        // across it, spilling it.
        for (int r = (gtid / 32) * 32 + sm90::lane_index(); r < BLOCK_M; r += sm90::kGatherThreads) {
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
          s_src_rows[r] = offset;
        }
        ptx::named_barrier_sync(sm90::kBarProducer, sm90::kGatherThreads);
        // Only the rows the consumers' wgmmas read (zeros past the valid ones);
        // the copy loop is compiled per width so that it has no data-dependent
        // branch per copy (one cost 2-4 % on full tiles,
        // docs/performance.md §5.4).
        sm90::with_mma_width<BLOCK_M, STEP>(sm90::mma_width<BLOCK_M, STEP>(u.rows_valid), [&](auto width) {
          constexpr int WIDTH = decltype(width)::value;
          constexpr int PASSES = (WIDTH + ROWS_PER_PASS - 1) / ROWS_PER_PASS;
          for (int it = 0; it < u.num_k_tiles; ++it) {
            const int kk = (u.kt_begin + it) * BLOCK_K + j * 8;
            ptx::mbarrier_wait(empty_bar + 8 * stage, phase ^ 1);
            const uint32_t a_stage = act_ring + stage * L.act_stage_bytes;
#pragma unroll
            for (int pass = 0; pass < PASSES; ++pass) {
              const int r = row0 + pass * ROWS_PER_PASS;
              if (WIDTH % ROWS_PER_PASS != 0 && r >= WIDTH) break;
              const int64_t offset = s_src_rows[r];
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
            ptx::cp_async_arrive_noinc(full_bar + 8 * stage);
            if (++stage == STAGES) {
              stage = 0;
              phase ^= 1;
            }
          }
        });
      }
      ptx::cp_async_wait_all();  // leave no copy of this thread in flight
    }
  } else {
    // =============================================================== consumers
    ptx::setmaxnreg_inc<sm90::consumer_regs(L.blocks_per_sm)>();
    const int64_t num_units = static_cast<int64_t>(s_prefix[p.num_experts]) * units_per_mtile;
    const int consumer = warpgroup - 1;  // 0 .. kSm90Consumers - 1
    const int ctid = tid - 128;          // 0 .. 128 * kSm90Consumers - 1
    const int wtid = tid % 128;          // thread in the warpgroup
    const int group = consumer * 4 + wtid / 32;  // this warp's 16-row fragment group in the tile
    const int n_half = p.n / 2;
    // kFinalize: this warpgroup's table of the unit's output rows
    // (detail::finalize_out_row) and router weights, (BLOCK_M) int32 then
    // (BLOCK_M) fp32; each thread loads the slots of rows wtid, wtid + 128, ...
    constexpr int SLOT_LOADS = EPI == Epilogue::kFinalize ? (BLOCK_M + 127) / 128 : 1;
    int32_t* s_out_rows = reinterpret_cast<int32_t*>(smem + L.slots_offset) + consumer * 2 * BLOCK_M;
    float* s_row_weights = reinterpret_cast<float*>(s_out_rows + BLOCK_M);
    int stage = 0;
    uint32_t phase = 0;
    float acc[NACC];

    for (int64_t unit = blockIdx.x; unit < num_units; unit += gridDim.x) {
      const detail::WorkUnit u = detail::decode_unit<BLOCK_M>(p, s_prefix, unit, units_per_mtile, k_tiles_total);
      const int e = u.expert;
#pragma unroll
      for (int i = 0; i < NACC; ++i) acc[i] = 0.0f;
      // kFinalize: the output slots of the unit's rows, loaded here and used
      // in the epilogue, so that the L2 round trip overlaps the mainloop.
      [[maybe_unused]] int32_t row_slots[SLOT_LOADS];
      if constexpr (EPI == Epilogue::kFinalize) {
#pragma unroll
        for (int j = 0; j < SLOT_LOADS; ++j) {
          const int r = wtid + 128 * j;
          row_slots[j] = r < u.rows_valid ? __ldg(p.scatter_rows + u.row_begin + r) : -1;
        }
      }

      // ---- mainloop. One stage: wait for it, then per 64-wide K fragment
      // dequantise, fence, four wgmmas, commit, and wait for the previous
      // fragment's group; the previous stage is released once the first
      // group of this one has been issued and the older ones have completed.
      int prev_stage = -1;
      auto consume_stage = [&](auto width) {
        constexpr int WIDTH = decltype(width)::value;
        ptx::mbarrier_wait(full_bar + 8 * stage, phase);
        ptx::fence_proxy_async_shared();  // the cp.async rows are read by wgmma (async proxy)
        const uint8_t* w_stage = s_weights + stage * L.weight_stage_bytes + group * kFragBytes;
        const uint8_t* sc_stage = s_scales + stage * L.scale_stage_bytes + group * kFragScaleBytes;
        const uint64_t a_stage_desc = ptx::smem_desc_k_major_sw128(act_ring + stage * L.act_stage_bytes);
        // Every fragment's codes and scales of the stage are loaded up front,
        // so the later fragments' loads overlap the first one's dequantisation.
        uint4 stage_codes[K_FRAGS];
        uint2 stage_scales[K_FRAGS];
#pragma unroll
        for (int kf = 0; kf < K_FRAGS; ++kf) {
          stage_codes[kf] = *reinterpret_cast<const uint4*>(w_stage + kf * (N_GROUPS * kFragBytes) + lane * 16);
          stage_scales[kf] =
              *reinterpret_cast<const uint2*>(sc_stage + kf * (N_GROUPS * kFragScaleBytes) + lane / 4 * 8);
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
          for (int ks = 0; ks < 4; ++ks) sm90::fence_registers(a[ks]);
          sm90::fence_registers(acc);
          ptx::wgmma_fence();
#pragma unroll
          for (int ks = 0; ks < 4; ++ks)
            ptx::Wgmma<WIDTH>::mma(acc, a[ks], ptx::smem_desc_advance(a_stage_desc, kf * (BLOCK_M * 128) + ks * 32));
          ptx::wgmma_commit();
          ptx::wgmma_wait<1>();  // the previous fragment's wgmmas are done
          // The stage's weights may be overwritten: its last wgmmas have
          // been issued, so the codes and scales they were made from are in
          // registers (the wgmmas read only the activations from shared
          // memory). NOTE: arriving right after the last dequantisation
          // instead, ptxas placed the arrival before the shared loads had
          // returned (nothing orders the two), and with one fragment per
          // stage the next bulk copy now and then overwrote codes not yet
          // read (test_tune_gpu, m256k64 with split-K).
          if (kf == K_FRAGS - 1) ptx::mbarrier_arrive(wempty_bar + 8 * stage);
          if (kf == 0 && prev_stage >= 0) {  // ... and with them every read of the previous stage
            ptx::mbarrier_arrive(empty_bar + 8 * prev_stage);
          }
        }
        prev_stage = stage;
        if (++stage == STAGES) {
          stage = 0;
          phase ^= 1;
        }
      };
      // NOTE: the loop body must hold an even number of wgmma groups. ptxas
      // keeps a group's A registers apart from the next group's within the
      // body, but reuses the body's registers across the back edge: with one
      // group per iteration the next one would overwrite the A operand of the
      // group still in flight (seen as wrong results with BLOCK_K = 64).
      constexpr int STAGES_PER_ITER = K_FRAGS % 2 == 0 ? 1 : 2;
      // The producer copied mma_width<BLOCK_M, STEP> rows, at least as many.
      sm90::with_mma_width<BLOCK_M, STEP, EXTRA>(sm90::mma_width<BLOCK_M, STEP, EXTRA>(u.rows_valid), [&](auto width) {
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
      sm90::fence_registers(acc);
      if (prev_stage >= 0) {
        ptx::mbarrier_arrive(empty_bar + 8 * prev_stage);
      }

      // The epilogue's lane roles, derived here rather than once per block:
      // the compiler hoisted the staging addresses made from them out of the
      // unit loop, and ~8 registers live across the mainloop made ptxas
      // spill in the two-block tiles.
      const int e_wtid = sm90::opaque(wtid);
      const int warp = e_wtid / 32;  // warp in the warpgroup
      const int g = e_wtid % 32 / 4;
      const int t = e_wtid % 4;

      // ---- split-K: the last slice to land sums all slices in slice order.
      // Accumulator element 4j + 2h + i sits at tile row row0 + 8h, token 8j + 2t + i.
      const int row0 = consumer * kSm90WarpgroupRows + warp * 16 + g;
      if (p.split_k > 1) {
        const int64_t tile_idx = static_cast<int64_t>(s_prefix[e] + u.m_tile) * n_tiles + u.n_tile;
        float* tile_partials = p.partials + tile_idx * p.split_k * (BLOCK_N * BLOCK_M);
        float* mine = tile_partials + u.slice * (BLOCK_N * BLOCK_M);  // (BLOCK_N, BLOCK_M) fp32
#pragma unroll
        for (int j = 0; j < BLOCK_M / 8; ++j)
#pragma unroll
          for (int h = 0; h < 2; ++h)
            __stcg(reinterpret_cast<float2*>(mine + (row0 + 8 * h) * BLOCK_M + 8 * j + 2 * t),
                   make_float2(acc[4 * j + 2 * h], acc[4 * j + 2 * h + 1]));
        __threadfence();
        ptx::named_barrier_sync(sm90::kBarConsumers, 128 * kSm90Consumers);
        if (ctid == 0) {
          *s_flag = detail::last_slice_to_arrive(p.tile_counters + tile_idx, p.split_k);
        }
        ptx::named_barrier_sync(sm90::kBarConsumers, 128 * kSm90Consumers);
        if (*s_flag == 0) continue;
        __threadfence();
#pragma unroll
        for (int j = 0; j < BLOCK_M / 8; ++j)
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            float2 sum = make_float2(0.0f, 0.0f);
            for (int s = 0; s < p.split_k; ++s) {
              const float2 v = __ldcg(reinterpret_cast<const float2*>(
                  tile_partials + s * (BLOCK_N * BLOCK_M) + (row0 + 8 * h) * BLOCK_M + 8 * j + 2 * t));
              sum.x += v.x;
              sum.y += v.y;
            }
            acc[4 * j + 2 * h] = sum.x;
            acc[4 * j + 2 * h + 1] = sum.y;
          }
      }

      // ---- epilogue, CHUNK tokens at a time through this warpgroup's staging.
      if constexpr (EPI == Epilogue::kFinalize) {
        // Read in the rounds below, after their first barrier; rewritten for
        // the next unit only after their last one.
#pragma unroll
        for (int j = 0; j < SLOT_LOADS; ++j) {
          const int r = wtid + 128 * j;
          if (r >= u.rows_valid) continue;
          const int slot = row_slots[j];
          const int out_row = detail::finalize_out_row(p, slot);
          s_out_rows[r] = out_row;
          s_row_weights[r] = out_row >= 0 && p.row_weights ? __ldg(p.row_weights + slot) : 1.0f;
        }
      }
      const float out_scale = __ldg(p.global_scales + e) * layout::kEpilogueScale;
      const float up_scale = detail::up_epilogue_scale(p, e, out_scale);  // kSwiglu's up rows
      uint8_t* stage_base = s_epilogue + consumer * (CHUNK * L.epi_row_elems * L.epi_elem_bytes);
      auto* s_out = reinterpret_cast<__nv_bfloat16*>(stage_base);  // (CHUNK, epi_row_elems) bf16
      auto* s_out_f32 = reinterpret_cast<float*>(stage_base);      // kFinalize: (CHUNK, epi_row_elems) fp32
      const int wg_row0 = warp * 16 + g;                           // this thread's rows in the warpgroup's 64
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
                    p, e, u.n_tile * (BLOCK_N / 2) + f, acc[4 * j + i], acc[4 * j + 2 + i], out_scale,
                    up_scale);
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
          ptx::named_barrier_sync(sm90::kBarWarpgroup0 + consumer, 128);
          const int rows = min(CHUNK, u.rows_valid - c * CHUNK);
          const int row_first = u.row_begin + c * CHUNK;
          if constexpr (EPI == Epilogue::kFinalize) {
            // (rows, 64) fp32 -> (+ bias) x router weight -> the slot's (or
            // token's) row, 16-byte stores or vector atomics.
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
                const int out_row = s_out_rows[c * CHUNK + r];
                if (out_row < 0) continue;
                const float4 v = *reinterpret_cast<const float4*>(s_out_f32 + r * L.epi_row_elems + col - n0);
                detail::finalize_store(p, out_row, col, v, bias, s_row_weights[c * CHUNK + r]);
              }
            }
          } else {
            // (rows, OUT_N) bf16 -> Y rows, 16-byte stores; the output width
            // is a multiple of 8, so a chunk is wholly inside it or past it.
            constexpr int OUT_N = EPI == Epilogue::kSwiglu ? kSm90WarpgroupRows / 2 : kSm90WarpgroupRows;
            constexpr int OUT_CHUNKS = OUT_N / 8;
            const int y_cols = EPI == Epilogue::kSwiglu ? n_half : p.n;
            const int n0 = u.n_tile * (EPI == Epilogue::kSwiglu ? BLOCK_N / 2 : BLOCK_N) + consumer * OUT_N;
            static_assert(EPI != Epilogue::kSwiglu || OUT_N % 16 == 0, "a SwiGLU tile must hold whole NVFP4 blocks");
            // W4A4 (kSwiglu with act_quant_scales): quantised to NVFP4
            // against down_proj's input_scale on the way, a block of 16
            // features per pair of threads (n0 and the output width are
            // multiples of 16: both chunks of a block are stored or skipped).
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
          ptx::named_barrier_sync(sm90::kBarWarpgroup0 + consumer, 128);  // staging free again
        }
      }
    }
  }
#endif  // FP4MOE_SM90_DEVICE_CODE
}

}  // namespace fp4moe::kernels
