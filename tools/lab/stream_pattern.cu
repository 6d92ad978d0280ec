// How fast HBM streams the m8 GEMM's weights without its math, under two
// access patterns with the same blocks and the same bytes in flight: every
// block reading its own contiguous region (as a decode-sized grouped GEMM's
// units do: one n-tile's K range each) against all blocks sweeping the
// buffer together (the read peer's pattern). A lab measurement for
// docs/performance.md §5.27; not part of the build.
//
//   nvcc -O3 -std=c++17 -arch=sm_90 tools/lab/stream_pattern.cu -o stream_pattern
//   ./stream_pattern [MB]    (default 107: GLM-5 GEMM1's weights at T = 1)
//
// Each block has 128 threads; a chunk is 16 KB (8 copies of 16 B per
// thread); a block keeps STAGES - 1 chunks in flight (cp.async into a ring
// of STAGES chunks in shared memory, as the portable GEMM's mainloop). The
// L2 is flushed (a read of 256 MB) before every timed pass; the median of 7
// passes is printed, one line per (pattern, blocks, stages), as `pattern
// blocks stages kb_in_flight_per_block tb_per_s`.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

namespace {

constexpr int kThreads = 128;
constexpr int kLoadsPerChunk = 8;
constexpr int64_t kChunkBytes = int64_t{kThreads} * kLoadsPerChunk * 16;

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "stream_pattern: %s: %s\n", what, cudaGetErrorString(e));
    std::exit(1);
  }
}

__device__ __forceinline__ void copy_async_16(void* smem, const void* global) {
  const uint32_t dst = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(global) : "memory");
}
__device__ __forceinline__ void commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wait_groups() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// A ring of STAGES 16 KB chunks in shared memory filled with cp.async, as
// the portable GEMM's mainloop fills its weight stages: STAGES - 1 chunks in
// flight while one is read back. Each thread reads back only what it
// copied, so no barrier is needed. CONTIGUOUS: block b reads chunks
// [b * per_block, (b + 1) * per_block); otherwise chunk c is read by block
// c % gridDim.x, all blocks in step.
template <int STAGES, bool CONTIGUOUS>
__global__ void __launch_bounds__(kThreads) stream_kernel(const uint4* data, int64_t num_chunks, uint32_t* sink) {
  extern __shared__ uint4 ring[];  // [STAGES][kLoadsPerChunk * kThreads]
  const int64_t per_block = (num_chunks + gridDim.x - 1) / gridDim.x;
  auto issue = [&](int64_t i) {
    const int64_t chunk = CONTIGUOUS ? blockIdx.x * per_block + i : i * gridDim.x + blockIdx.x;
    if (i < per_block && chunk < num_chunks) {
      uint4* slot = ring + (i % STAGES) * (kLoadsPerChunk * kThreads);
#pragma unroll
      for (int l = 0; l < kLoadsPerChunk; ++l)
        copy_async_16(slot + l * kThreads + threadIdx.x,
                      data + chunk * (kChunkBytes / 16) + l * kThreads + threadIdx.x);
    }
    commit();  // empty groups keep the count
  };
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) issue(s);
  uint32_t acc = 0;
  for (int64_t i = 0; i < per_block; ++i) {
    wait_groups<STAGES - 2>();
    const uint4* slot = ring + (i % STAGES) * (kLoadsPerChunk * kThreads);
#pragma unroll
    for (int l = 0; l < kLoadsPerChunk; ++l) {
      const uint4 v = slot[l * kThreads + threadIdx.x];
      acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    issue(i + STAGES - 1);
  }
  wait_groups<0>();
  if (acc == 0x9e3779b9u) sink[0] = acc;  // keeps the reads
}

template <int STAGES, bool CONTIGUOUS>
void launch(const uint4* data, int64_t num_chunks, int blocks, uint32_t* sink) {
  const int smem = static_cast<int>(STAGES * kChunkBytes);
  check(cudaFuncSetAttribute(stream_kernel<STAGES, CONTIGUOUS>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem),
        "smem attribute");
  stream_kernel<STAGES, CONTIGUOUS><<<blocks, kThreads, smem>>>(data, num_chunks, sink);
  check(cudaGetLastError(), "launch");
}

template <int STAGES, bool CONTIGUOUS>
float time_pass(const uint4* data, int64_t num_chunks, int blocks, uint32_t* sink, const uint4* flush,
                int64_t flush_chunks, cudaEvent_t start, cudaEvent_t stop) {
  std::vector<float> ms;
  for (int pass = 0; pass < 8; ++pass) {
    launch<4, false>(flush, flush_chunks, 1024, sink);
    check(cudaEventRecord(start), "event");
    launch<STAGES, CONTIGUOUS>(data, num_chunks, blocks, sink);
    check(cudaEventRecord(stop), "event");
    check(cudaEventSynchronize(stop), "kernel");
    float t = 0;
    check(cudaEventElapsedTime(&t, start, stop), "elapsed");
    if (pass > 0) ms.push_back(t);  // the first pass warms the code up
  }
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

template <int STAGES>
void run_both(const uint4* data, int64_t num_chunks, int blocks, uint32_t* sink, const uint4* flush,
              int64_t flush_chunks, cudaEvent_t start, cudaEvent_t stop) {
  const double bytes = static_cast<double>(num_chunks * kChunkBytes);
  const float contiguous = time_pass<STAGES, true>(data, num_chunks, blocks, sink, flush, flush_chunks, start, stop);
  const float sweep = time_pass<STAGES, false>(data, num_chunks, blocks, sink, flush, flush_chunks, start, stop);
  const int kb = static_cast<int>((STAGES - 1) * kChunkBytes / 1024);
  std::printf("contiguous %5d %2d %4d %6.3f\n", blocks, STAGES, kb, bytes / (contiguous * 1e-3) / 1e12);
  std::printf("sweep      %5d %2d %4d %6.3f\n", blocks, STAGES, kb, bytes / (sweep * 1e-3) / 1e12);
}

}  // namespace

int main(int argc, char** argv) {
  const int64_t mb = argc > 1 ? std::atoll(argv[1]) : 107;
  const int64_t num_chunks = mb * 1000 * 1000 / kChunkBytes;
  const int64_t flush_chunks = int64_t{256} * 1024 * 1024 / kChunkBytes;
  uint4 *data = nullptr, *flush = nullptr;
  uint32_t* sink = nullptr;
  check(cudaMalloc(&data, num_chunks * kChunkBytes), "malloc");
  check(cudaMalloc(&flush, flush_chunks * kChunkBytes), "malloc");
  check(cudaMalloc(&sink, 4), "malloc");
  check(cudaMemset(data, 1, num_chunks * kChunkBytes), "memset");
  check(cudaMemset(flush, 2, flush_chunks * kChunkBytes), "memset");
  cudaDeviceProp prop{};
  check(cudaGetDeviceProperties(&prop, 0), "properties");
  cudaEvent_t start, stop;
  check(cudaEventCreate(&start), "event");
  check(cudaEventCreate(&stop), "event");
  std::printf("# %s, %d SMs, %.1f MB read per pass, 128 threads per block, 16 KB chunks\n", prop.name,
              prop.multiProcessorCount, num_chunks * kChunkBytes / 1e6);
  std::printf("pattern    blocks stages kb_in_flight_per_block tb_per_s\n");
  const int sms = prop.multiProcessorCount;
  // 256 blocks: GEMM1's units at T = 1 (GLM-5, DeepSeek-V3; the m8 tile's
  // four stages hold three 16 KB weight chunks in flight); the others fill
  // one to four resident blocks per SM, as shared memory allows (every grid
  // here is resident at once).
  run_both<3>(data, num_chunks, 256, sink, flush, flush_chunks, start, stop);
  run_both<3>(data, num_chunks, 4 * sms, sink, flush, flush_chunks, start, stop);
  for (const int blocks : {256, 2 * sms, 3 * sms})
    run_both<4>(data, num_chunks, blocks, sink, flush, flush_chunks, start, stop);
  for (const int blocks : {256, 2 * sms}) run_both<6>(data, num_chunks, blocks, sink, flush, flush_chunks, start, stop);
  run_both<12>(data, num_chunks, sms, sink, flush, flush_chunks, start, stop);
  return 0;
}
