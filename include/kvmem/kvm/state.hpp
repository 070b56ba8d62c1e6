// SPDX-License-Identifier: Apache-2.0
#pragma once
// KVM cache state (spec KVM.md 2, 4.3, 4.7), in two parts (DESIGN.md 3, caller-owned memory).
// Persistent, per sequence slot and KV head (one contiguous block per (slot, KV head) item):
//   - the raw summed slot keys Sk [cap,D] and values Sv [cap,Dv], radius rho and merge count cnt
//     [cap], in the accumulate type (they are sums: rounding them to bf16 every merge would drift);
//   - the readout copies K^ = LN_s(Sk) [cap,D] and V^ [cap,Dv] in the storage type (what every query
//     reads; refreshed only when a slot changes, once per chunk); fp8 storage (e4m3) adds one fp32
//     scale per K^ row and per V^ row [cap] (core/numeric.hpp quantize_row: a power of two, amax <= 448);
//   - the window ring: raw post-RoPE k [W,D], v [W,Dv] in the window type (window_t: the storage type,
//     bf16 for fp8 storage) and g [W], W = nb*C, position p at p mod W;
// and per slot the tokens seen n, the tokens summarised cov and |S|.
// Workspace, per step: the learned weights in Acc, and per work item of the step (a row's KV head) the
// scratch of one update and one query block (k0, kg, vg, scores, targets, LN rows, q block,
// accumulators, softmax states) plus the item's result counters. Nothing of it outlives a call, so an
// engine sizes it for its largest step (workspace_bytes) and may share it between layers that never run
// at the same time.
//
// Capacity comes from slot_capacity(budget, geometry, n_ctx) (spec 3.1), so an engine allocates once.
// The sizes are closed-form (state_layout, state_bytes, workspace_bytes); the state is owning (create:
// state and a workspace for max_slots rows in one allocation) or placed over caller memory (place, then
// attach_workspace), and no operation allocates.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <new>
#include <string>
#include <type_traits>

#include "kvmem/core/arena.hpp"
#include "kvmem/core/memory.hpp"
#include "kvmem/core/numeric.hpp"
#include "kvmem/core/softmax.hpp"
#include "kvmem/core/status.hpp"
#include "kvmem/kvm/params.hpp"
#include "kvmem/kvm/schedule.hpp"

namespace kvmem::kvm {

// One layer's cache problem: parameters and shape (Shape::B = max_slots, Shape::n_ctx the longest
// context a slot holds).
struct Problem {
  Params params{};
  Shape shape{};
};

// The element type of the window ring of a state of storage S: S itself, and bf16 for fp8 storage. The
// window holds the recent tokens' exact keys and values, which every update re-reads (its k0, the merge
// sums): fp8 applies to the memory slots' readout copies only, so routing and the fp32 sums of an fp8
// state are those of a bf16 state given the same inputs.
template <class S>
using window_t = input_type_t<S>;

// Pointers of one (sequence, KV head); all rows contiguous. The workspace fields belong to the work
// item the pointers were taken for (nullptr when the state has no workspace for it).
template <class Storage, class Acc>
struct ItemView {
  Acc* sk;                // [cap, D]
  Acc* sv;                // [cap, Dv]
  Acc* rho;               // [cap]
  Acc* cnt;               // [cap]
  Storage* khat;          // [cap, D]
  Storage* vhat;          // [cap, Dv]
  float* khat_scale;      // [cap]: row scales of K^ (fp8 storage; nullptr otherwise)
  float* vhat_scale;      // [cap]: row scales of V^ (fp8 storage; nullptr otherwise)
  window_t<Storage>* wk;  // [W, D]
  window_t<Storage>* wv;  // [W, Dv]
  Acc* wg;                // [W]
  // workspace
  Acc* k0;                   // [C, D]
  Acc* kg;                   // [C, D]
  Acc* vg;                   // [C, Dv]
  Acc* score;                // [C]
  Acc* best;                 // [C]
  std::int64_t* target;      // [C]
  Acc* row;                  // [kRowBlock, D] (LN rows of a block of slots)
  Acc* qblock;               // [rep*C, D]
  Acc* acc;                  // [rep*C, Dv]
  OnlineSoftmax<Acc>* soft;  // [rep*C]
};

// Persistent bytes of a state (DESIGN.md 3): per (slot, KV head) item one block of item_bytes; per
// slot its KV heads' items and three int64 counters. bytes is what state_bytes returns and what place
// needs: max_slots * Hk * item_bytes plus the counter arrays, each array aligned to `alignment`.
struct StateLayout {
  std::size_t item_bytes = 0;  // one (slot, KV head): slots, readout copies, window ring
  std::size_t slot_bytes = 0;  // Hk * item_bytes + the slot's counters (n, cov, |S|)
  std::size_t bytes = 0;       // the whole state
  std::size_t alignment = kMemoryAlign;
};

namespace state_detail {

// Offsets inside one item block of the persistent part.
struct ItemOffsets {
  std::size_t sk, sv, rho, cnt, khat, vhat, khat_scale, vhat_scale, wk, wv, wg, bytes;
};
// Offsets inside one work item of the workspace.
struct WorkOffsets {
  std::size_t k0, kg, vg, score, best, target, row, qblock, acc, soft, bytes;
};

inline constexpr std::int64_t kRowBlock = 8;  // >= kernel::kRouteRows (kvm/ does not include kernel/)

template <class Storage, class Acc>
ItemOffsets item_offsets(const Params& p, const Shape& s) {
  const auto cap = std::size_t(slot_capacity(p.budget, p.geometry(), s.n_ctx));
  const auto W = std::size_t(p.window()), D = std::size_t(s.D), Dv = std::size_t(s.Dv);
  ArenaLayout a(kMemoryAlign);
  ItemOffsets o{};
  o.sk = a.take(cap * D * sizeof(Acc));
  o.sv = a.take(cap * Dv * sizeof(Acc));
  o.rho = a.take(cap * sizeof(Acc));
  o.cnt = a.take(cap * sizeof(Acc));
  o.khat = a.take(cap * D * sizeof(Storage));
  o.vhat = a.take(cap * Dv * sizeof(Storage));
  const std::size_t scales = is_row_scaled_v<Storage> ? cap * sizeof(float) : 0;  // none: no bytes taken
  o.khat_scale = a.take(scales);
  o.vhat_scale = a.take(scales);
  o.wk = a.take(W * D * sizeof(window_t<Storage>));
  o.wv = a.take(W * Dv * sizeof(window_t<Storage>));
  o.wg = a.take(W * sizeof(Acc));
  o.bytes = a.total();
  return o;
}

template <class Acc>
WorkOffsets work_offsets(const Params& p, const Shape& s) {
  const auto C = std::size_t(p.chunk), D = std::size_t(s.D), Dv = std::size_t(s.Dv);
  const auto R = std::size_t(s.rep()) * C;
  ArenaLayout a(kMemoryAlign);
  WorkOffsets o{};
  o.k0 = a.take(C * D * sizeof(Acc));
  o.kg = a.take(C * D * sizeof(Acc));
  o.vg = a.take(C * Dv * sizeof(Acc));
  o.score = a.take(C * sizeof(Acc));
  o.best = a.take(C * sizeof(Acc));
  o.target = a.take(C * sizeof(std::int64_t));
  o.row = a.take(std::size_t(kRowBlock) * D * sizeof(Acc));
  o.qblock = a.take(R * D * sizeof(Acc));
  o.acc = a.take(R * Dv * sizeof(Acc));
  o.soft = a.take(R * sizeof(OnlineSoftmax<Acc>));
  o.bytes = a.total();
  return o;
}

// Workspace: weights in Acc, the step's row list [rows], the items' result counters [items, 2], then
// the work items.
struct WorkLayout {
  std::size_t wts, row_list, result, items, item_bytes, total;
  std::int64_t count;  // work items
};
template <class Acc>
WorkLayout work_layout(const Params& p, const Shape& s, std::int64_t rows) {
  const auto items = std::size_t(rows * s.Hk);
  ArenaLayout a(kMemoryAlign);
  WorkLayout l{};
  l.wts = a.take((2 * std::size_t(s.D) + 2 * std::size_t(s.Hq)) * sizeof(Acc));
  l.row_list = a.take(std::size_t(rows) * sizeof(std::int64_t));
  l.result = a.take(items * 2 * sizeof(std::int64_t));
  l.item_bytes = work_offsets<Acc>(p, s).bytes;
  l.items = a.take(items * l.item_bytes);
  l.total = a.total();
  l.count = std::int64_t(items);
  return l;
}

// Entries of the update-target table a state keeps for a user budget (none for the built-ins, whose
// targets every backend evaluates from their fields): target |S| of update u = 1..updates(n_ctx) along
// the one slot trajectory every sequence follows (spec 3.1: |S| after an update is data independent),
// so device code reads a user policy's slots() without calling host code. Entry 0 is unused.
inline std::int64_t target_count(const Params& p, const Shape& s) {
  return p.budget.is_user() ? p.geometry().updates(s.n_ctx) + 1 : 0;
}

inline std::int64_t rows_of(const Limits& limits, const Shape& s) {
  return limits.max_rows > 0 ? limits.max_rows : s.B;
}

}  // namespace state_detail

// Persistent layout of a State<Storage, Acc> for `problem` (all zero when it is invalid, see can_run).
template <class Storage = float, class Acc = float>
StateLayout state_layout(const Problem& problem) {
  const Params& p = problem.params;
  const Shape& s = problem.shape;
  if (!validate(p, s).is_ok()) return {};
  StateLayout l;
  l.item_bytes = state_detail::item_offsets<Storage, Acc>(p, s).bytes;
  l.slot_bytes = std::size_t(s.Hk) * l.item_bytes + 3 * sizeof(std::int64_t);
  l.bytes = std::size_t(s.B * s.Hk) * l.item_bytes + 3 * align_up(std::size_t(s.B) * sizeof(std::int64_t)) +
            align_up(std::size_t(state_detail::target_count(p, s)) * sizeof(std::int64_t));
  return l;
}
// Persistent bytes of a State<Storage, Acc> for `problem` (0 when it is invalid).
template <class Storage = float, class Acc = float>
std::size_t state_bytes(const Problem& problem) {
  return state_layout<Storage, Acc>(problem).bytes;
}
// Workspace bytes of one step of at most limits.max_rows rows that name a slot (0 = max_slots; padding
// rows need none) on the host backend
// (0 when the problem is invalid or max_rows < 0). A step's scratch does not grow with its token count:
// the driver works one chunk segment at a time.
template <class Storage = float, class Acc = float>
std::size_t workspace_bytes(const Problem& problem, const Limits& limits = {}) {
  if (!validate(problem.params, problem.shape).is_ok() || limits.max_rows < 0) return 0;
  return state_detail::work_layout<Acc>(problem.params, problem.shape, state_detail::rows_of(limits, problem.shape))
      .total;
}

template <class Storage = float, class Acc = float>
class State {
  static_assert(!is_row_scaled_v<Storage> || std::is_same_v<Acc, float>,
                "kvmem::kvm::State: fp8 (kvmem::e4m3) storage accumulates in fp32 (Acc = float)");

 public:
  using storage_type = Storage;
  using accumulate_type = Acc;
  static constexpr std::size_t kAlign = kMemoryAlign;
  static constexpr std::int64_t kRowBlock = state_detail::kRowBlock;

  State() = default;
  // Moves leave the source empty (valid() false, every operation on it refused with a Status): a
  // moved-from State must not keep pointers into memory its new owner frees (DESIGN.md 3).
  State(State&& o) noexcept { take(o); }
  State& operator=(State&& o) noexcept {
    if (this != &o) {
      release();
      take(o);
    }
    return *this;
  }
  State(const State&) = delete;
  State& operator=(const State&) = delete;
  ~State() = default;

  // Bytes of a state with its workspace for max_slots rows in one block (what create allocates and the
  // five-argument place takes); 0 when (params, shape) are invalid.
  static std::size_t bytes_required(const Params& p, const Shape& s) {
    if (!validate(p, s).is_ok()) return 0;
    return kvm::state_bytes<Storage, Acc>({p, s}) + kvm::workspace_bytes<Storage, Acc>({p, s});
  }

  // Owning state: allocates bytes_required once (state, then a workspace for max_slots rows).
  static Status create(const Params& p, const Shape& s, State& out) {
    KVMEM_RETURN_IF_ERROR(validate(p, s));
    const std::size_t sb = kvm::state_bytes<Storage, Acc>({p, s}), wb = kvm::workspace_bytes<Storage, Acc>({p, s});
    State st;
    st.owned_.reset(new (std::align_val_t(kAlign)) std::byte[sb + wb]);
    st.bind(st.owned_.get(), p, s);
    st.bind_workspace(st.owned_.get() + sb, s.B);
    out = std::move(st);
    return Status::ok();
  }

  // Persistent state over caller memory: at least state_bytes(problem) bytes, 64-byte aligned, not
  // owned. Only the slot counters are written (to zero); steps need a workspace (attach_workspace).
  static Status place(void* memory, std::size_t bytes, const Problem& problem, State& out) {
    KVMEM_RETURN_IF_ERROR(validate(problem.params, problem.shape));
    KVMEM_RETURN_IF_ERROR(check_placement(memory, bytes, kvm::state_bytes<Storage, Acc>(problem), "state memory"));
    State st;
    st.bind(static_cast<std::byte*>(memory), problem.params, problem.shape);
    out = std::move(st);
    return Status::ok();
  }
  // State and a workspace for max_slots rows in one caller block of at least bytes_required bytes.
  static Status place(void* memory, std::size_t bytes, const Params& p, const Shape& s, State& out) {
    KVMEM_RETURN_IF_ERROR(validate(p, s));
    KVMEM_RETURN_IF_ERROR(check_placement(memory, bytes, bytes_required(p, s), "memory"));
    State st;
    st.bind(static_cast<std::byte*>(memory), p, s);
    st.bind_workspace(static_cast<std::byte*>(memory) + kvm::state_bytes<Storage, Acc>({p, s}), s.B);
    out = std::move(st);
    return Status::ok();
  }

  // Uses `memory` (at least workspace_bytes(problem, limits), 64-byte aligned, not owned) as the
  // scratch of every later call with at most limits.max_rows rows; replaces a workspace attached or
  // owned before (the owned one stays allocated until the State goes). Nothing is written here. The
  // same workspace may serve several states that are never stepped at the same time.
  Status attach_workspace(void* memory, std::size_t bytes, const Limits& limits = {}) {
    if (!valid()) return invalid_argument("state", "a created or placed State", "an empty State");
    if (limits.max_rows < 0) return invalid_argument("limits max_rows", ">= 0", limits.max_rows);
    const std::size_t need = kvm::workspace_bytes<Storage, Acc>({params_, shape_}, limits);
    KVMEM_RETURN_IF_ERROR(check_placement(memory, bytes, need, "workspace memory"));
    bind_workspace(static_cast<std::byte*>(memory), state_detail::rows_of(limits, shape_));
    return Status::ok();
  }

  // Forget every sequence slot (n = 0); memory is kept. No effect on an empty State.
  void reset() {
    if (!valid()) return;
    for (std::int64_t b = 0; b < shape_.B; ++b) n_[b] = cov_[b] = slots_[b] = 0;
  }
  // Forget the sequence in slot b. An empty State or b outside [0, max_slots) is refused.
  Status reset(std::int64_t b) {
    KVMEM_RETURN_IF_ERROR(check_slot(b, "slot"));
    n_[b] = cov_[b] = slots_[b] = 0;
    return Status::ok();
  }
  // Ok when the State holds memory and b names one of its slots.
  [[nodiscard]] Status check_slot(std::int64_t b, const char* name) const {
    if (!valid())
      return invalid_argument("state", "a created or placed State", "an empty (moved-from or default) State");
    if (b < 0 || b >= shape_.B)
      return {StatusCode::kOutOfRange, std::string(name) + ": expected 0 <= slot < max_slots = " +
                                           std::to_string(shape_.B) + ", got " + std::to_string(b)};
    return Status::ok();
  }
  // Ok when a call of `rows` rows has workspace; else the reason (DESIGN.md 3: checked before any change).
  [[nodiscard]] Status check_workspace(std::int64_t rows) const {
    return check_workspace_rows(ws_ != nullptr, rows, ws_rows_, "State");
  }

  [[nodiscard]] bool valid() const { return base_ != nullptr; }
  [[nodiscard]] const Params& params() const { return params_; }
  [[nodiscard]] const Shape& shape() const { return shape_; }
  // Sequence slots: Shape::B is the slot count, fixed at creation (DESIGN.md 3). A step's row names
  // the slot it advances; prefill/decode treat slot b as batch row b.
  [[nodiscard]] std::int64_t max_slots() const { return valid() ? shape_.B : 0; }
  [[nodiscard]] std::int64_t capacity() const { return cap_; }  // memory slots per (sequence slot, KV head)
  [[nodiscard]] std::int64_t window_capacity() const { return params_.window(); }
  // Rows the workspace serves (0 without one).
  [[nodiscard]] std::int64_t workspace_rows() const { return ws_ ? ws_rows_ : 0; }
  // Counters of sequence slot b; 0 for an empty State or an index outside [0, max_slots).
  [[nodiscard]] std::int64_t tokens(std::int64_t b) const { return in_range(b) ? n_[b] : 0; }     // n
  [[nodiscard]] std::int64_t covered(std::int64_t b) const { return in_range(b) ? cov_[b] : 0; }  // cov
  [[nodiscard]] std::int64_t slots(std::int64_t b) const { return in_range(b) ? slots_[b] : 0; }  // |S|
  // Bytes a cache of this layout keeps for sequence b right now: slots (sums, radius, count, the
  // readout copies and their row scales) plus the window's k, v, g, over all KV heads. The memory held
  // is state_bytes().
  [[nodiscard]] std::size_t cache_bytes(std::int64_t b) const {
    if (!in_range(b)) return 0;
    const auto S = std::size_t(slots_[b]);
    const auto win = std::size_t(std::min(n_[b], window_capacity()));
    const auto D = std::size_t(shape_.D), Dv = std::size_t(shape_.Dv);
    const std::size_t scales = is_row_scaled_v<Storage> ? 2 * sizeof(float) : 0;
    const std::size_t per_head = S * ((D + Dv + 2) * sizeof(Acc) + (D + Dv) * sizeof(Storage) + scales) +
                                 win * ((D + Dv) * sizeof(window_t<Storage>) + sizeof(Acc));
    return per_head * std::size_t(shape_.Hk);
  }
  // Persistent bytes (state_bytes of this problem), the workspace in use, and their sum.
  [[nodiscard]] std::size_t state_bytes() const { return valid() ? state_total_ : 0; }
  [[nodiscard]] std::size_t workspace_bytes() const { return ws_ ? ws_total_ : 0; }
  [[nodiscard]] std::size_t allocated_bytes() const { return state_bytes() + workspace_bytes(); }

  // Item (b, g) with the workspace of work item b*Hk + g (the prefill/decode numbering; nullptr
  // workspace fields when the workspace has fewer items).
  [[nodiscard]] ItemView<Storage, Acc> item(std::int64_t b, std::int64_t g) const {
    return item(b, g, b * shape_.Hk + g);
  }
  // Item (b, g) with the workspace of work item w (a step numbers its items row * Hk + g).
  [[nodiscard]] ItemView<Storage, Acc> item(std::int64_t b, std::int64_t g, std::int64_t w) const {
    std::byte* p = base_ + std::size_t(b * shape_.Hk + g) * io_.bytes;
    ItemView<Storage, Acc> v{};
    v.sk = reinterpret_cast<Acc*>(p + io_.sk);
    v.sv = reinterpret_cast<Acc*>(p + io_.sv);
    v.rho = reinterpret_cast<Acc*>(p + io_.rho);
    v.cnt = reinterpret_cast<Acc*>(p + io_.cnt);
    v.khat = reinterpret_cast<Storage*>(p + io_.khat);
    v.vhat = reinterpret_cast<Storage*>(p + io_.vhat);
    v.khat_scale = is_row_scaled_v<Storage> ? reinterpret_cast<float*>(p + io_.khat_scale) : nullptr;
    v.vhat_scale = is_row_scaled_v<Storage> ? reinterpret_cast<float*>(p + io_.vhat_scale) : nullptr;
    v.wk = reinterpret_cast<window_t<Storage>*>(p + io_.wk);
    v.wv = reinterpret_cast<window_t<Storage>*>(p + io_.wv);
    v.wg = reinterpret_cast<Acc*>(p + io_.wg);
    if (ws_ == nullptr || w < 0 || w >= wl_.count) return v;
    std::byte* q = ws_ + wl_.items + std::size_t(w) * wo_.bytes;
    v.k0 = reinterpret_cast<Acc*>(q + wo_.k0);
    v.kg = reinterpret_cast<Acc*>(q + wo_.kg);
    v.vg = reinterpret_cast<Acc*>(q + wo_.vg);
    v.score = reinterpret_cast<Acc*>(q + wo_.score);
    v.best = reinterpret_cast<Acc*>(q + wo_.best);
    v.target = reinterpret_cast<std::int64_t*>(q + wo_.target);
    v.row = reinterpret_cast<Acc*>(q + wo_.row);
    v.qblock = reinterpret_cast<Acc*>(q + wo_.qblock);
    v.acc = reinterpret_cast<Acc*>(q + wo_.acc);
    v.soft = reinterpret_cast<OnlineSoftmax<Acc>*>(q + wo_.soft);
    return v;
  }
  // Learned parameters converted to Acc once per call (workspace): ln_w [D], ln_b [D], tau_s [Hq],
  // tau_w [Hq]; nullptr without a workspace.
  [[nodiscard]] Acc* ln_w() const { return ws_ ? reinterpret_cast<Acc*>(ws_ + wl_.wts) : nullptr; }
  [[nodiscard]] Acc* ln_b() const { return ws_ ? ln_w() + shape_.D : nullptr; }
  [[nodiscard]] Acc* tau_s() const { return ws_ ? ln_b() + shape_.D : nullptr; }
  [[nodiscard]] Acc* tau_w() const { return ws_ ? tau_s() + shape_.Hq : nullptr; }

  // Mutable per-sequence counters, for the backends.
  std::int64_t* n_data() const { return n_; }
  std::int64_t* cov_data() const { return cov_; }
  std::int64_t* slots_data() const { return slots_; }
  // A user budget's target |S| per update u (entry u, 1 <= u <= updates(n_ctx)); nullptr for the
  // built-in budgets. Written once when the state is created or placed.
  [[nodiscard]] const std::int64_t* update_targets() const { return targets_; }
  // Per-work-item results of one call (cov, |S|), written by the item that owns them and folded into
  // the per-sequence counters after every item has joined (workspace). [work items, 2]
  std::int64_t* item_result() const { return ws_ ? reinterpret_cast<std::int64_t*>(ws_ + wl_.result) : nullptr; }
  // The rows of a step that name a slot, in order (workspace). [workspace_rows()]
  std::int64_t* row_list() const { return ws_ ? reinterpret_cast<std::int64_t*>(ws_ + wl_.row_list) : nullptr; }

 private:
  void bind(std::byte* base, const Params& p, const Shape& s) {
    base_ = base;
    params_ = p;
    shape_ = s;
    io_ = state_detail::item_offsets<Storage, Acc>(p, s);
    state_total_ = state_layout<Storage, Acc>({p, s}).bytes;
    cap_ = slot_capacity(p.budget, p.geometry(), s.n_ctx);
    const std::size_t counters = std::size_t(s.B * s.Hk) * io_.bytes;
    const std::size_t stride = align_up(std::size_t(s.B) * sizeof(std::int64_t));
    n_ = reinterpret_cast<std::int64_t*>(base + counters);
    cov_ = reinterpret_cast<std::int64_t*>(base + counters + stride);
    slots_ = reinterpret_cast<std::int64_t*>(base + counters + 2 * stride);
    targets_ = nullptr;
    if (const std::int64_t count = state_detail::target_count(p, s); count > 0) {
      auto* t = reinterpret_cast<std::int64_t*>(base + counters + 3 * stride);
      const Geometry geo = p.geometry();
      std::int64_t current = std::min(s.n_ctx, geo.chunk);
      t[0] = 0;
      for (std::int64_t u = 1; u < count; ++u) {
        t[u] = p.budget.slots((geo.window_chunks + u) * geo.chunk, (u + 1) * geo.chunk, current);
        current = slots_after_update(p.budget, geo, u, current);
      }
      targets_ = t;
    }
    reset();
  }
  void bind_workspace(std::byte* ws, std::int64_t rows) {
    ws_ = ws;
    ws_rows_ = rows;
    wl_ = state_detail::work_layout<Acc>(params_, shape_, rows);
    wo_ = state_detail::work_offsets<Acc>(params_, shape_);
    ws_total_ = wl_.total;
  }
  [[nodiscard]] bool in_range(std::int64_t b) const { return valid() && b >= 0 && b < shape_.B; }
  void take(State& o) noexcept {
    owned_ = std::move(o.owned_);
    base_ = o.base_;
    ws_ = o.ws_;
    params_ = o.params_;
    shape_ = o.shape_;
    io_ = o.io_;
    wo_ = o.wo_;
    wl_ = o.wl_;
    state_total_ = o.state_total_;
    ws_total_ = o.ws_total_;
    ws_rows_ = o.ws_rows_;
    cap_ = o.cap_;
    n_ = o.n_;
    cov_ = o.cov_;
    slots_ = o.slots_;
    targets_ = o.targets_;
    o.release();
  }
  void release() noexcept {
    owned_.reset();
    base_ = ws_ = nullptr;
    params_ = Params{};
    shape_ = Shape{};
    io_ = {};
    wo_ = {};
    wl_ = {};
    state_total_ = ws_total_ = 0;
    ws_rows_ = 0;
    cap_ = 0;
    n_ = cov_ = slots_ = nullptr;
    targets_ = nullptr;
  }

  struct AlignedDelete {
    void operator()(std::byte* p) const { ::operator delete[](p, std::align_val_t(kAlign)); }
  };
  std::unique_ptr<std::byte[], AlignedDelete> owned_;
  std::byte* base_ = nullptr;  // persistent part
  std::byte* ws_ = nullptr;    // workspace
  Params params_{};
  Shape shape_{};
  state_detail::ItemOffsets io_{};
  state_detail::WorkOffsets wo_{};
  state_detail::WorkLayout wl_{};
  std::size_t state_total_ = 0, ws_total_ = 0;
  std::int64_t ws_rows_ = 0;
  std::int64_t cap_ = 0;
  std::int64_t* n_ = nullptr;
  std::int64_t* cov_ = nullptr;
  std::int64_t* slots_ = nullptr;
  std::int64_t* targets_ = nullptr;
};

// Whether dropping the last n tokens of a slot of n_old tokens, cov_old of them covered, is exact
// (kvm::truncate on every backend): ok, or the reason why not. The rule needs only the counters, so a
// backend that keeps them on a device passes copies.
inline Status truncate_check(const Geometry& geo, std::int64_t slot, std::int64_t n_old, std::int64_t cov_old,
                             std::int64_t n) {
  if (n < 0 || n > n_old)
    return {StatusCode::kOutOfRange, "truncate n: expected 0 <= n <= tokens of slot " + std::to_string(slot) + " = " +
                                         std::to_string(n_old) + ", got " + std::to_string(n)};
  const std::int64_t n_new = n_old - n;
  if (n == 0 || n_new == 0) return Status::ok();
  const std::int64_t C = geo.chunk, cov_new = geo.covered(n_new);
  // Memory slots: unchanged when no update ran for the dropped tokens; below the first update
  // (cov <= C) the state is the initial slots, one founded by each token, and the dropped ones go.
  if (cov_old != cov_new && cov_old > C) {
    const std::int64_t at = cov_old + geo.window() - C + 1;  // tokens seen when that update ran (spec 4.7)
    return invalid_argument("truncate n",
                            "at most " + std::to_string(n_old - at) + ": the state update at token " +
                                std::to_string(at) + " absorbed tokens [" + std::to_string(cov_old - C) + ", " +
                                std::to_string(cov_old) + ") into the memory slots and cannot be undone (spec 4.5)",
                            n);
  }
  // Window: every position a later token or update reads must still be held ([bswa_begin(n_old), n_old)).
  const std::int64_t reads_from = std::min(geo.bswa_begin(n_new + 1), n_new >= C ? cov_new : n_new);
  if (reads_from < geo.bswa_begin(n_old))
    return invalid_argument(
        "truncate n",
        "a count whose shorter sequence reads only window positions >= " + std::to_string(geo.bswa_begin(n_old)) +
            " (the positions the window still holds)",
        std::to_string(n) + " (the shorter sequence reads from position " + std::to_string(reads_from) + ")");
  return Status::ok();
}

// The same for `slot` of a state whose counters the host reads.
template <class S, class A>
Status truncate_check(const State<S, A>& state, std::int64_t slot, std::int64_t n) {
  return truncate_check(state.params().geometry(), slot, state.tokens(slot), state.covered(slot), n);
}

}  // namespace kvmem::kvm
