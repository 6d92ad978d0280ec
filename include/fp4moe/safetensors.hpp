// safetensors files: memory-mapped reading and atomic writing.
//
// Format: 8-byte little-endian header length N, N bytes of JSON
// {"name": {"dtype": "BF16", "shape": [..], "data_offsets": [begin, end]}, ...,
//  "__metadata__": {"key": "value"}}, then the data section. Every offset,
// length, dtype and shape is validated on open; a malformed file raises one
// fp4moe::Error naming the file, the tensor and the problem.
// Tested in tests/format/test_safetensors.cpp (round trips, fuzzed headers,
// also under AddressSanitizer).
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
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

// A read-only, memory-mapped safetensors file. Views stay valid while the
// file object lives.
class SafetensorsFile {
 public:
  static SafetensorsFile open(const std::string& path);
  SafetensorsFile(SafetensorsFile&&) noexcept;
  SafetensorsFile& operator=(SafetensorsFile&&) noexcept;
  ~SafetensorsFile();

  const std::string& path() const { return path_; }
  bool contains(std::string_view name) const;
  // Throws fp4moe::Error naming the file and the missing tensor.
  const TensorView& get(std::string_view name) const;
  // Tensor names in file order of their data offsets.
  const std::vector<std::string>& names() const { return names_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }

 private:
  SafetensorsFile() = default;
  std::string path_;
  void* map_ = nullptr;
  size_t map_size_ = 0;
  std::vector<std::string> names_;
  std::map<std::string, TensorView, std::less<>> tensors_;
  std::map<std::string, std::string> metadata_;
};

// Collects tensors and writes them as one safetensors file. The write goes to
// "<path>.tmp.<pid>" first and is renamed over <path> only when complete, so
// a failed write leaves no partial file.
class SafetensorsWriter {
 public:
  // Copies the bytes. nbytes must equal numel(shape) * dtype_size(dtype).
  void add(const std::string& name, DType dtype, std::vector<int64_t> shape, const void* data,
           size_t nbytes);
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
