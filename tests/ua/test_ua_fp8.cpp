// SPDX-License-Identifier: Apache-2.0
// fp8 (e4m3) storage of UA cache rows on the host backend (precision::Fp8Storage: keys and values in
// e4m3 with one power-of-two scale per row, λ and every sum in fp32):
//  - on inputs an fp8 cache stores exactly (ua_fp8_support.hpp), outputs and kept sets equal the fp64
//    reference's within fp32 rounding: the rows, their scales, eviction and compaction lose nothing else;
//  - on arbitrary inputs, the documented fp8 tolerance against the fp64 reference (docs/compose.md);
//  - a slot record of an fp8 cache (values as float, the scale applied) imports into another fp8 cache
//    and continues bit for bit; the bytes of a row (e4m3 key and value, two fp32 scales).

#include <cstdint>
#include <cstring>
#include <vector>

#include <catch2/catch.hpp>

#include "kvmem/reference/ua.hpp"
#include "support/golden.hpp"
#include "ua_fp8_support.hpp"
#include "ua_host_support.hpp"

namespace {
using namespace kvmem::test::ua;
namespace kua = kvmem::ua;
using kvmem::e4m3;

constexpr double kFp32Tol = 1e-5;
// fp8 storage against the fp64 reference on unrounded inputs (relative Frobenius of the outputs): e4m3
// keeps 3 mantissa bits (a rounding of up to 2^-4 relative per element), which moves logits, the decay
// similarity and the values by a few percent of their spread.
constexpr double kFp8DenseTol = 6e-2;
constexpr double kFp8PrunedTol = 8e-2;
}  // namespace

TEST_CASE("ua host fp8 storage on fp8-exact inputs equals the fp64 reference within fp32 rounding", "[ua][fp8]") {
  const Case c = fp8_stored(random_case(2, 240, 4, 2, 64, 71));
  const FloatCase f(c);
  for (const double p : {0.0, 0.05}) {
    INFO("p " << p);
    ref::Config rc = c.config;
    rc.prefill_chunk = 64;
    rc.prefill_split = 150;
    const auto ref = kvmem::reference::ua::pruned(rc, c.inputs, p);
    for (const std::int64_t pool : {std::int64_t(0), std::int64_t(2 * 2 * 15)}) {
      INFO("pool pages " << pool);
      kua::CacheShape shape = f.cache_shape();
      shape.pool_pages = pool;
      kua::PrunedCache<e4m3> cache(shape);
      const auto out = host_prefill_decode(f, 150, kua::Options{p, 64, true}, cache);
      KVMEM_CHECK_CLOSE(out, ref.out, kFp32Tol);
      CHECK(kept_mask(cache, c.config.T) == ref.kept);
      // the cache holds the stored values: scale * e4m3 row, every scale a power of two
      for (std::int64_t g = 0; g < c.config.G; ++g) {
        const std::int64_t n = cache.length(1, g), D = c.config.D, T = c.config.T;
        const e4m3* k = cache.keys(1, g);
        const float* ks = cache.key_scales(1, g);
        const std::int64_t* pos = cache.positions(1, g);
        REQUIRE(ks != nullptr);
        for (std::int64_t e = 0; e < n; ++e) {
          int exponent = 0;
          CHECK(std::frexp(ks[e], &exponent) == 0.5f);
          for (std::int64_t d = 0; d < D; ++d)
            CHECK(double(float(k[e * D + d]) * ks[e]) == c.inputs.k[std::size_t(((1 * 2 + g) * T + pos[e]) * D + d)]);
        }
      }
    }
  }
}

TEST_CASE("ua host fp8 storage stays within its documented tolerance of the fp64 reference", "[ua][fp8]") {
  const Case c = random_case(1, 300, 4, 2, 128, 91);
  const FloatCase f(c);
  const auto dense = kvmem::reference::ua::dense(c.config, c.inputs);
  kua::PrunedCache<e4m3> cache(f.cache_shape());
  const auto out = host_prefill_decode(f, 200, kua::Options{0.0, 64, true}, cache);
  const double err = kvmem::test::relative_frobenius(out, dense.out);
  INFO("fp8 dense relative Frobenius " << err);
  CHECK(err < kFp8DenseTol);
  CHECK(err > 1e-3);  // the storage really is fp8 (bf16 would be near 3e-3 and below)
  ref::Config rc = c.config;
  rc.prefill_chunk = 64;
  rc.prefill_split = 200;
  const auto ref = kvmem::reference::ua::pruned(rc, c.inputs, 0.05);
  kua::PrunedCache<e4m3> pruned(f.cache_shape());
  const auto out_p = host_prefill_decode(f, 200, kua::Options{0.05, 64, true}, pruned);
  const double err_p = kvmem::test::relative_frobenius(out_p, ref.out);
  INFO("fp8 pruned relative Frobenius " << err_p);
  CHECK(err_p < kFp8PrunedTol);
}

TEST_CASE("ua host fp8: a slot record moves a slot between fp8 caches bit for bit", "[ua][fp8]") {
  const Case c = random_case(1, 120, 4, 2, 32, 17);
  const FloatCase f(c);
  const kvmem::host::Executor exec{1};
  kua::PrunedCache<e4m3> a(f.cache_shape()), b(f.cache_shape());
  std::vector<float> out = f.make_out(), out_b = f.make_out();
  REQUIRE(kua::prefill(exec, a, f.slice(0, 80), kua::Options{0.05, 32, true}, f.out_slice(out, 0, 80)).is_ok());
  std::vector<std::byte> record(kua::export_bytes(a, 0));
  REQUIRE(kua::export_slot(exec, a, 0, record).is_ok());
  REQUIRE(kua::import_slot(exec, b, 0, record).is_ok());
  for (std::int64_t t = 80; t < 120; ++t) {
    REQUIRE(kua::decode(exec, a, f.slice(t, t + 1), kua::Options{0.05, 32, true}, f.out_slice(out, t, t + 1)).is_ok());
    REQUIRE(
        kua::decode(exec, b, f.slice(t, t + 1), kua::Options{0.05, 32, true}, f.out_slice(out_b, t, t + 1)).is_ok());
  }
  for (std::size_t x = 80 * 4 * 32; x < out.size(); ++x) REQUIRE(std::memcmp(&out[x], &out_b[x], sizeof(float)) == 0);
  // A value no e4m3 row with a power-of-two scale holds is refused, naming the field.
  kua::PrunedCache<float> plain(f.cache_shape());
  REQUIRE(kua::prefill(exec, plain, f.slice(0, 20), kua::Options{0.0, 32, true}, f.out_slice(out, 0, 20)).is_ok());
  std::vector<std::byte> fp32_record(kua::export_bytes(plain, 0));
  REQUIRE(kua::export_slot(exec, plain, 0, fp32_record).is_ok());
  const auto refused = kua::import_slot(exec, b, 0, fp32_record);
  CHECK_FALSE(refused.is_ok());  // storage code 0 (float) against 3 (fp8)
  CHECK(b.position(0) == 120);
}

TEST_CASE("ua fp8 cache bytes: one e4m3 key and value and two fp32 scales per row", "[ua][fp8]") {
  const kua::CacheShape s{2, 8, 2, 128, 64, 16};
  const auto fp8 = kua::cache_layout<e4m3>(s), bf = kua::cache_layout<kvmem::bf16>(s);
  CHECK(fp8.page_bytes == 16 * (2 * 128 * 1 + 2 * 4 + 8 + 2 * 4));
  CHECK(bf.page_bytes == 16 * (2 * 128 * 2 + 2 * 4 + 8));
  CHECK(fp8.bytes < bf.bytes);
  using Ua = kua::Attention<kvmem::decay::Universal, kvmem::prune::Threshold{0.05}, kvmem::precision::Fp8Storage>;
  static_assert(std::is_same_v<Ua::Cache, kua::PrunedCache<e4m3>>);
  const auto rows = kua::report(kua::PrunedCache<e4m3>(s));
  CHECK(rows.size() == 4);
}
