// SPDX-License-Identifier: Apache-2.0
// EXPECT: KeepTop k >= 1
#include "kvmem/ua/ops.hpp"
#ifdef KVMEM_CONTROL
using Ua = kvmem::ua::Attention<kvmem::decay::Universal, kvmem::prune::KeepTop{1}>;
#else
using Ua = kvmem::ua::Attention<kvmem::decay::Universal, kvmem::prune::KeepTop{0}>;
#endif
int main() {
  return Ua::kPrune.k == 1 ? 0 : 1;
}
