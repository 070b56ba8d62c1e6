// SPDX-License-Identifier: Apache-2.0
// EXPECT: kvmem budget: invalid parameters
#include "kvmem/policy/budget.hpp"
#ifdef KVMEM_CONTROL
constexpr auto budget = kvmem::budget::checked<kvmem::budget::Power{16.0, 0.5, 256, 1}>();
#else
constexpr auto budget = kvmem::budget::checked<kvmem::budget::Power{16.0, 0.5, 256, 0}>();  // round_down 0
#endif
int main() {
  return 0;
}
