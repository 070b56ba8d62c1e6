// SPDX-License-Identifier: Apache-2.0
// bf16 / fp16 conversions: round-to-nearest-even on edge cases, specials, subnormals.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include <catch2/catch.hpp>

#include "kvmem/core/numeric.hpp"

namespace {
float from_bits(std::uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}
}  // namespace

TEST_CASE("bf16 rounds to nearest, ties to even", "[numeric]") {
  using kvmem::bf16;
  CHECK(bf16::from_float(1.0f) == 0x3f80);
  // 1 + 2^-8 is exactly half an ulp above 1.0 (even mantissa): ties down to 1.0
  CHECK(bf16::from_float(from_bits(0x3f808000u)) == 0x3f80);
  // 1 + 3*2^-8: half an ulp above an odd mantissa: ties up to even
  CHECK(bf16::from_float(from_bits(0x3f818000u)) == 0x3f82);
  // just above the tie rounds up
  CHECK(bf16::from_float(from_bits(0x3f808001u)) == 0x3f81);
  CHECK(bf16::from_float(from_bits(0x3f807fffu)) == 0x3f80);
  CHECK(bf16::from_float(-2.5f) == 0xc020);
  // the largest finite float rounds to infinity; infinities and zeros are kept
  CHECK(bf16::from_float(std::numeric_limits<float>::max()) == 0x7f80);
  CHECK(bf16::from_float(std::numeric_limits<float>::infinity()) == 0x7f80);
  CHECK(bf16::from_float(-std::numeric_limits<float>::infinity()) == 0xff80);
  CHECK(bf16::from_float(-0.0f) == 0x8000);
  // NaN stays NaN even when the payload sits only in the dropped bits
  const std::uint16_t nan = bf16::from_float(from_bits(0x7f800001u));
  CHECK(std::isnan(bf16::to_float(nan)));
  // round trip of every representable bf16 value that is finite
  for (std::uint32_t raw = 0; raw < 0x10000u; raw += 7) {
    const float f = bf16::to_float(static_cast<std::uint16_t>(raw));
    if (std::isfinite(f)) CHECK(bf16::from_float(f) == raw);
  }
}

TEST_CASE("fp16 rounds to nearest, ties to even, with subnormals and overflow", "[numeric]") {
  using kvmem::fp16;
  CHECK(fp16::from_float(1.0f) == 0x3c00);
  CHECK(fp16::from_float(-2.0f) == 0xc000);
  CHECK(fp16::from_float(65504.0f) == 0x7bff);  // largest finite
  CHECK(fp16::from_float(65519.0f) == 0x7bff);  // below the tie: stays finite
  CHECK(fp16::from_float(65520.0f) == 0x7c00);  // the tie rounds to even = infinity
  CHECK(fp16::from_float(1e10f) == 0x7c00);
  CHECK(fp16::from_float(-1e10f) == 0xfc00);
  // 1 + 2^-11 is a tie between 1 and 1 + 2^-10: to even (1.0); 1 + 3*2^-11 ties up
  CHECK(fp16::from_float(1.0f + std::ldexp(1.0f, -11)) == 0x3c00);
  CHECK(fp16::from_float(1.0f + 3 * std::ldexp(1.0f, -11)) == 0x3c02);
  // smallest subnormal 2^-24, half of it ties to zero, a bit more rounds up
  CHECK(fp16::from_float(std::ldexp(1.0f, -24)) == 0x0001);
  CHECK(fp16::from_float(std::ldexp(1.0f, -25)) == 0x0000);
  CHECK(fp16::from_float(std::ldexp(1.5f, -25)) == 0x0001);
  CHECK(fp16::from_float(std::ldexp(3.0f, -25)) == 0x0002);     // 1.5 * 2^-24: tie -> even (2)
  CHECK(fp16::from_float(std::ldexp(1023.5f, -24)) == 0x0400);  // rounds up into the smallest normal
  CHECK(fp16::from_float(std::ldexp(1.0f, -14)) == 0x0400);
  CHECK(std::isnan(fp16::to_float(fp16::from_float(std::nanf("")))));
  CHECK(fp16::to_float(0x0001) == std::ldexp(1.0f, -24));
  CHECK(fp16::to_float(0x7c00) == std::numeric_limits<float>::infinity());
  // every finite fp16 value round-trips
  for (std::uint32_t raw = 0; raw < 0x10000u; ++raw) {
    const float f = fp16::to_float(static_cast<std::uint16_t>(raw));
    if (std::isfinite(f)) REQUIRE(fp16::from_float(f) == raw);
  }
}

TEST_CASE("fp16 rounding matches a double-precision reference on random floats", "[numeric]") {
  using kvmem::fp16;
  std::uint32_t state = 12345u;
  for (int i = 0; i < 200000; ++i) {
    state = state * 1664525u + 1013904223u;
    const float f = std::ldexp(static_cast<float>(state >> 8) / 16777216.0f + 0.5f, static_cast<int>(state % 40) - 28);
    const float back = fp16::to_float(fp16::from_float(f));
    // the result is one of the two neighbours and at most half an ulp away
    const int e = std::max(std::ilogb(f), -14);
    const double half_ulp = std::ldexp(1.0, e - 11);
    if (std::abs(f) < 65504.0f) REQUIRE(std::abs(static_cast<double>(back) - f) <= half_ulp);
  }
}

namespace {
// The value of a non-negative e4m3 code from the format's definition (OCP FP8 E4M3: bias 7, subnormals
// m * 2^-9), independent of e4m3::to_float.
double e4m3_value(int code) {
  const int e = (code >> 3) & 0xf, m = code & 7;
  return e == 0 ? m * std::ldexp(1.0, -9) : (1.0 + m / 8.0) * std::ldexp(1.0, e - 7);
}
// Round to the nearest finite e4m3 value by search, ties to the even code; saturating at 448.
int e4m3_nearest(double x) {
  const double a = std::abs(x);
  int best = 0;
  for (int code = 1; code <= 0x7e; ++code) {
    const double d = std::abs(e4m3_value(code) - a), db = std::abs(e4m3_value(best) - a);
    if (d < db || (d == db && (code & 1) == 0)) best = code;
  }
  return (x < 0 ? 0x80 : 0) | best;
}
}  // namespace

TEST_CASE("e4m3 rounds to nearest, ties to even, saturates at 448 and keeps subnormals", "[numeric]") {
  using kvmem::e4m3;
  CHECK(e4m3::from_float(1.0f) == 0x38);
  CHECK(e4m3::from_float(-2.0f) == 0xc0);
  CHECK(e4m3::from_float(448.0f) == 0x7e);  // largest finite
  CHECK(e4m3::from_float(460.0f) == 0x7e);  // no code above 448: saturates (CUDA's satfinite)
  CHECK(e4m3::from_float(std::numeric_limits<float>::infinity()) == 0x7e);
  CHECK(e4m3::from_float(-1e10f) == 0xfe);
  CHECK(std::isnan(e4m3::to_float(e4m3::from_float(std::numeric_limits<float>::quiet_NaN()))));
  CHECK(std::isnan(e4m3::to_float(0x7f)));
  // 1 + 2^-4 ties between 1 and 1.125: to even (1.0); 1 + 3 * 2^-4 ties up to 1.25
  CHECK(e4m3::from_float(1.0625f) == 0x38);
  CHECK(e4m3::from_float(1.1875f) == 0x3a);
  // smallest subnormal 2^-9, half of it ties to zero, a bit more rounds up; 7.5 * 2^-9 ties to 2^-6
  CHECK(e4m3::from_float(std::ldexp(1.0f, -9)) == 0x01);
  CHECK(e4m3::from_float(std::ldexp(1.0f, -10)) == 0x00);
  CHECK(e4m3::from_float(std::ldexp(1.0f, -10) * 1.01f) == 0x01);
  CHECK(e4m3::from_float(7.5f * std::ldexp(1.0f, -9)) == 0x08);
  CHECK(e4m3::from_float(-0.0f) == 0x80);
  // every finite code: its value, and back to the same code
  for (int code = 0; code < 256; ++code) {
    if ((code & 0x7f) == 0x7f) continue;
    const float f = e4m3::to_float(static_cast<std::uint8_t>(code));
    CHECK(double(f) == ((code & 0x80) ? -e4m3_value(code & 0x7f) : e4m3_value(code & 0x7f)));
    if (f != 0.0f) CHECK(e4m3::from_float(f) == code);
  }
  // random floats over the whole range against the search, and every midpoint between neighbours
  std::uint64_t state = 12345;
  for (int i = 0; i < 20000; ++i) {
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    const float x = static_cast<float>(std::ldexp(double(state >> 11) / double(1ull << 53), int(state % 24) - 14)) *
                    ((state >> 7) & 1 ? -1.0f : 1.0f);
    INFO("x " << x);
    CHECK(e4m3::from_float(x) == e4m3_nearest(x));
  }
  for (int code = 0; code < 0x7e; ++code) {
    const double mid = 0.5 * (e4m3_value(code) + e4m3_value(code + 1));
    INFO("midpoint after code " << code);
    CHECK(e4m3::from_float(float(mid)) == e4m3_nearest(mid));
  }
}

TEST_CASE("fp8 rows: a power-of-two scale, exact read-back, and storing the read-back is a fixed point", "[numeric]") {
  for (const float amax : {1.0f, 448.0f, 449.0f, 224.0f, 0.3f, 1e-30f, 3e20f, 1.75f, 1.76f}) {
    const float s = kvmem::fp8_row_scale(amax);
    int e = 0;
    CHECK(std::frexp(s, &e) == 0.5f);  // a power of two
    CHECK(amax / s <= 448.0f);
    if (amax > 1e-30f) CHECK(amax / s > 224.0f);  // the smallest such power of two
    CHECK(s * kvmem::fp8_inverse_scale(s) == 1.0f);
  }
  CHECK(kvmem::fp8_row_scale(0.0f) == 1.0f);
  std::uint64_t state = 99;
  for (int row = 0; row < 200; ++row) {
    float x[64], back[64], again[64];
    const double magnitude = std::ldexp(1.0, row % 40 - 20);
    for (float& v : x) {
      state = state * 6364136223846793005ull + 1442695040888963407ull;
      v = float(magnitude * (double(state >> 11) / double(1ull << 53) - 0.5));
    }
    kvmem::e4m3 q[64], q2[64];
    const float s = kvmem::quantize_row(x, q, 64);
    for (int i = 0; i < 64; ++i) {
      back[i] = float(q[i]) * s;
      // within half an e4m3 unit of the row's scale: 2^-4 relative for normals, s * 2^-10 absolute below
      CHECK(std::abs(back[i] - x[i]) <= std::max(std::abs(x[i]) * 0.0625f, s * 0.0009765625f));
    }
    const float s2 = kvmem::quantize_row(back, q2, 64);
    for (int i = 0; i < 64; ++i) again[i] = float(q2[i]) * s2;
    for (int i = 0; i < 64; ++i) CHECK(again[i] == back[i]);
  }
}
