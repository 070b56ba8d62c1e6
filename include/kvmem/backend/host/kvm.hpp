// SPDX-License-Identifier: Apache-2.0
#pragma once
// KVM on the host backend: kvm::Backend<host::Executor>. Work is split over (sequence, KV head)
// items with host::parallel_for; each item runs its whole token range start to finish, so results
// do not depend on the thread count. Inside an item, queries are processed one chunk segment at a
// time (all query heads of the KV group together) and keys in tiles of kernel::kAttendTile, so a
// key/value tile stays in cache while every query row of the segment reads it.
//
// The driver is the decode rule of spec 4.7 applied to runs of tokens that do not cross a chunk
// boundary: at the first token of a new chunk the pending update runs (before its attention), then
// the tokens enter the window ring (and, below position C, found initial slots), then the segment
// attends. Prefill and decode therefore run the same operations in the same order and agree
// exactly (spec 6.1), and a prefill equals the chunked driver of spec 4.6.
//
// Memory: each work item (a batch row's or a step row's KV head) takes its scratch from the State's
// workspace (kvm/state.hpp: work item w = active row * Hk + g), so a step needs workspace for its rows
// that name a slot, checked before anything changes, and allocates nothing.
//
// kvm::step runs the same driver per (row, KV head) item over packed token-major inputs (SeqIo
// gives each item its tokens' addresses in either layout), so a row of a ragged step equals its
// sequence run alone with prefill, bit for bit on the exact path. The slot operations (reset, copy, export/import,
// truncate) work on the per-slot counters and item memory directly.
//
// Executor::exact selects the arithmetic. Exact: the scalar kernel/ bodies above, bitwise equal
// decode and prefill. Fast (the default, with Eigen available, backend/host/fast_path.hpp): the
// readout and the update's novelty and routing logits are Eigen matrix products over tiles. Every
// update still runs the same function on the same data in decode and prefill, so routes and state
// agree bitwise; readout outputs agree within fp32 rounding, as they do with the fp64 reference.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <new>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "kvmem/backend/host/executor.hpp"
#include "kvmem/backend/host/fast_path.hpp"
#include "kvmem/core/numeric.hpp"
#include "kvmem/core/softmax.hpp"
#include "kvmem/core/status.hpp"
#include "kvmem/core/tensor.hpp"
#include "kvmem/kernel/attend.hpp"
#include "kvmem/kernel/kvm_state.hpp"
#include "kvmem/kvm/attention.hpp"
#include "kvmem/kvm/params.hpp"
#include "kvmem/kvm/record.hpp"
#include "kvmem/kvm/state.hpp"

namespace kvmem::kvm {

namespace host_detail {

// Where one sequence's tokens of a call live: element pointers at its first token and the element
// distances between consecutive tokens and heads, so one driver reads prefill's [B,H,T,*] views and
// a step's packed token-major [tokens,H,*] views alike.
template <class In, class Out>
struct SeqIo {
  const In* q;     // (token i, query head h) at q + i*q_tok + h*q_head, D elements
  const In* k;     // (i, KV head g) at k + i*k_tok + g*k_head, D elements
  const In* v;     // Dv elements
  const In* gate;  // one element
  Out* out;        // (i, h) at out + i*o_tok + h*o_head, Dv elements
  float* lse;      // (i, h) at lse + i*l_tok + h*l_head, or nullptr
  std::int64_t q_tok, q_head, k_tok, k_head, v_tok, v_head, g_tok, g_head, o_tok, o_head, l_tok, l_head;

  // Sequence b of prefill's views: q [B,Hq,T,D], k [B,Hk,T,D], v [B,Hk,T,Dv], gate [B,Hk,T], out [B,T,Hq,Dv].
  static SeqIo batch_row(const TensorView<const In, 4>& q, const TensorView<const In, 4>& k,
                         const TensorView<const In, 4>& v, const TensorView<const In, 3>& gate,
                         const TensorView<Out, 4>& out, std::int64_t b) {
    const std::int64_t Hq = q.extent(1), Hk = k.extent(1), T = q.extent(2), D = q.extent(3), Dv = v.extent(3);
    return {.q = q.data() + b * Hq * T * D,
            .k = k.data() + b * Hk * T * D,
            .v = v.data() + b * Hk * T * Dv,
            .gate = gate.data() + b * Hk * T,
            .out = out.data() + b * T * Hq * Dv,
            .lse = nullptr,
            .q_tok = D,
            .q_head = T * D,
            .k_tok = D,
            .k_head = T * D,
            .v_tok = Dv,
            .v_head = T * Dv,
            .g_tok = 1,
            .g_head = T,
            .o_tok = Hq * Dv,
            .o_head = Dv,
            .l_tok = 0,
            .l_head = 0};
  }
  // The tokens from `start` of a step's packed views: q [tokens,Hq,D], k [tokens,Hk,D],
  // v [tokens,Hk,Dv], gate [tokens,Hk], out [tokens,Hq,Dv], lse [tokens,Hq] (may be empty).
  static SeqIo packed(const TensorView<const In, 3>& q, const TensorView<const In, 3>& k,
                      const TensorView<const In, 3>& v, const TensorView<const In, 2>& gate,
                      const TensorView<Out, 3>& out, const TensorView<float, 2>& lse, std::int64_t start) {
    const std::int64_t Hq = q.extent(1), Hk = k.extent(1), D = q.extent(2), Dv = v.extent(2);
    return {.q = q.data() + start * Hq * D,
            .k = k.data() + start * Hk * D,
            .v = v.data() + start * Hk * Dv,
            .gate = gate.data() + start * Hk,
            .out = out.data() + start * Hq * Dv,
            .lse = lse.empty() ? nullptr : lse.data() + start * Hq,
            .q_tok = Hq * D,
            .q_head = D,
            .k_tok = Hk * D,
            .k_head = D,
            .v_tok = Hk * Dv,
            .v_head = Dv,
            .g_tok = Hk,
            .g_head = 1,
            .o_tok = Hq * Dv,
            .o_head = Dv,
            .l_tok = Hq,
            .l_head = 1};
  }
};

template <class S, class A, class In, class Out>
struct Call {
  const State<S, A>& st;
  RouteLog* log;
  bool exact = true;  // Executor::exact; false: readout and routing logits may take the Eigen tile paths

  const Params& p() const { return st.params(); }
  std::int64_t D() const { return st.shape().D; }
  std::int64_t Dv() const { return st.shape().Dv; }

  // The parameters the shared state-step bodies read (kernel/kvm_state.hpp).
  kernel::KvmStepParams<A> step_params() const {
    const Params& pr = p();
    return {.D = D(),
            .Dv = Dv(),
            .rope_dims = pr.rope_dims,
            .ln_w = st.ln_w(),
            .ln_b = st.ln_b(),
            .eps = static_cast<A>(pr.ln_eps),
            .merge_gate_keys = pr.merge_gate_keys,
            .merge_gate_values = pr.merge_gate_values,
            .gate_appends = pr.gate_appends,
            .gate_initial = pr.gate_initial,
            .value_radius = pr.value_radius};
  }

  // K^_j = LN_s(Sk_j) and V^_j for slots [j0, j1) (spec 4.4 steps 1-2), into the readout copies.
  void refresh(const ItemView<S, A>& it, std::int64_t j0, std::int64_t j1) const {
    const kernel::KvmStepParams<A> kp = step_params();
#if KVMEM_HOST_EIGEN
    if constexpr (std::is_same_v<A, float>) {
      if (!exact) {  // refresh_slot with the vectorised layer norm
        for (std::int64_t j = j0; j < j1; ++j) {
          host::eigen::layer_norm_lanes(it.sk + j * D(), D(), kp.ln_w, kp.ln_b, kp.eps, it.row);
          if constexpr (is_row_scaled_v<S>) {
            it.khat_scale[j] = quantize_row(it.row, it.khat + j * D(), D());
            it.vhat_scale[j] = kernel::value_readout_scaled(it.sv + j * Dv(), Dv(), it.rho[j], it.cnt[j],
                                                            kp.value_radius, it.vhat + j * Dv());
          } else {
            for (std::int64_t d = 0; d < D(); ++d) it.khat[j * D() + d] = store_as<S>(it.row[d]);
            kernel::value_readout(it.sv + j * Dv(), Dv(), it.rho[j], it.cnt[j], kp.value_radius, it.vhat + j * Dv());
          }
        }
        return;
      }
    }
#endif
    for (std::int64_t j = j0; j < j1; ++j)
      kernel::refresh_slot(kp, it.sk + j * D(), it.sv + j * Dv(), it.rho[j], it.cnt[j], it.row, it.khat + j * D(),
                           it.vhat + j * Dv(), row_scale(it.khat_scale, j), row_scale(it.vhat_scale, j));
  }

  // Row j of a readout copy's scales (fp8 storage), or nullptr where the storage has none.
  static float* row_scale(float* scales, std::int64_t j) {
    return scales != nullptr ? scales + j : nullptr;
  }

  // Spec 4.3: the token at ring slot `ring` founds slot j (init rule; rho from the raw v).
  void init_slot(const ItemView<S, A>& it, std::int64_t ring, std::int64_t j) const {
    kernel::found_slot(step_params(), it.wk + ring * D(), it.wv + ring * Dv(), it.wg[ring], it.sk + j * D(),
                       it.sv + j * Dv(), it.rho + j, it.cnt + j);
    refresh(it, j, j + 1);
  }

  // Spec 4.5: U(tokens [a, a+C) read from the ring, N, avail). Returns the new |S|.
  std::int64_t update(const ItemView<S, A>& it, std::int64_t a, std::int64_t N, std::int64_t avail, std::int64_t S_cur,
                      std::vector<UpdateRoute>* routes) const {
    const Params& pr = p();
    const std::int64_t C = pr.chunk, W = pr.window();
    const A eps = static_cast<A>(pr.ln_eps);
    const kernel::KvmStepParams<A> kp = step_params();
    for (std::int64_t i = 0; i < C; ++i) {  // step 1: k0, kg, vg
      const std::int64_t ring = (a + i) % W;
      kernel::prepare_token(kp, it.wk + ring * D(), it.wv + ring * Dv(), it.wg[ring], it.k0 + i * D(), it.kg + i * D(),
                            it.vg + i * Dv());
    }
    double append_gap = 1e300;
    // spec 3.1: target and appends
    const std::int64_t target = pr.budget.slots(N, avail, S_cur);
    const std::int64_t n_app = std::min(target - S_cur, C);
    if (n_app > 0) {  // step 2: novelty against the pre-update state, ungated k0, sink included
      for (std::int64_t i = 0; i < C; ++i) it.score[i] = negative_infinity<A>();
      if (!route_tiles(it, 0, S_cur, /*novelty=*/true))
        for (std::int64_t j0 = 0; j0 < S_cur; j0 += kernel::kRouteRows) {
          const std::int64_t rows = std::min(kernel::kRouteRows, S_cur - j0);
          for (std::int64_t r = 0; r < rows; ++r)
            kernel::layer_norm(it.sk + (j0 + r) * D(), D(), st.ln_w(), st.ln_b(), eps, it.row + r * D());
          kernel::novelty_update_rows(it.k0, C, D(), it.row, rows, it.score);
        }
      kernel::select_appends(it.score, C, n_app, it.target);
      if (routes != nullptr && n_app < C) {  // test hook only: allocation allowed
        std::vector<A> sorted(it.score, it.score + C);
        std::sort(sorted.begin(), sorted.end());
        append_gap = double(sorted[std::size_t(n_app)]) - double(sorted[std::size_t(n_app - 1)]);
      }
    } else {
      for (std::int64_t i = 0; i < C; ++i) it.target[i] = 0;
    }
    UpdateRoute* route = nullptr;
    if (routes != nullptr) {
      routes->emplace_back();
      route = &routes->back();
      route->first_token = a;
      route->slots_before = S_cur;
    }
    // step 3: appends in increasing token order
    std::int64_t S_new = S_cur;
    for (std::int64_t i = 0; i < C; ++i) {
      if (it.target[i] != -1) continue;
      const std::int64_t j = S_new++;
      kernel::append_slot(kp, it.k0 + i * D(), it.kg + i * D(), it.vg + i * Dv(), it.wv + (a + i) % W * Dv(),
                          it.sk + j * D(), it.sv + j * Dv(), it.rho + j, it.cnt + j);
      if (route != nullptr) route->appended.push_back(a + i);
    }
    // step 4: route against K^+ of the expanded state, then one scatter
    if (n_app < C) {
      if (!route_tiles(it, pr.sink, S_new, /*novelty=*/false))
        for (std::int64_t j0 = pr.sink; j0 < S_new; j0 += kernel::kRouteRows) {
          const std::int64_t rows = std::min(kernel::kRouteRows, S_new - j0);
          for (std::int64_t r = 0; r < rows; ++r)
            kernel::layer_norm(it.sk + (j0 + r) * D(), D(), st.ln_w(), st.ln_b(), eps, it.row + r * D());
          kernel::merge_route_update_rows(it.kg, C, D(), it.row, j0, rows, it.best, it.target, j0 == pr.sink);
        }
      if (route != nullptr) route->merge_margin = merge_margin(it, S_new);
      kernel::scatter_into_slots(it.kg, it.vg, it.target, C, D(), Dv(), pr.sink, S_new, it.sk, it.sv, it.cnt);
    }
    if (route != nullptr) {
      route->append_margin = append_gap;
      route->slots_after = S_new;
      route->target.assign(it.target, it.target + C);
    }
    refresh(it, pr.sink, S_new);
    return S_new;
  }

  // Steps 2 and 4 with the token x slot logits of a block of slots as one Eigen product (the
  // selection rules stay kernel/'s). Routes may differ from the exact path's only where two logits
  // tie within fp32 rounding (DESIGN.md section 5). Returns false where this path does not apply
  // (exact executor, no Eigen, A != float); the caller then runs the exact blocks.
  bool route_tiles(const ItemView<S, A>& it, std::int64_t j_begin, std::int64_t j_end, bool novelty) const {
#if KVMEM_HOST_EIGEN
    if constexpr (std::is_same_v<A, float>) {
      if (exact) return false;
      const std::int64_t C = p().chunk, tile = host::eigen::kTile;
      const A eps = static_cast<A>(p().ln_eps);
      host::eigen::RangeScratch& ws = host::eigen::thread_range_scratch();
      if (ws.ln_rows.rows() < tile || ws.ln_rows.cols() != D()) ws.ln_rows.resize(tile, D());
      for (std::int64_t j0 = j_begin; j0 < j_end; j0 += tile) {
        const std::int64_t rows = std::min(tile, j_end - j0);
        for (std::int64_t r = 0; r < rows; ++r)
          host::eigen::layer_norm_lanes(it.sk + (j0 + r) * D(), D(), st.ln_w(), st.ln_b(), eps,
                                        ws.ln_rows.data() + r * D());
        host::eigen::cross_logits(novelty ? it.k0 : it.kg, C, D(), ws.ln_rows.data(), rows, ws.tile);
        const A* logits = ws.tile.logits.data();
        const std::int64_t ld = ws.tile.logits.cols();
        if (novelty)
          kernel::novelty_update_logits(logits, ld, C, rows, it.score);
        else
          kernel::merge_route_update_logits(logits, ld, C, j0, rows, it.best, it.target, j0 == j_begin);
      }
      return true;
    }
#endif
    (void)it, (void)j_begin, (void)j_end, (void)novelty;
    return false;
  }

  // Test hook: smallest top1 - top2 merge logit over the merged tokens, against K^+ before the
  // scatter (spec 2). Only runs when a RouteLog is attached; allocates.
  double merge_margin(const ItemView<S, A>& it, std::int64_t S_new) const {
    const Params& pr = p();
    const std::int64_t C = pr.chunk;
    const A eps = static_cast<A>(pr.ln_eps);
    std::vector<A> top1(std::size_t(C), negative_infinity<A>()), top2(std::size_t(C), negative_infinity<A>());
    for (std::int64_t j = pr.sink; j < S_new; ++j) {
      kernel::layer_norm(it.sk + j * D(), D(), st.ln_w(), st.ln_b(), eps, it.row);
      for (std::int64_t i = 0; i < C; ++i) {
        if (it.target[i] == -1) continue;
        const A l = kernel::dot(it.row, it.kg + i * D(), D());
        if (l > top1[std::size_t(i)]) {
          top2[std::size_t(i)] = top1[std::size_t(i)];
          top1[std::size_t(i)] = l;
        } else if (l > top2[std::size_t(i)]) {
          top2[std::size_t(i)] = l;
        }
      }
    }
    double margin = 1e300;
    for (std::int64_t i = 0; i < C; ++i)
      if (it.target[i] != -1 && top2[std::size_t(i)] > negative_infinity<A>())
        margin = std::min(margin, double(top1[std::size_t(i)]) - double(top2[std::size_t(i)]));
    return margin;
  }

  // Queries [t0, t1) (absolute; local index t - n0) of KV group (b, g) over the state (if
  // w > 0) and the causal window [w, t] in the ring.
  void attend_segment(const ItemView<S, A>& it, const SeqIo<In, Out>& io, std::int64_t g, std::int64_t n0,
                      std::int64_t t0, std::int64_t t1, std::int64_t w, std::int64_t S_cur) const {
    const Params& pr = p();
    const std::int64_t rep = st.shape().rep(), W = pr.window();
    const std::int64_t rows = (t1 - t0) * rep;
    const A scale = static_cast<A>(pr.scale > 0 ? pr.scale : 1.0 / std::sqrt(double(D())));
    for (std::int64_t r = 0; r < rows; ++r) {
      const std::int64_t t = t0 + r / rep, h = g * rep + r % rep;
      const In* qr = io.q + (t - n0) * io.q_tok + h * io.q_head;
      for (std::int64_t d = 0; d < D(); ++d) it.qblock[r * D() + d] = load_as<A>(qr[d]);
      new (it.soft + r) OnlineSoftmax<A>();
      for (std::int64_t d = 0; d < Dv(); ++d) it.acc[r * Dv() + d] = A(0);
    }
#if KVMEM_HOST_EIGEN
    if constexpr (std::is_same_v<A, float>) {
      if (!exact) {
        attend_segment_tiles(it, g, t0, t1, w, S_cur, rows, scale);
        return finish_segment(it, io, g, n0, t0, rows);
      }
    }
#endif
    const std::int64_t tile = kernel::kAttendTile;
    if (w > 0) {  // every slot, no mask (spec 4.1 step 2)
      for (std::int64_t j0 = 0; j0 < S_cur; j0 += tile) {
        const std::int64_t n = std::min(tile, S_cur - j0);
        for (std::int64_t r = 0; r < rows; ++r) {
          const std::int64_t h = g * rep + r % rep;
          const A ls = scale * (pr.head_temps ? st.tau_s()[h] : A(1));
          kernel::attend_accumulate(it.soft[r], it.acc + r * Dv(), it.qblock + r * D(), D(), ls, it.khat + j0 * D(),
                                    D(), it.vhat + j0 * Dv(), Dv(), Dv(), n, row_scale(it.khat_scale, j0),
                                    row_scale(it.vhat_scale, j0));
        }
      }
    }
    // window [w, t]: tiles start at w and at ring wraps, so a row sees the same tiles in prefill
    // and decode (bitwise equal results).
    for (std::int64_t a = w; a < t1;) {
      const std::int64_t wrap = (a / W + 1) * W;
      const std::int64_t e = std::min({a + tile, wrap, t1});
      const std::int64_t ring = a % W;
      for (std::int64_t r = 0; r < rows; ++r) {
        const std::int64_t t = t0 + r / rep, h = g * rep + r % rep;
        const std::int64_t n = std::min(e, t + 1) - a;
        if (n <= 0) continue;
        const A ls = scale * (pr.head_temps ? st.tau_w()[h] : A(1));
        kernel::attend_accumulate(it.soft[r], it.acc + r * Dv(), it.qblock + r * D(), D(), ls, it.wk + ring * D(), D(),
                                  it.wv + ring * Dv(), Dv(), Dv(), n);
      }
      a = e;
    }
    finish_segment(it, io, g, n0, t0, rows);
  }

  void finish_segment(const ItemView<S, A>& it, const SeqIo<In, Out>& io, std::int64_t g, std::int64_t n0,
                      std::int64_t t0, std::int64_t rows) const {
    const std::int64_t rep = st.shape().rep();
    for (std::int64_t r = 0; r < rows; ++r) {
      const std::int64_t t = t0 + r / rep, h = g * rep + r % rep;
      Out* o = io.out + (t - n0) * io.o_tok + h * io.o_head;
      const A inv = it.soft[r].normaliser();
      for (std::int64_t d = 0; d < Dv(); ++d) o[d] = static_cast<Out>(it.acc[r * Dv() + d] * inv);
      if (io.lse != nullptr) io.lse[(t - n0) * io.l_tok + h * io.l_head] = static_cast<float>(it.soft[r].lse());
    }
  }

  // Zeroes the out (and lse) rows of local tokens [i0, i1) for the query heads of KV group g.
  void zero_rows(const SeqIo<In, Out>& io, std::int64_t g, std::int64_t i0, std::int64_t i1) const {
    const std::int64_t rep = st.shape().rep();
    for (std::int64_t i = i0; i < i1; ++i)
      for (std::int64_t h = g * rep; h < (g + 1) * rep; ++h) {
        Out* o = io.out + i * io.o_tok + h * io.o_head;
        for (std::int64_t d = 0; d < Dv(); ++d) o[d] = Out(0);
        if (io.lse != nullptr) io.lse[i * io.l_tok + h * io.l_head] = 0.0f;
      }
  }

#if KVMEM_HOST_EIGEN
  // The same readout with the slot range and each window run (split at ring wraps) through Eigen
  // tiles (backend/host/eigen_attend.hpp). Tiles differ between prefill and decode, so the two agree
  // within fp32 rounding here, bitwise only on the exact path.
  void attend_segment_tiles(const ItemView<S, A>& it, std::int64_t g, std::int64_t t0, std::int64_t t1, std::int64_t w,
                            std::int64_t S_cur, std::int64_t rows, A scale) const {
    const Params& pr = p();
    const std::int64_t rep = st.shape().rep(), W = pr.window();
    host::eigen::RangeScratch& ws = host::eigen::thread_range_scratch();
    ws.reserve_rows(rows);
    const host::eigen::RowBlock blk{rows, D(), Dv(), it.qblock, ws.row_scale.data(), it.soft, it.acc};
    for (std::int64_t r = 0; r < rows; ++r) ws.last[std::size_t(r)] = t0 + r / rep;
    if (w > 0) {
      for (std::int64_t r = 0; r < rows; ++r)
        ws.row_scale[std::size_t(r)] = scale * (pr.head_temps ? st.tau_s()[g * rep + r % rep] : A(1));
      host::eigen::attend_range(blk, it.khat, D(), it.vhat, Dv(), 0, S_cur, nullptr, ws, it.khat_scale, it.vhat_scale);
    }
    for (std::int64_t r = 0; r < rows; ++r)
      ws.row_scale[std::size_t(r)] = scale * (pr.head_temps ? st.tau_w()[g * rep + r % rep] : A(1));
    for (std::int64_t a = w; a < t1;) {
      const std::int64_t e = std::min((a / W + 1) * W, t1), ring = a % W;
      host::eigen::attend_range(blk, it.wk + ring * D(), D(), it.wv + ring * Dv(), Dv(), a, e, ws.last.data(), ws);
      a = e;
    }
  }
#endif

  // The whole token range (len tokens of io) of one (sequence slot b, KV head g).
  // w: the work item whose workspace the item uses and whose result counters it writes.
  void run_item(const SeqIo<In, Out>& io, std::int64_t b, std::int64_t g, std::int64_t w, std::int64_t len) const {
    const Params& pr = p();
    const Geometry geo = pr.geometry();
    const std::int64_t C = pr.chunk, W = pr.window();
    const ItemView<S, A> it = st.item(b, g, w);
#if KVMEM_HOST_EIGEN
    if constexpr (std::is_same_v<A, float>)
      if (!exact) host::eigen::thread_range_scratch().reserve(st.shape().rep() * C, D(), Dv());
#endif
    const std::int64_t n0 = st.tokens(b);
    std::int64_t cov = st.covered(b), S_cur = st.slots(b);
    std::vector<UpdateRoute>* routes = log ? &log->items[std::size_t(b * st.shape().Hk + g)] : nullptr;
    for (std::int64_t t0 = n0; t0 < n0 + len;) {
      const std::int64_t t1 = std::min(n0 + len, (t0 / C + 1) * C);
      const std::int64_t w = geo.bswa_begin(t0 + 1);
      if (cov < w) {  // spec 4.7 step 4: the first token of a new chunk, before its attention
        S_cur = update(it, cov, W + cov, cov + C, S_cur, routes);
        cov += C;
      }
      for (std::int64_t t = t0; t < t1; ++t) {  // window ring; init slots below position C (spec 4.3)
        const std::int64_t ring = t % W;
        const In* kr = io.k + (t - n0) * io.k_tok + g * io.k_head;
        const In* vr = io.v + (t - n0) * io.v_tok + g * io.v_head;
        for (std::int64_t d = 0; d < D(); ++d) it.wk[ring * D() + d] = store_as<window_t<S>>(static_cast<A>(kr[d]));
        for (std::int64_t d = 0; d < Dv(); ++d) it.wv[ring * Dv() + d] = store_as<window_t<S>>(static_cast<A>(vr[d]));
        it.wg[ring] = static_cast<A>(io.gate[(t - n0) * io.g_tok + g * io.g_head]);
        if (t < C && t >= cov) {
          init_slot(it, ring, S_cur++);
          cov = t + 1;
        }
      }
      attend_segment(it, io, g, n0, t0, t1, w, S_cur);
      t0 = t1;
    }
    std::int64_t* res = st.item_result() + 2 * w;
    res[0] = cov;
    res[1] = S_cur;
  }
};

template <class E, std::size_t R>
Status check_values(const TensorView<const E, R>& x, std::int64_t b, std::int64_t len, const char* name,
                    bool positive) {
  // x: [B, H, T, ...]; rows t < len of sequence b must be finite (and > 0 for gates).
  const std::int64_t H = x.extent(1), T = x.extent(2);
  const std::int64_t inner = x.size() / (x.extent(0) * H * T > 0 ? x.extent(0) * H * T : 1);
  for (std::int64_t h = 0; h < H; ++h)
    for (std::int64_t t = 0; t < len; ++t) {
      const E* row = x.data() + ((b * H + h) * T + t) * inner;
      for (std::int64_t d = 0; d < inner; ++d) {
        const double e = static_cast<double>(row[d]);
        if (!std::isfinite(e))
          return invalid_argument(name, "finite values",
                                  "NaN or Inf at [" + std::to_string(b) + "," + std::to_string(h) + "," +
                                      std::to_string(t) + "," + std::to_string(d) + "]");
        if (positive && !(e > 0))
          return invalid_argument(name, "values > 0 (g = 1 + ELU > 0)",
                                  std::to_string(e) + " at [" + std::to_string(b) + "," + std::to_string(h) + "," +
                                      std::to_string(t) + "]");
      }
    }
  return Status::ok();
}

// Tokens [i0, i1) of a packed token-major view x [tokens, width...] must be finite (and > 0 for gates).
template <class E>
Status check_tokens(const E* x, std::int64_t width, std::int64_t i0, std::int64_t i1, const char* name, bool positive) {
  for (std::int64_t i = i0 * width; i < i1 * width; ++i) {
    const double e = static_cast<double>(x[i]);
    if (!std::isfinite(e))
      return invalid_argument(name, "finite values", "NaN or Inf at token " + std::to_string(i / width));
    if (positive && !(e > 0))
      return invalid_argument(name, "values > 0 (g = 1 + ELU > 0)",
                              std::to_string(e) + " at token " + std::to_string(i / width));
  }
  return Status::ok();
}

// The learned parameters in Acc, kept in the state for the items of one call (and for the readout
// rebuilt by import_slot).
template <class S, class A>
void load_weights(State<S, A>& state, const Weights& weights) {
  const Shape& sh = state.shape();
  for (std::int64_t d = 0; d < sh.D; ++d) {
    state.ln_w()[d] = static_cast<A>(weights.ln_weight(d));
    state.ln_b()[d] = static_cast<A>(weights.ln_bias(d));
  }
  for (std::int64_t h = 0; h < sh.Hq; ++h) {
    state.tau_s()[h] = static_cast<A>(weights.tau_state(h));
    state.tau_w()[h] = static_cast<A>(weights.tau_bswa(h));
  }
}

inline Status check_list(const TensorView<const std::int32_t, 1>& v, const char* name) {
  if (!v.is_contiguous()) return invalid_argument(name, "a contiguous view", "a strided view");
  return Status::ok();
}

}  // namespace host_detail

template <>
struct Backend<host::Executor> {
  template <class S, class A>
  using state_type = State<S, A>;
  using weights_type = Weights;

  // The host runs every valid problem (kvm::can_run checked the parameters and shape already).
  static Status can_run(const Problem& /*problem*/) { return Status::ok(); }

  template <class S, class A, class In, class Out>
  static Status prefill(const host::Executor& exec, State<S, A>& state, const Weights& weights,
                        TensorView<const In, 4> q,     // [B,Hq,T,D]
                        TensorView<const In, 4> k,     // [B,Hk,T,D]
                        TensorView<const In, 4> v,     // [B,Hk,T,Dv]
                        TensorView<const In, 3> gate,  // [B,Hk,T]
                        TensorView<Out, 4> out,        // [B,T,Hq,Dv]
                        const std::int64_t* lengths, RouteLog* log) {
    // ---- validation: nothing below changes the state until every check passed ----
    if (!state.valid()) return invalid_argument("state", "a created or placed State", "an empty State");
    const Shape& sh = state.shape();
    const std::int64_t B = sh.B, T = q.extent(2);
    KVMEM_RETURN_IF_ERROR(check_call_shapes(sh, q, k, v, gate, out));
    KVMEM_RETURN_IF_ERROR(state.check_workspace(B));
    if (!q.is_contiguous() || !k.is_contiguous() || !v.is_contiguous() || !gate.is_contiguous() || !out.is_contiguous())
      return invalid_argument("q, k, v, gate, out", "contiguous row-major views", "a strided view");
    KVMEM_RETURN_IF_ERROR(validate(weights, sh));
    for (std::int64_t b = 0; b < B; ++b) {
      const std::int64_t len = lengths ? lengths[b] : T;
      if (len < 0 || len > T)
        return invalid_argument("lengths[" + std::to_string(b) + "]", "0 <= length <= T = " + std::to_string(T), len);
      if (state.tokens(b) + len > sh.n_ctx)
        return {StatusCode::kOutOfRange, "sequence " + std::to_string(b) + ": " + std::to_string(state.tokens(b)) +
                                             " + " + std::to_string(len) +
                                             " tokens exceed the state's n_ctx = " + std::to_string(sh.n_ctx)};
      KVMEM_RETURN_IF_ERROR(host_detail::check_values(q, b, len, "q", false));
      KVMEM_RETURN_IF_ERROR(host_detail::check_values(k, b, len, "k", false));
      KVMEM_RETURN_IF_ERROR(host_detail::check_values(v, b, len, "v", false));
      const TensorView<const In, 4> g4(gate.data(), {B, sh.Hk, T, 1});
      KVMEM_RETURN_IF_ERROR(host_detail::check_values(g4, b, len, "gate", true));
    }
    // ---- run ----
    host_detail::load_weights(state, weights);
    if (log != nullptr) log->items.resize(std::size_t(B * sh.Hk));
    static_assert(State<S, A>::kRowBlock >= kernel::kRouteRows, "kvm State: row workspace below the routing block");
    const host_detail::Call<S, A, In, Out> call{state, log, exec.exact};
    host::parallel_for(exec, B * sh.Hk, [&](std::int64_t i) {
      const std::int64_t b = i / sh.Hk, g = i % sh.Hk, len = lengths ? lengths[b] : T;
      const auto io = host_detail::SeqIo<In, Out>::batch_row(q, k, v, gate, out, b);
      call.run_item(io, b, g, i, len);
      call.zero_rows(io, g, len, T);  // rows past this sequence's length
    });
    for (std::int64_t b = 0; b < B; ++b) {
      const std::int64_t len = lengths ? lengths[b] : T;
      const std::int64_t* res = state.item_result() + 2 * (b * sh.Hk);
      state.n_data()[b] += len;
      state.cov_data()[b] = res[0];
      state.slots_data()[b] = res[1];
    }
    return Status::ok();
  }

  // kvm::step: work items (row, KV head); a row runs its slot's tokens with the prefill driver.
  template <class S, class A, class In, class Out>
  static Status step(const host::Executor& exec, State<S, A>& state, const Weights& weights, const Rows& rows,
                     TensorView<const In, 3> q,     // [tokens,Hq,D]
                     TensorView<const In, 3> k,     // [tokens,Hk,D]
                     TensorView<const In, 3> v,     // [tokens,Hk,Dv]
                     TensorView<const In, 2> gate,  // [tokens,Hk]
                     TensorView<Out, 3> out,        // [tokens,Hq,Dv]
                     TensorView<float, 2> lse,      // [tokens,Hq] or empty
                     RouteLog* log) {
    // ---- validation: nothing below changes the state until every check passed ----
    if (!state.valid()) return invalid_argument("state", "a created or placed State", "an empty State");
    const Shape& sh = state.shape();
    const std::int64_t tokens = q.extent(0);
    KVMEM_RETURN_IF_ERROR(check_shape(q, {tokens, sh.Hq, sh.D}, "q [tokens,Hq,D]"));
    KVMEM_RETURN_IF_ERROR(check_shape(k, {tokens, sh.Hk, sh.D}, "k [tokens,Hk,D]"));
    KVMEM_RETURN_IF_ERROR(check_shape(v, {tokens, sh.Hk, sh.Dv}, "v [tokens,Hk,Dv]"));
    KVMEM_RETURN_IF_ERROR(check_shape(gate, {tokens, sh.Hk}, "gate [tokens,Hk]"));
    KVMEM_RETURN_IF_ERROR(check_shape(out, {tokens, sh.Hq, sh.Dv}, "out [tokens,Hq,Dv]"));
    if (!lse.empty()) KVMEM_RETURN_IF_ERROR(check_shape(lse, {tokens, sh.Hq}, "lse [tokens,Hq]"));
    if (!q.is_contiguous() || !k.is_contiguous() || !v.is_contiguous() || !gate.is_contiguous() ||
        !out.is_contiguous() || (!lse.empty() && !lse.is_contiguous()))
      return invalid_argument("q, k, v, gate, out, lse", "contiguous row-major views", "a strided view");
    if (!rows.slot.is_contiguous() || !rows.query_start.is_contiguous())
      return invalid_argument("rows", "contiguous slot and query_start views", "a strided view");
    KVMEM_RETURN_IF_ERROR(validate(weights, sh));
    KVMEM_RETURN_IF_ERROR(validate_rows(rows, sh.B, tokens));
    const std::int32_t* slot = rows.slot.data();
    const std::int32_t* start = rows.query_start.data();
    const std::int64_t R = rows.count();
    std::int64_t active = 0;  // rows that name a slot: each takes Hk work items of the workspace
    for (std::int64_t r = 0; r < R; ++r) active += slot[r] >= 0 ? 1 : 0;
    KVMEM_RETURN_IF_ERROR(state.check_workspace(active));
    for (std::int64_t r = 0; r < R; ++r) {
      if (slot[r] < 0) continue;
      const std::int64_t len = start[r + 1] - start[r], b = slot[r];
      if (state.tokens(b) + len > sh.n_ctx)
        return {StatusCode::kOutOfRange, "row " + std::to_string(r) + " (slot " + std::to_string(b) +
                                             "): " + std::to_string(state.tokens(b)) + " + " + std::to_string(len) +
                                             " tokens exceed the state's n_ctx = " + std::to_string(sh.n_ctx)};
      KVMEM_RETURN_IF_ERROR(host_detail::check_tokens(q.data(), sh.Hq * sh.D, start[r], start[r + 1], "q", false));
      KVMEM_RETURN_IF_ERROR(host_detail::check_tokens(k.data(), sh.Hk * sh.D, start[r], start[r + 1], "k", false));
      KVMEM_RETURN_IF_ERROR(host_detail::check_tokens(v.data(), sh.Hk * sh.Dv, start[r], start[r + 1], "v", false));
      KVMEM_RETURN_IF_ERROR(host_detail::check_tokens(gate.data(), sh.Hk, start[r], start[r + 1], "gate", true));
    }
    // ---- run ----
    host_detail::load_weights(state, weights);
    if (log != nullptr) log->items.resize(std::size_t(sh.B * sh.Hk));
    const host_detail::Call<S, A, In, Out> call{state, log, exec.exact};
    std::int64_t* row_list = state.row_list();
    for (std::int64_t r = 0, a = 0; r < R; ++r) {
      if (slot[r] >= 0) {
        row_list[a++] = r;
        continue;
      }
      const auto io = host_detail::SeqIo<In, Out>::packed(q, k, v, gate, out, lse, start[r]);
      for (std::int64_t g = 0; g < sh.Hk; ++g) call.zero_rows(io, g, 0, start[r + 1] - start[r]);  // padding row
    }
    host::parallel_for(exec, active * sh.Hk, [&](std::int64_t i) {
      const std::int64_t r = row_list[i / sh.Hk], g = i % sh.Hk, len = start[r + 1] - start[r];
      const auto io = host_detail::SeqIo<In, Out>::packed(q, k, v, gate, out, lse, start[r]);
      call.run_item(io, slot[r], g, i, len);
    });
    for (std::int64_t a = 0; a < active; ++a) {
      const std::int64_t r = row_list[a], b = slot[r];
      const std::int64_t* res = state.item_result() + 2 * (a * sh.Hk);
      state.n_data()[b] += start[r + 1] - start[r];
      state.cov_data()[b] = res[0];
      state.slots_data()[b] = res[1];
    }
    return Status::ok();
  }

  template <class S, class A>
  static Status reset_slots(const host::Executor& /*exec*/, State<S, A>& state,
                            TensorView<const std::int32_t, 1> slots) {
    if (!state.valid()) return invalid_argument("state", "a created or placed State", "an empty State");
    KVMEM_RETURN_IF_ERROR(host_detail::check_list(slots, "slots"));
    KVMEM_RETURN_IF_ERROR(check_slot_list(slots.data(), slots.extent(0), state.max_slots(), "slots", false));
    for (std::int64_t i = 0; i < slots.extent(0); ++i) KVMEM_RETURN_IF_ERROR(state.reset(slots(i)));
    return Status::ok();
  }

  template <class S, class A>
  static Status copy_slots(const host::Executor& exec, State<S, A>& state, TensorView<const std::int32_t, 1> src,
                           TensorView<const std::int32_t, 1> dst) {
    if (!state.valid()) return invalid_argument("state", "a created or placed State", "an empty State");
    KVMEM_RETURN_IF_ERROR(host_detail::check_list(src, "src"));
    KVMEM_RETURN_IF_ERROR(host_detail::check_list(dst, "dst"));
    if (src.extent(0) != dst.extent(0)) return invalid_argument("dst length", src.extent(0), dst.extent(0));
    KVMEM_RETURN_IF_ERROR(check_copy_pairs(src.data(), dst.data(), src.extent(0), state.max_slots()));
    const Shape& sh = state.shape();
    const std::int64_t W = state.window_capacity(), D = sh.D, Dv = sh.Dv;
    host::parallel_for(exec, src.extent(0) * sh.Hk, [&](std::int64_t i) {
      const std::int64_t s = src(i / sh.Hk), d = dst(i / sh.Hk), g = i % sh.Hk;
      if (s == d) return;
      const auto a = state.item(s, g), b = state.item(d, g);
      const std::int64_t used = state.slots(s);
      std::copy(a.sk, a.sk + used * D, b.sk);
      std::copy(a.sv, a.sv + used * Dv, b.sv);
      std::copy(a.rho, a.rho + used, b.rho);
      std::copy(a.cnt, a.cnt + used, b.cnt);
      std::copy(a.khat, a.khat + used * D, b.khat);
      std::copy(a.vhat, a.vhat + used * Dv, b.vhat);
      if constexpr (is_row_scaled_v<S>) {
        std::copy(a.khat_scale, a.khat_scale + used, b.khat_scale);
        std::copy(a.vhat_scale, a.vhat_scale + used, b.vhat_scale);
      }
      std::copy(a.wk, a.wk + W * D, b.wk);
      std::copy(a.wv, a.wv + W * Dv, b.wv);
      std::copy(a.wg, a.wg + W, b.wg);
    });
    for (std::int64_t i = 0; i < src.extent(0); ++i) {  // counters after every item: sources are never destinations
      const std::int64_t s = src(i), d = dst(i);
      state.n_data()[d] = state.tokens(s);
      state.cov_data()[d] = state.covered(s);
      state.slots_data()[d] = state.slots(s);
    }
    return Status::ok();
  }

  template <class S, class A>
  static Status export_slot(const host::Executor& /*exec*/, const State<S, A>& state, std::int32_t slot,
                            std::span<std::byte> bytes) {
    KVMEM_RETURN_IF_ERROR(state.check_slot(slot, "slot"));
    const std::size_t need = kvm::export_bytes(state, slot);
    if (bytes.size() < need)
      return invalid_argument("bytes", ">= export_bytes(state, slot) = " + std::to_string(need), bytes.size());
    slot_record::Writer w(bytes.first(need), slot_record::Mechanism::kKvm, record_detail::kFields);
    record_detail::write(state, slot, state.tokens(slot), state.covered(slot), state.slots(slot), w, false);
    return Status::ok();
  }

  template <class S, class A>
  static Status import_slot(const host::Executor& /*exec*/, State<S, A>& state, const Weights& weights,
                            std::int32_t slot, std::span<const std::byte> bytes) {
    KVMEM_RETURN_IF_ERROR(state.check_slot(slot, "slot"));
    KVMEM_RETURN_IF_ERROR(state.check_workspace(1));  // the readout rebuild uses work item 0
    const Shape& sh = state.shape();
    KVMEM_RETURN_IF_ERROR(validate(weights, sh));
    record_detail::Parsed<A> rec;
    KVMEM_RETURN_IF_ERROR(record_detail::read(state, bytes, rec));
    // ---- every check passed: write the slot ----
    host_detail::load_weights(state, weights);
    const std::int64_t D = sh.D, Dv = sh.Dv, W = state.window_capacity(), S_ = rec.slots;
    const std::int64_t w0 = state.params().geometry().bswa_begin(rec.n), held = rec.n - w0;
    const host_detail::Call<S, A, float, float> call{state, nullptr};
    for (std::int64_t g = 0; g < sh.Hk; ++g) {
      const auto it = state.item(slot, g, 0);
      std::copy_n(rec.sk.begin() + g * S_ * D, S_ * D, it.sk);
      std::copy_n(rec.sv.begin() + g * S_ * Dv, S_ * Dv, it.sv);
      std::copy_n(rec.rho.begin() + g * S_, S_, it.rho);
      std::copy_n(rec.cnt.begin() + g * S_, S_, it.cnt);
      call.refresh(it, 0, S_);  // the readout copies K^, V^ (spec 4.4), as the source computed them
      for (std::int64_t i = 0; i < held; ++i) {
        const std::int64_t ring = (w0 + i) % W, at = g * held + i;
        for (std::int64_t d = 0; d < D; ++d)
          it.wk[ring * D + d] = store_as<window_t<S>>(rec.wk[std::size_t(at * D + d)]);
        for (std::int64_t d = 0; d < Dv; ++d)
          it.wv[ring * Dv + d] = store_as<window_t<S>>(rec.wv[std::size_t(at * Dv + d)]);
        it.wg[ring] = rec.wg[std::size_t(at)];
      }
    }
    state.n_data()[slot] = rec.n;
    state.cov_data()[slot] = rec.cov;
    state.slots_data()[slot] = rec.slots;
    return Status::ok();
  }

  template <class S, class A>
  static Status truncate(const host::Executor& /*exec*/, State<S, A>& state, std::int32_t slot, std::int64_t n) {
    KVMEM_RETURN_IF_ERROR(state.check_slot(slot, "slot"));
    KVMEM_RETURN_IF_ERROR(truncate_check(state, slot, n));
    const std::int64_t n_new = state.tokens(slot) - n;
    const std::int64_t cov = state.params().geometry().covered(n_new);
    if (state.covered(slot) != cov) state.slots_data()[slot] = cov;  // initial slots only: one per token (spec 4.3)
    state.cov_data()[slot] = cov;
    state.n_data()[slot] = n_new;
    return Status::ok();
  }
};

}  // namespace kvmem::kvm
