// The compiled grouped-GEMM kernels, one entry per tile config: the host
// launch path (grouped_gemm.cu) looks a plan's config up here. Each family's
// entries are built from its X-macro (plan/compiled_configs.hpp) in the
// translation unit that instantiates the kernels.
#pragma once

#include <cstdint>
#include <vector>

#include "fp4moe/plan.hpp"

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

}  // namespace fp4moe::kernels
