// SPDX-License-Identifier: Apache-2.0
// The CUDA UA cache over caller-owned memory and its page pool (DESIGN.md 3, docs/memory.md): closed-form
// sizes and refusals, a cache and workspace placed over a guarded device buffer (nothing written outside,
// the same bits as an owning cache), results, kept sets and pool counters equal to the host page-pool
// cache on the same steps (the host is the reference), pool exhaustion (only the asking slot overflows,
// the other slots' outputs equal a run without it, reset_slots brings the slot back), pages taken and
// returned counted from the lengths the steps leave, no device allocation across 1,000 steps, and a long
// decode soak within the page bound (label slow). Skips, saying so, when no CUDA device is visible.
#include "kvmem/backend/cuda/vendor.cuh"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include <catch2/catch.hpp>

#include "cuda/cuda_test_support.hpp"
#include "kvmem/backend/cuda/ua.cuh"
#include "ua/ua_host_support.hpp"
#include "ua/ua_step_support.hpp"

namespace {
namespace kua = kvmem::ua;
using kvmem::Rows;
using kvmem::Status;
using kvmem::StatusCode;
using kvmem::TensorView;
using kvmem::cuda::UaCache;
using kvmem::test::ua_mem::Dims;
using kvmem::test::ua_mem::Step;
using namespace kvmem::test::cuda;
using I32View = TensorView<const std::int32_t, 1>;

const Dims kDims{8, 2, 64};  // GQA groups of 4, the shapes of the slot suite
const kua::Options kPrune{0.05, 64, true};
const kua::Options kDense{0.0, 64, true};

kua::CacheShape pooled(std::int64_t slots, std::int64_t capacity, std::int64_t pool_pages) {
  return {slots, kDims.H, kDims.G, kDims.D, capacity, 16, pool_pages};
}

// Device copies of a host Step's packed inputs and the step's outputs, at fixed addresses.
struct DevStep {
  Dev<float> q, k, v, zk, zq, out, lse;
  Dev<std::int32_t> slot, start;
  DevStep(std::int64_t tokens, std::int64_t rows)
      : q(std::size_t(tokens * kDims.H * kDims.D)),
        k(std::size_t(tokens * kDims.G * kDims.D)),
        v(std::size_t(tokens * kDims.G * kDims.D)),
        zk(std::size_t(tokens * kDims.G)),
        zq(std::size_t(tokens * kDims.G)),
        out(std::size_t(tokens * kDims.H * kDims.D)),
        lse(std::size_t(tokens * kDims.H)),
        slot(std::size_t(rows)),
        start(std::size_t(rows + 1)) {}
  void upload(const Step& s) {
    const auto put = [](auto* dst, const auto& src, std::size_t cap) {
      REQUIRE(src.size() <= cap);
      if (!src.empty())
        KVMEM_CUDA_REQUIRE(cudaMemcpy(dst, src.data(), src.size() * sizeof(src[0]), cudaMemcpyHostToDevice));
    };
    put(q.ptr, s.q, q.n);
    put(k.ptr, s.k, k.n);
    put(v.ptr, s.v, v.n);
    put(zk.ptr, s.zk, zk.n);
    put(zq.ptr, s.zq, zq.n);
    put(slot.ptr, s.slot, slot.n);
    put(start.ptr, s.start, start.n);
  }
  // Enqueues the step (uploaded) on `stream`; the launch's Status.
  Status enqueue(UaCache<float>& cache, const Step& s, const kua::Options& opt, cudaStream_t stream) {
    const std::int64_t N = s.tokens(), R = std::int64_t(s.slot.size());
    kua::PackedInputsOf<float> in;
    in.q = {q.ptr, {N, kDims.H, kDims.D}};
    in.k = {k.ptr, {N, kDims.G, kDims.D}};
    in.v = {v.ptr, {N, kDims.G, kDims.D}};
    in.z_k = {zk.ptr, {N, kDims.G}};
    in.z_q = {zq.ptr, {N, kDims.G}};
    const Rows rows{I32View(slot.ptr, {R}), I32View(start.ptr, {R + 1})};
    return kua::step(kvmem::cuda::Executor{stream}, cache, rows, in, opt,
                     TensorView<float, 3>(out.ptr, {N, kDims.H, kDims.D}), TensorView<float, 2>(lse.ptr, {N, kDims.H}));
  }
  // Uploads, runs and checks one step; returns out [N,H,D] and lse [N,H].
  std::pair<std::vector<float>, std::vector<float>> run(UaCache<float>& cache, const Step& s, const kua::Options& opt) {
    upload(s);
    const Status st = enqueue(cache, s, opt, nullptr);
    INFO(st.to_string());
    REQUIRE(st.is_ok());
    const Status checked = cache.step_status(kvmem::cuda::Executor{});
    INFO(checked.to_string());
    REQUIRE(checked.is_ok());
    const std::int64_t N = s.tokens();
    std::vector<float> o(std::size_t(N * kDims.H * kDims.D)), l(std::size_t(N * kDims.H));
    if (N > 0) {
      KVMEM_CUDA_REQUIRE(cudaMemcpy(o.data(), out.ptr, o.size() * sizeof(float), cudaMemcpyDeviceToHost));
      KVMEM_CUDA_REQUIRE(cudaMemcpy(l.data(), lse.ptr, l.size() * sizeof(float), cudaMemcpyDeviceToHost));
    }
    return {o, l};
  }
};

// A schedule of ragged steps over `slots` slots: a first step of prompt rows (at most the prefill
// chunk, so the host and the device take and return the same pages), then `decodes` steps of one token
// per slot. Seeded: every call with the same arguments gives the same steps.
std::vector<Step> schedule(std::int64_t slots, const std::vector<std::int64_t>& prompts, std::int64_t decodes,
                           std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<Step> steps;
  Step first(kDims, slots, 1024);
  for (std::int64_t s = 0; s < slots; ++s) first.add(kDims, std::int32_t(s), prompts[std::size_t(s)], rng);
  steps.push_back(first);
  for (std::int64_t t = 0; t < decodes; ++t) {
    Step d(kDims, slots, slots);
    for (std::int64_t s = 0; s < slots; ++s) d.add(kDims, std::int32_t(s), 1, rng);
    steps.push_back(d);
  }
  return steps;
}

// Relative Frobenius distance of b from a (0 when both are zero).
double rel_diff(const std::vector<float>& a, const std::vector<float>& b) {
  REQUIRE(a.size() == b.size());
  double num = 0.0, den = 0.0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    const double d = double(a[i]) - double(b[i]);
    num += d * d;
    den += double(a[i]) * double(a[i]);
  }
  return den > 0.0 ? std::sqrt(num / den) : std::sqrt(num);
}

std::vector<std::int64_t> lengths_of(UaCache<float>& cache) {
  std::vector<std::int64_t> len;
  REQUIRE(cache.lengths(len, nullptr).is_ok());
  return len;
}

std::int64_t pages_for(const std::vector<std::int64_t>& lengths, std::int64_t rows_per_page = 16) {
  std::int64_t p = 0;
  for (auto n : lengths) p += (n + rows_per_page - 1) / rows_per_page;
  return p;
}

struct DevList {
  Dev<std::int32_t> d;
  std::int64_t n;
  explicit DevList(const std::vector<std::int32_t>& s) : d(s), n(std::int64_t(s.size())) {}
  I32View view() const { return {d.ptr, {n}}; }
};

}  // namespace

TEST_CASE("cuda UA cache: closed-form sizes, can_run and refused placements", "[cuda][ua][memory][gpu]") {
  const kua::CacheShape s = pooled(4, 256, 40);
  const kua::CacheLayout host = kua::cache_layout<float>(s), dev = UaCache<float>::cache_layout(s);
  // the host's page layout, then the device's bookkeeping
  CHECK(dev.page_bytes == host.page_bytes);
  CHECK(dev.pages == host.pages);
  CHECK(dev.pages == 40);
  CHECK(dev.bytes > host.bytes);
  CHECK(dev.alignment == 256);
  CHECK(UaCache<float>::cache_bytes(s) == dev.bytes);
  // a pool of 40 pages costs 40 pages, whatever the capacity (unlike a contiguous cache)
  kua::CacheShape big = s;
  big.capacity = 1 << 16;
  CHECK(UaCache<float>::cache_bytes(big) - UaCache<float>::cache_bytes(s) < 40 * host.page_bytes);
  const std::size_t ws = UaCache<float>::workspace_bytes(s, {2});
  CHECK(ws > 0);
  CHECK(UaCache<float>::workspace_bytes(s, {-1}) == 0);
  CHECK(UaCache<float>::bytes_required(s) == UaCache<float>::cache_bytes(s) + UaCache<float>::workspace_bytes(s));
  CHECK(UaCache<float>::can_run(s).is_ok());
  kua::CacheShape wide = s;
  wide.head_dim = 320;
  CHECK(UaCache<float>::can_run(wide).code() == StatusCode::kUnsupported);
  kua::CacheShape odd = s;
  odd.page_rows = 12;
  CHECK(UaCache<float>::can_run(odd).code() == StatusCode::kInvalidArgument);
  CHECK(UaCache<float>::cache_bytes(odd) == 0);

  if (no_device()) return;
  Dev<unsigned char> mem(dev.bytes + 512);
  UaCache<float> c;
  CHECK(UaCache<float>::place(nullptr, dev.bytes, s, c).code() == StatusCode::kInvalidArgument);
  CHECK(UaCache<float>::place(mem.ptr + 64, dev.bytes, s, c).code() == StatusCode::kInvalidArgument);
  CHECK(UaCache<float>::place(mem.ptr, dev.bytes - 1, s, c).code() == StatusCode::kInvalidArgument);
  CHECK_FALSE(c.valid());
  REQUIRE(UaCache<float>::place(mem.ptr, dev.bytes, s, c).is_ok());
  CHECK(c.valid());
  CHECK(c.allocated_bytes() == 0);
  CHECK(c.cache_bytes() == dev.bytes);
  CHECK(c.free_pages() == 40);
  CHECK(c.pages_in_use() == 0);
  // a step needs a workspace
  Step st(kDims, 1, 1);
  std::mt19937_64 rng(1);
  st.add(kDims, 0, 1, rng);
  DevStep d(1, 1);
  d.upload(st);
  CHECK(d.enqueue(c, st, kPrune, nullptr).code() == StatusCode::kInvalidArgument);
  Dev<unsigned char> small(ws);
  CHECK(c.attach_workspace(small.ptr, ws - 1, {2}).code() == StatusCode::kInvalidArgument);
  REQUIRE(c.attach_workspace(small.ptr, ws, {2}).is_ok());
  CHECK(c.workspace_bytes() == ws);
  CHECK(d.enqueue(c, st, kPrune, nullptr).is_ok());
  KVMEM_CUDA_REQUIRE(cudaDeviceSynchronize());
  CHECK(c.pages_in_use() == kDims.G);  // one page per kv head of slot 0
  CHECK(c.pages_taken() == kDims.G);
}

TEST_CASE("cuda UA cache placed over a guarded buffer writes nothing outside and matches an owning cache",
          "[cuda][ua][memory][gpu]") {
  if (no_device()) return;
  const kua::CacheShape s = pooled(4, 256, 48);
  const std::size_t guard = 4096, cb = UaCache<float>::cache_bytes(s), ws = UaCache<float>::workspace_bytes(s, {4});
  const std::size_t cb_up = (cb + 255) / 256 * 256, total = guard + cb_up + guard + ws + guard;
  Dev<unsigned char> mem(total);
  KVMEM_CUDA_REQUIRE(cudaMemset(mem.ptr, 0x5a, total));
  KVMEM_CUDA_REQUIRE(cudaDeviceSynchronize());  // placed memory must not be in use by pending work
  UaCache<float> placed, owning;
  REQUIRE(UaCache<float>::place(mem.ptr + guard, cb, s, placed).is_ok());
  REQUIRE(placed.attach_workspace(mem.ptr + guard + cb_up + guard, ws, {4}).is_ok());
  REQUIRE(UaCache<float>::create(s, owning).is_ok());
  CHECK(owning.allocated_bytes() == UaCache<float>::bytes_required(s));

  const auto steps = schedule(4, {40, 17, 1, 64}, 80, 7);
  DevStep d(1024, 4);
  for (std::size_t i = 0; i < steps.size(); ++i) {
    const auto a = d.run(placed, steps[i], kPrune);
    const auto b = d.run(owning, steps[i], kPrune);
    INFO("step " << i);
    REQUIRE(a.first == b.first);
    REQUIRE(a.second == b.second);
    REQUIRE(placed.free_pages() == owning.free_pages());
    REQUIRE(placed.pages_taken() == owning.pages_taken());
  }
  CHECK(placed.pages_returned() > 0);  // eviction gave pages back
  // every byte outside the cache and the workspace still holds the fill
  const std::vector<unsigned char> bytes = mem.get();
  std::size_t outside = 0;
  const auto check = [&](std::size_t from, std::size_t to) {
    for (std::size_t x = from; x < to; ++x) outside += bytes[x] != 0x5a;
  };
  check(0, guard);
  check(guard + cb, guard + cb_up + guard);
  check(guard + cb_up + guard + ws, total);
  CHECK(outside == 0);
}

TEST_CASE("cuda UA page pool equals the host page-pool cache: outputs, kept sets, pool counters",
          "[cuda][ua][memory][gpu]") {
  if (no_device()) return;
  const kua::CacheShape s = pooled(4, 256, 48);
  UaCache<float> dev;
  REQUIRE(UaCache<float>::create(s, dev).is_ok());
  kua::PrunedCache<float> host(s);
  const auto steps = schedule(4, {40, 17, 1, 64}, 120, 11);
  DevStep d(1024, 4);
  const double log_p = std::log(kPrune.p);
  std::int64_t near_ties = 0;
  for (std::size_t i = 0; i < steps.size(); ++i) {
    Step h = steps[i];
    REQUIRE(h.run(kvmem::host::Executor{.threads = 1}, host, kPrune, kDims).is_ok());
    const auto got = d.run(dev, steps[i], kPrune);
    INFO("step " << i);
    CHECK(rel_diff(h.out, got.first) <= 1e-4);
    CHECK(rel_diff(h.lse, got.second) <= 1e-4);
    // kept sets, entry by entry; an entry kept by one side only must be a near-tie of λ and ln p
    bool same = true;
    for (std::int64_t b = 0; b < s.batch; ++b)
      for (std::int64_t g = 0; g < s.kv_heads; ++g) {
        std::vector<std::int64_t> pos;
        std::vector<float> lam;
        REQUIRE(dev.download(b, g, pos, lam, nullptr, nullptr, nullptr).is_ok());
        const std::int64_t n = host.length(b, g);
        const std::int64_t* hp = host.positions(b, g);
        const float* hl = host.lambda(b, g);
        const std::set<std::int64_t> hs(hp, hp + n), ds(pos.begin(), pos.end());
        if (hs == ds) continue;
        same = false;
        for (std::int64_t e = 0; e < n; ++e)
          if (!ds.count(hp[e])) CHECK(std::abs(hl[e] - log_p) < 1e-3);
        for (std::size_t e = 0; e < pos.size(); ++e)
          if (!hs.count(pos[e])) CHECK(std::abs(lam[e] - log_p) < 1e-3);
      }
    if (!same) {  // a near-tie: later outputs differ legitimately
      ++near_ties;
      WARN("near-tie of λ and ln p at step " << i << ": later steps not compared");
      break;
    }
    CHECK(dev.free_pages() == host.free_pages());
    CHECK(dev.pages_taken() == host.pages_taken());
    CHECK(dev.pages_returned() == host.pages_returned());
    CHECK(dev.pages_taken() - dev.pages_returned() == dev.pages_in_use());
  }
  CHECK(near_ties == 0);
  CHECK(host.pages_returned() > 0);
}

TEST_CASE("cuda UA fixed-batch prefill and decode over a shared pool equal the host's", "[cuda][ua][memory][gpu]") {
  if (no_device()) return;
  using kvmem::test::ua::FloatCase;
  // 3 sequences of a 70-token prompt in chunks of 32 (the last chunk returns the spare pages), then 40
  // decode steps, at p = 0.05 over a pool of 3 * 2 * 8 pages
  const std::int64_t B = 3, T = 110, prompt = 70;
  const FloatCase f(kvmem::test::ua::random_case(B, T, kDims.H, kDims.G, kDims.D, 41));
  const kua::CacheShape s{B, kDims.H, kDims.G, kDims.D, 256, 16, B * kDims.G * 8};
  const kua::Options opt{0.05, 32, true};
  kua::PrunedCache<float> host(s);
  UaCache<float> dev;
  REQUIRE(UaCache<float>::create(s, dev).is_ok());
  Dev<float> q(f.q), k(f.k), v(f.v), zk(f.z_k), zq(f.z_q), out(std::size_t(B * T * kDims.H * kDims.D));
  const auto slice = [&](std::int64_t t0, std::int64_t t1) {
    const std::int64_t H = kDims.H, G = kDims.G, D = kDims.D;
    kvmem::cuda::UaInputs<float> in;
    in.q = {q.ptr + t0 * D, {B, H, t1 - t0, D}, {H * T * D, T * D, D, 1}};
    in.k = {k.ptr + t0 * D, {B, G, t1 - t0, D}, {G * T * D, T * D, D, 1}};
    in.v = {v.ptr + t0 * D, {B, G, t1 - t0, D}, {G * T * D, T * D, D, 1}};
    in.z_k = {zk.ptr + t0, {B, G, t1 - t0}, {G * T, T, 1}};
    in.z_q = {zq.ptr + t0, {B, G, t1 - t0}, {G * T, T, 1}};
    return in;
  };
  const auto out_at = [&](std::int64_t t0, std::int64_t t1) {
    const std::int64_t H = kDims.H, D = kDims.D;
    return TensorView<float, 4>(out.ptr + t0 * H * D, {B, t1 - t0, H, D}, {T * H * D, H * D, D, 1});
  };
  std::vector<float> host_out = f.make_out();
  const kvmem::cuda::Executor exec{};
  REQUIRE(
      kua::prefill(kvmem::host::Executor{.threads = 1}, host, f.slice(0, prompt), opt, f.out_slice(host_out, 0, prompt))
          .is_ok());
  REQUIRE(kvmem::cuda::ua_prefill(exec, dev, slice(0, prompt), opt, out_at(0, prompt)).is_ok());
  for (std::int64_t t = prompt; t < T; ++t) {
    REQUIRE(
        kua::decode(kvmem::host::Executor{.threads = 1}, host, f.slice(t, t + 1), opt, f.out_slice(host_out, t, t + 1))
            .is_ok());
    REQUIRE(kvmem::cuda::ua_decode(exec, dev, slice(t, t + 1), opt, out_at(t, t + 1)).is_ok());
  }
  const auto len = lengths_of(dev);
  bool same = true;
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t g = 0; g < kDims.G; ++g) same = same && len[std::size_t(b * kDims.G + g)] == host.length(b, g);
  if (!same) WARN("kept lengths differ (a near-tie of λ and ln p): outputs not compared");
  if (same) {
    CHECK(rel_diff(host_out, out.get()) <= 1e-4);
    CHECK(dev.free_pages() == host.free_pages());
  }
  CHECK(dev.pages_in_use() == pages_for(len));
  CHECK(dev.pages_taken() - dev.pages_returned() == dev.pages_in_use());
  CHECK(dev.pages_returned() > 0);
  std::vector<std::int32_t> flags;
  REQUIRE(dev.overflowed(exec, flags).is_ok());
  CHECK(flags == std::vector<std::int32_t>(3, 0));
}

TEST_CASE("cuda UA fixed-batch calls over own pages keep the page counts and publish them", "[cuda][ua][memory][gpu]") {
  if (no_device()) return;
  // pool_pages = 0: every (slot, kv head) owns ceil(256 / 16) pages; no kernel counts them, publishing
  // (publish_occupancy, or the end of a prefill) counts the pages of the kept rows
  const std::int64_t B = 2, T = 90, prompt = 50;
  const kvmem::test::ua::FloatCase f(kvmem::test::ua::random_case(B, T, kDims.H, kDims.G, kDims.D, 43));
  const kua::CacheShape s{B, kDims.H, kDims.G, kDims.D, 256, 16, 0};
  UaCache<float> dev;
  REQUIRE(UaCache<float>::create(s, dev).is_ok());
  CHECK(dev.pool_pages() == B * kDims.G * 16);
  CHECK(dev.free_pages() == dev.pool_pages());
  Dev<float> q(f.q), k(f.k), v(f.v), zk(f.z_k), zq(f.z_q), out(std::size_t(B * T * kDims.H * kDims.D));
  const auto slice = [&](std::int64_t t0, std::int64_t t1) {
    const std::int64_t H = kDims.H, G = kDims.G, D = kDims.D;
    kvmem::cuda::UaInputs<float> in;
    in.q = {q.ptr + t0 * D, {B, H, t1 - t0, D}, {H * T * D, T * D, D, 1}};
    in.k = {k.ptr + t0 * D, {B, G, t1 - t0, D}, {G * T * D, T * D, D, 1}};
    in.v = {v.ptr + t0 * D, {B, G, t1 - t0, D}, {G * T * D, T * D, D, 1}};
    in.z_k = {zk.ptr + t0, {B, G, t1 - t0}, {G * T, T, 1}};
    in.z_q = {zq.ptr + t0, {B, G, t1 - t0}, {G * T, T, 1}};
    return in;
  };
  const auto out_at = [&](std::int64_t t0, std::int64_t t1) {
    const std::int64_t H = kDims.H, D = kDims.D;
    return TensorView<float, 4>(out.ptr + t0 * H * D, {B, t1 - t0, H, D}, {T * H * D, H * D, D, 1});
  };
  const kvmem::cuda::Executor exec{};
  const kua::Options opt{0.05, 32, true};
  REQUIRE(kvmem::cuda::ua_prefill(exec, dev, slice(0, prompt), opt, out_at(0, prompt)).is_ok());
  KVMEM_CUDA_REQUIRE(cudaDeviceSynchronize());
  auto len = lengths_of(dev);
  CHECK(dev.pages_in_use() == pages_for(len));
  for (std::int64_t t = prompt; t < T; ++t) {
    const std::int64_t before = dev.pages_in_use();
    REQUIRE(kvmem::cuda::ua_decode(exec, dev, slice(t, t + 1), opt, out_at(t, t + 1)).is_ok());
    KVMEM_CUDA_REQUIRE(cudaDeviceSynchronize());
    INFO("decode token " << t);
    REQUIRE(dev.pages_in_use() == before);  // own pages: a decode does no page accounting, publishes nothing
    REQUIRE(dev.publish_occupancy(exec).is_ok());
    KVMEM_CUDA_REQUIRE(cudaDeviceSynchronize());
    len = lengths_of(dev);
    REQUIRE(dev.pages_in_use() == pages_for(len));
    REQUIRE(dev.pages_taken() - dev.pages_returned() == dev.pages_in_use());
  }
  CHECK(dev.pages_returned() > 0);
  // a dense prefill (p = 0) appends every row
  UaCache<float> dense;
  REQUIRE(UaCache<float>::create(s, dense).is_ok());
  REQUIRE(kvmem::cuda::ua_prefill(exec, dense, slice(0, prompt), kDense, out_at(0, prompt)).is_ok());
  KVMEM_CUDA_REQUIRE(cudaDeviceSynchronize());
  CHECK(dense.pages_in_use() == B * kDims.G * ((prompt + 15) / 16));
}

TEST_CASE("cuda UA pool exhaustion flags only the asking slot, reset_slots brings it back", "[cuda][ua][memory][gpu]") {
  if (no_device()) return;
  // slots 0..2 hold 20 rows per kv head (2 pages each, room to 32 rows); slot 3 asks for 200 rows
  // (13 pages per kv head) from the 10 pages left: it overflows, whichever order the rows run in
  const kua::CacheShape s = pooled(4, 512, 3 * 2 * 2 + 10);
  UaCache<float> with, without;
  REQUIRE(UaCache<float>::create(s, with).is_ok());
  REQUIRE(UaCache<float>::create(s, without).is_ok());
  std::mt19937_64 rng(5);
  std::vector<Step> all, others;
  {
    Step a(kDims, 4, 1024), b(kDims, 4, 1024);
    std::mt19937_64 r2 = rng;
    for (std::int32_t x = 0; x < 3; ++x) a.add(kDims, x, 20, rng);
    for (std::int32_t x = 0; x < 3; ++x) b.add(kDims, x, 20, r2);
    all.push_back(a);
    others.push_back(b);
  }
  for (int t = 0; t < 10; ++t) {
    Step a(kDims, 4, 1024), b(kDims, 4, 1024);
    std::mt19937_64 r2 = rng;
    for (std::int32_t x = 0; x < 3; ++x) a.add(kDims, x, 1, rng);
    for (std::int32_t x = 0; x < 3; ++x) b.add(kDims, x, 1, r2);
    a.add(kDims, 3, t == 0 ? 200 : 1, rng);  // the prompt, then decode rows of the flagged slot
    all.push_back(a);
    others.push_back(b);
  }
  DevStep d(1024, 4);
  for (std::size_t i = 0; i < all.size(); ++i) {
    const auto a = d.run(with, all[i], kDense);
    const auto b = d.run(without, others[i], kDense);
    INFO("step " << i);
    const std::size_t n3 = std::size_t(others[i].tokens() * kDims.H * kDims.D);
    // slots 0..2 come first in both steps: their outputs are the same
    CHECK(rel_diff(b.first, std::vector<float>(a.first.begin(), a.first.begin() + std::ptrdiff_t(n3))) <= 1e-6);
    if (i > 0) {  // slot 3's row: zeros
      CHECK(std::all_of(a.first.begin() + std::ptrdiff_t(n3), a.first.end(), [](float x) { return x == 0.0f; }));
      CHECK(std::all_of(a.second.begin() + std::ptrdiff_t(n3 / kDims.D), a.second.end(),
                        [](float x) { return x == 0.0f; }));
    }
  }
  std::vector<std::int32_t> flags;
  REQUIRE(with.overflowed(kvmem::cuda::Executor{}, flags).is_ok());
  CHECK(flags == std::vector<std::int32_t>{0, 0, 0, 1});
  const auto len = lengths_of(with);
  CHECK(len[6] == 0);
  CHECK(len[7] == 0);
  CHECK(with.pages_in_use() == pages_for(len));  // the flagged slot's pages went back at once
  CHECK(with.pages_in_use() == 3 * 2 * 2);
  CHECK(with.pages_taken() - with.pages_returned() == with.pages_in_use());

  // after reset_slots the slot works again: a new prompt on it equals that sequence alone on the host
  const DevList three({3});
  REQUIRE(kua::reset_slots(kvmem::cuda::Executor{}, with, three.view()).is_ok());
  REQUIRE(with.overflowed(kvmem::cuda::Executor{}, flags).is_ok());
  CHECK(flags[3] == 0);
  kua::PrunedCache<float> alone(kua::CacheShape{1, kDims.H, kDims.G, kDims.D, 512, 16, 0});
  for (int t = 0; t < 6; ++t) {
    Step a(kDims, 1, 64);
    a.add(kDims, 3, t == 0 ? 30 : 1, rng);
    Step h = a;
    h.slot[0] = 0;
    REQUIRE(h.run(kvmem::host::Executor{.threads = 1}, alone, kDense, kDims).is_ok());
    const auto got = d.run(with, a, kDense);
    INFO("after reset, step " << t);
    CHECK(rel_diff(h.out, got.first) <= 1e-4);
    CHECK(rel_diff(h.lse, got.second) <= 1e-4);
  }
  REQUIRE(with.overflowed(kvmem::cuda::Executor{}, flags).is_ok());
  CHECK(flags[3] == 0);
  CHECK(lengths_of(with)[6] == 35);
}

TEST_CASE("cuda UA copy_slots and records over a shared pool: pages for the copy, refusals change nothing",
          "[cuda][ua][memory][gpu]") {
  if (no_device()) return;
  // slot 0 holds 40 rows per kv head (3 pages each); the pool has 4 pages left
  const kua::CacheShape s = pooled(3, 256, 2 * 3 + 4);
  UaCache<float> c;
  REQUIRE(UaCache<float>::create(s, c).is_ok());
  kua::PrunedCache<float> host(s);
  std::mt19937_64 rng(17);
  Step first(kDims, 3, 64);
  first.add(kDims, 0, 40, rng);
  DevStep d(64, 3);
  (void)d.run(c, first, kDense);
  REQUIRE(first.run(kvmem::host::Executor{.threads = 1}, host, kDense, kDims).is_ok());
  CHECK(c.pages_in_use() == 6);
  const kvmem::cuda::Executor exec{};
  // a copy needs 6 pages, 4 are free: refused on the device, nothing changed, and step_status returns the
  // host's message
  const DevList src({0}), dst({1});
  REQUIRE(kua::copy_slots(exec, c, src.view(), dst.view()).is_ok());
  const Status refused = c.step_status(exec);
  const std::vector<std::int32_t> host_src{0}, host_dst{1};
  const Status host_refused =
      kua::copy_slots(kvmem::host::Executor{}, host, I32View(host_src.data(), {1}), I32View(host_dst.data(), {1}));
  CHECK(refused.code() == StatusCode::kOutOfRange);
  CHECK(refused.to_string() == host_refused.to_string());
  CHECK(c.step_status(exec).is_ok());  // read once, cleared
  CHECK(c.pages_in_use() == 6);
  CHECK(lengths_of(c) == std::vector<std::int64_t>{40, 40, 0, 0, 0, 0});
  // slot 0's record (its rows gathered through the page table) has the host record's size and imports
  // into a host cache with the same lengths and positions
  std::vector<std::byte> rec(kua::export_bytes(c, 0));
  REQUIRE(kua::export_slot(exec, c, 0, std::span<std::byte>(rec)).is_ok());
  CHECK(rec.size() == kua::export_bytes(host, 0));
  kua::PrunedCache<float> back(pooled(1, 256, 0));
  REQUIRE(kua::import_slot(kvmem::host::Executor{}, back, 0, std::span<const std::byte>(rec)).is_ok());
  for (std::int64_t g = 0; g < kDims.G; ++g) {
    REQUIRE(back.length(0, g) == host.length(0, g));
    CHECK(std::equal(back.positions(0, g), back.positions(0, g) + back.length(0, g), host.positions(0, g)));
  }
  // importing it into slot 2 needs 6 pages: refused, nothing changed
  CHECK(kua::import_slot(exec, c, 2, std::span<const std::byte>(rec)).code() == StatusCode::kOutOfRange);
  CHECK(c.pages_in_use() == 6);
  // a shorter slot copies: slot 1 gets 20 rows (2 pages per kv head), then continues like its source
  const DevList zero({0});
  REQUIRE(kua::reset_slots(exec, c, zero.view()).is_ok());
  REQUIRE(c.step_status(exec).is_ok());  // the slot operations never wait: this waits for the reset
  CHECK(c.pages_in_use() == 0);
  Step again(kDims, 3, 64);
  again.add(kDims, 0, 20, rng);
  (void)d.run(c, again, kDense);
  REQUIRE(kua::copy_slots(exec, c, src.view(), dst.view()).is_ok());
  REQUIRE(c.step_status(exec).is_ok());
  CHECK(c.pages_in_use() == 8);
  CHECK(lengths_of(c) == std::vector<std::int64_t>{20, 20, 20, 20, 0, 0});
  Step both(kDims, 3, 8);
  std::mt19937_64 r2 = rng;
  both.add(kDims, 0, 1, rng);
  Step one(kDims, 1, 1);
  one.add(kDims, 1, 1, r2);  // the same token for the copy
  const auto a = d.run(c, both, kDense);
  const auto b = d.run(c, one, kDense);
  CHECK(a.first == b.first);
  CHECK(a.second == b.second);
  CHECK(c.pages_taken() - c.pages_returned() == c.pages_in_use());
}

TEST_CASE("cuda UA pages taken and returned equal the pages the lengths account for", "[cuda][ua][memory][gpu]") {
  if (no_device()) return;
  const kua::CacheShape s = pooled(4, 512, 4 * 2 * 33);
  UaCache<float> c;
  REQUIRE(UaCache<float>::create(s, c).is_ok());
  const auto steps = schedule(4, {64, 33, 5, 48}, 400, 23);
  DevStep d(1024, 4);
  std::vector<std::int64_t> len(8, 0);
  std::int64_t taken = 0, returned = 0;
  for (std::size_t i = 0; i < steps.size(); ++i) {
    (void)d.run(c, steps[i], kPrune);
    const auto now = lengths_of(c);
    // per (slot, kv head): the step took the pages of kept + its tokens before it ran and gave back the
    // pages past its survivors
    for (std::size_t it = 0; it < len.size(); ++it) {
      const std::int64_t tokens = steps[i].start[it / 2 + 1] - steps[i].start[it / 2];
      const std::int64_t held = (len[it] + 15) / 16, need = (len[it] + tokens + 15) / 16;
      const std::int64_t peak = std::max(held, need), after = (now[it] + 15) / 16;
      taken += peak - held;
      returned += peak - after;
    }
    len = now;
    INFO("step " << i);
    REQUIRE(c.pages_taken() == taken);
    REQUIRE(c.pages_returned() == returned);
    REQUIRE(c.pages_in_use() == pages_for(len));
  }
  CHECK(returned > 0);
}

TEST_CASE("cuda UA steps allocate no device memory across 1,000 steps", "[cuda][ua][memory][gpu]") {
  if (no_device()) return;
  const kua::CacheShape s = pooled(4, 512, 4 * 2 * 33);
  UaCache<float> c;
  REQUIRE(UaCache<float>::create(s, c).is_ok());
  const auto steps = schedule(4, {64, 33, 5, 48}, 1, 31);
  DevStep d(1024, 4);
  for (int w = 0; w < 5; ++w) (void)d.run(c, steps[std::size_t(w == 0 ? 0 : 1)], kPrune);  // loads the kernels
  d.upload(steps[1]);
  KVMEM_CUDA_REQUIRE(cudaDeviceSynchronize());
  std::size_t free0 = 0, free1 = 0, total = 0;
  KVMEM_CUDA_REQUIRE(cudaMemGetInfo(&free0, &total));
  for (int t = 0; t < 1000; ++t) REQUIRE(d.enqueue(c, steps[1], kPrune, nullptr).is_ok());
  KVMEM_CUDA_REQUIRE(cudaDeviceSynchronize());
  KVMEM_CUDA_REQUIRE(cudaMemGetInfo(&free1, &total));
  CHECK(free1 == free0);
  CHECK(c.step_status(kvmem::cuda::Executor{}).is_ok());
  std::vector<std::int32_t> flags;
  REQUIRE(c.overflowed(kvmem::cuda::Executor{}, flags).is_ok());
  CHECK(flags == std::vector<std::int32_t>(4, 0));
}

TEST_CASE("cuda UA decode soak of 1M tokens stays within the page bound", "[cuda][ua][memory][gpu][.slow]") {
  if (no_device()) return;
  // one slot, capacity 512 rows, pages of 4 rows, a pool of 512 / 4 + 1 pages per kv head (the closed-form
  // bound). Small pages make the kept count's steady-state swings (about ten rows here) cross page
  // boundaries, so pages are taken and returned all through the soak; with 16-row pages a kept count
  // that settles between 33 and 48 would hold its three pages for good and test no return.
  const std::int64_t rows_per_page = 4, pool = 2 * (512 / rows_per_page + 1);
  const kua::CacheShape s{1, kDims.H, kDims.G, kDims.D, 512, rows_per_page, pool};
  UaCache<float> c;
  REQUIRE(UaCache<float>::create(s, c).is_ok());
  // 64 decode steps of fresh random tokens, cycled (positions advance every step)
  std::mt19937_64 rng(2024);
  std::vector<std::unique_ptr<DevStep>> ring;
  Step one(kDims, 1, 1);
  for (int i = 0; i < 64; ++i) {
    one.clear();
    one.add(kDims, 0, 1, rng);
    ring.push_back(std::make_unique<DevStep>(1, 1));
    ring.back()->upload(one);
  }
  std::int64_t max_pages = 0, max_len = 0;
  bool balanced = true;
  // KVMEM_SOAK_TOKENS shortens the soak for runs under compute-sanitizer, where 1M decode steps would
  // take hours; the checks are the same, made every 1,000 steps.
  std::int64_t tokens = 1000000;
  if (const char* env = std::getenv("KVMEM_SOAK_TOKENS")) {
    tokens = std::strtoll(env, nullptr, 10);
    REQUIRE(tokens >= 1000);
    WARN("soak shortened to " << tokens << " tokens by KVMEM_SOAK_TOKENS");
  }
  for (std::int64_t t = 0; t < tokens && balanced; ++t) {
    REQUIRE(ring[std::size_t(t % 64)]->enqueue(c, one, kPrune, nullptr).is_ok());
    if ((t + 1) % 1000 != 0) continue;
    const auto len = lengths_of(c);  // synchronises: the mirror shows this step
    max_len = std::max({max_len, len[0], len[1]});
    max_pages = std::max(max_pages, c.pages_in_use());
    balanced =
        c.pages_in_use() == pages_for(len, rows_per_page) && c.pages_taken() - c.pages_returned() == c.pages_in_use();
  }
  INFO("max length " << max_len << ", max pages " << max_pages << ", pages returned " << c.pages_returned());
  CHECK(balanced);
  std::vector<std::int32_t> flags;
  REQUIRE(c.overflowed(kvmem::cuda::Executor{}, flags).is_ok());
  CHECK(flags[0] == 0);
  CHECK(c.pages_returned() > 0);
  CHECK(max_pages <= pool);
  CHECK(c.position(0) == tokens);
}
