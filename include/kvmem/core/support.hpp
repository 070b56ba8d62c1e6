// SPDX-License-Identifier: Apache-2.0
#pragma once
// What each backend's kernels take, known at compile time, so a composed variant with a fixed head
// dimension (kvm::Attention<.., HeadDim>, ua::Attention<.., HeadDim>) that a backend cannot run fails
// to compile where it is used with that backend's executor, with a message naming the limit. The list
// of supported combinations is docs/compose.md ("Supported combinations"); run-time shapes go
// through can_run, which gives the same answers as a Status.
//
// The primary template describes the host backend (any head dimension, storage fp32 / bf16 / fp16 / fp8
// e4m3; accumulation fp32 or, for KVM, fp64); a backend with narrower kernels
// specialises BackendLimits for its executor type in its own folder (backend/cuda/limits.hpp,
// backend/kokkos/executor.hpp).

#include <cstdint>

#include "kvmem/core/numeric.hpp"

namespace kvmem {

// A head dimension chosen at run time (the default of the Attention templates).
inline constexpr std::int64_t kAnyDim = 0;

template <class Executor>
struct BackendLimits {
  static constexpr const char* kName = "host/kokkos";
  static constexpr std::int64_t kMaxKvmKeyDim = 0;    // 0: no limit
  static constexpr std::int64_t kMaxKvmValueDim = 0;  // 0: no limit
  static constexpr std::int64_t kMaxUaHeadDim = 0;    // 0: no limit
  static constexpr bool kKvmFp64Accumulate = true;    // State<S, double> runs
  static constexpr bool kUaFp8 = true;                // UA cache rows in fp8 (precision::Fp8Storage)
  static constexpr bool kKvmFp8 = true;               // KVM readout copies in fp8 (precision::Fp8Storage)
};

// The head dims a call is compiled for. A composed variant with fixed dims (kvm::Attention<.., HeadDim,
// ValueDim>, ua::Attention<.., HeadDim>) passes them to a backend that can use them as this tag, so that
// the backend instantiates only the kernels of those dims (its run-time choice then has one branch);
// HeadDims<> (kAnyDim) keeps the run-time choice over every kernel. The backend still checks that the
// call's run-time dims are these (a Status), since a state or cache may come from elsewhere.
template <std::int64_t KeyDim = kAnyDim, std::int64_t ValueDim = KeyDim>
struct HeadDims {
  static_assert(KeyDim >= 0 && ValueDim >= 0, "kvmem::HeadDims: a head dim is > 0, or kAnyDim (chosen at run time)");
  static constexpr std::int64_t kKey = KeyDim;
  static constexpr std::int64_t kValue = ValueDim;
  static constexpr bool kFixed = KeyDim != kAnyDim;
  // Whether a call of these dims may have key dim `d` / value dim `dv` (any, for kAnyDim): a backend's
  // kernel choice compiles the branch of a dim only when this holds.
  static constexpr bool key_may_be(std::int64_t d) { return KeyDim == kAnyDim || KeyDim == d; }
  static constexpr bool value_may_be(std::int64_t dv) { return ValueDim == kAnyDim || ValueDim == dv; }
  // The same for a range [lo, hi] of key dims (a kernel whose lanes hold up to hi / 4 dims).
  static constexpr bool key_within(std::int64_t lo, std::int64_t hi) {
    return KeyDim == kAnyDim || (KeyDim >= lo && KeyDim <= hi);
  }
  static constexpr bool value_within(std::int64_t lo, std::int64_t hi) {
    return ValueDim == kAnyDim || (ValueDim >= lo && ValueDim <= hi);
  }
};

namespace detail {
consteval bool dim_fits(std::int64_t dim, std::int64_t limit) {
  return dim == kAnyDim || limit == 0 || dim <= limit;
}
}  // namespace detail

// The compile-time checks of a composed variant against the executor it runs on.
template <class Executor, class Accumulate, std::int64_t KeyDim, std::int64_t ValueDim>
consteval bool check_kvm_support() {
  using L = BackendLimits<Executor>;
  static_assert(detail::dim_fits(KeyDim, L::kMaxKvmKeyDim),
                "kvmem::kvm::Attention: this backend's KVM kernels do not take the variant's key head dim "
                "(BackendLimits<Executor>::kMaxKvmKeyDim; docs/compose.md, Supported combinations)");
  static_assert(detail::dim_fits(ValueDim, L::kMaxKvmValueDim),
                "kvmem::kvm::Attention: this backend's KVM kernels do not take the variant's value head dim "
                "(BackendLimits<Executor>::kMaxKvmValueDim; docs/compose.md, Supported combinations)");
  static_assert(L::kKvmFp64Accumulate || sizeof(Accumulate) == 4,
                "kvmem::kvm::Attention: this backend's KVM kernels accumulate in fp32 only; use a precision policy "
                "with Accumulate = float (docs/compose.md, Supported combinations)");
  return true;
}

// The same with the variant's storage type: fp8 (e4m3) readout copies need kKvmFp8.
template <class Executor, class Storage, class Accumulate, std::int64_t KeyDim, std::int64_t ValueDim>
consteval bool check_kvm_support() {
  static_assert(!is_row_scaled_v<Storage> || BackendLimits<Executor>::kKvmFp8,
                "kvmem::kvm::Attention: this backend's KVM kernels do not store fp8 (kvmem::e4m3) slots "
                "(BackendLimits<Executor>::kKvmFp8; docs/compose.md, Supported combinations)");
  return check_kvm_support<Executor, Accumulate, KeyDim, ValueDim>();
}

template <class Executor, std::int64_t HeadDim>
consteval bool check_ua_support() {
  using L = BackendLimits<Executor>;
  static_assert(detail::dim_fits(HeadDim, L::kMaxUaHeadDim),
                "kvmem::ua::Attention: this backend's UA kernels do not take the variant's head dim "
                "(BackendLimits<Executor>::kMaxUaHeadDim; docs/compose.md, Supported combinations)");
  return true;
}
// The same with the variant's storage type: fp8 (e4m3) rows need kUaFp8.
template <class Executor, class Storage, std::int64_t HeadDim>
consteval bool check_ua_support() {
  static_assert(!is_row_scaled_v<Storage> || BackendLimits<Executor>::kUaFp8,
                "kvmem::ua::Attention: this backend's UA kernels do not store fp8 (kvmem::e4m3) rows "
                "(BackendLimits<Executor>::kUaFp8; docs/compose.md, Supported combinations)");
  return check_ua_support<Executor, HeadDim>();
}

}  // namespace kvmem
