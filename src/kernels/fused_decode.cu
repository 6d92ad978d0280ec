// Host side of the fused decode kernel (fused_decode.cuh; the contract is
// in grouped_gemm.hpp): its compiled tiles, the checks of both GEMMs'
// arguments against each other, and the launch.
// Tested in tests/layer/test_moe_layer_decode.cpp.
#include "kernels/fused_decode.cuh"

#include <algorithm>
#include <vector>

#include "fp4moe/cuda_check.hpp"
#include "fp4moe/error.hpp"
#include "kernels/device_info.hpp"
#include "kernels/grouped_gemm.hpp"
#include "kernels/kernel_table.hpp"
#include "kernels/launch.cuh"
#include "plan/compiled_configs.hpp"
#include "plan/planner.hpp"

namespace fp4moe {

namespace {

using DecodeKernelFn = void (*)(kernels::GroupedGemmParams, kernels::GroupedGemmParams, kernels::FusedDecodeParams);

struct DecodeKernel {
  TileConfig tile;  // kFinalize: its shared-memory layout is the launch's
  DecodeKernelFn fn;
};

const std::vector<DecodeKernel>& decode_kernels() {
  static const std::vector<DecodeKernel> table = {
#define FP4MOE_X(BN, BM, BK, S, W)                                             \
  {TileConfig{BN, BM, BK, S, W, Epilogue::kFinalize, KernelFamily::kPortable}, \
   &kernels::portable_fused_decode_kernel<BN, BM, BK, S, W>},
      FP4MOE_FUSED_DECODE_TILES(FP4MOE_X)
#undef FP4MOE_X
  };
  return table;
}

const DecodeKernel* find_decode_kernel(TileConfig tile) {
  tile.epilogue = Epilogue::kFinalize;
  for (const DecodeKernel& k : decode_kernels())
    if (k.tile == tile) return &k;
  return nullptr;
}

}  // namespace

int64_t fused_decode_counter_ints(int64_t num_rows, int64_t num_tokens, int64_t gemm2_n) {
  // An m-tile holds at least one row: at most num_rows of them.
  return 2 + 2 * num_rows + num_tokens * ((gemm2_n + layout::kPadN - 1) / layout::kPadN);
}

void fused_decode(const GroupedGemmArgs& gemm1, const GroupedGemmArgs& gemm2, const FusedDecodeArgs& decode,
                  const TileConfig& tile, cudaStream_t stream) {
  const DecodeKernel* kernel = find_decode_kernel(tile);
  FP4MOE_CHECK(kernel != nullptr, "fused_decode: tile ", tile.to_string(),
               " is not compiled for the fused decode kernel");
  FP4MOE_CHECK(gemm1.num_experts == gemm2.num_experts && gemm1.expert_offsets == gemm2.expert_offsets &&
                   gemm1.num_rows == gemm2.num_rows,
               "fused_decode: both GEMMs must share their experts, expert offsets and rows");
  FP4MOE_CHECK(gemm2.x == gemm1.y && gemm2.k * 2 == gemm1.n && gemm2.gather_rows == nullptr,
               "fused_decode: GEMM2 must read GEMM1's SwiGLU output (x = GEMM1's y, k = GEMM1's n / 2, no gather)");
  FP4MOE_CHECK(!gemm2.atomic_out && gemm2.out_row_divisor == 1 && gemm2.out_rows == gemm2.num_rows,
               "fused_decode: GEMM2 must store one bf16 row per (token, slot) row (no atomic_out, out_row_divisor 1)");
  FP4MOE_CHECK(decode.num_tokens >= 1 && decode.rows_per_token >= 1 && decode.rows_per_token <= 32 &&
                   decode.num_tokens * decode.rows_per_token == gemm2.num_rows,
               "fused_decode: num_tokens = ", decode.num_tokens, ", rows_per_token = ", decode.rows_per_token,
               "; expected num_tokens * rows_per_token = the GEMMs' rows (", gemm2.num_rows,
               ") and at most 32 rows per token");
  const int64_t counters = fused_decode_counter_ints(gemm2.num_rows, decode.num_tokens, gemm2.n);
  FP4MOE_CHECK(decode.counters != nullptr && decode.counters_capacity >= counters,
               "fused_decode: ", decode.counters_capacity, " counters given; ", counters, " needed");
  FP4MOE_CHECK(decode.output == nullptr || reinterpret_cast<uintptr_t>(decode.output) % 16 == 0,
               "fused_decode: output must be 16-byte aligned");

  GemmPlan plan1;
  plan1.config = kernel->tile;
  plan1.config.epilogue = Epilogue::kSwiglu;
  GemmPlan plan2;
  plan2.config = kernel->tile;
  const auto params = [](const GroupedGemmArgs& args, const GemmPlan& plan) {
    kernels::GroupedGemmParams p = kernels::checked_launch_params(args, plan);
    p.split_k = 1;
    p.min_expert_rows = 0;
    p.max_expert_rows = INT32_MAX;
    return p;
  };
  const kernels::GroupedGemmParams p1 = params(gemm1, plan1);
  const kernels::GroupedGemmParams p2 = params(gemm2, plan2);
  if (gemm1.num_rows == 0) return;

  const kernels::DeviceInfo dev = kernels::current_device();
  const int64_t smem = portable_smem_layout(kernel->tile.block_n, kernel->tile.block_m, kernel->tile.block_k,
                                            kernel->tile.stages, Epilogue::kFinalize)
                           .total_bytes;
  kernels::check_fits_device(kernel->tile, smem, dev);
  const int threads = kernel->tile.warps * 32;
  const int blocks_per_sm =
      std::max(1, kernels::resident_blocks(reinterpret_cast<const void*>(kernel->fn), threads, smem, dev.device));

  kernels::FusedDecodeParams d{};
  d.counters = decode.counters;
  d.max_m_tiles = static_cast<int>(gemm2.num_rows);
  d.slot_experts = decode.slot_experts;
  d.output = static_cast<__nv_bfloat16*>(decode.output);
  d.num_tokens = static_cast<int>(decode.num_tokens);
  d.rows_per_token = decode.rows_per_token;
  // Units: at least one per GEMM per row's expert tile; more blocks than
  // units would only take a ticket and leave.
  const int64_t n_tiles = (gemm1.n + layout::kPadN - 1) / layout::kPadN + (gemm2.n + layout::kPadN - 1) / layout::kPadN;
  const int grid = static_cast<int>(std::min<int64_t>(int64_t{dev.num_sms} * blocks_per_sm, gemm1.num_rows * n_tiles));
  kernels::launch_kernel(kernel->fn, grid, threads, static_cast<size_t>(smem), stream, gemm1.programmatic_launch, p1,
                         p2, d);
}

}  // namespace fp4moe
