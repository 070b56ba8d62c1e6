// SPDX-License-Identifier: Apache-2.0
#pragma once
// The decoder of the engine example: a Llama-shaped transformer (pre-norm RMSNorm, grouped-query
// attention with rotary positions on the leading rope_dims channels, SwiGLU MLP, tied embedding) with
// random weights. Every function works on packed token-major activations [tokens, width], the layout
// kvmem's slot step takes, so one call serves prefill chunks and decode tokens of many sequences.
// Only the attention is kvmem's; everything here is the model around it.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <span>
#include <vector>

#include "kvmem/backend/host/executor.hpp"

namespace engine {

struct ModelConfig {
  std::int64_t vocab = 512;
  std::int64_t layers = 4;
  std::int64_t q_heads = 8;
  std::int64_t kv_heads = 2;
  std::int64_t head_dim = 64;
  std::int64_t rope_dims = 32;  // leading channels of each head that RoPE rotates (partial rotary)
  std::int64_t mlp = 1024;      // SwiGLU hidden width
  double rope_theta = 10000.0;
  float norm_eps = 1e-6f;
  std::uint64_t seed = 1;
  [[nodiscard]] std::int64_t d_model() const { return q_heads * head_dim; }
};

// Row-major weights: a projection from n_in to n_out features is [n_out, n_in].
struct LayerWeights {
  std::vector<float> attn_norm;             // [dm]
  std::vector<float> wq;                    // [Hq*D, dm]
  std::vector<float> wk;                    // [Hk*D, dm]
  std::vector<float> wv;                    // [Hk*D, dm]
  std::vector<float> wgk;                   // [Hk, dm]: KVM merge-gate logit, UA key-gate logit
  std::vector<float> wgq;                   // [Hk, dm]: UA query-side gate logit
  std::vector<float> wo;                    // [dm, Hq*D]
  std::vector<float> mlp_norm;              // [dm]
  std::vector<float> w_gate, w_up, w_down;  // [mlp, dm], [mlp, dm], [dm, mlp]
};

struct Model {
  ModelConfig cfg;
  std::vector<float> embed;       // [vocab, dm], also the output projection (tied)
  std::vector<float> final_norm;  // [dm]
  std::vector<LayerWeights> layers;

  // Weights ~ N(0, 1/fan_in), so activations keep unit scale through the layers; norms near 1.
  static Model random(const ModelConfig& cfg) {
    Model m;
    m.cfg = cfg;
    std::mt19937_64 rng(cfg.seed);
    const std::int64_t dm = cfg.d_model(), Hq = cfg.q_heads, Hk = cfg.kv_heads, D = cfg.head_dim;
    auto matrix = [&](std::int64_t out, std::int64_t in) {
      std::normal_distribution<float> n(0.0f, 1.0f / std::sqrt(static_cast<float>(in)));
      std::vector<float> w(static_cast<std::size_t>(out * in));
      for (float& x : w) x = n(rng);
      return w;
    };
    auto norm = [&](std::int64_t n) {
      std::uniform_real_distribution<float> u(0.8f, 1.2f);
      std::vector<float> w(static_cast<std::size_t>(n));
      for (float& x : w) x = u(rng);
      return w;
    };
    m.embed = matrix(cfg.vocab, dm);
    for (float& x : m.embed) x *= std::sqrt(static_cast<float>(dm));  // unit-scale embeddings
    m.final_norm = norm(dm);
    for (std::int64_t l = 0; l < cfg.layers; ++l) {
      LayerWeights w;
      w.attn_norm = norm(dm);
      w.wq = matrix(Hq * D, dm);
      w.wk = matrix(Hk * D, dm);
      w.wv = matrix(Hk * D, dm);
      w.wgk = matrix(Hk, dm);
      w.wgq = matrix(Hk, dm);
      w.wo = matrix(dm, Hq * D);
      w.mlp_norm = norm(dm);
      w.w_gate = matrix(cfg.mlp, dm);
      w.w_up = matrix(cfg.mlp, dm);
      w.w_down = matrix(dm, cfg.mlp);
      m.layers.push_back(std::move(w));
    }
    return m;
  }
};

// y [tokens, n_out] = x [tokens, n_in] · Wᵀ (W [n_out, n_in]); work split over output features, so a
// token's result does not depend on which other tokens share the call.
inline void linear(const kvmem::host::Executor& exec, const float* x, std::int64_t tokens, std::int64_t n_in,
                   const std::vector<float>& w, std::int64_t n_out, float* y) {
  constexpr std::int64_t kBlock = 16;
  kvmem::host::parallel_for(exec, (n_out + kBlock - 1) / kBlock, [&](std::int64_t blk) {
    const std::int64_t o1 = std::min(n_out, (blk + 1) * kBlock);
    for (std::int64_t t = 0; t < tokens; ++t)
      for (std::int64_t o = blk * kBlock; o < o1; ++o) {
        const float* wr = w.data() + o * n_in;
        const float* xr = x + t * n_in;
        float acc = 0.0f;
        for (std::int64_t i = 0; i < n_in; ++i) acc += wr[i] * xr[i];
        y[t * n_out + o] = acc;
      }
  });
}

// y = x / rms(x) ⊙ w, per token.
inline void rms_norm(const float* x, std::int64_t tokens, std::int64_t n, const std::vector<float>& w, float eps,
                     float* y) {
  for (std::int64_t t = 0; t < tokens; ++t) {
    float ss = 0.0f;
    for (std::int64_t i = 0; i < n; ++i) ss += x[t * n + i] * x[t * n + i];
    const float inv = 1.0f / std::sqrt(ss / static_cast<float>(n) + eps);
    for (std::int64_t i = 0; i < n; ++i) y[t * n + i] = x[t * n + i] * inv * w[static_cast<std::size_t>(i)];
  }
}

// Rotary positions on the first rope_dims channels of each head (pairs (i, i + rope_dims/2), the
// "rotate half" convention): x [tokens, heads, D], token t at position pos[t].
inline void rope(float* x, std::int64_t tokens, std::int64_t heads, std::int64_t D, std::int64_t rope_dims,
                 double theta, std::span<const std::int64_t> pos) {
  const std::int64_t half = rope_dims / 2;
  for (std::int64_t t = 0; t < tokens; ++t)
    for (std::int64_t i = 0; i < half; ++i) {
      const double angle =
          static_cast<double>(pos[static_cast<std::size_t>(t)]) * std::pow(theta, -2.0 * double(i) / double(rope_dims));
      const auto c = static_cast<float>(std::cos(angle)), s = static_cast<float>(std::sin(angle));
      for (std::int64_t h = 0; h < heads; ++h) {
        float* r = x + (t * heads + h) * D;
        const float a = r[i], b = r[i + half];
        r[i] = a * c - b * s;
        r[i + half] = a * s + b * c;
      }
    }
}

// k / (‖k‖₂ + 1e-6) per head: the key normalisation Universal Attention expects before RoPE.
inline void unit_keys(float* k, std::int64_t rows, std::int64_t D) {
  for (std::int64_t r = 0; r < rows; ++r) {
    float ss = 0.0f;
    for (std::int64_t d = 0; d < D; ++d) ss += k[r * D + d] * k[r * D + d];
    const float inv = 1.0f / (std::sqrt(ss) + 1e-6f);
    for (std::int64_t d = 0; d < D; ++d) k[r * D + d] *= inv;
  }
}

inline float silu(float x) {
  return x / (1.0f + std::exp(-x));
}

}  // namespace engine
