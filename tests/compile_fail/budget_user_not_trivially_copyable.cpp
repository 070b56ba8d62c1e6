// SPDX-License-Identifier: Apache-2.0
// EXPECT: a user budget policy must be trivially copyable
// budget::Any copies a user policy's bytes into kernels and slot records, so a policy that owns memory
// (here a std::string) is refused where it is stored.
#include <cstdint>
#include <string>

#include "kvmem/policy/budget.hpp"
struct NamedFixed {
#ifdef KVMEM_CONTROL
  const char* label = "fixed";
#else
  std::string label = "fixed";
#endif
  std::int64_t count = 64;
  std::int64_t slots(std::int64_t, std::int64_t avail, std::int64_t current) const {
    const std::int64_t t = count < avail ? count : avail;
    return t > current ? t : current;
  }
  std::int64_t max_slots(std::int64_t n) const {
    return count < n ? count : n;
  }
  const char* invalid_reason() const {
    return nullptr;
  }
  kvmem::Status validate() const {
    return kvmem::Status::ok();
  }
};
int main() {
  const kvmem::budget::Any any(NamedFixed{});
  return any.is_user() ? 0 : 1;
}
