// The tune cache: the tile config and split-K that `fp4moe tune` measured
// fastest per (GPU, driver, library version, GEMM shape, token bucket,
// epilogue), in one versioned JSON file (docs/design.md §4.6):
//
//   {"format": "fp4moe tune cache", "version": 1, "entries": [
//     {"gpu": "NVIDIA H200", "sms": 132, "driver": "570.86.15", "library": "0.1.0",
//      "n": 4096, "k": 6144, "experts": 256, "top_k": 8, "epilogue": "swiglu",
//      "batch_invariant": false, "bucket": 64,
//      "config": "sm90n128m16k128s7w12-swiglu", "split_k": 1,
//      "time_us": 41.2, "heuristic_config": "...", "heuristic_split_k": 1,
//      "heuristic_us": 43.0, "date": "2026-12-04"}, ...]}
//
// Reading never throws for what the file holds: a missing file is an empty
// cache; an unreadable or corrupt file, or one of another format version, is
// an empty cache with a one-line problem for the caller to report. The
// entries are kept as written (their config names are checked where they
// are used, src/tune/tune.hpp). Writing merges into what the file holds at
// that moment, under a lock, and replaces the file atomically (a temporary
// file renamed over it), so a reader sees the old or the new file, never a
// partial one.
//
// Internal (the CLI writes it, MoeLayer reads it). Tested in
// tests/tune/test_tune_cache.cpp.
#pragma once

#include <cstdint>
#include <nlohmann/json_fwd.hpp>
#include <string>
#include <string_view>
#include <vector>

#include "fp4moe/plan.hpp"

namespace fp4moe::tune {

inline constexpr std::string_view kCacheFormatName = "fp4moe tune cache";
inline constexpr int kCacheFormatVersion = 1;
// Overrides the cache's location; "off" disables tuned choices everywhere.
inline constexpr const char* kCacheEnvVar = "FP4MOE_TUNE_CACHE";

// fp4moe's version (the CMake project's), part of every cache key: another
// build of the kernels may rank the configs differently.
std::string library_version();

// What a tuned choice was measured on. Entries of another identity are never
// used.
struct DeviceIdentity {
  std::string gpu_name;         // the CUDA device name, e.g. "NVIDIA H200"
  int num_sms = 0;              // multiprocessors
  std::string driver_version;   // the NVIDIA kernel module's ("570.86.15"), else "CUDA <n>"
  std::string library_version;  // library_version() of the build that tuned

  bool operator==(const DeviceIdentity&) const = default;
  // "'NVIDIA H200', 132 SMs, driver 570.86.15, fp4moe 0.1.0"
  std::string describe() const;
};

// The current CUDA device's identity (looked up once per device). Throws
// fp4moe::Error where there is no CUDA device. Implemented in
// src/tune/tune_device.cpp (library fp4moe: it asks the CUDA runtime).
DeviceIdentity current_device_identity();

// One GEMM of a layer, as far as its tuned choices are concerned.
struct GemmKey {
  int64_t n = 0;
  int64_t k = 0;
  int64_t num_experts = 0;
  int top_k = 0;
  Epilogue epilogue = Epilogue::kNone;
  // Tuned for a batch-invariant layer: split-K 1 and one kernel family only.
  bool batch_invariant = false;

  bool operator==(const GemmKey&) const = default;
  // "n 4096, k 6144, 256 experts, top-8, swiglu" (+ ", batch invariant")
  std::string describe() const;
};
GemmKey gemm_key(const GemmProblem& problem, int top_k, bool batch_invariant);

struct CacheEntry {
  DeviceIdentity device;
  GemmKey gemm;
  int64_t bucket = 0;  // the token count the choice was timed at
  std::string config;  // TileConfig::to_string() of the choice, as written
  int split_k = 1;
  // What the tuner measured, for the record (not read when planning).
  double time_us = 0;
  std::string heuristic_config;
  int heuristic_split_k = 1;
  double heuristic_us = 0;
  std::string date;  // YYYY-MM-DD

  // Same device, GEMM and bucket: one replaces the other.
  bool same_key(const CacheEntry& other) const {
    return device == other.device && gemm == other.gemm && bucket == other.bucket;
  }
};

// The entry as the file stores it (fields: see the file comment).
nlohmann::json to_json(const CacheEntry& entry);

enum class CacheStatus {
  kOk,
  kMissing,       // no file: the heuristic, silently
  kUnreadable,    // exists but cannot be read (a directory, no permission)
  kCorrupt,       // not JSON, or not the cache's structure
  kOtherVersion,  // another format version
};

struct CacheFile {
  std::string path;
  CacheStatus status = CacheStatus::kMissing;
  std::string problem;              // one line naming the path and what is wrong; empty for kOk, kMissing
  std::vector<CacheEntry> entries;  // empty unless kOk
};

// Reads `path`; never throws for the file's content (see the file comment).
CacheFile read_cache(const std::string& path);

// How many entries of `cache` were tuned on another identity than `device`,
// as one line naming one of them (empty when there are none): such entries
// are ignored, never trusted.
std::string stale_entries_note(const CacheFile& cache, const DeviceIdentity& device);

struct MergeSummary {
  int64_t added = 0;          // new keys
  int64_t replaced = 0;       // keys the file held already
  int64_t dropped_stale = 0;  // entries of the writer's GPU (name and SMs) from another driver or library version
  int64_t kept = 0;           // other entries carried over unchanged
  std::string replaced_file_problem;  // the file was unreadable, corrupt or of another version: started afresh
};

// Merges `entries` into the cache at `path` (creating its directory) and
// replaces the file atomically. Runs under an exclusive lock on PATH.lock,
// so that concurrent writers do not drop each other's entries. Entries of
// `writer`'s GPU (same name and SM count) tuned under another driver or
// library version are dropped: they can no longer be used there. Throws
// fp4moe::Error when the file cannot be written.
MergeSummary write_cache(const std::string& path, const std::vector<CacheEntry>& entries, const DeviceIdentity& writer);

// Where the cache lives unless a caller names a file: $FP4MOE_TUNE_CACHE, else
// $XDG_CACHE_HOME/fp4moe/tune-cache.json (an absolute XDG_CACHE_HOME), else
// $HOME/.cache/fp4moe/tune-cache.json; "" when FP4MOE_TUNE_CACHE is "off" or
// none of them is set.
std::string default_cache_path();

// Prints "fp4moe: <line>" to stderr unless this process printed that line
// before: a problem with the cache is reported once, however many layers
// read it.
void report_once(const std::string& line);

}  // namespace fp4moe::tune
