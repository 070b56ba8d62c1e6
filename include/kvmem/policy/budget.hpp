// SPDX-License-Identifier: Apache-2.0
#pragma once
// KVM state budget policies (spec KVM.md 3.1). A policy answers two questions in closed form:
//   slots(N, avail, current)  the target |S| of one state update (capped by avail and the policy's
//                             maximum, never below the current size);
//   max_slots(n_ctx)          an upper bound of every target with N <= n_ctx, so an engine can size
//                             memory before the first token.
// The number of appends of an update is min(target - current, C); that step belongs to kvm/ because it
// needs the chunk length. Budgets are structural types: they can be template arguments
// (kvm::Attention<budget::Power{16.0, 0.5, 256}>) or plain runtime values.

#include <cmath>
#include <concepts>
#include <cstdint>
#include <string>
#include <type_traits>

#include "kvmem/core/config.hpp"
#include "kvmem/core/status.hpp"

namespace kvmem::budget {

// C * n_max_d_chunks of the paper configurations (spec KVM.md 3.1 table).
inline constexpr std::int64_t kPaperMaxSlots = 2'560'000;

namespace detail {
KVMEM_HOST_DEVICE constexpr std::int64_t min3(std::int64_t a, std::int64_t b, std::int64_t c) {
  const std::int64_t ab = a < b ? a : b;
  return ab < c ? ab : c;
}
// target = max(min(raw, avail, maximum), current) -- spec KVM.md 3.1
KVMEM_HOST_DEVICE constexpr std::int64_t capped_target(std::int64_t raw, std::int64_t avail, std::int64_t maximum,
                                                       std::int64_t current) {
  const std::int64_t capped = min3(raw, avail, maximum);
  return capped > current ? capped : current;
}
// R * floor(value / R), then at least `minimum`; `value` is already floored.
KVMEM_HOST_DEVICE constexpr std::int64_t round_and_floor(std::int64_t value, std::int64_t round_down,
                                                         std::int64_t minimum) {
  const std::int64_t rounded = round_down * (value / round_down);
  return rounded > minimum ? rounded : minimum;
}
inline Status to_status(const char* policy, const char* reason) {
  if (reason == nullptr) return Status::ok();
  return {StatusCode::kInvalidArgument, std::string(policy) + ": " + reason};
}
}  // namespace detail

// fixed: raw = count ("KVM-256").
struct Fixed {
  std::int64_t count = 256;
  std::int64_t maximum = kPaperMaxSlots;

  static constexpr const char* kName = "fixed";

  KVMEM_HOST_DEVICE constexpr std::int64_t raw(std::int64_t /*tokens*/) const { return count; }
  KVMEM_HOST_DEVICE constexpr std::int64_t slots(std::int64_t tokens, std::int64_t avail, std::int64_t current) const {
    return detail::capped_target(raw(tokens), avail, maximum, current);
  }
  constexpr std::int64_t max_slots(std::int64_t n_ctx) const { return detail::min3(count, n_ctx, maximum); }
  constexpr const char* invalid_reason() const {
    if (count < 0) return "count must be >= 0";
    if (maximum < 1) return "maximum must be >= 1";
    return nullptr;
  }
  Status validate() const { return detail::to_status("budget::Fixed", invalid_reason()); }
};

// power: raw = max(R * floor(floor(factor * N^exponent) / R), minimum)  ("KVM-sqrt", 16 sqrt N).
struct Power {
  double factor = 16.0;
  double exponent = 0.5;
  std::int64_t minimum = 256;
  std::int64_t round_down = 1;
  std::int64_t maximum = kPaperMaxSlots;

  static constexpr const char* kName = "power";

  KVMEM_HOST_DEVICE std::int64_t raw(std::int64_t tokens) const {
    // Evaluated in double and floored, exactly as the reference (std::pow(double(N), e)).
    const auto value = static_cast<std::int64_t>(std::floor(factor * std::pow(static_cast<double>(tokens), exponent)));
    return detail::round_and_floor(value, round_down, minimum);
  }
  KVMEM_HOST_DEVICE std::int64_t slots(std::int64_t tokens, std::int64_t avail, std::int64_t current) const {
    return detail::capped_target(raw(tokens), avail, maximum, current);
  }
  // raw() is non-decreasing in N for factor > 0, exponent >= 0, so raw(n_ctx) bounds every N <= n_ctx.
  std::int64_t max_slots(std::int64_t n_ctx) const { return detail::min3(raw(n_ctx), n_ctx, maximum); }
  constexpr const char* invalid_reason() const {
    if (!(factor > 0.0) || factor > 1e300) return "factor must be finite and > 0";
    if (!(exponent >= 0.0) || exponent > 1e300) return "exponent must be finite and >= 0";
    if (minimum < 0) return "minimum must be >= 0";
    if (round_down < 1) return "round_down must be >= 1";
    if (maximum < 1) return "maximum must be >= 1";
    return nullptr;
  }
  Status validate() const { return detail::to_status("budget::Power", invalid_reason()); }
};

// saturating: raw = max(R * floor(floor(Nsat * N / (Nsat + N)) / R), minimum)  ("KVM/SWA").
struct Saturating {
  double saturation = 1024.0;
  std::int64_t minimum = 1;
  std::int64_t maximum = kPaperMaxSlots;
  std::int64_t round_down = 1;

  static constexpr const char* kName = "saturating";

  KVMEM_HOST_DEVICE constexpr std::int64_t raw(std::int64_t tokens) const {
    const double n = static_cast<double>(tokens);
    const auto value = static_cast<std::int64_t>(saturation * n / (saturation + n));  // >= 0: trunc == floor
    return detail::round_and_floor(value, round_down, minimum);
  }
  KVMEM_HOST_DEVICE constexpr std::int64_t slots(std::int64_t tokens, std::int64_t avail, std::int64_t current) const {
    return detail::capped_target(raw(tokens), avail, maximum, current);
  }
  // Nsat*N/(Nsat+N) increases with N, so raw(n_ctx) bounds every N <= n_ctx.
  constexpr std::int64_t max_slots(std::int64_t n_ctx) const { return detail::min3(raw(n_ctx), n_ctx, maximum); }
  constexpr const char* invalid_reason() const {
    if (!(saturation > 0.0) || saturation > 1e300) return "saturation must be finite and > 0";
    if (minimum < 0) return "minimum must be >= 0";
    if (round_down < 1) return "round_down must be >= 1";
    if (maximum < 1) return "maximum must be >= 1";
    return nullptr;
  }
  Status validate() const { return detail::to_status("budget::Saturating", invalid_reason()); }
};

// A budget chosen at run time (configuration files, kvmem-replay, kvmem-plan). Same math, one type.
struct Any {
  enum class Kind { kFixed, kPower, kSaturating };
  Kind kind = Kind::kFixed;
  Fixed fixed{};
  Power power{};
  Saturating saturating{};

  static constexpr const char* kName = "any";

  constexpr Any() = default;
  constexpr Any(Fixed b) : kind(Kind::kFixed), fixed(b) {}
  constexpr Any(Power b) : kind(Kind::kPower), power(b) {}
  constexpr Any(Saturating b) : kind(Kind::kSaturating), saturating(b) {}

  template <class F>
  constexpr decltype(auto) visit(F&& f) const {
    switch (kind) {
      case Kind::kPower:
        return f(power);
      case Kind::kSaturating:
        return f(saturating);
      case Kind::kFixed:
        break;
    }
    return f(fixed);
  }
  const char* name() const {
    return visit([](const auto& b) { return std::remove_cvref_t<decltype(b)>::kName; });
  }
  std::int64_t raw(std::int64_t tokens) const {
    return visit([&](const auto& b) { return b.raw(tokens); });
  }
  std::int64_t slots(std::int64_t tokens, std::int64_t avail, std::int64_t current) const {
    return visit([&](const auto& b) { return b.slots(tokens, avail, current); });
  }
  std::int64_t max_slots(std::int64_t n_ctx) const {
    return visit([&](const auto& b) { return b.max_slots(n_ctx); });
  }
  constexpr const char* invalid_reason() const {
    return visit([](const auto& b) { return b.invalid_reason(); });
  }
  Status validate() const {
    return visit([](const auto& b) { return b.validate(); });
  }
};

}  // namespace kvmem::budget

namespace kvmem {

// The requirements every budget policy meets (spec KVM.md 3.1).
template <class B>
concept BudgetPolicy = requires(const B& budget, std::int64_t n) {
  { budget.slots(n, n, n) } -> std::same_as<std::int64_t>;  // target |S| of one update
  { budget.max_slots(n) } -> std::same_as<std::int64_t>;    // closed-form bound for n_ctx tokens
  { budget.validate() } -> std::same_as<Status>;
  { budget.invalid_reason() } -> std::convertible_to<const char*>;
};

namespace budget {
// Compile-time check used by variant templates (kvm::Attention<Budget>): a non-policy or invalid
// parameters fail with a message that names the problem.
template <auto Budget>
consteval auto checked() {
  static_assert(BudgetPolicy<decltype(Budget)>,
                "kvmem budget: the type is not a budget policy (it needs slots(N, avail, current), "
                "max_slots(n_ctx), validate() and invalid_reason()); use budget::Fixed, Power or Saturating");
  if constexpr (BudgetPolicy<decltype(Budget)>)
    static_assert(Budget.invalid_reason() == nullptr,
                  "kvmem budget: invalid parameters (factor/saturation > 0, exponent >= 0, minimum >= 0, "
                  "round_down >= 1, maximum >= 1)");
  return Budget;
}
}  // namespace budget

}  // namespace kvmem
