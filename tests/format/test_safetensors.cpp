// Tests for safetensors reading and writing (src/format/safetensors.cpp).
//
// Round trips cover every dtype with 0-d, zero-size and n-d shapes, metadata
// and the exact byte layout. The reader is attacked three ways: a table of
// hand-written malformed headers (one per validation rule, checking the
// message), deterministic fuzzing of a valid file's bytes (every truncation,
// every single-bit flip of the length prefix and header, seeded random byte
// and token mutations), and length prefixes that lie. Every corrupt input
// must raise fp4moe::Error and nothing else; a mutant that still opens must
// describe consistent, readable tensors. Writes that fail (missing
// directory, failed rename, file size limit) must leave neither the target
// nor a temporary file. The same file is also built with ASan/UBSan as
// test_safetensors_asan, so an out-of-bounds read fails there too.
#include "fp4moe/safetensors.hpp"

#include <gtest/gtest.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <csignal>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <limits>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "expect_error.hpp"
#include "fp4moe/error.hpp"

namespace fp4moe {
namespace {

namespace fs = std::filesystem;
using namespace std::string_literals;

constexpr DType kAllDTypes[] = {DType::BF16, DType::F16, DType::F32, DType::F8_E4M3,
                                DType::U8,   DType::I32, DType::I64};

std::string read_file_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

void write_file_bytes(const std::string& path, const std::string& bytes) {
  // NOTE: a fresh file rather than a truncated one: ext4 flushes a file that
  // was truncated and rewritten when it is closed, which made the fuzz loops
  // wait on the disk for milliseconds per input.
  fs::remove(path);
  std::ofstream out(path, std::ios::binary);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  ASSERT_TRUE(out.good()) << "cannot write test input " << path;
}

std::string length_prefix(uint64_t header_bytes) {
  std::string prefix(8, '\0');
  for (int byte_idx = 0; byte_idx < 8; ++byte_idx) {
    prefix[byte_idx] = static_cast<char>(header_bytes >> (8 * byte_idx));
  }
  return prefix;
}

// A file image: length prefix, header text as given, data section.
std::string file_image(const std::string& header, const std::string& data) {
  return length_prefix(header.size()) + header + data;
}

std::vector<uint8_t> random_bytes(std::mt19937_64& rng, size_t nbytes) {
  std::vector<uint8_t> bytes(nbytes);
  for (uint8_t& byte : bytes) byte = static_cast<uint8_t>(rng());
  return bytes;
}

enum class OpenOutcome { kOpened, kRejected };

// Where open_untrusted() stores what it read, so the reads cannot be elided.
volatile unsigned g_checksum_sink = 0;

// Opens a possibly corrupt file. Rejection must be an fp4moe::Error; a file
// that opens must hold self-consistent, disjoint tensors whose every byte can
// be read (ASan and the MMU check the reads).
OpenOutcome open_untrusted(const std::string& path, const std::string& what) {
  try {
    const SafetensorsFile file = SafetensorsFile::open(path);
    std::vector<const TensorView*> views;
    for (const std::string& name : file.names()) views.push_back(&file.get(name));
    EXPECT_EQ(views.size(), file.names().size()) << what;
    unsigned checksum = 0;
    for (const TensorView* view : views) {
      EXPECT_EQ(view->nbytes, static_cast<size_t>(view->numel()) * dtype_size(view->dtype))
          << what << ": tensor '" << view->name << "'";
      for (size_t byte_idx = 0; byte_idx < view->nbytes; ++byte_idx) checksum += view->data[byte_idx];
    }
    // Each view owns its bytes (the reader copies them out with pread), so
    // overlapping ranges in the file are what open() must refuse; it does, in
    // the malformed-header table.
    g_checksum_sink = checksum;
    return OpenOutcome::kOpened;
  } catch (const Error& e) {
    EXPECT_NE(e.message().find(path), std::string::npos)
        << what << ": error does not name the file: " << e.message();
    return OpenOutcome::kRejected;
  } catch (const std::exception& e) {
    ADD_FAILURE() << what << ": threw a std::exception that is not fp4moe::Error: " << e.what();
  } catch (...) {
    ADD_FAILURE() << what << ": threw something that is not a std::exception";
  }
  return OpenOutcome::kRejected;
}

class SafetensorsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("fp4moe-test-" + std::to_string(::getpid()));
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override {
    std::error_code ignored;
    fs::remove_all(dir_, ignored);
  }

  std::string path_in_dir(const std::string& file_name) const { return (dir_ / file_name).string(); }

  std::vector<std::string> temp_files_left() const {
    std::vector<std::string> left;
    for (const auto& entry : fs::directory_iterator(dir_)) {
      const std::string name = entry.path().filename().string();
      if (name.find(".tmp.") != std::string::npos) left.push_back(name);
    }
    return left;
  }

  // A valid file with metadata, a 0-d scalar, a zero-size tensor and data in
  // several dtypes: the seed of the fuzz tests.
  std::string write_seed_file(const std::string& path) const {
    std::mt19937_64 rng(7);
    SafetensorsWriter writer;
    const auto weight = random_bytes(rng, 4 * 6);
    const auto scale = random_bytes(rng, 4 * 2);
    const auto global_scale = random_bytes(rng, 4);
    const auto bias = random_bytes(rng, 2 * 3);
    writer.add("experts.0.up_proj.weight", DType::U8, {4, 6}, weight.data(), weight.size());
    writer.add("experts.0.up_proj.weight_scale", DType::F8_E4M3, {4, 2}, scale.data(), scale.size());
    writer.add("experts.0.up_proj.weight_scale_2", DType::F32, {}, global_scale.data(), 4);
    writer.add("experts.0.empty", DType::I64, {0, 3}, nullptr, 0);
    writer.add("experts.0.bias", DType::BF16, {3}, bias.data(), bias.size());
    writer.set_metadata("format", "pt");
    writer.set_metadata("quant_algo", "NVFP4");
    writer.write(path);
    return read_file_bytes(path);
  }

  fs::path dir_;
};

// ---------------------------------------------------------------------------
// dtype and shape helpers

TEST(SafetensorsHelpers, DTypeNamesSizesAndParsing) {
  const std::pair<DType, size_t> expected_sizes[] = {
      {DType::BF16, 2}, {DType::F16, 2}, {DType::F32, 4}, {DType::F8_E4M3, 1},
      {DType::U8, 1},   {DType::I32, 4}, {DType::I64, 8}};
  for (const auto& [dtype, size] : expected_sizes) {
    EXPECT_EQ(dtype_size(dtype), size) << dtype_name(dtype);
    EXPECT_EQ(parse_dtype(dtype_name(dtype)), dtype);
  }
  EXPECT_EQ(dtype_name(DType::F8_E4M3), "F8_E4M3");
  for (const char* unsupported : {"F64", "f32", "", "F8_E5M2", "BOOL", "BF16 "}) {
    const std::string message = error_of([&] { parse_dtype(unsupported); });
    EXPECT_NE(message.find(std::string("unsupported dtype '") + unsupported + "'"), std::string::npos)
        << message;
  }
}

TEST(SafetensorsHelpers, ShapeNumelAndToString) {
  EXPECT_EQ(shape_numel(std::vector<int64_t>{}), 1);
  EXPECT_EQ(shape_numel(std::vector<int64_t>{7}), 7);
  EXPECT_EQ(shape_numel(std::vector<int64_t>{2, 3, 4}), 24);
  EXPECT_EQ(shape_numel(std::vector<int64_t>{2, 0, 4}), 0);
  // A zero dimension wins even over dimensions whose product would overflow.
  EXPECT_EQ(shape_numel(std::vector<int64_t>{int64_t{1} << 40, int64_t{1} << 40, 0}), 0);
  EXPECT_NE(error_of([] { shape_numel(std::vector<int64_t>{3, -1}); }).find("negative"),
            std::string::npos);
  EXPECT_NE(error_of([] {
              shape_numel(std::vector<int64_t>{int64_t{1} << 32, int64_t{1} << 32});
            }).find("64 bits"),
            std::string::npos);
  EXPECT_EQ(shape_to_string(std::vector<int64_t>{}), "[]");
  EXPECT_EQ(shape_to_string(std::vector<int64_t>{5}), "[5]");
  EXPECT_EQ(shape_to_string(std::vector<int64_t>{2, 3}), "[2, 3]");
}

// ---------------------------------------------------------------------------
// Round trips

TEST_F(SafetensorsTest, RoundTripsEveryDTypeAndShape) {
  // No two zero-size tensors are adjacent, so offset order = insertion order.
  const std::vector<std::vector<int64_t>> shapes = {{}, {0}, {1}, {3}, {2, 3}, {2, 0, 4}, {3, 1, 5}};
  std::mt19937_64 rng(1234);
  SafetensorsWriter writer;
  std::vector<std::string> names;
  std::vector<std::vector<uint8_t>> contents;
  for (DType dtype : kAllDTypes) {
    for (size_t shape_idx = 0; shape_idx < shapes.size(); ++shape_idx) {
      const std::vector<int64_t>& shape = shapes[shape_idx];
      names.push_back("layers." + std::string(dtype_name(dtype)) + ".t" + std::to_string(shape_idx));
      contents.push_back(random_bytes(rng, static_cast<size_t>(shape_numel(shape)) * dtype_size(dtype)));
      writer.add(names.back(), dtype, shape, contents.back().data(), contents.back().size());
    }
  }
  writer.set_metadata("format", "pt");
  writer.set_metadata("empty", "");
  writer.set_metadata("unicode \xce\xbb", "value with \"quotes\", \\ and \xe2\x9c\x93");
  EXPECT_EQ(writer.num_tensors(), names.size());
  const std::string path = path_in_dir("all.safetensors");
  writer.write(path);

  const SafetensorsFile file = SafetensorsFile::open(path);
  EXPECT_EQ(file.path(), path);
  EXPECT_EQ(file.names(), names);
  size_t tensor_idx = 0;
  for (DType dtype : kAllDTypes) {
    for (const std::vector<int64_t>& shape : shapes) {
      SCOPED_TRACE(names[tensor_idx]);
      ASSERT_TRUE(file.contains(names[tensor_idx]));
      const TensorView& view = file.get(names[tensor_idx]);
      EXPECT_EQ(view.name, names[tensor_idx]);
      EXPECT_EQ(view.dtype, dtype);
      EXPECT_EQ(view.shape, shape);
      EXPECT_EQ(view.numel(), shape_numel(shape));
      ASSERT_EQ(view.nbytes, contents[tensor_idx].size());
      EXPECT_TRUE(std::equal(view.data, view.data + view.nbytes, contents[tensor_idx].begin()));
      ++tensor_idx;
    }
  }
  const std::map<std::string, std::string> expected_metadata = {
      {"format", "pt"},
      {"empty", ""},
      {"unicode \xce\xbb", "value with \"quotes\", \\ and \xe2\x9c\x93"}};
  EXPECT_EQ(file.metadata(), expected_metadata);
  EXPECT_FALSE(file.contains("layers.F32"));
  EXPECT_TRUE(temp_files_left().empty());
}

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

  std::string header =
      R"({"__metadata__":{"format":"pt"},"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})";
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

TEST_F(SafetensorsTest, ReadsHandWrittenFiles) {
  // Listed out of offset order, with a gap, an unknown extra field, padding
  // of spaces and a newline: all valid.
  const std::string header =
      "{\"b\": {\"dtype\": \"I32\", \"shape\": [2], \"data_offsets\": [12, 20], \"extra\": 1},\n"
      " \"a\": {\"dtype\": \"U8\", \"shape\": [2, 2], \"data_offsets\": [0, 4]},\n"
      " \"s\": {\"dtype\": \"F16\", \"shape\": [], \"data_offsets\": [20, 22]}}\n     ";
  std::string data(22, '\0');
  for (size_t byte_idx = 0; byte_idx < data.size(); ++byte_idx) data[byte_idx] = static_cast<char>(byte_idx);
  const std::string path = path_in_dir("hand.safetensors");
  write_file_bytes(path, file_image(header, data));

  const SafetensorsFile file = SafetensorsFile::open(path);
  EXPECT_EQ(file.names(), (std::vector<std::string>{"a", "b", "s"}));
  EXPECT_TRUE(file.metadata().empty());
  EXPECT_EQ(file.get("a").nbytes, 4u);
  EXPECT_EQ(file.get("a").data[3], 3);
  EXPECT_EQ(file.get("b").data[0], 12);
  EXPECT_EQ(file.get("s").shape, std::vector<int64_t>{});
  EXPECT_EQ(file.get("s").numel(), 1);
  EXPECT_EQ(file.get("s").data[1], 21);
}

TEST_F(SafetensorsTest, EmptyFilesAreValid) {
  const std::string bare = path_in_dir("bare.safetensors");
  write_file_bytes(bare, file_image("{}", ""));
  EXPECT_TRUE(SafetensorsFile::open(bare).names().empty());

  const std::string padded = path_in_dir("padded.safetensors");
  write_file_bytes(padded, file_image("{}      ", ""));
  EXPECT_TRUE(SafetensorsFile::open(padded).names().empty());

  const std::string written = path_in_dir("written.safetensors");
  SafetensorsWriter().write(written);
  EXPECT_EQ(read_file_bytes(written), file_image("{}      ", ""));
  const SafetensorsFile file = SafetensorsFile::open(written);
  EXPECT_TRUE(file.names().empty());
  EXPECT_TRUE(file.metadata().empty());

  SafetensorsWriter metadata_only;
  metadata_only.set_metadata("k", "v");
  metadata_only.write(written);
  EXPECT_EQ(SafetensorsFile::open(written).metadata().at("k"), "v");
}

TEST_F(SafetensorsTest, GetOfAMissingTensorNamesTheFileAndTheTensor) {
  const std::string path = path_in_dir("seed.safetensors");
  write_seed_file(path);
  const SafetensorsFile file = SafetensorsFile::open(path);
  EXPECT_FALSE(file.contains("experts.1.up_proj.weight"));
  const std::string message = error_of([&] { file.get("experts.1.up_proj.weight"); });
  EXPECT_NE(message.find(path), std::string::npos) << message;
  EXPECT_NE(message.find("'experts.1.up_proj.weight'"), std::string::npos) << message;
}

TEST_F(SafetensorsTest, OpenReportsMissingFilesAndDirectories) {
  const std::string missing = path_in_dir("missing.safetensors");
  std::string message = error_of([&] { SafetensorsFile::open(missing); });
  EXPECT_NE(message.find(missing), std::string::npos) << message;
  EXPECT_NE(message.find("No such file"), std::string::npos) << message;

  message = error_of([&] { SafetensorsFile::open(dir_.string()); });
  EXPECT_NE(message.find("not a regular file"), std::string::npos) << message;
}

// A FIFO is refused like a directory, without blocking in open() for a
// writer that never comes (a shard named by a checkpoint's index could be one).
TEST_F(SafetensorsTest, OpenRefusesAFifoWithoutBlocking) {
  const std::string fifo = path_in_dir("pipe.safetensors");
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0) << std::strerror(errno);
  const std::string message = error_of([&] { SafetensorsFile::open(fifo); });
  EXPECT_NE(message.find("not a regular file"), std::string::npos) << message;
}

TEST_F(SafetensorsTest, MovesKeepViewsValid) {
  const std::string path = path_in_dir("seed.safetensors");
  const std::string bytes = write_seed_file(path);
  SafetensorsFile first = SafetensorsFile::open(path);
  const TensorView* view = &first.get("experts.0.bias");
  const std::vector<uint8_t> expected(view->data, view->data + view->nbytes);

  SafetensorsFile moved(std::move(first));
  EXPECT_EQ(&moved.get("experts.0.bias"), view);  // map nodes move, not copy
  EXPECT_TRUE(std::equal(view->data, view->data + view->nbytes, expected.begin()));

  SafetensorsFile assigned = SafetensorsFile::open(path);
  assigned = std::move(moved);  // closes assigned's own file
  EXPECT_EQ(assigned.path(), path);
  EXPECT_TRUE(std::equal(view->data, view->data + view->nbytes, expected.begin()));
}

// ---------------------------------------------------------------------------
// Writer input validation and failing writes

TEST_F(SafetensorsTest, WriterRejectsBadTensors) {
  const std::vector<uint8_t> bytes(64);
  SafetensorsWriter writer;
  writer.add("w", DType::BF16, {2, 3}, bytes.data(), 12);

  std::string message = error_of([&] { writer.add("x", DType::F32, {2, 3}, bytes.data(), 12); });
  EXPECT_NE(message.find("tensor 'x': 12 bytes given but shape [2, 3] of F32 needs 24 bytes"),
            std::string::npos)
      << message;
  message = error_of([&] { writer.add("w", DType::BF16, {2, 3}, bytes.data(), 12); });
  EXPECT_NE(message.find("tensor 'w' was already added"), std::string::npos) << message;
  message = error_of([&] { writer.add("n", DType::U8, {-1, 2}, bytes.data(), 0); });
  EXPECT_NE(message.find("negative dimension"), std::string::npos) << message;
  message = error_of(
      [&] { writer.add("o", DType::F32, {int64_t{1} << 31, int64_t{1} << 31}, bytes.data(), 0); });
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
  EXPECT_NE(error_of([&] { SafetensorsStreamWriter w(path, {{"__metadata__", DType::U8, {1}}}); }).find("reserved"),
            std::string::npos);
  EXPECT_NE(error_of([&] { SafetensorsStreamWriter w(path, {{"n", DType::U8, {-1}}}); }).find("negative"),
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

// ---------------------------------------------------------------------------
// Malformed files

struct MalformedCase {
  std::string header;
  std::string expected_message;  // a substring of the fp4moe::Error message
};

TEST_F(SafetensorsTest, MalformedHeadersRaiseOneClearError) {
  // Each header breaks one rule; the data section is 128 bytes.
  const auto entry = [](const std::string& fields) { return R"({"x.weight": {)" + fields + "}}"; };
  const std::string valid_dtype = R"("dtype": "F32")";
  const std::string valid_shape = R"("shape": [2])";
  const std::string valid_offsets = R"("data_offsets": [0, 8])";
  const std::vector<MalformedCase> cases = {
      // The JSON itself.
      {"", "is not valid JSON"},
      {"{", "is not valid JSON"},
      {R"({"a": 1,})", "is not valid JSON"},
      {"{} x", "is not valid JSON"},
      {"{}\0\0\0\0"s, "is not valid JSON: NUL byte at offset 2"},
      // nlohmann::json alone would stop at the NUL and never see the tensor.
      {"{}\0{\"x\": {}}"s, "is not valid JSON: NUL byte at offset 2"},
      {"{\"bad \xff name\": {}}", "is not valid JSON"},
      {"[]", "header is not a JSON object, got a JSON array"},
      {R"("text")", "header is not a JSON object, got a JSON string"},
      {"12", "header is not a JSON object, got 12"},
      // The entry.
      {R"({"x.weight": 5})", "tensor 'x.weight': entry must be an object"},
      {R"({"x.weight": [1, 2]})", "tensor 'x.weight': entry must be an object"},
      // dtype.
      {entry(valid_shape + ", " + valid_offsets), "tensor 'x.weight': missing 'dtype'"},
      {entry(R"("dtype": 4, )" + valid_shape + ", " + valid_offsets),
       "tensor 'x.weight': 'dtype' must be a string, got 4"},
      {entry(R"("dtype": null, )" + valid_shape + ", " + valid_offsets),
       "'dtype' must be a string, got a JSON null"},
      {entry(R"("dtype": "", )" + valid_shape + ", " + valid_offsets), "'dtype' is an empty string"},
      // A dtype fp4moe does not read opens (test_safetensors_robust.cpp), but
      // its byte count is still checked.
      {entry(R"("dtype": "F64", )" + valid_shape + ", " + valid_offsets),
       "tensor 'x.weight': data_offsets [0, 8] but shape [2] of F64 needs 16 bytes"},
      // shape.
      {entry(valid_dtype + ", " + valid_offsets), "tensor 'x.weight': missing 'shape'"},
      {entry(valid_dtype + R"(, "shape": 2, )" + valid_offsets), "'shape' must be an array of dimensions, got 2"},
      {entry(valid_dtype + R"(, "shape": {"0": 2}, )" + valid_offsets), "'shape' must be an array"},
      {entry(valid_dtype + R"(, "shape": [2, -1], )" + valid_offsets),
       "tensor 'x.weight': shape[1] must be a non-negative integer, got -1"},
      {entry(valid_dtype + R"(, "shape": [2.5], )" + valid_offsets), "shape[0] must be a non-negative integer, got 2.5"},
      {entry(valid_dtype + R"(, "shape": [2.0], )" + valid_offsets), "shape[0] must be a non-negative integer, got 2.0"},
      {entry(valid_dtype + R"(, "shape": [1e30], )" + valid_offsets), "shape[0] must be a non-negative integer"},
      {entry(valid_dtype + R"(, "shape": ["2"], )" + valid_offsets), "shape[0] must be a non-negative integer, got a JSON string"},
      {entry(valid_dtype + R"(, "shape": [null], )" + valid_offsets), "got a JSON null"},
      {entry(valid_dtype + R"(, "shape": [[2]], )" + valid_offsets), "got a JSON array"},
      {entry(valid_dtype + R"(, "shape": [9223372036854775808], )" + valid_offsets),
       "shape[0] = 9223372036854775808 does not fit in a signed 64-bit dimension"},
      {entry(valid_dtype + R"(, "shape": [18446744073709551615], )" + valid_offsets),
       "does not fit in a signed 64-bit dimension"},
      {entry(R"("dtype": "U8", "shape": [4294967296, 4294967296], )" + valid_offsets),
       "tensor 'x.weight': shape [4294967296, 4294967296] of U8 overflows a 64-bit byte count"},
      {entry(valid_dtype + R"(, "shape": [2305843009213693952], )" + valid_offsets),
       "shape [2305843009213693952] of F32 overflows a 64-bit byte count"},
      // data_offsets.
      {entry(valid_dtype + ", " + valid_shape), "tensor 'x.weight': missing 'data_offsets'"},
      {entry(valid_dtype + ", " + valid_shape + R"(, "data_offsets": 8)"),
       "'data_offsets' must be an array [begin, end], got 8"},
      {entry(valid_dtype + ", " + valid_shape + R"(, "data_offsets": [8])"),
       "'data_offsets' must be an array [begin, end], got an array of 1 elements"},
      {entry(valid_dtype + ", " + valid_shape + R"(, "data_offsets": [0, 8, 16])"),
       "got an array of 3 elements"},
      {entry(valid_dtype + ", " + valid_shape + R"(, "data_offsets": [-8, 0])"),
       "data_offsets must be non-negative integers, got [-8, 0]"},
      {entry(valid_dtype + ", " + valid_shape + R"(, "data_offsets": [0, 8.5])"),
       "data_offsets must be non-negative integers, got [0, 8.5]"},
      {entry(valid_dtype + ", " + valid_shape + R"(, "data_offsets": ["0", 8])"),
       "data_offsets must be non-negative integers, got [a JSON string, 8]"},
      {entry(valid_dtype + ", " + valid_shape + R"(, "data_offsets": [16, 8])"),
       "tensor 'x.weight': data_offsets [16, 8] have end before begin"},
      {entry(valid_dtype + ", " + valid_shape + R"(, "data_offsets": [124, 132])"),
       "tensor 'x.weight': data_offsets [124, 132] run past the end of the data section (128 bytes)"},
      {entry(valid_dtype + ", " + valid_shape + R"(, "data_offsets": [0, 18446744073709551615])"),
       "run past the end of the data section"},
      {entry(valid_dtype + R"(, "shape": [4, 8], "data_offsets": [0, 100])"),
       "tensor 'x.weight': data_offsets [0, 100] but shape [4, 8] of F32 needs 128 bytes"},
      {entry(valid_dtype + R"(, "shape": [], "data_offsets": [0, 0])"),
       "data_offsets [0, 0] but shape [] of F32 needs 4 bytes"},
      {entry(valid_dtype + R"(, "shape": [0], "data_offsets": [0, 4])"),
       "data_offsets [0, 4] but shape [0] of F32 needs 0 bytes"},
      // Between tensors.
      {R"({"a": {"dtype": "U8", "shape": [8], "data_offsets": [0, 8]},)"
       R"( "b": {"dtype": "U8", "shape": [8], "data_offsets": [4, 12]}})",
       "tensor 'b': data_offsets [4, 12] overlap tensor 'a' at [0, 8]"},
      {R"({"a": {"dtype": "U8", "shape": [8], "data_offsets": [0, 8]},)"
       R"( "b": {"dtype": "U8", "shape": [8], "data_offsets": [0, 8]}})",
       "overlap tensor 'a' at [0, 8]"},
      {R"({"big": {"dtype": "U8", "shape": [64], "data_offsets": [0, 64]},)"
       R"( "inner": {"dtype": "U8", "shape": [0], "data_offsets": [8, 8]}})",
       "tensor 'inner': data_offsets [8, 8] overlap tensor 'big' at [0, 64]"},
      {R"({"a": {"dtype": "U8", "shape": [8], "data_offsets": [0, 8]},)"
       R"( "a": {"dtype": "U8", "shape": [8], "data_offsets": [8, 16]}})",
       "header lists 'a' more than once"},
      // Metadata.
      {R"({"__metadata__": 5})", "'__metadata__' must be an object of strings, got 5"},
      {R"({"__metadata__": ["format", "pt"]})", "'__metadata__' must be an object of strings, got a JSON array"},
      {R"({"__metadata__": {"format": "pt", "version": 2}})",
       "'__metadata__' entry 'version' must be a string, got 2"},
      {R"({"__metadata__": {"nested": {"a": "b"}}})", "entry 'nested' must be a string, got a JSON object"},
  };
  const std::string data(128, '\x5a');
  const std::string path = path_in_dir("model.safetensors");
  for (const MalformedCase& test_case : cases) {
    SCOPED_TRACE("header: " + test_case.header);
    write_file_bytes(path, file_image(test_case.header, data));
    const std::string message = error_of([&] { SafetensorsFile::open(path); });
    EXPECT_EQ(message.rfind(path + ": ", 0), 0u) << "message does not start with the path: " << message;
    EXPECT_NE(message.find(test_case.expected_message), std::string::npos) << message;
  }
}

TEST_F(SafetensorsTest, LyingLengthPrefixesAreRejected) {
  const std::string path = path_in_dir("prefix.safetensors");
  const std::string body = R"({"a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}})"
                           "x";
  const uint64_t file_bytes = 8 + body.size();
  const std::pair<uint64_t, std::string> cases[] = {
      {file_bytes - 7, "runs past the end of the file"},
      {file_bytes, "runs past the end of the file"},
      {100'000'001, "exceeds the limit of 100000000 bytes"},
      {uint64_t{1} << 63, "exceeds the limit"},
      {std::numeric_limits<uint64_t>::max(), "exceeds the limit"},
      {std::numeric_limits<uint64_t>::max() - 7, "exceeds the limit"},
  };
  for (const auto& [header_bytes, expected] : cases) {
    SCOPED_TRACE("header length " + std::to_string(header_bytes));
    write_file_bytes(path, length_prefix(header_bytes) + body);
    const std::string message = error_of([&] { SafetensorsFile::open(path); });
    EXPECT_NE(message.find(expected), std::string::npos) << message;
  }
  // The file exactly as long as the prefix says, with no data section: the
  // tensor then runs past the end of the (empty) data section.
  write_file_bytes(path, length_prefix(body.size() - 1) + body.substr(0, body.size() - 1));
  EXPECT_NE(error_of([&] { SafetensorsFile::open(path); }).find("run past the end of the data section (0 bytes)"),
            std::string::npos);
}

TEST_F(SafetensorsTest, FuzzEveryTruncationIsRejected) {
  const std::string path = path_in_dir("seed.safetensors");
  const std::string seed = write_seed_file(path);
  ASSERT_EQ(open_untrusted(path, "seed"), OpenOutcome::kOpened);
  const std::string truncated_path = path_in_dir("truncated.safetensors");
  for (size_t length = 0; length < seed.size(); ++length) {
    write_file_bytes(truncated_path, seed.substr(0, length));
    const std::string what = "truncated to " + std::to_string(length) + " bytes";
    EXPECT_EQ(open_untrusted(truncated_path, what), OpenOutcome::kRejected) << what;
    if (length < 8) {
      EXPECT_NE(error_of([&] { SafetensorsFile::open(truncated_path); })
                    .find("shorter than the 8-byte header length prefix"),
                std::string::npos);
    }
  }
}

TEST_F(SafetensorsTest, FuzzEveryBitFlipOfLengthPrefixAndHeader) {
  const std::string seed = write_seed_file(path_in_dir("seed.safetensors"));
  uint64_t header_bytes = 0;
  for (int byte_idx = 7; byte_idx >= 0; --byte_idx) {
    header_bytes = (header_bytes << 8) | static_cast<uint8_t>(seed[byte_idx]);
  }
  const std::string path = path_in_dir("flipped.safetensors");
  int num_opened = 0;
  for (size_t byte_idx = 0; byte_idx < 8 + header_bytes; ++byte_idx) {
    for (int bit = 0; bit < 8; ++bit) {
      std::string mutant = seed;
      mutant[byte_idx] = static_cast<char>(mutant[byte_idx] ^ (1 << bit));
      write_file_bytes(path, mutant);
      const std::string what = "bit " + std::to_string(bit) + " of byte " + std::to_string(byte_idx);
      const OpenOutcome outcome = open_untrusted(path, what);
      // Any change of the length prefix must be caught; a flip inside the
      // header may still be valid (a renamed tensor, an edited metadata value).
      if (byte_idx < 8) {
        EXPECT_EQ(outcome, OpenOutcome::kRejected) << what;
      }
      num_opened += outcome == OpenOutcome::kOpened;
    }
  }
  RecordProperty("header_bit_flips_still_valid", num_opened);
}

// Seeded random edits of the seed file: byte replacements, insertions and
// deletions in the header, and replacement of JSON tokens with boundary
// values; with the length prefix kept consistent or left stale.
TEST_F(SafetensorsTest, FuzzRandomMutationsNeverCrash) {
  const std::string seed = write_seed_file(path_in_dir("seed.safetensors"));
  const size_t data_section_bytes = 4 * 6 + 4 * 2 + 4 + 2 * 3;  // see write_seed_file()
  const size_t data_section_begin = seed.size() - data_section_bytes;
  const std::string seed_header = seed.substr(8, data_section_begin - 8);
  const std::string seed_data = seed.substr(data_section_begin);
  const std::vector<std::string> boundary_tokens = {
      "-1", "0", "1", "3", "4", "8", "24", "4294967296", "9223372036854775807",
      "9223372036854775808", "18446744073709551615", "18446744073709551616",
      "99999999999999999999999", "1e3", "2.0", "-0", "null", "true", "\"8\"", "[]", "{}",
      "[0,0]", "\"F64\"", "\"I64\"", "\"U8\"", "\"__metadata__\"", "{\"a\":1}"};
  const std::string json_bytes = "{}[],:\" 0123456789-.eE\\";

  std::mt19937_64 rng(20261202);
  const std::string path = path_in_dir("mutant.safetensors");
  int num_opened = 0;
  int num_rejected = 0;
  constexpr int kNumMutants = 10000;
  for (int mutant_idx = 0; mutant_idx < kNumMutants; ++mutant_idx) {
    std::string header = seed_header;
    const int num_edits = 1 + static_cast<int>(rng() % 3);
    for (int edit = 0; edit < num_edits && !header.empty(); ++edit) {
      const size_t position = rng() % header.size();
      switch (rng() % 5) {
        case 0:  // any byte
          header[position] = static_cast<char>(rng());
          break;
        case 1:  // a byte that means something in JSON
          header[position] = json_bytes[rng() % json_bytes.size()];
          break;
        case 2:
          header.insert(position, 1, json_bytes[rng() % json_bytes.size()]);
          break;
        case 3:
          header.erase(position, 1 + rng() % 4);
          break;
        default: {  // replace the number or string token around position
          const auto is_token_char = [&](size_t idx) {
            return std::isalnum(static_cast<unsigned char>(header[idx])) || header[idx] == '_' ||
                   header[idx] == '.' || header[idx] == '-';
          };
          size_t begin = position;
          size_t end = position;
          while (begin > 0 && is_token_char(begin - 1)) --begin;
          while (end < header.size() && is_token_char(end)) ++end;
          header.replace(begin, end - begin, boundary_tokens[rng() % boundary_tokens.size()]);
          break;
        }
      }
    }
    const bool stale_prefix = rng() % 8 == 0;
    std::string image = length_prefix(stale_prefix ? seed_header.size() : header.size()) + header + seed_data;
    write_file_bytes(path, image);
    const std::string what = "mutant " + std::to_string(mutant_idx) + " header: " + header;
    if (open_untrusted(path, what) == OpenOutcome::kOpened) {
      ++num_opened;
    } else {
      ++num_rejected;
    }
  }
  RecordProperty("mutants_opened", num_opened);
  RecordProperty("mutants_rejected", num_rejected);
  // The fuzzer must exercise both paths to mean anything.
  EXPECT_GT(num_opened, 0);
  EXPECT_GT(num_rejected, kNumMutants / 2);
}

}  // namespace
}  // namespace fp4moe
