// Converting a float checkpoint (F32/BF16/F16) into an NVIDIA ModelOpt NVFP4
// checkpoint as ModelOpt's W4A16_NVFP4 export writes it (numerics and the
// writing: docs/design.md §3).
//
// The input is a .safetensors file (the output: a file) or a checkpoint
// directory with model.safetensors.index.json or one model.safetensors (the
// output: a new directory with shards sized like the input's, the index,
// hf_quant_config.json, config.json with its quantization_config, and the
// directory's other small files copied).
//
//   <m>.weight [N, K] float (a linear layer)  -> <m>.weight U8 [N, K/2],
//                                                <m>.weight_scale F8_E4M3 [N, K/16],
//                                                <m>.weight_scale_2 F32 []
//   <p>experts.<proj>[.weight] [E, N, K] and  -> the same per expert, named
//   <p>experts.gate_up_proj [E, 2I, H] or        <p>experts.<e>.{gate,up,down}_proj.*
//   [E, H, 2I] (Llama4, gpt-oss interleaved)     (+ .bias split the same way)
//   anything else                              -> copied bit for bit
//
// Global scales are shared the way ModelOpt's export shares them between
// linear layers that read the same input: q/k/v (and DeepSeek MLA's q_a/q
// with kv_a_proj_with_mqa) of one attention block, gate/up (w1/w3) of one MLP
// or expert. Memory stays bounded by the largest input tensor (or scale
// group). Everything is written to "<output>.tmp.<pid>" and renamed at the
// end; an error (or a stop asked by the progress callback) removes it.
//
// Tested in tests/tools/test_quantize.cpp through `fp4moe quantize`, the
// command that wraps it (directories, shards, configs, shared scales,
// stacked layouts, refusals, failures and signals midway), and
// tests/tools/test_cli.cpp (bit equality with quantize_nvfp4, the loader).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

namespace fp4moe {

struct QuantizeCheckpointOptions {
  // The format written: "W4A16_NVFP4" (weight-only NVFP4, no input_scale) is
  // the only one; "NVFP4" (W4A4) is refused, its input_scale needing
  // activations calibrated on data.
  std::string algo = "W4A16_NVFP4";
  // Globs (fnmatch) of tensor or module names kept unquantised, beside the
  // defaults.
  std::vector<std::string> excludes;
  // Also quantise embeddings and what default_quantize_excludes() keeps.
  bool no_default_exclude = false;
};

// What ModelOpt keeps in high precision by default: its default-disabled
// quantizer patterns, matched against quantizer names
// ("<module>.weight_quantizer"), so "*mlp.gate.*" is the MoE router and not
// mlp.gate_proj. Embedding tables are kept too (ModelOpt disables the
// quantizers of nn.Embedding by class).
const std::vector<std::string>& default_quantize_excludes();

// How a conversion reports as it goes. Every member may be empty; each is
// called on the converting thread.
struct QuantizeCheckpointProgress {
  // Once the outputs are planned, before the first tensor is read: the
  // input's data bytes.
  std::function<void(uint64_t input_bytes)> begin;
  // `bytes` more input bytes done (0 after each quantised matrix); `detail`
  // names the module or tensor.
  std::function<void(uint64_t bytes, std::string_view detail)> advance;
  // After the last tensor is written; the directory's other files follow.
  std::function<void()> end;
  // Before each output tensor is written. Throwing stops the conversion,
  // which then removes what it wrote (the CLI stops so on SIGINT/SIGTERM).
  std::function<void()> before_write;
};

// What a conversion did.
struct QuantizeCheckpointSummary {
  std::string output;         // the path written ("out/" writes the directory "out")
  uint64_t input_bytes = 0;   // the input's data bytes
  size_t num_matrices = 0;    // matrices quantised
  int num_expert_stacks = 0;  // stacked expert tensors split per expert
  int num_copied = 0;         // tensors copied unquantised
  size_t num_shards = 0;      // .safetensors files written
};

// Converts the checkpoint at `input` into `output` (see above). Prints
// nothing. Throws fp4moe::Error, one line, for a refused format or input
// (already quantised, an unknown stacked expert layout, K not a multiple of
// 16), an output that exists (a directory must be new or empty) or cannot be
// written, and any failure midway; the output then does not exist.
QuantizeCheckpointSummary quantize_checkpoint(const std::string& input, const std::string& output,
                                              const QuantizeCheckpointOptions& options = {},
                                              const QuantizeCheckpointProgress& progress = {});

}  // namespace fp4moe
