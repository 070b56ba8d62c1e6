// SPDX-License-Identifier: Apache-2.0
// Two execution-space instances at once, in two forms:
//  1. Two instances, work launched back to back with no fence in between (KVM prefill on one, UA prefill
//     on the other, both unchecked so nothing reads back), then both fenced. On Kokkos >= 4 the two
//     instances come from partition_space and may overlap (streams on a GPU). Kokkos 3.4.1's Serial has
//     only its default instance and runs every launch synchronously, so there both "instances" are the
//     same one and the launches run one after the other: the test then checks the asynchronous API use
//     (no hidden host reads or fences are needed for correct results), not overlap.
//  2. Two std::threads launching on Kokkos::Serial() at the same time, with separate states and views.
//     Kokkos 3.4's Serial keeps ONE global team-data buffer for reductions and team scratch
//     (serial_get_thread_team_data), so only launches that use neither may overlap from two threads:
//     the KVM kernels with checked = false qualify (range and team launches, no scratch, no reduction);
//     UA (team scratch) and checked calls (a reduction) would race inside Kokkos 3.4 itself, so the
//     threaded test runs KVM only. Each result must equal its single-threaded run bitwise.
#include <cstdint>
#include <thread>
#include <vector>

#include <catch2/catch.hpp>

#include "ua_kokkos_util.hpp"

namespace {
using namespace kvmem::test;
using kvmem::TensorView;
using kvmem::budget::Power;
using kvmem::budget::Saturating;
using kvmem::kokkos::to_tensor_view;

std::vector<KokkosSpace> two_instances() {
#if KOKKOS_VERSION >= 40000
  const auto parts = Kokkos::Experimental::partition_space(KokkosSpace(), 1, 1);
  return {parts[0], parts[1]};
#else
  return {KokkosSpace(), KokkosSpace()};  // Kokkos 3.4: the default instance twice (see above)
#endif
}

// Device copies of one KVM problem's inputs, weights and output.
struct KvmProblem {
  rkvm::Config c;
  rkvm::Inputs in;
  FloatWeights w;
  Kokkos::View<float****, Kokkos::LayoutRight, KokkosSpace::memory_space> q, k, v, out;
  Kokkos::View<float***, Kokkos::LayoutRight, KokkosSpace::memory_space> g;
  Kokkos::View<float*, Kokkos::LayoutRight, KokkosSpace::memory_space> lw, lb, ts, tw;

  KvmProblem(const rkvm::Config& cfg, std::uint64_t seed)
      : c(cfg),
        in(random_inputs(cfg, seed)),
        w(in),
        q(to_device(slice_tokens(in.q, c.B * c.Hq, c.T, c.D, 0, c.T), c.B, c.Hq, c.T, c.D)),
        k(to_device(slice_tokens(in.k, c.B * c.Hk, c.T, c.D, 0, c.T), c.B, c.Hk, c.T, c.D)),
        v(to_device(slice_tokens(in.v, c.B * c.Hk, c.T, c.Dv, 0, c.T), c.B, c.Hk, c.T, c.Dv)),
        out("out", c.B, c.T, c.Hq, c.Dv),
        g(to_device(slice_tokens(in.gate, c.B * c.Hk, c.T, 1, 0, c.T), c.B, c.Hk, c.T)),
        lw(to_device(w.w, c.D)),
        lb(to_device(w.b, c.D)),
        ts(to_device(w.ts, c.Hq)),
        tw(to_device(w.tw, c.Hq)) {}

  // Launches the prefill; returns without waiting for it.
  kvmem::Status launch(const KokkosExec& exec, kvmem::kvm::State<float, float>& st) const {
    return kvmem::kvm::prefill(
        exec, st, kvmem::kvm::Weights{to_tensor_view(lw), to_tensor_view(lb), to_tensor_view(ts), to_tensor_view(tw)},
        TensorView<const float, 4>(to_tensor_view(q)), TensorView<const float, 4>(to_tensor_view(k)),
        TensorView<const float, 4>(to_tensor_view(v)), TensorView<const float, 3>(to_tensor_view(g)),
        to_tensor_view(out));
  }
};

TEST_CASE("kokkos two execution-space instances take interleaved KVM and UA work", "[kokkos][unit]") {
  const auto spaces = two_instances();
  const KokkosExec ea{spaces[0], false}, eb{spaces[1], false};
  const KvmProblem kvm(small_config(2, 50, 4, 2, 16, 8, Power{3.0, 0.5, 8, 1, 8000}), 31);
  const auto ua_case = ua::random_case(2, 40, 4, 2, 16, 32, 1.0, true);
  const ua::FloatCase f(ua_case);
  const ua::KokkosCase kc(f);
  const auto ua_out = kc.make_out();
  auto state = make_kokkos_state<float>(ea, kvm.c);
  auto cache = ua::make_kokkos_cache(eb, f);
  const kvmem::ua::Options opt{0.05, 16, true};
  // No fence between the two launches: each instance only orders its own work.
  REQUIRE(kvm.launch(ea, state.state).is_ok());
  REQUIRE(kvmem::ua::prefill(eb, cache, kc.slice(0, 40), opt, kc.out_slice(ua_out, 0, 40)).is_ok());
  ea.space.fence();
  eb.space.fence();
  const auto kvm_out = to_host(kvm.out);
  const auto ua_got = to_host(ua_out);
  KVMEM_CHECK_CLOSE(kvm_out, rkvm::prefill(kvm.c, kvm.in).out, 1e-5);
  CHECK(kvm_out == kokkos_prefill<float>(kvm.c, kvm.in).out);
  auto pr_cfg = ua_case.config;
  pr_cfg.prefill_chunk = 16;
  pr_cfg.prefill_split = 40;
  const auto pr = ua::ref::pruned(pr_cfg, ua_case.inputs, 0.05);
  KVMEM_CHECK_CLOSE(ua_got, pr.out, 1e-5);
  CHECK(ua::kokkos_kept_mask(cache, 40) == pr.kept);
}

TEST_CASE("kokkos two host threads launch KVM on the Serial instance at the same time", "[kokkos][unit]") {
#if !defined(KOKKOS_ENABLE_DEFAULT_DEVICE_TYPE_SERIAL)
  WARN("SKIPPED: the default execution space is " << KokkosSpace::name()
                                                  << ", not Serial (this test launches on Kokkos::Serial())");
#else
  const KvmProblem p1(small_config(2, 64, 4, 2, 16, 8, Power{3.0, 0.5, 8, 1, 8000}), 51);
  const KvmProblem p2(small_config(1, 72, 6, 2, 12, 12, Saturating{32.0, 1, 8000, 1}), 52);
  const auto single1 = kokkos_prefill<float>(p1.c, p1.in);  // also sizes Kokkos' team data once
  const auto single2 = kokkos_prefill<float>(p2.c, p2.in);
  KokkosKvmState<float> s1, s2;
  kvmem::Status status1, status2;
  const auto body = [](const KvmProblem& p, KokkosKvmState<float>& st, kvmem::Status& status) {
    const KokkosExec exec{Kokkos::Serial(), false};  // no reduction, no scratch: see the file comment
    status = kvmem::kokkos::create_state<float, float>(exec, to_params(p.c), to_shape(p.c, p.c.T), st);
    for (int round = 0; round < 20 && status.is_ok(); ++round) {  // repeat to overlap many launches
      st.state.reset();
      status = p.launch(exec, st.state);
      exec.space.fence();
    }
  };
  std::thread t1(body, std::cref(p1), std::ref(s1), std::ref(status1));
  std::thread t2(body, std::cref(p2), std::ref(s2), std::ref(status2));
  t1.join();
  t2.join();
  REQUIRE(status1.is_ok());
  REQUIRE(status2.is_ok());
  CHECK(to_host(p1.out) == single1.out);
  CHECK(to_host(p2.out) == single2.out);
  CHECK(s1.state.slots(0) == single1.slots);  // |S| after T tokens (data independent, spec 3.1)
  CHECK(s1.state.slots(1) == single1.slots);
  CHECK(s2.state.tokens(0) == p2.c.T);
#endif
}

}  // namespace
