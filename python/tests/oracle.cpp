// SPDX-License-Identifier: Apache-2.0
// kvmem-torch-oracle: the host backend's C++ results for the Python tests of the PyTorch ops. It runs
// ONE sequence through the batch-major C++ API (kvm::prefill / kvm::decode, ua::prefill / ua::decode),
// a different entry point from the slot step the ops call, so a test that serves several sequences
// through torch.ops.kvmem in ragged rows compares each against this run of it alone.
//
//   kvmem-torch-oracle <in.safetensors> <out.safetensors>
//
// Input tensors (F32, token-major): q [T,Hq,D], k [T,Hk,D], v [T,Hk,Dv]; KVM: gate [T,Hk], ln_weight [D],
// ln_bias [D], tau_state [Hq], tau_bswa [Hq]; UA: z_k [T,Hk], z_q [T,Hk]. Metadata (strings):
// mechanism (kvm | ua), prefill (tokens of the first call; the rest are decoded one at a time);
// KVM: chunk, window_chunks, sink, rope_dims, budget_count (a fixed budget); UA: p, prefill_chunk.
// Output: out [T,Hq,Dv] (F64 holding the float results).

#include <cstdio>
#include <string>
#include <vector>

#include "kvmem/backend/host/kvm.hpp"
#include "kvmem/backend/host/ua.hpp"
#include "kvmem/io/safetensors.hpp"
#include "kvmem/kvm/attention.hpp"
#include "kvmem/ua/ops.hpp"

namespace {

using kvmem::Status;
using kvmem::TensorView;

struct Input {
  kvmem::io::SafetensorsFile file;
  Status read(const std::string& name, std::vector<float>& out, std::vector<std::int64_t>& shape) const {
    std::vector<double> d;
    KVMEM_RETURN_IF_ERROR(file.read(name, d, &shape));
    out.assign(d.begin(), d.end());
    return Status::ok();
  }
  std::int64_t meta(const std::string& key) const { return std::stoll(file.metadata().at(key)); }
};

// Token-major [T, H, X] -> batch-major [1, H, T, X] for tokens [t0, t1).
std::vector<float> to_batch_major(const std::vector<float>& x, std::int64_t H, std::int64_t X, std::int64_t t0,
                                  std::int64_t t1) {
  const std::int64_t T = t1 - t0;
  std::vector<float> y(static_cast<std::size_t>(H * T * X));
  for (std::int64_t t = 0; t < T; ++t)
    for (std::int64_t h = 0; h < H; ++h)
      for (std::int64_t i = 0; i < X; ++i)
        y[static_cast<std::size_t>((h * T + t) * X + i)] = x[static_cast<std::size_t>(((t0 + t) * H + h) * X + i)];
  return y;
}

Status run_kvm(const Input& in, std::vector<double>& out_all, std::vector<std::int64_t>& out_shape) {
  std::vector<float> q, k, v, gate, lw, lb, ts, tb;
  std::vector<std::int64_t> qs, ks, vs, s;
  KVMEM_RETURN_IF_ERROR(in.read("q", q, qs));
  KVMEM_RETURN_IF_ERROR(in.read("k", k, ks));
  KVMEM_RETURN_IF_ERROR(in.read("v", v, vs));
  KVMEM_RETURN_IF_ERROR(in.read("gate", gate, s));
  KVMEM_RETURN_IF_ERROR(in.read("ln_weight", lw, s));
  KVMEM_RETURN_IF_ERROR(in.read("ln_bias", lb, s));
  KVMEM_RETURN_IF_ERROR(in.read("tau_state", ts, s));
  KVMEM_RETURN_IF_ERROR(in.read("tau_bswa", tb, s));
  const std::int64_t T = qs[0], Hq = qs[1], D = qs[2], Hk = ks[1], Dv = vs[2], T0 = in.meta("prefill");
  kvmem::kvm::Params p;
  p.chunk = in.meta("chunk");
  p.window_chunks = in.meta("window_chunks");
  p.sink = in.meta("sink");
  p.rope_dims = in.meta("rope_dims");
  p.budget = kvmem::budget::Fixed{in.meta("budget_count")};
  kvmem::kvm::State<float> state;
  KVMEM_RETURN_IF_ERROR(kvmem::kvm::State<float>::create(p, {1, Hq, Hk, D, Dv, T}, state));
  const kvmem::kvm::Weights w{TensorView<const float, 1>(lw.data(), {D}), TensorView<const float, 1>(lb.data(), {D}),
                              TensorView<const float, 1>(ts.data(), {Hq}), TensorView<const float, 1>(tb.data(), {Hq})};
  const kvmem::host::Executor exec{.threads = 1, .exact = true};
  out_shape = {T, Hq, Dv};
  out_all.clear();
  // The prompt in one prefill call, then one decode call per token.
  for (std::int64_t t0 = 0; t0 < T;) {
    const std::int64_t t1 = t0 == 0 ? T0 : t0 + 1, n = t1 - t0;
    const auto qb = to_batch_major(q, Hq, D, t0, t1), kb = to_batch_major(k, Hk, D, t0, t1);
    const auto vb = to_batch_major(v, Hk, Dv, t0, t1), gb = to_batch_major(gate, Hk, 1, t0, t1);
    std::vector<float> o(static_cast<std::size_t>(n * Hq * Dv));  // [1, n, Hq, Dv] = token-major
    KVMEM_RETURN_IF_ERROR(kvmem::kvm::prefill(
        exec, state, w, TensorView<const float, 4>(qb.data(), {1, Hq, n, D}),
        TensorView<const float, 4>(kb.data(), {1, Hk, n, D}), TensorView<const float, 4>(vb.data(), {1, Hk, n, Dv}),
        TensorView<const float, 3>(gb.data(), {1, Hk, n}), TensorView<float, 4>(o.data(), {1, n, Hq, Dv})));
    out_all.insert(out_all.end(), o.begin(), o.end());
    t0 = t1;
  }
  return Status::ok();
}

Status run_ua(const Input& in, std::vector<double>& out_all, std::vector<std::int64_t>& out_shape) {
  std::vector<float> q, k, v, zk, zq;
  std::vector<std::int64_t> qs, ks, s;
  KVMEM_RETURN_IF_ERROR(in.read("q", q, qs));
  KVMEM_RETURN_IF_ERROR(in.read("k", k, ks));
  KVMEM_RETURN_IF_ERROR(in.read("v", v, s));
  KVMEM_RETURN_IF_ERROR(in.read("z_k", zk, s));
  KVMEM_RETURN_IF_ERROR(in.read("z_q", zq, s));
  const std::int64_t T = qs[0], H = qs[1], D = qs[2], G = ks[1], T0 = in.meta("prefill");
  const kvmem::ua::Options opt{std::stod(in.file.metadata().at("p")), in.meta("prefill_chunk"), true};
  kvmem::ua::PrunedCache<float> cache;
  KVMEM_RETURN_IF_ERROR(kvmem::ua::PrunedCache<float>::create({1, H, G, D, T}, cache));
  const kvmem::host::Executor exec{.threads = 1};
  out_shape = {T, H, D};
  out_all.clear();
  for (std::int64_t t0 = 0; t0 < T;) {
    const std::int64_t t1 = t0 == 0 ? T0 : t0 + 1, n = t1 - t0;
    const auto qb = to_batch_major(q, H, D, t0, t1), kb = to_batch_major(k, G, D, t0, t1);
    const auto vb = to_batch_major(v, G, D, t0, t1);
    const auto zkb = to_batch_major(zk, G, 1, t0, t1), zqb = to_batch_major(zq, G, 1, t0, t1);
    const kvmem::ua::Inputs inputs{
        TensorView<const float, 4>(qb.data(), {1, H, n, D}), TensorView<const float, 4>(kb.data(), {1, G, n, D}),
        TensorView<const float, 4>(vb.data(), {1, G, n, D}), TensorView<const float, 3>(zkb.data(), {1, G, n}),
        TensorView<const float, 3>(zqb.data(), {1, G, n}),   {}};
    std::vector<float> o(static_cast<std::size_t>(n * H * D));
    const TensorView<float, 4> ov(o.data(), {1, n, H, D});
    // a one-token call is a decode step, as in ua::step
    KVMEM_RETURN_IF_ERROR(n == 1 ? kvmem::ua::decode(exec, cache, inputs, opt, ov)
                                 : kvmem::ua::prefill(exec, cache, inputs, opt, ov));
    out_all.insert(out_all.end(), o.begin(), o.end());
    t0 = t1;
  }
  return Status::ok();
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: kvmem-torch-oracle <in.safetensors> <out.safetensors>\n");
    return 2;
  }
  Input in;
  Status st = kvmem::io::SafetensorsFile::load(argv[1], in.file);
  std::vector<double> out;
  std::vector<std::int64_t> shape;
  if (st.is_ok()) {
    const std::string mech = in.file.metadata().count("mechanism") ? in.file.metadata().at("mechanism") : "";
    st = mech == "kvm"  ? run_kvm(in, out, shape)
         : mech == "ua" ? run_ua(in, out, shape)
                        : Status(kvmem::StatusCode::kInvalidArgument, "metadata mechanism: expected kvm or ua");
  }
  if (st.is_ok()) {
    kvmem::io::SafetensorsWriter w;
    w.add("out", shape, out);
    st = w.write(argv[2]);
  }
  if (!st.is_ok()) {
    std::fprintf(stderr, "kvmem-torch-oracle: %s\n", st.to_string().c_str());
    return 1;
  }
  return 0;
}
