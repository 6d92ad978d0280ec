// Tests of src/format/safetensors_writer.cpp: the exact byte layout
// (header padded to 8 bytes, tensors contiguous in insertion order), tensors
// refused (bad shapes, byte counts, names, invalid UTF-8), atomic
// replacement, and writes that fail (missing directory, failed rename, file
// size limit) leaving neither the target nor a temporary file; the
// streaming writer writes what the collecting one writes, refuses misuse
// and leaves nothing uncommitted. Also built with ASan/UBSan as
// test_safetensors_asan.
#include <gtest/gtest.h>

#include <sys/resource.h>
#include <sys/stat.h>

#include <csignal>
#include <cstring>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "expect_error.hpp"
#include "fp4moe/error.hpp"
#include "fp4moe/safetensors.hpp"
#include "safetensors_fixture.hpp"

namespace fp4moe {
namespace {

using namespace std::string_literals;

TEST_F(SafetensorsTest, WritesTheReferenceByteLayout) {
  // What the reference implementation writes for
  // save_file({"a": tensor([1., 2.])}, metadata={"format": "pt"}):
  // compact JSON, metadata first, header padded with spaces to 8 bytes.
  const float values[] = {1.0f, 2.0f};
  SafetensorsWriter writer;
  writer.add("a", DType::F32, {2}, values, sizeof(values));
  writer.set_metadata("format", "pt");
  const std::string path = path_in_dir("a.safetensors");
  writer.write(path);

  std::string header = R"({"__metadata__":{"format":"pt"},"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})";
  ASSERT_EQ(header.size(), 85u);
  header += "   ";
  const std::string data = {0, 0, '\x80', '\x3f', 0, 0, 0, '\x40'};  // 1.0f, 2.0f little-endian
  EXPECT_EQ(read_file_bytes(path), file_image(header, data));
}

TEST_F(SafetensorsTest, WritesTensorsContiguouslyInInsertionOrder) {
  SafetensorsWriter writer;
  const uint8_t three_bytes[] = {1, 2, 3};
  const int64_t one_i64 = -5;
  writer.add("z_first", DType::U8, {3}, three_bytes, 3);
  writer.add("a_second", DType::I64, {}, &one_i64, 8);
  const std::string path = path_in_dir("order.safetensors");
  writer.write(path);

  const SafetensorsFile file = SafetensorsFile::open(path);
  EXPECT_EQ(file.names(), (std::vector<std::string>{"z_first", "a_second"}));
  int64_t read_back = 0;
  std::memcpy(&read_back, file.get("a_second").data, 8);  // may be unaligned
  EXPECT_EQ(read_back, -5);
  const std::string bytes = read_file_bytes(path);
  // The data section ends with z_first's 3 bytes, then a_second's 8.
  EXPECT_EQ(bytes.substr(bytes.size() - 11, 3), std::string("\x01\x02\x03"));
  EXPECT_EQ(std::memcmp(bytes.data() + bytes.size() - 8, &one_i64, 8), 0);
  EXPECT_EQ((bytes.size() - 3 - 8) % 8, 0u) << "header not padded to 8 bytes";
}

// ---------------------------------------------------------------------------
// Writer input validation and failing writes

TEST_F(SafetensorsTest, WriterRejectsBadTensors) {
  const std::vector<uint8_t> bytes(64);
  SafetensorsWriter writer;
  writer.add("w", DType::BF16, {2, 3}, bytes.data(), 12);

  std::string message = error_of([&] { writer.add("x", DType::F32, {2, 3}, bytes.data(), 12); });
  EXPECT_NE(message.find("tensor 'x': 12 bytes given but shape [2, 3] of F32 needs 24 bytes"), std::string::npos)
      << message;
  message = error_of([&] { writer.add("w", DType::BF16, {2, 3}, bytes.data(), 12); });
  EXPECT_NE(message.find("tensor 'w' was already added"), std::string::npos) << message;
  message = error_of([&] { writer.add("n", DType::U8, {-1, 2}, bytes.data(), 0); });
  EXPECT_NE(message.find("negative dimension"), std::string::npos) << message;
  message = error_of([&] { writer.add("o", DType::F32, {int64_t{1} << 31, int64_t{1} << 31}, bytes.data(), 0); });
  EXPECT_NE(message.find("overflows"), std::string::npos) << message;
  message = error_of([&] { writer.add("null", DType::U8, {4}, nullptr, 4); });
  EXPECT_NE(message.find("data is null"), std::string::npos) << message;
  message = error_of([&] { writer.add("__metadata__", DType::U8, {1}, bytes.data(), 1); });
  EXPECT_NE(message.find("reserved"), std::string::npos) << message;
  // The rejected adds left the writer as it was.
  EXPECT_EQ(writer.num_tensors(), 1u);
}

TEST_F(SafetensorsTest, WriterRejectsInvalidUtf8Names) {
  const uint8_t byte = 1;
  SafetensorsWriter writer;
  writer.add("bad \xff name", DType::U8, {1}, &byte, 1);
  const std::string path = path_in_dir("utf8.safetensors");
  const std::string message = error_of([&] { writer.write(path); });
  EXPECT_NE(message.find("not valid UTF-8"), std::string::npos) << message;
  EXPECT_FALSE(fs::exists(path));
  EXPECT_TRUE(temp_files_left().empty());
}

TEST_F(SafetensorsTest, WriteReplacesAnExistingFile) {
  const std::string path = path_in_dir("replace.safetensors");
  write_seed_file(path);
  const uint8_t byte = 42;
  SafetensorsWriter writer;
  writer.add("only", DType::U8, {}, &byte, 1);
  writer.write(path);
  const SafetensorsFile file = SafetensorsFile::open(path);
  EXPECT_EQ(file.names(), std::vector<std::string>{"only"});
  EXPECT_EQ(file.get("only").data[0], 42);
  EXPECT_TRUE(temp_files_left().empty());
}

TEST_F(SafetensorsTest, WriteIntoAMissingDirectoryThrowsAndLeavesNoFile) {
  const uint8_t byte = 1;
  SafetensorsWriter writer;
  writer.add("t", DType::U8, {1}, &byte, 1);
  const std::string path = path_in_dir("no/such/dir/out.safetensors");
  const std::string message = error_of([&] { writer.write(path); });
  EXPECT_NE(message.find(path), std::string::npos) << message;
  EXPECT_NE(message.find("No such file"), std::string::npos) << message;
  EXPECT_FALSE(fs::exists(path));
  EXPECT_FALSE(fs::exists(path_in_dir("no")));
  EXPECT_TRUE(temp_files_left().empty());
}

TEST_F(SafetensorsTest, FailedRenameRemovesTheTempFile) {
  // The temporary file is written in full, then rename() fails because the
  // target is a non-empty directory.
  const std::string path = path_in_dir("target_dir");
  fs::create_directories(fs::path(path) / "occupied");
  const uint8_t byte = 1;
  SafetensorsWriter writer;
  writer.add("t", DType::U8, {1}, &byte, 1);
  const std::string message = error_of([&] { writer.write(path); });
  EXPECT_NE(message.find("cannot rename"), std::string::npos) << message;
  EXPECT_TRUE(fs::is_directory(path));
  EXPECT_TRUE(temp_files_left().empty());
}

// Lowers the file size limit so that write() fails midway with EFBIG,
// restoring the limit and SIGXFSZ's disposition afterwards.
class FileSizeLimit {
 public:
  explicit FileSizeLimit(rlim_t max_bytes) {
    getrlimit(RLIMIT_FSIZE, &saved_limit_);
    saved_handler_ = std::signal(SIGXFSZ, SIG_IGN);  // else the process is killed
    rlimit limit = saved_limit_;
    limit.rlim_cur = max_bytes;
    setrlimit(RLIMIT_FSIZE, &limit);
  }
  ~FileSizeLimit() {
    setrlimit(RLIMIT_FSIZE, &saved_limit_);
    std::signal(SIGXFSZ, saved_handler_);
  }

 private:
  rlimit saved_limit_{};
  void (*saved_handler_)(int) = nullptr;
};

TEST_F(SafetensorsTest, FailedWriteRemovesTheTempFileAndKeepsTheOldFile) {
  const std::string path = path_in_dir("limited.safetensors");
  const std::string old_bytes = write_seed_file(path);
  const std::vector<uint8_t> big(4096, 7);
  SafetensorsWriter writer;
  writer.add("big", DType::U8, {4096}, big.data(), big.size());
  std::string message;
  {
    const FileSizeLimit limit(1000);
    message = error_of([&] { writer.write(path); });
  }
  EXPECT_NE(message.find("write failed"), std::string::npos) << message;
  EXPECT_EQ(read_file_bytes(path), old_bytes);
  EXPECT_TRUE(temp_files_left().empty());
}

// ---------------------------------------------------------------------------
// Streaming writer

// The header goes out first, the data tensor by tensor, and the result is
// byte for byte what SafetensorsWriter writes for the same tensors.
TEST_F(SafetensorsTest, StreamWriterWritesWhatTheCollectingWriterWrites) {
  std::mt19937_64 rng(11);
  const auto weight = random_bytes(rng, 8 * 3);
  const auto scale = random_bytes(rng, 2 * 8);
  const float global_scale = 0.125f;
  const std::map<std::string, std::string> metadata = {{"format", "pt"}, {"quant_algo", "W4A16_NVFP4"}};

  SafetensorsWriter collecting;
  collecting.add("a.weight", DType::U8, {8, 3}, weight.data(), weight.size());
  collecting.add("a.weight_scale", DType::F8_E4M3, {2, 8}, scale.data(), scale.size());
  collecting.add("a.weight_scale_2", DType::F32, {}, &global_scale, 4);
  collecting.add("empty", DType::I64, {0, 5}, nullptr, 0);
  for (const auto& [key, value] : metadata) collecting.set_metadata(key, value);
  collecting.write(path_in_dir("collected.safetensors"));

  const std::string path = path_in_dir("streamed.safetensors");
  SafetensorsStreamWriter stream(path,
                                 {{"a.weight", DType::U8, {8, 3}},
                                  {"a.weight_scale", DType::F8_E4M3, {2, 8}},
                                  {"a.weight_scale_2", DType::F32, {}},
                                  {"empty", DType::I64, {0, 5}}},
                                 metadata);
  // Nothing at the final path until commit(); the header is already out.
  EXPECT_FALSE(fs::exists(path));
  ASSERT_EQ(temp_files_left().size(), 1u);
  EXPECT_GT(fs::file_size(dir_ / temp_files_left()[0]), 8u);
  EXPECT_EQ(stream.next_name(), "a.weight");
  stream.write("a.weight", weight.data(), weight.size());
  stream.write("a.weight_scale", scale.data(), scale.size());
  stream.write("a.weight_scale_2", &global_scale, 4);
  stream.write("empty", nullptr, 0);
  EXPECT_EQ(stream.next_name(), "");
  EXPECT_EQ(stream.num_written(), 4u);
  stream.commit();
  EXPECT_EQ(read_file_bytes(path), read_file_bytes(path_in_dir("collected.safetensors")));
  EXPECT_EQ(stream.file_bytes(), read_file_bytes(path).size());
  EXPECT_TRUE(temp_files_left().empty());
  const SafetensorsFile file = SafetensorsFile::open(path);
  EXPECT_EQ(file.metadata(), metadata);
  EXPECT_EQ(file.get("a.weight_scale_2").shape, std::vector<int64_t>{});
}

// Out-of-order tensors, wrong sizes, duplicates and a commit before the last
// tensor are refused; an uncommitted writer leaves nothing behind.
TEST_F(SafetensorsTest, StreamWriterRefusesMisuseAndLeavesNothingUncommitted) {
  const std::string path = path_in_dir("stream.safetensors");
  const std::vector<uint8_t> bytes(16, 3);
  EXPECT_NE(error_of([&] {
              SafetensorsStreamWriter w(path, {{"x", DType::U8, {4}}, {"x", DType::U8, {2}}});
            }).find("listed twice"),
            std::string::npos);
  EXPECT_NE(error_of([&] {
              SafetensorsStreamWriter w(path, {{"__metadata__", DType::U8, {1}}});
            }).find("reserved"),
            std::string::npos);
  EXPECT_NE(error_of([&] {
              SafetensorsStreamWriter w(path, {{"n", DType::U8, {-1}}});
            }).find("negative"),
            std::string::npos);
  EXPECT_TRUE(temp_files_left().empty());
  {
    SafetensorsStreamWriter w(path, {{"first", DType::U8, {4}}, {"second", DType::F32, {2}}});
    const std::string order = error_of([&] { w.write("second", bytes.data(), 8); });
    EXPECT_NE(order.find("where the header lists 'first' next"), std::string::npos) << order;
    const std::string size = error_of([&] { w.write("first", bytes.data(), 5); });
    EXPECT_NE(size.find("needs 4 bytes"), std::string::npos) << size;
    w.write("first", bytes.data(), 4);
    const std::string early = error_of([&] { w.commit(); });
    EXPECT_NE(early.find("'second' was not written"), std::string::npos) << early;
    EXPECT_EQ(temp_files_left().size(), 1u);
  }
  EXPECT_FALSE(fs::exists(path));
  EXPECT_TRUE(temp_files_left().empty()) << "the destructor removes an uncommitted file";
  {
    SafetensorsStreamWriter w(path, {{"only", DType::U8, {4}}});
    w.write("only", bytes.data(), 4);
    EXPECT_NE(error_of([&] { w.write("more", bytes.data(), 1); }).find("already written"), std::string::npos);
    w.commit();
  }
  EXPECT_EQ(SafetensorsFile::open(path).names(), std::vector<std::string>{"only"});
  EXPECT_TRUE(temp_files_left().empty());
}

// A write that fails midway (file size limit) throws and, once the writer is
// gone, leaves neither the file nor its temporary.
TEST_F(SafetensorsTest, StreamWriterFailedWriteLeavesNothing) {
  const std::string path = path_in_dir("limited_stream.safetensors");
  const std::vector<uint8_t> big(4096, 7);
  std::string message;
  {
    const FileSizeLimit limit(1000);
    SafetensorsStreamWriter w(path, {{"small", DType::U8, {16}}, {"big", DType::U8, {4096}}});
    w.write("small", big.data(), 16);
    message = error_of([&] { w.write("big", big.data(), big.size()); });
  }
  EXPECT_NE(message.find("write failed"), std::string::npos) << message;
  EXPECT_FALSE(fs::exists(path));
  EXPECT_TRUE(temp_files_left().empty());
}

}  // namespace
}  // namespace fp4moe
