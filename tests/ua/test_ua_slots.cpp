// SPDX-License-Identifier: Apache-2.0
// UA sequence slots on the host (DESIGN.md 3, core/slots.hpp): ua::step over ragged rows, the slot
// operations and their safety. Expected values come from runs of each sequence alone with ua::prefill /
// ua::decode on a cache of its own (the property the issue asks for: a slot step equals its sequence run
// alone, bitwise), from the fp64 reference (lse, outputs), or from the cache's state before a refused
// call; never from the slot path itself.
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <map>
#include <random>
#include <span>
#include <string>
#include <vector>

#include <catch2/catch.hpp>

#include "kvmem/backend/host/ua.hpp"
#include "kvmem/reference/ua.hpp"
#include "support/golden.hpp"
#include "ua_test_support.hpp"

namespace {
namespace kua = kvmem::ua;
using kvmem::Rows;
using kvmem::Status;
using kvmem::StatusCode;
using kvmem::TensorView;
using Slots = std::vector<std::int32_t>;

TensorView<const std::int32_t, 1> list(const Slots& s) {
  return {s.data(), {static_cast<std::int64_t>(s.size())}};
}

// One sequence's inputs, token-major: q [L,H,D], k, v [L,G,D], z_k, z_q [L,G]. Keys unit-norm, gate
// logits ~ N(gate_mean, 1.5) as in the UA suite's random cases (they evict at p = 0.05).
struct Seq {
  std::int64_t L = 0;
  std::vector<float> q, k, v, z_k, z_q;
  void resize(std::int64_t n, std::int64_t H, std::int64_t G, std::int64_t D) {
    q.resize(std::size_t(n * H * D));
    k.resize(std::size_t(n * G * D));
    v.resize(k.size());
    z_k.resize(std::size_t(n * G));
    z_q.resize(z_k.size());
  }
  // Fills tokens [from, L) with fresh random values.
  void fill(std::int64_t from, std::int64_t H, std::int64_t G, std::int64_t D, std::mt19937_64& rng, double gate_mean) {
    std::normal_distribution<float> n01(0.0f, 1.0f), gate(float(gate_mean), 1.5f);
    for (std::int64_t t = from; t < L; ++t) {
      for (std::int64_t x = 0; x < H * D; ++x) q[std::size_t(t * H * D + x)] = 2.0f * n01(rng);
      for (std::int64_t g = 0; g < G; ++g) {
        float* key = &k[std::size_t((t * G + g) * D)];
        double norm = 0.0;
        for (std::int64_t d = 0; d < D; ++d) {
          key[d] = n01(rng);
          norm += double(key[d]) * key[d];
          v[std::size_t((t * G + g) * D + d)] = n01(rng);
        }
        for (std::int64_t d = 0; d < D; ++d) key[d] = float(key[d] / (std::sqrt(norm) + 1e-6));
        z_k[std::size_t(t * G + g)] = gate(rng);
        z_q[std::size_t(t * G + g)] = gate(rng);
      }
    }
  }
};

struct Shape {
  std::int64_t H = 4, G = 2, D = 8;
};

// Batch-major views [1,H,T,D] ... of tokens [t0, t0+T) of a token-major sequence (for prefill/decode).
kua::Inputs batch_view(const Seq& s, const Shape& sh, std::int64_t t0, std::int64_t T) {
  const std::int64_t H = sh.H, G = sh.G, D = sh.D;
  kua::Inputs in;
  in.q = {s.q.data() + t0 * H * D, {1, H, T, D}, {s.L * H * D, D, H * D, 1}};
  in.k = {s.k.data() + t0 * G * D, {1, G, T, D}, {s.L * G * D, D, G * D, 1}};
  in.v = {s.v.data() + t0 * G * D, {1, G, T, D}, {s.L * G * D, D, G * D, 1}};
  in.z_k = {s.z_k.data() + t0 * G, {1, G, T}, {s.L * G, 1, G}};
  in.z_q = {s.z_q.data() + t0 * G, {1, G, T}, {s.L * G, 1, G}};
  return in;
}

// A sequence run alone: the same row lengths (its history), each row a ua::prefill (> 1 token) or a
// ua::decode (1 token) on a cache of one sequence. Returns out [n,H,D] for the first n tokens.
template <class Storage>
std::vector<float> run_alone(const Seq& s, const Shape& sh, const std::vector<std::int64_t>& rows,
                             const kua::Options& opt, std::int64_t capacity) {
  kua::PrunedCache<Storage> cache(kua::CacheShape{1, sh.H, sh.G, sh.D, capacity, 16});
  std::int64_t n = 0;
  for (auto T : rows) n += T;
  std::vector<float> out(std::size_t(n * sh.H * sh.D), 0.0f);
  std::int64_t t0 = 0;
  for (auto T : rows) {
    TensorView<float, 4> o(out.data() + t0 * sh.H * sh.D, {1, T, sh.H, sh.D});
    const Status st = T == 1 ? kua::decode(kvmem::host::Executor{2}, cache, batch_view(s, sh, t0, T), opt, o)
                             : kua::prefill(kvmem::host::Executor{2}, cache, batch_view(s, sh, t0, T), opt, o);
    INFO(st.to_string());
    REQUIRE(st.is_ok());
    t0 += T;
  }
  return out;
}

// One step's packed inputs and outputs.
struct Packed {
  std::vector<float> q, k, v, z_k, z_q, out, lse;
  Slots slot, query_start{0};
  std::int64_t N = 0;
  std::int64_t max_query_len = 0;  // Rows::max_query_len
  // Appends a row of tokens [t0, t0+T) of s (or T garbage tokens for a padding row when s is null).
  void add(std::int32_t slot_index, const Seq* s, std::int64_t t0, std::int64_t T, const Shape& sh,
           std::mt19937_64& rng) {
    const std::int64_t H = sh.H, G = sh.G, D = sh.D;
    std::normal_distribution<float> n01(0.0f, 1.0f);
    for (std::int64_t t = t0; t < t0 + T; ++t) {
      for (std::int64_t x = 0; x < H * D; ++x) q.push_back(s ? s->q[std::size_t(t * H * D + x)] : n01(rng));
      for (std::int64_t x = 0; x < G * D; ++x) {
        k.push_back(s ? s->k[std::size_t(t * G * D + x)] : n01(rng));
        v.push_back(s ? s->v[std::size_t(t * G * D + x)] : n01(rng));
      }
      for (std::int64_t g = 0; g < G; ++g) {
        z_k.push_back(s ? s->z_k[std::size_t(t * G + g)] : n01(rng));
        z_q.push_back(s ? s->z_q[std::size_t(t * G + g)] : n01(rng));
      }
    }
    N += T;
    slot.push_back(slot_index);
    query_start.push_back(std::int32_t(N));
  }
  kua::PackedInputs inputs(const Shape& sh) const {
    kua::PackedInputs in;
    in.q = {q.data(), {N, sh.H, sh.D}};
    in.k = {k.data(), {N, sh.G, sh.D}};
    in.v = {v.data(), {N, sh.G, sh.D}};
    in.z_k = {z_k.data(), {N, sh.G}};
    in.z_q = {z_q.data(), {N, sh.G}};
    return in;
  }
  Rows rows() const { return {list(slot), {query_start.data(), {std::int64_t(query_start.size())}}, max_query_len}; }
  // Runs the step; out and lse are pre-filled with NaN so that an unwritten row shows.
  template <class Storage>
  Status run(kua::PrunedCache<Storage>& cache, const Shape& sh, const kua::Options& opt, int threads = 2) {
    out.assign(std::size_t(N * sh.H * sh.D), std::nanf(""));
    lse.assign(std::size_t(N * sh.H), std::nanf(""));
    return kua::step(kvmem::host::Executor{threads}, cache, rows(), inputs(sh), opt,
                     TensorView<float, 3>(out.data(), {N, sh.H, sh.D}), TensorView<float, 2>(lse.data(), {N, sh.H}));
  }
};

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
}

// The whole observable state of a cache: shape, counters, lengths, freed rows and every kept row, bitwise.
template <class Storage>
std::vector<std::byte> state_of(const kua::PrunedCache<Storage>& c) {
  std::vector<std::byte> bytes;
  const auto put = [&](const void* p, std::size_t n) {
    const auto* b = static_cast<const std::byte*>(p);
    bytes.insert(bytes.end(), b, b + n);
  };
  const auto& s = c.shape();
  put(&s, sizeof s);
  for (std::int64_t b = 0; b < c.max_slots(); ++b) {
    const std::int64_t pos = c.position(b);
    put(&pos, sizeof pos);
    for (std::int64_t g = 0; g < s.kv_heads; ++g) {
      const std::int64_t n = c.length(b, g), freed = c.freed_rows(b, g);
      put(&n, sizeof n);
      put(&freed, sizeof freed);
      put(c.positions(b, g), std::size_t(n) * sizeof(std::int64_t));
      put(c.lambda(b, g), std::size_t(n) * sizeof(float));
      put(c.key_logits(b, g), std::size_t(n) * sizeof(float));
      put(c.keys(b, g), std::size_t(n * s.head_dim) * sizeof(Storage));
      put(c.values(b, g), std::size_t(n * s.head_dim) * sizeof(Storage));
    }
  }
  return bytes;
}

template <class Storage>
std::vector<std::byte> export_record(const kua::PrunedCache<Storage>& c, std::int32_t slot) {
  std::vector<std::byte> rec(kua::export_bytes(c, slot));
  const Status st = kua::export_slot(kvmem::host::Executor{}, c, slot, rec);
  INFO(st.to_string());
  REQUIRE(st.is_ok());
  return rec;
}

// ---- the continuous-batching property ------------------------------------------------------------

struct Live {
  Seq data;
  std::vector<std::int64_t> plan;     // row lengths still to run
  std::vector<std::int64_t> history;  // row lengths run so far (run_alone replays them)
  std::int64_t done = 0;              // tokens run
  std::vector<float> out, lse;        // [L,H,D], [L,H] as produced by the slot steps
  std::int32_t slot = -1;
};

struct ScheduleStats {
  std::int64_t sequences = 0, steps = 0, forks = 0, migrations = 0, resets = 0, truncations_exact = 0,
               truncations_refused = 0, padding_rows = 0, mixed_steps = 0, evicted = 0, max_len = 0, min_len = 1 << 30;
};

// Row plan of a sequence of L tokens: a prompt in prefill rows of 1..max_chunk tokens, then up to
// `max_decode` single-token decode rows.
std::vector<std::int64_t> make_plan(std::int64_t L, std::int64_t from, std::mt19937_64& rng, std::int64_t max_chunk,
                                    std::int64_t max_decode) {
  std::vector<std::int64_t> plan;
  const std::int64_t decode = std::min<std::int64_t>(L - from, std::int64_t(rng() % std::uint64_t(max_decode + 1)));
  std::int64_t t = from;
  while (t < L - decode) {
    std::int64_t c = 1 + std::int64_t(rng() % std::uint64_t(max_chunk));
    if (rng() % 4 == 0) c = 1 + std::int64_t(rng() % 8);  // short rows too, single tokens included
    c = std::min(c, L - decode - t);
    plan.push_back(c);
    t += c;
  }
  for (; t < L; ++t) plan.push_back(1);
  return plan;
}

template <class Storage>
ScheduleStats continuous_batching(std::uint64_t seed, const kua::Options& opt, std::int64_t sequences,
                                  std::int64_t max_len, std::int64_t slots) {
  const Shape sh;
  const std::int64_t H = sh.H, G = sh.G, D = sh.D, capacity = max_len;
  std::mt19937_64 rng(seed);
  kua::PrunedCache<Storage> cache(kua::CacheShape{slots, H, G, D, capacity, 16});
  std::vector<Live> all;
  std::vector<std::size_t> active;
  std::vector<std::int32_t> free_slots;
  for (std::int32_t s = std::int32_t(slots) - 1; s >= 0; --s) free_slots.push_back(s);
  ScheduleStats st;
  const auto new_length = [&](std::int64_t at_least) {
    // log-uniform in [1, max_len], with the extremes present
    if (st.sequences == 0) return max_len;
    if (st.sequences == 1) return std::max<std::int64_t>(1, at_least);
    const double u = std::uniform_real_distribution<double>(0.0, std::log(double(max_len)))(rng);
    return std::max<std::int64_t>(at_least, std::min<std::int64_t>(max_len, std::int64_t(std::exp(u))));
  };
  const auto admit = [&](Live&& x) {
    x.slot = free_slots.back();
    free_slots.pop_back();
    x.out.resize(std::size_t(x.data.L * H * D));
    x.lse.resize(std::size_t(x.data.L * H));
    st.max_len = std::max(st.max_len, x.data.L);
    st.min_len = std::min(st.min_len, x.data.L);
    ++st.sequences;
    all.push_back(std::move(x));
    active.push_back(all.size() - 1);
  };
  const auto leave = [&](std::size_t a) {  // index into active
    free_slots.push_back(all[active[a]].slot);
    all[active[a]].slot = -1;
    active.erase(active.begin() + std::ptrdiff_t(a));
  };

  while (st.sequences < sequences || !active.empty()) {
    // join
    while (st.sequences < sequences && free_slots.size() > 1 && rng() % 2 == 0) {
      Live x;
      x.data.L = new_length(1);
      x.data.resize(x.data.L, H, G, D);
      x.data.fill(0, H, G, D, rng, 1.0);
      x.plan = make_plan(x.data.L, 0, rng, 700, 40);
      // a new sequence's slot may hold an old one's state: reset it first (the engine's job)
      const Slots s{free_slots.back()};
      REQUIRE(kua::reset_slots(kvmem::host::Executor{}, cache, list(s)).is_ok());
      ++st.resets;
      admit(std::move(x));
    }
    // fork: a new sequence continues an active one's state (copy_slots), with its own future tokens
    if (!active.empty() && !free_slots.empty() && st.sequences < sequences && rng() % 3 == 0) {
      const Live& parent = all[active[rng() % active.size()]];
      if (parent.done > 0) {
        Live x;
        x.data.L = new_length(parent.done + 1);
        x.data.resize(x.data.L, H, G, D);
        std::copy_n(parent.data.q.begin(), parent.done * H * D, x.data.q.begin());
        std::copy_n(parent.data.k.begin(), parent.done * G * D, x.data.k.begin());
        std::copy_n(parent.data.v.begin(), parent.done * G * D, x.data.v.begin());
        std::copy_n(parent.data.z_k.begin(), parent.done * G, x.data.z_k.begin());
        std::copy_n(parent.data.z_q.begin(), parent.done * G, x.data.z_q.begin());
        x.data.fill(parent.done, H, G, D, rng, 1.0);
        x.history = parent.history;
        x.done = parent.done;
        x.plan = make_plan(x.data.L, parent.done, rng, 300, 40);
        const Slots src{parent.slot}, dst{free_slots.back()};
        const std::vector<float> pout(parent.out.begin(), parent.out.begin() + parent.done * H * D),
            plse(parent.lse.begin(), parent.lse.begin() + parent.done * H);
        REQUIRE(kua::copy_slots(kvmem::host::Executor{}, cache, list(src), list(dst)).is_ok());
        admit(std::move(x));
        Live& child = all.back();
        std::copy(pout.begin(), pout.end(), child.out.begin());
        std::copy(plse.begin(), plse.end(), child.lse.begin());
        ++st.forks;
      }
    }
    // migrate: export a slot, import it into a free slot, reset the old one
    if (!active.empty() && !free_slots.empty() && rng() % 10 == 0) {
      Live& x = all[active[rng() % active.size()]];
      const auto rec = export_record(cache, x.slot);
      const std::int32_t to = free_slots.back();
      free_slots.pop_back();
      REQUIRE(kua::import_slot(kvmem::host::Executor{}, cache, to, rec).is_ok());
      CHECK(export_record(cache, to) == rec);
      const Slots old{x.slot};
      REQUIRE(kua::reset_slots(kvmem::host::Executor{}, cache, list(old)).is_ok());
      free_slots.push_back(x.slot);
      x.slot = to;
      ++st.migrations;
    }
    // truncate: n = 0 is exact (nothing changes); 0 < n < tokens is refused and changes nothing
    if (!active.empty() && rng() % 5 == 0) {
      const Live& x = all[active[rng() % active.size()]];
      const auto before = state_of(cache);
      if (x.done >= 2) {
        const std::int64_t n = 1 + std::int64_t(rng() % std::uint64_t(x.done - 1));
        const Status s = kua::truncate(kvmem::host::Executor{}, cache, x.slot, n);
        CHECK(s.code() == StatusCode::kUnsupported);
        ++st.truncations_refused;
      } else {
        CHECK(kua::truncate(kvmem::host::Executor{}, cache, x.slot, 0).is_ok());
        ++st.truncations_exact;
      }
      CHECK(state_of(cache) == before);
    }
    if (active.empty()) continue;
    // one step: a random subset of the active sequences, each its next row, padding rows between
    Packed p;
    std::vector<std::size_t> stepped;
    std::vector<std::size_t> order(active.size());
    for (std::size_t i = 0; i < order.size(); ++i) order[i] = i;
    std::shuffle(order.begin(), order.end(), rng);
    bool prefill_row = false, decode_row = false;
    for (std::size_t i : order) {
      if (rng() % 4 == 0) {
        p.add(-1, nullptr, 0, std::int64_t(rng() % 3), sh, rng);
        ++st.padding_rows;
      }
      Live& x = all[active[i]];
      if (rng() % 5 == 0) continue;  // not in this step
      if (rng() % 12 == 0) {         // in the step with no tokens: untouched
        p.add(x.slot, &x.data, x.done, 0, sh, rng);
        continue;
      }
      const std::int64_t T = x.plan.front();
      (T == 1 ? decode_row : prefill_row) = true;
      p.add(x.slot, &x.data, x.done, T, sh, rng);
      stepped.push_back(active[i]);
    }
    if (p.slot.empty()) continue;
    const Status s = p.run(cache, sh, opt);
    INFO(s.to_string());
    REQUIRE(s.is_ok());
    ++st.steps;
    st.mixed_steps += prefill_row && decode_row;
    for (std::size_t r = 0; r < p.slot.size(); ++r) {
      const std::int64_t x0 = p.query_start[r], x1 = p.query_start[r + 1];
      if (p.slot[r] < 0) {  // padding rows zeroed
        for (std::int64_t x = x0 * H * D; x < x1 * H * D; ++x) CHECK(p.out[std::size_t(x)] == 0.0f);
        for (std::int64_t x = x0 * H; x < x1 * H; ++x) CHECK(p.lse[std::size_t(x)] == 0.0f);
      }
    }
    std::size_t r = 0;
    for (std::size_t id : stepped) {
      Live& x = all[id];
      while (p.slot[r] != x.slot) ++r;
      const std::int64_t x0 = p.query_start[r], T = p.query_start[r + 1] - x0;
      std::copy_n(p.out.begin() + x0 * H * D, T * H * D, x.out.begin() + x.done * H * D);
      std::copy_n(p.lse.begin() + x0 * H, T * H, x.lse.begin() + x.done * H);
      x.done += T;
      x.history.push_back(T);
      x.plan.erase(x.plan.begin());
    }
    // leave: finished sequences, and now and then one cut short (truncate of all its tokens: exact)
    for (std::size_t a = active.size(); a-- > 0;) {
      Live& x = all[active[a]];
      for (std::int64_t g = 0; g < G; ++g) st.evicted += x.done - cache.length(x.slot, g);
      if (x.plan.empty() || (x.done > 0 && rng() % 40 == 0)) {
        if (rng() % 2 == 0) {
          REQUIRE(kua::truncate(kvmem::host::Executor{}, cache, x.slot, x.done).is_ok());
          for (std::int64_t g = 0; g < G; ++g) CHECK(cache.length(x.slot, g) == 0);
          CHECK(cache.position(x.slot) == 0);
          ++st.truncations_exact;
        }
        leave(a);
      }
    }
  }

  // Every sequence equals itself run alone (same row lengths), bitwise.
  for (std::size_t i = 0; i < all.size(); ++i) {
    const Live& x = all[i];
    INFO("sequence " << i << " of " << x.data.L << " tokens, " << x.done << " run in " << x.history.size() << " rows");
    const auto alone = run_alone<Storage>(x.data, sh, x.history, opt, capacity);
    const std::vector<float> got(x.out.begin(), x.out.begin() + x.done * H * D);
    CHECK(same_bits(got, alone));
    for (std::int64_t t = 0; t < x.done * H; ++t) CHECK(std::isfinite(x.lse[std::size_t(t)]));
  }
  // lse of the whole schedule equals each sequence's lse from a one-slot step run (same rows), bitwise
  // (every third sequence of at most 1,500 tokens, to keep the test fast).
  for (std::size_t i = 0; i < all.size(); i += 3) {
    const Live& x = all[i];
    if (x.data.L > 1500) continue;
    kua::PrunedCache<Storage> one(kua::CacheShape{1, H, G, D, capacity, 16});
    std::int64_t t0 = 0;
    for (auto T : x.history) {
      Packed p;
      p.add(0, &x.data, t0, T, sh, rng);
      REQUIRE(p.run(one, sh, opt).is_ok());
      CHECK(std::equal(p.lse.begin(), p.lse.end(), x.lse.begin() + t0 * H, [](float a, float b) {
        return std::bit_cast<std::uint32_t>(a) == std::bit_cast<std::uint32_t>(b);
      }));
      t0 += T;
    }
  }
  return st;
}

void report(const ScheduleStats& s, std::int64_t max_len) {
  INFO("sequences " << s.sequences << ", steps " << s.steps << " (" << s.mixed_steps
                    << " mixing prefill and decode rows), forks " << s.forks << ", migrations " << s.migrations
                    << ", truncations exact " << s.truncations_exact << " / refused " << s.truncations_refused
                    << ", padding rows " << s.padding_rows << ", lengths " << s.min_len << ".." << s.max_len);
  CHECK(s.sequences >= 32);
  CHECK(s.max_len == max_len);
  CHECK(s.min_len == 1);
  CHECK(s.mixed_steps > 0);
  CHECK(s.forks > 0);
  CHECK(s.migrations > 0);
  CHECK(s.truncations_exact > 0);
  CHECK(s.truncations_refused > 0);
  CHECK(s.padding_rows > 0);
}

}  // namespace

// The schedule at full scale (sequences of 1 to 3,000 tokens) takes tens of seconds on a loaded or
// sanitized build: hidden from the default run, registered as ctest label `slow` (tests/ua/CMakeLists.txt).
// The fast variant below runs the same schedule with sequences of up to 600 tokens.
TEST_CASE("slots: continuous batching of 32+ sequences in 16 slots equals each sequence run alone, bitwise",
          "[ua][slots][.slow]") {
  SECTION("fp32, pruning p = 0.05") {
    const auto s = continuous_batching<float>(1, kua::Options{0.05, 64, true}, 34, 3000, 16);
    report(s, 3000);
    CHECK(s.evicted > 0);
  }
  SECTION("bf16, pruning p = 0.05, evicting after attention") {
    const auto s = continuous_batching<kvmem::bf16>(2, kua::Options{0.05, 96, false}, 33, 3000, 16);
    report(s, 3000);
    CHECK(s.evicted > 0);
  }
  SECTION("fp32, dense (p = 0)") {
    const auto s = continuous_batching<float>(3, kua::Options{0.0, 128, true}, 32, 3000, 16);
    report(s, 3000);
    CHECK(s.evicted == 0);
  }
  SECTION("bf16, dense (p = 0)") {
    const auto s = continuous_batching<kvmem::bf16>(4, kua::Options{0.0, 64, true}, 32, 3000, 16);
    report(s, 3000);
    CHECK(s.evicted == 0);
  }
}

TEST_CASE("slots: continuous batching of 32+ sequences of up to 600 tokens equals each sequence run alone",
          "[ua][slots]") {
  SECTION("fp32, pruning p = 0.05") {
    const auto s = continuous_batching<float>(5, kua::Options{0.05, 64, true}, 32, 600, 16);
    report(s, 600);
    CHECK(s.evicted > 0);
  }
  SECTION("bf16, pruning p = 0.05, evicting after attention") {
    const auto s = continuous_batching<kvmem::bf16>(6, kua::Options{0.05, 32, false}, 32, 600, 16);
    report(s, 600);
    CHECK(s.evicted > 0);
  }
  SECTION("fp32, dense (p = 0)") {
    const auto s = continuous_batching<float>(7, kua::Options{0.0, 128, true}, 32, 600, 16);
    report(s, 600);
    CHECK(s.evicted == 0);
  }
}

// ---- step semantics ------------------------------------------------------------------------------

namespace {
// A random sequence of L tokens in the suite's shape.
Seq random_seq(std::int64_t L, std::uint64_t seed, double gate_mean = 1.0) {
  const Shape sh;
  std::mt19937_64 rng(seed);
  Seq s;
  s.L = L;
  s.resize(L, sh.H, sh.G, sh.D);
  s.fill(0, sh.H, sh.G, sh.D, rng, gate_mean);
  return s;
}

// The fp64 reference's inputs ([1,H,T,D] ... batch-major) for a token-major sequence.
kvmem::reference::ua::Inputs ref_inputs(const Seq& s, const Shape& sh) {
  kvmem::reference::ua::Inputs in;
  const std::int64_t L = s.L, H = sh.H, G = sh.G, D = sh.D;
  in.q.resize(std::size_t(H * L * D));
  in.k.resize(std::size_t(G * L * D));
  in.v.resize(in.k.size());
  in.z_k.resize(std::size_t(G * L));
  in.z_q.resize(in.z_k.size());
  for (std::int64_t t = 0; t < L; ++t) {
    for (std::int64_t h = 0; h < H; ++h)
      for (std::int64_t d = 0; d < D; ++d)
        in.q[std::size_t((h * L + t) * D + d)] = s.q[std::size_t((t * H + h) * D + d)];
    for (std::int64_t g = 0; g < G; ++g) {
      for (std::int64_t d = 0; d < D; ++d) {
        in.k[std::size_t((g * L + t) * D + d)] = s.k[std::size_t((t * G + g) * D + d)];
        in.v[std::size_t((g * L + t) * D + d)] = s.v[std::size_t((t * G + g) * D + d)];
      }
      in.z_k[std::size_t(g * L + t)] = s.z_k[std::size_t(t * G + g)];
      in.z_q[std::size_t(g * L + t)] = s.z_q[std::size_t(t * G + g)];
    }
  }
  return in;
}

// Runs sequences side by side in one cache: sequence i in slot i, rows of `rows[i][k]` tokens at step k
// (0 = not in the step). Returns out [L,H,D] and lse [L,H] per sequence.
struct SideBySide {
  std::vector<std::vector<float>> out, lse;
};
template <class Storage>
SideBySide side_by_side(kua::PrunedCache<Storage>& cache, const std::vector<Seq>& seqs,
                        const std::vector<std::vector<std::int64_t>>& rows, const kua::Options& opt) {
  const Shape sh;
  std::mt19937_64 rng(7);
  SideBySide r;
  std::vector<std::int64_t> done(seqs.size(), 0);
  for (const auto& s : seqs) {
    r.out.emplace_back(std::size_t(s.L * sh.H * sh.D), 0.0f);
    r.lse.emplace_back(std::size_t(s.L * sh.H), 0.0f);
  }
  std::size_t steps = 0;
  for (const auto& x : rows) steps = std::max(steps, x.size());
  for (std::size_t k = 0; k < steps; ++k) {
    Packed p;
    for (std::size_t i = 0; i < seqs.size(); ++i)
      if (k < rows[i].size() && rows[i][k] > 0) p.add(std::int32_t(i), &seqs[i], done[i], rows[i][k], sh, rng);
    const Status st = p.run(cache, sh, opt);
    INFO(st.to_string());
    REQUIRE(st.is_ok());
    for (std::size_t i = 0, row = 0; i < seqs.size(); ++i)
      if (k < rows[i].size() && rows[i][k] > 0) {
        const std::int64_t x0 = p.query_start[row], T = rows[i][k];
        std::copy_n(p.out.begin() + x0 * sh.H * sh.D, T * sh.H * sh.D, r.out[i].begin() + done[i] * sh.H * sh.D);
        std::copy_n(p.lse.begin() + x0 * sh.H, T * sh.H, r.lse[i].begin() + done[i] * sh.H);
        done[i] += T;
        ++row;
      }
  }
  return r;
}
}  // namespace

TEST_CASE("slots: outputs and lse equal the fp64 reference (dense), pruned outputs its pruned run", "[ua][slots]") {
  const Shape sh;
  const std::vector<Seq> seqs{random_seq(300, 11), random_seq(1, 12), random_seq(150, 13)};
  // sequence 0: prefill rows of 64 (= P) then decode; 1: one decode token; 2: rows of 100 and 50
  const auto then_decode = [](std::vector<std::int64_t> rows, std::int64_t L) {
    std::int64_t n = 0;
    for (auto T : rows) n += T;
    for (; n < L; ++n) rows.push_back(1);
    return rows;
  };
  const std::vector<std::vector<std::int64_t>> dense_rows{then_decode({64, 64, 64, 64}, 300), {0, 0, 1}, {100, 0, 50}};
  kua::PrunedCache<float> cache(kua::CacheShape{3, sh.H, sh.G, sh.D, 300, 16});
  const auto got = side_by_side(cache, seqs, dense_rows, kua::Options{0.0, 64, true});
  for (std::size_t i = 0; i < seqs.size(); ++i) {
    INFO("sequence " << i);
    const kvmem::reference::ua::Config c{1, seqs[i].L, sh.H, sh.G, sh.D, 64, -1, true};
    const auto ref = kvmem::reference::ua::dense(c, ref_inputs(seqs[i], sh));
    // reference lse is [1,H,T]; ours [T,H]
    std::vector<double> ref_lse(got.lse[i].size());
    for (std::int64_t t = 0; t < seqs[i].L; ++t)
      for (std::int64_t h = 0; h < sh.H; ++h)
        ref_lse[std::size_t(t * sh.H + h)] = ref.lse[std::size_t(h * seqs[i].L + t)];
    KVMEM_CHECK_CLOSE(got.out[i], ref.out, 1e-5);
    KVMEM_CHECK_CLOSE(got.lse[i], ref_lse, 1e-5);
  }
  // Pruned, p = 0.05: prefill rows of P up to the split, then decode rows, as the reference's pruned run.
  kua::PrunedCache<float> pruned(kua::CacheShape{3, sh.H, sh.G, sh.D, 300, 16});
  const std::vector<std::vector<std::int64_t>> rows{then_decode({128, 128}, 300), {1}, then_decode({0, 128}, 150)};
  const auto got_p = side_by_side(pruned, seqs, rows, kua::Options{0.05, 128, true});
  std::int64_t evicted = 0;
  for (std::size_t i = 0; i < seqs.size(); ++i) {
    INFO("sequence " << i);
    const std::int64_t split = i == 1 ? 0 : (i == 0 ? 256 : 128);
    const kvmem::reference::ua::Config c{1, seqs[i].L, sh.H, sh.G, sh.D, 128, split, true};
    const auto ref = kvmem::reference::ua::pruned(c, ref_inputs(seqs[i], sh), 0.05);
    KVMEM_CHECK_CLOSE(got_p.out[i], ref.out, 1e-5);
    for (std::int64_t g = 0; g < sh.G; ++g) {
      std::vector<std::int64_t> kept(std::size_t(seqs[i].L), 0);
      for (std::int64_t e = 0; e < pruned.length(std::int64_t(i), g); ++e)
        kept[std::size_t(pruned.positions(std::int64_t(i), g)[e])] = 1;
      CHECK(std::vector<std::int64_t>(ref.kept.begin() + g * seqs[i].L, ref.kept.begin() + (g + 1) * seqs[i].L) ==
            kept);
      evicted += seqs[i].L - pruned.length(std::int64_t(i), g);
    }
  }
  CHECK(evicted > 0);
}

TEST_CASE("slots: a prompt in rows of whole chunks equals one prefill call; a 1-token row is a decode step",
          "[ua][slots]") {
  const Shape sh;
  const Seq s = random_seq(320, 21);
  const kua::Options opt{0.05, 64, true};
  // one prefill of 256, then decode 64 tokens, alone (batch-major API)
  std::vector<std::int64_t> history{256};
  for (int t = 0; t < 64; ++t) history.push_back(1);
  const auto alone = run_alone<float>(s, sh, history, opt, 320);
  // the same prompt as rows of 64, 128, 64 tokens (whole chunks) beside another sequence
  kua::PrunedCache<float> cache(kua::CacheShape{2, sh.H, sh.G, sh.D, 320, 16});
  std::vector<std::int64_t> rows{64, 128, 64};
  for (int t = 0; t < 64; ++t) rows.push_back(1);
  const auto got = side_by_side(cache, {s, random_seq(100, 22)}, {rows, {50, 49, 0, 1}}, opt);
  CHECK(same_bits(got.out[0], alone));
}

TEST_CASE("slots: a full slot refuses only rows that advance it; reset, it steps again", "[ua][slots]") {
  const Shape sh;
  const std::vector<Seq> seqs{random_seq(40, 31), random_seq(40, 32)};
  kua::PrunedCache<float> cache(kua::CacheShape{2, sh.H, sh.G, sh.D, 8, 16});
  std::mt19937_64 rng(1);
  const kua::Options dense{0.0, 64, true};
  {  // fill slot 0 to capacity
    Packed p;
    p.add(0, &seqs[0], 0, 8, sh, rng);
    REQUIRE(p.run(cache, sh, dense).is_ok());
  }
  const auto before = state_of(cache);
  Packed both;
  both.add(1, &seqs[1], 0, 1, sh, rng);
  both.add(0, &seqs[0], 8, 1, sh, rng);
  const Status s = both.run(cache, sh, dense);
  CHECK(s.code() == StatusCode::kOutOfRange);
  CHECK(s.message().find("row 1 (slot 0") != std::string::npos);
  CHECK(state_of(cache) == before);  // validation first: slot 1 did not advance either
  for (int t = 0; t < 7; ++t) {      // slot 1 alone keeps going
    Packed one;
    one.add(1, &seqs[1], t, 1, sh, rng);
    REQUIRE(one.run(cache, sh, dense).is_ok());
  }
  CHECK(cache.position(1) == 7);
  const Slots s0{0};
  REQUIRE(kua::reset_slots(kvmem::host::Executor{}, cache, list(s0)).is_ok());
  Packed again;
  again.add(0, &seqs[0], 0, 1, sh, rng);
  again.add(1, &seqs[1], 7, 1, sh, rng);
  CHECK(again.run(cache, sh, dense).is_ok());
  CHECK(cache.position(0) == 1);
  CHECK(cache.position(1) == 8);
}

TEST_CASE("slots: bad rows, shapes and values are refused before any change", "[ua][slots]") {
  const Shape sh;
  const Seq s = random_seq(20, 41);
  kua::PrunedCache<float> cache(kua::CacheShape{3, sh.H, sh.G, sh.D, 64, 16});
  std::mt19937_64 rng(2);
  const kua::Options opt{0.05, 64, true};
  {
    Packed p;
    p.add(1, &s, 0, 5, sh, rng);
    REQUIRE(p.run(cache, sh, opt).is_ok());
  }
  kua::PrunedCache<float> twin = cache;
  const auto refused = [&](Packed& p, const kua::Options& o, StatusCode code) {
    const Status st = p.run(cache, sh, o);
    INFO(st.to_string());
    CHECK(st.code() == code);
    CHECK(state_of(cache) == state_of(twin));
  };
  Packed bad_slot;
  bad_slot.add(0, &s, 0, 1, sh, rng);
  bad_slot.add(3, &s, 1, 1, sh, rng);
  refused(bad_slot, opt, StatusCode::kOutOfRange);
  Packed negative;
  negative.add(-2, &s, 0, 1, sh, rng);
  refused(negative, opt, StatusCode::kOutOfRange);
  Packed twice;
  twice.add(1, &s, 5, 1, sh, rng);
  twice.add(1, &s, 6, 1, sh, rng);
  refused(twice, opt, StatusCode::kInvalidArgument);
  Packed short_rows;
  short_rows.add(1, &s, 5, 2, sh, rng);
  short_rows.query_start.back() = 1;  // query_start[rows] != tokens
  refused(short_rows, opt, StatusCode::kInvalidArgument);
  Packed nan;
  nan.add(2, &s, 0, 1, sh, rng);
  nan.add(1, &s, 5, 3, sh, rng);
  nan.k[5] = std::nanf("");
  refused(nan, opt, StatusCode::kInvalidArgument);
  Packed fine;
  fine.add(1, &s, 5, 1, sh, rng);
  refused(fine, kua::Options{1.5, 64, true}, StatusCode::kInvalidArgument);
  // an output of the wrong shape
  const Status st = kua::step(kvmem::host::Executor{}, cache, fine.rows(), fine.inputs(sh), opt,
                              TensorView<float, 3>(fine.out.data(), {1, sh.G, sh.D}));
  CHECK(st.code() == StatusCode::kInvalidArgument);
  CHECK(state_of(cache) == state_of(twin));
  // an empty batch is a no-op
  Packed none;
  CHECK(none.run(cache, sh, opt).is_ok());
  CHECK(state_of(cache) == state_of(twin));
}

TEST_CASE("slots: max_query_len refuses a row over it; a bound that holds changes nothing", "[ua][slots]") {
  const Shape sh;
  const Seq s = random_seq(40, 43);
  kua::PrunedCache<float> cache(kua::CacheShape{3, sh.H, sh.G, sh.D, 64, 16});
  kua::PrunedCache<float> twin = cache;
  std::mt19937_64 rng(3);
  const kua::Options opt{0.05, 8, true};
  const auto batch = [&](std::int64_t bound) {  // 17 tokens, a padding row of 30, a decode token
    Packed p;
    p.add(0, &s, 0, 17, sh, rng);
    p.add(-1, nullptr, 0, 30, sh, rng);
    p.add(2, &s, 0, 1, sh, rng);
    p.max_query_len = bound;
    return p;
  };
  Packed over = batch(16);
  const Status st = over.run(cache, sh, opt);
  INFO(st.to_string());
  CHECK(st.code() == StatusCode::kInvalidArgument);
  CHECK(st.message().find("row 0: 17") != std::string::npos);
  CHECK(state_of(cache) == state_of(twin));
  Packed with = batch(17), without = batch(0);
  REQUIRE(with.run(cache, sh, opt).is_ok());
  REQUIRE(without.run(twin, sh, opt).is_ok());
  CHECK(same_bits(with.out, without.out));
  CHECK(same_bits(with.lse, without.lse));
  CHECK(state_of(cache) == state_of(twin));
}

// ---- slot operations -----------------------------------------------------------------------------

TEST_CASE("slots: copy_slots forks a slot that continues bit for bit like its source", "[ua][slots]") {
  const Shape sh;
  const Seq s = random_seq(200, 51);
  kua::PrunedCache<kvmem::bf16> cache(kua::CacheShape{4, sh.H, sh.G, sh.D, 200, 16});
  const kua::Options opt{0.05, 64, true};
  const auto first = side_by_side(cache, {s}, {{150}}, opt);
  const Slots src{0, 0}, dst{2, 3};
  REQUIRE(kua::copy_slots(kvmem::host::Executor{}, cache, list(src), list(dst)).is_ok());
  CHECK(export_record(cache, 2) == export_record(cache, 0));
  // continue slot 0 and its copy in slot 3 with the same tokens, in one step each row
  std::mt19937_64 rng(3);
  for (std::int64_t t = 150; t < 200; t += 10) {
    Packed p;
    p.add(3, &s, t, 10, sh, rng);
    p.add(0, &s, t, 10, sh, rng);
    REQUIRE(p.run(cache, sh, opt).is_ok());
    CHECK(std::equal(p.out.begin(), p.out.begin() + 10 * sh.H * sh.D, p.out.begin() + 10 * sh.H * sh.D));
  }
  CHECK(export_record(cache, 3) == export_record(cache, 0));
  // refused pairs leave the cache untouched
  const auto before = state_of(cache);
  const Slots bad_src{0, 1}, bad_dst{1, 2};  // 1 is a destination and a source
  CHECK(kua::copy_slots(kvmem::host::Executor{}, cache, list(bad_src), list(bad_dst)).code() ==
        StatusCode::kInvalidArgument);
  const Slots out_of_range{4};
  CHECK(kua::copy_slots(kvmem::host::Executor{}, cache, list(src), list(out_of_range)).code() ==
        StatusCode::kInvalidArgument);
  CHECK(kua::copy_slots(kvmem::host::Executor{}, cache, list(out_of_range), list(out_of_range)).code() ==
        StatusCode::kOutOfRange);
  CHECK(state_of(cache) == before);
}

TEST_CASE("slots: export -> import continues bitwise; a record that differs is refused, naming the field",
          "[ua][slots]") {
  const Shape sh;
  const Seq s = random_seq(260, 61);
  const kua::Options opt{0.05, 64, false};
  kua::PrunedCache<kvmem::bf16> a(kua::CacheShape{2, sh.H, sh.G, sh.D, 260, 16});
  (void)side_by_side(a, {random_seq(30, 62), s}, {{30}, {200}}, opt);
  const auto rec = export_record(a, 1);
  CHECK(rec.size() == kua::export_bytes(a, 1));
  // into slot 2 of another cache with a different slot count and capacity
  kua::PrunedCache<kvmem::bf16> b(kua::CacheShape{3, sh.H, sh.G, sh.D, 120, 16});
  REQUIRE(kua::import_slot(kvmem::host::Executor{}, b, 2, rec).is_ok());
  CHECK(b.position(2) == 200);
  CHECK(export_record(b, 2) == rec);
  std::mt19937_64 rng(4);
  for (std::int64_t t = 200; t < 260; t += (t % 3 == 0 ? 1 : 7)) {
    const std::int64_t T = std::min<std::int64_t>(t % 3 == 0 ? 1 : 7, 260 - t);
    Packed pa, pb;
    pa.add(1, &s, t, T, sh, rng);
    pb.add(2, &s, t, T, sh, rng);
    REQUIRE(pa.run(a, sh, opt).is_ok());
    REQUIRE(pb.run(b, sh, opt).is_ok());
    CHECK(same_bits(pa.out, pb.out));
    CHECK(same_bits(pa.lse, pb.lse));
    if (t % 3 != 0) t += T - 7;
  }
  CHECK(export_record(a, 1) == export_record(b, 2));

  const auto refused = [&](auto& cache, std::span<const std::byte> bytes, const std::string& names) {
    const auto before = state_of(cache);
    const Status st = kua::import_slot(kvmem::host::Executor{}, cache, 0, bytes);
    INFO(st.to_string());
    CHECK(!st.is_ok());
    CHECK(st.message().find(names) != std::string::npos);
    CHECK(state_of(cache) == before);
  };
  auto version = rec;
  version[8] = std::byte{7};
  refused(b, version, "version");
  auto mechanism = rec;
  mechanism[12] = std::byte{1};
  refused(b, mechanism, "mechanism");
  refused(b, std::span<const std::byte>(rec).first(rec.size() - 3), "truncated");
  auto longer = rec;
  longer.push_back(std::byte{0});
  refused(b, longer, "bytes");
  kua::PrunedCache<kvmem::bf16> other_heads(kua::CacheShape{1, 2 * sh.H, sh.G, sh.D, 260, 16});
  refused(other_heads, rec, "query_heads");
  kua::PrunedCache<kvmem::bf16> other_dim(kua::CacheShape{1, sh.H, sh.G, 2 * sh.D, 260, 16});
  refused(other_dim, rec, "head_dim");
  kua::PrunedCache<float> other_storage(kua::CacheShape{1, sh.H, sh.G, sh.D, 260, 16});
  refused(other_storage, rec, "storage");
  std::int64_t most = 0;
  for (std::int64_t g = 0; g < sh.G; ++g) most = std::max(most, a.length(1, g));
  REQUIRE(most > 1);
  kua::PrunedCache<kvmem::bf16> small(kua::CacheShape{1, sh.H, sh.G, sh.D, most - 1, 16});
  refused(small, rec, "capacity");
  // a field's content: λ > 0 is no λ of spec UA.md 4.2 (find the first λ in the record and corrupt it)
  auto lambda = rec;
  const std::string name = "lambda";
  const auto at = std::search(lambda.begin(), lambda.end(), reinterpret_cast<const std::byte*>(name.data()),
                              reinterpret_cast<const std::byte*>(name.data()) + name.size());
  REQUIRE(at != lambda.end());
  const float positive = 1.0f;
  std::memcpy(&*(at + std::ptrdiff_t(name.size() + 1 + 8)), &positive, sizeof positive);
  refused(b, lambda, "lambda");
  // bad slots and empty caches
  CHECK(kua::export_bytes(a, 2) == 0);
  CHECK(kua::export_bytes(a, -1) == 0);
  std::vector<std::byte> buf(rec.size());
  CHECK(kua::export_slot(kvmem::host::Executor{}, a, 2, buf).code() == StatusCode::kOutOfRange);
  CHECK(kua::export_slot(kvmem::host::Executor{}, a, 1, std::span<std::byte>(buf).first(10)).code() ==
        StatusCode::kOutOfRange);
  CHECK(kua::import_slot(kvmem::host::Executor{}, b, 3, rec).code() == StatusCode::kOutOfRange);
}

TEST_CASE("slots: truncate is exact for none or all of a slot's tokens and refused otherwise", "[ua][slots]") {
  const Shape sh;
  const Seq s = random_seq(100, 71);
  kua::PrunedCache<float> cache(kua::CacheShape{2, sh.H, sh.G, sh.D, 100, 16});
  const kua::Options opt{0.05, 64, true};
  (void)side_by_side(cache, {random_seq(10, 72), s}, {{10}, {60, 1, 1}}, opt);
  const kvmem::host::Executor exec;
  const auto before = state_of(cache);
  CHECK(kua::truncate(exec, cache, 1, 0).is_ok());
  CHECK(state_of(cache) == before);
  for (std::int64_t n : {1, 2, 61}) {
    const Status st = kua::truncate(exec, cache, 1, n);
    INFO(st.to_string());
    CHECK(st.code() == StatusCode::kUnsupported);
    CHECK(st.message().find("λ") != std::string::npos);
    CHECK(state_of(cache) == before);
  }
  CHECK(kua::truncate(exec, cache, 1, 63).code() == StatusCode::kOutOfRange);
  CHECK(kua::truncate(exec, cache, 1, -1).code() == StatusCode::kOutOfRange);
  CHECK(kua::truncate(exec, cache, 2, 0).code() == StatusCode::kOutOfRange);
  CHECK(state_of(cache) == before);
  // all 62 tokens: the slot is as new, and runs the sequence again exactly like a fresh cache
  REQUIRE(kua::truncate(exec, cache, 1, 62).is_ok());
  CHECK(cache.position(1) == 0);
  CHECK(cache.position(0) == 10);
  std::mt19937_64 rng(5);
  Packed p;
  p.add(1, &s, 0, 100, sh, rng);
  REQUIRE(p.run(cache, sh, opt).is_ok());
  CHECK(same_bits(p.out, run_alone<float>(s, sh, {100}, opt, 100)));
}

// ---- safety --------------------------------------------------------------------------------------

TEST_CASE("slots: empty and moved-from caches refuse every operation; bad slot indices leave the cache untouched",
          "[ua][slots]") {
  const Shape sh;
  const Seq s = random_seq(30, 81);
  const kua::Options opt{0.05, 64, true};
  const kvmem::host::Executor exec;
  kua::PrunedCache<float> live(kua::CacheShape{2, sh.H, sh.G, sh.D, 64, 16});
  (void)side_by_side(live, {s}, {{20}}, opt);
  const auto snapshot = state_of(live);
  kua::PrunedCache<float> moved(std::move(live));
  CHECK(state_of(moved) == snapshot);  // the new owner has everything
  kua::PrunedCache<float> assigned;
  assigned = std::move(moved);
  CHECK(state_of(assigned) == snapshot);
  kua::PrunedCache<float> never;
  for (auto* empty : {&live, &moved, &never}) {
    CHECK(!empty->valid());
    CHECK(empty->max_slots() == 0);
    CHECK(empty->position(0) == 0);  // the segfault of issue 22
    CHECK(empty->length(0, 0) == 0);
    CHECK(empty->positions(0, 0) == nullptr);
    CHECK(empty->freed_rows(0, 0) == 0);
    CHECK(empty->max_length() == 0);
    CHECK(kua::report(*empty).empty());
    CHECK(!empty->reset_sequence(0).is_ok());
    std::mt19937_64 rng(6);
    Packed p;
    p.add(0, &s, 0, 1, sh, rng);
    CHECK(!p.run(*empty, sh, opt).is_ok());
    std::vector<float> out(std::size_t(sh.H * sh.D));
    CHECK(!kua::decode(exec, *empty, batch_view(s, sh, 0, 1), opt, TensorView<float, 4>(out.data(), {1, 1, sh.H, sh.D}))
               .is_ok());
    const Slots zero{0};
    CHECK(!kua::reset_slots(exec, *empty, list(zero)).is_ok());
    CHECK(!kua::copy_slots(exec, *empty, list(zero), list(zero)).is_ok());
    CHECK(kua::export_bytes(*empty, 0) == 0);
    std::vector<std::byte> buf(64);
    CHECK(!kua::export_slot(exec, *empty, 0, buf).is_ok());
    CHECK(!kua::import_slot(exec, *empty, 0, export_record(assigned, 0)).is_ok());
    CHECK(!kua::truncate(exec, *empty, 0, 0).is_ok());
    CHECK(!empty->valid());
  }
  // a moved-from cache can be given a new cache
  REQUIRE(kua::PrunedCache<float>::create(kua::CacheShape{1, sh.H, sh.G, sh.D, 8, 16}, live).is_ok());
  CHECK(live.max_slots() == 1);
  // bad slot indices on a live cache: a Status, and the cache equals a twin that never saw the call
  const kua::PrunedCache<float> twin = assigned;
  CHECK(assigned.reset_sequence(2).code() == StatusCode::kOutOfRange);
  CHECK(assigned.reset_sequence(-1).code() == StatusCode::kOutOfRange);
  const Slots bad{0, 2};
  CHECK(kua::reset_slots(exec, assigned, list(bad)).code() == StatusCode::kOutOfRange);
  CHECK(kua::truncate(exec, assigned, -1, 0).code() == StatusCode::kOutOfRange);
  CHECK(kua::truncate(exec, assigned, 2, 0).code() == StatusCode::kOutOfRange);
  const Slots zero{0}, two{2}, minus{-1};
  CHECK(kua::copy_slots(exec, assigned, list(zero), list(two)).code() == StatusCode::kOutOfRange);
  CHECK(kua::copy_slots(exec, assigned, list(minus), list(zero)).code() == StatusCode::kOutOfRange);
  const auto record = export_record(assigned, 0);
  CHECK(kua::import_slot(exec, assigned, 2, record).code() == StatusCode::kOutOfRange);
  CHECK(kua::import_slot(exec, assigned, -1, record).code() == StatusCode::kOutOfRange);
  std::vector<std::byte> out_bytes(record.size());
  CHECK(kua::export_slot(exec, assigned, 2, out_bytes).code() == StatusCode::kOutOfRange);
  {
    std::mt19937_64 rng(9);
    Packed p;
    p.add(0, &s, 20, 1, sh, rng);
    p.add(2, &s, 21, 1, sh, rng);  // the second row names a slot the cache does not have
    CHECK(p.run(assigned, sh, opt).code() == StatusCode::kOutOfRange);
  }
  CHECK(assigned.position(2) == 0);
  CHECK(assigned.length(0, 2) == 0);
  CHECK(assigned.keys(-1, 0) == nullptr);
  CHECK(state_of(assigned) == state_of(twin));
  CHECK(assigned.reset_sequence(0).is_ok());
  CHECK(assigned.position(0) == 0);
}

TEST_CASE("slots: the composed ua::Attention steps like ua::step with its options", "[ua][slots]") {
  using Ua = kua::Attention<kvmem::decay::Universal, kvmem::prune::Threshold{0.05}, kvmem::precision::Bf16Storage>;
  const Shape sh;
  const Seq s = random_seq(90, 91);
  Ua::Cache a(kua::CacheShape{2, sh.H, sh.G, sh.D, 90, 16}), b(a.shape());
  std::mt19937_64 rng(8);
  for (std::int64_t t0 : {0, 70, 71}) {
    const std::int64_t T = t0 == 0 ? 70 : 1;
    Packed p, q;
    p.add(1, &s, t0, T, sh, rng);
    q.add(1, &s, t0, T, sh, rng);
    REQUIRE(p.run(a, sh, kua::Options{0.05, 32, true}).is_ok());
    q.out.assign(p.out.size(), 0.0f);
    q.lse.assign(p.lse.size(), 0.0f);
    REQUIRE(Ua::step(kvmem::host::Executor{}, b, q.rows(), q.inputs(sh),
                     TensorView<float, 3>(q.out.data(), {T, sh.H, sh.D}), TensorView<float, 2>(q.lse.data(), {T, sh.H}),
                     32)
                .is_ok());
    CHECK(same_bits(p.out, q.out));
    CHECK(same_bits(p.lse, q.lse));
  }
  CHECK(state_of(a) == state_of(b));
}
