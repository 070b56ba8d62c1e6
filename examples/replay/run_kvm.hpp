// SPDX-License-Identifier: Apache-2.0
#pragma once
// kvmem-replay adapter for KV Means (spec KVM.md; tensor names of tests/data/golden/README.md).
// It reads the configuration into Spec, checks every input's shape against it, and runs one backend:
//   prefill            -> out, state_k, state_v, state_rho, slots_after_update, route_append_u{u},
//                         route_merge_u{u}
//   decode_split (cfg) -> out_decode (prefill of [0, split), then one decode step per token)
// A state-only case (no q) runs prefill on zero queries: the state and the routes do not read q
// (spec KVM.md 4.5), and out / out_decode are not written because they would be meaningless.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "replay_core.hpp"
#include "trace.hpp"
#include "transport.hpp"

#include "kvmem/core/numeric.hpp"
#include "kvmem/core/tensor.hpp"
#include "kvmem/policy/budget.hpp"

// The adapters this file is built with: examples/replay/CMakeLists.txt sets each flag to 0 or 1; a file
// that includes this one without them (a test) gets none of them, as `#if` would read them.
#ifndef KVMEM_REPLAY_WITH_REFERENCE_KVM
#define KVMEM_REPLAY_WITH_REFERENCE_KVM 0
#endif
#ifndef KVMEM_REPLAY_WITH_HOST_KVM
#define KVMEM_REPLAY_WITH_HOST_KVM 0
#endif
#ifndef KVMEM_REPLAY_WITH_KOKKOS_KVM
#define KVMEM_REPLAY_WITH_KOKKOS_KVM 0
#endif
#ifndef KVMEM_REPLAY_WITH_KOKKOS_SLOTS_KVM
#define KVMEM_REPLAY_WITH_KOKKOS_SLOTS_KVM 0
#endif
#ifndef KVMEM_REPLAY_WITH_CUDA_KVM
#define KVMEM_REPLAY_WITH_CUDA_KVM 0
#endif
#if KVMEM_REPLAY_WITH_CUDA_KVM && !KVMEM_REPLAY_WITH_HOST_KVM
#error "the CUDA KVM adapter reuses the host adapter's parameter mapping: build it with KVMEM_REPLAY_WITH_HOST_KVM"
#endif

#if KVMEM_REPLAY_WITH_REFERENCE_KVM
#include "kvmem/reference/kvm.hpp"
#endif
#if KVMEM_REPLAY_WITH_HOST_KVM || KVMEM_REPLAY_WITH_KOKKOS_KVM
#include "kvmem/backend/host/kvm.hpp"
#endif
#if KVMEM_REPLAY_WITH_KOKKOS_KVM
#include <Kokkos_Core.hpp>

#include "kvmem/backend/kokkos.hpp"
#include "transport_kokkos.hpp"
#endif
#if KVMEM_REPLAY_WITH_CUDA_KVM
#include "kvmem/backend/cuda/kvm.cuh"
#include "transport_cuda.hpp"
#endif

namespace kvmem::replay::kvm_adapter {

struct Spec {
  std::int64_t B = 0, T = 0, Hq = 0, Hk = 0, D = 0, Dv = 0;
  std::int64_t chunk = 256, window_chunks = 2, sink = 1, rope_dims = 64;
  budget::Any budget;
  bool merge_gate_keys = true, merge_gate_values = true, head_temps = true, value_radius = true, gate_appends = false,
       gate_initial = false;
  double ln_eps = 1e-5;
  double scale = 0.0;              // 0: 1/sqrt(D)
  std::int64_t decode_split = -1;  // -1: no decode run
  // The authors' eager bf16 rounding of the value readout (golden README): off, as in the goldens.
  bool round_value_readout_bf16 = false;
};

inline budget::Any parse_budget(const ConfigReader& cfg) {
  const Json* b = cfg.find("budget");
  if (b == nullptr) throw BadInput("config: missing key 'budget'");
  if (!b->is_object()) throw BadInput("config: 'budget' must be an object, got " + b->dump());
  const ConfigReader r(*b, "config.budget");
  const std::string kind = r.string_or("kind", "");
  const std::int64_t maximum = r.integer_or("max_slots", budget::kPaperMaxSlots, 1, kMaxExtent);
  budget::Any any;
  if (kind == "fixed") {
    // The goldens give a fixed budget as `min` (raw target 0, floored at min: README "Target").
    const std::int64_t count = r.has("count") ? r.integer("count", 0, kMaxExtent) : r.integer("min", 0, kMaxExtent);
    any = budget::Fixed{count, maximum};
  } else if (kind == "power") {
    any = budget::Power{r.real_or("factor", 16.0, 0.0, 1e300), r.real_or("exponent", 0.5, 0.0, 1e300),
                        r.integer_or("min", 256, 0, kMaxExtent), r.integer_or("round_down", 1, 1, kMaxExtent), maximum};
  } else if (kind == "saturating") {
    if (!r.has("saturation")) throw BadInput("config.budget: kind 'saturating' needs 'saturation'");
    any = budget::Saturating{r.real_or("saturation", 1024.0, 0.0, 1e300), r.integer_or("min", 1, 0, kMaxExtent),
                             maximum, r.integer_or("round_down", 1, 1, kMaxExtent)};
  } else {
    throw BadInput("config.budget: 'kind' must be fixed, power or saturating, got '" + kind + "'");
  }
  const Status status = any.validate();
  if (!status.is_ok()) throw BadInput("config.budget: " + status.message());
  return any;
}

inline Spec parse_config(const Json& config) {
  const ConfigReader cfg(config);
  Spec s;
  s.B = cfg.integer("B", 1, kMaxExtent);
  s.T = cfg.integer("T", 1, kMaxExtent);
  s.Hq = cfg.integer("Hq", 1, kMaxExtent);
  s.Hk = cfg.integer("Hk", 1, kMaxExtent);
  s.D = cfg.integer("D", 1, kMaxExtent);
  s.Dv = cfg.integer("Dv", 1, kMaxExtent);
  if (s.Hq % s.Hk != 0)
    throw BadInput("config: 'Hq' (" + std::to_string(s.Hq) + ") must be a multiple of 'Hk' (" + std::to_string(s.Hk) +
                   ")");
  s.chunk = cfg.integer_or("chunk", s.chunk, 1, kMaxExtent);
  s.window_chunks = cfg.integer_or("window_chunks", s.window_chunks, 1, kMaxExtent);
  s.sink = cfg.integer_or("sink", s.sink, 0, s.chunk - 1);  // a merge needs a non-sink slot (spec 3)
  s.rope_dims = cfg.integer_or("rope_dims", std::min<std::int64_t>(s.rope_dims, s.D), 0, s.D);
  s.budget = parse_budget(cfg);
  s.merge_gate_keys = cfg.boolean_or("merge_gate_keys", s.merge_gate_keys);
  s.merge_gate_values = cfg.boolean_or("merge_gate_values", s.merge_gate_values);
  s.head_temps = cfg.boolean_or("head_temps", s.head_temps);
  s.value_radius = cfg.boolean_or("value_radius", s.value_radius);
  s.gate_appends = cfg.boolean_or("gate_appends", s.gate_appends);
  s.gate_initial = cfg.boolean_or("gate_initial_state", s.gate_initial);
  s.ln_eps = cfg.real_or("ln_eps", s.ln_eps, 1e-300, 1.0);
  s.scale = cfg.real_or("scale", s.scale, 0.0, 1e300);
  s.decode_split = cfg.integer_or("decode_split", -1, -1, s.T);
  s.round_value_readout_bf16 = cfg.boolean_or("round_value_readout_bf16", false);
  return s;
}

struct Inputs {
  bool has_q = false;
  std::vector<double> q, k, v, gate, ln_weight, ln_bias, tau_state, tau_bswa;
  std::vector<double> dout;  // [B,T,Hq,Dv] upstream gradient; empty when the case has none
};

inline Inputs load_inputs(const Case& c, const Spec& s) {
  const std::string bht = "B=" + std::to_string(s.B) + ", Hk=" + std::to_string(s.Hk) + ", T=" + std::to_string(s.T);
  Inputs in;
  in.has_q = c.file.has("q");
  if (in.has_q)
    in.q = input_f64(c, "q", {s.B, s.Hq, s.T, s.D},
                     "B=" + std::to_string(s.B) + ", Hq=" + std::to_string(s.Hq) + ", T=" + std::to_string(s.T) +
                         ", D=" + std::to_string(s.D));
  else
    in.q.assign(static_cast<std::size_t>(s.B * s.Hq * s.T * s.D), 0.0);
  in.k = input_f64(c, "k", {s.B, s.Hk, s.T, s.D}, bht + ", D=" + std::to_string(s.D));
  in.v = input_f64(c, "v", {s.B, s.Hk, s.T, s.Dv}, bht + ", Dv=" + std::to_string(s.Dv));
  in.gate = input_f64(c, "gate", {s.B, s.Hk, s.T}, bht);
  in.ln_weight = input_f64(c, "ln_weight", {s.D}, "D=" + std::to_string(s.D));
  in.ln_bias = input_f64(c, "ln_bias", {s.D}, "D=" + std::to_string(s.D));
  in.tau_state = input_f64(c, "tau_state", {s.Hq}, "Hq=" + std::to_string(s.Hq));
  in.tau_bswa = input_f64(c, "tau_bswa", {s.Hq}, "Hq=" + std::to_string(s.Hq));
  if (in.has_q && c.file.has("dout"))
    in.dout = input_f64(c, "dout", {s.B, s.T, s.Hq, s.Dv},
                        "B=" + std::to_string(s.B) + ", T=" + std::to_string(s.T) + ", Hq=" + std::to_string(s.Hq) +
                            ", Dv=" + std::to_string(s.Dv));
  return in;
}

// What one prefill (+ decode) produced, backend-neutral.
struct Results {
  std::vector<double> out, out_decode, state_k, state_v, state_rho;
  std::int64_t slots = 0;
  std::vector<std::int64_t> slots_after_update;
  std::vector<std::vector<std::int64_t>> route_append, route_merge;  // per update, [B,Hk,n_u] / [B,Hk,C]
  bool has_decode = false;
  // Gradients of sum(out * dout) (spec 5), when the backend implements backward and dout is given.
  bool has_grads = false;
  std::vector<double> d_q, d_k, d_v, d_gate, d_ln_weight, d_ln_bias, d_tau_state, d_tau_bswa;
};

// Turns Results into named output tensors, checking every size against the configuration so a
// backend bug cannot produce a file whose shapes lie.
inline void emit(const Spec& s, const Inputs& in, Results r, Outputs& outputs) {
  if (in.has_q) outputs.add("out", {s.B, s.T, s.Hq, s.Dv}, std::move(r.out));
  if (r.has_decode) outputs.add("out_decode", {s.B, s.T, s.Hq, s.Dv}, std::move(r.out_decode));
  outputs.add("state_k", {s.B, s.Hk, r.slots, s.D}, std::move(r.state_k));
  outputs.add("state_v", {s.B, s.Hk, r.slots, s.Dv}, std::move(r.state_v));
  outputs.add("state_rho", {s.B, s.Hk, r.slots}, std::move(r.state_rho));
  const auto updates = static_cast<std::int64_t>(r.slots_after_update.size());
  outputs.add("slots_after_update", {updates}, std::move(r.slots_after_update));
  const std::int64_t rows = s.B * s.Hk;
  for (std::size_t u = 0; u < r.route_append.size(); ++u) {
    const auto n = static_cast<std::int64_t>(r.route_append[u].size());
    if (n % rows != 0)
      throw std::logic_error("internal: route_append_u" + std::to_string(u + 1) + " has " + std::to_string(n) +
                             " entries, not a multiple of B*Hk");
    outputs.add("route_append_u" + std::to_string(u + 1), {s.B, s.Hk, n / rows}, std::move(r.route_append[u]));
  }
  for (std::size_t u = 0; u < r.route_merge.size(); ++u)
    outputs.add("route_merge_u" + std::to_string(u + 1), {s.B, s.Hk, s.chunk}, std::move(r.route_merge[u]));
  if (r.has_grads) {
    outputs.add("d_q", {s.B, s.Hq, s.T, s.D}, std::move(r.d_q));
    outputs.add("d_k", {s.B, s.Hk, s.T, s.D}, std::move(r.d_k));
    outputs.add("d_v", {s.B, s.Hk, s.T, s.Dv}, std::move(r.d_v));
    outputs.add("d_gate", {s.B, s.Hk, s.T}, std::move(r.d_gate));
    outputs.add("d_ln_weight", {s.D}, std::move(r.d_ln_weight));
    outputs.add("d_ln_bias", {s.D}, std::move(r.d_ln_bias));
    outputs.add("d_tau_state", {s.Hq}, std::move(r.d_tau_state));
    outputs.add("d_tau_bswa", {s.Hq}, std::move(r.d_tau_bswa));
  }
}

// ---- backends ------------------------------------------------------------------------------------

#if KVMEM_REPLAY_WITH_REFERENCE_KVM
inline Results run_reference(const Spec& s, const Inputs& in, Progress& progress) {
  namespace ref = kvmem::reference::kvm;
  ref::Config cfg;
  cfg.B = s.B;
  cfg.T = s.T;
  cfg.Hq = s.Hq;
  cfg.Hk = s.Hk;
  cfg.D = s.D;
  cfg.Dv = s.Dv;
  cfg.chunk = s.chunk;
  cfg.window_chunks = s.window_chunks;
  cfg.sink = s.sink;
  cfg.rope_dims = s.rope_dims;
  cfg.budget = s.budget;
  cfg.merge_gate_keys = s.merge_gate_keys;
  cfg.merge_gate_values = s.merge_gate_values;
  cfg.head_temps = s.head_temps;
  cfg.value_radius = s.value_radius;
  cfg.gate_appends = s.gate_appends;
  cfg.gate_initial = s.gate_initial;
  cfg.ln_eps = s.ln_eps;
  cfg.scale = s.scale;
  cfg.round_value_readout_bf16 = s.round_value_readout_bf16;
  ref::Inputs inputs;
  inputs.q = in.q;
  inputs.k = in.k;
  inputs.v = in.v;
  inputs.gate = in.gate;
  inputs.ln_weight = in.ln_weight;
  inputs.ln_bias = in.ln_bias;
  inputs.tau_state = in.tau_state;
  inputs.tau_bswa = in.tau_bswa;
  const Status status = ref::validate(cfg, inputs);
  if (!status.is_ok()) throw BadInput("reference kvm rejects the case: " + status.message());

  Results r;
  ref::Result res = progress.phase("prefill", s.T, [&] { return ref::prefill(cfg, inputs); });
  r.out = std::move(res.out);
  r.state_k = std::move(res.state_k);
  r.state_v = std::move(res.state_v);
  r.state_rho = std::move(res.state_rho);
  r.slots = res.slots;
  r.slots_after_update = std::move(res.slots_after_update);
  r.route_append = std::move(res.route_append);
  r.route_merge = std::move(res.route_merge);
  if (in.has_q && s.decode_split >= 0) {
    r.out_decode = progress.phase("prefill " + std::to_string(s.decode_split) + " + decode", s.T,
                                  [&] { return ref::prefill_then_decode(cfg, inputs, s.decode_split); });
    r.has_decode = true;
  }
  if (!in.dout.empty()) {  // spec 5: routing constant, everything else by the chain rule
    ref::Grads g = progress.phase("backward", s.T, [&] { return ref::backward(cfg, inputs, in.dout); });
    r.d_q = std::move(g.dq);
    r.d_k = std::move(g.dk);
    r.d_v = std::move(g.dv);
    r.d_gate = std::move(g.dgate);
    r.d_ln_weight = std::move(g.d_ln_weight);
    r.d_ln_bias = std::move(g.d_ln_bias);
    r.d_tau_state = std::move(g.d_tau_state);
    r.d_tau_bswa = std::move(g.d_tau_bswa);
    r.has_grads = true;
  }
  return r;
}
#endif

#if KVMEM_REPLAY_WITH_HOST_KVM || KVMEM_REPLAY_WITH_KOKKOS_KVM
namespace host_detail {

inline std::vector<float> to_float(const std::vector<double>& x) {
  return {x.begin(), x.end()};
}

// Tokens [t0, t1) of a [rows, T, width] float tensor, contiguous (what a call takes).
inline std::vector<float> tokens(const std::vector<float>& x, std::int64_t rows, std::int64_t T, std::int64_t width,
                                 std::int64_t t0, std::int64_t t1) {
  std::vector<float> y;
  y.reserve(static_cast<std::size_t>(rows * (t1 - t0) * width));
  for (std::int64_t r = 0; r < rows; ++r)
    y.insert(y.end(), x.begin() + (r * T + t0) * width, x.begin() + (r * T + t1) * width);
  return y;
}

struct FloatInputs {
  std::vector<float> q, k, v, gate, ln_w, ln_b, tau_s, tau_w;
  explicit FloatInputs(const Inputs& in)
      : q(to_float(in.q)),
        k(to_float(in.k)),
        v(to_float(in.v)),
        gate(to_float(in.gate)),
        ln_w(to_float(in.ln_weight)),
        ln_b(to_float(in.ln_bias)),
        tau_s(to_float(in.tau_state)),
        tau_w(to_float(in.tau_bswa)) {}
  [[nodiscard]] kvm::Weights weights() const {
    return {{ln_w.data(), {std::int64_t(ln_w.size())}},
            {ln_b.data(), {std::int64_t(ln_b.size())}},
            {tau_s.data(), {std::int64_t(tau_s.size())}},
            {tau_w.data(), {std::int64_t(tau_w.size())}}};
  }
};

// Feeds tokens [t0, t1) of every sequence through one prefill call (a decode step when t1 = t0 + 1:
// the host backend runs both with the same driver) and scatters the rows into out [B,T,Hq,Dv].
template <class S>
void feed(const host::Executor& exec, kvm::State<S, float>& st, const Spec& s, const FloatInputs& f, std::int64_t t0,
          std::int64_t t1, std::vector<double>& out, kvm::RouteLog* log) {
  const std::int64_t n = t1 - t0;
  const auto q = tokens(f.q, s.B * s.Hq, s.T, s.D, t0, t1);
  const auto k = tokens(f.k, s.B * s.Hk, s.T, s.D, t0, t1);
  const auto v = tokens(f.v, s.B * s.Hk, s.T, s.Dv, t0, t1);
  const auto g = tokens(f.gate, s.B * s.Hk, s.T, 1, t0, t1);
  std::vector<float> o(static_cast<std::size_t>(s.B * n * s.Hq * s.Dv), 0.0f);
  const Status status = kvm::prefill(exec, st, f.weights(), TensorView<const float, 4>(q.data(), {s.B, s.Hq, n, s.D}),
                                     TensorView<const float, 4>(k.data(), {s.B, s.Hk, n, s.D}),
                                     TensorView<const float, 4>(v.data(), {s.B, s.Hk, n, s.Dv}),
                                     TensorView<const float, 3>(g.data(), {s.B, s.Hk, n}),
                                     TensorView<float, 4>(o.data(), {s.B, n, s.Hq, s.Dv}), nullptr, log);
  if (!status.is_ok()) throw BadInput("host kvm rejects the case: " + status.message());
  const std::int64_t row = s.Hq * s.Dv;
  for (std::int64_t b = 0; b < s.B; ++b)
    std::copy(o.begin() + b * n * row, o.begin() + (b + 1) * n * row, out.begin() + (b * s.T + t0) * row);
}

inline kvm::Params params_of(const Spec& s) {
  kvm::Params p;
  p.chunk = s.chunk;
  p.window_chunks = s.window_chunks;
  p.sink = s.sink;
  p.rope_dims = s.rope_dims;
  p.budget = s.budget;
  p.merge_gate_keys = s.merge_gate_keys;
  p.merge_gate_values = s.merge_gate_values;
  p.head_temps = s.head_temps;
  p.value_radius = s.value_radius;
  p.gate_appends = s.gate_appends;
  p.gate_initial = s.gate_initial;
  p.ln_eps = s.ln_eps;
  p.scale = s.scale;
  return p;
}

template <class S>
kvm::State<S, float> make_state(const Spec& s) {
  kvm::State<S, float> st;
  const Status status = kvm::State<S, float>::create(params_of(s), kvm::Shape{s.B, s.Hq, s.Hk, s.D, s.Dv, s.T}, st);
  if (!status.is_ok()) throw BadInput("host kvm rejects the configuration: " + status.message());
  return st;
}

// The route log of a prefill in the goldens' layout: per update, the routes concatenated over the
// (b, kv head) items, and |S| after it.
inline void collect_routes(const kvm::RouteLog& log, Results& r) {
  const std::size_t U = log.items.empty() ? 0 : log.items[0].size();
  r.route_append.assign(U, {});
  r.route_merge.assign(U, {});
  r.slots_after_update.assign(U, 0);
  for (std::size_t u = 0; u < U; ++u)
    for (const auto& item : log.items) {
      if (item.size() != U) throw std::logic_error("internal: the backend logged different update counts per item");
      r.route_append[u].insert(r.route_append[u].end(), item[u].appended.begin(), item[u].appended.end());
      r.route_merge[u].insert(r.route_merge[u].end(), item[u].target.begin(), item[u].target.end());
      r.slots_after_update[u] = item[u].slots_after;
    }
}

// The final state and the route log of a prefill, in the goldens' layout: state [B,Hk,S,*], routes
// per update concatenated over the (b, kv head) items.
template <class S>
void collect(const kvm::State<S, float>& st, const Spec& s, const kvm::RouteLog& log, Results& r) {
  r.slots = st.slots(0);
  for (std::int64_t b = 0; b < s.B; ++b)
    for (std::int64_t g = 0; g < s.Hk; ++g) {
      const auto it = st.item(b, g);
      r.state_k.insert(r.state_k.end(), it.sk, it.sk + r.slots * s.D);
      r.state_v.insert(r.state_v.end(), it.sv, it.sv + r.slots * s.Dv);
      r.state_rho.insert(r.state_rho.end(), it.rho, it.rho + r.slots);
    }
  collect_routes(log, r);
}

template <class S>
Results run(const Spec& s, const Inputs& in, const Options& opt, Progress& progress) {
  const host::Executor exec{opt.threads};
  const FloatInputs f(in);
  Results r;
  r.out.assign(static_cast<std::size_t>(s.B * s.T * s.Hq * s.Dv), 0.0);
  {
    auto st = make_state<S>(s);
    kvm::RouteLog log;
    progress.phase("prefill", s.T, [&] { feed(exec, st, s, f, 0, s.T, r.out, &log); });
    collect(st, s, log, r);
  }
  if (in.has_q && s.decode_split >= 0) {
    auto st = make_state<S>(s);
    r.out_decode.assign(r.out.size(), 0.0);
    progress.phase("prefill " + std::to_string(s.decode_split) + " + decode", s.T, [&] {
      if (s.decode_split > 0) feed(exec, st, s, f, 0, s.decode_split, r.out_decode, nullptr);
      progress.advance(s.decode_split);
      for (std::int64_t t = s.decode_split; t < s.T; ++t) {
        feed(exec, st, s, f, t, t + 1, r.out_decode, nullptr);
        progress.advance(1);
      }
    });
    r.has_decode = true;
  }
  return r;
}

}  // namespace host_detail
#endif

#if KVMEM_REPLAY_WITH_HOST_KVM
// fp32 or bf16 storage (window keys/values and readout copies); sums and math in fp32.
inline Results run_host(const Spec& s, const Inputs& in, const Options& opt, Progress& progress) {
  if (s.round_value_readout_bf16)
    throw BadInput("config: 'round_value_readout_bf16' is only implemented by the reference backend");
  if (opt.precision == Precision::kBf16) return host_detail::run<bf16>(s, in, opt, progress);
  return host_detail::run<float>(s, in, opt, progress);
}
#endif

#if KVMEM_REPLAY_WITH_KOKKOS_KVM
namespace kokkos_detail {

using Space = Kokkos::DefaultExecutionSpace;
using MemSpace = Space::memory_space;
using Exec = kokkos::Executor<Space>;

// A host vector copied into the execution space's memory (the device on a GPU build).
inline Kokkos::View<float*, MemSpace> to_device(const std::vector<float>& x) {
  Kokkos::View<float*, MemSpace> view(Kokkos::view_alloc(Kokkos::WithoutInitializing, "kvmem-replay input"), x.size());
  Kokkos::View<const float*, Kokkos::HostSpace, Kokkos::MemoryTraits<Kokkos::Unmanaged>> host(x.data(), x.size());
  Kokkos::deep_copy(view, host);
  return view;
}

template <class S>
void feed(const Exec& exec, kvm::State<S, float>& st, const Spec& s, const host_detail::FloatInputs& f, std::int64_t t0,
          std::int64_t t1, std::vector<double>& out, kvm::RouteLog* log) {
  using host_detail::tokens;
  const std::int64_t n = t1 - t0;
  const auto q = to_device(tokens(f.q, s.B * s.Hq, s.T, s.D, t0, t1));
  const auto k = to_device(tokens(f.k, s.B * s.Hk, s.T, s.D, t0, t1));
  const auto v = to_device(tokens(f.v, s.B * s.Hk, s.T, s.Dv, t0, t1));
  const auto g = to_device(tokens(f.gate, s.B * s.Hk, s.T, 1, t0, t1));
  const auto lw = to_device(f.ln_w), lb = to_device(f.ln_b), ts = to_device(f.tau_s), tw = to_device(f.tau_w);
  Kokkos::View<float*, MemSpace> o("kvmem-replay out", static_cast<std::size_t>(s.B * n * s.Hq * s.Dv));
  const kvm::Weights weights{{lw.data(), {s.D}}, {lb.data(), {s.D}}, {ts.data(), {s.Hq}}, {tw.data(), {s.Hq}}};
  const Status status = kvm::prefill(exec, st, weights, TensorView<const float, 4>(q.data(), {s.B, s.Hq, n, s.D}),
                                     TensorView<const float, 4>(k.data(), {s.B, s.Hk, n, s.D}),
                                     TensorView<const float, 4>(v.data(), {s.B, s.Hk, n, s.Dv}),
                                     TensorView<const float, 3>(g.data(), {s.B, s.Hk, n}),
                                     TensorView<float, 4>(o.data(), {s.B, n, s.Hq, s.Dv}), nullptr, log);
  if (!status.is_ok()) throw BadInput("kokkos kvm rejects the case: " + status.message());
  exec.space.fence();
  const auto host = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), o);
  const std::int64_t row = s.Hq * s.Dv;
  for (std::int64_t b = 0; b < s.B; ++b)
    std::copy(host.data() + b * n * row, host.data() + (b + 1) * n * row, out.begin() + (b * s.T + t0) * row);
}

template <class S>
kokkos::KvmState<S, float, MemSpace> make_state(const Exec& exec, const Spec& s) {
  kokkos::KvmState<S, float, MemSpace> st;
  const Status status =
      kokkos::create_state<S, float>(exec, host_detail::params_of(s), kvm::Shape{s.B, s.Hq, s.Hk, s.D, s.Dv, s.T}, st);
  if (!status.is_ok()) throw BadInput("kokkos kvm rejects the configuration: " + status.message());
  return st;
}

template <class S>
Results run(const Spec& s, const Inputs& in, Progress& progress) {
  const Exec exec{Space(), /*checked*/ true};  // a replay reports bad input in its files as a Status
  const host_detail::FloatInputs f(in);
  Results r;
  r.out.assign(static_cast<std::size_t>(s.B * s.T * s.Hq * s.Dv), 0.0);
  {
    auto st = make_state<S>(exec, s);
    kvm::RouteLog log;
    progress.phase("prefill", s.T, [&] { feed(exec, st.state, s, f, 0, s.T, r.out, &log); });
    host_detail::collect(st.state, s, log, r);  // the state's memory is host-accessible (create_state)
  }
  if (in.has_q && s.decode_split >= 0) {
    auto st = make_state<S>(exec, s);
    r.out_decode.assign(r.out.size(), 0.0);
    progress.phase("prefill " + std::to_string(s.decode_split) + " + decode", s.T, [&] {
      if (s.decode_split > 0) feed(exec, st.state, s, f, 0, s.decode_split, r.out_decode, nullptr);
      progress.advance(s.decode_split);
      for (std::int64_t t = s.decode_split; t < s.T; ++t) {
        feed(exec, st.state, s, f, t, t + 1, r.out_decode, nullptr);
        progress.advance(1);
      }
    });
    r.has_decode = true;
  }
  return r;
}

}  // namespace kokkos_detail

// Kokkos' default execution space of this build (Serial with Debian's Kokkos). Kokkos is initialised
// for this run only; the guard outlives every View of the run.
inline Results run_kokkos(const Spec& s, const Inputs& in, const Options& opt, Progress& progress) {
  if (s.round_value_readout_bf16)
    throw BadInput("config: 'round_value_readout_bf16' is only implemented by the reference backend");
  if (opt.threads > 0)
    progress.note("--threads does not apply to the kokkos backend (Kokkos chooses; see KOKKOS_NUM_THREADS)");
  Kokkos::ScopeGuard guard;
  if (opt.precision == Precision::kBf16) return kokkos_detail::run<bf16>(s, in, progress);
  return kokkos_detail::run<float>(s, in, progress);
}
#endif

#if KVMEM_REPLAY_WITH_CUDA_KVM
namespace cuda_detail {

// The learned weights in device memory, fp32 (cuda::KvmWeights).
struct DeviceWeights {
  DeviceArray<float> ln_w, ln_b, tau_s, tau_w;
  explicit DeviceWeights(const host_detail::FloatInputs& f)
      : ln_w(to_device_as<float>(f.ln_w)),
        ln_b(to_device_as<float>(f.ln_b)),
        tau_s(to_device_as<float>(f.tau_s)),
        tau_w(to_device_as<float>(f.tau_w)) {}
  [[nodiscard]] cuda::KvmWeights view() const { return {ln_w.data(), ln_b.data(), tau_s.data(), tau_w.data()}; }
};

// Feeds tokens [t0, t1) of every sequence through one fixed-batch call (kvm::prefill; one token is a
// decode step on this backend too), inputs in the storage type S as the CUDA calls take them, and
// scatters the rows into out [B,T,Hq,Dv].
template <class S>
void feed(const cuda::Executor& exec, cuda::KvmState<S, float>& st, const DeviceWeights& w, const Spec& s,
          const host_detail::FloatInputs& f, std::int64_t t0, std::int64_t t1, std::vector<double>& out,
          kvm::RouteLog* log) {
  using host_detail::tokens;
  const std::int64_t n = t1 - t0;
  const auto q = to_device_as<S>(tokens(f.q, s.B * s.Hq, s.T, s.D, t0, t1));
  const auto k = to_device_as<S>(tokens(f.k, s.B * s.Hk, s.T, s.D, t0, t1));
  const auto v = to_device_as<S>(tokens(f.v, s.B * s.Hk, s.T, s.Dv, t0, t1));
  const auto g = to_device_as<S>(tokens(f.gate, s.B * s.Hk, s.T, 1, t0, t1));
  const DeviceArray<float> o(static_cast<std::size_t>(s.B * n * s.Hq * s.Dv));
  const Status status = kvm::prefill(exec, st, w.view(), TensorView<const S, 4>(q.data(), {s.B, s.Hq, n, s.D}),
                                     TensorView<const S, 4>(k.data(), {s.B, s.Hk, n, s.D}),
                                     TensorView<const S, 4>(v.data(), {s.B, s.Hk, n, s.Dv}),
                                     TensorView<const S, 3>(g.data(), {s.B, s.Hk, n}),
                                     TensorView<float, 4>(o.data(), {s.B, n, s.Hq, s.Dv}), nullptr, log);
  if (!status.is_ok()) throw BadInput("cuda kvm rejects the case: " + status.message());
  CudaTransport::fence(exec);
  std::vector<float> host(o.size());
  CudaTransport::read_back(o, host);
  const std::int64_t row = s.Hq * s.Dv;
  for (std::int64_t b = 0; b < s.B; ++b)
    std::copy(host.begin() + b * n * row, host.begin() + (b + 1) * n * row, out.begin() + (b * s.T + t0) * row);
}

template <class S>
cuda::KvmState<S, float> make_state(const Spec& s) {
  cuda::KvmState<S, float> st;
  const Status status =
      cuda::KvmState<S, float>::create(host_detail::params_of(s), kvm::Shape{s.B, s.Hq, s.Hk, s.D, s.Dv, s.T}, st);
  if (!status.is_ok()) throw BadInput("cuda kvm rejects the configuration: " + status.message());
  return st;
}

// The final state (read back item by item) and the route log of a prefill, in the goldens' layout.
template <class S>
void collect(const cuda::KvmState<S, float>& st, const Spec& s, const kvm::RouteLog& log, Results& r) {
  r.slots = st.slots();
  for (std::int64_t b = 0; b < s.B; ++b)
    for (std::int64_t g = 0; g < s.Hk; ++g) {
      std::vector<float> sk, sv, rho;
      throw_if_error(st.download(b, g, sk, sv, rho, cudaStream_t{}));
      r.state_k.insert(r.state_k.end(), sk.begin(), sk.end());
      r.state_v.insert(r.state_v.end(), sv.begin(), sv.end());
      r.state_rho.insert(r.state_rho.end(), rho.begin(), rho.end());
    }
  host_detail::collect_routes(log, r);
}

template <class S>
Results run(const Spec& s, const Inputs& in, Progress& progress) {
  const cuda::Executor exec{};  // the legacy default stream, with which CudaTransport's copies are ordered
  const host_detail::FloatInputs f(in);
  const DeviceWeights w(f);
  Results r;
  r.out.assign(static_cast<std::size_t>(s.B * s.T * s.Hq * s.Dv), 0.0);
  {
    auto st = make_state<S>(s);
    kvm::RouteLog log;
    progress.phase("prefill", s.T, [&] { feed(exec, st, w, s, f, 0, s.T, r.out, &log); });
    collect(st, s, log, r);
  }
  if (in.has_q && s.decode_split >= 0) {
    auto st = make_state<S>(s);
    r.out_decode.assign(r.out.size(), 0.0);
    progress.phase("prefill " + std::to_string(s.decode_split) + " + decode", s.T, [&] {
      if (s.decode_split > 0) feed(exec, st, w, s, f, 0, s.decode_split, r.out_decode, nullptr);
      progress.advance(s.decode_split);
      for (std::int64_t t = s.decode_split; t < s.T; ++t) {
        feed(exec, st, w, s, f, t, t + 1, r.out_decode, nullptr);
        progress.advance(1);
      }
    });
    r.has_decode = true;
  }
  return r;
}

}  // namespace cuda_detail

// The CUDA backend's fixed-batch calls (kvm::prefill, one call per decode token) on the current device:
// fp32 or bf16 storage, inputs in the storage type, sums and math in fp32.
inline Results run_cuda(const Spec& s, const Inputs& in, const Options& opt, Progress& progress) {
  if (s.round_value_readout_bf16)
    throw BadInput("config: 'round_value_readout_bf16' is only implemented by the reference backend");
  if (opt.threads > 0) progress.note("--threads does not apply to the cuda backend");
  if (opt.precision == Precision::kBf16) return cuda_detail::run<bf16>(s, in, progress);
  return cuda_detail::run<float>(s, in, progress);
}
#endif

// ---- trace mode (sequence slots, trace.hpp) ---------------------------------------------------------

// The trace's config: the keys of a golden case's config (Hq, Hk, D, Dv, budget, chunk, ...) without B
// and T; the slot count is the trace's max_slots and `n_ctx` the longest sequence a slot may hold.
inline Spec parse_trace_config(const trace::Trace& t) {
  const ConfigReader cfg(t.config, t.path + ": config");
  for (const char* key : {"B", "T", "decode_split", "round_value_readout_bf16"})
    if (cfg.has(key))
      throw BadInput(t.path + ": config: '" + key +
                     "' does not apply to a trace (slots come from max_slots, capacity from n_ctx)");
  const std::int64_t n_ctx = cfg.integer("n_ctx", 1, kMaxExtent);
  Json patched = t.config;
  patched.erase("n_ctx");
  patched["B"] = t.max_slots;
  patched["T"] = n_ctx;
  try {
    return parse_config(patched);
  } catch (const BadInput& e) {
    throw BadInput(t.path + ": " + e.what());
  }
}

// The packed inputs of every step, token-major, float: q [N,Hq,D], k [N,Hk,D], v [N,Hk,Dv], gate [N,Hk],
// and the learned weights ln_weight, ln_bias [D], tau_state, tau_bswa [Hq].
struct TraceInputs {
  std::vector<float> q, k, v, gate, ln_w, ln_b, tau_s, tau_w;
  [[nodiscard]] kvm::Weights weights() const {
    return {{ln_w.data(), {std::int64_t(ln_w.size())}},
            {ln_b.data(), {std::int64_t(ln_b.size())}},
            {tau_s.data(), {std::int64_t(tau_s.size())}},
            {tau_w.data(), {std::int64_t(tau_w.size())}}};
  }
};

inline TraceInputs load_trace_inputs(const Case& c, const Spec& s, std::int64_t N) {
  const auto f = [](std::vector<double> x) { return std::vector<float>(x.begin(), x.end()); };
  const std::string n = "N=" + std::to_string(N) + " packed tokens of the trace";
  TraceInputs in;
  in.q = f(input_f64(c, "q", {N, s.Hq, s.D}, n + ", Hq, D"));
  in.k = f(input_f64(c, "k", {N, s.Hk, s.D}, n + ", Hk, D"));
  in.v = f(input_f64(c, "v", {N, s.Hk, s.Dv}, n + ", Hk, Dv"));
  in.gate = f(input_f64(c, "gate", {N, s.Hk}, n + ", Hk"));
  in.ln_w = f(input_f64(c, "ln_weight", {s.D}, "D=" + std::to_string(s.D)));
  in.ln_b = f(input_f64(c, "ln_bias", {s.D}, "D=" + std::to_string(s.D)));
  in.tau_s = f(input_f64(c, "tau_state", {s.Hq}, "Hq=" + std::to_string(s.Hq)));
  in.tau_w = f(input_f64(c, "tau_bswa", {s.Hq}, "Hq=" + std::to_string(s.Hq)));
  return in;
}

#if KVMEM_REPLAY_WITH_KOKKOS_KVM && KVMEM_REPLAY_WITH_KOKKOS_SLOTS_KVM
// The trace's inputs copied into the memory of Kokkos' default execution space, once.
struct KokkosTraceInputs {
  Kokkos::View<float*, kokkos_detail::MemSpace> q, k, v, gate, ln_w, ln_b, tau_s, tau_w;
  explicit KokkosTraceInputs(const TraceInputs& in)
      : q(kokkos_detail::to_device(in.q)),
        k(kokkos_detail::to_device(in.k)),
        v(kokkos_detail::to_device(in.v)),
        gate(kokkos_detail::to_device(in.gate)),
        ln_w(kokkos_detail::to_device(in.ln_w)),
        ln_b(kokkos_detail::to_device(in.ln_b)),
        tau_s(kokkos_detail::to_device(in.tau_s)),
        tau_w(kokkos_detail::to_device(in.tau_w)) {}
  [[nodiscard]] kvm::Weights weights() const {
    return {{ln_w.data(), {std::int64_t(ln_w.extent(0))}},
            {ln_b.data(), {std::int64_t(ln_b.extent(0))}},
            {tau_s.data(), {std::int64_t(tau_s.extent(0))}},
            {tau_w.data(), {std::int64_t(tau_w.extent(0))}}};
  }
};

// A Kokkos state: kvm::State placed in the space's memory (kokkos::create_state).
template <class S>
Status create_trace_state(const kokkos_detail::Exec& exec, const kvm::Params& p, const kvm::Shape& shape,
                          kokkos::KvmState<S, float, kokkos_detail::MemSpace>& out) {
  return kokkos::create_state<S, float>(exec, p, shape, out);
}
template <class S>
kvm::State<S, float>& state_of(kokkos::KvmState<S, float, kokkos_detail::MemSpace>& st) {
  return st.state;
}
template <class S>
const kvm::State<S, float>& state_of(const kokkos::KvmState<S, float, kokkos_detail::MemSpace>& st) {
  return st.state;
}
#endif

#if KVMEM_REPLAY_WITH_HOST_KVM
// A host state owns its memory.
template <class S>
Status create_trace_state(const host::Executor& /*exec*/, const kvm::Params& p, const kvm::Shape& shape,
                          kvm::State<S, float>& out) {
  return kvm::State<S, float>::create(p, shape, out);
}
template <class S>
kvm::State<S, float>& state_of(kvm::State<S, float>& st) {
  return st;
}
template <class S>
const kvm::State<S, float>& state_of(const kvm::State<S, float>& st) {
  return st;
}
#endif

#if KVMEM_REPLAY_WITH_CUDA_KVM
// The trace's inputs in device memory, copied once: q, k, v and gate in the storage type S (the element
// type the CUDA step reads, as an engine hands it), the learned weights in fp32 (cuda::KvmWeights).
template <class S>
struct CudaTraceInputs {
  DeviceArray<S> q, k, v, gate;
  DeviceArray<float> ln_w, ln_b, tau_s, tau_w;
  explicit CudaTraceInputs(const TraceInputs& in)
      : q(to_device_as<S>(in.q)),
        k(to_device_as<S>(in.k)),
        v(to_device_as<S>(in.v)),
        gate(to_device_as<S>(in.gate)),
        ln_w(to_device_as<float>(in.ln_w)),
        ln_b(to_device_as<float>(in.ln_b)),
        tau_s(to_device_as<float>(in.tau_s)),
        tau_w(to_device_as<float>(in.tau_w)) {}
  [[nodiscard]] cuda::KvmWeights weights() const { return {ln_w.data(), ln_b.data(), tau_s.data(), tau_w.data()}; }
};

// A CUDA state (cuda::KvmState, owning its device memory) and the larger workspace that a step with
// more rows than slots needs: the CUDA step gives every row a work item, padding rows too, and a
// created state's own workspace serves max_slots rows.
template <class S>
struct CudaState {
  cuda::KvmState<S, float> state;
  cuda::DeviceBuffer workspace;
};
template <class S>
Status create_trace_state(const cuda::Executor& /*exec*/, const kvm::Params& p, const kvm::Shape& shape,
                          CudaState<S>& out) {
  return cuda::KvmState<S, float>::create(p, shape, out.state);
}
template <class S>
cuda::KvmState<S, float>& state_of(CudaState<S>& st) {
  return st.state;
}
template <class S>
const cuda::KvmState<S, float>& state_of(const CudaState<S>& st) {
  return st.state;
}
// Gives the state a workspace for `rows` rows when its own serves fewer. Runs between fenced calls, so
// no work still uses the workspace it replaces.
template <class S>
Status reserve_rows(CudaState<S>& st, std::int64_t rows) {
  if (rows <= st.state.workspace_rows()) return Status::ok();
  const Limits limits{.max_rows = rows};
  const std::size_t bytes = cuda::KvmState<S, float>::workspace_bytes({st.state.params(), st.state.shape()}, limits);
  cuda::DeviceBuffer memory;
  KVMEM_RETURN_IF_ERROR(cuda::DeviceBuffer::allocate(bytes, memory));
  KVMEM_RETURN_IF_ERROR(st.state.attach_workspace(memory.get(), bytes, limits));
  st.workspace = std::move(memory);
  return Status::ok();
}
// The CUDA step checks its rows on the device: a refused step returns ok, changes nothing and leaves
// its reason in the state until step_status reads (and clears) it. Read after every step, so a
// refusal reaches the player as the call's Status, as the host's would.
template <class S>
Status step_outcome(const cuda::Executor& exec, CudaState<S>& st) {
  return st.state.step_status(exec);
}
#endif

#if KVMEM_REPLAY_WITH_HOST_KVM || (KVMEM_REPLAY_WITH_KOKKOS_KVM && KVMEM_REPLAY_WITH_KOKKOS_SLOTS_KVM) || \
    KVMEM_REPLAY_WITH_CUDA_KVM
// What a backend needs around a step beyond the call: room for the step's rows (reserve_rows) and the
// step's refusal when the backend reports it after the call (step_outcome). Host and Kokkos check rows
// on the host and need neither; the CUDA overloads above are the more specialised match for its state.
template <class Holder>
Status reserve_rows(Holder& /*state*/, std::int64_t /*rows*/) {
  return Status::ok();
}
template <class Exec, class Holder>
Status step_outcome(const Exec& /*exec*/, Holder& /*state*/) {
  return Status::ok();
}

// One trace runner for every backend with KVM's slot API (docs/slots.md): Holder is the backend's
// state (made by create_trace_state, reached through state_of), In the trace's inputs in its memory
// (q, k, v, gate in the element type the backend's step reads, and weights()), Transport (transport.hpp)
// how a call's index lists and outputs move. The host runs the exact executor, which keeps the property
// the check tests: a row equals its sequence run alone, bit for bit.
template <class Exec, class Holder, class In, class Transport>
class KvmSlotRunner final : public trace::SlotRunner {
  using Elem = std::remove_cvref_t<decltype(*std::declval<const In&>().q.data())>;

 public:
  KvmSlotRunner(std::shared_ptr<const In> in, const Spec& s, std::int64_t max_slots, Exec exec, const char* backend)
      : in_(std::move(in)), s_(s), exec_(std::move(exec)) {
    const Status status =
        create_trace_state(exec_, host_detail::params_of(s), kvm::Shape{max_slots, s.Hq, s.Hk, s.D, s.Dv, s.T}, state_);
    if (!status.is_ok()) throw BadInput(std::string(backend) + " kvm rejects the trace's config: " + status.message());
  }
  Status step(std::span<const std::int32_t> slot, std::span<const std::int32_t> query_start, std::int64_t first,
              std::span<float> out, std::span<float> lse) override {
    const std::int64_t n = query_start.back();
    KVMEM_RETURN_IF_ERROR(reserve_rows(state_, std::int64_t(slot.size())));
    const auto d_slot = Transport::list(slot), d_start = Transport::list(query_start);
    auto d_out = Transport::output(out), d_lse = Transport::output(lse);
    const In& in = *in_;
    const Status called =
        kvm::step(exec_, state_of(state_), in.weights(), Rows{Transport::view(d_slot), Transport::view(d_start)},
                  TensorView<const Elem, 3>(in.q.data() + first * s_.Hq * s_.D, {n, s_.Hq, s_.D}),
                  TensorView<const Elem, 3>(in.k.data() + first * s_.Hk * s_.D, {n, s_.Hk, s_.D}),
                  TensorView<const Elem, 3>(in.v.data() + first * s_.Hk * s_.Dv, {n, s_.Hk, s_.Dv}),
                  TensorView<const Elem, 2>(in.gate.data() + first * s_.Hk, {n, s_.Hk}),
                  TensorView<float, 3>(Transport::data(d_out), {n, s_.Hq, s_.Dv}),
                  TensorView<float, 2>(Transport::data(d_lse), {n, s_.Hq}));
    Transport::fence(exec_);
    const Status status = called.is_ok() ? step_outcome(exec_, state_) : called;
    Transport::read_back(d_out, out);
    Transport::read_back(d_lse, lse);
    return status;
  }
  Status reset_slots(std::span<const std::int32_t> slots) override {
    const auto d = Transport::list(slots);
    return fenced(kvm::reset_slots(exec_, state_of(state_), Transport::view(d)));
  }
  Status copy_slots(std::span<const std::int32_t> src, std::span<const std::int32_t> dst) override {
    const auto a = Transport::list(src), b = Transport::list(dst);
    return fenced(kvm::copy_slots(exec_, state_of(state_), Transport::view(a), Transport::view(b)));
  }
  Status export_slot(std::int32_t slot, std::vector<std::byte>& record) override {
    Transport::fence(exec_);
    record.resize(kvm::export_bytes(state_of(state_), slot));
    return fenced(kvm::export_slot(exec_, state_of(state_), slot, std::span<std::byte>(record)));
  }
  Status import_slot(std::int32_t slot, std::span<const std::byte> record) override {
    return fenced(kvm::import_slot(exec_, state_of(state_), in_->weights(), slot, record));
  }
  Status truncate(std::int32_t slot, std::int64_t tokens) override {
    return fenced(kvm::truncate(exec_, state_of(state_), slot, tokens));
  }

 private:
  Status fenced(Status status) const {
    Transport::fence(exec_);
    return status;
  }
  std::shared_ptr<const In> in_;
  Spec s_;
  Exec exec_;
  Holder state_;
};

// The factory of the runner for the run's storage precision; Holder<S> is the backend's state type.
template <class Exec, template <class> class Holder, class Transport, class In>
std::function<std::unique_ptr<trace::SlotRunner>(std::int64_t)> make_runner(Precision precision,
                                                                            std::shared_ptr<const In> in, const Spec& s,
                                                                            Exec exec, const char* backend) {
  if (precision == Precision::kBf16)
    return [=](std::int64_t slots) -> std::unique_ptr<trace::SlotRunner> {
      return std::make_unique<KvmSlotRunner<Exec, Holder<bf16>, In, Transport>>(in, s, slots, exec, backend);
    };
  return [=](std::int64_t slots) -> std::unique_ptr<trace::SlotRunner> {
    return std::make_unique<KvmSlotRunner<Exec, Holder<float>, In, Transport>>(in, s, slots, exec, backend);
  };
}
#endif

#if KVMEM_REPLAY_WITH_HOST_KVM
template <class S>
using HostState = kvm::State<S, float>;
#endif
#if KVMEM_REPLAY_WITH_KOKKOS_KVM && KVMEM_REPLAY_WITH_KOKKOS_SLOTS_KVM
template <class S>
using KokkosState = kokkos::KvmState<S, float, kokkos_detail::MemSpace>;
#endif

#if KVMEM_REPLAY_WITH_CUDA_KVM
// The CUDA runner's factory for storage type S: the inputs go to the device once, in S.
template <class S>
std::function<std::unique_ptr<trace::SlotRunner>(std::int64_t)> make_cuda_runner(const TraceInputs& in, const Spec& s) {
  using Runner = KvmSlotRunner<cuda::Executor, CudaState<S>, CudaTraceInputs<S>, CudaTransport>;
  auto dev = std::make_shared<const CudaTraceInputs<S>>(in);
  // The legacy default stream: CudaTransport's blocking copies are ordered with its work.
  const cuda::Executor exec{};
  return [=](std::int64_t slots) -> std::unique_ptr<trace::SlotRunner> {
    return std::make_unique<Runner>(dev, s, slots, exec, "cuda");
  };
}
#endif

// The trace player's view of KVM on the chosen backend. A backend with a slot API gets a runner
// (trace::SlotRunner) and a case below; the others answer "not built".
inline trace::Mechanism trace_mechanism(const Options& opt, const Case& c, const trace::Trace& t) {
  const Spec s = parse_trace_config(t);
  auto in = std::make_shared<const TraceInputs>(load_trace_inputs(c, s, t.tokens));
  trace::Mechanism m;
  m.label = std::string("kvm/") + to_string(opt.backend);
  m.out_width = s.Hq * s.Dv;
  m.lse_width = s.Hq;
  m.out_shape_tail = {s.Hq, s.Dv};
  m.lse_shape_tail = {s.Hq};
  if (opt.backend == Backend::kHost) {
#if KVMEM_REPLAY_WITH_HOST_KVM
    const host::Executor exec{.threads = opt.threads, .exact = true};
    m.make_runner = make_runner<host::Executor, HostState, HostTransport>(opt.precision, in, s, exec, "host");
    return m;
#endif
  }
#if KVMEM_REPLAY_WITH_KOKKOS_KVM && KVMEM_REPLAY_WITH_KOKKOS_SLOTS_KVM
  if (opt.backend == Backend::kKokkos) {
    if (opt.threads > 0)
      std::fprintf(stderr, "kvmem-replay: --threads does not apply to the kokkos backend (see KOKKOS_NUM_THREADS)\n");
    m.keep_alive = std::make_shared<Kokkos::ScopeGuard>();  // Kokkos lives as long as the runners
    auto dev = std::make_shared<const KokkosTraceInputs>(*in);
    const kokkos_detail::Exec exec{kokkos_detail::Space(), /*checked*/ true};  // bad input comes back as a Status
    m.make_runner =
        make_runner<kokkos_detail::Exec, KokkosState, KokkosTransport>(opt.precision, dev, s, exec, "kokkos");
    return m;
  }
#endif
#if KVMEM_REPLAY_WITH_CUDA_KVM
  if (opt.backend == Backend::kCuda) {
    if (opt.threads > 0) std::fprintf(stderr, "kvmem-replay: --threads does not apply to the cuda backend\n");
    require_cuda_device();
    m.check_tolerance = trace::kCudaCheckTolerance;
    m.make_runner =
        opt.precision == Precision::kBf16 ? make_cuda_runner<bf16>(*in, s) : make_cuda_runner<float>(*in, s);
    return m;
  }
#endif
  throw BadInput(trace::trace_unavailable(opt.backend, "kvm", KVMEM_REPLAY_WITH_HOST_KVM != 0));
}

inline std::string skip_reason(const std::string& name, const Case& /*c*/, Backend backend) {
  if (name == "route_margin_min" || name == "append_margin_min") return "diagnostic of the generator, not recomputed";
  if (name.rfind("d_", 0) == 0)
    return std::string("gradient: backend ") + to_string(backend) + " implements no KVM backward";
  if (name == "out" || name == "out_decode") return "not computed for this case";
  return "";
}

// Runs the case; throws BadInput for anything wrong with it.
inline void run(const Options& opt, const Case& c, Outputs& outputs) {
  const Spec spec = parse_config(c.config);
  const Inputs inputs = load_inputs(c, spec);
  const std::string unavailable = unavailable_reason(
      opt.backend, "kvm",
      {KVMEM_REPLAY_WITH_REFERENCE_KVM != 0, KVMEM_REPLAY_WITH_HOST_KVM != 0, KVMEM_REPLAY_WITH_KOKKOS_KVM != 0,
       KVMEM_REPLAY_WITH_CUDA_KVM != 0, "include/kvmem/reference/kvm.hpp", "include/kvmem/backend/host/kvm.hpp"});
  if (!unavailable.empty()) throw BadInput(unavailable);
#if KVMEM_REPLAY_WITH_CUDA_KVM
  if (opt.backend == Backend::kCuda) require_cuda_device();  // before any note: one line without a GPU
#endif

  Progress progress(!opt.quiet, std::string("kvm/") + to_string(opt.backend));
  if (!inputs.has_q)
    progress.note(
        "no 'q' in the input: state-only case, prefill runs on zero queries; out and out_decode are not written");
  if (c.file.has("dout") && opt.backend != Backend::kReference)
    progress.note(std::string("'dout' present, but backend ") + to_string(opt.backend) +
                  " implements no KVM backward: gradients are not computed");
  Results results;
  if (opt.backend == Backend::kReference) {
#if KVMEM_REPLAY_WITH_REFERENCE_KVM
    results = run_reference(spec, inputs, progress);
#endif
  } else if (opt.backend == Backend::kHost) {
#if KVMEM_REPLAY_WITH_HOST_KVM
    results = run_host(spec, inputs, opt, progress);
#endif
  } else if (opt.backend == Backend::kKokkos) {
#if KVMEM_REPLAY_WITH_KOKKOS_KVM
    results = run_kokkos(spec, inputs, opt, progress);
#endif
  } else if (opt.backend == Backend::kCuda) {
#if KVMEM_REPLAY_WITH_CUDA_KVM
    results = run_cuda(spec, inputs, opt, progress);
#endif
  }
  emit(spec, inputs, std::move(results), outputs);
}

}  // namespace kvmem::replay::kvm_adapter
