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
#include <atomic>
#include <bit>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
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
      {"F64", DType::kF64}, {"F32", DType::kF32}, {"F16", DType::kF16}, {"BF16", DType::kBF16}, {"I64", DType::kI64},
      {"I32", DType::kI32}, {"I16", DType::kI16}, {"I8", DType::kI8},   {"U8", DType::kU8},     {"BOOL", DType::kBool}};
  for (const auto& [text, dtype] : kTable)
    if (name == text) {
      out = dtype;
      return true;
    }
  return false;
}

inline std::size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::kF64:
    case DType::kI64:
      return 8;
    case DType::kF32:
    case DType::kI32:
      return 4;
    case DType::kF16:
    case DType::kBF16:
    case DType::kI16:
      return 2;
    case DType::kI8:
    case DType::kU8:
    case DType::kBool:
      return 1;
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

inline Status io_error(const std::string& what) {
  return {StatusCode::kIoError, what};
}

class SafetensorsFile {
 public:
  // Largest header accepted; real headers are kilobytes.
  static constexpr std::uint64_t kMaxHeaderBytes = 100u << 20;

  static Status load(const std::string& path, SafetensorsFile& out) {
    std::vector<std::uint8_t> bytes;
    KVMEM_RETURN_IF_ERROR(read_file(path, bytes));
    Status status = parse(std::move(bytes), out);
    if (!status.is_ok()) return {status.code(), path + ": " + status.message()};
    return status;
  }

  // Reads only the length and the header JSON (metadata, names, dtypes, shapes) and checks every
  // tensor's offsets against the file size, without reading the data: a cheap way to inspect a large
  // file. read() on the result answers "data not loaded".
  static Status load_header(const std::string& path, SafetensorsFile& out) {
    std::uint64_t file_size = 0;
    KVMEM_RETURN_IF_ERROR(regular_file_size(path, file_size));
    std::ifstream in(path, std::ios::binary);
    if (!in) return io_error(path + ": cannot open file");
    std::vector<std::uint8_t> prefix(8, 0);
    if (file_size < 8)
      return io_error(path + ": truncated file: " + std::to_string(file_size) +
                      " bytes, the 8-byte header length is missing");
    in.read(reinterpret_cast<char*>(prefix.data()), 8);
    std::uint64_t header_len = 0;
    std::memcpy(&header_len, prefix.data(), 8);
    if (header_len <= kMaxHeaderBytes && header_len <= file_size - 8) {
      prefix.resize(8 + header_len);
      in.read(reinterpret_cast<char*>(prefix.data() + 8), static_cast<std::streamsize>(header_len));
      if (!in) return io_error(path + ": read failed");
    }
    SafetensorsFile file;
    Status status = parse_impl(std::move(prefix), file_size, file);
    if (!status.is_ok()) return {status.code(), path + ": " + status.message()};
    file.data_loaded_ = false;
    out = std::move(file);
    return Status::ok();
  }

  // Parses a complete file image. On failure `out` is unchanged.
  static Status parse(std::vector<std::uint8_t> bytes, SafetensorsFile& out) {
    const std::uint64_t size = bytes.size();
    return parse_impl(std::move(bytes), size, out);
  }

  [[nodiscard]] const std::map<std::string, std::string>& metadata() const { return metadata_; }
  [[nodiscard]] const std::vector<TensorInfo>& tensors() const { return tensors_; }
  [[nodiscard]] const TensorInfo* find(const std::string& name) const {
    for (const auto& t : tensors_)
      if (t.name == name) return &t;
    return nullptr;
  }
  [[nodiscard]] bool has(const std::string& name) const { return find(name) != nullptr; }
  // False after load_header(): names and shapes are known, the data is not.
  [[nodiscard]] bool data_loaded() const { return data_loaded_; }
  // Bytes of the data buffer that follows the header.
  [[nodiscard]] std::uint64_t data_size() const { return data_size_; }
  // Reads a floating tensor (F64, F32, F16, BF16) converted to double.
  Status read(const std::string& name, std::vector<double>& values, std::vector<std::int64_t>* shape = nullptr) const {
    const TensorInfo* info = find(name);
    if (info == nullptr) return io_error("missing tensor '" + name + "'");
    if (!data_loaded_) return io_error("tensor '" + name + "': data not loaded (header-only read)");
    const std::uint8_t* src = bytes_.data() + data_offset_ + info->begin;
    const auto n = static_cast<std::size_t>(info->numel());
    std::vector<double> result(n);
    switch (info->dtype) {
      case DType::kF64:
        copy_as<double>(src, result);
        break;
      case DType::kF32:
        copy_as<float>(src, result);
        break;
      case DType::kF16:
        convert16<fp16>(src, result);
        break;
      case DType::kBF16:
        convert16<bf16>(src, result);
        break;
      default:
        return io_error("tensor '" + name + "' has an integer dtype; a floating tensor was expected");
    }
    values = std::move(result);
    if (shape) *shape = info->shape;
    return Status::ok();
  }

  // Reads an integer or boolean tensor converted to int64.
  Status read(const std::string& name, std::vector<std::int64_t>& values,
              std::vector<std::int64_t>* shape = nullptr) const {
    const TensorInfo* info = find(name);
    if (info == nullptr) return io_error("missing tensor '" + name + "'");
    if (!data_loaded_) return io_error("tensor '" + name + "': data not loaded (header-only read)");
    const std::uint8_t* src = bytes_.data() + data_offset_ + info->begin;
    const auto n = static_cast<std::size_t>(info->numel());
    std::vector<std::int64_t> result(n);
    switch (info->dtype) {
      case DType::kI64:
        copy_as<std::int64_t>(src, result);
        break;
      case DType::kI32:
        copy_as<std::int32_t>(src, result);
        break;
      case DType::kI16:
        copy_as<std::int16_t>(src, result);
        break;
      case DType::kI8:
        copy_as<std::int8_t>(src, result);
        break;
      case DType::kU8:
      case DType::kBool:
        copy_as<std::uint8_t>(src, result);
        break;
      default:
        return io_error("tensor '" + name + "' has a floating dtype; an integer tensor was expected");
    }
    values = std::move(result);
    if (shape) *shape = info->shape;
    return Status::ok();
  }

 private:
  static constexpr int kMaxNesting = 64;

  static int nesting_depth(const char* begin, const char* end) {
    int depth = 0, deepest = 0;
    bool in_string = false;
    for (const char* p = begin; p != end; ++p) {
      const char c = *p;
      if (in_string) {
        if (c == '\\' && p + 1 != end)
          ++p;
        else if (c == '"')
          in_string = false;
      } else if (c == '"') {
        in_string = true;
      } else if (c == '{' || c == '[') {
        deepest = std::max(deepest, ++depth);
      } else if (c == '}' || c == ']') {
        --depth;
      }
    }
    return deepest;
  }

  static Status regular_file_size(const std::string& path, std::uint64_t& size) {
    std::error_code ec;
    const auto status = std::filesystem::status(path, ec);
    if (ec || !std::filesystem::exists(status)) return io_error(path + ": cannot open file (it does not exist)");
    if (!std::filesystem::is_regular_file(status)) return io_error(path + ": not a regular file");
    size = std::filesystem::file_size(path, ec);
    if (ec) return io_error(path + ": cannot determine the file size");
    return Status::ok();
  }

  // One read of the whole file (the size is known, so no incremental growth).
  static Status read_file(const std::string& path, std::vector<std::uint8_t>& bytes) {
    std::uint64_t size = 0;
    KVMEM_RETURN_IF_ERROR(regular_file_size(path, size));
    std::ifstream in(path, std::ios::binary);
    if (!in) return io_error(path + ": cannot open file");
    bytes.resize(static_cast<std::size_t>(size));
    if (size) in.read(reinterpret_cast<char*>(bytes.data()), static_cast<std::streamsize>(size));
    if (static_cast<std::uint64_t>(in.gcount()) != size && size)
      return io_error(path + ": read failed after " + std::to_string(in.gcount()) + " of " + std::to_string(size) +
                      " bytes");
    return Status::ok();
  }

  // `bytes` holds at least the length and the header (the whole file for parse(), the prefix for
  // load_header()); `file_size` is the size of the whole file, which bounds every data offset.
  static Status parse_impl(std::vector<std::uint8_t> bytes, std::uint64_t file_size, SafetensorsFile& out) {
    if (file_size < 8)
      return io_error("truncated file: " + std::to_string(file_size) + " bytes, the 8-byte header length is missing");
    std::uint64_t header_len = 0;
    std::memcpy(&header_len, bytes.data(), 8);
    if (header_len > kMaxHeaderBytes)
      return io_error("header length " + std::to_string(header_len) + " exceeds the limit of " +
                      std::to_string(kMaxHeaderBytes) + " bytes (corrupt length field?)");
    if (header_len > file_size - 8)
      return io_error("truncated file: header of " + std::to_string(header_len) + " bytes but only " +
                      std::to_string(file_size - 8) + " bytes follow the length");
    const auto* header_begin = reinterpret_cast<const char*>(bytes.data() + 8);
    const auto* header_end = header_begin + header_len;
    // nlohmann parses iteratively but dump()s recursively; a hostile header of nested brackets could
    // exhaust the stack later, so nesting is bounded before parsing (real headers nest 3 deep).
    if (nesting_depth(header_begin, header_end) > kMaxNesting)
      return io_error("header JSON is not parseable: nested deeper than " + std::to_string(kMaxNesting) + " levels");
    nlohmann::json header = nlohmann::json::parse(header_begin, header_end, nullptr, false);
    if (header.is_discarded()) return io_error("header JSON is not parseable");
    if (!header.is_object()) return io_error("header JSON is not an object");

    SafetensorsFile file;
    const std::uint64_t data_size = file_size - 8 - header_len;
    for (auto it = header.begin(); it != header.end(); ++it) {
      const std::string& name = it.key();
      const nlohmann::json& entry = it.value();
      if (name == "__metadata__") {
        if (!entry.is_object()) return io_error("__metadata__ is not an object");
        // The format asks for string values; other JSON is kept as its text rather than rejected.
        for (auto m = entry.begin(); m != entry.end(); ++m)
          file.metadata_[m.key()] = m.value().is_string()
                                        ? m.value().get<std::string>()
                                        : m.value().dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
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
    // Compare with the non-empty tensor reaching furthest so far: an empty tensor between two
    // overlapping ones must not hide the overlap.
    const TensorInfo* reach = nullptr;
    for (const TensorInfo* t : by_offset) {
      if (t->begin == t->end) continue;
      if (reach != nullptr && t->begin < reach->end)
        return io_error("tensor '" + t->name + "' overlaps tensor '" + reach->name + "'");
      if (reach == nullptr || t->end > reach->end) reach = t;
    }

    file.data_offset_ = 8 + header_len;
    file.data_size_ = data_size;
    file.bytes_ = std::move(bytes);
    out = std::move(file);
    return Status::ok();
  }

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
    if (info.begin > info.end)
      return io_error(where + "data_offsets [" + std::to_string(info.begin) + ", " + std::to_string(info.end) +
                      "] end before they begin");
    if (info.end > data_size)
      return io_error(where + "data_offsets [" + std::to_string(info.begin) + ", " + std::to_string(info.end) +
                      "] lie outside the data buffer of " + std::to_string(data_size) + " bytes (truncated file?)");
    if (info.end - info.begin != numel * dtype_size(info.dtype))
      return io_error(where + "data_offsets span " + std::to_string(info.end - info.begin) +
                      " bytes but the shape and dtype need " + std::to_string(numel * dtype_size(info.dtype)));
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
  std::uint64_t data_size_ = 0;
  bool data_loaded_ = true;
  std::vector<TensorInfo> tensors_;
  std::map<std::string, std::string> metadata_;
};

// Collects tensors and metadata, then writes them in one go. add() stores F64/I64 (what kvmem
// writes); add_raw() stores any dtype's little-endian bytes (tests build torch-style F32/BF16 files).
class SafetensorsWriter {
 public:
  void set_metadata(const std::string& key, const std::string& value) { metadata_[key] = value; }
  [[nodiscard]] std::size_t size() const { return tensors_.size(); }

  void add(const std::string& name, const std::vector<std::int64_t>& shape, const std::vector<double>& values) {
    add_raw(name, "F64", shape, values.data(), values.size() * sizeof(double));
  }
  void add(const std::string& name, const std::vector<std::int64_t>& shape, const std::vector<std::int64_t>& values) {
    add_raw(name, "I64", shape, values.data(), values.size() * sizeof(std::int64_t));
  }

  // `dtype` is a safetensors dtype name ("F32", "BF16", ...); `size` bytes are copied from `data`.
  // Consistency with the shape is checked by write(), which then writes nothing.
  void add_raw(const std::string& name, const std::string& dtype, const std::vector<std::int64_t>& shape,
               const void* data, std::size_t size) {
    Entry e{name, dtype, shape, std::vector<std::uint8_t>(size)};
    if (size) std::memcpy(e.bytes.data(), data, size);
    for (auto& existing : tensors_)
      if (existing.name == name) {
        existing = std::move(e);
        return;
      }
    tensors_.push_back(std::move(e));
  }

  // Writes `path` through a temporary file in the same folder and a rename, so readers never see a
  // partial file; an inconsistent tensor is reported before anything is written.
  Status write(const std::string& path) const {
    for (const auto& t : tensors_) KVMEM_RETURN_IF_ERROR(check(t));
    nlohmann::json header = nlohmann::json::object();
    if (!metadata_.empty()) header["__metadata__"] = metadata_;
    std::uint64_t offset = 0;
    for (const auto& t : tensors_) {
      header[t.name] = {{"dtype", t.dtype}, {"shape", t.shape}, {"data_offsets", {offset, offset + t.bytes.size()}}};
      offset += t.bytes.size();
    }
    std::string text = header.dump();
    text.append((8 - text.size() % 8) % 8, ' ');  // align the data buffer to 8 bytes
    // A per-writer name, so two writers of one path do not share a temporary file.
    const std::string temp = path + "." + unique_suffix() + ".tmp-kvmem";
    {
      std::ofstream out(temp, std::ios::binary | std::ios::trunc);
      if (!out) return io_error(path + ": cannot open for writing");
      const std::uint64_t len = text.size();
      out.write(reinterpret_cast<const char*>(&len), 8);
      out.write(text.data(), static_cast<std::streamsize>(text.size()));
      for (const auto& t : tensors_)
        out.write(reinterpret_cast<const char*>(t.bytes.data()), static_cast<std::streamsize>(t.bytes.size()));
      out.close();
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
  static Status check(const Entry& t) {
    if (t.name == "__metadata__") return io_error("a tensor cannot be named __metadata__");
    DType dtype;
    if (!parse_dtype(t.dtype, dtype)) return io_error("tensor '" + t.name + "': unknown dtype '" + t.dtype + "'");
    std::uint64_t numel = 1;
    for (auto e : t.shape) {
      if (e < 0) return io_error("tensor '" + t.name + "': negative extent in the shape");
      numel *= static_cast<std::uint64_t>(e);
    }
    if (numel * dtype_size(dtype) != t.bytes.size())
      return io_error("tensor '" + t.name + "': " + std::to_string(t.bytes.size()) + " bytes for a shape that needs " +
                      std::to_string(numel * dtype_size(dtype)));
    return Status::ok();
  }
  static std::string unique_suffix() {
    static std::atomic<unsigned> counter{0};
    const auto now = static_cast<unsigned long long>(std::chrono::steady_clock::now().time_since_epoch().count());
    return std::to_string(now) + "-" + std::to_string(counter.fetch_add(1));
  }

  std::vector<Entry> tensors_;
  std::map<std::string, std::string> metadata_;
};

}  // namespace kvmem::io
