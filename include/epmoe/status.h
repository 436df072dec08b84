// Status and Result<T>: how epmoe reports failures at its API boundaries.
//
// Functions that can fail because of their input, a file or a peer rank return Status or
// Result<T>; the message names the file, field, rank or value that is wrong. Broken internal
// invariants are not errors to report: EPMOE_CHECK aborts with file:line. Exceptions never cross the
// public API. Both types are plain values: thread-compatible (no shared state).
#pragma once

#include <cstdio>
#include <cstdlib>
#include <optional>
#include <string>
#include <utility>
#include <variant>

namespace epmoe {

enum class StatusCode {
  kOk = 0,
  kInvalidArgument,     // a flag, shape, field or value is wrong
  kNotFound,            // a file, preset or name does not exist
  kIoError,             // reading or writing failed, or a file is truncated or corrupt
  kOutOfRange,          // a size exceeds a configured bound (memory, counts)
  kFailedPrecondition,  // the call is valid but not in this state (e.g. option cannot run this shape)
  kUnavailable,         // a peer rank failed or did not answer in time
  kInternal,            // an unexpected failure of a dependency (MPI, OS)
};

const char* StatusCodeName(StatusCode code);

class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}

  static Status Ok() { return Status(); }
  bool ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }
  // "invalid argument: <message>", or "ok".
  std::string ToString() const;

  // Returns a copy whose message is "<context>: <message>".
  Status WithContext(const std::string& context) const;

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

Status InvalidArgument(std::string message);
Status NotFound(std::string message);
Status IoError(std::string message);
Status OutOfRange(std::string message);
Status FailedPrecondition(std::string message);
Status Unavailable(std::string message);
Status Internal(std::string message);

// A value or the Status that explains why there is none.
template <typename T>
class [[nodiscard]] Result {
 public:
  Result(T value) : value_(std::move(value)) {}         // NOLINT: implicit by design
  Result(Status status) : status_(std::move(status)) {  // NOLINT: implicit by design
    if (status_.ok()) status_ = Internal("Result constructed from an ok Status without a value");
  }

  bool ok() const { return value_.has_value(); }
  const Status& status() const { return status_; }
  T& value() & { return *value_; }
  const T& value() const& { return *value_; }
  T&& value() && { return std::move(*value_); }
  T& operator*() & { return *value_; }
  const T& operator*() const& { return *value_; }
  T* operator->() { return &*value_; }
  const T* operator->() const { return &*value_; }

 private:
  std::optional<T> value_;
  Status status_;
};

[[noreturn]] void CheckFailed(const char* file, int line, const char* condition, const std::string& detail);

}  // namespace epmoe

// Aborts with file:line when an internal invariant does not hold (never for bad user input).
#define EPMOE_CHECK(condition)                                                  \
  do {                                                                          \
    if (!(condition)) ::epmoe::CheckFailed(__FILE__, __LINE__, #condition, ""); \
  } while (0)
#define EPMOE_CHECK_MSG(condition, detail)                                          \
  do {                                                                              \
    if (!(condition)) ::epmoe::CheckFailed(__FILE__, __LINE__, #condition, detail); \
  } while (0)

#define EPMOE_STATUS_CONCAT_INNER(a, b) a##b
#define EPMOE_STATUS_CONCAT(a, b) EPMOE_STATUS_CONCAT_INNER(a, b)

// Returns the Status from the enclosing function if `expr` is not ok.
#define EPMOE_RETURN_IF_ERROR(expr)                \
  do {                                             \
    ::epmoe::Status epmoe_status_ = (expr);        \
    if (!epmoe_status_.ok()) return epmoe_status_; \
  } while (0)

// `lhs = value of expr`, or returns its Status from the enclosing function.
#define EPMOE_ASSIGN_OR_RETURN(lhs, expr)                         \
  auto EPMOE_STATUS_CONCAT(epmoe_result_, __LINE__) = (expr);     \
  if (!EPMOE_STATUS_CONCAT(epmoe_result_, __LINE__).ok())         \
    return EPMOE_STATUS_CONCAT(epmoe_result_, __LINE__).status(); \
  lhs = std::move(EPMOE_STATUS_CONCAT(epmoe_result_, __LINE__)).value()
