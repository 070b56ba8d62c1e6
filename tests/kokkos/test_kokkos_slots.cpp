// SPDX-License-Identifier: Apache-2.0
// Sequence slots on the Kokkos backend (DESIGN.md 3, docs/slots.md, docs/slots-ua.md): kvm::step and
// ua::step over ragged rows, the slot operations, records that travel between the host and Kokkos in
// both directions, and the refusals. Expected values come from each sequence run alone on Kokkos with
// prefill (KVM) or prefill / decode rows (UA) on a state of its own, from the host backend (records,
// continuations), or from a twin that never saw a refused call; never from the slot path itself.
// Results of the same space are compared bitwise; Kokkos against the host backend is bitwise on host
// spaces and within the fp32 tolerance on device spaces (kvm_kokkos_util.hpp).
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <random>
#include <span>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include <catch2/catch.hpp>

#include "kvm_kokkos_util.hpp"
#include "kvmem/backend/host/kvm.hpp"
#include "kvmem/backend/host/ua.hpp"
#include "kvmem/backend/kokkos.hpp"

namespace {

using kvmem::Rows;
using kvmem::Status;
using kvmem::StatusCode;
using kvmem::TensorView;
using kvmem::kokkos::to_tensor_view;
using kvmem::test::KokkosExec;
using kvmem::test::KokkosSpace;
using kvmem::test::to_device;
using kvmem::test::to_host;
namespace kvm = kvmem::kvm;
namespace kua = kvmem::ua;
using Mem = KokkosSpace::memory_space;
using Slots = std::vector<std::int32_t>;
using I32View = TensorView<const std::int32_t, 1>;

// Checked, so the refusals below come back as a Status. A function, not a global: an execution space
// instance may only be made after Kokkos::initialize (OpenMP and Cuda instances need the runtime).
KokkosExec kexec() {
  return {KokkosSpace(), true};
}
const kvmem::host::Executor hexec{.threads = 1, .exact = true};  // the host's bitwise path
constexpr double kTolFp32 = 1e-5;                                // Kokkos on a device space vs the host

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
}
bool same_bits(float a, float b) {
  return std::memcmp(&a, &b, sizeof a) == 0;
}

// A slot list in the space's memory, alive as long as the object.
struct DevList {
  Kokkos::View<std::int32_t*, Kokkos::LayoutRight, Mem> view;
  explicit DevList(const Slots& s) : view(to_device(s.empty() ? Slots{0} : s, s.empty() ? 1 : s.size())) {
    n = std::int64_t(s.size());
  }
  std::int64_t n = 0;
  I32View tv() const { return {view.data(), {n}}; }
};

// ================================ KV Means ===========================================================

struct Dims {
  std::int64_t Hq = 4, Hk = 2, D = 8, Dv = 8;  // GQA: two query heads per KV head
};
constexpr std::int64_t kChunk = 16, kWindowChunks = 2;

kvm::Params make_params(kvmem::budget::Any budget) {
  kvm::Params p;
  p.chunk = kChunk;
  p.window_chunks = kWindowChunks;
  p.sink = 1;
  p.rope_dims = 4;
  p.budget = budget;
  return p;
}

// Learned weights in the space's memory (and their host copy for the host backend).
struct Weights {
  std::vector<float> w, b, ts, tw;
  Kokkos::View<float*, Kokkos::LayoutRight, Mem> dw, db, dts, dtw;
  Weights(const Dims& d, std::uint64_t seed) {
    std::mt19937_64 rng(seed);
    std::normal_distribution<float> n01(0.f, 1.f);
    std::uniform_real_distribution<float> u(0.5f, 1.5f);
    for (std::int64_t i = 0; i < d.D; ++i) w.push_back(1.f + 0.2f * n01(rng)), b.push_back(0.2f * n01(rng));
    for (std::int64_t i = 0; i < d.Hq; ++i) ts.push_back(u(rng)), tw.push_back(u(rng));
    dw = to_device(w, w.size());
    db = to_device(b, b.size());
    dts = to_device(ts, ts.size());
    dtw = to_device(tw, tw.size());
  }
  kvm::Weights device() const {
    return {TensorView<const float, 1>(to_tensor_view(dw)), TensorView<const float, 1>(to_tensor_view(db)),
            TensorView<const float, 1>(to_tensor_view(dts)), TensorView<const float, 1>(to_tensor_view(dtw))};
  }
  kvm::Weights host() const {
    return {{w.data(), {std::int64_t(w.size())}},
            {b.data(), {std::int64_t(b.size())}},
            {ts.data(), {std::int64_t(ts.size())}},
            {tw.data(), {std::int64_t(tw.size())}}};
  }
};

// One token, token-major: q [Hq,D], k [Hk,D], v [Hk,Dv], g [Hk].
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

template <class S>
using KState = kvmem::kokkos::KvmState<S, float, kvmem::kokkos::state_memory_space<KokkosSpace>>;

template <class S>
KState<S> make_kstate(const kvm::Params& p, const Dims& d, std::int64_t slots, std::int64_t n_ctx) {
  KState<S> st;
  const Status s = kvmem::kokkos::create_state<S, float>(kexec(), p, {slots, d.Hq, d.Hk, d.D, d.Dv, n_ctx}, st);
  INFO(s.to_string());
  REQUIRE(s.is_ok());
  return st;
}

// Packed inputs of one step (host vectors), run on Kokkos or on the host.
struct Batch {
  Slots slot, start{0};
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
  // kvm::step on Kokkos: inputs in Views of the space's memory; out and lse start at -7 (unwritten shows).
  template <class S>
  Status run(KState<S>& st, const Weights& w, const Dims& d) {
    const std::int64_t T = std::int64_t(q.size()) / (d.Hq * d.D), R = std::int64_t(slot.size());
    const auto pad = [](std::vector<float> x) { return x.empty() ? std::vector<float>{0.f} : x; };
    const auto dq = to_device(pad(q), std::max<std::int64_t>(1, T * d.Hq * d.D));
    const auto dk = to_device(pad(k), std::max<std::int64_t>(1, T * d.Hk * d.D));
    const auto dv = to_device(pad(v), std::max<std::int64_t>(1, T * d.Hk * d.Dv));
    const auto dg = to_device(pad(g), std::max<std::int64_t>(1, T * d.Hk));
    const auto dout = to_device(std::vector<float>(std::size_t(std::max<std::int64_t>(1, T * d.Hq * d.Dv)), -7.f),
                                std::max<std::int64_t>(1, T * d.Hq * d.Dv));
    const auto dlse = to_device(std::vector<float>(std::size_t(std::max<std::int64_t>(1, T * d.Hq)), -7.f),
                                std::max<std::int64_t>(1, T * d.Hq));
    const DevList ds(slot), dst(start);
    const Rows rows{ds.tv(), {dst.view.data(), {R + 1}}, max_query_len};
    const Status s = kvm::step(
        kexec(), st.state, w.device(), rows, TensorView<const float, 3>(dq.data(), {T, d.Hq, d.D}),
        TensorView<const float, 3>(dk.data(), {T, d.Hk, d.D}), TensorView<const float, 3>(dv.data(), {T, d.Hk, d.Dv}),
        TensorView<const float, 2>(dg.data(), {T, d.Hk}), TensorView<float, 3>(dout.data(), {T, d.Hq, d.Dv}),
        TensorView<float, 2>(dlse.data(), {T, d.Hq}));
    kexec().space.fence();
    out = to_host(dout);
    lse = to_host(dlse);
    out.resize(std::size_t(T * d.Hq * d.Dv));
    lse.resize(std::size_t(T * d.Hq));
    return s;
  }
  // kvm::step on the host's exact path (the cross-backend oracle).
  template <class S>
  Status run_host(kvm::State<S, float>& st, const Weights& w, const Dims& d) {
    const std::int64_t T = std::int64_t(q.size()) / (d.Hq * d.D);
    out.assign(std::size_t(T * d.Hq * d.Dv), -7.f);
    lse.assign(std::size_t(T * d.Hq), -7.f);
    const Rows rows{I32View(slot.data(), {std::int64_t(slot.size())}),
                    I32View(start.data(), {std::int64_t(start.size())})};
    return kvm::step(hexec, st, w.host(), rows, TensorView<const float, 3>(q.data(), {T, d.Hq, d.D}),
                     TensorView<const float, 3>(k.data(), {T, d.Hk, d.D}),
                     TensorView<const float, 3>(v.data(), {T, d.Hk, d.Dv}),
                     TensorView<const float, 2>(g.data(), {T, d.Hk}), TensorView<float, 3>(out.data(), {T, d.Hq, d.Dv}),
                     TensorView<float, 2>(lse.data(), {T, d.Hq}));
  }
};

// The oracle: the sequence alone on Kokkos, one prefill call on a one-slot state (batch-major views,
// the prefill driver). out [T,Hq,Dv].
template <class S>
std::vector<float> alone_prefill(const kvm::Params& p, const Dims& d, std::int64_t n_ctx, const Weights& w,
                                 const std::vector<Tok>& toks) {
  const std::int64_t T = std::int64_t(toks.size());
  auto st = make_kstate<S>(p, d, 1, n_ctx);
  std::vector<float> q(std::size_t(d.Hq * T * d.D)), k(std::size_t(d.Hk * T * d.D)), v(std::size_t(d.Hk * T * d.Dv)),
      g(std::size_t(d.Hk * T));
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
  const auto dq = to_device(q, 1, d.Hq, T, d.D), dk = to_device(k, 1, d.Hk, T, d.D),
             dv = to_device(v, 1, d.Hk, T, d.Dv);
  const auto dg = to_device(g, 1, d.Hk, T);
  const auto dout = to_device(std::vector<float>(std::size_t(T * d.Hq * d.Dv), -7.f), 1, T, d.Hq, d.Dv);
  const Status s =
      kvm::prefill(kexec(), st.state, w.device(), TensorView<const float, 4>(to_tensor_view(dq)),
                   TensorView<const float, 4>(to_tensor_view(dk)), TensorView<const float, 4>(to_tensor_view(dv)),
                   TensorView<const float, 3>(to_tensor_view(dg)), to_tensor_view(dout));
  INFO(s.to_string());
  REQUIRE(s.is_ok());
  kexec().space.fence();
  return to_host(dout);
}

// lse of the sequence alone (a one-row step on a one-slot Kokkos state), [T,Hq]; its out must equal
// the prefill oracle's.
template <class S>
std::vector<float> alone_lse(const kvm::Params& p, const Dims& d, std::int64_t n_ctx, const Weights& w,
                             const std::vector<Tok>& toks, const std::vector<float>& prefill_out) {
  auto st = make_kstate<S>(p, d, 1, n_ctx);
  Batch b;
  b.add(0, toks, 0, std::int64_t(toks.size()));
  REQUIRE(b.run(st, w, d).is_ok());
  CHECK(same_bits(b.out, prefill_out));
  return b.lse;
}

template <class S>
std::vector<std::byte> kvm_record(const kvm::State<S, float>& st, std::int32_t slot, bool on_kokkos = true) {
  if (on_kokkos) kexec().space.fence();  // export_bytes reads the counters on the host
  std::vector<std::byte> bytes(kvm::export_bytes(st, slot));
  const Status s = on_kokkos ? kvm::export_slot(kexec(), st, slot, std::span<std::byte>(bytes))
                             : kvm::export_slot(hexec, st, slot, std::span<std::byte>(bytes));
  INFO(s.to_string());
  REQUIRE(s.is_ok());
  return bytes;
}

// Every slot's counters and record (the whole canonical state).
template <class S>
std::vector<std::vector<std::byte>> kvm_state_of(const kvm::State<S, float>& st) {
  std::vector<std::vector<std::byte>> all;
  kexec().space.fence();
  for (std::int32_t s = 0; s < st.max_slots(); ++s) all.push_back(kvm_record(st, s));
  return all;
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
  std::int64_t first_read = begin(n_new + 1);
  if (n_new >= C) first_read = std::min(first_read, std::max(C, begin(n_new)));
  return first_read >= begin(n_old);
}

struct KvmSeq {
  std::vector<Tok> toks;        // every token fed so far
  std::int64_t target = 0;      // leaves at this length
  std::int64_t prompt = 0;      // tokens fed in prefill chunks before decode
  std::vector<float> out, lse;  // [pos, Hq, Dv], [pos, Hq]
  std::vector<char> has;        // produced by this sequence's own rows (not inherited by a fork)
  std::int32_t slot = -1;
};

// A seeded continuous-batching schedule on one Kokkos state of 16 slots: sequences join and leave,
// prefill chunks mix with decode tokens and padding rows, with forks (copy_slots), migrations
// (export_slot -> import_slot into another slot), truncations (exact or refused) and resets. Every
// output row and lse equals that sequence run alone on Kokkos, bitwise.
template <class S>
void kvm_schedule(kvmem::budget::Any budget, std::uint64_t seed, int sequences, std::int64_t max_len) {
  const Dims d;
  const std::int64_t C = kChunk, kSlots = 16, n_ctx = max_len + 64;
  const kvm::Params p = make_params(budget);
  const Weights w(d, seed);
  auto st = make_kstate<S>(p, d, kSlots, n_ctx);
  REQUIRE(st.state.max_slots() == kSlots);
  std::mt19937_64 rng(seed);
  const auto uni = [&](std::int64_t a, std::int64_t b) {
    return std::uniform_int_distribution<std::int64_t>(a, b)(rng);
  };
  std::vector<KvmSeq> seqs;
  std::vector<std::int32_t> owner(std::size_t(kSlots), -1);
  int created = 0, finished = 0, forks = 0, migrations = 0, truncations = 0, refused = 0, resets = 0, mixed = 0;
  std::int64_t checked_rows = 0, max_seen = 0, min_len = 1 << 30;
  const auto new_len = [&]() -> std::int64_t {
    const std::int64_t r = uni(0, 7);
    return r < 2 ? uni(1, 48) : r < 6 ? uni(49, std::max<std::int64_t>(49, max_len / 4)) : uni(max_len / 4, max_len);
  };
  bool failed = false;
  const auto finish = [&](std::int32_t si) {
    KvmSeq& s = seqs[std::size_t(si)];
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
        for (std::int64_t h = 0; h < d.Hq && !failed; ++h)
          if (!same_bits(s.lse[t * d.Hq + h], ref_lse[t * d.Hq + h])) {
            FAIL_CHECK("sequence " << si << " position " << t << " lse[" << h << "] differs");
            failed = true;
          }
      }
    }
    owner[std::size_t(s.slot)] = -1;
    s.slot = -1;
    ++finished;
  };
  const auto record_len = [&](KvmSeq& s) {
    const std::size_t n = s.toks.size();
    s.out.resize(n * std::size_t(d.Hq * d.Dv));
    s.lse.resize(n * std::size_t(d.Hq));
    s.has.resize(n, 0);
  };

  while (created < sequences || finished < created) {
    for (std::int32_t sl = 0; sl < kSlots && created < sequences; ++sl)
      if (owner[std::size_t(sl)] < 0 && uni(0, 2) > 0) {
        KvmSeq s;
        s.target = created == 0 ? max_len : created == 1 ? 1 : new_len();
        s.prompt = s.target - uni(0, std::min<std::int64_t>(s.target, 80));
        s.slot = sl;
        kexec().space.fence();
        REQUIRE(st.state.tokens(sl) == 0);
        owner[std::size_t(sl)] = std::int32_t(seqs.size());
        min_len = std::min(min_len, s.target);
        seqs.push_back(std::move(s));
        ++created;
      }
    struct Plan {
      std::int32_t seq, slot;
      std::int64_t from, to;
    };
    std::vector<Plan> plan;
    bool prefill_row = false, decode_row = false;
    for (std::int32_t sl = 0; sl < kSlots; ++sl) {
      const std::int32_t si = owner[std::size_t(sl)];
      if (si < 0 || uni(0, 9) == 0) continue;
      KvmSeq& s = seqs[std::size_t(si)];
      const std::int64_t n = std::int64_t(s.toks.size());
      const std::int64_t len = n < s.prompt ? std::min(s.prompt - n, uni(1, 3 * C + 5)) : (uni(0, 7) == 0 ? 0 : 1);
      const std::int64_t to = std::min(n + len, s.target);
      while (std::int64_t(s.toks.size()) < to) s.toks.push_back(random_tok(d, rng));
      record_len(s);
      if (to - n > 1) prefill_row = true;
      if (to - n == 1) decode_row = true;
      plan.push_back({si, sl, n, to});
    }
    for (std::int64_t i = uni(0, 2); i > 0; --i) plan.push_back({-1, -1, 0, uni(0, 3)});
    std::shuffle(plan.begin(), plan.end(), rng);
    mixed += prefill_row && decode_row;
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
    for (std::size_t r = 0; r < plan.size(); ++r) {
      const Plan& pl = plan[r];
      const std::int64_t t0 = b.start[r], t1 = b.start[r + 1];
      if (pl.seq < 0) {
        const auto zero = [](float x) { return x == 0.f; };
        REQUIRE(std::all_of(b.out.begin() + t0 * d.Hq * d.Dv, b.out.begin() + t1 * d.Hq * d.Dv, zero));
        REQUIRE(std::all_of(b.lse.begin() + t0 * d.Hq, b.lse.begin() + t1 * d.Hq, zero));
        continue;
      }
      KvmSeq& s = seqs[std::size_t(pl.seq)];
      REQUIRE(st.state.tokens(pl.slot) == pl.to);  // run() fenced
      max_seen = std::max(max_seen, pl.to);
      std::copy(b.out.begin() + t0 * d.Hq * d.Dv, b.out.begin() + t1 * d.Hq * d.Dv,
                s.out.begin() + pl.from * d.Hq * d.Dv);
      std::copy(b.lse.begin() + t0 * d.Hq, b.lse.begin() + t1 * d.Hq, s.lse.begin() + pl.from * d.Hq);
      std::fill(s.has.begin() + pl.from, s.has.begin() + pl.to, 1);
    }
    std::vector<std::int32_t> leaving;
    for (std::int32_t sl = 0; sl < kSlots; ++sl) {
      const std::int32_t si = owner[std::size_t(sl)];
      if (si < 0) continue;
      const std::int64_t n = std::int64_t(seqs[std::size_t(si)].toks.size());
      if (n >= seqs[std::size_t(si)].target || (si != 0 && uni(0, 400) == 0)) {
        leaving.push_back(sl);
        continue;
      }
      const auto free = std::find(owner.begin(), owner.end(), -1);
      if (n > 0 && forks < 12 && uni(0, 30) == 0 && free != owner.end()) {  // fork into a free slot
        const std::int32_t dst = std::int32_t(free - owner.begin());
        const DevList ls({sl}), ld({dst});
        REQUIRE(kvm::copy_slots(kexec(), st.state, ls.tv(), ld.tv()).is_ok());
        KvmSeq child;
        child.toks = seqs[std::size_t(si)].toks;
        child.target = std::min(max_len, n + uni(1, 300));
        child.prompt = n + uni(0, 1) * uni(1, 100);
        child.slot = dst;
        child.has.assign(std::size_t(n), 0);  // positions before the fork are the parent's results
        record_len(child);
        owner[std::size_t(dst)] = std::int32_t(seqs.size());
        seqs.push_back(std::move(child));
        ++forks;
        ++created;
      } else if (n > 0 && uni(0, 40) == 0 && free != owner.end()) {  // migrate: export, import elsewhere, reset
        const std::int32_t to = std::int32_t(free - owner.begin());
        const auto rec = kvm_record(st.state, sl);
        REQUIRE(kvm::import_slot(kexec(), st.state, w.device(), to, rec).is_ok());
        REQUIRE(kvm_record(st.state, to) == rec);
        const DevList old({sl});
        REQUIRE(kvm::reset_slots(kexec(), st.state, old.tv()).is_ok());
        owner[std::size_t(to)] = si;
        owner[std::size_t(sl)] = -1;
        seqs[std::size_t(si)].slot = to;
        ++migrations;
        continue;
      }
      if (n > 0 && uni(0, 12) == 0) {  // truncate: exact, or refused with the state untouched
        KvmSeq& t = seqs[std::size_t(owner[std::size_t(sl)])];
        const std::int64_t cut = uni(1, std::min<std::int64_t>(n, 2 * C));
        const auto before = kvm_record(st.state, sl);
        const Status ts = kvm::truncate(kexec(), st.state, sl, cut);
        INFO("truncate " << cut << " of " << n << ": " << ts.to_string());
        REQUIRE(ts.is_ok() == truncate_exact(C, kWindowChunks, n, cut));
        if (ts.is_ok()) {
          t.toks.resize(std::size_t(n - cut));
          record_len(t);
          t.prompt = std::min(t.prompt, n - cut);
          REQUIRE(st.state.tokens(sl) == n - cut);
          ++truncations;
        } else {
          REQUIRE(ts.code() == StatusCode::kInvalidArgument);
          REQUIRE(kvm_record(st.state, sl) == before);
          ++refused;
        }
      }
    }
    for (std::int32_t sl : leaving) finish(owner[std::size_t(sl)]);
    if (!leaving.empty()) {
      const DevList l(leaving);
      REQUIRE(kvm::reset_slots(kexec(), st.state, l.tv()).is_ok());
      kexec().space.fence();
      for (std::int32_t sl : leaving) REQUIRE(st.state.tokens(sl) == 0);
      ++resets;
    }
  }
  INFO("longest " << max_seen << " sequences " << created << " forks " << forks << " migrations " << migrations
                  << " truncations " << truncations << " refused " << refused << " rows checked " << checked_rows);
  CHECK(created >= 32);
  CHECK(max_seen == max_len);
  CHECK(min_len == 1);
  CHECK(mixed > 0);
  CHECK(forks > 0);
  CHECK(truncations > 0);
  CHECK(refused > 0);
  CHECK(resets > 0);
  CHECK(checked_rows > 0);
}

}  // namespace

TEST_CASE("kokkos kvm step: continuous batching equals each sequence alone, fixed and 16 sqrt N budgets", "[slots]") {
  SECTION("fp32, fixed budget") {
    kvm_schedule<float>(kvmem::budget::Fixed{16, 16}, 11, 32, 400);
  }
  SECTION("bf16, 16 sqrt N budget") {
    kvm_schedule<kvmem::bf16>(kvmem::budget::Power{16.0, 0.5, 16, 1, 100000}, 12, 32, 400);
  }
}

TEST_CASE("kokkos kvm step: continuous batching of 1..3000-token sequences equals each alone", "[slots]") {
  SECTION("fp32, fixed budget") {
    kvm_schedule<float>(kvmem::budget::Fixed{16, 16}, 21, 34, 3000);
  }
  SECTION("fp32, 16 sqrt N budget") {
    kvm_schedule<float>(kvmem::budget::Power{16.0, 0.5, 16, 1, 100000}, 22, 34, 3000);
  }
}

TEST_CASE("kokkos kvm slots: records travel host -> Kokkos and Kokkos -> host and continue alike", "[slots]") {
  const Dims d;
  const kvm::Params p = make_params(kvmem::budget::Power{16.0, 0.5, 16, 1, 100000});
  const Weights w(d, 5);
  std::mt19937_64 rng(5);
  std::vector<Tok> toks;
  for (int i = 0; i < 300; ++i) toks.push_back(random_tok(d, rng));
  const std::int64_t n_ctx = 512;
  for (const bool host_first : {true, false}) {
    INFO((host_first ? "host -> Kokkos" : "Kokkos -> host"));
    kvm::State<float, float> hs;
    REQUIRE(kvm::State<float, float>::create(p, {3, d.Hq, d.Hk, d.D, d.Dv, n_ctx}, hs).is_ok());
    auto ks = make_kstate<float>(p, d, 3, n_ctx);
    // the source runs 0..250 in three rows in slot 1; its record moves to slot 2 of the other backend
    for (const auto& [a, e] : {std::pair<std::int64_t, std::int64_t>{0, 100}, {100, 237}, {237, 250}}) {
      Batch b;
      b.add(1, toks, a, e);
      REQUIRE((host_first ? b.run_host(hs, w, d) : b.run(ks, w, d)).is_ok());
    }
    const auto rec = host_first ? kvm_record(hs, 1, false) : kvm_record(ks.state, 1);
    const Status s = host_first ? kvm::import_slot(kexec(), ks.state, w.device(), 2, rec)
                                : kvm::import_slot(hexec, hs, w.host(), 2, rec);
    INFO(s.to_string());
    REQUIRE(s.is_ok());
    REQUIRE((host_first ? kvm_record(ks.state, 2) : kvm_record(hs, 2, false)) == rec);
    // both continue with tokens 250..300 (a chunk boundary inside): the same results on either side
    for (const auto& [a, e] : {std::pair<std::int64_t, std::int64_t>{250, 251}, {251, 280}, {280, 300}}) {
      Batch hb, kb;
      hb.add(host_first ? 1 : 2, toks, a, e);
      kb.add(host_first ? 2 : 1, toks, a, e);
      REQUIRE(hb.run_host(hs, w, d).is_ok());
      REQUIRE(kb.run(ks, w, d).is_ok());
      KVMEM_KOKKOS_CHECK_AS_HOST(kb.out, hb.out, kTolFp32);
      KVMEM_KOKKOS_CHECK_AS_HOST(kb.lse, hb.lse, kTolFp32);
    }
    kvmem::test::check_record_as_host(kvm_record(ks.state, host_first ? 2 : 1),
                                      kvm_record(hs, host_first ? 1 : 2, false), kTolFp32);
  }
}

TEST_CASE("kokkos kvm slots: bad slots, bad rows and refused records leave the state as its twin", "[slots]") {
  const Dims d;
  const kvm::Params p = make_params(kvmem::budget::Fixed{16, 16});
  const Weights w(d, 8);
  std::mt19937_64 rng(8);
  std::vector<Tok> toks;
  for (int i = 0; i < 300; ++i) toks.push_back(random_tok(d, rng));
  auto a = make_kstate<float>(p, d, 4, 256);
  auto twin = make_kstate<float>(p, d, 4, 256);
  for (auto* st : {&a, &twin}) {
    Batch b;
    b.add(0, toks, 0, 70);
    b.add(2, toks, 0, 120);
    REQUIRE(b.run(*st, w, d).is_ok());
  }
  const auto expect_untouched = [&](const Status& s, StatusCode code) {
    INFO(s.to_string());
    CHECK(s.code() == code);
    CHECK(kvm_state_of(a.state) == kvm_state_of(twin.state));
  };
  SECTION("slot lists") {
    expect_untouched(kvm::reset_slots(kexec(), a.state, DevList({1, 4}).tv()), StatusCode::kOutOfRange);
    expect_untouched(kvm::reset_slots(kexec(), a.state, DevList({-1}).tv()), StatusCode::kOutOfRange);
    expect_untouched(kvm::copy_slots(kexec(), a.state, DevList({0}).tv(), DevList({7}).tv()), StatusCode::kOutOfRange);
    expect_untouched(kvm::copy_slots(kexec(), a.state, DevList({9}).tv(), DevList({1}).tv()), StatusCode::kOutOfRange);
    expect_untouched(kvm::copy_slots(kexec(), a.state, DevList({0, 2}).tv(), DevList({1, 1}).tv()),
                     StatusCode::kInvalidArgument);
    expect_untouched(kvm::copy_slots(kexec(), a.state, DevList({0, 2}).tv(), DevList({2, 3}).tv()),
                     StatusCode::kInvalidArgument);  // a destination that is another pair's source
    expect_untouched(kvm::copy_slots(kexec(), a.state, DevList({0}).tv(), DevList({1, 3}).tv()),
                     StatusCode::kInvalidArgument);
  }
  SECTION("single-slot operations") {
    std::vector<std::byte> buf(kvm::export_bytes(a.state));
    expect_untouched(kvm::export_slot(kexec(), a.state, 4, std::span<std::byte>(buf)), StatusCode::kOutOfRange);
    expect_untouched(kvm::truncate(kexec(), a.state, -1, 0), StatusCode::kOutOfRange);
    expect_untouched(kvm::truncate(kexec(), a.state, 0, 71), StatusCode::kOutOfRange);
    expect_untouched(kvm::truncate(kexec(), a.state, 2, 30), StatusCode::kInvalidArgument);  // an update absorbed them
    auto rec = kvm_record(a.state, 0);
    expect_untouched(kvm::import_slot(kexec(), a.state, w.device(), 4, rec), StatusCode::kOutOfRange);
    auto bad = rec;
    bad[8] = std::byte{9};  // the format version
    expect_untouched(kvm::import_slot(kexec(), a.state, w.device(), 1, bad), StatusCode::kInvalidArgument);
    bad = rec;
    bad.pop_back();
    expect_untouched(kvm::import_slot(kexec(), a.state, w.device(), 1, bad), StatusCode::kInvalidArgument);
    const kvm::Params other = make_params(kvmem::budget::Fixed{24, 24});
    auto o = make_kstate<float>(other, d, 1, 256);
    Batch ob;
    ob.add(0, toks, 0, 10);
    REQUIRE(ob.run(o, w, d).is_ok());
    const Status s = kvm::import_slot(kexec(), a.state, w.device(), 1, kvm_record(o.state, 0));
    CHECK(s.to_string().find("budget_minimum") != std::string::npos);
    expect_untouched(s, StatusCode::kInvalidArgument);
  }
  SECTION("step rows and values") {
    const auto step = [&](Slots slots, Slots starts, float poison = 0.f) {
      Batch b;
      for (std::size_t r = 0; r < slots.size(); ++r) {
        const std::int64_t n = starts[r + 1] - starts[r];
        b.add(slots[r], toks, 70, 70 + std::max<std::int64_t>(n, 0));
      }
      b.start = starts;
      if (poison != 0.f) b.k[3] = poison;
      return b.run(a, w, d);
    };
    expect_untouched(step({1, 5}, {0, 2, 3}), StatusCode::kOutOfRange);                      // slot outside
    expect_untouched(step({1, 1}, {0, 2, 3}), StatusCode::kInvalidArgument);                 // one slot, two rows
    expect_untouched(step({1, 3}, {0, 2, 1}), StatusCode::kInvalidArgument);                 // starts decrease
    expect_untouched(step({1, 3}, {1, 2, 3}), StatusCode::kInvalidArgument);                 // query_start[0] != 0
    expect_untouched(step({1, 3}, {0, 2, 3}, std::nanf("")), StatusCode::kInvalidArgument);  // NaN key
    expect_untouched(step({2}, {0, 137}), StatusCode::kOutOfRange);                          // 120 + 137 > n_ctx
    // a row naming a slot over Rows::max_query_len (a padding row may be longer)
    Batch over;
    over.add(1, toks, 70, 75);
    over.add(-1, toks, 0, 9);
    over.add(3, toks, 70, 76);
    over.max_query_len = 5;
    const Status s = over.run(a, w, d);
    CHECK(s.message().find("max_query_len") != std::string::npos);
    CHECK(s.message().find("row 2") != std::string::npos);
    expect_untouched(s, StatusCode::kInvalidArgument);
  }
}

TEST_CASE("kokkos kvm slots: moved-from and never-created states refuse every operation", "[slots]") {
  const Dims d;
  const kvm::Params p = make_params(kvmem::budget::Fixed{16, 16});
  const Weights w(d, 9);
  std::mt19937_64 rng(9);
  std::vector<Tok> toks;
  for (int i = 0; i < 20; ++i) toks.push_back(random_tok(d, rng));
  auto src = make_kstate<float>(p, d, 2, 64);
  KState<float> owner = std::move(src);
  KState<float> never;
  Batch b;
  b.add(0, toks, 0, 20);
  REQUIRE(b.run(owner, w, d).is_ok());
  const auto owner_state = kvm_state_of(owner.state);
  for (KState<float>* e : {&src, &never}) {
    CHECK_FALSE(e->state.valid());
    CHECK(e->state.max_slots() == 0);
    CHECK(kvm::export_bytes(e->state) == 0);
    CHECK(kvm::export_bytes(e->state, 0) == 0);
    CHECK_FALSE(b.run(*e, w, d).is_ok());
    CHECK_FALSE(kvm::reset_slots(kexec(), e->state, DevList({0}).tv()).is_ok());
    CHECK_FALSE(kvm::copy_slots(kexec(), e->state, DevList({0}).tv(), DevList({1}).tv()).is_ok());
    std::vector<std::byte> buf(4096);
    CHECK_FALSE(kvm::export_slot(kexec(), e->state, 0, std::span<std::byte>(buf)).is_ok());
    CHECK_FALSE(kvm::import_slot(kexec(), e->state, w.device(), 0, kvm_record(owner.state, 0)).is_ok());
    CHECK_FALSE(kvm::truncate(kexec(), e->state, 0, 0).is_ok());
  }
  CHECK(kvm_state_of(owner.state) == owner_state);  // the new owner saw none of it
}

// ================================ Universal Attention ================================================

namespace {

struct UaShape {
  std::int64_t H = 4, G = 2, D = 8;  // GQA groups of two query heads
};
template <class Storage>
using KCache = kvmem::kokkos::UaCache<Storage, Mem>;

template <class Storage>
KCache<Storage> make_kcache(std::int64_t slots, std::int64_t capacity) {
  const UaShape sh;
  KCache<Storage> c;
  REQUIRE(
      kvmem::kokkos::create_cache<Storage>(kexec(), kua::CacheShape{slots, sh.H, sh.G, sh.D, capacity, 16}, c).is_ok());
  return c;
}

// One sequence's inputs, token-major: q [L,H,D], k, v [L,G,D], z_k, z_q [L,G]; unit-norm keys and gate
// logits ~ N(1, 1.5), which evict at p = 0.05.
struct UaSeq {
  std::int64_t L = 0;
  std::vector<float> q, k, v, z_k, z_q;
  void grow(std::int64_t n, std::mt19937_64& rng) {
    const UaShape sh;
    std::normal_distribution<float> n01(0.0f, 1.0f), gate(1.0f, 1.5f);
    for (std::int64_t t = L; t < n; ++t) {
      for (std::int64_t x = 0; x < sh.H * sh.D; ++x) q.push_back(2.0f * n01(rng));
      for (std::int64_t g = 0; g < sh.G; ++g) {
        std::vector<float> key(std::size_t(sh.D));
        double norm = 0.0;
        for (auto& x : key) x = n01(rng), norm += double(x) * x;
        for (auto& x : key) k.push_back(float(x / (std::sqrt(norm) + 1e-6)));
        for (std::int64_t d = 0; d < sh.D; ++d) v.push_back(n01(rng));
        z_k.push_back(gate(rng));
        z_q.push_back(gate(rng));
      }
    }
    L = n;
  }
};

// Packed inputs of one UA step (host vectors), run on Kokkos or on the host.
struct UaPacked {
  std::vector<float> q, k, v, z_k, z_q, out, lse;
  Slots slot, query_start{0};
  std::int64_t N = 0;
  void add(std::int32_t s, const UaSeq* x, std::int64_t t0, std::int64_t T, std::mt19937_64& rng) {
    const UaShape sh;
    if (x != nullptr && t0 + T > x->L)
      throw std::out_of_range("UaPacked::add: tokens [" + std::to_string(t0) + ", " + std::to_string(t0 + T) +
                              ") of a sequence of " + std::to_string(x->L));
    std::normal_distribution<float> n01(0.0f, 1.0f);
    const auto take = [&](std::vector<float>& to, const std::vector<float>* from, std::int64_t width) {
      for (std::int64_t e = t0 * width; e < (t0 + T) * width; ++e)
        to.push_back(from ? (*from)[std::size_t(e)] : n01(rng));
    };
    take(q, x ? &x->q : nullptr, sh.H * sh.D);
    take(k, x ? &x->k : nullptr, sh.G * sh.D);
    take(v, x ? &x->v : nullptr, sh.G * sh.D);
    take(z_k, x ? &x->z_k : nullptr, sh.G);
    take(z_q, x ? &x->z_q : nullptr, sh.G);
    N += T;
    slot.push_back(s);
    query_start.push_back(std::int32_t(N));
  }
  template <class Storage>
  Status run(KCache<Storage>& cache, const kua::Options& opt) {
    const UaShape sh;
    const auto dev = [](const std::vector<float>& x) {
      return to_device(x.empty() ? std::vector<float>{0.f} : x, std::max<std::size_t>(1, x.size()));
    };
    const auto dq = dev(q), dk = dev(k), dv = dev(v), dzk = dev(z_k), dzq = dev(z_q);
    const auto dout = dev(std::vector<float>(std::size_t(N * sh.H * sh.D), std::nanf("")));
    const auto dlse = dev(std::vector<float>(std::size_t(N * sh.H), std::nanf("")));
    const DevList ds(slot), dst(query_start);
    kua::PackedInputs in;
    in.q = {dq.data(), {N, sh.H, sh.D}};
    in.k = {dk.data(), {N, sh.G, sh.D}};
    in.v = {dv.data(), {N, sh.G, sh.D}};
    in.z_k = {dzk.data(), {N, sh.G}};
    in.z_q = {dzq.data(), {N, sh.G}};
    const Rows rows{ds.tv(), {dst.view.data(), {std::int64_t(query_start.size())}}};
    const Status s = kua::step(kexec(), cache, rows, in, opt, TensorView<float, 3>(dout.data(), {N, sh.H, sh.D}),
                               TensorView<float, 2>(dlse.data(), {N, sh.H}));
    kexec().space.fence();
    out = to_host(dout);
    lse = to_host(dlse);
    out.resize(std::size_t(N * sh.H * sh.D));
    lse.resize(std::size_t(N * sh.H));
    return s;
  }
  template <class Storage>
  Status run_host(kua::PrunedCache<Storage>& cache, const kua::Options& opt) {
    const UaShape sh;
    out.assign(std::size_t(N * sh.H * sh.D), std::nanf(""));
    lse.assign(std::size_t(N * sh.H), std::nanf(""));
    kua::PackedInputs in;
    in.q = {q.data(), {N, sh.H, sh.D}};
    in.k = {k.data(), {N, sh.G, sh.D}};
    in.v = {v.data(), {N, sh.G, sh.D}};
    in.z_k = {z_k.data(), {N, sh.G}};
    in.z_q = {z_q.data(), {N, sh.G}};
    const Rows rows{I32View(slot.data(), {std::int64_t(slot.size())}),
                    I32View(query_start.data(), {std::int64_t(query_start.size())})};
    return kua::step(kvmem::host::Executor{1}, cache, rows, in, opt, TensorView<float, 3>(out.data(), {N, sh.H, sh.D}),
                     TensorView<float, 2>(lse.data(), {N, sh.H}));
  }
};

// The oracle: the sequence alone on Kokkos with its own row lengths, each row a ua::prefill (> 1 token)
// or ua::decode (1 token) on a one-slot cache over batch-major views [1,H,T,D]. out [n,H,D].
template <class Storage>
std::vector<float> ua_alone(const UaSeq& s, const std::vector<std::int64_t>& rows, const kua::Options& opt,
                            std::int64_t capacity) {
  const UaShape sh;
  const std::int64_t H = sh.H, G = sh.G, D = sh.D;
  auto cache = make_kcache<Storage>(1, capacity);
  std::vector<float> out;
  std::int64_t t0 = 0;
  for (const std::int64_t T : rows) {
    std::vector<float> q(std::size_t(H * T * D)), k(std::size_t(G * T * D)), v(k.size()), zk(std::size_t(G * T)),
        zq(zk.size());
    for (std::int64_t t = 0; t < T; ++t) {
      for (std::int64_t h = 0; h < H; ++h)
        for (std::int64_t d = 0; d < D; ++d)
          q[std::size_t((h * T + t) * D + d)] = s.q[std::size_t(((t0 + t) * H + h) * D + d)];
      for (std::int64_t g = 0; g < G; ++g) {
        for (std::int64_t d = 0; d < D; ++d) {
          k[std::size_t((g * T + t) * D + d)] = s.k[std::size_t(((t0 + t) * G + g) * D + d)];
          v[std::size_t((g * T + t) * D + d)] = s.v[std::size_t(((t0 + t) * G + g) * D + d)];
        }
        zk[std::size_t(g * T + t)] = s.z_k[std::size_t((t0 + t) * G + g)];
        zq[std::size_t(g * T + t)] = s.z_q[std::size_t((t0 + t) * G + g)];
      }
    }
    const auto dq = to_device(q, 1, H, T, D), dk = to_device(k, 1, G, T, D), dv = to_device(v, 1, G, T, D);
    const auto dzk = to_device(zk, 1, G, T), dzq = to_device(zq, 1, G, T);
    const auto dout = to_device(std::vector<float>(std::size_t(T * H * D), std::nanf("")), 1, T, H, D);
    kua::Inputs in;
    in.q = TensorView<const float, 4>(to_tensor_view(dq));
    in.k = TensorView<const float, 4>(to_tensor_view(dk));
    in.v = TensorView<const float, 4>(to_tensor_view(dv));
    in.z_k = TensorView<const float, 3>(to_tensor_view(dzk));
    in.z_q = TensorView<const float, 3>(to_tensor_view(dzq));
    const Status st = T == 1 ? kua::decode(kexec(), cache, in, opt, to_tensor_view(dout))
                             : kua::prefill(kexec(), cache, in, opt, to_tensor_view(dout));
    INFO(st.to_string());
    REQUIRE(st.is_ok());
    kexec().space.fence();
    const auto o = to_host(dout);
    out.insert(out.end(), o.begin(), o.end());
    t0 += T;
  }
  return out;
}

template <class Storage>
std::vector<std::byte> ua_record(const KCache<Storage>& c, std::int32_t slot) {
  kexec().space.fence();
  std::vector<std::byte> rec(kua::export_bytes(c, slot));
  const Status s = kua::export_slot(kexec(), c, slot, std::span<std::byte>(rec));
  INFO(s.to_string());
  REQUIRE(s.is_ok());
  return rec;
}
template <class Storage>
std::vector<std::byte> ua_record(const kua::PrunedCache<Storage>& c, std::int32_t slot) {
  std::vector<std::byte> rec(kua::export_bytes(c, slot));
  REQUIRE(kua::export_slot(kvmem::host::Executor{}, c, slot, std::span<std::byte>(rec)).is_ok());
  return rec;
}
// The whole canonical state of a Kokkos cache: every slot's record plus lengths, peaks and counters.
template <class Storage>
std::vector<std::vector<std::byte>> ua_state_of(const KCache<Storage>& c) {
  std::vector<std::vector<std::byte>> all;
  for (std::int32_t s = 0; s < c.max_slots(); ++s) all.push_back(ua_record(c, s));
  const auto snap = kvmem::kokkos::snapshot(c);
  for (const auto* v : {&snap.length, &snap.peak, &snap.counter}) {
    std::vector<std::byte> b(v->size() * sizeof(std::int64_t));
    if (!b.empty()) std::memcpy(b.data(), v->data(), b.size());
    all.push_back(b);
  }
  return all;
}

struct UaLive {
  UaSeq data;
  std::int64_t target = 0, done = 0, prompt = 0;
  std::vector<std::int64_t> history;  // row lengths run so far (the oracle replays them)
  std::vector<float> out;             // [done,H,D]
  std::int32_t slot = -1;
};

// The UA schedule: as the KVM one, with UA's slot operations (truncate exact for none or all tokens,
// refused otherwise) and each sequence compared with itself run alone with the same row lengths.
template <class Storage>
void ua_schedule(std::uint64_t seed, const kua::Options& opt, int sequences, std::int64_t max_len) {
  const UaShape sh;
  const std::int64_t H = sh.H, D = sh.D, kSlots = 16, capacity = max_len;
  auto cache = make_kcache<Storage>(kSlots, capacity);
  std::mt19937_64 rng(seed);
  const auto uni = [&](std::int64_t a, std::int64_t b) {
    return std::uniform_int_distribution<std::int64_t>(a, b)(rng);
  };
  std::vector<UaLive> all;
  std::vector<std::int32_t> owner(std::size_t(kSlots), -1);
  int created = 0, forks = 0, migrations = 0, exact_truncations = 0, refused = 0, mixed = 0, padding = 0;
  std::int64_t max_seen = 0, min_len = 1 << 30, evicted = 0;
  const auto new_len = [&]() -> std::int64_t {
    if (created == 0) return max_len;
    if (created == 1) return 1;
    const double u = std::uniform_real_distribution<double>(0.0, std::log(double(max_len)))(rng);
    return std::max<std::int64_t>(1, std::min<std::int64_t>(max_len, std::int64_t(std::exp(u))));
  };
  const auto active = [&]() {
    std::vector<std::int32_t> a;
    for (std::int32_t s = 0; s < kSlots; ++s)
      if (owner[std::size_t(s)] >= 0) a.push_back(s);
    return a;
  };
  while (created < sequences || !active().empty()) {
    for (std::int32_t sl = 0; sl < kSlots && created < sequences; ++sl)
      if (owner[std::size_t(sl)] < 0 && uni(0, 2) > 0) {
        REQUIRE(kua::reset_slots(kexec(), cache, DevList({sl}).tv()).is_ok());
        UaLive x;
        x.target = new_len();
        x.prompt = x.target - uni(0, std::min<std::int64_t>(x.target, 40));
        x.slot = sl;
        min_len = std::min(min_len, x.target);
        owner[std::size_t(sl)] = std::int32_t(all.size());
        all.push_back(std::move(x));
        ++created;
      }
    const auto act = active();
    const auto free = std::find(owner.begin(), owner.end(), -1);
    if (!act.empty() && free != owner.end() && forks < 8 && uni(0, 3) == 0) {  // fork
      const std::int32_t from = act[std::size_t(uni(0, std::int64_t(act.size()) - 1))];
      const UaLive& parent = all[std::size_t(owner[std::size_t(from)])];
      if (parent.done > 0) {
        const std::int32_t to = std::int32_t(free - owner.begin());
        REQUIRE(kua::copy_slots(kexec(), cache, DevList({from}).tv(), DevList({to}).tv()).is_ok());
        UaLive x;
        x.data = parent.data;
        x.data.L = parent.done;
        x.data.q.resize(std::size_t(parent.done * H * D));
        x.data.k.resize(std::size_t(parent.done * sh.G * D));
        x.data.v.resize(x.data.k.size());
        x.data.z_k.resize(std::size_t(parent.done * sh.G));
        x.data.z_q.resize(x.data.z_k.size());
        x.done = parent.done;
        x.history = parent.history;
        x.out = parent.out;
        x.target = std::min(max_len, parent.done + uni(1, 200));
        x.prompt = parent.done + uni(0, 1) * uni(1, 60);
        x.slot = to;
        owner[std::size_t(to)] = std::int32_t(all.size());
        all.push_back(std::move(x));
        ++created;
        ++forks;
      }
    }
    if (!act.empty() && std::find(owner.begin(), owner.end(), -1) != owner.end() && uni(0, 9) == 0) {  // migrate
      const std::int32_t from = act[std::size_t(uni(0, std::int64_t(act.size()) - 1))];
      const std::int32_t to = std::int32_t(std::find(owner.begin(), owner.end(), -1) - owner.begin());
      const auto rec = ua_record(cache, from);
      REQUIRE(kua::import_slot(kexec(), cache, to, rec).is_ok());
      CHECK(ua_record(cache, to) == rec);
      REQUIRE(kua::reset_slots(kexec(), cache, DevList({from}).tv()).is_ok());
      owner[std::size_t(to)] = owner[std::size_t(from)];
      owner[std::size_t(from)] = -1;
      all[std::size_t(owner[std::size_t(to)])].slot = to;
      ++migrations;
    }
    if (!act.empty() && uni(0, 4) == 0) {  // truncate: 0 exact, a middle count refused, nothing changes
      const std::int32_t sl = std::find(owner.begin(), owner.end(), -1) == owner.end() ? act[0] : act.back();
      if (owner[std::size_t(sl)] >= 0) {
        const UaLive& x = all[std::size_t(owner[std::size_t(sl)])];
        const auto before = ua_state_of(cache);
        if (x.done >= 2) {
          CHECK(kua::truncate(kexec(), cache, sl, uni(1, x.done - 1)).code() == StatusCode::kUnsupported);
          ++refused;
        } else {
          CHECK(kua::truncate(kexec(), cache, sl, 0).is_ok());
          ++exact_truncations;
        }
        CHECK(ua_state_of(cache) == before);
      }
    }
    // one step: each active sequence its next row (a prompt chunk or one decode token), padding between
    struct Plan {
      std::int32_t slot;
      std::int64_t T;
    };
    std::vector<Plan> plan;
    for (const std::int32_t sl : active()) {
      if (uni(0, 3) == 0) plan.push_back({-1, uni(0, 2)});
      if (uni(0, 4) == 0) continue;
      UaLive& x = all[std::size_t(owner[std::size_t(sl)])];
      const std::int64_t T = x.done < x.prompt ? std::min(x.prompt - x.done, uni(1, 300)) : (uni(0, 10) == 0 ? 0 : 1);
      x.data.grow(std::min(x.target, x.done + T), rng);
      plan.push_back({sl, std::min(T, x.target - x.done)});
    }
    std::shuffle(plan.begin(), plan.end(), rng);
    if (plan.empty()) continue;
    UaPacked p;
    bool pre = false, dec = false;
    for (const Plan& pl : plan) {
      if (pl.slot < 0) {
        p.add(-1, nullptr, 0, pl.T, rng);
        ++padding;
        continue;
      }
      const UaLive& x = all[std::size_t(owner[std::size_t(pl.slot)])];
      p.add(pl.slot, &x.data, x.done, pl.T, rng);
      if (pl.T > 1) pre = true;
      if (pl.T == 1) dec = true;
    }
    mixed += pre && dec;
    const Status s = p.run(cache, opt);
    INFO(s.to_string());
    REQUIRE(s.is_ok());
    const auto snap = kvmem::kokkos::snapshot(cache);
    for (std::size_t r = 0; r < plan.size(); ++r) {
      const std::int64_t x0 = p.query_start[r], x1 = p.query_start[r + 1];
      if (plan[r].slot < 0) {
        for (std::int64_t e = x0 * H * D; e < x1 * H * D; ++e) REQUIRE(p.out[std::size_t(e)] == 0.0f);
        for (std::int64_t e = x0 * H; e < x1 * H; ++e) REQUIRE(p.lse[std::size_t(e)] == 0.0f);
        continue;
      }
      UaLive& x = all[std::size_t(owner[std::size_t(plan[r].slot)])];
      if (x1 == x0) continue;
      x.out.insert(x.out.end(), p.out.begin() + x0 * H * D, p.out.begin() + x1 * H * D);
      for (std::int64_t e = x0 * H; e < x1 * H; ++e) CHECK(std::isfinite(p.lse[std::size_t(e)]));
      x.done += x1 - x0;
      x.history.push_back(x1 - x0);
      REQUIRE(snap.counter[std::size_t(plan[r].slot)] == x.done);
      max_seen = std::max(max_seen, x.done);
    }
    for (const std::int32_t sl : active()) {  // leave: done, or cut short (truncate of every token: exact)
      UaLive& x = all[std::size_t(owner[std::size_t(sl)])];
      for (std::int64_t g = 0; g < sh.G; ++g) evicted += x.done - snap.length_of(sl, g);
      const bool longest = owner[std::size_t(sl)] == 0;  // the first sequence runs to max_len
      if (x.done >= x.target || (!longest && x.done > 0 && uni(0, 60) == 0)) {
        if (uni(0, 1) == 0) {
          REQUIRE(kua::truncate(kexec(), cache, sl, x.done).is_ok());
          const auto after = kvmem::kokkos::snapshot(cache);
          CHECK(after.counter[std::size_t(sl)] == 0);
          for (std::int64_t g = 0; g < sh.G; ++g) CHECK(after.length_of(sl, g) == 0);
          ++exact_truncations;
        }
        owner[std::size_t(sl)] = -1;
        x.slot = -1;
      }
    }
  }
  for (std::size_t i = 0; i < all.size(); ++i) {
    const UaLive& x = all[i];
    INFO("sequence " << i << " of " << x.done << " tokens in " << x.history.size() << " rows");
    CHECK(same_bits(x.out, ua_alone<Storage>(x.data, x.history, opt, capacity)));
  }
  INFO("sequences " << created << " forks " << forks << " migrations " << migrations << " truncations exact "
                    << exact_truncations << " refused " << refused << " padding rows " << padding);
  CHECK(created >= 32);
  CHECK(max_seen == max_len);
  CHECK(min_len == 1);
  CHECK(mixed > 0);
  CHECK(forks > 0);
  CHECK(migrations > 0);
  CHECK(exact_truncations > 0);
  CHECK(refused > 0);
  CHECK(padding > 0);
  if (opt.p > 0) CHECK(evicted > 0);
}

}  // namespace

TEST_CASE("kokkos ua step: continuous batching with pruning equals each sequence alone, bitwise", "[slots]") {
  SECTION("fp32, p = 0.05") {
    ua_schedule<float>(31, kua::Options{0.05, 64, true}, 32, 400);
  }
  SECTION("bf16, p = 0.05, evicting after attention") {
    ua_schedule<kvmem::bf16>(32, kua::Options{0.05, 48, false}, 32, 400);
  }
}

TEST_CASE("kokkos ua step: continuous batching of 1..3000-token sequences equals each alone", "[slots]") {
  ua_schedule<float>(41, kua::Options{0.05, 128, true}, 34, 3000);
}

TEST_CASE("kokkos ua slots: records travel host -> Kokkos and Kokkos -> host and continue alike", "[slots]") {
  const kua::Options opt{0.05, 32, true};
  std::mt19937_64 rng(3);
  UaSeq s;
  s.grow(261, rng);  // the tokens both directions read: 201 before the record, 60 after it
  for (const bool host_first : {true, false}) {
    INFO((host_first ? "host -> Kokkos" : "Kokkos -> host"));
    const UaShape sh;
    kua::PrunedCache<float> hc(kua::CacheShape{3, sh.H, sh.G, sh.D, 400, 16});
    auto kc = make_kcache<float>(3, 400);
    std::int64_t t = 0;
    for (const std::int64_t T : {100, 1, 99, 1}) {
      UaPacked p;
      p.add(1, &s, t, T, rng);
      REQUIRE((host_first ? p.run_host(hc, opt) : p.run(kc, opt)).is_ok());
      t += T;
    }
    const auto rec = host_first ? ua_record(hc, 1) : ua_record(kc, 1);
    const Status st =
        host_first ? kua::import_slot(kexec(), kc, 2, rec) : kua::import_slot(kvmem::host::Executor{}, hc, 2, rec);
    INFO(st.to_string());
    REQUIRE(st.is_ok());
    REQUIRE((host_first ? ua_record(kc, 2) : ua_record(hc, 2)) == rec);
    for (const std::int64_t T : {1, 40, 1, 18}) {  // both continue: the same results on either side
      UaPacked hp, kp;
      hp.add(host_first ? 1 : 2, &s, t, T, rng);
      kp.add(host_first ? 2 : 1, &s, t, T, rng);
      REQUIRE(hp.run_host(hc, opt).is_ok());
      REQUIRE(kp.run(kc, opt).is_ok());
      KVMEM_KOKKOS_CHECK_AS_HOST(kp.out, hp.out, kTolFp32);
      KVMEM_KOKKOS_CHECK_AS_HOST(kp.lse, hp.lse, kTolFp32);
      t += T;
    }
    kvmem::test::check_record_as_host(ua_record(kc, host_first ? 2 : 1), ua_record(hc, host_first ? 1 : 2), kTolFp32);
  }
}

TEST_CASE("kokkos ua slots: bad slots, rows, records and moved-from caches are refused, the cache untouched",
          "[slots]") {
  const kua::Options opt{0.0, 32, true};  // dense: slot 2 keeps all its 120 rows (the capacity case below)
  std::mt19937_64 rng(4);
  UaSeq s;
  s.grow(120, rng);
  auto a = make_kcache<float>(4, 128);
  auto twin = make_kcache<float>(4, 128);
  for (auto* c : {&a, &twin}) {
    UaPacked p;
    p.add(0, &s, 0, 70, rng);
    p.add(2, &s, 0, 120, rng);
    REQUIRE(p.run(*c, opt).is_ok());
  }
  const auto expect_untouched = [&](const Status& st, StatusCode code) {
    INFO(st.to_string());
    CHECK(st.code() == code);
    CHECK(ua_state_of(a) == ua_state_of(twin));
  };
  expect_untouched(kua::reset_slots(kexec(), a, DevList({1, 4}).tv()), StatusCode::kOutOfRange);
  expect_untouched(kua::copy_slots(kexec(), a, DevList({0}).tv(), DevList({5}).tv()), StatusCode::kOutOfRange);
  expect_untouched(kua::copy_slots(kexec(), a, DevList({0, 2}).tv(), DevList({1, 1}).tv()),
                   StatusCode::kInvalidArgument);
  expect_untouched(kua::copy_slots(kexec(), a, DevList({0, 2}).tv(), DevList({2, 3}).tv()),
                   StatusCode::kInvalidArgument);
  std::vector<std::byte> buf(1 << 16);
  expect_untouched(kua::export_slot(kexec(), a, 4, std::span<std::byte>(buf)), StatusCode::kOutOfRange);
  expect_untouched(kua::truncate(kexec(), a, 4, 0), StatusCode::kOutOfRange);
  expect_untouched(kua::truncate(kexec(), a, 0, 71), StatusCode::kOutOfRange);
  expect_untouched(kua::truncate(kexec(), a, 0, 10), StatusCode::kUnsupported);
  const auto rec = ua_record(a, 0);
  expect_untouched(kua::import_slot(kexec(), a, -1, rec), StatusCode::kOutOfRange);
  auto bad = rec;
  bad[8] = std::byte{7};  // the format version
  expect_untouched(kua::import_slot(kexec(), a, 1, bad), StatusCode::kInvalidArgument);
  {
    auto small = make_kcache<float>(1, 16);  // a record longer than this capacity is refused there
    const Status st = kua::import_slot(kexec(), small, 0, rec);
    CHECK(st.code() == StatusCode::kOutOfRange);
    CHECK(st.to_string().find("length") != std::string::npos);
  }
  const auto step = [&](Slots slots, Slots starts, float poison = 0.f) {
    UaPacked p;
    for (std::size_t r = 0; r < slots.size(); ++r)
      p.add(slots[r], &s, 70, std::max<std::int64_t>(0, starts[r + 1] - starts[r]), rng);
    p.query_start = starts;
    if (poison != 0.f) p.z_q[1] = poison;
    return p.run(a, opt);
  };
  expect_untouched(step({1, 5}, {0, 2, 3}), StatusCode::kOutOfRange);
  expect_untouched(step({1, 1}, {0, 2, 3}), StatusCode::kInvalidArgument);
  expect_untouched(step({1, 3}, {0, 2, 1}), StatusCode::kInvalidArgument);
  expect_untouched(step({1, 3}, {0, 2, 3}, std::nanf("")), StatusCode::kInvalidArgument);
  expect_untouched(step({2, 1}, {0, 40, 41}), StatusCode::kOutOfRange);  // slot 2 full: 120 + 40 > 128
  // moved-from and never-created caches
  KCache<float> owner = std::move(a);
  KCache<float> never;
  for (KCache<float>* e : {&a, &never}) {
    CHECK_FALSE(e->valid());
    CHECK(e->max_slots() == 0);
    CHECK(kua::export_bytes(*e, 0) == 0);
    UaPacked p;
    p.add(0, &s, 0, 3, rng);
    CHECK_FALSE(p.run(*e, opt).is_ok());
    CHECK_FALSE(kua::reset_slots(kexec(), *e, DevList({0}).tv()).is_ok());
    CHECK_FALSE(kua::copy_slots(kexec(), *e, DevList({0}).tv(), DevList({1}).tv()).is_ok());
    CHECK_FALSE(kua::export_slot(kexec(), *e, 0, std::span<std::byte>(buf)).is_ok());
    CHECK_FALSE(kua::import_slot(kexec(), *e, 0, rec).is_ok());
    CHECK_FALSE(kua::truncate(kexec(), *e, 0, 0).is_ok());
  }
  CHECK(ua_state_of(owner) == ua_state_of(twin));  // the new owner holds the state the twin has
}
