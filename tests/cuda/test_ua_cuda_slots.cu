// SPDX-License-Identifier: Apache-2.0
// Universal Attention sequence slots on the CUDA backend (DESIGN.md 3, docs/slots-ua.md): ua::step over
// ragged rows and the slot operations. Expected values come from each sequence run alone on the HOST
// backend (a one-slot host cache stepped with the same row lengths: ua::step of the host, which equals
// ua::prefill / ua::decode of that sequence bitwise), from the same steps run without a graph, from the
// host's own records, or from the cache's state before a refused call; never from the CUDA slot path
// itself. Kept-set differences are accepted only as near-ties (tests/support/near_ties.hpp), counted and
// printed, and a sequence with a near-tie is named and its outputs are not compared (a different kept
// set changes later outputs legitimately). Skips, saying so, when no CUDA device is visible.
#include "kvmem/backend/cuda/vendor.cuh"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <catch2/catch.hpp>

#include "cuda/cuda_test_support.hpp"
#include "kvmem/backend/cuda/ua.cuh"
#include "support/golden.hpp"
#include "support/near_ties.hpp"
#include "ua/ua_host_support.hpp"
#include "ua/ua_lifetime_set.hpp"

namespace {
namespace kua = kvmem::ua;
using kvmem::Rows;
using kvmem::Status;
using kvmem::StatusCode;
using kvmem::TensorView;
using namespace kvmem::test;
using namespace kvmem::test::cuda;
using namespace kvmem::test::ua;
using Slots = std::vector<std::int32_t>;

struct Dims {
  std::int64_t H = 8, G = 2, D = 64;  // GQA: 4 query heads per kv head
};

// x rounded to the storage type S (host and device then see the same values).
template <class S>
void round_to(std::vector<float>& x) {
  for (auto& e : x) e = kvmem::load_as<float>(kvmem::store_as<S>(e));
}

// A sequence of one slot: its inputs (a reference Case of B = 1, [1,H,L,D] ..., and float copies rounded
// to S), the rows it got (its history, which the alone run replays), and what the CUDA steps wrote.
template <class S>
struct Seq {
  Case c;
  FloatCase f;
  std::int64_t L = 0, prompt = 0, done = 0;
  std::vector<std::int64_t> rows;
  std::int32_t slot = -1;
  bool ended = false;
  std::vector<float> out, lse;     // [L,H,D], [L,H], NaN until written
  std::vector<std::int64_t> kept;  // [G, done] 0/1 kept positions of the CUDA slot when it ended
  explicit Seq(const Case& x) : c(x), f(x), L(x.config.T) {
    round_to<S>(f.q);
    round_to<S>(f.k);
    round_to<S>(f.v);
    out.assign(std::size_t(L * x.config.H * x.config.D), std::numeric_limits<float>::quiet_NaN());
    lse.assign(std::size_t(L * x.config.H), std::numeric_limits<float>::quiet_NaN());
  }
};

// A fork's inputs: the parent's first n tokens, then fresh random tokens up to L.
Case forked_case(const Case& parent, std::int64_t n, std::int64_t L, std::uint32_t seed) {
  Case c = random_case(1, L, parent.config.H, parent.config.G, parent.config.D, seed);
  const std::int64_t H = c.config.H, G = c.config.G, D = c.config.D, Lp = parent.config.T;
  for (std::int64_t t = 0; t < n; ++t) {
    for (std::int64_t h = 0; h < H; ++h)
      for (std::int64_t d = 0; d < D; ++d) c.inputs.q[(h * L + t) * D + d] = parent.inputs.q[(h * Lp + t) * D + d];
    for (std::int64_t g = 0; g < G; ++g) {
      for (std::int64_t d = 0; d < D; ++d) {
        c.inputs.k[(g * L + t) * D + d] = parent.inputs.k[(g * Lp + t) * D + d];
        c.inputs.v[(g * L + t) * D + d] = parent.inputs.v[(g * Lp + t) * D + d];
      }
      c.inputs.z_k[g * L + t] = parent.inputs.z_k[g * Lp + t];
      c.inputs.z_q[g * L + t] = parent.inputs.z_q[g * Lp + t];
    }
  }
  return c;
}

// Token-major views [T, heads, ...] of tokens [t0, t0 + T) of a FloatCase (B = 1, [1,H,L,D] layout).
kua::PackedInputs packed_view(const FloatCase& f, std::int64_t t0, std::int64_t T) {
  const std::int64_t H = f.c.H, G = f.c.G, D = f.c.D, L = f.c.T;
  kua::PackedInputs in;
  in.q = {f.q.data() + t0 * D, {T, H, D}, {D, L * D, 1}};
  in.k = {f.k.data() + t0 * D, {T, G, D}, {D, L * D, 1}};
  in.v = {f.v.data() + t0 * D, {T, G, D}, {D, L * D, 1}};
  in.z_k = {f.z_k.data() + t0, {T, G}, {1, L}};
  in.z_q = {f.z_q.data() + t0, {T, G}, {1, L}};
  return in;
}

// The sequence run alone on the host: a one-slot host cache stepped with the same row lengths.
struct Alone {
  std::vector<float> out, lse;     // [n,H,D], [n,H] for the n tokens of the rows
  std::vector<std::int64_t> kept;  // [G, n]
  std::vector<std::byte> record;   // the slot's record after the rows
};
template <class S>
Alone run_alone(const FloatCase& f, const std::vector<std::int64_t>& rows, const kua::Options& opt,
                std::int64_t capacity) {
  const std::int64_t H = f.c.H, G = f.c.G, D = f.c.D;
  std::int64_t n = 0;
  for (auto T : rows) n += T;
  kua::PrunedCache<S> hc(kua::CacheShape{1, H, G, D, capacity, 16});
  Alone a;
  a.out.assign(std::size_t(n * H * D), 0.0f);
  a.lse.assign(std::size_t(n * H), 0.0f);
  std::int64_t t0 = 0;
  for (auto T : rows) {
    const Slots slot{0}, qs{0, std::int32_t(T)};
    const Rows r{TensorView<const std::int32_t, 1>(slot.data(), {1}),
                 TensorView<const std::int32_t, 1>(qs.data(), {2})};
    const Status st = kua::step(kvmem::host::Executor{2}, hc, r, packed_view(f, t0, T), opt,
                                TensorView<float, 3>(a.out.data() + t0 * H * D, {T, H, D}),
                                TensorView<float, 2>(a.lse.data() + t0 * H, {T, H}));
    INFO(st.to_string());
    REQUIRE(st.is_ok());
    t0 += T;
  }
  a.kept = kept_mask(hc, n);
  a.record.resize(kua::export_bytes(hc, 0));
  REQUIRE(kua::export_slot(kvmem::host::Executor{}, hc, 0, std::span<std::byte>(a.record)).is_ok());
  return a;
}

// The first n tokens of a sequence as a reference case of the values both backends saw (the keys and
// gate logits as stored), for the near-tie bound.
Case stored_prefix(const FloatCase& f, std::int64_t n) {
  Case s;
  s.config = f.c;
  s.config.B = 1;
  s.config.T = n;
  const std::int64_t G = f.c.G, D = f.c.D, L = f.c.T;
  s.inputs.k.resize(std::size_t(G * n * D));
  s.inputs.z_k.resize(std::size_t(G * n));
  s.inputs.z_q.resize(std::size_t(G * n));
  for (std::int64_t g = 0; g < G; ++g)
    for (std::int64_t t = 0; t < n; ++t) {
      for (std::int64_t d = 0; d < D; ++d) s.inputs.k[(g * n + t) * D + d] = f.k[(g * L + t) * D + d];
      s.inputs.z_k[g * n + t] = f.z_k[g * L + t];
      s.inputs.z_q[g * n + t] = f.z_q[g * L + t];
    }
  return s;
}

// One step's rows and packed token-major inputs on the host (q, k, v as float values of S).
struct HostStep {
  std::vector<float> q, k, v, z_k, z_q;
  Slots slot, qs{0};
  std::int64_t tokens() const { return qs.back(); }
  // A row of tokens [t0, t0 + T) of f for `slot_index`, or T random tokens of a padding row (f null).
  void add(std::int32_t slot_index, const FloatCase* f, std::int64_t t0, std::int64_t T, const Dims& dm,
           std::mt19937_64& rng) {
    const std::int64_t H = dm.H, G = dm.G, D = dm.D, L = f ? f->c.T : 0;
    std::normal_distribution<float> n01(0.0f, 1.0f);
    for (std::int64_t t = t0; t < t0 + T; ++t) {
      for (std::int64_t h = 0; h < H; ++h)
        for (std::int64_t d = 0; d < D; ++d) q.push_back(f ? f->q[(h * L + t) * D + d] : n01(rng));
      for (std::int64_t g = 0; g < G; ++g) {
        for (std::int64_t d = 0; d < D; ++d) {
          k.push_back(f ? f->k[(g * L + t) * D + d] : n01(rng) * 0.125f);
          v.push_back(f ? f->v[(g * L + t) * D + d] : n01(rng));
        }
        z_k.push_back(f ? f->z_k[g * L + t] : n01(rng));
        z_q.push_back(f ? f->z_q[g * L + t] : n01(rng));
      }
    }
    slot.push_back(slot_index);
    qs.push_back(qs.back() + std::int32_t(T));
  }
};

// Device buffers for steps of up to max_tokens tokens and max_rows rows, at fixed addresses (a captured
// graph reads them on every replay).
template <class S>
struct DevStep {
  Dims dm;
  std::int64_t max_tokens, max_rows;
  Dev<S> q, k, v;
  Dev<float> z_k, z_q, out, lse;
  Dev<std::int32_t> slot, qs;
  DevStep(const Dims& d, std::int64_t tokens, std::int64_t rows)
      : dm(d),
        max_tokens(tokens),
        max_rows(rows),
        q(std::size_t(tokens * d.H * d.D)),
        k(std::size_t(tokens * d.G * d.D)),
        v(std::size_t(tokens * d.G * d.D)),
        z_k(std::size_t(tokens * d.G)),
        z_q(std::size_t(tokens * d.G)),
        out(std::size_t(tokens * d.H * d.D)),
        lse(std::size_t(tokens * d.H)),
        slot(std::size_t(rows)),
        qs(std::size_t(rows + 1)) {}
  // Copies a step's content in on `stream` (pageable host memory: the copy is done when it returns).
  void upload(const HostStep& h, cudaStream_t stream) {
    REQUIRE(h.tokens() <= max_tokens);
    REQUIRE(std::int64_t(h.slot.size()) <= max_rows);
    const auto put = [&](auto* dst, const auto& src) {
      KVMEM_CUDA_REQUIRE(cudaMemcpyAsync(dst, src.data(), src.size() * sizeof(src[0]), cudaMemcpyHostToDevice, stream));
    };
    put(q.ptr, as_storage<S>(h.q));
    put(k.ptr, as_storage<S>(h.k));
    put(v.ptr, as_storage<S>(h.v));
    put(z_k.ptr, h.z_k);
    put(z_q.ptr, h.z_q);
    put(slot.ptr, h.slot);
    put(qs.ptr, h.qs);
    KVMEM_CUDA_REQUIRE(cudaStreamSynchronize(stream));
  }
  Rows rows(std::int64_t R, std::int64_t max_query_len = 0) const {
    return {TensorView<const std::int32_t, 1>(slot.ptr, {R}), TensorView<const std::int32_t, 1>(qs.ptr, {R + 1}),
            max_query_len};
  }
  // the shapes name dm's fields in place: nvcc (#177) reports a local used only as a bare element of a
  // braced shape as never referenced
  kua::PackedInputsOf<S> inputs(std::int64_t N) const {
    kua::PackedInputsOf<S> in;
    in.q = {q.ptr, {N, dm.H, dm.D}};
    in.k = {k.ptr, {N, dm.G, dm.D}};
    in.v = {v.ptr, {N, dm.G, dm.D}};
    in.z_k = {z_k.ptr, {N, dm.G}};
    in.z_q = {z_q.ptr, {N, dm.G}};
    return in;
  }
  TensorView<float, 3> out_view(std::int64_t N) const { return {out.ptr, {N, dm.H, dm.D}}; }
  TensorView<float, 2> lse_view(std::int64_t N) const { return {lse.ptr, {N, dm.H}}; }
  // Runs one step of `h` (uploaded) and returns out [N,H,D] and lse [N,H].
  template <class Set = kvmem::decay::Universal>
  std::pair<std::vector<float>, std::vector<float>> run(kvmem::cuda::UaCache<S>& cache, const HostStep& h,
                                                        const kua::Options& opt, cudaStream_t stream,
                                                        std::int64_t max_query_len = 0) {
    upload(h, stream);
    const std::int64_t N = h.tokens(), R = std::int64_t(h.slot.size());
    const Status st = kua::step<Set>(kvmem::cuda::Executor{stream}, cache, rows(R, max_query_len), inputs(N), opt,
                                     out_view(N), lse_view(N));
    INFO(st.to_string());
    REQUIRE(st.is_ok());
    const Status checked = cache.step_status(kvmem::cuda::Executor{stream});
    INFO(checked.to_string());
    REQUIRE(checked.is_ok());
    std::vector<float> o(std::size_t(N * dm.H * dm.D)), l(std::size_t(N * dm.H));
    if (N > 0) {
      KVMEM_CUDA_REQUIRE(cudaMemcpy(o.data(), out.ptr, o.size() * sizeof(float), cudaMemcpyDeviceToHost));
      KVMEM_CUDA_REQUIRE(cudaMemcpy(l.data(), lse.ptr, l.size() * sizeof(float), cudaMemcpyDeviceToHost));
    }
    return {o, l};
  }
};

// [G, n] 0/1 kept positions of a CUDA slot.
template <class S>
std::vector<std::int64_t> cuda_kept(const kvmem::cuda::UaCache<S>& cache, std::int32_t slot, std::int64_t n,
                                    cudaStream_t stream) {
  const std::int64_t G = cache.shape().kv_heads;
  std::vector<std::int64_t> kept(std::size_t(G * n), 0);
  for (std::int64_t g = 0; g < G; ++g) {
    std::vector<std::int64_t> pos;
    std::vector<float> lam;
    REQUIRE(cache.download(slot, g, pos, lam, nullptr, nullptr, stream).is_ok());
    for (auto p : pos) {
      REQUIRE(p >= 0);
      REQUIRE(p < n);
      kept[std::size_t(g * n + p)] = 1;
    }
  }
  return kept;
}

std::vector<std::int32_t> list_of(std::int32_t a) {
  return {a};
}

// Elements of two runs that differ in any bit (same length).
template <class T>
std::size_t differing_bits(const std::vector<T>& a, const std::vector<T>& b) {
  REQUIRE(a.size() == b.size());
  std::size_t n = 0;
  for (std::size_t x = 0; x < a.size(); ++x) n += std::memcmp(&a[x], &b[x], sizeof(T)) != 0;
  return n;
}

// A list of slots in device memory (slot operations take device lists). The kernels that read it may
// still be queued on a stream when it goes: it waits for the device before its memory is freed.
struct DevList {
  Dev<std::int32_t> d;
  std::int64_t n;
  explicit DevList(const Slots& s) : d(s), n(std::int64_t(s.size())) {}
  DevList(const DevList&) = delete;
  DevList& operator=(const DevList&) = delete;
  ~DevList() { (void)cudaDeviceSynchronize(); }
  TensorView<const std::int32_t, 1> view() const { return {d.ptr, {n}}; }
};

// ---- (a) a seeded continuous-batching schedule ----------------------------------------------------
struct Schedule {
  int sequences = 32;  // sequences that join (forks come on top)
  int forks = 6;       // forks made from decoding sequences
  int cancels = 3;     // sequences reset before their end
  std::int64_t max_len = 3000;
  std::int32_t slots = 16;
  std::int64_t capacity = 1024;
  std::int64_t step_tokens = 1024;  // packed tokens per step at most
  std::int64_t max_prefill_row = 512;
  double tol = 1e-4;  // relative Frobenius of out and lse against the host, per sequence
  std::uint64_t seed = 2024;
};

template <class S>
void run_schedule(const Schedule& sc, const Dims& dm, const kua::Options& opt, const std::string& label) {
  std::mt19937_64 rng(sc.seed);
  const auto uniform = [&](std::int64_t lo, std::int64_t hi) {
    return std::uniform_int_distribution<std::int64_t>(lo, hi)(rng);
  };
  std::vector<Seq<S>> seqs;
  seqs.reserve(std::size_t(sc.sequences + sc.forks));
  for (int i = 0; i < sc.sequences; ++i) {
    // lengths 1..max_len: a few very short ones, the rest uniform
    const std::int64_t L = i < 3 ? i + 1 : uniform(1, sc.max_len);
    seqs.emplace_back(random_case(1, L, dm.H, dm.G, dm.D, std::uint32_t(sc.seed * 131 + std::uint64_t(i))));
    auto& s = seqs.back();
    s.prompt = std::max<std::int64_t>(1, L * uniform(10, 90) / 100);
  }
  kvmem::cuda::UaCacheLimits limits;
  limits.max_prefill_chunk = std::max<std::int64_t>(128, opt.prefill_chunk);
  kvmem::cuda::UaCache<S> cache;
  {
    const Status st = kvmem::cuda::UaCache<S>::create({sc.slots, dm.H, dm.G, dm.D, sc.capacity, 16}, cache, limits);
    INFO(st.to_string());
    REQUIRE(st.is_ok());
  }
  cudaStream_t stream = nullptr;
  KVMEM_CUDA_REQUIRE(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const kvmem::cuda::Executor exec{stream};
  DevStep<S> dev(dm, sc.step_tokens, 2 * sc.slots + 1);  // a row per slot, each may bring a padding row
  std::vector<std::int32_t> free_slots;
  for (std::int32_t s = sc.slots - 1; s >= 0; --s) free_slots.push_back(s);
  std::size_t next = 0;
  int forks = 0, cancels = 0, steps = 0, padding_rows = 0, prefill_rows = 0, decode_rows = 0;
  const std::int64_t H = dm.H, D = dm.D;

  const auto end_seq = [&](Seq<S>& s) {
    s.kept = cuda_kept(cache, s.slot, s.done, stream);
    s.ended = true;
  };
  while (true) {
    // join: pending sequences take free slots (a slot is reset when its sequence leaves)
    while (next < std::size_t(sc.sequences) && !free_slots.empty()) {
      seqs[next].slot = free_slots.back();
      free_slots.pop_back();
      ++next;
    }
    std::vector<std::size_t> active;
    for (std::size_t i = 0; i < seqs.size(); ++i)
      if (seqs[i].slot >= 0 && !seqs[i].ended) active.push_back(i);
    if (active.empty() && next >= std::size_t(sc.sequences)) break;
    // fork a decoding sequence into a free slot
    if (forks < sc.forks && !free_slots.empty() && uniform(0, 9) == 0) {
      for (std::size_t i : active) {
        Seq<S>& p = seqs[i];
        if (p.done < p.prompt || p.done >= p.L || p.done < 2) continue;
        const std::int64_t L = std::min<std::int64_t>(sc.max_len, p.done + uniform(1, 400));
        const Case cc = forked_case(p.c, p.done, L, std::uint32_t(sc.seed * 7 + std::uint64_t(forks)));
        // copy the parent's outputs so far before emplace_back (it may move the parent)
        const std::vector<float> po(p.out.begin(), p.out.begin() + p.done * H * D),
            pl(p.lse.begin(), p.lse.begin() + p.done * H);
        const std::vector<std::int64_t> prow = p.rows;
        const std::int64_t pdone = p.done;
        const std::int32_t pslot = p.slot;
        seqs.emplace_back(cc);
        Seq<S>& ch = seqs.back();
        ch.prompt = pdone;
        ch.done = pdone;
        ch.rows = prow;
        std::copy(po.begin(), po.end(), ch.out.begin());
        std::copy(pl.begin(), pl.end(), ch.lse.begin());
        ch.slot = free_slots.back();
        free_slots.pop_back();
        DevList src(list_of(pslot)), dst(list_of(ch.slot));
        const Status st = kua::copy_slots(exec, cache, src.view(), dst.view());
        INFO(st.to_string());
        REQUIRE(st.is_ok());
        ++forks;
        active.push_back(seqs.size() - 1);
        break;
      }
    }
    // the rows of this step, in a shuffled order, with padding rows and rows of no token
    std::shuffle(active.begin(), active.end(), rng);
    HostStep h;
    std::vector<std::pair<std::size_t, std::int64_t>> fed;  // (sequence, tokens) per row of a slot
    for (std::size_t i : active) {
      Seq<S>& s = seqs[i];
      if (uniform(0, 19) == 0) continue;  // sits this step out
      if (uniform(0, 5) == 0) {
        h.add(-1, nullptr, 0, uniform(1, 3), dm, rng);
        ++padding_rows;
      }
      std::int64_t T = 1;
      if (s.done < s.prompt) T = std::min(s.prompt - s.done, uniform(2, sc.max_prefill_row));
      if (uniform(0, 29) == 0) T = 0;  // a row of no token: the slot is not touched
      if (h.tokens() + T > sc.step_tokens) continue;
      h.add(s.slot, &s.f, s.done, T, dm, rng);
      fed.push_back({i, T});
    }
    if (h.slot.empty()) h.add(-1, nullptr, 0, 1, dm, rng);
    const auto [o, l] = dev.run(cache, h, opt, stream);
    ++steps;
    for (std::size_t row = 0, f = 0; row < h.slot.size(); ++row) {
      const std::int64_t x0 = h.qs[row], x1 = h.qs[row + 1];
      if (h.slot[row] < 0) {  // padding: zeroed
        for (std::int64_t x = x0 * H * D; x < x1 * H * D; ++x) REQUIRE(o[std::size_t(x)] == 0.0f);
        for (std::int64_t x = x0 * H; x < x1 * H; ++x) REQUIRE(l[std::size_t(x)] == 0.0f);
        continue;
      }
      Seq<S>& s = seqs[fed[f++].first];
      std::copy(o.begin() + x0 * H * D, o.begin() + x1 * H * D, s.out.begin() + s.done * H * D);
      std::copy(l.begin() + x0 * H, l.begin() + x1 * H, s.lse.begin() + s.done * H);
      if (x1 > x0) {
        s.rows.push_back(x1 - x0);
        (x1 - x0 == 1 ? decode_rows : prefill_rows) += 1;
      }
      s.done += x1 - x0;
    }
    // leave: finished sequences, and now and then one cancelled early; their slots are reset together
    Slots leaving;
    for (std::size_t i : active) {
      Seq<S>& s = seqs[i];
      const bool cancel = cancels < sc.cancels && s.done > 0 && s.done < s.L && uniform(0, 199) == 0;
      if (s.done == s.L || cancel) {
        cancels += cancel ? 1 : 0;
        end_seq(s);
        leaving.push_back(s.slot);
      }
    }
    if (!leaving.empty()) {
      DevList lv(leaving);
      const Status st = kua::reset_slots(exec, cache, lv.view());
      INFO(st.to_string());
      REQUIRE(st.is_ok());
      for (auto s : leaving) free_slots.push_back(s);
    }
  }
  std::vector<std::int32_t> flags;
  REQUIRE(cache.overflowed(exec, flags).is_ok());
  for (auto fl : flags) CHECK(fl == 0);
  std::vector<std::int64_t> positions;
  REQUIRE(cache.positions(exec, positions).is_ok());
  for (auto p : positions) CHECK(p == 0);  // every slot was reset when its sequence left
  KVMEM_CUDA_REQUIRE(cudaStreamDestroy(stream));
  std::printf(
      "ua cuda slots %s: %zu sequences (%d forks, %d cancelled), %d steps, %d prefill rows, %d decode rows, "
      "%d padding rows\n",
      label.c_str(), seqs.size(), forks, cancels, steps, prefill_rows, decode_rows, padding_rows);
  CHECK(forks > 0);
  CHECK(prefill_rows > 0);
  CHECK(decode_rows > 0);

  // every sequence against itself run alone on the host
  int with_ties = 0;
  double worst_out = 0, worst_lse = 0;
  for (std::size_t i = 0; i < seqs.size(); ++i) {
    const Seq<S>& s = seqs[i];
    REQUIRE(s.ended);
    const Alone a = run_alone<S>(s.f, s.rows, opt, sc.capacity);
    REQUIRE(std::int64_t(a.kept.size()) == dm.G * s.done);
    const Case stored = stored_prefix(s.f, s.done);
    const auto acc = near_ties::account_kept(stored.config, stored.inputs, s.kept, a.kept, opt.p);
    INFO(label << " sequence " << i << " (" << s.done << " of " << s.L << " tokens, " << s.rows.size()
               << " rows): " << acc.summary() << "; first unexplained: " << acc.first_beyond);
    CHECK(acc.beyond == 0);
    if (acc.near_ties > 0) {
      ++with_ties;
      std::printf("ua cuda slots %s: sequence %zu has %s; its outputs are not compared\n", label.c_str(), i,
                  acc.summary().c_str());
      continue;
    }
    const std::vector<float> out(s.out.begin(), s.out.begin() + s.done * H * D),
        lse(s.lse.begin(), s.lse.begin() + s.done * H);
    const double e_out = relative_frobenius(out, a.out), e_lse = relative_frobenius(lse, a.lse);
    worst_out = std::max(worst_out, e_out);
    worst_lse = std::max(worst_lse, e_lse);
    INFO("out relative Frobenius " << e_out << ", lse " << e_lse);
    CHECK(e_out <= sc.tol);
    CHECK(e_lse <= sc.tol);
  }
  std::printf("ua cuda slots %s: worst relative Frobenius out %.3g lse %.3g; %d sequences with near-ties\n",
              label.c_str(), worst_out, worst_lse, with_ties);
  CHECK(with_ties * 4 <= int(seqs.size()));  // near-ties are rare, not the rule
}

}  // namespace

TEST_CASE("ua cuda step: a small continuous batch equals each sequence alone on the host", "[ua][cuda][slots]") {
  if (no_device()) return;
  Schedule sc;
  sc.sequences = 8;
  sc.forks = 2;
  sc.cancels = 1;
  sc.max_len = 300;
  sc.slots = 4;
  sc.capacity = 512;
  sc.step_tokens = 512;
  sc.max_prefill_row = 200;
  sc.seed = 11;
  run_schedule<float>(sc, Dims{}, kua::Options{0.05, 64, true}, "fp32 small");
}

TEST_CASE("ua cuda step: 32+ sequences of 1..3000 tokens over 16 slots equal each sequence alone on the host",
          "[ua][cuda][slots][slow]") {
  if (no_device()) return;
  Schedule sc;
  run_schedule<float>(sc, Dims{}, kua::Options{0.05, 128, true}, "fp32 32 sequences");
}

TEST_CASE("ua cuda step: bf16 on the tensor-core chunk kernel, evict last, near-ties accounted",
          "[ua][cuda][slots][nearties]") {
  if (no_device()) return;
  Schedule sc;
  sc.sequences = 12;
  sc.forks = 3;
  sc.max_len = 1200;
  sc.slots = 8;
  sc.seed = 5;
  sc.tol = 1e-2;  // the tensor-core kernel rounds the probabilities to bf16 before p.v
  run_schedule<kvmem::bf16>(sc, Dims{}, kua::Options{0.05, 128, false}, "bf16");
}

TEST_CASE("ua cuda step: without pruning, long slots take the split decode path", "[ua][cuda][slots]") {
  if (no_device()) return;
  Schedule sc;
  sc.sequences = 10;
  sc.forks = 2;
  sc.max_len = 900;
  sc.slots = 6;
  sc.capacity = 1024;
  sc.seed = 3;
  run_schedule<float>(sc, Dims{}, kua::Options{0.0, 128, true}, "fp32 p=0");
}

// ---- (b) one graph for a decode step of a padded batch ---------------------------------------------
namespace {
// Slots 0..5 prefilled to 40 .. 590 tokens (one step, both caches alike), then 600 decode steps of a
// padded batch of 8 rows: replays of one graph captured on `graphed`, and the same steps run uncaptured
// on `plain`. The batch changes between replays as an engine's does, through the buffers' contents and
// slot operations only: at step 200 padding row 2 becomes a new sequence in the empty slot 6, at step
// 400 slot 5 is reset and starts over. Outputs, lse and the caches must agree bit for bit (the kernels
// are deterministic: no float atomics), and every slot's position advances by its decode steps although
// the host enqueued nothing but replays.
// pool_pages > 0: both caches share a pool of that many pages, and a third cache that owns its pages runs
// the same steps uncaptured: a shared pool moves a long item's live rows into fresh pages where own pages
// mark rows dead in place, which changes where the rows lie but not which rows are kept nor their λ (the
// same bits) nor the outputs (beyond the order of the partials' sums); after every step each item of
// `plain` holds the pages of its rows in use. Returns the steps that moved a long item.
template <class Set = kvmem::decay::Universal>
std::int64_t graph_replay(const kua::Options& opt, const char* label, std::int64_t pool_pages = 0) {
  const Dims dm;
  const std::int64_t cap = 2048;
  const std::int32_t kSlots = 6;
  kvmem::cuda::UaCache<float> graphed, plain, own;
  REQUIRE(kvmem::cuda::UaCache<float>::create({8, dm.H, dm.G, dm.D, cap, 16, pool_pages}, graphed).is_ok());
  REQUIRE(kvmem::cuda::UaCache<float>::create({8, dm.H, dm.G, dm.D, cap, 16, pool_pages}, plain).is_ok());
  REQUIRE(kvmem::cuda::UaCache<float>::create({8, dm.H, dm.G, dm.D, cap, 16}, own).is_ok());
  const bool shared = pool_pages > 0;
  cudaStream_t stream = nullptr;
  KVMEM_CUDA_REQUIRE(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const kvmem::cuda::Executor exec{stream};
  std::mt19937_64 rng(77);
  // slots 0..5 start at different positions (one prefill row each, both caches alike)
  std::vector<std::int64_t> start;
  {
    DevStep<float> pre(dm, 2048, 8);
    HostStep h;
    for (std::int32_t s = 0; s < kSlots; ++s) {
      const std::int64_t T = 40 + 110 * s;  // 40 .. 590: short and long (split) decode paths
      const Case c = random_case(1, T, dm.H, dm.G, dm.D, 500 + std::uint32_t(s));
      const FloatCase f(c);
      h.add(s, &f, 0, T, dm, rng);
      start.push_back(T);
    }
    pre.run<Set>(graphed, h, opt, stream);
    pre.run<Set>(plain, h, opt, stream);
    if (shared) pre.run<Set>(own, h, opt, stream);
  }
  // the decode batch: 8 rows, padding at rows 2 and 6, slots in a shuffled order
  Slots slots{3, 0, -1, 5, 1, 4, -1, 2};
  const std::int64_t R = 8, N = 8;
  DevStep<float> a(dm, N, R), b(dm, N, R), o(dm, N, R);
  const auto step_input = [&](std::mt19937_64& g) {
    HostStep h;
    for (auto s : slots) h.add(s, nullptr, 0, 1, dm, g);  // random tokens (unit-norm keys below)
    for (std::int64_t x = 0; x < N * dm.G; ++x) {
      double norm = 0;
      for (std::int64_t d = 0; d < dm.D; ++d) norm += double(h.k[x * dm.D + d]) * h.k[x * dm.D + d];
      for (std::int64_t d = 0; d < dm.D; ++d) h.k[x * dm.D + d] = float(h.k[x * dm.D + d] / std::sqrt(norm));
    }
    h.slot = slots;
    return h;
  };
  // capture once (the inputs' addresses are fixed; their contents change between replays)
  a.upload(step_input(rng), stream);
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t graph_exec = nullptr;
  KVMEM_CUDA_REQUIRE(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  const Status captured = kua::step<Set>(exec, graphed, a.rows(R), a.inputs(N), opt, a.out_view(N), a.lse_view(N));
  KVMEM_CUDA_REQUIRE(cudaStreamEndCapture(stream, &graph));
  INFO(captured.to_string());
  REQUIRE(captured.is_ok());
  KVMEM_CUDA_REQUIRE(cudaGraphInstantiate(&graph_exec, graph, 0));
  std::size_t differing = 0;
  std::int64_t moves = 0, page_mismatches = 0;
  double worst_own = 0;
  std::vector<std::int64_t> in_use_before(std::size_t(8 * dm.G), 0), kept_before(in_use_before.size(), 0);
  std::mt19937_64 inputs_rng(99);
  for (int t = 0; t < 600; ++t) {
    if (t == 200) slots[2] = 6;
    if (t == 400) {
      DevList five(Slots{5});
      REQUIRE(kua::reset_slots(exec, graphed, five.view()).is_ok());
      REQUIRE(kua::reset_slots(exec, plain, five.view()).is_ok());
      if (shared) REQUIRE(kua::reset_slots(exec, own, five.view()).is_ok());
      for (std::int64_t g = 0; g < dm.G; ++g)
        in_use_before[std::size_t(5 * dm.G + g)] = kept_before[std::size_t(5 * dm.G + g)] = 0;
    }
    const HostStep h = step_input(inputs_rng);
    a.upload(h, stream);
    b.upload(h, stream);
    if (shared) o.upload(h, stream);
    KVMEM_CUDA_REQUIRE(cudaGraphLaunch(graph_exec, stream));
    const Status st = kua::step<Set>(exec, plain, b.rows(R), b.inputs(N), opt, b.out_view(N), b.lse_view(N));
    REQUIRE(st.is_ok());
    if (shared) REQUIRE(kua::step<Set>(exec, own, o.rows(R), o.inputs(N), opt, o.out_view(N), o.lse_view(N)).is_ok());
    KVMEM_CUDA_REQUIRE(cudaStreamSynchronize(stream));
    const auto oa = a.out.get(), ob = b.out.get(), la = a.lse.get(), lb = b.lse.get();
    differing += std::size_t(std::memcmp(oa.data(), ob.data(), oa.size() * sizeof(float)) != 0) +
                 std::size_t(std::memcmp(la.data(), lb.data(), la.size() * sizeof(float)) != 0);
    for (std::int64_t row = 0; row < R; ++row)
      if (slots[std::size_t(row)] < 0)
        for (std::int64_t x = row * dm.H * dm.D; x < (row + 1) * dm.H * dm.D; ++x) REQUIRE(oa[std::size_t(x)] == 0.0f);
    if (!shared) continue;
    worst_own = std::max(worst_own, relative_frobenius(o.out.get(), ob));
    // the pages of the rows in use, and the steps that moved a long item (the step found a page's worth
    // of dead rows: after it, the item holds its live rows and the new one, and only this step's marks)
    std::vector<std::int64_t> kept, in_use(in_use_before.size()), held;
    REQUIRE(plain.lengths(kept, stream).is_ok());
    KVMEM_CUDA_REQUIRE(
        cudaMemcpy(in_use.data(), plain.device().length, in_use.size() * sizeof(std::int64_t), cudaMemcpyDeviceToHost));
    REQUIRE(plain.pages(exec, held).is_ok());
    for (std::size_t i = 0; i < in_use.size(); ++i) {
      page_mismatches += held[i] != (in_use[i] + 15) / 16;
      const std::int64_t was_dead = in_use_before[i] - kept_before[i];
      if (in_use_before[i] > kvmem::cuda::ua_detail::kOneBlockMaxKept && was_dead >= 16) {
        ++moves;
        CHECK(in_use[i] == kept_before[i] + 1);
      }
    }
    CHECK(plain.pages_taken() - plain.pages_returned() == plain.pages_in_use());
    in_use_before = in_use;
    kept_before = kept;
  }
  CHECK(differing == 0);
  if (shared) {
    INFO("worst relative Frobenius against own pages " << worst_own << ", steps that moved a long item " << moves);
    CHECK(worst_own <= 1e-5);
    CHECK(page_mismatches == 0);
  }
  REQUIRE(graphed.step_status(exec).is_ok());
  // the caches: the same positions, kept rows, λ, keys and values bit for bit
  std::vector<std::int64_t> pg, pp;
  REQUIRE(graphed.positions(exec, pg).is_ok());
  REQUIRE(plain.positions(exec, pp).is_ok());
  CHECK(pg == pp);
  std::int64_t shortest = cap, longest = 0;
  start.push_back(0);  // slot 6 starts empty at step 200
  for (std::int32_t s = 0; s <= kSlots; ++s) {
    const std::int64_t expected = s == 5 ? 200 : s == 6 ? 400 : start[std::size_t(s)] + 600;
    CHECK(pg[std::size_t(s)] == expected);
    for (std::int64_t g = 0; g < dm.G; ++g) {
      std::vector<std::int64_t> pos1, pos2;
      std::vector<float> lam1, lam2, k1, k2, v1, v2;
      REQUIRE(graphed.download(s, g, pos1, lam1, &k1, &v1, stream).is_ok());
      REQUIRE(plain.download(s, g, pos2, lam2, &k2, &v2, stream).is_ok());
      CHECK(pos1 == pos2);
      CHECK(differing_bits(lam1, lam2) == 0);
      CHECK(differing_bits(k1, k2) == 0);
      CHECK(differing_bits(v1, v2) == 0);
      if (shared) {  // the same kept rows and λ where the rows own their pages
        std::vector<std::int64_t> pos3;
        std::vector<float> lam3, k3, v3;
        REQUIRE(own.download(s, g, pos3, lam3, &k3, &v3, stream).is_ok());
        CHECK(pos3 == pos2);
        CHECK(differing_bits(lam3, lam2) == 0);
        CHECK(differing_bits(k3, k2) == 0);
        CHECK(differing_bits(v3, v2) == 0);
      }
      shortest = std::min<std::int64_t>(shortest, std::int64_t(pos1.size()));
      longest = std::max<std::int64_t>(longest, std::int64_t(pos1.size()));
    }
  }
  std::printf("ua cuda graph %s: 600 replays, kept rows per (slot, kv head) %lld .. %lld at the end\n", label,
              (long long)shortest, (long long)longest);
  KVMEM_CUDA_REQUIRE(cudaGraphExecDestroy(graph_exec));
  KVMEM_CUDA_REQUIRE(cudaGraphDestroy(graph));
  KVMEM_CUDA_REQUIRE(cudaStreamDestroy(stream));
  return moves;
}
}  // namespace

TEST_CASE("ua cuda step: a captured decode graph replays 600 steps bitwise like the same steps uncaptured",
          "[ua][cuda][slots][graph]") {
  if (no_device()) return;
  // p = 0 keeps every key: slots pass from the one-block decode path (<= 256 kept rows) to the split
  // path during the replays; p = 0.05 prunes.
  graph_replay(kua::Options{0.0, 128, true}, "p=0");
  graph_replay(kua::Options{0.05, 128, true}, "p=0.05");
  // keys with lifetimes of about 190-470 steps (tests/ua/ua_lifetime_set.hpp): long slots evict as they
  // decode, so over a shared pool their dead rows reach a page's worth and the step moves their live
  // rows into fresh pages (reserve_slot, decode_item)
  const std::int64_t moves = graph_replay<LifetimeSet<-83>>(kua::Options{0.05, 128, true}, "shared pool, lifetimes",
                                                            8 * Dims{}.G * 2 * (2048 / 16));
  CHECK(moves >= 1);
}

// ---- (c) records across backends ---------------------------------------------------------------------
namespace {
std::vector<float> part(const std::vector<float>& x, std::int64_t from, std::int64_t to) {
  return std::vector<float>(x.begin() + from, x.begin() + to);
}
// Host step of one token of f at t0 for `slot` of a host cache; returns out [H*D].
std::vector<float> host_token(kua::PrunedCache<float>& hc, std::int32_t slot, const FloatCase& f, std::int64_t t0) {
  const std::int64_t H = f.c.H, D = f.c.D;
  const Slots sl{slot}, qs{0, 1};
  const Rows r{TensorView<const std::int32_t, 1>(sl.data(), {1}), TensorView<const std::int32_t, 1>(qs.data(), {2})};
  std::vector<float> out(std::size_t(H * D));
  const Status st = kua::step(kvmem::host::Executor{}, hc, r, packed_view(f, t0, 1), kua::Options{0.05, 128, true},
                              TensorView<float, 3>(out.data(), {1, H, D}));
  INFO(st.to_string());
  REQUIRE(st.is_ok());
  return out;
}
}  // namespace

TEST_CASE("ua cuda slots: a CUDA export continues on the host, a host export continues on CUDA",
          "[ua][cuda][slots][record]") {
  if (no_device()) return;
  const Dims dm;
  const std::int64_t H = dm.H, D = dm.D, cap = 1024;
  const kua::Options opt{0.05, 128, true};
  const kvmem::cuda::Executor exec{};
  std::mt19937_64 rng(1);
  kvmem::cuda::UaCache<float> cache;
  REQUIRE(kvmem::cuda::UaCache<float>::create({4, H, dm.G, D, cap, 16}, cache).is_ok());
  DevStep<float> dev(dm, 256, 4);

  // CUDA -> host: 300 tokens on CUDA slot 2 (rows of 200 and 100), the record imported into host slot 1,
  // then 120 decode tokens on both
  const Seq<float> a(random_case(1, 420, H, dm.G, D, 4242));
  std::vector<std::int64_t> rows{200, 100};
  for (std::int64_t t0 = 0; const auto T : rows) {
    HostStep h;
    h.add(2, &a.f, t0, T, dm, rng);
    dev.run(cache, h, opt, nullptr);
    t0 += T;
  }
  std::vector<std::byte> rec(kua::export_bytes(cache, 2));
  REQUIRE(!rec.empty());
  REQUIRE(kua::export_slot(exec, cache, 2, std::span<std::byte>(rec)).is_ok());
  kua::PrunedCache<float> hc(kua::CacheShape{3, H, dm.G, D, cap, 16});
  const Status imported = kua::import_slot(kvmem::host::Executor{}, hc, 1, std::span<const std::byte>(rec));
  INFO(imported.to_string());
  REQUIRE(imported.is_ok());
  CHECK(hc.position(1) == 300);
  std::vector<std::byte> again(kua::export_bytes(hc, 1));
  REQUIRE(kua::export_slot(kvmem::host::Executor{}, hc, 1, std::span<std::byte>(again)).is_ok());
  CHECK(again == rec);  // the host holds exactly what the CUDA slot held
  rows.resize(rows.size() + 120, 1);
  const Alone alone_a = run_alone<float>(a.f, rows, opt, cap);
  std::vector<float> on_host, on_cuda;
  for (std::int64_t t = 300; t < 420; ++t) {
    const auto o = host_token(hc, 1, a.f, t);
    on_host.insert(on_host.end(), o.begin(), o.end());
    HostStep h;
    h.add(2, &a.f, t, 1, dm, rng);
    const auto [oc, lc] = dev.run(cache, h, opt, nullptr);
    on_cuda.insert(on_cuda.end(), oc.begin(), oc.end());
  }
  const auto expected_a = part(alone_a.out, 300 * H * D, 420 * H * D);
  INFO("CUDA -> host: host " << relative_frobenius(on_host, expected_a) << ", cuda "
                             << relative_frobenius(on_cuda, expected_a));
  CHECK(relative_frobenius(on_host, expected_a) <= 1e-4);
  CHECK(relative_frobenius(on_cuda, expected_a) <= 1e-4);

  // host -> CUDA: 250 tokens of another sequence on host slot 0, imported into CUDA slot 0, then 50
  // decode tokens on both
  const Seq<float> b(random_case(1, 300, H, dm.G, D, 777));
  const std::vector<std::int64_t> brows = [] {
    std::vector<std::int64_t> r{250};
    r.resize(51, 1);
    return r;
  }();
  const Alone alone_b = run_alone<float>(b.f, brows, opt, cap);
  {
    const Slots sl{0}, qs{0, 250};
    const Rows r{TensorView<const std::int32_t, 1>(sl.data(), {1}), TensorView<const std::int32_t, 1>(qs.data(), {2})};
    std::vector<float> out(std::size_t(250 * H * D));
    REQUIRE(kua::step(kvmem::host::Executor{}, hc, r, packed_view(b.f, 0, 250), opt,
                      TensorView<float, 3>(out.data(), {250, H, D}))
                .is_ok());
  }
  std::vector<std::byte> hrec(kua::export_bytes(hc, 0));
  REQUIRE(kua::export_slot(kvmem::host::Executor{}, hc, 0, std::span<std::byte>(hrec)).is_ok());
  {
    const Status st = kua::import_slot(exec, cache, 0, std::span<const std::byte>(hrec));
    INFO(st.to_string());
    REQUIRE(st.is_ok());
  }
  CHECK(cache.position(0) == 250);
  std::vector<std::byte> crec(kua::export_bytes(cache, 0));
  REQUIRE(kua::export_slot(exec, cache, 0, std::span<std::byte>(crec)).is_ok());
  CHECK(crec == hrec);
  on_host.clear();
  on_cuda.clear();
  for (std::int64_t t = 250; t < 300; ++t) {
    const auto o = host_token(hc, 0, b.f, t);
    on_host.insert(on_host.end(), o.begin(), o.end());
    HostStep h;
    h.add(0, &b.f, t, 1, dm, rng);
    const auto [oc, lc] = dev.run(cache, h, opt, nullptr);
    on_cuda.insert(on_cuda.end(), oc.begin(), oc.end());
  }
  const auto expected_b = part(alone_b.out, 250 * H * D, 300 * H * D);
  CHECK(differing_bits(on_host, expected_b) == 0);  // the host continued its own state
  INFO("host -> CUDA: cuda " << relative_frobenius(on_cuda, expected_b));
  CHECK(relative_frobenius(on_cuda, expected_b) <= 1e-4);
  CHECK(cache.position(2) == 420);  // slot 2 was not disturbed by the import into slot 0
}

TEST_CASE("ua cuda slots: a copied slot continues bit for bit like its source", "[ua][cuda][slots]") {
  if (no_device()) return;
  const Dims dm;
  const kua::Options opt{0.05, 32, true};
  const kvmem::cuda::Executor exec{};
  std::mt19937_64 rng(2);
  kvmem::cuda::UaCache<float> cache;
  REQUIRE(kvmem::cuda::UaCache<float>::create({4, dm.H, dm.G, dm.D, 512, 16}, cache).is_ok());
  DevStep<float> dev(dm, 512, 4);
  const Seq<float> s(random_case(1, 400, dm.H, dm.G, dm.D, 99));
  HostStep first;
  first.add(1, &s.f, 0, 300, dm, rng);
  dev.run(cache, first, opt, nullptr);
  DevList src(Slots{1}), dst(Slots{3});
  REQUIRE(kua::copy_slots(exec, cache, src.view(), dst.view()).is_ok());
  // both continue with the same tokens, a prefill row and then decode rows, in one step each
  for (std::int64_t t = 300; t < 400;) {
    const std::int64_t T = t == 300 ? 40 : 1;
    HostStep h;
    h.add(3, &s.f, t, T, dm, rng);
    h.add(1, &s.f, t, T, dm, rng);
    const auto [o, l] = dev.run(cache, h, opt, nullptr);
    const std::int64_t half = T * dm.H * dm.D;
    CHECK(differing_bits(part(o, 0, half), part(o, half, 2 * half)) == 0);
    CHECK(differing_bits(part(l, 0, T * dm.H), part(l, T * dm.H, 2 * T * dm.H)) == 0);
    t += T;
  }
  std::vector<std::byte> r1(kua::export_bytes(cache, 1)), r3(kua::export_bytes(cache, 3));
  REQUIRE(kua::export_slot(exec, cache, 1, std::span<std::byte>(r1)).is_ok());
  REQUIRE(kua::export_slot(exec, cache, 3, std::span<std::byte>(r3)).is_ok());
  CHECK(r1 == r3);
}

// ---- (d) overflow of one slot --------------------------------------------------------------------------
TEST_CASE("ua cuda step: a slot that runs out of rows is flagged and skipped while the others continue",
          "[ua][cuda][slots][overflow]") {
  if (no_device()) return;
  const Dims dm;
  const std::int64_t H = dm.H, D = dm.D, cap = 64;
  const kua::Options opt{0.0, 64, true};  // nothing is evicted: the slots fill up
  const kvmem::cuda::Executor exec{};
  std::mt19937_64 rng(3);
  kvmem::cuda::UaCache<float> cache;
  REQUIRE(kvmem::cuda::UaCache<float>::create({3, H, dm.G, D, cap, 16}, cache).is_ok());
  DevStep<float> dev(dm, 128, 4);
  const Seq<float> a(random_case(1, 80, H, dm.G, D, 10)), b(random_case(1, 80, H, dm.G, D, 11)),
      c(random_case(1, 80, H, dm.G, D, 12));
  std::vector<float> out_a, out_c, out_b;
  std::int64_t ta = 0, tb = 0, tc = 0;
  const auto take = [&](std::vector<float>& dst, const std::vector<float>& o, std::int64_t x0, std::int64_t x1) {
    dst.insert(dst.end(), o.begin() + x0 * H * D, o.begin() + x1 * H * D);
  };
  {  // a 20, b 50, c 10
    HostStep h;
    h.add(0, &a.f, 0, 20, dm, rng);
    h.add(1, &b.f, 0, 50, dm, rng);
    h.add(2, &c.f, 0, 10, dm, rng);
    const auto [o, l] = dev.run(cache, h, opt, nullptr);
    take(out_a, o, 0, 20);
    take(out_b, o, 20, 70);
    take(out_c, o, 70, 80);
    ta = 20, tb = 50, tc = 10;
  }
  for (int t = 0; t < 11; ++t) {  // b asks for 20 more tokens (50 + 20 > 64), then for one at a time
    HostStep h;
    h.add(2, &c.f, tc, 1, dm, rng);
    const std::int64_t nb = t == 0 ? 20 : 1;
    h.add(1, &b.f, tb, nb, dm, rng);
    h.add(0, &a.f, ta, 1, dm, rng);
    const auto [o, l] = dev.run(cache, h, opt, nullptr);
    take(out_c, o, 0, 1);
    take(out_a, o, 1 + nb, 2 + nb);
    for (std::int64_t x = H * D; x < (1 + nb) * H * D; ++x) REQUIRE(o[std::size_t(x)] == 0.0f);  // b: zeroed
    for (std::int64_t x = H; x < (1 + nb) * H; ++x) REQUIRE(l[std::size_t(x)] == 0.0f);
    ++ta, ++tc;
    std::vector<std::int32_t> flags;
    REQUIRE(cache.overflowed(exec, flags).is_ok());
    CHECK(flags == std::vector<std::int32_t>{0, 1, 0});
  }
  std::vector<std::int64_t> pos;
  REQUIRE(cache.positions(exec, pos).is_ok());
  CHECK(pos == std::vector<std::int64_t>{ta, tb, tc});
  std::vector<std::int64_t> rows_a{20}, rows_c{10};
  rows_a.resize(12, 1);
  rows_c.resize(12, 1);
  const Alone alone_a = run_alone<float>(a.f, rows_a, opt, cap), alone_b = run_alone<float>(b.f, {50}, opt, cap),
              alone_c = run_alone<float>(c.f, rows_c, opt, cap);
  CHECK(relative_frobenius(out_a, alone_a.out) <= 1e-4);
  CHECK(relative_frobenius(out_b, alone_b.out) <= 1e-4);
  CHECK(relative_frobenius(out_c, alone_c.out) <= 1e-4);
  // b's slot is as it was before the refused row: its record equals the host's after 50 tokens
  std::vector<std::byte> rec(kua::export_bytes(cache, 1));
  REQUIRE(kua::export_slot(exec, cache, 1, std::span<std::byte>(rec)).is_ok());
  CHECK(rec.size() == alone_b.record.size());
  // reset clears the flag: the slot takes a new sequence
  DevList one(Slots{1});
  REQUIRE(kua::reset_slots(exec, cache, one.view()).is_ok());
  std::vector<std::int32_t> flags;
  REQUIRE(cache.overflowed(exec, flags).is_ok());
  CHECK(flags == std::vector<std::int32_t>{0, 0, 0});
  HostStep h;
  h.add(1, &b.f, 0, 30, dm, rng);
  const auto [o, l] = dev.run(cache, h, opt, nullptr);
  const Alone again = run_alone<float>(b.f, {30}, opt, cap);
  CHECK(relative_frobenius(o, again.out) <= 1e-4);
  CHECK(cache.position(1) == 30);
  // A row that fills its slot exactly (kept + tokens == capacity) still runs: c holds 21 rows, takes 43
  HostStep to_capacity;
  to_capacity.add(2, &c.f, tc, 43, dm, rng);
  const std::vector<float> o_full = dev.run(cache, to_capacity, opt, nullptr).first;
  REQUIRE(cache.overflowed(exec, flags).is_ok());
  CHECK(flags == std::vector<std::int32_t>{0, 0, 0});
  rows_c.push_back(43);
  const Alone alone_full = run_alone<float>(c.f, rows_c, opt, cap);
  const std::vector<float> last(alone_full.out.end() - 43 * H * D, alone_full.out.end());
  CHECK(relative_frobenius(o_full, last) <= 1e-4);
  CHECK(cache.position(2) == tc + 43);
}

// ---- (e) refusals ---------------------------------------------------------------------------------------
namespace {
// Every slot's record: the whole observable state of a cache.
std::vector<std::vector<std::byte>> snapshot(const kvmem::cuda::UaCache<float>& cache) {
  std::vector<std::vector<std::byte>> recs;
  for (std::int32_t s = 0; s < std::int32_t(cache.max_slots()); ++s) {
    recs.emplace_back(kua::export_bytes(cache, s));
    REQUIRE(!recs.back().empty());
    REQUIRE(kua::export_slot(kvmem::cuda::Executor{}, cache, s, std::span<std::byte>(recs.back())).is_ok());
  }
  return recs;
}
// Every operation refuses an empty cache (never created or moved from).
void check_refuses_everything(kvmem::cuda::UaCache<float>& empty, DevStep<float>& dev) {
  const kvmem::cuda::Executor exec{};
  const kua::Options opt{0.05, 128, true};
  DevList l0(Slots{0}), l1(Slots{1});
  CHECK(!empty.valid());
  CHECK(empty.max_slots() == 0);
  CHECK(!kua::step(exec, empty, dev.rows(1), dev.inputs(1), opt, dev.out_view(1), dev.lse_view(1)).is_ok());
  CHECK(!kua::reset_slots(exec, empty, l0.view()).is_ok());
  CHECK(!kua::copy_slots(exec, empty, l0.view(), l1.view()).is_ok());
  CHECK(kua::export_bytes(empty, 0) == 0);
  std::vector<std::byte> buf(4096);
  CHECK(!kua::export_slot(exec, empty, 0, std::span<std::byte>(buf)).is_ok());
  CHECK(!kua::import_slot(exec, empty, 0, std::span<const std::byte>(buf)).is_ok());
  CHECK(!kua::truncate(exec, empty, 0, 0).is_ok());
  std::vector<std::int64_t> pos;
  std::vector<std::int32_t> flags;
  CHECK(!empty.positions(exec, pos).is_ok());
  CHECK(!empty.overflowed(exec, flags).is_ok());
  CHECK(!empty.step_status(exec).is_ok());
  CHECK(!empty.reset_sequence(0, nullptr).is_ok());
  CHECK(empty.position(0) == 0);
}
}  // namespace

TEST_CASE("ua cuda slots: empty caches, bad slots and bad rows are refused and leave the cache untouched",
          "[ua][cuda][slots][refusals]") {
  if (no_device()) return;
  const Dims dm;
  const kua::Options opt{0.05, 128, true};
  const kvmem::cuda::Executor exec{};
  std::mt19937_64 rng(4);
  DevStep<float> dev(dm, 64, 4);
  {
    HostStep h;
    h.add(0, nullptr, 0, 1, dm, rng);
    dev.upload(h, nullptr);
  }
  kvmem::cuda::UaCache<float> never;
  check_refuses_everything(never, dev);

  kvmem::cuda::UaCache<float> owner;
  REQUIRE(kvmem::cuda::UaCache<float>::create({4, dm.H, dm.G, dm.D, 256, 16}, owner).is_ok());
  const Seq<float> s(random_case(1, 40, dm.H, dm.G, dm.D, 5));
  {
    HostStep h;
    h.add(0, &s.f, 0, 30, dm, rng);
    h.add(1, &s.f, 0, 1, dm, rng);
    dev.run(owner, h, opt, nullptr);
  }
  kvmem::cuda::UaCache<float> cache = std::move(owner);
  check_refuses_everything(owner, dev);
  CHECK(cache.position(0) == 30);
  CHECK(cache.position(1) == 1);

  const auto before = snapshot(cache);
  const auto code = [](const Status& st) { return st.code(); };
  {  // what the host sees without reading a list is refused by the call
    DevList s0(Slots{0}), d12(Slots{1, 2});
    CHECK(code(kua::copy_slots(exec, cache, s0.view(), d12.view())) == StatusCode::kInvalidArgument);  // counts differ
    CHECK(code(kua::reset_slots(exec, cache, TensorView<const std::int32_t, 1>(d12.d.ptr, {2}, {2}))) ==
          StatusCode::kInvalidArgument);  // stride 2
    CHECK(code(kua::reset_slots(exec, cache, TensorView<const std::int32_t, 1>(nullptr, {1}))) ==
          StatusCode::kInvalidArgument);
    CHECK(code(kua::copy_slots(exec, cache, TensorView<const std::int32_t, 1>(nullptr, {2}), d12.view())) ==
          StatusCode::kInvalidArgument);
  }
  {  // bad indices are refused on the device: the call returns ok and step_status returns, once, the Status
     // the host returns for the same lists (the first failure in the host's order)
    kua::PrunedCache<float> host(kua::CacheShape{4, dm.H, dm.G, dm.D, 256, 16});
    const auto host_view = [](const Slots& l) {
      return TensorView<const std::int32_t, 1>(l.data(), {std::int64_t(l.size())});
    };
    const auto refused_reset = [&](const Slots& slots, StatusCode want, const char* field) {
      DevList l(slots);
      REQUIRE(kua::reset_slots(exec, cache, l.view()).is_ok());
      const Status got = cache.step_status(exec);
      INFO(got.to_string());
      CHECK(got.code() == want);
      CHECK(got.message().find(field) != std::string::npos);
      CHECK(got.to_string() == kua::reset_slots(kvmem::host::Executor{}, host, host_view(slots)).to_string());
      CHECK(cache.step_status(exec).is_ok());  // read once, cleared
    };
    const auto refused_copy = [&](const Slots& from, const Slots& to, StatusCode want, const char* field) {
      DevList a(from), b(to);
      REQUIRE(kua::copy_slots(exec, cache, a.view(), b.view()).is_ok());
      const Status got = cache.step_status(exec);
      INFO(got.to_string());
      CHECK(got.code() == want);
      CHECK(got.message().find(field) != std::string::npos);
      CHECK(got.to_string() ==
            kua::copy_slots(kvmem::host::Executor{}, host, host_view(from), host_view(to)).to_string());
      CHECK(cache.step_status(exec).is_ok());
    };
    refused_reset({0, 4}, StatusCode::kOutOfRange, "slots[1]");
    refused_reset({-1}, StatusCode::kOutOfRange, "slots[0]");
    refused_copy({0}, {4}, StatusCode::kOutOfRange, "dst[0]");
    refused_copy({0, -3}, {2, 9}, StatusCode::kOutOfRange, "src[1]");      // every source before any destination
    refused_copy({0, 1}, {2, 2}, StatusCode::kInvalidArgument, "dst[1]");  // a destination twice
    refused_copy({0, 1}, {1, 2}, StatusCode::kInvalidArgument, "dst[0]");  // a destination that is a source
    refused_copy({1, 0, 0}, {3, 2, 1}, StatusCode::kInvalidArgument, "dst[2]");
  }
  {  // a refused list is sticky: later good calls are refused too, until step_status reads the first refusal
    DevList s01(Slots{0, 1}), d22(Slots{2, 2}), one(Slots{1}), s0(Slots{0}), d3(Slots{3});
    REQUIRE(kua::copy_slots(exec, cache, s01.view(), d22.view()).is_ok());
    REQUIRE(kua::reset_slots(exec, cache, one.view()).is_ok());
    REQUIRE(kua::copy_slots(exec, cache, s0.view(), d3.view()).is_ok());
    CHECK(snapshot(cache) == before);
    const Status st = cache.step_status(exec);
    INFO(st.to_string());
    CHECK(st.to_string().find("dst[1]") != std::string::npos);
    CHECK(cache.step_status(exec).is_ok());
  }
  std::vector<std::byte> buf(before[0].size());
  CHECK(kua::export_bytes(cache, 4) == 0);
  CHECK(code(kua::export_slot(exec, cache, 4, std::span<std::byte>(buf))) == StatusCode::kOutOfRange);
  CHECK(code(kua::export_slot(exec, cache, 0, std::span<std::byte>(buf).first(buf.size() - 1))) ==
        StatusCode::kOutOfRange);
  CHECK(code(kua::import_slot(exec, cache, 4, std::span<const std::byte>(before[0]))) == StatusCode::kOutOfRange);
  CHECK(!kua::import_slot(exec, cache, 2, std::span<const std::byte>(before[0]).first(before[0].size() - 4)).is_ok());
  {  // a record of another head dim names the field
    kua::PrunedCache<float> other(kua::CacheShape{1, dm.H, dm.G, dm.D / 2, 16, 16});
    std::vector<std::byte> rec(kua::export_bytes(other, 0));
    REQUIRE(kua::export_slot(kvmem::host::Executor{}, other, 0, std::span<std::byte>(rec)).is_ok());
    const Status st = kua::import_slot(exec, cache, 2, std::span<const std::byte>(rec));
    CHECK(!st.is_ok());
    CHECK(st.to_string().find("head_dim") != std::string::npos);
  }
  CHECK(code(kua::truncate(exec, cache, 4, 0)) == StatusCode::kOutOfRange);
  CHECK(code(kua::truncate(exec, cache, 0, 31)) == StatusCode::kOutOfRange);
  CHECK(code(kua::truncate(exec, cache, 0, -1)) == StatusCode::kOutOfRange);
  CHECK(code(kua::truncate(exec, cache, 0, 10)) == StatusCode::kUnsupported);
  CHECK(kua::truncate(exec, cache, 0, 0).is_ok());
  // rows the device refuses: the step enqueues, runs nothing, and step_status says why
  // N: the packed token count the step's views say (random tokens fill them)
  const auto refused = [&](const Slots& slots, const Slots& qs, std::int64_t N, const char* field, StatusCode want) {
    HostStep h;
    h.add(-1, nullptr, 0, N, dm, rng);
    h.slot = slots;
    h.qs = qs;
    dev.upload(h, nullptr);
    const std::int64_t R = std::int64_t(slots.size());
    REQUIRE(kua::step(exec, cache, dev.rows(R), dev.inputs(N), opt, dev.out_view(N), dev.lse_view(N)).is_ok());
    const Status st = cache.step_status(exec);
    INFO(st.to_string());
    CHECK(st.code() == want);
    CHECK(st.to_string().find(field) != std::string::npos);
  };
  refused({0, 0}, {0, 1, 2}, 2, "slot[1]", StatusCode::kInvalidArgument);
  refused({1, 7}, {0, 1, 2}, 2, "slot[1]", StatusCode::kOutOfRange);
  refused({1, -2}, {0, 1, 2}, 2, "slot[1]", StatusCode::kOutOfRange);
  refused({0, 1}, {0, 2, 1}, 2, "query_start[1]", StatusCode::kInvalidArgument);
  refused({0, 1}, {1, 1, 2}, 2, "query_start[0]", StatusCode::kInvalidArgument);
  refused({0, 1}, {0, 1, 3}, 2, "query_start[2]", StatusCode::kInvalidArgument);  // the last is not N
  {  // a refusal is sticky: the next (good) step is refused too, until step_status reads and clears it
    HostStep bad;
    bad.add(0, nullptr, 0, 2, dm, rng);
    bad.slot = {0, 0};
    bad.qs = {0, 1, 2};
    dev.upload(bad, nullptr);
    REQUIRE(kua::step(exec, cache, dev.rows(2), dev.inputs(2), opt, dev.out_view(2), dev.lse_view(2)).is_ok());
    HostStep good;
    good.add(1, &s.f, 1, 1, dm, rng);
    dev.upload(good, nullptr);
    REQUIRE(kua::step(exec, cache, dev.rows(1), dev.inputs(1), opt, dev.out_view(1), dev.lse_view(1)).is_ok());
    const Status st = cache.step_status(exec);
    INFO(st.to_string());
    CHECK(st.to_string().find("slot[1]") != std::string::npos);
    CHECK(cache.step_status(exec).is_ok());  // read once, cleared
  }
  CHECK(snapshot(cache) == before);
  // a good step after the refused ones runs, and a whole-slot truncate resets
  {
    HostStep h;
    h.add(1, &s.f, 1, 1, dm, rng);
    dev.run(cache, h, opt, nullptr);
  }
  CHECK(cache.position(1) == 2);
  {  // and slot operations run again: slot 3 becomes a copy of slot 0, then a list naming slot 3 twice
     // resets it once (its pages go back once)
    REQUIRE(cache.step_status(exec).is_ok());
    const std::int64_t in_use = cache.pages_in_use();
    DevList s0(Slots{0}), d3(Slots{3}), twice(Slots{3, 3});
    REQUIRE(kua::copy_slots(exec, cache, s0.view(), d3.view()).is_ok());
    REQUIRE(cache.step_status(exec).is_ok());
    CHECK(cache.position(3) == 30);
    CHECK(snapshot(cache)[3] == before[0]);
    CHECK(cache.pages_in_use() > in_use);
    REQUIRE(kua::reset_slots(exec, cache, twice.view()).is_ok());
    REQUIRE(cache.step_status(exec).is_ok());
    CHECK(cache.position(3) == 0);
    CHECK(cache.pages_in_use() == in_use);
    CHECK(cache.pages_taken() - cache.pages_returned() == cache.pages_in_use());
  }
  CHECK(kua::truncate(exec, cache, 0, 30).is_ok());
  CHECK(cache.position(0) == 0);
  CHECK(kua::export_bytes(cache, 0) < before[0].size());
}

// Rows::max_query_len bounds the prefill rounds of a step (ceil(bound / prefill_chunk) instead of
// ceil(tokens / prefill_chunk); none for a bound of 1), which leaves out only rounds that had nothing to
// do: outputs, lse and every slot's record equal those of the same steps without the bound, bit for bit.
// The longest row holds 2 prefill chunks and 1 token, so a round short would leave its last token out.
// A row naming a slot over the bound refuses the step with the host's Status, and nothing changes.
TEST_CASE(
    "ua cuda step: max_query_len gives the unbounded step's outputs and state bitwise; a row over it is "
    "refused",
    "[ua][cuda][slots]") {
  if (no_device()) return;
  const Dims dm;
  const kua::Options opt{0.05, 32, true};
  const kvmem::cuda::Executor exec{};
  std::mt19937_64 rng(17);
  DevStep<float> dev(dm, 160, 5);
  kvmem::cuda::UaCache<float> bounded, unbounded;
  for (auto* c : {&bounded, &unbounded})
    REQUIRE(kvmem::cuda::UaCache<float>::create({4, dm.H, dm.G, dm.D, 256, 16}, *c).is_ok());
  std::vector<Seq<float>> seq;
  for (std::uint32_t i = 0; i < 4; ++i) seq.emplace_back(random_case(1, 120, dm.H, dm.G, dm.D, 40 + i));
  const auto same = [&](const HostStep& h, std::int64_t bound) {
    const auto with = dev.run(bounded, h, opt, nullptr, bound);
    const auto without = dev.run(unbounded, h, opt, nullptr);
    CHECK(differing_bits(with.first, without.first) == 0);
    CHECK(differing_bits(with.second, without.second) == 0);
    CHECK(snapshot(bounded) == snapshot(unbounded));
    return with;
  };
  {  // 65 tokens (2 chunks + 1), a padding row of 40, 20 tokens, a decode row: 3 rounds instead of 4
    HostStep h;
    h.add(0, &seq[0].f, 0, 65, dm, rng);
    h.add(-1, nullptr, 0, 40, dm, rng);
    h.add(1, &seq[1].f, 0, 20, dm, rng);
    h.add(2, &seq[2].f, 0, 1, dm, rng);
    const auto with = same(h, 65);
    for (std::size_t i = 65 * std::size_t(dm.H * dm.D); i < 105 * std::size_t(dm.H * dm.D); ++i)
      REQUIRE(with.first[i] == 0.0f);  // the padding row
  }
  {  // a decode step: no prefill round at all with a bound of 1
    HostStep h;
    for (std::int32_t s = 0; s < 3; ++s) h.add(s, &seq[std::size_t(s)].f, s == 0 ? 65 : s == 1 ? 20 : 1, 1, dm, rng);
    h.add(3, &seq[3].f, 0, 1, dm, rng);
    same(h, 1);
  }
  {  // rows continuing mid-chunk, bounded by a value above the longest row
    HostStep h;
    h.add(3, &seq[3].f, 1, 50, dm, rng);
    h.add(1, &seq[1].f, 21, 33, dm, rng);
    same(h, 100);
  }
  // rows over the bound: refused on the device with the host's Status, nothing changes
  const auto before = snapshot(bounded);
  const auto refused = [&](const HostStep& h, std::int64_t bound) {
    dev.upload(h, nullptr);
    const std::int64_t N = h.tokens(), R = std::int64_t(h.slot.size());
    REQUIRE(kua::step(exec, bounded, dev.rows(R, bound), dev.inputs(N), opt, dev.out_view(N), dev.lse_view(N)).is_ok());
    const Status st = bounded.step_status(exec);
    INFO(st.to_string());
    CHECK(st.code() == StatusCode::kInvalidArgument);
    const Rows host{TensorView<const std::int32_t, 1>(h.slot.data(), {R}),
                    TensorView<const std::int32_t, 1>(h.qs.data(), {R + 1}), bound};
    CHECK(st.to_string() == kvmem::validate_rows(host, 4, N).to_string());
    CHECK(bounded.step_status(exec).is_ok());  // read once, cleared
    CHECK(snapshot(bounded) == before);
  };
  {
    HostStep h;
    h.add(2, &seq[2].f, 2, 1, dm, rng);
    h.add(-1, nullptr, 0, 9, dm, rng);  // a padding row may be longer
    h.add(0, &seq[0].f, 66, 5, dm, rng);
    refused(h, 4);  // row 2 holds 5
    HostStep two;
    two.add(1, &seq[1].f, 54, 2, dm, rng);
    refused(two, 1);  // a 2-token row where the bound launches no prefill round
  }
  CHECK(kua::step(exec, bounded, dev.rows(1, -1), dev.inputs(1), opt, dev.out_view(1), dev.lse_view(1)).code() ==
        StatusCode::kInvalidArgument);  // a negative bound, refused on the host
  {                                     // the cache steps on
    HostStep h;
    h.add(0, &seq[0].f, 66, 5, dm, rng);
    h.add(-1, nullptr, 0, 9, dm, rng);
    same(h, 5);
  }
}

// ---- (f) slot operations and a step in one CUDA graph -------------------------------------------------
namespace {
// Two caches: one replays a graph captured from copy_slots (fork slot 0 into slot 5), reset_slots (slot 6
// starts over) and a padded decode step of slots 5, 0, 6 and 1; the other runs the same three calls
// uncaptured, and every replay's outputs must equal the uncaptured calls' bit for bit. The lists and
// rows stay in their device buffers, whose contents the replays read: at one replay the copy's
// destination is made invalid, and the whole replay is refused (the copy by its list, the reset and the
// step by the sticky refusal) and changes nothing, until step_status reads it. Over a shared pool the
// fork and the reset move pages on every replay.
void slot_ops_graph(const kua::CacheShape& shape, const kua::Options& opt, const char* label) {
  const Dims dm;
  const std::int64_t replays = 48, bad_replay = 17, R = 5, N = 5;
  kvmem::cuda::UaCache<float> graphed, plain;
  REQUIRE(kvmem::cuda::UaCache<float>::create(shape, graphed).is_ok());
  REQUIRE(kvmem::cuda::UaCache<float>::create(shape, plain).is_ok());
  cudaStream_t stream = nullptr;
  KVMEM_CUDA_REQUIRE(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const kvmem::cuda::Executor exec{stream};
  std::mt19937_64 rng(91);
  {  // slots 0, 1 and 6 hold 150, 40 and 9 tokens (one prefill row each, both caches alike)
    DevStep<float> pre(dm, 256, 3);
    HostStep h;
    for (const auto& [s, T] : {std::pair<std::int32_t, std::int64_t>{0, 150}, {1, 40}, {6, 9}}) {
      const Case c = random_case(1, T, dm.H, dm.G, dm.D, 900 + std::uint32_t(s));
      const FloatCase f(c);
      h.add(s, &f, 0, T, dm, rng);
    }
    pre.run(graphed, h, opt, stream);
    pre.run(plain, h, opt, stream);
  }
  const Slots rows_slots{5, 0, -1, 6, 1};
  DevStep<float> a(dm, N, R), b(dm, N, R);
  DevList src(Slots{0}), dst(Slots{5}), reset(Slots{6});
  const auto step_input = [&](std::mt19937_64& g) {
    HostStep h;
    for (auto s : rows_slots) h.add(s, nullptr, 0, 1, dm, g);  // random tokens (unit-norm keys below)
    for (std::int64_t x = 0; x < N * dm.G; ++x) {
      double norm = 0;
      for (std::int64_t d = 0; d < dm.D; ++d) norm += double(h.k[x * dm.D + d]) * h.k[x * dm.D + d];
      for (std::int64_t d = 0; d < dm.D; ++d) h.k[x * dm.D + d] = float(h.k[x * dm.D + d] / std::sqrt(norm));
    }
    return h;
  };
  const auto calls = [&](kvmem::cuda::UaCache<float>& cache, DevStep<float>& io) {
    KVMEM_RETURN_IF_ERROR(kua::copy_slots(exec, cache, src.view(), dst.view()));
    KVMEM_RETURN_IF_ERROR(kua::reset_slots(exec, cache, reset.view()));
    return kua::step(exec, cache, io.rows(R), io.inputs(N), opt, io.out_view(N), io.lse_view(N));
  };
  const auto put_dst = [&](std::int32_t value) {
    KVMEM_CUDA_REQUIRE(cudaMemcpyAsync(dst.d.ptr, &value, sizeof value, cudaMemcpyHostToDevice, stream));
    KVMEM_CUDA_REQUIRE(cudaStreamSynchronize(stream));  // `value` is a local
  };
  a.upload(step_input(rng), stream);
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t graph_exec = nullptr;
  KVMEM_CUDA_REQUIRE(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  const Status captured = calls(graphed, a);
  KVMEM_CUDA_REQUIRE(cudaStreamEndCapture(stream, &graph));
  INFO(captured.to_string());
  REQUIRE(captured.is_ok());
  KVMEM_CUDA_REQUIRE(cudaGraphInstantiate(&graph_exec, graph, 0));
  std::size_t differing = 0;
  for (std::int64_t r = 0; r < replays; ++r) {
    const HostStep h = step_input(rng);
    a.upload(h, stream);  // waits for the stream: the caches are at rest
    b.upload(h, stream);
    if (r == bad_replay) {
      const auto kept = snapshot(graphed);
      put_dst(std::int32_t(shape.batch));  // a destination outside the cache
      KVMEM_CUDA_REQUIRE(cudaGraphLaunch(graph_exec, stream));
      KVMEM_CUDA_REQUIRE(cudaStreamSynchronize(stream));
      CHECK(snapshot(graphed) == kept);
      const Status refused = graphed.step_status(exec);
      INFO(refused.to_string());
      CHECK(refused.code() == StatusCode::kOutOfRange);
      CHECK(refused.to_string().find("dst[0]") != std::string::npos);
      REQUIRE(graphed.step_status(exec).is_ok());
      put_dst(5);
      continue;  // the uncaptured cache skips this replay
    }
    KVMEM_CUDA_REQUIRE(cudaGraphLaunch(graph_exec, stream));
    REQUIRE(calls(plain, b).is_ok());
    KVMEM_CUDA_REQUIRE(cudaStreamSynchronize(stream));
    const auto oa = a.out.get(), ob = b.out.get(), la = a.lse.get(), lb = b.lse.get();
    differing += std::size_t(std::memcmp(oa.data(), ob.data(), oa.size() * sizeof(float)) != 0) +
                 std::size_t(std::memcmp(la.data(), lb.data(), la.size() * sizeof(float)) != 0);
    for (std::int64_t x = 2 * dm.H * dm.D; x < 3 * dm.H * dm.D; ++x) REQUIRE(oa[std::size_t(x)] == 0.0f);  // padding
  }
  CHECK(differing == 0);
  REQUIRE(graphed.step_status(exec).is_ok());
  REQUIRE(plain.step_status(exec).is_ok());
  std::vector<std::int64_t> pg, pp;
  REQUIRE(graphed.positions(exec, pg).is_ok());
  REQUIRE(plain.positions(exec, pp).is_ok());
  CHECK(pg == pp);
  // each good replay forked slot 0 (before its token) into 5, restarted 6 and stepped the four slots
  CHECK(pg[0] == 150 + replays - 1);
  CHECK(pg[5] == pg[0]);
  CHECK(pg[1] == 40 + replays - 1);
  CHECK(pg[6] == 1);
  CHECK(pg[2] == 0);
  CHECK(snapshot(graphed) == snapshot(plain));  // kept rows, λ, keys, values and positions of every slot
  CHECK(graphed.pages_in_use() == plain.pages_in_use());
  CHECK(graphed.pages_taken() - graphed.pages_returned() == graphed.pages_in_use());
  std::printf("ua cuda slot operations in a graph %s: %lld replays (one refused), %lld pages in use\n", label,
              (long long)replays, (long long)graphed.pages_in_use());
  KVMEM_CUDA_REQUIRE(cudaGraphExecDestroy(graph_exec));
  KVMEM_CUDA_REQUIRE(cudaGraphDestroy(graph));
  KVMEM_CUDA_REQUIRE(cudaStreamDestroy(stream));
}
}  // namespace

TEST_CASE("ua cuda slots: copy_slots, reset_slots and a decode step in one graph replay like uncaptured calls",
          "[ua][cuda][slots][graph]") {
  if (no_device()) return;
  const Dims dm;
  SECTION("own pages, p = 0.05") {
    slot_ops_graph({8, dm.H, dm.G, dm.D, 512, 16}, kua::Options{0.05, 128, true}, "own pages, p=0.05");
  }
  SECTION("shared pool, p = 0") {
    slot_ops_graph({8, dm.H, dm.G, dm.D, 512, 16, 96}, kua::Options{0.0, 128, true}, "shared pool, p=0");
  }
}
