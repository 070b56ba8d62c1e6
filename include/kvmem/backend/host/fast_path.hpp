// SPDX-License-Identifier: Apache-2.0
#pragma once
// Whether the host backend's fast tile paths can use Eigen: yes when <Eigen/Core> is on the include
// path (the kvmem::eigen target, or Eigen3::Eigen linked beside kvmem::kvmem) unless KVMEM_NO_EIGEN
// is defined. Without Eigen the host backend needs nothing but a C++20 compiler and runs its plain
// paths; Executor::exact selects those paths also where Eigen is present.

#if !defined(KVMEM_NO_EIGEN) && __has_include(<Eigen/Core>)
#include "kvmem/backend/host/eigen_attend.hpp"
#define KVMEM_HOST_EIGEN 1
#else
#define KVMEM_HOST_EIGEN 0
#endif
