// SPDX-License-Identifier: Apache-2.0
// Exact ties in KVM routing on the host backend (spec KVM.md 4.5, 7.4): merge-argmax ties to the
// smallest non-sink slot (sink 0, 1, 2), append-cutoff ties to the lowest token index; prefill and
// prefill + decode against the fp64 reference.
#include <cstdint>

#include <catch2/catch.hpp>

#include "kvm_boundary_cases.hpp"
#include "kvm_option_grid.hpp"
#include "support/near_ties.hpp"

namespace {
using namespace kvmem::test;

HostResult host_run(const rkvm::Config& c, const rkvm::Inputs& in, std::int64_t split) {
  if (split == c.T) return host_prefill<float>(c, in);
  HostResult r;
  r.out = host_prefill_then_decode<float>(c, in, split, &r);
  return r;
}
}  // namespace

TEST_CASE("host kvm: merge-argmax ties go to the smallest non-sink slot", "[kvm][host][boundary]") {
  boundary::check_merge_ties(host_run);
}

TEST_CASE("host kvm: append-cutoff ties go to the lowest token index", "[kvm][host][boundary]") {
  boundary::check_append_ties(host_run);
}

TEST_CASE("host kvm bf16: exact ties break as the spec says at D = 64, C = 16", "[kvm][host][boundary]") {
  // the configuration of the CUDA tensor-core tie test, on the host's bf16 state: closed forms only
  for (const std::int64_t sink : {0, 1, 2}) {
    INFO("merge ties, sink " << sink);
    const rkvm::Config c = boundary::merge_tie_config(sink, false, 64, 16);
    const rkvm::Inputs in = boundary::merge_tie_inputs(c);
    boundary::check_merge_tie_routes(c, host_prefill<kvmem::bf16>(c, in).route_merge);
    HostResult decoded;
    host_prefill_then_decode<kvmem::bf16>(c, in, 37, &decoded);
    boundary::check_merge_tie_routes(c, decoded.route_merge);
  }
  const rkvm::Config c = boundary::append_tie_config(true, 64, 16);
  const rkvm::Inputs in = boundary::append_tie_inputs(c);
  boundary::check_append_tie_routes(c, host_prefill<kvmem::bf16>(c, in).route_append);
}

// The near-tie accounting the CUDA bf16 tests use (tests/support/near_ties.hpp), checked here where it
// can be: it explains every route of the host's fp32 run (the fp64 reference forced along them) and
// flags a route moved to another slot.
TEST_CASE("near-tie accounting explains the host's fp32 routes and flags a moved one", "[kvm][host][nearties]") {
  rkvm::Config c = small_config(2, 90, 4, 2, 16, 16, kvmem::budget::Power{3.0, 0.5, 8});
  const rkvm::Inputs in = random_inputs(c, 515);
  HostResult r = host_prefill<float>(c, in);
  const auto stored = near_ties::kvm_inputs_as_stored<float>(in);
  const auto acc = near_ties::account_kvm_routes(c, stored, r, 0.0);
  INFO(acc.summary() << " " << acc.first_beyond);
  CHECK(acc.beyond == 0);
  CHECK(acc.merges > 100);
  CHECK(acc.append_updates > 0);
  // move one merge of the last update to the worst slot for that token: not a near-tie
  auto& last = r.route_merge.back();
  std::size_t moved = 0;
  while (last[moved] < 0) ++moved;
  last[moved] = last[moved] == c.sink ? c.sink + 1 : c.sink;
  const auto bad = near_ties::account_kvm_routes(c, stored, r, 0.0);
  INFO(bad.summary() << " " << bad.first_beyond);
  CHECK(bad.beyond >= 1);
}

TEST_CASE("host kvm fp32 over the option grid: sink 0/1/2, window 1-3 chunks, count mode, gate_initial_state",
          "[kvm][host][options]") {
  option_grid::check_option_grid(host_run);
}
