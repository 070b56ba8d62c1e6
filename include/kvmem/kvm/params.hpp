// SPDX-License-Identifier: Apache-2.0
#pragma once
// KVM hyper-parameters (spec KVM.md 3), problem shape, and their validation. Everything an engine
// fixes once per layer; the learned parameters (LN_s affine, temperatures) travel with every call in
// `Weights` so training can update them in place.

#include <cmath>
#include <cstdint>
#include <string>

#include "kvmem/core/status.hpp"
#include "kvmem/core/tensor.hpp"
#include "kvmem/kvm/schedule.hpp"
#include "kvmem/policy/budget.hpp"

namespace kvmem::kvm {

struct Params {
  std::int64_t chunk = 256;        // C
  std::int64_t window_chunks = 2;  // nb (window = nb*C keys)
  std::int64_t sink = 1;           // S: slots never merged into
  std::int64_t rope_dims = 64;     // r: leading key channels zeroed before LN_s
  budget::Any budget = budget::Fixed{256, 256};
  bool merge_gate_keys = true;    // kg = g k0
  bool merge_gate_values = true;  // vg = g v
  bool head_temps = true;         // false: tau = 1
  bool value_radius = true;       // false: count mode V^ = Sv / cnt
  bool gate_appends = false;      // appended slots take kg, vg
  bool gate_initial = false;      // initial slots take kg, vg (rho from raw v, spec 7.5)
  double ln_eps = 1e-5;
  double scale = 0;  // 0 -> 1/sqrt(D)

  [[nodiscard]] constexpr Geometry geometry() const { return {chunk, window_chunks}; }
  [[nodiscard]] constexpr std::int64_t window() const { return chunk * window_chunks; }
};

// Problem shape of one layer's cache: B sequences, Hq query heads, Hk KV heads, key dim D, value
// dim Dv, and the longest context n_ctx the cache must hold (sizes the slots once, spec 3.1).
struct Shape {
  std::int64_t B = 1, Hq = 1, Hk = 1, D = 128, Dv = 128, n_ctx = 4096;
  [[nodiscard]] constexpr std::int64_t rep() const { return Hq / Hk; }
};

// Learned parameters, float. ln_weight, ln_bias: [D]; tau_state, tau_bswa: [Hq].
struct Weights {
  TensorView<const float, 1> ln_weight, ln_bias, tau_state, tau_bswa;
};

// spec 3 validation plus what a preallocated cache needs (DESIGN.md 3: before any state change).
inline Status validate(const Params& p, const Shape& s) {
  if (p.chunk < 1) return invalid_argument("chunk", ">= 1", p.chunk);
  if (p.window_chunks < 1)
    return invalid_argument("window_chunks", ">= 1 (the window is window_chunks*chunk keys)", p.window_chunks);
  if (p.sink < 0 || p.sink >= p.chunk)
    return invalid_argument(
        "sink", "0 <= sink < chunk = " + std::to_string(p.chunk) + " (a merge needs a non-sink slot)", p.sink);
  if (p.rope_dims < 0 || p.rope_dims > s.D)
    return invalid_argument("rope_dims", "0 <= rope_dims <= D = " + std::to_string(s.D), p.rope_dims);
  KVMEM_RETURN_IF_ERROR(p.budget.validate());
  const std::int64_t maximum = p.budget.maximum();
  if (maximum < p.chunk)
    return invalid_argument("budget maximum",
                            ">= chunk = " + std::to_string(p.chunk) + " (the first chunk founds chunk slots)", maximum);
  if (!(p.ln_eps > 0) || !std::isfinite(p.ln_eps)) return invalid_argument("ln_eps", "finite and > 0", p.ln_eps);
  if (!(p.scale >= 0) || !std::isfinite(p.scale))
    return invalid_argument("scale", "finite and >= 0 (0 selects 1/sqrt(D))", p.scale);
  if (s.B < 1) return invalid_argument("B", ">= 1", s.B);
  if (s.Hk < 1) return invalid_argument("Hk", ">= 1", s.Hk);
  if (s.Hq < 1 || s.Hq % s.Hk != 0)
    return invalid_argument("Hq", "a positive multiple of Hk = " + std::to_string(s.Hk), s.Hq);
  if (s.D < 1) return invalid_argument("D", ">= 1", s.D);
  if (s.Dv < 1) return invalid_argument("Dv", ">= 1", s.Dv);
  if (s.n_ctx < 1) return invalid_argument("n_ctx", ">= 1", s.n_ctx);
  return Status::ok();
}

namespace detail {
template <class T, std::size_t R>
Status check_finite(const TensorView<T, R>& x, const char* name) {
  // Views here are contiguous (checked by the caller), so a flat scan covers them.
  for (std::int64_t i = 0; i < x.size(); ++i)
    if (!std::isfinite(static_cast<double>(x.data()[i])))
      return invalid_argument(name, "finite values", "NaN or Inf at flat index " + std::to_string(i));
  return Status::ok();
}
}  // namespace detail

inline Status validate(const Weights& w, const Shape& s) {
  KVMEM_RETURN_IF_ERROR(check_shape(w.ln_weight, {s.D}, "ln_weight"));
  KVMEM_RETURN_IF_ERROR(check_shape(w.ln_bias, {s.D}, "ln_bias"));
  KVMEM_RETURN_IF_ERROR(check_shape(w.tau_state, {s.Hq}, "tau_state"));
  KVMEM_RETURN_IF_ERROR(check_shape(w.tau_bswa, {s.Hq}, "tau_bswa"));
  KVMEM_RETURN_IF_ERROR(detail::check_finite(w.ln_weight, "ln_weight"));
  KVMEM_RETURN_IF_ERROR(detail::check_finite(w.ln_bias, "ln_bias"));
  KVMEM_RETURN_IF_ERROR(detail::check_finite(w.tau_state, "tau_state"));
  KVMEM_RETURN_IF_ERROR(detail::check_finite(w.tau_bswa, "tau_bswa"));
  return Status::ok();
}

}  // namespace kvmem::kvm
