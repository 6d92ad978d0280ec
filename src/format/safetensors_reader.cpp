// safetensors reading, fully validated, with pread.
//
// Reading trusts nothing in the file: the length prefix, the JSON header and
// every entry's dtype, shape and offsets are checked against each other and
// against the file size before a single view is handed out, so a corrupt or
// hostile file raises one fp4moe::Error naming the file, the tensor and the
// problem, and never leads to an out-of-bounds read. A tensor's bytes are
// read (pread) into memory the file object owns on its first get(), after
// checking that the file still holds them: a file truncated while open is a
// clean error, not the SIGBUS a memory map would raise, and a file replaced
// by rename keeps being read from the inode that was opened. Tensors of
// dtypes fp4moe does not read (F64, BOOL, ...) are listed and bounds-checked
// like the others; only get() on one of them is an error.
// Tested in tests/format/test_safetensors_reader.cpp: round trips of every
// dtype, a table of malformed headers, deterministic fuzzing of a valid
// file's bytes; the same tests also run under ASan/UBSan
// (test_safetensors_asan); tests/format/test_safetensors_robust.cpp: unread
// dtypes, truncation and replacement after open, release(). Fuzzed by
// fuzz/fuzz_safetensors.cpp.
#include "fp4moe/safetensors.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <limits>
#include <optional>
#include <set>
#include <tuple>
#include <utility>

#include <nlohmann/json.hpp>

#include "format/safetensors_format.hpp"
#include "fp4moe/error.hpp"

namespace fp4moe {

using namespace safetensors_format;

namespace {

using nlohmann::json;

// The reference implementation refuses larger headers too; a bigger length
// is a corrupt prefix, not a real header, and must not drive an allocation.
constexpr uint64_t kMaxHeaderBytes = 100'000'000;
// The other dtypes of the safetensors format, with their element sizes: a
// file may hold them (a mask, an fp64 statistic) beside tensors fp4moe reads;
// their byte counts are still checked against their shapes.
struct OtherDType {
  std::string_view name;
  size_t element_bytes;
};
constexpr OtherDType kOtherDTypes[] = {{"BOOL", 1}, {"I8", 1},  {"F8_E5M2", 1}, {"F8_E8M0", 1}, {"I16", 2},
                                       {"U16", 2},  {"U32", 4}, {"U64", 8},     {"F64", 8}};

// The value of a JSON non-negative integer (including "-0"), else nullopt.
std::optional<uint64_t> as_offset(const json& value) {
  if (value.is_number_unsigned()) return value.get<uint64_t>();
  if (value.is_number_integer() && value.get<int64_t>() == 0) return 0;
  return std::nullopt;
}

// For messages: numbers as written, anything else by its JSON type, so a
// huge string or array never ends up in an error message.
std::string describe(const json& value) {
  if (value.is_number()) return value.dump();
  return std::string("a JSON ") + value.type_name();
}

template <typename... Args>
[[noreturn]] void throw_tensor_error(const std::string& path, std::string_view name, const Args&... args) {
  FP4MOE_THROW(path, ": tensor '", name, "': ", args...);
}

uint64_t read_le_u64(const uint8_t* bytes) {
  uint64_t value = 0;
  for (int i = 7; i >= 0; --i) value = (value << 8) | bytes[i];
  return value;
}

// One header entry, validated on its own; overlaps are checked afterwards.
struct HeaderEntry {
  std::string name;
  std::optional<DType> dtype;  // empty: a dtype fp4moe does not read
  std::string dtype_name;
  std::vector<int64_t> shape;
  uint64_t begin;
  uint64_t end;
};

HeaderEntry parse_entry(const std::string& path, const std::string& name, const json& value,
                        uint64_t data_section_bytes) {
  if (!value.is_object()) {
    throw_tensor_error(path, name, "entry must be an object with dtype, shape and data_offsets, got ", describe(value));
  }
  HeaderEntry entry{name, std::nullopt, {}, {}, 0, 0};

  const auto dtype_it = value.find("dtype");
  if (dtype_it == value.end()) throw_tensor_error(path, name, "missing 'dtype'");
  if (!dtype_it->is_string()) {
    throw_tensor_error(path, name, "'dtype' must be a string, got ", describe(*dtype_it));
  }
  const auto& dtype_string = dtype_it->get_ref<const std::string&>();
  if (dtype_string.empty()) throw_tensor_error(path, name, "'dtype' is an empty string");
  entry.dtype = find_dtype(dtype_string);
  entry.dtype_name = dtype_string;
  // Element size: known for every safetensors dtype; a name outside the
  // format (a newer version's) gets its offsets checked, not its byte count.
  std::optional<size_t> element_bytes;
  if (entry.dtype) element_bytes = dtype_size(*entry.dtype);
  for (const OtherDType& other : kOtherDTypes)
    if (other.name == dtype_string) element_bytes = other.element_bytes;

  const auto shape_it = value.find("shape");
  if (shape_it == value.end()) throw_tensor_error(path, name, "missing 'shape'");
  if (!shape_it->is_array()) {
    throw_tensor_error(path, name, "'shape' must be an array of dimensions, got ", describe(*shape_it));
  }
  for (size_t dim_idx = 0; dim_idx < shape_it->size(); ++dim_idx) {
    const json& dim = (*shape_it)[dim_idx];
    const std::optional<uint64_t> extent = as_offset(dim);
    if (!extent) {
      throw_tensor_error(path, name, "shape[", dim_idx, "] must be a non-negative integer, got ", describe(dim));
    }
    if (*extent > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      throw_tensor_error(path, name, "shape[", dim_idx, "] = ", *extent, " does not fit in a signed 64-bit dimension");
    }
    entry.shape.push_back(static_cast<int64_t>(*extent));
  }
  const std::optional<uint64_t> nbytes = checked_nbytes(entry.shape, element_bytes.value_or(1));
  if (!nbytes) {
    throw_tensor_error(path, name, "shape ", shape_to_string(entry.shape), " of ", dtype_string,
                       " overflows a 64-bit byte count");
  }

  const auto offsets_it = value.find("data_offsets");
  if (offsets_it == value.end()) throw_tensor_error(path, name, "missing 'data_offsets'");
  if (!offsets_it->is_array() || offsets_it->size() != 2) {
    throw_tensor_error(path, name, "'data_offsets' must be an array [begin, end], got ",
                       offsets_it->is_array() ? "an array of " + std::to_string(offsets_it->size()) + " elements"
                                              : describe(*offsets_it));
  }
  const std::optional<uint64_t> begin = as_offset((*offsets_it)[0]);
  const std::optional<uint64_t> end = as_offset((*offsets_it)[1]);
  if (!begin || !end) {
    throw_tensor_error(path, name, "data_offsets must be non-negative integers, got [", describe((*offsets_it)[0]),
                       ", ", describe((*offsets_it)[1]), "]");
  }
  entry.begin = *begin;
  entry.end = *end;
  if (entry.end < entry.begin) {
    throw_tensor_error(path, name, "data_offsets [", entry.begin, ", ", entry.end, "] have end before begin");
  }
  if (entry.end > data_section_bytes) {
    throw_tensor_error(path, name, "data_offsets [", entry.begin, ", ", entry.end,
                       "] run past the end of the data section (", data_section_bytes, " bytes)");
  }
  if (element_bytes && entry.end - entry.begin != *nbytes) {
    throw_tensor_error(path, name, "data_offsets [", entry.begin, ", ", entry.end, "] but shape ",
                       shape_to_string(entry.shape), " of ", dtype_string, " needs ", *nbytes, " bytes");
  }
  return entry;
}

std::map<std::string, std::string> parse_metadata(const std::string& path, const json& value) {
  if (!value.is_object()) {
    FP4MOE_THROW(path, ": '", kMetadataKey, "' must be an object of strings, got ", describe(value));
  }
  std::map<std::string, std::string> metadata;
  for (const auto& [key, item] : value.items()) {
    FP4MOE_CHECK(item.is_string(), path, ": '", kMetadataKey, "' entry '", key, "' must be a string, got ",
                 describe(item));
    metadata.emplace(key, item.get<std::string>());
  }
  return metadata;
}

// Parses the header text, turning any JSON error into fp4moe::Error.
// nlohmann::json keeps only the last of repeated keys; a callback catches a
// repeated tensor name, which would otherwise hide a tensor silently.
json parse_header_json(const std::string& path, const char* text, size_t text_bytes) {
  std::set<std::string, std::less<>> top_level_keys;
  std::optional<std::string> repeated_key;
  const json::parser_callback_t note_repeated_keys = [&](int depth, json::parse_event_t event, json& parsed) {
    if (event == json::parse_event_t::key && depth == 1 && !repeated_key) {
      if (!top_level_keys.insert(parsed.get<std::string>()).second) {
        repeated_key = parsed.get<std::string>();
      }
    }
    return true;
  };
  // nlohmann::json stops at a NUL byte as if the input ended there, so text
  // after it would be ignored silently; raw NUL is never valid JSON.
  const void* nul_byte = std::memchr(text, '\0', text_bytes);
  if (nul_byte != nullptr) {
    FP4MOE_THROW(path, ": header (", text_bytes, " bytes) is not valid JSON: NUL byte at offset ",
                 static_cast<const char*>(nul_byte) - text);
  }
  json header;
  try {
    header = json::parse(text, text + text_bytes, note_repeated_keys);
  } catch (const json::exception& e) {
    FP4MOE_THROW(path, ": header (", text_bytes, " bytes) is not valid JSON: ", e.what());
  }
  if (!header.is_object()) {
    FP4MOE_THROW(path, ": header is not a JSON object, got ", describe(header));
  }
  if (repeated_key) {
    FP4MOE_THROW(path, ": header lists '", *repeated_key, "' more than once");
  }
  return header;
}

// Reads exactly nbytes at `offset`, retrying short reads and EINTR; false
// when the file ends first.
bool read_exactly(int fd, void* data, size_t nbytes, uint64_t offset, const std::string& path) {
  auto* cursor = static_cast<uint8_t*>(data);
  while (nbytes > 0) {
    const ssize_t got = ::pread(fd, cursor, std::min(nbytes, kMaxChunkBytes), static_cast<off_t>(offset));
    if (got < 0 && errno == EINTR) continue;
    if (got < 0) FP4MOE_THROW(path, ": read failed: ", errno_message(errno));
    if (got == 0) return false;
    cursor += got;
    offset += static_cast<uint64_t>(got);
    nbytes -= static_cast<size_t>(got);
  }
  return true;
}

// Where a view of zero bytes points: not null, never read.
const uint8_t kNoBytes[1] = {0};

}  // namespace

// ---------------------------------------------------------------------------
// SafetensorsFile

SafetensorsFile SafetensorsFile::open(const std::string& path) {
  SafetensorsFile file;
  file.path_ = path;

  // O_NONBLOCK: a FIFO (or device) at `path` must not block open() forever;
  // it is refused below as not a regular file. Regular files ignore the flag.
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) FP4MOE_THROW(path, ": cannot open: ", errno_message(errno));
  file.fd_ = fd;  // from here on, file's destructor closes it on any error
  struct stat file_stat {};
  if (::fstat(fd, &file_stat) != 0) FP4MOE_THROW(path, ": cannot stat: ", errno_message(errno));
  FP4MOE_CHECK(S_ISREG(file_stat.st_mode), path, ": not a regular file");
  const auto file_bytes = static_cast<uint64_t>(file_stat.st_size);
  FP4MOE_CHECK(file_bytes >= kLengthPrefixBytes, path, ": file is ", file_bytes,
               " bytes, shorter than the 8-byte header length prefix");

  file.file_bytes_ = file_bytes;
  uint8_t prefix[kLengthPrefixBytes];
  FP4MOE_CHECK(read_exactly(fd, prefix, kLengthPrefixBytes, 0, path), path,
               ": file ended while its length prefix was read (truncated while opening?)");
  const uint64_t header_bytes = read_le_u64(prefix);
  FP4MOE_CHECK(header_bytes <= kMaxHeaderBytes, path, ": header length ", header_bytes, " exceeds the limit of ",
               kMaxHeaderBytes, " bytes (corrupt length prefix?)");
  FP4MOE_CHECK(header_bytes <= file_bytes - kLengthPrefixBytes, path, ": header length ", header_bytes,
               " runs past the end of the file (", file_bytes, " bytes)");
  file.data_section_offset_ = kLengthPrefixBytes + header_bytes;
  const uint64_t data_section_bytes = file_bytes - kLengthPrefixBytes - header_bytes;

  std::string header_text(static_cast<size_t>(header_bytes), '\0');
  FP4MOE_CHECK(read_exactly(fd, header_text.data(), header_text.size(), kLengthPrefixBytes, path), path,
               ": file ended while its header was read (truncated while opening?)");
  const json header = parse_header_json(path, header_text.data(), header_text.size());

  std::vector<HeaderEntry> entries;
  for (const auto& [key, value] : header.items()) {
    if (key == kMetadataKey) {
      file.metadata_ = parse_metadata(path, value);
    } else {
      entries.push_back(parse_entry(path, key, value, data_section_bytes));
    }
  }

  // Sorted by (begin, end), the ranges are disjoint iff each one begins at or
  // after the previous one ends. Gaps are allowed: they waste space but are
  // harmless. An empty range strictly inside another counts as an overlap,
  // as it does for the reference implementation.
  std::sort(entries.begin(), entries.end(), [](const HeaderEntry& a, const HeaderEntry& b) {
    return std::tie(a.begin, a.end, a.name) < std::tie(b.begin, b.end, b.name);
  });
  for (size_t entry_idx = 1; entry_idx < entries.size(); ++entry_idx) {
    const HeaderEntry& previous = entries[entry_idx - 1];
    const HeaderEntry& current = entries[entry_idx];
    if (current.begin < previous.end) {
      throw_tensor_error(path, current.name, "data_offsets [", current.begin, ", ", current.end, "] overlap tensor '",
                         previous.name, "' at [", previous.begin, ", ", previous.end, "]");
    }
  }

  file.names_.reserve(entries.size());
  for (HeaderEntry& entry : entries) {
    StoredTensor stored;
    stored.view.name = entry.name;
    stored.view.dtype = entry.dtype.value_or(DType::U8);
    stored.view.shape = std::move(entry.shape);
    stored.view.nbytes = static_cast<size_t>(entry.end - entry.begin);
    stored.readable = entry.dtype.has_value();
    stored.dtype_name = std::move(entry.dtype_name);
    stored.offset = entry.begin;
    file.names_.push_back(entry.name);
    file.tensors_.emplace(std::move(entry.name), std::move(stored));
  }
  file.mutex_ = std::make_unique<std::mutex>();
  return file;
}

SafetensorsFile::SafetensorsFile(SafetensorsFile&& other) noexcept
    : path_(std::move(other.path_)),
      fd_(std::exchange(other.fd_, -1)),
      file_bytes_(other.file_bytes_),
      data_section_offset_(other.data_section_offset_),
      names_(std::move(other.names_)),
      tensors_(std::move(other.tensors_)),
      metadata_(std::move(other.metadata_)),
      mutex_(std::move(other.mutex_)) {}

SafetensorsFile& SafetensorsFile::operator=(SafetensorsFile&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) ::close(fd_);
    path_ = std::move(other.path_);
    fd_ = std::exchange(other.fd_, -1);
    file_bytes_ = other.file_bytes_;
    data_section_offset_ = other.data_section_offset_;
    names_ = std::move(other.names_);
    tensors_ = std::move(other.tensors_);
    metadata_ = std::move(other.metadata_);
    mutex_ = std::move(other.mutex_);
  }
  return *this;
}

SafetensorsFile::~SafetensorsFile() {
  if (fd_ >= 0) ::close(fd_);
}

bool SafetensorsFile::contains(std::string_view name) const { return tensors_.find(name) != tensors_.end(); }

SafetensorsFile::StoredTensor& SafetensorsFile::readable(std::string_view name) const {
  const auto it = tensors_.find(name);
  FP4MOE_CHECK(it != tensors_.end(), path_, ": no tensor named '", name, "' (the file has ", tensors_.size(),
               " tensors)");
  StoredTensor& stored = it->second;
  if (!stored.readable)
    throw_tensor_error(path_, name, "dtype '", stored.dtype_name,
                       "' is not one fp4moe reads (supported: ", kSupportedDTypes, ")");
  return stored;
}

TensorView SafetensorsFile::describe(std::string_view name) const {
  TensorView view = readable(name).view;
  view.data = nullptr;
  return view;
}

const TensorView& SafetensorsFile::get(std::string_view name) const {
  StoredTensor& stored = readable(name);
  const std::lock_guard<std::mutex> lock(*mutex_);
  if (stored.view.data != nullptr) return stored.view;
  const size_t nbytes = stored.view.nbytes;
  if (nbytes == 0) {
    stored.view.data = kNoBytes;
    return stored.view;
  }
  // The file must still hold the bytes it held at open(); reading past its
  // current end is refused here, not discovered as a short read.
  const uint64_t end = data_section_offset_ + stored.offset + nbytes;
  struct stat now {};
  if (::fstat(fd_, &now) != 0) FP4MOE_THROW(path_, ": cannot stat: ", errno_message(errno));
  const auto now_bytes = static_cast<uint64_t>(now.st_size);
  if (now_bytes < end)
    throw_tensor_error(path_, name, "the file is now ", now_bytes, " bytes, shorter than the ", file_bytes_,
                       " it had when opened (truncated while open?); the tensor ends at byte ", end);
  auto bytes = std::make_unique_for_overwrite<uint8_t[]>(nbytes);
  if (!read_exactly(fd_, bytes.get(), nbytes, end - nbytes, path_))
    throw_tensor_error(path_, name, "the file ended before byte ", end, " (truncated while being read?)");
  stored.bytes = std::move(bytes);
  stored.view.data = stored.bytes.get();
  return stored.view;
}

void SafetensorsFile::release(std::string_view name) const {
  const auto it = tensors_.find(name);
  if (it == tensors_.end()) return;
  StoredTensor& stored = it->second;
  const std::lock_guard<std::mutex> lock(*mutex_);
  stored.bytes.reset();
  stored.view.data = nullptr;
}

}  // namespace fp4moe
