// SPDX-License-Identifier: Apache-2.0
// Row batches, slot lists and the exported-slot byte record (core/slots.hpp).
#include <catch2/catch.hpp>

#include <array>
#include <cstddef>
#include <vector>

#include "kvmem/core/slots.hpp"

using kvmem::StatusCode;
namespace rec = kvmem::slot_record;

TEST_CASE("validate_rows accepts ragged rows with padding and refuses bad ones", "[unit][slots]") {
  const std::array<std::int32_t, 4> slot{3, -1, 0, 7};
  const std::array<std::int32_t, 5> start{0, 700, 700, 701, 702};
  CHECK(kvmem::validate_rows(slot.data(), start.data(), 4, 8, 702).is_ok());
  // the packed token count must match the last offset
  CHECK(kvmem::validate_rows(slot.data(), start.data(), 4, 8, 703).code() == StatusCode::kInvalidArgument);
  // a slot beyond max_slots
  CHECK(kvmem::validate_rows(slot.data(), start.data(), 4, 7, 702).code() == StatusCode::kOutOfRange);
  // the same slot in two rows
  const std::array<std::int32_t, 2> twice{2, 2};
  const std::array<std::int32_t, 3> s2{0, 1, 2};
  const auto st = kvmem::validate_rows(twice.data(), s2.data(), 2, 4, 2);
  CHECK(st.code() == StatusCode::kInvalidArgument);
  CHECK(st.message().find("slot[1]") != std::string::npos);
  // decreasing offsets, and a first offset other than 0
  const std::array<std::int32_t, 3> down{0, 5, 4};
  CHECK(kvmem::validate_rows(s2.data(), down.data(), 2, 4, 4).code() == StatusCode::kInvalidArgument);
  const std::array<std::int32_t, 3> late{1, 2, 3};
  CHECK(kvmem::validate_rows(s2.data(), late.data(), 2, 4, 3).code() == StatusCode::kInvalidArgument);
  // a slot index below -1
  const std::array<std::int32_t, 1> neg{-2};
  CHECK(kvmem::validate_rows(neg.data(), s2.data(), 1, 4, 1).code() == StatusCode::kOutOfRange);
}

TEST_CASE("validate_rows: max_query_len bounds every row that names a slot", "[unit][slots]") {
  const std::array<std::int32_t, 3> slot{3, -1, 0};
  const std::array<std::int32_t, 4> start{0, 40, 140, 141};                       // 40 tokens, padding of 100, 1 token
  CHECK(kvmem::validate_rows(slot.data(), start.data(), 3, 8, 141, 0).is_ok());   // 0: no bound
  CHECK(kvmem::validate_rows(slot.data(), start.data(), 3, 8, 141, 40).is_ok());  // padding rows may be longer
  const auto st = kvmem::validate_rows(slot.data(), start.data(), 3, 8, 141, 39);
  CHECK(st.code() == StatusCode::kInvalidArgument);
  CHECK(st.message().find("max_query_len") != std::string::npos);
  CHECK(st.message().find("row 0: 40") != std::string::npos);
  CHECK(kvmem::validate_rows(slot.data(), start.data(), 3, 8, 141, -1).code() == StatusCode::kInvalidArgument);
  // the Rows overload passes its bound on
  using I32 = kvmem::TensorView<const std::int32_t, 1>;
  const kvmem::Rows rows{I32(slot.data(), {3}), I32(start.data(), {4}), 39};
  CHECK(kvmem::validate_rows(rows, 8, 141).code() == StatusCode::kInvalidArgument);
  CHECK(kvmem::validate_rows(kvmem::Rows{rows.slot, rows.query_start}, 8, 141).is_ok());
}

TEST_CASE("copy pairs: destinations distinct and never another pair's source", "[unit][slots]") {
  const std::array<std::int32_t, 2> src{0, 0}, dst{1, 2};
  CHECK(kvmem::check_copy_pairs(src.data(), dst.data(), 2, 4).is_ok());
  const std::array<std::int32_t, 2> dup{1, 1};
  CHECK(kvmem::check_copy_pairs(src.data(), dup.data(), 2, 4).code() == StatusCode::kInvalidArgument);
  const std::array<std::int32_t, 2> chain_src{0, 1}, chain_dst{1, 2};
  CHECK(kvmem::check_copy_pairs(chain_src.data(), chain_dst.data(), 2, 4).code() == StatusCode::kInvalidArgument);
  const std::array<std::int32_t, 1> far{4};
  CHECK(kvmem::check_copy_pairs(far.data(), dst.data(), 1, 4).code() == StatusCode::kOutOfRange);
}

TEST_CASE("slot record: round trip, counted size, refusals name the field", "[unit][slots]") {
  const std::vector<float> data{1.5f, -2.0f, 3.25f};
  auto write = [&](std::span<std::byte> out) {
    rec::Writer w(out, rec::Mechanism::kKvm, 3);
    w.scalar<std::int64_t>("chunk", 256);
    w.scalar<double>("ln_eps", 1e-5);
    w.array("sk", data.data(), 3);
    return w;
  };
  const std::size_t bytes = write({}).size();
  // header 20 bytes; each field: 2 + name + 1 + 8 + data
  CHECK(bytes == 20 + (2 + 5 + 1 + 8 + 8) + (2 + 6 + 1 + 8 + 8) + (2 + 2 + 1 + 8 + 12));
  std::vector<std::byte> buf(bytes);
  REQUIRE(write(buf).fits());

  {
    rec::Reader r(buf, rec::Mechanism::kKvm, 3);
    CHECK(r.expect<std::int64_t>("chunk", 256).is_ok());
    CHECK(r.expect<double>("ln_eps", 1e-5).is_ok());
    std::vector<float> back(3);
    CHECK(r.array("sk", back.data(), 3).is_ok());
    CHECK(back == data);
    CHECK(r.finish().is_ok());
  }
  {  // a parameter that differs
    rec::Reader r(buf, rec::Mechanism::kKvm, 3);
    const auto s = r.expect<std::int64_t>("chunk", 128);
    CHECK(s.code() == StatusCode::kInvalidArgument);
    CHECK(s.message().find("'chunk'") != std::string::npos);
    CHECK_FALSE(r.finish().is_ok());  // the first failure sticks
  }
  {  // the wrong mechanism
    rec::Reader r(buf, rec::Mechanism::kUa, 3);
    CHECK(r.status().message().find("mechanism") != std::string::npos);
  }
  {  // a newer version
    std::vector<std::byte> v = buf;
    v[8] = std::byte{2};
    rec::Reader r(v, rec::Mechanism::kKvm, 3);
    CHECK(r.status().message().find("version") != std::string::npos);
  }
  {  // truncated data
    std::vector<std::byte> t(buf.begin(), buf.end() - 4);
    rec::Reader r(t, rec::Mechanism::kKvm, 3);
    CHECK(r.expect<std::int64_t>("chunk", 256).is_ok());
    CHECK(r.expect<double>("ln_eps", 1e-5).is_ok());
    std::vector<float> back(3);
    CHECK(r.array("sk", back.data(), 3).message().find("truncated") != std::string::npos);
  }
  {  // a buffer too small is reported and nothing is written past it
    std::vector<std::byte> small(bytes - 1, std::byte{0x5a});
    CHECK_FALSE(write(std::span<std::byte>(small.data(), small.size())).fits());
  }
}
