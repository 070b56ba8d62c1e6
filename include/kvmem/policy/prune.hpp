// SPDX-License-Identifier: Apache-2.0
#pragma once
// Universal Attention pruning policies (spec UA.md 4.5). An entry the rule evicts is gone for good.
// prune::None keeps every key (dense UA, same API) and compiles the eviction away.
//
// A prune policy is a value type (a template argument of ua::Attention, or a runtime value passed to
// ua::prefill / decode / step). Per call the host asks it for its evictor at the call's layer
// (evictor(layer)): a small trivially copyable value that the eviction body of every backend calls
// once per (sequence, KV head) item with the item's entries, and that answers with a Cut. An entry
// (λ, position) goes iff λ < cut.log_p, or the cut is ranked and (λ, position) orders below
// (cut.lambda, cut.pos) (λ first, then position: of equal λ the newer entry stays). One rule shape
// covers thresholds (fixed, per layer, per slot) and rank rules (keep the k least-decayed entries);
// the kernels keep one compaction loop.
//
// Built-in policies: None; Threshold{p} (λ < ln p, the paper's rule); PerLayer<L>{{p0, ..}} (a
// threshold per layer, Options::layer picks it); KeepTop{k, p} (at most k entries per item, the k with
// the largest λ, after the threshold p). A user rule is a struct with kEnabled, validate(),
// invalid_reason() and evictor(layer) (docs/compose.md).

#include <cmath>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <sstream>
#include <string>
#include <type_traits>

#include "kvmem/core/config.hpp"
#include "kvmem/core/status.hpp"

namespace kvmem::prune {

// What the evictor of one item decided: entries (λ, pos) with λ < log_p go; when ranked, so do
// entries ordering below (lambda, pos).
// (-HUGE_VAL rather than numeric_limits: the cut is built inside device code.)
struct Cut {
  double log_p = -HUGE_VAL;
  bool ranked = false;
  double lambda = 0.0;
  std::int64_t pos = 0;
};

// The cut of a plain threshold, the same for every item.
struct LogThreshold {
  double log_p = -std::numeric_limits<double>::infinity();
  // Whether any entry can go (decided on the host: -inf never evicts, so the pass is skipped).
  bool active() const { return log_p > -std::numeric_limits<double>::infinity(); }
  template <class Entries>
  KVMEM_HOST_DEVICE Cut cut(const Entries& /*entries*/) const {
    Cut c;
    c.log_p = log_p;
    return c;
  }
};

namespace detail {
inline double log_of(double p) {
  return p > 0.0 ? std::log(p) : -std::numeric_limits<double>::infinity();
}
inline Status p_status(const char* name, double p) {
  if (p >= 0.0 && p <= 1.0) return Status::ok();
  std::ostringstream got;
  got << p;
  return invalid_argument(name, "a value in [0, 1] (0 disables pruning)", got.str());
}
}  // namespace detail

struct None {
  static constexpr bool kEnabled = false;
  constexpr double log_threshold() const { return -std::numeric_limits<double>::infinity(); }
  constexpr bool evicts(double /*lambda*/) const { return false; }
  constexpr const char* invalid_reason() const { return nullptr; }
  Status validate() const { return Status::ok(); }
  LogThreshold evictor(std::int64_t /*layer*/) const { return {}; }
};

// Evict iff lambda < ln p. p = 0 never evicts (spec UA.md 3); p = 1 evicts every entry with
// lambda < 0 (spec UA.md 4.6). The paper uses 0.05 (conservative) and 0.15 (aggressive).
struct Threshold {
  double p = 0.05;

  static constexpr bool kEnabled = true;
  double log_threshold() const { return detail::log_of(p); }
  bool evicts(double lambda) const { return lambda < log_threshold(); }
  constexpr const char* invalid_reason() const {
    if (!(p >= 0.0 && p <= 1.0)) return "the threshold p must lie in [0, 1] (0 disables pruning)";
    return nullptr;
  }
  Status validate() const { return detail::p_status("prune::Threshold p", p); }
  LogThreshold evictor(std::int64_t /*layer*/) const { return {log_threshold()}; }
};

// A threshold per layer: layer l (ua::Options::layer) evicts λ < ln p[l]. L layers, each p in [0, 1].
template <std::size_t L>
struct PerLayer {
  double p[L];

  static constexpr bool kEnabled = true;
  static constexpr std::size_t kLayers = L;
  constexpr const char* invalid_reason() const {
    for (std::size_t l = 0; l < L; ++l)
      if (!(p[l] >= 0.0 && p[l] <= 1.0)) return "every per-layer threshold p must lie in [0, 1] (0 disables pruning)";
    return nullptr;
  }
  Status validate() const {
    for (std::size_t l = 0; l < L; ++l) KVMEM_RETURN_IF_ERROR(detail::p_status("prune::PerLayer p", p[l]));
    return Status::ok();
  }
  Status validate_layer(std::int64_t layer) const {
    if (layer < 0 || layer >= std::int64_t(L))
      return {StatusCode::kOutOfRange, "Options layer: expected 0 <= layer < " + std::to_string(L) +
                                           " (the layers of prune::PerLayer), got " + std::to_string(layer)};
    return Status::ok();
  }
  LogThreshold evictor(std::int64_t layer) const { return {detail::log_of(p[layer])}; }
};
template <class... P>
PerLayer(P...) -> PerLayer<sizeof...(P)>;

// The evictor of KeepTop: at most k entries per item stay, those with the largest λ (of equal λ the
// newer), after the threshold. Finding the k-th entry compares every pair of entries, O(n^2) per item
// and eviction, with no scratch memory (a kernel body may not allocate); it runs only when the item
// holds more than k entries.
struct TopCut {
  std::int64_t k = 0;
  double log_p = -HUGE_VAL;
  template <class Entries>
  KVMEM_HOST_DEVICE Cut cut(const Entries& e) const {
    Cut c;
    c.log_p = log_p;
    const std::int64_t n = e.size();
    if (n <= k) return c;
    for (std::int64_t i = 0; i < n; ++i) {
      const double li = e.lambda(i);
      const std::int64_t pi = e.pos(i);
      std::int64_t above = 0;  // entries ordering above i
      for (std::int64_t j = 0; j < n && above < k; ++j) {
        const double lj = e.lambda(j);
        above += (lj > li || (lj == li && e.pos(j) > pi)) ? 1 : 0;
      }
      if (above == k - 1) {  // i is the k-th entry: everything below it goes
        c.ranked = true;
        c.lambda = li;
        c.pos = pi;
        break;
      }
    }
    return c;
  }
};

// Keep at most k entries per (sequence slot, KV head): the k least decayed (largest λ), and of those
// only the ones with λ >= ln p (p = 0: no threshold). k >= 1.
struct KeepTop {
  std::int64_t k = 256;
  double p = 0.0;

  static constexpr bool kEnabled = true;
  constexpr const char* invalid_reason() const {
    if (k < 1) return "prune::KeepTop k must be >= 1";
    if (!(p >= 0.0 && p <= 1.0)) return "the threshold p must lie in [0, 1] (0 disables pruning)";
    return nullptr;
  }
  Status validate() const {
    if (k < 1) return invalid_argument("prune::KeepTop k", ">= 1", k);
    return detail::p_status("prune::KeepTop p", p);
  }
  TopCut evictor(std::int64_t /*layer*/) const { return {k, detail::log_of(p)}; }
};

}  // namespace kvmem::prune

namespace kvmem {

// The requirements every prune policy meets (spec UA.md 4.5): kEnabled (false compiles the eviction
// away), validate() / invalid_reason(), and evictor(layer), whose cut(entries) the eviction bodies call.
template <class P>
concept PrunePolicy = requires(const P& policy, std::int64_t layer) {
  { P::kEnabled } -> std::convertible_to<bool>;
  { policy.validate() } -> std::same_as<Status>;
  { policy.invalid_reason() } -> std::convertible_to<const char*>;
  {policy.evictor(layer)};
  requires std::is_trivially_copyable_v<decltype(policy.evictor(layer))>;
};

namespace prune {
// Compile-time check used by ua::Attention<Set, Prune>.
template <auto Policy>
consteval auto checked() {
  // remove_cvref: some front ends (nvcc) name a class-type template parameter object by reference.
  static_assert(PrunePolicy<std::remove_cvref_t<decltype(Policy)>>,
                "kvmem prune: the type is not a prune policy (it needs kEnabled, validate(), invalid_reason() and "
                "evictor(layer)); use prune::None, Threshold{p}, PerLayer{p0, ...} or KeepTop{k, p}");
  if constexpr (PrunePolicy<std::remove_cvref_t<decltype(Policy)>>)
    static_assert(Policy.invalid_reason() == nullptr,
                  "kvmem prune: invalid parameters (a threshold p must lie in [0, 1], KeepTop k >= 1)");
  return Policy;
}

// Ok when `policy` runs at `layer` (a policy without layers takes any).
template <PrunePolicy P>
Status validate_layer(const P& policy, std::int64_t layer) {
  if constexpr (requires { policy.validate_layer(layer); })
    return policy.validate_layer(layer);
  else
    return Status::ok();
}
// Whether the evictor can evict anything (host side; a rank or user rule always runs).
template <class E>
bool active(const E& evictor) {
  if constexpr (requires { evictor.active(); })
    return evictor.active();
  else
    return true;
}
}  // namespace prune

}  // namespace kvmem
