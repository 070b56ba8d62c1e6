// SPDX-License-Identifier: Apache-2.0
// kvmem-replay runs that compare with the goldens: --config overrides (flat, nested, mechanism),
// torch-style files (F32 tensors, no kvmem metadata, padded header), and expected tensors that are
// deliberately wrong (a shape, a value, a route) so the comparison must fail them.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include <catch2/catch.hpp>

#include "replay/replay_test_util.hpp"

namespace {

using kvmem::test::TempDir;
namespace fs = std::filesystem;

kvmem::io::SafetensorsFile load(const std::string& path) {
  kvmem::io::SafetensorsFile f;
  const auto status = kvmem::io::SafetensorsFile::load(path, f);
  INFO(status.to_string());
  REQUIRE(status.is_ok());
  return f;
}

std::vector<double> f64(const kvmem::io::SafetensorsFile& f, const std::string& name) {
  std::vector<double> v;
  REQUIRE(f.read(name, v).is_ok());
  return v;
}
std::vector<std::int64_t> i64(const kvmem::io::SafetensorsFile& f, const std::string& name) {
  std::vector<std::int64_t> v;
  REQUIRE(f.read(name, v).is_ok());
  return v;
}

bool line_has(const std::string& out, const std::string& name, const std::string& verdict) {
  std::size_t pos = 0;
  while ((pos = out.find(name + " ", pos)) != std::string::npos) {
    if (pos == 0 || out[pos - 1] == '\n') {
      const std::string line = out.substr(pos, out.find('\n', pos) - pos);
      return line.find(verdict) != std::string::npos;
    }
    ++pos;
  }
  return false;
}

// A copy of a golden's inputs as torch would save them: F32, header keys in any order, only
// {"format": "pt"} as metadata, header padded with spaces. No expected tensors.
void write_torch_style(const std::string& golden, const std::vector<std::string>& inputs, const std::string& path) {
  const auto g = load(golden);
  kvmem::io::SafetensorsWriter w;
  w.set_metadata("format", "pt");
  for (auto it = inputs.rbegin(); it != inputs.rend(); ++it) {  // data order differs from header order
    std::vector<double> v64 = f64(g, *it);
    std::vector<float> v32(v64.begin(), v64.end());
    w.add_raw(*it, "F32", g.find(*it)->shape, v32.data(), v32.size() * sizeof(float));
  }
  REQUIRE(w.write(path).is_ok());
}

double max_rel(const std::vector<double>& a, const std::vector<double>& ref) {
  REQUIRE(a.size() == ref.size());
  double m = 0, s = 1;
  for (std::size_t i = 0; i < a.size(); ++i) {
    m = std::max(m, std::abs(a[i] - ref[i]));
    s = std::max(s, std::abs(ref[i]));
  }
  return m / s;
}

}  // namespace

#if KVMEM_REPLAY_HAVE_REFERENCE_UA
TEST_CASE("config override: thresholds choose the pruned outputs", "[replay][config]") {
  TempDir dir("thresholds");
  const std::string golden = kvmem::test::golden_case("ua", "ua_g1_gqa_t37");
  kvmem::test::write_text(dir.file("cfg.json"), R"({"thresholds": [0.05]})");
  const std::string out = dir.file("out.safetensors");
  const auto run = kvmem::test::run_tool(
      {golden, "-o", out, "--backend", "reference", "--config", dir.file("cfg.json")}, dir.path());
  INFO(run.out << run.err);
  CHECK(run.rc == 0);
  CHECK(line_has(run.out, "kept_p005", "PASS"));
  CHECK(line_has(run.out, "out_pruned_p015", "SKIP"));
  const auto result = load(out);
  CHECK(result.has("out_pruned_p005"));
  CHECK_FALSE(result.has("out_pruned_p015"));
  CHECK_FALSE(result.has("kept_p015"));
  CHECK(result.find("kept_p005")->dtype == kvmem::io::DType::kI64);
  CHECK(result.find("out")->dtype == kvmem::io::DType::kF64);
  // the merged configuration is recorded with the results
  const auto cfg = nlohmann::json::parse(result.metadata().at("config"));
  CHECK(cfg["thresholds"] == nlohmann::json::array({0.05}));
  CHECK(cfg["prefill_split"] == 24);
  CHECK(result.metadata().at("backend") == "reference");

  // a threshold the golden has no tensor for is computed and written, but not compared
  kvmem::test::write_text(dir.file("cfg2.json"), R"({"thresholds": [0.3]})");
  const auto run2 = kvmem::test::run_tool(
      {golden, "-o", out, "--backend", "reference", "--config", dir.file("cfg2.json")}, dir.path());
  CHECK(run2.rc == 0);
  CHECK(load(out).has("kept_p030"));
}

TEST_CASE("a torch-style F32 UA file with the mechanism given by the config file", "[replay][torch]") {
  TempDir dir("torch_ua");
  const std::string golden = kvmem::test::golden_case("ua", "ua_g1_gqa_t37");
  const std::string input = dir.file("captured.safetensors");
  write_torch_style(golden, {"q", "k", "v", "z_k", "z_q"}, input);
  const auto g = load(golden);
  nlohmann::json cfg = nlohmann::json::parse(g.metadata().at("config"));
  cfg["mechanism"] = "ua";
  kvmem::test::write_text(dir.file("cfg.json"), cfg.dump());
  const std::string out = dir.file("out.safetensors");
  const auto run =
      kvmem::test::run_tool({input, "-o", out, "--backend", "reference", "--config", dir.file("cfg.json")}, dir.path());
  INFO(run.out << run.err);
  REQUIRE(run.rc == 0);
  CHECK_THAT(run.out, Catch::Contains("nothing compared"));
  const auto result = load(out);
  // fp32 inputs: the fp64 goldens hold to the fp32 tolerance, the kept sets exactly
  CHECK(max_rel(f64(result, "out"), f64(g, "out")) <= 1e-5);
  CHECK(max_rel(f64(result, "lse"), f64(g, "lse")) <= 1e-5);
  CHECK(max_rel(f64(result, "out_pruned_p015"), f64(g, "out_pruned_p015")) <= 1e-5);
  CHECK(i64(result, "kept_p005") == i64(g, "kept_p005"));
  CHECK(i64(result, "kept_p015") == i64(g, "kept_p015"));
}
#endif

#if KVMEM_REPLAY_HAVE_REFERENCE_KVM
TEST_CASE("config override: nested budget keys merge, flags replace", "[replay][config]") {
  TempDir dir("budget");
  const std::string golden = kvmem::test::golden_case("kvm", "kvm_g1_fixed");
  const std::string out = dir.file("out.safetensors");
  // power law capped by the file's max_slots = 8 gives the fixed-8 schedule: still all PASS
  kvmem::test::write_text(dir.file("power.json"), R"({"budget": {"kind": "power", "factor": 3.0, "exponent": 0.5}})");
  auto run = kvmem::test::run_tool({golden, "-o", out, "--backend", "reference", "--config", dir.file("power.json")},
                                   dir.path());
  INFO(run.out << run.err);
  CHECK(run.rc == 0);
  CHECK(line_has(run.out, "slots_after_update", "PASS"));
  // deleting max_slots (merge-patch null) lifts the cap: more slots, so routes and state fail
  kvmem::test::write_text(dir.file("uncapped.json"),
                          R"({"budget": {"kind": "power", "factor": 3.0, "exponent": 0.5, "max_slots": null}})");
  run = kvmem::test::run_tool({golden, "-o", out, "--backend", "reference", "--config", dir.file("uncapped.json")},
                              dir.path());
  CHECK(run.rc == 1);
  CHECK(line_has(run.out, "slots_after_update", "FAIL"));
  CHECK(line_has(run.out, "state_k", "FAIL"));
  CHECK(i64(load(out), "slots_after_update") != i64(load(golden), "slots_after_update"));
  // a flag: without head temperatures the output changes
  kvmem::test::write_text(dir.file("temps.json"), R"({"head_temps": false})");
  run = kvmem::test::run_tool({golden, "-o", out, "--backend", "reference", "--config", dir.file("temps.json")},
                              dir.path());
  CHECK(run.rc == 1);
  CHECK(line_has(run.out, "out", "FAIL"));
}

TEST_CASE("a torch-style F32 KVM file keeps the golden routes", "[replay][torch]") {
  TempDir dir("torch_kvm");
  const std::string golden = kvmem::test::golden_case("kvm", "kvm_g2_power");
  const std::string input = dir.file("captured.safetensors");
  write_torch_style(golden, {"q", "k", "v", "gate", "ln_weight", "ln_bias", "tau_state", "tau_bswa"}, input);
  const auto g = load(golden);
  nlohmann::json cfg = nlohmann::json::parse(g.metadata().at("config"));
  cfg["mechanism"] = "kvm";
  kvmem::test::write_text(dir.file("cfg.json"), cfg.dump());
  const std::string out = dir.file("out.safetensors");
  const auto run =
      kvmem::test::run_tool({input, "-o", out, "--backend", "reference", "--config", dir.file("cfg.json")}, dir.path());
  INFO(run.out << run.err);
  REQUIRE(run.rc == 0);
  const auto result = load(out);
  CHECK(max_rel(f64(result, "out"), f64(g, "out")) <= 1e-5);
  CHECK(max_rel(f64(result, "state_k"), f64(g, "state_k")) <= 1e-5);
  for (int u = 1; u <= 5; ++u) {
    CHECK(i64(result, "route_merge_u" + std::to_string(u)) == i64(g, "route_merge_u" + std::to_string(u)));
    CHECK(i64(result, "route_append_u" + std::to_string(u)) == i64(g, "route_append_u" + std::to_string(u)));
  }
}

TEST_CASE("a state-only case writes state and routes but no out", "[replay][state]") {
  TempDir dir("state_only");
  const std::string golden = kvmem::test::golden_case("kvm", "kvm_g10_paper_fixed");
  const std::string out = dir.file("out.safetensors");
  const auto run = kvmem::test::run_tool({golden, "-o", out, "--backend", "reference"}, dir.path());
  INFO(run.out << run.err);
  CHECK(run.rc == 0);
  CHECK_THAT(run.err, Catch::Contains("state-only case"));
  const auto result = load(out);
  CHECK_FALSE(result.has("out"));
  CHECK_FALSE(result.has("out_decode"));
  CHECK(result.find("state_k")->shape == std::vector<std::int64_t>{1, 1, 256, 128});
  CHECK(line_has(run.out, "route_merge_u1", "PASS"));
}

TEST_CASE("wrong expected tensors fail: shape, value, route", "[replay][compare]") {
  TempDir dir("wrong");
  const std::string golden = kvmem::test::golden_case("kvm", "kvm_g2_power");
  const std::string out = dir.file("out.safetensors");
  const auto g = load(golden);

  // shape: same bytes, another shape
  kvmem::test::edited_copy(golden, dir.file("shape.safetensors"), [](nlohmann::json& h) {
    h["out"]["shape"] = {1, 64, 4, 8};
  });
  auto run = kvmem::test::run_tool({dir.file("shape.safetensors"), "-o", out, "--backend", "reference"}, dir.path());
  CHECK(run.rc == 1);
  CHECK_THAT(run.out, Catch::Contains("shape [1,64,2,16] != expected [1,64,4,8]"));
  CHECK(line_has(run.out, "out_decode", "PASS"));
  CHECK(fs::exists(out));  // results are written even when a comparison fails

  // a value 1e-6 off in the state and one merge target changed
  auto img = kvmem::test::split_image(kvmem::test::read_bytes(golden));
  const auto sv = img.header["state_v"]["data_offsets"][0].get<std::size_t>();
  double x;
  std::memcpy(&x, img.data.data() + sv, 8);
  x += 1e-6;
  std::memcpy(img.data.data() + sv, &x, 8);
  const auto rm = img.header["route_merge_u3"]["data_offsets"][0].get<std::size_t>();
  std::int64_t target;
  std::memcpy(&target, img.data.data() + rm, 8);
  target = target == 1 ? 2 : 1;
  std::memcpy(img.data.data() + rm, &target, 8);
  kvmem::test::write_bytes(dir.file("values.safetensors"), kvmem::test::join_image(img));
  run = kvmem::test::run_tool({dir.file("values.safetensors"), "-o", out, "--backend", "reference"}, dir.path());
  INFO(run.out);
  CHECK(run.rc == 1);
  CHECK(line_has(run.out, "state_v", "FAIL"));
  CHECK(line_has(run.out, "route_merge_u3", "mismatches 1/16"));
  CHECK(line_has(run.out, "route_merge_u2", "PASS"));
  CHECK(line_has(run.out, "state_k", "PASS"));
}
#endif

#if KVMEM_REPLAY_HAVE_HOST_KVM
TEST_CASE("host results do not depend on --threads", "[replay][host]") {
  TempDir dir("threads");
  const std::string golden = kvmem::test::golden_case("kvm", "kvm_g5_gqa");
  const auto one =
      kvmem::test::run_tool({golden, "-o", dir.file("t1.safetensors"), "--threads", "1", "--quiet"}, dir.path());
  const auto three =
      kvmem::test::run_tool({golden, "-o", dir.file("t3.safetensors"), "--threads", "3", "--quiet"}, dir.path());
  INFO(one.out << one.err << three.out << three.err);
  REQUIRE(one.rc == 0);
  REQUIRE(three.rc == 0);
  const auto a = load(dir.file("t1.safetensors")), b = load(dir.file("t3.safetensors"));
  CHECK(a.metadata().at("backend") == "host");
  CHECK(a.metadata().at("precision") == "fp32");
  for (const auto& t : a.tensors()) {
    INFO(t.name);
    REQUIRE(b.has(t.name));
    if (t.dtype == kvmem::io::DType::kF64)
      CHECK(f64(a, t.name) == f64(b, t.name));
    else
      CHECK(i64(a, t.name) == i64(b, t.name));
  }
}
#endif

#if KVMEM_REPLAY_HAVE_HOST_UA
TEST_CASE("host bf16 UA stays within the bf16 tolerance and keeps the kept sets", "[replay][host]") {
  TempDir dir("bf16");
  const std::string golden = kvmem::test::golden_case("ua", "ua_g1_gqa_t37");
  const auto run =
      kvmem::test::run_tool({golden, "-o", dir.file("o.safetensors"), "--precision", "bf16", "--quiet"}, dir.path());
  INFO(run.out << run.err);
  CHECK(run.rc == 0);
  CHECK(line_has(run.out, "out_decode", "tol 3.000e-02"));
  CHECK(line_has(run.out, "kept_p015", "PASS"));
  // bf16 storage really is used: the decode output is not the fp32 one
  const auto fp32 = kvmem::test::run_tool({golden, "-o", dir.file("f.safetensors"), "--quiet"}, dir.path());
  REQUIRE(fp32.rc == 0);
  CHECK(f64(load(dir.file("o.safetensors")), "out_decode") != f64(load(dir.file("f.safetensors")), "out_decode"));
}
#endif

#if KVMEM_REPLAY_HAVE_HOST_UA && KVMEM_REPLAY_HAVE_KOKKOS_UA
namespace {

// A UA file with inputs only (no expected tensors): the inputs of `golden`, an output gate z_o
// (no golden has one), and the golden's config patched by `patch`.
void write_ua_inputs_with_z_o(const std::string& golden, const nlohmann::json& patch, const std::string& path) {
  const auto g = load(golden);
  nlohmann::json cfg = nlohmann::json::parse(g.metadata().at("config"));
  cfg.merge_patch(patch);
  kvmem::io::SafetensorsWriter w;
  w.set_metadata("mechanism", "ua");
  w.set_metadata("config", cfg.dump());
  for (const std::string name : {"q", "k", "v", "z_k", "z_q"}) w.add(name, g.find(name)->shape, f64(g, name));
  const std::int64_t B = cfg["B"], T = cfg["T"], H = cfg["H"], D = cfg["D"];
  std::vector<double> z_o(static_cast<std::size_t>(B * T * H * D));
  for (std::size_t i = 0; i < z_o.size(); ++i) z_o[i] = 2.0 * std::sin(0.37 * static_cast<double>(i) + 0.1);
  w.add("z_o", {B, T, H, D}, z_o);
  REQUIRE(w.write(path).is_ok());
}

}  // namespace

TEST_CASE("kokkos UA writes the tensors of the host UA adapter", "[replay][kokkos]") {
  TempDir dir("kokkos_ua");
  const std::string golden = kvmem::test::golden_case("ua", "ua_g1_gqa_t37");
  const std::string gated = dir.file("gated.safetensors");
  // z_o, evict after attention and a third threshold: paths the goldens do not take
  write_ua_inputs_with_z_o(golden, {{"evict_before_attention", false}, {"thresholds", {0.05, 0.15, 0.3}}}, gated);
  for (const std::string& input : {golden, gated}) {
    for (const std::string precision : {"fp32", "bf16"}) {
      INFO(input << " " << precision);
      const std::string host_out = dir.file("host_" + precision + ".safetensors");
      const std::string kokkos_out = dir.file("kokkos_" + precision + ".safetensors");
      const auto host = kvmem::test::run_tool(
          {input, "-o", host_out, "--backend", "host", "--precision", precision, "--quiet"}, dir.path());
      const auto kok = kvmem::test::run_tool(
          {input, "-o", kokkos_out, "--backend", "kokkos", "--precision", precision, "--quiet"}, dir.path());
      INFO(host.out << host.err << kok.out << kok.err);
      REQUIRE(host.rc == 0);
      REQUIRE(kok.rc == 0);
      const auto a = load(host_out), b = load(kokkos_out);
      CHECK(b.metadata().at("backend") == "kokkos");
      CHECK(b.metadata().at("precision") == precision);
      // the same tensors, names, dtypes and shapes
      std::vector<std::string> names_a, names_b;
      for (const auto& t : a.tensors()) names_a.push_back(t.name);
      for (const auto& t : b.tensors()) names_b.push_back(t.name);
      std::sort(names_a.begin(), names_a.end());
      std::sort(names_b.begin(), names_b.end());
      CHECK(names_a == names_b);
      const std::size_t expected = input == gated ? 4 + 2 * 3 : 4 + 2 * 2;
      CHECK(names_a.size() == expected);
      for (const auto& t : a.tensors()) {
        INFO(t.name);
        const auto* u = b.find(t.name);
        REQUIRE(u != nullptr);
        CHECK(u->dtype == t.dtype);
        CHECK(u->shape == t.shape);
        if (t.dtype == kvmem::io::DType::kF64)
          CHECK(max_rel(f64(b, t.name), f64(a, t.name)) <= 1e-6);
        else
          CHECK(i64(b, t.name) == i64(a, t.name));
      }
      // the pruned runs prune: a kept set that keeps everything would compare trivially
      const auto kept = i64(b, "kept_p015");
      CHECK(std::count(kept.begin(), kept.end(), 0) > 0);
      CHECK(std::count(kept.begin(), kept.end(), 1) > 0);
    }
    // bf16 storage really is used by the kokkos caches: the decode output is not the fp32 one
    CHECK(f64(load(dir.file("kokkos_bf16.safetensors")), "out_decode") !=
          f64(load(dir.file("kokkos_fp32.safetensors")), "out_decode"));
  }
  // the gate is applied: the gated run's out is not the golden's
  CHECK(max_rel(f64(load(dir.file("kokkos_fp32.safetensors")), "out"), f64(load(golden), "out")) > 1e-3);
}
#endif

#if !KVMEM_REPLAY_HAVE_REFERENCE_KVM || !KVMEM_REPLAY_HAVE_REFERENCE_UA
TEST_CASE("replay runs need the reference backend", "[replay][!mayfail]") {
  WARN("kvmem-replay was built without a reference backend: the run tests are not compiled");
}
#endif
