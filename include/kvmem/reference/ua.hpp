// SPDX-License-Identifier: Apache-2.0
#pragma once
// Universal Attention, float64 reference (spec UA.md). The test oracle for every backend and
// readable documentation of the math: one function per formula, full matrices, no tiling, no
// caching tricks. It deliberately shares no code with kernel/ (an oracle that shares code with what
// it checks checks nothing); it uses only core/ and policy/ (the decay gates are the definition of
// the per-step decay, spec UA.md 4.1).
//
// Layouts (spec UA.md 2), row-major:
//   q [B,H,T,D], k [B,G,T,D], v [B,G,T,D], z_k [B,G,T], z_q [B,G,T], z_o [B,T,H,D] (optional),
//   out [B,T,H,D], lse [B,H,T], lambda_last [B,G,T]. Query head h reads kv head floor(h / (H/G)).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "kvmem/core/math.hpp"
#include "kvmem/core/status.hpp"
#include "kvmem/policy/decay.hpp"
#include "kvmem/policy/prune.hpp"

namespace kvmem::reference::ua {

struct Config {
  std::int64_t B = 0, T = 0, H = 0, G = 0, D = 0;
  std::int64_t prefill_chunk = 128;    // P of spec UA.md 4.5
  std::int64_t prefill_split = -1;     // tokens [0, split) are prefilled, the rest decoded; -1 -> T
  bool evict_before_attention = true;  // decode-step order (spec UA.md 4.5)
};

struct Inputs {
  std::vector<double> q, k, v, z_k, z_q;  // shapes above
  std::vector<double> z_o;                // [B,T,H,D]; empty = no output gate (spec UA.md 7)
};

struct DenseResult {
  std::vector<double> out;          // [B,T,H,D]
  std::vector<double> lse;          // [B,H,T]
  std::vector<double> lambda_last;  // [B,G,T]
};

struct PrunedResult {
  std::vector<double> out;         // [B,T,H,D]
  std::vector<std::int64_t> kept;  // [B,G,T], 1 = in the cache after the last token
  // With a keep limit: the smallest gap, over every eviction that dropped entries by rank, between the
  // λ of the last entry kept and the first entry dropped (a near-tie below rounding may flip in fp32).
  double rank_margin = std::numeric_limits<double>::infinity();
};

namespace detail {
inline std::int64_t split_of(const Config& c) {
  return c.prefill_split < 0 ? c.T : c.prefill_split;
}
inline const double* key_row(const Config& c, const Inputs& in, std::int64_t b, std::int64_t g, std::int64_t t) {
  return in.k.data() + ((b * c.G + g) * c.T + t) * c.D;
}
inline const double* value_row(const Config& c, const Inputs& in, std::int64_t b, std::int64_t g, std::int64_t t) {
  return in.v.data() + ((b * c.G + g) * c.T + t) * c.D;
}
inline const double* query_row(const Config& c, const Inputs& in, std::int64_t b, std::int64_t h, std::int64_t t) {
  return in.q.data() + ((b * c.H + h) * c.T + t) * c.D;
}
inline double dot(const double* a, const double* b, std::int64_t n) {
  double s = 0.0;
  for (std::int64_t d = 0; d < n; ++d) s += a[d] * b[d];
  return s;
}
inline bool all_finite(const std::vector<double>& x) {
  for (double value : x)
    if (!std::isfinite(value)) return false;
  return true;
}
}  // namespace detail

// Shapes, finiteness and options; nothing is computed on invalid input.
inline Status validate(const Config& c, const Inputs& in) {
  if (c.B <= 0 || c.T <= 0 || c.H <= 0 || c.G <= 0 || c.D <= 0)
    return invalid_argument("Config B,T,H,G,D", "positive sizes",
                            kvmem::detail::concat(c.B, ",", c.T, ",", c.H, ",", c.G, ",", c.D));
  if (c.H % c.G != 0) return invalid_argument("Config H % G", "0 (H a multiple of G)", c.H % c.G);
  if (c.prefill_chunk <= 0) return invalid_argument("Config prefill_chunk", "a positive chunk length", c.prefill_chunk);
  if (c.prefill_split < -1 || c.prefill_split > c.T)
    return invalid_argument("Config prefill_split", kvmem::detail::concat("-1 or a value in [0, T=", c.T, "]"),
                            c.prefill_split);
  const auto check = [](const std::vector<double>& x, std::int64_t n, const char* name) -> Status {
    if (static_cast<std::int64_t>(x.size()) != n)
      return invalid_argument(std::string("Inputs ") + name + " size", n, x.size());
    if (!detail::all_finite(x)) return invalid_argument(std::string("Inputs ") + name, "finite values", "NaN or Inf");
    return Status::ok();
  };
  KVMEM_RETURN_IF_ERROR(check(in.q, c.B * c.H * c.T * c.D, "q [B,H,T,D]"));
  KVMEM_RETURN_IF_ERROR(check(in.k, c.B * c.G * c.T * c.D, "k [B,G,T,D]"));
  KVMEM_RETURN_IF_ERROR(check(in.v, c.B * c.G * c.T * c.D, "v [B,G,T,D]"));
  KVMEM_RETURN_IF_ERROR(check(in.z_k, c.B * c.G * c.T, "z_k [B,G,T]"));
  KVMEM_RETURN_IF_ERROR(check(in.z_q, c.B * c.G * c.T, "z_q [B,G,T]"));
  if (!in.z_o.empty()) KVMEM_RETURN_IF_ERROR(check(in.z_o, c.B * c.T * c.H * c.D, "z_o [B,T,H,D]"));
  return Status::ok();
}

// Spec UA.md 4.1: A_jm for one (b, g) and one pair j < m; 0 for m <= j (self term excluded).
template <DecaySet S = decay::Universal>
double step_decay(const Config& c, const Inputs& in, std::int64_t b, std::int64_t g, std::int64_t j, std::int64_t m) {
  if (m <= j) return 0.0;
  decay::PairInputs<double> pair;
  pair.key_logit = in.z_k[(b * c.G + g) * c.T + j];    // g_k[j] = sigmoid(z_k[j])
  pair.query_logit = in.z_q[(b * c.G + g) * c.T + m];  // g_q[m] = sigmoid(z_q[m])
  pair.similarity = detail::dot(detail::key_row(c, in, b, g, j), detail::key_row(c, in, b, g, m), c.D);  // c_jm
  pair.key_position = j;
  pair.position = m;
  // log of the geometric mean of the factors; -inf when a factor is 0 (c_jm <= 0)
  const double log_x = S::log_mean_factor(pair);
  if (log_x == -std::numeric_limits<double>::infinity()) return 0.0;  // x = 0 -> A = 0 exactly
  const double x = std::exp(log_x);
  return std::log1p(-std::min(x, 1.0 - decay::kClampEps));  // A = log1p(-min(x, 1 - 1e-6))
}

// Spec UA.md 4.1: the per-step decay matrix A [T,T] of one (b, g), A[j*T + m] (key first).
template <DecaySet S = decay::Universal>
std::vector<double> decay_matrix(const Config& c, const Inputs& in, std::int64_t b, std::int64_t g) {
  std::vector<double> a(static_cast<std::size_t>(c.T * c.T), 0.0);
  for (std::int64_t j = 0; j < c.T; ++j)
    for (std::int64_t m = j + 1; m < c.T; ++m) a[j * c.T + m] = step_decay<S>(c, in, b, g, j, m);
  return a;
}

// Spec UA.md 4.2: Λ [T,T] of one (b, g), Λ[i*T + j] = sum_{m=j+1..i} A_jm (accumulated in increasing
// m), -inf above the diagonal.
template <DecaySet S = decay::Universal>
std::vector<double> cumulative_decay(const Config& c, const Inputs& in, std::int64_t b, std::int64_t g) {
  const std::vector<double> a = decay_matrix<S>(c, in, b, g);
  std::vector<double> lam(static_cast<std::size_t>(c.T * c.T), -std::numeric_limits<double>::infinity());
  for (std::int64_t j = 0; j < c.T; ++j) {
    double run = 0.0;  // Λ_jj = 0
    lam[j * c.T + j] = run;
    for (std::int64_t i = j + 1; i < c.T; ++i) {
      run += a[j * c.T + i];  // Λ_ij = Λ_{i-1,j} + A_ji
      lam[i * c.T + j] = run;
    }
  }
  return lam;
}

namespace detail {
// Spec UA.md 4.3 for one query row: softmax over the listed keys with logits q.k_j + bias_j, then the
// optional output gate. Writes y [D] and returns the natural log-sum-exp of the logits.
inline double attend_row(const Config& c, const Inputs& in, std::int64_t b, std::int64_t h, std::int64_t i,
                         const std::vector<std::int64_t>& keys, const std::vector<double>& bias, double* y) {
  const std::int64_t g = h / (c.H / c.G);  // GQA: floor(h / r)
  const double* q = query_row(c, in, b, h, i);
  std::vector<double> logit(keys.size());
  double mx = -std::numeric_limits<double>::infinity();
  for (std::size_t e = 0; e < keys.size(); ++e) {
    logit[e] = dot(q, key_row(c, in, b, g, keys[e]), c.D) + bias[e];  // scale 1
    mx = std::max(mx, logit[e]);
  }
  double sum = 0.0;
  for (std::size_t e = 0; e < keys.size(); ++e) sum += std::exp(logit[e] - mx);
  for (std::int64_t d = 0; d < c.D; ++d) y[d] = 0.0;
  for (std::size_t e = 0; e < keys.size(); ++e) {
    const double p = std::exp(logit[e] - mx) / sum;
    const double* v = value_row(c, in, b, g, keys[e]);
    for (std::int64_t d = 0; d < c.D; ++d) y[d] += p * v[d];
  }
  if (!in.z_o.empty()) {  // y = o * sigmoid(z_o), spec UA.md 7
    const double* zo = in.z_o.data() + ((b * c.T + i) * c.H + h) * c.D;
    for (std::int64_t d = 0; d < c.D; ++d) y[d] *= 1.0 / (1.0 + std::exp(-zo[d]));
  }
  return mx + std::log(sum);
}
inline double* out_row(const Config& c, std::vector<double>& out, std::int64_t b, std::int64_t i, std::int64_t h) {
  return out.data() + ((b * c.T + i) * c.H + h) * c.D;
}
}  // namespace detail

// Dense causal UA over all T tokens (spec UA.md 4.1-4.3): out, lse and the last row of Λ.
template <DecaySet S = decay::Universal>
DenseResult dense(const Config& c, const Inputs& in) {
  throw_if_error(validate(c, in));
  DenseResult r;
  r.out.assign(static_cast<std::size_t>(c.B * c.T * c.H * c.D), 0.0);
  r.lse.assign(static_cast<std::size_t>(c.B * c.H * c.T), 0.0);
  r.lambda_last.assign(static_cast<std::size_t>(c.B * c.G * c.T), 0.0);
  const std::int64_t group = c.H / c.G;
  for (std::int64_t b = 0; b < c.B; ++b)
    for (std::int64_t g = 0; g < c.G; ++g) {
      const std::vector<double> lam = cumulative_decay<S>(c, in, b, g);
      for (std::int64_t j = 0; j < c.T; ++j) r.lambda_last[(b * c.G + g) * c.T + j] = lam[(c.T - 1) * c.T + j];
      for (std::int64_t hh = 0; hh < group; ++hh) {
        const std::int64_t h = g * group + hh;
        for (std::int64_t i = 0; i < c.T; ++i) {
          std::vector<std::int64_t> keys;
          std::vector<double> bias;
          for (std::int64_t j = 0; j <= i; ++j) {  // causal: j > i skipped (-inf)
            keys.push_back(j);
            bias.push_back(lam[i * c.T + j]);
          }
          r.lse[(b * c.H + h) * c.T + i] =
              detail::attend_row(c, in, b, h, i, keys, bias, detail::out_row(c, r.out, b, i, h));
        }
      }
    }
  return r;
}

namespace detail {
// One (b, g) cache of the decode simulation: positions and λ, in ascending position order.
struct RefCache {
  std::vector<std::int64_t> pos;
  std::vector<double> lambda;
};

// Evicts every entry with λ < ln p (strict), keeping the survivors in ascending position order. With
// keep >= 0, then only the `keep` survivors with the largest λ stay (of equal λ the later position);
// `margin` takes the λ gap at that cut.
inline void evict(RefCache& cache, double p, std::int64_t keep = -1, double* margin = nullptr) {
  RefCache kept;
  for (std::size_t e = 0; e < cache.pos.size(); ++e)
    if (!prune::Threshold{p}.evicts(cache.lambda[e])) {
      kept.pos.push_back(cache.pos[e]);
      kept.lambda.push_back(cache.lambda[e]);
    }
  if (keep >= 0 && std::int64_t(kept.pos.size()) > keep) {
    std::vector<std::size_t> order(kept.pos.size());
    for (std::size_t e = 0; e < order.size(); ++e) order[e] = e;
    std::sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) {
      if (kept.lambda[a] != kept.lambda[b]) return kept.lambda[a] > kept.lambda[b];
      return kept.pos[a] > kept.pos[b];
    });
    const auto k = static_cast<std::size_t>(keep);
    if (margin != nullptr && k > 0) *margin = std::min(*margin, kept.lambda[order[k - 1]] - kept.lambda[order[k]]);
    std::vector<bool> stays(order.size(), false);
    for (std::size_t i = 0; i < k; ++i) stays[order[i]] = true;
    RefCache top;
    for (std::size_t e = 0; e < stays.size(); ++e)
      if (stays[e]) {
        top.pos.push_back(kept.pos[e]);
        top.lambda.push_back(kept.lambda[e]);
      }
    kept = top;
  }
  cache = kept;
}

// Spec UA.md 4.4/4.5: one decode step of token t for (b, g) and its r query heads.
template <DecaySet S>
void decode_step(const Config& c, const Inputs& in, std::int64_t b, std::int64_t g, std::int64_t t, double p,
                 bool evict_before_attention, RefCache& cache, std::vector<double>& out, std::int64_t keep = -1,
                 double* margin = nullptr) {
  for (std::size_t e = 0; e < cache.pos.size(); ++e)  // 1. λ_j += A_jt
    cache.lambda[e] += step_decay<S>(c, in, b, g, cache.pos[e], t);
  cache.pos.push_back(t);  // 2. append with λ_t = 0
  cache.lambda.push_back(0.0);
  if (evict_before_attention) evict(cache, p, keep, margin);  // 3. evict λ < ln p
  const std::int64_t group = c.H / c.G;
  for (std::int64_t hh = 0; hh < group; ++hh)  // 4. attend
    attend_row(c, in, b, g * group + hh, t, cache.pos, cache.lambda, out_row(c, out, b, t, g * group + hh));
  if (!evict_before_attention) evict(cache, p, keep, margin);
}
}  // namespace detail

// Token-by-token decode from an empty cache, no pruning (spec UA.md 4.4): the golden `out_decode`.
template <DecaySet S = decay::Universal>
std::vector<double> decode_dense(const Config& c, const Inputs& in) {
  throw_if_error(validate(c, in));
  std::vector<double> out(static_cast<std::size_t>(c.B * c.T * c.H * c.D), 0.0);
  for (std::int64_t b = 0; b < c.B; ++b)
    for (std::int64_t g = 0; g < c.G; ++g) {
      detail::RefCache cache;
      for (std::int64_t t = 0; t < c.T; ++t) detail::decode_step<S>(c, in, b, g, t, 0.0, true, cache, out);
    }
  return out;
}

// The pruned run of tests/data/golden/README.md (spec UA.md 4.5): chunked prefill of [0, prefill_split)
// with chunk prefill_chunk, evicting at every chunk end (chunk keys included), then decode of the
// remaining tokens with the configured step order. p = 0 never evicts. keep >= 0: after the threshold,
// at most `keep` entries per (sequence, kv head) stay at every eviction, those with the largest λ
// (of equal λ the later position): the rule of prune::KeepTop{keep, p}.
template <DecaySet S = decay::Universal>
PrunedResult pruned(const Config& c, const Inputs& in, double p, std::int64_t keep = -1) {
  throw_if_error(validate(c, in));
  throw_if_error(prune::Threshold{p}.validate());
  PrunedResult r;
  r.out.assign(static_cast<std::size_t>(c.B * c.T * c.H * c.D), 0.0);
  r.kept.assign(static_cast<std::size_t>(c.B * c.G * c.T), 0);
  const std::int64_t split = detail::split_of(c);
  const std::int64_t group = c.H / c.G;
  for (std::int64_t b = 0; b < c.B; ++b)
    for (std::int64_t g = 0; g < c.G; ++g) {
      const std::vector<double> lam = cumulative_decay<S>(c, in, b, g);  // exact Λ (λ is eviction-independent)
      detail::RefCache cache;
      for (std::int64_t t0 = 0; t0 < split; t0 += c.prefill_chunk) {
        const std::int64_t t1 = std::min(t0 + c.prefill_chunk, split);
        for (std::int64_t t = t0; t < t1; ++t) cache.pos.push_back(t);  // chunk keys join the cache
        cache.lambda.assign(cache.pos.size(), 0.0);
        for (std::int64_t i = t0; i < t1; ++i)  // 1. attend to survivors + chunk keys t0..i with exact Λ_ij
          for (std::int64_t hh = 0; hh < group; ++hh) {
            std::vector<std::int64_t> keys;
            std::vector<double> bias;
            for (std::int64_t j : cache.pos)
              if (j <= i) {
                keys.push_back(j);
                bias.push_back(lam[i * c.T + j]);
              }
            detail::attend_row(c, in, b, g * group + hh, i, keys, bias,
                               detail::out_row(c, r.out, b, i, g * group + hh));
          }
        for (std::size_t e = 0; e < cache.pos.size(); ++e) cache.lambda[e] = lam[(t1 - 1) * c.T + cache.pos[e]];
        detail::evict(cache, p, keep, &r.rank_margin);  // 2. λ = Λ_{e,j} at the chunk end, evict
      }
      for (std::int64_t t = split; t < c.T; ++t)
        detail::decode_step<S>(c, in, b, g, t, p, c.evict_before_attention, cache, r.out, keep, &r.rank_margin);
      for (std::int64_t j : cache.pos) r.kept[(b * c.G + g) * c.T + j] = 1;
    }
  return r;
}

}  // namespace kvmem::reference::ua
