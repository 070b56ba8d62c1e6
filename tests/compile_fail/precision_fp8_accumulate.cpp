// SPDX-License-Identifier: Apache-2.0
// EXPECT: fp8 .kvmem::e4m3. storage accumulates in fp32
// fp8 storage is a row format read into fp32 sums; an fp64 accumulation of it is refused when the
// policy is formed.
#include "kvmem/policy/precision.hpp"
#ifdef KVMEM_CONTROL
using P = kvmem::precision::Policy<kvmem::e4m3, float>;
#else
using P = kvmem::precision::Policy<kvmem::e4m3, double>;
#endif
P::accumulate_type value{};
int main() {
  return 0;
}
