// SPDX-License-Identifier: Apache-2.0
#pragma once
// Accounting for every discrete difference of a reduced-precision CUDA run (DESIGN.md 5: routes and
// kept sets match the fp64 reference except where the reference's own margin is below rounding).
// Each difference must be a near-tie: its margin in the fp64 reference below a rounding bound derived
// here from the arithmetic of the two sides; the differences are counted (and printed by the tests),
// and any other difference fails.
//
// KVM: the fp64 reference is teacher-forced along the CUDA run's own routes (the same appends and
// merge targets, so the same slots), and at every update each CUDA decision is compared with the
// fp64 decision on that state: a merge target must be the fp64 argmax or within the bound of it, an
// append set must be separable at the fp64 scores within the bounds. Forcing keeps one near-tie
// from cascading into differences later updates would not explain; a CUDA-vs-host route difference
// is then a near-tie of one of the two or a consequence of one (the host is checked against the
// reference on its own).
// UA: every kept-set difference must be a key whose λ interval (the fp64 λ of the stored values,
// widened by the fp32 rounding of each side) contains ln p.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

#include "kvm/kvm_host_util.hpp"
#include "kvmem/core/numeric.hpp"
#include "kvmem/policy/decay.hpp"
#include "kvmem/reference/ua.hpp"
#include "ua/ua_test_support.hpp"

namespace kvmem::test::near_ties {

inline constexpr double kFp32Unit = 0x1p-24;  // unit roundoff of fp32 (24 significand bits)
inline constexpr double kBf16Unit = 0x1p-8;   // unit roundoff of bf16 (8 significand bits)

// Relative error of one routing product a.b on the tensor cores (kvm_route_tc.cuh): default routing
// splits each fp32 operand into hi + lo bf16 (|x - hi - lo| <= 2^-16 |x|) and drops lo.lo (<= 2^-16
// |ab|): 3 * 2^-16, taken as 4 * 2^-16. Fast routing multiplies hi.hi only, each operand rounded to
// bf16 once: (1 + u)^2 - 1 <= 2u + u^2 with u = 2^-8.
inline constexpr double kDefaultRoutingProduct = 4 * 0x1p-16;
inline constexpr double kFastRoutingProduct = 2 * kBf16Unit + kBf16Unit * kBf16Unit;

// x stored in S and read back (the values a CUDA call in storage S sees).
template <class S>
std::vector<double> stored_as(const std::vector<double>& x) {
  std::vector<double> y(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) y[i] = kvmem::load_as<float>(kvmem::store_as<S>(float(x[i])));
  return y;
}

// KVM inputs as a CUDA call in storage S sees them: k, v, gate in S; LN_s and τ in fp32.
template <class S>
rkvm::Inputs kvm_inputs_as_stored(const rkvm::Inputs& in) {
  rkvm::Inputs r = in;
  r.k = stored_as<S>(in.k);
  r.v = stored_as<S>(in.v);
  r.gate = stored_as<S>(in.gate);
  r.ln_weight = stored_as<float>(in.ln_weight);
  r.ln_bias = stored_as<float>(in.ln_bias);
  return r;
}

struct RouteAccount {
  std::int64_t merges = 0;             // merge decisions checked
  std::int64_t merges_off = 0;         // CUDA target != fp64 argmax on the same state (near-ties)
  std::int64_t append_updates = 0;     // updates with appends checked
  std::int64_t append_tokens_off = 0;  // tokens of the fp64 append set that the CUDA run merged (near-ties)
  std::int64_t beyond = 0;             // differences the bound does not explain: must be 0
  double worst = 0;                    // largest margin / bound over the excused differences (< 1)
  std::string first_beyond;            // what the first unexplained difference was

  [[nodiscard]] std::string summary() const {
    std::ostringstream s;
    s << merges_off << " of " << merges << " merge targets and " << append_tokens_off << " appended tokens (in "
      << append_updates << " append sets) differ from the fp64 decision on the same state, all near-ties "
      << "(largest margin / bound " << worst << "); unexplained: " << beyond;
    return s.str();
  }
  void excuse(double margin, double bound) { worst = std::max(worst, bound > 0 ? margin / bound : 0.0); }
  void fail(const std::string& what) {
    if (beyond++ == 0) first_beyond = what;
  }
};

namespace detail {
using Row = std::vector<double>;

// A slot of the teacher-forced state: its fp64 sum, the sum of |terms| per channel and the number of
// terms (they bound the CUDA fp32 sum: |fl(sum) - sum| <= n u sum|terms| per channel).
struct Slot {
  Row sum, abs;
  double terms = 1;
};

// K^ = LN_s(Sk) in fp64 and a bound on |K^ (CUDA, fp32) - K^ (fp64)| per channel. With every channel of
// the fp32 sum off by at most δ (summation bound above, plus LN's own mean/variance sums over D), the
// centred value moves by <= 2δ and σ by <= 2δ, so K^_d = w_d xh_d + b_d moves by <= |w_d| (2δ/σ)(1 +
// |xh_d|), plus a few fp32 roundings of K^ itself.
struct Khat {
  Row value, err;
};
inline Khat khat_of(const rkvm::Config& c, const rkvm::Inputs& in, const Slot& s) {
  const std::int64_t D = c.D;
  double mean = 0;
  for (double x : s.sum) mean += x;
  mean /= double(D);
  double var = 0, big = 0, delta = 0;
  for (std::int64_t d = 0; d < D; ++d) {
    var += (s.sum[std::size_t(d)] - mean) * (s.sum[std::size_t(d)] - mean);
    big = std::max(big, std::abs(s.sum[std::size_t(d)]));
    delta = std::max(delta, s.terms * kFp32Unit * s.abs[std::size_t(d)]);
  }
  var /= double(D);
  delta += 2.0 * double(D) * kFp32Unit * big;
  const double sigma = std::sqrt(var + c.ln_eps);
  Khat k{rkvm::detail::ln_s(c, in, s.sum), Row(std::size_t(D), 0.0)};
  for (std::int64_t d = 0; d < D; ++d) {
    const double xh = (s.sum[std::size_t(d)] - mean) / sigma;
    k.err[std::size_t(d)] = std::abs(in.ln_weight[std::size_t(d)]) * (2.0 * delta / sigma) * (1.0 + std::abs(xh)) +
                            8.0 * kFp32Unit * std::abs(k.value[std::size_t(d)]);
  }
  return k;
}

// a . K^ and the bound on its CUDA error: the product rounding (`product`, relative per term), the fp32
// accumulation of the D products (up to 3 D of them with hi/lo terms; tensor-core accumulation need
// not round to nearest, so 8 D u sum|a K^| instead of D u), which also covers the fp32 rounding of
// a = k0 or kg, and the K^ error above.
inline void logit(const Row& a, const Khat& k, double product, double& value, double& err) {
  value = 0;
  double mag = 0, from_k = 0;
  for (std::size_t d = 0; d < a.size(); ++d) {
    value += a[d] * k.value[d];
    mag += std::abs(a[d] * k.value[d]);
    from_k += std::abs(a[d]) * k.err[d];
  }
  err = (product + 8.0 * double(a.size()) * kFp32Unit) * mag + from_k;
}
}  // namespace detail

// Checks the routes of `run` (prefill of the whole sequence, layout of HostResult) against the fp64
// reference forced along them. `in` are the inputs as the CUDA run saw them (kvm_inputs_as_stored).
inline RouteAccount account_kvm_routes(const rkvm::Config& c, const rkvm::Inputs& in, const HostResult& run,
                                       double product) {
  using detail::Row;
  RouteAccount acc;
  const std::int64_t C = c.chunk, items = c.B * c.Hk, U = std::int64_t(run.route_merge.size());
  for (std::int64_t b = 0; b < c.B; ++b)
    for (std::int64_t g = 0; g < c.Hk; ++g) {
      const std::int64_t item = b * c.Hk + g;
      const rkvm::detail::Problem p{c, in, b, g};
      std::vector<detail::Slot> slots;
      const auto add_slot = [&](const Row& key) {
        detail::Slot s{key, Row(key.size()), 1};
        for (std::size_t d = 0; d < key.size(); ++d) s.abs[d] = std::abs(key[d]);
        slots.push_back(s);
      };
      for (std::int64_t j = 0; j < std::min(c.T, C); ++j) add_slot(c.gate_initial ? p.kg(j) : p.k0(j));
      for (std::int64_t u = 0; u < U; ++u) {
        const std::int64_t a = (u + 1) * C;  // update u + 1 absorbs tokens [(u+1)C, (u+2)C) (spec 4.6)
        const std::size_t n_app = run.route_append[std::size_t(u)].size() / std::size_t(items);
        std::vector<bool> appended(std::size_t(C), false);
        for (std::size_t e = 0; e < n_app; ++e) {
          const std::int64_t t = run.route_append[std::size_t(u)][std::size_t(item) * n_app + e];
          if (t < a || t >= a + C) {
            acc.fail("update " + std::to_string(u + 1) + ": appended token " + std::to_string(t) +
                     " outside the chunk");
            continue;
          }
          appended[std::size_t(t - a)] = true;
        }
        if (n_app > 0) {  // spec 4.5 step 2 on the pre-update state, ungated k0, every slot
          ++acc.append_updates;
          std::vector<detail::Khat> kh;
          for (const auto& s : slots) kh.push_back(detail::khat_of(c, in, s));
          std::vector<std::pair<double, std::int64_t>> order;
          double in_hi = -INFINITY, out_lo = INFINITY;  // max over A of (s - e), min over the rest of (s + e)
          for (std::int64_t i = 0; i < C; ++i) {
            const Row k0 = p.k0(a + i);
            double score = -INFINITY, err = 0;
            for (const auto& k : kh) {
              double l = 0, e = 0;
              detail::logit(k0, k, product, l, e);
              score = std::max(score, l);
              err = std::max(err, e);  // |max_j x_j - max_j y_j| <= max_j |x_j - y_j|
            }
            order.emplace_back(score, i);
            if (appended[std::size_t(i)])
              in_hi = std::max(in_hi, score - err);
            else
              out_lo = std::min(out_lo, score + err);
          }
          std::sort(order.begin(), order.end());  // the fp64 choice: (score asc, index asc)
          for (std::size_t r = 0; r < order.size(); ++r)
            if (!appended[std::size_t(order[r].second)] && r < n_app) ++acc.append_tokens_off;
          if (in_hi > out_lo)  // no cut separates the CUDA set from the rest within the bounds
            acc.fail("update " + std::to_string(u + 1) + ": append set not separable within the bounds (" +
                     std::to_string(in_hi) + " > " + std::to_string(out_lo) + ")");
        }
        for (std::int64_t i = 0; i < C; ++i)  // spec 4.5 step 3, the CUDA run's appends
          if (appended[std::size_t(i)]) add_slot(c.gate_appends ? p.kg(a + i) : p.k0(a + i));
        std::vector<detail::Khat> kh;
        for (const auto& s : slots) kh.push_back(detail::khat_of(c, in, s));
        const auto n_slots = std::int64_t(slots.size());
        std::vector<std::pair<std::int64_t, Row>> scatter;
        for (std::int64_t i = 0; i < C; ++i) {  // spec 4.5 step 4 on the expanded state
          if (appended[std::size_t(i)]) continue;
          ++acc.merges;
          const std::int64_t target = run.route_merge[std::size_t(u)][std::size_t(item * C + i)];
          if (target < c.sink || target >= n_slots) {
            acc.fail("update " + std::to_string(u + 1) + " token " + std::to_string(a + i) + ": target " +
                     std::to_string(target) + " outside [sink, slots)");
            continue;
          }
          const Row kg = p.kg(a + i);
          std::int64_t best = -1;
          double best_l = 0, best_e = 0, target_l = 0, target_e = 0;
          for (std::int64_t j = c.sink; j < n_slots; ++j) {
            double l = 0, e = 0;
            detail::logit(kg, kh[std::size_t(j)], product, l, e);
            if (best < 0 || l > best_l) {
              best = j;
              best_l = l;
              best_e = e;
            }
            if (j == target) {
              target_l = l;
              target_e = e;
            }
          }
          if (target != best) {
            ++acc.merges_off;
            const double margin = best_l - target_l, bound = best_e + target_e;
            if (margin > bound)
              acc.fail("update " + std::to_string(u + 1) + " token " + std::to_string(a + i) + ": target " +
                       std::to_string(target) + ", fp64 argmax " + std::to_string(best) + ", margin " +
                       std::to_string(margin) + " > bound " + std::to_string(bound));
            else
              acc.excuse(margin, bound);
          }
          scatter.emplace_back(target, kg);
        }
        for (const auto& [j, kg] : scatter) {  // one scatter against the same K^+
          auto& s = slots[std::size_t(j)];
          for (std::size_t d = 0; d < kg.size(); ++d) {
            s.sum[d] += kg[d];
            s.abs[d] += std::abs(kg[d]);
          }
          s.terms += 1;
        }
      }
    }
  return acc;
}

// ---- UA ------------------------------------------------------------------------------------------

struct KeptAccount {
  std::int64_t keys = 0;       // keys compared
  std::int64_t near_ties = 0;  // kept-set differences within the bound
  std::int64_t beyond = 0;     // differences the bound does not explain: must be 0
  double widest = 0;           // widest λ interval among the near-ties
  std::string first_beyond;
  [[nodiscard]] std::string summary() const {
    std::ostringstream s;
    s << near_ties << " of " << keys << " kept-set decisions differ, all near-ties (widest λ interval " << widest
      << "); unexplained: " << beyond;
    return s.str();
  }
};

// Interval of the fp32 λ of one key at the last token, around the fp64 λ of the stored values (spec
// UA.md 4.1, 4.2; `c` and `in` hold the values both sides see, e.g. bf16-rounded keys). Per pair j < m,
// both sides compute c_jm as an fp32 dot of the same values (any order, tensor cores included, whose
// accumulation need not round to nearest): |Δc| <= 8 D u sum_d |k_j,d k_m,d| (u = 2^-24); A is
// non-increasing in c, so A over [c - Δc, c + Δc] bounds it, where x is widened by 64 u (1 + |ln x|)
// for the fp32 gate logs, exp (CUDA's fast exp: 2 + 1.2 |arg| ulp) and the division by |set| behind
// x, A is evaluated with both the fp64 clamp 1 - 1e-6 and the fp32 one (1 - 1e-6 rounded to float:
// fp32 backends saturate at A = -13.802, fp64 at -13.816), and log1p adds 8 u |A|. The fp32 running
// sum adds T u sum|A| (each of the T additions rounds a partial sum bounded by sum|A|). fold_abs: an
// absolute error of one side's A beyond these (a fold on approximate hardware logarithms, e.g. the dense
// tensor-core prefill's kDnDecayAbsError), added once per pair that can decay (x > 0 in the interval).
template <class Set = kvmem::decay::Universal>
std::pair<double, double> lambda_interval(const kvmem::reference::ua::Config& c, const kvmem::reference::ua::Inputs& in,
                                          std::int64_t b, std::int64_t g, std::int64_t j, double fold_abs = 0.0) {
  const double u = kFp32Unit;
  const double cap64 = 1.0 - kvmem::decay::kClampEps, cap32 = double(1.0f - float(kvmem::decay::kClampEps));
  const auto A_at = [&](double x, double cap) { return std::log1p(-std::min(x, cap)); };
  const auto key = [&](std::int64_t t) { return in.k.data() + ((b * c.G + g) * c.T + t) * c.D; };
  double lo = 0, hi = 0, mag = 0;
  for (std::int64_t m = j + 1; m < c.T; ++m) {
    double sim = 0, abs_sim = 0;
    for (std::int64_t d = 0; d < c.D; ++d) {
      sim += key(j)[d] * key(m)[d];
      abs_sim += std::abs(key(j)[d] * key(m)[d]);
    }
    const double dsim = 8.0 * double(c.D) * u * abs_sim;
    kvmem::decay::PairInputs<double> pair;
    pair.key_logit = in.z_k[std::size_t((b * c.G + g) * c.T + j)];
    pair.query_logit = in.z_q[std::size_t((b * c.G + g) * c.T + m)];
    pair.key_position = j;
    pair.position = m;
    const auto x_of = [&](double s, double widen) {  // the set's x at similarity s, widened
      pair.similarity = s;
      const double lx = Set::log_mean_factor(pair);
      if (lx == -std::numeric_limits<double>::infinity()) return 0.0;
      return std::exp(lx) * (1.0 + widen * 64.0 * u * (1.0 + std::abs(lx)));
    };
    const double x_hi = x_of(sim + dsim, 1.0), x_lo = x_of(sim - dsim, -1.0);
    const double a_lo = std::min(A_at(x_hi, cap64), A_at(x_hi, cap32)),
                 a_hi = std::max(A_at(x_lo, cap64), A_at(x_lo, cap32));
    lo += a_lo * (1.0 + 8.0 * u) - (x_hi > 0.0 ? fold_abs : 0.0);
    hi += a_hi * (1.0 - 8.0 * u) + (x_hi > 0.0 ? fold_abs : 0.0);
    mag += std::abs(a_lo);
  }
  const double sum_err = double(c.T) * u * mag;
  return {lo - sum_err, hi + sum_err};
}

// Kept sets a and b ([B,G,T] 0/1 after the last token, decode order: the last eviction at T - 1) may
// differ only at keys whose λ interval (fold_abs: lambda_interval) contains ln p.
template <class Set = kvmem::decay::Universal>
KeptAccount account_kept(const kvmem::reference::ua::Config& c, const kvmem::reference::ua::Inputs& in,
                         const std::vector<std::int64_t>& a, const std::vector<std::int64_t>& b, double p,
                         double fold_abs = 0.0) {
  KeptAccount acc;
  const double lnp = std::log(p);
  for (std::int64_t bb = 0; bb < c.B; ++bb)
    for (std::int64_t g = 0; g < c.G; ++g)
      for (std::int64_t j = 0; j < c.T; ++j) {
        const std::size_t e = std::size_t((bb * c.G + g) * c.T + j);
        ++acc.keys;
        if (a[e] == b[e]) continue;
        const auto [lo, hi] = lambda_interval<Set>(c, in, bb, g, j, fold_abs);
        if (lo <= lnp && lnp <= hi) {
          ++acc.near_ties;
          acc.widest = std::max(acc.widest, hi - lo);
        } else if (acc.beyond++ == 0) {
          std::ostringstream s;
          s << "b " << bb << " g " << g << " key " << j << ": λ in [" << lo << ", " << hi << "], ln p " << lnp;
          acc.first_beyond = s.str();
        }
      }
  return acc;
}

}  // namespace kvmem::test::near_ties
