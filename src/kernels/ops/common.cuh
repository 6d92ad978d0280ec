// What the small kernels around the grouped GEMMs (src/kernels/ops/*.cu)
// share: their block sizes, the full-warp mask, and their launchers' grid
// size and input checks. The contract of the launchers is moe_ops.hpp.
#pragma once

#include <algorithm>
#include <cstdint>

#include "fp4moe/error.hpp"
#include "kernels/device_info.hpp"
#include "kernels/ops/moe_ops.hpp"
#include "kernels/timeline.cuh"
#include "plan/smem_model.hpp"

namespace fp4moe::kernels {

inline constexpr unsigned kFullWarp = 0xFFFFFFFFu;
// kMaxExperts (plan/smem_model.hpp, the grouped GEMM's bound) also sizes the
// routing keys and the sort histogram held in shared memory.
inline constexpr int kRouteThreads = 256;          // routing: one block per token
inline constexpr int kSortThreads = 1024;          // a sort block
inline constexpr int kElementwiseThreads = 256;    // gather and finalize
inline constexpr int kElementwiseBlocksPerSm = 8;  // 2048 resident threads per SM: enough to saturate HBM

static_assert(kMaxTopK <= 32, "lane j holds the j-th chosen expert");

// Grid of a grid-stride elementwise kernel: enough blocks to fill the GPU,
// no more than the work needs.
inline unsigned elementwise_grid(int64_t num_items) {
  const int64_t needed = (num_items + kElementwiseThreads - 1) / kElementwiseThreads;
  const int64_t resident = static_cast<int64_t>(current_device().num_sms) * kElementwiseBlocksPerSm;
  return static_cast<unsigned>(std::max<int64_t>(1, std::min(needed, resident)));
}

inline bool aligned_16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

inline void check_num_experts(const char* op, int64_t num_experts) {
  FP4MOE_CHECK(num_experts >= 1 && num_experts <= kMaxExperts, op, ": num_experts = ", num_experts,
               "; expected in [1, ", kMaxExperts, "]");
}

}  // namespace fp4moe::kernels
