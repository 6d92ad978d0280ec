// The SM90a kernel's shared pieces (sm90_grouped_gemm.cuh): its roles'
// named barriers and register split, the compile-time shape of one tile
// config (Tile), the block's shared memory carved by role (Shared), and the
// wgmma widths a unit runs at.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>
#include <type_traits>

#include "kernels/grouped_gemm_common.cuh"
#include "kernels/ptx/sm90.cuh"

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define FP4MOE_SM90_DEVICE_CODE 1
#else
#define FP4MOE_SM90_DEVICE_CODE 0
#endif

namespace fp4moe::kernels::sm90 {

// Hardware named barriers (0 is __syncthreads).
inline constexpr int kBarConsumers = 1;   // every consumer thread
inline constexpr int kBarWarpgroup0 = 2;  // + consumer warpgroup index
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
              mma_width<160, 40>(128) == 160 && mma_width<160, 40>(120) == 120 && mma_width<160, 40, 144>(121) == 144 &&
              mma_width<160, 40, 144>(144) == 144 && mma_width<160, 40, 144>(145) == 160 &&
              mma_width<160, 40, 144>(120) == 120);

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
__device__ __forceinline__ int unknown_to_compiler(int v) {
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

// The compile-time shape of one tile config, the same for every role.
template <int BLOCK_M_, int BLOCK_K_, int STAGES_, Epilogue EPI_>
struct Tile {
  static constexpr int BLOCK_M = BLOCK_M_;
  static constexpr int BLOCK_K = BLOCK_K_;
  static constexpr int STAGES = STAGES_;
  static constexpr Epilogue EPI = EPI_;
  static constexpr Sm90SmemLayout L = sm90_smem_layout(BLOCK_M, BLOCK_K, STAGES, EPI);
  static_assert(L.total_bytes <= kSmemLimitSm90, "config exceeds the SM90 shared-memory limit");
  static constexpr int BLOCK_N = kSm90BlockN;
  static constexpr int K_FRAGS = BLOCK_K / kFragK;      // 64-wide K fragments per stage
  static constexpr int N_GROUPS = BLOCK_N / kFragRows;  // 16-row fragment groups per tile
  static constexpr int X_CHUNKS = BLOCK_K / 8;          // 16-byte chunks per activation row per stage
  static constexpr int NACC = BLOCK_M / 2;              // fp32 accumulators per consumer thread
  static constexpr int CHUNK = L.chunk_tokens;          // tokens per epilogue round
  static constexpr int STEP = sm90_mma_width_step(BLOCK_M, L.blocks_per_sm);    // wgmma widths: multiples of it
  static constexpr int EXTRA = sm90_mma_extra_width(BLOCK_M, L.blocks_per_sm);  // and this one (0: none)
  // Activations by tensor map (TMA): only tiles from kSm90TensorMapMinBlockM
  // rows are compiled for it; the host sets x_map_valid only for them.
  static constexpr bool TMA_TILE = BLOCK_M >= kSm90TensorMapMinBlockM;
  static_assert(BLOCK_M % 8 == 0 && BLOCK_M <= 256 && BLOCK_M % CHUNK == 0 && CHUNK % 8 == 0,
                "BLOCK_M must be a multiple of 8 up to 256 (wgmma N)");
  static_assert(BLOCK_K % kFragK == 0 && layout::kPadK % BLOCK_K == 0 && layout::kPadN % BLOCK_N == 0,
                "unsupported tile shape");
  static_assert(BLOCK_N == layout::kPadN, "a stage of the prepared layout is one 128-row tile");
};

// The block's shared memory by role (Sm90SmemLayout): shared-window
// addresses for the async proxy and the barriers, pointers for the rest.
// Per stage three mbarriers: stage_full (its copies landed), acts_free (its
// activations read by every consumer's wgmmas) and weights_free (its weights
// and scales dequantised into registers).
template <class T>
struct Shared {
  uint8_t* smem;
  uint32_t act_ring;      // (STAGES, K_FRAGS, BLOCK_M, 128 B) swizzled bf16
  uint32_t weight_ring;   // (STAGES, K_FRAGS, N_GROUPS, 512 B) fp4
  uint32_t scale_ring;    // (STAGES, K_FRAGS, N_GROUPS, 64 B) scale codes
  uint32_t stage_full;    // (STAGES) mbarrier
  uint32_t acts_free;     // (STAGES) mbarrier
  uint32_t weights_free;  // (STAGES) mbarrier
  int64_t* src_rows;      // (BLOCK_M) x offsets of a gathered unit's rows
  int32_t* prefix;        // (kMaxExperts + 1) m-tiles of the experts before e
  int32_t* warp_sums;     // (32)
  int32_t* flag;          // split-K: this block holds a tile's last slice
  static_assert(kSm90StageBarriers == 3, "stage_full, acts_free and weights_free");

  __device__ __forceinline__ explicit Shared(uint8_t* base) : smem(base) {
    constexpr Sm90SmemLayout L = T::L;
    const uint32_t smem_base = ptx::smem_u32(smem);
    act_ring = smem_base + L.act_offset;
    weight_ring = smem_base + L.weight_offset;
    scale_ring = smem_base + L.scale_offset;
    stage_full = smem_base + L.barrier_offset;
    acts_free = stage_full + 8 * T::STAGES;
    weights_free = acts_free + 8 * T::STAGES;
    src_rows = reinterpret_cast<int64_t*>(smem + L.rows_offset);
    prefix = reinterpret_cast<int32_t*>(smem + L.schedule_offset);
    warp_sums = prefix + kMaxExperts + 1;
    flag = reinterpret_cast<int32_t*>(smem + L.flag_offset);
  }
};

// A ring position: the stage a role reads or fills next and the phase its
// barriers are in.
struct RingPosition {
  int stage = 0;
  uint32_t phase = 0;
  template <int STAGES>
  __device__ __forceinline__ void advance() {
    if (++stage == STAGES) {
      stage = 0;
      phase ^= 1;
    }
  }
};

}  // namespace fp4moe::kernels::sm90
