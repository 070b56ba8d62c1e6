// SPDX-License-Identifier: Apache-2.0
#pragma once
// Scalar helpers used by kernel bodies and references: numerically stable log-sigmoid and the
// clamped log-decay of spec UA.md 4.1. Written against <cmath> so they compile for host and device.

#include <cmath>
#include <limits>

#include "kvmem/core/config.hpp"

namespace kvmem {

template <class Real>
KVMEM_HOST_DEVICE constexpr Real negative_infinity() {
  return -std::numeric_limits<Real>::infinity();
}

// softplus(x) = log(1 + exp(x)), without overflow for large x.
template <class Real>
KVMEM_HOST_DEVICE inline Real softplus(Real x) {
  using std::exp;
  using std::log1p;
  return x > Real(0) ? x + log1p(exp(-x)) : log1p(exp(x));
}

// log(sigmoid(z)) = -softplus(-z) (spec UA.md 4.1 step 3).
template <class Real>
KVMEM_HOST_DEVICE inline Real log_sigmoid(Real z) {
  return -softplus(-z);
}

template <class Real>
KVMEM_HOST_DEVICE inline Real sigmoid(Real z) {
  using std::exp;
  return z >= Real(0) ? Real(1) / (Real(1) + exp(-z)) : exp(z) / (Real(1) + exp(z));
}

// A = log1p(-min(x, 1 - clamp_eps)) for x = exp(log_x), with x = 0 (log_x = -inf) giving A = 0
// exactly (spec UA.md 4.1 steps 3-4).
template <class Real>
KVMEM_HOST_DEVICE inline Real log_decay_from_log_factor(Real log_x, Real clamp_eps = Real(1e-6)) {
  using std::exp;
  using std::log1p;
  if (log_x == negative_infinity<Real>()) return Real(0);
  Real x = exp(log_x);
  const Real cap = Real(1) - clamp_eps;
  if (x > cap) x = cap;
  return log1p(-x);
}

}  // namespace kvmem
