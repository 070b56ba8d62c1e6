// SPDX-License-Identifier: Apache-2.0
#pragma once
// Sequence slots (DESIGN.md 3). A KVM state or a UA cache holds `max_slots` sequence slots, fixed at
// creation. One step takes a batch of rows: row r runs the tokens [query_start[r], query_start[r+1])
// of packed token-major inputs (q, k, v: [tokens, heads, head_dim], the layout of vLLM's
// `query_start_loc`) for the sequence held in slot[r]; slot[r] = -1 marks a padding row, which is
// skipped and whose output rows are zeroed. So one call mixes a prefill chunk of one sequence with
// single decode tokens of others.
//
// This header holds what every mechanism and backend shares: the row batch, its validation, the
// checks of slot lists for the slot operations, and the byte format of an exported slot.

#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "kvmem/core/numeric.hpp"
#include "kvmem/core/status.hpp"
#include "kvmem/core/tensor.hpp"

namespace kvmem {

namespace detail {
// "name[i]" built by appending: GCC 12 reports a false -Wrestrict for `"[" + std::to_string(i)` once
// it is inlined into a caller (GCC bug 105329), which breaks -Werror builds of users.
inline std::string indexed(const char* name, std::int64_t i) {
  std::string s(name);
  s += '[';
  s += std::to_string(i);
  s += ']';
  return s;
}
}  // namespace detail

// The rows of one step, in the backend's memory space (device pointers on a GPU backend).
//
// max_query_len is a bound, known on the host, on the tokens of every row that names a slot (vLLM's
// attention metadata carries it as `max_query_len`); 0 means unknown, and the packed token count bounds
// the rows. A GPU backend cannot read the rows without a synchronisation, so it sizes a step's launches
// (chunk phases, prefill rounds) from this bound: a prefill of a few long rows then costs what its rows
// need rather than what the packed token count allows. A padding row is not bound by it (its tokens are
// only zeroed). A step with a row that names a slot and holds more tokens is refused and changes
// nothing, on every backend.
struct Rows {
  TensorView<const std::int32_t, 1> slot;         // [rows]: slot index, or -1 for a padding row
  TensorView<const std::int32_t, 1> query_start;  // [rows + 1]: query_start[0] = 0, non-decreasing
  std::int64_t max_query_len = 0;                 // >= the tokens of every row naming a slot; 0: unknown
  [[nodiscard]] std::int64_t count() const { return slot.extent(0); }
};

// The message of a row over its step's max_query_len, shared by the backends that know the bound when
// they report it.
inline Status row_over_bound(std::int64_t row, std::int64_t tokens, std::int64_t max_query_len) {
  return invalid_argument("max_query_len",
                          "at least the tokens of every row that names a slot (row " + std::to_string(row) + ": " +
                              std::to_string(tokens) + ")",
                          max_query_len);
}

// Validates rows held in host memory against a state of `max_slots` slots and packed inputs of
// `tokens` tokens, and, when max_query_len > 0, the tokens of every row that names a slot against it
// (Rows::max_query_len). A slot may appear in at most one row of a step: its counters advance once per
// step, and two rows of one slot would race on its state.
inline Status validate_rows(const std::int32_t* slot, const std::int32_t* query_start, std::int64_t rows,
                            std::int64_t max_slots, std::int64_t tokens, std::int64_t max_query_len = 0) {
  if (rows < 0) return invalid_argument("rows", ">= 0", rows);
  if (max_query_len < 0) return invalid_argument("max_query_len", ">= 0 (0: no bound)", max_query_len);
  if (rows > 0 && (slot == nullptr || query_start == nullptr))
    return invalid_argument("slot, query_start", "non-null pointers for " + std::to_string(rows) + " rows", "nullptr");
  if (rows == 0) return tokens == 0 ? Status::ok() : invalid_argument("tokens", "0 for an empty batch", tokens);
  if (query_start[0] != 0) return invalid_argument("query_start[0]", 0, query_start[0]);
  // Steps do not allocate (DESIGN.md 3): slots seen so far in a bit set on the stack when max_slots
  // fits it, else by comparing with the earlier rows; messages are built only on failure.
  constexpr std::int64_t kBitSlots = 8192;
  std::uint64_t seen[kBitSlots / 64] = {};
  for (std::int64_t r = 0; r < rows; ++r) {
    if (query_start[r + 1] < query_start[r])
      return invalid_argument(
          "query_start" + detail::indexed("", r),
          "<= query_start[" + std::to_string(r + 1) + "] = " + std::to_string(query_start[r + 1]) + " (non-decreasing)",
          query_start[r]);
    const std::int32_t s = slot[r];
    if (s == -1) continue;
    if (s < -1 || s >= max_slots)
      return {StatusCode::kOutOfRange, "slot" + detail::indexed("", r) +
                                           ": expected -1 (padding) or 0 <= slot < max_slots = " +
                                           std::to_string(max_slots) + ", got " + std::to_string(s)};
    bool repeated = false;
    if (max_slots <= kBitSlots) {
      std::uint64_t& word = seen[s / 64];
      const std::uint64_t bit = std::uint64_t(1) << (s % 64);
      repeated = (word & bit) != 0;
      word |= bit;
    } else {
      for (std::int64_t e = 0; e < r && !repeated; ++e) repeated = slot[e] == s;
    }
    if (repeated)
      return invalid_argument("slot" + detail::indexed("", r), "a slot used by no earlier row of this step", s);
    if (max_query_len > 0 && query_start[r + 1] - query_start[r] > max_query_len)
      return row_over_bound(r, query_start[r + 1] - query_start[r], max_query_len);
  }
  if (query_start[rows] != tokens)
    return invalid_argument("query_start[" + std::to_string(rows) + "]",
                            "the packed token count " + std::to_string(tokens), query_start[rows]);
  return Status::ok();
}

inline Status validate_rows(const Rows& rows, std::int64_t max_slots, std::int64_t tokens) {
  if (rows.query_start.extent(0) != rows.count() + 1)
    return invalid_argument("query_start shape", "[rows + 1] = [" + std::to_string(rows.count() + 1) + "]",
                            shape_string(rows.query_start.extents()));
  return validate_rows(rows.slot.data(), rows.query_start.data(), rows.count(), max_slots, tokens, rows.max_query_len);
}

// Checks a list of slots for a slot operation (reset, copy): every index in [0, max_slots) and, when
// `distinct`, no index twice.
inline Status check_slot_list(const std::int32_t* slots, std::int64_t n, std::int64_t max_slots, const char* name,
                              bool distinct) {
  if (n < 0) return invalid_argument(std::string(name) + " count", ">= 0", n);
  if (n > 0 && slots == nullptr) return invalid_argument(name, "a non-null pointer", "nullptr");
  std::vector<bool> seen(static_cast<std::size_t>(max_slots > 0 ? max_slots : 0), false);
  for (std::int64_t i = 0; i < n; ++i) {
    const std::int32_t s = slots[i];
    if (s < 0 || s >= max_slots)
      return {StatusCode::kOutOfRange, detail::indexed(name, i) + ": expected 0 <= slot < max_slots = " +
                                           std::to_string(max_slots) + ", got " + std::to_string(s)};
    if (distinct && seen[static_cast<std::size_t>(s)])
      return invalid_argument(detail::indexed(name, i), "a slot listed once", s);
    seen[static_cast<std::size_t>(s)] = true;
  }
  return Status::ok();
}

// Pairs for copy_slots: sources and destinations in range, destinations distinct and none of them a
// source of another pair (a batched copy reads every source before any destination is written, so a
// destination that is also a source would make the result depend on the order).
inline Status check_copy_pairs(const std::int32_t* src, const std::int32_t* dst, std::int64_t n,
                               std::int64_t max_slots) {
  KVMEM_RETURN_IF_ERROR(check_slot_list(src, n, max_slots, "src", false));
  KVMEM_RETURN_IF_ERROR(check_slot_list(dst, n, max_slots, "dst", true));
  std::vector<bool> is_src(static_cast<std::size_t>(max_slots), false);
  for (std::int64_t i = 0; i < n; ++i) is_src[static_cast<std::size_t>(src[i])] = true;
  for (std::int64_t i = 0; i < n; ++i)
    if (is_src[static_cast<std::size_t>(dst[i])] && dst[i] != src[i])
      return invalid_argument("dst[" + std::to_string(i) + "]", "a slot that is no source of this copy", dst[i]);
  return Status::ok();
}

// ---- the exported slot: a versioned, self-describing byte record ---------------------------------
//
// Layout (all integers little-endian):
//   magic "KVMEMSLT" (8 bytes), u32 format version, u32 mechanism (1 = KVM, 2 = UA), u32 field count,
//   then the fields in order, each: u16 name length, name bytes, u8 kind, u64 element count, data.
// Kinds: 1 = i64, 2 = f64, 3 = f32 (arrays of that element type; a scalar is an array of one).
// A record holds the canonical fields only (parameters to check, counters, the state proper);
// derived copies (KVM readout rows, UA workspaces) are rebuilt by the importer. The field list of each
// mechanism is documented beside its export function.
namespace slot_record {

inline constexpr char kMagic[8] = {'K', 'V', 'M', 'E', 'M', 'S', 'L', 'T'};
inline constexpr std::uint32_t kVersion = 1;
enum class Mechanism : std::uint32_t { kKvm = 1, kUa = 2 };
enum class Kind : std::uint8_t { kI64 = 1, kF64 = 2, kF32 = 3 };

template <class T>
constexpr Kind kind_of() {
  if constexpr (std::is_same_v<T, std::int64_t>)
    return Kind::kI64;
  else if constexpr (std::is_same_v<T, double>)
    return Kind::kF64;
  else {
    static_assert(std::is_same_v<T, float>, "slot_record: fields are int64, double or float arrays");
    return Kind::kF32;
  }
}

// The storage type of keys and values as a record field ("storage"): 0 float, 1 bf16, 2 fp16, 3 fp8
// e4m3 (rows with a scale each; a record holds their values as float). Both mechanisms write it and
// refuse a record whose code differs from the importing state's.
template <class S>
constexpr std::int64_t storage_code() {
  if constexpr (std::is_same_v<S, float>)
    return 0;
  else if constexpr (std::is_same_v<S, bf16>)
    return 1;
  else if constexpr (std::is_same_v<S, fp16>)
    return 2;
  else {
    static_assert(std::is_same_v<S, e4m3>, "slot_record: storage is float, kvmem::bf16, kvmem::fp16 or kvmem::e4m3");
    return 3;
  }
}

static_assert(std::endian::native == std::endian::little, "slot_record: the byte format assumes a little-endian host");

// Writes a record into `out`; with an empty `out` it only counts the bytes (export_bytes).
class Writer {
 public:
  Writer(std::span<std::byte> out, Mechanism mechanism, std::uint32_t fields) : out_(out) {
    put(kMagic, sizeof kMagic);
    put_value(kVersion);
    put_value(static_cast<std::uint32_t>(mechanism));
    put_value(fields);
  }
  template <class T>
  void array(std::string_view name, const T* data, std::int64_t n) {
    put_value(static_cast<std::uint16_t>(name.size()));
    put(name.data(), name.size());
    put_value(static_cast<std::uint8_t>(kind_of<T>()));
    put_value(static_cast<std::uint64_t>(n));
    put(data, static_cast<std::size_t>(n) * sizeof(T));
  }
  template <class T>
  void scalar(std::string_view name, T value) {
    array(name, &value, 1);
  }
  [[nodiscard]] std::size_t size() const { return pos_; }
  // False when `out` was non-empty and too small: nothing past its end was written.
  [[nodiscard]] bool fits() const { return out_.empty() || pos_ <= out_.size(); }

 private:
  template <class T>
  void put_value(T v) {
    put(&v, sizeof v);
  }
  void put(const void* src, std::size_t n) {
    if (!out_.empty() && pos_ + n <= out_.size() && n > 0) std::memcpy(out_.data() + pos_, src, n);
    pos_ += n;
  }
  std::span<std::byte> out_;
  std::size_t pos_ = 0;
};

// Reads a record field by field, in the writer's order; every mismatch is a Status naming the field.
class Reader {
 public:
  Reader(std::span<const std::byte> in, Mechanism mechanism, std::uint32_t fields) : in_(in) {
    char magic[8] = {};
    std::uint32_t version = 0, mech = 0, count = 0;
    if (!get(magic, sizeof magic) || std::memcmp(magic, kMagic, sizeof kMagic) != 0) {
      (void)fail(invalid_argument("slot record", "bytes that start with \"KVMEMSLT\"", "another header"));
    } else if (!get_value(version) || version != kVersion) {
      (void)fail(invalid_argument("slot record version", kVersion, version));
    } else if (!get_value(mech) || mech != static_cast<std::uint32_t>(mechanism)) {
      (void)fail(invalid_argument("slot record mechanism", mechanism == Mechanism::kKvm ? "KVM (1)" : "UA (2)", mech));
    } else if (!get_value(count) || count != fields) {
      (void)fail(invalid_argument("slot record field count", fields, count));
    }
  }
  // Reads field `name` of n elements into `dst`.
  template <class T>
  Status array(std::string_view name, T* dst, std::int64_t n) {
    std::uint64_t count = 0;
    KVMEM_RETURN_IF_ERROR(header(name, kind_of<T>(), count));
    if (count != static_cast<std::uint64_t>(n))
      return fail(invalid_argument("slot record field '" + std::string(name) + "' length", n, count));
    if (!get(dst, static_cast<std::size_t>(n) * sizeof(T)))
      return fail(
          invalid_argument("slot record", "complete data of field '" + std::string(name) + "'", "a truncated record"));
    return Status::ok();
  }
  template <class T>
  Status scalar(std::string_view name, T& value) {
    return array(name, &value, 1);
  }
  // Reads a scalar and refuses the record when it differs from the importing state's value.
  template <class T>
  Status expect(std::string_view name, T expected) {
    T got{};
    KVMEM_RETURN_IF_ERROR(scalar(name, got));
    if (!(got == expected))
      return fail(invalid_argument("slot record field '" + std::string(name) + "'",
                                   "the importing state's " + to_text(expected), to_text(got)));
    return Status::ok();
  }
  // The record must end after the last field.
  Status finish() {
    KVMEM_RETURN_IF_ERROR(status_);
    if (pos_ != in_.size())
      return fail(
          invalid_argument("slot record", std::to_string(pos_) + " bytes", std::to_string(in_.size()) + " bytes"));
    return Status::ok();
  }
  [[nodiscard]] const Status& status() const { return status_; }

 private:
  template <class T>
  static std::string to_text(T v) {
    return std::to_string(v);
  }
  Status header(std::string_view name, Kind kind, std::uint64_t& count) {
    KVMEM_RETURN_IF_ERROR(status_);
    std::uint16_t len = 0;
    std::string got;
    if (get_value(len)) {
      got.resize(len);
      if (!get(got.data(), len)) got.clear();
    }
    if (got != name) return fail(invalid_argument("slot record field", "'" + std::string(name) + "'", "'" + got + "'"));
    std::uint8_t k = 0;
    if (!get_value(k) || k != static_cast<std::uint8_t>(kind))
      return fail(invalid_argument("slot record field '" + std::string(name) + "' element type", static_cast<int>(kind),
                                   static_cast<int>(k)));
    if (!get_value(count))
      return fail(
          invalid_argument("slot record", "a length for field '" + std::string(name) + "'", "a truncated record"));
    return Status::ok();
  }
  Status fail(Status s) {
    if (status_.is_ok()) status_ = s;
    return status_;
  }
  template <class T>
  bool get_value(T& v) {
    return get(&v, sizeof v);
  }
  bool get(void* dst, std::size_t n) {
    if (pos_ + n > in_.size()) return false;
    if (n > 0) std::memcpy(dst, in_.data() + pos_, n);
    pos_ += n;
    return true;
  }
  std::span<const std::byte> in_;
  std::size_t pos_ = 0;
  Status status_ = Status::ok();
};

}  // namespace slot_record
}  // namespace kvmem
