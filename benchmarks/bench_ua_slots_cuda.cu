// SPDX-License-Identifier: Apache-2.0
// Universal Attention sequence slots on the CUDA backend: a ragged decode step (ua::step, one token for
// each of --sequences slots, each at its own position; lengths drawn uniformly from [--min, --max],
// seeded) at H16 G4 D128 bf16, run plainly and replayed from one captured CUDA graph, for --steps
// consecutive steps. Prints ms per step and tokens/s, the kept rows per (slot, KV head) and the pool's pages
// in use at the end, and writes a JSON line per threshold (--json FILE).
//
//   kvmem_bench_ua_slots_cuda [--sequences 64] [--heads 16] [--kv-heads 4] [--min 1024] [--max 32768]
//                             [--steps 256] [--seed 1] [--p 0.05|0] [--pool-pages N] [--decode-tc 1]
//                             [--json out.jsonl]
//
// --pool-pages N: the slots' rows live in one shared pool of N pages of 16 rows (an engine's layer
// memory); 0 (the default): every (slot, KV head) owns the pages of its capacity. -1: a shared pool as
// large as the owned pages would be.
// --decode-tc 0|1: UaCacheLimits::decode_tensor_cores (long items decoded on the tensor cores, the default,
// or on the CUDA cores).
//
// The slots are filled by importing synthetic records: a sequence of length L keeps its last
// min(L, 160) keys at p = 0.05 (about what random inputs keep: the decay evicts older keys) and all L
// keys at p = 0 (dense: the decode step reads the whole cache). A decode step's cost depends on how many
// kept rows it reads, not on their values; λ starts at 0, so nothing is evicted during the run at p = 0
// and little at p = 0.05.

#include "kvmem/backend/cuda/vendor.cuh"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "cuda_bench_support.cuh"
#include "kvmem/backend/cuda.hpp"
#include "kvmem/kvmem.hpp"

namespace {

using kvmem::bf16;
using kvmem::TensorView;
using kvmem::bench::Buffer;
using kvmem::bench::fill;

struct Options {
  std::int64_t sequences = 64, heads = 16, kv_heads = 4, min_len = 1024, max_len = 32768, steps = 256;
  std::uint64_t seed = 1;
  std::int64_t pool_pages = 0;  // 0: own pages; -1: a shared pool of the owned pages' size
  double p = -1;                // < 0: both 0.05 and 0
  bool decode_tc = true;        // UaCacheLimits::decode_tensor_cores
  const char* json = nullptr;
};

constexpr std::int64_t kPrunedKept = 160;

void run(double p, const Options& o, std::FILE* json) {
  const std::int64_t R = o.sequences, H = o.heads, G = o.kv_heads, D = 128;
  const bool dense = p == 0.0;
  // every slot takes one row per step: 4 warm-up steps, steps - 4 plain ones, then steps graph replays
  const std::int64_t capacity = (dense ? o.max_len : kPrunedKept) + 2 * o.steps + 8;
  const std::int64_t pool_pages = o.pool_pages < 0 ? R * G * ((capacity + 15) / 16) : o.pool_pages;
  kvmem::cuda::UaCache<bf16> cache;
  kvmem::cuda::UaCacheLimits limits;
  limits.decode_tensor_cores = o.decode_tc;
  CHECK_STATUS(kvmem::cuda::UaCache<bf16>::create({R, H, G, D, capacity, 16, pool_pages}, cache, limits));
  const kvmem::cuda::Executor exec{};
  std::mt19937_64 rng(o.seed);
  // keys and values from a table of random values (filling 32K-row records draw by draw is slow)
  std::normal_distribution<float> n01(0.0f, 1.0f);
  std::vector<bf16> table(4099);
  for (auto& x : table) x = bf16(n01(rng) / std::sqrt(float(D)));
  std::vector<std::int64_t> lengths;
  double mean = 0;
  for (std::int64_t s = 0; s < R; ++s) {
    const std::int64_t L = std::uniform_int_distribution<std::int64_t>(o.min_len, o.max_len)(rng);
    lengths.push_back(L);
    mean += double(L) / double(R);
    const std::int64_t kept = dense ? L : std::min(L, kPrunedKept);
    kvmem::ua::PrunedCache<bf16> twin(kvmem::ua::CacheShape{1, H, G, D, kept, 16});
    for (std::int64_t g = 0; g < G; ++g) {
      auto it = twin.item_view(0, g);
      for (std::int64_t e = 0; e < kept; ++e) {
        for (std::int64_t d = 0; d < D; ++d) {
          it.keys[e * D + d] = table[std::size_t((e * D + d + 11 * g) % 4099)];
          it.values[e * D + d] = table[std::size_t((e * D + d + 13 * g + 7) % 4099)];
        }
        it.lambda[e] = 0.0f;
        it.key_logit[e] = 1.0f;
        it.pos[e] = L - kept + e;
      }
      *it.length = kept;
    }
    twin.set_position(0, L);
    std::vector<std::byte> bytes(kvmem::ua::export_bytes(twin, 0));
    CHECK_STATUS(kvmem::ua::export_slot(kvmem::host::Executor{}, twin, 0, std::span<std::byte>(bytes)));
    CHECK_STATUS(kvmem::ua::import_slot(exec, cache, std::int32_t(s), std::span<const std::byte>(bytes)));
  }
  // the decode batch: row r = slot r, one token each
  std::vector<std::int32_t> slot(static_cast<std::size_t>(R)), start(static_cast<std::size_t>(R + 1));
  for (std::int64_t r = 0; r <= R; ++r) {
    if (r < R) slot[std::size_t(r)] = std::int32_t(r);
    start[std::size_t(r)] = std::int32_t(r);
  }
  Buffer<std::int32_t> dslot{std::size_t(R)}, dstart{std::size_t(R + 1)};
  CHECK_CUDA(cudaMemcpy(dslot.ptr, slot.data(), slot.size() * 4, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(dstart.ptr, start.data(), start.size() * 4, cudaMemcpyHostToDevice));
  Buffer<bf16> q{std::size_t(R * H * D)}, k{std::size_t(R * G * D)}, v{std::size_t(R * G * D)};
  Buffer<float> z_k{std::size_t(R * G)}, z_q{std::size_t(R * G)}, out{std::size_t(R * H * D)}, lse{std::size_t(R * H)};
  fill(q.ptr, R * H * D, 1);
  fill(k.ptr, R * G * D, 2);
  fill(v.ptr, R * G * D, 3);
  fill(z_k.ptr, R * G, 4);
  fill(z_q.ptr, R * G, 5);
  cudaStream_t stream;
  CHECK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const kvmem::cuda::Executor on{stream};
  const kvmem::Rows rows{TensorView<const std::int32_t, 1>(dslot.ptr, {R}),
                         TensorView<const std::int32_t, 1>(dstart.ptr, {R + 1})};
  kvmem::ua::PackedInputsOf<bf16> in;
  in.q = {q.ptr, {R, H, D}};
  in.k = {k.ptr, {R, G, D}};
  in.v = {v.ptr, {R, G, D}};
  in.z_k = {z_k.ptr, {R, G}};
  in.z_q = {z_q.ptr, {R, G}};
  const kvmem::ua::Options opt{p, 128, true};
  const auto step = [&] {
    return kvmem::ua::step(on, cache, rows, in, opt, TensorView<float, 3>(out.ptr, {R, H, D}),
                           TensorView<float, 2>(lse.ptr, {R, H}));
  };
  const kvmem::bench::StepTimes times = kvmem::bench::time_plain_and_graph(stream, o.steps, step);
  CHECK_STATUS(cache.step_status(on));
  std::vector<std::int32_t> flags;
  CHECK_STATUS(cache.overflowed(on, flags));
  if (std::count(flags.begin(), flags.end(), 1) != 0) {
    std::fprintf(stderr, "a slot ran out of rows: the capacity is too small for --steps\n");
    std::exit(1);
  }
  const double plain = times.plain_ms, replay = times.graph_ms;
  // what the last steps read: kept rows per (slot, kv head) and the pages holding them
  std::vector<std::int64_t> kept;
  CHECK_STATUS(cache.lengths(kept, stream));
  double kept_mean = 0;
  for (auto k : kept) kept_mean += double(k) / double(kept.size());
  const std::int64_t kept_min = *std::min_element(kept.begin(), kept.end()),
                     kept_max = *std::max_element(kept.begin(), kept.end());
  CHECK_STATUS(cache.publish_occupancy(on));
  CHECK_CUDA(cudaStreamSynchronize(stream));
  const std::string name = dense ? "p=0" : "p=0.05";
  const std::string pool = pool_pages > 0 ? "shared pool of " + std::to_string(pool_pages) + " pages" : "own pages";
  std::printf(
      "UA %-7s %4lld seqs H%lld/%lld mean len %7.0f  step %8.4f ms (%9.0f tok/s)  graph %8.4f ms (%9.0f tok/s)\n"
      "         %s: kept rows per (slot, kv head) at the end %lld .. %lld (mean %.0f), pages in use %lld of %lld\n",
      name.c_str(), (long long)R, (long long)H, (long long)G, mean, plain, double(R) / plain * 1e3, replay,
      double(R) / replay * 1e3, pool.c_str(), (long long)kept_min, (long long)kept_max, kept_mean,
      (long long)cache.pages_in_use(), (long long)cache.pool_pages());
  if (json != nullptr)
    std::fprintf(json,
                 "{\"bench\":\"ua_slots_cuda_decode\",\"p\":%g,\"sequences\":%lld,\"heads\":%lld,"
                 "\"kv_heads\":%lld,\"min\":%lld,\"max\":%lld,\"longest\":%lld,\"mean_len\":%.1f,"
                 "\"steps\":%lld,\"step_ms\":%.6f,\"graph_step_ms\":%.6f,\"tokens_per_s\":%.1f,"
                 "\"graph_tokens_per_s\":%.1f,\"pool_pages\":%lld,\"kept_mean\":%.1f}\n",
                 p, (long long)R, (long long)H, (long long)G, (long long)o.min_len, (long long)o.max_len,
                 (long long)*std::max_element(lengths.begin(), lengths.end()), mean, (long long)o.steps, plain, replay,
                 double(R) / plain * 1e3, double(R) / replay * 1e3, (long long)pool_pages, kept_mean);
  CHECK_CUDA(cudaStreamDestroy(stream));
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i];
    if (a == "--sequences")
      o.sequences = std::atoll(argv[i + 1]);
    else if (a == "--heads")
      o.heads = std::atoll(argv[i + 1]);
    else if (a == "--kv-heads")
      o.kv_heads = std::atoll(argv[i + 1]);
    else if (a == "--min")
      o.min_len = std::atoll(argv[i + 1]);
    else if (a == "--max")
      o.max_len = std::atoll(argv[i + 1]);
    else if (a == "--steps")
      o.steps = std::max<std::int64_t>(8, std::atoll(argv[i + 1]));
    else if (a == "--seed")
      o.seed = std::strtoull(argv[i + 1], nullptr, 10);
    else if (a == "--p")
      o.p = std::atof(argv[i + 1]);
    else if (a == "--pool-pages")
      o.pool_pages = std::atoll(argv[i + 1]);
    else if (a == "--decode-tc")
      o.decode_tc = std::atoi(argv[i + 1]) != 0;
    else if (a == "--json")
      o.json = argv[i + 1];
    else {
      std::fprintf(stderr, "unknown option %s\n", a.c_str());
      return 2;
    }
  }
  if (kvmem::cuda::device_count() == 0) {
    std::printf("SKIPPED: no CUDA device visible\n");
    return 0;
  }
  std::FILE* json = o.json ? std::fopen(o.json, "a") : nullptr;
  if (o.p < 0 || o.p > 0) run(o.p < 0 ? 0.05 : o.p, o, json);
  if (o.p <= 0) run(0.0, o, json);
  if (json != nullptr) std::fclose(json);
  return 0;
}
