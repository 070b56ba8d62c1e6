// SPDX-License-Identifier: Apache-2.0
// EXPECT: every gate needs a static log_factor
#include "kvmem/policy/decay.hpp"
struct NotAGate {
  double strength = 1.0;
};
#ifdef KVMEM_CONTROL
using S = kvmem::decay::Set<kvmem::decay::QueryGate, kvmem::decay::SimilarityGate>;
#else
using S = kvmem::decay::Set<kvmem::decay::QueryGate, NotAGate>;
#endif
constexpr int size = S::kSize;
int main() {
  return size - size;
}
