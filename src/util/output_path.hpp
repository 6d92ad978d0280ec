// check_output_path: the one check, before any long work, that an output
// file can be written (its directory exists and it is not a directory). The
// checkpoint converter (src/format/convert.cpp) and the CLI's commands that
// write files run it. Internal (not under include/).
//
// Tested through the CLI in tests/tools/test_cli.cpp and
// tests/tools/test_quantize.cpp.
#pragma once

#include <filesystem>
#include <string>

#include "fp4moe/error.hpp"

namespace fp4moe {

inline void check_output_path(const std::string& path) {
  namespace fs = std::filesystem;
  const fs::path parent = fs::absolute(fs::path(path)).parent_path();
  FP4MOE_CHECK(fs::is_directory(parent), "output ", path, ": directory ", parent.string(), " does not exist");
  FP4MOE_CHECK(!fs::is_directory(path), "output ", path, " is a directory; expected a file name");
}

}  // namespace fp4moe
