// SPDX-License-Identifier: Apache-2.0
// The llama.cpp anchor of docs/cpu.md: ggml_flash_attn_ext, llama.cpp's CPU attention kernel, on the
// shape of kvmem_bench_kvm_cpu's dense rows (causal prefill, B = 1, 8 heads, D = 128), with f32 Q and
// f16 K, V and mask as llama.cpp calls it. Prints the minimum wall time over the runs and that run's
// process CPU time. Not part of the CMake build (it needs ggml); build it against a ggml checkout:
//
//   cmake -S ggml -B ggml/build -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DBUILD_SHARED_LIBS=OFF
//         -DGGML_BUILD_TESTS=OFF -DGGML_BUILD_EXAMPLES=OFF -DGGML_OPENMP=OFF       (one command)
//   cmake --build ggml/build -j
//   g++ -O3 -march=native benchmarks/ggml/ggml_flash_attn_anchor.cpp -Iggml/include ggml/build/src/libggml.a
//       ggml/build/src/libggml-cpu.a ggml/build/src/libggml-base.a -pthread -lm -o ggml_flash_attn_anchor
//   taskset -c 0,1 ./ggml_flash_attn_anchor 8192 2 3     # T, threads, runs
#include <sys/resource.h>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include "ggml-cpu.h"
#include "ggml.h"
static double cpu_s() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return u.ru_utime.tv_sec + u.ru_stime.tv_sec + 1e-6 * (u.ru_utime.tv_usec + u.ru_stime.tv_usec);
}
int main(int argc, char** argv) {
  const int T = argc > 1 ? atoi(argv[1]) : 4096, threads = argc > 2 ? atoi(argv[2]) : 2,
            reps = argc > 3 ? atoi(argv[3]) : 3;
  const int D = 128, H = 8;
  ggml_init_params ip{size_t(T) * T * 2 + size_t(T) * D * H * 16 + (size_t(256) << 20), nullptr, false};
  ggml_context* ctx = ggml_init(ip);
  ggml_tensor* q = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, D, T, H);
  ggml_tensor* k = ggml_new_tensor_3d(ctx, GGML_TYPE_F16, D, T, H);
  ggml_tensor* v = ggml_new_tensor_3d(ctx, GGML_TYPE_F16, D, T, H);
  ggml_tensor* m = ggml_new_tensor_2d(ctx, GGML_TYPE_F16, T, T);
  std::mt19937 rng(1234);
  std::normal_distribution<float> n01(0.f, 1.f);
  for (int64_t i = 0; i < ggml_nelements(q); ++i) ((float*)q->data)[i] = n01(rng);
  for (int64_t i = 0; i < ggml_nelements(k); ++i) ((ggml_fp16_t*)k->data)[i] = ggml_fp32_to_fp16(n01(rng));
  for (int64_t i = 0; i < ggml_nelements(v); ++i) ((ggml_fp16_t*)v->data)[i] = ggml_fp32_to_fp16(n01(rng));
  for (int i = 0; i < T; ++i)
    for (int j = 0; j < T; ++j)
      ((ggml_fp16_t*)m->data)[size_t(i) * T + j] = ggml_fp32_to_fp16(j <= i ? 0.f : -INFINITY);
  ggml_tensor* out = ggml_flash_attn_ext(ctx, q, k, v, m, 1.0f / std::sqrt(float(D)), 0.f, 0.f);
  ggml_cgraph* gf = ggml_new_graph(ctx);
  ggml_build_forward_expand(gf, out);
  double best = 1e300, best_cpu = 0;
  for (int r = 0; r < reps; ++r) {
    const double c0 = cpu_s();
    const auto t0 = std::chrono::steady_clock::now();
    ggml_graph_compute_with_ctx(ctx, gf, threads);
    const double w = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (w < best) {
      best = w;
      best_cpu = cpu_s() - c0;
    }
  }
  std::printf("ggml_flash_attn_ext T=%d H=%d D=%d threads=%d: min of %d wall %.3f s, cpu %.3f s, out[0]=%g\n", T, H, D,
              threads, reps, best, best_cpu, double(((float*)out->data)[0]));
  ggml_free(ctx);
}
