// SPDX-License-Identifier: Apache-2.0
#pragma once
// Entry header of the CUDA backend (compile with nvcc, CMake option KVMEM_CUDA, target kvmem::cuda).
#include "kvmem/backend/cuda/common.cuh"
#include "kvmem/backend/cuda/kvm.cuh"
#include "kvmem/backend/cuda/limits.hpp"
#include "kvmem/backend/cuda/ua.cuh"
