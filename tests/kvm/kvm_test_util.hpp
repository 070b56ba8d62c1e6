// SPDX-License-Identifier: Apache-2.0
#pragma once
// Shared helpers of the KVM tests: golden config -> reference Config, golden tensors -> Inputs,
// random problems for the property tests.

#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "kvmem/reference/kvm.hpp"
#include "support/golden.hpp"

namespace kvmem::test {

namespace rkvm = kvmem::reference::kvm;

inline kvmem::budget::Any budget_from_json(const nlohmann::json& b) {
  const std::string kind = b.at("kind").get<std::string>();
  const auto minimum = b.at("min").get<std::int64_t>();
  const auto maximum = b.at("max_slots").get<std::int64_t>();
  if (kind == "fixed") return kvmem::budget::Fixed{minimum, maximum};
  if (kind == "power")
    return kvmem::budget::Power{b.at("factor").get<double>(), b.at("exponent").get<double>(), minimum, 1, maximum};
  REQUIRE(kind == "saturating");
  return kvmem::budget::Saturating{b.at("saturation").get<double>(), minimum, maximum, 1};
}

inline rkvm::Config config_from_golden(const Golden& g) {
  const auto& j = g.config;
  rkvm::Config c;
  c.B = j.at("B");
  c.T = j.at("T");
  c.Hq = j.at("Hq");
  c.Hk = j.at("Hk");
  c.D = j.at("D");
  c.Dv = j.at("Dv");
  c.chunk = j.at("chunk");
  c.window_chunks = j.at("window_chunks");
  c.sink = j.at("sink");
  c.rope_dims = j.at("rope_dims");
  c.budget = budget_from_json(j.at("budget"));
  c.merge_gate_keys = j.at("merge_gate_keys");
  c.merge_gate_values = j.at("merge_gate_values");
  c.head_temps = j.at("head_temps");
  c.value_radius = j.at("value_radius");
  c.gate_appends = j.at("gate_appends");
  c.gate_initial = j.at("gate_initial_state");
  c.ln_eps = j.at("ln_eps");
  c.scale = j.at("scale");
  return c;
}

inline rkvm::Inputs inputs_from_golden(const Golden& g) {
  rkvm::Inputs in;
  if (g.has("q")) in.q = g.f64("q");
  in.k = g.f64("k");
  in.v = g.f64("v");
  in.gate = g.f64("gate");
  in.ln_weight = g.f64("ln_weight");
  in.ln_bias = g.f64("ln_bias");
  in.tau_state = g.f64("tau_state");
  in.tau_bswa = g.f64("tau_bswa");
  return in;
}

// What every backend's golden test checks of a prefill's state: the slot count; the slots' K, V and
// rho (golden rule: max |x - ref| <= tol max(1, max |ref|)); |S| after the updates and both routes of
// every update, exactly. Result: any type with HostResult's fields (slots, state_k, state_v, state_rho,
// slots_after_update, route_append, route_merge).
template <class Result>
void check_state_and_routes(const Golden& g, const Result& r, double tol) {
  CHECK(r.slots == g.shape("state_k")[2]);
  KVMEM_CHECK_CLOSE(r.state_k, g.f64("state_k"), tol);
  KVMEM_CHECK_CLOSE(r.state_v, g.f64("state_v"), tol);
  KVMEM_CHECK_CLOSE(r.state_rho, g.f64("state_rho"), tol);
  const auto updates = g.config.at("updates").get<std::size_t>();
  REQUIRE(r.route_append.size() == updates);
  REQUIRE(r.route_merge.size() == updates);
  if (updates > 0) CHECK(r.slots_after_update == g.i64("slots_after_update"));
  for (std::size_t u = 1; u <= updates; ++u) {
    INFO(g.name << " update " << u);
    CHECK(r.route_append[u - 1] == g.i64("route_append_u" + std::to_string(u)));
    CHECK(r.route_merge[u - 1] == g.i64("route_merge_u" + std::to_string(u)));
  }
}

// Random problem: q, k, v ~ N(0,1) (keys scaled so that routing margins are comfortable),
// gate = 1 + elu(N(0,1)) > 0, LN affine ~ N(1,0.2)/N(0,0.2), tau ~ U(0.5,1.5) (the golden recipe).
inline rkvm::Inputs random_inputs(const rkvm::Config& c, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> n01(0.0, 1.0);
  std::uniform_real_distribution<double> u(0.5, 1.5);
  rkvm::Inputs in;
  const auto fill = [&](std::vector<double>& x, std::int64_t n, double mean, double sd) {
    x.resize(std::size_t(n));
    for (auto& e : x) e = mean + sd * n01(rng);
  };
  fill(in.q, c.B * c.Hq * c.T * c.D, 0, 1);
  fill(in.k, c.B * c.Hk * c.T * c.D, 0, 1);
  fill(in.v, c.B * c.Hk * c.T * c.Dv, 0, 1);
  fill(in.gate, c.B * c.Hk * c.T, 0, 1);
  for (auto& g : in.gate) g = g > 0 ? 1 + g : std::exp(g);  // 1 + elu(x)
  fill(in.ln_weight, c.D, 1, 0.2);
  fill(in.ln_bias, c.D, 0, 0.2);
  in.tau_state.resize(std::size_t(c.Hq));
  in.tau_bswa.resize(std::size_t(c.Hq));
  for (auto& t : in.tau_state) t = c.head_temps ? u(rng) : 1.0;
  for (auto& t : in.tau_bswa) t = c.head_temps ? u(rng) : 1.0;
  return in;
}

inline rkvm::Config small_config(std::int64_t B, std::int64_t T, std::int64_t Hq, std::int64_t Hk, std::int64_t D,
                                 std::int64_t Dv, kvmem::budget::Any budget) {
  rkvm::Config c;
  c.B = B;
  c.T = T;
  c.Hq = Hq;
  c.Hk = Hk;
  c.D = D;
  c.Dv = Dv;
  c.chunk = 8;
  c.window_chunks = 2;
  c.sink = 1;
  c.rope_dims = D / 2;
  c.budget = budget;
  return c;
}

}  // namespace kvmem::test
