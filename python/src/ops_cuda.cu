// SPDX-License-Identifier: Apache-2.0
// The CUDA kernels of kvmem's PyTorch ops (schemas in ops.cpp): the CUDA backend's sequence-slot API
// over CUDA tensors, on the state's device and that device's current stream, as torch's own kernels
// run. A state is made for CUDA by kvm_create / ua_create with a CUDA `device` (the backend registered
// below) or by kvm_place / ua_place over CUDA uint8 tensors; it holds a cuda::KvmState or
// cuda::UaCache of the state's storage type (dtype) on that device. Every tensor of an op must be on
// the state's device: a CPU state with CUDA tensors, or the reverse, raises a ValueError naming both.
//
// What waits for the device (docs/integration.md, "PyTorch ops on CUDA"):
//   - kvm_step checks its rows on the device, which refuses a bad step as a whole (nothing changes);
//     the op then reads the state's step status (a 12-byte copy to the host, which waits for the
//     current stream) and raises like the CPU op. ua_step checks on the host before it enqueues
//     anything (rows, and room for every row, as the host backend does: this reads the slots' lengths,
//     waiting for the current stream), then launches without waiting.
//   - While the current stream is being captured into a CUDA graph, or when called with wait=False, both
//     steps skip those reads (they would break the capture, or stall a loop that keeps the device
//     busy): such a step never waits. What the device refused stays in the state; step_status(state)
//     raises it, and so do the next waiting steps.
//   - The slot operations read their lists back (one wait each), as the C++ API does; export_slot,
//     import_slot, truncate and the State methods tokens / export_bytes read the device and wait too.
//   - kvm_place / ua_place wait for the current stream once: the state initialises its memory on a
//     stream of its own, which must not overtake work queued earlier on that memory.
// Input values (NaN, Inf, gate <= 0) are the caller's precondition on CUDA, as in the C++ backend:
// checking them would read every input back.

#include <ATen/ATen.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "common.hpp"
#include "kvmem/backend/cuda.hpp"
#include "state.hpp"

namespace kvmem::torch_ops {
namespace {

template <class S>
using CudaKvm = cuda::KvmState<S, float>;
template <class S>
using CudaUa = cuda::UaCache<S>;

// The device a state made for `device` lives on: "cuda" without an index is the current device.
c10::Device resolve(const c10::Device& device) {
  return device.has_index() ? device : c10::Device(c10::kCUDA, c10::cuda::current_device());
}

// The current stream of `device` as the backend's executor.
cuda::Executor executor(const c10::Device& device) {
  return cuda::Executor{c10::cuda::getCurrentCUDAStream(device.index()).stream()};
}

// Whether `stream` is being captured into a CUDA graph: then nothing may wait for it.
bool capturing(cudaStream_t stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  check(cuda::to_status(cudaStreamIsCapturing(stream, &status), "cudaStreamIsCapturing"));
  return status != cudaStreamCaptureStatusNone;
}

void check_slot(std::int64_t slot, std::int64_t max_slots, const char* op) {
  TORCH_CHECK_INDEX(slot >= 0 && slot < max_slots, "kvmem: ", op, " slot: expected 0 <= slot < max_slots = ", max_slots,
                    ", got ", slot);
}

// A slot record for import_slot: uint8 [bytes], on the CPU or on the state's device (copied to the
// host, where the backend reads records).
at::Tensor host_record(const at::Tensor& bytes, const char* op, const c10::Device& device) {
  const bool on_cpu = bytes.defined() && bytes.device().is_cpu();
  check_tensor(bytes, op, "bytes", at::kByte, 1, on_cpu ? c10::Device(c10::kCPU) : device);
  return bytes.to(c10::kCPU).contiguous();
}

std::span<const std::byte> record_span(const at::Tensor& host) {
  return {static_cast<const std::byte*>(host.data_ptr()), static_cast<std::size_t>(host.numel())};
}

// A state of the CUDA backend on `device`. Destroyed with its device current: its streams, events and
// memory belong to that device.
template <class S>
class OnCuda : public DeviceState {
 public:
  OnCuda(S state, const c10::Device& device) : state_(std::move(state)), device_(device) {}
  OnCuda(const OnCuda&) = delete;
  OnCuda& operator=(const OnCuda&) = delete;
  ~OnCuda() override {
    const c10::cuda::CUDAGuard guard(device_);
    state_.reset();
  }
  [[nodiscard]] c10::Device device() const override { return device_; }
  [[nodiscard]] std::int64_t max_slots() const override { return state_->max_slots(); }
  S& get() { return *state_; }

 protected:
  std::optional<S> state_;
  c10::Device device_;
};

template <class S>
class KvmOnCuda final : public OnCuda<CudaKvm<S>> {
  using OnCuda<CudaKvm<S>>::state_;
  using OnCuda<CudaKvm<S>>::device_;

 public:
  using OnCuda<CudaKvm<S>>::OnCuda;
  using OnCuda<CudaKvm<S>>::max_slots;
  static constexpr bool kKvm = true;
  [[nodiscard]] bool is_kvm() const override { return true; }
  [[nodiscard]] at::ScalarType dtype() const override { return dtype_of<S>(); }
  [[nodiscard]] std::pair<std::int64_t, std::int64_t> out_dims() const override {
    return {state_->shape().Hq, state_->shape().Dv};
  }
  std::int64_t tokens(std::int64_t slot) override {
    if (slot < 0 || slot >= max_slots()) return 0;
    const c10::cuda::CUDAGuard guard(device_);
    std::int64_t n = 0, cov = 0, used = 0;
    check(state_->slot_counters(executor(device_), static_cast<std::int32_t>(slot), n, cov, used));
    return n;
  }
  [[nodiscard]] std::int64_t allocated_bytes() const override {
    return static_cast<std::int64_t>(state_->allocated_bytes());
  }
  std::int64_t export_bytes(std::int64_t slot) override {
    const c10::cuda::CUDAGuard guard(device_);
    // kvm::export_bytes reads the slot's counters on the default stream: the current stream's work first
    check(cuda::to_status(cudaStreamSynchronize(executor(device_).stream), "export_bytes sync"));
    return static_cast<std::int64_t>(kvm::export_bytes(*state_, static_cast<std::int32_t>(slot)));
  }
  at::Tensor export_slot(std::int64_t slot) override {
    const c10::cuda::CUDAGuard guard(device_);
    at::Tensor bytes = at::empty({export_bytes(slot)}, at::TensorOptions().dtype(at::kByte));
    const std::span<std::byte> span(static_cast<std::byte*>(bytes.data_ptr()), static_cast<std::size_t>(bytes.numel()));
    check(kvm::export_slot(executor(device_), *state_, static_cast<std::int32_t>(slot), span));
    return bytes;
  }
  void import_slot(const std::vector<at::Tensor>& weights, std::int64_t slot, const at::Tensor& bytes) override {
    constexpr const char* op = "import_slot";
    const c10::cuda::CUDAGuard guard(device_);
    const at::Tensor record = host_record(bytes, op, device_);
    check_slot(slot, max_slots(), op);
    const KvmWeightTensors w(weights, op, device_);
    w.check_shapes(state_->shape());
    check(kvm::import_slot(executor(device_), *state_, device_weights(w), static_cast<std::int32_t>(slot),
                           record_span(record)));
  }
  void truncate(std::int64_t slot, std::int64_t n) override {
    const c10::cuda::CUDAGuard guard(device_);
    check(kvm::truncate(executor(device_), *state_, static_cast<std::int32_t>(slot), n));
  }
  void step_status() override {
    const c10::cuda::CUDAGuard guard(device_);
    check(state_->step_status(executor(device_)), "a step was refused on the device");
  }

  static cuda::KvmWeights device_weights(const KvmWeightTensors& w) {
    return {w.w[0].data_ptr<float>(), w.w[1].data_ptr<float>(), w.w[2].data_ptr<float>(), w.w[3].data_ptr<float>()};
  }
};

template <class S>
class UaOnCuda final : public OnCuda<CudaUa<S>> {
  using OnCuda<CudaUa<S>>::state_;
  using OnCuda<CudaUa<S>>::device_;

 public:
  using OnCuda<CudaUa<S>>::OnCuda;
  using OnCuda<CudaUa<S>>::max_slots;
  static constexpr bool kKvm = false;
  [[nodiscard]] bool is_kvm() const override { return false; }
  [[nodiscard]] at::ScalarType dtype() const override { return dtype_of<S>(); }
  [[nodiscard]] std::pair<std::int64_t, std::int64_t> out_dims() const override {
    return {state_->shape().query_heads, state_->shape().head_dim};
  }
  std::int64_t tokens(std::int64_t slot) override {
    if (slot < 0 || slot >= max_slots()) return 0;
    const c10::cuda::CUDAGuard guard(device_);
    std::vector<std::int64_t> positions;
    check(state_->positions(executor(device_), positions));
    return positions[static_cast<std::size_t>(slot)];
  }
  [[nodiscard]] std::int64_t allocated_bytes() const override {
    return static_cast<std::int64_t>(state_->cache_bytes() + state_->workspace_bytes());
  }
  std::int64_t export_bytes(std::int64_t slot) override {
    const c10::cuda::CUDAGuard guard(device_);  // ua::export_bytes waits for the whole device
    return static_cast<std::int64_t>(ua::export_bytes(*state_, static_cast<std::int32_t>(slot)));
  }
  at::Tensor export_slot(std::int64_t slot) override {
    const c10::cuda::CUDAGuard guard(device_);
    at::Tensor bytes = at::empty({export_bytes(slot)}, at::TensorOptions().dtype(at::kByte));
    const std::span<std::byte> span(static_cast<std::byte*>(bytes.data_ptr()), static_cast<std::size_t>(bytes.numel()));
    check(ua::export_slot(executor(device_), *state_, static_cast<std::int32_t>(slot), span));
    return bytes;
  }
  void import_slot(const std::vector<at::Tensor>& weights, std::int64_t slot, const at::Tensor& bytes) override {
    constexpr const char* op = "import_slot";
    const c10::cuda::CUDAGuard guard(device_);
    const at::Tensor record = host_record(bytes, op, device_);
    check_slot(slot, max_slots(), op);
    TORCH_CHECK_VALUE(weights.empty(), op, ": weights: expected none for a Universal Attention cache, got ",
                      weights.size(), " tensors");
    check(ua::import_slot(executor(device_), *state_, static_cast<std::int32_t>(slot), record_span(record)));
  }
  void truncate(std::int64_t slot, std::int64_t n) override {
    const c10::cuda::CUDAGuard guard(device_);
    check(ua::truncate(executor(device_), *state_, static_cast<std::int32_t>(slot), n));
  }
  // The refusal the device kept since the last check, then the slots that ran out of room during steps
  // that did not wait (captured, or wait=False; they stay flagged, and raise here, until reset_slots,
  // copy_slots or import_slot).
  void step_status() override {
    const c10::cuda::CUDAGuard guard(device_);
    const cuda::Executor exec = executor(device_);
    check(state_->step_status(exec), "a step was refused on the device");
    std::vector<std::int32_t> flags;
    check(state_->overflowed(exec, flags));
    std::string slots;
    for (std::size_t b = 0; b < flags.size(); ++b)
      if (flags[b] != 0) slots += (slots.empty() ? "" : ", ") + std::to_string(b);
    TORCH_CHECK_INDEX(
        slots.empty(), "kvmem: out of range: cache capacity: slots [", slots,
        "] had no room for a row of a step that did not wait: their rows were skipped (out and lse zero) and "
        "they step no more until reset_slots, copy_slots or import_slot replaces them");
  }

  // What the host backend checks before a step changes anything, for an uncaptured step: the rows,
  // and room for every row's tokens in its slot (kept + new <= capacity in every KV head; a slot
  // flagged by an earlier captured step is skipped, as the host skips a flagged slot). Without it the
  // device would skip a row that has no room and step the others, which a raise could not report
  // without losing their outputs. Also raises a refusal the device kept from a captured step.
  void check_before_step(const RowTensors& rows, std::int64_t max_query_len, std::int64_t tokens,
                         const cuda::Executor& exec) {
    check(state_->step_status(exec), "a step enqueued earlier was refused on the device");
    std::vector<std::int32_t> flags;
    check(state_->overflowed(exec, flags));
    std::vector<std::int64_t> lengths;
    check(state_->lengths(lengths, exec.stream));
    const at::Tensor slot = rows.slot.to(c10::kCPU), start = rows.query_start.to(c10::kCPU);
    const Rows host{view<const std::int32_t, 1>(slot), view<const std::int32_t, 1>(start), max_query_len};
    check(validate_rows(host, max_slots(), tokens));
    const ua::CacheShape& s = state_->shape();
    for (std::int64_t r = 0; r < host.count(); ++r) {
      const std::int32_t b = host.slot(r);
      if (b < 0 || flags[static_cast<std::size_t>(b)] != 0) continue;
      const std::int64_t n = host.query_start(r + 1) - host.query_start(r);
      for (std::int64_t g = 0; g < s.kv_heads; ++g) {
        const std::int64_t kept = lengths[static_cast<std::size_t>(b * s.kv_heads + g)];
        if (kept + n > s.capacity)
          check({StatusCode::kOutOfRange,
                 kvmem::detail::concat("cache capacity: row ", r, " (slot ", b, ", kv head ", g, ") needs room for ",
                                       kept + n, " rows (", kept, " kept + ", n, " new tokens), got capacity ",
                                       s.capacity)});
      }
    }
  }
};

// The device state held by `h`: a ValueError naming the op for a CPU state (whose op reached a CUDA
// kernel because its tensors are CUDA tensors).
DeviceState& cuda_device_state(const Holder& h, const char* op) {
  TORCH_CHECK_VALUE(h, op, ": state is None");
  DeviceState* d = h->on_device();
  if (d == nullptr) device_mismatch(op, c10::Device(c10::kCPU), c10::Device(c10::kCUDA));
  return *d;
}

// f(state) for the CUDA KV Means state held by `h`, whatever its storage type (KvmOnCuda<S>&).
template <class F>
decltype(auto) with_cuda_kvm(const Holder& h, const char* op, F&& f) {
  DeviceState& d = cuda_device_state(h, op);
  TORCH_CHECK_VALUE(d.is_kvm(), op, ": expected a KV Means state (kvm_create), got a ", h->mechanism(), " state");
  if (auto* s = dynamic_cast<KvmOnCuda<bf16>*>(&d)) return f(*s);
  return f(dynamic_cast<KvmOnCuda<float>&>(d));
}

// f(cache) for the CUDA Universal Attention cache held by `h`, whatever its storage type (UaOnCuda<S>&).
template <class F>
decltype(auto) with_cuda_ua(const Holder& h, const char* op, F&& f) {
  DeviceState& d = cuda_device_state(h, op);
  TORCH_CHECK_VALUE(!d.is_kvm(), op, ": expected a Universal Attention cache (ua_create), got a ", h->mechanism(),
                    " state");
  if (auto* c = dynamic_cast<UaOnCuda<bf16>*>(&d)) return f(*c);
  if (auto* c = dynamic_cast<UaOnCuda<fp16>*>(&d)) return f(*c);
  return f(dynamic_cast<UaOnCuda<float>&>(d));
}

// f(state) for the CUDA state held by `h`, whatever its mechanism and storage type.
template <class F>
void with_cuda_state(const Holder& h, const char* op, F&& f) {
  if (cuda_device_state(h, op).is_kvm())
    with_cuda_kvm(h, op, f);
  else
    with_cuda_ua(h, op, f);
}

// ---- steps -----------------------------------------------------------------------------------------

std::tuple<at::Tensor, at::Tensor> kvm_step(const Holder& h, const std::vector<at::Tensor>& weights,
                                            const at::Tensor& slot, const at::Tensor& query_start, const at::Tensor& q,
                                            const at::Tensor& k, const at::Tensor& v, const at::Tensor& gate,
                                            bool /*exact*/, bool wait, std::int64_t max_query_len) {
  constexpr const char* op = "kvm_step";
  return with_cuda_kvm(h, op, [&]<class S>(KvmOnCuda<S>& st) -> std::tuple<at::Tensor, at::Tensor> {
    const c10::Device dev = st.device();
    const c10::cuda::CUDAGuard guard(dev);
    CudaKvm<S>& state = st.get();
    const KvmWeightTensors w(weights, op, dev);
    w.check_shapes(state.shape());
    const auto& sh = state.shape();
    const KvmStepTensors t(slot, query_start, q, k, v, gate, sh.Hq, sh.Dv, op, dev, dtype_of<S>());
    const cuda::Executor exec = executor(dev);
    const auto [qv, kv, vv, gv, ov] = t.views<S>();
    check(kvm::step(exec, state, KvmOnCuda<S>::device_weights(w), t.rows.rows(max_query_len), qv, kv, vv, gv, ov,
                    view<float, 2>(t.lse)));
    if (wait && !capturing(exec.stream)) check(state.step_status(exec));
    return t.result();
  });
}

std::tuple<at::Tensor, at::Tensor> ua_step(const Holder& h, const at::Tensor& slot, const at::Tensor& query_start,
                                           const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                           const at::Tensor& z_k, const at::Tensor& z_q,
                                           const c10::optional<at::Tensor>& z_o, double p, std::int64_t prefill_chunk,
                                           bool evict_before_attention, bool wait, std::int64_t max_query_len) {
  constexpr const char* op = "ua_step";
  return with_cuda_ua(h, op, [&]<class S>(UaOnCuda<S>& st) {
    const c10::Device dev = st.device();
    const c10::cuda::CUDAGuard guard(dev);
    CudaUa<S>& cache = st.get();
    // q, k, v and z_o are read in the storage type, z_k and z_q as float; out is written as float and
    // returned in the cache's dtype
    const UaStepTensors t(slot, query_start, q, k, v, z_k, z_q, z_o, cache.shape(), op, dev, dtype_of<S>());
    const ua::PackedInputsOf<S> in = t.inputs<S>();
    const ua::Options opt{p, prefill_chunk, evict_before_attention};
    const cuda::Executor exec = executor(dev);
    if (!capturing(exec.stream)) {
      // the host's order: options and shapes, then the rows and the room they need (which waits)
      check(ua::detail::validate_options(opt));
      check(ua::detail::check_packed_step(cache.shape(), in, view<float, 3>(t.out), view<float, 2>(t.lse)));
      if (wait) st.check_before_step(t.rows, max_query_len, t.q.size(0), exec);
    }
    check(ua::step(exec, cache, t.rows.rows(max_query_len), in, opt, view<float, 3>(t.out), view<float, 2>(t.lse)));
    return t.result();
  });
}

// ---- slot operations -------------------------------------------------------------------------------

// Runs a slot operation and keeps the CPU op's contract: the device checks the list and refuses it as a
// whole (changing nothing) after the call has returned, so the verdict is read back from the state's
// status word (one wait on the current stream) and a refusal raises. Under capture nothing is read: a
// refused replay stays in the state and step_status(state) raises it.
template <class State, class Op>
void slot_op_done(const cuda::Executor& exec, State& state, Op&& run) {
  check(run(state));
  if (!capturing(exec.stream)) check(state.step_status(exec));
}

void reset_slots(const Holder& h, const at::Tensor& slots) {
  constexpr const char* op = "reset_slots";
  const c10::Device dev = cuda_device_state(h, op).device();
  const c10::cuda::CUDAGuard guard(dev);
  const at::Tensor s = slot_list(slots, op, "slots", dev);
  const auto list = view<const std::int32_t, 1>(s);
  const cuda::Executor exec = executor(dev);
  with_cuda_state(h, op, [&](auto& st) {
    if constexpr (std::decay_t<decltype(st)>::kKvm)
      slot_op_done(exec, st.get(), [&](auto& k) { return kvm::reset_slots(exec, k, list); });
    else
      slot_op_done(exec, st.get(), [&](auto& c) { return ua::reset_slots(exec, c, list); });
  });
}

void copy_slots(const Holder& h, const at::Tensor& src, const at::Tensor& dst) {
  constexpr const char* op = "copy_slots";
  const c10::Device dev = cuda_device_state(h, op).device();
  const c10::cuda::CUDAGuard guard(dev);
  const at::Tensor s = slot_list(src, op, "src", dev), d = slot_list(dst, op, "dst", dev);
  const auto a = view<const std::int32_t, 1>(s), b = view<const std::int32_t, 1>(d);
  const cuda::Executor exec = executor(dev);
  with_cuda_state(h, op, [&](auto& st) {
    if constexpr (std::decay_t<decltype(st)>::kKvm)
      slot_op_done(exec, st.get(), [&](auto& k) { return kvm::copy_slots(exec, k, a, b); });
    else
      slot_op_done(exec, st.get(), [&](auto& c) { return ua::copy_slots(exec, c, a, b); });
  });
}

// Reached when the record or a weight is a CUDA tensor; the state's backend checks the rest.
void import_slot(const Holder& h, const std::vector<at::Tensor>& weights, std::int64_t slot, const at::Tensor& bytes) {
  cuda_device_state(h, "import_slot").import_slot(weights, slot, bytes);
}

// ---- placed over caller tensors (docs/memory.md) ---------------------------------------------------

// The device of a placement's tensors: both on one CUDA device, uint8, one dimension, contiguous.
c10::Device placement_device(const at::Tensor& memory, const at::Tensor& workspace, const char* op) {
  TORCH_CHECK_VALUE(memory.defined(), op, ": memory is undefined");
  const c10::Device dev = memory.device();
  check_memory(memory, op, "memory", dev);
  check_memory(workspace, op, "workspace", dev);
  TORCH_CHECK_VALUE(dev.is_cuda(), op, ": memory: expected a CUDA tensor, got device ", dev);
  // the state initialises its memory on a stream of its own: the work queued before on this one first
  check(cuda::to_status(cudaStreamSynchronize(executor(dev).stream), "placement sync"));
  return dev;
}

Holder kvm_place(const at::Tensor& memory, const at::Tensor& workspace, std::int64_t max_slots, std::int64_t q_heads,
                 std::int64_t kv_heads, std::int64_t head_dim, std::int64_t value_dim, std::int64_t n_ctx,
                 std::int64_t chunk, std::int64_t window_chunks, std::int64_t sink, std::int64_t rope_dims,
                 std::string budget, std::vector<double> budget_args, double scale,
                 c10::optional<at::ScalarType> dtype) {
  constexpr const char* op = "kvm_place";
  const kvm::Problem pr{make_params(chunk, window_chunks, sink, rope_dims, budget, budget_args, scale),
                        {max_slots, q_heads, kv_heads, head_dim, value_dim, n_ctx}};
  const c10::Device dev = placement_device(memory, workspace, op);
  const at::ScalarType storage = check_storage(dtype, op, true);
  const c10::cuda::CUDAGuard guard(dev);
  return with_storage<false>(storage, [&]<class S>() {
    CudaKvm<S> s;
    check(CudaKvm<S>::place(memory.data_ptr(), static_cast<std::size_t>(memory.numel()), pr, s));
    check(s.attach_workspace(workspace.data_ptr(), static_cast<std::size_t>(workspace.numel())));
    return c10::make_intrusive<StateHolder>(std::make_unique<KvmOnCuda<S>>(std::move(s), dev), memory, workspace);
  });
}

Holder ua_place(const at::Tensor& memory, const at::Tensor& workspace, std::int64_t max_slots, std::int64_t q_heads,
                std::int64_t kv_heads, std::int64_t head_dim, std::int64_t capacity,
                c10::optional<at::ScalarType> dtype) {
  constexpr const char* op = "ua_place";
  const c10::Device dev = placement_device(memory, workspace, op);
  const at::ScalarType storage = check_storage(dtype, op, false);
  const c10::cuda::CUDAGuard guard(dev);
  return with_storage<true>(storage, [&]<class S>() {
    CudaUa<S> c;
    check(CudaUa<S>::place(memory.data_ptr(), static_cast<std::size_t>(memory.numel()),
                           {max_slots, q_heads, kv_heads, head_dim, capacity}, c));
    check(c.attach_workspace(workspace.data_ptr(), static_cast<std::size_t>(workspace.numel())));
    return c10::make_intrusive<StateHolder>(std::make_unique<UaOnCuda<S>>(std::move(c), dev), memory, workspace);
  });
}

// ---- the backend for the ops without tensor arguments ---------------------------------------------

struct CudaBackend final : DeviceBackend {
  [[nodiscard]] Holder kvm_create(const kvm::Problem& problem, at::ScalarType dtype,
                                  c10::Device device) const override {
    const c10::Device dev = resolve(device);
    const c10::cuda::CUDAGuard guard(dev);
    return with_storage<false>(dtype, [&]<class S>() {
      CudaKvm<S> s;
      check(CudaKvm<S>::create(problem.params, problem.shape, s));
      return c10::make_intrusive<StateHolder>(std::make_unique<KvmOnCuda<S>>(std::move(s), dev));
    });
  }
  [[nodiscard]] Holder ua_create(const ua::CacheShape& shape, at::ScalarType dtype, c10::Device device) const override {
    const c10::Device dev = resolve(device);
    const c10::cuda::CUDAGuard guard(dev);
    return with_storage<true>(dtype, [&]<class S>() {
      CudaUa<S> c;
      check(CudaUa<S>::create(shape, c));
      return c10::make_intrusive<StateHolder>(std::make_unique<UaOnCuda<S>>(std::move(c), dev));
    });
  }
  [[nodiscard]] std::int64_t kvm_state_bytes(const kvm::Problem& problem, at::ScalarType dtype) const override {
    return with_storage<false>(dtype, [&]<class S>() {
      return static_cast<std::int64_t>(CudaKvm<S>::bytes_required(problem.params, problem.shape));
    });
  }
  [[nodiscard]] std::tuple<std::int64_t, std::int64_t> kvm_layout(const kvm::Problem& problem,
                                                                  at::ScalarType dtype) const override {
    if (!kvm::validate(problem.params, problem.shape).is_ok()) return {0, 0};
    return with_storage<false>(dtype, [&]<class S>() -> std::tuple<std::int64_t, std::int64_t> {
      return {static_cast<std::int64_t>(CudaKvm<S>::state_bytes(problem)),
              static_cast<std::int64_t>(CudaKvm<S>::workspace_bytes(problem))};
    });
  }
  [[nodiscard]] std::tuple<std::int64_t, std::int64_t> ua_layout(const ua::CacheShape& shape,
                                                                 at::ScalarType dtype) const override {
    return with_storage<true>(dtype, [&]<class S>() -> std::tuple<std::int64_t, std::int64_t> {
      if (!CudaUa<S>::can_run(shape).is_ok()) return {0, 0};
      return {static_cast<std::int64_t>(CudaUa<S>::cache_bytes(shape)),
              static_cast<std::int64_t>(CudaUa<S>::workspace_bytes(shape))};
    });
  }
};

const CudaBackend kCudaBackend;

}  // namespace
}  // namespace kvmem::torch_ops

namespace cuda_ops = kvmem::torch_ops;

TORCH_LIBRARY_IMPL(kvmem, CUDA, m) {
  cuda_ops::cuda_backend() = &cuda_ops::kCudaBackend;  // kvm_create / ua_create / the sizes with a CUDA device
  m.impl("kvm_step", &cuda_ops::kvm_step);
  m.impl("ua_step", &cuda_ops::ua_step);
  m.impl("reset_slots", &cuda_ops::reset_slots);
  m.impl("copy_slots", &cuda_ops::copy_slots);
  m.impl("import_slot", &cuda_ops::import_slot);
  m.impl("kvm_place", &cuda_ops::kvm_place);
  m.impl("ua_place", &cuda_ops::ua_place);
}

// These ops have no backward: autograd passes straight to the CUDA kernels.
TORCH_LIBRARY_IMPL(kvmem, AutogradCUDA, m) {
  for (const char* op : {"kvm_step", "ua_step", "reset_slots", "copy_slots", "import_slot", "kvm_place", "ua_place"})
    m.impl(op, torch::CppFunction::makeFallthrough());
}
