// libFuzzer target: SafetensorsFile::open on arbitrary bytes
// (src/format/safetensors.cpp).
//
// The input is the whole file. Opening it must either throw fp4moe::Error or
// succeed; anything else (another exception, a sanitizer report, a leak, a
// hang) is a finding. When it succeeds, every tensor the file object hands
// out is checked against an independent reading of the header: the view must
// be exactly the bytes its data_offsets name, inside the file, with as many
// bytes as its dtype and shape need. Then the tensors and metadata go through
// SafetensorsWriter and are read back unchanged.
//
// Seeds: fuzz/make-seeds (<build>/fuzz/seeds/safetensors); dictionary:
// fuzz/safetensors.dict. Run with scripts/fuzz safetensors.
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

#include "fp4moe/error.hpp"
#include "fp4moe/safetensors.hpp"
#include "fuzz_util.hpp"

namespace fp4moe::fuzz {
namespace {

uint64_t read_le_u64(const uint8_t* bytes) {
  uint64_t value = 0;
  for (int i = 7; i >= 0; --i) value = (value << 8) | bytes[i];
  return value;
}

// The file was accepted: its views must match what the header says.
void check_views(const SafetensorsFile& file, std::string_view input) {
  const auto* bytes = reinterpret_cast<const uint8_t*>(input.data());
  FP4MOE_FUZZ_ASSERT(input.size() >= 8, "accepted a file shorter than the length prefix");
  const uint64_t header_bytes = read_le_u64(bytes);
  FP4MOE_FUZZ_ASSERT(header_bytes <= input.size() - 8, "accepted a header longer than the file");
  const nlohmann::json header =
      nlohmann::json::parse(input.substr(8, header_bytes), nullptr, /*allow_exceptions=*/false);
  FP4MOE_FUZZ_ASSERT(header.is_object(), "accepted a header that is not a JSON object");
  const size_t data_begin = 8 + header_bytes;

  size_t num_tensors = 0;
  for (const auto& [name, entry] : header.items()) {
    if (name == "__metadata__") continue;
    ++num_tensors;
    FP4MOE_FUZZ_ASSERT(file.contains(name), "a header entry is missing from the file object");
    const TensorView& view = file.get(name);
    FP4MOE_FUZZ_ASSERT(view.name == name, "view name differs from its key");
    FP4MOE_FUZZ_ASSERT(dtype_name(view.dtype) == entry.at("dtype").get<std::string>(),
                       "view dtype differs from the header");
    FP4MOE_FUZZ_ASSERT(view.nbytes == static_cast<size_t>(view.numel()) * dtype_size(view.dtype),
                       "view byte count differs from numel * dtype size");
    const uint64_t begin = entry.at("data_offsets").at(0).get<uint64_t>();
    const uint64_t end = entry.at("data_offsets").at(1).get<uint64_t>();
    FP4MOE_FUZZ_ASSERT(end - begin == view.nbytes, "view byte count differs from data_offsets");
    FP4MOE_FUZZ_ASSERT(data_begin + end <= input.size(), "accepted data_offsets past the end");
    FP4MOE_FUZZ_ASSERT(view.nbytes == 0 || std::memcmp(view.data, bytes + data_begin + begin,
                                                       view.nbytes) == 0,
                       "view bytes differ from the file's bytes at data_offsets");
  }
  FP4MOE_FUZZ_ASSERT(file.names().size() == num_tensors, "names() differs from the header's tensors");
}

// Writes the accepted file's tensors and metadata again and reads them back.
void check_round_trip(const SafetensorsFile& file) {
  SafetensorsWriter writer;
  for (const std::string& name : file.names()) writer.add(file.get(name));
  for (const auto& [key, value] : file.metadata()) writer.set_metadata(key, value);
  const std::string path = (scratch_dir() / "round_trip.safetensors").string();
  writer.write(path);
  const SafetensorsFile again = SafetensorsFile::open(path);
  FP4MOE_FUZZ_ASSERT(again.metadata() == file.metadata(), "metadata changed in a round trip");
  FP4MOE_FUZZ_ASSERT(again.names().size() == file.names().size(), "tensor count changed in a round trip");
  for (const std::string& name : file.names()) {
    const TensorView& before = file.get(name);
    const TensorView& after = again.get(name);
    FP4MOE_FUZZ_ASSERT(before.dtype == after.dtype && before.shape == after.shape &&
                           before.nbytes == after.nbytes &&
                           (before.nbytes == 0 || std::memcmp(before.data, after.data, before.nbytes) == 0),
                       "a tensor changed in a round trip");
  }
}

}  // namespace
}  // namespace fp4moe::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace fp4moe::fuzz;
  const std::string_view input(reinterpret_cast<const char*>(data), size);
  const std::string path = (scratch_dir() / "input.safetensors").string();
  write_file(path, input);
  try {
    const fp4moe::SafetensorsFile file = fp4moe::SafetensorsFile::open(path);
    check_views(file, input);
    try {
      check_round_trip(file);
    } catch (const fp4moe::Error& e) {
      std::fprintf(stderr, "an accepted file failed its round trip: %s\n", e.what());
      std::abort();
    }
  } catch (const fp4moe::Error& e) {
    note_refusal(e);  // a clear refusal: the expected outcome for most inputs
  } catch (const std::exception& e) {
    std::fprintf(stderr, "unexpected exception (not fp4moe::Error): %s\n", e.what());
    std::abort();
  }
  return 0;
}
