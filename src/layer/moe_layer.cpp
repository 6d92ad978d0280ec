// The GPU MoE layer (include/fp4moe/moe_layer.hpp): weight preparation and
// upload, workspace layout, planning per token count and the forward's
// sequence of launches:
//
//   route (+ shared slots; or caller ids -> shared slots) -> sort pairs by expert
//     -> [gather] -> GEMM1 + SwiGLU -> GEMM2 + finalize scatter -> finalize reduction
//
// A shared expert runs as extra experts of the same grouped GEMMs: its
// intermediate dimension is cut into chunks of the routed experts' width
// (exact: SwiGLU is per intermediate column and down_proj sums over them;
// every chunk keeps the shared expert's global scales), appended as experts
// E .. E + c - 1, and every token gets c more slots for them, weighted 1 or
// sigmoid(gate · x), so a forward has T * (top_k + c) rows.
//
// Workspace: a fixed header holds everything that must stay zero between
// forwards (device error words, split-K tile counters), so forwards of any
// token count can share one workspace; the scratch after it is carved per
// forward from the token count.
// Plans are cached per token count in a bounded LRU cache (kPlanCacheCapacity
// plans, src/layer/plan_cache.hpp), so a server that sees every token count
// holds a fixed amount of host memory. Each GEMM's plan is, in this order, a
// forced config, the tune cache's checked choice for the token count's
// bucket (read once by prepare(); src/tune/tune.hpp), or the heuristic.
// Tested in tests/layer/test_moe_layer.cpp (GPU), test_moe_layer_faults.cpp
// (GPU: limits, device, out of memory, non-finite inputs) and
// test_moe_layer_args.cpp.
#include "fp4moe/moe_layer.hpp"
#include "layer/moe_layer_internals.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <sstream>
#include <utility>

#include "fp4moe/cuda_check.hpp"
#include "fp4moe/error.hpp"
#include "fp4moe/modelopt.hpp"
#include "fp4moe/reference.hpp"
#include "kernels/device_info.hpp"
#include "kernels/grouped_gemm.hpp"
#include "kernels/moe_ops.hpp"
#include "kernels/prepare_device.hpp"
#include "layer/plan_cache.hpp"
#include "plan/planner.hpp"
#include "plan/smem_model.hpp"
#include "tune/tune.hpp"
#include "util/device_buffer.hpp"
#include "util/parallel.hpp"

namespace fp4moe {

std::string to_string(FinalizeMode mode) {
  return mode == FinalizeMode::kAtomic ? "atomic" : "deterministic";
}
FinalizeMode parse_finalize_mode(const std::string& name) {
  if (name == "deterministic") return FinalizeMode::kDeterministic;
  if (name == "atomic") return FinalizeMode::kAtomic;
  FP4MOE_THROW("unknown finalize mode '", name, "': expected deterministic or atomic");
}
std::string to_string(GatherMode mode) {
  switch (mode) {
    case GatherMode::kAuto: return "auto";
    case GatherMode::kFused: return "fused";
    case GatherMode::kSeparate: return "separate";
  }
  return "?";
}

std::string PlanOrigin::describe() const {
  switch (kind) {
    case Kind::kForced: return "forced";
    case Kind::kTuned: return "tuned (bucket " + std::to_string(bucket) + " of " + cache_path + ")";
    case Kind::kHeuristic: break;
  }
  const std::string why = note();
  return why.empty() ? "heuristic" : "heuristic; " + why;
}

std::string PlanOrigin::note() const {
  if (kind != Kind::kHeuristic || unused_tuned_entry.empty()) return "";
  return "the tuned entry for bucket " + std::to_string(bucket) + " is not used: " + unused_tuned_entry;
}

std::string MoeLayerPlan::describe() const {
  std::ostringstream os;
  os << num_tokens << " tokens -> " << num_rows << " routed rows\n"
     << "  GEMM1 + SwiGLU  " << describe_row_classes(gemm1) << gemm1.config.to_string() << " split_k "
     << gemm1.split_k << " [" << gemm1_origin.describe() << "]: " << gemm1.reason() << "\n"
     << "  GEMM2 + finalize " << describe_row_classes(gemm2) << gemm2.config.to_string() << " split_k "
     << gemm2.split_k << " ["
     << gemm2_origin.describe() << "]: " << gemm2.reason() << "\n";
  return os.str();
}

namespace {

// FP4MOE_PRINT_CONFIG=1: every new per-token-count plan (config, split-K,
// where each came from, the planner's reason) goes to stderr once, when it
// is made.
bool print_plans() {
  static const bool enabled = [] {
    const char* v = std::getenv("FP4MOE_PRINT_CONFIG");
    return v != nullptr && *v != '\0' && std::string(v) != "0";
  }();
  return enabled;
}

constexpr size_t kAlign = 256;
// The grouped GEMM's largest N or K (grouped_gemm.cu: int indexing of the
// padded sizes).
constexpr int64_t kMaxLayerDim = (int64_t{1} << 31) - 256;
// Token counts whose plans are kept; the least recently used goes first.
constexpr size_t kPlanCacheCapacity = 1024;

size_t align_bytes(size_t v) { return (v + kAlign - 1) / kAlign * kAlign; }

// Header: [layer error word, routing arrival counter | GEMM1 error word |
// GEMM2 error word] (16 B each), then the GEMM1 and GEMM2 split-K counters
// (kMaxSplitKTiles each: limit_split_k runs larger plans unsplit). All zero
// between forwards.
constexpr size_t kErrorWordsBytes = 48;
constexpr size_t kHeaderBytes =
    (kErrorWordsBytes + 2 * kMaxSplitKTiles * 4 + kAlign - 1) / kAlign * kAlign;

struct DeviceGemmWeights {
  DeviceBuffer<uint8_t> weights;
  DeviceBuffer<uint8_t> scales;
  DeviceBuffer<float> global_scales;
  size_t bytes() const { return weights.bytes() + scales.bytes() + global_scales.bytes(); }
};

DeviceGemmWeights upload(const PreparedGemmWeights& p) {
  DeviceGemmWeights d;
  d.weights = DeviceBuffer<uint8_t>(p.weights);
  d.scales = DeviceBuffer<uint8_t>(p.scales);
  d.global_scales = DeviceBuffer<float>(p.global_scales);
  return d;
}

void check_matrix(const Nvfp4Matrix& m, int64_t rows, int64_t cols, int64_t expert_idx,
                  const char* name) {
  FP4MOE_CHECK(m.rows == rows && m.cols == cols, "MoeLayer: expert ", expert_idx, " ", name, " is [",
               m.rows, ", ", m.cols, "]; expected [", rows, ", ", cols, "]");
  FP4MOE_CHECK(m.packed.size() == static_cast<size_t>(rows * cols / 2) &&
                   m.scales.size() == static_cast<size_t>(rows * cols / 16),
               "MoeLayer: expert ", expert_idx, " ", name, " has ", m.packed.size(),
               " packed bytes and ", m.scales.size(), " scales; expected ", rows * cols / 2, " and ",
               rows * cols / 16);
}

// Everything prepare() checks before touching the GPU.
// The rules on a layer's shape and options, whichever way its weights come.
void validate_shape(int64_t num_experts, int64_t hidden, int64_t inter, const MoeLayerOptions& o) {
  FP4MOE_CHECK(num_experts >= 1 && num_experts <= kMaxExperts, "MoeLayer: ", num_experts,
               " experts; expected 1..", kMaxExperts);
  FP4MOE_CHECK(hidden >= 16 && hidden % 16 == 0, "MoeLayer: hidden = ", hidden,
               "; expected a positive multiple of 16 (the NVFP4 block)");
  FP4MOE_CHECK(inter >= 16 && inter % 16 == 0, "MoeLayer: inter = ", inter,
               "; expected a positive multiple of 16 (the NVFP4 block)");
  // Before any product of the two is formed: GEMM1's N is 2 * inter, and the
  // grouped GEMM indexes N and K with int and refuses N * K >= 2^40.
  FP4MOE_CHECK(hidden <= kMaxLayerDim && inter <= kMaxLayerDim / 2 && 2 * inter * hidden < (int64_t{1} << 40),
               "MoeLayer: hidden = ", hidden, ", inter = ", inter, "; expected hidden <= ", kMaxLayerDim,
               ", inter <= ", kMaxLayerDim / 2, " and 2 * inter * hidden < 2^40 (the grouped GEMM's 32-bit indexing)");
  FP4MOE_CHECK(!o.batch_invariant || o.finalize == FinalizeMode::kDeterministic,
               "MoeLayer: batch_invariant needs the deterministic finalize (atomic adds sum the "
               "top-k rows in a different order on every run)");
  const int k = o.routing.top_k;
  FP4MOE_CHECK(k >= 1 && k <= num_experts && k <= kernels::kMaxTopK, "MoeLayer: top_k = ", k,
               "; expected 1..", std::min<int64_t>(num_experts, kernels::kMaxTopK));
}

// The number of chunks of the routed experts' width the shared expert is
// cut into (0 without one), after checking that it can be.
int shared_chunks(const MoeWeights& w, const MoeLayerOptions& o) {
  if (!w.shared_expert) return 0;
  const SharedExpertWeights& sh = *w.shared_expert;
  FP4MOE_CHECK(!sh.dense(), "MoeLayer: the shared expert is unquantised in the checkpoint (ModelOpt's "
               "experts-only configs leave it in bf16); the GPU layer runs NVFP4 shared experts only, as extra experts "
               "of its grouped GEMMs: use the CPU backend (--device cpu) or a checkpoint that quantises it");
  FP4MOE_CHECK(sh.inter > 0 && sh.inter % w.inter == 0, "MoeLayer: the shared expert is ", sh.inter,
               " wide; expected a multiple of the routed experts' inter = ", w.inter,
               " (it runs as extra experts of that width)");
  const int64_t chunks = sh.inter / w.inter;
  FP4MOE_CHECK(o.routing.top_k + chunks <= kernels::kMaxTopK && w.num_experts + chunks <= kMaxExperts,
               "MoeLayer: the shared expert makes ", chunks, " extra experts of width ", w.inter, "; top_k + ", chunks,
               " = ", o.routing.top_k + chunks, " rows per token and ", w.num_experts + chunks,
               " experts; expected at most ", kernels::kMaxTopK, " and ", kMaxExperts);
  FP4MOE_CHECK(!w.has_bias(), "MoeLayer: a shared expert beside routed experts with biases (gpt-oss has none)");
  check_matrix(sh.mlp.gate, sh.inter, w.hidden, -1, "shared gate");
  check_matrix(sh.mlp.up, sh.inter, w.hidden, -1, "shared up");
  check_matrix(sh.mlp.down, w.hidden, sh.inter, -1, "shared down");
  FP4MOE_CHECK(std::isfinite(sh.mlp.gate.global_scale) && std::isfinite(sh.mlp.up.global_scale) &&
                   std::isfinite(sh.mlp.down.global_scale),
               "MoeLayer: the shared expert's weight_scale_2 are not all finite");
  FP4MOE_CHECK(sh.gate.empty() || sh.gate.size() == static_cast<size_t>(w.hidden), "MoeLayer: the shared expert's "
               "gate has ", sh.gate.size(), " values; expected 0 (none) or hidden = ", w.hidden);
  return static_cast<int>(chunks);
}

// Chunk j of the shared expert as an expert of the routed width: gate and
// up rows [j I, (j+1) I), down columns [j I, (j+1) I).
ExpertWeights shared_chunk(const SharedExpertWeights& sh, int64_t inter, int64_t j) {
  ExpertWeights e;
  e.gate = row_slice(sh.mlp.gate, j * inter, inter);
  e.up = row_slice(sh.mlp.up, j * inter, inter);
  e.down = column_slice(sh.mlp.down, j * inter, inter);
  return e;
}

void validate_weights(const MoeWeights& w, const MoeLayerOptions& o) {
  validate_shape(w.num_experts, w.hidden, w.inter, o);
  shared_chunks(w, o);
  FP4MOE_CHECK(static_cast<int64_t>(w.experts.size()) == w.num_experts, "MoeLayer: num_experts = ",
               w.num_experts, " but ", w.experts.size(), " experts are given");
  const bool bias = w.has_bias();
  for (int64_t e = 0; e < w.num_experts; ++e) {
    const ExpertWeights& x = w.experts[static_cast<size_t>(e)];
    check_matrix(x.gate, w.inter, w.hidden, e, "gate");
    check_matrix(x.up, w.inter, w.hidden, e, "up");
    check_matrix(x.down, w.hidden, w.inter, e, "down");
    FP4MOE_CHECK(std::isfinite(x.gate.global_scale) && std::isfinite(x.up.global_scale),
                 "MoeLayer: expert ", e, " has gate and up weight_scale_2 ", x.gate.global_scale, " and ",
                 x.up.global_scale, "; expected finite");
    const std::pair<const std::vector<float>*, std::pair<const char*, int64_t>> biases[] = {
        {&x.gate_bias, {"gate_bias", w.inter}},
        {&x.up_bias, {"up_bias", w.inter}},
        {&x.down_bias, {"down_bias", w.hidden}}};
    for (const auto& [values, what] : biases) {
      const size_t expected = bias ? static_cast<size_t>(what.second) : 0;
      FP4MOE_CHECK(values->size() == expected, "MoeLayer: expert ", e, " ", what.first, " has ",
                   values->size(), " entries; expected ", expected,
                   bias ? "" : " (expert 0 has no biases)");
    }
  }
}

// W4A4 input scales, as the quantiser needs them (the loader also bounds them).
void check_input_scale(float value, const char* what, int64_t expert_idx) {
  FP4MOE_CHECK(std::isfinite(value) && value > 0.0f, what, "[", expert_idx, "] is ", value,
               "; fp4 activations need a finite, positive input_scale");
}

// Byte offsets of one forward's scratch, after the header.
struct ScratchLayout {
  size_t topk_ids = 0, topk_weights = 0, offsets = 0, token_of_row = 0, pair_of_row = 0, sort_scratch = 0;
  size_t x_sorted = 0, activated = 0, finalize = 0, gemm1_ws = 0, gemm2_ws = 0;
  size_t gemm1_ws_bytes = 0, gemm2_ws_bytes = 0;
  size_t end = 0;
};

}  // namespace

struct MoeLayer::Impl {
  int device = 0;  // where prepare() uploaded the weights
  int64_t num_experts = 0, hidden = 0, inter = 0;
  int top_k = 0;
  // Shared expert chunks: extra experts num_experts .. num_experts +
  // num_shared - 1 of the GEMMs, one more slot each per token.
  int num_shared = 0;
  DeviceBuffer<float> shared_gate;  // [hidden]: Qwen2-MoE's sigmoid gate; empty: weight 1
  int rows_per_token() const { return top_k + num_shared; }
  int64_t gemm_experts() const { return num_experts + num_shared; }
  bool has_bias = false;
  MoeLayerOptions options;
  GatherMode gather = GatherMode::kAuto;
  DeviceGemmWeights w13;  // interleaved gate/up, [E][2 inter, hidden]
  // [E] the up rows' weight_scale_2 where it differs from the gate rows' (in
  // w13.global_scales); empty when they share it, as ModelOpt's exports do.
  DeviceBuffer<float> w13_up_scales;
  DeviceGemmWeights w2;   // down, [E][hidden, inter]
  DeviceBuffer<float> bias13;  // [E][2 inter]: gate biases then up biases
  DeviceBuffer<float> bias2;   // [E][hidden]
  // W4A4 (fp4 activations): [E] the input_scale each GEMM's input is
  // quantised with. Its activations are then stored as e2m1 x e4m3, so the
  // GEMMs' global scales above hold weight_scale_2 x input_scale.
  bool fp4_activations = false;
  DeviceBuffer<float> input_scales13;  // gate/up's (gemm1_input_scale)
  DeviceBuffer<float> input_scales2;   // down_proj's

  mutable PlanCache<MoeLayerPlan> plans{kPlanCacheCapacity};  // by token count
  mutable PlanCache<size_t> workspace_by_tokens{kPlanCacheCapacity};  // by max_tokens
  // GEMM1's and GEMM2's tuned choices, read once by prepare() and never
  // changed after: workspace_bytes() plans with them too, so the workspace
  // it sizes covers every split they make.
  tune::TunedGemm tuned[2];

  GemmProblem problem(int gemm, int64_t num_tokens) const {
    GemmProblem p = moe_gemm_problem(gemm, num_experts, top_k, hidden, inter, num_tokens, options.batch_invariant);
    // The shared chunks: always active, one row per token each.
    p.num_experts += num_shared;
    p.num_rows = num_tokens * rows_per_token();
    p.expected_active_experts += num_shared;
    return p;
  }

  // Reads the tune cache for this device (MoeLayerOptions::use_tune_cache)
  // and checks both GEMMs' entries; what is wrong with it is reported once
  // per process. A cache never makes prepare() fail: anything unexpected
  // leaves the heuristic in charge, reported.
  void load_tuned_choices() {
    if (!options.use_tune_cache) return;
    const std::string path = options.tune_cache_path.empty() ? tune::default_cache_path() : options.tune_cache_path;
    if (path.empty()) return;
    try {
      read_tuned_choices(path);
    } catch (const Error& e) {
      tuned[0] = tune::TunedGemm();
      tuned[1] = tune::TunedGemm();
      tune::report_once("tune cache " + path + " not used: " + e.message());
    }
  }
  void read_tuned_choices(const std::string& path) {
    const tune::CacheFile cache = tune::read_cache(path);
    if (!cache.problem.empty()) tune::report_once(cache.problem);
    if (cache.entries.empty()) return;
    const tune::DeviceIdentity identity = tune::current_device_identity();
    if (const std::string stale = tune::stale_entries_note(cache, identity); !stale.empty()) tune::report_once(stale);
    const kernels::DeviceInfo dev = kernels::current_device();
    const tune::DeviceLimits limits{dev.smem_per_block, kernels::compute_capability(dev)};
    std::vector<std::string> warnings;
    for (int gemm : {1, 2})
      tuned[gemm - 1] = tune::TunedGemm(cache, identity, problem(gemm, 1), top_k, limits, options.batch_invariant,
                                        &warnings);
    for (const std::string& warning : warnings) tune::report_once(warning);
  }

  // One GEMM's plan: the forced config, else the tuned choice, else the
  // heuristic, each as the layer runs it (limit_split_k).
  GemmPlan plan_one_gemm(int gemm, int64_t num_tokens, PlanOrigin* origin) const {
    const GemmProblem p = problem(gemm, num_tokens);
    const std::optional<TileConfig>& forced = gemm == 1 ? options.gemm1_config : options.gemm2_config;
    *origin = PlanOrigin{};
    if (forced) {
      origin->kind = PlanOrigin::Kind::kForced;
      return limit_split_k(plan_grouped_gemm(p, forced), options.batch_invariant);
    }
    const tune::TunedGemm& choices = tuned[gemm - 1];
    if (const tune::TunedChoice* tuned_choice = choices.find(num_tokens)) {
      if (tuned_choice->rejected.empty()) {
        origin->kind = PlanOrigin::Kind::kTuned;
        origin->cache_path = choices.cache_path();
        origin->bucket = tuned_choice->bucket;
        // The heuristic's own config and split run as the heuristic plans
        // them (row classes included), as `fp4moe tune` timed them.
        const GemmPlan heuristic = limit_split_k(plan_grouped_gemm(p), options.batch_invariant);
        if (heuristic.config == tuned_choice->choice.config && heuristic.split_k == tuned_choice->choice.split_k)
          return heuristic;
        return limit_split_k(
            plan_grouped_gemm(p, tuned_choice->choice.config, tuned_choice->choice.split_k),
            options.batch_invariant);
      }
      origin->bucket = tuned_choice->bucket;  // note() says so, when asked
      origin->unused_tuned_entry = tuned_choice->rejected;
    }
    return limit_split_k(plan_grouped_gemm(p), options.batch_invariant);
  }

  MoeLayerPlan make_plan(int64_t num_tokens) const {
    MoeLayerPlan p;
    p.num_tokens = num_tokens;
    p.num_rows = num_tokens * rows_per_token();
    p.gemm1 = plan_one_gemm(1, num_tokens, &p.gemm1_origin);
    p.gemm2 = plan_one_gemm(2, num_tokens, &p.gemm2_origin);
    return p;
  }

  // A shared pointer into the bounded cache: a forward copies no plan (its
  // reason strings), and a plan evicted by another thread meanwhile stays
  // alive while this one holds it.
  std::shared_ptr<const MoeLayerPlan> plan(int64_t num_tokens) const {
    if (auto hit = plans.find(num_tokens)) return hit;
    auto [plan, added] = plans.insert(num_tokens, make_plan(num_tokens));
    if (added && print_plans()) std::fprintf(stderr, "fp4moe: plan for %s", plan->describe().c_str());
    return plan;
  }

  // Whether a forward with plan `p` copies the activation rows into expert
  // order first (GatherMode::kAuto: where GEMM1's tile then reads them by
  // tensor map, which measured faster than the gather fused into its
  // cp.async copies; docs/performance.md §5.19). Either way GEMM1 computes
  // the same bits.
  bool wants_separate_gather(const MoeLayerPlan& p) const {
    if (fp4_activations) return true;  // the gather quantises GEMM1's input
    if (gather != GatherMode::kAuto) return gather == GatherMode::kSeparate;
    return auto_gather_is_separate(p.gemm1.config);
  }

  // What a forward of num_tokens with plan `p` and a workspace of
  // `workspace_bytes` does: kAuto's separate gather only where the
  // workspace holds the sorted copy (workspace_bytes() sizes it for the plan
  // of max_tokens; a smaller count whose plan wants the copy while the
  // largest one's does not runs fused).
  bool separate_gather(int64_t num_tokens, const MoeLayerPlan& p, size_t workspace_bytes) const {
    if (!wants_separate_gather(p)) return false;
    return fp4_activations || gather == GatherMode::kSeparate ||
           workspace_bytes >= scratch(num_tokens, p, true).end;
  }

  // The fewest workspace bytes a forward of num_tokens with plan `p` runs
  // in: kAuto's separate gather is left out where it is optional.
  size_t min_forward_bytes(int64_t num_tokens, const MoeLayerPlan& p) const {
    const bool required = wants_separate_gather(p) && (fp4_activations || gather == GatherMode::kSeparate);
    return scratch(num_tokens, p, required).end;
  }

  ScratchLayout scratch(int64_t num_tokens, const MoeLayerPlan& p, bool separate_gather) const {
    const size_t pairs = static_cast<size_t>(num_tokens * rows_per_token());
    ScratchLayout s;
    size_t at = kHeaderBytes;
    auto take = [&](size_t bytes) {
      const size_t offset = at;
      at = align_bytes(at + bytes);
      return offset;
    };
    s.topk_ids = take(pairs * 4);
    s.topk_weights = take(pairs * 4);
    s.offsets = take(static_cast<size_t>(gemm_experts() + 1) * 4);
    s.token_of_row = take(pairs * 4);
    s.pair_of_row = take(pairs * 4);
    s.sort_scratch = take(static_cast<size_t>(kernels::sort_scratch_ints(static_cast<int64_t>(pairs), gemm_experts())) *
                          4);
    if (separate_gather) s.x_sorted = take(pairs * hidden * 2);
    s.activated = take(pairs * inter * 2);
    const size_t finalize_rows =
        options.finalize == FinalizeMode::kDeterministic ? pairs : static_cast<size_t>(num_tokens);
    s.finalize = take(finalize_rows * hidden * 4);
    s.gemm1_ws_bytes = grouped_gemm_workspace_bytes(p.gemm1);
    s.gemm2_ws_bytes = grouped_gemm_workspace_bytes(p.gemm2);
    s.gemm1_ws = take(s.gemm1_ws_bytes);
    s.gemm2_ws = take(s.gemm2_ws_bytes);
    s.end = at;
    return s;
  }

  size_t workspace_bytes(int64_t max_tokens) const {
    if (auto hit = workspace_by_tokens.find(max_tokens)) return *hit;
    // Every region but the split-K partials grows with the token count; the
    // partials exist only while tiles are few (limit_split_k), so the smaller
    // counts where a split is possible are checked one by one, with the
    // tuned choices the forwards will use (planned here, not cached: they
    // would push the forwards' plans out of the bounded cache).
    const auto bytes_for = [&](int64_t t) {
      const MoeLayerPlan p = make_plan(t);
      return scratch(t, p, wants_separate_gather(p)).end;
    };
    size_t bytes = bytes_for(max_tokens);
    int max_block_m = 1;
    for (const TileConfig& c : compiled_configs()) max_block_m = std::max(max_block_m, c.block_m);
    const int64_t min_n_tiles = (std::min(2 * inter, hidden) + 127) / 128;
    for (int64_t t = 1; t < max_tokens; ++t) {
      if ((t * rows_per_token() / max_block_m) * min_n_tiles > kMaxSplitKTiles) break;
      bytes = std::max(bytes, bytes_for(t));
    }
    workspace_by_tokens.insert(max_tokens, bytes);
    return bytes;
  }
};

MoeLayer::MoeLayer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
MoeLayer::MoeLayer(MoeLayer&&) noexcept = default;
MoeLayer& MoeLayer::operator=(MoeLayer&&) noexcept = default;
MoeLayer::~MoeLayer() = default;

MoeLayer MoeLayer::prepare(const MoeWeights& weights, const MoeLayerOptions& options) {
  return MoeLayerInternals::prepare(weights, options, GatherMode::kAuto);
}

GatherMode MoeLayerInternals::gather(const MoeLayer& layer) { return layer.impl_->gather; }

bool auto_gather_is_separate(const TileConfig& gemm1) {
  return gemm1.family == KernelFamily::kSm90 && gemm1.block_m >= kSm90TensorMapMinBlockM;
}

bool MoeLayerInternals::separate_gather(const MoeLayer& layer, int64_t num_tokens, size_t workspace_bytes) {
  const MoeLayer::Impl& m = *layer.impl_;
  return m.separate_gather(num_tokens, *m.plan(num_tokens), workspace_bytes);
}

size_t MoeLayerInternals::min_forward_bytes(const MoeLayer& layer, int64_t num_tokens) {
  const MoeLayer::Impl& m = *layer.impl_;
  return m.min_forward_bytes(num_tokens, *m.plan(num_tokens));
}

MoeLayer MoeLayerInternals::prepare(const MoeWeights& weights, const MoeLayerOptions& options,
                                    GatherMode gather) {
  validate_weights(weights, options);
  auto impl = std::make_unique<MoeLayer::Impl>();
  impl->num_shared = shared_chunks(weights, options);
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
    chunks.push_back(shared_chunk(*weights.shared_expert, weights.inter, j));
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
      check_input_scale(in13.back(), "MoeLayer: gate/up input_scale", e);
      check_input_scale(in2.back(), "MoeLayer: down input_scale", e);
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

namespace {

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

MoeLayer MoeLayer::prepare_device(const MoeDeviceWeights& w, const MoeLayerOptions& options,
                                  cudaStream_t stream) {
  validate_shape(w.num_experts, w.hidden, w.inter, options);
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
  const bool fp4_activations =
      resolve_stacked_activation_numerics(options.activations, w.w13_input_scale != nullptr,
                                          w.w2_input_scale != nullptr, "MoeLayer::prepare_device") ==
      ActivationNumerics::kFp4;
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
    FP4MOE_CUDA_CHECK(cudaMemcpyAsync(impl->bias13.get(), w.w13_bias, impl->bias13.bytes(),
                                      cudaMemcpyDeviceToDevice, stream));
    FP4MOE_CUDA_CHECK(cudaMemcpyAsync(impl->bias2.get(), w.w2_bias, impl->bias2.bytes(),
                                      cudaMemcpyDeviceToDevice, stream));
  }
  // Complete on return, like prepare(): the caller may free its tensors.
  FP4MOE_CUDA_CHECK(cudaStreamSynchronize(stream));
  impl->load_tuned_choices();
  return MoeLayer(std::move(impl));
}

MoeLayer MoeLayer::load(const std::string& path, const std::string& prefix,
                        const MoeLayerOptions& options) {
  return prepare(load_moe_weights(path, prefix), options);
}

int64_t MoeLayer::num_experts() const { return impl_->num_experts; }
int64_t MoeLayer::hidden() const { return impl_->hidden; }
int64_t MoeLayer::inter() const { return impl_->inter; }
int MoeLayer::top_k() const { return impl_->top_k; }
int MoeLayer::device() const { return impl_->device; }
size_t MoeLayer::cached_plans() const { return impl_->plans.size(); }
size_t MoeLayer::plan_cache_capacity() { return kPlanCacheCapacity; }
const MoeLayerOptions& MoeLayer::options() const { return impl_->options; }
ActivationNumerics MoeLayer::activation_numerics() const {
  return impl_->fp4_activations ? ActivationNumerics::kFp4 : ActivationNumerics::kBf16;
}
size_t MoeLayer::device_weight_bytes() const {
  return impl_->w13.bytes() + impl_->w13_up_scales.bytes() + impl_->w2.bytes() + impl_->bias13.bytes() +
         impl_->bias2.bytes() + impl_->input_scales13.bytes() + impl_->input_scales2.bytes() +
         impl_->shared_gate.bytes();
}

namespace {
// Token counts are limited to T * top_k < 2^31 (rows are int on the device);
// compared as T < ceil(2^31 / top_k) so that no product can overflow.
int64_t max_tokens_for(int top_k) { return ((int64_t{1} << 31) + top_k - 1) / top_k; }
}  // namespace

MoeLayerPlan MoeLayer::plan(int64_t num_tokens) const {
  FP4MOE_CHECK(num_tokens >= 1 && num_tokens < max_tokens_for(impl_->rows_per_token()),
               "MoeLayer::plan: num_tokens = ", num_tokens, "; expected 1 .. 2^31 / top_k");
  return *impl_->plan(num_tokens);
}

size_t MoeLayer::workspace_bytes(int64_t max_tokens) const {
  FP4MOE_CHECK(max_tokens >= 1 && max_tokens < max_tokens_for(impl_->rows_per_token()),
               "MoeLayer::workspace_bytes: max_tokens = ", max_tokens,
               "; expected 1 .. 2^31 / top_k");
  return impl_->workspace_bytes(max_tokens);
}

namespace {
bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// The forward's launches go to the current device; the layer's weights live on
// the device prepare() ran on. Refused rather than switched: the caller's
// stream and buffers belong to the caller's device, and changing the thread's
// device behind its back would surprise the code around the call.
void check_device(int layer_device, const char* what) {
  int current = -1;
  FP4MOE_CUDA_CHECK(cudaGetDevice(&current));
  FP4MOE_CHECK(current == layer_device, what, ": the current CUDA device is ", current,
               " but the layer's weights are on device ", layer_device,
               " (where prepare() ran); call cudaSetDevice(", layer_device, ") first");
}
void record(cudaEvent_t event, cudaStream_t stream) {
  if (event) FP4MOE_CUDA_CHECK(cudaEventRecord(event, stream));
}
}  // namespace

void MoeLayer::forward(const MoeForwardArgs& args, void* output, void* workspace,
                       size_t workspace_bytes, cudaStream_t stream,
                       const MoeStageEvents* events) const {
  run(args, output, nullptr, workspace, workspace_bytes, stream, events);
}

void MoeLayer::forward_pair_rows(const MoeForwardArgs& args, float* pair_rows, void* workspace,
                                 size_t workspace_bytes, cudaStream_t stream) const {
  FP4MOE_CHECK(impl_->options.finalize == FinalizeMode::kDeterministic,
               "MoeLayer::forward_pair_rows: needs FinalizeMode::kDeterministic (the atomic mode "
               "never holds a row per slot)");
  FP4MOE_CHECK(impl_->num_shared == 0, "MoeLayer::forward_pair_rows: the layer has a shared expert, whose rows "
               "are not part of the [num_tokens * top_k] pair rows; use forward()");
  run(args, nullptr, pair_rows, workspace, workspace_bytes, stream, nullptr);
}

void MoeLayer::run(const MoeForwardArgs& args, void* output, float* pair_rows, void* workspace,
                   size_t workspace_bytes, cudaStream_t stream, const MoeStageEvents* events) const {
  const Impl& m = *impl_;
  const int64_t T = args.num_tokens;
  FP4MOE_CHECK(T >= 0 && T < max_tokens_for(m.rows_per_token()), "MoeLayer::forward: num_tokens = ", T,
               "; expected 0 .. 2^31 / top_k");
  if (T == 0) return;
  FP4MOE_CHECK(args.hidden_states && aligned16(args.hidden_states),
               "MoeLayer::forward: hidden_states must be a 16-byte aligned device pointer (bf16 [",
               T, ", ", m.hidden, "])");
  if (pair_rows)
    FP4MOE_CHECK(aligned16(pair_rows), "MoeLayer::forward_pair_rows: pair_rows must be a 16-byte "
                 "aligned device pointer (fp32 [", T * m.top_k, ", ", m.hidden, "])");
  else
    FP4MOE_CHECK(output && aligned16(output),
                 "MoeLayer::forward: output must be a 16-byte aligned device pointer (bf16 [", T,
                 ", ", m.hidden, "])");
  const bool device_routing = args.router_logits != nullptr;
  FP4MOE_CHECK(device_routing != (args.topk_ids != nullptr || args.topk_weights != nullptr),
               "MoeLayer::forward: give either router_logits or topk_ids + topk_weights, not both");
  FP4MOE_CHECK(device_routing || (args.topk_ids && args.topk_weights),
               "MoeLayer::forward: topk_ids and topk_weights go together");
  FP4MOE_CHECK(workspace && aligned16(workspace), "MoeLayer::forward: workspace must be a 16-byte "
               "aligned device pointer");
  check_device(m.device, "MoeLayer::forward");
  const std::shared_ptr<const MoeLayerPlan> plan_ptr = m.plan(T);  // one cached lookup per forward
  const MoeLayerPlan& plan = *plan_ptr;
  const bool separate_gather = m.separate_gather(T, plan, workspace_bytes);
  const ScratchLayout s = m.scratch(T, plan, separate_gather);
  FP4MOE_CHECK(workspace_bytes >= s.end, "MoeLayer::forward: workspace of ", workspace_bytes,
               " B; ", T, " tokens need ", s.end, " B (allocate workspace_bytes(max_tokens))");

  auto* ws = static_cast<uint8_t*>(workspace);
  auto* layer_errors = reinterpret_cast<int32_t*>(ws);
  int32_t* route_arrivals = layer_errors + 1;
  auto* gemm1_errors = reinterpret_cast<int32_t*>(ws + 16);
  auto* gemm2_errors = reinterpret_cast<int32_t*>(ws + 32);
  auto* gemm1_counters = reinterpret_cast<int32_t*>(ws + kErrorWordsBytes);
  int32_t* gemm2_counters = gemm1_counters + kMaxSplitKTiles;
  auto* ids = reinterpret_cast<int32_t*>(ws + s.topk_ids);
  auto* weights = reinterpret_cast<float*>(ws + s.topk_weights);
  auto* offsets = reinterpret_cast<int32_t*>(ws + s.offsets);
  auto* token_of_row = reinterpret_cast<int32_t*>(ws + s.token_of_row);
  auto* pair_of_row = reinterpret_cast<int32_t*>(ws + s.pair_of_row);
  auto* sort_scratch = reinterpret_cast<int32_t*>(ws + s.sort_scratch);
  auto* finalize = reinterpret_cast<float*>(ws + s.finalize);
  // Rows per token: the routed slots, then the shared expert's chunks.
  const int rows = m.rows_per_token();
  const int64_t pairs = T * rows;
  const int64_t gemm_experts = m.gemm_experts();
  const bool pdl = m.options.programmatic_launch;
  const MoeStageEvents no_events;
  const MoeStageEvents& ev = events ? *events : no_events;

  record(ev.start, stream);
  const int32_t* topk_ids = args.topk_ids;
  const float* topk_weights = args.topk_weights;
  // The shared expert's slots follow each token's routed ones ([T, rows]):
  // the routing kernel appends them, or for caller-given routing one small
  // kernel copies the caller's slots and appends them.
  kernels::SharedSlots shared_slots;
  shared_slots.num_shared = m.num_shared;
  shared_slots.hidden_states = args.hidden_states;
  shared_slots.gate = m.shared_gate.get();  // null: weight 1
  shared_slots.hidden = m.hidden;
  if (device_routing) {
    // One kernel for small batches, so the stage boundary is not observable.
    kernels::launch_route_and_sort(args.router_logits, args.correction_bias, T, m.num_experts,
                                   m.options.routing, ids, weights, offsets, token_of_row,
                                   pair_of_row, layer_errors, route_arrivals, sort_scratch, stream, pdl,
                                   shared_slots);
    topk_ids = ids;
    topk_weights = weights;
    record(ev.routed, stream);
  } else if (m.num_shared > 0) {
    kernels::launch_append_shared_slots(topk_ids, topk_weights, T, m.top_k, m.num_experts, m.num_shared,
                                        args.hidden_states, m.shared_gate.get(), m.hidden, ids, weights, stream,
                                        pdl);
    topk_ids = ids;
    topk_weights = weights;
    record(ev.routed, stream);
    kernels::launch_sort_by_expert(topk_ids, T, rows, gemm_experts, offsets, token_of_row, pair_of_row,
                                   layer_errors, sort_scratch, stream, pdl);
  } else {
    record(ev.routed, stream);
    kernels::launch_sort_by_expert(topk_ids, T, m.top_k, m.num_experts, offsets, token_of_row,
                                   pair_of_row, layer_errors, sort_scratch, stream, pdl);
  }
  record(ev.sorted, stream);
  if (m.fp4_activations)
    kernels::launch_gather_rows_fp4(args.hidden_states, token_of_row, offsets, gemm_experts, pairs, m.hidden,
                                    m.input_scales13.get(), ws + s.x_sorted, stream, pdl);
  else if (separate_gather)
    kernels::launch_gather_rows(args.hidden_states, token_of_row, offsets, gemm_experts, pairs,
                                m.hidden, ws + s.x_sorted, stream, pdl);
  record(ev.gathered, stream);

  GroupedGemmArgs g1;
  g1.weights = m.w13.weights.get();
  g1.scales = m.w13.scales.get();
  g1.global_scales = m.w13.global_scales.get();
  g1.up_global_scales = m.w13_up_scales.get();  // null when gate and up share one
  g1.num_experts = gemm_experts;
  g1.n = 2 * m.inter;
  g1.k = m.hidden;
  g1.x = separate_gather ? static_cast<const void*>(ws + s.x_sorted) : args.hidden_states;
  g1.gather_rows = separate_gather ? nullptr : token_of_row;
  g1.x_rows = separate_gather ? pairs : T;
  g1.expert_offsets = offsets;
  g1.num_rows = pairs;
  g1.y = ws + s.activated;
  g1.activation = m.options.activation;
  g1.bias = m.bias13.get();
  g1.act_quant_scales = m.input_scales2.get();  // W4A4: GEMM2's input quantised here; else null
  g1.workspace = ws + s.gemm1_ws;
  g1.workspace_bytes = s.gemm1_ws_bytes;
  g1.error_flags = gemm1_errors;
  g1.split_counters = gemm1_counters;
  g1.split_counters_capacity = kMaxSplitKTiles;
  g1.programmatic_launch = pdl;
  grouped_gemm(g1, plan.gemm1, stream);
  record(ev.gemm1, stream);

  const bool atomic = m.options.finalize == FinalizeMode::kAtomic;
  if (atomic)
    FP4MOE_CUDA_CHECK(cudaMemsetAsync(finalize, 0, static_cast<size_t>(T * m.hidden) * 4, stream));
  GroupedGemmArgs g2;
  g2.weights = m.w2.weights.get();
  g2.scales = m.w2.scales.get();
  g2.global_scales = m.w2.global_scales.get();
  g2.num_experts = gemm_experts;
  g2.n = m.hidden;
  g2.k = m.inter;
  g2.x = ws + s.activated;
  g2.expert_offsets = offsets;
  g2.num_rows = pairs;
  g2.bias = m.bias2.get();
  g2.scatter_rows = pair_of_row;
  g2.row_weights = topk_weights;
  g2.out_f32 = pair_rows ? pair_rows : finalize;
  g2.out_rows = atomic ? T : pairs;
  g2.out_row_divisor = atomic ? rows : 1;
  g2.atomic_out = atomic;
  g2.workspace = ws + s.gemm2_ws;
  g2.workspace_bytes = s.gemm2_ws_bytes;
  g2.error_flags = gemm2_errors;
  g2.split_counters = gemm2_counters;
  g2.split_counters_capacity = kMaxSplitKTiles;
  g2.programmatic_launch = pdl;
  g2.indices_before_previous_kernel = true;  // offsets, slots and weights come from the routing, before GEMM1
  grouped_gemm(g2, plan.gemm2, stream);
  record(ev.gemm2, stream);
  if (pair_rows) return;

  if (atomic)
    kernels::launch_finalize_accumulated(finalize, T, m.hidden, output, stream, pdl);
  else
    // The routing kernel's ids are all valid: no id check (a round trip
    // before the rows' loads at small T).
    kernels::launch_finalize_pairs(finalize, device_routing ? nullptr : topk_ids, T, rows, gemm_experts,
                                   m.hidden, output, stream, pdl);
  record(ev.end, stream);
}

std::string MoeLayer::device_errors(void* workspace, cudaStream_t stream) const {
  FP4MOE_CHECK(workspace != nullptr, "MoeLayer::device_errors: workspace is null");
  check_device(impl_->device, "MoeLayer::device_errors");
  int32_t words[12] = {};
  FP4MOE_CUDA_CHECK(cudaMemcpyAsync(words, workspace, kErrorWordsBytes, cudaMemcpyDeviceToHost, stream));
  FP4MOE_CUDA_CHECK(cudaStreamSynchronize(stream));
  std::string out;
  if (words[0] & kernels::kErrorExpertIdOutOfRange)
    out += "expert ids outside [0, " + std::to_string(impl_->num_experts) + ") (their slots were skipped); ";
  if (words[0] & kernels::kErrorNonFiniteLogits)
    out += "non-finite router logits (their experts were excluded, docs/design.md §3); ";
  for (int gemm = 1; gemm <= 2; ++gemm) {
    const std::string errors = grouped_gemm_device_errors(
        static_cast<const uint8_t*>(workspace) + 16 * gemm, stream);
    if (!errors.empty()) out += "GEMM" + std::to_string(gemm) + ": " + errors;
  }
  // Reported once: the words are cleared for the next forwards.
  FP4MOE_CUDA_CHECK(cudaMemsetAsync(workspace, 0, kErrorWordsBytes, stream));
  FP4MOE_CUDA_CHECK(cudaStreamSynchronize(stream));
  return out;
}

}  // namespace fp4moe
