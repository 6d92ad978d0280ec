// The fixture shared by the CLI tests (test_cli.cpp, CPU; test_cli_gpu.cpp,
// GPU): runs the built fp4moe binary with its output captured, in a fresh
// directory per test, and writes a small float checkpoint (4 experts, hidden
// 64, inter 32) that `fp4moe quantize` turns into an NVFP4 one.
//
// The binary is the one CMake built (FP4MOE_CLI_PATH, an absolute path
// compiled in), unless the environment variable FP4MOE_CLI names another:
// binaries carried to a GPU machine find their CLI that way
// (tools/lab/gpu-run sets it).
#pragma once

#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "fp4moe/modelopt.hpp"
#include "fp4moe/nvfp4.hpp"
#include "fp4moe/safetensors.hpp"

namespace fp4moe::cli_test {

namespace fs = std::filesystem;

inline constexpr int64_t kNumExperts = 4;
inline constexpr int64_t kHidden = 64;                           // H
inline constexpr int64_t kInter = 32;                            // I
inline const std::string kStackPrefix = "model.layers.0.mlp.";   // 3-D BF16 stacks
inline const std::string kExpertPrefix = "model.layers.1.mlp.";  // 2-D F32 per-expert tensors
inline const char* const kProjs[] = {"gate_proj", "up_proj", "down_proj"};

// ------------------------------------------------------------ float model

struct FloatExpert {
  std::vector<float> gate;  // [I, H]
  std::vector<float> up;    // [I, H]
  std::vector<float> down;  // [H, I]
};
using FloatLayer = std::vector<FloatExpert>;

inline float round_bf16(float x) { return bf16_to_float(float_to_bf16(x)); }

inline std::vector<float> normal_values(std::mt19937& rng, int64_t count, double stddev, bool bf16) {
  std::normal_distribution<double> dist(0.0, stddev);
  std::vector<float> v(static_cast<size_t>(count));
  for (float& x : v) x = bf16 ? round_bf16(static_cast<float>(dist(rng))) : static_cast<float>(dist(rng));
  return v;
}

// Weights with unit gain per projection. Gate and up differ in scale per
// expert (gate larger for expert 0, up larger for the others), so sharing
// their global scale is visible.
inline FloatLayer random_layer(std::mt19937& rng, bool bf16) {
  FloatLayer layer(kNumExperts);
  for (int64_t e = 0; e < kNumExperts; ++e) {
    FloatExpert& ex = layer[static_cast<size_t>(e)];
    const double gate_gain = e == 0 ? 2.0 : 1.0;
    const double up_gain = e == 0 ? 1.0 : 1.0 + 0.5 * static_cast<double>(e);
    ex.gate = normal_values(rng, kInter * kHidden, gate_gain / std::sqrt(double(kHidden)), bf16);
    ex.up = normal_values(rng, kInter * kHidden, up_gain / std::sqrt(double(kHidden)), bf16);
    ex.down = normal_values(rng, kHidden * kInter, 1.0 / std::sqrt(double(kInter)), bf16);
  }
  return layer;
}

inline const std::vector<float>& projection(const FloatExpert& ex, const std::string& proj) {
  return proj == "gate_proj" ? ex.gate : proj == "up_proj" ? ex.up : ex.down;
}

// ------------------------------------------------------------ file helpers

inline void add_f32(SafetensorsWriter& w, const std::string& name, std::vector<int64_t> shape,
                    const std::vector<float>& v) {
  w.add(name, DType::F32, std::move(shape), v.data(), v.size() * sizeof(float));
}

inline void add_bf16(SafetensorsWriter& w, const std::string& name, std::vector<int64_t> shape,
                     const std::vector<float>& v) {
  std::vector<uint16_t> bits(v.size());
  for (size_t i = 0; i < v.size(); ++i) bits[i] = float_to_bf16(v[i]);
  w.add(name, DType::BF16, std::move(shape), bits.data(), bits.size() * sizeof(uint16_t));
}

inline void add_i32(SafetensorsWriter& w, const std::string& name, std::vector<int64_t> shape,
                    const std::vector<int32_t>& v) {
  w.add(name, DType::I32, std::move(shape), v.data(), v.size() * sizeof(int32_t));
}

inline std::vector<float> read_floats(const TensorView& view) {
  std::vector<float> out(static_cast<size_t>(view.numel()));
  for (size_t i = 0; i < out.size(); ++i) {
    if (view.dtype == DType::F32) {
      std::memcpy(&out[i], view.data + 4 * i, 4);
    } else {
      uint16_t h;
      std::memcpy(&h, view.data + 2 * i, 2);
      out[i] = bf16_to_float(h);
    }
  }
  return out;
}

// `base`.{weight, weight_scale, weight_scale_2} as ModelOpt's W4A16 export
// writes the [rows, cols] float matrix w with amax `amax` (no input_scale):
// dtypes, shapes, the global scale, and codes and block scales bit for bit
// as the library's quantiser makes them.
inline void expect_quantized(const SafetensorsFile& f, const std::string& base, const std::vector<float>& w,
                             int64_t rows, int64_t cols, float amax) {
  SCOPED_TRACE(base);
  ASSERT_TRUE(f.contains(base + ".weight")) << f.path();
  const TensorView& weight = f.get(base + ".weight");
  const TensorView& scale = f.get(base + ".weight_scale");
  const TensorView& scale_2 = f.get(base + ".weight_scale_2");
  EXPECT_EQ(weight.dtype, DType::U8);
  EXPECT_EQ(weight.shape, (std::vector<int64_t>{rows, cols / 2}));
  EXPECT_EQ(scale.dtype, DType::F8_E4M3);
  EXPECT_EQ(scale.shape, (std::vector<int64_t>{rows, cols / 16}));
  EXPECT_EQ(scale_2.dtype, DType::F32);
  EXPECT_TRUE(scale_2.shape.empty());
  EXPECT_FALSE(f.contains(base + ".input_scale")) << "W4A16 writes no input_scale";
  float global_scale = 0.0f;
  std::memcpy(&global_scale, scale_2.data, sizeof(float));
  EXPECT_EQ(global_scale, nvfp4_global_scale(amax));
  const Nvfp4Matrix expected = quantize_nvfp4(w.data(), rows, cols, nvfp4_global_scale(amax));
  EXPECT_TRUE(std::equal(expected.packed.begin(), expected.packed.end(), weight.data)) << "packed codes differ";
  EXPECT_TRUE(std::equal(expected.scales.begin(), expected.scales.end(), scale.data)) << "block scales differ";
}

inline std::string expert_base(const std::string& prefix, int64_t e, const std::string& proj) {
  return prefix + "experts." + std::to_string(e) + "." + proj;
}

// -------------------------------------------------------------- fixture

struct CliResult {
  int exit_code = -1;
  std::string out;
  std::string err;
};

class CliTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const std::string test = ::testing::UnitTest::GetInstance()->current_test_info()->name();
    dir_ = fs::temp_directory_path() / ("fp4moe_test_cli." + std::to_string(getpid()) + "." + test);
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override {
    if (!HasFailure()) fs::remove_all(dir_);  // kept on failure, to look at
  }

  std::string path(const std::string& name) const { return (dir_ / name).string(); }

  static std::string read_text(const std::string& file) {
    std::ifstream in(file);
    std::stringstream ss;
    ss << in.rdbuf();
    return ss.str();
  }

  // The fp4moe binary under test: $FP4MOE_CLI if set and not empty, else the
  // path compiled in.
  static std::string cli_binary() {
    const char* from_env = std::getenv("FP4MOE_CLI");
    return from_env != nullptr && *from_env != '\0' ? std::string(from_env) : std::string(FP4MOE_CLI_PATH);
  }

  // Runs `fp4moe <args>` with stdout and stderr captured.
  CliResult run(const std::string& args) const { return run_with("", args); }

  // The same with a shell prefix (ulimit, trap) before it.
  CliResult run_with(const std::string& shell_prefix, const std::string& args) const {
    const std::string command =
        shell_prefix + " '" + cli_binary() + "' " + args + " >'" + path("stdout") + "' 2>'" + path("stderr") + "'";
    const int status = std::system(command.c_str());
    CliResult result;
    result.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    result.out = read_text(path("stdout"));
    result.err = read_text(path("stderr"));
    return result;
  }

  // The float checkpoint: kStackPrefix's experts as 3-D BF16 stacks,
  // kExpertPrefix's as 2-D F32 tensors, a router gate and a norm (copied) and
  // an attention projection (quantised as a plain linear layer).
  void write_float_checkpoint(const std::string& file) {
    std::mt19937 rng(1234);
    stacked_ = random_layer(rng, /*bf16=*/true);
    per_expert_ = random_layer(rng, /*bf16=*/false);
    router_ = normal_values(rng, kNumExperts * kHidden, 0.1, true);
    norm_ = normal_values(rng, kHidden, 1.0, true);
    o_proj_ = normal_values(rng, kHidden * kHidden, 0.1, false);

    SafetensorsWriter w;
    add_f32(w, "model.layers.0.self_attn.o_proj.weight", {kHidden, kHidden}, o_proj_);
    add_bf16(w, "model.layers.0.post_attention_layernorm.weight", {kHidden}, norm_);
    add_bf16(w, kStackPrefix + "gate.weight", {kNumExperts, kHidden}, router_);
    for (const std::string proj : kProjs) {
      std::vector<float> stack;
      for (const FloatExpert& ex : stacked_)
        stack.insert(stack.end(), projection(ex, proj).begin(), projection(ex, proj).end());
      const bool down = proj == "down_proj";
      add_bf16(w, kStackPrefix + "experts." + proj + ".weight",
               {kNumExperts, down ? kHidden : kInter, down ? kInter : kHidden}, stack);
    }
    for (int64_t e = 0; e < kNumExperts; ++e)
      for (const std::string proj : kProjs) {
        const bool down = proj == "down_proj";
        add_f32(w, expert_base(kExpertPrefix, e, proj) + ".weight", {down ? kHidden : kInter, down ? kInter : kHidden},
                projection(per_expert_[e], proj));
      }
    w.write(file);
  }

  // Float checkpoint quantised by the CLI into q.safetensors.
  std::string quantized_checkpoint() {
    write_float_checkpoint(path("float.safetensors"));
    const CliResult r = run("quantize -q '" + path("float.safetensors") + "' '" + path("q.safetensors") + "'");
    EXPECT_EQ(r.exit_code, 0) << r.err;
    return path("q.safetensors");
  }

  fs::path dir_;
  FloatLayer stacked_, per_expert_;
  std::vector<float> router_, norm_, o_proj_;
};

}  // namespace fp4moe::cli_test
