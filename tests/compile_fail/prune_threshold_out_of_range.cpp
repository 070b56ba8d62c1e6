// SPDX-License-Identifier: Apache-2.0
// EXPECT: p must lie in \[0, 1\]
#include "kvmem/policy/prune.hpp"
#ifdef KVMEM_CONTROL
constexpr auto policy = kvmem::prune::checked<kvmem::prune::Threshold{0.15}>();
#else
constexpr auto policy = kvmem::prune::checked<kvmem::prune::Threshold{1.5}>();
#endif
int main() {
  return 0;
}
