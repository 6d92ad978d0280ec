// Tests of src/format/quant_config.cpp through the loader: each declared
// format (hf_quant_config.json's NVFP4, W4A16_NVFP4 and MIXED_PRECISION,
// config.json's quantization_config) loads or is refused in one line naming
// the file, the format and the layer, through a directory and through one
// file in it.
#include <gtest/gtest.h>

#include <filesystem>
#include <string>
#include <vector>

#include "fp4moe/modelopt.hpp"
#include "temp_dir.hpp"
#include "checkpoint_fixture.hpp"

namespace fp4moe {
namespace {

namespace fs = std::filesystem;

// hf_quant_config.json: NVFP4 (W4A4) and W4A16_NVFP4 with group size 16
// load, through the directory and through one file in it; anything else is
// refused in one line naming the format.
TEST_F(ModeloptCheckpoint, QuantConfigMustSayNvfp4OrW4a16Nvfp4WithGroupSize16) {
  TempDir ckpt;
  fs::copy_file(write_checkpoint("layer.safetensors", weights_), ckpt / "model.safetensors");
  const std::string config = ckpt / "hf_quant_config.json";
  const std::string dir = ckpt.path().string();
  const std::string file = ckpt / "model.safetensors";

  for (const std::string algo : {"NVFP4", "W4A16_NVFP4"}) {
    SCOPED_TRACE(algo);
    write_text(config, R"({"quantization": {"quant_algo": ")" + algo + R"(", "group_size": 16}})");
    for (const std::string& path : {dir, file}) {
      const MoeWeights loaded = load_moe_weights(path, kPrefix);
      expect_same_weights(weights_, loaded);
      EXPECT_EQ(loaded.checkpoint_format, algo);
    }
  }
  // Without a config the format is not known.
  EXPECT_EQ(load_moe_weights(write_checkpoint("bare.safetensors", weights_), kPrefix).checkpoint_format, "");

  const auto expect_refused = [&](const std::string& text, const std::vector<std::string>& fragments) {
    SCOPED_TRACE(text);
    write_text(config, text);
    for (const std::string& path : {dir, file}) {  // one file honours its directory's config too
      const std::string msg = error_message([&] { load_moe_weights(path, kPrefix); });
      EXPECT_CONTAINS(msg, "hf_quant_config.json");
      for (const std::string& fragment : fragments) EXPECT_CONTAINS(msg, fragment);
      EXPECT_ONE_LINE(msg);
    }
  };
  expect_refused(R"({"quantization": {"quant_algo": "FP8", "group_size": 16}})", {"quant_algo \"FP8\""});
  expect_refused(R"({"quantization": {"quant_algo": "W4A16_NVFP4", "group_size": 32}})",
                 {"W4A16_NVFP4 with group_size 32; expected 16"});
  expect_refused(R"({"quantization": {"quant_algo": "NVFP4"}})", {"group_size"});
  expect_refused(R"({"quantization": {"group_size": 16}})", {"quant_algo"});
  expect_refused(R"({"producer": {}})", {"quantization"});
  expect_refused("{not json", {"not valid JSON"});
  expect_refused(R"({"quantization": {"quant_algo": "MIXED_PRECISION"}})", {"quantized_layers"});
}

// A MIXED_PRECISION export loads the layers whose experts are NVFP4 with
// group size 16 and refuses, in one line naming format and layer, the others.
TEST_F(ModeloptCheckpoint, MixedPrecisionLoadsItsNvfp4Layers) {
  TempDir ckpt;
  fs::copy_file(write_checkpoint("layer.safetensors", weights_), ckpt / "model.safetensors");
  const std::string dir = ckpt.path().string();
  // Layer 3's experts as `layer3`, layer 33's as `layer33`, an attention
  // projection in FP8 (ModelOpt lists every quantised module).
  const auto write_config = [&](const std::string& layer3, const std::string& layer33) {
    std::string layers = R"("model.layers.3.self_attn.o_proj": {"quant_algo": "FP8"})";
    for (int64_t e = 0; e < kExperts; ++e)
      for (const char* proj : {"gate_proj", "up_proj", "down_proj"})
        layers += ",\n\"" + kPrefix + "experts." + std::to_string(e) + "." + proj + "\": " + layer3;
    for (int64_t e = 0; e < 2; ++e)
      layers += ",\n\"model.layers.33.mlp.experts." + std::to_string(e) + ".gate_proj\": " + layer33;
    write_text(ckpt / "hf_quant_config.json",
               R"({"quantization": {"quant_algo": "MIXED_PRECISION", "quantized_layers": {)" + layers + "}}}");
  };
  const std::string nvfp4 = R"({"quant_algo": "NVFP4", "group_size": 16})";
  const std::string w4a16 = R"({"quant_algo": "W4A16_NVFP4", "group_size": 16})";

  write_config(nvfp4, R"({"quant_algo": "W4A8_AWQ", "group_size": 128})");
  MoeWeights loaded = load_moe_weights(dir, kPrefix);
  expect_same_weights(weights_, loaded);
  EXPECT_EQ(loaded.checkpoint_format, "NVFP4");
  std::string msg = error_message([&] { load_moe_weights(dir, "model.layers.33.mlp."); });
  EXPECT_CONTAINS(msg, "layer 'model.layers.33.mlp.experts.0.gate_proj' is quant_algo \"W4A8_AWQ\"");
  EXPECT_ONE_LINE(msg);

  write_config(w4a16, R"({"quant_algo": "NVFP4", "group_size": 32})");
  EXPECT_EQ(load_moe_weights(dir, kPrefix).checkpoint_format, "W4A16_NVFP4");
  msg = error_message([&] { load_moe_weights(ckpt / "model.safetensors", "model.layers.33.mlp."); });
  EXPECT_CONTAINS(msg, "layer 'model.layers.33.mlp.experts.0.gate_proj' is NVFP4 with group_size 32; expected 16");
  EXPECT_ONE_LINE(msg);

  // transformers' fused experts are listed once, as the experts module.
  write_text(ckpt / "hf_quant_config.json",
             R"({"quantization": {"quant_algo": "MIXED_PRECISION", "quantized_layers": {
                 "model.layers.3.self_attn.o_proj": {"quant_algo": "FP8"},
                 ")" +
                 kPrefix + R"(experts": {"quant_algo": "W4A16_NVFP4", "group_size": 16},
                 "model.layers.33.mlp.experts": {"quant_algo": "NVFP4", "group_size": 32}}}})");
  loaded = load_moe_weights(dir, kPrefix);
  expect_same_weights(weights_, loaded);
  EXPECT_EQ(loaded.checkpoint_format, "W4A16_NVFP4");
  msg = error_message([&] { load_moe_weights(dir, "model.layers.33.mlp."); });
  EXPECT_CONTAINS(msg, "layer 'model.layers.33.mlp.experts' is NVFP4 with group_size 32; expected 16");
  EXPECT_ONE_LINE(msg);

  // A layer whose experts quantized_layers does not list was left unquantised.
  write_text(ckpt / "hf_quant_config.json",
             R"({"quantization": {"quant_algo": "MIXED_PRECISION", "quantized_layers": {
                 "model.layers.33.mlp.experts.0.gate_proj": {"quant_algo": "NVFP4", "group_size": 16}}}})");
  msg = error_message([&] { load_moe_weights(dir, kPrefix); });
  EXPECT_CONTAINS(msg, "lists no expert of prefix '" + kPrefix + "'");
  EXPECT_ONE_LINE(msg);
}

// Without hf_quant_config.json, config.json's quantization_config (as
// ModelOpt writes it: quant_method "modelopt", group size in config_groups)
// declares the format.
TEST_F(ModeloptCheckpoint, ConfigJsonQuantizationConfigDeclaresTheFormat) {
  TempDir ckpt;
  fs::copy_file(write_checkpoint("layer.safetensors", weights_), ckpt / "model.safetensors");
  const std::string dir = ckpt.path().string();
  const auto write_config = [&](const std::string& algo, int group_size) {
    write_text(ckpt / "config.json", R"({"model_type": "qwen3_moe", "quantization_config": {
        "quant_method": "modelopt", "quant_algo": ")" +
                                         algo + R"(", "ignore": ["lm_head"],
        "config_groups": {"group_0": {"weights": {"num_bits": 4, "type": "float", "group_size": )" +
                                         std::to_string(group_size) + R"(}, "targets": ["Linear"]}}}})");
  };
  write_config("NVFP4", 16);
  const MoeWeights loaded = load_moe_weights(dir, kPrefix);
  expect_same_weights(weights_, loaded);
  EXPECT_EQ(loaded.checkpoint_format, "NVFP4");

  write_config("NVFP4", 32);
  std::string msg = error_message([&] { load_moe_weights(dir, kPrefix); });
  EXPECT_CONTAINS(msg, "config.json (quantization_config)");
  EXPECT_CONTAINS(msg, "group_size 32");
  EXPECT_ONE_LINE(msg);
  write_config("FP8", 16);
  msg = error_message([&] { load_moe_weights(ckpt / "model.safetensors", kPrefix); });
  EXPECT_CONTAINS(msg, "quant_algo \"FP8\"");
  EXPECT_ONE_LINE(msg);

  // hf_quant_config.json, where present, is the one read.
  write_text(ckpt / "hf_quant_config.json", R"({"quantization": {"quant_algo": "W4A16_NVFP4", "group_size": 16}})");
  EXPECT_EQ(load_moe_weights(dir, kPrefix).checkpoint_format, "W4A16_NVFP4");
}

}  // namespace
}  // namespace fp4moe
