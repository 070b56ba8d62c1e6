// SPDX-License-Identifier: Apache-2.0
// UA memory on the host: one sequence prefilled in chunks and decoded through ua::step at threshold p,
// then the bytes it keeps, the pool pages it holds (what its engine's pool gives it), and the dense KV
// cache it replaces. Random inputs as in kvmem-demo (unit-norm keys, gate logits N(1, 1.5)): they show
// sizes, not model quality.
//
//   kvmem_bench_ua_memory [--tokens 32768] [--heads 8] [--kv-heads 2] [--head-dim 64] [--p 0.05]
//                         [--page-rows 16] [--decode 64] [--threads 0]

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "kvmem/backend/host/ua.hpp"
#include "kvmem/core/slots.hpp"

namespace {

struct Options {
  std::int64_t tokens = 32768, heads = 8, kv_heads = 2, dim = 64, page_rows = 16, decode = 64;
  double p = 0.05;
  int threads = 0;
};

std::string mib(double bytes) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.3f MiB", bytes / (1024.0 * 1024.0));
  return buf;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i];
    const double v = std::strtod(argv[i + 1], nullptr);
    if (a == "--tokens")
      o.tokens = std::int64_t(v);
    else if (a == "--heads")
      o.heads = std::int64_t(v);
    else if (a == "--kv-heads")
      o.kv_heads = std::int64_t(v);
    else if (a == "--head-dim")
      o.dim = std::int64_t(v);
    else if (a == "--page-rows")
      o.page_rows = std::int64_t(v);
    else if (a == "--decode")
      o.decode = std::int64_t(v);
    else if (a == "--p")
      o.p = v;
    else if (a == "--threads")
      o.threads = int(v);
    else {
      std::fprintf(stderr, "kvmem_bench_ua_memory: unknown option %s\n", a.c_str());
      return 2;
    }
  }
  const std::int64_t H = o.heads, G = o.kv_heads, D = o.dim, N = o.tokens + o.decode, chunk = 512;
  using S = kvmem::bf16;
  kvmem::ua::PrunedCache<S> cache(kvmem::ua::CacheShape{1, H, G, D, N, o.page_rows});
  const kvmem::ua::Options opt{o.p, 128, true};
  const kvmem::host::Executor exec{o.threads};
  std::mt19937_64 rng(2026);
  std::normal_distribution<float> n01(0.f, 1.f), logit(1.0f, 1.5f);
  std::vector<float> q, k, v, zk, zq, out, lse;
  std::int64_t peak_pages = 0;
  const auto run = [&](std::int64_t n) {
    q.resize(std::size_t(n * H * D)), k.resize(std::size_t(n * G * D)), v.resize(k.size());
    zk.resize(std::size_t(n * G)), zq.resize(zk.size()), out.resize(q.size()), lse.resize(std::size_t(n * H));
    for (auto& x : q) x = 2.0f * n01(rng);
    for (auto& x : v) x = n01(rng);
    for (std::int64_t r = 0; r < n * G; ++r) {
      float n2 = 0;
      for (std::int64_t d = 0; d < D; ++d) n2 += (k[std::size_t(r * D + d)] = n01(rng)) * k[std::size_t(r * D + d)];
      for (std::int64_t d = 0; d < D; ++d) k[std::size_t(r * D + d)] /= std::sqrt(n2) + 1e-6f;
      zk[std::size_t(r)] = logit(rng), zq[std::size_t(r)] = logit(rng);
    }
    const std::int32_t slot = 0, start[2] = {0, std::int32_t(n)};
    using I32 = kvmem::TensorView<const std::int32_t, 1>;
    kvmem::ua::PackedInputs in;
    in.q = {q.data(), {n, H, D}}, in.k = {k.data(), {n, G, D}}, in.v = {v.data(), {n, G, D}};
    in.z_k = {zk.data(), {n, G}}, in.z_q = {zq.data(), {n, G}};
    kvmem::throw_if_error(kvmem::ua::step(exec, cache, kvmem::Rows{I32(&slot, {1}), I32(start, {2})}, in, opt,
                                          kvmem::TensorView<float, 3>(out.data(), {n, H, D}),
                                          kvmem::TensorView<float, 2>(lse.data(), {n, H})));
    peak_pages = std::max(peak_pages, cache.pages_in_use());
  };
  for (std::int64_t t = 0; t < o.tokens; t += chunk) run(std::min(chunk, o.tokens - t));
  for (std::int64_t s = 0; s < o.decode; ++s) run(1);

  const double page = double(cache.page_bytes());
  double kept_rows = 0, kept_kv = 0, kept_all = 0, held = 0, tables = 0, bound = 0;
  for (const auto& r : kvmem::ua::report(cache)) {
    kept_rows += double(r.kept);
    kept_kv += double(r.kv_bytes);
    kept_all += double(r.kv_bytes + r.scalar_bytes);
    held += double(r.pages) * page;
    tables += double(r.allocated_bytes) - double(r.pages) * page;
    bound += (std::ceil(double(r.kept) / double(o.page_rows)) + 1.0) * page;
  }
  const double dense = double(N * G * 2 * D) * sizeof(S);
  std::printf(
      "UA memory, host: one sequence of %lld tokens (%lld prefill in chunks of %lld + %lld decode), "
      "H %lld, G %lld, D %lld, bf16, p = %.3g, pages of %lld rows\n\n",
      (long long)N, (long long)o.tokens, (long long)chunk, (long long)o.decode, (long long)H, (long long)G,
      (long long)D, o.p, (long long)o.page_rows);
  std::printf("%-44s %14s %10s\n", "", "bytes", "vs dense");
  const auto row = [&](const char* name, double b) {
    std::printf("%-44s %14s %9.4fx\n", name, mib(b).c_str(), b / dense);
  };
  row("dense KV cache (keys + values, bf16)", dense);
  row("kept keys + values", kept_kv);
  row("kept rows, every field (+ lambda, gate, pos)", kept_all);
  row("allocated: pool pages held", held);
  row("bound: (ceil(kept / page) + 1) pages per KVh", bound);
  row("page tables and counters (fixed per KVh)", tables);
  row("peak pool pages held between steps", double(peak_pages) * page);
  std::printf("\nkept rows per KV head: %.1f of %lld; pages held %lld, pages taken %lld, returned %lld\n",
              kept_rows / double(G), (long long)N, (long long)cache.pages_in_use(), (long long)cache.pages_taken(),
              (long long)cache.pages_returned());
  return held <= bound ? 0 : 1;
}
