// SPDX-License-Identifier: Apache-2.0
// kvmem-demo: KV Means and Universal Attention over a long synthetic sequence on the host backend,
// next to dense causal attention computed by the same backend. It prints, per variant, the cache it
// keeps (slots or kept keys), the bytes it keeps and the bytes it holds (allocated) against a full KV
// cache, and the prefill and per-token decode time against dense attention.
//
//   kvmem-demo [--tokens 4096] [--heads 4] [--head-dim 64] [--threads 0] [--decode 32]
//
// Inputs are random (q, k, v ~ N(0,1); KVM gates 1 + |N(0,1)|; UA keys unit-norm, gate logits
// N(1, 1.5)): they show sizes and speed, not model quality. Random keys are less similar than a
// trained model's, so UA evicts more here than it would on real activations.

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
#include "kvmem/backend/host/ua.hpp"
#include "kvmem/kvm/attention.hpp"
#include "kvmem/ua/cache.hpp"
#include "kvmem/ua/ops.hpp"

namespace {

using Clock = std::chrono::steady_clock;
using kvmem::TensorView;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

struct Options {
  std::int64_t tokens = 4096, heads = 4, dim = 64, decode = 32;
  int threads = 0;
};

// [heads, n, width] rows [t0, t0 + count) of a [heads, N, width] tensor.
std::vector<float> rows(const std::vector<float>& x, std::int64_t heads, std::int64_t N, std::int64_t width,
                        std::int64_t t0, std::int64_t count) {
  std::vector<float> y;
  y.reserve(std::size_t(heads * count * width));
  for (std::int64_t h = 0; h < heads; ++h)
    y.insert(y.end(), x.begin() + (h * N + t0) * width, x.begin() + (h * N + t0 + count) * width);
  return y;
}

std::string mib(double bytes) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2f MiB", bytes / (1024.0 * 1024.0));
  return buf;
}

// kept: bytes of what the cache keeps; allocated: bytes it holds for that (the 'smaller' column).
void print_row(const char* name, const std::string& kept, double kept_bytes, double allocated, double full_bytes,
               double prefill_s, double dense_prefill_s, double decode_s, double dense_decode_s) {
  std::printf("%-24s %18s %12s %12s %7.1fx %10.3f %7.2fx %11.3f %7.2fx\n", name, kept.c_str(), mib(kept_bytes).c_str(),
              mib(allocated).c_str(), full_bytes / allocated, prefill_s, dense_prefill_s / prefill_s, decode_s * 1e3,
              dense_decode_s / decode_s);
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "-h" || a == "--help") {
      std::printf("usage: kvmem-demo [--tokens N] [--heads H] [--head-dim D] [--threads N] [--decode STEPS]\n");
      return 0;
    }
    if (i + 1 >= argc) {
      std::fprintf(stderr, "kvmem-demo: missing value for %s\n", a.c_str());
      return 2;
    }
    char* end = nullptr;
    const long long v = std::strtoll(argv[++i], &end, 10);
    if (*end != '\0' || v < 0) {
      std::fprintf(stderr, "kvmem-demo: %s needs a non-negative integer\n", a.c_str());
      return 2;
    }
    if (a == "--tokens")
      o.tokens = v;
    else if (a == "--heads")
      o.heads = v;
    else if (a == "--head-dim")
      o.dim = v;
    else if (a == "--threads")
      o.threads = int(v);
    else if (a == "--decode")
      o.decode = v;
    else {
      std::fprintf(stderr, "kvmem-demo: unknown option %s\n", a.c_str());
      return 2;
    }
  }
  if (o.tokens < 1 || o.heads < 1 || o.dim < 2) {
    std::fprintf(stderr, "kvmem-demo: --tokens, --heads must be >= 1 and --head-dim >= 2\n");
    return 2;
  }
  const kvmem::host::Executor exec{o.threads};
  const std::int64_t H = o.heads, D = o.dim, T = o.tokens, S = o.decode, N = T + S;
  std::mt19937 rng(2026);
  std::normal_distribution<float> n01(0.f, 1.f);
  std::vector<float> q(std::size_t(H * N * D)), k(q.size()), v(q.size()), gate(std::size_t(H * N));
  for (auto* x : {&q, &k, &v})
    for (auto& e : *x) e = n01(rng);
  for (auto& e : gate) e = 1.f + std::abs(n01(rng));

  std::printf(
      "kvmem demo: one sequence of %lld tokens, %lld heads, head dim %lld, fp32, %d threads, %lld decode steps\n\n",
      (long long)T, (long long)H, (long long)D, exec.resolved_threads(), (long long)S);
  std::printf("%-24s %18s %12s %12s %8s %10s %8s %11s %8s\n", "variant", "cache rows", "kept", "allocated", "smaller",
              "prefill s", "speedup", "decode ms", "speedup");

  // ---- dense causal attention (the anchor), same backend ----------------------------------------
  const float scale = 1.0f / std::sqrt(float(D));
  const auto qT = rows(q, H, N, D, 0, T), kT = rows(k, H, N, D, 0, T), vT = rows(v, H, N, D, 0, T);
  std::vector<float> out(std::size_t(T * H * D));
  auto t0 = Clock::now();
  kvmem::host::dense_causal_attention<float>(
      exec, TensorView<const float, 4>(qT.data(), {1, H, T, D}), TensorView<const float, 4>(kT.data(), {1, H, T, D}),
      TensorView<const float, 4>(vT.data(), {1, H, T, D}), TensorView<float, 4>(out.data(), {1, T, H, D}), scale);
  const double dense_prefill = seconds_since(t0);
  // dense decode: one query over the whole cache, per head, per step
  std::vector<float> acc(std::size_t(H * D)), o1(std::size_t(H * D));
  t0 = Clock::now();
  for (std::int64_t s = 0; s < S; ++s)
    kvmem::host::parallel_for(exec, H, [&](std::int64_t h) {
      kvmem::OnlineSoftmax<float> sm;
      std::fill(acc.begin() + h * D, acc.begin() + (h + 1) * D, 0.f);
      kvmem::kernel::attend_accumulate(sm, acc.data() + h * D, q.data() + (h * N + T + s) * D, D, scale,
                                       k.data() + h * N * D, D, v.data() + h * N * D, D, D, T + s + 1);
      kvmem::kernel::attend_finish(sm, acc.data() + h * D, D, o1.data() + h * D);
    });
  const double dense_decode = S > 0 ? seconds_since(t0) / double(S) : 1.0;
  const double full_bytes = double(H) * double(N) * 2.0 * double(D) * sizeof(float);
  print_row("dense causal attention", std::to_string(N), full_bytes, full_bytes, full_bytes, dense_prefill,
            dense_prefill, dense_decode, dense_decode);

  // ---- KV Means: fixed 256 and 16 sqrt(N) slots -------------------------------------------------
  std::vector<float> lnw(std::size_t(D), 1.f), lnb(std::size_t(D), 0.f), tau(std::size_t(H), 1.f);
  const kvmem::kvm::Weights weights{{lnw.data(), {D}}, {lnb.data(), {D}}, {tau.data(), {H}}, {tau.data(), {H}}};
  struct Budget {
    const char* name;
    kvmem::budget::Any budget;
  };
  for (const Budget& b : {Budget{"KVM fixed 256", kvmem::budget::Fixed{256}},
                          Budget{"KVM power 16*sqrt(N)", kvmem::budget::Power{16.0, 0.5, 256}}}) {
    kvmem::kvm::Params params;  // paper defaults: chunk 256, window 2 chunks, 1 sink slot
    params.rope_dims = D / 2;
    params.budget = b.budget;
    kvmem::kvm::State<float, float> state;
    kvmem::throw_if_error(kvmem::kvm::State<float, float>::create(params, {1, H, H, D, D, N}, state));
    const auto gT = rows(gate, H, N, 1, 0, T);
    t0 = Clock::now();
    kvmem::throw_if_error(kvmem::kvm::prefill(
        exec, state, weights, TensorView<const float, 4>(qT.data(), {1, H, T, D}),
        TensorView<const float, 4>(kT.data(), {1, H, T, D}), TensorView<const float, 4>(vT.data(), {1, H, T, D}),
        TensorView<const float, 3>(gT.data(), {1, H, T}), TensorView<float, 4>(out.data(), {1, T, H, D})));
    const double prefill = seconds_since(t0);
    t0 = Clock::now();
    for (std::int64_t s = 0; s < S; ++s) {
      const auto q1 = rows(q, H, N, D, T + s, 1), k1 = rows(k, H, N, D, T + s, 1), v1 = rows(v, H, N, D, T + s, 1),
                 g1 = rows(gate, H, N, 1, T + s, 1);
      kvmem::throw_if_error(kvmem::kvm::decode(
          exec, state, weights, TensorView<const float, 4>(q1.data(), {1, H, 1, D}),
          TensorView<const float, 4>(k1.data(), {1, H, 1, D}), TensorView<const float, 4>(v1.data(), {1, H, 1, D}),
          TensorView<const float, 3>(g1.data(), {1, H, 1}), TensorView<float, 4>(o1.data(), {1, 1, H, D})));
    }
    const double decode = S > 0 ? seconds_since(t0) / double(S) : 1.0;
    const std::string kept =
        std::to_string(state.slots(0)) + " + " + std::to_string(std::min<std::int64_t>(N, params.window())) + " win";
    print_row(b.name, kept, double(state.cache_bytes(0)), double(state.state_bytes()), full_bytes, prefill,
              dense_prefill, decode, dense_decode);
  }

  // ---- Universal Attention: dense decay and self-pruning at p = 0.05 / 0.15 ---------------------
  std::vector<float> uk(k.size()), zk(gate.size()), zq(gate.size());
  for (std::int64_t r = 0; r < H * N; ++r) {  // unit-norm keys (spec UA.md 2: normalised, then RoPE)
    float n2 = 0;
    for (std::int64_t d = 0; d < D; ++d) n2 += k[std::size_t(r * D + d)] * k[std::size_t(r * D + d)];
    const float inv = 1.0f / (std::sqrt(n2) + 1e-6f);
    for (std::int64_t d = 0; d < D; ++d) uk[std::size_t(r * D + d)] = k[std::size_t(r * D + d)] * inv;
  }
  std::normal_distribution<float> logits(1.0f, 1.5f);
  for (auto& e : zk) e = logits(rng);
  for (auto& e : zq) e = logits(rng);
  const auto ukT = rows(uk, H, N, D, 0, T), zkT = rows(zk, H, N, 1, 0, T), zqT = rows(zq, H, N, 1, 0, T);
  for (double p : {0.0, 0.05, 0.15}) {
    kvmem::ua::PrunedCache<float> cache;
    kvmem::throw_if_error(kvmem::ua::PrunedCache<float>::create({1, H, H, D, N, 16}, cache));
    const kvmem::ua::Options opt{p, 128, true};
    const kvmem::ua::Inputs in{
        TensorView<const float, 4>(qT.data(), {1, H, T, D}), TensorView<const float, 4>(ukT.data(), {1, H, T, D}),
        TensorView<const float, 4>(vT.data(), {1, H, T, D}), TensorView<const float, 3>(zkT.data(), {1, H, T}),
        TensorView<const float, 3>(zqT.data(), {1, H, T}),   {}};
    t0 = Clock::now();
    kvmem::throw_if_error(kvmem::ua::prefill(exec, cache, in, opt, TensorView<float, 4>(out.data(), {1, T, H, D})));
    const double prefill = seconds_since(t0);
    t0 = Clock::now();
    for (std::int64_t s = 0; s < S; ++s) {
      const auto q1 = rows(q, H, N, D, T + s, 1), k1 = rows(uk, H, N, D, T + s, 1), v1 = rows(v, H, N, D, T + s, 1),
                 zk1 = rows(zk, H, N, 1, T + s, 1), zq1 = rows(zq, H, N, 1, T + s, 1);
      const kvmem::ua::Inputs step{
          TensorView<const float, 4>(q1.data(), {1, H, 1, D}), TensorView<const float, 4>(k1.data(), {1, H, 1, D}),
          TensorView<const float, 4>(v1.data(), {1, H, 1, D}), TensorView<const float, 3>(zk1.data(), {1, H, 1}),
          TensorView<const float, 3>(zq1.data(), {1, H, 1}),   {}};
      kvmem::throw_if_error(kvmem::ua::decode(exec, cache, step, opt, TensorView<float, 4>(o1.data(), {1, 1, H, D})));
    }
    const double decode = S > 0 ? seconds_since(t0) / double(S) : 1.0;
    double kept = 0, bytes = 0, held = 0, ratio = 0;
    for (const auto& r : kvmem::ua::report(cache)) {
      kept += double(r.kept);
      bytes += double(r.kv_bytes + r.scalar_bytes);
      held += double(r.allocated_bytes);
      ratio += r.compression_ratio / double(H);
    }
    char name[48], rows_text[48];
    std::snprintf(name, sizeof name, p > 0 ? "UA pruned p=%.2f" : "UA dense (no pruning)", p);
    std::snprintf(rows_text, sizeof rows_text, "%.0f/head (%.1f%%)", kept / double(H), 100.0 * (1.0 - ratio));
    print_row(name, rows_text, bytes, held, full_bytes, prefill, dense_prefill, decode, dense_decode);
  }
  std::printf(
      "\n'kept' = bytes of what the cache keeps (KVM: slots + window + radii/gates; UA: kept keys + values +\n"
      "per-key lambda, gate, position). 'allocated' = bytes held for it (KVM: the state, sized for the\n"
      "context; UA: the pool pages of 16 rows the sequence holds + its page tables). 'smaller' = full KV\n"
      "bytes / allocated. 'speedup' = dense time / variant time on the same backend.\n");
  return 0;
}
