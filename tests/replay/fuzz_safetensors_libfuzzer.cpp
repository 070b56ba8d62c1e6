// SPDX-License-Identifier: Apache-2.0
// libFuzzer target for the safetensors reader (built only with clang; see CMakeLists.txt). The same
// property as test_safetensors_fuzz.cpp: parse() either fails with a message or returns tensors that
// lie inside the data buffer and read back with the right element count. Violations trap, so the
// fuzzer keeps the input as a crash reproducer.
//
//   ./fuzz_safetensors -max_total_time=60 corpus/
#include <cstddef>
#include <cstdint>
#include <vector>

#include "kvmem/io/safetensors.hpp"

namespace {
void require(bool ok) {
  if (!ok) __builtin_trap();
}
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  std::vector<std::uint8_t> bytes(data, data + size);
  kvmem::io::SafetensorsFile file;
  const kvmem::Status status = kvmem::io::SafetensorsFile::parse(std::move(bytes), file);
  if (!status.is_ok()) {
    require(!status.message().empty());
    require(file.tensors().empty());
    return 0;
  }
  for (const auto& t : file.tensors()) {
    require(t.begin <= t.end && t.end <= file.data_size());
    require(t.end - t.begin == static_cast<std::uint64_t>(t.numel()) * kvmem::io::dtype_size(t.dtype));
    std::vector<double> f;
    std::vector<std::int64_t> i;
    const bool as_float = file.read(t.name, f).is_ok();
    const bool as_int = file.read(t.name, i).is_ok();
    require(as_float != as_int);  // exactly one family reads it
    require(static_cast<std::int64_t>(as_float ? f.size() : i.size()) == t.numel());
  }
  return 0;
}
