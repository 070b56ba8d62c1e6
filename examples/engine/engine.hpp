// SPDX-License-Identifier: Apache-2.0
#pragma once
// A continuous-batching engine over the decoder of model.hpp, a template over the attention
// mechanism (attention.hpp). Requests arrive at given steps with a prompt and a number of tokens to
// generate; each step the engine
//   1. admits waiting requests into free sequence slots (reset_slots on every layer),
//   2. builds one ragged batch: a prefill chunk (at most prefill_chunk prompt tokens) of each request
//      still reading its prompt, one decode token of each generating request, and padding rows up to a
//      multiple of row_bucket (a graph-capturing engine pads its batch to fixed sizes the same way),
//   3. runs the model on the packed tokens, every layer's attention in one slot step,
//   4. samples greedily for rows that ended their prompt or decoded a token, and retires requests that
//      have generated all their tokens, freeing their slots for the next step.
// Everything a caller may compare (generated tokens, the logits behind them) is kept per request.

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <vector>

#include "attention.hpp"
#include "model.hpp"

namespace engine {

struct Request {
  std::int64_t arrival = 0;  // first step at which it may be admitted
  std::vector<std::int32_t> prompt;
  std::int64_t max_new = 1;  // tokens to generate (>= 1)
};

struct RequestResult {
  std::vector<std::int32_t> tokens;  // [max_new] generated tokens
  std::vector<float> logits;         // [max_new, vocab]: the logits each token was sampled from
  std::int64_t admitted = -1, finished = -1;
};

struct StepStats {
  std::int64_t step = 0, live = 0, rows = 0, tokens = 0, prefill_tokens = 0, decode_tokens = 0;
  std::size_t allocated_bytes = 0, live_bytes = 0;  // caches of all layers
  double seconds = 0;
};

struct EngineOptions {
  std::int64_t prefill_chunk = 64;  // prompt tokens of one request per step
  std::int64_t row_bucket = 4;      // rows are padded to a multiple of this with padding rows
  std::int64_t max_steps = 1 << 20;
};

template <class Mechanism>
class Engine {
 public:
  Engine(const Model& model, const CacheConfig& cache, const EngineOptions& opt, kvmem::host::Executor exec)
      : model_(model), cache_(cache), opt_(opt), exec_(std::move(exec)) {
    for (std::int64_t l = 0; l < model.cfg.layers; ++l) attn_.emplace_back(model.cfg, cache);
  }

  // Serves every request; calls on_step after each step. Results are in request order.
  std::vector<RequestResult> run(const std::vector<Request>& requests,
                                 const std::function<void(const StepStats&)>& on_step = {}) {
    std::vector<RequestResult> results(requests.size());
    std::vector<std::optional<Live>> slots(static_cast<std::size_t>(cache_.max_slots));
    std::size_t next = 0, done = 0;
    for (std::int64_t step = 0; done < requests.size() && step < opt_.max_steps; ++step) {
      const auto t0 = std::chrono::steady_clock::now();
      // 1. admission, in arrival order, into free slots
      std::vector<std::int32_t> admitted;
      for (std::size_t s = 0; s < slots.size() && next < requests.size(); ++s)
        if (!slots[s] && requests[next].arrival <= step) {
          slots[s] = Live{next, 0};
          results[next].admitted = step;
          admitted.push_back(static_cast<std::int32_t>(s));
          ++next;
        }
      if (!admitted.empty())
        for (auto& a : attn_) a.reset(admitted);
      // 2. the ragged batch
      Batch batch;
      StepStats st;
      st.step = step;
      for (std::size_t s = 0; s < slots.size(); ++s) {
        if (!slots[s]) continue;
        Live& live = *slots[s];
        const Request& rq = requests[live.request];
        const RequestResult& res = results[live.request];
        const auto prompt_len = static_cast<std::int64_t>(rq.prompt.size());
        std::int64_t n = 0;
        if (live.fed < prompt_len) {
          n = std::min(opt_.prefill_chunk, prompt_len - live.fed);
          for (std::int64_t i = 0; i < n; ++i) {
            batch.token.push_back(rq.prompt[static_cast<std::size_t>(live.fed + i)]);
            batch.pos.push_back(live.fed + i);
          }
          st.prefill_tokens += n;
        } else {
          n = 1;
          batch.token.push_back(res.tokens.back());
          batch.pos.push_back(live.fed);
          st.decode_tokens += 1;
        }
        batch.slot.push_back(static_cast<std::int32_t>(s));
        batch.query_start.push_back(batch.query_start.back() + static_cast<std::int32_t>(n));
        // a row samples when it reaches the end of the prompt or decodes
        batch.samples.push_back(live.fed + n >= prompt_len);
        live.fed += n;
      }
      st.live = static_cast<std::int64_t>(batch.slot.size());
      while (batch.slot.size() % static_cast<std::size_t>(opt_.row_bucket) != 0 || batch.slot.empty()) {
        batch.slot.push_back(-1);  // padding row: no tokens, skipped by the mechanism
        batch.query_start.push_back(batch.query_start.back());
        batch.samples.push_back(false);
      }
      st.rows = static_cast<std::int64_t>(batch.slot.size());
      st.tokens = static_cast<std::int64_t>(batch.token.size());
      // 3. the model, 4. sampling and retirement
      std::vector<std::int64_t> last;  // the token whose logits each sampling row needs
      for (std::size_t r = 0; r < batch.slot.size(); ++r)
        if (batch.samples[r]) last.push_back(batch.query_start[r + 1] - 1);
      if (st.tokens > 0) forward(batch, last);
      for (std::size_t r = 0, i = 0; r < batch.slot.size(); ++r) {
        if (!batch.samples[r]) continue;
        const auto s = static_cast<std::size_t>(batch.slot[r]);
        RequestResult& res = results[slots[s]->request];
        const float* logits = logits_.data() + (i++) * vocab();
        res.logits.insert(res.logits.end(), logits, logits + vocab());
        res.tokens.push_back(static_cast<std::int32_t>(std::max_element(logits, logits + vocab()) - logits));
        if (static_cast<std::int64_t>(res.tokens.size()) >= requests[slots[s]->request].max_new) {
          res.finished = step;
          const std::int32_t freed = batch.slot[r];
          for (auto& a : attn_) a.reset({&freed, 1});
          slots[s].reset();
          ++done;
        }
      }
      for (const auto& a : attn_) {
        st.allocated_bytes += a.allocated_bytes();
        st.live_bytes += a.live_bytes();
      }
      st.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      if (on_step) on_step(st);
    }
    return results;
  }

 private:
  struct Live {
    std::size_t request;
    std::int64_t fed;  // tokens given to the model so far = the next token's position
  };
  struct Batch {
    std::vector<std::int32_t> slot, query_start{0}, token;
    std::vector<std::int64_t> pos;
    std::vector<bool> samples;
  };

  [[nodiscard]] std::size_t vocab() const { return static_cast<std::size_t>(model_.cfg.vocab); }

  // The decoder over the packed tokens of one step; leaves logits_ [last.size(), vocab], the logits of
  // the tokens listed in `last` (the output projection runs for those only).
  void forward(const Batch& batch, const std::vector<std::int64_t>& last) {
    const ModelConfig& c = model_.cfg;
    const std::int64_t N = static_cast<std::int64_t>(batch.token.size()), dm = c.d_model();
    const std::int64_t Hq = c.q_heads, Hk = c.kv_heads, D = c.head_dim;
    auto sized = [](std::vector<float>& v, std::int64_t n) { v.resize(static_cast<std::size_t>(n)); };
    sized(x_, N * dm), sized(h_, N * dm), sized(q_, N * Hq * D), sized(k_, N * Hk * D), sized(v_, N * Hk * D);
    sized(gk_, N * Hk), sized(gq_, N * Hk), sized(o_, N * Hq * D), sized(a_, N * c.mlp), sized(b_, N * c.mlp);
    const auto S = static_cast<std::int64_t>(last.size());
    sized(y_, N * dm), sized(logits_, S * c.vocab);
    for (std::int64_t t = 0; t < N; ++t)
      std::copy_n(model_.embed.begin() + batch.token[static_cast<std::size_t>(t)] * dm, dm, x_.begin() + t * dm);
    const AttnStep step{batch.slot, batch.query_start, q_.data(), k_.data(), v_.data(), gk_.data(), gq_.data(), N};
    for (std::int64_t l = 0; l < c.layers; ++l) {
      const LayerWeights& w = model_.layers[static_cast<std::size_t>(l)];
      rms_norm(x_.data(), N, dm, w.attn_norm, c.norm_eps, h_.data());
      linear(exec_, h_.data(), N, dm, w.wq, Hq * D, q_.data());
      linear(exec_, h_.data(), N, dm, w.wk, Hk * D, k_.data());
      linear(exec_, h_.data(), N, dm, w.wv, Hk * D, v_.data());
      linear(exec_, h_.data(), N, dm, w.wgk, Hk, gk_.data());
      linear(exec_, h_.data(), N, dm, w.wgq, Hk, gq_.data());
      if constexpr (Mechanism::kUnitKeys) unit_keys(k_.data(), N * Hk, D);
      rope(q_.data(), N, Hq, D, c.rope_dims, c.rope_theta, batch.pos);
      rope(k_.data(), N, Hk, D, c.rope_dims, c.rope_theta, batch.pos);
      attn_[static_cast<std::size_t>(l)].step(exec_, step, o_.data());
      linear(exec_, o_.data(), N, Hq * D, w.wo, dm, y_.data());
      for (std::int64_t i = 0; i < N * dm; ++i) x_[static_cast<std::size_t>(i)] += y_[static_cast<std::size_t>(i)];
      rms_norm(x_.data(), N, dm, w.mlp_norm, c.norm_eps, h_.data());
      linear(exec_, h_.data(), N, dm, w.w_gate, c.mlp, a_.data());
      linear(exec_, h_.data(), N, dm, w.w_up, c.mlp, b_.data());
      for (std::size_t i = 0; i < a_.size(); ++i) a_[i] = silu(a_[i]) * b_[i];
      linear(exec_, a_.data(), N, c.mlp, w.w_down, dm, y_.data());
      for (std::int64_t i = 0; i < N * dm; ++i) x_[static_cast<std::size_t>(i)] += y_[static_cast<std::size_t>(i)];
    }
    for (std::int64_t i = 0; i < S; ++i)
      std::copy_n(x_.begin() + last[static_cast<std::size_t>(i)] * dm, dm, y_.begin() + i * dm);
    rms_norm(y_.data(), S, dm, model_.final_norm, c.norm_eps, h_.data());
    linear(exec_, h_.data(), S, dm, model_.embed, c.vocab, logits_.data());
  }

  const Model& model_;
  CacheConfig cache_;
  EngineOptions opt_;
  kvmem::host::Executor exec_;
  std::vector<Mechanism> attn_;  // one per layer
  std::vector<float> x_, h_, q_, k_, v_, gk_, gq_, o_, a_, b_, y_, logits_;
};

}  // namespace engine
