// SPDX-License-Identifier: Apache-2.0
#pragma once
// The attention of one decoder layer, behind one small interface so that the engine is a template over
// the mechanism: KV Means (kvmem::kvm, budget chosen by a template argument), Universal Attention
// (kvmem::ua, pruning threshold chosen by a template argument) and a dense KV cache as the baseline.
// Each holds `max_slots` sequence slots; a step takes the rows of a continuous batch (slot[r], -1 for
// padding, and query_start[r]) and packed token-major q, k, v, exactly kvmem's slot step.

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <string>
#include <vector>

#include "kvmem/backend/host/kvm.hpp"
#include "kvmem/backend/host/ua.hpp"
#include "kvmem/kvm/attention.hpp"
#include "kvmem/ua/cache.hpp"
#include "kvmem/ua/ops.hpp"
#include "kvmem/ua/slots.hpp"
#include "model.hpp"

namespace engine {

using kvmem::TensorView;

// What a layer hands its attention in one step.
struct AttnStep {
  std::span<const std::int32_t> slot;         // [rows]: slot, -1 = padding row
  std::span<const std::int32_t> query_start;  // [rows + 1]
  const float* q;                             // [tokens, Hq, D] post-RoPE
  const float* k;                             // [tokens, Hk, D] post-RoPE (unit-norm first when kUnitKeys)
  const float* v;                             // [tokens, Hk, D]
  const float* gate_k;                        // [tokens, Hk] logits: KVM merge gate, UA key gate
  const float* gate_q;                        // [tokens, Hk] logits: UA query-side gate
  std::int64_t tokens;
};

// Sizes every mechanism is built from.
struct CacheConfig {
  std::int64_t max_slots = 8;
  std::int64_t n_ctx = 4096;           // longest sequence a slot holds
  std::int64_t kvm_chunk = 64;         // KVM C
  std::int64_t kvm_window_chunks = 2;  // KVM nb: the window is nb*C exact keys
  std::int64_t ua_prefill_chunk = 128;
};

inline kvmem::Rows rows_of(const AttnStep& s) {
  return {TensorView<const std::int32_t, 1>(s.slot.data(), {static_cast<std::int64_t>(s.slot.size())}),
          TensorView<const std::int32_t, 1>(s.query_start.data(), {static_cast<std::int64_t>(s.query_start.size())})};
}

// KV Means with the budget policy `Budget` (kvmem::budget::Fixed{256}, Power{16.0, 0.5, 256}, ...).
template <auto Budget>
class KvmAttention {
 public:
  using Variant = kvmem::kvm::Attention<Budget>;
  static constexpr bool kUnitKeys = false;

  KvmAttention(const ModelConfig& m, const CacheConfig& c) {
    kvmem::kvm::Params p = Variant().params;
    p.chunk = c.kvm_chunk;
    p.window_chunks = c.kvm_window_chunks;
    p.rope_dims = m.rope_dims;  // the rotated channels are zeroed before LN_s (spec KVM.md 4.2)
    variant_ = Variant(p);
    const kvmem::kvm::Shape shape{c.max_slots, m.q_heads, m.kv_heads, m.head_dim, m.head_dim, c.n_ctx};
    kvmem::throw_if_error(variant_.make_state(shape, state_));
    // Identity LN_s affine and unit temperatures: with them a sequence that fits in the window is
    // attended exactly like a dense cache (spec KVM.md 4.8), which the engine's check relies on.
    ln_w_.assign(static_cast<std::size_t>(m.head_dim), 1.0f);
    ln_b_.assign(static_cast<std::size_t>(m.head_dim), 0.0f);
    tau_.assign(static_cast<std::size_t>(m.q_heads), 1.0f);
  }
  static std::string name() {
    const auto b = Variant::kBudget;
    if constexpr (requires { b.count; })
      return "kvm fixed-" + std::to_string(b.count);
    else if constexpr (requires { b.factor; })
      return "kvm " + std::to_string(static_cast<int>(b.factor)) + "*N^" + std::to_string(b.exponent).substr(0, 4);
    else
      return "kvm";
  }

  void reset(std::span<const std::int32_t> slots) {
    kvmem::throw_if_error(kvmem::kvm::reset_slots(
        kvmem::host::Executor{}, state_,
        TensorView<const std::int32_t, 1>(slots.data(), {static_cast<std::int64_t>(slots.size())})));
  }

  void step(const kvmem::host::Executor& exec, const AttnStep& s, float* out) {
    const auto& sh = state_.shape();
    gate_.resize(static_cast<std::size_t>(s.tokens * sh.Hk));
    for (std::size_t i = 0; i < gate_.size(); ++i) gate_[i] = 1.0f / (1.0f + std::exp(-s.gate_k[i]));  // g > 0
    const kvmem::kvm::Weights w{view(ln_w_), view(ln_b_), view(tau_), view(tau_)};
    kvmem::throw_if_error(kvmem::kvm::step(exec, state_, w, rows_of(s),
                                           TensorView<const float, 3>(s.q, {s.tokens, sh.Hq, sh.D}),
                                           TensorView<const float, 3>(s.k, {s.tokens, sh.Hk, sh.D}),
                                           TensorView<const float, 3>(s.v, {s.tokens, sh.Hk, sh.Dv}),
                                           TensorView<const float, 2>(gate_.data(), {s.tokens, sh.Hk}),
                                           TensorView<float, 3>(out, {s.tokens, sh.Hq, sh.Dv})));
  }

  [[nodiscard]] std::size_t allocated_bytes() const { return state_.allocated_bytes(); }
  [[nodiscard]] std::size_t live_bytes() const {
    std::size_t sum = 0;
    for (std::int64_t b = 0; b < state_.max_slots(); ++b) sum += state_.cache_bytes(b);
    return sum;
  }
  [[nodiscard]] const kvmem::kvm::State<float>& state() const { return state_; }

 private:
  static TensorView<const float, 1> view(const std::vector<float>& v) {
    return TensorView<const float, 1>(v.data(), {static_cast<std::int64_t>(v.size())});
  }
  Variant variant_;
  kvmem::kvm::State<float> state_;
  std::vector<float> ln_w_, ln_b_, tau_, gate_;
};

// Universal Attention with the pruning policy `Prune` (kvmem::prune::Threshold{0.05}, prune::None{}).
// Its slots are sized for the worst case (n_ctx rows per KV head); the live bytes show what pruning keeps.
template <auto Prune>
class UaAttention {
 public:
  using Variant = kvmem::ua::Attention<kvmem::decay::Universal, Prune>;
  static constexpr bool kUnitKeys = true;  // spec UA.md 2: k / (‖k‖ + 1e-6), then RoPE

  UaAttention(const ModelConfig& m, const CacheConfig& c) : chunk_(c.ua_prefill_chunk) {
    kvmem::throw_if_error(Variant::Cache::create({c.max_slots, m.q_heads, m.kv_heads, m.head_dim, c.n_ctx}, cache_));
  }
  static std::string name() { return "ua p=" + std::to_string(Variant::threshold()).substr(0, 4); }

  void reset(std::span<const std::int32_t> slots) {
    kvmem::throw_if_error(kvmem::ua::reset_slots(
        kvmem::host::Executor{}, cache_,
        TensorView<const std::int32_t, 1>(slots.data(), {static_cast<std::int64_t>(slots.size())})));
  }

  void step(const kvmem::host::Executor& exec, const AttnStep& s, float* out) {
    const auto& sh = cache_.shape();
    const std::int64_t N = s.tokens, H = sh.query_heads, G = sh.kv_heads, D = sh.head_dim;
    const kvmem::ua::PackedInputs in{
        TensorView<const float, 3>(s.q, {N, H, D}),   TensorView<const float, 3>(s.k, {N, G, D}),
        TensorView<const float, 3>(s.v, {N, G, D}),   TensorView<const float, 2>(s.gate_k, {N, G}),
        TensorView<const float, 2>(s.gate_q, {N, G}), {}};
    kvmem::throw_if_error(
        Variant::step(exec, cache_, rows_of(s), in, TensorView<float, 3>(out, {N, H, D}), {}, chunk_));
  }

  [[nodiscard]] std::size_t allocated_bytes() const {
    const auto& sh = cache_.shape();
    const auto rows = static_cast<std::size_t>(sh.batch * sh.kv_heads * sh.capacity);
    return rows * (2 * static_cast<std::size_t>(sh.head_dim) * sizeof(float) + 16);  // k, v, λ, z_k, pos
  }
  [[nodiscard]] std::size_t live_bytes() const {
    std::size_t sum = 0;
    for (const auto& r : kvmem::ua::report(cache_)) sum += static_cast<std::size_t>(r.kv_bytes + r.scalar_bytes);
    return sum;
  }

 private:
  typename Variant::Cache cache_;
  std::int64_t chunk_;
};

// The baseline: every key and value of every slot, softmax(q·k/√D) over positions [0, t]. Written
// here, independently of kvmem, so the engine can check KVM against it.
class DenseAttention {
 public:
  static constexpr bool kUnitKeys = false;

  DenseAttention(const ModelConfig& m, const CacheConfig& c)
      : Hq_(m.q_heads),
        Hk_(m.kv_heads),
        D_(m.head_dim),
        n_ctx_(c.n_ctx),
        k_(static_cast<std::size_t>(c.max_slots * Hk_ * n_ctx_ * D_)),
        v_(k_.size()),
        len_(static_cast<std::size_t>(c.max_slots), 0) {}
  static std::string name() { return "dense"; }

  void reset(std::span<const std::int32_t> slots) {
    for (const std::int32_t s : slots) len_.at(static_cast<std::size_t>(s)) = 0;
  }

  void step(const kvmem::host::Executor& exec, const AttnStep& s, float* out) {
    const auto rows = static_cast<std::int64_t>(s.slot.size());
    for (std::int64_t r = 0; r < rows; ++r) {  // append first: a token attends to itself
      const std::int32_t b = s.slot[static_cast<std::size_t>(r)];
      if (b < 0) continue;
      const std::int64_t x0 = s.query_start[static_cast<std::size_t>(r)],
                         x1 = s.query_start[static_cast<std::size_t>(r + 1)];
      if (len_[static_cast<std::size_t>(b)] + (x1 - x0) > n_ctx_)
        throw kvmem::Error({kvmem::StatusCode::kOutOfRange, "dense cache full"});
      for (std::int64_t x = x0; x < x1; ++x)
        for (std::int64_t g = 0; g < Hk_; ++g) {
          const std::int64_t at = pos(b, g, len_[static_cast<std::size_t>(b)] + x - x0);
          std::copy_n(s.k + (x * Hk_ + g) * D_, D_, k_.begin() + at);
          std::copy_n(s.v + (x * Hk_ + g) * D_, D_, v_.begin() + at);
        }
    }
    const std::int64_t rep = Hq_ / Hk_;
    kvmem::host::parallel_for(exec, rows * Hq_, [&](std::int64_t item) {
      const std::int64_t r = item / Hq_, h = item % Hq_, g = h / rep;
      const std::int32_t b = s.slot[static_cast<std::size_t>(r)];
      const std::int64_t x0 = s.query_start[static_cast<std::size_t>(r)],
                         x1 = s.query_start[static_cast<std::size_t>(r + 1)];
      std::vector<float> logit;
      for (std::int64_t x = x0; x < x1; ++x) {
        float* o = out + (x * Hq_ + h) * D_;
        std::fill_n(o, D_, 0.0f);
        if (b < 0) continue;
        const std::int64_t t = len_[static_cast<std::size_t>(b)] + x - x0;  // the query's position
        const float* q = s.q + (x * Hq_ + h) * D_;
        logit.assign(static_cast<std::size_t>(t + 1), 0.0f);
        float mx = -std::numeric_limits<float>::infinity();
        for (std::int64_t j = 0; j <= t; ++j) {
          const float* kj = k_.data() + pos(b, g, j);
          float dot = 0.0f;
          for (std::int64_t d = 0; d < D_; ++d) dot += q[d] * kj[d];
          logit[static_cast<std::size_t>(j)] = dot / std::sqrt(static_cast<float>(D_));
          mx = std::max(mx, logit[static_cast<std::size_t>(j)]);
        }
        float sum = 0.0f;
        for (std::int64_t j = 0; j <= t; ++j) {
          const float p = std::exp(logit[static_cast<std::size_t>(j)] - mx);
          sum += p;
          const float* vj = v_.data() + pos(b, g, j);
          for (std::int64_t d = 0; d < D_; ++d) o[d] += p * vj[d];
        }
        for (std::int64_t d = 0; d < D_; ++d) o[d] /= sum;
      }
    });
    for (std::int64_t r = 0; r < rows; ++r) {
      const std::int32_t b = s.slot[static_cast<std::size_t>(r)];
      if (b >= 0)
        len_[static_cast<std::size_t>(b)] +=
            s.query_start[static_cast<std::size_t>(r + 1)] - s.query_start[static_cast<std::size_t>(r)];
    }
  }

  [[nodiscard]] std::size_t allocated_bytes() const { return (k_.size() + v_.size()) * sizeof(float); }
  [[nodiscard]] std::size_t live_bytes() const {
    std::size_t sum = 0;
    for (const std::int64_t n : len_) sum += static_cast<std::size_t>(n * Hk_ * D_ * 2) * sizeof(float);
    return sum;
  }

 private:
  [[nodiscard]] std::int64_t pos(std::int64_t b, std::int64_t g, std::int64_t t) const {
    return ((b * Hk_ + g) * n_ctx_ + t) * D_;
  }
  std::int64_t Hq_, Hk_, D_, n_ctx_;
  std::vector<float> k_, v_;       // [slots, Hk, n_ctx, D]
  std::vector<std::int64_t> len_;  // tokens held per slot
};

}  // namespace engine
