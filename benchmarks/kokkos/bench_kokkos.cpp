// SPDX-License-Identifier: Apache-2.0
// The Kokkos backend on the default execution space (Cuda, OpenMP or Serial, as Kokkos was built):
// KVM fixed-256 prefill (kvm::prefill) and per-token decode (kvm::decode), and dense UA prefill
// (ua::prefill with p = 0 in chunks of 128 on a cache; also the cacheless ua::forward), fp32: the calls and shapes that
// the native benchmarks time with fp32 storage, so one script puts the rows side by side:
//   kvmem_bench_kvm_cuda --storage fp32 --batch 1 --heads 8 --tokens 32768 --budget fixed-256 --b1 0
//   kvmem_bench_ua_cuda --storage fp32 --batch 1 --heads 16 --kv-heads 4 --tokens 8192 (the dense row)
//   kvmem_bench_kvm_cpu --min-T 32768 --max-T 32768 --budget fixed --no-dense
//   kvmem_bench_ua_cpu --B 1 --H 16 --G 4 --D 128 --T 8192 --p 0 --chunk 128 --no-decode --no-anchor
// Inputs are generated on the device (a hash per element): unit-scale q, k, v, gates in (0.5, 1.5).
// Calls run unchecked (Executor::checked = false: no host read-back) and the time of a call is from
// its launch to the fence after it. Prefill: one warm-up call, then the minimum over --repeat calls
// (ms). Decode: --decode-steps consecutive tokens after the prefill, the first of which runs the state
// update (T is a multiple of C = 256), as the native benchmark's 256 steps (ms/token).
//
//   kvmem_bench_kokkos [--batch 1] [--heads 8] [--kv-heads 8] [--tokens 32768] [--decode-steps 256]
//                      [--ua-batch 1] [--ua-heads 16] [--ua-kv-heads 4] [--ua-tokens 8192]
//                      [--team-size 0] [--repeat 3] [--only kvm|ua] [--json out.jsonl]
// Kokkos's own options (e.g. --kokkos-num-threads=16, --kokkos-device-id=0) pass through.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include <Kokkos_Core.hpp>

#include "kvmem/backend/kokkos.hpp"

namespace {

using Space = Kokkos::DefaultExecutionSpace;
using Mem = Space::memory_space;
using View1 = Kokkos::View<float*, Kokkos::LayoutRight, Mem>;
using View3 = Kokkos::View<float***, Kokkos::LayoutRight, Mem>;
using View4 = Kokkos::View<float****, Kokkos::LayoutRight, Mem>;
using Clock = std::chrono::steady_clock;
using kvmem::TensorView;
using kvmem::kokkos::to_tensor_view;

struct Options {
  std::int64_t batch = 1, heads = 8, kv_heads = 8, D = 128, decode_steps = 256;
  std::vector<std::int64_t> tokens{32768};
  std::int64_t ua_batch = 1, ua_heads = 16, ua_kv_heads = 4;
  std::vector<std::int64_t> ua_tokens{8192};
  int team_size = 0, repeat = 3;
  std::string only, json;
};

std::vector<std::int64_t> parse_list(const char* s) {
  std::vector<std::int64_t> out;
  for (const char* p = s; *p != '\0';) {
    char* end = nullptr;
    out.push_back(std::strtoll(p, &end, 10));
    p = *end == ',' ? end + 1 : end;
    if (end == p && *p != '\0') break;
  }
  return out;
}

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i];
    const char* v = argv[i + 1];
    if (a == "--batch")
      o.batch = std::atoll(v);
    else if (a == "--heads")
      o.heads = std::atoll(v);
    else if (a == "--kv-heads")
      o.kv_heads = std::atoll(v);
    else if (a == "--tokens")
      o.tokens = parse_list(v);
    else if (a == "--decode-steps")
      o.decode_steps = std::atoll(v);
    else if (a == "--ua-batch")
      o.ua_batch = std::atoll(v);
    else if (a == "--ua-heads")
      o.ua_heads = std::atoll(v);
    else if (a == "--ua-kv-heads")
      o.ua_kv_heads = std::atoll(v);
    else if (a == "--ua-tokens")
      o.ua_tokens = parse_list(v);
    else if (a == "--team-size")
      o.team_size = std::atoi(v);
    else if (a == "--repeat")
      o.repeat = std::max(1, std::atoi(v));
    else if (a == "--only")
      o.only = v;
    else if (a == "--json")
      o.json = v;
    else if (a.rfind("--kokkos", 0) == 0)
      --i;  // Kokkos's own --kokkos-x=y options take no separate value
    else
      std::fprintf(stderr, "kvmem_bench_kokkos: ignoring unknown option %s\n", a.c_str());
  }
  return o;
}

// A deterministic value in [lo, hi) per (seed, index), generated where the view lives.
void fill(const View1& flat, std::uint64_t seed, float lo, float hi) {
  const float span = hi - lo;
  Kokkos::parallel_for(
      "kvmem::bench::fill", Kokkos::RangePolicy<Space>(0, std::int64_t(flat.extent(0))),
      KOKKOS_LAMBDA(const std::int64_t i) {
        std::uint64_t x = (std::uint64_t(i) + 1) * 0x9E3779B97F4A7C15ull ^ seed;
        x ^= x >> 31;
        x *= 0xBF58476D1CE4E5B9ull;
        x ^= x >> 29;
        flat(i) = lo + span * float(x >> 40) / float(1 << 24);
      });
}
template <class View, class... Extent>
View filled(const char* label, std::uint64_t seed, float lo, float hi, Extent... extents) {
  const std::string name(label);
  View v(name, std::size_t(extents)...);
  fill(View1(v.data(), v.span()), seed, lo, hi);
  return v;
}

// The minimum over `repeat` timed calls of run() after `warm_up` untimed ones; setup() runs before each,
// untimed. Both return a kvmem::Status; the first failure ends the measurement and is returned. (Statuses
// are initialised, never assigned: nvcc warns about the discarded Status& of an assignment, Status being
// [[nodiscard]].)
struct Timing {
  double seconds;
  kvmem::Status status;
};
template <class Setup, class F>
Timing best_seconds(int warm_up, int repeat, Setup&& setup, F&& run) {
  double best = std::numeric_limits<double>::infinity();
  for (int r = 0; r < warm_up + repeat; ++r) {
    if (kvmem::Status s = setup(); !s.is_ok()) return {best, std::move(s)};
    Kokkos::fence();
    const auto t0 = Clock::now();
    kvmem::Status s = run();
    Kokkos::fence();
    if (!s.is_ok()) return {best, std::move(s)};
    if (r >= warm_up) best = std::min(best, std::chrono::duration<double>(Clock::now() - t0).count());
  }
  return {best, kvmem::Status::ok()};
}

void report(FILE* json, const std::string& row, const char* mech, const char* op, std::int64_t B, std::int64_t H,
            std::int64_t G, std::int64_t T, double ms) {
  std::printf("| %-28s | %6lld | %3lld | %3lld | %6lld | %10.3f |\n", row.c_str(), (long long)B, (long long)H,
              (long long)G, (long long)T, ms);
  if (json != nullptr)
    std::fprintf(
        json,
        "{\"backend\": \"kokkos-%s\", \"mechanism\": \"%s\", \"op\": \"%s\", \"batch\": %lld, \"heads\": "
        "%lld, \"kv_heads\": %lld, \"tokens\": %lld, \"head_dim\": 128, \"storage\": \"fp32\", \"ms\": %.6f}\n",
        Space::name(), mech, op, (long long)B, (long long)H, (long long)G, (long long)T, ms);
}

bool run_kvm(const Options& o, FILE* json) {
  const kvmem::kokkos::Executor<Space> exec{Space(), /*checked*/ false, o.team_size};
  const std::int64_t B = o.batch, Hq = o.heads, Hk = o.kv_heads, D = o.D;
  View1 ln_w("ln_w", D), ln_b("ln_b", D), tau("tau", Hq);
  Kokkos::deep_copy(ln_w, 1.0f);
  Kokkos::deep_copy(tau, 1.0f);
  const kvmem::kvm::Weights weights{
      TensorView<const float, 1>(to_tensor_view(ln_w)), TensorView<const float, 1>(to_tensor_view(ln_b)),
      TensorView<const float, 1>(to_tensor_view(tau)), TensorView<const float, 1>(to_tensor_view(tau))};
  kvmem::kvm::Params params;  // C = 256, nb = 2, sink 1, r = 64, fixed-256 (the paper's defaults)
  params.budget = kvmem::budget::Fixed{256, 256};
  for (const std::int64_t T : o.tokens) {
    const auto q = filled<View4>("q", 1, -1.f, 1.f, B, Hq, T, D), k = filled<View4>("k", 2, -1.f, 1.f, B, Hk, T, D),
               v = filled<View4>("v", 3, -1.f, 1.f, B, Hk, T, D);
    const auto g = filled<View3>("gate", 4, 0.5f, 1.5f, B, Hk, T);
    const auto qd = filled<View4>("q1", 5, -1.f, 1.f, B, Hq, 1, D), kd = filled<View4>("k1", 6, -1.f, 1.f, B, Hk, 1, D),
               vd = filled<View4>("v1", 7, -1.f, 1.f, B, Hk, 1, D);
    const auto gd = filled<View3>("gate1", 8, 0.5f, 1.5f, B, Hk, 1);
    View4 out("out", B, T, Hq, D), out1("out1", B, 1, Hq, D);
    kvmem::kokkos::KvmState<float, float, kvmem::kokkos::state_memory_space<Space>> st;
    const kvmem::kvm::Shape shape{B, Hq, Hk, D, D, T + o.decode_steps};
    if (const auto s = kvmem::kokkos::create_state<float, float>(exec, params, shape, st); !s.is_ok()) {
      std::fprintf(stderr, "create_state: %s\n", s.to_string().c_str());
      return false;
    }
    const Timing prefill = best_seconds(
        1, o.repeat,
        [&] {
          st.state.reset();
          return kvmem::Status::ok();
        },
        [&] {
          return kvmem::kvm::prefill(exec, st.state, weights, TensorView<const float, 4>(to_tensor_view(q)),
                                     TensorView<const float, 4>(to_tensor_view(k)),
                                     TensorView<const float, 4>(to_tensor_view(v)),
                                     TensorView<const float, 3>(to_tensor_view(g)), to_tensor_view(out));
        });
    if (!prefill.status.is_ok()) {
      std::fprintf(stderr, "kvm prefill: %s\n", prefill.status.to_string().c_str());
      return false;
    }
    report(json, "kvm fixed-256 prefill (ms)", "kvm", "prefill", B, Hq, Hk, T, 1e3 * prefill.seconds);
    if (o.decode_steps <= 0) continue;
    // Decode continues the prefilled state one token per call; the steps include one state update
    // every C tokens, as an engine's decode loop sees them.
    const Timing decode = best_seconds(
        0, 1, [] { return kvmem::Status::ok(); },
        [&] {
          for (std::int64_t s = 0; s < o.decode_steps; ++s)
            if (kvmem::Status step = kvmem::kvm::decode(
                    exec, st.state, weights, TensorView<const float, 4>(to_tensor_view(qd)),
                    TensorView<const float, 4>(to_tensor_view(kd)), TensorView<const float, 4>(to_tensor_view(vd)),
                    TensorView<const float, 3>(to_tensor_view(gd)), to_tensor_view(out1));
                !step.is_ok())
              return step;
          return kvmem::Status::ok();
        });
    if (!decode.status.is_ok()) {
      std::fprintf(stderr, "kvm decode: %s\n", decode.status.to_string().c_str());
      return false;
    }
    report(json, "kvm fixed-256 decode (ms/tok)", "kvm", "decode", B, Hq, Hk, T,
           1e3 * decode.seconds / double(o.decode_steps));
  }
  return true;
}

bool run_ua(const Options& o, FILE* json) {
  const kvmem::kokkos::Executor<Space> exec{Space(), /*checked*/ false, o.team_size};
  const std::int64_t B = o.ua_batch, H = o.ua_heads, G = o.ua_kv_heads, D = o.D;
  for (const std::int64_t T : o.ua_tokens) {
    const auto q = filled<View4>("q", 11, -2.f, 2.f, B, H, T, D), k = filled<View4>("k", 12, -0.1f, 0.1f, B, G, T, D),
               v = filled<View4>("v", 13, -1.f, 1.f, B, G, T, D);
    const auto z_k = filled<View3>("z_k", 14, -0.5f, 2.5f, B, G, T),
               z_q = filled<View3>("z_q", 15, -0.5f, 2.5f, B, G, T);
    View4 out("out", B, T, H, D);
    kvmem::kokkos::UaCache<float, Mem> cache;
    const kvmem::ua::Options opt{0.0, 128, true};  // dense: nothing evicted; the native benchmark's chunk
    kvmem::ua::Inputs in;
    in.q = TensorView<const float, 4>(to_tensor_view(q));
    in.k = TensorView<const float, 4>(to_tensor_view(k));
    in.v = TensorView<const float, 4>(to_tensor_view(v));
    in.z_k = TensorView<const float, 3>(to_tensor_view(z_k));
    in.z_q = TensorView<const float, 3>(to_tensor_view(z_q));
    const Timing prefill = best_seconds(
        1, o.repeat,
        [&] {
          cache = {};
          return kvmem::kokkos::create_cache<float>(exec, kvmem::ua::CacheShape{B, H, G, D, T, 16}, cache);
        },
        [&] { return kvmem::ua::prefill(exec, cache, in, opt, to_tensor_view(out)); });
    if (!prefill.status.is_ok()) {
      std::fprintf(stderr, "ua prefill: %s\n", prefill.status.to_string().c_str());
      return false;
    }
    report(json, "ua dense prefill (ms)", "ua", "dense_prefill", B, H, G, T, 1e3 * prefill.seconds);
    // The cacheless dense call (ua::forward) at the same shape, for reference.
    const Timing forward = best_seconds(
        1, o.repeat, [] { return kvmem::Status::ok(); },
        [&] { return kvmem::ua::forward(exec, in, to_tensor_view(out)); });
    if (!forward.status.is_ok()) {
      std::fprintf(stderr, "ua forward: %s\n", forward.status.to_string().c_str());
      return false;
    }
    report(json, "ua dense forward (ms)", "ua", "dense_forward", B, H, G, T, 1e3 * forward.seconds);
  }
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  Kokkos::ScopeGuard kokkos(argc, argv);
  const Options o = parse(argc, argv);
  std::printf("kvmem Kokkos backend on %s (concurrency %d), fp32, D = %lld\n\n", Space::name(),
              int(Space().concurrency()), (long long)o.D);
  std::printf("| %-28s | %6s | %3s | %3s | %6s | %10s |\n|---|---|---|---|---|---|\n", "operation", "batch", "H", "G",
              "tokens", "time");
  FILE* json = o.json.empty() ? nullptr : std::fopen(o.json.c_str(), "w");
  bool ok = true;
  if (o.only.empty() || o.only == "kvm") ok = run_kvm(o, json) && ok;
  if (o.only.empty() || o.only == "ua") ok = run_ua(o, json) && ok;
  if (json != nullptr) std::fclose(json);
  return ok ? 0 : 1;
}
