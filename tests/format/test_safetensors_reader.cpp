// Tests of src/format/safetensors_reader.cpp. Round trips cover every
// dtype with 0-d, zero-size and n-d shapes, metadata, hand-written and
// empty files. The reader is attacked three ways: a table of hand-written
// malformed headers (one per validation rule, checking the message),
// deterministic fuzzing of a valid file's bytes (every truncation, every
// single-bit flip of the length prefix and header, seeded random byte and
// token mutations), and length prefixes that lie. Every corrupt input must
// raise fp4moe::Error and nothing else; a mutant that still opens must
// describe consistent, readable tensors. Also built with ASan/UBSan as
// test_safetensors_asan, so an out-of-bounds read fails there too.
#include <gtest/gtest.h>

#include <sys/stat.h>

#include <algorithm>
#include <cctype>
#include <cstring>
#include <filesystem>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "expect_error.hpp"
#include "fp4moe/error.hpp"
#include "fp4moe/safetensors.hpp"
#include "safetensors_fixture.hpp"

namespace fp4moe {
namespace {

using namespace std::string_literals;

// ---------------------------------------------------------------------------
// Round trips

TEST_F(SafetensorsTest, RoundTripsEveryDTypeAndShape) {
  // No two zero-size tensors are adjacent, so offset order = insertion order.
  const std::vector<std::vector<int64_t>> shapes = {{}, {0}, {1}, {3}, {2, 3}, {2, 0, 4}, {3, 1, 5}};
  std::mt19937_64 rng(1234);
  SafetensorsWriter writer;
  std::vector<std::string> names;
  std::vector<std::vector<uint8_t>> contents;
  for (DType dtype : kAllDTypes) {
    for (size_t shape_idx = 0; shape_idx < shapes.size(); ++shape_idx) {
      const std::vector<int64_t>& shape = shapes[shape_idx];
      names.push_back("layers." + std::string(dtype_name(dtype)) + ".t" + std::to_string(shape_idx));
      contents.push_back(random_bytes(rng, static_cast<size_t>(shape_numel(shape)) * dtype_size(dtype)));
      writer.add(names.back(), dtype, shape, contents.back().data(), contents.back().size());
    }
  }
  writer.set_metadata("format", "pt");
  writer.set_metadata("empty", "");
  writer.set_metadata("unicode \xce\xbb", "value with \"quotes\", \\ and \xe2\x9c\x93");
  EXPECT_EQ(writer.num_tensors(), names.size());
  const std::string path = path_in_dir("all.safetensors");
  writer.write(path);

  const SafetensorsFile file = SafetensorsFile::open(path);
  EXPECT_EQ(file.path(), path);
  EXPECT_EQ(file.names(), names);
  size_t tensor_idx = 0;
  for (DType dtype : kAllDTypes) {
    for (const std::vector<int64_t>& shape : shapes) {
      SCOPED_TRACE(names[tensor_idx]);
      ASSERT_TRUE(file.contains(names[tensor_idx]));
      const TensorView& view = file.get(names[tensor_idx]);
      EXPECT_EQ(view.name, names[tensor_idx]);
      EXPECT_EQ(view.dtype, dtype);
      EXPECT_EQ(view.shape, shape);
      EXPECT_EQ(view.numel(), shape_numel(shape));
      ASSERT_EQ(view.nbytes, contents[tensor_idx].size());
      EXPECT_TRUE(std::equal(view.data, view.data + view.nbytes, contents[tensor_idx].begin()));
      ++tensor_idx;
    }
  }
  const std::map<std::string, std::string> expected_metadata = {
      {"format", "pt"}, {"empty", ""}, {"unicode \xce\xbb", "value with \"quotes\", \\ and \xe2\x9c\x93"}};
  EXPECT_EQ(file.metadata(), expected_metadata);
  EXPECT_FALSE(file.contains("layers.F32"));
  EXPECT_TRUE(temp_files_left().empty());
}

TEST_F(SafetensorsTest, ReadsHandWrittenFiles) {
  // Listed out of offset order, with a gap, an unknown extra field, padding
  // of spaces and a newline: all valid.
  const std::string header =
      "{\"b\": {\"dtype\": \"I32\", \"shape\": [2], \"data_offsets\": [12, 20], \"extra\": 1},\n"
      " \"a\": {\"dtype\": \"U8\", \"shape\": [2, 2], \"data_offsets\": [0, 4]},\n"
      " \"s\": {\"dtype\": \"F16\", \"shape\": [], \"data_offsets\": [20, 22]}}\n     ";
  std::string data(22, '\0');
  for (size_t byte_idx = 0; byte_idx < data.size(); ++byte_idx) data[byte_idx] = static_cast<char>(byte_idx);
  const std::string path = path_in_dir("hand.safetensors");
  write_file_bytes(path, file_image(header, data));

  const SafetensorsFile file = SafetensorsFile::open(path);
  EXPECT_EQ(file.names(), (std::vector<std::string>{"a", "b", "s"}));
  EXPECT_TRUE(file.metadata().empty());
  EXPECT_EQ(file.get("a").nbytes, 4u);
  EXPECT_EQ(file.get("a").data[3], 3);
  EXPECT_EQ(file.get("b").data[0], 12);
  EXPECT_EQ(file.get("s").shape, std::vector<int64_t>{});
  EXPECT_EQ(file.get("s").numel(), 1);
  EXPECT_EQ(file.get("s").data[1], 21);
}

TEST_F(SafetensorsTest, EmptyFilesAreValid) {
  const std::string bare = path_in_dir("bare.safetensors");
  write_file_bytes(bare, file_image("{}", ""));
  EXPECT_TRUE(SafetensorsFile::open(bare).names().empty());

  const std::string padded = path_in_dir("padded.safetensors");
  write_file_bytes(padded, file_image("{}      ", ""));
  EXPECT_TRUE(SafetensorsFile::open(padded).names().empty());

  const std::string written = path_in_dir("written.safetensors");
  SafetensorsWriter().write(written);
  EXPECT_EQ(read_file_bytes(written), file_image("{}      ", ""));
  const SafetensorsFile file = SafetensorsFile::open(written);
  EXPECT_TRUE(file.names().empty());
  EXPECT_TRUE(file.metadata().empty());

  SafetensorsWriter metadata_only;
  metadata_only.set_metadata("k", "v");
  metadata_only.write(written);
  EXPECT_EQ(SafetensorsFile::open(written).metadata().at("k"), "v");
}

TEST_F(SafetensorsTest, GetOfAMissingTensorNamesTheFileAndTheTensor) {
  const std::string path = path_in_dir("seed.safetensors");
  write_seed_file(path);
  const SafetensorsFile file = SafetensorsFile::open(path);
  EXPECT_FALSE(file.contains("experts.1.up_proj.weight"));
  const std::string message = error_of([&] { file.get("experts.1.up_proj.weight"); });
  EXPECT_NE(message.find(path), std::string::npos) << message;
  EXPECT_NE(message.find("'experts.1.up_proj.weight'"), std::string::npos) << message;
}

TEST_F(SafetensorsTest, OpenReportsMissingFilesAndDirectories) {
  const std::string missing = path_in_dir("missing.safetensors");
  std::string message = error_of([&] { SafetensorsFile::open(missing); });
  EXPECT_NE(message.find(missing), std::string::npos) << message;
  EXPECT_NE(message.find("No such file"), std::string::npos) << message;

  message = error_of([&] { SafetensorsFile::open(dir_.string()); });
  EXPECT_NE(message.find("not a regular file"), std::string::npos) << message;
}

// A FIFO is refused like a directory, without blocking in open() for a
// writer that never comes (a shard named by a checkpoint's index could be one).
TEST_F(SafetensorsTest, OpenRefusesAFifoWithoutBlocking) {
  const std::string fifo = path_in_dir("pipe.safetensors");
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0) << std::strerror(errno);
  const std::string message = error_of([&] { SafetensorsFile::open(fifo); });
  EXPECT_NE(message.find("not a regular file"), std::string::npos) << message;
}

TEST_F(SafetensorsTest, MovesKeepViewsValid) {
  const std::string path = path_in_dir("seed.safetensors");
  const std::string bytes = write_seed_file(path);
  SafetensorsFile first = SafetensorsFile::open(path);
  const TensorView* view = &first.get("experts.0.bias");
  const std::vector<uint8_t> expected(view->data, view->data + view->nbytes);

  SafetensorsFile moved(std::move(first));
  EXPECT_EQ(&moved.get("experts.0.bias"), view);  // map nodes move, not copy
  EXPECT_TRUE(std::equal(view->data, view->data + view->nbytes, expected.begin()));

  SafetensorsFile assigned = SafetensorsFile::open(path);
  assigned = std::move(moved);  // closes assigned's own file
  EXPECT_EQ(assigned.path(), path);
  EXPECT_TRUE(std::equal(view->data, view->data + view->nbytes, expected.begin()));
}

// ---------------------------------------------------------------------------
// Malformed files

struct MalformedCase {
  std::string header;
  std::string expected_message;  // a substring of the fp4moe::Error message
};

TEST_F(SafetensorsTest, MalformedHeadersRaiseOneClearError) {
  // Each header breaks one rule; the data section is 128 bytes.
  const auto entry = [](const std::string& fields) { return R"({"x.weight": {)" + fields + "}}"; };
  const std::string valid_dtype = R"("dtype": "F32")";
  const std::string valid_shape = R"("shape": [2])";
  const std::string valid_offsets = R"("data_offsets": [0, 8])";
  const std::vector<MalformedCase> cases = {
      // The JSON itself.
      {"", "is not valid JSON"},
      {"{", "is not valid JSON"},
      {R"({"a": 1,})", "is not valid JSON"},
      {"{} x", "is not valid JSON"},
      {"{}\0\0\0\0"s, "is not valid JSON: NUL byte at offset 2"},
      // nlohmann::json alone would stop at the NUL and never see the tensor.
      {"{}\0{\"x\": {}}"s, "is not valid JSON: NUL byte at offset 2"},
      {"{\"bad \xff name\": {}}", "is not valid JSON"},
      {"[]", "header is not a JSON object, got a JSON array"},
      {R"("text")", "header is not a JSON object, got a JSON string"},
      {"12", "header is not a JSON object, got 12"},
      // The entry.
      {R"({"x.weight": 5})", "tensor 'x.weight': entry must be an object"},
      {R"({"x.weight": [1, 2]})", "tensor 'x.weight': entry must be an object"},
      // dtype.
      {entry(valid_shape + ", " + valid_offsets), "tensor 'x.weight': missing 'dtype'"},
      {entry(R"("dtype": 4, )" + valid_shape + ", " + valid_offsets),
       "tensor 'x.weight': 'dtype' must be a string, got 4"},
      {entry(R"("dtype": null, )" + valid_shape + ", " + valid_offsets), "'dtype' must be a string, got a JSON null"},
      {entry(R"("dtype": "", )" + valid_shape + ", " + valid_offsets), "'dtype' is an empty string"},
      // A dtype fp4moe does not read opens (test_safetensors_robust.cpp), but
      // its byte count is still checked.
      {entry(R"("dtype": "F64", )" + valid_shape + ", " + valid_offsets),
       "tensor 'x.weight': data_offsets [0, 8] but shape [2] of F64 needs 16 bytes"},
      // shape.
      {entry(valid_dtype + ", " + valid_offsets), "tensor 'x.weight': missing 'shape'"},
      {entry(valid_dtype + R"(, "shape": 2, )" + valid_offsets), "'shape' must be an array of dimensions, got 2"},
      {entry(valid_dtype + R"(, "shape": {"0": 2}, )" + valid_offsets), "'shape' must be an array"},
      {entry(valid_dtype + R"(, "shape": [2, -1], )" + valid_offsets),
       "tensor 'x.weight': shape[1] must be a non-negative integer, got -1"},
      {entry(valid_dtype + R"(, "shape": [2.5], )" + valid_offsets),
       "shape[0] must be a non-negative integer, got 2.5"},
      {entry(valid_dtype + R"(, "shape": [2.0], )" + valid_offsets),
       "shape[0] must be a non-negative integer, got 2.0"},
      {entry(valid_dtype + R"(, "shape": [1e30], )" + valid_offsets), "shape[0] must be a non-negative integer"},
      {entry(valid_dtype + R"(, "shape": ["2"], )" + valid_offsets),
       "shape[0] must be a non-negative integer, got a JSON string"},
      {entry(valid_dtype + R"(, "shape": [null], )" + valid_offsets), "got a JSON null"},
      {entry(valid_dtype + R"(, "shape": [[2]], )" + valid_offsets), "got a JSON array"},
      {entry(valid_dtype + R"(, "shape": [9223372036854775808], )" + valid_offsets),
       "shape[0] = 9223372036854775808 does not fit in a signed 64-bit dimension"},
      {entry(valid_dtype + R"(, "shape": [18446744073709551615], )" + valid_offsets),
       "does not fit in a signed 64-bit dimension"},
      {entry(R"("dtype": "U8", "shape": [4294967296, 4294967296], )" + valid_offsets),
       "tensor 'x.weight': shape [4294967296, 4294967296] of U8 overflows a 64-bit byte count"},
      {entry(valid_dtype + R"(, "shape": [2305843009213693952], )" + valid_offsets),
       "shape [2305843009213693952] of F32 overflows a 64-bit byte count"},
      // data_offsets.
      {entry(valid_dtype + ", " + valid_shape), "tensor 'x.weight': missing 'data_offsets'"},
      {entry(valid_dtype + ", " + valid_shape + R"(, "data_offsets": 8)"),
       "'data_offsets' must be an array [begin, end], got 8"},
      {entry(valid_dtype + ", " + valid_shape + R"(, "data_offsets": [8])"),
       "'data_offsets' must be an array [begin, end], got an array of 1 elements"},
      {entry(valid_dtype + ", " + valid_shape + R"(, "data_offsets": [0, 8, 16])"), "got an array of 3 elements"},
      {entry(valid_dtype + ", " + valid_shape + R"(, "data_offsets": [-8, 0])"),
       "data_offsets must be non-negative integers, got [-8, 0]"},
      {entry(valid_dtype + ", " + valid_shape + R"(, "data_offsets": [0, 8.5])"),
       "data_offsets must be non-negative integers, got [0, 8.5]"},
      {entry(valid_dtype + ", " + valid_shape + R"(, "data_offsets": ["0", 8])"),
       "data_offsets must be non-negative integers, got [a JSON string, 8]"},
      {entry(valid_dtype + ", " + valid_shape + R"(, "data_offsets": [16, 8])"),
       "tensor 'x.weight': data_offsets [16, 8] have end before begin"},
      {entry(valid_dtype + ", " + valid_shape + R"(, "data_offsets": [124, 132])"),
       "tensor 'x.weight': data_offsets [124, 132] run past the end of the data section (128 bytes)"},
      {entry(valid_dtype + ", " + valid_shape + R"(, "data_offsets": [0, 18446744073709551615])"),
       "run past the end of the data section"},
      {entry(valid_dtype + R"(, "shape": [4, 8], "data_offsets": [0, 100])"),
       "tensor 'x.weight': data_offsets [0, 100] but shape [4, 8] of F32 needs 128 bytes"},
      {entry(valid_dtype + R"(, "shape": [], "data_offsets": [0, 0])"),
       "data_offsets [0, 0] but shape [] of F32 needs 4 bytes"},
      {entry(valid_dtype + R"(, "shape": [0], "data_offsets": [0, 4])"),
       "data_offsets [0, 4] but shape [0] of F32 needs 0 bytes"},
      // Between tensors.
      {R"({"a": {"dtype": "U8", "shape": [8], "data_offsets": [0, 8]},)"
       R"( "b": {"dtype": "U8", "shape": [8], "data_offsets": [4, 12]}})",
       "tensor 'b': data_offsets [4, 12] overlap tensor 'a' at [0, 8]"},
      {R"({"a": {"dtype": "U8", "shape": [8], "data_offsets": [0, 8]},)"
       R"( "b": {"dtype": "U8", "shape": [8], "data_offsets": [0, 8]}})",
       "overlap tensor 'a' at [0, 8]"},
      {R"({"big": {"dtype": "U8", "shape": [64], "data_offsets": [0, 64]},)"
       R"( "inner": {"dtype": "U8", "shape": [0], "data_offsets": [8, 8]}})",
       "tensor 'inner': data_offsets [8, 8] overlap tensor 'big' at [0, 64]"},
      {R"({"a": {"dtype": "U8", "shape": [8], "data_offsets": [0, 8]},)"
       R"( "a": {"dtype": "U8", "shape": [8], "data_offsets": [8, 16]}})",
       "header lists 'a' more than once"},
      // Metadata.
      {R"({"__metadata__": 5})", "'__metadata__' must be an object of strings, got 5"},
      {R"({"__metadata__": ["format", "pt"]})", "'__metadata__' must be an object of strings, got a JSON array"},
      {R"({"__metadata__": {"format": "pt", "version": 2}})", "'__metadata__' entry 'version' must be a string, got 2"},
      {R"({"__metadata__": {"nested": {"a": "b"}}})", "entry 'nested' must be a string, got a JSON object"},
  };
  const std::string data(128, '\x5a');
  const std::string path = path_in_dir("model.safetensors");
  for (const MalformedCase& test_case : cases) {
    SCOPED_TRACE("header: " + test_case.header);
    write_file_bytes(path, file_image(test_case.header, data));
    const std::string message = error_of([&] { SafetensorsFile::open(path); });
    EXPECT_EQ(message.rfind(path + ": ", 0), 0u) << "message does not start with the path: " << message;
    EXPECT_NE(message.find(test_case.expected_message), std::string::npos) << message;
  }
}

TEST_F(SafetensorsTest, LyingLengthPrefixesAreRejected) {
  const std::string path = path_in_dir("prefix.safetensors");
  const std::string body = R"({"a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}})"
                           "x";
  const uint64_t file_bytes = 8 + body.size();
  const std::pair<uint64_t, std::string> cases[] = {
      {file_bytes - 7, "runs past the end of the file"},
      {file_bytes, "runs past the end of the file"},
      {100'000'001, "exceeds the limit of 100000000 bytes"},
      {uint64_t{1} << 63, "exceeds the limit"},
      {std::numeric_limits<uint64_t>::max(), "exceeds the limit"},
      {std::numeric_limits<uint64_t>::max() - 7, "exceeds the limit"},
  };
  for (const auto& [header_bytes, expected] : cases) {
    SCOPED_TRACE("header length " + std::to_string(header_bytes));
    write_file_bytes(path, length_prefix(header_bytes) + body);
    const std::string message = error_of([&] { SafetensorsFile::open(path); });
    EXPECT_NE(message.find(expected), std::string::npos) << message;
  }
  // The file exactly as long as the prefix says, with no data section: the
  // tensor then runs past the end of the (empty) data section.
  write_file_bytes(path, length_prefix(body.size() - 1) + body.substr(0, body.size() - 1));
  EXPECT_NE(error_of([&] { SafetensorsFile::open(path); }).find("run past the end of the data section (0 bytes)"),
            std::string::npos);
}

TEST_F(SafetensorsTest, FuzzEveryTruncationIsRejected) {
  const std::string path = path_in_dir("seed.safetensors");
  const std::string seed = write_seed_file(path);
  ASSERT_EQ(open_untrusted(path, "seed"), OpenOutcome::kOpened);
  const std::string truncated_path = path_in_dir("truncated.safetensors");
  for (size_t length = 0; length < seed.size(); ++length) {
    write_file_bytes(truncated_path, seed.substr(0, length));
    const std::string what = "truncated to " + std::to_string(length) + " bytes";
    EXPECT_EQ(open_untrusted(truncated_path, what), OpenOutcome::kRejected) << what;
    if (length < 8) {
      EXPECT_NE(
          error_of([&] { SafetensorsFile::open(truncated_path); }).find("shorter than the 8-byte header length prefix"),
          std::string::npos);
    }
  }
}

TEST_F(SafetensorsTest, FuzzEveryBitFlipOfLengthPrefixAndHeader) {
  const std::string seed = write_seed_file(path_in_dir("seed.safetensors"));
  uint64_t header_bytes = 0;
  for (int byte_idx = 7; byte_idx >= 0; --byte_idx) {
    header_bytes = (header_bytes << 8) | static_cast<uint8_t>(seed[byte_idx]);
  }
  const std::string path = path_in_dir("flipped.safetensors");
  int num_opened = 0;
  for (size_t byte_idx = 0; byte_idx < 8 + header_bytes; ++byte_idx) {
    for (int bit = 0; bit < 8; ++bit) {
      std::string mutant = seed;
      mutant[byte_idx] = static_cast<char>(mutant[byte_idx] ^ (1 << bit));
      write_file_bytes(path, mutant);
      const std::string what = "bit " + std::to_string(bit) + " of byte " + std::to_string(byte_idx);
      const OpenOutcome outcome = open_untrusted(path, what);
      // Any change of the length prefix must be caught; a flip inside the
      // header may still be valid (a renamed tensor, an edited metadata value).
      if (byte_idx < 8) {
        EXPECT_EQ(outcome, OpenOutcome::kRejected) << what;
      }
      num_opened += outcome == OpenOutcome::kOpened;
    }
  }
  RecordProperty("header_bit_flips_still_valid", num_opened);
}

// Seeded random edits of the seed file: byte replacements, insertions and
// deletions in the header, and replacement of JSON tokens with boundary
// values; with the length prefix kept consistent or left stale.
TEST_F(SafetensorsTest, FuzzRandomMutationsNeverCrash) {
  const std::string seed = write_seed_file(path_in_dir("seed.safetensors"));
  const size_t data_section_bytes = 4 * 6 + 4 * 2 + 4 + 2 * 3;  // see write_seed_file()
  const size_t data_section_begin = seed.size() - data_section_bytes;
  const std::string seed_header = seed.substr(8, data_section_begin - 8);
  const std::string seed_data = seed.substr(data_section_begin);
  const std::vector<std::string> boundary_tokens = {"-1",
                                                    "0",
                                                    "1",
                                                    "3",
                                                    "4",
                                                    "8",
                                                    "24",
                                                    "4294967296",
                                                    "9223372036854775807",
                                                    "9223372036854775808",
                                                    "18446744073709551615",
                                                    "18446744073709551616",
                                                    "99999999999999999999999",
                                                    "1e3",
                                                    "2.0",
                                                    "-0",
                                                    "null",
                                                    "true",
                                                    "\"8\"",
                                                    "[]",
                                                    "{}",
                                                    "[0,0]",
                                                    "\"F64\"",
                                                    "\"I64\"",
                                                    "\"U8\"",
                                                    "\"__metadata__\"",
                                                    "{\"a\":1}"};
  const std::string json_bytes = "{}[],:\" 0123456789-.eE\\";

  std::mt19937_64 rng(20261202);
  const std::string path = path_in_dir("mutant.safetensors");
  int num_opened = 0;
  int num_rejected = 0;
  constexpr int kNumMutants = 10000;
  for (int mutant_idx = 0; mutant_idx < kNumMutants; ++mutant_idx) {
    std::string header = seed_header;
    const int num_edits = 1 + static_cast<int>(rng() % 3);
    for (int edit = 0; edit < num_edits && !header.empty(); ++edit) {
      const size_t position = rng() % header.size();
      switch (rng() % 5) {
        case 0:  // any byte
          header[position] = static_cast<char>(rng());
          break;
        case 1:  // a byte that means something in JSON
          header[position] = json_bytes[rng() % json_bytes.size()];
          break;
        case 2:
          header.insert(position, 1, json_bytes[rng() % json_bytes.size()]);
          break;
        case 3:
          header.erase(position, 1 + rng() % 4);
          break;
        default: {  // replace the number or string token around position
          const auto is_token_char = [&](size_t idx) {
            return std::isalnum(static_cast<unsigned char>(header[idx])) || header[idx] == '_' || header[idx] == '.' ||
                   header[idx] == '-';
          };
          size_t begin = position;
          size_t end = position;
          while (begin > 0 && is_token_char(begin - 1)) --begin;
          while (end < header.size() && is_token_char(end)) ++end;
          header.replace(begin, end - begin, boundary_tokens[rng() % boundary_tokens.size()]);
          break;
        }
      }
    }
    const bool stale_prefix = rng() % 8 == 0;
    std::string image = length_prefix(stale_prefix ? seed_header.size() : header.size()) + header + seed_data;
    write_file_bytes(path, image);
    const std::string what = "mutant " + std::to_string(mutant_idx) + " header: " + header;
    if (open_untrusted(path, what) == OpenOutcome::kOpened) {
      ++num_opened;
    } else {
      ++num_rejected;
    }
  }
  RecordProperty("mutants_opened", num_opened);
  RecordProperty("mutants_rejected", num_rejected);
  // The fuzzer must exercise both paths to mean anything.
  EXPECT_GT(num_opened, 0);
  EXPECT_GT(num_rejected, kNumMutants / 2);
}

}  // namespace
}  // namespace fp4moe
