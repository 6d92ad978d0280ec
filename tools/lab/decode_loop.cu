// How fast the portable m8 tile's loop (n128 m8 k256, four stages, four
// warps, two blocks per SM: the one-token GEMMs' tile) runs on its own and
// with its weight stream, to tell at T = 1 whether the loop's instructions
// or the memory pipeline around them set the pace. Per 64-wide K fragment a
// warp reads its two 16-row groups' fp4 codes and scales from shared memory,
// dequantises them into mma.sync A fragments and multiplies them against one
// 8-token activation tile (ldmatrix), as portable_grouped_gemm.cuh does.
//   full      the loop over a ring filled once, a block barrier per stage
//   nobar     the same without the barrier
//   nodeq     the raw code words as A (no dequantisation)
//   nomma     dequantisation only (registers kept alive, no mma)
//   ring-l2   the loop behind its cp.async ring, every block re-reading its
//             first three stages, 54 KB of weights and scales (from L2)
//   ring      the loop behind its cp.async ring, every block streaming its
//             own unit of 128 rows x 6144 k (GLM-5 GEMM1's shape) from HBM
//   copy      the same ring without the loop (what the memory delivers)
//   ring-w    the ring of weights alone (no scales, no activation rows)
//   ring-bulk the ring with each stage's weights and scales as two bulk
//             copies (cp.async.bulk, one thread, an mbarrier per stage)
//   copy-bulk the same without the loop
//   ring-mbar the cp.async ring without the block barrier per stage: each
//             thread's copies arrive on the stage's "full" mbarrier
//             (cp.async.mbarrier.arrive), each warp on its "free" one after
//             reading it, and a refill waits for the slot's "free" only
//   copy-mbar the same without the loop
// A lab measurement for docs/performance.md §5.27; not part of the build.
//
//   nvcc -O3 -std=c++20 -gencode arch=compute_90a,code=sm_90a -Isrc -Iinclude \
//     tools/lab/decode_loop.cu -o decode_loop
//   ./decode_loop
//
// Prints one line per form: `form cycles_per_stage weights_per_cycle_per_sm
// us GB/s`: SM cycles (clock64) per 256-k stage of one block, the median
// over the blocks, and dequantised weights per cycle per SM over the two
// blocks; for the ring forms also the launch's time (events) and the weight
// and scale bytes it read per second. Medians of seven launches, the ring
// forms' each after a 256 MB read that evicts the L2. (The second archived
// run evicted it by a 256 MB write, whose dirty lines were written back
// during the launch: the ring at 2.21 TB/s there on an H100, 2.46-2.52 in
// the first run, without an eviction.)
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <vector>

#include "kernels/grouped_gemm_common.cuh"
#include "kernels/ptx/cp_async.cuh"
#include "kernels/ptx/mma.cuh"
#include "kernels/ptx/sm90.cuh"

namespace {

using namespace fp4moe;
using kernels::detail::dequant_a_fragment;
using kernels::detail::scale_pair;

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kStages = 4;
constexpr int kKFrags = 4;                                        // 256-wide stage
constexpr int kGroups = 8;                                        // 16-row groups of the 128-row tile
constexpr int kRowTiles = kGroups / kWarps;                       // per warp
constexpr int kWeightStage = kKFrags * kGroups * kFragBytes;      // 16 KB
constexpr int kScaleStage = kKFrags * kGroups * kFragScaleBytes;  // 2 KB
constexpr int kActStage = 8 * 256 * 2;                            // 8 rows x 256 k, bf16
constexpr int kStageBytes = kWeightStage + kScaleStage + kActStage;
constexpr int kSmemBytes = kStages * kStageBytes + kStages * 16;  // + the bulk and mbar forms' mbarriers
constexpr int kUnitStages = 6144 / 256;                           // one unit's stages: GLM-5 GEMM1's k
constexpr int kLoopStages = 2048;                                 // stages of the forms without a ring

enum Form { kFull, kNoBar, kNoDeq, kNoMma, kRingL2, kRing, kCopy, kRingW, kRingBulk, kCopyBulk, kRingMbar, kCopyMbar };

template <Form FORM>
constexpr bool kHasRing = FORM >= kRingL2;
template <Form FORM>
constexpr bool kBulk = FORM == kRingBulk || FORM == kCopyBulk;
template <Form FORM>
constexpr bool kMbar = FORM == kRingMbar || FORM == kCopyMbar;
template <Form FORM>
constexpr bool kMath = !(FORM == kCopy || FORM == kCopyBulk || FORM == kCopyMbar);

// One stage of math: K_FRAGS fragments of the warp's two row groups.
template <Form FORM>
__device__ __forceinline__ void stage_math(const uint8_t* w_stage, const uint8_t* s_stage, uint32_t a_stage,
                                           float (&acc)[kRowTiles][4], int warp, int lane) {
  const uint32_t ldsm_offset = (lane % 8) * 32 * 16;  // row lane % 8 of 32 16-byte chunks (k 256)
  const int ldsm_hi = (lane / 8) % 2;
#pragma unroll
  for (int kf = 0; kf < kKFrags; ++kf) {
    uint4 codes[kRowTiles];
    uint2 scales[kRowTiles];
#pragma unroll
    for (int mt = 0; mt < kRowTiles; ++mt) {
      const int group = warp * kRowTiles + mt;
      codes[mt] = *reinterpret_cast<const uint4*>(w_stage + (kf * kGroups + group) * kFragBytes + lane * 16);
      scales[mt] = *reinterpret_cast<const uint2*>(s_stage + (kf * kGroups + group) * kFragScaleBytes + (lane / 4) * 8);
    }
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) {
      uint32_t b[2] = {0, 0};
      if constexpr (FORM != kNoMma) {
        const uint32_t chunk = ((kf * 8 + 2 * ks + ldsm_hi) ^ (lane % 8)) * 16;
        ptx::ldmatrix_x2(b, a_stage + ldsm_offset + chunk);
      }
#pragma unroll
      for (int mt = 0; mt < kRowTiles; ++mt) {
        const uint32_t word = ks == 0 ? codes[mt].x : ks == 1 ? codes[mt].y : ks == 2 ? codes[mt].z : codes[mt].w;
        uint32_t a[4];
        if constexpr (FORM == kNoDeq) {
          a[0] = word;
          a[1] = word ^ scales[mt].x;
          a[2] = word + 1;
          a[3] = word ^ scales[mt].y;
        } else {
          dequant_a_fragment(word, scale_pair(scales[mt], ks), a);
        }
        if constexpr (FORM == kNoMma) {
#pragma unroll
          for (int i = 0; i < 4; ++i) acc[mt][i] += __uint_as_float(a[i]);
        } else {
          ptx::mma_m16n8k16_bf16(acc[mt], a, b[0], b[1]);
        }
      }
    }
  }
}

// weights, scales: the block's unit (kUnitStages stages, contiguous per
// stage as the prepared layout's), re-read from its start every
// `wrap_stages` stages; x: one 8 x 6144 bf16 activation tile.
template <Form FORM>
__global__ void __launch_bounds__(kThreads, 2)
    decode_loop(const uint8_t* weights, const uint8_t* scales, const __nv_bfloat16* x, int wrap_stages,
                long long* cycles, float* sink, int never) {
  extern __shared__ __align__(128) uint8_t smem[];
  uint8_t* s_weights = smem;
  uint8_t* s_scales = smem + kStages * kWeightStage;
  uint8_t* s_act = s_scales + kStages * kScaleStage;
  const uint32_t full_bar = ptx::smem_u32(s_act + kStages * kActStage);  // kBulk, kMbar: stage s's at + 8 s
  const uint32_t free_bar = full_bar + kStages * 8;                      // kMbar: stage s's at + 8 s
  const int tid = threadIdx.x;
  const int warp = tid / 32;
  const int lane = tid % 32;
  const uint8_t* g_weights = weights + static_cast<size_t>(blockIdx.x) * kUnitStages * kWeightStage;
  const uint8_t* g_scales = scales + static_cast<size_t>(blockIdx.x) * kUnitStages * kScaleStage;

  auto load = [&](int stage, int kt) {
    kt %= wrap_stages;
    const uint32_t sw = ptx::smem_u32(s_weights + stage * kWeightStage);
    const uint32_t ss = ptx::smem_u32(s_scales + stage * kScaleStage);
    if constexpr (kBulk<FORM>) {
      if (tid == 0) {
        const uint32_t bar = full_bar + 8 * stage;
        ptx::mbarrier_expect_tx(bar, kWeightStage + kScaleStage);
        ptx::bulk_copy_g2s(sw, g_weights + static_cast<size_t>(kt) * kWeightStage, kWeightStage, bar);
        ptx::bulk_copy_g2s(ss, g_scales + static_cast<size_t>(kt) * kScaleStage, kScaleStage, bar);
        ptx::mbarrier_arrive(bar);
      }
    } else {
#pragma unroll
      for (int j = 0; j < kWeightStage / 16 / kThreads; ++j) {
        const int i = tid + j * kThreads;
        ptx::cp_async_16(sw + i * 16, g_weights + static_cast<size_t>(kt) * kWeightStage + i * 16, 16);
      }
      if constexpr (FORM == kRingW) return;
      ptx::cp_async_16(ss + tid * 16, g_scales + static_cast<size_t>(kt) * kScaleStage + tid * 16, 16);
    }
    // 8 rows x 32 chunks of activations: two per thread, swizzled as the kernel's.
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int i = tid + j * kThreads;
      const int r = i / 32;
      const int c = i % 32;
      ptx::cp_async_16(ptx::smem_u32(s_act + stage * kActStage) + (r * 32 + (c ^ (r % 8))) * 16,
                       x + static_cast<size_t>(r) * 6144 + kt * 256 + c * 8, 16);
    }
    if constexpr (kMbar<FORM>) ptx::cp_async_arrive_noinc(full_bar + 8 * stage);
  };

  if constexpr (!kHasRing<FORM>) {
    // Code words of every value, scales near 1 (the timing does not depend on them).
    for (int i = tid; i < kStages * kWeightStage / 4; i += kThreads)
      reinterpret_cast<uint32_t*>(s_weights)[i] = 0x9E3779B9u * (i + 1);
    for (int i = tid; i < kStages * kScaleStage; i += kThreads) s_scales[i] = 0x70;
    for (int i = tid; i < kStages * kActStage / 4; i += kThreads) reinterpret_cast<uint32_t*>(s_act)[i] = 0;
  }
  if constexpr (kBulk<FORM> || kMbar<FORM>) {
    if (tid == 0) {
      for (int s = 0; s < kStages; ++s) {
        ptx::mbarrier_init(full_bar + 8 * s, kMbar<FORM> ? kThreads : 1);
        ptx::mbarrier_init(free_bar + 8 * s, kWarps);
      }
      ptx::fence_barrier_init();
    }
  }
  __syncthreads();
  float acc[kRowTiles][4] = {};
  const int stages = kHasRing<FORM> ? kUnitStages : kLoopStages;
  const long long start = clock64();
  if constexpr (kHasRing<FORM>) {
#pragma unroll
    for (int s = 0; s < kStages - 1; ++s) {
      load(s, s);
      ptx::cp_async_commit();
    }
  }
  for (int it = 0; it < stages; ++it) {
    const int stage = it % kStages;
    if constexpr (kMbar<FORM>) {
      // The refill of the slot read in the previous iteration waits only
      // for every warp to have read it; then this stage's copies.
      const int next = it + kStages - 1;
      if (next < stages) {
        const int slot = next % kStages;
        if (it >= 1) ptx::mbarrier_wait(free_bar + 8 * slot, ((it - 1) / kStages) % 2);
        load(slot, next);
      }
      ptx::mbarrier_wait(full_bar + 8 * stage, (it / kStages) % 2);
    } else if constexpr (kHasRing<FORM>) {
      ptx::cp_async_wait<kStages - 2>();
      if constexpr (kBulk<FORM>) ptx::mbarrier_wait(full_bar + 8 * stage, (it / kStages) % 2);
      __syncthreads();
      const int next = it + kStages - 1;
      if (next < stages) load(next % kStages, next);
      ptx::cp_async_commit();
    } else if constexpr (FORM != kNoBar) {
      __syncthreads();
    }
    if constexpr (kMath<FORM>)
      stage_math<FORM>(s_weights + stage * kWeightStage, s_scales + stage * kScaleStage,
                       ptx::smem_u32(s_act + stage * kActStage), acc, warp, lane);
    if constexpr (kMbar<FORM>) {
      __syncwarp();
      if (lane == 0) ptx::mbarrier_arrive(free_bar + 8 * stage);
    }
  }
  ptx::cp_async_wait_all();
  __syncthreads();
  const long long end = clock64();
  if (tid == 0) cycles[blockIdx.x] = end - start;
  if (never) {
    float s = 0.0f;
#pragma unroll
    for (int mt = 0; mt < kRowTiles; ++mt)
#pragma unroll
      for (int i = 0; i < 4; ++i) s += acc[mt][i];
    sink[blockIdx.x * kThreads + tid] = s;
  }
}

// Reads `words` 16-byte words: the L2 is left holding clean lines of this
// buffer only.
__global__ void evict_l2(const uint4* data, size_t words, uint32_t* sink) {
  uint32_t x = 0;
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < words;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    const uint4 v = __ldcg(data + i);
    x ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (x == 0x9E3779B9u) *sink = x;  // keeps the loads; (almost) never stores
}

struct Buffers {
  uint8_t* weights;
  uint8_t* scales;
  __nv_bfloat16* x;
  long long* cycles;
  float* sink;
  uint8_t* flush;
  int blocks;
};
constexpr size_t kFlushBytes = size_t{256} << 20;

template <Form FORM>
void run(const char* name, const Buffers& b) {
  auto kernel = decode_loop<FORM>;
  cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes);
  // ring-l2 re-reads the first 3 stages (54 KB per block, 14 MB in all: in L2).
  const int wrap = FORM == kRingL2 ? 3 : kUnitStages;
  cudaEvent_t t0, t1;
  cudaEventCreate(&t0);
  cudaEventCreate(&t1);
  std::vector<double> block_cycles, launch_us;
  for (int rep = 0; rep < 7; ++rep) {
    if (kHasRing<FORM>)
      evict_l2<<<4 * b.blocks, 256>>>(reinterpret_cast<const uint4*>(b.flush), kFlushBytes / 16,
                                      reinterpret_cast<uint32_t*>(b.sink));
    cudaEventRecord(t0);
    kernel<<<b.blocks, kThreads, kSmemBytes>>>(b.weights, b.scales, b.x, wrap, b.cycles, b.sink, 0);
    cudaEventRecord(t1);
    if (cudaError_t e = cudaDeviceSynchronize(); e != cudaSuccess) {
      std::printf("%s error %s\n", name, cudaGetErrorString(e));
      return;
    }
    float ms = 0.0f;
    cudaEventElapsedTime(&ms, t0, t1);
    std::vector<long long> c(b.blocks);
    cudaMemcpy(c.data(), b.cycles, b.blocks * sizeof(long long), cudaMemcpyDeviceToHost);
    std::sort(c.begin(), c.end());
    block_cycles.push_back(static_cast<double>(c[b.blocks / 2]));
    launch_us.push_back(ms * 1e3);
  }
  std::sort(block_cycles.begin(), block_cycles.end());
  std::sort(launch_us.begin(), launch_us.end());
  const double median_cycles = block_cycles[3];
  const double median_us = launch_us[3];
  const int stages = kHasRing<FORM> ? kUnitStages : kLoopStages;
  const double per_stage = median_cycles / stages;
  const double weights_per_cycle = 2.0 * 128 * 256 / per_stage;  // two blocks per SM
  if (kHasRing<FORM>) {
    const double bytes =
        static_cast<double>(b.blocks) * kUnitStages * (kWeightStage + (FORM == kRingW ? 0 : kScaleStage));
    std::printf("%-8s %8.1f %7.2f %8.1f %7.0f\n", name, per_stage, weights_per_cycle, median_us,
                bytes / median_us * 1e-3);
  } else {
    std::printf("%-8s %8.1f %7.2f\n", name, per_stage, weights_per_cycle);
  }
  cudaEventDestroy(t0);
  cudaEventDestroy(t1);
}

}  // namespace

int main() {
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  cudaDeviceProp prop{};
  cudaGetDeviceProperties(&prop, 0);
  Buffers b{};
  b.blocks = 2 * sms;
  const size_t w_bytes = static_cast<size_t>(b.blocks) * kUnitStages * kWeightStage;
  const size_t s_bytes = static_cast<size_t>(b.blocks) * kUnitStages * kScaleStage;
  cudaMalloc(&b.weights, w_bytes);
  cudaMalloc(&b.scales, s_bytes);
  cudaMalloc(&b.x, 8 * 6144 * sizeof(__nv_bfloat16));
  cudaMalloc(&b.cycles, b.blocks * sizeof(long long));
  cudaMalloc(&b.sink, b.blocks * kThreads * sizeof(float));
  cudaMalloc(&b.flush, kFlushBytes);
  cudaMemset(b.flush, 1, kFlushBytes);
  cudaMemset(b.weights, 0x35, w_bytes);
  cudaMemset(b.scales, 0x38, s_bytes);
  cudaMemset(b.x, 0, 8 * 6144 * sizeof(__nv_bfloat16));
  std::printf("# %s, %d SMs, %d blocks of %d threads, %.1f MB of weights and scales in the ring forms\n", prop.name,
              sms, b.blocks, kThreads, (w_bytes + s_bytes) * 1e-6);
  std::printf("# form cycles_per_stage weights_per_cycle_per_sm [us GB/s]\n");
  run<kFull>("full", b);
  run<kNoBar>("nobar", b);
  run<kNoDeq>("nodeq", b);
  run<kNoMma>("nomma", b);
  run<kRingL2>("ring-l2", b);
  run<kRing>("ring", b);
  run<kCopy>("copy", b);
  run<kRingW>("ring-w", b);
  run<kRingBulk>("ring-bulk", b);
  run<kCopyBulk>("copy-bulk", b);
  run<kRingMbar>("ring-mbar", b);
  run<kCopyMbar>("copy-mbar", b);
  run<kRing>("ring", b);
  return 0;
}
