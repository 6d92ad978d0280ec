// expect_error: the tests' check that a call is refused with an fp4moe::Error
// whose message says what was wrong and what was expected. In namespace
// fp4moe, where the tests live (a fp4moe::testing here would hide gtest's
// ::testing from tests that name it unqualified).
#pragma once

#include <gtest/gtest.h>

#include <functional>
#include <string>
#include <vector>

#include "fp4moe/error.hpp"

namespace fp4moe {

// Runs fn and expects an fp4moe::Error whose message contains every snippet.
inline void expect_error(const std::function<void()>& fn, const std::vector<std::string>& snippets) {
  try {
    fn();
  } catch (const Error& e) {
    for (const std::string& s : snippets)
      EXPECT_NE(e.message().find(s), std::string::npos) << "message '" << e.message() << "' lacks '" << s << "'";
    return;
  }
  ADD_FAILURE() << "expected fp4moe::Error mentioning '" << (snippets.empty() ? "" : snippets[0]) << "'";
}

// Runs fn and returns the message of the fp4moe::Error it throws, for
// matchers; a test failure (and "") when it throws nothing or another type.
inline std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.message();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "threw a std::exception that is not fp4moe::Error: " << e.what();
    return {};
  }
  ADD_FAILURE() << "expected fp4moe::Error";
  return {};
}

}  // namespace fp4moe
