// SPDX-License-Identifier: Apache-2.0
// Compile-time composition on Kokkos: a user budget policy (tests/kvm/compose_budget.hpp) drives the
// Kokkos KVM kernels through the state's update-target table and matches the fp64 reference, the
// policy's own schedule and the host backend; ua::Attention<Set, Prune> with a rank rule and a
// per-layer threshold runs the Kokkos eviction and matches the reference (outputs, kept sets) and the
// host. Against the host: bitwise on host spaces, within the fp32 tolerance on device spaces
// (kvm_kokkos_util.hpp).

#include <cmath>
#include <cstdint>
#include <vector>

#include <catch2/catch.hpp>

#include "kvm/compose_budget.hpp"
#include "kvm_kokkos_util.hpp"
#include "kvmem/reference/ua.hpp"
#include "ua_kokkos_util.hpp"

using namespace kvmem::test;

TEST_CASE("kokkos kvm with a user budget matches the reference and the host", "[kokkos][kvm][compose]") {
  auto c = small_config(2, 120, 4, 2, 16, 12, kvmem::budget::Any(LogBudget{4.0, 8, 1 << 20}));
  const auto in = random_inputs(c, 29);
  const auto expected = log_budget_schedule(4.0, 8, c.chunk, c.window_chunks, c.T);
  const auto ref = kvmem::reference::kvm::prefill(c, in);
  const auto kk = kokkos_prefill<float>(c, in);
  const auto host = host_prefill<float>(c, in);
  CHECK(kk.slots_after_update == expected);
  CHECK(kk.route_append == ref.route_append);
  CHECK(kk.route_merge == ref.route_merge);
  KVMEM_CHECK_CLOSE(kk.out, ref.out, 2e-5);
  KVMEM_CHECK_CLOSE(kk.state_k, ref.state_k, 2e-5);
  KVMEM_KOKKOS_CHECK_AS_HOST(kk.out, host.out, 1e-5);
  KVMEM_KOKKOS_CHECK_AS_HOST(kk.state_k, host.state_k, 1e-5);
  // decode after a prefill: the same schedule from the table, token by token
  HostResult fin;
  const auto od = kokkos_prefill_then_decode<float>(c, in, 40, &fin);
  CHECK(od == kk.out);
  CHECK(fin.slots_after_update.back() == expected.back());
}

namespace {
// Prefill [0, split) then decode [split, T) through the composed variant Ua on Kokkos.
template <class Ua>
std::vector<float> kokkos_variant(const ua::FloatCase& f, std::int64_t split, const kvmem::ua::Options& opt,
                                  ua::KokkosUaCache& cache) {
  const KokkosExec exec{};
  const ua::KokkosCase kc(f);
  const auto out = kc.make_out();
  auto s = Ua::prefill(exec, cache, kc.slice(0, split), kc.out_slice(out, 0, split), opt);
  INFO(s.to_string());
  REQUIRE(s.is_ok());
  for (std::int64_t t = split; t < f.c.T; ++t) {
    const auto step = Ua::decode(exec, cache, kc.slice(t, t + 1), kc.out_slice(out, t, t + 1), opt);
    INFO(step.to_string());
    REQUIRE(step.is_ok());
  }
  exec.space.fence();
  return to_host(out);
}
template <class Ua>
std::vector<float> host_variant(const ua::FloatCase& f, std::int64_t split, const kvmem::ua::Options& opt) {
  typename Ua::Cache cache(f.cache_shape());
  std::vector<float> out = f.make_out();
  REQUIRE(Ua::prefill(kvmem::host::Executor{1}, cache, f.slice(0, split), f.out_slice(out, 0, split), opt).is_ok());
  for (std::int64_t t = split; t < f.c.T; ++t)
    REQUIRE(Ua::decode(kvmem::host::Executor{1}, cache, f.slice(t, t + 1), f.out_slice(out, t, t + 1), opt).is_ok());
  return out;
}
}  // namespace

TEST_CASE("kokkos ua Attention with prune policies matches the reference and the host", "[kokkos][ua][compose]") {
  ua::Case c = ua::random_case(2, 160, 4, 2, 32, 1234);
  c.config.prefill_chunk = 32;
  c.config.prefill_split = 100;
  const ua::FloatCase f(c);
  const kvmem::ua::Options opt{0.0, 32};
  {
    using Ua = kvmem::ua::Attention<kvmem::decay::Universal, kvmem::prune::KeepTop{24, 0.05}>;
    const auto ref = kvmem::reference::ua::pruned(c.config, c.inputs, 0.05, 24);
    REQUIRE(ref.rank_margin > 1e-4);  // no near-tie at a rank cut on this seed
    auto cache = ua::make_kokkos_cache(KokkosExec{}, f);
    const auto out = kokkos_variant<Ua>(f, 100, opt, cache);
    KVMEM_CHECK_CLOSE(out, ref.out, 1e-5);
    CHECK(ua::kokkos_kept_mask(cache, f.c.T) == ref.kept);
    KVMEM_KOKKOS_CHECK_AS_HOST(out, host_variant<Ua>(f, 100, opt), 1e-5);
  }
  {
    constexpr kvmem::prune::PerLayer kLayers{0.05, 0.15};
    using Ua = kvmem::ua::Attention<kvmem::decay::Universal, kLayers>;
    auto at_layer = opt;
    at_layer.layer = 1;
    const auto ref = kvmem::reference::ua::pruned(c.config, c.inputs, 0.15);
    auto cache = ua::make_kokkos_cache(KokkosExec{}, f);
    const auto out = kokkos_variant<Ua>(f, 100, at_layer, cache);
    KVMEM_CHECK_CLOSE(out, ref.out, 1e-5);
    CHECK(ua::kokkos_kept_mask(cache, f.c.T) == ref.kept);
    KVMEM_KOKKOS_CHECK_AS_HOST(out, host_variant<Ua>(f, 100, at_layer), 1e-5);
  }
}

TEST_CASE("kokkos ua Attention with prune::None keeps every row however far λ falls", "[kokkos][ua][compose]") {
  using Dense = kvmem::ua::Attention<kvmem::decay::Universal, kvmem::prune::None{}>;
  static_assert(!Dense::kEvicts);  // the Kokkos close phase is compiled without its eviction
  ua::Case c = ua::random_case(2, 160, 4, 2, 32, 1234);
  c.config.prefill_chunk = 32;
  c.config.prefill_split = 100;
  const ua::FloatCase f(c);
  // Many keys decay far below any threshold a rule would use: λ < ln 1e-6 at the last token.
  const auto exact = kvmem::reference::ua::dense(c.config, c.inputs);
  std::int64_t far = 0;
  for (const double l : exact.lambda_last) far += l < std::log(1e-6) ? 1 : 0;
  REQUIRE(far > 100);
  const auto ref = kvmem::reference::ua::pruned(c.config, c.inputs, 0.0);
  auto cache = ua::make_kokkos_cache(KokkosExec{}, f);
  const auto out = kokkos_variant<Dense>(f, 100, {0.0, 32}, cache);
  KVMEM_CHECK_CLOSE(out, ref.out, 1e-5);
  const auto kept = ua::kokkos_kept_mask(cache, f.c.T);
  CHECK(kept == std::vector<std::int64_t>(kept.size(), 1));
  // Every row is still there with its exact λ, the far-decayed ones included.
  const auto snap = kvmem::kokkos::snapshot(cache);
  std::vector<double> lambda(kept.size(), 0.0);
  for (std::int64_t b = 0; b < f.c.B; ++b)
    for (std::int64_t g = 0; g < f.c.G; ++g)
      for (std::int64_t e = 0; e < snap.length_of(b, g); ++e)
        lambda[static_cast<std::size_t>((b * f.c.G + g) * f.c.T + snap.positions(b, g)[e])] =
            snap.lambda[static_cast<std::size_t>(snap.item(b, g) * snap.shape.capacity + e)];
  KVMEM_CHECK_CLOSE(lambda, exact.lambda_last, 1e-5);
}
