// The compiled grouped-GEMM kernels, one entry per tile config: the host
// launch path (grouped_gemm.cu) looks a plan's config up here. Each family's
// entries are built from its X-macro (plan/compiled_configs.hpp) in the
// translation unit that instantiates the kernels.
#pragma once

#include <cstdint>
#include <vector>

#include "fp4moe/plan.hpp"
#include "kernels/device_info.hpp"
#include "kernels/grouped_gemm.hpp"

namespace fp4moe::kernels {

struct GroupedGemmParams;
using GroupedGemmKernelFn = void (*)(GroupedGemmParams);

struct GroupedGemmKernel {
  TileConfig config;
  GroupedGemmKernelFn fn;
  int64_t smem_bytes;  // from the shared-memory model: the launch size
};

// The SM90a family (sm90_grouped_gemm.cu).
const std::vector<GroupedGemmKernel>& sm90_kernels();

// grouped_gemm.cu, for the launchers of other kernels built on the grouped
// GEMM's units (fused_decode.cu): the kernel parameters of a launch of
// `plan` (split-K and row-class fields left to the launch) from arguments
// it validates as grouped_gemm() does; a kernel's resident blocks per SM at
// its launch size, once its dynamic shared-memory limit is raised to it.
// And the refusal, before any launch, of a config whose family does not run
// on `dev` or whose `smem_bytes` do not fit it (with the region-by-region
// breakdown).
GroupedGemmParams checked_launch_params(const GroupedGemmArgs& args, const GemmPlan& plan);
int resident_blocks(const void* fn, int threads, int64_t smem_bytes, int device);
void check_fits_device(const TileConfig& config, int64_t smem_bytes, const DeviceInfo& dev);

}  // namespace fp4moe::kernels
