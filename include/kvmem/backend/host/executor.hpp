// SPDX-License-Identifier: Apache-2.0
#pragma once
// The host executor: how many threads an operation may use, and which pool runs them. Work is split
// over independent items (sequence, KV head); each item runs start to finish on one thread, so
// results do not depend on the thread count.
//
// Threads are created once, not per call: a ThreadPool keeps its workers parked between calls. An
// executor either points at a pool the engine owns (`pool`), or uses a process-wide pool per thread
// count that is created on first use and lives until exit, so existing `Executor{threads}` callers
// get pooled threads without changes.

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <memory>
#include <mutex>
#include <thread>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <vector>

namespace kvmem::host {

// A fixed set of worker threads that runs one parallel loop at a time; the calling thread takes
// part, so a pool of `threads` runs loops on `threads` threads with `threads - 1` workers parked.
// run() from inside a running loop's body (nested parallelism) runs the inner loop inline.
//
// After a loop a worker polls for the next one for `spin` before it sleeps on a condition variable,
// and the caller polls for the workers' end the same way: a decode step of a few tens of
// microseconds would otherwise pay a sleeping thread's wake-up (tens of microseconds on a virtual
// machine) on every call. Spinning costs CPU time while no loop comes; zero spins not at all.
class ThreadPool {
 public:
  static constexpr std::chrono::microseconds kDefaultSpin{1000};

  explicit ThreadPool(int threads, std::chrono::microseconds spin = kDefaultSpin)
      : size_(threads < 1 ? 1 : threads), spin_(spin) {
    workers_.reserve(std::size_t(size_ - 1));
    for (int w = 1; w < size_; ++w) workers_.emplace_back([this] { work(); });
  }
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;
  ~ThreadPool() {
    {
      const std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
      stop_flag_.store(true, std::memory_order_release);
    }
    wake_.notify_all();
    for (auto& t : workers_) t.join();
  }

  [[nodiscard]] int size() const { return size_; }

  // Runs body(i) for i in [0, count) on at most `workers` threads of this pool (dynamic scheduling:
  // items differ in cost, e.g. UA caches of different lengths). Blocks until every item ran; the
  // first exception is rethrown after every thread has left the loop, and no new item starts once
  // one has thrown. Concurrent calls from different threads take turns.
  template <class Body>
  void run(std::int64_t count, Body&& body, int workers = 0) {
    const int width = static_cast<int>(std::min<std::int64_t>(workers > 0 ? std::min(workers, size_) : size_, count));
    if (width <= 1 || current() == this) {
      for (std::int64_t i = 0; i < count; ++i) body(i);
      return;
    }
    const std::lock_guard<std::mutex> turn(turn_);
    Job job;
    job.count = count;
    job.ctx = static_cast<void*>(&body);
    job.call = [](void* ctx, std::int64_t i) { (*static_cast<std::remove_reference_t<Body>*>(ctx))(i); };
    {
      const std::lock_guard<std::mutex> lock(mutex_);
      job_ = &job;
      seats_ = width - 1;  // workers that may join this loop
      generation_.fetch_add(1, std::memory_order_release);
    }
    wake_.notify_all();
    execute(job);
    {
      std::unique_lock<std::mutex> lock(mutex_);
      seats_ = 0;  // late workers skip this loop
      if (job.active.load() != 0) {
        lock.unlock();
        poll([&] { return job.active.load(std::memory_order_acquire) == 0; });
        lock.lock();
      }
      done_.wait(lock, [&] { return job.active.load() == 0; });
      job_ = nullptr;
    }
    if (job.failure) std::rethrow_exception(job.failure);
  }

 private:
  struct Job {
    std::int64_t count = 0;
    void* ctx = nullptr;
    void (*call)(void*, std::int64_t) = nullptr;
    std::atomic<std::int64_t> next{0};
    std::atomic<bool> failed{false};
    std::exception_ptr failure;
    std::atomic<int> active{0};  // workers inside execute(); changed under mutex_, polled without it
  };

  static ThreadPool*& current() {
    thread_local ThreadPool* pool = nullptr;
    return pool;
  }

  void execute(Job& job) {
    ThreadPool* const outer = current();
    current() = this;
    try {
      for (std::int64_t i = job.next.fetch_add(1); i < job.count && !job.failed.load(); i = job.next.fetch_add(1))
        job.call(job.ctx, i);
    } catch (...) {
      if (!job.failed.exchange(true)) job.failure = std::current_exception();
    }
    current() = outer;
  }

  // Polls `ready` until it holds or spin_ has passed; true when it held.
  template <class Ready>
  bool poll(Ready&& ready) const {
    if (spin_.count() <= 0) return ready();
    const auto end = std::chrono::steady_clock::now() + spin_;
    for (unsigned i = 1;; ++i) {
      if (ready()) return true;
      if (i % 64 == 0 && std::chrono::steady_clock::now() >= end) return false;
#if defined(__x86_64__) || defined(__i386__)
      __builtin_ia32_pause();
#endif
    }
  }
  void work() {
    std::uint64_t seen = 0;
    std::unique_lock<std::mutex> lock(mutex_);
    for (;;) {
      if (!stop_ && generation_.load() == seen) {
        lock.unlock();
        poll([&] {
          return stop_flag_.load(std::memory_order_acquire) || generation_.load(std::memory_order_acquire) != seen;
        });
        lock.lock();
      }
      wake_.wait(lock, [&] { return stop_ || generation_.load() != seen; });
      if (stop_) return;
      seen = generation_.load();
      if (seats_ == 0 || job_ == nullptr) continue;
      --seats_;
      Job& job = *job_;
      ++job.active;
      lock.unlock();
      execute(job);
      lock.lock();
      if (--job.active == 0) done_.notify_all();
    }
  }

  int size_;
  std::vector<std::thread> workers_;
  std::mutex turn_;  // one loop at a time
  std::chrono::microseconds spin_;
  std::mutex mutex_;  // guards job_, seats_, stop_ and the changes of generation_ and Job::active
  std::condition_variable wake_, done_;
  Job* job_ = nullptr;
  int seats_ = 0;
  std::atomic<std::uint64_t> generation_{0};  // polled without mutex_ by spinning workers
  bool stop_ = false;
  std::atomic<bool> stop_flag_{false};  // stop_, for polling
};

struct Executor {
  // 0 = std::thread::hardware_concurrency().
  int threads = 0;
  // The engine's own pool; null = the process-wide pool for resolved_threads() (shared_pool()).
  std::shared_ptr<ThreadPool> pool = nullptr;
  // true = the plain scalar paths everywhere: the summation order that makes decode and prefill
  // bitwise equal. false lets a backend take faster tile paths (e.g. the Eigen dense prefill) that
  // agree with the fp64 reference within DESIGN.md section 5 but not bit for bit.
  bool exact = false;

  [[nodiscard]] int resolved_threads() const {
    if (threads > 0) return threads;
    if (pool) return pool->size();
    const unsigned hw = std::thread::hardware_concurrency();
    return hw == 0 ? 1 : static_cast<int>(hw);
  }
};

// The process-wide pool of `threads` threads, created on first use and kept until exit. An unordered_map:
// clang 15 in HIP mode with libstdc++ 12 and C++20 crashes on a std::map of move-only values, and this
// header reaches hipcc through the umbrella header.
inline ThreadPool& shared_pool(int threads) {
  static std::mutex mutex;
  static std::unordered_map<int, std::unique_ptr<ThreadPool>> pools;
  const std::lock_guard<std::mutex> lock(mutex);
  auto& p = pools[threads];
  if (!p) p = std::make_unique<ThreadPool>(threads);
  return *p;
}

// Runs body(i) for i in [0, count) on up to exec.resolved_threads() threads of the executor's pool
// (see ThreadPool::run: dynamic scheduling, first exception rethrown after every thread left).
template <class Body>
void parallel_for(const Executor& exec, std::int64_t count, Body&& body) {
  const int threads = exec.resolved_threads();
  if (std::min<std::int64_t>(threads, count) <= 1) {
    for (std::int64_t i = 0; i < count; ++i) body(i);
    return;
  }
  ThreadPool& pool = exec.pool ? *exec.pool : shared_pool(threads);
  pool.run(count, std::forward<Body>(body), threads);
}

}  // namespace kvmem::host
