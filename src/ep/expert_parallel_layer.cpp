// ExpertParallelMoeLayer (include/fp4moe/expert_parallel_layer.hpp): the
// host plans of expert_parallel.hpp carried out with the NCCL helpers of
// nccl_util.hpp and the single-GPU layer's kernels. Row moves on the device
// use the layer's row gather (16-byte vectors of bf16: the hidden rows and
// the bf16 result rows alike); the final slot-order sum is the deterministic
// finalize kernel itself, which is what makes the result bit-identical to
// one GPU.
#include "fp4moe/expert_parallel_layer.hpp"

#include <cuda_runtime.h>

#include <utility>
#include <vector>

#include "ep/nccl_util.hpp"
#include "fp4moe/cuda_check.hpp"
#include "fp4moe/error.hpp"
#include "kernels/ops/moe_ops.hpp"
#include "util/device_buffer.hpp"

namespace fp4moe {
namespace {

static_assert(kSlotServedElsewhere == kernels::kAbsentSlot, "the wire format's absent slot is the layer's skipped id");

// CUDA events between the phases of a forward, created on first use.
class PhaseEvents {
 public:
  static constexpr int kCount = 6;  // start, then the end of each of the five phases
  PhaseEvents() = default;
  PhaseEvents(const PhaseEvents&) = delete;
  PhaseEvents& operator=(const PhaseEvents&) = delete;
  ~PhaseEvents() {
    for (cudaEvent_t e : events_)
      if (e) cudaEventDestroy(e);
  }
  void record(int i, cudaStream_t stream) {
    if (!events_[i]) FP4MOE_CUDA_CHECK(cudaEventCreate(&events_[i]));
    FP4MOE_CUDA_CHECK(cudaEventRecord(events_[i], stream));
  }
  // Milliseconds from event i - 1 to event i; waits for event i.
  double elapsed_ms(int i) const {
    FP4MOE_CUDA_CHECK(cudaEventSynchronize(events_[i]));
    float ms = 0.0f;
    FP4MOE_CUDA_CHECK(cudaEventElapsedTime(&ms, events_[i - 1], events_[i]));
    return ms;
  }

 private:
  cudaEvent_t events_[kCount] = {};
};

// Grows `buffer` to hold `host` and copies it there on `stream` (the call
// returns once the pageable bytes are staged).
template <typename T>
void upload_async(DeviceBuffer<T>& buffer, const std::vector<T>& host, cudaStream_t stream) {
  buffer.grow(host.size());
  buffer.upload(host, stream);
}

template <typename T>
void download(std::vector<T>& host, const T* device, size_t count, cudaStream_t stream) {
  host.resize(count);
  if (count > 0)
    FP4MOE_CUDA_CHECK(cudaMemcpyAsync(host.data(), device, count * sizeof(T), cudaMemcpyDeviceToHost, stream));
  FP4MOE_CUDA_CHECK(cudaStreamSynchronize(stream));
}

}  // namespace

struct ExpertParallelMoeLayer::Impl {
  ExpertPlacement placement;
  ncclComm_t comm = nullptr;
  int rank = 0;
  int64_t num_experts = 0, hidden = 0;
  int top_k = 0;
  RoutingParams routing;
  MoeLayer local;

  // Per-forward buffers, grown on demand (DeviceBuffer::grow) and kept.
  DeviceBuffer<int32_t> ids;                       // home routing [T, k] (router-logits forwards)
  DeviceBuffer<int32_t> route_errors;              // [1] the routing kernel's error bits
  DeviceBuffer<float> weights;                     //   and its weights [T, k]
  DeviceBuffer<int32_t> row_count;                 // {0, n}: the rows of the current gather
  DeviceBuffer<int32_t> send_token_idx;            // [S] home token of each sent row
  DeviceBuffer<uint16_t> send_hidden;              // bf16 [S, H]
  DeviceBuffer<int32_t> send_meta;                 // [S, W]
  DeviceBuffer<int64_t> counts_send, counts_recv;  // [P, kCountsMessageWords]
  DeviceBuffer<uint16_t> recv_hidden;              // bf16 [R, H]
  DeviceBuffer<int32_t> recv_meta;                 // [R, W]
  DeviceBuffer<int32_t> local_ids;                 // [R, k]
  DeviceBuffer<float> local_weights;               // [R, k]
  DeviceBuffer<uint8_t> workspace;                 // the local layer's
  DeviceBuffer<uint16_t> pair_rows;                // bf16 [R * k, H]
  DeviceBuffer<int32_t> return_idx;                // [Rp]
  DeviceBuffer<uint16_t> return_rows;              // bf16 [Rp, H]
  DeviceBuffer<uint16_t> returned;                 // bf16 [T * k, H] in rank order
  DeviceBuffer<int32_t> combine_idx;               // [T * k]
  DeviceBuffer<uint16_t> home_pair_rows;           // bf16 [T * k, H] in (token, slot) order
  PhaseEvents phases;

  Impl(ExpertPlacement p, ncclComm_t c, int r, MoeLayer layer)
      : placement(std::move(p)), comm(c), rank(r), local(std::move(layer)) {}

  // dst[i, :] = src[index[i], :] for rows of `row_bytes` (a multiple of 16),
  // the host-given index uploaded into index_buffer. Stream-ordered, so one
  // row-count buffer serves every gather.
  void gather(const void* src, const std::vector<int32_t>& index, DeviceBuffer<int32_t>& index_buffer,
              int64_t row_bytes, void* dst, cudaStream_t stream) {
    if (index.empty()) return;
    const auto n = static_cast<int64_t>(index.size());
    upload_async(index_buffer, index, stream);
    upload_async(row_count, std::vector<int32_t>{0, static_cast<int32_t>(n)}, stream);
    kernels::launch_gather_rows(src, index_buffer.get(), row_count.get(), 1, n, row_bytes / 2, dst, stream);
  }
};

ExpertParallelMoeLayer::ExpertParallelMoeLayer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
ExpertParallelMoeLayer::ExpertParallelMoeLayer(ExpertParallelMoeLayer&&) noexcept = default;
ExpertParallelMoeLayer& ExpertParallelMoeLayer::operator=(ExpertParallelMoeLayer&&) noexcept = default;
ExpertParallelMoeLayer::~ExpertParallelMoeLayer() = default;

int ExpertParallelMoeLayer::rank() const { return impl_->rank; }
const ExpertPlacement& ExpertParallelMoeLayer::placement() const { return impl_->placement; }
const MoeLayer& ExpertParallelMoeLayer::local_layer() const { return impl_->local; }
int64_t ExpertParallelMoeLayer::num_experts() const { return impl_->num_experts; }
int64_t ExpertParallelMoeLayer::hidden() const { return impl_->hidden; }
int ExpertParallelMoeLayer::top_k() const { return impl_->top_k; }

ExpertParallelMoeLayer ExpertParallelMoeLayer::prepare(const MoeWeights& weights, const ExpertPlacement& placement,
                                                       ncclComm_t comm, const MoeLayerOptions& options) {
  FP4MOE_CHECK(comm != nullptr, "ExpertParallelMoeLayer: the NCCL communicator is null");
  int comm_size = 0, rank = 0;
  FP4MOE_NCCL_CHECK(ncclCommCount(comm, &comm_size));
  FP4MOE_NCCL_CHECK(ncclCommUserRank(comm, &rank));
  FP4MOE_CHECK(comm_size == placement.num_ranks, "ExpertParallelMoeLayer: the communicator has ", comm_size,
               " ranks but the placement ", placement.num_ranks);
  FP4MOE_CHECK(placement.num_experts == weights.num_experts, "ExpertParallelMoeLayer: the placement is for ",
               placement.num_experts, " experts but the layer has ", weights.num_experts);
  FP4MOE_CHECK(options.finalize == FinalizeMode::kDeterministic,
               "ExpertParallelMoeLayer: needs FinalizeMode::kDeterministic (the home rank sums "
               "each token's rows in slot order)");
  // Refused rather than dropped: the ranks would need the shared expert's
  // rows too (each token's home rank could run them).
  FP4MOE_CHECK(!weights.shared_expert, "ExpertParallelMoeLayer: the layer has a shared expert (",
               weights.shared_expert ? weights.shared_expert->inter : 0,
               " wide), which the expert-parallel layer does not run; use MoeLayer on one GPU");
  FP4MOE_CHECK(weights.hidden % 8 == 0, "ExpertParallelMoeLayer: hidden = ", weights.hidden,
               "; expected a multiple of 8 (rows move as 16-byte vectors)");
  MoeWeights local;
  local.hidden = weights.hidden;
  local.inter = weights.inter;
  local.num_experts = placement.num_local_experts(rank);
  for (int64_t i = 0; i < local.num_experts; ++i)
    local.experts.push_back(weights.experts.at(static_cast<size_t>(placement.global_expert(rank, i))));
  MoeLayerOptions local_options = options;
  local_options.batch_invariant = true;
  // Resolved on the whole layer: every rank runs the same activation numerics.
  local_options.activations = resolve_activation_numerics(weights, options.activations);
  auto impl = std::make_unique<Impl>(placement, comm, rank, MoeLayer::prepare(local, local_options));
  impl->num_experts = weights.num_experts;
  impl->hidden = weights.hidden;
  impl->top_k = options.routing.top_k;
  impl->routing = options.routing;
  return ExpertParallelMoeLayer(std::move(impl));
}

ExpertParallelStats ExpertParallelMoeLayer::forward(const MoeForwardArgs& args, void* output, cudaStream_t stream,
                                                    ExpertParallelTimes* times) {
  Impl& m = *impl_;
  const int64_t T = args.num_tokens, H = m.hidden, P = m.placement.num_ranks;
  const int k = m.top_k;
  FP4MOE_CHECK(T >= 0 && T * k < (int64_t{1} << 31), "ExpertParallelMoeLayer::forward: num_tokens = ", T,
               "; expected 0 .. 2^31 / top_k");
  const bool device_routing = args.router_logits != nullptr;
  if (T > 0) {  // a rank without tokens still takes part, with nothing to give
    FP4MOE_CHECK(device_routing != (args.topk_ids != nullptr || args.topk_weights != nullptr),
                 "ExpertParallelMoeLayer::forward: give either router_logits or topk_ids + "
                 "topk_weights, not both");
    FP4MOE_CHECK(device_routing || (args.topk_ids && args.topk_weights),
                 "ExpertParallelMoeLayer::forward: topk_ids and topk_weights go together");
    FP4MOE_CHECK(args.hidden_states && output,
                 "ExpertParallelMoeLayer::forward: hidden_states and output must be device pointers");
  }

  const auto phase_done = [&](int phase) {
    if (times) m.phases.record(phase, stream);
  };
  phase_done(0);

  // 1. The home tokens' routing, on the host for the dispatch plan.
  const int32_t* home_ids = args.topk_ids;
  const float* home_weights = args.topk_weights;
  if (device_routing && T > 0) {
    m.ids.grow(static_cast<size_t>(T * k));
    m.weights.grow(static_cast<size_t>(T * k));
    m.route_errors.grow(1);
    FP4MOE_CUDA_CHECK(cudaMemsetAsync(m.route_errors.get(), 0, sizeof(int32_t), stream));
    kernels::launch_route(args.router_logits, args.correction_bias, T, m.num_experts, m.routing, m.ids.get(),
                          m.weights.get(), stream, /*programmatic=*/false, m.route_errors.get());
    home_ids = m.ids.get();
    home_weights = m.weights.get();
  }
  std::vector<int32_t> host_ids;
  std::vector<float> host_weights;
  if (T > 0) {
    host_weights.resize(static_cast<size_t>(T * k));
    FP4MOE_CUDA_CHECK(
        cudaMemcpyAsync(host_weights.data(), home_weights, host_weights.size() * 4, cudaMemcpyDeviceToHost, stream));
  }
  int32_t route_errors = 0;  // read with the ids (download synchronises)
  if (device_routing && T > 0)
    FP4MOE_CUDA_CHECK(
        cudaMemcpyAsync(&route_errors, m.route_errors.get(), sizeof route_errors, cudaMemcpyDeviceToHost, stream));
  download(host_ids, home_ids, static_cast<size_t>(T * k), stream);
  const DispatchPlan plan = plan_dispatch(host_ids.data(), T, k, m.placement, m.rank, host_weights.data());
  const int64_t S = plan.num_send_rows();
  const int64_t W = dispatch_meta_words(k);
  phase_done(1);

  // 2. Send buffers: the rows in plan order and their metadata.
  upload_async(m.send_meta, plan.send_meta, stream);
  m.send_hidden.grow(static_cast<size_t>(S * H));
  // 3. Counts, to and from every rank.
  upload_async(m.counts_send, plan.counts_messages(), stream);
  m.counts_recv.grow(static_cast<size_t>(P * kCountsMessageWords));
  m.gather(args.hidden_states, plan.send_token_idx, m.send_token_idx, H * 2, m.send_hidden.get(), stream);
  nccl_exchange_counts(m.counts_send.get(), m.counts_recv.get(), static_cast<int>(P), m.comm, stream);
  std::vector<int64_t> recv_counts;
  download(recv_counts, m.counts_recv.get(), static_cast<size_t>(P * kCountsMessageWords), stream);
  int64_t R = 0;
  for (int64_t s = 0; s < P; ++s) R += recv_counts[static_cast<size_t>(s * kCountsMessageWords)];

  // 4. Dispatch: rows and metadata from every rank, in rank order.
  m.recv_hidden.grow(static_cast<size_t>(R * H));
  m.recv_meta.grow(static_cast<size_t>(R * W));
  nccl_dispatch(plan, recv_counts.data(), H, m.send_hidden.get(), m.send_meta.get(), m.recv_hidden.get(),
                m.recv_meta.get(), m.comm, stream);
  phase_done(2);
  std::vector<int32_t> recv_meta;
  download(recv_meta, m.recv_meta.get(), static_cast<size_t>(R * W), stream);
  const ReceivePlan recv = plan_receive(recv_counts.data(), recv_meta.data(), k, m.placement, m.rank);
  const int64_t Rp = recv.num_recv_pairs();

  // 5. This rank's experts on what it received: one bf16 row per served
  // (row, slot), then those rows in return order.
  m.return_rows.grow(static_cast<size_t>(Rp * H));
  if (R > 0) {
    m.local_ids.grow(static_cast<size_t>(R * k));
    m.local_weights.grow(static_cast<size_t>(R * k));
    const auto* meta = m.recv_meta.get();
    FP4MOE_CUDA_CHECK(
        cudaMemcpy2DAsync(m.local_ids.get(), k * 4, meta + 1, W * 4, k * 4, R, cudaMemcpyDeviceToDevice, stream));
    FP4MOE_CUDA_CHECK(cudaMemcpy2DAsync(m.local_weights.get(), k * 4, meta + 1 + k, W * 4, k * 4, R,
                                        cudaMemcpyDeviceToDevice, stream));
    const size_t workspace_bytes = m.local.workspace_bytes(R);
    if (m.workspace.grow(workspace_bytes)) m.workspace.fill_bytes(0, stream);
    m.pair_rows.grow(static_cast<size_t>(R * k * H));
    MoeForwardArgs local_args;
    local_args.hidden_states = m.recv_hidden.get();
    local_args.num_tokens = R;
    local_args.topk_ids = m.local_ids.get();
    local_args.topk_weights = m.local_weights.get();
    m.local.forward_pair_rows(local_args, m.pair_rows.get(), m.workspace.get(), workspace_bytes, stream);
    std::vector<int32_t> return_idx(static_cast<size_t>(Rp));
    for (int64_t p = 0; p < Rp; ++p) {
      const RecvPair& pair = recv.pairs[static_cast<size_t>(p)];
      return_idx[static_cast<size_t>(p)] = static_cast<int32_t>(pair.recv_row * k + pair.slot);
    }
    m.gather(m.pair_rows.get(), return_idx, m.return_idx, H * 2, m.return_rows.get(), stream);
  }

  phase_done(3);

  // 6. Return: each rank's rows back to it; ours arrive in rank order.
  m.returned.grow(static_cast<size_t>(T * k * H));
  nccl_return_rows(recv, plan, H, m.return_rows.get(), m.returned.get(), m.comm, stream);
  phase_done(4);

  // 7. Combine: the rows in (token, slot) order, summed in slot order.
  if (T > 0) {
    std::vector<int32_t> combine_idx(static_cast<size_t>(T * k));
    for (size_t i = 0; i < combine_idx.size(); ++i)
      combine_idx[i] = static_cast<int32_t>(plan.combine.return_row_idx[i]);
    m.home_pair_rows.grow(static_cast<size_t>(T * k * H));
    m.gather(m.returned.get(), combine_idx, m.combine_idx, H * 2, m.home_pair_rows.get(), stream);
    kernels::launch_finalize_pairs(m.home_pair_rows.get(), home_ids, T, k, m.num_experts, H, output, stream);
  }
  phase_done(5);
  if (times) {
    double* fields[] = {&times->route_ms, &times->dispatch_ms, &times->experts_ms, &times->return_ms,
                        &times->combine_ms};
    for (int i = 1; i < PhaseEvents::kCount; ++i) *fields[i - 1] = m.phases.elapsed_ms(i);
  }
  ExpertParallelStats stats;
  stats.sent_rows = S;
  stats.sent_pairs = plan.num_send_pairs();
  stats.received_rows = R;
  stats.received_pairs = Rp;
  stats.nonfinite_router_logits = (route_errors & kernels::kErrorNonFiniteLogits) != 0;
  return stats;
}

}  // namespace fp4moe
