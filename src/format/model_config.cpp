// config.json's MoE fields per model family (include/fp4moe/model_config.hpp),
// read through the one config.json reader (src/format/config_json.hpp), and
// the router logits of hidden states. The router's tensors are read in
// src/format/moe_weights_reader.cpp, beside the expert loader, through the
// same checkpoint reader.
// Tested in tests/format/test_model_config.cpp: each family's keys and
// defaults, contradictions and unsupported routings (one line each), and the
// logits against a hand-computed product.
#include "fp4moe/model_config.hpp"

#include <cmath>
#include <filesystem>
#include <sstream>

#include "format/config_json.hpp"
#include "fp4moe/error.hpp"

namespace fp4moe {

namespace fs = std::filesystem;

namespace {

// A config int that must fit the routing's int fields.
int to_int(int64_t value, const std::string& where, const char* key) {
  FP4MOE_CHECK(value <= (int64_t{1} << 30), where, ": ", key, " is ", value, "; expected at most 2^30");
  return static_cast<int>(value);
}

std::string number_string(double v) {
  std::ostringstream os;
  os << v;
  return os.str();
}

}  // namespace

std::string MoeModelConfig::describe_routing() const {
  std::string s = to_string(routing.mode);
  switch (routing.mode) {
    case RoutingMode::kSoftmaxTopK:
      s += routing.renormalize ? " (renormalised)" : " (not renormalised)";
      break;
    case RoutingMode::kNoauxTc:
      s += " (n_group " + std::to_string(routing.num_groups) + ", topk_group " + std::to_string(routing.topk_groups) +
           ", routed_scaling_factor " + number_string(routing.routed_scaling_factor) + ")";
      break;
    case RoutingMode::kGptOss:
      break;
  }
  return s;
}

namespace {

// The MoE fields of a config, by family (model_config.hpp); empty when it
// declares no routed expert count.
std::optional<MoeModelConfig> moe_model_config(const ConfigJson& c) {
  const std::string& where = c.where();
  MoeModelConfig m;
  m.where = where;
  m.model_type = c.model_type();

  const auto count = c.expert_count();
  if (!count) return std::nullopt;  // not an MoE config
  m.num_experts = count->num_experts;
  m.num_experts_key = count->key;

  // gpt-oss's original key is experts_per_token; transformers writes
  // num_experts_per_tok. Both present must agree.
  const auto per_tok = c.positive_int("num_experts_per_tok");
  const auto per_token = c.positive_int("experts_per_token");
  FP4MOE_CHECK(!per_tok || !per_token || *per_tok == *per_token, where, ": num_experts_per_tok = ", *per_tok,
               " but experts_per_token = ", *per_token, "; expected one top-k");
  if (per_tok || per_token) {
    m.top_k = to_int(per_tok ? *per_tok : *per_token, where, per_tok ? "num_experts_per_tok" : "experts_per_token");
    m.top_k_key = per_tok ? "num_experts_per_tok" : "experts_per_token";
  }
  m.hidden_size = c.positive_int("hidden_size");

  const bool gpt_oss = m.model_type == "gpt_oss" || c.has("experts_per_token");
  // Qwen2/3-MoE: transformers 5 writes their expert count as
  // num_local_experts too, so the model type, not the key, tells them from
  // Mixtral.
  const bool qwen = m.model_type.rfind("qwen", 0) == 0;
  RoutingParams& r = m.routing;
  const char* inter_key = "moe_intermediate_size";
  if (gpt_oss) {
    r.mode = RoutingMode::kGptOss;
    m.activation = Activation::kGptOss;
    inter_key = "intermediate_size";
  } else if (m.num_experts_key == std::string("n_routed_experts")) {
    // DeepSeek-V3 / Kimi K2 / GLM-4.5+ (and DeepSeek-V2's greedy softmax).
    const bool v3_defaults = m.model_type == "deepseek_v3" || m.model_type == "kimi_k2";
    const bool v2 = m.model_type == "deepseek_v2";
    const std::string scoring = c.string("scoring_func").value_or(v2 ? "softmax" : "sigmoid");
    const std::string method = c.string("topk_method").value_or(v2 ? "greedy" : "noaux_tc");
    const bool norm = c.boolean("norm_topk_prob").value_or(!v2);
    const double factor = c.number("routed_scaling_factor").value_or(v3_defaults ? 2.5 : 1.0);
    if (method == "noaux_tc") {
      FP4MOE_CHECK(scoring == "sigmoid", where, ": topk_method \"noaux_tc\" with scoring_func \"", scoring,
                   "\"; fp4moe's noaux_tc routing scores with \"sigmoid\"");
      FP4MOE_CHECK(norm, where,
                   ": norm_topk_prob is false with topk_method \"noaux_tc\"; fp4moe's noaux_tc "
                   "routing renormalises the top-k weights (norm_topk_prob true, as DeepSeek-V3, Kimi K2 and GLM)");
      r.mode = RoutingMode::kNoauxTc;
      r.num_groups = to_int(c.positive_int("n_group").value_or(v3_defaults ? 8 : 1), where, "n_group");
      r.topk_groups = to_int(c.positive_int("topk_group").value_or(v3_defaults ? 4 : 1), where, "topk_group");
      FP4MOE_CHECK(factor > 0.0, where, ": routed_scaling_factor is ", factor, "; expected > 0");
      r.routed_scaling_factor = static_cast<float>(factor);
    } else if (method == "greedy" && scoring == "softmax") {
      FP4MOE_CHECK(factor == 1.0, where, ": topk_method \"greedy\" with routed_scaling_factor ", factor,
                   "; fp4moe's softmax routing has no scaling factor (expected 1)");
      r.mode = RoutingMode::kSoftmaxTopK;
      r.renormalize = norm;
    } else {
      FP4MOE_THROW(where, ": topk_method \"", method, "\" with scoring_func \"", scoring,
                   "\" is not a routing fp4moe implements; expected \"noaux_tc\" (sigmoid) or \"greedy\" (softmax)");
    }
    m.num_shared_experts = c.count("n_shared_experts").value_or(0);
  } else if (m.num_experts_key == std::string("num_local_experts") && !qwen) {
    // Mixtral: softmax, top-k, always renormalised; intermediate_size is
    // the experts' width.
    r.mode = RoutingMode::kSoftmaxTopK;
    r.renormalize = true;
    inter_key = "intermediate_size";
  } else {
    // Qwen2-MoE / Qwen3-MoE.
    r.mode = RoutingMode::kSoftmaxTopK;
    r.renormalize = c.boolean("norm_topk_prob").value_or(false);
    m.shared_expert_intermediate_size = c.count("shared_expert_intermediate_size").value_or(0);
  }
  r.top_k = m.top_k.value_or(0);
  if (const auto inter = c.positive_int(inter_key)) {
    m.moe_intermediate_size = inter;
    m.moe_intermediate_key = inter_key;
  }
  if (!gpt_oss) {
    const auto act = c.string("hidden_act");
    FP4MOE_CHECK(!act || *act == "silu", where, ": hidden_act is \"", act.value_or(""),
                 "\"; fp4moe's experts compute SwiGLU (\"silu\") or gpt-oss's clamped variant");
  }
  return m;
}

}  // namespace

std::optional<MoeModelConfig> parse_moe_model_config(const std::string& json_text, const std::string& where) {
  return moe_model_config(ConfigJson::parse(json_text, where));
}

std::optional<MoeModelConfig> read_moe_model_config(const std::string& checkpoint_path) {
  std::error_code ec;
  const fs::path path(checkpoint_path);
  const fs::path dir = fs::is_directory(path, ec) ? path : path.parent_path();
  const fs::path config = dir / "config.json";
  if (!fs::exists(config, ec)) return std::nullopt;
  return moe_model_config(ConfigJson::read(config));
}

std::vector<float> compute_router_logits(const RouterWeights& router, const float* hidden_states, int64_t num_tokens) {
  const int64_t E = router.num_experts, H = router.hidden;
  FP4MOE_CHECK(E >= 1 && H >= 1 && router.weight.size() == static_cast<size_t>(E * H),
               "compute_router_logits: weight has ", router.weight.size(), " values; expected [", E, ", ", H, "]");
  FP4MOE_CHECK(router.bias.empty() || router.bias.size() == static_cast<size_t>(E), "compute_router_logits: bias has ",
               router.bias.size(), " values; expected 0 or ", E);
  FP4MOE_CHECK(num_tokens >= 0 && (num_tokens == 0 || hidden_states != nullptr),
               "compute_router_logits: hidden_states is null or num_tokens < 0");
  std::vector<float> logits(static_cast<size_t>(num_tokens * E));
  for (int64_t t = 0; t < num_tokens; ++t) {
    const float* x = hidden_states + t * H;
    for (int64_t e = 0; e < E; ++e) {
      const float* w = router.weight.data() + e * H;
      double sum = router.bias.empty() ? 0.0 : static_cast<double>(router.bias[static_cast<size_t>(e)]);
      for (int64_t h = 0; h < H; ++h) sum += static_cast<double>(w[h]) * static_cast<double>(x[h]);
      logits[static_cast<size_t>(t * E + e)] = static_cast<float>(sum);
    }
  }
  return logits;
}

}  // namespace fp4moe
