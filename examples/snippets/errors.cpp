// SPDX-License-Identifier: Apache-2.0
// Documentation snippet (docs/guide.md "Errors", docs/errors.md): the two ways to handle a refused call.
// main() checks the codes and the exact messages the documentation quotes, and that a refused call
// left the state as it was.

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "check.hpp"

// [snippet:errors]
#include <kvmem/kvmem.hpp>

#include <cstdio>

// Status style: every operation returns the first problem it finds, before it changes anything.
kvmem::Status make_state(kvmem::kvm::State<float>& state) {
  kvmem::kvm::Params params;
  params.sink = 300;  // must lie below the chunk length, 256
  const kvmem::Status status = kvmem::kvm::State<float>::create(params, {1, 4, 2, 64, 64, 4096}, state);
  if (!status.is_ok())  // status.code() == kvmem::StatusCode::kInvalidArgument
    std::fprintf(stderr, "%s\n", status.to_string().c_str());
  // invalid argument: sink: expected 0 <= sink < chunk = 256 (a merge needs a non-sink slot), got 300
  return status;
}

// Exception style: throw_if_error wraps the same Status in kvmem::Error.
bool make_cache(kvmem::ua::PrunedCache<float>& cache) {
  try {
    kvmem::throw_if_error(
        kvmem::ua::PrunedCache<float>::create({/*B*/ 1, /*H*/ 4, /*G*/ 3, /*D*/ 64, /*capacity*/ 1024}, cache));
    return true;
  } catch (const kvmem::Error& e) {  // e.status() is the Status, e.what() its to_string()
    std::fprintf(stderr, "%s\n", e.what());
    // invalid argument: CacheShape query_heads % kv_heads: expected 0 (GQA groups of equal size), got 1
    return false;
  }
}
// [snippet-end]

int main() {
  using kvmem::TensorView;
  kvmem::kvm::State<float> state;
  const kvmem::Status s = make_state(state);
  SNIPPET_CHECK(s.code() == kvmem::StatusCode::kInvalidArgument);
  SNIPPET_CHECK(s.to_string() ==
                "invalid argument: sink: expected 0 <= sink < chunk = 256 (a merge needs a non-sink slot), got 300");
  SNIPPET_CHECK(!state.valid());  // the output argument is untouched on error

  kvmem::ua::PrunedCache<float> cache;
  SNIPPET_CHECK(!make_cache(cache));
  try {
    kvmem::throw_if_error(kvmem::ua::PrunedCache<float>::create({1, 4, 3, 64, 1024}, cache));
    SNIPPET_CHECK(false);
  } catch (const kvmem::Error& e) {
    SNIPPET_CHECK(std::string(e.what()) ==
                  "invalid argument: CacheShape query_heads % kv_heads: expected 0 (GQA groups of equal size), got 1");
    SNIPPET_CHECK(e.status().code() == kvmem::StatusCode::kInvalidArgument);
  }

  // A NaN in the input and a call past n_ctx are refused, and the state stays as it was (docs/errors.md).
  kvmem::kvm::Params params;
  params.chunk = 4;
  params.rope_dims = 0;
  params.budget = kvmem::budget::Fixed{4, 4};
  const std::int64_t D = 8, T = 6;
  SNIPPET_CHECK_OK(kvmem::kvm::State<float>::create(params, {1, 1, 1, D, D, /*n_ctx*/ 8}, state));
  std::vector<float> x(std::size_t(T * D), 0.5f), g(std::size_t(T), 1.0f), out(std::size_t(T * D));
  std::vector<float> ln_w(D, 1.0f), ln_b(D, 0.0f), tau(1, 1.0f);
  const kvmem::kvm::Weights w{{ln_w.data(), {D}}, {ln_b.data(), {D}}, {tau.data(), {1}}, {tau.data(), {1}}};
  auto prefill = [&](std::int64_t tokens) {
    return kvmem::kvm::prefill(
        kvmem::host::Executor{1}, state, w, TensorView<const float, 4>(x.data(), {1, 1, tokens, D}),
        TensorView<const float, 4>(x.data(), {1, 1, tokens, D}),
        TensorView<const float, 4>(x.data(), {1, 1, tokens, D}), TensorView<const float, 3>(g.data(), {1, 1, tokens}),
        TensorView<float, 4>(out.data(), {1, tokens, 1, D}));
  };
  SNIPPET_CHECK_OK(prefill(T));
  const kvmem::Status too_long = prefill(T);
  SNIPPET_CHECK(too_long.code() == kvmem::StatusCode::kOutOfRange);
  SNIPPET_CHECK(too_long.message() == "sequence 0: 6 + 6 tokens exceed the state's n_ctx = 8");
  x[3] = std::numeric_limits<float>::quiet_NaN();
  const kvmem::Status nan = prefill(1);
  SNIPPET_CHECK(nan.code() == kvmem::StatusCode::kInvalidArgument);
  SNIPPET_CHECK(nan.message() == "q: expected finite values, got NaN or Inf at [0,0,0,3]");
  SNIPPET_CHECK(state.tokens(0) == T);  // both refusals left the state where it was
  return 0;
}
