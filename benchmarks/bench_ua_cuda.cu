// SPDX-License-Identifier: Apache-2.0
// Universal Attention on the CUDA backend at B x H16 x G4 x D128, bf16 storage: dense UA prefill
// (p = 0, ms), chunked prefill with pruning (p = 0.05 / 0.15, ms, kept fraction) and self-pruning decode
// (ms/token over 256 consecutive tokens after that prefill, launched one by one and replayed from one
// captured CUDA graph of the same 256 steps; kept fraction, bytes of the kept cache read per token).
// First it measures the launch floor: an empty kernel launched 256 times back to back, plain and from
// a graph, at <<<1, 32>>> and at the decode launch's shape. Inputs: q ~ 2 N(0,1), unit-norm random
// keys, v ~ N(0,1), gate logits ~ N(m, 1.5) with m = --gate-mean (1 by default). Prints tables and writes
// JSON lines (--json FILE) that benchmarks/gpu_report.py joins with the SDPA anchors.
//
//   kvmem_bench_ua_cuda [--batch 8] [--heads 16] [--kv-heads 4] [--tokens 4096,8192,16384]
//                       [--dense-only 32768] [--pruned-only 1] [--skip-after-tiles N] [--item-group N]
//                       [--prune-rows 4096] [--gate-mean 1] [--storage bf16|fp32|fp8[,...]] [--decode-tc 1]
//                       [--json out.jsonl]
// --storage fp32: fp32 q, k, v and cache (the precision kvmem_bench_kokkos times, for a side-by-side
//   comparison at the same shapes and call). fp8: bf16 q, k, v and an fp8 (e4m3) cache with a scale per
//   row. A list (bf16,fp8) runs each storage in turn in the same call, on the same inputs.
// --dense-only T...: extra lengths where only the dense prefill runs once (one call, B sequences).
// --skip-after-tiles N: UaCacheLimits::dense_skip_past_after_tiles (from which call length the dense prefill
//   takes its kernel with the skip past the decay's reach; 0: always), to measure where it starts to pay.
// --item-group N: UaCacheLimits::dense_item_group (how many items' row tiles the dense prefill hands out
//   together; 0: automatic, from the SM count), to measure its L2 reuse.
// --pruned-only 1: skip the dense (p = 0) rows of --tokens.
// --prune-rows N: UaCacheLimits::dense_prune_rows (rows per launch of the pruned prefill on the dense
//   tensor-core kernel, bf16; 0: the chunked path, as for the other storages), to measure its trade-off.
// --decode-tc 0|1: UaCacheLimits::decode_tensor_cores (bf16 decode of long items on the tensor cores, the
//   default, or on the CUDA cores), to time the two decode passes on the same inputs.
// --gate-mean m: the mean of the key- and query-gate logits. Lower gates decay more slowly, so more rows
//   stay above the threshold: about +1 keeps 0.1-0.6 % of the rows at p = 0.05, -6 about 6 %, -10 about
//   75 % (the kept fractions of trained models). The table prints the kept fraction and the kept bytes
//   each decode step reads beside its time: "kept KV" counts the keys and values of the kept rows (and an
//   fp8 row's two scales), "moved" every byte a step moves per kept row (key, value, scales, λ read and
//   written, key-gate logit, position).

#include "kvmem/backend/cuda/vendor.cuh"

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <string>
#include <vector>

#include "cuda_bench_support.cuh"
#include "kvmem/backend/cuda/ua.cuh"

namespace {

using kvmem::bf16;
using kvmem::TensorView;
using kvmem::bench::Buffer;
using kvmem::bench::fill;

// k / (||k|| + 1e-6), one warp per row (spec UA.md 2: normalised keys)
template <class S>
__global__ void normalise_kernel(S* k, std::int64_t rows, std::int64_t D) {
  using kvmem::cuda::kWarpSize;
  const std::int64_t row = blockIdx.x * std::int64_t(blockDim.x / kWarpSize) + threadIdx.x / kWarpSize;
  if (row >= rows) return;
  float ss = 0;
  for (std::int64_t d = threadIdx.x % kWarpSize; d < D; d += kWarpSize)
    ss += float(k[row * D + d]) * float(k[row * D + d]);
  for (int o = kWarpSize / 2; o > 0; o /= 2) ss += kvmem::cuda::warp_shfl_xor(ss, o);
  const float inv = 1.0f / (sqrtf(ss) + 1e-6f);
  for (std::int64_t d = threadIdx.x % kWarpSize; d < D; d += kWarpSize) k[row * D + d] = S(float(k[row * D + d]) * inv);
}

template <class S>  // S: the input type (an fp8 cache takes bf16)
struct Inputs {     // [B,H,T,D] q, [B,G,T,D] k v, [B,G,T] gates; out [B,T,H,D]
  std::int64_t B, H, G, T, D;
  Buffer<S> q, k, v;
  Buffer<float> zk, zq, out;
  Inputs(std::int64_t b, std::int64_t h, std::int64_t g, std::int64_t t, std::int64_t d, std::uint64_t seed,
         float gate_mean)
      : B(b),
        H(h),
        G(g),
        T(t),
        D(d),
        q(std::size_t(b * h * t * d)),
        k(std::size_t(b * g * t * d)),
        v(std::size_t(b * g * t * d)),
        zk(std::size_t(b * g * t)),
        zq(std::size_t(b * g * t)),
        out(std::size_t(b * t * h * d)) {
    fill(q.ptr, B * H * T * D, seed + 1, 0.0f, 2.0f);
    fill(k.ptr, B * G * T * D, seed + 2, 0.0f, 1.0f);
    constexpr std::int64_t kRowsPerBlock = 256 / kvmem::cuda::kWarpSize;  // a warp per row
    normalise_kernel<<<unsigned((B * G * T + kRowsPerBlock - 1) / kRowsPerBlock), 256>>>(k.ptr, B * G * T, D);
    CHECK_CUDA(cudaGetLastError());
    fill(v.ptr, B * G * T * D, seed + 3, 0.0f, 1.0f);
    fill(zk.ptr, B * G * T, seed + 4, gate_mean, 1.5f);
    fill(zq.ptr, B * G * T, seed + 5, gate_mean, 1.5f);
  }
  kvmem::ua::InputsOf<S> slice(std::int64_t t0, std::int64_t t1) const {
    [[maybe_unused]] const std::int64_t n = t1 - t0;  // used below; nvcc's front end misreports it (#177) here
    kvmem::ua::InputsOf<S> in;
    in.q = {q.ptr + t0 * D, {B, H, n, D}, {H * T * D, T * D, D, 1}};
    in.k = {k.ptr + t0 * D, {B, G, n, D}, {G * T * D, T * D, D, 1}};
    in.v = {v.ptr + t0 * D, {B, G, n, D}, {G * T * D, T * D, D, 1}};
    in.z_k = {zk.ptr + t0, {B, G, n}, {G * T, T, 1}};
    in.z_q = {zq.ptr + t0, {B, G, n}, {G * T, T, 1}};
    return in;
  }
  TensorView<float, 4> out_slice(std::int64_t t0, std::int64_t t1) const {
    return {out.ptr + t0 * H * D, {B, t1 - t0, H, D}, {T * H * D, H * D, D, 1}};
  }
};

struct Timer {
  cudaEvent_t a, b;
  cudaStream_t stream = nullptr;
  Timer() {
    CHECK_CUDA(cudaEventCreate(&a));
    CHECK_CUDA(cudaEventCreate(&b));
  }
  ~Timer() {
    (void)cudaEventDestroy(a);
    (void)cudaEventDestroy(b);
  }
  void start(cudaStream_t s = nullptr) {
    stream = s;
    CHECK_CUDA(cudaEventRecord(a, s));
  }
  float stop_ms() {
    CHECK_CUDA(cudaEventRecord(b, stream));
    CHECK_CUDA(cudaEventSynchronize(b));
    float ms = 0;
    CHECK_CUDA(cudaEventElapsedTime(&ms, a, b));
    return ms;
  }
};

template <class S>
void reset_all(kvmem::cuda::UaCache<S>& cache, std::int64_t B) {
  for (std::int64_t b = 0; b < B; ++b) CHECK_STATUS(cache.reset_sequence(b, nullptr));
  std::vector<std::int64_t> len;
  CHECK_STATUS(cache.lengths(len, nullptr));  // tightens the host bound back to 0
}

template <class S>
double mean_length(kvmem::cuda::UaCache<S>& cache) {
  std::vector<std::int64_t> len;
  CHECK_STATUS(cache.lengths(len, nullptr));
  return double(std::accumulate(len.begin(), len.end(), std::int64_t(0))) / double(len.size());
}

__global__ void empty_kernel() {}

// Microseconds per launch of an empty kernel of the given shape, 256 launches back to back: plain
// (each launch submitted by the host) and replayed from one captured graph of the 256 launches.
std::pair<double, double> launch_floor_us(dim3 grid, unsigned threads, cudaStream_t stream) {
  constexpr int kLaunches = 256;
  Timer timer;
  for (int i = 0; i < kLaunches; ++i) empty_kernel<<<grid, threads, 0, stream>>>();  // warm-up
  CHECK_CUDA(cudaStreamSynchronize(stream));
  timer.start(stream);
  for (int i = 0; i < kLaunches; ++i) empty_kernel<<<grid, threads, 0, stream>>>();
  CHECK_CUDA(cudaGetLastError());
  const double plain = 1e3 * timer.stop_ms() / kLaunches;
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CHECK_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  for (int i = 0; i < kLaunches; ++i) empty_kernel<<<grid, threads, 0, stream>>>();
  CHECK_CUDA(cudaStreamEndCapture(stream, &graph));
  CHECK_CUDA(cudaGraphInstantiate(&exec, graph, 0));
  CHECK_CUDA(cudaGraphLaunch(exec, stream));  // warm-up (uploads the graph)
  CHECK_CUDA(cudaStreamSynchronize(stream));
  timer.start(stream);
  CHECK_CUDA(cudaGraphLaunch(exec, stream));
  const double graphed = 1e3 * timer.stop_ms() / kLaunches;
  CHECK_CUDA(cudaGraphExecDestroy(exec));
  CHECK_CUDA(cudaGraphDestroy(graph));
  return {plain, graphed};
}

// "4096,8192" -> {4096, 8192}; "" -> {}. Anything else is a usage error (the loop must never stall on a
// character strtoll does not consume).
std::vector<std::int64_t> parse_list(const char* s) {
  std::vector<std::int64_t> v;
  for (const char* p = s; *p;) {
    char* end = nullptr;
    v.push_back(std::strtoll(p, &end, 10));
    if (end == p || (*end != ',' && *end != '\0')) {
      std::fprintf(stderr, "kvmem_bench_ua_cuda: expected a comma-separated list of integers, got '%s'\n", s);
      std::exit(2);
    }
    p = *end == ',' ? end + 1 : end;
  }
  return v;
}

// The prefill / decode table of every length in `tokens` (and the dense-only lengths) in storage S.
template <class S>
bool run_all(std::int64_t B, std::int64_t H, std::int64_t G, std::int64_t D, const std::vector<std::int64_t>& tokens,
             const std::vector<std::int64_t>& dense_only, bool pruned_only, const kvmem::cuda::UaCacheLimits& limits,
             const kvmem::cuda::Executor& exec, const kvmem::cuda::Executor& graph_exec, cudaStream_t graph_stream,
             FILE* js, std::int64_t decode_steps, float gate_mean) {
  std::printf(
      "| variant | storage | B | T | p | gate mean | prefill ms | kept after prefill | decode ms/token | decode "
      "ms/token "
      "(graph) | kept after decode | kept KV MB/token | moved MB/token | GB/s moved (graph) |\n");
  std::printf("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
  std::vector<std::pair<std::int64_t, bool>> runs;
  for (auto T : tokens) runs.push_back({T, false});
  for (auto T : dense_only) runs.push_back({T, true});
  // bytes of one kept row: key and value in S (an fp8 row with its two fp32 scales), and what a decode
  // step moves besides: λ read and written, the key-gate logit and the position
  const double kv_row = 2.0 * double(D) * double(sizeof(S)) + (kvmem::is_row_scaled_v<S> ? 8.0 : 0.0);
  const double moved_row = kv_row + 4.0 + 4.0 + 4.0 + 8.0;
  for (const auto& [T, only_dense] : runs) {
    Inputs<kvmem::input_type_t<S>> in(B, H, G, T + decode_steps, D, 1234 + std::uint64_t(T), gate_mean);
    kvmem::cuda::UaCache<S> cache;
    CHECK_STATUS(kvmem::cuda::UaCache<S>::create({B, H, G, D, T + decode_steps, 16}, cache, limits));
    Timer timer;
    for (double p : {0.0, 0.05, 0.15}) {
      if (only_dense && p > 0) break;
      if (pruned_only && !only_dense && p == 0) continue;
      const kvmem::ua::Options opt{p, 128, true};
      const int reps = only_dense ? 1 : 3;
      float prefill_ms = 1e30f;
      for (int rep = 0; rep < reps + (only_dense ? 0 : 1); ++rep) {  // one warm-up unless dense-only
        reset_all(cache, B);
        timer.start();
        CHECK_STATUS(kvmem::cuda::ua_prefill(exec, cache, in.slice(0, T), opt, in.out_slice(0, T)));
        const float ms = timer.stop_ms();
        if (rep > 0 || only_dense) prefill_ms = std::min(prefill_ms, ms);
      }
      const double kept_prefill = mean_length(cache) / double(T);
      double decode_ms = 0, decode_graph_ms = 0, kept_decode = 0, bytes_per_token = 0, moved_per_token = 0;
      if (p > 0) {
        const double before = mean_length(cache);
        timer.start();
        for (std::int64_t t = T; t < T + decode_steps; ++t)
          CHECK_STATUS(kvmem::cuda::ua_decode(exec, cache, in.slice(t, t + 1), opt, in.out_slice(t, t + 1)));
        decode_ms = timer.stop_ms() / double(decode_steps);
        std::vector<std::int64_t> plain_lengths;
        CHECK_STATUS(cache.lengths(plain_lengths, nullptr));
        const double after = mean_length(cache);
        kept_decode = after / double(T + decode_steps);
        // the kept entries of every (sequence, kv head), averaged over the steps
        bytes_per_token = 0.5 * (before + after) * double(B * G) * kv_row;
        moved_per_token = 0.5 * (before + after) * double(B * G) * moved_row;
        // the same 256 steps again from the same prefill, captured once and replayed as one graph
        reset_all(cache, B);
        CHECK_STATUS(kvmem::cuda::ua_prefill(exec, cache, in.slice(0, T), opt, in.out_slice(0, T)));
        CHECK_CUDA(cudaDeviceSynchronize());
        cudaGraph_t graph;
        cudaGraphExec_t graph_run;
        CHECK_CUDA(cudaStreamBeginCapture(graph_stream, cudaStreamCaptureModeThreadLocal));
        for (std::int64_t t = T; t < T + decode_steps; ++t)
          CHECK_STATUS(kvmem::cuda::ua_decode(graph_exec, cache, in.slice(t, t + 1), opt, in.out_slice(t, t + 1)));
        CHECK_CUDA(cudaStreamEndCapture(graph_stream, &graph));
        CHECK_CUDA(cudaGraphInstantiate(&graph_run, graph, 0));
        CHECK_CUDA(cudaGraphUpload(graph_run, graph_stream));
        CHECK_CUDA(cudaStreamSynchronize(graph_stream));
        timer.start(graph_stream);
        CHECK_CUDA(cudaGraphLaunch(graph_run, graph_stream));
        decode_graph_ms = timer.stop_ms() / double(decode_steps);
        CHECK_CUDA(cudaGraphExecDestroy(graph_run));
        CHECK_CUDA(cudaGraphDestroy(graph));
        std::vector<std::int64_t> graph_lengths;
        CHECK_STATUS(cache.lengths(graph_lengths, graph_stream));
        if (graph_lengths != plain_lengths) {
          std::fprintf(stderr, "the graph replay kept other entries than the plain decode\n");
          return false;
        }
      }
      std::printf(
          "| kvmem UA %s | %s | %lld | %lld | %.2f | %g | %.3f | %.4f | %.4f | %.4f | %.4f | %.2f | %.2f | %.0f |\n",
          p > 0 ? "pruned" : "dense", kvmem::type_name<S>(), (long long)B, (long long)T, p, double(gate_mean),
          prefill_ms, kept_prefill, decode_ms, decode_graph_ms, kept_decode, bytes_per_token / 1e6,
          moved_per_token / 1e6, decode_graph_ms > 0 ? moved_per_token / (decode_graph_ms * 1e6) : 0.0);
      std::fflush(stdout);
      if (js)
        std::fprintf(js,
                     "{\"storage\": \"%s\", \"B\": %lld, \"H\": %lld, \"G\": %lld, \"D\": %lld, \"T\": %lld, \"p\": "
                     "%g, \"prefill_ms\": %.5f, "
                     "\"kept_prefill\": %.6f, \"decode_ms\": %.6f, \"decode_graph_ms\": %.6f, \"kept_decode\": %.6f, "
                     "\"kept_bytes\": %.0f, \"moved_bytes\": %.0f, \"gate_mean\": %g}\n",
                     kvmem::type_name<S>(), (long long)B, (long long)H, (long long)G, (long long)D, (long long)T, p,
                     prefill_ms, kept_prefill, decode_ms, decode_graph_ms, kept_decode, bytes_per_token,
                     moved_per_token, double(gate_mean));
    }
  }
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  std::int64_t B = 8, H = 16, G = 4, D = 128;
  std::vector<std::int64_t> tokens = {4096, 8192, 16384}, dense_only;
  const char* json = nullptr;
  bool pruned_only = false;
  std::string storage = "bf16";
  float gate_mean = 1.0f;
  kvmem::cuda::UaCacheLimits limits;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!std::strcmp(argv[i], "--batch"))
      B = std::atoll(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--heads"))
      H = std::atoll(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--kv-heads"))
      G = std::atoll(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--tokens"))
      tokens = parse_list(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--dense-only"))
      dense_only = parse_list(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--pruned-only"))
      pruned_only = std::atoi(argv[i + 1]) != 0;
    else if (!std::strcmp(argv[i], "--skip-after-tiles"))
      limits.dense_skip_past_after_tiles = std::atoi(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--item-group"))
      limits.dense_item_group = std::atoi(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--prune-rows"))
      limits.dense_prune_rows = std::atoll(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--decode-tc"))
      limits.decode_tensor_cores = std::atoi(argv[i + 1]) != 0;
    else if (!std::strcmp(argv[i], "--gate-mean"))
      gate_mean = float(std::atof(argv[i + 1]));
    else if (!std::strcmp(argv[i], "--json"))
      json = argv[i + 1];
    else if (!std::strcmp(argv[i], "--storage"))
      storage = argv[i + 1];
    else {
      std::fprintf(stderr, "unknown option %s\n", argv[i]);
      return 2;
    }
  }
  std::vector<std::string> storages;
  for (std::size_t at = 0; at <= storage.size();) {
    const std::size_t end = std::min(storage.find(',', at), storage.size());
    storages.push_back(storage.substr(at, end - at));
    at = end + 1;
  }
  for (const auto& s : storages)
    if (s != "bf16" && s != "fp32" && s != "fp8") {
      std::fprintf(stderr, "kvmem_bench_ua_cuda: --storage is a list of bf16, fp32 and fp8, got '%s'\n", s.c_str());
      return 2;
    }
  if (kvmem::cuda::device_count() == 0) {
    std::printf("SKIPPED: no CUDA device\n");
    return 0;
  }
  FILE* js = json ? std::fopen(json, "a") : nullptr;
  constexpr std::int64_t kDecodeSteps = 256;
  const kvmem::cuda::Executor exec{};
  // a non-blocking stream: a capture must not make the legacy stream wait on it
  cudaStream_t graph_stream;
  CHECK_CUDA(cudaStreamCreateWithFlags(&graph_stream, cudaStreamNonBlocking));
  const kvmem::cuda::Executor graph_exec{graph_stream};
  {
    const int splits = kvmem::cuda::UaCacheLimits{}.max_splits;
    const auto one = launch_floor_us(dim3(1), 32, graph_stream);
    const auto shaped =
        launch_floor_us(dim3(unsigned(B * G), unsigned(splits)), kvmem::cuda::ua_detail::kDecodeThreads, graph_stream);
    std::printf("| empty kernel (launch floor) | plain us/launch | graph us/launch |\n|---|---|---|\n");
    std::printf("| <<<1, 32>>> | %.2f | %.2f |\n", one.first, one.second);
    std::printf("| <<<(%lld, %d), %d>>> (the decode launch's shape) | %.2f | %.2f |\n\n", (long long)(B * G), splits,
                kvmem::cuda::ua_detail::kDecodeThreads, shaped.first, shaped.second);
  }
  bool ok = true;
  for (const auto& s : storages) {
    if (s == "fp32")
      ok = ok && run_all<float>(B, H, G, D, tokens, dense_only, pruned_only, limits, exec, graph_exec, graph_stream, js,
                                kDecodeSteps, gate_mean);
    else if (s == "fp8")
      ok = ok && run_all<kvmem::e4m3>(B, H, G, D, tokens, dense_only, pruned_only, limits, exec, graph_exec,
                                      graph_stream, js, kDecodeSteps, gate_mean);
    else
      ok = ok && run_all<bf16>(B, H, G, D, tokens, dense_only, pruned_only, limits, exec, graph_exec, graph_stream, js,
                               kDecodeSteps, gate_mean);
    std::printf("\n");
  }
  if (js) std::fclose(js);
  CHECK_CUDA(cudaStreamDestroy(graph_stream));
  return ok ? 0 : 1;
}
