// SPDX-License-Identifier: Apache-2.0
#pragma once
// Kernels of KVM's sequence-slot step on the CUDA backend (kvm::step over ragged rows, docs/slots.md;
// the host side is in kvm.cuh). Every per-row decision is taken here from per-slot counters in device
// memory, so the host enqueues the same launches whatever the slots hold: a step is
//
//   plan(phase 0: validate the rows, snapshot n)  update  ingest  readout      (phase 0)
//   plan(phase p)                                  update  ingest  readout      (p = 1 .. P-1)
//
// where phase p runs the p-th chunk segment of every row (spec 4.7: at the first token of a new chunk
// the pending update runs, then the segment enters the window ring, founding initial slots below
// position C, then it attends), and the update is five launches spread over the whole GPU (see its
// section below). P bounds the segments of the longest possible row, from the rows' max_query_len
// when the caller gives it, else from the packed token count; a row with fewer segments idles in the
// later phases. Ingest and readout run a block per token of the phase's segments: per packed token, or
// per (row, position in its segment) when that grid is smaller (SlotGrid), the same per-token work.
//
// The state update mirrors the host backend's exact path operation by operation (kernel/kvm_state.hpp
// bodies, written here with explicitly rounded products and sums so nvcc contracts nothing into an
// FMA): a slot's memory slots, routes and counters equal the host's bit for bit. The readout is an
// online softmax over [slots | window] whose sum order differs from the host's (fp32 rounding).
//
// A step's rows are checked on the device (plan, phase 0). A refused step changes nothing; the reason
// stays in the state's status word (sticky: later steps and slot operations are refused too) until
// KvmState::step_status reads and clears it. The slot operations (reset_slots, copy_slots) check their
// device lists the same way (slot_lists.cuh) and report through the same word.

#include "kvmem/backend/cuda/vendor.cuh"

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstddef>
#include <cstdint>

#include "kvmem/backend/cuda/kvm_kernels.cuh"
#include "kvmem/backend/cuda/slot_lists.cuh"
#include "kvmem/core/numeric.hpp"

namespace kvmem::cuda::kvm_detail {

// The per-slot plan of the current phase of a step (written by slot_plan_kernel, read by the others).
struct SlotPlan {
  std::int64_t n0, len;               // the slot's tokens before this step, and its row's token count
  std::int64_t t0, t1;                // this phase's segment [t0, t1) (empty: t0 == t1)
  std::int64_t wb;                    // its window start bswa_begin(t0 + 1)
  std::int64_t a, n_app;              // the update before the segment: first token a (a < 0: none), appends
  std::int64_t s_before, s_after;     // |S| before and after that update
  std::int64_t found_from, found_to;  // positions founding initial slots (spec 4.3)
  std::int64_t s_read;                // |S| the segment's readout sees
};

// Why a step was refused (the status word's first element; a slot operation's refusals are the
// slot_lists::Code values above these).
enum SlotStepError : int {
  kStepOk = 0,
  kStepBadStart = 1,    // query_start[0] != 0 or a start decreases
  kStepBadSlot = 2,     // slot outside [-1, max_slots)
  kStepDuplicate = 3,   // a slot named by two rows
  kStepTooLong = 4,     // n + tokens > n_ctx
  kStepTokenCount = 5,  // query_start[rows] != the packed token count
  kStepOverBound = 6,   // a row naming a slot holds more tokens than the rows' max_query_len
};
// Elements of the step status word: code, row, value, step stamp, and the rows' max_query_len of the
// refused step (what an over-bound refusal's message names).
inline constexpr int kStatusWords = 5;

// The per-slot counters and step bookkeeping in device memory, passed by value to the kernels.
struct SlotCounters {
  std::int64_t* n;                    // [B] tokens seen
  std::int64_t* cov;                  // [B] tokens summarised
  std::int64_t* slots;                // [B] |S|
  SlotPlan* plan;                     // [B] (workspace: rewritten by every phase of a step)
  int* seen;                          // [B] stamp of the last step whose rows named the slot (duplicate check)
  int* status;                        // [kStatusWords] error code, row, value, step stamp, bound
  int* mark;                          // [B] scratch of a slot operation's list check (slot_lists.cuh)
  const std::int64_t* update_target;  // [updates]: budget target of update u (first token u C), spec 3.1
  int* update_rows;                   // [rows + 1] (workspace): count, then the rows updating this phase
  unsigned long long* key;            // [rows * Hk, C] (workspace): the update passes' merged keys
  std::int64_t B, n_ctx;
};

// The rows of a step in device memory: slot [R], query_start [R + 1]; max_len the host's bound on the
// tokens of a row naming a slot (Rows::max_query_len; 0: none), which the plan checks.
struct SlotRows {
  const std::int32_t* slot;
  const std::int32_t* start;
  std::int64_t R;
  std::int64_t max_len;
};

// ---- exactly rounded bodies (kernel/kvm_state.hpp, kernel/attend.hpp dot) ------------------------

template <class X>
__device__ inline float rn_load(const X& x) {
  return load_as<float>(x);
}

// kernel::dot with its eight partial sums, every product and sum rounded on its own.
template <class B>
__device__ inline float rn_dot(const float* a, const B* b, std::int64_t n) {
  float part[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  std::int64_t i = 0;
  for (; i + 8 <= n; i += 8)
#pragma unroll
    for (int l = 0; l < 8; ++l) part[l] = __fadd_rn(part[l], __fmul_rn(a[i + l], rn_load(b[i + l])));
  float s = __fadd_rn(__fadd_rn(__fadd_rn(part[0], part[1]), __fadd_rn(part[2], part[3])),
                      __fadd_rn(__fadd_rn(part[4], part[5]), __fadd_rn(part[6], part[7])));
  for (; i < n; ++i) s = __fadd_rn(s, __fmul_rn(a[i], rn_load(b[i])));
  return s;
}

// kernel::layer_norm; y[d] is stored as Y (store_as). y may alias x.
template <class X, class Y>
__device__ inline void rn_layer_norm(const X* x, std::int64_t D, const float* w, const float* b, float eps, Y* y) {
  float mean = 0;
  for (std::int64_t d = 0; d < D; ++d) mean = __fadd_rn(mean, rn_load(x[d]));
  mean = __fdiv_rn(mean, static_cast<float>(D));
  float var = 0;
  for (std::int64_t d = 0; d < D; ++d) {
    const float c = __fsub_rn(rn_load(x[d]), mean);
    var = __fadd_rn(var, __fmul_rn(c, c));
  }
  var = __fdiv_rn(var, static_cast<float>(D));
  const float inv = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(var, eps)));
  for (std::int64_t d = 0; d < D; ++d)
    y[d] = store_as<Y>(__fadd_rn(__fmul_rn(w[d], __fmul_rn(__fsub_rn(rn_load(x[d]), mean), inv)), b[d]));
}

template <class X>
__device__ inline float rn_norm2(const X* x, std::int64_t n) {
  float s = 0;
  for (std::int64_t i = 0; i < n; ++i) s = __fadd_rn(s, __fmul_rn(rn_load(x[i]), rn_load(x[i])));
  return __fsqrt_rn(s);
}

// K^_j = LN_s(Sk_j) and V^_j of slot j of an item (spec 4.4 steps 1-2), one thread. K^_j is kept in
// fp32 too (khat32: the update passes read it) and in the storage type (khat: the readout reads it).
// fp8 storage: each row with its scale (quantize_row's rule, the host's).
template <class S>
__device__ inline void rn_refresh(const DeviceState<S, float>& st, std::int64_t item, std::int64_t j) {
  const std::int64_t D = st.D, Dv = st.Dv;
  const float* sk = st.sk + (item * st.cap + j) * D;
  const float* sv = st.sv + (item * st.cap + j) * Dv;
  float* k32 = st.khat32 + (item * st.cap + j) * D;
  rn_layer_norm(sk, D, st.ln_w, st.ln_b, st.eps, k32);
  S* khat = st.khat + (item * st.cap + j) * D;
  if constexpr (is_row_scaled_v<S>)
    st.khat_scale[item * st.cap + j] = quantize_row(k32, khat, D);
  else
    for (std::int64_t d = 0; d < D; ++d) khat[d] = store_as<S>(k32[d]);
  float f;
  if (st.value_radius) {
    float nrm = rn_norm2(sv, Dv);
    if (nrm < 1e-12f) nrm = 1e-12f;
    f = __fdiv_rn(st.rho[item * st.cap + j], nrm);
  } else {
    f = __fdiv_rn(1.0f, st.cnt[item * st.cap + j]);
  }
  S* vhat = st.vhat + (item * st.cap + j) * Dv;
  if constexpr (is_row_scaled_v<S>) {
    float amax = 0.0f;
    for (std::int64_t d = 0; d < Dv; ++d) amax = fmaxf(amax, fabsf(__fmul_rn(sv[d], f)));
    const float scale = fp8_row_scale(amax), inverse = fp8_inverse_scale(scale);
    for (std::int64_t d = 0; d < Dv; ++d) vhat[d] = ptx::to_e4m3(__fmul_rn(sv[d], f) * inverse);
    st.vhat_scale[item * st.cap + j] = scale;
  } else {
    for (std::int64_t d = 0; d < Dv; ++d) vhat[d] = store_as<S>(__fmul_rn(sv[d], f));
  }
}

__device__ inline std::int64_t imin(std::int64_t a, std::int64_t b) {
  return a < b ? a : b;
}
__device__ inline std::int64_t imax(std::int64_t a, std::int64_t b) {
  return a > b ? a : b;
}

__device__ inline std::int64_t slot_bswa_begin(std::int64_t n, std::int64_t C, std::int64_t W) {
  const std::int64_t begin = (n + C - 1) / C * C - W;
  return begin > 0 ? begin : 0;
}

// The row r with start[r] <= token < start[r + 1] (rows of zero tokens hold none).
__device__ inline std::int64_t slot_row_of(const SlotRows& rows, std::int64_t token) {
  std::int64_t lo = 0, hi = rows.R - 1;  // the last row whose start is <= token
  while (lo < hi) {
    const std::int64_t mid = (lo + hi + 1) / 2;
    if (rows.start[mid] <= token)
      lo = mid;
    else
      hi = mid - 1;
  }
  return lo;
}

// The grid of a phase's ingest and readout (x): with per_row = 0, block x is packed token x; otherwise
// block x is position x % per_row of the phase's segment of row x / per_row (per_row >= the longest
// segment: min(C, the bound on a row's tokens)). The host takes whichever has fewer blocks: tokens, or
// rows * per_row, which a step of a few long rows makes much smaller, and every token of a segment still
// gets one block doing the same work.
struct SlotGrid {
  std::int64_t per_row;

  [[nodiscard]] std::int64_t blocks(std::int64_t rows, std::int64_t tokens) const {
    return per_row == 0 ? tokens : rows * per_row;
  }
  __device__ std::int64_t row(const SlotRows& rows, std::int64_t x) const {
    return per_row == 0 ? slot_row_of(rows, x) : x / per_row;
  }
  // The packed token of block x in row r's segment [t0, t1) this phase (the plan of its slot), or -1.
  __device__ std::int64_t token(const SlotRows& rows, std::int64_t r, const SlotPlan& pl, std::int64_t x) const {
    if (per_row == 0) {
      const std::int64_t t = pl.n0 + x - rows.start[r];
      return t >= pl.t0 && t < pl.t1 ? x : -1;
    }
    const std::int64_t j = x % per_row;
    return j < pl.t1 - pl.t0 ? rows.start[r] + (pl.t0 - pl.n0) + j : -1;
  }
  // The packed tokens [first, end) by `step` that block x zeroes in padding row r: its own token, or
  // every per_row-th token of the row from its position (a padding row is not bound by max_query_len).
  __device__ void padding(const SlotRows& rows, std::int64_t r, std::int64_t x, std::int64_t& first, std::int64_t& end,
                          std::int64_t& step) const {
    first = per_row == 0 ? x : rows.start[r] + x % per_row;
    end = per_row == 0 ? x + 1 : rows.start[r + 1];
    step = per_row == 0 ? 1 : per_row;
  }
};

// ---- plan: validation (phase 0) and the per-slot segment of a phase ------------------------------

inline constexpr int kPlanThreads = 256;

// One block. Phase 0 first checks every row (refusing the whole step on the first bad one, before any
// counter changes; a row over max_len too, since the host sized the phases and grids from it) and
// snapshots n; every phase then takes each row's p-th chunk segment: the update
// before it (spec 4.7 step 4: cov < bswa_begin(t0 + 1)), its initial slots, and advances cov and |S|.
__global__ void __launch_bounds__(kPlanThreads)
    slot_plan_kernel(SlotCounters sc, SlotRows rows, std::int64_t tokens, std::int64_t C, std::int64_t W, int phase) {
  __shared__ unsigned long long first_error;
  __shared__ int refused, updating;
  const int tid = threadIdx.x;
  if (tid == 0) updating = 0;
  if (phase == 0) {
    if (tid == 0) {
      first_error = ~0ull;
      refused = sc.status[0] != kStepOk;
    }
    __syncthreads();
    if (refused) return;  // sticky: a refused step refuses the later ones until step_status reads it
    const int stamp = sc.status[3] + 1;
    const auto fail = [&](int code, std::int64_t row, std::int64_t value) {
      atomicMin(&first_error, (static_cast<unsigned long long>(row) << 40) |
                                  (static_cast<unsigned long long>(code) << 32) |
                                  static_cast<unsigned long long>(static_cast<std::uint32_t>(value)));
    };
    for (std::int64_t r = tid; r < rows.R; r += blockDim.x) {
      const std::int64_t s0 = rows.start[r], s1 = rows.start[r + 1];
      if ((r == 0 && s0 != 0) || s1 < s0) fail(kStepBadStart, r, s0);
      const std::int32_t b = rows.slot[r];
      if (b == -1) continue;
      if (b < -1 || b >= sc.B) {
        fail(kStepBadSlot, r, b);
        continue;
      }
      if (atomicExch(&sc.seen[b], stamp) == stamp) fail(kStepDuplicate, r, b);
      if (sc.n[b] + (s1 - s0) > sc.n_ctx) fail(kStepTooLong, r, b);
      if (rows.max_len > 0 && s1 - s0 > rows.max_len) fail(kStepOverBound, r, s1 - s0);
    }
    if (tid == 0 && rows.start[rows.R] != tokens) fail(kStepTokenCount, rows.R, rows.start[rows.R]);
    __syncthreads();
    if (tid == 0) {
      sc.status[3] = stamp;  // every step takes a new stamp, refused or not, so no stale stamp matches
      if (first_error != ~0ull) {
        sc.status[0] = static_cast<int>((first_error >> 32) & 0xff);
        sc.status[1] = static_cast<int>(first_error >> 40);
        sc.status[2] = static_cast<int>(first_error & 0xffffffffull);
        sc.status[4] = static_cast<int>(rows.max_len < INT_MAX ? rows.max_len : INT_MAX);
      }
    }
    if (first_error != ~0ull) return;
    for (std::int64_t r = tid; r < rows.R; r += blockDim.x) {
      const std::int32_t b = rows.slot[r];
      if (b < 0) continue;
      const std::int64_t len = rows.start[r + 1] - rows.start[r];
      sc.plan[b].n0 = sc.n[b];
      sc.plan[b].len = len;
      sc.n[b] += len;
    }
  } else {
    if (tid == 0) refused = sc.status[0] != kStepOk;
    __syncthreads();
    if (refused) return;
  }
  for (std::int64_t r = tid; r < rows.R; r += blockDim.x) {
    const std::int32_t b = rows.slot[r];
    if (b < 0) continue;
    SlotPlan pl = sc.plan[b];
    const std::int64_t end = pl.n0 + pl.len;
    const std::int64_t t0 = phase == 0 ? pl.n0 : (pl.n0 / C + phase) * C;
    pl.a = -1;
    pl.found_from = pl.found_to = 0;
    if (t0 >= end) {
      pl.t0 = pl.t1 = 0;
      sc.plan[b] = pl;
      continue;
    }
    pl.t0 = t0;
    pl.t1 = imin(end, (t0 / C + 1) * C);
    pl.wb = slot_bswa_begin(t0 + 1, C, W);
    std::int64_t cov = sc.cov[b], S = sc.slots[b];
    if (cov < pl.wb) {  // spec 4.5 with N = W + a, avail = a + C; the budget's target precomputed per update
      sc.update_rows[1 + atomicAdd(&updating, 1)] = static_cast<int>(r);  // in any order: see the update
      pl.a = cov;
      pl.s_before = S;
      pl.n_app = imin(sc.update_target[cov / C] - S, C);
      S += pl.n_app > 0 ? pl.n_app : 0;
      pl.s_after = S;
      cov += C;
    }
    if (pl.t0 < C && pl.t1 > cov) {  // tokens below C found a slot each (spec 4.3)
      pl.found_from = imax(pl.t0, cov);
      pl.found_to = imin(pl.t1, C);
      S += pl.found_to - pl.found_from;
      cov = pl.found_to;
    }
    pl.s_read = S;
    sc.plan[b] = pl;
    sc.cov[b] = cov;
    sc.slots[b] = S;
  }
  __syncthreads();
  if (tid == 0) sc.update_rows[0] = updating;
}

// ---- update (spec 4.5), spread over the GPU ------------------------------------------------------------
//
// An update compares each of the C tokens of an item (row, KV head) with every slot twice: novelty
// against the S0 pre-update slots, routing against the S1 slots after the appends, C * S dots of D
// channels a pass (about 94 M multiply-adds at 16 sqrt N and 32K tokens). A decoding row updates once
// in C steps, so a step has few updating items, and one block per item would leave nearly all of the
// GPU idle behind one long serial chain. The update of a phase therefore runs as five launches:
//
//   prep     a block per updating item, a thread per token: k0, kg, vg (step 1)
//   novelty  a fixed grid over (item, range of slots): each token's best k0 . LN_s(Sk_j)  (step 2)
//   select   a block per updating item: the appends by rank, in token order (steps 2-3)
//   route    the fixed grid over (item, range of slots): each token's argmax kg . LN_s(Sk_j) (step 4)
//   finish   the fixed grid over (item, range of slots): the scatter, then K^, V^ (steps 4, 4.4)
//
// Grid sizes depend only on the device's multiprocessor count, the row count and the state's shape (one
// captured graph replays step after step); the plan lists the rows that update in this phase, and the
// blocks spread that list's items over themselves, the passes cutting each item's slots into as many
// ranges as keep every block busy.
//
// The passes read LN_s(Sk_j) from khat32 (fp32, written by rn_refresh and the appends with
// rn_layer_norm) and compute every dot as rn_dot does, so each (token, slot) dot has the bits of the
// host's exact path. Ranges meet through one 64-bit key per (item, token), merged with atomicMax: the
// high half an order-preserving code of the dot, the low half ~j. A maximum does not depend on the
// order in which blocks arrive (deterministic), and the keys keep the serial loops' rules exactly: the
// novelty score is the largest dot (a NaN never wins), the route the smallest j of the largest dot (the
// strict > of the serial loop keeps ties at the smaller j), and the first candidate, the sink slot, is
// kept when its own dot is NaN (nothing compares greater than the serial loop's NaN best).

inline constexpr int kSlotPassThreads = 256;  // threads of a pass or finish block
inline constexpr int kSlotPassTile = 32;      // slot rows of khat32 a pass block stages at a time
inline constexpr int kSlotGroup = 8;          // slots a thread dots one token against at once (64 sums)
inline constexpr int kSlotBlocksPerSm = 2;    // pass blocks a multiprocessor holds (registers: 64 sums)

inline unsigned slot_update_threads(std::int64_t C) {
  return static_cast<unsigned>(std::max<std::int64_t>(64, (C + kWarpSize - 1) / kWarpSize * kWarpSize));
}

// Dynamic shared memory of the launches: select (score and target per token), a pass (a tile of
// LN_s rows, a key and a skip flag per token), finish (target per token).
inline std::size_t slot_select_shared_bytes(std::int64_t C) {
  return std::size_t(C) * (sizeof(float) + sizeof(int));
}
inline std::size_t slot_pass_shared_bytes(std::int64_t C, std::int64_t D) {
  return std::size_t(kSlotPassTile * D) * sizeof(float) + std::size_t(C) * (sizeof(unsigned long long) + sizeof(int));
}
inline std::size_t slot_finish_shared_bytes(std::int64_t C) {
  return std::size_t(C) * sizeof(int);
}

// Order-preserving code of a float that is not NaN: x < y iff code(x) < code(y); -0 and +0 share a code
// (they compare equal). Every code is > 0 (-inf's is 0x007fffff), so 0 can mean "no dot yet". The key
// functions are host-callable too, so a test checks the merge rules without a device.
KVMEM_HOST_DEVICE inline std::uint32_t slot_order_code(float x) {
  const std::uint32_t u = ::kvmem::detail::float_bits(x == 0.0f ? 0.0f : x);
  return (u & 0x80000000u) != 0 ? ~u : (u | 0x80000000u);
}
KVMEM_HOST_DEVICE inline float slot_order_value(std::uint32_t code) {
  return ::kvmem::detail::bits_float((code & 0x80000000u) != 0 ? (code & 0x7fffffffu) : ~code);
}

// Novelty key of a dot: its code (a NaN is never > the running best: no key).
KVMEM_HOST_DEVICE inline unsigned long long slot_novelty_key(float s) {
  return s != s ? 0ull : static_cast<unsigned long long>(slot_order_code(s)) << 32;
}
// The novelty score of a merged key: -inf when no slot gave one (the serial loop's start).
KVMEM_HOST_DEVICE inline float slot_novelty_score(unsigned long long key) {
  return key == 0 ? -INFINITY : slot_order_value(static_cast<std::uint32_t>(key >> 32));
}

// Route key of dot l with slot j: larger dots first, then smaller j. The first candidate is taken
// whatever its dot, so its NaN outranks every dot; any other slot's NaN never wins.
KVMEM_HOST_DEVICE inline unsigned long long slot_route_key(float l, std::int64_t j, bool first) {
  const unsigned long long low = 0xffffffffull - static_cast<unsigned long long>(j);
  if (l != l) return first ? (0xffffffffull << 32) | low : 0ull;
  return (static_cast<unsigned long long>(slot_order_code(l)) << 32) | low;
}
KVMEM_HOST_DEVICE inline int slot_route_target(unsigned long long key) {
  return static_cast<int>(0xffffffffull - (key & 0xffffffffull));
}

// One updating item of the phase: entry e of the plan's list of updating rows, KV head g.
struct SlotUpdateItem {
  std::int64_t item, work;  // (slot, head) of the state; (row, head) of the workspace
  SlotPlan pl;
};

template <class S>
__device__ inline SlotUpdateItem slot_update_item(const DeviceState<S, float>& st, const SlotCounters& sc,
                                                  const SlotRows& rows, std::int64_t u) {
  const std::int64_t e = u / st.Hk, g = u % st.Hk, r = sc.update_rows[1 + e], b = rows.slot[r];
  return {b * st.Hk + g, r * st.Hk + g, sc.plan[b]};
}

// Items that update in this phase (0 when the step was refused).
__device__ inline std::int64_t slot_update_items(const SlotCounters& sc, std::int64_t Hk) {
  return sc.status[0] != kStepOk ? 0 : std::int64_t(sc.update_rows[0]) * Hk;
}

// Step 1 of the host's exact path (backend/host/kvm.hpp, Call::update): thread c computes k0, kg, vg of
// token c, row-major for the appends and the scatter and transposed ([D, C]: the passes read a channel
// of 32 tokens in one transaction), and clears its novelty key. grid min(R * Hk, ...), block
// slot_update_threads(C).
template <class S>
__global__ void __launch_bounds__(1024)
    slot_update_prep_kernel(DeviceState<S, float> st, SlotCounters sc, SlotRows rows) {
  const std::int64_t items = slot_update_items(sc, st.Hk), C = st.C, D = st.D, Dv = st.Dv, W = st.W;
  const std::int64_t c = threadIdx.x;
  if (c >= C) return;  // no barrier below
  for (std::int64_t u = blockIdx.x; u < items; u += gridDim.x) {
    const SlotUpdateItem it = slot_update_item(st, sc, rows, u);
    float* k0 = st.k0 + (it.work * C + c) * D;
    float* kg = st.kg + (it.work * C + c) * D;
    float* vg = st.vg + (it.work * C + c) * Dv;
    float* k0t = st.k0t + it.work * D * C + c;
    float* kgt = st.kgt + it.work * D * C + c;
    const std::int64_t ring = (it.pl.a + c) % W;
    const Win<S>* kr = st.wk + (it.item * W + ring) * D;
    const Win<S>* vr = st.wv + (it.item * W + ring) * Dv;
    const float gate = st.wg[it.item * W + ring];
    for (std::int64_t d = 0; d < D; ++d) k0[d] = d < st.rope_dims ? 0.0f : rn_load(kr[d]);
    rn_layer_norm(k0, D, st.ln_w, st.ln_b, st.eps, k0);
    for (std::int64_t d = 0; d < D; ++d) {
      const float x = k0[d], y = st.merge_gate_keys ? __fmul_rn(gate, x) : x;
      kg[d] = y;
      k0t[d * C] = x;
      kgt[d * C] = y;
    }
    for (std::int64_t d = 0; d < Dv; ++d)
      vg[d] = st.merge_gate_values ? __fmul_rn(gate, rn_load(vr[d])) : rn_load(vr[d]);
    sc.key[it.work * C + c] = 0;
  }
}

// The kSlotGroup dots of one token (channel d at x[d * ld]) with staged slot rows (rows[s * D + d]),
// each rounded exactly as rn_dot(rows + s * D, x, D): eight partial sums, their pairwise tree, the tail.
template <bool kVec>
__device__ inline void slot_dot_group(const float* rows, std::int64_t D, const float* x, std::int64_t ld,
                                      float (&out)[kSlotGroup]) {
  float part[kSlotGroup][8];
#pragma unroll
  for (int s = 0; s < kSlotGroup; ++s)
#pragma unroll
    for (int l = 0; l < 8; ++l) part[s][l] = 0.0f;
  std::int64_t i = 0;
  for (; i + 8 <= D; i += 8) {
    float xv[8];
#pragma unroll
    for (int l = 0; l < 8; ++l) xv[l] = __ldg(x + (i + l) * ld);
#pragma unroll
    for (int s = 0; s < kSlotGroup; ++s) {
      const float* a = rows + s * D + i;
      float av[8];
      if constexpr (kVec) {  // 16-byte aligned: D % 4 == 0 and i % 8 == 0
        const float4 lo = *reinterpret_cast<const float4*>(a), hi = *reinterpret_cast<const float4*>(a + 4);
        av[0] = lo.x, av[1] = lo.y, av[2] = lo.z, av[3] = lo.w, av[4] = hi.x, av[5] = hi.y, av[6] = hi.z, av[7] = hi.w;
      } else {
#pragma unroll
        for (int l = 0; l < 8; ++l) av[l] = a[l];
      }
#pragma unroll
      for (int l = 0; l < 8; ++l) part[s][l] = __fadd_rn(part[s][l], __fmul_rn(av[l], xv[l]));
    }
  }
#pragma unroll
  for (int s = 0; s < kSlotGroup; ++s)
    out[s] = __fadd_rn(__fadd_rn(__fadd_rn(part[s][0], part[s][1]), __fadd_rn(part[s][2], part[s][3])),
                       __fadd_rn(__fadd_rn(part[s][4], part[s][5]), __fadd_rn(part[s][6], part[s][7])));
  for (; i < D; ++i) {
    const float xi = __ldg(x + i * ld);
#pragma unroll
    for (int s = 0; s < kSlotGroup; ++s) out[s] = __fadd_rn(out[s], __fmul_rn(rows[s * D + i], xi));
  }
}

// The novelty pass (kRoute false: every token against slots [0, S0), where the item appends) or the
// routing pass (kRoute true: tokens not appended against slots [sink, S1), where some token merges).
// Unit u of the grid-stride loop is range u % ranges of item u / ranges; a range is whole tiles. Each
// block merges its keys per token in shared memory, then into sc.key with one atomicMax per token.
// grid kSlotBlocksPerSm * SMs, block kSlotPassThreads, smem slot_pass_shared_bytes.
template <class S, bool kRoute>
__global__ void __launch_bounds__(kSlotPassThreads, kSlotBlocksPerSm)
    slot_update_pass_kernel(DeviceState<S, float> st, SlotCounters sc, SlotRows rows) {
  const std::int64_t items = slot_update_items(sc, st.Hk);
  if (items == 0) return;
  extern __shared__ __align__(16) float slot_pass_smem[];
  const std::int64_t C = st.C, D = st.D, ranges = imax(1, std::int64_t(gridDim.x) / items);
  float* tile = slot_pass_smem;                                                  // [kSlotPassTile, D]
  auto* best = reinterpret_cast<unsigned long long*>(tile + kSlotPassTile * D);  // [C]
  int* skip = reinterpret_cast<int*>(best + C);                                  // [C]: appended tokens
  for (std::int64_t u = blockIdx.x; u < items * ranges; u += gridDim.x) {
    const SlotUpdateItem it = slot_update_item(st, sc, rows, u / ranges);
    const bool runs = kRoute ? it.pl.n_app < C : it.pl.n_app > 0;
    const std::int64_t jb = kRoute ? st.sink : 0, je = kRoute ? it.pl.s_after : it.pl.s_before;
    const std::int64_t tiles = je > jb ? (je - jb + kSlotPassTile - 1) / kSlotPassTile : 0;
    const std::int64_t per = (tiles + ranges - 1) / ranges * kSlotPassTile;
    const std::int64_t lo = jb + (u % ranges) * per, hi = imin(je, lo + per);
    if (!runs || lo >= hi) continue;  // the same for every thread of the block
    __syncthreads();                  // the previous unit's last reads of best are done
    for (std::int64_t c = threadIdx.x; c < C; c += blockDim.x) {
      best[c] = 0;
      skip[c] = kRoute && st.target[it.work * C + c] == -1;
    }
    const float* xt = (kRoute ? st.kgt : st.k0t) + it.work * D * C;
    const float* k32 = st.khat32 + it.item * st.cap * D;
    for (std::int64_t j0 = lo; j0 < hi; j0 += kSlotPassTile) {
      const std::int64_t n = imin(kSlotPassTile, hi - j0), groups = (n + kSlotGroup - 1) / kSlotGroup;
      __syncthreads();
      if (D % 4 == 0) {  // rows j0 .. j0 + n are contiguous: 16-byte copies
        const float4* from = reinterpret_cast<const float4*>(k32 + j0 * D);
        for (std::int64_t e = threadIdx.x; e < n * D / 4; e += blockDim.x) reinterpret_cast<float4*>(tile)[e] = from[e];
      } else {
        for (std::int64_t e = threadIdx.x; e < n * D; e += blockDim.x) tile[e] = k32[j0 * D + e];
      }
      __syncthreads();
      // a warp takes consecutive tokens of one group: the group's rows are read as broadcasts, the
      // tokens' channels as one transaction each
      for (std::int64_t p = threadIdx.x; p < C * groups; p += blockDim.x) {
        const std::int64_t c = p % C, g0 = p / C * kSlotGroup;
        if (kRoute && skip[c]) continue;
        float dots[kSlotGroup];
        if (D % 4 == 0)
          slot_dot_group<true>(tile + g0 * D, D, xt + c, C, dots);
        else
          slot_dot_group<false>(tile + g0 * D, D, xt + c, C, dots);
        unsigned long long key = 0;
#pragma unroll
        for (int s = 0; s < kSlotGroup; ++s) {
          if (g0 + s >= n) break;
          const std::int64_t j = j0 + g0 + s;
          const unsigned long long k = kRoute ? slot_route_key(dots[s], j, j == st.sink) : slot_novelty_key(dots[s]);
          if (k > key) key = k;
        }
        if (key != 0) atomicMax(&best[c], key);
      }
    }
    __syncthreads();
    for (std::int64_t c = threadIdx.x; c < C; c += blockDim.x)
      if (best[c] != 0) atomicMax(&sc.key[it.work * C + c], best[c]);
  }
}

// Steps 2-3 from the merged novelty keys: thread c takes token c's score and rank (kernel::
// select_appends: score asc, index asc; appended when rank < n_app), then the appends in increasing
// token order, each with its LN_s row in khat32 for the routing pass; writes every token's target
// (-1 appended, else 0) and clears its key for the routing pass. grid min(R * Hk, ...), block
// slot_update_threads(C), smem slot_select_shared_bytes.
template <class S>
__global__ void __launch_bounds__(1024)
    slot_update_select_kernel(DeviceState<S, float> st, SlotCounters sc, SlotRows rows) {
  const std::int64_t items = slot_update_items(sc, st.Hk), C = st.C, D = st.D, Dv = st.Dv, W = st.W, cap = st.cap;
  extern __shared__ float slot_smem[];
  float* score = slot_smem;
  int* target = reinterpret_cast<int*>(score + C);
  const std::int64_t c = threadIdx.x;
  const bool mine = c < C;
  for (std::int64_t u = blockIdx.x; u < items; u += gridDim.x) {
    const SlotUpdateItem it = slot_update_item(st, sc, rows, u);
    const std::int64_t S0 = it.pl.s_before, n_app = it.pl.n_app;
    __syncthreads();  // the previous item's reads of score and target are done
    const float mine_score = mine && n_app > 0 ? slot_novelty_score(sc.key[it.work * C + c]) : 0.0f;
    if (mine) score[c] = mine_score;
    __syncthreads();
    if (mine) {
      std::int64_t rank = 0;
      if (n_app > 0)
        for (std::int64_t j = 0; j < C; ++j)
          rank += (score[j] < mine_score || (score[j] == mine_score && j < c)) ? 1 : 0;
      target[c] = n_app > 0 && rank < n_app ? -1 : 0;
    }
    __syncthreads();
    if (!mine) continue;
    if (target[c] == -1) {
      std::int64_t j = S0;
      for (std::int64_t i = 0; i < c; ++i) j += target[i] == -1 ? 1 : 0;
      const float* k0 = st.k0 + (it.work * C + c) * D;
      const float* kg = st.kg + (it.work * C + c) * D;
      const float* vg = st.vg + (it.work * C + c) * Dv;
      const Win<S>* vr = st.wv + (it.item * W + (it.pl.a + c) % W) * Dv;
      float* sk = st.sk + (it.item * cap + j) * D;
      float* sv = st.sv + (it.item * cap + j) * Dv;
      for (std::int64_t d = 0; d < D; ++d) sk[d] = st.gate_appends ? kg[d] : k0[d];
      for (std::int64_t d = 0; d < Dv; ++d) sv[d] = st.gate_appends ? vg[d] : rn_load(vr[d]);
      st.rho[it.item * cap + j] = rn_norm2(sv, Dv);
      st.cnt[it.item * cap + j] = 1.0f;
      rn_layer_norm(sk, D, st.ln_w, st.ln_b, st.eps, st.khat32 + (it.item * cap + j) * D);
    }
    st.target[it.work * C + c] = target[c];
    sc.key[it.work * C + c] = 0;
  }
}

// kernel::scatter_into_slot for slot j with one warp: the tokens routed to j (target[i] == j), in
// increasing token order, added to Sk_j and Sv_j, lanes over the channels (each channel's sum keeps
// the token order), cnt_j counted in the same order. The warp finds the tokens a warp of targets a ballot.
inline constexpr int kSlotScatterRegs = 8;  // channels a lane sums per sweep over the tokens

template <class S>
__device__ __forceinline__ void slot_scatter_warp(const DeviceState<S, float>& st, std::int64_t item, std::int64_t work,
                                                  const int* target, std::int64_t j, int lane) {
  const std::int64_t C = st.C, D = st.D, Dv = st.Dv, cap = st.cap;
  float* sk = st.sk + (item * cap + j) * D;
  float* sv = st.sv + (item * cap + j) * Dv;
  float cnt = st.cnt[item * cap + j];
  // channels [0, D) are Sk's, [D, D + Dv) Sv's
  for (std::int64_t c0 = 0; c0 < D + Dv; c0 += kWarpSize * kSlotScatterRegs) {
    float acc[kSlotScatterRegs];
#pragma unroll
    for (int e = 0; e < kSlotScatterRegs; ++e) {
      const std::int64_t ch = c0 + lane + kWarpSize * e;
      acc[e] = ch < D ? sk[ch] : ch < D + Dv ? sv[ch - D] : 0.0f;
    }
    for (std::int64_t i0 = 0; i0 < C; i0 += kWarpSize) {
      LaneMask hits = warp_ballot(i0 + lane < C && target[i0 + lane] == j);
      while (hits != 0) {  // in increasing token order
        const std::int64_t i = i0 + mask_ffs(hits) - 1;
        hits &= hits - 1;
        const float* kgi = st.kg + (work * C + i) * D;
        const float* vgi = st.vg + (work * C + i) * Dv;
#pragma unroll
        for (int e = 0; e < kSlotScatterRegs; ++e) {
          const std::int64_t ch = c0 + lane + kWarpSize * e;
          if (ch < D)
            acc[e] = __fadd_rn(acc[e], kgi[ch]);
          else if (ch < D + Dv)
            acc[e] = __fadd_rn(acc[e], vgi[ch - D]);
        }
        if (c0 == 0) cnt = __fadd_rn(cnt, 1.0f);
      }
    }
#pragma unroll
    for (int e = 0; e < kSlotScatterRegs; ++e) {
      const std::int64_t ch = c0 + lane + kWarpSize * e;
      if (ch < D)
        sk[ch] = acc[e];
      else if (ch < D + Dv)
        sv[ch - D] = acc[e];
    }
  }
  if (lane == 0) st.cnt[item * cap + j] = cnt;
}

// Step 4's scatter where some token merges (a token's route decoded from its merged key; a warp a
// slot), then K^, V^ of every slot from the sink on (rn_refresh, a thread a slot). Unit u is the range
// u % ranges of blockDim slots of item u / ranges; ranges covers the capacity (state shape).
// grid kSlotBlocksPerSm * SMs, block kSlotPassThreads, smem slot_finish_shared_bytes.
template <class S>
__global__ void __launch_bounds__(kSlotPassThreads)
    slot_update_finish_kernel(DeviceState<S, float> st, SlotCounters sc, SlotRows rows, std::int64_t ranges) {
  const std::int64_t items = slot_update_items(sc, st.Hk), C = st.C;
  extern __shared__ int slot_finish_smem[];
  int* target = slot_finish_smem;  // [C]
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize, warps = blockDim.x / kWarpSize;
  for (std::int64_t u = blockIdx.x; u < items * ranges; u += gridDim.x) {
    const SlotUpdateItem it = slot_update_item(st, sc, rows, u / ranges);
    const std::int64_t S1 = it.pl.s_after, first = st.sink + (u % ranges) * blockDim.x;
    if (first >= S1) continue;  // the same for every thread of the block
    const std::int64_t last = imin(S1, first + blockDim.x);
    if (it.pl.n_app < C) {
      __syncthreads();  // the previous unit's reads of target are done
      // the route of each token not appended, from its merged key (none: no candidate slot)
      for (std::int64_t i = threadIdx.x; i < C; i += blockDim.x) {
        const unsigned long long key = sc.key[it.work * C + i];
        target[i] = st.target[it.work * C + i] == -1 ? -1 : key == 0 ? 0 : slot_route_target(key);
      }
      __syncthreads();
      for (std::int64_t j = first + warp; j < last; j += warps)
        slot_scatter_warp(st, it.item, it.work, target, j, lane);
      __syncthreads();  // the range's sums are final
    }
    if (first + threadIdx.x < last) rn_refresh(st, it.item, first + threadIdx.x);
  }
}

// ---- ingest: the segment's tokens enter the ring; tokens below C found their slot ------------------

inline constexpr int kSlotIngestThreads = 128;

// grid SlotGrid::blocks, block kSlotIngestThreads (a warp per KV head). k [tokens,Hk,D], v [tokens,Hk,Dv],
// gate [tokens,Hk].
template <class S, class In>
__global__ void __launch_bounds__(kSlotIngestThreads)
    slot_ingest_kernel(DeviceState<S, float> st, SlotCounters sc, SlotRows rows, SlotGrid grid, const In* k,
                       const In* v, const In* gate) {
  if (sc.status[0] != kStepOk) return;
  const std::int64_t r = grid.row(rows, blockIdx.x);
  const std::int32_t b = rows.slot[r];
  if (b < 0) return;
  const SlotPlan pl = sc.plan[b];
  const std::int64_t token = grid.token(rows, r, pl, blockIdx.x);
  if (token < 0) return;
  const std::int64_t t = pl.n0 + token - rows.start[r];
  const std::int64_t D = st.D, Dv = st.Dv, W = st.W, Hk = st.Hk, ring = t % W;
  const int lane = threadIdx.x % kWarpSize;
  for (std::int64_t g = threadIdx.x / kWarpSize; g < Hk; g += kSlotIngestThreads / kWarpSize) {
    const std::int64_t item = std::int64_t(b) * Hk + g;
    Win<S>* wk = st.wk + (item * W + ring) * D;
    Win<S>* wv = st.wv + (item * W + ring) * Dv;
    const In* kr = k + (token * Hk + g) * D;
    const In* vr = v + (token * Hk + g) * Dv;
    for (std::int64_t d = lane; d < D; d += kWarpSize) wk[d] = store_as<Win<S>>(rn_load(kr[d]));
    for (std::int64_t d = lane; d < Dv; d += kWarpSize) wv[d] = store_as<Win<S>>(rn_load(vr[d]));
    const float gt = rn_load(gate[token * Hk + g]);
    if (lane == 0) st.wg[item * W + ring] = gt;
    warp_sync();
    if (lane == 0 && t >= pl.found_from && t < pl.found_to) {  // spec 4.3 init rule: slot j = t
      const std::int64_t j = t, cap = st.cap;
      float* sk = st.sk + (item * cap + j) * D;
      float* sv = st.sv + (item * cap + j) * Dv;
      for (std::int64_t d = 0; d < D; ++d) sk[d] = d < st.rope_dims ? 0.0f : rn_load(wk[d]);
      rn_layer_norm(sk, D, st.ln_w, st.ln_b, st.eps, sk);
      for (std::int64_t d = 0; d < Dv; ++d) sv[d] = rn_load(wv[d]);
      st.rho[item * cap + j] = rn_norm2(sv, Dv);
      st.cnt[item * cap + j] = 1.0f;
      if (st.gate_initial) {
        if (st.merge_gate_keys)
          for (std::int64_t d = 0; d < D; ++d) sk[d] = __fmul_rn(sk[d], gt);
        if (st.merge_gate_values)
          for (std::int64_t d = 0; d < Dv; ++d) sv[d] = __fmul_rn(sv[d], gt);
      }
      rn_refresh(st, item, j);
    }
  }
}

// ---- readout (spec 4.4): one block per (token, group of query heads) ---------------------------------

inline constexpr int kSlotReadoutWarps = 4;
inline constexpr int kSlotReadoutMaxRegs = 8;  // value channels per lane: Dv <= kWarpSize * kSlotReadoutMaxRegs

template <class A>
__device__ inline A slot_warp_max(A x) {
  for (int o = kWarpSize / 2; o > 0; o >>= 1) x = fmaxf(x, warp_shfl_xor(x, o));
  return x;
}

template <class A>
__device__ inline A slot_warp_sum(A x) {
  for (int o = kWarpSize / 2; o > 0; o >>= 1) x += warp_shfl_xor(x, o);
  return x;
}

// Element i of a vector of storage values loaded as 32-bit words (little-endian: a word holds two 16-bit
// values, low half first, or four 8-bit values, lowest byte first). An fp8 element is its stored value
// (the row's scale is the caller's).
template <class S>
__device__ inline float slot_word_element(const unsigned* w, int i) {
  if constexpr (sizeof(S) == 4)
    return __uint_as_float(w[i]);
  else if constexpr (sizeof(S) == 1)
    return ptx::e4m3_to_float(e4m3::from_bits(static_cast<std::uint8_t>(w[i / 4] >> (8 * (i % 4)))));
  else
    return rn_load(S::from_bits(static_cast<std::uint16_t>(w[i / 2] >> (16 * (i % 2)))));
}

// N consecutive storage values at p as floats, in 16-byte (or, for 8 bytes in all, 8-byte) loads; p
// aligned to the load. A lane that reads a whole row this way moves it in a few transactions instead of
// one per element.
template <int N, class S>
__device__ inline void slot_load_vec(const S* p, float (&x)[N]) {
  static_assert(sizeof(S) == 1 || sizeof(S) == 2 || sizeof(S) == 4, "slot_load_vec: 8-, 16- or 32-bit storage");
  constexpr int kBytes = N * int(sizeof(S));
  static_assert(kBytes % 16 == 0 || kBytes == 8 || kBytes == 4, "slot_load_vec: 4, 8 bytes or whole 16-byte vectors");
  if constexpr (kBytes == 4) {
    const unsigned w[1] = {*reinterpret_cast<const unsigned*>(p)};
#pragma unroll
    for (int i = 0; i < N; ++i) x[i] = slot_word_element<S>(w, i);
  } else if constexpr (kBytes == 8) {
    const uint2 raw = *reinterpret_cast<const uint2*>(p);
    const unsigned w[2] = {raw.x, raw.y};
#pragma unroll
    for (int i = 0; i < N; ++i) x[i] = slot_word_element<S>(w, i);
  } else {
    constexpr int kPer = 16 / int(sizeof(S));
#pragma unroll
    for (int v = 0; v < N / kPer; ++v) {
      const uint4 raw = reinterpret_cast<const uint4*>(p)[v];
      const unsigned w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
      for (int i = 0; i < kPer; ++i) x[v * kPer + i] = slot_word_element<S>(w, i);
    }
  }
}

// Dots of a key row kr (storage or window type) with kRep query rows qs [kRep, D], accumulated into dot in
// increasing channel order; the row read in vectors of 8 channels when D allows.
template <int kRep, class K>
__device__ inline void slot_key_dots(const K* kr, const float* qs, std::int64_t D, float (&dot)[kRep]) {
  if (D % 8 == 0) {  // the same products in the same order, the row read in vectors of 8 channels
#pragma unroll 4
    for (std::int64_t d = 0; d < D; d += 8) {
      float x[8];
      slot_load_vec<8>(kr + d, x);
#pragma unroll
      for (int c = 0; c < 8; ++c)
#pragma unroll
        for (int h = 0; h < kRep; ++h) dot[h] = fmaf(qs[h * D + d + c], x[c], dot[h]);
    }
  } else {
    for (std::int64_t d = 0; d < D; ++d) {
      const float x = rn_load(kr[d]);
#pragma unroll
      for (int h = 0; h < kRep; ++h) dot[h] = fmaf(qs[h * D + d], x, dot[h]);
    }
  }
}

// A lane's kRegs value channels of row vr (storage or window type) into x: channels lane kRegs + e in one
// vector load when vec_v, else lane + kWarpSize e; channels past Dv stay as they are (the caller zeroes).
template <int kRegs, class V>
__device__ inline void slot_value_row(const V* vr, std::int64_t Dv, bool vec_v, int lane, float (&x)[kRegs]) {
  if (vec_v) {
    if (lane * kRegs < Dv) slot_load_vec<kRegs>(vr + lane * kRegs, x);
  } else {
#pragma unroll
    for (int e = 0; e < kRegs; ++e)
      if (lane + kWarpSize * e < Dv) x[e] = rn_load(vr[lane + kWarpSize * e]);
  }
}

// The readout's launch shape, from the state's shape alone: kRep query heads of one KV head per block
// (every key row is read once for all of them), kRegs value channels per lane.
struct SlotReadoutShape {
  int rep, regs;
  [[nodiscard]] std::size_t shared_bytes(std::int64_t D, std::int64_t Dv) const {
    return (std::size_t(rep) * std::size_t(D) + kSlotReadoutWarps * std::size_t(rep) * (std::size_t(Dv) + 2)) *
           sizeof(float);
  }
};

// The largest power of two kRep <= 8 that divides the GQA ratio with kRep * kRegs <= 32 registers of
// accumulators a lane.
inline SlotReadoutShape slot_readout_shape(std::int64_t Hq, std::int64_t Hk, std::int64_t Dv) {
  const int regs = Dv <= 128 ? 4 : 8;
  int rep = 1;
  while (rep < 8 && (Hq / Hk) % (2 * rep) == 0 && 2 * rep * regs <= 32) rep *= 2;
  return {rep, regs};
}

// Rows (token, h) for the kRep query heads h of block (token, group) over the slots (when wb > 0) and the
// causal window [wb, t] in the ring, one online softmax per head: warp w takes keys [kWarpSize (w + 4 i), ...),
// lane l a key's logits (its key row read in 16-byte vectors) and value channels l kRegs + e (or l + kWarpSize e
// when Dv is not a multiple of kRegs); the four warps merge in a fixed order (deterministic). A padding row's out and
// lse are zeroed (zero_padding: the first phase). grid (SlotGrid::blocks, Hq / kRep), block kWarpSize *
// kSlotReadoutWarps, smem SlotReadoutShape::shared_bytes. q [tokens,Hq,D], out [tokens,Hq,Dv], lse [tokens,Hq] or
// nullptr.
template <class S, class In, class Out, int kRep, int kRegs>
__global__ void __launch_bounds__(kWarpSize* kSlotReadoutWarps)
    slot_readout_kernel(DeviceState<S, float> st, SlotCounters sc, SlotRows rows, SlotGrid grid, const In* q, Out* out,
                        float* lse, bool zero_padding) {
  if (sc.status[0] != kStepOk) return;
  const std::int64_t h0 = std::int64_t(blockIdx.y) * kRep, Hq = st.Hq, D = st.D, Dv = st.Dv, W = st.W;
  const std::int64_t r = grid.row(rows, blockIdx.x);
  const std::int32_t b = rows.slot[r];
  if (b < 0) {
    if (zero_padding) {
      std::int64_t first, end, step;
      grid.padding(rows, r, blockIdx.x, first, end, step);
      for (std::int64_t token = first; token < end; token += step) {
        for (std::int64_t i = threadIdx.x; i < kRep * Dv; i += blockDim.x)
          out[(token * Hq + h0) * Dv + i] = store_as<Out>(0.0f);
        if (lse != nullptr && threadIdx.x < kRep) lse[token * Hq + h0 + threadIdx.x] = 0.0f;
      }
    }
    return;
  }
  const SlotPlan pl = sc.plan[b];
  const std::int64_t token = grid.token(rows, r, pl, blockIdx.x);
  if (token < 0) return;
  const std::int64_t t = pl.n0 + token - rows.start[r];
  extern __shared__ float slot_smem[];
  float* qs = slot_smem;        // [kRep, D]
  float* part = qs + kRep * D;  // per warp and head: m, l, acc[Dv]
  for (std::int64_t i = threadIdx.x; i < kRep * D; i += blockDim.x) qs[i] = rn_load(q[(token * Hq + h0) * D + i]);
  __syncthreads();
  const std::int64_t item = std::int64_t(b) * st.Hk + h0 / st.rep();
  float ls_s[kRep], ls_w[kRep];
#pragma unroll
  for (int h = 0; h < kRep; ++h) {
    ls_s[h] = st.scale * (st.head_temps ? st.tau_s[h0 + h] : 1.0f);
    ls_w[h] = st.scale * (st.head_temps ? st.tau_w[h0 + h] : 1.0f);
  }
  const std::int64_t n_s = pl.wb > 0 ? pl.s_read : 0, n_keys = n_s + (t - pl.wb + 1);
  const S* khat = st.khat + item * st.cap * D;
  const S* vhat = st.vhat + item * st.cap * Dv;
  const Win<S>* wk = st.wk + item * W * D;
  const Win<S>* wv = st.wv + item * W * Dv;
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  // lane l holds value channels l kRegs .. l kRegs + kRegs - 1 (one vector load a key) when they split
  // evenly, else channels l + kWarpSize e
  const bool vec_v = Dv % kRegs == 0;
  float m[kRep], l[kRep], acc[kRep][kRegs];
#pragma unroll
  for (int h = 0; h < kRep; ++h) {
    m[h] = -INFINITY;
    l[h] = 0;
#pragma unroll
    for (int e = 0; e < kRegs; ++e) acc[h][e] = 0;
  }
  for (std::int64_t base = std::int64_t(warp) * kWarpSize; base < n_keys; base += kWarpSize * kSlotReadoutWarps) {
    const std::int64_t key = base + lane;
    float p[kRep];
#pragma unroll
    for (int h = 0; h < kRep; ++h) p[h] = -INFINITY;
    if (key < n_keys) {
      const bool slot = key < n_s;
      float dot[kRep] = {};
      if (slot)
        slot_key_dots<kRep>(khat + key * D, qs, D, dot);
      else
        slot_key_dots<kRep>(wk + ((pl.wb + key - n_s) % W) * D, qs, D, dot);
      // an fp8 slot row: the products were taken on its stored elements, its scale applies once
      const float ks = is_row_scaled_v<S> && slot ? st.khat_scale[item * st.cap + key] : 1.0f;
#pragma unroll
      for (int h = 0; h < kRep; ++h) p[h] = (slot ? ls_s[h] : ls_w[h]) * (dot[h] * ks);  // the logit, for now
    }
#pragma unroll
    for (int h = 0; h < kRep; ++h) {
      const float m_new = fmaxf(m[h], slot_warp_max(p[h]));
      const float keep = m[h] == -INFINITY ? 0.0f : expf(m[h] - m_new);
      p[h] = key < n_keys ? expf(p[h] - m_new) : 0.0f;
      l[h] = l[h] * keep + slot_warp_sum(p[h]);
#pragma unroll
      for (int e = 0; e < kRegs; ++e) acc[h][e] *= keep;
      m[h] = m_new;
    }
    // the values of the round's keys, kBatch rows loaded before they are used (loads in flight), each
    // channel still accumulated in increasing key order
    constexpr int kBatch = 32 / kRegs;  // value rows in registers: 32 floats a lane
    const std::int64_t count = imin(kWarpSize, n_keys - base);
    for (std::int64_t i0 = 0; i0 < count; i0 += kBatch) {
      float x[kBatch][kRegs];
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        const std::int64_t kk = base + i0 + u;
#pragma unroll
        for (int e = 0; e < kRegs; ++e) x[u][e] = 0.0f;
        if (i0 + u >= count) continue;
        if (kk < n_s) {
          slot_value_row<kRegs>(vhat + kk * Dv, Dv, vec_v, lane, x[u]);
          if constexpr (is_row_scaled_v<S>) {  // dequantised: scale x element is exact (a power of two)
            const float vs = st.vhat_scale[item * st.cap + kk];
#pragma unroll
            for (int e = 0; e < kRegs; ++e) x[u][e] *= vs;
          }
        } else {
          slot_value_row<kRegs>(wv + ((pl.wb + kk - n_s) % W) * Dv, Dv, vec_v, lane, x[u]);
        }
      }
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        if (i0 + u >= count) break;  // the same for every lane
#pragma unroll
        for (int h = 0; h < kRep; ++h) {
          const float pi = warp_shfl(p[h], static_cast<int>(i0 + u));
#pragma unroll
          for (int e = 0; e < kRegs; ++e) acc[h][e] = fmaf(pi, x[u][e], acc[h][e]);
        }
      }
    }
  }
#pragma unroll
  for (int h = 0; h < kRep; ++h) {
    float* mine = part + (warp * kRep + h) * (Dv + 2);
    if (lane == 0) {
      mine[0] = m[h];
      mine[1] = l[h];
    }
#pragma unroll
    for (int e = 0; e < kRegs; ++e) {
      const std::int64_t ch = vec_v ? lane * kRegs + e : lane + kWarpSize * e;
      if (ch < Dv) mine[2 + ch] = acc[h][e];
    }
  }
  __syncthreads();
  for (int h = 0; h < kRep; ++h) {
    float M = -INFINITY, L = 0;
    for (int w = 0; w < kSlotReadoutWarps; ++w) M = fmaxf(M, part[(w * kRep + h) * (Dv + 2)]);
    for (int w = 0; w < kSlotReadoutWarps; ++w) {
      const float mw = part[(w * kRep + h) * (Dv + 2)];
      if (mw != -INFINITY) L += part[(w * kRep + h) * (Dv + 2) + 1] * expf(mw - M);
    }
    Out* o = out + (token * Hq + h0 + h) * Dv;
    for (std::int64_t d = threadIdx.x; d < Dv; d += blockDim.x) {
      float x = 0;
      for (int w = 0; w < kSlotReadoutWarps; ++w) {
        const float mw = part[(w * kRep + h) * (Dv + 2)];
        if (mw != -INFINITY) x += part[(w * kRep + h) * (Dv + 2) + 2 + d] * expf(mw - M);
      }
      o[d] = store_as<Out>(x / L);
    }
    if (lse != nullptr && threadIdx.x == 0) lse[token * Hq + h0 + h] = M + logf(L);
  }
}

// ---- slot operations -----------------------------------------------------------------------------

// The lists of reset_slots and copy_slots are in device memory and checked by
// slot_lists::slot_list_check_kernel, the operation's first launch; each launch below does nothing when
// the status word holds a refusal (that list's, or one not yet read), so a refused list changes nothing.

// reset_slots: n = cov = |S| = 0 for slots[0, n) (a slot listed twice is zeroed twice).
template <class = void>
__global__ void slot_reset_kernel(SlotCounters sc, const std::int32_t* slots, std::int64_t n) {
  if (slot_lists::refused(sc.status)) return;
  for (std::int64_t i = blockIdx.x * std::int64_t(blockDim.x) + threadIdx.x; i < n;
       i += std::int64_t(gridDim.x) * blockDim.x)
    sc.n[slots[i]] = sc.cov[slots[i]] = sc.slots[slots[i]] = 0;
}

// The per-slot parts of the state's arrays that copy_slots copies: region r holds bytes[r] bytes per
// slot at base[r] + slot * bytes[r] (every array keeps a slot's KV heads together), moved in words of
// unit[r] bytes (16, 4, 2 or 1: a divisor of bytes[r] and of base[r]'s alignment, so every slot's region
// is aligned to its words).
inline constexpr int kSlotRegionsMax = 12;  // fp8 storage adds the two row-scale arrays
struct SlotRegions {
  unsigned char* base[kSlotRegionsMax];
  std::size_t bytes[kSlotRegionsMax];
  int unit[kSlotRegionsMax];
  int count;
};
inline constexpr int kSlotCopyThreads = 256;

template <class Word>
__device__ inline void slot_copy_words(unsigned char* base, std::size_t bytes, std::int64_t from, std::int64_t to,
                                       std::size_t first, std::size_t step) {
  const Word* a = reinterpret_cast<const Word*>(base + std::size_t(from) * bytes);
  Word* b = reinterpret_cast<Word*>(base + std::size_t(to) * bytes);
  for (std::size_t w = first; w < bytes / sizeof(Word); w += step) b[w] = a[w];
}

// copy_slots: grid (x, pairs): the blocks of grid row y copy pairs y, y + gridDim.y, ...: every region
// of slot src[p] into slot dst[p], and block 0 of the row the counters. No destination is the source of
// another pair (the check), so no block reads what another writes; a pair whose slots are equal is
// left alone.
template <class = void>
__global__ void __launch_bounds__(kSlotCopyThreads)
    slot_copy_kernel(SlotCounters sc, SlotRegions r, const std::int32_t* src, const std::int32_t* dst, std::int64_t n) {
  if (slot_lists::refused(sc.status)) return;
  const std::size_t first = std::size_t(blockIdx.x) * blockDim.x + threadIdx.x,
                    step = std::size_t(gridDim.x) * blockDim.x;
  for (std::int64_t p = blockIdx.y; p < n; p += gridDim.y) {
    const std::int64_t a = src[p], b = dst[p];
    if (a == b) continue;
    for (int k = 0; k < r.count; ++k) {
      switch (r.unit[k]) {
        case 16:
          slot_copy_words<uint4>(r.base[k], r.bytes[k], a, b, first, step);
          break;
        case 4:
          slot_copy_words<unsigned>(r.base[k], r.bytes[k], a, b, first, step);
          break;
        case 2:
          slot_copy_words<unsigned short>(r.base[k], r.bytes[k], a, b, first, step);
          break;
        default:
          slot_copy_words<unsigned char>(r.base[k], r.bytes[k], a, b, first, step);
      }
    }
    if (first == 0) {
      sc.n[b] = sc.n[a];
      sc.cov[b] = sc.cov[a];
      sc.slots[b] = sc.slots[a];
    }
  }
}

// Sets the counters of slots [first, first + count) (truncate, import, and the switch from the
// fixed-batch calls' shared count to per-slot counters).
__global__ void slot_set_counters_kernel(SlotCounters sc, std::int64_t first, std::int64_t count, std::int64_t n,
                                         std::int64_t cov, std::int64_t slots) {
  for (std::int64_t i = threadIdx.x; i < count; i += blockDim.x) {
    sc.n[first + i] = n;
    sc.cov[first + i] = cov;
    sc.slots[first + i] = slots;
  }
}

// LN_s(Sk_j) into khat32 for slots [0, count) of every item (the first step after fixed-batch calls,
// whose kernels keep khat32 in their own rounding or not at all). grid items, block 128.
template <class S>
__global__ void slot_khat32_kernel(DeviceState<S, float> st, std::int64_t count) {
  const std::int64_t item = blockIdx.x;
  for (std::int64_t j = threadIdx.x; j < count; j += blockDim.x)
    rn_layer_norm(st.sk + (item * st.cap + j) * st.D, st.D, st.ln_w, st.ln_b, st.eps,
                  st.khat32 + (item * st.cap + j) * st.D);
}

// K^, V^ of slots [0, count) of slot b's items (import_slot). grid Hk, block 128.
template <class S>
__global__ void slot_refresh_kernel(DeviceState<S, float> st, std::int64_t b, std::int64_t count) {
  const std::int64_t item = b * st.Hk + blockIdx.x;
  for (std::int64_t j = threadIdx.x; j < count; j += blockDim.x) rn_refresh(st, item, j);
}

}  // namespace kvmem::cuda::kvm_detail
