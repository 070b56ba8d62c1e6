// SPDX-License-Identifier: Apache-2.0
// kvmem-replay: run a KVM or UA case stored as safetensors through one kvmem backend, write the
// results, and compare them with the expected tensors the file holds. See --help (replay_core.hpp).
//
// Exit status: 0 pass (or nothing to compare), 1 some tensor fails, 2 bad input or options. Every
// error is one line on stderr; nothing is written unless the whole run succeeded.

#include <cstdio>
#include <exception>
#include <new>
#include <optional>
#include <string>
#include <vector>

#include "replay_core.hpp"
#include "run_kvm.hpp"
#include "run_ua.hpp"
#include "trace.hpp"

namespace {

using kvmem::replay::BadInput;

// One entry per mechanism: adding one means writing its adapter and a line here.
struct Mechanism {
  const char* name;
  void (*run)(const kvmem::replay::Options&, const kvmem::replay::Case&, kvmem::replay::Outputs&);
  kvmem::replay::SkipReason skip_reason;
  kvmem::replay::trace::Mechanism (*trace)(const kvmem::replay::Options&, const kvmem::replay::Case&,
                                           const kvmem::replay::trace::Trace&);
};
constexpr Mechanism kMechanisms[] = {
    {"kvm", kvmem::replay::kvm_adapter::run, kvmem::replay::kvm_adapter::skip_reason,
     kvmem::replay::kvm_adapter::trace_mechanism},
    {"ua", kvmem::replay::ua_adapter::run, kvmem::replay::ua_adapter::skip_reason,
     kvmem::replay::ua_adapter::trace_mechanism},
};

int error(const std::string& message) {
  // One line: messages never contain a newline of their own.
  std::string line = message;
  for (char& c : line)
    if (c == '\n' || c == '\r') c = ' ';
  std::fprintf(stderr, "kvmem-replay: error: %s\n", line.c_str());
  return 2;
}

// --trace: the trace is parsed and checked first, then the inputs file is loaded (it needs no kvmem
// metadata), the schedule played, the outputs written, and with --check every sequence compared.
int replay_trace(const kvmem::replay::Options& opt) {
  namespace trace = kvmem::replay::trace;
  const trace::Trace t = trace::load_trace(opt.trace_path);
  kvmem::replay::Case inputs;
  inputs.path = opt.input;
  const kvmem::Status status = kvmem::io::SafetensorsFile::load(opt.input, inputs.file);
  if (!status.is_ok()) throw BadInput(status.message());
  inputs.mechanism = t.mechanism;
  inputs.config = t.config;
  const Mechanism* mechanism = nullptr;
  for (const auto& m : kMechanisms)
    if (t.mechanism == m.name) mechanism = &m;
  const trace::Mechanism m = mechanism->trace(opt, inputs, t);
  kvmem::replay::Progress progress(!opt.quiet, m.label);
  const trace::Played played = trace::play(t, m, progress, stdout);
  std::optional<trace::CheckResult> checked;
  if (opt.check) checked = trace::check(t, m, played, progress, stdout, to_string(opt.precision));
  trace::write(opt, t, m, played, checked ? &*checked : nullptr);
  if (!opt.quiet)
    std::fprintf(stderr, "kvmem-replay: [%s] %zu steps, %lld tokens, %zu sequences; wrote %s\n", m.label.c_str(),
                 t.steps.size(), static_cast<long long>(t.tokens), played.sequences.size(), opt.output.c_str());
  std::fflush(stdout);
  return (checked && checked->failed > 0) || played.expectation_failures > 0 ? 1 : 0;
}

int replay(const std::vector<std::string>& args) {
  const kvmem::replay::Options opt = kvmem::replay::parse_args(args);
  if (opt.help) {
    std::fputs(kvmem::replay::usage_text().c_str(), stdout);
    return 0;
  }
  if (!opt.trace_path.empty()) return replay_trace(opt);
  const kvmem::replay::Case c = kvmem::replay::load_case(opt);
  const Mechanism* mechanism = nullptr;
  for (const auto& m : kMechanisms)
    if (c.mechanism == m.name) mechanism = &m;
  if (mechanism == nullptr) throw BadInput(opt.input + ": unknown mechanism '" + c.mechanism + "' (known: kvm, ua)");

  kvmem::replay::Outputs outputs;
  mechanism->run(opt, c, outputs);
  kvmem::replay::write_outputs(opt, c, outputs);
  const int failed = kvmem::replay::compare_all(c, outputs, opt, mechanism->skip_reason, stdout);
  std::fflush(stdout);
  return failed > 0 ? 1 : 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return replay(std::vector<std::string>(argv + 1, argv + argc));
  } catch (const BadInput& e) {
    return error(e.what());
  } catch (const kvmem::Error& e) {
    return error(e.what());
  } catch (const std::bad_alloc&) {
    return error("out of memory (is the case larger than this machine, or is a size in the config wrong?)");
  } catch (const std::exception& e) {
    return error(e.what());
  }
}
