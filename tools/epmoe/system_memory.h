// What the machine can give: used to refuse runs that would not fit before allocating.
#pragma once

#include <cstdint>

#include "epmoe/status.h"

namespace epmoe::cli {

// MemAvailable from /proc/meminfo in bytes (or 8 GB when it cannot be read).
int64_t AvailableMemoryBytes();

// Refuses, before anything is allocated, `tokens` rows of `hidden` numbers whose one fp32 copy
// alone exceeds AvailableMemoryBytes() (e.g. --tokens 100000000), which would end in bad_alloc or
// the kernel's OOM kill. A plain bound; it does not admit the run's whole footprint.
Status CheckRowsFitInMemory(int64_t tokens, int hidden);

}  // namespace epmoe::cli
