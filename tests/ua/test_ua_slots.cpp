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
    const Status st = T == 1 ? kua::decode(kvmem::host::Executor{1}, cache, batch_view(s, sh, t0, T), opt, o)
                             : kua::prefill(kvmem::host::Executor{1}, cache, batch_view(s, sh, t0, T), opt, o);
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
  // Appends a row of tokens [t0, t0+T) of s (or T garbage tokens for a padding row when s is null).
  void add(std::int32_t slot_index, const Seq* s, std::int64_t t0, std::int64_t T, const Shape& sh, std::mt19937_64& rng) {
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
  Rows rows() const { return {list(slot), {query_start.data(), {std::int64_t(query_start.size())}}}; }
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
  // lse of the whole schedule equals each sequence's lse from a one-slot step run (same rows), bitwise.
  for (std::size_t i = 0; i < all.size(); i += 3) {
    const Live& x = all[i];
    kua::PrunedCache<Storage> one(kua::CacheShape{1, H, G, D, capacity, 16});
    std::int64_t t0 = 0;
    for (auto T : x.history) {
      Packed p;
      p.add(0, &x.data, t0, T, sh, rng);
      REQUIRE(p.run(one, sh, opt, 1).is_ok());
      CHECK(std::equal(p.lse.begin(), p.lse.end(), x.lse.begin() + t0 * H,
                       [](float a, float b) { return std::bit_cast<std::uint32_t>(a) == std::bit_cast<std::uint32_t>(b); }));
      t0 += T;
    }
  }
  return st;
}

void report(const ScheduleStats& s) {
  INFO("sequences " << s.sequences << ", steps " << s.steps << " (" << s.mixed_steps << " mixing prefill and decode rows), forks "
                    << s.forks << ", migrations " << s.migrations << ", truncations exact " << s.truncations_exact
                    << " / refused " << s.truncations_refused << ", padding rows " << s.padding_rows << ", lengths "
                    << s.min_len << ".." << s.max_len);
  CHECK(s.sequences >= 32);
  CHECK(s.max_len == 3000);
  CHECK(s.min_len == 1);
  CHECK(s.mixed_steps > 0);
  CHECK(s.forks > 0);
  CHECK(s.migrations > 0);
  CHECK(s.truncations_exact > 0);
  CHECK(s.truncations_refused > 0);
  CHECK(s.padding_rows > 0);
}

}  // namespace

TEST_CASE("slots: continuous batching of 32+ sequences in 16 slots equals each sequence run alone, bitwise", "[ua][slots]") {
  SECTION("fp32, pruning p = 0.05") {
    const auto s = continuous_batching<float>(1, kua::Options{0.05, 64, true}, 34, 3000, 16);
    report(s);
    CHECK(s.evicted > 0);
  }
  SECTION("bf16, pruning p = 0.05, evicting after attention") {
    const auto s = continuous_batching<kvmem::bf16>(2, kua::Options{0.05, 96, false}, 33, 3000, 16);
    report(s);
    CHECK(s.evicted > 0);
  }
  SECTION("fp32, dense (p = 0)") {
    const auto s = continuous_batching<float>(3, kua::Options{0.0, 128, true}, 32, 3000, 16);
    report(s);
    CHECK(s.evicted == 0);
  }
  SECTION("bf16, dense (p = 0)") {
    const auto s = continuous_batching<kvmem::bf16>(4, kua::Options{0.0, 64, true}, 32, 3000, 16);
    report(s);
    CHECK(s.evicted == 0);
  }
}
