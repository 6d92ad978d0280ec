// Reading `fp4moe moe`'s input file (see moe_input.hpp).
// Tested through the CLI in tests/tools/test_cli.cpp and by
// fuzz/fuzz_moe_input.cpp.
#include "moe_input.hpp"

#include <cmath>
#include <cstring>
#include <string>

#include "fp4moe/error.hpp"
#include "tensors.hpp"

namespace fp4moe::cli {
namespace {

// Reads topk_ids/topk_weights and checks them against the layer.
Routing read_given_routing(const SafetensorsFile& in, int64_t num_tokens, int64_t num_experts) {
  const TensorView& ids = in.get("topk_ids");
  FP4MOE_CHECK(ids.dtype == DType::I32, in.path(), ": topk_ids has dtype ", dtype_name(ids.dtype), "; expected I32");
  FP4MOE_CHECK(ids.shape.size() == 2 && ids.shape[0] == num_tokens, in.path(), ": topk_ids has shape ",
               shape_to_string(ids.shape), "; expected [", num_tokens, ", k] (T = ", num_tokens,
               " from hidden_states)");
  const int64_t top_k = ids.shape[1];
  FP4MOE_CHECK(top_k >= 1 && top_k <= num_experts, in.path(), ": topk_ids has k = ", top_k,
               " experts per token; expected 1 <= k <= ", num_experts, " (the layer's expert count)");
  FP4MOE_CHECK(in.contains("topk_weights"), in.path(), ": has topk_ids but no topk_weights [", num_tokens, ", ", top_k,
               "] F32");
  const TensorView& weights = in.get("topk_weights");
  expect_tensor(weights, in.path(), {DType::F32}, {num_tokens, top_k});

  Routing routing;
  routing.num_tokens = num_tokens;
  routing.top_k = static_cast<int>(top_k);
  routing.topk_ids.resize(static_cast<size_t>(num_tokens * top_k));
  routing.topk_weights.resize(routing.topk_ids.size());
  std::memcpy(routing.topk_ids.data(), ids.data, ids.nbytes);
  std::memcpy(routing.topk_weights.data(), weights.data, weights.nbytes);
  for (size_t i = 0; i < routing.topk_ids.size(); ++i) {
    const int32_t id = routing.topk_ids[i];
    FP4MOE_CHECK(id >= 0 && id < num_experts, in.path(), ": topk_ids[", i / top_k, "][", i % top_k, "] = ", id,
                 " is not an expert of the layer; expected 0 <= id < ", num_experts);
    FP4MOE_CHECK(std::isfinite(routing.topk_weights[i]), in.path(), ": topk_weights[", i / top_k, "][", i % top_k,
                 "] = ", routing.topk_weights[i], " is not finite");
  }
  validate_routing(routing, num_experts);  // duplicates within a token, etc.
  return routing;
}

// Routes logits [T, E] by the flags; `bias` is the correction bias (empty:
// none).
Routing route_logits(const std::vector<float>& logit_values, const std::vector<float>& bias,
                     const LogitRoutingFlags& flags, int64_t num_tokens, int64_t num_experts,
                     std::vector<std::string>& notes) {
  FP4MOE_CHECK(flags.top_k.has_value(), "routing from router logits needs --topk K (1 <= K <= ", num_experts,
               "), or a config.json beside the weights that gives num_experts_per_tok");
  FP4MOE_CHECK(*flags.top_k >= 1 && *flags.top_k <= num_experts, "--topk ", *flags.top_k,
               ": expected 1 <= K <= ", num_experts, " (the layer's expert count)");
  RoutingParams params;
  params.mode = parse_routing_mode(flags.mode);
  params.top_k = *flags.top_k;
  params.renormalize = flags.renormalize;
  params.num_groups = flags.num_groups;
  params.topk_groups = flags.topk_groups;
  params.routed_scaling_factor = flags.routed_scaling_factor;
  Routing routing = route(logit_values.data(), num_tokens, num_experts, bias.empty() ? nullptr : bias.data(), params);
  if (routing.tokens_with_nonfinite_logits > 0)
    notes.push_back(std::to_string(routing.tokens_with_nonfinite_logits) +
                    " token(s) have non-finite router logits; their experts were excluded "
                    "(docs/design.md, non-finite inputs)");
  return routing;
}

// Routes the input's router_logits (+ its e_score_correction_bias, else the
// checkpoint's) by the flags.
Routing route_from_logits(const SafetensorsFile& in, const LogitRoutingFlags& flags, const RouterWeights* router,
                          int64_t num_tokens, int64_t num_experts, std::vector<std::string>& notes) {
  const TensorView& logits = in.get("router_logits");
  expect_tensor(logits, in.path(), {DType::F32, DType::BF16, DType::F16}, {num_tokens, num_experts});
  std::vector<float> bias;
  if (in.contains("e_score_correction_bias")) {
    const TensorView& view = in.get("e_score_correction_bias");
    expect_tensor(view, in.path(), {DType::F32, DType::BF16, DType::F16}, {num_experts});
    bias = tensor_to_float(view);
    if (flags.mode != "noaux_tc") notes.push_back("e_score_correction_bias is used by noaux_tc routing only; ignored");
  } else if (flags.mode == "noaux_tc" && router != nullptr && !router->correction_bias.empty()) {
    bias = router->correction_bias;  // the checkpoint's gate.e_score_correction_bias
  }
  return route_logits(tensor_to_float(logits), bias, flags, num_tokens, num_experts, notes);
}

// Computes the logits from the hidden states with the checkpoint's router,
// then routes them by the flags.
Routing route_from_router(const RouterWeights& router, const std::vector<float>& hidden_states,
                          const LogitRoutingFlags& flags, int64_t num_tokens, int64_t hidden, int64_t num_experts,
                          std::vector<std::string>& notes) {
  FP4MOE_CHECK(router.num_experts == num_experts && router.hidden == hidden, "the router '", router.weight_name,
               "' is [", router.num_experts, ", ", router.hidden, "]; expected [", num_experts, ", ", hidden,
               "] (the layer's experts and hidden size)");
  if (flags.mode == "noaux_tc" && router.correction_bias.empty())
    notes.push_back("noaux_tc routing without an e_score_correction_bias in the checkpoint; zeros used");
  const std::vector<float> logits = compute_router_logits(router, hidden_states.data(), num_tokens);
  return route_logits(logits, flags.mode == "noaux_tc" ? router.correction_bias : std::vector<float>(), flags,
                      num_tokens, num_experts, notes);
}

}  // namespace

MoeInput read_moe_input(const SafetensorsFile& in, int64_t hidden, int64_t num_experts, const LogitRoutingFlags& flags,
                        const RouterWeights* router) {
  FP4MOE_CHECK(in.contains("hidden_states"), in.path(), ": no tensor 'hidden_states' [T, ", hidden, "]");
  const TensorView& hidden_view = in.get("hidden_states");
  FP4MOE_CHECK(hidden_view.dtype == DType::BF16 || hidden_view.dtype == DType::F32, in.path(),
               ": hidden_states has dtype ", dtype_name(hidden_view.dtype), "; expected BF16 or F32");
  FP4MOE_CHECK(hidden_view.shape.size() == 2 && hidden_view.shape[1] == hidden, in.path(), ": hidden_states has shape ",
               shape_to_string(hidden_view.shape), "; expected [T, ", hidden, "] (H = ", hidden, " from the weights)");
  MoeInput input;
  input.num_tokens = hidden_view.shape[0];
  FP4MOE_CHECK(input.num_tokens > 0, in.path(), ": hidden_states has T = 0 tokens; expected at least one");
  input.hidden_states = tensor_to_float(hidden_view);

  if (in.contains("topk_ids")) {
    input.routing = read_given_routing(in, input.num_tokens, num_experts);
    input.routing_source = "topk_ids";
    if (in.contains("router_logits"))
      input.notes.push_back("the input has both topk_ids and router_logits; using topk_ids");
  } else if (in.contains("router_logits")) {
    input.routing = route_from_logits(in, flags, router, input.num_tokens, num_experts, input.notes);
    input.routing_source = flags.mode;
  } else if (router != nullptr) {
    input.routing =
        route_from_router(*router, input.hidden_states, flags, input.num_tokens, hidden, num_experts, input.notes);
    input.routing_source = flags.mode + " (router " + router->weight_name + ")";
  } else {
    std::string present;
    for (const std::string& name : in.names()) present += (present.empty() ? "" : ", ") + name;
    FP4MOE_THROW(in.path(),
                 ": no routing; expected topk_ids [T, k] I32 + topk_weights [T, k] F32, "
                 "or router_logits [T, E] F32, or a checkpoint with the layer's router weight "
                 "(<prefix>gate.weight or <prefix>router.weight) to compute them (tensors present: ",
                 present, ")");
  }
  return input;
}

}  // namespace fp4moe::cli
