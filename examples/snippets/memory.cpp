// SPDX-License-Identifier: Apache-2.0
// Documentation snippet (docs/memory.md): memory the engine owns. A KV Means state and a Universal
// Attention cache are sized in closed form, placed over buffers the engine allocated, given a per-step
// workspace, and stepped; the UA cache takes its rows from a page pool that an engine can watch.
// main() checks that nothing was allocated by the steps' caches and that the pool balances.

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <new>
#include <vector>

#include "check.hpp"
#include "kvmem/kvmem.hpp"

namespace {

using kvmem::TensorView;

// 64-byte aligned engine memory.
struct Buffer {
  std::unique_ptr<std::byte[]> raw;
  std::byte* data = nullptr;
  std::size_t bytes = 0;
  explicit Buffer(std::size_t n) : raw(new std::byte[n + 64]), bytes(n) {
    data = raw.get() + (64 - reinterpret_cast<std::uintptr_t>(raw.get()) % 64) % 64;
  }
};

void fill(std::vector<float>& x, float f) {
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = std::sin(f * float(i) + 0.3f * float(i % 7));
}

kvmem::Status kvm_placed(std::vector<float>& out) {
  const std::int64_t Hq = 4, Hk = 2, D = 32, tokens = 40;
  kvmem::kvm::Params params;
  params.chunk = 16;
  params.rope_dims = 16;
  params.budget = kvmem::budget::Fixed{64};
  // [snippet:kvm-placed]
  // One layer: 8 sequence slots of up to 4096 tokens; steps advance at most 4 slots at a time.
  const kvmem::kvm::Problem problem{params, {/*max_slots*/ 8, Hq, Hk, D, D, /*n_ctx*/ 4096}};
  const kvmem::host::Executor exec{};
  KVMEM_RETURN_IF_ERROR(kvmem::kvm::can_run(exec, problem));  // or the reason why not
  const std::size_t state_bytes = kvmem::kvm::state_bytes<kvmem::bf16>(problem);
  const std::size_t work_bytes = kvmem::kvm::workspace_bytes<kvmem::bf16>(problem, {/*max_rows*/ 4});
  Buffer state_memory(state_bytes), workspace(work_bytes);  // the engine's memory, 64-byte aligned
  kvmem::kvm::State<kvmem::bf16> state;
  KVMEM_RETURN_IF_ERROR(kvmem::kvm::State<kvmem::bf16>::place(state_memory.data, state_memory.bytes, problem, state));
  KVMEM_RETURN_IF_ERROR(state.attach_workspace(workspace.data, workspace.bytes, {/*max_rows*/ 4}));
  // kvm::step(exec, state, weights, rows, q, k, v, gate, out, lse) now allocates nothing.
  // [snippet-end]
  std::vector<float> lnw(std::size_t(D), 1.f), lnb(std::size_t(D), 0.f), tau(std::size_t(Hq), 1.f);
  const kvmem::kvm::Weights weights{{lnw.data(), {D}}, {lnb.data(), {D}}, {tau.data(), {Hq}}, {tau.data(), {Hq}}};
  std::vector<float> q(std::size_t(tokens * Hq * D)), k(std::size_t(tokens * Hk * D)), v(k.size()),
      g(std::size_t(tokens * Hk), 1.0f);
  fill(q, 0.1f), fill(k, 0.2f), fill(v, 0.3f);
  out.assign(std::size_t(tokens * Hq * D), 0.f);
  const std::int32_t slot[1] = {5}, start[2] = {0, std::int32_t(tokens)};
  const kvmem::Rows rows{{slot, {1}}, {start, {2}}};
  KVMEM_RETURN_IF_ERROR(kvmem::kvm::step(
      exec, state, weights, rows, TensorView<const float, 3>(q.data(), {tokens, Hq, D}),
      TensorView<const float, 3>(k.data(), {tokens, Hk, D}), TensorView<const float, 3>(v.data(), {tokens, Hk, D}),
      TensorView<const float, 2>(g.data(), {tokens, Hk}), TensorView<float, 3>(out.data(), {tokens, Hq, D})));
  SNIPPET_CHECK(state.tokens(5) == tokens);
  SNIPPET_CHECK(state.allocated_bytes() == state_bytes + work_bytes);
  return kvmem::Status::ok();
}

kvmem::Status ua_pool(std::vector<float>& out) {
  const std::int64_t H = 4, G = 2, D = 32, tokens = 300;
  // [snippet:ua-pool]
  // One layer: 16 slots, each (slot, KV head) up to 8192 rows, sharing a pool of 512 pages of 16 rows.
  kvmem::ua::CacheShape shape{/*slots*/ 16, H, G, D, /*capacity*/ 8192};
  shape.page_rows = 16;
  shape.pool_pages = 512;
  const std::size_t cache_bytes = kvmem::ua::cache_layout<kvmem::bf16>(shape).bytes;
  const std::size_t work_bytes = kvmem::ua::workspace_bytes<kvmem::bf16>(shape, {/*max_rows*/ 4});
  Buffer cache_memory(cache_bytes), workspace(work_bytes);
  kvmem::ua::PrunedCache<kvmem::bf16> cache;
  KVMEM_RETURN_IF_ERROR(
      kvmem::ua::PrunedCache<kvmem::bf16>::place(cache_memory.data, cache_memory.bytes, shape, cache));
  KVMEM_RETURN_IF_ERROR(cache.attach_workspace(workspace.data, workspace.bytes, {/*max_rows*/ 4}));
  // ... ua::step(exec, cache, rows, inputs, {.p = 0.05}, out, lse) ...
  // Admission control: free pages now, and the slots that found the pool dry (reset_slots clears them).
  const std::int64_t free_pages = cache.free_pages();
  // [snippet-end]
  SNIPPET_CHECK(free_pages == 512);
  std::vector<float> q(std::size_t(tokens * H * D)), k(std::size_t(tokens * G * D)), v(k.size()),
      zk(std::size_t(tokens * G)), zq(zk.size());
  fill(q, 0.7f), fill(k, 0.5f), fill(v, 0.9f), fill(zk, 1.3f), fill(zq, 0.4f);
  for (std::int64_t r = 0; r < tokens * G; ++r) {  // unit-norm keys
    float n2 = 0;
    for (std::int64_t d = 0; d < D; ++d) n2 += k[std::size_t(r * D + d)] * k[std::size_t(r * D + d)];
    for (std::int64_t d = 0; d < D; ++d) k[std::size_t(r * D + d)] /= std::sqrt(n2);
  }
  out.assign(std::size_t(tokens * H * D), 0.f);
  const std::int32_t slot[1] = {3}, start[2] = {0, std::int32_t(tokens)};
  kvmem::ua::PackedInputs in;
  in.q = {q.data(), {tokens, H, D}}, in.k = {k.data(), {tokens, G, D}}, in.v = {v.data(), {tokens, G, D}};
  in.z_k = {zk.data(), {tokens, G}}, in.z_q = {zq.data(), {tokens, G}};
  KVMEM_RETURN_IF_ERROR(kvmem::ua::step(kvmem::host::Executor{}, cache, kvmem::Rows{{slot, {1}}, {start, {2}}}, in,
                                        {.p = 0.05}, TensorView<float, 3>(out.data(), {tokens, H, D})));
  std::int64_t pages = 0;
  for (std::int64_t g = 0; g < G; ++g) pages += (cache.length(3, g) + 15) / 16;
  SNIPPET_CHECK(cache.pages_in_use() == pages);
  SNIPPET_CHECK(cache.free_pages() == 512 - pages);
  SNIPPET_CHECK(!cache.overflowed(3));
  return kvmem::Status::ok();
}

}  // namespace

int main() {
  std::vector<float> a, b;
  SNIPPET_CHECK_OK(kvm_placed(a));
  SNIPPET_CHECK_OK(ua_pool(b));
  return 0;
}
