// SPDX-License-Identifier: Apache-2.0
// Documentation snippet (docs/guide.md "Kokkos backend"): KV Means and Universal Attention on a Kokkos
// execution space, with inputs and outputs in Kokkos::Views. Built with -DKVMEM_KOKKOS=ON. main()
// initialises Kokkos, runs it on the default execution space and checks the result.

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <vector>

#include "check.hpp"

// [snippet:kokkos]
#include <kvmem/backend/kokkos.hpp>  // needs Kokkos; CMake: find_package(kvmem COMPONENTS kokkos), kvmem::kokkos

// One KV Means layer and one Universal Attention layer over a prompt on `space`. Every View lives in
// the space's memory; the KVM state's memory must also be host-accessible (its counters are zeroed
// from the host): kokkos::state_memory_space<Space> is the space's own memory for Serial, OpenMP and
// Threads and unified memory (CudaUVMSpace) for Cuda.
template <class Space>
kvmem::Status run_on_kokkos(const Space& space, std::int64_t& kvm_slots, kvmem::kokkos::UaCacheSnapshot& ua) {
  using Mem = typename Space::memory_space;
  using View4 = Kokkos::View<float****, Kokkos::LayoutRight, Mem>;
  using View3 = Kokkos::View<float***, Kokkos::LayoutRight, Mem>;
  using kvmem::TensorView;
  using kvmem::kokkos::to_tensor_view;
  const std::int64_t B = 1, Hq = 4, Hk = 2, D = 64, T = 600;
  const kvmem::kokkos::Executor<Space> exec{space, /*checked*/ true};  // bad values come back as a Status

  // Inputs (synthetic here): q [B,Hq,T,D], unit-norm keys k and values v [B,Hk,T,D], gates [B,Hk,T].
  View4 q("q", B, Hq, T, D), k("k", B, Hk, T, D), v("v", B, Hk, T, D), out("out", B, T, Hq, D);
  View3 gate("gate", B, Hk, T), z_k("z_k", B, Hk, T), z_q("z_q", B, Hk, T);
  Kokkos::parallel_for(
      "fill", Kokkos::RangePolicy<Space>(space, 0, B * Hk * T), KOKKOS_LAMBDA(const std::int64_t r) {
        const std::int64_t b = r / (Hk * T), g = r / T % Hk, t = r % T;
        for (std::int64_t d = 0; d < D; ++d) {
          k(b, g, t, d) = (t * 31 + d * 17 + g * 5) % 3 == 0 ? -0.125f : 0.125f;  // 64 entries of 1/8: unit norm
          v(b, g, t, d) = float((t * 13 + d * 7) % 19) / 19.0f;
          for (std::int64_t h = g * (Hq / Hk); h < (g + 1) * (Hq / Hk); ++h)
            q(b, h, t, d) = float((t + d * h) % 11) / 11.0f;
        }
        gate(b, g, t) = 1.5f;
        z_k(b, g, t) = float(t % 5) - 1.0f;
        z_q(b, g, t) = float(t % 3);
      });
  Kokkos::View<float*, Mem> ln_w("ln_w", D), ln_b("ln_b", D), tau("tau", Hq);
  Kokkos::deep_copy(space, ln_w, 1.0f);
  Kokkos::deep_copy(space, tau, 1.0f);
  const TensorView<const float, 4> qv(to_tensor_view(q)), kv(to_tensor_view(k)), vv(to_tensor_view(v));

  // KV Means: the state is placed over a Kokkos allocation; kvm::prefill / decode take the executor first.
  kvmem::kvm::Params params;
  params.rope_dims = 32;
  kvmem::kokkos::KvmState<float, float, kvmem::kokkos::state_memory_space<Space>> kvm;
  KVMEM_RETURN_IF_ERROR(kvmem::kokkos::create_state(exec, params, {B, Hq, Hk, D, D, /*n_ctx*/ T}, kvm));
  const kvmem::kvm::Weights weights{
      TensorView<const float, 1>(to_tensor_view(ln_w)), TensorView<const float, 1>(to_tensor_view(ln_b)),
      TensorView<const float, 1>(to_tensor_view(tau)), TensorView<const float, 1>(to_tensor_view(tau))};
  KVMEM_RETURN_IF_ERROR(kvmem::kvm::prefill(exec, kvm.state, weights, qv, kv, vv,
                                            TensorView<const float, 3>(to_tensor_view(gate)), to_tensor_view(out)));

  // Universal Attention: kokkos::UaCache holds the rows in Views; ua::prefill / decode as on the host.
  kvmem::kokkos::UaCache<float, Mem> cache;
  KVMEM_RETURN_IF_ERROR(kvmem::kokkos::create_cache(exec, {B, Hq, Hk, D, /*capacity*/ T}, cache));
  const kvmem::ua::Inputs in{
      qv, kv, vv, TensorView<const float, 3>(to_tensor_view(z_k)), TensorView<const float, 3>(to_tensor_view(z_q)), {}};
  KVMEM_RETURN_IF_ERROR(kvmem::ua::prefill(exec, cache, in, {/*p*/ 0.05}, to_tensor_view(out)));

  space.fence();                        // the operations are asynchronous on the space
  kvm_slots = kvm.state.slots(0);       // host-accessible state: read directly
  ua = kvmem::kokkos::snapshot(cache);  // kept lengths, positions and λ copied to the host
  return kvmem::Status::ok();
}
// [snippet-end]

int main(int argc, char* argv[]) {
  Kokkos::ScopeGuard kokkos(argc, argv);
  std::int64_t slots = 0;
  kvmem::kokkos::UaCacheSnapshot ua;
  SNIPPET_CHECK_OK(run_on_kokkos(Kokkos::DefaultExecutionSpace(), slots, ua));
  SNIPPET_CHECK(slots == 256);  // 600 tokens, fixed budget: the first chunk's 256 slots, merges only
  SNIPPET_CHECK(ua.counter.size() == 1 && ua.counter[0] == 600);
  for (std::int64_t g = 0; g < 2; ++g) {
    std::printf("UA kv head %lld: %lld of 600 keys kept\n", static_cast<long long>(g),
                static_cast<long long>(ua.length_of(0, g)));
    SNIPPET_CHECK(ua.length_of(0, g) >= 1 && ua.length_of(0, g) <= 600);
  }
  return 0;
}
