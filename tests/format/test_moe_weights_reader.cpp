// Tests of src/format/moe_weights_reader.cpp (and the names of
// src/format/expert_names.cpp): an MoE layer loaded from a ModelOpt
// checkpoint by round trips through add_moe_weights (a single file with
// another layer beside it, biases in F32 and BF16, shape-[1] scalars, a
// missing input_scale, Mixtral's names, shared experts), and one test per
// error, each checking that the one-line message names the offending
// tensor: missing tensors, experts and biases, wrong dtypes and shapes
// (the first named, the rest counted), gate and up scales that differ,
// unusable input scales, stacked expert tensors, a wrong prefix, and the
// hostile inputs found by fuzzing (fuzz/fuzz_modelopt.cpp).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "expect_error.hpp"
#include "fp4moe/modelopt.hpp"
#include "fp4moe/nvfp4.hpp"
#include "fp4moe/safetensors.hpp"
#include "checkpoint_fixture.hpp"

namespace fp4moe {
namespace {

namespace fs = std::filesystem;

TEST_F(ModeloptCheckpoint, ExpertTensorName) {
  EXPECT_EQ(expert_tensor_name("model.layers.3.mlp.", 7, "down_proj", "weight_scale_2"),
            "model.layers.3.mlp.experts.7.down_proj.weight_scale_2");
  EXPECT_EQ(expert_tensor_name("", 0, "gate_proj", "weight"), "experts.0.gate_proj.weight");
}

TEST_F(ModeloptCheckpoint, RoundTripSingleFile) {
  const std::string path = write_checkpoint("layer.safetensors", weights_);
  const MoeWeights loaded = load_moe_weights(path, kPrefix);
  expect_same_weights(weights_, loaded);
  EXPECT_EQ(loaded.num_experts, kExperts);
  EXPECT_EQ(loaded.hidden, kHidden);
  EXPECT_EQ(loaded.inter, kInter);
  EXPECT_FALSE(loaded.has_bias());
  // Gate and up share the global scale; down has its own.
  for (const ExpertWeights& x : loaded.experts) {
    EXPECT_EQ(x.gate.global_scale, x.up.global_scale);
    EXPECT_NE(x.gate.global_scale, x.down.global_scale);
  }
  // The other layer loads too, with its own shapes.
  const MoeWeights other = load_moe_weights(path, "model.layers.33.mlp.");
  EXPECT_EQ(other.num_experts, 2);
  EXPECT_EQ(other.hidden, 32);
  EXPECT_EQ(other.inter, 16);
}

TEST_F(ModeloptCheckpoint, RoundTripWithBiasesF32AndBf16) {
  const MoeWeights w = make_weights(kExperts, kHidden, kInter, 5, /*with_bias=*/true);
  const std::string path = write_checkpoint("bias.safetensors", w);
  const MoeWeights loaded = load_moe_weights(path, kPrefix);
  EXPECT_TRUE(loaded.has_bias());
  expect_same_weights(w, loaded);

  // The same biases stored as BF16 load to the same floats.
  const std::string bf16_path = dir_ / "bias_bf16.safetensors";
  rewrite(path, bf16_path, [](const TensorView& v, SafetensorsWriter& out) {
    if (v.name.size() < 5 || v.name.substr(v.name.size() - 5) != ".bias") return true;
    std::vector<uint16_t> h(static_cast<size_t>(v.numel()));
    for (size_t i = 0; i < h.size(); ++i) {
      float f;
      std::memcpy(&f, v.data + 4 * i, 4);
      h[i] = float_to_bf16(f);
    }
    out.add(v.name, DType::BF16, v.shape, h.data(), h.size() * 2);
    return false;
  });
  expect_same_weights(w, load_moe_weights(bf16_path, kPrefix));
}

// Scalars of shape [1] are accepted like 0-d ones, and a missing input_scale
// means 1.0.
TEST_F(ModeloptCheckpoint, AcceptsShapeOneScalarsAndMissingInputScale) {
  const std::string path = write_checkpoint("layer.safetensors", weights_);
  const std::string edited = dir_ / "edited.safetensors";
  rewrite(path, edited, [](const TensorView& v, SafetensorsWriter& out) {
    if (v.name.find("input_scale") != std::string::npos) return false;
    if (v.name.find("weight_scale_2") != std::string::npos) {
      out.add(v.name, v.dtype, {1}, v.data, v.nbytes);
      return false;
    }
    return true;
  });
  MoeWeights expected = weights_;
  for (ExpertWeights& x : expected.experts) x.gate.input_scale = x.up.input_scale = x.down.input_scale = 1.0f;
  const MoeWeights loaded = load_moe_weights(edited, kPrefix);
  expect_same_weights(expected, loaded);
  for (const ExpertWeights& x : loaded.experts)
    EXPECT_FALSE(x.gate.has_input_scale || x.up.has_input_scale || x.down.has_input_scale);
  for (const ExpertWeights& x : load_moe_weights(path, kPrefix).experts)
    EXPECT_TRUE(x.gate.has_input_scale && x.up.has_input_scale && x.down.has_input_scale);
}

// An input_scale W4A4 could not use (zero, negative, non-finite, outside
// [1e-15, 1e15]) is refused on load, in one line naming the tensor.
TEST_F(ModeloptCheckpoint, RefusesUnusableInputScales) {
  const std::string path = write_checkpoint("layer.safetensors", weights_);
  const std::string bad = expert_tensor_name(kPrefix, 2, "down_proj", "input_scale");
  for (const float value :
       {0.0f, -0.5f, std::numeric_limits<float>::infinity(), std::numeric_limits<float>::quiet_NaN(), 1e-20f, 3e15f}) {
    const std::string edited = dir_ / "edited.safetensors";
    rewrite(path, edited, [&](const TensorView& v, SafetensorsWriter& out) {
      if (v.name != bad) return true;
      out.add(v.name, DType::F32, {}, &value, sizeof value);
      return false;
    });
    const std::string message = error_message([&] { load_moe_weights(edited, kPrefix); });
    EXPECT_CONTAINS(message, "'" + bad + "'");
    EXPECT_CONTAINS(message, "expected a finite input_scale in [");
    EXPECT_EQ(message.find('\n'), std::string::npos) << message;
  }
}

// ------------------------------------------------------------ load errors

TEST_F(ModeloptCheckpoint, MissingTensorIsNamed) {
  const std::string path = write_checkpoint("layer.safetensors", weights_);
  const std::string missing = expert_tensor_name(kPrefix, 1, "up_proj", "weight_scale");
  const std::string edited = dir_ / "edited.safetensors";
  rewrite(path, edited, [&](const TensorView& v, SafetensorsWriter&) { return v.name != missing; });
  const std::string msg = error_message([&] { load_moe_weights(edited, kPrefix); });
  EXPECT_CONTAINS(msg, "'" + missing + "'");
  EXPECT_CONTAINS(msg, "missing");
}

TEST_F(ModeloptCheckpoint, MissingExpertIsNamed) {
  const std::string path = write_checkpoint("layer.safetensors", weights_);
  const std::string edited = dir_ / "edited.safetensors";
  rewrite(path, edited,
          [](const TensorView& v, SafetensorsWriter&) { return v.name.rfind(kPrefix + "experts.1.", 0) != 0; });
  const std::string msg = error_message([&] { load_moe_weights(edited, kPrefix); });
  EXPECT_CONTAINS(msg, "'" + expert_tensor_name(kPrefix, 1, "gate_proj", "weight") + "'");
}

TEST_F(ModeloptCheckpoint, MissingBiasOfOneExpertIsNamed) {
  const std::string path = write_checkpoint("bias.safetensors", make_weights(kExperts, kHidden, kInter, 5, true));
  const std::string missing = expert_tensor_name(kPrefix, 2, "down_proj", "bias");
  const std::string edited = dir_ / "edited.safetensors";
  rewrite(path, edited, [&](const TensorView& v, SafetensorsWriter&) { return v.name != missing; });
  EXPECT_CONTAINS(error_message([&] { load_moe_weights(edited, kPrefix); }), "'" + missing + "'");
}

// Each mismatch alone is named on one line with what was expected and
// found; several are reported as the first (in load order: expert by
// expert) and a count of the others.
TEST_F(ModeloptCheckpoint, WrongShapesAndDtypesAreNamedOnOneLine) {
  const std::string path = write_checkpoint("layer.safetensors", weights_);
  const std::string bad_dtype = expert_tensor_name(kPrefix, 0, "up_proj", "weight_scale");
  const std::string bad_scalar = expert_tensor_name(kPrefix, 1, "gate_proj", "input_scale");
  const std::string bad_shape = expert_tensor_name(kPrefix, 2, "down_proj", "weight");
  const std::map<std::string, std::string> expected = {{bad_dtype, "expected F8_E4M3 [32, 4], found U8 [32, 4]"},
                                                       {bad_scalar, "expected F32 [] or [1], found F32 [2]"},
                                                       {bad_shape, "expected U8 [64, 16], found U8 [64, 8]"}};
  const auto edit = [&](const std::set<std::string>& bad) {
    const std::string edited = dir_ / "edited.safetensors";
    rewrite(path, edited, [&](const TensorView& v, SafetensorsWriter& out) {
      if (!bad.count(v.name)) return true;
      if (v.name == bad_shape) {  // [64, 16] -> [64, 8]: K halved
        out.add(v.name, v.dtype, {kHidden, kInter / 4}, v.data, v.nbytes / 2);
      } else if (v.name == bad_dtype) {
        out.add(v.name, DType::U8, v.shape, v.data, v.nbytes);
      } else {  // a [2] vector where a scalar belongs
        const float two[2] = {1.0f, 1.0f};
        out.add(v.name, DType::F32, {2}, two, sizeof two);
      }
      return false;
    });
    return error_message([&] { load_moe_weights(edited, kPrefix); });
  };
  for (const auto& [name, text] : expected) {
    SCOPED_TRACE(name);
    const std::string msg = edit({name});
    EXPECT_CONTAINS(msg, "'" + name + "'");
    EXPECT_CONTAINS(msg, text);
    EXPECT_ONE_LINE(msg);
    EXPECT_EQ(msg.find("more expert tensor"), std::string::npos) << msg;
  }
  const std::string msg = edit({bad_dtype, bad_scalar, bad_shape});
  EXPECT_CONTAINS(msg, "'" + bad_dtype + "'");
  EXPECT_CONTAINS(msg, expected.at(bad_dtype));
  EXPECT_CONTAINS(msg, "and 2 more expert tensor(s) under prefix '" + kPrefix + "'");
  EXPECT_ONE_LINE(msg);
}

// A weight_scale of the wrong dtype in every expert (F32 scales, or U8 bytes
// of an exporter that lost the dtype) is one line naming the first tensor,
// its dtype and the one expected, not a list of every expert's.
TEST_F(ModeloptCheckpoint, WrongWeightScaleDtypeEverywhereIsOneLine) {
  const std::string path = write_checkpoint("layer.safetensors", weights_);
  for (const DType dtype : {DType::F32, DType::U8}) {
    SCOPED_TRACE(dtype_name(dtype));
    const std::string edited = dir_ / "edited.safetensors";
    rewrite(path, edited, [&](const TensorView& v, SafetensorsWriter& out) {
      if (v.name.size() < 13 || v.name.compare(v.name.size() - 13, 13, ".weight_scale") != 0) return true;
      const std::vector<float> f32(static_cast<size_t>(v.numel()), 1.0f);
      if (dtype == DType::F32)
        out.add(v.name, DType::F32, v.shape, f32.data(), f32.size() * sizeof(float));
      else
        out.add(v.name, DType::U8, v.shape, v.data, v.nbytes);
      return false;
    });
    const std::string msg = error_message([&] { load_moe_weights(edited, kPrefix); });
    EXPECT_ONE_LINE(msg);
    EXPECT_CONTAINS(msg, "'" + expert_tensor_name(kPrefix, 0, "gate_proj", "weight_scale") + "'");
    EXPECT_CONTAINS(msg, "expected F8_E4M3 [32, 4], found " + std::string(dtype_name(dtype)) + " [32, 4]");
    EXPECT_CONTAINS(msg, "and " + std::to_string(kExperts * 3 - 1) + " more");
  }
}

TEST_F(ModeloptCheckpoint, ExpertShapesMustAgreeWithExpertZero) {
  // Expert 2 with a different hidden size: all of its tensors mismatch.
  const MoeWeights wider = make_weights(3, kHidden + 16, kInter, 77);
  SafetensorsWriter writer;
  MoeWeights first_two = weights_;
  first_two.experts.resize(2);
  first_two.num_experts = 2;
  add_moe_weights(writer, first_two, kPrefix);
  MoeWeights third = wider;
  third.experts.erase(third.experts.begin(), third.experts.begin() + 2);
  third.num_experts = 1;
  SafetensorsWriter tmp;
  add_moe_weights(tmp, third, "tmp.");
  tmp.write(dir_ / "tmp.safetensors");
  const SafetensorsFile t = SafetensorsFile::open(dir_ / "tmp.safetensors");
  for (const std::string& name : t.names()) {
    TensorView v = t.get(name);
    v.name = kPrefix + "experts.2." + name.substr(std::string("tmp.experts.0.").size());
    writer.add(v);
  }
  writer.write(dir_ / "mixed.safetensors");
  const std::string msg = error_message([&] { load_moe_weights(dir_ / "mixed.safetensors", kPrefix); });
  EXPECT_CONTAINS(msg, "'" + expert_tensor_name(kPrefix, 2, "gate_proj", "weight") + "'");
  EXPECT_CONTAINS(msg, "expected U8 [32, 32], found U8 [32, 40]");
  EXPECT_CONTAINS(msg, "and 5 more expert tensor(s)");  // expert 2's other weights and block scales
  EXPECT_ONE_LINE(msg);
}

TEST_F(ModeloptCheckpoint, DifferingGateUpScale2IsNamed) {
  const std::string path = write_checkpoint("layer.safetensors", weights_);
  const std::string up_scale = expert_tensor_name(kPrefix, 1, "up_proj", "weight_scale_2");
  const std::string edited = dir_ / "edited.safetensors";
  rewrite(path, edited, [&](const TensorView& v, SafetensorsWriter& out) {
    if (v.name != up_scale) return true;
    const float other = 0.123f;
    out.add(v.name, DType::F32, {}, &other, sizeof other);
    return false;
  });
  const std::string msg = error_message([&] { load_moe_weights(edited, kPrefix); });
  EXPECT_CONTAINS(msg, "'" + up_scale + "'");
  EXPECT_CONTAINS(msg, "'" + expert_tensor_name(kPrefix, 1, "gate_proj", "weight_scale_2") + "'");
  EXPECT_CONTAINS(msg, "0.123");
}

// Mixtral's expert names, block_sparse_moe.experts.<e>.{w1,w3,w2} for gate,
// up and down, load like ModelOpt's gate_proj/up_proj/down_proj.
std::string mixtral_name(std::string name) {
  const std::pair<std::string, std::string> renames[] = {
      {".mlp.", ".block_sparse_moe."}, {".gate_proj.", ".w1."}, {".up_proj.", ".w3."}, {".down_proj.", ".w2."}};
  for (const auto& [from, to] : renames)
    if (const size_t at = name.find(from); at != std::string::npos) name.replace(at, from.size(), to);
  return name;
}

TEST_F(ModeloptCheckpoint, MixtralNamesLoad) {
  const std::string path = write_checkpoint("layer.safetensors", weights_);
  const std::string mixtral = dir_ / "mixtral.safetensors";
  rewrite(path, mixtral, [](const TensorView& v, SafetensorsWriter& out) {
    TensorView renamed = v;
    renamed.name = mixtral_name(v.name);
    out.add(renamed);
    return false;
  });
  const std::string prefix = "model.layers.3.block_sparse_moe.";
  expect_same_weights(weights_, load_moe_weights(mixtral, prefix));
  EXPECT_EQ(load_moe_weights(mixtral, "model.layers.33.block_sparse_moe.").num_experts, 2);

  // Errors name the tensors as the checkpoint does.
  const std::string missing = prefix + "experts.2.w3.weight_scale";
  const std::string edited = dir_ / "edited.safetensors";
  rewrite(mixtral, edited, [&](const TensorView& v, SafetensorsWriter&) { return v.name != missing; });
  std::string msg = error_message([&] { load_moe_weights(edited, prefix); });
  EXPECT_CONTAINS(msg, "missing tensor '" + missing + "'");
  EXPECT_ONE_LINE(msg);
  const std::string up_scale = prefix + "experts.1.w3.weight_scale_2";
  rewrite(mixtral, edited, [&](const TensorView& v, SafetensorsWriter& out) {
    if (v.name != up_scale) return true;
    const float other = 0.5f;
    out.add(v.name, DType::F32, {}, &other, sizeof other);
    return false;
  });
  msg = error_message([&] { load_moe_weights(edited, prefix); });
  EXPECT_CONTAINS(msg, "'" + prefix + "experts.1.w1.weight_scale_2' = ");
  EXPECT_CONTAINS(msg, "differs from '" + up_scale + "' = 0.5");
  EXPECT_ONE_LINE(msg);
}

// transformers 5 holds a layer's experts fused in 3-D tensors
// (experts.gate_up_proj [E, 2I, H], experts.down_proj [E, H, I]); the loader
// says that stacked tensors are why it finds no expert.
TEST_F(ModeloptCheckpoint, StackedExpertTensorsAreRefusedWithTheReason) {
  const std::vector<uint16_t> gate_up(static_cast<size_t>(kExperts * 2 * kInter * kHidden), 0x3F80);
  const std::vector<uint16_t> down(static_cast<size_t>(kExperts * kHidden * kInter), 0x3F80);
  SafetensorsWriter fused;
  fused.add(kPrefix + "experts.gate_up_proj", DType::BF16, {kExperts, 2 * kInter, kHidden}, gate_up.data(),
            gate_up.size() * 2);
  fused.add(kPrefix + "experts.down_proj", DType::BF16, {kExperts, kHidden, kInter}, down.data(), down.size() * 2);
  fused.write(dir_ / "fused.safetensors");
  std::string msg = error_message([&] { load_moe_weights(dir_ / "fused.safetensors", kPrefix); });
  EXPECT_CONTAINS(msg, "are stacked expert tensors");
  EXPECT_CONTAINS(msg, "'" + kPrefix + "experts.down_proj'");  // the first name, sorted
  EXPECT_EQ(msg.find("fp4moe quantize"), std::string::npos) << "quantize does not split gate_up_proj: " << msg;
  EXPECT_ONE_LINE(msg);

  // 3-D stacks named per projection, which `fp4moe quantize` splits.
  SafetensorsWriter stacks;
  stacks.add(kPrefix + "experts.gate_proj.weight", DType::BF16, {kExperts, kInter, kHidden}, down.data(),
             down.size() * 2);
  stacks.write(dir_ / "stacks.safetensors");
  msg = error_message([&] { load_moe_weights(dir_ / "stacks.safetensors", kPrefix); });
  EXPECT_CONTAINS(msg, "are stacked expert tensors");
  EXPECT_CONTAINS(msg, "fp4moe quantize");
  EXPECT_ONE_LINE(msg);
}

TEST_F(ModeloptCheckpoint, BadPrefixSaysWhichAndShowsAnExpertName) {
  const std::string path = write_checkpoint("layer.safetensors", weights_);
  std::string msg = error_message([&] { load_moe_weights(path, "model.layers.9.mlp."); });
  EXPECT_CONTAINS(msg, "'model.layers.9.mlp.'");
  EXPECT_CONTAINS(msg, "model.layers.3.mlp.experts.0.");  // an example, and the prefix it has
  EXPECT_CONTAINS(msg, "prefix 'model.layers.3.mlp.'");
  // The prefix without its trailing dot finds nothing either.
  msg = error_message([&] { load_moe_weights(path, "model.layers.3.mlp"); });
  EXPECT_CONTAINS(msg, "'model.layers.3.mlp'");

  // A file without any expert tensors says so.
  SafetensorsWriter writer;
  const float one = 1.0f;
  writer.add("lm_head.weight", DType::F32, {1}, &one, sizeof one);
  writer.write(dir_ / "dense.safetensors");
  msg = error_message([&] { load_moe_weights(dir_ / "dense.safetensors", kPrefix); });
  EXPECT_CONTAINS(msg, "no tensor name contains 'experts.'");
}

// ------------------------------------------------- hostile checkpoints
// Inputs found by fuzzing the loader (fuzz/fuzz_modelopt.cpp; the raw
// inputs are kept in fuzz/regressions/modelopt/ and replayed by ctest).

// An empty gate weight may claim any extent: [0, 2^62] once made
// 2 * shape[1] overflow (UBSan) before the emptiness was noticed.
TEST_F(ModeloptCheckpoint, EmptyGateWeightOfHugeExtentIsRefused) {
  const std::string path = write_checkpoint("layer.safetensors", weights_);
  const std::string gate0 = expert_tensor_name(kPrefix, 0, "gate_proj", "weight");
  const std::string edited = dir_ / "edited.safetensors";
  rewrite(path, edited, [&](const TensorView& v, SafetensorsWriter& out) {
    if (v.name != gate0) return true;
    out.add(v.name, DType::U8, {0, int64_t{1} << 62}, nullptr, 0);
    return false;
  });
  const std::string msg = error_message([&] { load_moe_weights(edited, kPrefix); });
  EXPECT_CONTAINS(msg, "'" + gate0 + "' [0, 4611686018427387904] is empty");
}

// A NaN or infinite bias is named instead of loading silently.
TEST_F(ModeloptCheckpoint, NonFiniteBiasIsNamed) {
  const std::string path = write_checkpoint("bias.safetensors", make_weights(kExperts, kHidden, kInter, 5, true));
  const std::string bad = expert_tensor_name(kPrefix, 1, "up_proj", "bias");
  const std::string edited = dir_ / "edited.safetensors";
  rewrite(path, edited, [&](const TensorView& v, SafetensorsWriter& out) {
    if (v.name != bad) return true;
    std::vector<float> bias(static_cast<size_t>(v.numel()), 0.5f);
    bias[7] = std::numeric_limits<float>::infinity();
    out.add(v.name, DType::F32, v.shape, bias.data(), bias.size() * sizeof(float));
    return false;
  });
  const std::string msg = error_message([&] { load_moe_weights(edited, kPrefix); });
  EXPECT_CONTAINS(msg, "'" + bad + "': element 7 is inf; expected finite biases");
}

// ModelOpt's scales are amax / constant: a negative one is not a checkpoint.
TEST_F(ModeloptCheckpoint, NegativeScaleIsNamed) {
  const std::string path = write_checkpoint("layer.safetensors", weights_);
  const std::string bad = expert_tensor_name(kPrefix, 2, "down_proj", "weight_scale_2");
  const std::string edited = dir_ / "edited.safetensors";
  rewrite(path, edited, [&](const TensorView& v, SafetensorsWriter& out) {
    if (v.name != bad) return true;
    const float negative = -0.25f;
    out.add(v.name, DType::F32, {}, &negative, sizeof negative);
    return false;
  });
  const std::string msg = error_message([&] { load_moe_weights(edited, kPrefix); });
  EXPECT_CONTAINS(msg, "'" + bad + "' is -0.25; expected a finite, non-negative scale");
}

// A shared expert `width` wide: DeepSeek's (no gate) or Qwen2-MoE's (gated).
SharedExpertWeights make_shared_expert(int64_t hidden, int64_t width, bool gated, uint32_t seed) {
  SharedExpertWeights shared;
  shared.inter = width;
  shared.mlp = make_weights(1, hidden, width, seed).experts[0];
  if (gated)
    for (int64_t h = 0; h < hidden; ++h) shared.gate.push_back(0.01f * static_cast<float>(h % 7) - 0.03f);
  return shared;
}

// Shared experts load whole, under DeepSeek's names ("shared_experts.") or
// Qwen2-MoE's ("shared_expert." + "shared_expert_gate.weight"); a set with a
// tensor missing, a gate without its expert, a gated expert without its gate
// and an unquantised one are refused in one line naming the tensor.
TEST_F(ModeloptCheckpoint, SharedExpertLoadsWholeOrIsRefused) {
  for (const bool gated : {false, true}) {
    SCOPED_TRACE(gated ? "Qwen2-MoE shared_expert" : "DeepSeek shared_experts");
    MoeWeights w = weights_;
    w.shared_expert = make_shared_expert(kHidden, 2 * kInter, gated, 7);
    const std::string path = write_checkpoint("shared.safetensors", w);
    const MoeWeights loaded = load_moe_weights(path, kPrefix);
    expect_same_weights(w, loaded);
    ASSERT_TRUE(loaded.shared_expert.has_value());
    EXPECT_EQ(loaded.shared_expert->inter, 2 * kInter);
    expect_same_matrix(w.shared_expert->mlp.gate, loaded.shared_expert->mlp.gate, "shared gate");
    expect_same_matrix(w.shared_expert->mlp.up, loaded.shared_expert->mlp.up, "shared up");
    expect_same_matrix(w.shared_expert->mlp.down, loaded.shared_expert->mlp.down, "shared down");
    EXPECT_EQ(loaded.shared_expert->gate, w.shared_expert->gate);
    EXPECT_FALSE(load_moe_weights(path, "model.layers.33.mlp.").shared_expert.has_value());
    EXPECT_FALSE(load_moe_weights(write_checkpoint("plain.safetensors", weights_), kPrefix).shared_expert);

    const std::string stem = kPrefix + (gated ? "shared_expert." : "shared_experts.");
    const std::string gate = kPrefix + "shared_expert_gate.weight";
    const std::string broken = dir_ / "broken.safetensors";
    const auto drop = [&](const std::function<bool(const std::string&)>& dropped) {
      rewrite(path, broken, [&](const TensorView& v, SafetensorsWriter&) { return !dropped(v.name); });
    };
    drop([&](const std::string& name) { return name == stem + "down_proj.weight_scale"; });
    expect_error([&] { load_moe_weights(broken, kPrefix); },
                 {"missing tensor '" + stem + "down_proj.weight_scale'", "a shared expert needs all of"});
    if (gated) {
      drop([&](const std::string& name) { return name == gate; });
      expect_error([&] { load_moe_weights(broken, kPrefix); }, {"missing tensor '" + gate + "'", "sigmoid"});
      drop([&](const std::string& name) { return name.rfind(stem, 0) == 0; });
      expect_error([&] { load_moe_weights(broken, kPrefix); }, {"'" + gate + "' but no shared expert"});
    }
    // Unquantised (BF16) shared expert weights.
    rewrite(path, broken, [&](const TensorView& v, SafetensorsWriter& out) {
      if (v.name != stem + "gate_proj.weight") return true;
      const std::vector<uint16_t> bf16(static_cast<size_t>(2 * kInter * kHidden), 0x3F80);
      out.add(v.name, DType::BF16, {2 * kInter, kHidden}, bf16.data(), bf16.size() * 2);
      return false;
    });
    expect_error([&] { load_moe_weights(broken, kPrefix); },
                 {"beside an unquantised shared expert '" + stem + "*'", "not a mix"});

    // A shared expert left unquantised (ModelOpt's experts-only configs):
    // float weights, loaded as they are.
    MoeWeights dense_w = w;
    SharedExpertWeights& dense = *dense_w.shared_expert;
    dense.mlp = ExpertWeights{};
    dense.dense_gate_up.resize(static_cast<size_t>(2 * dense.inter * kHidden));
    dense.dense_down.resize(static_cast<size_t>(kHidden * dense.inter));
    for (size_t i = 0; i < dense.dense_gate_up.size(); ++i) dense.dense_gate_up[i] = 0.01f * static_cast<float>(i % 97);
    for (size_t i = 0; i < dense.dense_down.size(); ++i) dense.dense_down[i] = -0.02f * static_cast<float>(i % 89);
    const MoeWeights dense_loaded = load_moe_weights(write_checkpoint("dense.safetensors", dense_w), kPrefix);
    ASSERT_TRUE(dense_loaded.shared_expert && dense_loaded.shared_expert->dense());
    EXPECT_EQ(dense_loaded.shared_expert->inter, dense.inter);
    EXPECT_EQ(dense_loaded.shared_expert->dense_gate_up, dense.dense_gate_up);
    EXPECT_EQ(dense_loaded.shared_expert->dense_down, dense.dense_down);
    EXPECT_EQ(dense_loaded.shared_expert->gate, dense.gate);
  }
}

}  // namespace
}  // namespace fp4moe
