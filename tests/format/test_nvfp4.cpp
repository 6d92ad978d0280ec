// Tests of the scalar codecs in include/fp4moe/nvfp4.hpp: e2m1, float8 e4m3fn,
// bf16, f16 and the ModelOpt NVFP4 block-scale rule (docs/design.md §3).
//
// Expected values never come from the code under test: decodes are computed
// from each format's definition with std::ldexp, encodes from a brute-force
// search for the nearest representable value (ties to the even code), and f16
// is cross-checked against the compiler's _Float16 where it has one. Every
// code of the 4-, 8- and 16-bit formats is enumerated, and every rounding
// boundary is probed on, just below and just above (std::nextafter).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "fp4moe/nvfp4.hpp"

namespace fp4moe {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNan = std::numeric_limits<float>::quiet_NaN();

uint32_t bits_of(float f) {
  uint32_t b;
  std::memcpy(&b, &f, sizeof b);
  return b;
}
float float_of(uint32_t b) {
  float f;
  std::memcpy(&f, &b, sizeof f);
  return f;
}
// Same value including the sign of zero (NaNs are compared separately).
bool same_float(float a, float b) { return bits_of(a) == bits_of(b); }

// ------------------------------------------------------------ references

// e2m1 magnitudes by code & 7, from the format's definition: exponent field
// e (bias 1), mantissa m; e == 0 is subnormal m * 0.5.
double ref_e2m1_magnitude(int mag) {
  const int e = mag >> 1, m = mag & 1;
  return e == 0 ? m * 0.5 : std::ldexp(1.0 + m * 0.5, e - 1);
}

double ref_e2m1(uint8_t code) {
  const double v = ref_e2m1_magnitude(code & 7);
  return (code & 8) ? -v : v;
}

// Brute force: the nearest e2m1 magnitude, ties to the even code; the sign bit
// is set for x < 0 (ModelOpt's rule, so -0.1 becomes 0x8).
uint8_t ref_float_to_e2m1(double x) {
  const double a = std::fabs(x);
  int best = 0;
  double best_dist = a;
  for (int m = 1; m < 8; ++m) {
    const double d = std::fabs(a - ref_e2m1_magnitude(m));
    if (d < best_dist || (d == best_dist && m % 2 == 0)) {
      best = m;
      best_dist = d;
    }
  }
  return static_cast<uint8_t>((x < 0 ? 8 : 0) | best);
}

// e4m3fn from its definition: bias 7, subnormals man * 2^-9, S.1111.111 NaN.
double ref_e4m3(uint8_t code) {
  const int e = (code >> 3) & 15, m = code & 7;
  double v;
  if (e == 15 && m == 7)
    v = std::numeric_limits<double>::quiet_NaN();
  else if (e == 0)
    v = std::ldexp(m, -9);
  else
    v = std::ldexp(1.0 + m / 8.0, e - 7);
  return (code & 0x80) ? -v : v;
}

// Brute force over the 127 finite non-negative codes, ties to the even code;
// beyond 448 the nearest is 448 itself, i.e. saturation.
uint8_t ref_float_to_e4m3(double x) {
  const double a = std::fabs(x);
  int best = 0;
  double best_dist = a;
  for (int c = 1; c <= 0x7E; ++c) {
    const double d = std::fabs(a - ref_e4m3(static_cast<uint8_t>(c)));
    if (d < best_dist || (d == best_dist && c % 2 == 0)) {
      best = c;
      best_dist = d;
    }
  }
  return static_cast<uint8_t>((std::signbit(x) ? 0x80 : 0) | best);
}

// IEEE binary16 from its definition: bias 15, subnormals man * 2^-24.
double ref_f16(uint16_t h) {
  const int e = (h >> 10) & 31, m = h & 0x3FF;
  double v;
  if (e == 31)
    v = m ? std::numeric_limits<double>::quiet_NaN() : std::numeric_limits<double>::infinity();
  else if (e == 0)
    v = std::ldexp(m, -24);
  else
    v = std::ldexp(1024 + m, e - 25);
  return (h & 0x8000) ? -v : v;
}

// ------------------------------------------------------------------ e2m1

TEST(E2m1, DecodesEveryCode) {
  const float expected[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
  for (int code = 0; code < 16; ++code) {
    const float magnitude = expected[code & 7];
    EXPECT_EQ(ref_e2m1(static_cast<uint8_t>(code)), (code & 8) ? -magnitude : magnitude);
    const float got = e2m1_to_float(static_cast<uint8_t>(code));
    EXPECT_TRUE(same_float(got, (code & 8) ? -magnitude : magnitude))
        << "code 0x" << std::hex << code << " decoded to " << got;
  }
  // Only the low four bits are looked at.
  EXPECT_EQ(e2m1_to_float(0x17), 6.0f);
}

TEST(E2m1, EncodesEveryValueToItsCode) {
  for (int code = 0; code < 16; ++code) {
    if (code == 8) continue;  // -0 encodes as +0 (checked below)
    const float v = e2m1_to_float(static_cast<uint8_t>(code));
    EXPECT_EQ(float_to_e2m1(v), code) << "value " << v;
  }
  // ModelOpt sets the sign bit for x < 0 only: -0.0 is not below zero.
  EXPECT_EQ(float_to_e2m1(-0.0f), 0x0);
}

TEST(E2m1, RoundsToNearestTiesToEvenAtEveryBoundary) {
  struct Boundary {
    float at;
    uint8_t below, tie, above;
  };
  // Midpoints between neighbouring magnitudes; a tie goes to the even code.
  const Boundary boundaries[] = {
      {0.25f, 0, 0, 1}, {0.75f, 1, 2, 2}, {1.25f, 2, 2, 3}, {1.75f, 3, 4, 4},
      {2.5f, 4, 4, 5},  {3.5f, 5, 6, 6},  {5.0f, 6, 6, 7},
  };
  for (const Boundary& b : boundaries) {
    const float lo = std::nextafter(b.at, 0.0f), hi = std::nextafter(b.at, kInf);
    EXPECT_EQ(float_to_e2m1(b.at), b.tie) << b.at;
    EXPECT_EQ(float_to_e2m1(lo), b.below) << "just below " << b.at;
    EXPECT_EQ(float_to_e2m1(hi), b.above) << "just above " << b.at;
    EXPECT_EQ(float_to_e2m1(-b.at), 8 | b.tie) << -b.at;
    EXPECT_EQ(float_to_e2m1(-lo), 8 | b.below) << "just above " << -b.at;
    EXPECT_EQ(float_to_e2m1(-hi), 8 | b.above) << "just below " << -b.at;
    // The reference agrees on all three (it is checked too, not trusted).
    EXPECT_EQ(ref_float_to_e2m1(b.at), b.tie);
    EXPECT_EQ(ref_float_to_e2m1(lo), b.below);
    EXPECT_EQ(ref_float_to_e2m1(hi), b.above);
  }
}

TEST(E2m1, SaturatesToSix) {
  for (float x : {6.0f, std::nextafter(6.0f, kInf), 7.0f, 100.0f, 1e30f, std::numeric_limits<float>::max(), kInf}) {
    EXPECT_EQ(float_to_e2m1(x), 0x7) << x;
    EXPECT_EQ(float_to_e2m1(-x), 0xF) << -x;
  }
}

TEST(E2m1, SmallNegativeBecomesNegativeZeroCode) {
  for (float x : {-0.1f, -0.25f, -1e-30f, -std::numeric_limits<float>::denorm_min()})
    EXPECT_EQ(float_to_e2m1(x), 0x8) << x;
  for (float x : {0.1f, 0.25f, 1e-30f, std::numeric_limits<float>::denorm_min()}) EXPECT_EQ(float_to_e2m1(x), 0x0) << x;
  EXPECT_EQ(float_to_e2m1(kNan), 0x0);
}

TEST(E2m1, MatchesBruteForceOnRandomValues) {
  std::mt19937 rng(1234);
  std::uniform_real_distribution<float> dist(-8.0f, 8.0f);
  for (int i = 0; i < 200000; ++i) {
    const float x = dist(rng);
    ASSERT_EQ(float_to_e2m1(x), ref_float_to_e2m1(x)) << "x = " << x;
  }
  // Every float in [0, 8) on a fine grid, including all the boundaries.
  for (float x = 0.0f; x < 8.0f; x += 1.0f / 1024.0f) {
    ASSERT_EQ(float_to_e2m1(x), ref_float_to_e2m1(x)) << "x = " << x;
    ASSERT_EQ(float_to_e2m1(-x), ref_float_to_e2m1(-x)) << "x = " << -x;
  }
}

// ----------------------------------------------------------------- e4m3fn

TEST(E4m3, DecodesEveryCode) {
  for (int c = 0; c < 256; ++c) {
    const uint8_t code = static_cast<uint8_t>(c);
    const double expected = ref_e4m3(code);
    const float got = e4m3_to_float(code);
    if (std::isnan(expected)) {
      EXPECT_TRUE(std::isnan(got)) << "code 0x" << std::hex << c;
      EXPECT_TRUE(e4m3_is_nan(code));
      EXPECT_EQ(std::signbit(got), (c & 0x80) != 0);
      continue;
    }
    EXPECT_FALSE(e4m3_is_nan(code)) << "code 0x" << std::hex << c;
    EXPECT_TRUE(same_float(got, static_cast<float>(expected)))
        << "code 0x" << std::hex << c << ": got " << got << ", expected " << expected;
  }
  // Landmarks of the format.
  EXPECT_EQ(e4m3_to_float(0x7E), 448.0f);
  EXPECT_EQ(e4m3_to_float(0xFE), -448.0f);
  EXPECT_EQ(e4m3_to_float(0x01), 1.0f / 512.0f);  // smallest subnormal
  EXPECT_EQ(e4m3_to_float(0x07), 7.0f / 512.0f);  // largest subnormal
  EXPECT_EQ(e4m3_to_float(0x08), 1.0f / 64.0f);   // smallest normal
  EXPECT_EQ(e4m3_to_float(0x38), 1.0f);
  EXPECT_TRUE(same_float(e4m3_to_float(0x80), -0.0f));
  EXPECT_EQ(kE4m3Max, 448.0f);
  EXPECT_EQ(kMinBlockScale, e4m3_to_float(0x01));
}

TEST(E4m3, EveryCodeReencodesToItself) {
  for (int c = 0; c < 256; ++c) {
    const uint8_t code = static_cast<uint8_t>(c);
    const uint8_t again = float_to_e4m3(e4m3_to_float(code));
    if (e4m3_is_nan(code)) {
      EXPECT_TRUE(e4m3_is_nan(again)) << "code 0x" << std::hex << c;
    } else {
      EXPECT_EQ(again, code) << "code 0x" << std::hex << c;  // -0 stays 0x80
    }
  }
}

// Midpoints between consecutive codes (both signs) go to the even code, which
// is the even mantissa, also across the subnormal/normal border (0x07/0x08)
// and across every exponent step; just off a midpoint goes to the nearer code.
TEST(E4m3, RoundsToNearestTiesToEvenBetweenEveryPairOfCodes) {
  for (int c = 0; c < 0x7E; ++c) {
    const double lo = ref_e4m3(static_cast<uint8_t>(c)), hi = ref_e4m3(static_cast<uint8_t>(c + 1));
    const float mid = static_cast<float>((lo + hi) / 2);  // exact: 4 significant bits + 1
    ASSERT_EQ(static_cast<double>(mid), (lo + hi) / 2);
    const uint8_t even = static_cast<uint8_t>(c % 2 == 0 ? c : c + 1);
    const float below = std::nextafter(mid, 0.0f), above = std::nextafter(mid, kInf);
    EXPECT_EQ(float_to_e4m3(mid), even) << "midpoint " << mid;
    EXPECT_EQ(float_to_e4m3(below), c) << "just below " << mid;
    EXPECT_EQ(float_to_e4m3(above), c + 1) << "just above " << mid;
    EXPECT_EQ(float_to_e4m3(-mid), 0x80 | even) << "midpoint " << -mid;
    EXPECT_EQ(float_to_e4m3(-below), 0x80 | c) << "just above " << -mid;
    EXPECT_EQ(float_to_e4m3(-above), 0x80 | (c + 1)) << "just below " << -mid;
  }
  // Spot checks written out by hand.
  EXPECT_EQ(float_to_e4m3(1.0f / 1024.0f), 0x00);                        // 2^-10: tie 0 / 2^-9
  EXPECT_EQ(float_to_e4m3(std::nextafter(1.0f / 1024.0f, 1.0f)), 0x01);  // just above it
  EXPECT_EQ(float_to_e4m3(7.5f / 512.0f), 0x08);                         // tie across the subnormal/normal border
  EXPECT_EQ(float_to_e4m3(1.0625f), 0x38);                               // tie 1 / 1.125 -> 1 (even)
  EXPECT_EQ(float_to_e4m3(1.1875f), 0x3A);                               // tie 1.125 / 1.25 -> 1.25 (even)
  EXPECT_EQ(float_to_e4m3(15.5f), 0x58);                                 // tie 15 / 16 -> 16 (exponent step)
  EXPECT_EQ(float_to_e4m3(1e-30f), 0x00);
  EXPECT_EQ(float_to_e4m3(-1e-30f), 0x80);
}

TEST(E4m3, SaturatesAbove448AndKeepsNan) {
  for (float x : {448.0f, std::nextafter(448.0f, kInf), 460.0f, std::nextafter(464.0f, 0.0f), 464.0f, 479.0f, 480.0f,
                  1e6f, std::numeric_limits<float>::max(), kInf}) {
    EXPECT_EQ(float_to_e4m3(x), 0x7E) << x;
    EXPECT_EQ(float_to_e4m3(-x), 0xFE) << -x;
  }
  EXPECT_TRUE(e4m3_is_nan(float_to_e4m3(kNan)));
  EXPECT_TRUE(e4m3_is_nan(float_to_e4m3(-kNan)));
  EXPECT_TRUE(e4m3_is_nan(float_to_e4m3(float_of(0x7F800001u))));  // signalling NaN
}

TEST(E4m3, MatchesBruteForceOnRandomValues) {
  std::mt19937 rng(99);
  std::uniform_real_distribution<float> log2_mag(-14.0f, 10.0f);
  std::bernoulli_distribution negative(0.5);
  for (int i = 0; i < 100000; ++i) {
    float x = std::exp2(log2_mag(rng));
    if (negative(rng)) x = -x;
    ASSERT_EQ(float_to_e4m3(x), ref_float_to_e4m3(x)) << "x = " << x;
  }
}

// ------------------------------------------------------------------- bf16

TEST(Bf16, DecodesEveryCode) {
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const float got = bf16_to_float(static_cast<uint16_t>(h));
    // bf16 is the upper half of a float: sign, 8-bit exponent, 7-bit mantissa.
    const int e = (h >> 7) & 0xFF, m = h & 0x7F;
    double expected;
    if (e == 0xFF)
      expected = m ? std::numeric_limits<double>::quiet_NaN() : std::numeric_limits<double>::infinity();
    else if (e == 0)
      expected = std::ldexp(m, -133);
    else
      expected = std::ldexp(128 + m, e - 134);
    if (h & 0x8000) expected = -expected;
    if (std::isnan(expected)) {
      ASSERT_TRUE(std::isnan(got)) << std::hex << h;
    } else {
      ASSERT_TRUE(same_float(got, static_cast<float>(expected))) << std::hex << h;
    }
  }
  EXPECT_EQ(bf16_to_float(0x3F80), 1.0f);
  EXPECT_EQ(bf16_to_float(0xC000), -2.0f);
}

TEST(Bf16, EveryCodeReencodesToItself) {
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const uint16_t again = float_to_bf16(bf16_to_float(static_cast<uint16_t>(h)));
    const bool nan = (h & 0x7F80) == 0x7F80 && (h & 0x7F);
    if (nan) {
      ASSERT_TRUE(std::isnan(bf16_to_float(again))) << std::hex << h;
    } else {
      ASSERT_EQ(again, h) << std::hex << h;
    }
  }
}

TEST(Bf16, RoundsToNearestTiesToEven) {
  // Every pair of consecutive finite codes of either sign, including the last
  // finite one and infinity (the midpoint past the largest bf16 is a tie that
  // goes to the even code, infinity).
  for (uint32_t h = 0; h <= 0x7F7F; ++h) {
    for (uint32_t sign : {0u, 0x8000u}) {
      const uint32_t base = (sign | h) << 16;
      const uint16_t even = static_cast<uint16_t>(sign | ((h & 1) ? h + 1 : h));
      ASSERT_EQ(float_to_bf16(float_of(base | 0x8000u)), even) << std::hex << h;
      ASSERT_EQ(float_to_bf16(float_of(base | 0x7FFFu)), sign | h) << std::hex << h;
      ASSERT_EQ(float_to_bf16(float_of(base | 0x8001u)), sign | (h + 1)) << std::hex << h;
    }
  }
  EXPECT_EQ(float_to_bf16(std::numeric_limits<float>::max()), 0x7F80);  // overflows to inf
  EXPECT_EQ(float_to_bf16(kInf), 0x7F80);
  EXPECT_EQ(float_to_bf16(-kInf), 0xFF80);
  EXPECT_EQ(float_to_bf16(1.0f / 3.0f), 0x3EAB);  // 0x3EAAAAAB rounds up
}

TEST(Bf16, NanStaysNan) {
  // A NaN whose payload sits only in the low 16 bits must not round to inf.
  for (uint32_t bits : {0x7F800001u, 0x7FC00000u, 0xFF800001u, 0x7FFFFFFFu, 0x7F80FFFFu}) {
    const uint16_t h = float_to_bf16(float_of(bits));
    EXPECT_TRUE(std::isnan(bf16_to_float(h))) << std::hex << bits;
    EXPECT_EQ(h >> 15, bits >> 31) << "sign of " << std::hex << bits;
  }
}

// -------------------------------------------------------------------- f16

TEST(F16, DecodesEveryCode) {
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const double expected = ref_f16(static_cast<uint16_t>(h));
    const float got = f16_to_float(static_cast<uint16_t>(h));
    if (std::isnan(expected)) {
      ASSERT_TRUE(std::isnan(got)) << std::hex << h;
    } else {
      ASSERT_TRUE(same_float(got, static_cast<float>(expected)))
          << std::hex << h << ": got " << got << ", expected " << expected;
    }
  }
  EXPECT_EQ(f16_to_float(0x0001), std::ldexp(1.0f, -24));  // smallest subnormal
  EXPECT_EQ(f16_to_float(0x0400), std::ldexp(1.0f, -14));  // smallest normal
  EXPECT_EQ(f16_to_float(0x7BFF), 65504.0f);
  EXPECT_EQ(f16_to_float(0x7C00), kInf);
  EXPECT_EQ(f16_to_float(0xFC00), -kInf);
}

TEST(F16, EveryCodeReencodesToItself) {
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const uint16_t again = float_to_f16(f16_to_float(static_cast<uint16_t>(h)));
    if (std::isnan(ref_f16(static_cast<uint16_t>(h)))) {
      ASSERT_TRUE(std::isnan(f16_to_float(again))) << std::hex << h;
    } else {
      ASSERT_EQ(again, h) << std::hex << h;
    }
  }
}

TEST(F16, RoundsToNearestTiesToEven) {
  // Every pair of consecutive finite codes (subnormals included), and the last
  // finite code with 65536, the value infinity stands for when rounding.
  for (uint32_t h = 0; h <= 0x7BFF; ++h) {
    const double lo = ref_f16(static_cast<uint16_t>(h));
    const double hi = h == 0x7BFF ? 65536.0 : ref_f16(static_cast<uint16_t>(h + 1));
    const float mid = static_cast<float>((lo + hi) / 2);
    ASSERT_EQ(static_cast<double>(mid), (lo + hi) / 2);  // 12 significant bits: exact
    const uint16_t even = static_cast<uint16_t>((h & 1) ? h + 1 : h);
    for (uint16_t sign : {uint16_t{0}, uint16_t{0x8000}}) {
      const float s = sign ? -1.0f : 1.0f;
      ASSERT_EQ(float_to_f16(s * mid), sign | even) << "midpoint " << s * mid;
      ASSERT_EQ(float_to_f16(s * std::nextafter(mid, 0.0f)), sign | h) << "below " << s * mid;
      ASSERT_EQ(float_to_f16(s * std::nextafter(mid, kInf)), sign | (h + 1)) << "above " << s * mid;
    }
  }
}

TEST(F16, SubnormalsOverflowInfAndNan) {
  EXPECT_EQ(float_to_f16(std::ldexp(1.0f, -24)), 0x0001);
  EXPECT_EQ(float_to_f16(std::ldexp(1.0f, -25)), 0x0000);  // tie -> even (zero)
  EXPECT_EQ(float_to_f16(std::ldexp(1.5f, -25)), 0x0001);
  EXPECT_EQ(float_to_f16(std::ldexp(3.0f, -25)), 0x0002);     // tie 1 / 2 -> 2
  EXPECT_EQ(float_to_f16(std::ldexp(1023.5f, -24)), 0x0400);  // into the smallest normal
  EXPECT_EQ(float_to_f16(1e-30f), 0x0000);
  EXPECT_EQ(float_to_f16(-1e-30f), 0x8000);
  EXPECT_EQ(float_to_f16(65504.0f), 0x7BFF);
  EXPECT_EQ(float_to_f16(65519.0f), 0x7BFF);
  EXPECT_EQ(float_to_f16(65520.0f), 0x7C00);  // tie: 65504 has an odd mantissa
  EXPECT_EQ(float_to_f16(1e10f), 0x7C00);
  EXPECT_EQ(float_to_f16(-1e10f), 0xFC00);
  EXPECT_EQ(float_to_f16(std::numeric_limits<float>::max()), 0x7C00);
  EXPECT_EQ(float_to_f16(kInf), 0x7C00);
  EXPECT_EQ(float_to_f16(-kInf), 0xFC00);
  for (uint32_t bits : {0x7FC00000u, 0x7F800001u, 0xFFC00000u, 0x7F801000u}) {
    const uint16_t h = float_to_f16(float_of(bits));
    EXPECT_TRUE(std::isnan(f16_to_float(h))) << std::hex << bits;
    EXPECT_EQ(h >> 15, bits >> 31) << "sign of " << std::hex << bits;
  }
}

#if defined(__FLT16_MANT_DIG__)
// The compiler's own binary16 conversion (software or F16C) is correctly
// rounded; ours must agree bit for bit on every float we can afford to try.
TEST(F16, MatchesCompilerFloat16) {
  auto check = [](uint32_t bits) {
    const float f = float_of(bits);
    const _Float16 h = static_cast<_Float16>(f);
    uint16_t expected;
    std::memcpy(&expected, &h, sizeof expected);
    const uint16_t got = float_to_f16(f);
    if (std::isnan(f)) return std::isnan(f16_to_float(got)) && (got >> 15) == (bits >> 31);
    return got == expected;
  };
  // A stride through all 2^32 bit patterns (both signs, every exponent).
  for (uint64_t bits = 0; bits < (1ull << 32); bits += 509)
    ASSERT_TRUE(check(static_cast<uint32_t>(bits))) << std::hex << bits;
  // Every float in [2^-25, 2^-24], where values round to zero or to the
  // smallest subnormal, and every float in [65000, 66000], around overflow.
  for (uint32_t bits = bits_of(std::ldexp(1.0f, -25)); bits <= bits_of(std::ldexp(1.0f, -24)); ++bits)
    ASSERT_TRUE(check(bits)) << std::hex << bits;
  for (uint32_t bits = bits_of(65000.0f); bits <= bits_of(66000.0f); ++bits)
    ASSERT_TRUE(check(bits)) << std::hex << bits;
  // And the other way: every f16 code.
  for (uint32_t h = 0; h < 0x10000; ++h) {
    _Float16 v;
    const uint16_t h16 = static_cast<uint16_t>(h);
    std::memcpy(&v, &h16, sizeof v);
    const float expected = static_cast<float>(v);
    const float got = f16_to_float(h16);
    if (std::isnan(expected)) {
      ASSERT_TRUE(std::isnan(got)) << std::hex << h;
    } else {
      ASSERT_TRUE(same_float(got, expected)) << std::hex << h;
    }
  }
}
#endif

// ------------------------------------------------------------ NVFP4 rule

TEST(Nvfp4Rule, GlobalScaleIsAmaxOver2688InFloat) {
  EXPECT_EQ(nvfp4_global_scale(2688.0f), 1.0f);
  EXPECT_EQ(nvfp4_global_scale(1344.0f), 0.5f);
  EXPECT_EQ(nvfp4_global_scale(0.0f), 0.0f);
  // A division, not a multiplication by a rounded 1/2688: find amaxes where
  // the two differ and check we give the division.
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> dist(0.01f, 100.0f);
  const float inv = 1.0f / 2688.0f;
  int differing = 0;
  for (int i = 0; i < 10000; ++i) {
    const float amax = dist(rng);
    const volatile float divided = amax / 2688.0f;  // fp32 division, as torch does
    EXPECT_EQ(nvfp4_global_scale(amax), divided) << amax;
    if (amax * inv != divided) ++differing;
  }
  EXPECT_GT(differing, 0);  // the check above can tell the two apart
}

TEST(Nvfp4Rule, BlockScaleOfZeroBlockIsOne) {
  EXPECT_EQ(nvfp4_block_scale(0.0f, 0.01f), 0x38);
  EXPECT_EQ(e4m3_to_float(0x38), 1.0f);
  // An all-zero tensor: global scale 0 and block amax 0 (0/0).
  EXPECT_EQ(nvfp4_block_scale(0.0f, 0.0f), 0x38);
}

TEST(Nvfp4Rule, BlockScaleClampsAtSmallestSubnormal) {
  // b = block_amax / 6 with global scale 1.
  EXPECT_EQ(nvfp4_block_scale(1e-30f, 1.0f), 0x01);                        // far below 2^-9
  EXPECT_EQ(nvfp4_block_scale(6.0f * std::ldexp(1.0f, -10), 1.0f), 0x01);  // 2^-10 would round to 0
  EXPECT_EQ(nvfp4_block_scale(6.0f * std::ldexp(1.0f, -9), 1.0f), 0x01);
  EXPECT_EQ(nvfp4_block_scale(6.0f * std::ldexp(1.5f, -9), 1.0f), 0x02);  // tie 1 / 2 -> 2
  EXPECT_EQ(nvfp4_block_scale(6.0f * std::ldexp(2.5f, -9), 1.0f), 0x02);  // tie 2 / 3 -> 2
}

TEST(Nvfp4Rule, BlockScaleRoundsToNearestEvenAndSaturates) {
  EXPECT_EQ(nvfp4_block_scale(6.0f * 1.0625f, 1.0f), 0x38);  // tie 1 / 1.125
  EXPECT_EQ(nvfp4_block_scale(6.0f * 1.1875f, 1.0f), 0x3A);  // tie 1.125 / 1.25
  EXPECT_EQ(nvfp4_block_scale(6.0f * std::nextafter(1.0625f, 2.0f), 1.0f), 0x39);
  // The tensor's amax block: 448 exactly.
  const float amax = 3.7f;
  EXPECT_EQ(nvfp4_block_scale(amax, nvfp4_global_scale(amax)), 0x7E);
  // Beyond (a global scale given from a smaller tensor): saturates at 448.
  EXPECT_EQ(nvfp4_block_scale(10.0f, nvfp4_global_scale(1.0f)), 0x7E);
}

// docs/design.md §3 fixes the order b = block_amax / (6 * s2). Look for inputs where
// the other plausible orders, (block_amax / 6) / s2 and block_amax / s2 / 6,
// land on a different e4m3 code, and check we give the specified one.
TEST(Nvfp4Rule, BlockScaleUsesModelOptOrderOfOperations) {
  std::mt19937 rng(2024);
  std::uniform_real_distribution<float> amax_dist(0.05f, 20.0f);
  std::uniform_int_distribution<int> code_dist(1, 0x7D);
  int found = 0;
  for (int i = 0; i < 200000 && found < 20; ++i) {
    const float s2 = nvfp4_global_scale(amax_dist(rng));
    // Aim at the midpoint between two e4m3 codes, where order can matter.
    const int c = code_dist(rng);
    const float mid =
        static_cast<float>((ref_e4m3(static_cast<uint8_t>(c)) + ref_e4m3(static_cast<uint8_t>(c + 1))) / 2);
    float block_amax = mid * 6.0f * s2;
    std::uniform_int_distribution<int> ulps(-2, 2);
    for (int k = ulps(rng); k != 0; k += k > 0 ? -1 : 1) block_amax = std::nextafter(block_amax, k > 0 ? kInf : 0.0f);
    const volatile float six_s2 = 6.0f * s2;
    const float spec = block_amax / six_s2;
    const volatile float by6 = block_amax / 6.0f;
    const float alt1 = by6 / s2;
    const volatile float bys2 = block_amax / s2;
    const float alt2 = bys2 / 6.0f;
    const uint8_t expected = float_to_e4m3(spec < kMinBlockScale ? kMinBlockScale : spec);
    if (float_to_e4m3(alt1) == expected && float_to_e4m3(alt2) == expected) continue;
    ++found;
    EXPECT_EQ(nvfp4_block_scale(block_amax, s2), expected) << "block_amax " << block_amax << " s2 " << s2;
  }
  EXPECT_GT(found, 0) << "no input distinguishes the orders; widen the search";
}

TEST(Nvfp4Rule, QuantizeValue) {
  // Every e2m1 value times every finite block scale times a global scale
  // comes back to its code; the product is exact in float.
  const float s2 = 0.25f;
  for (int ws = 0x01; ws <= 0x7E; ++ws) {
    for (int code = 0; code < 16; ++code) {
      if (code == 8) continue;
      const uint8_t bs = static_cast<uint8_t>(ws);
      const float x = nvfp4_dequantize_value(static_cast<uint8_t>(code), bs, s2);
      EXPECT_EQ(x, e2m1_to_float(static_cast<uint8_t>(code)) * e4m3_to_float(bs) * s2);
      EXPECT_EQ(nvfp4_quantize_value(x, bs, s2), code) << "ws 0x" << std::hex << ws;
    }
  }
  // x / (ws * s2) rounds like e2m1: 0.75 * (2 * 0.25) is a tie -> 1.0 (code 2).
  EXPECT_EQ(nvfp4_quantize_value(0.375f, 0x40, 0.25f), 0x2);
  EXPECT_EQ(nvfp4_quantize_value(-0.375f, 0x40, 0.25f), 0xA);
  EXPECT_EQ(nvfp4_quantize_value(100.0f, 0x40, 0.25f), 0x7);  // saturates
  // All-zero tensor: global scale 0.
  EXPECT_EQ(nvfp4_quantize_value(0.0f, 0x38, 0.0f), 0x0);
  EXPECT_EQ(nvfp4_dequantize_value(0x7, 0x7E, 1.0f), 2688.0f);
  EXPECT_EQ(nvfp4_dequantize_value(0xF, 0x7E, 1.0f), -2688.0f);
}

// ModelOpt computes x / (float(ws) * s2); x / ws / s2 differs on rare ties.
TEST(Nvfp4Rule, QuantizeValueDividesByTheProductOfScales) {
  std::mt19937 rng(31);
  std::uniform_real_distribution<float> s2_dist(1e-4f, 1e-1f);
  std::uniform_int_distribution<int> ws_dist(0x01, 0x7E);
  const float boundaries[] = {0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.0f};
  int found = 0;
  for (int i = 0; i < 200000 && found < 20; ++i) {
    const float s2 = s2_dist(rng);
    const uint8_t ws = static_cast<uint8_t>(ws_dist(rng));
    const volatile float denom = e4m3_to_float(ws) * s2;
    const float x = boundaries[i % 7] * denom;
    const float spec = x / denom;
    const volatile float by_ws = x / e4m3_to_float(ws);
    const float alt = by_ws / s2;
    if (float_to_e2m1(spec) == float_to_e2m1(alt)) continue;
    ++found;
    EXPECT_EQ(nvfp4_quantize_value(x, ws, s2), float_to_e2m1(spec)) << "x " << x;
  }
  EXPECT_GT(found, 0);
}

// Dequantised values are e2m1 * e4m3 and exact in bf16 (docs/design.md §3), which is
// what lets the kernels dequantise to bf16 before the fp32 global scale.
TEST(Nvfp4Rule, Fp4TimesBlockScaleIsExactInBf16) {
  for (int code = 0; code < 16; ++code) {
    for (int ws = 0; ws < 256; ++ws) {
      if (e4m3_is_nan(static_cast<uint8_t>(ws))) continue;
      const float v = e2m1_to_float(static_cast<uint8_t>(code)) * e4m3_to_float(static_cast<uint8_t>(ws));
      EXPECT_EQ(bf16_to_float(float_to_bf16(v)), v) << code << " x 0x" << std::hex << ws;
    }
  }
}

}  // namespace
}  // namespace fp4moe
