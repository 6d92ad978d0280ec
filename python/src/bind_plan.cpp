// The planner's binding: describe_plan, what the planner picks for a layer
// shape on an architecture, without a GPU.
// Tested by tests/python/test_cpu.py.
#include <nanobind/stl/string.h>

#include <string>

#include "arrays.hpp"
#include "fp4moe/error.hpp"
#include "fp4moe/moe_layer.hpp"
#include "fp4moe/plan.hpp"
#include "plan/planner.hpp"

namespace fp4moe::python {
namespace {

// What the planner picks for a layer of this shape on `arch` ("sm90", ...;
// no GPU needed), described as MoeLayer.plan describes a layer's plan: the
// heuristic's, with `num_sms` multiprocessors and two blocks per SM for the
// split-K choice (a GPU layer sizes that by its kernels' occupancy, and a
// tune cache may override either GEMM).
std::string describe_plan(int64_t num_experts, int top_k, int64_t hidden, int64_t inter, int64_t num_tokens,
                          const std::string& arch, int num_sms, bool batch_invariant) {
  const ArchLimits limits = arch_limits(arch);
  FP4MOE_CHECK(num_sms >= 1, "fp4moe.describe_plan: num_sms = ", num_sms, "; expected >= 1");
  FP4MOE_CHECK(top_k >= 1 && num_tokens >= 1, "fp4moe.describe_plan: top_k = ", top_k, ", num_tokens = ", num_tokens,
               "; expected >= 1 each");
  MoeLayerPlan p;
  p.num_tokens = num_tokens;
  p.num_rows = num_tokens * top_k;
  GemmPlan* plans[2] = {&p.gemm1, &p.gemm2};
  for (int gemm : {1, 2}) {
    const GemmProblem problem = moe_gemm_problem(gemm, num_experts, top_k, hidden, inter, num_tokens, batch_invariant);
    *plans[gemm - 1] =
        limit_split_k(plan_gemm(problem, limits.smem_per_block, num_sms, limits.compute_capability), batch_invariant);
  }
  return p.describe();
}

}  // namespace

void register_plan(nb::module_& m) {
  m.def("describe_plan", &describe_plan, nb::arg("num_experts"), nb::arg("top_k"), nb::arg("hidden"), nb::arg("inter"),
        nb::arg("num_tokens"), nb::kw_only(), nb::arg("arch") = "sm90", nb::arg("num_sms") = 132,
        nb::arg("batch_invariant") = false,
        "What the planner picks for a layer of this shape on an architecture (sm80, sm86, sm89, sm90, sm100, "
        "sm120), as MoeLayer.plan describes it; no GPU needed (the heuristic's choice: a tune cache may differ).");
}

}  // namespace fp4moe::python
