// SPDX-License-Identifier: Apache-2.0
#pragma once
// Prune rules on the CUDA backend (policy/prune.hpp, spec UA.md 4.5). Included by backend/cuda/ua.cuh;
// not a public API.
//
// A threshold rule (prune::Threshold, PerLayer: the evictor prune::LogThreshold) has one cut for every
// item, ln p, which the fused kernels of ua_kernels.cuh apply where they meet each row. Any other rule
// (prune::KeepTop, a user rule) asks its evictor for a cut over all of an item's entries, so the cut of
// an item is known only once every λ of the step is final, before the first row is evicted:
//   prefill_cut_kernel  grid (items): after a chunk's merge and before its finish, the cut over the item's
//       cached rows (λ at the chunk end, written by the chunk kernel) and the chunk's own keys (λ in
//       lambda_new); finish_kernel then evicts by it;
//   decode_cut_kernel   grid (items): before a decode step's attention, λ_j += A_{j,t} for every cached
//       row (kernel/ua_decay.hpp's lambda_update, the host's body) and the cut over those rows and the new
//       token (λ = 0, position t); decode_attend_kernel then reads λ as it is (DeviceCall::lambda_updated)
//       and evicts by the cut.
// Both store the cut in DeviceCall-visible scratch (cuts[item]); the eviction test of every kernel is
// ua_detail::evict_test(cut, λ, position). A cut reads every row in use as an entry, so the calls drop
// the rows a decode marked dead before the first cut (compact_kernel).
//
// The cut runs on the item's block: prune::TopCut (KeepTop) block-parallel (each thread ranks some entries
// against all the others, O(n^2 / threads)); any other evictor's cut(entries) on the block's first thread,
// reading the entries from global memory, as the Kokkos backend runs it on one thread of a team.

#include "kvmem/backend/cuda/vendor.cuh"

#include <cstdint>
#include <type_traits>

#include "kvmem/backend/cuda/ua_kernels.cuh"
#include "kvmem/kernel/ua_decay.hpp"
#include "kvmem/policy/prune.hpp"

namespace kvmem::cuda::ua_detail {

inline constexpr int kCutThreads = 256;

// The entries of one item as an evictor's cut reads them (policy/prune.hpp: size(), lambda(e), pos(e)):
// the item's n rows in use in logical order, then `extra` entries of the call (a decode step's new token,
// λ = 0; a prefill chunk's keys, λ from extra_lambda) at positions first, first + 1, ... λ is read through
// the device-wide cache: other blocks of earlier launches, or this block, wrote it.
template <class S>
struct DeviceEntries {
  const DeviceCache<S>* c;
  std::int64_t item, n, extra;
  const float* extra_lambda;  // [extra], or nullptr: every extra entry has λ = 0
  std::int64_t first;         // position of extra entry 0

  __device__ std::int64_t size() const { return n + extra; }
  __device__ double lambda(std::int64_t e) const {
    if (e < n) return static_cast<double>(load_cg(c->lambda + c->row(item, e)));
    return extra_lambda != nullptr ? static_cast<double>(extra_lambda[e - n]) : 0.0;
  }
  __device__ std::int64_t pos(std::int64_t e) const { return e < n ? c->pos[c->row(item, e)] : first + (e - n); }
};

// The evictor's cut over `entries`, in every thread of the block (one call per block and kernel: the
// shared words are not reused). prune::TopCut: the entry with exactly k - 1 entries ordering above it (λ
// first, then position; positions are distinct, so it is unique), found by the block's threads in parallel,
// the same answer as TopCut::cut; any other evictor: cut(entries) on thread 0.
template <class Ev, class Entries>
__device__ inline prune::Cut block_cut(const Ev& ev, const Entries& entries) {
  __shared__ double cut_log_p, cut_lambda;
  __shared__ long long cut_pos;
  __shared__ int cut_ranked;
  if constexpr (std::is_same_v<Ev, prune::TopCut>) {
    if (threadIdx.x == 0) {
      cut_log_p = ev.log_p;
      cut_ranked = 0;
    }
    __syncthreads();
    const std::int64_t n = entries.size(), k = ev.k;
    if (n > k)
      for (std::int64_t i = threadIdx.x; i < n; i += blockDim.x) {
        const double li = entries.lambda(i);
        const std::int64_t pi = entries.pos(i);
        std::int64_t above = 0;  // entries ordering above i
        for (std::int64_t j = 0; j < n && above < k; ++j) {
          const double lj = entries.lambda(j);
          above += (lj > li || (lj == li && entries.pos(j) > pi)) ? 1 : 0;
        }
        if (above == k - 1) {  // the k-th entry: everything ordering below it goes
          cut_lambda = li;
          cut_pos = pi;
          cut_ranked = 1;
        }
      }
  } else {
    if (threadIdx.x == 0) {
      const prune::Cut c = ev.cut(entries);
      cut_log_p = c.log_p;
      cut_ranked = c.ranked ? 1 : 0;
      cut_lambda = c.lambda;
      cut_pos = c.pos;
    }
  }
  __syncthreads();
  prune::Cut cut;
  cut.log_p = cut_log_p;
  cut.ranked = cut_ranked != 0;
  cut.lambda = cut.ranked ? cut_lambda : 0.0;
  cut.pos = cut.ranked ? std::int64_t(cut_pos) : 0;
  return cut;
}

// grid (items of the chunk launch), block kCutThreads: the cut of each item of a prefill chunk (the
// chunk_work items of finish_kernel), after the chunk's attention has moved every λ to the chunk end.
template <class Ev, class S>
__global__ void __launch_bounds__(kCutThreads)
    prefill_cut_kernel(DeviceCache<S> c, DeviceCall<S> a, Ev ev, prune::Cut* cuts, std::int64_t t0, std::int64_t rows) {
  ChunkWork w;
  if (!chunk_work(c, a, blockIdx.x, t0, rows, w)) return;
  const DeviceEntries<S> entries{&c, w.item, c.length[w.item], w.rows, a.lambda_new + w.item * a.P, c.counter[w.item]};
  const prune::Cut cut = block_cut(ev, entries);
  if (threadIdx.x == 0) cuts[w.item] = cut;
}

// grid (I for a fixed batch, rows * G for a step), block kCutThreads: spec UA.md 4.4 step 1 for the items
// of a decode launch (decode_attend_kernel's items: a fixed batch's sequences whose slot runs, a step's
// 1-token rows), then their cut over the updated rows and the new token.
template <class Set, class Ev, class S>
__global__ void __launch_bounds__(kCutThreads)
    decode_cut_kernel(DeviceCache<S> c, DeviceCall<S> a, Ev ev, prune::Cut* cuts) {
  std::int64_t item = blockIdx.x, b = item / c.G;
  if (a.row_slot != nullptr && !decode_row(c, a, blockIdx.x, item, b)) return;
  if (a.row_slot == nullptr && a.slot_go != nullptr && a.slot_go[b] == 0) return;  // found the pool dry
  const std::int64_t D = c.D, g = item % c.G, n = c.length[item], t = c.counter[item];
  const auto* new_key = a.k + b * a.k_b + g * a.k_g;
  const float zq = a.z_q[b * a.zq_b + g * a.zq_g];
  for (std::int64_t e = threadIdx.x; e < n; e += blockDim.x) {  // each row on its own (spec 4.4)
    const std::int64_t x = c.row(item, e);
    kernel::ua::lambda_update<Set, float>(c.keys + x * D, D, c.key_logit + x, c.pos + x, c.lambda + x, 1, new_key, zq,
                                          t, D, c.key_scale != nullptr ? c.key_scale + x : nullptr);
  }
  __syncthreads();  // every λ of the item is final
  const DeviceEntries<S> entries{&c, item, n, 1, nullptr, t};
  const prune::Cut cut = block_cut(ev, entries);
  if (threadIdx.x == 0) cuts[item] = cut;
}

}  // namespace kvmem::cuda::ua_detail
