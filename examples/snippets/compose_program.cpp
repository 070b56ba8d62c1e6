// SPDX-License-Identifier: Apache-2.0
// Documentation snippet (README.md "Compose a variant", docs/compose.md): a complete program that composes
// a KV Means variant with a user budget and a Universal Attention variant with a rank prune rule, creates
// their state and cache, and runs a prompt on the host. It checks its own results: the KVM slot count
// follows the user budget's schedule, and every UA (sequence, KV head) keeps exactly its limit.

// [snippet:compose-program]
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <vector>

#include <kvmem/kvmem.hpp>

// A user budget: |S| grows with log2 of the tokens seen. Any type with these members is a
// kvmem::BudgetPolicy; the state is sized from max_slots, every update asks slots().
struct LogBudget {
  double factor = 24.0;
  std::int64_t maximum = 4096;
  std::int64_t slots(std::int64_t tokens, std::int64_t avail, std::int64_t current) const {
    const auto raw = static_cast<std::int64_t>(factor * std::log2(double(tokens)));
    return std::max(std::min({raw, avail, maximum}), current);
  }
  std::int64_t max_slots(std::int64_t n_ctx) const { return std::min(slots(n_ctx, n_ctx, 0), n_ctx); }
  constexpr const char* invalid_reason() const { return factor > 0.0 ? nullptr : "factor must be > 0"; }
  kvmem::Status validate() const { return kvmem::Status::ok(); }
};

constexpr std::int64_t kHeadDim = 64;
using Kvm = kvmem::kvm::Attention<LogBudget{}, kvmem::precision::Fp32Storage, kHeadDim>;
// UA with the paper's three gates, keeping the 96 least decayed keys per (sequence, KV head) (KeepTop{k, p}
// also applies a threshold p first). prune::Threshold{p}, PerLayer{p0, p1, ..} or None fit here as well.
using Ua =
    kvmem::ua::Attention<kvmem::decay::Universal, kvmem::prune::KeepTop{96}, kvmem::precision::Fp32Storage, kHeadDim>;

int main() {
  using kvmem::TensorView;
  const std::int64_t B = 2, Hq = 4, Hk = 2, D = kHeadDim, T = 500;
  // Inputs as an engine would pass them: q [B,Hq,T,D], k and v [B,Hk,T,D], gates [B,Hk,T].
  std::vector<float> q(B * Hq * T * D), k(B * Hk * T * D), v(B * Hk * T * D);
  std::vector<float> gate(B * Hk * T), z_k(B * Hk * T), z_q(B * Hk * T);
  for (std::size_t i = 0; i < q.size(); ++i) q[i] = std::sin(0.37f * float(i));
  for (std::size_t i = 0; i < k.size(); ++i) k[i] = std::cos(0.011f * float(i) + float(i % 5));
  for (std::size_t i = 0; i < v.size(); ++i) v[i] = std::sin(0.23f * float(i));
  for (std::size_t i = 0; i < gate.size(); ++i) {
    gate[i] = 1.0f + 0.5f * std::sin(0.1f * float(i));
    z_k[i] = 2.0f * std::sin(0.05f * float(i));
    z_q[i] = 2.0f * std::cos(0.07f * float(i));
  }
  for (std::size_t r = 0; r < k.size(); r += std::size_t(D)) {  // unit-norm keys, as UA expects
    float n2 = 0.0f;
    for (std::size_t d = 0; d < std::size_t(D); ++d) n2 += k[r + d] * k[r + d];
    for (std::size_t d = 0; d < std::size_t(D); ++d) k[r + d] /= std::sqrt(n2);
  }
  std::vector<float> ln_w(D, 1.0f), ln_b(D, 0.0f), tau(Hq, 1.0f), kvm_out(B * T * Hq * D), ua_out(B * T * Hq * D);
  const TensorView<const float, 4> qv(q.data(), {B, Hq, T, D}), kv(k.data(), {B, Hk, T, D}),
      vv(v.data(), {B, Hk, T, D});
  const kvmem::host::Executor exec{};

  // KV Means: run-time Params as usual (chunk, window, rope_dims), the budget from the type.
  Kvm kvm;
  kvm.params.chunk = 64;
  kvm.params.rope_dims = 32;
  Kvm::state_type state;
  const kvmem::kvm::Shape shape{B, Hq, Hk, D, D, /*n_ctx*/ T};
  const kvmem::kvm::Weights weights{{ln_w.data(), {D}}, {ln_b.data(), {D}}, {tau.data(), {Hq}}, {tau.data(), {Hq}}};
  kvmem::Status s = kvm.make_state(shape, state);
  if (s.is_ok())
    s = kvm.prefill(exec, state, weights, qv, kv, vv, TensorView<const float, 3>(gate.data(), {B, Hk, T}),
                    TensorView<float, 4>(kvm_out.data(), {B, T, Hq, D}));  // then kvm.decode(...) per token
  if (!s.is_ok()) return std::fprintf(stderr, "kvm: %s\n", s.to_string().c_str()), 1;
  const std::int64_t expected = kvmem::kvm::slots_after(LogBudget{}, kvm.params.geometry(), T);
  std::printf("KVM: %lld slots after %lld tokens (capacity %lld)\n", static_cast<long long>(state.slots(0)),
              static_cast<long long>(T), static_cast<long long>(state.capacity()));
  if (state.slots(0) != expected) return 1;

  // Universal Attention: the cache holds every key of the prompt before the chunk-end evictions.
  Ua::Cache cache;
  s = Ua::Cache::create({B, Hq, Hk, D, /*capacity*/ T}, cache);
  const kvmem::ua::Inputs ua_in{qv,
                                kv,
                                vv,
                                TensorView<const float, 3>(z_k.data(), {B, Hk, T}),
                                TensorView<const float, 3>(z_q.data(), {B, Hk, T}),
                                {}};
  if (s.is_ok()) s = Ua::prefill(exec, cache, ua_in, TensorView<float, 4>(ua_out.data(), {B, T, Hq, D}));
  if (!s.is_ok()) return std::fprintf(stderr, "ua: %s\n", s.to_string().c_str()), 1;
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t g = 0; g < Hk; ++g) {
      std::printf("UA sequence %lld, KV head %lld: %lld keys kept\n", static_cast<long long>(b),
                  static_cast<long long>(g), static_cast<long long>(cache.length(b, g)));
      if (cache.length(b, g) != 96) return 1;  // every chunk-end eviction keeps 96 of the prompt
    }
  return 0;
}
// [snippet-end]
