// SPDX-License-Identifier: Apache-2.0
// fp8 storage of KV Means slots on the CUDA backend (cuda::KvmState<kvmem::e4m3>): e4m3 readout rows with
// one fp32 scale per row, a bf16 window ring, bf16 inputs, fp32 sums (kvm/state.hpp, docs/compose.md).
// The fixed-batch prefill and decode (kvm_prefill, kvm_decode) against the fp64 reference (outputs within
// the documented 2^-4, every route the fp64 decision or a near-tie of it) and against the host backend's
// fp8 state (|S| trajectory exactly, outputs within the host's e4m3 rounding of the same rows), and
// decode == prefill. The slot step of fp8 states is checked in test_kvm_cuda_slots (continuous batching
// and export/import against the host's fp8 state). Skips, saying so, when no CUDA device is visible.
#include "kvmem/backend/cuda/vendor.cuh"

#include <cstdint>
#include <cstdio>
#include <span>
#include <string>
#include <vector>

#include <catch2/catch.hpp>

#include "cuda/cuda_test_support.hpp"
#include "kvm/kvm_host_util.hpp"
#include "kvmem/backend/cuda.hpp"
#include "support/near_ties.hpp"

namespace {
using kvmem::TensorView;
namespace rkvm = kvmem::reference::kvm;
using namespace kvmem::test;
using namespace kvmem::test::cuda;
using Fp8State = kvmem::cuda::KvmState<kvmem::e4m3>;

struct DevWeights {
  Dev<float> w, b, ts, tw;
  explicit DevWeights(const FloatWeights& f) : w(f.w), b(f.b), ts(f.ts), tw(f.tw) {}
  kvmem::cuda::KvmWeights view() const { return {w.ptr, b.ptr, ts.ptr, tw.ptr}; }
};

// q, k, v and gate rounded to bf16 (the inputs an fp8 state takes), so the host's float run and the CUDA
// bf16 run see the same values; the reference runs on them too.
rkvm::Inputs bf16_inputs(rkvm::Inputs in) {
  for (auto* x : {&in.q, &in.k, &in.v, &in.gate})
    for (auto& e : *x) e = double(kvmem::load_as<float>(kvmem::bf16(float(e))));
  return in;
}

// Tokens [t0, t1) through kvm_prefill (one token: the decode path) with bf16 inputs; their rows into out_full.
kvmem::Status feed(Fp8State& st, const rkvm::Config& c, const rkvm::Inputs& in, const DevWeights& w, std::int64_t t0,
                   std::int64_t t1, std::vector<float>& out_full, kvmem::kvm::RouteLog* log) {
  const std::int64_t n = t1 - t0;
  Dev<kvmem::bf16> q(as_storage<kvmem::bf16>(slice_tokens(in.q, c.B * c.Hq, c.T, c.D, t0, t1))),
      k(as_storage<kvmem::bf16>(slice_tokens(in.k, c.B * c.Hk, c.T, c.D, t0, t1))),
      v(as_storage<kvmem::bf16>(slice_tokens(in.v, c.B * c.Hk, c.T, c.Dv, t0, t1))),
      g(as_storage<kvmem::bf16>(slice_tokens(in.gate, c.B * c.Hk, c.T, 1, t0, t1)));
  Dev<float> out(std::vector<float>(std::size_t(c.B * n * c.Hq * c.Dv), -7.0f));  // poisoned
  const kvmem::cuda::Executor exec{};
  using In = const kvmem::bf16;
  KVMEM_RETURN_IF_ERROR(kvmem::cuda::kvm_prefill(
      exec, st, w.view(), TensorView<In, 4>(q.ptr, {c.B, c.Hq, n, c.D}), TensorView<In, 4>(k.ptr, {c.B, c.Hk, n, c.D}),
      TensorView<In, 4>(v.ptr, {c.B, c.Hk, n, c.Dv}), TensorView<In, 3>(g.ptr, {c.B, c.Hk, n}),
      TensorView<float, 4>(out.ptr, {c.B, n, c.Hq, c.Dv}), log));
  KVMEM_RETURN_IF_ERROR(kvmem::cuda::to_status(cudaDeviceSynchronize(), "sync after prefill"));
  const auto o = out.get();
  place_outputs(o, c, t0, n, out_full);
  return kvmem::Status::ok();
}

// Prefill [0, split), then one decode call per later token; split == T is a plain prefill.
HostResult cuda_run(const rkvm::Config& c, const rkvm::Inputs& in, std::int64_t split) {
  Fp8State st;
  const auto created = Fp8State::create(to_params(c), to_shape(c, c.T), st);
  INFO(created.to_string());
  REQUIRE(created.is_ok());
  const DevWeights w(FloatWeights{in});
  HostResult r;
  kvmem::kvm::RouteLog log;
  for (std::int64_t t0 = 0; t0 < c.T;) {
    const std::int64_t t1 = t0 < split ? split : t0 + 1;
    const auto s = feed(st, c, in, w, t0, t1, r.out, &log);
    INFO(s.to_string());
    REQUIRE(s.is_ok());
    t0 = t1;
  }
  extract_device_state(st, c, r);
  extract_routes(log, c, r);
  return r;
}

// The bound of docs/compose.md (fp8 KVM storage): e4m3's relative rounding of one element.
constexpr double kFp8Bound = 0.0625;

void check_against_reference_and_host(rkvm::Config c, std::uint64_t seed, const char* label) {
  const auto in = bf16_inputs(random_inputs(c, seed));
  const auto ref = rkvm::prefill(c, in);
  const auto host = host_prefill<kvmem::e4m3>(c, in);
  const auto gpu = cuda_run(c, in, c.T);
  INFO(label);
  // |S| is data independent (spec 3.1): exact
  CHECK(gpu.slots == ref.slots);
  CHECK(gpu.slots_after_update == host.slots_after_update);
  // routes: the fp64 decision on the run's own state or a near-tie of it (fp32 routing products on the
  // fp8 path: the tensor-core routing takes bf16 storage only)
  const auto acc = near_ties::account_kvm_routes(c, in, gpu, near_ties::kFp32Unit);
  std::printf("kvm cuda fp8 %s: %s\n", label, acc.summary().c_str());
  INFO(acc.summary() << "; first unexplained: " << acc.first_beyond);
  CHECK(acc.merges > 0);
  CHECK(acc.beyond == 0);
  // outputs: within the fp8 bound of the reference, and close to the host's fp8 run (the same e4m3
  // rule on rows that differ by fp32 rounding: an element may round to the neighbouring e4m3 code)
  const double e_ref = relative_frobenius(gpu.out, ref.out), e_host = relative_frobenius(gpu.out, host.out);
  const double e_host_ref = relative_frobenius(host.out, ref.out);
  std::printf("kvm cuda fp8 %s: out vs fp64 %.4g (host fp8 vs fp64 %.4g), vs host fp8 %.3g\n", label, e_ref, e_host_ref,
              e_host);
  INFO("relative Frobenius: vs fp64 " << e_ref << ", vs host fp8 " << e_host);
  CHECK(e_ref <= kFp8Bound);
  CHECK(e_host <= 1e-2);
  // decode == prefill: the fused decode readout and the prefill readout dequantise the same rows
  const auto decoded = cuda_run(c, in, c.T - 2 * c.chunk - 1);
  const double ed = relative_frobenius(decoded.out, gpu.out);
  INFO("decode vs prefill relative Frobenius " << ed);
  CHECK(ed <= 1e-3);
  CHECK(decoded.route_merge == gpu.route_merge);
  CHECK(decoded.slots_after_update == gpu.slots_after_update);
}

TEST_CASE("kvm cuda fp8 storage: prefill and decode against the fp64 reference and the host fp8 state",
          "[kvm][cuda][fp8]") {
  if (no_device()) return;
  SECTION("power budget, GQA 4:2, D = Dv = 64") {
    check_against_reference_and_host(small_config(2, 200, 4, 2, 64, 64, kvmem::budget::Power{3.0, 0.5, 8, 1, 8000}), 41,
                                     "power, D 64");
  }
  SECTION("fixed budget, D = Dv = 128") {
    auto c = small_config(1, 300, 4, 1, 128, 128, kvmem::budget::Fixed{16, 16});
    c.chunk = 16;
    check_against_reference_and_host(c, 42, "fixed, D 128");
  }
  SECTION("saturating budget, Dv != D (96 / 48)") {
    check_against_reference_and_host(small_config(2, 180, 2, 2, 96, 48, kvmem::budget::Saturating{40.0, 1, 8000, 1}),
                                     43, "saturating, D 96 Dv 48");
  }
}

TEST_CASE("kvm cuda fp8 storage at a paper-like shape (C 256, 16 sqrt N, D 128)", "[kvm][cuda][fp8]") {
  if (no_device()) return;
  rkvm::Config c = small_config(1, 1300, 4, 2, 128, 128, kvmem::budget::Power{16.0, 0.5, 256});
  c.chunk = 256;
  check_against_reference_and_host(c, 7, "paper-like shape");
}

TEST_CASE("kvm cuda fp8 state: layout counts the row scales and the bf16 window; records name the storage",
          "[kvm][cuda][fp8]") {
  const rkvm::Config c = small_config(2, 64, 4, 2, 32, 32, kvmem::budget::Power{3.0, 0.5, 8, 1, 8000});
  const kvmem::kvm::Problem pr{to_params(c), to_shape(c, c.T)};
  const auto l8 = Fp8State::state_layout(pr), l16 = kvmem::cuda::KvmState<kvmem::bf16>::state_layout(pr);
  const auto cap = std::size_t(kvmem::kvm::slot_capacity(pr.params.budget, pr.params.geometry(), c.T));
  const std::size_t W = std::size_t(pr.params.window()), D = 32, Dv = 32;
  // fp8 keeps no khat_lo (bf16 tensor-core routing only); readout rows of 1 byte plus two fp32 scales
  CHECK(l8.item_bytes == cap * ((D + Dv + 2) * 4 + D * 4 + (D + Dv) + 8) + W * ((D + Dv) * 2 + 4));
  CHECK(l16.item_bytes == cap * ((D + Dv + 2) * 4 + D * 4 + (D + Dv) * 2 + D * 2) + W * ((D + Dv) * 2 + 4));
  if (no_device()) return;
  // a bf16 record is refused by an fp8 state, naming the field and both types
  auto in = bf16_inputs(random_inputs(c, 5));
  kvmem::cuda::KvmState<kvmem::bf16> b16;
  Fp8State f8;
  REQUIRE(kvmem::cuda::KvmState<kvmem::bf16>::create(pr.params, pr.shape, b16).is_ok());
  REQUIRE(Fp8State::create(pr.params, pr.shape, f8).is_ok());
  const DevWeights w(FloatWeights{in});
  std::vector<float> out;
  REQUIRE(feed(f8, c, in, w, 0, c.T, out, nullptr).is_ok());
  std::vector<std::byte> rec8(kvmem::kvm::export_bytes(f8, 0));
  REQUIRE(kvmem::kvm::export_slot(kvmem::cuda::Executor{}, f8, 0, std::span<std::byte>(rec8)).is_ok());
  const auto refused = kvmem::kvm::import_slot(kvmem::cuda::Executor{}, b16, w.view(), 1, rec8);
  INFO(refused.to_string());
  CHECK(refused.message().find("'storage'") != std::string::npos);
  CHECK(refused.message().find("fp8 e4m3") != std::string::npos);
  CHECK(refused.message().find("bf16") != std::string::npos);
  // the fp8 record imports into another slot of an fp8 state and exports the same bytes
  REQUIRE(kvmem::kvm::import_slot(kvmem::cuda::Executor{}, f8, w.view(), 1, rec8).is_ok());
  std::vector<std::byte> again(kvmem::kvm::export_bytes(f8, 1));
  REQUIRE(kvmem::kvm::export_slot(kvmem::cuda::Executor{}, f8, 1, std::span<std::byte>(again)).is_ok());
  CHECK(again == rec8);
}

}  // namespace
