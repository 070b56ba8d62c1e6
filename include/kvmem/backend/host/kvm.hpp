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
// Executor::exact selects the arithmetic. Exact: the scalar kernel/ bodies above, bitwise equal
// decode and prefill. Fast (the default, with Eigen available, backend/host/fast_path.hpp): the
// readout and the update's novelty and routing logits are Eigen matrix products over tiles. Every
// update still runs the same function on the same data in decode and prefill, so routes and state
// agree bitwise; readout outputs agree within fp32 rounding, as they do with the fp64 reference.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <new>
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
#include "kvmem/kvm/state.hpp"

namespace kvmem::kvm {

namespace host_detail {

template <class S, class A, class In, class Out>
struct Call {
  const State<S, A>& st;
  TensorView<const In, 4> q;     // [B,Hq,T,D]
  TensorView<const In, 4> k;     // [B,Hk,T,D]
  TensorView<const In, 4> v;     // [B,Hk,T,Dv]
  TensorView<const In, 3> gate;  // [B,Hk,T]
  TensorView<Out, 4> out;        // [B,T,Hq,Dv]
  RouteLog* log;
  bool exact = true;  // Executor::exact; false: readout and routing logits may take the Eigen tile paths

  const Params& p() const { return st.params(); }
  std::int64_t D() const { return st.shape().D; }
  std::int64_t Dv() const { return st.shape().Dv; }

  // K^_j = LN_s(Sk_j) and V^_j for slots [j0, j1) (spec 4.4 steps 1-2), into the readout copies.
  void refresh(const ItemView<S, A>& it, std::int64_t j0, std::int64_t j1) const {
    const A eps = static_cast<A>(p().ln_eps);
    for (std::int64_t j = j0; j < j1; ++j) {
      kernel::layer_norm(it.sk + j * D(), D(), st.ln_w(), st.ln_b(), eps, it.row);
      for (std::int64_t d = 0; d < D(); ++d) it.khat[j * D() + d] = store_as<S>(it.row[d]);
      kernel::value_readout(it.sv + j * Dv(), Dv(), it.rho[j], it.cnt[j], p().value_radius, it.vhat + j * Dv());
    }
  }

  // Spec 4.3: the token at ring slot `ring` founds slot j (init rule; rho from the raw v).
  void init_slot(const ItemView<S, A>& it, std::int64_t ring, std::int64_t j) const {
    const A eps = static_cast<A>(p().ln_eps);
    A* sk = it.sk + j * D();
    A* sv = it.sv + j * Dv();
    const S* kr = it.wk + ring * D();
    const S* vr = it.wv + ring * Dv();
    kernel::preprocess_key(kr, D(), p().rope_dims, st.ln_w(), st.ln_b(), eps, sk);
    for (std::int64_t d = 0; d < Dv(); ++d) sv[d] = load_as<A>(vr[d]);
    it.rho[j] = kernel::norm2<A>(sv, Dv());
    it.cnt[j] = A(1);
    if (p().gate_initial) {  // Sk = kg, Sv = vg: each gated only when its merge gate flag is on (spec 4.2)
      const A g = it.wg[ring];
      if (p().merge_gate_keys)
        for (std::int64_t d = 0; d < D(); ++d) sk[d] *= g;
      if (p().merge_gate_values)
        for (std::int64_t d = 0; d < Dv(); ++d) sv[d] *= g;
    }
    refresh(it, j, j + 1);
  }

  // Spec 4.5: U(tokens [a, a+C) read from the ring, N, avail). Returns the new |S|.
  std::int64_t update(const ItemView<S, A>& it, std::int64_t a, std::int64_t N, std::int64_t avail,
                      std::int64_t S_cur, std::vector<UpdateRoute>* routes) const {
    const Params& pr = p();
    const std::int64_t C = pr.chunk, W = pr.window();
    const A eps = static_cast<A>(pr.ln_eps);
    // step 1: k0, kg, vg
    for (std::int64_t i = 0; i < C; ++i) {
      const std::int64_t ring = (a + i) % W;
      const A g = it.wg[ring];
      kernel::preprocess_key(it.wk + ring * D(), D(), pr.rope_dims, st.ln_w(), st.ln_b(), eps, it.k0 + i * D());
      for (std::int64_t d = 0; d < D(); ++d)
        it.kg[i * D() + d] = pr.merge_gate_keys ? g * it.k0[i * D() + d] : it.k0[i * D() + d];
      for (std::int64_t d = 0; d < Dv(); ++d) {
        const A x = load_as<A>(it.wv[ring * Dv() + d]);
        it.vg[i * Dv() + d] = pr.merge_gate_values ? g * x : x;
      }
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
      const std::int64_t ring = (a + i) % W;
      A* sk = it.sk + j * D();
      A* sv = it.sv + j * Dv();
      for (std::int64_t d = 0; d < D(); ++d) sk[d] = pr.gate_appends ? it.kg[i * D() + d] : it.k0[i * D() + d];
      for (std::int64_t d = 0; d < Dv(); ++d)
        sv[d] = pr.gate_appends ? it.vg[i * Dv() + d] : load_as<A>(it.wv[ring * Dv() + d]);
      it.rho[j] = kernel::norm2<A>(sv, Dv());
      it.cnt[j] = A(1);
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
      for (std::int64_t j = pr.sink; j < S_new; ++j)
        kernel::scatter_into_slot(it.kg, it.vg, it.target, C, D(), Dv(), j, it.sk + j * D(), it.sv + j * Dv(),
                                  it.cnt + j);
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
          kernel::layer_norm(it.sk + (j0 + r) * D(), D(), st.ln_w(), st.ln_b(), eps, ws.ln_rows.data() + r * D());
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
  void attend_segment(const ItemView<S, A>& it, std::int64_t b, std::int64_t g, std::int64_t n0,
                      std::int64_t t0, std::int64_t t1, std::int64_t w, std::int64_t S_cur) const {
    const Params& pr = p();
    const std::int64_t rep = st.shape().rep(), W = pr.window();
    const std::int64_t rows = (t1 - t0) * rep;
    const A scale = static_cast<A>(pr.scale > 0 ? pr.scale : 1.0 / std::sqrt(double(D())));
    for (std::int64_t r = 0; r < rows; ++r) {
      const std::int64_t t = t0 + r / rep, h = g * rep + r % rep;
      const In* qr = &q(b, h, t - n0, 0);
      for (std::int64_t d = 0; d < D(); ++d) it.qblock[r * D() + d] = load_as<A>(qr[d]);
      new (it.soft + r) OnlineSoftmax<A>();
      for (std::int64_t d = 0; d < Dv(); ++d) it.acc[r * Dv() + d] = A(0);
    }
#if KVMEM_HOST_EIGEN
    if constexpr (std::is_same_v<A, float>) {
      if (!exact) {
        attend_segment_tiles(it, g, t0, t1, w, S_cur, rows, scale);
        return finish_segment(it, b, g, n0, t0, rows);
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
                                    D(), it.vhat + j0 * Dv(), Dv(), Dv(), n);
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
        kernel::attend_accumulate(it.soft[r], it.acc + r * Dv(), it.qblock + r * D(), D(), ls, it.wk + ring * D(),
                                  D(), it.wv + ring * Dv(), Dv(), Dv(), n);
      }
      a = e;
    }
    finish_segment(it, b, g, n0, t0, rows);
  }

  void finish_segment(const ItemView<S, A>& it, std::int64_t b, std::int64_t g, std::int64_t n0, std::int64_t t0,
                      std::int64_t rows) const {
    const std::int64_t rep = st.shape().rep();
    for (std::int64_t r = 0; r < rows; ++r) {
      const std::int64_t t = t0 + r / rep, h = g * rep + r % rep;
      Out* o = &out(b, t - n0, h, 0);
      const A inv = it.soft[r].normaliser();
      for (std::int64_t d = 0; d < Dv(); ++d) o[d] = static_cast<Out>(it.acc[r * Dv() + d] * inv);
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
      host::eigen::attend_range(blk, it.khat, D(), it.vhat, Dv(), 0, S_cur, nullptr, ws);
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

  // The whole token range of one (sequence b, KV head g).
  void run_item(std::int64_t b, std::int64_t g, std::int64_t len) const {
    const Params& pr = p();
    const Geometry geo = pr.geometry();
    const std::int64_t C = pr.chunk, W = pr.window();
    const ItemView<S, A> it = st.item(b, g);
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
        const In* kr = &k(b, g, t - n0, 0);
        const In* vr = &v(b, g, t - n0, 0);
        for (std::int64_t d = 0; d < D(); ++d) it.wk[ring * D() + d] = store_as<S>(static_cast<A>(kr[d]));
        for (std::int64_t d = 0; d < Dv(); ++d) it.wv[ring * Dv() + d] = store_as<S>(static_cast<A>(vr[d]));
        it.wg[ring] = static_cast<A>(gate(b, g, t - n0));
        if (t < C && t >= cov) {
          init_slot(it, ring, S_cur++);
          cov = t + 1;
        }
      }
      attend_segment(it, b, g, n0, t0, t1, w, S_cur);
      t0 = t1;
    }
    const std::int64_t rep = st.shape().rep();
    for (std::int64_t t = len; t < out.extent(1); ++t)  // rows past this sequence's length: zeros
      for (std::int64_t h = g * rep; h < (g + 1) * rep; ++h)
        for (std::int64_t d = 0; d < Dv(); ++d) out(b, t, h, d) = Out(0);
    std::int64_t* res = st.item_result() + 2 * (b * st.shape().Hk + g);
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

}  // namespace host_detail

template <>
struct Backend<host::Executor> {
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
    if (!q.is_contiguous() || !k.is_contiguous() || !v.is_contiguous() || !gate.is_contiguous() ||
        !out.is_contiguous())
      return invalid_argument("q, k, v, gate, out", "contiguous row-major views", "a strided view");
    KVMEM_RETURN_IF_ERROR(validate(weights, sh));
    for (std::int64_t b = 0; b < B; ++b) {
      const std::int64_t len = lengths ? lengths[b] : T;
      if (len < 0 || len > T)
        return invalid_argument("lengths[" + std::to_string(b) + "]", "0 <= length <= T = " + std::to_string(T), len);
      if (state.tokens(b) + len > sh.n_ctx)
        return {StatusCode::kOutOfRange, "sequence " + std::to_string(b) + ": " + std::to_string(state.tokens(b)) +
                                             " + " + std::to_string(len) + " tokens exceed the state's n_ctx = " +
                                             std::to_string(sh.n_ctx)};
      KVMEM_RETURN_IF_ERROR(host_detail::check_values(q, b, len, "q", false));
      KVMEM_RETURN_IF_ERROR(host_detail::check_values(k, b, len, "k", false));
      KVMEM_RETURN_IF_ERROR(host_detail::check_values(v, b, len, "v", false));
      const TensorView<const In, 4> g4(gate.data(), {B, sh.Hk, T, 1});
      KVMEM_RETURN_IF_ERROR(host_detail::check_values(g4, b, len, "gate", true));
    }
    // ---- run ----
    for (std::int64_t d = 0; d < sh.D; ++d) {
      state.ln_w()[d] = static_cast<A>(weights.ln_weight(d));
      state.ln_b()[d] = static_cast<A>(weights.ln_bias(d));
    }
    for (std::int64_t h = 0; h < sh.Hq; ++h) {
      state.tau_s()[h] = static_cast<A>(weights.tau_state(h));
      state.tau_w()[h] = static_cast<A>(weights.tau_bswa(h));
    }
    if (log != nullptr) log->items.resize(std::size_t(B * sh.Hk));
    static_assert(State<S, A>::kRowBlock >= kernel::kRouteRows, "kvm State: row workspace below the routing block");
    const host_detail::Call<S, A, In, Out> call{state, q, k, v, gate, out, log, exec.exact};
    host::parallel_for(exec, B * sh.Hk, [&](std::int64_t i) {
      const std::int64_t b = i / sh.Hk, g = i % sh.Hk;
      call.run_item(b, g, lengths ? lengths[b] : T);
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
};

}  // namespace kvmem::kvm
