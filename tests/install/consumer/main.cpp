// SPDX-License-Identifier: Apache-2.0
// A consumer that only sees the installed package: it composes policies and checks one budget value.
#include <cstdio>

#include <kvmem/kvmem.hpp>

int main() {
  constexpr kvmem::budget::Power sqrt16{16.0, 0.5, 256};
  const auto slots = sqrt16.slots(768, 512, 256);  // spec KVM.md 8: 443
  if (slots != 443) {
    std::printf("kvmem consumer: unexpected slots %lld\n", static_cast<long long>(slots));
    return 1;
  }
  std::printf("kvmem consumer ok (slots %lld)\n", static_cast<long long>(slots));
  return 0;
}
