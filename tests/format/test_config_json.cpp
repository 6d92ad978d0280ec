// Tests of src/format/config_json.cpp through the loader: config.json's
// expert count under each key MoE configs use (and a multimodal model's
// text_config) is the count a layer is held to, a count that is not a
// positive integer or a file that is not a JSON object is refused in one
// line, and another quantiser's quantization_config is not read as
// ModelOpt's. The MoE fields per family are tested in
// tests/format/test_model_config.cpp, the Python binding in
// tests/python/test_cpu.py.
#include <gtest/gtest.h>

#include <filesystem>
#include <string>

#include "fp4moe/modelopt.hpp"
#include "fp4moe/safetensors.hpp"
#include "temp_dir.hpp"
#include "checkpoint_fixture.hpp"

namespace fp4moe {
namespace {

namespace fs = std::filesystem;

// With config.json present, its expert count is the one expected: a missing
// expert (any index, the last included) is named against it, and so is an
// index beyond it. Every key MoE configs use is read.
TEST_F(ModeloptCheckpoint, ExpertCountComesFromConfigJson) {
  TempDir ckpt;
  const std::string whole = write_checkpoint("layer.safetensors", weights_);
  const std::string file = ckpt / "model.safetensors";
  const std::string dir = ckpt.path().string();
  const auto without_expert = [&](int64_t missing) {
    fs::remove(file);
    rewrite(whole, file, [&](const TensorView& v, SafetensorsWriter&) {
      return v.name.rfind(kPrefix + "experts." + std::to_string(missing) + ".", 0) != 0;
    });
  };
  for (const std::string key : {"num_experts", "num_local_experts", "n_routed_experts"}) {
    SCOPED_TRACE(key);
    write_text(ckpt / "config.json", R"({"model_type": "x", ")" + key + R"(": 3})");
    fs::copy_file(whole, file, fs::copy_options::overwrite_existing);
    expect_same_weights(weights_, load_moe_weights(dir, kPrefix));
    for (int64_t missing = 0; missing < kExperts; ++missing) {
      without_expert(missing);
      for (const std::string& path : {dir, file}) {
        const std::string msg = error_message([&] { load_moe_weights(path, kPrefix); });
        EXPECT_CONTAINS(msg, "missing tensor '" + expert_tensor_name(kPrefix, missing, "gate_proj", "weight") + "'");
        EXPECT_CONTAINS(msg, "config.json says " + key + " = 3, so experts 0..2 must all be complete");
        EXPECT_ONE_LINE(msg);
      }
    }
  }
  // Without config.json a missing last expert cannot be told from a smaller
  // layer: the largest index found sets the count.
  fs::remove(ckpt / "config.json");
  EXPECT_EQ(load_moe_weights(dir, kPrefix).num_experts, kExperts - 1);

  // A multimodal config keeps the count in text_config; a count below the
  // experts found, or one that is not a positive integer, is refused.
  fs::copy_file(whole, file, fs::copy_options::overwrite_existing);
  write_text(ckpt / "config.json", R"({"text_config": {"num_experts": 3}, "num_experts": 99})");
  EXPECT_EQ(load_moe_weights(dir, kPrefix).num_experts, kExperts);
  write_text(ckpt / "config.json", R"({"num_local_experts": 2})");
  std::string msg = error_message([&] { load_moe_weights(dir, kPrefix); });
  EXPECT_CONTAINS(msg, "tensors of expert 2 under prefix '" + kPrefix + "', but ");
  EXPECT_CONTAINS(msg, "num_local_experts = 2 (experts 0..1)");
  EXPECT_ONE_LINE(msg);
  write_text(ckpt / "config.json", R"({"n_routed_experts": "3"})");
  msg = error_message([&] { load_moe_weights(dir, kPrefix); });
  EXPECT_CONTAINS(msg, "n_routed_experts is \"3\"; expected a positive expert count");
  EXPECT_ONE_LINE(msg);
  write_text(ckpt / "config.json", "[3]");
  msg = error_message([&] { load_moe_weights(dir, kPrefix); });
  EXPECT_CONTAINS(msg, "config.json: expected a JSON object");
  EXPECT_ONE_LINE(msg);
  // Another quantiser's quantization_config is not read as ModelOpt's.
  write_text(ckpt / "config.json", R"({"num_experts": 3, "quantization_config": {"quant_method": 3}})");
  EXPECT_EQ(load_moe_weights(dir, kPrefix).checkpoint_format, "");
}

}  // namespace
}  // namespace fp4moe
