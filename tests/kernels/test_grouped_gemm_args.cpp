// CPU tests of the grouped GEMM's host side: argument validation (refused
// before any CUDA call), the weight packer's round trip, and the fragment
// word's bit layout as the dequantiser reads it.
#include <gtest/gtest.h>

#include <cmath>
#include <initializer_list>
#include <random>
#include <string>

#include "fp4moe/error.hpp"
#include "fp4moe/nvfp4.hpp"
#include "kernels/fragment_layout.hpp"
#include "kernels/grouped_gemm.hpp"
#include "gpu_test_util.hpp"

namespace fp4moe {
namespace {

GroupedGemmArgs valid_args() {
  // Fake, aligned, never dereferenced: validation fails before any launch.
  alignas(16) static uint8_t dummy[64];
  static const int32_t offsets[] = {0, 3, 3, 8};
  GroupedGemmArgs a;
  a.weights = dummy;
  a.scales = dummy;
  a.global_scales = reinterpret_cast<const float*>(dummy);
  a.num_experts = 3;
  a.n = 128;
  a.k = 256;
  a.x = dummy;
  a.expert_offsets = offsets;
  a.num_rows = 8;
  a.y = dummy;
  a.workspace = dummy;
  a.workspace_bytes = sizeof dummy;
  a.host_expert_offsets = offsets;
  return a;
}

void expect_error(const GroupedGemmArgs& args, const std::string& fragment) {
  GemmPlan plan;
  plan.config = compiled_configs().front();
  try {
    grouped_gemm(args, plan, nullptr);
    ADD_FAILURE() << "expected an error containing '" << fragment << "'";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(fragment), std::string::npos)
        << "message: " << e.what() << "\nexpected to contain: " << fragment;
  }
}

// valid_args() for the finalize epilogue, deterministic: bf16 rows, one per
// slot.
GroupedGemmArgs finalize_args() {
  alignas(16) static uint16_t out_bf16[8 * 128];
  static const int32_t scatter[8] = {};
  GroupedGemmArgs a = valid_args();
  a.y = nullptr;
  a.out_bf16 = out_bf16;
  a.scatter_rows = scatter;
  a.out_rows = 8;
  return a;
}

// grouped_gemm with a finalize config must refuse `args` with a message
// holding every fragment.
void expect_finalize_error(const GroupedGemmArgs& args, std::initializer_list<const char*> fragments) {
  GemmPlan plan;
  for (const TileConfig& c : compiled_configs())
    if (c.epilogue == Epilogue::kFinalize) plan.config = c;
  ASSERT_EQ(plan.config.epilogue, Epilogue::kFinalize);
  try {
    grouped_gemm(args, plan, nullptr);
    ADD_FAILURE() << "accepted; expected an error containing '" << *fragments.begin() << "'";
  } catch (const Error& e) {
    for (const char* fragment : fragments)
      EXPECT_NE(std::string(e.what()).find(fragment), std::string::npos)
          << "message: " << e.what() << "\nexpected to contain: " << fragment;
  }
}

TEST(GroupedGemmArgs, RejectsMisalignedShapes) {
  GroupedGemmArgs a = valid_args();
  a.k = 200;
  expect_error(a, "k = 200; expected a positive multiple of 16");
  a = valid_args();
  a.n = 100;
  expect_error(a, "n = 100; expected a positive multiple of 16");
  a = valid_args();
  a.num_experts = 0;
  expect_error(a, "num_experts = 0");
  a = valid_args();
  a.num_experts = 513;
  expect_error(a, "num_experts = 513");
  // Sizes past 32-bit indexing are refused, not truncated.
  a = valid_args();
  a.n = int64_t{1} << 31;
  expect_error(a, "(32-bit indexing)");
  a = valid_args();
  a.k = (int64_t{1} << 31) + 16;
  expect_error(a, "(32-bit indexing)");
  a = valid_args();
  a.n = int64_t{1} << 21;
  a.k = int64_t{1} << 20;
  expect_error(a, "expected < 2^40");
}

// Row counts at 2^31 (every rows * N product the kernels form is then past
// 2^31 * 16) are refused before any CUDA call.
TEST(GroupedGemmArgs, RejectsRowCountsPast2To31) {
  GroupedGemmArgs a = valid_args();
  a.host_expert_offsets = nullptr;
  a.num_rows = int64_t{1} << 31;
  expect_error(a, "num_rows = 2147483648; expected 0..2^31-1");
  a = valid_args();
  static const int32_t gather[8] = {};
  a.gather_rows = gather;
  a.x_rows = int64_t{1} << 31;
  expect_error(a, "x_rows = 2147483648; expected < 2^31");

  a = finalize_args();
  a.out_rows = int64_t{1} << 31;
  expect_finalize_error(a, {"out_rows = 2147483648", "out_rows < 2^31"});
}

// The finalize epilogue writes bf16 (token, slot) rows (out_bf16) or adds
// into fp32 token rows (out_f32, atomic_out): exactly the one of its mode.
TEST(GroupedGemmArgs, RejectsFinalizeOutputsOfTheOtherMode) {
  alignas(16) static float out_f32[4];
  GroupedGemmArgs a = finalize_args();
  a.out_bf16 = nullptr;
  expect_finalize_error(
      a, {"without atomic_out stores bf16 rows into out_bf16", "expected out_bf16 set and out_f32 null"});
  a.out_f32 = out_f32;  // fp32 rows are the atomic mode's
  expect_finalize_error(a, {"expected out_bf16 set and out_f32 null"});
  a = finalize_args();
  a.out_f32 = out_f32;  // both
  expect_finalize_error(a, {"expected out_bf16 set and out_f32 null"});

  a = finalize_args();
  a.atomic_out = true;  // bf16 rows given, no fp32 accumulator
  expect_finalize_error(a,
                        {"the atomic finalize epilogue adds into out_f32", "expected out_f32 set and out_bf16 null"});
  a.out_f32 = out_f32;  // both
  expect_finalize_error(a, {"expected out_f32 set and out_bf16 null"});

  a = finalize_args();
  a.scatter_rows = nullptr;
  expect_finalize_error(a, {"the finalize epilogue needs scatter_rows"});
}

TEST(GroupedGemmArgs, RejectsMisalignedFinalizeRows) {
  GroupedGemmArgs a = finalize_args();
  a.out_bf16 = static_cast<uint8_t*>(a.out_bf16) + 8;  // one bf16x4 off
  expect_finalize_error(a, {"out_bf16 = ", "is not 16-byte aligned"});
  alignas(16) static float out_f32[8];
  a = finalize_args();
  a.atomic_out = true;
  a.out_bf16 = nullptr;
  a.out_f32 = out_f32 + 2;
  expect_finalize_error(a, {"out_f32 = ", "is not 16-byte aligned"});
}

TEST(GroupedGemmArgs, RejectsNullPointersWithRows) {
  for (const char* field : {"weights", "scales", "global_scales", "x", "y", "expert_offsets", "workspace"}) {
    GroupedGemmArgs a = valid_args();
    const std::string f = field;
    if (f == "weights") a.weights = nullptr;
    if (f == "scales") a.scales = nullptr;
    if (f == "global_scales") a.global_scales = nullptr;
    if (f == "x") a.x = nullptr;
    if (f == "y") a.y = nullptr;
    if (f == "expert_offsets") a.expert_offsets = nullptr;
    if (f == "workspace") a.workspace = nullptr;
    expect_error(a, f + " is null but num_rows = 8");
  }
}

TEST(GroupedGemmArgs, RejectsMisalignedPointers) {
  GroupedGemmArgs a = valid_args();
  a.x = static_cast<const uint8_t*>(a.x) + 2;
  expect_error(a, "x = ");
  expect_error(a, "is not 16-byte aligned");
}

TEST(GroupedGemmArgs, RejectsBadHostOffsets) {
  GroupedGemmArgs a = valid_args();
  const int32_t not_monotone[] = {0, 5, 3, 8};
  a.host_expert_offsets = not_monotone;
  expect_error(a, "expert_offsets not monotone: offsets[2] = 3 < offsets[1] = 5");
  const int32_t bad_start[] = {1, 3, 3, 8};
  a.host_expert_offsets = bad_start;
  expect_error(a, "expert_offsets[0] = 1; expected 0");
  const int32_t bad_end[] = {0, 3, 3, 7};
  a.host_expert_offsets = bad_end;
  expect_error(a, "expert_offsets[3] = 7; expected num_rows = 8");
}

TEST(PrepareGemmWeights, RoundTripsEveryElement) {
  std::mt19937 rng(3);
  for (auto [n, k] : {std::pair<int64_t, int64_t>{16, 16}, {144, 272}, {128, 256}, {32, 1040}}) {
    std::vector<Nvfp4Matrix> experts;
    for (int e = 0; e < 3; ++e) experts.push_back(testing::random_nvfp4(n, k, 0.01f * (e + 1), rng));
    std::vector<const Nvfp4Matrix*> ptrs;
    for (const auto& m : experts) ptrs.push_back(&m);
    const PreparedGemmWeights p = prepare_gemm_weights(ptrs);
    EXPECT_EQ(p.n_padded % 128, 0);
    EXPECT_EQ(p.k_padded % 256, 0);
    for (int e = 0; e < 3; ++e)
      for (int64_t r = 0; r < n; ++r)
        for (int64_t c = 0; c < k; ++c)
          ASSERT_EQ(p.value(e, r, c), experts[e].value(r, c))
              << "expert " << e << " [" << r << ", " << c << "] n=" << n << " k=" << k;
  }
}

// The kernels' dequantiser reads the fragment word with layout::placed_pair:
// every code in every slot must come out as its e2m1 value times 2^-126 in
// its register's half, whatever the other seven slots hold.
TEST(FragmentLayout, EveryCodeInEverySlotPlacesExactly) {
  std::mt19937 rng(5);
  for (int slot = 0; slot < 8; ++slot) {
    const int j = 3 - slot % 4;  // the A register of the slot's pair
    const int half = slot / 4;   // 0: the bf16x2's low half (even k), 1: high
    for (uint32_t code = 0; code < 16; ++code) {
      for (int trial = 0; trial < 16; ++trial) {
        uint32_t word = layout::code_in_slot(slot, code);
        for (int other = 0; other < 8; ++other)
          if (other != slot) word |= layout::code_in_slot(other, rng() & 0xFu);
        ASSERT_EQ(layout::code_of_slot(word, slot), code) << "slot " << slot;
        const uint16_t bits = static_cast<uint16_t>(layout::placed_pair(word, j) >> (16 * half));
        ASSERT_EQ(bf16_to_float(bits), std::ldexp(e2m1_to_float(static_cast<uint8_t>(code)), -126))
            << "slot " << slot << " code " << code << " word " << std::hex << word;
      }
    }
  }
  // The eight slots tile the word: all ones in every slot set every bit once.
  uint32_t all = 0;
  for (int slot = 0; slot < 8; ++slot) {
    EXPECT_EQ(all & layout::code_in_slot(slot, 0xFu), 0u) << "slot " << slot << " overlaps";
    all |= layout::code_in_slot(slot, 0xFu);
  }
  EXPECT_EQ(all, 0xFFFFFFFFu);
}

TEST(PrepareGemmWeights, RejectsBadInput) {
  std::mt19937 rng(4);
  Nvfp4Matrix a = testing::random_nvfp4(32, 64, 0.01f, rng);
  Nvfp4Matrix b = testing::random_nvfp4(48, 64, 0.01f, rng);
  std::vector<const Nvfp4Matrix*> mixed = {&a, &b};
  EXPECT_THROW(prepare_gemm_weights(mixed), Error);
  Nvfp4Matrix nan_scale = a;
  nan_scale.scales[5] = 0x7F;
  std::vector<const Nvfp4Matrix*> bad = {&nan_scale};
  try {
    prepare_gemm_weights(bad);
    ADD_FAILURE() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("block scale #5"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace fp4moe
