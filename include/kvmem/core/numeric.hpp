// SPDX-License-Identifier: Apache-2.0
#pragma once
// Storage types for reduced precision: bf16 and IEEE fp16. Both convert from float with
// round-to-nearest-even (ties to even), keep NaN a NaN (quiet), saturate to +-inf on overflow and
// keep subnormals (fp16). They are plain 16-bit structs so host, CUDA and HIP code share one layout;
// arithmetic is always done after conversion to float (DESIGN.md section 5).

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

// Uniform conversions used by kernel bodies: load a stored element as the accumulate type and
// store an accumulated value back.
template <class Acc, class Stored>
KVMEM_HOST_DEVICE inline Acc load_as(const Stored& value) {
  if constexpr (std::is_same_v<Stored, bf16> || std::is_same_v<Stored, fp16>)
    return static_cast<Acc>(static_cast<float>(value));
  else
    return static_cast<Acc>(value);
}

template <class Stored, class Acc>
KVMEM_HOST_DEVICE inline Stored store_as(Acc value) {
  if constexpr (std::is_same_v<Stored, bf16> || std::is_same_v<Stored, fp16>)
    return Stored(static_cast<float>(value));
  else
    return static_cast<Stored>(value);
}

template <class T>
inline constexpr bool is_storage_type_v =
    std::is_same_v<T, float> || std::is_same_v<T, double> || std::is_same_v<T, bf16> || std::is_same_v<T, fp16>;

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
  else
    return "unknown";
}

}  // namespace kvmem
