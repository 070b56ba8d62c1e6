// SPDX-License-Identifier: Apache-2.0
// Online softmax and the exact merge of partial results, against a direct two-pass softmax.
#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include <catch2/catch.hpp>

#include "kvmem/core/softmax.hpp"

namespace {
struct Partial {
  std::vector<double> o;
  double lse;
};

// Two-pass softmax over logits[begin, end) with values [n][dim].
Partial direct(const std::vector<double>& logits, const std::vector<double>& values, int dim, int begin, int end) {
  double m = -INFINITY;
  for (int j = begin; j < end; ++j) m = std::max(m, logits[j]);
  double s = 0;
  std::vector<double> o(dim, 0.0);
  for (int j = begin; j < end; ++j) {
    const double w = std::exp(logits[j] - m);
    s += w;
    for (int d = 0; d < dim; ++d) o[d] += w * values[j * dim + d];
  }
  for (auto& x : o) x /= s;
  return {o, m + std::log(s)};
}

Partial online(const std::vector<double>& logits, const std::vector<double>& values, int dim, int begin, int end) {
  kvmem::OnlineSoftmax<double> state;
  std::vector<double> acc(dim, 0.0);
  for (int j = begin; j < end; ++j) {
    const auto step = state.push(logits[j]);
    for (int d = 0; d < dim; ++d) acc[d] = acc[d] * step.rescale + step.weight * values[j * dim + d];
  }
  for (auto& x : acc) x *= state.normaliser();
  return {acc, state.lse()};
}
}  // namespace

TEST_CASE("online softmax equals the two-pass softmax", "[softmax]") {
  std::mt19937 rng(7);
  std::normal_distribution<double> normal(0.0, 4.0);
  const int n = 57, dim = 5;
  std::vector<double> logits(n), values(n * dim);
  for (auto& x : logits) x = normal(rng);
  for (auto& x : values) x = normal(rng);
  logits[10] = -INFINITY;  // a masked key contributes nothing
  const auto a = direct(logits, values, dim, 0, n);
  const auto b = online(logits, values, dim, 0, n);
  CHECK(b.lse == Approx(a.lse).epsilon(1e-13));
  for (int d = 0; d < dim; ++d) CHECK(b.o[d] == Approx(a.o[d]).epsilon(1e-12).margin(1e-13));
}

TEST_CASE("merging partial results over a split is exact", "[softmax]") {
  std::mt19937 rng(11);
  std::normal_distribution<double> normal(0.0, 3.0);
  const int n = 40, dim = 3;
  std::vector<double> logits(n), values(n * dim);
  for (auto& x : logits) x = normal(rng);
  for (auto& x : values) x = normal(rng);
  const auto whole = direct(logits, values, dim, 0, n);
  for (int split : {1, 13, 39}) {
    const auto left = online(logits, values, dim, 0, split);
    const auto right = online(logits, values, dim, split, n);
    std::vector<double> merged(dim);
    double lse = 0;
    kvmem::merge_partials(left.o.data(), left.lse, right.o.data(), right.lse, dim, merged.data(), lse);
    CHECK(lse == Approx(whole.lse).epsilon(1e-13));
    for (int d = 0; d < dim; ++d) CHECK(merged[d] == Approx(whole.o[d]).epsilon(1e-12).margin(1e-13));
  }
  // an empty side is the identity
  std::vector<double> merged(dim);
  double lse = 0;
  kvmem::merge_partials(whole.o.data(), whole.lse, merged.data(), -std::numeric_limits<double>::infinity(), dim,
                        merged.data(), lse);
  CHECK(lse == whole.lse);
  CHECK(merged[1] == whole.o[1]);
}

TEST_CASE("raise_max + accumulate (tile form) equals push", "[softmax]") {
  kvmem::OnlineSoftmax<double> a, b;
  const double block1[] = {0.5, 2.0, -1.0}, block2[] = {3.0, 1.0};
  for (double x : block1) a.push(x);
  for (double x : block2) a.push(x);
  b.raise_max(2.0);
  for (double x : block1) b.accumulate(x);
  b.raise_max(3.0);
  for (double x : block2) b.accumulate(x);
  CHECK(b.lse() == Approx(a.lse()).epsilon(1e-14));
}
