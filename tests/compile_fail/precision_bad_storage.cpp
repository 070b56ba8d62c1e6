// SPDX-License-Identifier: Apache-2.0
// EXPECT: Storage must be float, double, kvmem::bf16, kvmem::fp16 or kvmem::e4m3
#include "kvmem/policy/precision.hpp"
#ifdef KVMEM_CONTROL
using P = kvmem::precision::Policy<kvmem::bf16, float>;
#else
using P = kvmem::precision::Policy<int, float>;
#endif
P::storage_type value{};
int main() {
  return 0;
}
