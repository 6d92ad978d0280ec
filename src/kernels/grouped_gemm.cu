// Host side of the grouped GEMM, both kernel families: the compiled kernel
// table (from the X-macros in plan/compiled_configs.hpp), input validation,
// planning for the local GPU, workspace sizing and the launch.
// Tested in tests/kernels/test_grouped_gemm.cpp.
#include <cuda.h>
#include <cudaTypedefs.h>

#include <algorithm>
#include <cstdlib>
#include <limits>
#include <map>
#include <mutex>
#include <sstream>
#include <utility>

#include "fp4moe/cuda_check.hpp"
#include "kernels/grouped_gemm.hpp"
#include "kernels/device_info.hpp"
#include "kernels/kernel_table.hpp"
#include "kernels/launch.cuh"
#include "kernels/portable_grouped_gemm.cuh"
#include "plan/compiled_configs.hpp"
#include "plan/planner.hpp"

namespace fp4moe {

namespace {

using KernelEntry = kernels::GroupedGemmKernel;

const std::vector<KernelEntry>& kernel_table() {
  static const std::vector<KernelEntry> table = [] {
    std::vector<KernelEntry> entries = {
#define FP4MOE_X(BN, BM, BK, S, W, EPI)                           \
  {TileConfig{BN, BM, BK, S, W, EPI, KernelFamily::kPortable},    \
   &kernels::portable_grouped_gemm_kernel<BN, BM, BK, S, W, EPI>, \
   portable_smem_layout(BN, BM, BK, S, EPI).total_bytes},
        FP4MOE_PORTABLE_KERNELS(FP4MOE_X)
#undef FP4MOE_X
    };
    const auto& sm90 = kernels::sm90_kernels();
    entries.insert(entries.end(), sm90.begin(), sm90.end());
    return entries;
  }();
  return table;
}

const KernelEntry& find_kernel(const TileConfig& config) {
  for (const auto& entry : kernel_table())
    if (entry.config == config) return entry;
  std::string compiled;
  for (const auto& entry : kernel_table()) compiled += (compiled.empty() ? "" : ", ") + entry.config.to_string();
  FP4MOE_THROW("tile config ", config.to_string(), " is not compiled into this build; compiled: ", compiled);
}

using kernels::current_device;
using kernels::DeviceInfo;

// Raises a kernel's dynamic shared-memory limit to the model's size (once
// per device and kernel) and returns its resident blocks per SM.
int occupancy(const void* fn, int threads, int64_t smem_bytes, int device) {
  static std::mutex mutex;
  static std::map<std::pair<int, const void*>, int> cache;
  std::lock_guard<std::mutex> lock(mutex);
  const auto key = std::make_pair(device, fn);
  auto it = cache.find(key);
  if (it != cache.end()) return it->second;
  FP4MOE_CUDA_CHECK(
      cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem_bytes)));
  int blocks = 0;
  FP4MOE_CUDA_CHECK(
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, fn, threads, static_cast<size_t>(smem_bytes)));
  cache.emplace(key, blocks);
  return blocks;
}
int occupancy(const KernelEntry& entry, int device) {
  return occupancy(reinterpret_cast<const void*>(entry.fn), entry.config.warps * 32, entry.smem_bytes, device);
}

void check_fits_device(const KernelEntry& entry, const DeviceInfo& dev) {
  kernels::check_fits_device(entry.config, entry.smem_bytes, dev);
}

GemmProblem problem_of(const GroupedGemmArgs& a, Epilogue epilogue) {
  GemmProblem p;
  p.num_experts = a.num_experts;
  p.n = a.n;
  p.k = a.k;
  p.num_rows = a.num_rows;
  p.expected_active_experts = a.expected_active_experts;
  p.epilogue = epilogue;
  return p;
}

size_t align16(size_t v) { return (v + 15) / 16 * 16; }

bool aligned16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

// The driver's cuTensorMapEncodeTiled, through the runtime (no link against
// libcuda); null where the driver lacks it. FP4MOE_SM90_TMA=0 also gives
// null: the SM90 kernel then copies contiguous activations with cp.async as
// it does gathered ones (for comparing the two paths).
PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static const PFN_cuTensorMapEncodeTiled_v12000 encode = [] {
    const char* env = std::getenv("FP4MOE_SM90_TMA");
    if (env != nullptr && std::string(env) == "0") return PFN_cuTensorMapEncodeTiled_v12000{nullptr};
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &found) !=
            cudaSuccess ||
        found != cudaDriverEntryPointSuccess) {
      cudaGetLastError();
      fn = nullptr;
    }
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
  }();
  return encode;
}

// SM90 family: x ([x_rows, k] bf16, not gathered) as the tensor map the
// kernel's producer copies activation boxes with (GroupedGemmParams::x_map).
// False (cp.async instead) for tiles under kSm90TensorMapMinBlockM tokens and
// where a map cannot describe x: no encoder, a row pitch that is not a
// multiple of 16 bytes, a pointer not 16-byte aligned.
bool encode_activation_map(const kernels::GroupedGemmParams& p, const TileConfig& config, CUtensorMap* map) {
  const PFN_cuTensorMapEncodeTiled_v12000 encode = tensor_map_encoder();
  if (config.block_m < kSm90TensorMapMinBlockM || encode == nullptr || p.gather_rows != nullptr || p.k % 8 != 0 ||
      !aligned16(p.x) || p.x_rows < 1)
    return false;
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(p.k), static_cast<cuuint64_t>(p.x_rows)};
  const cuuint64_t row_pitch[1] = {static_cast<cuuint64_t>(p.k) * 2};
  const cuuint32_t box[2] = {
      static_cast<cuuint32_t>(kFragK),
      static_cast<cuuint32_t>(sm90_mma_width_step(config.block_m, sm90_smem_layout(config).blocks_per_sm))};
  const cuuint32_t element_strides[2] = {1, 1};
  const CUresult result =
      encode(map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, const_cast<__nv_bfloat16*>(p.x), dims, row_pitch, box,
             element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
             CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  FP4MOE_CHECK(result == CUDA_SUCCESS, "grouped_gemm: cuTensorMapEncodeTiled failed (CUresult ",
               static_cast<int>(result), ") for x [", p.x_rows, ", ", p.k, "] at ", static_cast<const void*>(p.x));
  return true;
}

// `for_launch`: also check what only the launch needs (the workspace).
void validate_args(const GroupedGemmArgs& a, bool for_launch, Epilogue epilogue) {
  FP4MOE_CHECK(a.num_experts >= 1 && a.num_experts <= kMaxExperts, "grouped_gemm: num_experts = ", a.num_experts,
               "; expected 1..", kMaxExperts);
  FP4MOE_CHECK(a.n >= 16 && a.n % 16 == 0, "grouped_gemm: n = ", a.n, "; expected a positive multiple of 16");
  FP4MOE_CHECK(a.k >= 16 && a.k % 16 == 0, "grouped_gemm: k = ", a.k,
               "; expected a positive multiple of 16 (the NVFP4 block size)");
  FP4MOE_CHECK(a.num_rows >= 0 && a.num_rows < (int64_t{1} << 31), "grouped_gemm: num_rows = ", a.num_rows,
               "; expected 0..2^31-1");
  // The kernels index n, k and their padded sizes with int.
  constexpr int64_t kMaxDim = (int64_t{1} << 31) - layout::kPadK;
  FP4MOE_CHECK(a.n <= kMaxDim && a.k <= kMaxDim, "grouped_gemm: n = ", a.n, ", k = ", a.k, "; expected each at most ",
               kMaxDim, " (32-bit indexing)");
  FP4MOE_CHECK(a.n * a.k < (int64_t{1} << 40), "grouped_gemm: n * k = ", a.n * a.k, " per expert; expected < 2^40");
  if (a.num_rows == 0) return;
  const std::pair<const void*, const char*> required[] = {{a.weights, "weights"},
                                                          {a.scales, "scales"},
                                                          {a.global_scales, "global_scales"},
                                                          {a.x, "x"},
                                                          {a.expert_offsets, "expert_offsets"}};
  for (const auto& [ptr, name] : required)
    FP4MOE_CHECK(ptr != nullptr, "grouped_gemm: ", name, " is null but num_rows = ", a.num_rows);
  FP4MOE_CHECK(a.gather_rows == nullptr || a.x_rows >= 1, "grouped_gemm: gather_rows given but x_rows = ", a.x_rows,
               "; expected the number of rows of x");
  FP4MOE_CHECK(a.x_rows < (int64_t{1} << 31), "grouped_gemm: x_rows = ", a.x_rows, "; expected < 2^31");
  FP4MOE_CHECK(!for_launch || a.workspace != nullptr, "grouped_gemm: workspace is null but num_rows = ", a.num_rows);
  // Fixed storage: this runs on every launch.
  std::pair<const void*, const char*> vectors[5] = {{a.weights, "weights"}, {a.scales, "scales"}, {a.x, "x"}};
  int num_vectors = 3;
  if (epilogue == Epilogue::kFinalize) {
    FP4MOE_CHECK(a.scatter_rows != nullptr, "grouped_gemm: the finalize epilogue needs scatter_rows");
    if (a.atomic_out)
      FP4MOE_CHECK(a.out_f32 != nullptr && a.out_bf16 == nullptr,
                   "grouped_gemm: the atomic finalize epilogue adds into out_f32 (fp32 [out_rows, n]); out_f32 = ",
                   static_cast<const void*>(a.out_f32), ", out_bf16 = ", a.out_bf16,
                   "; expected out_f32 set and out_bf16 null");
    else
      FP4MOE_CHECK(a.out_bf16 != nullptr && a.out_f32 == nullptr,
                   "grouped_gemm: the finalize epilogue without atomic_out stores bf16 rows into out_bf16 (bf16 "
                   "[out_rows, n]); out_bf16 = ",
                   a.out_bf16, ", out_f32 = ", static_cast<const void*>(a.out_f32),
                   "; expected out_bf16 set and out_f32 null");
    FP4MOE_CHECK(a.out_row_divisor >= 1 && a.out_rows >= 1 && a.out_rows < (int64_t{1} << 31),
                 "grouped_gemm: finalize out_rows = ", a.out_rows, ", out_row_divisor = ", a.out_row_divisor,
                 "; expected both >= 1 and out_rows < 2^31");
    if (a.atomic_out)
      vectors[num_vectors++] = {a.out_f32, "out_f32"};
    else
      vectors[num_vectors++] = {a.out_bf16, "out_bf16"};
    if (a.bias) vectors[num_vectors++] = {a.bias, "bias"};
  } else {
    FP4MOE_CHECK(a.y != nullptr, "grouped_gemm: y is null but num_rows = ", a.num_rows);
    vectors[num_vectors++] = {a.y, "y"};
  }
  FP4MOE_CHECK(epilogue == Epilogue::kSwiglu || a.up_global_scales == nullptr,
               "grouped_gemm: up_global_scales is only applied by the swiglu epilogue");
  FP4MOE_CHECK(epilogue == Epilogue::kSwiglu || a.act_quant_scales == nullptr,
               "grouped_gemm: act_quant_scales (fp4 output) is only applied by the swiglu epilogue");
  FP4MOE_CHECK(epilogue != Epilogue::kNone || a.bias == nullptr,
               "grouped_gemm: bias is only applied by the swiglu and finalize epilogues");
  for (int i = 0; i < num_vectors; ++i)
    FP4MOE_CHECK(aligned16(vectors[i].first), "grouped_gemm: ", vectors[i].second, " = ", vectors[i].first,
                 " is not 16-byte aligned (the kernel uses 16-byte loads and stores)");
  if (a.host_expert_offsets) {
    const int32_t* off = a.host_expert_offsets;
    FP4MOE_CHECK(off[0] == 0, "grouped_gemm: expert_offsets[0] = ", off[0], "; expected 0");
    for (int64_t e = 0; e < a.num_experts; ++e)
      FP4MOE_CHECK(off[e + 1] >= off[e], "grouped_gemm: expert_offsets not monotone: offsets[", e + 1,
                   "] = ", off[e + 1], " < offsets[", e, "] = ", off[e]);
    FP4MOE_CHECK(off[a.num_experts] == a.num_rows, "grouped_gemm: expert_offsets[", a.num_experts,
                 "] = ", off[a.num_experts], "; expected num_rows = ", a.num_rows);
  }
}

// The kernel's parameters for a launch of `plan` (split-K and row-class
// fields are the launch's), after the workspace checks; args validated.
kernels::GroupedGemmParams launch_params(const GroupedGemmArgs& args, const GemmPlan& plan) {
  const size_t workspace_needed = grouped_gemm_workspace_bytes(plan);
  FP4MOE_CHECK(args.workspace_bytes >= workspace_needed, "grouped_gemm: workspace of ", args.workspace_bytes,
               " B; this plan needs ", workspace_needed, " B");
  FP4MOE_CHECK(reinterpret_cast<uintptr_t>(args.workspace) % 16 == 0, "grouped_gemm: workspace is not 16-byte aligned");

  kernels::GroupedGemmParams p{};
  p.weights = args.weights;
  p.scales = args.scales;
  p.global_scales = args.global_scales;
  p.up_global_scales = args.up_global_scales;
  p.act_quant_scales = args.act_quant_scales;
  p.x = static_cast<const __nv_bfloat16*>(args.x);
  p.gather_rows = args.gather_rows;
  p.x_rows = static_cast<int>(args.gather_rows ? args.x_rows : args.num_rows);
  p.expert_offsets = args.expert_offsets;
  p.y = static_cast<__nv_bfloat16*>(args.y);
  p.bias = args.bias;
  p.activation = args.activation == Activation::kGptOss ? kernels::kActGptOss : kernels::kActSwiglu;
  p.scatter_rows = args.scatter_rows;
  p.row_weights = args.row_weights;
  if (args.atomic_out)
    p.out_f32 = args.out_f32;
  else
    p.out_bf16 = static_cast<__nv_bfloat16*>(args.out_bf16);
  p.out_rows = static_cast<int>(args.out_rows);
  p.out_row_divisor = args.out_row_divisor;
  p.atomic_out = args.atomic_out ? 1 : 0;
  auto* ws = static_cast<uint8_t*>(args.workspace);
  p.error_flags = args.error_flags ? args.error_flags : reinterpret_cast<int32_t*>(ws);
  p.tile_counters = reinterpret_cast<int32_t*>(ws + 16);
  if (args.split_counters) {
    FP4MOE_CHECK(plan.split_k == 1 || args.split_counters_capacity >= plan.max_tiles,
                 "grouped_gemm: split_counters hold ", args.split_counters_capacity, " tiles; this plan needs ",
                 plan.max_tiles);
    p.tile_counters = args.split_counters;
  }
  p.partials = reinterpret_cast<float*>(ws + 16 + align16(static_cast<size_t>(plan.max_tiles) * sizeof(int32_t)));
  p.num_experts = static_cast<int>(args.num_experts);
  p.n = static_cast<int>(args.n);
  p.k = static_cast<int>(args.k);
  p.n_groups = static_cast<int>((args.n + layout::kPadN - 1) / layout::kPadN * layout::kPadN / 16);
  p.k_frags = static_cast<int>((args.k + layout::kPadK - 1) / layout::kPadK * layout::kPadK / 64);
  p.num_rows = static_cast<int>(args.num_rows);
  p.early_weights = args.programmatic_launch && args.indices_before_previous_kernel ? 1 : 0;

  return p;
}

}  // namespace

GemmPlan plan_grouped_gemm(const GroupedGemmArgs& args, const std::optional<TileConfig>& forced, Epilogue epilogue) {
  validate_args(args, /*for_launch=*/false, epilogue);
  return plan_grouped_gemm(problem_of(args, epilogue), forced);
}

GemmPlan plan_grouped_gemm(const GemmProblem& problem, const std::optional<TileConfig>& forced, int split_k) {
  FP4MOE_CHECK(forced || split_k == 0, "plan_grouped_gemm: split_k = ", split_k,
               " without a config; a split is forced together with its config");
  const DeviceInfo dev = current_device();
  if (forced) {
    TileConfig config = *forced;
    config.epilogue = problem.epilogue;
    const KernelEntry& entry = find_kernel(config);
    check_fits_device(entry, dev);
    return plan_gemm_with(problem, config, dev.num_sms, occupancy(entry, dev.device), split_k);
  }
  const GemmPlan first = plan_gemm(problem, dev.smem_per_block, dev.num_sms, kernels::compute_capability(dev));
  const KernelEntry& entry = find_kernel(first.config);
  GemmPlan plan = plan_gemm_with(problem, first.config, dev.num_sms, occupancy(entry, dev.device));
  for (const GemmPlan::RowClass& stage : first.row_classes)
    plan = with_row_class(plan, problem, stage.config, stage.max_rows);
  return plan;
}

size_t grouped_gemm_workspace_bytes(const GemmPlan& plan) {
  size_t bytes = 16;  // error flags
  if (plan.split_k > 1) {
    bytes += align16(static_cast<size_t>(plan.max_tiles) * sizeof(int32_t));
    bytes +=
        static_cast<size_t>(plan.max_tiles) * plan.split_k * plan.config.block_n * plan.config.block_m * sizeof(float);
  }
  return bytes;
}

void grouped_gemm(const GroupedGemmArgs& args, const GemmPlan& plan, cudaStream_t stream) {
  const Epilogue epilogue = plan.config.epilogue;
  validate_args(args, /*for_launch=*/true, epilogue);
  const KernelEntry& entry = find_kernel(plan.config);
  const DeviceInfo dev = current_device();
  check_fits_device(entry, dev);
  const int64_t tiles_needed = max_tiles(problem_of(args, epilogue), plan.config);
  FP4MOE_CHECK(plan.max_tiles >= tiles_needed, "grouped_gemm: the plan covers ", plan.max_tiles, " tiles but ",
               args.num_rows, " rows may need ", tiles_needed, "; plan again for this problem");
  for (const GemmPlan::RowClass& stage : plan.row_classes) {
    FP4MOE_CHECK(stage.config.epilogue == epilogue, "grouped_gemm: the row class config ", stage.config.to_string(),
                 " has another epilogue than ", plan.config.to_string());
    check_fits_device(find_kernel(stage.config), dev);
    const int64_t needed = max_tiles(problem_of(args, epilogue), stage.config);
    FP4MOE_CHECK(stage.max_tiles >= needed, "grouped_gemm: the plan's ", stage.config.to_string(), " stage covers ",
                 stage.max_tiles, " tiles but ", args.num_rows, " rows may need ", needed,
                 "; plan again for this problem");
  }
  FP4MOE_CHECK(plan.split_k >= 1 && plan.split_k <= 64, "grouped_gemm: split_k = ", plan.split_k);
  if (args.num_rows == 0) return;
  const kernels::GroupedGemmParams p = launch_params(args, plan);

  // One launch over the experts whose rows lie in [min_rows, max_rows].
  const auto launch = [&](const TileConfig& config, int split_k, int64_t tiles, int min_rows, int max_rows) {
    const KernelEntry& e = find_kernel(config);
    kernels::GroupedGemmParams q = p;
    q.split_k = split_k;
    q.min_expert_rows = min_rows;
    q.max_expert_rows = max_rows;
    q.x_map_valid = config.family == KernelFamily::kSm90 && encode_activation_map(q, config, &q.x_map);
    const int blocks_per_sm = std::max(1, occupancy(e, dev.device));
    const int grid = static_cast<int>(std::min<int64_t>(tiles * split_k, int64_t{dev.num_sms} * blocks_per_sm));
    if (grid == 0) return;
    kernels::launch_kernel(e.fn, grid, e.config.warps * 32, static_cast<size_t>(e.smem_bytes), stream,
                           args.programmatic_launch, q);
  };
  // The row classes in order, then the main config over the experts above
  // the last (each launch waits for the one before: programmatic launches
  // wait for their predecessor's grid).
  int min_rows = 0;
  for (const GemmPlan::RowClass& stage : plan.row_classes) {
    launch(stage.config, 1, stage.max_tiles, min_rows, stage.max_rows);
    min_rows = stage.max_rows + 1;
  }
  launch(plan.config, plan.split_k, plan.max_tiles, min_rows, std::numeric_limits<int32_t>::max());
}

std::string grouped_gemm_device_errors(const void* workspace, cudaStream_t stream) {
  FP4MOE_CHECK(workspace != nullptr, "grouped_gemm_device_errors: workspace is null");
  int32_t flags = 0;
  FP4MOE_CUDA_CHECK(cudaMemcpyAsync(&flags, workspace, sizeof flags, cudaMemcpyDeviceToHost, stream));
  FP4MOE_CUDA_CHECK(cudaStreamSynchronize(stream));
  std::string out;
  if (flags & kernels::kErrorOffsetsNotMonotone) out += "expert_offsets not monotone; ";
  if (flags & kernels::kErrorOffsetsOutOfRange) out += "expert_offsets outside [0, num_rows]; ";
  if (flags & kernels::kErrorGatherRowOutOfRange) out += "gather or scatter rows out of range; ";
  if (flags & kernels::kErrorSmemMisaligned)
    out += "dynamic shared memory not 1024-byte aligned (the SM90 kernel computed nothing); ";
  return out;
}

KernelAttributes grouped_gemm_kernel_attributes(const TileConfig& config) {
  const KernelEntry& entry = find_kernel(config);
  const DeviceInfo dev = current_device();
  check_fits_device(entry, dev);
  KernelAttributes out;
  out.blocks_per_sm = occupancy(entry, dev.device);  // also sets the dynamic limit
  cudaFuncAttributes attr{};
  FP4MOE_CUDA_CHECK(cudaFuncGetAttributes(&attr, entry.fn));
  out.static_smem_bytes = static_cast<int64_t>(attr.sharedSizeBytes);
  out.max_dynamic_smem_bytes = attr.maxDynamicSharedSizeBytes;
  out.num_regs = attr.numRegs;
  out.local_bytes = static_cast<int64_t>(attr.localSizeBytes);
  return out;
}

namespace kernels {

void check_fits_device(const TileConfig& config, int64_t smem_bytes, const DeviceInfo& dev) {
  FP4MOE_CHECK(family_runs_on(config.family, compute_capability(dev)), "tile config ", config.to_string(),
               " is of the ", to_string(config.family), " family, which needs ",
               config.family == KernelFamily::kSm90 ? "an SM90 GPU (H100/H200, compute capability 9.0)"
                                                    : "compute capability 8.0 or newer",
               "; this GPU has compute capability ", dev.cc_major, ".", dev.cc_minor);
  // The kernel's size is the model's (kernel_table()); the breakdown is
  // built only for the refusal, so a launch does no string work.
  if (smem_bytes > dev.smem_per_block)
    FP4MOE_THROW("tile config ", config.to_string(), " needs ", smem_bytes,
                 " B of shared memory per block but this GPU allows ", dev.smem_per_block, " B:\n",
                 format_layout(config, dev.smem_per_block));
}

GroupedGemmParams checked_launch_params(const GroupedGemmArgs& args, const GemmPlan& plan) {
  validate_args(args, /*for_launch=*/true, plan.config.epilogue);
  return launch_params(args, plan);
}

int resident_blocks(const void* fn, int threads, int64_t smem_bytes, int device) {
  return occupancy(fn, threads, smem_bytes, device);
}

}  // namespace kernels

bool local_arch_limits(ArchLimits* limits, std::string* device_name) {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    cudaGetLastError();  // clear the sticky "no device" error
    return false;
  }
  int device = 0;
  FP4MOE_CUDA_CHECK(cudaGetDevice(&device));
  cudaDeviceProp prop{};
  FP4MOE_CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
  limits->name = "sm" + std::to_string(prop.major * 10 + prop.minor);
  limits->compute_capability = prop.major * 10 + prop.minor;
  limits->smem_per_block = static_cast<int64_t>(prop.sharedMemPerBlockOptin);
  limits->smem_per_sm = static_cast<int64_t>(prop.sharedMemPerMultiprocessor);
  limits->smem_reserved_per_block = static_cast<int64_t>(prop.reservedSharedMemPerBlock);
  if (device_name) *device_name = prop.name;
  return true;
}

}  // namespace fp4moe
