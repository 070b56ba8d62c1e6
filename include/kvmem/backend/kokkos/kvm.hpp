// SPDX-License-Identifier: Apache-2.0
#pragma once
// KVM on Kokkos: kvm::Backend<kokkos::Executor<Space>>, so kvm::prefill / kvm::decode / kvm::forward
// run on any execution space with the shared kernel bodies (kernel/attend.hpp, kernel/kvm_state.hpp).
//
// One team per (sequence, KV head) item runs the item's whole token range, exactly like the host
// driver (backend/host/kvm.hpp) and in the same order: per chunk segment, the pending state update
// (one thread: routing is a sequential scan over slots, spec 4.5), then the window ring and initial
// slots (one thread), then the segment's query rows spread over the team's threads (a row owns its
// online softmax and visits the same key tiles as on the host, so results are bitwise equal to the
// host backend's and decode == prefill holds exactly). |S| after an update is data independent
// (spec 3.1) and every thread computes it from the budget, so no broadcast is needed.
//
// Team scratch is not used here: each row's q copy, accumulator and softmax state come from the State's
// per-item workspace (already in the space's memory), and staging a kAttendTile-row K/V tile would take
// 64 (D + Dv) sizeof(S) = 64 KB for D = Dv = 128 fp32, over the ~40 KB level-0 cap on CUDA (DESIGN.md 4).
//
// Launch sequence of one call, all on exec.space (in order, no host round trip in between):
//   [checked] one reduction over sequences (lengths, n_ctx, finite inputs, gate > 0) read back;
//   weights -> state (ln_w, ln_b, tau_s, tau_w in Acc); the item teams; the per-sequence counter fold.
// The per-sequence counters (n, cov, |S|) and lengths are read inside the kernels only.
//
// State memory: the State must be placed over memory the space can access AND the host can write,
// because State::place/reset (kvm/state.hpp) zero the counters from the host. create_state() below
// allocates a Kokkos::View in such a memory space (the space's own when it is host-accessible, e.g.
// Serial/OpenMP/Threads; pass a host-accessible device space such as CudaUVMSpace for Cuda).
// The route log (test hook) is the only path that copies back to the host and allocates.

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <new>
#include <string>
#include <type_traits>
#include <utility>

#include <Kokkos_Core.hpp>

#include "kvmem/backend/kokkos/device_view.hpp"
#include "kvmem/backend/kokkos/executor.hpp"
#include "kvmem/core/numeric.hpp"
#include "kvmem/core/softmax.hpp"
#include "kvmem/core/status.hpp"
#include "kvmem/core/tensor.hpp"
#include "kvmem/kernel/attend.hpp"
#include "kvmem/kernel/kvm_state.hpp"
#include "kvmem/kvm/attention.hpp"
#include "kvmem/kvm/params.hpp"
#include "kvmem/kvm/state.hpp"
#include "kvmem/policy/budget.hpp"

namespace kvmem::kokkos {

// A KVM State placed over a Kokkos allocation in MemSpace (owned by `memory`).
template <class S, class A, class MemSpace>
struct KvmState {
  Kokkos::View<unsigned char*, MemSpace> memory;
  kvm::State<S, A> state;
};

// Allocates State::bytes_required in MemSpace and places a State there. MemSpace must be accessible
// from Space (the kernels) and from the host (State::place zeroes the counters on the host).
template <class S = float, class A = float, class Space, class MemSpace = typename Executor<Space>::memory_space>
Status create_state(const Executor<Space>& /*exec*/, const kvm::Params& params, const kvm::Shape& shape,
                    KvmState<S, A, MemSpace>& out) {
  static_assert(Kokkos::SpaceAccessibility<Space, MemSpace>::accessible,
                "kvmem::kokkos::create_state: the execution space cannot access MemSpace");
  static_assert(Kokkos::SpaceAccessibility<Kokkos::HostSpace, MemSpace>::accessible,
                "kvmem::kokkos::create_state: kvm::State::place writes its counters from the host; use a "
                "host-accessible memory space (e.g. Kokkos::CudaUVMSpace for Cuda)");
  KVMEM_RETURN_IF_ERROR(kvm::validate(params, shape));
  const std::size_t bytes = kvm::State<S, A>::bytes_required(params, shape);
  constexpr std::size_t kAlign = kvm::State<S, A>::kAlign;
  KvmState<S, A, MemSpace> st;
  st.memory = Kokkos::View<unsigned char*, MemSpace>(Kokkos::view_alloc(Kokkos::WithoutInitializing, "kvmem kvm state"),
                                                     bytes + kAlign);
  const auto address = reinterpret_cast<std::uintptr_t>(st.memory.data());
  void* aligned = st.memory.data() + (kAlign - address % kAlign) % kAlign;
  KVMEM_RETURN_IF_ERROR((kvm::State<S, A>::place(aligned, bytes, params, shape, st.state)));
  out = std::move(st);
  return Status::ok();
}

namespace detail {

// ItemView of item 0 plus the element distance between consecutive items of every field, taken
// from State::item() on the host, so a kernel derives item i without calling host code.
template <class S, class A>
struct ItemTable {
  kvm::ItemView<S, A> base{};
  std::int64_t sk = 0, sv = 0, rho = 0, cnt = 0, khat = 0, vhat = 0, wk = 0, wv = 0, wg = 0, k0 = 0, kg = 0, vg = 0,
               score = 0, best = 0, target = 0, row = 0, qblock = 0, acc = 0, soft = 0;

  explicit ItemTable(const kvm::State<S, A>& st) : base(st.item(0, 0)) {
    const std::int64_t Hk = st.shape().Hk;
    if (st.shape().B * Hk < 2) return;
    const kvm::ItemView<S, A> next = st.item(1 / Hk, 1 % Hk);
    sk = next.sk - base.sk;
    sv = next.sv - base.sv;
    rho = next.rho - base.rho;
    cnt = next.cnt - base.cnt;
    khat = next.khat - base.khat;
    vhat = next.vhat - base.vhat;
    wk = next.wk - base.wk;
    wv = next.wv - base.wv;
    wg = next.wg - base.wg;
    k0 = next.k0 - base.k0;
    kg = next.kg - base.kg;
    vg = next.vg - base.vg;
    score = next.score - base.score;
    best = next.best - base.best;
    target = next.target - base.target;
    row = next.row - base.row;
    qblock = next.qblock - base.qblock;
    acc = next.acc - base.acc;
    soft = next.soft - base.soft;
  }
  KOKKOS_INLINE_FUNCTION kvm::ItemView<S, A> at(std::int64_t i) const {
    kvm::ItemView<S, A> v = base;
    v.sk += i * sk;
    v.sv += i * sv;
    v.rho += i * rho;
    v.cnt += i * cnt;
    v.khat += i * khat;
    v.vhat += i * vhat;
    v.wk += i * wk;
    v.wv += i * wv;
    v.wg += i * wg;
    v.k0 += i * k0;
    v.kg += i * kg;
    v.vg += i * vg;
    v.score += i * score;
    v.best += i * best;
    v.target += i * target;
    v.row += i * row;
    v.qblock += i * qblock;
    v.acc += i * acc;
    v.soft += i * soft;
    return v;
  }
};

// budget::Any::slots dispatches through a host lambda; this switch reaches the same KVMEM_HOST_DEVICE
// policy functions (policy/budget.hpp) from a kernel.
KOKKOS_INLINE_FUNCTION std::int64_t budget_slots(const budget::Any& b, std::int64_t tokens, std::int64_t avail,
                                                 std::int64_t current) {
  switch (b.kind) {
    case budget::Any::Kind::kPower:
      return b.power.slots(tokens, avail, current);
    case budget::Any::Kind::kSaturating:
      return b.saturating.slots(tokens, avail, current);
    case budget::Any::Kind::kFixed:
      break;
  }
  return b.fixed.slots(tokens, avail, current);
}

// Route log record of one update: first token, |S| before, |S| after, then C targets.
inline constexpr std::int64_t kRouteHeader = 3;

template <class S, class A, class In, class Out>
struct KvmCall {
  ItemTable<S, A> items;
  std::int64_t* n_seq;           // [B]
  std::int64_t* cov_seq;         // [B]
  std::int64_t* slots_seq;       // [B]
  std::int64_t* result;          // [B*Hk, 2]
  const A* ln_w;                 // [D]
  const A* ln_b;                 // [D]
  const A* tau_s;                // [Hq]
  const A* tau_w;                // [Hq]
  DeviceView<const In, 4> q;     // [B,Hq,T,D]
  DeviceView<const In, 4> k;     // [B,Hk,T,D]
  DeviceView<const In, 4> v;     // [B,Hk,T,Dv]
  DeviceView<const In, 3> gate;  // [B,Hk,T]
  DeviceView<Out, 4> out;        // [B,T,Hq,Dv]
  const std::int64_t* lengths;   // [B] or nullptr
  std::int64_t T, Hk, rep, D, Dv, n_ctx;
  std::int64_t C, nb, sink, rope_dims;
  budget::Any budget;
  bool merge_gate_keys, merge_gate_values, head_temps, value_radius, gate_appends, gate_initial;
  A eps, scale;
  std::int64_t* log;  // [B*Hk, log_stride] or nullptr
  std::int64_t log_stride;

  KOKKOS_INLINE_FUNCTION std::int64_t W() const { return C * nb; }
  // spec 4.1: first window position when n tokens exist, max(0, ceil(n/C) C - nb C).
  KOKKOS_INLINE_FUNCTION std::int64_t bswa_begin(std::int64_t tokens) const {
    const std::int64_t begin = (tokens + C - 1) / C * C - W();
    return begin > 0 ? begin : 0;
  }
  KOKKOS_INLINE_FUNCTION std::int64_t length(std::int64_t b) const { return lengths ? lengths[b] : T; }
  // The sizes of sequence b fit (also what the checked reduction rejects): otherwise the item is skipped.
  KOKKOS_INLINE_FUNCTION bool runnable(std::int64_t b) const {
    const std::int64_t len = length(b);
    return len >= 0 && len <= T && n_seq[b] + len <= n_ctx;
  }
  // |S| after the update absorbing [a, a + C) from `current` (spec 3.1; data independent).
  KOKKOS_INLINE_FUNCTION std::int64_t appends(std::int64_t a, std::int64_t current) const {
    const std::int64_t target = budget_slots(budget, W() + a, a + C, current);
    const std::int64_t n_app = target - current;
    return n_app < C ? n_app : C;
  }

  // K^_j = LN_s(Sk_j) and V^_j for slots [j0, j1) (spec 4.4 steps 1-2).
  KOKKOS_INLINE_FUNCTION void refresh(const kvm::ItemView<S, A>& it, std::int64_t j0, std::int64_t j1) const {
    for (std::int64_t j = j0; j < j1; ++j) {
      kernel::layer_norm(it.sk + j * D, D, ln_w, ln_b, eps, it.row);
      for (std::int64_t d = 0; d < D; ++d) it.khat[j * D + d] = store_as<S>(it.row[d]);
      kernel::value_readout(it.sv + j * Dv, Dv, it.rho[j], it.cnt[j], value_radius, it.vhat + j * Dv);
    }
  }

  // Spec 4.3: the token at ring slot `ring` founds slot j (rho from the raw v).
  KOKKOS_INLINE_FUNCTION void init_slot(const kvm::ItemView<S, A>& it, std::int64_t ring, std::int64_t j) const {
    A* sk = it.sk + j * D;
    A* sv = it.sv + j * Dv;
    kernel::preprocess_key(it.wk + ring * D, D, rope_dims, ln_w, ln_b, eps, sk);
    for (std::int64_t d = 0; d < Dv; ++d) sv[d] = load_as<A>(it.wv[ring * Dv + d]);
    it.rho[j] = kernel::norm2<A>(sv, Dv);
    it.cnt[j] = A(1);
    if (gate_initial) {  // each gated only when its merge gate flag is on (spec 4.2)
      const A g = it.wg[ring];
      if (merge_gate_keys)
        for (std::int64_t d = 0; d < D; ++d) sk[d] *= g;
      if (merge_gate_values)
        for (std::int64_t d = 0; d < Dv; ++d) sv[d] *= g;
    }
    refresh(it, j, j + 1);
  }

  // Spec 4.5: U(tokens [a, a + C) read from the ring). One thread. Returns the new |S|.
  KOKKOS_INLINE_FUNCTION std::int64_t update(const kvm::ItemView<S, A>& it, std::int64_t a, std::int64_t S_cur,
                                             std::int64_t* route) const {
    const std::int64_t w = W();
    for (std::int64_t i = 0; i < C; ++i) {  // step 1: k0, kg, vg
      const std::int64_t ring = (a + i) % w;
      const A g = it.wg[ring];
      kernel::preprocess_key(it.wk + ring * D, D, rope_dims, ln_w, ln_b, eps, it.k0 + i * D);
      for (std::int64_t d = 0; d < D; ++d) it.kg[i * D + d] = merge_gate_keys ? g * it.k0[i * D + d] : it.k0[i * D + d];
      for (std::int64_t d = 0; d < Dv; ++d) {
        const A x = load_as<A>(it.wv[ring * Dv + d]);
        it.vg[i * Dv + d] = merge_gate_values ? g * x : x;
      }
    }
    const std::int64_t n_app = appends(a, S_cur);
    if (n_app > 0) {  // step 2: novelty against the pre-update state, ungated k0, sink included
      for (std::int64_t i = 0; i < C; ++i) it.score[i] = negative_infinity<A>();
      for (std::int64_t j = 0; j < S_cur; ++j) {
        kernel::layer_norm(it.sk + j * D, D, ln_w, ln_b, eps, it.row);
        kernel::novelty_update(it.k0, C, D, it.row, it.score);
      }
      kernel::select_appends(it.score, C, n_app, it.target);
    } else {
      for (std::int64_t i = 0; i < C; ++i) it.target[i] = 0;
    }
    std::int64_t S_new = S_cur;  // step 3: appends in increasing token order
    for (std::int64_t i = 0; i < C; ++i) {
      if (it.target[i] != -1) continue;
      const std::int64_t j = S_new++;
      const std::int64_t ring = (a + i) % w;
      A* sk = it.sk + j * D;
      A* sv = it.sv + j * Dv;
      for (std::int64_t d = 0; d < D; ++d) sk[d] = gate_appends ? it.kg[i * D + d] : it.k0[i * D + d];
      for (std::int64_t d = 0; d < Dv; ++d) sv[d] = gate_appends ? it.vg[i * Dv + d] : load_as<A>(it.wv[ring * Dv + d]);
      it.rho[j] = kernel::norm2<A>(sv, Dv);
      it.cnt[j] = A(1);
    }
    if (n_app < C) {  // step 4: route against K^+ of the expanded state, then one scatter
      for (std::int64_t j = sink; j < S_new; ++j) {
        kernel::layer_norm(it.sk + j * D, D, ln_w, ln_b, eps, it.row);
        kernel::merge_route_update(it.kg, C, D, it.row, j, it.best, it.target, j == sink);
      }
      for (std::int64_t j = sink; j < S_new; ++j)
        kernel::scatter_into_slot(it.kg, it.vg, it.target, C, D, Dv, j, it.sk + j * D, it.sv + j * Dv, it.cnt + j);
    }
    if (route != nullptr) {
      route[0] = a;
      route[1] = S_cur;
      route[2] = S_new;
      for (std::int64_t i = 0; i < C; ++i) route[kRouteHeader + i] = it.target[i];
    }
    refresh(it, sink, S_new);
    return S_new;
  }

  // One query row r of the segment [t0, t1) of item (b, g): the state (if w > 0) and the causal
  // window [w, t], in the host backend's tile order (bitwise equal results).
  KOKKOS_INLINE_FUNCTION void attend_row(const kvm::ItemView<S, A>& it, std::int64_t b, std::int64_t g, std::int64_t n0,
                                         std::int64_t t0, std::int64_t w, std::int64_t S_cur, std::int64_t r) const {
    const std::int64_t t = t0 + r / rep, h = g * rep + r % rep, w_len = W();
    A* qr = it.qblock + r * D;
    A* acc = it.acc + r * Dv;
    for (std::int64_t d = 0; d < D; ++d) qr[d] = load_as<A>(q(b, h, t - n0, d));
    for (std::int64_t d = 0; d < Dv; ++d) acc[d] = A(0);
    OnlineSoftmax<A>* sm = new (it.soft + r) OnlineSoftmax<A>();
    const std::int64_t tile = kernel::kAttendTile;
    if (w > 0) {  // every slot, no mask (spec 4.1 step 2)
      const A ls = scale * (head_temps ? tau_s[h] : A(1));
      for (std::int64_t j0 = 0; j0 < S_cur; j0 += tile) {
        const std::int64_t n = (S_cur - j0) < tile ? (S_cur - j0) : tile;
        kernel::attend_accumulate(*sm, acc, qr, D, ls, it.khat + j0 * D, D, it.vhat + j0 * Dv, Dv, Dv, n);
      }
    }
    // window [w, t]: tiles start at w and at ring wraps (same tiles in prefill and decode)
    const A lw = scale * (head_temps ? tau_w[h] : A(1));
    for (std::int64_t a = w; a <= t;) {
      const std::int64_t wrap = (a / w_len + 1) * w_len;
      std::int64_t e = a + tile;
      if (wrap < e) e = wrap;
      if (t + 1 < e) e = t + 1;
      const std::int64_t ring = a % w_len;
      kernel::attend_accumulate(*sm, acc, qr, D, lw, it.wk + ring * D, D, it.wv + ring * Dv, Dv, Dv, e - a);
      a = e;
    }
    const A inv = sm->normaliser();
    for (std::int64_t d = 0; d < Dv; ++d) out(b, t - n0, h, d) = static_cast<Out>(acc[d] * inv);
  }

  template <class Member>
  KOKKOS_INLINE_FUNCTION void operator()(const Member& team) const {
    const std::int64_t i = team.league_rank();
    const std::int64_t b = i / Hk, g = i % Hk;
    if (!runnable(b)) return;  // rejected sizes (checked = false): the item and its counters stay untouched
    const std::int64_t len = length(b), n0 = n_seq[b], w_len = W();
    const kvm::ItemView<S, A> it = items.at(i);
    std::int64_t cov = cov_seq[b], S_cur = slots_seq[b];
    std::int64_t* item_log = log ? log + i * log_stride : nullptr;
    for (std::int64_t t0 = n0; t0 < n0 + len;) {
      const std::int64_t chunk_end = (t0 / C + 1) * C;
      const std::int64_t t1 = n0 + len < chunk_end ? n0 + len : chunk_end;
      const std::int64_t w = bswa_begin(t0 + 1);
      const bool updating = cov < w;  // spec 4.7 step 4: first token of a new chunk, before attention
      const std::int64_t a = cov;
      const std::int64_t S_before = S_cur;
      Kokkos::single(Kokkos::PerTeam(team), [&]() {
        if (updating) {
          std::int64_t* route = nullptr;
          if (item_log != nullptr) route = item_log + 1 + item_log[0]++ * (kRouteHeader + C);
          update(it, a, S_before, route);
        }
        std::int64_t c = updating ? a + C : a, s = updating ? S_before + appends(a, S_before) : S_before;
        for (std::int64_t t = t0; t < t1; ++t) {  // window ring; initial slots below position C (spec 4.3)
          const std::int64_t ring = t % w_len;
          for (std::int64_t d = 0; d < D; ++d) it.wk[ring * D + d] = store_as<S>(load_as<A>(k(b, g, t - n0, d)));
          for (std::int64_t d = 0; d < Dv; ++d) it.wv[ring * Dv + d] = store_as<S>(load_as<A>(v(b, g, t - n0, d)));
          it.wg[ring] = load_as<A>(gate(b, g, t - n0));
          if (t < C && t >= c) {
            init_slot(it, ring, s++);
            c = t + 1;
          }
        }
      });
      // Every thread tracks cov and |S| itself: both follow from sizes and the budget alone.
      if (updating) {
        S_cur += appends(a, S_cur);
        cov += C;
      }
      for (std::int64_t t = t0; t < t1; ++t)
        if (t < C && t >= cov) {
          ++S_cur;
          cov = t + 1;
        }
      team.team_barrier();  // ring, slots and K^/V^ are complete before any row reads them
      const std::int64_t rows = (t1 - t0) * rep;
      const std::int64_t S_now = S_cur;
      Kokkos::parallel_for(Kokkos::TeamThreadRange(team, rows),
                           [&](const std::int64_t r) { attend_row(it, b, g, n0, t0, w, S_now, r); });
      team.team_barrier();  // rows finish reading before the next segment changes the ring or state
      t0 = t1;
    }
    const std::int64_t tail = (out.extent[1] - len) * rep * Dv;  // rows past this sequence's length: zeros
    Kokkos::parallel_for(Kokkos::TeamThreadRange(team, tail > 0 ? tail : 0), [&](const std::int64_t x) {
      const std::int64_t t = len + x / (rep * Dv), h = g * rep + (x / Dv) % rep, d = x % Dv;
      out(b, t, h, d) = Out(0);
    });
    Kokkos::single(Kokkos::PerTeam(team), [&]() {
      result[2 * i] = cov;
      result[2 * i + 1] = S_cur;
    });
  }
};

// The checked reduction: the smallest failure code * B + b over sequences, or `none`.
enum class KvmCheck : std::int64_t { kLength = 1, kContext, kQ, kK, kV, kGate, kWeights };

}  // namespace detail
}  // namespace kvmem::kokkos

namespace kvmem::kvm {

template <class Space>
struct Backend<kokkos::Executor<Space>> {
  template <class S, class A, class In, class Out>
  static Status prefill(const kokkos::Executor<Space>& exec, State<S, A>& state, const Weights& weights,
                        TensorView<const In, 4> q,     // [B,Hq,T,D]
                        TensorView<const In, 4> k,     // [B,Hk,T,D]
                        TensorView<const In, 4> v,     // [B,Hk,T,Dv]
                        TensorView<const In, 3> gate,  // [B,Hk,T]
                        TensorView<Out, 4> out,        // [B,T,Hq,Dv]
                        const std::int64_t* lengths,   // [B] in memory Space can read, or nullptr
                        RouteLog* log) {
    using namespace kokkos::detail;
    // ---- validation of sizes on the host; nothing changes before every check passed ----
    if (!state.valid()) return invalid_argument("state", "a created or placed State", "an empty State");
    const Shape& sh = state.shape();
    const Params& pr = state.params();
    const std::int64_t B = sh.B, T = q.extent(2);
    KVMEM_RETURN_IF_ERROR(check_call_shapes(sh, q, k, v, gate, out));
    KVMEM_RETURN_IF_ERROR(check_shape(weights.ln_weight, {sh.D}, "ln_weight"));
    KVMEM_RETURN_IF_ERROR(check_shape(weights.ln_bias, {sh.D}, "ln_bias"));
    KVMEM_RETURN_IF_ERROR(check_shape(weights.tau_state, {sh.Hq}, "tau_state"));
    KVMEM_RETURN_IF_ERROR(check_shape(weights.tau_bswa, {sh.Hq}, "tau_bswa"));

    KvmCall<S, A, In, Out> call{ItemTable<S, A>(state),
                                state.n_data(),
                                state.cov_data(),
                                state.slots_data(),
                                state.item_result(),
                                state.ln_w(),
                                state.ln_b(),
                                state.tau_s(),
                                state.tau_w(),
                                DeviceView<const In, 4>(q),
                                DeviceView<const In, 4>(k),
                                DeviceView<const In, 4>(v),
                                DeviceView<const In, 3>(gate),
                                DeviceView<Out, 4>(out),
                                lengths,
                                T,
                                sh.Hk,
                                sh.rep(),
                                sh.D,
                                sh.Dv,
                                sh.n_ctx,
                                pr.chunk,
                                pr.window_chunks,
                                pr.sink,
                                pr.rope_dims,
                                pr.budget,
                                pr.merge_gate_keys,
                                pr.merge_gate_values,
                                pr.head_temps,
                                pr.value_radius,
                                pr.gate_appends,
                                pr.gate_initial,
                                static_cast<A>(pr.ln_eps),
                                static_cast<A>(pr.scale > 0 ? pr.scale : 1.0 / std::sqrt(double(sh.D))),
                                nullptr,
                                0};
    const DeviceView<const float, 1> lw(weights.ln_weight), lb(weights.ln_bias), ts(weights.tau_state),
        tw(weights.tau_bswa);

    // ---- data-dependent checks on the device: one value read back ----
    if (exec.checked) {
      constexpr std::int64_t kNone = std::numeric_limits<std::int64_t>::max();
      std::int64_t found = kNone;
      const std::int64_t Hq = sh.Hq, Hk = sh.Hk, D = sh.D, Dv = sh.Dv;
      Kokkos::parallel_reduce(
          "kvmem::kokkos::kvm::check", Kokkos::RangePolicy<Space>(exec.space, 0, B),
          KOKKOS_LAMBDA(const std::int64_t b, std::int64_t& first) {
            auto fail = [&](KvmCheck code) {
              const std::int64_t c = static_cast<std::int64_t>(code) * B + b;
              if (c < first) first = c;
            };
            const std::int64_t len = call.length(b);
            if (len < 0 || len > T) return fail(KvmCheck::kLength);
            if (call.n_seq[b] + len > call.n_ctx) return fail(KvmCheck::kContext);
            for (std::int64_t t = 0; t < len; ++t) {
              for (std::int64_t h = 0; h < Hq; ++h)
                for (std::int64_t d = 0; d < D; ++d)
                  if (!finite(load_as<double>(call.q(b, h, t, d)))) return fail(KvmCheck::kQ);
              for (std::int64_t h = 0; h < Hk; ++h) {
                for (std::int64_t d = 0; d < D; ++d)
                  if (!finite(load_as<double>(call.k(b, h, t, d)))) return fail(KvmCheck::kK);
                for (std::int64_t d = 0; d < Dv; ++d)
                  if (!finite(load_as<double>(call.v(b, h, t, d)))) return fail(KvmCheck::kV);
                const double gv = load_as<double>(call.gate(b, h, t));
                if (!finite(gv) || !(gv > 0)) return fail(KvmCheck::kGate);
              }
            }
            if (b == 0) {
              for (std::int64_t d = 0; d < D; ++d)
                if (!finite(lw(d)) || !finite(lb(d))) return fail(KvmCheck::kWeights);
              for (std::int64_t h = 0; h < Hq; ++h)
                if (!finite(ts(h)) || !finite(tw(h))) return fail(KvmCheck::kWeights);
            }
          },
          Kokkos::Min<std::int64_t>(found));
      if (found != kNone) {
        const std::int64_t b = found % B;
        const std::string seq = "sequence " + std::to_string(b);
        switch (static_cast<KvmCheck>(found / B)) {
          case KvmCheck::kLength:
            return invalid_argument("lengths[" + std::to_string(b) + "]", "0 <= length <= T = " + std::to_string(T),
                                    "a value outside (read on the device)");
          case KvmCheck::kContext:
            return {StatusCode::kOutOfRange,
                    seq + ": tokens seen + length exceed the state's n_ctx = " + std::to_string(sh.n_ctx)};
          case KvmCheck::kQ:
            return invalid_argument("q", "finite values", "NaN or Inf in " + seq);
          case KvmCheck::kK:
            return invalid_argument("k", "finite values", "NaN or Inf in " + seq);
          case KvmCheck::kV:
            return invalid_argument("v", "finite values", "NaN or Inf in " + seq);
          case KvmCheck::kGate:
            return invalid_argument("gate", "finite values > 0 (g = 1 + ELU > 0)", "a violation in " + seq);
          case KvmCheck::kWeights:
            return invalid_argument("weights", "finite values", "NaN or Inf");
        }
      }
    }

    // ---- run: weights, items, counters; in order on exec.space ----
    Kokkos::View<std::int64_t**, Kokkos::LayoutRight, typename Space::memory_space> route_buffer;
    if (log != nullptr) {  // test hook: at most ceil(T/C) + 1 updates per item in this call
      call.log_stride = 1 + (T / pr.chunk + 2) * (kRouteHeader + pr.chunk);
      route_buffer = decltype(route_buffer)("kvmem kvm routes", B * sh.Hk, call.log_stride);
      call.log = route_buffer.data();
    }
    {
      A* w_ln = state.ln_w();
      A* b_ln = state.ln_b();
      A* t_s = state.tau_s();
      A* t_w = state.tau_w();
      const std::int64_t D = sh.D, Hq = sh.Hq;
      Kokkos::parallel_for(
          "kvmem::kokkos::kvm::weights", Kokkos::RangePolicy<Space>(exec.space, 0, D > Hq ? D : Hq),
          KOKKOS_LAMBDA(const std::int64_t x) {
            if (x < D) {
              w_ln[x] = static_cast<A>(lw(x));
              b_ln[x] = static_cast<A>(lb(x));
            }
            if (x < Hq) {
              t_s[x] = static_cast<A>(ts(x));
              t_w[x] = static_cast<A>(tw(x));
            }
          });
    }
    Kokkos::parallel_for("kvmem::kokkos::kvm::items", team_policy(exec, B * sh.Hk), call);
    Kokkos::parallel_for(
        "kvmem::kokkos::kvm::counters", Kokkos::RangePolicy<Space>(exec.space, 0, B),
        KOKKOS_LAMBDA(const std::int64_t b) {
          if (!call.runnable(b)) return;
          call.n_seq[b] += call.length(b);
          call.cov_seq[b] = call.result[2 * (b * call.Hk)];
          call.slots_seq[b] = call.result[2 * (b * call.Hk) + 1];
        });

    if (log != nullptr) {  // copy the records back and rebuild the host RouteLog
      auto host = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), route_buffer);
      log->items.resize(std::size_t(B * sh.Hk));
      for (std::int64_t i = 0; i < B * sh.Hk; ++i)
        for (std::int64_t u = 0; u < host(i, 0); ++u) {
          const std::int64_t* rec = &host(i, 1 + u * (kRouteHeader + pr.chunk));
          UpdateRoute r;
          r.first_token = rec[0];
          r.slots_before = rec[1];
          r.slots_after = rec[2];
          r.target.assign(rec + kRouteHeader, rec + kRouteHeader + pr.chunk);
          for (std::int64_t x = 0; x < pr.chunk; ++x)
            if (r.target[std::size_t(x)] == -1) r.appended.push_back(rec[0] + x);
          log->items[std::size_t(i)].push_back(std::move(r));
        }
    }
    return Status::ok();
  }
};

// kvm::forward on Kokkos: whole sequences from an empty cache whose state lives in the space's memory
// (create_state) instead of the host allocation of the generic forward. Allocates per call (training-
// style use, as the generic forward).
template <class S = float, class A = float, class Space, class In, class Out>
Status forward(const kokkos::Executor<Space>& exec, const Params& params, const Weights& weights,
               TensorView<const In, 4> q,     // [B,Hq,T,D]
               TensorView<const In, 4> k,     // [B,Hk,T,D]
               TensorView<const In, 4> v,     // [B,Hk,T,Dv]
               TensorView<const In, 3> gate,  // [B,Hk,T]
               TensorView<Out, 4> out,        // [B,T,Hq,Dv]
               const std::int64_t* lengths = nullptr) {
  const Shape shape{q.extent(0), q.extent(1), k.extent(1), q.extent(3), v.extent(3), q.extent(2) > 0 ? q.extent(2) : 1};
  kokkos::KvmState<S, A, typename Space::memory_space> state;
  KVMEM_RETURN_IF_ERROR((kokkos::create_state<S, A>(exec, params, shape, state)));
  KVMEM_RETURN_IF_ERROR(prefill(exec, state.state, weights, q, k, v, gate, out, lengths));
  exec.space.fence();  // the state's memory is released on return
  return Status::ok();
}

}  // namespace kvmem::kvm
