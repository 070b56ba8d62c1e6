// SPDX-License-Identifier: Apache-2.0
// EXPECT: UA kernels do not take the variant's head dim
// A composed UA variant with a fixed head dim above the CUDA kernels' limit (256) fails to compile for
// the CUDA executor: the check ua::Attention's calls run (backend/cuda/limits.hpp needs no nvcc).
#include "kvmem/backend/cuda/limits.hpp"
#include "kvmem/ua/ops.hpp"
#ifdef KVMEM_CONTROL
using Ua = kvmem::ua::Attention<kvmem::decay::Universal, kvmem::prune::None{}, kvmem::precision::Bf16Storage, 256>;
#else
using Ua = kvmem::ua::Attention<kvmem::decay::Universal, kvmem::prune::None{}, kvmem::precision::Bf16Storage, 320>;
#endif
static_assert(kvmem::check_ua_support<kvmem::cuda::Executor, Ua::kHeadDim>());
// The host takes any head dim.
static_assert(kvmem::check_ua_support<struct HostLike, 320>());
int main() {
  return 0;
}
