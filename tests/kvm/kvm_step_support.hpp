// SPDX-License-Identifier: Apache-2.0
#pragma once
// Random tokens and packed ragged steps for the KVM memory tests (placement, workspace, allocation).
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "kvmem/backend/host/kvm.hpp"
#include "kvmem/core/slots.hpp"
#include "kvmem/kvm/attention.hpp"

namespace kvmem::test::kvm_mem {

namespace kvm = kvmem::kvm;

struct Dims {
  std::int64_t Hq = 4, Hk = 2, D = 8, Dv = 8;
};

inline kvm::Params make_params(std::int64_t chunk, budget::Any budget) {
  kvm::Params p;
  p.chunk = chunk;
  p.window_chunks = 2;
  p.sink = 1;
  p.rope_dims = 4;
  p.budget = budget;
  return p;
}

struct Weights {
  std::vector<float> w, b, ts, tw;
  Weights(const Dims& d, std::uint64_t seed) {
    std::mt19937_64 rng(seed);
    std::normal_distribution<float> n01(0.f, 1.f);
    std::uniform_real_distribution<float> u(0.5f, 1.5f);
    for (std::int64_t i = 0; i < d.D; ++i) w.push_back(1.f + 0.2f * n01(rng)), b.push_back(0.2f * n01(rng));
    for (std::int64_t i = 0; i < d.Hq; ++i) ts.push_back(u(rng)), tw.push_back(u(rng));
  }
  [[nodiscard]] kvm::Weights view() const {
    return {{w.data(), {std::int64_t(w.size())}},
            {b.data(), {std::int64_t(b.size())}},
            {ts.data(), {std::int64_t(ts.size())}},
            {tw.data(), {std::int64_t(tw.size())}}};
  }
};

// Packed inputs of one step with random tokens; buffers are sized once (reserve) so a test that
// counts allocations can refill them without allocating.
struct Step {
  std::vector<std::int32_t> slot, start;
  std::vector<float> q, k, v, g, out, lse;
  Step(const Dims& d, std::int64_t max_rows, std::int64_t max_tokens) {
    slot.reserve(std::size_t(max_rows));
    start.reserve(std::size_t(max_rows + 1));
    q.reserve(std::size_t(max_tokens * d.Hq * d.D));
    k.reserve(std::size_t(max_tokens * d.Hk * d.D));
    v.reserve(std::size_t(max_tokens * d.Hk * d.Dv));
    g.reserve(std::size_t(max_tokens * d.Hk));
    out.reserve(std::size_t(max_tokens * d.Hq * d.Dv));
    lse.reserve(std::size_t(max_tokens * d.Hq));
    clear();
  }
  void clear() {
    slot.clear();
    start.assign(1, 0);
    q.clear(), k.clear(), v.clear(), g.clear();
  }
  // A row of `n` random tokens for slot s (-1: padding).
  void add(const Dims& d, std::int32_t s, std::int64_t n, std::mt19937_64& rng) {
    std::normal_distribution<float> n01(0.f, 1.f);
    slot.push_back(s);
    for (std::int64_t i = 0; i < n; ++i) {
      for (std::int64_t x = 0; x < d.Hq * d.D; ++x) q.push_back(n01(rng));
      for (std::int64_t x = 0; x < d.Hk * d.D; ++x) k.push_back(n01(rng));
      for (std::int64_t x = 0; x < d.Hk * d.Dv; ++x) v.push_back(n01(rng));
      for (std::int64_t x = 0; x < d.Hk; ++x) {
        const float z = n01(rng);
        g.push_back(z > 0 ? 1.f + z : std::exp(z));  // 1 + elu
      }
    }
    start.push_back(start.back() + std::int32_t(n));
  }
  [[nodiscard]] std::int64_t tokens() const { return start.back(); }
  template <class S>
  Status run(const host::Executor& exec, kvm::State<S, float>& st, const kvm::Weights& w, const Dims& d) {
    const std::int64_t T = tokens();
    out.assign(std::size_t(T * d.Hq * d.Dv), -7.f);
    lse.assign(std::size_t(T * d.Hq), -7.f);
    using I32 = TensorView<const std::int32_t, 1>;
    const Rows rows{I32(slot.data(), {std::int64_t(slot.size())}), I32(start.data(), {std::int64_t(start.size())})};
    return kvm::step(exec, st, w, rows, TensorView<const float, 3>(q.data(), {T, d.Hq, d.D}),
                     TensorView<const float, 3>(k.data(), {T, d.Hk, d.D}),
                     TensorView<const float, 3>(v.data(), {T, d.Hk, d.Dv}),
                     TensorView<const float, 2>(g.data(), {T, d.Hk}), TensorView<float, 3>(out.data(), {T, d.Hq, d.Dv}),
                     TensorView<float, 2>(lse.data(), {T, d.Hq}));
  }
};

}  // namespace kvmem::test::kvm_mem
