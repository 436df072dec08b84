#include "system_memory.h"

#include <fmt/format.h>

#include <algorithm>
#include <fstream>
#include <string>

#include "output.h"

namespace epmoe::cli {

int64_t AvailableMemoryBytes() {
  std::ifstream meminfo("/proc/meminfo");
  std::string key;
  int64_t value_kb = 0;
  std::string unit;
  while (meminfo >> key >> value_kb >> unit) {
    if (key == "MemAvailable:") return value_kb * 1024;
  }
  return 8'000'000'000LL;
}

Status CheckRowsFitInMemory(int64_t tokens, int hidden) {
  const double bytes = static_cast<double>(tokens) * hidden * sizeof(float);
  const int64_t available = AvailableMemoryBytes();
  if (bytes > static_cast<double>(available))
    return OutOfRange(
        fmt::format("--tokens {} rows of {} numbers take {} in fp32 alone, more than the {} of memory "
                    "available; use fewer --tokens",
                    tokens, hidden, HumanBytes(static_cast<int64_t>(std::min(bytes, 9e18))), HumanBytes(available)));
  return Status::Ok();
}

}  // namespace epmoe::cli
