// Device packer: stacked ModelOpt NVFP4 expert tensors already in GPU memory
// (as inference engines hold them) -> the grouped GEMMs' fragment-ordered
// layout, by GPU kernels, without a round trip through the host. The index
// mapping is stacked_layout.hpp's; the source tensors are only read.
// Tested in tests/kernels/test_stacked_layout.cpp (the mapping on the CPU,
// against the host packer) and tests/layer/test_moe_layer_weights.cpp (GPU:
// MoeLayer::prepare_device against MoeLayer::prepare).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/stacked_layout.hpp"
#include "util/device_buffer.hpp"

namespace fp4moe {

// One grouped GEMM's prepared weights in device memory (the arrays of
// PreparedGemmWeights, without its global scales).
struct DevicePackedGemm {
  DeviceBuffer<uint8_t> weights;  // [E][n_padded/16][k_padded/64][512] fp4 fragments
  DeviceBuffer<uint8_t> scales;   // [E][n_padded/16][k_padded/64][64] scale codes
};

// Checks every block scale of `source` (finite, non-negative: else throws
// naming `what` and the first offending element), then packs. Synchronises
// `stream` once, for the check. `source` must be device memory of the current
// device; n and k multiples of 16.
DevicePackedGemm prepare_gemm_weights_device(const layout::StackedNvfp4& source, const char* what, cudaStream_t stream);

}  // namespace fp4moe
