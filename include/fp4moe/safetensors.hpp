// safetensors files: validated reading (pread, no memory map) and atomic
// writing.
//
// Format: 8-byte little-endian header length N, N bytes of JSON
// {"name": {"dtype": "BF16", "shape": [..], "data_offsets": [begin, end]}, ...,
//  "__metadata__": {"key": "value"}}, then the data section. Every offset,
// length, dtype and shape is validated on open; a malformed file raises one
// fp4moe::Error naming the file, the tensor and the problem.
// Tested in tests/format/test_safetensors_{reader,writer}.cpp (round trips,
// fuzzed headers, also under AddressSanitizer) and
// tests/format/test_safetensors_robust.cpp (unread dtypes, files truncated or
// replaced after open).
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace fp4moe {

enum class DType { BF16, F16, F32, F8_E4M3, U8, I32, I64 };

size_t dtype_size(DType dtype);
// The safetensors spelling: "BF16", "F16", "F32", "F8_E4M3", "U8", "I32", "I64".
std::string_view dtype_name(DType dtype);
// Throws fp4moe::Error for an unsupported spelling.
DType parse_dtype(std::string_view name);

int64_t shape_numel(std::span<const int64_t> shape);
std::string shape_to_string(std::span<const int64_t> shape);  // "[2, 3]"

// A tensor inside an open file (or any borrowed buffer). 0-d tensors have an
// empty shape and one element.
struct TensorView {
  std::string name;
  DType dtype = DType::U8;
  std::vector<int64_t> shape;
  // Not necessarily aligned to the dtype (safetensors does not require it):
  // read elements with memcpy, not through a cast pointer.
  const uint8_t* data = nullptr;
  size_t nbytes = 0;

  int64_t numel() const { return shape_numel(shape); }
};

// A read-only safetensors file, kept open. open() reads and validates the
// header only. A tensor's bytes are read on its first get() into memory the
// file object owns (pread, not a memory map: a file truncated while open is
// an fp4moe::Error naming the file and the tensor, never a SIGBUS; a file
// replaced by rename is still read from what was opened). Views stay valid
// while the file object lives, until release() of that tensor.
//
// Tensors whose dtype fp4moe does not read (F64, BOOL, I8, U16, ..., or a
// name from a newer format version) are listed by names() and contains()
// and checked like the others at open; get() or describe() of one throws.
//
// get(), describe() and release() may be called from several threads, but
// not release() of a tensor whose view another thread still uses.
class SafetensorsFile {
 public:
  static SafetensorsFile open(const std::string& path);
  SafetensorsFile(SafetensorsFile&&) noexcept;
  SafetensorsFile& operator=(SafetensorsFile&&) noexcept;
  ~SafetensorsFile();

  const std::string& path() const { return path_; }
  bool contains(std::string_view name) const;
  // Reads the tensor's bytes on first use. Throws fp4moe::Error naming the
  // file and the tensor when it is missing, has a dtype fp4moe does not
  // read, or the file no longer holds its bytes.
  const TensorView& get(std::string_view name) const;
  // The tensor's name, dtype, shape and nbytes without reading its bytes
  // (data is null); throws as get() does for a missing or unread dtype.
  TensorView describe(std::string_view name) const;
  // Frees the bytes get() read for `name` (its views become invalid); the
  // next get() reads them again. For callers streaming through big files.
  void release(std::string_view name) const;
  // Tensor names in file order of their data offsets.
  const std::vector<std::string>& names() const { return names_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }

 private:
  struct StoredTensor {
    TensorView view;         // data: null until get() reads the bytes
    bool readable = false;   // a dtype fp4moe reads
    std::string dtype_name;  // as the header spells it
    uint64_t offset = 0;     // in the data section
    std::unique_ptr<uint8_t[]> bytes;
  };
  SafetensorsFile() = default;
  StoredTensor& readable(std::string_view name) const;
  std::string path_;
  int fd_ = -1;
  uint64_t file_bytes_ = 0;           // at open()
  uint64_t data_section_offset_ = 0;  // 8 + header length
  std::vector<std::string> names_;
  // mutable: the bytes get() reads are a cache of the file, filled by const
  // readers (the map's structure never changes after open()).
  mutable std::map<std::string, StoredTensor, std::less<>> tensors_;
  std::map<std::string, std::string> metadata_;
  std::unique_ptr<std::mutex> mutex_;  // guards the bytes read by get()
};

// The name, dtype and shape of a tensor to be written by
// SafetensorsStreamWriter; 0-d tensors have an empty shape.
struct TensorSpec {
  std::string name;
  DType dtype = DType::U8;
  std::vector<int64_t> shape;
};

// Writes one safetensors file with memory bounded by one tensor: the header is
// written first from every tensor's spec (known before any data is), then the
// tensors' bytes are given one at a time, in spec order, to write(). The file
// goes to "<path>.tmp.<pid>"; commit() (after the last tensor) fsyncs it and
// renames it over <path>. A writer destroyed before commit(), e.g. by an
// exception, removes its temporary file, so a failed write leaves nothing.
// The layout is SafetensorsWriter's (which writes through this class).
class SafetensorsStreamWriter {
 public:
  // Validates the specs (names unique, not "__metadata__", shapes
  // non-negative and not overflowing) and writes the header. Throws
  // fp4moe::Error naming the path when the file cannot be created.
  SafetensorsStreamWriter(std::string path, std::vector<TensorSpec> tensors,
                          const std::map<std::string, std::string>& metadata = {});
  ~SafetensorsStreamWriter();
  SafetensorsStreamWriter(const SafetensorsStreamWriter&) = delete;
  SafetensorsStreamWriter& operator=(const SafetensorsStreamWriter&) = delete;

  // The next tensor's bytes: `name` must be the next spec's name and nbytes
  // numel(shape) * dtype_size(dtype); anything else throws (a caller bug
  // that would otherwise write a file whose header lies).
  void write(std::string_view name, const void* data, size_t nbytes);
  // The name of the tensor write() expects next; empty once all are written.
  std::string_view next_name() const;
  size_t num_written() const { return next_; }
  // Total bytes of the file (length prefix + header + data).
  uint64_t file_bytes() const { return file_bytes_; }
  // After the last tensor: fsync, close, rename over the path. Throws if a
  // tensor is missing or the rename fails (the temporary file is removed).
  void commit();

 private:
  std::string path_;
  std::string tmp_path_;
  std::vector<TensorSpec> tensors_;
  std::vector<uint64_t> nbytes_;  // per tensor
  size_t next_ = 0;
  uint64_t file_bytes_ = 0;
  int fd_ = -1;
  bool committed_ = false;
};

// Collects tensors and writes them as one safetensors file. The write goes to
// "<path>.tmp.<pid>" first and is renamed over <path> only when complete, so
// a failed write leaves no partial file.
class SafetensorsWriter {
 public:
  // Copies the bytes. nbytes must equal numel(shape) * dtype_size(dtype).
  void add(const std::string& name, DType dtype, std::vector<int64_t> shape, const void* data, size_t nbytes);
  void add(const TensorView& view) { add(view.name, view.dtype, view.shape, view.data, view.nbytes); }
  void set_metadata(const std::string& key, const std::string& value);
  size_t num_tensors() const { return tensors_.size(); }
  void write(const std::string& path) const;

 private:
  struct Entry {
    std::string name;
    DType dtype;
    std::vector<int64_t> shape;
    std::vector<uint8_t> bytes;
  };
  std::vector<Entry> tensors_;
  std::set<std::string, std::less<>> names_;  // for add()'s duplicate check in O(log n)
  std::map<std::string, std::string> metadata_;
};

}  // namespace fp4moe
