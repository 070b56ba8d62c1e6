// SPDX-License-Identifier: Apache-2.0
// EXPECT: fp8 .kvmem::e4m3. storage of KVM slots is not supported
// fp8 storage is a UA cache format; a KVM variant composed with it is refused where the type is formed.
#include "kvmem/kvm/attention.hpp"
#ifdef KVMEM_CONTROL
using Kvm = kvmem::kvm::Attention<kvmem::budget::Fixed{256}, kvmem::precision::Bf16Storage>;
#else
using Kvm = kvmem::kvm::Attention<kvmem::budget::Fixed{256}, kvmem::precision::Fp8Storage>;
#endif
int main() {
  return Kvm::kHeadDim == kvmem::kAnyDim ? 0 : 1;
}
