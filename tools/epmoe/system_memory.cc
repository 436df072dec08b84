#include "system_memory.h"

#include <fstream>
#include <string>

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

}  // namespace epmoe::cli
