// Host side of the per-block timeline (timeline.hpp).
#include "kernels/timeline.hpp"

#include <mutex>

namespace fp4moe::kernels {
namespace {

struct Units {
  std::mutex mutex;
  std::vector<void (*)(TimelineRecord*)> set_pointer;
};
Units& units() {
  static Units u;  // constructed on first use: units register from static initialisers
  return u;
}

}  // namespace

const char* to_string(TimelineKernel kernel) {
  switch (kernel) {
    case TimelineKernel::kRouting:
      return "routing";
    case TimelineKernel::kSort:
      return "sort";
    case TimelineKernel::kGather:
      return "gather";
    case TimelineKernel::kGemm1:
      return "gemm1";
    case TimelineKernel::kGemm2:
      return "gemm2";
    case TimelineKernel::kGemm:
      return "gemm";
    case TimelineKernel::kFinalize:
      return "finalize";
    case TimelineKernel::kFusedDecode:
      return "fused_decode";
    case TimelineKernel::kCount:
      break;
  }
  return "?";
}

bool timeline_available() {
#if FP4MOE_TIMELINE
  return true;
#else
  return false;
#endif
}

bool register_timeline_unit(void (*set_pointer)(TimelineRecord*)) {
  Units& u = units();
  const std::lock_guard<std::mutex> lock(u.mutex);
  u.set_pointer.push_back(set_pointer);
  return true;
}

void set_timeline(TimelineRecord* records) {
  Units& u = units();
  const std::lock_guard<std::mutex> lock(u.mutex);
  for (auto* set_pointer : u.set_pointer) set_pointer(records);
}

}  // namespace fp4moe::kernels
