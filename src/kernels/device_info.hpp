// Facts about the current CUDA device that the launch paths need, looked up
// once per device: launching must not query the driver on every call.
#pragma once

#include <cstdint>

namespace fp4moe::kernels {

struct DeviceInfo {
  int device = 0;
  int num_sms = 0;
  int cc_major = 0;            // compute capability, major
  int cc_minor = 0;            // compute capability, minor
  int64_t smem_per_block = 0;  // opt-in shared-memory limit per block
};

inline int compute_capability(const DeviceInfo& dev) { return dev.cc_major * 10 + dev.cc_minor; }

// The current device's facts (cudaGetDevice), cached per device.
DeviceInfo current_device();

}  // namespace fp4moe::kernels
