// SPDX-License-Identifier: Apache-2.0
#pragma once
// Slot lists of the Kokkos slot operations (reset_slots, copy_slots), checked where they live: inside a
// kernel, by the rules of core/slots.hpp (check_slot_list, check_copy_pairs). A checked call
// (Executor::checked) reads back the first failure before anything changes; an unchecked call's
// kernels skip every entry that fails.

#include <cstdint>
#include <limits>
#include <string>

#include <Kokkos_Core.hpp>

#include "kvmem/backend/kokkos/device_view.hpp"
#include "kvmem/backend/kokkos/executor.hpp"
#include "kvmem/core/slots.hpp"
#include "kvmem/core/status.hpp"

namespace kvmem::kokkos::detail {

inline constexpr std::int64_t kNoFailure = std::numeric_limits<std::int64_t>::max();

// A slot list or copy pair checked inside a kernel (the rules of core/slots.hpp check_slot_list and
// check_copy_pairs); kernels of unchecked calls skip an entry that fails them.
struct SlotLists {
  DeviceView<const std::int32_t, 1> src, dst;  // dst unused (data nullptr) for a plain list
  std::int64_t B;
  // 0 when entry i passes; else 1 src out of range, 2 dst out of range, 3 dst listed twice, 4 dst is
  // the source of another pair.
  KOKKOS_INLINE_FUNCTION std::int64_t failure(std::int64_t i) const {
    const std::int64_t s = src(i);
    if (s < 0 || s >= B) return 1;
    if (dst.data == nullptr) return 0;
    const std::int64_t d = dst(i), n = src.extent[0];
    if (d < 0 || d >= B) return 2;
    for (std::int64_t e = 0; e < i; ++e)
      if (dst(e) == d) return 3;
    if (d != s)
      for (std::int64_t e = 0; e < n; ++e)
        if (src(e) == d) return 4;
    return 0;
  }
};

// The first failing entry (code * n + i), read back: the one host read of a checked slot operation.
template <class Space>
std::int64_t first_failure(const Executor<Space>& exec, const SlotLists& lists) {
  std::int64_t found = kNoFailure;
  const std::int64_t n = lists.src.extent[0];
  Kokkos::parallel_reduce(
      "kvmem::kokkos::slots::check", range_policy(exec, 0, n),
      KOKKOS_LAMBDA(const std::int64_t i, std::int64_t& first) {
        const std::int64_t c = lists.failure(i);
        if (c != 0 && c * n + i < first) first = c * n + i;
      },
      Kokkos::Min<std::int64_t>(found));
  return found;
}

inline Status slot_list_status(std::int64_t found, std::int64_t n, std::int64_t B, const char* src_name) {
  if (found == kNoFailure) return Status::ok();
  const std::int64_t code = found / n, i = found % n;
  const std::string range = ": expected 0 <= slot < max_slots = " + std::to_string(B) + ", got a slot outside it";
  switch (code) {
    case 1:
      return {StatusCode::kOutOfRange, kvmem::detail::indexed(src_name, i) + range};
    case 2:
      return {StatusCode::kOutOfRange, kvmem::detail::indexed("dst", i) + range};
    case 3:
      return invalid_argument(kvmem::detail::indexed("dst", i), "a slot listed once", "a slot an earlier pair names");
    default:
      return invalid_argument(kvmem::detail::indexed("dst", i), "a slot that is no source of this copy",
                              "the source of another pair");
  }
}

}  // namespace kvmem::kokkos::detail
