// SPDX-License-Identifier: Apache-2.0
// A consumer of the installed kvmem::kokkos target: initialises Kokkos, allocates a KVM state on the
// default execution space and checks its capacity.
#include <cstdio>

#include <Kokkos_Core.hpp>
#include <kvmem/backend/kokkos.hpp>

int main(int argc, char** argv) {
  Kokkos::ScopeGuard guard(argc, argv);
  const kvmem::kokkos::Executor<Kokkos::DefaultHostExecutionSpace> exec{};
  kvmem::kvm::Params params;
  const kvmem::kvm::Shape shape{1, 2, 1, 64, 64, 256};
  kvmem::kokkos::KvmState<float, float, Kokkos::HostSpace> kvm;
  const kvmem::Status status = kvmem::kokkos::create_state(exec, params, shape, kvm);
  if (!status.is_ok() || kvm.memory.size() == 0) {
    std::printf("kvmem kokkos consumer: create_state failed: %s\n", status.to_string().c_str());
    return 1;
  }
  std::printf("kvmem kokkos consumer ok (%zu state bytes)\n", static_cast<std::size_t>(kvm.memory.size()));
  return 0;
}
