// How fast the SM90 consumers' loop runs on its own: per 64-wide K fragment,
// the fp4 codes dequantised into wgmma A registers and four wgmma m64nWk16
// against an activation tile in shared memory, with one or two groups in
// flight — without a producer or memory traffic (the ring is filled once).
// Warpgroups per block 2 (today's tiles), 3 or 4 (K split between two
// pairs), at widths 64, 96 and 128, and seven forms of the loop:
//   full      as sm90/consumer.cuh: dequantise, fence, 4 wgmmas, commit, wait<1>
//   nodeq     the raw code words as A (no dequantisation)
//   nomma     dequantise only (registers kept alive, no wgmma)
//   split     two A registers dequantised, two wgmmas, the other two, commit
//   deep      as full with two groups in flight behind the one being dequantised (wait<2>)
//   arrive    as full with the stage's two mbarrier arrivals of every consumer thread (weights
//             free after its last fragment, the previous stage's activations after its first)
//   warparrive  the same arrivals, one per warp after __syncwarp
// A lab measurement for docs/performance.md §5.29; not part of the build.
//
//   nvcc -O3 -std=c++20 -gencode arch=compute_90a,code=sm_90a -Isrc -Iinclude \
//     tools/lab/consumer_overlap.cu -o consumer_overlap
//   ./consumer_overlap
//
// Prints one line per case: `form warpgroups width cycles_per_fragment
// weights_per_cycle_per_sm tensor_share` (the share of the tensor cores' peak
// of 2048 bf16 MACs per cycle per SM), the median over the blocks of one
// launch of one block per SM, the best of three launches. Cycles are SM
// cycles (clock64), so the figures do not depend on the clock the GPU runs
// at. ptxas serialises the wgmmas of `deep` with four warpgroups at width
// 128 (C7512: registers).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <vector>

#include "kernels/grouped_gemm_common.cuh"
#include "kernels/ptx/sm90.cuh"
#include "kernels/sm90/common.cuh"
#include "kernels/ptx/wgmma.cuh"

namespace {

using namespace fp4moe;

constexpr int kStages = 4;
constexpr int kKFrags = 2;        // 64-wide K fragments per stage, as the m128 k128 tile
constexpr int kFragments = 4096;  // per warpgroup
constexpr int kWeightStage = kKFrags * 8 * kFragBytes;
constexpr int kScaleStage = kKFrags * 8 * kFragScaleBytes;

enum Form { kFull, kNoDeq, kNoMma, kSplit, kDeep, kArrive, kWarpArrive };

// Stages per loop body: a multiple of the groups in flight (sm90/consumer.cuh's NOTE).
template <Form FORM>
constexpr int kStagesPerBody = FORM == kDeep ? 3 : 2;
// Fragments of a stage one warpgroup runs: four warpgroups split them in two pairs.
template <int WGS>
constexpr int kMyFrags = WGS == 4 ? 1 : kKFrags;
// Fragments one warpgroup runs.
template <int WGS, Form FORM>
constexpr int kRunFragments = kFragments / kMyFrags<WGS> / kStagesPerBody<FORM>* kStagesPerBody<FORM>* kMyFrags<WGS>;

template <int WIDTH>
constexpr int kActStage = kKFrags* WIDTH * 128;
template <int WIDTH>
constexpr int kSmemBytes = kStages*(kActStage<WIDTH> + kWeightStage + kScaleStage) + 1024;

template <int WGS, int WIDTH, Form FORM>
__global__ void __launch_bounds__(WGS * 128, 1) consumer_loop(long long* cycles, float* sink, int never) {
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  uint8_t* smem = smem_raw + (1024 - ptx::smem_u32(smem_raw) % 1024) % 1024;
  const int tid = threadIdx.x;
  // Codes of every value, scales near 1, activations zero (the timing does
  // not depend on the values).
  for (int i = tid; i < kStages * kActStage<WIDTH> / 4; i += blockDim.x) reinterpret_cast<uint32_t*>(smem)[i] = 0;
  uint8_t* s_weights = smem + kStages * kActStage<WIDTH>;
  uint8_t* s_scales = s_weights + kStages * kWeightStage;
  for (int i = tid; i < kStages * kWeightStage / 4; i += blockDim.x)
    reinterpret_cast<uint32_t*>(s_weights)[i] = 0x9E3779B9u * (i + 1);
  for (int i = tid; i < kStages * kScaleStage; i += blockDim.x) s_scales[i] = 0x70;
  // Per stage "weights free" and "activations free", as the kernel's.
  const uint32_t bars = ptx::smem_u32(s_scales + kStages * kScaleStage);
  if (tid == 0)
    for (int b = 0; b < 2 * kStages; ++b) ptx::mbarrier_init(bars + 8 * b, FORM == kWarpArrive ? WGS * 4 : WGS * 128);
  __syncthreads();

  const int warpgroup = tid / 128;
  const int lane = tid % 32;
  const int group = (warpgroup % 2) * 4 + (tid % 128) / 32;
  // Four warpgroups split each stage's fragments between two pairs.
  constexpr int MY_FRAGS = kMyFrags<WGS>;
  constexpr int SPB = kStagesPerBody<FORM>;
  const int kf0 = WGS == 4 ? warpgroup / 2 : 0;
  const uint32_t act_base = ptx::smem_u32(smem);
  float acc[WIDTH / 2];
#pragma unroll
  for (int i = 0; i < WIDTH / 2; ++i) acc[i] = 0.0f;

  __syncthreads();
  const long long start = clock64();
  // As sm90/consumer.cuh: every fragment's codes and scales of the stage are
  // loaded before the first one is dequantised.
  auto fragment = [&](int stage, int kf, uint4 codes, uint2 scales) {
    const uint64_t desc = ptx::smem_desc_k_major_sw128(act_base + stage * kActStage<WIDTH>);
    const uint32_t words[4] = {codes.x, codes.y, codes.z, codes.w};
    uint32_t a[4][4];
    if constexpr (FORM == kSplit) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
#pragma unroll
        for (int ks = 2 * half; ks < 2 * half + 2; ++ks) {
          kernels::detail::dequant_a_fragment(words[ks], kernels::detail::scale_pair(scales, ks), a[ks]);
          kernels::sm90::fence_registers(a[ks]);
        }
        kernels::sm90::fence_registers(acc);
        ptx::wgmma_fence();
#pragma unroll
        for (int ks = 2 * half; ks < 2 * half + 2; ++ks)
          ptx::Wgmma<WIDTH>::mma(acc, a[ks], ptx::smem_desc_advance(desc, kf * (WIDTH * 128) + ks * 32));
      }
      ptx::wgmma_commit();
      ptx::wgmma_wait<1>();
    } else {
#pragma unroll
      for (int ks = 0; ks < 4; ++ks) {
        if constexpr (FORM == kNoDeq) {
          a[ks][0] = words[ks];
          a[ks][1] = words[ks] << 1;
          a[ks][2] = words[ks] << 2;
          a[ks][3] = words[ks] << 3;
        } else {
          kernels::detail::dequant_a_fragment(words[ks], kernels::detail::scale_pair(scales, ks), a[ks]);
        }
        kernels::sm90::fence_registers(a[ks]);
      }
      if constexpr (FORM == kNoMma) {
#pragma unroll
        for (int ks = 0; ks < 4; ++ks) acc[ks] += __uint_as_float(a[ks][0] ^ a[ks][1] ^ a[ks][2] ^ a[ks][3]);
      } else {
        kernels::sm90::fence_registers(acc);
        ptx::wgmma_fence();
#pragma unroll
        for (int ks = 0; ks < 4; ++ks)
          ptx::Wgmma<WIDTH>::mma(acc, a[ks], ptx::smem_desc_advance(desc, kf * (WIDTH * 128) + ks * 32));
        ptx::wgmma_commit();
        ptx::wgmma_wait<FORM == kDeep ? 2 : 1>();
      }
    }
  };
  for (int it = 0; it < kRunFragments<WGS, FORM> / MY_FRAGS; it += SPB) {
#pragma unroll
    for (int s = 0; s < SPB; ++s) {
      const int stage = (it + s) % kStages;
      ptx::fence_proxy_async_shared();
      uint4 codes[MY_FRAGS];
      uint2 scales[MY_FRAGS];
#pragma unroll
      for (int f = 0; f < MY_FRAGS; ++f) {
        const int kf = kf0 + f;
        codes[f] = *reinterpret_cast<const uint4*>(s_weights + stage * kWeightStage + kf * (8 * kFragBytes) +
                                                   group * kFragBytes + lane * 16);
        scales[f] = *reinterpret_cast<const uint2*>(s_scales + stage * kScaleStage + kf * (8 * kFragScaleBytes) +
                                                    group * kFragScaleBytes + lane / 4 * 8);
      }
#pragma unroll
      for (int f = 0; f < MY_FRAGS; ++f) {
        fragment(stage, kf0 + f, codes[f], scales[f]);
        if constexpr (FORM == kArrive || FORM == kWarpArrive) {
          const uint32_t bar =
              f == MY_FRAGS - 1 ? bars + 8 * stage : bars + 8 * (kStages + (stage + kStages - 1) % kStages);
          if (f == MY_FRAGS - 1 || f == 0) {
            if constexpr (FORM == kWarpArrive) {
              __syncwarp();
              if (lane == 0) ptx::mbarrier_arrive(bar);
            } else {
              ptx::mbarrier_arrive(bar);
            }
          }
        }
      }
    }
  }
  ptx::wgmma_wait<0>();
  kernels::sm90::fence_registers(acc);
  __syncthreads();
  const long long end = clock64();
  if (tid == 0) cycles[blockIdx.x] = end - start;
  if (never) {
    float s = 0.0f;
#pragma unroll
    for (int i = 0; i < WIDTH / 2; ++i) s += acc[i];
    sink[blockIdx.x * blockDim.x + tid] = s;
  }
}

template <int WGS, int WIDTH, Form FORM>
void run(const char* name, int sms, long long* d_cycles, float* d_sink) {
  auto kernel = consumer_loop<WGS, WIDTH, FORM>;
  constexpr int bytes = kSmemBytes<WIDTH>;
  cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  std::vector<long long> best;
  for (int rep = 0; rep < 3; ++rep) {
    kernel<<<sms, WGS * 128, bytes>>>(d_cycles, d_sink, 0);
    if (cudaError_t e = cudaDeviceSynchronize(); e != cudaSuccess) {
      std::printf("%s %d %d error %s\n", name, WGS, WIDTH, cudaGetErrorString(e));
      return;
    }
    std::vector<long long> c(sms);
    cudaMemcpy(c.data(), d_cycles, sms * sizeof(long long), cudaMemcpyDeviceToHost);
    std::sort(c.begin(), c.end());
    best.push_back(c[sms / 2]);
  }
  std::sort(best.begin(), best.end());
  const double cycles = static_cast<double>(best[0]);
  // Weight fragments of 64 rows x 64 k the block finished: WGS x kFragments.
  const double per_fragment = cycles / kRunFragments<WGS, FORM>;  // cycles per fragment of one warpgroup
  const double weights = static_cast<double>(WGS) * kRunFragments<WGS, FORM> * 64 * 64;
  const double macs = weights * WIDTH;
  std::printf("%-6s %d %4d %8.1f %7.2f %6.3f\n", name, WGS, WIDTH, per_fragment, weights / cycles,
              macs / cycles / 2048.0);
}

template <int WGS, int WIDTH>
void run_forms(int sms, long long* c, float* s) {
  run<WGS, WIDTH, kFull>("full", sms, c, s);
  run<WGS, WIDTH, kNoDeq>("nodeq", sms, c, s);
  run<WGS, WIDTH, kNoMma>("nomma", sms, c, s);
  run<WGS, WIDTH, kSplit>("split", sms, c, s);
  run<WGS, WIDTH, kDeep>("deep", sms, c, s);
  run<WGS, WIDTH, kArrive>("arrive", sms, c, s);
  run<WGS, WIDTH, kWarpArrive>("warpar", sms, c, s);
}

}  // namespace

int main() {
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  cudaDeviceProp prop{};
  cudaGetDeviceProperties(&prop, 0);
  std::printf("# %s, %d SMs; form warpgroups width cycles_per_fragment weights_per_cycle_per_sm tensor_share\n",
              prop.name, sms);
  long long* d_cycles = nullptr;
  float* d_sink = nullptr;
  cudaMalloc(&d_cycles, sms * sizeof(long long));
  cudaMalloc(&d_sink, sms * 512 * sizeof(float));
  run_forms<2, 64>(sms, d_cycles, d_sink);
  run_forms<3, 64>(sms, d_cycles, d_sink);
  run_forms<4, 64>(sms, d_cycles, d_sink);
  run_forms<2, 96>(sms, d_cycles, d_sink);
  run_forms<4, 96>(sms, d_cycles, d_sink);
  run_forms<2, 128>(sms, d_cycles, d_sink);
  run_forms<4, 128>(sms, d_cycles, d_sink);
  return 0;
}
