// SPDX-License-Identifier: Apache-2.0
#pragma once
// KV Means, float64 reference: the test oracle and readable documentation of the KV Means math (docs/math.md).
// Written formula by formula after the spec, slow and obviously right. It shares no code with
// kernel/ (DESIGN.md section 1: an oracle that shares code with what it checks checks nothing); it
// uses only core/, policy/ and kvm/schedule.hpp.
//
// Memory order (spec section 2): q [B,Hq,T,D], k [B,Hk,T,D], v [B,Hk,T,Dv], gate [B,Hk,T],
// out [B,T,Hq,Dv]; state [B,Hk,S,D] / [B,Hk,S,Dv] / [B,Hk,S].

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <string>
#include <utility>
#include <vector>

#include "kvmem/core/numeric.hpp"
#include "kvmem/core/status.hpp"
#include "kvmem/kvm/schedule.hpp"
#include "kvmem/policy/budget.hpp"

namespace kvmem::reference::kvm {

struct Config {
  std::int64_t B = 1, T = 0, Hq = 1, Hk = 1, D = 0, Dv = 0;
  std::int64_t chunk = 256, window_chunks = 2, sink = 1, rope_dims = 64;
  kvmem::budget::Any budget;
  bool merge_gate_keys = true, merge_gate_values = true, head_temps = true, value_radius = true, gate_appends = false,
       gate_initial = false;
  double ln_eps = 1e-5;
  double scale = 0;  // 0 -> 1/sqrt(D)
  // The authors' eager readout rounds V^ to bf16 (spec 7.1). Off by default: kvmem does not
  // replicate it; on, it reproduces bf16-cast reference files.
  bool round_value_readout_bf16 = false;
};

// Shapes as spec section 2.
struct Inputs {
  std::vector<double> q;          // [B,Hq,T,D]
  std::vector<double> k;          // [B,Hk,T,D]
  std::vector<double> v;          // [B,Hk,T,Dv]
  std::vector<double> gate;       // [B,Hk,T]
  std::vector<double> ln_weight;  // [D]
  std::vector<double> ln_bias;    // [D]
  std::vector<double> tau_state;  // [Hq]
  std::vector<double> tau_bswa;   // [Hq]
};

struct Result {
  std::vector<double> out;                              // [B,T,Hq,Dv]
  std::vector<double> state_k, state_v, state_rho;      // [B,Hk,S,D], [B,Hk,S,Dv], [B,Hk,S]
  std::int64_t slots = 0;                               // S
  std::vector<std::int64_t> slots_after_update;         // [U]
  std::vector<std::vector<std::int64_t>> route_append;  // per update u (index u-1): [B,Hk,n_u]
  std::vector<std::vector<std::int64_t>> route_merge;   // per update: [B,Hk,C], target slot or -1
  std::vector<double> state_cnt;                        // [B,Hk,S] merge counts (count mode)
  std::vector<double> lse;  // [B,T,Hq]: natural log-sum-exp of each query's scaled logits (state and window)
};

namespace detail {

using Row = std::vector<double>;

inline double scale_of(const Config& c) {
  return c.scale > 0 ? c.scale : 1.0 / std::sqrt(double(c.D));
}
inline kvmem::kvm::Geometry geometry_of(const Config& c) {
  return {c.chunk, c.window_chunks};
}

inline double dot(const Row& a, const Row& b) {
  double s = 0;
  for (std::size_t i = 0; i < a.size(); ++i) s += a[i] * b[i];
  return s;
}
inline double norm2(const Row& a) {
  return std::sqrt(dot(a, a));
}

// LN_s(x) = w (x - mean) / sqrt(var + eps) + b, biased variance over D (spec 4.2 step 2).
inline Row ln_s(const Config& c, const Inputs& in, const Row& x) {
  const double n = double(x.size());
  double mean = 0;
  for (double e : x) mean += e;
  mean /= n;
  double var = 0;
  for (double e : x) var += (e - mean) * (e - mean);
  var /= n;
  const double inv = 1.0 / std::sqrt(var + c.ln_eps);
  Row y(x.size());
  for (std::size_t d = 0; d < x.size(); ++d) y[d] = in.ln_weight[d] * (x[d] - mean) * inv + in.ln_bias[d];
  return y;
}

// One (batch row, kv head): the slots and everything the cache keeps (spec 4.3, 4.7).
struct Slots {
  std::vector<Row> sk, sv;  // summed keys [n,D], summed values [n,Dv]
  Row rho, cnt;             // founder value norm; merge count (count mode)
};

struct Problem {
  const Config& c;
  const Inputs& in;
  std::int64_t b, g;  // batch row, kv head

  Row k(std::int64_t t) const {
    const auto* p = in.k.data() + ((b * c.Hk + g) * c.T + t) * c.D;
    return Row(p, p + c.D);
  }
  Row v(std::int64_t t) const {
    const auto* p = in.v.data() + ((b * c.Hk + g) * c.T + t) * c.Dv;
    return Row(p, p + c.Dv);
  }
  double gate(std::int64_t t) const { return in.gate[(b * c.Hk + g) * c.T + t]; }
  Row q(std::int64_t h, std::int64_t t) const {
    const auto* p = in.q.data() + ((b * c.Hq + h) * c.T + t) * c.D;
    return Row(p, p + c.D);
  }
  // spec 4.2: k~ (rope channels zeroed), k0 = LN_s(k~); kg, vg.
  Row k0(std::int64_t t) const {
    Row kt = k(t);
    for (std::int64_t d = 0; d < c.rope_dims; ++d) kt[std::size_t(d)] = 0;
    return ln_s(c, in, kt);
  }
  Row kg(std::int64_t t) const {
    Row r = k0(t);
    if (c.merge_gate_keys)
      for (auto& e : r) e *= gate(t);
    return r;
  }
  Row vg(std::int64_t t) const {
    Row r = v(t);
    if (c.merge_gate_values)
      for (auto& e : r) e *= gate(t);
    return r;
  }
};

// spec 4.3: one slot per token (init, and decode's direct appends while n <= C).
inline void init_slot(const Problem& p, Slots& s, std::int64_t t) {
  Row key = p.k0(t), val = p.v(t);
  const double rho = norm2(val);  // always from the raw v, also with gate_initial (spec 7.5)
  if (p.c.gate_initial) {
    key = p.kg(t);
    val = p.vg(t);
  }
  s.sk.push_back(key);
  s.sv.push_back(val);
  s.rho.push_back(rho);
  s.cnt.push_back(1.0);
}

struct UpdateLog {
  std::vector<std::int64_t> appended;  // absolute token ids, ascending
  std::vector<std::int64_t> merged;    // [C]: target slot or -1
};

// spec 4.5: U(tokens [a, a+C), N, avail).
inline UpdateLog update(const Problem& p, Slots& s, std::int64_t a, std::int64_t N, std::int64_t avail) {
  const Config& c = p.c;
  const std::int64_t C = c.chunk;
  const auto cur = std::int64_t(s.sk.size());
  // spec 3.1: target and n_app
  const std::int64_t target = c.budget.slots(N, avail, cur);
  const std::int64_t n_app = std::min(target - cur, C);

  std::vector<bool> is_app(std::size_t(C), false);
  if (n_app > 0) {
    // step 2: novelty score_i = max_j k0_i . LN_s(Sk_j) over all current slots (ungated k0)
    std::vector<Row> khat;
    for (const auto& row : s.sk) khat.push_back(ln_s(c, p.in, row));
    std::vector<std::pair<double, std::int64_t>> scored;
    for (std::int64_t i = 0; i < C; ++i) {
      const Row k0 = p.k0(a + i);
      double best = -INFINITY;
      for (const auto& kh : khat) best = std::max(best, dot(k0, kh));
      scored.emplace_back(best, i);
    }
    std::sort(scored.begin(), scored.end());  // (score asc, index asc)
    for (std::int64_t r = 0; r < n_app; ++r) is_app[std::size_t(scored[std::size_t(r)].second)] = true;
  }
  UpdateLog log;
  log.merged.assign(std::size_t(C), -1);
  // step 3: append in increasing token order
  for (std::int64_t i = 0; i < C; ++i) {
    if (!is_app[std::size_t(i)]) continue;
    const std::int64_t t = a + i;
    Row key = c.gate_appends ? p.kg(t) : p.k0(t);
    Row val = c.gate_appends ? p.vg(t) : p.v(t);
    s.sk.push_back(key);
    s.rho.push_back(norm2(val));
    s.sv.push_back(std::move(val));
    s.cnt.push_back(1.0);
    log.appended.push_back(t);
  }
  // step 4: merge by argmax over non-sink slots of the expanded state, one scatter against K^+
  std::vector<Row> khat_plus;
  for (const auto& row : s.sk) khat_plus.push_back(ln_s(c, p.in, row));
  const auto n_slots = std::int64_t(s.sk.size());
  std::vector<Row> add_k(std::size_t(n_slots), Row(std::size_t(c.D), 0.0));
  std::vector<Row> add_v(std::size_t(n_slots), Row(std::size_t(c.Dv), 0.0));
  std::vector<double> add_n(std::size_t(n_slots), 0.0);
  for (std::int64_t i = 0; i < C; ++i) {
    if (is_app[std::size_t(i)]) continue;
    const Row kg = p.kg(a + i), vg = p.vg(a + i);
    std::int64_t best_j = -1;
    double best = -INFINITY;
    for (std::int64_t j = c.sink; j < n_slots; ++j) {
      const double l = dot(kg, khat_plus[std::size_t(j)]);
      if (best_j < 0 || l > best) {  // strict: ties keep the smallest j
        best = l;
        best_j = j;
      }
    }
    log.merged[std::size_t(i)] = best_j;
    for (std::int64_t d = 0; d < c.D; ++d) add_k[std::size_t(best_j)][std::size_t(d)] += kg[std::size_t(d)];
    for (std::int64_t d = 0; d < c.Dv; ++d) add_v[std::size_t(best_j)][std::size_t(d)] += vg[std::size_t(d)];
    add_n[std::size_t(best_j)] += 1.0;
  }
  for (std::int64_t j = 0; j < n_slots; ++j) {
    for (std::int64_t d = 0; d < c.D; ++d)
      s.sk[std::size_t(j)][std::size_t(d)] += add_k[std::size_t(j)][std::size_t(d)];
    for (std::int64_t d = 0; d < c.Dv; ++d)
      s.sv[std::size_t(j)][std::size_t(d)] += add_v[std::size_t(j)][std::size_t(d)];
    s.cnt[std::size_t(j)] += add_n[std::size_t(j)];
  }
  return log;
}

// spec 4.4: one joint softmax over state slots (optional) and window keys [w, t].
// `keys`/`vals` hold the raw window rows for positions w..t.
inline Row readout(const Problem& p, std::int64_t h, const Row& q, const Slots* s, const std::vector<Row>& keys,
                   const std::vector<Row>& vals, double* lse = nullptr) {
  const Config& c = p.c;
  const double scale = scale_of(c);
  const double ts = c.head_temps ? p.in.tau_state[std::size_t(h)] : 1.0;
  const double tw = c.head_temps ? p.in.tau_bswa[std::size_t(h)] : 1.0;
  std::vector<double> logits;
  std::vector<Row> values;
  if (s != nullptr) {
    for (std::size_t j = 0; j < s->sk.size(); ++j) {
      const Row kh = ln_s(c, p.in, s->sk[j]);  // K^_j
      Row vh(std::size_t(c.Dv));               // V^_j
      if (c.value_radius) {
        const double n = std::max(norm2(s->sv[j]), 1e-12);
        for (std::size_t d = 0; d < vh.size(); ++d) vh[d] = s->rho[j] * s->sv[j][d] / n;
      } else {
        for (std::size_t d = 0; d < vh.size(); ++d) vh[d] = s->sv[j][d] / s->cnt[j];
      }
      if (c.round_value_readout_bf16)
        for (auto& e : vh) e = double(float(kvmem::bf16(float(e))));
      logits.push_back(ts * dot(q, kh) * scale);
      values.push_back(std::move(vh));
    }
  }
  for (std::size_t i = 0; i < keys.size(); ++i) {
    logits.push_back(tw * dot(q, keys[i]) * scale);
    values.push_back(vals[i]);
  }
  const double mx = *std::max_element(logits.begin(), logits.end());
  double z = 0;
  for (double l : logits) z += std::exp(l - mx);
  if (lse != nullptr) *lse = mx + std::log(z);  // log sum_j exp(l_j)
  Row o(std::size_t(c.Dv), 0.0);
  for (std::size_t i = 0; i < logits.size(); ++i) {
    const double pr = std::exp(logits[i] - mx) / z;
    for (std::size_t d = 0; d < o.size(); ++d) o[d] += pr * values[i][d];
  }
  return o;
}

inline void store_out(const Config& c, std::vector<double>& out, std::int64_t b, std::int64_t t, std::int64_t h,
                      const Row& o) {
  std::copy(o.begin(), o.end(), out.begin() + ((b * c.T + t) * c.Hq + h) * c.Dv);
}

// Window rows [w, t] of one (b, g).
inline void window_rows(const Problem& p, std::int64_t w, std::int64_t t, std::vector<Row>& keys,
                        std::vector<Row>& vals) {
  keys.clear();
  vals.clear();
  for (std::int64_t s = w; s <= t; ++s) {
    keys.push_back(p.k(s));
    vals.push_back(p.v(s));
  }
}

inline bool all_finite(const std::vector<double>& x) {
  return std::all_of(x.begin(), x.end(), [](double e) { return std::isfinite(e); });
}

}  // namespace detail

// Shapes, configuration and values (spec 2, 3; DESIGN.md 3: rejected before any state changes).
inline Status validate(const Config& c, const Inputs& in) {
  if (c.B < 1) return invalid_argument("B", ">= 1", c.B);
  if (c.T < 0) return invalid_argument("T", ">= 0", c.T);
  if (c.Hk < 1) return invalid_argument("Hk", ">= 1", c.Hk);
  if (c.Hq < 1 || c.Hq % c.Hk != 0)
    return invalid_argument("Hq", "a positive multiple of Hk = " + std::to_string(c.Hk), c.Hq);
  if (c.D < 1) return invalid_argument("D", ">= 1", c.D);
  if (c.Dv < 1) return invalid_argument("Dv", ">= 1", c.Dv);
  if (c.chunk < 1) return invalid_argument("chunk", ">= 1", c.chunk);
  if (c.window_chunks < 1) return invalid_argument("window_chunks", ">= 1", c.window_chunks);
  if (c.sink < 0 || c.sink >= c.chunk)
    return invalid_argument("sink", "0 <= sink < chunk = " + std::to_string(c.chunk), c.sink);
  if (c.rope_dims < 0 || c.rope_dims > c.D)
    return invalid_argument("rope_dims", "0 <= rope_dims <= D = " + std::to_string(c.D), c.rope_dims);
  KVMEM_RETURN_IF_ERROR(c.budget.validate());
  const std::int64_t max_slots = c.budget.maximum();
  if (max_slots < c.chunk)
    return invalid_argument("budget maximum", ">= chunk = " + std::to_string(c.chunk), max_slots);
  if (!(c.ln_eps > 0) || !std::isfinite(c.ln_eps)) return invalid_argument("ln_eps", "finite and > 0", c.ln_eps);
  if (!(c.scale >= 0) || !std::isfinite(c.scale))
    return invalid_argument("scale", "finite and >= 0 (0: 1/sqrt(D))", c.scale);
  const auto check = [](const char* name, const std::vector<double>& x, std::int64_t n) -> Status {
    if (std::int64_t(x.size()) != n) return invalid_argument(std::string(name) + " size", n, x.size());
    if (!detail::all_finite(x)) return invalid_argument(name, "finite values", "NaN or Inf");
    return Status::ok();
  };
  KVMEM_RETURN_IF_ERROR(check("q", in.q, c.B * c.Hq * c.T * c.D));
  KVMEM_RETURN_IF_ERROR(check("k", in.k, c.B * c.Hk * c.T * c.D));
  KVMEM_RETURN_IF_ERROR(check("v", in.v, c.B * c.Hk * c.T * c.Dv));
  KVMEM_RETURN_IF_ERROR(check("gate", in.gate, c.B * c.Hk * c.T));
  KVMEM_RETURN_IF_ERROR(check("ln_weight", in.ln_weight, c.D));
  KVMEM_RETURN_IF_ERROR(check("ln_bias", in.ln_bias, c.D));
  KVMEM_RETURN_IF_ERROR(check("tau_state", in.tau_state, c.Hq));
  KVMEM_RETURN_IF_ERROR(check("tau_bswa", in.tau_bswa, c.Hq));
  for (double g : in.gate)
    if (!(g > 0)) return invalid_argument("gate", "values > 0", g);
  return Status::ok();
}

// One prefill over all T tokens (spec 4.6), with the routing hooks of spec 2.
// Throws kvmem::Error on invalid input. `in.q` may be empty (state-only): out is then empty.
inline Result prefill(const Config& c, const Inputs& in_arg) {
  Inputs in_copy;
  const bool state_only = in_arg.q.empty() && c.T > 0;
  const Inputs* in_ptr = &in_arg;
  if (state_only) {  // validate with zero queries, then never read them
    in_copy = in_arg;
    in_copy.q.assign(std::size_t(c.B * c.Hq * c.T * c.D), 0.0);
    in_ptr = &in_copy;
  }
  const Inputs& in = *in_ptr;
  throw_if_error(validate(c, in));
  const auto geo = detail::geometry_of(c);
  const std::int64_t T = c.T, C = c.chunk, rep = c.Hq / c.Hk, U = geo.updates(T);
  Result r;
  if (!state_only) {
    r.out.assign(std::size_t(c.B * T * c.Hq * c.Dv), 0.0);
    r.lse.assign(std::size_t(c.B * T * c.Hq), 0.0);
  }
  r.route_append.resize(std::size_t(U));
  r.route_merge.assign(std::size_t(U), std::vector<std::int64_t>(std::size_t(c.B * c.Hk * C), -1));
  r.slots_after_update.assign(std::size_t(U), 0);
  std::vector<detail::Slots> all(std::size_t(c.B * c.Hk));
  std::vector<detail::Row> keys, vals;
  for (std::int64_t b = 0; b < c.B; ++b) {
    for (std::int64_t g = 0; g < c.Hk; ++g) {
      const detail::Problem p{c, in, b, g};
      detail::Slots& s = all[std::size_t(b * c.Hk + g)];
      const std::int64_t F = std::min(T, geo.window());
      if (!state_only)
        for (std::int64_t t = 0; t < F; ++t) {  // plain causal attention, no state
          detail::window_rows(p, 0, t, keys, vals);
          for (std::int64_t hh = 0; hh < rep; ++hh) {
            const std::int64_t h = g * rep + hh;
            detail::store_out(
                c, r.out, b, t, h,
                detail::readout(p, h, p.q(h, t), nullptr, keys, vals, &r.lse[std::size_t((b * T + t) * c.Hq + h)]));
          }
        }
      for (std::int64_t j = 0; j < std::min(T, C); ++j) detail::init_slot(p, s, j);
      std::int64_t u = 0;
      for (std::int64_t qb = F; qb < T; qb += C) {
        const std::int64_t qe = std::min(T, qb + C);
        const std::int64_t w = geo.bswa_begin(qe);
        if (!state_only)
          for (std::int64_t t = qb; t < qe; ++t) {
            detail::window_rows(p, w, t, keys, vals);
            for (std::int64_t hh = 0; hh < rep; ++hh) {
              const std::int64_t h = g * rep + hh;
              detail::store_out(
                  c, r.out, b, t, h,
                  detail::readout(p, h, p.q(h, t), &s, keys, vals, &r.lse[std::size_t((b * T + t) * c.Hq + h)]));
            }
          }
        const std::int64_t w2 = geo.bswa_begin(std::min(T, qe + C));
        if (w2 > w) {
          const detail::UpdateLog log = detail::update(p, s, w, qe, w2);
          auto& app = r.route_append[std::size_t(u)];
          const std::size_t n_u = log.appended.size();
          if (app.empty()) app.assign(std::size_t(c.B * c.Hk) * n_u, 0);
          std::copy(log.appended.begin(), log.appended.end(),
                    app.begin() + std::ptrdiff_t((b * c.Hk + g) * std::int64_t(n_u)));
          std::copy(log.merged.begin(), log.merged.end(), r.route_merge[std::size_t(u)].begin() + (b * c.Hk + g) * C);
          r.slots_after_update[std::size_t(u)] = std::int64_t(s.sk.size());
          ++u;
        }
      }
    }
  }
  r.slots = std::int64_t(all[0].sk.size());
  r.state_k.assign(std::size_t(c.B * c.Hk * r.slots * c.D), 0.0);
  r.state_v.assign(std::size_t(c.B * c.Hk * r.slots * c.Dv), 0.0);
  r.state_rho.assign(std::size_t(c.B * c.Hk * r.slots), 0.0);
  r.state_cnt.assign(std::size_t(c.B * c.Hk * r.slots), 0.0);
  for (std::int64_t i = 0; i < c.B * c.Hk; ++i) {
    const auto& s = all[std::size_t(i)];
    for (std::int64_t j = 0; j < r.slots; ++j) {
      std::copy(s.sk[std::size_t(j)].begin(), s.sk[std::size_t(j)].end(), r.state_k.begin() + (i * r.slots + j) * c.D);
      std::copy(s.sv[std::size_t(j)].begin(), s.sv[std::size_t(j)].end(), r.state_v.begin() + (i * r.slots + j) * c.Dv);
      r.state_rho[std::size_t(i * r.slots + j)] = s.rho[std::size_t(j)];
      r.state_cnt[std::size_t(i * r.slots + j)] = s.cnt[std::size_t(j)];
    }
  }
  return r;
}

// Prefill of tokens [0, split), then one decode step (spec 4.7) per later token.
// Returns out [B,T,Hq,Dv]. 0 <= split <= T; split = 0 decodes from an empty cache.
inline std::vector<double> prefill_then_decode(const Config& c, const Inputs& in, std::int64_t split) {
  throw_if_error(validate(c, in));
  if (split < 0 || split > c.T)
    throw Error(invalid_argument("split", "0 <= split <= T = " + std::to_string(c.T), split));
  const auto geo = detail::geometry_of(c);
  const std::int64_t C = c.chunk, rep = c.Hq / c.Hk;
  std::vector<double> out(std::size_t(c.B * c.T * c.Hq * c.Dv), 0.0);
  // Prefill part: the same driver on the truncated inputs (spec 4.6), then the cache of spec 4.7.
  Config c0 = c;
  c0.T = split;
  Inputs in0;
  in0.ln_weight = in.ln_weight;
  in0.ln_bias = in.ln_bias;
  in0.tau_state = in.tau_state;
  in0.tau_bswa = in.tau_bswa;
  const auto slice = [&](const std::vector<double>& x, std::int64_t rows, std::int64_t width) {
    std::vector<double> y;
    for (std::int64_t r = 0; r < rows; ++r)
      y.insert(y.end(), x.begin() + r * c.T * width, x.begin() + (r * c.T + split) * width);
    return y;
  };
  in0.q = slice(in.q, c.B * c.Hq, c.D);
  in0.k = slice(in.k, c.B * c.Hk, c.D);
  in0.v = slice(in.v, c.B * c.Hk, c.Dv);
  in0.gate = slice(in.gate, c.B * c.Hk, 1);
  Result pre;
  if (split > 0) {
    pre = prefill(c0, in0);
    for (std::int64_t b = 0; b < c.B; ++b)
      for (std::int64_t t = 0; t < split; ++t)
        std::copy(pre.out.begin() + (b * split + t) * c.Hq * c.Dv, pre.out.begin() + (b * split + t + 1) * c.Hq * c.Dv,
                  out.begin() + (b * c.T + t) * c.Hq * c.Dv);
  }
  std::vector<detail::Row> keys, vals;
  for (std::int64_t b = 0; b < c.B; ++b) {
    for (std::int64_t g = 0; g < c.Hk; ++g) {
      const detail::Problem p{c, in, b, g};
      detail::Slots s;
      for (std::int64_t j = 0; j < pre.slots; ++j) {
        const std::int64_t i = (b * c.Hk + g) * pre.slots + j;
        s.sk.emplace_back(pre.state_k.begin() + i * c.D, pre.state_k.begin() + (i + 1) * c.D);
        s.sv.emplace_back(pre.state_v.begin() + i * c.Dv, pre.state_v.begin() + (i + 1) * c.Dv);
        s.rho.push_back(pre.state_rho[std::size_t(i)]);
        s.cnt.push_back(pre.state_cnt[std::size_t(i)]);
      }
      // Cache after a prefill of T0 tokens: n = T0, cov = max(min(T0,C), bswa_begin(T0)).
      std::int64_t n = split;
      std::int64_t cov = std::max(std::min(split, C), geo.bswa_begin(split));
      for (std::int64_t t = split; t < c.T; ++t) {
        n += 1;  // step 1: the new token has position n - 1 = t
        const std::int64_t tgt = std::min(n, C);
        const std::int64_t w = geo.bswa_begin(n);
        const std::int64_t newcov = std::max(tgt, w);
        if (cov < tgt) {  // step 3
          detail::init_slot(p, s, t);
          cov = tgt;
        }
        if (cov < newcov) {  // step 4: update before attention
          detail::update(p, s, cov, geo.window() + cov, cov + C);
          cov = newcov;
        }
        detail::window_rows(p, w, t, keys, vals);  // step 5/6
        for (std::int64_t hh = 0; hh < rep; ++hh) {
          const std::int64_t h = g * rep + hh;
          detail::store_out(c, out, b, t, h, detail::readout(p, h, p.q(h, t), w > 0 ? &s : nullptr, keys, vals));
        }
      }
    }
  }
  return out;
}

// ---- backward (spec 5): routing constant, everything else by the chain rule ----------------------

struct Grads {
  std::vector<double> dq, dk, dv, dgate;        // like q, k, v, gate
  std::vector<double> d_ln_weight, d_ln_bias;   // [D]
  std::vector<double> d_tau_state, d_tau_bswa;  // [Hq]
};

namespace detail {
// y = LN_s(x): accumulates dx (into dx), dw, db from dy (spec 5, LN_s).
inline void ln_s_backward(const Config& c, const Inputs& in, const Row& x, const Row& dy, Row& dx, Row& dw, Row& db) {
  const double n = double(x.size());
  double mean = 0;
  for (double e : x) mean += e;
  mean /= n;
  double var = 0;
  for (double e : x) var += (e - mean) * (e - mean);
  var /= n;
  const double sigma = std::sqrt(var + c.ln_eps);
  Row xh(x.size()), gh(x.size());
  double mg = 0, mgx = 0;
  for (std::size_t d = 0; d < x.size(); ++d) {
    xh[d] = (x[d] - mean) / sigma;
    gh[d] = dy[d] * in.ln_weight[d];
    dw[d] += dy[d] * xh[d];
    db[d] += dy[d];
    mg += gh[d];
    mgx += gh[d] * xh[d];
  }
  mg /= n;
  mgx /= n;
  for (std::size_t d = 0; d < x.size(); ++d) dx[d] += (gh[d] - mg - xh[d] * mgx) / sigma;
}
}  // namespace detail

// Gradients of sum(out * dout) for one prefill over all T tokens. dout: [B,T,Hq,Dv].
inline Grads backward(const Config& c, const Inputs& in, const std::vector<double>& dout) {
  throw_if_error(validate(c, in));
  if (std::int64_t(dout.size()) != c.B * c.T * c.Hq * c.Dv)
    throw Error(invalid_argument("dout size", c.B * c.T * c.Hq * c.Dv, dout.size()));
  using detail::Row;
  const auto geo = detail::geometry_of(c);
  const std::int64_t T = c.T, C = c.chunk, rep = c.Hq / c.Hk, D = c.D, Dv = c.Dv;
  const double scale = detail::scale_of(c);
  Grads gr;
  gr.dq.assign(in.q.size(), 0.0);
  gr.dk.assign(in.k.size(), 0.0);
  gr.dv.assign(in.v.size(), 0.0);
  gr.dgate.assign(in.gate.size(), 0.0);
  gr.d_ln_weight.assign(std::size_t(D), 0.0);
  gr.d_ln_bias.assign(std::size_t(D), 0.0);
  gr.d_tau_state.assign(std::size_t(c.Hq), 0.0);
  gr.d_tau_bswa.assign(std::size_t(c.Hq), 0.0);
  for (std::int64_t b = 0; b < c.B; ++b) {
    for (std::int64_t g = 0; g < c.Hk; ++g) {
      const detail::Problem p{c, in, b, g};
      // Forward with snapshots: s_0 (init) and s_u after update u, and the routing of each update.
      std::vector<detail::Slots> versions;
      std::vector<detail::UpdateLog> logs;
      std::vector<std::int64_t> first_token;
      detail::Slots s;
      for (std::int64_t j = 0; j < std::min(T, C); ++j) detail::init_slot(p, s, j);
      versions.push_back(s);
      const std::int64_t F = std::min(T, geo.window());
      for (std::int64_t qb = F; qb < T; qb += C) {
        const std::int64_t qe = std::min(T, qb + C), w = geo.bswa_begin(qe);
        const std::int64_t w2 = geo.bswa_begin(std::min(T, qe + C));
        if (w2 > w) {
          logs.push_back(detail::update(p, s, w, qe, w2));
          first_token.push_back(w);
          versions.push_back(s);
        }
      }
      // Gradient w.r.t. each version's (Sk, Sv, rho), from the readouts that read it.
      std::vector<std::vector<Row>> gSk(versions.size()), gSv(versions.size());
      std::vector<Row> grho(versions.size());
      for (std::size_t u = 0; u < versions.size(); ++u) {
        const std::size_t n = versions[u].sk.size();
        gSk[u].assign(n, Row(std::size_t(D), 0.0));
        gSv[u].assign(n, Row(std::size_t(Dv), 0.0));
        grho[u].assign(n, 0.0);
      }
      Row dk0_acc_dummy;
      for (std::int64_t t = 0; t < T; ++t) {
        const std::int64_t chunk = t / C;
        const bool reads_state = chunk >= c.window_chunks;
        const std::int64_t w = reads_state ? (chunk + 1 - c.window_chunks) * C : 0;
        const std::size_t u = reads_state ? std::size_t(chunk - c.window_chunks) : 0;
        const detail::Slots* st = reads_state ? &versions[u] : nullptr;
        // state readout rows of this version
        std::vector<Row> khat, vhat;
        if (st != nullptr)
          for (std::size_t j = 0; j < st->sk.size(); ++j) {
            khat.push_back(detail::ln_s(c, in, st->sk[j]));
            Row vh(static_cast<std::size_t>(Dv));
            if (c.value_radius) {
              const double nn = std::max(detail::norm2(st->sv[j]), 1e-12);
              for (std::size_t d = 0; d < vh.size(); ++d) vh[d] = st->rho[j] * st->sv[j][d] / nn;
            } else {
              for (std::size_t d = 0; d < vh.size(); ++d) vh[d] = st->sv[j][d] / st->cnt[j];
            }
            vhat.push_back(vh);
          }
        std::vector<Row> dkhat(khat.size(), Row(std::size_t(D), 0.0)), dvhat(vhat.size(), Row(std::size_t(Dv), 0.0));
        for (std::int64_t hh = 0; hh < rep; ++hh) {
          const std::int64_t h = g * rep + hh;
          const double ts = c.head_temps ? in.tau_state[std::size_t(h)] : 1.0;
          const double tw = c.head_temps ? in.tau_bswa[std::size_t(h)] : 1.0;
          const Row q = p.q(h, t);
          const double* dO = dout.data() + ((b * T + t) * c.Hq + h) * Dv;
          // logits: slots then window
          std::vector<double> l, qk;
          for (const auto& kh : khat) {
            qk.push_back(detail::dot(q, kh));
            l.push_back(ts * qk.back() * scale);
          }
          for (std::int64_t x = w; x <= t; ++x) {
            qk.push_back(detail::dot(q, p.k(x)));
            l.push_back(tw * qk.back() * scale);
          }
          const double mx = *std::max_element(l.begin(), l.end());
          double z = 0;
          for (double e : l) z += std::exp(e - mx);
          std::vector<double> pr(l.size());
          for (std::size_t i = 0; i < l.size(); ++i) pr[i] = std::exp(l[i] - mx) / z;
          const auto val = [&](std::size_t i) {
            return i < khat.size() ? vhat[i] : p.v(w + std::int64_t(i - khat.size()));
          };
          Row o(std::size_t(Dv), 0.0);
          for (std::size_t i = 0; i < l.size(); ++i) {
            const Row vi = val(i);
            for (std::size_t d = 0; d < o.size(); ++d) o[d] += pr[i] * vi[d];
          }
          double delta = 0;
          for (std::int64_t d = 0; d < Dv; ++d) delta += dO[d] * o[std::size_t(d)];
          double* dq = gr.dq.data() + ((b * c.Hq + h) * T + t) * D;
          for (std::size_t i = 0; i < l.size(); ++i) {
            const Row vi = val(i);
            double dOv = 0;
            for (std::int64_t d = 0; d < Dv; ++d) dOv += dO[d] * vi[std::size_t(d)];
            const double dl = pr[i] * (dOv - delta);
            if (i < khat.size()) {
              for (std::int64_t d = 0; d < D; ++d) {
                dq[d] += scale * dl * ts * khat[i][std::size_t(d)];
                dkhat[i][std::size_t(d)] += dl * ts * q[std::size_t(d)] * scale;
              }
              if (c.head_temps) gr.d_tau_state[std::size_t(h)] += dl * qk[i] * scale;
              for (std::int64_t d = 0; d < Dv; ++d) dvhat[i][std::size_t(d)] += pr[i] * dO[d];
            } else {
              const std::int64_t x = w + std::int64_t(i - khat.size());
              const Row kx = p.k(x);
              double* dk = gr.dk.data() + ((b * c.Hk + g) * T + x) * D;
              double* dv = gr.dv.data() + ((b * c.Hk + g) * T + x) * Dv;
              for (std::int64_t d = 0; d < D; ++d) {
                dq[d] += scale * dl * tw * kx[std::size_t(d)];
                dk[d] += dl * tw * q[std::size_t(d)] * scale;
              }
              if (c.head_temps) gr.d_tau_bswa[std::size_t(h)] += dl * qk[i] * scale;
              for (std::int64_t d = 0; d < Dv; ++d) dv[d] += pr[i] * dO[d];
            }
          }
        }
        // dK^ -> dSk through LN_s; dV^ -> dSv, drho through the radius (or count) readout.
        for (std::size_t j = 0; j < khat.size(); ++j) {
          detail::ln_s_backward(c, in, st->sk[j], dkhat[j], gSk[u][j], gr.d_ln_weight, gr.d_ln_bias);
          if (c.value_radius) {
            const Row& sv = st->sv[j];
            const double nn = detail::norm2(sv);
            if (nn > 1e-12) {
              double udv = 0;
              for (std::size_t d = 0; d < sv.size(); ++d) udv += sv[d] / nn * dvhat[j][d];
              for (std::size_t d = 0; d < sv.size(); ++d)
                gSv[u][j][d] += st->rho[j] / nn * (dvhat[j][d] - sv[d] / nn * udv);
              grho[u][j] += udv;
            } else {
              for (std::size_t d = 0; d < sv.size(); ++d) {
                gSv[u][j][d] += st->rho[j] * dvhat[j][d] / 1e-12;
                grho[u][j] += sv[d] * dvhat[j][d] / 1e-12;
              }
            }
          } else {
            for (std::size_t d = 0; d < st->sv[j].size(); ++d) gSv[u][j][d] += dvhat[j][d] / st->cnt[j];
          }
        }
      }
      // Per-token gradients of k0, kg, v (raw), vg; then gates, LN_s and the key.
      std::vector<Row> dk0(std::size_t(T), Row(std::size_t(D), 0.0)), dkg(std::size_t(T), Row(std::size_t(D), 0.0));
      std::vector<Row> dvr(std::size_t(T), Row(std::size_t(Dv), 0.0)), dvg(std::size_t(T), Row(std::size_t(Dv), 0.0));
      const auto add = [](Row& a, const Row& x, double f = 1.0) {
        for (std::size_t d = 0; d < a.size(); ++d) a[d] += f * x[d];
      };
      const auto radius_grad = [&](Row& dvv, const Row& vv, double drho) {  // d||v|| = v/||v||
        const double nn = detail::norm2(vv);
        if (nn > 0) add(dvv, vv, drho / nn);
      };
      for (std::size_t u = versions.size(); u-- > 1;) {
        // G_u is complete (own readouts + carried from u+1); carry to s_{u-1} and distribute update u.
        const detail::UpdateLog& lg = logs[u - 1];
        const std::int64_t a = first_token[u - 1];
        const std::size_t before = versions[u - 1].sk.size();
        for (std::size_t j = 0; j < before; ++j) {
          add(gSk[u - 1][j], gSk[u][j]);
          add(gSv[u - 1][j], gSv[u][j]);
          grho[u - 1][j] += grho[u][j];
        }
        for (std::size_t r = 0; r < lg.appended.size(); ++r) {
          const std::int64_t i = lg.appended[r];
          const std::size_t slot = before + r;
          if (c.gate_appends) {
            add(dkg[std::size_t(i)], gSk[u][slot]);
            add(dvg[std::size_t(i)], gSv[u][slot]);
            radius_grad(dvg[std::size_t(i)], p.vg(i), grho[u][slot]);
          } else {
            add(dk0[std::size_t(i)], gSk[u][slot]);
            add(dvr[std::size_t(i)], gSv[u][slot]);
            radius_grad(dvr[std::size_t(i)], p.v(i), grho[u][slot]);
          }
        }
        for (std::int64_t i = 0; i < C; ++i) {
          const std::int64_t j = lg.merged[std::size_t(i)];
          if (j < 0) continue;
          add(dkg[std::size_t(a + i)], gSk[u][std::size_t(j)]);
          add(dvg[std::size_t(a + i)], gSv[u][std::size_t(j)]);
        }
      }
      for (std::size_t j = 0; j < versions[0].sk.size(); ++j) {  // init slots from G_0 (spec 4.3)
        const std::int64_t i = std::int64_t(j);
        if (c.gate_initial) {
          add(dkg[j], gSk[0][j]);
          add(dvg[j], gSv[0][j]);
        } else {
          add(dk0[j], gSk[0][j]);
          add(dvr[j], gSv[0][j]);
        }
        radius_grad(dvr[j], p.v(i), grho[0][j]);  // rho always from the raw v
      }
      for (std::int64_t i = 0; i < T; ++i) {
        const double gi = p.gate(i);
        const Row k0 = p.k0(i), vi = p.v(i);
        double& dg = gr.dgate[std::size_t((b * c.Hk + g) * T + i)];
        if (c.merge_gate_keys) {
          dg += detail::dot(dkg[std::size_t(i)], k0);
          add(dk0[std::size_t(i)], dkg[std::size_t(i)], gi);
        } else {
          add(dk0[std::size_t(i)], dkg[std::size_t(i)]);
        }
        if (c.merge_gate_values) {
          dg += detail::dot(dvg[std::size_t(i)], vi);
          add(dvr[std::size_t(i)], dvg[std::size_t(i)], gi);
        } else {
          add(dvr[std::size_t(i)], dvg[std::size_t(i)]);
        }
        double* dv = gr.dv.data() + ((b * c.Hk + g) * T + i) * Dv;
        for (std::int64_t d = 0; d < Dv; ++d) dv[d] += dvr[std::size_t(i)][std::size_t(d)];
        // LN_s backward to k~ (rope channels zeroed), then into k for channels >= r
        Row kt = p.k(i);
        for (std::int64_t d = 0; d < c.rope_dims; ++d) kt[std::size_t(d)] = 0;
        Row dkt(std::size_t(D), 0.0);
        detail::ln_s_backward(c, in, kt, dk0[std::size_t(i)], dkt, gr.d_ln_weight, gr.d_ln_bias);
        double* dk = gr.dk.data() + ((b * c.Hk + g) * T + i) * D;
        for (std::int64_t d = c.rope_dims; d < D; ++d) dk[d] += dkt[std::size_t(d)];
      }
    }
  }
  return gr;
}

}  // namespace kvmem::reference::kvm
