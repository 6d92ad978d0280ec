// The shared-memory models of the two grouped-GEMM kernel families: one
// constexpr description per tile configuration, giving every region's offset
// and size.
//
// Each kernel (src/kernels/portable_grouped_gemm.cuh, sm90_grouped_gemm.cuh)
// carves its dynamic shared memory from its family's layout function and
// nothing else, and static_asserts the total against the smallest per-block
// limit it must run on; the host planner (src/plan/configs.cpp) builds the
// printed layout from the same structs, so the table `fp4moe plan` shows is
// the one the kernel uses. The GPU test checks the compiled kernels'
// attributes against it.
#pragma once

#include <cstdint>

#include "fp4moe/plan.hpp"  // Epilogue

namespace fp4moe {

// Per-block opt-in shared memory limits (bytes).
inline constexpr int64_t kSmemLimitSm80 = 166912;
inline constexpr int64_t kSmemLimitSm86 = 101376;  // also SM89
inline constexpr int64_t kSmemLimitSm90 = 232448;  // also SM100
inline constexpr int64_t kSmemLimitSm120 = 101376;
// Shared memory per SM on SM90 (also SM100), and what each resident block
// costs on top of its own (reserved by the system).
inline constexpr int64_t kSmemPerSmSm90 = 233472;
inline constexpr int64_t kSmemReservedPerBlock = 1024;
// The portable family must fit the smallest of these.
inline constexpr int64_t kPortableSmemLimit = 101376;

// Experts one launch can cover: the scheduler keeps a prefix sum of m-tiles
// per expert in shared memory.
inline constexpr int kMaxExperts = 512;

// Region alignment: 128 B keeps every region on its own bank-row boundary and
// satisfies the 16-B alignment of cp.async and ldmatrix.
inline constexpr int64_t kSmemAlign = 128;

constexpr int64_t align_up(int64_t value, int64_t alignment) { return (value + alignment - 1) / alignment * alignment; }

// Packed weights in smem and global memory are grouped in 512-byte fragments:
// 16 weight rows x 64 K values, laid out so that lane l of a warp reads the 16
// bytes it needs for four m16n8k16 MMAs with one 16-byte load.
inline constexpr int kFragRows = 16;
inline constexpr int kFragK = 64;
inline constexpr int kFragBytes = kFragRows * kFragK / 2;        // 512
inline constexpr int kFragScaleBytes = kFragRows * kFragK / 16;  // 64

// One token's row of an epilogue staging tile over `weight_rows` rows of the
// weight tile: bf16 outputs (half as many for SwiGLU, where gate and up rows
// make one output) or fp32 finalize rows, padded by 16 B so that a warp's
// column writes spread over all banks.
struct EpilogueRow {
  int elems = 0;
  int elem_bytes = 0;
};
constexpr EpilogueRow epilogue_row(Epilogue epilogue, int weight_rows) {
  switch (epilogue) {
    case Epilogue::kSwiglu:
      return {weight_rows / 2 + 8, 2};
    case Epilogue::kFinalize:
      return {weight_rows + 4, 4};
    case Epilogue::kNone:
      break;
  }
  return {weight_rows + 8, 2};
}

// Every region of one configuration, computed by a constexpr function so the
// kernel evaluates it at compile time and the planner at run time.
struct PortableSmemLayout {
  // Per pipeline stage.
  int64_t weight_stage_bytes = 0;  // (BLOCK_N, BLOCK_K/2) packed fp4
  int64_t scale_stage_bytes = 0;   // (BLOCK_N, BLOCK_K/16) block scales
  int64_t act_stage_bytes = 0;     // (BLOCK_M, BLOCK_K) bf16, swizzled

  // Mainloop ring buffers, (STAGES, ...) each.
  int64_t weight_offset = 0, weight_bytes = 0;
  int64_t scale_offset = 0, scale_bytes = 0;
  int64_t act_offset = 0, act_bytes = 0;
  int64_t mainloop_end = 0;

  // Epilogue staging of the output tile, token-major so rows leave with
  // 16-byte stores; it reuses the drained mainloop buffers. Per epilogue:
  //   kNone      (BLOCK_M, BLOCK_N + 8)     bf16
  //   kSwiglu    (BLOCK_M, BLOCK_N / 2 + 8) bf16  (gate and up rows make one output)
  //   kFinalize  (BLOCK_M, BLOCK_N + 4)     fp32  (scaled by the router weight on the way out)
  // The pad (16 B) spreads a warp's column writes over all banks.
  int epi_row_elems = 0;
  int epi_elem_bytes = 0;
  int64_t epilogue_offset = 0, epilogue_bytes = 0;
  int64_t union_end = 0;

  // Per token row of the tile, live through mainloop and epilogue: the
  // activation row it reads (gather), and for kFinalize the output row it
  // goes to and its router weight. (3, BLOCK_M) 4-byte words.
  int64_t rows_offset = 0, rows_bytes = 0;

  // Scheduler: m-tile prefix sums per expert, int32 (kMaxExperts + 1), then
  // 32 int32 of per-warp partial sums used while building them.
  int64_t schedule_offset = 0, schedule_bytes = 0;
  // Split-K: the "this block reduces the tile" flag, broadcast to all threads.
  int64_t flag_offset = 0, flag_bytes = 0;

  int64_t total_bytes = 0;
};

constexpr PortableSmemLayout portable_smem_layout(int block_n, int block_m, int block_k, int stages,
                                                  Epilogue epilogue) {
  PortableSmemLayout l;
  l.weight_stage_bytes = int64_t{block_n} * block_k / 2;
  l.scale_stage_bytes = int64_t{block_n} * block_k / 16;
  l.act_stage_bytes = int64_t{block_m} * block_k * 2;

  l.weight_offset = 0;
  l.weight_bytes = stages * l.weight_stage_bytes;
  l.scale_offset = align_up(l.weight_offset + l.weight_bytes, kSmemAlign);
  l.scale_bytes = stages * l.scale_stage_bytes;
  l.act_offset = align_up(l.scale_offset + l.scale_bytes, kSmemAlign);
  l.act_bytes = stages * l.act_stage_bytes;
  l.mainloop_end = align_up(l.act_offset + l.act_bytes, kSmemAlign);

  const EpilogueRow row = epilogue_row(epilogue, block_n);
  l.epi_row_elems = row.elems;
  l.epi_elem_bytes = row.elem_bytes;
  l.epilogue_offset = 0;
  l.epilogue_bytes = int64_t{block_m} * l.epi_row_elems * l.epi_elem_bytes;
  l.union_end = align_up(l.mainloop_end > l.epilogue_bytes ? l.mainloop_end : l.epilogue_bytes, kSmemAlign);

  l.rows_offset = l.union_end;
  l.rows_bytes = 3 * int64_t{block_m} * 4;

  l.schedule_offset = align_up(l.rows_offset + l.rows_bytes, kSmemAlign);
  l.schedule_bytes = (kMaxExperts + 1 + 32) * 4;
  l.flag_offset = align_up(l.schedule_offset + l.schedule_bytes, 16);
  l.flag_bytes = 16;

  l.total_bytes = align_up(l.flag_offset + l.flag_bytes, kSmemAlign);
  return l;
}

// ------------------------------------------------------------ SM90a family
//
// A block is one producer warpgroup (bulk copies of weights and scales;
// tensor-map copies of contiguous activation rows, or cp.async of gathered
// ones) and kSm90Consumers consumer
// warpgroups (dequantise, wgmma, epilogue), each owning 64 weight rows of the
// BLOCK_N = 128 tile. The producer runs ahead across work units, so the
// epilogue staging cannot reuse the ring: it is a region of its own, sized
// for a chunk of at most kSm90EpilogueChunk tokens at a time.
inline constexpr int kSm90Consumers = 2;
inline constexpr int kSm90WarpgroupRows = 64;  // weight rows per consumer warpgroup (wgmma M)
inline constexpr int kSm90BlockN = kSm90Consumers * kSm90WarpgroupRows;
inline constexpr int kSm90Threads = (kSm90Consumers + 1) * 128;
inline constexpr int kSm90EpilogueChunk = 32;  // tokens staged per epilogue round
inline constexpr int kSm90StageBarriers = 3;   // mbarriers per pipeline stage (Sm90SmemLayout)
// wgmma reads the activation tile in 128-byte-swizzled atoms of 8 rows x
// 128 B, which must start on 1024-byte boundaries.
inline constexpr int64_t kSm90AtomAlign = 1024;

// The steps in which a unit's wgmma width (its token columns) follows its
// rows: a quarter of the tile from m32 up, 8 for m8 and m16, the whole tile
// for m256 (sm90_grouped_gemm.cuh, sm90::mma_width). Also the rows of one
// tensor-map box of activations: a unit's width is a whole number of them.
// Kernels compiled for two blocks per SM (Sm90SmemLayout::blocks_per_sm)
// have at most two widths, and one above 32 rows: with 104 registers per
// consumer thread, four copies of the m32 mainloop or two of the m64 one
// made ptxas serialise the wgmmas for lack of registers (C7512), and two of
// the m48 one spilled.
constexpr int sm90_mma_width_step(int block_m, int blocks_per_sm) {
  if (blocks_per_sm == 2) return block_m > 32 ? block_m : block_m / 2 > 8 ? block_m / 2 : 8;
  return block_m == 256 ? 256 : block_m >= 32 ? block_m / 4 : 8;
}

// One more wgmma width between the tile's last two steps, or 0: 144 for the
// one-block m160, whose units at T = 4096 hold experts of 128 +- 11 rows under
// uniform routing (121-144 rows ran at 160 columns; with 144 the units'
// columns hold 0.92 rather than 0.85 rows). The producer still copies whole
// steps (160 rows for such a unit). A sixth mainloop copy (steps of 16 from
// 80) made ptxas serialise the wgmmas (C7512), as did ten.
constexpr int sm90_mma_extra_width(int block_m, int blocks_per_sm) {
  return blocks_per_sm == 1 && block_m == 160 ? 144 : 0;
}

// Token tiles from which the producer copies contiguous activations with
// tensor maps (TMA) rather than cp.async: measured 1.06-1.48x as fast for
// m128 and m256 tiles, 0.82-1.04x for m8 ... m64, whose boxes of 8 or 16
// rows are small transfers (docs/performance.md §5.5).
inline constexpr int kSm90TensorMapMinBlockM = 128;

struct Sm90SmemLayout {
  // Per pipeline stage.
  int64_t act_stage_bytes = 0;     // (BLOCK_K/64, BLOCK_M, 64) bf16, 128-B swizzled
  int64_t weight_stage_bytes = 0;  // (BLOCK_K/64, BLOCK_N/16, 512 B) fp4 fragments
  int64_t scale_stage_bytes = 0;   // (BLOCK_K/64, BLOCK_N/16, 64 B) scale codes

  // Ring buffers, (STAGES, ...) each; activations first, 1024-B aligned.
  int64_t act_offset = 0, act_bytes = 0;
  int64_t weight_offset = 0, weight_bytes = 0;
  int64_t scale_offset = 0, scale_bytes = 0;
  // (3, STAGES) mbarriers of 8 B: "stage full", "activations consumed" and
  // "weights consumed" (the consumers release a stage's weights and scales
  // as soon as they hold them in registers, its activations once the wgmmas
  // that read them are done).
  int64_t barrier_offset = 0, barrier_bytes = 0;
  int64_t ring_end = 0;

  // Epilogue staging, (CONSUMERS, CHUNK, epi_row_elems), token-major so rows
  // leave with 16-byte stores. Row length per epilogue, as in the portable
  // family but per warpgroup (64 weight rows):
  //   kNone      64 + 8  bf16     kSwiglu  32 + 8 bf16     kFinalize  64 + 4 fp32
  int chunk_tokens = 0;
  int epi_row_elems = 0;
  int epi_elem_bytes = 0;
  int64_t epilogue_offset = 0, epilogue_bytes = 0;

  // The producer's table of the unit's (gathered) token rows, as element
  // offsets in x, (BLOCK_M) int64.
  int64_t rows_offset = 0, rows_bytes = 0;
  // kFinalize: each consumer warpgroup's table of the unit's output slots and
  // router weights, (CONSUMERS, BLOCK_M) x (int32 slot, fp32 weight); empty
  // for the other epilogues.
  int64_t slots_offset = 0, slots_bytes = 0;
  // Scheduler: m-tile prefix sums per expert (kMaxExperts + 1) + 32 int32.
  int64_t schedule_offset = 0, schedule_bytes = 0;
  // Split-K: the "this block reduces the tile" flag.
  int64_t flag_offset = 0, flag_bytes = 0;

  int64_t total_bytes = 0;
  // Blocks resident per SM: the kernel is compiled for this many (its
  // launch bounds, and the producer's and consumers' register counts).
  int blocks_per_sm = 1;
};

// Two blocks per SM where the token tile has at most kSm90TwoBlocksMaxBlockM
// rows and two blocks' shared memory fits the SM: four consumer warpgroups
// dequantising on the SM instead of two, each with a smaller register budget
// (sm90_grouped_gemm.cuh, sm90::consumer_regs), and one block's epilogue or
// pipeline fill overlapping the other's mainloop. Larger tiles' accumulators
// need the one-block budget.
inline constexpr int kSm90TwoBlocksMaxBlockM = 64;

constexpr Sm90SmemLayout sm90_smem_layout(int block_m, int block_k, int stages, Epilogue epilogue) {
  Sm90SmemLayout l;
  l.act_stage_bytes = int64_t{block_m} * block_k * 2;
  l.weight_stage_bytes = int64_t{kSm90BlockN} * block_k / 2;
  l.scale_stage_bytes = int64_t{kSm90BlockN} * block_k / 16;

  l.act_offset = 0;
  l.act_bytes = stages * l.act_stage_bytes;
  l.weight_offset = align_up(l.act_offset + l.act_bytes, kSm90AtomAlign);
  l.weight_bytes = stages * l.weight_stage_bytes;
  l.scale_offset = align_up(l.weight_offset + l.weight_bytes, kSmemAlign);
  l.scale_bytes = stages * l.scale_stage_bytes;
  l.barrier_offset = align_up(l.scale_offset + l.scale_bytes, kSmemAlign);
  l.barrier_bytes = kSm90StageBarriers * int64_t{stages} * 8;
  l.ring_end = align_up(l.barrier_offset + l.barrier_bytes, kSmemAlign);

  // Tokens per epilogue round: the tile's up to kSm90EpilogueChunk, in whole
  // rounds (m48: 16).
  l.chunk_tokens = block_m < kSm90EpilogueChunk ? block_m : block_m % kSm90EpilogueChunk == 0 ? kSm90EpilogueChunk : 16;
  const EpilogueRow row = epilogue_row(epilogue, kSm90WarpgroupRows);
  l.epi_row_elems = row.elems;
  l.epi_elem_bytes = row.elem_bytes;
  l.epilogue_offset = l.ring_end;
  l.epilogue_bytes = int64_t{kSm90Consumers} * l.chunk_tokens * l.epi_row_elems * l.epi_elem_bytes;

  l.rows_offset = align_up(l.epilogue_offset + l.epilogue_bytes, kSmemAlign);
  l.rows_bytes = int64_t{block_m} * 8;
  l.slots_offset = align_up(l.rows_offset + l.rows_bytes, kSmemAlign);
  l.slots_bytes = epilogue == Epilogue::kFinalize ? int64_t{kSm90Consumers} * block_m * 8 : 0;
  l.schedule_offset = align_up(l.slots_offset + l.slots_bytes, kSmemAlign);
  l.schedule_bytes = (kMaxExperts + 1 + 32) * 4;
  l.flag_offset = align_up(l.schedule_offset + l.schedule_bytes, 16);
  l.flag_bytes = 16;

  l.total_bytes = align_up(l.flag_offset + l.flag_bytes, kSmemAlign);
  l.blocks_per_sm =
      block_m <= kSm90TwoBlocksMaxBlockM && 2 * (l.total_bytes + kSmemReservedPerBlock) <= kSmemPerSmSm90 ? 2 : 1;
  return l;
}

// The layout of an SM90 config (its family is not checked here).
constexpr Sm90SmemLayout sm90_smem_layout(const TileConfig& c) {
  return sm90_smem_layout(c.block_m, c.block_k, c.stages, c.epilogue);
}

}  // namespace fp4moe
