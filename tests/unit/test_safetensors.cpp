// SPDX-License-Identifier: Apache-2.0
// The safetensors reader on broken inputs; the writer round trip (the golden files: test_safetensors_golden.cpp).
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include <catch2/catch.hpp>

#include "kvmem/io/safetensors.hpp"

namespace {
std::vector<std::uint8_t> image(const std::string& header, std::size_t data_bytes) {
  std::vector<std::uint8_t> bytes(8 + header.size() + data_bytes, 0);
  const std::uint64_t len = header.size();
  std::memcpy(bytes.data(), &len, 8);
  std::memcpy(bytes.data() + 8, header.data(), header.size());
  return bytes;
}
std::string parse_error(std::vector<std::uint8_t> bytes) {
  kvmem::io::SafetensorsFile file;
  const auto status = kvmem::io::SafetensorsFile::parse(std::move(bytes), file);
  REQUIRE_FALSE(status.is_ok());
  return status.message();
}
}  // namespace

TEST_CASE("broken files are rejected with a message naming the problem", "[safetensors]") {
  CHECK_THAT(parse_error({1, 2, 3}), Catch::Contains("truncated"));
  CHECK_THAT(parse_error(image("{\"a\":", 0)), Catch::Contains("not parseable"));
  auto cut = image("{}", 0);
  cut.resize(9);
  CHECK_THAT(parse_error(cut), Catch::Contains("truncated"));
  CHECK_THAT(parse_error(image(R"({"x":{"dtype":"F99","shape":[1],"data_offsets":[0,8]}})", 8)),
             Catch::Contains("unknown dtype"));
  CHECK_THAT(parse_error(image(R"({"x":{"dtype":"F64","shape":[2],"data_offsets":[0,16]}})", 8)),
             Catch::Contains("outside the data buffer"));
  CHECK_THAT(parse_error(image(R"({"x":{"dtype":"F64","shape":[3],"data_offsets":[0,16]}})", 16)),
             Catch::Contains("need 24"));
  CHECK_THAT(parse_error(image(R"({"x":{"dtype":"F64","shape":[-1],"data_offsets":[0,8]}})", 8)),
             Catch::Contains("non-negative"));
  CHECK_THAT(parse_error(image(R"({"x":{"dtype":"F64","shape":[1],"data_offsets":[0,8]},)"
                               R"("y":{"dtype":"F64","shape":[1],"data_offsets":[4,12]}})",
                               16)),
             Catch::Contains("overlaps"));
}

TEST_CASE("writer output reads back and bf16/f32/i32 inputs convert", "[safetensors]") {
  const auto dir = std::filesystem::temp_directory_path() / "kvmem_safetensors_test";
  std::filesystem::create_directories(dir);
  const std::string path = (dir / "round.safetensors").string();
  kvmem::io::SafetensorsWriter writer;
  writer.set_metadata("mechanism", "kvm");
  writer.add("a", {2, 2}, std::vector<double>{1.0, -2.5, 3.25, 1e-300});
  writer.add("b", {3}, std::vector<std::int64_t>{-1, 0, 7});
  writer.add("empty", {1, 0}, std::vector<double>{});
  REQUIRE(writer.write(path).is_ok());
  kvmem::io::SafetensorsFile file;
  REQUIRE(kvmem::io::SafetensorsFile::load(path, file).is_ok());
  std::vector<double> a;
  std::vector<std::int64_t> b, shape;
  REQUIRE(file.read("a", a, &shape).is_ok());
  CHECK(a == std::vector<double>{1.0, -2.5, 3.25, 1e-300});
  CHECK(shape == std::vector<std::int64_t>{2, 2});
  REQUIRE(file.read("b", b).is_ok());
  CHECK(b == std::vector<std::int64_t>{-1, 0, 7});
  CHECK(file.metadata().at("mechanism") == "kvm");
  CHECK_FALSE(file.read("a", b).is_ok());  // dtype family mismatch is an error, not a reinterpretation
  CHECK_THAT(file.read("missing", a).message(), Catch::Contains("missing tensor"));

  // other dtypes as written by torch: bf16 1.5 = 0x3fc0, f32 -0.25, i32 9
  std::string header = R"({"h":{"dtype":"BF16","shape":[1],"data_offsets":[0,2]},)"
                       R"("f":{"dtype":"F32","shape":[1],"data_offsets":[2,6]},)"
                       R"("i":{"dtype":"I32","shape":[1],"data_offsets":[6,10]}})";
  auto bytes = image(header, 10);
  const std::uint16_t h = 0x3fc0;
  const float f = -0.25f;
  const std::int32_t i = 9;
  std::memcpy(bytes.data() + 8 + header.size(), &h, 2);
  std::memcpy(bytes.data() + 8 + header.size() + 2, &f, 4);
  std::memcpy(bytes.data() + 8 + header.size() + 6, &i, 4);
  kvmem::io::SafetensorsFile mixed;
  REQUIRE(kvmem::io::SafetensorsFile::parse(bytes, mixed).is_ok());
  REQUIRE(mixed.read("h", a).is_ok());
  CHECK(a[0] == 1.5);
  REQUIRE(mixed.read("f", a).is_ok());
  CHECK(a[0] == -0.25);
  REQUIRE(mixed.read("i", b).is_ok());
  CHECK(b[0] == 9);
  std::filesystem::remove_all(dir);
}
