// Uses the installed headers and both libraries: the CPU reference runs,
// the GPU layer is linked (not run: the test needs no GPU).
#include <cstdio>

#include "fp4moe/moe_layer.hpp"
#include "fp4moe/reference.hpp"

int main() {
  const fp4moe::RoutingMode mode = fp4moe::parse_routing_mode("noaux_tc");
  auto prepare = &fp4moe::MoeLayer::prepare_device;
  std::printf("consumer: routing %s, MoeLayer::prepare_device linked: %s\n", fp4moe::to_string(mode).c_str(),
              prepare != nullptr ? "yes" : "no");
  return mode == fp4moe::RoutingMode::kNoauxTc && prepare != nullptr ? 0 : 1;
}
