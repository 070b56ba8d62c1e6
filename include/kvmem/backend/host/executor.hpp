// SPDX-License-Identifier: Apache-2.0
#pragma once
// The host executor: how many std::threads an operation may use. Work is split over independent
// items (sequence, KV head); each item runs start to finish on one thread, so results do not
// depend on the thread count.

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <exception>
#include <thread>
#include <vector>

namespace kvmem::host {

struct Executor {
  // 0 = std::thread::hardware_concurrency().
  int threads = 0;

  [[nodiscard]] int resolved_threads() const {
    if (threads > 0) return threads;
    const unsigned hw = std::thread::hardware_concurrency();
    return hw == 0 ? 1 : static_cast<int>(hw);
  }
};

// Runs body(i) for i in [0, count) on up to exec.resolved_threads() threads (dynamic scheduling:
// items differ in cost, e.g. UA caches of different lengths). The first exception is rethrown
// after every thread has joined.
template <class Body>
void parallel_for(const Executor& exec, std::int64_t count, Body&& body) {
  const std::int64_t workers = std::min<std::int64_t>(exec.resolved_threads(), count);
  if (workers <= 1) {
    for (std::int64_t i = 0; i < count; ++i) body(i);
    return;
  }
  std::atomic<std::int64_t> next{0};
  std::exception_ptr failure;
  std::atomic<bool> failed{false};
  auto worker = [&] {
    try {
      for (std::int64_t i = next.fetch_add(1); i < count && !failed.load(); i = next.fetch_add(1)) body(i);
    } catch (...) {
      if (!failed.exchange(true)) failure = std::current_exception();
    }
  };
  std::vector<std::thread> pool;
  pool.reserve(static_cast<std::size_t>(workers - 1));
  for (std::int64_t w = 1; w < workers; ++w) pool.emplace_back(worker);
  worker();
  for (auto& t : pool) t.join();
  if (failure) std::rethrow_exception(failure);
}

}  // namespace kvmem::host
