// The tune cache file (src/tune/tune_cache.hpp): reading it without ever
// trusting a damaged one, the atomic merged write, its default location.
// Host-only; tested in tests/tune/test_tune_cache.cpp.
#include "tune/tune_cache.hpp"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <mutex>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <tuple>
#include <type_traits>

#include "fp4moe/error.hpp"

#ifndef FP4MOE_LIBRARY_VERSION
#error "FP4MOE_LIBRARY_VERSION must be defined by the build (src/CMakeLists.txt)"
#endif

namespace fp4moe::tune {

namespace fs = std::filesystem;
using nlohmann::json;

std::string library_version() { return FP4MOE_LIBRARY_VERSION; }

std::string DeviceIdentity::describe() const {
  return "'" + gpu_name + "', " + std::to_string(num_sms) + " SMs, driver " + driver_version + ", fp4moe " +
         library_version;
}

std::string GemmKey::describe() const {
  std::ostringstream os;
  os << "n " << n << ", k " << k << ", " << num_experts << " experts, top-" << top_k << ", " << to_string(epilogue)
     << (batch_invariant ? ", batch invariant" : "");
  return os.str();
}

GemmKey gemm_key(const GemmProblem& problem, int top_k, bool batch_invariant) {
  return {problem.n, problem.k, problem.num_experts, top_k, problem.epilogue, batch_invariant};
}

namespace {

// ------------------------------------------------------------------ reading

// The first structural fault of one entry, or "" (fields: see tune_cache.hpp).
std::string parse_entry(const json& j, CacheEntry* e) {
  if (!j.is_object()) return "not an object";
  // Strings from the file reach one-line messages (an unknown epilogue, a
  // config that is not compiled, another GPU's name): a control character in
  // one is damage, not text to print.
  const auto has_control = [](const std::string& text) {
    return std::any_of(text.begin(), text.end(),
                       [](char c) { return static_cast<unsigned char>(c) < 0x20 || c == 0x7f; });
  };
  const auto string_field = [&](const char* name, std::string* out) -> std::string {
    const auto it = j.find(name);
    if (it == j.end() || !it->is_string()) return std::string("'") + name + "' is missing or not a string";
    if (has_control(it->get<std::string>())) return std::string("'") + name + "' holds a control character";
    *out = it->get<std::string>();
    return {};
  };
  // Integers in [minimum, the field's largest]; an absent optional field
  // leaves *out as it is.
  const auto int_field = [&](const char* name, int64_t minimum, bool required, auto* out) -> std::string {
    using Int = std::remove_pointer_t<decltype(out)>;
    const auto it = j.find(name);
    if (it == j.end() && !required) return {};
    if (it == j.end() || !it->is_number_integer() || it->get<int64_t>() < minimum ||
        it->get<int64_t>() > std::numeric_limits<Int>::max())
      return std::string("'") + name + "' is missing or not an integer in [" + std::to_string(minimum) + ", " +
             std::to_string(std::numeric_limits<Int>::max()) + "]";
    *out = static_cast<Int>(it->get<int64_t>());
    return {};
  };
  // (The parser refuses numbers that overflow a double: they are finite.)
  const auto number_field = [&](const char* name, double* out) -> std::string {
    const auto it = j.find(name);
    if (it == j.end()) return {};
    if (!it->is_number()) return std::string("'") + name + "' is not a number";
    *out = it->get<double>();
    return {};
  };
  std::string epilogue;
  std::string why;
  for (const std::string& fault :
       {string_field("gpu", &e->device.gpu_name), int_field("sms", 1, true, &e->device.num_sms),
        string_field("driver", &e->device.driver_version), string_field("library", &e->device.library_version),
        int_field("n", 1, true, &e->gemm.n), int_field("k", 1, true, &e->gemm.k),
        int_field("experts", 1, true, &e->gemm.num_experts), int_field("top_k", 1, true, &e->gemm.top_k),
        string_field("epilogue", &epilogue), int_field("bucket", 1, true, &e->bucket),
        string_field("config", &e->config), int_field("split_k", INT32_MIN, true, &e->split_k),
        number_field("time_us", &e->time_us), int_field("heuristic_split_k", INT32_MIN, false, &e->heuristic_split_k),
        number_field("heuristic_us", &e->heuristic_us)})
    if (!fault.empty()) return fault;
  const auto bi = j.find("batch_invariant");
  if (bi == j.end() || !bi->is_boolean()) return "'batch_invariant' is missing or not true/false";
  e->gemm.batch_invariant = bi->get<bool>();
  bool known = false;
  for (Epilogue candidate : {Epilogue::kNone, Epilogue::kSwiglu, Epilogue::kFinalize})
    if (epilogue == to_string(candidate)) {
      e->gemm.epilogue = candidate;
      known = true;
    }
  if (!known) return "'epilogue' is '" + epilogue + "'; expected none, swiglu or finalize";
  // Informational strings: absent is fine, another type is damage.
  for (const auto& [name, out] : {std::pair{"heuristic_config", &e->heuristic_config}, std::pair{"date", &e->date}}) {
    const auto it = j.find(name);
    if (it == j.end()) continue;
    if (!it->is_string()) return std::string("'") + name + "' is not a string";
    if (has_control(it->get<std::string>())) return std::string("'") + name + "' holds a control character";
    *out = it->get<std::string>();
  }
  return {};
}

}  // namespace

json to_json(const CacheEntry& e) {
  return json{{"gpu", e.device.gpu_name},
              {"sms", e.device.num_sms},
              {"driver", e.device.driver_version},
              {"library", e.device.library_version},
              {"n", e.gemm.n},
              {"k", e.gemm.k},
              {"experts", e.gemm.num_experts},
              {"top_k", e.gemm.top_k},
              {"epilogue", to_string(e.gemm.epilogue)},
              {"batch_invariant", e.gemm.batch_invariant},
              {"bucket", e.bucket},
              {"config", e.config},
              {"split_k", e.split_k},
              {"time_us", e.time_us},
              {"heuristic_config", e.heuristic_config},
              {"heuristic_split_k", e.heuristic_split_k},
              {"heuristic_us", e.heuristic_us},
              {"date", e.date}};
}

namespace {

// A stable order for the file: by device, then GEMM, then bucket.
bool entry_less(const CacheEntry& a, const CacheEntry& b) {
  const auto key = [](const CacheEntry& e) {
    return std::tie(e.device.gpu_name, e.device.num_sms, e.device.driver_version, e.device.library_version, e.gemm.n,
                    e.gemm.k, e.gemm.num_experts, e.gemm.top_k, e.gemm.epilogue, e.gemm.batch_invariant, e.bucket);
  };
  return key(a) < key(b);
}

}  // namespace

CacheFile read_cache(const std::string& path) {
  CacheFile out;
  out.path = path;
  const auto fail = [&](CacheStatus status, const std::string& what) {
    out.status = status;
    out.problem = "tune cache " + path + " " + what;
    out.entries.clear();
    return out;
  };
  std::error_code ec;
  const fs::file_status st = fs::status(path, ec);
  if (st.type() == fs::file_type::not_found) return out;  // kMissing
  if (ec) return fail(CacheStatus::kUnreadable, "cannot be read (" + ec.message() + "); ignored");
  if (fs::is_directory(st)) return fail(CacheStatus::kUnreadable, "is a directory, not a file; ignored");
  std::ifstream in(path, std::ios::binary);
  if (!in) return fail(CacheStatus::kUnreadable, std::string("cannot be read (") + std::strerror(errno) + "); ignored");
  std::ostringstream text;
  text << in.rdbuf();
  if (in.bad()) return fail(CacheStatus::kUnreadable, "cannot be read (I/O error); ignored");
  const json j = json::parse(text.str(), nullptr, /*allow_exceptions=*/false);
  const std::string rebuild = "; ignored (fp4moe tune writes a new one)";
  if (j.is_discarded()) return fail(CacheStatus::kCorrupt, "is corrupt (not valid JSON)" + rebuild);
  if (!j.is_object() || j.value("format", json()) != std::string(kCacheFormatName))
    return fail(CacheStatus::kCorrupt,
                "is corrupt (not an object with \"format\": \"" + std::string(kCacheFormatName) + "\")" + rebuild);
  const auto version = j.find("version");
  if (version == j.end() || !version->is_number_integer())
    return fail(CacheStatus::kCorrupt, "is corrupt (no integer \"version\")" + rebuild);
  if (version->get<int64_t>() != kCacheFormatVersion)
    return fail(CacheStatus::kOtherVersion, "has format version " + std::to_string(version->get<int64_t>()) +
                                                "; this fp4moe reads version " + std::to_string(kCacheFormatVersion) +
                                                rebuild);
  const auto entries = j.find("entries");
  if (entries == j.end() || !entries->is_array())
    return fail(CacheStatus::kCorrupt, "is corrupt (no \"entries\" array)" + rebuild);
  for (size_t i = 0; i < entries->size(); ++i) {
    CacheEntry e;
    const std::string fault = parse_entry((*entries)[i], &e);
    if (!fault.empty())
      return fail(CacheStatus::kCorrupt, "is corrupt (entry " + std::to_string(i) + ": " + fault + ")" + rebuild);
    out.entries.push_back(std::move(e));
  }
  out.status = CacheStatus::kOk;
  return out;
}

std::string stale_entries_note(const CacheFile& cache, const DeviceIdentity& device) {
  int64_t stale = 0;
  const CacheEntry* example = nullptr;
  for (const CacheEntry& e : cache.entries)
    if (!(e.device == device)) {
      ++stale;
      if (!example) example = &e;
    }
  if (stale == 0) return {};
  return "tune cache " + cache.path + ": " + std::to_string(stale) + " of " + std::to_string(cache.entries.size()) +
         " entries were tuned on another GPU, driver or library version (e.g. " + example->device.describe() +
         ") and are ignored; this process runs on " + device.describe() + " (fp4moe tune measures it)";
}

// ------------------------------------------------------------------ writing

namespace {

// An exclusive lock on `path`, released when the object goes.
class FileLock {
 public:
  explicit FileLock(const std::string& path) {
    fd_ = ::open(path.c_str(), O_CREAT | O_RDWR | O_CLOEXEC, 0644);
    FP4MOE_CHECK(fd_ >= 0, "cannot create the tune cache lock ", path, ": ", std::strerror(errno));
    if (::flock(fd_, LOCK_EX) != 0) {
      const int err = errno;
      ::close(fd_);
      FP4MOE_THROW("cannot lock ", path, ": ", std::strerror(err));
    }
  }
  ~FileLock() { ::close(fd_); }  // closing releases the lock
  FileLock(const FileLock&) = delete;
  FileLock& operator=(const FileLock&) = delete;

 private:
  int fd_ = -1;
};

// Writes `text` to `path` through a temporary file in the same directory,
// flushed to disk, then renamed over `path`.
void replace_file(const std::string& path, const std::string& text) {
  const std::string tmp = path + ".tmp." + std::to_string(::getpid());
  FILE* f = std::fopen(tmp.c_str(), "wb");
  FP4MOE_CHECK(f != nullptr, "cannot write the tune cache ", tmp, ": ", std::strerror(errno));
  const bool written =
      std::fwrite(text.data(), 1, text.size(), f) == text.size() && std::fflush(f) == 0 && ::fsync(::fileno(f)) == 0;
  const int err = errno;
  const bool closed = std::fclose(f) == 0;
  if (!written || !closed) {
    std::remove(tmp.c_str());
    FP4MOE_THROW("cannot write the tune cache ", tmp, ": ", std::strerror(written ? errno : err));
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    const int rename_err = errno;
    std::remove(tmp.c_str());
    FP4MOE_THROW("cannot replace the tune cache ", path, ": ", std::strerror(rename_err));
  }
}

}  // namespace

MergeSummary write_cache(const std::string& path, const std::vector<CacheEntry>& entries,
                         const DeviceIdentity& writer) {
  FP4MOE_CHECK(!path.empty(), "write_cache: no path");
  const fs::path parent = fs::absolute(fs::path(path)).parent_path();
  std::error_code ec;
  fs::create_directories(parent, ec);
  FP4MOE_CHECK(!ec && fs::is_directory(parent), "cannot create the tune cache directory ", parent.string(), ": ",
               ec ? ec.message() : "not a directory");
  FP4MOE_CHECK(!fs::is_directory(path), "tune cache ", path, " is a directory; expected a file name");
  const FileLock lock(path + ".lock");

  MergeSummary summary;
  const CacheFile existing = read_cache(path);
  if (existing.status != CacheStatus::kOk && existing.status != CacheStatus::kMissing)
    summary.replaced_file_problem = existing.problem;
  std::vector<CacheEntry> merged;
  for (const CacheEntry& old : existing.entries) {
    const bool superseded =
        std::any_of(entries.begin(), entries.end(), [&](const CacheEntry& e) { return e.same_key(old); });
    const bool stale_here =
        old.device.gpu_name == writer.gpu_name && old.device.num_sms == writer.num_sms && !(old.device == writer);
    if (superseded) continue;  // counted below, once per key
    if (stale_here) {
      ++summary.dropped_stale;
    } else {
      ++summary.kept;
      merged.push_back(old);
    }
  }
  const auto first_new = static_cast<std::ptrdiff_t>(merged.size());
  for (const CacheEntry& e : entries) {
    // Within one write the last entry of a key wins.
    const auto same =
        std::find_if(merged.begin() + first_new, merged.end(), [&](const CacheEntry& m) { return m.same_key(e); });
    if (same != merged.end()) {
      *same = e;
    } else {
      merged.push_back(e);
      const bool known = std::any_of(existing.entries.begin(), existing.entries.end(),
                                     [&](const CacheEntry& old) { return old.same_key(e); });
      ++(known ? summary.replaced : summary.added);
    }
  }
  std::stable_sort(merged.begin(), merged.end(), entry_less);

  std::string text = "{\n  \"format\": " + json(std::string(kCacheFormatName)).dump() +
                     ",\n  \"version\": " + std::to_string(kCacheFormatVersion) + ",\n  \"entries\": [";
  for (size_t i = 0; i < merged.size(); ++i) text += (i ? ",\n    " : "\n    ") + to_json(merged[i]).dump();
  text += merged.empty() ? "]\n}\n" : "\n  ]\n}\n";
  replace_file(path, text);
  return summary;
}

// ------------------------------------------------------------------ where, reports

std::string default_cache_path() {
  if (const char* v = std::getenv(kCacheEnvVar); v != nullptr && *v != '\0')
    return std::string(v) == "off" ? std::string() : std::string(v);
  if (const char* xdg = std::getenv("XDG_CACHE_HOME"); xdg != nullptr && xdg[0] == '/')
    return std::string(xdg) + "/fp4moe/tune-cache.json";
  if (const char* home = std::getenv("HOME"); home != nullptr && *home != '\0')
    return std::string(home) + "/.cache/fp4moe/tune-cache.json";
  return {};
}

void report_once(const std::string& line) {
  static std::mutex mutex;
  static std::set<std::string> reported;
  const std::lock_guard<std::mutex> lock(mutex);
  if (reported.insert(line).second) std::fprintf(stderr, "fp4moe: %s\n", line.c_str());
}

}  // namespace fp4moe::tune
