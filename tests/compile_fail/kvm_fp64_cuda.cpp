// SPDX-License-Identifier: Apache-2.0
// EXPECT: KVM kernels accumulate in fp32 only
#include "kvmem/backend/cuda/limits.hpp"
#include "kvmem/kvm/attention.hpp"
#ifdef KVMEM_CONTROL
using Kvm = kvmem::kvm::Attention<kvmem::budget::Fixed{256}, kvmem::precision::Fp32Storage, 128>;
#else
using Kvm = kvmem::kvm::Attention<kvmem::budget::Fixed{256}, kvmem::precision::Fp64, 128>;
#endif
static_assert(kvmem::check_kvm_support<kvmem::cuda::Executor, Kvm::accumulate_type, Kvm::kHeadDim, Kvm::kValueDim>());
// The host runs fp64 accumulation.
static_assert(kvmem::check_kvm_support<struct HostLike, double, 128, 128>());
int main() {
  return 0;
}
