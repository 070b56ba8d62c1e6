// SPDX-License-Identifier: Apache-2.0
#pragma once
// Status and Error: every operation validates its arguments before it touches state and reports the
// first problem as a Status whose message names the argument, the expected and the actual value.
// The throwing API wraps the same Status in kvmem::Error.

#include <initializer_list>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

namespace kvmem {

enum class StatusCode {
  kOk = 0,
  kInvalidArgument,  // a shape, value or option the caller passed is wrong
  kOutOfRange,       // an index/length beyond what a buffer or state can hold
  kUnsupported,      // a valid request this backend or build cannot run
  kBackendError,     // the device/runtime reported a failure (CUDA, Kokkos, ...)
  kIoError,          // reading/writing a file failed or a file is malformed
};

[[nodiscard]] inline const char* to_string(StatusCode code) noexcept {
  switch (code) {
    case StatusCode::kOk:
      return "ok";
    case StatusCode::kInvalidArgument:
      return "invalid argument";
    case StatusCode::kOutOfRange:
      return "out of range";
    case StatusCode::kUnsupported:
      return "unsupported";
    case StatusCode::kBackendError:
      return "backend error";
    case StatusCode::kIoError:
      return "I/O error";
  }
  return "unknown";
}

class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}

  static Status ok() { return {}; }
  [[nodiscard]] bool is_ok() const noexcept { return code_ == StatusCode::kOk; }
  explicit operator bool() const noexcept { return is_ok(); }
  [[nodiscard]] StatusCode code() const noexcept { return code_; }
  [[nodiscard]] const std::string& message() const noexcept { return message_; }
  [[nodiscard]] std::string to_string() const {
    return is_ok() ? std::string("ok") : std::string(kvmem::to_string(code_)) + ": " + message_;
  }

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

// Exception used by the throwing convenience API; carries the Status unchanged.
class Error : public std::runtime_error {
 public:
  explicit Error(Status status) : std::runtime_error(status.to_string()), status_(std::move(status)) {}
  [[nodiscard]] const Status& status() const noexcept { return status_; }

 private:
  Status status_;
};

// Throws kvmem::Error when `status` is not ok; returns otherwise.
inline void throw_if_error(const Status& status) {
  if (!status.is_ok()) throw Error(status);
}

namespace detail {
template <class... Parts>
std::string concat(const Parts&... parts) {
  std::ostringstream out;
  (out << ... << parts);
  return out.str();
}
}  // namespace detail

// "<argument>: expected <expected>, got <actual>" -- the one message shape every check uses.
template <class Expected, class Actual>
Status invalid_argument(const std::string& argument, const Expected& expected, const Actual& actual) {
  return {StatusCode::kInvalidArgument, detail::concat(argument, ": expected ", expected, ", got ", actual)};
}

}  // namespace kvmem

// Propagates a non-ok Status out of the enclosing function.
#define KVMEM_RETURN_IF_ERROR(expr)                   \
  do {                                                \
    ::kvmem::Status kvmem_status_ = (expr);           \
    if (!kvmem_status_.is_ok()) return kvmem_status_; \
  } while (false)
