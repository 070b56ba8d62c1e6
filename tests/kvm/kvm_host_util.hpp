// SPDX-License-Identifier: Apache-2.0
#pragma once
// Runs the host backend on a reference-style problem (rkvm::Config + Inputs in double): float
// inputs, storage S, and the results laid out like the reference Result so tests compare directly.

#include <algorithm>
#include <cstdint>
#include <vector>

#include "kvm_test_util.hpp"
#include "kvmem/backend/host/kvm.hpp"

namespace kvmem::test {

inline kvmem::kvm::Params to_params(const rkvm::Config& c) {
  kvmem::kvm::Params p;
  p.chunk = c.chunk;
  p.window_chunks = c.window_chunks;
  p.sink = c.sink;
  p.rope_dims = c.rope_dims;
  p.budget = c.budget;
  p.merge_gate_keys = c.merge_gate_keys;
  p.merge_gate_values = c.merge_gate_values;
  p.head_temps = c.head_temps;
  p.value_radius = c.value_radius;
  p.gate_appends = c.gate_appends;
  p.gate_initial = c.gate_initial;
  p.ln_eps = c.ln_eps;
  p.scale = c.scale;
  return p;
}
inline kvmem::kvm::Shape to_shape(const rkvm::Config& c, std::int64_t n_ctx) {
  return {c.B, c.Hq, c.Hk, c.D, c.Dv, n_ctx};
}

// Tokens [t0, t1) of a [rows, T, width] tensor, as float.
inline std::vector<float> slice_tokens(const std::vector<double>& x, std::int64_t rows, std::int64_t T,
                                       std::int64_t width, std::int64_t t0, std::int64_t t1) {
  std::vector<float> y;
  y.reserve(std::size_t(rows * (t1 - t0) * width));
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t i = (r * T + t0) * width; i < (r * T + t1) * width; ++i) y.push_back(float(x[std::size_t(i)]));
  return y;
}

struct FloatWeights {
  std::vector<float> w, b, ts, tw;
  explicit FloatWeights(const rkvm::Inputs& in)
      : w(in.ln_weight.begin(), in.ln_weight.end()),
        b(in.ln_bias.begin(), in.ln_bias.end()),
        ts(in.tau_state.begin(), in.tau_state.end()),
        tw(in.tau_bswa.begin(), in.tau_bswa.end()) {}
  kvmem::kvm::Weights view() const {
    return {{w.data(), {std::int64_t(w.size())}},
            {b.data(), {std::int64_t(b.size())}},
            {ts.data(), {std::int64_t(ts.size())}},
            {tw.data(), {std::int64_t(tw.size())}}};
  }
};

// Which host path the helpers run: exact (the scalar readout, bitwise decode == prefill) unless a
// test asks for the fast tile path.
enum class HostPath { kExact, kFast };

// Feeds tokens [t0, t1) to the state; out_full [B,T,Hq,Dv] receives their rows.
template <class S>
kvmem::Status host_feed(kvmem::kvm::State<S, float>& st, const rkvm::Config& c, const rkvm::Inputs& in,
                        const FloatWeights& w, std::int64_t t0, std::int64_t t1, std::vector<float>& out_full,
                        const std::int64_t* lengths = nullptr, kvmem::kvm::RouteLog* log = nullptr, int threads = 2,
                        HostPath path = HostPath::kExact) {
  const std::int64_t n = t1 - t0;
  std::vector<float> q = in.q.empty() ? std::vector<float>(std::size_t(c.B * c.Hq * n * c.D), 0.0f)
                                      : slice_tokens(in.q, c.B * c.Hq, c.T, c.D, t0, t1);
  const auto k = slice_tokens(in.k, c.B * c.Hk, c.T, c.D, t0, t1);
  const auto v = slice_tokens(in.v, c.B * c.Hk, c.T, c.Dv, t0, t1);
  const auto g = slice_tokens(in.gate, c.B * c.Hk, c.T, 1, t0, t1);
  std::vector<float> out(std::size_t(c.B * n * c.Hq * c.Dv), -7.0f);
  using kvmem::TensorView;
  kvmem::host::Executor exec{threads};
  exec.exact = path == HostPath::kExact;
  const kvmem::Status s = kvmem::kvm::prefill(
      exec, st, w.view(), TensorView<const float, 4>(q.data(), {c.B, c.Hq, n, c.D}),
      TensorView<const float, 4>(k.data(), {c.B, c.Hk, n, c.D}),
      TensorView<const float, 4>(v.data(), {c.B, c.Hk, n, c.Dv}), TensorView<const float, 3>(g.data(), {c.B, c.Hk, n}),
      TensorView<float, 4>(out.data(), {c.B, n, c.Hq, c.Dv}), lengths, log);
  if (!s.is_ok()) return s;
  out_full.resize(std::size_t(c.B * c.T * c.Hq * c.Dv), 0.0f);
  for (std::int64_t b = 0; b < c.B; ++b)
    for (std::int64_t t = 0; t < n; ++t)
      for (std::int64_t i = 0; i < c.Hq * c.Dv; ++i)
        out_full[std::size_t(((b * c.T + t0 + t) * c.Hq) * c.Dv + i)] = out[std::size_t((b * n + t) * c.Hq * c.Dv + i)];
  return s;
}

struct HostResult {
  std::vector<float> out;                           // [B,T,Hq,Dv]
  std::vector<double> state_k, state_v, state_rho;  // [B,Hk,S,*]
  std::int64_t slots = 0;
  std::vector<std::int64_t> slots_after_update;
  std::vector<std::vector<std::int64_t>> route_append, route_merge;  // per update, [B,Hk,*]
  double merge_margin = 1e300, append_margin = 1e300;                // minima over updates, rows and heads
};

template <class S>
void extract_state(const kvmem::kvm::State<S, float>& st, const rkvm::Config& c, HostResult& r) {
  r.slots = st.slots(0);
  r.state_k.clear();
  r.state_v.clear();
  r.state_rho.clear();
  for (std::int64_t b = 0; b < c.B; ++b)
    for (std::int64_t g = 0; g < c.Hk; ++g) {
      const auto it = st.item(b, g);
      r.state_k.insert(r.state_k.end(), it.sk, it.sk + r.slots * c.D);
      r.state_v.insert(r.state_v.end(), it.sv, it.sv + r.slots * c.Dv);
      r.state_rho.insert(r.state_rho.end(), it.rho, it.rho + r.slots);
    }
}

// The slot states of a device state (a backend state with download(b, g, sk, sv, rho, stream), e.g. the
// CUDA KvmState), read back into r as extract_state reads a host state.
template <class DeviceState>
void extract_device_state(const DeviceState& st, const rkvm::Config& c, HostResult& r) {
  r.slots = st.slots();
  r.state_k.clear();
  r.state_v.clear();
  r.state_rho.clear();
  for (std::int64_t b = 0; b < c.B; ++b)
    for (std::int64_t g = 0; g < c.Hk; ++g) {
      std::vector<float> sk, sv, rho;
      REQUIRE(st.download(b, g, sk, sv, rho, nullptr).is_ok());
      r.state_k.insert(r.state_k.end(), sk.begin(), sk.end());
      r.state_v.insert(r.state_v.end(), sv.begin(), sv.end());
      r.state_rho.insert(r.state_rho.end(), rho.begin(), rho.end());
    }
}

// A call's outputs o [B, n, Hq, Dv] for tokens [t0, t0 + n) into out_full [B, T, Hq, Dv] (sized, zeroed,
// on first use).
template <class T>
void place_outputs(const std::vector<T>& o, const rkvm::Config& c, std::int64_t t0, std::int64_t n,
                   std::vector<float>& out_full) {
  out_full.resize(std::size_t(c.B * c.T * c.Hq * c.Dv), 0.0f);
  for (std::int64_t b = 0; b < c.B; ++b)
    for (std::int64_t t = 0; t < n; ++t)
      for (std::int64_t i = 0; i < c.Hq * c.Dv; ++i)
        out_full[std::size_t(((b * c.T + t0 + t) * c.Hq) * c.Dv + i)] =
            kvmem::load_as<float>(o[std::size_t((b * n + t) * c.Hq * c.Dv + i)]);
}

inline void extract_routes(const kvmem::kvm::RouteLog& log, const rkvm::Config& c, HostResult& r) {
  const std::size_t U = log.items.empty() ? 0 : log.items[0].size();
  r.route_append.assign(U, {});
  r.route_merge.assign(U, {});
  r.slots_after_update.assign(U, 0);
  for (std::size_t u = 0; u < U; ++u)
    for (std::int64_t i = 0; i < c.B * c.Hk; ++i) {
      const auto& rt = log.items[std::size_t(i)].at(u);
      r.route_append[u].insert(r.route_append[u].end(), rt.appended.begin(), rt.appended.end());
      r.route_merge[u].insert(r.route_merge[u].end(), rt.target.begin(), rt.target.end());
      r.slots_after_update[u] = rt.slots_after;
      r.merge_margin = std::min(r.merge_margin, rt.merge_margin);
      r.append_margin = std::min(r.append_margin, rt.append_margin);
    }
}

template <class S>
HostResult host_prefill(const rkvm::Config& c, const rkvm::Inputs& in, int threads = 2,
                        HostPath path = HostPath::kExact) {
  kvmem::kvm::State<S, float> st;
  REQUIRE(kvmem::kvm::State<S, float>::create(to_params(c), to_shape(c, c.T), st).is_ok());
  const FloatWeights w(in);
  HostResult r;
  kvmem::kvm::RouteLog log;
  const auto status = host_feed(st, c, in, w, 0, c.T, r.out, nullptr, &log, threads, path);
  INFO(status.to_string());
  REQUIRE(status.is_ok());
  extract_state(st, c, r);
  extract_routes(log, c, r);
  return r;
}

// Prefill [0, split), then one decode call per later token.
template <class S>
std::vector<float> host_prefill_then_decode(const rkvm::Config& c, const rkvm::Inputs& in, std::int64_t split,
                                            HostResult* final_state = nullptr, HostPath path = HostPath::kExact) {
  kvmem::kvm::State<S, float> st;
  REQUIRE(kvmem::kvm::State<S, float>::create(to_params(c), to_shape(c, c.T), st).is_ok());
  const FloatWeights w(in);
  std::vector<float> out;
  kvmem::kvm::RouteLog log;
  if (split > 0) REQUIRE(host_feed(st, c, in, w, 0, split, out, nullptr, &log, 2, path).is_ok());
  for (std::int64_t t = split; t < c.T; ++t)
    REQUIRE(host_feed(st, c, in, w, t, t + 1, out, nullptr, &log, 2, path).is_ok());
  if (final_state != nullptr) {
    extract_state(st, c, *final_state);
    extract_routes(log, c, *final_state);
  }
  return out;
}

}  // namespace kvmem::test
