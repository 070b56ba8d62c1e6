// SPDX-License-Identifier: Apache-2.0
#pragma once
// Where the PyTorch ops keep a layer's kvmem state. This is the one place that decides it: every op
// reaches the state through kvm_state() / ua_cache() below and never sees how it is held.
//
// The state is a torch custom class (torch.classes.kvmem.State) holding a host kvm::State or
// ua::PrunedCache; Python holds it like any object and passes it to every op. The kvm_create / ua_create
// ops make one that owns its memory; kvm_place / ua_place make one placed over uint8 tensors the caller
// allocated from the published layout (kvm_layout / ua_layout), which the holder keeps alive.

#include <torch/custom_class.h>

#include <cstdint>
#include <string>
#include <utility>
#include <variant>

#include "kvmem/kvm/state.hpp"
#include "kvmem/ua/cache.hpp"

namespace kvmem::torch_ops {

using KvmState = kvm::State<float>;
using UaCache = ua::PrunedCache<float>;

struct StateHolder : torch::CustomClassHolder {
  std::variant<KvmState, UaCache> state;

  // The caller's tensors a placed state lives in (undefined for an owning state): held so that the
  // memory outlives the state whatever Python does with its own references.
  at::Tensor memory, workspace;

  explicit StateHolder(KvmState s) : state(std::move(s)) {}
  explicit StateHolder(UaCache c) : state(std::move(c)) {}
  StateHolder(KvmState s, at::Tensor mem, at::Tensor ws)
      : state(std::move(s)), memory(std::move(mem)), workspace(std::move(ws)) {}
  StateHolder(UaCache c, at::Tensor mem, at::Tensor ws)
      : state(std::move(c)), memory(std::move(mem)), workspace(std::move(ws)) {}

  [[nodiscard]] std::string mechanism() const { return std::holds_alternative<KvmState>(state) ? "kvm" : "ua"; }
  [[nodiscard]] std::int64_t max_slots() const {
    return std::visit([](const auto& s) { return s.max_slots(); }, state);
  }
  // Tokens the sequence in `slot` has seen (KVM n, UA position); 0 outside the state.
  [[nodiscard]] std::int64_t tokens(std::int64_t slot) const {
    if (const auto* k = std::get_if<KvmState>(&state)) return k->tokens(slot);
    return std::get<UaCache>(state).position(slot);
  }
};

using Holder = c10::intrusive_ptr<StateHolder>;

// The KVM state held by `h`; a torch error naming the op when it holds a UA cache.
inline KvmState& kvm_state(const Holder& h, const char* op) {
  TORCH_CHECK_VALUE(h, op, ": state is None");
  auto* s = std::get_if<KvmState>(&h->state);
  TORCH_CHECK_VALUE(s != nullptr, op, ": expected a KV Means state (kvm_create), got a ", h->mechanism(), " state");
  return *s;
}

inline UaCache& ua_cache(const Holder& h, const char* op) {
  TORCH_CHECK_VALUE(h, op, ": state is None");
  auto* c = std::get_if<UaCache>(&h->state);
  TORCH_CHECK_VALUE(c != nullptr, op, ": expected a Universal Attention cache (ua_create), got a ", h->mechanism(),
                    " state");
  return *c;
}

}  // namespace kvmem::torch_ops
