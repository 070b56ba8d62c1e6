// SPDX-License-Identifier: Apache-2.0
// kvmem-plan: how much KV-cache memory a model needs at a context length, for a full cache and for
// each KV Means budget (fixed 256, 16 sqrt N, saturating 1024). The state sizes come from the same
// closed-form schedule the library allocates with.
//
//   kvmem-plan [--layers 32] [--kv-heads 8] [--head-dim 128] [--value-dim D] [--dtype bf16]
//              [--context 32768] [--batch 1] [--chunk 256] [--window-chunks 2]

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "kvmem/kvm/schedule.hpp"
#include "kvmem/policy/budget.hpp"

namespace {

struct Options {
  std::int64_t layers = 32, kv_heads = 8, head_dim = 128, value_dim = -1, context = 32768, batch = 1;
  std::int64_t chunk = 256, window_chunks = 2;
  std::string dtype = "bf16";
};

int usage(const char* problem) {
  if (problem) std::fprintf(stderr, "kvmem-plan: %s\n", problem);
  std::fprintf(
      stderr,
      "usage: kvmem-plan [--layers L] [--kv-heads H] [--head-dim D] [--value-dim Dv] [--dtype bf16|fp16|fp32]\n"
      "                  [--context N] [--batch B] [--chunk C] [--window-chunks nb]\n");
  return 2;
}

bool parse_int(const char* text, std::int64_t& out) {
  char* end = nullptr;
  const long long value = std::strtoll(text, &end, 10);
  if (end == text || *end != '\0' || value <= 0) return false;
  out = value;
  return true;
}

std::string human(double bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (bytes >= 1024.0 && u < 4) {
    bytes /= 1024.0;
    ++u;
  }
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.2f %s", bytes, units[u]);
  return buf;
}

}  // namespace

int main(int argc, char** argv) {
  Options opt;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "-h" || arg == "--help") return usage(nullptr), 0;
    if (i + 1 >= argc) return usage(("missing value for " + arg).c_str());
    const char* value = argv[++i];
    std::int64_t* target = nullptr;
    if (arg == "--layers")
      target = &opt.layers;
    else if (arg == "--kv-heads")
      target = &opt.kv_heads;
    else if (arg == "--head-dim")
      target = &opt.head_dim;
    else if (arg == "--value-dim")
      target = &opt.value_dim;
    else if (arg == "--context")
      target = &opt.context;
    else if (arg == "--batch")
      target = &opt.batch;
    else if (arg == "--chunk")
      target = &opt.chunk;
    else if (arg == "--window-chunks")
      target = &opt.window_chunks;
    else if (arg == "--dtype") {
      opt.dtype = value;
      continue;
    } else {
      return usage(("unknown option " + arg).c_str());
    }
    if (!parse_int(value, *target)) return usage((arg + " needs a positive integer, got '" + value + "'").c_str());
  }
  double elem = 0;
  if (opt.dtype == "bf16" || opt.dtype == "fp16")
    elem = 2;
  else if (opt.dtype == "fp32")
    elem = 4;
  else
    return usage(("--dtype must be bf16, fp16 or fp32, got '" + opt.dtype + "'").c_str());
  if (opt.value_dim < 0) opt.value_dim = opt.head_dim;

  const double heads = static_cast<double>(opt.batch * opt.layers * opt.kv_heads);
  const double row = static_cast<double>(opt.head_dim + opt.value_dim) * elem;  // one key + value
  const double full = heads * static_cast<double>(opt.context) * row;
  const kvmem::kvm::Geometry geo{opt.chunk, opt.window_chunks};
  // Per (sequence, layer, KV head): slot rows (summed key + value, storage dtype) with an fp32 radius,
  // and the window ring of exact keys/values with an fp32 merge gate per token.
  const double window_tokens = static_cast<double>(std::min(opt.context, geo.window()));
  const double window_bytes = window_tokens * (row + 4.0);

  std::printf("kvmem-plan: %lld layers x %lld KV heads, head dim %lld (values %lld), %s, batch %lld, context %lld\n",
              static_cast<long long>(opt.layers), static_cast<long long>(opt.kv_heads),
              static_cast<long long>(opt.head_dim), static_cast<long long>(opt.value_dim), opt.dtype.c_str(),
              static_cast<long long>(opt.batch), static_cast<long long>(opt.context));
  std::printf("KV Means geometry: chunk %lld, window %lld chunks (%lld exact keys)\n\n",
              static_cast<long long>(opt.chunk), static_cast<long long>(opt.window_chunks),
              static_cast<long long>(geo.window()));
  std::printf("%-26s %10s %14s %10s\n", "cache", "slots", "memory", "vs full");
  std::printf("%-26s %10lld %14s %9.2fx\n", "full KV cache", static_cast<long long>(opt.context), human(full).c_str(),
              1.0);

  struct Named {
    const char* name;
    kvmem::budget::Any budget;
  };
  const Named budgets[] = {{"KVM fixed 256", kvmem::budget::Fixed{256}},
                           {"KVM power 16*sqrt(N)", kvmem::budget::Power{16.0, 0.5, 256}},
                           {"KVM saturating 1024", kvmem::budget::Saturating{1024.0, 1}}};
  for (const auto& b : budgets) {
    const std::int64_t slots = kvmem::kvm::slots_after(b.budget, geo, opt.context);
    const double bytes = heads * (static_cast<double>(slots) * (row + 4.0) + window_bytes);
    std::printf("%-26s %10lld %14s %9.2fx\n", b.name, static_cast<long long>(slots), human(bytes).c_str(),
                full / bytes);
  }
  std::printf(
      "\n'vs full' = full-cache bytes / KVM bytes (slots + window, per-slot radius and per-token gate included).\n");
  return 0;
}
