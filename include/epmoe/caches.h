// The size of this machine's last-level caches, for measurements that must read from memory
// rather than from cache: a buffer read to flush the caches, or to measure the memory's bandwidth,
// has to be well over it. (On a server with a 300 MB L3, a 128 MB buffer measured the L3.)
#pragma once

#include <cstdint>
#include <span>
#include <string>

namespace epmoe {

// The bytes of the last-level caches that serve `cpus`, from a sysfs CPU directory laid out as
// Linux's /sys/devices/system/cpu (cpuN/cache/indexI/{level,type,size,shared_cpu_list}): per CPU
// its highest-level data or unified cache, each distinct cache (by its shared_cpu_list) counted
// once. 0 when the directory says nothing about them.
int64_t LastLevelCacheBytes(const std::string& cpu_directory, std::span<const int> cpus);

// The same for the CPUs this process may run on (its affinity mask), read once.
int64_t LastLevelCacheBytes();

// A size for a buffer whose reads come from memory: 4 x this machine's last-level caches (a cache
// that keeps some old lines against a streaming read still loses them), at least `at_least`.
int64_t BytesBeyondCaches(int64_t at_least);

}  // namespace epmoe
