// SPDX-License-Identifier: Apache-2.0
// Documentation snippet (README.md "Compose a variant", docs/guide.md "Compile-time composition"):
// variants composed from policies at compile time, then used on the host backend. main() builds
// inputs, runs both variants and checks them (the bf16 KV Means variant against an fp32 run of the same
// inputs, within the bf16 tolerance of docs/guide.md).

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <type_traits>
#include <vector>

#include "check.hpp"

// [snippet:compose-types]
#include <kvmem/kvmem.hpp>

// KV Means with the paper's 16·sqrt(N) budget (at least 256 slots), bf16 storage, fp32 accumulation.
// budget::checked stops the build when the budget's parameters are invalid (e.g. a negative exponent).
constexpr auto kBudget = kvmem::budget::checked<kvmem::budget::Power{16.0, 0.5, /*minimum*/ 256}>();
using Kvm = kvmem::kvm::Attention<kBudget, kvmem::precision::Bf16Storage>;

// Universal Attention: the paper's query, key and similarity gates plus a user gate (forget faster
// the further apart key j and position m are), self-pruning at p = 0.05.
struct DistanceGate {
  template <class Real>
  KVMEM_HOST_DEVICE static Real log_factor(const kvmem::decay::PairInputs<Real>& in) {
    return Real(-0.01) * static_cast<Real>(in.position - in.key_position);  // log f <= 0
  }
};
using Decay =
    kvmem::decay::Set<kvmem::decay::QueryGate, kvmem::decay::KeyGate, kvmem::decay::SimilarityGate, DistanceGate>;
constexpr auto kPrune = kvmem::prune::checked<kvmem::prune::Threshold{0.05}>();
using Ua = kvmem::ua::Attention<Decay, kPrune, kvmem::precision::Fp32Storage>;

// What the types carry: the state and cache types follow from the precision, the threshold from kPrune.
static_assert(std::is_same_v<Kvm::state_type, kvmem::kvm::State<kvmem::bf16, float>>);
static_assert(std::is_same_v<Ua::Cache, kvmem::ua::PrunedCache<float>>);
static_assert(Ua::threshold() == 0.05);
// [snippet-end]

// [snippet:compose-use]
// One layer of each variant over a prompt. KVM: q [B,Hq,T,D], k [B,Hk,T,D], v [B,Hk,T,Dv],
// gate [B,Hk,T], out [B,T,Hq,Dv]. UA: ua_in and ua_out as in kvmem::ua::Inputs, out [B,T,H,D].
kvmem::Status run_variants(const kvmem::host::Executor& exec, const kvmem::kvm::Weights& weights,
                           kvmem::TensorView<const float, 4> q, kvmem::TensorView<const float, 4> k,
                           kvmem::TensorView<const float, 4> v, kvmem::TensorView<const float, 3> gate,
                           kvmem::TensorView<float, 4> kvm_out, Kvm::state_type& state, const kvmem::ua::Inputs& ua_in,
                           kvmem::TensorView<float, 4> ua_out, Ua::Cache& cache) {
  const std::int64_t B = q.extent(0), Hq = q.extent(1), T = q.extent(2), D = q.extent(3);
  const std::int64_t Hk = k.extent(1), Dv = v.extent(3);

  Kvm kvm;                    // kvm.params: the defaults of kvm::Params, with the budget of the type
  kvm.params.rope_dims = 32;  // run-time Params as usual (rope_dims defaults to 64: set your model's)
  const kvmem::kvm::Shape shape{B, Hq, Hk, D, Dv, /*n_ctx*/ T};
  std::printf("KVM state: %lld slots per (sequence, KV head), %zu bytes\n",
              static_cast<long long>(kvmem::kvm::slot_capacity(Kvm::kBudget, kvm.params.geometry(), shape.n_ctx)),
              kvm.state_bytes(shape));
  KVMEM_RETURN_IF_ERROR(kvm.make_state(shape, state));
  KVMEM_RETURN_IF_ERROR(kvm.prefill(exec, state, weights, q, k, v, gate, kvm_out));  // then kvm.decode(...)

  KVMEM_RETURN_IF_ERROR(Ua::Cache::create({B, Hq, Hk, D, /*capacity*/ T}, cache));
  return Ua::prefill(exec, cache, ua_in, ua_out);  // p = 0.05 from the type; then Ua::decode(...)
}
// [snippet-end]

int main() {
  using kvmem::TensorView;
  const std::int64_t B = 1, Hq = 4, Hk = 2, D = 64, T = 1000;
  auto fill = [](std::vector<float>& x, float f) {
    for (std::size_t i = 0; i < x.size(); ++i) x[i] = std::sin(f * float(i) + 0.5f * float(i % 7));
  };
  std::vector<float> q(B * Hq * T * D), k(B * Hk * T * D), v(B * Hk * T * D), gate(B * Hk * T, 1.5f);
  std::vector<float> z_k(B * Hk * T), z_q(B * Hk * T), kvm_out(B * T * Hq * D), ua_out(B * T * Hq * D);
  fill(q, 0.37f);
  fill(k, 0.011f);
  fill(v, 0.23f);
  fill(z_k, 0.05f);
  fill(z_q, 0.07f);
  for (std::size_t r = 0; r < k.size(); r += std::size_t(D)) {  // unit-norm keys, as UA expects
    float n2 = 0.0f;
    for (std::int64_t d = 0; d < D; ++d) n2 += k[r + std::size_t(d)] * k[r + std::size_t(d)];
    for (std::int64_t d = 0; d < D; ++d) k[r + std::size_t(d)] /= std::sqrt(n2) + 1e-6f;
  }
  std::vector<float> ln_w(D, 1.0f), ln_b(D, 0.0f), tau(Hq, 1.0f);
  const kvmem::kvm::Weights weights{{ln_w.data(), {D}}, {ln_b.data(), {D}}, {tau.data(), {Hq}}, {tau.data(), {Hq}}};
  const TensorView<const float, 4> qv(q.data(), {B, Hq, T, D}), kv(k.data(), {B, Hk, T, D}),
      vv(v.data(), {B, Hk, T, D});
  const TensorView<const float, 3> gv(gate.data(), {B, Hk, T});
  const kvmem::ua::Inputs ua_in{qv,
                                kv,
                                vv,
                                TensorView<const float, 3>(z_k.data(), {B, Hk, T}),
                                TensorView<const float, 3>(z_q.data(), {B, Hk, T}),
                                {}};
  const kvmem::host::Executor exec{};
  Kvm::state_type state;
  Ua::Cache cache;
  SNIPPET_CHECK_OK(run_variants(exec, weights, qv, kv, vv, gv, TensorView<float, 4>(kvm_out.data(), {B, T, Hq, D}),
                                state, ua_in, TensorView<float, 4>(ua_out.data(), {B, T, Hq, D}), cache));
  SNIPPET_CHECK(state.slots(0) == 443);  // floor(16 sqrt(768)) after the one update of 1000 tokens

  // The bf16-storage variant agrees with fp32 storage to the bf16 tolerance (relative Frobenius 1e-2).
  kvmem::kvm::Params fp32_params = state.params();
  std::vector<float> fp32_out(kvm_out.size());
  SNIPPET_CHECK_OK(kvmem::kvm::forward(exec, fp32_params, weights, qv, kv, vv, gv,
                                       TensorView<float, 4>(fp32_out.data(), {B, T, Hq, D})));
  double diff = 0.0, norm = 0.0;
  for (std::size_t i = 0; i < fp32_out.size(); ++i) {
    diff += double(kvm_out[i] - fp32_out[i]) * double(kvm_out[i] - fp32_out[i]);
    norm += double(fp32_out[i]) * double(fp32_out[i]);
  }
  std::printf("bf16 storage against fp32: relative Frobenius %.2e\n", std::sqrt(diff / norm));
  SNIPPET_CHECK(norm > 0.0 && std::sqrt(diff / norm) < 1e-2);

  // The user gate takes part in the decay: the composed variant keeps another set of keys.
  kvmem::ua::PrunedCache<float> plain;
  SNIPPET_CHECK_OK(kvmem::ua::PrunedCache<float>::create({B, Hq, Hk, D, T}, plain));
  std::vector<float> plain_out(ua_out.size());
  SNIPPET_CHECK_OK(kvmem::ua::prefill(exec, plain, ua_in, kvmem::ua::Options{0.05, 128, true},
                                      TensorView<float, 4>(plain_out.data(), {B, T, Hq, D})));
  for (std::int64_t g = 0; g < Hk; ++g) {
    std::printf("kv head %lld: %lld keys kept with the distance gate, %lld without\n", static_cast<long long>(g),
                static_cast<long long>(cache.length(0, g)), static_cast<long long>(plain.length(0, g)));
    SNIPPET_CHECK(cache.length(0, g) >= 1 && cache.length(0, g) < T);
    SNIPPET_CHECK(cache.length(0, g) != plain.length(0, g));
  }
  return 0;
}
