#include "commands.hpp"
namespace fp4moe::cli {
void add_demo_command(CLI::App&) {}
}  // namespace fp4moe::cli
