// SPDX-License-Identifier: Apache-2.0
#pragma once
// kvmem-replay --trace: a recorded serving schedule played through a backend's sequence-slot API
// (docs/slots.md, docs/slots-ua.md). The trace (JSON, format in README.md) lists steps of ragged rows
// and slot operations; the inputs file holds the packed token-major inputs of every step, in order.
// Every output row (out, lse) and every exported record is written; --check runs each sequence that
// the schedule built once more alone, in a state of one slot with the same rows, and compares.
//
// This file is mechanism- and backend-neutral: the trace's parsing and validation, the bookkeeping of
// which tokens each slot's sequence holds (its lineage), the player and the check. A backend enters
// through SlotRunner (one small interface per mechanism x backend, in run_kvm.hpp / run_ua.hpp).

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <iterator>
#include <limits>
#include <map>
#include <memory>
#include <set>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "replay_core.hpp"

#include "kvmem/core/slots.hpp"

namespace kvmem::replay::trace {

inline constexpr std::int64_t kTraceVersion = 1;
// Slot counts and token counts travel as int32 in a step's rows (core/slots.hpp).
inline constexpr std::int64_t kMaxSlots = 1 << 20;
inline constexpr std::int64_t kMaxTokens = std::numeric_limits<std::int32_t>::max();

// ---- the trace ------------------------------------------------------------------------------------

enum class Op { kStep, kReset, kCopy, kExport, kImport, kTruncate };

inline const char* to_string(Op op) {
  switch (op) {
    case Op::kStep:
      return "step";
    case Op::kReset:
      return "reset";
    case Op::kCopy:
      return "copy";
    case Op::kExport:
      return "export";
    case Op::kImport:
      return "import";
    case Op::kTruncate:
      return "truncate";
  }
  return "?";
}

struct Step {
  Op op = Op::kStep;
  // step: rows (slot, tokens) with their packed offsets; first_token is where the step's tokens start
  // in the inputs (the tokens of all earlier steps come first).
  std::vector<std::int32_t> slot, query_start;
  std::int64_t first_token = 0;
  // reset: slots; copy: src -> dst
  std::vector<std::int32_t> slots, src, dst;
  // export, import, truncate
  std::int32_t one_slot = -1;
  std::string record;
  std::int64_t tokens = 0;  // truncate: how many tokens to drop
  int expect = -1;          // truncate: -1 no expectation, 1 exact, 0 refused
  std::int64_t truncate_index = -1;
};

struct Trace {
  std::string path;
  std::string mechanism;
  std::int64_t max_slots = 0;
  Json config;
  std::vector<Step> steps;
  std::int64_t tokens = 0;     // packed tokens of all steps (the inputs' first extent)
  std::int64_t truncates = 0;  // truncate steps
  std::vector<std::string> records;
};

// Reads one field of a step with a message that names the step and the field.
class StepReader {
 public:
  StepReader(const Json& j, std::string where) : j_(j), where_(std::move(where)) {}
  [[noreturn]] void fail(const std::string& field, const std::string& what) const {
    throw BadInput(where_ + ": '" + field + "' " + what);
  }
  const Json& need(const std::string& field) const {
    if (!j_.contains(field)) throw BadInput(where_ + ": missing field '" + field + "'");
    return j_.at(field);
  }
  std::int64_t integer(const Json& v, const std::string& field, std::int64_t lo, std::int64_t hi) const {
    if (!v.is_number_integer() || (v.is_number_unsigned() && v.get<std::uint64_t>() > std::uint64_t(hi)) ||
        v.get<std::int64_t>() < lo || v.get<std::int64_t>() > hi)
      fail(field, "must be an integer in [" + std::to_string(lo) + ", " + std::to_string(hi) + "], got " + v.dump());
    return v.get<std::int64_t>();
  }
  std::int64_t integer(const std::string& field, std::int64_t lo, std::int64_t hi) const {
    return integer(need(field), field, lo, hi);
  }
  std::vector<std::int32_t> slot_list(const std::string& field, std::int64_t max_slots) const {
    const Json& v = need(field);
    if (!v.is_array()) fail(field, "must be an array of slot indices, got " + v.dump());
    std::vector<std::int32_t> out;
    for (std::size_t i = 0; i < v.size(); ++i)
      out.push_back(std::int32_t(integer(v[i], field + "[" + std::to_string(i) + "]", 0, max_slots - 1)));
    return out;
  }
  std::string string(const std::string& field) const {
    const Json& v = need(field);
    if (!v.is_string() || v.get<std::string>().empty()) fail(field, "must be a non-empty string, got " + v.dump());
    return v.get<std::string>();
  }
  // Refuses fields the op does not have: a misspelt field is an error, not a silently ignored one.
  void only(std::initializer_list<const char*> fields) const {
    for (auto it = j_.begin(); it != j_.end(); ++it) {
      bool known = false;
      for (const char* f : fields) known = known || it.key() == f;
      if (!known) {
        std::string list;
        for (const char* f : fields) list += std::string(list.empty() ? "" : ", ") + f;
        throw BadInput(where_ + ": unknown field '" + it.key() + "' (this op has: " + list + ")");
      }
    }
  }
  [[nodiscard]] const std::string& where() const { return where_; }

 private:
  const Json& j_;
  std::string where_;
};

// A library Status about a step's arguments, as a BadInput naming the step.
inline void require_ok(const Status& status, const std::string& where) {
  if (!status.is_ok()) throw BadInput(where + ": " + status.message());
}

inline Step parse_step(const Json& j, const std::string& where, Trace& t) {
  if (!j.is_object()) throw BadInput(where + ": must be an object with an 'op' field, got " + j.dump());
  const StepReader r(j, where);
  const Json& op = r.need("op");
  const std::string name = op.is_string() ? op.get<std::string>() : op.dump();
  Step s;
  const std::string at = where + " (" + name + ")";
  const StepReader f(j, at);
  if (name == "step") {
    s.op = Op::kStep;
    f.only({"op", "rows"});
    const Json& rows = f.need("rows");
    if (!rows.is_array()) f.fail("rows", "must be an array of [slot, tokens] pairs, got " + rows.dump());
    s.query_start.push_back(0);
    for (std::size_t i = 0; i < rows.size(); ++i) {
      const std::string field = "rows[" + std::to_string(i) + "]";
      const Json& row = rows[i];
      if (!row.is_array() || row.size() != 2) f.fail(field, "must be a [slot, tokens] pair, got " + row.dump());
      s.slot.push_back(std::int32_t(f.integer(row[0], field + "[0] (slot)", -1, t.max_slots - 1)));
      const std::int64_t n = f.integer(row[1], field + "[1] (tokens)", 0, kMaxTokens);
      if (s.query_start.back() + n > kMaxTokens)
        f.fail(field + "[1] (tokens)", "takes the step past " + std::to_string(kMaxTokens) + " tokens");
      s.query_start.push_back(std::int32_t(s.query_start.back() + n));
    }
    // The library's own rules (one row per slot, starts): the same message a step call would give.
    require_ok(validate_rows(s.slot.data(), s.query_start.data(), std::int64_t(s.slot.size()), t.max_slots,
                             s.query_start.back()),
               at + ": rows");
    s.first_token = t.tokens;
    if (t.tokens + s.query_start.back() > kMaxExtent)
      f.fail("rows", "takes the trace past " + std::to_string(kMaxExtent) + " tokens");
    t.tokens += s.query_start.back();
  } else if (name == "reset") {
    s.op = Op::kReset;
    f.only({"op", "slots"});
    s.slots = f.slot_list("slots", t.max_slots);
    require_ok(check_slot_list(s.slots.data(), std::int64_t(s.slots.size()), t.max_slots, "slots", true), at);
  } else if (name == "copy") {
    s.op = Op::kCopy;
    f.only({"op", "src", "dst"});
    s.src = f.slot_list("src", t.max_slots);
    s.dst = f.slot_list("dst", t.max_slots);
    if (s.src.size() != s.dst.size())
      f.fail("dst", "must list as many slots as 'src' (" + std::to_string(s.src.size()) + "), got " +
                        std::to_string(s.dst.size()));
    require_ok(check_copy_pairs(s.src.data(), s.dst.data(), std::int64_t(s.src.size()), t.max_slots), at);
  } else if (name == "export") {
    s.op = Op::kExport;
    f.only({"op", "slot", "record"});
    s.one_slot = std::int32_t(f.integer("slot", 0, t.max_slots - 1));
    s.record = f.string("record");
    if (std::find(t.records.begin(), t.records.end(), s.record) != t.records.end())
      f.fail("record", "names a record an earlier export wrote: '" + s.record + "' (record names are unique)");
    t.records.push_back(s.record);
  } else if (name == "import") {
    s.op = Op::kImport;
    f.only({"op", "slot", "record"});
    s.one_slot = std::int32_t(f.integer("slot", 0, t.max_slots - 1));
    s.record = f.string("record");
    if (std::find(t.records.begin(), t.records.end(), s.record) == t.records.end())
      f.fail("record", "names no record an earlier export wrote: '" + s.record + "'");
  } else if (name == "truncate") {
    s.op = Op::kTruncate;
    f.only({"op", "slot", "tokens", "expect"});
    s.one_slot = std::int32_t(f.integer("slot", 0, t.max_slots - 1));
    s.tokens = f.integer("tokens", 0, kMaxExtent);
    if (j.contains("expect")) {
      const Json& e = j.at("expect");
      if (!e.is_string() || (e.get<std::string>() != "exact" && e.get<std::string>() != "refused"))
        f.fail("expect", "must be \"exact\" or \"refused\", got " + e.dump());
      s.expect = e.get<std::string>() == "exact" ? 1 : 0;
    }
    s.truncate_index = t.truncates++;
  } else {
    r.fail("op", "must be one of step, reset, copy, export, import, truncate; got " + op.dump());
  }
  return s;
}

// Parses and validates a trace. Everything that can be checked without running is checked here,
// so a malformed trace is refused before any state exists; each message names the step and field.
inline Trace parse_trace(const std::string& text, const std::string& path) {
  Json j = Json::parse(text, nullptr, false);
  if (j.is_discarded()) throw BadInput(path + ": not valid JSON");
  if (!j.is_object()) throw BadInput(path + ": the trace must be a JSON object");
  const StepReader r(j, path);
  r.only({"kvmem_trace", "mechanism", "max_slots", "config", "steps"});
  Trace t;
  t.path = path;
  if (r.integer("kvmem_trace", 0, std::numeric_limits<std::int64_t>::max()) != kTraceVersion)
    r.fail("kvmem_trace", "is the format version; this kvmem-replay reads version " + std::to_string(kTraceVersion) +
                              ", got " + j.at("kvmem_trace").dump());
  const Json& mechanism = r.need("mechanism");
  if (!mechanism.is_string() || (mechanism != "kvm" && mechanism != "ua"))
    r.fail("mechanism", "must be \"kvm\" or \"ua\", got " + mechanism.dump());
  t.mechanism = mechanism.get<std::string>();
  t.max_slots = r.integer("max_slots", 1, kMaxSlots);
  t.config = r.need("config");
  if (!t.config.is_object()) r.fail("config", "must be an object, got " + t.config.dump());
  const Json& steps = r.need("steps");
  if (!steps.is_array()) r.fail("steps", "must be an array, got " + steps.dump());
  for (std::size_t i = 0; i < steps.size(); ++i)
    t.steps.push_back(parse_step(steps[i], path + ": steps[" + std::to_string(i) + "]", t));
  return t;
}

inline Trace load_trace(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw BadInput("--trace " + path + ": cannot open file");
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  return parse_trace(text, path);
}

// ---- a backend -------------------------------------------------------------------------------------

// One mechanism on one backend, driven through its slot API. The runner owns its state (max_slots
// slots) and the trace's inputs (copied where the backend needs them). Buffers passed in and out are
// host memory; a device runner copies. A refused call returns the library's Status and must leave the
// state as it was (the library's rule), so the player can report it.
class SlotRunner {
 public:
  virtual ~SlotRunner() = default;
  // Rows slot[r] (-1 padding) over the inputs' tokens [first_token + query_start[r],
  // first_token + query_start[r+1]); out [tokens, out_width], lse [tokens, lse_width].
  virtual Status step(std::span<const std::int32_t> slot, std::span<const std::int32_t> query_start,
                      std::int64_t first_token, std::span<float> out, std::span<float> lse) = 0;
  virtual Status reset_slots(std::span<const std::int32_t> slots) = 0;
  virtual Status copy_slots(std::span<const std::int32_t> src, std::span<const std::int32_t> dst) = 0;
  virtual Status export_slot(std::int32_t slot, std::vector<std::byte>& record) = 0;
  virtual Status import_slot(std::int32_t slot, std::span<const std::byte> record) = 0;
  virtual Status truncate(std::int32_t slot, std::int64_t tokens) = 0;
};

// What a mechanism adapter hands the player: output widths per token and a way to make runners
// (the schedule's, with the trace's slot count, and one-slot runners for the check).
struct Mechanism {
  // What runners and inputs need alive while they exist (Kokkos' initialisation); first, so that it
  // is destroyed last.
  std::shared_ptr<void> keep_alive;
  std::string label;           // "kvm/host", for messages and progress
  std::int64_t out_width = 0;  // floats of out per token (heads x value dim)
  std::int64_t lse_width = 0;  // floats of lse per token (query heads)
  std::vector<std::int64_t> out_shape_tail, lse_shape_tail;
  double check_tolerance = 0.0;  // 0: the backend promises bitwise equality with a run alone
  std::function<std::unique_ptr<SlotRunner>(std::int64_t max_slots)> make_runner;
};

// The check's tolerance on CUDA: its kernels take their launch shapes and their split of the work from
// the batch they are given (row and token counts), and the tool does not promise that a row rounds the
// same in every batch; a row is held to the golden fp32 tolerance of its run alone, and each sequence's
// line still says whether it was bitwise equal.
inline constexpr double kCudaCheckTolerance = kTolFp32;

// Why `backend` cannot play a trace of `mechanism` in this build. Only backends with a SlotRunner in
// run_kvm.hpp / run_ua.hpp play traces (Kokkos once its headers have the slot API, CMake checks; CUDA
// in kvmem-replay-cuda); the reference has no sequence slots at all.
inline std::string trace_unavailable(Backend b, const std::string& mechanism, bool host_built) {
  switch (b) {
    case Backend::kReference:
      return "backend reference has no sequence slots: --trace runs on host (the default)";
    case Backend::kHost:
      return host_built ? "" : not_built(b, "include/kvmem/backend/host/" + mechanism + ".hpp was not present");
    case Backend::kKokkos:
#if defined(KVMEM_REPLAY_CUDA_TOOL)
      return not_built(b, kKokkosInHostTool);
#elif defined(KVMEM_REPLAY_WITH_KOKKOS)
      return not_built(b, "the Kokkos backend of this kvmem has no " + mechanism + " sequence slots");
#else
      return not_built(b, "configure kvmem with -DKVMEM_KOKKOS=ON");
#endif
    case Backend::kCuda:
#if defined(KVMEM_REPLAY_CUDA_TOOL)
      return not_built(b, "include/kvmem/backend/cuda/" + mechanism + ".cuh was not present when it was built");
#elif defined(KVMEM_REPLAY_WITH_CUDA)
      return not_built(b, kCudaInCudaTool);
#else
      return not_built(b, "configure kvmem with -DKVMEM_CUDA=ON, then run kvmem-replay-cuda");
#endif
  }
  return "";
}

// ---- lineages ---------------------------------------------------------------------------------------

// The rows a slot's sequence was built from, oldest first: (first input token, count). A fork copies
// its source's rows, an import the exported slot's rows at export time, a truncate shortens the last
// ones. A sequence "run alone" is these rows, one step each, on a state of one slot.
struct Segment {
  std::int64_t first = 0, count = 0;
};
struct Lineage {
  std::vector<Segment> rows;
  std::int64_t slot = -1;
  std::int64_t first_step = -1, last_step = -1;
  [[nodiscard]] std::int64_t tokens() const {
    std::int64_t n = 0;
    for (const auto& r : rows) n += r.count;
    return n;
  }
};

struct Played {
  std::vector<float> out, lse;
  std::map<std::string, std::vector<std::byte>> records;
  std::vector<std::int64_t> truncate_ok;
  std::vector<Lineage> sequences;  // every sequence the schedule built (ended or still in a slot)
  int expectation_failures = 0;
};

// Plays the trace. A call the backend refuses (other than a truncate, which may be refused by design)
// stops the run with a message naming the step.
inline Played play(const Trace& t, const Mechanism& m, Progress& progress, std::FILE* sink) {
  Played p;
  p.out.assign(std::size_t(t.tokens * m.out_width), 0.0f);
  p.lse.assign(std::size_t(t.tokens * m.lse_width), 0.0f);
  p.truncate_ok.assign(std::size_t(t.truncates), 0);
  auto runner = m.make_runner(t.max_slots);
  std::vector<Lineage> live(std::size_t(t.max_slots));
  std::map<std::string, Lineage> exported;
  const auto end = [&](std::int32_t slot) {  // the sequence in `slot` is complete: keep it for the check
    Lineage& l = live[std::size_t(slot)];
    if (!l.rows.empty()) p.sequences.push_back(l);
    l = Lineage{};
    l.slot = slot;
  };
  for (std::int32_t s = 0; s < t.max_slots; ++s) live[std::size_t(s)].slot = s;
  const auto refuse = [&](std::size_t i, const Status& status) {
    throw BadInput(t.path + ": steps[" + std::to_string(i) + "] (" + to_string(t.steps[i].op) + "): " + m.label +
                   " refuses it: " + status.message());
  };
  progress.phase("trace", t.tokens, [&] {
    for (std::size_t i = 0; i < t.steps.size(); ++i) {
      const Step& s = t.steps[i];
      const auto si = std::int64_t(i);
      switch (s.op) {
        case Op::kStep: {
          const std::int64_t n = s.query_start.back();
          const std::span<float> out(p.out.data() + s.first_token * m.out_width, std::size_t(n * m.out_width));
          const std::span<float> lse(p.lse.data() + s.first_token * m.lse_width, std::size_t(n * m.lse_width));
          const Status status = runner->step(s.slot, s.query_start, s.first_token, out, lse);
          if (!status.is_ok()) refuse(i, status);
          for (std::size_t r = 0; r < s.slot.size(); ++r) {
            const std::int64_t count = s.query_start[r + 1] - s.query_start[r];
            if (s.slot[r] < 0 || count == 0) continue;
            Lineage& l = live[std::size_t(s.slot[r])];
            if (l.first_step < 0) l.first_step = si;
            l.last_step = si;
            l.rows.push_back({s.first_token + s.query_start[r], count});
          }
          progress.advance(n);
          break;
        }
        case Op::kReset: {
          const Status status = runner->reset_slots(s.slots);
          if (!status.is_ok()) refuse(i, status);
          for (std::int32_t slot : s.slots) end(slot);
          break;
        }
        case Op::kCopy: {
          const Status status = runner->copy_slots(s.src, s.dst);
          if (!status.is_ok()) refuse(i, status);
          std::vector<Lineage> sources;  // a batched copy reads every source before it writes
          for (std::int32_t slot : s.src) sources.push_back(live[std::size_t(slot)]);
          for (std::size_t k = 0; k < s.dst.size(); ++k) {
            if (s.dst[k] == s.src[k]) continue;
            end(s.dst[k]);
            Lineage copy = sources[k];
            copy.slot = s.dst[k];
            live[std::size_t(s.dst[k])] = copy;
          }
          break;
        }
        case Op::kExport: {
          std::vector<std::byte> record;
          const Status status = runner->export_slot(s.one_slot, record);
          if (!status.is_ok()) refuse(i, status);
          p.records[s.record] = std::move(record);
          exported[s.record] = live[std::size_t(s.one_slot)];
          break;
        }
        case Op::kImport: {
          const Status status = runner->import_slot(s.one_slot, p.records.at(s.record));
          if (!status.is_ok()) refuse(i, status);
          end(s.one_slot);
          Lineage l = exported.at(s.record);
          l.slot = s.one_slot;
          live[std::size_t(s.one_slot)] = l;
          break;
        }
        case Op::kTruncate: {
          const Status status = runner->truncate(s.one_slot, s.tokens);
          const bool ok = status.is_ok();
          // Refusals for an argument out of range are trace errors; a refusal because the cut is not
          // exact (kInvalidArgument for KVM, kUnsupported for UA) is an outcome the trace may expect.
          if (!ok && status.code() == StatusCode::kOutOfRange) refuse(i, status);
          p.truncate_ok[std::size_t(s.truncate_index)] = ok ? 1 : 0;
          if (s.expect >= 0 && s.expect != int(ok)) {
            ++p.expectation_failures;
            std::fprintf(sink, "steps[%zu] truncate of %lld tokens in slot %d: expected %s, got %s%s  FAIL\n", i,
                         static_cast<long long>(s.tokens), s.one_slot, s.expect ? "exact" : "refused",
                         ok ? "exact" : "refused: ", ok ? "" : status.message().c_str());
          }
          if (ok && s.tokens > 0) {
            Lineage& l = live[std::size_t(s.one_slot)];
            p.sequences.push_back(l);  // its outputs up to now stay checkable
            std::int64_t drop = s.tokens;
            while (drop > 0 && !l.rows.empty()) {
              Segment& last = l.rows.back();
              const std::int64_t d = std::min(drop, last.count);
              last.count -= d;
              drop -= d;
              if (last.count == 0) l.rows.pop_back();
            }
            if (l.rows.empty()) end(s.one_slot);
          }
          break;
        }
      }
    }
  });
  for (std::int32_t s = 0; s < t.max_slots; ++s) end(s);
  return p;
}

// ---- the check: each sequence alone ------------------------------------------------------------------

struct CheckResult {
  int failed = 0;
  std::vector<std::int64_t> mismatches;  // per sequence: output values that differ (beyond tolerance)
};

// Runs every sequence alone (its rows, one step each, on a runner of one slot) and compares its outputs
// with the schedule's, token by token: bitwise when the backend promises it, else within the
// tolerance (relative to max(1, |alone|), the rule of the golden comparisons).
inline CheckResult check(const Trace& t, const Mechanism& m, const Played& p, Progress& progress, std::FILE* sink,
                         const std::string& precision) {
  CheckResult c;
  std::int64_t total = 0;
  for (const auto& l : p.sequences) total += l.tokens();
  progress.phase("check", total, [&] {
    for (std::size_t i = 0; i < p.sequences.size(); ++i) {
      const Lineage& l = p.sequences[i];
      auto runner = m.make_runner(1);
      std::int64_t diff = 0, first_bad = -1, inexact = 0;  // inexact: values not bitwise equal
      double max_abs = 0.0;
      for (const Segment& row : l.rows) {
        const std::int32_t slot[1] = {0};
        const std::int32_t starts[2] = {0, std::int32_t(row.count)};
        std::vector<float> out(std::size_t(row.count * m.out_width)), lse(std::size_t(row.count * m.lse_width));
        const Status status = runner->step(slot, starts, row.first, out, lse);
        if (!status.is_ok())
          throw BadInput(t.path + ": sequence " + std::to_string(i) + " run alone: " + m.label + " refuses a row of " +
                         std::to_string(row.count) + " tokens: " + status.message());
        const auto compare = [&](const std::vector<float>& alone, const std::vector<float>& got, std::int64_t width) {
          for (std::int64_t x = 0; x < row.count * width; ++x) {
            const float a = alone[std::size_t(x)], b = got[std::size_t(row.first * width + x)];
            const double d = std::abs(double(a) - double(b));
            const bool bitwise = std::memcmp(&a, &b, sizeof a) == 0;
            const bool same =
                m.check_tolerance == 0.0 ? bitwise : d <= m.check_tolerance * std::max(1.0, std::abs(double(a)));
            if (!bitwise) ++inexact;
            if (!same) {
              ++diff;
              if (first_bad < 0) first_bad = row.first + x / width;
              max_abs = std::max(max_abs, std::isnan(d) ? std::numeric_limits<double>::infinity() : d);
            }
          }
        };
        compare(out, p.out, m.out_width);
        compare(lse, p.lse, m.lse_width);
        progress.advance(row.count);
      }
      c.mismatches.push_back(diff);
      std::string line = "sequence " + std::to_string(i) + ": slot " + std::to_string(l.slot) + ", " +
                         std::to_string(l.tokens()) + " tokens in " + std::to_string(l.rows.size()) +
                         (l.rows.size() == 1 ? " row" : " rows");
      if (diff == 0) {
        line += inexact == 0 ? ": bitwise equal to its run alone  PASS"
                             : ": within " + fmt_e(m.check_tolerance) + " of its run alone (" +
                                   std::to_string(inexact) + " values not bitwise equal)  PASS";
      } else {
        ++c.failed;
        line += ": " + std::to_string(diff) + " values differ from its run alone (first at input token " +
                std::to_string(first_bad) + ", max_abs " + fmt_e(max_abs) + ")  FAIL";
      }
      std::fprintf(sink, "%s\n", line.c_str());
    }
  });
  std::fprintf(sink, "%zu of %zu sequences equal their run alone (%s, %s)\n",
               p.sequences.size() - std::size_t(c.failed), p.sequences.size(), m.label.c_str(), precision.c_str());
  return c;
}

// ---- writing ---------------------------------------------------------------------------------------

inline Json lineage_json(const std::vector<Lineage>& sequences) {
  Json all = Json::array();
  for (const auto& l : sequences) {
    Json rows = Json::array();
    for (const auto& r : l.rows) rows.push_back({r.first, r.count});
    all.push_back({{"slot", l.slot}, {"rows", rows}});
  }
  return all;
}

inline void write(const Options& opt, const Trace& t, const Mechanism& m, const Played& p, const CheckResult* c) {
  io::SafetensorsWriter writer;
  writer.set_metadata("producer", "kvmem-replay");
  writer.set_metadata("mechanism", t.mechanism);
  writer.set_metadata("trace", t.path);
  writer.set_metadata("input", opt.input);
  writer.set_metadata("backend", to_string(opt.backend));
  writer.set_metadata("precision", to_string(opt.precision));
  writer.set_metadata("sequences", lineage_json(p.sequences).dump());
  std::vector<std::int64_t> out_shape{t.tokens}, lse_shape{t.tokens};
  out_shape.insert(out_shape.end(), m.out_shape_tail.begin(), m.out_shape_tail.end());
  lse_shape.insert(lse_shape.end(), m.lse_shape_tail.begin(), m.lse_shape_tail.end());
  writer.add_raw("out", "F32", out_shape, p.out.data(), p.out.size() * sizeof(float));
  writer.add_raw("lse", "F32", lse_shape, p.lse.data(), p.lse.size() * sizeof(float));
  for (const auto& [name, bytes] : p.records)
    writer.add_raw("record." + name, "U8", {std::int64_t(bytes.size())}, bytes.data(), bytes.size());
  if (!p.truncate_ok.empty()) writer.add("truncate_exact", {std::int64_t(p.truncate_ok.size())}, p.truncate_ok);
  if (c != nullptr) writer.add("check_mismatches", {std::int64_t(c->mismatches.size())}, c->mismatches);
  const Status status = writer.write(opt.output);
  if (!status.is_ok()) throw BadInput(status.message());
}

}  // namespace kvmem::replay::trace
