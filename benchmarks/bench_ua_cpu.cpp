// SPDX-License-Identifier: Apache-2.0
// Universal Attention on the host backend: prefill and decode, dense UA (p = 0) vs pruned UA
// (p = 0.05 / 0.15, prefill chunk 128), against a plain blocked causal attention on the same
// backend (same dot product, same online softmax, same threading) as the anchor.
//
// Inputs: q ~ 2 N(0,1), unit-norm random keys, v ~ N(0,1), gate logits ~ N(1, 1.5) ("realistic gates").
// Random keys are far less similar than trained keys, so the similarity gate decays them quickly and
// the kept fractions here are lower than on a trained model; the table says what was measured.
//
//   kvmem_bench_ua_cpu [--T 4096,8192,16384] [--B 1] [--H 4] [--G 1] [--D 64] [--threads 2]
//                      [--p 0,0.05,0.15] [--decode-steps 32] [--chunk 128] [--no-prefill] [--no-decode]
//                      [--gate-mean 1] [--no-anchor]
// --gate-mean sets the mean of the key and query gate logits: lower values decay keys more slowly, so a
// sweep of it sweeps the kept fraction (printed with the kept bytes). --no-anchor skips the plain causal
// attention rows (minutes at 32K).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "kvmem/backend/host/executor.hpp"
#include "kvmem/backend/host/ua.hpp"
#include "kvmem/core/softmax.hpp"
#include "kvmem/kernel/ua_decay.hpp"
#include "kvmem/ua/cache.hpp"
#include "kvmem/ua/ops.hpp"

namespace {

using Clock = std::chrono::steady_clock;

struct Args {
  std::vector<std::int64_t> T = {4096, 8192, 16384};
  std::int64_t B = 1, H = 4, G = 1, D = 64;
  int threads = 2;
  std::vector<double> p = {0.0, 0.05, 0.15};
  std::int64_t decode_steps = 32, chunk = 128;
  bool prefill = true, decode = true, anchor = true;
  float gate_mean = 1.0f;
};

template <class T>
std::vector<T> parse_list(const std::string& s) {
  std::vector<T> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) out.push_back(static_cast<T>(std::stod(item)));
  return out;
}

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string f = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "missing value after %s\n", f.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (f == "--T")
      a.T = parse_list<std::int64_t>(next());
    else if (f == "--B")
      a.B = std::stoll(next());
    else if (f == "--H")
      a.H = std::stoll(next());
    else if (f == "--G")
      a.G = std::stoll(next());
    else if (f == "--D")
      a.D = std::stoll(next());
    else if (f == "--threads")
      a.threads = std::stoi(next());
    else if (f == "--p")
      a.p = parse_list<double>(next());
    else if (f == "--decode-steps")
      a.decode_steps = std::stoll(next());
    else if (f == "--chunk")
      a.chunk = std::stoll(next());
    else if (f == "--no-prefill")
      a.prefill = false;
    else if (f == "--no-decode")
      a.decode = false;
    else if (f == "--gate-mean")
      a.gate_mean = std::stof(next());
    else if (f == "--no-anchor")
      a.anchor = false;
    else {
      std::fprintf(stderr, "unknown flag %s (see the header of bench_ua_cpu.cpp)\n", f.c_str());
      std::exit(2);
    }
  }
  return a;
}

// Inputs of T + decode_steps tokens, layouts of spec UA.md 2.
struct Data {
  std::int64_t B, H, G, T, D;
  std::vector<float> q, k, v, zk, zq;
  Data(std::int64_t B_, std::int64_t H_, std::int64_t G_, std::int64_t T_, std::int64_t D_, unsigned seed,
       float gate_mean)
      : B(B_), H(H_), G(G_), T(T_), D(D_) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> n01(0.0f, 1.0f), gate(gate_mean, 1.5f);
    q.resize(B * H * T * D);
    for (auto& x : q) x = 2.0f * n01(rng);
    k.resize(B * G * T * D);
    for (auto& x : k) x = n01(rng);
    for (std::int64_t r = 0; r < B * G * T; ++r) {
      float n = 0;
      for (std::int64_t d = 0; d < D; ++d) n += k[r * D + d] * k[r * D + d];
      n = std::sqrt(n) + 1e-6f;
      for (std::int64_t d = 0; d < D; ++d) k[r * D + d] /= n;
    }
    v.resize(B * G * T * D);
    for (auto& x : v) x = n01(rng);
    zk.resize(B * G * T);
    zq.resize(B * G * T);
    for (auto& x : zk) x = gate(rng);
    for (auto& x : zq) x = gate(rng);
  }
  kvmem::ua::Inputs slice(std::int64_t t0, std::int64_t t1) const {
    const std::int64_t n = t1 - t0;
    kvmem::ua::Inputs in;
    in.q = {q.data() + t0 * D, {B, H, n, D}, {H * T * D, T * D, D, 1}};
    in.k = {k.data() + t0 * D, {B, G, n, D}, {G * T * D, T * D, D, 1}};
    in.v = {v.data() + t0 * D, {B, G, n, D}, {G * T * D, T * D, D, 1}};
    in.z_k = {zk.data() + t0, {B, G, n}, {G * T, T, 1}};
    in.z_q = {zq.data() + t0, {B, G, n}, {G * T, T, 1}};
    return in;
  }
  kvmem::TensorView<float, 4> out(std::vector<float>& o, std::int64_t t0, std::int64_t t1) const {
    return {o.data() + t0 * H * D, {B, t1 - t0, H, D}, {T * H * D, H * D, D, 1}};
  }
};

// The anchor: plain blocked causal softmax attention (scale 1) over keys [0, n_keys) for the queries
// at positions [q0, q1), one (b, h) per task, tiles of 32 queries x 64 keys, online softmax.
void causal_attention(const kvmem::host::Executor& exec, const Data& d, std::int64_t q0, std::int64_t q1,
                      std::vector<float>& out) {
  const std::int64_t r = d.H / d.G, D = d.D;
  kvmem::host::parallel_for(exec, d.B * d.H, [&](std::int64_t it) {
    const std::int64_t b = it / d.H, h = it % d.H, g = h / r;
    const float* K = d.k.data() + (b * d.G + g) * d.T * D;
    const float* V = d.v.data() + (b * d.G + g) * d.T * D;
    std::vector<float> acc(32 * D);
    float logits[64];
    for (std::int64_t i0 = q0; i0 < q1; i0 += 32) {
      const std::int64_t i1 = std::min(q1, i0 + 32);
      kvmem::OnlineSoftmax<float> sm[32];
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (std::int64_t j0 = 0; j0 < i1; j0 += 64) {
        const std::int64_t j1 = std::min(i1, j0 + 64);
        for (std::int64_t i = i0; i < i1; ++i) {
          const float* qrow = d.q.data() + ((b * d.H + h) * d.T + i) * D;
          float mx = -INFINITY;
          const std::int64_t jn = std::min(j1, i + 1);
          if (jn <= j0) continue;
          for (std::int64_t j = j0; j < jn; ++j) {
            logits[j - j0] = kvmem::kernel::ua::dot8<float>(qrow, K + j * D, D);
            mx = std::max(mx, logits[j - j0]);
          }
          float* a = acc.data() + (i - i0) * D;
          const float rs = sm[i - i0].raise_max(mx);
          if (rs != 1.0f)
            for (std::int64_t e = 0; e < D; ++e) a[e] *= rs;
          for (std::int64_t j = j0; j < jn; ++j) {
            const float w = sm[i - i0].accumulate(logits[j - j0]);
            for (std::int64_t e = 0; e < D; ++e) a[e] += w * V[j * D + e];
          }
        }
      }
      for (std::int64_t i = i0; i < i1; ++i) {
        const float inv = sm[i - i0].normaliser();
        float* o = out.data() + ((b * d.T + i) * d.H + h) * D;
        for (std::int64_t e = 0; e < D; ++e) o[e] = acc[(i - i0) * D + e] * inv;
      }
    }
  });
}

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

void check(const kvmem::Status& s) {
  if (!s.is_ok()) {
    std::fprintf(stderr, "kvmem error: %s\n", s.to_string().c_str());
    std::exit(1);
  }
}

struct Kept {
  double fraction;        // kept entries / tokens seen, averaged over (b, g)
  std::int64_t kv_bytes;  // keys + values kept, all (b, g)
  std::int64_t dense_bytes;
};
Kept kept_of(const kvmem::ua::PrunedCache<float>& cache) {
  Kept k{0.0, 0, 0};
  const auto rows = kvmem::ua::report(cache);
  for (const auto& r : rows) {
    k.fraction += static_cast<double>(r.kept) / static_cast<double>(r.dense);
    k.kv_bytes += r.kv_bytes;
    k.dense_bytes += r.dense_kv_bytes;
  }
  k.fraction /= static_cast<double>(rows.size());
  return k;
}

std::string mib(std::int64_t bytes) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2f", static_cast<double>(bytes) / (1024.0 * 1024.0));
  return buf;
}

// time / anchor time, or "-" where the anchor did not run.
std::string ratio(double time, double anchor) {
  if (anchor <= 0) return "-";
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2f", time / anchor);
  return buf;
}

}  // namespace

int main(int argc, char** argv) {
  const Args a = parse(argc, argv);
  const kvmem::host::Executor exec{a.threads};
  std::printf("# kvmem UA on the host backend\n\n");
  std::printf(
      "B=%lld H=%lld G=%lld D=%lld, threads=%d, fp32 storage, prefill chunk %lld, decode: %lld steps after a "
      "prefill of T tokens (time per step). Gates: logits ~ N(%.1f, 1.5); keys: random unit vectors.\n"
      "kept = kept entries / tokens seen (mean over (b, kv head)); KV MiB = keys + values kept (all heads); "
      "compression ratio = fraction of the dense KV cache removed; vs anchor = time / plain causal attention "
      "time on the same backend.\n\n",
      static_cast<long long>(a.B), static_cast<long long>(a.H), static_cast<long long>(a.G),
      static_cast<long long>(a.D), a.threads, static_cast<long long>(a.chunk), static_cast<long long>(a.decode_steps),
      static_cast<double>(a.gate_mean));
  std::printf("| phase | T | variant | time | kept | KV MiB | dense KV MiB | compression ratio | vs anchor |\n");
  std::printf("|---|---|---|---|---|---|---|---|---|\n");
  for (const std::int64_t T : a.T) {
    const std::int64_t steps = a.decode ? a.decode_steps : 0;
    const Data d(a.B, a.H, a.G, T + steps, a.D, 1234u + static_cast<unsigned>(T), a.gate_mean);
    std::vector<float> out(static_cast<std::size_t>(a.B * (T + steps) * a.H * a.D));
    const std::int64_t dense_bytes = a.B * a.G * T * 2 * a.D * 4;

    double anchor_prefill = 0, anchor_decode = 0;
    if (a.prefill && a.anchor) {
      const auto t0 = Clock::now();
      causal_attention(exec, d, 0, T, out);
      anchor_prefill = seconds_since(t0);
      std::printf("| prefill | %lld | causal attention (anchor) | %.3f s | 1 | %s | %s | 0 | 1.00 |\n",
                  static_cast<long long>(T), anchor_prefill, mib(dense_bytes).c_str(), mib(dense_bytes).c_str());
      std::fflush(stdout);
    }
    if (a.decode && a.anchor) {
      const auto t0 = Clock::now();
      causal_attention(exec, d, T, T + steps, out);  // decode-style: each new query over all T + i keys
      anchor_decode = seconds_since(t0) / static_cast<double>(steps);
      std::printf("| decode | %lld | causal attention (anchor) | %.3f ms/step | 1 | %s | %s | 0 | 1.00 |\n",
                  static_cast<long long>(T), anchor_decode * 1e3, mib(dense_bytes).c_str(), mib(dense_bytes).c_str());
      std::fflush(stdout);
    }
    for (const double p : a.p) {
      const std::string name =
          p == 0.0 ? std::string("UA dense (p = 0)") : "UA pruned p = " + std::to_string(p).substr(0, 4);
      kvmem::ua::PrunedCache<float> cache(kvmem::ua::CacheShape{a.B, a.H, a.G, a.D, T + steps, 16});
      const kvmem::ua::Options opt{p, a.chunk, true};
      const auto t0 = Clock::now();
      check(kvmem::ua::prefill(exec, cache, d.slice(0, T), opt, d.out(out, 0, T)));
      const double tp = seconds_since(t0);
      const Kept kp = kept_of(cache);
      if (a.prefill)
        std::printf("| prefill | %lld | %s | %.3f s | %.4f | %s | %s | %.4f | %s |\n", static_cast<long long>(T),
                    name.c_str(), tp, kp.fraction, mib(kp.kv_bytes).c_str(), mib(kp.dense_bytes).c_str(),
                    1.0 - static_cast<double>(kp.kv_bytes) / static_cast<double>(kp.dense_bytes),
                    ratio(tp, anchor_prefill).c_str());
      std::fflush(stdout);
      if (a.decode) {
        const auto t1 = Clock::now();
        for (std::int64_t t = T; t < T + steps; ++t)
          check(kvmem::ua::decode(exec, cache, d.slice(t, t + 1), opt, d.out(out, t, t + 1)));
        const double td = seconds_since(t1) / static_cast<double>(steps);
        const Kept kd = kept_of(cache);
        std::printf("| decode | %lld | %s | %.3f ms/step | %.4f | %s | %s | %.4f | %s |\n", static_cast<long long>(T),
                    name.c_str(), td * 1e3, kd.fraction, mib(kd.kv_bytes).c_str(), mib(kd.dense_bytes).c_str(),
                    1.0 - static_cast<double>(kd.kv_bytes) / static_cast<double>(kd.dense_bytes),
                    ratio(td, anchor_decode).c_str());
        std::fflush(stdout);
      }
    }
  }
  return 0;
}
