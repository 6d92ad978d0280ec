// Tests of src/util/device_buffer.hpp that need no GPU: empty buffers make no
// CUDA call, moves leave the source empty, a failed allocation (no device
// here, or a size no device has) throws fp4moe::Error and leaves the buffer
// empty, and oversized uploads and element counts are refused before any
// CUDA call. The copies themselves are checked in test_device_buffer_gpu.cpp.
#include <gtest/gtest.h>

#include <cstdint>
#include <functional>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "fp4moe/error.hpp"
#include "util/device_buffer.hpp"

namespace fp4moe {
namespace {

// More bytes than any device has (and than a 64-bit address space maps).
constexpr size_t kImpossibleBytes = size_t{1} << 62;

std::string error_message(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.message();
  }
  ADD_FAILURE() << "expected fp4moe::Error";
  return {};
}

TEST(DeviceBuffer, EmptyBuffersNeedNoDevice) {
  DeviceBuffer<float> a;
  EXPECT_EQ(a.get(), nullptr);
  EXPECT_EQ(a.size(), 0u);
  EXPECT_EQ(a.bytes(), 0u);
  EXPECT_TRUE(a.empty());

  DeviceBuffer<float> b(size_t{0});
  DeviceBuffer<int32_t> c(std::vector<int32_t>{});
  EXPECT_EQ(b.get(), nullptr);
  EXPECT_EQ(c.get(), nullptr);
  b.resize(0);
  EXPECT_FALSE(b.grow(0));
  b.fill_bytes(0xFF);
  c.upload({});
  c.upload({}, nullptr);
  EXPECT_TRUE(b.empty());
  EXPECT_TRUE(c.empty());
}

TEST(DeviceBuffer, MoveLeavesTheSourceEmpty) {
  DeviceBuffer<float> a;
  DeviceBuffer<float> b(std::move(a));
  EXPECT_TRUE(a.empty());
  EXPECT_TRUE(b.empty());
  a = DeviceBuffer<float>();
  EXPECT_EQ(a.get(), nullptr);
}

TEST(DeviceBuffer, FailedAllocationThrowsAndLeavesItEmpty) {
  const std::string msg = error_message([] { DeviceBuffer<uint8_t> b(kImpossibleBytes); });
  EXPECT_NE(msg.find("cudaMalloc"), std::string::npos) << msg;

  DeviceBuffer<uint8_t> b;
  EXPECT_THROW(b.resize(kImpossibleBytes), Error);
  EXPECT_EQ(b.get(), nullptr);
  EXPECT_EQ(b.size(), 0u);
  EXPECT_THROW(b.grow(kImpossibleBytes), Error);
  EXPECT_TRUE(b.empty());
}

TEST(DeviceBuffer, OverflowingCountIsRefused) {
  const std::string msg = error_message([] { DeviceBuffer<double> b(std::numeric_limits<size_t>::max() / 4); });
  EXPECT_NE(msg.find("overflow"), std::string::npos) << msg;
}

TEST(DeviceBuffer, UploadLargerThanTheBufferIsRefused) {
  DeviceBuffer<int32_t> b;
  const std::string msg = error_message([&] { b.upload({1, 2, 3}); });
  EXPECT_NE(msg.find("3 elements into a buffer of 0"), std::string::npos) << msg;
  EXPECT_THROW(b.upload({1}, nullptr), Error);
}

}  // namespace
}  // namespace fp4moe
