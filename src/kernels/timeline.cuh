// Device side of the per-block timeline (timeline.hpp): FP4MOE_TIMELINE_SPAN
// (kernel) at the top of a kernel stamps the block's start and, as the last
// warp leaves the kernel's scope, its end. Nothing at all without
// FP4MOE_TIMELINE.
#pragma once

#include "kernels/timeline.hpp"

#if FP4MOE_TIMELINE
#include <cuda_runtime.h>

#include "fp4moe/cuda_check.hpp"

namespace fp4moe::kernels {
namespace {

// One per translation unit (a __device__ variable is not shared across
// units without relocatable device code); set_timeline sets each.
__device__ TimelineRecord* g_timeline_records = nullptr;
void set_unit_timeline(TimelineRecord* records) {
  FP4MOE_CUDA_CHECK(cudaMemcpyToSymbol(g_timeline_records, &records, sizeof records));
}
[[maybe_unused]] const bool g_timeline_unit_registered = register_timeline_unit(set_unit_timeline);

__device__ __forceinline__ unsigned long long global_timer_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Lane 0 of every warp stamps: the block's start is its first warp's, the
// end its last warp's.
class TimelineSpan {
 public:
  __device__ explicit TimelineSpan(TimelineKernel kernel) {
    TimelineRecord* records = g_timeline_records;
    if (records == nullptr || threadIdx.x % 32 != 0) return;
    record_ = records + static_cast<int>(kernel) * kTimelineMaxBlocks + min(blockIdx.x, kTimelineMaxBlocks - 1u);
    atomicMin(&record_->start, global_timer_ns());
  }
  __device__ ~TimelineSpan() {
    if (record_ != nullptr) atomicMax(&record_->end, global_timer_ns());
  }

 private:
  TimelineRecord* record_ = nullptr;
};

// The block's span of `kernel` from `start` (a global_timer_ns() it took)
// to now, by its thread 0: for parts of a kernel, as the fused decode
// kernel's units of each GEMM.
__device__ __forceinline__ void timeline_mark(TimelineKernel kernel, unsigned long long start) {
  TimelineRecord* records = g_timeline_records;
  if (records == nullptr || threadIdx.x != 0) return;
  TimelineRecord* record =
      records + static_cast<int>(kernel) * kTimelineMaxBlocks + min(blockIdx.x, kTimelineMaxBlocks - 1u);
  atomicMin(&record->start, start);
  atomicMax(&record->end, global_timer_ns());
}

}  // namespace
}  // namespace fp4moe::kernels

#define FP4MOE_TIMELINE_SPAN(kernel) const ::fp4moe::kernels::TimelineSpan fp4moe_timeline_span_(kernel)
#define FP4MOE_TIMELINE_NOW() ::fp4moe::kernels::global_timer_ns()
#define FP4MOE_TIMELINE_MARK(kernel, start) ::fp4moe::kernels::timeline_mark(kernel, start)
#else
#define FP4MOE_TIMELINE_SPAN(kernel) static_cast<void>(0)
#define FP4MOE_TIMELINE_NOW() 0ull
#define FP4MOE_TIMELINE_MARK(kernel, start) static_cast<void>(start)
#endif
