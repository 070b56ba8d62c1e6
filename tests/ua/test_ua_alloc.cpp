// SPDX-License-Identifier: Apache-2.0
// No allocation on the prefill/decode path once a PrunedCache exists (DESIGN.md 3). A counting global
// operator new (this executable only) brackets the calls; one worker thread, so the host executor
// does not start threads (which would allocate their own stacks and bookkeeping).
#include <atomic>
#include <cstddef>
#include <cstdlib>
#include <new>
#include <random>
#include <vector>

#include <catch2/catch.hpp>

#include "kvmem/backend/host/ua.hpp"
#include "ua_host_support.hpp"
#include "ua_step_support.hpp"
#include "ua_test_support.hpp"

// GCC inlines std::allocator's operator new into callers and then flags our free() in operator delete
// as "mismatched"; the replacement pairs malloc with free on purpose.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmismatched-new-delete"
#endif

namespace {
std::atomic<long> g_allocations{0};
}  // namespace

// Every replaceable non-aligned form, so allocation and release always pair malloc/free (ASan checks it).
namespace {
void* counted_malloc(std::size_t size) noexcept {
  g_allocations.fetch_add(1, std::memory_order_relaxed);
  return std::malloc(size ? size : 1);
}
}  // namespace
void* operator new(std::size_t size) {
  if (void* p = counted_malloc(size)) return p;
  throw std::bad_alloc();
}
void* operator new[](std::size_t size) {
  if (void* p = counted_malloc(size)) return p;
  throw std::bad_alloc();
}
void* operator new(std::size_t size, const std::nothrow_t&) noexcept {
  return counted_malloc(size);
}
void* operator new[](std::size_t size, const std::nothrow_t&) noexcept {
  return counted_malloc(size);
}
void operator delete(void* p) noexcept {
  std::free(p);
}
void operator delete[](void* p) noexcept {
  std::free(p);
}
void operator delete(void* p, std::size_t) noexcept {
  std::free(p);
}
void operator delete[](void* p, std::size_t) noexcept {
  std::free(p);
}
void operator delete(void* p, const std::nothrow_t&) noexcept {
  std::free(p);
}
void operator delete[](void* p, const std::nothrow_t&) noexcept {
  std::free(p);
}

TEST_CASE("ua: prefill and decode do not allocate once the cache exists", "[ua][host]") {
  using namespace kvmem::test::ua;
  const Case c = random_case(2, 96, 4, 2, 16, 151, 1.0, true);
  const FloatCase f(c);
  kvmem::ua::PrunedCache<kvmem::bf16> cache(f.cache_shape());
  std::vector<float> out = f.make_out();
  const kvmem::host::Executor exec{1};
  const kvmem::ua::Options opt{0.05, 32, true};
  const long before = g_allocations.load();
  kvmem::Status s = kvmem::ua::prefill(exec, cache, f.slice(0, 64), opt, f.out_slice(out, 0, 64));
  for (std::int64_t t = 64; t < 96 && s.is_ok(); ++t)
    s = kvmem::ua::decode(exec, cache, f.slice(t, t + 1), opt, f.out_slice(out, t, t + 1));
  const long after = g_allocations.load();
  REQUIRE(s.is_ok());
  CHECK(after - before == 0);
  CHECK(cache.position(0) == 96);
  // the counter does count: a freshly made vector allocates
  const long probe_before = g_allocations.load();
  std::vector<float> probe(1000, 1.0f);
  CHECK(g_allocations.load() - probe_before >= 1);
  CHECK(probe[999] == 1.0f);
}

TEST_CASE("ua: steps over a placed cache with a shared page pool do not allocate", "[ua][host]") {
  using namespace kvmem::test::ua_mem;
  const Dims d;
  const kvmem::ua::CacheShape shape{4, d.H, d.G, d.D, 1024, 16, 64};
  std::vector<std::byte> cache_mem(kvmem::ua::cache_layout<kvmem::bf16>(shape).bytes + 64),
      work_mem(kvmem::ua::workspace_bytes<kvmem::bf16>(shape, {2, 0}) + 64);
  const auto aligned = [](std::vector<std::byte>& v) {
    return v.data() + (64 - reinterpret_cast<std::uintptr_t>(v.data()) % 64) % 64;
  };
  kvmem::ua::PrunedCache<kvmem::bf16> cache;
  REQUIRE(kvmem::ua::PrunedCache<kvmem::bf16>::place(aligned(cache_mem), cache_mem.size() - 64, shape, cache).is_ok());
  REQUIRE(cache.attach_workspace(aligned(work_mem), work_mem.size() - 64, {2, 0}).is_ok());
  Step step(d, 4, 64);
  std::mt19937_64 rng(1);
  const kvmem::ua::Options opt{0.05, 32, true};
  long counted = 0;
  for (int i = 0; i < 300; ++i) {
    step.clear();
    step.add(d, std::int32_t(i % 4), i % 25 == 0 ? 40 : 1, rng);
    step.add(d, -1, 2, rng);
    step.add(d, std::int32_t((i + 1) % 4), 1, rng);
    const long before = g_allocations.load();
    const kvmem::Status s = step.run(kvmem::host::Executor{1}, cache, opt, d);
    counted += g_allocations.load() - before;
    REQUIRE(s.is_ok());
  }
  CHECK(counted == 0);
  CHECK(cache.pages_returned() > 0);
}
