// SPDX-License-Identifier: Apache-2.0
#pragma once
// Test helpers: load the float64 golden vectors in place (KVMEM_GOLDEN_DIR, by default the copy in
// tests/data/golden), and compare tensors with the tolerance rule of tests/data/golden/README.md
// (max |x - ref| <= tol * max(1, max |ref|)).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include "kvmem/io/safetensors.hpp"

namespace kvmem::test {

// The golden folder: the environment variable KVMEM_GOLDEN_DIR when set (another copy, without a
// rebuild; the golden_missing_fails test points it at a folder that does not exist), else the
// folder configured at build time.
inline std::string golden_dir() {
  const char* env = std::getenv("KVMEM_GOLDEN_DIR");
  return env != nullptr && *env != '\0' ? std::string(env) : std::string(KVMEM_GOLDEN_DIR);
}

// Every *.safetensors of golden/<mechanism>, sorted by name. A missing or empty folder fails the
// calling test case: a golden test must never pass without having compared anything.
inline std::vector<std::string> golden_files(const std::string& mechanism) {
  std::vector<std::string> files;
  const std::filesystem::path dir = std::filesystem::path(golden_dir()) / mechanism;
  if (!std::filesystem::is_directory(dir))
    FAIL("golden vectors missing: " << dir.string()
                                    << " is not a folder (KVMEM_GOLDEN_DIR; the repository carries them in "
                                       "tests/data/golden)");
  for (const auto& entry : std::filesystem::directory_iterator(dir))
    if (entry.path().extension() == ".safetensors") files.push_back(entry.path().string());
  if (files.empty()) FAIL("golden vectors missing: no *.safetensors under " << dir.string());
  std::sort(files.begin(), files.end());
  return files;
}

struct Golden {
  std::string path;
  std::string name;  // file stem, e.g. kvm_g1_fixed
  io::SafetensorsFile file;
  nlohmann::json config;

  [[nodiscard]] bool has(const std::string& tensor) const { return file.has(tensor); }
  [[nodiscard]] std::vector<double> f64(const std::string& tensor) const {
    std::vector<double> values;
    const Status status = file.read(tensor, values);
    INFO(name << ": " << status.to_string());
    REQUIRE(status.is_ok());
    return values;
  }
  [[nodiscard]] std::vector<std::int64_t> i64(const std::string& tensor) const {
    std::vector<std::int64_t> values;
    const Status status = file.read(tensor, values);
    INFO(name << ": " << status.to_string());
    REQUIRE(status.is_ok());
    return values;
  }
  [[nodiscard]] std::vector<std::int64_t> shape(const std::string& tensor) const {
    const io::TensorInfo* info = file.find(tensor);
    INFO(name << ": missing tensor " << tensor);
    REQUIRE(info != nullptr);
    return info->shape;
  }
};

inline Golden load_golden(const std::string& path) {
  Golden g;
  g.path = path;
  g.name = std::filesystem::path(path).stem().string();
  const Status status = io::SafetensorsFile::load(path, g.file);
  INFO(status.to_string());
  REQUIRE(status.is_ok());
  const auto it = g.file.metadata().find("config");
  REQUIRE(it != g.file.metadata().end());
  g.config = nlohmann::json::parse(it->second);
  return g;
}

struct Deviation {
  double max_abs = 0.0;  // max |actual - expected|
  double scale = 1.0;    // max(1, max |expected|)
  [[nodiscard]] double relative() const { return max_abs / scale; }
};

template <class A, class E>
Deviation deviation(const std::vector<A>& actual, const std::vector<E>& expected) {
  REQUIRE(actual.size() == expected.size());
  Deviation d;
  for (std::size_t i = 0; i < actual.size(); ++i) {
    const double e = static_cast<double>(expected[i]);
    const double diff = std::abs(static_cast<double>(actual[i]) - e);
    d.max_abs = std::isnan(diff) ? INFINITY : std::max(d.max_abs, diff);
    d.scale = std::max(d.scale, std::abs(e));
  }
  return d;
}

// Relative Frobenius error ||a - e|| / ||e|| (bf16 bounds of DESIGN.md 5).
template <class A, class E>
double relative_frobenius(const std::vector<A>& actual, const std::vector<E>& expected) {
  REQUIRE(actual.size() == expected.size());
  double num = 0.0, den = 0.0;
  for (std::size_t i = 0; i < actual.size(); ++i) {
    const double diff = static_cast<double>(actual[i]) - static_cast<double>(expected[i]);
    num += diff * diff;
    den += static_cast<double>(expected[i]) * static_cast<double>(expected[i]);
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

}  // namespace kvmem::test

// Checks the golden tolerance rule and prints the numbers on failure.
#define KVMEM_CHECK_CLOSE(actual, expected, tol)                                                                \
  do {                                                                                                          \
    const auto kvmem_dev_ = ::kvmem::test::deviation((actual), (expected));                                     \
    INFO(#actual << " vs " << #expected << ": max abs " << kvmem_dev_.max_abs << ", scale " << kvmem_dev_.scale \
                 << ", relative " << kvmem_dev_.relative() << ", tol " << (tol));                               \
    CHECK(kvmem_dev_.relative() <= (tol));                                                                      \
  } while (false)
