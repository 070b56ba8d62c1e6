// SPDX-License-Identifier: Apache-2.0
// KVM memory the engine owns (DESIGN.md 3): closed-form state and workspace sizes, a state and a
// workspace placed over caller buffers with guard bytes on both sides (nothing written outside), a
// workspace smaller than max_slots rows, and can_run's reasons.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include <catch2/catch.hpp>

#include "kvm_step_support.hpp"

namespace {

using namespace kvmem::test::kvm_mem;
using kvmem::Limits;
using kvmem::Status;
using kvmem::StatusCode;
using kvmem::budget::Fixed;
using kvmem::budget::Power;
namespace kvm = kvmem::kvm;

const kvmem::host::Executor kExact{.threads = 2, .exact = true};

std::size_t up64(std::size_t n) {
  return (n + 63) / 64 * 64;
}

// A caller buffer with `guard` bytes of a pattern before and after a 64-byte aligned region.
struct Guarded {
  static constexpr std::size_t kGuard = 256;
  static constexpr unsigned char kPattern = 0xA5;
  std::vector<unsigned char> raw;
  std::size_t offset = 0, bytes = 0;
  explicit Guarded(std::size_t n) : raw(n + 2 * kGuard + 64, kPattern), bytes(n) {
    const auto at = reinterpret_cast<std::uintptr_t>(raw.data()) + kGuard;
    offset = kGuard + (64 - at % 64) % 64;
  }
  void* data() { return raw.data() + offset; }
  [[nodiscard]] bool guards_intact() const {
    for (std::size_t i = 0; i < offset; ++i)
      if (raw[i] != kPattern) return false;
    for (std::size_t i = offset + bytes; i < raw.size(); ++i)
      if (raw[i] != kPattern) return false;
    return true;
  }
};

}  // namespace

TEST_CASE("kvm state_layout and workspace_bytes follow the closed form", "[kvm][memory][unit]") {
  const Dims d{8, 2, 16, 12};
  for (const kvmem::budget::Any& budget : {kvmem::budget::Any(Fixed{32, 32}), kvmem::budget::Any(Power{2.0, 0.5, 16})})
    for (const std::int64_t B : {1, 3})
      for (const std::int64_t n_ctx : {40, 1000}) {
        const kvm::Problem pr{make_params(16, budget), {B, d.Hq, d.Hk, d.D, d.Dv, n_ctx}};
        const auto cap = std::size_t(kvm::slot_capacity(budget, pr.params.geometry(), n_ctx));
        const std::size_t W = 32, D = 16, Dv = 12, C = 16, R = 4 * C;
        // float sums, bf16 readout copies and window (spec KVM.md 2), each array 64-byte aligned
        const std::size_t item = up64(cap * D * 4) + up64(cap * Dv * 4) + 2 * up64(cap * 4) + up64(cap * D * 2) +
                                 up64(cap * Dv * 2) + up64(W * D * 2) + up64(W * Dv * 2) + up64(W * 4);
        const auto layout = kvm::state_layout<kvmem::bf16, float>(pr);
        INFO("B " << B << " n_ctx " << n_ctx << " cap " << cap);
        CHECK(layout.item_bytes == item);
        CHECK(layout.slot_bytes == 2 * item + 24);
        CHECK(layout.bytes == std::size_t(B) * 2 * item + 3 * up64(std::size_t(B) * 8));
        CHECK(kvm::state_bytes<kvmem::bf16, float>(pr) == layout.bytes);
        const std::size_t work_item = 2 * up64(C * D * 4) + up64(C * Dv * 4) + 2 * up64(C * 4) + up64(C * 8) +
                                      up64(8 * D * 4) + up64(R * D * 4) + up64(R * Dv * 4) +
                                      up64(R * sizeof(kvmem::OnlineSoftmax<float>));
        for (const std::int64_t rows : {1, 2, 5}) {
          const std::size_t ws = up64((2 * D + 2 * 8) * 4) + up64(std::size_t(rows) * 8) +
                                 up64(std::size_t(rows) * 2 * 2 * 8) + std::size_t(rows) * 2 * work_item;
          CHECK(kvm::workspace_bytes<kvmem::bf16, float>(pr, Limits{rows, 0}) == ws);
        }
        kvm::State<kvmem::bf16, float> st;
        REQUIRE(kvm::State<kvmem::bf16, float>::create(pr.params, pr.shape, st).is_ok());
        CHECK(st.state_bytes() == layout.bytes);
        CHECK(st.workspace_bytes() == kvm::workspace_bytes<kvmem::bf16, float>(pr, Limits{B, 0}));
        CHECK(st.allocated_bytes() == kvm::State<kvmem::bf16, float>::bytes_required(pr.params, pr.shape));
      }
}

// fp8 storage: e4m3 readout copies with one fp32 scale per K^ row and per V^ row, the window in bf16
// (kvm/state.hpp); the workspace is the bf16 state's (it holds only fp32 scratch).
TEST_CASE("kvm state_layout of fp8 storage counts the row scales and the bf16 window", "[kvm][memory][unit]") {
  const Dims d{8, 2, 16, 12};
  for (const kvmem::budget::Any& budget : {kvmem::budget::Any(Fixed{32, 32}), kvmem::budget::Any(Power{2.0, 0.5, 16})})
    for (const std::int64_t n_ctx : {40, 1000}) {
      const std::int64_t B = 3;
      const kvm::Problem pr{make_params(16, budget), {B, d.Hq, d.Hk, d.D, d.Dv, n_ctx}};
      const auto cap = std::size_t(kvm::slot_capacity(budget, pr.params.geometry(), n_ctx));
      const std::size_t W = 32, D = 16, Dv = 12;
      const std::size_t item = up64(cap * D * 4) + up64(cap * Dv * 4) + 2 * up64(cap * 4) + up64(cap * D) +
                               up64(cap * Dv) + 2 * up64(cap * 4) + up64(W * D * 2) + up64(W * Dv * 2) + up64(W * 4);
      const auto layout = kvm::state_layout<kvmem::e4m3, float>(pr);
      INFO("n_ctx " << n_ctx << " cap " << cap);
      CHECK(layout.item_bytes == item);
      CHECK(layout.slot_bytes == 2 * item + 24);
      CHECK(layout.bytes == std::size_t(B) * 2 * item + 3 * up64(std::size_t(B) * 8));
      CHECK(kvm::state_bytes<kvmem::e4m3, float>(pr) == layout.bytes);
      CHECK(kvm::workspace_bytes<kvmem::e4m3, float>(pr) == kvm::workspace_bytes<kvmem::bf16, float>(pr));
      kvm::State<kvmem::e4m3, float> st;
      REQUIRE(kvm::State<kvmem::e4m3, float>::create(pr.params, pr.shape, st).is_ok());
      CHECK(st.state_bytes() == layout.bytes);
      // the item's arrays lie inside its block, the scales between the readout copies and the window
      const auto it = st.item(1, 1), next = st.item(2, 0);
      CHECK(reinterpret_cast<std::byte*>(it.khat_scale) >= reinterpret_cast<std::byte*>(it.vhat + cap * Dv));
      CHECK(reinterpret_cast<std::byte*>(it.vhat_scale + cap) <= reinterpret_cast<std::byte*>(it.wk));
      CHECK(reinterpret_cast<std::byte*>(it.wg + W) <= reinterpret_cast<std::byte*>(next.sk));
    }
}

TEST_CASE("kvm state and workspace placed over caller buffers write nothing outside them", "[kvm][memory][unit]") {
  const Dims d;
  const std::int64_t B = 4, C = 8;
  const kvm::Problem pr{make_params(C, Power{2.0, 0.5, 8}), {B, d.Hq, d.Hk, d.D, d.Dv, 200}};
  const Limits limits{2, 0};  // two rows that name a slot per step, of four slots
  Guarded state_mem(kvm::state_bytes(pr)), work_mem(kvm::workspace_bytes(pr, limits));
  kvm::State<float, float> placed, owned;
  REQUIRE(kvm::State<float, float>::place(state_mem.data(), state_mem.bytes, pr, placed).is_ok());
  CHECK(placed.workspace_rows() == 0);
  REQUIRE(placed.attach_workspace(work_mem.data(), work_mem.bytes, limits).is_ok());
  REQUIRE(kvm::State<float, float>::create(pr.params, pr.shape, owned).is_ok());
  CHECK(placed.state_bytes() == state_mem.bytes);
  CHECK(placed.workspace_bytes() == work_mem.bytes);
  const Weights w(d, 5);
  std::mt19937_64 rng(11), twin(11);
  Step a(d, 4, 64), b(d, 4, 64);
  // Ragged steps over rotating slot pairs (prefill chunks and decode tokens), padding rows between.
  for (int it = 0; it < 40; ++it) {
    const auto s0 = std::int32_t(it % B), s1 = std::int32_t((it + 1 + it / 8) % B);
    const std::int64_t n0 = it % 5 == 0 ? 13 : 1, n1 = it % 7 == 0 ? 9 : 1;
    for (auto* st : {&a, &b}) st->clear();
    a.add(d, s0, n0, rng), a.add(d, -1, 2, rng);
    b.add(d, s0, n0, twin), b.add(d, -1, 2, twin);
    if (s1 != s0) a.add(d, s1, n1, rng), b.add(d, s1, n1, twin);
    REQUIRE(a.run(kExact, placed, w.view(), d).is_ok());
    REQUIRE(b.run(kExact, owned, w.view(), d).is_ok());
    REQUIRE(a.out == b.out);
    REQUIRE(a.lse == b.lse);
  }
  for (std::int64_t s = 0; s < B; ++s) {
    CHECK(placed.tokens(s) == owned.tokens(s));
    CHECK(placed.slots(s) == owned.slots(s));
  }
  CHECK(state_mem.guards_intact());
  CHECK(work_mem.guards_intact());

  SECTION("a step with more slot rows than the workspace holds is refused, the state unchanged") {
    const std::vector<unsigned char> before(state_mem.raw);
    a.clear();
    a.add(d, 0, 1, rng), a.add(d, 1, 1, rng), a.add(d, 2, 1, rng);
    const Status s = a.run(kExact, placed, w.view(), d);
    CHECK(s.code() == StatusCode::kOutOfRange);
    CHECK(s.message().find("workspace") != std::string::npos);
    CHECK(state_mem.raw == before);
  }
  SECTION("prefill needs a workspace for every slot") {
    std::vector<float> q(std::size_t(B * d.Hq * d.D), 0.5f), k(std::size_t(B * d.Hk * d.D), 0.5f),
        v(std::size_t(B * d.Hk * d.Dv), 0.5f), g(std::size_t(B * d.Hk), 1.f), out(std::size_t(B * d.Hq * d.Dv));
    const Status s =
        kvm::decode(kExact, placed, w.view(), kvmem::TensorView<const float, 4>(q.data(), {B, d.Hq, 1, d.D}),
                    kvmem::TensorView<const float, 4>(k.data(), {B, d.Hk, 1, d.D}),
                    kvmem::TensorView<const float, 4>(v.data(), {B, d.Hk, 1, d.Dv}),
                    kvmem::TensorView<const float, 3>(g.data(), {B, d.Hk, 1}),
                    kvmem::TensorView<float, 4>(out.data(), {B, 1, d.Hq, d.Dv}));
    CHECK(s.code() == StatusCode::kOutOfRange);
    CHECK(s.message().find("workspace") != std::string::npos);
  }
}

TEST_CASE("kvm placement and workspace arguments are checked", "[kvm][memory][unit]") {
  const Dims d;
  const kvm::Problem pr{make_params(8, Fixed{16, 16}), {2, d.Hq, d.Hk, d.D, d.Dv, 64}};
  Guarded mem(kvm::state_bytes(pr) + 64);
  kvm::State<float, float> st;
  CHECK(kvm::State<float, float>::place(nullptr, mem.bytes, pr, st).message().find("non-null") != std::string::npos);
  CHECK(kvm::State<float, float>::place(static_cast<char*>(mem.data()) + 8, mem.bytes, pr, st)
            .message()
            .find("alignment") != std::string::npos);
  const Status small = kvm::State<float, float>::place(mem.data(), kvm::state_bytes(pr) - 1, pr, st);
  CHECK(small.message().find(std::to_string(kvm::state_bytes(pr))) != std::string::npos);
  CHECK_FALSE(st.valid());
  REQUIRE(kvm::State<float, float>::place(mem.data(), mem.bytes, pr, st).is_ok());
  Guarded ws(kvm::workspace_bytes(pr, {1, 0}));
  CHECK_FALSE(st.attach_workspace(ws.data(), ws.bytes, {2, 0}).is_ok());  // sized for one row, asked for two
  CHECK(st.attach_workspace(ws.data(), ws.bytes, {1, 0}).is_ok());
  CHECK(st.workspace_rows() == 1);
  CHECK(mem.guards_intact());
  CHECK(ws.guards_intact());
}

TEST_CASE("kvm can_run says why not", "[kvm][memory][unit]") {
  const Dims d;
  kvm::Problem pr{make_params(8, Fixed{16, 16}), {2, d.Hq, d.Hk, d.D, d.Dv, 64}};
  CHECK(kvm::can_run(kExact, pr).is_ok());
  pr.params.chunk = 0;
  const Status s = kvm::can_run(kExact, pr);
  CHECK_FALSE(s.is_ok());
  CHECK(s.message().find("chunk") != std::string::npos);
  CHECK(kvm::state_bytes(pr) == 0);
  CHECK(kvm::workspace_bytes(pr) == 0);
  pr = {make_params(8, Fixed{16, 16}), {2, 3, d.Hk, d.D, d.Dv, 64}};  // Hq not a multiple of Hk
  CHECK(kvm::can_run(kExact, pr).message().find("Hq") != std::string::npos);
}
