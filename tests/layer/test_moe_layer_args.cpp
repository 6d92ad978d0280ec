// CPU tests of MoeLayer::prepare's weight validation, which runs on the host
// before anything touches the GPU: shapes that differ between experts, hidden or inter
// not a multiple of 16, wrong bias sizes, zero experts, more than 512
// experts, short buffers, NaN and negative block scales, batch invariance
// asked with the atomic finalize, fp4 activations without usable input
// scales. Every case checks
// what the message says, not only that it throws, so these run (and pass)
// without a GPU.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cctype>
#include <functional>
#include <limits>
#include <random>
#include <string>

#include "fp4moe/error.hpp"
#include "fp4moe/moe_layer.hpp"
#include "gpu_test_util.hpp"

namespace fp4moe {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::Not;

constexpr int64_t kHidden = 64;
constexpr int64_t kInter = 32;

// A small valid layer: num_experts experts of [kInter, kHidden] / [kHidden, kInter].
MoeWeights valid_weights(int64_t num_experts = 4, bool with_bias = false, int64_t hidden = kHidden,
                         int64_t inter = kInter) {
  std::mt19937 rng(7);
  MoeWeights w = testing::random_moe_weights(num_experts, hidden, inter, 0.01f, 0.02f, rng);
  for (ExpertWeights& ex : w.experts)
    if (with_bias) {
      ex.gate_bias.assign(static_cast<size_t>(inter), 0.5f);
      ex.up_bias.assign(static_cast<size_t>(inter), -0.25f);
      ex.down_bias.assign(static_cast<size_t>(hidden), 0.125f);
    }
  return w;
}

MoeLayerOptions options_for(int64_t num_experts) {
  MoeLayerOptions o;
  o.routing.top_k = static_cast<int>(std::min<int64_t>(2, std::max<int64_t>(num_experts, 1)));
  return o;
}

std::string lowercase(std::string s) {
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return s;
}

// prepare()'s error message, lower-cased; empty (and a test failure) if it
// did not throw fp4moe::Error.
std::string prepare_error(const MoeWeights& weights, const MoeLayerOptions& options) {
  try {
    MoeLayer layer = MoeLayer::prepare(weights, options);
    ADD_FAILURE() << "prepare() accepted weights it should have rejected";
  } catch (const Error& e) {
    return lowercase(e.what());
  } catch (const std::exception& e) {
    ADD_FAILURE() << "prepare() threw something other than fp4moe::Error: " << e.what();
  }
  return {};
}

std::string prepare_error(const MoeWeights& weights) {
  return prepare_error(weights, options_for(weights.num_experts));
}

// Validation must come before any CUDA call: a weight error is never a CUDA error.
auto is_validation_error() { return AllOf(Not(HasSubstr("cudaerror")), Not(HasSubstr("no cuda"))); }

TEST(MoeLayerArgs, RejectsExpertsWhoseShapesDiffer) {
  // Each case replaces one matrix of expert 2 by one of another shape (same
  // global scale, so only the shape is wrong).
  struct Case {
    const char* proj;
    std::function<void(ExpertWeights&)> reshape;
  };
  const Case cases[] = {
      {"gate",
       [](ExpertWeights& ex) { ex.gate = testing::fast_random_nvfp4(kInter - 16, kHidden, ex.gate.global_scale, 1); }},
      {"up",
       [](ExpertWeights& ex) { ex.up = testing::fast_random_nvfp4(kInter, kHidden + 16, ex.up.global_scale, 2); }},
      {"down",
       [](ExpertWeights& ex) { ex.down = testing::fast_random_nvfp4(kHidden, kInter + 16, ex.down.global_scale, 3); }},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.proj);
    MoeWeights w = valid_weights();
    c.reshape(w.experts[2]);
    const std::string msg = prepare_error(w);
    EXPECT_THAT(msg, HasSubstr("expert 2"));
    EXPECT_THAT(msg, HasSubstr(c.proj));
    EXPECT_THAT(msg, is_validation_error());
  }
}

TEST(MoeLayerArgs, RejectsHiddenOrInterNotAMultipleOf16) {
  struct Case {
    int64_t hidden, inter;
    const char* name;
    int64_t bad_value;
  };
  const Case cases[] = {
      {72, 32, "hidden", 72}, {264, 32, "hidden", 264}, {64, 40, "inter", 40}, {64, 200, "inter", 200}};
  for (const Case& c : cases) {
    SCOPED_TRACE(std::string(c.name) + " = " + std::to_string(c.bad_value));
    // The matrices match the (bad) layer dimensions, so only the alignment is wrong.
    const MoeWeights w = valid_weights(4, false, c.hidden, c.inter);
    const std::string msg = prepare_error(w);
    EXPECT_THAT(msg, HasSubstr(c.name));
    EXPECT_THAT(msg, HasSubstr(std::to_string(c.bad_value)));
    EXPECT_THAT(msg, HasSubstr("16"));
    EXPECT_THAT(msg, is_validation_error());
  }
}

// Dimensions past the grouped GEMM's 32-bit indexing are refused before any
// product of them is formed or anything is allocated: the matrices here only
// claim those shapes (their buffers are empty).
TEST(MoeLayerArgs, RejectsDimensionsPast32BitIndexing) {
  struct Case {
    int64_t hidden, inter;
  };
  const Case cases[] = {{int64_t{1} << 31, 16},
                        {(int64_t{1} << 31) - 240, 16},         // past 2^31 - 256
                        {64, int64_t{1} << 30},                 // GEMM1's N = 2 inter = 2^31
                        {int64_t{1} << 20, int64_t{1} << 20},   // 2 inter hidden = 2^41
                        {int64_t{1} << 62, int64_t{1} << 62}};  // products would overflow int64
  for (const Case& c : cases) {
    SCOPED_TRACE("hidden = " + std::to_string(c.hidden) + ", inter = " + std::to_string(c.inter));
    MoeWeights w;
    w.num_experts = 2;
    w.hidden = c.hidden;
    w.inter = c.inter;
    w.experts.resize(2);
    for (ExpertWeights& x : w.experts) {
      x.gate.rows = x.up.rows = x.down.cols = c.inter;
      x.gate.cols = x.up.cols = x.down.rows = c.hidden;
    }
    const std::string msg = prepare_error(w);
    EXPECT_THAT(msg, HasSubstr("32-bit indexing"));
    EXPECT_THAT(msg, HasSubstr("hidden = " + std::to_string(c.hidden)));
  }
  // Just inside the limits, the shapes pass and the empty buffers are what is wrong.
  MoeWeights w;
  w.num_experts = 1;
  w.hidden = (int64_t{1} << 31) - 256;
  w.inter = 16;
  w.experts.resize(1);
  ExpertWeights& x = w.experts[0];
  x.gate.rows = x.up.rows = x.down.cols = w.inter;
  x.gate.cols = x.up.cols = x.down.rows = w.hidden;
  MoeLayerOptions o;
  o.routing.top_k = 1;
  EXPECT_THAT(prepare_error(w, o), HasSubstr("packed bytes"));
}

TEST(MoeLayerArgs, RejectsBiasesOfTheWrongSize) {
  struct Case {
    const char* name;
    std::function<void(ExpertWeights&)> damage;
    int64_t bad_size;
  };
  const Case cases[] = {
      {"gate", [](ExpertWeights& ex) { ex.gate_bias.resize(kInter - 1); }, kInter - 1},
      {"up", [](ExpertWeights& ex) { ex.up_bias.resize(kInter + 5); }, kInter + 5},
      {"down", [](ExpertWeights& ex) { ex.down_bias.resize(kInter); }, kInter},
      {"down", [](ExpertWeights& ex) { ex.down_bias.clear(); }, 0},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(std::string(c.name) + " bias of " + std::to_string(c.bad_size));
    MoeWeights w = valid_weights(4, /*with_bias=*/true);
    c.damage(w.experts[1]);
    const std::string msg = prepare_error(w);
    EXPECT_THAT(msg, HasSubstr("expert 1"));
    EXPECT_THAT(msg, HasSubstr(c.name));
    EXPECT_THAT(msg, HasSubstr("bias"));
    EXPECT_THAT(msg, HasSubstr(std::to_string(c.bad_size)));
    EXPECT_THAT(msg, is_validation_error());
  }
}

TEST(MoeLayerArgs, RejectsBiasesOnSomeExpertsOnly) {
  MoeWeights w = valid_weights(4, /*with_bias=*/true);
  w.experts[2].gate_bias.clear();
  w.experts[2].up_bias.clear();
  w.experts[2].down_bias.clear();
  const std::string msg = prepare_error(w);
  EXPECT_THAT(msg, HasSubstr("expert 2"));
  EXPECT_THAT(msg, HasSubstr("bias"));
  EXPECT_THAT(msg, is_validation_error());
}

TEST(MoeLayerArgs, RejectsBatchInvarianceWithTheAtomicFinalize) {
  MoeLayerOptions o = options_for(4);
  o.batch_invariant = true;
  o.finalize = FinalizeMode::kAtomic;
  const std::string msg = prepare_error(valid_weights(), o);
  EXPECT_THAT(msg, HasSubstr("batch_invariant"));
  EXPECT_THAT(msg, HasSubstr("deterministic"));
  EXPECT_THAT(msg, is_validation_error());
}

TEST(MoeLayerArgs, RejectsZeroExperts) {
  MoeWeights w;
  w.hidden = kHidden;
  w.inter = kInter;
  const std::string msg = prepare_error(w, MoeLayerOptions{});
  EXPECT_THAT(msg, HasSubstr("expert"));
  EXPECT_THAT(msg, HasSubstr("0"));
  EXPECT_THAT(msg, is_validation_error());
}

TEST(MoeLayerArgs, RejectsMoreThan512Experts) {
  const MoeWeights w = valid_weights(513, false, 16, 16);
  const std::string msg = prepare_error(w);
  EXPECT_THAT(msg, HasSubstr("513"));
  EXPECT_THAT(msg, HasSubstr("512"));
  EXPECT_THAT(msg, is_validation_error());
}

TEST(MoeLayerArgs, RejectsAnExpertCountThatDisagreesWithTheExperts) {
  MoeWeights w = valid_weights(4);
  w.num_experts = 5;
  const std::string msg = prepare_error(w);
  EXPECT_THAT(msg, HasSubstr("5"));
  EXPECT_THAT(msg, HasSubstr("4"));
  EXPECT_THAT(msg, HasSubstr("expert"));
  EXPECT_THAT(msg, is_validation_error());
}

TEST(MoeLayerArgs, RejectsBuffersShorterThanTheirShape) {
  // rows/cols say [kInter, kHidden] but the arrays are short: reading them
  // would run off the end, so prepare must refuse.
  MoeWeights w = valid_weights(4);
  w.experts[1].down.packed.resize(w.experts[1].down.packed.size() - 8);
  std::string msg = prepare_error(w);
  EXPECT_THAT(msg, HasSubstr("expert 1"));
  EXPECT_THAT(msg, HasSubstr("down"));
  EXPECT_THAT(msg, is_validation_error());

  w = valid_weights(4);
  w.experts[0].gate.scales.pop_back();
  msg = prepare_error(w);
  EXPECT_THAT(msg, HasSubstr("expert 0"));
  EXPECT_THAT(msg, HasSubstr("gate"));
  EXPECT_THAT(msg, is_validation_error());
}

TEST(MoeLayerArgs, RejectsNanOrNegativeBlockScales) {
  // Every projection: down is packed separately from gate/up, and must be
  // checked before anything is uploaded too.
  struct Case {
    const char* what;
    std::function<std::vector<uint8_t>&(ExpertWeights&)> scales;
    uint8_t code;
    const char* fragment;
  };
  const Case cases[] = {
      {"gate NaN", [](ExpertWeights& ex) -> std::vector<uint8_t>& { return ex.gate.scales; }, 0x7F, "nan"},
      {"up negative", [](ExpertWeights& ex) -> std::vector<uint8_t>& { return ex.up.scales; }, 0xB8, "negative"},
      {"down NaN", [](ExpertWeights& ex) -> std::vector<uint8_t>& { return ex.down.scales; }, 0xFF, "nan"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    MoeWeights w = valid_weights(4);
    c.scales(w.experts[3])[5] = c.code;
    const std::string msg = prepare_error(w);
    EXPECT_THAT(msg, HasSubstr("expert 3"));
    EXPECT_THAT(msg, HasSubstr(c.fragment));
    EXPECT_THAT(msg, is_validation_error());
  }
}

// fp4 activations (W4A4) need an input_scale on every expert matrix, finite
// and positive; refused before anything touches the GPU.
TEST(MoeLayerArgs, RejectsFp4ActivationsWithoutUsableInputScales) {
  MoeLayerOptions fp4 = options_for(4);
  fp4.activations = ActivationNumerics::kFp4;
  MoeWeights w = valid_weights(4);
  std::string msg = prepare_error(w, fp4);
  EXPECT_THAT(msg, HasSubstr("need an input_scale for every expert matrix"));
  EXPECT_THAT(msg, HasSubstr("expert 0 gate has none"));
  EXPECT_THAT(msg, is_validation_error());
  for (ExpertWeights& ex : w.experts) {
    ex.gate.has_input_scale = ex.up.has_input_scale = ex.down.has_input_scale = true;
    ex.gate.input_scale = ex.up.input_scale = ex.down.input_scale = 0.01f;
  }
  w.experts[2].down.has_input_scale = false;
  EXPECT_THAT(prepare_error(w, fp4), HasSubstr("expert 2 down has none"));
  w.experts[2].down.has_input_scale = true;
  for (const float bad : {0.0f, -1.0f, std::numeric_limits<float>::infinity()}) {
    w.experts[3].down.input_scale = bad;
    msg = prepare_error(w, fp4);
    EXPECT_THAT(msg, HasSubstr("down input_scale[3]"));
    EXPECT_THAT(msg, HasSubstr("finite, positive input_scale"));
    EXPECT_THAT(msg, is_validation_error());
  }
}

// The positive control: valid weights pass validation. With a GPU, prepare
// succeeds; without one, the first thing that fails is the device, which
// shows that the rejections above are validation, not CUDA, errors.
// A shared expert runs as extra experts of the routed width: a width that is
// not a multiple of it, or more rows per token than the kernels take, is
// refused before any CUDA call; so is a gate of the wrong size.
TEST(MoeLayerArgs, RejectsSharedExpertsTheLayerCannotChunk) {
  const auto with_shared = [](int64_t width, size_t gate_size) {
    MoeWeights w = valid_weights();
    SharedExpertWeights shared;
    shared.inter = width;
    shared.mlp.gate = testing::fast_random_nvfp4(width, kHidden, 0.01f, 11);
    shared.mlp.up = testing::fast_random_nvfp4(width, kHidden, 0.01f, 12);
    shared.mlp.down = testing::fast_random_nvfp4(kHidden, width, 0.01f, 13);
    shared.gate.assign(gate_size, 0.5f);
    w.shared_expert = shared;
    return w;
  };
  std::string msg = prepare_error(with_shared(kInter + 16, 0));
  EXPECT_THAT(msg, HasSubstr("shared expert is " + std::to_string(kInter + 16) + " wide"));
  EXPECT_THAT(msg, HasSubstr("multiple of the routed experts' inter = " + std::to_string(kInter)));
  EXPECT_THAT(msg, is_validation_error());
  msg = prepare_error(with_shared(31 * kInter, 0));  // top_k 2 + 31 chunks > 32 rows per token
  EXPECT_THAT(msg, HasSubstr("33 rows per token"));
  EXPECT_THAT(msg, is_validation_error());
  msg = prepare_error(with_shared(kInter, static_cast<size_t>(kHidden - 1)));
  EXPECT_THAT(msg, HasSubstr("gate has " + std::to_string(kHidden - 1) + " values"));
  EXPECT_THAT(msg, is_validation_error());
  // An unquantised shared expert (ModelOpt's experts-only exports) runs on
  // the CPU backend only.
  MoeWeights dense = with_shared(kInter, 0);
  dense.shared_expert->mlp = ExpertWeights{};
  dense.shared_expert->dense_gate_up.assign(static_cast<size_t>(2 * kInter * kHidden), 0.01f);
  dense.shared_expert->dense_down.assign(static_cast<size_t>(kHidden * kInter), 0.01f);
  msg = prepare_error(dense);
  EXPECT_THAT(msg, HasSubstr("shared expert is unquantised"));
  EXPECT_THAT(msg, HasSubstr("--device cpu"));
  EXPECT_THAT(msg, is_validation_error());
}

TEST(MoeLayerArgs, AcceptsValidWeights) {
  for (bool with_bias : {false, true}) {
    SCOPED_TRACE(with_bias ? "with biases" : "without biases");
    const MoeWeights w = valid_weights(4, with_bias);
    MoeLayerOptions options = options_for(4);
    if (with_bias) options.activation = Activation::kGptOss;
    if (testing::has_cuda_device()) {
      EXPECT_NO_THROW({
        MoeLayer layer = MoeLayer::prepare(w, options);
        EXPECT_EQ(layer.num_experts(), 4);
        EXPECT_EQ(layer.hidden(), kHidden);
        EXPECT_EQ(layer.inter(), kInter);
        EXPECT_EQ(layer.top_k(), 2);
      });
    } else {
      try {
        MoeLayer layer = MoeLayer::prepare(w, options);
        ADD_FAILURE() << "prepare() succeeded without a CUDA device";
      } catch (const Error& e) {
        EXPECT_THAT(lowercase(e.what()), HasSubstr("cuda")) << "expected a CUDA error, got: " << e.what();
      }
    }
  }
}

}  // namespace
}  // namespace fp4moe
