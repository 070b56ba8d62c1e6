// SPDX-License-Identifier: Apache-2.0
// kvmem's PyTorch custom ops (torch.ops.kvmem.*): the host backend's sequence-slot API over CPU
// tensors. Inputs are packed token-major, as in docs/slots.md: q [tokens, Hq, D], k [tokens, Hk, D],
// v [tokens, Hk, Dv], gates [tokens, Hk]; slot [rows] and query_start [rows + 1] are int32. Each op
// checks dtype and device, then calls the kvmem function of the same name; a refused call raises with
// kvmem's Status message (ValueError for invalid arguments, IndexError for indices out of range,
// RuntimeError otherwise) and leaves the state unchanged.
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

#include "kvmem/backend/host/kvm.hpp"
#include "kvmem/backend/host/ua.hpp"
#include "kvmem/kvm/attention.hpp"
#include "kvmem/kvm/record.hpp"
#include "kvmem/ua/ops.hpp"
#include "kvmem/ua/slots.hpp"
#include "state.hpp"

namespace kvmem::torch_ops {
namespace {

// Raises a Python exception carrying the Status message; the exception type follows the code.
void check(const Status& st) {
  if (st.is_ok()) return;
  switch (st.code()) {
    case StatusCode::kInvalidArgument:
      TORCH_CHECK_VALUE(false, "kvmem: ", st.to_string());
    case StatusCode::kOutOfRange:
      TORCH_CHECK_INDEX(false, "kvmem: ", st.to_string());
    default:
      TORCH_CHECK(false, "kvmem: ", st.to_string());
  }
}

host::Executor executor(bool exact = false) {
  return host::Executor{.threads = at::get_num_threads(), .exact = exact};
}

void check_tensor(const at::Tensor& t, const char* op, const char* name, at::ScalarType dtype, std::int64_t dim) {
  TORCH_CHECK_VALUE(t.defined(), op, ": ", name, " is undefined");
  TORCH_CHECK_VALUE(t.device().is_cpu(), op, ": ", name, ": expected a CPU tensor, got device ", t.device());
  TORCH_CHECK_VALUE(t.scalar_type() == dtype, op, ": ", name, ": expected dtype ", dtype, ", got ", t.scalar_type());
  TORCH_CHECK_VALUE(t.dim() == dim, op, ": ", name, ": expected ", dim, " dimensions, got shape ", t.sizes());
}

template <class T, std::size_t R>
TensorView<T, R> view(const at::Tensor& t) {
  std::array<std::int64_t, R> ext{};
  for (std::size_t i = 0; i < R; ++i) ext[i] = t.size(static_cast<std::int64_t>(i));
  return TensorView<T, R>(static_cast<T*>(t.data_ptr()), ext);
}

// The row batch of a step (int32 slot [rows], query_start [rows + 1]), contiguous.
struct RowTensors {
  at::Tensor slot, query_start;
  RowTensors(const at::Tensor& s, const at::Tensor& qs, const char* op) {
    check_tensor(s, op, "slot", at::kInt, 1);
    check_tensor(qs, op, "query_start", at::kInt, 1);
    slot = s.contiguous();
    query_start = qs.contiguous();
  }
  [[nodiscard]] Rows rows() const {
    return {view<const std::int32_t, 1>(slot), view<const std::int32_t, 1>(query_start)};
  }
};

at::Tensor float_input(const at::Tensor& t, const char* op, const char* name, std::int64_t dim) {
  check_tensor(t, op, name, at::kFloat, dim);
  return t.contiguous();
}

// kvm::Weights from [ln_weight [D], ln_bias [D], tau_state [Hq], tau_bswa [Hq]].
struct KvmWeightTensors {
  std::vector<at::Tensor> w;
  KvmWeightTensors(const std::vector<at::Tensor>& weights, const char* op) {
    TORCH_CHECK_VALUE(weights.size() == 4, op,
                      ": weights: expected 4 tensors [ln_weight, ln_bias, tau_state, tau_bswa], got ", weights.size());
    const char* names[4] = {"ln_weight", "ln_bias", "tau_state", "tau_bswa"};
    for (std::size_t i = 0; i < 4; ++i) w.push_back(float_input(weights[i], op, names[i], 1));
  }
  [[nodiscard]] kvm::Weights get() const {
    return {view<const float, 1>(w[0]), view<const float, 1>(w[1]), view<const float, 1>(w[2]),
            view<const float, 1>(w[3])};
  }
};

// ---- create ----------------------------------------------------------------------------------------

budget::Any parse_budget(const std::string& kind, const std::vector<double>& a) {
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

kvm::Params make_params(std::int64_t chunk, std::int64_t window_chunks, std::int64_t sink, std::int64_t rope_dims,
                        const std::string& budget, const std::vector<double>& budget_args, double scale) {
  kvm::Params p;
  p.chunk = chunk;
  p.window_chunks = window_chunks;
  p.sink = sink;
  p.rope_dims = rope_dims;
  p.budget = parse_budget(budget, budget_args);
  p.scale = scale;
  return p;
}

Holder kvm_create(std::int64_t max_slots, std::int64_t q_heads, std::int64_t kv_heads, std::int64_t head_dim,
                  std::int64_t value_dim, std::int64_t n_ctx, std::int64_t chunk, std::int64_t window_chunks,
                  std::int64_t sink, std::int64_t rope_dims, std::string budget, std::vector<double> budget_args,
                  double scale) {
  KvmState s;
  check(KvmState::create(make_params(chunk, window_chunks, sink, rope_dims, budget, budget_args, scale),
                         {max_slots, q_heads, kv_heads, head_dim, value_dim, n_ctx}, s));
  return c10::make_intrusive<StateHolder>(std::move(s));
}

Holder ua_create(std::int64_t max_slots, std::int64_t q_heads, std::int64_t kv_heads, std::int64_t head_dim,
                 std::int64_t capacity) {
  UaCache c;
  check(UaCache::create({max_slots, q_heads, kv_heads, head_dim, capacity}, c));
  return c10::make_intrusive<StateHolder>(std::move(c));
}

// ---- placed over caller tensors (docs/memory.md) ---------------------------------------------------

// A uint8 CPU tensor whose storage a state or workspace is placed over: one dimension, contiguous. Its
// size and 64-byte alignment are kvmem's checks (State::place, attach_workspace).
void check_memory(const at::Tensor& t, const char* op, const char* name) {
  check_tensor(t, op, name, at::kByte, 1);
  TORCH_CHECK_VALUE(t.is_contiguous(), op, ": ", name, ": expected a contiguous tensor");
}

// (state bytes, workspace bytes) of a KVM state placed by kvm_place: the tensors an engine allocates,
// each 64-byte aligned (torch's CPU allocations are). (0, 0) when the configuration is invalid.
std::tuple<std::int64_t, std::int64_t> kvm_layout(std::int64_t max_slots, std::int64_t q_heads, std::int64_t kv_heads,
                                                  std::int64_t head_dim, std::int64_t value_dim, std::int64_t n_ctx,
                                                  std::int64_t chunk, std::int64_t window_chunks, std::int64_t sink,
                                                  std::int64_t rope_dims, std::string budget,
                                                  std::vector<double> budget_args, double scale) {
  const kvm::Problem pr{make_params(chunk, window_chunks, sink, rope_dims, budget, budget_args, scale),
                        {max_slots, q_heads, kv_heads, head_dim, value_dim, n_ctx}};
  if (!kvm::validate(pr.params, pr.shape).is_ok()) return {0, 0};
  return {static_cast<std::int64_t>(kvm::state_bytes<float, float>(pr)),
          static_cast<std::int64_t>(kvm::workspace_bytes<float, float>(pr))};
}

Holder kvm_place(const at::Tensor& memory, const at::Tensor& workspace, std::int64_t max_slots, std::int64_t q_heads,
                 std::int64_t kv_heads, std::int64_t head_dim, std::int64_t value_dim, std::int64_t n_ctx,
                 std::int64_t chunk, std::int64_t window_chunks, std::int64_t sink, std::int64_t rope_dims,
                 std::string budget, std::vector<double> budget_args, double scale) {
  constexpr const char* op = "kvm_place";
  check_memory(memory, op, "memory");
  check_memory(workspace, op, "workspace");
  const kvm::Problem pr{make_params(chunk, window_chunks, sink, rope_dims, budget, budget_args, scale),
                        {max_slots, q_heads, kv_heads, head_dim, value_dim, n_ctx}};
  KvmState s;
  check(KvmState::place(memory.data_ptr(), static_cast<std::size_t>(memory.numel()), pr, s));
  check(s.attach_workspace(workspace.data_ptr(), static_cast<std::size_t>(workspace.numel())));
  return c10::make_intrusive<StateHolder>(std::move(s), memory, workspace);
}

// (cache bytes, workspace bytes) of a UA cache placed by ua_place; (0, 0) for an invalid shape.
std::tuple<std::int64_t, std::int64_t> ua_layout(std::int64_t max_slots, std::int64_t q_heads, std::int64_t kv_heads,
                                                 std::int64_t head_dim, std::int64_t capacity) {
  const ua::CacheShape shape{max_slots, q_heads, kv_heads, head_dim, capacity};
  if (!UaCache::validate_shape(shape).is_ok()) return {0, 0};
  return {static_cast<std::int64_t>(ua::cache_layout<float>(shape).bytes),
          static_cast<std::int64_t>(ua::workspace_bytes<float>(shape))};
}

Holder ua_place(const at::Tensor& memory, const at::Tensor& workspace, std::int64_t max_slots, std::int64_t q_heads,
                std::int64_t kv_heads, std::int64_t head_dim, std::int64_t capacity) {
  constexpr const char* op = "ua_place";
  check_memory(memory, op, "memory");
  check_memory(workspace, op, "workspace");
  UaCache c;
  check(UaCache::place(memory.data_ptr(), static_cast<std::size_t>(memory.numel()),
                       {max_slots, q_heads, kv_heads, head_dim, capacity}, c));
  check(c.attach_workspace(workspace.data_ptr(), static_cast<std::size_t>(workspace.numel())));
  return c10::make_intrusive<StateHolder>(std::move(c), memory, workspace);
}

// ---- steps -----------------------------------------------------------------------------------------

std::tuple<at::Tensor, at::Tensor> kvm_step(const Holder& h, const std::vector<at::Tensor>& weights,
                                            const at::Tensor& slot, const at::Tensor& query_start, const at::Tensor& q,
                                            const at::Tensor& k, const at::Tensor& v, const at::Tensor& gate,
                                            bool exact) {
  constexpr const char* op = "kvm_step";
  KvmState& state = kvm_state(h, op);
  const KvmWeightTensors w(weights, op);
  const RowTensors rows(slot, query_start, op);
  const at::Tensor qc = float_input(q, op, "q", 3), kc = float_input(k, op, "k", 3), vc = float_input(v, op, "v", 3);
  const at::Tensor gc = float_input(gate, op, "gate", 2);
  const auto& sh = state.shape();
  const std::int64_t tokens = qc.size(0);
  at::Tensor out = at::empty({tokens, sh.Hq, sh.Dv}, qc.options());
  at::Tensor lse = at::empty({tokens, sh.Hq}, qc.options());
  check(kvm::step(executor(exact), state, w.get(), rows.rows(), view<const float, 3>(qc), view<const float, 3>(kc),
                  view<const float, 3>(vc), view<const float, 2>(gc), view<float, 3>(out), view<float, 2>(lse)));
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor> kvm_step_meta(const Holder& h, const std::vector<at::Tensor>& /*weights*/,
                                                 const at::Tensor& /*slot*/, const at::Tensor& /*query_start*/,
                                                 const at::Tensor& q, const at::Tensor& /*k*/, const at::Tensor& /*v*/,
                                                 const at::Tensor& /*gate*/, bool /*exact*/) {
  const auto& sh = kvm_state(h, "kvm_step").shape();
  return {at::empty({q.size(0), sh.Hq, sh.Dv}, q.options()), at::empty({q.size(0), sh.Hq}, q.options())};
}

std::tuple<at::Tensor, at::Tensor> ua_step(const Holder& h, const at::Tensor& slot, const at::Tensor& query_start,
                                           const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                           const at::Tensor& z_k, const at::Tensor& z_q,
                                           const c10::optional<at::Tensor>& z_o, double p, std::int64_t prefill_chunk,
                                           bool evict_before_attention) {
  constexpr const char* op = "ua_step";
  UaCache& cache = ua_cache(h, op);
  const RowTensors rows(slot, query_start, op);
  const at::Tensor qc = float_input(q, op, "q", 3), kc = float_input(k, op, "k", 3), vc = float_input(v, op, "v", 3);
  const at::Tensor zk = float_input(z_k, op, "z_k", 2), zq = float_input(z_q, op, "z_q", 2);
  at::Tensor zo;
  if (z_o.has_value() && z_o->defined()) zo = float_input(*z_o, op, "z_o", 3);
  const auto& s = cache.shape();
  const std::int64_t tokens = qc.size(0);
  at::Tensor out = at::empty({tokens, s.query_heads, s.head_dim}, qc.options());
  at::Tensor lse = at::empty({tokens, s.query_heads}, qc.options());
  const ua::PackedInputs in{
      view<const float, 3>(qc), view<const float, 3>(kc),
      view<const float, 3>(vc), view<const float, 2>(zk),
      view<const float, 2>(zq), zo.defined() ? view<const float, 3>(zo) : TensorView<const float, 3>{}};
  const ua::Options opt{p, prefill_chunk, evict_before_attention};
  check(ua::step(executor(), cache, rows.rows(), in, opt, view<float, 3>(out), view<float, 2>(lse)));
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor> ua_step_meta(const Holder& h, const at::Tensor& /*slot*/,
                                                const at::Tensor& /*query_start*/, const at::Tensor& q,
                                                const at::Tensor& /*k*/, const at::Tensor& /*v*/,
                                                const at::Tensor& /*z_k*/, const at::Tensor& /*z_q*/,
                                                const c10::optional<at::Tensor>& /*z_o*/, double /*p*/,
                                                std::int64_t /*prefill_chunk*/, bool /*evict_before_attention*/) {
  const auto& s = ua_cache(h, "ua_step").shape();
  return {at::empty({q.size(0), s.query_heads, s.head_dim}, q.options()),
          at::empty({q.size(0), s.query_heads}, q.options())};
}

// ---- slot operations (the same names and argument order for both mechanisms) -----------------------

at::Tensor slot_list(const at::Tensor& t, const char* op, const char* name) {
  check_tensor(t, op, name, at::kInt, 1);
  return t.contiguous();
}

void reset_slots(const Holder& h, const at::Tensor& slots) {
  TORCH_CHECK_VALUE(h, "reset_slots: state is None");
  const at::Tensor s = slot_list(slots, "reset_slots", "slots");
  const auto list = view<const std::int32_t, 1>(s);
  if (auto* k = std::get_if<KvmState>(&h->state))
    check(kvm::reset_slots(executor(), *k, list));
  else
    check(ua::reset_slots(executor(), std::get<UaCache>(h->state), list));
}

void copy_slots(const Holder& h, const at::Tensor& src, const at::Tensor& dst) {
  TORCH_CHECK_VALUE(h, "copy_slots: state is None");
  const at::Tensor s = slot_list(src, "copy_slots", "src"), d = slot_list(dst, "copy_slots", "dst");
  const auto a = view<const std::int32_t, 1>(s), b = view<const std::int32_t, 1>(d);
  if (auto* k = std::get_if<KvmState>(&h->state))
    check(kvm::copy_slots(executor(), *k, a, b));
  else
    check(ua::copy_slots(executor(), std::get<UaCache>(h->state), a, b));
}

void slot_op_meta(const Holder& /*h*/, const at::Tensor& /*slots*/) {}
void copy_slots_meta(const Holder& /*h*/, const at::Tensor& /*src*/, const at::Tensor& /*dst*/) {}

std::int64_t export_bytes(const Holder& h, std::int64_t slot) {
  TORCH_CHECK_VALUE(h, "export_bytes: state is None");
  if (slot < 0 || slot >= h->max_slots()) return 0;
  if (const auto* k = std::get_if<KvmState>(&h->state))
    return static_cast<std::int64_t>(kvm::export_bytes(*k, static_cast<std::int32_t>(slot)));
  return static_cast<std::int64_t>(ua::export_bytes(std::get<UaCache>(h->state), static_cast<std::int32_t>(slot)));
}

// The record of `slot` as a uint8 tensor of export_bytes(state, slot) bytes.
at::Tensor export_slot(const Holder& h, std::int64_t slot) {
  TORCH_CHECK_VALUE(h, "export_slot: state is None");
  TORCH_CHECK_INDEX(slot >= 0 && slot < h->max_slots(),
                    "kvmem: export_slot slot: expected 0 <= slot < max_slots = ", h->max_slots(), ", got ", slot);
  at::Tensor bytes = at::empty({export_bytes(h, slot)}, at::TensorOptions().dtype(at::kByte));
  const std::span<std::byte> span(static_cast<std::byte*>(bytes.data_ptr()), static_cast<std::size_t>(bytes.numel()));
  if (const auto* k = std::get_if<KvmState>(&h->state))
    check(kvm::export_slot(executor(), *k, static_cast<std::int32_t>(slot), span));
  else
    check(ua::export_slot(executor(), std::get<UaCache>(h->state), static_cast<std::int32_t>(slot), span));
  return bytes;
}

// weights: KVM's four learned tensors (the readout copies are rebuilt with them); empty for UA.
void import_slot(const Holder& h, const std::vector<at::Tensor>& weights, std::int64_t slot, const at::Tensor& bytes) {
  constexpr const char* op = "import_slot";
  TORCH_CHECK_VALUE(h, op, ": state is None");
  check_tensor(bytes, op, "bytes", at::kByte, 1);
  const at::Tensor b = bytes.contiguous();
  TORCH_CHECK_INDEX(slot >= 0 && slot < h->max_slots(),
                    "kvmem: import_slot slot: expected 0 <= slot < max_slots = ", h->max_slots(), ", got ", slot);
  const std::span<const std::byte> span(static_cast<const std::byte*>(b.data_ptr()),
                                        static_cast<std::size_t>(b.numel()));
  if (auto* k = std::get_if<KvmState>(&h->state)) {
    const KvmWeightTensors w(weights, op);
    check(kvm::import_slot(executor(), *k, w.get(), static_cast<std::int32_t>(slot), span));
  } else {
    TORCH_CHECK_VALUE(weights.empty(), op, ": weights: expected none for a Universal Attention cache, got ",
                      weights.size(), " tensors");
    check(ua::import_slot(executor(), std::get<UaCache>(h->state), static_cast<std::int32_t>(slot), span));
  }
}

void import_slot_meta(const Holder& /*h*/, const std::vector<at::Tensor>& /*weights*/, std::int64_t /*slot*/,
                      const at::Tensor& /*bytes*/) {}

void truncate(const Holder& h, std::int64_t slot, std::int64_t n) {
  TORCH_CHECK_VALUE(h, "truncate: state is None");
  TORCH_CHECK_INDEX(slot >= 0 && slot < h->max_slots(),
                    "kvmem: truncate slot: expected 0 <= slot < max_slots = ", h->max_slots(), ", got ", slot);
  if (auto* k = std::get_if<KvmState>(&h->state))
    check(kvm::truncate(executor(), *k, static_cast<std::int32_t>(slot), n));
  else
    check(ua::truncate(executor(), std::get<UaCache>(h->state), static_cast<std::int32_t>(slot), n));
}

// Bytes a KVM state of this configuration allocates (0 when the configuration is invalid).
std::int64_t kvm_state_bytes(std::int64_t max_slots, std::int64_t q_heads, std::int64_t kv_heads, std::int64_t head_dim,
                             std::int64_t value_dim, std::int64_t n_ctx, std::int64_t chunk, std::int64_t window_chunks,
                             std::int64_t sink, std::int64_t rope_dims, std::string budget,
                             std::vector<double> budget_args, double scale) {
  return static_cast<std::int64_t>(
      KvmState::bytes_required(make_params(chunk, window_chunks, sink, rope_dims, budget, budget_args, scale),
                               {max_slots, q_heads, kv_heads, head_dim, value_dim, n_ctx}));
}

std::int64_t allocated_bytes(const Holder& h) {
  if (const auto* k = std::get_if<KvmState>(&h->state)) return static_cast<std::int64_t>(k->allocated_bytes());
  const auto& s = std::get<UaCache>(h->state).shape();
  // keys and values, λ and key-gate logit (fp32), position (int64) per row
  return s.batch * s.kv_heads * s.capacity * (2 * s.head_dim * std::int64_t(sizeof(float)) + 16);
}

}  // namespace
}  // namespace kvmem::torch_ops

namespace ops = kvmem::torch_ops;

TORCH_LIBRARY(kvmem, m) {
  m.class_<ops::StateHolder>("State")
      .def("mechanism", [](const ops::Holder& h) { return h->mechanism(); })
      .def("max_slots", [](const ops::Holder& h) { return h->max_slots(); })
      .def("tokens", [](const ops::Holder& h, std::int64_t slot) { return h->tokens(slot); })
      .def("allocated_bytes", [](const ops::Holder& h) { return ops::allocated_bytes(h); })
      .def("export_bytes", [](const ops::Holder& h, std::int64_t slot) { return ops::export_bytes(h, slot); });

  // Ops without tensor arguments run on every dispatch key (catch-all).
  m.def(
      "kvm_create(int max_slots, int q_heads, int kv_heads, int head_dim, int value_dim, int n_ctx, "
      "int chunk=256, int window_chunks=2, int sink=1, int rope_dims=64, str budget=\"fixed\", "
      "float[] budget_args=[], float scale=0.) -> __torch__.torch.classes.kvmem.State",
      &ops::kvm_create);
  m.def(
      "kvm_state_bytes(int max_slots, int q_heads, int kv_heads, int head_dim, int value_dim, int n_ctx, "
      "int chunk=256, int window_chunks=2, int sink=1, int rope_dims=64, str budget=\"fixed\", "
      "float[] budget_args=[], float scale=0.) -> int",
      &ops::kvm_state_bytes);
  m.def(
      "ua_create(int max_slots, int q_heads, int kv_heads, int head_dim, int capacity) -> "
      "__torch__.torch.classes.kvmem.State",
      &ops::ua_create);
  m.def(
      "kvm_layout(int max_slots, int q_heads, int kv_heads, int head_dim, int value_dim, int n_ctx, "
      "int chunk=256, int window_chunks=2, int sink=1, int rope_dims=64, str budget=\"fixed\", "
      "float[] budget_args=[], float scale=0.) -> (int, int)",
      &ops::kvm_layout);
  m.def("ua_layout(int max_slots, int q_heads, int kv_heads, int head_dim, int capacity) -> (int, int)",
        &ops::ua_layout);
  m.def("export_slot(__torch__.torch.classes.kvmem.State state, int slot) -> Tensor", &ops::export_slot);
  m.def("truncate(__torch__.torch.classes.kvmem.State state, int slot, int n) -> ()", &ops::truncate);

  // Ops with tensor arguments: a CPU kernel (the host backend) and a Meta kernel (shapes only).
  m.def(
      "kvm_step(__torch__.torch.classes.kvmem.State state, Tensor[] weights, Tensor slot, Tensor query_start, "
      "Tensor q, Tensor k, Tensor v, Tensor gate, bool exact=False) -> (Tensor out, Tensor lse)");
  m.def(
      "ua_step(__torch__.torch.classes.kvmem.State state, Tensor slot, Tensor query_start, Tensor q, Tensor k, "
      "Tensor v, Tensor z_k, Tensor z_q, Tensor? z_o=None, float p=0., int prefill_chunk=128, "
      "bool evict_before_attention=True) -> (Tensor out, Tensor lse)");
  m.def("reset_slots(__torch__.torch.classes.kvmem.State state, Tensor slots) -> ()");
  m.def("copy_slots(__torch__.torch.classes.kvmem.State state, Tensor src, Tensor dst) -> ()");
  m.def("import_slot(__torch__.torch.classes.kvmem.State state, Tensor[] weights, int slot, Tensor bytes) -> ()");
  m.def(
      "kvm_place(Tensor memory, Tensor workspace, int max_slots, int q_heads, int kv_heads, int head_dim, "
      "int value_dim, int n_ctx, int chunk=256, int window_chunks=2, int sink=1, int rope_dims=64, "
      "str budget=\"fixed\", float[] budget_args=[], float scale=0.) -> __torch__.torch.classes.kvmem.State");
  m.def(
      "ua_place(Tensor memory, Tensor workspace, int max_slots, int q_heads, int kv_heads, int head_dim, "
      "int capacity) -> __torch__.torch.classes.kvmem.State");
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
