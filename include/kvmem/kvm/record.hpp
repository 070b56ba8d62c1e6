// SPDX-License-Identifier: Apache-2.0
#pragma once
// The slot record of a KVM sequence (core/slots.hpp format, mechanism KVM): the canonical fields of
// one sequence slot, written by export_slot and read by import_slot on every backend. The field
// list is documented beside kvm::export_slot (kvm/attention.hpp) and in docs/slots.md.
//
// These functions read and write a State in host-accessible memory (host backend; Kokkos states
// placed in host-accessible memory). A device backend stages its fields to the host in this order.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "kvmem/core/numeric.hpp"
#include "kvmem/core/slots.hpp"
#include "kvmem/core/status.hpp"
#include "kvmem/kvm/params.hpp"
#include "kvmem/kvm/state.hpp"

namespace kvmem::kvm {

namespace record_detail {

inline constexpr std::uint32_t kFields = 29;

inline std::int64_t flags_of(const Params& p) {
  return std::int64_t(p.merge_gate_keys) | std::int64_t(p.merge_gate_values) << 1 | std::int64_t(p.head_temps) << 2 |
         std::int64_t(p.value_radius) << 3 | std::int64_t(p.gate_appends) << 4 | std::int64_t(p.gate_initial) << 5;
}

// The budget as the record's seven fields (0 where a kind has no such value; a user policy, kind 3,
// keeps its fingerprint in budget_minimum).
struct BudgetFields {
  std::int64_t kind = 0, minimum = 0, maximum = 0, round_down = 0;
  double factor = 0, exponent = 0, saturation = 0;
};
inline BudgetFields budget_fields(const budget::Any& b) {
  BudgetFields f;
  switch (b.kind) {
    case budget::Any::Kind::kFixed:
      f = {0, b.fixed.count, b.fixed.maximum, 0, 0, 0, 0};
      break;
    case budget::Any::Kind::kPower:
      f = {1, b.power.minimum, b.power.maximum, b.power.round_down, b.power.factor, b.power.exponent, 0};
      break;
    case budget::Any::Kind::kSaturating:
      f = {2, b.saturating.minimum, b.saturating.maximum, b.saturating.round_down, 0, 0, b.saturating.saturation};
      break;
    case budget::Any::Kind::kUser:  // a user policy: its fingerprint (name and bytes) stands for its values
      f = {3, b.fingerprint(), 0, 0, 0, 0, 0};
      break;
  }
  return f;
}

// Writes (or, with an empty writer span, counts) the record of a slot holding n tokens, cov covered,
// `slots` memory slots; the data comes from `state` slot `b` unless `dry` (counting only).
template <class S, class A>
void write(const State<S, A>& state, std::int64_t b, std::int64_t n, std::int64_t cov, std::int64_t slots,
           slot_record::Writer& w, bool dry) {
  const Params& p = state.params();
  const Shape& sh = state.shape();
  const std::int64_t Hk = sh.Hk, D = sh.D, Dv = sh.Dv, W = p.window();
  const std::int64_t w0 = p.geometry().bswa_begin(n), held = n - w0;
  const BudgetFields bf = budget_fields(p.budget);
  w.scalar("chunk", p.chunk);
  w.scalar("window_chunks", p.window_chunks);
  w.scalar("sink", p.sink);
  w.scalar("rope_dims", p.rope_dims);
  w.scalar("budget_kind", bf.kind);
  w.scalar("budget_minimum", bf.minimum);
  w.scalar("budget_maximum", bf.maximum);
  w.scalar("budget_round_down", bf.round_down);
  w.scalar("budget_factor", bf.factor);
  w.scalar("budget_exponent", bf.exponent);
  w.scalar("budget_saturation", bf.saturation);
  w.scalar("flags", flags_of(p));
  w.scalar("ln_eps", p.ln_eps);
  w.scalar("scale", p.scale);
  w.scalar("Hq", sh.Hq);
  w.scalar("Hk", Hk);
  w.scalar("D", D);
  w.scalar("Dv", Dv);
  w.scalar("storage", slot_record::storage_code<S>());
  w.scalar("n", n);
  w.scalar("cov", cov);
  w.scalar("slots", slots);
  // The state proper, gathered over KV heads (each head's rows are contiguous in the State).
  std::vector<A> sk, sv, rho, cnt, wg;
  std::vector<float> wk, wv;
  if (!dry) {
    sk.reserve(std::size_t(Hk * slots * D));
    sv.reserve(std::size_t(Hk * slots * Dv));
    for (std::int64_t g = 0; g < Hk; ++g) {
      const auto it = state.item(b, g);
      sk.insert(sk.end(), it.sk, it.sk + slots * D);
      sv.insert(sv.end(), it.sv, it.sv + slots * Dv);
      rho.insert(rho.end(), it.rho, it.rho + slots);
      cnt.insert(cnt.end(), it.cnt, it.cnt + slots);
      for (std::int64_t t = w0; t < n; ++t) {
        const std::int64_t ring = t % W;
        for (std::int64_t d = 0; d < D; ++d) wk.push_back(load_as<float>(it.wk[ring * D + d]));
        for (std::int64_t d = 0; d < Dv; ++d) wv.push_back(load_as<float>(it.wv[ring * Dv + d]));
        wg.push_back(it.wg[ring]);
      }
    }
  }
  w.array("sk", dry ? nullptr : sk.data(), Hk * slots * D);
  w.array("sv", dry ? nullptr : sv.data(), Hk * slots * Dv);
  w.array("rho", dry ? nullptr : rho.data(), Hk * slots);
  w.array("cnt", dry ? nullptr : cnt.data(), Hk * slots);
  w.array("window_k", dry ? nullptr : wk.data(), Hk * held * D);
  w.array("window_v", dry ? nullptr : wv.data(), Hk * held * Dv);
  w.array("window_g", dry ? nullptr : wg.data(), Hk * held);
}

// A record read and checked against the importing state, before any of it is written there.
template <class A>
struct Parsed {
  std::int64_t n = 0, cov = 0, slots = 0;
  std::vector<A> sk, sv, rho, cnt, wg;
  std::vector<float> wk, wv;
};

// Name of a record's storage code (slot_record::storage_code), for messages.
inline const char* storage_name(std::int64_t code) {
  switch (code) {
    case 0:
      return "fp32";
    case 1:
      return "bf16";
    case 2:
      return "fp16";
    case 3:
      return "fp8 e4m3";
    default:
      return "an unknown storage type";
  }
}

// The record's storage type must be the state's: an fp8 state's readout copies and window (bf16) differ
// from a bf16 state's, and a record of one is not a record of the other.
template <class S>
Status check_storage(slot_record::Reader& r) {
  std::int64_t code = -1;
  KVMEM_RETURN_IF_ERROR(r.scalar("storage", code));
  const std::int64_t want = slot_record::storage_code<S>();
  if (code != want)
    return invalid_argument("slot record field 'storage'",
                            std::to_string(want) + " (" + storage_name(want) +
                                ", the importing state's storage type; a record imports only into a state of its "
                                "own storage type)",
                            std::to_string(code) + " (" + storage_name(code) + ")");
  return Status::ok();
}

template <class S, class A>
Status read(const State<S, A>& state, std::span<const std::byte> bytes, Parsed<A>& out) {
  const Params& p = state.params();
  const Shape& sh = state.shape();
  const BudgetFields bf = budget_fields(p.budget);
  slot_record::Reader r(bytes, slot_record::Mechanism::kKvm, kFields);
  KVMEM_RETURN_IF_ERROR(r.status());
  KVMEM_RETURN_IF_ERROR(r.expect("chunk", p.chunk));
  KVMEM_RETURN_IF_ERROR(r.expect("window_chunks", p.window_chunks));
  KVMEM_RETURN_IF_ERROR(r.expect("sink", p.sink));
  KVMEM_RETURN_IF_ERROR(r.expect("rope_dims", p.rope_dims));
  KVMEM_RETURN_IF_ERROR(r.expect("budget_kind", bf.kind));
  KVMEM_RETURN_IF_ERROR(r.expect("budget_minimum", bf.minimum));
  KVMEM_RETURN_IF_ERROR(r.expect("budget_maximum", bf.maximum));
  KVMEM_RETURN_IF_ERROR(r.expect("budget_round_down", bf.round_down));
  KVMEM_RETURN_IF_ERROR(r.expect("budget_factor", bf.factor));
  KVMEM_RETURN_IF_ERROR(r.expect("budget_exponent", bf.exponent));
  KVMEM_RETURN_IF_ERROR(r.expect("budget_saturation", bf.saturation));
  KVMEM_RETURN_IF_ERROR(r.expect("flags", flags_of(p)));
  KVMEM_RETURN_IF_ERROR(r.expect("ln_eps", p.ln_eps));
  KVMEM_RETURN_IF_ERROR(r.expect("scale", p.scale));
  KVMEM_RETURN_IF_ERROR(r.expect("Hq", sh.Hq));
  KVMEM_RETURN_IF_ERROR(r.expect("Hk", sh.Hk));
  KVMEM_RETURN_IF_ERROR(r.expect("D", sh.D));
  KVMEM_RETURN_IF_ERROR(r.expect("Dv", sh.Dv));
  KVMEM_RETURN_IF_ERROR(check_storage<S>(r));
  KVMEM_RETURN_IF_ERROR(r.scalar("n", out.n));
  KVMEM_RETURN_IF_ERROR(r.scalar("cov", out.cov));
  KVMEM_RETURN_IF_ERROR(r.scalar("slots", out.slots));
  // Counters: consistent with the schedule (spec 4.7, 3.1) and within this state's n_ctx and capacity.
  const Geometry geo = p.geometry();
  if (out.n < 0 || out.n > sh.n_ctx)
    return {StatusCode::kOutOfRange, "slot record field 'n': expected 0 <= n <= the importing state's n_ctx = " +
                                         std::to_string(sh.n_ctx) + ", got " + std::to_string(out.n)};
  if (out.cov != geo.covered(out.n))
    return invalid_argument("slot record field 'cov'", "covered(n) = " + std::to_string(geo.covered(out.n)), out.cov);
  if (out.slots < std::min(out.n, p.chunk) || out.slots > state.capacity())
    return invalid_argument(
        "slot record field 'slots'",
        std::to_string(std::min(out.n, p.chunk)) + " <= |S| <= capacity " + std::to_string(state.capacity()),
        out.slots);
  const std::int64_t Hk = sh.Hk, D = sh.D, Dv = sh.Dv, S_ = out.slots, held = out.n - geo.bswa_begin(out.n);
  out.sk.resize(std::size_t(Hk * S_ * D));
  out.sv.resize(std::size_t(Hk * S_ * Dv));
  out.rho.resize(std::size_t(Hk * S_));
  out.cnt.resize(std::size_t(Hk * S_));
  out.wk.resize(std::size_t(Hk * held * D));
  out.wv.resize(std::size_t(Hk * held * Dv));
  out.wg.resize(std::size_t(Hk * held));
  KVMEM_RETURN_IF_ERROR(r.array("sk", out.sk.data(), Hk * S_ * D));
  KVMEM_RETURN_IF_ERROR(r.array("sv", out.sv.data(), Hk * S_ * Dv));
  KVMEM_RETURN_IF_ERROR(r.array("rho", out.rho.data(), Hk * S_));
  KVMEM_RETURN_IF_ERROR(r.array("cnt", out.cnt.data(), Hk * S_));
  KVMEM_RETURN_IF_ERROR(r.array("window_k", out.wk.data(), Hk * held * D));
  KVMEM_RETURN_IF_ERROR(r.array("window_v", out.wv.data(), Hk * held * Dv));
  KVMEM_RETURN_IF_ERROR(r.array("window_g", out.wg.data(), Hk * held));
  KVMEM_RETURN_IF_ERROR(r.finish());
  // The window is stored in the window type (window_t<S>): a value it cannot hold exactly is not a record
  // of this state.
  using Win = window_t<S>;
  for (const float x : out.wk)
    if (load_as<float>(store_as<Win>(x)) != x)
      return invalid_argument("slot record field 'window_k'", "values exact in the state's window type", x);
  for (const float x : out.wv)
    if (load_as<float>(store_as<Win>(x)) != x)
      return invalid_argument("slot record field 'window_v'", "values exact in the state's window type", x);
  return Status::ok();
}

}  // namespace record_detail

// Bytes of the record export_slot writes for `slot` now; 0 for an empty state or a bad slot.
template <class S, class A>
std::size_t export_bytes(const State<S, A>& state, std::int32_t slot) {
  if (!state.check_slot(slot, "slot").is_ok()) return 0;
  slot_record::Writer w({}, slot_record::Mechanism::kKvm, record_detail::kFields);
  record_detail::write(state, slot, state.tokens(slot), state.covered(slot), state.slots(slot), w, true);
  return w.size();
}

// Bytes of the largest record any slot of this state can produce (full memory, full window): what
// an engine allocates once per exported slot. 0 for an empty state.
template <class S, class A>
std::size_t export_bytes(const State<S, A>& state) {
  if (!state.valid()) return 0;
  const std::int64_t W = state.params().window();
  slot_record::Writer w({}, slot_record::Mechanism::kKvm, record_detail::kFields);
  record_detail::write(state, 0, W, 0, state.capacity(), w, true);  // held = n - bswa_begin(n) <= W
  return w.size();
}

}  // namespace kvmem::kvm
