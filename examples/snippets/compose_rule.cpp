// SPDX-License-Identifier: Apache-2.0
// Documentation snippet (docs/compose.md "A user prune rule"): a prune rule written by a user, a
// threshold relative to the least decayed entry of each (sequence, KV head), composed into
// ua::Attention and run on the host. main() checks the rule held at the last eviction: every kept
// entry's λ lies within `margin` of the largest, and the rule evicted something.

#include <cmath>
#include <cstdint>
#include <vector>

#include "check.hpp"

// [snippet:compose-rule]
#include <kvmem/kvmem.hpp>

// Evict every entry whose λ lies more than `margin` below the largest λ of its (sequence, KV head).
struct RelativeThreshold {
  double margin = 3.0;

  static constexpr bool kEnabled = true;  // false would compile the eviction away (prune::None)
  constexpr const char* invalid_reason() const { return margin > 0.0 ? nullptr : "margin must be > 0"; }
  kvmem::Status validate() const {
    return margin > 0.0 ? kvmem::Status::ok() : kvmem::invalid_argument("margin", "> 0", margin);
  }
  // What the eviction body calls, once per (sequence, KV head): trivially copyable, host and device.
  struct Evictor {
    double margin;
    template <class Entries>  // entries.size(), entries.lambda(e), entries.pos(e)
    KVMEM_HOST_DEVICE kvmem::prune::Cut cut(const Entries& entries) const {
      double top = -HUGE_VAL;
      for (std::int64_t e = 0; e < entries.size(); ++e) top = entries.lambda(e) > top ? entries.lambda(e) : top;
      kvmem::prune::Cut c;
      c.log_p = top - margin;  // entries with λ < log_p go
      return c;
    }
  };
  Evictor evictor(std::int64_t /*layer*/) const { return {margin}; }
};
static_assert(kvmem::PrunePolicy<RelativeThreshold>);

using Ua = kvmem::ua::Attention<kvmem::decay::Universal, RelativeThreshold{3.0}>;
// [snippet-end]

int main() {
  using kvmem::TensorView;
  const std::int64_t B = 1, H = 2, G = 1, D = 32, T = 300;
  std::vector<float> q(B * H * T * D), k(B * G * T * D), v(B * G * T * D), z_k(B * G * T), z_q(B * G * T);
  std::vector<float> out(B * T * H * D);
  for (std::size_t i = 0; i < q.size(); ++i) q[i] = std::sin(0.31f * float(i));
  for (std::size_t i = 0; i < k.size(); ++i) k[i] = std::cos(0.017f * float(i) + float(i % 3));
  for (std::size_t i = 0; i < v.size(); ++i) v[i] = std::sin(0.29f * float(i));
  for (std::size_t i = 0; i < z_k.size(); ++i) z_k[i] = 1.5f * std::sin(0.05f * float(i)), z_q[i] = 1.0f;
  for (std::size_t r = 0; r < k.size(); r += std::size_t(D)) {
    float n2 = 0.0f;
    for (std::size_t d = 0; d < std::size_t(D); ++d) n2 += k[r + d] * k[r + d];
    for (std::size_t d = 0; d < std::size_t(D); ++d) k[r + d] /= std::sqrt(n2);
  }
  const kvmem::ua::Inputs in{
      TensorView<const float, 4>(q.data(), {B, H, T, D}), TensorView<const float, 4>(k.data(), {B, G, T, D}),
      TensorView<const float, 4>(v.data(), {B, G, T, D}), TensorView<const float, 3>(z_k.data(), {B, G, T}),
      TensorView<const float, 3>(z_q.data(), {B, G, T}),  {}};
  Ua::Cache cache;
  SNIPPET_CHECK_OK(Ua::Cache::create({B, H, G, D, T}, cache));
  SNIPPET_CHECK_OK(Ua::prefill(kvmem::host::Executor{}, cache, in, TensorView<float, 4>(out.data(), {B, T, H, D})));
  const std::int64_t n = cache.length(0, 0);
  const float* lambda = cache.lambda(0, 0);
  float top = lambda[0];
  for (std::int64_t e = 0; e < n; ++e) top = lambda[e] > top ? lambda[e] : top;
  for (std::int64_t e = 0; e < n; ++e) SNIPPET_CHECK(double(lambda[e]) >= double(top) - 3.0);
  SNIPPET_CHECK(n >= 1 && n < T);
  return 0;
}
