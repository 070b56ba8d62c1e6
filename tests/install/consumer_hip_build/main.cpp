// SPDX-License-Identifier: Apache-2.0
// The GPU backend's entry header compiled by hipcc through kvmem::hip: 64-lane warps (CDNA), the HIP
// runtime behind the CUDA names (a device count without a GPU is 0, not an error).
#include <cstdio>

#include "kvmem/backend/cuda.hpp"

int main() {
  const int devices = kvmem::cuda::device_count();
  if (kvmem::cuda::kWarpSize != 64 || devices < 0) return 1;
  std::printf("kvmem hip consumer ok (warp %d, %d devices)\n", kvmem::cuda::kWarpSize, devices);
  return 0;
}
