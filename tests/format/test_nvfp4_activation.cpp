// Tests of the NVFP4 activation quantiser (include/fp4moe/nvfp4_activation.hpp)
// against an independent evaluation of ModelOpt's rule: fp32 divisions are
// done in double and rounded once to float (correctly rounded, since double
// has more than 2 * 24 + 2 bits), the e4m3 scale is the nearest of all finite
// e4m3 values listed from the format's definition (ties to the even code),
// and the e2m1 code the nearest of the eight magnitudes by brute force.
// Covers ties, zeros, negative zero, subnormal e4m3 scales, outliers past the
// calibrated range, NaN and infinity, and every bf16 value in one element.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "fp4moe/nvfp4_activation.hpp"

namespace fp4moe {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNan = std::numeric_limits<float>::quiet_NaN();

uint32_t bits_of(float f) {
  uint32_t b;
  std::memcpy(&b, &f, sizeof b);
  return b;
}

// ------------------------------------------------------------- references

// e4m3fn value of a positive code, from the definition (bias 7, 3 mantissa bits).
double ref_e4m3_value(int code) {
  const int e = (code >> 3) & 0xF, m = code & 7;
  return e == 0 ? std::ldexp(m, -9) : std::ldexp(8 + m, e - 10);
}

// Nearest finite positive e4m3 code to b > 0 (b already clamped to
// [2^-9, 448]), ties to the even code.
uint8_t ref_e4m3_code(double b) {
  int best = 1;
  for (int c = 1; c <= 0x7E; ++c) {
    const double d = std::fabs(ref_e4m3_value(c) - b), bd = std::fabs(ref_e4m3_value(best) - b);
    if (d < bd || (d == bd && c % 2 == 0)) best = c;
  }
  return static_cast<uint8_t>(best);
}

double ref_e2m1_magnitude(int mag) {
  static const double kMags[8] = {0, 0.5, 1, 1.5, 2, 3, 4, 6};
  return kMags[mag];
}

// Nearest e2m1 magnitude (saturating), ties to the even code; sign bit for v < 0.
uint8_t ref_e2m1_code(double v) {
  const double a = std::fabs(v);
  // Saturation first: far beyond 6 the distances to 4 and 6 round to one double.
  if (a >= 6) return static_cast<uint8_t>((v < 0 ? 8 : 0) | 7);
  int best = 0;
  for (int m = 1; m < 8; ++m) {
    const double d = std::fabs(ref_e2m1_magnitude(m) - a), bd = std::fabs(ref_e2m1_magnitude(best) - a);
    if (d < bd || (d == bd && m % 2 == 0)) best = m;
  }
  return static_cast<uint8_t>((v < 0 ? 8 : 0) | best);
}

float div_f32(float a, float b) { return static_cast<float>(static_cast<double>(a) / b); }
float mul_f32(float a, float b) { return static_cast<float>(static_cast<double>(a) * b); }

struct RefBlock {
  uint8_t scale;
  uint8_t codes[16];
  double values[16];  // q * sf * s, exact in double
};

// The rule for a block of finite values.
RefBlock ref_quantize(const float* x, float s) {
  double amax = 0;
  for (int i = 0; i < 16; ++i) amax = std::max(amax, std::fabs(static_cast<double>(x[i])));
  double b = div_f32(static_cast<float>(amax), mul_f32(6.0f, s));
  if (b == 0) b = 1;
  b = std::min(std::max(b, std::ldexp(1.0, -9)), 448.0);
  RefBlock r{};
  r.scale = ref_e4m3_code(b);
  const float denom = mul_f32(static_cast<float>(ref_e4m3_value(r.scale)), s);
  for (int i = 0; i < 16; ++i) {
    r.codes[i] = ref_e2m1_code(div_f32(x[i], denom));
    const double q = ref_e2m1_magnitude(r.codes[i] & 7) * ((r.codes[i] & 8) ? -1 : 1);
    r.values[i] = q * ref_e4m3_value(r.scale) * s;
  }
  return r;
}

// Checks the quantiser on one block against the reference; returns the
// number of mismatches (printing the first few).
int check_block(const float* x, float s, const char* what) {
  uint8_t codes[16];
  float unscaled[16];
  const uint8_t scale = nvfp4_act_quantize_block(x, s, codes, unscaled);
  const RefBlock r = ref_quantize(x, s);
  int bad = 0;
  if (scale != r.scale) {
    ADD_FAILURE() << what << ": block scale code 0x" << std::hex << int(scale) << ", expected 0x" << int(r.scale)
                  << std::dec << " (s = " << s << ")";
    return 1;
  }
  for (int i = 0; i < 16; ++i) {
    const double value = static_cast<double>(unscaled[i]) * s;
    if (codes[i] != r.codes[i] || value != r.values[i]) {
      if (bad++ < 4)
        ADD_FAILURE() << what << ": element " << i << " x = " << x[i] << " got code 0x" << std::hex << int(codes[i])
                      << std::dec << " value " << value << ", expected code 0x" << std::hex << int(r.codes[i])
                      << std::dec << " value " << r.values[i] << " (s = " << s << ", scale code 0x" << std::hex
                      << int(scale) << ")";
    }
  }
  return bad;
}

// ------------------------------------------------------------------ tests

TEST(Nvfp4Activation, RandomBlocksAcrossMagnitudesMatchTheRule) {
  std::mt19937 rng(1234);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_int_distribution<int> exponent(-30, 20);
  const float scales[] = {1.0f / 2688.0f, 0.0123f, 3.7e-5f, 1.9f, 0.37f / 2688.0f};
  int bad = 0;
  for (int iter = 0; iter < 20000 && bad == 0; ++iter) {
    float x[16];
    const float mag = std::ldexp(1.0f, exponent(rng));
    for (float& v : x) v = bf16_to_float(float_to_bf16(normal(rng) * mag));  // bf16 inputs, as on the GPU
    bad += check_block(x, scales[iter % 5], "random block");
  }
}

// The quantiser decides each code by comparing |x| with thresholds derived
// from the block's divisor instead of dividing; here every element sits
// within a few fp32 steps of a rounding boundary times the divisor, where
// the quotient's rounding decides the code, for many divisors. The
// reference divides.
TEST(Nvfp4Activation, QuotientsNextToEveryRoundingBoundary) {
  std::mt19937_64 rng(2027);
  std::uniform_real_distribution<float> log2_s(-30.0f, 10.0f), log2_amax(-12.0f, 12.0f);
  const double kBoundaries[8] = {0x1p-150, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0};
  int bad = 0;
  for (int trial = 0; trial < 3000 && bad == 0; ++trial) {
    const float s = std::exp2(log2_s(rng));
    float x[16] = {};
    x[0] = std::exp2(log2_amax(rng)) * s * 2688.0f / 448.0f;  // the block's amax
    uint8_t codes[16];
    const uint8_t scale = nvfp4_act_quantize_block(x, s, codes, nullptr);
    const float d = mul_f32(static_cast<float>(ref_e4m3_value(scale)), s);
    for (int i = 1; i < 16; ++i) {
      const double m = kBoundaries[(trial + i) % 8];
      float v = static_cast<float>(m * d);
      for (int step = (i % 7) - 3; step < 0; ++step) v = std::nextafter(v, 0.0f);
      for (int step = (i % 7) - 3; step > 0; --step) v = std::nextafter(v, INFINITY);
      v = std::min(v, x[0]);  // keeps the block's amax (and scale)
      x[i] = (i % 2) ? -v : v;
    }
    bad += check_block(x, s, "next to a boundary");
  }
}

TEST(Nvfp4Activation, TiesRoundToEvenCodes) {
  // Powers of two keep every division exact: s = 2^-3 and amax 3 give
  // b = 3 / (6 * 2^-3) = 4 and x / (4 * 2^-3) = 2x, so x = t / 2 lands on t.
  const float s = 0.125f;
  const float ties[] = {0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.0f};
  const uint8_t expected[] = {0, 2, 2, 4, 4, 6, 6};  // 0, 1, 1, 2, 2, 4, 4
  for (int k = 0; k < 7; ++k) {
    float x[16] = {};
    x[0] = 3.0f;  // the block's amax
    x[1] = ties[k] * 0.5f;
    x[2] = -ties[k] * 0.5f;
    uint8_t codes[16];
    const uint8_t scale = nvfp4_act_quantize_block(x, s, codes, nullptr);
    EXPECT_EQ(scale, float_to_e4m3(4.0f));
    EXPECT_EQ(codes[1], expected[k]) << "tie at " << ties[k];
    EXPECT_EQ(codes[2], expected[k] | 8) << "tie at -" << ties[k];
    check_block(x, s, "ties");
  }
}

TEST(Nvfp4Activation, ZerosAndNegativeZero) {
  float zeros[16] = {};
  zeros[3] = -0.0f;
  uint8_t codes[16];
  float unscaled[16];
  // An all-zero block gets scale 1 (code 0x38) and code 0 everywhere, also
  // for -0 (x < 0 is false), so it dequantises to +0.
  EXPECT_EQ(nvfp4_act_quantize_block(zeros, 0.01f, codes, unscaled), 0x38);
  for (int i = 0; i < 16; ++i) {
    EXPECT_EQ(codes[i], 0) << i;
    EXPECT_EQ(bits_of(unscaled[i]), 0u) << i;
  }
  // A small negative value rounds to code 0x8: -0.
  float x[16] = {};
  x[0] = 6.0f;
  x[1] = -0.1f;
  nvfp4_act_quantize_block(x, 1.0f, codes, unscaled);
  EXPECT_EQ(codes[1], 0x8);
  EXPECT_EQ(bits_of(unscaled[1]), 0x80000000u);
  check_block(zeros, 0.01f, "zero block");
  check_block(x, 1.0f, "negative zero");
}

TEST(Nvfp4Activation, SubnormalAndClampedScales) {
  const float s = 1.0f;
  // b = amax / 6 below 2^-9 clamps to 2^-9 (code 0x01); subnormal codes 1..7 for
  // b = m * 2^-9; the smallest normal 2^-6 is code 0x08.
  for (int m = 1; m <= 9; ++m) {
    float x[16] = {};
    x[5] = 6.0f * std::ldexp(static_cast<float>(m), -9);
    x[6] = -x[5] / 3.0f;
    uint8_t codes[16];
    EXPECT_EQ(nvfp4_act_quantize_block(x, s, codes, nullptr), m) << "m = " << m;
    check_block(x, s, "subnormal scale");
  }
  float tiny[16] = {};
  tiny[0] = 1e-30f;
  tiny[1] = -3e-31f;
  uint8_t codes[16];
  EXPECT_EQ(nvfp4_act_quantize_block(tiny, s, codes, nullptr), 0x01);
  check_block(tiny, s, "clamped to 2^-9");
  // Between subnormal codes: ties to even (b = 2.5 * 2^-9 -> code 2).
  float half[16] = {};
  half[0] = 6.0f * std::ldexp(2.5f, -9);
  EXPECT_EQ(nvfp4_act_quantize_block(half, s, codes, nullptr), 0x02);
  check_block(half, s, "subnormal tie");
}

TEST(Nvfp4Activation, OutliersPastTheCalibratedRangeSaturate) {
  // input_scale calibrated for amax 10: s = 10 / 2688. A block with amax
  // 1e6 needs b = 1e6 / 60 * ... > 448: the scale clamps to 448 (0x7E) and
  // the outlier saturates to +-6 (+-2688 s = +-10).
  const float s = 10.0f / 2688.0f;
  float x[16];
  for (int i = 0; i < 16; ++i) x[i] = 0.5f * static_cast<float>(i) - 3.0f;
  x[7] = 1e6f;
  x[9] = -3e38f;
  uint8_t codes[16];
  float unscaled[16];
  EXPECT_EQ(nvfp4_act_quantize_block(x, s, codes, unscaled), 0x7E);
  EXPECT_EQ(codes[7], 0x7);
  EXPECT_EQ(codes[9], 0xF);
  EXPECT_EQ(unscaled[7], 2688.0f);
  check_block(x, s, "outliers");
}

TEST(Nvfp4Activation, NanPoisonsItsBlockInfinitySaturates) {
  const float s = 0.01f;
  float x[16];
  for (int i = 0; i < 16; ++i) x[i] = 0.25f * static_cast<float>(i);
  x[4] = kNan;
  uint8_t codes[16];
  float unscaled[16];
  EXPECT_EQ(nvfp4_act_quantize_block(x, s, codes, unscaled), kE4m3NanCode);
  for (int i = 0; i < 16; ++i) EXPECT_TRUE(std::isnan(unscaled[i])) << "element " << i;
  // NaN first or last in the block: the same.
  for (int pos : {0, 15}) {
    for (int i = 0; i < 16; ++i) x[i] = 1.0f;
    x[pos] = -kNan;
    EXPECT_EQ(nvfp4_act_quantize_block(x, s, codes, unscaled), kE4m3NanCode) << "NaN at " << pos;
  }

  for (int i = 0; i < 16; ++i) x[i] = 0.25f * static_cast<float>(i);
  x[2] = kInf;
  x[3] = -kInf;
  EXPECT_EQ(nvfp4_act_quantize_block(x, s, codes, unscaled), 0x7E);
  EXPECT_EQ(codes[2], 0x7);
  EXPECT_EQ(codes[3], 0xF);
  EXPECT_EQ(unscaled[2], 2688.0f);
  EXPECT_EQ(unscaled[3], -2688.0f);
  // The finite elements are quantised against scale 448.
  const float denom = mul_f32(448.0f, s);
  for (int i : {0, 1, 5, 15}) EXPECT_EQ(codes[i], ref_e2m1_code(div_f32(x[i], denom))) << i;
}

TEST(Nvfp4Activation, EveryBf16ValueInOneElement) {
  // Each finite bf16 value as element 0 of a block whose other elements are
  // fixed: exercises every scale the value can force and every rounding.
  const float s = 0.75f / 2688.0f;
  int bad = 0;
  for (uint32_t h = 0; h < 0x10000 && bad < 8; ++h) {
    const float v = bf16_to_float(static_cast<uint16_t>(h));
    if (!std::isfinite(v)) continue;
    float x[16];
    for (int i = 0; i < 16; ++i) x[i] = 0.01f * static_cast<float>(i - 7);
    x[0] = v;
    bad += check_block(x, s, "bf16 sweep");
  }
}

TEST(Nvfp4Activation, UnscaledValuesAreExactInBf16AndF16) {
  // q * sf for every e2m1 code and finite e4m3 scale: the GPU stores it in
  // the MMA's input type, which must not round it.
  for (int sf = 0; sf < 256; ++sf) {
    if (e4m3_is_nan(static_cast<uint8_t>(sf))) continue;
    for (int q = 0; q < 16; ++q) {
      const float v = nvfp4_act_unscaled_value(static_cast<uint8_t>(q), static_cast<uint8_t>(sf));
      EXPECT_EQ(static_cast<double>(v),
                (q & 8 ? -1 : 1) * ref_e2m1_magnitude(q & 7) * (sf & 0x80 ? -1 : 1) * ref_e4m3_value(sf & 0x7F));
      EXPECT_EQ(bf16_to_float(float_to_bf16(v)), v) << "q " << q << " sf " << sf;
      EXPECT_EQ(f16_to_float(float_to_f16(v)), v) << "q " << q << " sf " << sf;
    }
  }
}

}  // namespace
}  // namespace fp4moe
