// SPDX-License-Identifier: Apache-2.0
// Exact ties in KVM routing on the host backend (spec KVM.md 4.5, 7.4): merge-argmax ties to the
// smallest non-sink slot (sink 0, 1, 2), append-cutoff ties to the lowest token index; prefill and
// prefill + decode against the fp64 reference.
#include <cstdint>

#include <catch2/catch.hpp>

#include "kvm_boundary_cases.hpp"

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
