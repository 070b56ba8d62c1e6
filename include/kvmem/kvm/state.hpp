// SPDX-License-Identifier: Apache-2.0
#pragma once
// KVM cache state (spec KVM.md 2, 4.3, 4.7). Per sequence and KV head it keeps
//   - the raw summed slot keys Sk [cap,D] and values Sv [cap,Dv], radius rho and merge count cnt
//     [cap], in the accumulate type (they are sums: rounding them to bf16 every merge would drift);
//   - the readout copies K^ = LN_s(Sk) [cap,D] and V^ [cap,Dv] in the storage type (what every query
//     reads; refreshed only when a slot changes, once per chunk);
//   - the window ring: raw post-RoPE k [W,D], v [W,Dv] in storage type and g [W], W = nb*C,
//     position p at p mod W;
//   - a workspace for one update and one query block, so prefill/decode never allocate;
// and per sequence the tokens seen n, the tokens summarised cov and |S|.
//
// Capacity comes from slot_capacity(budget, geometry, n_ctx) (spec 3.1), so an engine allocates once.
// The state is either owning (create) or placed over caller memory (place, bytes_required).

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <new>
#include <string>

#include "kvmem/core/arena.hpp"
#include "kvmem/core/numeric.hpp"
#include "kvmem/core/softmax.hpp"
#include "kvmem/core/status.hpp"
#include "kvmem/kvm/params.hpp"
#include "kvmem/kvm/schedule.hpp"

namespace kvmem::kvm {

// Pointers of one (sequence, KV head); all rows contiguous.
template <class Storage, class Acc>
struct ItemView {
  Acc* sk;        // [cap, D]
  Acc* sv;        // [cap, Dv]
  Acc* rho;       // [cap]
  Acc* cnt;       // [cap]
  Storage* khat;  // [cap, D]
  Storage* vhat;  // [cap, Dv]
  Storage* wk;    // [W, D]
  Storage* wv;    // [W, Dv]
  Acc* wg;        // [W]
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

template <class Storage = float, class Acc = float>
class State {
 public:
  using storage_type = Storage;
  using accumulate_type = Acc;
  static constexpr std::size_t kAlign = 64;
  static constexpr std::int64_t kRowBlock = 8;  // >= kernel::kRouteRows (kvm/ does not include kernel/)

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

  // Bytes a placed state needs for (params, shape); 0 when they are invalid.
  static std::size_t bytes_required(const Params& p, const Shape& s) {
    if (!validate(p, s).is_ok()) return 0;
    return layout(p, s).total;
  }

  // Owning state: allocates bytes_required once.
  static Status create(const Params& p, const Shape& s, State& out) {
    KVMEM_RETURN_IF_ERROR(validate(p, s));
    const Layout l = layout(p, s);
    State st;
    st.owned_.reset(new (std::align_val_t(kAlign)) std::byte[l.total]);
    st.bind(st.owned_.get(), p, s, l);
    out = std::move(st);
    return Status::ok();
  }

  // Placement over caller memory (at least bytes_required, aligned to 64 bytes). Not owned.
  static Status place(void* memory, std::size_t bytes, const Params& p, const Shape& s, State& out) {
    KVMEM_RETURN_IF_ERROR(validate(p, s));
    const Layout l = layout(p, s);
    if (memory == nullptr) return invalid_argument("memory", "a non-null pointer", "nullptr");
    if (reinterpret_cast<std::uintptr_t>(memory) % kAlign != 0)
      return invalid_argument("memory", "64-byte alignment", "misaligned pointer");
    if (bytes < l.total) return invalid_argument("memory bytes", ">= " + std::to_string(l.total), bytes);
    State st;
    st.bind(static_cast<std::byte*>(memory), p, s, l);
    out = std::move(st);
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

  [[nodiscard]] bool valid() const { return base_ != nullptr; }
  [[nodiscard]] const Params& params() const { return params_; }
  [[nodiscard]] const Shape& shape() const { return shape_; }
  // Sequence slots: Shape::B is the slot count, fixed at creation (DESIGN.md 3). A step's row names
  // the slot it advances; prefill/decode treat slot b as batch row b.
  [[nodiscard]] std::int64_t max_slots() const { return valid() ? shape_.B : 0; }
  [[nodiscard]] std::int64_t capacity() const { return cap_; }  // memory slots per (sequence slot, KV head)
  [[nodiscard]] std::int64_t window_capacity() const { return params_.window(); }
  // Counters of sequence slot b; 0 for an empty State or an index outside [0, max_slots).
  [[nodiscard]] std::int64_t tokens(std::int64_t b) const { return in_range(b) ? n_[b] : 0; }     // n
  [[nodiscard]] std::int64_t covered(std::int64_t b) const { return in_range(b) ? cov_[b] : 0; }  // cov
  [[nodiscard]] std::int64_t slots(std::int64_t b) const { return in_range(b) ? slots_[b] : 0; }  // |S|
  // Bytes a cache of this layout keeps for sequence b right now: slots (sums, radius, count and the
  // readout copies) plus the window's k, v, g, over all KV heads.
  [[nodiscard]] std::size_t cache_bytes(std::int64_t b) const {
    if (!in_range(b)) return 0;
    const auto S = std::size_t(slots_[b]);
    const auto win = std::size_t(std::min(n_[b], window_capacity()));
    const auto D = std::size_t(shape_.D), Dv = std::size_t(shape_.Dv);
    const std::size_t per_head = S * ((D + Dv + 2) * sizeof(Acc) + (D + Dv) * sizeof(Storage)) +
                                 win * ((D + Dv) * sizeof(Storage) + sizeof(Acc));
    return per_head * std::size_t(shape_.Hk);
  }
  [[nodiscard]] std::size_t allocated_bytes() const { return total_; }

  [[nodiscard]] ItemView<Storage, Acc> item(std::int64_t b, std::int64_t g) const {
    const std::int64_t i = b * shape_.Hk + g;
    const std::int64_t C = params_.chunk, W = params_.window(), D = shape_.D, Dv = shape_.Dv;
    const std::int64_t R = shape_.rep() * C;
    ItemView<Storage, Acc> v{};
    v.sk = at<Acc>(lay_.sk) + i * cap_ * D;
    v.sv = at<Acc>(lay_.sv) + i * cap_ * Dv;
    v.rho = at<Acc>(lay_.rho) + i * cap_;
    v.cnt = at<Acc>(lay_.cnt) + i * cap_;
    v.khat = at<Storage>(lay_.khat) + i * cap_ * D;
    v.vhat = at<Storage>(lay_.vhat) + i * cap_ * Dv;
    v.wk = at<Storage>(lay_.wk) + i * W * D;
    v.wv = at<Storage>(lay_.wv) + i * W * Dv;
    v.wg = at<Acc>(lay_.wg) + i * W;
    v.k0 = at<Acc>(lay_.k0) + i * C * D;
    v.kg = at<Acc>(lay_.kg) + i * C * D;
    v.vg = at<Acc>(lay_.vg) + i * C * Dv;
    v.score = at<Acc>(lay_.score) + i * C;
    v.best = at<Acc>(lay_.best) + i * C;
    v.target = at<std::int64_t>(lay_.target) + i * C;
    v.row = at<Acc>(lay_.row) + i * kRowBlock * D;
    v.qblock = at<Acc>(lay_.qblock) + i * R * D;
    v.acc = at<Acc>(lay_.acc) + i * R * Dv;
    v.soft = at<OnlineSoftmax<Acc>>(lay_.soft) + i * R;
    return v;
  }
  // Learned parameters converted to Acc once per call: ln_w [D], ln_b [D], tau_s [Hq], tau_w [Hq].
  [[nodiscard]] Acc* ln_w() const { return at<Acc>(lay_.wts); }
  [[nodiscard]] Acc* ln_b() const { return ln_w() + shape_.D; }
  [[nodiscard]] Acc* tau_s() const { return ln_b() + shape_.D; }
  [[nodiscard]] Acc* tau_w() const { return tau_s() + shape_.Hq; }

  // Mutable per-sequence counters, for the backends.
  std::int64_t* n_data() const { return n_; }
  std::int64_t* cov_data() const { return cov_; }
  std::int64_t* slots_data() const { return slots_; }
  // Per-(sequence, KV head) results of one call (cov, |S|), written by the item that owns them and
  // folded into the per-sequence counters after every item has joined. [B*Hk, 2]
  std::int64_t* item_result() const { return at<std::int64_t>(lay_.item_result); }

 private:
  struct Layout {
    std::size_t sk, sv, rho, cnt, khat, vhat, wk, wv, wg, k0, kg, vg, score, best, target, row, qblock, acc, soft, wts,
        n, cov, slots, item_result, total;
  };
  static Layout layout(const Params& p, const Shape& s) {
    const auto I = std::size_t(s.B * s.Hk);
    const auto cap = std::size_t(slot_capacity(p.budget, p.geometry(), s.n_ctx));
    const auto C = std::size_t(p.chunk), W = std::size_t(p.window()), D = std::size_t(s.D), Dv = std::size_t(s.Dv);
    const auto R = std::size_t(s.rep()) * C;
    Layout l{};
    ArenaLayout arena(kAlign);
    l.sk = arena.take(I * cap * D * sizeof(Acc));
    l.sv = arena.take(I * cap * Dv * sizeof(Acc));
    l.rho = arena.take(I * cap * sizeof(Acc));
    l.cnt = arena.take(I * cap * sizeof(Acc));
    l.khat = arena.take(I * cap * D * sizeof(Storage));
    l.vhat = arena.take(I * cap * Dv * sizeof(Storage));
    l.wk = arena.take(I * W * D * sizeof(Storage));
    l.wv = arena.take(I * W * Dv * sizeof(Storage));
    l.wg = arena.take(I * W * sizeof(Acc));
    l.k0 = arena.take(I * C * D * sizeof(Acc));
    l.kg = arena.take(I * C * D * sizeof(Acc));
    l.vg = arena.take(I * C * Dv * sizeof(Acc));
    l.score = arena.take(I * C * sizeof(Acc));
    l.best = arena.take(I * C * sizeof(Acc));
    l.target = arena.take(I * C * sizeof(std::int64_t));
    l.row = arena.take(I * kRowBlock * D * sizeof(Acc));
    l.qblock = arena.take(I * R * D * sizeof(Acc));
    l.acc = arena.take(I * R * Dv * sizeof(Acc));
    l.soft = arena.take(I * R * sizeof(OnlineSoftmax<Acc>));
    l.wts = arena.take((2 * D + 2 * std::size_t(s.Hq)) * sizeof(Acc));
    l.n = arena.take(std::size_t(s.B) * sizeof(std::int64_t));
    l.cov = arena.take(std::size_t(s.B) * sizeof(std::int64_t));
    l.slots = arena.take(std::size_t(s.B) * sizeof(std::int64_t));
    l.item_result = arena.take(I * 2 * sizeof(std::int64_t));
    l.total = arena.total();
    return l;
  }
  void bind(std::byte* base, const Params& p, const Shape& s, const Layout& l) {
    base_ = base;
    params_ = p;
    shape_ = s;
    lay_ = l;
    total_ = l.total;
    cap_ = slot_capacity(p.budget, p.geometry(), s.n_ctx);
    n_ = at<std::int64_t>(l.n);
    cov_ = at<std::int64_t>(l.cov);
    slots_ = at<std::int64_t>(l.slots);
    reset();
  }
  [[nodiscard]] bool in_range(std::int64_t b) const { return valid() && b >= 0 && b < shape_.B; }
  void take(State& o) noexcept {
    owned_ = std::move(o.owned_);
    base_ = o.base_;
    params_ = o.params_;
    shape_ = o.shape_;
    lay_ = o.lay_;
    total_ = o.total_;
    cap_ = o.cap_;
    n_ = o.n_;
    cov_ = o.cov_;
    slots_ = o.slots_;
    o.release();
  }
  void release() noexcept {
    owned_.reset();
    base_ = nullptr;
    params_ = Params{};
    shape_ = Shape{};
    lay_ = Layout{};
    total_ = 0;
    cap_ = 0;
    n_ = cov_ = slots_ = nullptr;
  }
  template <class T>
  T* at(std::size_t offset) const {
    return reinterpret_cast<T*>(base_ + offset);
  }

  struct AlignedDelete {
    void operator()(std::byte* p) const { ::operator delete[](p, std::align_val_t(kAlign)); }
  };
  std::unique_ptr<std::byte[], AlignedDelete> owned_;
  std::byte* base_ = nullptr;
  Params params_{};
  Shape shape_{};
  Layout lay_{};
  std::size_t total_ = 0;
  std::int64_t cap_ = 0;
  std::int64_t* n_ = nullptr;
  std::int64_t* cov_ = nullptr;
  std::int64_t* slots_ = nullptr;
};

// Whether dropping the last n tokens of `slot` is exact (kvm::truncate); ok or the reason why not.
template <class S, class A>
Status truncate_check(const State<S, A>& state, std::int64_t slot, std::int64_t n) {
  const std::int64_t n_old = state.tokens(slot);
  if (n < 0 || n > n_old)
    return {StatusCode::kOutOfRange, "truncate n: expected 0 <= n <= tokens of slot " + std::to_string(slot) + " = " +
                                         std::to_string(n_old) + ", got " + std::to_string(n)};
  const std::int64_t n_new = n_old - n;
  if (n == 0 || n_new == 0) return Status::ok();
  const Geometry geo = state.params().geometry();
  const std::int64_t C = geo.chunk, cov_old = state.covered(slot), cov_new = geo.covered(n_new);
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

}  // namespace kvmem::kvm
