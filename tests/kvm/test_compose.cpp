// SPDX-License-Identifier: Apache-2.0
// Compile-time composition with a user budget policy (DESIGN.md 2): kvm::Attention<LogBudget{...}>
// sizes its state from the policy's max_slots, follows the policy's slot schedule, and matches the fp64
// reference run with the same policy; the schedule is checked against the policy's formula computed
// in the test. The built-in budgets keep their own fast path (no update-target table).

#include <cstdint>
#include <span>
#include <vector>

#include <catch2/catch.hpp>

#include "compose_budget.hpp"
#include "kvm_host_util.hpp"

using namespace kvmem::test;
using kvmem::TensorView;
namespace kvm = kvmem::kvm;

namespace {
constexpr double kTolFp32 = 2e-5;
constexpr LogBudget kLog{4.0, 8, 1 << 20};
using LogKvm = kvm::Attention<kLog, kvmem::precision::Fp32Storage>;
static_assert(kvmem::BudgetPolicy<LogBudget>);
}  // namespace

TEST_CASE("kvm Attention with a user budget matches the fp64 reference", "[kvm][unit][compose]") {
  auto c = small_config(2, 120, 4, 2, 16, 12, kvmem::budget::Any(kLog));
  const auto in = random_inputs(c, 29);
  kvm::Params p = to_params(c);
  p.budget = kvmem::budget::Fixed{8, 8};  // replaced by the compile-time budget
  const LogKvm attn(p);
  CHECK(attn.params.budget.kind == kvmem::budget::Any::Kind::kUser);
  CHECK(std::string(attn.params.budget.name()) == "log");

  LogKvm::state_type st;
  const kvm::Shape shape = to_shape(c, c.T);
  REQUIRE(attn.make_state(shape, st).is_ok());
  // Sized from the policy's closed form: max(min(n_ctx, C), floor(4 log2 120) = 27).
  CHECK(st.capacity() == 27);
  REQUIRE(st.update_targets() != nullptr);
  CHECK(attn.state_bytes(shape) == st.state_bytes());

  const FloatWeights w(in);
  HostResult host;
  kvm::RouteLog log;
  REQUIRE(host_feed(st, c, in, w, 0, c.T, host.out, nullptr, &log).is_ok());
  extract_state(st, c, host);
  extract_routes(log, c, host);

  const auto expected = log_budget_schedule(4.0, 8, c.chunk, c.window_chunks, c.T);
  REQUIRE(expected.size() == 12);
  CHECK(expected.back() > expected.front());  // the schedule grows (not a fixed budget in disguise)
  CHECK(host.slots_after_update == expected);
  CHECK(st.slots(0) == expected.back());

  const auto ref = kvmem::reference::kvm::prefill(c, in);
  CHECK(ref.slots_after_update == expected);
  KVMEM_CHECK_CLOSE(host.out, ref.out, kTolFp32);
  KVMEM_CHECK_CLOSE(host.state_k, ref.state_k, kTolFp32);
  KVMEM_CHECK_CLOSE(host.state_v, ref.state_v, kTolFp32);
  CHECK(host.route_append == ref.route_append);
  CHECK(host.route_merge == ref.route_merge);

  // Decode after a prefill follows the same schedule, bitwise equal to the one prefill.
  HostResult fin;
  const auto od = host_prefill_then_decode<float>(c, in, 40, &fin);
  CHECK(od == host.out);
  CHECK(fin.state_k == host.state_k);
}

TEST_CASE("a slot record of a user budget imports only into a state with the same policy", "[kvm][unit][compose]") {
  auto c = small_config(1, 64, 2, 1, 8, 8, kvmem::budget::Any(kLog));
  const auto in = random_inputs(c, 5);
  const FloatWeights w(in);
  kvm::State<float, float> a, same, other;
  REQUIRE(kvm::State<float, float>::create(to_params(c), to_shape(c, c.T), a).is_ok());
  REQUIRE(kvm::State<float, float>::create(to_params(c), to_shape(c, c.T), same).is_ok());
  auto c2 = c;
  c2.budget = kvmem::budget::Any(LogBudget{5.0, 8, 1 << 20});
  REQUIRE(kvm::State<float, float>::create(to_params(c2), to_shape(c2, c2.T), other).is_ok());
  std::vector<float> out;
  REQUIRE(host_feed(a, c, in, w, 0, c.T, out).is_ok());
  kvmem::host::Executor exec{1};
  std::vector<std::byte> bytes(kvm::export_bytes(a, 0));
  REQUIRE(kvm::export_slot(exec, a, 0, std::span<std::byte>(bytes)).is_ok());
  CHECK(kvm::import_slot(exec, same, w.view(), 0, std::span<const std::byte>(bytes)).is_ok());
  CHECK(same.slots(0) == a.slots(0));
  const auto refused = kvm::import_slot(exec, other, w.view(), 0, std::span<const std::byte>(bytes));
  CHECK_FALSE(refused.is_ok());
  CHECK_THAT(refused.message(), Catch::Matchers::Contains("budget_minimum"));
}

TEST_CASE("the built-in budgets keep their closed form and need no update-target table", "[kvm][unit][compose]") {
  for (const kvmem::budget::Any& b :
       {kvmem::budget::Any(kvmem::budget::Fixed{16, 16}), kvmem::budget::Any(kvmem::budget::Power{16.0, 0.5, 8}),
        kvmem::budget::Any(kvmem::budget::Saturating{64.0, 8})}) {
    auto c = small_config(1, 64, 2, 1, 8, 8, b);
    kvm::State<float, float> st;
    REQUIRE(kvm::State<float, float>::create(to_params(c), to_shape(c, c.T), st).is_ok());
    CHECK(st.update_targets() == nullptr);
    CHECK(b.fingerprint() == 0);
  }
}

TEST_CASE("a variant with fixed head dims refuses a state of other dims", "[kvm][unit][compose]") {
  using Kvm = kvm::Attention<kLog, kvmem::precision::Fp32Storage, 16, 12>;
  static_assert(Kvm::kHeadDim == 16 && Kvm::kValueDim == 12);
  const Kvm attn(to_params(small_config(1, 64, 2, 1, 16, 12, kvmem::budget::Any(kLog))));
  Kvm::state_type st;
  const auto ok = attn.make_state({1, 2, 1, 16, 12, 64}, st);
  INFO(ok.to_string());
  CHECK(ok.is_ok());
  const auto wrong_d = attn.make_state({1, 2, 1, 32, 12, 64}, st);
  CHECK_THAT(wrong_d.message(), Catch::Matchers::Contains("head dim 16"));
  const auto wrong_dv = attn.make_state({1, 2, 1, 16, 16, 64}, st);
  CHECK_THAT(wrong_dv.message(), Catch::Matchers::Contains("value head dim 12"));
}
