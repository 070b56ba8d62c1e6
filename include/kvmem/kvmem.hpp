// SPDX-License-Identifier: Apache-2.0
#pragma once
// kvmem umbrella header: core types, policies, both mechanisms and the host backend (the embedded
// default). Needs nothing but C++20.
// Optional backends have their own entry headers (kvmem/backend/kokkos.hpp, kvmem/backend/cuda.hpp).

#include "kvmem/backend/host/executor.hpp"
#include "kvmem/backend/host/kvm.hpp"
#include "kvmem/backend/host/ua.hpp"
#include "kvmem/core/config.hpp"
#include "kvmem/core/math.hpp"
#include "kvmem/core/memory.hpp"
#include "kvmem/core/numeric.hpp"
#include "kvmem/core/softmax.hpp"
#include "kvmem/core/status.hpp"
#include "kvmem/core/tensor.hpp"
#include "kvmem/kvm/attention.hpp"
#include "kvmem/kvm/schedule.hpp"
#include "kvmem/policy/budget.hpp"
#include "kvmem/policy/decay.hpp"
#include "kvmem/policy/precision.hpp"
#include "kvmem/policy/prune.hpp"
#include "kvmem/ua/cache.hpp"
#include "kvmem/ua/ops.hpp"
