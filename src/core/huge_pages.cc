#include "core/huge_pages.h"

#include <sys/mman.h>

#include <algorithm>

namespace epmoe {

int64_t HugePageBytes(int64_t bytes) {
  return bytes >= kHugePageBytes / 2 ? (bytes + kHugePageBytes - 1) / kHugePageBytes * kHugePageBytes : bytes;
}

HugePageMemory AllocateHugePageMemory(int64_t bytes) {
  const int64_t allocated = HugePageBytes(bytes);
  if (allocated < kHugePageBytes)
    return HugePageMemory(static_cast<uint8_t*>(std::malloc(static_cast<size_t>(std::max<int64_t>(bytes, 1)))));
  void* memory = std::aligned_alloc(kHugePageBytes, static_cast<size_t>(allocated));
  if (memory != nullptr) (void)madvise(memory, static_cast<size_t>(allocated), MADV_HUGEPAGE);
  return HugePageMemory(static_cast<uint8_t*>(memory));
}

}  // namespace epmoe
