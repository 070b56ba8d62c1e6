// SPDX-License-Identifier: Apache-2.0
// EXPECT: decay::Set needs at least one gate
#include "kvmem/policy/decay.hpp"
#ifdef KVMEM_CONTROL
using S = kvmem::decay::Set<kvmem::decay::KeyGate>;
#else
using S = kvmem::decay::Set<>;
#endif
constexpr int size = S::kSize;
int main() {
  return size - size;
}
