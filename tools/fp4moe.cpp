// placeholder main
#include "commands.hpp"
int main(int argc, char** argv) {
  CLI::App app{"fp4moe"};
  CLI11_PARSE(app, argc, argv);
  return 0;
}
