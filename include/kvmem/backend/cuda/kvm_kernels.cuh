// SPDX-License-Identifier: Apache-2.0
#pragma once
// CUDA kernels of the KVM backend. The math comes from the shared bodies in kernel/ (key
// preprocessing, LN_s, value readout, online softmax); this file only decides where they run:
// one block per (sequence, KV head) item for the state update, tiles of slots/keys in shared
// memory, and a split-K decode. Deterministic: no float atomics, every reduction has a fixed order.

#include <cuda_runtime.h>

#include <cstdint>

#include "kvmem/core/numeric.hpp"
#include "kvmem/core/softmax.hpp"
#include "kvmem/kernel/kvm_state.hpp"

namespace kvmem::cuda::kvm_detail {

// Device pointers and sizes of a KvmState, passed by value to every kernel. Item i = b*Hk + g.
template <class S, class A>
struct DeviceState {
  A* sk;      // [I, cap, D]  raw summed keys
  A* sv;      // [I, cap, Dv] raw summed values
  A* rho;     // [I, cap]
  A* cnt;     // [I, cap]
  A* khat32;  // [I, cap, D]  LN_s(Sk) in the accumulate type (routing reads it, as the host does)
  S* khat;    // [I, cap, D]  readout keys (storage type)
  S* vhat;    // [I, cap, Dv] readout values (storage type)
  S* wk;      // [I, W, D]    window ring, position p at p mod W
  S* wv;      // [I, W, Dv]
  A* wg;      // [I, W]
  A* k0;      // [I, C, D]    update workspace
  A* k0t;     // [I, D, C]    the same, transposed (coalesced reads across tokens)
  A* kgt;     // [I, D, C]    gated keys, transposed
  A* vg;      // [I, C, Dv]
  A* kg;      // [I, C, D]
  A* score;   // [I, C]
  int* target;  // [I, C]  -1 appended, else merge slot
  A* partial;   // [B*Hq, max_splits, Dv + 1] decode split results (o, lse)
  const A* ln_w;   // [D]   caller's device weights, read in place (no per-call copy)
  const A* ln_b;   // [D]
  const A* tau_s;  // [Hq]
  const A* tau_w;  // [Hq]
  std::int64_t cap, C, W, D, Dv, Hq, Hk, sink, rope_dims, max_splits;
  A eps, scale;
  bool merge_gate_keys, merge_gate_values, head_temps, value_radius, gate_appends, gate_initial;

  __device__ std::int64_t rep() const { return Hq / Hk; }
};

// K^_j, V^_j of slot j of item i from its sums (spec 4.4 steps 1-2); one thread.
template <class S, class A>
__device__ void refresh_slot(const DeviceState<S, A>& st, std::int64_t i, std::int64_t j) {
  A* k32 = st.khat32 + (i * st.cap + j) * st.D;
  kernel::layer_norm(st.sk + (i * st.cap + j) * st.D, st.D, st.ln_w, st.ln_b, st.eps, k32);
  S* kh = st.khat + (i * st.cap + j) * st.D;
  for (std::int64_t d = 0; d < st.D; ++d) kh[d] = store_as<S>(k32[d]);
  const std::int64_t sj = i * st.cap + j;
  kernel::value_readout(st.sv + sj * st.Dv, st.Dv, st.rho[sj], st.cnt[sj], st.value_radius, st.vhat + sj * st.Dv);
}

// Sum over the 32 lanes of a warp with xor shuffles: a fixed order, every lane gets the same value.
template <class A>
__device__ A warp_sum(A x) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) x += __shfl_xor_sync(0xffffffffu, x, off);
  return x;
}

// LN_s (spec 4.2 step 2) with the D channels split over the lanes of a warp: the same formula as
// kernel::layer_norm, reduced in parallel. Lane l reads and writes only channels l, l+32, ..., so
// y may alias x.
template <class A, class X>
__device__ void warp_layer_norm(const X* x, std::int64_t D, const A* w, const A* b, A eps, A* y, int lane) {
  A sum = A(0);
  for (std::int64_t d = lane; d < D; d += 32) sum += load_as<A>(x[d]);
  const A mean = warp_sum(sum) / static_cast<A>(D);
  A var = A(0);
  for (std::int64_t d = lane; d < D; d += 32) {
    const A c = load_as<A>(x[d]) - mean;
    var += c * c;
  }
  const A inv = A(1) / sqrt(warp_sum(var) / static_cast<A>(D) + eps);
  for (std::int64_t d = lane; d < D; d += 32) y[d] = w[d] * ((load_as<A>(x[d]) - mean) * inv) + b[d];
}

// refresh_slot with a warp: K^_j = LN_s(Sk_j) into khat32/khat, V^_j (spec 4.4 steps 1-2).
template <class S, class A>
__device__ void warp_refresh_slot(const DeviceState<S, A>& st, std::int64_t i, std::int64_t j, int lane) {
  const std::int64_t sj = i * st.cap + j;
  A* k32 = st.khat32 + sj * st.D;
  warp_layer_norm(st.sk + sj * st.D, st.D, st.ln_w, st.ln_b, st.eps, k32, lane);
  for (std::int64_t d = lane; d < st.D; d += 32) st.khat[sj * st.D + d] = store_as<S>(k32[d]);
  const A* sv = st.sv + sj * st.Dv;
  A f;
  if (st.value_radius) {
    A sq = A(0);
    for (std::int64_t d = lane; d < st.Dv; d += 32) sq += sv[d] * sv[d];
    A n = sqrt(warp_sum(sq));
    if (n < A(1e-12)) n = A(1e-12);
    f = st.rho[sj] / n;
  } else {
    f = A(1) / st.cnt[sj];
  }
  for (std::int64_t d = lane; d < st.Dv; d += 32) st.vhat[sj * st.Dv + d] = store_as<S>(sv[d] * f);
}

inline constexpr int kWarpsPerBlock = 8;  // update kernels that give each token or slot a warp

// Tokens [t0, t1) enter the window ring; tokens below C that the state has not covered found their
// slot j = t (spec 4.3; before the first update |S| equals the position). grid (I, t1 - t0).
// k: [B,Hk,T,D], v: [B,Hk,T,Dv], gate: [B,Hk,T] (local token index t - n0)
template <class S, class A, class In>
__global__ void ingest_kernel(DeviceState<S, A> st, const In* k, const In* v, const In* gate, std::int64_t T,
                              std::int64_t n0, std::int64_t t0, std::int64_t cov) {
  const std::int64_t i = blockIdx.x, t = t0 + blockIdx.y, ring = t % st.W;
  const std::int64_t local = (i * T + (t - n0));
  S* wk = st.wk + (i * st.W + ring) * st.D;
  S* wv = st.wv + (i * st.W + ring) * st.Dv;
  for (std::int64_t d = threadIdx.x; d < st.D; d += blockDim.x) wk[d] = store_as<S>(load_as<A>(k[local * st.D + d]));
  for (std::int64_t d = threadIdx.x; d < st.Dv; d += blockDim.x) wv[d] = store_as<S>(load_as<A>(v[local * st.Dv + d]));
  if (threadIdx.x == 0) st.wg[i * st.W + ring] = load_as<A>(gate[local]);
  __syncthreads();
  if (threadIdx.x != 0 || t >= st.C || t < cov) return;
  // init rule (spec 4.3), read back from the ring so every backend founds slots from the stored k, v
  const std::int64_t sj = i * st.cap + t;
  A* sk = st.sk + sj * st.D;
  A* sv = st.sv + sj * st.Dv;
  kernel::preprocess_key(wk, st.D, st.rope_dims, st.ln_w, st.ln_b, st.eps, sk);
  for (std::int64_t d = 0; d < st.Dv; ++d) sv[d] = load_as<A>(wv[d]);
  st.rho[sj] = kernel::norm2<A>(sv, st.Dv);
  st.cnt[sj] = A(1);
  if (st.gate_initial) {
    const A g = st.wg[i * st.W + ring];
    if (st.merge_gate_keys)
      for (std::int64_t d = 0; d < st.D; ++d) sk[d] *= g;
    if (st.merge_gate_values)
      for (std::int64_t d = 0; d < st.Dv; ++d) sv[d] *= g;
  }
  refresh_slot(st, i, t);
}

// Update step 1 (spec 4.5): k0, kg, vg of the C tokens [a, a+C) read from the ring, one warp per
// token. grid (I, ceil(C / kWarpsPerBlock)), block 32 * kWarpsPerBlock.
template <class S, class A>
__global__ void update_prepare_kernel(DeviceState<S, A> st, std::int64_t a) {
  const int lane = threadIdx.x % 32;
  const std::int64_t i = blockIdx.x, c = std::int64_t(blockIdx.y) * kWarpsPerBlock + threadIdx.x / 32;
  const std::int64_t C = st.C, D = st.D, Dv = st.Dv;
  if (c >= C) return;
  const std::int64_t ring = (a + c) % st.W;
  const S* kr = st.wk + (i * st.W + ring) * D;
  A* k0 = st.k0 + (i * C + c) * D;
  for (std::int64_t d = lane; d < D; d += 32) k0[d] = d < st.rope_dims ? A(0) : load_as<A>(kr[d]);  // spec 4.2 step 1
  warp_layer_norm(k0, D, st.ln_w, st.ln_b, st.eps, k0, lane);
  const A g = st.wg[i * st.W + ring];
  for (std::int64_t d = lane; d < D; d += 32) {
    const A kgv = st.merge_gate_keys ? g * k0[d] : k0[d];
    st.k0t[(i * D + d) * C + c] = k0[d];
    st.kgt[(i * D + d) * C + c] = kgv;
    st.kg[(i * C + c) * D + d] = kgv;
  }
  const S* vr = st.wv + (i * st.W + ring) * Dv;
  for (std::int64_t d = lane; d < Dv; d += 32) {
    const A x = load_as<A>(vr[d]);
    st.vg[(i * C + c) * Dv + d] = st.merge_gate_values ? g * x : x;
  }
  if (lane == 0) st.target[i * C + c] = 0;
}

inline constexpr int kSlotTile = 16;

// For token c of item i (one thread each), visits slots [j0, j1) in tiles of kSlotTile rows of
// khat32 staged in shared memory and calls visit(j, x . khat32_j) in increasing j, where x is the
// token's column of `xt` [D, C]. Dynamic shared memory: kSlotTile * D accumulate values.
template <class S, class A, class Visit>
__device__ void sweep_slots(const DeviceState<S, A>& st, std::int64_t i, const A* xt, std::int64_t j0, std::int64_t j1,
                            Visit&& visit) {
  extern __shared__ unsigned char smem_raw[];
  A* tile = reinterpret_cast<A*>(smem_raw);
  const std::int64_t c = threadIdx.x, C = st.C, D = st.D;
  for (std::int64_t base = j0; base < j1; base += kSlotTile) {
    const std::int64_t n = (j1 - base) < kSlotTile ? (j1 - base) : kSlotTile;
    __syncthreads();
    for (std::int64_t e = threadIdx.x; e < n * D; e += blockDim.x) tile[e] = st.khat32[(i * st.cap + base) * D + e];
    __syncthreads();
    A acc[kSlotTile];
#pragma unroll
    for (int s = 0; s < kSlotTile; ++s) acc[s] = A(0);
    for (std::int64_t d = 0; d < D; ++d) {
      const A x = xt[d * C + c];
#pragma unroll
      for (int s = 0; s < kSlotTile; ++s) acc[s] += x * tile[s * D + d];
    }
    for (int s = 0; s < kSlotTile && s < n; ++s) visit(base + s, acc[s]);
  }
}

// Update step 2 (spec 4.5): novelty score_c = max_j k0_c . LN_s(Sk_j) over all current slots, then
// the append set by rank (score asc, index asc) and the appends in token order (step 3), each new
// slot refreshed. grid I, block C, dynamic smem kSlotTile*D*sizeof(A) + C*(sizeof(A)+sizeof(int)).
template <class S, class A>
__global__ void update_append_kernel(DeviceState<S, A> st, std::int64_t a, std::int64_t slots_before,
                                     std::int64_t n_app) {
  const std::int64_t i = blockIdx.x, c = threadIdx.x, C = st.C, D = st.D, Dv = st.Dv;
  A best = negative_infinity<A>();
  sweep_slots(st, i, st.k0t + i * D * C, 0, slots_before, [&](std::int64_t, A x) {
    if (x > best) best = x;
  });
  extern __shared__ unsigned char smem_raw[];
  A* score = reinterpret_cast<A*>(smem_raw + kSlotTile * D * sizeof(A));
  int* appended = reinterpret_cast<int*>(score + C);
  __syncthreads();
  score[c] = best;
  st.score[i * C + c] = best;
  __syncthreads();
  std::int64_t rank = 0;
  for (std::int64_t o = 0; o < C; ++o) rank += (score[o] < best || (score[o] == best && o < c)) ? 1 : 0;
  const bool is_app = rank < n_app;
  appended[c] = is_app ? 1 : 0;
  __syncthreads();
  if (!is_app) return;
  std::int64_t pos = 0;  // appends keep increasing token order
  for (std::int64_t o = 0; o < c; ++o) pos += appended[o];
  const std::int64_t j = slots_before + pos, sj = i * st.cap + j;
  st.target[i * C + c] = -1;
  const std::int64_t ring = (a + c) % st.W;
  A* sk = st.sk + sj * D;
  A* sv = st.sv + sj * Dv;
  for (std::int64_t d = 0; d < D; ++d) sk[d] = st.gate_appends ? st.kg[(i * C + c) * D + d] : st.k0[(i * C + c) * D + d];
  for (std::int64_t d = 0; d < Dv; ++d)
    sv[d] = st.gate_appends ? st.vg[(i * C + c) * Dv + d] : load_as<A>(st.wv[(i * st.W + ring) * Dv + d]);
  st.rho[sj] = kernel::norm2<A>(sv, Dv);
  st.cnt[sj] = A(1);
  refresh_slot(st, i, j);
}

// Update step 4 routing (spec 4.5): j*(c) = argmax_{j >= sink} kg_c . K^+_j over the expanded state,
// ties to the smaller j. grid I, block C, dynamic smem kSlotTile*D*sizeof(A).
template <class S, class A>
__global__ void update_route_kernel(DeviceState<S, A> st, std::int64_t slots_after) {
  const std::int64_t i = blockIdx.x, c = threadIdx.x, C = st.C, D = st.D;
  A best = negative_infinity<A>();
  int arg = -1;
  sweep_slots(st, i, st.kgt + i * D * C, st.sink, slots_after, [&](std::int64_t j, A x) {
    if (arg < 0 || x > best) {
      best = x;
      arg = static_cast<int>(j);
    }
  });
  if (st.target[i * C + c] != -1) st.target[i * C + c] = arg;
}

// Update step 4 scatter: one warp per slot j >= sink adds its routed tokens in token order (lanes
// split the channels), then refreshes the slot's readout. grid (I, ceil((slots_after - sink) /
// kWarpsPerBlock)), block 32 * kWarpsPerBlock, smem C ints.
template <class S, class A>
__global__ void update_scatter_kernel(DeviceState<S, A> st, std::int64_t slots_after) {
  extern __shared__ unsigned char smem_raw[];
  int* target = reinterpret_cast<int*>(smem_raw);
  const std::int64_t i = blockIdx.x, C = st.C, D = st.D, Dv = st.Dv;
  for (std::int64_t c = threadIdx.x; c < C; c += blockDim.x) target[c] = st.target[i * C + c];
  __syncthreads();
  const int lane = threadIdx.x % 32;
  const std::int64_t j = st.sink + std::int64_t(blockIdx.y) * kWarpsPerBlock + threadIdx.x / 32;
  if (j >= slots_after) return;
  const std::int64_t sj = i * st.cap + j;
  A added = A(0);
  for (std::int64_t c = 0; c < C; ++c) {
    if (target[c] != j) continue;
    for (std::int64_t d = lane; d < D; d += 32) st.sk[sj * D + d] += st.kg[(i * C + c) * D + d];
    for (std::int64_t d = lane; d < Dv; d += 32) st.sv[sj * Dv + d] += st.vg[(i * C + c) * Dv + d];
    added += A(1);
  }
  if (lane == 0) st.cnt[sj] += added;
  __syncwarp();
  warp_refresh_slot(st, i, j, lane);
}

inline constexpr int kRowsPerBlock = 32;  // query rows of one head per attention block
inline constexpr int kLanesPerRow = 4;    // threads sharing a row's dot products and accumulator
inline constexpr int kKeyTile = 32;
inline constexpr int kRowPad = 4;  // row stride D + 4: the 8 rows x 4 lanes of a warp hit 32 banks

// Prefill readout (spec 4.4): rows t in [t0, t1) of query head h = blockIdx.x % Hq over the state
// slots (when w > 0) and the causal window [w, t], one online softmax per row. Each row is served
// by kLanesPerRow threads that split the head dims (lane l owns dims l, l+4, ...); their partial
// dots are combined with xor shuffles, which gives every lane the bitwise same logit.
// kD/kDv > 0: compile-time head dims, the row's query and accumulator live in registers;
// kD = kDv = 0: any head dims, both live in shared memory.
// grid (B*Hq, ceil((t1-t0)/kRowsPerBlock)), block kRowsPerBlock*kLanesPerRow, dynamic smem from
// attend_shared_bytes(). q: [B,Hq,T,D], out: [B,T,Hq,Dv]
template <int kD, int kDv>
constexpr std::size_t attend_shared_bytes(std::int64_t D, std::int64_t Dv, std::size_t acc_size) {
  const std::size_t tiles = std::size_t(kKeyTile) * std::size_t(D + Dv);
  const std::size_t rows = (kD > 0 && kDv > 0) ? 0 : std::size_t(kRowsPerBlock) * std::size_t(D + Dv + 2 * kRowPad);
  return (tiles + rows) * acc_size;
}

template <class S, class A, class In, class Out, int kD, int kDv>
__global__ void attend_rows_kernel(DeviceState<S, A> st, const In* q, Out* out, std::int64_t T, std::int64_t n0,
                                   std::int64_t t0, std::int64_t t1, std::int64_t w, std::int64_t slots) {
  constexpr bool kInRegisters = kD > 0 && kDv > 0;
  constexpr int kQ = kInRegisters ? kD / kLanesPerRow : 1;   // dims per lane (registers)
  constexpr int kV = kInRegisters ? kDv / kLanesPerRow : 1;
  extern __shared__ unsigned char smem_raw[];
  const std::int64_t D = kInRegisters ? kD : st.D, Dv = kInRegisters ? kDv : st.Dv, Hq = st.Hq;
  A* ks = reinterpret_cast<A*>(smem_raw);  // [kKeyTile, D]
  A* vs = ks + kKeyTile * D;               // [kKeyTile, Dv]
  A* qs = vs + kKeyTile * Dv;              // [rows, D + pad]   (shared-memory path only)
  A* as = qs + kRowsPerBlock * (D + kRowPad);  // [rows, Dv + pad]
  const std::int64_t bh = blockIdx.x, b = bh / Hq, h = bh % Hq, g = h / st.rep(), item = b * st.Hk + g;
  const int row = threadIdx.x / kLanesPerRow, lane = threadIdx.x % kLanesPerRow;
  const std::int64_t t = t0 + std::int64_t(blockIdx.y) * kRowsPerBlock + row;
  const bool active = t < t1;
  const std::int64_t block_last = t0 + std::int64_t(blockIdx.y) * kRowsPerBlock + kRowsPerBlock - 1;
  const std::int64_t last_t = block_last < t1 - 1 ? block_last : t1 - 1;  // last row of this block
  const In* qrow = q + ((b * Hq + h) * T + (active ? t - n0 : 0)) * D;
  A qr[kQ], ar[kV];
  if constexpr (kInRegisters) {
#pragma unroll
    for (int e = 0; e < kQ; ++e) qr[e] = active ? load_as<A>(qrow[lane + kLanesPerRow * e]) : A(0);
#pragma unroll
    for (int e = 0; e < kV; ++e) ar[e] = A(0);
  } else {
    for (std::int64_t d = lane; d < D; d += kLanesPerRow) qs[row * (D + kRowPad) + d] = active ? load_as<A>(qrow[d]) : A(0);
    for (std::int64_t d = lane; d < Dv; d += kLanesPerRow) as[row * (Dv + kRowPad) + d] = A(0);
  }
  OnlineSoftmax<A> sm;
  const A ls_state = st.scale * (st.head_temps ? st.tau_s[h] : A(1));
  const A ls_window = st.scale * (st.head_temps ? st.tau_w[h] : A(1));
  // phase 0: every slot (no mask); phase 1: window positions [w, last_t]
  for (int phase = 0; phase < 2; ++phase) {
    const std::int64_t begin = phase == 0 ? 0 : w;
    const std::int64_t end = phase == 0 ? (w > 0 ? slots : 0) : last_t + 1;
    const A ls = phase == 0 ? ls_state : ls_window;
    for (std::int64_t base = begin; base < end; base += kKeyTile) {
      const std::int64_t n = (end - base) < kKeyTile ? (end - base) : kKeyTile;
      __syncthreads();
      // Rows s >= n are zero-filled: their weight is 0, and 0 * (stale shared memory) could be NaN.
      for (std::int64_t e = threadIdx.x; e < kKeyTile * D; e += blockDim.x) {
        const std::int64_t s = e / D, d = e % D;
        ks[e] = s >= n ? A(0)
                : phase == 0 ? load_as<A>(st.khat[(item * st.cap + base + s) * D + d])
                             : load_as<A>(st.wk[(item * st.W + (base + s) % st.W) * D + d]);
      }
      for (std::int64_t e = threadIdx.x; e < kKeyTile * Dv; e += blockDim.x) {
        const std::int64_t s = e / Dv, d = e % Dv;
        vs[e] = s >= n ? A(0)
                : phase == 0 ? load_as<A>(st.vhat[(item * st.cap + base + s) * Dv + d])
                             : load_as<A>(st.wv[(item * st.W + (base + s) % st.W) * Dv + d]);
      }
      __syncthreads();
      A logit[kKeyTile];
      A tile_max = negative_infinity<A>();
#pragma unroll
      for (int s = 0; s < kKeyTile; ++s) {
        A part = A(0);
        if constexpr (kInRegisters) {
#pragma unroll
          for (int e = 0; e < kQ; ++e) part += qr[e] * ks[s * kD + lane + kLanesPerRow * e];
        } else {
          for (std::int64_t d = lane; d < D; d += kLanesPerRow) part += qs[row * (D + kRowPad) + d] * ks[s * D + d];
        }
        part += __shfl_xor_sync(0xffffffffu, part, 1);
        part += __shfl_xor_sync(0xffffffffu, part, 2);
        const bool visible = s < n && active && (phase == 0 || base + s <= t);
        logit[s] = visible ? ls * part : negative_infinity<A>();
        if (logit[s] > tile_max) tile_max = logit[s];
      }
      const A rescale = sm.raise_max(tile_max);
      if (rescale != A(1)) {
        if constexpr (kInRegisters) {
#pragma unroll
          for (int e = 0; e < kV; ++e) ar[e] *= rescale;
        } else {
          for (std::int64_t d = lane; d < Dv; d += kLanesPerRow) as[row * (Dv + kRowPad) + d] *= rescale;
        }
      }
#pragma unroll
      for (int s = 0; s < kKeyTile; ++s) {  // fully unrolled: logit[] stays in registers
        const A wgt = sm.accumulate(logit[s]);  // 0 for masked keys and s >= n
        if constexpr (kInRegisters) {
#pragma unroll
          for (int e = 0; e < kV; ++e) ar[e] += wgt * vs[s * kDv + lane + kLanesPerRow * e];
        } else {
          if (wgt == A(0)) continue;
          for (std::int64_t d = lane; d < Dv; d += kLanesPerRow) as[row * (Dv + kRowPad) + d] += wgt * vs[s * Dv + d];
        }
      }
    }
  }
  if (!active) return;
  const A inv = sm.normaliser();
  Out* orow = out + (((b * T + (t - n0)) * Hq) + h) * Dv;
  if constexpr (kInRegisters) {
#pragma unroll
    for (int e = 0; e < kV; ++e) orow[lane + kLanesPerRow * e] = store_as<Out>(ar[e] * inv);
  } else {
    for (std::int64_t d = lane; d < Dv; d += kLanesPerRow) orow[d] = store_as<Out>(as[row * (Dv + kRowPad) + d] * inv);
  }
}

// One warp merges `parts` normalised partial results (po[p*Dv + d], log-sum-exp pl[p]) in order p =
// 0, 1, ... into dst[0, Dv) and dst[Dv] = lse: the exact merge of core/softmax.hpp merge_partials, in
// a fixed order so decode is deterministic. po[0, Dv) is overwritten.
template <class A>
__device__ void warp_merge_partials(A* po, const A* pl, int parts, std::int64_t Dv, A* dst, int lane) {
  A lse = pl[0];
  for (int p = 1; p < parts; ++p) {
    const A lse_b = pl[p];
    const A top = lse > lse_b ? lse : lse_b;
    if (top == negative_infinity<A>()) continue;
    const A wa = lse == negative_infinity<A>() ? A(0) : exp(lse - top);
    const A wb = lse_b == negative_infinity<A>() ? A(0) : exp(lse_b - top);
    for (std::int64_t d = lane; d < Dv; d += 32) po[d] = (wa * po[d] + wb * po[p * Dv + d]) / (wa + wb);
    lse = top + log(wa + wb);
  }
  for (std::int64_t d = lane; d < Dv; d += 32) dst[d] = po[d];
  if (lane == 0) dst[Dv] = lse;
}

// Decode readout, split-K: block (bh, split) covers keys [split*per, ...) of the virtual key list
// [slots | window [w, pos]]; each warp takes every 4th key, lanes split the head dims. Writes the
// normalised partial (o, lse) of the split. grid (B*Hq, splits), block 128.
// q: [B,Hq,1,D]
template <class S, class A, class In>
__global__ void decode_partial_kernel(DeviceState<S, A> st, const In* q, std::int64_t pos, std::int64_t w,
                                      std::int64_t slots, std::int64_t per_split) {
  constexpr int kWarps = 4;
  extern __shared__ unsigned char smem_raw[];
  const std::int64_t D = st.D, Dv = st.Dv, Hq = st.Hq;
  A* qs = reinterpret_cast<A*>(smem_raw);  // [D]
  A* po = qs + D;                          // [kWarps, Dv]
  A* pl = po + kWarps * Dv;                // [kWarps]
  const std::int64_t bh = blockIdx.x, b = bh / Hq, h = bh % Hq, item = b * st.Hk + h / st.rep();
  for (std::int64_t d = threadIdx.x; d < D; d += blockDim.x) qs[d] = load_as<A>(q[bh * D + d]);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (std::int64_t d = lane; d < Dv; d += 32) po[warp * Dv + d] = A(0);
  __syncthreads();
  const std::int64_t n_state = w > 0 ? slots : 0;
  const std::int64_t total = n_state + (pos - w + 1);
  const std::int64_t k_begin = std::int64_t(blockIdx.y) * per_split;
  const std::int64_t k_end = (k_begin + per_split) < total ? (k_begin + per_split) : total;
  const A ls_state = st.scale * (st.head_temps ? st.tau_s[h] : A(1));
  const A ls_window = st.scale * (st.head_temps ? st.tau_w[h] : A(1));
  OnlineSoftmax<A> sm;
  for (std::int64_t x = k_begin + warp; x < k_end; x += kWarps) {
    const bool in_state = x < n_state;
    const S* kr = in_state ? st.khat + (item * st.cap + x) * D : st.wk + (item * st.W + (w + x - n_state) % st.W) * D;
    const S* vr = in_state ? st.vhat + (item * st.cap + x) * Dv : st.wv + (item * st.W + (w + x - n_state) % st.W) * Dv;
    A part = A(0);
    for (std::int64_t d = lane; d < D; d += 32) part += qs[d] * load_as<A>(kr[d]);
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) part += __shfl_xor_sync(0xffffffffu, part, off);
    const typename OnlineSoftmax<A>::Step step = sm.push((in_state ? ls_state : ls_window) * part);
    for (std::int64_t d = lane; d < Dv; d += 32)
      po[warp * Dv + d] = po[warp * Dv + d] * step.rescale + step.weight * load_as<A>(vr[d]);
  }
  if (lane == 0) pl[warp] = sm.lse();
  for (std::int64_t d = lane; d < Dv; d += 32) po[warp * Dv + d] *= sm.normaliser();
  __syncthreads();
  if (warp != 0) return;
  warp_merge_partials(po, pl, kWarps, Dv, st.partial + (bh * st.max_splits + blockIdx.y) * (Dv + 1), lane);
}

// decode_partial_kernel for bf16 storage and D = Dv = 128: each half-warp takes every 8th key and
// each lane reads 8 channels with one 16-byte load, so a key row is one coalesced 256-byte read.
// Same split layout and outputs as decode_partial_kernel. grid (B*Hq, splits), block 128.
template <class A, class In>
__global__ void decode_partial_bf16_kernel(DeviceState<bf16, A> st, const In* q, std::int64_t pos, std::int64_t w,
                                           std::int64_t slots, std::int64_t per_split) {
  constexpr int kDim = 128, kHalves = 8, kPer = 8;
  __shared__ A po[kHalves][kDim];
  __shared__ A pl[kHalves];
  const std::int64_t Hq = st.Hq, bh = blockIdx.x, b = bh / Hq, h = bh % Hq, item = b * st.Hk + h / st.rep();
  const int half = threadIdx.x / 16, l = threadIdx.x % 16;
  A qr[kPer], acc[kPer];
#pragma unroll
  for (int e = 0; e < kPer; ++e) {
    qr[e] = load_as<A>(q[bh * kDim + l * kPer + e]);
    acc[e] = A(0);
  }
  const std::int64_t n_state = w > 0 ? slots : 0;
  const std::int64_t total = n_state + (pos - w + 1);
  const std::int64_t k_begin = std::int64_t(blockIdx.y) * per_split;
  const std::int64_t k_end = (k_begin + per_split) < total ? (k_begin + per_split) : total;
  const A ls_state = st.scale * (st.head_temps ? st.tau_s[h] : A(1));
  const A ls_window = st.scale * (st.head_temps ? st.tau_w[h] : A(1));
  OnlineSoftmax<A> sm;
  // The loop runs the same number of times in both halves of a warp (the shuffles need every lane);
  // a half whose key lies past the split end computes on zeros and pushes nothing.
  for (std::int64_t x0 = k_begin; x0 < k_end; x0 += kHalves) {
    const std::int64_t x = x0 + half;
    const bool valid = x < k_end;
    const bool in_state = x < n_state;
    uint4 kv = make_uint4(0, 0, 0, 0), vv = make_uint4(0, 0, 0, 0);
    if (valid) {
      const std::int64_t row = in_state ? item * st.cap + x : item * st.W + (w + x - n_state) % st.W;
      kv = reinterpret_cast<const uint4*>((in_state ? st.khat : st.wk) + row * kDim)[l];
      vv = reinterpret_cast<const uint4*>((in_state ? st.vhat : st.wv) + row * kDim)[l];
    }
    const bf16* kb = reinterpret_cast<const bf16*>(&kv);
    const bf16* vb = reinterpret_cast<const bf16*>(&vv);
    A part = A(0);
#pragma unroll
    for (int e = 0; e < kPer; ++e) part += qr[e] * load_as<A>(kb[e]);
#pragma unroll
    for (int off = 8; off > 0; off >>= 1) part += __shfl_xor_sync(0xffffffffu, part, off);  // within the half
    if (!valid) continue;
    const typename OnlineSoftmax<A>::Step step = sm.push((in_state ? ls_state : ls_window) * part);
#pragma unroll
    for (int e = 0; e < kPer; ++e) acc[e] = acc[e] * step.rescale + step.weight * load_as<A>(vb[e]);
  }
  const A norm = sm.normaliser();
#pragma unroll
  for (int e = 0; e < kPer; ++e) po[half][l * kPer + e] = acc[e] * norm;
  if (l == 0) pl[half] = sm.lse();
  __syncthreads();
  if (threadIdx.x >= 32) return;
  warp_merge_partials(&po[0][0], pl, kHalves, kDim, st.partial + (bh * st.max_splits + blockIdx.y) * (kDim + 1),
                      int(threadIdx.x));
}

// Merges the split partials in split order into out[b, 0, h, :]. grid B*Hq, block 32.
template <class S, class A, class Out>
__global__ void decode_combine_kernel(DeviceState<S, A> st, Out* out, std::int64_t splits) {
  const std::int64_t bh = blockIdx.x, Dv = st.Dv;
  const A* src = st.partial + bh * st.max_splits * (Dv + 1);
  A lse = negative_infinity<A>();
  for (std::int64_t s = 0; s < splits; ++s) lse = lse > src[s * (Dv + 1) + Dv] ? lse : src[s * (Dv + 1) + Dv];
  A total = A(0);
  for (std::int64_t s = 0; s < splits; ++s) {
    const A l = src[s * (Dv + 1) + Dv];
    total += l == negative_infinity<A>() ? A(0) : exp(l - lse);
  }
  for (std::int64_t d = threadIdx.x; d < Dv; d += blockDim.x) {
    A o = A(0);
    for (std::int64_t s = 0; s < splits; ++s) {
      const A l = src[s * (Dv + 1) + Dv];
      if (l != negative_infinity<A>()) o += exp(l - lse) * src[s * (Dv + 1) + d];
    }
    out[bh * Dv + d] = store_as<Out>(o / total);
  }
}

}  // namespace kvmem::cuda::kvm_detail
