// SPDX-License-Identifier: Apache-2.0
#pragma once
// kvmem-replay adapter for Universal Attention (spec UA.md; tensor names of tests/data/golden/README.md).
//   dense                      -> out, lse, lambda_last
//   decode (no pruning)        -> out_decode
//   pruned, per config threshold p -> out_pruned_p{digits}, kept_p{digits}  (0.05 -> p005)
// The optional output gate z_o [B,T,H,D] is passed on when the input has it.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <memory>
#include <set>
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

// The adapters this file is built with: examples/replay/CMakeLists.txt sets each flag to 0 or 1; a file
// that includes this one without them (a test) gets none of them, as `#if` would read them.
#ifndef KVMEM_REPLAY_WITH_REFERENCE_UA
#define KVMEM_REPLAY_WITH_REFERENCE_UA 0
#endif
#ifndef KVMEM_REPLAY_WITH_HOST_UA
#define KVMEM_REPLAY_WITH_HOST_UA 0
#endif
#ifndef KVMEM_REPLAY_WITH_KOKKOS_UA
#define KVMEM_REPLAY_WITH_KOKKOS_UA 0
#endif
#ifndef KVMEM_REPLAY_WITH_KOKKOS_SLOTS_UA
#define KVMEM_REPLAY_WITH_KOKKOS_SLOTS_UA 0
#endif
#ifndef KVMEM_REPLAY_WITH_CUDA_UA
#define KVMEM_REPLAY_WITH_CUDA_UA 0
#endif
#if KVMEM_REPLAY_WITH_CUDA_UA && !KVMEM_REPLAY_WITH_HOST_UA
#error "the CUDA UA adapter reuses the host adapter's input views: build it with KVMEM_REPLAY_WITH_HOST_UA"
#endif

#if KVMEM_REPLAY_WITH_REFERENCE_UA
#include "kvmem/reference/ua.hpp"
#endif
#if KVMEM_REPLAY_WITH_HOST_UA || KVMEM_REPLAY_WITH_KOKKOS_UA
#include "kvmem/backend/host/ua.hpp"
#endif
#if KVMEM_REPLAY_WITH_KOKKOS_UA
#include <Kokkos_Core.hpp>

#include "kvmem/backend/kokkos.hpp"
#include "transport_kokkos.hpp"
#endif
#if KVMEM_REPLAY_WITH_CUDA_UA
#include "kvmem/backend/cuda/ua.cuh"
#include "transport_cuda.hpp"
#endif

namespace kvmem::replay::ua_adapter {

struct Spec {
  std::int64_t B = 0, T = 0, H = 0, G = 0, D = 0;
  std::int64_t prefill_chunk = 128;
  std::int64_t prefill_split = -1;  // -1: the whole prompt is prefilled
  bool evict_before_attention = true;
  std::vector<double> thresholds;
};

// The tensor-name suffix of threshold p, as the goldens spell it: the decimal digits of p with at
// least two and at most three decimals, dot removed (0.05 -> "p005", 0.15 -> "p015", 0.125 -> "p0125").
inline std::string threshold_suffix(double p) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.3f", p);
  std::string text = buf;
  if (text.size() > 4 && text.back() == '0') text.pop_back();  // keep two decimals minimum
  std::string digits;
  for (char ch : text)
    if (ch != '.') digits += ch;
  return "p" + digits;
}

inline Spec parse_config(const Json& config) {
  const ConfigReader cfg(config);
  Spec s;
  s.B = cfg.integer("B", 1, kMaxExtent);
  s.T = cfg.integer("T", 1, kMaxExtent);
  s.H = cfg.integer("H", 1, kMaxExtent);
  s.G = cfg.integer("G", 1, kMaxExtent);
  s.D = cfg.integer("D", 1, kMaxExtent);
  if (s.H % s.G != 0)
    throw BadInput("config: 'H' (" + std::to_string(s.H) + ") must be a multiple of 'G' (" + std::to_string(s.G) + ")");
  s.prefill_chunk = cfg.integer_or("prefill_chunk", s.prefill_chunk, 1, kMaxExtent);
  s.prefill_split = cfg.integer_or("prefill_split", s.prefill_split, -1, s.T);
  s.evict_before_attention = cfg.boolean_or("evict_before_attention", s.evict_before_attention);
  // The library's UA has scale 1, clamp 1e-6 and the three-gate set; a case asking for something
  // else cannot be replayed faithfully, so it is refused rather than silently run differently.
  if (const double scale = cfg.real_or("scale", 1.0, -1e300, 1e300); scale != 1.0)
    throw BadInput("config: 'scale' = " + ConfigReader::num(scale) + " is not supported (UA uses softmax scale 1)");
  if (const double clamp = cfg.real_or("clamp", 1e-6, -1e300, 1e300); clamp != 1e-6)
    throw BadInput("config: 'clamp' = " + ConfigReader::num(clamp) + " is not supported (UA clamps at 1e-6)");
  if (const Json* gates = cfg.find("gates")) {
    std::set<std::string> names;
    if (gates->is_array())
      for (const auto& g : *gates)
        if (g.is_string()) names.insert(g.get<std::string>());
    if (!gates->is_array() || names != std::set<std::string>{"query", "key", "similarity"} || gates->size() != 3)
      throw BadInput("config: 'gates' must be [\"query\",\"key\",\"similarity\"] (the set kvmem-replay runs), got " +
                     gates->dump());
  }
  if (const std::string gqa = cfg.string_or("gqa", "floor(h/r)"); gqa != "floor(h/r)")
    throw BadInput("config: 'gqa' must be \"floor(h/r)\", got '" + gqa + "'");
  if (const Json* th = cfg.find("thresholds")) {
    if (!th->is_array())
      throw BadInput("config: 'thresholds' must be an array of numbers in (0, 1), got " + th->dump());
    std::set<std::string> seen;
    for (const auto& p : *th) {
      if (!p.is_number() || !(p.get<double>() > 0.0 && p.get<double>() < 1.0))
        throw BadInput("config: every entry of 'thresholds' must be a number in (0, 1), got " + p.dump());
      if (!seen.insert(threshold_suffix(p.get<double>())).second)
        throw BadInput("config: thresholds " + th->dump() + " name the same output twice (" +
                       threshold_suffix(p.get<double>()) + ")");
      s.thresholds.push_back(p.get<double>());
    }
    if (s.thresholds.size() > 64) throw BadInput("config: more than 64 thresholds");
  }
  return s;
}

struct Inputs {
  std::vector<double> q, k, v, z_k, z_q, z_o;
};

inline Inputs load_inputs(const Case& c, const Spec& s) {
  const std::string bgt = "B=" + std::to_string(s.B) + ", G=" + std::to_string(s.G) + ", T=" + std::to_string(s.T);
  const std::string d = ", D=" + std::to_string(s.D);
  Inputs in;
  in.q = input_f64(c, "q", {s.B, s.H, s.T, s.D},
                   "B=" + std::to_string(s.B) + ", H=" + std::to_string(s.H) + ", T=" + std::to_string(s.T) + d);
  in.k = input_f64(c, "k", {s.B, s.G, s.T, s.D}, bgt + d);
  in.v = input_f64(c, "v", {s.B, s.G, s.T, s.D}, bgt + d);
  in.z_k = input_f64(c, "z_k", {s.B, s.G, s.T}, bgt);
  in.z_q = input_f64(c, "z_q", {s.B, s.G, s.T}, bgt);
  if (c.file.has("z_o"))
    in.z_o = input_f64(c, "z_o", {s.B, s.T, s.H, s.D},
                       "B=" + std::to_string(s.B) + ", T=" + std::to_string(s.T) + ", H=" + std::to_string(s.H) + d);
  return in;
}

struct Pruned {
  double p = 0.0;
  std::vector<double> out;
  std::vector<std::int64_t> kept;  // [B,G,T] 0/1
};
struct Results {
  std::vector<double> out, lse, lambda_last, out_decode;
  std::vector<Pruned> pruned;
};

inline void emit(const Spec& s, Results r, Outputs& outputs) {
  outputs.add("out", {s.B, s.T, s.H, s.D}, std::move(r.out));
  outputs.add("lse", {s.B, s.H, s.T}, std::move(r.lse));
  outputs.add("lambda_last", {s.B, s.G, s.T}, std::move(r.lambda_last));
  outputs.add("out_decode", {s.B, s.T, s.H, s.D}, std::move(r.out_decode));
  for (auto& p : r.pruned) {
    const std::string suffix = threshold_suffix(p.p);
    outputs.add("out_pruned_" + suffix, {s.B, s.T, s.H, s.D}, std::move(p.out));
    outputs.add("kept_" + suffix, {s.B, s.G, s.T}, std::move(p.kept));
  }
}

// ---- backends ------------------------------------------------------------------------------------

#if KVMEM_REPLAY_WITH_REFERENCE_UA
inline Results run_reference(const Spec& s, const Inputs& in, Progress& progress) {
  namespace ref = kvmem::reference::ua;
  ref::Config cfg;
  cfg.B = s.B;
  cfg.T = s.T;
  cfg.H = s.H;
  cfg.G = s.G;
  cfg.D = s.D;
  cfg.prefill_chunk = s.prefill_chunk;
  cfg.prefill_split = s.prefill_split;
  cfg.evict_before_attention = s.evict_before_attention;
  ref::Inputs inputs;
  inputs.q = in.q;
  inputs.k = in.k;
  inputs.v = in.v;
  inputs.z_k = in.z_k;
  inputs.z_q = in.z_q;
  inputs.z_o = in.z_o;
  const Status status = ref::validate(cfg, inputs);
  if (!status.is_ok()) throw BadInput("reference ua rejects the case: " + status.message());

  Results r;
  ref::DenseResult dense = progress.phase("dense", s.T, [&] { return ref::dense(cfg, inputs); });
  r.out = std::move(dense.out);
  r.lse = std::move(dense.lse);
  r.lambda_last = std::move(dense.lambda_last);
  r.out_decode = progress.phase("decode", s.T, [&] { return ref::decode_dense(cfg, inputs); });
  for (double p : s.thresholds) {
    ref::PrunedResult pr =
        progress.phase("pruned " + threshold_suffix(p), s.T, [&] { return ref::pruned(cfg, inputs, p); });
    r.pruned.push_back({p, std::move(pr.out), std::move(pr.kept)});
  }
  return r;
}
#endif

#if KVMEM_REPLAY_WITH_HOST_UA || KVMEM_REPLAY_WITH_KOKKOS_UA
namespace host_detail {

// Float copies of the inputs and strided views of token ranges (no copies per call).
struct FloatInputs {
  Spec s;
  std::vector<float> q, k, v, z_k, z_q, z_o;
  FloatInputs(const Spec& spec, const Inputs& in)
      : s(spec),
        q(in.q.begin(), in.q.end()),
        k(in.k.begin(), in.k.end()),
        v(in.v.begin(), in.v.end()),
        z_k(in.z_k.begin(), in.z_k.end()),
        z_q(in.z_q.begin(), in.z_q.end()),
        z_o(in.z_o.begin(), in.z_o.end()) {}

  [[nodiscard]] ua::Inputs slice(std::int64_t t0, std::int64_t t1) const {
    const std::int64_t B = s.B, H = s.H, G = s.G, T = s.T, D = s.D, n = t1 - t0;
    ua::Inputs in;
    in.q = {q.data() + t0 * D, {B, H, n, D}, {H * T * D, T * D, D, 1}};
    in.k = {k.data() + t0 * D, {B, G, n, D}, {G * T * D, T * D, D, 1}};
    in.v = {v.data() + t0 * D, {B, G, n, D}, {G * T * D, T * D, D, 1}};
    in.z_k = {z_k.data() + t0, {B, G, n}, {G * T, T, 1}};
    in.z_q = {z_q.data() + t0, {B, G, n}, {G * T, T, 1}};
    if (!z_o.empty()) in.z_o = {z_o.data() + t0 * H * D, {B, n, H, D}, {T * H * D, H * D, D, 1}};
    return in;
  }
  [[nodiscard]] TensorView<float, 4> out_slice(std::vector<float>& out, std::int64_t t0, std::int64_t t1) const {
    return {out.data() + t0 * s.H * s.D, {s.B, t1 - t0, s.H, s.D}, {s.T * s.H * s.D, s.H * s.D, s.D, 1}};
  }
};

inline void check(const Status& status, const char* what, const char* backend = "host") {
  if (!status.is_ok())
    throw BadInput(std::string(backend) + " ua rejects the case (" + what + "): " + status.message());
}

inline std::vector<double> to_double(const std::vector<float>& x) {
  return {x.begin(), x.end()};
}

// The cache shape every cache run uses: room for the whole case, pages of 16 rows.
inline ua::CacheShape cache_shape(const Spec& s) {
  return {s.B, s.H, s.G, s.D, s.T, 16};
}

// Cache membership [B,G,T] as 0/1 from per-(b, g) row positions; `positions(b, g)` returns the
// pointer and `length(b, g)` the row count.
template <class Positions, class Length>
std::vector<std::int64_t> kept_mask(const Spec& s, const Positions& positions, const Length& length,
                                    const char* backend) {
  std::vector<std::int64_t> kept(static_cast<std::size_t>(s.B * s.G * s.T), 0);
  for (std::int64_t b = 0; b < s.B; ++b)
    for (std::int64_t g = 0; g < s.G; ++g)
      for (std::int64_t e = 0; e < length(b, g); ++e) {
        const std::int64_t pos = positions(b, g)[e];
        if (pos < 0 || pos >= s.T)
          throw std::logic_error(std::string("internal: ") + backend + " ua cache holds position " +
                                 std::to_string(pos));
        kept[static_cast<std::size_t>((b * s.G + g) * s.T + pos)] = 1;
      }
  return kept;
}

}  // namespace host_detail
#endif

#if KVMEM_REPLAY_WITH_HOST_UA
namespace host_detail {

// Chunked prefill of [0, split) with `opt`, then one decode call per later token.
template <class S>
std::vector<float> prefill_decode(const host::Executor& exec, const FloatInputs& f, std::int64_t split,
                                  const ua::Options& opt, ua::PrunedCache<S>& cache, Progress& progress) {
  std::vector<float> out(static_cast<std::size_t>(f.s.B * f.s.T * f.s.H * f.s.D), 0.0f);
  if (split > 0) check(ua::prefill(exec, cache, f.slice(0, split), opt, f.out_slice(out, 0, split)), "prefill");
  progress.advance(split);
  for (std::int64_t t = split; t < f.s.T; ++t) {
    check(ua::decode(exec, cache, f.slice(t, t + 1), opt, f.out_slice(out, t, t + 1)), "decode");
    progress.advance(1);
  }
  return out;
}

template <class S>
ua::PrunedCache<S> make_cache(const Spec& s) {
  ua::PrunedCache<S> cache;
  check(ua::PrunedCache<S>::create(cache_shape(s), cache), "cache");
  return cache;
}

template <class S>
Results run(const Spec& s, const Inputs& in, const Options& options, Progress& progress) {
  const host::Executor exec{options.threads};
  const FloatInputs f(s, in);
  Results r;
  {
    std::vector<float> out(static_cast<std::size_t>(s.B * s.T * s.H * s.D)),
        lse(static_cast<std::size_t>(s.B * s.H * s.T)), lambda(static_cast<std::size_t>(s.B * s.G * s.T));
    progress.phase("dense", s.T, [&] {
      check(ua::forward(exec, f.slice(0, s.T), f.out_slice(out, 0, s.T),
                        TensorView<float, 3>(lse.data(), {s.B, s.H, s.T}),
                        TensorView<float, 3>(lambda.data(), {s.B, s.G, s.T})),
            "forward");
    });
    r.out = to_double(out);
    r.lse = to_double(lse);
    r.lambda_last = to_double(lambda);
  }
  ua::Options dense_opt;
  dense_opt.p = 0.0;
  dense_opt.prefill_chunk = s.prefill_chunk;
  dense_opt.evict_before_attention = s.evict_before_attention;
  {
    auto cache = make_cache<S>(s);
    r.out_decode = to_double(
        progress.phase("decode", s.T, [&] { return prefill_decode(exec, f, 0, dense_opt, cache, progress); }));
  }
  const std::int64_t split = s.prefill_split < 0 ? s.T : s.prefill_split;
  for (double p : s.thresholds) {
    auto cache = make_cache<S>(s);
    ua::Options opt = dense_opt;
    opt.p = p;
    Pruned pr;
    pr.p = p;
    pr.out = to_double(progress.phase("pruned " + threshold_suffix(p), s.T,
                                      [&] { return prefill_decode(exec, f, split, opt, cache, progress); }));
    pr.kept = kept_mask(
        s, [&](std::int64_t b, std::int64_t g) { return cache.positions(b, g); },
        [&](std::int64_t b, std::int64_t g) { return cache.length(b, g); }, "host");
    r.pruned.push_back(std::move(pr));
  }
  return r;
}

}  // namespace host_detail

// fp32: everything in float. bf16: the decode caches store keys and values in bf16 (lambda and
// accumulation stay fp32); the dense forward has no storage and runs in fp32.
inline Results run_host(const Spec& s, const Inputs& in, const Options& opt, Progress& progress) {
  if (opt.precision == Precision::kBf16) return host_detail::run<bf16>(s, in, opt, progress);
  return host_detail::run<float>(s, in, opt, progress);
}
#endif

#if KVMEM_REPLAY_WITH_KOKKOS_UA
namespace kokkos_detail {

using Space = Kokkos::DefaultExecutionSpace;
using MemSpace = Space::memory_space;
using Exec = kokkos::Executor<Space>;
using DeviceVector = Kokkos::View<float*, MemSpace>;
using host_detail::check;

// A host vector copied into the execution space's memory (the device on a GPU build).
inline DeviceVector to_device(const std::vector<float>& x, const char* label) {
  DeviceVector view(Kokkos::view_alloc(Kokkos::WithoutInitializing, std::string(label)), x.size());
  Kokkos::View<const float*, Kokkos::HostSpace, Kokkos::MemoryTraits<Kokkos::Unmanaged>> host(x.data(), x.size());
  Kokkos::deep_copy(view, host);
  return view;
}

inline std::vector<double> to_host(const DeviceVector& x) {
  const auto host = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), x);
  return {host.data(), host.data() + host.size()};
}

// The float inputs copied once into the space's memory; token ranges are strided views of those
// copies with host_detail::FloatInputs' strides, so every call reads the same layout as the host run.
struct DeviceInputs {
  const host_detail::FloatInputs& f;
  DeviceVector q, k, v, z_k, z_q, z_o;

  explicit DeviceInputs(const host_detail::FloatInputs& fi)
      : f(fi),
        q(to_device(fi.q, "kvmem-replay q")),
        k(to_device(fi.k, "kvmem-replay k")),
        v(to_device(fi.v, "kvmem-replay v")),
        z_k(to_device(fi.z_k, "kvmem-replay z_k")),
        z_q(to_device(fi.z_q, "kvmem-replay z_q")) {
    if (!fi.z_o.empty()) z_o = to_device(fi.z_o, "kvmem-replay z_o");
  }

  [[nodiscard]] ua::Inputs slice(std::int64_t t0, std::int64_t t1) const {
    const ua::Inputs host = f.slice(t0, t1);
    const auto rebase = [](auto view, const std::vector<float>& from, const DeviceVector& to) {
      using V = decltype(view);
      return V(to.data() + (view.data() - from.data()), view.extents(), view.strides());
    };
    ua::Inputs in;
    in.q = rebase(host.q, f.q, q);
    in.k = rebase(host.k, f.k, k);
    in.v = rebase(host.v, f.v, v);
    in.z_k = rebase(host.z_k, f.z_k, z_k);
    in.z_q = rebase(host.z_q, f.z_q, z_q);
    if (!f.z_o.empty()) in.z_o = rebase(host.z_o, f.z_o, z_o);
    return in;
  }
  [[nodiscard]] DeviceVector make_out(const char* label) const {
    return DeviceVector(std::string(label), static_cast<std::size_t>(f.s.B * f.s.T * f.s.H * f.s.D));
  }
  [[nodiscard]] TensorView<float, 4> out_slice(const DeviceVector& out, std::int64_t t0, std::int64_t t1) const {
    const Spec& s = f.s;
    return {out.data() + t0 * s.H * s.D, {s.B, t1 - t0, s.H, s.D}, {s.T * s.H * s.D, s.H * s.D, s.D, 1}};
  }
};

// Chunked prefill of [0, split) with `opt`, then one decode call per later token.
template <class S>
std::vector<double> prefill_decode(const Exec& exec, const DeviceInputs& d, std::int64_t split, const ua::Options& opt,
                                   kokkos::UaCache<S, MemSpace>& cache, Progress& progress) {
  const std::int64_t T = d.f.s.T;
  const DeviceVector out = d.make_out("kvmem-replay out");
  if (split > 0)
    check(ua::prefill(exec, cache, d.slice(0, split), opt, d.out_slice(out, 0, split)), "prefill", "kokkos");
  progress.advance(split);
  for (std::int64_t t = split; t < T; ++t) {
    check(ua::decode(exec, cache, d.slice(t, t + 1), opt, d.out_slice(out, t, t + 1)), "decode", "kokkos");
    progress.advance(1);
  }
  exec.space.fence();
  return to_host(out);
}

template <class S>
kokkos::UaCache<S, MemSpace> make_cache(const Exec& exec, const Spec& s) {
  kokkos::UaCache<S, MemSpace> cache;
  check(kokkos::create_cache<S>(exec, host_detail::cache_shape(s), cache), "cache", "kokkos");
  return cache;
}

template <class S>
Results run(const Spec& s, const Inputs& in, Progress& progress) {
  const Exec exec{Space(), /*checked*/ true};  // a replay reports bad input in its files as a Status
  const host_detail::FloatInputs f(s, in);
  const DeviceInputs d(f);
  Results r;
  {
    const DeviceVector out = d.make_out("kvmem-replay out");
    const DeviceVector lse("kvmem-replay lse", static_cast<std::size_t>(s.B * s.H * s.T));
    const DeviceVector lambda("kvmem-replay lambda_last", static_cast<std::size_t>(s.B * s.G * s.T));
    progress.phase("dense", s.T, [&] {
      check(ua::forward(exec, d.slice(0, s.T), d.out_slice(out, 0, s.T),
                        TensorView<float, 3>(lse.data(), {s.B, s.H, s.T}),
                        TensorView<float, 3>(lambda.data(), {s.B, s.G, s.T})),
            "forward", "kokkos");
    });
    r.out = to_host(out);
    r.lse = to_host(lse);
    r.lambda_last = to_host(lambda);
  }
  ua::Options dense_opt;
  dense_opt.p = 0.0;
  dense_opt.prefill_chunk = s.prefill_chunk;
  dense_opt.evict_before_attention = s.evict_before_attention;
  {
    auto cache = make_cache<S>(exec, s);
    r.out_decode =
        progress.phase("decode", s.T, [&] { return prefill_decode(exec, d, 0, dense_opt, cache, progress); });
  }
  const std::int64_t split = s.prefill_split < 0 ? s.T : s.prefill_split;
  for (double p : s.thresholds) {
    auto cache = make_cache<S>(exec, s);
    ua::Options opt = dense_opt;
    opt.p = p;
    Pruned pr;
    pr.p = p;
    pr.out = progress.phase("pruned " + threshold_suffix(p), s.T,
                            [&] { return prefill_decode(exec, d, split, opt, cache, progress); });
    const kokkos::UaCacheSnapshot snap = kokkos::snapshot(cache);
    pr.kept = host_detail::kept_mask(
        s, [&](std::int64_t b, std::int64_t g) { return snap.positions(b, g); },
        [&](std::int64_t b, std::int64_t g) { return snap.length_of(b, g); }, "kokkos");
    r.pruned.push_back(std::move(pr));
  }
  return r;
}

}  // namespace kokkos_detail

// Kokkos' default execution space of this build (Serial with Debian's Kokkos), the same storage
// choice as the host adapter: fp32, or bf16 keys/values in the decode caches (kokkos::UaCache<bf16>;
// lambda and accumulation stay fp32, the dense forward runs in fp32). Kokkos is initialised for this
// run only; the guard outlives every View of the run.
inline Results run_kokkos(const Spec& s, const Inputs& in, const Options& opt, Progress& progress) {
  if (opt.threads > 0)
    progress.note("--threads does not apply to the kokkos backend (Kokkos chooses; see KOKKOS_NUM_THREADS)");
  Kokkos::ScopeGuard guard;
  if (opt.precision == Precision::kBf16) return kokkos_detail::run<bf16>(s, in, progress);
  return kokkos_detail::run<float>(s, in, progress);
}
#endif

#if KVMEM_REPLAY_WITH_CUDA_UA
namespace cuda_detail {

using host_detail::check;

// The float inputs copied once to the device, q, k, v and z_o in the element type E (the gate logits
// stay fp32); token ranges are strided views of those copies with host_detail::FloatInputs' strides.
template <class E>
struct DeviceInputs {
  const host_detail::FloatInputs& f;
  DeviceArray<E> q, k, v, z_o;
  DeviceArray<float> z_k, z_q;

  explicit DeviceInputs(const host_detail::FloatInputs& fi)
      : f(fi),
        q(to_device_as<E>(fi.q)),
        k(to_device_as<E>(fi.k)),
        v(to_device_as<E>(fi.v)),
        z_o(to_device_as<E>(fi.z_o)),
        z_k(to_device_as<float>(fi.z_k)),
        z_q(to_device_as<float>(fi.z_q)) {}

  [[nodiscard]] ua::InputsOf<E> slice(std::int64_t t0, std::int64_t t1) const {
    const ua::Inputs host = f.slice(t0, t1);
    const auto rebase = [](const auto& view, const std::vector<float>& from, const auto& to) {
      using T = std::remove_cvref_t<decltype(*to.data())>;
      constexpr std::size_t kRank = std::remove_cvref_t<decltype(view)>::kRank;
      return TensorView<const T, kRank>(to.data() + (view.data() - from.data()), view.extents(), view.strides());
    };
    ua::InputsOf<E> in;
    in.q = rebase(host.q, f.q, q);
    in.k = rebase(host.k, f.k, k);
    in.v = rebase(host.v, f.v, v);
    in.z_k = rebase(host.z_k, f.z_k, z_k);
    in.z_q = rebase(host.z_q, f.z_q, z_q);
    if (!f.z_o.empty()) in.z_o = rebase(host.z_o, f.z_o, z_o);
    return in;
  }
  [[nodiscard]] DeviceArray<float> make_out() const {
    return zeroed_device_floats(static_cast<std::size_t>(f.s.B * f.s.T * f.s.H * f.s.D));
  }
  [[nodiscard]] TensorView<float, 4> out_slice(const DeviceArray<float>& out, std::int64_t t0, std::int64_t t1) const {
    const std::int64_t H = f.s.H, T = f.s.T, D = f.s.D;
    return {out.data() + t0 * H * D, {f.s.B, t1 - t0, H, D}, {T * H * D, H * D, D, 1}};
  }
};

inline std::vector<double> to_host(const DeviceArray<float>& x) {
  std::vector<float> host(x.size());
  CudaTransport::read_back(x, host);
  return {host.begin(), host.end()};
}

// Chunked prefill of [0, split) with `opt`, then one decode call per later token.
template <class S>
std::vector<double> prefill_decode(const cuda::Executor& exec, const DeviceInputs<S>& d, std::int64_t split,
                                   const ua::Options& opt, cuda::UaCache<S>& cache, Progress& progress) {
  const std::int64_t T = d.f.s.T;
  const DeviceArray<float> out = d.make_out();
  if (split > 0) check(ua::prefill(exec, cache, d.slice(0, split), opt, d.out_slice(out, 0, split)), "prefill", "cuda");
  progress.advance(split);
  for (std::int64_t t = split; t < T; ++t) {
    check(ua::decode(exec, cache, d.slice(t, t + 1), opt, d.out_slice(out, t, t + 1)), "decode", "cuda");
    progress.advance(1);
  }
  CudaTransport::fence(exec);
  return to_host(out);
}

// A cache for the whole case whose prefill takes the config's prefill_chunk (UaCacheLimits sizes the
// workspace for max_prefill_chunk, 128 unless the case asks for more).
template <class S>
cuda::UaCache<S> make_cache(const Spec& s) {
  cuda::UaCacheLimits limits;
  limits.max_prefill_chunk = std::max(limits.max_prefill_chunk, s.prefill_chunk);
  cuda::UaCache<S> cache;
  check(cuda::UaCache<S>::create(host_detail::cache_shape(s), cache, limits), "cache", "cuda");
  return cache;
}

template <class S>
Results run(const Spec& s, const Inputs& in, Progress& progress) {
  const cuda::Executor exec{};  // the legacy default stream, with which CudaTransport's copies are ordered
  const host_detail::FloatInputs f(s, in);
  const DeviceInputs<float> d32(f);  // the dense forward runs in fp32, as on host
  const DeviceInputs<S> d(f);        // the caches' calls take their inputs in the storage type
  Results r;
  {
    const DeviceArray<float> out = d32.make_out();
    const DeviceArray<float> lse(static_cast<std::size_t>(s.B * s.H * s.T));
    const DeviceArray<float> lambda(static_cast<std::size_t>(s.B * s.G * s.T));
    progress.phase("dense", s.T, [&] {
      check(cuda::ua_forward(exec, d32.slice(0, s.T), d32.out_slice(out, 0, s.T),
                             TensorView<float, 3>(lse.data(), {s.B, s.H, s.T}),
                             TensorView<float, 3>(lambda.data(), {s.B, s.G, s.T})),
            "forward", "cuda");
      CudaTransport::fence(exec);
    });
    r.out = to_host(out);
    r.lse = to_host(lse);
    r.lambda_last = to_host(lambda);
  }
  ua::Options dense_opt;
  dense_opt.p = 0.0;
  dense_opt.prefill_chunk = s.prefill_chunk;
  dense_opt.evict_before_attention = s.evict_before_attention;
  {
    auto cache = make_cache<S>(s);
    r.out_decode =
        progress.phase("decode", s.T, [&] { return prefill_decode(exec, d, 0, dense_opt, cache, progress); });
  }
  const std::int64_t split = s.prefill_split < 0 ? s.T : s.prefill_split;
  for (double p : s.thresholds) {
    auto cache = make_cache<S>(s);
    ua::Options opt = dense_opt;
    opt.p = p;
    Pruned pr;
    pr.p = p;
    pr.out = progress.phase("pruned " + threshold_suffix(p), s.T,
                            [&] { return prefill_decode(exec, d, split, opt, cache, progress); });
    std::vector<std::vector<std::int64_t>> positions(static_cast<std::size_t>(s.B * s.G));
    for (std::int64_t b = 0; b < s.B; ++b)
      for (std::int64_t g = 0; g < s.G; ++g) {
        std::vector<float> lambda;
        check(cache.download(b, g, positions[std::size_t(b * s.G + g)], lambda, nullptr, nullptr, cudaStream_t{}),
              "kept positions", "cuda");
      }
    pr.kept = host_detail::kept_mask(
        s, [&](std::int64_t b, std::int64_t g) { return positions[std::size_t(b * s.G + g)].data(); },
        [&](std::int64_t b, std::int64_t g) { return std::int64_t(positions[std::size_t(b * s.G + g)].size()); },
        "cuda");
    r.pruned.push_back(std::move(pr));
  }
  return r;
}

}  // namespace cuda_detail

// The CUDA backend on the current device, the same storage choice as the host adapter: fp32, or bf16
// keys and values in the decode caches (cuda::UaCache<bf16>, which take q, k, v in bf16; λ and
// accumulation stay fp32); the dense forward runs in fp32.
inline Results run_cuda(const Spec& s, const Inputs& in, const Options& opt, Progress& progress) {
  if (opt.threads > 0) progress.note("--threads does not apply to the cuda backend");
  if (opt.precision == Precision::kBf16) return cuda_detail::run<bf16>(s, in, progress);
  return cuda_detail::run<float>(s, in, progress);
}
#endif

// ---- trace mode (sequence slots, trace.hpp) ---------------------------------------------------------

// The trace's config: H, G, D, `capacity` (kept rows per slot and KV head), and the options of every
// step: `p` (eviction threshold, 0 = dense), `prefill_chunk`, `evict_before_attention`.
struct TraceSpec {
  std::int64_t H = 0, G = 0, D = 0, capacity = 0;
  double p = 0.0;
  std::int64_t prefill_chunk = 128;
  bool evict_before_attention = true;
};

inline TraceSpec parse_trace_config(const trace::Trace& t) {
  const ConfigReader cfg(t.config, t.path + ": config");
  for (auto it = t.config.begin(); it != t.config.end(); ++it) {
    static const std::set<std::string> kKeys{"H", "G", "D", "capacity", "p", "prefill_chunk", "evict_before_attention"};
    if (kKeys.count(it.key()) == 0)
      throw BadInput(t.path + ": config: unknown key '" + it.key() +
                     "' (a UA trace has H, G, D, capacity, p, prefill_chunk, evict_before_attention)");
  }
  TraceSpec s;
  s.H = cfg.integer("H", 1, kMaxExtent);
  s.G = cfg.integer("G", 1, kMaxExtent);
  s.D = cfg.integer("D", 1, kMaxExtent);
  if (s.H % s.G != 0)
    throw BadInput(t.path + ": config: 'H' (" + std::to_string(s.H) + ") must be a multiple of 'G' (" +
                   std::to_string(s.G) + ")");
  s.capacity = cfg.integer("capacity", 1, kMaxExtent);
  s.p = cfg.real_or("p", 0.0, 0.0, 1.0);
  if (s.p >= 1.0) throw BadInput(t.path + ": config: 'p' must lie in [0, 1) (0 = dense), got 1");
  s.prefill_chunk = cfg.integer_or("prefill_chunk", s.prefill_chunk, 1, kMaxExtent);
  s.evict_before_attention = cfg.boolean_or("evict_before_attention", s.evict_before_attention);
  return s;
}

// The packed inputs of every step, token-major, float: q [N,H,D], k, v [N,G,D], z_k, z_q [N,G] and,
// when the file has it, z_o [N,H,D].
struct TraceInputs {
  std::vector<float> q, k, v, z_k, z_q, z_o;
  [[nodiscard]] const float* output_gate() const { return z_o.empty() ? nullptr : z_o.data(); }
};

inline TraceInputs load_trace_inputs(const Case& c, const TraceSpec& s, std::int64_t N) {
  const auto f = [](std::vector<double> x) { return std::vector<float>(x.begin(), x.end()); };
  const std::string n = "N=" + std::to_string(N) + " packed tokens of the trace";
  TraceInputs in;
  in.q = f(input_f64(c, "q", {N, s.H, s.D}, n + ", H, D"));
  in.k = f(input_f64(c, "k", {N, s.G, s.D}, n + ", G, D"));
  in.v = f(input_f64(c, "v", {N, s.G, s.D}, n + ", G, D"));
  in.z_k = f(input_f64(c, "z_k", {N, s.G}, n + ", G"));
  in.z_q = f(input_f64(c, "z_q", {N, s.G}, n + ", G"));
  if (c.file.has("z_o")) in.z_o = f(input_f64(c, "z_o", {N, s.H, s.D}, n + ", H, D"));
  return in;
}

#if KVMEM_REPLAY_WITH_KOKKOS_UA && KVMEM_REPLAY_WITH_KOKKOS_SLOTS_UA
// The trace's inputs copied into the memory of Kokkos' default execution space, once.
struct KokkosTraceInputs {
  kokkos_detail::DeviceVector q, k, v, z_k, z_q, z_o;
  explicit KokkosTraceInputs(const TraceInputs& in)
      : q(kokkos_detail::to_device(in.q, "kvmem-replay q")),
        k(kokkos_detail::to_device(in.k, "kvmem-replay k")),
        v(kokkos_detail::to_device(in.v, "kvmem-replay v")),
        z_k(kokkos_detail::to_device(in.z_k, "kvmem-replay z_k")),
        z_q(kokkos_detail::to_device(in.z_q, "kvmem-replay z_q")) {
    if (!in.z_o.empty()) z_o = kokkos_detail::to_device(in.z_o, "kvmem-replay z_o");
  }
  [[nodiscard]] const float* output_gate() const { return z_o.extent(0) > 0 ? z_o.data() : nullptr; }
};
#endif

#if KVMEM_REPLAY_WITH_CUDA_UA
// The trace's inputs in device memory, copied once: q, k, v and z_o in the storage type S (what the
// CUDA step reads), the gate logits z_k, z_q in fp32.
template <class S>
struct CudaTraceInputs {
  DeviceArray<S> q, k, v, z_o;
  DeviceArray<float> z_k, z_q;
  explicit CudaTraceInputs(const TraceInputs& in)
      : q(to_device_as<S>(in.q)),
        k(to_device_as<S>(in.k)),
        v(to_device_as<S>(in.v)),
        z_o(to_device_as<S>(in.z_o)),
        z_k(to_device_as<float>(in.z_k)),
        z_q(to_device_as<float>(in.z_q)) {}
  [[nodiscard]] const S* output_gate() const { return z_o.empty() ? nullptr : z_o.data(); }
};

// A CUDA cache whose step takes prefill chunks of the trace's length: UaCacheLimits sizes the step's
// workspace for max_prefill_chunk (128 unless the trace asks for more).
template <class S>
Status create_trace_cache(const cuda::Executor& /*exec*/, const ua::CacheShape& shape, const TraceSpec& s,
                          cuda::UaCache<S>& out) {
  cuda::UaCacheLimits limits;
  limits.max_prefill_chunk = std::max(limits.max_prefill_chunk, s.prefill_chunk);
  return cuda::UaCache<S>::create(shape, out, limits);
}

// The CUDA step checks its rows on the device and leaves a refusal in the cache until step_status
// reads it; a row whose slot lacks room is skipped while the others step on, and its slot flagged
// (UaCache::overflowed). Both are read after every step and returned as the call's Status -- the
// capacity refusal with the host's code, kOutOfRange -- so the player stops where the host would.
template <class S>
Status step_outcome(const cuda::Executor& exec, cuda::UaCache<S>& cache, std::span<const std::int32_t> slot,
                    std::int64_t capacity) {
  KVMEM_RETURN_IF_ERROR(cache.step_status(exec));
  std::vector<std::int32_t> overflowed;
  KVMEM_RETURN_IF_ERROR(cache.overflowed(exec, overflowed));
  for (std::size_t r = 0; r < slot.size(); ++r)
    if (slot[r] >= 0 && overflowed[std::size_t(slot[r])] != 0)
      return {StatusCode::kOutOfRange, "cache capacity: row " + std::to_string(r) + " (slot " +
                                           std::to_string(slot[r]) + ") has no room for its tokens in some kv head " +
                                           "(capacity " + std::to_string(capacity) +
                                           "); the CUDA step skipped the row and flagged the slot"};
  return Status::ok();
}
#endif

#if KVMEM_REPLAY_WITH_HOST_UA || (KVMEM_REPLAY_WITH_KOKKOS_UA && KVMEM_REPLAY_WITH_KOKKOS_SLOTS_UA) || \
    KVMEM_REPLAY_WITH_CUDA_UA
// How a backend's cache is made for the trace (create_trace_cache) and whether a step was refused after
// the call returned (step_outcome). Host and Kokkos: the cache's own create, and the call's Status says
// it all; the CUDA overloads above are the more specialised match for its cache.
template <class Exec, class Cache>
Status create_trace_cache(const Exec& /*exec*/, const ua::CacheShape& shape, const TraceSpec& /*s*/, Cache& out) {
  return Cache::create(shape, out);
}
template <class Exec, class Cache>
Status step_outcome(const Exec& /*exec*/, Cache& /*cache*/, std::span<const std::int32_t> /*slot*/,
                    std::int64_t /*capacity*/) {
  return Status::ok();
}

// One trace runner for every backend with UA's slot API: the cache type comes from the executor
// (ua::cache_t) and every call has the host's signature (docs/slots-ua.md). In holds the trace's
// inputs in the backend's memory (q, k, v, z_k, z_q and output_gate(), null without one; q, k, v and
// z_o in the element type the backend's step reads); the Transport (transport.hpp) moves a call's
// index lists and outputs.
template <class Exec, class S, class In, class Transport>
class UaSlotRunner final : public trace::SlotRunner {
  using Elem = std::remove_cvref_t<decltype(*std::declval<const In&>().q.data())>;

 public:
  UaSlotRunner(std::shared_ptr<const In> in, const TraceSpec& s, std::int64_t max_slots, Exec exec, const char* backend)
      : in_(std::move(in)), s_(s), exec_(std::move(exec)) {
    const Status status = create_trace_cache(exec_, {max_slots, s.H, s.G, s.D, s.capacity, 16}, s, cache_);
    if (!status.is_ok()) throw BadInput(std::string(backend) + " ua rejects the trace's config: " + status.message());
  }
  Status step(std::span<const std::int32_t> slot, std::span<const std::int32_t> query_start, std::int64_t first,
              std::span<float> out, std::span<float> lse) override {
    const std::int64_t n = query_start.back(), H = s_.H, G = s_.G, D = s_.D;
    const In& in = *in_;
    ua::PackedInputsOf<Elem> x;
    x.q = {in.q.data() + first * H * D, {n, H, D}};
    x.k = {in.k.data() + first * G * D, {n, G, D}};
    x.v = {in.v.data() + first * G * D, {n, G, D}};
    x.z_k = {in.z_k.data() + first * G, {n, G}};
    x.z_q = {in.z_q.data() + first * G, {n, G}};
    if (in.output_gate() != nullptr) x.z_o = {in.output_gate() + first * H * D, {n, H, D}};
    const auto d_slot = Transport::list(slot), d_start = Transport::list(query_start);
    auto d_out = Transport::output(out), d_lse = Transport::output(lse);
    const Status called = ua::step(exec_, cache_, Rows{Transport::view(d_slot), Transport::view(d_start)}, x,
                                   ua::Options{s_.p, s_.prefill_chunk, s_.evict_before_attention},
                                   TensorView<float, 3>(Transport::data(d_out), {n, H, D}),
                                   TensorView<float, 2>(Transport::data(d_lse), {n, H}));
    Transport::fence(exec_);
    const Status status = called.is_ok() ? step_outcome(exec_, cache_, slot, s_.capacity) : called;
    Transport::read_back(d_out, out);
    Transport::read_back(d_lse, lse);
    return status;
  }
  Status reset_slots(std::span<const std::int32_t> slots) override {
    const auto d = Transport::list(slots);
    return fenced(ua::reset_slots(exec_, cache_, Transport::view(d)));
  }
  Status copy_slots(std::span<const std::int32_t> src, std::span<const std::int32_t> dst) override {
    const auto a = Transport::list(src), b = Transport::list(dst);
    return fenced(ua::copy_slots(exec_, cache_, Transport::view(a), Transport::view(b)));
  }
  Status export_slot(std::int32_t slot, std::vector<std::byte>& record) override {
    Transport::fence(exec_);
    record.resize(ua::export_bytes(cache_, slot));
    return fenced(ua::export_slot(exec_, cache_, slot, std::span<std::byte>(record)));
  }
  Status import_slot(std::int32_t slot, std::span<const std::byte> record) override {
    return fenced(ua::import_slot(exec_, cache_, slot, record));
  }
  Status truncate(std::int32_t slot, std::int64_t tokens) override {
    return fenced(ua::truncate(exec_, cache_, slot, tokens));
  }

 private:
  Status fenced(Status status) const {
    Transport::fence(exec_);
    return status;
  }
  std::shared_ptr<const In> in_;
  TraceSpec s_;
  Exec exec_;
  ua::cache_t<Exec, S> cache_;
};
#endif

#if KVMEM_REPLAY_WITH_HOST_UA || (KVMEM_REPLAY_WITH_KOKKOS_UA && KVMEM_REPLAY_WITH_KOKKOS_SLOTS_UA)
// The factory of UaSlotRunner<Exec, S, In, Transport> for the run's storage precision.
template <class Exec, class Transport, class In>
std::function<std::unique_ptr<trace::SlotRunner>(std::int64_t)> make_runner(Precision precision,
                                                                            std::shared_ptr<const In> in,
                                                                            const TraceSpec& s, Exec exec,
                                                                            const char* backend) {
  if (precision == Precision::kBf16)
    return [=](std::int64_t slots) -> std::unique_ptr<trace::SlotRunner> {
      return std::make_unique<UaSlotRunner<Exec, bf16, In, Transport>>(in, s, slots, exec, backend);
    };
  return [=](std::int64_t slots) -> std::unique_ptr<trace::SlotRunner> {
    return std::make_unique<UaSlotRunner<Exec, float, In, Transport>>(in, s, slots, exec, backend);
  };
}
#endif

#if KVMEM_REPLAY_WITH_CUDA_UA
// The CUDA runner's factory for storage type S: the inputs go to the device once, q, k, v, z_o in S.
template <class S>
std::function<std::unique_ptr<trace::SlotRunner>(std::int64_t)> make_cuda_runner(const TraceInputs& in,
                                                                                 const TraceSpec& s) {
  using Runner = UaSlotRunner<cuda::Executor, S, CudaTraceInputs<S>, CudaTransport>;
  auto dev = std::make_shared<const CudaTraceInputs<S>>(in);
  // The legacy default stream: CudaTransport's blocking copies are ordered with its work.
  const cuda::Executor exec{};
  return [=](std::int64_t slots) -> std::unique_ptr<trace::SlotRunner> {
    return std::make_unique<Runner>(dev, s, slots, exec, "cuda");
  };
}
#endif

// The trace player's view of UA on the chosen backend (see kvm_adapter::trace_mechanism).
inline trace::Mechanism trace_mechanism(const Options& opt, const Case& c, const trace::Trace& t) {
  const TraceSpec s = parse_trace_config(t);
  auto in = std::make_shared<const TraceInputs>(load_trace_inputs(c, s, t.tokens));
  trace::Mechanism m;
  m.label = std::string("ua/") + to_string(opt.backend);
  m.out_width = s.H * s.D;
  m.lse_width = s.H;
  m.out_shape_tail = {s.H, s.D};
  m.lse_shape_tail = {s.H};
  if (opt.backend == Backend::kHost) {
#if KVMEM_REPLAY_WITH_HOST_UA
    const host::Executor exec{.threads = opt.threads, .exact = true};
    m.make_runner = make_runner<host::Executor, HostTransport>(opt.precision, in, s, exec, "host");
    return m;
#endif
  }
#if KVMEM_REPLAY_WITH_KOKKOS_UA && KVMEM_REPLAY_WITH_KOKKOS_SLOTS_UA
  if (opt.backend == Backend::kKokkos) {
    if (opt.threads > 0)
      std::fprintf(stderr, "kvmem-replay: --threads does not apply to the kokkos backend (see KOKKOS_NUM_THREADS)\n");
    m.keep_alive = std::make_shared<Kokkos::ScopeGuard>();  // Kokkos lives as long as the runners
    auto dev = std::make_shared<const KokkosTraceInputs>(*in);
    const kokkos_detail::Exec exec{kokkos_detail::Space(), /*checked*/ true};  // bad input comes back as a Status
    m.make_runner = make_runner<kokkos_detail::Exec, KokkosTransport>(opt.precision, dev, s, exec, "kokkos");
    return m;
  }
#endif
#if KVMEM_REPLAY_WITH_CUDA_UA
  if (opt.backend == Backend::kCuda) {
    if (opt.threads > 0) std::fprintf(stderr, "kvmem-replay: --threads does not apply to the cuda backend\n");
    require_cuda_device();
    m.check_tolerance = trace::kCudaCheckTolerance;
    m.make_runner =
        opt.precision == Precision::kBf16 ? make_cuda_runner<bf16>(*in, s) : make_cuda_runner<float>(*in, s);
    return m;
  }
#endif
  throw BadInput(trace::trace_unavailable(opt.backend, "ua", KVMEM_REPLAY_WITH_HOST_UA != 0));
}

inline std::string skip_reason(const std::string& name, const Case& /*c*/, Backend backend) {
  if (name.rfind("d_", 0) == 0)
    return std::string("gradient: backend ") + to_string(backend) + " implements no UA backward";
  if (name.rfind("out_pruned_", 0) == 0 || name.rfind("kept_", 0) == 0) return "threshold not in config 'thresholds'";
  return "";
}

inline void run(const Options& opt, const Case& c, Outputs& outputs) {
  const Spec spec = parse_config(c.config);
  const Inputs inputs = load_inputs(c, spec);
  const std::string unavailable = unavailable_reason(
      opt.backend, "ua",
      {KVMEM_REPLAY_WITH_REFERENCE_UA != 0, KVMEM_REPLAY_WITH_HOST_UA != 0, KVMEM_REPLAY_WITH_KOKKOS_UA != 0,
       KVMEM_REPLAY_WITH_CUDA_UA != 0, "include/kvmem/reference/ua.hpp", "include/kvmem/backend/host/ua.hpp"});
  if (!unavailable.empty()) throw BadInput(unavailable);
#if KVMEM_REPLAY_WITH_CUDA_UA
  if (opt.backend == Backend::kCuda) require_cuda_device();  // before any note: one line without a GPU
#endif

  Progress progress(!opt.quiet, std::string("ua/") + to_string(opt.backend));
  if (c.file.has("dout"))
    progress.note(std::string("'dout' present, but backend ") + to_string(opt.backend) +
                  " implements no UA backward: gradients are not computed");
  Results results;
  if (opt.backend == Backend::kReference) {
#if KVMEM_REPLAY_WITH_REFERENCE_UA
    results = run_reference(spec, inputs, progress);
#endif
  } else if (opt.backend == Backend::kHost) {
#if KVMEM_REPLAY_WITH_HOST_UA
    results = run_host(spec, inputs, opt, progress);
#endif
  } else if (opt.backend == Backend::kKokkos) {
#if KVMEM_REPLAY_WITH_KOKKOS_UA
    results = run_kokkos(spec, inputs, opt, progress);
#endif
  } else if (opt.backend == Backend::kCuda) {
#if KVMEM_REPLAY_WITH_CUDA_UA
    results = run_cuda(spec, inputs, opt, progress);
#endif
  }
  emit(spec, std::move(results), outputs);
}

}  // namespace kvmem::replay::ua_adapter
