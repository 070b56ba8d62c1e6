// SPDX-License-Identifier: Apache-2.0
#pragma once
// Dense causal softmax attention on the host backend: the anchor KVM is measured against
// (benchmarks/bench_kvm_cpu.cpp) and a cross-check in tests. Same attend-row body and tiling as the
// KVM readout (kernel/attend.hpp), parallel over (sequence, KV head), query blocks of `block` rows
// sweeping key tiles so a tile stays in cache. Allocates its workspace per call (an anchor, not an
// engine path).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "kvmem/backend/host/executor.hpp"
#include "kvmem/core/numeric.hpp"
#include "kvmem/core/softmax.hpp"
#include "kvmem/core/tensor.hpp"
#include "kvmem/kernel/attend.hpp"

namespace kvmem::host {

// out[b,t,h] = softmax_s<=t(scale * q[b,h,t] . k[b,g(h),s]) v[b,g(h),s].
template <class S, class A = float>
void dense_causal_attention(const Executor& exec,
                            TensorView<const S, 4> q,  // [B,Hq,T,D]
                            TensorView<const S, 4> k,  // [B,Hk,T,D]
                            TensorView<const S, 4> v,  // [B,Hk,T,Dv]
                            TensorView<A, 4> out,      // [B,T,Hq,Dv]
                            A scale, std::int64_t block = 64) {
  const std::int64_t B = q.extent(0), Hq = q.extent(1), T = q.extent(2), D = q.extent(3);
  const std::int64_t Hk = k.extent(1), Dv = v.extent(3), rep = Hq / Hk;
  const std::int64_t tile = kernel::kAttendTile;
  parallel_for(exec, B * Hk, [&](std::int64_t i) {
    const std::int64_t b = i / Hk, g = i % Hk;
    const std::int64_t rows_max = block * rep;
    std::vector<A> qb(std::size_t(rows_max * D)), acc(std::size_t(rows_max * Dv));
    std::vector<OnlineSoftmax<A>> soft(static_cast<std::size_t>(rows_max));
    const S* kp = &k(b, g, 0, 0);
    const S* vp = &v(b, g, 0, 0);
    for (std::int64_t t0 = 0; t0 < T; t0 += block) {
      const std::int64_t t1 = std::min(T, t0 + block), rows = (t1 - t0) * rep;
      for (std::int64_t r = 0; r < rows; ++r) {
        const S* qr = &q(b, g * rep + r % rep, t0 + r / rep, 0);
        for (std::int64_t d = 0; d < D; ++d) qb[std::size_t(r * D + d)] = load_as<A>(qr[d]);
        std::fill(acc.begin() + r * Dv, acc.begin() + (r + 1) * Dv, A(0));
        soft[std::size_t(r)] = OnlineSoftmax<A>();
      }
      for (std::int64_t a = 0; a < t1; a += tile) {
        const std::int64_t e = std::min(a + tile, t1);
        for (std::int64_t r = 0; r < rows; ++r) {
          const std::int64_t n = std::min(e, t0 + r / rep + 1) - a;
          if (n <= 0) continue;
          kernel::attend_accumulate(soft[std::size_t(r)], acc.data() + r * Dv, qb.data() + r * D, D, scale,
                                    kp + a * D, D, vp + a * Dv, Dv, Dv, n);
        }
      }
      for (std::int64_t r = 0; r < rows; ++r)
        kernel::attend_finish(soft[std::size_t(r)], acc.data() + r * Dv, Dv,
                              &out(b, t0 + r / rep, g * rep + r % rep, 0));
    }
  });
}

}  // namespace kvmem::host
