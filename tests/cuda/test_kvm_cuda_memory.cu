// SPDX-License-Identifier: Apache-2.0
// Caller-owned memory of the CUDA KV Means state (DESIGN.md 3): a state placed over caller device
// memory (place + attach_workspace) writes nothing outside the bytes it was given (guard bytes before
// and after both buffers keep their pattern), and runs exactly like an owning state (create) driven
// the same way: outputs, lse and exported slot records equal bit for bit, for kvm::step schedules with
// slot operations and for the fixed-batch prefill/decode with readouts beside the update chain. No
// step allocates (the device's free memory is unchanged across 1,000 steps), and create/place do not
// wait for the device (they return while a kernel on another stream is still running). Skips, saying
// so, when no CUDA device is visible.
#include "kvmem/backend/cuda/vendor.cuh"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <numeric>
#include <random>
#include <span>
#include <string>
#include <vector>

#include <catch2/catch.hpp>

#include "cuda/cuda_test_support.hpp"
#include "kvmem/backend/cuda.hpp"

// A kernel outside the anonymous namespace below: nvcc's host stub of a kernel there collides with
// the anonymous namespaces Catch's TEST_CASE opens.
namespace kvmem_memory_test {
// Spins until *flag is set from the host, or about `cycles` clock cycles have passed; *released says
// which (1: the flag, 0: the timeout).
__global__ void spin_kernel(const volatile int* flag, int* released, long long cycles) {
  const long long t0 = clock64();
  while (*flag == 0) {
    if (clock64() - t0 > cycles) {
      *released = 0;
      return;
    }
  }
  *released = 1;
}
}  // namespace kvmem_memory_test

namespace {

using kvmem::bf16;
using kvmem::Rows;
using kvmem::Status;
using kvmem::StatusCode;
using kvmem::TensorView;
using kvmem::cuda::KvmState;
namespace kvm = kvmem::kvm;
using namespace kvmem::test::cuda;
using I32View = TensorView<const std::int32_t, 1>;

constexpr unsigned char kGuard = 0xA5;
constexpr std::size_t kGuardBytes = 4096;  // a multiple of KvmState::kAlign: the placed block stays aligned

struct Dims {
  std::int64_t Hq = 4, Hk = 2, D = 32, Dv = 32;
};

kvm::Params make_params(std::int64_t chunk, kvmem::budget::Any budget) {
  kvm::Params p;
  p.chunk = chunk;
  p.window_chunks = 2;
  p.sink = 1;
  p.rope_dims = 8;
  p.budget = budget;
  return p;
}

struct Weights {
  Dev<float> w, b, ts, tw;
  Weights(const Dims& d, std::mt19937_64& rng)
      : w(normal(std::size_t(d.D), rng, 1.f, 0.2f)),
        b(normal(std::size_t(d.D), rng, 0.f, 0.2f)),
        ts(normal(std::size_t(d.Hq), rng, 1.f, 0.2f)),
        tw(normal(std::size_t(d.Hq), rng, 1.f, 0.2f)) {}
  kvmem::cuda::KvmWeights device() const { return {w.ptr, b.ptr, ts.ptr, tw.ptr}; }
};

// A device buffer of `bytes` with kGuardBytes of kGuard before and after; the middle starts filled
// with kGuard too (placement must not depend on its contents).
struct Guarded {
  Dev<unsigned char> all;
  std::size_t bytes;
  explicit Guarded(std::size_t n) : all(n + 2 * kGuardBytes), bytes(n) {
    KVMEM_CUDA_REQUIRE(cudaMemset(all.ptr, kGuard, all.n));
    // place() initialises the state on the state's own stream, which does not wait for this fill on the
    // default stream: placed memory must not be in use by pending work (the caller's side of place's contract)
    KVMEM_CUDA_REQUIRE(cudaDeviceSynchronize());
  }
  void* memory() const { return all.ptr + kGuardBytes; }
  // Guard bytes that lost their pattern.
  std::size_t damaged() const {
    const std::vector<unsigned char> h = all.get();
    std::size_t bad = 0;
    for (std::size_t i = 0; i < kGuardBytes; ++i) bad += (h[i] != kGuard) + (h[kGuardBytes + bytes + i] != kGuard);
    return bad;
  }
};

// Packed inputs of one step in device memory (storage type S), outputs for two states.
template <class S>
struct StepData {
  std::int64_t T = 0, R = 0;
  Dev<std::int32_t> slot, start;
  Dev<S> q, k, v, g;
  StepData(const Dims& d, const std::vector<std::int32_t>& slots, const std::vector<std::int32_t>& starts,
           std::mt19937_64& rng)
      : T(starts.back()),
        R(std::int64_t(slots.size())),
        slot(slots),
        start(starts),
        q(as_storage<S>(normal(std::size_t(T * d.Hq * d.D), rng))),
        k(as_storage<S>(normal(std::size_t(T * d.Hk * d.D), rng))),
        v(as_storage<S>(normal(std::size_t(T * d.Hk * d.Dv), rng))),
        g(as_storage<S>(gates(std::size_t(T * d.Hk), rng))) {}
  Status run(KvmState<S>& st, const Weights& w, const Dims& d, float* out, float* lse,
             cudaStream_t stream = nullptr) const {
    const Rows rows{I32View(slot.ptr, {R}), I32View(start.ptr, {R + 1})};
    return kvm::step(kvmem::cuda::Executor{stream}, st, w.device(), rows, TensorView<const S, 3>(q.ptr, {T, d.Hq, d.D}),
                     TensorView<const S, 3>(k.ptr, {T, d.Hk, d.D}), TensorView<const S, 3>(v.ptr, {T, d.Hk, d.Dv}),
                     TensorView<const S, 2>(g.ptr, {T, d.Hk}), TensorView<float, 3>(out, {T, d.Hq, d.Dv}),
                     TensorView<float, 2>(lse, {T, d.Hq}));
  }
};

template <class S>
std::vector<std::byte> export_of(const KvmState<S>& st, std::int32_t slot) {
  std::vector<std::byte> bytes(kvm::export_bytes(st, slot));
  const Status s = kvm::export_slot(kvmem::cuda::Executor{}, st, slot, std::span<std::byte>(bytes));
  INFO(s.to_string());
  REQUIRE(s.is_ok());
  return bytes;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// A placed state (guarded state and workspace buffers, the workspace for max_rows rows) and an owning
// one run the same random schedule of kvm::step calls (ragged rows, padding rows, prefill chunks and
// decode tokens) with resets and forks between them.
template <class S>
void placed_equals_owning(kvmem::budget::Any budget, std::uint64_t seed) {
  const Dims d;
  const std::int64_t B = 4, max_rows = 3, n_ctx = 400, C = 16;
  const kvm::Params p = make_params(C, budget);
  const kvmem::kvm::Problem problem{p, {B, d.Hq, d.Hk, d.D, d.Dv, n_ctx}};
  const kvmem::Limits limits{.max_rows = max_rows};
  REQUIRE(KvmState<S>::can_run(problem).is_ok());
  const std::size_t sb = KvmState<S>::state_bytes(problem), wb = KvmState<S>::workspace_bytes(problem, limits);
  REQUIRE(sb > 0);
  REQUIRE(wb > 0);
  REQUIRE(wb < KvmState<S>::workspace_bytes(problem));  // fewer rows, less scratch
  Guarded state_mem(sb), ws_mem(wb);

  KvmState<S> placed, owning;
  {
    // refused placements change nothing and leave `placed` empty
    auto* base = static_cast<unsigned char*>(state_mem.memory());
    CHECK(KvmState<S>::place(base + 64, sb, problem, placed).code() == StatusCode::kInvalidArgument);
    CHECK(KvmState<S>::place(state_mem.memory(), sb - 1, problem, placed).code() == StatusCode::kInvalidArgument);
    CHECK(KvmState<S>::place(nullptr, sb, problem, placed).code() == StatusCode::kInvalidArgument);
    CHECK_FALSE(placed.valid());
  }
  const Status ps = KvmState<S>::place(state_mem.memory(), sb, problem, placed);
  INFO(ps.to_string());
  REQUIRE(ps.is_ok());
  REQUIRE(KvmState<S>::create(problem.params, problem.shape, owning).is_ok());
  CHECK(placed.state_bytes() == sb);
  CHECK(placed.workspace_bytes() == 0);
  CHECK(owning.allocated_bytes() == sb + KvmState<S>::workspace_bytes(problem));

  std::mt19937_64 rng(seed);
  const Weights w(d, rng);
  Dev<float> out_a(std::size_t(d.Hq * d.Dv)), lse_a(std::size_t(d.Hq));
  {
    // a placed state without a workspace refuses a step; one with too small a workspace cannot get it
    const StepData<S> one(d, {0}, {0, 1}, rng);
    CHECK(one.run(placed, w, d, out_a.ptr, lse_a.ptr).code() == StatusCode::kInvalidArgument);
    CHECK(placed.attach_workspace(ws_mem.memory(), wb - 1, limits).code() == StatusCode::kInvalidArgument);
  }
  REQUIRE(placed.attach_workspace(ws_mem.memory(), wb, limits).is_ok());
  CHECK(placed.workspace_rows() == max_rows);
  CHECK(placed.workspace_bytes() == wb);

  const auto uni = [&](std::int64_t a, std::int64_t b) {
    return std::uniform_int_distribution<std::int64_t>(a, b)(rng);
  };
  std::vector<std::int64_t> n(std::size_t(B), 0);  // tokens per slot (host bookkeeping of the schedule)
  int steps = 0, resets = 0, forks = 0, refused = 0;
  for (int it = 0; it < 120; ++it) {
    // slot operations, the same on both states
    if (uni(0, 9) == 0) {
      const std::int32_t s = std::int32_t(uni(0, B - 1));
      const Dev<std::int32_t> list(std::vector<std::int32_t>{s});  // slot lists live in device memory
      REQUIRE(kvm::reset_slots(kvmem::cuda::Executor{}, placed, I32View(list.ptr, {1})).is_ok());
      REQUIRE(kvm::reset_slots(kvmem::cuda::Executor{}, owning, I32View(list.ptr, {1})).is_ok());
      n[std::size_t(s)] = 0;
      ++resets;
    }
    if (uni(0, 11) == 0) {
      const std::int32_t a = std::int32_t(uni(0, B - 1)), b = std::int32_t((a + 1 + uni(0, B - 2)) % B);
      const Dev<std::int32_t> src(std::vector<std::int32_t>{a}), dst(std::vector<std::int32_t>{b});
      REQUIRE(kvm::copy_slots(kvmem::cuda::Executor{}, placed, I32View(src.ptr, {1}), I32View(dst.ptr, {1})).is_ok());
      REQUIRE(kvm::copy_slots(kvmem::cuda::Executor{}, owning, I32View(src.ptr, {1}), I32View(dst.ptr, {1})).is_ok());
      n[std::size_t(b)] = n[std::size_t(a)];
      ++forks;
    }
    // rows: distinct slots, a padding row now and then, decode tokens mostly and prefill chunks
    std::vector<std::int32_t> order(static_cast<std::size_t>(B));
    std::iota(order.begin(), order.end(), 0);
    std::shuffle(order.begin(), order.end(), rng);
    const std::int64_t R = uni(1, max_rows);
    std::vector<std::int32_t> slots, starts{0};
    for (std::int64_t r = 0; r < R; ++r) {
      const std::int32_t s = uni(0, 7) == 0 ? -1 : order[std::size_t(r)];
      std::int64_t len = uni(0, 3) == 0 ? uni(2, 40) : 1;
      if (s >= 0) {
        if (n[std::size_t(s)] + len > n_ctx) len = 0;
        n[std::size_t(s)] += len;
      }
      slots.push_back(s);
      starts.push_back(starts.back() + std::int32_t(len));
    }
    const StepData<S> data(d, slots, starts, rng);
    const std::size_t rows_out = std::size_t(std::max<std::int64_t>(1, data.T));
    Dev<float> oa(std::vector<float>(rows_out * d.Hq * d.Dv, -7.f)),
        ob(std::vector<float>(rows_out * d.Hq * d.Dv, -7.f)), la(std::vector<float>(rows_out * d.Hq, -7.f)),
        lb(std::vector<float>(rows_out * d.Hq, -7.f));
    const Status sa = data.run(placed, w, d, oa.ptr, la.ptr), sb2 = data.run(owning, w, d, ob.ptr, lb.ptr);
    INFO(sa.to_string() << " / " << sb2.to_string());
    REQUIRE(sa.is_ok());
    REQUIRE(sb2.is_ok());
    const Status status_a = placed.step_status(kvmem::cuda::Executor{}),
                 status_b = owning.step_status(kvmem::cuda::Executor{});
    INFO("step status " << status_a.to_string() << " / " << status_b.to_string());
    REQUIRE(status_a.is_ok());
    REQUIRE(status_b.is_ok());
    INFO("step " << it);
    CHECK(same_bits(oa.get(), ob.get()));
    CHECK(same_bits(la.get(), lb.get()));
    ++steps;
    if (it % 40 == 39) {
      // a step of more rows than the placed workspace holds is refused before anything is enqueued
      const StepData<S> wide(d, {0, 1, 2, 3}, {0, 1, 2, 3, 4}, rng);
      Dev<float> ow(std::size_t(4 * d.Hq * d.Dv)), lw(std::size_t(4 * d.Hq));
      CHECK(wide.run(placed, w, d, ow.ptr, lw.ptr).code() == StatusCode::kOutOfRange);
      ++refused;
    }
  }
  for (std::int32_t s = 0; s < B; ++s) {
    INFO("slot " << s);
    CHECK(export_of(placed, s) == export_of(owning, s));
  }
  KVMEM_CUDA_REQUIRE(cudaDeviceSynchronize());
  CHECK(state_mem.damaged() == 0);
  CHECK(ws_mem.damaged() == 0);
  // moved: the new owner runs, the source refuses
  KvmState<S> moved = std::move(placed);
  CHECK_FALSE(placed.valid());
  CHECK(moved.valid());
  CHECK(moved.workspace_rows() == max_rows);
  WARN("placed == owning: " << steps << " steps, " << resets << " resets, " << forks << " forks, " << refused
                            << " wide steps refused");
}

const kvmem::budget::Any kFixed = kvmem::budget::Fixed{48, 48};
const kvmem::budget::Any kSqrt = kvmem::budget::Power{8.0, 0.5, 16, 1, 100000};

TEST_CASE("cuda kvm memory: a placed state writes only its bytes and equals an owning state (fp32)", "[memory][gpu]") {
  if (no_device()) return;
  placed_equals_owning<float>(kFixed, 11);
  placed_equals_owning<float>(kSqrt, 12);
}

TEST_CASE("cuda kvm memory: a placed state writes only its bytes and equals an owning state (bf16)", "[memory][gpu]") {
  if (no_device()) return;
  placed_equals_owning<bf16>(kFixed, 21);
  placed_equals_owning<bf16>(kSqrt, 22);
}

TEST_CASE("cuda kvm memory: state and workspace sizes are closed form", "[memory][gpu]") {
  // no device needed: pure arithmetic
  for (const kvmem::budget::Any& budget : {kFixed, kSqrt}) {
    for (const Dims& d : {Dims{4, 2, 32, 32}, Dims{8, 1, 64, 64}, Dims{4, 4, 128, 128}}) {
      for (const std::int64_t n_ctx : {256, 4096}) {
        const kvmem::kvm::Problem problem{make_params(16, budget), {3, d.Hq, d.Hk, d.D, d.Dv, n_ctx}};
        const auto check = [&](auto tag) {
          using S = decltype(tag);
          const kvmem::cuda::KvmStateLayout l = KvmState<S>::state_layout(problem);
          INFO("Hq " << d.Hq << " Hk " << d.Hk << " D " << d.D << " n_ctx " << n_ctx);
          CHECK(l.alignment == KvmState<S>::kAlign);
          CHECK(l.bytes % l.alignment == 0);
          CHECK(l.bytes == KvmState<S>::state_bytes(problem));
          // the arrays hold the slots' and the fixed bytes, plus at most one alignment pad each
          const std::size_t content = 3 * l.slot_bytes + l.fixed_bytes;
          CHECK(l.bytes >= content);
          CHECK(l.bytes < content + 32 * l.alignment);
          CHECK(l.slot_bytes > std::size_t(d.Hk) * l.item_bytes);
          // the workspace grows with the rows of a step, and max_rows 0 means max_slots
          const std::size_t w1 = KvmState<S>::workspace_bytes(problem, {.max_rows = 1}),
                            w2 = KvmState<S>::workspace_bytes(problem, {.max_rows = 2}),
                            w3 = KvmState<S>::workspace_bytes(problem, {.max_rows = 3});
          CHECK(w1 < w2);
          CHECK(w2 < w3);
          CHECK(w3 == KvmState<S>::workspace_bytes(problem));
          CHECK(KvmState<S>::workspace_bytes(problem, {.max_rows = -1}) == 0);
          CHECK(KvmState<S>::bytes_required(problem.params, problem.shape) == l.bytes + w3);
        };
        check(float{});
        check(bf16{});
      }
    }
  }
  kvmem::kvm::Problem bad{make_params(16, kFixed), {3, 4, 2, 32, 32, 256}};
  bad.params.chunk = 0;
  CHECK(KvmState<float>::state_bytes(bad) == 0);
  CHECK(KvmState<float>::workspace_bytes(bad) == 0);
  CHECK_FALSE(KvmState<float>::can_run(bad).is_ok());
  const kvmem::kvm::Problem wide{make_params(16, kFixed), {1, 4, 2, 32, 512, 256}};  // Dv over kvm::step's registers
  CHECK(kvm::validate(wide.params, wide.shape).is_ok());
  CHECK(KvmState<float>::can_run(wide).code() == StatusCode::kUnsupported);
}

TEST_CASE("cuda kvm memory: the device's free memory is unchanged across 1,000 steps", "[memory][gpu]") {
  if (no_device()) return;
  using S = bf16;
  const Dims d;
  const std::int64_t B = 4, n_ctx = 8192;
  const kvmem::kvm::Problem problem{make_params(16, kSqrt), {B, d.Hq, d.Hk, d.D, d.Dv, n_ctx}};
  const kvmem::Limits limits{.max_rows = B};
  Dev<unsigned char> state_mem(KvmState<S>::state_bytes(problem)),
      ws_mem(KvmState<S>::workspace_bytes(problem, limits));
  KvmState<S> st;
  REQUIRE(KvmState<S>::place(state_mem.ptr, state_mem.n, problem, st).is_ok());
  REQUIRE(st.attach_workspace(ws_mem.ptr, ws_mem.n, limits).is_ok());
  std::mt19937_64 rng(5);
  const Weights w(d, rng);
  // a decode step of four rows, one of them padding, and a step with a prefill chunk
  const StepData<S> decode(d, {0, 1, -1, 3}, {0, 1, 2, 2, 3}, rng);
  const StepData<S> prefill(d, {2, 0}, {0, 24, 25}, rng);
  Dev<float> out(std::size_t(25 * d.Hq * d.Dv)), lse(std::size_t(25 * d.Hq));
  const Dev<std::int32_t> reset_slot(std::vector<std::int32_t>{2}), from(std::vector<std::int32_t>{0}),
      to(std::vector<std::int32_t>{2});  // slot lists in device memory, made once
  const auto round = [&](int i) {
    if (i % 100 == 99) {
      REQUIRE(kvm::reset_slots(kvmem::cuda::Executor{}, st, I32View(reset_slot.ptr, {1})).is_ok());
      REQUIRE(kvm::copy_slots(kvmem::cuda::Executor{}, st, I32View(from.ptr, {1}), I32View(to.ptr, {1})).is_ok());
    }
    const StepData<S>& s = i % 50 == 0 ? prefill : decode;
    REQUIRE(s.run(st, w, d, out.ptr, lse.ptr).is_ok());
  };
  for (int i = 0; i < 100; ++i) round(i);  // every kernel loaded (lazy module loading) before measuring
  KVMEM_CUDA_REQUIRE(cudaDeviceSynchronize());
  std::size_t free0 = 0, free1 = 0, total = 0;
  KVMEM_CUDA_REQUIRE(cudaMemGetInfo(&free0, &total));
  for (int i = 0; i < 1000; ++i) round(i);
  KVMEM_CUDA_REQUIRE(cudaDeviceSynchronize());
  KVMEM_CUDA_REQUIRE(cudaMemGetInfo(&free1, &total));
  REQUIRE(st.step_status(kvmem::cuda::Executor{}).is_ok());
  std::int64_t n = 0, cov = 0, used = 0;
  REQUIRE(st.slot_counters(kvmem::cuda::Executor{}, 1, n, cov, used).is_ok());
  CHECK(n == 1100 - 22);  // slot 1: one token a decode step (22 of the 1,100 steps were prefill steps)
  CHECK(free1 == free0);
}

TEST_CASE("cuda kvm memory: create and place return while another stream's kernel still runs", "[memory][gpu]") {
  if (no_device()) return;
  using S = bf16;
  const Dims d;
  const kvmem::kvm::Problem problem{make_params(16, kSqrt), {4, d.Hq, d.Hk, d.D, d.Dv, 1024}};
  Dev<unsigned char> state_mem(KvmState<S>::state_bytes(problem)), ws_mem(KvmState<S>::workspace_bytes(problem));
  int* flag = nullptr;
  KVMEM_CUDA_REQUIRE(cudaHostAlloc(&flag, sizeof(int), cudaHostAllocMapped));
  *flag = 0;
  int* flag_dev = nullptr;
  KVMEM_CUDA_REQUIRE(cudaHostGetDevicePointer(reinterpret_cast<void**>(&flag_dev), flag, 0));
  Dev<int> released(std::vector<int>{-1});
  // a blocking stream: any work create or place put on the legacy default stream would wait for it
  cudaStream_t busy = nullptr;
  KVMEM_CUDA_REQUIRE(cudaStreamCreate(&busy));
  kvmem_memory_test::spin_kernel<<<1, 1, 0, busy>>>(flag_dev, released.ptr, 20'000'000'000LL);  // about 10 s at 2 GHz
  KVMEM_CUDA_REQUIRE(cudaGetLastError());
  KvmState<S> placed, owning;
  const Status ps = KvmState<S>::place(state_mem.ptr, state_mem.n, problem, placed);
  const Status ws = placed.attach_workspace(ws_mem.ptr, ws_mem.n);
  const cudaError_t after_place = cudaStreamQuery(busy);
  const Status cs = KvmState<S>::create(problem.params, problem.shape, owning);
  const cudaError_t after_create = cudaStreamQuery(busy);
  reinterpret_cast<volatile int*>(flag)[0] = 1;
  KVMEM_CUDA_REQUIRE(cudaStreamSynchronize(busy));
  INFO(ps.to_string() << " / " << ws.to_string() << " / " << cs.to_string());
  CHECK(ps.is_ok());
  CHECK(ws.is_ok());
  CHECK(cs.is_ok());
  CHECK(after_place == cudaErrorNotReady);   // place returned with the kernel still running
  CHECK(after_create == cudaErrorNotReady);  // so did create
  CHECK(released.get()[0] == 1);             // and the kernel ended by the flag, not by its timeout
  // both states start initialised: every slot empty, no step refused
  for (KvmState<S>* st : {&placed, &owning}) {
    std::int64_t n = -1, cov = -1, used = -1;
    REQUIRE(st->slot_counters(kvmem::cuda::Executor{}, 3, n, cov, used).is_ok());
    CHECK(n == 0);
    CHECK(st->step_status(kvmem::cuda::Executor{}).is_ok());
  }
  KVMEM_CUDA_REQUIRE(cudaStreamDestroy(busy));
  KVMEM_CUDA_REQUIRE(cudaFreeHost(flag));
}

// Inputs of a fixed-batch call of n tokens per sequence in device memory: q [B,Hq,n,D], k [B,Hk,n,D],
// v [B,Hk,n,Dv], gate [B,Hk,n].
template <class S>
struct BatchInputs {
  Dev<S> q, k, v, g;
  BatchInputs(std::int64_t B, const Dims& d, std::int64_t n, std::mt19937_64& rng)
      : q(as_storage<S>(normal(std::size_t(B * d.Hq * n * d.D), rng))),
        k(as_storage<S>(normal(std::size_t(B * d.Hk * n * d.D), rng))),
        v(as_storage<S>(normal(std::size_t(B * d.Hk * n * d.Dv), rng))),
        g(as_storage<S>(gates(std::size_t(B * d.Hk * n), rng))) {}
};

// The fixed-batch calls on a placed state (bf16, head dim 64: tensor-core readouts beside the update
// chain, whose readout copies live in the placed block) equal an owning state's bit for bit, write
// nothing outside the block, and allocate nothing across 200 decode calls.
TEST_CASE("cuda kvm memory: fixed-batch prefill and decode on a placed state equal an owning state", "[memory][gpu]") {
  if (no_device()) return;
  using S = bf16;
  const Dims d{4, 2, 64, 64};
  const std::int64_t B = 2, T = 100, steps = 240, n_ctx = T + steps;
  const kvmem::kvm::Problem problem{make_params(16, kvmem::budget::Fixed{24, 24}), {B, d.Hq, d.Hk, d.D, d.Dv, n_ctx}};
  const std::size_t total = KvmState<S>::bytes_required(problem.params, problem.shape);
  Guarded mem(total);
  KvmState<S> placed, owning;
  REQUIRE(KvmState<S>::place(mem.memory(), total, problem.params, problem.shape, placed).is_ok());
  REQUIRE(KvmState<S>::create(problem.params, problem.shape, owning).is_ok());
  REQUIRE(placed.readouts_beside_updates() == kvmem::cuda::kVendorPaths);  // portable: readouts on the chain
  REQUIRE(placed.workspace_rows() == B);
  std::mt19937_64 rng(7);
  const Weights w(d, rng);
  const auto run = [&](KvmState<S>& st, std::int64_t n, const Dev<S>& q, const Dev<S>& k, const Dev<S>& v,
                       const Dev<S>& g, float* out) {
    const auto q4 = TensorView<const S, 4>(q.ptr, {B, d.Hq, n, d.D});
    const auto k4 = TensorView<const S, 4>(k.ptr, {B, d.Hk, n, d.D});
    const auto v4 = TensorView<const S, 4>(v.ptr, {B, d.Hk, n, d.Dv});
    const auto g3 = TensorView<const S, 3>(g.ptr, {B, d.Hk, n});
    const auto o4 = TensorView<float, 4>(out, {B, n, d.Hq, d.Dv});
    return n == 1 ? kvmem::cuda::kvm_decode(kvmem::cuda::Executor{}, st, w.device(), q4, k4, v4, g3, o4)
                  : kvmem::cuda::kvm_prefill(kvmem::cuda::Executor{}, st, w.device(), q4, k4, v4, g3, o4);
  };
  const auto inputs = [&](std::int64_t n) { return std::make_unique<BatchInputs<S>>(B, d, n, rng); };
  {
    const auto in = inputs(T);
    Dev<float> oa(std::size_t(B * T * d.Hq * d.Dv)), ob(std::size_t(B * T * d.Hq * d.Dv));
    REQUIRE(run(placed, T, in->q, in->k, in->v, in->g, oa.ptr).is_ok());
    REQUIRE(run(owning, T, in->q, in->k, in->v, in->g, ob.ptr).is_ok());
    CHECK(same_bits(oa.get(), ob.get()));
  }
  const auto in = inputs(1);
  Dev<float> oa(std::size_t(B * d.Hq * d.Dv)), ob(std::size_t(B * d.Hq * d.Dv));
  std::size_t free0 = 0, free1 = 0, total_mem = 0;
  int mismatches = 0;
  for (std::int64_t s = 0; s < steps; ++s) {
    if (s == 40) {  // the first 40 decode calls load every kernel a decode call launches
      KVMEM_CUDA_REQUIRE(cudaDeviceSynchronize());
      KVMEM_CUDA_REQUIRE(cudaMemGetInfo(&free0, &total_mem));
    }
    REQUIRE(run(placed, 1, in->q, in->k, in->v, in->g, oa.ptr).is_ok());
    REQUIRE(run(owning, 1, in->q, in->k, in->v, in->g, ob.ptr).is_ok());
    mismatches += same_bits(oa.get(), ob.get()) ? 0 : 1;
  }
  KVMEM_CUDA_REQUIRE(cudaDeviceSynchronize());
  KVMEM_CUDA_REQUIRE(cudaMemGetInfo(&free1, &total_mem));
  CHECK(mismatches == 0);
  CHECK(free1 == free0);
  CHECK(placed.tokens() == n_ctx);
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t g = 0; g < d.Hk; ++g) {
      std::vector<float> ska, sva, rhoa, skb, svb, rhob;
      REQUIRE(placed.download(b, g, ska, sva, rhoa, nullptr).is_ok());
      REQUIRE(owning.download(b, g, skb, svb, rhob, nullptr).is_ok());
      CHECK(same_bits(ska, skb));
      CHECK(same_bits(sva, svb));
      CHECK(same_bits(rhoa, rhob));
    }
  CHECK(mem.damaged() == 0);
}

}  // namespace
