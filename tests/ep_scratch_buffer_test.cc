// The executors' exchange buffers (src/ep/scratch_buffer.h): that a buffer rounds up to huge pages
// only when asked, grows only when it must, keeps what it was given, and says when its memory was
// replaced.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>

#include "ep/scratch_buffer.h"

namespace epmoe::ep_internal {
namespace {

constexpr int64_t kMiB = int64_t{1} << 20;

TEST(ScratchBuffer, HugeBuffersAreAlignedToTheirPagesAndSmallOnesExact) {
  ScratchBuffer huge;
  huge.Reserve(kMiB + 3, /*huge=*/true);
  EXPECT_EQ(huge.capacity(), 2 * kMiB);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(huge.data()) % kHugePageBytes, 0u);
  std::memset(huge.data(), 1, static_cast<size_t>(huge.capacity()));  // all of it is usable

  ScratchBuffer small;
  small.Reserve(kMiB - 1, /*huge=*/true);  // under 1 MiB: never rounded
  EXPECT_EQ(small.capacity(), kMiB - 1);
  ScratchBuffer exact;
  exact.Reserve(3 * kMiB, /*huge=*/false);
  EXPECT_EQ(exact.capacity(), 3 * kMiB);
}

TEST(ScratchBuffer, GrowsOnlyWhenItMustAndCountsReplacements) {
  ScratchBuffer b;
  b.Reserve(1000, false);
  const int64_t first = b.generation();
  std::memset(b.data(), 7, 1000);
  b.Reserve(500, true);  // fits: kept, contents too
  EXPECT_EQ(b.capacity(), 1000);
  EXPECT_EQ(b.generation(), first);
  EXPECT_EQ(b.data()[999], 7);
  b.ShrinkTo(1000);  // not more than asked: kept
  EXPECT_EQ(b.generation(), first);
  b.ShrinkTo(999);
  EXPECT_EQ(b.capacity(), 0);
  EXPECT_NE(b.generation(), first);
  b.Reserve(2000, false);
  EXPECT_EQ(b.capacity(), 2000);
}

}  // namespace
}  // namespace epmoe::ep_internal
