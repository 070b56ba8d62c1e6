// SPDX-License-Identifier: Apache-2.0
#include <vector>

#include <catch2/catch.hpp>

#include "kvmem/core/status.hpp"
#include "kvmem/core/tensor.hpp"

TEST_CASE("tensor views index row-major and with strides", "[tensor]") {
  std::vector<float> data(2 * 3 * 4);
  for (std::size_t i = 0; i < data.size(); ++i) data[i] = static_cast<float>(i);
  kvmem::TensorView<float, 3> view(data.data(), {2, 3, 4});
  CHECK(view.size() == 24);
  CHECK(view(1, 2, 3) == 23.0f);
  CHECK(view(1, 0, 2) == 14.0f);
  CHECK(view.is_contiguous());
  // a transposed view of the last two axes
  kvmem::TensorView<float, 3> t(data.data(), {2, 4, 3}, {12, 1, 4});
  CHECK(t(1, 3, 2) == view(1, 2, 3));
  CHECK_FALSE(t.is_contiguous());
  kvmem::TensorView<const float, 3> as_const = view;
  CHECK(as_const(0, 1, 1) == 5.0f);
}

TEST_CASE("shape checks name the argument, the expected and the actual shape", "[tensor]") {
  std::vector<float> data(16);
  kvmem::TensorView<float, 2> view(data.data(), {4, 4});
  CHECK(kvmem::check_shape(view, {4, 4}, "q").is_ok());
  const auto status = kvmem::check_shape(view, {4, 8}, "q");
  CHECK(status.code() == kvmem::StatusCode::kInvalidArgument);
  CHECK(status.message() == "q shape: expected [4,8], got [4,4]");
  kvmem::TensorView<float, 2> null_view(nullptr, {4, 4});
  CHECK_THAT(kvmem::check_shape(null_view, {4, 4}, "k").message(), Catch::Contains("nullptr"));
}

TEST_CASE("checked construction rejects bad extents and leaves the target unchanged", "[tensor]") {
  std::vector<float> data(8);
  kvmem::TensorView<float, 2> out(data.data(), {2, 4});
  CHECK_FALSE(kvmem::TensorView<float, 2>::create(data.data(), {-1, 4}, {4, 1}, "v", out).is_ok());
  CHECK_FALSE(kvmem::TensorView<float, 2>::create(nullptr, {2, 4}, {4, 1}, "v", out).is_ok());
  CHECK(out.data() == data.data());
  CHECK(out.extent(0) == 2);
  CHECK(kvmem::TensorView<float, 2>::create(nullptr, {0, 4}, {4, 1}, "v", out).is_ok());
}

TEST_CASE("Error carries the Status", "[status]") {
  const kvmem::Status bad = kvmem::invalid_argument("gate", "values > 0", -1.5);
  CHECK(bad.message() == "gate: expected values > 0, got -1.5");
  CHECK(bad.to_string() == "invalid argument: gate: expected values > 0, got -1.5");
  try {
    kvmem::throw_if_error(bad);
    FAIL("throw_if_error did not throw");
  } catch (const kvmem::Error& e) {
    CHECK(e.status().code() == kvmem::StatusCode::kInvalidArgument);
    CHECK(std::string(e.what()) == bad.to_string());
  }
  CHECK_NOTHROW(kvmem::throw_if_error(kvmem::Status::ok()));
}
