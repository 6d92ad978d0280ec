// The fp4moe command-line tool: quantize, moe, demo, plan, bench, soak and
// tune subcommands (one cmd_<name>.cpp each). This is the only place where
// exceptions become exit codes:
//   0  success (also --help, --version)
//   1  fp4moe::Error: bad input or a failed check, reported as one line
//      "fp4moe: error: <message>" on stderr (set FP4MOE_VERBOSE=1 to also
//      see the source location)
//   2  any other exception (a bug): "fp4moe: internal error: <what>"
//   CLI11's own codes for command-line mistakes (usage printed).
// Tested in tests/tools/test_cli.cpp, which runs the built binary.
#include <cstdio>
#include <cstdlib>
#include <exception>

#include <CLI/CLI.hpp>

#include "commands.hpp"
#include "fp4moe/error.hpp"

#ifndef FP4MOE_VERSION
#define FP4MOE_VERSION "unknown"
#endif

int main(int argc, char** argv) {
  CLI::App app{
      "fp4moe: runs the Mixture-of-Experts layer of NVFP4-quantised LLMs (DeepSeek-V3, GLM, "
      "Qwen3, Kimi K2, gpt-oss, Mixtral) and plans its GPU kernels so that none can fail for "
      "lack of shared memory.",
      "fp4moe"};
  app.require_subcommand(1);
  app.set_version_flag("--version", std::string("fp4moe ") + FP4MOE_VERSION);

  fp4moe::cli::add_quantize_command(app);
  fp4moe::cli::add_moe_command(app);
  fp4moe::cli::add_demo_command(app);
  fp4moe::cli::add_plan_command(app);
  fp4moe::cli::add_bench_command(app);
  fp4moe::cli::add_soak_command(app);
  fp4moe::cli::add_tune_command(app);

  try {
    app.parse(argc, argv);  // runs the chosen subcommand's callback
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  } catch (const fp4moe::Error& e) {
    const char* verbose = std::getenv("FP4MOE_VERBOSE");
    const bool with_location = verbose != nullptr && verbose[0] != '\0' && verbose[0] != '0';
    std::fprintf(stderr, "fp4moe: error: %s\n", with_location ? e.what() : e.message().c_str());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "fp4moe: internal error: %s\n", e.what());
    return 2;
  }
  return 0;
}
