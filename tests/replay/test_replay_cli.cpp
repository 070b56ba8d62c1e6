// SPDX-License-Identifier: Apache-2.0
// kvmem-replay on bad input and bad options: exit 2, one line on stderr naming the problem, nothing
// on stdout, and no output file (not even a temporary one). Broken files are made here from copies of
// public goldens in a temporary folder. Also unit tests of the tool's comparison and naming rules.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include <catch2/catch.hpp>

#include "replay/replay_test_util.hpp"
#include "replay_core.hpp"
#include "run_ua.hpp"

namespace {

using kvmem::test::TempDir;
namespace fs = std::filesystem;

// The golden inputs, looked up inside the test cases: a missing file fails each case that needs it.
const std::string& kvm_file() {
  static const std::string path = kvmem::test::golden_case("kvm", "kvm_g6_short_t5");
  return path;
}
const std::string& ua_file() {
  static const std::string path = kvmem::test::golden_case("ua", "ua_g0_analytic");
  return path;
}

int count_lines(const std::string& s) {
  return static_cast<int>(std::count(s.begin(), s.end(), '\n'));
}

// Runs the tool on `input` with `extra` options, writing to <dir>/out.safetensors, and checks the
// bad-input contract. Returns stderr.
std::string expect_bad(const TempDir& dir, const std::string& input, std::vector<std::string> extra,
                       const std::string& message) {
  const std::string out = dir.file("out.safetensors");
  const auto before = dir.entries();
  std::vector<std::string> args;
  if (!input.empty()) args.push_back(input);
  args.insert(args.end(), {"-o", out});
  args.insert(args.end(), extra.begin(), extra.end());
  const auto run = kvmem::test::run_tool(args, dir.path());
  INFO("stderr: " << run.err << "stdout: " << run.out);
  CHECK(run.rc == 2);
  CHECK_THAT(run.err, Catch::Contains(message));
  CHECK_THAT(run.err, Catch::Contains("kvmem-replay: error: "));
  // exactly one error line, and it is the last line
  CHECK(run.err.find("error:") == run.err.rfind("error:"));
  CHECK(run.err.rfind("kvmem-replay: error: ") == run.err.rfind('\n', run.err.size() - 2) + 1);
  CHECK(run.out.empty());
  CHECK_FALSE(fs::exists(out));
  CHECK(dir.entries() == before);  // no temporary file left behind
  return run.err;
}

std::string edited(const TempDir& dir, const std::string& golden, const std::string& name,
                   const std::function<void(nlohmann::json&)>& edit) {
  const std::string path = dir.file(name);
  kvmem::test::edited_copy(golden, path, edit);
  return path;
}

}  // namespace

TEST_CASE("bad options exit 2 with one line naming the option", "[replay][cli]") {
  TempDir dir("options");
  const auto err = expect_bad(dir, "", {}, "no input file");
  CHECK(count_lines(err) == 1);
  {
    const auto run = kvmem::test::run_tool({kvm_file()}, dir.path());
    CHECK(run.rc == 2);
    CHECK_THAT(run.err, Catch::Contains("no output file"));
  }
  expect_bad(dir, kvm_file(), {"--bogus"}, "unknown option '--bogus'");
  expect_bad(dir, kvm_file(), {"--backend", "tpu"}, "--backend: expected reference, host, kokkos or cuda, got 'tpu'");
  expect_bad(dir, kvm_file(), {"--backend=gpu"}, "got 'gpu'");
  expect_bad(dir, kvm_file(), {"--precision", "fp8"}, "--precision: expected fp32 or bf16, got 'fp8'");
  expect_bad(dir, kvm_file(), {"--threads", "0"}, "--threads: expected an integer >= 1, got '0'");
  expect_bad(dir, kvm_file(), {"--threads", "two"}, "got 'two'");
  expect_bad(dir, kvm_file(), {"--threads", "-3"}, "got '-3'");
  expect_bad(dir, kvm_file(), {"--backend", "reference", "--precision", "bf16"},
             "reference backend computes in float64");
  expect_bad(dir, kvm_file(), {"--threads"}, "option --threads needs a value");
  expect_bad(dir, kvm_file(), {ua_file()}, "more than one input file");
  expect_bad(dir, kvm_file(), {"--config", dir.file("absent.json")}, "cannot open file");
  kvmem::test::write_text(dir.file("bad.json"), "{\"T\": ");
  expect_bad(dir, kvm_file(), {"--config", dir.file("bad.json")}, "is not valid JSON");
  kvmem::test::write_text(dir.file("array.json"), "[1, 2]");
  expect_bad(dir, kvm_file(), {"--config", dir.file("array.json")}, "is not a JSON object");
  kvmem::test::write_text(dir.file("mech.json"), "{\"mechanism\": 3}");
  expect_bad(dir, kvm_file(), {"--config", dir.file("mech.json")}, "'mechanism' must be a string");

  const auto help = kvmem::test::run_tool({"--help"}, dir.path());
  CHECK(help.rc == 0);
  CHECK_THAT(help.out, Catch::Contains("usage: kvmem-replay CASE.safetensors -o OUT.safetensors"));
  CHECK_THAT(help.out, Catch::Contains("bf16 3e-2"));  // the bf16 tolerance is stated
}

// Which GPU backends this kvmem-replay has is a build property (KVMEM_REPLAY_HAVE_<BACKEND>_<MECH>,
// from examples/replay/CMakeLists.txt): a built one must run the case, an absent one must answer
// "not built" with exit 2 and write nothing.
void expect_backend(const TempDir& dir, const std::string& input, const std::string& backend, bool built) {
  INFO("backend " << backend << ", input " << input << (built ? " (built in)" : " (not built in)"));
  if (!built) {
    expect_bad(dir, input, {"--backend", backend}, "backend " + backend + " is not built into this kvmem-replay");
    return;
  }
  const std::string out = dir.file(backend + "_out.safetensors");
  fs::remove(out);
  const auto run = kvmem::test::run_tool({input, "-o", out, "--backend", backend, "--quiet"}, dir.path());
  INFO("stderr: " << run.err << "stdout: " << run.out);
  CHECK(run.rc == 0);
  CHECK_THAT(run.err, !Catch::Contains("not built"));
  CHECK_THAT(run.out, Catch::Contains("(backend " + backend + ", fp32)"));
  CHECK_THAT(run.out, !Catch::Contains("FAIL"));
  REQUIRE(fs::exists(out));
  kvmem::io::SafetensorsFile f;
  REQUIRE(kvmem::io::SafetensorsFile::load(out, f).is_ok());
  CHECK(f.metadata().at("backend") == backend);
  CHECK(f.has("out"));
}

TEST_CASE("kokkos and cuda run when built in and otherwise answer that they are not", "[replay][cli]") {
  TempDir dir("gpu");
  expect_backend(dir, kvm_file(), "kokkos", KVMEM_REPLAY_HAVE_KOKKOS_KVM);
  expect_backend(dir, ua_file(), "kokkos", KVMEM_REPLAY_HAVE_KOKKOS_UA);
  expect_backend(dir, kvm_file(), "cuda", KVMEM_REPLAY_HAVE_CUDA_KVM);
  expect_backend(dir, ua_file(), "cuda", KVMEM_REPLAY_HAVE_CUDA_UA);
}

#if !KVMEM_REPLAY_HAVE_KOKKOS_KVM && !KVMEM_REPLAY_HAVE_KOKKOS_UA
TEST_CASE("a build without kokkos says how to get it", "[replay][cli]") {
  TempDir dir("gpu_hint");
  // Either Kokkos is not configured, or it is but the tool has no adapter for the mechanism.
  const auto err =
      expect_bad(dir, ua_file(), {"--backend", "kokkos"}, "backend kokkos is not built into this kvmem-replay");
  const bool configure_hint = err.find("-DKVMEM_KOKKOS=ON") != std::string::npos;
  const bool adapter_hint = err.find("has no Kokkos ua adapter") != std::string::npos;
  CHECK((configure_hint || adapter_hint));
}
#endif

TEST_CASE("missing, unreadable and truncated files", "[replay][cli]") {
  TempDir dir("truncated");
  expect_bad(dir, dir.file("absent.safetensors"), {}, "does not exist");
  fs::create_directories(dir.path() / "folder.safetensors");
  expect_bad(dir, dir.file("folder.safetensors"), {}, "not a regular file");

  const auto bytes = kvmem::test::read_bytes(kvm_file());
  auto cut = [&](std::size_t n) {
    const std::string path = dir.file("cut" + std::to_string(n) + ".safetensors");
    kvmem::test::write_bytes(path,
                             std::vector<std::uint8_t>(bytes.begin(), bytes.begin() + static_cast<std::ptrdiff_t>(n)));
    return path;
  };
  expect_bad(dir, cut(0), {}, "truncated file: 0 bytes");
  expect_bad(dir, cut(5), {}, "truncated file: 5 bytes");
  expect_bad(dir, cut(100), {}, "truncated file: header of");             // inside the header
  expect_bad(dir, cut(bytes.size() - 1), {}, "outside the data buffer");  // inside the data
  expect_bad(dir, cut(bytes.size() / 2), {}, "(truncated file?)");
}

TEST_CASE("header JSON that does not parse", "[replay][cli]") {
  TempDir dir("json");
  auto bytes = kvmem::test::read_bytes(kvm_file());
  REQUIRE(bytes[8] == '{');
  bytes[8] = '#';
  kvmem::test::write_bytes(dir.file("hash.safetensors"), bytes);
  expect_bad(dir, dir.file("hash.safetensors"), {}, "header JSON is not parseable");

  bytes = kvmem::test::read_bytes(kvm_file());
  const std::uint64_t huge = std::uint64_t{1} << 62;
  std::memcpy(bytes.data(), &huge, 8);
  kvmem::test::write_bytes(dir.file("len.safetensors"), bytes);
  expect_bad(dir, dir.file("len.safetensors"), {}, "exceeds the limit");

  const std::string nested = std::string(200, '[') + std::string(200, ']');
  kvmem::test::write_bytes(dir.file("deep.safetensors"), kvmem::test::join_image(nested, {}));
  expect_bad(dir, dir.file("deep.safetensors"), {}, "not parseable");

  kvmem::test::write_bytes(dir.file("array.safetensors"), kvmem::test::join_image("[1,2]", {}));
  expect_bad(dir, dir.file("array.safetensors"), {}, "header JSON is not an object");
}

TEST_CASE("offsets outside the file, overlaps and unknown dtypes", "[replay][cli]") {
  TempDir dir("offsets");
  const auto outside = edited(dir, kvm_file(), "outside.safetensors", [](nlohmann::json& h) {
    auto& off = h["v"]["data_offsets"];
    const auto span = off[1].get<std::uint64_t>() - off[0].get<std::uint64_t>();
    off[0] = std::uint64_t{1} << 40;
    off[1] = (std::uint64_t{1} << 40) + span;
  });
  expect_bad(dir, outside, {}, "tensor 'v': data_offsets [1099511627776");
  expect_bad(dir, outside, {}, "outside the data buffer");

  const auto reversed = edited(dir, kvm_file(), "reversed.safetensors", [](nlohmann::json& h) {
    auto& off = h["gate"]["data_offsets"];
    const auto b = off[0];
    off[0] = off[1];
    off[1] = b;
  });
  expect_bad(dir, reversed, {}, "end before they begin");

  const auto overlap = edited(dir, kvm_file(), "overlap.safetensors",
                              [](nlohmann::json& h) { h["ln_bias"]["data_offsets"] = h["ln_weight"]["data_offsets"]; });
  expect_bad(dir, overlap, {}, "overlaps");

  const auto dtype = edited(dir, kvm_file(), "dtype.safetensors", [](nlohmann::json& h) { h["q"]["dtype"] = "F80"; });
  expect_bad(dir, dtype, {}, "tensor 'q': unknown dtype 'F80'");

  const auto integer =
      edited(dir, kvm_file(), "int.safetensors", [](nlohmann::json& h) { h["gate"]["dtype"] = "I64"; });
  expect_bad(dir, integer, {}, "tensor 'gate' has an integer dtype");

  const auto size = edited(dir, ua_file(), "size.safetensors", [](nlohmann::json& h) { h["z_k"]["dtype"] = "F32"; });
  expect_bad(dir, size, {}, "tensor 'z_k': data_offsets span 128 bytes but the shape and dtype need 64");
}

TEST_CASE("shapes that disagree with the config and missing tensors", "[replay][cli]") {
  TempDir dir("shapes");
  // Same byte count, different shape: the reader accepts it, the config check must not.
  const auto reshaped = edited(dir, kvm_file(), "reshaped.safetensors", [](nlohmann::json& h) {
    h["k"]["shape"] = {1, 2, 10, 8};
  });
  expect_bad(dir, reshaped, {},
             "tensor 'k' has shape [1,2,10,8] but the config (B=1, Hk=2, T=5, D=16) calls for [1,2,5,16]");

  kvmem::test::write_text(dir.file("t4.json"), R"({"T": 4})");
  expect_bad(dir, kvm_file(), {"--config", dir.file("t4.json")}, "tensor 'q' has shape [1,2,5,16]");
  kvmem::test::write_text(dir.file("g2.json"), R"({"G": 2})");
  expect_bad(dir, ua_file(), {"--config", dir.file("g2.json")}, "tensor 'k' has shape [1,1,16,4]");

  const auto no_v = edited(dir, kvm_file(), "no_v.safetensors", [](nlohmann::json& h) { h.erase("v"); });
  expect_bad(dir, no_v, {}, "missing tensor 'v'");
  const auto no_zq = edited(dir, ua_file(), "no_zq.safetensors", [](nlohmann::json& h) { h.erase("z_q"); });
  expect_bad(dir, no_zq, {}, "missing tensor 'z_q'");
  const auto no_tau = edited(dir, kvm_file(), "no_tau.safetensors", [](nlohmann::json& h) { h.erase("tau_bswa"); });
  expect_bad(dir, no_tau, {}, "missing tensor 'tau_bswa'");
}

TEST_CASE("unknown mechanism and broken configurations", "[replay][cli]") {
  TempDir dir("config");
  const auto mech =
      edited(dir, kvm_file(), "mech.safetensors", [](nlohmann::json& h) { h["__metadata__"]["mechanism"] = "kvx"; });
  expect_bad(dir, mech, {}, "unknown mechanism 'kvx' (known: kvm, ua)");
  const auto no_mech =
      edited(dir, kvm_file(), "nomech.safetensors", [](nlohmann::json& h) { h["__metadata__"].erase("mechanism"); });
  expect_bad(dir, no_mech, {}, "metadata has no 'mechanism'");
  const auto no_meta = edited(dir, ua_file(), "nometa.safetensors", [](nlohmann::json& h) { h.erase("__metadata__"); });
  expect_bad(dir, no_meta, {}, "metadata has no 'mechanism'");
  const auto no_cfg =
      edited(dir, kvm_file(), "nocfg.safetensors", [](nlohmann::json& h) { h["__metadata__"].erase("config"); });
  expect_bad(dir, no_cfg, {}, "metadata has no 'config'");
  const auto bad_cfg = edited(dir, kvm_file(), "badcfg.safetensors",
                              [](nlohmann::json& h) { h["__metadata__"]["config"] = "{\"B\": 1,"; });
  expect_bad(dir, bad_cfg, {}, "metadata 'config' is not valid JSON");

  auto with = [&](const std::string& golden, const std::string& name,
                  const std::function<void(nlohmann::json&)>& edit) {
    return edited(dir, golden, name, [&](nlohmann::json& h) { kvmem::test::edit_config(h, edit); });
  };
  expect_bad(dir, with(kvm_file(), "noT.safetensors", [](nlohmann::json& c) { c.erase("T"); }), {},
             "config: missing key 'T'");
  expect_bad(dir, with(kvm_file(), "strT.safetensors", [](nlohmann::json& c) { c["T"] = "5"; }), {},
             "'T' must be an integer");
  expect_bad(dir, with(kvm_file(), "negB.safetensors", [](nlohmann::json& c) { c["B"] = -1; }), {},
             "'B' must lie in [1,");
  expect_bad(dir, with(kvm_file(), "hq.safetensors", [](nlohmann::json& c) { c["Hq"] = 3; }), {},
             "must be a multiple of 'Hk'");
  expect_bad(dir, with(kvm_file(), "sink.safetensors", [](nlohmann::json& c) { c["sink"] = 8; }), {},
             "'sink' must lie in [0, 7]");
  expect_bad(dir, with(kvm_file(), "kind.safetensors", [](nlohmann::json& c) { c["budget"]["kind"] = "linear"; }), {},
             "config.budget: 'kind' must be fixed, power or saturating, got 'linear'");
  expect_bad(dir, with(kvm_file(), "nobudget.safetensors", [](nlohmann::json& c) { c.erase("budget"); }), {},
             "missing key 'budget'");
  expect_bad(dir, with(kvm_file(), "flag.safetensors", [](nlohmann::json& c) { c["head_temps"] = 1; }), {},
             "'head_temps' must be true or false");
  expect_bad(dir, with(kvm_file(), "split.safetensors", [](nlohmann::json& c) { c["decode_split"] = 6; }), {},
             "'decode_split' must lie in [-1, 5]");
  expect_bad(dir,
             with(ua_file(), "th.safetensors",
                  [](nlohmann::json& c) {
                    c["thresholds"] = {0.05, 1.5};
                  }),
             {}, "every entry of 'thresholds' must be a number in (0, 1), got 1.5");
  expect_bad(dir,
             with(ua_file(), "thdup.safetensors",
                  [](nlohmann::json& c) {
                    c["thresholds"] = {0.05, 0.0501};
                  }),
             {}, "name the same output twice (p005)");
  expect_bad(dir,
             with(ua_file(), "gates.safetensors",
                  [](nlohmann::json& c) {
                    c["gates"] = {"query", "key"};
                  }),
             {}, "'gates' must be");
  expect_bad(dir, with(ua_file(), "scale.safetensors", [](nlohmann::json& c) { c["scale"] = 0.5; }), {},
             "'scale' = 0.5 is not supported");
  expect_bad(dir, with(ua_file(), "psplit.safetensors", [](nlohmann::json& c) { c["prefill_split"] = 17; }), {},
             "'prefill_split' must lie in [-1, 16]");
}

TEST_CASE("a failed run leaves an existing output file untouched", "[replay][cli]") {
  TempDir dir("untouched");
  const std::string out = dir.file("out.safetensors");
  kvmem::test::write_text(out, "previous results");
  auto bytes = kvmem::test::read_bytes(ua_file());
  REQUIRE(bytes.size() > 8);
  bytes.erase(bytes.end() - 8, bytes.end());  // drop the last 8 bytes (erase: no grow path for GCC to misjudge)
  kvmem::test::write_bytes(dir.file("cut.safetensors"), bytes);
  const auto run = kvmem::test::run_tool({dir.file("cut.safetensors"), "-o", out}, dir.path());
  CHECK(run.rc == 2);
  CHECK(kvmem::test::slurp(out) == "previous results");
}

#if KVMEM_REPLAY_HAVE_REFERENCE_KVM
TEST_CASE("an output folder that does not exist is an error after the run, with nothing written", "[replay][cli]") {
  TempDir dir("nofolder");
  const std::string out = dir.file("missing/out.safetensors");
  const auto run = kvmem::test::run_tool({kvm_file(), "-o", out, "--backend", "reference", "--quiet"}, dir.path());
  CHECK(run.rc == 2);
  CHECK_THAT(run.err, Catch::Contains("cannot open for writing"));
  CHECK(run.out.empty());  // no comparison lines for results that were not saved
  CHECK_FALSE(fs::exists(dir.path() / "missing"));
}
#endif

#if KVMEM_REPLAY_HAVE_REFERENCE_KVM && KVMEM_REPLAY_HAVE_HOST_KVM
TEST_CASE("non-finite inputs are rejected by every backend before anything is written", "[replay][cli]") {
  TempDir dir("nan");
  auto img = kvmem::test::split_image(kvmem::test::read_bytes(kvm_file()));
  const auto at = img.header["k"]["data_offsets"][0].get<std::size_t>() + 8 * 17;
  const double nan = std::numeric_limits<double>::quiet_NaN();
  std::memcpy(img.data.data() + at, &nan, 8);
  kvmem::test::write_bytes(dir.file("nan.safetensors"), kvmem::test::join_image(img));
  expect_bad(dir, dir.file("nan.safetensors"), {"--backend", "reference"}, "reference kvm rejects the case");
  expect_bad(dir, dir.file("nan.safetensors"), {"--backend", "host"}, "host kvm rejects the case");
#if KVMEM_REPLAY_HAVE_KOKKOS_KVM
  expect_bad(dir, dir.file("nan.safetensors"), {"--backend", "kokkos"}, "kokkos kvm rejects the case");
#endif
}
#endif

#if KVMEM_REPLAY_HAVE_HOST_UA || KVMEM_REPLAY_HAVE_KOKKOS_UA
TEST_CASE("non-finite UA inputs are rejected by the host and kokkos backends before anything is written",
          "[replay][cli]") {
  TempDir dir("nan_ua");
  auto img = kvmem::test::split_image(kvmem::test::read_bytes(ua_file()));
  const auto at = img.header["q"]["data_offsets"][0].get<std::size_t>() + 8 * 3;
  const double inf = std::numeric_limits<double>::infinity();
  std::memcpy(img.data.data() + at, &inf, 8);
  kvmem::test::write_bytes(dir.file("inf.safetensors"), kvmem::test::join_image(img));
#if KVMEM_REPLAY_HAVE_HOST_UA
  expect_bad(dir, dir.file("inf.safetensors"), {"--backend", "host"}, "host ua rejects the case");
#endif
#if KVMEM_REPLAY_HAVE_KOKKOS_UA
  expect_bad(dir, dir.file("inf.safetensors"), {"--backend", "kokkos"}, "kokkos ua rejects the case");
#endif
}
#endif

// ---- the tool's own rules, without running it ---------------------------------------------------

TEST_CASE("threshold names follow the goldens", "[replay][unit]") {
  using kvmem::replay::ua_adapter::threshold_suffix;
  CHECK(threshold_suffix(0.05) == "p005");
  CHECK(threshold_suffix(0.15) == "p015");
  CHECK(threshold_suffix(0.5) == "p050");
  CHECK(threshold_suffix(0.125) == "p0125");
  CHECK(threshold_suffix(0.0504) == "p005");  // rounded to 3 decimals
}

TEST_CASE("comparison rule: relative tolerance, exact integers, shapes, NaN", "[replay][unit]") {
  TempDir dir("compare");
  kvmem::io::SafetensorsWriter w;
  w.add("x", {2, 2}, std::vector<double>{1.0, -4.0, 0.5, 2.0});
  w.add("small", {2}, std::vector<double>{1e-3, -1e-3});
  w.add("idx", {3}, std::vector<std::int64_t>{3, -1, 7});
  REQUIRE(w.write(dir.file("ref.safetensors")).is_ok());
  kvmem::io::SafetensorsFile ref;
  REQUIRE(kvmem::io::SafetensorsFile::load(dir.file("ref.safetensors"), ref).is_ok());
  using kvmem::replay::compare_tensor;
  using kvmem::replay::OutTensor;

  // scale = max(1, max|ref|) = 4: an error of 3.9e-5 is 0.98e-5 relative
  auto c = compare_tensor(ref, OutTensor{"x", {2, 2}, false, {1.0, -4.0, 0.5 + 3.9e-5, 2.0}, {}}, 1e-5);
  CHECK(c.pass);
  CHECK(c.max_abs == Approx(3.9e-5));
  CHECK(c.relative == Approx(3.9e-5 / 4));
  c = compare_tensor(ref, OutTensor{"x", {2, 2}, false, {1.0, -4.0, 0.5 + 4.1e-5, 2.0}, {}}, 1e-5);
  CHECK_FALSE(c.pass);
  CHECK_THAT(c.line, Catch::EndsWith("FAIL"));
  // small references are measured against 1, not against themselves
  c = compare_tensor(ref, OutTensor{"small", {2}, false, {1e-3 + 5e-6, -1e-3}, {}}, 1e-5);
  CHECK(c.pass);
  c = compare_tensor(ref, OutTensor{"x", {2, 2}, false, {1.0, std::nan(""), 0.5, 2.0}, {}}, 1e-5);
  CHECK_FALSE(c.pass);
  c = compare_tensor(ref, OutTensor{"x", {4}, false, {1.0, -4.0, 0.5, 2.0}, {}}, 1e-5);
  CHECK_FALSE(c.pass);
  CHECK_THAT(c.line, Catch::Contains("shape [4] != expected [2,2]"));
  c = compare_tensor(ref, OutTensor{"idx", {3}, true, {}, {3, -1, 7}}, 1e-5);
  CHECK(c.pass);
  c = compare_tensor(ref, OutTensor{"idx", {3}, true, {}, {3, 0, 7}}, 1.0);  // integers ignore the tolerance
  CHECK_FALSE(c.pass);
  CHECK(c.mismatches == 1);
  CHECK_THAT(c.line, Catch::Contains("mismatches 1/3"));
}

TEST_CASE("tolerances per backend and precision", "[replay][unit]") {
  using namespace kvmem::replay;
  CHECK(tolerance(Backend::kReference, Precision::kFp32, "kvm", "out") == 1e-9);
  CHECK(tolerance(Backend::kHost, Precision::kFp32, "kvm", "out") == 1e-5);
  CHECK(tolerance(Backend::kHost, Precision::kFp32, "ua", "d_k") == 1e-4);
  CHECK(tolerance(Backend::kHost, Precision::kFp32, "kvm", "d_k") == 1e-5);
  CHECK(tolerance(Backend::kHost, Precision::kBf16, "ua", "out") == 3e-2);
}

TEST_CASE("option parsing: forms and defaults", "[replay][unit]") {
  using namespace kvmem::replay;
  const Options o = parse_args({"in.safetensors", "--output=o.safetensors", "--backend=reference", "--threads", "3"});
  CHECK(o.input == "in.safetensors");
  CHECK(o.output == "o.safetensors");
  CHECK(o.backend == Backend::kReference);
  CHECK(o.threads == 3);
  const Options d = parse_args({"-o", "x", "in"});
  CHECK(d.backend == Backend::kHost);
  CHECK(d.precision == Precision::kFp32);
  CHECK_THROWS_AS(parse_args({"in", "-o", "x", "--threads", "99999999"}), BadInput);
}
