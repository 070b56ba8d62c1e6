// SPDX-License-Identifier: Apache-2.0
#pragma once
// Storage types for reduced precision: bf16, IEEE fp16 and fp8 e4m3. bf16 and fp16 convert from float
// with round-to-nearest-even (ties to even), keep NaN a NaN (quiet), saturate to +-inf on overflow and
// keep subnormals (fp16). e4m3 (OCP FP8 E4M3: no infinities, one NaN code per sign) rounds to nearest
// even, saturates to +-448 and keeps subnormals; it stores rows with one power-of-two scale per row
// (fp8_row_scale, quantize_row below), so a row of any magnitude keeps e4m3's 3-bit relative precision.
// They are plain 16- and 8-bit structs so host, CUDA and HIP code share one layout; arithmetic is always
// done after conversion to float (DESIGN.md section 5).

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "kvmem/core/config.hpp"

namespace kvmem {

// log2(e): kernels that take base-2 exponentials (ex2) of natural-log quantities fold it into their
// factors. The float form is the correctly rounded float of the same number.
inline constexpr double kLog2e = 1.4426950408889634;
inline constexpr float kLog2eFloat = float(kLog2e);

namespace detail {
KVMEM_HOST_DEVICE inline std::uint32_t float_bits(float value) {
  std::uint32_t bits;
  std::memcpy(&bits, &value, sizeof bits);
  return bits;
}
KVMEM_HOST_DEVICE inline float bits_float(std::uint32_t bits) {
  float value;
  std::memcpy(&value, &bits, sizeof value);
  return value;
}
}  // namespace detail

struct bf16 {
  std::uint16_t bits = 0;

  bf16() = default;
  KVMEM_HOST_DEVICE explicit bf16(float value) : bits(from_float(value)) {}
  KVMEM_HOST_DEVICE explicit operator float() const { return to_float(bits); }

  static KVMEM_HOST_DEVICE bf16 from_bits(std::uint16_t raw) {
    bf16 out;
    out.bits = raw;
    return out;
  }

  // Round to nearest, ties to even, on the 16 dropped mantissa bits.
  static KVMEM_HOST_DEVICE std::uint16_t from_float(float value) {
    const std::uint32_t bits = detail::float_bits(value);
    if ((bits & 0x7fffffffu) > 0x7f800000u)  // NaN: keep sign, force a quiet payload bit
      return static_cast<std::uint16_t>((bits >> 16) | 0x0040u);
    const std::uint32_t lsb = (bits >> 16) & 1u;
    const std::uint32_t rounded = bits + 0x7fffu + lsb;  // overflow into the exponent gives inf
    return static_cast<std::uint16_t>(rounded >> 16);
  }
  static KVMEM_HOST_DEVICE float to_float(std::uint16_t raw) {
    return detail::bits_float(static_cast<std::uint32_t>(raw) << 16);
  }
};

struct fp16 {
  std::uint16_t bits = 0;

  fp16() = default;
  KVMEM_HOST_DEVICE explicit fp16(float value) : bits(from_float(value)) {}
  KVMEM_HOST_DEVICE explicit operator float() const { return to_float(bits); }

  static KVMEM_HOST_DEVICE fp16 from_bits(std::uint16_t raw) {
    fp16 out;
    out.bits = raw;
    return out;
  }

  static KVMEM_HOST_DEVICE std::uint16_t from_float(float value) {
    const std::uint32_t bits = detail::float_bits(value);
    const std::uint32_t sign = (bits >> 16) & 0x8000u;
    const std::uint32_t abs = bits & 0x7fffffffu;
    if (abs > 0x7f800000u) return static_cast<std::uint16_t>(sign | 0x7e00u);   // NaN
    if (abs >= 0x477ff000u) return static_cast<std::uint16_t>(sign | 0x7c00u);  // rounds to >= 65536: inf
    if (abs < 0x38800000u) {
      // Result is subnormal (or zero) in fp16: value = m * 2^-24 with m < 1024.
      // 0.5 * 2^-24 and below round to zero (ties to even: exactly half rounds to 0).
      if (abs <= 0x33000000u) return static_cast<std::uint16_t>(sign);
      const std::uint32_t exponent = abs >> 23;                      // biased, 102..112
      const std::uint32_t mantissa = (abs & 0x7fffffu) | 0x800000u;  // with implicit bit
      const std::uint32_t shift = 126u - exponent;                   // brings it to units of 2^-24
      const std::uint32_t half = 1u << (shift - 1);
      std::uint32_t result = mantissa >> shift;
      const std::uint32_t remainder = mantissa & ((1u << shift) - 1u);
      if (remainder > half || (remainder == half && (result & 1u))) ++result;
      return static_cast<std::uint16_t>(sign | result);
    }
    // Normal: rebias 127 -> 15 and round the 13 dropped bits to nearest even. A carry out of the
    // mantissa correctly increments the exponent (and reaches inf only above the guard above).
    const std::uint32_t lsb = (abs >> 13) & 1u;
    const std::uint32_t rounded = abs - (112u << 23) + 0xfffu + lsb;
    return static_cast<std::uint16_t>(sign | (rounded >> 13));
  }

  static KVMEM_HOST_DEVICE float to_float(std::uint16_t raw) {
    const std::uint32_t sign = (static_cast<std::uint32_t>(raw) & 0x8000u) << 16;
    const std::uint32_t exponent = (raw >> 10) & 0x1fu;
    const std::uint32_t mantissa = raw & 0x3ffu;
    if (exponent == 0x1fu)  // inf / NaN
      return detail::bits_float(sign | 0x7f800000u | (mantissa << 13));
    if (exponent == 0) {
      // zero or subnormal: mantissa * 2^-24, exact in float
      const float magnitude = static_cast<float>(mantissa) * 5.9604644775390625e-8f;
      return sign ? -magnitude : magnitude;
    }
    return detail::bits_float(sign | ((exponent + 112u) << 23) | (mantissa << 13));
  }
};

// fp8 e4m3 (OCP FP8 E4M3, the "fn" variant): 1 sign, 4 exponent (bias 7), 3 mantissa bits; no
// infinities; S.1111.111 is NaN, so the largest finite value is 448 = 1.75 * 2^8; subnormals are
// m * 2^-9, m < 8.
struct e4m3 {
  std::uint8_t bits = 0;

  static constexpr float kMax = 448.0f;

  e4m3() = default;
  KVMEM_HOST_DEVICE explicit e4m3(float value) : bits(from_float(value)) {}
  KVMEM_HOST_DEVICE explicit operator float() const { return to_float(bits); }

  static KVMEM_HOST_DEVICE e4m3 from_bits(std::uint8_t raw) {
    e4m3 out;
    out.bits = raw;
    return out;
  }

  // Round to nearest, ties to even; |value| >= 448 (inf included) saturates to +-448 (the CUDA
  // conversion's satfinite mode); NaN stays NaN.
  static KVMEM_HOST_DEVICE std::uint8_t from_float(float value) {
    const std::uint32_t bits = detail::float_bits(value);
    const auto sign = static_cast<std::uint8_t>((bits >> 24) & 0x80u);
    const std::uint32_t abs = bits & 0x7fffffffu;
    if (abs > 0x7f800000u) return static_cast<std::uint8_t>(sign | 0x7fu);   // NaN
    if (abs >= 0x43e00000u) return static_cast<std::uint8_t>(sign | 0x7eu);  // >= 448: the largest finite
    if (abs < 0x3c800000u) {
      // Below 2^-6: subnormal (or zero) in e4m3, m * 2^-9 with m <= 8 (8 carries into 2^-6, code 0x08).
      // 2^-10 (half a unit) and below round to zero (ties to even).
      if (abs <= 0x3a800000u) return sign;
      const std::uint32_t exponent = abs >> 23;                      // biased, 117..120
      const std::uint32_t mantissa = (abs & 0x7fffffu) | 0x800000u;  // with implicit bit
      const std::uint32_t shift = 141u - exponent;                   // brings it to units of 2^-9
      const std::uint32_t half = 1u << (shift - 1);
      std::uint32_t result = mantissa >> shift;
      const std::uint32_t remainder = mantissa & ((1u << shift) - 1u);
      if (remainder > half || (remainder == half && (result & 1u))) ++result;
      return static_cast<std::uint8_t>(sign | result);
    }
    // Normal: rebias 127 -> 7 and round the 20 dropped bits to nearest even; a carry out of the
    // mantissa increments the exponent (it stays <= 448: larger values saturated above).
    const std::uint32_t lsb = (abs >> 20) & 1u;
    const std::uint32_t rounded = abs - (120u << 23) + 0x7ffffu + lsb;
    return static_cast<std::uint8_t>(sign | (rounded >> 20));
  }

  static KVMEM_HOST_DEVICE float to_float(std::uint8_t raw) {
    const std::uint32_t sign = (static_cast<std::uint32_t>(raw) & 0x80u) << 24;
    const std::uint32_t exponent = (raw >> 3) & 0xfu;
    const std::uint32_t mantissa = raw & 0x7u;
    if (exponent == 0xfu && mantissa == 0x7u) return detail::bits_float(sign | 0x7fc00000u);  // NaN
    if (exponent == 0) {
      // zero or subnormal: mantissa * 2^-9, exact in float
      const float magnitude = static_cast<float>(mantissa) * 0.001953125f;
      return sign ? -magnitude : magnitude;
    }
    return detail::bits_float(sign | ((exponent + 120u) << 23) | (mantissa << 20));
  }
};

// Uniform conversions used by kernel bodies: load a stored element as the accumulate type and
// store an accumulated value back. An e4m3 element loads as its own value; the row's scale is the
// caller's (kernels multiply the row's products by it, see quantize_row).
template <class Acc, class Stored>
KVMEM_HOST_DEVICE inline Acc load_as(const Stored& value) {
  if constexpr (std::is_same_v<Stored, bf16> || std::is_same_v<Stored, fp16> || std::is_same_v<Stored, e4m3>)
    return static_cast<Acc>(static_cast<float>(value));
  else
    return static_cast<Acc>(value);
}

template <class Stored, class Acc>
KVMEM_HOST_DEVICE inline Stored store_as(Acc value) {
  if constexpr (std::is_same_v<Stored, bf16> || std::is_same_v<Stored, fp16> || std::is_same_v<Stored, e4m3>)
    return Stored(static_cast<float>(value));
  else
    return static_cast<Stored>(value);
}

template <class T>
inline constexpr bool is_storage_type_v = std::is_same_v<T, float> || std::is_same_v<T, double> ||
                                          std::is_same_v<T, bf16> || std::is_same_v<T, fp16> || std::is_same_v<T, e4m3>;

// Storage whose rows carry one scale each (e4m3): a stored row x is scale * x8. Keys and values of
// such a cache have a float scale per row beside the row; every product with the row is taken on the
// stored elements and multiplied by the scale once.
template <class T>
inline constexpr bool is_row_scaled_v = std::is_same_v<T, e4m3>;

// The element type of the inputs (q, k, v) a GPU cache of storage S takes: S itself, and bf16 for an
// fp8 cache (fp8 is a storage format; the caller's projections stay in bf16).
template <class S>
struct input_type {
  using type = S;
};
template <>
struct input_type<e4m3> {
  using type = bf16;
};
template <class S>
using input_type_t = typename input_type<S>::type;

// The scale of a row stored in e4m3: the smallest power of two s (a normal float, >= 2^-126) with
// amax / s <= 448, amax = max |x| over the row; 1 for a zero row. A power of two makes x / s and
// s * x8 exact, so a stored row reads back to exactly the values it holds, and storing those values
// again gives the same values (a record or a copy moves rows without a change).
KVMEM_HOST_DEVICE inline float fp8_row_scale(float amax) {
  if (!(amax > 0.0f)) return 1.0f;
  const std::uint32_t bits = detail::float_bits(amax);
  const int exponent = static_cast<int>(bits >> 23) - 127;  // amax in [2^e, 2^(e+1)); -127: subnormal
  // amax / 2^(e-8) lies in [256, 512): at most 448 iff the mantissa is at most 1.75
  int k = (bits & 0x7fffffu) <= 0x600000u ? exponent - 8 : exponent - 7;
  k = k < -126 ? -126 : k;
  return detail::bits_float(static_cast<std::uint32_t>(k + 127) << 23);
}
// 1 / s of a row scale s (exact: a power of two; s <= 2^120, so 1 / s is a normal float).
KVMEM_HOST_DEVICE inline float fp8_inverse_scale(float scale) {
  return detail::bits_float((254u << 23) - detail::float_bits(scale));
}

// Stores the n elements of row x in e4m3 with one scale: out[i] = e4m3(x[i] / s); returns s.
template <class In>
KVMEM_HOST_DEVICE inline float quantize_row(const In* x, e4m3* out, std::int64_t n) {
  float amax = 0.0f;
  for (std::int64_t i = 0; i < n; ++i) {
    const float v = load_as<float>(x[i]);
    const float a = v < 0.0f ? -v : v;
    amax = a > amax ? a : amax;
  }
  const float scale = fp8_row_scale(amax), inverse = fp8_inverse_scale(scale);
  for (std::int64_t i = 0; i < n; ++i) out[i] = e4m3(load_as<float>(x[i]) * inverse);
  return scale;
}

// Name used in messages and reports.
template <class T>
constexpr const char* type_name() {
  if constexpr (std::is_same_v<T, float>)
    return "fp32";
  else if constexpr (std::is_same_v<T, double>)
    return "fp64";
  else if constexpr (std::is_same_v<T, bf16>)
    return "bf16";
  else if constexpr (std::is_same_v<T, fp16>)
    return "fp16";
  else if constexpr (std::is_same_v<T, e4m3>)
    return "fp8";
  else
    return "unknown";
}

}  // namespace kvmem
