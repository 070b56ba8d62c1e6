// SPDX-License-Identifier: Apache-2.0
#pragma once
// A small, defensive safetensors reader and writer (the golden-vector and kvmem-replay format).
// Layout: u64 little-endian header length N, N bytes of JSON {name: {dtype, shape, data_offsets}},
// optional "__metadata__" {string: string}, then the data buffer. Every malformed input is answered
// with a Status naming the problem (truncated file, unparseable header, offsets outside the file,
// unknown dtype, size that disagrees with the shape); nothing here aborts or reads out of bounds.
// The writer writes to a temporary file and renames it, so a failed write leaves no partial output.
//
// Needs nlohmann-json (Debian: nlohmann-json3-dev); not part of the dependency-free umbrella header.

#include <algorithm>
#include <bit>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "kvmem/core/numeric.hpp"
#include "kvmem/core/status.hpp"

namespace kvmem::io {

static_assert(std::endian::native == std::endian::little, "kvmem::io::safetensors assumes a little-endian host");

enum class DType { kF64, kF32, kF16, kBF16, kI64, kI32, kI16, kI8, kU8, kBool };

inline bool parse_dtype(const std::string& name, DType& out) {
  static const std::pair<const char*, DType> kTable[] = {
      {"F64", DType::kF64}, {"F32", DType::kF32}, {"F16", DType::kF16}, {"BF16", DType::kBF16},
      {"I64", DType::kI64}, {"I32", DType::kI32}, {"I16", DType::kI16}, {"I8", DType::kI8},
      {"U8", DType::kU8},   {"BOOL", DType::kBool}};
  for (const auto& [text, dtype] : kTable)
    if (name == text) {
      out = dtype;
      return true;
    }
  return false;
}

inline std::size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::kF64: case DType::kI64: return 8;
    case DType::kF32: case DType::kI32: return 4;
    case DType::kF16: case DType::kBF16: case DType::kI16: return 2;
    case DType::kI8: case DType::kU8: case DType::kBool: return 1;
  }
  return 0;
}

struct TensorInfo {
  std::string name;
  DType dtype = DType::kF64;
  std::vector<std::int64_t> shape;
  std::uint64_t begin = 0;  // offsets into the data buffer
  std::uint64_t end = 0;

  [[nodiscard]] std::int64_t numel() const {
    std::int64_t n = 1;
    for (auto e : shape) n *= e;
    return n;
  }
};

inline Status io_error(const std::string& what) { return {StatusCode::kIoError, what}; }

class SafetensorsFile {
 public:
  // Largest header accepted; real headers are kilobytes.
  static constexpr std::uint64_t kMaxHeaderBytes = 100u << 20;

  static Status load(const std::string& path, SafetensorsFile& out) {
    std::ifstream in(path, std::ios::binary);
    if (!in) return io_error(path + ": cannot open file");
    std::vector<std::uint8_t> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    if (in.bad()) return io_error(path + ": read failed");
    Status status = parse(std::move(bytes), out);
    if (!status.is_ok()) return {status.code(), path + ": " + status.message()};
    return status;
  }

  // Parses a complete file image. On failure `out` is unchanged.
  static Status parse(std::vector<std::uint8_t> bytes, SafetensorsFile& out) {
    if (bytes.size() < 8)
      return io_error("truncated file: " + std::to_string(bytes.size()) + " bytes, the 8-byte header length is missing");
    std::uint64_t header_len = 0;
    std::memcpy(&header_len, bytes.data(), 8);
    if (header_len > kMaxHeaderBytes)
      return io_error("header length " + std::to_string(header_len) + " exceeds the limit of " +
                      std::to_string(kMaxHeaderBytes) + " bytes");
    if (header_len > bytes.size() - 8)
      return io_error("truncated file: header of " + std::to_string(header_len) + " bytes but only " +
                      std::to_string(bytes.size() - 8) + " bytes follow the length");
    const auto* header_begin = reinterpret_cast<const char*>(bytes.data() + 8);
    nlohmann::json header = nlohmann::json::parse(header_begin, header_begin + header_len, nullptr, false);
    if (header.is_discarded()) return io_error("header JSON is not parseable");
    if (!header.is_object()) return io_error("header JSON is not an object");

    SafetensorsFile file;
    const std::uint64_t data_size = bytes.size() - 8 - header_len;
    for (auto it = header.begin(); it != header.end(); ++it) {
      const std::string& name = it.key();
      const nlohmann::json& entry = it.value();
      if (name == "__metadata__") {
        if (!entry.is_object()) return io_error("__metadata__ is not an object");
        for (auto m = entry.begin(); m != entry.end(); ++m)
          file.metadata_[m.key()] = m.value().is_string() ? m.value().get<std::string>() : m.value().dump();
        continue;
      }
      TensorInfo info;
      KVMEM_RETURN_IF_ERROR(parse_entry(name, entry, data_size, info));
      file.tensors_.push_back(std::move(info));
    }
    // Tensors must not overlap (the format requires a dense, non-overlapping buffer).
    std::vector<const TensorInfo*> by_offset;
    for (const auto& t : file.tensors_) by_offset.push_back(&t);
    std::sort(by_offset.begin(), by_offset.end(), [](auto* a, auto* b) { return a->begin < b->begin; });
    for (std::size_t i = 1; i < by_offset.size(); ++i)
      if (by_offset[i]->begin < by_offset[i - 1]->end && by_offset[i]->begin != by_offset[i]->end)
        return io_error("tensor '" + by_offset[i]->name + "' overlaps tensor '" + by_offset[i - 1]->name + "'");

    file.data_offset_ = 8 + header_len;
    file.bytes_ = std::move(bytes);
    out = std::move(file);
    return Status::ok();
  }

  [[nodiscard]] const std::map<std::string, std::string>& metadata() const { return metadata_; }
  [[nodiscard]] const std::vector<TensorInfo>& tensors() const { return tensors_; }
  [[nodiscard]] const TensorInfo* find(const std::string& name) const {
    for (const auto& t : tensors_)
      if (t.name == name) return &t;
    return nullptr;
  }
  [[nodiscard]] bool has(const std::string& name) const { return find(name) != nullptr; }

  // Reads a floating tensor (F64, F32, F16, BF16) converted to double.
  Status read(const std::string& name, std::vector<double>& values, std::vector<std::int64_t>* shape = nullptr) const {
    const TensorInfo* info = find(name);
    if (info == nullptr) return io_error("missing tensor '" + name + "'");
    const std::uint8_t* src = bytes_.data() + data_offset_ + info->begin;
    const auto n = static_cast<std::size_t>(info->numel());
    std::vector<double> result(n);
    switch (info->dtype) {
      case DType::kF64: copy_as<double>(src, result); break;
      case DType::kF32: copy_as<float>(src, result); break;
      case DType::kF16: convert16<fp16>(src, result); break;
      case DType::kBF16: convert16<bf16>(src, result); break;
      default: return io_error("tensor '" + name + "' has an integer dtype; a floating tensor was expected");
    }
    values = std::move(result);
    if (shape) *shape = info->shape;
    return Status::ok();
  }

  // Reads an integer or boolean tensor converted to int64.
  Status read(const std::string& name, std::vector<std::int64_t>& values, std::vector<std::int64_t>* shape = nullptr) const {
    const TensorInfo* info = find(name);
    if (info == nullptr) return io_error("missing tensor '" + name + "'");
    const std::uint8_t* src = bytes_.data() + data_offset_ + info->begin;
    const auto n = static_cast<std::size_t>(info->numel());
    std::vector<std::int64_t> result(n);
    switch (info->dtype) {
      case DType::kI64: copy_as<std::int64_t>(src, result); break;
      case DType::kI32: copy_as<std::int32_t>(src, result); break;
      case DType::kI16: copy_as<std::int16_t>(src, result); break;
      case DType::kI8: copy_as<std::int8_t>(src, result); break;
      case DType::kU8: case DType::kBool: copy_as<std::uint8_t>(src, result); break;
      default: return io_error("tensor '" + name + "' has a floating dtype; an integer tensor was expected");
    }
    values = std::move(result);
    if (shape) *shape = info->shape;
    return Status::ok();
  }

 private:
  static Status parse_entry(const std::string& name, const nlohmann::json& entry, std::uint64_t data_size,
                            TensorInfo& info) {
    const std::string where = "tensor '" + name + "': ";
    if (!entry.is_object()) return io_error(where + "entry is not an object");
    const auto dtype = entry.find("dtype");
    if (dtype == entry.end() || !dtype->is_string()) return io_error(where + "missing dtype");
    if (!parse_dtype(dtype->get<std::string>(), info.dtype))
      return io_error(where + "unknown dtype '" + dtype->get<std::string>() + "'");
    const auto shape = entry.find("shape");
    if (shape == entry.end() || !shape->is_array()) return io_error(where + "missing shape");
    std::uint64_t numel = 1;
    for (const auto& e : *shape) {
      if (!e.is_number_unsigned()) return io_error(where + "shape entries must be non-negative integers");
      const auto extent = e.get<std::uint64_t>();
      if (extent > (1ull << 40) || (extent != 0 && numel > (1ull << 40) / extent))
        return io_error(where + "shape is too large");
      numel *= extent;
      info.shape.push_back(static_cast<std::int64_t>(extent));
    }
    const auto offsets = entry.find("data_offsets");
    if (offsets == entry.end() || !offsets->is_array() || offsets->size() != 2 || !(*offsets)[0].is_number_unsigned() ||
        !(*offsets)[1].is_number_unsigned())
      return io_error(where + "data_offsets must be [begin, end] with non-negative integers");
    info.begin = (*offsets)[0].get<std::uint64_t>();
    info.end = (*offsets)[1].get<std::uint64_t>();
    if (info.begin > info.end || info.end > data_size)
      return io_error(where + "data_offsets [" + std::to_string(info.begin) + ", " + std::to_string(info.end) +
                      "] lie outside the data buffer of " + std::to_string(data_size) + " bytes");
    if (info.end - info.begin != numel * dtype_size(info.dtype))
      return io_error(where + "data_offsets span " + std::to_string(info.end - info.begin) + " bytes but the shape and dtype need " +
                      std::to_string(numel * dtype_size(info.dtype)));
    info.name = name;
    return Status::ok();
  }

  template <class Stored, class Out>
  static void copy_as(const std::uint8_t* src, std::vector<Out>& out) {
    for (std::size_t i = 0; i < out.size(); ++i) {
      Stored value;
      std::memcpy(&value, src + i * sizeof(Stored), sizeof(Stored));
      out[i] = static_cast<Out>(value);
    }
  }
  template <class Half>
  static void convert16(const std::uint8_t* src, std::vector<double>& out) {
    for (std::size_t i = 0; i < out.size(); ++i) {
      std::uint16_t raw;
      std::memcpy(&raw, src + i * 2, 2);
      out[i] = static_cast<double>(Half::to_float(raw));
    }
  }

  std::vector<std::uint8_t> bytes_;
  std::uint64_t data_offset_ = 0;
  std::vector<TensorInfo> tensors_;
  std::map<std::string, std::string> metadata_;
};

// Collects F64/I64 tensors and metadata, then writes them in one go.
class SafetensorsWriter {
 public:
  void set_metadata(const std::string& key, const std::string& value) { metadata_[key] = value; }

  void add(const std::string& name, const std::vector<std::int64_t>& shape, const std::vector<double>& values) {
    add_raw(name, "F64", shape, values.data(), values.size() * sizeof(double));
  }
  void add(const std::string& name, const std::vector<std::int64_t>& shape, const std::vector<std::int64_t>& values) {
    add_raw(name, "I64", shape, values.data(), values.size() * sizeof(std::int64_t));
  }

  // Writes `path` through a temporary file and a rename, so readers never see a partial file.
  Status write(const std::string& path) const {
    nlohmann::json header = nlohmann::json::object();
    if (!metadata_.empty()) header["__metadata__"] = metadata_;
    std::uint64_t offset = 0;
    for (const auto& t : tensors_) {
      header[t.name] = {{"dtype", t.dtype}, {"shape", t.shape}, {"data_offsets", {offset, offset + t.bytes.size()}}};
      offset += t.bytes.size();
    }
    std::string text = header.dump();
    text.append((8 - text.size() % 8) % 8, ' ');  // align the data buffer to 8 bytes
    const std::string temp = path + ".tmp-kvmem";
    {
      std::ofstream out(temp, std::ios::binary | std::ios::trunc);
      if (!out) return io_error(path + ": cannot open for writing");
      const std::uint64_t len = text.size();
      out.write(reinterpret_cast<const char*>(&len), 8);
      out.write(text.data(), static_cast<std::streamsize>(text.size()));
      for (const auto& t : tensors_) out.write(reinterpret_cast<const char*>(t.bytes.data()), static_cast<std::streamsize>(t.bytes.size()));
      out.flush();
      if (!out) {
        std::remove(temp.c_str());
        return io_error(path + ": write failed");
      }
    }
    if (std::rename(temp.c_str(), path.c_str()) != 0) {
      std::remove(temp.c_str());
      return io_error(path + ": cannot move the finished file into place");
    }
    return Status::ok();
  }

 private:
  struct Entry {
    std::string name;
    std::string dtype;
    std::vector<std::int64_t> shape;
    std::vector<std::uint8_t> bytes;
  };
  void add_raw(const std::string& name, const char* dtype, const std::vector<std::int64_t>& shape, const void* data,
               std::size_t size) {
    Entry e{name, dtype, shape, std::vector<std::uint8_t>(size)};
    if (size) std::memcpy(e.bytes.data(), data, size);
    for (auto& existing : tensors_)
      if (existing.name == name) {
        existing = std::move(e);
        return;
      }
    tensors_.push_back(std::move(e));
  }

  std::vector<Entry> tensors_;
  std::map<std::string, std::string> metadata_;
};

}  // namespace kvmem::io
