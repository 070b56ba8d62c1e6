// SPDX-License-Identifier: Apache-2.0
// kvmem-engine: a small decoder (model.hpp) served with continuous batching through kvmem's sequence
// slots (engine.hpp), with KV Means, Universal Attention or a dense KV cache as the attention of every
// layer. Requests of different prompt and output lengths arrive every few steps and leave when done.
// Per step it prints the live sequences, rows, tokens and the cache bytes of all layers (allocated and
// in use); at the end the tokens/s of each mechanism. Weights and prompts are random: the numbers show
// sizes and speed, not model quality.
//
//   kvmem-engine [--mechanism all|dense|kvm|kvm-sqrt|ua] [--requests 12] [--slots 4]
//                [--prompt 16:200] [--generate 8:48] [--arrival-gap 2] [--layers 4] [--heads 8]
//                [--kv-heads 2] [--head-dim 64] [--mlp 1024] [--vocab 512] [--chunk 64]
//                [--window-chunks 2] [--prefill-chunk 64] [--threads 0] [--seed 1] [--quiet]
//   kvmem-engine --check [size options]
//
// --check runs the checks a test needs and exits non-zero when one fails:
//   1. requests shorter than KVM's window: every generated token and the logits behind it agree with
//      the dense cache (spec KVM.md 4.8: such a sequence is attended exactly like a dense cache);
//   2. requests longer than the window (KVM compresses, UA prunes): each request's logits in the
//      continuous batch equal, bit for bit, the same request served alone (exact host arithmetic),
//      since a slot step's row computes what its sequence alone computes.

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "engine.hpp"

namespace {

using namespace engine;

using KvmFixed = KvmAttention<kvmem::budget::Fixed{256}>;
using KvmSqrt = KvmAttention<kvmem::budget::Power{16.0, 0.5, 256}>;
using Ua = UaAttention<kvmem::prune::Threshold{0.05}>;

struct Options {
  std::string mechanism = "all";
  std::int64_t requests = 12, arrival_gap = 2;
  std::int64_t prompt_min = 16, prompt_max = 200, gen_min = 8, gen_max = 48;
  std::int64_t threads = 0;
  bool quiet = false, check = false;
  ModelConfig model;
  CacheConfig cache;
  EngineOptions engine;
};

bool range(const char* s, std::int64_t& lo, std::int64_t& hi) {
  return std::sscanf(s, "%ld:%ld", &lo, &hi) == 2 && lo >= 1 && hi >= lo;  // NOLINT(cert-err34-c)
}

bool parse(int argc, char** argv, Options& o) {
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> const char* { return i + 1 < argc ? argv[++i] : nullptr; };
    auto integer = [&](std::int64_t& out) {
      const char* v = value();
      if (v == nullptr) return false;
      out = std::strtoll(v, nullptr, 10);
      return out >= 0;
    };
    bool ok = true;
    if (a == "--mechanism") {
      const char* v = value();
      ok = v != nullptr;
      if (ok) o.mechanism = v;
    } else if (a == "--requests")
      ok = integer(o.requests);
    else if (a == "--slots")
      ok = integer(o.cache.max_slots);
    else if (a == "--prompt")
      ok = i + 1 < argc && range(argv[++i], o.prompt_min, o.prompt_max);
    else if (a == "--generate")
      ok = i + 1 < argc && range(argv[++i], o.gen_min, o.gen_max);
    else if (a == "--arrival-gap")
      ok = integer(o.arrival_gap);
    else if (a == "--layers")
      ok = integer(o.model.layers);
    else if (a == "--heads")
      ok = integer(o.model.q_heads);
    else if (a == "--kv-heads")
      ok = integer(o.model.kv_heads);
    else if (a == "--head-dim")
      ok = integer(o.model.head_dim);
    else if (a == "--mlp")
      ok = integer(o.model.mlp);
    else if (a == "--vocab")
      ok = integer(o.model.vocab);
    else if (a == "--chunk")
      ok = integer(o.cache.kvm_chunk);
    else if (a == "--window-chunks")
      ok = integer(o.cache.kvm_window_chunks);
    else if (a == "--prefill-chunk")
      ok = integer(o.engine.prefill_chunk);
    else if (a == "--threads")
      ok = integer(o.threads);
    else if (a == "--seed") {
      std::int64_t s = 0;
      ok = integer(s);
      o.model.seed = static_cast<std::uint64_t>(s);
    } else if (a == "--quiet")
      o.quiet = true;
    else if (a == "--check")
      o.check = true;
    else
      ok = false;
    if (!ok) {
      std::fprintf(stderr,
                   "kvmem-engine: bad or unknown argument %s (see the comment at the top of kvmem_engine.cpp)\n",
                   a.c_str());
      return false;
    }
  }
  o.model.rope_dims = o.model.head_dim / 2;
  if (o.model.q_heads < 1 || o.model.kv_heads < 1 || o.model.q_heads % o.model.kv_heads != 0 || o.model.head_dim < 2 ||
      o.cache.max_slots < 1 || o.engine.prefill_chunk < 1) {
    std::fprintf(stderr,
                 "kvmem-engine: heads must be a multiple of kv-heads; head-dim >= 2; slots, prefill-chunk >= 1\n");
    return false;
  }
  return true;
}

// Requests i = 0.. arrive every arrival_gap steps with random prompt and output lengths.
std::vector<Request> workload(const Options& o, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<std::int64_t> plen(o.prompt_min, o.prompt_max), glen(o.gen_min, o.gen_max);
  std::uniform_int_distribution<std::int32_t> tok(0, static_cast<std::int32_t>(o.model.vocab - 1));
  std::vector<Request> out;
  for (std::int64_t i = 0; i < o.requests; ++i) {
    Request r;
    r.arrival = i * o.arrival_gap;
    r.prompt.resize(static_cast<std::size_t>(plen(rng)));
    for (auto& t : r.prompt) t = tok(rng);
    r.max_new = glen(rng);
    out.push_back(std::move(r));
  }
  return out;
}

std::string mib(std::size_t bytes) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2f MiB", static_cast<double>(bytes) / (1024.0 * 1024.0));
  return buf;
}

template <class Mechanism>
std::vector<RequestResult> serve(const Model& model, const Options& o, const std::vector<Request>& requests, bool exact,
                                 bool print) {
  CacheConfig cache = o.cache;
  cache.n_ctx = o.prompt_max + o.gen_max;
  const kvmem::host::Executor exec{.threads = static_cast<int>(o.threads), .exact = exact};
  Engine<Mechanism> eng(model, cache, o.engine, exec);
  std::int64_t tokens = 0, decode = 0, steps = 0;
  double seconds = 0, decode_seconds = 0;
  std::size_t allocated = 0, peak_live = 0;
  if (print) std::printf("\n== %s ==\n", Mechanism::name().c_str());
  if (print && !o.quiet)
    std::printf("%6s %5s %5s %7s %8s %14s %14s %9s\n", "step", "live", "rows", "prefill", "decode", "cache alloc",
                "cache in use", "ms");
  auto results = eng.run(requests, [&](const StepStats& s) {
    tokens += s.tokens;
    decode += s.decode_tokens;
    seconds += s.seconds;
    if (s.prefill_tokens == 0) decode_seconds += s.seconds;
    allocated = s.allocated_bytes;
    peak_live = std::max(peak_live, s.live_bytes);
    steps = s.step + 1;
    if (print && !o.quiet)
      std::printf("%6ld %5ld %5ld %7ld %8ld %14s %14s %9.2f\n", static_cast<long>(s.step), static_cast<long>(s.live),
                  static_cast<long>(s.rows), static_cast<long>(s.prefill_tokens), static_cast<long>(s.decode_tokens),
                  mib(s.allocated_bytes).c_str(), mib(s.live_bytes).c_str(), 1e3 * s.seconds);
  });
  if (print) {
    std::printf("%s: %ld steps, %ld tokens in %.3f s = %.0f tokens/s", Mechanism::name().c_str(),
                static_cast<long>(steps), static_cast<long>(tokens), seconds, seconds > 0 ? tokens / seconds : 0.0);
    if (decode_seconds > 0) std::printf(" (decode-only steps: %.0f tokens/s)", decode / decode_seconds);
    std::printf("; cache allocated %s, peak in use %s\n", mib(allocated).c_str(), mib(peak_live).c_str());
  }
  return results;
}

int failures = 0;
void expect(bool ok, const std::string& what) {
  std::printf("%s: %s\n", ok ? "ok  " : "FAIL", what.c_str());
  if (!ok) ++failures;
}

bool complete(const std::vector<Request>& rq, const std::vector<RequestResult>& res) {
  for (std::size_t i = 0; i < rq.size(); ++i)
    if (static_cast<std::int64_t>(res[i].tokens.size()) != rq[i].max_new || res[i].finished < 0) return false;
  return true;
}

// Check 1: KVM within its window against the dense cache.
template <class Kvm>
void check_against_dense(const Model& model, const Options& o, const std::vector<Request>& rq,
                         const std::vector<RequestResult>& dense) {
  const auto kvm = serve<Kvm>(model, o, rq, false, false);
  expect(complete(rq, kvm), Kvm::name() + ": every request generated all its tokens");
  double worst = 0;
  std::size_t same = 0;
  for (std::size_t i = 0; i < rq.size(); ++i) {
    same += kvm[i].tokens == dense[i].tokens;
    for (std::size_t j = 0; j < std::min(kvm[i].logits.size(), dense[i].logits.size()); ++j)
      worst = std::max(worst, double(std::fabs(kvm[i].logits[j] - dense[i].logits[j])) /
                                  std::max(1.0, double(std::fabs(dense[i].logits[j]))));
  }
  expect(same == rq.size(), Kvm::name() + " vs dense: " + std::to_string(same) + "/" + std::to_string(rq.size()) +
                                " requests generated the same tokens");
  expect(worst <= 1e-3,
         Kvm::name() + " vs dense: largest relative logit difference " + std::to_string(worst) + " (<= 1e-3)");
}

// Check 2: each request in the continuous batch equals that request served alone, bit for bit.
template <class Mechanism>
void check_batch_equals_alone(const Model& model, const Options& o, const std::vector<Request>& rq) {
  const auto batched = serve<Mechanism>(model, o, rq, true, false);
  expect(complete(rq, batched), Mechanism::name() + ": every request generated all its tokens");
  std::size_t same = 0;
  for (std::size_t i = 0; i < rq.size(); ++i) {
    Request alone = rq[i];
    alone.arrival = 0;
    const auto single = serve<Mechanism>(model, o, {alone}, true, false);
    same += single[0].tokens == batched[i].tokens && single[0].logits == batched[i].logits;
  }
  expect(same == rq.size(), Mechanism::name() + ": " + std::to_string(same) + "/" + std::to_string(rq.size()) +
                                " requests equal, bitwise, the same request served alone");
}

int run_checks(Options o) {
  const Model model = Model::random(o.model);
  // 1. Requests within the window: window = chunk * window_chunks tokens.
  Options shrt = o;
  const std::int64_t window = o.cache.kvm_chunk * o.cache.kvm_window_chunks;
  shrt.prompt_max = std::min(o.prompt_max, window / 2);
  shrt.prompt_min = std::min(o.prompt_min, shrt.prompt_max);
  shrt.gen_max = std::min(o.gen_max, window - shrt.prompt_max);
  shrt.gen_min = std::min(o.gen_min, shrt.gen_max);
  const auto rq = workload(shrt, o.model.seed + 1);
  const auto dense = serve<DenseAttention>(model, shrt, rq, false, false);
  expect(complete(rq, dense), "dense: every request generated all its tokens");
  check_against_dense<KvmFixed>(model, shrt, rq, dense);
  check_against_dense<KvmSqrt>(model, shrt, rq, dense);
  // 2. Requests well beyond the window.
  Options lng = o;
  lng.prompt_min = std::max(o.prompt_min, window + 1);
  lng.prompt_max = std::max(o.prompt_max, 3 * window);
  const auto rq2 = workload(lng, o.model.seed + 2);
  check_batch_equals_alone<KvmFixed>(model, lng, rq2);
  check_batch_equals_alone<Ua>(model, lng, rq2);
  std::printf("%s\n", failures == 0 ? "all checks passed" : "some checks FAILED");
  return failures == 0 ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  if (!parse(argc, argv, o)) return 2;
  try {
    if (o.check) return run_checks(o);
    const Model model = Model::random(o.model);
    const auto rq = workload(o, o.model.seed + 1);
    std::printf(
        "model: %ld layers, d_model %ld, %ld query / %ld kv heads of %ld, MLP %ld, vocab %ld; %ld requests "
        "(prompt %ld..%ld, generate %ld..%ld, one every %ld steps), %ld slots\n",
        static_cast<long>(o.model.layers), static_cast<long>(o.model.d_model()), static_cast<long>(o.model.q_heads),
        static_cast<long>(o.model.kv_heads), static_cast<long>(o.model.head_dim), static_cast<long>(o.model.mlp),
        static_cast<long>(o.model.vocab), static_cast<long>(o.requests), static_cast<long>(o.prompt_min),
        static_cast<long>(o.prompt_max), static_cast<long>(o.gen_min), static_cast<long>(o.gen_max),
        static_cast<long>(o.arrival_gap), static_cast<long>(o.cache.max_slots));
    const bool all = o.mechanism == "all";
    bool any = false;
    if (all || o.mechanism == "dense") any = true, serve<DenseAttention>(model, o, rq, false, true);
    if (all || o.mechanism == "kvm") any = true, serve<KvmFixed>(model, o, rq, false, true);
    if (all || o.mechanism == "kvm-sqrt") any = true, serve<KvmSqrt>(model, o, rq, false, true);
    if (all || o.mechanism == "ua") any = true, serve<Ua>(model, o, rq, false, true);
    if (!any) {
      std::fprintf(stderr, "kvmem-engine: --mechanism must be all, dense, kvm, kvm-sqrt or ua\n");
      return 2;
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "kvmem-engine: %s\n", e.what());
    return 1;
  }
  return 0;
}
