// Uses the installed headers and both libraries: the CPU reference runs,
// the GPU layer is linked (not run: the test needs no GPU). Only the
// installed include folder is on the include path (tests/install/), so a
// public header that reached into src/ would fail here.
#include <cstdio>

#include "fp4moe/moe_layer.hpp"
#include "fp4moe/reference.hpp"
#include "fp4moe/types.hpp"

int main() {
  const fp4moe::RoutingMode mode = fp4moe::parse_routing_mode("noaux_tc");
  fp4moe::RoutingParams params;
  params.mode = mode;
  fp4moe::MoeWeights weights;  // the vocabulary of fp4moe/types.hpp
  auto prepare = &fp4moe::MoeLayer::prepare_device;
  std::printf("consumer: routing %s, %lld experts, MoeLayer::prepare_device linked: %s\n",
              fp4moe::to_string(params.mode).c_str(), static_cast<long long>(weights.num_experts),
              prepare != nullptr ? "yes" : "no");
  return params.mode == fp4moe::RoutingMode::kNoauxTc && prepare != nullptr ? 0 : 1;
}
