// TempDir: a fresh directory under the system temp dir for one test, removed
// with everything in it when the object goes. Shared by the tests that write
// files (tests/format/, tests/tune/). In namespace fp4moe,
// where the tests live (a fp4moe::testing here would hide gtest's ::testing
// from tests that name it unqualified).
#pragma once

#include <unistd.h>

#include <filesystem>
#include <random>
#include <string>
#include <system_error>

namespace fp4moe {

class TempDir {
 public:
  explicit TempDir(const std::string& prefix = "fp4moe_test") {
    std::random_device rd;
    path_ = std::filesystem::temp_directory_path() /
            (prefix + "_" + std::to_string(::getpid()) + "_" + std::to_string(rd()));
    std::filesystem::create_directories(path_);
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  std::string operator/(const std::string& name) const { return (path_ / name).string(); }
  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
};

}  // namespace fp4moe
