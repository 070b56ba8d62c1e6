// SPDX-License-Identifier: Apache-2.0
// Documentation snippet (docs/integration.md): a KV Means layer behind the sequence-memory calls of a
// llama.cpp-style engine (llama_memory_i: seq_rm, seq_cp, state_write, state_read), sequence ids
// being kvmem slots. main() checks that a copied sequence continues bit for bit like its source, that
// a written and read state continues like the original, that removing a tail is exact where kvmem
// allows it and refused (nothing changed) where a state update absorbed those tokens.

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "check.hpp"
#include "kvmem/kvmem.hpp"

namespace {

using kvmem::TensorView;
constexpr std::int64_t kHq = 2, kHk = 1, kD = 16;

// [snippet:llama-memory]
// One KV Means layer's memory; llama.cpp's sequence ids are kvmem slots (0 <= seq < max_slots).
struct KvmLayerMemory {
  kvmem::kvm::State<float> state;
  kvmem::kvm::Weights weights;  // the layer's LN_s affine and temperatures
  kvmem::host::Executor exec;

  static TensorView<const std::int32_t, 1> one(const std::int32_t& seq) { return {&seq, {1}}; }

  // seq_rm(seq, p0, -1): remove positions [p0, end). p0 <= 0 forgets the sequence; a later p0 drops the
  // tail when that is exact (kvm::truncate) and is refused with the reason otherwise.
  kvmem::Status seq_rm(std::int32_t seq, std::int64_t p0) {
    if (p0 <= 0) return kvmem::kvm::reset_slots(exec, state, one(seq));
    return kvmem::kvm::truncate(exec, state, seq, state.tokens(seq) - p0);
  }
  // seq_cp(src, dst): dst becomes a fork of src (shared prompt, beam search, n > 1 sampling).
  kvmem::Status seq_cp(std::int32_t src, std::int32_t dst) {
    return kvmem::kvm::copy_slots(exec, state, one(src), one(dst));
  }
  // state_write / state_read of one sequence: kvmem's versioned slot record.
  kvmem::Status state_write(std::int32_t seq, std::vector<std::byte>& out) const {
    out.resize(kvmem::kvm::export_bytes(state, seq));
    return kvmem::kvm::export_slot(exec, state, seq, out);
  }
  kvmem::Status state_read(std::int32_t seq, std::span<const std::byte> in) {
    return kvmem::kvm::import_slot(exec, state, weights, seq, in);
  }
};
// [snippet-end]

struct Tokens {
  std::vector<float> q, k, v, gate;
  explicit Tokens(std::int64_t n, float f)
      : q(std::size_t(n * kHq * kD)), k(std::size_t(n * kHk * kD)), v(k.size()), gate(std::size_t(n * kHk)) {
    for (std::size_t i = 0; i < q.size(); ++i) q[i] = std::sin(f * float(i) + 0.1f);
    for (std::size_t i = 0; i < k.size(); ++i) k[i] = std::cos(f * float(i) + 0.7f * float(i % 3));
    for (std::size_t i = 0; i < v.size(); ++i) v[i] = std::sin(0.37f * f * float(i) + 1.0f);
    for (std::size_t i = 0; i < gate.size(); ++i) gate[i] = 1.0f + 0.5f * std::sin(float(i));
  }
};

// One step: the same `n` tokens for every slot in `slots`; returns out [slots * n, Hq, D].
std::vector<float> step(KvmLayerMemory& m, const std::vector<std::int32_t>& slots, const Tokens& x, std::int64_t n) {
  const auto R = static_cast<std::int64_t>(slots.size()), N = R * n;
  std::vector<std::int32_t> qs{0};
  std::vector<float> q, k, v, g;
  for (std::int64_t r = 0; r < R; ++r) {
    qs.push_back(static_cast<std::int32_t>((r + 1) * n));
    q.insert(q.end(), x.q.begin(), x.q.begin() + n * kHq * kD);
    k.insert(k.end(), x.k.begin(), x.k.begin() + n * kHk * kD);
    v.insert(v.end(), x.v.begin(), x.v.begin() + n * kHk * kD);
    g.insert(g.end(), x.gate.begin(), x.gate.begin() + n * kHk);
  }
  std::vector<float> out(std::size_t(N * kHq * kD));
  const kvmem::Rows rows{TensorView<const std::int32_t, 1>(slots.data(), {R}),
                         TensorView<const std::int32_t, 1>(qs.data(), {R + 1})};
  SNIPPET_CHECK_OK(kvmem::kvm::step(
      m.exec, m.state, m.weights, rows, TensorView<const float, 3>(q.data(), {N, kHq, kD}),
      TensorView<const float, 3>(k.data(), {N, kHk, kD}), TensorView<const float, 3>(v.data(), {N, kHk, kD}),
      TensorView<const float, 2>(g.data(), {N, kHk}), TensorView<float, 3>(out.data(), {N, kHq, kD})));
  return out;
}

}  // namespace

int main() {
  const std::vector<float> ln_w(kD, 1.0f), ln_b(kD, 0.0f), tau(kHq, 1.0f);
  kvmem::kvm::Params p;
  p.chunk = 8;
  p.window_chunks = 2;
  p.rope_dims = 8;
  p.budget = kvmem::budget::Fixed{12};
  KvmLayerMemory m;
  m.weights = {TensorView<const float, 1>(ln_w.data(), {kD}), TensorView<const float, 1>(ln_b.data(), {kD}),
               TensorView<const float, 1>(tau.data(), {kHq}), TensorView<const float, 1>(tau.data(), {kHq})};
  m.exec = kvmem::host::Executor{.threads = 1, .exact = true};
  SNIPPET_CHECK_OK(kvmem::kvm::State<float>::create(p, {4, kHq, kHk, kD, kD, 128}, m.state));

  // A 20-token prompt in sequence 0, forked into sequence 1: both continue alike.
  step(m, {0}, Tokens(20, 0.3f), 20);
  SNIPPET_CHECK_OK(m.seq_cp(0, 1));
  const std::vector<float> both = step(m, {0, 1}, Tokens(1, 0.9f), 1);
  SNIPPET_CHECK(std::equal(both.begin(), both.begin() + kHq * kD, both.begin() + kHq * kD));

  // state_write of sequence 0, state_read into sequence 2: the copy continues like the original.
  std::vector<std::byte> record;
  SNIPPET_CHECK_OK(m.state_write(0, record));
  SNIPPET_CHECK_OK(m.state_read(2, record));
  SNIPPET_CHECK(m.state.tokens(2) == 21);
  const std::vector<float> pair = step(m, {0, 2}, Tokens(1, 1.7f), 1);
  SNIPPET_CHECK(std::equal(pair.begin(), pair.begin() + kHq * kD, pair.begin() + kHq * kD));

  // Sequence 1 (21 tokens, no state update yet): dropping its last 3 tokens is exact.
  SNIPPET_CHECK_OK(m.seq_rm(1, 18));
  SNIPPET_CHECK(m.state.tokens(1) == 18);
  // Sequence 0 grows past the first update (token 25 absorbs tokens [8, 16)): dropping back to 10 tokens
  // is refused and leaves it as it was; forgetting it entirely is always possible.
  step(m, {0}, Tokens(10, 2.1f), 10);
  const kvmem::Status refused = m.seq_rm(0, 10);
  SNIPPET_CHECK(refused.code() == kvmem::StatusCode::kInvalidArgument && m.state.tokens(0) == 32);
  SNIPPET_CHECK_OK(m.seq_rm(0, 0));
  SNIPPET_CHECK(m.state.tokens(0) == 0);
  return 0;
}
