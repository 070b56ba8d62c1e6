// SPDX-License-Identifier: Apache-2.0
// Documentation snippet (README.md "Run it", docs/guide.md "Host backend"): Universal Attention with a
// self-pruning cache on the host backend, a prompt prefill followed by decode steps and the cache report.
// main() checks the result.

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <vector>

#include "check.hpp"

// [snippet:ua-host]
#include <kvmem/kvmem.hpp>

// Prefill a 600-token prompt, then decode `steps` tokens, evicting keys whose decay passes p = 0.05.
kvmem::Status universal_attention_on_host(kvmem::ua::PrunedCache<float>& cache, std::vector<float>& out1) {
  using kvmem::TensorView;
  const std::int64_t B = 1, H = 4, G = 2, D = 64, T = 600, steps = 8;

  // Rows per (sequence, KV head), allocated once: a call needs (longest kept list + its tokens) rows.
  KVMEM_RETURN_IF_ERROR(kvmem::ua::PrunedCache<float>::create({B, H, G, D, /*capacity*/ T + steps}, cache));
  const kvmem::ua::Options opt{/*p*/ 0.05, /*prefill_chunk*/ 128, /*evict_before_attention*/ true};

  // q [B,H,T,D]; k, v [B,G,T,D] with unit-norm keys (normalise, then rotate); gate logits z_k, z_q [B,G,T].
  auto fill = [](std::vector<float>& x, float f) {
    for (std::size_t i = 0; i < x.size(); ++i) x[i] = std::sin(f * float(i) + 0.5f * float(i % 7));
  };
  auto normalise_rows = [D](std::vector<float>& x) {
    for (std::size_t r = 0; r < x.size(); r += std::size_t(D)) {
      float n2 = 0.0f;
      for (std::int64_t d = 0; d < D; ++d) n2 += x[r + std::size_t(d)] * x[r + std::size_t(d)];
      for (std::int64_t d = 0; d < D; ++d) x[r + std::size_t(d)] /= std::sqrt(n2) + 1e-6f;
    }
  };
  std::vector<float> q(B * H * T * D), k(B * G * T * D), v(B * G * T * D), z_k(B * G * T), z_q(B * G * T);
  std::vector<float> out(B * T * H * D);
  fill(q, 0.37f);
  fill(k, 0.011f);
  normalise_rows(k);
  fill(v, 0.23f);
  fill(z_k, 0.05f);
  fill(z_q, 0.07f);
  const kvmem::ua::Inputs prompt{
      TensorView<const float, 4>(q.data(), {B, H, T, D}),
      TensorView<const float, 4>(k.data(), {B, G, T, D}),
      TensorView<const float, 4>(v.data(), {B, G, T, D}),
      TensorView<const float, 3>(z_k.data(), {B, G, T}),
      TensorView<const float, 3>(z_q.data(), {B, G, T}),
      /*z_o: no output gate*/ {},
  };
  const kvmem::host::Executor exec{};
  KVMEM_RETURN_IF_ERROR(kvmem::ua::prefill(exec, cache, prompt, opt, TensorView<float, 4>(out.data(), {B, T, H, D})));

  // Decode: the caller rotates the new token at position cache.position(b), whatever was evicted.
  std::vector<float> q1(B * H * D), k1(B * G * D), v1(B * G * D), zk1(B * G, 1.0f), zq1(B * G, 1.0f);
  out1.assign(B * H * D, 0.0f);
  for (std::int64_t step = 0; step < steps; ++step) {
    fill(q1, 0.3f + 0.01f * float(step));
    fill(k1, 0.013f + 0.001f * float(step));
    normalise_rows(k1);
    fill(v1, 0.9f);
    const kvmem::ua::Inputs token{
        TensorView<const float, 4>(q1.data(), {B, H, 1, D}),
        TensorView<const float, 4>(k1.data(), {B, G, 1, D}),
        TensorView<const float, 4>(v1.data(), {B, G, 1, D}),
        TensorView<const float, 3>(zk1.data(), {B, G, 1}),
        TensorView<const float, 3>(zq1.data(), {B, G, 1}),
        /*z_o*/ {},
    };
    KVMEM_RETURN_IF_ERROR(kvmem::ua::decode(exec, cache, token, opt, TensorView<float, 4>(out1.data(), {B, 1, H, D})));
  }
  // Kept keys, bytes and the fraction of a dense cache removed, per (sequence, KV head).
  for (const kvmem::ua::CacheReportRow& row : kvmem::ua::report(cache))
    std::printf("sequence %lld, kv head %lld: %lld of %lld keys kept, %lld bytes (compression %.2f)\n",
                static_cast<long long>(row.batch), static_cast<long long>(row.kv_head),
                static_cast<long long>(row.kept), static_cast<long long>(row.dense),
                static_cast<long long>(row.kv_bytes), row.compression_ratio);
  return kvmem::Status::ok();
}
// [snippet-end]

// [snippet:ua-any-backend]
template <class Exec>
kvmem::Status layer_prefill(const Exec& exec, kvmem::ua::cache_t<Exec, float>& cache, const kvmem::ua::Inputs& in,
                            kvmem::TensorView<float, 4> out) {
  return kvmem::ua::prefill(exec, cache, in, {.p = 0.05}, out);  // host, Kokkos or CUDA
}
// [snippet-end]

// layer_prefill on the host: the cache type comes from the executor, and the call gives the bits of the
// direct ua::prefill with the same options.
void check_layer_prefill() {
  using kvmem::TensorView;
  const std::int64_t B = 1, H = 2, G = 1, D = 16, T = 40;
  std::vector<float> q(B * H * T * D), k(B * G * T * D), v(B * G * T * D), z(B * G * T, 1.0f);
  for (std::size_t i = 0; i < q.size(); ++i) q[i] = std::sin(0.1f * float(i));
  for (std::size_t i = 0; i < k.size(); ++i) k[i] = std::cos(0.07f * float(i)) / 4.0f;  // |k| = 1 per row
  for (std::size_t i = 0; i < v.size(); ++i) v[i] = std::sin(0.3f * float(i));
  const kvmem::ua::Inputs in{
      TensorView<const float, 4>(q.data(), {B, H, T, D}), TensorView<const float, 4>(k.data(), {B, G, T, D}),
      TensorView<const float, 4>(v.data(), {B, G, T, D}), TensorView<const float, 3>(z.data(), {B, G, T}),
      TensorView<const float, 3>(z.data(), {B, G, T}),    {}};
  const kvmem::host::Executor exec{};
  kvmem::ua::cache_t<kvmem::host::Executor, float> a, b;
  SNIPPET_CHECK_OK(decltype(a)::create({B, H, G, D, T}, a));
  SNIPPET_CHECK_OK(decltype(b)::create({B, H, G, D, T}, b));
  std::vector<float> out_a(B * T * H * D), out_b(B * T * H * D);
  SNIPPET_CHECK_OK(layer_prefill(exec, a, in, TensorView<float, 4>(out_a.data(), {B, T, H, D})));
  SNIPPET_CHECK_OK(
      kvmem::ua::prefill(exec, b, in, kvmem::ua::Options{0.05}, TensorView<float, 4>(out_b.data(), {B, T, H, D})));
  SNIPPET_CHECK(out_a == out_b);
  SNIPPET_CHECK(a.length(0, 0) == b.length(0, 0) && a.length(0, 0) < T);  // both pruned, the same rows
}

int main() {
  check_layer_prefill();
  kvmem::ua::PrunedCache<float> cache;
  std::vector<float> out1;
  SNIPPET_CHECK_OK(universal_attention_on_host(cache, out1));
  SNIPPET_CHECK(cache.position(0) == 608);  // positions count tokens, not kept keys
  const auto rows = kvmem::ua::report(cache);
  SNIPPET_CHECK(rows.size() == 2);
  for (const auto& row : rows) {
    SNIPPET_CHECK(row.dense == 608);
    SNIPPET_CHECK(row.kept >= 1 && row.kept < row.dense);  // these inputs decay: the cache pruned itself
    SNIPPET_CHECK(row.kept == cache.length(row.batch, row.kv_head));
  }
  bool finite = true, nonzero = false;
  for (float x : out1) {
    finite = finite && std::isfinite(x);
    nonzero = nonzero || x != 0.0f;
  }
  SNIPPET_CHECK(finite && nonzero);
  return 0;
}
