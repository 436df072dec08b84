#include "epmoe/bounded_input.h"

#include <fmt/format.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <memory>

namespace epmoe {

Result<std::string> ReadFileText(const std::string& path, int64_t max_bytes, std::string_view what) {
  std::unique_ptr<std::FILE, int (*)(std::FILE*)> file(std::fopen(path.c_str(), "rb"), &std::fclose);
  if (file == nullptr) return NotFound(fmt::format("{}: cannot open {}: {}", path, what, std::strerror(errno)));
  std::string text;
  char buffer[1 << 16];
  while (true) {
    const size_t n = std::fread(buffer, 1, sizeof(buffer), file.get());
    text.append(buffer, n);
    if (static_cast<int64_t>(text.size()) > max_bytes)
      return OutOfRange(fmt::format("{}: {} larger than {} bytes", path, what, max_bytes));
    if (n < sizeof(buffer)) break;
  }
  if (std::ferror(file.get())) return IoError(fmt::format("{}: cannot read {}: {}", path, what, std::strerror(errno)));
  return text;
}

Status CheckJsonDepth(std::string_view text, std::string_view source) {
  int depth = 0;
  bool in_string = false;
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (in_string) {
      if (c == '\\') {
        ++i;
      } else if (c == '"') {
        in_string = false;
      }
    } else if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      if (++depth > kMaxJsonDepth)
        return InvalidArgument(
            fmt::format("{}: JSON nested deeper than {} levels at byte {}", source, kMaxJsonDepth, i));
    } else if (c == ']' || c == '}') {
      --depth;
    }
  }
  return Status::Ok();
}

}  // namespace epmoe
