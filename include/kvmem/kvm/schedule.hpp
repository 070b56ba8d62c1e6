// SPDX-License-Identifier: Apache-2.0
#pragma once
// KVM chunk geometry and the state-size schedule (spec KVM.md 3.1, 4.1, 4.6, 4.7). Everything here
// is closed-form in the token count: |S| does not depend on the data, so an engine can size memory
// and a GPU prefill can be captured as one stream of launches.

#include <algorithm>
#include <cstdint>
#include <vector>

#include "kvmem/policy/budget.hpp"

namespace kvmem::kvm {

struct Geometry {
  std::int64_t chunk = 256;        // C
  std::int64_t window_chunks = 2;  // nb

  [[nodiscard]] constexpr std::int64_t window() const { return chunk * window_chunks; }
  // First window position when n tokens exist: max(0, ceil(n/C) C - nb C)  (spec 4.1).
  [[nodiscard]] constexpr std::int64_t bswa_begin(std::int64_t n) const {
    const std::int64_t begin = (n + chunk - 1) / chunk * chunk - window();
    return begin > 0 ? begin : 0;
  }
  // Number of state updates in a prefill of T tokens: max(0, ceil(T/C) - nb - 1)  (spec 4.6).
  [[nodiscard]] constexpr std::int64_t updates(std::int64_t tokens) const {
    const std::int64_t u = (tokens + chunk - 1) / chunk - window_chunks - 1;
    return u > 0 ? u : 0;
  }
  // Tokens summarised by the state after n tokens: max(min(n, C), bswa_begin(n))  (spec 4.7).
  [[nodiscard]] constexpr std::int64_t covered(std::int64_t n) const {
    return std::max(std::min(n, chunk), bswa_begin(n));
  }
};

// |S| after one update from `current` slots: current + min(target - current, C)  (spec 3.1).
template <BudgetPolicy Budget>
std::int64_t slots_after_update(const Budget& budget, const Geometry& geo, std::int64_t update, std::int64_t current) {
  const std::int64_t tokens = (geo.window_chunks + update) * geo.chunk;  // N
  const std::int64_t avail = (update + 1) * geo.chunk;
  const std::int64_t target = budget.slots(tokens, avail, current);
  return current + std::min(target - current, geo.chunk);
}

// |S| after each update u = 1..updates(T) of a prefill of T tokens.
template <BudgetPolicy Budget>
std::vector<std::int64_t> slot_schedule(const Budget& budget, const Geometry& geo, std::int64_t tokens) {
  std::vector<std::int64_t> sizes;
  std::int64_t current = std::min(tokens, geo.chunk);
  for (std::int64_t u = 1; u <= geo.updates(tokens); ++u) {
    current = slots_after_update(budget, geo, u, current);
    sizes.push_back(current);
  }
  return sizes;
}

// |S| once T tokens have been processed (prefill or decode: both run the same updates).
template <BudgetPolicy Budget>
std::int64_t slots_after(const Budget& budget, const Geometry& geo, std::int64_t tokens) {
  std::int64_t current = std::min(tokens, geo.chunk);
  for (std::int64_t u = 1; u <= geo.updates(tokens); ++u) current = slots_after_update(budget, geo, u, current);
  return current;
}

// Slots to allocate for a context of up to n_ctx tokens: the closed-form bound of the budget, and
// never less than the initial min(n_ctx, C) slots.
template <BudgetPolicy Budget>
std::int64_t slot_capacity(const Budget& budget, const Geometry& geo, std::int64_t n_ctx) {
  return std::max(std::min(n_ctx, geo.chunk), budget.max_slots(n_ctx));
}

}  // namespace kvmem::kvm
