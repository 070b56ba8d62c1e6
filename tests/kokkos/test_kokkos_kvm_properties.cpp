// SPDX-License-Identifier: Apache-2.0
// KVM on Kokkos: random shapes, budgets and flags against the fp64 reference (1e-5 relative, routes and
// |S| exact) and against the host backend (same bodies, same tile order: bitwise on host spaces, within
// the fp32 tolerance on device spaces, kvm_kokkos_util.hpp); the same bits when a call repeats and for
// every team size; decode == prefill at every split; ragged lengths read on the device; views of any
// layout; validation before any change.
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include <catch2/catch.hpp>

#include "kvm_kokkos_util.hpp"

namespace {
using namespace kvmem::test;
using kvmem::budget::Fixed;
using kvmem::budget::Power;
using kvmem::budget::Saturating;
constexpr double kTolFp32 = 1e-5;
constexpr double kTolBf16 = 1e-2;  // DESIGN.md 5, for results read from bf16-stored keys and values

// A Kokkos state after its updates against the host backend's: routes and |S| exactly, the slot sums
// and ρ bitwise on host spaces (both orders keep the host's update order), within the fp32 tolerance on
// device spaces.
void check_state_as_host(const HostResult& kk, const HostResult& host) {
  CHECK(kk.slots_after_update == host.slots_after_update);
  CHECK(kk.route_append == host.route_append);
  CHECK(kk.route_merge == host.route_merge);
  CHECK(kk.slots == host.slots);
  if constexpr (std::is_same_v<KokkosSpace, Kokkos::DefaultHostExecutionSpace>) {
    CHECK(same_bits(kk.state_k, host.state_k));
    CHECK(same_bits(kk.state_v, host.state_v));
    CHECK(same_bits(kk.state_rho, host.state_rho));
  } else {
    KVMEM_KOKKOS_CHECK_AS_HOST(kk.state_k, host.state_k, kTolFp32);
    KVMEM_KOKKOS_CHECK_AS_HOST(kk.state_v, host.state_v, kTolFp32);
  }
}

TEST_CASE("kokkos kvm matches the reference and the host backend on random shapes, budgets and flags",
          "[kokkos][kvm][unit]") {
  std::uint64_t seed = 100;
  for (auto c : {small_config(2, 61, 2, 2, 16, 16, Power{3.0, 0.5, 8, 1, 8000}),
                 small_config(1, 70, 6, 2, 16, 12, Saturating{32.0, 1, 8000, 1}),  // GQA rep 3, Dv != D
                 small_config(2, 45, 3, 1, 8, 20, Fixed{8, 8}),                    // MQA, Dv > D
                 small_config(1, 83, 2, 1, 12, 8, Power{4.0, 0.5, 8, 1, 30})}) {   // cap binds
    for (int flags = 0; flags < 5; ++flags) {
      c.gate_appends = flags & 1;
      c.merge_gate_keys = !(flags & 2);
      c.head_temps = flags != 3;
      c.gate_initial = flags == 3;
      c.value_radius = flags != 4;  // count mode
      const auto in = random_inputs(c, seed++);
      INFO("B" << c.B << " T" << c.T << " Hq" << c.Hq << " Hk" << c.Hk << " D" << c.D << " Dv" << c.Dv << " budget "
               << c.budget.name() << " flags " << flags);
      const auto ref = rkvm::prefill(c, in);
      const auto kk = kokkos_prefill<float>(c, in);
      KVMEM_CHECK_CLOSE(kk.out, ref.out, kTolFp32);
      KVMEM_CHECK_CLOSE(kk.state_k, ref.state_k, kTolFp32);
      KVMEM_CHECK_CLOSE(kk.state_v, ref.state_v, kTolFp32);
      CHECK(kk.slots_after_update == ref.slots_after_update);
      CHECK(kk.route_append == ref.route_append);
      CHECK(kk.route_merge == ref.route_merge);
      const auto host = host_prefill<float>(c, in);
      KVMEM_KOKKOS_CHECK_AS_HOST(kk.out, host.out, kTolFp32);
      KVMEM_KOKKOS_CHECK_AS_HOST(kk.state_k, host.state_k, kTolFp32);
      KVMEM_KOKKOS_CHECK_AS_HOST(kk.state_v, host.state_v, kTolFp32);
    }
  }
}

TEST_CASE("kokkos kvm state updates equal the host backend's: routes exactly, the state bitwise on host spaces",
          "[kokkos][kvm][unit]") {
  // The update (spec 4.5) keeps the host's per-token and per-slot order in both orders of the Kokkos
  // backend (the device order spreads it over token-block and slot-block teams), so its routes, |S|
  // and slot sums equal the host backend's bitwise wherever the host compiler builds it, whichever
  // order the readout runs in. C = 40 gives token blocks of 16, 16 and 8, and |S| >= 40 gives several
  // 32-slot LN tiles and refresh blocks, so tile and block edges are crossed; six updates (the last
  // chunk partial).
  std::uint64_t seed = 500;
  for (auto c : {small_config(2, 331, 4, 2, 16, 12, Power{8.0, 0.5, 8, 1, 8000}),  // all appended, then mixed
                 small_config(1, 330, 2, 1, 12, 16, Fixed{40, 40}),                // merges only
                 small_config(1, 321, 3, 1, 16, 8, Saturating{300.0, 1, 8000, 1})}) {
    c.chunk = 40;
    const auto in = random_inputs(c, seed++);
    INFO("T" << c.T << " budget " << c.budget.name());
    const auto kk = kokkos_prefill<float>(c, in);
    const auto host = host_prefill<float>(c, in);
    REQUIRE(host.route_merge.size() == 6);
    check_state_as_host(kk, host);
    KVMEM_KOKKOS_CHECK_AS_HOST(kk.out, host.out, kTolFp32);
    HostResult fin;  // decode from mid-sequence: its updates run one per one-token call
    CHECK(kokkos_prefill_then_decode<float>(c, in, 150, &fin) == kk.out);
    CHECK(same_bits(fin.state_k, kk.state_k));
    CHECK(same_bits(fin.state_v, kk.state_v));
  }
}

TEST_CASE("kokkos kvm gives the same bits with one thread and with several threads per team", "[kokkos][kvm][unit]") {
  const int wide = wide_team_size();
  if (wide < 2) {
    WARN("SKIPPED: " << KokkosSpace::name() << " runs one thread per team here (concurrency "
                     << KokkosSpace().concurrency() << ")");
    return;
  }
  std::uint64_t seed = 300;
  for (auto c : {small_config(2, 75, 4, 2, 16, 12, Power{3.0, 0.5, 8, 1, 8000}),  // appends and merges
                 small_config(1, 90, 3, 1, 12, 16, Fixed{12, 12})}) {             // merges only, past the cap
    c.chunk = 8;
    const auto in = random_inputs(c, seed++);
    INFO("team size " << wide << " T" << c.T << " budget " << c.budget.name());
    const auto one = kokkos_prefill<float>(c, in, KokkosExec{KokkosSpace(), false, 1});
    const auto many = kokkos_prefill<float>(c, in, KokkosExec{KokkosSpace(), false, wide});
    CHECK(many.out == one.out);
    CHECK(many.state_k == one.state_k);
    CHECK(many.state_v == one.state_v);
    CHECK(many.route_append == one.route_append);
    CHECK(many.route_merge == one.route_merge);
    const auto host = host_prefill<float>(c, in);
    KVMEM_KOKKOS_CHECK_AS_HOST(many.out, host.out, kTolFp32);
    KVMEM_KOKKOS_CHECK_AS_HOST(many.state_k, host.state_k, kTolFp32);
    const auto decoded =
        kokkos_prefill_then_decode<float>(c, in, c.T / 2, nullptr, KokkosExec{KokkosSpace(), false, wide});
    CHECK(decoded == one.out);
  }
}

TEST_CASE("kokkos kvm gives the same bits when a call repeats", "[kokkos][kvm][unit]") {
  // On every space, device spaces included: no order-dependent reductions in the kernels (the device
  // order's atomic tickets choose which team merges, never the order of a sum).
  auto c = small_config(2, 75, 4, 2, 16, 12, Power{3.0, 0.5, 8, 1, 8000});
  c.chunk = 8;
  const auto in = random_inputs(c, 310);
  for (const int team : {0, wide_team_size()}) {
    INFO("team size " << team << " (0: Kokkos chooses)");
    const KokkosExec exec{KokkosSpace(), false, team};
    const auto first = kokkos_prefill<float>(c, in, exec);
    const auto second = kokkos_prefill<float>(c, in, exec);
    CHECK(same_bits(second.out, first.out));
    CHECK(same_bits(second.state_k, first.state_k));
    CHECK(same_bits(second.state_v, first.state_v));
    CHECK(second.route_append == first.route_append);
    CHECK(second.route_merge == first.route_merge);
    const auto decoded = kokkos_prefill_then_decode<float>(c, in, 30, nullptr, exec);
    CHECK(same_bits(kokkos_prefill_then_decode<float>(c, in, 30, nullptr, exec), decoded));
  }
}

TEST_CASE("kokkos kvm one-token calls equal one prefill at every split", "[kokkos][kvm][unit]") {
  auto c = small_config(2, 45, 4, 2, 8, 6, Power{3.0, 0.5, 8, 1, 8000});
  c.chunk = 4;
  const auto in = random_inputs(c, 11);
  const auto kk = kokkos_prefill<float>(c, in);
  KVMEM_CHECK_CLOSE(kk.out, rkvm::prefill(c, in).out, kTolFp32);
  for (std::int64_t split = 0; split <= c.T; ++split) {
    INFO("split " << split);
    HostResult fin;
    const auto od = kokkos_prefill_then_decode<float>(c, in, split, &fin);
    CHECK(od == kk.out);  // the same operations in the same order (spec 6.1: exact)
    CHECK(fin.state_k == kk.state_k);
    CHECK(fin.state_v == kk.state_v);
    const std::size_t first = kk.route_merge.size() - fin.route_merge.size();
    for (std::size_t u = 0; u < fin.route_merge.size(); ++u) CHECK(fin.route_merge[u] == kk.route_merge[first + u]);
  }
}

TEST_CASE("kokkos kvm decode rows split over several teams equal one prefill and the host backend",
          "[kokkos][kvm][unit]") {
  // A one-token call has few rows, so the device order splits each row's pieces of 64 keys over several
  // teams that leave them in the workspace, and a second launch merges them (backend/kokkos/kvm.hpp,
  // run_call); a prefill segment has enough rows to keep every row on one team. The split moves work
  // between teams, never a sum's order: decode must equal prefill bitwise. C = 32, 96 slots and a
  // 64-token window give rows of up to 160 keys (3 pieces, 3 splits): early rows have fewer pieces than
  // splits, piece edges fall inside the slots and inside the window, the window wraps; D = 12 and
  // Dv = 20 leave lanes past the last multiple of 8.
  auto c = small_config(2, 300, 4, 2, 12, 20, Fixed{96, 96});
  c.chunk = 32;
  const auto in = random_inputs(c, 910);
  const auto kk = kokkos_prefill<float>(c, in);
  KVMEM_CHECK_CLOSE(kk.out, rkvm::prefill(c, in).out, kTolFp32);
  const auto host = host_prefill<float>(c, in);
  for (const std::int64_t split : {std::int64_t(0), std::int64_t(150)}) {
    INFO("prefill of " << split << " tokens, then one-token calls");
    HostResult fin;
    const auto od = kokkos_prefill_then_decode<float>(c, in, split, &fin);
    CHECK(same_bits(od, kk.out));
    KVMEM_KOKKOS_CHECK_AS_HOST(od, host.out, kTolFp32);
    CHECK(same_bits(fin.state_k, kk.state_k));
    CHECK(same_bits(fin.state_v, kk.state_v));
  }
}

TEST_CASE("kokkos kvm one-token calls across update boundaries equal the host backend's", "[kokkos][kvm][unit]") {
  // A one-token call at a chunk boundary runs the pending update first (spec 4.7 step 4); on device
  // spaces over the update's teams around the state kernel (the last routing team of an item scatters
  // and refreshes, the last split team of a row merges it: backend/kokkos/kvm.hpp). Its routes, |S| and
  // slot sums must be the host backend's (bitwise on host spaces, where both orders keep the host's
  // update order), the outputs within the tolerance, and calls without the route log (an engine's) the
  // same bits. C = 32 and a 64-token window: a prefill of 69 tokens (the first chunk founds slots, no
  // update yet), then one-token calls through the updates at 96, 128, 160 and 192.
  std::uint64_t seed = 930;
  for (auto c : {small_config(2, 195, 4, 2, 16, 12, Power{8.0, 0.5, 8, 1, 8000}),  // appends, then mixed
                 small_config(1, 195, 2, 1, 12, 16, Fixed{40, 40})}) {             // merges only
    c.chunk = 32;
    const std::int64_t split = 69;
    const auto in = random_inputs(c, seed++);
    INFO("B" << c.B << " budget " << c.budget.name());
    HostResult kk_fin, host_fin;
    const auto kk = kokkos_prefill_then_decode<float>(c, in, split, &kk_fin);
    const auto host = host_prefill_then_decode<float>(c, in, split, &host_fin);
    REQUIRE(host_fin.route_merge.size() == 4);
    check_state_as_host(kk_fin, host_fin);
    KVMEM_KOKKOS_CHECK_AS_HOST(kk, host, kTolFp32);
    const KokkosExec exec{};
    auto st = make_kokkos_state<float>(exec, c);
    const FloatWeights w(in);
    std::vector<float> quiet;
    REQUIRE(kokkos_feed(exec, st.state, c, in, w, 0, split, quiet).is_ok());
    for (std::int64_t t = split; t < c.T; ++t) REQUIRE(kokkos_feed(exec, st.state, c, in, w, t, t + 1, quiet).is_ok());
    HostResult quiet_fin;
    extract_state(st.state, c, quiet_fin);
    CHECK(same_bits(quiet, kk));
    CHECK(same_bits(quiet_fin.state_k, kk_fin.state_k));
    CHECK(same_bits(quiet_fin.state_v, kk_fin.state_v));
    CHECK(quiet_fin.slots == kk_fin.slots);
  }
}

TEST_CASE("kokkos kvm one-token calls give the same bits with teams running concurrently", "[kokkos][kvm][unit]") {
  // The device order's one-token call hands work between teams of one launch through atomic tickets:
  // an item's last routing team scatters and refreshes, a split row's last team merges its pieces, the
  // call's last row team folds the counters (backend/kokkos/kvm.hpp, last_team). On a host space built
  // for the device order, the default team takes every thread of the pool, so its teams run one at a
  // time; teams narrower than the pool run at once on the CPU's threads and draw their tickets
  // concurrently. Every team size, call after call, must give the bits of teams one at a time: a
  // publication the ticket does not order, a ticket not reset or drawn twice changes outputs, slot sums
  // or counters. A host space hands each thread a contiguous range of a launch's teams, so the calls
  // with one item and one query head put an item's routing teams (2) and a row's split teams (2, 3 or 5)
  // on different threads. C = 32 and a 64-token window: updates at 96, 128 and 160.
  const int threads = KokkosSpace().concurrency();
  std::uint64_t seed = 950;
  for (auto c : {small_config(1, 170, 1, 1, 16, 12, Power{8.0, 0.5, 8, 1, 8000}),  // appends, then mixed
                 small_config(1, 170, 1, 1, 16, 12, Fixed{64, 64}),                // merges, 2 pieces a row
                 small_config(1, 170, 1, 1, 12, 16, Fixed{96, 96}),                // 3 pieces a row
                 small_config(1, 170, 1, 1, 8, 8, Fixed{200, 200}),                // 5 pieces a row
                 small_config(3, 170, 2, 1, 12, 16, Fixed{96, 96})}) {             // several items and rows
    c.chunk = 32;
    const std::int64_t split = 69;
    const auto in = random_inputs(c, seed++);
    HostResult one_fin;
    const auto one = kokkos_prefill_then_decode<float>(c, in, split, &one_fin);
    for (int team = 1; team == 1 || team < threads; team *= 2) {
      for (int repeat = 0; repeat < 3; ++repeat) {
        INFO("B" << c.B << " budget " << c.budget.name() << ", team size " << team << " of " << threads
                 << " threads, repeat " << repeat);
        HostResult fin;
        const auto many = kokkos_prefill_then_decode<float>(c, in, split, &fin, KokkosExec{KokkosSpace(), false, team});
        CHECK(same_bits(many, one));
        CHECK(same_bits(fin.state_k, one_fin.state_k));
        CHECK(same_bits(fin.state_v, one_fin.state_v));
        CHECK(same_bits(fin.state_rho, one_fin.state_rho));
        CHECK(fin.slots == one_fin.slots);
        CHECK(fin.slots_after_update == one_fin.slots_after_update);
        CHECK(fin.route_merge == one_fin.route_merge);
      }
    }
  }
}

TEST_CASE("kokkos kvm decode through kvm::decode and bf16 storage equal the host backend", "[kokkos][kvm][unit]") {
  auto c = small_config(2, 40, 4, 2, 16, 16, Power{3.0, 0.5, 8, 1, 8000});
  const auto in = random_inputs(c, 21);
  const KokkosExec exec{};
  auto st = make_kokkos_state<kvmem::bf16>(exec, c);
  kvmem::kvm::State<kvmem::bf16, float> host_st;
  REQUIRE(kvmem::kvm::State<kvmem::bf16, float>::create(to_params(c), to_shape(c, c.T), host_st).is_ok());
  const FloatWeights w(in);
  std::vector<float> out_k, out_h;
  REQUIRE(kokkos_feed(exec, st.state, c, in, w, 0, 30, out_k).is_ok());
  REQUIRE(host_feed(host_st, c, in, w, 0, 30, out_h).is_ok());
  // One step through kvm::decode with views of Kokkos memory.
  const auto q = to_device(slice_tokens(in.q, c.B * c.Hq, c.T, c.D, 30, 31), c.B, c.Hq, 1, c.D);
  const auto k = to_device(slice_tokens(in.k, c.B * c.Hk, c.T, c.D, 30, 31), c.B, c.Hk, 1, c.D);
  const auto v = to_device(slice_tokens(in.v, c.B * c.Hk, c.T, c.Dv, 30, 31), c.B, c.Hk, 1, c.Dv);
  const auto g = to_device(slice_tokens(in.gate, c.B * c.Hk, c.T, 1, 30, 31), c.B, c.Hk, 1);
  const auto o = to_device(std::vector<float>(std::size_t(c.B * c.Hq * c.Dv), 0.0f), c.B, 1, c.Hq, c.Dv);
  const auto lw = to_device(w.w, c.D), lb = to_device(w.b, c.D), ts = to_device(w.ts, c.Hq), tw = to_device(w.tw, c.Hq);
  using kvmem::TensorView;
  using kvmem::kokkos::to_tensor_view;
  const kvmem::kvm::Weights wv{to_tensor_view(lw), to_tensor_view(lb), to_tensor_view(ts), to_tensor_view(tw)};
  REQUIRE(kvmem::kvm::decode(exec, st.state, wv, TensorView<const float, 4>(to_tensor_view(q)),
                             TensorView<const float, 4>(to_tensor_view(k)),
                             TensorView<const float, 4>(to_tensor_view(v)),
                             TensorView<const float, 3>(to_tensor_view(g)), to_tensor_view(o))
              .is_ok());
  std::vector<float> step_h;
  REQUIRE(host_feed(host_st, c, in, w, 30, 31, step_h).is_ok());
  const auto step_k = to_host(o);
  std::vector<float> expect;
  for (std::int64_t b = 0; b < c.B; ++b)
    expect.insert(expect.end(), step_h.begin() + (b * c.T + 30) * c.Hq * c.Dv,
                  step_h.begin() + (b * c.T + 31) * c.Hq * c.Dv);
  KVMEM_KOKKOS_CHECK_AS_HOST(out_k, out_h, kTolBf16);
  KVMEM_KOKKOS_CHECK_AS_HOST(step_k, expect, kTolBf16);
  CHECK(st.state.tokens(0) == 31);
  CHECK(st.state.slots(1) == host_st.slots(1));
}

TEST_CASE("kokkos kvm forward allocates its state in the space's memory and matches the reference",
          "[kokkos][kvm][unit]") {
  const auto c = small_config(2, 37, 4, 2, 16, 12, Saturating{32.0, 1, 8000, 1});
  const auto in = random_inputs(c, 13);
  const FloatWeights w(in);
  const auto q = to_device(slice_tokens(in.q, c.B * c.Hq, c.T, c.D, 0, c.T), c.B, c.Hq, c.T, c.D);
  const auto k = to_device(slice_tokens(in.k, c.B * c.Hk, c.T, c.D, 0, c.T), c.B, c.Hk, c.T, c.D);
  const auto v = to_device(slice_tokens(in.v, c.B * c.Hk, c.T, c.Dv, 0, c.T), c.B, c.Hk, c.T, c.Dv);
  const auto g = to_device(slice_tokens(in.gate, c.B * c.Hk, c.T, 1, 0, c.T), c.B, c.Hk, c.T);
  const auto lw = to_device(w.w, c.D), lb = to_device(w.b, c.D), ts = to_device(w.ts, c.Hq), tw = to_device(w.tw, c.Hq);
  Kokkos::View<float****, Kokkos::LayoutRight, KokkosSpace::memory_space> o("out", c.B, c.T, c.Hq, c.Dv);
  using kvmem::TensorView;
  using kvmem::kokkos::to_tensor_view;
  const auto s = kvmem::kvm::forward(
      KokkosExec{}, to_params(c),
      kvmem::kvm::Weights{to_tensor_view(lw), to_tensor_view(lb), to_tensor_view(ts), to_tensor_view(tw)},
      TensorView<const float, 4>(to_tensor_view(q)), TensorView<const float, 4>(to_tensor_view(k)),
      TensorView<const float, 4>(to_tensor_view(v)), TensorView<const float, 3>(to_tensor_view(g)), to_tensor_view(o));
  INFO(s.to_string());
  REQUIRE(s.is_ok());
  KVMEM_CHECK_CLOSE(to_host(o), rkvm::prefill(c, in).out, kTolFp32);
}

TEST_CASE("kokkos kvm ragged lengths in device memory equal separate single-sequence references",
          "[kokkos][kvm][unit]") {
  auto c = small_config(3, 53, 4, 2, 16, 8, Power{3.0, 0.5, 8, 1, 8000});
  const auto in = random_inputs(c, 5);
  const std::vector<std::int64_t> lengths{53, 17, 40};
  const auto dev_lengths = to_device(lengths, 3);
  const KokkosExec exec{};
  auto st = make_kokkos_state<float>(exec, c);
  std::vector<float> out;
  REQUIRE(kokkos_feed(exec, st.state, c, in, FloatWeights(in), 0, c.T, out, dev_lengths.data()).is_ok());
  for (std::int64_t b = 0; b < 3; ++b) {
    INFO("sequence " << b << " length " << lengths[std::size_t(b)]);
    CHECK(st.state.tokens(b) == lengths[std::size_t(b)]);
    auto cb = c;
    cb.B = 1;
    cb.T = lengths[std::size_t(b)];
    rkvm::Inputs ib = in;
    const auto pick = [&](const std::vector<double>& x, std::int64_t rows, std::int64_t width) {
      std::vector<double> y;
      for (std::int64_t r = b * rows; r < (b + 1) * rows; ++r)
        y.insert(y.end(), x.begin() + r * c.T * width, x.begin() + (r * c.T + cb.T) * width);
      return y;
    };
    ib.q = pick(in.q, c.Hq, c.D);
    ib.k = pick(in.k, c.Hk, c.D);
    ib.v = pick(in.v, c.Hk, c.Dv);
    ib.gate = pick(in.gate, c.Hk, 1);
    const auto ref = rkvm::prefill(cb, ib);
    const auto row = [&](std::int64_t t) { return out.begin() + (b * c.T + t) * c.Hq * c.Dv; };
    KVMEM_CHECK_CLOSE(std::vector<float>(row(0), row(cb.T)), ref.out, kTolFp32);
    CHECK(st.state.slots(b) == ref.slots);
    CHECK(std::vector<float>(row(cb.T), row(c.T)) == std::vector<float>(std::size_t((c.T - cb.T) * c.Hq * c.Dv), 0.0f));
  }
}

TEST_CASE("kokkos kvm reads LayoutLeft and strided views through their strides", "[kokkos][kvm][unit]") {
  auto c = small_config(2, 30, 4, 2, 8, 8, Fixed{8, 8});
  const auto in = random_inputs(c, 9);
  const KokkosExec exec{};
  const auto right = kokkos_prefill<float>(c, in);
  // q and k as LayoutLeft copies, out as a LayoutLeft view: same values through different strides.
  const auto qr = to_device(slice_tokens(in.q, c.B * c.Hq, c.T, c.D, 0, c.T), c.B, c.Hq, c.T, c.D);
  const auto kr = to_device(slice_tokens(in.k, c.B * c.Hk, c.T, c.D, 0, c.T), c.B, c.Hk, c.T, c.D);
  const auto v = to_device(slice_tokens(in.v, c.B * c.Hk, c.T, c.Dv, 0, c.T), c.B, c.Hk, c.T, c.Dv);
  const auto g = to_device(slice_tokens(in.gate, c.B * c.Hk, c.T, 1, 0, c.T), c.B, c.Hk, c.T);
  using Left4 = Kokkos::View<float****, Kokkos::LayoutLeft, KokkosSpace::memory_space>;
  Left4 ql("q left", c.B, c.Hq, c.T, c.D), kl("k left", c.B, c.Hk, c.T, c.D), ol("out left", c.B, c.T, c.Hq, c.Dv);
  Kokkos::deep_copy(ql, qr);
  Kokkos::deep_copy(kl, kr);
  const FloatWeights w(in);
  const auto lw = to_device(w.w, c.D), lb = to_device(w.b, c.D), ts = to_device(w.ts, c.Hq), tw = to_device(w.tw, c.Hq);
  using kvmem::TensorView;
  using kvmem::kokkos::to_tensor_view;
  auto st = make_kokkos_state<float>(exec, c);
  REQUIRE(kvmem::kvm::prefill(
              exec, st.state,
              kvmem::kvm::Weights{to_tensor_view(lw), to_tensor_view(lb), to_tensor_view(ts), to_tensor_view(tw)},
              TensorView<const float, 4>(to_tensor_view(ql)), TensorView<const float, 4>(to_tensor_view(kl)),
              TensorView<const float, 4>(to_tensor_view(v)), TensorView<const float, 3>(to_tensor_view(g)),
              to_tensor_view(ol))
              .is_ok());
  using Right4 = Kokkos::View<float****, Kokkos::LayoutRight, KokkosSpace::memory_space>;
  Right4 o("out right", c.B, c.T, c.Hq, c.Dv);
  Kokkos::deep_copy(o, ol);
  CHECK(to_host(o) == right.out);
}

TEST_CASE("kokkos kvm rejects bad input before any state change", "[kokkos][kvm][unit]") {
  auto c = small_config(2, 20, 2, 2, 8, 8, Fixed{8, 8});
  auto in = random_inputs(c, 3);
  const FloatWeights w(in);
  const KokkosExec exec{KokkosSpace(), true};  // checked: bad input comes back as a Status
  auto st = make_kokkos_state<float>(exec, c);
  std::vector<float> out;
  REQUIRE(kokkos_feed(exec, st.state, c, in, w, 0, 10, out).is_ok());
  const auto sk_before = std::vector<float>(st.state.item(1, 1).sk, st.state.item(1, 1).sk + 8 * c.D);
  SECTION("NaN in k of sequence 1") {
    in.k[std::size_t(((1 * c.Hk + 1) * c.T + 12) * c.D + 3)] = std::numeric_limits<double>::quiet_NaN();
    const auto s = kokkos_feed(exec, st.state, c, in, w, 10, 20, out);
    CHECK(s.code() == kvmem::StatusCode::kInvalidArgument);
    CHECK(s.to_string().find("sequence 1") != std::string::npos);
  }
  SECTION("gate <= 0") {
    in.gate[std::size_t((0 * c.Hk + 1) * c.T + 15)] = 0.0;
    CHECK(kokkos_feed(exec, st.state, c, in, w, 10, 20, out).code() == kvmem::StatusCode::kInvalidArgument);
  }
  SECTION("more tokens than n_ctx, checked and unchecked") {
    auto c2 = c;
    c2.T = 11;  // the state was sized for 20 tokens; 10 + 11 > 20
    auto in2 = random_inputs(c2, 4);
    CHECK(kokkos_feed(exec, st.state, c2, in2, FloatWeights(in2), 0, 11, out).code() == kvmem::StatusCode::kOutOfRange);
    // Unchecked: no read-back; the kernels skip the overflowing sequences and leave them untouched.
    const KokkosExec unchecked{KokkosSpace(), false};
    CHECK(kokkos_feed(unchecked, st.state, c2, in2, FloatWeights(in2), 0, 11, out).is_ok());
  }
  CHECK(st.state.tokens(0) == 10);
  CHECK(st.state.tokens(1) == 10);
  CHECK(std::vector<float>(st.state.item(1, 1).sk, st.state.item(1, 1).sk + 8 * c.D) == sk_before);
}

TEST_CASE("kokkos kvm moved-from and never-created states refuse every call; slot indices are checked",
          "[kokkos][kvm][unit][slots]") {
  auto c = small_config(2, 20, 2, 2, 8, 8, Fixed{8, 8});
  const auto in = random_inputs(c, 3);
  const FloatWeights w(in);
  const KokkosExec exec{KokkosSpace(), true};  // checked: bad input comes back as a Status
  auto a = make_kokkos_state<float>(exec, c);
  auto twin = make_kokkos_state<float>(exec, c);
  std::vector<float> out_a, out_twin;
  REQUIRE(kokkos_feed(exec, a.state, c, in, w, 0, 10, out_a).is_ok());
  REQUIRE(kokkos_feed(exec, twin.state, c, in, w, 0, 10, out_twin).is_ok());
  CHECK(a.state.reset(8).code() == kvmem::StatusCode::kOutOfRange);  // used to zero sequence 0's counters
  CHECK(a.state.tokens(0) == 10);
  auto b = std::move(a);
  decltype(b) never;
  for (auto* e : {&a, &never}) {
    CHECK(!e->state.valid());
    CHECK(e->state.max_slots() == 0);
    CHECK(!e->state.reset(0).is_ok());
    CHECK(kokkos_feed(exec, e->state, c, in, w, 10, 20, out_a).code() == kvmem::StatusCode::kInvalidArgument);
  }
  // the new owner continues exactly like the twin that never moved
  REQUIRE(kokkos_feed(exec, b.state, c, in, w, 10, 20, out_a).is_ok());
  REQUIRE(kokkos_feed(exec, twin.state, c, in, w, 10, 20, out_twin).is_ok());
  CHECK(out_a == out_twin);
}

}  // namespace
