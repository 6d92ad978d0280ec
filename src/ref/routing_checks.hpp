// The checks of noaux_tc's routing parameters, shared by the CPU reference
// (fp4moe::route, routing.cpp) and the GPU routing launchers
// (src/kernels/ops/routing.cu), so that both refuse the same settings with
// the same words. Tested in tests/ref/test_reference.cpp and
// tests/kernels/ops/test_routing.cpp.
#pragma once

#include <cstdint>

#include "fp4moe/reference.hpp"

namespace fp4moe {

// Throws fp4moe::Error, with messages that start with `op` ("route",
// "launch_route") and "(noaux_tc)", unless num_groups divides num_experts
// into groups of at least 2 experts, topk_groups is in [1, num_groups], the
// kept groups hold at least top_k experts, and routed_scaling_factor is
// finite and positive. p.mode is not looked at.
void check_noaux_tc_params(const char* op, int64_t num_experts, const RoutingParams& p);

}  // namespace fp4moe
