// CPU reference MoE layer (docs/design.md §3): for every (token, slot) the expert
// MLP down(act(gate·x, up·x)) in double, weighted and summed per token in slot
// order. Weights are dequantised exactly (e2m1 · e4m3 · global_scale) on the
// fly, row by row, only for experts that received tokens. Work is spread over
// threads by (expert, row range); every output element is one dot product in
// a fixed order, so the result depends neither on the thread count nor on
// which other tokens are in the batch.
// Tested in tests/ref/test_reference.cpp against a naive independent path.
#include <algorithm>
#include <array>
#include <cmath>

#include "fp4moe/error.hpp"
#include "fp4moe/nvfp4.hpp"
#include "fp4moe/nvfp4_activation.hpp"
#include "fp4moe/reference.hpp"
#include "util/parallel.hpp"

namespace fp4moe {
namespace {

// Rows of one projection handled by one work unit: small enough to balance
// a few active experts over all threads, large enough to amortise the unit.
constexpr int64_t kRowsPerUnit = 32;
// Upper bound on the per-chunk double buffers (activations, intermediate and
// per-slot outputs); long inputs are processed in token chunks of this size.
constexpr size_t kChunkBufferBytes = size_t{64} << 20;

// e2m1 values of a packed byte's two elements, and e4m3 values by code.
struct CodePair {
  double even;  // low nibble
  double odd;   // high nibble
};
struct CodeTables {
  std::array<CodePair, 256> pair;
  std::array<double, 256> e4m3;
};

const CodeTables& code_tables() {
  static const CodeTables tables = [] {
    CodeTables t{};
    for (int c = 0; c < 256; ++c) {
      t.pair[c] = {e2m1_to_float(static_cast<uint8_t>(c & 0xF)), e2m1_to_float(static_cast<uint8_t>(c >> 4))};
      t.e4m3[c] = e4m3_to_float(static_cast<uint8_t>(c));
    }
    return t;
  }();
  return tables;
}

// Row r of m (dequantised: e2m1 · e4m3 · global_scale) dotted with x[0, m.cols),
// factored as global_scale · sum_b e4m3_b · sum_{i in b} e2m1_i · x_i so that
// each packed byte costs one table lookup. Each e2m1 · x product is exact in
// double; the order of the sums is fixed (per block: even and odd elements,
// then blocks in order), so the result does not depend on the caller.
// Columns [col_begin, col_end) only where given (multiples of 16): one
// chunk of a shared expert's down projection; x is indexed by column.
double row_dot(const Nvfp4Matrix& m, int64_t r, const double* x, int64_t col_begin = 0, int64_t col_end = -1) {
  const CodeTables& tables = code_tables();
  const uint8_t* packed = m.packed.data() + r * (m.cols / 2);
  const uint8_t* scales = m.scales.data() + r * (m.cols / kNvfp4BlockSize);
  double total = 0.0;
  const int64_t block_end = (col_end < 0 ? m.cols : col_end) / kNvfp4BlockSize;
  for (int64_t b = col_begin / kNvfp4BlockSize; b < block_end; ++b) {
    const uint8_t* block_bytes = packed + b * (kNvfp4BlockSize / 2);
    const double* block_x = x + b * kNvfp4BlockSize;
    double even = 0.0, odd = 0.0;
    for (int i = 0; i < kNvfp4BlockSize / 2; ++i) {
      const CodePair& w = tables.pair[block_bytes[i]];
      even += w.even * block_x[2 * i];
      odd += w.odd * block_x[2 * i + 1];
    }
    total += tables.e4m3[scales[b]] * (even + odd);
  }
  return total * static_cast<double>(m.global_scale);
}

double sigmoid(double z) { return 1.0 / (1.0 + std::exp(-z)); }

void check_matrix(const Nvfp4Matrix& m, int64_t expert_idx, const char* name, int64_t rows, int64_t cols) {
  FP4MOE_CHECK(m.rows == rows && m.cols == cols, "moe_reference: expert ", expert_idx, " ", name, " is [", m.rows, ", ",
               m.cols, "]; expected [", rows, ", ", cols, "]");
  FP4MOE_CHECK(m.packed.size() == static_cast<size_t>(rows * cols / 2), "moe_reference: expert ", expert_idx, " ", name,
               " packed has ", m.packed.size(), " bytes; expected ", rows * cols / 2, " ([", rows, ", ", cols / 2,
               "])");
  FP4MOE_CHECK(m.scales.size() == static_cast<size_t>(rows * cols / kNvfp4BlockSize), "moe_reference: expert ",
               expert_idx, " ", name, " scales has ", m.scales.size(), " entries; expected ",
               rows * cols / kNvfp4BlockSize, " ([", rows, ", ", cols / kNvfp4BlockSize, "])");
  FP4MOE_CHECK(std::isfinite(m.global_scale), "moe_reference: expert ", expert_idx, " ", name,
               " global_scale = ", m.global_scale, "; expected finite");
}

void check_bias(const std::vector<float>& bias, int64_t expert_idx, const char* name, int64_t size) {
  FP4MOE_CHECK(bias.empty() || bias.size() == static_cast<size_t>(size), "moe_reference: expert ", expert_idx, " ",
               name, " has ", bias.size(), " entries; expected 0 (none) or ", size);
}

void validate_weights(const MoeWeights& w) {
  FP4MOE_CHECK(w.num_experts >= 1, "moe_reference: num_experts = ", w.num_experts, "; expected >= 1");
  FP4MOE_CHECK(w.experts.size() == static_cast<size_t>(w.num_experts), "moe_reference: ", w.experts.size(),
               " experts given; expected num_experts = ", w.num_experts);
  FP4MOE_CHECK(w.hidden >= kNvfp4BlockSize && w.hidden % kNvfp4BlockSize == 0, "moe_reference: hidden = ", w.hidden,
               "; expected a positive multiple of ", kNvfp4BlockSize);
  FP4MOE_CHECK(w.inter >= kNvfp4BlockSize && w.inter % kNvfp4BlockSize == 0, "moe_reference: inter = ", w.inter,
               "; expected a positive multiple of ", kNvfp4BlockSize);
  // Before rows * cols is formed for the buffer checks (the GPU layer's
  // grouped GEMM has the same bound on N and K).
  constexpr int64_t kMaxDim = (int64_t{1} << 31) - 256;
  FP4MOE_CHECK(w.hidden <= kMaxDim && w.inter <= kMaxDim, "moe_reference: hidden = ", w.hidden, ", inter = ", w.inter,
               "; expected each at most ", kMaxDim);
  for (int64_t e = 0; e < w.num_experts; ++e) {
    const ExpertWeights& ex = w.experts[static_cast<size_t>(e)];
    check_matrix(ex.gate, e, "gate", w.inter, w.hidden);
    check_matrix(ex.up, e, "up", w.inter, w.hidden);
    check_matrix(ex.down, e, "down", w.hidden, w.inter);
    check_bias(ex.gate_bias, e, "gate_bias", w.inter);
    check_bias(ex.up_bias, e, "up_bias", w.inter);
    check_bias(ex.down_bias, e, "down_bias", w.hidden);
  }
  if (!w.shared_expert) return;
  const SharedExpertWeights& sh = *w.shared_expert;
  if (sh.dense()) {
    FP4MOE_CHECK(sh.inter >= 1 && sh.inter <= kMaxDim &&
                     sh.dense_gate_up.size() == static_cast<size_t>(2 * sh.inter * w.hidden) &&
                     sh.dense_down.size() == static_cast<size_t>(w.hidden * sh.inter),
                 "moe_reference: the unquantised shared expert has ", sh.dense_gate_up.size(), " gate/up and ",
                 sh.dense_down.size(), " down values; expected ", 2 * sh.inter * w.hidden, " and ", w.hidden * sh.inter,
                 " (inter = ", sh.inter, ")");
  } else {
    FP4MOE_CHECK(sh.inter >= kNvfp4BlockSize && sh.inter % kNvfp4BlockSize == 0 && sh.inter <= kMaxDim,
                 "moe_reference: shared expert inter = ", sh.inter, "; expected a positive multiple of ",
                 kNvfp4BlockSize, " up to ", kMaxDim);
    constexpr int64_t kShared = -1;  // names the shared expert in check_matrix's messages
    check_matrix(sh.mlp.gate, kShared, "(shared) gate", sh.inter, w.hidden);
    check_matrix(sh.mlp.up, kShared, "(shared) up", sh.inter, w.hidden);
    check_matrix(sh.mlp.down, kShared, "(shared) down", w.hidden, sh.inter);
  }
  FP4MOE_CHECK(sh.mlp.gate_bias.empty() && sh.mlp.up_bias.empty() && sh.mlp.down_bias.empty(),
               "moe_reference: the shared expert has biases; expected none");
  FP4MOE_CHECK(sh.gate.empty() || sh.gate.size() == static_cast<size_t>(w.hidden),
               "moe_reference: the shared expert's gate has ", sh.gate.size(),
               " values; expected 0 (none) or hidden = ", w.hidden);
}

// Dot product of float weights with double activations, in double (an
// unquantised shared expert).
double dense_dot(const float* w, const double* x, int64_t n) {
  double sum = 0.0;
  for (int64_t k = 0; k < n; ++k) sum += static_cast<double>(w[k]) * x[k];
  return sum;
}

// One unit of work: rows [row_begin, row_end) of one expert's projection(s).
struct WorkUnit {
  int64_t expert_idx;
  int64_t row_begin;
  int64_t row_end;
};

std::vector<WorkUnit> split_rows(const std::vector<int64_t>& active_experts, int64_t rows) {
  std::vector<WorkUnit> units;
  for (int64_t e : active_experts)
    for (int64_t r = 0; r < rows; r += kRowsPerUnit) units.push_back({e, r, std::min(rows, r + kRowsPerUnit)});
  return units;
}

// W4A4: replaces row[0, n) by its NVFP4 activation values (nvfp4_activation.hpp):
// each element rounded to float, quantised per block of 16 against
// input_scale, and set to q * e4m3 * input_scale, exact in double.
void quantize_activation_row(double* row, int64_t n, float input_scale) {
  for (int64_t b = 0; b < n; b += kNvfp4BlockSize) {
    float block[kNvfp4BlockSize];
    for (int i = 0; i < kNvfp4BlockSize; ++i) block[i] = static_cast<float>(row[b + i]);
    uint8_t codes[kNvfp4BlockSize];
    float unscaled[kNvfp4BlockSize];
    nvfp4_act_quantize_block(block, input_scale, codes, unscaled);
    for (int i = 0; i < kNvfp4BlockSize; ++i)
      row[b + i] = static_cast<double>(unscaled[i]) * static_cast<double>(input_scale);
  }
}

}  // namespace

double activate(Activation activation, double gate, double up) {
  switch (activation) {
    case Activation::kSwiGLU:
      return gate * sigmoid(gate) * up;
    case Activation::kGptOss: {
      const double g = std::min(gate, 7.0);
      const double l = std::clamp(up, -7.0, 7.0);
      return g * sigmoid(1.702 * g) * (l + 1.0);
    }
  }
  return 0.0;  // unreachable: the activation is validated up front
}

void moe_reference(const MoeWeights& weights, const float* hidden_states, const Routing& routing, Activation activation,
                   float* output) {
  moe_reference(weights, hidden_states, routing, activation, output, 0);
}

void moe_reference(const MoeWeights& weights, const float* hidden_states, const Routing& routing, Activation activation,
                   float* output, int num_threads, Intermediate intermediate, ActivationNumerics numerics,
                   Combine combine) {
  validate_weights(weights);
  const bool fp4_activations = resolve_activation_numerics(weights, numerics) == ActivationNumerics::kFp4;
  if (fp4_activations) {
    const bool nvfp4_shared = weights.shared_expert && !weights.shared_expert->dense();
    for (int64_t e = 0; e < weights.num_experts + (nvfp4_shared ? 1 : 0); ++e) {
      const ExpertWeights& ex =
          e == weights.num_experts ? weights.shared_expert->mlp : weights.experts[static_cast<size_t>(e)];
      for (const float s : {ex.gate.input_scale, ex.up.input_scale, ex.down.input_scale})
        FP4MOE_CHECK(std::isfinite(s) && s > 0.0f, "moe_reference: ",
                     e == weights.num_experts ? std::string("the shared expert") : "expert " + std::to_string(e),
                     " has input_scale ", s, "; fp4 activations need finite, positive input scales");
    }
  }
  validate_routing(routing, weights.num_experts);
  FP4MOE_CHECK(activation == Activation::kSwiGLU || activation == Activation::kGptOss,
               "moe_reference: unknown Activation ", static_cast<int>(activation));
  if (routing.num_tokens == 0) return;
  FP4MOE_CHECK(hidden_states != nullptr, "moe_reference: hidden_states is null");
  FP4MOE_CHECK(output != nullptr, "moe_reference: output is null");

  const int64_t hidden = weights.hidden;
  const int64_t inter = weights.inter;
  const int top_k = routing.top_k;
  const SharedExpertWeights* shared = weights.shared_expert ? &*weights.shared_expert : nullptr;
  // A weighted (token, slot) row as the combine sums it (Combine).
  const bool bf16_rows = combine == Combine::kBf16Rows;
  const auto slot_row = [bf16_rows](double v) {
    return bf16_rows ? static_cast<double>(bf16_to_float(float_to_bf16(static_cast<float>(v)))) : v;
  };
  const int64_t shared_inter = shared ? shared->inter : 0;
  // Per token: its activations, per slot the intermediate and the output,
  // and the shared expert's intermediate, output and weight (+ with fp4
  // activations, the quantised activations per (token, slot): each slot's
  // expert has its own input_scale; and per token for the shared expert).
  const size_t bytes_per_token =
      sizeof(double) *
      static_cast<size_t>(hidden + top_k * (inter + hidden + (fp4_activations ? hidden : 0)) +
                          (shared ? shared_inter + hidden + 1 : 0) + (shared && fp4_activations ? hidden : 0));
  const int64_t chunk_tokens = std::max<int64_t>(1, static_cast<int64_t>(kChunkBufferBytes / bytes_per_token));

  std::vector<double> x;              // [chunk, hidden]
  std::vector<double> act;            // [chunk * top_k, inter]   act(gate x, up x) per (token, slot)
  std::vector<double> y;              // [chunk * top_k, hidden]  down(act) per (token, slot)
  std::vector<double> xq;             // fp4: [chunk * top_k, hidden] x quantised with the slot's expert's input_scale
  std::vector<double> shared_act;     // [chunk, shared_inter]
  std::vector<double> shared_y;       // [chunk, hidden]  the weighted output (its bf16 rows summed, kBf16Rows)
  std::vector<double> shared_weight;  // [chunk]: 1, or sigmoid(gate · x)
  std::vector<double> shared_xq;      // fp4: [chunk, hidden] x quantised with the shared expert's input_scale
  for (int64_t t0 = 0; t0 < routing.num_tokens; t0 += chunk_tokens) {
    const int64_t num_tokens = std::min(chunk_tokens, routing.num_tokens - t0);
    const int64_t num_pairs = num_tokens * top_k;
    x.assign(hidden_states + t0 * hidden, hidden_states + (t0 + num_tokens) * hidden);
    act.resize(static_cast<size_t>(num_pairs * inter));
    y.resize(static_cast<size_t>(num_pairs * hidden));

    // (token, slot) pairs of this chunk grouped by expert, in pair order.
    std::vector<std::vector<int64_t>> pairs_of(static_cast<size_t>(weights.num_experts));
    for (int64_t p = 0; p < num_pairs; ++p)
      pairs_of[static_cast<size_t>(routing.topk_ids[static_cast<size_t>(t0 * top_k + p)])].push_back(p);
    std::vector<int64_t> active_experts;
    for (int64_t e = 0; e < weights.num_experts; ++e)
      if (!pairs_of[static_cast<size_t>(e)].empty()) active_experts.push_back(e);
    // GEMM1's input of pair p: x of its token, quantised with gate/up's
    // input_scale of its expert when activations are fp4.
    if (fp4_activations) {
      xq.resize(static_cast<size_t>(num_pairs * hidden));
      parallel_for(
          num_pairs,
          [&](int64_t p) {
            const int64_t e = routing.topk_ids[static_cast<size_t>(t0 * top_k + p)];
            double* row = xq.data() + p * hidden;
            std::copy_n(x.data() + (p / top_k) * hidden, hidden, row);
            quantize_activation_row(row, hidden, gemm1_input_scale(weights.experts[static_cast<size_t>(e)]));
          },
          num_threads);
    }
    auto gemm1_input = [&](int64_t p) {
      return fp4_activations ? xq.data() + p * hidden : x.data() + (p / top_k) * hidden;
    };

    // act[p, i] = act(gate_e[i]·x_t + gate_bias, up_e[i]·x_t + up_bias).
    const std::vector<WorkUnit> gate_up_units = split_rows(active_experts, inter);
    parallel_for(
        static_cast<int64_t>(gate_up_units.size()),
        [&](int64_t u) {
          const WorkUnit& unit = gate_up_units[static_cast<size_t>(u)];
          const ExpertWeights& ex = weights.experts[static_cast<size_t>(unit.expert_idx)];
          for (int64_t i = unit.row_begin; i < unit.row_end; ++i) {
            const double gate_bias = ex.gate_bias.empty() ? 0.0 : ex.gate_bias[static_cast<size_t>(i)];
            const double up_bias = ex.up_bias.empty() ? 0.0 : ex.up_bias[static_cast<size_t>(i)];
            for (int64_t p : pairs_of[static_cast<size_t>(unit.expert_idx)]) {
              const double* xt = gemm1_input(p);
              const double g = row_dot(ex.gate, i, xt) + gate_bias;
              const double v = row_dot(ex.up, i, xt) + up_bias;
              const double a = activate(activation, g, v);
              act[static_cast<size_t>(p * inter + i)] =
                  intermediate == Intermediate::kBf16
                      ? static_cast<double>(bf16_to_float(float_to_bf16(static_cast<float>(a))))
                      : a;
            }
          }
        },
        num_threads);

    // GEMM2's input with fp4 activations: act quantised with down's input_scale.
    if (fp4_activations) {
      parallel_for(
          num_pairs,
          [&](int64_t p) {
            const int64_t e = routing.topk_ids[static_cast<size_t>(t0 * top_k + p)];
            quantize_activation_row(act.data() + p * inter, inter,
                                    weights.experts[static_cast<size_t>(e)].down.input_scale);
          },
          num_threads);
    }

    // y[p, n] = down_e[n]·act[p] + down_bias.
    const std::vector<WorkUnit> down_units = split_rows(active_experts, hidden);
    parallel_for(
        static_cast<int64_t>(down_units.size()),
        [&](int64_t u) {
          const WorkUnit& unit = down_units[static_cast<size_t>(u)];
          const ExpertWeights& ex = weights.experts[static_cast<size_t>(unit.expert_idx)];
          for (int64_t n = unit.row_begin; n < unit.row_end; ++n) {
            const double down_bias = ex.down_bias.empty() ? 0.0 : ex.down_bias[static_cast<size_t>(n)];
            for (int64_t p : pairs_of[static_cast<size_t>(unit.expert_idx)])
              y[static_cast<size_t>(p * hidden + n)] = row_dot(ex.down, n, act.data() + p * inter) + down_bias;
          }
        },
        num_threads);

    // The shared expert, whole (never chunked: an independent check of the
    // GPU layer, which runs it as extra experts of the routed width).
    if (shared) {
      shared_act.resize(static_cast<size_t>(num_tokens * shared_inter));
      shared_y.resize(static_cast<size_t>(num_tokens * hidden));
      shared_weight.resize(static_cast<size_t>(num_tokens));
      // With fp4 activations its inputs are quantised as a routed expert's
      // are: x with gate/up's input_scale, act with down's.
      const bool shared_fp4 = fp4_activations && !shared->dense();
      if (shared_fp4) {
        shared_xq = x;
        parallel_for(
            num_tokens,
            [&](int64_t t) {
              quantize_activation_row(shared_xq.data() + t * hidden, hidden, gemm1_input_scale(shared->mlp));
            },
            num_threads);
      }
      const std::vector<double>& shared_x = shared_fp4 ? shared_xq : x;
      const std::vector<WorkUnit> act_units = split_rows({0}, shared_inter);
      parallel_for(
          static_cast<int64_t>(act_units.size()),
          [&](int64_t u) {
            const WorkUnit& unit = act_units[static_cast<size_t>(u)];
            for (int64_t i = unit.row_begin; i < unit.row_end; ++i)
              for (int64_t t = 0; t < num_tokens; ++t) {
                const double* xt = shared_x.data() + t * hidden;
                const double a =
                    shared->dense()
                        ? activate(activation, dense_dot(shared->dense_gate_up.data() + i * hidden, xt, hidden),
                                   dense_dot(shared->dense_gate_up.data() + (shared_inter + i) * hidden, xt, hidden))
                        : activate(activation, row_dot(shared->mlp.gate, i, xt), row_dot(shared->mlp.up, i, xt));
                shared_act[static_cast<size_t>(t * shared_inter + i)] =
                    intermediate == Intermediate::kBf16
                        ? static_cast<double>(bf16_to_float(float_to_bf16(static_cast<float>(a))))
                        : a;
              }
          },
          num_threads);
      if (shared_fp4) {
        parallel_for(
            num_tokens,
            [&](int64_t t) {
              quantize_activation_row(shared_act.data() + t * shared_inter, shared_inter, shared->mlp.down.input_scale);
            },
            num_threads);
      }
      for (int64_t t = 0; t < num_tokens; ++t) {
        double logit = 0.0;
        for (size_t h = 0; h < shared->gate.size(); ++h)
          logit += static_cast<double>(shared->gate[h]) * x[static_cast<size_t>(t * hidden) + h];
        shared_weight[static_cast<size_t>(t)] = shared->gate.empty() ? 1.0 : sigmoid(logit);
      }
      // The weighted output: whole (kExact), or as the GPU layer's chunks of
      // the routed width, each weighted row rounded to bf16 (kBf16Rows).
      const int64_t chunk_width = bf16_rows && shared_inter % inter == 0 ? inter : shared_inter;
      const std::vector<WorkUnit> down_units_shared = split_rows({0}, hidden);
      parallel_for(
          static_cast<int64_t>(down_units_shared.size()),
          [&](int64_t u) {
            const WorkUnit& unit = down_units_shared[static_cast<size_t>(u)];
            for (int64_t n = unit.row_begin; n < unit.row_end; ++n)
              for (int64_t t = 0; t < num_tokens; ++t) {
                const double* at = shared_act.data() + t * shared_inter;
                double sum = 0.0;
                for (int64_t c0 = 0; c0 < shared_inter; c0 += chunk_width) {
                  const double part = shared->dense() ? dense_dot(shared->dense_down.data() + n * shared_inter + c0,
                                                                  at + c0, chunk_width)
                                                      : row_dot(shared->mlp.down, n, at, c0, c0 + chunk_width);
                  sum += slot_row(shared_weight[static_cast<size_t>(t)] * part);
                }
                shared_y[static_cast<size_t>(t * hidden + n)] = sum;
              }
          },
          num_threads);
    }

    // output[t] = sum over slots j, in slot order, of w_j * y[(t, j)], then
    // the shared expert's weighted output.
    parallel_for(
        num_tokens,
        [&](int64_t t) {
          float* out = output + (t0 + t) * hidden;
          for (int64_t n = 0; n < hidden; ++n) {
            double sum = 0.0;
            for (int j = 0; j < top_k; ++j) {
              const int64_t p = t * top_k + j;
              sum += slot_row(static_cast<double>(routing.topk_weights[static_cast<size_t>(t0 * top_k + p)]) *
                              y[static_cast<size_t>(p * hidden + n)]);
            }
            if (shared) sum += shared_y[static_cast<size_t>(t * hidden + n)];
            out[n] = static_cast<float>(sum);
          }
        },
        num_threads);
  }
}

}  // namespace fp4moe
