// SPDX-License-Identifier: Apache-2.0
#pragma once
// Precision policies: the storage type of cached keys/values and the accumulate type of every sum
// (DESIGN.md section 5: storage bf16/fp16/fp32 or fp8 e4m3 with a power-of-two scale per row,
// accumulation fp32; fp64 for the reference path).

#include <type_traits>

#include "kvmem/core/numeric.hpp"

namespace kvmem::precision {

template <class Storage, class Accumulate = float>
struct Policy {
  static_assert(is_storage_type_v<Storage>,
                "kvmem::precision::Policy: Storage must be float, double, kvmem::bf16, kvmem::fp16 or kvmem::e4m3");
  static_assert(std::is_same_v<Accumulate, float> || std::is_same_v<Accumulate, double>,
                "kvmem::precision::Policy: Accumulate must be float or double");
  static_assert(sizeof(Accumulate) >= sizeof(Storage),
                "kvmem::precision::Policy: Accumulate must be at least as wide as Storage");
  static_assert(!is_row_scaled_v<Storage> || std::is_same_v<Accumulate, float>,
                "kvmem::precision::Policy: fp8 (kvmem::e4m3) storage accumulates in fp32 (Accumulate = float)");
  using storage_type = Storage;
  using accumulate_type = Accumulate;
};

using Fp32Storage = Policy<float, float>;
using Bf16Storage = Policy<bf16, float>;
using Fp16Storage = Policy<fp16, float>;
using Fp64 = Policy<double, double>;
// fp8 e4m3 keys and values with one power-of-two scale per row, fp32 accumulation (core/numeric.hpp).
using Fp8Storage = Policy<e4m3, float>;

template <class T>
inline constexpr bool is_policy_v = false;
template <class S, class A>
inline constexpr bool is_policy_v<Policy<S, A>> = true;

}  // namespace kvmem::precision

namespace kvmem {
template <class P>
concept PrecisionPolicy = precision::is_policy_v<P>;
}  // namespace kvmem
