// SPDX-License-Identifier: Apache-2.0
#pragma once
// A user decay set whose keys have lifetimes a case can choose: ConstantGate next to KeyGate gives every
// key a lifetime set by its z_k (spec UA.md 4.1: A = log(1 - sqrt(sigmoid(z_k) e^c)) per step), so a case
// keeps a chosen number of entries, evicts some of them at most steps and varies the kept length slowly.
// The CUDA decode tests use it to hold items past the one-block limit while they evict.

#include "kvmem/core/config.hpp"
#include "kvmem/policy/decay.hpp"

namespace kvmem::test::ua {

// A constant log factor c = kTenthsOfLogFactor / 10.
template <int kTenthsOfLogFactor>
struct ConstantGate {
  template <class Real>
  KVMEM_HOST_DEVICE static Real log_factor(const kvmem::decay::PairInputs<Real>&) {
    return Real(kTenthsOfLogFactor) / Real(10);
  }
};
template <int kTenths>
using LifetimeSet = kvmem::decay::Set<kvmem::decay::KeyGate, ConstantGate<kTenths>>;

}  // namespace kvmem::test::ua
