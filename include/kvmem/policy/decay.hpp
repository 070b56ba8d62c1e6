// SPDX-License-Identifier: Apache-2.0
#pragma once
// Universal Attention decay gates (spec UA.md 4.1). A gate contributes log f in [-inf, 0] for one
// (key j, later position m) pair; decay::Set<G...> averages the logs (the geometric mean of the
// factors, evaluated in log space) and turns the mean into the per-step log-decay
//   A_jm = log1p(-min(exp(mean), 1 - 1e-6)),   A_jm = 0 exactly when a factor is 0.
// A user gate is a struct with a static log_factor(PairInputs) and optional kNeeds* flags; the fused
// kernels pick it up through the Set.

#include <cmath>
#include <concepts>
#include <cstdint>

#include "kvmem/core/config.hpp"
#include "kvmem/core/math.hpp"

namespace kvmem::decay {

// Everything a gate may look at for the pair (key j, position m), j < m.
template <class Real>
struct PairInputs {
  Real key_logit = Real(0);       // z_k[j]: key-gate logit of the key
  Real query_logit = Real(0);     // z_q[m]: gate logit of the later token
  Real similarity = Real(0);      // c_jm = k_j . k_m (normalised, post-RoPE keys)
  std::int64_t key_position = 0;  // j
  std::int64_t position = 0;      // m
};

// f = sigmoid(z_k[j]): how readily key j forgets (the authors' static_src).
struct KeyGate {
  static constexpr bool kNeedsKeyLogit = true;
  template <class Real>
  KVMEM_HOST_DEVICE static Real log_factor(const PairInputs<Real>& in) {
    return log_sigmoid(in.key_logit);
  }
};

// f = sigmoid(z_q[m]): how strongly the later token m erases (the authors' static_dest).
struct QueryGate {
  static constexpr bool kNeedsQueryLogit = true;
  template <class Real>
  KVMEM_HOST_DEVICE static Real log_factor(const PairInputs<Real>& in) {
    return log_sigmoid(in.query_logit);
  }
};

// f = relu(c_jm)^2: a later token overwrites keys that point the same way.
struct SimilarityGate {
  static constexpr bool kNeedsSimilarity = true;
  template <class Real>
  KVMEM_HOST_DEVICE static Real log_factor(const PairInputs<Real>& in) {
    using std::log;
    return in.similarity > Real(0) ? Real(2) * log(in.similarity) : negative_infinity<Real>();
  }
};

}  // namespace kvmem::decay

namespace kvmem {

// A decay gate maps PairInputs to log f (a value <= 0, -inf allowed) for float and double.
template <class G>
concept DecayGate = requires(const decay::PairInputs<double>& d, const decay::PairInputs<float>& f) {
  { G::log_factor(d) } -> std::convertible_to<double>;
  { G::log_factor(f) } -> std::convertible_to<float>;
};

namespace decay {

namespace detail {
template <class G>
constexpr bool needs_key_logit() {
  if constexpr (requires { G::kNeedsKeyLogit; })
    return G::kNeedsKeyLogit;
  else
    return false;
}
template <class G>
constexpr bool needs_query_logit() {
  if constexpr (requires { G::kNeedsQueryLogit; })
    return G::kNeedsQueryLogit;
  else
    return false;
}
template <class G>
constexpr bool needs_similarity() {
  if constexpr (requires { G::kNeedsSimilarity; })
    return G::kNeedsSimilarity;
  else
    return false;
}
}  // namespace detail

// Clamp of spec UA.md 3: x <= 1 - 1e-6, so every step adds at least ln(1e-6).
inline constexpr double kClampEps = 1e-6;

template <class... Gates>
struct Set {
  static_assert(sizeof...(Gates) > 0, "kvmem::decay::Set needs at least one gate");
  static_assert((DecayGate<Gates> && ...),
                "kvmem::decay::Set: every gate needs a static log_factor(const PairInputs<Real>&) "
                "returning log f <= 0 for Real = float and double");

  static constexpr int kSize = static_cast<int>(sizeof...(Gates));
  // Which inputs the kernels must provide (a kernel skips the k_j . k_m products when no gate reads them).
  static constexpr bool kNeedsKeyLogit = (detail::needs_key_logit<Gates>() || ...);
  static constexpr bool kNeedsQueryLogit = (detail::needs_query_logit<Gates>() || ...);
  static constexpr bool kNeedsSimilarity = (detail::needs_similarity<Gates>() || ...);

  // log of the geometric mean: (sum of log f) / |set|; -inf when any factor is 0.
  template <class Real>
  KVMEM_HOST_DEVICE static Real log_mean_factor(const PairInputs<Real>& in) {
    const Real sum = (Real(0) + ... + static_cast<Real>(Gates::log_factor(in)));
    return sum / static_cast<Real>(kSize);
  }

  // A_jm in [ln 1e-6, 0] (spec UA.md 4.1 step 4).
  template <class Real>
  KVMEM_HOST_DEVICE static Real log_decay(const PairInputs<Real>& in) {
    return log_decay_from_log_factor(log_mean_factor(in), static_cast<Real>(kClampEps));
  }
};

// The paper's set: query, key and similarity gates.
using Universal = Set<QueryGate, KeyGate, SimilarityGate>;

template <class T>
inline constexpr bool is_set_v = false;
template <class... G>
inline constexpr bool is_set_v<Set<G...>> = true;

}  // namespace decay

template <class S>
concept DecaySet = decay::is_set_v<S>;

}  // namespace kvmem
