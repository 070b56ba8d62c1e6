// SPDX-License-Identifier: Apache-2.0
#pragma once
// Helpers of the kvmem-replay tests: a temporary folder per test case, running the built tool
// (path from CMake) with its stdout/stderr captured, and byte-level edits of safetensors files.

#include <sys/wait.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <string>
#include <vector>

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include "support/golden.hpp"

namespace kvmem::test {

namespace fs = std::filesystem;

// A fresh folder removed at scope exit; ctest may run test cases in parallel, so names are unique.
class TempDir {
 public:
  explicit TempDir(const std::string& tag) {
    static std::atomic<int> counter{0};
    const auto stamp = std::chrono::steady_clock::now().time_since_epoch().count();
    path_ = fs::temp_directory_path() /
            ("kvmem_replay_" + tag + "_" + std::to_string(stamp) + "_" + std::to_string(counter++));
    fs::create_directories(path_);
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  [[nodiscard]] std::string file(const std::string& name) const { return (path_ / name).string(); }
  [[nodiscard]] const fs::path& path() const { return path_; }
  // Names of every entry in the folder (to prove that nothing, not even a temporary, was left).
  [[nodiscard]] std::vector<std::string> entries() const {
    std::vector<std::string> names;
    for (const auto& e : fs::directory_iterator(path_)) names.push_back(e.path().filename().string());
    return names;
  }

 private:
  fs::path path_;
};

inline std::string slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

inline std::vector<std::uint8_t> read_bytes(const std::string& path) {
  const std::string s = slurp(path);
  return {s.begin(), s.end()};
}

inline void write_bytes(const std::string& path, const std::vector<std::uint8_t>& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  REQUIRE(out.good());
}

inline void write_text(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << text;
  REQUIRE(out.good());
}

inline std::string shell_quote(const std::string& s) {
  std::string q = "'";
  for (char c : s) {
    if (c == '\'')
      q.append("'\\''");
    else
      q.push_back(c);
  }
  q.push_back('\'');
  return q;
}

#ifdef KVMEM_REPLAY_EXE
struct ToolRun {
  int rc = -1;
  std::string out;  // stdout
  std::string err;  // stderr
};

// Runs kvmem-replay (or the tool at `exe`: kvmem-replay-cuda) with `args`; stdout and stderr go to files
// in `dir` (not under test).
inline ToolRun run_tool(const std::vector<std::string>& args, const fs::path& log_dir,
                        const std::string& exe = KVMEM_REPLAY_EXE) {
  std::string cmd = shell_quote(exe);
  for (const auto& a : args) {
    cmd.push_back(' ');
    cmd.append(shell_quote(a));
  }
  const std::string out = (log_dir / "stdout.txt").string(), err = (log_dir / "stderr.txt").string();
  cmd.append(" >");
  cmd.append(shell_quote(out));
  cmd.append(" 2>");
  cmd.append(shell_quote(err));
  const int status = std::system(cmd.c_str());
  ToolRun r;
  REQUIRE(status != -1);
  REQUIRE(WIFEXITED(status));  // a signal (crash, sanitizer abort by signal) fails here
  r.rc = WEXITSTATUS(status);
  r.out = slurp(out);
  r.err = slurp(err);
  std::error_code ec;
  fs::remove(out, ec);
  fs::remove(err, ec);
  return r;
}
#endif  // KVMEM_REPLAY_EXE (set by tests/replay/CMakeLists.txt for the tests that run the tool)

// Splits a safetensors image into its header JSON and its data buffer (the input must be valid).
struct Image {
  nlohmann::json header;
  std::vector<std::uint8_t> data;
};
inline Image split_image(const std::vector<std::uint8_t>& bytes) {
  REQUIRE(bytes.size() >= 8);
  std::uint64_t n = 0;
  std::memcpy(&n, bytes.data(), 8);
  REQUIRE(8 + n <= bytes.size());
  Image img;
  img.header = nlohmann::json::parse(bytes.begin() + 8, bytes.begin() + 8 + static_cast<std::ptrdiff_t>(n));
  img.data.assign(bytes.begin() + 8 + static_cast<std::ptrdiff_t>(n), bytes.end());
  return img;
}
// Header text (padded with spaces to 8 bytes, as Python's safetensors does) followed by the data.
inline std::vector<std::uint8_t> join_image(const std::string& header_text, const std::vector<std::uint8_t>& data) {
  std::string text = header_text;
  text.append((8 - text.size() % 8) % 8, ' ');
  const std::uint64_t n = text.size();
  std::vector<std::uint8_t> bytes(8 + text.size() + data.size());
  std::memcpy(bytes.data(), &n, 8);
  if (!text.empty()) std::memcpy(bytes.data() + 8, text.data(), text.size());
  if (!data.empty()) std::memcpy(bytes.data() + 8 + text.size(), data.data(), data.size());
  return bytes;
}
inline std::vector<std::uint8_t> join_image(const Image& img) {
  return join_image(img.header.dump(), img.data);
}

// A copy of `golden` with its header edited by `edit` (data buffer unchanged), written to `path`.
inline void edited_copy(const std::string& golden, const std::string& path,
                        const std::function<void(nlohmann::json&)>& edit) {
  Image img = split_image(read_bytes(golden));
  edit(img.header);
  write_bytes(path, join_image(img));
}

// The metadata config of a header, edited and stored back as a string (the format's rule).
inline void edit_config(nlohmann::json& header, const std::function<void(nlohmann::json&)>& edit) {
  nlohmann::json config = nlohmann::json::parse(header["__metadata__"]["config"].get<std::string>());
  edit(config);
  header["__metadata__"]["config"] = config.dump();
}

// The path of one public golden file; a missing file fails the calling test case, naming the folder.
inline std::string golden_case(const std::string& mechanism, const std::string& name) {
  const std::string path = golden_dir() + "/" + mechanism + "/" + name + ".safetensors";
  if (!std::filesystem::is_regular_file(path))
    FAIL("golden vectors missing: " << path << " not found (KVMEM_GOLDEN_DIR=" << golden_dir() << ")");
  return path;
}

}  // namespace kvmem::test
