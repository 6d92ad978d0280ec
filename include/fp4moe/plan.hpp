// Tile configurations, their shared-memory model, architecture limits and
// the planner that picks a configuration per problem (docs/design.md §5).
//
// Every byte of shared memory a kernel uses is described by SmemLayout; the
// kernels carve their shared memory from the same description (see
// src/plan/smem_model.hpp), so what `fp4moe plan` prints is what runs. The
// planner's measured constants and its internal steps (split-K limits, row
// classes) are not part of this API: src/plan/planner.hpp.
// Tested in tests/plan/test_plan.cpp and, against the compiled kernels, in
// tests/kernels/test_grouped_gemm.cpp.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace fp4moe {

// ------------------------------------------------------------- architectures

struct ArchLimits {
  std::string name;                 // "sm90"
  int compute_capability;           // 90
  int64_t smem_per_block;           // opt-in dynamic shared memory per block, bytes
  int64_t smem_per_sm;              // shared memory per multiprocessor, bytes
  int64_t smem_reserved_per_block;  // reserved by the system per resident block
};

// sm80, sm86, sm89, sm90, sm100, sm120. Throws with the list of valid names.
ArchLimits arch_limits(std::string_view name);
std::vector<std::string> known_archs();
// Limits of the local GPU (from the CUDA runtime); false if there is none.
bool local_arch_limits(ArchLimits* limits, std::string* device_name = nullptr);

// ---------------------------------------------------------------- configs

// What the grouped GEMM does with a finished tile (docs/design.md §4.4).
enum class Epilogue {
  kNone,      // bf16 rows in expert-sorted order
  kSwiglu,    // GEMM1: gate and up rows interleaved in one tile -> act(gate, up), bf16, half width
  kFinalize,  // GEMM2: (row (+ bias)) x router weight, bf16 to the (token, slot) row or fp32 added to the token row
};
std::string to_string(Epilogue epilogue);

// The grouped-GEMM kernel families (docs/design.md §4.1-4.4 portable, §4.7 SM90).
enum class KernelFamily {
  kPortable,  // mma.sync + cp.async, SM80 ... SM120, <= 101,376 B of shared memory
  kSm90,      // warp-specialised wgmma + bulk copies + mbarrier ring, SM90a only
};
std::string to_string(KernelFamily family);

// One tile configuration of a grouped GEMM kernel (swap AB: weight rows are
// the MMA's M side, tokens its N side).
struct TileConfig {
  int block_n = 128;  // weight rows (output features) per tile
  int block_m = 8;    // token rows per tile
  int block_k = 256;  // K per pipeline stage
  int stages = 4;     // pipeline depth
  int warps = 4;      // warps per block (portable: each owns block_n / warps weight rows;
                      // sm90: one producer and two consumer warpgroups)
  Epilogue epilogue = Epilogue::kNone;
  KernelFamily family = KernelFamily::kPortable;

  // "n128m8k256s4w4"; the SM90 family is prefixed, "sm90n128m64k128s6w12"; a
  // fused epilogue adds a suffix: "n128m8k256s4w4-swiglu".
  std::string to_string() const;
  // Inverse of to_string; throws with the expected form on a malformed name.
  static TileConfig parse(std::string_view name);
  bool operator==(const TileConfig&) const = default;
};

// The forwards the layer runs as one fused decode launch
// (MoeLayerOptions::fused_decode, docs/design.md §4.8): measured faster than
// the separate launches from 2 to 16 tokens and slower at one
// (docs/performance.md §5.27).
inline constexpr int64_t kFusedDecodeMinTokens = 2;
inline constexpr int64_t kFusedDecodeMaxTokens = 16;

// The configurations compiled into the library (every tile shape with every
// epilogue), in the order the planner considers them.
const std::vector<TileConfig>& compiled_configs();
bool is_compiled(const TileConfig& config);

// ---------------------------------------------------------- shared memory

struct SmemRegion {
  std::string name;    // "weights"
  std::string shape;   // "(STAGES=4, BLOCK_N=128, BLOCK_K/2=128) packed fp4"
  int64_t offset = 0;  // bytes from the start of dynamic shared memory
  int64_t bytes = 0;
  bool overlaps_mainloop = false;  // reuses drained pipeline buffers
};

struct SmemLayout {
  std::vector<SmemRegion> regions;
  int64_t total_bytes = 0;  // dynamic shared memory the kernel is launched with
};

// The layout the kernel for `config` carves its shared memory from.
SmemLayout smem_layout(const TileConfig& config);
// Its total_bytes alone, without the regions' descriptions (no text is
// formatted): what the planner compares with a budget.
int64_t smem_bytes(const TileConfig& config);
// Blocks of `config` that one SM of `arch` holds by shared memory (its
// layout plus the system's reserve per block), at most the blocks an SM90
// kernel is compiled for (its registers are split for them); the portable
// family's registers are not counted.
int64_t blocks_per_sm_by_smem(const TileConfig& config, const ArchLimits& arch);

// Whether a config fits a per-block budget, and if not, why and what would
// make it fit.
struct FitReport {
  bool fits = false;
  int64_t total_bytes = 0;
  int64_t limit_bytes = 0;
  std::string advice;  // empty when it fits
};
FitReport check_fit(const TileConfig& config, int64_t smem_budget_bytes);

// The table `fp4moe plan` prints for one config: regions, total, limit,
// verdict.
std::string format_layout(const TileConfig& config, int64_t smem_budget_bytes);

// ----------------------------------------------------------------- planner

// One grouped GEMM: Y[rows, n] = X[rows, k] . W_e[n, k]^T per expert.
struct GemmProblem {
  int64_t num_experts = 0;
  int64_t n = 0;
  int64_t k = 0;
  int64_t num_rows = 0;                 // routed rows over all experts (tokens * top_k)
  int64_t expected_active_experts = 0;  // 0: estimate from uniform routing
  Epilogue epilogue = Epilogue::kNone;  // the planner only picks configs with this epilogue
  // Keep to one kernel family at every row count where it runs (the two
  // families may round differently; batch-invariant layers need one).
  bool single_family = false;
};

struct GemmPlan {
  TileConfig config;
  int split_k = 1;        // K slices per tile, reduced in a fixed order
  int64_t max_tiles = 0;  // upper bound of (m-tile, n-tile) pairs
  // Why this config and split, as one line of text. Formatted here, from the
  // figures below: planning itself formats no text (a layer plans on its
  // first forward of each token count, and workspace_bytes() plans many).
  std::string reason() const;
  // The figures the planner weighed (plan_gemm_with), and what later steps
  // changed (limit_split_k, with_row_class), for reason().
  struct Rationale {
    bool no_rows = false;  // nothing to plan for: reason() is "no rows"
    int block_m = 0;
    double rows_per_expert = 0;  // expected rows per active expert
    double active_experts = 0;
    int64_t num_experts = 0;
    double tiles = 0;  // expected tiles
    int split_k = 1;   // the split planned (before limit_split_k)
    bool split_k_given = false;
    double block_slots = 0;
    int64_t k_tiles = 0;
    // Appended in order: split-K turned off, a row class added.
    struct Note {
      enum class Kind { kSplitKOffBatchInvariant, kSplitKOffTileCounters, kRowClass } kind;
      TileConfig config;   // kRowClass: the class's config
      int first_rows = 0;  // kRowClass: its experts' rows, first_rows .. max_rows
      int max_rows = 0;
    };
    std::vector<Note> notes;
  };
  Rationale why;
  // Row classes (empty: one launch of `config` over every expert). Launch i
  // runs row_classes[i].config, unsplit, over the experts with more rows than
  // row_classes[i - 1].max_rows (0 for the first) and at most its own
  // max_rows; then `config` (split_k) runs over the experts above the last.
  // Every launch filters the device-side offsets by row count, so which
  // expert goes where is decided on the GPU (graph-capturable).
  struct RowClass {
    TileConfig config;
    int max_rows = 0;
    int64_t max_tiles = 0;  // upper bound of config's tiles
  };
  std::vector<RowClass> row_classes;
};

// "A (<= 16 rows), B (<= 48 rows), then " for a plan's row classes; "" for
// none.
std::string describe_row_classes(const GemmPlan& plan);

// Whether a family's kernels run on a GPU of compute capability `cc`
// (e.g. 90): the portable family from 80 on, the SM90 family on 90 only.
bool family_runs_on(KernelFamily family, int compute_capability);

// Picks a config for `problem` among those with its epilogue fitting
// `smem_budget_bytes` whose family runs on `compute_capability` (0: the
// portable family only). On SM90 the SM90 family takes the problems of more
// rows per active expert than a measured boundary (docs/performance.md §5.3),
// or every problem with single_family, the portable family the rest: below it
// the portable kernel's mma.sync tiles measured faster.
// num_sms and blocks_per_sm size the split-K choice (it only fills block
// slots the tiles leave idle); the SM90 family always runs one block per SM.
GemmPlan plan_gemm(const GemmProblem& problem, int64_t smem_budget_bytes, int num_sms, int compute_capability = 0,
                   int blocks_per_sm = 2);

// Plans with a given config; split_k 0 lets the planner choose the split,
// otherwise it is used as given (1 .. the config's k-tiles of problem.k).
GemmPlan plan_gemm_with(const GemmProblem& problem, const TileConfig& config, int num_sms, int blocks_per_sm = 2,
                        int split_k = 0);

// The grouped GEMMs of an MoE layer (docs/design.md §4.5) as MoeLayer plans
// them for num_tokens tokens: gemm 1 is [rows, hidden] x [2 inter, hidden]^T
// with the SwiGLU epilogue, gemm 2 [rows, inter] x [hidden, inter]^T with the
// finalize epilogue; rows = num_tokens * top_k, the active experts those of
// uniform routing, one kernel family when batch_invariant.
GemmProblem moe_gemm_problem(int gemm, int64_t num_experts, int top_k, int64_t hidden, int64_t inter,
                             int64_t num_tokens, bool batch_invariant = false);

}  // namespace fp4moe
