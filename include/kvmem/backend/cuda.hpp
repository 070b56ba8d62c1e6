// SPDX-License-Identifier: Apache-2.0
#pragma once
// Entry header of the GPU backend: compile with nvcc (CMake option KVMEM_CUDA, target kvmem::cuda) for
// NVIDIA GPUs, or with hipcc (KVMEM_HIP, kvmem::hip) for AMD GPUs from the same source (docs/hip.md).
#include "kvmem/backend/cuda/common.cuh"
#include "kvmem/backend/cuda/kvm.cuh"
#include "kvmem/backend/cuda/limits.hpp"
#include "kvmem/backend/cuda/ua.cuh"
