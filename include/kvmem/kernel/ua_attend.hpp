// SPDX-License-Identifier: Apache-2.0
#pragma once
// Universal Attention block body shared by every backend (spec UA.md 4.3-4.5): a block of
// consecutive query positions of one (sequence, kv head) and its r query heads attends to the
// cached entries of that kv head with the additive bias Λ, in tiles of kQueryTile rows x kKeyTile
// keys with an online softmax (core/softmax.hpp). Λ is built tile by tile from the entries' λ and the
// decay tile, never as an L x L matrix: memory is O(tile) per worker plus the λ the cache keeps anyway.
//
// The same body serves dense prefill (an empty cache, one block), chunked prefill (one block per chunk;
// the caller evicts at the chunk end) and decode (one row). λ accumulates in increasing position
// (kernel/ua_decay.hpp), and a row's softmax visits the entries in the same key tiles whatever the
// block size, so decode and prefill give bitwise identical λ and outputs.
//
// Backend-neutral: KVMEM_HOST_DEVICE, no allocation, no containers, no exceptions.

#include <cmath>
#include <cstdint>

#include "kvmem/core/config.hpp"
#include "kvmem/core/math.hpp"
#include "kvmem/core/numeric.hpp"
#include "kvmem/core/softmax.hpp"
#include "kvmem/kernel/ua_decay.hpp"
#include "kvmem/kernel/ua_rows.hpp"

namespace kvmem::kernel::ua {

inline constexpr std::int64_t kQueryTile = 32;  // query positions per tile (all r heads share the bias tile)
inline constexpr std::int64_t kKeyTile = 64;    // cached entries per tile

// Workspace (in Acc elements) one worker needs for attend_block with `heads` query heads of dim D.
KVMEM_HOST_DEVICE constexpr std::int64_t block_workspace_elems(std::int64_t heads, std::int64_t D) {
  return heads * kQueryTile * D       // output accumulators
         + 2 * heads * kQueryTile     // running max and sum per (head, row)
         + 2 * kKeyTile * kQueryTile  // decay tile and bias tile
         + kKeyTile                   // one row's logits
         + kQueryTile;                // query-gate parts of the tile's positions
}

// One block of query positions [first, first + rows) of one (sequence, kv head).
// KS: cache storage type, QS: input type of q / new keys / gates, OS: output type, Acc: accumulate type.
template <class KS, class QS, class OS, class Acc>
struct BlockArgs {
  std::int64_t D = 0;      // head dim (keys and values)
  std::int64_t heads = 0;  // r query heads of the group
  // Cached entries in ascending position order. On entry λ_e = Λ_{through, pos_e} for pos_e <= through
  // and 0 for newer entries (appended by the caller, e.g. this block's own keys); on exit
  // λ_e = Λ_{first + rows - 1, pos_e} for every entry with pos_e < first + rows.
  const KS* keys = nullptr;    // [n, D], rows key_stride apart
  const KS* values = nullptr;  // [n, D], rows value_stride apart
  std::int64_t key_stride = 0, value_stride = 0;
  Acc* lambda = nullptr;           // [n], log space
  const Acc* key_logit = nullptr;  // [n], z_k of each entry
  // Row-scaled storage (KS = e4m3, core/numeric.hpp): entry e's key is key_scale[e] * keys[e] and its
  // value value_scale[e] * values[e]; unused for other storage types.
  const float* key_scale = nullptr;    // [n]
  const float* value_scale = nullptr;  // [n]
  const std::int64_t* pos = nullptr;   // [n], absolute positions, ascending
  std::int64_t n = 0;
  // Entry e sits at row map(e) of keys, values, lambda, key_logit and pos (kernel/ua_rows.hpp); the
  // default is contiguous rows.
  RowMap map{};
  std::int64_t through = -1;  // λ already includes the decay of every position <= through
  // The block's query positions.
  std::int64_t first = 0, rows = 0;
  const QS* new_keys = nullptr;  // [rows, D] k_m of positions first.., rows new_key_stride apart
  std::int64_t new_key_stride = 0;
  const QS* query_logit = nullptr;  // [rows] z_q of positions first.., query_logit_stride apart
  std::int64_t query_logit_stride = 1;
  const QS* q = nullptr;  // [heads, rows, D]
  std::int64_t q_head_stride = 0, q_row_stride = 0;
  const QS* z_o = nullptr;  // [rows, heads, D] output-gate logits, nullptr = no gate (spec UA.md 7)
  std::int64_t z_o_row_stride = 0, z_o_head_stride = 0;
  OS* out = nullptr;  // [rows, heads, D]
  std::int64_t out_row_stride = 0, out_head_stride = 0;
  Acc* lse = nullptr;  // [heads, rows] natural log-sum-exp, nullptr = not wanted
  std::int64_t lse_head_stride = 0, lse_row_stride = 1;
  Acc* workspace = nullptr;  // [block_workspace_elems(heads, D)]
};

// One output row from its accumulator: y = acc / sum, times sigmoid(z_o) when the output gate is on
// (spec UA.md 7), and the row's natural log-sum-exp.
// acc: [D]; z_o: [D] or nullptr (no gate); out: [D]; lse: nullptr = not wanted
template <class QS, class OS, class Acc>
KVMEM_HOST_DEVICE inline void finish_output_row(const OnlineSoftmax<Acc>& sm, const Acc* acc, std::int64_t D,
                                                const QS* z_o, OS* out, Acc* lse) {
  const Acc inv = sm.normaliser();
  for (std::int64_t d = 0; d < D; ++d) {
    Acc y = acc[d] * inv;
    if (z_o) y *= sigmoid(load_as<Acc>(z_o[d]));
    out[d] = store_as<OS>(y);
  }
  if (lse) *lse = sm.lse();
}

// The end of query tile r0 for (head h, row i): finish_output_row of the tile's accumulator (the
// output row and lse). acc, row_max, row_sum: the tile's workspace as attend_block lays it out.
template <class KS, class QS, class OS, class Acc>
KVMEM_HOST_DEVICE inline void finish_row(const BlockArgs<KS, QS, OS, Acc>& a, const Acc* acc, const Acc* row_max,
                                         const Acc* row_sum, std::int64_t r0, std::int64_t h, std::int64_t i) {
  OnlineSoftmax<Acc> sm;
  sm.max = row_max[h * kQueryTile + i];
  sm.sum = row_sum[h * kQueryTile + i];
  finish_output_row(sm, acc + (h * kQueryTile + i) * a.D, a.D,
                    a.z_o ? a.z_o + (r0 + i) * a.z_o_row_stride + h * a.z_o_head_stride : nullptr,
                    a.out + (r0 + i) * a.out_row_stride + h * a.out_head_stride,
                    a.lse ? a.lse + h * a.lse_head_stride + (r0 + i) * a.lse_row_stride : nullptr);
}

template <class Set, class KS, class QS, class OS, class Acc>
KVMEM_HOST_DEVICE inline void attend_block(const BlockArgs<KS, QS, OS, Acc>& a) {
  const std::int64_t D = a.D;
  Acc* acc = a.workspace;                         // [heads, kQueryTile, D]
  Acc* row_max = acc + a.heads * kQueryTile * D;  // [heads, kQueryTile]
  Acc* row_sum = row_max + a.heads * kQueryTile;  // [heads, kQueryTile]
  Acc* decay = row_sum + a.heads * kQueryTile;    // [kKeyTile, kQueryTile]
  Acc* bias = decay + kKeyTile * kQueryTile;      // [kQueryTile, kKeyTile]
  Acc* logits = bias + kKeyTile * kQueryTile;     // [kKeyTile]
  Acc* query_part = logits + kKeyTile;            // [kQueryTile]

  for (std::int64_t r0 = 0; r0 < a.rows; r0 += kQueryTile) {
    const std::int64_t nr = (a.rows - r0) < kQueryTile ? (a.rows - r0) : kQueryTile;
    const std::int64_t m0 = a.first + r0;  // first position of the tile
    const std::int64_t m_last = m0 + nr - 1;
    const std::int64_t through = a.through > m0 - 1 ? a.through : m0 - 1;  // λ holds Λ_{through, .}
    const std::int64_t skip = through + 1 > m0 ? through + 1 - m0 : 0;     // rows already in λ (decode)
    // acc is [heads, kQueryTile, D]: zero the nr rows of every head (a flat heads*nr*D prefix misses the
    // rows of heads >= 1 when nr < kQueryTile; the first rescale by 0 hid that only while the workspace
    // held finite values, which team scratch on Kokkos does not guarantee).
    for (std::int64_t h = 0; h < a.heads; ++h)
      for (std::int64_t x = 0; x < nr * D; ++x) acc[h * kQueryTile * D + x] = Acc(0);
    for (std::int64_t x = 0; x < a.heads * kQueryTile; ++x) {
      row_max[x] = negative_infinity<Acc>();
      row_sum[x] = Acc(0);
    }

    for (std::int64_t e0 = 0; e0 < a.n && a.pos[a.map(e0)] <= m_last; e0 += kKeyTile) {
      std::int64_t ne = (a.n - e0) < kKeyTile ? (a.n - e0) : kKeyTile;
      while (ne > 0 && a.pos[a.map(e0 + ne - 1)] > m_last) --ne;  // entries beyond the tile are all masked

      // Bias tile: Λ_{m, pos_e} for the tile's rows (spec UA.md 4.2), then λ moves to row m_last. The
      // decay rows are computed run by run of physically consecutive entries (one run unless paged);
      // each entry's row depends on that entry only, so the runs do not change a bit.
      if (nr > skip)
        for (std::int64_t s = 0; s < ne;) {
          const std::int64_t len = a.map.run(e0 + s, e0 + ne), x = a.map(e0 + s);
          decay_tile<Set, Acc>(a.keys + x * a.key_stride, a.key_stride, a.key_logit + x, a.pos + x, len,
                               a.new_keys + (r0 + skip) * a.new_key_stride, a.new_key_stride,
                               a.query_logit + (r0 + skip) * a.query_logit_stride, a.query_logit_stride, m0 + skip,
                               nr - skip, D, decay + s * kQueryTile, kQueryTile, query_part,
                               a.key_scale != nullptr ? a.key_scale + x : nullptr);
          s += len;
        }
      // Entry loops walk runs of physically consecutive rows (one run unless paged), entries in order.
      for (std::int64_t s = 0; s < ne;) {
        const std::int64_t len = a.map.run(e0 + s, e0 + ne), x0 = a.map(e0 + s);
        for (std::int64_t e = s, x = x0; e < s + len; ++e, ++x) {
          const std::int64_t p = a.pos[x];
          Acc lam = a.lambda[x];
          for (std::int64_t i = 0; i < skip && i < nr; ++i)
            bias[i * kKeyTile + e] = (m0 + i < p) ? negative_infinity<Acc>() : lam;
          if (nr > skip) {
            lam = cumulative_decay(lam, p, m0 + skip, decay + e * kQueryTile, nr - skip, bias + skip * kKeyTile + e,
                                   kKeyTile);
            if (p <= m_last) a.lambda[x] = lam;  // Λ_{m_last, p}
          }
        }
        s += len;
      }

      // Online softmax of every (head, row) over this key tile; the r heads share the bias tile.
      for (std::int64_t h = 0; h < a.heads; ++h)
        for (std::int64_t i = 0; i < nr; ++i) {
          const QS* qrow = a.q + h * a.q_head_stride + (r0 + i) * a.q_row_stride;
          const Acc* brow = bias + i * kKeyTile;
          Acc block_max = negative_infinity<Acc>();
          for (std::int64_t s = 0; s < ne;) {
            const std::int64_t len = a.map.run(e0 + s, e0 + ne), x0 = a.map(e0 + s);
            const KS* krow = a.keys + x0 * a.key_stride;
            for (std::int64_t e = s; e < s + len; ++e, krow += a.key_stride) {
              Acc qk = dot8<Acc>(qrow, krow, D);
              if constexpr (is_row_scaled_v<KS>) qk *= Acc(a.key_scale[x0 + (e - s)]);
              logits[e] = brow[e] == negative_infinity<Acc>() ? negative_infinity<Acc>() : qk + brow[e];  // scale 1
              if (logits[e] > block_max) block_max = logits[e];
            }
            s += len;
          }
          if (block_max == negative_infinity<Acc>()) continue;
          OnlineSoftmax<Acc> sm;
          sm.max = row_max[h * kQueryTile + i];
          sm.sum = row_sum[h * kQueryTile + i];
          Acc* arow = acc + (h * kQueryTile + i) * D;
          const Acc rescale = sm.raise_max(block_max);
          if (rescale != Acc(1))
            for (std::int64_t d = 0; d < D; ++d) arow[d] *= rescale;
          for (std::int64_t s = 0; s < ne;) {
            const std::int64_t len = a.map.run(e0 + s, e0 + ne), x0 = a.map(e0 + s);
            const KS* vrow = a.values + x0 * a.value_stride;
            for (std::int64_t e = s; e < s + len; ++e, vrow += a.value_stride) {
              Acc w = sm.accumulate(logits[e]);
              if (w == Acc(0)) continue;
              if constexpr (is_row_scaled_v<KS>) w *= Acc(a.value_scale[x0 + (e - s)]);
              for (std::int64_t d = 0; d < D; ++d) arow[d] += w * load_as<Acc>(vrow[d]);
            }
            s += len;
          }
          row_max[h * kQueryTile + i] = sm.max;
          row_sum[h * kQueryTile + i] = sm.sum;
        }
    }

    for (std::int64_t h = 0; h < a.heads; ++h)
      for (std::int64_t i = 0; i < nr; ++i) finish_row(a, acc, row_max, row_sum, r0, h, i);
  }
}

}  // namespace kvmem::kernel::ua
