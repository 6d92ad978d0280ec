// Tests of the safetensors reader against files that change under it and
// dtypes it does not read (src/format/safetensors_reader.cpp):
//   - tensors of dtypes fp4moe does not read (F64, BOOL, I8, U16, a name from
//     a newer format) leave the file readable; only get()/describe() of one
//     of them throws, naming the dtype;
//   - a file truncated after open(): get() of a tensor past the new end is an
//     fp4moe::Error naming the file and the tensor (no SIGBUS); tensors
//     before it, and tensors read before the truncation, stay readable;
//   - a file replaced by rename after open() is still read from what was
//     opened; one overwritten in place gives its new bytes, no crash;
//   - describe() reads nothing, release() frees a tensor's bytes and the next
//     get() reads them again.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include "expect_error.hpp"
#include "fp4moe/error.hpp"
#include "fp4moe/safetensors.hpp"

namespace fp4moe {
namespace {

namespace fs = std::filesystem;

std::string length_prefix(uint64_t header_bytes) {
  std::string prefix(8, '\0');
  for (int i = 0; i < 8; ++i) prefix[i] = static_cast<char>(header_bytes >> (8 * i));
  return prefix;
}

void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  ASSERT_TRUE(out.good()) << path;
}

class SafetensorsRobust : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("fp4moe-robust-" + std::to_string(::getpid()));
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override {
    std::error_code ignored;
    fs::remove_all(dir_, ignored);
  }
  std::string path_in_dir(const std::string& name) const { return (dir_ / name).string(); }

  // Three U8 tensors of 1000 bytes each, filled with 1, 2 and 3.
  std::string write_three(const std::string& path) const {
    SafetensorsWriter writer;
    for (int i = 1; i <= 3; ++i) {
      const std::vector<uint8_t> bytes(1000, static_cast<uint8_t>(i));
      writer.add("t" + std::to_string(i), DType::U8, {1000}, bytes.data(), bytes.size());
    }
    writer.write(path);
    std::ifstream in(path, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }

  fs::path dir_;
};

TEST_F(SafetensorsRobust, UnreadDTypesKeepTheFileReadable) {
  const std::string header = R"({"mask": {"dtype": "BOOL", "shape": [4], "data_offsets": [0, 4]},)"
                             R"( "stat": {"dtype": "F64", "shape": [2], "data_offsets": [4, 20]},)"
                             R"( "small": {"dtype": "I8", "shape": [2], "data_offsets": [20, 22]},)"
                             R"( "half": {"dtype": "U16", "shape": [1], "data_offsets": [22, 24]},)"
                             R"( "future": {"dtype": "F4", "shape": [6], "data_offsets": [24, 27]},)"
                             R"( "w": {"dtype": "F32", "shape": [2], "data_offsets": [28, 36]}})";
  std::string data(36, '\0');
  const float w[2] = {1.5f, -2.0f};
  std::memcpy(data.data() + 28, w, sizeof w);
  const std::string path = path_in_dir("mixed.safetensors");
  write_bytes(path, length_prefix(header.size()) + header + data);

  const SafetensorsFile file = SafetensorsFile::open(path);
  EXPECT_EQ(file.names(), (std::vector<std::string>{"mask", "stat", "small", "half", "future", "w"}));
  EXPECT_TRUE(file.contains("stat"));
  float read_back[2];
  std::memcpy(read_back, file.get("w").data, sizeof read_back);
  EXPECT_EQ(read_back[0], 1.5f);
  EXPECT_EQ(read_back[1], -2.0f);
  for (const char* name : {"mask", "stat", "small", "half", "future"}) {
    SCOPED_TRACE(name);
    const std::string message = error_of([&] { file.get(name); });
    EXPECT_NE(message.find(path), std::string::npos) << message;
    EXPECT_NE(message.find(std::string("tensor '") + name + "'"), std::string::npos) << message;
    EXPECT_NE(message.find("is not one fp4moe reads"), std::string::npos) << message;
    EXPECT_NE(error_of([&] { file.describe(name); }).find("is not one fp4moe reads"), std::string::npos);
  }
  EXPECT_NE(error_of([&] { file.get("stat"); }).find("dtype 'F64'"), std::string::npos);
}

TEST_F(SafetensorsRobust, UnreadDTypesAreStillBoundsChecked) {
  // F64 [4] needs 32 bytes; the data section holds 16.
  const std::string header = R"({"stat": {"dtype": "F64", "shape": [4], "data_offsets": [0, 32]}})";
  const std::string path = path_in_dir("short.safetensors");
  write_bytes(path, length_prefix(header.size()) + header + std::string(16, '\0'));
  EXPECT_NE(error_of([&] { SafetensorsFile::open(path); }).find("run past the end of the data section"),
            std::string::npos);
  // An unknown name past the end is caught by its offsets alone.
  const std::string future = R"({"x": {"dtype": "F4", "shape": [64], "data_offsets": [0, 40]}})";
  write_bytes(path, length_prefix(future.size()) + future + std::string(16, '\0'));
  EXPECT_NE(error_of([&] { SafetensorsFile::open(path); }).find("run past the end of the data section"),
            std::string::npos);
}

TEST_F(SafetensorsRobust, TruncationAfterOpenIsACleanError) {
  const std::string path = path_in_dir("three.safetensors");
  const std::string bytes = write_three(path);
  const SafetensorsFile file = SafetensorsFile::open(path);
  const TensorView& first = file.get("t1");  // read before the truncation
  // Cut the file in the middle of t2.
  ASSERT_EQ(::truncate(path.c_str(), static_cast<off_t>(bytes.size() - 1500)), 0);
  for (const char* name : {"t2", "t3"}) {
    SCOPED_TRACE(name);
    const std::string message = error_of([&] { file.get(name); });
    EXPECT_NE(message.find(path), std::string::npos) << message;
    EXPECT_NE(message.find(std::string("tensor '") + name + "'"), std::string::npos) << message;
    EXPECT_NE(message.find("truncated while open"), std::string::npos) << message;
  }
  EXPECT_EQ(first.data[999], 1);
  // Nothing was lost: restored, the same object reads the rest.
  write_bytes(path, bytes);
  EXPECT_EQ(file.get("t3").data[0], 3);
  EXPECT_EQ(file.get("t2").data[999], 2);
  // Truncated to nothing: every unread tensor is refused, none crashes.
  const SafetensorsFile again = SafetensorsFile::open(path);
  ASSERT_EQ(::truncate(path.c_str(), 0), 0);
  for (const std::string& name : again.names())
    EXPECT_NE(error_of([&] { again.get(name); }).find("now 0 bytes"), std::string::npos) << name;
}

TEST_F(SafetensorsRobust, ReplacedFilesAreReadAsOpened) {
  const std::string path = path_in_dir("three.safetensors");
  write_three(path);
  const SafetensorsFile file = SafetensorsFile::open(path);
  // Replaced by rename (how SafetensorsWriter and most tools write): the open
  // file is the old inode, and it is still read whole.
  SafetensorsWriter other;
  const std::vector<uint8_t> tiny(4, 9);
  other.add("other", DType::U8, {4}, tiny.data(), tiny.size());
  other.write(path);
  EXPECT_EQ(file.get("t3").data[500], 3);
  EXPECT_FALSE(file.contains("other"));
  // Removed: the same.
  fs::remove(path);
  EXPECT_EQ(file.get("t2").data[0], 2);
}

TEST_F(SafetensorsRobust, DescribeReadsNothingAndReleaseFrees) {
  const std::string path = path_in_dir("three.safetensors");
  const std::string bytes = write_three(path);
  const SafetensorsFile file = SafetensorsFile::open(path);
  const TensorView info = file.describe("t2");
  EXPECT_EQ(info.data, nullptr);
  EXPECT_EQ(info.nbytes, 1000u);
  EXPECT_EQ(info.dtype, DType::U8);
  EXPECT_EQ(info.shape, std::vector<int64_t>{1000});
  // describe() works on a truncated file (it reads nothing).
  ASSERT_EQ(::truncate(path.c_str(), 16), 0);
  EXPECT_EQ(file.describe("t3").nbytes, 1000u);
  write_bytes(path, bytes);
  EXPECT_EQ(file.get("t1").data[0], 1);
  file.release("t1");
  file.release("no such tensor");          // a no-op
  EXPECT_EQ(file.get("t1").data[999], 1);  // read again
}

}  // namespace
}  // namespace fp4moe
