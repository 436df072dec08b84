// epmoe's binary trace format: the streamed reader (the writer is TraceWriter in trace.h).
// Internal to src/trace.
#pragma once

#include <istream>
#include <memory>
#include <string>

#include "epmoe/trace.h"

namespace epmoe::trace_internal {

inline constexpr char kTraceMagic[8] = {'E', 'P', 'M', 'O', 'E', 'T', 'R', 'C'};
inline constexpr uint32_t kTraceVersion = 1;
inline constexpr uint32_t kFlagPicks = 1;
inline constexpr uint32_t kFlagWeights = 2;
inline constexpr uint32_t kStepMagic = 0x50455453;     // "STEP" little-endian
inline constexpr uint32_t kTrailerMagic = 0x444e4554;  // "TEND" little-endian
inline constexpr int kMaxLayers = 1 << 16;
inline constexpr int kMaxExperts = 1 << 20;
inline constexpr int kMaxTopK = 1024;

// Reads the header from `in` (which the reader keeps) and returns a reader that streams the steps.
// `size` is the stream's length in bytes (bounds every allocation); `source` names it in errors.
Result<std::unique_ptr<TraceReader>> OpenBinaryTrace(std::unique_ptr<std::istream> in, int64_t size,
                                                     const std::string& source);

// True when the bytes start with the binary trace magic.
bool HasTraceMagic(const char* bytes, size_t size);

}  // namespace epmoe::trace_internal
