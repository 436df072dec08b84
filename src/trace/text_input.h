// Line-oriented text input for the trace importers: lines with their numbers, comma splitting and
// strict number parsing with messages that name the source, line and column. Internal to src/trace.
#pragma once

#include <cstdint>
#include <istream>
#include <string>
#include <string_view>
#include <vector>

#include "epmoe/status.h"

namespace epmoe::trace_internal {

// Reads lines from a stream, stripping "\r\n" endings; refuses lines over kMaxLineBytes (a binary
// or corrupt file read as text). Not thread-safe.
class LineReader {
 public:
  static constexpr size_t kMaxLineBytes = size_t{64} << 20;

  LineReader(std::istream& in, std::string source) : in_(in), source_(std::move(source)) {}
  // Sets *line to the next line and returns true, or false at the end of the input.
  Result<bool> Next(std::string_view* line);
  // The next non-empty line split on commas (SplitCommas) into *fields, which must number
  // `expected_fields` (the header's), else an error naming the line; false at the end of the input.
  // The fields view the line buffer: valid until the next call.
  Result<bool> NextRecord(size_t expected_fields, std::vector<std::string_view>* fields);
  int64_t line_number() const { return line_number_; }
  const std::string& source() const { return source_; }
  // "<source>:<line>: <message>" as an invalid-argument Status.
  Status Error(const std::string& message) const;

 private:
  std::istream& in_;
  std::string source_;
  std::string buffer_;
  int64_t line_number_ = 0;
};

// Splits on commas (no quoting: none of the supported CSV layouts quotes fields); trims spaces.
std::vector<std::string_view> SplitCommas(std::string_view line);

// The fields of a header line as owned strings (they outlive the line buffer).
std::vector<std::string> SplitHeader(std::string_view line);

// Whole-field parses; false when the field is not exactly a number of that type.
bool ParseInt64(std::string_view text, int64_t* value);
bool ParseDouble(std::string_view text, double* value);

// A router weight or gate score as traces store it (float); false when the value is not finite as a
// float (e.g. 1e300 parses as a finite double but overflows a float).
bool ToWeight(double value, float* weight);

}  // namespace epmoe::trace_internal
