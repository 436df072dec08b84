#include "epmoe/caches.h"

#include <algorithm>
#include <cctype>
#include <fstream>
#include <map>
#include <vector>

#include "epmoe/thread_pool.h"

namespace epmoe {
namespace {

// The first line of `path`, or "" when it cannot be read.
std::string FirstLine(const std::string& path) {
  std::ifstream in(path);
  std::string line;
  std::getline(in, line);
  return line;
}

// sysfs sizes: "32768K", "300M", or bytes; -1 when not a size.
int64_t ParseCacheSize(const std::string& text) {
  size_t digits = 0;
  while (digits < text.size() && std::isdigit(static_cast<unsigned char>(text[digits]))) ++digits;
  if (digits == 0 || digits > 15) return -1;
  int64_t value = std::stoll(text.substr(0, digits));
  const std::string unit = text.substr(digits);
  if (unit == "K") return value << 10;
  if (unit == "M") return value << 20;
  if (unit == "G") return value << 30;
  return unit.empty() ? value : -1;
}

}  // namespace

int64_t LastLevelCacheBytes(const std::string& cpu_directory, std::span<const int> cpus) {
  std::map<std::string, int64_t> caches;  // shared_cpu_list -> size, the last level's
  int last_level = 0;
  for (int cpu : cpus) {
    const std::string cache_directory = cpu_directory + "/cpu" + std::to_string(cpu) + "/cache/index";
    int level = 0;
    int64_t size = -1;
    std::string shared;
    for (int index = 0;; ++index) {
      const std::string entry = cache_directory + std::to_string(index);
      const std::string level_text = FirstLine(entry + "/level");
      if (level_text.empty()) break;
      if (FirstLine(entry + "/type") == "Instruction") continue;
      const int this_level = std::atoi(level_text.c_str());
      const int64_t this_size = ParseCacheSize(FirstLine(entry + "/size"));
      if (this_level > level && this_size > 0) {
        level = this_level;
        size = this_size;
        shared = FirstLine(entry + "/shared_cpu_list");
        if (shared.empty()) shared = "cpu" + std::to_string(cpu);
      }
    }
    if (level == 0) continue;
    // CPUs whose last level is lower (a system that describes some CPUs partly) do not count.
    if (level > last_level) {
      caches.clear();
      last_level = level;
    }
    if (level == last_level) caches[shared] = size;
  }
  int64_t total = 0;
  for (const auto& [shared, size] : caches) total += size;
  return total;
}

int64_t LastLevelCacheBytes() {
  static const int64_t bytes = LastLevelCacheBytes("/sys/devices/system/cpu", UsableCpus());
  return bytes;
}

int64_t BytesBeyondCaches(int64_t at_least) {
  return std::max(at_least, 4 * LastLevelCacheBytes());
}

}  // namespace epmoe
