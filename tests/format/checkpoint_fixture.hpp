// What the tests of src/format's ModelOpt checkpoint code share: random
// matrices of three distributions, error-message checks, index files, a
// layer's quantised experts and the ModeloptCheckpoint fixture that writes
// them as a checkpoint (the layer under test beside a router and a second
// layer whose prefix shares "model.layers.3"). Files go to a fresh
// temporary directory that is removed afterwards.
//
// Used by tests/format/test_{modelopt_quantize,config_json,quant_config,checkpoint_reader,moe_weights_reader,checkpoint_writer}.cpp.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <fstream>
#include <functional>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "fp4moe/error.hpp"
#include "fp4moe/modelopt.hpp"
#include "fp4moe/nvfp4.hpp"
#include "fp4moe/safetensors.hpp"
#include "temp_dir.hpp"

namespace fp4moe {

enum class Dist { kNormal, kUniform, kHeavyTailed };

inline const char* dist_name(Dist d) {
  switch (d) {
    case Dist::kNormal:
      return "normal";
    case Dist::kUniform:
      return "uniform";
    case Dist::kHeavyTailed:
      return "heavy-tailed";
  }
  return "?";
}

inline std::vector<float> random_matrix(int64_t rows, int64_t cols, Dist dist, uint32_t seed, float scale = 0.02f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, scale);
  std::uniform_real_distribution<float> uniform(-scale, scale);
  std::student_t_distribution<float> student(1.5f);  // infinite variance: real outliers
  std::vector<float> out(static_cast<size_t>(rows * cols));
  for (float& x : out) {
    switch (dist) {
      case Dist::kNormal:
        x = normal(rng);
        break;
      case Dist::kUniform:
        x = uniform(rng);
        break;
      case Dist::kHeavyTailed:
        x = scale * student(rng);
        break;
    }
  }
  return out;
}

// The message of the fp4moe::Error that `fn` throws; fails the test if it
// throws nothing or something else.
inline std::string error_message(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "threw a non-fp4moe exception: " << e.what();
    return {};
  }
  ADD_FAILURE() << "did not throw";
  return {};
}

#define EXPECT_CONTAINS(haystack, needle)                                   \
  EXPECT_NE(std::string(haystack).find(needle), std::string::npos)          \
      << "expected the message to contain \"" << (needle) << "\"; it is:\n" \
      << (haystack)

// The README promises one-line errors.
#define EXPECT_ONE_LINE(message) \
  EXPECT_EQ(std::string(message).find('\n'), std::string::npos) << "one line expected:\n" << (message)

inline void write_text(const std::string& path, const std::string& text) {
  std::ofstream out(path);
  out << text;
  ASSERT_TRUE(out.good()) << path;
}

// tensor name -> shard file, as in model.safetensors.index.json.
using WeightMap = std::map<std::string, std::string>;

// The index file's text (tensor and file names here need no JSON escaping).
inline std::string index_json(const WeightMap& weight_map) {
  std::string text = "{\"metadata\": {\"total_size\": 0},\n \"weight_map\": {";
  const char* sep = "\n";
  for (const auto& [name, file] : weight_map) {
    text += sep + std::string("  \"") + name + "\": \"" + file + "\"";
    sep = ",\n";
  }
  return text + "}}\n";
}

inline const std::string kPrefix = "model.layers.3.mlp.";

// Quantised experts from random weights, gate and up sharing the global
// scale of their joint amax, as ModelOpt does.
inline MoeWeights make_weights(int64_t num_experts, int64_t hidden, int64_t inter, uint32_t seed,
                               bool with_bias = false) {
  MoeWeights m;
  m.num_experts = num_experts;
  m.hidden = hidden;
  m.inter = inter;
  for (int64_t e = 0; e < num_experts; ++e) {
    const uint32_t s = seed + static_cast<uint32_t>(e) * 3;
    const std::vector<float> gate = random_matrix(inter, hidden, Dist::kNormal, s, 0.02f);
    const std::vector<float> up = random_matrix(inter, hidden, Dist::kNormal, s + 1, 0.05f);
    const std::vector<float> down = random_matrix(hidden, inter, Dist::kHeavyTailed, s + 2);
    const float shared = nvfp4_global_scale(std::max(abs_max(gate.data(), gate.size()), abs_max(up.data(), up.size())));
    ExpertWeights x;
    x.gate = quantize_nvfp4(gate.data(), inter, hidden, shared);
    x.up = quantize_nvfp4(up.data(), inter, hidden, shared);
    x.down = quantize_nvfp4(down.data(), hidden, inter);
    x.gate.input_scale = x.up.input_scale = 0.01f * static_cast<float>(e + 1);
    x.down.input_scale = 0.002f * static_cast<float>(e + 1);
    if (with_bias) {
      for (int64_t i = 0; i < inter; ++i) {
        // Values exact in bf16, so a BF16 copy of the bias loads back equal.
        x.gate_bias.push_back(bf16_to_float(float_to_bf16(0.01f * static_cast<float>(i - e))));
        x.up_bias.push_back(bf16_to_float(float_to_bf16(-0.02f * static_cast<float>(i + e))));
      }
      for (int64_t i = 0; i < hidden; ++i)
        x.down_bias.push_back(bf16_to_float(float_to_bf16(0.003f * static_cast<float>(i))));
    }
    m.experts.push_back(std::move(x));
  }
  return m;
}

inline void expect_same_matrix(const Nvfp4Matrix& a, const Nvfp4Matrix& b, const std::string& what) {
  EXPECT_EQ(a.rows, b.rows) << what;
  EXPECT_EQ(a.cols, b.cols) << what;
  EXPECT_TRUE(a.packed == b.packed) << what << ": packed bytes differ";
  EXPECT_TRUE(a.scales == b.scales) << what << ": scales differ";
  EXPECT_EQ(a.global_scale, b.global_scale) << what;
  EXPECT_EQ(a.input_scale, b.input_scale) << what;
}

inline void expect_same_weights(const MoeWeights& a, const MoeWeights& b) {
  ASSERT_EQ(a.num_experts, b.num_experts);
  EXPECT_EQ(a.hidden, b.hidden);
  EXPECT_EQ(a.inter, b.inter);
  ASSERT_EQ(a.experts.size(), b.experts.size());
  EXPECT_EQ(a.has_bias(), b.has_bias());
  for (size_t e = 0; e < a.experts.size(); ++e) {
    const std::string tag = "expert " + std::to_string(e);
    expect_same_matrix(a.experts[e].gate, b.experts[e].gate, tag + " gate");
    expect_same_matrix(a.experts[e].up, b.experts[e].up, tag + " up");
    expect_same_matrix(a.experts[e].down, b.experts[e].down, tag + " down");
    EXPECT_EQ(a.experts[e].gate_bias, b.experts[e].gate_bias) << tag;
    EXPECT_EQ(a.experts[e].up_bias, b.experts[e].up_bias) << tag;
    EXPECT_EQ(a.experts[e].down_bias, b.experts[e].down_bias) << tag;
  }
}

// Copies every tensor of `src` into a new file `dst`; `edit` may add
// replacements to the writer and returns false to drop the original.
using Edit = std::function<bool(const TensorView&, SafetensorsWriter&)>;

inline void rewrite(const std::string& src, const std::string& dst, const Edit& edit) {
  const SafetensorsFile in = SafetensorsFile::open(src);
  SafetensorsWriter out;
  for (const std::string& name : in.names()) {
    const TensorView& view = in.get(name);
    if (edit(view, out)) out.add(view);
  }
  out.write(dst);
}

class ModeloptCheckpoint : public testing::Test {
 protected:
  static constexpr int64_t kExperts = 3, kHidden = 64, kInter = 32;

  // The layer under test plus tensors a real checkpoint has around it: the
  // router, and layer 33 whose prefix shares "model.layers.3".
  std::string write_checkpoint(const std::string& file, const MoeWeights& w) {
    SafetensorsWriter writer;
    add_moe_weights(writer, w, kPrefix);
    const std::vector<uint16_t> router(static_cast<size_t>(kExperts * kHidden), 0x3F80);
    writer.add(kPrefix + "gate.weight", DType::BF16, {kExperts, kHidden}, router.data(), router.size() * 2);
    add_moe_weights(writer, make_weights(2, 32, 16, 999), "model.layers.33.mlp.");
    const std::string path = dir_ / file;
    writer.write(path);
    return path;
  }

  TempDir dir_;
  MoeWeights weights_ = make_weights(kExperts, kHidden, kInter, 42);
};

}  // namespace fp4moe
