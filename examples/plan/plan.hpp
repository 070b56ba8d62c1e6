// SPDX-License-Identifier: Apache-2.0
#pragma once
// The numbers kvmem-plan prints, computed by the functions the library allocates with: kvm::state_bytes
// and kvm::workspace_bytes for KV Means, ua::cache_layout for the Universal Attention page pool. A test
// (tests/kvm/test_plan.cpp) creates the states these rows describe and checks that they agree.

#include <cstdint>
#include <string>
#include <vector>

#include "kvmem/core/numeric.hpp"
#include "kvmem/kvm/params.hpp"
#include "kvmem/kvm/schedule.hpp"
#include "kvmem/kvm/state.hpp"
#include "kvmem/policy/budget.hpp"
#include "kvmem/ua/cache.hpp"

namespace kvmem::plan {

struct Config {
  std::int64_t layers = 32, q_heads = 32, kv_heads = 8, head_dim = 128, value_dim = -1, context = 32768, batch = 1;
  std::int64_t chunk = 256, window_chunks = 2;
  std::string dtype = "bf16";  // bf16, fp16, fp32 or fp8 (KVM readout copies and window; UA keys and values)
};

struct Budget {
  const char* name;
  budget::Any budget;
};
// The budgets kvmem-plan prints.
inline std::vector<Budget> budgets() {
  return {{"KVM fixed 256", budget::Fixed{256}},
          {"KVM power 16*sqrt(N)", budget::Power{16.0, 0.5, 256}},
          {"KVM saturating 1024", budget::Saturating{1024.0, 1}}};
}

inline kvm::Params params(const Config& c, const budget::Any& b) {
  kvm::Params p;
  p.chunk = c.chunk;
  p.window_chunks = c.window_chunks;
  p.rope_dims = c.head_dim / 2;
  p.budget = b;
  return p;
}
inline kvm::Shape shape(const Config& c) {
  return {c.batch, c.q_heads, c.kv_heads, c.head_dim, c.value_dim > 0 ? c.value_dim : c.head_dim, c.context};
}

// One row of the plan, for the whole model (every layer, every sequence of the batch).
struct Row {
  std::string name;
  std::int64_t rows = 0;       // slots (KVM) or cache rows per (sequence, KV head)
  double kept_bytes = 0;       // what the cache keeps at the context length
  double state_bytes = 0;      // what it allocates: persistent, every layer
  double workspace_bytes = 0;  // per step, one workspace shared by the layers (they run one at a time)
  double per_item_bytes = 0;   // allocated bytes per (sequence, KV head) of one layer
};

// fp8 (e4m3) rows carry one fp32 scale each: a key row and a value row, 8 bytes per (key, value) pair.
template <class S>
inline constexpr double kRowScaleBytes = is_row_scaled_v<S> ? 2.0 * sizeof(float) : 0.0;

template <class S>
std::vector<Row> rows_for(const Config& c) {
  const kvm::Shape sh = shape(c);
  const double L = double(c.layers), items = double(c.batch * c.kv_heads);
  const double elem = double(sizeof(S)), D = double(sh.D), Dv = double(sh.Dv);
  const double win_elem = double(sizeof(kvm::window_t<S>)), scales = kRowScaleBytes<S>;
  std::vector<Row> out;
  Row full;  // a dense cache in the same dtype (fp8: with the per-row scales of a UA fp8 row)
  full.name = "full KV cache";
  full.rows = c.context;
  full.kept_bytes = full.state_bytes = L * items * double(c.context) * ((D + Dv) * elem + scales);
  full.per_item_bytes = double(c.context) * ((D + Dv) * elem + scales);
  out.push_back(full);
  for (const Budget& b : budgets()) {
    const kvm::Problem pr{params(c, b.budget), sh};
    const kvm::Geometry geo = pr.params.geometry();
    const auto layout = kvm::state_layout<S, float>(pr);
    Row r;
    r.name = b.name;
    r.rows = kvm::slots_after(b.budget, geo, c.context);
    // kept: slot sums (fp32 keys, values, radius, count) and readout copies (with their row scales for
    // fp8), the window's k, v (bf16 for fp8 storage), g
    const double window = double(std::min(c.context, geo.window()));
    r.kept_bytes =
        L * items *
        (double(r.rows) * ((D + Dv + 2) * 4 + (D + Dv) * elem + scales) + window * ((D + Dv) * win_elem + 4));
    r.state_bytes = L * double(layout.bytes);
    r.workspace_bytes = double(kvm::workspace_bytes<S, float>(pr, {c.batch, 0}));
    r.per_item_bytes = double(layout.item_bytes);
    out.push_back(r);
  }
  // UA: a pool of 16-row pages; without pruning a sequence holds ceil(context / 16) pages per KV head.
  const ua::CacheShape us{c.batch, c.q_heads, c.kv_heads, c.head_dim, c.context, 16, 0};
  const auto ul = ua::cache_layout<S>(us);
  Row u;
  u.name = "UA pool, no eviction";
  u.rows = c.context;
  u.kept_bytes = L * items * double(c.context) * (2 * D * elem + 16 + scales);
  u.state_bytes = L * double(ul.bytes);
  u.workspace_bytes = double(ua::workspace_bytes<S>(us, {c.batch, 0}));
  u.per_item_bytes = double(us.pages_per_item()) * double(ul.page_bytes) + double(ul.item_bytes);
  out.push_back(u);
  return out;
}

// The plan for c (empty when the dtype is unknown or the configuration invalid).
inline std::vector<Row> rows(const Config& c) {
  if (c.dtype == "bf16") return rows_for<bf16>(c);
  if (c.dtype == "fp16") return rows_for<fp16>(c);
  if (c.dtype == "fp32") return rows_for<float>(c);
  if (c.dtype == "fp8") return rows_for<e4m3>(c);
  return {};
}

}  // namespace kvmem::plan
