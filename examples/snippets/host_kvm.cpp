// SPDX-License-Identifier: Apache-2.0
// Documentation snippet (README.md "Run it", docs/guide.md "Host backend"): KV Means on the host
// backend, a prompt prefill followed by decode steps. main() checks the result.

#include <cmath>
#include <cstdint>
#include <vector>

#include "check.hpp"

// [snippet:kvm-host]
#include <kvmem/kvmem.hpp>

// Prefill a 1000-token prompt, then decode `steps` tokens, on one layer of KV Means.
kvmem::Status kv_means_on_host(kvmem::kvm::State<float>& state, std::vector<float>& out1) {
  using kvmem::TensorView;
  const std::int64_t B = 1, Hq = 4, Hk = 2, D = 64, Dv = 64, T = 1000, steps = 8;

  kvmem::kvm::Params params;  // chunk 256, window 2 chunks, 1 sink slot, rope_dims 64, fixed 256 slots
  params.rope_dims = 32;      // rotated key channels of this model (the default 64 is for D = 128)
  params.budget = kvmem::budget::Power{16.0, 0.5, /*minimum*/ 256};  // 16·sqrt(N) slots
  // Sized once for the longest context: memory for the budget's largest slot count at n_ctx tokens.
  KVMEM_RETURN_IF_ERROR(kvmem::kvm::State<float>::create(params, {B, Hq, Hk, D, Dv, /*n_ctx*/ T + steps}, state));

  // The layer's learned parameters: LN_s affine [D], temperatures tau_state and tau_bswa [Hq].
  std::vector<float> ln_w(D, 1.0f), ln_b(D, 0.0f), tau(Hq, 1.0f);
  const kvmem::kvm::Weights weights{{ln_w.data(), {D}}, {ln_b.data(), {D}}, {tau.data(), {Hq}}, {tau.data(), {Hq}}};

  // Projected, normalised and rotated activations (synthetic here), and merge gates g > 0.
  auto fill = [](std::vector<float>& x, float f) {
    for (std::size_t i = 0; i < x.size(); ++i) x[i] = std::sin(f * float(i) + 0.5f * float(i % 7));
  };
  std::vector<float> q(B * Hq * T * D), k(B * Hk * T * D), v(B * Hk * T * Dv), gate(B * Hk * T, 1.5f);
  std::vector<float> out(B * T * Hq * Dv);
  fill(q, 0.37f);
  fill(k, 0.11f);
  fill(v, 0.23f);

  const kvmem::host::Executor exec{/*threads, 0 = every core*/ 0};
  KVMEM_RETURN_IF_ERROR(kvmem::kvm::prefill(exec, state, weights, TensorView<const float, 4>(q.data(), {B, Hq, T, D}),
                                            TensorView<const float, 4>(k.data(), {B, Hk, T, D}),
                                            TensorView<const float, 4>(v.data(), {B, Hk, T, Dv}),
                                            TensorView<const float, 3>(gate.data(), {B, Hk, T}),
                                            TensorView<float, 4>(out.data(), {B, T, Hq, Dv})));  // [B,T,Hq,Dv]

  // Decode: one token per sequence and call, at position state.tokens(b).
  std::vector<float> q1(B * Hq * D), k1(B * Hk * D), v1(B * Hk * Dv), g1(B * Hk, 1.5f);
  out1.assign(B * Hq * Dv, 0.0f);
  for (std::int64_t step = 0; step < steps; ++step) {
    fill(q1, 0.3f + 0.01f * float(step));
    fill(k1, 0.7f + 0.01f * float(step));
    fill(v1, 0.9f);
    KVMEM_RETURN_IF_ERROR(kvmem::kvm::decode(
        exec, state, weights, TensorView<const float, 4>(q1.data(), {B, Hq, 1, D}),
        TensorView<const float, 4>(k1.data(), {B, Hk, 1, D}), TensorView<const float, 4>(v1.data(), {B, Hk, 1, Dv}),
        TensorView<const float, 3>(g1.data(), {B, Hk, 1}), TensorView<float, 4>(out1.data(), {B, 1, Hq, Dv})));
  }
  return kvmem::Status::ok();
}
// [snippet-end]

int main() {
  kvmem::kvm::State<float> state;
  std::vector<float> out1;
  SNIPPET_CHECK_OK(kv_means_on_host(state, out1));
  // 1008 tokens: one state update (at the first token of chunk 3) took the state to floor(16 sqrt(768)) = 443
  // slots, and the schedule's closed form says the same.
  SNIPPET_CHECK(state.tokens(0) == 1008);
  SNIPPET_CHECK(state.slots(0) == 443);
  SNIPPET_CHECK(state.slots(0) == kvmem::kvm::slots_after(state.params().budget, state.params().geometry(), 1008));
  bool finite = true, nonzero = false;
  for (float x : out1) {
    finite = finite && std::isfinite(x);
    nonzero = nonzero || x != 0.0f;
  }
  SNIPPET_CHECK(finite && nonzero);
  std::printf("KV Means: %lld tokens, %lld slots, %zu cache bytes\n", static_cast<long long>(state.tokens(0)),
              static_cast<long long>(state.slots(0)), state.cache_bytes(0));
  return 0;
}
