// SPDX-License-Identifier: Apache-2.0
#pragma once
// KV Means on the CUDA backend.
//
//   kvmem::cuda::KvmState<S>           the cache in device memory, sized once from
//                                      slot_capacity(budget, geometry, n_ctx) like kvm::State: owning
//                                      (create) or placed over caller memory (state_bytes, place,
//                                      workspace_bytes, attach_workspace; see KvmState);
//   kvmem::cuda::kvm_prefill(exec, state, weights, q, k, v, gate, out [, log])
//   kvmem::cuda::kvm_decode (exec, state, weights, q1, k1, v1, gate1, out1)
//   kvmem::kvm::step(exec, state, weights, rows, q, k, v, gate, out [, lse])   sequence slots
//   kvmem::kvm::reset_slots / copy_slots / export_bytes / export_slot / import_slot / truncate
// Views point to device memory; shapes as spec KVM.md 2.
//
// Two ways to drive a state. The fixed-batch calls (kvm_prefill, kvm_decode: the tuned tensor-core
// kernels) advance all sequences together with one token count kept on the host, so every host
// decision -- which chunk boundary runs an update, how many slots it appends (spec 3.1, closed form)
// -- depends only on counts known before the call: a call is one stream of launches with no host
// synchronisation and no allocation, but a CUDA graph captured from one replays that call's position
// (it repeats the same step, it does not advance the state).
// kvm::step (docs/slots.md; kernels in kvm_slots.cuh) keeps per-slot counters in device memory and
// takes every per-row decision (update, ring write, slot founding) inside its kernels, with launch
// shapes from the row count, the packed token count, the rows' max_query_len and the state's shape
// only: one CUDA graph captured from a step of a padded batch replays correctly step after step, each
// replay advancing every slot from its own position. Once a state has run a step or a slot operation
// its counters are per slot and the fixed-batch calls refuse it (the first such call after fixed-batch
// calls gives every slot the shared count). reset_slots and copy_slots check their device slot lists
// on the device too (slot_lists.cuh) and are captured like a step. Only KvmState::create allocates;
// create and place wait for their own initialisation on the state's side stream, never for the
// device; export_slot, import_slot, truncate and the counter reads synchronise (they read counters or
// host bytes).
// Values (NaN, g <= 0) are the caller's precondition here: checking them would need a
// device-to-host round trip per call; shapes and parameters are validated.

#include "kvmem/backend/cuda/vendor.cuh"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "kvmem/backend/cuda/common.cuh"
#include "kvmem/backend/cuda/kvm_kernels.cuh"
#if KVMEM_GPU_VENDOR_PATHS
#include "kvmem/backend/cuda/kvm_attend_tc.cuh"
#include "kvmem/backend/cuda/kvm_route_tc.cuh"
#endif
#if KVMEM_GPU_MFMA_PATHS
#include "kvmem/backend/cuda/kvm_attend_mfma.cuh"
#include "kvmem/backend/cuda/kvm_route_mfma.cuh"
#endif
#include "kvmem/backend/cuda/kvm_slots.cuh"
#include "kvmem/core/arena.hpp"
#include "kvmem/core/slots.hpp"
#include "kvmem/core/status.hpp"
#include "kvmem/core/tensor.hpp"
#include "kvmem/kvm/attention.hpp"
#include "kvmem/kvm/params.hpp"
#include "kvmem/kvm/record.hpp"
#include "kvmem/kvm/schedule.hpp"
#include "kvmem/kvm/state.hpp"

namespace kvmem::cuda {

// Learned parameters in device memory. ln_weight, ln_bias: [D]; tau_state, tau_bswa: [Hq].
struct KvmWeights {
  const float* ln_weight = nullptr;
  const float* ln_bias = nullptr;
  const float* tau_state = nullptr;
  const float* tau_bswa = nullptr;
};

namespace kvm_detail {

// A second stream and two events owned by a state. A prefill runs the selection of the next update
// (novelty, appends, routes; the fp32 sweeps' prepare pass first) on it beside the current chunk's
// readout: fork makes the selection wait for the work before the readout, join makes the scatter
// wait for the selection.
// With readouts off the chain (ReadoutPipeline) the whole update chain runs on it instead: fork at
// the call's start, join at its end. Both are stream dependencies, so a prefill still captures as
// one CUDA graph.
struct SideStream {
  cudaStream_t stream = nullptr;
  cudaEvent_t fork = nullptr, join = nullptr;

  SideStream() = default;
  SideStream(const SideStream&) = delete;
  SideStream& operator=(const SideStream&) = delete;
  SideStream(SideStream&& o) noexcept
      : stream(std::exchange(o.stream, nullptr)),
        fork(std::exchange(o.fork, nullptr)),
        join(std::exchange(o.join, nullptr)) {}
  SideStream& operator=(SideStream&& o) noexcept {
    if (this != &o) {
      release();
      stream = std::exchange(o.stream, nullptr);
      fork = std::exchange(o.fork, nullptr);
      join = std::exchange(o.join, nullptr);
    }
    return *this;
  }
  ~SideStream() { release(); }

  static Status create(SideStream& out) {
    SideStream s;
    int least = 0, greatest = 0;  // the selection is on the critical path: schedule its blocks first
    KVMEM_RETURN_IF_ERROR(
        to_status(cudaDeviceGetStreamPriorityRange(&least, &greatest), "cudaDeviceGetStreamPriorityRange"));
    KVMEM_RETURN_IF_ERROR(to_status(cudaStreamCreateWithPriority(&s.stream, cudaStreamNonBlocking, greatest),
                                    "cudaStreamCreateWithPriority"));
    KVMEM_RETURN_IF_ERROR(
        to_status(cudaEventCreateWithFlags(&s.fork, cudaEventDisableTiming), "cudaEventCreateWithFlags (fork)"));
    KVMEM_RETURN_IF_ERROR(
        to_status(cudaEventCreateWithFlags(&s.join, cudaEventDisableTiming), "cudaEventCreateWithFlags (join)"));
    out = std::move(s);
    return Status::ok();
  }

 private:
  void release() {
    if (stream) (void)cudaStreamDestroy(stream);
    if (fork) (void)cudaEventDestroy(fork);
    if (join) (void)cudaEventDestroy(join);
    stream = nullptr;
    fork = join = nullptr;
  }
};

// Readout off the update chain (bf16 storage, tensor-core readout, inputs in the storage type): the
// state trajectory does not depend on the queries, so a prefill runs the updates as a chain on the
// side stream (highest priority) and each chunk's readout on the caller's stream beside them. The
// readout of a chunk reads the slots' readout rows (khat, vhat) as the chunk's update left them, and
// its window keys from the call's k/v inputs. Of an update only the scatter (update_finish) changes
// existing slots' readout rows (the selection reads them and appends slots no earlier readout
// reads), so the state keeps kReadoutCopies copies of them, one live: each scatter writes the slots
// it refreshes into the next copy, and a copy kernel on an aux stream beside it the rows of the
// others (the untouched slots and the sinks) from the live one; the next copy then becomes live. Both
// wait only for the readout that last read the copy they write (event `read`, one per copy),
// kReadoutCopies updates back: the chain may run kReadoutCopies - 1 chunks ahead of the readouts.
// The aux stream also takes the ingest of the chunks the ring must hold beside the chain.
// Four copies let the chain run three chunks ahead of the readouts; with fewer it waits for them more
// often (with none, each scatter would run with nothing beside it). The chain keeps the highest priority:
// it is the critical path, every later chunk's update and readout waits for it. Both halves fill the GPU
// (the readout with 3 blocks of 168 registers per SM, the chain's routing with 2 of 128 x 256), so they
// share the SMs rather than overlap freely. Only states no larger than the window take this path: a larger
// state (16 sqrt N: 2884 slots at 32K) makes the update a tensor-core-bound novelty pass that shares the
// SMs with the readout just the same, while copying its untouched rows would move most of 0.4 GB a chunk;
// such states keep the readout on the chain and run the selection beside it (the other path below).
inline constexpr int kReadoutCopies = 4;

struct ReadoutPipeline {
  cudaStream_t aux = nullptr;
  cudaEvent_t chained = nullptr;                 // the chain after a chunk's update: aux and the readout may start
  cudaEvent_t aux_done[2] = {nullptr, nullptr};  // aux after a chunk's ingest (two chunks in flight)
  cudaEvent_t read[kReadoutCopies] = {};         // the last readout of readout copy r finished: a scatter may write it
  cudaEvent_t selected = nullptr;                // the chain after an update's routing: aux may copy the untouched rows
  cudaEvent_t copied = nullptr;                  // aux after that copy: the chain may go on past the scatter

  ReadoutPipeline() = default;
  ReadoutPipeline(const ReadoutPipeline&) = delete;
  ReadoutPipeline& operator=(const ReadoutPipeline&) = delete;
  ReadoutPipeline(ReadoutPipeline&& o) noexcept { take(o); }
  ReadoutPipeline& operator=(ReadoutPipeline&& o) noexcept {
    if (this != &o) {
      release();
      take(o);
    }
    return *this;
  }
  ~ReadoutPipeline() { release(); }

  static Status create(ReadoutPipeline& out) {
    ReadoutPipeline p;
    int least = 0, greatest = 0;
    KVMEM_RETURN_IF_ERROR(
        to_status(cudaDeviceGetStreamPriorityRange(&least, &greatest), "cudaDeviceGetStreamPriorityRange"));
    KVMEM_RETURN_IF_ERROR(to_status(cudaStreamCreateWithPriority(&p.aux, cudaStreamNonBlocking, greatest),
                                    "cudaStreamCreateWithPriority (aux)"));
    for (cudaEvent_t* e : p.events())
      KVMEM_RETURN_IF_ERROR(
          to_status(cudaEventCreateWithFlags(e, cudaEventDisableTiming), "cudaEventCreateWithFlags (readout)"));
    out = std::move(p);
    return Status::ok();
  }

 private:
  std::array<cudaEvent_t*, 5 + kReadoutCopies> events() {
    std::array<cudaEvent_t*, 5 + kReadoutCopies> e{&chained, &aux_done[0], &aux_done[1], &selected, &copied};
    for (int r = 0; r < kReadoutCopies; ++r) e[std::size_t(5 + r)] = &read[r];
    return e;
  }
  void take(ReadoutPipeline& o) {
    aux = std::exchange(o.aux, nullptr);
    const auto mine = events(), theirs = o.events();
    for (std::size_t i = 0; i < mine.size(); ++i) *mine[i] = std::exchange(*theirs[i], nullptr);
  }
  void release() {
    if (aux) (void)cudaStreamDestroy(aux);
    aux = nullptr;
    for (cudaEvent_t* e : events()) {
      if (*e) (void)cudaEventDestroy(*e);
      *e = nullptr;
    }
  }
};

struct SlotAccess;

}  // namespace kvm_detail

// Persistent device bytes of a KvmState (DESIGN.md 3). The CUDA state keeps each field as one array
// over all (slot, KV head) items, so a slot's bytes are spread over the arrays: item_bytes is one
// (slot, KV head)'s share of them, slot_bytes a slot's (its KV heads and its counters), fixed_bytes
// what the state keeps once (the budget's update targets, the step status) and bytes the whole
// state with each array aligned to `alignment`.
struct KvmStateLayout {
  std::size_t item_bytes = 0;
  std::size_t slot_bytes = 0;
  std::size_t fixed_bytes = 0;
  std::size_t bytes = 0;
  std::size_t alignment = 0;
};

namespace kvm_detail {

// Alignment of a placed state or workspace and of every array carved from one: cudaMalloc's, which
// the vector loads and cp.async copies of the kernels (16-byte rows) need at most.
inline constexpr std::size_t kKvmAlign = 256;

// Offsets of the persistent arrays inside a state's memory.
struct KvmStateOffsets {
  std::size_t sk, sv, rho, cnt, khat32, khat, khat_lo, vhat, khat_scale, vhat_scale, wk, wv, wg;
  std::size_t copies[kReadoutCopies];  // readout copies 1.. (copy 0 is khat, vhat); 0 bytes without the pipeline
  std::size_t counter, slot_n, slot_cov, slot_s, seen, mark, status, update_target, bytes;
  std::int64_t updates;  // entries of update_target
  bool beside;           // readouts beside the update chain (ReadoutPipeline)
};

// Offsets of the per-step arrays inside a workspace of `rows` rows.
struct KvmWorkOffsets {
  std::size_t plan, update_rows, k0, k0t, kgt, vg, kg, score, rbest, target, key, partial, bytes;
};

// Readouts beside the update chain where the readout runs on the tensor cores and the state is no
// larger than the window (ReadoutPipeline says why); such a state keeps more readout copies.
template <class S>
bool readouts_beside(const kvm::Params& p, const kvm::Shape& s, std::int64_t cap) {
  return kVendorPaths && std::is_same_v<S, bf16> && s.D == s.Dv && (s.D == 64 || s.D == 128) && cap <= p.window();
}

// Persistent: per (slot, KV head) item the sums (Sk, Sv, rho, cnt), the readout rows (khat32, khat,
// khat_lo, vhat and their copies; for fp8 storage the rows' scales) and the window ring (window type); per (slot, query
// head) the decode split counter (zero between calls: the last split of a step resets it); per slot the counters n,
// cov, |S|, the duplicate-check stamp and the slot operations' list-check word (slot_lists.cuh); once, the status word
// and the budget's |S| target per update.
template <class S, class A>
KvmStateOffsets state_offsets(const kvm::Params& p, const kvm::Shape& s) {
  constexpr bool kBf16 = std::is_same_v<S, bf16>;
  const std::int64_t capacity = kvm::slot_capacity(p.budget, p.geometry(), s.n_ctx);
  const auto I = std::size_t(s.B * s.Hk), cap = std::size_t(capacity), W = std::size_t(p.window()),
             D = std::size_t(s.D), Dv = std::size_t(s.Dv);
  ArenaLayout arena(kKvmAlign);
  KvmStateOffsets o{};
  o.beside = readouts_beside<S>(p, s, capacity);
  o.sk = arena.take(I * cap * D * sizeof(A));
  o.sv = arena.take(I * cap * Dv * sizeof(A));
  o.rho = arena.take(I * cap * sizeof(A));
  o.cnt = arena.take(I * cap * sizeof(A));
  o.khat32 = arena.take(I * cap * D * sizeof(A));
  o.khat = arena.take(I * cap * D * sizeof(S));
  o.khat_lo = arena.take(kBf16 ? I * cap * D * sizeof(bf16) : 0);
  o.vhat = arena.take(I * cap * Dv * sizeof(S));
  o.khat_scale = arena.take(is_row_scaled_v<S> ? I * cap * sizeof(float) : 0);  // fp8: a scale per readout row
  o.vhat_scale = arena.take(is_row_scaled_v<S> ? I * cap * sizeof(float) : 0);
  o.wk = arena.take(I * W * D * sizeof(Win<S>));
  o.wv = arena.take(I * W * Dv * sizeof(Win<S>));
  o.wg = arena.take(I * W * sizeof(A));
  for (int r = 1; r < kReadoutCopies; ++r) o.copies[r] = arena.take(o.beside ? I * cap * (D + Dv) * sizeof(S) : 0);
  o.counter = arena.take(std::size_t(s.B * s.Hq) * sizeof(int));
  o.slot_n = arena.take(std::size_t(s.B) * sizeof(std::int64_t));
  o.slot_cov = arena.take(std::size_t(s.B) * sizeof(std::int64_t));
  o.slot_s = arena.take(std::size_t(s.B) * sizeof(std::int64_t));
  o.seen = arena.take(std::size_t(s.B) * sizeof(int));
  o.mark = arena.take(std::size_t(s.B) * sizeof(int));
  o.status = arena.take(kvm_detail::kStatusWords * sizeof(int));
  o.updates = s.n_ctx / p.chunk + 2;
  o.update_target = arena.take(std::size_t(o.updates) * sizeof(std::int64_t));
  o.bytes = arena.total();
  return o;
}

// Per step, for `rows` rows (work items rows * Hk, decode rows rows * Hq): the step plan per slot
// (indexed by slot, so max_slots entries), the list of rows updating in a phase, the update scratch of
// each work item (with kvm::step's merged novelty and route key per token) and the fixed-batch
// decode's split-K partials. Nothing of it outlives a call.
template <class S, class A>
KvmWorkOffsets work_offsets(const kvm::Params& p, const kvm::Shape& s, std::int64_t rows) {
  constexpr bool kBf16 = std::is_same_v<S, bf16>;
  const auto I = std::size_t(rows * s.Hk), C = std::size_t(p.chunk), D = std::size_t(s.D), Dv = std::size_t(s.Dv);
  ArenaLayout arena(kKvmAlign);
  KvmWorkOffsets o{};
  o.plan = arena.take(std::size_t(s.B) * sizeof(SlotPlan));
  o.update_rows = arena.take(std::size_t(rows + 1) * sizeof(int));
  o.k0 = arena.take(I * C * D * sizeof(A));
  o.k0t = arena.take(I * C * D * sizeof(A));
  o.kgt = arena.take(I * C * D * sizeof(A));
  o.vg = arena.take(I * C * Dv * sizeof(A));
  o.kg = arena.take(I * C * D * sizeof(A));
  o.score = arena.take(I * C * sizeof(A));
  o.rbest = arena.take(kBf16 ? I * C * sizeof(A) : 0);
  o.target = arena.take(I * C * sizeof(int));
  o.key = arena.take(I * C * sizeof(unsigned long long));
  o.partial = arena.take(std::size_t(rows * s.Hq) * std::size_t(kMaxSplitsPerRow) * (Dv + 1) * sizeof(A));
  o.bytes = arena.total();
  return o;
}

// Rows a workspace serves for `limits` (max_rows, or max_slots when 0).
inline std::int64_t workspace_rows(const Limits& limits, const kvm::Shape& s) {
  return limits.max_rows > 0 ? limits.max_rows : s.B;
}

// Ok when `memory` can hold `need` bytes at kKvmAlign; else a Status naming `what`.
inline Status check_device_placement(const void* memory, std::size_t bytes, std::size_t need, const char* what) {
  if (memory == nullptr) return invalid_argument(what, "a non-null device pointer", "nullptr");
  if (reinterpret_cast<std::uintptr_t>(memory) % kKvmAlign != 0)
    return invalid_argument(what, std::to_string(kKvmAlign) + "-byte alignment", "a misaligned pointer");
  if (bytes < need) return invalid_argument(std::string(what) + " bytes", ">= " + std::to_string(need), bytes);
  return Status::ok();
}

}  // namespace kvm_detail

// The KV Means cache in device memory (DESIGN.md 3, caller-owned memory), in two parts: persistent
// state (state_layout, state_bytes) and per-step workspace (workspace_bytes), both closed-form. A
// state is owning (create: one cudaMalloc holding the state and a workspace for max_slots rows) or
// placed over caller device memory (place, then attach_workspace). create and place also create the
// state's side stream and events (the fixed-batch prefill's, ReadoutPipeline) and initialise the
// counters and the budget's update targets on that side stream, waiting for that work only: neither
// synchronises the device nor waits for work on any other stream. No operation allocates, creates
// streams or events, or waits for the device, except those documented to synchronise (export_slot,
// import_slot, truncate, slot_counters, step_status, download); kvm::step, reset_slots and
// copy_slots never do.
template <class S = float, class A = float>
class KvmState {
  static_assert(!is_row_scaled_v<S> || std::is_same_v<A, float>,
                "kvmem::cuda::KvmState: fp8 (kvmem::e4m3) storage accumulates in fp32 (A = float)");

 public:
  static constexpr std::int64_t kMaxDecodeSplits = kvm_detail::kMaxSplitsPerRow;
  static constexpr std::size_t kAlign = kvm_detail::kKvmAlign;

  KvmState() = default;
  // Moves leave the source empty (valid() false, every operation refused with a Status): its device
  // pointers would otherwise alias memory the new owner frees (DESIGN.md 3).
  KvmState(KvmState&& o) noexcept { take(o); }
  KvmState& operator=(KvmState&& o) noexcept {
    if (this != &o) take(o);
    return *this;
  }
  KvmState(const KvmState&) = delete;
  KvmState& operator=(const KvmState&) = delete;
  ~KvmState() = default;

  // Whether the CUDA backend runs every operation on `problem`: ok, or why not (invalid parameters or
  // shape, a chunk over 1024 (one thread per token of an update), a value head dim over kvm::step's
  // readout registers). create and place refuse only the first two: the fixed-batch calls take any Dv.
  static Status can_run(const kvm::Problem& problem) {
    KVMEM_RETURN_IF_ERROR(check_creatable(problem.params, problem.shape));
    if (problem.shape.Dv > 32 * kvm_detail::kSlotReadoutMaxRegs)
      return {StatusCode::kUnsupported,
              "cuda kvm::step: Dv must be <= " + std::to_string(32 * kvm_detail::kSlotReadoutMaxRegs) + ", got " +
                  std::to_string(problem.shape.Dv)};
    return Status::ok();
  }

  // Persistent layout for `problem` (all zero when it is invalid, see can_run).
  static KvmStateLayout state_layout(const kvm::Problem& problem) {
    const kvm::Params& p = problem.params;
    const kvm::Shape& s = problem.shape;
    if (!kvm::validate(p, s).is_ok()) return {};
    const std::int64_t capacity = kvm::slot_capacity(p.budget, p.geometry(), s.n_ctx);
    const auto cap = std::size_t(capacity), W = std::size_t(p.window()), D = std::size_t(s.D), Dv = std::size_t(s.Dv);
    const std::size_t copies = kvm_detail::readouts_beside<S>(p, s, capacity) ? kvm_detail::kReadoutCopies - 1 : 0;
    KvmStateLayout l;
    l.item_bytes = cap * ((D + Dv + 2) * sizeof(A) + D * sizeof(A) + (D + Dv) * sizeof(S) +
                          (std::is_same_v<S, bf16> ? D * sizeof(bf16) : 0) + copies * (D + Dv) * sizeof(S) +
                          (is_row_scaled_v<S> ? 2 * sizeof(float) : 0)) +
                   W * ((D + Dv) * sizeof(kvm_detail::Win<S>) + sizeof(A));
    l.slot_bytes =
        std::size_t(s.Hk) * l.item_bytes + std::size_t(s.Hq) * sizeof(int) + 3 * sizeof(std::int64_t) + 2 * sizeof(int);
    l.fixed_bytes = kvm_detail::kStatusWords * sizeof(int) + std::size_t(s.n_ctx / p.chunk + 2) * sizeof(std::int64_t);
    l.bytes = kvm_detail::state_offsets<S, A>(p, s).bytes;
    l.alignment = kAlign;
    return l;
  }
  // Persistent device bytes for `problem` (0 when it is invalid).
  static std::size_t state_bytes(const kvm::Problem& problem) { return state_layout(problem).bytes; }
  // Workspace device bytes of steps of at most limits.max_rows rows (padding rows count: the kernels
  // take a work item per row; 0 = max_slots). The fixed-batch calls (kvm_prefill, kvm_decode) need a
  // workspace of max_slots rows. 0 when the problem is invalid or max_rows < 0.
  static std::size_t workspace_bytes(const kvm::Problem& problem, const Limits& limits = {}) {
    if (!kvm::validate(problem.params, problem.shape).is_ok() || limits.max_rows < 0) return 0;
    return kvm_detail::work_offsets<S, A>(problem.params, problem.shape,
                                          kvm_detail::workspace_rows(limits, problem.shape))
        .bytes;
  }
  // Bytes of a state with its workspace for max_slots rows in one block (what create allocates and the
  // five-argument place takes); 0 when (params, shape) are invalid.
  static std::size_t bytes_required(const kvm::Params& p, const kvm::Shape& s) {
    if (!kvm::validate(p, s).is_ok()) return 0;
    return state_bytes({p, s}) + workspace_bytes({p, s});
  }

  // Owning state: one device allocation of bytes_required (state, then a workspace for max_slots rows).
  static Status create(const kvm::Params& p, const kvm::Shape& s, KvmState& out) {
    KVMEM_RETURN_IF_ERROR(check_creatable(p, s));
    KvmState st;
    const std::size_t sb = state_bytes({p, s});
    KVMEM_RETURN_IF_ERROR(DeviceBuffer::allocate(bytes_required(p, s), st.owned_));
    auto* base = static_cast<unsigned char*>(st.owned_.get());
    KVMEM_RETURN_IF_ERROR(st.bind(base, p, s));
    st.bind_workspace(base + sb, s.B);
    out = std::move(st);
    return Status::ok();
  }

  // Persistent state over caller device memory: at least state_bytes(problem) bytes, kAlign-aligned,
  // not owned, not in use by pending work. Writes only the counters, the status word and the update
  // targets (nothing outside [memory, memory + state_bytes)); steps need a workspace (attach_workspace).
  static Status place(void* memory, std::size_t bytes, const kvm::Problem& problem, KvmState& out) {
    KVMEM_RETURN_IF_ERROR(check_creatable(problem.params, problem.shape));
    KVMEM_RETURN_IF_ERROR(kvm_detail::check_device_placement(memory, bytes, state_bytes(problem), "state memory"));
    KvmState st;
    KVMEM_RETURN_IF_ERROR(st.bind(static_cast<unsigned char*>(memory), problem.params, problem.shape));
    out = std::move(st);
    return Status::ok();
  }
  // State and a workspace for max_slots rows in one caller block of at least bytes_required bytes.
  static Status place(void* memory, std::size_t bytes, const kvm::Params& p, const kvm::Shape& s, KvmState& out) {
    KVMEM_RETURN_IF_ERROR(check_creatable(p, s));
    KVMEM_RETURN_IF_ERROR(kvm_detail::check_device_placement(memory, bytes, bytes_required(p, s), "memory"));
    KvmState st;
    auto* base = static_cast<unsigned char*>(memory);
    KVMEM_RETURN_IF_ERROR(st.bind(base, p, s));
    st.bind_workspace(base + state_bytes({p, s}), s.B);
    out = std::move(st);
    return Status::ok();
  }

  // Uses caller device memory (at least workspace_bytes(problem, limits), kAlign-aligned, not owned) as
  // the scratch of every later call of at most limits.max_rows rows; replaces a workspace attached or
  // owned before (the owned one stays allocated until the state goes). Nothing is written here. One
  // workspace may serve several states whose calls never run at the same time (one stream, say).
  Status attach_workspace(void* memory, std::size_t bytes, const Limits& limits = {}) {
    if (!valid()) return invalid_argument("state", "a created or placed KvmState", "an empty KvmState");
    if (limits.max_rows < 0) return invalid_argument("limits max_rows", ">= 0", limits.max_rows);
    KVMEM_RETURN_IF_ERROR(kvm_detail::check_device_placement(memory, bytes, workspace_bytes({params_, shape_}, limits),
                                                             "workspace memory"));
    bind_workspace(static_cast<unsigned char*>(memory), kvm_detail::workspace_rows(limits, shape_));
    return Status::ok();
  }
  // Ok when a call of `rows` rows has workspace; else the reason (checked before anything is enqueued).
  [[nodiscard]] Status check_workspace(std::int64_t rows) const {
    return check_workspace_rows(ws_rows_ > 0, rows, ws_rows_, "KvmState");
  }
  // False for a state never created and for a moved-from one: every operation on it is refused.
  [[nodiscard]] bool valid() const { return base_ != nullptr; }
  [[nodiscard]] const kvm::Params& params() const { return params_; }
  [[nodiscard]] const kvm::Shape& shape() const { return shape_; }
  [[nodiscard]] std::int64_t capacity() const { return cap_; }
  // The shared counters of the fixed-batch calls (kvm_prefill / kvm_decode). Once a state is driven by
  // kvm::step or a slot operation its counters are per slot, on the device: slot_counters reads them.
  [[nodiscard]] std::int64_t tokens() const { return n_; }     // n, shared by every sequence
  [[nodiscard]] std::int64_t covered() const { return cov_; }  // cov
  [[nodiscard]] std::int64_t slots() const { return slots_; }  // |S|
  [[nodiscard]] std::int64_t max_slots() const { return valid() ? shape_.B : 0; }
  // Rows the workspace serves (0 without one).
  [[nodiscard]] std::int64_t workspace_rows() const { return ws_rows_; }
  // Persistent bytes (state_bytes of this problem), the workspace in use, and their sum.
  [[nodiscard]] std::size_t state_bytes() const { return valid() ? state_total_ : 0; }
  [[nodiscard]] std::size_t workspace_bytes() const { return ws_rows_ > 0 ? ws_total_ : 0; }
  [[nodiscard]] std::size_t allocated_bytes() const { return state_bytes() + workspace_bytes(); }
  [[nodiscard]] const kvm_detail::DeviceState<S, A>& device() const { return dev_; }
  // Forgets every sequence of the fixed-batch calls (their shared count). A state driven by kvm::step
  // forgets sequences with kvm::reset_slots instead.
  void reset() { n_ = cov_ = slots_ = 0; }
  // bf16 storage with head dim 64 or 128 routes on the tensor cores. By default each novelty and
  // routing dot is computed from hi/lo bf16 splits of both operands (three products, about fp32
  // accuracy: routes match the host backend except at true near-ties). Fast routing uses one bf16
  // product (bf16 logits, as the reference's eager bf16 path): about 3x cheaper, and routes flip
  // where two slots are within bf16 rounding of each other. No effect on fp32 storage.
  void set_fast_routing(bool fast) { dev_.route_terms = fast ? 1 : 3; }
  [[nodiscard]] bool routes_on_tensor_cores() const { return dev_.tc_route; }
  // A prefill whose k/v inputs are in the storage type (16-byte rows) runs each chunk's readout
  // beside the update chain (kvm_detail::ReadoutPipeline): bf16 storage, head dims 64 or 128, a state
  // no larger than the window.
  [[nodiscard]] bool readouts_beside_updates() const { return pipe_.aux != nullptr; }
  // True once kvm::step or a slot operation ran: the counters are per slot on the device, and the
  // fixed-batch kvm_prefill / kvm_decode (one host count for every sequence) refuse the state.
  [[nodiscard]] bool slot_mode() const { return slot_mode_; }

  // Counters of sequence slot `slot` (n, cov, |S|), read from the device: synchronises the stream.
  Status slot_counters(const Executor& exec, std::int32_t slot, std::int64_t& n, std::int64_t& cov,
                       std::int64_t& slots) const {
    if (!valid()) return invalid_argument("state", "a KvmState made by KvmState::create or place", "an empty KvmState");
    if (slot < 0 || slot >= shape_.B)
      return {StatusCode::kOutOfRange,
              "slot: expected 0 <= slot < max_slots = " + std::to_string(shape_.B) + ", got " + std::to_string(slot)};
    if (!slot_mode_) {
      n = n_, cov = cov_, slots = slots_;
      return Status::ok();
    }
    std::int64_t v[3] = {};
    KVMEM_RETURN_IF_ERROR(to_status(
        cudaMemcpyAsync(&v[0], sc_.n + slot, sizeof(std::int64_t), cudaMemcpyDeviceToHost, exec.stream), "read n"));
    KVMEM_RETURN_IF_ERROR(to_status(
        cudaMemcpyAsync(&v[1], sc_.cov + slot, sizeof(std::int64_t), cudaMemcpyDeviceToHost, exec.stream), "read cov"));
    KVMEM_RETURN_IF_ERROR(
        to_status(cudaMemcpyAsync(&v[2], sc_.slots + slot, sizeof(std::int64_t), cudaMemcpyDeviceToHost, exec.stream),
                  "read |S|"));
    KVMEM_RETURN_IF_ERROR(to_status(cudaStreamSynchronize(exec.stream), "slot counters sync"));
    n = v[0], cov = v[1], slots = v[2];
    return Status::ok();
  }

  // kvm::step checks its rows on the device (they live there) and refuses a bad step without
  // changing the state, and reset_slots / copy_slots check their device slot lists the same way; the
  // reason stays in the state (and refuses every later step and slot operation) until this call
  // reads it: ok, or the Status the host backend would have returned for the first refused call
  // since the last read. Clears it. Synchronises the stream.
  Status step_status(const Executor& exec) {
    if (!valid()) return invalid_argument("state", "a KvmState made by KvmState::create or place", "an empty KvmState");
    int v[kvm_detail::kStatusWords] = {};
    KVMEM_RETURN_IF_ERROR(
        to_status(cudaMemcpyAsync(v, sc_.status, sizeof v, cudaMemcpyDeviceToHost, exec.stream), "read step status"));
    KVMEM_RETURN_IF_ERROR(to_status(cudaStreamSynchronize(exec.stream), "step status sync"));
    if (v[0] == kvm_detail::kStepOk) return Status::ok();
    KVMEM_RETURN_IF_ERROR(to_status(cudaMemsetAsync(sc_.status, 0, sizeof v, exec.stream), "clear step status"));
    KVMEM_RETURN_IF_ERROR(to_status(cudaStreamSynchronize(exec.stream), "step status sync"));
    if (v[0] >= slot_lists::kFirstCode) return slot_lists::slot_list_status(v[0], v[1], v[2], shape_.B);
    const std::string row = "row " + std::to_string(v[1]);
    switch (v[0]) {
      case kvm_detail::kStepBadStart:
        return invalid_argument("query_start", "query_start[0] = 0 and non-decreasing starts",
                                "query_start[" + std::to_string(v[1]) + "] = " + std::to_string(v[2]));
      case kvm_detail::kStepBadSlot:
        return {StatusCode::kOutOfRange, "slot[" + std::to_string(v[1]) +
                                             "]: expected -1 (padding) or 0 <= slot < max_slots = " +
                                             std::to_string(shape_.B) + ", got " + std::to_string(v[2])};
      case kvm_detail::kStepDuplicate:
        return invalid_argument("slot[" + std::to_string(v[1]) + "]", "a slot used by no other row of the step", v[2]);
      case kvm_detail::kStepTooLong:
        return {StatusCode::kOutOfRange,
                row + " (slot " + std::to_string(v[2]) +
                    "): its tokens exceed the state's n_ctx = " + std::to_string(shape_.n_ctx)};
      case kvm_detail::kStepOverBound:  // the host's message (core/slots.hpp), the bound from the word
        return row_over_bound(v[1], v[2], v[4]);
      default:
        return invalid_argument("query_start[" + std::to_string(v[1]) + "]", "the packed token count", v[2]);
    }
  }

  // Copies the state of item (b, g) to the host: Sk [S,D], Sv [S,Dv], rho [S] (tests, replay).
  Status download(std::int64_t b, std::int64_t g, std::vector<A>& sk, std::vector<A>& sv, std::vector<A>& rho,
                  cudaStream_t stream) const {
    if (!valid()) return invalid_argument("state", "a KvmState made by KvmState::create or place", "an empty KvmState");
    if (b < 0 || b >= shape_.B)
      return {StatusCode::kOutOfRange,
              "download b: expected 0 <= b < B = " + std::to_string(shape_.B) + ", got " + std::to_string(b)};
    if (g < 0 || g >= shape_.Hk)
      return {StatusCode::kOutOfRange,
              "download g: expected 0 <= g < Hk = " + std::to_string(shape_.Hk) + ", got " + std::to_string(g)};
    const std::int64_t i = b * shape_.Hk + g;
    sk.resize(std::size_t(slots_ * shape_.D));
    sv.resize(std::size_t(slots_ * shape_.Dv));
    rho.resize(std::size_t(slots_));
    KVMEM_RETURN_IF_ERROR(to_status(cudaMemcpyAsync(sk.data(), dev_.sk + i * cap_ * shape_.D, sk.size() * sizeof(A),
                                                    cudaMemcpyDeviceToHost, stream),
                                    "download Sk"));
    KVMEM_RETURN_IF_ERROR(to_status(cudaMemcpyAsync(sv.data(), dev_.sv + i * cap_ * shape_.Dv, sv.size() * sizeof(A),
                                                    cudaMemcpyDeviceToHost, stream),
                                    "download Sv"));
    KVMEM_RETURN_IF_ERROR(to_status(
        cudaMemcpyAsync(rho.data(), dev_.rho + i * cap_, rho.size() * sizeof(A), cudaMemcpyDeviceToHost, stream),
        "download rho"));
    return to_status(cudaStreamSynchronize(stream), "download sync");
  }

 private:
  static Status check_creatable(const kvm::Params& p, const kvm::Shape& s) {
    KVMEM_RETURN_IF_ERROR(kvm::validate(p, s));
    if (p.chunk > 1024)
      return {StatusCode::kUnsupported,
              "cuda KVM: chunk must be <= 1024 (one thread per token of an update), got " + std::to_string(p.chunk)};
    return Status::ok();
  }

  template <class Dims, class S2, class A2, class In, class Out>
  friend Status kvm_run_as(Dims, const Executor&, KvmState<S2, A2>&, const KvmWeights&, TensorView<const In, 4>,
                           TensorView<const In, 4>, TensorView<const In, 4>, TensorView<const In, 3>,
                           TensorView<Out, 4>, kvm::RouteLog*);

  friend struct kvm_detail::SlotAccess;

  void take(KvmState& o) noexcept {
    sc_ = std::exchange(o.sc_, kvm_detail::SlotCounters{});
    slot_mode_ = std::exchange(o.slot_mode_, false);
    khat32_rows_ = std::exchange(o.khat32_rows_, 0);
    params_ = std::exchange(o.params_, kvm::Params{});
    shape_ = std::exchange(o.shape_, kvm::Shape{});
    cap_ = std::exchange(o.cap_, 0);
    n_ = std::exchange(o.n_, 0);
    cov_ = std::exchange(o.cov_, 0);
    slots_ = std::exchange(o.slots_, 0);
    sm_count_ = std::exchange(o.sm_count_, 1);
    side_ = std::move(o.side_);
    pipe_ = std::move(o.pipe_);
    for (int r = 0; r < kvm_detail::kReadoutCopies; ++r) {
      khat_copy_[r] = std::exchange(o.khat_copy_[r], nullptr);
      vhat_copy_[r] = std::exchange(o.vhat_copy_[r], nullptr);
    }
    live_copy_ = std::exchange(o.live_copy_, 0);
    owned_ = std::move(o.owned_);
    base_ = std::exchange(o.base_, nullptr);
    state_total_ = std::exchange(o.state_total_, 0);
    ws_total_ = std::exchange(o.ws_total_, 0);
    ws_rows_ = std::exchange(o.ws_rows_, 0);
    dev_ = std::exchange(o.dev_, kvm_detail::DeviceState<S, A>{});
  }

  // Points the persistent arrays into `base` (state_offsets), creates the side stream and events, and
  // initialises the counters, the status word and the budget's update targets on the side stream,
  // waiting for that work only (the caller's later work on any stream sees an initialised state).
  Status bind(unsigned char* base, const kvm::Params& p, const kvm::Shape& s) {
    constexpr bool kBf16 = std::is_same_v<S, bf16>;
    const kvm_detail::KvmStateOffsets o = kvm_detail::state_offsets<S, A>(p, s);
    params_ = p;
    shape_ = s;
    cap_ = kvm::slot_capacity(p.budget, p.geometry(), s.n_ctx);
    base_ = base;
    state_total_ = o.bytes;
    const auto I = std::size_t(s.B * s.Hk), cap = std::size_t(cap_), D = std::size_t(s.D);
    auto& d = dev_;
    d.sk = reinterpret_cast<A*>(base + o.sk);
    d.sv = reinterpret_cast<A*>(base + o.sv);
    d.rho = reinterpret_cast<A*>(base + o.rho);
    d.cnt = reinterpret_cast<A*>(base + o.cnt);
    d.khat32 = reinterpret_cast<A*>(base + o.khat32);
    d.khat = reinterpret_cast<S*>(base + o.khat);
    d.vhat = reinterpret_cast<S*>(base + o.vhat);
    d.khat_scale = is_row_scaled_v<S> ? reinterpret_cast<float*>(base + o.khat_scale) : nullptr;
    d.vhat_scale = is_row_scaled_v<S> ? reinterpret_cast<float*>(base + o.vhat_scale) : nullptr;
    d.wk = reinterpret_cast<kvm_detail::Win<S>*>(base + o.wk);
    d.wv = reinterpret_cast<kvm_detail::Win<S>*>(base + o.wv);
    d.wg = reinterpret_cast<A*>(base + o.wg);
    d.counter = reinterpret_cast<int*>(base + o.counter);
    d.khat_lo = kBf16 ? reinterpret_cast<bf16*>(base + o.khat_lo) : nullptr;
    auto& sc = sc_;
    sc.n = reinterpret_cast<std::int64_t*>(base + o.slot_n);
    sc.cov = reinterpret_cast<std::int64_t*>(base + o.slot_cov);
    sc.slots = reinterpret_cast<std::int64_t*>(base + o.slot_s);
    sc.seen = reinterpret_cast<int*>(base + o.seen);
    sc.mark = reinterpret_cast<int*>(base + o.mark);
    sc.status = reinterpret_cast<int*>(base + o.status);
    sc.update_target = reinterpret_cast<const std::int64_t*>(base + o.update_target);
    sc.B = s.B;
    sc.n_ctx = s.n_ctx;
    khat_copy_[0] = d.khat;
    vhat_copy_[0] = d.vhat;
    for (int r = 1; r < kvm_detail::kReadoutCopies && o.beside; ++r) {
      khat_copy_[r] = reinterpret_cast<S*>(base + o.copies[r]);
      vhat_copy_[r] = khat_copy_[r] + I * cap * D;  // [I, cap, D] keys, then [I, cap, Dv] values
    }
    d.tc_route = kMatrixPaths && kBf16 && (s.D == 64 || s.D == 128) && p.chunk % 16 == 0;
    d.route_terms = 3;
    d.cap = cap_;
    d.C = p.chunk;
    d.W = p.window();
    d.D = s.D;
    d.Dv = s.Dv;
    d.Hq = s.Hq;
    d.Hk = s.Hk;
    d.sink = p.sink;
    d.rope_dims = p.rope_dims;
    d.max_splits = kMaxDecodeSplits;
    d.eps = static_cast<A>(p.ln_eps);
    d.scale = static_cast<A>(p.scale > 0 ? p.scale : 1.0 / std::sqrt(double(s.D)));
    d.merge_gate_keys = p.merge_gate_keys;
    d.merge_gate_values = p.merge_gate_values;
    d.head_temps = p.head_temps;
    d.value_radius = p.value_radius;
    d.gate_appends = p.gate_appends;
    d.gate_initial = p.gate_initial;
    KVMEM_RETURN_IF_ERROR(kvm_detail::SideStream::create(side_));
    if (o.beside) KVMEM_RETURN_IF_ERROR(kvm_detail::ReadoutPipeline::create(pipe_));
    KVMEM_RETURN_IF_ERROR(current_sm_count(sm_count_));
    // the budget's target |S| per update u (first token u C) along the one trajectory every sequence
    // follows (spec 3.1), read by the step kernels
    std::vector<std::int64_t> target(std::size_t(o.updates), 0);
    std::int64_t current = p.chunk;  // |S| at the first update: the C initial slots
    for (std::int64_t u = 1; u < o.updates; ++u) {
      target[std::size_t(u)] = p.budget.slots(p.window() + u * p.chunk, (u + 1) * p.chunk, current);
      current += std::max<std::int64_t>(0, std::min(target[std::size_t(u)] - current, p.chunk));
    }
    const cudaStream_t on = side_.stream;
    KVMEM_RETURN_IF_ERROR(to_status(cudaMemcpyAsync(base + o.update_target, target.data(),
                                                    target.size() * sizeof(std::int64_t), cudaMemcpyHostToDevice, on),
                                    "upload the budget's update targets"));
    // the decode split counters start at 0 (the last split of each step resets its own)
    KVMEM_RETURN_IF_ERROR(to_status(cudaMemsetAsync(d.counter, 0, std::size_t(s.B * s.Hq) * sizeof(int), on),
                                    "cudaMemsetAsync decode counters"));
    for (const std::size_t at : {o.slot_n, o.slot_cov, o.slot_s})
      KVMEM_RETURN_IF_ERROR(to_status(cudaMemsetAsync(base + at, 0, std::size_t(s.B) * sizeof(std::int64_t), on),
                                      "cudaMemsetAsync slot counters"));
    KVMEM_RETURN_IF_ERROR(
        to_status(cudaMemsetAsync(sc.seen, 0, std::size_t(s.B) * sizeof(int), on), "cudaMemsetAsync seen"));
    KVMEM_RETURN_IF_ERROR(
        to_status(cudaMemsetAsync(sc.status, 0, kvm_detail::kStatusWords * sizeof(int), on), "cudaMemsetAsync status"));
    // the host table dies here; this waits for the state's own side stream, nothing else
    return to_status(cudaStreamSynchronize(on), "state initialisation");
  }

  // Points the per-step arrays into `ws` (work_offsets for `rows` rows).
  void bind_workspace(unsigned char* ws, std::int64_t rows) {
    constexpr bool kBf16 = std::is_same_v<S, bf16>;
    const kvm_detail::KvmWorkOffsets o = kvm_detail::work_offsets<S, A>(params_, shape_, rows);
    auto& d = dev_;
    sc_.plan = reinterpret_cast<kvm_detail::SlotPlan*>(ws + o.plan);
    sc_.update_rows = reinterpret_cast<int*>(ws + o.update_rows);
    sc_.key = reinterpret_cast<unsigned long long*>(ws + o.key);
    d.k0 = reinterpret_cast<A*>(ws + o.k0);
    d.k0t = reinterpret_cast<A*>(ws + o.k0t);
    d.kgt = reinterpret_cast<A*>(ws + o.kgt);
    d.vg = reinterpret_cast<A*>(ws + o.vg);
    d.kg = reinterpret_cast<A*>(ws + o.kg);
    d.score = reinterpret_cast<A*>(ws + o.score);
    d.rbest = kBf16 ? reinterpret_cast<A*>(ws + o.rbest) : nullptr;
    d.target = reinterpret_cast<int*>(ws + o.target);
    d.partial = reinterpret_cast<A*>(ws + o.partial);
    ws_rows_ = rows;
    ws_total_ = o.bytes;
  }

  kvm::Params params_{};
  kvm::Shape shape_{};
  std::int64_t cap_ = 0;
  std::int64_t n_ = 0, cov_ = 0, slots_ = 0;  // host mirror of the shared counters
  int sm_count_ = 1;                          // multiprocessors: sizes the decode split-K grid
  kvm_detail::SideStream side_;               // next update's selection beside a prefill readout
  kvm_detail::ReadoutPipeline pipe_;          // readouts beside the update chain (bf16 tensor cores)
  // The readout rows' copies (all but copy 0 only with pipe_) and the live one, which dev_.khat / vhat
  // point to.
  S* khat_copy_[kvm_detail::kReadoutCopies] = {};
  S* vhat_copy_[kvm_detail::kReadoutCopies] = {};
  int live_copy_ = 0;
  DeviceBuffer owned_;             // create's allocation (empty for a placed state)
  unsigned char* base_ = nullptr;  // the persistent arrays (state_offsets)
  std::size_t state_total_ = 0;    // state_bytes of the problem
  std::size_t ws_total_ = 0;       // workspace bytes in use
  std::int64_t ws_rows_ = 0;       // rows the workspace serves (0: none)
  kvm_detail::DeviceState<S, A> dev_{};
  kvm_detail::SlotCounters sc_{};  // per-slot counters in device memory (kvm::step, slot operations)
  bool slot_mode_ = false;         // set by the first step or slot operation (slot_mode())
  std::int64_t khat32_rows_ = 0;   // slots whose khat32 the next step rebuilds (after fixed-batch calls)
};

namespace kvm_detail {

#if KVMEM_GPU_VENDOR_PATHS
// One pass of update_tc_scores_kernel (kMode: RtMode) for the update of tokens [a, a + C) over slots
// [j0, j1) on the tensor cores; bf16 storage with d.tc_route only.
template <int kD, int kTerms, int kMode>
Status launch_tc_scores_as(const Executor& exec, const DeviceState<bf16, float>& d, std::int64_t items, std::int64_t a,
                           std::int64_t j0, std::int64_t j1) {
  const auto kernel = update_tc_scores_kernel<kD, kTerms, kMode>;
  constexpr std::size_t bytes = rt_shared_bytes<kD, kTerms>();
  KVMEM_RETURN_IF_ERROR(allow_shared(kernel, bytes));
  const std::int64_t blocks = items * ((d.C + kRtTokens - 1) / kRtTokens);
  kernel<<<static_cast<unsigned>(blocks), 32 * kRtWarps, bytes, exec.stream>>>(d, a, j0, j1);
  return to_status(cudaGetLastError(), kMode == kRtNovelty ? "kvm update_tc_scores_kernel (novelty)"
                                                           : "kvm update_tc_scores_kernel (routes)");
}

// d.tc_route holds D in {64, 128}; Dims: a variant's fixed key dim instantiates only its own passes.
template <int kMode, class Dims>
Status launch_tc_scores(const Executor& exec, const DeviceState<bf16, float>& d, std::int64_t items, std::int64_t a,
                        std::int64_t j0, std::int64_t j1) {
  if constexpr (Dims::key_may_be(128))
    if (d.D == 128)
      return d.route_terms == 1 ? launch_tc_scores_as<128, 1, kMode>(exec, d, items, a, j0, j1)
                                : launch_tc_scores_as<128, 3, kMode>(exec, d, items, a, j0, j1);
  if constexpr (Dims::key_may_be(64))
    return d.route_terms == 1 ? launch_tc_scores_as<64, 1, kMode>(exec, d, items, a, j0, j1)
                              : launch_tc_scores_as<64, 3, kMode>(exec, d, items, a, j0, j1);
  return {StatusCode::kUnsupported, "kvm tensor-core routing: a key dim other than 64 or 128"};
}
#elif KVMEM_GPU_MFMA_PATHS
// The same pass on the AMD matrix cores (kvm_route_mfma.cuh).
template <int kMode, class Dims>
Status launch_tc_scores(const Executor& exec, const DeviceState<bf16, float>& d, std::int64_t items, std::int64_t a,
                        std::int64_t j0, std::int64_t j1) {
  if constexpr (Dims::key_may_be(128))
    if (d.D == 128)
      return d.route_terms == 1 ? launch_mfma_scores_as<128, 1, kMode>(exec, d, items, a, j0, j1)
                                : launch_mfma_scores_as<128, 3, kMode>(exec, d, items, a, j0, j1);
  if constexpr (Dims::key_may_be(64))
    return d.route_terms == 1 ? launch_mfma_scores_as<64, 1, kMode>(exec, d, items, a, j0, j1)
                              : launch_mfma_scores_as<64, 3, kMode>(exec, d, items, a, j0, j1);
  return {StatusCode::kUnsupported, "kvm matrix-core routing: a key dim other than 64 or 128"};
}
#endif  // KVMEM_GPU_VENDOR_PATHS, KVMEM_GPU_MFMA_PATHS

// Spec 4.5 on every item at once: U(tokens [a, a+C), N, avail) from `slots` slots. Returns the new |S|.
// Host-known shape of one update: U(tokens [a, a+C)) from `slots` slots to `after` (spec 3.1).
struct UpdatePlan {
  std::int64_t a = 0, slots = 0, n_app = 0, after = 0;
};

// Update steps 1-4 up to the routes (prepare, novelty, appends, merge targets). Reads the state and
// writes only new slots (j >= plan.slots) and the update workspace, so it may run while a readout of
// the current state is in flight; the scatter (update_finish) changes existing slots and may not.
// Dims: a variant's fixed head dims (HeadDims; its key dim outside {64, 128} compiles no tensor-core pass).
template <class Dims, class S, class A>
Status update_select(const Executor& exec, const DeviceState<S, A>& d, const kvm::Params& p, std::int64_t items,
                     std::int64_t a, std::int64_t slots, UpdatePlan& plan) {
  const std::int64_t C = p.chunk, N = p.window() + a, avail = a + C;
  const std::int64_t target = p.budget.slots(N, avail, slots);
  const std::int64_t n_app = std::min(target - slots, C);
  const std::int64_t after = slots + n_app;
  plan = UpdatePlan{a, slots, n_app, after};
  const auto grid = static_cast<unsigned>(items);
  bool tc = false;
  if constexpr (std::is_same_v<S, bf16> && (Dims::key_may_be(64) || Dims::key_may_be(128))) tc = d.tc_route;
  // Tensor-core routing needs no prepare pass: its first pass (novelty, or routing without appends)
  // builds the tokens' k0 / kg from their keys and writes the kg (k0) rows the appends and the scatter
  // add; the appends and a register scatter gate the values themselves. The fp32 sweeps, and a scatter
  // of values wider than 128 (memory form, reads vg rows), still take it.
  if (!tc || !scatter_in_registers(d)) {
    const dim3 pgrid(grid, static_cast<unsigned>((C + kWarpsPerBlock - 1) / kWarpsPerBlock));
    update_prepare_kernel<S, A><<<pgrid, kWarpSize * kWarpsPerBlock, 0, exec.stream>>>(d, a, n_app > 0);
    KVMEM_CUDA_RETURN_IF_LAUNCH_FAILED("kvm update_prepare_kernel");
  }
  const std::size_t tile_bytes = std::size_t(kSlotTile) * std::size_t(d.D) * sizeof(A);
  const std::size_t select_bytes = std::size_t(C) * (sizeof(A) + 2 * sizeof(int));
  const unsigned tblock = token_block(C);
  if (n_app > 0) {
    if (tc) {
#if KVMEM_GPU_VENDOR_PATHS || KVMEM_GPU_MFMA_PATHS
      if constexpr (std::is_same_v<S, bf16>)
        KVMEM_RETURN_IF_ERROR((launch_tc_scores<kRtNovelty, Dims>)(exec, d, items, a, 0, slots));
#endif
      update_append_kernel<S, A, true><<<grid, tblock, select_bytes, exec.stream>>>(d, a, slots, n_app);
    } else {
      const std::size_t bytes = tile_bytes + select_bytes;
      KVMEM_RETURN_IF_ERROR(allow_shared(update_append_kernel<S, A, false>, bytes));
      update_append_kernel<S, A, false><<<grid, tblock, bytes, exec.stream>>>(d, a, slots, n_app);
    }
    KVMEM_CUDA_RETURN_IF_LAUNCH_FAILED("kvm update_append_kernel");
  }
  if (n_app < C) {
    if (tc) {
      // after appends only the new slots remain to be scanned (the novelty pass took the old ones)
#if KVMEM_GPU_VENDOR_PATHS || KVMEM_GPU_MFMA_PATHS
      if constexpr (std::is_same_v<S, bf16>) {
        if (n_app > 0)
          KVMEM_RETURN_IF_ERROR((launch_tc_scores<kRtRouteNew, Dims>)(exec, d, items, a, slots, after));
        else
          KVMEM_RETURN_IF_ERROR((launch_tc_scores<kRtRoute, Dims>)(exec, d, items, a, p.sink, after));
      }
#endif
    } else {
      KVMEM_RETURN_IF_ERROR(allow_shared(update_route_kernel<S, A>, tile_bytes));
      update_route_kernel<S, A><<<grid, tblock, tile_bytes, exec.stream>>>(d, after);
      KVMEM_CUDA_RETURN_IF_LAUNCH_FAILED("kvm update_route_kernel");
    }
  }
  return Status::ok();
}

// Whether the scatter of an update refreshes every non-sink slot (the first update; see
// update_scatter_kernel) rather than only the slots some token was routed to.
inline bool scatter_takes_every_slot(const UpdatePlan& plan, std::int64_t C) {
  return plan.a == C;
}

// Whether update_finish launches a scatter for the plan: not when every token founded a slot (nothing
// merges), nor when every slot is a sink. The prefill's readout copies rotate exactly when it does.
inline bool update_scatters(const UpdatePlan& plan, const kvm::Params& p) {
  return plan.n_app < p.chunk && plan.after > p.sink;
}

// Update step 4 scatter (and the test hook's route log) of a selected update.
template <class S, class A>
Status update_finish(const Executor& exec, const DeviceState<S, A>& d, const kvm::Params& p, std::int64_t items,
                     const UpdatePlan& plan, kvm::RouteLog* log) {
  const std::int64_t C = p.chunk, a = plan.a, slots = plan.slots, after = plan.after;
  const auto grid = static_cast<unsigned>(items);
  if (plan.n_app < C) {
    if (update_scatters(plan, p)) {
      // The first update scatters every non-sink slot, later ones the touched slots only (see
      // update_scatter_kernel). About eight slots per warp (the stream of scatter_warp_stream): a
      // block's prologue (the targets, the first-token and count tables and the touched list) costs a
      // load round trip and two barriers before its warps start, which fewer slots a warp pay more
      // often; more slots a warp would give 16 sqrt N's blocks (about 1442 slots) 59 KB of shared memory
      // (three blocks an SM). At most 8192 slots (64 KB of tables) a block.
      constexpr std::int64_t kSlotsPerWarp = 8;
      const bool every_slot = scatter_takes_every_slot(plan, C);
      const std::int64_t range = after - p.sink, work = every_slot ? range : std::min(C, range);
      std::int64_t blocks =
          std::max<std::int64_t>(1, (work + kSlotsPerWarp * kWarpsPerBlock - 1) / (kSlotsPerWarp * kWarpsPerBlock));
      blocks = std::max<std::int64_t>(blocks, (range + 8191) / 8192);
      const std::int64_t per_block = (range + blocks - 1) / blocks;
      blocks = (range + per_block - 1) / per_block;
      const dim3 sgrid(grid, static_cast<unsigned>(blocks));
      const std::size_t bytes = scatter_shared_bytes(d, per_block);
      const bool async_rows = scatter_rows_async(d);
      const auto launch = [&](auto kernel) -> Status {
        KVMEM_RETURN_IF_ERROR(allow_shared(kernel, bytes));
        kernel<<<sgrid, kWarpSize * kWarpsPerBlock, bytes, exec.stream>>>(d, a, after, per_block, every_slot,
                                                                          async_rows);
        return Status::ok();
      };
      if (scatter_in_registers(d))
        KVMEM_RETURN_IF_ERROR(launch(update_scatter_kernel<S, A, true>));
      else
        KVMEM_RETURN_IF_ERROR(launch(update_scatter_kernel<S, A, false>));
    }
    KVMEM_CUDA_RETURN_IF_LAUNCH_FAILED("kvm update_scatter_kernel");
  }
  if (log != nullptr) {  // test hook (spec 2): synchronises, never used on an engine's path
    std::vector<int> targets(std::size_t(items * C));
    KVMEM_RETURN_IF_ERROR(to_status(
        cudaMemcpyAsync(targets.data(), d.target, targets.size() * sizeof(int), cudaMemcpyDeviceToHost, exec.stream),
        "route log copy"));
    KVMEM_RETURN_IF_ERROR(to_status(cudaStreamSynchronize(exec.stream), "route log sync"));
    log->items.resize(std::size_t(items));
    for (std::int64_t i = 0; i < items; ++i) {
      kvm::UpdateRoute r;
      r.first_token = a;
      r.slots_before = slots;
      r.slots_after = after;
      for (std::int64_t c = 0; c < C; ++c) {
        const int t = targets[std::size_t(i * C + c)];
        r.target.push_back(t);
        if (t == -1) r.appended.push_back(a + c);
      }
      log->items[std::size_t(i)].push_back(std::move(r));
    }
  }
  return Status::ok();
}

// With readouts beside the chain: the rows of readout copy `to` that the scatter of a selected update
// (update_finish, writing `to`) does not refresh, copied from the live copy `from`
// (copy_unrefreshed_rows_kernel). Reads the update's merge targets: enqueue it after update_select.
template <class S, class A>
Status launch_copy_unrefreshed(const Executor& exec, const DeviceState<S, A>& d, const kvm::Params& p,
                               std::int64_t items, const UpdatePlan& plan, const S* khat_from, const S* vhat_from,
                               S* khat_to, S* vhat_to) {
  const std::int64_t end = scatter_takes_every_slot(plan, p.chunk) ? std::min(p.sink, plan.after) : plan.after;
  if (end == 0) return Status::ok();  // the first update of a state without sinks: the scatter writes every row
  const dim3 grid(static_cast<unsigned>(items),
                  static_cast<unsigned>((end + kCopySlotsPerBlock - 1) / kCopySlotsPerBlock));
  copy_unrefreshed_rows_kernel<S, A>
      <<<grid, kWarpSize * kWarpsPerBlock, 0, exec.stream>>>(d, khat_from, vhat_from, khat_to, vhat_to, end);
  KVMEM_CUDA_RETURN_IF_LAUNCH_FAILED("kvm copy_unrefreshed_rows_kernel");
  return Status::ok();
}

// The prefill readout kernels of a call's shape: `rows`, the scalar kernel (head dims 64 and 128
// keep each row's query and accumulator in registers, others use shared memory), and `tc`, the
// tensor-core kernel for bf16 storage with head dims 128 or 64 (q.k and p.v on the tensor cores, or on
// the matrix cores of an AMD GPU: kvm_attend_mfma.cuh; nullptr for other shapes), which a prefill takes
// when there is one, with tc_threads threads and tc_rows query rows per block. Dims: a variant's fixed
// head dims (HeadDims), whose kernels alone are instantiated (at 64/64 or 128/128 the generic scalar
// kernel is not).
template <class S, class A, class In, class Out, class Dims = HeadDims<>>
struct ReadoutKernels {
  using Rows = void (*)(DeviceState<S, A>, const In*, Out*, std::int64_t, std::int64_t, std::int64_t, std::int64_t,
                        std::int64_t, std::int64_t);
#if KVMEM_GPU_VENDOR_PATHS || KVMEM_GPU_MFMA_PATHS
  using Tc = void (*)(DeviceState<bf16, float>, TcSources, const In*, Out*, std::int64_t, std::int64_t, std::int64_t,
                      std::int64_t, std::int64_t, std::int64_t);
#else
  using Tc = const void*;  // the portable path has no tensor-core readout: always nullptr
#endif
  // Whether the variant's dims are one of the register / tensor-core shapes (kDim, kDim) for sure.
  static constexpr bool kSquare = Dims::kFixed && Dims::kKey == Dims::kValue;
  static constexpr bool kOwnShape = kSquare && (Dims::kKey == 64 || Dims::kKey == 128);

  Rows rows = nullptr;
  std::size_t rows_bytes = 0;
  Tc tc = nullptr;
  std::size_t tc_bytes = 0;
  int tc_threads = 0;
  std::int64_t tc_rows = 0;
  const char* tc_name = "";

  explicit ReadoutKernels(const kvm::Shape& sh) {
    if constexpr (Dims::key_may_be(128) && Dims::value_may_be(128))
      if (sh.D == 128 && sh.Dv == 128) {
        take<128>(sh);
        return;
      }
    if constexpr (Dims::key_may_be(64) && Dims::value_may_be(64))
      if (sh.D == 64 && sh.Dv == 64) {
        take<64>(sh);
        return;
      }
    if constexpr (!kOwnShape) {
      rows = attend_rows_kernel<S, A, In, Out, 0, 0>;
      rows_bytes = attend_shared_bytes<0, 0>(sh.D, sh.Dv, sizeof(A));
    }
  }
  // The kernels of head dims D = Dv = kDim (64 or 128): the register-resident scalar kernel and, for bf16
  // storage, the tensor-core (matrix-core) kernel.
  template <int kDim>
  void take(const kvm::Shape& sh) {
    rows = attend_rows_kernel<S, A, In, Out, kDim, kDim>;
    rows_bytes = attend_shared_bytes<kDim, kDim>(sh.D, sh.Dv, sizeof(A));
#if KVMEM_GPU_VENDOR_PATHS
    if constexpr (std::is_same_v<S, bf16>) {
      tc = attend_tc_kernel<In, Out, kDim, kDim>;
      tc_bytes = TcLayout<kDim, kDim>::kBytes;
      tc_threads = kTcThreads;
      tc_rows = kTcRows;
      tc_name = "kvm attend_tc_kernel";
    }
#elif KVMEM_GPU_MFMA_PATHS
    if constexpr (std::is_same_v<S, bf16>) {
      tc = attend_mfma_kernel<In, Out, kDim, kDim>;
      tc_bytes = MfmaReadoutLayout<kDim, kDim>::kBytes;
      tc_threads = kMfmaReadoutThreads;
      tc_rows = kMfmaReadoutRows;
      tc_name = "kvm attend_mfma_kernel";
    }
#endif
  }

  // Opts the kernels into their dynamic shared memory (a driver call each).
  Status allow_shared_memory() const {
    KVMEM_RETURN_IF_ERROR(allow_shared(rows, rows_bytes));
    if (tc != nullptr) KVMEM_RETURN_IF_ERROR(allow_shared(tc, tc_bytes));
    return Status::ok();
  }
};

// One decode step (spec 4.7) of every row in one fused launch: ring append, split-K attention over
// [slots | window [wb, t0]] and the merge of the splits. bf16 storage with head dims 128 takes the
// vectorised kernel whose splits merge through a cluster's shared memory; other shapes the generic one.
// Dims: a variant's fixed head dims (HeadDims); at D = Dv = kDecodeDim with bf16 storage only the vectorised
// kernel is instantiated, at other fixed dims only the generic one.
template <class Dims, class S, class A, class In, class Out>
Status launch_decode_step(const Executor& exec, const DeviceState<S, A>& d, const kvm::Shape& sh, int sm_count,
                          const In* qd, const In* kd, const In* vd, const In* gd, Out* od, std::int64_t t0,
                          std::int64_t wb, std::int64_t slots) {
  const std::int64_t keys = (wb > 0 ? slots : 0) + (t0 - wb + 1);
  const std::int64_t rows = sh.B * sh.Hq;
  [[maybe_unused]] bool vectorised = false;
#if KVMEM_GPU_VENDOR_PATHS
  // programmatic dependent launch: the step's blocks may be scheduled while the previous kernel
  // finishes (they wait for it before touching memory), which hides a launch latency per token
  cudaLaunchAttribute attrs[2]{};
  attrs[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attrs[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t cfg{};
  cfg.stream = exec.stream;
  cfg.attrs = attrs;
  cfg.numAttrs = 1;
  if constexpr (std::is_same_v<S, bf16> && std::is_same_v<A, float> && Dims::key_may_be(kDecodeDim) &&
                Dims::value_may_be(kDecodeDim)) {
    if (sh.D == kDecodeDim && sh.Dv == kDecodeDim) {
      // the whole grid resident at once (kDecodeBlocksPerSm per SM), at least a round of warp units per
      // split, and the splits of a row in one cluster
      const std::int64_t resident = kDecodeBlocksPerSm * std::int64_t(sm_count);
      const int heads = decode_heads_per_block(rows, sh.Hq / sh.Hk, resident);  // query heads sharing a block
      const DecodeSplits sp = decode_splits(rows / heads, keys, resident, kDecodeMaxCluster, kDecodeSplitGranule);
      cfg.gridDim = dim3(static_cast<unsigned>(rows / heads), static_cast<unsigned>(sp.splits));
      cfg.blockDim = dim3(kDecodeThreads);
      cfg.dynamicSmemBytes = kDecodeSmemBytes;
      if (sp.splits > 1) {
        attrs[1].id = cudaLaunchAttributeClusterDimension;
        attrs[1].val.clusterDim.x = 1;
        attrs[1].val.clusterDim.y = static_cast<unsigned>(sp.splits);
        attrs[1].val.clusterDim.z = 1;
        cfg.numAttrs = 2;
      }
      const auto launch = [&](auto kernel) {
        return to_status(
            cudaLaunchKernelEx(&cfg, kernel, d, qd, kd, vd, gd, od, t0, wb, slots, sp.per, static_cast<int>(sp.splits)),
            "kvm decode_fused_bf16_kernel");
      };
      KVMEM_RETURN_IF_ERROR(heads == 4   ? launch(decode_fused_bf16_kernel<In, Out, 4>)
                            : heads == 2 ? launch(decode_fused_bf16_kernel<In, Out, 2>)
                                         : launch(decode_fused_bf16_kernel<In, Out, 1>));
      vectorised = true;
    }
  }
  // with bf16 storage at fixed D = Dv = kDecodeDim every call is vectorised: no generic kernel
  constexpr bool kOnlyVectorised = std::is_same_v<S, bf16> && std::is_same_v<A, float> && Dims::kFixed &&
                                   Dims::kKey == kDecodeDim && Dims::kValue == kDecodeDim;
#else
  constexpr bool kOnlyVectorised = false;
#endif
  if constexpr (!kOnlyVectorised)
    if (!vectorised) {
      // enough blocks to fill the device (16 blocks of 128 threads per SM), at least 32 keys a split
      const DecodeSplits sp = decode_splits(rows, keys, 16 * std::int64_t(sm_count), kMaxSplitsPerRow, 32);
      const dim3 grid(static_cast<unsigned>(rows), static_cast<unsigned>(sp.splits));
      const std::size_t bytes = (std::size_t(sh.D) + 4 * std::size_t(sh.Dv) + 4) * sizeof(A);
#if KVMEM_GPU_VENDOR_PATHS
      cfg.gridDim = grid;
      cfg.blockDim = dim3(128);
      cfg.dynamicSmemBytes = bytes;
      KVMEM_RETURN_IF_ERROR(to_status(cudaLaunchKernelEx(&cfg, decode_fused_kernel<S, A, In, Out>, d, qd, kd, vd, gd,
                                                         od, t0, wb, slots, sp.per, static_cast<int>(sp.splits)),
                                      "kvm decode_fused_kernel"));
#else
      // the portable path launches without programmatic dependence (the kernel's wait is a no-op)
      decode_fused_kernel<S, A, In, Out><<<grid, 128, bytes, exec.stream>>>(d, qd, kd, vd, gd, od, t0, wb, slots,
                                                                            sp.per, static_cast<int>(sp.splits));
      KVMEM_CUDA_RETURN_IF_LAUNCH_FAILED("kvm decode_fused_kernel");
#endif
    }
  return Status::ok();
}

}  // namespace kvm_detail

// One call of T tokens for every sequence (T = 1 is a decode step). See the header comment. Dims: a
// composed variant's fixed head dims (HeadDims<D, Dv>: only the kernels of those dims are instantiated, a
// state of other dims is refused), or HeadDims<> (the run-time choice, kvm_run).
template <class Dims, class S, class A, class In, class Out>
Status kvm_run_as(Dims, const Executor& exec, KvmState<S, A>& state, const KvmWeights& w,
                  TensorView<const In, 4> q,     // [B,Hq,T,D]   device
                  TensorView<const In, 4> k,     // [B,Hk,T,D]   device
                  TensorView<const In, 4> v,     // [B,Hk,T,Dv]  device
                  TensorView<const In, 3> gate,  // [B,Hk,T]     device
                  TensorView<Out, 4> out,        // [B,T,Hq,Dv]  device
                  kvm::RouteLog* log) {
  using namespace kvm_detail;
  if (!state.valid())
    return invalid_argument("state", "a KvmState made by KvmState::create or place",
                            "an empty (never created or moved-from) KvmState");
  if (!Dims::key_may_be(state.shape_.D) || !Dims::value_may_be(state.shape_.Dv))
    return invalid_argument("D, Dv", kvmem::detail::concat("the variant's head dims ", Dims::kKey, ", ", Dims::kValue),
                            kvmem::detail::concat(state.shape_.D, ", ", state.shape_.Dv));
  if (state.slot_mode_)
    return invalid_argument("state", "a state of the fixed-batch calls (one token count for every sequence)",
                            "a state driven by kvm::step or slot operations (per-slot counters): use kvm::step");
  const kvm::Shape& sh = state.shape_;
  const kvm::Params& p = state.params_;
  const std::int64_t B = sh.B, T = q.extent(2);
  KVMEM_RETURN_IF_ERROR(state.check_workspace(B));  // one work item per (slot, KV head)
  KVMEM_RETURN_IF_ERROR(kvm::check_call_shapes(sh, q, k, v, gate, out));
  if (!q.is_contiguous() || !k.is_contiguous() || !v.is_contiguous() || !gate.is_contiguous() || !out.is_contiguous())
    return invalid_argument("q, k, v, gate, out", "contiguous row-major views", "a strided view");
  if (!w.ln_weight || !w.ln_bias || !w.tau_state || !w.tau_bswa)
    return invalid_argument("weights", "device pointers for ln_weight, ln_bias, tau_state, tau_bswa", "nullptr");
  if (state.n_ + T > sh.n_ctx)
    return {StatusCode::kOutOfRange, std::to_string(state.n_) + " + " + std::to_string(T) +
                                         " tokens exceed the state's n_ctx = " + std::to_string(sh.n_ctx)};
  static_assert(std::is_same_v<A, float>, "cuda KVM: the accumulate type is float (weights are float)");
  DeviceState<S, A>& d = state.dev_;  // weights are read in place: no copy on the hot path
  d.ln_w = w.ln_weight;
  d.ln_b = w.ln_bias;
  d.tau_s = w.tau_state;
  d.tau_w = w.tau_bswa;

  const kvm::Geometry geo = p.geometry();
  const std::int64_t C = p.chunk, items = B * sh.Hk, n0 = state.n_;
  std::int64_t cov = state.cov_, slots = state.slots_;
  const ReadoutKernels<S, A, In, Out, Dims> readout(sh);
  // A decode call (T = 1) never launches the readout kernels: keep the driver calls off its hot path.
  if (T > 1) KVMEM_RETURN_IF_ERROR(readout.allow_shared_memory());
  // ingest copies whole 16-byte vectors when the inputs are in the window type and every row is aligned
  const bool copy16 = std::is_same_v<In, Win<S>> && rows_16byte_aligned(k) && rows_16byte_aligned(v);
  const SideStream& side = state.side_;
  // A prefill on the tensor cores whose k/v inputs the readout can copy as they are (storage type,
  // 16-byte rows) reads each chunk's window from them when they hold all of it, and the updates read
  // their tokens there too: a chunk enters the ring only if a later reader needs it there (founding,
  // a readout whose window starts before the call, the call's last window).
  const bool window_in_inputs = T > 1 && readout.tc != nullptr && copy16;
  // Readouts off the update chain (ReadoutPipeline) where the state has the pipeline: the chain of
  // updates then runs on the side stream, the readouts on the caller's stream.
  const ReadoutPipeline& pipe = state.pipe_;
  const bool detach = window_in_inputs && state.readouts_beside_updates();
  const Executor chain = detach ? Executor{side.stream} : exec;
  d.in_k = d.in_v = d.in_g = nullptr;
  d.in_first = n0;
  d.in_count = T;
  if constexpr (std::is_same_v<In, Win<S>>) {
    if (window_in_inputs) {
      d.in_k = k.data();
      d.in_v = v.data();
      d.in_g = gate.data();
    }
  }
  const auto record = [](cudaEvent_t e, cudaStream_t on) {
    return to_status(cudaEventRecord(e, on), "cudaEventRecord");
  };
  const auto wait = [](cudaStream_t s, cudaEvent_t e) {
    return to_status(cudaStreamWaitEvent(s, e, 0), "cudaStreamWaitEvent");
  };
  std::int64_t aux_records = 0;                         // aux_done records of this call
  bool copy_read[kReadoutCopies] = {};                  // a readout of this call read readout copy r (pipe.read[r])
  const auto chain_waits_aux = [&](std::int64_t age) {  // the chain waits for the aux work `age` chunks back
    return aux_records > age ? wait(side.stream, pipe.aux_done[(aux_records - 1 - age) % 2]) : Status::ok();
  };
  if (detach) {
    KVMEM_RETURN_IF_ERROR(record(side.fork, exec.stream));
    KVMEM_RETURN_IF_ERROR(wait(side.stream, side.fork));
  }
  UpdatePlan pending{};
  bool selected = false;  // the selection of the next update already runs on the side stream
  for (std::int64_t t0 = n0; t0 < n0 + T;) {
    const std::int64_t t1 = std::min(n0 + T, (t0 / C + 1) * C);
    const std::int64_t wb = geo.bswa_begin(t0 + 1);
    if (cov < wb) {  // spec 4.7 step 4: the first token of a new chunk, before its attention
      UpdatePlan plan{};
      if (selected) {
        plan = pending;
        selected = false;
        KVMEM_RETURN_IF_ERROR(to_status(cudaStreamWaitEvent(exec.stream, side.join, 0), "cudaStreamWaitEvent (join)"));
      } else {
        // The selection reads the tokens leaving the window (ingested nb chunks back) and the slots:
        // with nb >= 2 that is aux work two chunks back, so the latest ingest runs beside it.
        if (detach) KVMEM_RETURN_IF_ERROR(chain_waits_aux(p.window_chunks == 1 ? 0 : 1));
        KVMEM_RETURN_IF_ERROR(update_select<Dims>(chain, d, p, items, cov, slots, plan));
      }
      // Beside the readouts the scatter writes the next readout copy once the readout that last read
      // it is done (ReadoutPipeline); it reads the ring rows ingested last. The rows it does not
      // refresh are copied into that copy on aux beside it, once the routing has written the targets
      // (event `selected`); the chain waits for that copy (event `copied`) before it goes on: the
      // readout (after `chained`) reads the whole copy, the next selection reads it and rewrites the
      // targets.
      const bool flip = detach && update_scatters(plan, p);
      const int next = (state.live_copy_ + 1) % kReadoutCopies;
      if (flip) {
        KVMEM_RETURN_IF_ERROR(record(pipe.selected, side.stream));
        KVMEM_RETURN_IF_ERROR(wait(pipe.aux, pipe.selected));
        if (copy_read[next]) KVMEM_RETURN_IF_ERROR(wait(pipe.aux, pipe.read[next]));
        KVMEM_RETURN_IF_ERROR(launch_copy_unrefreshed(Executor{pipe.aux}, d, p, items, plan, d.khat, d.vhat,
                                                      state.khat_copy_[next], state.vhat_copy_[next]));
        KVMEM_RETURN_IF_ERROR(record(pipe.copied, pipe.aux));
      }
      if (detach) KVMEM_RETURN_IF_ERROR(chain_waits_aux(0));
      if (flip) {  // copy `next` becomes live only if the update was enqueued
        if (copy_read[next]) KVMEM_RETURN_IF_ERROR(wait(side.stream, pipe.read[next]));
        d.khat = state.khat_copy_[next];
        d.vhat = state.vhat_copy_[next];
      }
      const Status finished = update_finish(chain, d, p, items, plan, log);
      if (flip) {
        // the chain joins the copy even if the scatter failed: no later write of copy `next` (another
        // flip's scatter) may run beside it
        const Status joined = wait(side.stream, pipe.copied);
        if (finished.is_ok() && joined.is_ok()) {
          state.live_copy_ = next;
        } else {
          d.khat = state.khat_copy_[state.live_copy_];
          d.vhat = state.vhat_copy_[state.live_copy_];
        }
        KVMEM_RETURN_IF_ERROR(joined);
      }
      KVMEM_RETURN_IF_ERROR(finished);
      slots = plan.after;
      cov += C;
    }
    const bool decode_step = t1 - t0 == 1 && T == 1;
    const bool founds = t0 < C && t1 > cov;  // initial slots founded by positions [cov, min(t1, C))
    // the readout of [t0, t1) sees the slots (when wb > 0) and the window [wb, t1); it reads the
    // window from the inputs, and is detached, when the whole window is in this call's inputs
    const std::int64_t readout_slots = slots + (founds ? std::min(t1, C) - std::max(t0, cov) : 0);
    const bool reads_inputs = window_in_inputs && wb >= n0;
    const bool detached_readout = detach && reads_inputs;
    [[maybe_unused]] const bool reads_slots = detached_readout && wb > 0 && readout_slots > 0;
    const Executor ingest_on = detach ? Executor{pipe.aux} : chain;
    if (detach) {  // after this chunk's update: aux ingests, the readout may read the slots
      KVMEM_RETURN_IF_ERROR(record(pipe.chained, side.stream));
      KVMEM_RETURN_IF_ERROR(wait(pipe.aux, pipe.chained));
    }
    // a decode step appends its token inside the fused kernel
    const bool ingest = window_in_inputs ? founds || !reads_inputs || t1 > n0 + T - p.window() : !decode_step || founds;
    if (ingest) {
      const dim3 igrid(static_cast<unsigned>(items),
                       static_cast<unsigned>((t1 - t0 + kWarpsPerBlock - 1) / kWarpsPerBlock));
      ingest_kernel<S, A, In><<<igrid, kWarpSize * kWarpsPerBlock, 0, ingest_on.stream>>>(
          d, k.data(), v.data(), gate.data(), T, n0, t0, t1, cov, copy16);
      KVMEM_CUDA_RETURN_IF_LAUNCH_FAILED("kvm ingest_kernel");
    }
    if (detach) {
      KVMEM_RETURN_IF_ERROR(record(pipe.aux_done[aux_records % 2], pipe.aux));
      ++aux_records;
    }
    if (founds) {
      slots = readout_slots;
      cov = std::min(t1, C);
    }
    if (decode_step) {  // one fused launch: ring append + split-K attention + merge of the splits
      KVMEM_RETURN_IF_ERROR(launch_decode_step<Dims>(exec, d, sh, state.sm_count_, q.data(), k.data(), v.data(),
                                                     gate.data(), out.data(), t0, wb, slots));
    } else {
      // The update before the next chunk (if this call reaches it) selects from the state this chunk
      // reads and writes only new slots: run that part beside the readout (spec 4.6: the readout of
      // a chunk needs only the state before it). The scatter waits for both (join, stream order).
      // Detached readouts need no such overlap: the whole chain runs beside them.
      if (!detach && t1 < n0 + T && cov < geo.bswa_begin(t1 + 1)) {
        KVMEM_RETURN_IF_ERROR(to_status(cudaEventRecord(side.fork, exec.stream), "cudaEventRecord (fork)"));
        KVMEM_RETURN_IF_ERROR(to_status(cudaStreamWaitEvent(side.stream, side.fork, 0), "cudaStreamWaitEvent (fork)"));
        KVMEM_RETURN_IF_ERROR(update_select<Dims>(Executor{side.stream}, d, p, items, cov, slots, pending));
        KVMEM_RETURN_IF_ERROR(to_status(cudaEventRecord(side.join, side.stream), "cudaEventRecord (join)"));
        selected = true;
      }
      bool on_tensor_cores = false;
#if KVMEM_GPU_VENDOR_PATHS || KVMEM_GPU_MFMA_PATHS
      if constexpr (std::is_same_v<S, bf16>) {
        if (readout.tc != nullptr) {
          const std::int64_t grid = B * sh.Hq * ((t1 - t0 + readout.tc_rows - 1) / readout.tc_rows);
          TcSources src{d.khat, d.vhat, d.wk, d.wv, d.W, 0, true};
          cudaStream_t on = chain.stream;
          if constexpr (std::is_same_v<In, S>) {
            if (reads_inputs) src = TcSources{d.khat, d.vhat, k.data(), v.data(), T, n0, false};
          }
          if (detached_readout) {
            if (reads_slots) KVMEM_RETURN_IF_ERROR(wait(exec.stream, pipe.chained));
            on = exec.stream;
          } else if (detach) {  // a window that starts before this call: the ring, in chain order
            KVMEM_RETURN_IF_ERROR(chain_waits_aux(0));
          }
          readout.tc<<<static_cast<unsigned>(grid), readout.tc_threads, readout.tc_bytes, on>>>(
              d, src, q.data(), out.data(), T, n0, t0, t1, wb, readout_slots);
          KVMEM_CUDA_RETURN_IF_LAUNCH_FAILED(readout.tc_name);
          if (reads_slots) {
            KVMEM_RETURN_IF_ERROR(record(pipe.read[state.live_copy_], exec.stream));
            copy_read[state.live_copy_] = true;
          }
          on_tensor_cores = true;
        }
      }
#endif
      if (!on_tensor_cores) {
        const dim3 agrid(static_cast<unsigned>(B * sh.Hq),
                         static_cast<unsigned>((t1 - t0 + kRowsPerBlock - 1) / kRowsPerBlock));
        readout.rows<<<agrid, kRowsPerBlock * kLanesPerRow, readout.rows_bytes, chain.stream>>>(
            d, q.data(), out.data(), T, n0, t0, t1, wb, slots);
        KVMEM_CUDA_RETURN_IF_LAUNCH_FAILED("kvm attend_rows_kernel");
      }
    }
    t0 = t1;
  }
  if (detach) {  // join: the caller's stream waits for the chain, which waits for the last aux work
    KVMEM_RETURN_IF_ERROR(chain_waits_aux(0));
    KVMEM_RETURN_IF_ERROR(record(side.join, side.stream));
    KVMEM_RETURN_IF_ERROR(wait(exec.stream, side.join));
  }
  state.n_ = n0 + T;
  state.cov_ = cov;
  state.slots_ = slots;
  return Status::ok();
}

template <class S, class A, class In, class Out>
Status kvm_run(const Executor& exec, KvmState<S, A>& state, const KvmWeights& w,
               TensorView<const In, 4> q,     // [B,Hq,T,D]   device
               TensorView<const In, 4> k,     // [B,Hk,T,D]   device
               TensorView<const In, 4> v,     // [B,Hk,T,Dv]  device
               TensorView<const In, 3> gate,  // [B,Hk,T]     device
               TensorView<Out, 4> out,        // [B,T,Hq,Dv]  device
               kvm::RouteLog* log = nullptr) {
  return kvm_run_as(HeadDims<>{}, exec, state, w, q, k, v, gate, out, log);
}

// Prefill T tokens of every sequence (chunked exactly like spec 4.6; a non-empty state continues).
template <class S, class A, class In, class Out>
Status kvm_prefill(const Executor& exec, KvmState<S, A>& state, const KvmWeights& w, TensorView<const In, 4> q,
                   TensorView<const In, 4> k, TensorView<const In, 4> v, TensorView<const In, 3> gate,
                   TensorView<Out, 4> out, kvm::RouteLog* log = nullptr) {
  return kvm_run(exec, state, w, q, k, v, gate, out, log);
}

// One token per sequence (spec 4.7): the update on the first token of a new chunk, then split-K attention.
template <class S, class A, class In, class Out>
Status kvm_decode(const Executor& exec, KvmState<S, A>& state, const KvmWeights& w, TensorView<const In, 4> q,
                  TensorView<const In, 4> k, TensorView<const In, 4> v, TensorView<const In, 3> gate,
                  TensorView<Out, 4> out, kvm::RouteLog* log = nullptr) {
  if (q.extent(2) != 1) return invalid_argument("decode q tokens", 1, q.extent(2));
  return kvm_run(exec, state, w, q, k, v, gate, out, log);
}

namespace kvm_detail {

// The readout kernel of a launch shape (slot_readout_shape: kRep heads of 1, 2, 4, 8; 4 registers for
// Dv <= 128, else 8). Dims: a variant's fixed value dim instantiates only the kernels of its register count.
template <class S, class In, class Out, int kRegs>
auto slot_readout_kernel_regs(int rep) {
  if constexpr (kRegs == 4)
    return rep == 8   ? slot_readout_kernel<S, In, Out, 8, 4>
           : rep == 4 ? slot_readout_kernel<S, In, Out, 4, 4>
           : rep == 2 ? slot_readout_kernel<S, In, Out, 2, 4>
                      : slot_readout_kernel<S, In, Out, 1, 4>;
  else
    return rep == 4   ? slot_readout_kernel<S, In, Out, 4, 8>
           : rep == 2 ? slot_readout_kernel<S, In, Out, 2, 8>
                      : slot_readout_kernel<S, In, Out, 1, 8>;
}
template <class S, class In, class Out, class Dims = HeadDims<>>
auto slot_readout_kernel_for(const SlotReadoutShape& shape) {
  if constexpr (Dims::kValue == kAnyDim)
    return shape.regs == 4 ? slot_readout_kernel_regs<S, In, Out, 4>(shape.rep)
                           : slot_readout_kernel_regs<S, In, Out, 8>(shape.rep);
  else
    return slot_readout_kernel_regs<S, In, Out, (Dims::kValue <= 128 ? 4 : 8)>(shape.rep);
}

// The host side of kvm::step and the slot operations on a KvmState (docs/slots.md).
struct SlotAccess {
  template <class S, class A>
  static Status check_state(const KvmState<S, A>& st) {
    if (!st.valid())
      return invalid_argument("state", "a KvmState made by KvmState::create or place",
                              "an empty (never created or moved-from) KvmState");
    return Status::ok();
  }

  static Status check_slot(std::int64_t slot, std::int64_t max_slots) {
    if (slot < 0 || slot >= max_slots)
      return {StatusCode::kOutOfRange,
              "slot: expected 0 <= slot < max_slots = " + std::to_string(max_slots) + ", got " + std::to_string(slot)};
    return Status::ok();
  }

  // The first step or slot operation after fixed-batch calls gives every slot their shared counters,
  // and the next step rebuilds khat32 (LN_s of the sums, which the step's update passes read) for
  // those slots: the fixed-batch kernels round it their own way, or skip it (tensor-core routing).
  template <class S, class A>
  static Status enter_slot_mode(const Executor& exec, KvmState<S, A>& st) {
    if (st.slot_mode_) return Status::ok();
    if (st.n_ > 0) {
      slot_set_counters_kernel<<<1, 256, 0, exec.stream>>>(st.sc_, 0, st.shape_.B, st.n_, st.cov_, st.slots_);
      KVMEM_CUDA_RETURN_IF_LAUNCH_FAILED("kvm slot_set_counters_kernel");
      st.khat32_rows_ = st.slots_;
    }
    st.slot_mode_ = true;
    return Status::ok();
  }

  template <class S, class A>
  static void bind_weights(KvmState<S, A>& st, const KvmWeights& w) {
    st.dev_.ln_w = w.ln_weight;
    st.dev_.ln_b = w.ln_bias;
    st.dev_.tau_s = w.tau_state;
    st.dev_.tau_w = w.tau_bswa;
  }

  // Dims: a composed variant's fixed head dims (HeadDims; only their readout kernels are instantiated, a
  // state of other dims is refused), or HeadDims<> (the run-time choice).
  template <class S, class A, class In, class Out, class Dims = HeadDims<>>
  static Status step(const Executor& exec, KvmState<S, A>& st, const KvmWeights& w, const Rows& rows,
                     TensorView<const In, 3> q, TensorView<const In, 3> k, TensorView<const In, 3> v,
                     TensorView<const In, 2> gate, TensorView<Out, 3> out, TensorView<float, 2> lse, Dims = {}) {
    static_assert(std::is_same_v<A, float>, "cuda kvm::step: the accumulate type is float");
    KVMEM_RETURN_IF_ERROR(check_state(st));
    const kvm::Shape& sh = st.shape_;
    if (!Dims::key_may_be(sh.D) || !Dims::value_may_be(sh.Dv))
      return invalid_argument("D, Dv",
                              kvmem::detail::concat("the variant's head dims ", Dims::kKey, ", ", Dims::kValue),
                              kvmem::detail::concat(sh.D, ", ", sh.Dv));
    const kvm::Params& p = st.params_;
    const std::int64_t tokens = q.extent(0), R = rows.count();
    KVMEM_RETURN_IF_ERROR(check_shape(q, {tokens, sh.Hq, sh.D}, "q [tokens,Hq,D]"));
    KVMEM_RETURN_IF_ERROR(check_shape(k, {tokens, sh.Hk, sh.D}, "k [tokens,Hk,D]"));
    KVMEM_RETURN_IF_ERROR(check_shape(v, {tokens, sh.Hk, sh.Dv}, "v [tokens,Hk,Dv]"));
    KVMEM_RETURN_IF_ERROR(check_shape(gate, {tokens, sh.Hk}, "gate [tokens,Hk]"));
    KVMEM_RETURN_IF_ERROR(check_shape(out, {tokens, sh.Hq, sh.Dv}, "out [tokens,Hq,Dv]"));
    if (!lse.empty()) KVMEM_RETURN_IF_ERROR(check_shape(lse, {tokens, sh.Hq}, "lse [tokens,Hq]"));
    if (!q.is_contiguous() || !k.is_contiguous() || !v.is_contiguous() || !gate.is_contiguous() ||
        !out.is_contiguous() || (!lse.empty() && !lse.is_contiguous()))
      return invalid_argument("q, k, v, gate, out, lse", "contiguous row-major views", "a strided view");
    if (rows.query_start.extent(0) != R + 1)
      return invalid_argument("query_start shape", "[rows + 1] = [" + std::to_string(R + 1) + "]",
                              shape_string(rows.query_start.extents()));
    if (!rows.slot.is_contiguous() || !rows.query_start.is_contiguous())
      return invalid_argument("rows", "contiguous slot and query_start views", "a strided view");
    if (R > 0 && (rows.slot.data() == nullptr || rows.query_start.data() == nullptr))
      return invalid_argument("rows", "device pointers for slot and query_start", "nullptr");
    if (rows.max_query_len < 0) return invalid_argument("max_query_len", ">= 0 (0: no bound)", rows.max_query_len);
    if (R == 0) return tokens == 0 ? Status::ok() : invalid_argument("tokens", "0 for an empty batch", tokens);
    KVMEM_RETURN_IF_ERROR(st.check_workspace(R));  // one work item per (row, KV head), padding rows too
    if (!w.ln_weight || !w.ln_bias || !w.tau_state || !w.tau_bswa)
      return invalid_argument("weights", "device pointers for ln_weight, ln_bias, tau_state, tau_bswa", "nullptr");
    if (sh.Dv > 32 * kSlotReadoutMaxRegs)
      return {StatusCode::kUnsupported, "cuda kvm::step: Dv must be <= " + std::to_string(32 * kSlotReadoutMaxRegs) +
                                            ", got " + std::to_string(sh.Dv)};
    KVMEM_RETURN_IF_ERROR(enter_slot_mode(exec, st));
    bind_weights(st, w);
    const DeviceState<S, A>& d = st.dev_;
    const SlotRows sr{rows.slot.data(), rows.query_start.data(), R, rows.max_query_len};
    const std::int64_t C = p.chunk;
    // a row naming a slot holds L <= longest tokens (the plan refuses a step with a row over
    // max_query_len) and spans at most min(L, (L - 1) / C + 2) chunk segments, one phase each
    const std::int64_t longest = rows.max_query_len > 0 ? std::min(rows.max_query_len, tokens) : tokens;
    const std::int64_t phases = longest == 0 ? 1 : std::min(longest, (longest - 1) / C + 2);
    // a block per packed token, or per (row, position in a segment of at most min(C, longest) tokens)
    const std::int64_t per_row = std::max<std::int64_t>(1, std::min(C, longest));
    const SlotGrid token_grid{R * per_row < tokens ? per_row : 0};
    const auto token_blocks = static_cast<unsigned>(token_grid.blocks(R, tokens));
    const SlotReadoutShape shape = slot_readout_shape(sh.Hq, sh.Hk, sh.Dv);
    const std::size_t readout_bytes = shape.shared_bytes(sh.D, sh.Dv);
    const auto readout = slot_readout_kernel_for<S, In, Out, Dims>(shape);
    // the update's launches (kvm_slots.cuh): a block per item for prep and select, at most one per
    // item of the step; a fixed grid of kSlotBlocksPerSm blocks per multiprocessor for the passes and
    // the finish, whose blocks spread the updating items over themselves
    const std::size_t select_bytes = slot_select_shared_bytes(C), pass_bytes = slot_pass_shared_bytes(C, sh.D),
                      finish_bytes = slot_finish_shared_bytes(C);
    const unsigned token_threads = slot_update_threads(C);
    const auto item_grid = static_cast<unsigned>(std::min<std::int64_t>(R * sh.Hk, 4 * std::int64_t(st.sm_count_)));
    const auto pass_grid = static_cast<unsigned>(kSlotBlocksPerSm * std::max(1, st.sm_count_));
    const std::int64_t finish_ranges =
        std::max<std::int64_t>(1, (st.cap_ - p.sink + kSlotPassThreads - 1) / kSlotPassThreads);
    KVMEM_RETURN_IF_ERROR(allow_shared(slot_update_select_kernel<S>, select_bytes));
    KVMEM_RETURN_IF_ERROR(allow_shared(slot_update_pass_kernel<S, false>, pass_bytes));
    KVMEM_RETURN_IF_ERROR(allow_shared(slot_update_pass_kernel<S, true>, pass_bytes));
    KVMEM_RETURN_IF_ERROR(allow_shared(slot_update_finish_kernel<S>, finish_bytes));
    KVMEM_RETURN_IF_ERROR(allow_shared(readout, readout_bytes));
    if (st.khat32_rows_ > 0) {  // once, after fixed-batch calls (enter_slot_mode)
      slot_khat32_kernel<S><<<static_cast<unsigned>(sh.B * sh.Hk), 128, 0, exec.stream>>>(d, st.khat32_rows_);
      KVMEM_CUDA_RETURN_IF_LAUNCH_FAILED("kvm slot_khat32_kernel");
      st.khat32_rows_ = 0;
    }
    for (std::int64_t ph = 0; ph < phases; ++ph) {
      slot_plan_kernel<<<1, kPlanThreads, 0, exec.stream>>>(st.sc_, sr, tokens, C, p.window(), int(ph));
      KVMEM_CUDA_RETURN_IF_LAUNCH_FAILED("kvm slot_plan_kernel");
      slot_update_prep_kernel<S><<<item_grid, token_threads, 0, exec.stream>>>(d, st.sc_, sr);
      KVMEM_CUDA_RETURN_IF_LAUNCH_FAILED("kvm slot_update_prep_kernel");
      slot_update_pass_kernel<S, false><<<pass_grid, kSlotPassThreads, pass_bytes, exec.stream>>>(d, st.sc_, sr);
      KVMEM_CUDA_RETURN_IF_LAUNCH_FAILED("kvm slot_update_pass_kernel (novelty)");
      slot_update_select_kernel<S><<<item_grid, token_threads, select_bytes, exec.stream>>>(d, st.sc_, sr);
      KVMEM_CUDA_RETURN_IF_LAUNCH_FAILED("kvm slot_update_select_kernel");
      slot_update_pass_kernel<S, true><<<pass_grid, kSlotPassThreads, pass_bytes, exec.stream>>>(d, st.sc_, sr);
      KVMEM_CUDA_RETURN_IF_LAUNCH_FAILED("kvm slot_update_pass_kernel (routes)");
      slot_update_finish_kernel<S>
          <<<pass_grid, kSlotPassThreads, finish_bytes, exec.stream>>>(d, st.sc_, sr, finish_ranges);
      KVMEM_CUDA_RETURN_IF_LAUNCH_FAILED("kvm slot_update_finish_kernel");
      if (tokens == 0) continue;
      slot_ingest_kernel<S, In><<<token_blocks, kSlotIngestThreads, 0, exec.stream>>>(d, st.sc_, sr, token_grid,
                                                                                      k.data(), v.data(), gate.data());
      KVMEM_CUDA_RETURN_IF_LAUNCH_FAILED("kvm slot_ingest_kernel");
      const dim3 grid(token_blocks, static_cast<unsigned>(sh.Hq / shape.rep));
      readout<<<grid, kWarpSize * kSlotReadoutWarps, readout_bytes, exec.stream>>>(
          d, st.sc_, sr, token_grid, q.data(), out.data(), lse.empty() ? nullptr : lse.data(), ph == 0);
      KVMEM_CUDA_RETURN_IF_LAUNCH_FAILED("kvm slot_readout_kernel");
    }
    return Status::ok();
  }

  // The list check of a slot operation (slot_lists.cuh), enqueued first: it writes a refusal into the
  // status word, which every later launch of the operation reads.
  template <class S, class A>
  static Status check_list(const Executor& exec, KvmState<S, A>& st, const std::int32_t* src, const std::int32_t* dst,
                           std::int64_t n) {
    slot_lists::Args a;
    return slot_lists::launch_check(exec.stream, src, dst, n, st.shape_.B, st.sc_.mark, st.sc_.status, a);
  }

  template <class S, class A>
  static Status reset_slots(const Executor& exec, KvmState<S, A>& st, TensorView<const std::int32_t, 1> slots) {
    KVMEM_RETURN_IF_ERROR(check_state(st));
    KVMEM_RETURN_IF_ERROR(slot_lists::check_device_slot_list(slots, "slots"));
    const std::int64_t n = slots.extent(0);
    // the switch to per-slot counters runs even if the device refuses the list: it gives every slot the
    // count it already has, so the slots' contents (their records) do not change
    KVMEM_RETURN_IF_ERROR(enter_slot_mode(exec, st));
    if (n == 0) return Status::ok();
    KVMEM_RETURN_IF_ERROR(check_list(exec, st, slots.data(), nullptr, n));
    slot_reset_kernel<><<<1, 256, 0, exec.stream>>>(st.sc_, slots.data(), n);
    KVMEM_CUDA_RETURN_IF_LAUNCH_FAILED("kvm slot_reset_kernel");
    return Status::ok();
  }

  // The per-slot regions copy_slots copies: whole slot regions of the sums, the readout rows and the
  // window (every KV head's item is contiguous per slot), capacity rows rather than the |S| in use,
  // since |S| lives on the device.
  template <class S, class A>
  static SlotRegions copy_regions(const KvmState<S, A>& st) {
    const DeviceState<S, A>& d = st.dev_;
    const kvm::Shape& sh = st.shape_;
    const auto Hk = std::size_t(sh.Hk), cap = std::size_t(st.cap_), W = std::size_t(st.params_.window()),
               D = std::size_t(sh.D), Dv = std::size_t(sh.Dv);
    SlotRegions r{};
    const auto add = [&](auto* base, std::size_t elements) {
      const std::size_t bytes = elements * sizeof(*base);
      const std::size_t both = bytes | std::size_t(reinterpret_cast<std::uintptr_t>(base));  // size and alignment
      r.base[r.count] = reinterpret_cast<unsigned char*>(base);
      r.bytes[r.count] = bytes;
      r.unit[r.count] = both % 16 == 0 ? 16 : both % 4 == 0 ? 4 : both % 2 == 0 ? 2 : 1;
      ++r.count;
    };
    add(d.sk, Hk * cap * D);
    add(d.sv, Hk * cap * Dv);
    add(d.rho, Hk * cap);
    add(d.cnt, Hk * cap);
    add(d.khat32, Hk * cap * D);
    add(d.khat, Hk * cap * D);
    add(d.vhat, Hk * cap * Dv);
    if constexpr (is_row_scaled_v<S>) {
      add(d.khat_scale, Hk * cap);
      add(d.vhat_scale, Hk * cap);
    }
    add(d.wk, Hk * W * D);
    add(d.wv, Hk * W * Dv);
    add(d.wg, Hk * W);
    return r;
  }

  template <class S, class A>
  static Status copy_slots(const Executor& exec, KvmState<S, A>& st, TensorView<const std::int32_t, 1> src,
                           TensorView<const std::int32_t, 1> dst) {
    KVMEM_RETURN_IF_ERROR(check_state(st));
    if (src.extent(0) != dst.extent(0)) return invalid_argument("dst length", src.extent(0), dst.extent(0));
    KVMEM_RETURN_IF_ERROR(slot_lists::check_device_slot_list(src, "src"));
    KVMEM_RETURN_IF_ERROR(slot_lists::check_device_slot_list(dst, "dst"));
    const std::int64_t n = src.extent(0);
    KVMEM_RETURN_IF_ERROR(enter_slot_mode(exec, st));  // as in reset_slots: changes no slot's contents
    if (n == 0) return Status::ok();
    KVMEM_RETURN_IF_ERROR(check_list(exec, st, src.data(), dst.data(), n));
    const SlotRegions regions = copy_regions(st);
    std::size_t words = 0;  // of the largest region: the grid's x covers it with one word per thread
    for (int k = 0; k < regions.count; ++k) words = std::max(words, regions.bytes[k] / std::size_t(regions.unit[k]));
    const auto blocks = static_cast<unsigned>(std::clamp<std::size_t>((words + kSlotCopyThreads - 1) / kSlotCopyThreads,
                                                                      1, 4 * std::size_t(std::max(1, st.sm_count_))));
    const dim3 grid(blocks, static_cast<unsigned>(std::min<std::int64_t>(n, 65535)));
    slot_copy_kernel<><<<grid, kSlotCopyThreads, 0, exec.stream>>>(st.sc_, regions, src.data(), dst.data(), n);
    KVMEM_CUDA_RETURN_IF_LAUNCH_FAILED("kvm slot_copy_kernel");
    return Status::ok();
  }

  // A one-slot host State with this state's parameters and shape: the slot record's codec
  // (kvm/record.hpp) reads and writes host States, so a CUDA slot is staged through one.
  template <class S, class A>
  static Status host_twin(const KvmState<S, A>& st, kvm::State<S, A>& twin) {
    kvm::Shape one = st.shape_;
    one.B = 1;
    return kvm::State<S, A>::create(st.params_, one, twin);
  }

  template <class S, class A>
  static Status counters(const Executor& exec, const KvmState<S, A>& st, std::int32_t slot, std::int64_t& n,
                         std::int64_t& cov, std::int64_t& slots) {
    return st.slot_counters(exec, slot, n, cov, slots);
  }

  template <class S, class A>
  static std::size_t record_bytes(const kvm::State<S, A>& twin, std::int64_t n, std::int64_t cov, std::int64_t slots) {
    slot_record::Writer w({}, slot_record::Mechanism::kKvm, kvm::record_detail::kFields);
    kvm::record_detail::write(twin, 0, n, cov, slots, w, true);
    return w.size();
  }

  template <class S, class A>
  static Status export_slot(const Executor& exec, const KvmState<S, A>& st, std::int32_t slot,
                            std::span<std::byte> bytes) {
    KVMEM_RETURN_IF_ERROR(check_state(st));
    KVMEM_RETURN_IF_ERROR(check_slot(slot, st.shape_.B));
    std::int64_t n = 0, cov = 0, used = 0;
    KVMEM_RETURN_IF_ERROR(counters(exec, st, slot, n, cov, used));
    kvm::State<S, A> twin;
    KVMEM_RETURN_IF_ERROR(host_twin(st, twin));
    const std::size_t need = record_bytes(twin, n, cov, used);
    if (bytes.size() < need)
      return invalid_argument("bytes", ">= export_bytes(state, slot) = " + std::to_string(need), bytes.size());
    const kvm::Shape& sh = st.shape_;
    const DeviceState<S, A>& d = st.dev_;
    const std::int64_t cap = st.cap_, W = st.params_.window();
    const auto get = [&](auto* to, const auto* from, std::int64_t count) {
      return to_status(cudaMemcpyAsync(to, from, std::size_t(count) * sizeof(*to), cudaMemcpyDeviceToHost, exec.stream),
                       "export_slot cudaMemcpyAsync");
    };
    for (std::int64_t g = 0; g < sh.Hk; ++g) {
      const std::int64_t i = std::int64_t(slot) * sh.Hk + g;
      const auto it = twin.item(0, g);
      KVMEM_RETURN_IF_ERROR(get(it.sk, d.sk + i * cap * sh.D, used * sh.D));
      KVMEM_RETURN_IF_ERROR(get(it.sv, d.sv + i * cap * sh.Dv, used * sh.Dv));
      KVMEM_RETURN_IF_ERROR(get(it.rho, d.rho + i * cap, used));
      KVMEM_RETURN_IF_ERROR(get(it.cnt, d.cnt + i * cap, used));
      KVMEM_RETURN_IF_ERROR(get(it.wk, d.wk + i * W * sh.D, W * sh.D));
      KVMEM_RETURN_IF_ERROR(get(it.wv, d.wv + i * W * sh.Dv, W * sh.Dv));
      KVMEM_RETURN_IF_ERROR(get(it.wg, d.wg + i * W, W));
    }
    KVMEM_RETURN_IF_ERROR(to_status(cudaStreamSynchronize(exec.stream), "export_slot sync"));
    slot_record::Writer w(bytes.first(need), slot_record::Mechanism::kKvm, kvm::record_detail::kFields);
    kvm::record_detail::write(twin, 0, n, cov, used, w, false);
    return Status::ok();
  }

  template <class S, class A>
  static Status import_slot(const Executor& exec, KvmState<S, A>& st, const KvmWeights& weights, std::int32_t slot,
                            std::span<const std::byte> bytes) {
    KVMEM_RETURN_IF_ERROR(check_state(st));
    KVMEM_RETURN_IF_ERROR(check_slot(slot, st.shape_.B));
    if (!weights.ln_weight || !weights.ln_bias || !weights.tau_state || !weights.tau_bswa)
      return invalid_argument("weights", "device pointers for ln_weight, ln_bias, tau_state, tau_bswa", "nullptr");
    kvm::State<S, A> twin;
    KVMEM_RETURN_IF_ERROR(host_twin(st, twin));
    kvm::record_detail::Parsed<A> rec;
    KVMEM_RETURN_IF_ERROR(kvm::record_detail::read(twin, bytes, rec));
    // ---- every check passed: write the slot ----
    KVMEM_RETURN_IF_ERROR(enter_slot_mode(exec, st));
    bind_weights(st, weights);
    const kvm::Shape& sh = st.shape_;
    const DeviceState<S, A>& d = st.dev_;
    const std::int64_t cap = st.cap_, W = st.params_.window(), D = sh.D, Dv = sh.Dv, used = rec.slots;
    const std::int64_t w0 = st.params_.geometry().bswa_begin(rec.n), held = rec.n - w0;
    using Win = kvm_detail::Win<S>;
    std::vector<Win> wk(std::size_t(sh.Hk * W * D), store_as<Win>(0.0f)),
        wv(std::size_t(sh.Hk * W * Dv), store_as<Win>(0.0f));
    std::vector<A> wg(std::size_t(sh.Hk * W), A(0));
    for (std::int64_t g = 0; g < sh.Hk; ++g)
      for (std::int64_t i = 0; i < held; ++i) {
        const std::int64_t ring = (w0 + i) % W, at = g * held + i;
        for (std::int64_t c = 0; c < D; ++c)
          wk[std::size_t((g * W + ring) * D + c)] = store_as<Win>(rec.wk[std::size_t(at * D + c)]);
        for (std::int64_t c = 0; c < Dv; ++c)
          wv[std::size_t((g * W + ring) * Dv + c)] = store_as<Win>(rec.wv[std::size_t(at * Dv + c)]);
        wg[std::size_t(g * W + ring)] = rec.wg[std::size_t(at)];
      }
    const auto put = [&](auto* to, const auto* from, std::int64_t count) {
      return to_status(cudaMemcpyAsync(to, from, std::size_t(count) * sizeof(*to), cudaMemcpyHostToDevice, exec.stream),
                       "import_slot cudaMemcpyAsync");
    };
    for (std::int64_t g = 0; g < sh.Hk; ++g) {
      const std::int64_t i = std::int64_t(slot) * sh.Hk + g;
      KVMEM_RETURN_IF_ERROR(put(d.sk + i * cap * D, rec.sk.data() + g * used * D, used * D));
      KVMEM_RETURN_IF_ERROR(put(d.sv + i * cap * Dv, rec.sv.data() + g * used * Dv, used * Dv));
      KVMEM_RETURN_IF_ERROR(put(d.rho + i * cap, rec.rho.data() + g * used, used));
      KVMEM_RETURN_IF_ERROR(put(d.cnt + i * cap, rec.cnt.data() + g * used, used));
    }
    const std::int64_t s = slot;
    KVMEM_RETURN_IF_ERROR(put(d.wk + s * sh.Hk * W * D, wk.data(), sh.Hk * W * D));
    KVMEM_RETURN_IF_ERROR(put(d.wv + s * sh.Hk * W * Dv, wv.data(), sh.Hk * W * Dv));
    KVMEM_RETURN_IF_ERROR(put(d.wg + s * sh.Hk * W, wg.data(), sh.Hk * W));
    if (used > 0) {  // the readout copies K^, V^ (spec 4.4), rebuilt as the exporter computed them
      slot_refresh_kernel<S><<<static_cast<unsigned>(sh.Hk), 128, 0, exec.stream>>>(d, s, used);
      KVMEM_CUDA_RETURN_IF_LAUNCH_FAILED("kvm slot_refresh_kernel");
    }
    slot_set_counters_kernel<<<1, 32, 0, exec.stream>>>(st.sc_, s, 1, rec.n, rec.cov, rec.slots);
    KVMEM_CUDA_RETURN_IF_LAUNCH_FAILED("kvm slot_set_counters_kernel");
    return to_status(cudaStreamSynchronize(exec.stream), "import_slot sync");  // the host staging dies here
  }

  template <class S, class A>
  static Status truncate(const Executor& exec, KvmState<S, A>& st, std::int32_t slot, std::int64_t n) {
    KVMEM_RETURN_IF_ERROR(check_state(st));
    KVMEM_RETURN_IF_ERROR(check_slot(slot, st.shape_.B));
    std::int64_t n_old = 0, cov_old = 0, used = 0;
    KVMEM_RETURN_IF_ERROR(counters(exec, st, slot, n_old, cov_old, used));
    const kvm::Geometry geo = st.params_.geometry();
    KVMEM_RETURN_IF_ERROR(kvm::truncate_check(geo, slot, n_old, cov_old, n));
    KVMEM_RETURN_IF_ERROR(enter_slot_mode(exec, st));
    const std::int64_t n_new = n_old - n, cov = geo.covered(n_new);
    if (cov_old != cov) used = cov;  // initial slots only: one per token (spec 4.3)
    slot_set_counters_kernel<<<1, 32, 0, exec.stream>>>(st.sc_, slot, 1, n_new, cov, used);
    KVMEM_CUDA_RETURN_IF_LAUNCH_FAILED("kvm slot_set_counters_kernel");
    return Status::ok();
  }

  template <class S, class A>
  static std::size_t export_bytes(const KvmState<S, A>& st) {
    kvm::State<S, A> twin;
    if (!st.valid() || !host_twin(st, twin).is_ok()) return 0;
    return kvm::export_bytes(twin);
  }

  template <class S, class A>
  static std::size_t export_bytes(const KvmState<S, A>& st, std::int32_t slot) {
    std::int64_t n = 0, cov = 0, used = 0;
    kvm::State<S, A> twin;
    if (!st.valid() || !check_slot(slot, st.shape_.B).is_ok() ||
        !counters(Executor{}, st, slot, n, cov, used).is_ok() || !host_twin(st, twin).is_ok())
      return 0;
    return record_bytes(twin, n, cov, used);
  }
};

}  // namespace kvm_detail

}  // namespace kvmem::cuda

// ---- kvm::step and the slot operations on the CUDA backend (docs/slots.md) -------------------------
// The names and argument order of the host backend's (kvm/attention.hpp), for a cuda::KvmState with
// its weights in device memory (cuda::KvmWeights). Everything a step reads is in device memory: the
// rows (slot, query_start) and the packed token-major tensors. A step enqueues a fixed sequence of
// launches that depends only on the row count, the packed token count, the rows' max_query_len (the
// host's bound on a row's tokens, which sizes the chunk phases; a row over it refuses the step) and the
// state's shape, and neither allocates nor synchronises: one CUDA graph captured for a padded batch replays step after
// step, each replay advancing every slot from its own device counters. Rows are checked on the device;
// a refused step changes nothing and KvmState::step_status says why.
// The slot lists of reset_slots and copy_slots are in device memory, as on CUDA Universal Attention,
// and are checked there (slot_lists.cuh): the host checks only lengths, strides and pointers, and the
// operation's launches depend only on the list length and the state's shape, so it neither allocates
// nor synchronises and captures in a CUDA graph beside the steps. A list the device refuses (an index
// out of range; for copy_slots a destination twice, or one that is another pair's source) changes
// nothing, the call having returned ok; KvmState::step_status returns the host's Status for it, and
// until then every later step and slot operation is refused too. export_slot, import_slot, truncate
// and export_bytes(state, slot) read counters or host bytes and synchronise.
namespace kvmem::kvm {

// The CUDA backend behind kvm::prefill / decode / step / reset_slots / copy_slots / export_slot /
// import_slot / truncate / forward / can_run (kvm/attention.hpp): states are cuda::KvmState, weights
// cuda::KvmWeights, and every view points to device memory except the byte records of
// export_slot / import_slot (host). What this backend does not do is refused with kUnsupported: a
// RouteLog on step (the fixed-batch calls keep one) and per-sequence lengths / active masks of the
// fixed-batch calls (ragged and partial batches go through step).
template <>
struct Backend<cuda::Executor> {
  template <class S, class A>
  using state_type = cuda::KvmState<S, A>;
  using weights_type = cuda::KvmWeights;

  static Status can_run(const Problem& problem) { return cuda::KvmState<>::can_run(problem); }

  template <class S, class A, class In, class Out>
  static Status prefill(const cuda::Executor& exec, cuda::KvmState<S, A>& state, const cuda::KvmWeights& weights,
                        TensorView<const In, 4> q, TensorView<const In, 4> k, TensorView<const In, 4> v,
                        TensorView<const In, 3> gate, TensorView<Out, 4> out, const std::int64_t* lengths,
                        RouteLog* log) {
    if (lengths != nullptr) return fixed_batch_only();
    return cuda::kvm_run(exec, state, weights, q, k, v, gate, out, log);
  }

  template <class S, class A, class In, class Out>
  static Status step(const cuda::Executor& exec, cuda::KvmState<S, A>& state, const cuda::KvmWeights& weights,
                     const Rows& rows, TensorView<const In, 3> q, TensorView<const In, 3> k, TensorView<const In, 3> v,
                     TensorView<const In, 2> gate, TensorView<Out, 3> out, TensorView<float, 2> lse, RouteLog* log) {
    if (log != nullptr) return no_route_log();
    return cuda::kvm_detail::SlotAccess::step(exec, state, weights, rows, q, k, v, gate, out, lse);
  }

  // The calls of a composed variant with fixed head dims (kvm::Attention<.., HeadDim, ValueDim> passes
  // HeadDims<HeadDim, ValueDim>): the same as above, compiling only the kernels of those dims.
  template <std::int64_t kD, std::int64_t kDv, class S, class A, class In, class Out>
  static Status prefill(HeadDims<kD, kDv> dims, const cuda::Executor& exec, cuda::KvmState<S, A>& state,
                        const cuda::KvmWeights& weights, TensorView<const In, 4> q, TensorView<const In, 4> k,
                        TensorView<const In, 4> v, TensorView<const In, 3> gate, TensorView<Out, 4> out,
                        const std::int64_t* lengths, RouteLog* log) {
    if (lengths != nullptr) return fixed_batch_only();
    return cuda::kvm_run_as(dims, exec, state, weights, q, k, v, gate, out, log);
  }
  template <std::int64_t kD, std::int64_t kDv, class S, class A, class In, class Out>
  static Status step(HeadDims<kD, kDv> dims, const cuda::Executor& exec, cuda::KvmState<S, A>& state,
                     const cuda::KvmWeights& weights, const Rows& rows, TensorView<const In, 3> q,
                     TensorView<const In, 3> k, TensorView<const In, 3> v, TensorView<const In, 2> gate,
                     TensorView<Out, 3> out, TensorView<float, 2> lse, RouteLog* log) {
    if (log != nullptr) return no_route_log();
    return cuda::kvm_detail::SlotAccess::step(exec, state, weights, rows, q, k, v, gate, out, lse, dims);
  }

  template <class S, class A>
  static Status reset_slots(const cuda::Executor& exec, cuda::KvmState<S, A>& state,
                            TensorView<const std::int32_t, 1> slots) {
    return cuda::kvm_detail::SlotAccess::reset_slots(exec, state, slots);
  }

  template <class S, class A>
  static Status copy_slots(const cuda::Executor& exec, cuda::KvmState<S, A>& state,
                           TensorView<const std::int32_t, 1> src, TensorView<const std::int32_t, 1> dst) {
    return cuda::kvm_detail::SlotAccess::copy_slots(exec, state, src, dst);
  }

  template <class S, class A>
  static Status export_slot(const cuda::Executor& exec, const cuda::KvmState<S, A>& state, std::int32_t slot,
                            std::span<std::byte> bytes) {
    return cuda::kvm_detail::SlotAccess::export_slot(exec, state, slot, bytes);
  }

  template <class S, class A>
  static Status import_slot(const cuda::Executor& exec, cuda::KvmState<S, A>& state, const cuda::KvmWeights& weights,
                            std::int32_t slot, std::span<const std::byte> bytes) {
    return cuda::kvm_detail::SlotAccess::import_slot(exec, state, weights, slot, bytes);
  }

  template <class S, class A>
  static Status truncate(const cuda::Executor& exec, cuda::KvmState<S, A>& state, std::int32_t slot, std::int64_t n) {
    return cuda::kvm_detail::SlotAccess::truncate(exec, state, slot, n);
  }

 private:
  static Status fixed_batch_only() {
    return {StatusCode::kUnsupported,
            "lengths / active: the CUDA fixed-batch prefill and decode advance every sequence together "
            "(pass nullptr); ragged and partial batches go through kvm::step"};
  }
  static Status no_route_log() {
    return {StatusCode::kUnsupported,
            "log: the CUDA kvm::step keeps no RouteLog (pass nullptr; the fixed-batch prefill and decode keep one)"};
  }
};

// Bytes of export_slot's record: of the state's largest possible slot, and of `slot` as it is now
// (synchronises the default stream: reads the slot's counters).
template <class S, class A>
std::size_t export_bytes(const cuda::KvmState<S, A>& state) {
  return cuda::kvm_detail::SlotAccess::export_bytes(state);
}

template <class S, class A>
std::size_t export_bytes(const cuda::KvmState<S, A>& state, std::int32_t slot) {
  return cuda::kvm_detail::SlotAccess::export_bytes(state, slot);
}

}  // namespace kvmem::kvm
