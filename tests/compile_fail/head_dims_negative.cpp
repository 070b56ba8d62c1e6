// SPDX-License-Identifier: Apache-2.0
// EXPECT: kvmem::HeadDims: a head dim is > 0
// The head dims a composed variant passes to a backend's kernel choice (core/support.hpp) are positive or
// kAnyDim; any other value stops the build where the tag is formed.
#include "kvmem/core/support.hpp"
#ifdef KVMEM_CONTROL
using Dims = kvmem::HeadDims<128, 64>;
#else
using Dims = kvmem::HeadDims<128, -1>;
#endif
static_assert(Dims::kKey == 128);
static_assert(Dims::key_may_be(128) && !Dims::key_may_be(64));
static_assert(kvmem::HeadDims<>::key_may_be(64) && kvmem::HeadDims<>::value_within(1, 256));
int main() {
  return 0;
}
