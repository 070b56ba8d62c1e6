// SPDX-License-Identifier: Apache-2.0
// The host backend against every public KVM golden file.
//  - fp32 storage: out, final state, decode split within 1e-5 relative (golden README rule:
//    max |x - ref| <= 1e-5 max(1, max |ref|)); |S| after every update and routes exactly.
//  - bf16 storage (window k/v and the K^/V^ readout copies in bf16, sums and math in fp32):
//    |S| after every update exactly (data independent). bf16 rounding of the keys can flip routes
//    against the fp64 golden (spec 7.2; append cut-off gaps are ~1e-3, bf16 keeps ~3 digits), and a
//    flipped append changes every later readout, so the golden comparison is split:
//      * against the fp64 reference run on the bf16-rounded k and v (what the bf16 path stores):
//        routes exactly, out and out_decode within the bound below;
//      * against the golden itself: when no route differs, out/out_decode/state within the same
//        bound; the number of differing routes is always printed.
//    Bound: 1e-2 relative Frobenius (DESIGN.md 5); achieved <= 2.8e-3.
#include <catch2/catch.hpp>

#include "kvm_host_util.hpp"

namespace {
using namespace kvmem::test;
constexpr double kTolFp32 = 1e-5;
constexpr double kTolBf16Frobenius = 1e-2;  // DESIGN.md 5; achieved <= 2.8e-3 on the public files

TEST_CASE("kvm host fp32 matches every public golden file", "[kvm][golden]") {
  const auto files = golden_files("kvm");
  for (const auto& path : files) {
    const Golden g = load_golden(path);
    SECTION(g.name) {
      const auto c = config_from_golden(g);
      const auto in = inputs_from_golden(g);
      const bool has_q = g.config.at("has_q_out").get<bool>();
      const auto r = host_prefill<float>(c, in);
      if (has_q) {
        KVMEM_CHECK_CLOSE(r.out, g.f64("out"), kTolFp32);
      } else {
        WARN(g.name << ": has_q_out = false, output and decode not checked (state-only case)");
      }
      check_state_and_routes(g, r, kTolFp32);
      // decision margins of the test hook against the golden's (fp32 vs fp64 logits)
      const double gm = g.f64("route_margin_min").at(0), ga = g.f64("append_margin_min").at(0);
      CHECK(std::abs(r.merge_margin - gm) <= 1e-4 * std::max(1.0, std::abs(gm)));
      CHECK(std::abs(r.append_margin - ga) <= 1e-4 * std::max(1.0, std::abs(ga)));
      if (has_q) {
        const auto split = g.config.at("decode_split").get<std::int64_t>();
        HostResult fin;
        const auto od = host_prefill_then_decode<float>(c, in, split, &fin);
        KVMEM_CHECK_CLOSE(od, g.f64("out_decode"), kTolFp32);
        WARN(g.name << " host fp32: max relative error out " << deviation(r.out, g.f64("out")).relative()
                    << ", out_decode " << deviation(od, g.f64("out_decode")).relative() << ", state_k "
                    << deviation(r.state_k, g.f64("state_k")).relative() << ", state_v "
                    << deviation(r.state_v, g.f64("state_v")).relative());
        // decode reaches the same final state as prefill
        KVMEM_CHECK_CLOSE(fin.state_k, g.f64("state_k"), kTolFp32);
        KVMEM_CHECK_CLOSE(fin.state_v, g.f64("state_v"), kTolFp32);
      }
    }
  }
}

TEST_CASE("kvm host bf16 storage within the documented bound of every public golden file", "[kvm][golden]") {
  const auto files = golden_files("kvm");
  for (const auto& path : files) {
    const Golden g = load_golden(path);
    SECTION(g.name) {
      const auto c = config_from_golden(g);
      const auto in = inputs_from_golden(g);
      const auto r = host_prefill<kvmem::bf16>(c, in);
      std::int64_t flips = 0, total = 0;
      for (std::int64_t u = 1; u <= g.config.at("updates").get<std::int64_t>(); ++u) {
        const auto gm = g.i64("route_merge_u" + std::to_string(u));
        for (std::size_t i = 0; i < gm.size(); ++i) flips += (gm[i] != r.route_merge[std::size_t(u - 1)][i]) ? 1 : 0;
        total += std::int64_t(gm.size());
      }
      WARN(g.name << " bf16: " << flips << " of " << total << " routes differ from the fp64 golden");
      const bool has_q = g.config.at("has_q_out").get<bool>();
      const auto split = g.config.at("decode_split").get<std::int64_t>();
      {  // the fp64 reference on the inputs the bf16 path stores
        auto rin = in;
        for (auto* x : {&rin.k, &rin.v})
          for (auto& e : *x) e = double(float(kvmem::bf16(float(e))));
        const auto ref = rkvm::prefill(c, rin);
        CHECK(r.slots_after_update == ref.slots_after_update);
        for (std::size_t u = 0; u < ref.route_merge.size(); ++u) {
          INFO("update " << u + 1);
          CHECK(r.route_append[u] == ref.route_append[u]);
          CHECK(r.route_merge[u] == ref.route_merge[u]);
        }
        if (has_q) {
          const double e = relative_frobenius(r.out, ref.out);
          INFO(g.name << " bf16 out vs reference(bf16 k, v): relative Frobenius " << e);
          CHECK(e <= kTolBf16Frobenius);
          const double ed = relative_frobenius(host_prefill_then_decode<kvmem::bf16>(c, in, split), ref.out);
          INFO(g.name << " bf16 out_decode vs reference(bf16 k, v): relative Frobenius " << ed);
          CHECK(ed <= kTolBf16Frobenius);
          WARN(g.name << " bf16 vs reference(bf16 k, v): relative Frobenius out " << e << ", out_decode " << ed);
        }
        CHECK(relative_frobenius(r.state_k, ref.state_k) <= kTolBf16Frobenius);
        CHECK(relative_frobenius(r.state_v, ref.state_v) <= kTolBf16Frobenius);
      }
      CHECK(r.slots == g.shape("state_k")[2]);  // |S| is data independent: exact even in bf16
      CHECK(r.slots_after_update == g.i64("slots_after_update"));
      // golden comparison only meaningful with the golden's routing (no early return: a return
      // inside a SECTION would hide the sections of the later files from Catch)
      if (flips == 0) {
        if (has_q) {
          const double e = relative_frobenius(r.out, g.f64("out"));
          INFO(g.name << " bf16 out relative Frobenius " << e);
          CHECK(e <= kTolBf16Frobenius);
          const double ed =
              relative_frobenius(host_prefill_then_decode<kvmem::bf16>(c, in, split), g.f64("out_decode"));
          INFO(g.name << " bf16 out_decode relative Frobenius " << ed);
          CHECK(ed <= kTolBf16Frobenius);
          WARN(g.name << " bf16 vs golden: relative Frobenius out " << e << ", out_decode " << ed);
        }
        CHECK(relative_frobenius(r.state_k, g.f64("state_k")) <= kTolBf16Frobenius);
        CHECK(relative_frobenius(r.state_v, g.f64("state_v")) <= kTolBf16Frobenius);
        CHECK(relative_frobenius(r.state_rho, g.f64("state_rho")) <= kTolBf16Frobenius);
      }
    }
  }
}
}  // namespace
