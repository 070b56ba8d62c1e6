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
