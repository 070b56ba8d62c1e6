// SPDX-License-Identifier: Apache-2.0
// EXPECT: KVM kernels do not take the variant's value head dim
#include "kvmem/backend/cuda/limits.hpp"
#include "kvmem/kvm/attention.hpp"
#ifdef KVMEM_CONTROL
using Kvm = kvmem::kvm::Attention<kvmem::budget::Fixed{256}, kvmem::precision::Bf16Storage, 128, 256>;
#else
using Kvm = kvmem::kvm::Attention<kvmem::budget::Fixed{256}, kvmem::precision::Bf16Storage, 128, 512>;
#endif
static_assert(kvmem::check_kvm_support<kvmem::cuda::Executor, Kvm::accumulate_type, Kvm::kHeadDim, Kvm::kValueDim>());
int main() {
  return 0;
}
