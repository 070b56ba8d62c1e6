// SPDX-License-Identifier: Apache-2.0
// fp8 (e4m3) storage of UA cache rows on the CUDA backend (cuda::UaCache<kvmem::e4m3>, bf16 inputs; one
// power-of-two scale per key and value row, λ and every sum fp32):
//  - on inputs an fp8 cache stores exactly (tests/ua/ua_fp8_support.hpp), outputs match the fp64
//    reference at fp32 rounding and kept sets equal it but for near-ties (tests/support/near_ties.hpp),
//    through every decode path (one block, decode_split_rows at r = 4, decode_split at r = 2) and the
//    chunked prefill, over own pages and a shared pool;
//  - on bf16 inputs, the documented fp8 tolerance against the fp64 reference (docs/compose.md), and the
//    host's fp8 cache on the same values stores the same rows;
//  - a step, copy_slots (the copy continues bit for bit), and a slot record that the host's fp8 cache
//    imports and continues.
// Skips, saying so, when no CUDA device is visible.
#include "kvmem/backend/cuda/vendor.cuh"

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>

#include <catch2/catch.hpp>

#include "cuda/cuda_test_support.hpp"
#include "kvmem/backend/cuda.hpp"
#include "kvmem/reference/ua.hpp"
#include "support/golden.hpp"
#include "support/near_ties.hpp"
#include "ua/ua_fp8_support.hpp"
#include "ua/ua_host_support.hpp"

namespace {
using kvmem::bf16;
using kvmem::e4m3;
using kvmem::TensorView;
using namespace kvmem::test;
using namespace kvmem::test::cuda;
using namespace kvmem::test::ua;
namespace kua = kvmem::ua;

constexpr double kFp32Tol = 2e-5;  // fp32 sums in another order than the reference's (bf16 inputs, D 128)
constexpr double kFp8DenseTol = 6e-2;
constexpr double kFp8PrunedTol = 8e-2;

// The case with q rounded to bf16 (a CUDA fp8 cache takes bf16 inputs); k and v as given.
Case bf16_queries(Case c) {
  for (auto& x : c.inputs.q) x = double(kvmem::load_as<float>(kvmem::store_as<bf16>(float(x))));
  return c;
}
// The case with q, k, v rounded to bf16.
Case bf16_inputs(Case c) {
  c = bf16_queries(c);
  for (auto* field : {&c.inputs.k, &c.inputs.v})
    for (auto& x : *field) x = double(kvmem::load_as<float>(kvmem::store_as<bf16>(float(x))));
  return c;
}

// A FloatCase's tensors in device memory (q, k, v in bf16; gate logits fp32) and views of token ranges.
struct DevCase {
  const FloatCase& f;
  Dev<bf16> q, k, v;
  Dev<float> z_k, z_q;
  explicit DevCase(const FloatCase& fc)
      : f(fc),
        q(as_storage<bf16>(fc.q)),
        k(as_storage<bf16>(fc.k)),
        v(as_storage<bf16>(fc.v)),
        z_k(fc.z_k),
        z_q(fc.z_q) {}
  kvmem::cuda::UaInputs<e4m3> slice(std::int64_t t0, std::int64_t t1) const {
    const std::int64_t B = f.c.B, H = f.c.H, G = f.c.G, T = f.c.T, D = f.c.D, n = t1 - t0;
    kvmem::cuda::UaInputs<e4m3> in;
    in.q = {q.ptr + t0 * D, {B, H, n, D}, {H * T * D, T * D, D, 1}};
    in.k = {k.ptr + t0 * D, {B, G, n, D}, {G * T * D, T * D, D, 1}};
    in.v = {v.ptr + t0 * D, {B, G, n, D}, {G * T * D, T * D, D, 1}};
    in.z_k = {z_k.ptr + t0, {B, G, n}, {G * T, T, 1}};
    in.z_q = {z_q.ptr + t0, {B, G, n}, {G * T, T, 1}};
    return in;
  }
  TensorView<float, 4> out_slice(float* out, std::int64_t t0, std::int64_t t1) const {
    const std::int64_t H = f.c.H, T = f.c.T, D = f.c.D;
    return {out + t0 * H * D, {f.c.B, t1 - t0, H, D}, {T * H * D, H * D, D, 1}};
  }
};

struct Run {
  std::vector<float> out;
  std::vector<std::int64_t> kept;
  std::int64_t longest = 0;
};
Run kept_of(const kvmem::cuda::UaCache<e4m3>& cache, std::int64_t T) {
  const auto& s = cache.shape();
  Run r;
  r.kept.assign(std::size_t(s.batch * s.kv_heads * T), 0);
  for (std::int64_t b = 0; b < s.batch; ++b)
    for (std::int64_t g = 0; g < s.kv_heads; ++g) {
      std::vector<std::int64_t> pos;
      std::vector<float> lam, ks;
      std::vector<e4m3> keys;
      REQUIRE(cache.download(b, g, pos, lam, &keys, nullptr, nullptr, &ks, nullptr).is_ok());
      REQUIRE(ks.size() == pos.size());
      for (const float x : ks) {
        int exponent = 0;
        CHECK(std::frexp(x, &exponent) == 0.5f);  // power-of-two row scales
      }
      r.longest = std::max(r.longest, std::int64_t(pos.size()));
      for (std::size_t e = 0; e < pos.size(); ++e) {
        if (e > 0) CHECK(pos[e] > pos[e - 1]);
        r.kept[std::size_t((b * s.kv_heads + g) * T + pos[e])] = 1;
      }
    }
  return r;
}

// Chunked prefill of [0, split) then decode of [split, T) on an fp8 CUDA cache.
Run cuda_fp8_run(const FloatCase& f, std::int64_t split, const kua::CacheShape& shape, const kua::Options& opt) {
  DevCase d(f);
  kvmem::cuda::UaCache<e4m3> cache;
  const auto made = kvmem::cuda::UaCache<e4m3>::create(shape, cache);
  INFO(made.to_string());
  REQUIRE(made.is_ok());
  Dev<float> out(std::vector<float>(f.make_out().size(), -7.0f));  // poisoned
  const kvmem::cuda::Executor exec{};
  const auto prefilled = kua::prefill(exec, cache, d.slice(0, split), opt, d.out_slice(out.ptr, 0, split));
  INFO(prefilled.to_string());
  REQUIRE(prefilled.is_ok());
  for (std::int64_t t = split; t < f.c.T; ++t) {
    const auto s = kua::decode(exec, cache, d.slice(t, t + 1), opt, d.out_slice(out.ptr, t, t + 1));
    INFO("token " << t << ": " << s.to_string());
    REQUIRE(s.is_ok());
  }
  KVMEM_CUDA_REQUIRE(cudaDeviceSynchronize());
  Run r = kept_of(cache, f.c.T);
  r.out = out.get();
  return r;
}

kua::CacheShape pooled(kua::CacheShape s) {
  s.pool_pages = s.batch * s.kv_heads * s.pages_per_item();
  return s;
}
}  // namespace

TEST_CASE("ua cuda fp8 storage on fp8-exact inputs matches the fp64 reference through every decode path",
          "[ua][cuda][fp8][nearties]") {
  if (no_device()) return;
  // H 8 / G 2 (r = 4): decode_split_rows past 256 rows; H 4 / G 2 (r = 2): decode_split; p = 0.15 keeps
  // items short (the one-block decode), p = 0 lets them grow to T.
  struct Shape {
    std::int64_t H, D;
  };
  for (const Shape sh : {Shape{8, 128}, Shape{4, 64}}) {
    const Case c = bf16_queries(fp8_stored(random_case(2, 520, sh.H, 2, sh.D, 5)));
    const FloatCase f(c);
    for (const double p : {0.0, 0.15}) {
      ref::Config rc = c.config;
      rc.prefill_chunk = 64;
      rc.prefill_split = 300;
      const auto ref = kvmem::reference::ua::pruned(rc, c.inputs, p);
      for (const bool pool : {false, true}) {
        INFO("H " << sh.H << " D " << sh.D << ", p " << p << ", shared pool " << pool);
        const kua::CacheShape shape = pool ? pooled(f.cache_shape()) : f.cache_shape();
        const Run gpu = cuda_fp8_run(f, 300, shape, kua::Options{p, 64, true});
        KVMEM_CHECK_CLOSE(gpu.out, ref.out, kFp32Tol);
        if (p == 0.0) {
          CHECK(gpu.kept == ref.kept);
          CHECK(gpu.longest == c.config.T);
        } else {
          const auto acc = near_ties::account_kept(rc, c.inputs, gpu.kept, ref.kept, p);
          std::printf("ua cuda fp8 (H %lld, D %lld, p %.2f, pool %d): %s\n", (long long)sh.H, (long long)sh.D, p,
                      int(pool), acc.summary().c_str());
          INFO(acc.summary() << "; first unexplained: " << acc.first_beyond);
          CHECK(acc.beyond == 0);
          CHECK(gpu.longest <= kvmem::cuda::ua_detail::kOneBlockMaxKept);
        }
      }
    }
  }
}

TEST_CASE("ua cuda fp8 storage with a rank rule: KeepTop past the one-block decode", "[ua][cuda][fp8][compose]") {
  if (no_device()) return;
  // the decode cut kernel reads fp8 rows with their scales; a seed whose smallest gap at a rank cut is
  // ten times the fp32 drift of λ over the sequence (test_ua_cuda_prune.cu)
  const Case c = bf16_queries(fp8_stored(random_case(1, 420, 8, 2, 128, 18)));
  const FloatCase f(c);
  ref::Config rc = c.config;
  rc.prefill_chunk = 64;
  rc.prefill_split = 300;
  const auto ref = kvmem::reference::ua::pruned(rc, c.inputs, 0.0, 260);
  INFO("smallest λ gap at a rank cut " << ref.rank_margin);
  REQUIRE(ref.rank_margin > 1e-3);
  DevCase d(f);
  kvmem::cuda::UaCache<e4m3> cache;
  REQUIRE(kvmem::cuda::UaCache<e4m3>::create(f.cache_shape(), cache).is_ok());
  Dev<float> out(f.make_out().size());
  const kvmem::cuda::Executor exec{};
  const kua::Options opt{0.0, 64, true};
  REQUIRE(kua::prefill(exec, cache, d.slice(0, 300), opt, kvmem::prune::KeepTop{260}, d.out_slice(out.ptr, 0, 300))
              .is_ok());
  for (std::int64_t t = 300; t < c.config.T; ++t)
    REQUIRE(kua::decode(exec, cache, d.slice(t, t + 1), opt, kvmem::prune::KeepTop{260}, d.out_slice(out.ptr, t, t + 1))
                .is_ok());
  KVMEM_CUDA_REQUIRE(cudaDeviceSynchronize());
  const Run gpu = kept_of(cache, c.config.T);
  CHECK(gpu.kept == ref.kept);
  CHECK(gpu.longest == 260);
  KVMEM_CHECK_CLOSE(out.get(), ref.out, kFp32Tol);
}

TEST_CASE("ua cuda fp8 storage on bf16 inputs: the documented tolerance, and the host's fp8 rows", "[ua][cuda][fp8]") {
  if (no_device()) return;
  const Case c = bf16_inputs(random_case(1, 400, 8, 2, 128, 91));
  const FloatCase f(c);
  const auto dense = kvmem::reference::ua::dense(c.config, c.inputs);
  const Run gpu = cuda_fp8_run(f, 250, f.cache_shape(), kua::Options{0.0, 64, true});
  const double err = relative_frobenius(gpu.out, dense.out);
  std::printf("ua cuda fp8 dense relative Frobenius against fp64: %.4f\n", err);
  INFO("fp8 dense relative Frobenius " << err);
  CHECK(err < kFp8DenseTol);
  CHECK(err > 1e-3);  // the rows really are fp8
  // The host's fp8 cache stores the same rows from the same values: the runs agree at fp32 rounding.
  kua::PrunedCache<e4m3> host(f.cache_shape());
  const auto out_h = host_prefill_decode(f, 250, kua::Options{0.0, 64, true}, host);
  KVMEM_CHECK_CLOSE(gpu.out, out_h, kFp32Tol);
  ref::Config rc = c.config;
  rc.prefill_chunk = 64;
  rc.prefill_split = 250;
  const auto ref = kvmem::reference::ua::pruned(rc, c.inputs, 0.05);
  const Run pruned = cuda_fp8_run(f, 250, f.cache_shape(), kua::Options{0.05, 64, true});
  const double err_p = relative_frobenius(pruned.out, ref.out);
  std::printf("ua cuda fp8 pruned (p 0.05) relative Frobenius against fp64: %.4f\n", err_p);
  INFO("fp8 pruned relative Frobenius " << err_p);
  CHECK(err_p < kFp8PrunedTol);
}

TEST_CASE("ua cuda fp8: a step, copy_slots and a slot record keep the rows and their scales", "[ua][cuda][fp8]") {
  if (no_device()) return;
  const Case c = bf16_queries(fp8_stored(random_case(1, 200, 8, 2, 128, 33)));
  const FloatCase f(c);
  const std::int64_t H = 8, G = 2, D = 128, T = c.config.T;
  kvmem::cuda::UaCache<e4m3> cache;
  REQUIRE(kvmem::cuda::UaCache<e4m3>::create(kua::CacheShape{3, H, G, D, T, 16, 3 * G * 13}, cache).is_ok());
  const kvmem::cuda::Executor exec{};
  const kua::Options opt{0.05, 64, true};
  // Packed rows of sequence 0 of the case: [t0, t1) token-major.
  auto packed = [&](std::int64_t t0, std::int64_t t1, std::vector<bf16>& q, std::vector<bf16>& k, std::vector<bf16>& v,
                    std::vector<float>& zk, std::vector<float>& zq) {
    for (std::int64_t t = t0; t < t1; ++t) {
      for (std::int64_t h = 0; h < H; ++h)
        for (std::int64_t x = 0; x < D; ++x) q.push_back(kvmem::store_as<bf16>(f.q[std::size_t((h * T + t) * D + x)]));
      for (std::int64_t g = 0; g < G; ++g) {
        for (std::int64_t x = 0; x < D; ++x) {
          k.push_back(kvmem::store_as<bf16>(f.k[std::size_t((g * T + t) * D + x)]));
          v.push_back(kvmem::store_as<bf16>(f.v[std::size_t((g * T + t) * D + x)]));
        }
        zk.push_back(f.z_k[std::size_t(g * T + t)]);
        zq.push_back(f.z_q[std::size_t(g * T + t)]);
      }
    }
  };
  auto step = [&](std::int32_t slot, std::int64_t t0, std::int64_t t1) {
    std::vector<bf16> q, k, v;
    std::vector<float> zk, zq;
    packed(t0, t1, q, k, v, zk, zq);
    const std::int64_t N = t1 - t0;
    Dev<bf16> dq(q), dk(k), dv(v);
    Dev<float> dzk(zk), dzq(zq), out(std::size_t(N * H * D));
    Dev<std::int32_t> ds(std::vector<std::int32_t>{slot}), dst(std::vector<std::int32_t>{0, std::int32_t(N)});
    kua::PackedInputsOf<bf16> in;
    in.q = TensorView<const bf16, 3>(dq.ptr, {N, H, D});
    in.k = TensorView<const bf16, 3>(dk.ptr, {N, G, D});
    in.v = TensorView<const bf16, 3>(dv.ptr, {N, G, D});
    in.z_k = TensorView<const float, 2>(dzk.ptr, {N, G});
    in.z_q = TensorView<const float, 2>(dzq.ptr, {N, G});
    const kvmem::Rows rows{TensorView<const std::int32_t, 1>(ds.ptr, {1}),
                           TensorView<const std::int32_t, 1>(dst.ptr, {2})};
    REQUIRE(kua::step(exec, cache, rows, in, opt, TensorView<float, 3>(out.ptr, {N, H, D})).is_ok());
    REQUIRE(cache.step_status(exec).is_ok());
    return out.get();
  };
  (void)step(0, 0, 150);
  for (std::int64_t t = 150; t < 170; ++t) (void)step(0, t, t + 1);
  // fork slot 0 into slot 1: both continue alike, bit for bit
  Dev<std::int32_t> src(std::vector<std::int32_t>{0}), dst(std::vector<std::int32_t>{1});
  REQUIRE(kua::copy_slots(exec, cache, TensorView<const std::int32_t, 1>(src.ptr, {1}),
                          TensorView<const std::int32_t, 1>(dst.ptr, {1}))
              .is_ok());
  REQUIRE(cache.step_status(exec).is_ok());
  // the record of slot 0 into the host's fp8 cache
  std::vector<std::byte> record(kua::export_bytes(cache, 0));
  REQUIRE(!record.empty());
  REQUIRE(kua::export_slot(exec, cache, 0, record).is_ok());
  kua::PrunedCache<e4m3> host(kua::CacheShape{1, H, G, D, T, 16});
  REQUIRE(kua::import_slot(kvmem::host::Executor{1}, host, 0, record).is_ok());
  // and back into slot 2 of the device cache
  REQUIRE(kua::import_slot(exec, cache, 2, record).is_ok());
  std::vector<float> host_out = f.make_out();
  double worst = 0.0;
  for (std::int64_t t = 170; t < T; ++t) {
    const auto a = step(0, t, t + 1), b = step(1, t, t + 1), i = step(2, t, t + 1);
    REQUIRE(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
    REQUIRE(std::memcmp(a.data(), i.data(), a.size() * sizeof(float)) == 0);
    REQUIRE(
        kua::decode(kvmem::host::Executor{1}, host, f.slice(t, t + 1), opt, f.out_slice(host_out, t, t + 1)).is_ok());
    std::vector<float> h(host_out.begin() + t * H * D, host_out.begin() + (t + 1) * H * D);
    worst = std::max(worst, relative_frobenius(a, h));
  }
  INFO("worst relative Frobenius of a decode row against the host's fp8 cache " << worst);
  CHECK(worst < 1e-4);
}

TEST_CASE("ua cuda fp8 through ua::Attention<Set, Prune, Fp8Storage> gives the plain calls' bits", "[ua][cuda][fp8]") {
  if (no_device()) return;
  const Case c = random_case(1, 160, 8, 2, 64, 7);
  const FloatCase f(c);
  using Ua = kua::Attention<kvmem::decay::Universal, kvmem::prune::Threshold{0.05}, kvmem::precision::Fp8Storage, 64>;
  static_assert(std::is_same_v<Ua::storage_type, e4m3>);
  DevCase d(f);
  const kvmem::cuda::Executor exec{};
  kvmem::cuda::UaCache<e4m3> composed, plain;
  REQUIRE(kvmem::cuda::UaCache<e4m3>::create(f.cache_shape(), composed).is_ok());
  REQUIRE(kvmem::cuda::UaCache<e4m3>::create(f.cache_shape(), plain).is_ok());
  Dev<float> out_a(f.make_out().size()), out_b(f.make_out().size());
  REQUIRE(Ua::prefill(exec, composed, d.slice(0, 100), d.out_slice(out_a.ptr, 0, 100), Ua::options(32)).is_ok());
  REQUIRE(
      kua::prefill(exec, plain, d.slice(0, 100), kua::Options{0.05, 32, true}, d.out_slice(out_b.ptr, 0, 100)).is_ok());
  for (std::int64_t t = 100; t < c.config.T; ++t) {
    REQUIRE(Ua::decode(exec, composed, d.slice(t, t + 1), d.out_slice(out_a.ptr, t, t + 1), Ua::options(32)).is_ok());
    REQUIRE(kua::decode(exec, plain, d.slice(t, t + 1), kua::Options{0.05, 32, true}, d.out_slice(out_b.ptr, t, t + 1))
                .is_ok());
  }
  const auto a = out_a.get(), b = out_b.get();
  CHECK(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
}
