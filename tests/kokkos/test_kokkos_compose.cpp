// SPDX-License-Identifier: Apache-2.0
// Compile-time composition on Kokkos: a user budget policy (tests/kvm/compose_budget.hpp) drives the
// Kokkos KVM kernels through the state's update-target table and matches the fp64 reference, the
// policy's own schedule and the host backend bitwise.

#include <cstdint>
#include <vector>

#include <catch2/catch.hpp>

#include "kvm/compose_budget.hpp"
#include "kvm_kokkos_util.hpp"

using namespace kvmem::test;

TEST_CASE("kokkos kvm with a user budget matches the reference and the host", "[kokkos][kvm][compose]") {
  auto c = small_config(2, 120, 4, 2, 16, 12, kvmem::budget::Any(LogBudget{4.0, 8, 1 << 20}));
  const auto in = random_inputs(c, 29);
  const auto expected = log_budget_schedule(4.0, 8, c.chunk, c.window_chunks, c.T);
  const auto ref = kvmem::reference::kvm::prefill(c, in);
  const auto kk = kokkos_prefill<float>(c, in);
  const auto host = host_prefill<float>(c, in);
  CHECK(kk.slots_after_update == expected);
  CHECK(kk.route_append == ref.route_append);
  CHECK(kk.route_merge == ref.route_merge);
  KVMEM_CHECK_CLOSE(kk.out, ref.out, 2e-5);
  KVMEM_CHECK_CLOSE(kk.state_k, ref.state_k, 2e-5);
  CHECK(kk.out == host.out);
  CHECK(kk.state_k == host.state_k);
  // decode after a prefill: the same schedule from the table, token by token
  HostResult fin;
  const auto od = kokkos_prefill_then_decode<float>(c, in, 40, &fin);
  CHECK(od == kk.out);
  CHECK(fin.slots_after_update.back() == expected.back());
}
