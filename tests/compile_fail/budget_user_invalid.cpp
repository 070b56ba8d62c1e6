// SPDX-License-Identifier: Apache-2.0
// EXPECT: kvmem budget: invalid parameters
// A user budget policy with invalid_reason() != nullptr fails kvm::Attention's compile-time check.
#include <cstdint>

#include "kvmem/kvm/attention.hpp"
struct LogBudget {
  double factor = 4.0;
  std::int64_t slots(std::int64_t tokens, std::int64_t avail, std::int64_t current) const {
    const auto raw = static_cast<std::int64_t>(factor * double(tokens > 1 ? 63 - __builtin_clzll(tokens) : 0));
    const std::int64_t t = raw < avail ? raw : avail;
    return t > current ? t : current;
  }
  std::int64_t max_slots(std::int64_t n) const { return slots(n, n, 0); }
  constexpr const char* invalid_reason() const { return factor > 0.0 ? nullptr : "factor must be > 0"; }
  kvmem::Status validate() const { return kvmem::Status::ok(); }
};
#ifdef KVMEM_CONTROL
using Kvm = kvmem::kvm::Attention<LogBudget{4.0}>;
#else
using Kvm = kvmem::kvm::Attention<LogBudget{-1.0}>;
#endif
int main() {
  return Kvm::kBudget.factor > 0.0 ? 0 : 1;
}
