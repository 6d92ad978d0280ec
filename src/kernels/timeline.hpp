// A per-block timeline of the layer's kernels, for builds configured with
// -DFP4MOE_TIMELINE=ON (a measurement build: every block of every layer
// kernel then stamps %globaltimer as it starts and as its last warp leaves;
// in other builds the stamps compile to nothing and timeline_available() is
// false). The layer bench's --timeline writes one forward's stamps
// (bench/layer_bench.cu), which show how the kernels overlap under
// programmatic dependent launch (docs/performance.md §7).
#pragma once

#include <cstdint>
#include <vector>

namespace fp4moe::kernels {

// kGemm1 and kGemm2 also mark the fused decode kernel's units of each GEMM
// (per block: its first unit's start to its last unit's end).
enum class TimelineKernel : uint32_t {
  kRouting,
  kSort,
  kGather,
  kGemm1,
  kGemm2,
  kGemm,
  kFinalize,
  kFusedDecode,
  kCount
};
const char* to_string(TimelineKernel kernel);

inline constexpr int kTimelineMaxBlocks = 2048;  // blocks beyond share the last record

// One block's span in ns of %globaltimer; start == UINT64_MAX where the
// kernel ran no such block. Blocks of several launches of one kernel (row
// classes) share their records: the earliest start, the latest end.
struct TimelineRecord {
  unsigned long long start;
  unsigned long long end;
};

bool timeline_available();
// Records [TimelineKernel::kCount * kTimelineMaxBlocks] in device memory,
// reset to (UINT64_MAX, 0), where every layer kernel launched from now on
// stamps its blocks; nullptr stops the stamping.
void set_timeline(TimelineRecord* records);
// Each translation unit that launches stamped kernels registers how to point
// its copy of the device-side pointer at the records (timeline.cuh).
bool register_timeline_unit(void (*set_pointer)(TimelineRecord*));

}  // namespace fp4moe::kernels
