// A test kernel that lets the next kernel in the stream start at once
// (programmatic dependent launch) and only then, after a delay, writes its
// output: a kernel launched after it that reads the output too early sees
// the old contents.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace fp4moe::testing {

// Copies `bytes` (a multiple of 16) from src to dst after spinning for
// `delay_ns` nanoseconds on the device; one block.
void launch_delayed_copy(const void* src, void* dst, size_t bytes, int64_t delay_ns, cudaStream_t stream);

}  // namespace fp4moe::testing
