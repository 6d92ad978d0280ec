// What the safetensors reader (safetensors_reader.cpp) and writer
// (safetensors_writer.cpp) share about the file format: the length prefix,
// the metadata key, the header alignment, the dtypes fp4moe reads and the
// byte count of a shape. Internal to src/format.
// Tested in tests/format/test_safetensors_format.cpp and through the reader
// and writer tests.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>

#include "fp4moe/safetensors.hpp"

namespace fp4moe::safetensors_format {

inline constexpr size_t kLengthPrefixBytes = 8;
// Data starts at 8 + header length; keeping that a multiple of 8 lets
// readers of 8-byte dtypes map tensors aligned when the writer orders them so.
inline constexpr size_t kHeaderAlignment = 8;
inline constexpr std::string_view kMetadataKey = "__metadata__";
inline constexpr std::string_view kSupportedDTypes = "BF16, F16, F32, F8_E4M3, U8, I32, I64";
// Linux transfers at most ~2 GiB per read() or write(); ask for 1 GiB at a
// time.
inline constexpr size_t kMaxChunkBytes = size_t{1} << 30;

// The dtype spelled `name`, when it is one fp4moe reads.
std::optional<DType> find_dtype(std::string_view name);

// numel(shape) * element_bytes, or nullopt when it does not fit in 63 bits.
// A zero dimension makes the product 0 however large the others are.
std::optional<uint64_t> checked_nbytes(std::span<const int64_t> shape, size_t element_bytes);

// strerror's text for an errno value.
std::string errno_message(int error_number);

}  // namespace fp4moe::safetensors_format
