// SPDX-License-Identifier: Apache-2.0
// The fp64 reference (include/kvmem/reference/kvm.hpp) against every public KVM golden file:
// output, final state, |S| after every update, append/merge routes (exactly), decode split.
#include <catch2/catch.hpp>

#include "kvm_test_util.hpp"

namespace {
using namespace kvmem::test;
constexpr double kTol = 1e-12;  // fp64 vs fp64 golden (README: reruns agree to <= 1.5e-12)

TEST_CASE("kvm reference matches every public golden file", "[kvm][golden]") {
  const auto files = golden_files("kvm");
  for (const auto& path : files) {
    const Golden g = load_golden(path);
    SECTION(g.name) {
      const auto c = config_from_golden(g);
      const auto in = inputs_from_golden(g);
      const bool has_q = g.config.at("has_q_out").get<bool>();
      const auto r = rkvm::prefill(c, in);
      INFO(g.name);
      if (has_q) {
        KVMEM_CHECK_CLOSE(r.out, g.f64("out"), kTol);
      } else {
        WARN(g.name << ": has_q_out = false, output and decode not checked (state-only case)");
      }
      check_state_and_routes(g, r, kTol);
      if (has_q) {
        const auto split = g.config.at("decode_split").get<std::int64_t>();
        const auto od = rkvm::prefill_then_decode(c, in, split);
        KVMEM_CHECK_CLOSE(od, g.f64("out_decode"), kTol);
        WARN(g.name << " reference: max relative error out " << deviation(r.out, g.f64("out")).relative()
                    << ", out_decode " << deviation(od, g.f64("out_decode")).relative() << ", state_k "
                    << deviation(r.state_k, g.f64("state_k")).relative() << ", state_v "
                    << deviation(r.state_v, g.f64("state_v")).relative());
      }
    }
  }
}
}  // namespace

namespace {
// Backward of the fp64 reference (spec 5) against the golden gradients (has_grads files).
TEST_CASE("kvm reference backward matches the golden gradients", "[kvm][golden]") {
  const auto files = golden_files("kvm");
  for (const auto& path : files) {
    const Golden g = load_golden(path);
    SECTION(g.name) {
      if (!g.config.at("has_grads").get<bool>()) {
        // No gradients to compare; then the file must hold none either (else a check would be lost).
        CHECK_FALSE(g.has("d_q"));
        WARN(g.name << ": has_grads = false, backward not checked");
      } else {
        const auto c = config_from_golden(g);
        const auto in = inputs_from_golden(g);
        const auto gr = rkvm::backward(c, in, g.f64("dout"));
        constexpr double kTolGrad = 1e-10;
        KVMEM_CHECK_CLOSE(gr.dq, g.f64("d_q"), kTolGrad);
        KVMEM_CHECK_CLOSE(gr.dk, g.f64("d_k"), kTolGrad);
        KVMEM_CHECK_CLOSE(gr.dv, g.f64("d_v"), kTolGrad);
        KVMEM_CHECK_CLOSE(gr.dgate, g.f64("d_gate"), kTolGrad);
        KVMEM_CHECK_CLOSE(gr.d_ln_weight, g.f64("d_ln_weight"), kTolGrad);
        KVMEM_CHECK_CLOSE(gr.d_ln_bias, g.f64("d_ln_bias"), kTolGrad);
        KVMEM_CHECK_CLOSE(gr.d_tau_state, g.f64("d_tau_state"), kTolGrad);
        KVMEM_CHECK_CLOSE(gr.d_tau_bswa, g.f64("d_tau_bswa"), kTolGrad);
        WARN(g.name << " reference backward: max relative error d_q " << deviation(gr.dq, g.f64("d_q")).relative()
                    << ", d_k " << deviation(gr.dk, g.f64("d_k")).relative() << ", d_gate "
                    << deviation(gr.dgate, g.f64("d_gate")).relative());
      }
    }
  }
}
}  // namespace
