#include "commands.hpp"
namespace fp4moe::cli {
void add_quantize_command(CLI::App&) {}
}  // namespace fp4moe::cli
