// MoeLayer's construction (include/fp4moe/moe_layer.hpp): prepare() packs
// host weights and uploads them, prepare_device() repacks weights already on
// the GPU by kernels (the same bytes), load() reads a checkpoint first; both
// check everything (src/layer/weights.cpp) before any allocation, and fold
// W4A4's input scales into the epilogues' global scales. Also the layer's
// accessors. Tested in tests/layer/test_moe_layer_weights.cpp (GPU),
// test_moe_layer_w4a4.cpp (GPU) and test_moe_layer_args.cpp.
#include "fp4moe/moe_layer.hpp"

#include <cmath>
#include <memory>
#include <utility>
#include <vector>

#include "fp4moe/cuda_check.hpp"
#include "fp4moe/error.hpp"
#include "fp4moe/modelopt.hpp"
#include "fp4moe/reference.hpp"
#include "kernels/grouped_gemm.hpp"
#include "kernels/prepare_device.hpp"
#include "layer/layer_impl.hpp"
#include "util/parallel.hpp"

namespace fp4moe {

namespace {

layer::DeviceGemmWeights upload(const PreparedGemmWeights& p) {
  layer::DeviceGemmWeights d;
  d.weights = DeviceBuffer<uint8_t>(p.weights);
  d.scales = DeviceBuffer<uint8_t>(p.scales);
  d.global_scales = DeviceBuffer<float>(p.global_scales);
  return d;
}

// Throws unless `ptr` is device (or managed) memory of device `device`.
void check_device_pointer(const void* ptr, int device, const char* name) {
  FP4MOE_CHECK(ptr != nullptr, "MoeLayer::prepare_device: ", name, " is null");
  cudaPointerAttributes attr{};
  FP4MOE_CUDA_CHECK(cudaPointerGetAttributes(&attr, ptr));
  FP4MOE_CHECK(attr.type == cudaMemoryTypeDevice || attr.type == cudaMemoryTypeManaged,
               "MoeLayer::prepare_device: ", name, " is not GPU memory");
  FP4MOE_CHECK(attr.device == device, "MoeLayer::prepare_device: ", name, " is on GPU ", attr.device,
               " but the current device is GPU ", device);
}

std::vector<float> download_floats(const float* device_ptr, size_t count, cudaStream_t stream) {
  std::vector<float> host(count);
  FP4MOE_CUDA_CHECK(cudaMemcpyAsync(host.data(), device_ptr, count * sizeof(float), cudaMemcpyDeviceToHost, stream));
  FP4MOE_CUDA_CHECK(cudaStreamSynchronize(stream));
  return host;
}

void check_finite(const std::vector<float>& values, const char* name, int per_expert) {
  for (size_t i = 0; i < values.size(); ++i)
    FP4MOE_CHECK(std::isfinite(values[i]), "MoeLayer::prepare_device: ", name, "[", i / per_expert,
                 per_expert > 1 ? (i % 2 ? ", 1" : ", 0") : "", "] is ", values[i],
                 "; expected a finite weight_scale_2");
}

}  // namespace

MoeLayer::MoeLayer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
MoeLayer::MoeLayer(MoeLayer&&) noexcept = default;
MoeLayer& MoeLayer::operator=(MoeLayer&&) noexcept = default;
MoeLayer::~MoeLayer() = default;

MoeLayer MoeLayer::prepare(const MoeWeights& weights, const MoeLayerOptions& options) {
  return MoeLayerInternals::prepare(weights, options, GatherMode::kAuto);
}

MoeLayer MoeLayerInternals::prepare(const MoeWeights& weights, const MoeLayerOptions& options, GatherMode gather) {
  layer::validate_weights(weights, options);
  auto impl = std::make_unique<MoeLayer::Impl>();
  impl->num_shared = layer::shared_chunks(weights, options);
  impl->gather = gather;
  impl->num_experts = weights.num_experts;
  impl->hidden = weights.hidden;
  impl->inter = weights.inter;
  impl->top_k = options.routing.top_k;
  impl->has_bias = weights.has_bias();
  impl->options = options;
  // The experts of the GEMMs: the routed ones, then the shared expert's
  // chunks.
  std::vector<ExpertWeights> chunks;
  for (int j = 0; j < impl->num_shared; ++j)
    chunks.push_back(layer::shared_chunk(*weights.shared_expert, weights.inter, j));
  std::vector<const ExpertWeights*> experts;
  for (const ExpertWeights& x : weights.experts) experts.push_back(&x);
  for (const ExpertWeights& x : chunks) experts.push_back(&x);
  const int64_t E = static_cast<int64_t>(experts.size());
  // Activation numerics, and for fp4 the per-expert input scales, checked
  // before any packing.
  impl->fp4_activations = resolve_activation_numerics(weights, options.activations) == ActivationNumerics::kFp4;
  std::vector<float> in13, in2;
  if (impl->fp4_activations) {
    for (int64_t e = 0; e < E; ++e) {
      const ExpertWeights& x = *experts[static_cast<size_t>(e)];
      in13.push_back(gemm1_input_scale(x));
      in2.push_back(x.down.input_scale);
      layer::check_input_scale(in13.back(), "MoeLayer: gate/up input_scale", e);
      layer::check_input_scale(in2.back(), "MoeLayer: down input_scale", e);
    }
  }
  // Both GEMMs are packed (and their scales checked) on the host before
  // anything is uploaded, so a bad checkpoint is refused without GPU work.
  PreparedGemmWeights packed13, packed2;
  {
    std::vector<Nvfp4Matrix> gate_up(static_cast<size_t>(E));
    parallel_for(E, [&](int64_t e) {
      const ExpertWeights& x = *experts[static_cast<size_t>(e)];
      gate_up[static_cast<size_t>(e)] = interleave_gate_up(x.gate, x.up);
    });
    std::vector<const Nvfp4Matrix*> ptrs;
    for (const auto& m : gate_up) ptrs.push_back(&m);
    packed13 = prepare_gemm_weights(ptrs);
  }
  {
    std::vector<const Nvfp4Matrix*> ptrs;
    for (const ExpertWeights* x : experts) ptrs.push_back(&x->down);
    packed2 = prepare_gemm_weights(ptrs);
  }
  // W4A4: the activations reach the GEMMs as e2m1 x e4m3, so their
  // input_scale joins weight_scale_2 in each epilogue's scale.
  if (impl->fp4_activations) {
    for (int64_t e = 0; e < E; ++e) {
      packed13.global_scales[static_cast<size_t>(e)] *= in13[static_cast<size_t>(e)];
      packed2.global_scales[static_cast<size_t>(e)] *= in2[static_cast<size_t>(e)];
    }
  }
  FP4MOE_CUDA_CHECK(cudaGetDevice(&impl->device));
  impl->w13 = upload(packed13);
  impl->w2 = upload(packed2);
  if (impl->fp4_activations) {
    impl->input_scales13 = DeviceBuffer<float>(in13);
    impl->input_scales2 = DeviceBuffer<float>(in2);
  }
  // Gate and up may carry different global scales (ModelOpt shares one;
  // other exporters need not): the SwiGLU epilogue then scales each its own.
  std::vector<float> up_scales;
  bool shared = true;
  for (const ExpertWeights* x : experts) {
    up_scales.push_back(x->up.global_scale * (impl->fp4_activations ? gemm1_input_scale(*x) : 1.0f));
    shared = shared && x->up.global_scale == x->gate.global_scale;
  }
  if (!shared) impl->w13_up_scales = DeviceBuffer<float>(up_scales);
  if (impl->num_shared > 0 && !weights.shared_expert->gate.empty())
    impl->shared_gate = DeviceBuffer<float>(weights.shared_expert->gate);
  if (impl->has_bias) {
    std::vector<float> b13, b2;
    for (const auto& x : weights.experts) {
      b13.insert(b13.end(), x.gate_bias.begin(), x.gate_bias.end());
      b13.insert(b13.end(), x.up_bias.begin(), x.up_bias.end());
      b2.insert(b2.end(), x.down_bias.begin(), x.down_bias.end());
    }
    impl->bias13 = DeviceBuffer<float>(b13);
    impl->bias2 = DeviceBuffer<float>(b2);
  }
  impl->load_tuned_choices();
  return MoeLayer(std::move(impl));
}

MoeLayer MoeLayer::prepare_device(const MoeDeviceWeights& w, const MoeLayerOptions& options, cudaStream_t stream) {
  layer::validate_shape(w.num_experts, w.hidden, w.inter, options);
  const int k = options.routing.top_k;
  FP4MOE_CHECK((w.w13_bias == nullptr) == (w.w2_bias == nullptr),
               "MoeLayer::prepare_device: give both w13_bias and w2_bias, or neither");
  int device = 0;
  FP4MOE_CUDA_CHECK(cudaGetDevice(&device));
  const std::pair<const void*, const char*> tensors[] = {
      {w.w13, "w13"}, {w.w13_scale, "w13_scale"}, {w.w13_scale_2, "w13_scale_2"},
      {w.w2, "w2"},   {w.w2_scale, "w2_scale"},   {w.w2_scale_2, "w2_scale_2"}};
  for (const auto& [ptr, name] : tensors) check_device_pointer(ptr, device, name);
  if (w.w13_bias) {
    check_device_pointer(w.w13_bias, device, "w13_bias");
    check_device_pointer(w.w2_bias, device, "w2_bias");
  }
  const bool fp4_activations = resolve_stacked_activation_numerics(
                                   options.activations, w.w13_input_scale != nullptr, w.w2_input_scale != nullptr,
                                   "MoeLayer::prepare_device") == ActivationNumerics::kFp4;
  if (w.w13_input_scale != nullptr) {
    check_device_pointer(w.w13_input_scale, device, "w13_input_scale");
    check_device_pointer(w.w2_input_scale, device, "w2_input_scale");
  }

  const int64_t E = w.num_experts;
  auto impl = std::make_unique<MoeLayer::Impl>();
  impl->device = device;
  impl->gather = GatherMode::kAuto;
  impl->num_experts = E;
  impl->hidden = w.hidden;
  impl->inter = w.inter;
  impl->top_k = k;
  impl->has_bias = w.w13_bias != nullptr;
  impl->options = options;

  // Global scales: few, checked on the host.
  const int halves = w.w13_scale_2_per_half ? 2 : 1;
  const std::vector<float> s13 = download_floats(w.w13_scale_2, static_cast<size_t>(E * halves), stream);
  const std::vector<float> s2 = download_floats(w.w2_scale_2, static_cast<size_t>(E), stream);
  check_finite(s13, "w13_scale_2", halves);
  check_finite(s2, "w2_scale_2", 1);
  std::vector<float> gate_scales(static_cast<size_t>(E)), up_scales(static_cast<size_t>(E));
  bool shared = true;
  for (int64_t e = 0; e < E; ++e) {
    gate_scales[static_cast<size_t>(e)] = s13[static_cast<size_t>(e * halves)];
    up_scales[static_cast<size_t>(e)] = s13[static_cast<size_t>(e * halves + halves - 1)];
    shared = shared && gate_scales[static_cast<size_t>(e)] == up_scales[static_cast<size_t>(e)];
  }
  // W4A4, as prepare(): the input scales join the epilogues' scales.
  std::vector<float> s2_epilogue = s2;
  impl->fp4_activations = fp4_activations;
  if (impl->fp4_activations) {
    // The engines' stacked forms as a checkpoint's per-matrix scales, then
    // GEMM1's per expert as prepare() takes it (gemm1_input_scale).
    const std::vector<ExpertInputScales> scales = stacked_input_scales(
        E,
        download_floats(w.w13_input_scale, static_cast<size_t>(input_scale_count(w.w13_input_scale_extent, E)), stream)
            .data(),
        w.w13_input_scale_extent,
        download_floats(w.w2_input_scale, static_cast<size_t>(input_scale_count(w.w2_input_scale_extent, E)), stream)
            .data(),
        w.w2_input_scale_extent, "MoeLayer::prepare_device");
    std::vector<float> in13(static_cast<size_t>(E)), in2(static_cast<size_t>(E));
    for (int64_t e = 0; e < E; ++e) {
      const auto i = static_cast<size_t>(e);
      in13[i] = gemm1_input_scale(scales[i].gate, scales[i].up);
      in2[i] = scales[i].down;
      gate_scales[i] *= in13[i];
      up_scales[i] *= in13[i];
      s2_epilogue[i] *= in2[i];
    }
    impl->input_scales13 = DeviceBuffer<float>(in13);
    impl->input_scales2 = DeviceBuffer<float>(in2);
  }

  const layout::StackedNvfp4 src13{w.w13, w.w13_scale, E, 2 * w.inter, w.hidden, /*gate_up=*/true};
  const layout::StackedNvfp4 src2{w.w2, w.w2_scale, E, w.hidden, w.inter, /*gate_up=*/false};
  DevicePackedGemm packed13 = prepare_gemm_weights_device(src13, "w13_scale", stream);
  DevicePackedGemm packed2 = prepare_gemm_weights_device(src2, "w2_scale", stream);
  impl->w13.weights = std::move(packed13.weights);
  impl->w13.scales = std::move(packed13.scales);
  impl->w13.global_scales = DeviceBuffer<float>(gate_scales);
  if (!shared) impl->w13_up_scales = DeviceBuffer<float>(up_scales);
  impl->w2.weights = std::move(packed2.weights);
  impl->w2.scales = std::move(packed2.scales);
  impl->w2.global_scales = DeviceBuffer<float>(s2_epilogue);
  if (impl->has_bias) {
    // The layer's bias layouts are the engines': [E][gate; up] and [E][H].
    impl->bias13 = DeviceBuffer<float>(static_cast<size_t>(E * 2 * w.inter));
    impl->bias2 = DeviceBuffer<float>(static_cast<size_t>(E * w.hidden));
    FP4MOE_CUDA_CHECK(
        cudaMemcpyAsync(impl->bias13.get(), w.w13_bias, impl->bias13.bytes(), cudaMemcpyDeviceToDevice, stream));
    FP4MOE_CUDA_CHECK(
        cudaMemcpyAsync(impl->bias2.get(), w.w2_bias, impl->bias2.bytes(), cudaMemcpyDeviceToDevice, stream));
  }
  // Complete on return, like prepare(): the caller may free its tensors.
  FP4MOE_CUDA_CHECK(cudaStreamSynchronize(stream));
  impl->load_tuned_choices();
  return MoeLayer(std::move(impl));
}

MoeLayer MoeLayer::load(const std::string& path, const std::string& prefix, const MoeLayerOptions& options) {
  return prepare(load_moe_weights(path, prefix), options);
}

int64_t MoeLayer::num_experts() const { return impl_->num_experts; }
int64_t MoeLayer::hidden() const { return impl_->hidden; }
int64_t MoeLayer::inter() const { return impl_->inter; }
int MoeLayer::top_k() const { return impl_->top_k; }
int MoeLayer::device() const { return impl_->device; }
size_t MoeLayer::cached_plans() const { return impl_->plans.size(); }
size_t MoeLayer::plan_cache_capacity() { return layer::kPlanCacheCapacity; }
const MoeLayerOptions& MoeLayer::options() const { return impl_->options; }
ActivationNumerics MoeLayer::activation_numerics() const {
  return impl_->fp4_activations ? ActivationNumerics::kFp4 : ActivationNumerics::kBf16;
}
size_t MoeLayer::device_weight_bytes() const {
  return impl_->w13.bytes() + impl_->w13_up_scales.bytes() + impl_->w2.bytes() + impl_->bias13.bytes() +
         impl_->bias2.bytes() + impl_->input_scales13.bytes() + impl_->input_scales2.bytes() +
         impl_->shared_gate.bytes();
}

}  // namespace fp4moe
