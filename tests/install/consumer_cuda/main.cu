// SPDX-License-Identifier: Apache-2.0
// A consumer of the installed kvmem::cuda target, compiled by nvcc with nothing but what the target
// carries (C++20, --expt-relaxed-constexpr, cudart). Without a GPU it reports zero devices; with one
// it also allocates a KVM state there.
#include <cstdio>

#include <kvmem/backend/cuda.hpp>

int main() {
  const int devices = kvmem::cuda::device_count();
  if (devices > 0) {
    kvmem::kvm::Params params;
    const kvmem::kvm::Shape shape{1, 2, 1, 64, 64, 256};
    kvmem::cuda::KvmState<> kvm;
    const kvmem::Status status = kvmem::cuda::KvmState<>::create(params, shape, kvm);
    if (!status.is_ok()) {
      std::printf("kvmem cuda consumer: KvmState::create failed: %s\n", status.to_string().c_str());
      return 1;
    }
  }
  std::printf("kvmem cuda consumer ok (%d devices)\n", devices);
  return 0;
}
