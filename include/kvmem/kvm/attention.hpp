// SPDX-License-Identifier: Apache-2.0
#pragma once
// KVM operations (DESIGN.md 3): executor first, then the state, the learned weights, views of
// caller memory. Each backend specialises kvm::Backend<Executor> (backend/host/kvm.hpp for
// host::Executor), so kvm/ knows nothing of threads, CUDA or Kokkos.
//
//   prefill(exec, state, weights, q, k, v, gate, out [, lengths, log])  appends T tokens per sequence
//           (any length, ragged last chunk; lengths[b] <= T gives per-sequence lengths), chunked
//           exactly like spec 4.6; a non-empty state continues (chunked prefill).
//   decode (exec, state, weights, q1, k1, v1, gate1, out1 [, active])   one token per sequence, the
//           update on the first token of a new chunk before its attention (spec 4.7).
//   forward(exec, params, weights, q, k, v, gate, out)                 a whole sequence from an
//           empty cache (training-style; allocates its own state).
//
// Shapes (spec 2): q [B,Hq,T,D], k [B,Hk,T,D], v [B,Hk,T,Dv], gate [B,Hk,T], out [B,T,Hq,Dv].
// Validation runs first; on error the state is untouched.

#include <cstdint>
#include <vector>

#include "kvmem/core/status.hpp"
#include "kvmem/core/tensor.hpp"
#include "kvmem/kvm/params.hpp"
#include "kvmem/kvm/state.hpp"
#include "kvmem/policy/budget.hpp"
#include "kvmem/policy/precision.hpp"

namespace kvmem::kvm {

// Test hook of spec 2: per update, the append list, merge targets and |S|.
struct UpdateRoute {
  std::int64_t first_token = 0;   // the update absorbs tokens [first_token, first_token + C)
  std::int64_t slots_before = 0;  // |S| before
  std::int64_t slots_after = 0;   // |S| after
  std::vector<std::int64_t> appended;  // absolute token ids, ascending
  std::vector<std::int64_t> target;    // [C]: merge target slot (>= sink) or -1 if appended
  // Decision margins (spec 2 test hooks), so tests can skip near-ties explicitly:
  double merge_margin = 1e300;   // smallest top1 - top2 merge logit kg . K^+_j over non-sink slots
  double append_margin = 1e300;  // gap at the append cut-off (n-th vs (n+1)-th smallest novelty score)
};
struct RouteLog {
  std::vector<std::vector<UpdateRoute>> items;  // [B*Hk], updates in order
};

// The shapes of one call of T tokens against the cache shape (spec 2); every backend checks them
// first. Layout (contiguity, strides) is each backend's own rule.
template <class In, class Out>
Status check_call_shapes(const Shape& sh,
                         const TensorView<const In, 4>& q,     // [B,Hq,T,D]
                         const TensorView<const In, 4>& k,     // [B,Hk,T,D]
                         const TensorView<const In, 4>& v,     // [B,Hk,T,Dv]
                         const TensorView<const In, 3>& gate,  // [B,Hk,T]
                         const TensorView<Out, 4>& out) {      // [B,T,Hq,Dv]
  const std::int64_t B = sh.B, T = q.extent(2);
  KVMEM_RETURN_IF_ERROR(check_shape(q, {B, sh.Hq, T, sh.D}, "q"));
  KVMEM_RETURN_IF_ERROR(check_shape(k, {B, sh.Hk, T, sh.D}, "k"));
  KVMEM_RETURN_IF_ERROR(check_shape(v, {B, sh.Hk, T, sh.Dv}, "v"));
  KVMEM_RETURN_IF_ERROR(check_shape(gate, {B, sh.Hk, T}, "gate"));
  return check_shape(out, {B, T, sh.Hq, sh.Dv}, "out");
}

// Customisation point: backends specialise Backend<Executor> with static prefill().
template <class Executor>
struct Backend;

template <class Executor, class S, class A, class In, class Out>
Status prefill(const Executor& exec, State<S, A>& state, const Weights& weights,
               TensorView<const In, 4> q,     // [B,Hq,T,D]
               TensorView<const In, 4> k,     // [B,Hk,T,D]
               TensorView<const In, 4> v,     // [B,Hk,T,Dv]
               TensorView<const In, 3> gate,  // [B,Hk,T]
               TensorView<Out, 4> out,        // [B,T,Hq,Dv]
               const std::int64_t* lengths = nullptr,  // [B], each <= T; nullptr: all T
               RouteLog* log = nullptr) {
  return Backend<Executor>::prefill(exec, state, weights, q, k, v, gate, out, lengths, log);
}

// One token per sequence. `active` [B] (0/1, nullptr: all) lets an engine step a subset.
template <class Executor, class S, class A, class In, class Out>
Status decode(const Executor& exec, State<S, A>& state, const Weights& weights,
              TensorView<const In, 4> q,     // [B,Hq,1,D]
              TensorView<const In, 4> k,     // [B,Hk,1,D]
              TensorView<const In, 4> v,     // [B,Hk,1,Dv]
              TensorView<const In, 3> gate,  // [B,Hk,1]
              TensorView<Out, 4> out,        // [B,1,Hq,Dv]
              const std::int64_t* active = nullptr, RouteLog* log = nullptr) {
  if (q.extent(2) != 1) return invalid_argument("decode q tokens", 1, q.extent(2));
  return Backend<Executor>::prefill(exec, state, weights, q, k, v, gate, out, active, log);
}

// Whole sequences from an empty cache, storage type S (training-style forward).
template <class S = float, class A = float, class Executor, class In, class Out>
Status forward(const Executor& exec, const Params& params, const Weights& weights,
               TensorView<const In, 4> q,     // [B,Hq,T,D]
               TensorView<const In, 4> k,     // [B,Hk,T,D]
               TensorView<const In, 4> v,     // [B,Hk,T,Dv]
               TensorView<const In, 3> gate,  // [B,Hk,T]
               TensorView<Out, 4> out,        // [B,T,Hq,Dv]
               const std::int64_t* lengths = nullptr) {
  const Shape shape{q.extent(0), q.extent(1), k.extent(1), q.extent(3), v.extent(3),
                    q.extent(2) > 0 ? q.extent(2) : 1};
  using StateType = State<S, A>;
  StateType state;
  KVMEM_RETURN_IF_ERROR(StateType::create(params, shape, state));
  return prefill(exec, state, weights, q, k, v, gate, out, lengths);
}

// Compile-time composition (DESIGN.md 2): kvm::Attention<budget::Power{16.0, 0.5, 256},
// precision::Bf16Storage>. The budget is checked at compile time; the rest of Params (chunk,
// window, flags) stays a runtime value with the spec's defaults.
template <auto Budget, PrecisionPolicy Precision = precision::Fp32Storage>
struct Attention {
  static constexpr auto kBudget = budget::checked<Budget>();
  using precision_type = Precision;
  using storage_type = typename Precision::storage_type;
  using accumulate_type = typename Precision::accumulate_type;
  using state_type = State<storage_type, accumulate_type>;

  Params params{};

  Attention() { params.budget = budget::Any(kBudget); }
  explicit Attention(Params p) : params(p) { params.budget = budget::Any(kBudget); }

  [[nodiscard]] Status make_state(const Shape& shape, state_type& out) const {
    return state_type::create(params, shape, out);
  }
  [[nodiscard]] std::size_t state_bytes(const Shape& shape) const { return state_type::bytes_required(params, shape); }

  template <class Executor, class In, class Out>
  Status prefill(const Executor& exec, state_type& state, const Weights& w, TensorView<const In, 4> q,
                 TensorView<const In, 4> k, TensorView<const In, 4> v, TensorView<const In, 3> gate,
                 TensorView<Out, 4> out, const std::int64_t* lengths = nullptr) const {
    return kvm::prefill(exec, state, w, q, k, v, gate, out, lengths);
  }
  template <class Executor, class In, class Out>
  Status decode(const Executor& exec, state_type& state, const Weights& w, TensorView<const In, 4> q,
                TensorView<const In, 4> k, TensorView<const In, 4> v, TensorView<const In, 3> gate,
                TensorView<Out, 4> out, const std::int64_t* active = nullptr) const {
    return kvm::decode(exec, state, w, q, k, v, gate, out, active);
  }
};

}  // namespace kvmem::kvm
