// SPDX-License-Identifier: Apache-2.0
// kvmem-plan's numbers (examples/plan/plan.hpp) agree with what the library allocates: for every
// budget, dtype, GQA shape and context length of the grid, the states and caches made by create hold
// exactly the plan's allocated and workspace bytes, and at a small size the kept bytes equal what a
// state reports after running the context.
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include <catch2/catch.hpp>

#include "kvm_step_support.hpp"
#include "plan.hpp"

namespace {

namespace kvm = kvmem::kvm;
namespace plan = kvmem::plan;

template <class S>
void check_allocations(const plan::Config& c) {
  const std::vector<plan::Row> rows = plan::rows(c);
  const auto budgets = plan::budgets();
  REQUIRE(rows.size() == budgets.size() + 2);
  INFO(c.dtype << " Hq " << c.q_heads << " Hk " << c.kv_heads << " context " << c.context << " batch " << c.batch);
  const double L = double(c.layers);
  const double row_scales = kvmem::is_row_scaled_v<S> ? 8.0 : 0.0;  // fp8: a key and a value scale per token
  const double full = L * double(c.batch * c.kv_heads * c.context) * (double(2 * c.head_dim * sizeof(S)) + row_scales);
  CHECK(rows[0].state_bytes == full);
  for (std::size_t i = 0; i < budgets.size(); ++i) {
    const plan::Row& r = rows[i + 1];
    INFO(r.name);
    kvm::State<S, float> st;  // one layer; create allocates the state and a workspace for `batch` rows
    REQUIRE(kvm::State<S, float>::create(plan::params(c, budgets[i].budget), plan::shape(c), st).is_ok());
    CHECK(r.state_bytes == L * double(st.state_bytes()));
    CHECK(r.workspace_bytes == double(st.workspace_bytes()));
    CHECK(r.per_item_bytes * double(c.batch * c.kv_heads) <= double(st.state_bytes()));
    CHECK(double(st.allocated_bytes()) == r.state_bytes / L + r.workspace_bytes);
  }
  const plan::Row& u = rows.back();
  kvmem::ua::PrunedCache<S> cache(kvmem::ua::CacheShape{c.batch, c.q_heads, c.kv_heads, c.head_dim, c.context, 16});
  CHECK(u.state_bytes == L * double(cache.cache_bytes()));
  CHECK(u.workspace_bytes == double(cache.workspace_bytes()));
  CHECK(u.per_item_bytes == double(cache.pool_pages() / (c.batch * c.kv_heads)) * double(cache.page_bytes()) +
                                double(kvmem::ua::cache_layout<S>(cache.shape()).item_bytes));
}

}  // namespace

TEST_CASE("kvmem-plan's allocated bytes are the library's, for every dtype, GQA shape and context",
          "[kvm][memory][unit]") {
  for (const char* dtype : {"bf16", "fp16", "fp32", "fp8"})
    for (const auto& [hq, hk] : {std::pair{32, 8}, std::pair{8, 8}, std::pair{64, 4}})
      for (const std::int64_t context : {4096, 32768, 131072})
        for (const std::int64_t batch : {1, 3}) {
          plan::Config c;
          c.dtype = dtype;
          c.q_heads = hq;
          c.kv_heads = hk;
          c.context = context;
          c.batch = batch;
          if (c.dtype == "bf16")
            check_allocations<kvmem::bf16>(c);
          else if (c.dtype == "fp16")
            check_allocations<kvmem::fp16>(c);
          else if (c.dtype == "fp8")
            check_allocations<kvmem::e4m3>(c);
          else
            check_allocations<float>(c);
        }
}

namespace {
template <class S>
void check_kept_bytes(const char* dtype) {
  using namespace kvmem::test::kvm_mem;
  plan::Config c;
  c.layers = 3, c.q_heads = 4, c.kv_heads = 2, c.head_dim = 8, c.context = 700, c.chunk = 16, c.dtype = dtype;
  const std::vector<plan::Row> rows = plan::rows(c);
  const auto budgets = plan::budgets();
  const Dims d{4, 2, 8, 8};
  const Weights w(d, 1);
  for (std::size_t i = 0; i < budgets.size(); ++i) {
    INFO(dtype << " " << rows[i + 1].name);
    kvm::State<S, float> st;
    REQUIRE(kvm::State<S, float>::create(plan::params(c, budgets[i].budget), plan::shape(c), st).is_ok());
    Step step(d, 1, 100);
    std::mt19937_64 rng(4);
    for (std::int64_t t = 0; t < c.context; t += 100) {
      step.clear();
      step.add(d, 0, std::min<std::int64_t>(100, c.context - t), rng);
      REQUIRE(step.run(kvmem::host::Executor{.threads = 1, .exact = true}, st, w.view(), d).is_ok());
    }
    CHECK(st.slots(0) == rows[i + 1].rows);
    CHECK(rows[i + 1].kept_bytes == double(c.layers) * double(st.cache_bytes(0)));
  }
}
}  // namespace

TEST_CASE("kvmem-plan's kept bytes equal a state's after the context ran", "[kvm][memory][unit]") {
  check_kept_bytes<kvmem::bf16>("bf16");
  check_kept_bytes<kvmem::e4m3>("fp8");
}
