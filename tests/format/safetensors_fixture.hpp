// What the safetensors reader and writer tests share: file images written
// byte by byte (length prefix, header, data), seeded random bytes, the
// check that a possibly corrupt file is refused with an fp4moe::Error or
// opens consistent and readable, and the SafetensorsTest fixture (a fresh
// directory, the temporary files a failed write left, a valid seed file).
//
// Used by tests/format/test_safetensors_{format,reader,writer}.cpp, which
// are also built with ASan/UBSan as test_safetensors_asan.
#pragma once

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <random>
#include <string>
#include <vector>

#include "fp4moe/error.hpp"
#include "fp4moe/safetensors.hpp"

namespace fp4moe {

namespace fs = std::filesystem;

inline constexpr DType kAllDTypes[] = {DType::BF16, DType::F16, DType::F32, DType::F8_E4M3,
                                       DType::U8,   DType::I32, DType::I64};

inline std::string read_file_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

inline void write_file_bytes(const std::string& path, const std::string& bytes) {
  // NOTE: a fresh file rather than a truncated one: ext4 flushes a file that
  // was truncated and rewritten when it is closed, which made the fuzz loops
  // wait on the disk for milliseconds per input.
  fs::remove(path);
  std::ofstream out(path, std::ios::binary);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  ASSERT_TRUE(out.good()) << "cannot write test input " << path;
}

inline std::string length_prefix(uint64_t header_bytes) {
  std::string prefix(8, '\0');
  for (int byte_idx = 0; byte_idx < 8; ++byte_idx) {
    prefix[byte_idx] = static_cast<char>(header_bytes >> (8 * byte_idx));
  }
  return prefix;
}

// A file image: length prefix, header text as given, data section.
inline std::string file_image(const std::string& header, const std::string& data) {
  return length_prefix(header.size()) + header + data;
}

inline std::vector<uint8_t> random_bytes(std::mt19937_64& rng, size_t nbytes) {
  std::vector<uint8_t> bytes(nbytes);
  for (uint8_t& byte : bytes) byte = static_cast<uint8_t>(rng());
  return bytes;
}

enum class OpenOutcome { kOpened, kRejected };

// Where open_untrusted() stores what it read, so the reads cannot be elided.
inline volatile unsigned g_checksum_sink = 0;

// Opens a possibly corrupt file. Rejection must be an fp4moe::Error; a file
// that opens must hold self-consistent, disjoint tensors whose every byte can
// be read (ASan and the MMU check the reads).
inline OpenOutcome open_untrusted(const std::string& path, const std::string& what) {
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
    EXPECT_NE(e.message().find(path), std::string::npos) << what << ": error does not name the file: " << e.message();
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

}  // namespace fp4moe
