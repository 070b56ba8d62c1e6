// SPDX-License-Identifier: Apache-2.0
// Universal Attention on the CUDA backend: every public UA golden in fp32 (out, lse, lambda_last,
// out_decode, the pruned outputs and exact kept sets for p = 0.05 / 0.15), random cases in bf16 at
// head dims 80 and 128 against the host backend, decode == prefill, pruned == dense as p -> 0, the
// output gate, and validation. Tags: [boundary] the eviction boundary (p = 1, λ exactly at ln p, p just
// above 0), [nearties] reduced-precision runs whose every kept-set difference is accounted as a near-tie
// (tests/support/near_ties.hpp). Skips, saying so, when no CUDA device is visible.
#include "kvmem/backend/cuda/vendor.cuh"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <iostream>
#include <limits>
#include <numeric>
#include <string>
#include <utility>
#include <vector>

#include <catch2/catch.hpp>

#include "cuda/cuda_test_support.hpp"
#include "kvmem/backend/cuda/ua.cuh"
#include "support/golden.hpp"
#include "support/near_ties.hpp"
#include "ua/ua_boundary_cases.hpp"
#include "ua/ua_host_support.hpp"
#include "ua/ua_lifetime_set.hpp"

namespace {
using kvmem::TensorView;
using namespace kvmem::test;
using namespace kvmem::test::cuda;
using namespace kvmem::test::ua;

// The values a storage type S can hold (host runs see exactly what the device sees).
template <class S>
std::vector<float> rounded(const std::vector<float>& x) {
  std::vector<float> y(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) y[i] = kvmem::load_as<float>(kvmem::store_as<S>(x[i]));
  return y;
}
// Rounds the inputs a device call stores in S (q, k, v and the output-gate logits) in place.
template <class S>
void round_inputs_to(FloatCase& f) {
  f.q = rounded<S>(f.q);
  f.k = rounded<S>(f.k);
  f.v = rounded<S>(f.v);
  f.z_o = rounded<S>(f.z_o);
}

// A FloatCase's tensors in device memory (q, k, v, z_o in S; gate logits fp32) and views of token ranges.
template <class S>
struct DevCase {
  const FloatCase& f;
  Dev<S> q, k, v, z_o;
  Dev<float> z_k, z_q;
  explicit DevCase(const FloatCase& fc)
      : f(fc),
        q(as_storage<S>(fc.q)),
        k(as_storage<S>(fc.k)),
        v(as_storage<S>(fc.v)),
        z_o(as_storage<S>(fc.z_o)),
        z_k(fc.z_k),
        z_q(fc.z_q) {}
  kvmem::cuda::UaInputs<S> slice(std::int64_t t0, std::int64_t t1) const {
    const auto& c = f.c;
    // the shapes name c.B and t1 - t0 in place: nvcc (#177) reports a local used only as a bare element
    // of a braced shape as never referenced
    const std::int64_t H = c.H, G = c.G, T = c.T, D = c.D;
    kvmem::cuda::UaInputs<S> in;
    in.q = {q.ptr + t0 * D, {c.B, H, t1 - t0, D}, {H * T * D, T * D, D, 1}};
    in.k = {k.ptr + t0 * D, {c.B, G, t1 - t0, D}, {G * T * D, T * D, D, 1}};
    in.v = {v.ptr + t0 * D, {c.B, G, t1 - t0, D}, {G * T * D, T * D, D, 1}};
    in.z_k = {z_k.ptr + t0, {c.B, G, t1 - t0}, {G * T, T, 1}};
    in.z_q = {z_q.ptr + t0, {c.B, G, t1 - t0}, {G * T, T, 1}};
    if (!f.z_o.empty()) in.z_o = {z_o.ptr + t0 * H * D, {c.B, t1 - t0, H, D}, {T * H * D, H * D, D, 1}};
    return in;
  }
  TensorView<float, 4> out_slice(float* out, std::int64_t t0, std::int64_t t1) const {
    const std::int64_t H = f.c.H, T = f.c.T, D = f.c.D;
    return {out + t0 * H * D, {f.c.B, t1 - t0, H, D}, {T * H * D, H * D, D, 1}};
  }
};

// Outputs of two runs that differ in any bit (same length).
std::size_t differing_bits(const std::vector<float>& a, const std::vector<float>& b) {
  std::size_t n = 0;
  for (std::size_t x = 0; x < a.size(); ++x) n += std::memcmp(&a[x], &b[x], sizeof(float)) != 0;
  return n;
}

struct CudaRun {
  std::vector<float> out;
  std::vector<std::int64_t> kept;  // [B,G,T] 0/1 membership after the last token
  std::vector<std::int64_t> lengths;
  std::vector<double> lambda;  // [B,G,T] the cache's λ of each kept position, NaN elsewhere
};

// Chunked prefill of [0, split), then decode of [split, T), all with `opt` (the goldens' pruned run).
// first_call > 0: the prefill is two calls, [0, first_call) and [first_call, split).
// length_trace: when given, every item's kept length after each decode step is appended to it, and to
// in_use_trace (when given) its rows in use (kept rows and dead rows awaiting compaction).
// pool_pages > 0: the cache's rows live in a shared pool of that many pages, and after every decode step
// each item holds exactly the pages of its rows in use and the pool's counters balance.
// decode_opt: when given, the decode steps' options (the prefill keeps `opt`).
template <class S, class Set = kvmem::decay::Universal>
CudaRun cuda_prefill_decode(const FloatCase& f, std::int64_t split, const kvmem::ua::Options& opt,
                            kvmem::cuda::UaCacheLimits limits = {}, std::int64_t first_call = 0,
                            std::vector<std::int64_t>* length_trace = nullptr,
                            std::vector<std::int64_t>* in_use_trace = nullptr, std::int64_t pool_pages = 0,
                            const kvmem::ua::Options* decode_opt = nullptr) {
  const auto& c = f.c;
  DevCase<S> d(f);
  kvmem::cuda::UaCache<S> cache;
  kvmem::ua::CacheShape shape = f.cache_shape();
  shape.pool_pages = pool_pages;
  const auto created = kvmem::cuda::UaCache<S>::create(shape, cache, limits);
  INFO(created.to_string());
  REQUIRE(created.is_ok());
  Dev<float> out(std::vector<float>(std::size_t(c.B * c.T * c.H * c.D), -7.0f));  // poisoned
  const kvmem::cuda::Executor exec{};
  for (const auto& [t0, t1] : {std::pair{std::int64_t(0), first_call}, std::pair{first_call, split}}) {
    if (t1 <= t0) continue;
    const auto s = kvmem::cuda::ua_prefill<Set>(exec, cache, d.slice(t0, t1), opt, d.out_slice(out.ptr, t0, t1));
    INFO(s.to_string());
    REQUIRE(s.is_ok());
  }
  for (std::int64_t t = split; t < c.T; ++t) {
    const auto s = kvmem::cuda::ua_decode<Set>(exec, cache, d.slice(t, t + 1), decode_opt ? *decode_opt : opt,
                                               d.out_slice(out.ptr, t, t + 1));
    INFO(s.to_string());
    REQUIRE(s.is_ok());
    if (length_trace) {
      std::vector<std::int64_t> len;
      REQUIRE(cache.lengths(len, exec.stream).is_ok());
      length_trace->insert(length_trace->end(), len.begin(), len.end());
    }
    if (in_use_trace || pool_pages > 0) {
      std::vector<std::int64_t> rows(std::size_t(c.B * c.G));
      KVMEM_CUDA_REQUIRE(
          cudaMemcpy(rows.data(), cache.device().length, rows.size() * sizeof(std::int64_t), cudaMemcpyDeviceToHost));
      if (in_use_trace) in_use_trace->insert(in_use_trace->end(), rows.begin(), rows.end());
      if (pool_pages > 0) {
        std::vector<std::int64_t> held;
        REQUIRE(cache.pages(exec, held).is_ok());
        for (std::size_t i = 0; i < rows.size(); ++i) {
          INFO("decode token " << t << ", item " << i << ", rows in use " << rows[i]);
          CHECK(held[i] == (rows[i] + shape.page_rows - 1) / shape.page_rows);
        }
        CHECK(cache.pages_taken() - cache.pages_returned() == cache.pages_in_use());
      }
    }
  }
  KVMEM_CUDA_REQUIRE(cudaDeviceSynchronize());
  CudaRun r;
  r.out = out.get();
  r.kept.assign(std::size_t(c.B * c.G * c.T), 0);
  r.lambda.assign(r.kept.size(), std::numeric_limits<double>::quiet_NaN());
  for (std::int64_t b = 0; b < c.B; ++b) {
    CHECK(cache.position(b) == c.T);
    for (std::int64_t g = 0; g < c.G; ++g) {
      std::vector<std::int64_t> pos;
      std::vector<float> lam;
      REQUIRE(cache.download(b, g, pos, lam, nullptr, nullptr, nullptr).is_ok());
      r.lengths.push_back(std::int64_t(pos.size()));
      for (std::size_t e = 0; e < pos.size(); ++e) {
        if (e > 0) CHECK(pos[e] > pos[e - 1]);  // ascending, stable compaction
        REQUIRE(pos[e] >= 0);
        REQUIRE(pos[e] < c.T);
        r.kept[std::size_t((b * c.G + g) * c.T + pos[e])] = 1;
        r.lambda[std::size_t((b * c.G + g) * c.T + pos[e])] = lam[e];
      }
    }
  }
  return r;
}

struct CudaDense {
  std::vector<float> out, lse, lambda_last;
};
template <class S>
CudaDense cuda_forward(const FloatCase& f) {
  const auto& c = f.c;
  DevCase<S> d(f);
  Dev<float> out(std::size_t(c.B * c.T * c.H * c.D)), lse(std::size_t(c.B * c.H * c.T)),
      lam(std::size_t(c.B * c.G * c.T));
  const auto s = kvmem::cuda::ua_forward(kvmem::cuda::Executor{}, d.slice(0, c.T), d.out_slice(out.ptr, 0, c.T),
                                         TensorView<float, 3>(lse.ptr, {c.B, c.H, c.T}),
                                         TensorView<float, 3>(lam.ptr, {c.B, c.G, c.T}));
  INFO(s.to_string());
  REQUIRE(s.is_ok());
  return {out.get(), lse.get(), lam.get()};
}

// Kept-set comparison: exact, except keys whose λ at the last token (fp64 reference, decay set Set) lies
// within `band` of ln p (spec UA.md 6.12: don't-care when the other side rounds differently); the
// count of those is returned in `excluded`.
template <class Set = kvmem::decay::Universal>
std::int64_t kept_mismatches(const Case& c, const std::vector<std::int64_t>& a, const std::vector<std::int64_t>& b,
                             double p, double band, std::int64_t& excluded) {
  std::int64_t bad = 0;
  excluded = 0;
  const std::int64_t T = c.config.T;
  for (std::int64_t bb = 0; bb < c.config.B; ++bb)
    for (std::int64_t g = 0; g < c.config.G; ++g) {
      const auto lam = kvmem::reference::ua::cumulative_decay<Set>(c.config, c.inputs, bb, g);
      for (std::int64_t j = 0; j < T; ++j) {
        const std::size_t e = std::size_t((bb * c.config.G + g) * T + j);
        if (a[e] == b[e]) continue;
        if (std::abs(lam[std::size_t((T - 1) * T + j)] - std::log(p)) < band)
          ++excluded;
        else
          ++bad;
      }
    }
  return bad;
}

constexpr double kTolFp32 = 1e-5;  // golden README: max |x - ref| <= 1e-5 * max(1, max |ref|)

// The values both backends see in a reduced-precision run: the case with FloatCase's keys (rounded to
// the storage type by round_inputs_to) and its fp32 gate logits.
Case stored_case(const Case& c, const FloatCase& f) {
  Case s = c;
  s.inputs.k.assign(f.k.begin(), f.k.end());
  s.inputs.z_k.assign(f.z_k.begin(), f.z_k.end());
  s.inputs.z_q.assign(f.z_q.begin(), f.z_q.end());
  return s;
}

// Kept sets of a reduced-precision device run and the host run on the same stored values may differ
// only at keys whose fp32 λ interval contains ln p (tests/support/near_ties.hpp derives it); the
// near-ties are counted and printed, any other difference fails. Returns the account.
// fold_abs: lambda_interval's extra error per pair (the dense tensor-core prefill: kDnDecayAbsError).
template <class Set = kvmem::decay::Universal>
near_ties::KeptAccount check_kept_near_ties(const Case& c, const FloatCase& f, const std::vector<std::int64_t>& gpu,
                                            const std::vector<std::int64_t>& host, double p, const std::string& label,
                                            double fold_abs = 0.0) {
  const Case s = stored_case(c, f);
  const auto acc = near_ties::account_kept<Set>(s.config, s.inputs, gpu, host, p, fold_abs);
  std::printf("ua cuda %s: %s\n", label.c_str(), acc.summary().c_str());
  INFO(label << ": " << acc.summary() << "; first unexplained: " << acc.first_beyond);
  CHECK(acc.keys == c.config.B * c.config.G * c.config.T);
  CHECK(acc.beyond == 0);
  return acc;
}
}  // namespace

TEST_CASE("ua cuda fp32 matches every public UA golden", "[ua][cuda][golden]") {
  if (no_device()) return;
  const auto files = golden_files("ua");
  REQUIRE(files.size() >= 3);
  for (const auto& path : files) {
    const Golden g = load_golden(path);
    const Case c = from_golden(g);
    const FloatCase f(c);
    INFO(g.name);
    const auto dense = cuda_forward<float>(f);
    KVMEM_CHECK_CLOSE(dense.out, g.f64("out"), kTolFp32);
    KVMEM_CHECK_CLOSE(dense.lse, g.f64("lse"), kTolFp32);
    KVMEM_CHECK_CLOSE(dense.lambda_last, g.f64("lambda_last"), kTolFp32);
    const auto decoded = cuda_prefill_decode<float>(f, 0, kvmem::ua::Options{});
    KVMEM_CHECK_CLOSE(decoded.out, g.f64("out_decode"), kTolFp32);
    std::cout << g.name << " cuda fp32 rel err: out " << deviation(dense.out, g.f64("out")).relative() << " lse "
              << deviation(dense.lse, g.f64("lse")).relative() << " lambda_last "
              << deviation(dense.lambda_last, g.f64("lambda_last")).relative() << " out_decode "
              << deviation(decoded.out, g.f64("out_decode")).relative();
    for (const auto& [p, tag] : {std::pair{0.05, "p005"}, std::pair{0.15, "p015"}}) {
      const kvmem::ua::Options opt{p, c.config.prefill_chunk, c.config.evict_before_attention};
      const auto r = cuda_prefill_decode<float>(f, c.config.prefill_split, opt);
      KVMEM_CHECK_CLOSE(r.out, g.f64(std::string("out_pruned_") + tag), kTolFp32);
      std::int64_t excluded = 0;
      const auto bad = kept_mismatches(c, r.kept, g.i64(std::string("kept_") + tag), p, 1e-9, excluded);
      INFO(tag << ": " << bad << " kept-set mismatches, " << excluded << " within 1e-9 of ln p");
      CHECK(bad == 0);
      CHECK(excluded == 0);  // the README guarantees margins >= 6e-4
      std::cout << " out_pruned_" << tag << " " << deviation(r.out, g.f64(std::string("out_pruned_") + tag)).relative();
    }
    std::cout << "\n";
  }
}

TEST_CASE("ua cuda G0 worked example: chunked prefill kept sets and decode orders", "[ua][cuda][sanitize]") {
  if (no_device()) return;
  const Case c = g0_case(4);
  const FloatCase f(c);
  // spec UA.md 8: chunk 4, kept after t = 15: p = 0.05 -> {4, 5, 10, 13, 14, 15}; p = 0.15 -> {14, 15}
  for (const auto& [p, want] : {std::pair{0.05, std::vector<std::int64_t>{4, 5, 10, 13, 14, 15}},
                                std::pair{0.15, std::vector<std::int64_t>{14, 15}}}) {
    const auto r = cuda_prefill_decode<float>(f, 16, kvmem::ua::Options{p, 4, true});
    std::vector<std::int64_t> kept;
    for (std::int64_t j = 0; j < 16; ++j)
      if (r.kept[std::size_t(j)]) kept.push_back(j);
    INFO("p " << p);
    CHECK(kept == want);
  }
  // decode from an empty cache, O(h0, t=15), both eviction orders (spec UA.md 8)
  const std::vector<std::pair<kvmem::ua::Options, std::vector<double>>> decode_cases = {
      {{0.05, 128, true}, {-0.409134, -0.714472, -0.770225, -0.556915}},
      {{0.05, 128, false}, {-0.461722, -0.735490, -0.752331, -0.506360}},
      {{0.15, 128, true}, {-0.232012, -0.729708, -0.972495, -0.875562}},
      {{0.15, 128, false}, {-0.342484, -0.784143, -0.951878, -0.787095}}};
  for (const auto& [opt, want] : decode_cases) {
    const auto r = cuda_prefill_decode<float>(f, 0, opt);
    INFO("p " << opt.p << " evict_before_attention " << opt.evict_before_attention);
    for (std::int64_t d = 0; d < 4; ++d)
      CHECK(r.out[std::size_t((15 * 2 + 0) * 4 + d)] == Approx(want[std::size_t(d)]).margin(2e-6));
  }
}

TEST_CASE("ua cuda decode equals prefill, pruned equals dense as p -> 0 (fp32)", "[ua][cuda][sanitize]") {
  if (no_device()) return;
  const Case c = random_case(2, 150, 4, 2, 32, 11);
  const FloatCase f(c);
  const auto dense = cuda_forward<float>(f);
  const auto host = host_forward(f);
  KVMEM_CHECK_CLOSE(dense.out, host.out, 1e-5);
  KVMEM_CHECK_CLOSE(dense.lambda_last, host.lambda_last, 1e-5);
  for (std::int64_t split : {0, 1, 37, 128, 149}) {
    INFO("split " << split);
    const auto r = cuda_prefill_decode<float>(f, split, kvmem::ua::Options{0.0, 32, true});
    KVMEM_CHECK_CLOSE(r.out, dense.out, 1e-5);
    for (auto len : r.lengths) CHECK(len == c.config.T);  // p = 0 never evicts
  }
  const auto tiny = cuda_prefill_decode<float>(f, 100, kvmem::ua::Options{1e-30, 32, true});
  KVMEM_CHECK_CLOSE(tiny.out, dense.out, 1e-5);
  for (auto len : tiny.lengths) CHECK(len == c.config.T);  // λ >= 149 ln 1e-6 > ln 1e-30
}

TEST_CASE("ua cuda fp32 pruned prefill and decode match the host backend (GQA, output gate, several chunks)",
          "[ua][cuda]") {
  if (no_device()) return;
  for (const bool gate : {false, true}) {
    const Case c = random_case(2, 300, 8, 2, 64, 21, 1.0, gate);
    const FloatCase f(c);
    for (double p : {0.05, 0.15}) {
      const kvmem::ua::Options opt{p, 64, true};
      kvmem::ua::PrunedCache<float> hc(f.cache_shape());
      const auto host = host_prefill_decode(f, 200, opt, hc);
      const auto gpu = cuda_prefill_decode<float>(f, 200, opt);
      INFO("gate " << gate << " p " << p);
      KVMEM_CHECK_CLOSE(gpu.out, host, 1e-5);
      std::int64_t excluded = 0;
      CHECK(kept_mismatches(c, gpu.kept, kept_mask(hc, c.config.T), p, 1e-4, excluded) == 0);
      CHECK(excluded <= 1);
    }
  }
}

TEST_CASE("ua cuda bf16 storage agrees with the host backend at head dims 80 and 128", "[ua][cuda][nearties]") {
  if (no_device()) return;
  // r = 4 runs the tensor-core chunk kernel, which rounds the probabilities to bf16 before p.v (as
  // FlashAttention does): agreement to bf16 precision. r = 2 runs the CUDA-core kernel on the same bf16
  // operands: agreement to fp32 summation order.
  struct Shape {
    std::int64_t dim, H, G;
    double tol;
  };
  // At r = 4 the prefill takes the dense tensor-core kernel with its masks (default limits) or the chunk
  // kernel (dense_prune_rows = 0); the dense fold's A is within kDnDecayAbsError of the spec's.
  for (const Shape& sh : {Shape{80, 16, 4, 1e-2}, Shape{128, 16, 4, 1e-2}, Shape{128, 8, 4, 1e-4}}) {
    const std::int64_t dim = sh.dim;
    Case c = random_case(2, 400, sh.H, sh.G, dim, 31 + std::uint32_t(dim));
    FloatCase f(c);
    round_inputs_to<kvmem::bf16>(f);  // host and device see the same bf16 inputs
    for (double p : {0.05, 0.15}) {
      const kvmem::ua::Options opt{p, 128, true};
      kvmem::ua::PrunedCache<kvmem::bf16> hc(f.cache_shape());
      const auto host = host_prefill_decode(f, 300, opt, hc);
      for (const bool dense : {true, false}) {
        kvmem::cuda::UaCacheLimits limits;
        if (!dense) limits.dense_prune_rows = 0;
        const auto gpu = cuda_prefill_decode<kvmem::bf16>(f, 300, opt, limits);
        const double e = relative_frobenius(gpu.out, host);
        const std::string label = "bf16 D=" + std::to_string(dim) + " r=" + std::to_string(sh.H / sh.G) +
                                  " p=" + std::to_string(p) + (dense ? " dense" : " chunks");
        check_kept_near_ties(c, f, gpu.kept, kept_mask(hc, c.config.T), p, label,
                             dense ? kvmem::cuda::ua_detail::kDnDecayAbsError : 0.0);
        INFO(label << ": out relative Frobenius " << e);
        CHECK(e <= sh.tol);
      }
    }
  }
}

TEST_CASE("ua cuda rejects bad calls before touching the cache", "[ua][cuda]") {
  if (no_device()) return;
  const Case c = random_case(1, 8, 2, 1, 16, 3);
  const FloatCase f(c);
  DevCase<float> d(f);
  Dev<float> out(std::size_t(8 * 2 * 16));
  kvmem::cuda::UaCache<float> cache;
  REQUIRE(kvmem::cuda::UaCache<float>::create({1, 2, 1, 16, 8, 16}, cache).is_ok());
  const kvmem::cuda::Executor exec{};
  auto in = d.slice(0, 8);
  in.v = {d.v.ptr, {1, 1, 8, 8}};
  const auto wrong_v = kvmem::cuda::ua_prefill(exec, cache, in, {}, d.out_slice(out.ptr, 0, 8));
  CHECK(wrong_v.code() == kvmem::StatusCode::kInvalidArgument);
  CHECK(wrong_v.message() == "v [B,G,T,D] shape: expected [1,1,8,16], got [1,1,8,8]");
  const auto big_chunk = kvmem::cuda::ua_prefill(exec, cache, d.slice(0, 8), kvmem::ua::Options{0.0, 256, true},
                                                 d.out_slice(out.ptr, 0, 8));
  CHECK(big_chunk.code() == kvmem::StatusCode::kInvalidArgument);
  CHECK(big_chunk.message().find("max_prefill_chunk = 128") != std::string::npos);
  const auto two_tokens = kvmem::cuda::ua_decode(exec, cache, d.slice(0, 2), {}, d.out_slice(out.ptr, 0, 2));
  CHECK(two_tokens.code() == kvmem::StatusCode::kInvalidArgument);
  CHECK(cache.position(0) == 0);
  // capacity: 8 rows, a dense prefill of 8 fits, a 9th token does not (checked against the true length)
  REQUIRE(kvmem::cuda::ua_prefill(exec, cache, d.slice(0, 8), {}, d.out_slice(out.ptr, 0, 8)).is_ok());
  const auto ninth = kvmem::cuda::ua_decode(exec, cache, d.slice(7, 8), {}, d.out_slice(out.ptr, 7, 8));
  CHECK(ninth.code() == kvmem::StatusCode::kOutOfRange);
  INFO(ninth.message());
  CHECK(ninth.message().find("capacity") != std::string::npos);
  CHECK(cache.position(0) == 8);
  CHECK(cache.length_bound() == 8);
  // limits that make no sense are refused at creation, with the field named
  for (auto [field, limits] :
       {std::pair{"dense_skip_past_after_tiles", kvmem::cuda::UaCacheLimits{.dense_skip_past_after_tiles = -1}},
        std::pair{"dense_item_group", kvmem::cuda::UaCacheLimits{.dense_item_group = -1}}}) {
    kvmem::cuda::UaCache<float> refused;
    const auto made = kvmem::cuda::UaCache<float>::create({1, 2, 1, 16, 8, 16}, refused, limits);
    INFO(made.message());
    CHECK(made.code() == kvmem::StatusCode::kInvalidArgument);
    CHECK(made.message().find(field) != std::string::npos);
  }
}

TEST_CASE("ua cuda capacity below the prompt: pruning keeps the cache small across calls", "[ua][cuda]") {
  if (no_device()) return;
  // capacity 96 rows for a 400-token prompt fed in calls of 64 tokens: the host bound would overflow,
  // so calls read the true lengths back and continue; outputs equal one host prefill of 400 tokens.
  const Case c = random_case(1, 400, 4, 2, 32, 5, 2.0);
  const FloatCase f(c);
  const kvmem::ua::Options opt{0.15, 64, true};
  kvmem::ua::PrunedCache<float> hc(f.cache_shape());
  const auto host = host_prefill_decode(f, 400, opt, hc);
  INFO("host max length " << hc.max_length());
  REQUIRE(hc.max_length() + 64 <= 96);  // the case keeps few keys, so it fits
  DevCase<float> d(f);
  kvmem::cuda::UaCache<float> cache;
  REQUIRE(kvmem::cuda::UaCache<float>::create(f.cache_shape(96), cache).is_ok());
  Dev<float> out(std::size_t(400 * 4 * 32));
  for (std::int64_t t0 = 0; t0 < 400; t0 += 64) {
    const std::int64_t t1 = std::min<std::int64_t>(400, t0 + 64);
    const auto s =
        kvmem::cuda::ua_prefill(kvmem::cuda::Executor{}, cache, d.slice(t0, t1), opt, d.out_slice(out.ptr, t0, t1));
    INFO(s.to_string());
    REQUIRE(s.is_ok());
  }
  KVMEM_CHECK_CLOSE(out.get(), host, 1e-5);
}

TEST_CASE("ua cuda bf16 tensor-core chunk kernel at a small shape (sanitizer case)", "[ua][cuda][sanitize][nearties]") {
  if (no_device()) return;
  // r = 4, D = 64: the tensor-core chunk kernel (dense_prune_rows = 0: not the dense kernel), a ragged last
  // chunk, entry splits, then decode
  Case c = random_case(1, 203, 8, 2, 64, 77);
  FloatCase f(c);
  round_inputs_to<kvmem::bf16>(f);  // host and device see the same bf16 inputs
  const kvmem::ua::Options opt{0.05, 64, true};
  kvmem::ua::PrunedCache<kvmem::bf16> hc(f.cache_shape());
  const auto host = host_prefill_decode(f, 170, opt, hc);
  kvmem::cuda::UaCacheLimits chunks;
  chunks.dense_prune_rows = 0;
  const auto gpu = cuda_prefill_decode<kvmem::bf16>(f, 170, opt, chunks);
  const double e = relative_frobenius(gpu.out, host);
  check_kept_near_ties(c, f, gpu.kept, kept_mask(hc, c.config.T), 0.05, "bf16 tensor-core chunk kernel, small");
  INFO("out relative Frobenius " << e);
  CHECK(e <= 1e-2);
}

namespace {
// A user gate (DESIGN.md 2): forget faster the further apart the tokens are; the kernels pick it up
// through the decay::Set like the built-in gates.
struct DistanceGate {
  template <class Real>
  KVMEM_HOST_DEVICE static Real log_factor(const kvmem::decay::PairInputs<Real>& in) {
    return -Real(0.05) * static_cast<Real>(in.position - in.key_position);
  }
};
using DistanceSet = kvmem::decay::Set<kvmem::decay::KeyGate, DistanceGate>;  // no similarity products
using UniversalPlusDistance =
    kvmem::decay::Set<kvmem::decay::QueryGate, kvmem::decay::KeyGate, kvmem::decay::SimilarityGate, DistanceGate>;
}  // namespace

TEST_CASE("ua cuda user decay gates: fp32 against the fp64 reference, bf16 tensor cores against the host",
          "[ua][cuda][nearties]") {
  if (no_device()) return;
  {  // CUDA-core kernels, a set without the similarity gate
    Case c = random_case(1, 90, 2, 1, 8, 131);
    c.config.prefill_chunk = 16;
    c.config.prefill_split = 60;
    const FloatCase f(c);
    const auto ref = kvmem::reference::ua::pruned<DistanceSet>(c.config, c.inputs, 0.05);
    const auto gpu = cuda_prefill_decode<float, DistanceSet>(f, 60, kvmem::ua::Options{0.05, 16, true});
    KVMEM_CHECK_CLOSE(gpu.out, ref.out, kTolFp32);
    CHECK(gpu.kept == ref.kept);
    CHECK(gpu.lengths[0] < 90);
  }
  {  // tensor-core chunk kernel (bf16, r = 4): the paper's gates plus the user gate
    Case c = random_case(1, 260, 8, 2, 64, 133);
    FloatCase f(c);
    round_inputs_to<kvmem::bf16>(f);  // host and device see the same bf16 inputs
    const kvmem::ua::Options opt{0.05, 64, true};
    kvmem::ua::PrunedCache<kvmem::bf16> hc(f.cache_shape());
    std::vector<float> host = f.make_out();
    REQUIRE(kvmem::ua::prefill<UniversalPlusDistance>(kvmem::host::Executor{2}, hc, f.slice(0, 200), opt,
                                                      f.out_slice(host, 0, 200))
                .is_ok());
    for (std::int64_t t = 200; t < 260; ++t)
      REQUIRE(kvmem::ua::decode<UniversalPlusDistance>(kvmem::host::Executor{2}, hc, f.slice(t, t + 1), opt,
                                                       f.out_slice(host, t, t + 1))
                  .is_ok());
    for (const bool dense : {true, false}) {  // the dense tensor-core prefill's masks, or the chunk kernel
      kvmem::cuda::UaCacheLimits limits;
      if (!dense) limits.dense_prune_rows = 0;
      const auto gpu = cuda_prefill_decode<kvmem::bf16, UniversalPlusDistance>(f, 200, opt, limits);
      const double e = relative_frobenius(gpu.out, host);
      INFO((dense ? "dense" : "chunks") << ": out relative Frobenius " << e);
      CHECK(e <= 1e-2);
      check_kept_near_ties<UniversalPlusDistance>(c, f, gpu.kept, kept_mask(hc, c.config.T), 0.05,
                                                  dense ? "bf16 user gates, dense" : "bf16 user gates, chunks",
                                                  dense ? kvmem::cuda::ua_detail::kDnDecayAbsError : 0.0);
    }
  }
}

TEST_CASE("ua cuda fp16 storage agrees with the host backend (CUDA-core kernels)", "[ua][cuda][nearties]") {
  if (no_device()) return;
  Case c = random_case(2, 300, 8, 2, 64, 151);
  FloatCase f(c);
  round_inputs_to<kvmem::fp16>(f);  // host and device see the same fp16 inputs
  const kvmem::ua::Options opt{0.05, 64, true};
  kvmem::ua::PrunedCache<kvmem::fp16> hc(f.cache_shape());
  const auto host = host_prefill_decode(f, 220, opt, hc);
  const auto gpu = cuda_prefill_decode<kvmem::fp16>(f, 220, opt);
  const double e = relative_frobenius(gpu.out, host);
  check_kept_near_ties(c, f, gpu.kept, kept_mask(hc, c.config.T), 0.05, "fp16");
  INFO("out relative Frobenius " << e);
  CHECK(e <= 1e-4);  // same fp16 operands, fp32 sums in a different order
}

TEST_CASE("ua cuda bf16 dense prefill (p = 0): the pipelined tensor-core kernel against the host", "[ua][cuda]") {
  if (no_device()) return;
  // p = 0 with bf16, D in {64, 80, 128} and r in {4, 8} takes dense_prefill_tc_kernel: every row of a call
  // in one launch, row tiles chained through λ. Several row tiles (ragged last one), several entry
  // tiles, a second call that starts from cached rows, then decode; probabilities are rounded to bf16
  // before p.v (tolerance 1e-2), λ and lse stay fp32.
  struct Shape {
    std::int64_t dim, H, G;
    bool gate;
  };
  for (const Shape& sh : {Shape{128, 16, 4, false}, Shape{80, 16, 4, true}, Shape{64, 16, 2, false}}) {
    Case c = random_case(2, 300, sh.H, sh.G, sh.dim, 41 + std::uint32_t(sh.dim), 1.0, sh.gate);
    FloatCase f(c);
    round_inputs_to<kvmem::bf16>(f);  // host and device see the same bf16 inputs
    const auto host = host_forward(f);
    const auto dense = cuda_forward<kvmem::bf16>(f);
    const double e_out = relative_frobenius(dense.out, host.out), e_lse = relative_frobenius(dense.lse, host.lse),
                 e_lam = relative_frobenius(dense.lambda_last, host.lambda_last);
    INFO("dim " << sh.dim << " r " << sh.H / sh.G << " gate " << sh.gate << ": out " << e_out << ", lse " << e_lse
                << ", lambda_last " << e_lam);
    CHECK(e_out <= 1e-2);
    CHECK(e_lse <= 1e-3);
    CHECK(e_lam <= 1e-4);
    const auto calls = cuda_prefill_decode<kvmem::bf16>(f, 250, kvmem::ua::Options{0.0, 128, true}, {}, 100);
    const double e_calls = relative_frobenius(calls.out, host.out);
    INFO("two prefill calls + decode: out " << e_calls);
    CHECK(e_calls <= 1e-2);
    for (auto len : calls.lengths) CHECK(len == c.config.T);  // p = 0 never evicts
    // the row tiles handed out in item groups (UaCacheLimits::dense_item_group; 8 items here: groups of 1,
    // and of 3 with a smaller last group) change only which block runs which row tile: the same bits
    const auto all_items = cuda_prefill_decode<kvmem::bf16>(f, c.config.T, kvmem::ua::Options{0.0, 128, true});
    for (int group : {1, 3}) {
      kvmem::cuda::UaCacheLimits grouped;
      grouped.dense_item_group = group;
      const auto run = cuda_prefill_decode<kvmem::bf16>(f, c.config.T, kvmem::ua::Options{0.0, 128, true}, grouped);
      const std::size_t differing = differing_bits(run.out, all_items.out);
      INFO("item group " << group << ": outputs differing from one group of every item " << differing);
      CHECK(differing == 0);
      CHECK(relative_frobenius(run.out, host.out) <= 1e-2);  // and not a shared wrong answer
    }
  }
}

namespace {
// A case with the stored values of a bf16 run (q, k, v, gate logits as FloatCase holds them after
// round_inputs_to): what the fp64 reference must see to be compared with it.
Case rounded_case(const Case& c, const FloatCase& f) {
  Case s = c;
  s.inputs.q.assign(f.q.begin(), f.q.end());
  s.inputs.k.assign(f.k.begin(), f.k.end());
  s.inputs.v.assign(f.v.begin(), f.v.end());
  s.inputs.z_k.assign(f.z_k.begin(), f.z_k.end());
  s.inputs.z_q.assign(f.z_q.begin(), f.z_q.end());
  s.inputs.z_o.assign(f.z_o.begin(), f.z_o.end());
  return s;
}

// Prefill calls over [0, first_call) and [first_call, split) (one call when first_call is 0), then decode to
// T, on the host with the same calls as cuda_prefill_decode (chunks count from each call's first row).
std::vector<float> host_calls_decode(const FloatCase& f, std::int64_t first_call, std::int64_t split,
                                     const kvmem::ua::Options& opt, kvmem::ua::PrunedCache<kvmem::bf16>& hc) {
  std::vector<float> out = f.make_out();
  const kvmem::host::Executor exec{2};
  for (const auto& [t0, t1] : {std::pair{std::int64_t(0), first_call}, std::pair{first_call, split}})
    if (t1 > t0) REQUIRE(kvmem::ua::prefill(exec, hc, f.slice(t0, t1), opt, f.out_slice(out, t0, t1)).is_ok());
  for (std::int64_t t = split; t < f.c.T; ++t)
    REQUIRE(kvmem::ua::decode(exec, hc, f.slice(t, t + 1), opt, f.out_slice(out, t, t + 1)).is_ok());
  return out;
}
}  // namespace

TEST_CASE("ua cuda bf16 pruned prefill on the dense tensor-core kernel: fp64 reference, host and chunk kernel",
          "[ua][cuda][nearties]") {
  if (no_device()) return;
  // p > 0 with bf16, r in {4, 8}, own pages and chunks of whole row tiles takes dense_prefill_tc_kernel with
  // the chunk-start masks, in launches of UaCacheLimits::dense_prune_rows rows, each followed by the kernel that
  // marks the evicted rows dead and compacts an item once they are a sixteenth of its rows.
  // T = 600 (not a multiple of 128): one prefill of 500 tokens, then decode. Against the fp64 reference on
  // the same bf16 values: outputs (relative Frobenius <= 1e-2, DESIGN.md 5), kept sets (near-ties only:
  // keys whose fp32 λ interval, widened by the dense fold's error per pair, contains ln p) and the λ of
  // every key both keep (inside that interval). Launches of 128 (= P: that kernel after every chunk), 256
  // (two launches and a ragged third) and 4096 rows (one) must all give that; the chunk kernel
  // (dense_prune_rows = 0) and the host too. Two prefill calls ([0, 200), [200, 500): the second call's
  // chunks start at 200) against the host's same two calls. D 128 r 4 and D 64 r 8 (wgmma), D 80 r 4
  // (mma.sync); the output gate on one shape.
  namespace ref = kvmem::reference::ua;
  const double fold = kvmem::cuda::ua_detail::kDnDecayAbsError;
  struct Shape {
    std::int64_t dim, H, G;
    bool gate;
  };
  constexpr std::int64_t kT = 600, kSplit = 500;
  for (const Shape& sh : {Shape{128, 16, 4, false}, Shape{64, 16, 2, true}, Shape{80, 8, 2, false}}) {
    Case c = random_case(2, kT, sh.H, sh.G, sh.dim, 211 + std::uint32_t(sh.dim), 1.0, sh.gate);
    FloatCase f(c);
    round_inputs_to<kvmem::bf16>(f);  // host, reference and device see the same bf16 inputs
    Case stored = rounded_case(c, f);
    stored.config.prefill_chunk = 128;
    stored.config.prefill_split = kSplit;
    const std::int64_t items = c.config.B * c.config.G;
    for (const double p : {0.05, 0.15, 0.5}) {
      const std::string label =
          "dense pruned D=" + std::to_string(sh.dim) + " r=" + std::to_string(sh.H / sh.G) + " p=" + std::to_string(p);
      INFO(label);
      const kvmem::ua::Options opt{p, 128, true};
      const auto reference = ref::pruned(stored.config, stored.inputs, p);
      const std::int64_t kept_ref = std::accumulate(reference.kept.begin(), reference.kept.end(), std::int64_t(0));
      INFO("reference keeps " << kept_ref << " of " << items * kT);
      REQUIRE(kept_ref > items);       // the case keeps keys beyond the newest
      REQUIRE(kept_ref < items * kT);  // and evicts
      for (const std::int64_t prune_rows : {std::int64_t(128), std::int64_t(256), std::int64_t(4096)}) {
        kvmem::cuda::UaCacheLimits limits;
        limits.dense_prune_rows = prune_rows;
        const auto gpu = cuda_prefill_decode<kvmem::bf16>(f, kSplit, opt, limits);
        const double e = relative_frobenius(gpu.out, reference.out);
        INFO("dense_prune_rows " << prune_rows << ": out relative Frobenius " << e);
        CHECK(e <= 1e-2);
        const auto acc = near_ties::account_kept(stored.config, stored.inputs, gpu.kept, reference.kept, p, fold);
        std::printf("ua cuda %s rows %lld vs fp64: %s\n", label.c_str(), (long long)prune_rows, acc.summary().c_str());
        INFO(acc.summary() << "; first unexplained: " << acc.first_beyond);
        CHECK(acc.beyond == 0);
        // every item's length is its kept count
        for (std::int64_t i = 0; i < items; ++i)
          CHECK(gpu.lengths[std::size_t(i)] ==
                std::accumulate(gpu.kept.begin() + i * kT, gpu.kept.begin() + (i + 1) * kT, std::int64_t(0)));
        if (prune_rows != 256) continue;
        // λ of the kept keys: inside their fp32 interval around the fp64 λ at the last token
        std::int64_t outside = 0, checked = 0;
        std::string first_outside;
        for (std::int64_t b = 0; b < c.config.B; ++b)
          for (std::int64_t g = 0; g < c.config.G; ++g)
            for (std::int64_t j = 0; j < kT; ++j) {
              const std::size_t x = std::size_t((b * c.config.G + g) * kT + j);
              if (!gpu.kept[x] || !reference.kept[x]) continue;
              const auto [lo, hi] = near_ties::lambda_interval(stored.config, stored.inputs, b, g, j, fold);
              ++checked;
              if ((gpu.lambda[x] < lo || gpu.lambda[x] > hi) && outside++ == 0)
                first_outside = "key " + std::to_string(x) + ": λ " + std::to_string(gpu.lambda[x]) + " outside [" +
                                std::to_string(lo) + ", " + std::to_string(hi) + "]";
            }
        INFO("kept λ checked " << checked << "; first outside its interval: " << first_outside);
        CHECK(checked > 0);
        CHECK(outside == 0);
      }
      // the chunk kernel, and two prefill calls, against the host
      kvmem::ua::PrunedCache<kvmem::bf16> hc(f.cache_shape());
      const auto host = host_calls_decode(f, 0, kSplit, opt, hc);
      kvmem::cuda::UaCacheLimits chunks;
      chunks.dense_prune_rows = 0;
      const auto chunked = cuda_prefill_decode<kvmem::bf16>(f, kSplit, opt, chunks);
      CHECK(relative_frobenius(chunked.out, host) <= 1e-2);
      check_kept_near_ties(c, f, chunked.kept, kept_mask(hc, kT), p, label + " chunk kernel vs host");
      kvmem::ua::PrunedCache<kvmem::bf16> hc2(f.cache_shape());
      const auto host2 = host_calls_decode(f, 200, kSplit, opt, hc2);
      kvmem::cuda::UaCacheLimits two;
      two.dense_prune_rows = 256;
      const auto calls = cuda_prefill_decode<kvmem::bf16>(f, kSplit, opt, two, 200);
      const double e2 = relative_frobenius(calls.out, host2);
      INFO("two prefill calls: out relative Frobenius " << e2);
      CHECK(e2 <= 1e-2);
      check_kept_near_ties(c, f, calls.kept, kept_mask(hc2, kT), p, label + " two calls vs host", fold);
      std::vector<std::int64_t> host_lengths;
      for (std::int64_t b = 0; b < c.config.B; ++b)
        for (std::int64_t g = 0; g < c.config.G; ++g) host_lengths.push_back(hc2.length(b, g));
      INFO("two prefill calls: lengths equal the host's unless a near-tie differs");
      if (calls.kept == kept_mask(hc2, kT)) CHECK(calls.lengths == host_lengths);
    }
  }
}

TEST_CASE("ua cuda bf16 pruned dense prefill: a capacity below the prompt, calls read the lengths back", "[ua][cuda]") {
  if (no_device()) return;
  // D 128, r 4, p = 0.5: calls of 100 tokens into a cache of capacity (longest kept before a call) + 100,
  // far below the 700 tokens (the host's capacity rule: room for kept rows + the call). Each call is one
  // dense launch and compaction; outputs equal the host's same calls, to bf16 precision.
  constexpr std::int64_t kT = 700, kCall = 100;
  Case c = random_case(1, kT, 16, 4, 128, 307);
  FloatCase f(c);
  round_inputs_to<kvmem::bf16>(f);
  const kvmem::ua::Options opt{0.5, 128, true};
  kvmem::ua::PrunedCache<kvmem::bf16> hc(f.cache_shape());
  std::vector<float> host = f.make_out();
  std::int64_t longest_before = 0;
  for (std::int64_t t0 = 0; t0 < kT; t0 += kCall) {
    longest_before = std::max(longest_before, hc.max_length());
    REQUIRE(kvmem::ua::prefill(kvmem::host::Executor{2}, hc, f.slice(t0, t0 + kCall), opt,
                               f.out_slice(host, t0, t0 + kCall))
                .is_ok());
  }
  const std::int64_t capacity = longest_before + kCall;
  INFO("capacity " << capacity);
  REQUIRE(capacity < kT / 2);
  DevCase<kvmem::bf16> d(f);
  kvmem::cuda::UaCache<kvmem::bf16> cache;
  REQUIRE(kvmem::cuda::UaCache<kvmem::bf16>::create(f.cache_shape(capacity), cache).is_ok());
  Dev<float> out(std::vector<float>(std::size_t(kT * 16 * 128), -7.0f));
  for (std::int64_t t0 = 0; t0 < kT; t0 += kCall) {
    const auto s = kvmem::cuda::ua_prefill(kvmem::cuda::Executor{}, cache, d.slice(t0, t0 + kCall), opt,
                                           d.out_slice(out.ptr, t0, t0 + kCall));
    INFO("call at " << t0 << ": " << s.to_string());
    REQUIRE(s.is_ok());
  }
  KVMEM_CUDA_REQUIRE(cudaDeviceSynchronize());
  const double e = relative_frobenius(out.get(), host);
  INFO("out relative Frobenius " << e);
  CHECK(e <= 1e-2);
  CHECK(cache.position(0) == kT);
}

TEST_CASE("ua cuda dense prefill: item groups hand out every row tile once, each after the one before it",
          "[ua][cuda]") {
  // host arithmetic only (no device needed): the launch's tickets 0 .. items * tiles - 1 map one to one
  // onto (row tile, item), and row tile k - 1 of an item has a smaller ticket than row tile k (the λ
  // pipeline's freedom from deadlock); groups of 1, a divisor, a non-divisor, all items, more than all
  namespace dn = kvmem::cuda::ua_detail;
  for (const std::int64_t items : {1, 7, 32})
    for (const std::int64_t tiles : {1, 5, 512})
      for (const std::int64_t group : {std::int64_t(1), std::int64_t(4), std::int64_t(12), items}) {
        const std::int64_t g = dn::dense_item_group_for(int(group), 132, items);
        std::vector<std::int64_t> ticket_of(std::size_t(items * tiles), -1);
        bool in_range = true;
        for (std::int64_t t = 0; t < items * tiles; ++t) {
          const auto [k, item] = dn::dense_ticket_tile(t, items, tiles, g);
          if (k < 0 || k >= tiles || item < 0 || item >= items) {
            in_range = false;
            break;
          }
          ticket_of[std::size_t(item * tiles + k)] = t;
        }
        INFO("items " << items << ", tiles " << tiles << ", group " << g);
        REQUIRE(in_range);
        CHECK(std::count(ticket_of.begin(), ticket_of.end(), -1) == 0);  // every row tile handed out
        std::int64_t out_of_order = 0;
        for (std::int64_t item = 0; item < items; ++item)
          for (std::int64_t k = 1; k < tiles; ++k)
            out_of_order += ticket_of[std::size_t(item * tiles + k - 1)] >= ticket_of[std::size_t(item * tiles + k)];
        CHECK(out_of_order == 0);
      }
  // the automatic group: the resident blocks over kDnRowTilesInFlight, at least 1, at most every item
  CHECK(dn::dense_item_group_for(0, 132, 32) == dn::kDnBlocksPerSM * 132 / dn::kDnRowTilesInFlight);
  CHECK(dn::dense_item_group_for(0, 132, 4) == 4);
  CHECK(dn::dense_item_group_for(0, 1, 32) == 1);
  CHECK(dn::dense_item_group_for(5, 132, 32) == 5);
}

TEST_CASE("ua cuda bf16 dense tensor-core prefill at a small shape (sanitizer case)", "[ua][cuda][sanitize]") {
  if (no_device()) return;
  // r = 4, D = 64: three row tiles of 32 rows, two calls (the second over 25 cached rows), then decode
  Case c = random_case(1, 70, 8, 2, 64, 79);
  FloatCase f(c);
  round_inputs_to<kvmem::bf16>(f);  // host and device see the same bf16 inputs
  const auto host = host_forward(f);
  const auto gpu = cuda_prefill_decode<kvmem::bf16>(f, 60, kvmem::ua::Options{0.0, 128, true}, {}, 25);
  const double e = relative_frobenius(gpu.out, host.out);
  INFO("out relative Frobenius " << e);
  CHECK(e <= 1e-2);
  for (auto len : gpu.lengths) CHECK(len == c.config.T);
  // p = 0.5 in launches of one 32-row chunk: after each, prune_compact_kernel marks the rows below ln p dead in
  // place or compacts the item; the next launch walks the dead rows as masked entries, then decode
  const kvmem::ua::Options pruned{0.5, 32, true};
  kvmem::ua::PrunedCache<kvmem::bf16> hc(f.cache_shape());
  const auto host_pruned = host_calls_decode(f, 0, 60, pruned, hc);
  kvmem::cuda::UaCacheLimits one_chunk;
  one_chunk.dense_prune_rows = 32;
  const auto gpu_pruned = cuda_prefill_decode<kvmem::bf16>(f, 60, pruned, one_chunk);
  const double ep = relative_frobenius(gpu_pruned.out, host_pruned);
  INFO("p = 0.5: out relative Frobenius " << ep);
  CHECK(ep <= 1e-2);
  check_kept_near_ties(c, f, gpu_pruned.kept, kept_mask(hc, c.config.T), 0.5, "dense pruned, 32-row launches vs host");
}

namespace {
// What the dense prefill's skip body (sm_90a) meets in a case, from the fp64 logits of its (rounded) inputs:
// with the newest entry tiles first, a step whose tile has every weight of the row tile's pairs underflow
// (each pair's largest logit in the tile far below its running maximum, the tile's included) predicts the
// next step past the reach, which then skips its value tile and P V; where that next step has weights after
// all, its P V is deferred (inside the walk, or after the last step). `margin` (natural-log units) keeps
// steps near the underflow, where the device's rounding may decide either way, out of every count.
struct PastReachSteps {
  std::int64_t skipped = 0, deferred_inside = 0, deferred_last = 0;
};
PastReachSteps past_reach_steps(const Case& c, double margin) {
  namespace ref = kvmem::reference::ua;
  namespace dn = kvmem::cuda::ua_detail;
  const std::int64_t T = c.config.T, r = c.config.H / c.config.G, rows = dn::dense_row_tile(r);
  const double underflow = double(dn::kDnUnderflowLog2) * std::log(2.0);  // the weights' exact 0, natural log
  const double inf = std::numeric_limits<double>::infinity();
  PastReachSteps steps;
  for (std::int64_t b = 0; b < c.config.B; ++b)
    for (std::int64_t g = 0; g < c.config.G; ++g) {
      const auto lam = ref::cumulative_decay(c.config, c.inputs, b, g);
      for (std::int64_t r0 = 0; r0 < T; r0 += rows) {
        const std::int64_t nr = std::min(rows, T - r0), etiles = (r0 + nr + dn::kDnEntries - 1) / dn::kDnEntries;
        std::vector<double> running(std::size_t(r * nr), -inf);  // each pair's largest logit so far
        bool surely_past_before = false;                         // every weight of the previous step underflowed
        for (std::int64_t step = 0; step < etiles; ++step) {
          const std::int64_t e0 = (etiles - 1 - step) * dn::kDnEntries;
          double gap = -inf;  // the largest of the pairs' (tile maximum - running maximum with the tile)
          for (std::int64_t h = 0; h < r; ++h)
            for (std::int64_t i = 0; i < nr; ++i) {
              const std::int64_t m = r0 + i;
              const double* q = ref::detail::query_row(c.config, c.inputs, b, g * r + h, m);
              double tile_max = -inf;
              for (std::int64_t j = e0; j < std::min(e0 + dn::kDnEntries, m + 1); ++j) {
                const double* k = ref::detail::key_row(c.config, c.inputs, b, g, j);
                tile_max = std::max(tile_max, ref::detail::dot(q, k, c.config.D) + lam[std::size_t(m * T + j)]);
              }
              double& run = running[std::size_t(h * nr + i)];
              run = std::max(run, tile_max);
              if (tile_max > -inf) gap = std::max(gap, tile_max - run);
            }
          if (surely_past_before) {
            ++steps.skipped;
            if (gap > underflow + margin) ++(step + 1 < etiles ? steps.deferred_inside : steps.deferred_last);
          }
          surely_past_before = gap < underflow - margin;
        }
      }
    }
  return steps;
}
}  // namespace

TEST_CASE("ua cuda bf16 dense prefill past the decay's reach (sanitizer case)", "[ua][cuda][sanitize]") {
  if (no_device()) return;
  // D = 128, r = 4 (the wgmma path on sm_90a). The keys share a common direction (similarities about 0.5,
  // A about -0.7 a row), so entries some 150 rows back underflow for every pair of a row tile: the later row
  // tiles walk steps past the decay's reach, where each warp sets P = 0 without its sums. One key of each
  // item points the other way (similarity <= 0 to every other key: A = 0, its λ stays 0), so its entry tile
  // comes back into reach after such steps: in tile 1 (batch 0) and in tile 0, the last step (batch 1).
  // The other cases are too short to reach the underflow.
  constexpr std::int64_t kT = 640, kD = 128;
  Case c = random_case(2, kT, 8, 2, kD, 97);
  std::vector<double> common(kD);
  for (std::int64_t d = 0; d < kD; ++d) common[std::size_t(d)] = (d % 2 ? 1.0 : -1.0) / std::sqrt(double(kD));
  for (std::int64_t row = 0; row < 2 * 2 * kT; ++row) {
    const std::int64_t b = row / (2 * kT), t = row % kT;
    const double sign = t == (b == 0 ? 70 : 5) ? -1.0 : 1.0;
    double* k = c.inputs.k.data() + row * kD;
    double norm = 0.0;
    for (std::int64_t d = 0; d < kD; ++d) {
      k[d] = sign * (common[std::size_t(d)] + k[d]);
      norm += k[d] * k[d];
    }
    for (std::int64_t d = 0; d < kD; ++d) k[d] /= std::sqrt(norm);
  }
  FloatCase f(c);
  round_inputs_to<kvmem::bf16>(f);  // host and device see the same bf16 inputs
  const auto host = host_forward(f);
  // the premise: the oldest entries' Λ at the last row lies far below the underflow of the weights (a
  // logit about 88 below the row maximum)
  double lowest = 0.0;
  for (float lam : host.lambda_last) lowest = std::min(lowest, double(lam));
  INFO("lowest lambda_last " << lowest);
  REQUIRE(lowest < -200.0);
  const auto dense = cuda_forward<kvmem::bf16>(f);
  const double e_out = relative_frobenius(dense.out, host.out), e_lse = relative_frobenius(dense.lse, host.lse),
               e_lam = relative_frobenius(dense.lambda_last, host.lambda_last);
  INFO("out " << e_out << ", lse " << e_lse << ", lambda_last " << e_lam);
  CHECK(e_out <= 1e-2);
  CHECK(e_lse <= 1e-3);
  CHECK(e_lam <= 1e-4);

  // The kernel with the skip body (sm_90a), which the default threshold leaves to calls past 8K rows, here
  // with the threshold at 0: the same result bits as the kernel without it (which the default runs here: 10
  // entry tiles at most), and within the same tolerance of the host. Its premise, from the fp64 logits of
  // the bf16 inputs: steps are skipped, and a skipped step's P V is deferred both inside the walk and after
  // the last step.
  Case rounded = c;
  for (auto [to, from] :
       {std::pair{&rounded.inputs.q, &f.q}, std::pair{&rounded.inputs.k, &f.k}, std::pair{&rounded.inputs.v, &f.v},
        std::pair{&rounded.inputs.z_k, &f.z_k}, std::pair{&rounded.inputs.z_q, &f.z_q}})
    to->assign(from->begin(), from->end());
  const PastReachSteps steps = past_reach_steps(rounded, 1.0);
  INFO("steps skipped " << steps.skipped << ", deferred inside the walk " << steps.deferred_inside
                        << ", after the last step " << steps.deferred_last);
  CHECK(steps.skipped >= 50);
  CHECK(steps.deferred_inside >= 1);
  CHECK(steps.deferred_last >= 1);
  const kvmem::ua::Options dense_opt{0.0, 128, true};  // p = 0: one dense launch for the whole call
  kvmem::cuda::UaCacheLimits skip_everywhere;
  skip_everywhere.dense_skip_past_after_tiles = 0;
  const auto skipping = cuda_prefill_decode<kvmem::bf16>(f, kT, dense_opt, skip_everywhere);
  const auto usual = cuda_prefill_decode<kvmem::bf16>(f, kT, dense_opt);
  const double e_skip = relative_frobenius(skipping.out, host.out);
  const std::size_t differing = differing_bits(skipping.out, usual.out);
  INFO("skip body: out " << e_skip << ", outputs differing from the default threshold's " << differing);
  CHECK(e_skip <= 1e-2);
  CHECK(differing == 0);
}

namespace {
// The host backend with a decay set: chunked prefill of [0, split), then decode of [split, T).
template <class Set, class Storage>
std::vector<float> host_prefill_decode_set(const FloatCase& f, std::int64_t split, const kvmem::ua::Options& opt,
                                           kvmem::ua::PrunedCache<Storage>& hc) {
  std::vector<float> out = f.make_out();
  const kvmem::host::Executor exec{2};
  REQUIRE(kvmem::ua::prefill<Set>(exec, hc, f.slice(0, split), opt, f.out_slice(out, 0, split)).is_ok());
  for (std::int64_t t = split; t < f.c.T; ++t)
    REQUIRE(kvmem::ua::decode<Set>(exec, hc, f.slice(t, t + 1), opt, f.out_slice(out, t, t + 1)).is_ok());
  return out;
}

// bf16 inputs, chunked prefill of [0, split) then decode with `opt` on the host and the device, with a
// user decay set: the output's relative Frobenius error, the kept-set mismatches (and near-ties left
// out) and every item's length after each device decode step ([steps][items]).
struct SetRun {
  double error = 0;
  std::int64_t mismatches = 0, near_ties = 0;
  std::vector<std::int64_t> lengths, in_use;
};
template <class Set>
SetRun host_vs_cuda_set(const Case& c, std::int64_t split, const kvmem::ua::Options& opt, std::int64_t pool_pages = 0) {
  FloatCase f(c);
  round_inputs_to<kvmem::bf16>(f);  // host and device see the same bf16 inputs
  kvmem::ua::PrunedCache<kvmem::bf16> hc(f.cache_shape());
  const auto host = host_prefill_decode_set<Set>(f, split, opt, hc);
  SetRun run;
  const auto gpu = cuda_prefill_decode<kvmem::bf16, Set>(f, split, opt, {}, 0, &run.lengths, &run.in_use, pool_pages);
  run.error = relative_frobenius(gpu.out, host);
  // r 4 or 8: the prefill takes the dense tensor-core kernel (its fold's error per pair)
  const auto acc = check_kept_near_ties<Set>(c, f, gpu.kept, kept_mask(hc, c.config.T), opt.p, "bf16 lifetime set",
                                             kvmem::cuda::ua_detail::kDnDecayAbsError);
  run.mismatches = acc.beyond;
  run.near_ties = acc.near_ties;
  return run;
}
}  // namespace

TEST_CASE("ua cuda one-block decode: evictions across several tiles (sanitizer case)",
          "[ua][cuda][sanitize][nearties]") {
  if (no_device()) return;
  // lifetimes of about 100-290 steps (c = -7): the kept length climbs past two 64-entry tiles of the
  // one-block path, and from about step 100 on keys from the middle of the cache leave at most steps, so
  // survivors move down within and across tiles
  const Case c = random_case(1, 300, 8, 2, 64, 83);
  const auto [e, bad, excluded, trace, in_use] =
      host_vs_cuda_set<LifetimeSet<-70>>(c, 60, kvmem::ua::Options{0.05, 64, true});
  CHECK(in_use == trace);  // the one-block path compacts in its pass: no dead row is ever left
  const auto longest = *std::max_element(trace.begin(), trace.end());
  const std::int64_t items = c.config.B * c.config.G;
  std::int64_t evicting_steps = 0;  // steps after which an item is not one entry longer than before
  for (std::size_t i = std::size_t(items); i < trace.size(); ++i)
    evicting_steps += trace[i] <= trace[i - std::size_t(items)];
  INFO("out relative Frobenius " << e << ", kept mismatches " << bad << " (+ " << excluded << " near-ties), longest "
                                 << longest << ", steps that evicted " << evicting_steps);
  CHECK(e <= 1e-2);
  CHECK(bad == 0);
  CHECK(longest > 2 * kvmem::cuda::ua_detail::kOneBlockTile);
  CHECK(longest <= kvmem::cuda::ua_detail::kOneBlockMaxKept);  // every step on the one-block path
  CHECK(evicting_steps >= 50);
}

TEST_CASE("ua cuda decode: items cross the one-block limit and come back (bf16, D 128, r 4)", "[ua][cuda][nearties]") {
  if (no_device()) return;
  // lifetimes of about 190-470 steps (c = -8.3): kept lengths wander around kOneBlockMaxKept, so items
  // switch between the one-block path and the entry splits (the vector-row pass), in both directions,
  // while evicting. Over own pages the splits mark evicted rows dead in place and an item is compacted
  // once its dead rows are as many as its kept rows (and at least a page's worth): the kept sets stay the
  // host's, and the dead rows never outnumber that bound.
  const Case c = random_case(1, 1000, 8, 2, 128, 87);
  const auto [e, bad, excluded, trace, in_use] =
      host_vs_cuda_set<LifetimeSet<-83>>(c, 128, kvmem::ua::Options{0.05, 128, true});
  REQUIRE(in_use.size() == trace.size());
  std::int64_t marked_steps = 0, compactions = 0, over_bound = 0;
  for (std::size_t i = 0; i < trace.size(); ++i) {
    const std::int64_t dead = in_use[i] - trace[i];
    marked_steps += dead > 0;
    over_bound += dead < 0 || dead > std::max<std::int64_t>(trace[i], 16);
    if (i >= std::size_t(c.config.B * c.config.G))
      compactions += in_use[i] < in_use[i - std::size_t(c.config.B * c.config.G)] && dead == 0 &&
                     in_use[i - std::size_t(c.config.B * c.config.G)] > kvmem::cuda::ua_detail::kOneBlockMaxKept;
  }
  INFO("steps with dead rows " << marked_steps << ", compactions of long items " << compactions
                               << ", steps past the dead-row bound " << over_bound);
  CHECK(marked_steps >= 1);
  CHECK(compactions >= 1);
  CHECK(over_bound == 0);
  const std::int64_t items = c.config.B * c.config.G, limit = kvmem::cuda::ua_detail::kOneBlockMaxKept;
  std::int64_t up = 0, down = 0;
  for (std::size_t i = std::size_t(items); i < trace.size(); ++i) {
    up += trace[i - std::size_t(items)] <= limit && trace[i] > limit;
    down += trace[i - std::size_t(items)] > limit && trace[i] <= limit;
  }
  INFO("out relative Frobenius " << e << ", kept mismatches " << bad << " (+ " << excluded
                                 << " near-ties), crossings up " << up << " down " << down);
  CHECK(e <= 1e-2);
  CHECK(bad == 0);
  CHECK(up >= 1);
  CHECK(down >= 1);
}

TEST_CASE("ua cuda decode over a shared pool: long items move their live rows into fresh pages",
          "[ua][cuda][nearties]") {
  if (no_device()) return;
  // The lifetimes of the test above (c = -8.3) over a shared pool with room for every row twice: a long
  // item (more than kOneBlockMaxKept rows in use) whose dead rows reach a page's worth moves its live
  // rows into fresh pages during its next decode step and gives the old pages back, so its dead rows stay
  // below a page plus one step's evictions. Kept sets are the host's, and after every step each item holds
  // the pages of its rows in use (cuda_prefill_decode checks them). r = 4 runs the vector-row pass, r = 2
  // the entry splits.
  const std::int64_t page = 16, dead_bound = page - 1;
  for (const std::int64_t H : {8, 4}) {
    const Case c = random_case(1, 1000, H, 2, 128, 87);
    const std::int64_t items = c.config.B * c.config.G, pool = 2 * items * ((c.config.T + page - 1) / page);
    const auto [e, bad, excluded, trace, in_use] =
        host_vs_cuda_set<LifetimeSet<-83>>(c, 128, kvmem::ua::Options{0.05, 128, true}, pool);
    REQUIRE(in_use.size() == trace.size());
    std::int64_t moves = 0, long_steps = 0, over_bound = 0, wrong_moves = 0;
    for (std::size_t i = std::size_t(items); i < trace.size(); ++i) {
      const std::int64_t was_in_use = in_use[i - std::size_t(items)], was_kept = trace[i - std::size_t(items)];
      const std::int64_t was_dead = was_in_use - was_kept, dead = in_use[i] - trace[i];
      const std::int64_t left = was_kept + 1 - trace[i];  // rows evicted by this step (the new one stays)
      if (was_in_use <= kvmem::cuda::ua_detail::kOneBlockMaxKept) continue;
      ++long_steps;
      over_bound += dead > dead_bound + left;
      if (was_dead >= page) {  // this step moved the live rows: only its own evictions are dead after it
        ++moves;
        wrong_moves += in_use[i] != was_kept + 1 || dead != left;
      }
    }
    INFO("r = " << H / 2 << ": out relative Frobenius " << e << ", kept mismatches " << bad << " (+ " << excluded
                << " near-ties), steps of long items " << long_steps << ", steps that moved " << moves);
    CHECK(e <= 1e-2);
    CHECK(bad == 0);
    CHECK(long_steps >= 100);
    CHECK(moves >= 1);
    CHECK(wrong_moves == 0);
    CHECK(over_bound == 0);
  }
}

// ---- long items on the tensor cores (ua_decode_tc.cuh) -------------------------------------------
namespace {
// The largest |λ_gpu - λ_ref| / max(1, |λ_ref|) over the rows the device kept, against the fp64 reference's
// λ at the last token on the stored values (Set's decay). NaN rows (not kept) are skipped.
template <class Set = kvmem::decay::Universal>
double kept_lambda_error(const Case& c, const FloatCase& f, const std::vector<double>& gpu_lambda) {
  const Case s = stored_case(c, f);
  const std::int64_t T = c.config.T;
  double worst = 0.0;
  for (std::int64_t b = 0; b < c.config.B; ++b)
    for (std::int64_t g = 0; g < c.config.G; ++g) {
      const auto lam = kvmem::reference::ua::cumulative_decay<Set>(s.config, s.inputs, b, g);
      for (std::int64_t j = 0; j < T; ++j) {
        const double x = gpu_lambda[std::size_t((b * c.config.G + g) * T + j)];
        if (std::isnan(x)) continue;
        const double ref = lam[std::size_t((T - 1) * T + j)];
        worst = std::max(worst, std::abs(x - ref) / std::max(1.0, std::abs(ref)));
      }
    }
  return worst;
}
}  // namespace

TEST_CASE("ua cuda bf16 decode of long items on the tensor cores: host, fp64 reference and the CUDA-core pass",
          "[ua][cuda][nearties][decode_tc]") {
  if (no_device()) return;
  // Gate logits around -5 keep 370-700 of 900 rows at p = 0.05 and 0.15 while most steps evict, so after a
  // prefill of 400 tokens every decode step runs the long path, on the tensor cores by default
  // (UaCacheLimits::decode_tensor_cores). Against the host backend on the same bf16 values: outputs within
  // DESIGN.md 5 (the probabilities are rounded to bf16 before p.v), kept sets up to near-ties (the
  // similarity's summation order on the tensor cores is within the accounting's bound; the prefill's dense
  // fold adds kDnDecayAbsError per pair), and every kept row's λ against the fp64 reference (a missed or
  // misplaced λ write moves a row's λ by a whole step's decay, about 1e-2). p = 0 keeps every row. The CUDA-
  // core pass (decode_tensor_cores = false) on the same inputs agrees as well, and differs in some bits: the
  // tensor-core pass ran. D 64 / 80 / 128, groups of 4 and 8 heads; B = 2 gives 4 items of several splits.
  struct Shape {
    std::int64_t dim, H;
  };
  for (const Shape& sh : {Shape{64, 8}, Shape{80, 16}, Shape{128, 8}, Shape{128, 16}}) {
    constexpr std::int64_t kG = 2, kSplit = 400;
    const Case c = random_case(2, 900, sh.H, kG, sh.dim, 301 + std::uint32_t(sh.dim + sh.H), -5.0);
    FloatCase f(c);
    round_inputs_to<kvmem::bf16>(f);
    for (const double p : {0.05, 0.15, 0.0}) {
      const kvmem::ua::Options opt{p, 128, true};
      const std::string label = "tensor-core decode D=" + std::to_string(sh.dim) + " r=" + std::to_string(sh.H / kG) +
                                " p=" + std::to_string(p);
      kvmem::ua::PrunedCache<kvmem::bf16> hc(f.cache_shape());
      const auto host = host_prefill_decode(f, kSplit, opt, hc);
      std::vector<std::int64_t> lengths, in_use;
      const auto tc = cuda_prefill_decode<kvmem::bf16>(f, kSplit, opt, {}, 0, &lengths, &in_use);
      kvmem::cuda::UaCacheLimits cuda_cores;
      cuda_cores.decode_tensor_cores = false;
      const auto cc = cuda_prefill_decode<kvmem::bf16>(f, kSplit, opt, cuda_cores);
      const std::int64_t items = c.config.B * kG;
      std::int64_t long_steps = 0;  // (step, item) pairs that ran the long path
      for (std::size_t i = 0; i + std::size_t(items) < in_use.size(); ++i)
        long_steps += in_use[i] > kvmem::cuda::ua_detail::kOneBlockMaxKept;
      const double e = relative_frobenius(tc.out, host), e_cc = relative_frobenius(tc.out, cc.out);
      const double lam_err = kept_lambda_error(c, f, tc.lambda);
      const std::size_t differing = differing_bits(tc.out, cc.out);
      INFO(label << ": out relative Frobenius " << e << " (CUDA-core pass " << e_cc << ", differing outputs "
                 << differing << "), kept λ error " << lam_err << ", long (step, item) pairs " << long_steps);
      CHECK(long_steps >= (c.config.T - kSplit - 1) * items / 2);
      CHECK(e <= 1e-2);
      CHECK(e_cc <= 1e-2);
      CHECK(differing > 0);
      CHECK(lam_err <= 5e-4);
      if (p > 0.0) {
        check_kept_near_ties(c, f, tc.kept, kept_mask(hc, c.config.T), p, label,
                             kvmem::cuda::ua_detail::kDnDecayAbsError);
        CHECK(*std::min_element(tc.lengths.begin(), tc.lengths.end()) < c.config.T);  // it evicted
      } else {
        CHECK(tc.kept == std::vector<std::int64_t>(tc.kept.size(), 1));
      }
    }
  }
}

TEST_CASE("ua cuda bf16 tensor-core decode: block ranges of several windows with dead rows among them",
          "[ua][cuda][decode_tc]") {
  if (no_device()) return;
  // At most 4 splits per item (max_splits = 1) and a dense prefill (p = 0) of 8960 rows: each block of a
  // decode step takes about 2240 entries, more than one window of the tensor-core pass (kDtcWindow), so the
  // next window's λ is scanned while one is attended and the list is rebuilt. The decode steps then evict at
  // p = kP (marked dead in place, fewer than the kept rows: no compaction), so later steps list live rows from
  // among dead ones. The CUDA-core pass on the same inputs (the same prefill bits) is the reference here (the
  // host would take minutes at this length): outputs within DESIGN.md 5, the same λ up to the similarity's
  // summation order, and kept sets that differ only at rows whose λ lies within 1e-3 of ln p.
  constexpr std::int64_t kPrefill = 8960, kSteps = 24, kT = kPrefill + kSteps, kG = 2;
  constexpr double kP = 0.05;  // gate logits around -8 keep about 73 % of the prefill's rows at p = 0.05
  const Case c = random_case(1, kT, 8, kG, 128, 977, -8.0);
  FloatCase f(c);
  round_inputs_to<kvmem::bf16>(f);
  const kvmem::ua::Options prefill_opt{0.0, 128, true}, decode_opt{kP, 128, true};
  kvmem::cuda::UaCacheLimits tc_limits, cc_limits;
  tc_limits.max_splits = cc_limits.max_splits = 1;
  cc_limits.decode_tensor_cores = false;
  std::vector<std::int64_t> kept_trace, in_use;
  const auto tc =
      cuda_prefill_decode<kvmem::bf16>(f, kPrefill, prefill_opt, tc_limits, 0, &kept_trace, &in_use, 0, &decode_opt);
  const auto cc =
      cuda_prefill_decode<kvmem::bf16>(f, kPrefill, prefill_opt, cc_limits, 0, nullptr, nullptr, 0, &decode_opt);
  REQUIRE(in_use.size() == kept_trace.size());
  std::int64_t multi_window = 0, dead_at_start = 0;  // (step, item) pairs: ranges past a window, dead rows
  for (std::size_t i = 0; i < in_use.size(); ++i) {
    const bool wide = in_use[i] > 4 * std::int64_t(kvmem::cuda::ua_detail::kDtcWindow);
    multi_window += wide;
    if (i + std::size_t(kG) < in_use.size()) dead_at_start += wide && in_use[i] > kept_trace[i];
  }
  // decode outputs only (the prefill's are the same bits in both runs)
  const std::size_t first = std::size_t(kPrefill) * std::size_t(c.config.H * c.config.D);
  const std::vector<float> tc_out(tc.out.begin() + std::ptrdiff_t(first), tc.out.end()),
      cc_out(cc.out.begin() + std::ptrdiff_t(first), cc.out.end());
  const double e = relative_frobenius(tc_out, cc_out);
  const std::size_t differing = differing_bits(tc_out, cc_out);
  double lam_err = 0.0;
  std::int64_t kept_differ = 0, far_differ = 0;
  const double ln_p = std::log(kP);
  for (std::size_t x = 0; x < tc.kept.size(); ++x) {
    if (tc.kept[x] != 0 && cc.kept[x] != 0) {
      lam_err = std::max(lam_err, std::abs(tc.lambda[x] - cc.lambda[x]) / std::max(1.0, std::abs(cc.lambda[x])));
    } else if (tc.kept[x] != cc.kept[x]) {
      ++kept_differ;
      const double lam = tc.kept[x] != 0 ? tc.lambda[x] : cc.lambda[x];
      far_differ += std::abs(lam - ln_p) > 1e-3;
    }
  }
  INFO("out relative Frobenius " << e << ", differing outputs " << differing << ", kept λ error " << lam_err
                                 << ", kept-set differences " << kept_differ << " (" << far_differ
                                 << " beyond 1e-3 of ln p), (step, item) pairs past a window " << multi_window
                                 << ", of them with dead rows at the start " << dead_at_start
                                 << ", kept after the last step " << kept_trace[kept_trace.size() - 2] << ", "
                                 << kept_trace.back());
  CHECK(multi_window >= kSteps * kG / 2);
  CHECK(dead_at_start >= 1);
  CHECK(e <= 1e-2);
  CHECK(differing > 0);
  CHECK(lam_err <= 1e-4);
  CHECK(far_differ == 0);
}

// ---- the eviction boundary (tests/ua/ua_boundary_cases.hpp) --------------------------------
namespace {
boundary::Run cuda_boundary_run(const Case& c, std::int64_t split, const kvmem::ua::Options& opt) {
  const FloatCase f(c);
  const CudaRun r = cuda_prefill_decode<float>(f, split, opt);
  return {r.out, r.kept, r.lambda};
}
}  // namespace

TEST_CASE("ua cuda fp32: p = 1 keeps exactly the keys that never decayed, the new token included",
          "[ua][cuda][boundary]") {
  if (no_device()) return;
  boundary::check_p_one(cuda_boundary_run);
}

TEST_CASE("ua cuda fp32: a key whose fp32 λ equals ln p stays, and goes at the next larger p", "[ua][cuda][boundary]") {
  if (no_device()) return;
  boundary::check_exact_threshold(cuda_boundary_run);
}

TEST_CASE("ua cuda fp32: p just above 0 evicts only keys decayed below ln p = -744", "[ua][cuda][boundary]") {
  if (no_device()) return;
  boundary::check_p_tiny(cuda_boundary_run);
}

TEST_CASE("ua cuda bf16 tensor-core chunk and dense kernels: p = 1 keeps exactly the keys that never decayed",
          "[ua][cuda][boundary]") {
  if (no_device()) return;
  // r = 4, D = 64 (the tensor-core chunk kernel, as the sanitizer case): basis keys ±e_i are exact in
  // bf16 and their products exact in fp32, so the closed form holds without near-ties
  Case c = boundary::basis_key_case(1, 203, 8, 2, 64, 419);
  const auto closed = boundary::p1_survivors(c);
  FloatCase f(c);
  round_inputs_to<kvmem::bf16>(f);
  // the same closed form on the dense tensor-core prefill's masks (default limits; its fold gives A = 0
  // exactly where c <= 0 and A < 0 at these keys' x) and on the chunk kernel
  for (const std::int64_t prune_rows : {std::int64_t(0), std::int64_t(128), std::int64_t(4096)})
    for (const std::int64_t split : {std::int64_t(203), std::int64_t(170)}) {
      INFO("split " << split << ", dense_prune_rows " << prune_rows);
      kvmem::cuda::UaCacheLimits limits;
      limits.dense_prune_rows = prune_rows;
      const auto gpu = cuda_prefill_decode<kvmem::bf16>(f, split, kvmem::ua::Options{1.0, 64, true}, limits);
      CHECK(gpu.kept == closed);
    }
}

TEST_CASE("ua cuda: a never-created or moved-from cache refuses every operation; bad slots are refused",
          "[ua][cuda][slots]") {
  // Never created: refused before any CUDA call, so this part runs without a device.
  kvmem::cuda::UaCache<float> never;
  CHECK(!never.valid());
  CHECK(never.max_slots() == 0);
  CHECK(never.position(0) == 0);
  std::vector<std::int64_t> lengths;
  CHECK(never.lengths(lengths, nullptr).code() == kvmem::StatusCode::kInvalidArgument);
  CHECK(never.reset_sequence(0, nullptr).code() == kvmem::StatusCode::kInvalidArgument);
  std::vector<std::int64_t> pos;
  std::vector<float> lambda;
  CHECK(!never.download(0, 0, pos, lambda, nullptr, nullptr, nullptr).is_ok());
  const kvmem::cuda::Executor exec{};
  CHECK(kvmem::cuda::ua_decode(exec, never, kvmem::cuda::UaInputs<float>{}, {}, TensorView<float, 4>{}).code() ==
        kvmem::StatusCode::kInvalidArgument);
  if (no_device()) return;
  const Case c = random_case(2, 8, 2, 1, 16, 4);
  const FloatCase f(c);
  DevCase<float> d(f);
  Dev<float> out(std::size_t(2 * 8 * 2 * 16));
  kvmem::cuda::UaCache<float> cache;
  REQUIRE(kvmem::cuda::UaCache<float>::create({2, 2, 1, 16, 8, 16}, cache).is_ok());
  REQUIRE(kvmem::cuda::ua_prefill(exec, cache, d.slice(0, 4), {}, d.out_slice(out.ptr, 0, 4)).is_ok());
  // bad slot indices: a Status, the cache as before
  CHECK(cache.reset_sequence(2, nullptr).code() == kvmem::StatusCode::kOutOfRange);
  CHECK(cache.reset_sequence(-1, nullptr).code() == kvmem::StatusCode::kOutOfRange);
  CHECK(!cache.download(0, 1, pos, lambda, nullptr, nullptr, nullptr).is_ok());
  CHECK(cache.position(5) == 0);
  REQUIRE(cache.lengths(lengths, nullptr).is_ok());
  CHECK(lengths == std::vector<std::int64_t>{4, 4});
  CHECK(cache.position(0) == 4);
  // moved from: empty, and refusing instead of writing the new owner's memory
  kvmem::cuda::UaCache<float> owner(std::move(cache));
  CHECK(!cache.valid());
  CHECK(cache.position(0) == 0);
  CHECK(cache.reset_sequence(0, nullptr).code() == kvmem::StatusCode::kInvalidArgument);
  CHECK(kvmem::cuda::ua_decode(exec, cache, d.slice(4, 5), {}, d.out_slice(out.ptr, 4, 5)).code() ==
        kvmem::StatusCode::kInvalidArgument);
  REQUIRE(owner.lengths(lengths, nullptr).is_ok());
  CHECK(lengths == std::vector<std::int64_t>{4, 4});
  CHECK(owner.position(1) == 4);
  CHECK(kvmem::cuda::ua_decode(exec, owner, d.slice(4, 5), {}, d.out_slice(out.ptr, 4, 5)).is_ok());
  CHECK(owner.position(0) == 5);
}
