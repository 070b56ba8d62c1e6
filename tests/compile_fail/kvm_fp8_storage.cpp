// SPDX-License-Identifier: Apache-2.0
// EXPECT: KVM kernels do not store fp8 .kvmem::e4m3. slots
// A composed KVM variant with fp8 storage fails to compile for an executor whose backend does not store
// fp8 slots (the Kokkos backend's limits; a fake executor here, so the check needs no Kokkos), while the
// host and CUDA executors take it.
#include "kvmem/backend/cuda/limits.hpp"
#include "kvmem/kvm/attention.hpp"
namespace fake {
struct Executor {};
}  // namespace fake
template <>
struct kvmem::BackendLimits<fake::Executor> : kvmem::BackendLimits<void> {
  static constexpr bool kKvmFp8 = false;
};
using Kvm = kvmem::kvm::Attention<kvmem::budget::Fixed{256}, kvmem::precision::Fp8Storage>;
static_assert(std::is_same_v<Kvm::state_type, kvmem::kvm::State<kvmem::e4m3, float>>);
static_assert(kvmem::check_kvm_support<struct HostLike, Kvm::storage_type, float, Kvm::kHeadDim, Kvm::kValueDim>());
static_assert(
    kvmem::check_kvm_support<kvmem::cuda::Executor, Kvm::storage_type, float, Kvm::kHeadDim, Kvm::kValueDim>());
#ifdef KVMEM_CONTROL
static_assert(kvmem::check_kvm_support<fake::Executor, kvmem::bf16, float, Kvm::kHeadDim, Kvm::kValueDim>());
#else
static_assert(kvmem::check_kvm_support<fake::Executor, Kvm::storage_type, float, Kvm::kHeadDim, Kvm::kValueDim>());
#endif
int main() {
  return 0;
}
