// CPU tests of the autotuner's cache and rules (src/tune/tune_cache.hpp,
// src/tune/tune.hpp): the cache file's round trip; a missing, corrupt,
// unreadable or other-version file; entries of another GPU, SM count,
// driver or library version; invalid entries (config names, epilogues,
// families, budgets, splits); the atomic merged write (concurrent writers
// included); the default location; the bucket rule; the candidates (every
// one fits the budget and runs; split-K 1 only, in one family, for batch
// invariance; the heuristic's choice among them); batch-invariant layers'
// use of entries.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "fp4moe/error.hpp"
#include "fp4moe/plan.hpp"
#include "plan/planner.hpp"
#include "temp_dir.hpp"
#include "tune/tune.hpp"
#include "tune/tune_cache.hpp"

namespace fp4moe {
namespace {

namespace fs = std::filesystem;
using tune::CacheEntry;
using tune::CacheFile;
using tune::CacheStatus;
using tune::Candidate;
using tune::DeviceIdentity;
using tune::DeviceLimits;
using tune::TunedGemm;

const DeviceIdentity kH200{"NVIDIA H200", 132, "570.86.15", tune::library_version()};
const DeviceLimits kSm90Limits{232448, 90};

// GLM-5's GEMMs at `tokens` tokens.
GemmProblem glm5(int gemm, int64_t tokens = 1, bool batch_invariant = false) {
  return moe_gemm_problem(gemm, 256, 8, 6144, 2048, tokens, batch_invariant);
}

CacheEntry entry(const GemmProblem& problem, int64_t bucket, const std::string& config, int split_k,
                 const DeviceIdentity& device = kH200, bool batch_invariant = false) {
  CacheEntry e;
  e.device = device;
  e.gemm = tune::gemm_key(problem, 8, batch_invariant);
  e.bucket = bucket;
  e.config = config;
  e.split_k = split_k;
  e.time_us = 10.0 + static_cast<double>(bucket);
  e.heuristic_config = config;
  e.heuristic_split_k = split_k;
  e.heuristic_us = 11.0 + static_cast<double>(bucket);
  e.date = "2026-12-04";
  return e;
}

void write_text(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary);
  out << text;
  ASSERT_TRUE(out.good()) << path;
}

std::string read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// A valid one-entry cache file whose entry has `field` set to `value` (JSON
// text), or removed when `value` is empty.
std::string cache_with_field(const std::string& field, const std::string& value) {
  nlohmann::json e = nlohmann::json::parse(R"({"gpu": "NVIDIA H200", "sms": 132, "driver": "570.86.15",
      "library": "0.1.0", "n": 4096, "k": 6144, "experts": 256, "top_k": 8, "epilogue": "swiglu",
      "batch_invariant": false, "bucket": 64, "config": "n128m8k256s4w4-swiglu", "split_k": 1, "time_us": 12.5})");
  if (value.empty())
    e.erase(field);
  else
    e[field] = nlohmann::json::parse(value);
  const nlohmann::json file{{"format", "fp4moe tune cache"}, {"version", 1}, {"entries", nlohmann::json::array({e})}};
  return file.dump();
}

// Sets an environment variable for one scope, then restores it.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old;
    if (value)
      ::setenv(name, value, 1);
    else
      ::unsetenv(name);
  }
  ~ScopedEnv() {
    if (old_)
      ::setenv(name_, old_->c_str(), 1);
    else
      ::unsetenv(name_);
  }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  const char* name_;
  std::optional<std::string> old_;
};

// ------------------------------------------------------------------ the file

TEST(TuneCache, RoundTripKeepsEveryField) {
  const TempDir dir;
  const std::string path = dir / "sub/dir/tune-cache.json";  // directories are created
  const DeviceIdentity h100{"NVIDIA H100 80GB HBM3", 132, "560.35.03", tune::library_version()};
  const std::vector<CacheEntry> written = {entry(glm5(1), 1, "n128m8k256s4w4-swiglu", 2),
                                           entry(glm5(2), 64, "sm90n128m16k128s7w12-finalize", 1),
                                           entry(glm5(1), 4096, "sm90n128m128k128s4w12-swiglu", 1, h100, true)};
  const tune::MergeSummary summary = tune::write_cache(path, written, kH200);
  EXPECT_EQ(summary.added, 3);
  EXPECT_EQ(summary.replaced + summary.kept + summary.dropped_stale, 0);
  const CacheFile read = tune::read_cache(path);
  ASSERT_EQ(read.status, CacheStatus::kOk) << read.problem;
  EXPECT_TRUE(read.problem.empty());
  ASSERT_EQ(read.entries.size(), written.size());
  for (const CacheEntry& w : written) {
    const auto it =
        std::find_if(read.entries.begin(), read.entries.end(), [&](const CacheEntry& r) { return r.same_key(w); });
    ASSERT_NE(it, read.entries.end()) << w.gemm.describe() << " bucket " << w.bucket;
    EXPECT_EQ(it->config, w.config);
    EXPECT_EQ(it->split_k, w.split_k);
    EXPECT_EQ(it->gemm.batch_invariant, w.gemm.batch_invariant);
    EXPECT_EQ(it->gemm.epilogue, w.gemm.epilogue);
    EXPECT_DOUBLE_EQ(it->time_us, w.time_us);
    EXPECT_EQ(it->heuristic_config, w.heuristic_config);
    EXPECT_EQ(it->heuristic_split_k, w.heuristic_split_k);
    EXPECT_DOUBLE_EQ(it->heuristic_us, w.heuristic_us);
    EXPECT_EQ(it->date, w.date);
  }
  // Versioned: the file says what it is.
  const std::string text = read_text(path);
  EXPECT_NE(text.find("\"format\": \"fp4moe tune cache\""), std::string::npos) << text;
  EXPECT_NE(text.find("\"version\": 1"), std::string::npos) << text;
}

TEST(TuneCache, MissingFileIsEmptyAndSilent) {
  const TempDir dir;
  const CacheFile read = tune::read_cache(dir / "absent.json");
  EXPECT_EQ(read.status, CacheStatus::kMissing);
  EXPECT_TRUE(read.problem.empty());
  EXPECT_TRUE(read.entries.empty());
}

TEST(TuneCache, CorruptFilesAreReportedAndIgnored) {
  const TempDir dir;
  const std::string path = dir / "tune-cache.json";
  // Each case: file content, a phrase of the problem.
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"", "not valid JSON"},
      {"{\"format\": \"fp4moe tune cache\", \"version\": 1, \"entries\": [", "not valid JSON"},  // truncated
      {"\x89PNG\r\n\x1a\n binary", "not valid JSON"},
      {"[]", "\"format\""},
      {R"({"format": "something else", "version": 1, "entries": []})", "\"format\""},
      {R"({"format": "fp4moe tune cache", "entries": []})", "\"version\""},
      {R"({"format": "fp4moe tune cache", "version": "1", "entries": []})", "\"version\""},
      {R"({"format": "fp4moe tune cache", "version": 1})", "\"entries\""},
      {R"({"format": "fp4moe tune cache", "version": 1, "entries": {}})", "\"entries\""},
      {R"({"format": "fp4moe tune cache", "version": 1, "entries": [7]})", "entry 0: not an object"},
      {cache_with_field("n", ""), "'n'"},
      {cache_with_field("n", "\"4096\""), "'n'"},
      {cache_with_field("n", "-4096"), "'n'"},
      {cache_with_field("k", "6144.5"), "'k'"},
      {cache_with_field("sms", "4294967296"), "'sms'"},
      {cache_with_field("gpu", "17"), "'gpu'"},
      {cache_with_field("config", ""), "'config'"},
      {cache_with_field("split_k", "null"), "'split_k'"},
      {cache_with_field("epilogue", "\"gelu\""), "'epilogue'"},
      {cache_with_field("batch_invariant", ""), "'batch_invariant'"},
      {cache_with_field("batch_invariant", "1"), "'batch_invariant'"},
      {cache_with_field("time_us", "\"fast\""), "'time_us'"},
      {R"({"format": "fp4moe tune cache", "version": 1, "entries": [{"time_us": 1e400}]})", "not valid JSON"},
      {cache_with_field("date", "20261204"), "'date'"},
      // File strings reach one-line messages: a control character in one is damage (found by fuzz_tune_cache).
      {cache_with_field("epilogue", R"("f\nalize")"), "'epilogue' holds a control character"},
      {cache_with_field("gpu", R"("NVIDIA\rH200")"), "'gpu' holds a control character"},
      {cache_with_field("date", R"("2026-12-04\u007f")"), "'date' holds a control character"},
  };
  // The fixture itself is valid.
  write_text(path, cache_with_field("time_us", "12.5"));
  ASSERT_EQ(tune::read_cache(path).status, CacheStatus::kOk) << tune::read_cache(path).problem;
  for (const auto& [text, phrase] : cases) {
    SCOPED_TRACE(text);
    write_text(path, text);
    const CacheFile read = tune::read_cache(path);
    EXPECT_EQ(read.status, CacheStatus::kCorrupt);
    EXPECT_TRUE(read.entries.empty());
    EXPECT_NE(read.problem.find(path), std::string::npos) << read.problem;
    EXPECT_NE(read.problem.find("corrupt"), std::string::npos) << read.problem;
    EXPECT_NE(read.problem.find(phrase), std::string::npos) << read.problem;
    EXPECT_EQ(read.problem.find('\n'), std::string::npos) << "one line: " << read.problem;
  }
}

TEST(TuneCache, OtherFormatVersionIsReportedAndIgnored) {
  const TempDir dir;
  const std::string path = dir / "tune-cache.json";
  nlohmann::json text = nlohmann::json::parse(cache_with_field("time_us", "1"));
  text["version"] = 2;
  write_text(path, text.dump());
  const CacheFile read = tune::read_cache(path);
  EXPECT_EQ(read.status, CacheStatus::kOtherVersion);
  EXPECT_TRUE(read.entries.empty());
  EXPECT_NE(read.problem.find("format version 2"), std::string::npos) << read.problem;
  EXPECT_NE(read.problem.find("reads version 1"), std::string::npos) << read.problem;
}

TEST(TuneCache, UnreadableFileIsReportedAndIgnored) {
  const TempDir dir;
  fs::create_directories(dir / "a-directory");
  const CacheFile directory = tune::read_cache(dir / "a-directory");
  EXPECT_EQ(directory.status, CacheStatus::kUnreadable);
  EXPECT_NE(directory.problem.find("is a directory"), std::string::npos) << directory.problem;
  if (::geteuid() == 0) {
    std::printf("  (running as root: a file without read permission is still readable; that case is skipped)\n");
    return;
  }
  const std::string path = dir / "no-permission.json";
  write_text(path, cache_with_field("time_us", "1"));
  fs::permissions(path, fs::perms::none);
  const CacheFile read = tune::read_cache(path);
  EXPECT_EQ(read.status, CacheStatus::kUnreadable);
  EXPECT_NE(read.problem.find("cannot be read"), std::string::npos) << read.problem;
}

TEST(TuneCache, EntriesOfAnotherGpuDriverOrLibraryAreNeverUsed) {
  const TempDir dir;
  const std::string path = dir / "tune-cache.json";
  DeviceIdentity other_library = kH200, other_name = kH200, other_sms = kH200, other_driver = kH200;
  other_library.library_version = "0.0.1";
  other_name.gpu_name = "NVIDIA H100 80GB HBM3";
  other_sms.num_sms = 114;
  other_driver.driver_version = "560.35.03";
  // Written by another machine: the writer's identity drops nothing of these.
  const DeviceIdentity writer{"NVIDIA B200", 148, "575.1", tune::library_version()};
  std::vector<CacheEntry> entries;
  for (const DeviceIdentity& d : {other_library, other_name, other_sms, other_driver})
    entries.push_back(entry(glm5(1), 16, "n128m32k128s4w4-swiglu", 1, d));
  entries.push_back(entry(glm5(1), 64, "n128m64k128s3w4-swiglu", 1, kH200));
  tune::write_cache(path, entries, writer);
  const CacheFile cache = tune::read_cache(path);
  ASSERT_EQ(cache.status, CacheStatus::kOk) << cache.problem;
  ASSERT_EQ(cache.entries.size(), 5u);
  const std::string note = tune::stale_entries_note(cache, kH200);
  EXPECT_NE(note.find("4 of 5 entries"), std::string::npos) << note;
  EXPECT_NE(note.find(kH200.describe()), std::string::npos) << note;
  EXPECT_EQ(note.find('\n'), std::string::npos) << note;
  std::vector<std::string> warnings;
  const TunedGemm tuned(cache, kH200, glm5(1), 8, kSm90Limits, false, &warnings);
  EXPECT_TRUE(warnings.empty());
  ASSERT_EQ(tuned.choices().size(), 1u) << "only this device's entry";
  EXPECT_EQ(tuned.choices()[0].bucket, 64);
  // Each stale identity alone sees its own entry and nothing else.
  for (const DeviceIdentity& d : {other_library, other_name, other_sms, other_driver}) {
    const TunedGemm theirs(cache, d, glm5(1), 8, kSm90Limits, false, nullptr);
    ASSERT_EQ(theirs.choices().size(), 1u) << d.describe();
    EXPECT_EQ(theirs.choices()[0].bucket, 16);
  }
  EXPECT_TRUE(tune::stale_entries_note(tune::CacheFile{}, kH200).empty());
}

TEST(TuneCache, InvalidEntriesAreRefusedWithAWarning) {
  // Each case: config name, split, a phrase of the warning.
  const std::vector<std::tuple<std::string, int, std::string>> invalid = {
      {"bogus", 1, "malformed tile config 'bogus'"},
      {"n128m8k256s4w4-gelu", 1, "unknown epilogue"},
      {"n128m8k256s4w4", 1, "has the none epilogue; this GEMM's is swiglu"},
      {"n128m8k256s4w4-finalize", 1, "has the finalize epilogue"},
      {"n128m16k256s4w4-swiglu", 1, "is not compiled into this build"},
      {"n128m8k256s4w4-swiglu", 0, "split_k 0"},
      {"n128m8k256s4w4-swiglu", 9, "split_k 9"},
      {"n128m8k256s4w4-swiglu", -1, "split_k -1"},
  };
  const GemmProblem problem = glm5(1);
  std::vector<CacheEntry> entries;
  int64_t bucket = 1;
  for (const auto& [config, split, phrase] : invalid) entries.push_back(entry(problem, bucket++, config, split));
  entries.push_back(entry(problem, bucket, "n128m8k256s4w4-swiglu", 2));  // valid
  CacheFile cache;
  cache.path = "/some/tune-cache.json";
  cache.status = CacheStatus::kOk;
  cache.entries = entries;
  std::vector<std::string> warnings;
  const TunedGemm tuned(cache, kH200, problem, 8, kSm90Limits, false, &warnings);
  ASSERT_EQ(warnings.size(), invalid.size());
  for (size_t i = 0; i < invalid.size(); ++i) {
    const auto& [config, split, phrase] = invalid[i];
    SCOPED_TRACE(config + " split " + std::to_string(split));
    EXPECT_NE(warnings[i].find(phrase), std::string::npos) << warnings[i];
    EXPECT_NE(warnings[i].find("bucket " + std::to_string(i + 1)), std::string::npos) << warnings[i];
    EXPECT_NE(warnings[i].find(cache.path), std::string::npos) << warnings[i];
    EXPECT_NE(warnings[i].find("the heuristic plans"), std::string::npos) << warnings[i];
    const tune::TunedChoice* found = tuned.find(static_cast<int64_t>(i + 1));
    ASSERT_NE(found, nullptr);
    EXPECT_EQ(found->bucket, static_cast<int64_t>(i + 1));
    EXPECT_FALSE(found->rejected.empty());
  }
  const tune::TunedChoice* valid = tuned.find(bucket);
  ASSERT_NE(valid, nullptr);
  EXPECT_TRUE(valid->rejected.empty()) << valid->rejected;
  EXPECT_EQ(valid->choice.config.to_string(), "n128m8k256s4w4-swiglu");
  EXPECT_EQ(valid->choice.split_k, 2);

  // Device checks: a family that does not run there, a config that does not fit.
  const std::string sm90 = "sm90n128m64k128s6w12-swiglu";
  EXPECT_NE(tune::check_choice(sm90, 1, problem, {101376, 120}).find("does not run on compute capability 12.0"),
            std::string::npos);
  const std::string no_fit = tune::check_choice(sm90, 1, problem, {101376, 90});
  EXPECT_NE(no_fit.find("B of shared memory per block; this GPU allows 101376 B"), std::string::npos) << no_fit;
  EXPECT_EQ(tune::check_choice(sm90, 1, problem, kSm90Limits), "");
}

TEST(TuneCache, AtomicMergeKeepsOtherEntriesAndDropsStaleOnes) {
  const TempDir dir;
  const std::string path = dir / "tune-cache.json";
  DeviceIdentity old_driver = kH200;
  old_driver.driver_version = "550.54.15";
  const DeviceIdentity h100{"NVIDIA H100 80GB HBM3", 132, "570.86.15", tune::library_version()};
  tune::write_cache(
      path,
      {entry(glm5(1), 1, "n128m8k256s4w4-swiglu", 2), entry(glm5(1), 64, "n128m8k256s4w4-swiglu", 1),
       entry(glm5(1), 8, "n128m8k256s4w4-swiglu", 1, old_driver), entry(glm5(1), 8, "n128m8k256s4w4-swiglu", 1, h100)},
      old_driver);  // the old driver wrote all of them
  const tune::MergeSummary summary = tune::write_cache(
      path,
      {entry(glm5(1), 64, "sm90n128m16k128s7w12-swiglu", 1), entry(glm5(2), 64, "sm90n128m16k128s7w12-finalize", 1)},
      kH200);
  EXPECT_EQ(summary.added, 1);
  EXPECT_EQ(summary.replaced, 1);
  EXPECT_EQ(summary.kept, 2);           // bucket 1 of this device and the H100's entry
  EXPECT_EQ(summary.dropped_stale, 1);  // this GPU's entry from the old driver
  EXPECT_TRUE(summary.replaced_file_problem.empty());
  const CacheFile cache = tune::read_cache(path);
  ASSERT_EQ(cache.status, CacheStatus::kOk) << cache.problem;
  EXPECT_EQ(cache.entries.size(), 4u);
  for (const CacheEntry& e : cache.entries) {
    EXPECT_FALSE(e.device == old_driver) << "stale entry kept";
    if (e.device == kH200 && e.bucket == 64 && e.gemm.epilogue == Epilogue::kSwiglu)
      EXPECT_EQ(e.config, "sm90n128m16k128s7w12-swiglu") << "the new entry replaces the old";
  }
  // Only the cache and its lock remain: no temporary file.
  std::vector<std::string> names;
  for (const auto& f : fs::directory_iterator(dir.path())) names.push_back(f.path().filename().string());
  std::sort(names.begin(), names.end());
  EXPECT_EQ(names, (std::vector<std::string>{"tune-cache.json", "tune-cache.json.lock"}));
  // Within one write the last entry of a key wins.
  tune::write_cache(
      path, {entry(glm5(2), 2, "n128m8k256s4w4-finalize", 1), entry(glm5(2), 2, "n128m32k128s4w4-finalize", 3)}, kH200);
  const CacheFile again = tune::read_cache(path);
  const auto twice =
      std::count_if(again.entries.begin(), again.entries.end(), [](const CacheEntry& e) { return e.bucket == 2; });
  EXPECT_EQ(twice, 1);
  for (const CacheEntry& e : again.entries)
    if (e.bucket == 2) EXPECT_EQ(e.config, "n128m32k128s4w4-finalize");
}

TEST(TuneCache, WriteReplacesACorruptOrOtherVersionFile) {
  const TempDir dir;
  const std::string path = dir / "tune-cache.json";
  for (const std::string bad : {"{ not json", R"({"format": "fp4moe tune cache", "version": 9})"}) {
    write_text(path, bad);
    const tune::MergeSummary summary = tune::write_cache(path, {entry(glm5(1), 1, "n128m8k256s4w4-swiglu", 1)}, kH200);
    EXPECT_NE(summary.replaced_file_problem.find(path), std::string::npos) << summary.replaced_file_problem;
    const CacheFile read = tune::read_cache(path);
    EXPECT_EQ(read.status, CacheStatus::kOk) << read.problem;
    EXPECT_EQ(read.entries.size(), 1u);
  }
}

TEST(TuneCache, WriteRefusesPathsItCannotWrite) {
  const TempDir dir;
  fs::create_directories(dir / "a-directory");
  const std::vector<CacheEntry> one = {entry(glm5(1), 1, "n128m8k256s4w4-swiglu", 1)};
  EXPECT_THROW(tune::write_cache(dir / "a-directory", one, kH200), Error);
  write_text(dir / "a-file", "x");
  EXPECT_THROW(tune::write_cache(dir / "a-file/tune-cache.json", one, kH200), Error);
  EXPECT_THROW(tune::write_cache("", one, kH200), Error);
}

TEST(TuneCache, ConcurrentWritersKeepEveryEntry) {
  const TempDir dir;
  const std::string path = dir / "tune-cache.json";
  constexpr int kWriters = 6, kEntriesEach = 5;
  std::vector<std::thread> threads;
  for (int w = 0; w < kWriters; ++w)
    threads.emplace_back([&, w] {
      for (int i = 0; i < kEntriesEach; ++i)
        tune::write_cache(path, {entry(glm5(1 + i % 2), 1000 * (w + 1) + i, "n128m8k256s4w4-swiglu", 1)}, kH200);
    });
  for (std::thread& t : threads) t.join();
  const CacheFile cache = tune::read_cache(path);
  ASSERT_EQ(cache.status, CacheStatus::kOk) << cache.problem;
  EXPECT_EQ(cache.entries.size(), static_cast<size_t>(kWriters * kEntriesEach));
}

TEST(TuneCache, DefaultPathFollowsTheEnvironment) {
  {
    const ScopedEnv env("FP4MOE_TUNE_CACHE", "/tmp/mine.json");
    EXPECT_EQ(tune::default_cache_path(), "/tmp/mine.json");
  }
  {
    const ScopedEnv env("FP4MOE_TUNE_CACHE", "off");
    EXPECT_EQ(tune::default_cache_path(), "");
  }
  const ScopedEnv no_override("FP4MOE_TUNE_CACHE", nullptr);
  {
    const ScopedEnv xdg("XDG_CACHE_HOME", "/var/cache/me");
    EXPECT_EQ(tune::default_cache_path(), "/var/cache/me/fp4moe/tune-cache.json");
  }
  const ScopedEnv home("HOME", "/home/me");
  {
    const ScopedEnv relative_xdg("XDG_CACHE_HOME", "relative/cache");  // not absolute: ignored
    EXPECT_EQ(tune::default_cache_path(), "/home/me/.cache/fp4moe/tune-cache.json");
  }
  const ScopedEnv no_xdg("XDG_CACHE_HOME", nullptr);
  EXPECT_EQ(tune::default_cache_path(), "/home/me/.cache/fp4moe/tune-cache.json");
  const ScopedEnv no_home("HOME", nullptr);
  EXPECT_EQ(tune::default_cache_path(), "");
}

TEST(TuneCache, ReportsEachLineOnce) {
  ::testing::internal::CaptureStderr();
  tune::report_once("tune cache /x: a test line");
  tune::report_once("tune cache /x: a test line");
  tune::report_once("tune cache /x: another test line");
  const std::string err = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(err, "fp4moe: tune cache /x: a test line\nfp4moe: tune cache /x: another test line\n");
}

// ------------------------------------------------------------------ buckets

TEST(TuneBuckets, SmallestTunedBucketAtLeastTElseTheLargest) {
  EXPECT_EQ(tune::bucket_for(5, {}), 0);
  EXPECT_EQ(tune::bucket_for(1, {64}), 64);
  EXPECT_EQ(tune::bucket_for(1000, {64}), 64);
  const std::vector<int64_t>& buckets = tune::default_buckets();
  ASSERT_TRUE(std::is_sorted(buckets.begin(), buckets.end()));
  EXPECT_EQ(std::adjacent_find(buckets.begin(), buckets.end()), buckets.end());
  EXPECT_EQ(buckets.front(), 1);
  EXPECT_EQ(buckets.back(), 16384);
  for (int64_t b = 1; b <= 256; b *= 2) EXPECT_TRUE(std::binary_search(buckets.begin(), buckets.end(), b)) << b;
  EXPECT_EQ(tune::bucket_for(1, buckets), 1);
  EXPECT_EQ(tune::bucket_for(3, buckets), 4);
  EXPECT_EQ(tune::bucket_for(256, buckets), 256);
  EXPECT_EQ(tune::bucket_for(257, buckets), 384);
  EXPECT_EQ(tune::bucket_for(5000, buckets), 6144);
  EXPECT_EQ(tune::bucket_for(100000, buckets), 16384);
}

TEST(TuneBuckets, TunedGemmFindsTheEntryOfTheBucket) {
  CacheFile cache;
  cache.status = CacheStatus::kOk;
  cache.entries = {entry(glm5(1), 64, "n128m32k128s4w4-swiglu", 1), entry(glm5(1), 4, "n128m8k256s4w4-swiglu", 2),
                   entry(glm5(1), 1024, "sm90n128m64k128s6w12-swiglu", 1),
                   entry(glm5(1), 64, "n128m64k128s3w4-swiglu", 1)};  // the later entry of bucket 64 wins
  const TunedGemm tuned(cache, kH200, glm5(1), 8, kSm90Limits, false, nullptr);
  ASSERT_EQ(tuned.choices().size(), 3u);
  const std::vector<std::pair<int64_t, int64_t>> expected = {{1, 4},   {4, 4},     {5, 64},
                                                             {64, 64}, {65, 1024}, {9000, 1024}};
  for (const auto& [tokens, bucket] : expected) {
    const tune::TunedChoice* found = tuned.find(tokens);
    ASSERT_NE(found, nullptr) << tokens;
    EXPECT_EQ(found->bucket, bucket) << tokens << " tokens";
  }
  EXPECT_EQ(tuned.find(64)->choice.config.to_string(), "n128m64k128s3w4-swiglu");
  EXPECT_EQ(TunedGemm().find(1), nullptr);
  // Another GEMM (epilogue, shape) has no entries.
  EXPECT_TRUE(TunedGemm(cache, kH200, glm5(2), 8, kSm90Limits, false, nullptr).choices().empty());
  EXPECT_TRUE(TunedGemm(cache, kH200, glm5(1), 4, kSm90Limits, false, nullptr).choices().empty()) << "top-4";
}

// --------------------------------------------------------------- candidates

TEST(TuneCandidates, EveryCandidateFitsRunsAndHasTheEpilogue) {
  const std::vector<DeviceLimits> devices = {{232448, 90}, {101376, 90}, {80000, 90}, {101376, 120},
                                             {166912, 80}, {101376, 86}, {60000, 90}};
  const std::vector<std::tuple<int64_t, int, int64_t, int64_t>> shapes = {
      {256, 8, 7168, 2048}, {128, 8, 2048, 768}, {8, 2, 4096, 14336}, {128, 4, 2880, 2880}};
  int checked = 0;
  for (const DeviceLimits& device : devices)
    for (const auto& [experts, top_k, hidden, inter] : shapes)
      for (int gemm : {1, 2})
        for (int64_t tokens : {int64_t{1}, int64_t{16}, int64_t{256}, int64_t{4096}})
          for (bool invariant : {false, true}) {
            const GemmProblem p = moe_gemm_problem(gemm, experts, top_k, hidden, inter, tokens, invariant);
            SCOPED_TRACE("budget " + std::to_string(device.smem_budget_bytes) + " cc " +
                         std::to_string(device.compute_capability) + " gemm " + std::to_string(gemm) + " T " +
                         std::to_string(tokens) + (invariant ? " invariant" : ""));
            const std::vector<Candidate> candidates = tune::candidates(p, device, invariant);
            const KernelFamily only = tune::invariant_family(p.epilogue, device);
            for (const Candidate& c : candidates) {
              ++checked;
              EXPECT_TRUE(check_fit(c.config, device.smem_budget_bytes).fits) << c.to_string();
              EXPECT_TRUE(is_compiled(c.config)) << c.to_string();
              EXPECT_TRUE(family_runs_on(c.config.family, device.compute_capability)) << c.to_string();
              EXPECT_EQ(c.config.epilogue, p.epilogue) << c.to_string();
              EXPECT_TRUE(split_k_allowed(p, c.config, c.split_k)) << c.to_string();
              EXPECT_EQ(tune::check_choice(c.config.to_string(), c.split_k, p, device), "") << c.to_string();
              if (c.split_k > 1) EXPECT_LE(max_tiles(p, c.config), kMaxSplitKTiles) << c.to_string();
              if (invariant) {
                EXPECT_EQ(c.split_k, 1) << c.to_string();
                EXPECT_EQ(c.config.family, only) << c.to_string();
                EXPECT_EQ(tune::check_batch_invariant(c, p.epilogue, device), "") << c.to_string();
              }
            }
            // Complete: every config that fits and runs, with split-K 1.
            for (const TileConfig& c : compiled_configs()) {
              const bool eligible = c.epilogue == p.epilogue && family_runs_on(c.family, device.compute_capability) &&
                                    check_fit(c, device.smem_budget_bytes).fits && (!invariant || c.family == only);
              const bool listed = std::find(candidates.begin(), candidates.end(), Candidate{c, 1}) != candidates.end();
              EXPECT_EQ(listed, eligible) << c.to_string();
            }
            // The heuristic's choice, as the layer runs it, is a candidate.
            bool any_fits = false;
            for (const TileConfig& c : compiled_configs())
              any_fits = any_fits || (c.epilogue == p.epilogue && check_fit(c, device.smem_budget_bytes).fits);
            if (!any_fits) {
              EXPECT_TRUE(candidates.empty());
              continue;
            }
            const GemmPlan heuristic =
                limit_split_k(plan_gemm(p, device.smem_budget_bytes, 132, device.compute_capability), invariant);
            EXPECT_NE(std::find(candidates.begin(), candidates.end(), Candidate{heuristic.config, heuristic.split_k}),
                      candidates.end())
                << "heuristic " << heuristic.config.to_string() << " split_k " << heuristic.split_k;
          }
  EXPECT_GT(checked, 1000);
  // Splits are there where the planner could pick them: few tiles, long K.
  const std::vector<Candidate> decode = tune::candidates(glm5(2, 1), kSm90Limits, false);
  EXPECT_TRUE(std::any_of(decode.begin(), decode.end(), [](const Candidate& c) { return c.split_k == kMaxSplitK; }));
  EXPECT_TRUE(std::any_of(decode.begin(), decode.end(),
                          [](const Candidate& c) { return c.config.family == KernelFamily::kPortable; }));
  EXPECT_TRUE(std::any_of(decode.begin(), decode.end(),
                          [](const Candidate& c) { return c.config.family == KernelFamily::kSm90; }));
  // A budget that nothing fits leaves no candidates.
  EXPECT_TRUE(tune::candidates(glm5(1), {20000, 90}, false).empty());
}

TEST(TuneCandidates, BatchInvariantLayersUseOnlyInvariantChoices) {
  const Candidate portable_split{TileConfig::parse("n128m8k256s4w4-swiglu"), 2};
  const Candidate portable{TileConfig::parse("n128m8k256s4w4-swiglu"), 1};
  const Candidate sm90{TileConfig::parse("sm90n128m16k128s7w12-swiglu"), 1};
  EXPECT_NE(tune::check_batch_invariant(portable_split, Epilogue::kSwiglu, kSm90Limits).find("split_k 2"),
            std::string::npos);
  EXPECT_NE(tune::check_batch_invariant(portable, Epilogue::kSwiglu, kSm90Limits).find("sm90 family"),
            std::string::npos);
  EXPECT_EQ(tune::check_batch_invariant(sm90, Epilogue::kSwiglu, kSm90Limits), "");
  EXPECT_EQ(tune::check_batch_invariant(portable, Epilogue::kSwiglu, {101376, 120}), "") << "portable-only GPU";

  // Plain entries: a batch-invariant layer takes the invariant ones only, silently.
  CacheFile cache;
  cache.path = "/c.json";
  cache.status = CacheStatus::kOk;
  cache.entries = {entry(glm5(1), 1, "n128m8k256s4w4-swiglu", 2), entry(glm5(1), 64, "sm90n128m16k128s7w12-swiglu", 1)};
  std::vector<std::string> warnings;
  const TunedGemm plain(cache, kH200, glm5(1), 8, kSm90Limits, true, &warnings);
  EXPECT_TRUE(warnings.empty()) << "not faulty, just not for this layer";
  ASSERT_NE(plain.find(1), nullptr);
  EXPECT_NE(plain.find(1)->rejected.find("split_k 2"), std::string::npos);
  EXPECT_TRUE(plain.find(64)->rejected.empty());
  // The same layer without batch invariance takes both.
  EXPECT_TRUE(TunedGemm(cache, kH200, glm5(1), 8, kSm90Limits, false, nullptr).find(1)->rejected.empty());
  // Entries tuned for batch invariance win over the plain ones, for invariant layers only.
  cache.entries.push_back(entry(glm5(1), 16, "sm90n128m8k128s9w12-swiglu", 1, kH200, /*batch_invariant=*/true));
  const TunedGemm invariant(cache, kH200, glm5(1), 8, kSm90Limits, true, nullptr);
  ASSERT_EQ(invariant.choices().size(), 1u);
  EXPECT_EQ(invariant.find(1)->bucket, 16);
  EXPECT_EQ(TunedGemm(cache, kH200, glm5(1), 8, kSm90Limits, false, nullptr).choices().size(), 2u);
}

}  // namespace
}  // namespace fp4moe
