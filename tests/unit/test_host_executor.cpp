// SPDX-License-Identifier: Apache-2.0
// host::ThreadPool and host::parallel_for: every item runs exactly once whatever the thread count,
// exceptions reach the caller, threads are created once and reused, nested and concurrent loops
// finish.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <set>
#include <stdexcept>
#include <thread>
#include <vector>

#include <catch2/catch.hpp>

#include "kvmem/backend/host/executor.hpp"

namespace {
using kvmem::host::Executor;
using kvmem::host::parallel_for;
using kvmem::host::ThreadPool;

// A per-item value that depends only on the item (an integer hash, so equality is exact).
std::uint64_t item_value(std::int64_t i) {
  std::uint64_t x = std::uint64_t(i) * 0x9E3779B97F4A7C15ull;
  for (int r = 0; r < 100; ++r) x = (x ^ (x >> 29)) * 0xBF58476D1CE4E5B9ull;
  return x;
}

std::vector<std::uint64_t> run_items(const Executor& exec, std::int64_t count) {
  std::vector<std::uint64_t> out(static_cast<std::size_t>(count), 0);
  std::vector<std::atomic<int>> runs(static_cast<std::size_t>(count));
  parallel_for(exec, count, [&](std::int64_t i) {
    out[std::size_t(i)] = item_value(i);
    runs[std::size_t(i)].fetch_add(1);
  });
  for (std::int64_t i = 0; i < count; ++i) REQUIRE(runs[std::size_t(i)].load() == 1);
  return out;
}
}  // namespace

TEST_CASE("host parallel_for: every item exactly once, results independent of the thread count", "[host][unit]") {
  std::vector<std::uint64_t> expected(1000);
  for (std::int64_t i = 0; i < 1000; ++i) expected[std::size_t(i)] = item_value(i);
  for (int threads : {1, 2, 3, 8})
    for (std::int64_t count : {0, 1, 2, 7, 1000}) {
      INFO("threads " << threads << " count " << count);
      const auto out = run_items(Executor{threads}, count);
      CHECK(std::equal(out.begin(), out.end(), expected.begin()));
    }
  auto pool = std::make_shared<ThreadPool>(4);
  const Executor engine{0, pool};
  CHECK(engine.resolved_threads() == 4);
  const auto out = run_items(engine, 1000);
  CHECK(std::equal(out.begin(), out.end(), expected.begin()));
}

TEST_CASE("host parallel_for: the first exception reaches the caller and the pool stays usable", "[host][unit]") {
  for (int threads : {1, 3}) {
    INFO("threads " << threads);
    const Executor exec{threads};
    std::atomic<std::int64_t> started{0};
    CHECK_THROWS_AS(parallel_for(exec, 10000,
                                 [&](std::int64_t i) {
                                   started.fetch_add(1);
                                   if (i == 5) throw std::runtime_error("item 5");
                                 }),
                    std::runtime_error);
    CHECK(started.load() < 10000);  // no new item starts once one has thrown
    const auto out = run_items(exec, 100);
    CHECK(out[7] == item_value(7));
  }
}

TEST_CASE("host parallel_for: threads are created once and reused across calls", "[host][unit]") {
  const Executor exec{3};
  CHECK(&kvmem::host::shared_pool(3) == &kvmem::host::shared_pool(3));
  std::mutex m;
  std::set<std::thread::id> ids;
  for (int call = 0; call < 50; ++call)
    parallel_for(exec, 64, [&](std::int64_t) {
      std::this_thread::sleep_for(std::chrono::microseconds(20));
      const std::lock_guard<std::mutex> lock(m);
      ids.insert(std::this_thread::get_id());
    });
  // The caller and the pool's two parked workers; threads started per call would add ids.
  CHECK(ids.size() <= 3);
  CHECK(ids.count(std::this_thread::get_id()) == 1);
}

TEST_CASE("host parallel_for: nested and concurrent loops finish with every item run", "[host][unit]") {
  auto pool = std::make_shared<ThreadPool>(3);
  const Executor exec{0, pool};
  std::atomic<std::int64_t> total{0};
  parallel_for(exec, 8, [&](std::int64_t) {  // the inner loop runs inline on the calling worker
    parallel_for(exec, 10, [&](std::int64_t) { total.fetch_add(1); });
  });
  CHECK(total.load() == 80);
  std::vector<std::uint64_t> a, b;
  std::thread other([&] { a = run_items(exec, 500); });
  b = run_items(exec, 500);
  other.join();
  REQUIRE(a.size() == 500);
  CHECK(a == b);
  CHECK(a[499] == item_value(499));
}

TEST_CASE("host ThreadPool: loops right after each other, after the spin ran out, and a pool destroyed while spinning",
          "[host][unit]") {
  using std::chrono::microseconds;
  std::vector<std::uint64_t> expected(300);
  for (std::int64_t i = 0; i < 300; ++i) expected[std::size_t(i)] = item_value(i);
  for (const microseconds spin : {microseconds(0), microseconds(200), ThreadPool::kDefaultSpin}) {
    INFO("spin " << spin.count() << " us");
    auto pool = std::make_shared<ThreadPool>(3, spin);
    {
      const Executor exec{0, pool};
      for (int call = 0; call < 200; ++call) {  // back to back: workers still polling take the next loop
        const auto out = run_items(exec, 300);
        REQUIRE(std::equal(out.begin(), out.end(), expected.begin()));
      }
      for (int call = 0; call < 3; ++call) {  // idle longer than the spin: workers sleep and are woken
        std::this_thread::sleep_for(spin + microseconds(2000));
        const auto out = run_items(exec, 300);
        REQUIRE(std::equal(out.begin(), out.end(), expected.begin()));
      }
      run_items(exec, 300);
    }
    REQUIRE(pool.use_count() == 1);
    const auto t0 = std::chrono::steady_clock::now();
    pool.reset();  // the workers are polling: the destructor must stop them, not wait out a sleep
    CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(2));
  }
}
