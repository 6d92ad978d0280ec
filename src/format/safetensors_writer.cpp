// safetensors writing, atomic: tensors are laid out contiguously in
// insertion order after a header padded to 8 bytes (as the reference
// implementation does), written to "<path>.tmp.<pid>", fsynced and renamed
// over <path>. The header is written first from the tensors' specs and the
// data streamed after it (SafetensorsStreamWriter), so a writer never needs
// more than one tensor in memory; SafetensorsWriter collects tensors and
// writes through it.
// Tested in tests/format/test_safetensors_writer.cpp: the exact byte layout,
// refused tensors, failing writes (missing directory, failed rename, file
// size limit) that leave nothing behind, the streaming writer (order, sizes,
// misuse); also under ASan/UBSan (test_safetensors_asan).
#include "fp4moe/safetensors.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <filesystem>
#include <optional>
#include <set>
#include <utility>

#include <nlohmann/json.hpp>

#include "format/safetensors_format.hpp"
#include "fp4moe/error.hpp"

namespace fp4moe {

using namespace safetensors_format;

namespace {

// Writes all of [data, data + nbytes), retrying short writes and EINTR.
void write_all(int fd, const void* data, size_t nbytes, const std::string& tmp_path) {
  const auto* cursor = static_cast<const uint8_t*>(data);
  while (nbytes > 0) {
    const ssize_t written = ::write(fd, cursor, std::min(nbytes, kMaxChunkBytes));
    if (written < 0 && errno == EINTR) continue;
    if (written < 0) FP4MOE_THROW(tmp_path, ": write failed: ", errno_message(errno));
    FP4MOE_CHECK(written > 0, tmp_path, ": write made no progress");
    cursor += written;
    nbytes -= static_cast<size_t>(written);
  }
}

// Makes a rename durable. Best effort: some filesystems refuse fsync on a
// directory, and the file itself is already complete and synced.
void sync_parent_directory(const std::string& path) {
  std::filesystem::path parent = std::filesystem::path(path).parent_path();
  if (parent.empty()) parent = ".";
  const int dir_fd = ::open(parent.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dir_fd < 0) return;
  ::fsync(dir_fd);
  ::close(dir_fd);
}

// Checks one tensor's name, dtype and shape for a writer (`who` prefixes the
// messages) and returns its byte count.
uint64_t checked_spec_bytes(std::string_view who, const std::string& name, DType dtype,
                            const std::vector<int64_t>& shape) {
  FP4MOE_CHECK(name != kMetadataKey, who, ": a tensor cannot be named '", kMetadataKey,
               "' (the key is reserved for metadata)");
  for (int64_t dim : shape) {
    FP4MOE_CHECK(dim >= 0, who, ": tensor '", name, "': shape ", shape_to_string(shape), " has a negative dimension");
  }
  const std::optional<uint64_t> expected_bytes = checked_nbytes(shape, dtype_size(dtype));
  FP4MOE_CHECK(expected_bytes.has_value(), who, ": tensor '", name, "': shape ", shape_to_string(shape), " of ",
               dtype_name(dtype), " overflows a 64-bit byte count");
  return *expected_bytes;
}

}  // namespace

// ---------------------------------------------------------------------------
// SafetensorsStreamWriter

SafetensorsStreamWriter::SafetensorsStreamWriter(std::string path, std::vector<TensorSpec> tensors,
                                                 const std::map<std::string, std::string>& metadata)
    : path_(std::move(path)), tensors_(std::move(tensors)) {
  std::set<std::string_view> names;
  nbytes_.reserve(tensors_.size());
  for (const TensorSpec& spec : tensors_) {
    nbytes_.push_back(checked_spec_bytes("SafetensorsStreamWriter", spec.name, spec.dtype, spec.shape));
    FP4MOE_CHECK(names.insert(spec.name).second, "SafetensorsStreamWriter: tensor '", spec.name, "' is listed twice");
  }

  // ordered_json keeps "__metadata__" first and the tensors in the given
  // order, matching the data layout.
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) {
    nlohmann::ordered_json meta = nlohmann::ordered_json::object();
    for (const auto& [key, value] : metadata) meta[key] = value;
    header[std::string(kMetadataKey)] = std::move(meta);
  }
  uint64_t offset = 0;
  for (size_t i = 0; i < tensors_.size(); ++i) {
    nlohmann::ordered_json info = nlohmann::ordered_json::object();
    info["dtype"] = std::string(dtype_name(tensors_[i].dtype));
    info["shape"] = tensors_[i].shape;
    info["data_offsets"] = nlohmann::ordered_json::array({offset, offset + nbytes_[i]});
    header[tensors_[i].name] = std::move(info);
    offset += nbytes_[i];
  }
  std::string header_text;
  try {
    header_text = header.dump();
  } catch (const nlohmann::ordered_json::exception& e) {
    FP4MOE_THROW(path_, ": cannot write: a tensor name or metadata string is not valid UTF-8 (", e.what(), ")");
  }
  header_text.append((kHeaderAlignment - header_text.size() % kHeaderAlignment) % kHeaderAlignment, ' ');
  uint8_t length_prefix[kLengthPrefixBytes];
  for (size_t byte_idx = 0; byte_idx < kLengthPrefixBytes; ++byte_idx) {
    length_prefix[byte_idx] = static_cast<uint8_t>(uint64_t{header_text.size()} >> (8 * byte_idx));
  }
  file_bytes_ = kLengthPrefixBytes + header_text.size() + offset;

  tmp_path_ = path_ + ".tmp." + std::to_string(::getpid());
  fd_ = ::open(tmp_path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd_ < 0) {
    FP4MOE_THROW(path_, ": cannot create temporary file '", tmp_path_, "': ", errno_message(errno));
  }
  try {
    write_all(fd_, length_prefix, sizeof(length_prefix), tmp_path_);
    write_all(fd_, header_text.data(), header_text.size(), tmp_path_);
  } catch (...) {
    ::close(fd_);
    ::unlink(tmp_path_.c_str());
    throw;
  }
}

SafetensorsStreamWriter::~SafetensorsStreamWriter() {
  if (committed_) return;
  if (fd_ >= 0) ::close(fd_);
  ::unlink(tmp_path_.c_str());
}

std::string_view SafetensorsStreamWriter::next_name() const {
  return next_ < tensors_.size() ? std::string_view(tensors_[next_].name) : std::string_view();
}

void SafetensorsStreamWriter::write(std::string_view name, const void* data, size_t nbytes) {
  FP4MOE_CHECK(!committed_, "SafetensorsStreamWriter: ", path_, ": write of '", name, "' after commit()");
  FP4MOE_CHECK(next_ < tensors_.size(), "SafetensorsStreamWriter: ", path_, ": tensor '", name, "' written but all ",
               tensors_.size(), " listed tensors are already written");
  const TensorSpec& spec = tensors_[next_];
  FP4MOE_CHECK(name == spec.name, "SafetensorsStreamWriter: ", path_, ": tensor '", name,
               "' written where the header lists '", spec.name, "' next");
  FP4MOE_CHECK(nbytes == nbytes_[next_], "SafetensorsStreamWriter: tensor '", name, "': ", nbytes,
               " bytes given but shape ", shape_to_string(spec.shape), " of ", dtype_name(spec.dtype), " needs ",
               nbytes_[next_], " bytes");
  FP4MOE_CHECK(data != nullptr || nbytes == 0, "SafetensorsStreamWriter: tensor '", name, "': data is null");
  write_all(fd_, data, nbytes, tmp_path_);
  ++next_;
}

void SafetensorsStreamWriter::commit() {
  FP4MOE_CHECK(!committed_, "SafetensorsStreamWriter: ", path_, ": commit() called twice");
  FP4MOE_CHECK(next_ == tensors_.size(), "SafetensorsStreamWriter: ", path_, ": commit() after ", next_, " of ",
               tensors_.size(), " tensors; '", tensors_[next_].name, "' was not written");
  if (::fsync(fd_) != 0) FP4MOE_THROW(tmp_path_, ": fsync failed: ", errno_message(errno));
  // close() can report a deferred write error (NFS, quotas).
  if (::close(std::exchange(fd_, -1)) != 0) {
    FP4MOE_THROW(tmp_path_, ": close failed: ", errno_message(errno));
  }
  if (::rename(tmp_path_.c_str(), path_.c_str()) != 0) {
    FP4MOE_THROW(path_, ": cannot rename '", tmp_path_, "' over it: ", errno_message(errno));
  }
  committed_ = true;
  sync_parent_directory(path_);
}

// ---------------------------------------------------------------------------
// SafetensorsWriter

void SafetensorsWriter::add(const std::string& name, DType dtype, std::vector<int64_t> shape, const void* data,
                            size_t nbytes) {
  FP4MOE_CHECK(!names_.contains(name), "SafetensorsWriter: tensor '", name, "' was already added");
  const uint64_t expected_bytes = checked_spec_bytes("SafetensorsWriter", name, dtype, shape);
  FP4MOE_CHECK(nbytes == expected_bytes, "SafetensorsWriter: tensor '", name, "': ", nbytes, " bytes given but shape ",
               shape_to_string(shape), " of ", dtype_name(dtype), " needs ", expected_bytes, " bytes");
  FP4MOE_CHECK(data != nullptr || nbytes == 0, "SafetensorsWriter: tensor '", name, "': data is null");

  const auto* first = static_cast<const uint8_t*>(data);
  tensors_.push_back(Entry{name, dtype, std::move(shape),
                           nbytes == 0 ? std::vector<uint8_t>{} : std::vector<uint8_t>(first, first + nbytes)});
  names_.insert(name);
}

void SafetensorsWriter::set_metadata(const std::string& key, const std::string& value) { metadata_[key] = value; }

void SafetensorsWriter::write(const std::string& path) const {
  std::vector<TensorSpec> specs;
  specs.reserve(tensors_.size());
  for (const Entry& entry : tensors_) specs.push_back(TensorSpec{entry.name, entry.dtype, entry.shape});
  SafetensorsStreamWriter stream(path, std::move(specs), metadata_);
  for (const Entry& entry : tensors_) stream.write(entry.name, entry.bytes.data(), entry.bytes.size());
  stream.commit();
}

}  // namespace fp4moe
