// SPDX-License-Identifier: Apache-2.0
#pragma once
// Where the PyTorch ops keep a layer's kvmem state. This is the one place that decides it: every op
// reaches the state through the accessors below and never sees how it is held.
//
// The state is a torch custom class (torch.classes.kvmem.State); Python holds it like any object and
// passes it to every op. It holds one of
//   - a host kvm::State or ua::PrunedCache of one storage type (a CPU state: the ops' CPU kernels run
//     it; KV Means float or bf16, Universal Attention float, bf16 or fp16, as the C++ host backend
//     supports them), or
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
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

#include "kvmem/core/numeric.hpp"
#include "kvmem/kvm/state.hpp"
#include "kvmem/ua/cache.hpp"

namespace kvmem::torch_ops {

// The storage types a state may have, as torch dtypes: KV Means keeps float32 or bfloat16 windows and
// readout copies (its sums are float32 either way), Universal Attention float32, bfloat16 or float16
// keys and values. The same sets on every backend, so a state's dtype never depends on its device.
template <class S>
constexpr at::ScalarType dtype_of() {
  if constexpr (std::is_same_v<S, bf16>) return at::kBFloat16;
  if constexpr (std::is_same_v<S, fp16>) return at::kHalf;
  return at::kFloat;
}

// Calls f.template operator()<S>() for the storage type S of `dtype`: float, bf16 and, when `half`,
// fp16. The caller has checked `dtype` (check_storage in common.hpp).
template <bool half, class F>
decltype(auto) with_storage(at::ScalarType dtype, F&& f) {
  if constexpr (half) {
    if (dtype == at::kHalf) return f.template operator()<fp16>();
  }
  if (dtype == at::kBFloat16) return f.template operator()<bf16>();
  return f.template operator()<float>();
}

template <class S>
using KvmStateOf = kvm::State<S>;
template <class S>
using UaCacheOf = ua::PrunedCache<S>;

template <class T>
inline constexpr bool is_kvm_state_v = false;
template <class S, class A>
inline constexpr bool is_kvm_state_v<kvm::State<S, A>> = true;

// A state of a device backend. The ops without tensor arguments (export_slot, truncate, step_status,
// the State methods) run for every state in ops.cpp and reach a device state through these calls;
// the backend's own kernels (TORCH_LIBRARY_IMPL for its dispatch key) reach the concrete type.
struct DeviceState {
  virtual ~DeviceState() = default;
  [[nodiscard]] virtual c10::Device device() const = 0;
  [[nodiscard]] virtual bool is_kvm() const = 0;
  [[nodiscard]] virtual at::ScalarType dtype() const = 0;  // the storage type
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
  using Host = std::variant<KvmStateOf<float>, KvmStateOf<bf16>, UaCacheOf<float>, UaCacheOf<bf16>, UaCacheOf<fp16>>;
  // The caller's tensors a placed state lives in (undefined for an owning state): held so that the
  // memory outlives the state whatever Python does with its own references. Declared before the
  // state, so that the state goes first.
  at::Tensor memory, workspace;
  std::variant<Host, std::unique_ptr<DeviceState>> state;

  template <class S>
  requires std::is_constructible_v<Host, S&&>
  explicit StateHolder(S s, at::Tensor mem = {}, at::Tensor ws = {})
      : memory(std::move(mem)), workspace(std::move(ws)), state(Host(std::move(s))) {}
  explicit StateHolder(std::unique_ptr<DeviceState> d, at::Tensor mem = {}, at::Tensor ws = {})
      : memory(std::move(mem)), workspace(std::move(ws)), state(std::move(d)) {}

  // The device state, or nullptr for a CPU state.
  [[nodiscard]] DeviceState* on_device() const {
    const auto* d = std::get_if<std::unique_ptr<DeviceState>>(&state);
    return d != nullptr ? d->get() : nullptr;
  }
  // The CPU state, or nullptr for a device state.
  [[nodiscard]] Host* on_host() { return std::get_if<Host>(&state); }
  [[nodiscard]] const Host* on_host() const { return std::get_if<Host>(&state); }
  // f(state) for the CPU state, whatever its mechanism and storage type (call on a CPU state only).
  template <class F>
  decltype(auto) visit_host(F&& f) {
    return std::visit(std::forward<F>(f), std::get<Host>(state));
  }
  template <class F>
  decltype(auto) visit_host(F&& f) const {
    return std::visit(std::forward<F>(f), std::get<Host>(state));
  }

  [[nodiscard]] c10::Device device() const { return on_device() ? on_device()->device() : c10::Device(c10::kCPU); }
  [[nodiscard]] bool is_kvm() const {
    if (const DeviceState* d = on_device()) return d->is_kvm();
    return visit_host([](const auto& s) { return is_kvm_state_v<std::decay_t<decltype(s)>>; });
  }
  [[nodiscard]] std::string mechanism() const { return is_kvm() ? "kvm" : "ua"; }
  [[nodiscard]] at::ScalarType dtype() const {
    if (const DeviceState* d = on_device()) return d->dtype();
    return visit_host([](const auto& s) { return dtype_of<typename std::decay_t<decltype(s)>::storage_type>(); });
  }
  [[nodiscard]] std::int64_t max_slots() const {
    if (const DeviceState* d = on_device()) return d->max_slots();
    return visit_host([](const auto& s) { return std::int64_t(s.max_slots()); });
  }
  // Tokens the sequence in `slot` has seen (KVM n, UA position); 0 outside the state. A device state
  // reads them from the device (a synchronisation of the current stream).
  [[nodiscard]] std::int64_t tokens(std::int64_t slot) const {
    if (DeviceState* d = on_device()) return d->tokens(slot);
    return visit_host([&](const auto& s) -> std::int64_t {
      if constexpr (is_kvm_state_v<std::decay_t<decltype(s)>>)
        return s.tokens(slot);
      else
        return s.position(slot);
    });
  }
  // (heads, value dim) of a step's output rows (the Meta kernels' shapes).
  [[nodiscard]] std::pair<std::int64_t, std::int64_t> out_dims() const {
    if (const DeviceState* d = on_device()) return d->out_dims();
    return visit_host([](const auto& s) -> std::pair<std::int64_t, std::int64_t> {
      if constexpr (is_kvm_state_v<std::decay_t<decltype(s)>>)
        return {s.shape().Hq, s.shape().Dv};
      else
        return {s.shape().query_heads, s.shape().head_dim};
    });
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

// f(state) for the CPU KV Means state held by `h`, whatever its storage type; a torch error naming the
// op when it holds a UA cache or a device state.
template <class F>
decltype(auto) with_kvm_state(const Holder& h, const char* op, F&& f) {
  host_state(h, op);
  StateHolder::Host& host = *h->on_host();
  if (auto* s = std::get_if<KvmStateOf<bf16>>(&host)) return f(*s);
  auto* s = std::get_if<KvmStateOf<float>>(&host);
  TORCH_CHECK_VALUE(s != nullptr, op, ": expected a KV Means state (kvm_create), got a ", h->mechanism(), " state");
  return f(*s);
}

// f(cache) for the CPU Universal Attention cache held by `h`, whatever its storage type.
template <class F>
decltype(auto) with_ua_cache(const Holder& h, const char* op, F&& f) {
  host_state(h, op);
  StateHolder::Host& host = *h->on_host();
  if (auto* c = std::get_if<UaCacheOf<bf16>>(&host)) return f(*c);
  if (auto* c = std::get_if<UaCacheOf<fp16>>(&host)) return f(*c);
  auto* c = std::get_if<UaCacheOf<float>>(&host);
  TORCH_CHECK_VALUE(c != nullptr, op, ": expected a Universal Attention cache (ua_create), got a ", h->mechanism(),
                    " state");
  return f(*c);
}

}  // namespace kvmem::torch_ops
