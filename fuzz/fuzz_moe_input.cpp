// libFuzzer target: the `fp4moe moe` input file (read_moe_input,
// tools/moe_input.cpp), and the CPU reference layer (src/ref) on whatever it
// accepts.
//
// One input is a layer, the routing flags and the input file:
//
//   byte 0    bit 0: hidden 32 instead of 16; bit 1: gpt-oss activation;
//             bit 2: the layer has biases
//   byte 1    experts: 1 + byte % 8
//   byte 2    --routing: softmax, noaux_tc, gptoss (byte % 3); bit 2:
//             --no-renormalize; --topk: absent when bits 3..5 are 0, else
//             (byte >> 3) % 8 (so 1..7); bit 6, bit 7 pick --n-group 1/2
//             and --topk-group 1/2
//   byte 3    --routed-scaling-factor, one of kScalingFactors (byte % 8)
//   the rest  the safetensors input file (hidden_states, topk_ids,
//             topk_weights, router_logits, e_score_correction_bias)
//
// Reading must either throw fp4moe::Error or return an input that the layer
// can run: routing that validate_routing accepts and hidden states of
// [T, H]. The CPU reference then runs the layer on it (small inputs only) and
// must not fail, must write every output element, and must give a finite
// output to every token whose inputs and router weights are finite and
// moderate. Anything else (another exception, a sanitizer report, a
// leak, a hang) is a finding.
//
// Seeds: fuzz/make-seeds (<build>/fuzz/seeds/moe_input); dictionary:
// fuzz/moe_input.dict. Run with scripts/fuzz moe_input.
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <limits>
#include <map>
#include <string>
#include <string_view>
#include <tuple>
#include <vector>

#include "fp4moe/error.hpp"
#include "fp4moe/modelopt.hpp"
#include "fp4moe/nvfp4.hpp"
#include "fp4moe/reference.hpp"
#include "fp4moe/safetensors.hpp"
#include "fuzz_util.hpp"
#include "moe_input.hpp"

namespace fp4moe::fuzz {
namespace {

constexpr size_t kConfigBytes = 4;
constexpr int64_t kInter = 16;
constexpr float kScalingFactors[8] = {1.0f, 2.5f, 0.0f, -1.0f, 1e-30f,
                                      1e30f, std::numeric_limits<float>::infinity(),
                                      std::numeric_limits<float>::quiet_NaN()};
// The reference runs only on small inputs: its cost is what it is, not a finding.
constexpr int64_t kMaxReferenceSlots = 256;  // tokens * top_k

// A deterministic layer of num_experts experts, hidden x kInter, made once
// per shape.
const MoeWeights& layer(int64_t hidden, int64_t num_experts, bool with_bias) {
  static std::map<std::tuple<int64_t, int64_t, bool>, MoeWeights> cache;
  const auto key = std::make_tuple(hidden, num_experts, with_bias);
  const auto it = cache.find(key);
  if (it != cache.end()) return it->second;

  MoeWeights weights;
  weights.num_experts = num_experts;
  weights.hidden = hidden;
  weights.inter = kInter;
  uint32_t state = 12345;
  auto next = [&state] {  // small values in [-1, 1)
    state = state * 1664525u + 1013904223u;
    return static_cast<float>(state >> 8) / static_cast<float>(1u << 23) - 1.0f;
  };
  auto matrix = [&](int64_t rows, int64_t cols) {
    std::vector<float> values(static_cast<size_t>(rows * cols));
    for (float& v : values) v = next();
    return values;
  };
  for (int64_t e = 0; e < num_experts; ++e) {
    ExpertWeights expert;
    const std::vector<float> gate = matrix(kInter, hidden);
    const std::vector<float> up = matrix(kInter, hidden);
    const float shared = nvfp4_global_scale(std::max(abs_max(gate.data(), gate.size()),
                                                     abs_max(up.data(), up.size())));
    expert.gate = quantize_nvfp4(gate.data(), kInter, hidden, shared);
    expert.up = quantize_nvfp4(up.data(), kInter, hidden, shared);
    const std::vector<float> down = matrix(hidden, kInter);
    expert.down = quantize_nvfp4(down.data(), hidden, kInter);
    if (with_bias) {
      expert.gate_bias = matrix(kInter, 1);
      expert.up_bias = matrix(kInter, 1);
      expert.down_bias = matrix(hidden, 1);
    }
    weights.experts.push_back(std::move(expert));
  }
  return cache.emplace(key, std::move(weights)).first->second;
}

void run(const uint8_t* data, size_t size) {
  if (size < kConfigBytes) return;
  const int64_t hidden = (data[0] & 1) ? 32 : 16;
  const Activation activation = (data[0] & 2) ? Activation::kGptOss : Activation::kSwiGLU;
  const bool with_bias = (data[0] & 4) != 0;
  const int64_t num_experts = 1 + data[1] % 8;
  cli::LogitRoutingFlags flags;
  static const char* const kModes[3] = {"softmax", "noaux_tc", "gptoss"};
  flags.mode = kModes[data[2] % 3];
  flags.renormalize = (data[2] & 4) == 0;
  const int top_k = (data[2] >> 3) % 8;
  if (top_k > 0) flags.top_k = top_k;
  flags.num_groups = (data[2] & 0x40) ? 2 : 1;
  flags.topk_groups = (data[2] & 0x80) ? 2 : 1;
  flags.routed_scaling_factor = kScalingFactors[data[3] % 8];

  const std::string path = (scratch_dir() / "input.safetensors").string();
  write_file(path, std::string_view(reinterpret_cast<const char*>(data + kConfigBytes), size - kConfigBytes));
  cli::MoeInput input;
  try {
    const SafetensorsFile file = SafetensorsFile::open(path);
    input = cli::read_moe_input(file, hidden, num_experts, flags);
  } catch (const Error& e) {
    note_refusal(e);  // a clear refusal
    return;
  }

  FP4MOE_FUZZ_ASSERT(input.num_tokens > 0 && input.routing.num_tokens == input.num_tokens,
                     "accepted input has no tokens or routing for other tokens");
  FP4MOE_FUZZ_ASSERT(input.hidden_states.size() == static_cast<size_t>(input.num_tokens * hidden),
                     "accepted hidden_states of the wrong size");
  try {
    validate_routing(input.routing, num_experts);
  } catch (const Error& e) {
    std::fprintf(stderr, "accepted routing fails validate_routing: %s\n", e.what());
    std::abort();
  }
  if (input.num_tokens * input.routing.top_k > kMaxReferenceSlots) return;

  const MoeWeights& weights = layer(hidden, num_experts, with_bias);
  // Poisoned with a NaN payload no arithmetic produces, so an element the
  // reference never wrote is told apart from a computed NaN.
  constexpr uint32_t kPoison = 0x7FA5A5A5u;
  std::vector<float> output(input.hidden_states.size(), std::bit_cast<float>(kPoison));
  try {
    moe_reference(weights, input.hidden_states.data(), input.routing, activation, output.data(),
                  /*num_threads=*/1);
  } catch (const Error& e) {
    std::fprintf(stderr, "the reference refused accepted input: %s\n", e.what());
    std::abort();
  }
  const int slots = input.routing.top_k;
  for (int64_t t = 0; t < input.num_tokens; ++t) {
    const float* x = input.hidden_states.data() + t * hidden;
    const float* out = output.data() + t * hidden;
    for (int64_t n = 0; n < hidden; ++n)
      FP4MOE_FUZZ_ASSERT(std::bit_cast<uint32_t>(out[n]) != kPoison, "the reference left an output element unwritten");
    // A token with moderate finite inputs and router weights has a finite
    // output: the layer's dequantised weights are at most 1 in magnitude, so
    // nothing here can overflow (bounds: |x| <= 1e3, |w| <= 1e6).
    bool moderate = std::all_of(x, x + hidden, [](float v) { return std::isfinite(v) && std::fabs(v) <= 1e3f; });
    for (int j = 0; j < slots; ++j) {
      const float w = input.routing.topk_weights[static_cast<size_t>(t * slots + j)];
      moderate = moderate && std::isfinite(w) && std::fabs(w) <= 1e6f;
    }
    if (moderate)
      FP4MOE_FUZZ_ASSERT(std::all_of(out, out + hidden, [](float v) { return std::isfinite(v); }),
                         "a token with moderate finite inputs got a non-finite output");
  }
}

}  // namespace
}  // namespace fp4moe::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  return fp4moe::fuzz::run_guarded(fp4moe::fuzz::run, data, size);
}
