// SPDX-License-Identifier: Apache-2.0
// KV Means on the CUDA backend: prefill (ms) and decode (ms/token over 256 consecutive tokens, one
// state update included) at B x H32 x D128 bf16 for fixed-256 and 16 sqrt N, plus B = 1 decode
// plain and replayed from a captured CUDA graph. --storage fp32 runs fp32 inputs, state and outputs
// (the precision kvmem_bench_kokkos times, for a side-by-side comparison at the same shapes); --storage fp8
// keeps the memory slots' readout rows in e4m3 with a scale per row (bf16 window, inputs and outputs).
// MB/token is what a decoded token reads of the cache: every visible slot row (K^ and V^, with their
// scales for fp8) and window row once per KV head; GB/s is that over decode_ms. --kv-heads Hk < H
// measures grouped-query attention (H query heads over Hk KV heads; the decode GB/s then count each KV head's rows
// once). Prints a table and writes JSON lines (--json FILE) that benchmarks/gpu_report.py joins with the PyTorch SDPA
// anchor measured in the same run.
//
//   kvmem_bench_kvm_cuda [--batch 8] [--heads 32] [--kv-heads 32] [--tokens 4096,8192,16384,32768] [--json out.jsonl]
//                        [--budget fixed-256|16sqrtN] [--b1 0|1] [--fast-routing 0|1] [--storage bf16|fp32|fp8]
//
// update_ms is the one decode step of the 256 that runs the state update (update + attention);
// --fast-routing 1 routes on single bf16 products (KvmState::set_fast_routing), rows say "+fast".

#include "kvmem/backend/cuda/vendor.cuh"

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "cuda_bench_support.cuh"
#include "kvmem/backend/cuda.hpp"

namespace {

using kvmem::bf16;
using kvmem::TensorView;
using kvmem::bench::fill;

template <class S>
__global__ void gate_kernel(S* x, std::int64_t n) {  // g = 1 + elu(z) > 0
  for (std::int64_t i = blockIdx.x * std::int64_t(blockDim.x) + threadIdx.x; i < n;
       i += std::int64_t(gridDim.x) * blockDim.x) {
    const float z = float(x[i]);
    x[i] = S(z > 0 ? 1 + z : expf(z));
  }
}

struct Buffer {
  void* ptr = nullptr;
  explicit Buffer(std::size_t bytes) { CHECK_CUDA(cudaMalloc(&ptr, std::max<std::size_t>(bytes, 16))); }
  ~Buffer() { (void)cudaFree(ptr); }
  template <class T>
  T* as() const {
    return static_cast<T*>(ptr);
  }
};

struct Row {
  std::string budget;
  std::int64_t batch, heads, kv_heads, tokens, slots;
  double prefill_ms, decode_ms, decode_graph_ms, prefill_tflops, decode_gbps, update_ms, decode_bytes;
};

// S: the storage type; the inputs and outputs are in input_type_t<S> (bf16 for fp8 storage).
template <class S>
Row run(const std::string& name, kvmem::budget::Any budget, std::int64_t B, std::int64_t H, std::int64_t Hk,
        std::int64_t T, bool graph, bool fast_routing) {
  using In = kvmem::input_type_t<S>;
  constexpr std::int64_t kBytes = sizeof(In);
  const std::int64_t D = 128, decode_tokens = 256;
  kvmem::kvm::Params p;  // paper defaults: C = 256, nb = 2, S = 1, r = 64
  p.budget = budget;
  const kvmem::kvm::Shape shape{B, H, Hk, D, D, T + decode_tokens};
  kvmem::cuda::KvmState<S> state;
  CHECK_STATUS(kvmem::cuda::KvmState<S>::create(p, shape, state));
  state.set_fast_routing(fast_routing);
  const std::int64_t n_q = B * H * T * D, n_kv = B * Hk * T * D, n_g = B * Hk * T;
  Buffer q(n_q * kBytes), k(n_kv * kBytes), v(n_kv * kBytes), g(n_g * kBytes), out(n_q * kBytes);
  fill(q.as<In>(), n_q, 1);
  fill(k.as<In>(), n_kv, 2);
  fill(v.as<In>(), n_kv, 3);
  fill(g.as<In>(), n_g, 4);
  gate_kernel<<<1024, 256>>>(g.as<In>(), n_g);
  std::vector<float> ones(std::size_t(std::max(D, H)), 1.0f), zeros(std::size_t(D), 0.0f);
  Buffer w(D * 4), bias(D * 4), ts(H * 4), tw(H * 4);
  CHECK_CUDA(cudaMemcpy(w.ptr, ones.data(), D * 4, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(bias.ptr, zeros.data(), D * 4, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(ts.ptr, ones.data(), H * 4, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(tw.ptr, ones.data(), H * 4, cudaMemcpyHostToDevice));
  const kvmem::cuda::KvmWeights weights{w.as<float>(), bias.as<float>(), ts.as<float>(), tw.as<float>()};
  cudaStream_t stream;
  CHECK_CUDA(cudaStreamCreate(&stream));
  const kvmem::cuda::Executor exec{stream};
  const auto prefill = [&] {
    state.reset();
    CHECK_STATUS(kvmem::cuda::kvm_prefill(
        exec, state, weights, TensorView<const In, 4>(q.as<In>(), {B, H, T, D}),
        TensorView<const In, 4>(k.as<In>(), {B, Hk, T, D}), TensorView<const In, 4>(v.as<In>(), {B, Hk, T, D}),
        TensorView<const In, 3>(g.as<In>(), {B, Hk, T}), TensorView<In, 4>(out.as<In>(), {B, T, H, D})));
  };
  cudaEvent_t e0, e1;
  CHECK_CUDA(cudaEventCreate(&e0));
  CHECK_CUDA(cudaEventCreate(&e1));
  prefill();  // warm-up (module load, shared-memory attributes)
  CHECK_CUDA(cudaStreamSynchronize(stream));
  std::vector<float> times;
  for (int rep = 0; rep < 3; ++rep) {
    CHECK_CUDA(cudaEventRecord(e0, stream));
    prefill();
    CHECK_CUDA(cudaEventRecord(e1, stream));
    CHECK_CUDA(cudaEventSynchronize(e1));
    float ms = 0;
    CHECK_CUDA(cudaEventElapsedTime(&ms, e0, e1));
    times.push_back(ms);
  }
  std::sort(times.begin(), times.end());
  Row row{name, B, H, Hk, T, state.slots(), times[1], 0, 0, 0, 0, 0, 0};
  // attention FLOP of the prefill: 4 D per (query, visible key) per head
  const kvmem::kvm::Geometry geo = p.geometry();
  double keys = 0;
  for (std::int64_t t = 0; t < T; ++t) {
    const std::int64_t wb = geo.bswa_begin(t + 1);
    keys +=
        double(t - wb + 1) + (wb > 0 ? double(kvmem::kvm::slots_after(budget, geo, (t / p.chunk + 1) * p.chunk)) : 0.0);
  }
  row.prefill_tflops = 4.0 * D * keys * double(B * H) / (row.prefill_ms * 1e-3) / 1e12;

  // decode: 256 consecutive tokens after the prefill (the first one runs a state update)
  Buffer q1(B * H * D * kBytes), k1(B * Hk * D * kBytes), v1(B * Hk * D * kBytes), g1(B * Hk * kBytes),
      o1(B * H * D * kBytes);
  fill(q1.as<In>(), B * H * D, 11);
  fill(k1.as<In>(), B * Hk * D, 12);
  fill(v1.as<In>(), B * Hk * D, 13);
  fill(g1.as<In>(), B * Hk, 14, 1.0f, 0.1f);
  const auto step = [&] {
    CHECK_STATUS(kvmem::cuda::kvm_decode(
        exec, state, weights, TensorView<const In, 4>(q1.as<In>(), {B, H, 1, D}),
        TensorView<const In, 4>(k1.as<In>(), {B, Hk, 1, D}), TensorView<const In, 4>(v1.as<In>(), {B, Hk, 1, D}),
        TensorView<const In, 3>(g1.as<In>(), {B, Hk, 1}), TensorView<In, 4>(o1.as<In>(), {B, 1, H, D})));
  };
  cudaEvent_t e_upd;
  CHECK_CUDA(cudaEventCreate(&e_upd));
  prefill();
  CHECK_CUDA(cudaEventRecord(e0, stream));
  for (std::int64_t i = 0; i < decode_tokens; ++i) {
    step();
    if (i == 0) CHECK_CUDA(cudaEventRecord(e_upd, stream));
  }
  CHECK_CUDA(cudaEventRecord(e1, stream));
  CHECK_CUDA(cudaEventSynchronize(e1));
  float ms = 0, upd = 0;
  CHECK_CUDA(cudaEventElapsedTime(&ms, e0, e1));
  CHECK_CUDA(cudaEventElapsedTime(&upd, e0, e_upd));
  row.decode_ms = ms / float(decode_tokens);
  row.update_ms = upd;
  CHECK_CUDA(cudaEventDestroy(e_upd));
  // bytes read per token: every visible slot row (K^, V^ in the storage type, with an fp32 scale each for
  // fp8) and window row (the window type) once per KV head
  const double slot_row = 2.0 * D * double(sizeof(S)) + (kvmem::is_row_scaled_v<S> ? 2.0 * sizeof(float) : 0.0);
  const double window_row = 2.0 * D * double(sizeof(kvmem::kvm::window_t<S>));
  row.decode_bytes = (double(state.slots()) * slot_row + double(p.window()) * window_row) * double(B * Hk);
  row.decode_gbps = row.decode_bytes / (row.decode_ms * 1e-3) / 1e9;
  if (graph) {
    // Replay one decode step (no update inside: the state stays mid-chunk) from a captured graph.
    prefill();
    step();  // position T: runs the update outside the capture
    cudaGraph_t g_;
    cudaGraphExec_t ge;
    CHECK_CUDA(cudaStreamSynchronize(stream));
    const std::int64_t n_before = state.tokens();
    CHECK_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
    step();
    CHECK_CUDA(cudaStreamEndCapture(stream, &g_));
    CHECK_CUDA(cudaGraphInstantiate(&ge, g_, 0));
    (void)n_before;  // the captured step is replayed at a fixed position: a timing of launch costs
    CHECK_CUDA(cudaGraphLaunch(ge, stream));
    CHECK_CUDA(cudaEventRecord(e0, stream));
    for (int i = 0; i < 200; ++i) CHECK_CUDA(cudaGraphLaunch(ge, stream));
    CHECK_CUDA(cudaEventRecord(e1, stream));
    CHECK_CUDA(cudaEventSynchronize(e1));
    CHECK_CUDA(cudaEventElapsedTime(&ms, e0, e1));
    row.decode_graph_ms = ms / 200.0;
    CHECK_CUDA(cudaGraphExecDestroy(ge));
    CHECK_CUDA(cudaGraphDestroy(g_));
  }
  CHECK_CUDA(cudaStreamDestroy(stream));
  return row;
}

}  // namespace

int main(int argc, char** argv) {
  std::int64_t B = 8, H = 32, Hk = 0;  // Hk = 0: as many KV heads as query heads
  std::vector<std::int64_t> tokens{4096, 8192, 16384, 32768};
  const char* json = nullptr;
  bool with_b1 = true, fast = false;
  std::string only_budget, storage = "bf16";
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!std::strcmp(argv[i], "--batch"))
      B = std::atoll(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--b1"))
      with_b1 = std::atoi(argv[i + 1]) != 0;
    else if (!std::strcmp(argv[i], "--fast-routing"))
      fast = std::atoi(argv[i + 1]) != 0;
    else if (!std::strcmp(argv[i], "--budget"))
      only_budget = argv[i + 1];
    else if (!std::strcmp(argv[i], "--heads"))
      H = std::atoll(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--kv-heads"))
      Hk = std::atoll(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--json"))
      json = argv[i + 1];
    else if (!std::strcmp(argv[i], "--storage"))
      storage = argv[i + 1];
    else if (!std::strcmp(argv[i], "--tokens")) {
      tokens.clear();
      for (char* s = argv[i + 1]; *s;) {
        char* end = nullptr;
        tokens.push_back(std::strtoll(s, &end, 10));
        if (end == s || (*end != ',' && *end != '\0')) {  // never stall on a character strtoll leaves
          std::fprintf(stderr, "kvmem_bench_kvm_cuda: --tokens expects integers separated by commas, got '%s'\n",
                       argv[i + 1]);
          return 2;
        }
        s = *end == ',' ? end + 1 : end;
      }
    }
  }
  if (storage != "bf16" && storage != "fp32" && storage != "fp8") {
    std::fprintf(stderr, "kvmem_bench_kvm_cuda: --storage is bf16, fp32 or fp8, got '%s'\n", storage.c_str());
    return 2;
  }
  if (Hk == 0) Hk = H;
  if (Hk < 1 || H % Hk != 0) {
    std::fprintf(stderr, "kvmem_bench_kvm_cuda: --kv-heads must divide --heads (%lld), got %lld\n", (long long)H,
                 (long long)Hk);
    return 2;
  }
  if (kvmem::cuda::device_count() == 0) {
    std::printf("SKIPPED: no CUDA device\n");
    return 0;
  }
  cudaDeviceProp prop;
  CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  std::printf("kvmem KVM CUDA benchmark on %s (%d SMs), %s storage, D=128, C=256, window 512\n", prop.name,
              prop.multiProcessorCount, storage.c_str());
  const auto run_one = storage == "fp32" ? run<float> : storage == "fp8" ? run<kvmem::e4m3> : run<bf16>;
  std::FILE* out = json ? std::fopen(json, "a") : nullptr;
  std::printf("%-14s %3s %3s %3s %6s %6s %11s %11s %11s %9s %9s %9s %9s\n", "budget", "B", "H", "Hk", "T", "slots",
              "prefill_ms", "decode_ms", "graph_ms", "TFLOP/s", "GB/s", "MB/token", "update_ms");
  struct Named {
    const char* name;
    kvmem::budget::Any budget;
  };
  const Named budgets[] = {{"fixed-256", kvmem::budget::Fixed{256}}, {"16sqrtN", kvmem::budget::Power{16.0, 0.5, 256}}};
  std::vector<Row> rows;
  for (const auto& nb : budgets)
    if (only_budget.empty() || only_budget == nb.name)
      for (auto T : tokens)
        rows.push_back(run_one(std::string(nb.name) + (fast ? "+fast" : ""), nb.budget, B, H, Hk, T, false, fast));
  for (const auto& nb : budgets)
    if (with_b1 && (only_budget.empty() || only_budget == nb.name))
      for (auto T : {tokens.front(), tokens.back()})
        rows.push_back(run_one(std::string(nb.name) + (fast ? "+fast" : ""), nb.budget, 1, H, Hk, T, true, fast));
  for (const auto& r : rows) {
    std::printf("%-14s %3lld %3lld %3lld %6lld %6lld %11.3f %11.4f %11.4f %9.1f %9.0f %9.3f %9.4f\n", r.budget.c_str(),
                (long long)r.batch, (long long)r.heads, (long long)r.kv_heads, (long long)r.tokens, (long long)r.slots,
                r.prefill_ms, r.decode_ms, r.decode_graph_ms, r.prefill_tflops, r.decode_gbps, r.decode_bytes / 1e6,
                r.update_ms);
    if (out)
      std::fprintf(out,
                   "{\"mechanism\":\"kvm\",\"storage\":\"%s\",\"budget\":\"%s\",\"B\":%lld,\"H\":%lld,\"Hk\":%lld,"
                   "\"T\":%lld,\"slots\":%lld,"
                   "\"prefill_ms\":%.5f,\"decode_ms\":%.6f,\"decode_graph_ms\":%.6f,\"prefill_tflops\":%.3f,"
                   "\"decode_gbps\":%.1f,\"decode_bytes_per_token\":%.0f,\"update_step_ms\":%.5f}\n",
                   storage.c_str(), r.budget.c_str(), (long long)r.batch, (long long)r.heads, (long long)r.kv_heads,
                   (long long)r.tokens, (long long)r.slots, r.prefill_ms, r.decode_ms, r.decode_graph_ms,
                   r.prefill_tflops, r.decode_gbps, r.decode_bytes, r.update_ms);
  }
  if (out) std::fclose(out);
  return 0;
}
