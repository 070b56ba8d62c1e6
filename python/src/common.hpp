// SPDX-License-Identifier: Apache-2.0
#pragma once
// What the op kernels of every backend share: ops.cpp (the host backend's CPU kernels, the Meta
// kernels and the ops without tensor arguments) and ops_cuda.cu (the CUDA backend's kernels) include
// this header. It holds the Status -> Python exception mapping, the checks of tensor arguments, views
// over tensors, the row and weight tensors of a step, the parameters of a KV Means state, and the
// hook through which ops.cpp makes the states of a device backend. No CUDA code: nvcc and the C++
// compiler both compile it.

#include <ATen/ATen.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "kvmem/core/slots.hpp"
#include "kvmem/core/status.hpp"
#include "kvmem/core/tensor.hpp"
#include "kvmem/kvm/params.hpp"
#include "kvmem/kvm/state.hpp"
#include "kvmem/ua/cache.hpp"
#include "kvmem/ua/ops.hpp"
#include "state.hpp"

namespace kvmem::torch_ops {

// Raises a Python exception carrying the Status message (after `context`, when given); the exception
// type follows the code.
inline void check(const Status& st, const std::string& context = {}) {
  if (st.is_ok()) return;
  const std::string what = context.empty() ? st.to_string() : context + ": " + st.to_string();
  switch (st.code()) {
    case StatusCode::kInvalidArgument:
      TORCH_CHECK_VALUE(false, "kvmem: ", what);
    case StatusCode::kOutOfRange:
      TORCH_CHECK_INDEX(false, "kvmem: ", what);
    default:
      TORCH_CHECK(false, "kvmem: ", what);
  }
}

// A tensor argument: defined, on `device` (the state's), of `dtype`, with `dim` dimensions.
inline void check_tensor(const at::Tensor& t, const char* op, const char* name, at::ScalarType dtype, std::int64_t dim,
                         const c10::Device& device) {
  TORCH_CHECK_VALUE(t.defined(), op, ": ", name, " is undefined");
  if (device.is_cpu()) {
    TORCH_CHECK_VALUE(t.device().is_cpu(), op, ": ", name, ": expected a CPU tensor, got device ", t.device());
  } else {
    TORCH_CHECK_VALUE(t.device() == device, op, ": ", name, ": expected a tensor on ", device,
                      " (the state's device), got device ", t.device());
  }
  TORCH_CHECK_VALUE(t.scalar_type() == dtype, op, ": ", name, ": expected dtype ", dtype, ", got ", t.scalar_type());
  TORCH_CHECK_VALUE(t.dim() == dim, op, ": ", name, ": expected ", dim, " dimensions, got shape ", t.sizes());
}

template <class T, std::size_t R>
TensorView<T, R> view(const at::Tensor& t) {
  std::array<std::int64_t, R> ext{};
  for (std::size_t i = 0; i < R; ++i) ext[i] = t.size(static_cast<std::int64_t>(i));
  return TensorView<T, R>(static_cast<T*>(t.data_ptr()), ext);
}

// The row batch of a step (int32 slot [rows], query_start [rows + 1]), contiguous, on `device`; rows()
// adds the caller's bound on a row's tokens (Rows::max_query_len, 0: none).
struct RowTensors {
  at::Tensor slot, query_start;
  RowTensors(const at::Tensor& s, const at::Tensor& qs, const char* op, const c10::Device& device) {
    check_tensor(s, op, "slot", at::kInt, 1, device);
    check_tensor(qs, op, "query_start", at::kInt, 1, device);
    slot = s.contiguous();
    query_start = qs.contiguous();
  }
  [[nodiscard]] Rows rows(std::int64_t max_query_len) const {
    return {view<const std::int32_t, 1>(slot), view<const std::int32_t, 1>(query_start), max_query_len};
  }
};

// A state's storage dtype from a create or size op's `dtype` argument (None = float32): one the
// mechanism keeps on every backend (state.hpp), else a ValueError naming the combination.
inline at::ScalarType check_storage(const c10::optional<at::ScalarType>& dtype, const char* op, bool kvm) {
  const at::ScalarType t = dtype.value_or(at::kFloat);
  if (kvm) {
    TORCH_CHECK_VALUE(t == at::kFloat || t == at::kBFloat16, op, ": dtype: expected Float or BFloat16 (the storage ",
                      "types of a KV Means state), got ", t);
  } else {
    TORCH_CHECK_VALUE(t == at::kFloat || t == at::kBFloat16 || t == at::kHalf, op,
                      ": dtype: expected Float, BFloat16 or Half (the storage types of a Universal Attention cache), ",
                      "got ", t);
  }
  return t;
}

// A step input in the state's dtype `dtype` (what the backends read), contiguous. `takes` names the
// inputs that share that rule, for the message.
inline at::Tensor step_input(const at::Tensor& t, const char* op, const char* name, std::int64_t dim,
                             const c10::Device& device, at::ScalarType dtype, const char* takes) {
  TORCH_CHECK_VALUE(t.defined(), op, ": ", name, " is undefined");
  check_tensor(t, op, name, t.scalar_type(), dim, device);
  TORCH_CHECK_VALUE(t.scalar_type() == dtype, op, ": ", name, ": expected dtype ", dtype, ", got ", t.scalar_type(),
                    " (a state of dtype ", dtype, " takes ", takes, " of its dtype)");
  return t.contiguous();
}

inline at::Tensor float_input(const at::Tensor& t, const char* op, const char* name, std::int64_t dim,
                              const c10::Device& device) {
  check_tensor(t, op, name, at::kFloat, dim, device);
  return t.contiguous();
}

// The tensors of one kvm_step on `device` for a state of dtype `dtype`: its rows, and q, k, v and gate
// of that dtype, checked and contiguous; the outputs out [tokens, Hq, Dv] (that dtype) and lse
// [tokens, Hq] (float32) allocated on the device.
struct KvmStepTensors {
  static constexpr const char* kTakes = "q, k, v and gate";
  RowTensors rows;
  at::ScalarType dtype;
  at::Tensor q, k, v, gate, out, lse;
  KvmStepTensors(const at::Tensor& slot, const at::Tensor& query_start, const at::Tensor& q_, const at::Tensor& k_,
                 const at::Tensor& v_, const at::Tensor& gate_, std::int64_t Hq, std::int64_t Dv, const char* op,
                 const c10::Device& device, at::ScalarType dtype_)
      : rows(slot, query_start, op, device),
        dtype(dtype_),
        q(step_input(q_, op, "q", 3, device, dtype, kTakes)),
        k(step_input(k_, op, "k", 3, device, dtype, kTakes)),
        v(step_input(v_, op, "v", 3, device, dtype, kTakes)),
        gate(step_input(gate_, op, "gate", 2, device, dtype, kTakes)),
        out(at::empty({q.size(0), Hq, Dv}, q.options())),
        lse(at::empty({q.size(0), Hq}, q.options().dtype(at::kFloat))) {}
  // Inputs and out as float32: the host backend reads and writes float32 whatever its storage type (the
  // conversion from bf16 is exact, the window rounds keys and values to the storage type, and out is
  // rounded to the state's dtype once, as a bf16 output of the backend would be).
  void to_float() {
    for (at::Tensor* t : {&q, &k, &v, &gate}) *t = t->to(at::kFloat);
    if (out.scalar_type() != at::kFloat) out = at::empty(out.sizes(), out.options().dtype(at::kFloat));
  }
  // Views of the inputs and out as S: the state's storage type, or float after to_float().
  template <class S>
  [[nodiscard]] std::tuple<TensorView<const S, 3>, TensorView<const S, 3>, TensorView<const S, 3>,
                           TensorView<const S, 2>, TensorView<S, 3>>
  views() const {
    return {view<const S, 3>(q), view<const S, 3>(k), view<const S, 3>(v), view<const S, 2>(gate), view<S, 3>(out)};
  }
  // out in the state's dtype, lse float32.
  [[nodiscard]] std::tuple<at::Tensor, at::Tensor> result() const { return {out.to(dtype), lse}; }
};

// The tensors of one ua_step on `device` for a cache of dtype `dtype`: its rows, q, k, v, z_k, z_q and
// the optional z_o of that dtype, checked and contiguous; z_k and z_q as float32 (what every backend
// reads); the outputs out [tokens, H, D] and lse [tokens, H] as float32 (what the backends write:
// result() gives out in the cache's dtype).
struct UaStepTensors {
  static constexpr const char* kTakes = "q, k, v, z_k, z_q and z_o";
  RowTensors rows;
  at::ScalarType dtype;
  at::Tensor q, k, v, z_k, z_q, z_o, out, lse;
  UaStepTensors(const at::Tensor& slot, const at::Tensor& query_start, const at::Tensor& q_, const at::Tensor& k_,
                const at::Tensor& v_, const at::Tensor& z_k_, const at::Tensor& z_q_,
                const c10::optional<at::Tensor>& z_o_, const ua::CacheShape& s, const char* op,
                const c10::Device& device, at::ScalarType dtype_)
      : rows(slot, query_start, op, device),
        dtype(dtype_),
        q(step_input(q_, op, "q", 3, device, dtype, kTakes)),
        k(step_input(k_, op, "k", 3, device, dtype, kTakes)),
        v(step_input(v_, op, "v", 3, device, dtype, kTakes)),
        z_k(step_input(z_k_, op, "z_k", 2, device, dtype, kTakes).to(at::kFloat)),
        z_q(step_input(z_q_, op, "z_q", 2, device, dtype, kTakes).to(at::kFloat)),
        out(at::empty({q.size(0), s.query_heads, s.head_dim}, q.options().dtype(at::kFloat))),
        lse(at::empty({q.size(0), s.query_heads}, q.options().dtype(at::kFloat))) {
    if (z_o_.has_value() && z_o_->defined()) z_o = step_input(*z_o_, op, "z_o", 3, device, dtype, kTakes);
  }
  // q, k, v and z_o as float32: the host backend reads float32 inputs whatever its storage type (the
  // conversion from bf16 or fp16 is exact, and the cache rounds keys and values to its storage type).
  void inputs_to_float() {
    for (at::Tensor* t : {&q, &k, &v, &z_o})
      if (t->defined()) *t = t->to(at::kFloat);
  }
  // The inputs as S (q, k, v, z_o) and float (z_k, z_q): S is float after inputs_to_float().
  template <class S>
  [[nodiscard]] ua::PackedInputsOf<S> inputs() const {
    return {view<const S, 3>(q),       view<const S, 3>(k),
            view<const S, 3>(v),       view<const float, 2>(z_k),
            view<const float, 2>(z_q), z_o.defined() ? view<const S, 3>(z_o) : TensorView<const S, 3>{}};
  }
  // out in the cache's dtype, lse float32.
  [[nodiscard]] std::tuple<at::Tensor, at::Tensor> result() const { return {out.to(dtype), lse}; }
};

// A slot list of a slot operation (int32 [n]), contiguous, on `device`.
inline at::Tensor slot_list(const at::Tensor& t, const char* op, const char* name, const c10::Device& device) {
  check_tensor(t, op, name, at::kInt, 1, device);
  return t.contiguous();
}

// KV Means' learned weights [ln_weight [D], ln_bias [D], tau_state [Hq], tau_bswa [Hq]], contiguous
// float32 tensors on `device`.
struct KvmWeightTensors {
  static constexpr std::array<const char*, 4> kNames = {"ln_weight", "ln_bias", "tau_state", "tau_bswa"};
  std::vector<at::Tensor> w;
  KvmWeightTensors(const std::vector<at::Tensor>& weights, const char* op, const c10::Device& device) {
    TORCH_CHECK_VALUE(weights.size() == 4, op,
                      ": weights: expected 4 tensors [ln_weight, ln_bias, tau_state, tau_bswa], got ", weights.size());
    for (std::size_t i = 0; i < 4; ++i) w.push_back(float_input(weights[i], op, kNames[i], 1, device));
  }
  // Host views (kvm::Weights): the host backend checks their sizes itself.
  [[nodiscard]] kvm::Weights get() const {
    return {view<const float, 1>(w[0]), view<const float, 1>(w[1]), view<const float, 1>(w[2]),
            view<const float, 1>(w[3])};
  }
  // Shapes against the state's, with the host backend's messages, for a backend that takes raw
  // pointers (CUDA reads [D] and [Hq] elements from them without knowing their extents).
  void check_shapes(const kvm::Shape& s) const {
    const std::array<std::int64_t, 4> expected = {s.D, s.D, s.Hq, s.Hq};
    for (std::size_t i = 0; i < 4; ++i) check(check_shape(view<const float, 1>(w[i]), {expected[i]}, kNames[i]));
  }
};

// A uint8 tensor whose storage a state or workspace is placed over: one dimension, contiguous. Its
// size and alignment are kvmem's checks (State::place, attach_workspace).
inline void check_memory(const at::Tensor& t, const char* op, const char* name, const c10::Device& device) {
  check_tensor(t, op, name, at::kByte, 1, device);
  TORCH_CHECK_VALUE(t.is_contiguous(), op, ": ", name, ": expected a contiguous tensor");
}

// ---- KV Means parameters -----------------------------------------------------------------------------

inline budget::Any parse_budget(const std::string& kind, const std::vector<double>& a) {
  auto arg = [&](std::size_t i, double fallback) { return i < a.size() ? a[i] : fallback; };
  auto integer = [&](std::size_t i, std::int64_t fallback) {
    return static_cast<std::int64_t>(arg(i, static_cast<double>(fallback)));
  };
  if (kind == "fixed") {
    TORCH_CHECK_VALUE(a.size() <= 2, "kvm_create: budget_args of 'fixed': [count, maximum], got ", a.size(), " values");
    return budget::Fixed{integer(0, 256), integer(1, budget::kPaperMaxSlots)};
  }
  if (kind == "power") {
    TORCH_CHECK_VALUE(a.size() <= 5, "kvm_create: budget_args of 'power': [factor, exponent, minimum, round_down, ",
                      "maximum], got ", a.size(), " values");
    return budget::Power{arg(0, 16.0), arg(1, 0.5), integer(2, 256), integer(3, 1), integer(4, budget::kPaperMaxSlots)};
  }
  if (kind == "saturating") {
    TORCH_CHECK_VALUE(a.size() <= 4, "kvm_create: budget_args of 'saturating': [saturation, minimum, maximum, ",
                      "round_down], got ", a.size(), " values");
    return budget::Saturating{arg(0, 1024.0), integer(1, 1), integer(2, budget::kPaperMaxSlots), integer(3, 1)};
  }
  TORCH_CHECK_VALUE(false, "kvm_create: budget: expected 'fixed', 'power' or 'saturating', got '", kind, "'");
}

inline kvm::Params make_params(std::int64_t chunk, std::int64_t window_chunks, std::int64_t sink,
                               std::int64_t rope_dims, const std::string& budget,
                               const std::vector<double>& budget_args, double scale) {
  kvm::Params p;
  p.chunk = chunk;
  p.window_chunks = window_chunks;
  p.sink = sink;
  p.rope_dims = rope_dims;
  p.budget = parse_budget(budget, budget_args);
  p.scale = scale;
  return p;
}

// ---- device backends ---------------------------------------------------------------------------------

// What ops.cpp needs from a device backend to make its states and answer the size queries of the ops
// without tensor arguments (kvm_create / ua_create / kvm_state_bytes / kvm_layout / ua_layout with a
// device). The backend's translation unit sets its pointer below when the library loads.
struct DeviceBackend {
  virtual ~DeviceBackend() = default;
  // A state of storage type `dtype` (checked by check_storage) owning its device memory on `device` (an
  // index, or none: the current device).
  [[nodiscard]] virtual Holder kvm_create(const kvm::Problem& problem, at::ScalarType dtype,
                                          c10::Device device) const = 0;
  [[nodiscard]] virtual Holder ua_create(const ua::CacheShape& shape, at::ScalarType dtype,
                                         c10::Device device) const = 0;
  // Bytes kvm_create allocates (0 when the configuration is invalid).
  [[nodiscard]] virtual std::int64_t kvm_state_bytes(const kvm::Problem& problem, at::ScalarType dtype) const = 0;
  // (state bytes, workspace bytes) of a placed state; (0, 0) when the configuration is invalid.
  [[nodiscard]] virtual std::tuple<std::int64_t, std::int64_t> kvm_layout(const kvm::Problem& problem,
                                                                          at::ScalarType dtype) const = 0;
  [[nodiscard]] virtual std::tuple<std::int64_t, std::int64_t> ua_layout(const ua::CacheShape& shape,
                                                                         at::ScalarType dtype) const = 0;
};

// The CUDA backend, when this library was built with it (ops_cuda.cu registers it); nullptr otherwise.
inline const DeviceBackend*& cuda_backend() {
  static const DeviceBackend* backend = nullptr;
  return backend;
}

}  // namespace kvmem::torch_ops
