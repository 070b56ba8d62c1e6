// SPDX-License-Identifier: Apache-2.0
#pragma once
// CUDA kernels of the KVM backend. The math comes from the shared bodies in kernel/ (key
// preprocessing, LN_s, value readout, online softmax); this file only decides where they run:
// one block per (sequence, KV head) item for the state update, tiles of slots/keys in shared
// memory, and a split-K decode. Deterministic: no float atomics, every reduction has a fixed order.

#include "kvmem/backend/cuda/vendor.cuh"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "kvmem/backend/cuda/ptx.cuh"
#include "kvmem/core/numeric.hpp"
#include "kvmem/core/softmax.hpp"
#include "kvmem/kernel/kvm_state.hpp"
#include "kvmem/kvm/state.hpp"

namespace kvmem::cuda::kvm_detail {

// The element type of the window ring (kvm::window_t): the storage type, bf16 for fp8 storage, whose
// e4m3 applies to the slots' readout rows only (kvm/state.hpp).
template <class S>
using Win = kvm::window_t<S>;

// Device pointers and sizes of a KvmState, passed by value to every kernel. Item i = b*Hk + g.
template <class S, class A>
struct DeviceState {
  A* sk;              // [I, cap, D]  raw summed keys
  A* sv;              // [I, cap, Dv] raw summed values
  A* rho;             // [I, cap]
  A* cnt;             // [I, cap]
  A* khat32;          // [I, cap, D]  LN_s(Sk) in the accumulate type (routing reads it, as the host does;
                      //              not kept up to date with tc_route, whose routing reads khat + khat_lo)
  S* khat;            // [I, cap, D]  readout keys (storage type)
  S* vhat;            // [I, cap, Dv] readout values (storage type)
  float* khat_scale;  // [I, cap] row scales of khat (fp8 storage; nullptr otherwise)
  float* vhat_scale;  // [I, cap] row scales of vhat (fp8 storage; nullptr otherwise)
  Win<S>* wk;         // [I, W, D]    window ring (window type), position p at p mod W
  Win<S>* wv;         // [I, W, Dv]
  A* wg;              // [I, W]
  A* k0;              // [I, C, D]    update workspace
  A* k0t;             // [I, D, C]    the same, transposed (coalesced reads across tokens)
  A* kgt;             // [I, D, C]    gated keys, transposed
  A* vg;              // [I, C, Dv]
  A* kg;              // [I, C, D]
  A* score;           // [I, C]
  A* rbest;           // [I, C]  best k0 . K^ over the non-sink pre-update slots (route candidate, tensor-core path)
  int* target;        // [I, C]  -1 appended, else merge slot
  A* partial;         // [B*Hq, max_splits, Dv + 1] decode split results (o, lse)
  int* counter;       // [B*Hq] decode splits finished this step; the last one merges and resets it to 0
  // Tensor-core routing (bf16 storage, tc_route): khat32 = khat + khat_lo to ~2^-16 (the routing
  // passes build the tokens' hi/lo operands themselves). khat_lo is nullptr without it.
  bf16* khat_lo;  // [I, cap, D]
  // A prefill call's own inputs (storage type, [I, in_count, *] for positions in_first + r), set
  // for prefills with readouts beside the chain: an update reads the tokens leaving the window
  // from them (token_key and friends) instead of the ring, so such a prefill ingests only the
  // chunks a later reader of the ring needs. nullptr: every token from the ring.
  const Win<S>* in_k;  // [I, in_count, D]
  const Win<S>* in_v;  // [I, in_count, Dv]
  const Win<S>* in_g;  // [I, in_count]
  std::int64_t in_first, in_count;
  const A* ln_w;   // [D]   caller's device weights, read in place (no per-call copy)
  const A* ln_b;   // [D]
  const A* tau_s;  // [Hq]
  const A* tau_w;  // [Hq]
  std::int64_t cap, C, W, D, Dv, Hq, Hk, sink, rope_dims, max_splits;
  A eps, scale;
  bool merge_gate_keys, merge_gate_values, head_temps, value_radius, gate_appends, gate_initial;
  bool tc_route;    // novelty and routing dots on the tensor / matrix cores (bf16, D = 64 or 128, C % 16 == 0)
  int route_terms;  // 3: hi*hi + lo*hi + hi*lo (about fp32 accuracy); 1: hi*hi only (fast, flips near ties)

  __device__ std::int64_t rep() const { return Hq / Hk; }
};

// Key, value row and gate of position p of item i for an update: from the call's inputs when they
// hold it (the same values the ring would: the ring stores storage-type inputs as they are), else
// from the ring (row p mod W).
template <class S, class A>
__device__ inline const Win<S>* token_key(const DeviceState<S, A>& st, std::int64_t i, std::int64_t p) {
  if (st.in_k != nullptr && p >= st.in_first) return st.in_k + (i * st.in_count + (p - st.in_first)) * st.D;
  return st.wk + (i * st.W + p % st.W) * st.D;
}
template <class S, class A>
__device__ inline const Win<S>* token_value(const DeviceState<S, A>& st, std::int64_t i, std::int64_t p) {
  if (st.in_v != nullptr && p >= st.in_first) return st.in_v + (i * st.in_count + (p - st.in_first)) * st.Dv;
  return st.wv + (i * st.W + p % st.W) * st.Dv;
}
template <class S, class A>
__device__ inline A token_gate(const DeviceState<S, A>& st, std::int64_t i, std::int64_t p) {
  if (st.in_g != nullptr && p >= st.in_first) return load_as<A>(st.in_g[i * st.in_count + (p - st.in_first)]);
  return st.wg[i * st.W + p % st.W];
}

// Channel d of slot sj's readout key K^ from its accumulate-type value: the storage copy and, with
// tensor-core routing, the bf16 remainder (khat + khat_lo = khat32 to about 2^-16).
template <class S, class A>
__device__ inline void store_readout_key(const DeviceState<S, A>& st, std::int64_t sj, std::int64_t d, A k32) {
  const S hi = store_as<S>(k32);
  st.khat[sj * st.D + d] = hi;
  if (st.khat_lo != nullptr) st.khat_lo[sj * st.D + d] = store_as<bf16>(k32 - load_as<A>(hi));
}

// Element d of slot row sj's readout key / value in the accumulate type: the stored element, times the
// row's scale for fp8 storage (exact: a power of two). The readout kernels that stage tiles dequantise
// with these; kernel::attend_accumulate scales the products instead (fp32 rounding apart, the same).
template <class S, class A>
__device__ inline A readout_key(const DeviceState<S, A>& st, std::int64_t sj, std::int64_t d) {
  if constexpr (is_row_scaled_v<S>)
    return load_as<A>(st.khat[sj * st.D + d]) * A(st.khat_scale[sj]);
  else
    return load_as<A>(st.khat[sj * st.D + d]);
}
template <class S, class A>
__device__ inline A readout_value(const DeviceState<S, A>& st, std::int64_t sj, std::int64_t d) {
  if constexpr (is_row_scaled_v<S>)
    return load_as<A>(st.vhat[sj * st.Dv + d]) * A(st.vhat_scale[sj]);
  else
    return load_as<A>(st.vhat[sj * st.Dv + d]);
}

// K^_j, V^_j of slot j of item i from its sums (spec 4.4 steps 1-2); one thread. fp8 storage quantises
// each row with its scale (quantize_row, kernel::value_readout_scaled: the host's rule).
template <class S, class A>
__device__ void refresh_slot(const DeviceState<S, A>& st, std::int64_t i, std::int64_t j) {
  const std::int64_t sj = i * st.cap + j;
  A* k32 = st.khat32 + sj * st.D;
  kernel::layer_norm(st.sk + sj * st.D, st.D, st.ln_w, st.ln_b, st.eps, k32);
  if constexpr (is_row_scaled_v<S>) {
    st.khat_scale[sj] = quantize_row(k32, st.khat + sj * st.D, st.D);
    st.vhat_scale[sj] = kernel::value_readout_scaled(st.sv + sj * st.Dv, st.Dv, st.rho[sj], st.cnt[sj], st.value_radius,
                                                     st.vhat + sj * st.Dv);
  } else {
    for (std::int64_t d = 0; d < st.D; ++d) store_readout_key(st, sj, d, k32[d]);
    kernel::value_readout(st.sv + sj * st.Dv, st.Dv, st.rho[sj], st.cnt[sj], st.value_radius, st.vhat + sj * st.Dv);
  }
}

// Largest value over the kWarpSize lanes of a warp (every lane gets it; max is exact in any order).
__device__ inline float warp_max(float x) {
#pragma unroll
  for (int off = kWarpSize / 2; off > 0; off >>= 1) {
    const float y = warp_shfl_xor(x, off);
    x = y > x ? y : x;
  }
  return x;
}

// Sum over the kWarpSize lanes of a warp with xor shuffles: a fixed order, every lane gets the same value.
template <class A>
__device__ A warp_sum(A x) {
#pragma unroll
  for (int off = kWarpSize / 2; off > 0; off >>= 1) x += warp_shfl_xor(x, off);
  return x;
}

// LN_s (spec 4.2 step 2) with the D channels split over the lanes of a warp: the same formula as
// kernel::layer_norm, reduced in parallel. Lane l reads and writes only channels l, l + kWarpSize, ..., so
// y may alias x.
template <class A, class X>
__device__ void warp_layer_norm(const X* x, std::int64_t D, const A* w, const A* b, A eps, A* y, int lane) {
  A sum = A(0);
  for (std::int64_t d = lane; d < D; d += kWarpSize) sum += load_as<A>(x[d]);
  const A mean = warp_sum(sum) / static_cast<A>(D);
  A var = A(0);
  for (std::int64_t d = lane; d < D; d += kWarpSize) {
    const A c = load_as<A>(x[d]) - mean;
    var += c * c;
  }
  const A inv = A(1) / sqrt(warp_sum(var) / static_cast<A>(D) + eps);
  for (std::int64_t d = lane; d < D; d += kWarpSize) y[d] = w[d] * ((load_as<A>(x[d]) - mean) * inv) + b[d];
}

inline constexpr int kLaneRegs = 4;  // channels per lane held in registers: head dims up to kWarpSize * kLaneRegs

// x / n for a count n >= 1. A power of two n (every head dim the register forms see in practice) gives
// the product with its reciprocal 2^-k, built from the exponent bits: x / 2^k and x * 2^-k are both the
// correctly rounded x 2^-k, so bitwise equal (subnormal results too, with no flush to zero), and the
// product skips the division's Newton steps and slow-path check.
template <class A>
__device__ inline A divide_by_count(A x, std::int64_t n) {
  if constexpr (std::is_same_v<A, float>) {
    if (n > 0 && (n & (n - 1)) == 0) return x * __int_as_float((127 - (__ffsll(static_cast<long long>(n)) - 1)) << 23);
  }
  return x / static_cast<A>(n);
}

// warp_layer_norm on a row held in registers (lane l holds channels l + kWarpSize e, e < kLaneRegs; slots
// past D are ignored): the same operations in the same order, so both forms give bitwise the same
// row. D <= kWarpSize * kLaneRegs. This part: the mean and 1 / sqrt(var + eps).
template <class A>
__device__ void warp_layer_norm_stats(const A (&x)[kLaneRegs], std::int64_t D, A eps, int lane, A& mean, A& inv) {
  A sum = A(0);
#pragma unroll
  for (int e = 0; e < kLaneRegs; ++e)
    if (lane + kWarpSize * e < D) sum += x[e];
  mean = divide_by_count(warp_sum(sum), D);
  A var = A(0);
#pragma unroll
  for (int e = 0; e < kLaneRegs; ++e) {
    if (lane + kWarpSize * e < D) {
      const A c = x[e] - mean;
      var += c * c;
    }
  }
  inv = A(1) / sqrt(divide_by_count(warp_sum(var), D) + eps);
}

// LN_s weight and bias of one channel side by side: a block that normalizes many rows keeps a copy of
// them in shared memory and reads both with one 8-byte load (for float).
template <class A>
struct alignas(2 * sizeof(A)) LnWeight {
  A w, b;
};

// The LN_s weights where DeviceState keeps them (two arrays in global memory), read through the same
// ln[d] -> LnWeight as a block's shared copy (a const LnWeight<A>*): the LN below has one body for both.
template <class A>
struct StateLnWeights {
  const A* w;
  const A* b;
  __device__ LnWeight<A> operator[](std::int64_t d) const { return {w[d], b[d]}; }
};

template <class S, class A>
__device__ StateLnWeights<A> state_ln(const DeviceState<S, A>& st) {
  return {st.ln_w, st.ln_b};
}

// LN_s of a row held in registers (lane l holds channels l + kWarpSize e). ln: StateLnWeights or a shared copy.
template <class A, class Ln>
__device__ void warp_layer_norm_regs(A (&x)[kLaneRegs], std::int64_t D, const Ln& ln, A eps, int lane) {
  A mean, inv;
  warp_layer_norm_stats(x, D, eps, lane, mean, inv);
#pragma unroll
  for (int e = 0; e < kLaneRegs; ++e) {
    const int d = lane + kWarpSize * e;
    if (d < D) {
      const LnWeight<A> p = ln[d];
      x[e] = p.w * ((x[e] - mean) * inv) + p.b;
    }
  }
}

// The gated key kg = g k0 (spec 4.2 step 3) of one channel: an explicit rounded product, so no pass
// contracts it into a later add (the host stores kg, then sums it).
template <class A>
__device__ inline A gated_key(bool merge_gate_keys, A g, A k0) {
  if constexpr (std::is_same_v<A, float>) return merge_gate_keys ? __fmul_rn(g, k0) : k0;
  return merge_gate_keys ? g * k0 : k0;
}

// The gated value vg = g v (spec 4.2 step 3) of one channel. Every pass that gates values (prepare,
// appends, scatter) uses this one product, so they agree bitwise; an explicit rounded product, as
// gated_key's, because the scatter adds it straight into the sums (the host stores vg, then sums it).
template <class A>
__device__ inline A gated_value(bool merge_gate_values, A g, A v) {
  if constexpr (std::is_same_v<A, float>) return merge_gate_values ? __fmul_rn(g, v) : v;
  return merge_gate_values ? g * v : v;
}

// bf16::from_float of a and b packed as a | b << 16 (round to nearest even, a NaN keeps its sign and
// payload with the quiet bit set): one hardware conversion for both, except when either is a NaN, where
// the hardware gives the canonical NaN instead.
__device__ inline std::uint32_t bf16_pair_bits(float a, float b) {
  if (a != a || b != b) return bf16::from_float(a) | std::uint32_t(bf16::from_float(b)) << 16;
  return ptx::pack_bf16(a, b);
}

// The storage copy of a row held in registers (layout of warp_layer_norm_regs) to row[d], d < n:
// store_as<S> per channel. For bf16, two channels per hardware conversion (bf16_pair_bits), and with
// lo (tensor-core routing's khat_lo, nullptr without it) the bf16 remainder x - bf16(x) as well, as
// store_readout_key gives it. fp8 storage: the row's scale from its amax over the warp (quantize_row's
// rule), written by lane 0 to *scale.
template <class S, class A>
__device__ inline void store_row_regs(S* row, bf16* lo, const A (&x)[kLaneRegs], int n, int lane,
                                      float* scale = nullptr) {
  if constexpr (is_row_scaled_v<S>) {
    float amax = 0.0f;
#pragma unroll
    for (int e = 0; e < kLaneRegs; ++e) {
      const float a = lane + kWarpSize * e < n ? fabsf(static_cast<float>(x[e])) : 0.0f;
      amax = a > amax ? a : amax;
    }
    const float s = fp8_row_scale(warp_max(amax)), inverse = fp8_inverse_scale(s);
#pragma unroll
    for (int e = 0; e < kLaneRegs; ++e)
      if (lane + kWarpSize * e < n) row[lane + kWarpSize * e] = ptx::to_e4m3(static_cast<float>(x[e]) * inverse);
    if (lane == 0) *scale = s;
    (void)lo;
  } else if constexpr (std::is_same_v<S, bf16> && std::is_same_v<A, float> && kLaneRegs % 2 == 0) {
#pragma unroll
    for (int e = 0; e < kLaneRegs; e += 2) {
      const int d = lane + kWarpSize * e;
      const std::uint32_t hi = bf16_pair_bits(x[e], x[e + 1]);
      if (d < n) row[d] = bf16::from_bits(static_cast<std::uint16_t>(hi));
      if (d + kWarpSize < n) row[d + kWarpSize] = bf16::from_bits(static_cast<std::uint16_t>(hi >> 16));
      if (lo == nullptr) continue;
      const std::uint32_t rem =
          bf16_pair_bits(x[e] - __uint_as_float(hi << 16), x[e + 1] - __uint_as_float(hi & 0xffff0000u));
      if (d < n) lo[d] = bf16::from_bits(static_cast<std::uint16_t>(rem));
      if (d + kWarpSize < n) lo[d + kWarpSize] = bf16::from_bits(static_cast<std::uint16_t>(rem >> 16));
    }
  } else {
#pragma unroll
    for (int e = 0; e < kLaneRegs; ++e) {
      const int d = lane + kWarpSize * e;
      if (d >= n) continue;
      const S h = store_as<S>(x[e]);
      row[d] = h;
      if (lo != nullptr) lo[d] = store_as<bf16>(x[e] - load_as<A>(h));
    }
  }
}

// K^_j, V^_j of slot sj (spec 4.4 steps 1-2) from its sums Sk (k) and Sv (v) in registers (layout
// of warp_layer_norm_regs), its rho and cnt: no round trip through memory. D, Dv <= kWarpSize * kLaneRegs.
// The stores are those of store_readout_key and refresh_slot, channel for channel.
// ln: the LN_s weights, state_ln(st) or a block's copy in shared memory (const LnWeight<A>*).
template <class S, class A, class Ln>
__device__ void warp_refresh_regs(const DeviceState<S, A>& st, std::int64_t sj, const A (&k)[kLaneRegs],
                                  const A (&v)[kLaneRegs], A rho, A cnt, const Ln& ln, int lane) {
  const int D = static_cast<int>(st.D), Dv = static_cast<int>(st.Dv);
  A kh[kLaneRegs];
#pragma unroll
  for (int e = 0; e < kLaneRegs; ++e) kh[e] = k[e];
  warp_layer_norm_regs(kh, st.D, ln, st.eps, lane);
  if (!st.tc_route) {  // tensor-core routing reads khat + khat_lo instead
    A* k32 = st.khat32 + sj * st.D;
#pragma unroll
    for (int e = 0; e < kLaneRegs; ++e)
      if (lane + kWarpSize * e < D) k32[lane + kWarpSize * e] = kh[e];
  }
  store_row_regs(st.khat + sj * st.D, st.khat_lo != nullptr ? st.khat_lo + sj * st.D : nullptr, kh, D, lane,
                 st.khat_scale != nullptr ? st.khat_scale + sj : nullptr);
  A f;
  if (st.value_radius) {
    A sq = A(0);
#pragma unroll
    for (int e = 0; e < kLaneRegs; ++e)
      if (lane + kWarpSize * e < Dv) sq += v[e] * v[e];
    A n = sqrt(warp_sum(sq));
    if (n < A(1e-12)) n = A(1e-12);
    f = rho / n;
  } else {
    f = A(1) / cnt;
  }
  A vh[kLaneRegs];
#pragma unroll
  for (int e = 0; e < kLaneRegs; ++e) vh[e] = v[e] * f;
  store_row_regs(st.vhat + sj * st.Dv, static_cast<bf16*>(nullptr), vh, Dv, lane,
                 st.vhat_scale != nullptr ? st.vhat_scale + sj : nullptr);
}

// refresh_slot with a warp: K^_j = LN_s(Sk_j) into khat32/khat, V^_j (spec 4.4 steps 1-2). Head dims
// up to kWarpSize * kLaneRegs go through registers (warp_refresh_regs: bitwise the same as the memory form below).
template <class S, class A>
__device__ void warp_refresh_slot(const DeviceState<S, A>& st, std::int64_t i, std::int64_t j, int lane) {
  const std::int64_t sj = i * st.cap + j;
  if (st.D <= kWarpSize * kLaneRegs && st.Dv <= kWarpSize * kLaneRegs) {
    A k[kLaneRegs], v[kLaneRegs];
#pragma unroll
    for (int e = 0; e < kLaneRegs; ++e) {
      const int d = lane + kWarpSize * e;
      k[e] = d < st.D ? st.sk[sj * st.D + d] : A(0);
      v[e] = d < st.Dv ? st.sv[sj * st.Dv + d] : A(0);
    }
    warp_refresh_regs(st, sj, k, v, st.rho[sj], st.cnt[sj], state_ln(st), lane);
    return;
  }
  A* k32 = st.khat32 + sj * st.D;
  warp_layer_norm(st.sk + sj * st.D, st.D, st.ln_w, st.ln_b, st.eps, k32, lane);
  if constexpr (is_row_scaled_v<S>) {  // wide rows of fp8 storage: one lane quantises each row (rare shapes)
    warp_sync();
    if (lane == 0) {
      st.khat_scale[sj] = quantize_row(k32, st.khat + sj * st.D, st.D);
      st.vhat_scale[sj] = kernel::value_readout_scaled(st.sv + sj * st.Dv, st.Dv, st.rho[sj], st.cnt[sj],
                                                       st.value_radius, st.vhat + sj * st.Dv);
    }
  } else {
    for (std::int64_t d = lane; d < st.D; d += kWarpSize) store_readout_key(st, sj, d, k32[d]);
    const A* sv = st.sv + sj * st.Dv;
    A f;
    if (st.value_radius) {
      A sq = A(0);
      for (std::int64_t d = lane; d < st.Dv; d += kWarpSize) sq += sv[d] * sv[d];
      A n = sqrt(warp_sum(sq));
      if (n < A(1e-12)) n = A(1e-12);
      f = st.rho[sj] / n;
    } else {
      f = A(1) / st.cnt[sj];
    }
    for (std::int64_t d = lane; d < st.Dv; d += kWarpSize) st.vhat[sj * st.Dv + d] = store_as<S>(sv[d] * f);
  }
}

// Warps of the update kernels that give each token or slot a warp: blocks of 256 threads, 8 NVIDIA warps
// or 4 CDNA wavefronts (which keeps the scatter's shared-memory stages within the 64 KiB of an AMD GPU).
inline constexpr int kWarpsPerBlock = 256 / kWarpSize;

// Tokens [t0, t1) enter the window ring, one warp per token; tokens below C that the state has not
// covered found their slot j = t (spec 4.3; before the first update |S| equals the position).
// grid (I, ceil((t1 - t0) / kWarpsPerBlock)), block kWarpSize * kWarpsPerBlock.
// k: [B,Hk,T,D], v: [B,Hk,T,Dv], gate: [B,Hk,T] (local token index t - n0)
template <class S, class A, class In>
__global__ void ingest_kernel(DeviceState<S, A> st, const In* k, const In* v, const In* gate, std::int64_t T,
                              std::int64_t n0, std::int64_t t0, std::int64_t t1, std::int64_t cov, bool copy16) {
  const int lane = threadIdx.x % kWarpSize;
  const std::int64_t i = blockIdx.x, t = t0 + std::int64_t(blockIdx.y) * kWarpsPerBlock + threadIdx.x / kWarpSize;
  if (t >= t1) return;  // warp-uniform
  const std::int64_t ring = t % st.W, local = (i * T + (t - n0));
  Win<S>* wk = st.wk + (i * st.W + ring) * st.D;
  Win<S>* wv = st.wv + (i * st.W + ring) * st.Dv;
  if constexpr (std::is_same_v<In, Win<S>>) {
    if (copy16) {  // rows of whole 16-byte vectors, stored as given (In == the window type): plain copies
      const std::int64_t kv = st.D * std::int64_t(sizeof(In)) / 16, vv = st.Dv * std::int64_t(sizeof(In)) / 16;
      for (std::int64_t e = lane; e < kv; e += kWarpSize)
        reinterpret_cast<uint4*>(wk)[e] = reinterpret_cast<const uint4*>(k + local * st.D)[e];
      for (std::int64_t e = lane; e < vv; e += kWarpSize)
        reinterpret_cast<uint4*>(wv)[e] = reinterpret_cast<const uint4*>(v + local * st.Dv)[e];
    }
  }
  if (!copy16) {
    for (std::int64_t d = lane; d < st.D; d += kWarpSize) wk[d] = store_as<Win<S>>(load_as<A>(k[local * st.D + d]));
    for (std::int64_t d = lane; d < st.Dv; d += kWarpSize) wv[d] = store_as<Win<S>>(load_as<A>(v[local * st.Dv + d]));
  }
  if (lane == 0) st.wg[i * st.W + ring] = load_as<A>(gate[local]);
  warp_sync();                       // the founding below reads the row back from the ring
  if (t >= st.C || t < cov) return;  // warp-uniform
  // init rule (spec 4.3), read back from the ring so every backend founds slots from the stored k, v
  const std::int64_t sj = i * st.cap + t;
  if (st.D <= kWarpSize * kLaneRegs && st.Dv <= kWarpSize * kLaneRegs) {
    // the whole warp: LN_s in registers, rho summed in kernel::norm2's sequential order (the host's)
    A kr[kLaneRegs], vr[kLaneRegs];
#pragma unroll
    for (int e = 0; e < kLaneRegs; ++e) {
      const int d = lane + kWarpSize * e;
      kr[e] = d < st.D && d >= st.rope_dims ? load_as<A>(wk[d]) : A(0);  // spec 4.2 step 1
      vr[e] = d < st.Dv ? load_as<A>(wv[d]) : A(0);
    }
    warp_layer_norm_regs(kr, st.D, state_ln(st), st.eps, lane);
    A sq = A(0);
#pragma unroll
    for (int e = 0; e < kLaneRegs; ++e) {
      for (int l = 0; l < kWarpSize; ++l) {
        const A x = warp_shfl(vr[e], l);
        if (l + kWarpSize * e < st.Dv) sq += x * x;
      }
    }
    const A rho = sqrt(sq);
    if (st.gate_initial) {
      const A g = st.wg[i * st.W + ring];
#pragma unroll
      for (int e = 0; e < kLaneRegs; ++e) {
        if (st.merge_gate_keys) kr[e] *= g;
        if (st.merge_gate_values) vr[e] *= g;
      }
    }
#pragma unroll
    for (int e = 0; e < kLaneRegs; ++e) {
      const int d = lane + kWarpSize * e;
      if (d < st.D) st.sk[sj * st.D + d] = kr[e];
      if (d < st.Dv) st.sv[sj * st.Dv + d] = vr[e];
    }
    if (lane == 0) {
      st.rho[sj] = rho;
      st.cnt[sj] = A(1);
    }
    warp_refresh_regs(st, sj, kr, vr, rho, A(1), state_ln(st), lane);
    return;
  }
  if (lane != 0) return;
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

// Head dims up to kWarpSize * kLaneRegs: the scatter keeps a slot's sums in registers and reads the merged tokens'
// values from the ring (vg = g v, the same product as update_prepare_kernel's), so vg is written only for the appends
// and for wider heads.
template <class S, class A>
__host__ __device__ inline bool scatter_in_registers(const DeviceState<S, A>& st) {
  return st.D <= kWarpSize * kLaneRegs && st.Dv <= kWarpSize * kLaneRegs;
}

// Update step 1 (spec 4.5) of the fp32 sweeps: kg, vg (and, when the update appends, k0 for the
// novelty scores and the appends) of the C tokens [a, a+C) read from the ring or the call's inputs,
// one warp per token. Tensor-core routing runs it only for values wider than 128 (the memory-form
// scatter reads vg): its novelty and routing passes build the tokens' operands from the keys and
// write the kg (k0) rows themselves (update_tc_scores_kernel).
// grid (I, ceil(C / kWarpsPerBlock)), block kWarpSize * kWarpsPerBlock.
template <class S, class A>
__global__ void update_prepare_kernel(DeviceState<S, A> st, std::int64_t a, bool novelty) {
  const int lane = threadIdx.x % kWarpSize;
  const std::int64_t i = blockIdx.x, c = std::int64_t(blockIdx.y) * kWarpsPerBlock + threadIdx.x / kWarpSize;
  const std::int64_t C = st.C, D = st.D, Dv = st.Dv;
  if (c >= C) return;
  const Win<S>* kr = token_key(st, i, a + c);
  A* k0 = st.k0 + (i * C + c) * D;
  const A g = token_gate(st, i, a + c);
  // this token's k0 row: lane l holds channels l + kWarpSize e (in registers for head dims up to kWarpSize * kLaneRegs,
  // else normalised in place in st.k0)
  A x[kLaneRegs];
  const bool in_regs = D <= kWarpSize * kLaneRegs;
  if (in_regs) {
#pragma unroll
    for (int e = 0; e < kLaneRegs; ++e) {
      const int d = lane + kWarpSize * e;
      x[e] = d < D && d >= st.rope_dims ? load_as<A>(kr[d]) : A(0);  // spec 4.2 step 1
    }
    warp_layer_norm_regs(x, D, state_ln(st), st.eps, lane);
  } else {
    for (std::int64_t d = lane; d < D; d += kWarpSize) k0[d] = d < st.rope_dims ? A(0) : load_as<A>(kr[d]);
    warp_layer_norm(k0, D, st.ln_w, st.ln_b, st.eps, k0, lane);
  }
  const auto emit = [&](std::int64_t d, A k0v) {
    const A kgv = gated_key(st.merge_gate_keys, g, k0v);
    if (novelty && in_regs) k0[d] = k0v;  // the appends copy k0 rows (spec 4.5 step 3)
    if (novelty) st.k0t[(i * D + d) * C + c] = k0v;
    st.kgt[(i * D + d) * C + c] = kgv;
    st.kg[(i * C + c) * D + d] = kgv;
  };
  if (in_regs) {
#pragma unroll
    for (int e = 0; e < kLaneRegs; ++e)
      if (lane + kWarpSize * e < D) emit(lane + kWarpSize * e, x[e]);
  } else {
    for (std::int64_t d = lane; d < D; d += kWarpSize) emit(d, k0[d]);
  }
  if (novelty || !scatter_in_registers(st)) {  // else the scatter gates the ring's values itself
    const Win<S>* vr = token_value(st, i, a + c);
    for (std::int64_t d = lane; d < Dv; d += kWarpSize) {
      const A y = load_as<A>(vr[d]);
      st.vg[(i * C + c) * Dv + d] = gated_value(st.merge_gate_values, g, y);
    }
  }
  if (lane == 0) st.target[i * C + c] = 0;
}

inline constexpr int kSlotTile = 16;

// For token c of item i (one thread each; threads c >= C compute on token 0 and are ignored), visits
// slots [j0, j1) in tiles of kSlotTile rows of khat32 staged in shared memory and calls visit(j,
// x . khat32_j) in increasing j, where x is the token's column of `xt` [D, C]. Dynamic shared
// memory: kSlotTile * D accumulate values.
template <class S, class A, class Visit>
__device__ void sweep_slots(const DeviceState<S, A>& st, std::int64_t i, const A* xt, std::int64_t j0, std::int64_t j1,
                            Visit&& visit) {
  extern __shared__ __align__(128) unsigned char smem_raw[];
  A* tile = reinterpret_cast<A*>(smem_raw);
  const std::int64_t C = st.C, D = st.D, c = std::int64_t(threadIdx.x) < C ? std::int64_t(threadIdx.x) : 0;
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

// Threads per block of the kernels that give each token of an update a thread: C rounded up to
// whole warps (the warp-wide shuffles of the appends need full warps).
inline unsigned token_block(std::int64_t C) {
  return static_cast<unsigned>((C + kWarpSize - 1) / kWarpSize * kWarpSize);
}

// Update steps 2-3 (spec 4.5): novelty score_c = max_j k0_c . LN_s(Sk_j) over all current slots
// (swept here in fp32, or already in st.score from the tensor-core pass when kScoresReady), the
// append set by rank (score asc, index asc), then the appends in token order, one warp per new slot.
// grid I, block token_block(C), dynamic smem (kScoresReady ? 0 : kSlotTile*D*sizeof(A)) +
// C*(sizeof(A) + 2*sizeof(int)).
template <class S, class A, bool kScoresReady>
__global__ void update_append_kernel(DeviceState<S, A> st, std::int64_t a, std::int64_t slots_before,
                                     std::int64_t n_app) {
  const std::int64_t i = blockIdx.x, c = threadIdx.x, C = st.C, D = st.D, Dv = st.Dv;
  const bool token = c < C;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  A* score = reinterpret_cast<A*>(smem_raw + (kScoresReady ? 0 : kSlotTile * D * sizeof(A)));
  int* appended = reinterpret_cast<int*>(score + C);
  int* order = appended + C;  // order[p]: the token founding slot slots_before + p
  A best = negative_infinity<A>();
  if constexpr (kScoresReady) {
    if (token) best = st.score[i * C + c];
  } else {
    sweep_slots(st, i, st.k0t + i * D * C, 0, slots_before, [&](std::int64_t, A x) {
      if (x > best) best = x;
    });
  }
  if (token) {
    score[c] = best;
    if constexpr (!kScoresReady) st.score[i * C + c] = best;
  }
  __syncthreads();
  bool is_app = false;
  if (token) {
    std::int64_t rank = 0;
    for (std::int64_t o = 0; o < C; ++o) rank += (score[o] < best || (score[o] == best && o < c)) ? 1 : 0;
    is_app = rank < n_app;
    appended[c] = is_app ? 1 : 0;
  }
  __syncthreads();
  if (is_app) {
    std::int64_t pos = 0;  // appends keep increasing token order
    for (std::int64_t o = 0; o < c; ++o) pos += appended[o];
    order[pos] = static_cast<int>(c);
    st.target[i * C + c] = -1;
  }
  __syncthreads();
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize, warps = blockDim.x / kWarpSize;
  for (std::int64_t p = warp; p < n_app; p += warps) {
    const std::int64_t t = order[p], j = slots_before + p, sj = i * st.cap + j;
    A* sk = st.sk + sj * D;
    A* sv = st.sv + sj * Dv;
    const A* ksrc = (st.gate_appends ? st.kg : st.k0) + (i * C + t) * D;
    for (std::int64_t d = lane; d < D; d += kWarpSize) sk[d] = ksrc[d];
    A rho = A(0);
    if (st.gate_appends && kScoresReady) {
      // tensor-core routing has no prepare pass: vg = g v from the token (update_prepare_kernel's
      // product), then rho over the row the warp wrote
      const Win<S>* vrow = token_value(st, i, a + t);
      const A g = token_gate(st, i, a + t);
      for (std::int64_t d = lane; d < Dv; d += kWarpSize) {
        const A y = load_as<A>(vrow[d]);
        sv[d] = gated_value(st.merge_gate_values, g, y);
      }
      warp_sync();
      if (lane == 0) rho = kernel::norm2<A>(sv, Dv);  // the sequential sum of the host backend
    } else if (st.gate_appends) {
      const A* vsrc = st.vg + (i * C + t) * Dv;
      for (std::int64_t d = lane; d < Dv; d += kWarpSize) sv[d] = vsrc[d];
      if (lane == 0) rho = kernel::norm2<A>(vsrc, Dv);  // the sequential sum of the host backend
    } else {
      const Win<S>* vsrc = token_value(st, i, a + t);
      for (std::int64_t d = lane; d < Dv; d += kWarpSize) sv[d] = load_as<A>(vsrc[d]);
      if (lane == 0) rho = kernel::norm2<A>(vsrc, Dv);
    }
    if (lane == 0) {
      st.rho[sj] = rho;
      st.cnt[sj] = A(1);
    }
    warp_sync();
    warp_refresh_slot(st, i, j, lane);
    warp_sync();
  }
}

// Update step 4 routing (spec 4.5): j*(c) = argmax_{j >= sink} kg_c . K^+_j over the expanded state,
// ties to the smaller j. fp32 path. grid I, block token_block(C), dynamic smem kSlotTile*D*sizeof(A).
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
  if (c < C && st.target[i * C + c] != -1) st.target[i * C + c] = arg;
}

// Adds the tokens routed to slot j (token order, lanes split the channels, read-modify-write of the
// sums per token) and refreshes its readout: the memory form of the scatter, for head dims above 128
// (scatter_in_registers). Tokens at or after c_first are scanned (c_first: the first token routed to j,
// or C if none).
template <class S, class A>
__device__ void scatter_into_slot(const DeviceState<S, A>& st, std::int64_t i, std::int64_t j, const int* target,
                                  std::int64_t c_first, int lane) {
  const std::int64_t C = st.C, D = st.D, Dv = st.Dv, sj = i * st.cap + j;
  A added = A(0);
  for (std::int64_t cb = c_first - c_first % kWarpSize; cb < C; cb += kWarpSize) {
    const std::int64_t cc = cb + lane;
    LaneMask m = warp_ballot(cc >= c_first && cc < C && target[cc] == j);
    while (m != 0u) {
      const std::int64_t c = cb + (mask_ffs(m) - 1);
      m &= m - 1u;
      for (std::int64_t d = lane; d < D; d += kWarpSize) st.sk[sj * D + d] += st.kg[(i * C + c) * D + d];
      for (std::int64_t d = lane; d < Dv; d += kWarpSize) st.sv[sj * Dv + d] += st.vg[(i * C + c) * Dv + d];
      added += A(1);
    }
  }
  if (lane == 0) st.cnt[sj] += added;
  warp_sync();
  warp_refresh_slot(st, i, j, lane);
}

// The register-form scatter (head dims up to kWarpSize * kLaneRegs) runs a warp's slots as one stream of rows: for each
// slot its sums (Sk, Sv, rho and count), then the rows of the tokens routed to it (gated key, value) in
// token order. The warp keeps the next kScatterDepth rows of its stream in flight, copied into
// shared memory with cp.async (no registers held for them), so the loads of the next slots and tokens
// overlap the adds, stores and readout refresh of the current one, across slot boundaries; only the
// slot being added holds registers (its sums). The adds keep token order, so the sums are bitwise
// those of scatter_into_slot. Rows in flight in shared memory rather than registers leave room for
// four blocks an SM, and no load round trip per token stands between the adds.
inline constexpr int kScatterDepth = 4;
static_assert((kScatterDepth & (kScatterDepth - 1)) == 0, "the stage of stream row e is e % kScatterDepth");

// Bytes of one stage: the larger of a slot's sums (Sk, Sv up to kWarpSize * kLaneRegs channels each, then rho
// and count) and a token's rows (kg in the first half, the value row in storage type in the second).
template <class A>
constexpr std::size_t scatter_stage_bytes() {
  return 2 * kWarpSize * kLaneRegs * sizeof(A) + 16;
}

// The chunk's tokens as the scatter sees them, in shared memory: merge target, value row
// (ring or call inputs, token_value) and gate (token_gate), resolved once per block.
template <class S, class A>
struct ScatterTokens {
  const int* target;
  const Win<S>* const* vrow;
  const A* gate;
  const LnWeight<A>* ln;  // the LN_s weights, copied once per block
};

// The gated key row kg of token c of item i (the routing pass writes it): the one place the scatter
// reads it.
template <class S, class A>
__device__ inline const A* routed_key_row(const DeviceState<S, A>& st, std::int64_t i, int c) {
  return st.kg + (i * st.C + c) * st.D;
}

// Copies row src (n elements) into dst, a stage row of kWarpSize * kLaneRegs elements in shared memory, over
// the lanes of a warp, with zeros past n (so the adds need no bounds checks): with `async`, one 16-byte
// cp.async piece per lane (n * sizeof(T) a multiple of 16, both rows 16-byte aligned; a piece past n
// copies 0 bytes, which fills it with zeros; complete after the caller's wait), else plain loads and
// stores (shapes without that alignment).
template <class T>
__device__ inline void stage_row(T* dst, const T* src, int n, bool async, int lane) {
  constexpr int kRow = kWarpSize * kLaneRegs, kPiece = 16 / int(sizeof(T));
  static_assert(kRow <= kWarpSize * kPiece, "one 16-byte piece per lane covers a stage row");
  if (async) {
    const int q = lane * kPiece;
    if (q < kRow) ptx::cp_async16(dst + q, src + (q < n ? q : 0), q < n ? 16 : 0);
  } else {
    for (int d = lane; d < kRow; d += kWarpSize) dst[d] = d < n ? src[d] : T{};
  }
}
template <class T>
__device__ inline void stage_value(T* dst, const T* src, bool async) {
  if (async)
    ptx::cp_async_ca<int(sizeof(T))>(dst, src);
  else
    *dst = *src;
}

// Lists the n tokens routed to slot `target` (c_first: the first of them) in increasing order into
// list, scanning the chunk's targets from c_first until all n are found.
__device__ inline void list_routed_tokens(const int* targets, int C, int c_first, int n, int target, int* list,
                                          int lane) {
  for (int cb = c_first - c_first % kWarpSize, found = 0; found < n; cb += kWarpSize) {
    const int c = cb + lane;
    const bool hit = c < C && targets[c] == target;
    const LaneMask m = warp_ballot(hit);
    if (hit) list[found + mask_popc(m & lanes_below(lane))] = c;
    found += mask_popc(m);
  }
  warp_sync();  // the list is read by every lane
}

// One warp's share of a scatter block: its slots are the block's p-th for p = warp + kWarpsPerBlock k
// (slot(p): j - lo; first[j - lo] and routed[j - lo]: its first token and number of tokens), walked as
// the stream above with kScatterDepth stages of scatter_stage_bytes<A>() at `stages`. `list` (C ints of
// this warp) receives each slot's token list (list_routed_tokens) as the stream reaches it.
template <class S, class A, class Slot>
__device__ void scatter_warp_stream(const DeviceState<S, A>& st, std::int64_t i, std::int64_t lo,
                                    const ScatterTokens<S, A>& tokens, const int* first, const int* routed,
                                    const Slot& slot, int n_slots, bool async_rows, unsigned char* stages, int* list,
                                    int warp, int lane) {
  const int C = static_cast<int>(st.C), D = static_cast<int>(st.D), Dv = static_cast<int>(st.Dv);
  constexpr std::size_t kHalf = kWarpSize * kLaneRegs * sizeof(A);  // the second row of a stage starts here
  const auto stage = [&](int e) { return stages + (e & (kScatterDepth - 1)) * scatter_stage_bytes<A>(); };
  const auto has_slot = [&](int k) { return warp + kWarpsPerBlock * k < n_slots; };
  const auto slot_rel = [&](int k) { return slot(warp + kWarpsPerBlock * k); };  // j - lo of the warp's k-th slot

  // Issue side: copies stream row e into its stage and commits one cp.async group per row (an empty
  // one past the end), so row e is complete once at most kScatterDepth - 1 later groups are pending.
  int issue_slot = 0, issue_left = 0, issue_pos = 0, list_end = 0;
  const auto issue = [&](int e) {
    unsigned char* s = stage(e);
    if (issue_left > 0) {  // the next token of the slot being issued
      const int c = list[issue_pos++];
      --issue_left;
      stage_row(reinterpret_cast<A*>(s), routed_key_row(st, i, c), D, async_rows, lane);
      stage_row(reinterpret_cast<Win<S>*>(s + kHalf), tokens.vrow[c], Dv, async_rows, lane);
    } else if (has_slot(issue_slot)) {  // the next slot: list its tokens, then copy its sums
      const int rel = slot_rel(issue_slot++);
      const std::int64_t sj = i * st.cap + lo + rel;
      issue_left = routed[rel];
      list_routed_tokens(tokens.target, C, first[rel], issue_left, static_cast<int>(lo + rel), list + list_end, lane);
      issue_pos = list_end;
      list_end += issue_left;
      stage_row(reinterpret_cast<A*>(s), st.sk + sj * D, D, async_rows, lane);
      stage_row(reinterpret_cast<A*>(s + kHalf), st.sv + sj * Dv, Dv, async_rows, lane);
      A* rho_cnt = reinterpret_cast<A*>(s + 2 * kHalf);
      if (lane == 0) stage_value(rho_cnt, st.rho + sj, async_rows);
      if (lane == 1) stage_value(rho_cnt + 1, st.cnt + sj, async_rows);
    }
    ptx::cp_async_commit();
  };

  // Take side: the slot being added (sums in the layout of warp_layer_norm_regs).
  int take_slot = 0, take_left = 0, take_pos = 0, n_routed = 0;
  std::int64_t sj = 0;
  A k[kLaneRegs], v[kLaneRegs], rho = A(0), cnt = A(0);
  for (int e = 0; e < kScatterDepth; ++e) issue(e);
  for (int e = 0; take_left > 0 || has_slot(take_slot); ++e) {
    ptx::cp_async_wait<kScatterDepth - 1>();
    warp_sync();  // row e, copied by every lane, is visible to all
    const unsigned char* s = stage(e);
    if (take_left > 0) {  // a token of the current slot: add its rows
      const int c = list[take_pos++];
      --take_left;
      const A* kg = reinterpret_cast<const A*>(s);
      const Win<S>* vr = reinterpret_cast<const Win<S>*>(s + kHalf);
      const A g = tokens.gate[c];
#pragma unroll
      for (int e2 = 0; e2 < kLaneRegs; ++e2) {  // channels past D, Dv: zeros in the stage
        k[e2] += kg[lane + kWarpSize * e2];
        v[e2] += gated_value(st.merge_gate_values, g, load_as<A>(vr[lane + kWarpSize * e2]));
      }
    } else {  // the next slot: its sums
      const int rel = slot_rel(take_slot++);
      sj = i * st.cap + lo + rel;
      n_routed = take_left = routed[rel];
      const A* sk = reinterpret_cast<const A*>(s);
      const A* sv = reinterpret_cast<const A*>(s + kHalf);
#pragma unroll
      for (int e2 = 0; e2 < kLaneRegs; ++e2) {  // channels past D, Dv: zeros in the stage
        k[e2] = sk[lane + kWarpSize * e2];
        v[e2] = sv[lane + kWarpSize * e2];
      }
      rho = sv[kWarpSize * kLaneRegs];
      cnt = sv[kWarpSize * kLaneRegs + 1];
    }
    warp_sync();  // every lane is done with stage e: refill it
    issue(e + kScatterDepth);
    if (take_left > 0) continue;
    // the slot's last row is in: store its sums and count, refresh its readout
    cnt += A(n_routed);  // the same as adding 1 per token: counts are exact
#pragma unroll
    for (int e2 = 0; e2 < kLaneRegs; ++e2) {
      const int d = lane + kWarpSize * e2;
      if (d < D) st.sk[sj * D + d] = k[e2];
      if (d < Dv) st.sv[sj * Dv + d] = v[e2];
    }
    if (lane == 0) st.cnt[sj] = cnt;
    warp_refresh_regs(st, sj, k, v, rho, cnt, tokens.ln, lane);
  }
}

// Readouts beside the update chain (kvm.cuh, ReadoutPipeline) keep several copies of the readout rows
// (khat, vhat): the scatter of an update writes the rows it refreshes into the next copy, and this
// kernel the others -- the sinks and the slots no token of the update was routed to -- copied from
// the live copy, so that the next copy then holds the whole state after the update. It runs on the
// aux stream beside the scatter (both write disjoint rows of the next copy, neither writes the live
// one): it needs only the update's merge targets (st.target, final once the routing pass is done).
// Rows [0, end): end = the slots after the update, or the sinks alone for the first update, whose
// scatter refreshes every non-sink slot. Sinks are never merge targets (routes start at st.sink).
// Block (i, y) covers slots [y * kCopySlotsPerBlock, ...) of item i, one warp a slot, 16-byte pieces:
// only bf16 rows of 64 or 128 channels (whole pieces, 16-byte aligned) take this path.
// grid (I, ceil(end / kCopySlotsPerBlock)), block kWarpSize * kWarpsPerBlock.
inline constexpr int kCopySlotsPerBlock = 64;

template <class S, class A>
__global__ void __launch_bounds__(kWarpSize* kWarpsPerBlock)
    copy_unrefreshed_rows_kernel(DeviceState<S, A> st, const S* __restrict__ khat_from, const S* __restrict__ vhat_from,
                                 S* __restrict__ khat_to, S* __restrict__ vhat_to, std::int64_t end) {
  __shared__ int routed[kCopySlotsPerBlock];  // nonzero: the scatter refreshes slot lo + s
  const std::int64_t i = blockIdx.x, lo = std::int64_t(blockIdx.y) * kCopySlotsPerBlock;
  const std::int64_t hi = lo + kCopySlotsPerBlock < end ? lo + kCopySlotsPerBlock : end;
  for (int s = threadIdx.x; s < kCopySlotsPerBlock; s += blockDim.x) routed[s] = 0;
  __syncthreads();
  for (std::int64_t c = threadIdx.x; c < st.C; c += blockDim.x) {
    const int t = st.target[i * st.C + c];
    if (t >= lo && t < hi) atomicOr(routed + (t - lo), 1);  // an atomic: many tokens may mark one slot
  }
  __syncthreads();
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  const int k_pieces = static_cast<int>(st.D * std::int64_t(sizeof(S)) / 16);
  const int pieces = k_pieces + static_cast<int>(st.Dv * std::int64_t(sizeof(S)) / 16);
  for (std::int64_t j = lo + warp; j < hi; j += kWarpsPerBlock) {
    if (routed[j - lo] != 0) continue;
    const std::int64_t sj = i * st.cap + j;
    const uint4* ks = reinterpret_cast<const uint4*>(khat_from + sj * st.D);
    const uint4* vs = reinterpret_cast<const uint4*>(vhat_from + sj * st.Dv);
    uint4* kd = reinterpret_cast<uint4*>(khat_to + sj * st.D);
    uint4* vd = reinterpret_cast<uint4*>(vhat_to + sj * st.Dv);
    for (int e = lane; e < pieces; e += kWarpSize) {
      if (e < k_pieces)
        kd[e] = ks[e];
      else
        vd[e - k_pieces] = vs[e - k_pieces];
    }
  }
}

// Update step 4 scatter. Block y covers the non-sink slots [lo, lo + per_block): it finds the first
// token routed to each (an integer atomicMin: the same result in any order) and deals its slots to its
// warps, as a stream of rows per warp in the register form (kInRegisters: head dims up to kWarpSize * kLaneRegs,
// scatter_warp_stream; async_rows: its rows are copied with 16-byte cp.async, scatter_rows_async), one
// at a time in the memory form (scatter_into_slot).
// Later updates take only the touched slots (those some token was routed to; at most C, listed in any
// order: each is one warp's work, independent of the others): an untouched slot's readout would be
// refreshed unchanged. The first update (every_slot) takes every slot: its slots may have been founded
// with the one-thread refresh (head dims above 128), and after it every non-sink slot carries the warp
// refresh, so later updates may skip untouched slots bit-exactly.
// grid (I, ceil((slots_after - sink) / per_block)), block kWarpSize * kWarpsPerBlock, smem
// scatter_shared_bytes(st, per_block).
template <class S, class A, bool kInRegisters>
__global__ void __launch_bounds__(kWarpSize* kWarpsPerBlock, 4)
    update_scatter_kernel(DeviceState<S, A> st, std::int64_t a, std::int64_t slots_after, std::int64_t per_block,
                          bool every_slot, bool async_rows) {
  extern __shared__ __align__(128) unsigned char smem_raw[];
  const std::int64_t i = blockIdx.x, C = st.C;
  unsigned char* stages = smem_raw;  // register form: [kWarpsPerBlock][kScatterDepth] stages (16-byte aligned)
  LnWeight<A>* ln = reinterpret_cast<LnWeight<A>*>(
      stages + (kInRegisters ? kWarpsPerBlock * kScatterDepth * scatter_stage_bytes<A>() : 0));  // register form: [D]
  const Win<S>** vrow = reinterpret_cast<const Win<S>**>(ln + (kInRegisters ? st.D : 0));        // [C]
  A* gate = reinterpret_cast<A*>(vrow + C);                                                      // [C]
  int* target = reinterpret_cast<int*>(gate + C);                                                // [C]
  int* first = target + C;            // [per_block] first[j - lo]: the first token routed to slot j, C if none
  int* routed = first + per_block;    // [per_block] routed[j - lo]: the number of tokens routed to slot j
  int* touched = routed + per_block;  // [min(per_block, C)] j - lo of the touched slots (not every_slot)
  int* n_touched = touched + (per_block < C ? per_block : C);
  int* lists = n_touched + 1;  // register form: [kWarpsPerBlock][C] the token lists of a warp's slots
  const std::int64_t lo = st.sink + std::int64_t(blockIdx.y) * per_block;
  const std::int64_t hi = (lo + per_block) < slots_after ? (lo + per_block) : slots_after;
  for (std::int64_t c = threadIdx.x; c < C; c += blockDim.x) {
    target[c] = st.target[i * C + c];
    if (kInRegisters) {  // token a + c: in the ring (the next chunk enters it after the scatter) or the inputs
      vrow[c] = token_value(st, i, a + c);
      gate[c] = token_gate(st, i, a + c);
    }
  }
  if (kInRegisters)
    for (std::int64_t d = threadIdx.x; d < st.D; d += blockDim.x) ln[d] = state_ln(st)[d];
  for (std::int64_t s = threadIdx.x; s < per_block; s += blockDim.x) {
    first[s] = static_cast<int>(C);
    routed[s] = 0;
  }
  if (threadIdx.x == 0) *n_touched = every_slot ? static_cast<int>(hi - lo) : 0;
  __syncthreads();
  // integer atomics: the minima, the counts and the set of touched slots do not depend on their order
  for (std::int64_t c = threadIdx.x; c < C; c += blockDim.x) {
    const int t = target[c];
    if (t < lo || t >= hi) continue;
    atomicMin(first + (t - lo), static_cast<int>(c));
    if (atomicAdd(routed + (t - lo), 1) == 0 && !every_slot)
      touched[atomicAdd(n_touched, 1)] = static_cast<int>(t - lo);
  }
  __syncthreads();
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize, n = *n_touched;
  const auto slot = [&](int p) { return every_slot ? p : touched[p]; };  // j - lo of the block's p-th slot
  if constexpr (!kInRegisters) {
    for (int p = warp; p < n; p += kWarpsPerBlock) scatter_into_slot(st, i, lo + slot(p), target, first[slot(p)], lane);
  } else {
    const ScatterTokens<S, A> tokens{target, vrow, gate, ln};
    scatter_warp_stream(st, i, lo, tokens, first, routed, slot, n, async_rows,
                        stages + warp * kScatterDepth * scatter_stage_bytes<A>(), lists + warp * C, warp, lane);
  }
}

// Dynamic shared memory of update_scatter_kernel (the memory form leaves its stages, the LN weights,
// vrow, gate and the token lists unused).
template <class S, class A>
std::size_t scatter_shared_bytes(const DeviceState<S, A>& st, std::int64_t per_block) {
  const std::int64_t C = st.C, touched = per_block < C ? per_block : C;
  std::size_t bytes = std::size_t(C) * (sizeof(const Win<S>*) + sizeof(A) + sizeof(int)) +
                      std::size_t(2 * per_block + touched + 1) * sizeof(int);
  if (scatter_in_registers(st))
    bytes += std::size_t(kWarpsPerBlock) * (kScatterDepth * scatter_stage_bytes<A>() + std::size_t(C) * sizeof(int)) +
             std::size_t(st.D) * sizeof(LnWeight<A>);
  return bytes;
}

// Whether the register-form scatter may copy its rows with 16-byte cp.async: every row it copies (the
// sums, the kg rows and the tokens' value rows in the ring or the call's inputs) is a whole number of
// 16-byte pieces starting on a 16-byte boundary. Other shapes copy them with plain loads.
template <class S, class A>
bool scatter_rows_async(const DeviceState<S, A>& st) {
  const auto aligned = [](const void* p) { return reinterpret_cast<std::uintptr_t>(p) % 16 == 0; };
  const bool rows = st.D * std::int64_t(sizeof(A)) % 16 == 0 && st.Dv * std::int64_t(sizeof(A)) % 16 == 0 &&
                    st.Dv * std::int64_t(sizeof(Win<S>)) % 16 == 0;
  return rows && aligned(st.sk) && aligned(st.sv) && aligned(st.kg) && aligned(st.wv) &&
         (st.in_v == nullptr || aligned(st.in_v));
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
  constexpr int kQ = kInRegisters ? kD / kLanesPerRow : 1;  // dims per lane (registers)
  constexpr int kV = kInRegisters ? kDv / kLanesPerRow : 1;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  const std::int64_t D = kInRegisters ? kD : st.D, Dv = kInRegisters ? kDv : st.Dv, Hq = st.Hq;
  A* ks = reinterpret_cast<A*>(smem_raw);      // [kKeyTile, D]
  A* vs = ks + kKeyTile * D;                   // [kKeyTile, Dv]
  A* qs = vs + kKeyTile * Dv;                  // [rows, D + pad]   (shared-memory path only)
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
    for (std::int64_t d = lane; d < D; d += kLanesPerRow)
      qs[row * (D + kRowPad) + d] = active ? load_as<A>(qrow[d]) : A(0);
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
        ks[e] = s >= n       ? A(0)
                : phase == 0 ? readout_key(st, item * st.cap + base + s, d)
                             : load_as<A>(st.wk[(item * st.W + (base + s) % st.W) * D + d]);
      }
      for (std::int64_t e = threadIdx.x; e < kKeyTile * Dv; e += blockDim.x) {
        const std::int64_t s = e / Dv, d = e % Dv;
        vs[e] = s >= n       ? A(0)
                : phase == 0 ? readout_value(st, item * st.cap + base + s, d)
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
        part += warp_shfl_xor(part, 1);
        part += warp_shfl_xor(part, 2);
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
      for (int s = 0; s < kKeyTile; ++s) {      // fully unrolled: logit[] stays in registers
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

// What a pass of the matrix-unit novelty and routing kernels (kvm_route_tc.cuh on NVIDIA,
// kvm_route_mfma.cuh on AMD) computes (argmax: the first slot of the largest value, the host's
// sequential scan). An update that appends scans the pre-update slots once: with g > 0, argmax_j kg .
// K^+_j equals argmax_j k0 . K^+_j (spec 4.5), and merges change no slot before the routes are taken, so
// the novelty pass also gives the best old slot of every token, and the routing pass then only scans the
// appended slots (a handful per update once the state is large).
enum RtMode : int {
  kRtNovelty = 0,   // st.score[c] = max_{j in [j0, j1)} k0_c . K^_j (every slot, sink included), and the
                    // route candidate st.rbest[c], st.target[c] = max, argmax_{j in [max(j0, sink), j1)}
  kRtRoute = 1,     // no appends: for tokens with target != -1, st.target[c] = argmax_{j in [j0, j1)} kg_c . K^_j
  kRtRouteNew = 2,  // after appends, slots [j0, j1) = the appended ones: for tokens with target != -1,
                    // st.target[c] = that argmax of k0_c . K^+_j if its value exceeds st.rbest[c]
};

// Where a matrix-unit readout (kvm_attend_tc.cuh on NVIDIA, kvm_attend_mfma.cuh on AMD) finds its keys.
// The slots: the state's readout copies (khat, vhat). The window: the ring (position p at row p mod W),
// or the call's own k/v inputs (position p at row p - n0), which hold every window position of a chunk
// whose window starts inside the call.
struct TcSources {
  const bf16* khat;    // [I, cap, D]
  const bf16* vhat;    // [I, cap, Dv]
  const bf16* wk;      // ring [I, W, D] or inputs [I, T, D]
  const bf16* wv;      // ring [I, W, Dv] or inputs [I, T, Dv]
  std::int64_t rows;   // rows per item of wk, wv: W or T
  std::int64_t first;  // inputs: the position of row 0 (n0)
  bool ring;
};

// One warp merges `parts` normalised partial results (po[p*Dv + d], log-sum-exp pl[p]) in order p =
// 0, 1, ... into po[0, Dv) and returns the merged log-sum-exp: the exact merge of core/softmax.hpp
// merge_partials, in a fixed order so decode is deterministic.
template <class A>
__device__ A warp_merge_partials(A* po, const A* pl, int parts, std::int64_t Dv, int lane) {
  A lse = pl[0];
  for (int p = 1; p < parts; ++p) {
    const A lse_b = pl[p];
    const A top = lse > lse_b ? lse : lse_b;
    if (top == negative_infinity<A>()) continue;
    const A wa = lse == negative_infinity<A>() ? A(0) : exp(lse - top);
    const A wb = lse_b == negative_infinity<A>() ? A(0) : exp(lse_b - top);
    for (std::int64_t d = lane; d < Dv; d += kWarpSize) po[d] = (wa * po[d] + wb * po[p * Dv + d]) / (wa + wb);
    lse = top + log(wa + wb);
  }
  warp_sync();
  return lse;
}

inline constexpr int kMaxSplitsPerRow = 32;  // one lane per split in the merge (KvmState::kMaxDecodeSplits)

// The weights of a merge of split partials: lane s holds split s's log-sum-exp l (-inf where there is
// no split s) and gets exp(l - the warp's largest l) (0 for -inf); *total is their sum over the warp, in
// a fixed shuffle order (deterministic). Called by a whole warp.
template <class A>
__device__ A warp_split_weight(A l, A* total) {
  A top = l;
#pragma unroll
  for (int off = kWarpSize / 2; off > 0; off >>= 1) {
    const A o = warp_shfl_xor(top, off);
    top = top > o ? top : o;
  }
  const A w = l == negative_infinity<A>() ? A(0) : exp(l - top);
  *total = warp_sum(w);
  return w;
}

// Ends decode split blockIdx.y of row bh (called by one warp; po[0, Dv) holds the split's normalised
// partial, lse its log-sum-exp). With one split the block writes out[bh] itself. Otherwise it
// publishes the partial, and the last split to finish (an integer counter per row: no float
// atomics) merges all partials in split order -- the same result whichever block arrives last --
// and resets the counter for the next step, so a captured step replays as is.
template <class S, class A, class Out>
__device__ void finish_decode_split(const DeviceState<S, A>& st, const A* po, A lse, Out* out, std::int64_t bh,
                                    int splits, int lane) {
  const std::int64_t Dv = st.Dv;
  if (splits == 1) {
    for (std::int64_t d = lane; d < Dv; d += kWarpSize) out[bh * Dv + d] = store_as<Out>(po[d]);
    return;
  }
  A* base = st.partial + bh * st.max_splits * (Dv + 1);
  A* mine = base + std::int64_t(blockIdx.y) * (Dv + 1);
  for (std::int64_t d = lane; d < Dv; d += kWarpSize) mine[d] = po[d];
  if (lane == 0) mine[Dv] = lse;
  __threadfence();  // the partial is visible device-wide before the count says so
  warp_sync();
  int last = 0;
  if (lane == 0) last = atomicAdd(st.counter + bh, 1) == splits - 1 ? 1 : 0;
  last = warp_shfl(last, 0);
  if (!last) return;
  __threadfence();
  // the exact merge of every split (L2 reads: other blocks wrote them during this kernel). Lane s
  // holds split s's log-sum-exp; its weight goes to shared memory, and each output channel then
  // reads every split's value with independent loads (no chain of dependent round trips).
  __shared__ A weight[kMaxSplitsPerRow];
  const A l = lane < splits ? load_cg(base + std::int64_t(lane) * (Dv + 1) + Dv) : negative_infinity<A>();
  A total;
  const A wl = warp_split_weight(l, &total);
  weight[lane] = wl;
  warp_sync();
  for (std::int64_t d = lane; d < Dv; d += kWarpSize) {
    A o = A(0);
#pragma unroll 8
    for (int s = 0; s < splits; ++s) o += weight[s] * load_cg(base + s * (Dv + 1) + d);
    out[bh * Dv + d] = store_as<Out>(o / total);
  }
  if (lane == 0) st.counter[bh] = 0;
}

// The decode token (position pos) enters its item's window ring; called by one block per item (the
// split-0 block of the item's first query head). Blocks never read that ring row in this step: it
// held position pos - W, outside the window, and the token itself is read from the inputs.
// k1: [B,Hk,1,D], v1: [B,Hk,1,Dv], g1: [B,Hk,1]
template <class S, class A, class In>
__device__ void ingest_decode_token(const DeviceState<S, A>& st, const In* k1, const In* v1, const In* g1,
                                    std::int64_t item, std::int64_t pos) {
  const std::int64_t ring = pos % st.W;
  for (std::int64_t d = threadIdx.x; d < st.D; d += blockDim.x)
    st.wk[(item * st.W + ring) * st.D + d] = store_as<Win<S>>(load_as<A>(k1[item * st.D + d]));
  for (std::int64_t d = threadIdx.x; d < st.Dv; d += blockDim.x)
    st.wv[(item * st.W + ring) * st.Dv + d] = store_as<Win<S>>(load_as<A>(v1[item * st.Dv + d]));
  if (threadIdx.x == 0) st.wg[item * st.W + ring] = load_as<A>(g1[item]);
}

// Fused decode step (spec 4.7 steps 1 and 6), split-K: block (bh, split) covers keys [split*per, ...)
// of the virtual key list [slots | window [w, pos]]; each warp takes every 4th key, lanes split the
// head dims. The block of the item's first head and split 0 also appends the token to the ring;
// the last split to finish merges (finish_decode_split). One launch per step.
// grid (B*Hq, splits), block 128, dynamic smem (D + 4 Dv + 4) * sizeof(A).
// q: [B,Hq,1,D], k1: [B,Hk,1,D], v1: [B,Hk,1,Dv], g1: [B,Hk,1], out: [B,1,Hq,Dv]
template <class S, class A, class In, class Out>
__global__ void decode_fused_kernel(DeviceState<S, A> st, const In* q, const In* k1, const In* v1, const In* g1,
                                    Out* out, std::int64_t pos, std::int64_t w, std::int64_t slots,
                                    std::int64_t per_split, int splits) {
  constexpr int kWarps = 4;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  const std::int64_t D = st.D, Dv = st.Dv, Hq = st.Hq;
  A* qs = reinterpret_cast<A*>(smem_raw);  // [D]
  A* po = qs + D;                          // [kWarps, Dv]
  A* pl = po + kWarps * Dv;                // [kWarps]
  // kvm_run launches decode steps as dependent launches (ptx.cuh): hides a launch latency per step
  ptx::wait_for_previous_grid();
  ptx::allow_next_grid();
  const std::int64_t bh = blockIdx.x, b = bh / Hq, h = bh % Hq, item = b * st.Hk + h / st.rep();
  if (blockIdx.y == 0 && h % st.rep() == 0) ingest_decode_token(st, k1, v1, g1, item, pos);
  for (std::int64_t d = threadIdx.x; d < D; d += blockDim.x) qs[d] = load_as<A>(q[bh * D + d]);
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  for (std::int64_t d = lane; d < Dv; d += kWarpSize) po[warp * Dv + d] = A(0);
  __syncthreads();
  const std::int64_t n_state = w > 0 ? slots : 0;
  const std::int64_t total = n_state + (pos - w + 1);
  const std::int64_t k_begin = std::int64_t(blockIdx.y) * per_split;
  const std::int64_t k_end = (k_begin + per_split) < total ? (k_begin + per_split) : total;
  const A ls_state = st.scale * (st.head_temps ? st.tau_s[h] : A(1));
  const A ls_window = st.scale * (st.head_temps ? st.tau_w[h] : A(1));
  const In* knew = k1 + item * D;
  const In* vnew = v1 + item * Dv;
  OnlineSoftmax<A> sm;
  for (std::int64_t x = k_begin + warp; x < k_end; x += kWarps) {
    const bool in_state = x < n_state;
    const bool is_new = x == total - 1;  // the decode token: from the inputs, rounded as the ring stores it
    // a slot row (readout copy, with its scale for fp8) or a ring row (window type)
    const std::int64_t sj = item * st.cap + (in_state ? x : 0), ring = in_state ? 0 : (w + x - n_state) % st.W;
    const S* kr = st.khat + sj * D;
    const S* vr = st.vhat + sj * Dv;
    const Win<S>* wkr = st.wk + (item * st.W + ring) * D;
    const Win<S>* wvr = st.wv + (item * st.W + ring) * Dv;
    A part = A(0);
    if (is_new) {
      for (std::int64_t d = lane; d < D; d += kWarpSize)
        part += qs[d] * load_as<A>(store_as<Win<S>>(load_as<A>(knew[d])));
    } else if (in_state) {
      for (std::int64_t d = lane; d < D; d += kWarpSize) part += qs[d] * load_as<A>(kr[d]);
    } else {
      for (std::int64_t d = lane; d < D; d += kWarpSize) part += qs[d] * load_as<A>(wkr[d]);
    }
#pragma unroll
    for (int off = kWarpSize / 2; off > 0; off >>= 1) part += warp_shfl_xor(part, off);
    if constexpr (is_row_scaled_v<S>)
      if (in_state) part *= A(st.khat_scale[sj]);
    typename OnlineSoftmax<A>::Step step = sm.push((in_state ? ls_state : ls_window) * part);
    if constexpr (is_row_scaled_v<S>)
      if (in_state) step.weight *= A(st.vhat_scale[sj]);  // the rescale stays unscaled
    for (std::int64_t d = lane; d < Dv; d += kWarpSize) {
      const A val = is_new     ? load_as<A>(store_as<Win<S>>(load_as<A>(vnew[d])))
                    : in_state ? load_as<A>(vr[d])
                               : load_as<A>(wvr[d]);
      po[warp * Dv + d] = po[warp * Dv + d] * step.rescale + step.weight * val;
    }
  }
  if (lane == 0) pl[warp] = sm.lse();
  for (std::int64_t d = lane; d < Dv; d += kWarpSize) po[warp * Dv + d] *= sm.normaliser();
  __syncthreads();
  if (warp != 0) return;
  const A lse = warp_merge_partials(po, pl, kWarps, Dv, lane);
  finish_decode_split(st, po, lse, out, bh, splits, lane);
}

// decode_fused_kernel for bf16 storage, D = Dv = 128 and fp32 accumulation, built for memory-level
// parallelism and a short chain of dependent latencies (a decode step reads every visible key once, so
// it is bound by bytes at large batches and by latency at batch 1):
// - each warp streams its own keys global -> shared memory (cp.async) in units of kDecodeWarpKeys K and
//   V rows, kDecodeWarpStages - 1 units in flight while it computes on the oldest one; a warp waits only
//   for its own copies (no block barrier in the loop, so one slow load stalls one warp, not the block);
// - the splits of a row form one thread-block cluster: they merge through distributed shared memory
//   (two cluster barriers) instead of global partials, a fence and a counter;
// - the host sizes the split count so the whole grid is resident at once (one wave).
// Unit u of a split holds its keys [u * kDecodeWarpKeys, ...); warp w takes units w, w + 4, ... Each
// half-warp takes half of a unit's keys; a lane holds 8 channels of q and of its output for each of
// the block's kHeads query heads, which share one KV head: every key and value row a block reads
// serves all of them (rather than reading the cache once per query head). Each head's arithmetic is
// that of kHeads = 1.
// The decode token (the last key of the last split) comes from the inputs, rounded as the ring stores
// it, exactly as in decode_fused_kernel.
// grid (B*Hq/kHeads, splits), cluster (1, splits, 1), block kDecodeThreads, dynamic smem kDecodeSmemBytes.
//
// Each warp runs its own ring of units rather than block-wide stages behind a __syncthreads: a
// block-wide stage waits for the slowest of its copies, so the barriers, not the bytes in flight, would
// set the pace.
inline constexpr int kDecodeThreads = 128;
inline constexpr int kDecodeWarpKeys = 8;    // keys per warp unit: 4 per half-warp
inline constexpr int kDecodeWarpStages = 3;  // units per warp ring: 2 in flight while one is read
inline constexpr int kDecodeMaxCluster = 8;  // the portable cluster size bounds the splits of a row
inline constexpr int kDecodeDim = 128;
// a split's keys come in whole rounds of one unit per warp
inline constexpr int kDecodeSplitGranule = kDecodeWarpKeys * (kDecodeThreads / kWarpSize);
// K and V rows of every warp's ring; 48 KB, the most a kernel may use without opting in per device.
inline constexpr std::size_t kDecodeSmemBytes =
    std::size_t(kDecodeThreads / kWarpSize) * kDecodeWarpStages * kDecodeWarpKeys * 2 * kDecodeDim * 2;
inline constexpr int kDecodeBlocksPerSm = 4;  // __launch_bounds__ below; 4 x 48 KB of shared memory fit an SM
// the merge of 4 heads (partials, log-sum-exps, results, split weights) reuses the rings
static_assert((4 * (2 * kDecodeThreads / kWarpSize) * (kDecodeDim + 1) + 4 * (kDecodeDim + 1) +
               4 * (kDecodeMaxCluster + 1)) *
                      sizeof(float) <=
                  kDecodeSmemBytes,
              "the decode merge fits the rings' shared memory");

// Split-K plan of a decode step: `splits` blocks per row, `per` keys each (the last one fewer, none empty).
struct DecodeSplits {
  std::int64_t splits, per;
};
// As many splits as fit `resident` blocks in one wave (at most max_splits, at least `granule` keys
// each); `per` is a whole number of granules, so every split but the last reads whole rounds.
inline DecodeSplits decode_splits(std::int64_t rows, std::int64_t keys, std::int64_t resident, std::int64_t max_splits,
                                  std::int64_t granule) {
  std::int64_t splits = std::min(resident / rows, (keys + granule - 1) / granule);
  splits = std::clamp<std::int64_t>(splits, 1, max_splits);
  std::int64_t per = (keys + splits - 1) / splits;
  per = (per + granule - 1) / granule * granule;
  return {(keys + per - 1) / per, per};
}

// Query heads per block of decode_fused_bf16_kernel for `rows` query rows (B Hq), `rep` query heads
// per KV head and `resident` blocks in one wave: the heads of a group that share a block read their
// keys and values once (4 at most: each head keeps 8 channels of q and of its output per lane in
// registers). That pays only when the rows alone fill the device at the most splits a row takes; with
// fewer rows the step is bound by latency, and a block per head keeps more blocks in flight.
inline int decode_heads_per_block(std::int64_t rows, std::int64_t rep, std::int64_t resident) {
  if (rows * kDecodeMaxCluster <= resident) return 1;
  return rep % 4 == 0 ? 4 : rep % 2 == 0 ? 2 : 1;
}

#if KVMEM_GPU_VENDOR_PATHS  // cp.async rings and a cluster merge: NVIDIA sm_90 only
template <class In, class Out, int kHeads>
__global__ void __launch_bounds__(kDecodeThreads, kDecodeBlocksPerSm)
    decode_fused_bf16_kernel(DeviceState<bf16, float> st, const In* q, const In* k1, const In* v1, const In* g1,
                             Out* out, std::int64_t pos, std::int64_t w, std::int64_t slots, std::int64_t per_split,
                             int splits) {
  constexpr int kDim = kDecodeDim, kWarps = kDecodeThreads / kWarpSize, kHalves = 2 * kWarps, kPer = 8, kRow = 2 * kDim;
  constexpr int kUnit = kDecodeWarpKeys, kKeysPerHalf = kUnit / 2, kStages = kDecodeWarpStages;
  static_assert(kDecodeThreads >= kDim, "the merge gives every output channel its own thread");
  static_assert(kHeads <= kWarps, "the cluster merge gives every head a warp");
  constexpr float kNegInf = negative_infinity<float>();
  extern __shared__ __align__(128) unsigned char smem_raw[];  // one symbol in kvm_detail: every declaration says 128
  // kvm_run launches decode steps as dependent launches (ptx.cuh): hides a launch latency per step
  ptx::wait_for_previous_grid();
  ptx::allow_next_grid();
  // this block's query heads h0 .. h0 + kHeads - 1 (rows bh0 ..) share KV head item
  const std::int64_t Hq = st.Hq, blocks_per_b = Hq / kHeads, b = blockIdx.x / blocks_per_b;
  const std::int64_t h0 = (blockIdx.x % blocks_per_b) * kHeads, bh0 = b * Hq + h0, item = b * st.Hk + h0 / st.rep();
  const std::int64_t n_state = w > 0 ? slots : 0;
  const std::int64_t total = n_state + (pos - w + 1);
  const std::int64_t k_begin = std::int64_t(blockIdx.y) * per_split;
  const int n_keys = static_cast<int>((k_begin + per_split < total ? k_begin + per_split : total) - k_begin);
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const int n_units = (n_keys + kUnit - 1) / kUnit;
  const int my_units = n_units > warp ? (n_units - warp + kWarps - 1) / kWarps : 0;
  // this warp's ring: [kStages][kUnit keys][K row | V row]
  bf16* ring = reinterpret_cast<bf16*>(smem_raw) + std::size_t(warp) * kStages * kUnit * kRow;
  // window keys lie within W positions of w: their ring rows follow from w's with 32-bit arithmetic
  const int ring_len = static_cast<int>(st.W), w_ring = static_cast<int>(w % st.W);

  // The warp's j-th unit. A key row pair (K | V) is 32 pieces of 16 bytes: lane l copies piece l of
  // every key of the unit (K channels 8l.. for l < 16, else V), so its channel and arrays never change;
  // keys past the split read nothing and leave zeros.
  const bool copies_v = lane >= kDim / 8;
  const int chan = (lane % (kDim / 8)) * 8;
  const bf16* state_rows = (copies_v ? st.vhat : st.khat) + item * st.cap * kDim + chan;
  const bf16* ring_rows = (copies_v ? st.wv : st.wk) + item * st.W * kDim + chan;
  const In* token = (copies_v ? v1 : k1) + item * kDim + chan;
  const auto issue = [&](int j) {
    bf16* buf = ring + (j % kStages) * kUnit * kRow;
    const int first = (warp + j * kWarps) * kUnit;
#pragma unroll
    for (int key = 0; key < kUnit; ++key) {
      bf16* dst = buf + key * kRow + lane * 8;
      const int x_in = first + key;
      const std::int64_t x = k_begin + x_in;
      if (x_in >= n_keys) {
        ptx::cp_async16(dst, st.khat, 0);
      } else if (x == total - 1) {  // the decode token: from the inputs, rounded as the ring stores it
        alignas(16) bf16 piece[8];
#pragma unroll
        for (int e = 0; e < 8; ++e) piece[e] = store_as<bf16>(load_as<float>(token[e]));
        *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(piece);
      } else if (x < n_state) {
        ptx::cp_async16(dst, state_rows + x * kDim, 16);
      } else {  // window position w + (x - n_state), at ring row (w mod W + x - n_state) mod W
        int r = w_ring + static_cast<int>(x - n_state);
        if (r >= ring_len) r -= ring_len;
        ptx::cp_async16(dst, ring_rows + std::int64_t(r) * kDim, 16);
      }
    }
    ptx::cp_async_commit();
  };
  for (int j = 0; j < kStages - 1; ++j) {
    if (j < my_units)
      issue(j);
    else
      ptx::cp_async_commit();  // empty group: every iteration below waits on the same count
  }
  // while the first units are in flight: the ring append and this lane's channels of q
  if (blockIdx.y == 0 && h0 % st.rep() == 0) ingest_decode_token(st, k1, v1, g1, item, pos);
  const int half = threadIdx.x / 16, l = threadIdx.x % 16, in_unit = (lane / 16) * kKeysPerHalf;
  float qr[kHeads][kPer], acc[kHeads][kPer], ls_state[kHeads], ls_window[kHeads];
  OnlineSoftmax<float> sm[kHeads];
#pragma unroll
  for (int hh = 0; hh < kHeads; ++hh) {
#pragma unroll
    for (int e = 0; e < kPer; ++e) {
      qr[hh][e] = load_as<float>(q[(bh0 + hh) * kDim + l * kPer + e]);
      acc[hh][e] = 0.0f;
    }
    ls_state[hh] = st.scale * (st.head_temps ? st.tau_s[h0 + hh] : 1.0f);
    ls_window[hh] = st.scale * (st.head_temps ? st.tau_w[h0 + hh] : 1.0f);
  }
  for (int j = 0; j < my_units; ++j) {
    ptx::cp_async_wait<kStages - 2>();  // this lane's pieces of unit j have landed
    warp_sync();                        // every lane's have, and unit j - 1's buffer is free
    if (j + kStages - 1 < my_units)
      issue(j + kStages - 1);
    else
      ptx::cp_async_commit();
    const bf16* buf = ring + (j % kStages) * kUnit * kRow;
    const int first = (warp + j * kWarps) * kUnit;
    // each key's row is read once for every head of the block
    float logit[kHeads][kKeysPerHalf], group_max[kHeads];
#pragma unroll
    for (int hh = 0; hh < kHeads; ++hh) group_max[hh] = kNegInf;
#pragma unroll
    for (int u = 0; u < kKeysPerHalf; ++u) {
      const int key = in_unit + u, x_in = first + key;
      const uint4 kv = reinterpret_cast<const uint4*>(buf + key * kRow)[l];
      const bf16* kb = reinterpret_cast<const bf16*>(&kv);
      float kf[kPer];
#pragma unroll
      for (int e = 0; e < kPer; ++e) kf[e] = load_as<float>(kb[e]);
      const bool live = x_in < n_keys, in_state = k_begin + x_in < n_state;
#pragma unroll
      for (int hh = 0; hh < kHeads; ++hh) {
        float part = 0.0f;
#pragma unroll
        for (int e = 0; e < kPer; ++e) part += qr[hh][e] * kf[e];
#pragma unroll
        for (int off = 8; off > 0; off >>= 1) part += warp_shfl_xor(part, off);  // within the half
        logit[hh][u] = live ? (in_state ? ls_state[hh] : ls_window[hh]) * part : kNegInf;
        group_max[hh] = logit[hh][u] > group_max[hh] ? logit[hh][u] : group_max[hh];
      }
    }
#pragma unroll
    for (int hh = 0; hh < kHeads; ++hh) {
      const float rescale = sm[hh].raise_max(group_max[hh]);
      if (rescale != 1.0f) {
#pragma unroll
        for (int e = 0; e < kPer; ++e) acc[hh][e] *= rescale;
      }
    }
#pragma unroll
    for (int u = 0; u < kKeysPerHalf; ++u) {
      const uint4 vv = reinterpret_cast<const uint4*>(buf + (in_unit + u) * kRow + kDim)[l];
      const bf16* vb = reinterpret_cast<const bf16*>(&vv);
      float vf[kPer];
#pragma unroll
      for (int e = 0; e < kPer; ++e) vf[e] = load_as<float>(vb[e]);
#pragma unroll
      for (int hh = 0; hh < kHeads; ++hh) {
        const float wgt = sm[hh].accumulate(logit[hh][u]);  // 0 for masked keys (their rows hold zeros)
#pragma unroll
        for (int e = 0; e < kPer; ++e) acc[hh][e] += wgt * vf[e];
      }
    }
  }
  ptx::cp_async_wait<0>();
  __syncthreads();  // every unit consumed: the rings now hold the merge

  // Per head: the block's kHalves half-warp partials -> one (o, lse), in half order (thread d merges
  // channel d); then the splits of the row, in split order, by the cluster's first block. Fixed orders:
  // deterministic.
  float* po = reinterpret_cast<float*>(smem_raw);  // [kHeads][kHalves][kDim] normalised partials
  float* pl = po + kHeads * kHalves * kDim;        // [kHeads][kHalves] their log-sum-exps
  float* res = pl + kHeads * kHalves;              // [kHeads][kDim + 1] the block's (o, lse): read by the cluster
  float* wsplit = res + kHeads * (kDim + 1);       // [kHeads][kDecodeMaxCluster + 1] split weights, then their sum
#pragma unroll
  for (int hh = 0; hh < kHeads; ++hh) {
    const float norm = sm[hh].normaliser();
#pragma unroll
    for (int e = 0; e < kPer; ++e) po[(hh * kHalves + half) * kDim + l * kPer + e] = acc[hh][e] * norm;
    if (l == 0) pl[hh * kHalves + half] = sm[hh].lse();
  }
  __syncthreads();
  if (threadIdx.x < kDim) {
    for (int hh = 0; hh < kHeads; ++hh) {
      const float* hpl = pl + hh * kHalves;
      float top = kNegInf;
      for (int p = 0; p < kHalves; ++p) top = hpl[p] > top ? hpl[p] : top;
      float o = 0.0f, sum = 0.0f;
      for (int p = 0; p < kHalves; ++p) {
        const float wp = hpl[p] == kNegInf ? 0.0f : expf(hpl[p] - top);
        o += wp * po[(hh * kHalves + p) * kDim + threadIdx.x];
        sum += wp;
      }
      // sum >= 1 (the largest weight is exactly 1) unless the block saw no key: the host never plans
      // an empty split, but one would contribute nothing rather than NaN
      const float o_norm = sum > 0.0f ? o / sum : 0.0f;
      if (splits == 1) {
        out[(bh0 + hh) * kDim + threadIdx.x] = store_as<Out>(o_norm);
      } else {
        res[hh * (kDim + 1) + threadIdx.x] = o_norm;
        if (threadIdx.x == 0) res[hh * (kDim + 1) + kDim] = sum > 0.0f ? top + logf(sum) : kNegInf;
      }
    }
  }
  if (splits == 1) return;
  ptx::cluster_sync();  // every split's (o, lse) is visible to the cluster
  if (blockIdx.y == 0) {
    if (warp < kHeads) {  // warp hh, lane s reads split s's log-sum-exp of head hh
      float* hres = res + warp * (kDim + 1);
      const float lse = lane < splits ? ptx::load_cluster(ptx::cluster_address(hres + kDim, lane)) : kNegInf;
      float total_w;
      const float wl = warp_split_weight(lse, &total_w);
      float* hw = wsplit + warp * (kDecodeMaxCluster + 1);
      if (lane < splits) hw[lane] = wl;
      if (lane == 0) hw[kDecodeMaxCluster] = total_w;
    }
    __syncthreads();
    if (threadIdx.x < kDim) {
      for (int hh = 0; hh < kHeads; ++hh) {
        const float* hw = wsplit + hh * (kDecodeMaxCluster + 1);
        float o = 0.0f;
        for (int s = 0; s < splits; ++s)
          o += hw[s] * ptx::load_cluster(ptx::cluster_address(res + hh * (kDim + 1) + threadIdx.x, s));
        out[(bh0 + hh) * kDim + threadIdx.x] = store_as<Out>(o / hw[kDecodeMaxCluster]);
      }
    }
  }
  ptx::cluster_sync();  // no block leaves while the first one may still read its shared memory
}
#endif  // KVMEM_GPU_VENDOR_PATHS

}  // namespace kvmem::cuda::kvm_detail
