// SPDX-License-Identifier: Apache-2.0
#pragma once
// Portability macros shared by every layer. The kernel bodies in kernel/ are compiled by the host
// compiler, by nvcc/hipcc and through Kokkos, so they are marked KVMEM_HOST_DEVICE.

#if defined(__CUDACC__) || defined(__HIPCC__)
#define KVMEM_HOST_DEVICE __host__ __device__
#define KVMEM_DEVICE_COMPILE 1
#else
#define KVMEM_HOST_DEVICE
#endif

#if defined(__CUDA_ARCH__) || defined(__HIP_DEVICE_COMPILE__)
#define KVMEM_ON_DEVICE 1
#endif

#define KVMEM_VERSION_MAJOR 0
#define KVMEM_VERSION_MINOR 1
#define KVMEM_VERSION_PATCH 0
