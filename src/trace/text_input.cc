#include "trace/text_input.h"

#include <fmt/format.h>

#include <charconv>
#include <cmath>

namespace epmoe::trace_internal {

Result<bool> LineReader::Next(std::string_view* line) {
  buffer_.clear();
  int c;
  bool any = false;
  while ((c = in_.get()) != std::char_traits<char>::eof()) {
    any = true;
    if (c == '\n') break;
    if (buffer_.size() >= kMaxLineBytes)
      return IoError(fmt::format("{}:{}: line longer than {} bytes (not a text trace?)", source_, line_number_ + 1,
                                 kMaxLineBytes));
    buffer_.push_back(static_cast<char>(c));
  }
  if (in_.bad()) return IoError(fmt::format("{}:{}: read error", source_, line_number_ + 1));
  if (!any) return false;
  ++line_number_;
  if (!buffer_.empty() && buffer_.back() == '\r') buffer_.pop_back();
  *line = buffer_;
  return true;
}

Result<bool> LineReader::NextRecord(size_t expected_fields, std::vector<std::string_view>* fields) {
  std::string_view line;
  do {
    EPMOE_ASSIGN_OR_RETURN(bool more, Next(&line));
    if (!more) return false;
  } while (line.empty());
  *fields = SplitCommas(line);
  if (fields->size() != expected_fields)
    return Error(fmt::format("{} fields, the header has {}", fields->size(), expected_fields));
  return true;
}

Status LineReader::Error(const std::string& message) const {
  return InvalidArgument(fmt::format("{}:{}: {}", source_, line_number_, message));
}

std::vector<std::string_view> SplitCommas(std::string_view line) {
  std::vector<std::string_view> fields;
  size_t start = 0;
  while (true) {
    size_t comma = line.find(',', start);
    std::string_view field =
        line.substr(start, comma == std::string_view::npos ? std::string_view::npos : comma - start);
    while (!field.empty() && (field.front() == ' ' || field.front() == '\t')) field.remove_prefix(1);
    while (!field.empty() && (field.back() == ' ' || field.back() == '\t')) field.remove_suffix(1);
    fields.push_back(field);
    if (comma == std::string_view::npos) break;
    start = comma + 1;
  }
  return fields;
}

std::vector<std::string> SplitHeader(std::string_view line) {
  std::vector<std::string> fields;
  for (std::string_view field : SplitCommas(line)) fields.emplace_back(field);
  return fields;
}

bool ParseInt64(std::string_view text, int64_t* value) {
  if (text.empty()) return false;
  if (text.front() == '+') text.remove_prefix(1);
  const char* end = text.data() + text.size();
  auto [ptr, ec] = std::from_chars(text.data(), end, *value);
  return ec == std::errc() && ptr == end;
}

bool ParseDouble(std::string_view text, double* value) {
  if (text.empty()) return false;
  if (text.front() == '+') text.remove_prefix(1);
  const char* end = text.data() + text.size();
  auto [ptr, ec] = std::from_chars(text.data(), end, *value);
  return ec == std::errc() && ptr == end && std::isfinite(*value);
}

bool ToWeight(double value, float* weight) {
  *weight = static_cast<float>(value);
  return std::isfinite(*weight);
}

}  // namespace epmoe::trace_internal
