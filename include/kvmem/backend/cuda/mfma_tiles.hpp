// SPDX-License-Identifier: Apache-2.0
#pragma once
// The AMD matrix-core tiles of the GPU backend: one wavefront's part of the attention walk (KVM prefill
// readout, UA prefill chunks), of the UA key/key similarity and of the KVM novelty and routing passes,
// on the instruction and lane layout of mfma_layout.hpp. Written against a wave W (mfma_wave.cuh states
// the interface): on the device each lane runs them on its own registers (mfma::DeviceWave), and the
// host tests run them on an emulated wavefront of 64 lanes (tests/support/mfma_host_wave.hpp), so the
// code that hipcc compiles for the matrix cores is the code the host tests check.
//
// Orientation: every product puts the dimension the tile reduces over (keys, slots) on the rows of the
// MFMA result and the queries or tokens on its 32 columns, so a column lives in lane c (rows 8 m + r,
// r < 4) and lane c + 32 (rows 8 m + 4 + r): a column's maximum, softmax sum or argmax is one lane's
// registers and one exchange with the partner lane (xor32). Attention computes S^T = K Q^T (Q^T from
// registers, loaded once), and O^T += V^T P^T, whose B operand P^T is the S^T accumulators themselves:
// the accumulator registers 4 t .. 4 t + 3 of a lane are the keys 8 t + 4 q .. + 3 of its column, exactly
// the elements k-step t of the B operand needs, so the weights never leave the lane. Its A operand V^T is
// read from a value tile stored transposed ([dim][key] rows), 4 consecutive keys a load.
// Precision: bf16 operands, fp32 accumulation; the softmax weights are rounded to bf16 for P V (as the
// NVIDIA tensor-core tiles and FlashAttention do), logits, the running max/sum and O stay fp32. The
// online softmax is core/softmax.hpp's, the state the portable kernels carry.
//
// Memory: key, slot and transposed value rows are read as bf16 rows `pitch` elements apart (shared
// memory on the device); a row operand reads 4 consecutive elements, so rows start 8-byte aligned and the
// pitch is a multiple of 4.

#include <cstdint>

#include "kvmem/backend/cuda/mfma_layout.hpp"
#include "kvmem/core/config.hpp"
#include "kvmem/core/math.hpp"
#include "kvmem/core/numeric.hpp"
#include "kvmem/core/softmax.hpp"

namespace kvmem::cuda::mfma {

// Operand of k-step ks for lane `lane` from row-major bf16 rows: row lane_col(lane), elements 8 ks + 4 q
// .. + 3. Serves A (its row i is a memory row) and B (its column j is a memory row) alike.
KVMEM_HOST_DEVICE inline Operand row_operand(const bf16* rows, int pitch, int lane, int ks) {
  return operand_of(rows + lane_col(lane) * pitch + kK * ks + 4 * lane_half(lane));
}
// One 32 x 32 product of bf16 rows: out[i * out_pitch + j] = a_i . b_j over kD (fp32 accumulation) for
// i, j < 32, where a_i and b_j are rows of `a` and `b`. The UA key/key similarity of an entry block and
// the row tile's keys (spec UA.md 4.1 step 1).
template <class W, int kD>
KVMEM_HOST_DEVICE void product_abt(const bf16* a, int a_pitch, const bf16* b, int b_pitch, float* out, int out_pitch) {
  static_assert(kD % kK == 0, "the MFMA tiles take head dims that are multiples of 8");
  typename W::template Reg<Accum> c;
  W::lanes([&](int l) { W::at(c, l) = Accum{}; });
  KVMEM_MFMA_UNROLL
  for (int ks = 0; ks < kD / kK; ++ks) {
    typename W::template Reg<Operand> fa, fb;
    W::lanes([&](int l) {
      W::at(fa, l) = row_operand(a, a_pitch, l, ks);
      W::at(fb, l) = row_operand(b, b_pitch, l, ks);
    });
    W::mma(c, fa, fb);
  }
  W::lanes([&](int l) {
    KVMEM_MFMA_UNROLL
    for (int g = 0; g < kAccRegs; ++g) out[acc_row(l, g) * out_pitch + lane_col(l)] = W::at(c, l)[g];
  });
}

// ---- attention (KVM readout, spec KVM.md 4.4; UA prefill, spec UA.md 4.3) -----------------------------
// One wavefront's 32 query columns of an online-softmax walk over key tiles of kTileKeys keys: begin()
// loads the queries, step() folds one key tile in (logits from a caller's function of the raw dot: scale,
// temperature, Λ, masks), finish() hands out each column's running max, total sum and unnormalised O.
inline constexpr int kTileKeys = 64;  // keys of a step: two 32-key blocks of S^T

template <class W, int kD, int kDv>
struct AttendTile {
  static_assert(kD % kK == 0, "the MFMA attention tile takes key dims that are multiples of 8");
  static constexpr int kKSteps = kD / kK;
  static constexpr int kDvTiles = (kDv + 31) / 32;  // 32-row blocks of O^T, the last one partly used
  static constexpr int kValueRows = kM * kDvTiles;  // rows of a transposed value tile (zeros past kDv)
  static constexpr int kKeyBlocks = kTileKeys / kM;
  template <class T>
  using Reg = typename W::template Reg<T>;

  Reg<Operand> q[kKSteps];  // Q^T: B operands, lane c (+ 32) holds query column c
  Reg<Accum> o[kDvTiles];   // O^T: register g of lane l holds dim 32 dt + acc_row(l, g) of column c
  Reg<OnlineSoftmax<float>> sm;

  // row_of(col): query column col's kD elements (any storage type), or nullptr for a column without a
  // query (zeros: its logits must then be masked by step's logit function).
  template <class RowOf>
  KVMEM_HOST_DEVICE void begin(RowOf&& row_of) {
    W::lanes([&](int l) {
      const auto* row = row_of(lane_col(l));
      KVMEM_MFMA_UNROLL
      for (int ks = 0; ks < kKSteps; ++ks) {
        float x[kOperandElems] = {0.0f, 0.0f, 0.0f, 0.0f};
        if (row != nullptr) {
          KVMEM_MFMA_UNROLL
          for (int e = 0; e < kOperandElems; ++e) x[e] = load_as<float>(row[kK * ks + operand_k(l, e)]);
        }
        W::at(q[ks], l) = operand_of(x[0], x[1], x[2], x[3]);
      }
      KVMEM_MFMA_UNROLL
      for (int dt = 0; dt < kDvTiles; ++dt) W::at(o[dt], l) = Accum{};
      W::at(sm, l) = OnlineSoftmax<float>{};
    });
  }

  // One key tile: keys [kTileKeys][k_pitch] and the values transposed, values_t [kValueRows][vt_pitch]
  // (row d: dim d of keys 0 .. kTileKeys - 1; rows d >= kDv zero). bf16; the keys and values the walk does
  // not use hold finite values, zeros in practice: a weight 0 times them must be 0.
  // logit(key, col, dot) -> the logit of key `key` (0 .. kTileKeys - 1) for column col from the raw q.k
  // dot, or -inf where the key is masked for that column.
  template <class Logit>
  KVMEM_HOST_DEVICE void step(const bf16* keys, int k_pitch, const bf16* values_t, int vt_pitch, Logit&& logit) {
    // S^T = K Q^T, two 32-key blocks
    Reg<Accum> s[kKeyBlocks];
    W::lanes([&](int l) {
      KVMEM_MFMA_UNROLL
      for (int kb = 0; kb < kKeyBlocks; ++kb) W::at(s[kb], l) = Accum{};
    });
    KVMEM_MFMA_UNROLL
    for (int ks = 0; ks < kKSteps; ++ks) {
      KVMEM_MFMA_UNROLL
      for (int kb = 0; kb < kKeyBlocks; ++kb) {
        Reg<Operand> a;
        W::lanes([&](int l) { W::at(a, l) = row_operand(keys + kb * kM * k_pitch, k_pitch, l, ks); });
        W::mma(s[kb], a, q[ks]);
      }
    }
    // logits in place, and the column's maximum over this lane's keys, then over both halves
    Reg<float> mx;
    W::lanes([&](int l) {
      float m = negative_infinity<float>();
      KVMEM_MFMA_UNROLL
      for (int kb = 0; kb < kKeyBlocks; ++kb) {
        KVMEM_MFMA_UNROLL
        for (int g = 0; g < kAccRegs; ++g) {
          const float x = logit(kb * kM + acc_row(l, g), lane_col(l), W::at(s[kb], l)[g]);
          W::at(s[kb], l)[g] = x;
          m = x > m ? x : m;
        }
      }
      W::at(mx, l) = m;
    });
    const Reg<float> mx_other = W::xor32(mx);
    // online softmax (both lanes of a column raise to the same maximum; each sums its own keys), the
    // weights in place of the logits
    W::lanes([&](int l) {
      const float m = W::at(mx, l) > W::at(mx_other, l) ? W::at(mx, l) : W::at(mx_other, l);
      OnlineSoftmax<float>& state = W::at(sm, l);
      const float rescale = state.raise_max(m);
      if (rescale != 1.0f) {
        KVMEM_MFMA_UNROLL
        for (int dt = 0; dt < kDvTiles; ++dt) {
          KVMEM_MFMA_UNROLL
          for (int g = 0; g < kAccRegs; ++g) W::at(o[dt], l)[g] *= rescale;
        }
      }
      KVMEM_MFMA_UNROLL
      for (int kb = 0; kb < kKeyBlocks; ++kb) {
        KVMEM_MFMA_UNROLL
        for (int g = 0; g < kAccRegs; ++g) W::at(s[kb], l)[g] = state.accumulate(W::at(s[kb], l)[g]);
      }
    });
    // O^T += V^T P^T, k-step t of key block kb: P^T from accumulator registers 4 t .. 4 t + 3
    KVMEM_MFMA_UNROLL
    for (int kb = 0; kb < kKeyBlocks; ++kb) {
      KVMEM_MFMA_UNROLL
      for (int t = 0; t < kM / kK; ++t) {
        Reg<Operand> p;
        W::lanes([&](int l) {
          const Accum& w = W::at(s[kb], l);
          W::at(p, l) = operand_of(w[4 * t], w[4 * t + 1], w[4 * t + 2], w[4 * t + 3]);
        });
        KVMEM_MFMA_UNROLL
        for (int dt = 0; dt < kDvTiles; ++dt) {
          Reg<Operand> v;
          W::lanes([&](int l) {
            W::at(v, l) = row_operand(values_t + kM * dt * vt_pitch, vt_pitch, l, kb * (kM / kK) + t);
          });
          W::mma(o[dt], v, p);
        }
      }
    }
  }

  // Each column's result: column(lane, col, max, sum) once per column (from its lane of half 0), then
  // value(lane, col, dim, o, sum) for every dim < kDv of it, from the lane that holds it. sum is the
  // total over both halves (the softmax denominator: o / sum is the output); max and o are the
  // unnormalised partial of core/softmax.hpp (sum 0: no visible key).
  template <class Column, class Value>
  KVMEM_HOST_DEVICE void finish(Column&& column, Value&& value) {
    Reg<float> sum;
    W::lanes([&](int l) { W::at(sum, l) = W::at(sm, l).sum; });
    const Reg<float> sum_other = W::xor32(sum);
    W::lanes([&](int l) {
      const int c = lane_col(l);
      // the two halves' sums in the same order in both lanes of a column
      const float total = lane_half(l) == 0 ? W::at(sum, l) + W::at(sum_other, l) : W::at(sum_other, l) + W::at(sum, l);
      if (lane_half(l) == 0) column(l, c, W::at(sm, l).max, total);
      KVMEM_MFMA_UNROLL
      for (int dt = 0; dt < kDvTiles; ++dt) {
        KVMEM_MFMA_UNROLL
        for (int g = 0; g < kAccRegs; ++g) {
          const int d = kM * dt + acc_row(l, g);
          if (d < kDv) value(l, c, d, W::at(o[dt], l)[g], total);
        }
      }
    });
  }
};

// ---- KVM novelty and routing (spec KVM.md 4.5 steps 2 and 4) ----------------------------------------
// One wavefront's 32 tokens (columns) against slot tiles of 32 slots (rows): token operands split as x =
// hi + lo (two bf16 values, |x - hi - lo| about 2^-16 |x|) and slots as khat (hi) + khat_lo (lo); with
// kTerms = 3 a dot is hi.hi + lo.hi + hi.lo in fp32, about as accurate as an fp32 dot (the host backend's
// routing), with kTerms = 1 hi.hi only. Each lane folds its slots in increasing order into running
// maxima (a later value wins only if larger), and finish() merges the two halves of a column (the larger
// value, ties to the smaller slot): the first slot of the largest value, the host's sequential scan.
inline constexpr int kRouteSlots = kM;  // slots of a step

template <class W, int kD, int kTerms>
struct RouteTile {
  static_assert(kD % kK == 0, "the MFMA routing tile takes key dims that are multiples of 8");
  static_assert(kTerms == 1 || kTerms == 3, "routing dots of 1 or 3 bf16 products");
  static constexpr int kKSteps = kD / kK;
  template <class T>
  using Reg = typename W::template Reg<T>;

  Reg<Operand> hi[kKSteps], lo[kTerms == 3 ? kKSteps : 1];
  // best, arg: the argmax of a routing pass (arg -1: none yet), or the novelty score (every slot);
  // cbest, carg: the novelty pass's route candidate (slots j >= sink)
  Reg<float> best, cbest;
  Reg<int> arg, carg;

  // The tokens' operands: lanes c and c + 32 hold dims 8 ks + 4 q .. + 3 of token column c. raw(col, d):
  // channel d of the token's key; channels below rope_dims are zeroed (spec KVM.md 4.2 step 1), then
  // k0 = LN_s (step 2: mean and biased variance over the kD channels, eps inside the square root).
  // operand(lane, col, d, k0) -> the value to route with (k0, or the gated kg), where the caller may also
  // store its rows. A column with live(col) false gets zero operands (its results are not used).
  template <class Live, class Raw, class OperandOf>
  KVMEM_HOST_DEVICE void prepare(Live&& live, Raw&& raw, const float* ln_w, const float* ln_b, float eps, int rope_dims,
                                 OperandOf&& operand) {
    struct Channels {
      float x[kKSteps][kOperandElems];  // this lane's channels of its token, zeroed below rope_dims
    };
    Reg<Channels> ch;
    Reg<float> part;
    W::lanes([&](int l) {
      const int c = lane_col(l);
      const bool on = live(c);
      float s = 0.0f;
      KVMEM_MFMA_UNROLL
      for (int ks = 0; ks < kKSteps; ++ks) {
        KVMEM_MFMA_UNROLL
        for (int e = 0; e < kOperandElems; ++e) {
          const int d = kK * ks + operand_k(l, e);
          const float x = on && d >= rope_dims ? raw(c, d) : 0.0f;
          W::at(ch, l).x[ks][e] = x;
          s += x;
        }
      }
      W::at(part, l) = s;
    });
    const Reg<float> mean = column_total(part, kD);
    W::lanes([&](int l) {
      float s = 0.0f;
      KVMEM_MFMA_UNROLL
      for (int ks = 0; ks < kKSteps; ++ks) {
        KVMEM_MFMA_UNROLL
        for (int e = 0; e < kOperandElems; ++e) {
          const float dv = W::at(ch, l).x[ks][e] - W::at(mean, l);
          s += dv * dv;
        }
      }
      W::at(part, l) = s;
    });
    const Reg<float> var = column_total(part, kD);
    W::lanes([&](int l) {
      using std::sqrt;
      const int c = lane_col(l);
      const bool on = live(c);
      const float inv = 1.0f / sqrt(W::at(var, l) + eps);
      KVMEM_MFMA_UNROLL
      for (int ks = 0; ks < kKSteps; ++ks) {
        float y[kOperandElems] = {0.0f, 0.0f, 0.0f, 0.0f}, r[kOperandElems] = {0.0f, 0.0f, 0.0f, 0.0f};
        if (on) {
          KVMEM_MFMA_UNROLL
          for (int e = 0; e < kOperandElems; ++e) {
            const int d = kK * ks + operand_k(l, e);
            const float k0 = ln_w[d] * ((W::at(ch, l).x[ks][e] - W::at(mean, l)) * inv) + ln_b[d];
            y[e] = operand(l, c, d, k0);
            r[e] = y[e] - bf16::to_float(bf16::from_float(y[e]));
          }
        }
        W::at(hi[ks], l) = operand_of(y[0], y[1], y[2], y[3]);
        if constexpr (kTerms == 3) W::at(lo[ks], l) = operand_of(r[0], r[1], r[2], r[3]);
      }
      W::at(best, l) = W::at(cbest, l) = negative_infinity<float>();
      W::at(arg, l) = W::at(carg, l) = -1;
    });
  }

  // One tile of slots [base, base + 32): hi and lo rows [32][pitch] (rows at and past n zero), of which
  // the first n are slots of the pass. kNovelty: best = max over the slots, cbest/carg = max and argmax
  // over those >= sink; otherwise best/arg = max and argmax over the slots.
  template <bool kNovelty>
  KVMEM_HOST_DEVICE void step(const bf16* hi_rows, const bf16* lo_rows, int pitch, int base, int n, int sink) {
    Reg<Accum> s;
    W::lanes([&](int l) { W::at(s, l) = Accum{}; });
    KVMEM_MFMA_UNROLL
    for (int ks = 0; ks < kKSteps; ++ks) {
      Reg<Operand> sh;
      W::lanes([&](int l) { W::at(sh, l) = row_operand(hi_rows, pitch, l, ks); });
      W::mma(s, sh, hi[ks]);  // slot hi . token hi
      if constexpr (kTerms == 3) {
        W::mma(s, sh, lo[ks]);  // . token lo
        Reg<Operand> sl;
        W::lanes([&](int l) { W::at(sl, l) = row_operand(lo_rows, pitch, l, ks); });
        W::mma(s, sl, hi[ks]);  // slot lo . token hi
      }
    }
    W::lanes([&](int l) {
      KVMEM_MFMA_UNROLL
      for (int g = 0; g < kAccRegs; ++g) {
        const int row = acc_row(l, g);
        if (row >= n) continue;
        const float val = W::at(s, l)[g];
        const int j = base + row;
        if constexpr (kNovelty) {
          if (val > W::at(best, l)) W::at(best, l) = val;
          if (j >= sink && (W::at(carg, l) < 0 || val > W::at(cbest, l))) {
            W::at(cbest, l) = val;
            W::at(carg, l) = j;
          }
        } else if (W::at(arg, l) < 0 || val > W::at(best, l)) {
          W::at(best, l) = val;
          W::at(arg, l) = j;
        }
      }
    });
  }

  // Merges the two halves of every column: afterwards both lanes of a column hold its result.
  template <bool kNovelty>
  KVMEM_HOST_DEVICE void finish() {
    if constexpr (kNovelty) {
      const Reg<float> b_other = W::xor32(best);
      W::lanes([&](int l) {
        if (W::at(b_other, l) > W::at(best, l)) W::at(best, l) = W::at(b_other, l);
      });
      merge_argmax(cbest, carg);
    } else {
      merge_argmax(best, arg);
    }
  }

 private:
  // The sum of a value over the two lanes of every column (the same order in both), divided by `count`.
  KVMEM_HOST_DEVICE static Reg<float> column_total(const Reg<float>& part, int count) {
    const Reg<float> other = W::xor32(part);
    Reg<float> total;
    W::lanes([&](int l) {
      const float a = W::at(part, l), b = W::at(other, l);
      W::at(total, l) = (lane_half(l) == 0 ? a + b : b + a) / static_cast<float>(count);
    });
    return total;
  }
  // The larger value of the two halves; ties to the smaller slot; -1 (none) loses to any slot.
  KVMEM_HOST_DEVICE static void merge_argmax(Reg<float>& b, Reg<int>& a) {
    const Reg<float> ob = W::xor32(b);
    const Reg<int> oa = W::xor32(a);
    W::lanes([&](int l) {
      const float vb = W::at(ob, l);
      const int va = W::at(oa, l);
      if (va >= 0 && (W::at(a, l) < 0 || vb > W::at(b, l) || (vb == W::at(b, l) && va < W::at(a, l)))) {
        W::at(b, l) = vb;
        W::at(a, l) = va;
      }
    });
  }
};

}  // namespace kvmem::cuda::mfma
