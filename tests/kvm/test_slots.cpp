// SPDX-License-Identifier: Apache-2.0
// KVM sequence slots on the host backend (DESIGN.md 3, docs/slots.md): the ragged step, the slot
// operations and the safety of empty states. The oracle of every step is the same sequence run
// alone with prefill on a one-slot state (bitwise: the host driver runs the same operations in the
// same order); lse is checked against the fp64 reference.
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <span>
#include <string>
#include <vector>

#include <catch2/catch.hpp>

#include "kvm_host_util.hpp"
#include "kvm_step_support.hpp"

namespace {
// A ragged row equals its sequence run alone bit for bit on the exact path; the fast path's tile
// products depend on how many query rows a segment holds, so there the two agree within fp32 rounding.
kvmem::host::Executor exact_exec(int threads) {
  return {.threads = threads, .exact = true};
}
}  // namespace

namespace {

using namespace kvmem::test;
using kvmem::Rows;
using kvmem::Status;
using kvmem::StatusCode;
using kvmem::TensorView;
namespace kvm = kvmem::kvm;
using I32View = TensorView<const std::int32_t, 1>;

// Dims (GQA 4 over 2, D 8), make_params and the seeded weights are the memory tests' (kvm_step_support.hpp).
using kvmem::test::kvm_mem::Dims;
using kvmem::test::kvm_mem::make_params;
using RandomWeights = kvmem::test::kvm_mem::Weights;

// One token of a sequence, token-major: q [Hq,D], k [Hk,D], v [Hk,Dv], g [Hk].
struct Tok {
  std::vector<float> q, k, v, g;
};
Tok random_tok(const Dims& d, std::mt19937_64& rng) {
  std::normal_distribution<float> n01(0.f, 1.f);
  Tok t;
  for (std::int64_t i = 0; i < d.Hq * d.D; ++i) t.q.push_back(n01(rng));
  for (std::int64_t i = 0; i < d.Hk * d.D; ++i) t.k.push_back(n01(rng));
  for (std::int64_t i = 0; i < d.Hk * d.Dv; ++i) t.v.push_back(n01(rng));
  for (std::int64_t i = 0; i < d.Hk; ++i) {
    const float x = n01(rng);
    t.g.push_back(x > 0 ? 1.f + x : std::exp(x));  // 1 + elu
  }
  return t;
}

// Packed inputs of one step.
struct Batch {
  std::vector<std::int32_t> slot, start{0};
  std::vector<float> q, k, v, g, out, lse;
  std::int64_t max_query_len = 0;  // Rows::max_query_len
  void add(std::int32_t s, const std::vector<Tok>& toks, std::int64_t from, std::int64_t to) {
    slot.push_back(s);
    for (std::int64_t i = from; i < to; ++i) {
      const Tok& t = toks[std::size_t(i)];
      q.insert(q.end(), t.q.begin(), t.q.end());
      k.insert(k.end(), t.k.begin(), t.k.end());
      v.insert(v.end(), t.v.begin(), t.v.end());
      g.insert(g.end(), t.g.begin(), t.g.end());
    }
    start.push_back(start.back() + std::int32_t(to - from));
  }
  std::int64_t tokens() const { return start.back(); }
  Status run(kvm::State<kvmem::bf16, float>& st, const kvm::Weights& w, const Dims& d) { return run_any(st, w, d); }
  Status run(kvm::State<float, float>& st, const kvm::Weights& w, const Dims& d) { return run_any(st, w, d); }
  Status run(kvm::State<kvmem::e4m3, float>& st, const kvm::Weights& w, const Dims& d) { return run_any(st, w, d); }
  template <class S>
  Status run_any(kvm::State<S, float>& st, const kvm::Weights& w, const Dims& d, int threads = 2) {
    const std::int64_t T = tokens();
    out.assign(std::size_t(T * d.Hq * d.Dv), -7.f);
    lse.assign(std::size_t(T * d.Hq), -7.f);
    const Rows rows{I32View(slot.data(), {std::int64_t(slot.size())}),
                    I32View(start.data(), {std::int64_t(start.size())}), max_query_len};
    return kvm::step(exact_exec(threads), st, w, rows, TensorView<const float, 3>(q.data(), {T, d.Hq, d.D}),
                     TensorView<const float, 3>(k.data(), {T, d.Hk, d.D}),
                     TensorView<const float, 3>(v.data(), {T, d.Hk, d.Dv}),
                     TensorView<const float, 2>(g.data(), {T, d.Hk}), TensorView<float, 3>(out.data(), {T, d.Hq, d.Dv}),
                     TensorView<float, 2>(lse.data(), {T, d.Hq}));
  }
};

// The oracle: the sequence alone, one prefill call on a one-slot state. out [T,Hq,Dv].
template <class S>
std::vector<float> alone_prefill(const kvm::Params& p, const Dims& d, std::int64_t n_ctx, const kvm::Weights& w,
                                 const std::vector<Tok>& toks) {
  const std::int64_t T = std::int64_t(toks.size());
  kvm::State<S, float> st;
  REQUIRE(kvm::State<S, float>::create(p, {1, d.Hq, d.Hk, d.D, d.Dv, n_ctx}, st).is_ok());
  std::vector<float> q(std::size_t(d.Hq * T * d.D)), k(std::size_t(d.Hk * T * d.D)), v(std::size_t(d.Hk * T * d.Dv)),
      g(std::size_t(d.Hk * T)), out(std::size_t(T * d.Hq * d.Dv), -7.f);
  for (std::int64_t t = 0; t < T; ++t) {  // token-major -> [1,H,T,*]
    const Tok& x = toks[std::size_t(t)];
    for (std::int64_t h = 0; h < d.Hq; ++h)
      for (std::int64_t e = 0; e < d.D; ++e) q[std::size_t((h * T + t) * d.D + e)] = x.q[std::size_t(h * d.D + e)];
    for (std::int64_t h = 0; h < d.Hk; ++h) {
      for (std::int64_t e = 0; e < d.D; ++e) k[std::size_t((h * T + t) * d.D + e)] = x.k[std::size_t(h * d.D + e)];
      for (std::int64_t e = 0; e < d.Dv; ++e) v[std::size_t((h * T + t) * d.Dv + e)] = x.v[std::size_t(h * d.Dv + e)];
      g[std::size_t(h * T + t)] = x.g[std::size_t(h)];
    }
  }
  const Status s = kvm::prefill(
      exact_exec(2), st, w, TensorView<const float, 4>(q.data(), {1, d.Hq, T, d.D}),
      TensorView<const float, 4>(k.data(), {1, d.Hk, T, d.D}), TensorView<const float, 4>(v.data(), {1, d.Hk, T, d.Dv}),
      TensorView<const float, 3>(g.data(), {1, d.Hk, T}), TensorView<float, 4>(out.data(), {1, T, d.Hq, d.Dv}));
  INFO(s.to_string());
  REQUIRE(s.is_ok());
  return out;
}

// lse of the sequence alone (a one-row step on a one-slot state), [T,Hq]; its out must equal prefill's.
template <class S>
std::vector<float> alone_lse(const kvm::Params& p, const Dims& d, std::int64_t n_ctx, const kvm::Weights& w,
                             const std::vector<Tok>& toks, const std::vector<float>& prefill_out) {
  kvm::State<S, float> st;
  REQUIRE(kvm::State<S, float>::create(p, {1, d.Hq, d.Hk, d.D, d.Dv, n_ctx}, st).is_ok());
  Batch b;
  b.add(0, toks, 0, std::int64_t(toks.size()));
  REQUIRE(b.run_any(st, w, d, 1).is_ok());
  CHECK(std::memcmp(b.out.data(), prefill_out.data(), b.out.size() * sizeof(float)) == 0);
  return b.lse;
}

bool same_bits(float a, float b) {
  return std::memcmp(&a, &b, sizeof a) == 0;
}

template <class S>
std::vector<std::byte> export_of(const kvm::State<S, float>& st, std::int32_t slot) {
  std::vector<std::byte> bytes(kvm::export_bytes(st, slot));
  REQUIRE(kvm::export_slot(exact_exec(1), st, slot, std::span<std::byte>(bytes)).is_ok());
  return bytes;
}

// Canonical contents (counters and records of every slot) of two states are equal.
template <class S>
void require_same_state(const kvm::State<S, float>& a, const kvm::State<S, float>& b) {
  REQUIRE(a.max_slots() == b.max_slots());
  for (std::int32_t s = 0; s < a.max_slots(); ++s) {
    INFO("slot " << s);
    REQUIRE(a.tokens(s) == b.tokens(s));
    REQUIRE(a.covered(s) == b.covered(s));
    REQUIRE(a.slots(s) == b.slots(s));
    REQUIRE(export_of(a, s) == export_of(b, s));
  }
}

// Whether truncating n of n_old tokens can be exact, from the spec's schedule (4.1, 4.3, 4.5, 4.7):
// no update ran at a token count in (n_new, n_old] (updates run when n = (nb+u) C + 1, u >= 1), and
// the positions the next token and the next update read are still in the window of n_old.
bool truncate_exact(std::int64_t C, std::int64_t nb, std::int64_t n_old, std::int64_t n) {
  const std::int64_t n_new = n_old - n;
  if (n == 0 || n_new == 0) return true;
  for (std::int64_t u = 1; (nb + u) * C + 1 <= n_old; ++u)
    if ((nb + u) * C + 1 > n_new) return false;
  const auto begin = [&](std::int64_t m) { return std::max<std::int64_t>(0, (m + C - 1) / C * C - nb * C); };
  std::int64_t first_read = begin(n_new + 1);  // window of the query at position n_new
  if (n_new >= C) first_read = std::min(first_read, std::max(C, begin(n_new)));  // the next update's tokens
  return first_read >= begin(n_old);
}

// ---- the continuous-batching property (issue 22) ----------------------------------------------------

struct Seq {
  std::vector<Tok> toks;        // every token fed so far (the sequence's content)
  std::int64_t target = 0;      // leaves at this length
  std::int64_t prompt = 0;      // tokens fed in prefill chunks before decode
  std::vector<float> out, lse;  // [pos, Hq, Dv], [pos, Hq]: latest result per position
  std::vector<char> has;        // produced by this sequence's own rows (not inherited by a fork)
  std::int32_t slot = -1;
};

template <class S>
void continuous_batching(kvmem::budget::Any budget, std::uint64_t seed, int sequences, std::int64_t max_len) {
  const Dims d;
  const std::int64_t C = 16, kSlots = 16, n_ctx = max_len + 64;
  const kvm::Params p = make_params(C, budget);
  const RandomWeights rw(d, seed);
  const kvm::Weights w = rw.view();
  kvm::State<S, float> st;
  REQUIRE(kvm::State<S, float>::create(p, {kSlots, d.Hq, d.Hk, d.D, d.Dv, n_ctx}, st).is_ok());
  REQUIRE(st.max_slots() == kSlots);
  std::mt19937_64 rng(seed);
  const auto uni = [&](std::int64_t a, std::int64_t b) {
    return std::uniform_int_distribution<std::int64_t>(a, b)(rng);
  };
  std::vector<Seq> seqs;
  std::vector<std::int32_t> owner(std::size_t(kSlots), -1);  // seq index per slot
  int created = 0, finished = 0, forks = 0, truncations = 0, refused = 0, resets = 0, steps = 0, migrations = 0,
      mixed_steps = 0;
  std::int64_t min_len = max_len;
  std::int64_t checked_rows = 0;
  const auto new_len = [&]() -> std::int64_t {
    const std::int64_t r = uni(0, 7);
    return r < 2 ? uni(1, 48) : r < 6 ? uni(49, 700) : uni(701, max_len);
  };
  bool failed = false;
  const auto finish = [&](std::int32_t si) {  // compare with the sequence alone, then free its slot
    Seq& s = seqs[std::size_t(si)];
    if (!s.toks.empty() && !failed) {
      const auto ref = alone_prefill<S>(p, d, n_ctx, w, s.toks);
      const auto ref_lse = alone_lse<S>(p, d, n_ctx, w, s.toks, ref);
      const std::int64_t Q = d.Hq * d.Dv;
      for (std::size_t t = 0; t < s.toks.size() && !failed; ++t) {
        if (!s.has[t]) continue;
        ++checked_rows;
        for (std::int64_t i = 0; i < Q; ++i)
          if (!same_bits(s.out[t * Q + i], ref[t * Q + i])) {
            FAIL_CHECK("sequence " << si << " position " << t << " out[" << i << "] " << s.out[t * Q + i]
                                   << " != alone " << ref[t * Q + i]);
            failed = true;
            break;
          }
        for (std::int64_t h = 0; h < d.Hq; ++h)
          if (!same_bits(s.lse[t * d.Hq + h], ref_lse[t * d.Hq + h])) {
            FAIL_CHECK("sequence " << si << " position " << t << " lse[" << h << "] differs");
            failed = true;
            break;
          }
      }
    }
    owner[std::size_t(s.slot)] = -1;
    s.slot = -1;
    ++finished;
  };
  const auto record_len = [&](Seq& s) {
    const std::size_t n = s.toks.size();
    s.out.resize(n * std::size_t(d.Hq * d.Dv));
    s.lse.resize(n * std::size_t(d.Hq));
    s.has.resize(n, 0);
  };

  std::int64_t max_seen = 0;
  while (created < sequences || finished < created) {
    // join: new sequences take free slots
    for (std::int32_t sl = 0; sl < kSlots && created < sequences; ++sl)
      if (owner[std::size_t(sl)] < 0 && uni(0, 2) > 0) {
        Seq s;
        // the first one has the full length, the second a single token
        s.target = created == 0 ? max_len : created == 1 ? 1 : new_len();
        s.prompt = s.target - uni(0, std::min<std::int64_t>(s.target, 120));  // then up to 120 decode steps
        s.slot = sl;
        REQUIRE(st.tokens(sl) == 0);
        owner[std::size_t(sl)] = std::int32_t(seqs.size());
        seqs.push_back(std::move(s));
        ++created;
      }
    // one step: some active sequences (a prefill chunk or one decode token each) and padding rows
    struct Plan {
      std::int32_t seq, slot;
      std::int64_t from, to;
    };
    std::vector<Plan> plan;
    bool prefill_row = false, decode_row = false;
    for (std::int32_t sl = 0; sl < kSlots; ++sl) {
      const std::int32_t si = owner[std::size_t(sl)];
      if (si < 0 || uni(0, 9) == 0) continue;  // a slot may sit out a step
      Seq& s = seqs[std::size_t(si)];
      const std::int64_t n = std::int64_t(s.toks.size());
      const std::int64_t len = n < s.prompt ? std::min(s.prompt - n, uni(1, 3 * C + 5)) : (uni(0, 7) == 0 ? 0 : 1);
      const std::int64_t to = std::min(n + len, s.target);
      (to - n == 1 ? decode_row : prefill_row) |= to - n >= 1;
      while (std::int64_t(s.toks.size()) < to) s.toks.push_back(random_tok(d, rng));
      record_len(s);
      plan.push_back({si, sl, n, to});
    }
    for (std::int64_t i = uni(0, 2); i > 0; --i) plan.push_back({-1, -1, 0, uni(0, 3)});
    std::shuffle(plan.begin(), plan.end(), rng);
    Batch b;
    std::vector<Tok> pad;
    for (const Plan& pl : plan) {
      if (pl.seq < 0) {  // padding: NaN inputs, which the step must not read
        Tok nan_tok = random_tok(d, rng);
        for (auto* x : {&nan_tok.q, &nan_tok.k, &nan_tok.v, &nan_tok.g}) std::fill(x->begin(), x->end(), std::nanf(""));
        pad.assign(std::size_t(pl.to), nan_tok);
        b.add(-1, pad, 0, pl.to);
      } else {
        b.add(pl.slot, seqs[std::size_t(pl.seq)].toks, pl.from, pl.to);
      }
    }
    const Status status = b.run(st, w, d);
    INFO(status.to_string());
    REQUIRE(status.is_ok());
    ++steps;
    mixed_steps += prefill_row && decode_row;
    for (std::size_t r = 0; r < plan.size(); ++r) {
      const Plan& pl = plan[r];
      const std::int64_t t0 = b.start[r], t1 = b.start[r + 1];
      if (pl.seq < 0) {
        const auto zero = [](float x) { return x == 0.f; };
        REQUIRE(std::all_of(b.out.begin() + t0 * d.Hq * d.Dv, b.out.begin() + t1 * d.Hq * d.Dv, zero));
        REQUIRE(std::all_of(b.lse.begin() + t0 * d.Hq, b.lse.begin() + t1 * d.Hq, zero));
        continue;
      }
      Seq& s = seqs[std::size_t(pl.seq)];
      REQUIRE(st.tokens(pl.slot) == pl.to);
      max_seen = std::max(max_seen, pl.to);
      std::copy(b.out.begin() + t0 * d.Hq * d.Dv, b.out.begin() + t1 * d.Hq * d.Dv,
                s.out.begin() + pl.from * d.Hq * d.Dv);
      std::copy(b.lse.begin() + t0 * d.Hq, b.lse.begin() + t1 * d.Hq, s.lse.begin() + pl.from * d.Hq);
      std::fill(s.has.begin() + pl.from, s.has.begin() + pl.to, 1);
    }
    // slot operations between steps
    std::vector<std::int32_t> leaving;
    for (std::int32_t sl = 0; sl < kSlots; ++sl) {
      const std::int32_t si = owner[std::size_t(sl)];
      if (si < 0) continue;
      Seq& s = seqs[std::size_t(si)];
      const std::int64_t n = std::int64_t(s.toks.size());
      if (n >= s.target || (si != 0 && uni(0, 400) == 0)) {  // done, or leaves early (not the longest)
        min_len = std::min(min_len, n);
        leaving.push_back(sl);
        continue;
      }
      if (n > 0 && migrations < 10 && uni(0, 60) == 0) {  // migrate: export, import into a free slot, reset
        const auto free = std::find(owner.begin(), owner.end(), -1);
        if (free != owner.end()) {
          const std::int32_t dst = std::int32_t(free - owner.begin());
          const auto rec = export_of(st, sl);
          REQUIRE(kvm::import_slot(exact_exec(1), st, w, dst, std::span<const std::byte>(rec)).is_ok());
          REQUIRE(export_of(st, dst) == rec);
          REQUIRE(kvm::reset_slots(exact_exec(1), st, I32View(&sl, {1})).is_ok());
          owner[std::size_t(dst)] = si;
          owner[std::size_t(sl)] = -1;
          s.slot = dst;
          ++migrations;
          continue;
        }
      }
      if (n > 0 && forks < 12 && uni(0, 30) == 0) {  // fork into a free slot
        const auto free = std::find(owner.begin(), owner.end(), -1);
        if (free != owner.end()) {
          const std::int32_t dst = std::int32_t(free - owner.begin());
          REQUIRE(kvm::copy_slots(exact_exec(2), st, I32View(&sl, {1}), I32View(&dst, {1})).is_ok());
          Seq child;
          child.toks = s.toks;
          child.target = std::min(max_len, n + uni(1, 400));
          child.prompt = n + uni(0, 1) * uni(1, 100);
          child.slot = dst;
          child.has.assign(std::size_t(n), 0);  // positions before the fork are the parent's results
          record_len(child);
          owner[std::size_t(dst)] = std::int32_t(seqs.size());
          seqs.push_back(std::move(child));
          ++forks;
          ++created;
        }
      }
      if (n > 0 && uni(0, 12) == 0) {  // truncate: exact, or refused with the state untouched
        Seq& t = seqs[std::size_t(owner[std::size_t(sl)])];
        const std::int64_t cut = uni(1, std::min<std::int64_t>(n, 2 * C));
        const auto before = export_of(st, sl);
        const Status ts = kvm::truncate(exact_exec(1), st, sl, cut);
        INFO("truncate " << cut << " of " << n << ": " << ts.to_string());
        REQUIRE(ts.is_ok() == truncate_exact(C, 2, n, cut));
        if (ts.is_ok()) {
          t.toks.resize(std::size_t(n - cut));
          record_len(t);
          t.prompt = std::min(t.prompt, n - cut);
          REQUIRE(st.tokens(sl) == n - cut);
          ++truncations;
        } else {
          REQUIRE(ts.code() == StatusCode::kInvalidArgument);
          REQUIRE(export_of(st, sl) == before);
          ++refused;
        }
      }
    }
    for (std::int32_t sl : leaving) finish(owner[std::size_t(sl)]);
    if (!leaving.empty()) {
      REQUIRE(kvm::reset_slots(exact_exec(1), st, I32View(leaving.data(), {std::int64_t(leaving.size())})).is_ok());
      for (std::int32_t sl : leaving) REQUIRE(st.tokens(sl) == 0);
      ++resets;
    }
  }
  INFO("longest " << max_seen << " shortest " << min_len << " steps " << steps << " (" << mixed_steps
                  << " mixing prefill and decode rows) sequences " << created << " forks " << forks << " migrations "
                  << migrations << " truncations " << truncations << " refused " << refused << " rows checked "
                  << checked_rows);
  CHECK(created >= 32);
  CHECK(min_len == 1);  // the second sequence holds one token
  CHECK(mixed_steps > 0);
  CHECK(migrations > 0);
  CHECK(max_seen == max_len);  // the first sequence ran to max_len
  CHECK(forks > 0);
  CHECK(truncations > 0);
  CHECK(refused > 0);
  CHECK(resets > 0);
  CHECK(checked_rows > 0);
}

TEST_CASE("kvm step: continuous batching equals each sequence alone (fixed budget)", "[slots]") {
  SECTION("fp32") {
    continuous_batching<float>(kvmem::budget::Fixed{16, 16}, 11, 34, 3000);
  }
  SECTION("bf16") {
    continuous_batching<kvmem::bf16>(kvmem::budget::Fixed{16, 16}, 12, 34, 3000);
  }
  SECTION("fp8") {  // e4m3 readout copies with row scales, bf16 window (kvm/state.hpp)
    continuous_batching<kvmem::e4m3>(kvmem::budget::Fixed{16, 16}, 13, 34, 3000);
  }
}

TEST_CASE("kvm step: continuous batching equals each sequence alone (power budget)", "[slots]") {
  SECTION("fp32") {
    continuous_batching<float>(kvmem::budget::Power{2.0, 0.5, 16, 1, 100000}, 21, 34, 3000);
  }
  SECTION("bf16") {
    continuous_batching<kvmem::bf16>(kvmem::budget::Power{2.0, 0.5, 16, 1, 100000}, 22, 34, 3000);
  }
  SECTION("fp8") {
    continuous_batching<kvmem::e4m3>(kvmem::budget::Power{2.0, 0.5, 16, 1, 100000}, 23, 34, 3000);
  }
}

// 96 sequences: about a second in a release build, tens of seconds under ASan on a loaded machine, so
// hidden from the default run and registered as ctest label `slow` (tests/kvm/CMakeLists.txt).
TEST_CASE("kvm step: continuous batching, saturating budget, many sequences", "[slots][.slow]") {
  continuous_batching<float>(kvmem::budget::Saturating{64.0, 1, 100000, 1}, 31, 96, 3000);
}

// ---- lse against the fp64 reference --------------------------------------------------------------

TEST_CASE("kvm step: lse and out match the fp64 reference", "[slots]") {
  for (const kvmem::budget::Any& budget : {kvmem::budget::Any(kvmem::budget::Fixed{8, 8}),
                                           kvmem::budget::Any(kvmem::budget::Power{3.0, 0.5, 8, 1, 100000})}) {
    rkvm::Config c = small_config(1, 150, 4, 2, 8, 8, budget);
    const rkvm::Inputs in = random_inputs(c, 7);
    const rkvm::Result ref = rkvm::prefill(c, in);
    REQUIRE(ref.lse.size() == std::size_t(c.T * c.Hq));
    const Dims d;
    std::vector<Tok> toks(std::size_t(c.T));
    for (std::int64_t t = 0; t < c.T; ++t) {
      Tok& x = toks[std::size_t(t)];
      for (std::int64_t h = 0; h < c.Hq; ++h)
        for (std::int64_t e = 0; e < c.D; ++e) x.q.push_back(float(in.q[std::size_t((h * c.T + t) * c.D + e)]));
      for (std::int64_t h = 0; h < c.Hk; ++h) {
        for (std::int64_t e = 0; e < c.D; ++e) x.k.push_back(float(in.k[std::size_t((h * c.T + t) * c.D + e)]));
        for (std::int64_t e = 0; e < c.Dv; ++e) x.v.push_back(float(in.v[std::size_t((h * c.T + t) * c.Dv + e)]));
        x.g.push_back(float(in.gate[std::size_t(h * c.T + t)]));
      }
    }
    const FloatWeights fw(in);
    kvm::State<float, float> st;
    REQUIRE(kvm::State<float, float>::create(to_params(c), {3, c.Hq, c.Hk, c.D, c.Dv, c.T}, st).is_ok());
    // the sequence in slot 1, fed in uneven chunks next to a padding row
    std::vector<float> lse(std::size_t(c.T * c.Hq)), out(std::size_t(c.T * c.Hq * c.Dv));
    for (std::int64_t t0 = 0; t0 < c.T;) {
      const std::int64_t t1 = std::min(c.T, t0 + 1 + (t0 * 7) % 13);
      Batch b;
      std::vector<Tok> pad(1, toks[0]);
      b.add(-1, pad, 0, 1);
      b.add(1, toks, t0, t1);
      REQUIRE(b.run(st, fw.view(), d).is_ok());
      std::copy(b.lse.begin() + d.Hq, b.lse.end(), lse.begin() + t0 * d.Hq);
      std::copy(b.out.begin() + d.Hq * d.Dv, b.out.end(), out.begin() + t0 * d.Hq * d.Dv);
      t0 = t1;
    }
    double worst_lse = 0, worst_out = 0;
    for (std::size_t i = 0; i < lse.size(); ++i) worst_lse = std::max(worst_lse, std::abs(double(lse[i]) - ref.lse[i]));
    for (std::size_t i = 0; i < out.size(); ++i) worst_out = std::max(worst_out, std::abs(double(out[i]) - ref.out[i]));
    INFO("budget " << budget.name() << " max |lse - ref| " << worst_lse << " max |out - ref| " << worst_out);
    CHECK(worst_lse < 2e-5);
    CHECK(worst_out < 2e-5);
  }
}

// ---- export / import ------------------------------------------------------------------------------

// Feeds tokens [from, to) of `toks` to `slot` in chunks of up to `chunk`, returning out and lse rows.
template <class S>
void feed(kvm::State<S, float>& st, const kvm::Weights& w, const Dims& d, std::int32_t slot,
          const std::vector<Tok>& toks, std::int64_t from, std::int64_t to, std::int64_t chunk,
          std::vector<float>* out = nullptr, std::vector<float>* lse = nullptr) {
  for (std::int64_t t0 = from; t0 < to;) {
    const std::int64_t t1 = std::min(to, t0 + chunk);
    Batch b;
    b.add(slot, toks, t0, t1);
    const Status s = b.run(st, w, d);
    INFO(s.to_string());
    REQUIRE(s.is_ok());
    if (out) out->insert(out->end(), b.out.begin(), b.out.end());
    if (lse) lse->insert(lse->end(), b.lse.begin(), b.lse.end());
    t0 = t1;
  }
}

template <class S>
void round_trip(kvmem::budget::Any budget) {
  const Dims d;
  const std::int64_t C = 8;
  const kvm::Params p = make_params(C, budget);
  const RandomWeights rw(d, 5);
  std::mt19937_64 rng(9);
  std::vector<Tok> toks;
  for (int i = 0; i < 400; ++i) toks.push_back(random_tok(d, rng));
  for (const std::int64_t n : {0, 1, 5, 8, 9, 16, 24, 25, 33, 57, 130, 250}) {
    INFO("exported after " << n << " tokens");
    kvm::State<S, float> a, b;
    REQUIRE(kvm::State<S, float>::create(p, {3, d.Hq, d.Hk, d.D, d.Dv, 512}, a).is_ok());
    REQUIRE(kvm::State<S, float>::create(p, {2, d.Hq, d.Hk, d.D, d.Dv, 400}, b).is_ok());
    feed(a, rw.view(), d, 2, toks, 0, n, 7);
    const auto bytes = export_of(a, 2);
    REQUIRE(bytes.size() <= kvm::export_bytes(a));
    const Status s = kvm::import_slot(exact_exec(1), b, rw.view(), 0, std::span<const std::byte>(bytes));
    INFO(s.to_string());
    REQUIRE(s.is_ok());
    REQUIRE(b.tokens(0) == n);
    REQUIRE(export_of(b, 0) == bytes);  // the canonical fields survive the trip bit for bit
    std::vector<float> out_a, lse_a, out_b, lse_b;
    feed(a, rw.view(), d, 2, toks, n, n + 120, 5, &out_a, &lse_a);
    feed(b, rw.view(), d, 0, toks, n, n + 120, 5, &out_b, &lse_b);
    REQUIRE(std::memcmp(out_a.data(), out_b.data(), out_a.size() * sizeof(float)) == 0);
    REQUIRE(std::memcmp(lse_a.data(), lse_b.data(), lse_a.size() * sizeof(float)) == 0);
  }
}

TEST_CASE("kvm slots: export -> import continues bit for bit like the source", "[slots]") {
  SECTION("fp32 fixed") {
    round_trip<float>(kvmem::budget::Fixed{8, 8});
  }
  SECTION("bf16 power") {
    round_trip<kvmem::bf16>(kvmem::budget::Power{3.0, 0.5, 8, 1, 100000});
  }
  SECTION("fp8 power") {  // the import rebuilds the e4m3 readout copies and their scales bit for bit
    round_trip<kvmem::e4m3>(kvmem::budget::Power{3.0, 0.5, 8, 1, 100000});
  }
  SECTION("fp8 fixed") {
    round_trip<kvmem::e4m3>(kvmem::budget::Fixed{8, 8});
  }
}

template <class S>
Status try_import(const kvm::Params& p, const Dims& d, std::int64_t n_ctx, std::span<const std::byte> bytes) {
  const RandomWeights rw(d, 5);
  kvm::State<S, float> st, twin;
  REQUIRE(kvm::State<S, float>::create(p, {2, d.Hq, d.Hk, d.D, d.Dv, n_ctx}, st).is_ok());
  REQUIRE(kvm::State<S, float>::create(p, {2, d.Hq, d.Hk, d.D, d.Dv, n_ctx}, twin).is_ok());
  std::mt19937_64 rng(3);
  std::vector<Tok> toks;
  for (int i = 0; i < 20; ++i) toks.push_back(random_tok(d, rng));
  feed(st, rw.view(), d, 1, toks, 0, 20, 20);
  feed(twin, rw.view(), d, 1, toks, 0, 20, 20);
  const Status s = kvm::import_slot(exact_exec(1), st, rw.view(), 1, bytes);
  if (!s.is_ok()) require_same_state(st, twin);  // refused: checked before any write, so untouched
  return s;
}

TEST_CASE("kvm slots: imports whose version, mechanism, parameters or shape differ are refused", "[slots]") {
  const Dims d;
  const kvm::Params p = make_params(8, kvmem::budget::Power{3.0, 0.5, 8, 1, 100000});
  const RandomWeights rw(d, 5);
  kvm::State<float, float> src;
  REQUIRE(kvm::State<float, float>::create(p, {1, d.Hq, d.Hk, d.D, d.Dv, 300}, src).is_ok());
  std::mt19937_64 rng(4);
  std::vector<Tok> toks;
  for (int i = 0; i < 60; ++i) toks.push_back(random_tok(d, rng));
  feed(src, rw.view(), d, 0, toks, 0, 60, 13);
  const auto bytes = export_of(src, 0);
  const std::span<const std::byte> rec(bytes);
  REQUIRE(try_import<float>(p, d, 300, rec).is_ok());  // the control: same parameters import

  const auto refused = [&](const Status& s, const std::string& field) {
    INFO(s.to_string());
    CHECK(!s.is_ok());
    CHECK(s.message().find(field) != std::string::npos);
  };
  SECTION("version and mechanism") {
    auto v = bytes;
    v[8] = std::byte{2};
    refused(try_import<float>(p, d, 300, v), "version");
    auto m = bytes;
    m[12] = std::byte{2};
    refused(try_import<float>(p, d, 300, m), "mechanism");
    auto magic = bytes;
    magic[0] = std::byte{'X'};
    refused(try_import<float>(p, d, 300, magic), "KVMEMSLT");
  }
  SECTION("each parameter") {
    struct Case {
      const char* field;
      kvm::Params p;
    };
    std::vector<Case> cases;
    const auto with = [&](const char* f, auto change) {
      kvm::Params q = p;
      change(q);
      cases.push_back({f, q});
    };
    with("'chunk'", [](kvm::Params& q) { q.chunk = 16, q.budget = kvmem::budget::Power{3.0, 0.5, 16, 1, 100000}; });
    with("'window_chunks'", [](kvm::Params& q) { q.window_chunks = 3; });
    with("'sink'", [](kvm::Params& q) { q.sink = 2; });
    with("'rope_dims'", [](kvm::Params& q) { q.rope_dims = 2; });
    with("'budget_kind'", [](kvm::Params& q) { q.budget = kvmem::budget::Fixed{8, 100000}; });
    with("'budget_minimum'", [](kvm::Params& q) { q.budget = kvmem::budget::Power{3.0, 0.5, 9, 1, 100000}; });
    with("'budget_maximum'", [](kvm::Params& q) { q.budget = kvmem::budget::Power{3.0, 0.5, 8, 1, 90000}; });
    with("'budget_round_down'", [](kvm::Params& q) { q.budget = kvmem::budget::Power{3.0, 0.5, 8, 2, 100000}; });
    with("'budget_factor'", [](kvm::Params& q) { q.budget = kvmem::budget::Power{3.5, 0.5, 8, 1, 100000}; });
    with("'budget_exponent'", [](kvm::Params& q) { q.budget = kvmem::budget::Power{3.0, 0.6, 8, 1, 100000}; });
    with("'flags'", [](kvm::Params& q) { q.merge_gate_keys = false; });
    with("'flags'", [](kvm::Params& q) { q.merge_gate_values = false; });
    with("'flags'", [](kvm::Params& q) { q.head_temps = false; });
    with("'flags'", [](kvm::Params& q) { q.value_radius = false; });
    with("'flags'", [](kvm::Params& q) { q.gate_appends = true; });
    with("'flags'", [](kvm::Params& q) { q.gate_initial = true; });
    with("'ln_eps'", [](kvm::Params& q) { q.ln_eps = 1e-6; });
    with("'scale'", [](kvm::Params& q) { q.scale = 0.25; });
    for (const Case& c : cases) {
      INFO("field " << c.field);
      refused(try_import<float>(c.p, d, 300, rec), c.field);
    }
    // saturation: a saturating record into a saturating state of another Nsat
    kvm::Params sat = p;
    sat.budget = kvmem::budget::Saturating{64.0, 1, 100000, 1};
    kvm::State<float, float> s2;
    REQUIRE(kvm::State<float, float>::create(sat, {1, d.Hq, d.Hk, d.D, d.Dv, 300}, s2).is_ok());
    feed(s2, rw.view(), d, 0, toks, 0, 30, 30);
    const auto sat_bytes = export_of(s2, 0);
    kvm::Params sat2 = sat;
    sat2.budget = kvmem::budget::Saturating{65.0, 1, 100000, 1};
    refused(try_import<float>(sat2, d, 300, sat_bytes), "'budget_saturation'");
    REQUIRE(try_import<float>(sat, d, 300, sat_bytes).is_ok());
  }
  SECTION("shape, storage and context") {
    refused(try_import<float>(p, Dims{8, 2, 8, 8}, 300, rec), "'Hq'");
    refused(try_import<float>(p, Dims{4, 4, 8, 8}, 300, rec), "'Hk'");
    refused(try_import<float>(p, Dims{4, 2, 16, 8}, 300, rec), "'D'");
    refused(try_import<float>(p, Dims{4, 2, 8, 16}, 300, rec), "'Dv'");
    refused(try_import<kvmem::bf16>(p, d, 300, rec), "'storage'");
    refused(try_import<float>(p, d, 59, rec), "n_ctx");  // 60 tokens do not fit
  }
  SECTION("truncated or padded records") {
    for (const std::size_t keep :
         {std::size_t(0), std::size_t(7), std::size_t(20), bytes.size() / 2, bytes.size() - 1}) {
      INFO("first " << keep << " bytes");
      CHECK(!try_import<float>(p, d, 300, rec.first(keep)).is_ok());
    }
    auto longer = bytes;
    longer.push_back(std::byte{0});
    CHECK(!try_import<float>(p, d, 300, longer).is_ok());
  }
}

// A record holds its storage type: an fp8 state refuses a bf16 or fp32 record, and a bf16 state an fp8
// record, naming the field and both types; the refused state is unchanged (try_import checks).
TEST_CASE("kvm slots: a record of another storage type is refused, naming both types", "[slots]") {
  const Dims d;
  const kvm::Params p = make_params(8, kvmem::budget::Power{3.0, 0.5, 8, 1, 100000});
  const RandomWeights rw(d, 5);
  std::mt19937_64 rng(14);
  std::vector<Tok> toks;
  for (int i = 0; i < 40; ++i) toks.push_back(random_tok(d, rng));
  kvm::State<kvmem::bf16, float> b16;
  kvm::State<kvmem::e4m3, float> f8;
  REQUIRE(kvm::State<kvmem::bf16, float>::create(p, {1, d.Hq, d.Hk, d.D, d.Dv, 300}, b16).is_ok());
  REQUIRE(kvm::State<kvmem::e4m3, float>::create(p, {1, d.Hq, d.Hk, d.D, d.Dv, 300}, f8).is_ok());
  feed(b16, rw.view(), d, 0, toks, 0, 40, 11);
  feed(f8, rw.view(), d, 0, toks, 0, 40, 11);
  const auto rec16 = export_of(b16, 0), rec8 = export_of(f8, 0);
  REQUIRE(try_import<kvmem::e4m3>(p, d, 300, rec8).is_ok());  // the control
  REQUIRE(try_import<kvmem::bf16>(p, d, 300, rec16).is_ok());
  const Status into8 = try_import<kvmem::e4m3>(p, d, 300, rec16);
  INFO(into8.to_string());
  CHECK(into8.code() == StatusCode::kInvalidArgument);
  CHECK(into8.message().find("'storage'") != std::string::npos);
  CHECK(into8.message().find("fp8 e4m3") != std::string::npos);
  CHECK(into8.message().find("bf16") != std::string::npos);
  const Status into16 = try_import<kvmem::bf16>(p, d, 300, rec8);
  INFO(into16.to_string());
  CHECK(into16.message().find("'storage'") != std::string::npos);
  CHECK(into16.message().find("fp8 e4m3") != std::string::npos);
  CHECK(!try_import<kvmem::e4m3>(p, d, 300, export_of(b16, 0)).is_ok());
}

// ---- truncate -------------------------------------------------------------------------------------

TEST_CASE("kvm slots: truncate is exact where no update is undone, refused otherwise", "[slots]") {
  // C = 4, nb = 2 (spec 8): updates run at n = 13, 17, 21, ...
  const Dims d;
  const kvm::Params p = make_params(4, kvmem::budget::Power{3.0, 0.5, 4, 1, 100000});
  const RandomWeights rw(d, 8);
  std::mt19937_64 rng(10);
  struct Case {
    std::int64_t n_old, cut;
    bool exact;
  };
  // hand-derived from spec 4.1/4.7: window [bswa_begin(n), n), bswa_begin(n) = max(0, ceil(n/4)*4 - 8)
  const Case cases[] = {
      {14, 1, true},   // 13 tokens: the update at n = 13 stays
      {14, 2, false},  // 12 tokens: undoes the update at n = 13
      {16, 3, true},  {17, 1, false}, {20, 3, true},  {20, 4, false},
      {6, 4, true},    // initial slots only: 2 remain (spec 4.3)
      {11, 2, true},   // 9 tokens: position 8 reads the window from 4, still held
      {11, 5, false},  // 6 tokens: position 6 reads from 0, but the window of 11 starts at 4
      {8, 7, true},   {12, 12, true}, {30, 30, true}, {3, 0, true},
  };
  for (const Case& c : cases) {
    INFO("n_old " << c.n_old << " cut " << c.cut);
    REQUIRE(truncate_exact(4, 2, c.n_old, c.cut) == c.exact);  // the test's own predicate agrees with the table
    std::vector<Tok> toks;
    for (std::int64_t i = 0; i < c.n_old; ++i) toks.push_back(random_tok(d, rng));
    kvm::State<float, float> st, twin;
    REQUIRE(kvm::State<float, float>::create(p, {2, d.Hq, d.Hk, d.D, d.Dv, 200}, st).is_ok());
    REQUIRE(kvm::State<float, float>::create(p, {2, d.Hq, d.Hk, d.D, d.Dv, 200}, twin).is_ok());
    feed(st, rw.view(), d, 1, toks, 0, c.n_old, 5);
    feed(twin, rw.view(), d, 1, toks, 0, c.n_old, 5);
    const Status s = kvm::truncate(exact_exec(1), st, 1, c.cut);
    INFO(s.to_string());
    REQUIRE(s.is_ok() == c.exact);
    if (!c.exact) {
      CHECK(s.code() == StatusCode::kInvalidArgument);
      require_same_state(st, twin);
      continue;
    }
    // continue with new tokens: equal to the shorter sequence alone
    toks.resize(std::size_t(c.n_old - c.cut));
    const std::int64_t n_new = std::int64_t(toks.size());
    for (int i = 0; i < 40; ++i) toks.push_back(random_tok(d, rng));
    std::vector<float> out;
    feed(st, rw.view(), d, 1, toks, n_new, std::int64_t(toks.size()), 3, &out);
    const auto ref = alone_prefill<float>(p, d, 200, rw.view(), toks);
    REQUIRE(std::memcmp(out.data(), ref.data() + n_new * d.Hq * d.Dv, out.size() * sizeof(float)) == 0);
  }
  kvm::State<float, float> st;
  REQUIRE(kvm::State<float, float>::create(p, {2, d.Hq, d.Hk, d.D, d.Dv, 200}, st).is_ok());
  CHECK(kvm::truncate(exact_exec(1), st, 0, 1).code() == StatusCode::kOutOfRange);  // more than it holds
  CHECK(kvm::truncate(exact_exec(1), st, 0, -1).code() == StatusCode::kOutOfRange);
}

// ---- safety: bad slot indices, moved-from and never-created states ---------------------------------

TEST_CASE("kvm slots: bad slot indices are refused and leave the state untouched", "[slots]") {
  const Dims d;
  const kvm::Params p = make_params(4, kvmem::budget::Fixed{4, 4});
  const RandomWeights rw(d, 2);
  std::mt19937_64 rng(1);
  std::vector<Tok> toks;
  for (int i = 0; i < 60; ++i) toks.push_back(random_tok(d, rng));
  kvm::State<float, float> st, twin;
  for (auto* s : {&st, &twin}) {
    REQUIRE(kvm::State<float, float>::create(p, {2, d.Hq, d.Hk, d.D, d.Dv, 64}, *s).is_ok());
    feed(*s, rw.view(), d, 0, toks, 0, 30, 7);
    feed(*s, rw.view(), d, 1, toks, 0, 11, 4);
  }
  const kvmem::host::Executor ex{1};
  const auto bad_step = [&](std::vector<std::int32_t> slots, std::vector<std::int32_t> starts) {
    Batch b;
    b.slot = slots;
    b.start = starts;
    const std::int64_t T = starts.back();
    for (std::int64_t i = 0; i < T; ++i) {
      const Tok& t = toks[std::size_t(i)];
      b.q.insert(b.q.end(), t.q.begin(), t.q.end());
      b.k.insert(b.k.end(), t.k.begin(), t.k.end());
      b.v.insert(b.v.end(), t.v.begin(), t.v.end());
      b.g.insert(b.g.end(), t.g.begin(), t.g.end());
    }
    return b.run(st, rw.view(), d);
  };
  CHECK(bad_step({2}, {0, 1}).code() == StatusCode::kOutOfRange);
  CHECK(bad_step({-2}, {0, 1}).code() == StatusCode::kOutOfRange);
  CHECK(bad_step({0, 0}, {0, 1, 2}).code() == StatusCode::kInvalidArgument);  // one slot twice
  CHECK(bad_step({0, 1}, {0, 2, 1}).code() == StatusCode::kInvalidArgument);  // decreasing starts
  CHECK(bad_step({0}, {1, 1}).code() == StatusCode::kInvalidArgument);        // query_start[0] != 0
  CHECK(!bad_step({1}, {0, 60}).is_ok());                                     // n_ctx of slot 1
  {
    Batch b;
    b.add(0, toks, 0, 2);
    b.q[3] = std::nanf("");
    CHECK(b.run(st, rw.view(), d).code() == StatusCode::kInvalidArgument);
    Batch g;
    g.add(1, toks, 0, 2);
    g.g[1] = 0.f;
    CHECK(g.run(st, rw.view(), d).code() == StatusCode::kInvalidArgument);
  }
  const std::int32_t bad[] = {2}, neg[] = {-1}, zero[] = {0}, one[] = {1}, both[] = {0, 1};
  CHECK(kvm::reset_slots(ex, st, I32View(bad, {1})).code() == StatusCode::kOutOfRange);
  CHECK(kvm::reset_slots(ex, st, I32View(neg, {1})).code() == StatusCode::kOutOfRange);
  CHECK(kvm::copy_slots(ex, st, I32View(zero, {1}), I32View(bad, {1})).code() == StatusCode::kOutOfRange);
  CHECK(kvm::copy_slots(ex, st, I32View(bad, {1}), I32View(zero, {1})).code() == StatusCode::kOutOfRange);
  CHECK(kvm::copy_slots(ex, st, I32View(both, {2}), I32View(one, {1})).code() == StatusCode::kInvalidArgument);
  CHECK(!kvm::copy_slots(ex, st, I32View(zero, {1}), I32View(both, {2})).is_ok());
  {
    const std::int32_t src[] = {0, 1}, dst[] = {1, 0};  // a destination that is another pair's source
    CHECK(kvm::copy_slots(ex, st, I32View(src, {2}), I32View(dst, {2})).code() == StatusCode::kInvalidArgument);
  }
  std::vector<std::byte> buf(kvm::export_bytes(st));
  CHECK(kvm::export_bytes(st, 2) == 0);
  CHECK(kvm::export_slot(ex, st, 2, std::span<std::byte>(buf)).code() == StatusCode::kOutOfRange);
  CHECK(kvm::export_slot(ex, st, 0, std::span<std::byte>(buf).first(10)).code() == StatusCode::kInvalidArgument);
  const auto rec0 = export_of(st, 0);
  CHECK(kvm::import_slot(ex, st, rw.view(), -1, std::span<const std::byte>(rec0)).code() == StatusCode::kOutOfRange);
  CHECK(kvm::import_slot(ex, st, rw.view(), 2, std::span<const std::byte>(rec0)).code() == StatusCode::kOutOfRange);
  CHECK(kvm::truncate(ex, st, 9, 1).code() == StatusCode::kOutOfRange);
  CHECK(kvm::truncate(ex, st, -1, 1).code() == StatusCode::kOutOfRange);
  CHECK(st.reset(8).code() == StatusCode::kOutOfRange);  // used to zero sequence 0's counters
  CHECK(st.reset(-1).code() == StatusCode::kOutOfRange);
  CHECK(st.tokens(8) == 0);
  require_same_state(st, twin);
  // and the state still works exactly like its twin
  std::vector<float> out_a, out_b;
  feed(st, rw.view(), d, 0, toks, 0, 0, 1);
  feed(st, rw.view(), d, 1, toks, 11, 25, 6, &out_a);
  feed(twin, rw.view(), d, 1, toks, 11, 25, 6, &out_b);
  CHECK(out_a == out_b);
}

// Rows::max_query_len: a bound on the tokens of a row naming a slot. A bound at or above the longest
// such row changes nothing (a padding row may be longer); a row over it refuses the step, naming the
// row, and the state is untouched.
TEST_CASE("kvm step: max_query_len bounds the rows; a row over it is refused, a correct bound changes nothing",
          "[slots]") {
  const Dims d;
  const kvm::Params p = make_params(4, kvmem::budget::Fixed{4, 4});
  const RandomWeights rw(d, 3);
  std::mt19937_64 rng(5);
  std::vector<Tok> toks;
  for (int i = 0; i < 40; ++i) toks.push_back(random_tok(d, rng));
  kvm::State<float, float> st, twin;
  for (auto* s : {&st, &twin}) {
    REQUIRE(kvm::State<float, float>::create(p, {3, d.Hq, d.Hk, d.D, d.Dv, 64}, *s).is_ok());
    feed(*s, rw.view(), d, 1, toks, 0, 6, 3);
  }
  // a prefill row of 11 tokens (slot 0), a padding row of 13, a row of 5 continuing slot 1
  const auto batch = [&](std::int64_t bound) {
    Batch b;
    b.add(0, toks, 0, 11);
    b.add(-1, toks, 11, 24);
    b.add(1, toks, 6, 11);
    b.max_query_len = bound;
    return b;
  };
  Batch over = batch(10);
  const Status refused = over.run(st, rw.view(), d);
  INFO(refused.to_string());
  CHECK(refused.code() == StatusCode::kInvalidArgument);
  CHECK(refused.message().find("max_query_len") != std::string::npos);
  CHECK(refused.message().find("row 0: 11") != std::string::npos);
  require_same_state(st, twin);
  Batch negative = batch(-1);
  CHECK(negative.run(st, rw.view(), d).code() == StatusCode::kInvalidArgument);
  require_same_state(st, twin);

  Batch unbounded = batch(0), bounded = batch(11);  // 11: the longest row naming a slot; padding holds 13
  REQUIRE(unbounded.run(twin, rw.view(), d).is_ok());
  const Status ran = bounded.run(st, rw.view(), d);
  INFO(ran.to_string());
  REQUIRE(ran.is_ok());
  CHECK(std::memcmp(bounded.out.data(), unbounded.out.data(), bounded.out.size() * sizeof(float)) == 0);
  CHECK(std::memcmp(bounded.lse.data(), unbounded.lse.data(), bounded.lse.size() * sizeof(float)) == 0);
  require_same_state(st, twin);
}

TEST_CASE("kvm slots: moved-from and never-created states are empty and refuse every operation", "[slots]") {
  const Dims d;
  const kvm::Params p = make_params(4, kvmem::budget::Fixed{4, 4});
  const RandomWeights rw(d, 2);
  std::mt19937_64 rng(1);
  std::vector<Tok> toks;
  for (int i = 0; i < 20; ++i) toks.push_back(random_tok(d, rng));
  const kvmem::host::Executor ex{1};
  kvm::State<float, float> a, twin;
  REQUIRE(kvm::State<float, float>::create(p, {2, d.Hq, d.Hk, d.D, d.Dv, 64}, a).is_ok());
  REQUIRE(kvm::State<float, float>::create(p, {2, d.Hq, d.Hk, d.D, d.Dv, 64}, twin).is_ok());
  feed(a, rw.view(), d, 0, toks, 0, 15, 4);
  feed(twin, rw.view(), d, 0, toks, 0, 15, 4);
  kvm::State<float, float> b(std::move(a));
  kvm::State<float, float> never;
  kvm::State<float, float> assigned;
  REQUIRE(kvm::State<float, float>::create(p, {1, d.Hq, d.Hk, d.D, d.Dv, 64}, assigned).is_ok());
  kvm::State<float, float> c;
  c = std::move(b);  // move-assign; b is empty again
  assigned = std::move(c);
  const auto rec = export_of(twin, 0);
  for (kvm::State<float, float>* e : {&a, &b, &c, &never}) {
    CHECK(!e->valid());
    CHECK(e->max_slots() == 0);
    CHECK(e->tokens(0) == 0);
    CHECK(e->cache_bytes(0) == 0);
    e->reset();  // no effect
    CHECK(!e->reset(0).is_ok());
    Batch bt;
    bt.add(0, toks, 0, 1);
    CHECK(!bt.run(*e, rw.view(), d).is_ok());
    const std::int32_t zero[] = {0}, one[] = {1};
    CHECK(!kvm::reset_slots(ex, *e, I32View(zero, {1})).is_ok());
    CHECK(!kvm::copy_slots(ex, *e, I32View(zero, {1}), I32View(one, {1})).is_ok());
    CHECK(kvm::export_bytes(*e) == 0);
    CHECK(kvm::export_bytes(*e, 0) == 0);
    std::vector<std::byte> buf(64);
    CHECK(!kvm::export_slot(ex, *e, 0, std::span<std::byte>(buf)).is_ok());
    CHECK(!kvm::import_slot(ex, *e, rw.view(), 0, std::span<const std::byte>(rec)).is_ok());
    CHECK(!kvm::truncate(ex, *e, 0, 0).is_ok());
    std::vector<float> q(std::size_t(2 * d.Hq * d.D), 0.f), k(std::size_t(2 * d.Hk * d.D), 0.f),
        v(std::size_t(2 * d.Hk * d.Dv), 0.f), g(std::size_t(2 * d.Hk), 1.f), out(std::size_t(2 * d.Hq * d.Dv));
    CHECK(!kvm::decode(ex, *e, rw.view(), TensorView<const float, 4>(q.data(), {2, d.Hq, 1, d.D}),
                       TensorView<const float, 4>(k.data(), {2, d.Hk, 1, d.D}),
                       TensorView<const float, 4>(v.data(), {2, d.Hk, 1, d.Dv}),
                       TensorView<const float, 3>(g.data(), {2, d.Hk, 1}),
                       TensorView<float, 4>(out.data(), {2, 1, d.Hq, d.Dv}))
               .is_ok());
  }
  // the final owner holds the sequence and continues exactly like the twin that never moved
  REQUIRE(assigned.valid());
  require_same_state(assigned, twin);
  std::vector<float> out_a, out_b;
  feed(assigned, rw.view(), d, 0, toks, 15, 20, 2, &out_a);
  feed(twin, rw.view(), d, 0, toks, 15, 20, 2, &out_b);
  CHECK(out_a == out_b);
}

TEST_CASE("kvm slots: copy_slots forks continue like the source, reset_slots forgets", "[slots]") {
  const Dims d;
  const kvm::Params p = make_params(8, kvmem::budget::Power{3.0, 0.5, 8, 1, 100000});
  const RandomWeights rw(d, 6);
  std::mt19937_64 rng(6);
  std::vector<Tok> toks;
  for (int i = 0; i < 120; ++i) toks.push_back(random_tok(d, rng));
  kvm::State<kvmem::bf16, float> st;
  REQUIRE(kvm::State<kvmem::bf16, float>::create(p, {4, d.Hq, d.Hk, d.D, d.Dv, 256}, st).is_ok());
  feed(st, rw.view(), d, 0, toks, 0, 70, 9);
  feed(st, rw.view(), d, 3, toks, 0, 30, 30);
  const std::int32_t src[] = {0, 0, 2}, dst[] = {1, 2, 3};  // slot 2 is copied before it is written
  REQUIRE(!kvm::copy_slots(exact_exec(2), st, I32View(src, {3}), I32View(dst, {3})).is_ok());
  const std::int32_t src2[] = {0, 0}, dst2[] = {1, 2};
  REQUIRE(kvm::copy_slots(exact_exec(2), st, I32View(src2, {2}), I32View(dst2, {2})).is_ok());
  for (std::int32_t s : {1, 2}) REQUIRE(export_of(st, s) == export_of(st, 0));
  std::vector<float> o0, o1, o2;
  feed(st, rw.view(), d, 0, toks, 70, 120, 4, &o0);
  feed(st, rw.view(), d, 1, toks, 70, 120, 7, &o1);
  feed(st, rw.view(), d, 2, toks, 70, 120, 50, &o2);
  CHECK(std::memcmp(o0.data(), o1.data(), o0.size() * sizeof(float)) == 0);
  CHECK(std::memcmp(o0.data(), o2.data(), o0.size() * sizeof(float)) == 0);
  const auto ref = alone_prefill<kvmem::bf16>(p, d, 256, rw.view(), toks);
  CHECK(std::memcmp(o0.data(), ref.data() + 70 * d.Hq * d.Dv, o0.size() * sizeof(float)) == 0);
  const std::int32_t gone[] = {1, 3};
  REQUIRE(kvm::reset_slots(exact_exec(1), st, I32View(gone, {2})).is_ok());
  CHECK(st.tokens(1) == 0);
  CHECK(st.tokens(3) == 0);
  CHECK(st.tokens(0) == 120);
  // a reset slot starts a new sequence from scratch
  std::vector<float> fresh;
  feed(st, rw.view(), d, 3, toks, 0, 40, 40, &fresh);
  CHECK(std::memcmp(fresh.data(), ref.data(), fresh.size() * sizeof(float)) == 0);
}

}  // namespace
