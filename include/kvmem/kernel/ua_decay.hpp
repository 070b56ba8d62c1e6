// SPDX-License-Identifier: Apache-2.0
#pragma once
// Universal Attention decay bodies shared by every backend (spec UA.md 4.1, 4.2, 4.4 step 1):
// the per-step decay A_jm of one (key j, position m) pair from the gates of a decay::Set, a decay
// tile, the cumulative decay along the position axis, and the decode lambda update.
//
// Backend-neutral: KVMEM_HOST_DEVICE, no allocation, no containers, no exceptions. The cumulative
// decay always accumulates in increasing m (Λ_ij = Λ_{i-1,j} + A_ji, spec UA.md 4.2), one rounding per
// step, so prefill tiles, chunked prefill and token-by-token decode produce bitwise identical λ.

#include <cstdint>
#include <type_traits>

#include "kvmem/core/config.hpp"
#include "kvmem/core/math.hpp"
#include "kvmem/core/numeric.hpp"
#include "kvmem/policy/decay.hpp"

namespace kvmem::kernel::ua {

// a . b over n elements with eight partial sums (vectorises without reassociation; the order is
// fixed, so every caller gets the same bits). a: [n], b: [n]
template <class Acc, class A, class B>
KVMEM_HOST_DEVICE inline Acc dot8(const A* a, const B* b, std::int64_t n) {
  Acc part[8] = {Acc(0), Acc(0), Acc(0), Acc(0), Acc(0), Acc(0), Acc(0), Acc(0)};
  std::int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int l = 0; l < 8; ++l) part[l] += load_as<Acc>(a[i + l]) * load_as<Acc>(b[i + l]);
  Acc s = ((part[0] + part[1]) + (part[2] + part[3])) + ((part[4] + part[5]) + (part[6] + part[7]));
  for (; i < n; ++i) s += load_as<Acc>(a[i]) * load_as<Acc>(b[i]);
  return s;
}

namespace detail {
template <class S>
struct HasSimilarityGate : std::false_type {};
template <class... G>
struct HasSimilarityGate<decay::Set<G...>> : std::bool_constant<(std::is_same_v<G, decay::SimilarityGate> || ...)> {};
}  // namespace detail

// A set that contains SimilarityGate has a factor relu(c)^2 = 0 for c <= 0, so its geometric mean is
// 0 and A = 0 exactly (spec UA.md 4.1 step 3): kernels may skip the remaining gates for such pairs.
template <class S>
inline constexpr bool kHasSimilarityGate = detail::HasSimilarityGate<S>::value;

// The gate sum of decay::Set, with the per-key part (KeyGate: depends on z_k[j] only) and the
// per-position part (QueryGate: z_q[m] only) precomputed once per key / position instead of once per
// pair. The fold runs left to right over the set's gates exactly like Set::log_mean_factor, with the
// same values, so the result is bitwise the one the set itself computes.
namespace detail {
template <class G, class Acc>
KVMEM_HOST_DEVICE inline Acc gate_value(const decay::PairInputs<Acc>& in, Acc key_part, Acc query_part) {
  if constexpr (std::is_same_v<G, decay::KeyGate>)
    return key_part;
  else if constexpr (std::is_same_v<G, decay::QueryGate>)
    return query_part;
  else
    return static_cast<Acc>(G::log_factor(in));
}
template <class S>
struct SetDecay;
template <class... G>
struct SetDecay<decay::Set<G...>> {
  template <class Acc>
  KVMEM_HOST_DEVICE static Acc log_decay(const decay::PairInputs<Acc>& in, Acc key_part, Acc query_part) {
    Acc sum = Acc(0);
    ((sum = sum + gate_value<G, Acc>(in, key_part, query_part)), ...);
    return log_decay_from_log_factor(sum / static_cast<Acc>(sizeof...(G)), static_cast<Acc>(decay::kClampEps));
  }
};
}  // namespace detail

// log g_k[j] (the KeyGate factor) of one key, and log g_q[m] (the QueryGate factor) of one position;
// 0 when the set has no such gate (the value is then never read).
template <class Acc>
KVMEM_HOST_DEVICE inline Acc key_gate_part(Acc key_logit) {
  decay::PairInputs<Acc> in;
  in.key_logit = key_logit;
  return decay::KeyGate::log_factor(in);
}
template <class Acc>
KVMEM_HOST_DEVICE inline Acc query_gate_part(Acc query_logit) {
  decay::PairInputs<Acc> in;
  in.query_logit = query_logit;
  return decay::QueryGate::log_factor(in);
}

// Spec UA.md 4.1: A_jm for one pair j < m from its similarity c_jm = k_j . k_m, computed by the caller
// (a backend that forms the similarities as a tile product, e.g. on tensor cores, calls this per pair).
template <class Set, class Acc>
KVMEM_HOST_DEVICE inline Acc decay_from_similarity(Acc similarity, Acc key_logit_j, Acc key_part, std::int64_t pos_j,
                                                   Acc query_logit_m, Acc query_part, std::int64_t pos_m) {
  decay::PairInputs<Acc> in;
  in.key_logit = key_logit_j;
  in.query_logit = query_logit_m;
  in.key_position = pos_j;
  in.position = pos_m;
  in.similarity = similarity;
  if constexpr (kHasSimilarityGate<Set>)
    if (!(similarity > Acc(0))) return Acc(0);  // relu(c)^2 = 0 -> x = 0 -> A = 0 exactly
  return detail::SetDecay<Set>::template log_decay<Acc>(in, key_part, query_part);
}

// Spec UA.md 4.1: A_jm for one pair j < m of one (sequence, kv head), given the precomputed gate parts
// key_part = key_gate_part(z_k[j]) and query_part = query_gate_part(z_q[m]). A row-scaled cached key
// (fp8, core/numeric.hpp) is scale_j * key_j: its similarity is the stored row's times the scale.
// key_j: [D] (cached key, storage type), key_m: [D] (the later token's key)
template <class Set, class Acc, class KJ, class KM>
KVMEM_HOST_DEVICE inline Acc pair_decay(const KJ* key_j, Acc key_logit_j, Acc key_part, std::int64_t pos_j,
                                        const KM* key_m, Acc query_logit_m, Acc query_part, std::int64_t pos_m,
                                        std::int64_t D, Acc scale_j = Acc(1)) {
  Acc similarity = Acc(0);
  if constexpr (Set::kNeedsSimilarity) {
    similarity = dot8<Acc>(key_j, key_m, D);
    if constexpr (is_row_scaled_v<KJ>) similarity *= scale_j;
  }
  return decay_from_similarity<Set, Acc>(similarity, key_logit_j, key_part, pos_j, query_logit_m, query_part, pos_m);
}

// The same without precomputed parts (one-off pairs, tests).
template <class Set, class Acc, class KJ, class KM>
KVMEM_HOST_DEVICE inline Acc pair_decay(const KJ* key_j, Acc key_logit_j, std::int64_t pos_j, const KM* key_m,
                                        Acc query_logit_m, std::int64_t pos_m, std::int64_t D) {
  return pair_decay<Set, Acc>(key_j, key_logit_j, key_gate_part(key_logit_j), pos_j, key_m, query_logit_m,
                              query_gate_part(query_logit_m), pos_m, D);
}

// Decay tile (spec UA.md 4.1): tile[e * ld + i] = A(key e, position m_i) for keys [0, n_keys) and
// positions m_i = first_pos + i, i in [0, n_pos); 0 where m_i <= pos_e (self term and the future).
// keys: [n_keys, D] rows key_stride apart; key_logit, key_pos: [n_keys];
// new_keys: [n_pos, D] rows new_key_stride apart; query_logit: [n_pos] query_logit_stride apart;
// tile: [n_keys, ld]; query_part: [n_pos] scratch; key_scale: [n_keys] for row-scaled keys, else unused
template <class Set, class Acc, class KS, class QS>
KVMEM_HOST_DEVICE inline void decay_tile(const KS* keys, std::int64_t key_stride, const Acc* key_logit,
                                         const std::int64_t* key_pos, std::int64_t n_keys, const QS* new_keys,
                                         std::int64_t new_key_stride, const QS* query_logit,
                                         std::int64_t query_logit_stride, std::int64_t first_pos, std::int64_t n_pos,
                                         std::int64_t D, Acc* tile, std::int64_t ld, Acc* query_part,
                                         const float* key_scale = nullptr) {
  // query_part: [n_pos] scratch for log g_q of each position (computed once per tile, not per pair)
  for (std::int64_t i = 0; i < n_pos; ++i)
    query_part[i] = query_gate_part(load_as<Acc>(query_logit[i * query_logit_stride]));
  for (std::int64_t e = 0; e < n_keys; ++e) {
    const Acc key_part = key_gate_part(key_logit[e]);
    Acc scale = Acc(1);
    if constexpr (is_row_scaled_v<KS>) scale = Acc(key_scale[e]);
    for (std::int64_t i = 0; i < n_pos; ++i) {
      const std::int64_t m = first_pos + i;
      tile[e * ld + i] = m > key_pos[e] ? pair_decay<Set, Acc>(keys + e * key_stride, key_logit[e], key_part,
                                                               key_pos[e], new_keys + i * new_key_stride,
                                                               load_as<Acc>(query_logit[i * query_logit_stride]),
                                                               query_part[i], m, D, scale)
                                        : Acc(0);
    }
  }
}

// Cumulative decay along the position axis for one key (spec UA.md 4.2): given λ = Λ_{m0-1,j} and the
// key's decay row a[i] = A_{j, m0+i}, writes bias[i * ld] = Λ_{m0+i, j} for i in [0, n) (-inf where
// m0+i < pos_j, 0 on the diagonal) and returns Λ_{m0+n-1, j}. Accumulates in increasing m.
// a: [n]; bias: [n] with stride ld
template <class Acc>
KVMEM_HOST_DEVICE inline Acc cumulative_decay(Acc lambda, std::int64_t pos_j, std::int64_t m0, const Acc* a,
                                              std::int64_t n, Acc* bias, std::int64_t ld) {
  for (std::int64_t i = 0; i < n; ++i) {
    const std::int64_t m = m0 + i;
    if (m < pos_j) {
      bias[i * ld] = negative_infinity<Acc>();  // causal mask
      continue;
    }
    if (m > pos_j) lambda += a[i];
    bias[i * ld] = lambda;
  }
  return lambda;
}

// Decode step 1 (spec UA.md 4.4): λ_e += A(e, t) for every cached entry of one (sequence, kv head).
// keys: [n, D] rows key_stride apart; lambda, key_logit, key_pos: [n]; new_key: [D];
// key_scale: [n] for row-scaled keys, else unused
template <class Set, class Acc, class KS, class QS>
KVMEM_HOST_DEVICE inline void lambda_update(const KS* keys, std::int64_t key_stride, const Acc* key_logit,
                                            const std::int64_t* key_pos, Acc* lambda, std::int64_t n, const QS* new_key,
                                            Acc query_logit, std::int64_t t, std::int64_t D,
                                            const float* key_scale = nullptr) {
  const Acc query_part = query_gate_part(query_logit);
  for (std::int64_t e = 0; e < n; ++e) {
    Acc scale = Acc(1);
    if constexpr (is_row_scaled_v<KS>) scale = Acc(key_scale[e]);
    if (t > key_pos[e])
      lambda[e] += pair_decay<Set, Acc>(keys + e * key_stride, key_logit[e], key_gate_part(key_logit[e]), key_pos[e],
                                        new_key, query_logit, query_part, t, D, scale);
  }
}

}  // namespace kvmem::kernel::ua
