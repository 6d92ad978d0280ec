// DeviceBuffer<T>: the project's one owning device allocation, used by the
// layers, the CLI, the benchmarks and the GPU tests. Internal (not under
// include/): the public API takes caller-owned device pointers.
//
// It holds size() elements of T in cudaMalloc'd memory of the device that was
// current when it was allocated, and frees it with cudaFree; it is move-only,
// and a moved-from buffer is empty. An allocation that fails throws
// fp4moe::Error and leaves the buffer empty; a constructor that fails frees
// what it allocated. Copies and fills are ordered on a caller-given stream
// (the legacy default stream when none is given); download() and the
// stream-less upload() wait for their copy.
//
// Tested in tests/util/test_device_buffer.cpp, and by every GPU test, which
// keeps its data in these buffers.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <limits>
#include <utility>
#include <vector>

#include "fp4moe/cuda_check.hpp"
#include "fp4moe/error.hpp"

namespace fp4moe {

template <typename T>
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  // `count` elements, contents undefined.
  explicit DeviceBuffer(size_t count) { resize(count); }
  // A copy of `host`, complete on return. The object is constructed once the
  // delegated constructor returns, so a failed copy frees the memory.
  explicit DeviceBuffer(const std::vector<T>& host) : DeviceBuffer(host.size()) { upload(host); }
  ~DeviceBuffer() { release(); }

  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  DeviceBuffer(DeviceBuffer&& other) noexcept
      : ptr_(std::exchange(other.ptr_, nullptr)), count_(std::exchange(other.count_, 0)) {}
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept {
    if (this != &other) {
      release();
      ptr_ = std::exchange(other.ptr_, nullptr);
      count_ = std::exchange(other.count_, 0);
    }
    return *this;
  }

  T* get() const { return ptr_; }  // null when empty
  size_t size() const { return count_; }
  size_t bytes() const { return count_ * sizeof(T); }
  bool empty() const { return count_ == 0; }

  // Reallocates to `count` elements, contents undefined. The old memory is
  // freed first, so old and new are never held together; cudaFree waits for
  // the device, so work still using the old memory has finished.
  void resize(size_t count) {
    FP4MOE_CHECK(count <= std::numeric_limits<size_t>::max() / sizeof(T), "DeviceBuffer: ", count, " elements of ",
                 sizeof(T), " bytes overflow size_t");
    T* old = std::exchange(ptr_, nullptr);
    count_ = 0;
    if (old) FP4MOE_CUDA_CHECK(cudaFree(old));
    if (count == 0) return;
    void* ptr = nullptr;
    const cudaError_t status = cudaMalloc(&ptr, count * sizeof(T));
    if (status != cudaSuccess) {
      // Out of memory is not sticky: clear it from the runtime's last error,
      // so that the next launch's check does not report this allocation.
      cudaGetLastError();
      FP4MOE_THROW("cudaMalloc of ", count * sizeof(T), " bytes failed: ", cudaGetErrorName(status), " (",
                   cudaGetErrorString(status), ")");
    }
    ptr_ = static_cast<T*>(ptr);
    count_ = count;
  }

  // Grows to at least `count` elements and keeps a larger allocation, for
  // buffers reused across calls of varying size. Returns whether it
  // reallocated (the contents are then undefined).
  bool grow(size_t count) {
    if (count <= count_) return false;
    resize(count);
    return true;
  }

  // Copies `host` into the first host.size() elements (at most size()),
  // ordered on `stream`. From pageable host memory (a std::vector's) the call
  // returns once the bytes are staged, so `host` may change or go as soon as
  // it returns.
  void upload(const std::vector<T>& host, cudaStream_t stream) {
    FP4MOE_CHECK(host.size() <= count_, "DeviceBuffer::upload: ", host.size(), " elements into a buffer of ", count_);
    if (!host.empty())
      FP4MOE_CUDA_CHECK(cudaMemcpyAsync(ptr_, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice, stream));
  }
  // The same, complete on return (then visible to work on any stream).
  void upload(const std::vector<T>& host) {
    if (host.empty()) return;
    upload(host, nullptr);
    FP4MOE_CUDA_CHECK(cudaStreamSynchronize(nullptr));
  }

  // The whole buffer, after the work queued on `stream` (waits for it).
  std::vector<T> download(cudaStream_t stream = nullptr) const {
    std::vector<T> host(count_);
    if (count_) FP4MOE_CUDA_CHECK(cudaMemcpyAsync(host.data(), ptr_, bytes(), cudaMemcpyDeviceToHost, stream));
    FP4MOE_CUDA_CHECK(cudaStreamSynchronize(stream));
    return host;
  }

  // Sets every byte to `byte` on `stream`: 0 to zero, 0xFF to poison (NaN
  // for floats, -1 for integers).
  void fill_bytes(int byte, cudaStream_t stream = nullptr) {
    if (count_) FP4MOE_CUDA_CHECK(cudaMemsetAsync(ptr_, byte, bytes(), stream));
  }

 private:
  // Destructor and move: no throwing; an error of cudaFree belongs to work
  // that was checked where it was queued.
  void release() noexcept {
    if (ptr_) cudaFree(ptr_);
    ptr_ = nullptr;
    count_ = 0;
  }

  T* ptr_ = nullptr;
  size_t count_ = 0;
};

}  // namespace fp4moe
