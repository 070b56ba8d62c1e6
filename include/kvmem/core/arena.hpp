// SPDX-License-Identifier: Apache-2.0
#pragma once
// Offsets of several arrays carved from one allocation (a state or cache is allocated once, then
// split): take(bytes) returns the next offset and advances by bytes rounded up to the alignment.

#include <cstddef>

namespace kvmem {

class ArenaLayout {
 public:
  explicit constexpr ArenaLayout(std::size_t alignment) : alignment_(alignment) {}
  constexpr std::size_t take(std::size_t bytes) {
    const std::size_t at = total_;
    total_ += (bytes + alignment_ - 1) / alignment_ * alignment_;
    return at;
  }
  // Bytes to allocate for everything taken so far.
  [[nodiscard]] constexpr std::size_t total() const { return total_; }

 private:
  std::size_t alignment_;
  std::size_t total_ = 0;
};

}  // namespace kvmem
