// libFuzzer target: loading a ModelOpt NVFP4 checkpoint
// (load_moe_weights and checkpoint_tensor_names, src/format/modelopt.cpp).
//
// One input describes a small checkpoint directory:
//
//   byte 0    flags: bit 0 write model.safetensors.index.json, bit 1 write
//             hf_quant_config.json, bit 2 write b.safetensors, bit 3 load
//             a.safetensors itself instead of the directory, bit 4 use the
//             empty prefix instead of "mlp."
//   the rest  index.json, hf_quant_config.json, a.safetensors and
//             b.safetensors, separated by "\n%%\n" (kPartSeparator)
//
// Loading must either throw fp4moe::Error or return weights that keep the
// promises of fp4moe/modelopt.hpp: every matrix has the bytes its shape
// needs, gate and up share their global scale, biases are all there or all
// absent; checkpoint_tensor_names lists each tensor once and, where the
// loader accepted, names a tensor of every expert it returned. Accepted
// weights are written back with add_moe_weights and must load again
// unchanged. Anything else (another exception, a sanitizer
// report, a leak, a hang) is a finding.
//
// Seeds: fuzz/make-seeds (<build>/fuzz/seeds/modelopt); dictionary:
// fuzz/modelopt.dict. Run with scripts/fuzz modelopt.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "format/checkpoint.hpp"
#include "fp4moe/error.hpp"
#include "fp4moe/modelopt.hpp"
#include "fp4moe/nvfp4.hpp"
#include "fuzz_util.hpp"

namespace fp4moe::fuzz {
namespace {

constexpr std::string_view kPartSeparator = "\n%%\n";
constexpr uint8_t kWriteIndex = 1 << 0;
constexpr uint8_t kWriteQuantConfig = 1 << 1;
constexpr uint8_t kWriteSecondShard = 1 << 2;
constexpr uint8_t kLoadFile = 1 << 3;
constexpr uint8_t kEmptyPrefix = 1 << 4;
// Dequantising bigger layers only costs time; their bytes are checked anyway.
constexpr int64_t kMaxDequantizedElements = 1 << 16;

void check_matrix(const Nvfp4Matrix& m, int64_t rows, int64_t cols) {
  FP4MOE_FUZZ_ASSERT(m.rows == rows && m.cols == cols, "a matrix has the wrong shape");
  FP4MOE_FUZZ_ASSERT(m.packed.size() == static_cast<size_t>(rows * cols / 2),
                     "a matrix has the wrong number of packed bytes");
  FP4MOE_FUZZ_ASSERT(m.scales.size() == static_cast<size_t>(rows * cols / kNvfp4BlockSize),
                     "a matrix has the wrong number of block scales");
  if (rows * cols <= kMaxDequantizedElements) (void)m.dequantize();
}

void check_weights(const MoeWeights& weights) {
  FP4MOE_FUZZ_ASSERT(weights.num_experts > 0 &&
                         static_cast<size_t>(weights.num_experts) == weights.experts.size(),
                     "num_experts differs from the experts loaded");
  FP4MOE_FUZZ_ASSERT(weights.hidden > 0 && weights.hidden % kNvfp4BlockSize == 0 &&
                         weights.inter > 0 && weights.inter % kNvfp4BlockSize == 0,
                     "hidden or inter is not a positive multiple of 16");
  const bool has_bias = weights.has_bias();
  for (const ExpertWeights& expert : weights.experts) {
    check_matrix(expert.gate, weights.inter, weights.hidden);
    check_matrix(expert.up, weights.inter, weights.hidden);
    check_matrix(expert.down, weights.hidden, weights.inter);
    FP4MOE_FUZZ_ASSERT(expert.gate.global_scale == expert.up.global_scale,
                       "gate and up global scales differ");
    const size_t bias_rows[3] = {static_cast<size_t>(weights.inter), static_cast<size_t>(weights.inter),
                                 static_cast<size_t>(weights.hidden)};
    const std::vector<float>* biases[3] = {&expert.gate_bias, &expert.up_bias, &expert.down_bias};
    for (int p = 0; p < 3; ++p)
      FP4MOE_FUZZ_ASSERT(biases[p]->size() == (has_bias ? bias_rows[p] : 0),
                         "biases are neither all present nor all absent");
  }
}

bool same_matrix(const Nvfp4Matrix& a, const Nvfp4Matrix& b) {
  return a.rows == b.rows && a.cols == b.cols && a.packed == b.packed && a.scales == b.scales &&
         a.global_scale == b.global_scale && a.input_scale == b.input_scale;
}

void check_round_trip(const MoeWeights& weights, const std::string& prefix) {
  SafetensorsWriter writer;
  add_moe_weights(writer, weights, prefix);
  const std::string path = (scratch_dir() / "round_trip.safetensors").string();
  writer.write(path);
  const MoeWeights again = load_moe_weights(path, prefix);
  FP4MOE_FUZZ_ASSERT(again.num_experts == weights.num_experts && again.hidden == weights.hidden &&
                         again.inter == weights.inter,
                     "layer dimensions changed in a round trip");
  for (size_t e = 0; e < weights.experts.size(); ++e) {
    const ExpertWeights& x = weights.experts[e];
    const ExpertWeights& y = again.experts[e];
    FP4MOE_FUZZ_ASSERT(same_matrix(x.gate, y.gate) && same_matrix(x.up, y.up) &&
                           same_matrix(x.down, y.down) && x.gate_bias == y.gate_bias &&
                           x.up_bias == y.up_bias && x.down_bias == y.down_bias,
                       "an expert changed in a round trip");
  }
}

void run(const uint8_t* data, size_t size) {
  if (size == 0) return;
  const uint8_t flags = data[0];
  const std::string_view rest(reinterpret_cast<const char*>(data + 1), size - 1);
  const std::vector<std::string_view> parts = split(rest, kPartSeparator, 4);

  clear_scratch_dir();
  const std::filesystem::path dir = scratch_dir() / "checkpoint";
  std::filesystem::create_directory(dir);
  if (flags & kWriteIndex) write_file(dir / "model.safetensors.index.json", parts[0]);
  if (flags & kWriteQuantConfig) write_file(dir / "hf_quant_config.json", parts[1]);
  write_file(dir / "a.safetensors", parts[2]);
  if (flags & kWriteSecondShard) write_file(dir / "b.safetensors", parts[3]);
  const std::string path = ((flags & kLoadFile) ? dir / "a.safetensors" : dir).string();
  const std::string prefix = (flags & kEmptyPrefix) ? "" : "mlp.";

  std::optional<std::vector<std::string>> names;
  try {
    names = checkpoint_tensor_names(path);
  } catch (const Error& e) {
    note_refusal(e);
  }
  if (names) {
    std::set<std::string> unique(names->begin(), names->end());
    FP4MOE_FUZZ_ASSERT(unique.size() == names->size(), "checkpoint_tensor_names lists a name twice");
  }
  MoeWeights weights;
  try {
    weights = load_moe_weights(path, prefix);
  } catch (const Error& e) {
    note_refusal(e);  // a clear refusal
    return;
  }
  // Both read the same tensors: what the loader found, the listing names.
  FP4MOE_FUZZ_ASSERT(names.has_value(), "load_moe_weights accepted a checkpoint that checkpoint_tensor_names refused");
  for (int64_t e = 0; e < weights.num_experts; ++e) {
    const std::string expert = prefix + "experts." + std::to_string(e) + ".";
    FP4MOE_FUZZ_ASSERT(std::any_of(names->begin(), names->end(),
                                   [&](const std::string& n) { return n.rfind(expert, 0) == 0; }),
                       "an expert the loader returned has no tensor in checkpoint_tensor_names");
  }
  check_weights(weights);
  try {
    check_round_trip(weights, prefix);
  } catch (const Error& e) {
    std::fprintf(stderr, "accepted weights failed their round trip: %s\n", e.what());
    std::abort();
  }
}

}  // namespace
}  // namespace fp4moe::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  return fp4moe::fuzz::run_guarded(fp4moe::fuzz::run, data, size);
}
