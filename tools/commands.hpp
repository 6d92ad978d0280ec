// Subcommands of the fp4moe CLI. Each lives in its own cmd_<name>.cpp and
// registers itself on the app; the callback throws fp4moe::Error on failure
// and tools/fp4moe.cpp turns that into a message and a non-zero exit code.
#pragma once

#include <CLI/CLI.hpp>

namespace fp4moe::cli {

void add_quantize_command(CLI::App& app);  // cmd_quantize.cpp
void add_moe_command(CLI::App& app);       // cmd_moe.cpp
void add_demo_command(CLI::App& app);      // cmd_demo.cpp
void add_plan_command(CLI::App& app);      // cmd_plan.cpp
void add_bench_command(CLI::App& app);     // cmd_bench.cpp
void add_soak_command(CLI::App& app);      // cmd_soak.cpp
void add_tune_command(CLI::App& app);      // cmd_tune.cpp

}  // namespace fp4moe::cli
