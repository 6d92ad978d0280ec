// Tests of `fp4moe quantize` on checkpoint directories and stacked expert
// layouts (tools/cmd_quantize.cpp over the library's converter,
// src/format/convert.cpp): the built binary is run on float
// checkpoints written here, and its output is read back tensor by tensor.
//
// - A sharded Qwen-MoE-like directory (attention, router, per-expert and
//   dense MLP, embeddings, lm_head, norm, tokenizer files) becomes a sharded
//   directory whose index, hf_quant_config.json and config.json say what
//   ModelOpt's W4A16_NVFP4 export says, whose matrices equal quantize_nvfp4
//   bit for bit with the shared global scales (q/k/v, gate/up), whose
//   unquantised tensors are byte copies, and which the loader reads.
// - transformers' fused [E, 2I, H] experts, Llama4's [E, H, 2I] and gpt-oss's
//   interleaved [E, H, 2I] with biases are split per expert.
// - Refusals (W4A4, unknown stacks, quantised input, existing output) are
//   one line with exit code 1 and leave nothing; a write that fails midway
//   (file size limit) leaves neither the output nor its temporary directory.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <regex>
#include <set>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "cli_test_support.hpp"
#include "fp4moe/modelopt.hpp"
#include "fp4moe/nvfp4.hpp"
#include "fp4moe/safetensors.hpp"

namespace fp4moe {
namespace {

using namespace cli_test;  // NOLINT: the shared fixture and file helpers
using nlohmann::json;

constexpr int64_t kE = 4;   // experts
constexpr int64_t kH = 64;  // hidden
constexpr int64_t kI = 32;  // expert / MLP intermediate
constexpr int64_t kVocab = 48;

// A float tensor as the test keeps it: values (already bf16-exact when
// stored as BF16) and its dtype.
struct FloatTensor {
  std::vector<int64_t> shape;
  std::vector<float> values;
  DType dtype = DType::BF16;
};

float amax_of(const std::vector<float>& v) {
  float m = 0.0f;
  for (float x : v) m = std::max(m, std::fabs(x));
  return m;
}

std::string file_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

class QuantizeTest : public CliTest {
 protected:
  // Normal values with a per-tensor gain, so tensors of one shared group have
  // different amax and sharing is visible.
  FloatTensor random_tensor(std::vector<int64_t> shape, double gain, DType dtype = DType::BF16) {
    std::normal_distribution<double> dist(0.0, gain);
    FloatTensor t{std::move(shape), {}, dtype};
    t.values.resize(static_cast<size_t>(shape_numel(t.shape)));
    for (float& x : t.values) {
      x = static_cast<float>(dist(rng_));
      if (dtype == DType::BF16) x = round_bf16(x);
    }
    return t;
  }

  static void add(SafetensorsWriter& w, const std::string& name, const FloatTensor& t) {
    if (t.dtype == DType::F32) {
      add_f32(w, name, t.shape, t.values);
    } else {
      add_bf16(w, name, t.shape, t.values);
    }
  }

  // Writes `tensors` (name order kept) into shards of the given names.
  static void write_shards(const std::string& dir,
                           const std::vector<std::pair<std::string, std::vector<std::string>>>& shards,
                           const std::map<std::string, FloatTensor>& tensors) {
    json weight_map = json::object();
    uint64_t total = 0;
    for (const auto& [file, names] : shards) {
      SafetensorsWriter w;
      for (const std::string& name : names) {
        add(w, name, tensors.at(name));
        weight_map[name] = file;
        total += tensors.at(name).values.size() * dtype_size(tensors.at(name).dtype);
      }
      w.write(dir + "/" + file);
    }
    std::ofstream(dir + "/model.safetensors.index.json")
        << json{{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}}.dump(2);
  }

  // The Qwen-MoE-like checkpoint: layer 0 attention + MoE (router, 4
  // experts), layer 1 dense MLP, embeddings, lm_head. Three shards; the last
  // holds the big F32 embedding table, so output shards stay small before it.
  std::string write_model_dir() {
    const std::string dir = path("in");
    fs::create_directories(dir);
    auto& t = model_;
    t["model.embed_tokens.weight"] = random_tensor({kVocab * 16, kH}, 1.0, DType::F32);
    t["lm_head.weight"] = random_tensor({kVocab, kH}, 0.5);
    t["model.norm.weight"] = random_tensor({kH}, 1.0);
    t["model.layers.0.input_layernorm.weight"] = random_tensor({kH}, 1.0);
    t["model.layers.0.self_attn.q_proj.weight"] = random_tensor({kH, kH}, 0.5);
    t["model.layers.0.self_attn.k_proj.weight"] = random_tensor({kH / 2, kH}, 2.0);
    t["model.layers.0.self_attn.v_proj.weight"] = random_tensor({kH / 2, kH}, 1.0);
    t["model.layers.0.self_attn.o_proj.weight"] = random_tensor({kH, kH}, 0.3);
    t["model.layers.0.mlp.gate.weight"] = random_tensor({kE, kH}, 0.1);
    for (int64_t e = 0; e < kE; ++e) {
      const std::string p = "model.layers.0.mlp.experts." + std::to_string(e) + ".";
      t[p + "gate_proj.weight"] = random_tensor({kI, kH}, e == 0 ? 2.0 : 0.5);
      t[p + "up_proj.weight"] = random_tensor({kI, kH}, e == 0 ? 0.5 : 1.0 + e);
      t[p + "down_proj.weight"] = random_tensor({kH, kI}, 0.7);
    }
    t["model.layers.1.mlp.gate_proj.weight"] = random_tensor({kI, kH}, 0.4);
    t["model.layers.1.mlp.up_proj.weight"] = random_tensor({kI, kH}, 1.3);
    t["model.layers.1.mlp.down_proj.weight"] = random_tensor({kH, kI}, 0.6);

    std::vector<std::string> shard1, shard2;
    for (const auto& [name, tensor] : t) {
      if (name == "model.embed_tokens.weight") continue;
      (name.find("layers.0.mlp.experts") != std::string::npos ? shard2 : shard1).push_back(name);
    }
    write_shards(dir,
                 {{"model-00001-of-00003.safetensors", shard1},
                  {"model-00002-of-00003.safetensors", shard2},
                  {"model-00003-of-00003.safetensors", {"model.embed_tokens.weight"}}},
                 t);
    std::ofstream(dir + "/config.json") << R"({"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
      "hidden_size": 64, "num_experts": 4, "num_experts_per_tok": 2, "rope_theta": 1000000.0,
      "tie_word_embeddings": false, "torch_dtype": "bfloat16"})";
    std::ofstream(dir + "/tokenizer.json") << R"({"version": "1.0", "model": {"type": "BPE"}})";
    std::ofstream(dir + "/generation_config.json") << R"({"do_sample": true, "temperature": 0.6})";
    std::ofstream(dir + "/pytorch_model.bin") << "not copied";
    return dir;
  }

  // Every tensor of an output directory, through its index.
  static std::map<std::string, std::string> weight_map(const std::string& dir) {
    const json index = json::parse(file_bytes(dir + "/model.safetensors.index.json"));
    std::map<std::string, std::string> map;
    for (const auto& [name, file] : index.at("weight_map").items()) map[name] = file.get<std::string>();
    return map;
  }

  // Checks <base>.{weight, weight_scale, weight_scale_2} against
  // quantize_nvfp4 of `w` [rows, cols] with the global scale of `amax`.
  static void expect_copied(const SafetensorsFile& f, const std::string& name, const FloatTensor& t) {
    SCOPED_TRACE(name);
    ASSERT_TRUE(f.contains(name));
    const TensorView& v = f.get(name);
    EXPECT_EQ(v.dtype, t.dtype);
    EXPECT_EQ(v.shape, t.shape);
    EXPECT_EQ(read_floats(v), t.values);
  }

  // A single .safetensors file of stacked experts under prefix "model.layers.0.mlp."
  std::string write_file(const std::string& name, const std::map<std::string, FloatTensor>& tensors) {
    SafetensorsWriter w;
    for (const auto& [n, t] : tensors) add(w, n, t);
    w.write(path(name));
    return path(name);
  }

  // Nothing named OUT or OUT.tmp.* in the test directory.
  void expect_no_output(const std::string& out_name) const {
    for (const auto& entry : fs::directory_iterator(path("")))
      EXPECT_NE(entry.path().filename().string().rfind(out_name, 0), 0u)
          << "left behind: " << entry.path().filename().string();
  }

  std::mt19937 rng_{2024};
  std::map<std::string, FloatTensor> model_;
};

// An [E, N, K] stack's matrix e as a vector.
std::vector<float> slice_of(const FloatTensor& t, int64_t e) {
  const int64_t n = t.shape[1] * t.shape[2];
  return {t.values.begin() + e * n, t.values.begin() + (e + 1) * n};
}

// Rows [offset, offset + rows) of stride `stride` of matrix e of a stack, or
// of its transpose when `transposed` (the stack being [E, K, M]).
std::vector<float> rows_of(const FloatTensor& t, int64_t e, bool transposed, int64_t offset, int64_t stride,
                           int64_t rows) {
  const std::vector<float> m = slice_of(t, e);
  const int64_t a = t.shape[1], b = t.shape[2];
  const int64_t cols = transposed ? a : b;
  std::vector<float> out;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) {
      const int64_t src = offset + r * stride;
      out.push_back(transposed ? m[static_cast<size_t>(c * b + src)] : m[static_cast<size_t>(src * b + c)]);
    }
  return out;
}

TEST_F(QuantizeTest, ShardedDirectoryRoundTrip) {
  const std::string in = write_model_dir();
  const std::string out = path("out");
  const CliResult r = run("quantize -q '" + in + "' '" + out + "'");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.err.find("W4A16_NVFP4"), std::string::npos) << r.err;
  expect_no_output("out.tmp");

  // Index: every tensor of every shard, once, with the data size as total.
  const std::map<std::string, std::string> map = weight_map(out);
  std::set<std::string> shard_files;
  for (const auto& [name, file] : map) shard_files.insert(file);
  ASSERT_GE(shard_files.size(), 2u) << "shards sized like the input's";
  uint64_t total = 0;
  size_t num_tensors = 0;
  const uint64_t max_input_shard = 4 * kVocab * 16 * kH;  // the embedding shard
  for (const std::string& file : shard_files) {
    EXPECT_TRUE(std::regex_match(
        file, std::regex(R"(model-0000\d-of-0000)" + std::to_string(shard_files.size()) + R"(\.safetensors)")))
        << file;
    const SafetensorsFile shard = SafetensorsFile::open(out + "/" + file);
    EXPECT_EQ(shard.metadata().at("format"), "pt");
    uint64_t shard_bytes = 0;
    for (const std::string& name : shard.names()) {
      EXPECT_EQ(map.at(name), file) << name;
      shard_bytes += shard.describe(name).nbytes;
      ++num_tensors;
    }
    EXPECT_LE(shard_bytes, max_input_shard) << file;
    total += shard_bytes;
  }
  EXPECT_EQ(num_tensors, map.size());
  const json index = json::parse(file_bytes(out + "/model.safetensors.index.json"));
  EXPECT_EQ(index.at("metadata").at("total_size").get<uint64_t>(), total);

  // hf_quant_config.json and config.json, as ModelOpt's export writes them.
  const std::vector<std::string> excluded = {"lm_head", "model.embed_tokens", "model.layers.0.mlp.gate"};
  const json hf = json::parse(file_bytes(out + "/hf_quant_config.json"));
  EXPECT_EQ(hf.at("quantization").at("quant_algo"), "W4A16_NVFP4");
  EXPECT_EQ(hf.at("quantization").at("group_size"), 16);
  EXPECT_TRUE(hf.at("quantization").at("kv_cache_quant_algo").is_null());
  EXPECT_EQ(hf.at("quantization").at("exclude_modules").get<std::vector<std::string>>(), excluded);
  const json config = json::parse(file_bytes(out + "/config.json"));
  EXPECT_EQ(config.at("model_type"), "qwen3_moe") << "the original keys are kept";
  EXPECT_EQ(config.at("num_experts"), 4);
  const json& qc = config.at("quantization_config");
  EXPECT_EQ(qc.at("quant_method"), "modelopt");
  EXPECT_EQ(qc.at("quant_algo"), "W4A16_NVFP4");
  EXPECT_EQ(qc.at("ignore").get<std::vector<std::string>>(), excluded);
  EXPECT_EQ(qc.at("config_groups").at("group_0").at("weights").at("group_size"), 16);
  EXPECT_EQ(qc.at("config_groups").at("group_0").at("weights").at("num_bits"), 4);
  EXPECT_FALSE(qc.at("config_groups").at("group_0").contains("input_activations")) << "weight-only";

  // Small files copied as they are; weights in other formats are not.
  EXPECT_EQ(file_bytes(out + "/tokenizer.json"), file_bytes(in + "/tokenizer.json"));
  EXPECT_EQ(file_bytes(out + "/generation_config.json"), file_bytes(in + "/generation_config.json"));
  EXPECT_FALSE(fs::exists(out + "/pytorch_model.bin"));

  // Tensors, each opened from the shard the index names.
  std::map<std::string, SafetensorsFile> files;
  for (const std::string& file : shard_files) files.emplace(file, SafetensorsFile::open(out + "/" + file));
  const auto file_of = [&](const std::string& name) -> const SafetensorsFile& {
    EXPECT_TRUE(map.contains(name)) << name;
    return files.at(map.at(name));
  };
  const auto& t = model_;
  const auto values = [&](const std::string& name) { return t.at(name).values; };
  // q/k/v share one global scale: the max of the three amax.
  const std::string attn = "model.layers.0.self_attn.";
  const float qkv_amax = std::max({amax_of(values(attn + "q_proj.weight")), amax_of(values(attn + "k_proj.weight")),
                                   amax_of(values(attn + "v_proj.weight"))});
  ASSERT_NE(qkv_amax, amax_of(values(attn + "q_proj.weight"))) << "fixture: sharing must be visible";
  expect_quantized(file_of(attn + "q_proj.weight"), attn + "q_proj", values(attn + "q_proj.weight"), kH, kH, qkv_amax);
  expect_quantized(file_of(attn + "k_proj.weight"), attn + "k_proj", values(attn + "k_proj.weight"), kH / 2, kH,
                   qkv_amax);
  expect_quantized(file_of(attn + "v_proj.weight"), attn + "v_proj", values(attn + "v_proj.weight"), kH / 2, kH,
                   qkv_amax);
  expect_quantized(file_of(attn + "o_proj.weight"), attn + "o_proj", values(attn + "o_proj.weight"), kH, kH,
                   amax_of(values(attn + "o_proj.weight")));
  // Experts and the dense MLP: gate/up shared, down its own.
  for (int64_t e = -1; e < kE; ++e) {
    const std::string p = e < 0 ? "model.layers.1.mlp." : "model.layers.0.mlp.experts." + std::to_string(e) + ".";
    const float shared = std::max(amax_of(values(p + "gate_proj.weight")), amax_of(values(p + "up_proj.weight")));
    expect_quantized(file_of(p + "gate_proj.weight"), p + "gate_proj", values(p + "gate_proj.weight"), kI, kH, shared);
    expect_quantized(file_of(p + "up_proj.weight"), p + "up_proj", values(p + "up_proj.weight"), kI, kH, shared);
    expect_quantized(file_of(p + "down_proj.weight"), p + "down_proj", values(p + "down_proj.weight"), kH, kI,
                     amax_of(values(p + "down_proj.weight")));
  }
  // Kept in high precision, bit for bit in their dtype.
  for (const std::string name : {"model.embed_tokens.weight", "lm_head.weight", "model.layers.0.mlp.gate.weight",
                                 "model.norm.weight", "model.layers.0.input_layernorm.weight"})
    expect_copied(file_of(name), name, t.at(name));
  for (const auto& [name, file] : map) EXPECT_FALSE(name.ends_with(".input_scale")) << name;

  // The loader reads the experts back (shards through the index, the format
  // from hf_quant_config.json), and they dequantise to what was written.
  const MoeWeights loaded = load_moe_weights(out, "model.layers.0.mlp.");
  EXPECT_EQ(loaded.num_experts, kE);
  EXPECT_EQ(loaded.hidden, kH);
  EXPECT_EQ(loaded.inter, kI);
  EXPECT_EQ(loaded.checkpoint_format, "W4A16_NVFP4");
  const std::string p1 = "model.layers.0.mlp.experts.1.";
  const float shared = std::max(amax_of(values(p1 + "gate_proj.weight")), amax_of(values(p1 + "up_proj.weight")));
  EXPECT_EQ(loaded.experts[1].up.dequantize(),
            quantize_nvfp4(values(p1 + "up_proj.weight").data(), kI, kH, nvfp4_global_scale(shared)).dequantize());
}

TEST_F(QuantizeTest, SingleFileDirectoryGivesSingleFileAndQuantizesEverythingWithoutDefaults) {
  const std::string dir = path("single");
  fs::create_directories(dir);
  std::map<std::string, FloatTensor> t;
  t["model.layers.0.mlp.gate.weight"] = random_tensor({kE, kH}, 0.1);
  t["model.layers.0.self_attn.o_proj.weight"] = random_tensor({kH, kH}, 0.3);
  SafetensorsWriter w;
  for (const auto& [name, tensor] : t) add(w, name, tensor);
  w.write(dir + "/model.safetensors");
  const CliResult r = run("quantize -q --no-default-exclude '" + dir + "' '" + path("out") + "'");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_FALSE(fs::exists(path("out") + "/model.safetensors.index.json")) << "one file, as the input";
  EXPECT_FALSE(fs::exists(path("out") + "/config.json")) << "no config.json in, none out";
  // A causal LM without lm_head.weight has a tied lm_head, which ModelOpt
  // lists as kept (with the default exclusions). The router is summarised
  // as "model.layers.0.mlp*": no quantised layer's name starts so (only
  // self_attn.o_proj is quantised here).
  std::ofstream(dir + "/config.json") << R"({"architectures": ["TinyForCausalLM"], "model_type": "tiny"})";
  const CliResult tied = run("quantize -q '" + dir + "' '" + path("tied") + "'");
  ASSERT_EQ(tied.exit_code, 0) << tied.err;
  EXPECT_EQ(json::parse(file_bytes(path("tied") + "/hf_quant_config.json")).at("quantization").at("exclude_modules"),
            json({"lm_head", "model.layers.0.mlp*"}));
  EXPECT_EQ(json::parse(file_bytes(path("tied") + "/config.json")).at("quantization_config").at("quant_method"),
            "modelopt");
  const SafetensorsFile f = SafetensorsFile::open(path("out") + "/model.safetensors");
  // The router is quantised too when the defaults are off.
  expect_quantized(f, "model.layers.0.mlp.gate", t["model.layers.0.mlp.gate.weight"].values, kE, kH,
                   amax_of(t["model.layers.0.mlp.gate.weight"].values));
  const json hf = json::parse(file_bytes(path("out") + "/hf_quant_config.json"));
  EXPECT_TRUE(hf.at("quantization").at("exclude_modules").empty());
}

// transformers' fused experts: gate_up_proj [E, 2I, H] (gate rows first),
// down_proj [E, H, I]; gate and up of each expert share the expert's amax.
TEST_F(QuantizeTest, SplitsTransformersFusedExperts) {
  std::map<std::string, FloatTensor> t;
  const std::string p = "model.layers.0.mlp.experts.";
  t[p + "gate_up_proj"] = random_tensor({kE, 2 * kI, kH}, 1.0);
  t[p + "down_proj"] = random_tensor({kE, kH, kI}, 0.5);
  // Expert 2's up half much larger than its gate half: sharing is visible.
  for (int64_t i = kI * kH; i < 2 * kI * kH; ++i) t[p + "gate_up_proj"].values[2 * 2 * kI * kH + i] *= 4.0f;
  const std::string in = write_file("fused.safetensors", t);
  const CliResult r = run("quantize -q '" + in + "' '" + path("q.safetensors") + "'");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const SafetensorsFile f = SafetensorsFile::open(path("q.safetensors"));
  EXPECT_FALSE(f.contains(p + "gate_up_proj")) << "stacks are split, never copied";
  EXPECT_FALSE(f.contains(p + "down_proj"));
  EXPECT_EQ(f.metadata().at("quant_algo"), "W4A16_NVFP4");
  for (int64_t e = 0; e < kE; ++e) {
    const std::string b = p + std::to_string(e) + ".";
    const float shared = amax_of(slice_of(t[p + "gate_up_proj"], e));
    expect_quantized(f, b + "gate_proj", rows_of(t[p + "gate_up_proj"], e, false, 0, 1, kI), kI, kH, shared);
    expect_quantized(f, b + "up_proj", rows_of(t[p + "gate_up_proj"], e, false, kI, 1, kI), kI, kH, shared);
    expect_quantized(f, b + "down_proj", slice_of(t[p + "down_proj"], e), kH, kI,
                     amax_of(slice_of(t[p + "down_proj"], e)));
  }
  const MoeWeights loaded = load_moe_weights(path("q.safetensors"), "model.layers.0.mlp.");
  EXPECT_EQ(loaded.num_experts, kE);
  EXPECT_EQ(loaded.inter, kI);
}

// Llama4 (bmm layout, [E, H, 2I], gate columns first) and gpt-oss (the same
// layout with gate/up columns interleaved, and biases).
TEST_F(QuantizeTest, SplitsBmmLayoutExpertsOfLlama4AndGptOss) {
  for (const bool gptoss : {false, true}) {
    SCOPED_TRACE(gptoss ? "gpt-oss" : "llama4");
    std::map<std::string, FloatTensor> t;
    const std::string prefix = gptoss ? "model.layers.0.mlp." : "model.layers.0.feed_forward.";
    const std::string p = prefix + "experts.";
    t[p + "gate_up_proj"] = random_tensor({kE, kH, 2 * kI}, 1.0);
    t[p + "down_proj"] = random_tensor({kE, kI, kH}, 0.5);
    // Expert 0 larger: its amax is the stack's, the others' are smaller.
    // (a power of two keeps the values bf16-exact)
    for (int64_t i = 0; i < kH * 2 * kI; ++i) t[p + "gate_up_proj"].values[static_cast<size_t>(i)] *= 4.0f;
    if (gptoss) {
      t[p + "gate_up_proj_bias"] = random_tensor({kE, 2 * kI}, 0.1);
      t[p + "down_proj_bias"] = random_tensor({kE, kH}, 0.1);
    }
    const std::string in = write_file("bmm.safetensors", t);
    const CliResult r = run("quantize -q '" + in + "' '" + path("q.safetensors") + "'");
    ASSERT_EQ(r.exit_code, 0) << r.err;
    const SafetensorsFile f = SafetensorsFile::open(path("q.safetensors"));
    // One quantizer per bmm stack in ModelOpt: every expert has the stack's
    // amax (gate_up's for gate and up, down's for down).
    const float gate_up_amax = amax_of(t[p + "gate_up_proj"].values);
    const float down_amax = amax_of(t[p + "down_proj"].values);
    ASSERT_NE(gate_up_amax, amax_of(slice_of(t[p + "gate_up_proj"], 1))) << "fixture: the stack scale must be visible";
    for (int64_t e = 0; e < kE; ++e) {
      const std::string b = p + std::to_string(e) + ".";
      const int64_t stride = gptoss ? 2 : 1, up_offset = gptoss ? 1 : kI;
      expect_quantized(f, b + "gate_proj", rows_of(t[p + "gate_up_proj"], e, true, 0, stride, kI), kI, kH,
                       gate_up_amax);
      expect_quantized(f, b + "up_proj", rows_of(t[p + "gate_up_proj"], e, true, up_offset, stride, kI), kI, kH,
                       gate_up_amax);
      expect_quantized(f, b + "down_proj", rows_of(t[p + "down_proj"], e, true, 0, 1, kH), kH, kI, down_amax);
      if (gptoss) {
        const std::vector<float>& bias = t[p + "gate_up_proj_bias"].values;
        std::vector<float> gate_bias, up_bias;
        for (int64_t i = 0; i < kI; ++i) {
          gate_bias.push_back(bias[static_cast<size_t>(e * 2 * kI + 2 * i)]);
          up_bias.push_back(bias[static_cast<size_t>(e * 2 * kI + 2 * i + 1)]);
        }
        expect_copied(f, b + "gate_proj.bias", FloatTensor{{kI}, gate_bias, DType::BF16});
        expect_copied(f, b + "up_proj.bias", FloatTensor{{kI}, up_bias, DType::BF16});
        const std::vector<float>& down_bias = t[p + "down_proj_bias"].values;
        expect_copied(f, b + "down_proj.bias",
                      FloatTensor{{kH}, {down_bias.begin() + e * kH, down_bias.begin() + (e + 1) * kH}, DType::BF16});
      }
    }
    const MoeWeights loaded = load_moe_weights(path("q.safetensors"), prefix);
    EXPECT_EQ(loaded.num_experts, kE);
    EXPECT_EQ(loaded.hidden, kH);
    EXPECT_EQ(loaded.has_bias(), gptoss);
  }
}

// DeepSeek MLA: q_a_proj and kv_a_proj_with_mqa read the same hidden state
// and share a global scale; q_b_proj and kv_b_proj have their own. The
// routing bias, which transformers keeps in fp32, is written as F32 (the
// dtype ModelOpt exports it in) with the same values.
TEST_F(QuantizeTest, DeepSeekMlaGroupAndFp32RoutingBias) {
  std::map<std::string, FloatTensor> t;
  const std::string a = "model.layers.0.self_attn.";
  t[a + "q_a_proj.weight"] = random_tensor({kI, kH}, 0.3);
  t[a + "kv_a_proj_with_mqa.weight"] = random_tensor({kI + 16, kH}, 1.5);
  t[a + "q_b_proj.weight"] = random_tensor({kH, kI}, 0.4);
  t[a + "kv_b_proj.weight"] = random_tensor({kH, kI}, 0.8);
  t["model.layers.0.mlp.gate.e_score_correction_bias"] = random_tensor({kE}, 1.0);
  const std::string in = write_file("mla.safetensors", t);
  const CliResult r = run("quantize -q '" + in + "' '" + path("q.safetensors") + "'");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const SafetensorsFile f = SafetensorsFile::open(path("q.safetensors"));
  const float shared =
      std::max(amax_of(t[a + "q_a_proj.weight"].values), amax_of(t[a + "kv_a_proj_with_mqa.weight"].values));
  expect_quantized(f, a + "q_a_proj", t[a + "q_a_proj.weight"].values, kI, kH, shared);
  expect_quantized(f, a + "kv_a_proj_with_mqa", t[a + "kv_a_proj_with_mqa.weight"].values, kI + 16, kH, shared);
  expect_quantized(f, a + "q_b_proj", t[a + "q_b_proj.weight"].values, kH, kI,
                   amax_of(t[a + "q_b_proj.weight"].values));
  expect_quantized(f, a + "kv_b_proj", t[a + "kv_b_proj.weight"].values, kH, kI,
                   amax_of(t[a + "kv_b_proj.weight"].values));
  const std::string bias = "model.layers.0.mlp.gate.e_score_correction_bias";
  expect_copied(f, bias, FloatTensor{{kE}, t[bias].values, DType::F32});
}

TEST_F(QuantizeTest, RefusalsAreOneLineAndLeaveNothing) {
  const std::string in = write_model_dir();
  std::map<std::string, FloatTensor> unknown;
  unknown["model.layers.0.mlp.experts.w13_weight"] = random_tensor({kE, 2 * kI, kH}, 1.0);
  const std::string unknown_file = write_file("unknown.safetensors", unknown);
  // gpt-oss as OpenAI publishes it: MXFP4 blocks, U8 [E, 2I, H/32, 16].
  SafetensorsWriter mxfp4;
  const std::vector<uint8_t> blocks(static_cast<size_t>(kE * 2 * kI * kH / 2), 0x11);
  mxfp4.add("model.layers.0.mlp.experts.gate_up_proj_blocks", DType::U8, {kE, 2 * kI, kH / 32, 16}, blocks.data(),
            blocks.size());
  mxfp4.write(path("mxfp4.safetensors"));
  // An index that does not match its shards.
  fs::copy(in, path("bad_index"));
  json index = json::parse(file_bytes(in + "/model.safetensors.index.json"));
  index["weight_map"]["lm_head.weight"] = "model-00002-of-00003.safetensors";
  std::ofstream(path("bad_index") + "/model.safetensors.index.json") << index.dump();
  fs::create_directories(path("full"));
  std::ofstream(path("full") + "/x") << "x";
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"--algo NVFP4 '" + in + "' '" + path("out") + "'", "calibrated"},
      {"--algo FP8 '" + in + "' '" + path("out") + "'", "not supported"},
      {"'" + unknown_file + "' '" + path("out") + "'", "layout fp4moe does not know"},
      {"'" + path("mxfp4.safetensors") + "' '" + path("out") + "'", "not float (already quantised"},
      {"'" + in + "' '" + path("full") + "'", "not an empty directory"},
      {"'" + unknown_file + "' '" + unknown_file + "'", "is the input file"},
      {"'" + path("bad_index") + "' '" + path("out") + "'", "places tensor 'lm_head.weight' in"},
  };
  for (const auto& [args, phrase] : cases) {
    SCOPED_TRACE(args);
    const CliResult r = run("quantize -q " + args);
    EXPECT_EQ(r.exit_code, 1) << r.err;
    EXPECT_EQ(r.err.rfind("fp4moe: error: ", 0), 0u) << r.err;
    EXPECT_NE(r.err.find(phrase), std::string::npos) << r.err;
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
    expect_no_output("out");
  }
  // A checkpoint that is already quantised is refused, as is a config.json
  // that already declares a quantisation.
  SafetensorsWriter q;
  const uint8_t byte = 0;
  const float one = 1.0f;
  q.add("model.layers.0.self_attn.o_proj.weight", DType::U8, {1, 1}, &byte, 1);
  q.add("model.layers.0.self_attn.o_proj.weight_scale_2", DType::F32, {}, &one, 4);
  q.write(path("q_in.safetensors"));
  const CliResult again = run("quantize -q '" + path("q_in.safetensors") + "' '" + path("out.safetensors") + "'");
  EXPECT_EQ(again.exit_code, 1);
  EXPECT_NE(again.err.find("already quantised"), std::string::npos) << again.err;
  std::ofstream(in + "/config.json") << R"({"model_type": "x", "quantization_config": {"quant_method": "mxfp4"}})";
  const CliResult declared = run("quantize -q '" + in + "' '" + path("out") + "'");
  EXPECT_EQ(declared.exit_code, 1);
  EXPECT_NE(declared.err.find("already has a quantization_config"), std::string::npos) << declared.err;
  expect_no_output("out");
}

// A write that fails after some shards are written (the file size limit
// makes the large last shard fail) leaves neither OUT nor OUT.tmp.*.
TEST_F(QuantizeTest, FailureMidwayLeavesNothing) {
  const std::string in = write_model_dir();
  // Blocks of 512 or 1024 bytes depending on the shell: 256 blocks is
  // 128-256 kB, above the first shard (~32 kB) and below the 196 kB
  // embedding shard. SIGXFSZ ignored (and inherited so) makes write() fail
  // with EFBIG instead of killing the process.
  const CliResult r = run_with("trap '' XFSZ; ulimit -f 256;", "quantize -q '" + in + "' '" + path("out") + "'");
  EXPECT_EQ(r.exit_code, 1) << r.err;
  EXPECT_NE(r.err.find("write failed"), std::string::npos) << r.err;
  EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
  expect_no_output("out");
  // The same run without the limit succeeds: the failure was the limit.
  EXPECT_EQ(run("quantize -q '" + in + "' '" + path("out") + "'").exit_code, 0);
}

// SIGTERM during a run stops it at the next tensor and removes the
// temporary directory. The run may finish before the signal on a fast
// machine; then the output must be complete. Either way nothing partial is
// left.
TEST_F(QuantizeTest, SignalMidwayLeavesNothingPartial) {
  const std::string dir = path("big");
  fs::create_directories(dir);
  SafetensorsWriter w;
  const std::vector<float> values(512 * 2048, 0.25f);
  for (int l = 0; l < 48; ++l)
    add_f32(w, "model.layers." + std::to_string(l) + ".self_attn.o_proj.weight", {512, 2048}, values);
  w.write(dir + "/model.safetensors");
  // The signal goes once the temporary output exists (the handler is in
  // place before it is created; a fixed delay raced the process's start on a
  // loaded machine), or never if the process has already exited.
  const std::string command = "'" + cli_binary() + "' quantize -q '" + dir + "' '" + path("out") + "' 2>'" +
                              path("stderr") + "' & pid=$!; for i in $(seq 1000); do " + "ls -d '" + path("out") +
                              "'.tmp.* >/dev/null 2>&1 && break; " +
                              "kill -0 $pid 2>/dev/null || break; sleep 0.01; done; " +
                              "kill -TERM $pid 2>/dev/null; wait $pid; echo $? >'" + path("rc") + "'";
  ASSERT_EQ(std::system(command.c_str()), 0);
  const int rc = std::stoi(read_text(path("rc")));
  const std::string err = read_text(path("stderr"));
  if (rc == 0) {
    EXPECT_TRUE(fs::exists(path("out") + "/model.safetensors")) << "finished before the signal: complete output";
  } else {
    EXPECT_EQ(rc, 1) << err;
    EXPECT_NE(err.find("interrupted by signal 15"), std::string::npos) << err;
    EXPECT_FALSE(fs::exists(path("out")));
  }
  for (const auto& entry : fs::directory_iterator(path("")))
    EXPECT_EQ(entry.path().filename().string().find(".tmp."), std::string::npos) << entry.path();
}

}  // namespace
}  // namespace fp4moe
