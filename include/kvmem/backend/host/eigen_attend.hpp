// SPDX-License-Identifier: Apache-2.0
#pragma once
// The attend step of kernel/attend.hpp for a block of query rows against one key tile, with the two
// products (logits = Q K^T, acc += P V) done by Eigen's matrix kernels on maps of kvmem's own memory.
// Requires Eigen 3.3+ (<Eigen/Core> on the include path; target kvmem::eigen). The online softmax
// is core/softmax.hpp's: each row raises its running max to the tile's maximum (one rescale of its
// accumulator per tile, as attend_accumulate does), then adds exp(logit - max), computed by Eigen's
// vectorised exp over the row. Only the summation order differs from the scalar body, so results
// agree with it and with the fp64 reference within fp32 rounding (DESIGN.md section 5), not bitwise.

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include <Eigen/Core>

#include "kvmem/core/math.hpp"
#include "kvmem/core/numeric.hpp"
#include "kvmem/core/softmax.hpp"

namespace kvmem::host::eigen {

using RowMatrix = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using ConstRowMap = Eigen::Map<const RowMatrix, Eigen::Unaligned, Eigen::OuterStride<>>;
using RowMap = Eigen::Map<RowMatrix, Eigen::Unaligned, Eigen::OuterStride<>>;

// Keys per tile (and slots per routing block): large enough that the products run at the speed of
// Eigen's kernels, small enough that a key and value tile (2 x 64 KiB at D = 128) and the logits
// stay in L2. It is also the fixed row stride of the logits scratch, a multiple of 16 floats, so
// every logits row starts 64-byte aligned: Eigen's vectorised exp and sums then split each row into
// the same packets whatever the scratch's history, and results depend only on the inputs.
inline constexpr std::int64_t kTile = 128;

// Per-thread scratch of one tile: the logits / probabilities ([rows, kTile]) and, for bf16 and fp16
// storage, the key and value tile converted to fp32 once. Grows on first use; reuse one per thread.
struct TileScratch {
  RowMatrix logits, keys, values;
  void reserve_logits(Eigen::Index rows) {
    if (logits.rows() < rows || logits.cols() != Eigen::Index(kTile))
      logits.resize(std::max(rows, logits.rows()), kTile);
  }
};

// One query block against one key tile.
struct TileArgs {
  std::int64_t rows = 0;             // query rows in the block
  std::int64_t D = 0, Dv = 0;        // key and value widths
  std::int64_t n = 0;                // keys in the tile
  const float* q = nullptr;          // [rows, D]
  const float* row_scale = nullptr;  // [rows]: logit scale per row, or null = `scale` for all
  float scale = 1.0f;
  const std::int64_t* visible = nullptr;  // [rows]: keys [0, visible[r]) of the tile are seen by
                                          // row r (causal masks), or null = all n
};

// Accumulates keys [0, n) of a tile into every row of a block: l = scale_r * (q_r . k_j),
// p over everything pushed into soft[r] so far (spec KVM.md 4.4 step 3, in tile form).
// soft: [rows]; acc: [rows, Dv] unnormalised; keys: [n, ldk] (first D used); vals: [n, ldv]
// (first Dv used); n <= kTile. A row that sees no key of the tile is left unchanged.
template <class K, class V>
void attend_tile(const TileArgs& a, OnlineSoftmax<float>* soft, float* acc, const K* keys, std::int64_t ldk,
                 const V* vals, std::int64_t ldv, TileScratch& scratch) {
  using Eigen::Index;
  const Index rows = Index(a.rows), n = Index(a.n), D = Index(a.D), Dv = Index(a.Dv);
  if (rows == 0 || n == 0) return;
  const float* kp = nullptr;
  const float* vp = nullptr;
  Index kld = Index(ldk), vld = Index(ldv);
  if constexpr (std::is_same_v<K, float>) {
    kp = keys;
  } else {  // bf16 / fp16 storage: convert the tile once, not once per query row
    if (scratch.keys.rows() < n || scratch.keys.cols() != D) scratch.keys.resize(std::max(n, scratch.keys.rows()), D);
    for (Index j = 0; j < n; ++j)
      for (Index d = 0; d < D; ++d) scratch.keys(j, d) = load_as<float>(keys[j * ldk + d]);
    kp = scratch.keys.data();
    kld = scratch.keys.cols();
  }
  if constexpr (std::is_same_v<V, float>) {
    vp = vals;
  } else {
    if (scratch.values.rows() < n || scratch.values.cols() != Dv)
      scratch.values.resize(std::max(n, scratch.values.rows()), Dv);
    for (Index j = 0; j < n; ++j)
      for (Index d = 0; d < Dv; ++d) scratch.values(j, d) = load_as<float>(vals[j * ldv + d]);
    vp = scratch.values.data();
    vld = scratch.values.cols();
  }
  const ConstRowMap Q(a.q, rows, D, Eigen::OuterStride<>(D));
  const ConstRowMap Kt(kp, n, D, Eigen::OuterStride<>(kld));
  const ConstRowMap Vt(vp, n, Dv, Eigen::OuterStride<>(vld));
  RowMap O(acc, rows, Dv, Eigen::OuterStride<>(Dv));
  scratch.reserve_logits(rows);
  auto P = scratch.logits.topLeftCorner(rows, n);
  P.noalias() = Q * Kt.transpose();
  for (Index r = 0; r < rows; ++r) {
    const Index seen = a.visible ? std::min<Index>(n, Index(a.visible[r])) : n;
    auto row = P.row(r);
    if (seen <= 0) {
      row.setZero();
      continue;
    }
    const float ls = a.row_scale ? a.row_scale[r] : a.scale;
    auto live = row.head(seen).array();
    live *= ls;
    const float rescale = soft[r].raise_max(live.maxCoeff());
    if (rescale != 1.0f) O.row(r) *= rescale;
    live = (live - soft[r].max).exp();
    soft[r].accumulate_sum(live.sum());
    row.tail(n - seen).setZero();
  }
  O.noalias() += P * Vt;
}

// logits[i, r] = x_i . y_r for x: [n, D], y: [rows, D] (row-major, fp32), rows <= kTile, into the
// scratch's logits (row stride kTile). The KVM update's novelty and routing scores.
inline void cross_logits(const float* x, std::int64_t n, std::int64_t D, const float* y, std::int64_t rows,
                         TileScratch& scratch) {
  using Eigen::Index;
  scratch.reserve_logits(Index(n));
  RowMatrix& logits = scratch.logits;
  const ConstRowMap X(x, Index(n), Index(D), Eigen::OuterStride<>(Index(D)));
  const ConstRowMap Y(y, Index(rows), Index(D), Eigen::OuterStride<>(Index(D)));
  logits.topLeftCorner(Index(n), Index(rows)).noalias() = X * Y.transpose();
}

// Per-thread scratch of a row block's key-range sweep: the tile scratch, a logit scale and the last
// visible key position per row. Sized by reserve() on a thread's first call of a problem, then reused.
struct RangeScratch {
  TileScratch tile;
  RowMatrix ln_rows;  // [kTile, D]: layer-normed slot keys of one routing block
  std::vector<float> row_scale;
  std::vector<std::int64_t> last, visible;
  void reserve_rows(std::int64_t rows) {
    if (std::int64_t(last.size()) < rows) {
      row_scale.resize(std::size_t(rows));
      last.resize(std::size_t(rows));
      visible.resize(std::size_t(rows));
    }
  }
  // Sizes everything for query blocks and routing blocks of up to `rows` rows at widths D, Dv, so later
  // calls of that problem never grow it: a thread allocates on its first call only (DESIGN.md 3).
  void reserve(std::int64_t rows, std::int64_t D, std::int64_t Dv) {
    using Eigen::Index;
    reserve_rows(rows);
    tile.reserve_logits(Index(std::max(rows, kTile)));
    if (tile.keys.rows() < Index(kTile) || tile.keys.cols() != Index(D)) tile.keys.resize(Index(kTile), Index(D));
    if (tile.values.rows() < Index(kTile) || tile.values.cols() != Index(Dv))
      tile.values.resize(Index(kTile), Index(Dv));
    if (ln_rows.rows() < Index(kTile) || ln_rows.cols() != Index(D)) ln_rows.resize(Index(kTile), Index(D));
  }
};

inline RangeScratch& thread_range_scratch() {
  thread_local RangeScratch scratch;
  return scratch;
}

// Keys at positions [a, e) stored contiguously from `keys`/`vals` (position a at row 0), in tiles of
// kTile keys. Row r sees the keys at positions <= last[r] (null = every key) with the logit scale
// row_scale[r].

struct RowBlock {
  std::int64_t rows = 0, D = 0, Dv = 0;
  const float* q = nullptr;              // [rows, D]
  const float* row_scale = nullptr;      // [rows]
  OnlineSoftmax<float>* soft = nullptr;  // [rows]
  float* acc = nullptr;                  // [rows, Dv] unnormalised
};

template <class K, class V>
void attend_range(const RowBlock& blk, const K* keys, std::int64_t ldk, const V* vals, std::int64_t ldv, std::int64_t a,
                  std::int64_t e, const std::int64_t* last, RangeScratch& scratch) {
  TileArgs args;
  args.rows = blk.rows;
  args.D = blk.D;
  args.Dv = blk.Dv;
  args.q = blk.q;
  args.row_scale = blk.row_scale;
  for (std::int64_t t = a; t < e; t += kTile) {
    args.n = std::min(kTile, e - t);
    args.visible = nullptr;
    if (last != nullptr) {
      bool all = true, any = false;
      for (std::int64_t r = 0; r < blk.rows; ++r) {
        const std::int64_t seen = std::clamp<std::int64_t>(last[r] + 1 - t, 0, args.n);
        scratch.visible[std::size_t(r)] = seen;
        all = all && seen == args.n;
        any = any || seen > 0;
      }
      if (!any) break;  // positions only grow: no row sees a later tile either
      if (!all) args.visible = scratch.visible.data();
    }
    attend_tile(args, blk.soft, blk.acc, keys + (t - a) * ldk, ldk, vals + (t - a) * ldv, ldv, scratch.tile);
  }
}

}  // namespace kvmem::host::eigen
