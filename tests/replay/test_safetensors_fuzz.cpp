// SPDX-License-Identifier: Apache-2.0
// Random-mutation fuzzing of the safetensors reader (kvmem-replay's only door for untrusted bytes).
// Valid files are mutated (bit flips, byte edits, inserts, deletes, header splices, length-field and
// digit edits, truncation) for a bounded time; parse() must never crash and must either succeed with
// every tensor inside the data buffer and readable, or return a non-ok Status. CI runs this under
// -fsanitize=address,undefined, where an out-of-bounds read fails the run.
//
// KVMEM_FUZZ_SEED and KVMEM_FUZZ_SECONDS (default 10) override the seed and the time budget.
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <random>
#include <string>
#include <vector>

#include <catch2/catch.hpp>

#include "kvmem/io/safetensors.hpp"
#include "replay/replay_test_util.hpp"

namespace {

using kvmem::io::DType;
using kvmem::io::SafetensorsFile;
using Bytes = std::vector<std::uint8_t>;

Bytes synthetic_seed(const kvmem::test::TempDir& dir) {
  kvmem::io::SafetensorsWriter w;
  w.set_metadata("mechanism", "kvm");
  w.set_metadata("config", R"({"B": 1, "T": 3, "budget": {"kind": "fixed", "min": 8}})");
  w.add("a", {2, 3}, std::vector<double>{1, 2, 3, 4, 5, 6});
  w.add("idx", {4}, std::vector<std::int64_t>{-1, 0, 7, 9});
  w.add("empty", {0, 4}, std::vector<double>{});
  const float f[3] = {0.5f, -1.0f, 3.0f};
  w.add_raw("f", "F32", {3}, f, sizeof f);
  const std::uint16_t h[2] = {0x3fc0, 0xc000};
  w.add_raw("h", "BF16", {2}, h, sizeof h);
  w.add_raw("g", "F16", {1, 2}, h, sizeof h);
  const std::uint8_t b[5] = {0, 1, 1, 0, 1};
  w.add_raw("mask", "BOOL", {5}, b, sizeof b);
  const std::int32_t i32[2] = {-5, 6};
  w.add_raw("i32", "I32", {2}, i32, sizeof i32);
  const std::string path = dir.file("seed.safetensors");
  REQUIRE(w.write(path).is_ok());
  return kvmem::test::read_bytes(path);
}

// The length field when it describes a header inside `b`, else 0 (mutants may hold any value).
std::uint64_t header_len(const Bytes& b) {
  if (b.size() < 8) return 0;
  std::uint64_t n;
  std::memcpy(&n, b.data(), 8);
  return n <= b.size() - 8 ? n : 0;
}

bool is_float(DType d) {
  return d == DType::kF64 || d == DType::kF32 || d == DType::kF16 || d == DType::kBF16;
}

// The success half of the property: everything a parsed file claims is inside it and readable.
void check_parsed(const SafetensorsFile& f) {
  for (const auto& t : f.tensors()) {
    REQUIRE(t.begin <= t.end);
    REQUIRE(t.end <= f.data_size());
    REQUIRE(t.end - t.begin == static_cast<std::uint64_t>(t.numel()) * kvmem::io::dtype_size(t.dtype));
    if (is_float(t.dtype)) {
      std::vector<double> v;
      REQUIRE(f.read(t.name, v).is_ok());
      REQUIRE(static_cast<std::int64_t>(v.size()) == t.numel());
      std::vector<std::int64_t> wrong;
      REQUIRE_FALSE(f.read(t.name, wrong).is_ok());
    } else {
      std::vector<std::int64_t> v;
      REQUIRE(f.read(t.name, v).is_ok());
      REQUIRE(static_cast<std::int64_t>(v.size()) == t.numel());
    }
  }
  for (const auto& [k, v] : f.metadata()) REQUIRE(k.size() + v.size() < (std::size_t{1} << 30));
}

class Mutator {
 public:
  Mutator(std::uint64_t seed, std::vector<Bytes> seeds) : rng_(seed), seeds_(std::move(seeds)) {}

  Bytes next() {
    Bytes b = (!last_.empty() && coin(0.2)) ? last_ : seeds_[pick(seeds_.size())];
    const int ops = 1 + static_cast<int>(pick(3));
    for (int i = 0; i < ops; ++i) mutate(b);
    last_ = b;
    return b;
  }

 private:
  std::size_t pick(std::size_t n) { return n == 0 ? 0 : std::uniform_int_distribution<std::size_t>(0, n - 1)(rng_); }
  bool coin(double p) { return std::bernoulli_distribution(p)(rng_); }
  std::uint8_t interesting() {
    static const char kChars[] = "{}[]\":,0123456789-.eE \\ntfu\x00\xff";
    return static_cast<std::uint8_t>(kChars[pick(sizeof kChars - 1)]);
  }
  // A position, biased towards the header where the parser's decisions are.
  std::size_t position(const Bytes& b) {
    const std::uint64_t n = header_len(b);
    if (n > 0 && coin(0.75)) return 8 + pick(n);
    return pick(b.size() + 1);
  }

  void mutate(Bytes& b) {
    switch (pick(9)) {
      case 0:  // bit flip
        if (!b.empty()) {
          const std::size_t p = std::min(position(b), b.size() - 1);
          b[p] ^= static_cast<std::uint8_t>(1u << pick(8));
        }
        break;
      case 1:  // interesting byte
        if (!b.empty()) b[std::min(position(b), b.size() - 1)] = interesting();
        break;
      case 2: {  // insert
        const std::size_t p = std::min(position(b), b.size());
        const std::size_t n = 1 + pick(16);
        Bytes ins(n);
        for (auto& x : ins) x = coin(0.5) ? interesting() : static_cast<std::uint8_t>(pick(256));
        b.insert(b.begin() + static_cast<std::ptrdiff_t>(p), ins.begin(), ins.end());
        break;
      }
      case 3: {  // delete
        if (b.empty()) break;
        const std::size_t p = std::min(position(b), b.size() - 1);
        const std::size_t n = std::min<std::size_t>(1 + pick(16), b.size() - p);
        b.erase(b.begin() + static_cast<std::ptrdiff_t>(p), b.begin() + static_cast<std::ptrdiff_t>(p + n));
        break;
      }
      case 4: {  // splice a fragment of another seed's header over a range of this header
        const Bytes& donor = seeds_[pick(seeds_.size())];
        const std::uint64_t dn = header_len(donor);
        if (dn == 0 || b.size() < 9) break;
        const std::size_t from = 8 + pick(dn), len = 1 + pick(std::min<std::uint64_t>(64, 8 + dn - from));
        const std::size_t at = std::min(position(b), b.size() - 1);
        const std::size_t cut = std::min<std::size_t>(pick(64), b.size() - at);
        b.erase(b.begin() + static_cast<std::ptrdiff_t>(at), b.begin() + static_cast<std::ptrdiff_t>(at + cut));
        b.insert(b.begin() + static_cast<std::ptrdiff_t>(at), donor.begin() + static_cast<std::ptrdiff_t>(from),
                 donor.begin() + static_cast<std::ptrdiff_t>(from + len));
        break;
      }
      case 5: {  // the length field
        if (b.size() < 8) break;
        std::uint64_t n;
        std::memcpy(&n, b.data(), 8);
        switch (pick(4)) {
          case 0:
            n += pick(17) - 8;
            break;
          case 1:
            n = rng_();
            break;
          case 2:
            n = 0;
            break;
          default:
            n = b.size() - 8 - pick(std::min<std::size_t>(b.size() - 8, 64) + 1);
            break;
        }
        std::memcpy(b.data(), &n, 8);
        break;
      }
      case 6:  // truncate
        b.resize(pick(b.size() + 1));
        break;
      case 7: {  // edit a digit of the header: offsets and shapes
        const std::uint64_t n = header_len(b);
        if (n == 0) break;
        for (int tries = 0; tries < 32; ++tries) {
          const std::size_t p = 8 + pick(n);
          if (b[p] >= '0' && b[p] <= '9') {
            if (coin(0.5))
              b[p] = static_cast<std::uint8_t>('0' + pick(10));
            else
              b.insert(b.begin() + static_cast<std::ptrdiff_t>(p), static_cast<std::uint8_t>('0' + pick(10)));
            break;
          }
        }
        break;
      }
      default: {  // duplicate a range somewhere else
        if (b.size() < 2) break;
        const std::size_t from = pick(b.size()), len = 1 + pick(std::min<std::size_t>(32, b.size() - from));
        const Bytes piece(b.begin() + static_cast<std::ptrdiff_t>(from),
                          b.begin() + static_cast<std::ptrdiff_t>(from + len));
        const std::size_t at = position(b);
        b.insert(b.begin() + static_cast<std::ptrdiff_t>(std::min(at, b.size())), piece.begin(), piece.end());
        break;
      }
    }
  }

  std::mt19937_64 rng_;
  std::vector<Bytes> seeds_;
  Bytes last_;
};

std::uint64_t env_or(const char* name, std::uint64_t fallback) {
  const char* v = std::getenv(name);
  return v ? std::strtoull(v, nullptr, 10) : fallback;
}

}  // namespace

TEST_CASE("random mutations never crash the safetensors reader", "[safetensors][fuzz]") {
  kvmem::test::TempDir dir("fuzz");
  std::vector<Bytes> seeds{synthetic_seed(dir)};
  const std::string golden = kvmem::test::golden_case("ua", "ua_g0_analytic");
  if (std::filesystem::exists(golden)) seeds.push_back(kvmem::test::read_bytes(golden));
  for (const auto& s : seeds) {  // the seeds themselves are valid
    SafetensorsFile f;
    REQUIRE(SafetensorsFile::parse(s, f).is_ok());
    check_parsed(f);
  }

  const std::uint64_t seed = env_or("KVMEM_FUZZ_SEED", 20261129);
  const auto budget = std::chrono::seconds(env_or("KVMEM_FUZZ_SECONDS", 10));
  INFO("KVMEM_FUZZ_SEED=" << seed);
  Mutator mutator(seed, seeds);
  const auto start = std::chrono::steady_clock::now();
  std::uint64_t iterations = 0, parsed = 0, rejected = 0;
  const std::string path = dir.file("mutant.safetensors");
  while (std::chrono::steady_clock::now() - start < budget && iterations < 400000) {
    const Bytes b = mutator.next();
    SafetensorsFile f;
    const kvmem::Status status = SafetensorsFile::parse(b, f);
    if (status.is_ok()) {
      ++parsed;
      check_parsed(f);
    } else {
      ++rejected;
      REQUIRE_FALSE(status.message().empty());
      REQUIRE(f.tensors().empty());  // a failed parse leaves the output untouched
    }
    // Now and then through the file paths: load() must agree with parse(), load_header() too.
    if (iterations % 64 == 0) {
      kvmem::test::write_bytes(path, b);
      SafetensorsFile g, h;
      const kvmem::Status loaded = SafetensorsFile::load(path, g);
      REQUIRE(loaded.is_ok() == status.is_ok());
      const kvmem::Status header = SafetensorsFile::load_header(path, h);
      REQUIRE(header.is_ok() == status.is_ok());
      if (header.is_ok()) {
        REQUIRE(h.tensors().size() == f.tensors().size());
        REQUIRE_FALSE(h.data_loaded());
        for (const auto& t : h.tensors()) {
          std::vector<double> v;
          REQUIRE_FALSE(h.read(t.name, v).is_ok());
        }
      }
    }
    ++iterations;
  }
  WARN("fuzz: " << iterations << " mutants (" << parsed << " parsed, " << rejected << " rejected) in "
                << std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() << " s, seed "
                << seed);
  CHECK(iterations >= 1000);
  CHECK(parsed > 0);    // the mutations reach valid files (digit edits in the data, benign header edits)
  CHECK(rejected > 0);  // and broken ones
}

TEST_CASE("hostile headers: deep nesting, huge shapes, overlaps hidden behind empty tensors", "[safetensors][fuzz]") {
  auto parse = [](const std::string& header, std::size_t data) {
    SafetensorsFile f;
    Bytes bytes = kvmem::test::join_image(header, Bytes(data, 0));
    return SafetensorsFile::parse(std::move(bytes), f);
  };
  // a million open brackets must not reach a recursive walk
  CHECK_THAT(parse(std::string(1000000, '['), 0).message(), Catch::Contains("nested deeper"));
  CHECK_THAT(parse(R"({"__metadata__":{"x":)" + std::string(100, '[') + std::string(100, ']') + "}}", 0).message(),
             Catch::Contains("nested deeper"));
  // a shape whose element count overflows
  CHECK_THAT(parse(R"({"x":{"dtype":"F64","shape":[4294967296,4294967296],"data_offsets":[0,8]}})", 8).message(),
             Catch::Contains("too large"));
  // zero-size tensor between two overlapping ones
  CHECK_THAT(parse(R"({"a":{"dtype":"F64","shape":[2],"data_offsets":[0,16]},)"
                   R"("z":{"dtype":"F64","shape":[0],"data_offsets":[4,4]},)"
                   R"("b":{"dtype":"F64","shape":[1],"data_offsets":[8,16]}})",
                   16)
                 .message(),
             Catch::Contains("overlaps"));
  // strings with escapes do not confuse the nesting count; non-string metadata is kept as text
  SafetensorsFile f;
  Bytes ok = kvmem::test::join_image(R"({"__metadata__":{"s":"[[[\"]]]","n":[1,{"a":2}]}})", {});
  REQUIRE(SafetensorsFile::parse(ok, f).is_ok());
  CHECK(f.metadata().at("s") == "[[[\"]]]");
  CHECK(f.metadata().at("n") == R"([1,{"a":2}])");
}
