// SPDX-License-Identifier: Apache-2.0
// Documentation snippet (docs/guide.md "CUDA backend"): KV Means and Universal Attention on a CUDA
// stream, over inputs in device memory. Built with -DKVMEM_CUDA=ON; without a visible device main()
// prints why and ctest reports the test as skipped.

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <vector>

#include "check.hpp"

// [snippet:cuda]
#include <kvmem/backend/cuda.hpp>  // nvcc; CMake: -DKVMEM_CUDA=ON, target kvmem::cuda

constexpr std::int64_t B = 1, Hq = 4, Hk = 2, D = 64, T = 600;

// One KV Means and one Universal Attention layer over a prompt, enqueued on `stream`. Device pointers:
// q [B,Hq,T,D]; unit-norm keys k and values v [B,Hk,T,D]; gate, z_k, z_q [B,Hk,T]; out [B,T,Hq,D].
kvmem::Status run_on_cuda(cudaStream_t stream, const float* q, const float* k, const float* v, const float* gate,
                          const float* z_k, const float* z_q, const kvmem::cuda::KvmWeights& weights, float* out,
                          std::int64_t& kvm_slots, std::vector<std::int64_t>& ua_kept) {
  using kvmem::TensorView;
  const kvmem::cuda::Executor exec{stream};
  const TensorView<const float, 4> qv(q, {B, Hq, T, D}), kv(k, {B, Hk, T, D}), vv(v, {B, Hk, T, D});

  // KV Means: create() allocates the state's device memory once and synchronises the device; prefill
  // and decode enqueue their kernels on the stream and return.
  kvmem::kvm::Params params;
  params.rope_dims = 32;
  kvmem::cuda::KvmState<float> kvm;  // KvmState<kvmem::bf16>: bf16 storage (float or bf16 inputs)
  KVMEM_RETURN_IF_ERROR(kvmem::cuda::KvmState<float>::create(params, {B, Hq, Hk, D, D, /*n_ctx*/ T}, kvm));
  KVMEM_RETURN_IF_ERROR(kvmem::cuda::kvm_prefill(exec, kvm, weights, qv, kv, vv,
                                                 TensorView<const float, 3>(gate, {B, Hk, T}),
                                                 TensorView<float, 4>(out, {B, T, Hq, D})));
  kvm_slots = kvm.slots();  // the token count and |S| are kept on the host, shared by every sequence

  // Universal Attention: the cache's lengths and positions live on the device.
  kvmem::cuda::UaCache<float> cache;  // UaCache<kvmem::bf16> / <kvmem::fp16>: inputs in that type
  KVMEM_RETURN_IF_ERROR(kvmem::cuda::UaCache<float>::create({B, Hq, Hk, D, /*capacity*/ T}, cache));
  const kvmem::cuda::UaInputs<float> in{
      qv, kv, vv, TensorView<const float, 3>(z_k, {B, Hk, T}), TensorView<const float, 3>(z_q, {B, Hk, T}), {}};
  KVMEM_RETURN_IF_ERROR(
      kvmem::cuda::ua_prefill(exec, cache, in, {/*p*/ 0.05}, TensorView<float, 4>(out, {B, T, Hq, D})));
  return cache.lengths(ua_kept, stream);  // kept keys per (sequence, KV head): reads back, synchronises
}
// [snippet-end]

int main() {
  if (kvmem::cuda::device_count() == 0) {
    std::printf("SKIPPED: no CUDA device visible\n");
    return 0;
  }
  std::vector<float> q(B * Hq * T * D), k(B * Hk * T * D), v(B * Hk * T * D), gate(B * Hk * T, 1.5f);
  std::vector<float> z_k(B * Hk * T), z_q(B * Hk * T), ln_w(D, 1.0f), ln_b(D, 0.0f), tau(Hq, 1.0f);
  for (std::size_t i = 0; i < q.size(); ++i) q[i] = std::sin(0.37f * float(i));
  for (std::size_t i = 0; i < k.size(); ++i) k[i] = (i * 31 + i / 64 * 17) % 3 == 0 ? -0.125f : 0.125f;  // unit rows
  for (std::size_t i = 0; i < v.size(); ++i) v[i] = std::sin(0.23f * float(i));
  for (std::size_t i = 0; i < z_k.size(); ++i) {
    z_k[i] = float(i % 5) - 1.0f;
    z_q[i] = float(i % 3);
  }
  // Device copies, owned by kvmem::cuda::DeviceBuffer.
  std::vector<kvmem::cuda::DeviceBuffer> buffers;
  auto upload = [&](const std::vector<float>& host) {
    buffers.emplace_back();
    SNIPPET_CHECK_OK(kvmem::cuda::DeviceBuffer::allocate(host.size() * sizeof(float), buffers.back()));
    SNIPPET_CHECK_OK(kvmem::cuda::to_status(
        cudaMemcpy(buffers.back().get(), host.data(), host.size() * sizeof(float), cudaMemcpyHostToDevice), "upload"));
    return static_cast<float*>(buffers.back().get());
  };
  buffers.reserve(11);
  const float *dq = upload(q), *dk = upload(k), *dv = upload(v), *dg = upload(gate), *dzk = upload(z_k),
              *dzq = upload(z_q);
  const kvmem::cuda::KvmWeights weights{upload(ln_w), upload(ln_b), upload(tau), upload(tau)};
  float* dout = upload(std::vector<float>(B * T * Hq * D, 0.0f));
  cudaStream_t stream = nullptr;
  SNIPPET_CHECK_OK(kvmem::cuda::to_status(cudaStreamCreate(&stream), "cudaStreamCreate"));
  std::int64_t slots = 0;
  std::vector<std::int64_t> kept;
  SNIPPET_CHECK_OK(run_on_cuda(stream, dq, dk, dv, dg, dzk, dzq, weights, dout, slots, kept));
  std::vector<float> out(B * T * Hq * D);
  SNIPPET_CHECK_OK(kvmem::cuda::to_status(
      cudaMemcpy(out.data(), dout, out.size() * sizeof(float), cudaMemcpyDeviceToHost), "download"));
  SNIPPET_CHECK_OK(kvmem::cuda::to_status(cudaStreamDestroy(stream), "cudaStreamDestroy"));
  SNIPPET_CHECK(slots == 256);  // 600 tokens, fixed budget: the first chunk's 256 slots
  SNIPPET_CHECK(kept.size() == std::size_t(B * Hk));
  for (std::int64_t n : kept) SNIPPET_CHECK(n >= 1 && n <= T);
  bool finite = true;
  for (float x : out) finite = finite && std::isfinite(x);
  SNIPPET_CHECK(finite);
  std::printf("KVM: %lld slots; UA: %lld and %lld of %lld keys kept\n", static_cast<long long>(slots),
              static_cast<long long>(kept[0]), static_cast<long long>(kept[1]), static_cast<long long>(T));
  return 0;
}
