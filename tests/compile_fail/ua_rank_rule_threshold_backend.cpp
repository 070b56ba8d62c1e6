// SPDX-License-Identifier: Apache-2.0
// EXPECT: eviction kernels take only a threshold
// A backend whose UA calls take Options::p but no prune policy (every backend of kvmem takes policies;
// a third-party backend may not) runs the threshold-shaped policies through ua::Attention, and refuses
// a rank rule at compile time.
#include "kvmem/ua/ops.hpp"
namespace fake {
struct Executor {};
struct Cache {
  kvmem::ua::CacheShape shape() const { return {1, 1, 1, 8, 8, 16}; }
};
}  // namespace fake
namespace kvmem::ua {
template <DecaySet Set = decay::Universal>
Status prefill(const fake::Executor&, fake::Cache&, const Inputs&, const Options& opt, TensorView<float, 4>) {
  return opt.p == 0.05 ? Status::ok() : invalid_argument("p", 0.05, opt.p);
}
}  // namespace kvmem::ua
#ifdef KVMEM_CONTROL
using Ua = kvmem::ua::Attention<kvmem::decay::Universal, kvmem::prune::Threshold{0.05}>;
#else
using Ua = kvmem::ua::Attention<kvmem::decay::Universal, kvmem::prune::KeepTop{8}>;
#endif
int main() {
  fake::Cache cache;
  return Ua::prefill(fake::Executor{}, cache, kvmem::ua::Inputs{}, kvmem::TensorView<float, 4>{}).is_ok() ? 0 : 1;
}
