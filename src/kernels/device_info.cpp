#include "kernels/device_info.hpp"

#include <cuda_runtime_api.h>

#include <map>
#include <mutex>

#include "fp4moe/cuda_check.hpp"

namespace fp4moe::kernels {

DeviceInfo current_device() {
  int device = 0;
  FP4MOE_CUDA_CHECK(cudaGetDevice(&device));
  static std::mutex mutex;
  static std::map<int, DeviceInfo> cache;
  std::lock_guard<std::mutex> lock(mutex);
  auto it = cache.find(device);
  if (it != cache.end()) return it->second;
  DeviceInfo info;
  info.device = device;
  FP4MOE_CUDA_CHECK(cudaDeviceGetAttribute(&info.num_sms, cudaDevAttrMultiProcessorCount, device));
  FP4MOE_CUDA_CHECK(cudaDeviceGetAttribute(&info.cc_major, cudaDevAttrComputeCapabilityMajor, device));
  FP4MOE_CUDA_CHECK(cudaDeviceGetAttribute(&info.cc_minor, cudaDevAttrComputeCapabilityMinor, device));
  int smem = 0;
  FP4MOE_CUDA_CHECK(cudaDeviceGetAttribute(&smem, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  info.smem_per_block = smem;
  cache.emplace(device, info);
  return info;
}

}  // namespace fp4moe::kernels
