// SPDX-License-Identifier: Apache-2.0
// No KVM step allocates (DESIGN.md 3) once the state and its workspace are placed: a counting global
// operator new (this executable only) brackets the steps. The exact path on one thread is counted from
// the first step; with two threads after the first step, which creates the shared thread pool; the fast
// path after one step, since each pool thread sizes its Eigen tile scratch on its first call.
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <new>
#include <random>
#include <vector>

#include <catch2/catch.hpp>

#include "kvm_step_support.hpp"

// GCC inlines std::allocator's operator new into callers and then flags our free() in operator delete
// as "mismatched"; the replacement pairs malloc with free on purpose.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmismatched-new-delete"
#endif

namespace {
std::atomic<long> g_allocations{0};
void* counted_malloc(std::size_t size) noexcept {
  g_allocations.fetch_add(1, std::memory_order_relaxed);
  return std::malloc(size ? size : 1);
}
void* counted_aligned(std::size_t size, std::align_val_t align) noexcept {
  g_allocations.fetch_add(1, std::memory_order_relaxed);
  const auto a = static_cast<std::size_t>(align);
  return std::aligned_alloc(a, (size + a - 1) / a * a);
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
void* operator new(std::size_t size, std::align_val_t align) {
  if (void* p = counted_aligned(size, align)) return p;
  throw std::bad_alloc();
}
void* operator new[](std::size_t size, std::align_val_t align) {
  if (void* p = counted_aligned(size, align)) return p;
  throw std::bad_alloc();
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
void operator delete(void* p, std::align_val_t) noexcept {
  std::free(p);
}
void operator delete[](void* p, std::align_val_t) noexcept {
  std::free(p);
}
void operator delete(void* p, std::size_t, std::align_val_t) noexcept {
  std::free(p);
}
void operator delete[](void* p, std::size_t, std::align_val_t) noexcept {
  std::free(p);
}

namespace {

using namespace kvmem::test::kvm_mem;
namespace kvm = kvmem::kvm;

// Steps mixing prefill chunks, decode tokens and padding over four slots; returns the allocations
// counted while they ran (Step buffers are reserved up front and refilled in place).
template <class S>
long count_steps(const kvmem::host::Executor& exec, kvm::State<S, float>& st, const Dims& d, int steps) {
  const Weights w(d, 3);
  Step step(d, 3, 64);
  std::mt19937_64 rng(7);
  long allocations = 0;
  for (int i = 0; i < steps; ++i) {
    step.clear();
    step.add(d, std::int32_t(i % 4), i % 6 == 0 ? 20 : 1, rng);
    step.add(d, -1, 1, rng);
    step.add(d, std::int32_t((i + 2) % 4), 1, rng);
    const long before = g_allocations.load();
    const kvmem::Status s = step.run(exec, st, w.view(), d);
    allocations += g_allocations.load() - before;
    REQUIRE(s.is_ok());
  }
  return allocations;
}

}  // namespace

TEST_CASE("kvm steps do not allocate", "[kvm][memory][unit]") {
  const Dims d{4, 2, 32, 32};
  const kvm::Problem pr{make_params(16, kvmem::budget::Power{2.0, 0.5, 16}), {4, d.Hq, d.Hk, d.D, d.Dv, 2000}};
  std::vector<std::byte> state_mem(kvm::state_bytes<kvmem::bf16, float>(pr) + 64),
      work_mem(kvm::workspace_bytes<kvmem::bf16, float>(pr, {2, 0}) + 64);
  const auto aligned = [](std::vector<std::byte>& v) {
    return v.data() + (64 - reinterpret_cast<std::uintptr_t>(v.data()) % 64) % 64;
  };
  kvm::State<kvmem::bf16, float> st;
  REQUIRE(kvm::State<kvmem::bf16, float>::place(aligned(state_mem), state_mem.size() - 64, pr, st).is_ok());
  REQUIRE(st.attach_workspace(aligned(work_mem), work_mem.size() - 64, {2, 0}).is_ok());

  SECTION("exact path, one thread, from the first step") {
    CHECK(count_steps(kvmem::host::Executor{.threads = 1, .exact = true}, st, d, 120) == 0);
    CHECK(st.tokens(0) > 3 * 16);  // updates ran (past the window)
  }
  SECTION("exact path, two threads, after the step that creates the shared thread pool") {
    const kvmem::host::Executor exec{.threads = 2, .exact = true};
    (void)count_steps(exec, st, d, 1);
    CHECK(count_steps(exec, st, d, 120) == 0);
  }
  SECTION("fast path after a warm-up step (the thread's tile scratch is sized on its first call)") {
    const kvmem::host::Executor exec{.threads = 1, .exact = false};
    (void)count_steps(exec, st, d, 1);
    CHECK(count_steps(exec, st, d, 120) == 0);
  }
  SECTION("fp8 storage (e4m3 readout rows with their scales), exact and fast paths") {
    std::vector<std::byte> state8(kvm::state_bytes<kvmem::e4m3, float>(pr) + 64),
        work8(kvm::workspace_bytes<kvmem::e4m3, float>(pr, {2, 0}) + 64);
    kvm::State<kvmem::e4m3, float> st8;
    REQUIRE(kvm::State<kvmem::e4m3, float>::place(aligned(state8), state8.size() - 64, pr, st8).is_ok());
    REQUIRE(st8.attach_workspace(aligned(work8), work8.size() - 64, {2, 0}).is_ok());
    CHECK(count_steps(kvmem::host::Executor{.threads = 1, .exact = true}, st8, d, 120) == 0);
    const kvmem::host::Executor fast{.threads = 1, .exact = false};
    (void)count_steps(fast, st8, d, 1);
    CHECK(count_steps(fast, st8, d, 120) == 0);
    CHECK(st8.tokens(0) > 3 * 16);
  }
  // the counter does count: a freshly made vector allocates
  const long probe_before = g_allocations.load();
  std::vector<float> probe(1000, 1.0f);
  CHECK(g_allocations.load() - probe_before >= 1);
  CHECK(probe[999] == 1.0f);
}
