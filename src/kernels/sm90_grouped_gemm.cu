// Instantiates the SM90a grouped-GEMM kernels listed in
// plan/compiled_configs.hpp (their bodies exist for sm_90a only) and lists
// them for the launch path in grouped_gemm.cu.
#include "kernels/kernel_table.hpp"
#include "kernels/sm90_grouped_gemm.cuh"
#include "plan/compiled_configs.hpp"

namespace fp4moe::kernels {

const std::vector<GroupedGemmKernel>& sm90_kernels() {
  static const std::vector<GroupedGemmKernel> table = {
#define FP4MOE_X(BM, BK, S, EPI)                                                    \
  {TileConfig{kSm90BlockN, BM, BK, S, kSm90Threads / 32, EPI, KernelFamily::kSm90}, \
   &sm90_grouped_gemm_kernel<BM, BK, S, EPI>, sm90_smem_layout(BM, BK, S, EPI).total_bytes},
      FP4MOE_SM90_KERNELS(FP4MOE_X)
#undef FP4MOE_X
  };
  return table;
}

}  // namespace fp4moe::kernels
