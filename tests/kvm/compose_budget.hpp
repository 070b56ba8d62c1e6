// SPDX-License-Identifier: Apache-2.0
#pragma once
// A user budget policy for the composition tests: logarithmic growth, |S| = factor * log2(N), written
// the way an integrator would (a structural value type with the members BudgetPolicy asks for, not
// one of the built-in kinds), and the schedule it implies computed here from its formula alone.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "kvmem/core/config.hpp"
#include "kvmem/core/status.hpp"

namespace kvmem::test {

struct LogBudget {
  double factor = 4.0;
  std::int64_t minimum = 8;
  std::int64_t maximum = 1 << 20;

  static constexpr const char* kName = "log";

  std::int64_t raw(std::int64_t tokens) const {
    const auto v = static_cast<std::int64_t>(std::floor(factor * std::log2(double(std::max<std::int64_t>(tokens, 1)))));
    return std::max(v, minimum);
  }
  std::int64_t slots(std::int64_t tokens, std::int64_t avail, std::int64_t current) const {
    return std::max(std::min({raw(tokens), avail, maximum}), current);
  }
  // raw() grows with N, so raw(n_ctx) bounds every target with N <= n_ctx.
  std::int64_t max_slots(std::int64_t n_ctx) const { return std::min({raw(n_ctx), n_ctx, maximum}); }
  constexpr const char* invalid_reason() const {
    if (!(factor > 0.0)) return "factor must be > 0";
    if (minimum < 0) return "minimum must be >= 0";
    if (maximum < 1) return "maximum must be >= 1";
    return nullptr;
  }
  Status validate() const {
    const char* r = invalid_reason();
    return r == nullptr ? Status::ok() : Status{StatusCode::kInvalidArgument, r};
  }
};

// |S| after each update u = 1..U of T tokens (spec 3.1), from the formula: N = (nb + u) C tokens,
// avail = (u + 1) C, appends = min(target - |S|, C).
inline std::vector<std::int64_t> log_budget_schedule(double factor, std::int64_t minimum, std::int64_t C,
                                                     std::int64_t nb, std::int64_t T) {
  std::vector<std::int64_t> sizes;
  std::int64_t s = std::min(T, C);
  const std::int64_t U = std::max<std::int64_t>(0, (T + C - 1) / C - nb - 1);
  for (std::int64_t u = 1; u <= U; ++u) {
    const double N = double((nb + u) * C);
    const std::int64_t raw = std::max<std::int64_t>(std::int64_t(std::floor(factor * std::log2(N))), minimum);
    const std::int64_t target = std::max(std::min(raw, (u + 1) * C), s);
    s += std::min(target - s, C);
    sizes.push_back(s);
  }
  return sizes;
}

}  // namespace kvmem::test
