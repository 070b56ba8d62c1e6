// SPDX-License-Identifier: Apache-2.0
#pragma once
// Caller-owned memory (DESIGN.md 3): what an engine states about its largest step, and the checks a
// placement over caller memory makes before it writes anything. A state or cache keeps persistent
// bytes per sequence slot; a step needs workspace bytes sized by the largest step the engine runs.
// Both come from closed-form layout functions (kvm::state_layout, kvm::workspace_bytes,
// ua::cache_layout, ua::workspace_bytes), the same functions the owning constructors allocate with.

#include <cstddef>
#include <cstdint>
#include <string>

#include "kvmem/core/status.hpp"

namespace kvmem {

// The largest step an engine will run (CUTLASS's "problem size" of the workspace query).
struct Limits {
  std::int64_t max_rows = 0;    // rows of one step (sequences advanced together); 0 = max_slots
  std::int64_t max_tokens = 0;  // tokens of one step; 0 = no bound (the host needs no per-token scratch)
};

// Alignment of every placed state, cache and workspace, and of each array carved from them.
inline constexpr std::size_t kMemoryAlign = 64;

// Ok when `memory` can hold `need` bytes at kMemoryAlign; else a Status naming `what`.
inline Status check_placement(const void* memory, std::size_t bytes, std::size_t need, const char* what) {
  if (memory == nullptr) return invalid_argument(what, "a non-null pointer", "nullptr");
  if (reinterpret_cast<std::uintptr_t>(memory) % kMemoryAlign != 0)
    return invalid_argument(what, std::to_string(kMemoryAlign) + "-byte alignment", "a misaligned pointer");
  if (bytes < need) return invalid_argument(std::string(what) + " bytes", ">= " + std::to_string(need), bytes);
  return Status::ok();
}

// Ok when a call of `rows` rows fits the attached workspace of `held` rows (`attached`: one is
// attached); else the reason, naming `owner` (the type whose create or attach_workspace gives one).
// Checked before anything changes (DESIGN.md 3).
inline Status check_workspace_rows(bool attached, std::int64_t rows, std::int64_t held, const char* owner) {
  if (!attached)
    return invalid_argument(
        "workspace", std::string("a workspace (") + owner + "::create, or attach_workspace after place)", "none");
  if (rows > held)
    return {StatusCode::kOutOfRange,
            "workspace: a call of " + std::to_string(rows) +
                " rows, the attached workspace holds limits.max_rows = " + std::to_string(held)};
  return Status::ok();
}

inline constexpr std::size_t align_up(std::size_t bytes, std::size_t alignment = kMemoryAlign) {
  return (bytes + alignment - 1) / alignment * alignment;
}

}  // namespace kvmem
