// SPDX-License-Identifier: Apache-2.0
#pragma once
// Dense causal softmax attention on the host backend: the anchor KVM is measured against
// (benchmarks/bench_kvm_cpu.cpp) and a cross-check in tests. Parallel over (sequence, KV head),
// query blocks sweeping key tiles so a tile stays in cache. Allocates its workspace per call (an
// anchor, not an engine path).
//
// Two paths compute the same formula. With Eigen on the include path (and KVMEM_NO_EIGEN not
// defined) and an executor with exact == false, the query block times key tile products run through
// Eigen's matrix kernels (backend/host/eigen_attend.hpp). Otherwise, and always for exact == true,
// every row runs the attend-row body of kernel/attend.hpp with the KVM readout's tiling.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "kvmem/backend/host/executor.hpp"
#include "kvmem/backend/host/fast_path.hpp"
#include "kvmem/core/numeric.hpp"
#include "kvmem/core/softmax.hpp"
#include "kvmem/core/tensor.hpp"
#include "kvmem/kernel/attend.hpp"

namespace kvmem::host {

#if KVMEM_HOST_EIGEN
namespace dense_detail {

// Query blocks and key tiles of the same length (eigen::kTile), aligned, so the diagonal tile of a
// block starts at the block's first token and every row sees at least one key of every tile it visits.
inline constexpr std::int64_t kEigenBlock = eigen::kTile;

template <class S>
void causal_eigen(const Executor& exec, TensorView<const S, 4> q, TensorView<const S, 4> k, TensorView<const S, 4> v,
                  TensorView<float, 4> out, float scale) {
  const std::int64_t B = q.extent(0), Hq = q.extent(1), T = q.extent(2), D = q.extent(3);
  const std::int64_t Hk = k.extent(1), Dv = v.extent(3), rep = Hq / Hk;
  const std::int64_t block = kEigenBlock;
  parallel_for(exec, B * Hk, [&](std::int64_t i) {
    const std::int64_t b = i / Hk, g = i % Hk;
    const std::int64_t rows_max = block * rep;
    std::vector<float> qb(std::size_t(rows_max * D)), acc(std::size_t(rows_max * Dv));
    std::vector<std::int64_t> visible(static_cast<std::size_t>(rows_max));
    std::vector<OnlineSoftmax<float>> soft(static_cast<std::size_t>(rows_max));
    eigen::TileScratch scratch;
    const S* kp = &k(b, g, 0, 0);
    const S* vp = &v(b, g, 0, 0);
    for (std::int64_t t0 = 0; t0 < T; t0 += block) {
      const std::int64_t t1 = std::min(T, t0 + block), rows = (t1 - t0) * rep;
      for (std::int64_t r = 0; r < rows; ++r) {  // row r: token t0 + r / rep, query head g * rep + r % rep
        const S* qr = &q(b, g * rep + r % rep, t0 + r / rep, 0);
        for (std::int64_t d = 0; d < D; ++d) qb[std::size_t(r * D + d)] = load_as<float>(qr[d]);
        std::fill(acc.begin() + r * Dv, acc.begin() + (r + 1) * Dv, 0.0f);
        soft[std::size_t(r)] = OnlineSoftmax<float>();
        visible[std::size_t(r)] = r / rep + 1;  // the diagonal tile: keys [t0, t]
      }
      eigen::TileArgs args;
      args.rows = rows;
      args.D = D;
      args.Dv = Dv;
      args.q = qb.data();
      args.scale = scale;
      for (std::int64_t a = 0; a < t1; a += block) {
        args.n = std::min(a + block, t1) - a;
        args.visible = a == t0 ? visible.data() : nullptr;
        eigen::attend_tile(args, soft.data(), acc.data(), kp + a * D, D, vp + a * Dv, Dv, scratch);
      }
      for (std::int64_t r = 0; r < rows; ++r)
        kernel::attend_finish(soft[std::size_t(r)], acc.data() + r * Dv, Dv,
                              &out(b, t0 + r / rep, g * rep + r % rep, 0));
    }
  });
}

}  // namespace dense_detail
#endif

// out[b,t,h] = softmax_s<=t(scale * q[b,h,t] . k[b,g(h),s]) v[b,g(h),s].
template <class S, class A = float>
void dense_causal_attention(const Executor& exec, TensorView<const S, 4> q,  // [B,Hq,T,D]
                            TensorView<const S, 4> k,                        // [B,Hk,T,D]
                            TensorView<const S, 4> v,                        // [B,Hk,T,Dv]
                            TensorView<A, 4> out,                            // [B,T,Hq,Dv]
                            A scale, std::int64_t block = 64) {
  const std::int64_t B = q.extent(0), Hq = q.extent(1), T = q.extent(2), D = q.extent(3);
  const std::int64_t Hk = k.extent(1), Dv = v.extent(3), rep = Hq / Hk;
#if KVMEM_HOST_EIGEN
  if constexpr (std::is_same_v<A, float>) {
    if (!exec.exact) {
      dense_detail::causal_eigen(exec, q, k, v, out, scale);
      return;
    }
  }
#endif
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
          kernel::attend_accumulate(soft[std::size_t(r)], acc.data() + r * Dv, qb.data() + r * D, D, scale, kp + a * D,
                                    D, vp + a * Dv, Dv, Dv, n);
        }
      }
      for (std::int64_t r = 0; r < rows; ++r)
        kernel::attend_finish(soft[std::size_t(r)], acc.data() + r * Dv, Dv,
                              &out(b, t0 + r / rep, g * rep + r % rep, 0));
    }
  });
}

}  // namespace kvmem::host
