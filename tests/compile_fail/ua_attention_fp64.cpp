// SPDX-License-Identifier: Apache-2.0
// EXPECT: the host UA path accumulates in fp32
#include "kvmem/ua/ops.hpp"
#ifdef KVMEM_CONTROL
using Ua = kvmem::ua::Attention<kvmem::decay::Universal, kvmem::prune::None{}, kvmem::precision::Fp32Storage>;
#else
using Ua = kvmem::ua::Attention<kvmem::decay::Universal, kvmem::prune::None{}, kvmem::precision::Fp64>;
#endif
Ua::Cache* cache = nullptr;
int main() {
  return cache == nullptr ? 0 : 1;
}
