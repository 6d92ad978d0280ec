// current_device_identity() (src/tune/tune_cache.hpp): the CUDA device's name
// and multiprocessor count, the NVIDIA driver's version and fp4moe's, looked
// up once per device. In library fp4moe (it asks the CUDA runtime). Tested
// on a GPU in tests/tune/test_tune_gpu.cpp.
#include <cuda_runtime_api.h>

#include <fstream>
#include <map>
#include <mutex>
#include <regex>
#include <string>

#include "fp4moe/cuda_check.hpp"
#include "fp4moe/error.hpp"
#include "tune/tune_cache.hpp"

namespace fp4moe::tune {

namespace {

// The NVIDIA kernel module's version ("570.86.15") from
// /proc/driver/nvidia/version, which names the driver build exactly; where
// that file is not readable (not Linux, a restricted container), the CUDA
// driver API version ("CUDA 12080"), which a driver update may leave as it is.
std::string driver_version() {
  std::ifstream in("/proc/driver/nvidia/version");
  std::string line;
  static const std::regex kModule(R"(Kernel Module(?: for \S+)?\s+(\d+(?:\.\d+)+))");
  while (std::getline(in, line)) {
    std::smatch match;
    if (std::regex_search(line, match, kModule)) return match[1];
  }
  int version = 0;
  FP4MOE_CUDA_CHECK(cudaDriverGetVersion(&version));
  return "CUDA " + std::to_string(version);
}

}  // namespace

DeviceIdentity current_device_identity() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    cudaGetLastError();  // clear the sticky "no device" error
    FP4MOE_THROW("no CUDA device: tuned choices are measured and used per GPU");
  }
  int device = 0;
  FP4MOE_CUDA_CHECK(cudaGetDevice(&device));
  static std::mutex mutex;
  static std::map<int, DeviceIdentity> known;
  const std::lock_guard<std::mutex> lock(mutex);
  if (const auto it = known.find(device); it != known.end()) return it->second;
  cudaDeviceProp prop{};
  FP4MOE_CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
  DeviceIdentity id{prop.name, prop.multiProcessorCount, driver_version(), library_version()};
  known.emplace(device, id);
  return id;
}

}  // namespace fp4moe::tune
