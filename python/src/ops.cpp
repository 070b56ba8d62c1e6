// SPDX-License-Identifier: Apache-2.0
// kvmem's PyTorch custom ops (torch.ops.kvmem.*): the schemas, the host backend's sequence-slot API
// over CPU tensors (the CPU kernels), the Meta kernels, and the ops without tensor arguments for states
// on every device. The CUDA kernels are in ops_cuda.cu. Inputs are packed token-major, as in
// docs/slots.md: q [tokens, Hq, D], k [tokens, Hk, D], v [tokens, Hk, Dv], gates [tokens, Hk]; slot
// [rows] and query_start [rows + 1] are int32. Each op checks dtype and device, then calls the kvmem
// function of the same name; a refused call raises with kvmem's Status message (ValueError for invalid
// arguments, IndexError for indices out of range, RuntimeError otherwise) and leaves the state unchanged.
//
// Meta kernels give the output shapes without touching the state, so meta tensors and fake-tensor
// tracing (torch._subclasses.FakeTensorMode) run through the steps. The state is a custom-class object,
// not a tensor, which graph tracers of torch 2.x before 2.4 cannot fake; state held in tensors lifts that.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <cstdint>
#include <span>
#include <string>
#include <tuple>
#include <vector>

#include "common.hpp"
#include "kvmem/backend/host/kvm.hpp"
#include "kvmem/backend/host/ua.hpp"
#include "kvmem/kvm/attention.hpp"
#include "kvmem/kvm/record.hpp"
#include "kvmem/ua/ops.hpp"
#include "kvmem/ua/slots.hpp"
#include "state.hpp"

namespace kvmem::torch_ops {
namespace {

const c10::Device kCpu(c10::kCPU);

host::Executor executor(bool exact = false) {
  return host::Executor{.threads = at::get_num_threads(), .exact = exact};
}

// The device backend that makes states on `device`, or nullptr for the CPU (the host backend).
const DeviceBackend* device_backend(const c10::optional<c10::Device>& device, const char* op) {
  if (!device.has_value() || device->is_cpu()) return nullptr;
  TORCH_CHECK_VALUE(device->is_cuda(), op, ": device: expected cpu or cuda, got ", *device);
  const DeviceBackend* b = cuda_backend();
  TORCH_CHECK(b != nullptr, op, ": device ", *device,
              ": this build of kvmem's ops has no CUDA backend (build with KVMEM_CUDA=ON against a torch with CUDA)");
  return b;
}

// ---- create ----------------------------------------------------------------------------------------

Holder kvm_create(std::int64_t max_slots, std::int64_t q_heads, std::int64_t kv_heads, std::int64_t head_dim,
                  std::int64_t value_dim, std::int64_t n_ctx, std::int64_t chunk, std::int64_t window_chunks,
                  std::int64_t sink, std::int64_t rope_dims, std::string budget, std::vector<double> budget_args,
                  double scale, c10::optional<c10::Device> device, c10::optional<at::ScalarType> dtype) {
  const at::ScalarType storage = check_storage(dtype, "kvm_create", true);
  const kvm::Problem pr{make_params(chunk, window_chunks, sink, rope_dims, budget, budget_args, scale),
                        {max_slots, q_heads, kv_heads, head_dim, value_dim, n_ctx}};
  if (const DeviceBackend* b = device_backend(device, "kvm_create")) return b->kvm_create(pr, storage, *device);
  return with_storage<false>(storage, [&]<class S>() {
    KvmStateOf<S> s;
    check(KvmStateOf<S>::create(pr.params, pr.shape, s));
    return c10::make_intrusive<StateHolder>(std::move(s));
  });
}

Holder ua_create(std::int64_t max_slots, std::int64_t q_heads, std::int64_t kv_heads, std::int64_t head_dim,
                 std::int64_t capacity, c10::optional<c10::Device> device, c10::optional<at::ScalarType> dtype) {
  const at::ScalarType storage = check_storage(dtype, "ua_create", false);
  const ua::CacheShape shape{max_slots, q_heads, kv_heads, head_dim, capacity};
  if (const DeviceBackend* b = device_backend(device, "ua_create")) return b->ua_create(shape, storage, *device);
  return with_storage<true>(storage, [&]<class S>() {
    UaCacheOf<S> c;
    check(UaCacheOf<S>::create(shape, c));
    return c10::make_intrusive<StateHolder>(std::move(c));
  });
}

// ---- placed over caller tensors (docs/memory.md) ---------------------------------------------------

// (state bytes, workspace bytes) of a KVM state placed by kvm_place: the tensors an engine allocates,
// each 64-byte aligned on the CPU (torch's CPU allocations are), 256-byte aligned on CUDA (torch's CUDA
// allocations are). (0, 0) when the configuration is invalid.
std::tuple<std::int64_t, std::int64_t> kvm_layout(std::int64_t max_slots, std::int64_t q_heads, std::int64_t kv_heads,
                                                  std::int64_t head_dim, std::int64_t value_dim, std::int64_t n_ctx,
                                                  std::int64_t chunk, std::int64_t window_chunks, std::int64_t sink,
                                                  std::int64_t rope_dims, std::string budget,
                                                  std::vector<double> budget_args, double scale,
                                                  c10::optional<c10::Device> device,
                                                  c10::optional<at::ScalarType> dtype) {
  const at::ScalarType storage = check_storage(dtype, "kvm_layout", true);
  const kvm::Problem pr{make_params(chunk, window_chunks, sink, rope_dims, budget, budget_args, scale),
                        {max_slots, q_heads, kv_heads, head_dim, value_dim, n_ctx}};
  if (const DeviceBackend* b = device_backend(device, "kvm_layout")) return b->kvm_layout(pr, storage);
  if (!kvm::validate(pr.params, pr.shape).is_ok()) return {0, 0};
  return with_storage<false>(storage, [&]<class S>() -> std::tuple<std::int64_t, std::int64_t> {
    return {static_cast<std::int64_t>(kvm::state_bytes<S, float>(pr)),
            static_cast<std::int64_t>(kvm::workspace_bytes<S, float>(pr))};
  });
}

Holder kvm_place(const at::Tensor& memory, const at::Tensor& workspace, std::int64_t max_slots, std::int64_t q_heads,
                 std::int64_t kv_heads, std::int64_t head_dim, std::int64_t value_dim, std::int64_t n_ctx,
                 std::int64_t chunk, std::int64_t window_chunks, std::int64_t sink, std::int64_t rope_dims,
                 std::string budget, std::vector<double> budget_args, double scale,
                 c10::optional<at::ScalarType> dtype) {
  constexpr const char* op = "kvm_place";
  check_memory(memory, op, "memory", kCpu);
  check_memory(workspace, op, "workspace", kCpu);
  const at::ScalarType storage = check_storage(dtype, op, true);
  const kvm::Problem pr{make_params(chunk, window_chunks, sink, rope_dims, budget, budget_args, scale),
                        {max_slots, q_heads, kv_heads, head_dim, value_dim, n_ctx}};
  return with_storage<false>(storage, [&]<class S>() {
    KvmStateOf<S> s;
    check(KvmStateOf<S>::place(memory.data_ptr(), static_cast<std::size_t>(memory.numel()), pr, s));
    check(s.attach_workspace(workspace.data_ptr(), static_cast<std::size_t>(workspace.numel())));
    return c10::make_intrusive<StateHolder>(std::move(s), memory, workspace);
  });
}

// (cache bytes, workspace bytes) of a UA cache placed by ua_place; (0, 0) for an invalid shape.
std::tuple<std::int64_t, std::int64_t> ua_layout(std::int64_t max_slots, std::int64_t q_heads, std::int64_t kv_heads,
                                                 std::int64_t head_dim, std::int64_t capacity,
                                                 c10::optional<c10::Device> device,
                                                 c10::optional<at::ScalarType> dtype) {
  const at::ScalarType storage = check_storage(dtype, "ua_layout", false);
  const ua::CacheShape shape{max_slots, q_heads, kv_heads, head_dim, capacity};
  if (const DeviceBackend* b = device_backend(device, "ua_layout")) return b->ua_layout(shape, storage);
  return with_storage<true>(storage, [&]<class S>() -> std::tuple<std::int64_t, std::int64_t> {
    if (!UaCacheOf<S>::validate_shape(shape).is_ok()) return {0, 0};
    return {static_cast<std::int64_t>(ua::cache_layout<S>(shape).bytes),
            static_cast<std::int64_t>(ua::workspace_bytes<S>(shape))};
  });
}

Holder ua_place(const at::Tensor& memory, const at::Tensor& workspace, std::int64_t max_slots, std::int64_t q_heads,
                std::int64_t kv_heads, std::int64_t head_dim, std::int64_t capacity,
                c10::optional<at::ScalarType> dtype) {
  constexpr const char* op = "ua_place";
  check_memory(memory, op, "memory", kCpu);
  check_memory(workspace, op, "workspace", kCpu);
  const at::ScalarType storage = check_storage(dtype, op, false);
  return with_storage<true>(storage, [&]<class S>() {
    UaCacheOf<S> c;
    check(UaCacheOf<S>::place(memory.data_ptr(), static_cast<std::size_t>(memory.numel()),
                              {max_slots, q_heads, kv_heads, head_dim, capacity}, c));
    check(c.attach_workspace(workspace.data_ptr(), static_cast<std::size_t>(workspace.numel())));
    return c10::make_intrusive<StateHolder>(std::move(c), memory, workspace);
  });
}

// ---- steps -----------------------------------------------------------------------------------------

// (heads, value dim) of a step's outputs for the Meta kernels, which serve states on every device.
std::pair<std::int64_t, std::int64_t> meta_dims(const Holder& h, const char* op, bool kvm) {
  TORCH_CHECK_VALUE(h, op, ": state is None");
  TORCH_CHECK_VALUE(h->is_kvm() == kvm, op, ": expected a ",
                    kvm ? "KV Means state (kvm_create)" : "Universal Attention cache (ua_create)", ", got a ",
                    h->mechanism(), " state");
  return h->out_dims();
}

std::tuple<at::Tensor, at::Tensor> kvm_step(const Holder& h, const std::vector<at::Tensor>& weights,
                                            const at::Tensor& slot, const at::Tensor& query_start, const at::Tensor& q,
                                            const at::Tensor& k, const at::Tensor& v, const at::Tensor& gate,
                                            bool exact, bool /*wait*/, std::int64_t max_query_len) {
  constexpr const char* op = "kvm_step";
  return with_kvm_state(h, op, [&]<class S>(KvmStateOf<S>& state) -> std::tuple<at::Tensor, at::Tensor> {
    const KvmWeightTensors w(weights, op, kCpu);
    const auto& sh = state.shape();
    KvmStepTensors t(slot, query_start, q, k, v, gate, sh.Hq, sh.Dv, op, kCpu, dtype_of<S>());
    t.to_float();
    const auto [qv, kv, vv, gv, ov] = t.views<float>();
    check(kvm::step(executor(exact), state, w.get(), t.rows.rows(max_query_len), qv, kv, vv, gv, ov,
                    view<float, 2>(t.lse)));
    return t.result();
  });
}

std::tuple<at::Tensor, at::Tensor> kvm_step_meta(const Holder& h, const std::vector<at::Tensor>& /*weights*/,
                                                 const at::Tensor& /*slot*/, const at::Tensor& /*query_start*/,
                                                 const at::Tensor& q, const at::Tensor& /*k*/, const at::Tensor& /*v*/,
                                                 const at::Tensor& /*gate*/, bool /*exact*/, bool /*wait*/,
                                                 std::int64_t /*max_query_len*/) {
  const auto [heads, dim] = meta_dims(h, "kvm_step", true);
  return {at::empty({q.size(0), heads, dim}, q.options()),
          at::empty({q.size(0), heads}, q.options().dtype(at::kFloat))};
}

std::tuple<at::Tensor, at::Tensor> ua_step(const Holder& h, const at::Tensor& slot, const at::Tensor& query_start,
                                           const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                           const at::Tensor& z_k, const at::Tensor& z_q,
                                           const c10::optional<at::Tensor>& z_o, double p, std::int64_t prefill_chunk,
                                           bool evict_before_attention, bool /*wait*/, std::int64_t max_query_len) {
  constexpr const char* op = "ua_step";
  return with_ua_cache(h, op, [&]<class S>(UaCacheOf<S>& cache) {
    UaStepTensors t(slot, query_start, q, k, v, z_k, z_q, z_o, cache.shape(), op, kCpu, dtype_of<S>());
    t.inputs_to_float();
    const ua::Options opt{p, prefill_chunk, evict_before_attention};
    check(ua::step(executor(), cache, t.rows.rows(max_query_len), t.inputs<float>(), opt, view<float, 3>(t.out),
                   view<float, 2>(t.lse)));
    return t.result();
  });
}

std::tuple<at::Tensor, at::Tensor> ua_step_meta(const Holder& h, const at::Tensor& /*slot*/,
                                                const at::Tensor& /*query_start*/, const at::Tensor& q,
                                                const at::Tensor& /*k*/, const at::Tensor& /*v*/,
                                                const at::Tensor& /*z_k*/, const at::Tensor& /*z_q*/,
                                                const c10::optional<at::Tensor>& /*z_o*/, double /*p*/,
                                                std::int64_t /*prefill_chunk*/, bool /*evict_before_attention*/,
                                                bool /*wait*/, std::int64_t /*max_query_len*/) {
  const auto [heads, dim] = meta_dims(h, "ua_step", false);
  return {at::empty({q.size(0), heads, dim}, q.options()),
          at::empty({q.size(0), heads}, q.options().dtype(at::kFloat))};
}

// ---- slot operations (the same names and argument order for both mechanisms) -----------------------

void reset_slots(const Holder& h, const at::Tensor& slots) {
  constexpr const char* op = "reset_slots";
  host_state(h, op);
  const at::Tensor s = slot_list(slots, op, "slots", kCpu);
  const auto list = view<const std::int32_t, 1>(s);
  h->visit_host([&](auto& st) {
    if constexpr (is_kvm_state_v<std::decay_t<decltype(st)>>)
      check(kvm::reset_slots(executor(), st, list));
    else
      check(ua::reset_slots(executor(), st, list));
  });
}

void copy_slots(const Holder& h, const at::Tensor& src, const at::Tensor& dst) {
  constexpr const char* op = "copy_slots";
  host_state(h, op);
  const at::Tensor s = slot_list(src, op, "src", kCpu), d = slot_list(dst, op, "dst", kCpu);
  const auto a = view<const std::int32_t, 1>(s), b = view<const std::int32_t, 1>(d);
  h->visit_host([&](auto& st) {
    if constexpr (is_kvm_state_v<std::decay_t<decltype(st)>>)
      check(kvm::copy_slots(executor(), st, a, b));
    else
      check(ua::copy_slots(executor(), st, a, b));
  });
}

void slot_op_meta(const Holder& /*h*/, const at::Tensor& /*slots*/) {}
void copy_slots_meta(const Holder& /*h*/, const at::Tensor& /*src*/, const at::Tensor& /*dst*/) {}

// The ops below take no tensor arguments (or only a record), so they run here for states on every
// device; a device state answers through its backend.

std::int64_t export_bytes(const Holder& h, std::int64_t slot) {
  TORCH_CHECK_VALUE(h, "export_bytes: state is None");
  if (slot < 0 || slot >= h->max_slots()) return 0;
  if (DeviceState* d = h->on_device()) return d->export_bytes(slot);
  return h->visit_host([&](const auto& st) -> std::int64_t {
    if constexpr (is_kvm_state_v<std::decay_t<decltype(st)>>)
      return static_cast<std::int64_t>(kvm::export_bytes(st, static_cast<std::int32_t>(slot)));
    else
      return static_cast<std::int64_t>(ua::export_bytes(st, static_cast<std::int32_t>(slot)));
  });
}

// The record of `slot` as a uint8 CPU tensor of export_bytes(state, slot) bytes (records are host bytes
// on every backend).
at::Tensor export_slot(const Holder& h, std::int64_t slot) {
  TORCH_CHECK_VALUE(h, "export_slot: state is None");
  TORCH_CHECK_INDEX(slot >= 0 && slot < h->max_slots(),
                    "kvmem: export_slot slot: expected 0 <= slot < max_slots = ", h->max_slots(), ", got ", slot);
  if (DeviceState* d = h->on_device()) return d->export_slot(slot);
  at::Tensor bytes = at::empty({export_bytes(h, slot)}, at::TensorOptions().dtype(at::kByte));
  const std::span<std::byte> span(static_cast<std::byte*>(bytes.data_ptr()), static_cast<std::size_t>(bytes.numel()));
  h->visit_host([&](const auto& st) {
    if constexpr (is_kvm_state_v<std::decay_t<decltype(st)>>)
      check(kvm::export_slot(executor(), st, static_cast<std::int32_t>(slot), span));
    else
      check(ua::export_slot(executor(), st, static_cast<std::int32_t>(slot), span));
  });
  return bytes;
}

// weights: KVM's four learned tensors (the readout copies are rebuilt with them); empty for UA. A
// device state reaches this CPU kernel when its record is a CPU tensor and no weight is on the device
// (UA, or KVM weights on the wrong device, which its backend refuses).
void import_slot(const Holder& h, const std::vector<at::Tensor>& weights, std::int64_t slot, const at::Tensor& bytes) {
  constexpr const char* op = "import_slot";
  TORCH_CHECK_VALUE(h, op, ": state is None");
  if (DeviceState* d = h->on_device()) return d->import_slot(weights, slot, bytes);
  check_tensor(bytes, op, "bytes", at::kByte, 1, kCpu);
  const at::Tensor b = bytes.contiguous();
  TORCH_CHECK_INDEX(slot >= 0 && slot < h->max_slots(),
                    "kvmem: import_slot slot: expected 0 <= slot < max_slots = ", h->max_slots(), ", got ", slot);
  const std::span<const std::byte> span(static_cast<const std::byte*>(b.data_ptr()),
                                        static_cast<std::size_t>(b.numel()));
  h->visit_host([&](auto& st) {
    if constexpr (is_kvm_state_v<std::decay_t<decltype(st)>>) {
      const KvmWeightTensors w(weights, op, kCpu);
      check(kvm::import_slot(executor(), st, w.get(), static_cast<std::int32_t>(slot), span));
    } else {
      TORCH_CHECK_VALUE(weights.empty(), op, ": weights: expected none for a Universal Attention cache, got ",
                        weights.size(), " tensors");
      check(ua::import_slot(executor(), st, static_cast<std::int32_t>(slot), span));
    }
  });
}

void import_slot_meta(const Holder& /*h*/, const std::vector<at::Tensor>& /*weights*/, std::int64_t /*slot*/,
                      const at::Tensor& /*bytes*/) {}

void truncate(const Holder& h, std::int64_t slot, std::int64_t n) {
  TORCH_CHECK_VALUE(h, "truncate: state is None");
  TORCH_CHECK_INDEX(slot >= 0 && slot < h->max_slots(),
                    "kvmem: truncate slot: expected 0 <= slot < max_slots = ", h->max_slots(), ", got ", slot);
  if (DeviceState* d = h->on_device()) return d->truncate(slot, n);
  h->visit_host([&](auto& st) {
    if constexpr (is_kvm_state_v<std::decay_t<decltype(st)>>)
      check(kvm::truncate(executor(), st, static_cast<std::int32_t>(slot), n));
    else
      check(ua::truncate(executor(), st, static_cast<std::int32_t>(slot), n));
  });
}

// What a device refused since the last check: the host backend refuses a call when it is made, so a
// CPU state has nothing to report.
void step_status(const Holder& h) {
  TORCH_CHECK_VALUE(h, "step_status: state is None");
  if (DeviceState* d = h->on_device()) d->step_status();
}

// Bytes a KVM state of this configuration allocates (0 when the configuration is invalid).
std::int64_t kvm_state_bytes(std::int64_t max_slots, std::int64_t q_heads, std::int64_t kv_heads, std::int64_t head_dim,
                             std::int64_t value_dim, std::int64_t n_ctx, std::int64_t chunk, std::int64_t window_chunks,
                             std::int64_t sink, std::int64_t rope_dims, std::string budget,
                             std::vector<double> budget_args, double scale, c10::optional<c10::Device> device,
                             c10::optional<at::ScalarType> dtype) {
  const at::ScalarType storage = check_storage(dtype, "kvm_state_bytes", true);
  const kvm::Problem pr{make_params(chunk, window_chunks, sink, rope_dims, budget, budget_args, scale),
                        {max_slots, q_heads, kv_heads, head_dim, value_dim, n_ctx}};
  if (const DeviceBackend* b = device_backend(device, "kvm_state_bytes")) return b->kvm_state_bytes(pr, storage);
  return with_storage<false>(storage, [&]<class S>() {
    return static_cast<std::int64_t>(KvmStateOf<S>::bytes_required(pr.params, pr.shape));
  });
}

std::int64_t allocated_bytes(const Holder& h) {
  if (const DeviceState* d = h->on_device()) return d->allocated_bytes();
  return h->visit_host([](const auto& st) -> std::int64_t {
    using T = std::decay_t<decltype(st)>;
    if constexpr (is_kvm_state_v<T>) {
      return static_cast<std::int64_t>(st.allocated_bytes());
    } else {
      const auto& s = st.shape();
      // keys and values (storage type), λ and key-gate logit (fp32), position (int64) per row
      return s.batch * s.kv_heads * s.capacity * (2 * s.head_dim * std::int64_t(sizeof(typename T::storage_type)) + 16);
    }
  });
}

}  // namespace
}  // namespace kvmem::torch_ops

namespace ops = kvmem::torch_ops;

TORCH_LIBRARY(kvmem, m) {
  m.class_<ops::StateHolder>("State")
      .def("mechanism", [](const ops::Holder& h) { return h->mechanism(); })
      .def("max_slots", [](const ops::Holder& h) { return h->max_slots(); })
      .def("tokens", [](const ops::Holder& h, std::int64_t slot) { return h->tokens(slot); })
      .def("device", [](const ops::Holder& h) { return h->device().str(); })
      .def("dtype", [](const ops::Holder& h) { return std::string(c10::toString(h->dtype())); })
      .def("allocated_bytes", [](const ops::Holder& h) { return ops::allocated_bytes(h); })
      .def("export_bytes", [](const ops::Holder& h, std::int64_t slot) { return ops::export_bytes(h, slot); });

  // Ops without tensor arguments run on every dispatch key (catch-all). `device` (None = the CPU) picks
  // the backend of a state kvm_create / ua_create make, and of the sizes the size queries answer.
  m.def(
      "kvm_create(int max_slots, int q_heads, int kv_heads, int head_dim, int value_dim, int n_ctx, "
      "int chunk=256, int window_chunks=2, int sink=1, int rope_dims=64, str budget=\"fixed\", "
      "float[] budget_args=[], float scale=0., Device? device=None, ScalarType? dtype=None) -> "
      "__torch__.torch.classes.kvmem.State",
      &ops::kvm_create);
  m.def(
      "kvm_state_bytes(int max_slots, int q_heads, int kv_heads, int head_dim, int value_dim, int n_ctx, "
      "int chunk=256, int window_chunks=2, int sink=1, int rope_dims=64, str budget=\"fixed\", "
      "float[] budget_args=[], float scale=0., Device? device=None, ScalarType? dtype=None) -> int",
      &ops::kvm_state_bytes);
  m.def(
      "ua_create(int max_slots, int q_heads, int kv_heads, int head_dim, int capacity, Device? device=None, "
      "ScalarType? dtype=None) -> __torch__.torch.classes.kvmem.State",
      &ops::ua_create);
  m.def(
      "kvm_layout(int max_slots, int q_heads, int kv_heads, int head_dim, int value_dim, int n_ctx, "
      "int chunk=256, int window_chunks=2, int sink=1, int rope_dims=64, str budget=\"fixed\", "
      "float[] budget_args=[], float scale=0., Device? device=None, ScalarType? dtype=None) -> (int, int)",
      &ops::kvm_layout);
  m.def(
      "ua_layout(int max_slots, int q_heads, int kv_heads, int head_dim, int capacity, Device? device=None, "
      "ScalarType? dtype=None) -> (int, int)",
      &ops::ua_layout);
  m.def("export_slot(__torch__.torch.classes.kvmem.State state, int slot) -> Tensor", &ops::export_slot);
  m.def("truncate(__torch__.torch.classes.kvmem.State state, int slot, int n) -> ()", &ops::truncate);
  m.def("step_status(__torch__.torch.classes.kvmem.State state) -> ()", &ops::step_status);

  // Ops with tensor arguments: a CPU kernel (the host backend), a Meta kernel (shapes only) and, when
  // built with it, a CUDA kernel (ops_cuda.cu).
  m.def(
      "kvm_step(__torch__.torch.classes.kvmem.State state, Tensor[] weights, Tensor slot, Tensor query_start, "
      "Tensor q, Tensor k, Tensor v, Tensor gate, bool exact=False, bool wait=True, int max_query_len=0) -> "
      "(Tensor out, Tensor lse)");
  m.def(
      "ua_step(__torch__.torch.classes.kvmem.State state, Tensor slot, Tensor query_start, Tensor q, Tensor k, "
      "Tensor v, Tensor z_k, Tensor z_q, Tensor? z_o=None, float p=0., int prefill_chunk=128, "
      "bool evict_before_attention=True, bool wait=True, int max_query_len=0) -> (Tensor out, Tensor lse)");
  m.def("reset_slots(__torch__.torch.classes.kvmem.State state, Tensor slots) -> ()");
  m.def("copy_slots(__torch__.torch.classes.kvmem.State state, Tensor src, Tensor dst) -> ()");
  m.def("import_slot(__torch__.torch.classes.kvmem.State state, Tensor[] weights, int slot, Tensor bytes) -> ()");
  m.def(
      "kvm_place(Tensor memory, Tensor workspace, int max_slots, int q_heads, int kv_heads, int head_dim, "
      "int value_dim, int n_ctx, int chunk=256, int window_chunks=2, int sink=1, int rope_dims=64, "
      "str budget=\"fixed\", float[] budget_args=[], float scale=0., ScalarType? dtype=None) -> "
      "__torch__.torch.classes.kvmem.State");
  m.def(
      "ua_place(Tensor memory, Tensor workspace, int max_slots, int q_heads, int kv_heads, int head_dim, "
      "int capacity, ScalarType? dtype=None) -> __torch__.torch.classes.kvmem.State");
}

TORCH_LIBRARY_IMPL(kvmem, CPU, m) {
  m.impl("kvm_step", &ops::kvm_step);
  m.impl("ua_step", &ops::ua_step);
  m.impl("reset_slots", &ops::reset_slots);
  m.impl("copy_slots", &ops::copy_slots);
  m.impl("import_slot", &ops::import_slot);
  m.impl("kvm_place", &ops::kvm_place);
  m.impl("ua_place", &ops::ua_place);
}

TORCH_LIBRARY_IMPL(kvmem, Meta, m) {
  m.impl("kvm_step", &ops::kvm_step_meta);
  m.impl("ua_step", &ops::ua_step_meta);
  m.impl("reset_slots", &ops::slot_op_meta);
  m.impl("copy_slots", &ops::copy_slots_meta);
  m.impl("import_slot", &ops::import_slot_meta);
}

// torch 1.13 has no autograd fallthrough for the Meta key; these ops have no backward, so autograd
// passes straight to the Meta kernels.
TORCH_LIBRARY_IMPL(kvmem, AutogradMeta, m) {
  for (const char* op : {"kvm_step", "ua_step", "reset_slots", "copy_slots", "import_slot"})
    m.impl(op, torch::CppFunction::makeFallthrough());
}
