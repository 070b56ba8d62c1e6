// SPDX-License-Identifier: Apache-2.0
#pragma once
// The Kokkos executor (DESIGN.md 3: executor first): an execution-space instance plus the few
// launch choices an engine may want to fix. kvm::Backend and the ua operations are specialised /
// overloaded for Executor<Space> in backend/kokkos/kvm.hpp and backend/kokkos/ua.hpp.
//
//   kvmem::kokkos::Executor<Kokkos::Serial> exec{Kokkos::Serial()};
//   kvmem::kvm::prefill(exec, state, weights, q, k, v, gate, out);
//
// Memory: every pointer an operation receives (tensor views, lengths, the state or cache) must be
// accessible from Space (Kokkos::SpaceAccessibility<Space, MemorySpace>). Views come either as
// kvmem::TensorView over the space's memory or as Kokkos::View through to_tensor_view(), which keeps
// the view's strides, so LayoutRight, LayoutLeft and LayoutStride views are described exactly (the
// operations then say which strides they accept).
//
// Written against the Kokkos 3.4 API that is still valid in Kokkos 4 (DESIGN.md 4).

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include <Kokkos_Core.hpp>

#include "kvmem/core/numeric.hpp"
#include "kvmem/core/support.hpp"
#include "kvmem/core/tensor.hpp"

namespace kvmem::kokkos {

template <class ExecSpace = Kokkos::DefaultExecutionSpace>
struct Executor {
  using execution_space = ExecSpace;
  using memory_space = typename ExecSpace::memory_space;

  ExecSpace space{};
  // false (default): an operation reads nothing back to the host (no synchronisation, graph-safe,
  // DESIGN.md 3); kernels skip every item whose sizes would overflow the state or cache and leave it
  // untouched (KVM: the sequence's counters too; UA: the sequence's position still advances, since the
  // per-item skip is not visible to the counter kernel), and non-finite inputs propagate.
  // true: before anything changes, one reduction checks the data-dependent preconditions (finite
  // inputs, lengths, capacity) and its result is read back on the host, so bad input returns a Status
  // (a synchronisation per call: for debugging and validation runs).
  bool checked = false;
  // Threads per team; 0 lets Kokkos choose (Kokkos::AUTO). Serial always runs one. A kernel with vector
  // lanes takes at most 1024 / lanes threads a team (a GPU block holds 1024 threads), fewer than asked.
  int team_size = 0;
};

// An unmanaged Kokkos::View of caller memory in Space's memory space (the form the operations take).
template <class DataType, class Space, class Layout = Kokkos::LayoutRight>
using UnmanagedView =
    Kokkos::View<DataType, Layout, typename Space::memory_space, Kokkos::MemoryTraits<Kokkos::Unmanaged>>;

// A kvmem tensor view over a Kokkos::View's memory with the view's own strides (any layout).
template <class View>
auto to_tensor_view(const View& view) {
  using Value = typename View::value_type;
  constexpr std::size_t kRank = View::rank;
  Extents<kRank> extents{};
  Extents<kRank> strides{};
  for (std::size_t i = 0; i < kRank; ++i) {
    extents[i] = static_cast<std::int64_t>(view.extent(i));
    strides[i] = static_cast<std::int64_t>(view.stride(i));
  }
  return TensorView<Value, kRank>(view.data(), extents, strides);
}

namespace detail {

// Every launch is marked light-weight: on Cuda a functor under the kernel-argument limit (4 KB) then
// travels as a kernel argument. Without the hint Kokkos copies a functor above 512 bytes (the KVM and
// UA call structs) into constant memory and first waits on the host until the previous such kernel has
// finished, which turns every launch of a call into a host round trip.
using LightWeight = Kokkos::Experimental::WorkItemProperty::HintLightWeight_t;

// Threads of a team times its vector lanes at most: a CUDA or HIP block's limit.
inline constexpr int kMaxTeamThreads = 1024;

// A team policy of `league` teams on exec's instance (Props: e.g. a work tag), team size from the
// executor, `lanes` vector lanes per thread.
template <class Space, class... Props>
Kokkos::TeamPolicy<Space, Props..., LightWeight> team_policy(const Executor<Space>& exec, std::int64_t league,
                                                             int lanes = 1) {
  using Policy = Kokkos::TeamPolicy<Space, Props..., LightWeight>;
  if (exec.team_size > 0)
    return Policy(exec.space, static_cast<int>(league), std::min(exec.team_size, kMaxTeamThreads / lanes), lanes);
  return Policy(exec.space, static_cast<int>(league), Kokkos::AUTO, lanes);
}

// A range policy over [begin, end) on exec's instance.
template <class Space>
Kokkos::RangePolicy<Space, LightWeight> range_policy(const Executor<Space>& exec, std::int64_t begin,
                                                     std::int64_t end) {
  return Kokkos::RangePolicy<Space, LightWeight>(exec.space, begin, end);
}

// Whether the kernels keep the host backend's operation order (host execution spaces, where the host
// compiler builds the same bodies, so results equal the host backend's bitwise, docs/kokkos.md) or
// spread one row's keys over a team in pieces merged in a fixed order (device spaces: a row of the
// host order is a chain of dependent tiles that leaves a GPU's team idle). Both orders give the same
// bits for every team size. KVMEM_KOKKOS_DEVICE_ORDER selects the device order on every space, so a
// machine without a GPU can test it (the tests then compare with the host within the tolerance).
template <class Space>
inline constexpr bool kHostOrder =
#if defined(KVMEM_KOKKOS_DEVICE_ORDER)
    false;
#else
    Kokkos::SpaceAccessibility<Space, Kokkos::HostSpace>::accessible;
#endif

// Query rows per team in the host order (KVM and UA rows kernels, one row per thread): enough teams
// for every core when a call has few items, few enough that a team's launch is amortised.
inline constexpr std::int64_t kHostRows = 8;
// Threads per team in the device order unless the executor fixes them: a KVM chunk's tokens (C = 256
// by default) one per thread in the update, and a row's keys (KVM slots plus window, UA entries) a few
// per thread.
inline constexpr int kDeviceTeam = 256;

// Vector lanes per thread of the device order's row teams: a key's dot product over D is shared by
// the lanes as kernel::dot's eight partial sums (lane l takes the elements l, l + 8, ...), so the
// lanes read consecutive elements of a key and the sum keeps kernel::dot's order and bits.
inline constexpr int kRowLanes = 8;

// a . b over n elements by the calling thread's vector lanes in kernel::dot's and kernel::ua::dot8's
// order: partial l is the sum of a[i] b[i] for i = l, l + 8, ... below the last multiple of 8, in
// increasing i (one lane each), then one lane adds the partials as ((0+1)+(2+3))+((4+5)+(6+7)), then the
// tail in order, and passes the sum to done(s). The sum has those kernels' bits whatever the number of
// lanes the space runs. partial: [kRowLanes], the thread's own scratch.
template <class Acc, class Member, class TA, class TB, class Done>
KOKKOS_INLINE_FUNCTION void lane_dot(const Member& team, Acc* partial, const TA* a, const TB* b, std::int64_t n,
                                     const Done& done) {
  static_assert(kRowLanes == 8, "kvmem::kokkos::lane_dot: the lanes take the eight partial sums of kernel::dot");
  const std::int64_t n8 = n / 8 * 8;
  Kokkos::parallel_for(Kokkos::ThreadVectorRange(team, kRowLanes), [&](const int l) {
    Acc s = Acc(0);
    for (std::int64_t i = l; i < n8; i += 8) s += load_as<Acc>(a[i]) * load_as<Acc>(b[i]);
    partial[l] = s;
  });
  Kokkos::single(Kokkos::PerThread(team), [&]() {
    const Acc* p = partial;
    Acc s = ((p[0] + p[1]) + (p[2] + p[3])) + ((p[4] + p[5]) + (p[6] + p[7]));
    for (std::int64_t i = n8; i < n; ++i) s += load_as<Acc>(a[i]) * load_as<Acc>(b[i]);
    done(s);
  });
}

// Level-0 team scratch on CUDA is capped near 40 KB (DESIGN.md 4: 48 KiB minus what Kokkos keeps);
// larger per-team buffers go to level 1.
inline constexpr std::size_t kScratch0Bytes = 32 * 1024;

}  // namespace detail

}  // namespace kvmem::kokkos

namespace kvmem {
// The Kokkos backend runs the host's kernel bodies: the host's limits, except fp8 storage, which neither
// its UA cache (kokkos::UaCache) nor its KVM drivers (no row scales in their readout) take.
template <class Space>
struct BackendLimits<kokkos::Executor<Space>> : BackendLimits<void> {
  static constexpr const char* kName = "kokkos";
  static constexpr bool kUaFp8 = false;
  static constexpr bool kKvmFp8 = false;
};
}  // namespace kvmem
