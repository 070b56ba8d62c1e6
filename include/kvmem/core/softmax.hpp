// SPDX-License-Identifier: Apache-2.0
#pragma once
// Online (streaming) softmax for one query row, and the exact merge of two partial results.
//
// A row's partial result over a key range is (o, lse): o = sum_j p_j v_j with p normalised over
// that range, lse = log sum_j exp(l_j). Two partial results over disjoint ranges merge exactly:
//   lse = logaddexp(lse_a, lse_b),  o = exp(lse_a - lse) o_a + exp(lse_b - lse) o_b.
// Split-KV decode, several devices, and state-plus-window readouts all reduce through this merge.

#include <cmath>
#include <cstdint>

#include "kvmem/core/config.hpp"
#include "kvmem/core/math.hpp"

namespace kvmem {

// Running max and sum of exp(logit - max). The caller owns the accumulator vector; push() returns
// the factor to rescale it with and the weight of the new value, so the same state drives scalar
// loops, SIMD loops and GPU tiles.
template <class Acc>
struct OnlineSoftmax {
  Acc max = negative_infinity<Acc>();
  Acc sum = Acc(0);

  struct Step {
    Acc rescale;  // multiply the existing accumulator by this
    Acc weight;   // then add weight * value
  };

  KVMEM_HOST_DEVICE Step push(Acc logit) {
    using std::exp;
    if (logit == negative_infinity<Acc>()) return {Acc(1), Acc(0)};  // masked key
    if (logit > max) {
      const Acc rescale = (max == negative_infinity<Acc>()) ? Acc(0) : exp(max - logit);
      max = logit;
      sum = sum * rescale + Acc(1);
      return {rescale, Acc(1)};
    }
    const Acc weight = exp(logit - max);
    sum += weight;
    return {Acc(1), weight};
  }

  // Raise the running max to at least `block_max` before pushing a block of logits whose maximum
  // is known (tiles): every push in the block then has rescale == 1. Returns the rescale factor.
  KVMEM_HOST_DEVICE Acc raise_max(Acc block_max) {
    using std::exp;
    if (!(block_max > max)) return Acc(1);
    const Acc rescale = (max == negative_infinity<Acc>()) ? Acc(0) : exp(max - block_max);
    max = block_max;
    sum *= rescale;
    return rescale;
  }
  // Add exp(logit - max) for a logit not above the current max; returns the weight.
  KVMEM_HOST_DEVICE Acc accumulate(Acc logit) {
    using std::exp;
    const Acc weight = (logit == negative_infinity<Acc>()) ? Acc(0) : exp(logit - max);
    sum += weight;
    return weight;
  }

  // Add the summed weights of a block of logits pushed after raise_max(block max), each weight
  // exp(logit - max) computed by the caller's vectorised loop (the same formula as accumulate()).
  KVMEM_HOST_DEVICE void accumulate_sum(Acc weight_sum) { sum += weight_sum; }

  [[nodiscard]] KVMEM_HOST_DEVICE bool empty() const { return sum == Acc(0); }
  // 1 / sum, the factor that normalises the accumulator (0 for an empty row).
  [[nodiscard]] KVMEM_HOST_DEVICE Acc normaliser() const { return sum > Acc(0) ? Acc(1) / sum : Acc(0); }
  // Natural log-sum-exp of every pushed logit (-inf for an empty row).
  [[nodiscard]] KVMEM_HOST_DEVICE Acc lse() const {
    using std::log;
    return sum > Acc(0) ? max + log(sum) : negative_infinity<Acc>();
  }
};

// Merges two normalised partial results (o_a, lse_a), (o_b, lse_b) of length `dim` into
// (o_out, lse_out). o_out may alias o_a or o_b. An empty side (lse = -inf) contributes nothing.
template <class Acc>
KVMEM_HOST_DEVICE inline void merge_partials(const Acc* o_a, Acc lse_a, const Acc* o_b, Acc lse_b, std::int64_t dim,
                                             Acc* o_out, Acc& lse_out) {
  using std::exp;
  using std::log;
  const Acc ninf = negative_infinity<Acc>();
  if (lse_a == ninf && lse_b == ninf) {
    for (std::int64_t d = 0; d < dim; ++d) o_out[d] = Acc(0);
    lse_out = ninf;
    return;
  }
  const Acc hi = lse_a > lse_b ? lse_a : lse_b;
  const Acc wa = (lse_a == ninf) ? Acc(0) : exp(lse_a - hi);
  const Acc wb = (lse_b == ninf) ? Acc(0) : exp(lse_b - hi);
  const Acc total = wa + wb;
  for (std::int64_t d = 0; d < dim; ++d) o_out[d] = (wa * o_a[d] + wb * o_b[d]) / total;
  lse_out = hi + log(total);
}

}  // namespace kvmem
