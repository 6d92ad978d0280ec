// Device packer (prepare_device.hpp): one thread per prepared weight word and
// per prepared scale byte, each computed by stacked_layout.hpp's pure
// functions, plus a scan of the source block scales for values the kernels
// cannot use (negative or NaN), which the host packer refuses too.
//
// A DeepSeek-V3 layer (E = 256, H = 7168, I = 2048) is 5.6 GB of source
// codes; the packer reads each source byte about twice (the word kernel) and
// writes each prepared byte once, so it runs at a few ms per GB on an H200.
#include "kernels/prepare_device.hpp"

#include <cuda_runtime.h>

#include <algorithm>
#include <limits>

#include "fp4moe/error.hpp"
#include "fp4moe/nvfp4.hpp"

namespace fp4moe {

namespace {

constexpr int kThreads = 256;

// Grid-stride loops: a layer has up to ~1.5e9 prepared words.
__global__ void pack_weight_words_kernel(layout::StackedNvfp4 source, uint32_t* out, int64_t num_words) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < num_words; i += int64_t{gridDim.x} * blockDim.x)
    out[i] = layout::prepared_weight_word(source, i);
}

__global__ void pack_scale_bytes_kernel(layout::StackedNvfp4 source, uint8_t* out, int64_t num_bytes) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < num_bytes; i += int64_t{gridDim.x} * blockDim.x)
    out[i] = layout::prepared_scale_byte(source, i);
}

// first_bad: the lowest index of a negative or NaN e4m3 scale (stays at
// INT64_MAX when there is none).
__global__ void check_scales_kernel(const uint8_t* scales, int64_t count, unsigned long long* first_bad) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < count; i += int64_t{gridDim.x} * blockDim.x) {
    const uint8_t s = scales[i];
    if ((s & 0x80) || e4m3_is_nan(s)) atomicMin(first_bad, static_cast<unsigned long long>(i));
  }
}

unsigned grid_for(int64_t count) {
  int device = 0, sms = 0;
  FP4MOE_CUDA_CHECK(cudaGetDevice(&device));
  FP4MOE_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  const int64_t blocks = (count + kThreads - 1) / kThreads;
  return static_cast<unsigned>(std::clamp<int64_t>(blocks, 1, int64_t{sms} * 16));
}

}  // namespace

DevicePackedGemm prepare_gemm_weights_device(const layout::StackedNvfp4& source, const char* what,
                                             cudaStream_t stream) {
  FP4MOE_CHECK(source.packed != nullptr && source.scales != nullptr, "prepare_device: ", what, ": null device pointer");
  FP4MOE_CHECK(source.num_experts >= 1 && source.n >= 16 && source.n % 16 == 0 && source.k >= 16 && source.k % 16 == 0,
               "prepare_device: ", what, " is ", source.num_experts, " x [", source.n, ", ", source.k,
               "]; expected at least one expert and n, k positive multiples of 16");
  FP4MOE_CHECK(!source.gate_up || source.n % 32 == 0, "prepare_device: ", what, " has ", source.n,
               " rows; a gate/up stack needs a multiple of 32 (gate and up each a multiple of 16)");

  const int64_t num_scales = source.num_experts * source.n * (source.k / 16);
  {
    DeviceBuffer<unsigned long long> first_bad(1);
    const unsigned long long none = std::numeric_limits<unsigned long long>::max();
    FP4MOE_CUDA_CHECK(cudaMemcpyAsync(first_bad.get(), &none, sizeof(none), cudaMemcpyHostToDevice, stream));
    check_scales_kernel<<<grid_for(num_scales), kThreads, 0, stream>>>(source.scales, num_scales, first_bad.get());
    FP4MOE_CUDA_CHECK(cudaGetLastError());
    unsigned long long bad = none;
    FP4MOE_CUDA_CHECK(cudaMemcpyAsync(&bad, first_bad.get(), sizeof(bad), cudaMemcpyDeviceToHost, stream));
    FP4MOE_CUDA_CHECK(cudaStreamSynchronize(stream));
    if (bad != none) {
      uint8_t s = 0;
      FP4MOE_CUDA_CHECK(cudaMemcpy(&s, source.scales + bad, 1, cudaMemcpyDeviceToHost));
      const int64_t per_expert = source.n * (source.k / 16);
      const int64_t e = static_cast<int64_t>(bad) / per_expert;
      const int64_t row = static_cast<int64_t>(bad) % per_expert / (source.k / 16);
      const int64_t block = static_cast<int64_t>(bad) % (source.k / 16);
      FP4MOE_THROW("prepare_device: ", what, "[", e, ", ", row, ", ", block, "] is ", e4m3_to_float(s), " (e4m3 byte ",
                   int{s}, "); block scales must be finite and non-negative");
    }
  }

  DevicePackedGemm out;
  const int64_t num_fragments = source.num_fragments();
  const int64_t num_words = num_fragments * layout::kWordsPerFragment;
  const int64_t num_scale_bytes = num_fragments * kFragScaleBytes;
  out.weights = DeviceBuffer<uint8_t>(static_cast<size_t>(num_fragments * kFragBytes));
  out.scales = DeviceBuffer<uint8_t>(static_cast<size_t>(num_scale_bytes));
  pack_weight_words_kernel<<<grid_for(num_words), kThreads, 0, stream>>>(
      source, reinterpret_cast<uint32_t*>(out.weights.get()), num_words);
  FP4MOE_CUDA_CHECK(cudaGetLastError());
  pack_scale_bytes_kernel<<<grid_for(num_scale_bytes), kThreads, 0, stream>>>(source, out.scales.get(),
                                                                              num_scale_bytes);
  FP4MOE_CUDA_CHECK(cudaGetLastError());
  return out;
}

}  // namespace fp4moe
