// SPDX-License-Identifier: Apache-2.0
#pragma once
// Generic attend-row body shared by every backend: one query row accumulates a range of keys into
// an online-softmax state (core/softmax.hpp) and an unnormalised output accumulator. KVM's readout
// (spec KVM.md 4.4) calls it once over the state slots and once per contiguous window segment, so
// slots and window share ONE softmax; dense causal attention calls it over [0, t].
//
// Backend-neutral: KVMEM_HOST_DEVICE, no allocation, no containers, no exceptions. Keys are read in
// tiles of kAttendTile so a tile's logits stay in registers/L1 and each row rescales once per tile.

#include <cstdint>

#include "kvmem/core/config.hpp"
#include "kvmem/core/math.hpp"
#include "kvmem/core/numeric.hpp"
#include "kvmem/core/softmax.hpp"

namespace kvmem::kernel {

inline constexpr std::int64_t kAttendTile = 64;

// a . b over n elements, eight partial sums so the compiler can vectorise without reassociation.
// a: [n] (accumulate type), b: [n] (storage type)
template <class Acc, class B>
KVMEM_HOST_DEVICE inline Acc dot(const Acc* a, const B* b, std::int64_t n) {
  Acc part[8] = {Acc(0), Acc(0), Acc(0), Acc(0), Acc(0), Acc(0), Acc(0), Acc(0)};
  std::int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int l = 0; l < 8; ++l) part[l] += a[i + l] * load_as<Acc>(b[i + l]);
  Acc s = ((part[0] + part[1]) + (part[2] + part[3])) + ((part[4] + part[5]) + (part[6] + part[7]));
  for (; i < n; ++i) s += a[i] * load_as<Acc>(b[i]);
  return s;
}

// Accumulates keys [0, count) into one row: l_j = logit_scale * (q . k_j), p over the union of
// everything pushed into `sm` so far (spec KVM.md 4.4 step 3).
// q: [D]; keys: [count, ldk] (first D used); vals: [count, ldv] (first Dv used); acc: [Dv]
// Row-scaled (fp8) keys or values read as scale * row (core/numeric.hpp): key_scale, value_scale
// [count] (read only for a row-scaled K / V). The dot and the value sum are taken on the stored
// elements and multiplied by the row's scale once, as the UA readout does (kernel/ua_attend.hpp).
template <class Acc, class K, class V>
KVMEM_HOST_DEVICE inline void attend_accumulate(OnlineSoftmax<Acc>& sm, Acc* acc, const Acc* q, std::int64_t D,
                                                Acc logit_scale, const K* keys, std::int64_t ldk, const V* vals,
                                                std::int64_t ldv, std::int64_t Dv, std::int64_t count,
                                                const float* key_scale = nullptr, const float* value_scale = nullptr) {
  using std::exp;
  Acc logits[kAttendTile];
  for (std::int64_t base = 0; base < count; base += kAttendTile) {
    const std::int64_t n = (count - base) < kAttendTile ? (count - base) : kAttendTile;
    Acc block_max = negative_infinity<Acc>();
    for (std::int64_t j = 0; j < n; ++j) {
      Acc qk = dot(q, keys + (base + j) * ldk, D);
      if constexpr (is_row_scaled_v<K>) qk *= Acc(key_scale[base + j]);
      logits[j] = logit_scale * qk;
      if (logits[j] > block_max) block_max = logits[j];
    }
    const Acc rescale = sm.raise_max(block_max);
    if (rescale != Acc(1))
      for (std::int64_t d = 0; d < Dv; ++d) acc[d] *= rescale;
    for (std::int64_t j = 0; j < n; ++j) {
      Acc w = sm.accumulate(logits[j]);
      if constexpr (is_row_scaled_v<V>) w *= Acc(value_scale[base + j]);
      const V* row = vals + (base + j) * ldv;
      for (std::int64_t d = 0; d < Dv; ++d) acc[d] += w * load_as<Acc>(row[d]);
    }
  }
}

// Split-key readout: a row's keys cut into pieces of kAttendTile consecutive keys, each piece reduced
// on its own and the pieces merged in increasing order (core/softmax.hpp: partial results over
// disjoint key ranges merge exactly). Every sum runs in one fixed order, so the result does not depend
// on how many threads share the pieces; it differs from attend_accumulate's running softmax in the
// last bits only (the rescales happen per piece instead of per tile).

// A piece's logits [n] become their weights exp(l - m) in place; returns m (the piece's max) and
// sum (the weights' sum, left to right).
template <class Acc>
struct PieceSoftmax {
  Acc max;
  Acc sum;
};
template <class Acc>
KVMEM_HOST_DEVICE inline PieceSoftmax<Acc> piece_weights(Acc* logits, std::int64_t n) {
  using std::exp;
  PieceSoftmax<Acc> p{negative_infinity<Acc>(), Acc(0)};
  for (std::int64_t j = 0; j < n; ++j)
    if (logits[j] > p.max) p.max = logits[j];
  for (std::int64_t j = 0; j < n; ++j) {
    const Acc w = logits[j] == negative_infinity<Acc>() ? Acc(0) : exp(logits[j] - p.max);
    logits[j] = w;
    p.sum += w;
  }
  return p;
}

// The merge of `count` pieces: factor[p] = exp(max_p - M) (M the largest piece max), returns the row's
// PieceSoftmax {M, sum_p sum_p factor[p]}; a row's output element is sum_p factor[p] acc_p[d] / sum.
// pieces: [count], factor: [count]
template <class Acc>
KVMEM_HOST_DEVICE inline PieceSoftmax<Acc> merge_piece_factors(const PieceSoftmax<Acc>* pieces, std::int64_t count,
                                                               Acc* factor) {
  using std::exp;
  PieceSoftmax<Acc> r{negative_infinity<Acc>(), Acc(0)};
  for (std::int64_t p = 0; p < count; ++p)
    if (pieces[p].max > r.max) r.max = pieces[p].max;
  for (std::int64_t p = 0; p < count; ++p) {
    factor[p] = pieces[p].max == negative_infinity<Acc>() ? Acc(0) : exp(pieces[p].max - r.max);
    r.sum += pieces[p].sum * factor[p];
  }
  return r;
}

// out = acc / sum (an empty row gives zeros). acc: [Dv], out: [Dv]
template <class Acc, class Out>
KVMEM_HOST_DEVICE inline void attend_finish(const OnlineSoftmax<Acc>& sm, const Acc* acc, std::int64_t Dv, Out* out) {
  const Acc inv = sm.normaliser();
  for (std::int64_t d = 0; d < Dv; ++d) out[d] = static_cast<Out>(acc[d] * inv);
}

}  // namespace kvmem::kernel
