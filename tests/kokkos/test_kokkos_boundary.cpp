// SPDX-License-Identifier: Apache-2.0
// Decision boundaries on the Kokkos backend, the same cases as the host's (tests/ua/ua_boundary_cases.hpp,
// tests/kvm/kvm_boundary_cases.hpp): UA eviction at p = 1, λ exactly at ln p in fp32, p just above 0;
// KVM merge-argmax and append-cutoff ties, and the KVM option grid. Expected values: closed forms and the
// fp64 reference.
#include <cstdint>
#include <limits>
#include <vector>

#include <catch2/catch.hpp>

#include "kvm/kvm_boundary_cases.hpp"
#include "kvm/kvm_option_grid.hpp"
#include "ua/ua_boundary_cases.hpp"
#include "ua_kokkos_util.hpp"

namespace {
using namespace kvmem::test::ua;

boundary::Run kokkos_ua_run(const Case& c, std::int64_t split, const kvmem::ua::Options& opt) {
  const FloatCase f(c);
  const kvmem::test::KokkosExec exec{};
  auto cache = make_kokkos_cache(exec, f);
  boundary::Run r;
  r.out = kokkos_prefill_decode(f, split, opt, cache, exec);
  r.kept = kokkos_kept_mask(cache, c.config.T);
  r.lambda.assign(r.kept.size(), std::numeric_limits<double>::quiet_NaN());
  const auto snap = kvmem::kokkos::snapshot(cache);
  for (std::int64_t b = 0; b < c.config.B; ++b)
    for (std::int64_t g = 0; g < c.config.G; ++g)
      for (std::int64_t e = 0; e < snap.length_of(b, g); ++e)
        r.lambda[std::size_t((b * c.config.G + g) * c.config.T + snap.positions(b, g)[e])] =
            snap.lambda[std::size_t(snap.item(b, g) * snap.shape.capacity + e)];
  return r;
}

kvmem::test::HostResult kokkos_kvm_run(const kvmem::test::rkvm::Config& c, const kvmem::test::rkvm::Inputs& in,
                                       std::int64_t split) {
  if (split == c.T) return kvmem::test::kokkos_prefill<float>(c, in);
  kvmem::test::HostResult r;
  r.out = kvmem::test::kokkos_prefill_then_decode<float>(c, in, split, &r);
  return r;
}
}  // namespace

TEST_CASE("kokkos ua: p = 1 keeps exactly the keys that never decayed, the new token included",
          "[kokkos][ua][boundary]") {
  boundary::check_p_one(kokkos_ua_run);
}

TEST_CASE("kokkos ua: a key whose fp32 λ equals ln p stays, and goes at the next larger p", "[kokkos][ua][boundary]") {
  boundary::check_exact_threshold(kokkos_ua_run);
}

TEST_CASE("kokkos ua: p just above 0 evicts only keys decayed below ln p = -744", "[kokkos][ua][boundary]") {
  boundary::check_p_tiny(kokkos_ua_run);
}

TEST_CASE("kokkos kvm: merge-argmax ties go to the smallest non-sink slot", "[kokkos][kvm][boundary]") {
  kvmem::test::boundary::check_merge_ties(kokkos_kvm_run);
}

TEST_CASE("kokkos kvm: append-cutoff ties go to the lowest token index", "[kokkos][kvm][boundary]") {
  kvmem::test::boundary::check_append_ties(kokkos_kvm_run);
}

TEST_CASE("kokkos kvm fp32 over the option grid: sink 0/1/2, window 1-3 chunks, count mode, gate_initial_state",
          "[kokkos][kvm][options]") {
  kvmem::test::option_grid::check_option_grid(kokkos_kvm_run);
}
