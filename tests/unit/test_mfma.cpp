// SPDX-License-Identifier: Apache-2.0
// The AMD matrix-core (MFMA) tiles of the GPU backend, run on the host over an emulated 64-lane wavefront
// (support/mfma_host_wave.hpp): no AMD GPU runs them, so this is where their arithmetic is checked.
//  - The lane layout of backend/cuda/mfma_layout.hpp against the AMD Matrix Instruction Calculator's
//    mapping for v_mfma_f32_32x32x8bf16_1k / v_mfma_f32_32x32x8_bf16 (transcribed below, element to
//    register), and the emulated instruction against a plain matrix product placed by that mapping.
//  - The attention tile (KVM readout shape: scale, masks, several key tiles) against an fp64 softmax.
//  - The UA prefill composed as the AMD chunk kernel composes it (similarity tiles, the shared decay
//    fold, λ carried along the rows, attention with Λ) against the fp64 reference's dense UA.
//  - The novelty and routing tile (LN_s of the tokens, hi/lo products, argmax with first-slot ties)
//    against fp64 dots.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include <catch2/catch.hpp>

#include "kvmem/backend/cuda/mfma_layout.hpp"
#include "kvmem/backend/cuda/mfma_tiles.hpp"
#include "kvmem/core/numeric.hpp"
#include "kvmem/kernel/ua_decay.hpp"
#include "kvmem/policy/decay.hpp"
#include "kvmem/reference/ua.hpp"
#include "support/mfma_host_wave.hpp"

namespace {

using kvmem::bf16;
using kvmem::test::MfmaHostWave;
namespace mfma = kvmem::cuda::mfma;
using W = MfmaHostWave;
constexpr double kInf = std::numeric_limits<double>::infinity();

double round_bf16(double x) {
  return double(float(bf16(float(x))));
}

// Relative Frobenius distance of `got` to `want`.
double rel_frobenius(const std::vector<double>& got, const std::vector<double>& want) {
  double num = 0.0, den = 0.0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    num += (got[i] - want[i]) * (got[i] - want[i]);
    den += want[i] * want[i];
  }
  return std::sqrt(num / den);
}

// bf16 rows [rows][pitch] from values [rows][cols] (already bf16-exact or rounded here), zeros elsewhere.
std::vector<bf16> bf16_rows(const std::vector<double>& x, int rows, int cols, int pitch, int cap_rows) {
  std::vector<bf16> out(std::size_t(cap_rows) * std::size_t(pitch), bf16(0.0f));
  for (int r = 0; r < rows && r < cap_rows; ++r)
    for (int c = 0; c < cols; ++c) out[std::size_t(r * pitch + c)] = bf16(float(x[std::size_t(r * cols + c)]));
  return out;
}

// The same values transposed, as AttendTile reads its value tile: out[c * pitch + r] = x[r][c], for
// out_rows rows of `pitch` (zeros past the values).
std::vector<bf16> bf16_transposed(const std::vector<double>& x, int rows, int cols, int pitch, int out_rows) {
  std::vector<bf16> out(std::size_t(out_rows) * std::size_t(pitch), bf16(0.0f));
  for (int r = 0; r < rows; ++r)
    for (int c = 0; c < cols; ++c) out[std::size_t(c * pitch + r)] = bf16(float(x[std::size_t(r * cols + c)]));
  return out;
}

}  // namespace

// ---- the layout ---------------------------------------------------------------------------------------

TEST_CASE("MFMA 32x32x8 bf16 lane layout matches the documented element-to-register mapping", "[mfma]") {
  // AMD Matrix Instruction Calculator, --detail-instruction, CDNA2 v_mfma_f32_32x32x8bf16_1k and CDNA3
  // v_mfma_f32_32x32x8_bf16 (the same mapping), "Matrix element to register mapping with no modifiers":
  //   A[i][k]: GPR floor(k / 2) % 2, bits 16 (k % 2) .., lane 32 floor(k / 4) + i
  //   B[k][j]: GPR floor(k / 2) % 2, bits 16 (k % 2) .., lane 32 floor(k / 4) + j
  //   C or D[i][j]: GPR 4 floor(i / 8) + (i % 4), lane (32 floor(i / 4)) % 64 + j
  // An operand element e of the 4-short vector is GPR e / 2, bits 16 (e % 2).
  for (int l = 0; l < mfma::kLanes; ++l) {
    for (int e = 0; e < mfma::kOperandElems; ++e) {
      const int i = mfma::lane_col(l), k = mfma::operand_k(l, e);
      REQUIRE(k >= 0);
      REQUIRE(k < mfma::kK);
      CHECK(l == 32 * (k / 4) + i);  // A[i][k] and B[k][i]: the lane
      CHECK(e / 2 == (k / 2) % 2);   // the register of the pair
      CHECK(e % 2 == k % 2);         // its half
    }
    for (int g = 0; g < mfma::kAccRegs; ++g) {
      const int i = mfma::acc_row(l, g), j = mfma::lane_col(l);
      REQUIRE(i >= 0);
      REQUIRE(i < mfma::kM);
      CHECK(g == 4 * (i / 8) + i % 4);
      CHECK(l == (32 * (i / 4)) % 64 + j);
    }
  }
  // two entries of the calculator's register-to-element direction: register 5 of lane 33 holds D[13][1],
  // element 2 of lane 40 holds A[8][6]
  CHECK(mfma::acc_row(33, 5) == 13);
  CHECK(mfma::lane_col(33) == 1);
  CHECK(mfma::lane_col(40) == 8);
  CHECK(mfma::operand_k(40, 2) == 6);
}

TEST_CASE("the emulated MFMA multiplies matrices placed by the documented mapping", "[mfma]") {
  std::mt19937 rng(11);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  float A[32][8], B[8][32], C[32][32];
  for (auto& row : A)
    for (float& x : row) x = float(bf16(nd(rng)));
  for (auto& row : B)
    for (float& x : row) x = float(bf16(nd(rng)));
  for (auto& row : C)
    for (float& x : row) x = nd(rng);
  W::Reg<mfma::Operand> a{}, b{};
  W::Reg<mfma::Accum> c{};
  // placed with the documented element-to-register formulas (not the layout header's functions)
  for (int i = 0; i < 32; ++i)
    for (int k = 0; k < 8; ++k) {
      a[std::size_t(32 * (k / 4) + i)][k % 4] = static_cast<short>(bf16(A[i][k]).bits);
      b[std::size_t(32 * (k / 4) + i)][k % 4] = static_cast<short>(bf16(B[k][i]).bits);
    }
  for (int i = 0; i < 32; ++i)
    for (int j = 0; j < 32; ++j) c[std::size_t((32 * (i / 4)) % 64 + j)][4 * (i / 8) + i % 4] = C[i][j];
  W::mma(c, a, b);
  for (int i = 0; i < 32; ++i)
    for (int j = 0; j < 32; ++j) {
      double want = C[i][j];
      for (int k = 0; k < 8; ++k) want += double(A[i][k]) * double(B[k][j]);
      const float got = c[std::size_t((32 * (i / 4)) % 64 + j)][4 * (i / 8) + i % 4];
      CHECK(std::abs(got - want) <= 1e-5 * (1.0 + std::abs(want)));
    }
}

TEST_CASE("MFMA product tile: 32 x 32 dots of bf16 rows", "[mfma]") {
  constexpr int kD = 80, kPitch = kD + 4;
  std::mt19937 rng(5);
  std::normal_distribution<double> nd(0.0, 1.0);
  std::vector<double> a(32 * kD), b(32 * kD);
  for (double& x : a) x = round_bf16(nd(rng));
  for (double& x : b) x = round_bf16(nd(rng));
  const std::vector<bf16> ar = bf16_rows(a, 32, kD, kPitch, 32), br = bf16_rows(b, 32, kD, kPitch, 32);
  std::vector<float> out(32 * 36, -1.0f);
  mfma::product_abt<W, kD>(ar.data(), kPitch, br.data(), kPitch, out.data(), 36);
  for (int i = 0; i < 32; ++i)
    for (int j = 0; j < 32; ++j) {
      double want = 0.0;
      for (int d = 0; d < kD; ++d) want += a[std::size_t(i * kD + d)] * b[std::size_t(j * kD + d)];
      CHECK(std::abs(out[std::size_t(i * 36 + j)] - want) <= 1e-5 * std::sqrt(double(kD)) * 4.0);
    }
}

// ---- attention: the KVM readout's shape ------------------------------------------------------------------

namespace {

// One wavefront's 32 query rows over n keys in tiles of 64: logits scale * q.k, key s visible to column c
// iff s < limit[c] (a window's causal mask; limit 0: no key), the output o / sum and lse against fp64.
template <int kD, int kDv>
void check_attend(int n, std::uint32_t seed) {
  using Tile = mfma::AttendTile<W, kD, kDv>;
  constexpr int kKP = kD + 4, kVP = mfma::kTileKeys + 4;
  std::mt19937 rng(seed);
  std::normal_distribution<double> nd(0.0, 1.0);
  std::vector<double> q(32 * kD), k(std::size_t(n) * kD), v(std::size_t(n) * kDv);
  for (double& x : q) x = round_bf16(nd(rng));
  for (double& x : k) x = round_bf16(nd(rng));
  for (double& x : v) x = round_bf16(nd(rng));
  std::vector<int> limit(32);
  for (int c = 0; c < 32; ++c) limit[std::size_t(c)] = c == 3 ? 0 : std::min(n, n / 2 + 3 * c);
  const double scale = 1.3 / std::sqrt(double(kD));
  std::vector<bf16> qrows = bf16_rows(q, 32, kD, kD, 32);

  Tile tile;
  tile.begin([&](int c) -> const bf16* { return c == 7 ? nullptr : qrows.data() + c * kD; });
  for (int base = 0; base < n; base += mfma::kTileKeys) {
    const int cnt = std::min(mfma::kTileKeys, n - base);
    std::vector<double> kt(k.begin() + std::ptrdiff_t(base) * kD, k.begin() + std::ptrdiff_t(base + cnt) * kD);
    std::vector<double> vt(v.begin() + std::ptrdiff_t(base) * kDv, v.begin() + std::ptrdiff_t(base + cnt) * kDv);
    const std::vector<bf16> ks = bf16_rows(kt, cnt, kD, kKP, mfma::kTileKeys);
    const std::vector<bf16> vs = bf16_transposed(vt, cnt, kDv, kVP, Tile::kValueRows);
    tile.step(ks.data(), kKP, vs.data(), kVP, [&](int key, int col, float dot) {
      const bool visible = key < cnt && col != 7 && base + key < limit[std::size_t(col)];
      return visible ? float(scale) * dot : -std::numeric_limits<float>::infinity();
    });
  }
  std::vector<double> got(32 * kDv, 0.0), lse(32, -kInf), sums(32, 0.0);
  std::vector<int> seen(32 * kDv, 0);
  tile.finish(
      [&](int, int c, float mx, float sum) {
        sums[std::size_t(c)] = sum;
        lse[std::size_t(c)] = sum > 0.0f ? double(mx) + std::log(double(sum)) : -kInf;
      },
      [&](int, int c, int d, float o, float sum) {
        got[std::size_t(c * kDv + d)] = sum > 0.0f ? double(o) / double(sum) : 0.0;
        ++seen[std::size_t(c * kDv + d)];
      });
  for (int x : seen) REQUIRE(x == 1);  // every (column, dim) handed out once
  // fp64 softmax on the same bf16 values
  std::vector<double> want(32 * kDv, 0.0);
  for (int c = 0; c < 32; ++c) {
    const int lim = c == 7 ? 0 : limit[std::size_t(c)];
    if (lim == 0) {
      CHECK(sums[std::size_t(c)] == 0.0);
      CHECK(lse[std::size_t(c)] == -kInf);
      continue;
    }
    std::vector<double> l(static_cast<std::size_t>(lim));
    double mx = -kInf;
    for (int s = 0; s < lim; ++s) {
      double dot = 0.0;
      for (int d = 0; d < kD; ++d) dot += q[std::size_t(c * kD + d)] * k[std::size_t(s * kD + d)];
      l[std::size_t(s)] = scale * dot;
      mx = std::max(mx, l[std::size_t(s)]);
    }
    double sum = 0.0;
    for (int s = 0; s < lim; ++s) sum += std::exp(l[std::size_t(s)] - mx);
    for (int s = 0; s < lim; ++s)
      for (int d = 0; d < kDv; ++d)
        want[std::size_t(c * kDv + d)] += std::exp(l[std::size_t(s)] - mx) / sum * v[std::size_t(s * kDv + d)];
    CHECK(std::abs(lse[std::size_t(c)] - (mx + std::log(sum))) <= 1e-4 * (1.0 + std::abs(mx)));
  }
  // P rounded to bf16 before P V: about 2^-9 relative per weight
  CHECK(rel_frobenius(got, want) < 4e-3);
}

}  // namespace

TEST_CASE("MFMA attention tile: masked softmax over key tiles (KVM readout shapes)", "[mfma]") {
  SECTION("D 128") {
    check_attend<128, 128>(150, 1);
  }
  SECTION("D 64") {
    check_attend<64, 64>(64, 2);
  }
  SECTION("D 80, values in a partly used O block") {
    check_attend<80, 80>(97, 3);
  }
  SECTION("one key") {
    check_attend<64, 64>(1, 4);
  }
}

// ---- UA prefill, composed as chunk_attend_mfma_kernel composes it ------------------------------------

namespace {

// One (sequence, kv head) item with r query heads, T prompt rows, no cached rows: row tiles of 128
// (head, row) pairs (128 / r rows), entry tiles of 64, the similarity of an entry block and the row
// tile's keys on the emulated MFMA, the decay fold and the λ carry of kernel/ua_decay.hpp, attention
// with Λ. Against reference::ua::dense on the same bf16 inputs.
template <int kD>
void check_ua_prefill(int r, int T, std::uint32_t seed) {
  using Set = kvmem::decay::Universal;
  namespace ref = kvmem::reference::ua;
  constexpr int kKP = kD + 4, kVP = mfma::kTileKeys + 4, kAP = 32 + 4;
  ref::Config cfg;
  cfg.B = 1;
  cfg.G = 1;
  cfg.H = r;
  cfg.T = T;
  cfg.D = kD;
  ref::Inputs in;
  std::mt19937 rng(seed);
  std::normal_distribution<double> nd(0.0, 1.0);
  in.q.resize(std::size_t(r * T * kD));
  in.k.resize(std::size_t(T * kD));
  in.v.resize(std::size_t(T * kD));
  in.z_k.resize(std::size_t(T));
  in.z_q.resize(std::size_t(T));
  for (double& x : in.q) x = round_bf16(1.5 * nd(rng));
  for (int t = 0; t < T; ++t) {  // unit keys (spec UA.md 2), a shared direction so that decays bite
    double norm = 0.0;
    std::vector<double> raw(kD);
    for (int d = 0; d < kD; ++d) {
      raw[std::size_t(d)] = nd(rng) + (d < 4 ? 2.0 : 0.0);
      norm += raw[std::size_t(d)] * raw[std::size_t(d)];
    }
    for (int d = 0; d < kD; ++d) in.k[std::size_t(t * kD + d)] = round_bf16(raw[std::size_t(d)] / std::sqrt(norm));
  }
  for (double& x : in.v) x = round_bf16(nd(rng));
  for (double& x : in.z_k) x = double(float(1.0 + nd(rng)));
  for (double& x : in.z_q) x = double(float(1.0 + nd(rng)));
  const ref::DenseResult want = ref::dense<Set>(cfg, in);

  const int rt = 128 / r;
  std::vector<float> lambda(std::size_t(T), 0.0f);  // λ of every entry (persistent across row tiles)
  std::vector<double> got(std::size_t(T * r * kD), 0.0);
  for (int r0 = 0; r0 < T; r0 += rt) {
    const int nr = std::min(rt, T - r0);
    // the row tile's keys (rows past the call: zeros) and query-side gates
    std::vector<double> nk_vals(in.k.begin() + std::ptrdiff_t(r0) * kD, in.k.begin() + std::ptrdiff_t(r0 + nr) * kD);
    const std::vector<bf16> nk = bf16_rows(nk_vals, nr, kD, kKP, 32);
    std::vector<mfma::AttendTile<W, kD, kD>> waves(4);
    for (int w = 0; w < 4; ++w)
      waves[std::size_t(w)].begin([&](int c) -> const double* {
        const int p = 32 * w + c, h = p / rt, i = p % rt;
        return i < nr ? in.q.data() + std::size_t((h * T + r0 + i) * kD) : nullptr;
      });
    for (int e0 = 0; e0 < r0 + nr; e0 += mfma::kTileKeys) {
      const int ne = std::min(mfma::kTileKeys, T - e0);
      std::vector<double> kv(in.k.begin() + std::ptrdiff_t(e0) * kD, in.k.begin() + std::ptrdiff_t(e0 + ne) * kD);
      std::vector<double> vv(in.v.begin() + std::ptrdiff_t(e0) * kD, in.v.begin() + std::ptrdiff_t(e0 + ne) * kD);
      const std::vector<bf16> ks = bf16_rows(kv, ne, kD, kKP, mfma::kTileKeys);
      const std::vector<bf16> vs = bf16_transposed(vv, ne, kD, kVP, mfma::AttendTile<W, kD, kD>::kValueRows);
      std::vector<float> at(std::size_t(mfma::kTileKeys * kAP), 0.0f);
      for (int blk = 0; blk < 2; ++blk)
        mfma::product_abt<W, kD>(ks.data() + blk * 32 * kKP, kKP, nk.data(), kKP, at.data() + blk * 32 * kAP, kAP);
      // the decay fold A(e, m) (0 where m <= pos_e), then Λ carried down the rows in increasing m
      for (int e = 0; e < ne; ++e) {
        const int pos = e0 + e;
        for (int i = 0; i < rt; ++i) {
          const int m = r0 + i;
          float a = 0.0f;
          if (i < nr && m > pos)
            a = kvmem::kernel::ua::decay_from_similarity<Set, float>(
                at[std::size_t(e * kAP + i)], float(in.z_k[std::size_t(pos)]),
                kvmem::kernel::ua::key_gate_part(float(in.z_k[std::size_t(pos)])), pos, float(in.z_q[std::size_t(m)]),
                kvmem::kernel::ua::query_gate_part(float(in.z_q[std::size_t(m)])), m);
          at[std::size_t(e * kAP + i)] = a;
        }
        float* col = at.data() + e * kAP;
        lambda[std::size_t(pos)] = kvmem::kernel::ua::cumulative_decay<float>(
            pos >= r0 ? 0.0f : lambda[std::size_t(pos)], pos, r0, col, nr, col, 1);
      }
      for (int w = 0; w < 4; ++w)
        waves[std::size_t(w)].step(ks.data(), kKP, vs.data(), kVP, [&](int key, int c, float dot) {
          const int i = (32 * w + c) % rt;
          const float bias = (i < nr && key < ne) ? at[std::size_t(key * kAP + i)] : -INFINITY;
          return bias == -INFINITY ? bias : dot + bias;
        });
    }
    for (int w = 0; w < 4; ++w)
      waves[std::size_t(w)].finish([](int, int, float, float) {},
                                   [&](int, int c, int d, float o, float sum) {
                                     const int p = 32 * w + c, h = p / rt, i = p % rt;
                                     if (i < nr)
                                       got[std::size_t(((r0 + i) * r + h) * kD + d)] = double(o) / double(sum);
                                   });
  }
  // the bias is fp32 λ and the weights are rounded to bf16 before P V
  const double err = rel_frobenius(got, want.out);
  INFO("relative Frobenius error " << err);
  CHECK(err < 5e-3);
  for (int t = 0; t < T; ++t)  // λ after the prompt is Λ_{T-1, j}
    CHECK(std::abs(lambda[std::size_t(t)] - want.lambda_last[std::size_t(t)]) <=
          1e-4 * (1.0 + std::abs(want.lambda_last[std::size_t(t)])));
}

}  // namespace

TEST_CASE("MFMA UA prefill tiles against the fp64 dense reference", "[mfma]") {
  SECTION("D 128, r 4, two row tiles, three entry tiles") {
    check_ua_prefill<128>(4, 150, 21);
  }
  SECTION("D 64, r 8, row tiles of 16 rows") {
    check_ua_prefill<64>(8, 70, 22);
  }
  SECTION("D 80, r 4") {
    check_ua_prefill<80>(4, 40, 23);
  }
}

// ---- KVM novelty and routing -------------------------------------------------------------------------

namespace {

// 64 tokens (two wavefronts) against `slots` slots: novelty (max over every slot; route candidate over
// slots >= sink) on k0, routing (argmax) on kg = g k0 over [sink, slots). LN_s of the tokens against an
// fp64 LN; values against fp64 dots with the slots' fp32 K^ rows; an argmax must be the fp64 argmax or
// within the products' error of it, and exactly the fp64 argmax where the fp64 margin exceeds that.
template <int kD, int kTerms>
void check_route(int slots, std::uint32_t seed) {
  constexpr int kP = kD + 4, kTokens = 64, kSink = 1;
  const int rope = kD / 2;
  const float eps = 1e-5f;
  std::mt19937 rng(seed);
  std::normal_distribution<double> nd(0.0, 1.0);
  std::uniform_real_distribution<double> ud(0.5, 2.0);
  std::vector<float> ln_w(kD), ln_b(kD);
  for (float& x : ln_w) x = float(1.0 + 0.2 * nd(rng));
  for (float& x : ln_b) x = float(0.1 * nd(rng));
  // LN-like slot keys; the sink slot 0 four times longer: the largest dot of many tokens, which the
  // novelty score takes and a route candidate may not
  std::vector<float> khat32(std::size_t(slots) * kD);
  for (float& x : khat32) x = float(nd(rng));
  for (int d = 0; d < kD; ++d) khat32[std::size_t(d)] *= 4.0f;
  std::vector<double> raw(std::size_t(kTokens) * kD), gate(kTokens);
  for (double& x : raw) x = round_bf16(2.0 * nd(rng));
  for (double& x : gate) x = double(float(ud(rng)));
  std::vector<bf16> hi(std::size_t(slots) * kP, bf16(0.0f)), lo(std::size_t(slots) * kP, bf16(0.0f));
  for (int j = 0; j < slots; ++j)
    for (int d = 0; d < kD; ++d) {
      const float x = khat32[std::size_t(j * kD + d)];
      hi[std::size_t(j * kP + d)] = bf16(x);
      lo[std::size_t(j * kP + d)] = bf16(x - float(bf16(x)));
    }
  // fp64 k0 of every token (spec KVM.md 4.2: zero the rope channels, LN_s with biased variance)
  std::vector<double> k0(std::size_t(kTokens) * kD);
  for (int c = 0; c < kTokens; ++c) {
    double mean = 0.0, var = 0.0;
    for (int d = 0; d < kD; ++d) mean += d >= rope ? raw[std::size_t(c * kD + d)] : 0.0;
    mean /= kD;
    for (int d = 0; d < kD; ++d) {
      const double x = (d >= rope ? raw[std::size_t(c * kD + d)] : 0.0) - mean;
      var += x * x;
    }
    var /= kD;
    for (int d = 0; d < kD; ++d)
      k0[std::size_t(c * kD + d)] =
          double(ln_w[std::size_t(d)]) *
              (((d >= rope ? raw[std::size_t(c * kD + d)] : 0.0) - mean) / std::sqrt(var + eps)) +
          double(ln_b[std::size_t(d)]);
  }
  // products' error bound (near_ties.hpp's reasoning): 3 terms about 4 * 2^-16 |x||y|, 1 term two bf16
  // roundings; plus the fp32 LN's and accumulation's rounding
  const double rel = kTerms == 3 ? 4.0 * 0x1p-16 + 1e-5 : 2.0 * 0x1p-8 + 1e-5;
  int exact = 0, compared = 0;
  for (bool novelty : {true, false}) {
    for (int w = 0; w < kTokens / 32; ++w) {
      mfma::RouteTile<W, kD, kTerms> tile;
      std::vector<double> k0_seen(32 * kD, 0.0);
      tile.prepare([&](int c) { return c != 31 || w == 0; },  // column 31 of wave 1: no token
                   [&](int c, int d) { return float(raw[std::size_t((32 * w + c) * kD + d)]); }, ln_w.data(),
                   ln_b.data(), eps, rope,
                   [&](int, int c, int d, float y) {
                     k0_seen[std::size_t(c * kD + d)] = y;
                     return novelty ? y : float(gate[std::size_t(32 * w + c)]) * y;
                   });
      // novelty scans every slot, a routing pass the slots from the sink on (the kernels' j0)
      for (int base = novelty ? 0 : kSink; base < slots; base += 32) {
        const int n = std::min(32, slots - base);
        std::vector<bf16> th(std::size_t(32 * kP), bf16(0.0f)), tl(std::size_t(32 * kP), bf16(0.0f));
        std::copy(hi.begin() + std::ptrdiff_t(base) * kP, hi.begin() + std::ptrdiff_t(base + n) * kP, th.begin());
        std::copy(lo.begin() + std::ptrdiff_t(base) * kP, lo.begin() + std::ptrdiff_t(base + n) * kP, tl.begin());
        if (novelty)
          tile.template step<true>(th.data(), tl.data(), kP, base, n, kSink);
        else
          tile.template step<false>(th.data(), tl.data(), kP, base, n, kSink);
      }
      if (novelty)
        tile.template finish<true>();
      else
        tile.template finish<false>();
      for (int l = 0; l < mfma::kLanes; ++l) {
        const int c = mfma::lane_col(l), token = 32 * w + c;
        if (c == 31 && w == 1) {  // no token: nothing to check but that no lane invented a slot
          continue;
        }
        for (int d = 0; d < kD; ++d) {
          if (l >= 32) break;
          const double want_k0 = k0[std::size_t(token * kD + d)];
          CHECK(std::abs(k0_seen[std::size_t(c * kD + d)] - want_k0) <= 1e-5 * (1.0 + std::abs(want_k0)));
        }
        // fp64 dots of the routed operand with the fp32 slot keys
        const double g = novelty ? 1.0 : gate[std::size_t(token)];
        double best = -kInf, best_sink = -kInf, second = -kInf, scale = 0.0;
        int arg = -1;
        std::vector<double> dot(static_cast<std::size_t>(slots));
        for (int j = 0; j < slots; ++j) {
          double s = 0.0, m = 0.0;
          for (int d = 0; d < kD; ++d) {
            s += g * k0[std::size_t(token * kD + d)] * double(khat32[std::size_t(j * kD + d)]);
            m += std::abs(g * k0[std::size_t(token * kD + d)] * double(khat32[std::size_t(j * kD + d)]));
          }
          dot[std::size_t(j)] = s;
          scale = std::max(scale, m);
          best = std::max(best, s);
          if (j >= kSink) {
            if (s > best_sink) {
              second = best_sink;
              best_sink = s;
              arg = j;
            } else {
              second = std::max(second, s);
            }
          }
        }
        const double tol = rel * scale;
        const float got_best = W::at(tile.best, l);
        const int got_arg = novelty ? W::at(tile.carg, l) : W::at(tile.arg, l);
        if (novelty) CHECK(std::abs(double(got_best) - best) <= tol);
        REQUIRE(got_arg >= kSink);
        REQUIRE(got_arg < slots);
        CHECK(dot[std::size_t(got_arg)] >= best_sink - 2.0 * tol);  // the fp64 argmax or within rounding
        if (best_sink - second > 2.0 * tol) {
          ++compared;
          exact += got_arg == arg;
          CHECK(got_arg == arg);
        }
      }
    }
  }
  INFO("exact argmax on " << exact << " of " << compared << " separable tokens");
  CHECK(compared > 0);
}

}  // namespace

TEST_CASE("MFMA novelty and routing tile against fp64 dots", "[mfma]") {
  SECTION("D 128, hi.hi + lo.hi + hi.lo") {
    check_route<128, 3>(150, 31);
  }
  SECTION("D 64, hi.hi + lo.hi + hi.lo") {
    check_route<64, 3>(70, 32);
  }
  SECTION("D 128, hi.hi only") {
    check_route<128, 1>(100, 33);
  }
}

TEST_CASE("MFMA routing tile: equal values go to the smaller slot, across lanes and tiles", "[mfma]") {
  // every slot the same key: all dots equal, the first slot of the pass must win (the host's scan)
  constexpr int kD = 64, kP = kD + 4;
  std::vector<bf16> rows(std::size_t(32 * kP), bf16(0.0f));
  for (int j = 0; j < 32; ++j)
    for (int d = 0; d < kD; ++d) rows[std::size_t(j * kP + d)] = bf16(d % 3 == 0 ? 1.0f : -0.5f);
  std::vector<float> ln_w(kD, 1.0f), ln_b(kD, 0.0f);
  mfma::RouteTile<W, kD, 3> tile;
  tile.prepare([](int) { return true; }, [](int c, int d) { return float((c + 1) * ((d * 7) % 5) - 2); }, ln_w.data(),
               ln_b.data(), 1e-5f, 0, [](int, int, int, float y) { return y; });
  for (int base : {5, 37, 69}) tile.template step<false>(rows.data(), rows.data(), kP, base, 32, 1);
  tile.template finish<false>();
  for (int l = 0; l < mfma::kLanes; ++l) CHECK(W::at(tile.arg, l) == 5);
}
