// SPDX-License-Identifier: Apache-2.0
// EXPECT: UA kernels do not store fp8 .kvmem::e4m3. rows
// A composed UA variant with fp8 storage fails to compile for an executor whose backend does not store
// fp8 rows (the Kokkos backend's limits; a fake executor here, so the check needs no Kokkos), while
// the host and CUDA executors take it.
#include "kvmem/backend/cuda/limits.hpp"
#include "kvmem/ua/ops.hpp"
namespace fake {
struct Executor {};
}  // namespace fake
template <>
struct kvmem::BackendLimits<fake::Executor> : kvmem::BackendLimits<void> {
  static constexpr bool kUaFp8 = false;
};
using Ua = kvmem::ua::Attention<kvmem::decay::Universal, kvmem::prune::None{}, kvmem::precision::Fp8Storage>;
static_assert(kvmem::check_ua_support<kvmem::cuda::Executor, Ua::storage_type, Ua::kHeadDim>());
static_assert(kvmem::check_ua_support<struct HostLike, Ua::storage_type, Ua::kHeadDim>());
#ifdef KVMEM_CONTROL
static_assert(kvmem::check_ua_support<fake::Executor, kvmem::bf16, Ua::kHeadDim>());
#else
static_assert(kvmem::check_ua_support<fake::Executor, Ua::storage_type, Ua::kHeadDim>());
#endif
int main() {
  return 0;
}
