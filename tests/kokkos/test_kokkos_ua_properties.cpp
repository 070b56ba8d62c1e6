// SPDX-License-Identifier: Apache-2.0
// UA on Kokkos: random cases (GQA, D = 80, output gate, batches, rows of 600 entries) against the fp64
// reference (1e-5 relative, kept sets exact) and against the host backend (bitwise on host spaces, within
// the fp32 tolerance on device spaces, kvm_kokkos_util.hpp); the same bits when a call repeats and for
// every team size; decode == prefill; freed pages; validation before any change.
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include <catch2/catch.hpp>

#include "ua_kokkos_util.hpp"

namespace {
using namespace kvmem::test::ua;
using kvmem::test::KokkosExec;
constexpr double kTolFp32 = 1e-5;

TEST_CASE("kokkos ua matches the reference and the host backend on random cases", "[kokkos][ua][unit]") {
  struct Shape {
    std::int64_t B, T, H, G, D;
    bool gate;
  };
  std::uint32_t seed = 40;
  for (const Shape s : {Shape{2, 45, 4, 2, 16, false}, Shape{1, 70, 3, 1, 80, true}, Shape{2, 33, 2, 2, 8, true}}) {
    Case c = random_case(s.B, s.T, s.H, s.G, s.D, seed++, 1.0, s.gate);
    c.config.prefill_chunk = 16;
    c.config.prefill_split = s.T / 2;
    const FloatCase f(c);
    INFO("B" << s.B << " T" << s.T << " H" << s.H << " G" << s.G << " D" << s.D << " gate " << s.gate);
    const auto dense = kokkos_forward(f);
    const auto ref = ref::dense(c.config, c.inputs);
    KVMEM_CHECK_CLOSE(dense.out, ref.out, kTolFp32);
    KVMEM_CHECK_CLOSE(dense.lse, ref.lse, kTolFp32);
    KVMEM_CHECK_CLOSE(dense.lambda_last, ref.lambda_last, kTolFp32);
    const auto host = host_forward(f);
    KVMEM_KOKKOS_CHECK_AS_HOST(dense.out, host.out, kTolFp32);
    KVMEM_KOKKOS_CHECK_AS_HOST(dense.lambda_last, host.lambda_last, kTolFp32);
    for (const double p : {0.0, 0.05, 0.2}) {
      INFO("p " << p);
      const kvmem::ua::Options opt{p, c.config.prefill_chunk, true};
      auto cache = make_kokkos_cache({}, f);
      const auto out = kokkos_prefill_decode(f, c.config.prefill_split, opt, cache);
      if (p > 0) {
        const auto pr = ref::pruned(c.config, c.inputs, p);
        KVMEM_CHECK_CLOSE(out, pr.out, kTolFp32);
        CHECK(kokkos_kept_mask(cache, s.T) == pr.kept);
      } else {
        KVMEM_CHECK_CLOSE(out, ref.out, kTolFp32);
      }
      kvmem::ua::PrunedCache<float> host_cache(f.cache_shape());
      KVMEM_KOKKOS_CHECK_AS_HOST(out, host_prefill_decode(f, c.config.prefill_split, opt, host_cache), kTolFp32);
      const auto snap = kvmem::kokkos::snapshot(cache);
      for (std::int64_t b = 0; b < s.B; ++b) {
        CHECK(snap.counter[std::size_t(b)] == s.T);
        for (std::int64_t g = 0; g < s.G; ++g) {
          CHECK(snap.length_of(b, g) == host_cache.length(b, g));
          CHECK(snap.freed_pages(b, g).count == host_cache.freed_pages(b, g).count);
        }
      }
    }
  }
}

TEST_CASE("kokkos ua rows longer than one group of pieces match the reference and the host backend",
          "[kokkos][ua][unit]") {
  // The device order sums a row's value elements kUaRowPieces = 8 pieces of 64 entries at a time
  // (backend/kokkos/ua.hpp, row_in_device_order): 600 tokens give rows of up to 10 pieces, so a second,
  // partial group runs after the first; D = 12 leaves lanes past the last multiple of 8.
  Case c = random_case(1, 600, 2, 1, 12, 77, 1.0, true);
  c.config.prefill_chunk = 64;
  const FloatCase f(c);
  const auto dense = kokkos_forward(f);
  const auto ref = ref::dense(c.config, c.inputs);
  KVMEM_CHECK_CLOSE(dense.out, ref.out, kTolFp32);
  KVMEM_CHECK_CLOSE(dense.lse, ref.lse, kTolFp32);
  KVMEM_KOKKOS_CHECK_AS_HOST(dense.out, host_forward(f).out, kTolFp32);
  const kvmem::ua::Options opt{0.0, c.config.prefill_chunk, true};
  auto cache = make_kokkos_cache({}, f);
  KVMEM_CHECK_CLOSE(kokkos_prefill_decode(f, 560, opt, cache), ref.out, kTolFp32);
}

TEST_CASE("kokkos ua gives the same bits with one thread and with several threads per team", "[kokkos][ua][unit]") {
  const int wide = kvmem::test::wide_team_size();
  if (wide < 2) {
    WARN("SKIPPED: " << kvmem::test::KokkosSpace::name() << " runs one thread per team here");
    return;
  }
  const KokkosExec one{kvmem::test::KokkosSpace(), false, 1}, many{kvmem::test::KokkosSpace(), false, wide};
  Case c = random_case(2, 80, 4, 2, 16, 61, 1.0, true);  // 80 rows: query tiles of 32 and key tiles of 64
  c.config.prefill_chunk = 24;
  const FloatCase f(c);
  INFO("team size " << wide);
  const auto dense_one = kokkos_forward(f, one), dense_many = kokkos_forward(f, many);
  CHECK(dense_many.out == dense_one.out);
  CHECK(dense_many.lse == dense_one.lse);
  CHECK(dense_many.lambda_last == dense_one.lambda_last);
  KVMEM_KOKKOS_CHECK_AS_HOST(dense_many.out, host_forward(f).out, kTolFp32);
  for (const double p : {0.0, 0.1}) {
    INFO("p " << p);
    const kvmem::ua::Options opt{p, c.config.prefill_chunk, true};
    auto cache_one = make_kokkos_cache(one, f), cache_many = make_kokkos_cache(many, f);
    const auto out_one = kokkos_prefill_decode(f, 50, opt, cache_one, one);
    const auto out_many = kokkos_prefill_decode(f, 50, opt, cache_many, many);
    CHECK(out_many == out_one);
    CHECK(kokkos_kept_mask(cache_many, c.config.T) == kokkos_kept_mask(cache_one, c.config.T));
    kvmem::ua::PrunedCache<float> host_cache(f.cache_shape());
    KVMEM_KOKKOS_CHECK_AS_HOST(out_many, host_prefill_decode(f, 50, opt, host_cache), kTolFp32);
  }
}

TEST_CASE("kokkos ua gives the same bits when a call repeats", "[kokkos][ua][unit]") {
  // On every space, device spaces included: no atomics or order-dependent reductions in the kernels.
  Case c = random_case(2, 80, 4, 2, 16, 62, 1.0, true);
  c.config.prefill_chunk = 24;
  const FloatCase f(c);
  for (const int team : {0, kvmem::test::wide_team_size()}) {
    INFO("team size " << team << " (0: Kokkos chooses)");
    const KokkosExec exec{kvmem::test::KokkosSpace(), false, team};
    const auto first = kokkos_forward(f, exec), second = kokkos_forward(f, exec);
    CHECK(kvmem::test::same_bits(second.out, first.out));
    CHECK(kvmem::test::same_bits(second.lse, first.lse));
    CHECK(kvmem::test::same_bits(second.lambda_last, first.lambda_last));
    const kvmem::ua::Options opt{0.1, c.config.prefill_chunk, true};
    auto cache_a = make_kokkos_cache(exec, f), cache_b = make_kokkos_cache(exec, f);
    const auto out_a = kokkos_prefill_decode(f, 50, opt, cache_a, exec);
    const auto out_b = kokkos_prefill_decode(f, 50, opt, cache_b, exec);
    CHECK(kvmem::test::same_bits(out_b, out_a));
    CHECK(kokkos_kept_mask(cache_b, c.config.T) == kokkos_kept_mask(cache_a, c.config.T));
  }
}

TEST_CASE("kokkos ua decode equals prefill at every split", "[kokkos][ua][unit]") {
  const Case c = random_case(1, 24, 2, 1, 8, 7, 1.0, false);
  const FloatCase f(c);
  const kvmem::ua::Options opt{0.0, 5, true};  // chunks of 5 do not divide the splits
  auto full = make_kokkos_cache({}, f);
  const auto prefilled = kokkos_prefill_decode(f, c.config.T, opt, full);
  KVMEM_CHECK_CLOSE(prefilled, ref::dense(c.config, c.inputs).out, kTolFp32);
  for (std::int64_t split = 0; split < c.config.T; split += 3) {
    INFO("split " << split);
    auto cache = make_kokkos_cache({}, f);
    CHECK(kokkos_prefill_decode(f, split, opt, cache) == prefilled);  // λ accumulates in the same order
  }
}

TEST_CASE("kokkos ua rejects bad input before any change", "[kokkos][ua][unit]") {
  const Case c = random_case(2, 12, 2, 2, 8, 3, 1.0, false);
  FloatCase f(c);
  auto cache = make_kokkos_cache({}, f, 10);  // room for 10 rows per item
  const KokkosCase kc(f);
  const auto out = kc.make_out();
  const kvmem::ua::Options opt{0.05, 4, true};
  REQUIRE(kvmem::ua::prefill(KokkosExec{kvmem::test::KokkosSpace(), true}, cache, kc.slice(0, 8), opt,
                             kc.out_slice(out, 0, 8))
              .is_ok());
  const auto before = kvmem::kokkos::snapshot(cache);
  SECTION("capacity") {
    const auto s = kvmem::ua::prefill(KokkosExec{kvmem::test::KokkosSpace(), true}, cache, kc.slice(8, 12),
                                      kvmem::ua::Options{}, kc.out_slice(out, 8, 12));
    CHECK(s.code() == kvmem::StatusCode::kOutOfRange);
  }
  SECTION("NaN in z_q") {
    f.z_q[std::size_t(1 * 12 + 9)] = std::numeric_limits<float>::quiet_NaN();
    const KokkosCase bad(f);
    const auto s = kvmem::ua::decode(KokkosExec{kvmem::test::KokkosSpace(), true}, cache, bad.slice(9, 10), opt,
                                     bad.out_slice(out, 9, 10));
    CHECK(s.code() == kvmem::StatusCode::kInvalidArgument);
    CHECK(s.to_string().find("z_q") != std::string::npos);
  }
  SECTION("innermost stride != 1 (a LayoutLeft view)") {
    auto in = kc.slice(8, 9);
    in.q = kvmem::TensorView<const float, 4>(in.q.data(), in.q.extents(), {1, 2, 4, 8});
    CHECK(kvmem::ua::decode(KokkosExec{kvmem::test::KokkosSpace(), true}, cache, in, opt, kc.out_slice(out, 8, 9))
              .code() == kvmem::StatusCode::kInvalidArgument);
  }
  const auto after = kvmem::kokkos::snapshot(cache);
  CHECK(after.length == before.length);
  CHECK(after.counter == before.counter);
  CHECK(after.lambda == before.lambda);
}

TEST_CASE("kokkos ua: an empty or moved-from cache refuses every operation and reads as empty",
          "[kokkos][ua][unit][slots]") {
  const Case c = random_case(2, 12, 2, 2, 8, 4, 1.0, false);
  const FloatCase f(c);
  const KokkosCase kc(f);
  const auto out = kc.make_out();
  const kvmem::ua::Options opt{0.05, 4, true};
  auto cache = make_kokkos_cache({}, f, 12);
  REQUIRE(kvmem::ua::prefill(KokkosExec{kvmem::test::KokkosSpace(), true}, cache, kc.slice(0, 6), opt,
                             kc.out_slice(out, 0, 6))
              .is_ok());
  const auto before = kvmem::kokkos::snapshot(cache);
  KokkosUaCache owner(std::move(cache));
  KokkosUaCache never;
  for (auto* empty : {&cache, &never}) {
    CHECK(!empty->valid());
    CHECK(empty->max_slots() == 0);
    CHECK(empty->keys.data() == nullptr);
    CHECK(kvmem::ua::decode(KokkosExec{kvmem::test::KokkosSpace(), true}, *empty, kc.slice(6, 7), opt,
                            kc.out_slice(out, 6, 7))
              .code() == kvmem::StatusCode::kInvalidArgument);
    const auto snap = kvmem::kokkos::snapshot(*empty);
    CHECK(snap.length_of(0, 0) == 0);
    CHECK(snap.positions(0, 0) == nullptr);
    CHECK(snap.freed_pages(0, 0).count == 0);
  }
  // the new owner holds the state, untouched by the refused calls, and goes on
  const auto moved = kvmem::kokkos::snapshot(owner);
  CHECK(moved.length == before.length);
  CHECK(moved.counter == before.counter);
  CHECK(moved.lambda == before.lambda);
  CHECK(kvmem::ua::decode(KokkosExec{kvmem::test::KokkosSpace(), true}, owner, kc.slice(6, 7), opt,
                          kc.out_slice(out, 6, 7))
            .is_ok());
  KokkosUaCache assigned;
  assigned = std::move(owner);
  CHECK(!owner.valid());
  CHECK(assigned.max_slots() == 2);
  CHECK(kvmem::kokkos::snapshot(assigned).counter == std::vector<std::int64_t>{7, 7});
}

}  // namespace

namespace {
// Engine code written once over the executor type, as an engine embeds kvmem: the cache type comes from
// the executor (ua::cache_t), is created through its static create, and every call has one signature on
// every backend. in(t0, t1) and out(t0, t1) give views of tokens [t0, t1) in the backend's memory.
// Prefills [0, split), decodes the rest, and returns slot 0's record.
template <class Exec, class In, class Out>
std::vector<std::byte> engine_run(const Exec& exec, const kvmem::ua::CacheShape& shape, std::int64_t split,
                                  std::int64_t T, const kvmem::ua::Options& opt, In&& in, Out&& out) {
  using Cache = kvmem::ua::cache_t<Exec, float>;
  Cache cache;
  REQUIRE(Cache::create(shape, cache).is_ok());
  REQUIRE(cache.max_slots() == shape.batch);
  const kvmem::Status s = kvmem::ua::prefill(exec, cache, in(0, split), opt, out(0, split));
  INFO(s.to_string());
  REQUIRE(s.is_ok());
  for (std::int64_t t = split; t < T; ++t)
    REQUIRE(kvmem::ua::decode(exec, cache, in(t, t + 1), opt, out(t, t + 1)).is_ok());
  std::vector<std::byte> record(kvmem::ua::export_bytes(cache, 0));
  REQUIRE(!record.empty());
  REQUIRE(kvmem::ua::export_slot(exec, cache, 0, record).is_ok());
  Cache moved = std::move(cache);  // a moved-from cache is empty on every backend
  CHECK(cache.max_slots() == 0);
  CHECK(moved.max_slots() == shape.batch);
  return record;
}
}  // namespace

TEST_CASE("kokkos ua: engine code written once over the executor type runs on host and Kokkos alike",
          "[kokkos][ua][unit]") {
  static_assert(std::is_same_v<kvmem::ua::cache_t<kvmem::host::Executor, float>, kvmem::ua::PrunedCache<float>>);
  static_assert(std::is_same_v<kvmem::ua::cache_t<KokkosExec, float>, KokkosUaCache>);
  Case c = random_case(2, 40, 4, 2, 16, 77, 1.0, true);
  const std::int64_t split = 23, T = 40;
  c.config.prefill_chunk = 16;
  c.config.prefill_split = split;
  const FloatCase f(c);
  const KokkosCase kc(f);
  const kvmem::ua::Options opt{0.05, c.config.prefill_chunk, true};
  std::vector<float> host_out = f.make_out();
  const auto host_record = engine_run(
      kvmem::host::Executor{2}, f.cache_shape(), split, T, opt,
      [&](std::int64_t a, std::int64_t b) { return f.slice(a, b); },
      [&](std::int64_t a, std::int64_t b) { return f.out_slice(host_out, a, b); });
  const auto kokkos_out = kc.make_out();
  const auto kokkos_record = engine_run(
      KokkosExec{}, f.cache_shape(), split, T, opt, [&](std::int64_t a, std::int64_t b) { return kc.slice(a, b); },
      [&](std::int64_t a, std::int64_t b) { return kc.out_slice(kokkos_out, a, b); });
  KokkosExec{}.space.fence();
  KVMEM_KOKKOS_CHECK_AS_HOST(kvmem::test::to_host(kokkos_out), host_out, kTolFp32);
  kvmem::test::check_record_as_host(kokkos_record, host_record, kTolFp32);
  const auto ref = ref::pruned(c.config, c.inputs, 0.05);
  KVMEM_CHECK_CLOSE(host_out, ref.out, kTolFp32);
}
