// A main() for the fuzz targets in builds without libFuzzer (GCC, the
// regular test suite): runs LLVMFuzzerTestOneInput once on every file named
// on the command line, or in a directory named there, so that the seed
// corpora and the regression inputs of fuzz/regressions run as ctest tests
// under AddressSanitizer and UBSan everywhere. With libFuzzer the target
// binary itself does this (`fuzz_<target> FILE...`).
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);

int main(int argc, char** argv) {
  namespace fs = std::filesystem;
  std::vector<fs::path> files;
  for (int arg_idx = 1; arg_idx < argc; ++arg_idx) {
    const fs::path path = argv[arg_idx];
    if (fs::is_directory(path)) {
      for (const fs::directory_entry& entry : fs::directory_iterator(path))
        if (entry.is_regular_file()) files.push_back(entry.path());
    } else {
      files.push_back(path);
    }
  }
  std::sort(files.begin(), files.end());
  for (const fs::path& file : files) {
    std::ifstream in(file, std::ios::binary);
    if (!in) {
      std::fprintf(stderr, "%s: cannot open\n", file.c_str());
      return 1;
    }
    const std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    LLVMFuzzerTestOneInput(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size());
  }
  std::printf("replayed %zu inputs\n", files.size());
  return 0;
}
