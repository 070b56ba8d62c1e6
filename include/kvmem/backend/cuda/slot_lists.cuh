// SPDX-License-Identifier: Apache-2.0
#pragma once
// Slot lists of the CUDA slot operations (reset_slots, copy_slots of KV Means and Universal Attention),
// checked where they live: on the device, by the rules of core/slots.hpp (check_slot_list,
// check_copy_pairs), so that an operation never waits for the host and captures in a CUDA graph.
//
// The host checks only what it sees without reading device memory (check_device_slot_list). Then
// slot_list_check_kernel, the operation's first launch, checks every entry and, when the list breaks a
// rule, writes the first failure in the host's order into the state's step status word (the word
// KvmState::step_status and UaCache::step_status read: code, index, value). Every later launch of the
// operation reads that word first and does nothing while it holds a refusal, so a refused list changes
// nothing; and, as for a refused step, the refusal is sticky: the word refuses every later step and
// slot operation until step_status reads it, turns it into the Status the host would have returned
// (slot_list_status) and clears it.

#include "kvmem/backend/cuda/vendor.cuh"

#include <cstdint>
#include <string>

#include "kvmem/backend/cuda/common.cuh"
#include "kvmem/core/slots.hpp"
#include "kvmem/core/status.hpp"
#include "kvmem/core/tensor.hpp"

namespace kvmem::cuda::slot_lists {

// What a slot operation writes into a step status word's code (word[0]). The step codes of both
// mechanisms (kvm_detail::SlotStepError, ua_detail::StepCheck) are below kFirstCode, and 0 means ok.
enum Code : int {
  kFirstCode = 16,
  kSlotsOutOfRange = 16,  // reset_slots: slots[i] outside [0, max_slots)
  kSrcOutOfRange = 17,    // copy_slots: src[i] outside [0, max_slots)
  kDstOutOfRange = 18,    // copy_slots: dst[i] outside [0, max_slots)
  kDstTwice = 19,         // copy_slots: dst[i] names the destination of an earlier pair
  kDstIsSource = 20,      // copy_slots: dst[i] is the source of another pair
  kCopyPoolDry = 21,      // UA copy_slots: the page pool cannot give the copied rows' pages
};

// The per-slot scratch word of the check (one int per slot in the state's memory; the check writes the
// word of every slot its list names before it reads one, so it needs no initialisation): bits 0-29 the
// smallest list index naming the slot (for copy_slots: as a destination), bit 30 set when the slot is a
// source of the copy. A work kernel that must touch a slot once (UA reset_slots, whose list may name a
// slot twice) runs only the entry whose index the word holds.
inline constexpr int kIndexMask = 0x3fffffff;
inline constexpr int kIsSource = 0x40000000;
// The longest list: every index fits the scratch word's index bits and the status word.
inline constexpr std::int64_t kMaxEntries = kIndexMask;

struct Args {
  const std::int32_t* src = nullptr;  // reset_slots: the slots; copy_slots: the sources ([n] each)
  const std::int32_t* dst = nullptr;  // copy_slots: the destinations; nullptr for reset_slots
  std::int64_t n = 0, max_slots = 0;
  int* mark = nullptr;    // [max_slots] scratch (kIndexMask, kIsSource)
  int* status = nullptr;  // the state's step status word: code, index, value
};

inline constexpr int kCheckThreads = 512;

// One block. Refuses the list when the status word already holds a refusal (sticky), else checks the
// rules in the host's order -- every source (reset_slots: every slot) in range; then, by index, every
// destination in range and named by no earlier pair; then every destination that is not its own
// pair's source named by no pair as a source -- and writes the first failure. (A template, so that
// translation units that all include this header link.)
template <class = void>
__global__ void __launch_bounds__(kCheckThreads) slot_list_check_kernel(Args a) {
  __shared__ unsigned long long first;  // (rule << 32) | index of the first failure; ~0: none
  __shared__ int pending;
  const int tid = int(threadIdx.x), threads = int(blockDim.x);
  if (tid == 0) {
    first = ~0ull;
    pending = a.status[0];
  }
  __syncthreads();
  if (pending != 0) return;
  const bool copy = a.dst != nullptr;
  const auto in_range = [&](std::int32_t s) { return s >= 0 && s < a.max_slots; };
  const auto fail = [&](unsigned long long rule, std::int64_t i) {
    atomicMin(&first, (rule << 32) | static_cast<unsigned long long>(i));
  };
  // rule 0, ranges; and the scratch word of every listed slot (a source's too) starts empty
  for (std::int64_t i = tid; i < a.n; i += threads) {
    const std::int32_t s = a.src[i];
    if (in_range(s))
      a.mark[s] = kIndexMask;
    else
      fail(0, i);
    if (!copy) continue;
    const std::int32_t d = a.dst[i];
    if (in_range(d))
      a.mark[d] = kIndexMask;
    else
      fail(1, i);
  }
  __syncthreads();
  const std::int32_t* named = copy ? a.dst : a.src;
  for (std::int64_t i = tid; i < a.n; i += threads)
    if (in_range(named[i])) atomicMin(a.mark + named[i], int(i));
  __syncthreads();
  if (copy) {
    for (std::int64_t i = tid; i < a.n; i += threads)
      if (in_range(a.src[i])) atomicOr(a.mark + a.src[i], kIsSource);
    __syncthreads();
    const volatile int* mark = a.mark;
    for (std::int64_t i = tid; i < a.n; i += threads) {
      const std::int32_t d = a.dst[i];
      if (!in_range(d)) continue;
      const int m = mark[d];
      if ((m & kIndexMask) != int(i))
        fail(1, i);  // an earlier pair names d
      else if ((m & kIsSource) != 0 && d != a.src[i])
        fail(2, i);
    }
    __syncthreads();
  }
  if (tid != 0 || first == ~0ull) return;
  const int rule = int(first >> 32);
  const std::int64_t i = std::int64_t(first & 0xffffffffull);
  int code = kDstIsSource, value = 0;
  if (rule == 0) {
    code = copy ? kSrcOutOfRange : kSlotsOutOfRange;
    value = a.src[i];
  } else {
    value = a.dst[i];
    if (rule == 1) code = in_range(value) ? kDstTwice : kDstOutOfRange;
  }
  a.status[1] = int(i);
  a.status[2] = value;
  a.status[0] = code;
}

// Enqueues the check of a slot list on `stream` (the operation's first launch) over the state's scratch
// words `mark` ([max_slots]) and its step status word; returns the Args the operation's work kernels read.
// `dst` is nullptr for reset_slots.
inline Status launch_check(cudaStream_t stream, const std::int32_t* src, const std::int32_t* dst, std::int64_t n,
                           std::int64_t max_slots, int* mark, int* status, Args& out) {
  out = Args{src, dst, n, max_slots, mark, status};
  slot_list_check_kernel<><<<1, kCheckThreads, 0, stream>>>(out);
  return to_status(cudaGetLastError(), "slot_list_check_kernel");
}

// Whether the operation's work must do nothing: its list was refused, or a refusal is still unread.
__device__ inline bool refused(const int* status) {
  return *static_cast<const volatile int*>(status) != 0;
}

// What the host checks of a device slot list before anything is enqueued: unit stride, a device pointer
// when it is not empty, and a length the device check can index.
inline Status check_device_slot_list(TensorView<const std::int32_t, 1> list, const char* name) {
  const std::int64_t n = list.extent(0);
  if (n > 1 && list.stride(0) != 1) return invalid_argument(std::string(name) + " stride", 1, list.stride(0));
  if (n > 0 && list.data() == nullptr) return invalid_argument(name, "a non-null device pointer", "nullptr");
  if (n > kMaxEntries) return invalid_argument(std::string(name) + " count", "<= " + std::to_string(kMaxEntries), n);
  return Status::ok();
}

// The Status the host's check_slot_list / check_copy_pairs returns for the failure a status word holds
// (code >= kFirstCode, except kCopyPoolDry, whose message is the mechanism's).
inline Status slot_list_status(int code, int index, int value, std::int64_t max_slots) {
  const auto range = [&](const char* name) {
    return Status{StatusCode::kOutOfRange, kvmem::detail::indexed(name, index) + ": expected 0 <= slot < max_slots = " +
                                               std::to_string(max_slots) + ", got " + std::to_string(value)};
  };
  switch (code) {
    case kSlotsOutOfRange:
      return range("slots");
    case kSrcOutOfRange:
      return range("src");
    case kDstOutOfRange:
      return range("dst");
    case kDstTwice:
      return invalid_argument(kvmem::detail::indexed("dst", index), "a slot listed once", value);
    default:
      return invalid_argument(kvmem::detail::indexed("dst", index), "a slot that is no source of this copy", value);
  }
}

}  // namespace kvmem::cuda::slot_lists
