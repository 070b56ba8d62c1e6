// SPDX-License-Identifier: Apache-2.0
#pragma once
// Where the PyTorch ops keep a layer's kvmem state. This is the one place that decides it: every op
// reaches the state through the accessors below and never sees how it is held.
//
// The state is a torch custom class (torch.classes.kvmem.State); Python holds it like any object and
// passes it to every op. It holds one of
//   - a host kvm::State or ua::PrunedCache (a CPU state: the ops' CPU kernels run it), or
//   - a DeviceState: a state of a device backend (CUDA), defined in that backend's translation unit
//     (ops_cuda.cu), which this header and ops.cpp reach through virtual calls only, so that they
//     compile without that backend's headers.
// The kvm_create / ua_create ops make one that owns its memory (on the CPU, or on the device named by
// their `device` argument); kvm_place / ua_place make one placed over uint8 tensors the caller
// allocated from the published layout (kvm_layout / ua_layout), whose device decides the backend, and
// which the holder keeps alive.

#include <torch/custom_class.h>

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include "kvmem/kvm/state.hpp"
#include "kvmem/ua/cache.hpp"

namespace kvmem::torch_ops {

using KvmState = kvm::State<float>;
using UaCache = ua::PrunedCache<float>;

// A state of a device backend. The ops without tensor arguments (export_slot, truncate, step_status,
// the State methods) run for every state in ops.cpp and reach a device state through these calls;
// the backend's own kernels (TORCH_LIBRARY_IMPL for its dispatch key) reach the concrete type.
struct DeviceState {
  virtual ~DeviceState() = default;
  [[nodiscard]] virtual c10::Device device() const = 0;
  [[nodiscard]] virtual bool is_kvm() const = 0;
  [[nodiscard]] virtual std::int64_t max_slots() const = 0;
  // (heads, value dim) of a step's output rows: (Hq, Dv) for KV Means, (query_heads, head_dim) for UA.
  [[nodiscard]] virtual std::pair<std::int64_t, std::int64_t> out_dims() const = 0;
  virtual std::int64_t tokens(std::int64_t slot) = 0;
  [[nodiscard]] virtual std::int64_t allocated_bytes() const = 0;
  virtual std::int64_t export_bytes(std::int64_t slot) = 0;
  virtual at::Tensor export_slot(std::int64_t slot) = 0;
  virtual void import_slot(const std::vector<at::Tensor>& weights, std::int64_t slot, const at::Tensor& bytes) = 0;
  virtual void truncate(std::int64_t slot, std::int64_t n) = 0;
  // Raises what the device refused since the last check (a step's rows, a UA slot that overflowed).
  virtual void step_status() = 0;
};

struct StateHolder : torch::CustomClassHolder {
  // The caller's tensors a placed state lives in (undefined for an owning state): held so that the
  // memory outlives the state whatever Python does with its own references. Declared before the
  // state, so that the state goes first.
  at::Tensor memory, workspace;
  std::variant<KvmState, UaCache, std::unique_ptr<DeviceState>> state;

  explicit StateHolder(KvmState s) : state(std::move(s)) {}
  explicit StateHolder(UaCache c) : state(std::move(c)) {}
  explicit StateHolder(std::unique_ptr<DeviceState> d) : state(std::move(d)) {}
  StateHolder(KvmState s, at::Tensor mem, at::Tensor ws)
      : memory(std::move(mem)), workspace(std::move(ws)), state(std::move(s)) {}
  StateHolder(UaCache c, at::Tensor mem, at::Tensor ws)
      : memory(std::move(mem)), workspace(std::move(ws)), state(std::move(c)) {}
  StateHolder(std::unique_ptr<DeviceState> d, at::Tensor mem, at::Tensor ws)
      : memory(std::move(mem)), workspace(std::move(ws)), state(std::move(d)) {}

  // The device state, or nullptr for a CPU state.
  [[nodiscard]] DeviceState* on_device() const {
    const auto* d = std::get_if<std::unique_ptr<DeviceState>>(&state);
    return d != nullptr ? d->get() : nullptr;
  }
  [[nodiscard]] c10::Device device() const { return on_device() ? on_device()->device() : c10::Device(c10::kCPU); }
  [[nodiscard]] bool is_kvm() const {
    if (const DeviceState* d = on_device()) return d->is_kvm();
    return std::holds_alternative<KvmState>(state);
  }
  [[nodiscard]] std::string mechanism() const { return is_kvm() ? "kvm" : "ua"; }
  [[nodiscard]] std::int64_t max_slots() const {
    if (const DeviceState* d = on_device()) return d->max_slots();
    if (const auto* k = std::get_if<KvmState>(&state)) return k->max_slots();
    return std::get<UaCache>(state).max_slots();
  }
  // Tokens the sequence in `slot` has seen (KVM n, UA position); 0 outside the state. A device state
  // reads them from the device (a synchronisation of the current stream).
  [[nodiscard]] std::int64_t tokens(std::int64_t slot) const {
    if (DeviceState* d = on_device()) return d->tokens(slot);
    if (const auto* k = std::get_if<KvmState>(&state)) return k->tokens(slot);
    return std::get<UaCache>(state).position(slot);
  }
  // (heads, value dim) of a step's output rows (the Meta kernels' shapes).
  [[nodiscard]] std::pair<std::int64_t, std::int64_t> out_dims() const {
    if (const DeviceState* d = on_device()) return d->out_dims();
    if (const auto* k = std::get_if<KvmState>(&state)) return {k->shape().Hq, k->shape().Dv};
    const auto& s = std::get<UaCache>(state).shape();
    return {s.query_heads, s.head_dim};
  }
};

using Holder = c10::intrusive_ptr<StateHolder>;

// The mismatch of a state on one device with tensors on another (a ValueError naming both).
[[noreturn]] inline void device_mismatch(const char* op, const c10::Device& state, const c10::Device& tensors) {
  TORCH_CHECK_VALUE(false, op, ": the state is on ", state, " but the tensors are on ", tensors,
                    ": expected every tensor on the state's device");
}

// The CPU state held by `h` for the CPU kernels: a ValueError naming the op for a device state (whose
// op reached the CPU kernel because its tensors are CPU tensors).
inline const Holder& host_state(const Holder& h, const char* op) {
  TORCH_CHECK_VALUE(h, op, ": state is None");
  if (const DeviceState* d = h->on_device()) device_mismatch(op, d->device(), c10::Device(c10::kCPU));
  return h;
}

// The KVM state held by `h`; a torch error naming the op when it holds a UA cache.
inline KvmState& kvm_state(const Holder& h, const char* op) {
  host_state(h, op);
  auto* s = std::get_if<KvmState>(&h->state);
  TORCH_CHECK_VALUE(s != nullptr, op, ": expected a KV Means state (kvm_create), got a ", h->mechanism(), " state");
  return *s;
}

inline UaCache& ua_cache(const Holder& h, const char* op) {
  host_state(h, op);
  auto* c = std::get_if<UaCache>(&h->state);
  TORCH_CHECK_VALUE(c != nullptr, op, ": expected a Universal Attention cache (ua_create), got a ", h->mechanism(),
                    " state");
  return *c;
}

}  // namespace kvmem::torch_ops
