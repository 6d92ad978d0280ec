// Tests of src/format/checkpoint_writer.cpp: add_moe_weights writes a layer
// in ModelOpt's layout (names, dtypes, shapes, the matrix's bytes), gate and
// up keep the global scale of their joint amax, and inconsistent weights are
// refused naming the expert. Every round trip of
// tests/format/test_moe_weights_reader.cpp reads what it writes.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "fp4moe/modelopt.hpp"
#include "fp4moe/safetensors.hpp"
#include "checkpoint_fixture.hpp"

namespace fp4moe {
namespace {

namespace fs = std::filesystem;

TEST_F(ModeloptCheckpoint, WritesModeloptLayout) {
  const std::string path = write_checkpoint("layer.safetensors", weights_);
  const SafetensorsFile f = SafetensorsFile::open(path);
  auto check = [&](const std::string& name, DType dtype, std::vector<int64_t> shape) {
    ASSERT_TRUE(f.contains(name)) << name;
    EXPECT_EQ(f.get(name).dtype, dtype) << name;
    EXPECT_EQ(f.get(name).shape, shape) << name;
  };
  for (int64_t e = 0; e < kExperts; ++e) {
    for (const char* proj : {"gate_proj", "up_proj", "down_proj"}) {
      const bool down = std::string(proj) == "down_proj";
      const int64_t n = down ? kHidden : kInter, k = down ? kInter : kHidden;
      check(expert_tensor_name(kPrefix, e, proj, "weight"), DType::U8, {n, k / 2});
      check(expert_tensor_name(kPrefix, e, proj, "weight_scale"), DType::F8_E4M3, {n, k / 16});
      check(expert_tensor_name(kPrefix, e, proj, "weight_scale_2"), DType::F32, {});
      check(expert_tensor_name(kPrefix, e, proj, "input_scale"), DType::F32, {});
      EXPECT_FALSE(f.contains(expert_tensor_name(kPrefix, e, proj, "bias")));
    }
  }
  // The bytes are the matrix's, unchanged.
  const TensorView& v = f.get(expert_tensor_name(kPrefix, 1, "down_proj", "weight"));
  EXPECT_EQ(std::memcmp(v.data, weights_.experts[1].down.packed.data(), v.nbytes), 0);
}

// Gate and up quantised with the scale of their joint amax: the larger one
// reaches block scale 448, the smaller one never does.
TEST_F(ModeloptCheckpoint, GateAndUpShareTheGlobalScaleOfTheirJointAmax) {
  const ExpertWeights& x = weights_.experts[0];
  EXPECT_EQ(x.gate.global_scale, x.up.global_scale);
  const auto has_448 = [](const Nvfp4Matrix& m) {
    return std::find(m.scales.begin(), m.scales.end(), 0x7E) != m.scales.end();
  };
  EXPECT_TRUE(has_448(x.up));  // up is drawn 2.5x wider than gate
  EXPECT_FALSE(has_448(x.gate));

  MoeWeights bad = weights_;
  bad.experts[1].up.global_scale *= 1.5f;
  SafetensorsWriter writer;
  const std::string msg = error_message([&] { add_moe_weights(writer, bad, kPrefix); });
  EXPECT_CONTAINS(msg, "expert 1");
  EXPECT_CONTAINS(msg, "shares one weight_scale_2");
}

TEST_F(ModeloptCheckpoint, AddRejectsInconsistentWeights) {
  SafetensorsWriter writer;
  MoeWeights w = weights_;
  w.num_experts = 4;
  EXPECT_CONTAINS(error_message([&] { add_moe_weights(writer, w, kPrefix); }), "num_experts");
  w = weights_;
  w.experts[2].down = quantize_nvfp4(std::vector<float>(kHidden * 16, 1.0f).data(), kHidden, 16);
  const std::string msg = error_message([&] { add_moe_weights(writer, w, kPrefix); });
  EXPECT_CONTAINS(msg, "expert 2 down_proj");
  EXPECT_CONTAINS(msg, "[64, 16], expected [64, 32]");
}

}  // namespace
}  // namespace fp4moe
