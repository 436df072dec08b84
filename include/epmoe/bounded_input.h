// Reading a user's file or JSON text within bounds: a path that names a directory, a device that
// never ends (/dev/zero) or a JSON value nested a million deep is refused with a message naming it,
// instead of an exception, unbounded memory or a stack overflow. Plain functions; thread-safe.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "epmoe/status.h"

namespace epmoe {

// The whole content of `path`. Refuses (naming the path and `what`, e.g. "placement file") a path
// that cannot be opened (NotFound), a directory or a read error (IoError), and a content longer than
// max_bytes (OutOfRange), reading at most max_bytes + 1 bytes.
Result<std::string> ReadFileText(const std::string& path, int64_t max_bytes, std::string_view what);

// Deepest nesting of arrays and objects the JSON readers accept; real files nest a few levels.
constexpr int kMaxJsonDepth = 512;

// Refuses JSON text nested deeper than kMaxJsonDepth before it is parsed (the parser's recursion
// would overflow the stack). Brackets inside strings do not count. Cheap: one pass, no allocation.
Status CheckJsonDepth(std::string_view text, std::string_view source);

}  // namespace epmoe
