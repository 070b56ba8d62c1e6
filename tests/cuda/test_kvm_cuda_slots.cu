// SPDX-License-Identifier: Apache-2.0
// KVM sequence slots on the CUDA backend (docs/slots.md): kvm::step over ragged rows and the slot
// operations on a cuda::KvmState. The oracle of every row is its sequence run alone on the host
// backend (exact path, a one-slot state): outputs and lse within fp32 rounding (the readouts sum in
// another order), and the exported slot records -- counters, memory slots, window -- byte for byte
// (the CUDA update rounds every operation as the host does, so routes and state are identical; fp8
// storage quantises the readout rows by the host's rule). A CUDA graph of one padded decode step
// replays bitwise like the same steps run uncaptured, and so does one of copy_slots, reset_slots and a
// step. Slot lists are checked on the device: a refused list
// changes nothing and step_status returns the host backend's Status for it. Skips, saying so, when no
// CUDA device is visible.
#include "kvmem/backend/cuda/vendor.cuh"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <random>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <catch2/catch.hpp>

#include "cuda/cuda_test_support.hpp"
#include "kvmem/backend/cuda.hpp"
#include "kvmem/backend/host/kvm.hpp"

namespace {

using kvmem::Rows;
using kvmem::Status;
using kvmem::StatusCode;
using kvmem::TensorView;
namespace kvm = kvmem::kvm;
using namespace kvmem::test::cuda;
using I32View = TensorView<const std::int32_t, 1>;

// A slot list in device memory, as reset_slots and copy_slots take it on CUDA; view(n) is its first n.
struct DeviceList {
  Dev<std::int32_t> d;
  std::int64_t n;
  explicit DeviceList(const std::vector<std::int32_t>& host) : d(host), n(std::int64_t(host.size())) {}
  I32View view() const { return view(n); }
  I32View view(std::int64_t count) const { return I32View(d.ptr, {count}); }
};

kvmem::host::Executor exact_exec(int threads) {
  return {.threads = threads, .exact = true};
}

struct Dims {
  std::int64_t Hq = 4, Hk = 2, D = 32, Dv = 32;  // GQA: two query heads per KV head
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

struct RandomWeights {
  std::vector<float> w, b, ts, tw;
  Dev<float> dw, db, dts, dtw;
  static std::vector<float> draw(std::int64_t n, std::mt19937_64& rng, float mean, float spread) {
    std::normal_distribution<float> n01(0.f, 1.f);
    std::vector<float> x;
    for (std::int64_t i = 0; i < n; ++i) x.push_back(mean + spread * n01(rng));
    return x;
  }
  RandomWeights(const Dims& d, std::uint64_t seed, std::mt19937_64 rng = {})
      : w((rng.seed(seed), draw(d.D, rng, 1.f, 0.2f))),
        b(draw(d.D, rng, 0.f, 0.2f)),
        ts(draw(d.Hq, rng, 1.f, 0.2f)),
        tw(draw(d.Hq, rng, 1.f, 0.2f)),
        dw(w),
        db(b),
        dts(ts),
        dtw(tw) {}
  kvm::Weights host() const {
    return {{w.data(), {std::int64_t(w.size())}},
            {b.data(), {std::int64_t(b.size())}},
            {ts.data(), {std::int64_t(ts.size())}},
            {tw.data(), {std::int64_t(tw.size())}}};
  }
  kvmem::cuda::KvmWeights device() const { return {dw.ptr, db.ptr, dts.ptr, dtw.ptr}; }
};

// One token of a sequence, token-major: q [Hq,D], k [Hk,D], v [Hk,Dv], g [Hk]; values exact in the
// input type of storage S (input_type_t: S, bf16 for fp8), so the host (float inputs) and CUDA (inputs
// in that type) runs store the same window.
struct Tok {
  std::vector<float> q, k, v, g;
};
template <class S>
Tok random_tok(const Dims& d, std::mt19937_64& rng) {
  std::normal_distribution<float> n01(0.f, 1.f);
  const auto r = [](float x) { return kvmem::load_as<float>(kvmem::store_as<kvmem::input_type_t<S>>(x)); };
  Tok t;
  for (std::int64_t i = 0; i < d.Hq * d.D; ++i) t.q.push_back(r(n01(rng)));
  for (std::int64_t i = 0; i < d.Hk * d.D; ++i) t.k.push_back(r(n01(rng)));
  for (std::int64_t i = 0; i < d.Hk * d.Dv; ++i) t.v.push_back(r(n01(rng)));
  for (std::int64_t i = 0; i < d.Hk; ++i) {
    const float x = n01(rng);
    t.g.push_back(r(x > 0 ? 1.f + x : std::exp(x)));  // 1 + elu
  }
  return t;
}

// Packed inputs of one step (host copies), run on a CUDA state with inputs in input_type_t<S> and float
// outputs.
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
  template <class S>
  Status run(kvmem::cuda::KvmState<S>& st, const RandomWeights& w, const Dims& d) {
    using In = kvmem::input_type_t<S>;
    const std::int64_t T = tokens();
    Dev<std::int32_t> ds(slot), dst(start);
    Dev<In> dq(as_storage<In>(q)), dk(as_storage<In>(k)), dv(as_storage<In>(v)), dg(as_storage<In>(g));
    Dev<float> dout(std::vector<float>(std::size_t(T * d.Hq * d.Dv), -7.f)),
        dlse(std::vector<float>(std::size_t(T * d.Hq), -7.f));
    const Rows rows{I32View(ds.ptr, {std::int64_t(slot.size())}), I32View(dst.ptr, {std::int64_t(start.size())}),
                    max_query_len};
    const kvmem::cuda::Executor exec{};
    const Status s =
        kvm::step(exec, st, w.device(), rows, TensorView<const In, 3>(dq.ptr, {T, d.Hq, d.D}),
                  TensorView<const In, 3>(dk.ptr, {T, d.Hk, d.D}), TensorView<const In, 3>(dv.ptr, {T, d.Hk, d.Dv}),
                  TensorView<const In, 2>(dg.ptr, {T, d.Hk}), TensorView<float, 3>(dout.ptr, {T, d.Hq, d.Dv}),
                  TensorView<float, 2>(dlse.ptr, {T, d.Hq}));
    if (!s.is_ok()) return s;
    KVMEM_RETURN_IF_ERROR(kvmem::cuda::to_status(cudaDeviceSynchronize(), "sync after step"));
    out = dout.get();
    lse = dlse.get();
    return Status::ok();
  }
};

// The oracle: the sequence alone on the host backend, one exact step on a one-slot state. Fills out
// [T,Hq,Dv], lse [T,Hq] and the slot's record.
template <class S>
void alone(const kvm::Params& p, const Dims& d, std::int64_t n_ctx, const kvm::Weights& w, const std::vector<Tok>& toks,
           std::vector<float>& out, std::vector<float>& lse, std::vector<std::byte>& record) {
  const std::int64_t T = std::int64_t(toks.size());
  kvm::State<S, float> st;
  REQUIRE(kvm::State<S, float>::create(p, {1, d.Hq, d.Hk, d.D, d.Dv, n_ctx}, st).is_ok());
  std::vector<float> q, k, v, g;
  for (const Tok& t : toks) {
    q.insert(q.end(), t.q.begin(), t.q.end());
    k.insert(k.end(), t.k.begin(), t.k.end());
    v.insert(v.end(), t.v.begin(), t.v.end());
    g.insert(g.end(), t.g.begin(), t.g.end());
  }
  out.assign(std::size_t(T * d.Hq * d.Dv), -7.f);
  lse.assign(std::size_t(T * d.Hq), -7.f);
  const std::int32_t slot = 0, start[2] = {0, std::int32_t(T)};
  const Rows rows{I32View(&slot, {1}), I32View(start, {2})};
  const Status s =
      kvm::step(exact_exec(2), st, w, rows, TensorView<const float, 3>(q.data(), {T, d.Hq, d.D}),
                TensorView<const float, 3>(k.data(), {T, d.Hk, d.D}),
                TensorView<const float, 3>(v.data(), {T, d.Hk, d.Dv}), TensorView<const float, 2>(g.data(), {T, d.Hk}),
                TensorView<float, 3>(out.data(), {T, d.Hq, d.Dv}), TensorView<float, 2>(lse.data(), {T, d.Hq}));
  INFO(s.to_string());
  REQUIRE(s.is_ok());
  record.resize(kvm::export_bytes(st, 0));
  REQUIRE(kvm::export_slot(exact_exec(1), st, 0, std::span<std::byte>(record)).is_ok());
}

template <class S>
std::vector<std::byte> export_of(const kvmem::cuda::KvmState<S>& st, std::int32_t slot) {
  std::vector<std::byte> bytes(kvm::export_bytes(st, slot));
  const Status s = kvm::export_slot(kvmem::cuda::Executor{}, st, slot, std::span<std::byte>(bytes));
  INFO(s.to_string());
  REQUIRE(s.is_ok());
  return bytes;
}

template <class S>
std::vector<std::byte> host_export_of(const kvm::State<S, float>& st, std::int32_t slot) {
  std::vector<std::byte> bytes(kvm::export_bytes(st, slot));
  REQUIRE(kvm::export_slot(exact_exec(1), st, slot, std::span<std::byte>(bytes)).is_ok());
  return bytes;
}

template <class S>
std::int64_t tokens_of(const kvmem::cuda::KvmState<S>& st, std::int32_t slot) {
  std::int64_t n = -1, cov = -1, used = -1;
  REQUIRE(st.slot_counters(kvmem::cuda::Executor{}, slot, n, cov, used).is_ok());
  return n;
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

// max |x - ref| <= tol * max(1, max |ref|) (the golden README rule of test_kvm_cuda).
double scaled_error(const float* x, const float* ref, std::size_t n) {
  double worst = 0, scale = 1;
  for (std::size_t i = 0; i < n; ++i) {
    worst = std::max(worst, std::abs(double(x[i]) - double(ref[i])));
    scale = std::max(scale, std::abs(double(ref[i])));
  }
  return worst / scale;
}
constexpr double kTol = 1e-5;

// ---- the continuous-batching property --------------------------------------------------------------

struct Seq {
  std::vector<Tok> toks;        // every token fed so far (the sequence's content)
  std::int64_t target = 0;      // leaves at this length
  std::int64_t prompt = 0;      // tokens fed in prefill chunks before decode
  std::vector<float> out, lse;  // [pos, Hq, Dv], [pos, Hq]: latest result per position
  std::vector<char> has;        // produced by this sequence's own rows (not inherited by a fork)
  std::int32_t slot = -1;
};

struct ScheduleSize {
  int sequences;
  std::int64_t max_len, chunk;
};

template <class S>
void continuous_batching(kvmem::budget::Any budget, std::uint64_t seed, ScheduleSize size) {
  const Dims d;
  const std::int64_t C = size.chunk, kSlots = 16, max_len = size.max_len, n_ctx = max_len + 64;
  const kvm::Params p = make_params(C, budget);
  const RandomWeights rw(d, seed);
  kvmem::cuda::KvmState<S> st;
  const Status created_state = kvmem::cuda::KvmState<S>::create(p, {kSlots, d.Hq, d.Hk, d.D, d.Dv, n_ctx}, st);
  INFO(created_state.to_string());
  REQUIRE(created_state.is_ok());
  // A step has up to kSlots rows naming slots plus two padding rows; the workspace of an owning state
  // holds max_slots rows (padding rows take work items too), so the test attaches one for its largest step.
  const kvmem::Limits limits{.max_rows = kSlots + 2};
  Dev<unsigned char> workspace(kvmem::cuda::KvmState<S>::workspace_bytes({p, st.shape()}, limits));
  REQUIRE(st.attach_workspace(workspace.ptr, workspace.n, limits).is_ok());
  std::mt19937_64 rng(seed);
  const auto uni = [&](std::int64_t a, std::int64_t b) {
    return std::uniform_int_distribution<std::int64_t>(a, b)(rng);
  };
  std::vector<Seq> seqs;
  std::vector<std::int32_t> owner(std::size_t(kSlots), -1);  // seq index per slot
  int created = 0, finished = 0, forks = 0, truncations = 0, refused = 0, resets = 0, steps = 0;
  std::int64_t checked_rows = 0, max_seen = 0;
  double worst_out = 0, worst_lse = 0;
  const auto new_len = [&]() -> std::int64_t {
    const std::int64_t r = uni(0, 7);
    return r < 2 ? uni(1, 48) : r < 6 ? uni(49, std::min<std::int64_t>(700, max_len)) : uni(1, max_len);
  };
  bool failed = false;
  const auto finish = [&](std::int32_t si) {  // compare with the sequence alone, then free its slot
    Seq& s = seqs[std::size_t(si)];
    if (!s.toks.empty() && !failed) {
      std::vector<float> ref, ref_lse;
      std::vector<std::byte> ref_record;
      alone<S>(p, d, n_ctx, rw.host(), s.toks, ref, ref_lse, ref_record);
      const std::int64_t Q = d.Hq * d.Dv;
      for (std::size_t t = 0; t < s.toks.size() && !failed; ++t) {
        if (!s.has[t]) continue;
        ++checked_rows;
        const double eo = scaled_error(&s.out[t * Q], &ref[t * Q], std::size_t(Q));
        const double el = scaled_error(&s.lse[t * d.Hq], &ref_lse[t * d.Hq], std::size_t(d.Hq));
        worst_out = std::max(worst_out, eo);
        worst_lse = std::max(worst_lse, el);
        if (eo > kTol || el > kTol) {
          FAIL_CHECK("sequence " << si << " position " << t << ": out error " << eo << ", lse error " << el);
          failed = true;
        }
      }
      // the state itself: counters, memory slots (so every route) and window, byte for byte
      if (!failed && export_of(st, s.slot) != ref_record) {
        FAIL_CHECK("sequence " << si << " (" << s.toks.size()
                               << " tokens): the CUDA slot record differs from the host's");
        failed = true;
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

  while ((created < size.sequences || finished < created) && !failed) {
    for (std::int32_t sl = 0; sl < kSlots && created < size.sequences; ++sl)
      if (owner[std::size_t(sl)] < 0 && uni(0, 2) > 0) {
        Seq s;
        s.target = created == 0 ? max_len : new_len();                        // the first one has the full length
        s.prompt = s.target - uni(0, std::min<std::int64_t>(s.target, 120));  // then up to 120 decode steps
        s.slot = sl;
        REQUIRE(tokens_of(st, sl) == 0);
        owner[std::size_t(sl)] = std::int32_t(seqs.size());
        seqs.push_back(std::move(s));
        ++created;
      }
    struct Plan {
      std::int32_t seq, slot;
      std::int64_t from, to;
    };
    std::vector<Plan> plan;
    for (std::int32_t sl = 0; sl < kSlots; ++sl) {
      const std::int32_t si = owner[std::size_t(sl)];
      if (si < 0 || uni(0, 9) == 0) continue;  // a slot may sit out a step
      Seq& s = seqs[std::size_t(si)];
      const std::int64_t n = std::int64_t(s.toks.size());
      const std::int64_t len = n < s.prompt ? std::min(s.prompt - n, uni(1, 3 * C + 5)) : (uni(0, 7) == 0 ? 0 : 1);
      const std::int64_t to = std::min(n + len, s.target);
      while (std::int64_t(s.toks.size()) < to) s.toks.push_back(random_tok<S>(d, rng));
      record_len(s);
      plan.push_back({si, sl, n, to});
    }
    for (std::int64_t i = uni(0, 2); i > 0; --i) plan.push_back({-1, -1, 0, uni(0, 3)});
    std::shuffle(plan.begin(), plan.end(), rng);
    Batch b;
    std::vector<Tok> pad;
    for (const Plan& pl : plan) {
      if (pl.seq < 0) {  // padding: NaN inputs, which the step must not read
        Tok nan_tok = random_tok<S>(d, rng);
        for (auto* x : {&nan_tok.q, &nan_tok.k, &nan_tok.v, &nan_tok.g}) std::fill(x->begin(), x->end(), std::nanf(""));
        pad.assign(std::size_t(pl.to), nan_tok);
        b.add(-1, pad, 0, pl.to);
      } else {
        b.add(pl.slot, seqs[std::size_t(pl.seq)].toks, pl.from, pl.to);
      }
    }
    const Status status = b.run(st, rw, d);
    INFO(status.to_string());
    REQUIRE(status.is_ok());
    REQUIRE(st.step_status(kvmem::cuda::Executor{}).to_string() == "ok");
    ++steps;
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
      max_seen = std::max(max_seen, pl.to);
      std::copy(b.out.begin() + t0 * d.Hq * d.Dv, b.out.begin() + t1 * d.Hq * d.Dv,
                s.out.begin() + pl.from * d.Hq * d.Dv);
      std::copy(b.lse.begin() + t0 * d.Hq, b.lse.begin() + t1 * d.Hq, s.lse.begin() + pl.from * d.Hq);
      std::fill(s.has.begin() + pl.from, s.has.begin() + pl.to, 1);
    }
    if (steps % 16 == 0)
      for (std::int32_t sl = 0; sl < kSlots; ++sl)
        if (owner[std::size_t(sl)] >= 0)
          REQUIRE(tokens_of(st, sl) == std::int64_t(seqs[std::size_t(owner[std::size_t(sl)])].toks.size()));
    // slot operations between steps
    std::vector<std::int32_t> leaving;
    for (std::int32_t sl = 0; sl < kSlots; ++sl) {
      const std::int32_t si = owner[std::size_t(sl)];
      if (si < 0) continue;
      Seq& s = seqs[std::size_t(si)];
      const std::int64_t n = std::int64_t(s.toks.size());
      if (n >= s.target || (si != 0 && uni(0, 400) == 0)) {  // done, or leaves early (not the longest)
        leaving.push_back(sl);
        continue;
      }
      if (n > 0 && forks < 12 && uni(0, 30) == 0) {  // fork into a free slot
        const auto free = std::find(owner.begin(), owner.end(), -1);
        if (free != owner.end()) {
          const std::int32_t dst = std::int32_t(free - owner.begin());
          const DeviceList from({sl}), to({dst});
          REQUIRE(kvm::copy_slots(kvmem::cuda::Executor{}, st, from.view(), to.view()).is_ok());
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
        const Status ts = kvm::truncate(kvmem::cuda::Executor{}, st, sl, cut);
        INFO("truncate " << cut << " of " << n << ": " << ts.to_string());
        REQUIRE(ts.is_ok() == truncate_exact(C, 2, n, cut));
        if (ts.is_ok()) {
          t.toks.resize(std::size_t(n - cut));
          record_len(t);
          t.prompt = std::min(t.prompt, n - cut);
          REQUIRE(tokens_of(st, sl) == n - cut);
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
      const DeviceList lv(leaving);
      REQUIRE(kvm::reset_slots(kvmem::cuda::Executor{}, st, lv.view()).is_ok());
      for (std::int32_t sl : leaving) REQUIRE(tokens_of(st, sl) == 0);
      ++resets;
    }
  }
  std::printf(
      "kvm cuda slots %s %s: %d sequences (longest %lld), %d steps, %d forks, %d truncations (%d refused), "
      "%lld rows checked, worst out %.3g, lse %.3g\n",
      kvmem::type_name<S>(), budget.name(), created, (long long)max_seen, steps, forks, truncations, refused,
      (long long)checked_rows, worst_out, worst_lse);
  REQUIRE(!failed);
  CHECK(created >= size.sequences);
  CHECK(max_seen == max_len);  // the first sequence ran to max_len
  CHECK(checked_rows > 0);
  CHECK(resets > 0);
  if (size.sequences >= 32) {
    CHECK(forks > 0);
    CHECK(truncations > 0);
    CHECK(refused > 0);
  }
}

// Fixed-256-style (a fixed count of slots) and 16 sqrt N budgets, scaled to chunk 16: a fixed 64
// slots, and 16 sqrt N slots (at least one chunk).
const kvmem::budget::Any kFixed = kvmem::budget::Fixed{64, 64};
const kvmem::budget::Any kSqrt = kvmem::budget::Power{16.0, 0.5, 16, 1, 100000};

TEST_CASE("cuda kvm step: a small continuous batch equals each sequence alone", "[slots][gpu]") {
  if (no_device()) return;
  SECTION("fp32, fixed") {
    continuous_batching<float>(kFixed, 101, {10, 300, 16});
  }
  SECTION("bf16, 16 sqrt N") {
    continuous_batching<kvmem::bf16>(kSqrt, 102, {10, 300, 16});
  }
  SECTION("fp8 (e4m3 readout rows, bf16 window and inputs), 16 sqrt N") {
    continuous_batching<kvmem::e4m3>(kSqrt, 103, {10, 300, 16});
  }
}

TEST_CASE("cuda kvm step: continuous batching equals each sequence alone", "[slots][gpu]") {
  if (no_device()) return;
  SECTION("fp32, fixed") {
    continuous_batching<float>(kFixed, 11, {34, 3000, 16});
  }
  SECTION("bf16, fixed") {
    continuous_batching<kvmem::bf16>(kFixed, 12, {34, 3000, 16});
  }
  SECTION("fp32, 16 sqrt N") {
    continuous_batching<float>(kSqrt, 21, {34, 3000, 16});
  }
  SECTION("bf16, 16 sqrt N") {
    continuous_batching<kvmem::bf16>(kSqrt, 22, {34, 3000, 16});
  }
  SECTION("fp8, fixed") {
    continuous_batching<kvmem::e4m3>(kFixed, 13, {34, 3000, 16});
  }
  SECTION("fp8, 16 sqrt N") {
    continuous_batching<kvmem::e4m3>(kSqrt, 23, {34, 3000, 16});
  }
}

// ---- one CUDA graph of a padded decode step ------------------------------------------------------------

// Two twin states hold 13 sequences at different positions; one replays a graph captured from a
// 16-row decode step (3 padding rows), the other runs the same steps uncaptured. 600 steps cross
// many chunk boundaries (updates) of every sequence.
template <class S>
void graph_replay(std::uint64_t seed) {
  const Dims d;
  const std::int64_t C = 16, kSlots = 16, steps = 600, n_ctx = 1400;
  const kvm::Params p = make_params(C, kSqrt);
  const RandomWeights rw(d, seed);
  kvmem::cuda::KvmState<S> a, b;
  REQUIRE(kvmem::cuda::KvmState<S>::create(p, {kSlots, d.Hq, d.Hk, d.D, d.Dv, n_ctx}, a).is_ok());
  REQUIRE(kvmem::cuda::KvmState<S>::create(p, {kSlots, d.Hq, d.Hk, d.D, d.Dv, n_ctx}, b).is_ok());
  std::mt19937_64 rng(seed);
  // prefill: slot s (s != 2, 7, 11) gets 3 + 53 s tokens
  const std::vector<std::int32_t> active{0, 1, 3, 4, 5, 6, 8, 9, 10, 12, 13, 14, 15};
  {
    Batch pre;
    for (const std::int32_t s : active) {
      std::vector<Tok> mine;
      const std::int64_t n = 3 + 53 * std::int64_t(s);
      for (std::int64_t t = 0; t < n; ++t) mine.push_back(random_tok<S>(d, rng));
      pre.add(s, mine, 0, n);
    }
    Batch twin = pre;
    REQUIRE(pre.run(a, rw, d).is_ok());
    REQUIRE(twin.run(b, rw, d).is_ok());
    REQUIRE(pre.out == twin.out);
  }
  // the decode batch: row r holds slot row_slot[r] (-1: padding), one token each
  std::vector<std::int32_t> row_slot, start{0};
  for (std::int32_t r = 0, next = 0; r < 16; ++r) {
    row_slot.push_back(r == 2 || r == 9 || r == 15 ? -1 : active[std::size_t(next++)]);
    start.push_back(r + 1);
  }
  const std::int64_t T = 16;
  Dev<std::int32_t> dslot(row_slot), dstart(start);
  Dev<S> q(std::size_t(T * d.Hq * d.D)), k(std::size_t(T * d.Hk * d.D)), v(std::size_t(T * d.Hk * d.Dv)),
      g(std::size_t(T * d.Hk));
  Dev<float> out_a(std::size_t(T * d.Hq * d.Dv)), lse_a(std::size_t(T * d.Hq)), out_b(std::size_t(T * d.Hq * d.Dv)),
      lse_b(std::size_t(T * d.Hq));
  const Rows rows{I32View(dslot.ptr, {16}), I32View(dstart.ptr, {17})};
  cudaStream_t stream = nullptr;
  KVMEM_CUDA_REQUIRE(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const kvmem::cuda::Executor exec{stream};
  const auto run = [&](kvmem::cuda::KvmState<S>& st, Dev<float>& out, Dev<float>& lse) {
    return kvm::step(exec, st, rw.device(), rows, TensorView<const S, 3>(q.ptr, {T, d.Hq, d.D}),
                     TensorView<const S, 3>(k.ptr, {T, d.Hk, d.D}), TensorView<const S, 3>(v.ptr, {T, d.Hk, d.Dv}),
                     TensorView<const S, 2>(g.ptr, {T, d.Hk}), TensorView<float, 3>(out.ptr, {T, d.Hq, d.Dv}),
                     TensorView<float, 2>(lse.ptr, {T, d.Hq}));
  };
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t instance = nullptr;
  KVMEM_CUDA_REQUIRE(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  const Status captured = run(a, out_a, lse_a);
  KVMEM_CUDA_REQUIRE(cudaStreamEndCapture(stream, &graph));
  INFO(captured.to_string());
  REQUIRE(captured.is_ok());
  KVMEM_CUDA_REQUIRE(cudaGraphInstantiate(&instance, graph, 0));
  std::int64_t mismatches = 0;
  for (std::int64_t step = 0; step < steps; ++step) {
    std::vector<Tok> toks;
    for (std::int64_t r = 0; r < T; ++r) toks.push_back(random_tok<S>(d, rng));
    Batch in;
    in.add(0, toks, 0, T);
    const auto qs = as_storage<S>(in.q), ks = as_storage<S>(in.k), vs = as_storage<S>(in.v), gs = as_storage<S>(in.g);
    KVMEM_CUDA_REQUIRE(cudaMemcpyAsync(q.ptr, qs.data(), qs.size() * sizeof(S), cudaMemcpyHostToDevice, stream));
    KVMEM_CUDA_REQUIRE(cudaMemcpyAsync(k.ptr, ks.data(), ks.size() * sizeof(S), cudaMemcpyHostToDevice, stream));
    KVMEM_CUDA_REQUIRE(cudaMemcpyAsync(v.ptr, vs.data(), vs.size() * sizeof(S), cudaMemcpyHostToDevice, stream));
    KVMEM_CUDA_REQUIRE(cudaMemcpyAsync(g.ptr, gs.data(), gs.size() * sizeof(S), cudaMemcpyHostToDevice, stream));
    KVMEM_CUDA_REQUIRE(cudaGraphLaunch(instance, stream));
    REQUIRE(run(b, out_b, lse_b).is_ok());
    KVMEM_CUDA_REQUIRE(cudaStreamSynchronize(stream));
    const auto oa = out_a.get(), ob = out_b.get(), la = lse_a.get(), lb = lse_b.get();
    const bool same = std::memcmp(oa.data(), ob.data(), oa.size() * sizeof(float)) == 0 &&
                      std::memcmp(la.data(), lb.data(), la.size() * sizeof(float)) == 0;
    if (!same && mismatches++ == 0)
      FAIL_CHECK("step " << step << ": the graph replay differs from the uncaptured step");
    for (std::int64_t r = 0; r < T; ++r)
      if (row_slot[std::size_t(r)] < 0)
        for (std::int64_t i = 0; i < d.Hq * d.Dv; ++i) REQUIRE(oa[std::size_t(r * d.Hq * d.Dv + i)] == 0.f);
  }
  CHECK(mismatches == 0);
  REQUIRE(a.step_status(exec).is_ok());
  REQUIRE(b.step_status(exec).is_ok());
  for (std::int32_t s : active) {
    INFO("slot " << s);
    REQUIRE(tokens_of(a, s) == 3 + 53 * s + steps);
    REQUIRE(export_of(a, s) == export_of(b, s));
  }
  REQUIRE(tokens_of(a, 2) == 0);
  KVMEM_CUDA_REQUIRE(cudaGraphExecDestroy(instance));
  KVMEM_CUDA_REQUIRE(cudaGraphDestroy(graph));
  KVMEM_CUDA_REQUIRE(cudaStreamDestroy(stream));
}

TEST_CASE("cuda kvm step: one graph of a padded decode step replays 600 steps like uncaptured steps", "[slots][gpu]") {
  if (no_device()) return;
  SECTION("bf16") {
    graph_replay<kvmem::bf16>(7);
  }
  SECTION("fp32") {
    graph_replay<float>(8);
  }
}

// ---- the update's merged keys (host-side: no device needed) -----------------------------------------

// The update's passes cut a token's candidate slots into ranges, reduce each range to a key and merge
// the keys with atomicMax in whatever order blocks finish. Whatever the cut and the order, the merged
// key must give what the serial loops give (kernel::novelty_update_logits: the largest dot, NaN never
// taken; kernel::merge_route_update_logits: the first j of the largest dot from the sink on, the sink
// taken first even with a NaN dot), on dots with ties, -0 and +0, infinities, NaN and subnormals.
TEST_CASE("cuda kvm step: the update's merged keys give the serial loops' novelty and routes", "[slots]") {
  namespace kd = kvmem::cuda::kvm_detail;
  const float special[] = {0.0f, -0.0f, 1.0f, -1.0f, 2.5f, -2.5f, INFINITY, -INFINITY, NAN, 1e-40f, -1e-40f, 3.0f};
  std::mt19937_64 rng(9);
  const auto below = [&](std::uint64_t n) { return static_cast<std::int64_t>(rng() % n); };
  int routes = 0, sink_nan = 0, ties = 0;
  for (int trial = 0; trial < 20000; ++trial) {
    const std::int64_t S = 1 + below(40), sink = below(3);
    std::vector<float> dot(static_cast<std::size_t>(S));
    for (float& x : dot) x = below(3) == 0 ? special[below(12)] : float(below(7) - 3);  // small integers tie
    // the serial loops of the exact path
    float score = -INFINITY;
    kvmem::kernel::novelty_update_logits(dot.data(), S, 1, S, &score);
    float best = 0;
    std::int64_t route = 0;
    if (S > sink)
      kvmem::kernel::merge_route_update_logits(dot.data() + sink, S, 1, sink, S - sink, &best, &route, true);
    // ranges cut at random, merged in a random order
    std::vector<std::int64_t> cuts{0, S};
    for (std::int64_t i = below(6); i > 0; --i) cuts.push_back(below(std::uint64_t(S) + 1));
    std::sort(cuts.begin(), cuts.end());
    std::vector<std::size_t> order(cuts.size() - 1);
    for (std::size_t i = 0; i < order.size(); ++i) order[i] = i;
    std::shuffle(order.begin(), order.end(), rng);
    unsigned long long novelty = 0, routed = 0;
    for (const std::size_t q : order) {
      unsigned long long n = 0, r = 0;
      for (std::int64_t j = cuts[q]; j < cuts[q + 1]; ++j) {
        n = std::max(n, kd::slot_novelty_key(dot[std::size_t(j)]));
        if (j >= sink) r = std::max(r, kd::slot_route_key(dot[std::size_t(j)], j, j == sink));
      }
      novelty = std::max(novelty, n);
      routed = std::max(routed, r);
    }
    INFO("trial " << trial << ", S " << S << ", sink " << sink);
    REQUIRE(kd::slot_novelty_score(novelty) == score);  // -0 == +0: the append ranks compare with < and ==
    if (S > sink) {
      REQUIRE(kd::slot_route_target(routed) == route);
      ++routes;
      sink_nan += std::isnan(dot[std::size_t(sink)]) ? 1 : 0;
      ties += std::count(dot.begin() + sink, dot.end(), best) > 1 ? 1 : 0;
    }
  }
  CHECK(routes > 10000);  // the cases the rules are about occurred
  CHECK(sink_nan > 100);
  CHECK(ties > 1000);
}

// ---- the first step after fixed-batch calls -----------------------------------------------------------

// A state prefilled by the fixed-batch kvm_prefill, then driven by kvm::step, continues like a twin whose
// slots were imported from its records after the prefill. The step's update reads LN_s of the slots'
// sums, which the fixed-batch kernels keep rounded their own way (or not at all with tensor-core
// routing: bf16, head dim 64, chunk 16), so the first step must rebuild it: memory slots, routes and
// counters then equal the twin's byte for byte. Outputs agree to the storage precision only: the
// switched state's readout rows are the prefill's until an update refreshes them, the twin's were
// rebuilt on import.
template <class S>
void after_fixed_batch(std::uint64_t seed) {
  const Dims d{4, 2, 64, 64};
  const std::int64_t B = 2, T = 90, total = 200, C = 16, n_ctx = 400;
  const kvm::Params p = make_params(C, kSqrt);
  const RandomWeights rw(d, seed);
  const kvmem::cuda::Executor exec{};
  std::mt19937_64 rng(seed);
  std::vector<std::vector<Tok>> toks(static_cast<std::size_t>(B));
  for (auto& seq : toks)
    for (std::int64_t t = 0; t < total; ++t) seq.push_back(random_tok<S>(d, rng));
  kvmem::cuda::KvmState<S> fixed, twin;
  REQUIRE(kvmem::cuda::KvmState<S>::create(p, {B, d.Hq, d.Hk, d.D, d.Dv, n_ctx}, fixed).is_ok());
  REQUIRE(kvmem::cuda::KvmState<S>::create(p, {B, d.Hq, d.Hk, d.D, d.Dv, n_ctx}, twin).is_ok());
  // the fixed-batch prefill's head-major inputs: q [B,Hq,T,D], k [B,Hk,T,D], v [B,Hk,T,Dv], g [B,Hk,T]
  std::vector<float> q(std::size_t(B * d.Hq * T * d.D)), k(std::size_t(B * d.Hk * T * d.D)),
      v(std::size_t(B * d.Hk * T * d.Dv)), g(std::size_t(B * d.Hk * T));
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t t = 0; t < T; ++t) {
      const Tok& x = toks[std::size_t(b)][std::size_t(t)];
      for (std::int64_t h = 0; h < d.Hq; ++h)
        for (std::int64_t c = 0; c < d.D; ++c)
          q[std::size_t(((b * d.Hq + h) * T + t) * d.D + c)] = x.q[std::size_t(h * d.D + c)];
      for (std::int64_t h = 0; h < d.Hk; ++h) {
        for (std::int64_t c = 0; c < d.D; ++c)
          k[std::size_t(((b * d.Hk + h) * T + t) * d.D + c)] = x.k[std::size_t(h * d.D + c)];
        for (std::int64_t c = 0; c < d.Dv; ++c)
          v[std::size_t(((b * d.Hk + h) * T + t) * d.Dv + c)] = x.v[std::size_t(h * d.Dv + c)];
        g[std::size_t((b * d.Hk + h) * T + t)] = x.g[std::size_t(h)];
      }
    }
  {
    Dev<S> dq(as_storage<S>(q)), dk(as_storage<S>(k)), dv(as_storage<S>(v)), dg(as_storage<S>(g));
    Dev<float> dout(std::size_t(B * T * d.Hq * d.Dv));
    const Status s = kvmem::cuda::kvm_prefill(
        exec, fixed, rw.device(), TensorView<const S, 4>(dq.ptr, {B, d.Hq, T, d.D}),
        TensorView<const S, 4>(dk.ptr, {B, d.Hk, T, d.D}), TensorView<const S, 4>(dv.ptr, {B, d.Hk, T, d.Dv}),
        TensorView<const S, 3>(dg.ptr, {B, d.Hk, T}), TensorView<float, 4>(dout.ptr, {B, T, d.Hq, d.Dv}));
    INFO(s.to_string());
    REQUIRE(s.is_ok());
  }
  for (std::int32_t b = 0; b < B; ++b) {
    const std::vector<std::byte> bytes = export_of(fixed, b);
    REQUIRE(kvm::import_slot(exec, twin, rw.device(), b, std::span<const std::byte>(bytes)).is_ok());
  }
  REQUIRE(!fixed.slot_mode());  // exports leave the fixed-batch counters; the first step switches
  const double tol = std::is_same_v<S, float> ? kTol : 1e-2;
  int steps = 0;
  for (std::int64_t t0 = T; t0 < total; ++steps) {  // decode tokens and chunks of 13, across updates
    const std::int64_t t1 = std::min(total, t0 + (steps % 3 == 0 ? 13 : 1));
    Batch bf, bt;
    for (std::int32_t b = 0; b < B; ++b) {
      bf.add(b, toks[std::size_t(b)], t0, t1);
      bt.add(b, toks[std::size_t(b)], t0, t1);
    }
    REQUIRE(bf.run(fixed, rw, d).is_ok());
    REQUIRE(bt.run(twin, rw, d).is_ok());
    INFO("tokens [" << t0 << ", " << t1 << ")");
    CHECK(scaled_error(bf.out.data(), bt.out.data(), bt.out.size()) <= tol);
    CHECK(scaled_error(bf.lse.data(), bt.lse.data(), bt.lse.size()) <= tol);
    t0 = t1;
  }
  REQUIRE(fixed.slot_mode());
  for (std::int32_t b = 0; b < B; ++b) {
    INFO("slot " << b);
    CHECK(export_of(fixed, b) == export_of(twin, b));
  }
}

TEST_CASE("cuda kvm step: the first step after fixed-batch calls continues like the same slots imported",
          "[slots][gpu]") {
  if (no_device()) return;
  SECTION("fp32") {
    after_fixed_batch<float>(41);
  }
  SECTION("bf16 (tensor-core routing in the prefill)") {
    after_fixed_batch<kvmem::bf16>(42);
  }
}

// ---- export / import across backends -----------------------------------------------------------------

// Runs a Batch on a host state (exact path).
template <class S>
Status host_run(kvm::State<S, float>& st, const kvm::Weights& w, Batch& b, const Dims& d) {
  const std::int64_t T = b.tokens();
  b.out.assign(std::size_t(T * d.Hq * d.Dv), -7.f);
  b.lse.assign(std::size_t(T * d.Hq), -7.f);
  const Rows rows{I32View(b.slot.data(), {std::int64_t(b.slot.size())}),
                  I32View(b.start.data(), {std::int64_t(b.start.size())})};
  return kvm::step(exact_exec(2), st, w, rows, TensorView<const float, 3>(b.q.data(), {T, d.Hq, d.D}),
                   TensorView<const float, 3>(b.k.data(), {T, d.Hk, d.D}),
                   TensorView<const float, 3>(b.v.data(), {T, d.Hk, d.Dv}),
                   TensorView<const float, 2>(b.g.data(), {T, d.Hk}),
                   TensorView<float, 3>(b.out.data(), {T, d.Hq, d.Dv}), TensorView<float, 2>(b.lse.data(), {T, d.Hq}));
}

// Feeds tokens [from, to) of one sequence in chunks of 37 beside a padding row, on CUDA slot cs and host
// slot hs (either may be -1: not run), and checks that the two agree (out, lse within fp32 rounding).
template <class S>
void feed_both(kvmem::cuda::KvmState<S>* cst, std::int32_t cs, kvm::State<S, float>* hst, std::int32_t hs,
               const RandomWeights& rw, const Dims& d, const std::vector<Tok>& toks, std::int64_t from,
               std::int64_t to) {
  for (std::int64_t t0 = from; t0 < to;) {
    const std::int64_t t1 = std::min(to, t0 + 37);
    std::vector<Tok> pad(1, toks[0]);
    Batch bc, bh;
    bc.add(-1, pad, 0, 1);
    bc.add(cs, toks, t0, t1);
    bh.add(hs, toks, t0, t1);
    if (cst != nullptr) {
      const Status s = bc.run(*cst, rw, d);
      INFO(s.to_string());
      REQUIRE(s.is_ok());
    }
    if (hst != nullptr) REQUIRE(host_run(*hst, rw.host(), bh, d).is_ok());
    if (cst != nullptr && hst != nullptr) {
      const std::size_t Q = std::size_t(d.Hq * d.Dv);
      CHECK(scaled_error(bc.out.data() + Q, bh.out.data(), bh.out.size()) <= kTol);
      CHECK(scaled_error(bc.lse.data() + d.Hq, bh.lse.data(), bh.lse.size()) <= kTol);
    }
    t0 = t1;
  }
}

template <class S>
void export_import_across(std::uint64_t seed) {
  const Dims d;
  const std::int64_t C = 16, n_ctx = 900;
  const kvm::Params p = make_params(C, kSqrt);
  const RandomWeights rw(d, seed);
  const kvmem::cuda::Executor exec{};
  std::mt19937_64 rng(seed);
  std::vector<Tok> toks;
  for (int t = 0; t < 400; ++t) toks.push_back(random_tok<S>(d, rng));
  kvmem::cuda::KvmState<S> cst;
  kvm::State<S, float> hst;
  REQUIRE(kvmem::cuda::KvmState<S>::create(p, {4, d.Hq, d.Hk, d.D, d.Dv, n_ctx}, cst).is_ok());
  REQUIRE(kvm::State<S, float>::create(p, {2, d.Hq, d.Hk, d.D, d.Dv, n_ctx}, hst).is_ok());
  REQUIRE(kvm::export_bytes(cst) == kvm::export_bytes(hst));
  SECTION("CUDA -> host") {
    feed_both<S>(&cst, 3, nullptr, -1, rw, d, toks, 0, 300);
    std::vector<std::byte> bytes(kvm::export_bytes(cst, 3));
    REQUIRE(bytes.size() <= kvm::export_bytes(cst));
    REQUIRE(kvm::export_slot(exec, cst, 3, std::span<std::byte>(bytes)).is_ok());
    const Status imported = kvm::import_slot(exact_exec(1), hst, rw.host(), 1, std::span<const std::byte>(bytes));
    INFO(imported.to_string());
    REQUIRE(imported.is_ok());
    REQUIRE(hst.tokens(1) == 300);
    REQUIRE(host_export_of(hst, 1) == bytes);
    feed_both<S>(&cst, 3, &hst, 1, rw, d, toks, 300, 400);  // both continue alike
    REQUIRE(export_of(cst, 3) == host_export_of(hst, 1));
  }
  SECTION("host -> CUDA") {
    feed_both<S>(nullptr, -1, &hst, 0, rw, d, toks, 0, 300);
    const auto bytes = host_export_of(hst, 0);
    const Status imported = kvm::import_slot(exec, cst, rw.device(), 2, std::span<const std::byte>(bytes));
    INFO(imported.to_string());
    REQUIRE(imported.is_ok());
    REQUIRE(tokens_of(cst, 2) == 300);
    REQUIRE(export_of(cst, 2) == bytes);
    feed_both<S>(&cst, 2, &hst, 0, rw, d, toks, 300, 400);
    REQUIRE(export_of(cst, 2) == host_export_of(hst, 0));
  }
}

TEST_CASE("cuda kvm slots: a slot exported on one backend imports on the other and continues alike", "[slots][gpu]") {
  if (no_device()) return;
  SECTION("fp32") {
    export_import_across<float>(31);
  }
  SECTION("bf16") {
    export_import_across<kvmem::bf16>(32);
  }
  SECTION("fp8") {
    export_import_across<kvmem::e4m3>(33);
  }
}

// ---- refusals: never-created, moved-from, bad slot indices, bad rows ----------------------------------

// Every operation on an empty state returns a Status (export_bytes: 0).
void require_refuses_everything(kvmem::cuda::KvmState<float>& st, const RandomWeights& rw, const Dims& d) {
  const kvmem::cuda::Executor exec{};
  Dev<std::int32_t> dslot(std::vector<std::int32_t>{0}), dstart(std::vector<std::int32_t>{0, 1});
  Dev<float> q(std::size_t(d.Hq * d.D)), k(std::size_t(d.Hk * d.D)), v(std::size_t(d.Hk * d.Dv)), g(std::size_t(d.Hk)),
      out(std::size_t(d.Hq * d.Dv));
  const Rows rows{I32View(dslot.ptr, {1}), I32View(dstart.ptr, {2})};
  CHECK(!kvm::step(exec, st, rw.device(), rows, TensorView<const float, 3>(q.ptr, {1, d.Hq, d.D}),
                   TensorView<const float, 3>(k.ptr, {1, d.Hk, d.D}),
                   TensorView<const float, 3>(v.ptr, {1, d.Hk, d.Dv}), TensorView<const float, 2>(g.ptr, {1, d.Hk}),
                   TensorView<float, 3>(out.ptr, {1, d.Hq, d.Dv}))
             .is_ok());
  const DeviceList zero({0}), one({1});
  CHECK(!kvm::reset_slots(exec, st, zero.view()).is_ok());
  CHECK(!kvm::copy_slots(exec, st, zero.view(), one.view()).is_ok());
  CHECK(kvm::export_bytes(st) == 0);
  CHECK(kvm::export_bytes(st, 0) == 0);
  std::vector<std::byte> bytes(4096);
  CHECK(!kvm::export_slot(exec, st, 0, std::span<std::byte>(bytes)).is_ok());
  CHECK(!kvm::import_slot(exec, st, rw.device(), 0, std::span<const std::byte>(bytes)).is_ok());
  CHECK(!kvm::truncate(exec, st, 0, 1).is_ok());
  CHECK(!st.step_status(exec).is_ok());
  std::int64_t n = 0, cov = 0, used = 0;
  CHECK(!st.slot_counters(exec, 0, n, cov, used).is_ok());
}

TEST_CASE("cuda kvm slots: never-created and moved-from states refuse every operation", "[slots][gpu]") {
  if (no_device()) return;
  const Dims d;
  const RandomWeights rw(d, 41);
  const kvm::Params p = make_params(16, kFixed);
  kvmem::cuda::KvmState<float> never;
  REQUIRE(!never.valid());
  require_refuses_everything(never, rw, d);
  kvmem::cuda::KvmState<float> st;
  REQUIRE(kvmem::cuda::KvmState<float>::create(p, {2, d.Hq, d.Hk, d.D, d.Dv, 256}, st).is_ok());
  kvmem::cuda::KvmState<float> owner(std::move(st));
  REQUIRE(!st.valid());
  REQUIRE(owner.valid());
  require_refuses_everything(st, rw, d);
  std::mt19937_64 rng(41);
  std::vector<Tok> toks;
  for (int t = 0; t < 40; ++t) toks.push_back(random_tok<float>(d, rng));
  feed_both<float>(&owner, 1, nullptr, -1, rw, d, toks, 0, 40);  // the new owner works
  REQUIRE(tokens_of(owner, 1) == 40);
}

TEST_CASE("cuda kvm slots: bad slot indices and bad rows are refused and leave the state untouched", "[slots][gpu]") {
  if (no_device()) return;
  const Dims d;
  const RandomWeights rw(d, 51);
  const kvm::Params p = make_params(16, kSqrt);
  const kvmem::cuda::Executor exec{};
  kvmem::cuda::KvmState<float> st;
  const std::int64_t n_ctx = 200;
  REQUIRE(kvmem::cuda::KvmState<float>::create(p, {4, d.Hq, d.Hk, d.D, d.Dv, n_ctx}, st).is_ok());
  std::mt19937_64 rng(51);
  std::vector<Tok> toks;
  for (int t = 0; t < 150; ++t) toks.push_back(random_tok<float>(d, rng));
  feed_both<float>(&st, 0, nullptr, -1, rw, d, toks, 0, 150);
  feed_both<float>(&st, 2, nullptr, -1, rw, d, toks, 0, 20);
  const auto snapshot = [&] {
    std::vector<std::vector<std::byte>> r;
    for (std::int32_t s = 0; s < 4; ++s) r.push_back(export_of(st, s));
    return r;
  };
  const auto before = snapshot();
  const auto code = [](const Status& s) { return s.code(); };
  SECTION("slot operations") {
    // what the host sees without reading the lists is refused by the call
    const DeviceList src({0, 1}), dst({1, 2}), one({1});
    CHECK(code(kvm::copy_slots(exec, st, src.view(1), dst.view())) == StatusCode::kInvalidArgument);  // lengths differ
    CHECK(code(kvm::reset_slots(exec, st, I32View(src.d.ptr, {2}, {2}))) == StatusCode::kInvalidArgument);  // stride
    CHECK(code(kvm::reset_slots(exec, st, I32View(nullptr, {1}))) == StatusCode::kInvalidArgument);
    CHECK(code(kvm::copy_slots(exec, st, one.view(), I32View(nullptr, {1}))) == StatusCode::kInvalidArgument);
    // bad indices are refused on the device: the call returns ok and step_status returns the Status the
    // host backend returns for the same lists (the first failure in the host's order), once
    kvm::State<float, float> host;
    REQUIRE(kvm::State<float, float>::create(p, {4, d.Hq, d.Hk, d.D, d.Dv, n_ctx}, host).is_ok());
    const auto host_list = [](const std::vector<std::int32_t>& l) {
      return I32View(l.data(), {std::int64_t(l.size())});
    };
    const auto refused_reset = [&](const std::vector<std::int32_t>& slots, StatusCode want, const char* field) {
      const DeviceList l(slots);
      REQUIRE(kvm::reset_slots(exec, st, l.view()).is_ok());
      const Status got = st.step_status(exec);
      INFO(got.to_string());
      CHECK(got.code() == want);
      CHECK(got.message().find(field) != std::string::npos);
      CHECK(got.to_string() == kvm::reset_slots(exact_exec(1), host, host_list(slots)).to_string());
      CHECK(st.step_status(exec).is_ok());  // read once, cleared
    };
    const auto refused_copy = [&](const std::vector<std::int32_t>& from, const std::vector<std::int32_t>& to,
                                  StatusCode want, const char* field) {
      const DeviceList a(from), b(to);
      REQUIRE(kvm::copy_slots(exec, st, a.view(), b.view()).is_ok());
      const Status got = st.step_status(exec);
      INFO(got.to_string());
      CHECK(got.code() == want);
      CHECK(got.message().find(field) != std::string::npos);
      CHECK(got.to_string() == kvm::copy_slots(exact_exec(1), host, host_list(from), host_list(to)).to_string());
      CHECK(st.step_status(exec).is_ok());
    };
    refused_reset({4}, StatusCode::kOutOfRange, "slots[0]");
    refused_reset({-1}, StatusCode::kOutOfRange, "slots[0]");
    refused_reset({0, 2, 2, 7}, StatusCode::kOutOfRange, "slots[3]");  // listed twice is fine, 7 is not
    refused_copy({4}, {1}, StatusCode::kOutOfRange, "src[0]");
    refused_copy({0}, {9}, StatusCode::kOutOfRange, "dst[0]");
    refused_copy({0, 9}, {5, 1}, StatusCode::kOutOfRange, "src[1]");       // every source before any destination
    refused_copy({0, 1}, {1, 1}, StatusCode::kInvalidArgument, "dst[1]");  // a destination twice
    refused_copy({0, 1}, {1, 2}, StatusCode::kInvalidArgument, "dst[0]");  // destination 1 is a source
    refused_copy({2, 0, 0}, {3, 1, 2}, StatusCode::kInvalidArgument, "dst[2]");
    std::vector<std::byte> bytes(kvm::export_bytes(st));
    CHECK(code(kvm::export_slot(exec, st, 4, std::span<std::byte>(bytes))) == StatusCode::kOutOfRange);
    std::vector<std::byte> small(16);
    CHECK(code(kvm::export_slot(exec, st, 0, std::span<std::byte>(small))) == StatusCode::kInvalidArgument);
    CHECK(code(kvm::import_slot(exec, st, rw.device(), -1, std::span<const std::byte>(before[0]))) ==
          StatusCode::kOutOfRange);
    CHECK(code(kvm::import_slot(exec, st, rw.device(), 1, std::span<const std::byte>(small))) ==
          StatusCode::kInvalidArgument);
    // a record of another chunk is refused naming the field
    kvmem::cuda::KvmState<float> other;
    REQUIRE(
        kvmem::cuda::KvmState<float>::create(make_params(8, kSqrt), {4, d.Hq, d.Hk, d.D, d.Dv, n_ctx}, other).is_ok());
    const Status wrong = kvm::import_slot(exec, st, rw.device(), 1, std::span<const std::byte>(export_of(other, 0)));
    CHECK(wrong.code() == StatusCode::kInvalidArgument);
    CHECK(wrong.message().find("chunk") != std::string::npos);
    CHECK(code(kvm::truncate(exec, st, 7, 1)) == StatusCode::kOutOfRange);
    CHECK(code(kvm::truncate(exec, st, 2, 21)) == StatusCode::kOutOfRange);        // more than the slot holds
    CHECK(code(kvm::truncate(exec, st, 0, 100)) == StatusCode::kInvalidArgument);  // undoes an update
  }
  SECTION("rows refused on the device") {
    // each bad batch: the call enqueues and returns ok (its rows are on the device), step_status says why
    const auto bad_step = [&](std::vector<std::int32_t> slot, std::vector<std::int32_t> start, std::int64_t T) {
      Dev<std::int32_t> ds(slot), dst(start);
      Dev<float> q(std::size_t(T * d.Hq * d.D)), k(std::size_t(T * d.Hk * d.D)), v(std::size_t(T * d.Hk * d.Dv)),
          g(std::vector<float>(std::size_t(T * d.Hk), 1.f)), out(std::size_t(T * d.Hq * d.Dv));
      const Rows rows{I32View(ds.ptr, {std::int64_t(slot.size())}), I32View(dst.ptr, {std::int64_t(start.size())})};
      REQUIRE(kvm::step(exec, st, rw.device(), rows, TensorView<const float, 3>(q.ptr, {T, d.Hq, d.D}),
                        TensorView<const float, 3>(k.ptr, {T, d.Hk, d.D}),
                        TensorView<const float, 3>(v.ptr, {T, d.Hk, d.Dv}),
                        TensorView<const float, 2>(g.ptr, {T, d.Hk}), TensorView<float, 3>(out.ptr, {T, d.Hq, d.Dv}))
                  .is_ok());
      return st.step_status(exec);
    };
    const Status twice = bad_step({1, 3, 1}, {0, 1, 2, 3}, 3);
    INFO(twice.to_string());
    CHECK(twice.code() == StatusCode::kInvalidArgument);                            // slot 1 twice
    CHECK(bad_step({1, 4}, {0, 1, 2}, 2).code() == StatusCode::kOutOfRange);        // slot 4 of 4
    CHECK(bad_step({1, -1}, {0, 2, 1}, 1).code() == StatusCode::kInvalidArgument);  // a start decreases
    CHECK(bad_step({1, 3}, {0, 1, 2}, 3).code() == StatusCode::kInvalidArgument);   // query_start[rows] != tokens
    CHECK(bad_step({0}, {0, 60}, 60).code() == StatusCode::kOutOfRange);            // 150 + 60 > n_ctx
    CHECK(st.step_status(exec).is_ok());                                            // read and cleared
  }
  SECTION("the fixed-batch calls refuse a state with per-slot counters") {
    Dev<float> q(std::size_t(4 * d.Hq * d.D)), k(std::size_t(4 * d.Hk * d.D)), v(std::size_t(4 * d.Hk * d.Dv)),
        g(std::size_t(4 * d.Hk)), out(std::size_t(4 * d.Hq * d.Dv));
    CHECK(!kvmem::cuda::kvm_decode(exec, st, rw.device(), TensorView<const float, 4>(q.ptr, {4, d.Hq, 1, d.D}),
                                   TensorView<const float, 4>(k.ptr, {4, d.Hk, 1, d.D}),
                                   TensorView<const float, 4>(v.ptr, {4, d.Hk, 1, d.Dv}),
                                   TensorView<const float, 3>(g.ptr, {4, d.Hk, 1}),
                                   TensorView<float, 4>(out.ptr, {4, 1, d.Hq, d.Dv}))
               .is_ok());
  }
  REQUIRE(snapshot() == before);
  // after every refusal a good step still runs
  feed_both<float>(&st, 2, nullptr, -1, rw, d, toks, 20, 30);
  REQUIRE(tokens_of(st, 2) == 30);
}

// Rows::max_query_len sizes a step's phases and its ingest and readout grids from the longest row instead
// of the packed token count: a block per (row, position in its segment) once that grid is smaller than a
// block per packed token. Only the mapping of blocks to tokens changes, so outputs, lse and every slot's
// record equal those of the same steps without the bound, bit for bit. Step 1: a bound below the chunk
// (2 phases instead of 6; the row grid, where the unbounded step takes the token grid) with a padding row
// longer than the bound, zeroed by its blocks striding over it; step 2: rows of several chunks, with
// updates (4 phases instead of 8, both on the row grid). A row over the bound refuses the step, and nothing changes.
template <class S>
void bounded_rows(std::uint64_t seed) {
  const Dims d;
  const RandomWeights rw(d, seed);
  const kvm::Params p = make_params(64, kSqrt);
  const kvmem::cuda::Executor exec{};
  kvmem::cuda::KvmState<S> bounded, unbounded;
  // 6 slots for the workspace's sake: a step's rows, padding rows included, are at most max_slots (the
  // owning create sizes the workspace for that many), and step 1 has 6 rows over slots 0..4
  for (auto* st : {&bounded, &unbounded})
    REQUIRE(kvmem::cuda::KvmState<S>::create(p, {6, d.Hq, d.Hk, d.D, d.Dv, 512}, *st).is_ok());
  std::mt19937_64 rng(seed);
  std::vector<std::vector<Tok>> seq(5);
  for (auto& toks : seq)
    for (int t = 0; t < 260; ++t) toks.push_back(random_tok<S>(d, rng));
  std::vector<Tok> pad;
  for (int t = 0; t < 100; ++t) pad.push_back(random_tok<S>(d, rng));
  for (auto* st : {&bounded, &unbounded}) {  // slots 1 and 3 mid-chunk, so segments start anywhere
    feed_both<S>(st, 1, nullptr, -1, rw, d, seq[1], 0, 23);
    feed_both<S>(st, 3, nullptr, -1, rw, d, seq[3], 0, 50);
  }
  const auto same = [&](Batch& with, Batch& without) {
    const Status a = with.run(bounded, rw, d), b = without.run(unbounded, rw, d);
    INFO(a.to_string() << " / " << b.to_string());
    REQUIRE(a.is_ok());
    REQUIRE(b.is_ok());
    REQUIRE(bounded.step_status(exec).is_ok());
    REQUIRE(unbounded.step_status(exec).is_ok());
    CHECK(std::memcmp(with.out.data(), without.out.data(), with.out.size() * sizeof(float)) == 0);
    CHECK(std::memcmp(with.lse.data(), without.lse.data(), with.lse.size() * sizeof(float)) == 0);
    for (std::int32_t s = 0; s < 5; ++s) {
      INFO("slot " << s);
      CHECK(export_of(bounded, s) == export_of(unbounded, s));
    }
  };
  const auto step1 = [&](std::int64_t bound) {  // 40 + 100 (padding) + 40 + 40 + 40 tokens
    Batch b;
    b.add(0, seq[0], 0, 40);
    b.add(-1, pad, 0, 100);
    b.add(1, seq[1], 23, 63);
    b.add(3, seq[3], 50, 90);  // crosses the chunk boundary at 64: two segments
    b.add(-1, pad, 0, 0);
    b.add(4, seq[4], 0, 40);
    b.max_query_len = bound;
    return b;
  };
  Batch with1 = step1(40), without1 = step1(0);
  same(with1, without1);
  for (std::size_t i = 40 * std::size_t(d.Hq * d.Dv); i < 140 * std::size_t(d.Hq * d.Dv); ++i)
    REQUIRE(with1.out[i] == 0.0f);  // the padding row, every token of it
  for (std::size_t i = 40 * std::size_t(d.Hq); i < 140 * std::size_t(d.Hq); ++i) REQUIRE(with1.lse[i] == 0.0f);
  const auto step2 = [&](std::int64_t bound) {  // rows of up to 150 tokens, updates included
    Batch b;
    b.add(0, seq[0], 40, 190);
    b.add(1, seq[1], 63, 200);
    b.add(-1, pad, 0, 3);
    b.add(3, seq[3], 90, 240);
    b.max_query_len = bound;
    return b;
  };
  Batch with2 = step2(150), without2 = step2(0);
  same(with2, without2);

  // a row naming a slot over the bound: refused on the device, reported by step_status, nothing changes
  std::vector<std::vector<std::byte>> before;
  for (std::int32_t s = 0; s < 5; ++s) before.push_back(export_of(bounded, s));
  Batch over;
  over.add(2, seq[2], 0, 30);
  over.add(4, seq[4], 40, 50);
  over.max_query_len = 20;
  REQUIRE(over.run(bounded, rw, d).is_ok());  // the rows are on the device: the call enqueues
  const Status refused = bounded.step_status(exec);
  INFO(refused.to_string());
  CHECK(refused.code() == StatusCode::kInvalidArgument);
  CHECK(refused.message().find("max_query_len") != std::string::npos);
  CHECK(refused.message().find("row 0: 30") != std::string::npos);
  CHECK(refused.message() == kvmem::row_over_bound(0, 30, 20).message());  // the host's words, the bound included
  CHECK(bounded.step_status(exec).is_ok());                                // read and cleared
  for (std::int32_t s = 0; s < 5; ++s) CHECK(export_of(bounded, s) == before[std::size_t(s)]);
  Batch negative;
  negative.add(2, seq[2], 0, 1);
  negative.max_query_len = -1;
  CHECK(negative.run(bounded, rw, d).code() == StatusCode::kInvalidArgument);  // refused on the host
  // and the state steps on with a bound that holds
  Batch next = step1(40), next_without = step1(0);
  next.slot[0] = next_without.slot[0] = 2;
  same(next, next_without);
}

TEST_CASE(
    "cuda kvm step: max_query_len gives the unbounded step's outputs and state bitwise; a row over it is "
    "refused",
    "[slots][gpu]") {
  if (no_device()) return;
  SECTION("float") {
    bounded_rows<float>(81);
  }
  SECTION("bf16") {
    bounded_rows<kvmem::bf16>(82);
  }
}

TEST_CASE("cuda kvm slots: a refused slot list refuses later calls until step_status reads it, then calls run",
          "[slots][gpu]") {
  if (no_device()) return;
  const Dims d;
  const RandomWeights rw(d, 61);
  const kvm::Params p = make_params(16, kSqrt);
  const kvmem::cuda::Executor exec{};
  kvmem::cuda::KvmState<float> st;
  REQUIRE(kvmem::cuda::KvmState<float>::create(p, {4, d.Hq, d.Hk, d.D, d.Dv, 400}, st).is_ok());
  std::mt19937_64 rng(61);
  std::vector<Tok> toks;
  for (int t = 0; t < 120; ++t) toks.push_back(random_tok<float>(d, rng));
  feed_both<float>(&st, 0, nullptr, -1, rw, d, toks, 0, 100);
  feed_both<float>(&st, 2, nullptr, -1, rw, d, toks, 0, 20);
  const auto snapshot = [&] {
    std::vector<std::vector<std::byte>> r;
    for (std::int32_t s = 0; s < 4; ++s) r.push_back(export_of(st, s));
    return r;
  };
  const auto before = snapshot();
  // a copy whose destination is named twice: refused on the device
  const DeviceList src({0, 2}), twice({1, 1}), two({2}), three({3}), zero({0});
  REQUIRE(kvm::copy_slots(exec, st, src.view(), twice.view()).is_ok());
  // every later call is refused too while the refusal is unread: a good reset, a good copy, a good step
  REQUIRE(kvm::reset_slots(exec, st, two.view()).is_ok());
  REQUIRE(kvm::copy_slots(exec, st, two.view(), three.view()).is_ok());
  {
    Batch b;
    b.add(2, toks, 20, 21);
    REQUIRE(b.run(st, rw, d).is_ok());
  }
  REQUIRE(snapshot() == before);  // bitwise: every slot's counters, memory slots and window
  const Status first = st.step_status(exec);
  INFO(first.to_string());
  CHECK(first.code() == StatusCode::kInvalidArgument);
  CHECK(first.message().find("dst[1]") != std::string::npos);  // the first refusal, not a later one
  REQUIRE(st.step_status(exec).is_ok());
  // once read, calls run: slot 3 becomes a copy of slot 2, slot 0 is reset, slot 2 steps on
  REQUIRE(kvm::copy_slots(exec, st, two.view(), three.view()).is_ok());
  REQUIRE(st.step_status(exec).is_ok());
  CHECK(export_of(st, 3) == before[2]);
  REQUIRE(kvm::reset_slots(exec, st, zero.view()).is_ok());
  REQUIRE(st.step_status(exec).is_ok());
  CHECK(tokens_of(st, 0) == 0);
  feed_both<float>(&st, 2, nullptr, -1, rw, d, toks, 20, 30);
  REQUIRE(st.step_status(exec).is_ok());
  CHECK(tokens_of(st, 2) == 30);
  CHECK(tokens_of(st, 3) == 20);
}

// ---- slot operations and a step in one CUDA graph ------------------------------------------------------

// Two twin states: one replays a graph captured from copy_slots (fork slot 0 into slot 5), reset_slots
// (slot 6 starts over) and a padded decode step of slots 0, 1, 5 and 6; the other runs the same three
// calls uncaptured. The lists and rows stay in their device buffers, whose contents the replays read:
// at one replay the copy's destination is made invalid, and the whole replay is refused (the copy by
// its list, the reset and the step by the sticky refusal), changing nothing, until step_status reads it.
template <class S>
void slot_ops_graph(std::uint64_t seed) {
  const Dims d;
  const std::int64_t C = 16, kSlots = 8, replays = 48, bad_replay = 20, n_ctx = 600;
  const kvm::Params p = make_params(C, kSqrt);
  const RandomWeights rw(d, seed);
  kvmem::cuda::KvmState<S> a, b;
  REQUIRE(kvmem::cuda::KvmState<S>::create(p, {kSlots, d.Hq, d.Hk, d.D, d.Dv, n_ctx}, a).is_ok());
  REQUIRE(kvmem::cuda::KvmState<S>::create(p, {kSlots, d.Hq, d.Hk, d.D, d.Dv, n_ctx}, b).is_ok());
  std::mt19937_64 rng(seed);
  {  // slots 0, 1, 6 hold 70, 33 and 9 tokens
    Batch pre;
    for (const auto& [s, n] : {std::pair<std::int32_t, std::int64_t>{0, 70}, {1, 33}, {6, 9}}) {
      std::vector<Tok> mine;
      for (std::int64_t t = 0; t < n; ++t) mine.push_back(random_tok<S>(d, rng));
      pre.add(s, mine, 0, n);
    }
    Batch twin = pre;
    REQUIRE(pre.run(a, rw, d).is_ok());
    REQUIRE(twin.run(b, rw, d).is_ok());
    REQUIRE(pre.out == twin.out);
  }
  const std::vector<std::int32_t> row_slot{5, 0, -1, 6, 1}, start{0, 1, 2, 3, 4, 5};
  const std::int64_t T = 5;
  Dev<std::int32_t> dslot(row_slot), dstart(start), src(std::vector<std::int32_t>{0}),
      dst(std::vector<std::int32_t>{5}), reset(std::vector<std::int32_t>{6});
  Dev<S> q(std::size_t(T * d.Hq * d.D)), k(std::size_t(T * d.Hk * d.D)), v(std::size_t(T * d.Hk * d.Dv)),
      g(std::size_t(T * d.Hk));
  Dev<float> out_a(std::size_t(T * d.Hq * d.Dv)), lse_a(std::size_t(T * d.Hq)), out_b(std::size_t(T * d.Hq * d.Dv)),
      lse_b(std::size_t(T * d.Hq));
  const Rows rows{I32View(dslot.ptr, {T}), I32View(dstart.ptr, {T + 1})};
  cudaStream_t stream = nullptr;
  KVMEM_CUDA_REQUIRE(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const kvmem::cuda::Executor exec{stream};
  const auto calls = [&](kvmem::cuda::KvmState<S>& st, Dev<float>& out, Dev<float>& lse) {
    KVMEM_RETURN_IF_ERROR(kvm::copy_slots(exec, st, I32View(src.ptr, {1}), I32View(dst.ptr, {1})));
    KVMEM_RETURN_IF_ERROR(kvm::reset_slots(exec, st, I32View(reset.ptr, {1})));
    return kvm::step(exec, st, rw.device(), rows, TensorView<const S, 3>(q.ptr, {T, d.Hq, d.D}),
                     TensorView<const S, 3>(k.ptr, {T, d.Hk, d.D}), TensorView<const S, 3>(v.ptr, {T, d.Hk, d.Dv}),
                     TensorView<const S, 2>(g.ptr, {T, d.Hk}), TensorView<float, 3>(out.ptr, {T, d.Hq, d.Dv}),
                     TensorView<float, 2>(lse.ptr, {T, d.Hq}));
  };
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t instance = nullptr;
  KVMEM_CUDA_REQUIRE(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  const Status captured = calls(a, out_a, lse_a);
  KVMEM_CUDA_REQUIRE(cudaStreamEndCapture(stream, &graph));
  INFO(captured.to_string());
  REQUIRE(captured.is_ok());
  KVMEM_CUDA_REQUIRE(cudaGraphInstantiate(&instance, graph, 0));
  const auto put = [&](std::int32_t* at, std::int32_t value) {
    KVMEM_CUDA_REQUIRE(cudaMemcpyAsync(at, &value, sizeof value, cudaMemcpyHostToDevice, stream));
    KVMEM_CUDA_REQUIRE(cudaStreamSynchronize(stream));  // `value` is a local
  };
  std::int64_t mismatches = 0;
  for (std::int64_t r = 0; r < replays; ++r) {
    std::vector<Tok> toks;
    for (std::int64_t t = 0; t < T; ++t) toks.push_back(random_tok<S>(d, rng));
    Batch in;
    in.add(0, toks, 0, T);
    const auto qs = as_storage<S>(in.q), ks = as_storage<S>(in.k), vs = as_storage<S>(in.v), gs = as_storage<S>(in.g);
    KVMEM_CUDA_REQUIRE(cudaMemcpyAsync(q.ptr, qs.data(), qs.size() * sizeof(S), cudaMemcpyHostToDevice, stream));
    KVMEM_CUDA_REQUIRE(cudaMemcpyAsync(k.ptr, ks.data(), ks.size() * sizeof(S), cudaMemcpyHostToDevice, stream));
    KVMEM_CUDA_REQUIRE(cudaMemcpyAsync(v.ptr, vs.data(), vs.size() * sizeof(S), cudaMemcpyHostToDevice, stream));
    KVMEM_CUDA_REQUIRE(cudaMemcpyAsync(g.ptr, gs.data(), gs.size() * sizeof(S), cudaMemcpyHostToDevice, stream));
    if (r == bad_replay) {
      const auto before = [&] {
        std::vector<std::vector<std::byte>> recs;
        KVMEM_CUDA_REQUIRE(cudaStreamSynchronize(stream));
        for (std::int32_t s = 0; s < kSlots; ++s) recs.push_back(export_of(a, s));
        return recs;
      };
      const auto kept = before();
      put(dst.ptr, std::int32_t(kSlots));  // a destination outside the state
      KVMEM_CUDA_REQUIRE(cudaGraphLaunch(instance, stream));
      KVMEM_CUDA_REQUIRE(cudaStreamSynchronize(stream));
      CHECK(before() == kept);
      const Status refused = a.step_status(exec);
      INFO(refused.to_string());
      CHECK(refused.code() == StatusCode::kOutOfRange);
      CHECK(refused.message().find("dst[0]") != std::string::npos);
      REQUIRE(a.step_status(exec).is_ok());
      put(dst.ptr, 5);
      continue;  // the twin skips this replay
    }
    KVMEM_CUDA_REQUIRE(cudaGraphLaunch(instance, stream));
    REQUIRE(calls(b, out_b, lse_b).is_ok());
    KVMEM_CUDA_REQUIRE(cudaStreamSynchronize(stream));
    const auto oa = out_a.get(), ob = out_b.get(), la = lse_a.get(), lb = lse_b.get();
    const bool same = std::memcmp(oa.data(), ob.data(), oa.size() * sizeof(float)) == 0 &&
                      std::memcmp(la.data(), lb.data(), la.size() * sizeof(float)) == 0;
    if (!same && mismatches++ == 0) FAIL_CHECK("replay " << r << ": the graph differs from the uncaptured calls");
    for (std::int64_t i = 2 * d.Hq * d.Dv; i < 3 * d.Hq * d.Dv; ++i) REQUIRE(oa[std::size_t(i)] == 0.f);  // padding
  }
  CHECK(mismatches == 0);
  REQUIRE(a.step_status(exec).is_ok());
  REQUIRE(b.step_status(exec).is_ok());
  for (std::int32_t s = 0; s < kSlots; ++s) {
    INFO("slot " << s);
    REQUIRE(export_of(a, s) == export_of(b, s));
  }
  // each good replay forked slot 0 (before its token) into 5, restarted 6 and stepped all four
  CHECK(tokens_of(a, 0) == 70 + replays - 1);
  CHECK(tokens_of(a, 5) == tokens_of(a, 0));
  CHECK(tokens_of(a, 1) == 33 + replays - 1);
  CHECK(tokens_of(a, 6) == 1);
  CHECK(tokens_of(a, 2) == 0);
  KVMEM_CUDA_REQUIRE(cudaGraphExecDestroy(instance));
  KVMEM_CUDA_REQUIRE(cudaGraphDestroy(graph));
  KVMEM_CUDA_REQUIRE(cudaStreamDestroy(stream));
}

TEST_CASE("cuda kvm slots: copy_slots, reset_slots and a decode step in one graph replay like uncaptured calls",
          "[slots][gpu][graph]") {
  if (no_device()) return;
  SECTION("fp32") {
    slot_ops_graph<float>(71);
  }
  SECTION("bf16") {
    slot_ops_graph<kvmem::bf16>(72);
  }
}

}  // namespace
