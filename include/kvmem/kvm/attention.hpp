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
//   step   (exec, state, weights, rows, q, k, v, gate, out [, lse, log]) ragged rows over sequence
//           slots (core/slots.hpp): row r advances slot[r] by its tokens, padding rows are skipped.
//   reset_slots, copy_slots, export_bytes, export_slot, import_slot, truncate: the slot operations
//           (docs/slots.md).
//   can_run(exec, problem)  whether the backend runs a problem, or why not; the sizes an engine
//           allocates come from kvm/state.hpp (state_layout, state_bytes, workspace_bytes; docs/memory.md).
//
// Shapes (spec 2): q [B,Hq,T,D], k [B,Hk,T,D], v [B,Hk,T,Dv], gate [B,Hk,T], out [B,T,Hq,Dv];
// a step's inputs are packed token-major: q [tokens,Hq,D], k [tokens,Hk,D], v [tokens,Hk,Dv],
// gate [tokens,Hk], out [tokens,Hq,Dv], lse [tokens,Hq]. B is the state's slot count (max_slots).
// Validation runs first; on error the state is untouched.

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "kvmem/core/slots.hpp"
#include "kvmem/core/status.hpp"
#include "kvmem/core/support.hpp"
#include "kvmem/core/tensor.hpp"
#include "kvmem/kvm/params.hpp"
#include "kvmem/kvm/record.hpp"
#include "kvmem/kvm/state.hpp"
#include "kvmem/policy/budget.hpp"
#include "kvmem/policy/precision.hpp"

namespace kvmem::kvm {

// Test hook of spec 2: per update, the append list, merge targets and |S|.
struct UpdateRoute {
  std::int64_t first_token = 0;        // the update absorbs tokens [first_token, first_token + C)
  std::int64_t slots_before = 0;       // |S| before
  std::int64_t slots_after = 0;        // |S| after
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
Status check_call_shapes(const Shape& sh, const TensorView<const In, 4>& q,  // [B,Hq,T,D]
                         const TensorView<const In, 4>& k,                   // [B,Hk,T,D]
                         const TensorView<const In, 4>& v,                   // [B,Hk,T,Dv]
                         const TensorView<const In, 3>& gate,                // [B,Hk,T]
                         const TensorView<Out, 4>& out) {                    // [B,T,Hq,Dv]
  const std::int64_t B = sh.B, T = q.extent(2);
  KVMEM_RETURN_IF_ERROR(check_shape(q, {B, sh.Hq, T, sh.D}, "q"));
  KVMEM_RETURN_IF_ERROR(check_shape(k, {B, sh.Hk, T, sh.D}, "k"));
  KVMEM_RETURN_IF_ERROR(check_shape(v, {B, sh.Hk, T, sh.Dv}, "v"));
  KVMEM_RETURN_IF_ERROR(check_shape(gate, {B, sh.Hk, T}, "gate"));
  return check_shape(out, {B, T, sh.Hq, sh.Dv}, "out");
}

// Customisation point (DESIGN.md 3): each backend specialises Backend<Executor> with
//   template <class S, class A> using state_type;  the state of that backend's memory (host and Kokkos:
//                                                  kvm::State; CUDA: cuda::KvmState)
//   using weights_type;                             its learned parameters (kvm::Weights; cuda::KvmWeights)
// and static prefill, step, reset_slots, copy_slots, export_slot, import_slot, truncate (optionally
// can_run). The functions below are the one public signature; a backend never changes it, it only
// refuses with a Status what it cannot do (for example a RouteLog on a backend that keeps none).
template <class Executor>
struct Backend;

// The state and weights types of `Executor`'s backend, so engine code written once names them:
// kvm::state_t<cuda::Executor, bf16> is cuda::KvmState<bf16, float>.
template <class Executor, class S, class A = float>
using state_t = typename Backend<Executor>::template state_type<S, A>;
template <class Executor>
using weights_t = typename Backend<Executor>::weights_type;

// Whether `exec`'s backend runs `problem`: ok, or a Status with the reason (invalid parameters or
// shape first, then what the backend itself cannot do, when it says so through a static
// Backend<Executor>::can_run(problem)). Sizes come from state_layout / workspace_bytes (kvm/state.hpp).
template <class Executor>
Status can_run(const Executor& /*exec*/, const Problem& problem) {
  KVMEM_RETURN_IF_ERROR(validate(problem.params, problem.shape));
  if constexpr (requires { Backend<Executor>::can_run(problem); })
    return Backend<Executor>::can_run(problem);
  else
    return Status::ok();
}

template <class Executor, class St, class In, class Out>
Status prefill(const Executor& exec, St& state, const weights_t<Executor>& weights,
               TensorView<const In, 4> q,              // [B,Hq,T,D]
               TensorView<const In, 4> k,              // [B,Hk,T,D]
               TensorView<const In, 4> v,              // [B,Hk,T,Dv]
               TensorView<const In, 3> gate,           // [B,Hk,T]
               TensorView<Out, 4> out,                 // [B,T,Hq,Dv]
               const std::int64_t* lengths = nullptr,  // [B], each <= T; nullptr: all T
               RouteLog* log = nullptr) {
  return Backend<Executor>::prefill(exec, state, weights, q, k, v, gate, out, lengths, log);
}

// One token per sequence. `active` [B] (0/1, nullptr: all) lets an engine step a subset.
template <class Executor, class St, class In, class Out>
Status decode(const Executor& exec, St& state, const weights_t<Executor>& weights,
              TensorView<const In, 4> q,     // [B,Hq,1,D]
              TensorView<const In, 4> k,     // [B,Hk,1,D]
              TensorView<const In, 4> v,     // [B,Hk,1,Dv]
              TensorView<const In, 3> gate,  // [B,Hk,1]
              TensorView<Out, 4> out,        // [B,1,Hq,Dv]
              const std::int64_t* active = nullptr, RouteLog* log = nullptr) {
  if (q.extent(2) != 1) return invalid_argument("decode q tokens", 1, q.extent(2));
  return Backend<Executor>::prefill(exec, state, weights, q, k, v, gate, out, active, log);
}

// One step over sequence slots (DESIGN.md 3, core/slots.hpp). Row r runs the packed tokens
// [query_start[r], query_start[r+1]) of the sequence in slot[r] (0 tokens allowed), exactly as a
// prefill of those tokens on that sequence alone would (same operations in the same order, so the
// results are bitwise equal); a padding row (slot -1) is skipped and its out and lse rows are zeroed.
// lse (optional; an empty view is not written) is the natural log-sum-exp of each query row's scaled
// logits over state and window, so partial results merge exactly (core/softmax.hpp). Validation
// (rows, shapes, n_ctx of every slot, finite inputs, gate > 0) runs first; on error nothing changed.
// A RouteLog gets one entry per (slot, KV head): log->items[slot * Hk + g].
template <class Executor, class St, class In, class Out>
Status step(const Executor& exec, St& state, const weights_t<Executor>& weights, const Rows& rows,
            TensorView<const In, 3> q,      // [tokens,Hq,D]
            TensorView<const In, 3> k,      // [tokens,Hk,D]
            TensorView<const In, 3> v,      // [tokens,Hk,Dv]
            TensorView<const In, 2> gate,   // [tokens,Hk]
            TensorView<Out, 3> out,         // [tokens,Hq,Dv]
            TensorView<float, 2> lse = {},  // [tokens,Hq] or empty
            RouteLog* log = nullptr) {
  return Backend<Executor>::step(exec, state, weights, rows, q, k, v, gate, out, lse, log);
}

// ---- slot operations (docs/slots.md); every slot index is checked, a refused call changes nothing ----

// Forgets the sequences in `slots` (n = cov = |S| = 0). slots: [n], each in [0, max_slots).
template <class Executor, class St>
Status reset_slots(const Executor& exec, St& state, TensorView<const std::int32_t, 1> slots) {
  return Backend<Executor>::reset_slots(exec, state, slots);
}

// Fork: slot dst[i] becomes a copy of slot src[i] (counters, memory slots, window), so it continues
// bit for bit like its source. src, dst: [n]; destinations distinct and none of them another pair's
// source (core/slots.hpp check_copy_pairs).
template <class Executor, class St>
Status copy_slots(const Executor& exec, St& state, TensorView<const std::int32_t, 1> src,
                  TensorView<const std::int32_t, 1> dst) {
  return Backend<Executor>::copy_slots(exec, state, src, dst);
}

// Exports the sequence in `slot` as a slot record (core/slots.hpp format, mechanism KVM). Fields,
// in order (i64 unless noted; arrays over KV heads g = 0..Hk-1, rows in slot / position order):
//   parameters checked on import: chunk, window_chunks, sink, rope_dims, budget_kind (0 fixed,
//     1 power, 2 saturating, 3 user: budget_minimum then holds budget::Any::fingerprint()),
//     budget_minimum, budget_maximum, budget_round_down, budget_factor (f64), budget_exponent (f64),
//     budget_saturation (f64) (values a budget kind lacks are 0), flags (bit 0 merge_gate_keys,
//     1 merge_gate_values, 2 head_temps, 3 value_radius, 4 gate_appends, 5 gate_initial), ln_eps (f64),
//     scale (f64), Hq, Hk, D, Dv, storage (0 fp32, 1 bf16, 2 fp16, 3 fp8 e4m3; a record imports only
//     into a state of its storage type);
//   counters: n (tokens seen), cov (tokens summarised), slots (|S|);
//   state (accumulate type, f32 or f64): sk [Hk,|S|,D], sv [Hk,|S|,Dv], rho [Hk,|S|], cnt [Hk,|S|];
//   window, positions [bswa_begin(n), n) (spec 4.1; f32, exact for the window's type: bf16 for fp8 storage):
//     window_k [Hk,w,D], window_v [Hk,w,Dv], window_g [Hk,w] (accumulate type).
// The readout copies K^ = LN_s(Sk), V^ are derived and not exported; import_slot rebuilds them.
// `bytes` must hold at least export_bytes(state, slot); exactly that many bytes are written at its front.
template <class Executor, class St>
Status export_slot(const Executor& exec, const St& state, std::int32_t slot, std::span<std::byte> bytes) {
  return Backend<Executor>::export_slot(exec, state, slot, bytes);
}

// Imports a record written by export_slot (any backend) into `slot`, replacing what it held. The
// record's version, mechanism and every parameter and shape field must equal the importing state's
// (else a Status naming the field), and the state's n_ctx must hold its n tokens. The readout copies
// are rebuilt from Sk, Sv with `weights` (the LN_s affine the sequence is read with). `bytes` is the
// record, exactly export_bytes(source, slot) long.
template <class Executor, class St>
Status import_slot(const Executor& exec, St& state, const weights_t<Executor>& weights, std::int32_t slot,
                   std::span<const std::byte> bytes) {
  return Backend<Executor>::import_slot(exec, state, weights, slot, bytes);
}

// Drops the last n tokens of the sequence in `slot`. Exact (the slot then equals a sequence that
// never saw them) when every dropped token is still only in the window or founded an initial slot
// of its own (spec 4.3), and the window keeps every position a later token reads; otherwise
// (a state update absorbed part of them, spec 4.5, or the window no longer holds what the shorter
// sequence reads) the call is refused with a Status that says which, and nothing changes.
template <class Executor, class St>
Status truncate(const Executor& exec, St& state, std::int32_t slot, std::int64_t n) {
  return Backend<Executor>::truncate(exec, state, slot, n);
}

// Whole sequences from an empty cache, storage type S (training-style forward).
template <class S = float, class A = float, class Executor, class In, class Out>
Status forward(const Executor& exec, const Params& params, const weights_t<Executor>& weights,
               TensorView<const In, 4> q,     // [B,Hq,T,D]
               TensorView<const In, 4> k,     // [B,Hk,T,D]
               TensorView<const In, 4> v,     // [B,Hk,T,Dv]
               TensorView<const In, 3> gate,  // [B,Hk,T]
               TensorView<Out, 4> out,        // [B,T,Hq,Dv]
               const std::int64_t* lengths = nullptr) {
  const Shape shape{q.extent(0), q.extent(1), k.extent(1), q.extent(3), v.extent(3), q.extent(2) > 0 ? q.extent(2) : 1};
  using StateType = state_t<Executor, S, A>;
  StateType state;
  KVMEM_RETURN_IF_ERROR(StateType::create(params, shape, state));
  return prefill(exec, state, weights, q, k, v, gate, out, lengths);
}

namespace detail {
// A composed variant's calls: the backend's overload that takes the variant's fixed head dims
// (HeadDims<D, Dv> before the executor) when it has one (CUDA/HIP: only the kernels of those dims are
// instantiated, core/support.hpp), else the plain operation.
template <std::int64_t D, std::int64_t Dv, class Executor, class St, class W, class In, class Out>
Status prefill_dims(const Executor& exec, St& state, const W& w, TensorView<const In, 4> q, TensorView<const In, 4> k,
                    TensorView<const In, 4> v, TensorView<const In, 3> gate, TensorView<Out, 4> out,
                    const std::int64_t* lengths) {
  RouteLog* const log = nullptr;
  if constexpr (D != kAnyDim && requires {
                  Backend<Executor>::prefill(HeadDims<D, Dv>{}, exec, state, w, q, k, v, gate, out, lengths, log);
                })
    return Backend<Executor>::prefill(HeadDims<D, Dv>{}, exec, state, w, q, k, v, gate, out, lengths, log);
  else
    return kvm::prefill(exec, state, w, q, k, v, gate, out, lengths, log);
}
template <std::int64_t D, std::int64_t Dv, class Executor, class St, class W, class In, class Out>
Status decode_dims(const Executor& exec, St& state, const W& w, TensorView<const In, 4> q, TensorView<const In, 4> k,
                   TensorView<const In, 4> v, TensorView<const In, 3> gate, TensorView<Out, 4> out,
                   const std::int64_t* active) {
  if (q.extent(2) != 1) return invalid_argument("decode q tokens", 1, q.extent(2));
  return prefill_dims<D, Dv>(exec, state, w, q, k, v, gate, out, active);
}
template <std::int64_t D, std::int64_t Dv, class Executor, class St, class W, class In, class Out>
Status step_dims(const Executor& exec, St& state, const W& w, const Rows& rows, TensorView<const In, 3> q,
                 TensorView<const In, 3> k, TensorView<const In, 3> v, TensorView<const In, 2> gate,
                 TensorView<Out, 3> out, TensorView<float, 2> lse) {
  RouteLog* const log = nullptr;
  if constexpr (D != kAnyDim && requires {
                  Backend<Executor>::step(HeadDims<D, Dv>{}, exec, state, w, rows, q, k, v, gate, out, lse, log);
                })
    return Backend<Executor>::step(HeadDims<D, Dv>{}, exec, state, w, rows, q, k, v, gate, out, lse, log);
  else
    return kvm::step(exec, state, w, rows, q, k, v, gate, out, lse, log);
}
}  // namespace detail

// Compile-time composition (DESIGN.md 2): kvm::Attention<budget::Power{16.0, 0.5, 256},
// precision::Bf16Storage>. The budget is any BudgetPolicy (the built-in three or a user type, checked
// at compile time; it sizes the state through its max_slots and drives every update through its
// slots()); the rest of Params (chunk, window, flags) stays a runtime value with the spec's defaults.
// HeadDim / ValueDim (default kAnyDim: chosen at run time) fix the head dims: make_state refuses other
// shapes, and a call on a backend whose kernels cannot take them does not compile (core/support.hpp).
template <auto Budget, PrecisionPolicy Precision = precision::Fp32Storage, std::int64_t HeadDim = kAnyDim,
          std::int64_t ValueDim = HeadDim>
struct Attention {
  static constexpr auto kBudget = budget::checked<Budget>();
  static constexpr std::int64_t kHeadDim = HeadDim;
  static constexpr std::int64_t kValueDim = ValueDim;
  static_assert(HeadDim >= 0 && ValueDim >= 0, "kvmem::kvm::Attention: head dims are > 0 (or kAnyDim)");
  using budget_type = std::remove_cvref_t<decltype(kBudget)>;
  using precision_type = Precision;
  using storage_type = typename Precision::storage_type;
  using accumulate_type = typename Precision::accumulate_type;
  using state_type = State<storage_type, accumulate_type>;

  Params params{};

  Attention() { params.budget = budget::Any(kBudget); }
  explicit Attention(Params p) : params(p) { params.budget = budget::Any(kBudget); }

  // Ok when `shape` has the variant's fixed head dims (any, for kAnyDim).
  [[nodiscard]] static Status check_dims(const Shape& shape) {
    if (HeadDim != kAnyDim && shape.D != HeadDim)
      return invalid_argument("D", "the variant's head dim " + std::to_string(HeadDim), shape.D);
    if (ValueDim != kAnyDim && shape.Dv != ValueDim)
      return invalid_argument("Dv", "the variant's value head dim " + std::to_string(ValueDim), shape.Dv);
    return Status::ok();
  }
  // A state of this variant for `shape`: the host's State (state_type), or another backend's state
  // with a static create(params, shape, out) (state_t<cuda::Executor, storage_type, accumulate_type>).
  template <class St = state_type>
  [[nodiscard]] Status make_state(const Shape& shape, St& out) const {
    KVMEM_RETURN_IF_ERROR(check_dims(shape));
    return St::create(params, shape, out);
  }
  // Persistent bytes of a state for `shape` (kvm::state_bytes), and the per-step workspace (kvm::workspace_bytes).
  [[nodiscard]] std::size_t state_bytes(const Shape& shape) const {
    return kvm::state_bytes<storage_type, accumulate_type>({params, shape});
  }
  [[nodiscard]] std::size_t workspace_bytes(const Shape& shape, const Limits& limits = {}) const {
    return kvm::workspace_bytes<storage_type, accumulate_type>({params, shape}, limits);
  }

  // The operations on any backend (kvm::prefill, decode, step): the state and weights of the executor's
  // backend (state_t / weights_t: host and Kokkos kvm::State and Weights, CUDA cuda::KvmState and
  // cuda::KvmWeights). A call on a backend whose kernels cannot take the variant does not compile.
  template <class Executor, class In, class Out>
  Status prefill(const Executor& exec, state_t<Executor, storage_type, accumulate_type>& state,
                 const weights_t<Executor>& w, TensorView<const In, 4> q, TensorView<const In, 4> k,
                 TensorView<const In, 4> v, TensorView<const In, 3> gate, TensorView<Out, 4> out,
                 const std::int64_t* lengths = nullptr) const {
    static_assert(check_kvm_support<Executor, storage_type, accumulate_type, HeadDim, ValueDim>());
    return detail::prefill_dims<HeadDim, ValueDim>(exec, state, w, q, k, v, gate, out, lengths);
  }
  template <class Executor, class In, class Out>
  Status decode(const Executor& exec, state_t<Executor, storage_type, accumulate_type>& state,
                const weights_t<Executor>& w, TensorView<const In, 4> q, TensorView<const In, 4> k,
                TensorView<const In, 4> v, TensorView<const In, 3> gate, TensorView<Out, 4> out,
                const std::int64_t* active = nullptr) const {
    static_assert(check_kvm_support<Executor, storage_type, accumulate_type, HeadDim, ValueDim>());
    return detail::decode_dims<HeadDim, ValueDim>(exec, state, w, q, k, v, gate, out, active);
  }
  template <class Executor, class In, class Out>
  Status step(const Executor& exec, state_t<Executor, storage_type, accumulate_type>& state,
              const weights_t<Executor>& w, const Rows& rows, TensorView<const In, 3> q, TensorView<const In, 3> k,
              TensorView<const In, 3> v, TensorView<const In, 2> gate, TensorView<Out, 3> out,
              TensorView<float, 2> lse = {}) const {
    static_assert(check_kvm_support<Executor, storage_type, accumulate_type, HeadDim, ValueDim>());
    return detail::step_dims<HeadDim, ValueDim>(exec, state, w, rows, q, k, v, gate, out, lse);
  }
};

}  // namespace kvmem::kvm
