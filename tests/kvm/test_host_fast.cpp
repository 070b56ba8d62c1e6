// SPDX-License-Identifier: Apache-2.0
// The host backend's fast path (Executor::exact = false: Eigen tiles for the readout and for the
// update's novelty and routing logits, when built with Eigen) against the fp64 reference and the
// exact path. Logits differ from the exact path's only by fp32 rounding, so routes and kept slots
// agree with both wherever no two candidates tie within rounding; like the other host-vs-reference
// route checks, these seeds have no such near-tie. Outputs agree within DESIGN.md section 5. Shapes
// have more slots and window keys than one Eigen tile (128), so ranges split into several tiles,
// partially visible tiles and ring wraps.
#include <cstdint>
#include <vector>

#include <catch2/catch.hpp>

#include "kvm_host_util.hpp"

namespace {
using namespace kvmem::test;
using kvmem::budget::Fixed;
using kvmem::budget::Power;

// fp32 accumulation over D-term dots and a few hundred weighted values of O(1): rounding stays far
// below DESIGN.md's fp32 rule (1e-5 relative), which the exact host path meets as well.
constexpr double kTolFp32 = 1e-5;

std::vector<rkvm::Config> cases() {
  auto a = small_config(2, 520, 2, 2, 16, 16, Fixed{160, 160});  // 160 slots, window 192
  a.chunk = 96;
  auto b = small_config(1, 430, 6, 2, 16, 12, Power{6.0, 0.5, 96, 1, 300});  // GQA rep 3, Dv != D
  b.chunk = 96;
  auto c = small_config(1, 300, 2, 1, 8, 20, Fixed{8, 8});  // small state, window of 16
  return {a, b, c};
}
}  // namespace

TEST_CASE("kvm host fast path matches the reference; routes and kept slots equal the exact path's",
          "[kvm][host][unit]") {
  std::uint64_t seed = 500;
  for (const auto& c : cases()) {
    INFO("B" << c.B << " T" << c.T << " Hq" << c.Hq << " Hk" << c.Hk << " D" << c.D << " Dv" << c.Dv << " C" << c.chunk
             << " budget " << c.budget.name());
    const auto in = random_inputs(c, seed++);
    const auto ref = rkvm::prefill(c, in);
    const auto exact = host_prefill<float>(c, in, 2, HostPath::kExact);
    const auto fast = host_prefill<float>(c, in, 2, HostPath::kFast);
    KVMEM_CHECK_CLOSE(exact.out, ref.out, kTolFp32);
    KVMEM_CHECK_CLOSE(fast.out, ref.out, kTolFp32);
    CHECK(fast.route_merge == ref.route_merge);
    CHECK(fast.route_append == ref.route_append);
    CHECK(fast.route_merge == exact.route_merge);
    CHECK(fast.route_append == exact.route_append);
    CHECK(fast.slots == exact.slots);
    KVMEM_CHECK_CLOSE(fast.state_k, ref.state_k, kTolFp32);
    KVMEM_CHECK_CLOSE(fast.state_v, ref.state_v, kTolFp32);
    CHECK(fast.state_k == exact.state_k);  // same routes, same scatter: the same sums
    CHECK(fast.state_v == exact.state_v);
    CHECK(host_prefill<float>(c, in, 1, HostPath::kFast).out == fast.out);  // thread count: bitwise
    // bf16 storage: both paths read the same rounded slots and window, so they agree to fp32 rounding.
    const auto exact16 = host_prefill<kvmem::bf16>(c, in, 2, HostPath::kExact);
    const auto fast16 = host_prefill<kvmem::bf16>(c, in, 2, HostPath::kFast);
    KVMEM_CHECK_CLOSE(fast16.out, exact16.out, kTolFp32);
    CHECK(fast16.route_merge == exact16.route_merge);
  }
}

TEST_CASE("kvm host fast path: prefill then decode agrees with one prefill within fp32 rounding", "[kvm][host][unit]") {
  auto c = cases()[0];
  c.T = 300;
  const auto in = random_inputs(c, 77);
  const auto one = host_prefill<float>(c, in, 2, HostPath::kFast);
  for (std::int64_t split : {0, 95, 96, 250}) {
    INFO("split " << split);
    HostResult fin;
    const auto out = host_prefill_then_decode<float>(c, in, split, &fin, HostPath::kFast);
    KVMEM_CHECK_CLOSE(out, one.out, kTolFp32);
    CHECK(fin.state_k == one.state_k);  // every update runs the same function on the same data: bitwise
    const std::size_t first = one.route_merge.size() - fin.route_merge.size();
    for (std::size_t u = 0; u < fin.route_merge.size(); ++u) CHECK(fin.route_merge[u] == one.route_merge[first + u]);
  }
}
