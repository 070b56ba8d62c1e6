// SPDX-License-Identifier: Apache-2.0
#pragma once
// kvmem-replay, the part every mechanism and backend shares: command line, loading the case,
// configuration (metadata `config` merged with --config), input shape checks, the output set,
// comparison against expected tensors of the same names, atomic writing, progress lines.
//
// Mechanism adapters (run_kvm.hpp, run_ua.hpp) only turn the configuration into their library
// types, call one backend and hand tensors back. Every problem with the input or the options is
// thrown as BadInput and becomes one line on stderr and exit code 2 (see kvmem_replay.cpp), so an
// adapter never needs its own error plumbing and no output file is written.

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <limits>
#include <map>
#include <mutex>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "kvmem/core/status.hpp"
#include "kvmem/io/safetensors.hpp"

namespace kvmem::replay {

using Shape = std::vector<std::int64_t>;
using Json = nlohmann::json;

// Bad input or options: one line, exit 2.
class BadInput : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

inline std::string shape_text(const Shape& shape) {
  std::string text = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) {
    if (i) text += ',';
    text += std::to_string(shape[i]);
  }
  text += ']';
  return text;
}

// ---- options ----------------------------------------------------------------------------------

enum class Backend { kReference, kHost, kKokkos, kCuda };
enum class Precision { kFp32, kBf16 };

inline const char* to_string(Backend b) {
  switch (b) {
    case Backend::kReference:
      return "reference";
    case Backend::kHost:
      return "host";
    case Backend::kKokkos:
      return "kokkos";
    case Backend::kCuda:
      return "cuda";
  }
  return "?";
}
inline const char* to_string(Precision p) {
  return p == Precision::kBf16 ? "bf16" : "fp32";
}

struct Options {
  std::string input;
  std::string output;
  std::string config_path;
  std::string trace_path;  // --trace: play a serving schedule (trace.hpp); input is then its inputs file
  bool check = false;      // --check (trace mode): run each sequence alone and compare
  Backend backend = Backend::kHost;
  Precision precision = Precision::kFp32;
  bool precision_given = false;
  int threads = 0;  // 0: every hardware thread
  bool quiet = false;
  bool help = false;
};

// Tolerances (relative rule of tests/data/golden/README.md: max|x - ref| <= tol * max(1, max|ref|)).
inline constexpr double kTolReference = 1e-9;
inline constexpr double kTolFp32 = 1e-5;
inline constexpr double kTolFp32UaDk = 1e-4;  // UA d_k: the c^(-1/3) factor amplifies rounding
inline constexpr double kTolBf16 = 3e-2;

inline std::string usage_text() {
  return "usage: kvmem-replay CASE.safetensors -o OUT.safetensors [--backend reference|host|kokkos|cuda]\n"
         "                    [--precision fp32|bf16] [--threads N] [--config FILE.json] [--quiet]\n"
         "       kvmem-replay --trace TRACE.json INPUTS.safetensors -o OUT.safetensors [--check]\n"
         "                    [--backend host|kokkos|cuda] [--precision fp32|bf16] [--threads N] [--quiet]\n"
         "\n"
         "Runs the KVM or UA operation that CASE's metadata names (`mechanism`, `config`; layout of\n"
         "tests/data/golden/README.md) on CASE's input tensors and writes every result, float64 (int64 for\n"
         "routes, slot counts and kept sets), to OUT under the names the goldens use. OUT is written\n"
         "through a temporary file and a rename: it is complete or absent.\n"
         "\n"
         "  -o, --output FILE   where to write the results (required)\n"
         "  --backend B         reference (float64 oracle) | host (default) | kokkos | cuda\n"
         "                      (kokkos: KVM and UA when built with -DKVMEM_KOKKOS=ON, Kokkos' default\n"
         "                      execution space; cuda: KVM and UA in kvmem-replay-cuda, the same tool\n"
         "                      built beside this one by -DKVMEM_CUDA=ON. An absent backend exits 2.)\n"
         "  --precision P       storage precision of host/kokkos/cuda: fp32 (default) | bf16;\n"
         "                      not accepted with --backend reference (always float64)\n"
         "  --threads N         host threads, N >= 1 (default: all hardware threads)\n"
         "  --config FILE.json  a JSON object merged into the metadata config (RFC 7386 merge patch:\n"
         "                      nested objects such as `budget` merge key by key, null deletes a key);\n"
         "                      a top-level \"mechanism\" key replaces the metadata mechanism\n"
         "  --quiet             no progress lines on stderr\n"
         "  --trace TRACE.json  play a serving schedule (steps of ragged rows, reset, copy, export, import,\n"
         "                      truncate; format in the tool's README) through the backend's sequence-slot\n"
         "                      API over the packed inputs of INPUTS; writes out, lse, record.NAME per\n"
         "                      export and truncate_exact. Runs on host, on kokkos where the Kokkos\n"
         "                      backend has sequence slots, and on cuda (kvmem-replay-cuda).\n"
         "  --check             with --trace: run every sequence the schedule built alone (its rows, on a\n"
         "                      state of one slot) and compare, bitwise on host and kokkos, within the\n"
         "                      fp32 tolerance on cuda; exit 1 on a difference\n"
         "\n"
         "KVM runs prefill (out, state_k, state_v, state_rho, slots_after_update, route_append_u{u},\n"
         "route_merge_u{u}) and, when config has decode_split, prefill then token-by-token decode\n"
         "(out_decode). Without `q` (state-only case) it feeds zero queries to get the state and routes and\n"
         "writes no out/out_decode. UA runs dense (out, lse, lambda_last), decode (out_decode) and, per\n"
         "config `thresholds` p, the pruned run (out_pruned_p{digits}, kept_p{digits}; 0.05 -> p005).\n"
         "Gradients: the reference backend computes KVM gradients when `dout` is present; other backends and\n"
         "UA say once on stderr that they implement no backward and list the expected d_* tensors as SKIP.\n"
         "\n"
         "When CASE also holds expected tensors of those names, one line per tensor is printed:\n"
         "name, max abs error, relative error max|x-ref|/max(1,max|ref|), tolerance, PASS/FAIL.\n"
         "Tolerances: reference 1e-9; fp32 1e-5 (UA d_k 1e-4); bf16 3e-2. Integer tensors (routes,\n"
         "kept sets, slot counts) must match exactly; a shape mismatch fails the tensor.\n"
         "\n"
         "Exit status: 0 all compared tensors pass (or nothing to compare), 1 some tensor fails,\n"
         "2 bad input or options (one-line message on stderr, no output file).\n";
}

inline bool parse_positive_int(const std::string& text, int& out) {
  if (text.empty() || text.size() > 6) return false;
  for (char c : text)
    if (c < '0' || c > '9') return false;
  const int value = std::stoi(text);
  if (value < 1) return false;
  out = value;
  return true;
}

// Accepts "--opt value" and "--opt=value". Throws BadInput naming the offending option.
inline Options parse_args(const std::vector<std::string>& args) {
  Options opt;
  for (std::size_t i = 0; i < args.size(); ++i) {
    std::string arg = args[i];
    std::optional<std::string> inline_value;
    if (arg.rfind("--", 0) == 0) {
      const auto eq = arg.find('=');
      if (eq != std::string::npos) {
        inline_value = arg.substr(eq + 1);
        arg = arg.substr(0, eq);
      }
    }
    auto value = [&]() -> std::string {
      if (inline_value) return *inline_value;
      if (i + 1 >= args.size()) throw BadInput("option " + arg + " needs a value");
      return args[++i];
    };
    if (arg == "-h" || arg == "--help") {
      opt.help = true;
    } else if (arg == "--quiet") {
      opt.quiet = true;
    } else if (arg == "-o" || arg == "--output") {
      opt.output = value();
      if (opt.output.empty()) throw BadInput("option -o needs a file name");
    } else if (arg == "--backend") {
      const std::string v = value();
      if (v == "reference")
        opt.backend = Backend::kReference;
      else if (v == "host")
        opt.backend = Backend::kHost;
      else if (v == "kokkos")
        opt.backend = Backend::kKokkos;
      else if (v == "cuda")
        opt.backend = Backend::kCuda;
      else
        throw BadInput("--backend: expected reference, host, kokkos or cuda, got '" + v + "'");
    } else if (arg == "--precision") {
      const std::string v = value();
      if (v == "fp32")
        opt.precision = Precision::kFp32;
      else if (v == "bf16")
        opt.precision = Precision::kBf16;
      else
        throw BadInput("--precision: expected fp32 or bf16, got '" + v + "'");
      opt.precision_given = true;
    } else if (arg == "--threads") {
      const std::string v = value();
      if (!parse_positive_int(v, opt.threads)) throw BadInput("--threads: expected an integer >= 1, got '" + v + "'");
    } else if (arg == "--trace") {
      opt.trace_path = value();
      if (opt.trace_path.empty()) throw BadInput("option --trace needs a file name");
    } else if (arg == "--check") {
      opt.check = true;
    } else if (arg == "--config") {
      opt.config_path = value();
      if (opt.config_path.empty()) throw BadInput("option --config needs a file name");
    } else if (!arg.empty() && arg[0] == '-' && arg != "-") {
      throw BadInput("unknown option '" + arg + "' (see --help)");
    } else {
      if (!opt.input.empty()) throw BadInput("more than one input file: '" + opt.input + "' and '" + arg + "'");
      opt.input = arg;
    }
  }
  if (opt.help) return opt;
  if (opt.input.empty() && !opt.trace_path.empty())
    throw BadInput("no inputs file (usage: kvmem-replay --trace TRACE.json INPUTS.safetensors -o OUT.safetensors)");
  if (opt.input.empty()) throw BadInput("no input file (usage: kvmem-replay CASE.safetensors -o OUT.safetensors ...)");
  if (opt.output.empty()) throw BadInput("no output file: pass -o OUT.safetensors");
  if (opt.check && opt.trace_path.empty())
    throw BadInput("--check compares a trace's sequences with their runs alone; it needs --trace TRACE.json");
  if (!opt.trace_path.empty() && !opt.config_path.empty())
    throw BadInput("--config does not apply to --trace: the trace holds its config");
  if (opt.backend == Backend::kReference && opt.precision_given)
    throw BadInput(
        "--precision applies to the host, kokkos and cuda backends; the reference backend computes in float64");
  return opt;
}

// ---- the case: file, mechanism, configuration -------------------------------------------------

struct Case {
  std::string path;
  io::SafetensorsFile file;
  std::string mechanism;
  Json config;  // metadata config with --config merged in
};

inline Json parse_json_object(const std::string& text, const std::string& what) {
  Json j = Json::parse(text, nullptr, false);
  if (j.is_discarded()) throw BadInput(what + " is not valid JSON");
  if (!j.is_object()) throw BadInput(what + " is not a JSON object");
  return j;
}

inline Case load_case(const Options& opt) {
  Case c;
  c.path = opt.input;
  const Status status = io::SafetensorsFile::load(opt.input, c.file);
  if (!status.is_ok()) throw BadInput(status.message());

  const auto& meta = c.file.metadata();
  if (auto it = meta.find("mechanism"); it != meta.end()) c.mechanism = it->second;
  if (auto it = meta.find("config"); it != meta.end())
    c.config = parse_json_object(it->second, opt.input + ": metadata 'config'");
  else
    c.config = Json::object();

  if (!opt.config_path.empty()) {
    std::ifstream in(opt.config_path, std::ios::binary);
    if (!in) throw BadInput("--config " + opt.config_path + ": cannot open file");
    const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    Json patch = parse_json_object(text, "--config " + opt.config_path);
    if (auto m = patch.find("mechanism"); m != patch.end()) {
      if (!m->is_string()) throw BadInput("--config " + opt.config_path + ": 'mechanism' must be a string");
      c.mechanism = m->get<std::string>();
      patch.erase("mechanism");
    }
    c.config.merge_patch(patch);
  }
  if (c.mechanism.empty())
    throw BadInput(opt.input + ": metadata has no 'mechanism' (kvm or ua); add it to the file or to --config");
  if (meta.find("config") == meta.end() && opt.config_path.empty())
    throw BadInput(opt.input + ": metadata has no 'config'; pass --config FILE.json");
  return c;
}

// Typed, range-checked access to the configuration; every failure names the key.
class ConfigReader {
 public:
  explicit ConfigReader(const Json& config, std::string where = "config") : config_(config), where_(std::move(where)) {}

  [[nodiscard]] bool has(const std::string& key) const { return config_.contains(key) && !config_.at(key).is_null(); }

  std::int64_t integer(const std::string& key, std::int64_t lo, std::int64_t hi) const {
    if (!has(key)) throw BadInput(where_ + ": missing key '" + key + "'");
    return integer_value(key, config_.at(key), lo, hi);
  }
  std::int64_t integer_or(const std::string& key, std::int64_t fallback, std::int64_t lo, std::int64_t hi) const {
    return has(key) ? integer_value(key, config_.at(key), lo, hi) : fallback;
  }
  double real_or(const std::string& key, double fallback, double lo, double hi) const {
    if (!has(key)) return fallback;
    const Json& j = config_.at(key);
    if (!j.is_number()) throw BadInput(where_ + ": '" + key + "' must be a number, got " + j.dump());
    const double v = j.get<double>();
    if (!(v >= lo && v <= hi))
      throw BadInput(where_ + ": '" + key + "' must lie in [" + num(lo) + ", " + num(hi) + "], got " + j.dump());
    return v;
  }
  bool boolean_or(const std::string& key, bool fallback) const {
    if (!has(key)) return fallback;
    const Json& j = config_.at(key);
    if (!j.is_boolean()) throw BadInput(where_ + ": '" + key + "' must be true or false, got " + j.dump());
    return j.get<bool>();
  }
  std::string string_or(const std::string& key, const std::string& fallback) const {
    if (!has(key)) return fallback;
    const Json& j = config_.at(key);
    if (!j.is_string()) throw BadInput(where_ + ": '" + key + "' must be a string, got " + j.dump());
    return j.get<std::string>();
  }
  [[nodiscard]] const Json* find(const std::string& key) const { return has(key) ? &config_.at(key) : nullptr; }
  [[nodiscard]] const std::string& where() const { return where_; }

  static std::string num(double v) {
    std::ostringstream s;
    s << v;
    return s.str();
  }

 private:
  std::int64_t integer_value(const std::string& key, const Json& j, std::int64_t lo, std::int64_t hi) const {
    // JSON writers differ (Python writes 8, some tools 8.0): accept integral floats too.
    std::int64_t v = 0;
    if (j.is_number_integer()) {
      if (j.is_number_unsigned() && j.get<std::uint64_t>() > static_cast<std::uint64_t>(hi))
        throw BadInput(where_ + ": '" + key + "' must lie in [" + std::to_string(lo) + ", " + std::to_string(hi) +
                       "], got " + j.dump());
      v = j.get<std::int64_t>();
    } else if (j.is_number_float() && std::isfinite(j.get<double>()) &&
               std::floor(j.get<double>()) == j.get<double>() && std::abs(j.get<double>()) < 9e15) {
      v = static_cast<std::int64_t>(j.get<double>());
    } else {
      throw BadInput(where_ + ": '" + key + "' must be an integer, got " + j.dump());
    }
    if (v < lo || v > hi)
      throw BadInput(where_ + ": '" + key + "' must lie in [" + std::to_string(lo) + ", " + std::to_string(hi) +
                     "], got " + j.dump());
    return v;
  }

  const Json& config_;
  std::string where_;
};

// Extents are bounded so that products of a few of them cannot overflow int64 (tensor sizes are
// bounded by the file anyway; this only keeps config arithmetic safe before shapes are compared).
inline constexpr std::int64_t kMaxExtent = std::int64_t{1} << 31;

// ---- inputs -----------------------------------------------------------------------------------

// Reads a floating input tensor whose shape must equal `expected` (`why` says which config values
// give that shape, for the message).
inline std::vector<double> input_f64(const Case& c, const std::string& name, const Shape& expected,
                                     const std::string& why) {
  const io::TensorInfo* info = c.file.find(name);
  if (info == nullptr) throw BadInput(c.path + ": missing tensor '" + name + "' (shape " + shape_text(expected) + ")");
  if (info->shape != expected)
    throw BadInput(c.path + ": tensor '" + name + "' has shape " + shape_text(info->shape) + " but the config (" + why +
                   ") calls for " + shape_text(expected));
  std::vector<double> values;
  const Status status = c.file.read(name, values);
  if (!status.is_ok()) throw BadInput(c.path + ": " + status.message());
  return values;
}

// ---- outputs ----------------------------------------------------------------------------------

struct OutTensor {
  std::string name;
  Shape shape;
  bool integer = false;
  std::vector<double> f;
  std::vector<std::int64_t> i;
};

inline std::int64_t numel(const Shape& shape) {
  std::int64_t n = 1;
  for (auto e : shape) n *= e;
  return n;
}

class Outputs {
 public:
  void add(const std::string& name, Shape shape, std::vector<double> values) {
    check_size(name, shape, values.size());
    put(OutTensor{name, std::move(shape), false, std::move(values), {}});
  }
  void add(const std::string& name, Shape shape, std::vector<std::int64_t> values) {
    check_size(name, shape, values.size());
    put(OutTensor{name, std::move(shape), true, {}, std::move(values)});
  }
  [[nodiscard]] const std::vector<OutTensor>& tensors() const { return tensors_; }
  [[nodiscard]] const OutTensor* find(const std::string& name) const {
    for (const auto& t : tensors_)
      if (t.name == name) return &t;
    return nullptr;
  }

 private:
  // A backend that returns a different number of values than its own shape says is a bug in kvmem,
  // not in the input; still a clean one-line exit rather than a bad file.
  static void check_size(const std::string& name, const Shape& shape, std::size_t size) {
    if (numel(shape) != static_cast<std::int64_t>(size))
      throw std::logic_error("internal: result '" + name + "' has " + std::to_string(size) + " values for shape " +
                             shape_text(shape));
  }
  void put(OutTensor t) {
    for (auto& existing : tensors_)
      if (existing.name == t.name) {
        existing = std::move(t);
        return;
      }
    tensors_.push_back(std::move(t));
  }
  std::vector<OutTensor> tensors_;
};

// ---- progress -----------------------------------------------------------------------------------

// One line per finished phase (tokens, elapsed), and while a phase runs longer than a second a
// heartbeat line every second (every fifth second after the first ten), so a long case shows it is
// alive. Lines go to stderr.
class Progress {
 public:
  Progress(bool enabled, std::string label) : enabled_(enabled), label_(std::move(label)), start_(Clock::now()) {}
  Progress(const Progress&) = delete;
  Progress& operator=(const Progress&) = delete;

  // Runs `body` as one phase over `tokens` tokens.
  template <class Body>
  decltype(auto) phase(const std::string& name, std::int64_t tokens, Body&& body) {
    done_.store(-1);
    if (!enabled_) return body();
    const auto begin = Clock::now();
    Heartbeat beat(*this, name, tokens, begin);
    struct Done {
      Progress& p;
      const std::string& name;
      std::int64_t tokens;
      Clock::time_point begin;
      ~Done() {
        if (std::uncaught_exceptions() == 0)
          p.line(name + ": " + std::to_string(tokens) + " tokens in " + seconds(Clock::now() - begin) + " (total " +
                 seconds(Clock::now() - p.start_) + ")");
      }
    } done{*this, name, tokens, begin};
    return body();
  }
  // Adapters that loop over tokens report them, and the heartbeat then shows "done/total tokens".
  void advance(std::int64_t tokens) {
    std::int64_t cur = done_.load();
    done_.store(cur < 0 ? tokens : cur + tokens);
  }
  void note(const std::string& text) const { std::fprintf(stderr, "kvmem-replay: %s\n", text.c_str()); }

 private:
  using Clock = std::chrono::steady_clock;
  static std::string seconds(Clock::duration d) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%.3f s", std::chrono::duration<double>(d).count());
    return buf;
  }
  void line(const std::string& text) const {
    std::fprintf(stderr, "kvmem-replay: [%s] %s\n", label_.c_str(), text.c_str());
  }

  class Heartbeat {
   public:
    Heartbeat(const Progress& p, const std::string& name, std::int64_t tokens, Clock::time_point begin)
        : thread_([this, &p, name, tokens, begin] {
            std::unique_lock lock(mutex_);
            // Every second for the first ten, then every fifth: alive, without flooding a log.
            for (int beat = 1; !cv_.wait_for(lock, std::chrono::seconds(1), [this] { return stop_; }); ++beat) {
              if (beat > 10 && beat % 5 != 0) continue;
              const std::int64_t done = p.done_.load();
              p.line(name + ": " + (done >= 0 ? std::to_string(done) + "/" : std::string("running over ")) +
                     std::to_string(tokens) + " tokens, " + seconds(Clock::now() - begin) + " elapsed");
            }
          }) {}
    ~Heartbeat() {
      {
        std::lock_guard lock(mutex_);
        stop_ = true;
      }
      cv_.notify_one();
      thread_.join();
    }

   private:
    std::mutex mutex_;
    std::condition_variable cv_;
    bool stop_ = false;
    std::thread thread_;  // last: starts after the members it uses exist
  };

  bool enabled_;
  std::string label_;
  Clock::time_point start_;
  std::atomic<std::int64_t> done_{-1};  // tokens finished in the current phase; -1: not reported
};

// ---- comparison ---------------------------------------------------------------------------------

inline double tolerance(Backend backend, Precision precision, const std::string& mechanism, const std::string& name) {
  if (backend == Backend::kReference) return kTolReference;
  if (precision == Precision::kBf16) return kTolBf16;
  if (mechanism == "ua" && name == "d_k") return kTolFp32UaDk;
  return kTolFp32;
}

struct Comparison {
  std::string name;
  bool pass = false;
  bool shape_ok = true;
  bool integer = false;
  double max_abs = 0.0;
  double relative = 0.0;
  double tol = 0.0;
  std::int64_t mismatches = 0;
  std::int64_t count = 0;
  std::string line;  // the printed line
};

inline std::string fmt_e(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.3e", v);
  return buf;
}

// Compares one result with the expected tensor of the same name (which must exist in `file`).
inline Comparison compare_tensor(const io::SafetensorsFile& file, const OutTensor& out, double tol) {
  Comparison c;
  c.name = out.name;
  c.integer = out.integer;
  c.tol = out.integer ? 0.0 : tol;
  const io::TensorInfo* info = file.find(out.name);
  const std::string tol_text = out.integer ? "exact" : fmt_e(tol);
  char head[96];
  std::snprintf(head, sizeof head, "%-18s", out.name.c_str());
  if (info->shape != out.shape) {
    c.shape_ok = false;
    c.line = std::string(head) + " shape " + shape_text(out.shape) + " != expected " + shape_text(info->shape) +
             "  tol " + tol_text + "  FAIL";
    return c;
  }
  // Expected values as double: exact for every int64 that an index or a count can take.
  std::vector<double> ref;
  switch (info->dtype) {
    case io::DType::kF64:
    case io::DType::kF32:
    case io::DType::kF16:
    case io::DType::kBF16: {
      if (!file.read(out.name, ref).is_ok()) ref.clear();
      break;
    }
    default: {
      std::vector<std::int64_t> iv;
      if (file.read(out.name, iv).is_ok()) ref.assign(iv.begin(), iv.end());
      break;
    }
  }
  double max_abs = 0.0, scale = 1.0;
  const std::size_t n = ref.size();
  c.count = static_cast<std::int64_t>(n);
  for (std::size_t k = 0; k < n; ++k) {
    const double x = out.integer ? static_cast<double>(out.i[k]) : out.f[k];
    const double r = ref[k];
    double diff = std::abs(x - r);
    if (std::isnan(x) && std::isnan(r))
      diff = 0.0;  // NaN where NaN is expected
    else if (std::isnan(diff))
      diff = std::numeric_limits<double>::infinity();  // NaN/inf where a number is
    if (diff != 0.0) ++c.mismatches;
    max_abs = std::max(max_abs, diff);
    if (std::isfinite(r)) scale = std::max(scale, std::abs(r));
  }
  c.max_abs = max_abs;
  c.relative = max_abs / scale;
  c.pass = out.integer ? c.mismatches == 0 : c.relative <= tol;
  std::string line =
      std::string(head) + " max_abs " + fmt_e(c.max_abs) + "  rel " + fmt_e(c.relative) + "  tol " + tol_text;
  if (out.integer) line += "  mismatches " + std::to_string(c.mismatches) + "/" + std::to_string(c.count);
  c.line = line + (c.pass ? "  PASS" : "  FAIL");
  return c;
}

// Why an expected tensor of the input was not recomputed, for the SKIP line; empty when it is an
// ordinary input.
using SkipReason = std::string (*)(const std::string& name, const Case& c, Backend backend);

// Prints one line per result that has an expected tensor, then a summary. Returns the number of
// failures.
inline int compare_all(const Case& c, const Outputs& outputs, const Options& opt, SkipReason skip_reason,
                       std::FILE* sink) {
  int failed = 0, compared = 0;
  for (const auto& out : outputs.tensors()) {
    if (!c.file.has(out.name)) continue;
    const Comparison cmp = compare_tensor(c.file, out, tolerance(opt.backend, opt.precision, c.mechanism, out.name));
    std::fprintf(sink, "%s\n", cmp.line.c_str());
    ++compared;
    if (!cmp.pass) ++failed;
  }
  std::vector<std::string> skipped;
  for (const auto& t : c.file.tensors()) {
    if (outputs.find(t.name)) continue;
    const std::string why = skip_reason(t.name, c, opt.backend);
    if (!why.empty()) std::fprintf(sink, "%-18s SKIP (%s)\n", t.name.c_str(), why.c_str());
  }
  if (compared == 0)
    std::fprintf(sink, "no expected tensors in %s: nothing compared\n", c.path.c_str());
  else
    std::fprintf(sink, "%d of %d tensors pass (backend %s%s)\n", compared - failed, compared, to_string(opt.backend),
                 opt.backend == Backend::kReference ? "" : (std::string(", ") + to_string(opt.precision)).c_str());
  return failed;
}

// ---- writing --------------------------------------------------------------------------------------

inline void write_outputs(const Options& opt, const Case& c, const Outputs& outputs) {
  io::SafetensorsWriter writer;
  writer.set_metadata("mechanism", c.mechanism);
  writer.set_metadata("config", c.config.dump());
  writer.set_metadata("producer", "kvmem-replay");
  writer.set_metadata("backend", to_string(opt.backend));
  writer.set_metadata("precision", opt.backend == Backend::kReference ? "fp64" : to_string(opt.precision));
  writer.set_metadata("input", c.path);
  for (const auto& t : outputs.tensors()) {
    if (t.integer)
      writer.add(t.name, t.shape, t.i);
    else
      writer.add(t.name, t.shape, t.f);
  }
  const Status status = writer.write(opt.output);
  if (!status.is_ok()) throw BadInput(status.message());
}

// ---- backends ---------------------------------------------------------------------------------------

// The line every unavailable backend answers with (tests match its start).
inline std::string not_built(Backend b, const std::string& why) {
  return std::string("backend ") + to_string(b) + " is not built into this kvmem-replay (" + why + ")";
}

// Where the GPU backends live. kvmem-replay is compiled by the host compiler and carries Kokkos;
// kvmem-replay-cuda (kvmem_replay_cuda.cu: this same tool compiled by nvcc, built beside it when kvmem is
// configured with -DKVMEM_CUDA=ON, macro KVMEM_REPLAY_CUDA_TOOL) carries CUDA and leaves Kokkos out.
inline constexpr const char* kCudaInCudaTool = "the CUDA backend is in kvmem-replay-cuda, built beside this tool";
inline constexpr const char* kKokkosInHostTool =
    "kvmem-replay-cuda leaves Kokkos out; the Kokkos backend is in kvmem-replay";

// Why a GPU backend is absent: not configured, in the other tool, or configured but without a replay
// adapter for the mechanism (adapters for KVM and UA are in run_kvm.hpp / run_ua.hpp).
inline std::string gpu_backend_reason(Backend b, [[maybe_unused]] const std::string& mechanism) {
  if (b == Backend::kKokkos) {
#if defined(KVMEM_REPLAY_CUDA_TOOL)
    return kKokkosInHostTool;
#elif defined(KVMEM_REPLAY_WITH_KOKKOS)
    return "kvmem-replay has no Kokkos " + mechanism + " adapter in this build";
#else
    return "configure kvmem with -DKVMEM_KOKKOS=ON";
#endif
  }
#if defined(KVMEM_REPLAY_CUDA_TOOL)
  return "include/kvmem/backend/cuda/" + mechanism + ".cuh was not present when it was built";
#elif defined(KVMEM_REPLAY_WITH_CUDA)
  return kCudaInCudaTool;
#else
  return "configure kvmem with -DKVMEM_CUDA=ON, then run kvmem-replay-cuda";
#endif
}

// The adapters one mechanism's file (run_kvm.hpp, run_ua.hpp) was built with: its KVMEM_REPLAY_WITH_*
// flags, and the headers whose absence leaves the reference and host adapters out.
struct BuiltAdapters {
  bool reference, host, kokkos, cuda;
  const char* reference_header;
  const char* host_header;
};

// Why backend b cannot replay `mechanism` in this build, or "" when it can.
inline std::string unavailable_reason(Backend b, const std::string& mechanism, const BuiltAdapters& built) {
  const auto absent = [](const char* header) { return std::string(header) + " was not present when it was built"; };
  switch (b) {
    case Backend::kReference:
      return built.reference ? "" : not_built(b, absent(built.reference_header));
    case Backend::kHost:
      return built.host ? "" : not_built(b, absent(built.host_header));
    case Backend::kKokkos:
      return built.kokkos ? "" : not_built(b, gpu_backend_reason(b, mechanism));
    case Backend::kCuda:
      return built.cuda ? "" : not_built(b, gpu_backend_reason(b, mechanism));
  }
  return "";
}

}  // namespace kvmem::replay
