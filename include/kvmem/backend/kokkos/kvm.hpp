// SPDX-License-Identifier: Apache-2.0
#pragma once
// KVM on Kokkos: kvm::Backend<kokkos::Executor<Space>>, so kvm::prefill / decode / step / forward and
// the slot operations run on any execution space with the shared kernel bodies (kernel/attend.hpp,
// kernel/kvm_state.hpp).
//
// A call runs chunk segment by chunk segment (an item's tokens cut at multiples of C; at most
// ceil((T - 1) / C) + 1 of them for T tokens, so the launch count follows from the padded sizes), each
// segment as two kernels in the host driver's order (backend/host/kvm.hpp) with the same per-token and
// per-slot bodies (kernel/kvm_state.hpp):
// - state side, one team per (sequence, KV head) item: on host spaces the pending state update with
//   the team's threads over the chunk's tokens (preprocessing, novelty, rank selection, routing) and
//   over slots (scatter, K^/V^ refresh), each token visiting the slots in increasing order as on the
//   host; the segment's tokens into the window ring over the threads; the initial slots (one thread).
//   On device spaces, decode calls included, the update spreads over many teams around this kernel:
//   PrepTag before it (preprocessing and novelty per (item, token block); it must read the ring's
//   tokens [cov, cov + C) before the state kernel writes the segment's tokens there), the state team
//   itself (append selection and appends, before its ring write), RouteTag after it (routing per (item,
//   token block); the item's last routing team to finish, found by an atomic ticket, scatters into the
//   slots and refreshes K^/V^). Each token still visits the slots in increasing order on one thread
//   and each slot adds its tokens in increasing order, so the update's results are the host order's.
//   Every launch decides per item from the counters whether the item updates (item_segment), as the
//   state kernel does, and returns at once where it does not.
// - rows side, the segment's query rows (token, query head) of every item over many teams. On host
//   spaces a team takes kHostRows rows, one per thread, each in the host's tile order through one
//   online softmax, so results are bitwise equal to the host backend's. On device spaces a team takes
//   one row and shares its keys: logits one key per thread (its dot over the thread's vector lanes in
//   kernel::dot's order), then pieces of kAttendTile keys reduced and merged in a fixed order
//   (kernel::piece_weights, merge_piece_factors), so a row's bits depend on neither the team size nor
//   the call's other rows (decode == prefill exactly on every space) and differ from the host order in
//   the last bits only (docs/kokkos.md). A segment of few rows (a decode call) splits each row's pieces
//   over several teams, which leave them in the item's workspace, and the row's last team to finish (an
//   atomic ticket per row) adds them in the same fixed order, so a GPU is filled at batch 1 and the
//   row's bits stay the same.
// |S| after an update is data independent (spec 3.1) and every thread computes it from the budget, so
// no broadcast is needed; an item's running (cov, |S|) passes between segments in its result counters.
//
// kvm::step (sequence slots, docs/slots.md) runs the same driver, state teams per (row, KV head) and
// row teams per packed token: each team reads its row's slot and query_start (a row team finds its row
// by bisection) and the slot's counters inside the kernel, so every
// per-row decision (chunk-boundary update, ring write, slot founding) is taken on the device. The
// slot operations reset_slots and copy_slots are kernels on exec.space as well; export_slot,
// import_slot and truncate fence exec.space and read or write the slot on the host (the record and the
// exactness rule are host code shared with the host backend: kvm/record.hpp, kvm::truncate_check).
//
// Team scratch: the device order's row (q, logits or weights of every key, piece states, piece
// accumulators [pieces, Dv]) is sized from the state's slot capacity plus the window: about 10 KB for
// 256 slots and a 512-token window at D = Dv = 128 fp32, level 0 up to kScratch0Bytes (the ~40 KB CUDA
// cap, DESIGN.md 4) and level 1 beyond. The device order's update tiles (token rows, LN rows of 32
// slots, their logits: 26 KB at D = 128 fp32) are team scratch as well, level 0 or 1 by size. The host
// order keeps each row's q copy, accumulator and softmax state in the State's per-item workspace; the
// update's rows (k0, kg, vg, scores, targets; the host order's LN blocks) live there in both orders.
// The device order's tickets live in the workspace too: the counter fold's in the row list, a routing
// ticket per item in its LN block, a ticket per split row behind the split pieces' states; the launch
// before the one that draws them zeroes them (the state kernel).
//
// Launch sequence of one prefill / decode / step call, all on exec.space (in order, no host round trip
// in between): [checked] one reduction over sequences or rows (rows, lengths, n_ctx, finite inputs,
// gate > 0) read back; [unless the weights are read in place] weights -> state (ln_w, ln_b, tau_s,
// tau_w in Acc); per segment [device order: the update's prep teams] the state teams [device order:
// the update's routing teams] and the row teams; [host order] the per-sequence counter fold (the
// device order's last row team to finish folds them), so a device-order decode call runs four launches.
// Every launch is light-weight (executor.hpp, LightWeight), so queuing one never waits for the previous
// kernel. The per-sequence counters (n, cov, |S|), lengths and rows are read inside the kernels only.
//
// State memory: the State must be placed over memory the space can access AND the host can write,
// because State::place/reset (kvm/state.hpp) zero the counters from the host and the record code
// reads and writes a slot there. create_state() below allocates a Kokkos::View in such a memory space
// (the space's own when it is host-accessible, e.g. Serial/OpenMP/Threads; pass a host-accessible
// device space such as CudaUVMSpace for Cuda). The accessors State::tokens/covered/slots and
// kvm::export_bytes(state, slot) read the counters on the host: fence exec.space first.
// The route log (test hook) is the only path of a step that copies back to the host and allocates.

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <new>
#include <span>
#include <string>
#include <type_traits>
#include <utility>

#include <Kokkos_Core.hpp>

#include "kvmem/backend/kokkos/device_view.hpp"
#include "kvmem/backend/kokkos/executor.hpp"
#include "kvmem/backend/kokkos/slot_lists.hpp"
#include "kvmem/core/numeric.hpp"
#include "kvmem/core/slots.hpp"
#include "kvmem/core/softmax.hpp"
#include "kvmem/core/status.hpp"
#include "kvmem/core/tensor.hpp"
#include "kvmem/kernel/attend.hpp"
#include "kvmem/kernel/kvm_state.hpp"
#include "kvmem/kvm/attention.hpp"
#include "kvmem/kvm/params.hpp"
#include "kvmem/kvm/record.hpp"
#include "kvmem/kvm/state.hpp"
#include "kvmem/policy/budget.hpp"

namespace kvmem::kokkos {

// Where a KVM State for Space lives by default: memory Space's kernels and the host can both reach,
// because State::place zeroes the counters and the slot record code reads and writes them on the host.
// Space's own memory where the host reaches it (Serial, OpenMP, Threads); unified memory on Cuda.
template <class Space, class Mem = typename Space::memory_space,
          bool kHostReaches = Kokkos::SpaceAccessibility<Kokkos::HostSpace, Mem>::accessible>
struct StateMemory {
  using type = Mem;
};
#if defined(KOKKOS_ENABLE_CUDA)
template <class Mem>
struct StateMemory<Kokkos::Cuda, Mem, false> {
  using type = Kokkos::CudaUVMSpace;
};
#endif
template <class Space>
using state_memory_space = typename StateMemory<Space>::type;

// fp8 (e4m3) storage of KVM slots runs on the host and CUDA backends: the Kokkos drivers' readout,
// refresh and copies keep no row scales (BackendLimits<kokkos::Executor>::kKvmFp8 = false).
template <class S>
consteval bool check_kvm_storage() {
  static_assert(!is_row_scaled_v<S>,
                "kvmem::kokkos: fp8 (kvmem::e4m3) storage of KVM slots is not supported on the Kokkos backend "
                "(the host and CUDA backends take it; docs/compose.md, Supported combinations)");
  return true;
}

// A KVM State placed over a Kokkos allocation in MemSpace (owned by `memory`).
template <class S, class A, class MemSpace>
struct KvmState {
  static_assert(check_kvm_storage<S>());
  Kokkos::View<unsigned char*, MemSpace> memory;
  kvm::State<S, A> state;
};

// Allocates State::bytes_required in MemSpace and places a State there. MemSpace must be accessible
// from Space (the kernels) and from the host (State::place zeroes the counters on the host).
template <class S = float, class A = float, class Space, class MemSpace = state_memory_space<Space>>
Status create_state(const Executor<Space>& /*exec*/, const kvm::Params& params, const kvm::Shape& shape,
                    KvmState<S, A, MemSpace>& out) {
  static_assert(Kokkos::SpaceAccessibility<Space, MemSpace>::accessible,
                "kvmem::kokkos::create_state: the execution space cannot access MemSpace");
  static_assert(Kokkos::SpaceAccessibility<Kokkos::HostSpace, MemSpace>::accessible,
                "kvmem::kokkos::create_state: kvm::State::place writes its counters from the host; use a "
                "host-accessible memory space (e.g. Kokkos::CudaUVMSpace for Cuda)");
  KVMEM_RETURN_IF_ERROR(kvm::validate(params, shape));
  const std::size_t bytes = kvm::State<S, A>::bytes_required(params, shape);
  constexpr std::size_t kAlign = kvm::State<S, A>::kAlign;
  KvmState<S, A, MemSpace> st;
  st.memory = Kokkos::View<unsigned char*, MemSpace>(Kokkos::view_alloc(Kokkos::WithoutInitializing, "kvmem kvm state"),
                                                     bytes + kAlign);
  const auto address = reinterpret_cast<std::uintptr_t>(st.memory.data());
  void* aligned = st.memory.data() + (kAlign - address % kAlign) % kAlign;
  KVMEM_RETURN_IF_ERROR((kvm::State<S, A>::place(aligned, bytes, params, shape, st.state)));
  out = std::move(st);
  return Status::ok();
}

namespace detail {

// ItemView of item 0 plus the element distance between consecutive items of every field, taken
// from State::item() on the host, so a kernel derives item i without calling host code.
template <class S, class A>
struct ItemTable {
  kvm::ItemView<S, A> base{};
  std::int64_t sk = 0, sv = 0, rho = 0, cnt = 0, khat = 0, vhat = 0, wk = 0, wv = 0, wg = 0, k0 = 0, kg = 0, vg = 0,
               score = 0, best = 0, target = 0, row = 0, qblock = 0, acc = 0, soft = 0;

  explicit ItemTable(const kvm::State<S, A>& st) : base(st.item(0, 0)) {
    const std::int64_t Hk = st.shape().Hk;
    if (st.shape().B * Hk < 2) return;
    const kvm::ItemView<S, A> next = st.item(1 / Hk, 1 % Hk);
    sk = next.sk - base.sk;
    sv = next.sv - base.sv;
    rho = next.rho - base.rho;
    cnt = next.cnt - base.cnt;
    khat = next.khat - base.khat;
    vhat = next.vhat - base.vhat;
    wk = next.wk - base.wk;
    wv = next.wv - base.wv;
    wg = next.wg - base.wg;
    k0 = next.k0 - base.k0;
    kg = next.kg - base.kg;
    vg = next.vg - base.vg;
    score = next.score - base.score;
    best = next.best - base.best;
    target = next.target - base.target;
    row = next.row - base.row;
    qblock = next.qblock - base.qblock;
    acc = next.acc - base.acc;
    soft = next.soft - base.soft;
  }
  KOKKOS_INLINE_FUNCTION kvm::ItemView<S, A> at(std::int64_t i) const {
    kvm::ItemView<S, A> v = base;
    v.sk += i * sk;
    v.sv += i * sv;
    v.rho += i * rho;
    v.cnt += i * cnt;
    v.khat += i * khat;
    v.vhat += i * vhat;
    v.wk += i * wk;
    v.wv += i * wv;
    v.wg += i * wg;
    v.k0 += i * k0;
    v.kg += i * kg;
    v.vg += i * vg;
    v.score += i * score;
    v.best += i * best;
    v.target += i * target;
    v.row += i * row;
    v.qblock += i * qblock;
    v.acc += i * acc;
    v.soft += i * soft;
    return v;
  }
};

// budget::Any::slots dispatches through a host lambda; this switch reaches the same KVMEM_HOST_DEVICE
// policy functions (policy/budget.hpp) from a kernel.
KOKKOS_INLINE_FUNCTION std::int64_t budget_slots(const budget::Any& b, std::int64_t tokens, std::int64_t avail,
                                                 std::int64_t current) {
  switch (b.kind) {
    case budget::Any::Kind::kPower:
      return b.power.slots(tokens, avail, current);
    case budget::Any::Kind::kSaturating:
      return b.saturating.slots(tokens, avail, current);
    case budget::Any::Kind::kFixed:
    case budget::Any::Kind::kUser:  // never reached: a user budget's targets come from the state's table
      break;
  }
  return b.fixed.slots(tokens, avail, current);
}

// Route log record of one update: first token, |S| before, |S| after, then C targets.
inline constexpr std::int64_t kRouteHeader = 3;

// One sequence's share of a call, resolved inside the kernels from the call's lengths or rows and
// the state's counters: state slot b (-1 for a padding row), token count, first packed token x0.
struct SeqRef {
  std::int64_t b = -1, len = 0, x0 = 0;
  bool ok = false;  // b names a slot and its sizes fit (what the checked reduction guarantees)
};

// A query token of one segment of a call: its sequence (or row) and absolute position t.
struct TokenRef {
  SeqRef seq;
  std::int64_t t = 0;
  bool ok = false;  // the token exists, its sequence is ok and names a slot, and t is in the segment
};

// The two kernels of a segment (KvmCall): the state side (update, ring, initial slots) and the rows.
struct StateTag {};
struct RowsTag {};
// The device order's state update U (spec 4.5) over many teams, around the segment's state kernel:
// key preprocessing and novelty per (item, token block) before it; the state kernel's team then selects
// and appends; merge routing per (item, token block) after it, the last routing team of an item
// scattering into the slots and refreshing K^/V^.
struct PrepTag {};
struct RouteTag {};

// Tokens per team of the update's token-block launches and slots per LN tile: a tile's LN rows, the
// block's token rows and their logits fit in level-0 scratch at D = 128 fp32 (26 KB, under
// kScratch0Bytes), and C = 256 gives 16 teams per item.
inline constexpr std::int64_t kUpdateTokens = 16;
inline constexpr std::int64_t kUpdateSlots = 32;

// Row teams a device-order call should launch at least before it splits rows' keys over several teams:
// about a GPU's multiprocessor count (132 on an H200), so a decode call of a few rows still fills the
// device. A space whose concurrency asks for more teams (concurrency / kDeviceTeam) gets more.
inline constexpr std::int64_t kFillTeams = 128;

// What the state side of one segment does for one item, decided from device data alone (the call's
// lengths or rows and the counters): the same answer for the state kernel and every update launch.
struct ItemSegment {
  std::int64_t i = -1;          // the state's item (slot b, KV head g); -1: the item is skipped
  std::int64_t cov = 0, S = 0;  // tokens covered and |S| entering the segment
  std::int64_t t0 = 0, t1 = 0;  // the segment's tokens [t0, t1); empty when t0 == t1
  bool updating = false;        // U(tokens [cov, cov + C)) runs before the segment (spec 4.7 step 4)
};

// prefill / decode: sequence b is batch row b of q [B,Hq,T,D], k [B,Hk,T,D], v [B,Hk,T,Dv],
// gate [B,Hk,T], out [B,T,Hq,Dv]; lengths [B] (or nullptr: all T).
template <class In, class Out>
struct BatchIo {
  DeviceView<const In, 4> q, k, v;
  DeviceView<const In, 3> gate;
  DeviceView<Out, 4> out;
  const std::int64_t* lengths;
  std::int64_t T;

  KOKKOS_INLINE_FUNCTION std::int64_t count() const { return q.extent[0]; }
  KOKKOS_INLINE_FUNCTION SeqRef seq(std::int64_t b, const std::int64_t* n_seq, std::int64_t n_ctx) const {
    SeqRef s;
    s.b = b;
    s.len = lengths ? lengths[b] : T;
    s.ok = s.len >= 0 && s.len <= T && n_seq[b] + s.len <= n_ctx;
    return s;
  }
  KOKKOS_INLINE_FUNCTION const In& q_at(const SeqRef& s, std::int64_t h, std::int64_t i, std::int64_t d) const {
    return q(s.b, h, i, d);
  }
  KOKKOS_INLINE_FUNCTION const In& k_at(const SeqRef& s, std::int64_t g, std::int64_t i, std::int64_t d) const {
    return k(s.b, g, i, d);
  }
  KOKKOS_INLINE_FUNCTION const In& v_at(const SeqRef& s, std::int64_t g, std::int64_t i, std::int64_t d) const {
    return v(s.b, g, i, d);
  }
  KOKKOS_INLINE_FUNCTION const In& gate_at(const SeqRef& s, std::int64_t g, std::int64_t i) const {
    return gate(s.b, g, i);
  }
  KOKKOS_INLINE_FUNCTION Out& out_at(const SeqRef& s, std::int64_t i, std::int64_t h, std::int64_t d) const {
    return out(s.b, i, h, d);
  }
  KOKKOS_INLINE_FUNCTION float* lse_at(const SeqRef&, std::int64_t, std::int64_t) const { return nullptr; }
  // Output rows of the batch past the sequence's length (zeroed).
  KOKKOS_INLINE_FUNCTION std::int64_t tail(const SeqRef& s) const { return out.extent[1] - s.len; }
  // The most tokens one sequence brings to a call of `tokens` padded tokens.
  std::int64_t token_bound(std::int64_t) const { return T; }
  // The rows kernel's tokens: batch row x / span, x % span-th token of the segment (span = min(T, C)).
  KOKKOS_INLINE_FUNCTION std::int64_t row_tokens(std::int64_t C) const { return count() * (T < C ? T : C); }
  KOKKOS_INLINE_FUNCTION TokenRef locate(std::int64_t x, std::int64_t seg, std::int64_t C, const std::int64_t* n_seq,
                                         std::int64_t n_ctx) const {
    TokenRef r;
    const std::int64_t span = T < C ? T : C;
    if (span <= 0 || x / span >= count()) return r;
    r.seq = seq(x / span, n_seq, n_ctx);
    if (!r.seq.ok) return r;
    const std::int64_t n0 = n_seq[r.seq.b], t0 = seg == 0 ? n0 : (n0 / C + seg) * C;
    r.t = t0 + x % span;
    r.ok = r.t < n0 + r.seq.len && r.t < (t0 / C + 1) * C;
    return r;
  }
};

// kvm::step: row r runs packed tokens [query_start[r], query_start[r+1]) of q [tokens,Hq,D],
// k [tokens,Hk,D], v [tokens,Hk,Dv], gate [tokens,Hk] for slot[r]; out [tokens,Hq,Dv], lse
// [tokens,Hq] (data nullptr: not written).
template <class In, class Out>
struct PackedIo {
  DeviceView<const std::int32_t, 1> slot;         // [rows]
  DeviceView<const std::int32_t, 1> query_start;  // [rows + 1]
  DeviceView<const In, 3> q, k, v;
  DeviceView<const In, 2> gate;
  DeviceView<Out, 3> out;
  DeviceView<float, 2> lse;
  std::int64_t B;            // max_slots
  std::int64_t max_len = 0;  // Rows::max_query_len (0: no bound)

  KOKKOS_INLINE_FUNCTION std::int64_t count() const { return slot.extent[0]; }
  // Unchecked calls (Executor::checked = false) read rows nobody validated: a row whose slot is out
  // of range, whose slot an earlier row already names (two rows would race on one slot), whose starts
  // decrease, whose tokens overflow n_ctx or exceed max_len is not ok and is skipped with its slot
  // untouched.
  KOKKOS_INLINE_FUNCTION SeqRef seq(std::int64_t r, const std::int64_t* n_seq, std::int64_t n_ctx) const {
    SeqRef s;
    s.b = slot(r);
    s.x0 = query_start(r);
    s.len = query_start(r + 1) - s.x0;
    if (s.b < 0) {  // padding: only its output rows are written (zeroed)
      s.ok = s.b == -1 && s.len >= 0 && s.x0 >= 0 && s.x0 + s.len <= q.extent[0];
      return s;
    }
    s.ok = s.b < B && s.len >= 0 && s.x0 >= 0 && s.x0 + s.len <= q.extent[0] && n_seq[s.b] + s.len <= n_ctx &&
           (max_len == 0 || s.len <= max_len);
    for (std::int64_t e = 0; e < r && s.ok; ++e)
      if (slot(e) == s.b) s.ok = false;
    return s;
  }
  KOKKOS_INLINE_FUNCTION const In& q_at(const SeqRef& s, std::int64_t h, std::int64_t i, std::int64_t d) const {
    return q(s.x0 + i, h, d);
  }
  KOKKOS_INLINE_FUNCTION const In& k_at(const SeqRef& s, std::int64_t g, std::int64_t i, std::int64_t d) const {
    return k(s.x0 + i, g, d);
  }
  KOKKOS_INLINE_FUNCTION const In& v_at(const SeqRef& s, std::int64_t g, std::int64_t i, std::int64_t d) const {
    return v(s.x0 + i, g, d);
  }
  KOKKOS_INLINE_FUNCTION const In& gate_at(const SeqRef& s, std::int64_t g, std::int64_t i) const {
    return gate(s.x0 + i, g);
  }
  KOKKOS_INLINE_FUNCTION Out& out_at(const SeqRef& s, std::int64_t i, std::int64_t h, std::int64_t d) const {
    return out(s.x0 + i, h, d);
  }
  KOKKOS_INLINE_FUNCTION float* lse_at(const SeqRef& s, std::int64_t i, std::int64_t h) const {
    return lse.data != nullptr ? &lse(s.x0 + i, h) : nullptr;
  }
  KOKKOS_INLINE_FUNCTION std::int64_t tail(const SeqRef&) const { return 0; }
  // The most tokens one row that is ok brings to a call of `tokens` packed tokens (max_len bounds it).
  std::int64_t token_bound(std::int64_t tokens) const { return max_len > 0 && max_len < tokens ? max_len : tokens; }
  // The rows kernel's tokens: packed token x, in the row whose [query_start[r], query_start[r+1])
  // holds it (found by bisection over query_start; a call with decreasing starts is not ok anyway).
  KOKKOS_INLINE_FUNCTION std::int64_t row_tokens(std::int64_t) const { return q.extent[0]; }
  KOKKOS_INLINE_FUNCTION TokenRef locate(std::int64_t x, std::int64_t seg, std::int64_t C, const std::int64_t* n_seq,
                                         std::int64_t n_ctx) const {
    TokenRef r;
    const std::int64_t R = count();
    if (R == 0 || x >= q.extent[0]) return r;
    std::int64_t lo = 0, hi = R;  // the last row whose start is <= x lies in [lo, hi)
    while (hi - lo > 1) {
      const std::int64_t mid = lo + (hi - lo) / 2;
      if (query_start(mid) <= x)
        lo = mid;
      else
        hi = mid;
    }
    r.seq = seq(lo, n_seq, n_ctx);
    if (r.seq.b < 0 || !r.seq.ok || x < r.seq.x0 || x >= r.seq.x0 + r.seq.len) return r;
    const std::int64_t n0 = n_seq[r.seq.b];
    r.t = n0 + (x - r.seq.x0);
    r.ok = r.t / C - n0 / C == seg;
    return r;
  }
};

template <class S, class A, class In, class Out, class Io>
struct KvmCall {
  ItemTable<S, A> items;
  std::int64_t* n_seq;      // [B]
  std::int64_t* cov_seq;    // [B]
  std::int64_t* slots_seq;  // [B]
  std::int64_t* result;     // [B*Hk, 2]
  const A* ln_w;            // [D]
  const A* ln_b;            // [D]
  const A* tau_s;           // [Hq]
  const A* tau_w;           // [Hq]
  Io io;                    // the call's inputs and outputs (BatchIo or PackedIo)
  std::int64_t Hk, rep, D, Dv, n_ctx;
  std::int64_t C, nb, sink, rope_dims;
  budget::Any budget;
  const std::int64_t* targets;  // a user budget's target per update (State::update_targets), else nullptr
  bool merge_gate_keys, merge_gate_values, head_temps, value_radius, gate_appends, gate_initial;
  A eps, scale;
  std::int64_t* log;  // [B*Hk, log_stride] or nullptr
  std::int64_t log_stride;
  // Launch choices (run_call): the segment both kernels run, the row order (executor.hpp, kHostOrder),
  // the (token, head) pairs of a host-order team, and the split order's key and piece capacity.
  std::int64_t seg = 0;
  bool host_order = true;
  // Whether the state kernel runs a pending update itself on its team (the host order): otherwise the
  // device order's update launches (PrepTag .. RefreshTag) ran it before, decode calls included (one
  // team would take milliseconds over an update's C x |S| dots, a stall every C steps).
  bool team_update = true;
  std::int64_t host_rows = 1, keys_cap = 0, pieces_cap = 0;
  // Device order: a row's pieces of kAttendTile keys go to `splits` teams, split_pieces consecutive
  // pieces each (splits = 1: one team per row, split_pieces = pieces_cap). With several splits every
  // team leaves its pieces' softmax states and accumulators in the item's workspace, and the team that
  // finishes the row last (split_ticket) merges them; row_threads is the row teams' thread count (one
  // lane-partial block each in scratch).
  std::int64_t splits = 1, split_pieces = 0, row_threads = 1;
  // Device order, the last segment of a call: the rows launch also folds the call's counters
  // (count_seq), so a call needs no counter launch. The state kernel's first team zeroes `ticket` (a
  // workspace word no Kokkos kernel uses otherwise: the state's row list), each row team takes a number
  // from it when it has finished reading the counters, and the team that draws the last number folds
  // every sequence in increasing order.
  bool fold_counters = false;
  std::int64_t* ticket = nullptr;

  KOKKOS_INLINE_FUNCTION std::int64_t W() const { return C * nb; }
  // spec 4.1: first window position when n tokens exist, max(0, ceil(n/C) C - nb C).
  KOKKOS_INLINE_FUNCTION std::int64_t bswa_begin(std::int64_t tokens) const {
    const std::int64_t begin = (tokens + C - 1) / C * C - W();
    return begin > 0 ? begin : 0;
  }
  // Sequence (or row) x of the call; unless ok, its items and counters are skipped.
  KOKKOS_INLINE_FUNCTION SeqRef seq(std::int64_t x) const { return io.seq(x, n_seq, n_ctx); }
  // |S| after the update absorbing [a, a + C) from `current` (spec 3.1; data independent).
  KOKKOS_INLINE_FUNCTION std::int64_t appends(std::int64_t a, std::int64_t current) const {
    // a = u C for update u; a user budget's targets were evaluated on the host (kvm/state.hpp).
    const std::int64_t target = targets != nullptr ? targets[a / C] : budget_slots(budget, W() + a, a + C, current);
    const std::int64_t n_app = target - current;
    return n_app < C ? n_app : C;
  }

  // Sequence x's counters after the call: tokens seen, and (cov, |S|) of its first KV head's item (all
  // heads of a sequence agree). Runs once every kernel that reads n_seq or writes `result` has finished.
  KOKKOS_INLINE_FUNCTION void count_seq(std::int64_t x) const {
    const SeqRef sq = seq(x);
    if (sq.b < 0 || !sq.ok) return;
    n_seq[sq.b] += sq.len;
    cov_seq[sq.b] = result[2 * (sq.b * Hk)];
    slots_seq[sq.b] = result[2 * (sq.b * Hk) + 1];
  }
  // Whether the calling team is the last of `teams` teams to draw a number from *counter (zeroed by an
  // earlier launch). Every thread fences its writes before the team draws and the last team fences
  // after its draw, so it may then read what the other teams wrote, past the L1 cache (another
  // multiprocessor's L1 may hold an older line: volatile loads). Every thread gets the answer.
  template <class Member>
  KOKKOS_INLINE_FUNCTION static bool last_team(const Member& team, std::int64_t* counter, std::int64_t teams) {
    Kokkos::memory_fence();
    team.team_barrier();
    bool last = false;
    Kokkos::single(
        Kokkos::PerTeam(team),
        [&](bool& is_last) {
          Kokkos::memory_fence();
          is_last = Kokkos::atomic_fetch_add(counter, std::int64_t(1)) == teams - 1;
          if (is_last) Kokkos::memory_fence();
        },
        last);
    return last;
  }
  // fold_counters: after the calling team's last read of n_seq, the team that finishes last runs
  // count_seq over the sequences in increasing order (it reads `result`, written by earlier launches).
  template <class Member>
  KOKKOS_INLINE_FUNCTION void count_after_last_team(const Member& team) const {
    if (!last_team(team, ticket, team.league_size())) return;
    Kokkos::single(Kokkos::PerTeam(team), [&]() {
      for (std::int64_t x = 0; x < io.count(); ++x) count_seq(x);
    });
  }

  // The parameters the shared state-step bodies read (kernel/kvm_state.hpp).
  KOKKOS_INLINE_FUNCTION kernel::KvmStepParams<A> step_params() const {
    kernel::KvmStepParams<A> p;
    p.D = D;
    p.Dv = Dv;
    p.rope_dims = rope_dims;
    p.ln_w = ln_w;
    p.ln_b = ln_b;
    p.eps = eps;
    p.merge_gate_keys = merge_gate_keys;
    p.merge_gate_values = merge_gate_values;
    p.gate_appends = gate_appends;
    p.gate_initial = gate_initial;
    p.value_radius = value_radius;
    return p;
  }

  // K^_j = LN_s(Sk_j) and V^_j for slots [j0, j1) (spec 4.4 steps 1-2), on the calling thread.
  KOKKOS_INLINE_FUNCTION void refresh(const kvm::ItemView<S, A>& it, std::int64_t j0, std::int64_t j1) const {
    const kernel::KvmStepParams<A> kp = step_params();
    for (std::int64_t j = j0; j < j1; ++j)
      kernel::refresh_slot(kp, it.sk + j * D, it.sv + j * Dv, it.rho[j], it.cnt[j], it.row, it.khat + j * D,
                           it.vhat + j * Dv);
  }

  // Spec 4.3: the token at ring slot `ring` founds slot j (rho from the raw v). One thread.
  KOKKOS_INLINE_FUNCTION void init_slot(const kvm::ItemView<S, A>& it, std::int64_t ring, std::int64_t j) const {
    kernel::found_slot(step_params(), it.wk + ring * D, it.wv + ring * Dv, it.wg[ring], it.sk + j * D, it.sv + j * Dv,
                       it.rho + j, it.cnt + j);
    refresh(it, j, j + 1);
  }

  // The item's LN rows of slots [j0, j0 + rows), rows <= kRowBlock, one slot per thread.
  template <class Member>
  KOKKOS_INLINE_FUNCTION void ln_rows(const Member& team, const kvm::ItemView<S, A>& it, std::int64_t j0,
                                      std::int64_t rows) const {
    Kokkos::parallel_for(Kokkos::TeamThreadRange(team, rows), [&](const std::int64_t r) {
      kernel::layer_norm(it.sk + (j0 + r) * D, D, ln_w, ln_b, eps, it.row + r * D);
    });
    team.team_barrier();
  }

  // Spec 4.5: U(tokens [a, a + C) read from the ring) by the whole team: tokens spread over the
  // threads for preprocessing, novelty, append selection and routing; slots for the scatter and the
  // K^/V^ refresh. Slots are visited in blocks of kRowBlock in increasing order (LN rows shared by the
  // team), and every token compares them in that order, so each token's score, rank and route equal
  // the one-thread order of the host driver exactly. Every thread returns the new |S|.
  template <class Member>
  KOKKOS_INLINE_FUNCTION std::int64_t update(const Member& team, const kvm::ItemView<S, A>& it, std::int64_t a,
                                             std::int64_t S_cur) const {
    constexpr std::int64_t kRows = kvm::State<S, A>::kRowBlock;
    const kernel::KvmStepParams<A> kp = step_params();
    const std::int64_t w = W();
    Kokkos::parallel_for(Kokkos::TeamThreadRange(team, C), [&](const std::int64_t i) {  // step 1: k0, kg, vg
      const std::int64_t ring = (a + i) % w;
      kernel::prepare_token(kp, it.wk + ring * D, it.wv + ring * Dv, it.wg[ring], it.k0 + i * D, it.kg + i * D,
                            it.vg + i * Dv);
      it.score[i] = negative_infinity<A>();
    });
    team.team_barrier();
    const std::int64_t n_app = appends(a, S_cur);
    if (n_app > 0) {  // step 2: novelty against the pre-update state, ungated k0, sink included
      for (std::int64_t j0 = 0; j0 < S_cur; j0 += kRows) {
        const std::int64_t rows = S_cur - j0 < kRows ? S_cur - j0 : kRows;
        ln_rows(team, it, j0, rows);
        Kokkos::parallel_for(Kokkos::TeamThreadRange(team, C), [&](const std::int64_t i) {
          kernel::novelty_update_rows(it.k0 + i * D, 1, D, it.row, rows, it.score + i);
        });
        team.team_barrier();
      }
    }
    Kokkos::parallel_for(Kokkos::TeamThreadRange(team, C), [&](const std::int64_t i) {
      it.target[i] = n_app > 0 ? kernel::append_target(it.score, C, n_app, i) : 0;
    });
    team.team_barrier();
    // Ranks are distinct, so exactly n_app tokens (n_app <= C) are appended.
    const std::int64_t S_new = S_cur + (n_app > 0 ? n_app : 0);
    Kokkos::parallel_for(Kokkos::TeamThreadRange(team, C), [&](const std::int64_t i) {  // step 3: appends
      if (it.target[i] != -1) return;
      const std::int64_t j = kernel::append_slot_index(it.target, i, S_cur);
      kernel::append_slot(kp, it.k0 + i * D, it.kg + i * D, it.vg + i * Dv, it.wv + (a + i) % w * Dv, it.sk + j * D,
                          it.sv + j * Dv, it.rho + j, it.cnt + j);
    });
    team.team_barrier();
    if (n_app < C) {  // step 4: route against K^+ of the expanded state, then one scatter
      for (std::int64_t j0 = sink; j0 < S_new; j0 += kRows) {
        const std::int64_t rows = S_new - j0 < kRows ? S_new - j0 : kRows;
        ln_rows(team, it, j0, rows);
        Kokkos::parallel_for(Kokkos::TeamThreadRange(team, C), [&](const std::int64_t i) {
          kernel::merge_route_update_rows(it.kg + i * D, 1, D, it.row, j0, rows, it.best + i, it.target + i,
                                          j0 == sink);
        });
        team.team_barrier();
      }
      const std::int64_t merged = S_new > sink ? S_new - sink : 0;
      Kokkos::parallel_for(Kokkos::TeamThreadRange(team, merged), [&](const std::int64_t x) {
        const std::int64_t j = sink + x;
        kernel::scatter_into_slot(it.kg, it.vg, it.target, C, D, Dv, j, it.sk + j * D, it.sv + j * Dv, it.cnt + j);
      });
      team.team_barrier();
    }
    for (std::int64_t j0 = sink; j0 < S_new; j0 += kRows) {  // K^/V^ of every non-sink slot
      const std::int64_t rows = S_new - j0 < kRows ? S_new - j0 : kRows;
      Kokkos::parallel_for(Kokkos::TeamThreadRange(team, rows), [&](const std::int64_t r) {
        const std::int64_t j = j0 + r;
        kernel::refresh_slot(kp, it.sk + j * D, it.sv + j * Dv, it.rho[j], it.cnt[j], it.row + r * D, it.khat + j * D,
                             it.vhat + j * Dv);
      });
      team.team_barrier();
    }
    return S_new;
  }

  // Segment seg of a sequence with n0 tokens before the call: the chunk-aligned token range
  // [t0, t1) it covers (the first segment starts at n0; each later one at a multiple of C).
  KOKKOS_INLINE_FUNCTION std::int64_t segment_begin(std::int64_t n0, std::int64_t s) const {
    return s == 0 ? n0 : (n0 / C + s) * C;
  }

  // Segment seg of sequence (or row) sq's KV head g: its tokens, the running (cov, |S|) entering it
  // (the counters in segment 0, the previous segment's result after) and whether the pending update
  // runs first: cov < bswa_begin(t0 + 1) (spec 4.6, 4.7 step 4). Padding and rejected rows are skipped.
  KOKKOS_INLINE_FUNCTION ItemSegment item_segment(const SeqRef& sq, std::int64_t g) const {
    ItemSegment s;
    if (sq.b < 0 || !sq.ok) return s;
    s.i = sq.b * Hk + g;
    const std::int64_t n0 = n_seq[sq.b], end = n0 + sq.len;
    s.cov = seg == 0 ? cov_seq[sq.b] : result[2 * s.i];
    s.S = seg == 0 ? slots_seq[sq.b] : result[2 * s.i + 1];
    s.t0 = s.t1 = segment_begin(n0, seg);
    if (s.t0 < end) {
      const std::int64_t chunk_end = (s.t0 / C + 1) * C;
      s.t1 = end < chunk_end ? end : chunk_end;
      s.updating = s.cov < bswa_begin(s.t0 + 1);
    }
    return s;
  }
  // The same for item x of the call (sequence or row x / Hk, KV head x % Hk).
  KOKKOS_INLINE_FUNCTION ItemSegment item_segment(std::int64_t x) const { return item_segment(seq(x / Hk), x % Hk); }
  // Appended slots of the update from (a, |S|): n_app > 0 of spec 3.1, else none.
  KOKKOS_INLINE_FUNCTION std::int64_t appended(std::int64_t a, std::int64_t current) const {
    const std::int64_t n_app = appends(a, current);
    return n_app > 0 ? n_app : 0;
  }

  // ---- the device order's update pipeline (spec 4.5 over many teams) ----------------------------------
  // Each launch finds its item's segment itself (item_segment) and returns at once unless the item
  // updates, so the pipeline needs no read-back. Every token's novelty score and route is taken over the slots in
  // increasing order by one thread with the host's bodies (kernel::novelty_update_logits,
  // merge_route_update_logits on dots computed as kernel::dot), and every slot's scatter adds its
  // tokens in increasing order, so the update's results are those of the host order bitwise (where the
  // same compiler builds them) and depend neither on the team size nor on the order teams run in.

  KOKKOS_INLINE_FUNCTION std::int64_t token_blocks() const { return (C + kUpdateTokens - 1) / kUpdateTokens; }
  // Team scratch of a token-block launch: the block's token rows [kUpdateTokens, D + 1] and a tile's LN
  // rows [kUpdateSlots, D + 1] (one padding element per row, so threads reading different rows at the
  // same d hit different banks), and the block's logits [kUpdateTokens, kUpdateSlots].
  KOKKOS_INLINE_FUNCTION std::size_t block_scratch_bytes() const {
    return sizeof(A) *
           static_cast<std::size_t>((kUpdateTokens + kUpdateSlots) * (D + 1) + kUpdateTokens * kUpdateSlots);
  }
  // Team scratch of a routing team: a token block's, or the C targets the last team copies there.
  KOKKOS_INLINE_FUNCTION std::size_t route_scratch_bytes() const {
    const std::size_t targets = sizeof(std::int64_t) * static_cast<std::size_t>(C);
    return block_scratch_bytes() > targets ? block_scratch_bytes() : targets;
  }
  KOKKOS_INLINE_FUNCTION static int scratch_level(std::size_t bytes) { return bytes <= kScratch0Bytes ? 0 : 1; }

  // Whether the update's LN rows LN_s(Sk_j) are the slots' readout keys K^_j: with Acc storage K^_j
  // holds kernel::layer_norm's bits (kernel::refresh_slot), and every change of Sk_j is followed by a
  // refresh before an update reads the slot (the refresh stage, slot founding, import; appended slots:
  // append_stage), so an update's tiles copy K^ instead of normalising each slot again in every token
  // block. The copy equals the LN of the call's ln_w, ln_b where those are the weights the slots were
  // refreshed with (a layer's weights do not change between its calls). Other storage rounds K^, so
  // its tiles normalise Sk as the host does.
  static constexpr bool kLnFromReadout = std::is_same_v<S, A>;

  // Tokens [i0, i0 + n) of the update against slots [j_begin, j_end), by the team, in tiles of
  // kUpdateSlots slots in increasing order: the tile's LN rows (K^ rows, kLnFromReadout; else one slot
  // per thread, kernel::layer_norm as on the host), the tokens x slots dots (one per thread, kernel::dot
  // with the host's operands), then per token the tile's logits in increasing slot order through the
  // host's update rule: novelty (spec 4.5 step 2: score = max over slots of k0 . LN_s(Sk_j), NaN never
  // wins) or routing (step 4: argmax over slots of kg . K^+_j, strict improvement, so ties keep the
  // smaller j; tokens already appended are skipped). Scores and routes start from it.score / it.best,
  // it.target.
  template <class Member>
  KOKKOS_INLINE_FUNCTION void token_slot_tiles(const Member& team, A* scratch, const kvm::ItemView<S, A>& it,
                                               std::int64_t i0, std::int64_t n, std::int64_t j_begin,
                                               std::int64_t j_end, bool novelty) const {
    const std::int64_t ld = D + 1;
    A* tok = scratch;
    A* ln = tok + kUpdateTokens * ld;
    A* logit = ln + kUpdateSlots * ld;
    const A* src = novelty ? it.k0 : it.kg;
    Kokkos::parallel_for(Kokkos::TeamThreadRange(team, n * D),
                         [&](const std::int64_t x) { tok[x / D * ld + x % D] = src[(i0 + x / D) * D + x % D]; });
    for (std::int64_t j0 = j_begin; j0 < j_end; j0 += kUpdateSlots) {
      const std::int64_t rows = j_end - j0 < kUpdateSlots ? j_end - j0 : kUpdateSlots;
      if constexpr (kLnFromReadout) {  // the tile's K^ rows, read coalesced
        Kokkos::parallel_for(Kokkos::TeamThreadRange(team, rows * D),
                             [&](const std::int64_t x) { ln[x / D * ld + x % D] = it.khat[(j0 + x / D) * D + x % D]; });
      } else {
        Kokkos::parallel_for(Kokkos::TeamThreadRange(team, rows), [&](const std::int64_t r) {
          kernel::layer_norm(it.sk + (j0 + r) * D, D, ln_w, ln_b, eps, ln + r * ld);
        });
      }
      team.team_barrier();
      Kokkos::parallel_for(Kokkos::TeamThreadRange(team, n * rows), [&](const std::int64_t x) {
        const std::int64_t t = x / rows, r = x % rows;
        if (novelty || it.target[i0 + t] != -1) logit[t * kUpdateSlots + r] = kernel::dot(ln + r * ld, tok + t * ld, D);
      });
      team.team_barrier();
      Kokkos::parallel_for(Kokkos::TeamThreadRange(team, n), [&](const std::int64_t t) {
        if (novelty)
          kernel::novelty_update_logits(logit + t * kUpdateSlots, kUpdateSlots, 1, rows, it.score + i0 + t);
        else
          kernel::merge_route_update_logits(logit + t * kUpdateSlots, kUpdateSlots, 1, j0, rows, it.best + i0 + t,
                                            it.target + i0 + t, j0 == j_begin);
      });
      team.team_barrier();
    }
  }

  // Stage 1-2, a team per (item, block of kUpdateTokens tokens): k0, kg, vg of the block's tokens from
  // the ring (spec 4.5 step 1), then, when the update appends, their novelty against every slot of the
  // pre-update state, sink included, with the ungated k0 (step 2).
  template <class Member>
  KOKKOS_INLINE_FUNCTION void operator()(PrepTag, const Member& team) const {
    const std::int64_t blocks = token_blocks();
    const ItemSegment ps = item_segment(team.league_rank() / blocks);
    if (!ps.updating) return;
    const std::int64_t i0 = team.league_rank() % blocks * kUpdateTokens;
    const std::int64_t n = C - i0 < kUpdateTokens ? C - i0 : kUpdateTokens, a = ps.cov, w = W();
    const kvm::ItemView<S, A> it = items.at(ps.i);
    const kernel::KvmStepParams<A> kp = step_params();
    Kokkos::parallel_for(Kokkos::TeamThreadRange(team, n), [&](const std::int64_t t) {
      const std::int64_t x = i0 + t, ring = (a + x) % w;
      kernel::prepare_token(kp, it.wk + ring * D, it.wv + ring * Dv, it.wg[ring], it.k0 + x * D, it.kg + x * D,
                            it.vg + x * Dv);
      it.score[x] = negative_infinity<A>();
    });
    team.team_barrier();
    if (appended(a, ps.S) == 0) return;
    A* scratch =
        static_cast<A*>(team.team_scratch(scratch_level(block_scratch_bytes())).get_shmem(block_scratch_bytes()));
    token_slot_tiles(team, scratch, it, i0, n, 0, ps.S, /*novelty=*/true);
  }

  // (cov, |S|) of an item after the update absorbing [a, a + C) from |S| = current (the state kernel's
  // running counters; no initial slot is founded in a segment that updates: its tokens lie past W >= C).
  KOKKOS_INLINE_FUNCTION void after_update(std::int64_t a, std::int64_t current, std::int64_t& cov,
                                           std::int64_t& slots) const {
    cov = a + C;
    slots = current + appends(a, current);
  }
  // The number the routing teams of an item draw (last_team) before the last one scatters and
  // refreshes: the first word of the item's LN-row block, which only the host order's update, slot
  // founding and import use; the state kernel of an updating item zeroes it.
  KOKKOS_INLINE_FUNCTION static std::int64_t* route_ticket(const kvm::ItemView<S, A>& it) {
    return reinterpret_cast<std::int64_t*>(it.row);
  }

  // Stage 3, on the state kernel's team of an updating item (after every token's score is final): append
  // selection by rank over the C scores (spec 4.5 step 2; targets 0 when nothing is appended), then the
  // appended tokens' slots in increasing token order (step 3), their raw values read from the ring
  // before the team writes the segment's tokens there.
  template <class Member>
  KOKKOS_INLINE_FUNCTION void append_stage(const Member& team, const kvm::ItemView<S, A>& it, std::int64_t a,
                                           std::int64_t S_cur) const {
    const std::int64_t n_app = appended(a, S_cur), w = W();
    const kernel::KvmStepParams<A> kp = step_params();
    Kokkos::parallel_for(Kokkos::TeamThreadRange(team, C), [&](const std::int64_t i) {
      it.target[i] = n_app > 0 ? kernel::append_target(it.score, C, n_app, i) : 0;
    });
    team.team_barrier();
    Kokkos::parallel_for(Kokkos::TeamThreadRange(team, C), [&](const std::int64_t i) {
      if (it.target[i] != -1) return;
      const std::int64_t j = kernel::append_slot_index(it.target, i, S_cur);
      kernel::append_slot(kp, it.k0 + i * D, it.kg + i * D, it.vg + i * Dv, it.wv + (a + i) % w * Dv, it.sk + j * D,
                          it.sv + j * Dv, it.rho + j, it.cnt + j);
      // the routing stage reads K^_j of the expanded state (kLnFromReadout); the refresh stage rewrites it
      if constexpr (kLnFromReadout) kernel::layer_norm(it.sk + j * D, D, ln_w, ln_b, eps, it.khat + j * D);
    });
    team.team_barrier();
  }

  // Stage 4, a team per (item, token block), after the state kernel: the block's merge tokens routed
  // against K^+ of the expanded state, non-sink slots only (spec 4.5 step 4). The item's last team to
  // finish runs stage 5 (refresh_stage), so the update needs no launch of its own for it.
  template <class Member>
  KOKKOS_INLINE_FUNCTION void operator()(RouteTag, const Member& team) const {
    const std::int64_t blocks = token_blocks();
    const ItemSegment ps = item_segment(team.league_rank() / blocks);
    if (!ps.updating) return;
    const std::int64_t n_app = appended(ps.cov, ps.S);
    const kvm::ItemView<S, A> it = items.at(ps.i);
    A* scratch =
        static_cast<A*>(team.team_scratch(scratch_level(route_scratch_bytes())).get_shmem(route_scratch_bytes()));
    if (n_app < C) {  // some tokens merge
      const std::int64_t i0 = team.league_rank() % blocks * kUpdateTokens;
      const std::int64_t n = C - i0 < kUpdateTokens ? C - i0 : kUpdateTokens;
      token_slot_tiles(team, scratch, it, i0, n, sink, ps.S + n_app, /*novelty=*/false);
    }
    if (last_team(team, route_ticket(it), blocks))
      refresh_stage(team, reinterpret_cast<std::int64_t*>(scratch), it, ps, n_app);
  }

  // Stage 5, on the item's last routing team (every route is final): each non-sink slot's routed tokens
  // added in increasing token order (spec 4.5 step 4's scatter), then its K^/V^ (spec 4.4), one slot
  // per thread, C slots at a time with their LN rows in the k0 block (free after the appends). The
  // routes come through target [C] (team scratch), read past L1 (last_team). Then the route record
  // (test hook) and the item's (cov, |S|) after the segment, which the state kernel left to this team.
  template <class Member>
  KOKKOS_INLINE_FUNCTION void refresh_stage(const Member& team, std::int64_t* target, const kvm::ItemView<S, A>& it,
                                            const ItemSegment& ps, std::int64_t n_app) const {
    const volatile std::int64_t* routed = it.target;
    Kokkos::parallel_for(Kokkos::TeamThreadRange(team, C), [&](const std::int64_t i) { target[i] = routed[i]; });
    team.team_barrier();
    const kernel::KvmStepParams<A> kp = step_params();
    const std::int64_t S_new = ps.S + n_app;
    for (std::int64_t j0 = sink; j0 < S_new; j0 += C) {
      const std::int64_t rows = S_new - j0 < C ? S_new - j0 : C;
      Kokkos::parallel_for(Kokkos::TeamThreadRange(team, rows), [&](const std::int64_t r) {
        const std::int64_t j = j0 + r;
        if (n_app < C)
          kernel::scatter_into_slot(it.kg, it.vg, target, C, D, Dv, j, it.sk + j * D, it.sv + j * Dv, it.cnt + j);
        kernel::refresh_slot(kp, it.sk + j * D, it.sv + j * Dv, it.rho[j], it.cnt[j], it.k0 + r * D, it.khat + j * D,
                             it.vhat + j * Dv);
      });
      team.team_barrier();
    }
    Kokkos::single(Kokkos::PerTeam(team), [&]() {
      if (log != nullptr) {  // test hook: the update's route record
        std::int64_t* item_log = log + ps.i * log_stride;
        std::int64_t* route = item_log + 1 + item_log[0]++ * (kRouteHeader + C);
        route[0] = ps.cov;
        route[1] = ps.S;
        route[2] = S_new;
        for (std::int64_t x = 0; x < C; ++x) route[kRouteHeader + x] = target[x];
      }
      after_update(ps.cov, ps.S, result[2 * ps.i], result[2 * ps.i + 1]);
    });
  }

  // One query row (token t, query head h) of item (b, g) in the host driver's order: the state (if
  // w > 0) and the causal window [w, t] as a chain of kAttendTile tiles through one online softmax
  // (bitwise equal to the host backend where the host compiler builds it). `r` names the row's
  // workspace in the item's state (q copy, accumulator, softmax state; r < rep C).
  KOKKOS_INLINE_FUNCTION void attend_row(const kvm::ItemView<S, A>& it, const SeqRef& sq, std::int64_t n0,
                                         std::int64_t t, std::int64_t h, std::int64_t w, std::int64_t S_cur,
                                         std::int64_t r) const {
    const std::int64_t w_len = W();
    A* qr = it.qblock + r * D;
    A* acc = it.acc + r * Dv;
    for (std::int64_t d = 0; d < D; ++d) qr[d] = load_as<A>(io.q_at(sq, h, t - n0, d));
    for (std::int64_t d = 0; d < Dv; ++d) acc[d] = A(0);
    OnlineSoftmax<A>* sm = new (it.soft + r) OnlineSoftmax<A>();
    const std::int64_t tile = kernel::kAttendTile;
    if (w > 0) {  // every slot, no mask (spec 4.1 step 2)
      const A ls = scale * (head_temps ? tau_s[h] : A(1));
      for (std::int64_t j0 = 0; j0 < S_cur; j0 += tile) {
        const std::int64_t n = (S_cur - j0) < tile ? (S_cur - j0) : tile;
        kernel::attend_accumulate(*sm, acc, qr, D, ls, it.khat + j0 * D, D, it.vhat + j0 * Dv, Dv, Dv, n);
      }
    }
    // window [w, t]: tiles start at w and at ring wraps (same tiles in prefill and decode)
    const A lw = scale * (head_temps ? tau_w[h] : A(1));
    for (std::int64_t a = w; a <= t;) {
      const std::int64_t wrap = (a / w_len + 1) * w_len;
      std::int64_t e = a + tile;
      if (wrap < e) e = wrap;
      if (t + 1 < e) e = t + 1;
      const std::int64_t ring = a % w_len;
      kernel::attend_accumulate(*sm, acc, qr, D, lw, it.wk + ring * D, D, it.wv + ring * Dv, Dv, Dv, e - a);
      a = e;
    }
    const A inv = sm->normaliser();
    for (std::int64_t d = 0; d < Dv; ++d) io.out_at(sq, t - n0, h, d) = static_cast<Out>(acc[d] * inv);
    if (float* l = io.lse_at(sq, t - n0, h)) *l = static_cast<float>(sm->lse());
  }

  // The team scratch of one row team in the split order: piece softmax states and merge factors
  // [split_pieces] each plus the row's state, q [D], logits or weights of the team's keys
  // [min(keys_cap, split_pieces kAttendTile)], piece accumulators [split_pieces, Dv] (unused with
  // several splits: the workspace holds them) and kRowLanes dot partials per thread. With several
  // splits the team that merges a row lays the same bytes out again (split_finish): every piece's state
  // [pieces_cap], the row's state and merge factors [pieces_cap].
  KOKKOS_INLINE_FUNCTION std::size_t row_scratch_bytes() const {
    const std::size_t pieces = static_cast<std::size_t>(split_pieces);
    const std::int64_t tile_keys = split_pieces * kernel::kAttendTile;
    const std::int64_t keys = keys_cap < tile_keys ? keys_cap : tile_keys;
    const std::size_t rows =
        sizeof(A) * static_cast<std::size_t>(D + keys + split_pieces * (1 + Dv) + row_threads * kRowLanes) +
        sizeof(kernel::PieceSoftmax<A>) * (pieces + 1);
    const std::size_t merge = sizeof(kernel::PieceSoftmax<A>) * static_cast<std::size_t>(pieces_cap + 1) +
                              sizeof(A) * static_cast<std::size_t>(pieces_cap);
    return splits > 1 && merge > rows ? merge : rows;
  }

  // A row's keys: the state's n_s slots (when w > 0), then the window [w, t]; n of them in all.
  struct RowKeys {
    std::int64_t n_s = 0, n = 0, pieces = 0;
  };
  KOKKOS_INLINE_FUNCTION static RowKeys row_keys(std::int64_t t, std::int64_t w, std::int64_t S_cur) {
    RowKeys k;
    k.n_s = w > 0 ? S_cur : 0;
    k.n = k.n_s + (t - w + 1);
    k.pieces = (k.n + kernel::kAttendTile - 1) / kernel::kAttendTile;
    return k;
  }

  // Logit of key x of a row (q in qr [D]) into *logit, its dot on the thread's lanes with kernel::dot's
  // bits (lane_dot). partial [kRowLanes] is the thread's own.
  template <class Member>
  KOKKOS_INLINE_FUNCTION void key_logit(const Member& team, A* partial, const A* qr, const kvm::ItemView<S, A>& it,
                                        std::int64_t w, std::int64_t n_s, std::int64_t x, A ls, A lw, A* logit) const {
    const bool slot = x < n_s;
    const S* key = slot ? it.khat + x * D : it.wk + (w + x - n_s) % W() * D;
    lane_dot<A>(team, partial, qr, key, D, [&](const A s) { *logit = (slot ? ls : lw) * s; });
  }

  // Pieces [p0, p1) of one query row (token t, query head h) by the whole team in the split order: the
  // pieces' logits (key_logit, keys over the threads), each piece's weights on one thread
  // (kernel::piece_weights), then per (piece, value element) the weighted sum over the piece's keys in
  // increasing order, on the threads' lanes. piece [p1 - p0] and part [p1 - p0, Dv] receive the pieces'
  // softmax states and accumulators. Every sum runs in one order that depends neither on the team size
  // nor on how the row's pieces are split over teams.
  template <class Member>
  KOKKOS_INLINE_FUNCTION void row_pieces(const Member& team, A* qr, A* logit, A* partial, const kvm::ItemView<S, A>& it,
                                         const SeqRef& sq, std::int64_t n0, std::int64_t t, std::int64_t h,
                                         std::int64_t w, const RowKeys& rk, std::int64_t p0, std::int64_t p1,
                                         kernel::PieceSoftmax<A>* piece, A* part) const {
    const std::int64_t tile = kernel::kAttendTile, n = rk.n, n_s = rk.n_s;
    const std::int64_t j_begin = p0 * tile, j_end = n < p1 * tile ? n : p1 * tile;
    const std::int64_t d_blocks = (D + kRowLanes - 1) / kRowLanes, v_blocks = (Dv + kRowLanes - 1) / kRowLanes;
    Kokkos::parallel_for(Kokkos::TeamThreadRange(team, d_blocks), [&](const std::int64_t b) {
      Kokkos::parallel_for(Kokkos::ThreadVectorRange(team, kRowLanes), [&](const int l) {
        const std::int64_t d = b * kRowLanes + l;
        if (d < D) qr[d] = load_as<A>(io.q_at(sq, h, t - n0, d));
      });
    });
    team.team_barrier();
    const A ls = scale * (head_temps ? tau_s[h] : A(1)), lw = scale * (head_temps ? tau_w[h] : A(1));
    Kokkos::parallel_for(Kokkos::TeamThreadRange(team, j_end - j_begin), [&](const std::int64_t x) {
      key_logit(team, partial, qr, it, w, n_s, j_begin + x, ls, lw, logit + x);
    });
    team.team_barrier();
    Kokkos::parallel_for(Kokkos::TeamThreadRange(team, p1 - p0), [&](const std::int64_t q) {
      Kokkos::single(Kokkos::PerThread(team), [&]() {
        const std::int64_t j0 = (p0 + q) * tile, m = n - j0 < tile ? n - j0 : tile;
        piece[q] = kernel::piece_weights(logit + (j0 - j_begin), m);
      });
    });
    team.team_barrier();
    Kokkos::parallel_for(Kokkos::TeamThreadRange(team, (p1 - p0) * v_blocks), [&](const std::int64_t x) {
      Kokkos::parallel_for(Kokkos::ThreadVectorRange(team, kRowLanes), [&](const int l) {
        const std::int64_t q = x / v_blocks, d = x % v_blocks * kRowLanes + l;
        if (d >= Dv) return;
        const std::int64_t j0 = (p0 + q) * tile, j1 = n - j0 < tile ? n : j0 + tile;
        const std::int64_t js = j1 < n_s ? j1 : n_s;  // slots [j0, js), then window keys [max(j0, n_s), j1)
        const A* wt = logit - j_begin;
        A sum = A(0);
        for (std::int64_t j = j0; j < js; ++j) sum += wt[j] * load_as<A>(it.vhat[j * Dv + d]);
        // the window's ring position advances with j and wraps at W: one division per piece, not per key
        const std::int64_t jw = j0 > n_s ? j0 : n_s, w_len = W();
        std::int64_t ring = (w + jw - n_s) % w_len;
        for (std::int64_t j = jw; j < j1; ++j) {
          sum += wt[j] * load_as<A>(it.wv[ring * Dv + d]);
          if (++ring == w_len) ring = 0;
        }
        part[q * Dv + d] = sum;
      });
    });
  }

  // The row's output from its `pieces` pieces' states piece [pieces] and accumulators part [pieces, Dv]:
  // the pieces merge in increasing order (kernel::merge_piece_factors), then out[d] = sum_p factor[p]
  // part[p, d] / sum, the sum in increasing p. row [1] and factor [pieces] are team scratch; part is
  // team scratch (Part = const A) or another team's workspace (const volatile A), read kFinishLoads
  // pieces at a time so that the loads overlap.
  static constexpr int kFinishLoads = 8;
  template <class Member, class Part>
  KOKKOS_INLINE_FUNCTION void row_finish(const Member& team, const kernel::PieceSoftmax<A>* piece, Part* part,
                                         std::int64_t pieces, kernel::PieceSoftmax<A>* row, A* factor, const SeqRef& sq,
                                         std::int64_t n0, std::int64_t t, std::int64_t h) const {
    Kokkos::single(Kokkos::PerTeam(team), [&]() { row[0] = kernel::merge_piece_factors(piece, pieces, factor); });
    team.team_barrier();
    const A inv = row[0].sum > A(0) ? A(1) / row[0].sum : A(0);
    const std::int64_t v_blocks = (Dv + kRowLanes - 1) / kRowLanes;
    Kokkos::parallel_for(Kokkos::TeamThreadRange(team, v_blocks), [&](const std::int64_t b) {
      Kokkos::parallel_for(Kokkos::ThreadVectorRange(team, kRowLanes), [&](const int l) {
        const std::int64_t d = b * kRowLanes + l;
        if (d >= Dv) return;
        A o = A(0);
        std::int64_t p = 0;
        for (; p + kFinishLoads <= pieces; p += kFinishLoads) {
          A x[kFinishLoads];
          for (int k = 0; k < kFinishLoads; ++k) x[k] = part[(p + k) * Dv + d];
          for (int k = 0; k < kFinishLoads; ++k) o += factor[p + k] * x[k];
        }
        for (; p < pieces; ++p) o += factor[p] * part[p * Dv + d];
        io.out_at(sq, t - n0, h, d) = static_cast<Out>(o * inv);
      });
    });
    Kokkos::single(Kokkos::PerTeam(team), [&]() {
      using std::log;
      if (float* l = io.lse_at(sq, t - n0, h))
        *l = static_cast<float>(row[0].sum > A(0) ? row[0].max + log(row[0].sum) : negative_infinity<A>());
    });
  }

  // Where a split row keeps its pieces in the item's workspace: states over the q block, accumulators
  // over the accumulator block, pieces_cap of each per row r of the item's segment rows (r < rep C).
  // run_call splits only when a segment's rows of one item fit: (rows / rep) pieces_cap <= C. Behind
  // the states (rep C of them at most) lies each row's ticket, the number its split teams draw
  // (last_team), zeroed by the state kernel; run_call splits only where the tickets fit in the q block.
  KOKKOS_INLINE_FUNCTION kernel::PieceSoftmax<A>* split_states(const kvm::ItemView<S, A>& it, std::int64_t r) const {
    return reinterpret_cast<kernel::PieceSoftmax<A>*>(it.qblock) + r * pieces_cap;
  }
  KOKKOS_INLINE_FUNCTION A* split_parts(const kvm::ItemView<S, A>& it, std::int64_t r) const {
    return it.acc + r * pieces_cap * Dv;
  }
  KOKKOS_INLINE_FUNCTION std::int64_t* split_ticket(const kvm::ItemView<S, A>& it, std::int64_t r) const {
    return reinterpret_cast<std::int64_t*>(reinterpret_cast<kernel::PieceSoftmax<A>*>(it.qblock) + rep * C) + r;
  }

  // The merge of a split row by the team that drew its last ticket: every split's piece states copied
  // to scratch, then row_finish over the accumulators in the workspace, both read past L1 (last_team),
  // in the order one team taking every piece merges them, so the row's bits do not depend on the split.
  template <class Member>
  KOKKOS_INLINE_FUNCTION void split_finish(const Member& team, unsigned char* scratch, const kvm::ItemView<S, A>& it,
                                           std::int64_t pieces, const SeqRef& sq, std::int64_t n0, std::int64_t t,
                                           std::int64_t h, std::int64_t r) const {
    using kernel::PieceSoftmax;
    PieceSoftmax<A>* piece = reinterpret_cast<PieceSoftmax<A>*>(scratch);
    PieceSoftmax<A>* row = piece + pieces_cap;
    A* factor = reinterpret_cast<A*>(row + 1);
    const volatile A* states = reinterpret_cast<const volatile A*>(split_states(it, r));  // (max, sum) per piece
    Kokkos::parallel_for(Kokkos::TeamThreadRange(team, pieces), [&](const std::int64_t q) {
      Kokkos::single(Kokkos::PerThread(team), [&]() {
        piece[q].max = states[2 * q];
        piece[q].sum = states[2 * q + 1];
      });
    });
    team.team_barrier();
    const volatile A* parts = split_parts(it, r);
    row_finish(team, piece, parts, pieces, row, factor, sq, n0, t, h);
  }

  // Split `split` of one query row (token t, query head h; row r of its item's segment rows) in the
  // split order: the team takes the row's pieces [split split_pieces, + split_pieces) (none past the
  // row's last piece). One split: the team merges and writes the row; several: its pieces go to the
  // workspace and the row's last split team to finish merges them (split_finish). Either way the row's
  // bits are those of one team taking every piece.
  template <class Member>
  KOKKOS_INLINE_FUNCTION void attend_row_team(const Member& team, unsigned char* scratch, const kvm::ItemView<S, A>& it,
                                              const SeqRef& sq, std::int64_t n0, std::int64_t t, std::int64_t h,
                                              std::int64_t w, std::int64_t S_cur, std::int64_t split,
                                              std::int64_t r) const {
    using kernel::PieceSoftmax;
    const RowKeys rk = row_keys(t, w, S_cur);
    const std::int64_t p0 = split * split_pieces;
    const std::int64_t p1 = rk.pieces < p0 + split_pieces ? rk.pieces : p0 + split_pieces;
    const std::int64_t tile_keys = split_pieces * kernel::kAttendTile;
    PieceSoftmax<A>* piece = reinterpret_cast<PieceSoftmax<A>*>(scratch);
    PieceSoftmax<A>* row = piece + split_pieces;
    A* qr = reinterpret_cast<A*>(row + 1);
    A* logit = qr + D;
    A* factor = logit + (keys_cap < tile_keys ? keys_cap : tile_keys);
    A* part = factor + split_pieces;
    A* partial = part + split_pieces * Dv + team.team_rank() * kRowLanes;
    if (splits > 1) {  // a team past the row's last piece only draws its ticket
      if (p0 < rk.pieces)
        row_pieces(team, qr, logit, partial, it, sq, n0, t, h, w, rk, p0, p1, split_states(it, r) + p0,
                   split_parts(it, r) + p0 * Dv);
      if (last_team(team, split_ticket(it, r), splits)) split_finish(team, scratch, it, rk.pieces, sq, n0, t, h, r);
      return;
    }
    row_pieces(team, qr, logit, partial, it, sq, n0, t, h, w, rk, p0, p1, piece, part);
    team.team_barrier();
    row_finish(team, piece, part, rk.pieces, row, factor, sq, n0, t, h);
  }

  // Zeroes the out (and lse) rows of local tokens [i0, i1) for the query heads of KV group g.
  template <class Member>
  KOKKOS_INLINE_FUNCTION void zero_rows(const Member& team, const SeqRef& sq, std::int64_t g, std::int64_t i0,
                                        std::int64_t i1) const {
    const std::int64_t n = i1 > i0 ? (i1 - i0) * rep * Dv : 0;
    Kokkos::parallel_for(Kokkos::TeamThreadRange(team, n), [&](const std::int64_t x) {
      const std::int64_t t = i0 + x / (rep * Dv), h = g * rep + (x / Dv) % rep, d = x % Dv;
      io.out_at(sq, t, h, d) = Out(0);
      if (d == 0)
        if (float* l = io.lse_at(sq, t, h)) *l = 0.0f;
    });
  }

  // Segment `seg` of every item, state side: one team per (sequence or row, KV head) runs the pending
  // state update (spec 4.7 step 4: first token of a new chunk, before attention; the device order: its
  // append stage), writes the segment's tokens into the window ring and founds the initial slots below
  // position C (spec 4.3). The item's running (cov, |S|) pass from segment to segment in `result` (the
  // device order's last routing team writes them for an updating item); the rows kernel of the same
  // segment reads |S| there. Segment 0 also zeroes padding rows and batch rows past a sequence's length.
  // The device order's tickets of the launches after it start here: the routing teams' of an updating
  // item, the split row teams' of the segment's rows and (last segment) the counter fold's.
  template <class Member>
  KOKKOS_INLINE_FUNCTION void operator()(StateTag, const Member& team) const {
    if (fold_counters && team.league_rank() == 0) Kokkos::single(Kokkos::PerTeam(team), [&]() { *ticket = 0; });
    const std::int64_t g = team.league_rank() % Hk;
    const SeqRef sq = seq(team.league_rank() / Hk);
    if (sq.b < 0) {  // padding row: inputs unread, outputs zeroed
      if (sq.ok && seg == 0) zero_rows(team, sq, g, 0, sq.len);
      return;
    }
    if (!sq.ok) return;  // rejected sizes (checked = false): the item and its counters stay untouched
    const ItemSegment ps = item_segment(sq, g);
    const std::int64_t i = ps.i;  // the state's item of (slot b, KV head g)
    const std::int64_t len = sq.len, n0 = n_seq[sq.b], w_len = W();
    const kvm::ItemView<S, A> it = items.at(i);
    std::int64_t cov = ps.cov, S_cur = ps.S;
    const std::int64_t t0 = ps.t0, t1 = ps.t1;
    if (t0 < t1) {
      const bool updating = ps.updating;
      const std::int64_t a = cov;
      const std::int64_t S_before = S_cur;
      // team_update: the update runs here, on this team. Otherwise the prep launch ran its stages 1-2
      // before this kernel, this team appends, the routing launch after it routes, scatters and
      // refreshes, and |S| after it follows from the budget alone (spec 3.1). Both give the host order's
      // routes and sums.
      std::int64_t S_after = S_before;
      if (updating && team_update) {
        S_after = update(team, it, a, S_before);
      } else if (updating) {
        append_stage(team, it, a, S_before);
        S_after = S_before + appended(a, S_before);
        Kokkos::single(Kokkos::PerTeam(team), [&]() { *route_ticket(it) = 0; });
      }
      std::int64_t* item_log = log && team_update ? log + i * log_stride : nullptr;
      Kokkos::single(Kokkos::PerTeam(team), [&]() {
        if (updating && item_log != nullptr) {  // test hook: the update's route record (device order: stage 5's)
          std::int64_t* route = item_log + 1 + item_log[0]++ * (kRouteHeader + C);
          route[0] = a;
          route[1] = S_before;
          route[2] = S_after;
          for (std::int64_t x = 0; x < C; ++x) route[kRouteHeader + x] = it.target[x];
        }
      });
      const std::int64_t D_all = D + Dv + 1;  // window ring: k [D], v [Dv], gate per token
      Kokkos::parallel_for(Kokkos::TeamThreadRange(team, (t1 - t0) * D_all), [&](const std::int64_t x) {
        const std::int64_t t = t0 + x / D_all, e = x % D_all, ring = t % w_len;
        if (e < D)
          it.wk[ring * D + e] = store_as<S>(load_as<A>(io.k_at(sq, g, t - n0, e)));
        else if (e < D + Dv)
          it.wv[ring * Dv + e - D] = store_as<S>(load_as<A>(io.v_at(sq, g, t - n0, e - D)));
        else
          it.wg[ring] = load_as<A>(io.gate_at(sq, g, t - n0));
      });
      team.team_barrier();
      if (t0 < C) {
        Kokkos::single(Kokkos::PerTeam(team), [&]() {  // initial slots below position C (spec 4.3), in order
          std::int64_t c = updating ? a + C : a, s = S_after;
          for (std::int64_t t = t0; t < t1; ++t)
            if (t < C && t >= c) {
              init_slot(it, t % w_len, s++);
              c = t + 1;
            }
        });
      }
      // Every thread tracks cov and |S| itself: both follow from sizes and the budget alone.
      if (updating) after_update(a, S_before, cov, S_cur);
      for (std::int64_t t = t0; t < t1; ++t)
        if (t < C && t >= cov) {
          ++S_cur;
          cov = t + 1;
        }
      if (!host_order && splits > 1)  // the tickets of the segment's split rows of this item
        Kokkos::parallel_for(Kokkos::TeamThreadRange(team, (t1 - t0) * rep),
                             [&](const std::int64_t r) { *split_ticket(it, r) = 0; });
    }
    if (seg == 0) zero_rows(team, sq, g, len, len + io.tail(sq));  // batch rows past this sequence's length
    if (ps.updating && !team_update) return;  // stage 5 writes the item's result after every routing team read it
    team.team_barrier();                      // every thread has read result before it changes
    Kokkos::single(Kokkos::PerTeam(team), [&]() {
      result[2 * i] = cov;
      result[2 * i + 1] = S_cur;
    });
  }

  // Segment `seg` of every item, rows side: the segment's query rows (token, query head) after its
  // state side finished. Host order: a team takes host_rows consecutive (token, head) pairs of one KV
  // head, one pair per thread. Split order: a team takes one pair's pieces of one split and shares its
  // keys (all of them with one split).
  template <class Member>
  KOKKOS_INLINE_FUNCTION void operator()(RowsTag, const Member& team) const {
    if (!host_order) {  // team (pair, split): the pair's rank over Hk and its split
      const std::int64_t pair = team.league_rank() / splits, split = team.league_rank() % splits;
      unsigned char* scratch =
          static_cast<unsigned char*>(team.team_scratch(row_scratch_level()).get_shmem(row_scratch_bytes()));
      const RowRef rr = row_ref(pair % Hk, pair / Hk);
      if (rr.ok) attend_row_team(team, scratch, items.at(rr.i), rr.sq, rr.n0, rr.t, rr.h, rr.w, rr.slots, split, rr.r);
      if (fold_counters) count_after_last_team(team);
      return;
    }
    const std::int64_t g = team.league_rank() % Hk, block = team.league_rank() / Hk;
    Kokkos::parallel_for(Kokkos::TeamThreadRange(team, host_rows), [&](const std::int64_t x) {
      const RowRef rr = row_ref(g, block * host_rows + x);
      if (rr.ok) attend_row(items.at(rr.i), rr.sq, rr.n0, rr.t, rr.h, rr.w, rr.slots, rr.r);
    });
  }

  KOKKOS_INLINE_FUNCTION int row_scratch_level() const { return row_scratch_bytes() <= kScratch0Bytes ? 0 : 1; }

  // One query row of a segment: its sequence, token t (n0 tokens before the call), query head h, window
  // start w, item i with |S| = slots after the segment's update, and r, the row's index among the item's
  // rows of the segment (r < rep C: its workspace in the host order and for split pieces).
  struct RowRef {
    bool ok = false;
    SeqRef sq;
    std::int64_t n0 = 0, t = 0, h = 0, w = 0, i = 0, slots = 0, r = 0;
  };
  // Pair p of the segment's rows of KV head g: packed token or batch row p / rep, query head
  // g rep + p % rep. Rows outside the segment are not ok (every thread of a team takes the same branch
  // in the split order, whose pair is the team's).
  KOKKOS_INLINE_FUNCTION RowRef row_ref(std::int64_t g, std::int64_t p) const {
    RowRef rr;
    const TokenRef tr = io.locate(p / rep, seg, C, n_seq, n_ctx);
    if (!tr.ok) return rr;
    rr.ok = true;
    rr.sq = tr.seq;
    rr.n0 = n_seq[rr.sq.b];
    rr.t = tr.t;
    rr.h = g * rep + p % rep;
    const std::int64_t t0 = rr.t / C * C > rr.n0 ? rr.t / C * C : rr.n0;
    rr.w = bswa_begin(t0 + 1);
    rr.i = rr.sq.b * Hk + g;
    rr.slots = result[2 * rr.i + 1];
    rr.r = (rr.t - t0) * rep + p % rep;
    return rr;
  }
};

// The checked reductions: the smallest failure code * count + index over sequences (or rows), or none.
enum class KvmCheck : std::int64_t {
  kStart = 1,
  kSlot,
  kDuplicate,
  kBound,
  kLength,
  kContext,
  kQ,
  kK,
  kV,
  kGate,
  kWeights
};
// A KvmCall over the state and the call's inputs `io`, with the parameters of spec 2 in kernel form.
template <class S, class A, class In, class Out, class Io>
KvmCall<S, A, In, Out, Io> make_call(const kvm::State<S, A>& state, const Io& io) {
  const kvm::Shape& sh = state.shape();
  const kvm::Params& pr = state.params();
  return {ItemTable<S, A>(state),
          state.n_data(),
          state.cov_data(),
          state.slots_data(),
          state.item_result(),
          state.ln_w(),
          state.ln_b(),
          state.tau_s(),
          state.tau_w(),
          io,
          sh.Hk,
          sh.rep(),
          sh.D,
          sh.Dv,
          sh.n_ctx,
          pr.chunk,
          pr.window_chunks,
          pr.sink,
          pr.rope_dims,
          pr.budget,
          state.update_targets(),
          pr.merge_gate_keys,
          pr.merge_gate_values,
          pr.head_temps,
          pr.value_radius,
          pr.gate_appends,
          pr.gate_initial,
          static_cast<A>(pr.ln_eps),
          static_cast<A>(pr.scale > 0 ? pr.scale : 1.0 / std::sqrt(double(sh.D))),
          nullptr,
          0};
}

// The learned parameters as kernel views; shapes are checked on the host (no data read).
struct KvmWeights {
  DeviceView<const float, 1> lw, lb, ts, tw;  // ln_weight [D], ln_bias [D], tau_state [Hq], tau_bswa [Hq]
  explicit KvmWeights(const kvm::Weights& w) : lw(w.ln_weight), lb(w.ln_bias), ts(w.tau_state), tw(w.tau_bswa) {}
  static Status check_shapes(const kvm::Weights& w, const kvm::Shape& sh) {
    KVMEM_RETURN_IF_ERROR(check_shape(w.ln_weight, {sh.D}, "ln_weight"));
    KVMEM_RETURN_IF_ERROR(check_shape(w.ln_bias, {sh.D}, "ln_bias"));
    KVMEM_RETURN_IF_ERROR(check_shape(w.tau_state, {sh.Hq}, "tau_state"));
    return check_shape(w.tau_bswa, {sh.Hq}, "tau_bswa");
  }
  // Every view dense (unit stride, or at most one element): fp32 kernels may then read them in place.
  bool contiguous() const {
    const auto dense = [](const DeviceView<const float, 1>& v) { return v.stride[0] == 1 || v.extent[0] <= 1; };
    return dense(lw) && dense(lb) && dense(ts) && dense(tw);
  }
  KOKKOS_INLINE_FUNCTION bool finite_values(std::int64_t D, std::int64_t Hq) const {
    for (std::int64_t d = 0; d < D; ++d)
      if (!finite(lw(d)) || !finite(lb(d))) return false;
    for (std::int64_t h = 0; h < Hq; ++h)
      if (!finite(ts(h)) || !finite(tw(h))) return false;
    return true;
  }
};

// weights -> state (ln_w, ln_b, tau_s, tau_w in Acc), on exec.space.
template <class Space, class S, class A>
void load_weights(const Executor<Space>& exec, const kvm::State<S, A>& state, const KvmWeights& w) {
  A* w_ln = state.ln_w();
  A* b_ln = state.ln_b();
  A* t_s = state.tau_s();
  A* t_w = state.tau_w();
  const std::int64_t D = state.shape().D, Hq = state.shape().Hq;
  Kokkos::parallel_for(
      "kvmem::kokkos::kvm::weights", ::kvmem::kokkos::detail::range_policy(exec, 0, D > Hq ? D : Hq),
      KOKKOS_LAMBDA(const std::int64_t x) {
        if (x < D) {
          w_ln[x] = static_cast<A>(w.lw(x));
          b_ln[x] = static_cast<A>(w.lb(x));
        }
        if (x < Hq) {
          t_s[x] = static_cast<A>(w.ts(x));
          t_w[x] = static_cast<A>(w.tw(x));
        }
      });
}

// The run of one prefill / decode / step call, all on exec.space in order with no host round trip:
// weights -> state; per chunk segment [device order: the update pipeline's four launches] the state
// teams (one per sequence or row, times Hk) and the row teams; the per-sequence counter fold.
// `max_tokens` bounds the tokens of one item (sizes the route log, a test hook that reads back).
template <class Space, class S, class A, class In, class Out, class Io>
void run_call(const Executor<Space>& exec, const kvm::State<S, A>& state, const KvmWeights& w,
              KvmCall<S, A, In, Out, Io> call, std::int64_t max_tokens, kvm::RouteLog* log) {
  const kvm::Shape& sh = state.shape();
  const std::int64_t C = state.params().chunk, items = call.io.count() * sh.Hk;
  Kokkos::View<std::int64_t**, Kokkos::LayoutRight, typename Space::memory_space> route_buffer;
  if (log != nullptr) {  // at most ceil(tokens/C) + 1 updates per item in this call
    call.log_stride = 1 + (max_tokens / C + 2) * (kRouteHeader + C);
    route_buffer = decltype(route_buffer)("kvmem kvm routes", sh.B * sh.Hk, call.log_stride);
    call.log = route_buffer.data();
  }
  // With an fp32 accumulator and dense weights the kernels read the caller's weights in place (the copy
  // would convert float to float, the same bits) and the call saves the weights launch.
  bool in_place = false;
  if constexpr (std::is_same_v<A, float>) {
    in_place = w.contiguous();
    if (in_place) {
      call.ln_w = w.lw.data;
      call.ln_b = w.lb.data;
      call.tau_s = w.ts.data;
      call.tau_w = w.tw.data;
    }
  }
  if (!in_place) load_weights(exec, state, w);
  // One item's tokens span at most ceil((max_tokens - 1) / C) + 1 chunk segments wherever it starts, so
  // the launch count follows from the padded sizes alone (no counter is read back). Each segment runs
  // its state side (a team per item) and then its rows, which need that state and ring.
  const std::int64_t segments = max_tokens > 0 ? (max_tokens - 1 + C - 1) / C + 1 : 1;
  const std::int64_t pairs = call.io.row_tokens(C) * sh.rep();
  call.host_order = kHostOrder<Space>;
  call.team_update = call.host_order;
  call.host_rows = kHostRows;
  call.keys_cap = state.capacity() + state.window_capacity();
  call.pieces_cap = (call.keys_cap + kernel::kAttendTile - 1) / kernel::kAttendTile;
  // Device order: a segment of few rows (a decode call) splits each row's pieces over several teams
  // until the call has about kFillTeams teams or more (at most one piece a team). The split pieces go
  // to the workspace's q and accumulator blocks of the row's item (split_states, split_parts), which
  // hold them when one item's rows of a segment (at most min(tokens, C) tokens, rep heads each) take
  // pieces_cap pieces each: min(tokens, C) pieces_cap <= C; the rows' tickets follow the states in the
  // q block (split_ticket). The split changes which team computes a piece, never a piece's arithmetic or
  // the merge order, so a row's bits are the same split or not.
  const std::int64_t row_pairs = pairs * sh.Hk;
  call.splits = 1;
  call.split_pieces = call.pieces_cap;
  if (!call.host_order && row_pairs > 0) {
    const std::int64_t bound = call.io.token_bound(max_tokens), span = bound < C ? bound : C;
    const std::int64_t fill = std::max<std::int64_t>(exec.space.concurrency() / kDeviceTeam, kFillTeams);
    const std::int64_t want = std::min<std::int64_t>(call.pieces_cap, (fill + row_pairs - 1) / row_pairs);
    const std::size_t q_block = sizeof(A) * static_cast<std::size_t>(sh.rep() * C * sh.D);
    const std::size_t held = sizeof(kernel::PieceSoftmax<A>) * static_cast<std::size_t>(sh.rep() * C) +
                             sizeof(std::int64_t) * static_cast<std::size_t>(sh.rep() * span);
    if (want > 1 && span * call.pieces_cap <= C && held <= q_block) {
      call.split_pieces = (call.pieces_cap + want - 1) / want;
      call.splits = (call.pieces_cap + call.split_pieces - 1) / call.split_pieces;
    }
  }
  const std::int64_t row_teams =
      call.host_order ? (pairs + kHostRows - 1) / kHostRows * sh.Hk : row_pairs * call.splits;
  // The device order's update pipeline: token-block teams before the state kernel (stages 1-2) and
  // after it (stage 4, the last team of an item stage 5); stage 3 runs on the state kernel's teams.
  const std::int64_t token_teams = items * call.token_blocks();
  auto state_teams = team_policy<Space, StateTag>(exec, items);
  auto rows = team_policy<Space, RowsTag>(exec, row_teams, call.host_order ? 1 : kRowLanes);
  auto prep = team_policy<Space, PrepTag>(exec, token_teams);
  auto route = team_policy<Space, RouteTag>(exec, token_teams);
  if (!call.host_order) {
    // The most threads a team of each kernel may have (Kokkos's occupancy query, before any scratch is
    // set). It depends on the kernel and its vector lanes alone, fixed for an instantiation here, so it
    // is asked once per process rather than for every call (decode pays it for every token otherwise).
    struct Most {
      int state, rows, prep, route;
    };
    static const Most most = [&] {
      const Kokkos::ParallelForTag tag;
      return Most{state_teams.team_size_max(call, tag), rows.team_size_max(call, tag), prep.team_size_max(call, tag),
                  route.team_size_max(call, tag)};
    }();
    const auto size = [&](auto& policy, std::int64_t league, int limit, int wanted, int lanes) {
      policy = std::remove_reference_t<decltype(policy)>(exec.space, static_cast<int>(league),
                                                         limit < wanted ? limit : wanted, lanes);
    };
    if (exec.team_size == 0) {                               // teams as wide as the work, where they fit
      size(state_teams, items, most.state, kDeviceTeam, 1);  // a chunk's tokens
      size(rows, row_teams, most.rows, kDeviceTeam / kRowLanes, kRowLanes);  // a row's keys, D or Dv on the lanes
      size(prep, token_teams, most.prep, kDeviceTeam, 1);                    // a block's token x slot dots
      size(route, token_teams, most.route, kDeviceTeam, 1);                  // the same; stage 5: C slots
    } else {  // the executor's threads, each with kRowLanes lanes, where they fit
      size(rows, row_teams, most.rows, exec.team_size, kRowLanes);
    }
    call.row_threads = rows.team_size();
    rows.set_scratch_size(call.row_scratch_level(), Kokkos::PerTeam(call.row_scratch_bytes()));
    const std::size_t block = call.block_scratch_bytes(), routing = call.route_scratch_bytes();
    prep.set_scratch_size(call.scratch_level(block), Kokkos::PerTeam(block));
    route.set_scratch_size(call.scratch_level(routing), Kokkos::PerTeam(routing));
  }
  // The device order's last rows launch folds the counters.
  const bool fold = !call.host_order && pairs > 0;
  call.ticket = state.row_list();
  for (std::int64_t s = 0; s < segments; ++s) {
    call.seg = s;
    call.fold_counters = fold && s == segments - 1;
    // Device order: the update's stages 1-2 before the state kernel overwrites the ring, 4-5 after its
    // appends; every launch returns at once for an item that does not update.
    if (!call.team_update && items > 0) Kokkos::parallel_for("kvmem::kokkos::kvm::update_prepare", prep, call);
    if (items > 0) Kokkos::parallel_for("kvmem::kokkos::kvm::segment_state", state_teams, call);
    if (!call.team_update && items > 0) Kokkos::parallel_for("kvmem::kokkos::kvm::update_route", route, call);
    if (pairs > 0) Kokkos::parallel_for("kvmem::kokkos::kvm::segment_rows", rows, call);
  }
  if (!fold) {
    Kokkos::parallel_for(
        "kvmem::kokkos::kvm::counters", ::kvmem::kokkos::detail::range_policy(exec, 0, call.io.count()),
        KOKKOS_LAMBDA(const std::int64_t x) { call.count_seq(x); });
  }
  if (log != nullptr) {  // copy the records back and rebuild the host RouteLog (items[slot * Hk + g])
    auto host = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), route_buffer);
    log->items.resize(std::size_t(sh.B * sh.Hk));
    for (std::int64_t i = 0; i < sh.B * sh.Hk; ++i)
      for (std::int64_t u = 0; u < host(i, 0); ++u) {
        const std::int64_t* rec = &host(i, 1 + u * (kRouteHeader + C));
        kvm::UpdateRoute r;
        r.first_token = rec[0];
        r.slots_before = rec[1];
        r.slots_after = rec[2];
        r.target.assign(rec + kRouteHeader, rec + kRouteHeader + C);
        for (std::int64_t x = 0; x < C; ++x)
          if (r.target[std::size_t(x)] == -1) r.appended.push_back(rec[0] + x);
        log->items[std::size_t(i)].push_back(std::move(r));
      }
  }
}

}  // namespace detail
}  // namespace kvmem::kokkos

namespace kvmem::kvm {

template <class Space>
struct Backend<kokkos::Executor<Space>> {
  template <class S, class A>
  using state_type = State<S, A>;
  using weights_type = Weights;

  template <class S, class A, class In, class Out>
  static Status prefill(const kokkos::Executor<Space>& exec, State<S, A>& state, const Weights& weights,
                        TensorView<const In, 4> q,     // [B,Hq,T,D]
                        TensorView<const In, 4> k,     // [B,Hk,T,D]
                        TensorView<const In, 4> v,     // [B,Hk,T,Dv]
                        TensorView<const In, 3> gate,  // [B,Hk,T]
                        TensorView<Out, 4> out,        // [B,T,Hq,Dv]
                        const std::int64_t* lengths,   // [B] in memory Space can read, or nullptr
                        RouteLog* log) {
    static_assert(kokkos::check_kvm_storage<S>());
    using namespace kokkos::detail;
    // ---- validation of sizes on the host; nothing changes before every check passed ----
    if (!state.valid()) return invalid_argument("state", "a created or placed State", "an empty State");
    const Shape& sh = state.shape();
    const std::int64_t B = sh.B, T = q.extent(2);
    KVMEM_RETURN_IF_ERROR(check_call_shapes(sh, q, k, v, gate, out));
    KVMEM_RETURN_IF_ERROR(KvmWeights::check_shapes(weights, sh));
    const BatchIo<In, Out> io{DeviceView<const In, 4>(q),
                              DeviceView<const In, 4>(k),
                              DeviceView<const In, 4>(v),
                              DeviceView<const In, 3>(gate),
                              DeviceView<Out, 4>(out),
                              lengths,
                              T};
    const auto call = make_call<S, A, In, Out>(state, io);
    const KvmWeights w(weights);

    // ---- data-dependent checks on the device: one value read back ----
    if (exec.checked) {
      std::int64_t found = kNoFailure;
      const std::int64_t Hq = sh.Hq, Hk = sh.Hk, D = sh.D, Dv = sh.Dv;
      Kokkos::parallel_reduce(
          "kvmem::kokkos::kvm::check", ::kvmem::kokkos::detail::range_policy(exec, 0, B),
          KOKKOS_LAMBDA(const std::int64_t b, std::int64_t& first) {
            auto fail = [&](KvmCheck code) {
              const std::int64_t c = static_cast<std::int64_t>(code) * B + b;
              if (c < first) first = c;
            };
            const SeqRef sq = call.seq(b);
            if (sq.len < 0 || sq.len > T) return fail(KvmCheck::kLength);
            if (call.n_seq[b] + sq.len > call.n_ctx) return fail(KvmCheck::kContext);
            for (std::int64_t t = 0; t < sq.len; ++t) {
              for (std::int64_t h = 0; h < Hq; ++h)
                for (std::int64_t d = 0; d < D; ++d)
                  if (!finite(load_as<double>(io.q(b, h, t, d)))) return fail(KvmCheck::kQ);
              for (std::int64_t h = 0; h < Hk; ++h) {
                for (std::int64_t d = 0; d < D; ++d)
                  if (!finite(load_as<double>(io.k(b, h, t, d)))) return fail(KvmCheck::kK);
                for (std::int64_t d = 0; d < Dv; ++d)
                  if (!finite(load_as<double>(io.v(b, h, t, d)))) return fail(KvmCheck::kV);
                const double gv = load_as<double>(io.gate(b, h, t));
                if (!finite(gv) || !(gv > 0)) return fail(KvmCheck::kGate);
              }
            }
            if (b == 0 && !w.finite_values(D, Hq)) return fail(KvmCheck::kWeights);
          },
          Kokkos::Min<std::int64_t>(found));
      if (found != kNoFailure) {
        const std::int64_t b = found % B;
        const std::string seq = "sequence " + std::to_string(b);
        switch (static_cast<KvmCheck>(found / B)) {
          case KvmCheck::kLength:
            return invalid_argument("lengths[" + std::to_string(b) + "]", "0 <= length <= T = " + std::to_string(T),
                                    "a value outside (read on the device)");
          case KvmCheck::kContext:
            return {StatusCode::kOutOfRange,
                    seq + ": tokens seen + length exceed the state's n_ctx = " + std::to_string(sh.n_ctx)};
          default:
            return value_status(static_cast<KvmCheck>(found / B), seq);
        }
      }
    }
    run_call(exec, state, w, call, T, log);
    return Status::ok();
  }

  // kvm::step: one team per (row, KV head); a row runs its slot's tokens with the prefill driver above,
  // so it equals its sequence run alone, bitwise. Rows, n_ctx and values are checked by one reduction
  // over rows (exec.checked); the kernels read slot, query_start and the counters themselves.
  template <class S, class A, class In, class Out>
  static Status step(const kokkos::Executor<Space>& exec, State<S, A>& state, const Weights& weights, const Rows& rows,
                     TensorView<const In, 3> q,     // [tokens,Hq,D]
                     TensorView<const In, 3> k,     // [tokens,Hk,D]
                     TensorView<const In, 3> v,     // [tokens,Hk,Dv]
                     TensorView<const In, 2> gate,  // [tokens,Hk]
                     TensorView<Out, 3> out,        // [tokens,Hq,Dv]
                     TensorView<float, 2> lse,      // [tokens,Hq] or empty
                     RouteLog* log) {
    static_assert(kokkos::check_kvm_storage<S>());
    using namespace kokkos::detail;
    if (!state.valid()) return invalid_argument("state", "a created or placed State", "an empty State");
    const Shape& sh = state.shape();
    const std::int64_t tokens = q.extent(0), R = rows.count();
    KVMEM_RETURN_IF_ERROR(check_shape(q, {tokens, sh.Hq, sh.D}, "q [tokens,Hq,D]"));
    KVMEM_RETURN_IF_ERROR(check_shape(k, {tokens, sh.Hk, sh.D}, "k [tokens,Hk,D]"));
    KVMEM_RETURN_IF_ERROR(check_shape(v, {tokens, sh.Hk, sh.Dv}, "v [tokens,Hk,Dv]"));
    KVMEM_RETURN_IF_ERROR(check_shape(gate, {tokens, sh.Hk}, "gate [tokens,Hk]"));
    KVMEM_RETURN_IF_ERROR(check_shape(out, {tokens, sh.Hq, sh.Dv}, "out [tokens,Hq,Dv]"));
    if (!lse.empty()) KVMEM_RETURN_IF_ERROR(check_shape(lse, {tokens, sh.Hq}, "lse [tokens,Hq]"));
    if (rows.query_start.extent(0) != R + 1)
      return invalid_argument("query_start shape", "[rows + 1] = [" + std::to_string(R + 1) + "]",
                              shape_string(rows.query_start.extents()));
    if (R == 0 && tokens != 0) return invalid_argument("tokens", "0 for an empty batch", tokens);
    if (rows.max_query_len < 0) return invalid_argument("max_query_len", ">= 0 (0: no bound)", rows.max_query_len);
    KVMEM_RETURN_IF_ERROR(KvmWeights::check_shapes(weights, sh));
    PackedIo<In, Out> io{DeviceView<const std::int32_t, 1>(rows.slot),
                         DeviceView<const std::int32_t, 1>(rows.query_start),
                         DeviceView<const In, 3>(q),
                         DeviceView<const In, 3>(k),
                         DeviceView<const In, 3>(v),
                         DeviceView<const In, 2>(gate),
                         DeviceView<Out, 3>(out),
                         {},
                         sh.B};
    if (!lse.empty()) io.lse = DeviceView<float, 2>(lse);
    io.max_len = rows.max_query_len;
    const auto call = make_call<S, A, In, Out>(state, io);
    const KvmWeights w(weights);

    if (exec.checked && R > 0) {
      std::int64_t found = kNoFailure;
      const std::int64_t Hq = sh.Hq, Hk = sh.Hk, D = sh.D, Dv = sh.Dv, B = sh.B;
      Kokkos::parallel_reduce(
          "kvmem::kokkos::kvm::step_check", ::kvmem::kokkos::detail::range_policy(exec, 0, R),
          KOKKOS_LAMBDA(const std::int64_t r, std::int64_t& first) {
            auto fail = [&](KvmCheck code) {
              const std::int64_t c = static_cast<std::int64_t>(code) * R + r;
              if (c < first) first = c;
            };
            const std::int64_t x0 = io.query_start(r), x1 = io.query_start(r + 1), b = io.slot(r);
            if ((r == 0 && x0 != 0) || x1 < x0 || (r == R - 1 && x1 != tokens)) return fail(KvmCheck::kStart);
            if (r == 0 && !w.finite_values(D, Hq)) fail(KvmCheck::kWeights);
            if (b == -1) return;  // padding: its inputs are not read
            if (b < -1 || b >= B) return fail(KvmCheck::kSlot);
            for (std::int64_t e = 0; e < r; ++e)
              if (io.slot(e) == b) return fail(KvmCheck::kDuplicate);
            if (io.max_len > 0 && x1 - x0 > io.max_len) return fail(KvmCheck::kBound);
            if (call.n_seq[b] + (x1 - x0) > call.n_ctx) return fail(KvmCheck::kContext);
            if (x0 < 0 || x1 > tokens) return;  // some start is wrong: reported by its own row
            for (std::int64_t x = x0; x < x1; ++x) {
              for (std::int64_t h = 0; h < Hq; ++h)
                for (std::int64_t d = 0; d < D; ++d)
                  if (!finite(load_as<double>(io.q(x, h, d)))) return fail(KvmCheck::kQ);
              for (std::int64_t h = 0; h < Hk; ++h) {
                for (std::int64_t d = 0; d < D; ++d)
                  if (!finite(load_as<double>(io.k(x, h, d)))) return fail(KvmCheck::kK);
                for (std::int64_t d = 0; d < Dv; ++d)
                  if (!finite(load_as<double>(io.v(x, h, d)))) return fail(KvmCheck::kV);
                const double gv = load_as<double>(io.gate(x, h));
                if (!finite(gv) || !(gv > 0)) return fail(KvmCheck::kGate);
              }
            }
          },
          Kokkos::Min<std::int64_t>(found));
      if (found != kNoFailure) {
        const std::int64_t r = found % R;
        const std::string row = "row " + std::to_string(r);
        switch (static_cast<KvmCheck>(found / R)) {
          case KvmCheck::kStart:
            return invalid_argument(
                "query_start[" + std::to_string(r) + "], query_start[" + std::to_string(r + 1) + "]",
                "query_start[0] = 0, non-decreasing starts, query_start[rows] = tokens = " + std::to_string(tokens),
                "a violation at " + row + " (read on the device)");
          case KvmCheck::kSlot:
            return {StatusCode::kOutOfRange, "slot[" + std::to_string(r) +
                                                 "]: expected -1 (padding) or 0 <= slot < max_slots = " +
                                                 std::to_string(sh.B) + ", got a value outside"};
          case KvmCheck::kDuplicate:
            return invalid_argument("slot[" + std::to_string(r) + "]", "a slot used by no earlier row of this step",
                                    "a slot an earlier row names");
          case KvmCheck::kBound:
            return invalid_argument(
                "max_query_len",
                "at least the tokens of every row that names a slot (" + row + ": more, read on the device)",
                rows.max_query_len);
          case KvmCheck::kContext:
            return {
                StatusCode::kOutOfRange,
                row + ": the slot's tokens + the row's tokens exceed the state's n_ctx = " + std::to_string(sh.n_ctx)};
          default:
            return value_status(static_cast<KvmCheck>(found / R), row);
        }
      }
    }
    run_call(exec, state, w, call, tokens, log);
    return Status::ok();
  }

  template <class S, class A>
  static Status reset_slots(const kokkos::Executor<Space>& exec, State<S, A>& state,
                            TensorView<const std::int32_t, 1> slots) {
    using namespace kokkos::detail;
    if (!state.valid()) return invalid_argument("state", "a created or placed State", "an empty State");
    const SlotLists lists{DeviceView<const std::int32_t, 1>(slots), {}, state.max_slots()};
    const std::int64_t n = slots.extent(0);
    if (exec.checked && n > 0) KVMEM_RETURN_IF_ERROR(slot_list_status(first_failure(exec, lists), n, lists.B, "slots"));
    std::int64_t* n_seq = state.n_data();
    std::int64_t* cov = state.cov_data();
    std::int64_t* used = state.slots_data();
    Kokkos::parallel_for(
        "kvmem::kokkos::kvm::reset_slots", ::kvmem::kokkos::detail::range_policy(exec, 0, n),
        KOKKOS_LAMBDA(const std::int64_t i) {
          if (lists.failure(i) != 0) return;
          const std::int64_t b = lists.src(i);
          n_seq[b] = cov[b] = used[b] = 0;
        });
    return Status::ok();
  }

  template <class S, class A>
  static Status copy_slots(const kokkos::Executor<Space>& exec, State<S, A>& state,
                           TensorView<const std::int32_t, 1> src, TensorView<const std::int32_t, 1> dst) {
    static_assert(kokkos::check_kvm_storage<S>());
    using namespace kokkos::detail;
    if (!state.valid()) return invalid_argument("state", "a created or placed State", "an empty State");
    if (src.extent(0) != dst.extent(0)) return invalid_argument("dst length", src.extent(0), dst.extent(0));
    const SlotLists lists{DeviceView<const std::int32_t, 1>(src), DeviceView<const std::int32_t, 1>(dst),
                          state.max_slots()};
    const std::int64_t n = src.extent(0);
    if (exec.checked && n > 0) KVMEM_RETURN_IF_ERROR(slot_list_status(first_failure(exec, lists), n, lists.B, "src"));
    const ItemTable<S, A> items(state);
    const Shape& sh = state.shape();
    const std::int64_t Hk = sh.Hk, D = sh.D, Dv = sh.Dv, W = state.window_capacity();
    std::int64_t* n_seq = state.n_data();
    std::int64_t* cov = state.cov_data();
    std::int64_t* used = state.slots_data();
    // Every source is read before its counters could change: no destination is a source.
    Kokkos::parallel_for(
        "kvmem::kokkos::kvm::copy_slots", ::kvmem::kokkos::detail::range_policy(exec, 0, n * Hk),
        KOKKOS_LAMBDA(const std::int64_t x) {
          const std::int64_t i = x / Hk, g = x % Hk;
          if (lists.failure(i) != 0) return;
          const std::int64_t s = lists.src(i), d = lists.dst(i);
          if (s == d) return;
          const kvm::ItemView<S, A> a = items.at(s * Hk + g), b = items.at(d * Hk + g);
          const std::int64_t m = used[s];
          for (std::int64_t e = 0; e < m * D; ++e) {
            b.sk[e] = a.sk[e];
            b.khat[e] = a.khat[e];
          }
          for (std::int64_t e = 0; e < m * Dv; ++e) {
            b.sv[e] = a.sv[e];
            b.vhat[e] = a.vhat[e];
          }
          for (std::int64_t e = 0; e < m; ++e) {
            b.rho[e] = a.rho[e];
            b.cnt[e] = a.cnt[e];
          }
          for (std::int64_t e = 0; e < W * D; ++e) b.wk[e] = a.wk[e];
          for (std::int64_t e = 0; e < W * Dv; ++e) b.wv[e] = a.wv[e];
          for (std::int64_t e = 0; e < W; ++e) b.wg[e] = a.wg[e];
        });
    Kokkos::parallel_for(
        "kvmem::kokkos::kvm::copy_counters", ::kvmem::kokkos::detail::range_policy(exec, 0, n),
        KOKKOS_LAMBDA(const std::int64_t i) {
          if (lists.failure(i) != 0) return;
          const std::int64_t s = lists.src(i), d = lists.dst(i);
          n_seq[d] = n_seq[s];
          cov[d] = cov[s];
          used[d] = used[s];
        });
    return Status::ok();
  }

  // The record is written on the host from the state's host-accessible memory (create_state), after
  // the work queued on exec.space has finished; kvm/record.hpp is the one writer of every backend.
  template <class S, class A>
  static Status export_slot(const kokkos::Executor<Space>& exec, const State<S, A>& state, std::int32_t slot,
                            std::span<std::byte> bytes) {
    KVMEM_RETURN_IF_ERROR(state.check_slot(slot, "slot"));
    exec.space.fence();
    const std::size_t need = kvm::export_bytes(state, slot);
    if (bytes.size() < need)
      return invalid_argument("bytes", ">= export_bytes(state, slot) = " + std::to_string(need), bytes.size());
    slot_record::Writer wr(bytes.first(need), slot_record::Mechanism::kKvm, record_detail::kFields);
    record_detail::write(state, slot, state.tokens(slot), state.covered(slot), state.slots(slot), wr, false);
    return Status::ok();
  }

  // The record is read and checked on the host (kvm/record.hpp) before anything changes; the slot's
  // canonical fields are then written into the host-accessible state and the readout copies K^, V^
  // rebuilt on exec.space with the same kernel bodies as a step (so they equal the source's bits).
  template <class S, class A>
  static Status import_slot(const kokkos::Executor<Space>& exec, State<S, A>& state, const Weights& weights,
                            std::int32_t slot, std::span<const std::byte> bytes) {
    static_assert(kokkos::check_kvm_storage<S>());
    using namespace kokkos::detail;
    KVMEM_RETURN_IF_ERROR(state.check_slot(slot, "slot"));
    const Shape& sh = state.shape();
    KVMEM_RETURN_IF_ERROR(KvmWeights::check_shapes(weights, sh));
    const KvmWeights w(weights);
    if (exec.checked) {
      std::int64_t bad = 0;
      const std::int64_t D = sh.D, Hq = sh.Hq;
      Kokkos::parallel_reduce(
          "kvmem::kokkos::kvm::import_check", ::kvmem::kokkos::detail::range_policy(exec, 0, 1),
          KOKKOS_LAMBDA(const std::int64_t, std::int64_t& b) { b = w.finite_values(D, Hq) ? 0 : 1; },
          Kokkos::Max<std::int64_t>(bad));
      if (bad > 0) return invalid_argument("weights", "finite values", "NaN or Inf");
    }
    record_detail::Parsed<A> rec;
    KVMEM_RETURN_IF_ERROR(record_detail::read(state, bytes, rec));
    exec.space.fence();  // no queued kernel still reads or writes the slot
    const std::int64_t D = sh.D, Dv = sh.Dv, W = state.window_capacity(), S_ = rec.slots, Hk = sh.Hk;
    const std::int64_t w0 = state.params().geometry().bswa_begin(rec.n), held = rec.n - w0;
    for (std::int64_t g = 0; g < Hk; ++g) {
      const auto it = state.item(slot, g);
      std::copy_n(rec.sk.begin() + g * S_ * D, S_ * D, it.sk);
      std::copy_n(rec.sv.begin() + g * S_ * Dv, S_ * Dv, it.sv);
      std::copy_n(rec.rho.begin() + g * S_, S_, it.rho);
      std::copy_n(rec.cnt.begin() + g * S_, S_, it.cnt);
      for (std::int64_t i = 0; i < held; ++i) {
        const std::int64_t ring = (w0 + i) % W, at = g * held + i;
        for (std::int64_t d = 0; d < D; ++d) it.wk[ring * D + d] = store_as<S>(rec.wk[std::size_t(at * D + d)]);
        for (std::int64_t d = 0; d < Dv; ++d) it.wv[ring * Dv + d] = store_as<S>(rec.wv[std::size_t(at * Dv + d)]);
        it.wg[ring] = rec.wg[std::size_t(at)];
      }
    }
    state.n_data()[slot] = rec.n;
    state.cov_data()[slot] = rec.cov;
    state.slots_data()[slot] = rec.slots;
    load_weights(exec, state, w);
    const auto call = make_call<S, A, float, float>(state, BatchIo<float, float>{});
    const std::int64_t first = std::int64_t(slot) * Hk;
    Kokkos::parallel_for(
        "kvmem::kokkos::kvm::import_readout", ::kvmem::kokkos::detail::range_policy(exec, 0, Hk),
        KOKKOS_LAMBDA(const std::int64_t g) { call.refresh(call.items.at(first + g), 0, S_); });
    exec.space.fence();  // the record's staging memory is the caller's; the state is complete on return
    return Status::ok();
  }

  // Reads the slot's counters on the host (after the queued work finished) to decide exactness
  // (kvm::truncate_check), then rewrites them.
  template <class S, class A>
  static Status truncate(const kokkos::Executor<Space>& exec, State<S, A>& state, std::int32_t slot, std::int64_t n) {
    KVMEM_RETURN_IF_ERROR(state.check_slot(slot, "slot"));
    exec.space.fence();
    KVMEM_RETURN_IF_ERROR(truncate_check(state, slot, n));
    const std::int64_t n_new = state.tokens(slot) - n;
    const std::int64_t cov = state.params().geometry().covered(n_new);
    if (state.covered(slot) != cov) state.slots_data()[slot] = cov;  // initial slots only: one per token (spec 4.3)
    state.cov_data()[slot] = cov;
    state.n_data()[slot] = n_new;
    return Status::ok();
  }

 private:
  static Status value_status(kokkos::detail::KvmCheck code, const std::string& where) {
    using kokkos::detail::KvmCheck;
    switch (code) {
      case KvmCheck::kQ:
        return invalid_argument("q", "finite values", "NaN or Inf in " + where);
      case KvmCheck::kK:
        return invalid_argument("k", "finite values", "NaN or Inf in " + where);
      case KvmCheck::kV:
        return invalid_argument("v", "finite values", "NaN or Inf in " + where);
      case KvmCheck::kGate:
        return invalid_argument("gate", "finite values > 0 (g = 1 + ELU > 0)", "a violation in " + where);
      default:
        return invalid_argument("weights", "finite values", "NaN or Inf");
    }
  }
};

// kvm::forward on Kokkos: whole sequences from an empty cache whose state lives in the space's memory
// (create_state) instead of the host allocation of the generic forward. Allocates per call (training-
// style use, as the generic forward).
template <class S = float, class A = float, class Space, class In, class Out>
Status forward(const kokkos::Executor<Space>& exec, const Params& params, const Weights& weights,
               TensorView<const In, 4> q,     // [B,Hq,T,D]
               TensorView<const In, 4> k,     // [B,Hk,T,D]
               TensorView<const In, 4> v,     // [B,Hk,T,Dv]
               TensorView<const In, 3> gate,  // [B,Hk,T]
               TensorView<Out, 4> out,        // [B,T,Hq,Dv]
               const std::int64_t* lengths = nullptr) {
  const Shape shape{q.extent(0), q.extent(1), k.extent(1), q.extent(3), v.extent(3), q.extent(2) > 0 ? q.extent(2) : 1};
  kokkos::KvmState<S, A, kokkos::state_memory_space<Space>> state;
  KVMEM_RETURN_IF_ERROR((kokkos::create_state<S, A>(exec, params, shape, state)));
  KVMEM_RETURN_IF_ERROR(prefill(exec, state.state, weights, q, k, v, gate, out, lengths));
  exec.space.fence();  // the state's memory is released on return
  return Status::ok();
}

}  // namespace kvmem::kvm
