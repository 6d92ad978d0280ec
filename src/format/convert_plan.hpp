// Planning a checkpoint conversion (fp4moe/checkpoint.hpp) from the input's
// headers alone: which tensors become NVFP4 matrices (and out of which rows
// of which input), which are copied, which share a global scale, the shard
// each output goes to, and what hf_quant_config.json lists as kept. The
// writer (convert.cpp) then reads each input tensor once and streams the
// planned outputs. Internal to src/format.
//
// Tested through `fp4moe quantize` in tests/tools/test_quantize.cpp.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "fp4moe/checkpoint.hpp"
#include "fp4moe/safetensors.hpp"

namespace fp4moe::convert {

// ------------------------------------------------------------------ input

struct InputTensor {
  size_t shard = 0;  // index into Input::shards
  TensorView desc;   // name, dtype, shape, nbytes (no data)
};

struct Input {
  bool is_dir = false;
  bool sharded = false;       // a directory with model.safetensors.index.json
  std::filesystem::path dir;  // the checkpoint directory (a file's own directory)
  std::vector<SafetensorsFile> shards;
  std::vector<uint64_t> shard_data_bytes;
  std::vector<InputTensor> tensors;  // shard by shard, file order
  std::map<std::string, size_t> index_of;
};

// The input checkpoint's shards, opened (headers read), and its tensors.
Input open_input(const std::string& path);

// A JSON file of the input (its index, its config.json), keys in the file's
// order: the config.json written out keeps them so.
nlohmann::ordered_json read_json(const std::filesystem::path& path);

// ------------------------------------------------------------------- plan

// How the rows of one output matrix [rows, cols] come out of an input tensor:
// the input's slice `expert` (or the whole 2-D tensor), seen as [M, cols]
// (transposed: the slice is [cols, M]), rows row_offset, row_offset +
// row_stride, ... That covers plain matrices, [E, N, K] stacks, fused gate_up
// halves and gpt-oss's interleaved gate/up columns.
struct Slice {
  int64_t expert = -1;  // -1: a 2-D input
  bool transposed = false;
  int64_t row_offset = 0;
  int64_t row_stride = 1;
  int64_t rows = 0;
  int64_t cols = 0;
};

struct Matrix {
  std::string module;  // output name without ".weight"
  size_t input = 0;    // input tensor index
  Slice slice;
  std::string group;  // shared global scale key; empty: its own
  // The group is the whole input tensor (a bmm-layout stack): its amax is
  // the tensor's.
  bool group_is_input = false;
};

// One output tensor and where its bytes come from.
struct Output {
  enum Kind { kCopy, kCopyAsF32, kWeight, kWeightScale, kWeightScale2, kBiasSlice } kind = kCopy;
  TensorSpec spec;
  size_t input = 0;   // the input tensor it derives from
  size_t matrix = 0;  // kWeight*: index into Plan::matrices
  Slice slice;        // kBiasSlice: rows of a [E, M] bias (cols = 1)
  uint64_t nbytes = 0;
};

struct Plan {
  std::vector<Matrix> matrices;
  std::vector<Output> outputs;  // in input order, then the order each input emits
  std::vector<std::string> quantized_modules;
  std::vector<std::string> excluded_modules;
  int num_stacks = 0;
};

// One output .safetensors file and the outputs it holds.
struct Shard {
  std::string file;             // name inside the output directory (or the output file)
  std::vector<size_t> outputs;  // indices into Plan::outputs, in order
  uint64_t data_bytes = 0;
};

// Packs the outputs, in order, into shards of at most `max_bytes` each (a
// tensor larger than that gets a shard of its own), named as transformers
// names them.
std::vector<Shard> make_shards(const Plan& plan, uint64_t max_bytes);

// hf_quant_config.json's exclude_modules as ModelOpt summarises it: each
// unquantised module is covered by the shortest prefix wildcard cut at a dot
// ("a.b*", or "a.b.*" when the bare "a.b*" would also catch a sibling such
// as "a.bc") that matches no quantised module, else by its own name; names
// already covered add nothing. Sorted.
std::vector<std::string> summarize_excludes(std::vector<std::string> excluded,
                                            const std::vector<std::string>& quantized);

// Plans every input tensor's outputs. `input_path` names the input in
// messages; `model_type` (config.json's) tells layouts apart where shapes
// cannot (gpt-oss's interleaved gate/up, ERNIE's fp32 tensors).
class Planner {
 public:
  Planner(const Input& in, const std::string& input_path, const QuantizeCheckpointOptions& opts,
          std::string model_type);

  // The plan; throws one line for an input already quantised, an unknown
  // stacked expert layout, K not a multiple of 16, two inputs written under
  // one name.
  Plan make();

  // A layer is kept in high precision when a pattern matches its quantizer
  // name (ModelOpt's form) or the tensor's own name (what --exclude users
  // see).
  bool excluded(const std::string& module, const std::string& tensor) const;

 private:
  struct FusedLayout {
    bool transposed = false;
    bool interleaved = false;
    int64_t inter = 0;
  };

  bool kept_in_fp32(const std::string& name) const;
  void add_copy(size_t input);
  void push(Output o);
  void add_matrix(const std::string& module, size_t input, const Slice& slice, bool whole_input_group = false);
  void add_bias(const std::string& name, size_t input, const Slice& slice);
  const InputTensor* find(const std::string& name) const;
  FusedLayout fused_layout(const std::string& base, const TensorView& gate_up) const;
  void plan_tensor(size_t i);
  void plan_expert_stack(size_t i, const std::string& base, const std::string& proj, bool bare);
  void plan_expert_bias(size_t i, const std::string& base, const std::string& proj);

  const Input& in_;
  const std::string& input_path_;
  const QuantizeCheckpointOptions& opts_;
  std::string model_type_;
  std::vector<std::string> patterns_;
  Plan plan_;
  std::map<std::string, size_t> owner_;  // output name -> input tensor
};

}  // namespace fp4moe::convert
