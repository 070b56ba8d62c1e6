// SPDX-License-Identifier: Apache-2.0
// EXPECT: a threshold p must lie in \[0, 1\]
#include "kvmem/ua/ops.hpp"
#ifdef KVMEM_CONTROL
using Ua = kvmem::ua::Attention<kvmem::decay::Universal, kvmem::prune::PerLayer{0.05, 0.15}>;
#else
using Ua = kvmem::ua::Attention<kvmem::decay::Universal, kvmem::prune::PerLayer{0.05, 1.5}>;
#endif
int main() {
  return Ua::kPrune.p[0] > 0.0 ? 0 : 1;
}
