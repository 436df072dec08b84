// Memory on 2 MiB pages (src/core/huge_pages.h): what rounding up takes, and that such memory is
// aligned to its pages and all of it usable.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>

#include "core/huge_pages.h"

namespace epmoe {
namespace {

constexpr int64_t kMiB = int64_t{1} << 20;

TEST(HugePages, OnlyBuffersOfOneMebibyteOrMoreRoundUpToWholeHugePages) {
  EXPECT_EQ(HugePageBytes(0), 0);
  EXPECT_EQ(HugePageBytes(kMiB - 1), kMiB - 1);
  EXPECT_EQ(HugePageBytes(kMiB), 2 * kMiB);
  EXPECT_EQ(HugePageBytes(2 * kMiB), 2 * kMiB);
  EXPECT_EQ(HugePageBytes(2 * kMiB + 1), 4 * kMiB);
}

TEST(HugePages, LargeMemoryIsAlignedToItsPagesAndSmallMemoryIsUsable) {
  HugePageMemory large = AllocateHugePageMemory(3 * kMiB + 5);
  ASSERT_NE(large, nullptr);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(large.get()) % kHugePageBytes, 0u);
  std::memset(large.get(), 1, static_cast<size_t>(HugePageBytes(3 * kMiB + 5)));  // all of it is usable
  HugePageMemory small = AllocateHugePageMemory(100);
  ASSERT_NE(small, nullptr);
  std::memset(small.get(), 1, 100);
  EXPECT_NE(AllocateHugePageMemory(0), nullptr);  // an empty buffer is still a buffer
}

}  // namespace
}  // namespace epmoe
