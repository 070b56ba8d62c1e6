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
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
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

// A user budget held by budget::Any (kind kUser): its bytes and the host functions that evaluate it.
// Any stays a trivially copyable value of fixed size, so kernels and records take it like the built-ins.
namespace detail {
inline constexpr std::size_t kUserBytes = 64;  // room for a handful of doubles / int64 parameters
struct UserOps {
  const char* name;
  std::int64_t (*raw)(const void*, std::int64_t);
  std::int64_t (*slots)(const void*, std::int64_t, std::int64_t, std::int64_t);
  std::int64_t (*max_slots)(const void*, std::int64_t);
  std::int64_t (*maximum)(const void*);
  const char* (*invalid_reason)(const void*);
  std::size_t size;  // sizeof the policy: the bytes its fingerprint covers
};
template <class B>
const B& user_cast(const void* p) {
  return *static_cast<const B*>(p);
}
template <class B>
inline constexpr UserOps kUserOps = {
    [] {
      if constexpr (requires { B::kName; })
        return static_cast<const char*>(B::kName);
      else
        return "user";
    }(),
    [](const void* p, std::int64_t tokens) -> std::int64_t {
      if constexpr (requires(const B& b, std::int64_t n) { b.raw(n); })
        return user_cast<B>(p).raw(tokens);
      else  // the uncapped target of an empty state
        return user_cast<B>(p).slots(tokens, std::numeric_limits<std::int64_t>::max(), 0);
    },
    [](const void* p, std::int64_t tokens, std::int64_t avail, std::int64_t current) -> std::int64_t {
      return user_cast<B>(p).slots(tokens, avail, current);
    },
    [](const void* p, std::int64_t n_ctx) -> std::int64_t { return user_cast<B>(p).max_slots(n_ctx); },
    [](const void* p) -> std::int64_t {
      if constexpr (requires(const B& b) { std::int64_t(b.maximum); })
        return std::int64_t(user_cast<B>(p).maximum);
      else
        return std::numeric_limits<std::int64_t>::max();
    },
    [](const void* p) -> const char* { return user_cast<B>(p).invalid_reason(); },
    sizeof(B),
};
}  // namespace detail

// A budget chosen at run time (configuration files, kvmem-replay, kvmem-plan), or a user policy
// (kvm::Attention<MyBudget{...}>). Same math, one type. The built-in kinds are evaluated from their
// fields (also inside kernels); a user kind through host functions, so device code that needs its
// targets reads them from the slot schedule the host evaluated (kvm::State's update targets).
struct Any {
  enum class Kind { kFixed, kPower, kSaturating, kUser };
  Kind kind = Kind::kFixed;
  Fixed fixed{};
  Power power{};
  Saturating saturating{};
  const detail::UserOps* user_ops = nullptr;                // kUser only
  alignas(16) unsigned char user[detail::kUserBytes] = {};  // kUser: the policy's bytes

  static constexpr const char* kName = "any";

  constexpr Any() = default;
  constexpr Any(Fixed b) : kind(Kind::kFixed), fixed(b) {}
  constexpr Any(Power b) : kind(Kind::kPower), power(b) {}
  constexpr Any(Saturating b) : kind(Kind::kSaturating), saturating(b) {}
  // Any other budget policy (concept BudgetPolicy below): a small trivially copyable value type.
  template <class B>
  requires(!std::is_same_v<std::remove_cvref_t<B>, Any> && !std::is_same_v<B, Fixed> && !std::is_same_v<B, Power> &&
           !std::is_same_v<B, Saturating> &&
           requires(const B& b, std::int64_t n) {
             { b.slots(n, n, n) } -> std::same_as<std::int64_t>;
             { b.max_slots(n) } -> std::same_as<std::int64_t>;
           }) Any(const B& b)
      : kind(Kind::kUser), user_ops(&detail::kUserOps<B>) {
    static_assert(std::is_trivially_copyable_v<B>,
                  "kvmem budget::Any: a user budget policy must be trivially copyable (plain fields, no pointers "
                  "to owned memory): Any copies its bytes into kernels and slot records");
    static_assert(sizeof(B) <= detail::kUserBytes && alignof(B) <= 16,
                  "kvmem budget::Any: a user budget policy must fit in 64 bytes (alignment <= 16)");
    std::memcpy(user, &b, sizeof(B));
  }

  // Calls f with the built-in policy this Any holds (Fixed, Power or Saturating); a user kind has no
  // type to pass here: use the members below, which cover every kind.
  template <class F>
  constexpr decltype(auto) visit(F&& f) const {
    switch (kind) {
      case Kind::kPower:
        return f(power);
      case Kind::kSaturating:
        return f(saturating);
      case Kind::kFixed:
      case Kind::kUser:
        break;
    }
    return f(fixed);
  }
  [[nodiscard]] bool is_user() const { return kind == Kind::kUser; }
  const char* name() const {
    if (is_user()) return user_ops->name;
    return visit([](const auto& b) { return std::remove_cvref_t<decltype(b)>::kName; });
  }
  std::int64_t raw(std::int64_t tokens) const {
    if (is_user()) return user_ops->raw(user, tokens);
    return visit([&](const auto& b) { return b.raw(tokens); });
  }
  std::int64_t slots(std::int64_t tokens, std::int64_t avail, std::int64_t current) const {
    if (is_user()) return user_ops->slots(user, tokens, avail, current);
    return visit([&](const auto& b) { return b.slots(tokens, avail, current); });
  }
  std::int64_t max_slots(std::int64_t n_ctx) const {
    if (is_user()) return user_ops->max_slots(user, n_ctx);
    return visit([&](const auto& b) { return b.max_slots(n_ctx); });
  }
  // The cap every target stays under (the built-ins' `maximum`; a user policy's own `maximum` member
  // when it has one, else no cap beyond its max_slots).
  std::int64_t maximum() const {
    if (is_user()) return user_ops->maximum(user);
    return visit([](const auto& b) { return b.maximum; });
  }
  const char* invalid_reason() const {
    if (is_user()) return user_ops->invalid_reason(user);
    return visit([](const auto& b) { return b.invalid_reason(); });
  }
  Status validate() const {
    if (is_user()) return detail::to_status(user_ops->name, user_ops->invalid_reason(user));
    return visit([](const auto& b) { return b.validate(); });
  }
  // 63-bit FNV-1a over a user policy's name and bytes (0 for the built-ins): what a slot record keeps
  // of a user budget, so an import into a state with another user budget is refused.
  std::int64_t fingerprint() const {
    if (!is_user()) return 0;
    std::uint64_t h = 1469598103934665603ull;
    const auto mix = [&h](unsigned char c) { h = (h ^ c) * 1099511628211ull; };
    for (const char* c = user_ops->name; *c != 0; ++c) mix(static_cast<unsigned char>(*c));
    for (std::size_t i = 0; i < user_ops->size; ++i) mix(user[i]);
    return static_cast<std::int64_t>(h >> 1);
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
  static_assert(BudgetPolicy<std::remove_cvref_t<decltype(Budget)>>,
                "kvmem budget: the type is not a budget policy (it needs slots(N, avail, current), "
                "max_slots(n_ctx), validate() and invalid_reason()); use budget::Fixed, Power or Saturating, or "
                "give your type those members (docs/compose.md)");
  if constexpr (BudgetPolicy<std::remove_cvref_t<decltype(Budget)>>)
    static_assert(Budget.invalid_reason() == nullptr,
                  "kvmem budget: invalid parameters (factor/saturation > 0, exponent >= 0, minimum >= 0, "
                  "round_down >= 1, maximum >= 1)");
  return Budget;
}
}  // namespace budget

}  // namespace kvmem
