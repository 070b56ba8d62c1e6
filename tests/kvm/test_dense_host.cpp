// SPDX-License-Identifier: Apache-2.0
// host::dense_causal_attention against causal attention in double written out here (the oracle
// shares no code with the backend). Shapes span several query blocks and key tiles of both host
// paths (the Eigen tile path and the exact scalar path), a ragged last block, GQA and Dv != D.
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include <catch2/catch.hpp>

#include "kvmem/backend/host/kvm_dense.hpp"
#include "support/golden.hpp"

namespace {
using kvmem::TensorView;

struct Case {
  std::int64_t B, Hq, Hk, T, D, Dv;
};

// out: [B,T,Hq,Dv]; q: [B,Hq,T,D]; k: [B,Hk,T,D]; v: [B,Hk,T,Dv]
std::vector<double> causal_fp64(const Case& c, const std::vector<double>& q, const std::vector<double>& k,
                                const std::vector<double>& v, double scale) {
  std::vector<double> out(std::size_t(c.B * c.T * c.Hq * c.Dv), 0.0);
  const std::int64_t rep = c.Hq / c.Hk;
  std::vector<double> l(std::size_t(c.T));
  for (std::int64_t b = 0; b < c.B; ++b)
    for (std::int64_t h = 0; h < c.Hq; ++h)
      for (std::int64_t t = 0; t < c.T; ++t) {
        const std::int64_t g = h / rep;
        double mx = -INFINITY;
        for (std::int64_t s = 0; s <= t; ++s) {
          double d = 0;
          for (std::int64_t i = 0; i < c.D; ++i)
            d += q[std::size_t(((b * c.Hq + h) * c.T + t) * c.D + i)] *
                 k[std::size_t(((b * c.Hk + g) * c.T + s) * c.D + i)];
          l[std::size_t(s)] = d * scale;
          mx = std::max(mx, l[std::size_t(s)]);
        }
        double z = 0;
        for (std::int64_t s = 0; s <= t; ++s) z += std::exp(l[std::size_t(s)] - mx);
        for (std::int64_t s = 0; s <= t; ++s) {
          const double p = std::exp(l[std::size_t(s)] - mx) / z;
          for (std::int64_t d = 0; d < c.Dv; ++d)
            out[std::size_t(((b * c.T + t) * c.Hq + h) * c.Dv + d)] +=
                p * v[std::size_t(((b * c.Hk + g) * c.T + s) * c.Dv + d)];
        }
      }
  return out;
}

template <class S>
std::vector<S> random_storage(std::size_t n, std::uint32_t seed, double sd) {
  std::mt19937 rng(seed);
  std::normal_distribution<double> dist(0.0, sd);
  std::vector<S> x(n);
  for (auto& e : x) e = static_cast<S>(static_cast<float>(dist(rng)));
  return x;
}

template <class S>
std::vector<double> widen(const std::vector<S>& x) {
  std::vector<double> y(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) y[i] = double(static_cast<float>(x[i]));
  return y;
}

template <class S>
std::vector<float> run_dense(const Case& c, const kvmem::host::Executor& exec, const std::vector<S>& q,
                             const std::vector<S>& k, const std::vector<S>& v, float scale) {
  std::vector<float> out(std::size_t(c.B * c.T * c.Hq * c.Dv), -1.0f);
  kvmem::host::dense_causal_attention<S>(exec, TensorView<const S, 4>(q.data(), {c.B, c.Hq, c.T, c.D}),
                                         TensorView<const S, 4>(k.data(), {c.B, c.Hk, c.T, c.D}),
                                         TensorView<const S, 4>(v.data(), {c.B, c.Hk, c.T, c.Dv}),
                                         TensorView<float, 4>(out.data(), {c.B, c.T, c.Hq, c.Dv}), scale);
  return out;
}

// fp32 accumulation over D-term dot products and up to T-term weighted sums of O(1) values: the
// rounding error is a few hundred ulp at most, far below DESIGN.md's 1e-5 relative for fp32 paths.
// Logits have standard deviation 2 (q, k scaled up), so the softmax is peaked and the running max
// rises inside and across tiles, exercising the rescale.
constexpr double kTolFp32 = 1e-5;

template <class S>
void check_case(const Case& c, std::uint32_t seed) {
  const auto q = random_storage<S>(std::size_t(c.B * c.Hq * c.T * c.D), seed, 1.4);
  const auto k = random_storage<S>(std::size_t(c.B * c.Hk * c.T * c.D), seed + 1, 1.4);
  const auto v = random_storage<S>(std::size_t(c.B * c.Hk * c.T * c.Dv), seed + 2, 1.0);
  const double scale = 1.0 / std::sqrt(double(c.D));
  // The oracle sees the same rounded inputs (bf16 storage), so only the arithmetic is compared.
  const auto expected = causal_fp64(c, widen(q), widen(k), widen(v), double(float(scale)));
  const auto fast1 = run_dense<S>(c, kvmem::host::Executor{1}, q, k, v, float(scale));
  const auto fast3 = run_dense<S>(c, kvmem::host::Executor{3}, q, k, v, float(scale));
  kvmem::host::Executor exact{2};
  exact.exact = true;
  const auto plain = run_dense<S>(c, exact, q, k, v, float(scale));
  KVMEM_CHECK_CLOSE(fast1, expected, kTolFp32);
  KVMEM_CHECK_CLOSE(plain, expected, kTolFp32);
  CHECK(fast1 == fast3);  // each (sequence, KV head) runs on one thread: bitwise equal
}
}  // namespace

TEST_CASE("host dense causal attention (fast and exact paths) matches fp64 causal attention", "[host][unit]") {
  SECTION("fp32, several blocks, ragged last block") {
    check_case<float>({2, 2, 2, 300, 64, 64}, 11);
  }
  SECTION("fp32, GQA rep 3, Dv != D") {
    check_case<float>({1, 6, 2, 200, 32, 48}, 21);
  }
  SECTION("fp32, one short block") {
    check_case<float>({1, 1, 1, 5, 16, 16}, 31);
  }
  SECTION("bf16 storage") {
    check_case<kvmem::bf16>({1, 2, 1, 260, 64, 32}, 41);
  }
}
