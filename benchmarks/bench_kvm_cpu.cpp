// SPDX-License-Identifier: Apache-2.0
// KVM on the CPU (host backend): prefill and per-token decode against dense causal attention run
// by the same backend (same attend-row body and tiling, backend/host/kvm_dense.hpp).
// Shape: B = 1, Hq = Hk = 8, D = Dv = 128, C = 256, nb = 2, r = 64; budgets fixed-256
// and 16 sqrt(N). Prints a markdown table: time, state bytes vs full-KV bytes, ratios, and for the
// dense rows the achieved GFLOP/s (prefill) and GB/s (decode) against the machine's peaks measured in
// the same run (an FMA loop and a stream copy on the same threads): a roofline column.
// Dense prefill runs the host backend's fast path (Eigen tiles when built with Eigen) unless --exact.
// Times are the minimum over --repeat runs; "cpu s" is the process CPU time of that run, which on a
// machine shared with other work says how much of the wall time the benchmark actually ran.
//
//   kvmem_bench_kvm_cpu [--min-T 4096] [--max-T 32768] [--threads 0] [--decode-steps 256]
//                       [--budget fixed|sqrt|both|none] [--bf16] [--no-dense] [--exact] [--repeat 1]
//                       [--flush | --flush-dirty]
// --flush evicts the caches before every KVM decode step (outside the timed region) by reading a buffer
// larger than the last-level cache, as an engine sees it when other layers (their weights and states,
// read, not written) ran in between. --flush-dirty writes that buffer instead, so every line the step
// reads first forces a write-back of a dirty line: the worst case, about twice the memory traffic.
#include <sys/resource.h>
#include <time.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "kvmem/backend/host/kvm.hpp"
#include "kvmem/backend/host/kvm_dense.hpp"
#include "kvmem/kvm/attention.hpp"

namespace {
using Clock = std::chrono::steady_clock;
using kvmem::TensorView;
namespace kvm = kvmem::kvm;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

double cpu_seconds() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return double(u.ru_utime.tv_sec + u.ru_stime.tv_sec) + 1e-6 * double(u.ru_utime.tv_usec + u.ru_stime.tv_usec);
}

double thread_cpu_seconds() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return double(ts.tv_sec) + 1e-9 * double(ts.tv_nsec);
}

// Peak fp32 FMA rate of the executor's threads: each thread updates 128 independent accumulators
// (enough chains to cover FMA latency on every vector unit) with x = x * m + c. What the compiler
// makes of a simple loop at the build's instruction set, i.e. the roof reachable from C++. Rates are
// per thread CPU second times the thread count: the peak of an idle machine, also on a shared one.
double measure_fma_gflops(const kvmem::host::Executor& exec, int threads) {
  constexpr int kLanes = 128;
  const std::int64_t iters = 2000000;
  std::vector<float> sink(std::size_t(threads), 0.f);
  std::vector<double> cpu(static_cast<std::size_t>(threads));
  double best = 0;
  for (int trial = 0; trial < 3; ++trial) {
    kvmem::host::parallel_for(exec, threads, [&](std::int64_t w) {
      const double c0 = thread_cpu_seconds();
      float x[kLanes];
      for (int l = 0; l < kLanes; ++l) x[l] = 1.0f + 1e-3f * float(l + w);
      const float m = 0.999999f, c = 1e-7f;
      for (std::int64_t it = 0; it < iters; ++it)
        for (int l = 0; l < kLanes; ++l) x[l] = x[l] * m + c;
      float s = 0;
      for (int l = 0; l < kLanes; ++l) s += x[l];
      sink[std::size_t(w)] = s;
      cpu[std::size_t(w)] = thread_cpu_seconds() - c0;
    });
    const double slowest = *std::max_element(cpu.begin(), cpu.end());
    best = std::max(best, 2.0 * kLanes * double(iters) * threads / slowest * 1e-9);
  }
  return sink[0] == 12345.f ? 0 : best;  // keeps the loop alive
}

// Stream copy bandwidth (read + write bytes) of the executor's threads over 2 x 128 MiB.
double measure_copy_gbs(const kvmem::host::Executor& exec, int threads) {
  const std::size_t n = std::size_t(32) << 20;  // floats
  std::vector<float> a(n, 1.0f), b(n, 0.0f);
  std::vector<double> cpu(static_cast<std::size_t>(threads));
  double best = 0;
  for (int trial = 0; trial < 3; ++trial) {
    kvmem::host::parallel_for(exec, threads, [&](std::int64_t w) {
      const double c0 = thread_cpu_seconds();
      const std::size_t lo = n * std::size_t(w) / std::size_t(threads),
                        hi = n * std::size_t(w + 1) / std::size_t(threads);
      std::copy(a.begin() + std::ptrdiff_t(lo), a.begin() + std::ptrdiff_t(hi), b.begin() + std::ptrdiff_t(lo));
      cpu[std::size_t(w)] = thread_cpu_seconds() - c0;
    });
    const double slowest = *std::max_element(cpu.begin(), cpu.end());
    best = std::max(best, 2.0 * double(n) * sizeof(float) / slowest * 1e-9);
  }
  return b[n / 2] == 1.0f ? best : 0;
}

struct Options {
  std::int64_t min_t = 4096, max_t = 32768, decode_steps = 256;  // 256 = one chunk: includes its one update
  int threads = 0;
  std::string budget = "both";
  bool bf16 = false, dense = true, exact = false;
  int flush = 0;  // 0: warm caches, 1: evicted by reads, 2: evicted by writes (dirty)
  int repeat = 1;
};

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const auto next = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "%s needs a value\n", a.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--min-T")
      o.min_t = std::stoll(next());
    else if (a == "--max-T")
      o.max_t = std::stoll(next());
    else if (a == "--threads")
      o.threads = std::stoi(next());
    else if (a == "--decode-steps")
      o.decode_steps = std::stoll(next());
    else if (a == "--budget")
      o.budget = next();
    else if (a == "--bf16")
      o.bf16 = true;
    else if (a == "--no-dense")
      o.dense = false;
    else if (a == "--exact")
      o.exact = true;
    else if (a == "--flush")
      o.flush = 1;
    else if (a == "--flush-dirty")
      o.flush = 2;
    else if (a == "--repeat")
      o.repeat = std::max(1, std::stoi(next()));
    else {
      std::fprintf(stderr,
                   "usage: %s [--min-T N] [--max-T N] [--threads N] [--decode-steps N] [--budget fixed|sqrt|both|none] "
                   "[--bf16] [--no-dense] [--exact] [--repeat N] [--flush | --flush-dirty]\n",
                   argv[0]);
      std::exit(a == "--help" ? 0 : 2);
    }
  }
  return o;
}

struct Problem {
  std::int64_t B = 1, H = 8, D = 128, Dv = 128, T = 0, steps = 0;
  std::vector<float> q, k, v, g;  // [B,H,T+steps,*]
  std::vector<float> lnw, lnb, tau_s, tau_w;
  Problem(std::int64_t tokens, std::int64_t decode_steps) : T(tokens), steps(decode_steps) {
    std::mt19937 rng(1234);
    std::normal_distribution<float> n01(0.f, 1.f);
    const std::int64_t N = T + steps;
    q.resize(std::size_t(B * H * N * D));
    k.resize(q.size());
    v.resize(std::size_t(B * H * N * Dv));
    g.resize(std::size_t(B * H * N));
    for (auto* x : {&q, &k, &v})
      for (auto& e : *x) e = n01(rng);
    for (auto& e : g) e = 1.f + std::abs(n01(rng));
    lnw.assign(std::size_t(D), 1.f);
    lnb.assign(std::size_t(D), 0.f);
    tau_s.assign(std::size_t(H), 1.f);
    tau_w.assign(std::size_t(H), 1.f);
  }
  kvm::Weights weights() const {
    return {{lnw.data(), {D}}, {lnb.data(), {D}}, {tau_s.data(), {H}}, {tau_w.data(), {H}}};
  }
  // Rows [t0, t0+n) of a [B,H,N,width] tensor, copied contiguous.
  std::vector<float> rows(const std::vector<float>& x, std::int64_t width, std::int64_t t0, std::int64_t n) const {
    std::vector<float> y;
    y.reserve(std::size_t(B * H * n * width));
    const std::int64_t N = T + steps;
    for (std::int64_t r = 0; r < B * H; ++r)
      y.insert(y.end(), x.begin() + (r * N + t0) * width, x.begin() + (r * N + t0 + n) * width);
    return y;
  }
};

struct KvmTiming {
  double prefill_s = 0, prefill_cpu_s = 0, decode_s = 0;
  std::size_t state_bytes = 0;
  std::int64_t slots = 0;
};

volatile char flush_sink = 0;  // a volatile store keeps the cache flush's reads

template <class S>
KvmTiming run_kvm(const Problem& p, kvmem::budget::Any budget, int threads, int flush) {
  kvm::Params params;
  params.chunk = 256;
  params.window_chunks = 2;
  params.sink = 1;
  params.rope_dims = 64;
  params.budget = budget;
  const kvm::Shape shape{p.B, p.H, p.H, p.D, p.Dv, p.T + p.steps};
  kvm::State<S, float> st;
  kvmem::throw_if_error(kvm::State<S, float>::create(params, shape, st));
  const kvmem::host::Executor exec{threads};
  const auto q = p.rows(p.q, p.D, 0, p.T), k = p.rows(p.k, p.D, 0, p.T), v = p.rows(p.v, p.Dv, 0, p.T),
             g = p.rows(p.g, 1, 0, p.T);
  std::vector<float> out(std::size_t(p.B * p.T * p.H * p.Dv));
  KvmTiming r;
  const double c0 = cpu_seconds();
  auto t0 = Clock::now();
  kvmem::throw_if_error(kvm::prefill(exec, st, p.weights(), TensorView<const float, 4>(q.data(), {p.B, p.H, p.T, p.D}),
                                     TensorView<const float, 4>(k.data(), {p.B, p.H, p.T, p.D}),
                                     TensorView<const float, 4>(v.data(), {p.B, p.H, p.T, p.Dv}),
                                     TensorView<const float, 3>(g.data(), {p.B, p.H, p.T}),
                                     TensorView<float, 4>(out.data(), {p.B, p.T, p.H, p.Dv})));
  r.prefill_s = seconds_since(t0);
  r.prefill_cpu_s = cpu_seconds() - c0;
  r.state_bytes = st.cache_bytes(0);
  r.slots = st.slots(0);
  std::vector<std::vector<float>> dq, dk, dv, dg;
  for (std::int64_t s = 0; s < p.steps; ++s) {
    dq.push_back(p.rows(p.q, p.D, p.T + s, 1));
    dk.push_back(p.rows(p.k, p.D, p.T + s, 1));
    dv.push_back(p.rows(p.v, p.Dv, p.T + s, 1));
    dg.push_back(p.rows(p.g, 1, p.T + s, 1));
  }
  std::vector<float> o1(std::size_t(p.B * p.H * p.Dv));
  std::vector<char> evict(flush ? std::size_t(256) << 20 : 0, 1);  // larger than any last-level cache
  double timed = 0;
  for (std::int64_t s = 0; s < p.steps; ++s) {
    // Untimed: touch a buffer larger than the caches so the step reads its state from memory. The
    // executor's threads do it, as the other layers' work of an engine would run on them.
    if (flush != 0) {
      const std::int64_t parts = exec.resolved_threads();
      kvmem::host::parallel_for(exec, parts, [&](std::int64_t i) {
        const std::size_t lo = evict.size() * std::size_t(i) / std::size_t(parts),
                          hi = evict.size() * std::size_t(i + 1) / std::size_t(parts);
        char x = 0;
        for (std::size_t at = lo; at < hi; at += 64) {
          if (flush == 1)
            x = char(x ^ evict[at]);
          else
            evict[at] = char(evict[at] + 1);
        }
        flush_sink = x;
      });
    }
    t0 = Clock::now();
    kvmem::throw_if_error(kvm::decode(exec, st, p.weights(),
                                      TensorView<const float, 4>(dq[std::size_t(s)].data(), {p.B, p.H, 1, p.D}),
                                      TensorView<const float, 4>(dk[std::size_t(s)].data(), {p.B, p.H, 1, p.D}),
                                      TensorView<const float, 4>(dv[std::size_t(s)].data(), {p.B, p.H, 1, p.Dv}),
                                      TensorView<const float, 3>(dg[std::size_t(s)].data(), {p.B, p.H, 1}),
                                      TensorView<float, 4>(o1.data(), {p.B, 1, p.H, p.Dv})));
    timed += seconds_since(t0);
  }
  r.decode_s = p.steps > 0 ? timed / double(p.steps) : 0;
  return r;
}

struct DenseTiming {
  double prefill_s = 0, prefill_cpu_s = 0, decode_s = 0;
};

// Dense anchor: causal prefill over T, and per-token decode of one query over a full KV cache of
// T + s keys (the same attend-row body as KVM's readout).
DenseTiming run_dense(const Problem& p, int threads, bool exact, int repeat) {
  kvmem::host::Executor exec{threads};
  exec.exact = exact;
  const auto q = p.rows(p.q, p.D, 0, p.T), k = p.rows(p.k, p.D, 0, p.T + p.steps),
             v = p.rows(p.v, p.Dv, 0, p.T + p.steps);
  const std::int64_t N = p.T + p.steps;
  std::vector<float> out(std::size_t(p.B * p.T * p.H * p.Dv));
  const float scale = 1.0f / std::sqrt(float(p.D));
  DenseTiming r;
  // q/k/v for the prefill view only the first T rows: k, v are laid out [B,H,N,*], so take strides.
  const auto kT = p.rows(p.k, p.D, 0, p.T), vT = p.rows(p.v, p.Dv, 0, p.T);
  r.prefill_s = 1e300;
  for (int rep = 0; rep < repeat; ++rep) {
    const double c0 = cpu_seconds();
    const auto w0 = Clock::now();
    kvmem::host::dense_causal_attention<float>(exec, TensorView<const float, 4>(q.data(), {p.B, p.H, p.T, p.D}),
                                               TensorView<const float, 4>(kT.data(), {p.B, p.H, p.T, p.D}),
                                               TensorView<const float, 4>(vT.data(), {p.B, p.H, p.T, p.Dv}),
                                               TensorView<float, 4>(out.data(), {p.B, p.T, p.H, p.Dv}), scale);
    const double wall = seconds_since(w0);
    if (wall < r.prefill_s) {
      r.prefill_s = wall;
      r.prefill_cpu_s = cpu_seconds() - c0;
    }
  }
  auto t0 = Clock::now();
  std::vector<float> acc(std::size_t(p.H * p.Dv)), o(std::size_t(p.H * p.Dv)), qrow(std::size_t(p.H * p.D));
  t0 = Clock::now();
  for (std::int64_t s = 0; s < p.steps; ++s) {
    const std::int64_t n = p.T + s + 1;  // keys [0, T + s]
    kvmem::host::parallel_for(exec, p.B * p.H, [&](std::int64_t h) {
      const float* qs = p.q.data() + (h * N + p.T + s) * p.D;
      std::copy(qs, qs + p.D, qrow.begin() + h * p.D);
      kvmem::OnlineSoftmax<float> sm;
      std::fill(acc.begin() + h * p.Dv, acc.begin() + (h + 1) * p.Dv, 0.f);
      kvmem::kernel::attend_accumulate(sm, acc.data() + h * p.Dv, qrow.data() + h * p.D, p.D, scale,
                                       k.data() + h * N * p.D, p.D, v.data() + h * N * p.Dv, p.Dv, p.Dv, n);
      kvmem::kernel::attend_finish(sm, acc.data() + h * p.Dv, p.Dv, o.data() + h * p.Dv);
    });
  }
  r.decode_s = p.steps > 0 ? seconds_since(t0) / double(p.steps) : 0;
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  const Options o = parse(argc, argv);
  const kvmem::host::Executor exec0{o.threads};
  const int threads = exec0.resolved_threads();
  const double peak_gflops = measure_fma_gflops(exec0, threads), peak_gbs = measure_copy_gbs(exec0, threads);
  std::printf(
      "KVM CPU benchmark (host backend, %d threads): B=1, Hq=Hk=8, D=Dv=128, C=256, nb=2, r=64, "
      "fp32 inputs, decode = mean of %lld steps after the prefill (256 = one chunk, so one state update is amortised "
      "as in steady state)\n",
      threads, static_cast<long long>(o.decode_steps));
  std::printf("KVM decode: caches %s before each step\n",
              o.flush == 1   ? "evicted by reading 256 MiB (clean)"
              : o.flush == 2 ? "evicted by writing 256 MiB (dirty: each line read forces a write-back)"
                             : "warm (not evicted)");
  std::printf("dense prefill path: %s; times: min of %d runs\n",
              o.exact ? "exact (scalar rows)" : "fast (Eigen tiles if built with Eigen)", o.repeat);
  std::printf("measured peaks on these %d threads: FMA loop %.1f GFLOP/s, stream copy %.1f GB/s\n\n", threads,
              peak_gflops, peak_gbs);
  std::printf(
      "| T | variant | storage | slots | prefill s | cpu s | decode ms/token | state MiB | full-KV MiB | "
      "bytes full/state | prefill dense/kvm | decode dense/kvm | prefill GFLOP/s: wall, CPU (%% peak) | decode GB/s "
      "(%% peak) |\n");
  std::printf("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
  for (std::int64_t T = 4096; T <= o.max_t; T *= 2) {
    if (T < o.min_t) continue;
    const Problem p(T, o.decode_steps);
    const double full_mib = double(T * p.H * (p.D + p.Dv) * 4) / (1024.0 * 1024.0);  // fp32 K and V
    DenseTiming dense{};
    if (o.dense) {
      dense = run_dense(p, o.threads, o.exact, o.repeat);
      // QK^T and PV over the T(T+1)/2 causal pairs; decode reads fp32 K and V of all keys once.
      const double flop = double(p.B * p.H * 2 * (p.D + p.Dv)) * double(T) * double(T + 1) / 2.0;
      const double gflops = flop / dense.prefill_s * 1e-9;
      const double gflops_cpu = flop / (dense.prefill_cpu_s / threads) * 1e-9;  // as the peaks: per CPU second
      const double gbs = o.decode_steps > 0 ? double(T * p.H * (p.D + p.Dv) * 4) / dense.decode_s * 1e-9 : 0;
      std::printf(
          "| %lld | dense causal | fp32 | - | %.3f | %.3f | %.3f | %.1f | %.1f | 1.0 | 1.0 | 1.0 | %.1f, %.1f (%.0f%%) "
          "| "
          "%.1f (%.0f%%) |\n",
          static_cast<long long>(T), dense.prefill_s, dense.prefill_cpu_s, dense.decode_s * 1e3, full_mib, full_mib,
          gflops, gflops_cpu, 100 * gflops_cpu / peak_gflops, gbs, 100 * gbs / peak_gbs);
      std::fflush(stdout);
    }
    struct Variant {
      const char* name;
      kvmem::budget::Any budget;
    };
    std::vector<Variant> variants;
    if (o.budget == "none") continue;
    if (o.budget != "sqrt") variants.push_back({"KVM fixed-256", kvmem::budget::Fixed{256, 256}});
    if (o.budget != "fixed") variants.push_back({"KVM 16 sqrt N", kvmem::budget::Power{16.0, 0.5, 256}});
    for (const auto& var : variants) {
      for (int prec = 0; prec < (o.bf16 ? 2 : 1); ++prec) {
        const KvmTiming r = prec == 0 ? run_kvm<float>(p, var.budget, o.threads, o.flush)
                                      : run_kvm<kvmem::bf16>(p, var.budget, o.threads, o.flush);
        const double state_mib = double(r.state_bytes) / (1024.0 * 1024.0);
        std::printf("| %lld | %s | %s | %lld | %.3f | %.3f | %.3f | %.1f | %.1f | %.1f | ", static_cast<long long>(T),
                    var.name, prec == 0 ? "fp32" : "bf16", static_cast<long long>(r.slots), r.prefill_s,
                    r.prefill_cpu_s, r.decode_s * 1e3, state_mib, full_mib, full_mib / state_mib);
        if (o.dense)
          std::printf("%.2f | %.2f | - | - |\n", dense.prefill_s / r.prefill_s, dense.decode_s / r.decode_s);
        else
          std::printf("- | - | - | - |\n");
        std::fflush(stdout);
      }
    }
  }
  std::printf(
      "\nstate bytes: per sequence, all KV heads: slot sums Sk, Sv, rho, count (fp32) + readout copies "
      "K^, V^ (storage type) + the window's k, v (storage type) and gate (fp32). full-KV: fp32 K and V of "
      "all T tokens.\n");
  return 0;
}
