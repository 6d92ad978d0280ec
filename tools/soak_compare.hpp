// The soak test's device-side check (tools/cmd_soak.cpp): counts the bf16
// elements of a forward's output that differ, bit for bit, from the output
// of the first pass over the same inputs, without copying either to the host.
// Implemented in tools/soak_compare.cu; exercised by `fp4moe soak` on a GPU.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace fp4moe::cli {

// *mismatches += the number of i < count with got[i] != expected[i] (16-bit
// words compared as bits, so NaN payloads and -0 count too). count must be a
// multiple of 8 and both pointers 16-byte aligned. Asynchronous on `stream`.
void launch_count_mismatches(const uint16_t* got, const uint16_t* expected, int64_t count, uint32_t* mismatches,
                             cudaStream_t stream);

}  // namespace fp4moe::cli
