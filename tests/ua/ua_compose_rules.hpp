// SPDX-License-Identifier: Apache-2.0
#pragma once
// A user prune rule (policy/prune.hpp, docs/compose.md) shared by the host and CUDA composition tests:
// the rank rule of prune::KeepTop written as a user policy, so every backend runs it through the generic
// evictor path (cut(entries) on one thread) rather than a path of its own for the built-in rule.

#include <cstdint>
#include <limits>

#include "kvmem/core/config.hpp"
#include "kvmem/core/status.hpp"
#include "kvmem/policy/prune.hpp"

namespace kvmem::test::ua {

// A user rule: keep the k entries of largest λ (ties: the later position), found by k rounds of
// "largest entry below the previous one" rather than by counting ranks as prune::KeepTop does.
struct TopByLambda {
  std::int64_t k = 16;

  static constexpr bool kEnabled = true;
  constexpr const char* invalid_reason() const { return k >= 1 ? nullptr : "k must be >= 1"; }
  kvmem::Status validate() const {
    return k >= 1 ? kvmem::Status::ok() : kvmem::invalid_argument("TopByLambda k", ">= 1", k);
  }
  struct Evictor {
    std::int64_t k;
    template <class Entries>
    KVMEM_HOST_DEVICE kvmem::prune::Cut cut(const Entries& e) const {
      kvmem::prune::Cut c;
      if (e.size() <= k) return c;
      double bound_l = std::numeric_limits<double>::infinity();
      std::int64_t bound_p = std::numeric_limits<std::int64_t>::max();
      for (std::int64_t round = 0; round < k; ++round) {  // the next entry below (bound_l, bound_p)
        double best_l = -std::numeric_limits<double>::infinity();
        std::int64_t best_p = -1;
        for (std::int64_t i = 0; i < e.size(); ++i) {
          const double l = e.lambda(i);
          const std::int64_t p = e.pos(i);
          const bool below = l < bound_l || (l == bound_l && p < bound_p);
          const bool better = l > best_l || (l == best_l && p > best_p);
          if (below && better) best_l = l, best_p = p;
        }
        bound_l = best_l, bound_p = best_p;
      }
      c.ranked = true;
      c.lambda = bound_l;
      c.pos = bound_p;
      return c;
    }
  };
  Evictor evictor(std::int64_t /*layer*/) const { return {k}; }
};
static_assert(kvmem::PrunePolicy<TopByLambda>);

}  // namespace kvmem::test::ua
