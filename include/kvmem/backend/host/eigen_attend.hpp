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
#include <cmath>
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
inline constexpr std::int64_t kTile = 256;

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

// Query blocks of at most this many rows (a decode step: one token's query heads of a KV group) with
// bf16 or fp16 keys or values take the streaming path: the tile is converted to fp32 and multiplied in
// sub-blocks of kStreamKeys rows that stay in L1, instead of being converted whole (64 KiB at D = 128,
// more than L1) and read back. A product of so few rows is bound by the bytes of the keys and values.
inline constexpr std::int64_t kStreamRows = 4;
inline constexpr std::int64_t kStreamKeys = 32;

// Hardware prefetchers stop at 4 KiB page boundaries, so a tile read from memory (a decode step after
// other work evicted the state) would wait a full miss at the start of every page. The streaming path
// asks for rows kPrefetchRows ahead of the one it converts, at a steady distance.
inline constexpr std::int64_t kPrefetchRows = 16;

template <class T>
inline void prefetch_row(const T* row, std::int64_t width) {
#if defined(__GNUC__) || defined(__clang__)
  const char* p = reinterpret_cast<const char*>(row);
  for (std::int64_t b = 0; b < width * std::int64_t(sizeof(T)); b += 64) __builtin_prefetch(p + b, 0, 3);
#else
  (void)row, (void)width;
#endif
}

// Rows [j0, j1) of src ([*, ld], first `width` used) as fp32 into dst ([j1 - j0, width]), asking for row
// j + kPrefetchRows of src (below `end`) and row j of `also` (its row stride ld_also, width w_also;
// null = none) while converting row j. Row-scaled (fp8) rows read as scale[j] * row (exact: a power of
// two), so the products below equal the kernel body's product-then-scale but for fp32 rounding.
template <class T, class U>
inline void convert_rows(const T* src, std::int64_t j0, std::int64_t j1, std::int64_t end, std::int64_t ld,
                         std::int64_t width, float* dst, const U* also, std::int64_t ld_also, std::int64_t w_also,
                         const float* scale = nullptr) {
  for (std::int64_t j = j0; j < j1; ++j) {
    if (j + kPrefetchRows < end) prefetch_row(src + (j + kPrefetchRows) * ld, width);
    if (also != nullptr) prefetch_row(also + j * ld_also, w_also);
    if constexpr (is_row_scaled_v<T>) {
      const float s = scale[j];
      for (std::int64_t d = 0; d < width; ++d) dst[(j - j0) * width + d] = s * load_as<float>(src[j * ld + d]);
    } else {
      (void)scale;
      for (std::int64_t d = 0; d < width; ++d) dst[(j - j0) * width + d] = load_as<float>(src[j * ld + d]);
    }
  }
}

// The online-softmax step of every row on its logits row of P ([rows, n], row stride kTile): scale,
// raise the running max (rescaling the row's accumulator once), p = exp(l - max) into P, keys the row
// does not see (visible[r] and later) set to 0.
template <class Logits>
void softmax_rows(const TileArgs& a, Logits& P, OnlineSoftmax<float>* soft, float* acc) {
  using Eigen::Index;
  const Index n = Index(a.n), Dv = Index(a.Dv);
  for (Index r = 0; r < Index(a.rows); ++r) {
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
    if (rescale != 1.0f)
      for (Index d = 0; d < Dv; ++d) acc[r * Dv + d] *= rescale;
    live = (live - soft[r].max).exp();
    soft[r].accumulate_sum(live.sum());
    row.tail(n - seen).setZero();
  }
}

// Accumulates keys [0, n) of a tile into every row of a block: l = scale_r * (q_r . k_j),
// p over everything pushed into soft[r] so far (spec KVM.md 4.4 step 3, in tile form).
// soft: [rows]; acc: [rows, Dv] unnormalised; keys: [n, ldk] (first D used); vals: [n, ldv]
// (first Dv used); n <= kTile. A row that sees no key of the tile is left unchanged. Row-scaled (fp8)
// keys and values take their row scales key_scale, value_scale [n] (unused otherwise).
template <class K, class V>
void attend_tile(const TileArgs& a, OnlineSoftmax<float>* soft, float* acc, const K* keys, std::int64_t ldk,
                 const V* vals, std::int64_t ldv, TileScratch& scratch, const float* key_scale = nullptr,
                 const float* value_scale = nullptr) {
  using Eigen::Index;
  const Index rows = Index(a.rows), n = Index(a.n), D = Index(a.D), Dv = Index(a.Dv);
  if (rows == 0 || n == 0) return;
  scratch.reserve_logits(rows);
  auto P = scratch.logits.topLeftCorner(rows, n);
  const ConstRowMap Q(a.q, rows, D, Eigen::OuterStride<>(D));
  RowMap O(acc, rows, Dv, Eigen::OuterStride<>(Dv));
  if constexpr (!std::is_same_v<K, float> || !std::is_same_v<V, float>) {
    if (rows <= Index(kStreamRows)) {
      const Index sub = Index(kStreamKeys);
      if (scratch.keys.rows() < sub || scratch.keys.cols() != D)
        scratch.keys.resize(std::max(sub, scratch.keys.rows()), D);
      if (scratch.values.rows() < sub || scratch.values.cols() != Dv)
        scratch.values.resize(std::max(sub, scratch.values.rows()), Dv);
      for (Index j = 0; j < n; j += sub) {
        const Index m = std::min(sub, n - j);
        convert_rows(keys, j, j + m, n, ldk, D, scratch.keys.data(), vals, ldv, Dv, key_scale);
        P.middleCols(j, m).noalias() = Q * scratch.keys.topRows(m).transpose();
      }
      softmax_rows(a, P, soft, acc);
      for (Index j = 0; j < n; j += sub) {
        const Index m = std::min(sub, n - j);
        convert_rows(vals, j, j + m, n, ldv, Dv, scratch.values.data(), static_cast<const V*>(nullptr), 0, 0,
                     value_scale);
        O.noalias() += P.middleCols(j, m) * scratch.values.topRows(m);
      }
      return;
    }
  }
  const float* kp = nullptr;
  const float* vp = nullptr;
  Index kld = Index(ldk), vld = Index(ldv);
  if constexpr (std::is_same_v<K, float>) {
    kp = keys;
  } else {  // bf16 / fp16 storage: convert the tile once, not once per query row
    if (scratch.keys.rows() < n || scratch.keys.cols() != D) scratch.keys.resize(std::max(n, scratch.keys.rows()), D);
    convert_rows(keys, 0, n, 0, ldk, D, scratch.keys.data(), static_cast<const K*>(nullptr), 0, 0, key_scale);
    kp = scratch.keys.data();
    kld = scratch.keys.cols();
  }
  if constexpr (std::is_same_v<V, float>) {
    vp = vals;
  } else {
    if (scratch.values.rows() < n || scratch.values.cols() != Dv)
      scratch.values.resize(std::max(n, scratch.values.rows()), Dv);
    convert_rows(vals, 0, n, 0, ldv, Dv, scratch.values.data(), static_cast<const V*>(nullptr), 0, 0, value_scale);
    vp = scratch.values.data();
    vld = scratch.values.cols();
  }
  const ConstRowMap Kt(kp, n, D, Eigen::OuterStride<>(kld));
  const ConstRowMap Vt(vp, n, Dv, Eigen::OuterStride<>(vld));
  P.noalias() = Q * Kt.transpose();
  softmax_rows(a, P, soft, acc);
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

// y = LN(x) * w + b over D channels (spec KVM.md 2, as kernel::layer_norm) with the mean and the
// variance summed in 16 fixed lanes, added pairwise at the end: vectorised, where kernel::layer_norm's
// single running sums are one long dependency chain each. The order does not depend on the data or
// the address, so every call on the same row gives the same bits; it differs from kernel::layer_norm's
// in the last bits (the fast path's tolerance, DESIGN.md section 5).
inline void layer_norm_lanes(const float* x, std::int64_t D, const float* w, const float* b, float eps, float* y) {
  constexpr std::int64_t L = 16;
  auto lane_sum = [&](auto&& term) {
    float lane[L] = {};
    std::int64_t d = 0;
    for (; d + L <= D; d += L)
      for (std::int64_t l = 0; l < L; ++l) lane[l] += term(d + l);
    for (std::int64_t l = 0; d + l < D; ++l) lane[l] += term(d + l);
    for (std::int64_t h = L / 2; h > 0; h /= 2)
      for (std::int64_t l = 0; l < h; ++l) lane[l] += lane[l + h];
    return lane[0];
  };
  const float mean = lane_sum([&](std::int64_t d) { return x[d]; }) / static_cast<float>(D);
  const float var = lane_sum([&](std::int64_t d) { return (x[d] - mean) * (x[d] - mean); }) / static_cast<float>(D);
  const float inv = 1.0f / std::sqrt(var + eps);
  for (std::int64_t d = 0; d < D; ++d) y[d] = w[d] * ((x[d] - mean) * inv) + b[d];
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

// Row-scaled (fp8) keys and values take their row scales key_scale, value_scale (indexed like the rows,
// position a at 0; unused otherwise).
template <class K, class V>
void attend_range(const RowBlock& blk, const K* keys, std::int64_t ldk, const V* vals, std::int64_t ldv, std::int64_t a,
                  std::int64_t e, const std::int64_t* last, RangeScratch& scratch, const float* key_scale = nullptr,
                  const float* value_scale = nullptr) {
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
    attend_tile(args, blk.soft, blk.acc, keys + (t - a) * ldk, ldk, vals + (t - a) * ldv, ldv, scratch.tile,
                key_scale != nullptr ? key_scale + (t - a) : nullptr,
                value_scale != nullptr ? value_scale + (t - a) : nullptr);
  }
}

}  // namespace kvmem::host::eigen
