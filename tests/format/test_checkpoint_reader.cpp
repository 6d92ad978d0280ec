// Tests of src/format/checkpoint_reader.cpp: a checkpoint read as one
// .safetensors file, a sharded directory with model.safetensors.index.json
// (a stray file beside it ignored) and a directory of loose shards; one
// shard held to its directory's configs and naming the shard that holds
// what it lacks; the tensor listing the CLI uses (checkpoint_tensor_names);
// and one test per error (missing paths, a broken index, an index naming
// files outside the checkpoint, a tensor in two loose files), each message
// naming the file.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <string>
#include <tuple>
#include <vector>

#include "format/checkpoint_reader.hpp"
#include "fp4moe/modelopt.hpp"
#include "fp4moe/safetensors.hpp"
#include "temp_dir.hpp"
#include "checkpoint_fixture.hpp"

namespace fp4moe {
namespace {

namespace fs = std::filesystem;

// Splits `file` into two shards by expert (0..1 and the rest, plus every
// non-expert tensor in the second), returning the weight_map.
WeightMap split_into_shards(const std::string& file, const TempDir& dir, const std::string& shard1,
                            const std::string& shard2) {
  const SafetensorsFile in = SafetensorsFile::open(file);
  SafetensorsWriter a, b;
  WeightMap weight_map;
  for (const std::string& name : in.names()) {
    const bool first = name.rfind(kPrefix + "experts.0.", 0) == 0 || name.rfind(kPrefix + "experts.1.", 0) == 0;
    (first ? a : b).add(in.get(name));
    weight_map[name] = first ? shard1 : shard2;
  }
  a.write(dir / shard1);
  b.write(dir / shard2);
  return weight_map;
}

TEST_F(ModeloptCheckpoint, RoundTripShardedDirectoryWithIndex) {
  TempDir ckpt;
  const std::string file = write_checkpoint("whole.safetensors", weights_);
  const WeightMap weight_map =
      split_into_shards(file, ckpt, "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors");
  write_text(ckpt / "model.safetensors.index.json", index_json(weight_map));
  write_text(ckpt / "hf_quant_config.json",
             R"({"producer": {"name": "modelopt", "version": "0.31.0"},
                 "quantization": {"quant_algo": "NVFP4", "kv_cache_quant_algo": null,
                                  "group_size": 16, "exclude_modules": ["lm_head"]}})");
  // A stray file the index does not mention is ignored.
  fs::copy_file(file, ckpt / "stray.safetensors");
  expect_same_weights(weights_, load_moe_weights(ckpt.path().string(), kPrefix));
}

// One shard of a sharded checkpoint reads its directory's configs; a layer
// that continues in another shard is refused with that shard named.
TEST_F(ModeloptCheckpoint, OneShardOfADirectoryReadsItsConfigsAndNamesTheOtherShard) {
  TempDir ckpt;
  const std::string file = write_checkpoint("whole.safetensors", weights_);
  write_text(ckpt / "model.safetensors.index.json",
             index_json(split_into_shards(file, ckpt, "model-00001-of-00002.safetensors",
                                          "model-00002-of-00002.safetensors")));
  write_text(ckpt / "hf_quant_config.json", R"({"quantization": {"quant_algo": "W4A16_NVFP4", "group_size": 16}})");
  write_text(ckpt / "config.json", R"({"model_type": "qwen3_moe", "num_experts": 3})");
  expect_same_weights(weights_, load_moe_weights(ckpt.path().string(), kPrefix));

  // The first shard holds experts 0 and 1 (the last one missing), the
  // second the rest (the first missing).
  for (const auto& [shard, missing, other] :
       {std::tuple{"model-00001-of-00002.safetensors", 2, "model-00002-of-00002.safetensors"},
        std::tuple{"model-00002-of-00002.safetensors", 0, "model-00001-of-00002.safetensors"}}) {
    SCOPED_TRACE(shard);
    const std::string msg = error_message([&] { load_moe_weights(ckpt / shard, kPrefix); });
    EXPECT_CONTAINS(msg, "missing tensor '" + expert_tensor_name(kPrefix, missing, "gate_proj", "weight") + "'");
    EXPECT_CONTAINS(msg, "num_experts = 3");
    EXPECT_CONTAINS(msg, "puts it in " + (ckpt / other) + ": pass the directory");
    EXPECT_ONE_LINE(msg);
  }
}

TEST_F(ModeloptCheckpoint, RoundTripDirectoryWithoutIndex) {
  TempDir ckpt;
  const std::string file = write_checkpoint("whole.safetensors", weights_);
  split_into_shards(file, ckpt, "a.safetensors", "b.safetensors");
  expect_same_weights(weights_, load_moe_weights(ckpt.path().string(), kPrefix));

  // A tensor in two loose files is ambiguous.
  fs::copy_file(ckpt / "a.safetensors", ckpt / "c.safetensors");
  const std::string msg = error_message([&] { load_moe_weights(ckpt.path().string(), kPrefix); });
  EXPECT_CONTAINS(msg, "c.safetensors");
  EXPECT_CONTAINS(msg, "experts.");
}

// checkpoint_tensor_names (format/checkpoint.hpp, for the CLI) lists what
// the loader sees: the same names from one file, from indexed shards (a stray
// file the index does not name is not listed) and from loose shards.
TEST_F(ModeloptCheckpoint, TensorNamesAreTheLoadersView) {
  const std::string file = write_checkpoint("whole.safetensors", weights_);
  std::vector<std::string> expected = SafetensorsFile::open(file).names();
  std::sort(expected.begin(), expected.end());
  EXPECT_EQ(checkpoint_tensor_names(file), expected);

  TempDir indexed, loose;
  write_text(indexed / "model.safetensors.index.json",
             index_json(split_into_shards(file, indexed, "a.safetensors", "b.safetensors")));
  fs::copy_file(file, indexed / "stray.safetensors");
  EXPECT_EQ(checkpoint_tensor_names(indexed.path().string()), expected);
  split_into_shards(file, loose, "a.safetensors", "b.safetensors");
  EXPECT_EQ(checkpoint_tensor_names(loose.path().string()), expected);
}

TEST_F(ModeloptCheckpoint, MissingPathsAreNamed) {
  EXPECT_CONTAINS(error_message([&] { load_moe_weights(dir_ / "nope.safetensors", kPrefix); }), "nope.safetensors");
  TempDir empty;
  EXPECT_CONTAINS(error_message([&] { load_moe_weights(empty.path().string(), kPrefix); }), "no *.safetensors file");
  // An index that points at a shard that is not there.
  WeightMap weight_map;
  const SafetensorsFile whole = SafetensorsFile::open(write_checkpoint("layer.safetensors", weights_));
  for (const std::string& name : whole.names()) weight_map[name] = "gone.safetensors";
  write_text(empty / "model.safetensors.index.json", index_json(weight_map));
  EXPECT_CONTAINS(error_message([&] { load_moe_weights(empty.path().string(), kPrefix); }), "gone.safetensors");
}

// A broken index is named, with what is wrong, by the loader and by the
// listing alike (one reader).
TEST_F(ModeloptCheckpoint, IndexErrorsNameTheIndex) {
  TempDir ckpt;
  const std::string dir = ckpt.path().string();
  const auto expect_both = [&](const std::string& index_text, const std::string& fragment) {
    write_text(ckpt / "model.safetensors.index.json", index_text);
    for (const std::string& msg : {error_message([&] { load_moe_weights(dir, kPrefix); }),
                                   error_message([&] { checkpoint_tensor_names(dir); })}) {
      EXPECT_CONTAINS(msg, "model.safetensors.index.json");
      EXPECT_CONTAINS(msg, fragment);
    }
  };
  expect_both("{not json", "not valid JSON");
  expect_both(R"({"metadata": {}})", "expected an object with a \"weight_map\" object");
  expect_both(R"({"weight_map": {"a.weight": 3}})", "weight_map[\"a.weight\"] is 3; expected a shard file name");
}

// The index may name shard files inside the checkpoint directory only:
// absolute paths and ".." would make the loader open any file.
TEST_F(ModeloptCheckpoint, IndexMayNotNameFilesOutsideTheCheckpoint) {
  TempDir ckpt;
  const std::string dir = ckpt.path().string();
  const SafetensorsFile whole = SafetensorsFile::open(write_checkpoint("layer.safetensors", weights_));
  for (const std::string& shard : {std::string("../layer.safetensors"), dir_ / "layer.safetensors",
                                   std::string("sub/../../layer.safetensors"), std::string("")}) {
    WeightMap weight_map;
    for (const std::string& name : whole.names()) weight_map[name] = shard;
    write_text(ckpt / "model.safetensors.index.json", index_json(weight_map));
    for (const std::string& msg : {error_message([&] { load_moe_weights(dir, kPrefix); }),
                                   error_message([&] { checkpoint_tensor_names(dir); })}) {
      EXPECT_CONTAINS(msg, "model.safetensors.index.json");
      EXPECT_CONTAINS(msg, "expected the name of a shard file inside the checkpoint directory");
    }
  }
  // A subdirectory of the checkpoint is inside it.
  std::filesystem::create_directory(ckpt / "sub");
  std::filesystem::copy_file(dir_ / "layer.safetensors", ckpt / "sub/layer.safetensors");
  WeightMap weight_map;
  for (const std::string& name : whole.names()) weight_map[name] = "sub/layer.safetensors";
  write_text(ckpt / "model.safetensors.index.json", index_json(weight_map));
  expect_same_weights(weights_, load_moe_weights(dir, kPrefix));
}

}  // namespace
}  // namespace fp4moe
