// Helpers shared by the libFuzzer targets of fuzz/: a scratch directory
// (on tmpfs where there is one) for the files a target hands to the library,
// splitting one fuzz input into several files, and a check that aborts with
// a message so that the fuzzer records the input as a crash.
#pragma once

#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <fstream>
#include <string>
#include <string_view>
#include <system_error>
#include <vector>

namespace fp4moe::fuzz {

// Aborts (a crash to libFuzzer) when a property the library promises fails.
#define FP4MOE_FUZZ_ASSERT(cond, what)                                                         \
  do {                                                                                         \
    if (!(cond)) {                                                                             \
      std::fprintf(stderr, "fuzz property violated at %s:%d: %s\n", __FILE__, __LINE__, what); \
      std::abort();                                                                            \
    }                                                                                          \
  } while (0)

// With FP4MOE_FUZZ_VERBOSE=1 set, targets print why the library refused an
// input: to check that seeds get deep, or to read a regression input.
inline void note_refusal(const std::exception& e) {
  static const bool verbose = std::getenv("FP4MOE_FUZZ_VERBOSE") != nullptr;
  if (verbose) std::fprintf(stderr, "refused: %s\n", e.what());
}

// A directory private to this process, created on first use and removed at
// exit. /dev/shm keeps the many small writes off the disk.
inline const std::filesystem::path& scratch_dir() {
  static const std::filesystem::path dir = [] {
    namespace fs = std::filesystem;
    const fs::path base = fs::is_directory("/dev/shm") ? fs::path("/dev/shm") : fs::temp_directory_path();
    const fs::path made = base / ("fp4moe-fuzz-" + std::to_string(::getpid()));
    fs::create_directories(made);
    std::atexit([] {
      std::error_code ec;
      fs::remove_all(scratch_dir(), ec);
    });
    return made;
  }();
  return dir;
}

// Removes everything in the scratch directory, so that one input's files
// never leak into the next.
inline void clear_scratch_dir() {
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(scratch_dir(), ec))
    std::filesystem::remove_all(entry.path(), ec);
}

inline void write_file(const std::filesystem::path& path, std::string_view bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  FP4MOE_FUZZ_ASSERT(out.good(), "cannot write a scratch file");
}

// Splits `input` at each `separator`, into at most max_parts parts (the
// last part keeps any further separators). Missing parts are empty.
inline std::vector<std::string_view> split(std::string_view input, std::string_view separator, size_t max_parts) {
  std::vector<std::string_view> parts;
  while (parts.size() + 1 < max_parts) {
    const size_t at = input.find(separator);
    if (at == std::string_view::npos) break;
    parts.push_back(input.substr(0, at));
    input.remove_prefix(at + separator.size());
  }
  parts.push_back(input);
  parts.resize(max_parts);
  return parts;
}

// libFuzzer's entry for a target whose run() may throw only fp4moe::Error
// (handled inside run): anything else is a finding.
template <class Run>
int run_guarded(Run run, const uint8_t* data, size_t size) {
  try {
    run(data, size);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "unexpected exception (not fp4moe::Error): %s\n", e.what());
    std::abort();
  }
  return 0;
}

}  // namespace fp4moe::fuzz
