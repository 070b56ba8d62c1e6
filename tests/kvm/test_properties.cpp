// SPDX-License-Identifier: Apache-2.0
// KVM invariants of spec KVM.md section 6 on random inputs, for the fp64 reference and the host
// backend, plus host == reference on shapes the goldens do not cover (GQA with rep 3, Dv != D,
// ragged T, batches of different lengths, every budget and flag).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include <catch2/catch.hpp>

#include "kvm_host_util.hpp"
#include "kvmem/backend/host/kvm_dense.hpp"

namespace {
using namespace kvmem::test;
using kvmem::budget::Fixed;
using kvmem::budget::Power;
using kvmem::budget::Saturating;

constexpr double kTolRef = 1e-12;  // fp64 vs fp64
constexpr double kTolFp32 = 1e-5;  // host fp32 vs fp64 reference (golden README rule)

// A few shapes: (B, T, Hq, Hk, D, Dv, budget), C = 8, nb = 2, r = D/2.
std::vector<rkvm::Config> random_cases() {
  return {
      small_config(2, 61, 2, 2, 16, 16, Power{3.0, 0.5, 8, 1, 8000}),
      small_config(1, 70, 6, 2, 16, 12, Saturating{32.0, 1, 8000, 1}),  // GQA rep 3, Dv != D
      small_config(2, 45, 3, 1, 8, 20, Fixed{8, 8}),                    // MQA, Dv > D
      small_config(1, 83, 2, 1, 12, 8, Power{4.0, 0.5, 8, 1, 30}),      // cap binds (max 30)
  };
}

// Plain causal attention with keys tau_bswa[h] k, scale 1/sqrt(D) (spec 6.2), in double.
std::vector<double> plain_causal(const rkvm::Config& c, const rkvm::Inputs& in) {
  std::vector<double> out(std::size_t(c.B * c.T * c.Hq * c.Dv), 0.0);
  const double scale = c.scale > 0 ? c.scale : 1.0 / std::sqrt(double(c.D));
  const std::int64_t rep = c.Hq / c.Hk;
  for (std::int64_t b = 0; b < c.B; ++b)
    for (std::int64_t h = 0; h < c.Hq; ++h)
      for (std::int64_t t = 0; t < c.T; ++t) {
        const std::int64_t g = h / rep;
        std::vector<double> l(std::size_t(t + 1));
        for (std::int64_t s = 0; s <= t; ++s) {
          double d = 0;
          for (std::int64_t i = 0; i < c.D; ++i)
            d += in.q[std::size_t(((b * c.Hq + h) * c.T + t) * c.D + i)] * in.tau_bswa[std::size_t(h)] *
                 in.k[std::size_t(((b * c.Hk + g) * c.T + s) * c.D + i)];
          l[std::size_t(s)] = d * scale;
        }
        const double mx = *std::max_element(l.begin(), l.end());
        double z = 0;
        for (double x : l) z += std::exp(x - mx);
        for (std::int64_t s = 0; s <= t; ++s)
          for (std::int64_t d = 0; d < c.Dv; ++d)
            out[std::size_t(((b * c.T + t) * c.Hq + h) * c.Dv + d)] +=
                std::exp(l[std::size_t(s)] - mx) / z * in.v[std::size_t(((b * c.Hk + g) * c.T + s) * c.Dv + d)];
      }
  return out;
}

TEST_CASE("kvm prefill then decode equals one prefill at every split", "[kvm][unit]") {
  auto c = small_config(2, 45, 4, 2, 8, 6, Power{3.0, 0.5, 8, 1, 8000});
  c.chunk = 4;
  const auto in = random_inputs(c, 11);
  const auto ref = rkvm::prefill(c, in);
  const auto host = host_prefill<float>(c, in);
  for (std::int64_t split = 0; split <= c.T; ++split) {
    INFO("split " << split);
    KVMEM_CHECK_CLOSE(rkvm::prefill_then_decode(c, in, split), ref.out, kTolRef);
    HostResult fin;
    const auto od = host_prefill_then_decode<float>(c, in, split, &fin);
    // Same code path, same tile order: the host agrees with itself bitwise (spec 6.1 "exact").
    CHECK(od == host.out);
    CHECK(fin.state_k == host.state_k);
    CHECK(fin.state_v == host.state_v);
    // Updates that ran during decode report the same routes and |S| as the prefill's.
    const std::size_t first = host.route_merge.size() - fin.route_merge.size();
    for (std::size_t u = 0; u < fin.route_merge.size(); ++u) {
      CHECK(fin.route_merge[u] == host.route_merge[first + u]);
      CHECK(fin.route_append[u] == host.route_append[first + u]);
      CHECK(fin.slots_after_update[u] == host.slots_after_update[first + u]);
    }
  }
}

TEST_CASE("kvm T within the window equals plain causal attention with tau_bswa keys", "[kvm][unit]") {
  for (std::int64_t T : {1, 5, 9, 16}) {
    auto c = small_config(2, T, 4, 2, 16, 8, Fixed{8, 8});
    const auto in = random_inputs(c, 100 + std::uint64_t(T));
    const auto expected = plain_causal(c, in);
    INFO("T = " << T);
    KVMEM_CHECK_CLOSE(rkvm::prefill(c, in).out, expected, kTolRef);
    KVMEM_CHECK_CLOSE(host_prefill<float>(c, in).out, expected, kTolFp32);
    // The anchor of the benchmark computes the same plain attention (tau = 1 there).
    auto c1 = c;
    c1.head_temps = false;
    auto in1 = in;
    std::fill(in1.tau_bswa.begin(), in1.tau_bswa.end(), 1.0);
    std::fill(in1.tau_state.begin(), in1.tau_state.end(), 1.0);
    const auto expected1 = plain_causal(c1, in1);
    const auto q = slice_tokens(in.q, c.B * c.Hq, T, c.D, 0, T);
    const auto k = slice_tokens(in.k, c.B * c.Hk, T, c.D, 0, T);
    const auto v = slice_tokens(in.v, c.B * c.Hk, T, c.Dv, 0, T);
    std::vector<float> out(std::size_t(c.B * T * c.Hq * c.Dv));
    kvmem::host::dense_causal_attention<float>(
        kvmem::host::Executor{2}, kvmem::TensorView<const float, 4>(q.data(), {c.B, c.Hq, T, c.D}),
        kvmem::TensorView<const float, 4>(k.data(), {c.B, c.Hk, T, c.D}),
        kvmem::TensorView<const float, 4>(v.data(), {c.B, c.Hk, T, c.Dv}),
        kvmem::TensorView<float, 4>(out.data(), {c.B, T, c.Hq, c.Dv}), float(1.0 / std::sqrt(double(c.D))));
    KVMEM_CHECK_CLOSE(out, expected1, kTolFp32);
  }
}

TEST_CASE("kvm host matches the reference on random shapes, budgets and flags", "[kvm][unit]") {
  std::uint64_t seed = 1;
  for (auto c : random_cases()) {
    for (int flags = 0; flags < 4; ++flags) {
      c.gate_appends = flags & 1;
      c.merge_gate_keys = !(flags & 2);
      c.head_temps = flags != 3;
      c.gate_initial = flags == 3;
      const auto in = random_inputs(c, seed++);
      INFO("B" << c.B << " T" << c.T << " Hq" << c.Hq << " Hk" << c.Hk << " D" << c.D << " Dv" << c.Dv << " budget "
               << c.budget.name() << " flags " << flags);
      const auto ref = rkvm::prefill(c, in);
      const auto host = host_prefill<float>(c, in);
      KVMEM_CHECK_CLOSE(host.out, ref.out, kTolFp32);
      KVMEM_CHECK_CLOSE(host.state_k, ref.state_k, kTolFp32);
      KVMEM_CHECK_CLOSE(host.state_v, ref.state_v, kTolFp32);
      KVMEM_CHECK_CLOSE(host.state_rho, ref.state_rho, kTolFp32);
      CHECK(host.slots_after_update == ref.slots_after_update);
      CHECK(host.route_append == ref.route_append);
      CHECK(host.route_merge == ref.route_merge);
    }
  }
}

TEST_CASE("kvm count mode (value_radius = false) matches the reference", "[kvm][unit]") {
  // No golden exists (the authors' count update is broken, golden README); reference vs host.
  auto c = small_config(1, 64, 2, 2, 16, 16, Power{3.0, 0.5, 8, 1, 8000});
  c.value_radius = false;
  const auto in = random_inputs(c, 77);
  const auto ref = rkvm::prefill(c, in);
  const auto host = host_prefill<float>(c, in);
  KVMEM_CHECK_CLOSE(host.out, ref.out, kTolFp32);
  CHECK(host.route_merge == ref.route_merge);
}

TEST_CASE("kvm host batches of different lengths equal separate single-sequence runs", "[kvm][unit]") {
  auto c = small_config(3, 53, 4, 2, 16, 8, Power{3.0, 0.5, 8, 1, 8000});
  const auto in = random_inputs(c, 5);
  const std::int64_t lengths[3] = {53, 17, 40};
  kvmem::kvm::State<float, float> st;
  REQUIRE(kvmem::kvm::State<float, float>::create(to_params(c), to_shape(c, c.T), st).is_ok());
  const FloatWeights w(in);
  std::vector<float> out;
  REQUIRE(host_feed(st, c, in, w, 0, c.T, out, lengths).is_ok());
  for (std::int64_t b = 0; b < 3; ++b) {
    INFO("sequence " << b << " length " << lengths[b]);
    CHECK(st.tokens(b) == lengths[b]);
    // the reference on sequence b alone, truncated to its length
    auto cb = c;
    cb.B = 1;
    cb.T = lengths[b];
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
    std::vector<float> got;
    for (std::int64_t t = 0; t < cb.T; ++t)
      got.insert(got.end(), out.begin() + ((b * c.T + t) * c.Hq) * c.Dv,
                 out.begin() + ((b * c.T + t + 1) * c.Hq) * c.Dv);
    KVMEM_CHECK_CLOSE(got, ref.out, kTolFp32);
    CHECK(st.slots(b) == ref.slots);
    // rows past the length are zero
    for (std::int64_t t = cb.T; t < c.T; ++t)
      for (std::int64_t i = 0; i < c.Hq * c.Dv; ++i) CHECK(out[std::size_t((b * c.T + t) * c.Hq * c.Dv + i)] == 0.0f);
  }
}

// Decode token by token and check the state invariants after every step (spec 6.3, 6.4, 6.6, 6.7).
TEST_CASE("kvm state invariants hold after every decode step", "[kvm][unit]") {
  for (auto c : random_cases()) {
    const auto in = random_inputs(c, 999);
    kvmem::kvm::State<double, double> st;  // fp64 storage: invariants checked at 1e-10
    const auto params = to_params(c);
    REQUIRE(kvmem::kvm::State<double, double>::create(params, to_shape(c, c.T), st).is_ok());
    const auto geo = params.geometry();
    std::vector<double> q(std::size_t(c.B * c.Hq * c.D)), k(std::size_t(c.B * c.Hk * c.D)),
        v(std::size_t(c.B * c.Hk * c.Dv)), g(std::size_t(c.B * c.Hk)), out(std::size_t(c.B * c.Hq * c.Dv));
    const FloatWeights w(in);
    kvmem::kvm::RouteLog log;
    std::int64_t prev_slots = 0;
    for (std::int64_t t = 0; t < c.T; ++t) {
      for (std::int64_t r = 0; r < c.B * c.Hq; ++r)
        std::copy_n(in.q.begin() + (r * c.T + t) * c.D, c.D, q.begin() + r * c.D);
      for (std::int64_t r = 0; r < c.B * c.Hk; ++r) {
        std::copy_n(in.k.begin() + (r * c.T + t) * c.D, c.D, k.begin() + r * c.D);
        std::copy_n(in.v.begin() + (r * c.T + t) * c.Dv, c.Dv, v.begin() + r * c.Dv);
        g[std::size_t(r)] = in.gate[std::size_t(r * c.T + t)];
      }
      using kvmem::TensorView;
      REQUIRE(kvmem::kvm::decode(kvmem::host::Executor{2}, st, w.view(),
                                 TensorView<const double, 4>(q.data(), {c.B, c.Hq, 1, c.D}),
                                 TensorView<const double, 4>(k.data(), {c.B, c.Hk, 1, c.D}),
                                 TensorView<const double, 4>(v.data(), {c.B, c.Hk, 1, c.Dv}),
                                 TensorView<const double, 3>(g.data(), {c.B, c.Hk, 1}),
                                 TensorView<double, 4>(out.data(), {c.B, 1, c.Hq, c.Dv}), nullptr, &log)
                  .is_ok());
      const std::int64_t n = t + 1;
      INFO("n = " << n);
      // budget: never shrinks, within capacity and avail, follows the closed-form schedule
      const std::int64_t S = st.slots(0);
      CHECK(S >= prev_slots);
      CHECK(S <= st.capacity());
      CHECK(S <= std::max(std::min(n, c.chunk), st.covered(0)));
      CHECK(S == kvmem::kvm::slots_after(c.budget, geo, n));
      CHECK(st.covered(0) == geo.covered(n));
      prev_slots = S;
      for (std::int64_t b = 0; b < c.B; ++b) CHECK(st.slots(b) == S);  // identical across rows
      for (std::int64_t b = 0; b < c.B; ++b)
        for (std::int64_t hk = 0; hk < c.Hk; ++hk) {
          const auto it = st.item(b, hk);
          const std::int64_t row = b * c.Hk + hk;
          // sink slot: Sk_0 = k0_0 = LN_s(k_0 with r channels zeroed), Sv_0 = v_0, rho_0 = ||v_0||
          std::vector<double> k0(std::size_t(c.D));
          for (std::int64_t d = 0; d < c.D; ++d)
            k0[std::size_t(d)] = d < c.rope_dims ? 0.0 : in.k[std::size_t((row * c.T) * c.D + d)];
          double mean = 0, var = 0;
          for (double x : k0) mean += x / double(c.D);
          for (double x : k0) var += (x - mean) * (x - mean) / double(c.D);
          double vn = 0;
          for (std::int64_t d = 0; d < c.D; ++d) {
            // Weights reach the state as float (kvm::Weights), so the expected LN uses them rounded.
            const double e =
                double(float(in.ln_weight[std::size_t(d)])) * (k0[std::size_t(d)] - mean) / std::sqrt(var + c.ln_eps) +
                double(float(in.ln_bias[std::size_t(d)]));
            const double ge = c.gate_initial ? e * in.gate[std::size_t(row * c.T)] : e;
            CHECK(std::abs(it.sk[d] - ge) <= 1e-10 * std::max(1.0, std::abs(ge)));
          }
          for (std::int64_t d = 0; d < c.Dv; ++d) {
            const double v0 = in.v[std::size_t((row * c.T) * c.Dv + d)];
            vn += v0 * v0;
            CHECK(it.sv[d] == (c.gate_initial ? v0 * in.gate[std::size_t(row * c.T)] : v0));
          }
          CHECK(std::abs(it.rho[0] - std::sqrt(vn)) <= 1e-12);
          // sum identity: sum_j Sv_j = sum founders v_f + sum merged vg_i over [0, cov) (spec 6.4)
          // and the partition of [0, cov) into founders and merged tokens (spec 6.5).
          std::vector<int> role(std::size_t(st.covered(b)), 0);  // 1 founder, 2 merged
          for (std::int64_t j = 0; j < std::min(n, c.chunk); ++j) role[std::size_t(j)] = 1;
          for (const auto& rt : log.items[std::size_t(row)]) {
            for (auto a : rt.appended) role[std::size_t(a)] += 1;
            for (std::int64_t i = 0; i < c.chunk; ++i) {
              if (rt.target[std::size_t(i)] == -1) continue;
              CHECK(rt.target[std::size_t(i)] >= c.sink);  // no merge into a sink slot
              role[std::size_t(rt.first_token + i)] += 2;
            }
          }
          for (int r : role) CHECK((r == 1 || r == 2));
          for (std::int64_t d = 0; d < c.Dv; ++d) {
            double expect = 0, got = 0;
            for (std::int64_t p = 0; p < std::int64_t(role.size()); ++p) {
              const double x = in.v[std::size_t((row * c.T + p) * c.Dv + d)];
              const double gp = in.gate[std::size_t(row * c.T + p)];
              const bool founder = role[std::size_t(p)] == 1;
              const bool gated = founder ? (p < c.chunk ? c.gate_initial : c.gate_appends) : c.merge_gate_values;
              expect += gated ? gp * x : x;
            }
            for (std::int64_t j = 0; j < S; ++j) got += it.sv[j * c.Dv + d];
            CHECK(std::abs(got - expect) <= 1e-10 * std::max(1.0, std::abs(expect)));
          }
        }
    }
  }
}
}  // namespace

namespace {
TEST_CASE("kvm host results do not depend on the thread count", "[kvm][unit]") {
  auto c = small_config(3, 70, 4, 2, 16, 8, Power{3.0, 0.5, 8, 1, 8000});
  const auto in = random_inputs(c, 42);
  const auto one = host_prefill<float>(c, in, 1);
  for (int threads : {2, 3, 0}) {
    const auto many = host_prefill<float>(c, in, threads);
    CHECK(many.out == one.out);
    CHECK(many.state_k == one.state_k);
    CHECK(many.route_merge == one.route_merge);
  }
}

// spec 6.8: for a fixed pre-update state the merge targets do not depend on the gate values
// (g > 0 scales every merge logit of a token alike); only update 1 has the same pre-update state.
// spec 6.9: with both merge gates off the output does not depend on g at all.
TEST_CASE("kvm gate routing invariance and gate-free flags", "[kvm][unit]") {
  auto c = small_config(1, 64, 2, 2, 16, 16, Power{3.0, 0.5, 8, 1, 8000});
  const auto in = random_inputs(c, 9);
  auto in2 = in;
  std::mt19937_64 rng(5);
  std::uniform_real_distribution<double> u(0.1, 3.0);
  for (auto& g : in2.gate) g = u(rng);
  const auto a = rkvm::prefill(c, in), b = rkvm::prefill(c, in2);
  CHECK(a.route_merge[0] == b.route_merge[0]);
  CHECK(a.route_append[0] == b.route_append[0]);
  const auto ha = host_prefill<float>(c, in), hb = host_prefill<float>(c, in2);
  CHECK(ha.route_merge[0] == hb.route_merge[0]);
  CHECK(ha.out != hb.out);  // gates matter with the default flags
  c.merge_gate_keys = c.merge_gate_values = false;
  CHECK(host_prefill<float>(c, in).out == host_prefill<float>(c, in2).out);
  KVMEM_CHECK_CLOSE(rkvm::prefill(c, in).out, rkvm::prefill(c, in2).out, 0.0);
}
}  // namespace

namespace {
TEST_CASE("kvm host matches the reference for sink 0, window of 1 and 3 chunks, rope 0 and D", "[kvm][unit]") {
  struct Variant {
    std::int64_t sink, nb, rope, chunk;
  };
  std::uint64_t seed = 500;
  for (const Variant& var :
       {Variant{0, 2, 8, 8}, Variant{1, 1, 8, 8}, Variant{1, 3, 0, 8}, Variant{2, 2, 16, 6}, Variant{1, 1, 4, 5}}) {
    auto c = small_config(2, 67, 4, 2, 16, 8, Saturating{40.0, 1, 8000, 1});
    c.sink = var.sink;
    c.window_chunks = var.nb;
    c.rope_dims = var.rope;
    c.chunk = var.chunk;
    const auto in = random_inputs(c, seed++);
    INFO("sink " << var.sink << " nb " << var.nb << " rope " << var.rope << " chunk " << var.chunk);
    const auto ref = rkvm::prefill(c, in);
    const auto host = host_prefill<float>(c, in);
    KVMEM_CHECK_CLOSE(host.out, ref.out, kTolFp32);
    KVMEM_CHECK_CLOSE(host.state_k, ref.state_k, kTolFp32);
    CHECK(host.route_merge == ref.route_merge);
    CHECK(host.slots_after_update == ref.slots_after_update);
    KVMEM_CHECK_CLOSE(host_prefill_then_decode<float>(c, in, 23), ref.out, kTolFp32);
    KVMEM_CHECK_CLOSE(rkvm::prefill_then_decode(c, in, 23), ref.out, kTolRef);
  }
}
}  // namespace
