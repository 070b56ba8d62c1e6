// SPDX-License-Identifier: Apache-2.0
// KV Means sequence slots on the CUDA backend: a ragged decode step (kvm::step, one token for each of
// --sequences slots, each at its own position; lengths drawn uniformly from [--min, --max], seeded) at
// H32 D128 bf16, run plainly and replayed from one captured CUDA graph, for --steps consecutive steps
// (the state updates of the sequences that cross a chunk boundary included: a sequence updates at
// every position that is a multiple of the chunk, so about sequences / C rows a step). Prints ms per
// step, tokens/s and the state updates per replayed step, and writes a JSON line per budget (--json
// FILE).
//
//   kvmem_bench_kvm_slots_cuda [--sequences 64] [--heads 32] [--kv-heads 32] [--min 1024] [--max 32768]
//                              [--steps 256] [--seed 1] [--budget fixed-256|16sqrtN] [--json out.jsonl]
//                              [--prefill-rows 0] [--prefill-len 2048] [--prefill-reps 8]
//
// --prefill-rows R > 0 times a prefill step instead: R rows of --prefill-len tokens each, every row
// starting an empty slot (reset_slots before each step, timed with it), --prefill-reps times, once
// without the rows' bound (Rows::max_query_len = 0: chunk phases and grids from the packed token count)
// and once with it (max_query_len = --prefill-len, as vLLM's attention metadata gives it). Prints ms
// per step and tokens/s of both and their ratio; JSON lines "kvm_slots_cuda_prefill".
//
// The slots are filled by importing synthetic records (counters of a sequence of that length, its
// memory and window zero): a decode step's cost depends on how many slots and window keys it reads,
// not on their values.

#include "kvmem/backend/cuda/vendor.cuh"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
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

__global__ void gate_kernel(bf16* x, std::int64_t n) {  // g = 1 + elu(z) > 0
  for (std::int64_t i = blockIdx.x * std::int64_t(blockDim.x) + threadIdx.x; i < n;
       i += std::int64_t(gridDim.x) * blockDim.x) {
    const float z = float(x[i]);
    x[i] = bf16(z > 0 ? 1 + z : expf(z));
  }
}

struct Options {
  std::int64_t sequences = 64, heads = 32, kv_heads = 32, min_len = 1024, max_len = 32768, steps = 256;
  std::int64_t prefill_rows = 0, prefill_len = 2048, prefill_reps = 8;
  std::uint64_t seed = 1;
  std::string budget;
  const char* json = nullptr;
};

// Weights that leave the state's arithmetic plain: LayerNorm weight 1 and bias 0, every temperature 1.
struct UnitWeights {
  Buffer<float> w, bias, ts, tw;
  UnitWeights(std::int64_t D, std::int64_t H)
      : w{std::size_t(D)}, bias{std::size_t(D)}, ts{std::size_t(H)}, tw{std::size_t(H)} {
    const std::vector<float> ones(std::size_t(std::max(D, H)), 1.0f), zeros(std::size_t(D), 0.0f);
    CHECK_CUDA(cudaMemcpy(w.ptr, ones.data(), D * 4, cudaMemcpyHostToDevice));
    CHECK_CUDA(cudaMemcpy(bias.ptr, zeros.data(), D * 4, cudaMemcpyHostToDevice));
    CHECK_CUDA(cudaMemcpy(ts.ptr, ones.data(), H * 4, cudaMemcpyHostToDevice));
    CHECK_CUDA(cudaMemcpy(tw.ptr, ones.data(), H * 4, cudaMemcpyHostToDevice));
  }
  kvmem::cuda::KvmWeights view() const { return {w.ptr, bias.ptr, ts.ptr, tw.ptr}; }
};

// One step's packed device inputs and outputs: row r is slot slot[r] with tokens [start[r], start[r + 1]),
// N = start.back() tokens of seeded random q, k, v and positive gates.
struct PackedBatch {
  std::int64_t R, N, H, Hk, D;
  Buffer<std::int32_t> slot, start;
  Buffer<bf16> q, k, v, g;
  Buffer<float> out, lse;
  PackedBatch(const std::vector<std::int32_t>& slots, const std::vector<std::int32_t>& starts, std::int64_t heads,
              std::int64_t kv_heads, std::int64_t head_dim)
      : R(std::int64_t(slots.size())),
        N(starts.back()),
        H(heads),
        Hk(kv_heads),
        D(head_dim),
        slot{slots.size()},
        start{starts.size()},
        q{std::size_t(N * H * D)},
        k{std::size_t(N * Hk * D)},
        v{std::size_t(N * Hk * D)},
        g{std::size_t(N * Hk)},
        out{std::size_t(N * H * D)},
        lse{std::size_t(N * H)} {
    CHECK_CUDA(cudaMemcpy(slot.ptr, slots.data(), slots.size() * 4, cudaMemcpyHostToDevice));
    CHECK_CUDA(cudaMemcpy(start.ptr, starts.data(), starts.size() * 4, cudaMemcpyHostToDevice));
    fill(q.ptr, N * H * D, 1);
    fill(k.ptr, N * Hk * D, 2);
    fill(v.ptr, N * Hk * D, 3);
    fill(g.ptr, N * Hk, 4);
    gate_kernel<<<64, 256>>>(g.ptr, N * Hk);
    CHECK_CUDA(cudaGetLastError());
  }
  kvmem::Rows rows(std::int64_t max_query_len = 0) const {
    return {TensorView<const std::int32_t, 1>(slot.ptr, {R}), TensorView<const std::int32_t, 1>(start.ptr, {R + 1}),
            max_query_len};
  }
  kvmem::Status step(const kvmem::cuda::Executor& on, kvmem::cuda::KvmState<bf16>& state,
                     const kvmem::cuda::KvmWeights& weights, const kvmem::Rows& r) const {
    return kvmem::kvm::step(on, state, weights, r, TensorView<const bf16, 3>(q.ptr, {N, H, D}),
                            TensorView<const bf16, 3>(k.ptr, {N, Hk, D}), TensorView<const bf16, 3>(v.ptr, {N, Hk, D}),
                            TensorView<const bf16, 2>(g.ptr, {N, Hk}), TensorView<float, 3>(out.ptr, {N, H, D}),
                            TensorView<float, 2>(lse.ptr, {N, H}));
  }
};

void run(const std::string& name, kvmem::budget::Any budget, const Options& o, std::FILE* json) {
  const std::int64_t R = o.sequences, H = o.heads, Hk = o.kv_heads, D = 128;
  kvmem::kvm::Params p;  // paper defaults: C = 256, nb = 2, S = 1, r = 64
  p.budget = budget;
  const kvmem::kvm::Shape shape{R, H, Hk, D, D, o.max_len + 2 * o.steps + 8};
  kvmem::cuda::KvmState<bf16> state;
  CHECK_STATUS(kvmem::cuda::KvmState<bf16>::create(p, shape, state));
  const UnitWeights unit(D, H);
  const kvmem::cuda::KvmWeights weights = unit.view();
  const kvmem::cuda::Executor exec{};
  // lengths and synthetic records: a host one-slot state with the counters of a sequence of length L
  std::mt19937_64 rng(o.seed);
  std::vector<std::int64_t> lengths;
  double mean = 0;
  {
    kvmem::kvm::Shape one = shape;
    one.B = 1;
    kvmem::kvm::State<bf16, float> twin;
    CHECK_STATUS((kvmem::kvm::State<bf16, float>::create(p, one, twin)));
    const kvmem::kvm::Geometry geo = p.geometry();
    for (std::int64_t s = 0; s < R; ++s) {
      const std::int64_t L = std::uniform_int_distribution<std::int64_t>(o.min_len, o.max_len)(rng);
      lengths.push_back(L);
      mean += double(L) / double(R);
      twin.n_data()[0] = L;
      twin.cov_data()[0] = geo.covered(L);
      twin.slots_data()[0] = kvmem::kvm::slots_after(p.budget, geo, L);
      for (std::int64_t g = 0; g < Hk; ++g) {  // zero memory and window (exact in bf16, finite LN)
        const auto it = twin.item(0, g);
        std::fill(it.sk, it.sk + state.capacity() * D, 0.0f);
        std::fill(it.sv, it.sv + state.capacity() * D, 0.0f);
        std::fill(it.rho, it.rho + state.capacity(), 0.0f);
        std::fill(it.cnt, it.cnt + state.capacity(), 1.0f);
        std::fill(it.wk, it.wk + p.window() * D, bf16(0.0f));
        std::fill(it.wv, it.wv + p.window() * D, bf16(0.0f));
        std::fill(it.wg, it.wg + p.window(), 1.0f);
      }
      std::vector<std::byte> bytes(kvmem::kvm::export_bytes(twin, 0));
      CHECK_STATUS(kvmem::kvm::export_slot(kvmem::host::Executor{}, twin, 0, std::span<std::byte>(bytes)));
      CHECK_STATUS(kvmem::kvm::import_slot(exec, state, weights, std::int32_t(s), std::span<const std::byte>(bytes)));
    }
  }
  // the decode batch: row r = slot r, one token each
  std::vector<std::int32_t> slot(static_cast<std::size_t>(R)), start(static_cast<std::size_t>(R + 1));
  for (std::int64_t r = 0; r <= R; ++r) {
    if (r < R) slot[std::size_t(r)] = std::int32_t(r);
    start[std::size_t(r)] = std::int32_t(r);
  }
  const PackedBatch batch(slot, start, H, Hk, D);
  cudaStream_t stream;
  CHECK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const kvmem::cuda::Executor on{stream};
  const kvmem::Rows rows = batch.rows();
  const auto step = [&] { return batch.step(on, state, weights, rows); };
  const kvmem::bench::StepTimes times = kvmem::bench::time_plain_and_graph(stream, o.steps, step);
  CHECK_STATUS(state.step_status(on));
  const double plain = times.plain_ms, replay = times.graph_ms;
  // the replays run positions L + steps .. L + 2 steps - 1 of each sequence (after the plain steps);
  // the step at position n updates the sequence when n is a multiple of C (spec 4.7)
  std::int64_t updates = 0;
  for (const std::int64_t L : lengths)
    for (std::int64_t i = o.steps; i < 2 * o.steps; ++i) updates += (L + i) % p.chunk == 0 ? 1 : 0;
  const double per_step = double(updates) / double(o.steps);
  std::printf(
      "%-10s %4lld seqs H%lld/%lld mean len %7.0f  step %8.4f ms (%9.0f tok/s)  graph %8.4f ms (%9.0f tok/s)  "
      "%.3f updates/step\n",
      name.c_str(), (long long)R, (long long)H, (long long)Hk, mean, plain, double(R) / plain * 1e3, replay,
      double(R) / replay * 1e3, per_step);
  if (json != nullptr)
    std::fprintf(json,
                 "{\"bench\":\"kvm_slots_cuda_decode\",\"budget\":\"%s\",\"sequences\":%lld,\"heads\":%lld,"
                 "\"kv_heads\":%lld,\"min\":%lld,\"max\":%lld,\"longest\":%lld,\"mean_len\":%.1f,"
                 "\"steps\":%lld,\"step_ms\":%.6f,\"graph_step_ms\":%.6f,\"tokens_per_s\":%.1f,"
                 "\"graph_tokens_per_s\":%.1f,\"updates_per_step\":%.4f}\n",
                 name.c_str(), (long long)R, (long long)H, (long long)Hk, (long long)o.min_len, (long long)o.max_len,
                 (long long)*std::max_element(lengths.begin(), lengths.end()), mean, (long long)o.steps, plain, replay,
                 double(R) / plain * 1e3, double(R) / replay * 1e3, per_step);
  CHECK_CUDA(cudaStreamDestroy(stream));
}

// R rows of L tokens each, every one starting an empty slot: the step's time without and with the rows'
// bound (max_query_len), whose outputs are the same bits.
void run_prefill(const std::string& name, kvmem::budget::Any budget, const Options& o, std::FILE* json) {
  const std::int64_t R = o.prefill_rows, L = o.prefill_len, N = R * L, H = o.heads, Hk = o.kv_heads, D = 128;
  kvmem::kvm::Params p;  // paper defaults: C = 256, nb = 2, S = 1, r = 64
  p.budget = budget;
  kvmem::cuda::KvmState<bf16> state;
  CHECK_STATUS(kvmem::cuda::KvmState<bf16>::create(p, {R, H, Hk, D, D, L}, state));
  const UnitWeights unit(D, H);
  const kvmem::cuda::KvmWeights weights = unit.view();
  std::vector<std::int32_t> slot(static_cast<std::size_t>(R)), start(static_cast<std::size_t>(R + 1));
  for (std::int64_t r = 0; r <= R; ++r) {
    if (r < R) slot[std::size_t(r)] = std::int32_t(r);
    start[std::size_t(r)] = std::int32_t(r * L);
  }
  const PackedBatch batch(slot, start, H, Hk, D);
  cudaStream_t stream;
  CHECK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const kvmem::cuda::Executor on{stream};
  const auto step = [&](std::int64_t bound) {
    const kvmem::Rows rows = batch.rows(bound);
    CHECK_STATUS(kvmem::kvm::reset_slots(on, state, rows.slot));
    CHECK_STATUS(batch.step(on, state, weights, rows));
  };
  cudaEvent_t e0, e1;
  CHECK_CUDA(cudaEventCreate(&e0));
  CHECK_CUDA(cudaEventCreate(&e1));
  const auto time_ms = [&](std::int64_t bound) {
    step(bound);  // warm-up
    CHECK_CUDA(cudaEventRecord(e0, stream));
    for (std::int64_t i = 0; i < o.prefill_reps; ++i) step(bound);
    CHECK_CUDA(cudaEventRecord(e1, stream));
    CHECK_CUDA(cudaEventSynchronize(e1));
    float ms = 0;
    CHECK_CUDA(cudaEventElapsedTime(&ms, e0, e1));
    CHECK_STATUS(state.step_status(on));
    return double(ms) / double(o.prefill_reps);
  };
  const double unbounded = time_ms(0), bounded = time_ms(L);
  std::printf(
      "%-10s prefill %lld rows x %lld tokens H%lld/%lld  no bound %9.3f ms (%6.3f M tok/s)  max_query_len %9.3f ms "
      "(%6.3f M tok/s)  x%.1f\n",
      name.c_str(), (long long)R, (long long)L, (long long)H, (long long)Hk, unbounded, double(N) / unbounded * 1e-3,
      bounded, double(N) / bounded * 1e-3, unbounded / bounded);
  if (json != nullptr)
    std::fprintf(json,
                 "{\"bench\":\"kvm_slots_cuda_prefill\",\"budget\":\"%s\",\"rows\":%lld,\"row_tokens\":%lld,"
                 "\"heads\":%lld,\"kv_heads\":%lld,\"reps\":%lld,\"step_ms\":%.6f,\"bounded_step_ms\":%.6f,"
                 "\"tokens_per_s\":%.1f,\"bounded_tokens_per_s\":%.1f}\n",
                 name.c_str(), (long long)R, (long long)L, (long long)H, (long long)Hk, (long long)o.prefill_reps,
                 unbounded, bounded, double(N) / unbounded * 1e3, double(N) / bounded * 1e3);
  CHECK_CUDA(cudaEventDestroy(e0));
  CHECK_CUDA(cudaEventDestroy(e1));
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
    else if (a == "--budget")
      o.budget = argv[i + 1];
    else if (a == "--json")
      o.json = argv[i + 1];
    else if (a == "--prefill-rows")
      o.prefill_rows = std::atoll(argv[i + 1]);
    else if (a == "--prefill-len")
      o.prefill_len = std::max<std::int64_t>(1, std::atoll(argv[i + 1]));
    else if (a == "--prefill-reps")
      o.prefill_reps = std::max<std::int64_t>(1, std::atoll(argv[i + 1]));
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
  const auto bench = o.prefill_rows > 0 ? run_prefill : run;
  if (o.budget.empty() || o.budget == "fixed-256") bench("fixed-256", kvmem::budget::Fixed{}, o, json);
  if (o.budget.empty() || o.budget == "16sqrtN") bench("16sqrtN", kvmem::budget::Power{}, o, json);
  if (json != nullptr) std::fclose(json);
  return 0;
}
