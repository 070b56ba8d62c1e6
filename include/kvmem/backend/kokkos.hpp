// SPDX-License-Identifier: Apache-2.0
#pragma once
// The Kokkos backend (requires Kokkos >= 3.4; DESIGN.md 1, 4): include this header, then call the
// kvm/ and ua/ operations with a kvmem::kokkos::Executor<Space> first.
//
//   kvmem::kokkos::Executor<Kokkos::DefaultExecutionSpace> exec{space};
//   kvmem::kokkos::KvmState<float, float, MemSpace> kvm;      // create_state(exec, params, shape, kvm)
//   kvmem::kvm::prefill(exec, kvm.state, weights, q, k, v, gate, out);
//   kvmem::kokkos::UaCache<float, MemSpace> cache;             // create_cache(exec, shape, cache)
//   kvmem::ua::prefill(exec, cache, inputs, options, out);
//
// See backend/kokkos/README.md for what runs where and the memory rules.

#include "kvmem/backend/kokkos/executor.hpp"
#include "kvmem/backend/kokkos/kvm.hpp"
#include "kvmem/backend/kokkos/ua.hpp"
