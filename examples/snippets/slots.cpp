// SPDX-License-Identifier: Apache-2.0
// Documentation snippet (docs/slots.md, docs/slots-ua.md): one ragged step over sequence slots, for KV
// Means and for Universal Attention on the host backend: a prefill chunk of one sequence, a padding row
// and a decode token of another in one call. main() checks the slots' counters, the zeroed padding rows
// and that the prefill row equals its sequence run alone.

#include <cmath>
#include <cstdint>
#include <vector>

#include "check.hpp"
#include "kvmem/kvmem.hpp"

namespace {

using kvmem::TensorView;
constexpr std::int64_t kHq = 2, kHk = 1, kD = 16;

void fill(std::vector<float>& x, float f) {
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = std::sin(f * float(i) + 0.3f * float(i % 5));
}

kvmem::Status kvm_ragged_step(const kvmem::kvm::Weights& weights, const kvmem::kvm::Params& params,
                              const std::vector<float>& q, const std::vector<float>& k, const std::vector<float>& v,
                              const std::vector<float>& gate, std::vector<float>& out, std::vector<float>& lse,
                              kvmem::kvm::State<float>& state) {
  const std::int64_t Hq = kHq, Hk = kHk, D = kD, Dv = kD;
  // [snippet:kvm-slots-create]
  // A state of 16 sequence slots (Shape::B), each able to hold up to n_ctx tokens.
  KVMEM_RETURN_IF_ERROR(
      kvmem::kvm::State<float>::create(params, {/*max_slots*/ 16, Hq, Hk, D, Dv, /*n_ctx*/ 4096}, state));
  // [snippet-end]
  // [snippet:kvm-step]
  // Row 0: 40 prompt tokens of the sequence in slot 2; row 1: padding (3 tokens, skipped, zeroed);
  // row 2: one decode token of the sequence in slot 0. Inputs are packed token-major:
  // q [tokens,Hq,D], k [tokens,Hk,D], v [tokens,Hk,Dv], gate [tokens,Hk]; out [tokens,Hq,Dv], lse [tokens,Hq].
  const std::vector<std::int32_t> slot{2, -1, 0}, query_start{0, 40, 43, 44};
  const std::int64_t tokens = query_start.back();
  const kvmem::Rows rows{TensorView<const std::int32_t, 1>(slot.data(), {3}),
                         TensorView<const std::int32_t, 1>(query_start.data(), {4})};
  const kvmem::host::Executor exec{.threads = 2, .exact = true};  // exact: a row equals its sequence alone, bitwise
  return kvmem::kvm::step(
      exec, state, weights, rows, TensorView<const float, 3>(q.data(), {tokens, Hq, D}),
      TensorView<const float, 3>(k.data(), {tokens, Hk, D}), TensorView<const float, 3>(v.data(), {tokens, Hk, Dv}),
      TensorView<const float, 2>(gate.data(), {tokens, Hk}), TensorView<float, 3>(out.data(), {tokens, Hq, Dv}),
      TensorView<float, 2>(lse.data(), {tokens, Hq}));
  // [snippet-end]
}

kvmem::Status ua_ragged_step(const std::vector<float>& q, const std::vector<float>& k, const std::vector<float>& v,
                             const std::vector<float>& z_k, const std::vector<float>& z_q, std::vector<float>& out,
                             std::vector<float>& lse, kvmem::ua::PrunedCache<float>& cache) {
  const std::int64_t H = kHq, G = kHk, D = kD;
  // [snippet:ua-step]
  // 16 slots, each holding up to 4096 kept rows per KV head; p = 0.05 evicts keys whose decay passed it.
  KVMEM_RETURN_IF_ERROR(kvmem::ua::PrunedCache<float>::create({/*max_slots*/ 16, H, G, D, /*capacity*/ 4096}, cache));
  const kvmem::ua::Options opt{/*p*/ 0.05, /*prefill_chunk*/ 128, /*evict_before_attention*/ true};
  // The rows of the KV Means example: a 40-token chunk for slot 2, padding, one token for slot 0.
  const std::vector<std::int32_t> slot{2, -1, 0}, query_start{0, 40, 43, 44};
  const std::int64_t tokens = query_start.back();
  const kvmem::Rows rows{TensorView<const std::int32_t, 1>(slot.data(), {3}),
                         TensorView<const std::int32_t, 1>(query_start.data(), {4})};
  // q [tokens,H,D]; k, v [tokens,G,D] (unit-norm keys); gate logits z_k, z_q [tokens,G]; no output gate.
  const kvmem::ua::PackedInputs in{
      TensorView<const float, 3>(q.data(), {tokens, H, D}), TensorView<const float, 3>(k.data(), {tokens, G, D}),
      TensorView<const float, 3>(v.data(), {tokens, G, D}), TensorView<const float, 2>(z_k.data(), {tokens, G}),
      TensorView<const float, 2>(z_q.data(), {tokens, G}),  {}};
  return kvmem::ua::step(kvmem::host::Executor{}, cache, rows, in, opt,
                         TensorView<float, 3>(out.data(), {tokens, H, D}),
                         TensorView<float, 2>(lse.data(), {tokens, H}));
  // [snippet-end]
}

}  // namespace

int main() {
  const std::int64_t T = 44, Hq = kHq, Hk = kHk, D = kD;
  std::vector<float> q(T * Hq * D), k(T * Hk * D), v(T * Hk * D), gate(T * Hk), out(T * Hq * D, -1.f),
      lse(T * Hq, -1.f);
  fill(q, 0.31f);
  fill(k, 0.017f);
  fill(v, 0.23f);
  for (std::size_t i = 0; i < gate.size(); ++i) gate[i] = 1.0f + 0.5f * std::sin(0.7f * float(i));
  const std::vector<float> ones(D, 1.f), zeros(D, 0.f), taus(Hq, 1.f);
  const kvmem::kvm::Weights weights{
      TensorView<const float, 1>(ones.data(), {D}), TensorView<const float, 1>(zeros.data(), {D}),
      TensorView<const float, 1>(taus.data(), {Hq}), TensorView<const float, 1>(taus.data(), {Hq})};
  kvmem::kvm::Params params;
  params.chunk = 16;
  params.rope_dims = 0;
  params.budget = kvmem::budget::Fixed{32, 32};

  kvmem::kvm::State<float> state;
  SNIPPET_CHECK_OK(kvm_ragged_step(weights, params, q, k, v, gate, out, lse, state));
  SNIPPET_CHECK(state.tokens(2) == 40 && state.tokens(0) == 1 && state.tokens(1) == 0);
  for (std::int64_t i = 40 * Hq * D; i < 43 * Hq * D; ++i) SNIPPET_CHECK(out[std::size_t(i)] == 0.0f);  // padding

  // Slot 2's row equals a prefill of those 40 tokens alone ([1,H,T,*] layout), bit for bit.
  std::vector<float> q1(40 * Hq * D), k1(40 * Hk * D), v1(40 * Hk * D), g1(40 * Hk), o1(40 * Hq * D);
  for (std::int64_t t = 0; t < 40; ++t) {
    for (std::int64_t h = 0; h < Hq; ++h)
      for (std::int64_t d = 0; d < D; ++d) q1[std::size_t((h * 40 + t) * D + d)] = q[std::size_t((t * Hq + h) * D + d)];
    for (std::int64_t d = 0; d < D; ++d) {
      k1[std::size_t(t * D + d)] = k[std::size_t(t * D + d)];
      v1[std::size_t(t * D + d)] = v[std::size_t(t * D + d)];
    }
    g1[std::size_t(t)] = gate[std::size_t(t)];
  }
  kvmem::kvm::State<float> alone;
  SNIPPET_CHECK_OK(kvmem::kvm::State<float>::create(params, {1, Hq, Hk, D, D, 4096}, alone));
  SNIPPET_CHECK_OK(kvmem::kvm::prefill(
      kvmem::host::Executor{.threads = 1, .exact = true}, alone, weights,
      TensorView<const float, 4>(q1.data(), {1, Hq, 40, D}), TensorView<const float, 4>(k1.data(), {1, Hk, 40, D}),
      TensorView<const float, 4>(v1.data(), {1, Hk, 40, D}), TensorView<const float, 3>(g1.data(), {1, Hk, 40}),
      TensorView<float, 4>(o1.data(), {1, 40, Hq, D})));
  for (std::size_t i = 0; i < o1.size(); ++i) SNIPPET_CHECK(o1[i] == out[i]);

  // UA: unit-norm keys, then the same rows.
  for (std::int64_t r = 0; r < T * Hk; ++r) {
    float n2 = 0.f;
    for (std::int64_t d = 0; d < D; ++d) n2 += k[std::size_t(r * D + d)] * k[std::size_t(r * D + d)];
    for (std::int64_t d = 0; d < D; ++d) k[std::size_t(r * D + d)] /= std::sqrt(n2);
  }
  std::vector<float> z_k(T * Hk), z_q(T * Hk);
  fill(z_k, 0.05f);
  fill(z_q, 0.07f);
  kvmem::ua::PrunedCache<float> cache;
  SNIPPET_CHECK_OK(ua_ragged_step(q, k, v, z_k, z_q, out, lse, cache));
  SNIPPET_CHECK(cache.position(2) == 40 && cache.position(0) == 1 && cache.position(1) == 0);
  SNIPPET_CHECK(cache.length(2, 0) >= 1 && cache.length(2, 0) <= 40);
  for (std::int64_t i = 40 * Hq * D; i < 43 * Hq * D; ++i) SNIPPET_CHECK(out[std::size_t(i)] == 0.0f);
  for (std::int64_t i = 40 * Hq; i < 43 * Hq; ++i) SNIPPET_CHECK(lse[std::size_t(i)] == 0.0f);
  return 0;
}
