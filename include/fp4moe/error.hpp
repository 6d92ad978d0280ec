// fp4moe::Error and the checking macros used everywhere in the library.
//
// Library code never exits: it throws fp4moe::Error with file:line and a
// message that says what was wrong and what was expected. Only the CLI turns
// exceptions into exit codes.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

namespace fp4moe {

class Error : public std::runtime_error {
 public:
  Error(const std::string& message, const char* file, int line)
      : std::runtime_error(message + " [" + file + ":" + std::to_string(line) + "]"), message_(message) {}
  // The message without the source location, for user-facing output.
  const std::string& message() const { return message_; }

 private:
  std::string message_;
};

namespace detail {
template <typename... Args>
std::string concat(const Args&... args) {
  std::ostringstream os;
  (os << ... << args);
  return os.str();
}
}  // namespace detail

}  // namespace fp4moe

// Throws fp4moe::Error built from the streamed arguments.
#define FP4MOE_THROW(...) throw ::fp4moe::Error(::fp4moe::detail::concat(__VA_ARGS__), __FILE__, __LINE__)

// Checks a condition on user input or internal state; the message says what
// was expected.
#define FP4MOE_CHECK(cond, ...)             \
  do {                                      \
    if (!(cond)) FP4MOE_THROW(__VA_ARGS__); \
  } while (0)
