// SPDX-License-Identifier: Apache-2.0
#pragma once
// Random tokens and packed ragged UA steps for the memory tests (page pool, placement, allocation).
// Token generation follows the slot suite's: unit-norm keys, queries of scale 2, gate logits normal
// around `gate_mean`, so p = 0.05 evicts steadily.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "kvmem/backend/host/ua.hpp"
#include "kvmem/core/slots.hpp"

namespace kvmem::test::ua_mem {

struct Dims {
  std::int64_t H = 4, G = 2, D = 8;
};

// Packed inputs of one step; buffers are reserved once so a counting test can refill them in place.
struct Step {
  std::vector<std::int32_t> slot, start;
  std::vector<float> q, k, v, zk, zq, out, lse;
  Step(const Dims& d, std::int64_t max_rows, std::int64_t max_tokens) {
    slot.reserve(std::size_t(max_rows));
    start.reserve(std::size_t(max_rows + 1));
    q.reserve(std::size_t(max_tokens * d.H * d.D));
    k.reserve(std::size_t(max_tokens * d.G * d.D));
    v.reserve(std::size_t(max_tokens * d.G * d.D));
    zk.reserve(std::size_t(max_tokens * d.G));
    zq.reserve(std::size_t(max_tokens * d.G));
    out.reserve(std::size_t(max_tokens * d.H * d.D));
    lse.reserve(std::size_t(max_tokens * d.H));
    clear();
  }
  void clear() {
    slot.clear();
    start.assign(1, 0);
    q.clear(), k.clear(), v.clear(), zk.clear(), zq.clear();
  }
  void add(const Dims& d, std::int32_t s, std::int64_t n, std::mt19937_64& rng, double gate_mean = 1.0) {
    std::normal_distribution<float> n01(0.0f, 1.0f), gate(float(gate_mean), 1.5f);
    slot.push_back(s);
    for (std::int64_t t = 0; t < n; ++t) {
      for (std::int64_t x = 0; x < d.H * d.D; ++x) q.push_back(2.0f * n01(rng));
      for (std::int64_t g = 0; g < d.G; ++g) {
        const std::size_t at = k.size();
        double norm = 0.0;
        for (std::int64_t x = 0; x < d.D; ++x) {
          k.push_back(n01(rng));
          norm += double(k.back()) * k.back();
          v.push_back(n01(rng));
        }
        for (std::int64_t x = 0; x < d.D; ++x)
          k[at + std::size_t(x)] = float(k[at + std::size_t(x)] / (std::sqrt(norm) + 1e-6));
        zk.push_back(gate(rng));
        zq.push_back(gate(rng));
      }
    }
    start.push_back(start.back() + std::int32_t(n));
  }
  [[nodiscard]] std::int64_t tokens() const { return start.back(); }
  template <class Storage>
  Status run(const host::Executor& exec, ::kvmem::ua::PrunedCache<Storage>& cache, const ::kvmem::ua::Options& opt,
             const Dims& d) {
    const std::int64_t N = tokens();
    out.assign(std::size_t(N * d.H * d.D), -7.0f);
    lse.assign(std::size_t(N * d.H), -7.0f);
    using I32 = TensorView<const std::int32_t, 1>;
    const Rows rows{I32(slot.data(), {std::int64_t(slot.size())}), I32(start.data(), {std::int64_t(start.size())})};
    ::kvmem::ua::PackedInputs in;
    in.q = TensorView<const float, 3>(q.data(), {N, d.H, d.D});
    in.k = TensorView<const float, 3>(k.data(), {N, d.G, d.D});
    in.v = TensorView<const float, 3>(v.data(), {N, d.G, d.D});
    in.z_k = TensorView<const float, 2>(zk.data(), {N, d.G});
    in.z_q = TensorView<const float, 2>(zq.data(), {N, d.G});
    return ::kvmem::ua::step(exec, cache, rows, in, opt, TensorView<float, 3>(out.data(), {N, d.H, d.D}),
                             TensorView<float, 2>(lse.data(), {N, d.H}));
  }
  // Output and lse rows of the tokens of row r (token-major, every head).
  [[nodiscard]] std::vector<float> out_of(std::size_t r, const Dims& d) const {
    return {out.begin() + start[r] * d.H * d.D, out.begin() + start[r + 1] * d.H * d.D};
  }
  [[nodiscard]] std::vector<float> lse_of(std::size_t r, const Dims& d) const {
    return {lse.begin() + start[r] * d.H, lse.begin() + start[r + 1] * d.H};
  }
};

}  // namespace kvmem::test::ua_mem

namespace kvmem::test::ua_mem {

// Decode soak: `slots` sequences decode `tokens` tokens each at p = 0.05 through ::kvmem::ua::step over a pool of
// `pool_pages` pages of 16 rows. After every step the pool must hold exactly the kept rows rounded up
// to pages (Σ ceil(length / 16) over (slot, kv head)), no slot may overflow, and the taken / returned
// counters must balance. Returns the largest kept length and pages in use seen.
struct SoakResult {
  std::int64_t max_length = 0, max_pages = 0, returned = 0;
  bool balanced = true, overflowed = false;
};
inline SoakResult soak(std::int64_t slots, std::int64_t tokens, std::int64_t capacity, std::int64_t pool_pages) {
  const Dims d;
  ::kvmem::ua::PrunedCache<bf16> cache(::kvmem::ua::CacheShape{slots, d.H, d.G, d.D, capacity, 16, pool_pages});
  const ::kvmem::ua::Options opt{0.05, 64, true};
  const host::Executor exec{.threads = 1};
  Step step(d, slots, slots);
  std::mt19937_64 rng(2024);
  SoakResult r;
  for (std::int64_t t = 0; t < tokens && r.balanced && !r.overflowed; ++t) {
    step.clear();
    for (std::int64_t s = 0; s < slots; ++s) step.add(d, std::int32_t(s), 1, rng);
    if (!step.run(exec, cache, opt, d).is_ok()) {
      r.balanced = false;
      break;
    }
    std::int64_t expect = 0;
    for (std::int64_t s = 0; s < slots; ++s) {
      r.overflowed = r.overflowed || cache.overflowed(s);
      for (std::int64_t g = 0; g < d.G; ++g) {
        r.max_length = std::max(r.max_length, cache.length(s, g));
        expect += (cache.length(s, g) + 15) / 16;
      }
    }
    r.max_pages = std::max(r.max_pages, cache.pages_in_use());
    r.balanced = cache.pages_in_use() == expect && cache.pages_taken() - cache.pages_returned() == expect;
  }
  r.returned = cache.pages_returned();
  return r;
}

}  // namespace kvmem::test::ua_mem
