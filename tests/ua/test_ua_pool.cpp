// SPDX-License-Identifier: Apache-2.0
// The UA page pool and caller-owned memory (DESIGN.md 3): closed-form cache and workspace sizes, a
// cache and workspace placed over guarded caller buffers (nothing written outside, the same bits as an
// owning cache with a full pool), pool exhaustion (only the asking slot overflows, the other slots'
// outputs equal a run without it, reset_slots brings the slot back), pages returned counted against
// the pages that eviction empties, and a short decode soak within the page bound.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include <catch2/catch.hpp>

#include "ua_step_support.hpp"

namespace {

using namespace kvmem::test::ua_mem;
namespace kua = kvmem::ua;
using kvmem::Status;
using kvmem::StatusCode;
using I32View = kvmem::TensorView<const std::int32_t, 1>;

const kvmem::host::Executor kOne{.threads = 1};
const kua::Options kPrune{0.05, 64, true};

std::size_t up64(std::size_t n) {
  return (n + 63) / 64 * 64;
}

struct Guarded {
  static constexpr std::size_t kGuard = 256;
  static constexpr unsigned char kPattern = 0x5A;
  std::vector<unsigned char> raw;
  std::size_t offset = 0, bytes = 0;
  explicit Guarded(std::size_t n) : raw(n + 2 * kGuard + 64, kPattern), bytes(n) {
    const auto at = reinterpret_cast<std::uintptr_t>(raw.data()) + kGuard;
    offset = kGuard + (64 - at % 64) % 64;
  }
  void* data() { return raw.data() + offset; }
  [[nodiscard]] bool guards_intact() const {
    for (std::size_t i = 0; i < offset; ++i)
      if (raw[i] != kPattern) return false;
    for (std::size_t i = offset + bytes; i < raw.size(); ++i)
      if (raw[i] != kPattern) return false;
    return true;
  }
};

template <class S>
std::vector<std::int64_t> kept(const kua::PrunedCache<S>& c, std::int64_t b, std::int64_t g) {
  const std::int64_t* p = c.positions(b, g);
  return {p, p + c.length(b, g)};
}

template <class S>
std::int64_t pages_for_kept(const kua::PrunedCache<S>& c) {
  std::int64_t n = 0;
  for (std::int64_t b = 0; b < c.max_slots(); ++b)
    for (std::int64_t g = 0; g < c.shape().kv_heads; ++g)
      n += (c.length(b, g) + c.shape().page_rows - 1) / c.shape().page_rows;
  return n;
}

Status reset(kua::PrunedCache<float>& c, std::int32_t slot) {
  return kua::reset_slots(kOne, c, I32View(&slot, {1}));
}

}  // namespace

TEST_CASE("ua cache_layout and workspace_bytes follow the closed form", "[ua][memory][unit]") {
  for (const std::int64_t pool : {0, 20}) {
    const kua::CacheShape s{3, 4, 2, 8, 100, 16, pool};
    const std::int64_t ppi = 7, pages = pool > 0 ? pool : 3 * 2 * ppi, rows = pages * 16;
    const auto expect = [&](std::size_t sz) {
      return 2 * up64(std::size_t(rows) * 8 * sz) + 2 * up64(std::size_t(rows) * 4) + up64(std::size_t(rows) * 8) +
             up64(6 * ppi * 4) + 3 * up64(6 * 8) + 2 * up64(3 * 8) + up64(std::size_t(pages) * 4) + up64(3 * 8);
    };
    const auto lf = kua::cache_layout<float>(s);
    const auto lb = kua::cache_layout<kvmem::bf16>(s);
    CHECK(lf.bytes == expect(4));
    CHECK(lb.bytes == expect(2));
    CHECK(lf.page_bytes == 16 * (2 * 8 * 4 + 16));
    CHECK(lb.page_bytes == 16 * (2 * 8 * 2 + 16));
    CHECK(lf.pages == pages);
    // attend scratch of one work item: r = 2 heads x 32 query rows x D, max and sum, decay and bias
    // tiles 64 x 32, one row of 64 logits, 32 query-gate parts (fp32), 64-byte aligned
    const std::size_t item = up64((2 * 32 * 8 + 2 * 2 * 32 + 2 * 64 * 32 + 64 + 32) * 4);
    CHECK(kua::workspace_bytes<float>(s, {2, 0}) == up64(2 * 8) + 2 * 2 * item);
    kua::PrunedCache<kvmem::bf16> c(s);
    CHECK(c.cache_bytes() == lb.bytes);
    CHECK(c.workspace_bytes() == kua::workspace_bytes<kvmem::bf16>(s));
    CHECK(c.pool_pages() == pages);
    CHECK(c.free_pages() == pages);
  }
  CHECK(kua::cache_layout<float>(kua::CacheShape{1, 4, 2, 8, 100, 12}).bytes == 0);  // page_rows not a power of two
  CHECK(kua::can_run(kOne, kua::CacheShape{1, 4, 2, 8, 100, 12}).message().find("power of two") != std::string::npos);
  CHECK(kua::can_run(kOne, kua::CacheShape{1, 4, 2, 8, 100, 16}).is_ok());
}

TEST_CASE("ua cache and workspace placed over caller buffers write nothing outside them", "[ua][memory][unit]") {
  const Dims d;
  const kua::CacheShape shape{4, d.H, d.G, d.D, 512, 16, 48};  // a shared pool of 48 pages, not 4 * 2 * 32
  const kvmem::Limits limits{2, 0};
  Guarded cache_mem(kua::cache_layout<float>(shape).bytes), work_mem(kua::workspace_bytes<float>(shape, limits));
  kua::PrunedCache<float> placed;
  REQUIRE(kua::PrunedCache<float>::place(cache_mem.data(), cache_mem.bytes, shape, placed).is_ok());
  REQUIRE(placed.attach_workspace(work_mem.data(), work_mem.bytes, limits).is_ok());
  kua::CacheShape full = shape;
  full.pool_pages = 0;
  kua::PrunedCache<float> owned(full);
  std::mt19937_64 rng(3), twin(3);
  Step a(d, 4, 64), b(d, 4, 64);
  for (int it = 0; it < 120; ++it) {
    const auto s0 = std::int32_t(it % 4), s1 = std::int32_t((it + 1 + it / 10) % 4);
    const std::int64_t n0 = it % 9 == 0 ? 40 : 1, n1 = it % 13 == 0 ? 17 : 1;
    a.clear(), b.clear();
    a.add(d, s0, n0, rng), a.add(d, -1, 3, rng);
    b.add(d, s0, n0, twin), b.add(d, -1, 3, twin);
    if (s1 != s0) a.add(d, s1, n1, rng), b.add(d, s1, n1, twin);
    REQUIRE(a.run(kOne, placed, kPrune, d).is_ok());
    REQUIRE(b.run(kOne, owned, kPrune, d).is_ok());
    REQUIRE(a.out == b.out);
    REQUIRE(a.lse == b.lse);
  }
  for (std::int64_t s = 0; s < 4; ++s)
    for (std::int64_t g = 0; g < d.G; ++g) CHECK(kept(placed, s, g) == kept(owned, s, g));
  CHECK(placed.pages_in_use() == pages_for_kept(placed));
  CHECK(owned.pages_in_use() == pages_for_kept(owned));
  CHECK(placed.pages_returned() > 0);
  CHECK(cache_mem.guards_intact());
  CHECK(work_mem.guards_intact());

  SECTION("a step with more rows than the workspace holds is refused, the cache unchanged") {
    const std::vector<unsigned char> before(cache_mem.raw);
    a.clear();
    a.add(d, 0, 1, rng), a.add(d, 1, 1, rng), a.add(d, 2, 1, rng);
    const Status s = a.run(kOne, placed, kPrune, d);
    CHECK(s.code() == StatusCode::kOutOfRange);
    CHECK(s.message().find("workspace") != std::string::npos);
    CHECK(cache_mem.raw == before);
  }
}

TEST_CASE("ua pool exhaustion overflows only the asking slot; reset_slots brings it back", "[ua][memory][unit]") {
  const Dims d;
  const std::int64_t steps = 150;
  // Run B: slots 0 and 1 alone over a full pool, to learn their outputs and the pages they need.
  kua::PrunedCache<float> alone(kua::CacheShape{3, d.H, d.G, d.D, 4096, 16});
  std::vector<std::vector<float>> outs;
  std::int64_t peak = 0;
  {
    std::mt19937_64 rng(17);
    Step st(d, 3, 4096);
    for (std::int64_t i = 0; i < steps; ++i) {
      st.clear();
      st.add(d, 0, i == 0 ? 40 : 1, rng), st.add(d, 1, i == 0 ? 24 : 1, rng);
      REQUIRE(st.run(kOne, alone, kPrune, d).is_ok());
      outs.push_back(st.out);
      peak = std::max(peak, alone.pages_in_use() + 2 * d.G);  // + the page a decode may take before evicting
    }
  }
  // Run A: the same two slots plus slot 2, whose gates barely decay (it keeps everything), over a pool
  // of `peak + 6` pages: slot 2's 2000-token prompt needs 250 pages and cannot have them.
  kua::PrunedCache<float> shared(kua::CacheShape{3, d.H, d.G, d.D, 4096, 16, peak + 6});
  std::mt19937_64 rng(17), other(99);
  Step st(d, 3, 4096), tmp(d, 1, 4096);
  for (std::int64_t i = 0; i < steps; ++i) {
    st.clear();
    // slot 2's row first: its items ask for pages before the others' in each step
    if (i == 0 || i % 10 == 5) tmp.clear(), tmp.add(d, 2, i == 0 ? 2000 : 1, other, -6.0);
    if (i == 0 || i % 10 == 5) {
      st.slot.push_back(2);
      st.q = tmp.q, st.k = tmp.k, st.v = tmp.v, st.zk = tmp.zk, st.zq = tmp.zq;
      st.start.push_back(tmp.start.back());
    }
    st.add(d, 0, i == 0 ? 40 : 1, rng), st.add(d, 1, i == 0 ? 24 : 1, rng);
    REQUIRE(st.run(kOne, shared, kPrune, d).is_ok());
    const bool with2 = st.slot[0] == 2;
    const std::int64_t first = with2 ? st.start[1] : 0;
    // slots 0 and 1: exactly the outputs of the run without slot 2
    REQUIRE(std::vector<float>(st.out.begin() + first * d.H * d.D, st.out.end()) == outs[std::size_t(i)]);
    if (with2) {
      const auto o2 = st.out_of(0, d), l2 = st.lse_of(0, d);
      CHECK(std::all_of(o2.begin(), o2.end(), [](float x) { return x == 0.0f; }));
      CHECK(std::all_of(l2.begin(), l2.end(), [](float x) { return x == 0.0f; }));
    }
    CHECK(shared.overflowed(2));
    CHECK_FALSE(shared.overflowed(0));
    CHECK_FALSE(shared.overflowed(1));
    CHECK(shared.pages(2, 0) + shared.pages(2, 1) == 0);
    CHECK(shared.pages_in_use() == pages_for_kept(shared));
    CHECK(shared.pages_taken() - shared.pages_returned() == shared.pages_in_use());
  }
  CHECK(shared.position(2) == 0);  // an overflowed slot does not advance
  // reset_slots: slot 2 works again and equals a fresh cache fed the same tokens
  REQUIRE(reset(shared, 2).is_ok());
  CHECK_FALSE(shared.overflowed(2));
  kua::PrunedCache<float> fresh(kua::CacheShape{1, d.H, d.G, d.D, 4096, 16});
  std::mt19937_64 r2(5), r2twin(5);
  Step a(d, 2, 64), b(d, 1, 64);
  for (int i = 0; i < 20; ++i) {
    a.clear(), b.clear();
    a.add(d, 2, i == 0 ? 30 : 1, r2), b.add(d, 0, i == 0 ? 30 : 1, r2twin);
    REQUIRE(a.run(kOne, shared, kPrune, d).is_ok());
    REQUIRE(b.run(kOne, fresh, kPrune, d).is_ok());
    REQUIRE(a.out == b.out);
  }
  CHECK_FALSE(shared.overflowed(2));
  for (std::int64_t g = 0; g < d.G; ++g) CHECK(kept(shared, 2, g) == kept(fresh, 0, g));
}

TEST_CASE("ua pages returned equal the pages eviction empties, step by step", "[ua][memory][unit]") {
  const Dims d;
  kua::PrunedCache<float> c(kua::CacheShape{2, d.H, d.G, d.D, 1024, 8});
  std::mt19937_64 rng(8);
  Step st(d, 2, 64);
  st.add(d, 0, 50, rng), st.add(d, 1, 30, rng);
  REQUIRE(st.run(kOne, c, kPrune, d).is_ok());
  std::int64_t expect_taken = c.pages_taken(), expect_returned = c.pages_returned(), freed_total = 0;
  const auto up = [](std::int64_t rows) { return (rows + 7) / 8; };
  for (int i = 0; i < 400; ++i) {
    std::int64_t before[2][2];
    for (std::int64_t b = 0; b < 2; ++b)
      for (std::int64_t g = 0; g < d.G; ++g) before[b][g] = c.length(b, g);
    st.clear();
    st.add(d, 0, 1, rng), st.add(d, 1, 1, rng);
    REQUIRE(st.run(kOne, c, kPrune, d).is_ok());
    std::int64_t freed = 0;
    for (std::int64_t b = 0; b < 2; ++b)
      for (std::int64_t g = 0; g < d.G; ++g) {
        // a decode appends one row (a page when it crosses into one), then eviction empties pages
        expect_taken += up(before[b][g] + 1) - up(before[b][g]);
        expect_returned += up(before[b][g] + 1) - up(c.length(b, g));
        freed += c.freed_pages(b, g).count;
      }
    REQUIRE(c.pages_taken() == expect_taken);
    REQUIRE(c.pages_returned() == expect_returned);
    freed_total += freed;
  }
  CHECK(freed_total > 20);                      // eviction did return pages
  CHECK(c.pages_returned() - freed_total > 0);  // (the prefill's returns came before the loop)
  CHECK(c.pages_in_use() == pages_for_kept(c));
}

TEST_CASE("ua decode soak stays within the page bound (short)", "[ua][memory][unit]") {
  const SoakResult r = soak(2, 20000, 512, 2 * 2 * 33);
  INFO("max length " << r.max_length << ", max pages " << r.max_pages);
  CHECK(r.balanced);
  CHECK_FALSE(r.overflowed);
  CHECK(r.returned > 0);
  CHECK(r.max_pages <= 2 * 2 * 33);
}
