// SPDX-License-Identifier: Apache-2.0
#pragma once
// Universal Attention pruning policies (spec UA.md 4.5). An entry whose accumulated log-decay
// falls strictly below ln p is evicted for good. prune::None keeps every key (dense UA, same API).

#include <cmath>
#include <concepts>
#include <limits>
#include <sstream>

#include "kvmem/core/status.hpp"

namespace kvmem::prune {

struct None {
  static constexpr bool kEnabled = false;
  constexpr double log_threshold() const { return -std::numeric_limits<double>::infinity(); }
  constexpr bool evicts(double /*lambda*/) const { return false; }
  constexpr const char* invalid_reason() const { return nullptr; }
  Status validate() const { return Status::ok(); }
};

// Evict iff lambda < ln p. p = 0 never evicts (spec UA.md 3); p = 1 evicts every entry with
// lambda < 0 (spec UA.md 4.6). The paper uses 0.05 (conservative) and 0.15 (aggressive).
struct Threshold {
  double p = 0.05;

  static constexpr bool kEnabled = true;
  double log_threshold() const { return p > 0.0 ? std::log(p) : -std::numeric_limits<double>::infinity(); }
  bool evicts(double lambda) const { return lambda < log_threshold(); }
  constexpr const char* invalid_reason() const {
    if (!(p >= 0.0 && p <= 1.0)) return "the threshold p must lie in [0, 1] (0 disables pruning)";
    return nullptr;
  }
  Status validate() const {
    if (invalid_reason() == nullptr) return Status::ok();
    std::ostringstream got;
    got << p;
    return invalid_argument("prune::Threshold p", "a value in [0, 1] (0 disables pruning)", got.str());
  }
};

}  // namespace kvmem::prune

namespace kvmem {

template <class P>
concept PrunePolicy = requires(const P& policy, double lambda) {
  { P::kEnabled } -> std::convertible_to<bool>;
  { policy.log_threshold() } -> std::convertible_to<double>;
  { policy.evicts(lambda) } -> std::same_as<bool>;
  { policy.validate() } -> std::same_as<Status>;
};

namespace prune {
// Compile-time check used by ua::Attention<Set, Prune>.
template <auto Policy>
consteval auto checked() {
  static_assert(PrunePolicy<decltype(Policy)>,
                "kvmem prune: the type is not a prune policy; use prune::None or prune::Threshold{p}");
  if constexpr (PrunePolicy<decltype(Policy)>)
    static_assert(Policy.invalid_reason() == nullptr,
                  "kvmem prune::Threshold: p must lie in [0, 1] (0 disables pruning)");
  return Policy;
}
}  // namespace prune

}  // namespace kvmem
