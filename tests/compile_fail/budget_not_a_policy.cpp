// SPDX-License-Identifier: Apache-2.0
// EXPECT: the type is not a budget policy
#include "kvmem/policy/budget.hpp"
struct NotABudget {
  int slots = 3;
};
#ifdef KVMEM_CONTROL
constexpr auto budget = kvmem::budget::checked<kvmem::budget::Fixed{256}>();
#else
constexpr auto budget = kvmem::budget::checked<NotABudget{}>();
#endif
int main() {
  return 0;
}
