// SPDX-License-Identifier: Apache-2.0
#pragma once
// fp8 (e4m3) UA test inputs: a case whose keys and values are replaced by the values an fp8 cache stores
// for them (each row with its own power-of-two scale, core/numeric.hpp), so the fp64 reference sees
// exactly what the cache holds and a run's only differences from it are fp32 rounding. Storing such a row
// again gives the same values, so the cache's own rounding is then exact.

#include <cstdint>
#include <vector>

#include "kvmem/core/numeric.hpp"
#include "ua_test_support.hpp"

namespace kvmem::test::ua {

// x read back from rows of `width` stored in e4m3 with one scale per row.
inline std::vector<double> fp8_rows(const std::vector<double>& x, std::int64_t width) {
  std::vector<double> y(x.size());
  std::vector<float> row(static_cast<std::size_t>(width));
  std::vector<kvmem::e4m3> q(row.size());
  for (std::size_t r0 = 0; r0 < x.size(); r0 += static_cast<std::size_t>(width)) {
    for (std::size_t d = 0; d < row.size(); ++d) row[d] = static_cast<float>(x[r0 + d]);
    const float scale = kvmem::quantize_row(row.data(), q.data(), width);
    for (std::size_t d = 0; d < row.size(); ++d) y[r0 + d] = static_cast<double>(static_cast<float>(q[d]) * scale);
  }
  return y;
}

// The case with k and v as an fp8 cache stores them (q and the gate logits unchanged).
inline Case fp8_stored(Case c) {
  c.inputs.k = fp8_rows(c.inputs.k, c.config.D);
  c.inputs.v = fp8_rows(c.inputs.v, c.config.D);
  return c;
}

}  // namespace kvmem::test::ua
