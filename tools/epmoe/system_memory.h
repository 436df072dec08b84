// What the machine can give: used to refuse runs that would not fit before allocating.
#pragma once

#include <cstdint>

namespace epmoe::cli {

// MemAvailable from /proc/meminfo in bytes (or 8 GB when it cannot be read).
int64_t AvailableMemoryBytes();

}  // namespace epmoe::cli
