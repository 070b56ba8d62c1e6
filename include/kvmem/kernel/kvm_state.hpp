// SPDX-License-Identifier: Apache-2.0
#pragma once
// KVM state-update bodies shared by every backend (spec KVM.md 4.2-4.5): key preprocessing (zeroed
// RoPE channels, LN_s), the value readout V^, novelty scores, append selection by rank, merge
// routing by argmax over non-sink slots and the scatter of gated sums. Each body works on one
// (sequence, KV head) and one row or one slot at a time; backends decide where the bodies run.
//
// KVMEM_HOST_DEVICE, no allocation, no containers, no exceptions, no virtual functions.

#include <cmath>
#include <cstdint>

#include "kvmem/core/config.hpp"
#include "kvmem/core/numeric.hpp"
#include "kvmem/kernel/attend.hpp"

namespace kvmem::kernel {

// Slots per block in the blocked routing bodies (a workspace of kRouteRows * D per item).
inline constexpr std::int64_t kRouteRows = 8;

// LN_s(x) = w (x - mean)/sqrt(var + eps) + b, biased variance over D (spec 4.2 step 2). y may alias x.
// x: [D], w: [D], b: [D], y: [D]
template <class Acc, class X>
KVMEM_HOST_DEVICE inline void layer_norm(const X* x, std::int64_t D, const Acc* w, const Acc* b, Acc eps, Acc* y) {
  using std::sqrt;
  Acc mean = Acc(0);
  for (std::int64_t d = 0; d < D; ++d) mean += load_as<Acc>(x[d]);
  mean /= static_cast<Acc>(D);
  Acc var = Acc(0);
  for (std::int64_t d = 0; d < D; ++d) {
    const Acc c = load_as<Acc>(x[d]) - mean;
    var += c * c;
  }
  var /= static_cast<Acc>(D);
  const Acc inv = Acc(1) / sqrt(var + eps);
  for (std::int64_t d = 0; d < D; ++d) y[d] = w[d] * ((load_as<Acc>(x[d]) - mean) * inv) + b[d];
}

// k0 = LN_s(k with channels [0, r) zeroed) (spec 4.2 steps 1-2; LN refills the zeroed channels).
// k: [D], k0: [D]
template <class Acc, class K>
KVMEM_HOST_DEVICE inline void preprocess_key(const K* k, std::int64_t D, std::int64_t rope_dims, const Acc* w,
                                             const Acc* b, Acc eps, Acc* k0) {
  for (std::int64_t d = 0; d < D; ++d) k0[d] = d < rope_dims ? Acc(0) : load_as<Acc>(k[d]);
  layer_norm(k0, D, w, b, eps, k0);
}

// ||x||_2. x: [n]
template <class Acc, class X>
KVMEM_HOST_DEVICE inline Acc norm2(const X* x, std::int64_t n) {
  using std::sqrt;
  Acc s = Acc(0);
  for (std::int64_t i = 0; i < n; ++i) s += load_as<Acc>(x[i]) * load_as<Acc>(x[i]);
  return sqrt(s);
}

// V^ = rho * Sv / max(||Sv||, 1e-12) (value radius) or Sv / cnt (count mode)  (spec 4.4 step 2).
// sv: [Dv], out: [Dv]
// The factor f of V^ = f * Sv: rho / max(||Sv||, 1e-12) or 1 / cnt. sv: [Dv]
template <class Acc>
KVMEM_HOST_DEVICE inline Acc value_readout_factor(const Acc* sv, std::int64_t Dv, Acc rho, Acc cnt, bool value_radius) {
  if (!value_radius) return Acc(1) / cnt;
  Acc n = norm2<Acc>(sv, Dv);
  if (n < Acc(1e-12)) n = Acc(1e-12);
  return rho / n;
}
template <class Acc, class Out>
KVMEM_HOST_DEVICE inline void value_readout(const Acc* sv, std::int64_t Dv, Acc rho, Acc cnt, bool value_radius,
                                            Out* out) {
  const Acc f = value_readout_factor(sv, Dv, rho, cnt, value_radius);
  for (std::int64_t d = 0; d < Dv; ++d) out[d] = store_as<Out>(sv[d] * f);
}

// Novelty, one slot at a time: score_i = max(score_i, k0_i . khat) (spec 4.5 step 2; scores start
// at -inf and see every current slot, sink included). k0: [n, D], khat: [D], score: [n]
template <class Acc>
KVMEM_HOST_DEVICE inline void novelty_update(const Acc* k0, std::int64_t n, std::int64_t D, const Acc* khat,
                                             Acc* score) {
  for (std::int64_t i = 0; i < n; ++i) {
    const Acc s = dot(khat, k0 + i * D, D);
    if (s > score[i]) score[i] = s;
  }
}

// Blocked form of novelty_update for `rows` consecutive slots (khat: [rows, D]): each token row is
// read once per block instead of once per slot; the dots are the same, so results are identical.
template <class Acc>
KVMEM_HOST_DEVICE inline void novelty_update_rows(const Acc* k0, std::int64_t n, std::int64_t D, const Acc* khat,
                                                  std::int64_t rows, Acc* score) {
  for (std::int64_t i = 0; i < n; ++i) {
    Acc best = score[i];
    for (std::int64_t r = 0; r < rows; ++r) {
      const Acc s = dot(khat + r * D, k0 + i * D, D);
      if (s > best) best = s;
    }
    score[i] = best;
  }
}

// novelty_update_rows from precomputed logits (a backend's matrix product): logits[i * ld + r] =
// k0_i . khat_r for slots r in [0, rows). logits: [n, ld], score: [n]
template <class Acc>
KVMEM_HOST_DEVICE inline void novelty_update_logits(const Acc* logits, std::int64_t ld, std::int64_t n,
                                                    std::int64_t rows, Acc* score) {
  for (std::int64_t i = 0; i < n; ++i) {
    Acc best = score[i];
    for (std::int64_t r = 0; r < rows; ++r)
      if (logits[i * ld + r] > best) best = logits[i * ld + r];
    score[i] = best;
  }
}

// Append selection by rank: token i is appended iff fewer than n_app tokens precede it in the
// order (score asc, index asc) (spec 4.5 step 2; stable ties by lower index, spec 7.4). O(n^2)
// comparisons, no sort, so a GPU thread per token computes its own rank (append_target).
// score: [n]; returns token i's target: -1 appended, 0 otherwise
template <class Acc>
KVMEM_HOST_DEVICE inline std::int64_t append_target(const Acc* score, std::int64_t n, std::int64_t n_app,
                                                    std::int64_t i) {
  std::int64_t rank = 0;
  for (std::int64_t j = 0; j < n; ++j) rank += (score[j] < score[i] || (score[j] == score[i] && j < i)) ? 1 : 0;
  return rank < n_app ? -1 : 0;
}

// append_target for every token. score: [n], target: [n]
template <class Acc>
KVMEM_HOST_DEVICE inline void select_appends(const Acc* score, std::int64_t n, std::int64_t n_app,
                                             std::int64_t* target) {
  for (std::int64_t i = 0; i < n; ++i) target[i] = append_target(score, n, n_app, i);
}

// Merge routing, one candidate slot j at a time in increasing j (j >= sink): token i (target != -1)
// moves to j when kg_i . K^+_j beats its best so far strictly, so ties keep the smaller j (spec 4.5
// step 4). Before the first slot, set best_logit[i] = -inf and target[i] = 0 (unrouted) for merges.
// kg: [n, D], khat: [D], best_logit: [n], target: [n]
template <class Acc>
KVMEM_HOST_DEVICE inline void merge_route_update(const Acc* kg, std::int64_t n, std::int64_t D, const Acc* khat,
                                                 std::int64_t j, Acc* best_logit, std::int64_t* target,
                                                 bool first_candidate) {
  for (std::int64_t i = 0; i < n; ++i) {
    if (target[i] == -1) continue;
    const Acc l = dot(khat, kg + i * D, D);
    if (first_candidate || l > best_logit[i]) {
      best_logit[i] = l;
      target[i] = j;
    }
  }
}

// Blocked form of merge_route_update for slots j0 .. j0+rows-1 (khat: [rows, D]), still in
// increasing j per token, so ties keep the smaller j and results equal the one-slot form.
template <class Acc>
KVMEM_HOST_DEVICE inline void merge_route_update_rows(const Acc* kg, std::int64_t n, std::int64_t D, const Acc* khat,
                                                      std::int64_t j0, std::int64_t rows, Acc* best_logit,
                                                      std::int64_t* target, bool first_candidate) {
  for (std::int64_t i = 0; i < n; ++i) {
    if (target[i] == -1) continue;
    for (std::int64_t r = 0; r < rows; ++r) {
      const Acc l = dot(khat + r * D, kg + i * D, D);
      if ((first_candidate && r == 0) || l > best_logit[i]) {
        best_logit[i] = l;
        target[i] = j0 + r;
      }
    }
  }
}

// merge_route_update_rows from precomputed logits: logits[i * ld + r] = kg_i . K^+_{j0 + r}, same rule
// (increasing j per token, strict improvement, ties keep the smaller j). logits: [n, ld]
template <class Acc>
KVMEM_HOST_DEVICE inline void merge_route_update_logits(const Acc* logits, std::int64_t ld, std::int64_t n,
                                                        std::int64_t j0, std::int64_t rows, Acc* best_logit,
                                                        std::int64_t* target, bool first_candidate) {
  for (std::int64_t i = 0; i < n; ++i) {
    if (target[i] == -1) continue;
    for (std::int64_t r = 0; r < rows; ++r) {
      const Acc l = logits[i * ld + r];
      if ((first_candidate && r == 0) || l > best_logit[i]) {
        best_logit[i] = l;
        target[i] = j0 + r;
      }
    }
  }
}

// Scatter of gated sums into slot j: Sk_j += sum kg_i, Sv_j += sum vg_i, cnt_j += #i over the
// tokens routed to j, added in increasing token order (spec 4.5 step 4, one parallel scatter
// against the same K^+: the bodies run after routing is complete).
// kg: [n, D], vg: [n, Dv], target: [n], sk: [D], sv: [Dv]
template <class Acc>
KVMEM_HOST_DEVICE inline void scatter_into_slot(const Acc* kg, const Acc* vg, const std::int64_t* target,
                                                std::int64_t n, std::int64_t D, std::int64_t Dv, std::int64_t j,
                                                Acc* sk, Acc* sv, Acc* cnt) {
  for (std::int64_t i = 0; i < n; ++i) {
    if (target[i] != j) continue;
    for (std::int64_t d = 0; d < D; ++d) sk[d] += kg[i * D + d];
    for (std::int64_t d = 0; d < Dv; ++d) sv[d] += vg[i * Dv + d];
    *cnt += Acc(1);
  }
}

// The same scatter for every slot j in [j_begin, j_end) at once, in one pass over the tokens: each
// slot still receives its tokens in increasing token order, so the sums are bitwise those of
// scatter_into_slot called for each j, in O(n) instead of O(n x slots) (the serial drivers' form).
// sk: [slots, D], sv: [slots, Dv], cnt: [slots], indexed by absolute slot.
template <class Acc>
KVMEM_HOST_DEVICE inline void scatter_into_slots(const Acc* kg, const Acc* vg, const std::int64_t* target,
                                                 std::int64_t n, std::int64_t D, std::int64_t Dv, std::int64_t j_begin,
                                                 std::int64_t j_end, Acc* sk, Acc* sv, Acc* cnt) {
  for (std::int64_t i = 0; i < n; ++i) {
    const std::int64_t j = target[i];
    if (j < j_begin || j >= j_end) continue;
    for (std::int64_t d = 0; d < D; ++d) sk[j * D + d] += kg[i * D + d];
    for (std::int64_t d = 0; d < Dv; ++d) sv[j * Dv + d] += vg[i * Dv + d];
    cnt[j] += Acc(1);
  }
}

// ---- the state steps of one item, one token or one slot per call (spec 4.3-4.5) ---------------------
// Host and Kokkos drivers run these same bodies: the host in loops on one thread per item, Kokkos with
// a team's threads over tokens or slots. Per token / per slot they do exactly the same arithmetic, so
// the drivers' results are bitwise equal however the calls are spread.

// What the state steps read from the parameters and learned weights (spec 2), in kernel form.
template <class Acc>
struct KvmStepParams {
  std::int64_t D = 0, Dv = 0, rope_dims = 0;
  const Acc* ln_w = nullptr;  // [D]
  const Acc* ln_b = nullptr;  // [D]
  Acc eps = Acc(0);
  bool merge_gate_keys = false, merge_gate_values = false, gate_appends = false, gate_initial = false,
       value_radius = false;
};

// value_readout into an fp8 row: V^ is formed in Acc exactly as above and stored with one scale
// (quantize_row's rule, core/numeric.hpp: a power of two bringing the row's amax to <= 448), without
// a scratch row: the factor is applied twice, once for the amax and once for the store. Returns the
// scale. sv: [Dv], out: [Dv]
template <class Acc>
KVMEM_HOST_DEVICE inline float value_readout_scaled(const Acc* sv, std::int64_t Dv, Acc rho, Acc cnt, bool value_radius,
                                                    e4m3* out) {
  const Acc f = value_readout_factor(sv, Dv, rho, cnt, value_radius);
  float amax = 0.0f;
  for (std::int64_t d = 0; d < Dv; ++d) {
    const float x = static_cast<float>(sv[d] * f), a = x < 0.0f ? -x : x;
    amax = a > amax ? a : amax;
  }
  const float scale = fp8_row_scale(amax), inverse = fp8_inverse_scale(scale);
  for (std::int64_t d = 0; d < Dv; ++d) out[d] = e4m3(static_cast<float>(sv[d] * f) * inverse);
  return scale;
}

// Spec 4.4 steps 1-2: K^_j = LN_s(Sk_j) (through the Acc row `ln`) and V^_j of one slot. Row-scaled
// storage (fp8) writes each row's scale to *khat_scale and *vhat_scale (unused otherwise).
// sk: [D], sv: [Dv], ln: [D] scratch, khat: [D], vhat: [Dv]
template <class Acc, class S>
KVMEM_HOST_DEVICE inline void refresh_slot(const KvmStepParams<Acc>& p, const Acc* sk, const Acc* sv, Acc rho, Acc cnt,
                                           Acc* ln, S* khat, S* vhat, float* khat_scale = nullptr,
                                           float* vhat_scale = nullptr) {
  layer_norm(sk, p.D, p.ln_w, p.ln_b, p.eps, ln);
  if constexpr (is_row_scaled_v<S>) {
    *khat_scale = quantize_row(ln, khat, p.D);
    *vhat_scale = value_readout_scaled(sv, p.Dv, rho, cnt, p.value_radius, vhat);
  } else {
    (void)khat_scale, (void)vhat_scale;
    for (std::int64_t d = 0; d < p.D; ++d) khat[d] = store_as<S>(ln[d]);
    value_readout(sv, p.Dv, rho, cnt, p.value_radius, vhat);
  }
}

// Spec 4.3: a window token (key wk, value wv, gate g) founds a slot: Sk = k0, Sv = v, rho = ||v||,
// cnt = 1, each gated when gate_initial and its merge gate flag are on (spec 4.2). K^/V^ not refreshed.
// wk: [D], wv: [Dv], sk: [D], sv: [Dv]
template <class Acc, class S>
KVMEM_HOST_DEVICE inline void found_slot(const KvmStepParams<Acc>& p, const S* wk, const S* wv, Acc g, Acc* sk, Acc* sv,
                                         Acc* rho, Acc* cnt) {
  preprocess_key(wk, p.D, p.rope_dims, p.ln_w, p.ln_b, p.eps, sk);
  for (std::int64_t d = 0; d < p.Dv; ++d) sv[d] = load_as<Acc>(wv[d]);
  *rho = norm2<Acc>(sv, p.Dv);
  *cnt = Acc(1);
  if (p.gate_initial) {
    if (p.merge_gate_keys)
      for (std::int64_t d = 0; d < p.D; ++d) sk[d] *= g;
    if (p.merge_gate_values)
      for (std::int64_t d = 0; d < p.Dv; ++d) sv[d] *= g;
  }
}

// Spec 4.5 step 1 for one token of the chunk: k0 = LN_s(masked k), kg = g k0 and vg = g v where the
// merge gate flags say so. wk: [D], wv: [Dv], k0: [D], kg: [D], vg: [Dv]
template <class Acc, class S>
KVMEM_HOST_DEVICE inline void prepare_token(const KvmStepParams<Acc>& p, const S* wk, const S* wv, Acc g, Acc* k0,
                                            Acc* kg, Acc* vg) {
  preprocess_key(wk, p.D, p.rope_dims, p.ln_w, p.ln_b, p.eps, k0);
  for (std::int64_t d = 0; d < p.D; ++d) kg[d] = p.merge_gate_keys ? g * k0[d] : k0[d];
  for (std::int64_t d = 0; d < p.Dv; ++d) {
    const Acc x = load_as<Acc>(wv[d]);
    vg[d] = p.merge_gate_values ? g * x : x;
  }
}

// Spec 4.5 step 3: an appended token becomes slot j: Sk = kg or k0 and Sv = vg or the raw v
// (gate_appends), rho = ||Sv||, cnt = 1. k0, kg: [D], vg, wv: [Dv], sk: [D], sv: [Dv]
template <class Acc, class S>
KVMEM_HOST_DEVICE inline void append_slot(const KvmStepParams<Acc>& p, const Acc* k0, const Acc* kg, const Acc* vg,
                                          const S* wv, Acc* sk, Acc* sv, Acc* rho, Acc* cnt) {
  for (std::int64_t d = 0; d < p.D; ++d) sk[d] = p.gate_appends ? kg[d] : k0[d];
  for (std::int64_t d = 0; d < p.Dv; ++d) sv[d] = p.gate_appends ? vg[d] : load_as<Acc>(wv[d]);
  *rho = norm2<Acc>(sv, p.Dv);
  *cnt = Acc(1);
}

// The slot an appended token takes: |S| before the update plus the appended tokens before it
// (appends keep increasing token order, spec 4.5 step 3). target: [n] (-1 = appended)
KVMEM_HOST_DEVICE inline std::int64_t append_slot_index(const std::int64_t* target, std::int64_t i,
                                                        std::int64_t slots_before) {
  std::int64_t j = slots_before;
  for (std::int64_t e = 0; e < i; ++e) j += target[e] == -1 ? 1 : 0;
  return j;
}

}  // namespace kvmem::kernel
