// SPDX-License-Identifier: Apache-2.0
#pragma once
// Exact ties in KVM routing (spec KVM.md 4.5 and 7.4), checked on any backend with the same cases:
// merge-argmax ties go to the smallest non-sink slot, append-cutoff ties to the lowest token index.
// The ties are exact by construction (identical slots or identical tokens give bitwise identical
// dot products on every backend), and each case also has a closed-form expectation besides the fp64
// reference's routes.
//
// A backend is a runner: HostResult(const rkvm::Config&, const rkvm::Inputs&, std::int64_t split):
// prefill of [0, split) then one decode call per later token (split == T: one prefill), with the
// outputs, the final state and the routes of every update (tests/kvm/kvm_host_util.hpp's layout).

#include <algorithm>
#include <cstdint>
#include <vector>

#include <catch2/catch.hpp>

#include "kvm_host_util.hpp"

namespace kvmem::test::boundary {

// Token `from` copied onto token `to` (k, v and gate) in every (b, kv head).
inline void copy_token(const rkvm::Config& c, rkvm::Inputs& in, std::int64_t from, std::int64_t to) {
  for (std::int64_t row = 0; row < c.B * c.Hk; ++row) {
    for (std::int64_t d = 0; d < c.D; ++d)
      in.k[std::size_t((row * c.T + to) * c.D + d)] = in.k[std::size_t((row * c.T + from) * c.D + d)];
    for (std::int64_t d = 0; d < c.Dv; ++d)
      in.v[std::size_t((row * c.T + to) * c.Dv + d)] = in.v[std::size_t((row * c.T + from) * c.Dv + d)];
    in.gate[std::size_t(row * c.T + to)] = in.gate[std::size_t(row * c.T + from)];
  }
}

template <class Runner>
void check_against_reference(const rkvm::Config& c, const rkvm::Inputs& in, Runner&& run, std::int64_t split,
                             const rkvm::Result& ref) {
  INFO("split " << split);
  const HostResult r = run(c, in, split);
  REQUIRE(r.route_merge.size() == ref.route_merge.size());
  REQUIRE(r.route_append.size() == ref.route_append.size());
  for (std::size_t u = 0; u < ref.route_merge.size(); ++u) {
    INFO("update " << u + 1);
    CHECK(r.route_merge[u] == ref.route_merge[u]);
    CHECK(r.route_append[u] == ref.route_append[u]);
  }
  CHECK(r.slots == ref.slots);
  KVMEM_CHECK_CLOSE(r.state_k, ref.state_k, 1e-5);
  KVMEM_CHECK_CLOSE(r.state_v, ref.state_v, 1e-5);
  KVMEM_CHECK_CLOSE(r.out, ref.out, 1e-5);
}

// Merge-argmax ties: tokens 0..3 identical, so init slots 0..3 have bitwise identical K^ (LN_s of the
// same sum) and every merged token's logits to them tie exactly. The tokens of update 1 (chunk 1) are
// close to token 0, so many pick that group; each must go to its smallest non-sink member, slot
// `sink` (spec 4.5 step 4: argmax over j >= S, ties to the smallest j). Fixed budget of C slots:
// updates only merge. T = 5 C: two updates.
inline rkvm::Config merge_tie_config(std::int64_t sink, bool gate_initial, std::int64_t D = 8, std::int64_t C = 8) {
  rkvm::Config c = small_config(2, 5 * C, 4, 2, D, D == 8 ? 6 : D, kvmem::budget::Fixed{C, C});
  c.chunk = C;
  c.sink = sink;
  c.gate_initial = gate_initial;
  return c;
}
inline rkvm::Inputs merge_tie_inputs(const rkvm::Config& c) {
  rkvm::Inputs in = random_inputs(c, 7100 + std::uint64_t(c.sink));
  for (std::int64_t t = 1; t < 4; ++t) copy_token(c, in, 0, t);
  for (std::int64_t row = 0; row < c.B * c.Hk; ++row)  // update 1's tokens near token 0
    for (std::int64_t t = c.chunk; t < 2 * c.chunk; ++t)
      for (std::int64_t d = 0; d < c.D; ++d)
        in.k[std::size_t((row * c.T + t) * c.D + d)] =
            in.k[std::size_t((row * c.T) * c.D + d)] + 0.3 * in.k[std::size_t((row * c.T + t) * c.D + d)];
  return in;
}
// The closed form on update 1's routes (any backend or the reference): a token routed into the tied
// group {0..3} goes to slot `sink`; at least one token is (the tie is exercised).
inline void check_merge_tie_routes(const rkvm::Config& c, const std::vector<std::vector<std::int64_t>>& route_merge) {
  REQUIRE(route_merge.size() == 2);
  std::int64_t into_group = 0;
  for (std::int64_t target : route_merge[0]) {
    if (target >= 0 && target < 4) {
      ++into_group;
      CHECK(target == c.sink);
    }
  }
  REQUIRE(into_group > 0);
}

template <class Runner>
void check_merge_ties(Runner&& run) {
  for (const std::int64_t sink : {0, 1, 2})
    for (const bool gate_initial : {false, true}) {
      INFO("sink " << sink << ", gate_initial " << gate_initial);
      const rkvm::Config c = merge_tie_config(sink, gate_initial);
      const rkvm::Inputs in = merge_tie_inputs(c);
      const rkvm::Result ref = rkvm::prefill(c, in);
      check_merge_tie_routes(c, ref.route_merge);
      for (const std::int64_t split : {c.T, std::int64_t(13), std::int64_t(0)})
        check_against_reference(c, in, run, split, ref);
    }
}

// Append-cutoff ties: every token of updates 1 and 2 (chunks 1 and 2) has its chunk's one key (values
// and gates differ), so all novelty scores of an update tie exactly (the score uses the ungated k0,
// spec 4.5 step 2) and the append set is the first n_app tokens by index (ties by lower index, spec
// 7.4). Power budget f = 3, e = 0.5, min C; T = 5 C: two updates.
inline rkvm::Config append_tie_config(bool value_radius, std::int64_t D = 8, std::int64_t C = 8) {
  rkvm::Config c = small_config(1, 5 * C, 2, 1, D, D, kvmem::budget::Power{3.0, 0.5, C});
  c.chunk = C;
  c.value_radius = value_radius;
  return c;
}
inline rkvm::Inputs append_tie_inputs(const rkvm::Config& c) {
  rkvm::Inputs in = random_inputs(c, 7200);
  const std::int64_t C = c.chunk;
  for (std::int64_t t = C; t < 3 * C; ++t)
    for (std::int64_t d = 0; d < c.D; ++d)
      in.k[std::size_t(t * c.D + d)] = in.k[std::size_t((t < 2 * C ? C : 2 * C) * c.D + d)];
  return in;
}
// Closed form: update u appends tokens [u C, u C + n_u), n_u from the budget (spec 3.1; C = 8 gives the
// table of spec 8: 6 then 2 appends).
inline void check_append_tie_routes(const rkvm::Config& c, const std::vector<std::vector<std::int64_t>>& route_append) {
  REQUIRE(route_append.size() == 2);
  const std::int64_t C = c.chunk;
  std::int64_t cur = C;
  for (std::int64_t u = 1; u <= 2; ++u) {
    const std::int64_t N = (c.window_chunks + u) * C, avail = (u + 1) * C;
    const std::int64_t n = std::min(c.budget.slots(N, avail, cur) - cur, C);
    std::vector<std::int64_t> expect;
    for (std::int64_t t = u * C; t < u * C + n; ++t) expect.push_back(t);
    INFO("update " << u);
    REQUIRE(n > 0);
    REQUIRE(n < C);  // a cut inside the tied chunk
    CHECK(route_append[std::size_t(u - 1)] == expect);
    cur += n;
  }
}

template <class Runner>
void check_append_ties(Runner&& run) {
  for (const bool value_radius : {true, false}) {
    INFO("value_radius " << value_radius);
    const rkvm::Config c = append_tie_config(value_radius);
    const rkvm::Inputs in = append_tie_inputs(c);
    const rkvm::Result ref = rkvm::prefill(c, in);
    check_append_tie_routes(c, ref.route_append);
    for (const std::int64_t split : {c.T, std::int64_t(13), std::int64_t(0)})
      check_against_reference(c, in, run, split, ref);
  }
}

}  // namespace kvmem::test::boundary
