// SPDX-License-Identifier: Apache-2.0
// EXPECT: the type is not a prune policy
#include "kvmem/ua/ops.hpp"
struct NotARule {
  double p = 0.05;  // a threshold alone: no kEnabled, validate() or evictor(layer)
};
#ifdef KVMEM_CONTROL
using Ua = kvmem::ua::Attention<kvmem::decay::Universal, kvmem::prune::Threshold{0.05}>;
#else
using Ua = kvmem::ua::Attention<kvmem::decay::Universal, NotARule{}>;
#endif
int main() {
  return Ua::kPrune.p > 0.0 ? 0 : 1;
}
