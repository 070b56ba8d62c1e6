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
// position C, then it attends). P bounds the segments of the longest possible row, from the packed
// token count alone; a row with fewer segments idles in the later phases.
//
// The state update mirrors the host backend's exact path operation by operation (kernel/kvm_state.hpp
// bodies, written here with explicitly rounded products and sums so nvcc contracts nothing into an
// FMA): a slot's memory slots, routes and counters equal the host's bit for bit. The readout is an
// online softmax over [slots | window] whose sum order differs from the host's (fp32 rounding).
//
// A step's rows are checked on the device (plan, phase 0). A refused step changes nothing; the reason
// stays in the state's status word (sticky: later steps are refused too) until KvmState::step_status
// reads and clears it.

#include "kvmem/backend/cuda/vendor.cuh"

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "kvmem/backend/cuda/kvm_kernels.cuh"
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

// Why a step was refused (the status word's first element).
enum SlotStepError : int {
  kStepOk = 0,
  kStepBadStart = 1,    // query_start[0] != 0 or a start decreases
  kStepBadSlot = 2,     // slot outside [-1, max_slots)
  kStepDuplicate = 3,   // a slot named by two rows
  kStepTooLong = 4,     // n + tokens > n_ctx
  kStepTokenCount = 5,  // query_start[rows] != the packed token count
};

// The per-slot counters and step bookkeeping in device memory, passed by value to the kernels.
struct SlotCounters {
  std::int64_t* n;                    // [B] tokens seen
  std::int64_t* cov;                  // [B] tokens summarised
  std::int64_t* slots;                // [B] |S|
  SlotPlan* plan;                     // [B] (workspace: rewritten by every phase of a step)
  int* seen;                          // [B] stamp of the last step whose rows named the slot (duplicate check)
  int* status;                        // [4] error code, row, value, step stamp
  const std::int64_t* update_target;  // [updates]: budget target of update u (first token u C), spec 3.1
  std::int64_t B, n_ctx;
};

// The rows of a step in device memory: slot [R], query_start [R + 1].
struct SlotRows {
  const std::int32_t* slot;
  const std::int32_t* start;
  std::int64_t R;
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

// K^_j = LN_s(Sk_j) and V^_j of slot j of an item (spec 4.4 steps 1-2), one thread.
template <class S>
__device__ inline void rn_refresh(const DeviceState<S, float>& st, std::int64_t item, std::int64_t j) {
  const std::int64_t D = st.D, Dv = st.Dv;
  const float* sk = st.sk + (item * st.cap + j) * D;
  const float* sv = st.sv + (item * st.cap + j) * Dv;
  rn_layer_norm(sk, D, st.ln_w, st.ln_b, st.eps, st.khat + (item * st.cap + j) * D);
  float f;
  if (st.value_radius) {
    float nrm = rn_norm2(sv, Dv);
    if (nrm < 1e-12f) nrm = 1e-12f;
    f = __fdiv_rn(st.rho[item * st.cap + j], nrm);
  } else {
    f = __fdiv_rn(1.0f, st.cnt[item * st.cap + j]);
  }
  S* vhat = st.vhat + (item * st.cap + j) * Dv;
  for (std::int64_t d = 0; d < Dv; ++d) vhat[d] = store_as<S>(__fmul_rn(sv[d], f));
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

// ---- plan: validation (phase 0) and the per-slot segment of a phase ------------------------------

inline constexpr int kPlanThreads = 256;

// One block. Phase 0 first checks every row (refusing the whole step on the first bad one, before any
// counter changes) and snapshots n; every phase then takes each row's p-th chunk segment: the update
// before it (spec 4.7 step 4: cov < bswa_begin(t0 + 1)), its initial slots, and advances cov and |S|.
__global__ void __launch_bounds__(kPlanThreads)
    slot_plan_kernel(SlotCounters sc, SlotRows rows, std::int64_t tokens, std::int64_t C, std::int64_t W, int phase) {
  __shared__ unsigned long long first_error;
  __shared__ int refused;
  const int tid = threadIdx.x;
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
    }
    if (tid == 0 && rows.start[rows.R] != tokens) fail(kStepTokenCount, rows.R, rows.start[rows.R]);
    __syncthreads();
    if (tid == 0) {
      sc.status[3] = stamp;  // every step takes a new stamp, refused or not, so no stale stamp matches
      if (first_error != ~0ull) {
        sc.status[0] = static_cast<int>((first_error >> 32) & 0xff);
        sc.status[1] = static_cast<int>(first_error >> 40);
        sc.status[2] = static_cast<int>(first_error & 0xffffffffull);
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
}

// ---- update (spec 4.5), one block per (row, KV head) -----------------------------------------------

inline constexpr int kSlotLnRows = 32;  // slots whose LN_s rows a block stages per tile

inline std::size_t slot_update_shared_bytes(std::int64_t C, std::int64_t D) {
  return std::size_t(C) * (sizeof(float) + sizeof(int)) + std::size_t(kSlotLnRows * D) * sizeof(float);
}

inline unsigned slot_update_threads(std::int64_t C) {
  return static_cast<unsigned>(std::max<std::int64_t>(64, (C + kWarpSize - 1) / kWarpSize * kWarpSize));
}

// Stages LN_s(Sk_j) of slots [j0, j0 + n) into rows (one thread a slot); the caller syncs around it.
template <class S>
__device__ inline void stage_ln_rows(const DeviceState<S, float>& st, std::int64_t item, std::int64_t j0,
                                     std::int64_t n, float* rows) {
  if (threadIdx.x < n)
    rn_layer_norm(st.sk + (item * st.cap + j0 + threadIdx.x) * st.D, st.D, st.ln_w, st.ln_b, st.eps,
                  rows + threadIdx.x * st.D);
}

// The update of the host's exact path (backend/host/kvm.hpp, Call::update) on the block's item: token
// c is thread c (blockDim >= C; chunks up to 1024, the backend's limit). grid R * Hk, block slot_update_threads(C),
// smem slot_update_shared_bytes.
template <class S>
__global__ void __launch_bounds__(1024) slot_update_kernel(DeviceState<S, float> st, SlotCounters sc, SlotRows rows) {
  const std::int64_t r = blockIdx.x / st.Hk, g = blockIdx.x % st.Hk;
  if (sc.status[0] != kStepOk) return;
  const std::int32_t b = rows.slot[r];
  if (b < 0) return;
  const SlotPlan pl = sc.plan[b];
  if (pl.t0 >= pl.t1 || pl.a < 0) return;
  extern __shared__ float slot_smem[];
  const std::int64_t C = st.C, D = st.D, Dv = st.Dv, W = st.W, cap = st.cap, item = std::int64_t(b) * st.Hk + g;
  // the update scratch (k0, kg, vg) belongs to the work item (row r, head g), not to the slot: a step's
  // workspace holds as many items as the step has rows
  const std::int64_t work = std::int64_t(blockIdx.x);
  float* score = slot_smem;
  int* target = reinterpret_cast<int*>(score + C);
  float* ln_rows = reinterpret_cast<float*>(target + C);
  const std::int64_t c = threadIdx.x;
  const bool mine = c < C;
  float* k0 = st.k0 + (work * C + c) * D;
  float* kg = st.kg + (work * C + c) * D;
  float* vg = st.vg + (work * C + c) * Dv;
  const std::int64_t ring = (pl.a + c) % W;
  const S* kr = st.wk + (item * W + ring) * D;
  const S* vr = st.wv + (item * W + ring) * Dv;
  // step 1: k0, kg, vg of token c
  if (mine) {
    const float gate = st.wg[item * W + ring];
    for (std::int64_t d = 0; d < D; ++d) k0[d] = d < st.rope_dims ? 0.0f : rn_load(kr[d]);
    rn_layer_norm(k0, D, st.ln_w, st.ln_b, st.eps, k0);
    for (std::int64_t d = 0; d < D; ++d) kg[d] = st.merge_gate_keys ? __fmul_rn(gate, k0[d]) : k0[d];
    for (std::int64_t d = 0; d < Dv; ++d)
      vg[d] = st.merge_gate_values ? __fmul_rn(gate, rn_load(vr[d])) : rn_load(vr[d]);
  }
  const std::int64_t S0 = pl.s_before, S1 = pl.s_after, n_app = pl.n_app;
  // step 2: novelty against the pre-update slots (sink included), appends by rank
  if (n_app > 0) {
    float best = -INFINITY;
    for (std::int64_t j0 = 0; j0 < S0; j0 += kSlotLnRows) {
      const std::int64_t n = imin(kSlotLnRows, S0 - j0);
      __syncthreads();
      stage_ln_rows(st, item, j0, n, ln_rows);
      __syncthreads();
      if (mine)
        for (std::int64_t i = 0; i < n; ++i) {
          const float s = rn_dot(ln_rows + i * D, k0, D);
          if (s > best) best = s;
        }
    }
    if (mine) score[c] = best;
    __syncthreads();
    if (mine) {  // kernel::select_appends: rank in (score asc, index asc)
      std::int64_t rank = 0;
      for (std::int64_t j = 0; j < C; ++j) rank += (score[j] < best || (score[j] == best && j < c)) ? 1 : 0;
      target[c] = rank < n_app ? -1 : 0;
    }
  } else if (mine) {
    target[c] = 0;
  }
  __syncthreads();
  // step 3: appends in increasing token order
  if (mine && target[c] == -1) {
    std::int64_t j = S0;
    for (std::int64_t i = 0; i < c; ++i) j += target[i] == -1 ? 1 : 0;
    float* sk = st.sk + (item * cap + j) * D;
    float* sv = st.sv + (item * cap + j) * Dv;
    for (std::int64_t d = 0; d < D; ++d) sk[d] = st.gate_appends ? kg[d] : k0[d];
    for (std::int64_t d = 0; d < Dv; ++d) sv[d] = st.gate_appends ? vg[d] : rn_load(vr[d]);
    st.rho[item * cap + j] = rn_norm2(sv, Dv);
    st.cnt[item * cap + j] = 1.0f;
  }
  // step 4: routes against K^+ of the expanded state (ties keep the smaller j), then the scatter
  if (n_app < C) {
    float best = -INFINITY;
    int to = mine ? target[c] : -1;
    for (std::int64_t j0 = st.sink; j0 < S1; j0 += kSlotLnRows) {
      const std::int64_t n = imin(kSlotLnRows, S1 - j0);
      __syncthreads();
      stage_ln_rows(st, item, j0, n, ln_rows);
      __syncthreads();
      if (mine && to != -1)
        for (std::int64_t i = 0; i < n; ++i) {
          const float l = rn_dot(ln_rows + i * D, kg, D);
          if ((j0 == st.sink && i == 0) || l > best) {
            best = l;
            to = static_cast<int>(j0 + i);
          }
        }
    }
    __syncthreads();
    if (mine) target[c] = to;
    __syncthreads();
    for (std::int64_t j = st.sink + threadIdx.x; j < S1; j += blockDim.x) {  // kernel::scatter_into_slot
      float* sk = st.sk + (item * cap + j) * D;
      float* sv = st.sv + (item * cap + j) * Dv;
      float cnt = st.cnt[item * cap + j];
      for (std::int64_t i = 0; i < C; ++i) {
        if (target[i] != j) continue;
        const float* kgi = st.kg + (work * C + i) * D;
        const float* vgi = st.vg + (work * C + i) * Dv;
        for (std::int64_t d = 0; d < D; ++d) sk[d] = __fadd_rn(sk[d], kgi[d]);
        for (std::int64_t d = 0; d < Dv; ++d) sv[d] = __fadd_rn(sv[d], vgi[d]);
        cnt = __fadd_rn(cnt, 1.0f);
      }
      st.cnt[item * cap + j] = cnt;
    }
  }
  __syncthreads();
  for (std::int64_t j = st.sink + threadIdx.x; j < S1; j += blockDim.x) rn_refresh(st, item, j);
}

// ---- ingest: the segment's tokens enter the ring; tokens below C found their slot ------------------

inline constexpr int kSlotIngestThreads = 128;

// grid tokens, block kSlotIngestThreads (a warp per KV head). k [tokens,Hk,D], v [tokens,Hk,Dv],
// gate [tokens,Hk].
template <class S, class In>
__global__ void __launch_bounds__(kSlotIngestThreads)
    slot_ingest_kernel(DeviceState<S, float> st, SlotCounters sc, SlotRows rows, const In* k, const In* v,
                       const In* gate) {
  if (sc.status[0] != kStepOk) return;
  const std::int64_t token = blockIdx.x, r = slot_row_of(rows, token);
  const std::int32_t b = rows.slot[r];
  if (b < 0) return;
  const SlotPlan pl = sc.plan[b];
  const std::int64_t t = pl.n0 + token - rows.start[r];
  if (t < pl.t0 || t >= pl.t1) return;
  const std::int64_t D = st.D, Dv = st.Dv, W = st.W, Hk = st.Hk, ring = t % W;
  const int lane = threadIdx.x % kWarpSize;
  for (std::int64_t g = threadIdx.x / kWarpSize; g < Hk; g += kSlotIngestThreads / kWarpSize) {
    const std::int64_t item = std::int64_t(b) * Hk + g;
    S* wk = st.wk + (item * W + ring) * D;
    S* wv = st.wv + (item * W + ring) * Dv;
    const In* kr = k + (token * Hk + g) * D;
    const In* vr = v + (token * Hk + g) * Dv;
    for (std::int64_t d = lane; d < D; d += kWarpSize) wk[d] = store_as<S>(rn_load(kr[d]));
    for (std::int64_t d = lane; d < Dv; d += kWarpSize) wv[d] = store_as<S>(rn_load(vr[d]));
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
// lane l a key's logits and value channels l + kWarpSize e; the four warps merge in a fixed order
// (deterministic). A padding row's out and lse are zeroed (zero_padding: the first phase).
// grid (tokens, Hq / kRep), block kWarpSize * kSlotReadoutWarps, smem SlotReadoutShape::shared_bytes.
// q [tokens,Hq,D], out [tokens,Hq,Dv], lse [tokens,Hq] or nullptr.
template <class S, class In, class Out, int kRep, int kRegs>
__global__ void __launch_bounds__(kWarpSize* kSlotReadoutWarps)
    slot_readout_kernel(DeviceState<S, float> st, SlotCounters sc, SlotRows rows, const In* q, Out* out, float* lse,
                        bool zero_padding) {
  if (sc.status[0] != kStepOk) return;
  const std::int64_t token = blockIdx.x, h0 = std::int64_t(blockIdx.y) * kRep, Hq = st.Hq, D = st.D, Dv = st.Dv,
                     W = st.W;
  const std::int64_t r = slot_row_of(rows, token);
  const std::int32_t b = rows.slot[r];
  if (b < 0) {
    if (zero_padding) {
      for (std::int64_t i = threadIdx.x; i < kRep * Dv; i += blockDim.x)
        out[(token * Hq + h0) * Dv + i] = store_as<Out>(0.0f);
      if (lse != nullptr && threadIdx.x < kRep) lse[token * Hq + h0 + threadIdx.x] = 0.0f;
    }
    return;
  }
  const SlotPlan pl = sc.plan[b];
  const std::int64_t t = pl.n0 + token - rows.start[r];
  if (t < pl.t0 || t >= pl.t1) return;
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
  const S* wk = st.wk + item * W * D;
  const S* wv = st.wv + item * W * Dv;
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
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
      const S* kr = slot ? khat + key * D : wk + ((pl.wb + key - n_s) % W) * D;
      float dot[kRep] = {};
      for (std::int64_t d = 0; d < D; ++d) {
        const float x = rn_load(kr[d]);
#pragma unroll
        for (int h = 0; h < kRep; ++h) dot[h] = fmaf(qs[h * D + d], x, dot[h]);
      }
#pragma unroll
      for (int h = 0; h < kRep; ++h) p[h] = (slot ? ls_s[h] : ls_w[h]) * dot[h];  // the logit, for now
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
    const std::int64_t count = imin(kWarpSize, n_keys - base);
    for (std::int64_t i = 0; i < count; ++i) {
      const std::int64_t kk = base + i;
      const S* vr = kk < n_s ? vhat + kk * Dv : wv + ((pl.wb + kk - n_s) % W) * Dv;
      float x[kRegs];
#pragma unroll
      for (int e = 0; e < kRegs; ++e) x[e] = lane + kWarpSize * e < Dv ? rn_load(vr[lane + kWarpSize * e]) : 0.0f;
#pragma unroll
      for (int h = 0; h < kRep; ++h) {
        const float pi = warp_shfl(p[h], static_cast<int>(i));
#pragma unroll
        for (int e = 0; e < kRegs; ++e) acc[h][e] = fmaf(pi, x[e], acc[h][e]);
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
    for (int e = 0; e < kRegs; ++e)
      if (lane + kWarpSize * e < Dv) mine[2 + lane + kWarpSize * e] = acc[h][e];
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

// A list of slots passed by value (a captured operation replays the same list).
inline constexpr int kSlotListMax = 64;
struct SlotList {
  int count;
  std::int32_t a[kSlotListMax], b[kSlotListMax];
};

// reset_slots: n = cov = |S| = 0 for slots a[0, count).
__global__ void slot_reset_kernel(SlotCounters sc, SlotList list) {
  for (int i = threadIdx.x; i < list.count; i += blockDim.x)
    sc.n[list.a[i]] = sc.cov[list.a[i]] = sc.slots[list.a[i]] = 0;
}

// copy_slots: the counters of b[i] become those of a[i] (the memory is copied beside it).
__global__ void slot_copy_counters_kernel(SlotCounters sc, SlotList list) {
  for (int i = threadIdx.x; i < list.count; i += blockDim.x) {
    sc.n[list.b[i]] = sc.n[list.a[i]];
    sc.cov[list.b[i]] = sc.cov[list.a[i]];
    sc.slots[list.b[i]] = sc.slots[list.a[i]];
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

// K^, V^ of slots [0, count) of slot b's items (import_slot). grid Hk, block 128.
template <class S>
__global__ void slot_refresh_kernel(DeviceState<S, float> st, std::int64_t b, std::int64_t count) {
  const std::int64_t item = b * st.Hk + blockIdx.x;
  for (std::int64_t j = threadIdx.x; j < count; j += blockDim.x) rn_refresh(st, item, j);
}

}  // namespace kvmem::cuda::kvm_detail
