// SPDX-License-Identifier: Apache-2.0
// EXPECT: Accumulate must be float or double
#include "kvmem/policy/precision.hpp"
#ifdef KVMEM_CONTROL
using P = kvmem::precision::Policy<kvmem::fp16, float>;
#else
using P = kvmem::precision::Policy<kvmem::fp16, kvmem::fp16>;
#endif
P::accumulate_type value{};
int main() {
  return 0;
}
