// SPDX-License-Identifier: Apache-2.0
// kvmem-replay --trace: a seeded serving schedule (sequences joining and leaving 8 slots, prefill
// chunks mixed with decode tokens, padding rows, forks, export/import migrations, truncations,
// resets) is written as a trace and an inputs file, played by the tool, and every output row of every
// sequence is compared with that sequence computed here alone, through the library's own calls
// (KVM: one prefill of the whole sequence; UA: its rows as prefill/decode calls on a cache of one
// sequence). Malformed traces are refused with exit 2 and a message naming the step and field.
// kvmem-replay-cuda plays the same schedules on the CUDA backend (hidden tag [.cuda], label gpu), held
// to its own --check (each sequence alone on CUDA) and, for KVM fp32, to the host's sequence alone
// within the fp32 tolerance; without a visible GPU those cases check that the tool refuses in one line
// and say SKIPPED.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <functional>
#include <random>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include "kvmem/backend/host/kvm.hpp"
#include "kvmem/backend/host/ua.hpp"
#include "kvmem/io/safetensors.hpp"
#include "replay_test_util.hpp"

#ifndef KVMEM_REPLAY_HAVE_CUDA_TRACE_KVM
#define KVMEM_REPLAY_HAVE_CUDA_TRACE_KVM 0
#endif
#ifndef KVMEM_REPLAY_HAVE_CUDA_TRACE_UA
#define KVMEM_REPLAY_HAVE_CUDA_TRACE_UA 0
#endif
#if KVMEM_REPLAY_HAVE_CUDA_TRACE_KVM || KVMEM_REPLAY_HAVE_CUDA_TRACE_UA
#include <cuda_runtime_api.h>  // the runtime's C API: this file is compiled by the host compiler
#endif

namespace {

using kvmem::Rows;
using kvmem::Status;
using kvmem::TensorView;
using kvmem::test::run_tool;
using kvmem::test::TempDir;
using Json = nlohmann::json;
namespace kvm = kvmem::kvm;
namespace kua = kvmem::ua;

// ---- the schedule ------------------------------------------------------------------------------------

struct Row {
  std::int64_t first = 0, count = 0;  // input tokens of the row
};
struct Seq {
  std::vector<Row> rows;  // the rows the sequence was built from
  std::int64_t target = 0, prompt = 0;
  int cuts = 0;  // truncations tried (at most two, so every sequence reaches its target)
  [[nodiscard]] std::int64_t tokens() const {
    std::int64_t n = 0;
    for (const auto& r : rows) n += r.count;
    return n;
  }
};

// Whether dropping n of n_old KVM tokens is exact (spec KVM.md 4.1, 4.3, 4.5, 4.7; docs/slots.md):
// no update ran at a token count in (n_new, n_old] (updates run at n = (nb+u)C + 1, u >= 1), and the
// window of n_old still holds what the next query and the next update of n_new read.
bool kvm_truncate_exact(std::int64_t C, std::int64_t nb, std::int64_t n_old, std::int64_t n) {
  const std::int64_t n_new = n_old - n;
  if (n == 0 || n_new == 0) return true;
  for (std::int64_t u = 1; (nb + u) * C + 1 <= n_old; ++u)
    if ((nb + u) * C + 1 > n_new) return false;
  const auto begin = [&](std::int64_t m) { return std::max<std::int64_t>(0, (m + C - 1) / C * C - nb * C); };
  std::int64_t first_read = begin(n_new + 1);
  if (n_new >= C) first_read = std::min(first_read, std::max(C, begin(n_new)));
  return first_read >= begin(n_old);
}

struct Schedule {
  Json steps = Json::array();
  std::int64_t tokens = 0;
  std::vector<Seq> done;  // sequences to compare: ended ones and those still in a slot at the end
  int forks = 0, migrations = 0, truncations = 0, refused = 0, resets = 0, padding = 0, mixed = 0;
  std::int64_t longest = 0;
};

// A seeded continuous-batching schedule. `kvm_rules`: truncations follow KVM's exactness rule (else
// UA's: exact only for none or all of the tokens).
Schedule make_schedule(std::uint64_t seed, int sequences, std::int64_t max_len, std::int32_t slots, bool kvm_rules) {
  constexpr std::int64_t C = 16, kWindowChunks = 2;
  std::mt19937_64 rng(seed);
  const auto uni = [&](std::int64_t a, std::int64_t b) {
    return std::uniform_int_distribution<std::int64_t>(a, b)(rng);
  };
  Schedule s;
  std::vector<int> owner(std::size_t(slots), -1);
  std::vector<Seq> live;
  std::vector<bool> used(std::size_t(slots), false);
  int created = 0;
  const auto reset = [&](std::vector<std::int32_t> list) {
    s.steps.push_back({{"op", "reset"}, {"slots", list}});
    ++s.resets;
  };
  const auto finish = [&](std::int32_t slot) {
    Seq& q = live[std::size_t(owner[std::size_t(slot)])];
    if (!q.rows.empty()) s.done.push_back(q);
    owner[std::size_t(slot)] = -1;
  };
  while (true) {
    for (std::int32_t sl = 0; sl < slots && created < sequences; ++sl)
      if (owner[std::size_t(sl)] < 0 && uni(0, 2) > 0) {
        Seq q;
        q.target = created == 0 ? max_len : (uni(0, 3) == 0 ? uni(1, 8) : uni(9, max_len));
        q.prompt = q.target - uni(0, std::min<std::int64_t>(q.target, 40));
        if (used[std::size_t(sl)]) reset({sl});
        used[std::size_t(sl)] = true;
        owner[std::size_t(sl)] = int(live.size());
        live.push_back(q);
        ++created;
      }
    bool any = false;
    for (int o : owner) any = any || o >= 0;
    if (!any && created >= sequences) break;
    // a step: a row per active slot (a prompt chunk, a decode token or nothing), padding rows between
    Json rows = Json::array();
    bool prefill_row = false, decode_row = false;
    std::vector<std::int32_t> order(static_cast<std::size_t>(slots));
    for (std::int32_t i = 0; i < slots; ++i) order[std::size_t(i)] = i;
    std::shuffle(order.begin(), order.end(), rng);
    for (std::int32_t sl : order) {
      if (uni(0, 5) == 0) {
        rows.push_back({-1, uni(0, 3)});
        s.tokens += rows.back()[1].get<std::int64_t>();
        ++s.padding;
      }
      const int o = owner[std::size_t(sl)];
      if (o < 0 || uni(0, 9) == 0) continue;
      Seq& q = live[std::size_t(o)];
      const std::int64_t n = q.tokens();
      std::int64_t len = n < q.prompt ? std::min(q.prompt - n, uni(1, 3 * C + 5)) : (uni(0, 7) == 0 ? 0 : 1);
      len = std::min(len, q.target - n);
      rows.push_back({sl, len});
      if (len > 0) q.rows.push_back({s.tokens, len});
      if (len == 1) decode_row = true;
      if (len > 1) prefill_row = true;
      s.tokens += len;
      s.longest = std::max(s.longest, n + len);
    }
    s.mixed += prefill_row && decode_row;
    s.steps.push_back({{"op", "step"}, {"rows", rows}});
    // slot operations between steps
    std::vector<std::int32_t> leaving;
    for (std::int32_t sl = 0; sl < slots; ++sl) {
      const int o = owner[std::size_t(sl)];
      if (o < 0) continue;
      const std::int64_t n = live[std::size_t(o)].tokens();
      if (n >= live[std::size_t(o)].target || (o != 0 && uni(0, 150) == 0)) {
        leaving.push_back(sl);
        continue;
      }
      const auto free = std::find(owner.begin(), owner.end(), -1);
      if (n > 0 && free != owner.end() && uni(0, 25) == 0) {  // fork
        const auto dst = std::int32_t(free - owner.begin());
        s.steps.push_back({{"op", "copy"}, {"src", {sl}}, {"dst", {dst}}});
        Seq child = live[std::size_t(o)];
        child.target = std::min(max_len, n + uni(1, 100));
        child.prompt = n + uni(0, 1) * uni(1, 40);
        used[std::size_t(dst)] = true;
        owner[std::size_t(dst)] = int(live.size());
        live.push_back(child);
        ++s.forks;
        continue;
      }
      if (n > 0 && free != owner.end() && uni(0, 25) == 0) {  // migrate through an exported record
        const auto dst = std::int32_t(free - owner.begin());
        const std::string name = "m" + std::to_string(s.migrations++);
        s.steps.push_back({{"op", "export"}, {"slot", sl}, {"record", name}});
        s.steps.push_back({{"op", "import"}, {"slot", dst}, {"record", name}});
        reset({sl});
        used[std::size_t(dst)] = true;
        owner[std::size_t(dst)] = o;
        owner[std::size_t(sl)] = -1;
        continue;
      }
      if (n > 0 && live[std::size_t(o)].cuts < 2 && uni(0, 10) == 0) {  // truncate
        Seq& q = live[std::size_t(o)];
        ++q.cuts;
        const std::int64_t cut = uni(0, 2) == 0 ? n : uni(1, std::min<std::int64_t>(n, 2 * C));
        const bool exact = kvm_rules ? kvm_truncate_exact(C, kWindowChunks, n, cut) : cut == n;
        s.steps.push_back({{"op", "truncate"}, {"slot", sl}, {"tokens", cut}, {"expect", exact ? "exact" : "refused"}});
        if (exact) {
          ++s.truncations;
          for (std::int64_t drop = cut; drop > 0;) {
            Row& last = q.rows.back();
            const std::int64_t d = std::min(drop, last.count);
            last.count -= d;
            drop -= d;
            if (last.count == 0) q.rows.pop_back();
          }
          if (cut < n) q.prompt = std::min(q.prompt, n - cut);  // a whole cut starts the prompt again
        } else {
          ++s.refused;
        }
      }
    }
    for (std::int32_t sl : leaving) finish(sl);
  }
  return s;
}

// Random inputs for every packed token; padding rows get random values too (the step skips them).
std::vector<float> random_floats(std::int64_t n, std::mt19937_64& rng, float lo = 0.0f, float hi = 0.0f) {
  std::normal_distribution<float> n01(0.0f, 1.0f);
  std::uniform_real_distribution<float> u(lo, hi);
  std::vector<float> x(static_cast<std::size_t>(n));
  for (auto& v : x) v = hi > lo ? u(rng) : n01(rng);
  return x;
}

void add_f32(kvmem::io::SafetensorsWriter& w, const std::string& name, std::vector<std::int64_t> shape,
             const std::vector<float>& x) {
  w.add_raw(name, "F32", shape, x.data(), x.size() * sizeof(float));
}

std::vector<float> read_f32(const std::string& path, const std::string& name) {
  kvmem::io::SafetensorsFile file;
  REQUIRE(kvmem::io::SafetensorsFile::load(path, file).is_ok());
  std::vector<double> x;
  REQUIRE(file.read(name, x).is_ok());
  return {x.begin(), x.end()};
}

// The tokens of a sequence gathered from packed [N, width] inputs: [L, width].
std::vector<float> gather(const std::vector<float>& x, std::int64_t width, const Seq& q) {
  std::vector<float> y;
  for (const Row& r : q.rows) y.insert(y.end(), x.begin() + r.first * width, x.begin() + (r.first + r.count) * width);
  return y;
}

// [L, H, W] token-major -> [1, H, L, W] head-major.
std::vector<float> head_major(const std::vector<float>& x, std::int64_t L, std::int64_t H, std::int64_t W) {
  std::vector<float> y(x.size());
  for (std::int64_t t = 0; t < L; ++t)
    for (std::int64_t h = 0; h < H; ++h)
      for (std::int64_t e = 0; e < W; ++e) y[std::size_t((h * L + t) * W + e)] = x[std::size_t((t * H + h) * W + e)];
  return y;
}

// Expects the schedule's outputs of sequence q (packed [N, width]) to equal `alone` [L, width], bitwise.
void require_rows_equal(const std::vector<float>& packed, const std::vector<float>& alone, std::int64_t width,
                        const Seq& q, const char* what, std::size_t index) {
  const std::vector<float> got = gather(packed, width, q);
  REQUIRE(got.size() == alone.size());
  const bool same = std::memcmp(got.data(), alone.data(), got.size() * sizeof(float)) == 0;
  if (!same) {
    std::size_t i = 0;
    while (std::memcmp(&got[i], &alone[i], sizeof(float)) == 0) ++i;
    FAIL(what << " of sequence " << index << " (" << q.tokens() << " tokens) differs at token " << i / width << ": "
              << got[i] << " vs alone " << alone[i]);
  }
}

// Expects the schedule's outputs of sequence q to lie within `tol` of `alone`, relative to
// max(1, max |alone|) over the sequence (the golden comparisons' rule).
void require_rows_close(const std::vector<float>& packed, const std::vector<float>& alone, std::int64_t width,
                        const Seq& q, const char* what, std::size_t index, double tol) {
  const std::vector<float> got = gather(packed, width, q);
  REQUIRE(got.size() == alone.size());
  double worst = 0.0, scale = 1.0;
  std::size_t at = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    const double d = std::abs(double(got[i]) - double(alone[i]));
    if (!(d <= worst)) {
      worst = std::isnan(d) ? INFINITY : d;
      at = i;
    }
    scale = std::max(scale, std::abs(double(alone[i])));
  }
  if (worst > tol * scale)
    FAIL(what << " of sequence " << index << " (" << q.tokens() << " tokens) differs at token " << at / width << ": "
              << got[at] << " vs alone " << alone[at] << " (relative " << worst / scale << ", tolerance " << tol
              << ")");
}

// The tool that plays a backend's traces: kvmem-replay, or kvmem-replay-cuda for cuda.
std::string tool_for(const std::string& backend) {
#ifdef KVMEM_REPLAY_CUDA_EXE
  if (backend == "cuda") return KVMEM_REPLAY_CUDA_EXE;
#endif
  (void)backend;
  return KVMEM_REPLAY_EXE;
}

// ---- KV Means ----------------------------------------------------------------------------------------

constexpr std::int64_t kHq = 4, kHk = 2, kD = 8, kDv = 8, kC = 16;

Json kvm_config(std::int64_t n_ctx, const Json& budget) {
  return {{"Hq", kHq},   {"Hk", kHk},          {"D", kD},   {"Dv", kDv},      {"n_ctx", n_ctx},
          {"chunk", kC}, {"window_chunks", 2}, {"sink", 1}, {"rope_dims", 4}, {"budget", budget}};
}

struct KvmInputs {
  std::vector<float> q, k, v, gate, ln_w, ln_b, tau_s, tau_w;
  KvmInputs(std::int64_t N, std::uint64_t seed) {
    std::mt19937_64 rng(seed);
    q = random_floats(N * kHq * kD, rng);
    k = random_floats(N * kHk * kD, rng);
    v = random_floats(N * kHk * kDv, rng);
    gate = random_floats(N * kHk, rng, 0.3f, 2.0f);
    ln_w = random_floats(kD, rng, 0.8f, 1.2f);
    ln_b = random_floats(kD, rng, -0.2f, 0.2f);
    tau_s = random_floats(kHq, rng, 0.5f, 1.5f);
    tau_w = random_floats(kHq, rng, 0.5f, 1.5f);
  }
  void write(const std::string& path, std::int64_t N) const {
    kvmem::io::SafetensorsWriter w;
    add_f32(w, "q", {N, kHq, kD}, q);
    add_f32(w, "k", {N, kHk, kD}, k);
    add_f32(w, "v", {N, kHk, kDv}, v);
    add_f32(w, "gate", {N, kHk}, gate);
    add_f32(w, "ln_weight", {kD}, ln_w);
    add_f32(w, "ln_bias", {kD}, ln_b);
    add_f32(w, "tau_state", {kHq}, tau_s);
    add_f32(w, "tau_bswa", {kHq}, tau_w);
    REQUIRE(w.write(path).is_ok());
  }
  [[nodiscard]] kvm::Weights weights() const {
    return {{ln_w.data(), {kD}}, {ln_b.data(), {kD}}, {tau_s.data(), {kHq}}, {tau_w.data(), {kHq}}};
  }
};

kvm::Params kvm_params(kvmem::budget::Any budget) {
  kvm::Params p;
  p.chunk = kC;
  p.window_chunks = 2;
  p.sink = 1;
  p.rope_dims = 4;
  p.budget = budget;
  return p;
}

// The sequence alone: out from one prefill of all its tokens on a one-slot state (prefill's chunking
// is the spec's, whatever rows the schedule used), lse from one step of one row holding all of them.
template <class S>
void kvm_alone(const KvmInputs& in, const kvm::Params& p, std::int64_t n_ctx, const Seq& q, std::vector<float>& out,
               std::vector<float>& lse) {
  const std::int64_t L = q.tokens();
  const auto qs = gather(in.q, kHq * kD, q), ks = gather(in.k, kHk * kD, q), vs = gather(in.v, kHk * kDv, q),
             gs = gather(in.gate, kHk, q);
  const auto qh = head_major(qs, L, kHq, kD), kh = head_major(ks, L, kHk, kD), vh = head_major(vs, L, kHk, kDv),
             gh = head_major(gs, L, kHk, 1);
  const kvmem::host::Executor exec{.threads = 2, .exact = true};
  kvm::State<S, float> a, b;
  REQUIRE(kvm::State<S, float>::create(p, {1, kHq, kHk, kD, kDv, n_ctx}, a).is_ok());
  REQUIRE(kvm::State<S, float>::create(p, {1, kHq, kHk, kD, kDv, n_ctx}, b).is_ok());
  out.assign(std::size_t(L * kHq * kDv), 0.0f);
  REQUIRE(kvm::prefill(exec, a, in.weights(), TensorView<const float, 4>(qh.data(), {1, kHq, L, kD}),
                       TensorView<const float, 4>(kh.data(), {1, kHk, L, kD}),
                       TensorView<const float, 4>(vh.data(), {1, kHk, L, kDv}),
                       TensorView<const float, 3>(gh.data(), {1, kHk, L}),
                       TensorView<float, 4>(out.data(), {1, L, kHq, kDv}))
              .is_ok());
  std::vector<float> out2(out.size());
  lse.assign(std::size_t(L * kHq), 0.0f);
  const std::int32_t slot[] = {0}, starts[] = {0, std::int32_t(L)};
  REQUIRE(kvm::step(
              exec, b, in.weights(), Rows{{slot, {1}}, {starts, {2}}},
              TensorView<const float, 3>(qs.data(), {L, kHq, kD}), TensorView<const float, 3>(ks.data(), {L, kHk, kD}),
              TensorView<const float, 3>(vs.data(), {L, kHk, kDv}), TensorView<const float, 2>(gs.data(), {L, kHk}),
              TensorView<float, 3>(out2.data(), {L, kHq, kDv}), TensorView<float, 2>(lse.data(), {L, kHq}))
              .is_ok());
}

template <class S>
void kvm_trace_case(std::uint64_t seed, kvmem::budget::Any budget, const Json& budget_json, const char* precision,
                    const char* backend = "host") {
  constexpr std::int64_t kMaxLen = 700, kNctx = kMaxLen + 64;
  constexpr std::int32_t kSlots = 8;
  const Schedule sch = make_schedule(seed, 20, kMaxLen, kSlots, true);
  INFO("steps " << sch.steps.size() << ", tokens " << sch.tokens << ", sequences " << sch.done.size() << ", forks "
                << sch.forks << ", migrations " << sch.migrations << ", truncations " << sch.truncations
                << " / refused " << sch.refused << ", mixed steps " << sch.mixed);
  CHECK(sch.done.size() >= 20);
  CHECK(sch.forks > 0);
  CHECK(sch.migrations > 0);
  CHECK(sch.truncations > 0);
  CHECK(sch.refused > 0);
  CHECK(sch.mixed > 0);
  CHECK(sch.padding > 0);
  CHECK(sch.longest == kMaxLen);
  const TempDir dir("trace_kvm");
  const Json trace = {{"kvmem_trace", 1},
                      {"mechanism", "kvm"},
                      {"max_slots", kSlots},
                      {"config", kvm_config(kNctx, budget_json)},
                      {"steps", sch.steps}};
  kvmem::test::write_text(dir.file("trace.json"), trace.dump(1));
  const KvmInputs in(sch.tokens, seed + 100);
  in.write(dir.file("in.safetensors"), sch.tokens);
  const auto r =
      run_tool({"--trace", dir.file("trace.json"), dir.file("in.safetensors"), "-o", dir.file("out.safetensors"),
                "--check", "--quiet", "--precision", precision, "--backend", backend},
               dir.path(), tool_for(backend));
  INFO(r.out.substr(r.out.size() > 2000 ? r.out.size() - 2000 : 0) << r.err);
  REQUIRE(r.rc == 0);
  CHECK(r.out.find("FAIL") == std::string::npos);
  CHECK(r.out.find("sequences equal their run alone") != std::string::npos);
  const auto out = read_f32(dir.file("out.safetensors"), "out");
  const auto lse = read_f32(dir.file("out.safetensors"), "lse");
  REQUIRE(out.size() == std::size_t(sch.tokens * kHq * kDv));
  // CUDA: its own check above (each sequence alone on CUDA); against the host's sequence alone, fp32
  // within the fp32 tolerance (the CUDA step updates the state as the host does; the readouts sum in
  // another order). bf16 is not compared with the host: CUDA takes its inputs in bf16, the host in fp32.
  const bool cuda = std::string(backend) == "cuda";
  if (cuda && !std::is_same_v<S, float>) return;
  for (std::size_t i = 0; i < sch.done.size(); ++i) {
    std::vector<float> a_out, a_lse;
    kvm_alone<S>(in, kvm_params(budget), kNctx, sch.done[i], a_out, a_lse);
    if (cuda) {
      require_rows_close(out, a_out, kHq * kDv, sch.done[i], "out", i, 1e-5);
      require_rows_close(lse, a_lse, kHq, sch.done[i], "lse", i, 1e-5);
    } else {
      require_rows_equal(out, a_out, kHq * kDv, sch.done[i], "out", i);
      require_rows_equal(lse, a_lse, kHq, sch.done[i], "lse", i);
    }
  }
}

// ---- Universal Attention -------------------------------------------------------------------------------

constexpr std::int64_t kH = 4, kG = 2, kUD = 8;

struct UaInputs {
  std::vector<float> q, k, v, z_k, z_q;
  UaInputs(std::int64_t N, std::uint64_t seed) {
    std::mt19937_64 rng(seed);
    q = random_floats(N * kH * kUD, rng);
    for (auto& x : q) x *= 2.0f;
    k = random_floats(N * kG * kUD, rng);
    for (std::int64_t t = 0; t < N * kG; ++t) {  // unit-norm keys (spec UA.md 2)
      double norm = 0.0;
      for (std::int64_t d = 0; d < kUD; ++d) norm += double(k[std::size_t(t * kUD + d)]) * k[std::size_t(t * kUD + d)];
      for (std::int64_t d = 0; d < kUD; ++d) k[std::size_t(t * kUD + d)] /= float(std::sqrt(norm) + 1e-6);
    }
    v = random_floats(N * kG * kUD, rng);
    z_k = random_floats(N * kG, rng);
    z_q = random_floats(N * kG, rng);
    for (auto* z : {&z_k, &z_q})
      for (auto& x : *z) x = 1.0f + 1.5f * x;  // gates that evict at p = 0.05
  }
  void write(const std::string& path, std::int64_t N) const {
    kvmem::io::SafetensorsWriter w;
    add_f32(w, "q", {N, kH, kUD}, q);
    add_f32(w, "k", {N, kG, kUD}, k);
    add_f32(w, "v", {N, kG, kUD}, v);
    add_f32(w, "z_k", {N, kG}, z_k);
    add_f32(w, "z_q", {N, kG}, z_q);
    REQUIRE(w.write(path).is_ok());
  }
};

// The sequence alone: its rows as ua::prefill (more than one token) and ua::decode (one token) calls
// on a cache of one sequence; lse from the same rows as one-row steps on another one-slot cache.
template <class S>
void ua_alone(const UaInputs& in, const kua::Options& opt, std::int64_t capacity, const Seq& q, std::vector<float>& out,
              std::vector<float>& lse) {
  const std::int64_t L = q.tokens();
  const auto qs = gather(in.q, kH * kUD, q), ks = gather(in.k, kG * kUD, q), vs = gather(in.v, kG * kUD, q),
             zk = gather(in.z_k, kG, q), zq = gather(in.z_q, kG, q);
  kua::PrunedCache<S> a(kua::CacheShape{1, kH, kG, kUD, capacity, 16}), b(a.shape());
  out.assign(std::size_t(L * kH * kUD), 0.0f);
  lse.assign(std::size_t(L * kH), 0.0f);
  std::vector<float> out2(out.size());
  const kvmem::host::Executor exec{2};
  std::int64_t t0 = 0;
  for (const Row& r : q.rows) {
    const std::int64_t T = r.count;
    kua::Inputs x;  // [1,H,T,D] views of token-major data
    x.q = {qs.data() + t0 * kH * kUD, {1, kH, T, kUD}, {L * kH * kUD, kUD, kH * kUD, 1}};
    x.k = {ks.data() + t0 * kG * kUD, {1, kG, T, kUD}, {L * kG * kUD, kUD, kG * kUD, 1}};
    x.v = {vs.data() + t0 * kG * kUD, {1, kG, T, kUD}, {L * kG * kUD, kUD, kG * kUD, 1}};
    x.z_k = {zk.data() + t0 * kG, {1, kG, T}, {L * kG, 1, kG}};
    x.z_q = {zq.data() + t0 * kG, {1, kG, T}, {L * kG, 1, kG}};
    const TensorView<float, 4> o(out.data() + t0 * kH * kUD, {1, T, kH, kUD});
    REQUIRE((T == 1 ? kua::decode(exec, a, x, opt, o) : kua::prefill(exec, a, x, opt, o)).is_ok());
    kua::PackedInputs p;
    p.q = {qs.data() + t0 * kH * kUD, {T, kH, kUD}};
    p.k = {ks.data() + t0 * kG * kUD, {T, kG, kUD}};
    p.v = {vs.data() + t0 * kG * kUD, {T, kG, kUD}};
    p.z_k = {zk.data() + t0 * kG, {T, kG}};
    p.z_q = {zq.data() + t0 * kG, {T, kG}};
    const std::int32_t slot[] = {0}, starts[] = {0, std::int32_t(T)};
    REQUIRE(kua::step(exec, b, Rows{{slot, {1}}, {starts, {2}}}, p, opt,
                      TensorView<float, 3>(out2.data() + t0 * kH * kUD, {T, kH, kUD}),
                      TensorView<float, 2>(lse.data() + t0 * kH, {T, kH}))
                .is_ok());
    t0 += T;
  }
}

template <class S>
void ua_trace_case(std::uint64_t seed, double p, std::int64_t chunk, bool evict_before, const char* precision,
                   const char* backend = "host") {
  constexpr std::int64_t kMaxLen = 700;
  constexpr std::int32_t kSlots = 8;
  const Schedule sch = make_schedule(seed, 20, kMaxLen, kSlots, false);
  INFO("steps " << sch.steps.size() << ", tokens " << sch.tokens << ", sequences " << sch.done.size());
  CHECK(sch.done.size() >= 20);
  CHECK(sch.forks > 0);
  CHECK(sch.migrations > 0);
  CHECK(sch.truncations > 0);
  CHECK(sch.refused > 0);
  CHECK(sch.mixed > 0);
  const TempDir dir("trace_ua");
  const Json config = {{"H", kH},
                       {"G", kG},
                       {"D", kUD},
                       {"capacity", kMaxLen},
                       {"p", p},
                       {"prefill_chunk", chunk},
                       {"evict_before_attention", evict_before}};
  const Json trace = {
      {"kvmem_trace", 1}, {"mechanism", "ua"}, {"max_slots", kSlots}, {"config", config}, {"steps", sch.steps}};
  kvmem::test::write_text(dir.file("trace.json"), trace.dump());
  const UaInputs in(sch.tokens, seed + 200);
  in.write(dir.file("in.safetensors"), sch.tokens);
  const auto r =
      run_tool({"--trace", dir.file("trace.json"), dir.file("in.safetensors"), "-o", dir.file("out.safetensors"),
                "--check", "--quiet", "--precision", precision, "--backend", backend},
               dir.path(), tool_for(backend));
  INFO(r.out.substr(r.out.size() > 2000 ? r.out.size() - 2000 : 0) << r.err);
  REQUIRE(r.rc == 0);
  CHECK(r.out.find("FAIL") == std::string::npos);
  CHECK(r.out.find("sequences equal their run alone") != std::string::npos);
  // CUDA: its own check above only. Against the host, eviction at p > 0 may keep a different set where
  // a key's λ lies within rounding of ln p (tests/cuda/test_ua_cuda_slots.cu accounts for those).
  if (std::string(backend) == "cuda") return;
  const auto out = read_f32(dir.file("out.safetensors"), "out");
  const auto lse = read_f32(dir.file("out.safetensors"), "lse");
  const kua::Options opt{p, chunk, evict_before};
  for (std::size_t i = 0; i < sch.done.size(); ++i) {
    std::vector<float> a_out, a_lse;
    ua_alone<S>(in, opt, kMaxLen, sch.done[i], a_out, a_lse);
    require_rows_equal(out, a_out, kH * kUD, sch.done[i], "out", i);
    require_rows_equal(lse, a_lse, kH, sch.done[i], "lse", i);
  }
}

// A UA trace (2 slots, capacity 4, dense) whose second step asks slot 0 for a fifth row: every backend
// refuses that step, naming the row and the slot, and plays the first. It packs 8 input tokens.
Json ua_full_slot_trace() {
  const Json config = {{"H", kH}, {"G", kG}, {"D", kUD}, {"capacity", 4}, {"p", 0.0}};
  const Json steps = {{{"op", "step"}, {"rows", {{0, 3}, {1, 2}}}}, {{"op", "step"}, {"rows", {{1, 1}, {0, 2}}}}};
  return {{"kvmem_trace", 1}, {"mechanism", "ua"}, {"max_slots", 2}, {"config", config}, {"steps", steps}};
}
constexpr std::int64_t kFullSlotTokens = 8;

void ua_full_slot_case(const std::string& backend) {
  const TempDir dir("trace_ua_full");
  kvmem::test::write_text(dir.file("trace.json"), ua_full_slot_trace().dump());
  const UaInputs in(kFullSlotTokens, 11);
  in.write(dir.file("in.safetensors"), kFullSlotTokens);
  const auto r = run_tool({"--trace", dir.file("trace.json"), dir.file("in.safetensors"), "-o",
                           dir.file("out.safetensors"), "--quiet", "--backend", backend},
                          dir.path(), tool_for(backend));
  INFO(r.out << r.err);
  CHECK(r.rc == 2);
  CHECK(r.err.find("steps[1] (step): ua/" + backend + " refuses it: cache capacity: row 1 (slot 0") !=
        std::string::npos);
  CHECK(!std::filesystem::exists(dir.file("out.safetensors")));
}

// ---- malformed traces ------------------------------------------------------------------------------------

// The example trace of examples/replay/README.md (KVM, 2 slots, 12 packed tokens): the base of the
// small-trace and malformed-trace cases, so the documented example is one that runs.
Json small_trace() {
  const std::string text = kvmem::test::slurp(KVMEM_REPLAY_README);
  const std::string mark = "<!-- trace-example -->\n```json\n";
  const auto begin = text.find(mark);
  REQUIRE(begin != std::string::npos);
  const auto end = text.find("\n```", begin + mark.size());
  REQUIRE(end != std::string::npos);
  return Json::parse(text.substr(begin + mark.size(), end - begin - mark.size()));
}

// What every backend's run of small_trace() must write: the truncate's outcome, no sequence that differs
// from its run alone (slot 1's first, ended by the copy; slot 0 before the truncate; slot 0 cut by one
// token, ended by the import; the fork in slot 1, ended by the reset; the import in slot 0, live at the
// end), the record of slot 1 after the fork (slot 0's 5 tokens, importable into a host state), and
// zeroed padding rows.
void check_small_trace_outputs(const kvmem::io::SafetensorsFile& file, const std::string& out_path,
                               const KvmInputs& in) {
  std::vector<std::int64_t> ok, mismatches, record;
  REQUIRE(file.read("truncate_exact", ok).is_ok());
  CHECK(ok == std::vector<std::int64_t>{1});
  REQUIRE(file.read("check_mismatches", mismatches).is_ok());
  CHECK(mismatches == std::vector<std::int64_t>(5, 0));
  REQUIRE(file.read("record.fork", record).is_ok());
  kvm::State<float, float> st;
  const kvm::Params params = kvm_params(kvmem::budget::Fixed{4, kvmem::budget::kPaperMaxSlots});
  REQUIRE(kvm::State<float, float>::create(params, {1, kHq, kHk, kD, kDv, 64}, st).is_ok());
  std::vector<std::byte> bytes(record.size());
  for (std::size_t i = 0; i < record.size(); ++i) bytes[i] = std::byte(record[i]);
  REQUIRE(kvm::import_slot(kvmem::host::Executor{1}, st, in.weights(), 0, std::span<const std::byte>(bytes)).is_ok());
  CHECK(st.tokens(0) == 5);
  const auto out = read_f32(out_path, "out");
  CHECK(std::all_of(out.begin() + 5 * kHq * kDv, out.begin() + 7 * kHq * kDv, [](float x) { return x == 0.0f; }));
}
constexpr std::int64_t kSmallTokens = 12;

}  // namespace

TEST_CASE("replay --trace: a KVM schedule equals each sequence alone (fixed budget, fp32)", "[replay][trace]") {
  kvm_trace_case<float>(1, kvmem::budget::Fixed{16, 16}, {{"kind", "fixed"}, {"count", 16}, {"max_slots", 16}}, "fp32");
}

TEST_CASE("replay --trace: a KVM schedule equals each sequence alone (power budget, bf16)", "[replay][trace]") {
  kvm_trace_case<kvmem::bf16>(
      2, kvmem::budget::Power{2.0, 0.5, 16, 1, 100000},
      {{"kind", "power"}, {"factor", 2.0}, {"exponent", 0.5}, {"min", 16}, {"round_down", 1}, {"max_slots", 100000}},
      "bf16");
}

TEST_CASE("replay --trace: a UA schedule equals each sequence alone (pruning p = 0.05)", "[replay][trace]") {
  SECTION("fp32") {
    ua_trace_case<float>(3, 0.05, 64, true, "fp32");
  }
  SECTION("bf16, evicting after attention") {
    ua_trace_case<kvmem::bf16>(4, 0.05, 32, false, "bf16");
  }
}

// Kokkos plays the same schedules through its slot API (hidden tag: registered with label kokkos by
// tests/replay/CMakeLists.txt); its rows equal the host's sequence alone, bitwise.
#if KVMEM_REPLAY_HAVE_KOKKOS_TRACE_KVM
TEST_CASE("replay --trace on kokkos: a KVM schedule equals each sequence alone", "[replay][trace][.kokkos]") {
  kvm_trace_case<float>(1, kvmem::budget::Fixed{16, 16}, {{"kind", "fixed"}, {"count", 16}, {"max_slots", 16}}, "fp32",
                        "kokkos");
}
#endif
#if KVMEM_REPLAY_HAVE_KOKKOS_TRACE_UA
TEST_CASE("replay --trace on kokkos: a UA schedule equals each sequence alone", "[replay][trace][.kokkos]") {
  ua_trace_case<float>(3, 0.05, 64, true, "fp32", "kokkos");
}
#endif

// CUDA plays the same schedules in kvmem-replay-cuda (hidden tag: registered with label gpu by
// tests/replay/CMakeLists.txt).
#if KVMEM_REPLAY_HAVE_CUDA_TRACE_KVM || KVMEM_REPLAY_HAVE_CUDA_TRACE_UA
namespace {
// The rule of the gpu suite (tests/cuda/cuda_test_support.hpp, kvmem::cuda::device_count): no GPU when
// cudaGetDeviceCount fails or finds none; a case without one says "SKIPPED:", which ctest reports as a
// skip. Before that, kvmem-replay-cuda must refuse --backend cuda there in one line, exit 2, no output.
bool cuda_skipped() {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess) {
    (void)cudaGetLastError();  // clear the sticky "no device" error
    devices = 0;
  }
  if (devices > 0) return false;
  const TempDir dir("trace_cuda_none");
  kvmem::test::write_text(dir.file("trace.json"), small_trace().dump());
  const KvmInputs in(kSmallTokens, 9);
  in.write(dir.file("in.safetensors"), kSmallTokens);
  const auto r = run_tool({"--trace", dir.file("trace.json"), dir.file("in.safetensors"), "-o",
                           dir.file("out.safetensors"), "--backend", "cuda"},
                          dir.path(), tool_for("cuda"));
  INFO(r.err);
  CHECK(r.rc == 2);
  CHECK(r.err.rfind("kvmem-replay: error: backend cuda: no CUDA device is visible", 0) == 0);
  CHECK(std::count(r.err.begin(), r.err.end(), '\n') == 1);
  CHECK(!std::filesystem::exists(dir.file("out.safetensors")));
  WARN("SKIPPED: no CUDA device visible; the gpu suite needs one (CI compiles it only)");
  return true;
}
}  // namespace
#endif
#if KVMEM_REPLAY_HAVE_CUDA_TRACE_KVM
TEST_CASE("replay --trace on cuda: a KVM schedule equals each sequence alone", "[replay][trace][.cuda]") {
  if (cuda_skipped()) return;
  SECTION("fixed budget, fp32") {
    kvm_trace_case<float>(1, kvmem::budget::Fixed{16, 16}, {{"kind", "fixed"}, {"count", 16}, {"max_slots", 16}},
                          "fp32", "cuda");
  }
  SECTION("power budget, bf16") {
    kvm_trace_case<kvmem::bf16>(
        2, kvmem::budget::Power{2.0, 0.5, 16, 1, 100000},
        {{"kind", "power"}, {"factor", 2.0}, {"exponent", 0.5}, {"min", 16}, {"round_down", 1}, {"max_slots", 100000}},
        "bf16", "cuda");
  }
}

TEST_CASE("replay --trace on cuda: records, truncates and a full slot of a small KVM trace", "[replay][trace][.cuda]") {
  if (cuda_skipped()) return;
  const TempDir dir("trace_cuda_small");
  kvmem::test::write_text(dir.file("trace.json"), small_trace().dump());
  const KvmInputs in(kSmallTokens, 9);
  in.write(dir.file("in.safetensors"), kSmallTokens);
  const auto r = run_tool({"--trace", dir.file("trace.json"), dir.file("in.safetensors"), "-o",
                           dir.file("out.safetensors"), "--check", "--backend", "cuda"},
                          dir.path(), tool_for("cuda"));
  INFO(r.out << r.err);
  REQUIRE(r.rc == 0);
  kvmem::io::SafetensorsFile file;
  REQUIRE(kvmem::io::SafetensorsFile::load(dir.file("out.safetensors"), file).is_ok());
  CHECK(file.metadata().at("backend") == "cuda");
  // the CUDA record is the host's record format: it imports into a host state
  check_small_trace_outputs(file, dir.file("out.safetensors"), in);
  // a slot past n_ctx: the device refuses the step (step_status), and the tool stops there as on host
  Json full = small_trace();
  full["config"]["n_ctx"] = 5;
  kvmem::test::write_text(dir.file("full.json"), full.dump());
  const auto r2 = run_tool({"--trace", dir.file("full.json"), dir.file("in.safetensors"), "-o",
                            dir.file("out2.safetensors"), "--quiet", "--backend", "cuda"},
                           dir.path(), tool_for("cuda"));
  INFO(r2.err);
  CHECK(r2.rc == 2);
  CHECK(r2.err.find("steps[3] (step): kvm/cuda refuses it") != std::string::npos);
  CHECK(!std::filesystem::exists(dir.file("out2.safetensors")));
}
#endif
#if KVMEM_REPLAY_HAVE_CUDA_TRACE_UA
TEST_CASE("replay --trace on cuda: a UA schedule equals each sequence alone", "[replay][trace][.cuda]") {
  if (cuda_skipped()) return;
  SECTION("fp32") {
    ua_trace_case<float>(3, 0.05, 64, true, "fp32", "cuda");
  }
  SECTION("bf16, evicting after attention") {
    ua_trace_case<kvmem::bf16>(4, 0.05, 32, false, "bf16", "cuda");
  }
}

TEST_CASE("replay --trace on cuda: a UA step past a slot's capacity is refused", "[replay][trace][.cuda]") {
  if (cuda_skipped()) return;
  ua_full_slot_case("cuda");
}
#endif

TEST_CASE("replay --trace: a UA step past a slot's capacity is refused", "[replay][trace]") {
  ua_full_slot_case("host");
}

TEST_CASE("replay --trace: outputs, records and truncate outcomes of a small trace", "[replay][trace]") {
  const TempDir dir("trace_small");
  kvmem::test::write_text(dir.file("trace.json"), small_trace().dump());
  const KvmInputs in(kSmallTokens, 9);
  in.write(dir.file("in.safetensors"), kSmallTokens);
  const auto r = run_tool(
      {"--trace", dir.file("trace.json"), dir.file("in.safetensors"), "-o", dir.file("out.safetensors"), "--check"},
      dir.path());
  INFO(r.out << r.err);
  REQUIRE(r.rc == 0);
  kvmem::io::SafetensorsFile file;
  REQUIRE(kvmem::io::SafetensorsFile::load(dir.file("out.safetensors"), file).is_ok());
  REQUIRE(file.find("out") != nullptr);
  CHECK(file.find("out")->shape == std::vector<std::int64_t>{kSmallTokens, kHq, kDv});
  CHECK(file.find("lse")->shape == std::vector<std::int64_t>{kSmallTokens, kHq});
  REQUIRE(file.find("record.fork") != nullptr);
  check_small_trace_outputs(file, dir.file("out.safetensors"), in);
  // a truncate whose expectation is wrong fails the run (exit 1), and the outputs are still written
  Json wrong = small_trace();
  wrong["steps"][4]["tokens"] = 7;  // more than slot 0 holds (6): an argument error, exit 2
  kvmem::test::write_text(dir.file("wrong.json"), wrong.dump());
  const auto r2 = run_tool(
      {"--trace", dir.file("wrong.json"), dir.file("in.safetensors"), "-o", dir.file("out2.safetensors"), "--quiet"},
      dir.path());
  CHECK(r2.rc == 2);
  CHECK(r2.err.find("steps[4] (truncate)") != std::string::npos);
  wrong["steps"][4]["tokens"] = 1;
  wrong["steps"][4]["expect"] = "refused";
  kvmem::test::write_text(dir.file("wrong.json"), wrong.dump());
  const auto r3 = run_tool(
      {"--trace", dir.file("wrong.json"), dir.file("in.safetensors"), "-o", dir.file("out3.safetensors"), "--quiet"},
      dir.path());
  INFO(r3.out << r3.err);
  CHECK(r3.rc == 1);
  CHECK(r3.out.find("steps[4] truncate of 1 tokens in slot 0: expected refused, got exact  FAIL") != std::string::npos);
  CHECK(std::filesystem::exists(dir.file("out3.safetensors")));
}

TEST_CASE("replay --trace: malformed traces are refused, naming the step and the field", "[replay][trace]") {
  const TempDir dir("trace_bad");
  const KvmInputs in(kSmallTokens, 9);
  in.write(dir.file("in.safetensors"), kSmallTokens);
  struct Bad {
    const char* what;
    std::function<void(Json&)> edit;
    std::vector<std::string> expect;  // substrings of the one-line message
  };
  const std::vector<Bad> cases = {
      {"unknown op", [](Json& t) { t["steps"][1]["op"] = "fork"; }, {"steps[1]", "'op' must be one of"}},
      {"op missing", [](Json& t) { t["steps"][1].erase("op"); }, {"steps[1]", "missing field 'op'"}},
      {"slot out of range",
       [](Json& t) { t["steps"][0]["rows"][2][0] = 2; },
       {"steps[0] (step)", "'rows[2][0] (slot)' must be an integer in [-1, 1], got 2"}},
      {"negative token count",
       [](Json& t) { t["steps"][3]["rows"][1][1] = -1; },
       {"steps[3] (step)", "'rows[1][1] (tokens)'"}},
      {"row that is no pair",
       [](Json& t) { t["steps"][0]["rows"][1] = {0}; },
       {"steps[0] (step)", "'rows[1]' must be a [slot, tokens] pair"}},
      {"a slot in two rows", [](Json& t) { t["steps"][0]["rows"][2][0] = 0; }, {"steps[0] (step): rows", "slot[2]"}},
      {"rows not an array", [](Json& t) { t["steps"][3]["rows"] = 3; }, {"steps[3] (step)", "'rows' must be an array"}},
      {"copy lengths differ",
       [](Json& t) {
         t["steps"][1]["dst"] = {1, 0};
       },
       {"steps[1] (copy)", "'dst' must list as many slots as 'src'"}},
      {"copy onto a source",
       [](Json& t) {
         t["steps"][1] = {{"op", "copy"}, {"src", {0, 1}}, {"dst", {1, 0}}};
       },
       {"steps[1] (copy)", "dst[0]"}},
      {"copy slot out of range",
       [](Json& t) { t["steps"][1]["src"] = {5}; },
       {"steps[1] (copy)", "'src[0]' must be an integer in [0, 1], got 5"}},
      {"reset slot out of range", [](Json& t) { t["steps"][6]["slots"] = {-1}; }, {"steps[6] (reset)", "'slots[0]'"}},
      {"reset slot twice",
       [](Json& t) {
         t["steps"][6]["slots"] = {1, 1};
       },
       {"steps[6] (reset)", "slots[1]"}},
      {"import of no record",
       [](Json& t) { t["steps"][5]["record"] = "x"; },
       {"steps[5] (import)", "'record' names no record an earlier export wrote: 'x'"}},
      {"import before its export",
       [](Json& t) { std::swap(t["steps"][2], t["steps"][5]); },
       {"steps[2] (import)", "'record'"}},
      {"record name twice",
       [](Json& t) {
         t["steps"][5] = {{"op", "export"}, {"slot", 0}, {"record", "fork"}};
       },
       {"steps[5] (export)", "'record' names a record an earlier export wrote"}},
      {"export without slot",
       [](Json& t) { t["steps"][2].erase("slot"); },
       {"steps[2] (export)", "missing field 'slot'"}},
      {"truncate negative", [](Json& t) { t["steps"][4]["tokens"] = -2; }, {"steps[4] (truncate)", "'tokens'"}},
      {"truncate expect",
       [](Json& t) { t["steps"][4]["expect"] = "maybe"; },
       {"steps[4] (truncate)", "'expect' must be \"exact\" or \"refused\""}},
      {"misspelt field",
       [](Json& t) { t["steps"][6]["slot"] = 1; },
       {"steps[6] (reset)", "unknown field 'slot' (this op has: op, slots)"}},
      {"step not an object", [](Json& t) { t["steps"][3] = "step"; }, {"steps[3]", "must be an object"}},
      {"format version", [](Json& t) { t["kvmem_trace"] = 2; }, {"'kvmem_trace'", "reads version 1"}},
      {"no format field", [](Json& t) { t.erase("kvmem_trace"); }, {"missing field 'kvmem_trace'"}},
      {"mechanism", [](Json& t) { t["mechanism"] = "mla"; }, {"'mechanism' must be \"kvm\" or \"ua\""}},
      {"max_slots", [](Json& t) { t["max_slots"] = 0; }, {"'max_slots' must be an integer in [1,"}},
      {"steps", [](Json& t) { t["steps"] = Json::object(); }, {"'steps' must be an array"}},
      {"config without n_ctx", [](Json& t) { t["config"].erase("n_ctx"); }, {"config: missing key 'n_ctx'"}},
      {"config with T", [](Json& t) { t["config"]["T"] = 5; }, {"config: 'T' does not apply to a trace"}},
      {"config budget", [](Json& t) { t["config"]["budget"]["kind"] = "linear"; }, {"config.budget: 'kind'"}},
      {"inputs of another length",
       [](Json& t) { t["steps"][0]["rows"][0][1] = 6; },
       {"tensor 'q' has shape [12,4,8]", "[13,4,8]"}},
      {"capacity of a slot", [](Json& t) { t["config"]["n_ctx"] = 5; }, {"steps[3] (step): kvm/host refuses it"}},
  };
  for (const Bad& b : cases) {
    INFO(b.what);
    Json t = small_trace();
    b.edit(t);
    kvmem::test::write_text(dir.file("bad.json"), t.dump());
    const auto r = run_tool(
        {"--trace", dir.file("bad.json"), dir.file("in.safetensors"), "-o", dir.file("out.safetensors")}, dir.path());
    INFO(r.err);
    CHECK(r.rc == 2);
    CHECK(r.err.rfind("kvmem-replay: error: ", 0) == 0);
    for (const auto& e : b.expect) CHECK(r.err.find(e) != std::string::npos);
    CHECK(!std::filesystem::exists(dir.file("out.safetensors")));
  }
  // not JSON, and options that do not go with --trace
  kvmem::test::write_text(dir.file("bad.json"), "{\"kvmem_trace\": 1,");
  auto r = run_tool({"--trace", dir.file("bad.json"), dir.file("in.safetensors"), "-o", dir.file("o.safetensors")},
                    dir.path());
  CHECK(r.rc == 2);
  CHECK(r.err.find("not valid JSON") != std::string::npos);
  kvmem::test::write_text(dir.file("good.json"), small_trace().dump());
  r = run_tool({"--check", dir.file("in.safetensors"), "-o", dir.file("o.safetensors")}, dir.path());
  CHECK(r.rc == 2);
  CHECK(r.err.find("it needs --trace") != std::string::npos);
  r = run_tool({"--trace", dir.file("good.json"), dir.file("in.safetensors"), "-o", dir.file("o.safetensors"),
                "--backend", "reference"},
               dir.path());
  CHECK(r.rc == 2);
  CHECK(r.err.find("backend reference has no sequence slots") != std::string::npos);
  r = run_tool({"--trace", dir.file("good.json"), dir.file("in.safetensors"), "-o", dir.file("o.safetensors"),
                "--backend", "cuda"},
               dir.path());
  CHECK(r.rc == 2);
  CHECK(r.err.find("backend cuda is not built into this kvmem-replay") != std::string::npos);
  r = run_tool({"--trace", dir.file("good.json"), "-o", dir.file("o.safetensors")}, dir.path());
  CHECK(r.rc == 2);
  CHECK(r.err.find("no inputs file") != std::string::npos);
  CHECK(!std::filesystem::exists(dir.file("o.safetensors")));
}
