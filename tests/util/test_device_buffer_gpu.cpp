// GPU tests of src/util/device_buffer.hpp: round trips through upload and
// download (blocking and on a stream), fill_bytes, a partial upload, grow
// keeping the larger allocation, and moves handing the memory over. Skipped,
// visibly, where there is no GPU.
#include <gtest/gtest.h>

#include <cuda_runtime_api.h>

#include <cstdint>
#include <utility>
#include <vector>

#include "fp4moe/cuda_check.hpp"
#include "gpu_test_util.hpp"
#include "util/device_buffer.hpp"

namespace fp4moe {
namespace {

std::vector<int32_t> iota(size_t count, int32_t first) {
  std::vector<int32_t> v(count);
  for (size_t i = 0; i < count; ++i) v[i] = first + static_cast<int32_t>(i);
  return v;
}

TEST(DeviceBufferGpu, RoundTrips) {
  FP4MOE_REQUIRE_GPU();
  for (const size_t count : {size_t{1}, size_t{3}, size_t{1000}, size_t{1} << 20}) {
    const std::vector<int32_t> host = iota(count, 7);
    const DeviceBuffer<int32_t> a(host);
    EXPECT_EQ(a.size(), count);
    EXPECT_EQ(a.bytes(), count * 4);
    EXPECT_NE(a.get(), nullptr);
    EXPECT_EQ(a.download(), host) << count;

    cudaStream_t stream = nullptr;
    FP4MOE_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    DeviceBuffer<int32_t> b(count);
    b.fill_bytes(0xFF, stream);
    EXPECT_EQ(b.download(stream), std::vector<int32_t>(count, -1)) << count;
    b.upload(host, stream);
    EXPECT_EQ(b.download(stream), host) << count;
    FP4MOE_CUDA_CHECK(cudaStreamDestroy(stream));
  }
}

// Out of device memory: an fp4moe::Error, and the runtime's last error is
// cleared, so that the next launch's check does not report this allocation;
// the device keeps working.
TEST(DeviceBufferGpu, OutOfMemoryLeavesNoErrorBehind) {
  FP4MOE_REQUIRE_GPU();
  size_t free_bytes = 0, total_bytes = 0;
  FP4MOE_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
  DeviceBuffer<uint8_t> b;
  EXPECT_THROW(b.resize(total_bytes * 2), Error);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  EXPECT_TRUE(b.empty());
  DeviceBuffer<int32_t> after(iota(16, 3));
  EXPECT_EQ(after.download(), iota(16, 3));
}

TEST(DeviceBufferGpu, PartialUploadKeepsTheRest) {
  FP4MOE_REQUIRE_GPU();
  DeviceBuffer<int32_t> b(8);
  b.fill_bytes(0);
  b.upload({5, 6, 7});
  EXPECT_EQ(b.download(), (std::vector<int32_t>{5, 6, 7, 0, 0, 0, 0, 0}));
}

TEST(DeviceBufferGpu, GrowKeepsTheLargerAllocation) {
  FP4MOE_REQUIRE_GPU();
  DeviceBuffer<float> b;
  EXPECT_TRUE(b.grow(100));
  EXPECT_EQ(b.size(), 100u);
  const float* first = b.get();
  EXPECT_FALSE(b.grow(50));
  EXPECT_FALSE(b.grow(100));
  EXPECT_EQ(b.get(), first);
  EXPECT_EQ(b.size(), 100u);
  EXPECT_TRUE(b.grow(101));
  EXPECT_EQ(b.size(), 101u);
  b.resize(10);
  EXPECT_EQ(b.size(), 10u);
}

TEST(DeviceBufferGpu, MovesHandTheMemoryOver) {
  FP4MOE_REQUIRE_GPU();
  const std::vector<int32_t> host = iota(64, -3);
  DeviceBuffer<int32_t> a(host);
  const int32_t* ptr = a.get();
  DeviceBuffer<int32_t> b(std::move(a));
  EXPECT_TRUE(a.empty());
  EXPECT_EQ(a.get(), nullptr);
  EXPECT_EQ(b.get(), ptr);
  DeviceBuffer<int32_t> c(iota(8, 0));
  c = std::move(b);  // frees c's old memory
  EXPECT_TRUE(b.empty());
  EXPECT_EQ(c.get(), ptr);
  EXPECT_EQ(c.download(), host);
}

}  // namespace
}  // namespace fp4moe
