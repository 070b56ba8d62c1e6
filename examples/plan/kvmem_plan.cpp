// SPDX-License-Identifier: Apache-2.0
// kvmem-plan: how much KV-cache memory a model needs at a context length, for a full cache, for each
// KV Means budget (fixed 256, 16 sqrt N, saturating 1024) and for a Universal Attention page pool that
// evicts nothing. Every allocated size comes from the functions the library allocates with
// (kvm::state_layout, kvm::workspace_bytes, ua::cache_layout; plan.hpp), and a test checks that states
// created for these rows hold exactly these bytes.
//
//   kvmem-plan [--layers 32] [--q-heads 32] [--kv-heads 8] [--head-dim 128] [--value-dim D]
//              [--dtype bf16] [--context 32768] [--batch 1] [--chunk 256] [--window-chunks 2]

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "plan.hpp"

namespace {

using Options = kvmem::plan::Config;

int usage(const char* problem) {
  if (problem) std::fprintf(stderr, "kvmem-plan: %s\n", problem);
  std::fprintf(
      stderr,
      "usage: kvmem-plan [--layers L] [--q-heads Hq] [--kv-heads H] [--head-dim D] [--value-dim Dv]\n"
      "                  [--dtype bf16|fp16|fp32|fp8] [--context N] [--batch B] [--chunk C] [--window-chunks nb]\n");
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
    else if (arg == "--q-heads")
      target = &opt.q_heads;
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
  if (opt.dtype != "bf16" && opt.dtype != "fp16" && opt.dtype != "fp32" && opt.dtype != "fp8")
    return usage(("--dtype must be bf16, fp16, fp32 or fp8, got '" + opt.dtype + "'").c_str());
  if (opt.value_dim < 0) opt.value_dim = opt.head_dim;
  if (opt.q_heads % opt.kv_heads != 0) return usage("--q-heads must be a multiple of --kv-heads");
  const std::vector<kvmem::plan::Row> rows = kvmem::plan::rows(opt);
  if (rows.empty()) return usage("these parameters make no valid KV Means state (is --chunk <= 256?)");

  std::printf(
      "kvmem-plan: %lld layers x %lld KV heads (%lld query heads), head dim %lld (values %lld), %s, batch %lld, "
      "context %lld\n",
      static_cast<long long>(opt.layers), static_cast<long long>(opt.kv_heads), static_cast<long long>(opt.q_heads),
      static_cast<long long>(opt.head_dim), static_cast<long long>(opt.value_dim), opt.dtype.c_str(),
      static_cast<long long>(opt.batch), static_cast<long long>(opt.context));
  std::printf("KV Means geometry: chunk %lld, window %lld chunks (%lld exact keys)\n\n",
              static_cast<long long>(opt.chunk), static_cast<long long>(opt.window_chunks),
              static_cast<long long>(opt.chunk * opt.window_chunks));
  std::printf("%-24s %9s %12s %12s %12s %14s %9s\n", "cache", "rows", "kept", "allocated", "workspace",
              "per (seq, KVh)", "vs full");
  const double full = rows.front().state_bytes;
  for (const auto& r : rows)
    std::printf("%-24s %9lld %12s %12s %12s %14s %8.2fx\n", r.name.c_str(), static_cast<long long>(r.rows),
                human(r.kept_bytes).c_str(), human(r.state_bytes).c_str(), human(r.workspace_bytes).c_str(),
                human(r.per_item_bytes).c_str(), full / r.state_bytes);
  std::printf(
      "\nkept = bytes of what the cache holds at the context length (KVM: slot sums, radius, count in fp32,\n"
      "readout copies and window in the dtype; UA: keys, values and 16 bytes of lambda, gate logit, position\n"
      "per row; fp8: e4m3 readout copies and UA rows with an fp32 scale per row, the KVM window in bf16).\n"
      "allocated = the persistent bytes every layer allocates (kvm::state_bytes, ua::cache_layout).\n"
      "workspace = one per-step workspace for --batch rows, shared by the layers. per (seq, KVh) = allocated\n"
      "bytes per (sequence, KV head) of one layer. vs full = full KV cache bytes / allocated. A UA pool sized\n"
      "for the kept rows holds ceil(kept / 16) pages per (sequence, KV head); see docs/memory.md.\n");
  return 0;
}
